//! Generations: every write between the tiers carries the generation it was
//! decided at and applies only over an older one. Each interleaving that used
//! to decide a token's state by arrival order is made here on purpose (a
//! stale marker restored after a release, journal entries out of order or
//! unreadable, markers past the retention), with the V4 migration run on a
//! populated database and the journal's apply rule checked against its model
//! on a real Postgres.

use std::collections::BTreeMap;

use chrono::{DateTime, TimeZone, Utc};
use idempotency_ledger::durable::journal::{self, Decided, Entry, EntryKind, Versioned};
use idempotency_ledger::durable::tokens::TokenRecord;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::{PgPool, Row};

use crate::helpers::*;

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// `POST /v1/admin/reconcile` (not a dry run): the report.
async fn reconcile(app: &TestApp) -> Value {
    let r = app.post(ADMIN, "/v1/admin/reconcile", &json!({})).await;
    let (status, _, body) = answer(r).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

async fn consume(app: &TestApp, token: &str, body: Value) -> (StatusCode, bool, Value) {
    answer(app.consume(PAYMENTS, token, &body).await).await
}

async fn redis_state(app: &TestApp, token: &str) -> Option<String> {
    let mut r = app.redis().await;
    r.hget(app.token_key(token), "s").await.expect("hget")
}

// ---- the migration ------------------------------------------------------------

#[tokio::test]
async fn the_generations_migration_runs_on_a_populated_database() {
    let stores = Stores::fresh();
    let url = stores.db_url();
    idempotency_ledger::durable::setup::create_database_if_missing(&url)
        .await
        .expect("database");
    // The schema as it was before generations, with rows in every state.
    let (mut client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let task = tokio::spawn(conn);
    embedded::migrations::runner()
        .set_target(refinery::Target::Version(3))
        .run_async(&mut client)
        .await
        .expect("V1..V3");
    client
        .batch_execute(
            "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                                 state, consumed_at, result)
             VALUES (1, 'order_a', 'order', 'durable', 'u', 'payments', now(), now() + interval '1h',
                     'issued', NULL, NULL),
                    (2, 'order_b', 'order', 'durable', 'u', 'payments', now(), now() + interval '1h',
                     'consumed', now(), NULL),
                    (3, 'like_c', 'like', 'fast', 'u', 'payments', now(), now() + interval '1h',
                     'consumed', now(), '{\"ok\": true}');
             INSERT INTO audit_events (kind, token_id, token) VALUES ('token.consumed', 2, 'order_b'),
                                                                     ('token.consumed', 3, 'like_c');",
        )
        .await
        .expect("rows of the old schema");
    drop(client);
    let _ = task.await;

    let applied = idempotency_ledger::durable::setup::migrate(&url)
        .await
        .expect("V4 on a populated database");
    assert!(applied >= 1, "V4 applied");
    let pg = sqlx::PgPool::connect(&url).await.expect("pool");
    let gens: Vec<(i64, i64)> = sqlx::query_as("SELECT id, gen FROM tokens ORDER BY id")
        .fetch_all(&pg)
        .await
        .expect("gens");
    assert_eq!(gens, [(1, 0), (2, 1), (3, 1)], "issued 0, consumed 1");

    // Instances built before V4, still running while a deploy rolls over,
    // change states without writing `gen`: the parity holds for them too.
    sqlx::raw_sql(
        "UPDATE tokens SET state = 'issued', consumed_at = NULL WHERE id = 2;
         UPDATE tokens SET state = 'consumed', consumed_at = now() WHERE id = 1;",
    )
    .execute(&pg)
    .await
    .expect("old-style state changes");
    sqlx::query(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                             state, consumed_at)
         VALUES (4, 'order_d', 'order', 'durable', 'u', 'payments', now(), now() + interval '1h',
                 'consumed', now())",
    )
    .execute(&pg)
    .await
    .expect("an old-style consuming insert");
    let gens: Vec<(i64, i64)> = sqlx::query_as("SELECT id, gen FROM tokens ORDER BY id")
        .fetch_all(&pg)
        .await
        .expect("gens");
    assert_eq!(gens, [(1, 1), (2, 2), (3, 1), (4, 1)]);
    // And the database refuses a state its generation contradicts.
    let refused = sqlx::query("UPDATE tokens SET gen = 2 WHERE id = 3")
        .execute(&pg)
        .await
        .expect_err("consumed at an even generation");
    assert!(
        format!("{refused:?}").contains("tokens_gen_parity"),
        "{refused:?}"
    );
    pg.close().await;

    // The service runs on the migrated database: the token released by the
    // old-style statement is consumable again, at generation 3.
    let app = spawn_app_on(stores).await;
    let token = app.issue(PAYMENTS, "order", "u-1").await;
    let (status, _, body) = consume(&app, &token, json!({"subject": "u-1"})).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let pg = app.pg().await;
    let row = sqlx::query("SELECT gen, state::text AS state FROM tokens WHERE token = $1")
        .bind(&token)
        .fetch_one(&pg)
        .await
        .expect("row");
    assert_eq!(row.get::<i64, _>("gen"), 1);
    app.stop().await;
}

// ---- the journal against its model, on a real Postgres --------------------

fn at(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(1_795_000_000_000 + ms).unwrap()
}

/// The entries one token's decisions ship, in the order they were decided:
/// per round a consume, then either its result (the end) or a release.
fn decided(id: i64, rounds: &[bool], result_last: bool) -> Vec<Entry> {
    let record = TokenRecord {
        id,
        token: format!("like_dev1_t{id}"),
        biz_type: "like".into(),
        durability: idempotency_ledger::config::Durability::Fast,
        subject: "u-7".into(),
        client: "payments".into(),
        issued_at: at(0),
        expires_at: at(3_600_000),
    };
    let mut out = Vec::new();
    for (round, &release) in rounds.iter().enumerate() {
        let gen = 2 * round as i64 + 1;
        let consumed_at = at(1_000 * gen);
        let consumed = |result| Decided::Consumed {
            consumed_at,
            fingerprint: (round % 2 == 0).then(|| format!("sha256:{round}")),
            request_id: Some(format!("req-{round}")),
            result,
        };
        out.push(Entry {
            record: record.clone(),
            kind: EntryKind::Consume,
            at: consumed_at,
            version: Versioned {
                gen,
                state: consumed(None),
            },
        });
        let last = round + 1 == rounds.len();
        if last && result_last {
            let when = at(1_000 * gen + 400);
            out.push(Entry {
                record: record.clone(),
                kind: EntryKind::Result,
                at: when,
                version: Versioned {
                    gen,
                    state: consumed(Some((json!({"round": round, "ok": true}), when))),
                },
            });
        } else if release || !last {
            out.push(Entry {
                record: record.clone(),
                kind: EntryKind::Release,
                at: at(1_000 * gen + 500),
                version: Versioned {
                    gen: gen + 1,
                    state: Decided::Issued,
                },
            });
        }
    }
    out
}

async fn row_of(pg: &PgPool, id: i64) -> Versioned {
    let r = sqlx::query(
        "SELECT gen, state::text AS state, consumed_at, fingerprint, request_id, result, result_at
           FROM tokens WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pg)
    .await
    .expect("the token's row");
    let state: String = r.get("state");
    Versioned {
        gen: r.get("gen"),
        state: if state == "issued" {
            Decided::Issued
        } else {
            let result: Option<Value> = r.get("result");
            let result_at: Option<DateTime<Utc>> = r.get("result_at");
            Decided::Consumed {
                consumed_at: r.get("consumed_at"),
                fingerprint: r.get("fingerprint"),
                request_id: r.get("request_id"),
                result: result.zip(result_at),
            }
        },
    }
}

/// Any order, any repetition and any batching of one token's entries leaves
/// its row in the state of the last decision, with one audit row per
/// decision: the statement agrees with the rule it mirrors
/// (`journal::apply_one`) on a real Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_entries_in_any_order_and_any_batches_reach_the_last_decision() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    let handle = tokio::runtime::Handle::current();
    let strategy = (
        proptest::collection::vec(any::<bool>(), 1..4),
        any::<bool>(),
        proptest::collection::vec(1usize..3, 8),
        any::<u64>(),
        proptest::collection::vec(1usize..4, 8),
    );
    let mut runner = TestRunner::new(Config::with_cases(12));
    let next_id = std::sync::atomic::AtomicI64::new(
        9_000_000_000_000 + rand::random::<i32>().unsigned_abs() as i64,
    );
    runner
        .run(
            &strategy,
            |(rounds, result_last, repeats, seed, batches)| {
                let id = next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let history = decided(id, &rounds, result_last);
                let mut deliveries: Vec<Entry> = Vec::new();
                for (i, e) in history.iter().enumerate() {
                    for _ in 0..repeats[i % repeats.len()] {
                        deliveries.push(e.clone());
                    }
                }
                let mut state = seed | 1;
                for i in (1..deliveries.len()).rev() {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    deliveries.swap(i, (state % (i as u64 + 1)) as usize);
                }
                let model = deliveries
                    .iter()
                    .fold(None, |row, e| Some(journal::apply_one(row, &e.version)));
                let last = history.last().map(|e| e.version.clone());
                prop_assert_eq!(&model, &last, "the model reaches the last decision");
                let (row, audit) = tokio::task::block_in_place(|| {
                    handle.block_on(async {
                        let mut rest = deliveries.as_slice();
                        let mut b = 0;
                        while !rest.is_empty() {
                            let n = batches[b % batches.len()].min(rest.len());
                            b += 1;
                            journal::apply(&pg, &rest[..n])
                                .await
                                .expect("batch applies");
                            rest = &rest[n..];
                        }
                        let audit: Vec<(String, i64, i64)> = sqlx::query_as(
                            "SELECT kind::text, gen, count(*) FROM audit_events
                          WHERE token_id = $1 GROUP BY kind, gen ORDER BY gen, kind",
                        )
                        .bind(id)
                        .fetch_all(&pg)
                        .await
                        .expect("audit");
                        (row_of(&pg, id).await, audit)
                    })
                });
                prop_assert_eq!(Some(row), last, "postgres reaches the last decision");
                let mut want: BTreeMap<(i64, String), i64> = BTreeMap::new();
                for e in &history {
                    want.insert((e.version.gen, e.kind.audit_kind().to_owned()), 1);
                }
                let got: BTreeMap<(i64, String), i64> =
                    audit.into_iter().map(|(k, g, n)| ((g, k), n)).collect();
                prop_assert_eq!(got, want, "one audit row per decision");
                Ok(())
            },
        )
        .expect("property holds");
    app.stop().await;
}

// ---- a poison entry -----------------------------------------------------------

async fn metric(app: &TestApp, name: &str) -> f64 {
    app.metrics_text()
        .await
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Entries that can never apply (a result Postgres refuses, as a fast result
/// holding U+0000 used to write, and junk) are set aside with their reason
/// and counted; the entries behind them still reach Postgres.
#[tokio::test]
async fn a_poison_journal_entry_is_set_aside_and_the_journal_keeps_flowing() {
    let app = spawn_app().await;
    let mut r = app.redis().await;
    let stream = format!("{}journal", app.stores.prefix);
    let now_ms = Utc::now().timestamp_millis().to_string();
    let poison = json!(["result", 77, "{\"note\":\"nul\\u0000byte\"}"]).to_string();
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("e")
        .arg(&poison)
        .arg("at")
        .arg(&now_ms)
        .query_async(&mut r)
        .await
        .expect("xadd poison");
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("e")
        .arg("not an entry")
        .query_async(&mut r)
        .await
        .expect("xadd junk");

    // A fast consume and its result, behind them in the stream.
    let token = app.issue(PAYMENTS, "like", "u-1").await;
    let (status, _, _) = consume(&app, &token, json!({"subject": "u-1"})).await;
    assert_eq!(status, StatusCode::OK);
    let recorded = app
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{token}/result"),
            &json!({"subject": "u-1", "result": {"liked": true}}),
        )
        .await;
    assert_eq!(recorded.status(), StatusCode::OK);
    let pg = app.pg().await;
    eventually(15, || async {
        let result: Option<Value> =
            sqlx::query_scalar("SELECT result FROM tokens WHERE token = $1 AND state = 'consumed'")
                .bind(&token)
                .fetch_optional(&pg)
                .await
                .expect("query")
                .flatten();
        (result == Some(json!({"liked": true}))).then_some(())
    })
    .await;

    let dead = format!("{}journal:dead", app.stores.prefix);
    let set_aside: Vec<redis::streams::StreamId> = {
        let reply: redis::streams::StreamRangeReply =
            r.xrange_all(&dead).await.expect("xrange dead letters");
        reply.ids
    };
    assert_eq!(set_aside.len(), 2, "both set aside");
    let reasons: Vec<String> = set_aside
        .iter()
        .map(|e| e.get::<String>("reason").unwrap_or_default())
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("Unicode") || r.contains("\\u0000")),
        "{reasons:?}"
    );
    assert!(set_aside
        .iter()
        .any(|e| e.get::<String>("e") == Some(poison.clone())));
    assert_eq!(metric(&app, "ledger_journal_dead_letters_total").await, 2.0);
    let len: u64 = r.xlen(&stream).await.expect("xlen");
    assert_eq!(len, 0, "everything acknowledged");
    let report = reconcile(&app).await;
    let errors = report["errors"].to_string();
    assert!(errors.contains("journal:dead"), "{report}");
    app.stop().await;
}

// ---- a stale consumed marker ----------------------------------------------

/// A durable token consumed, released, and then its consumed marker back in
/// Redis (a failover to a replica that still held it: DUMP before the
/// release, RESTORE after). Reconcile finds it (`redis_consumed_but_live`),
/// the marker gives way to Postgres's issued state, a new consume wins, and a
/// second run finds nothing.
#[tokio::test]
async fn a_consumed_marker_restored_after_a_release_gives_way_on_reconcile() {
    let app = spawn_app().await;
    let mut r = app.redis().await;
    let token = app.issue(PAYMENTS, "order", "u-1").await;
    let key = app.token_key(&token);
    let (status, _, _) = consume(&app, &token, json!({"subject": "u-1", "request_id": "R1"})).await;
    assert_eq!(status, StatusCode::OK);
    wait_redis_state(&r, &key, "c", 5).await;
    let dump: Vec<u8> = redis::cmd("DUMP")
        .arg(&key)
        .query_async(&mut r)
        .await
        .expect("dump");
    let released = app
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{token}/release"),
            &json!({"subject": "u-1"}),
        )
        .await;
    assert_eq!(released.status(), StatusCode::OK);
    wait_redis_state(&r, &key, "i", 5).await;
    let _: () = redis::cmd("RESTORE")
        .arg(&key)
        .arg(60_000)
        .arg(dump)
        .arg("REPLACE")
        .query_async(&mut r)
        .await
        .expect("restore");
    assert_eq!(redis_state(&app, &token).await.as_deref(), Some("c"));

    let report = reconcile(&app).await;
    assert_eq!(report["found"]["redis_consumed_but_live"], 1, "{report}");
    assert_eq!(report["repaired"]["redis_consumed_but_live"], 1, "{report}");
    assert_eq!(redis_state(&app, &token).await.as_deref(), Some("i"));

    let (status, replayed, body) =
        consume(&app, &token, json!({"subject": "u-1", "request_id": "R2"})).await;
    assert_eq!(
        (status, replayed, body["outcome"].as_str()),
        (StatusCode::OK, false, Some("consumed")),
        "{body}"
    );
    wait_redis_state(&r, &key, "c", 5).await;
    let report = reconcile(&app).await;
    assert_eq!(report["found"]["redis_consumed_but_live"], 0, "{report}");
    app.stop().await;
}

// ---- the retention ----------------------------------------------------------

/// With `tokens.retention = "4s"`, a consumed token past its expiry and the
/// retention answers `token_expired` once reconcile purged its record: its
/// Redis marker is gone by then (durable and fast alike).
#[tokio::test]
async fn no_redis_marker_outlives_the_retention() {
    let app = spawn_app_on(Stores::fresh().with("tokens.retention = \"4s\"")).await;
    let pg = app.pg().await;
    let mut tokens = Vec::new();
    for biz in ["order", "like"] {
        let r = app
            .post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": biz, "subject": "u-1", "ttl_seconds": 1}),
            )
            .await;
        let (status, _, body) = answer(r).await;
        assert_eq!(status, StatusCode::CREATED);
        let token = body["token"].as_str().expect("token").to_owned();
        let (status, _, body) = consume(&app, &token, json!({"subject": "u-1"})).await;
        assert_eq!(body["outcome"], "consumed", "{status} {body}");
        tokens.push(token);
    }
    // Reconcile until it purged both records (consumed 4 s ago, expired).
    eventually(30, || async {
        reconcile(&app).await;
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE token = ANY($1)")
            .bind(&tokens)
            .fetch_one(&pg)
            .await
            .expect("count");
        (left == 0).then_some(())
    })
    .await;
    let r = app.redis().await;
    for token in &tokens {
        // The marker lives `redis.consumed_ttl` from its consume, held to the
        // retention: it is gone (or going) by the purge.
        let key = app.token_key(token);
        eventually(3, || {
            let mut r = r.clone();
            let key = key.clone();
            async move {
                let n: i64 = r.exists(&key).await.expect("exists");
                (n == 0).then_some(())
            }
        })
        .await;
        let (status, _, body) = consume(&app, token, json!({"subject": "u-1"})).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_expired")),
            "{token}: {body}"
        );
    }
    app.stop().await;
}
