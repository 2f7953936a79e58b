//! Generations: every write between the tiers carries the generation it was
//! decided at and applies only over an older one. Each interleaving that used
//! to decide a token's state by arrival order is made here on purpose (a
//! stale marker restored after a release, journal entries out of order or
//! unreadable, markers past the retention), with the V4 migration run on a
//! populated database and the journal's apply rule checked against its model
//! on a real Postgres.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, TimeZone, Utc};
use idempotency_ledger::config::Durability;
use idempotency_ledger::durable::journal::{self, Decided, Entry, EntryKind, Versioned};
use idempotency_ledger::durable::tokens::TokenRecord;
use idempotency_ledger::fast::{Attempt, ConsumeMode, Marker, ScriptOutcome};
use idempotency_ledger::token::{Clock, SystemClock};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::{PgPool, Row};

use crate::helpers::procs::RedisProc;
use crate::helpers::tiers::fast_tier;
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
        durability: Durability::Fast,
        subject: "u-7".into(),
        client: "payments".into(),
        issued_at: at(0),
        expires_at: at(3_600_000),
        key: None,
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
            detail: None,
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
                detail: None,
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
                detail: None,
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
                    want.insert((e.version.gen, e.kind.audit_kind().as_str().to_owned()), 1);
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
    let now_ms = SystemClock.now_ms().to_string();
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

// ---- tools for interleavings ------------------------------------------------

/// A TCP proxy in front of a private Redis: `cut` closes every connection
/// through it and refuses new ones, so that one instance loses Redis while
/// another, connected directly, keeps it.
struct Proxy {
    port: u16,
    open: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("proxy port");
        let port = listener.local_addr().expect("addr").port();
        let open = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (open, conns) = (open.clone(), conns.clone());
            tokio::spawn(async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    if !open.load(Ordering::SeqCst) {
                        continue; // dropped: closed at once
                    }
                    let task = tokio::spawn(async move {
                        if let Ok(mut out) =
                            tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                        {
                            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                        }
                    });
                    conns.lock().expect("conns").push(task);
                }
            })
        };
        Proxy {
            port,
            open,
            conns,
            accept,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for task in self.conns.lock().expect("conns").drain(..) {
            task.abort();
        }
    }

    fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// Fast breaker and Redis timeout, for the tests that cut Redis.
const QUICK: &str = r#"
redis.timeout = "300ms"
redis.down_backoff = "300ms"
"#;

/// A fast token's record (signed with the development key; Postgres need
/// not know it: journal entries carry the record).
fn like_record(app: &TestApp, id: u64, subject: &str) -> TokenRecord {
    let exp = (SystemClock.now_ms() / 1000 + 600) as u32;
    let token = app.sign("like", id, exp, "payments", subject);
    TokenRecord {
        id: id as i64,
        token,
        biz_type: "like".into(),
        durability: Durability::Fast,
        subject: subject.into(),
        client: "payments".into(),
        issued_at: SystemClock.now(),
        expires_at: Utc.timestamp_opt(i64::from(exp), 0).unwrap(),
        key: None,
    }
}

/// The journal entries a fast token's scripts wrote on `scratch`'s prefix
/// (where no drainer runs), oldest first, removed from there.
async fn take_entries(
    r: &mut redis::aio::MultiplexedConnection,
    scratch: &Stores,
) -> Vec<Vec<(String, Vec<u8>)>> {
    let key = format!("{}journal", scratch.prefix);
    let reply: redis::streams::StreamRangeReply = r.xrange_all(&key).await.expect("xrange");
    let _: () = r.del(&key).await.expect("del");
    reply
        .ids
        .into_iter()
        .map(|e| {
            let mut fields: Vec<(String, Vec<u8>)> = e
                .map
                .into_iter()
                .filter_map(|(k, v)| match v {
                    redis::Value::BulkString(b) => Some((k, b)),
                    _ => None,
                })
                .collect();
            fields.sort();
            fields
        })
        .collect()
}

async fn append_entries(
    r: &mut redis::aio::MultiplexedConnection,
    stores: &Stores,
    entries: &[Vec<(String, Vec<u8>)>],
) {
    let key = format!("{}journal", stores.prefix);
    for fields in entries {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&key).arg("*");
        for (k, v) in fields {
            cmd.arg(k).arg(v.as_slice());
        }
        let _: String = cmd.query_async(r).await.expect("xadd");
    }
}

async fn pg_token(pg: &PgPool, id: i64) -> Option<(String, i64, Option<String>, Option<Value>)> {
    sqlx::query_as("SELECT state::text, gen, request_id, result FROM tokens WHERE id = $1")
        .bind(id)
        .fetch_optional(pg)
        .await
        .expect("token row")
}

/// The number in a metric line of `/metrics` (0 when absent).
async fn gauge(app: &TestApp, line_prefix: &str) -> f64 {
    metric(app, line_prefix).await
}

// ---- the journal across instances -------------------------------------------

/// A fast result whose entry reaches Postgres before its consume's (another
/// instance took the consume entry, or it was claimed late): the result is
/// not lost, and the consume arriving afterwards changes nothing.
#[tokio::test]
async fn a_result_applied_before_its_consume_on_another_instance_is_kept() {
    let stores = Stores::fresh();
    let scratch = Stores::fresh();
    let a = spawn_app_on(stores.clone()).await;
    let b = spawn_app_on(stores.clone()).await;
    let fast = fast_tier(&scratch).0;
    let mut r = a.redis().await;
    let rec = like_record(&a, 7_100_000_001, "u-1");
    fast.seed(&rec.token, 60_000).await.expect("seed");
    let attempt = Attempt {
        owner: "",
        request_id: Some("r-1"),
        fingerprint: None,
    };
    let fields = idempotency_ledger::journal::consume_fields(&rec, Some("r-1"), None);
    let (won, _) = fast
        .consume_versioned(&rec.token, ConsumeMode::Fast, &attempt, 1_000, &fields)
        .await
        .expect("consume");
    assert!(matches!(won, ScriptOutcome::Won { .. }), "{won:?}");
    let result = json!({"liked": 1});
    let written = fast
        .write_result(
            &rec.token,
            result.to_string(),
            None,
            &idempotency_ledger::journal::result_fields_for(&rec, &result.to_string()),
        )
        .await
        .expect("result");
    assert_eq!(written, idempotency_ledger::fast::ResultWrite::Recorded);
    let mut entries = take_entries(&mut r, &scratch).await;
    assert_eq!(entries.len(), 2);
    entries.reverse(); // the result first
    append_entries(&mut r, &stores, &entries).await;

    let pg = a.pg().await;
    let row = eventually(15, || async {
        let row = pg_token(&pg, rec.id).await?;
        let journal: u64 = a
            .redis()
            .await
            .xlen(format!("{}journal", stores.prefix))
            .await
            .ok()?;
        (journal == 0).then_some(row)
    })
    .await;
    assert_eq!(
        row,
        ("consumed".into(), 1, Some("r-1".into()), Some(result)),
        "the result survives its consume arriving later"
    );
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind::text FROM audit_events WHERE token_id = $1 AND gen = 1 ORDER BY at",
    )
    .bind(rec.id)
    .fetch_all(&pg)
    .await
    .expect("audit");
    assert_eq!(kinds, ["token.consumed", "token.result"]);
    a.stop().await;
    b.stop().await;
}

/// Consume, release, consume of a fast token, their entries applied by two
/// instances in the worst order (newest first): Postgres ends at the last
/// consume, never at the release or the first consume.
#[tokio::test]
async fn fast_consume_release_consume_spread_over_instances_ends_at_the_last_consume() {
    let stores = Stores::fresh();
    let scratch = Stores::fresh();
    let a = spawn_app_on(stores.clone()).await;
    let b = spawn_app_on(stores.clone()).await;
    let fast = fast_tier(&scratch).0;
    let mut r = a.redis().await;
    let rec = like_record(&a, 7_100_000_002, "u-2");
    fast.seed(&rec.token, 60_000).await.expect("seed");
    for (i, rid) in ["r-1", "r-3"].into_iter().enumerate() {
        let attempt = Attempt {
            owner: "",
            request_id: Some(rid),
            fingerprint: None,
        };
        let fields = idempotency_ledger::journal::consume_fields(&rec, Some(rid), None);
        let (won, v) = fast
            .consume_versioned(&rec.token, ConsumeMode::Fast, &attempt, 1_000, &fields)
            .await
            .expect("consume");
        assert!(matches!(won, ScriptOutcome::Won { .. }), "{won:?}");
        assert_eq!(v.gen, 2 * i as i64 + 1);
        if i == 0 {
            let released = fast
                .release(
                    &rec.token,
                    60_000,
                    None,
                    &idempotency_ledger::journal::release_fields_for(&rec),
                )
                .await
                .expect("release");
            assert!(
                matches!(
                    released,
                    idempotency_ledger::fast::ReleaseWrite::Released { gen: 2, .. }
                ),
                "{released:?}"
            );
        }
    }
    let mut entries = take_entries(&mut r, &scratch).await;
    assert_eq!(entries.len(), 3);
    entries.reverse();
    // Each instance gets some: the stream is read by both drainers.
    append_entries(&mut r, &stores, &entries).await;
    let pg = a.pg().await;
    let row = eventually(15, || async {
        let row = pg_token(&pg, rec.id).await?;
        (row.1 == 3).then_some(row)
    })
    .await;
    assert_eq!(row, ("consumed".into(), 3, Some("r-3".into()), None));
    let audit: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE token_id = $1")
        .bind(rec.id)
        .fetch_one(&pg)
        .await
        .expect("audit");
    assert_eq!(audit, 3, "consumed@1, released@2, consumed@3");
    a.stop().await;
    b.stop().await;
}

// ---- durable write-backs ----------------------------------------------------

async fn release(app: &TestApp, token: &str, subject: &str) -> StatusCode {
    app.post(
        PAYMENTS,
        &format!("/v1/tokens/{token}/release"),
        &json!({ "subject": subject }),
    )
    .await
    .status()
}

async fn redis_gen(r: &redis::aio::MultiplexedConnection, key: &str) -> Option<i64> {
    let mut r = r.clone();
    let g: Option<String> = r.hget(key, "g").await.expect("hget");
    g.and_then(|g| g.parse().ok())
}

/// A durable token consumed on A (R1), released on B, consumed again on A
/// (R3); then R1's consume's write-back arrives late. It is refused (an
/// older generation): duplicates answer from R3's consume, R3's retry is
/// told `consumed`, R1's is not.
#[tokio::test]
async fn durable_consume_release_consume_over_instances_with_a_late_write_back() {
    let stores = Stores::fresh();
    let a = spawn_app_on(stores.clone()).await;
    let b = spawn_app_on(stores.clone()).await;
    let r = a.redis().await;
    let token = a.issue(PAYMENTS, "order", "u-1").await;
    let key = a.token_key(&token);
    let first = json!({"subject": "u-1", "request_id": "R1", "fingerprint": "f1"});
    let (s, _, body) = consume(&a, &token, first.clone()).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let first_at = body["consumed_at"].as_str().expect("at").to_owned();
    wait_redis_state(&r, &key, "c", 5).await;
    assert_eq!(release(&b, &token, "u-1").await, StatusCode::OK);
    eventually(5, || async {
        (redis_gen(&r, &key).await == Some(2)).then_some(())
    })
    .await;
    let third = json!({"subject": "u-1", "request_id": "R3", "fingerprint": "f3"});
    let (s, _, body) = consume(&a, &token, third.clone()).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    eventually(5, || async {
        (redis_gen(&r, &key).await == Some(3)).then_some(())
    })
    .await;

    // R1's write-back, late.
    let at = DateTime::parse_from_rfc3339(&first_at)
        .expect("time")
        .timestamp_millis();
    let late = fast_tier(&stores)
        .0
        .write_consumed(
            &token,
            1,
            &Marker {
                at_ms: at,
                request_id: Some("R1".into()),
                fingerprint: Some("f1".into()),
                result: None,
            },
        )
        .await
        .expect("write");
    assert!(!late, "an older generation is refused");
    let mut rc = r.clone();
    let rid: Option<String> = rc.hget(&key, "rid").await.expect("hget");
    assert_eq!(rid.as_deref(), Some("R3"));

    for app in [&a, &b] {
        let (s, replayed, body) = consume(app, &token, third.clone()).await;
        assert_eq!(
            (s, replayed, body["outcome"].as_str()),
            (StatusCode::OK, true, Some("consumed")),
            "{body}"
        );
        let (s, _, body) =
            consume(app, &token, json!({"subject": "u-1", "fingerprint": "f3"})).await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate"))
        );
        let (s, _, body) = consume(app, &token, first.clone()).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                Some("fingerprint_mismatch")
            ),
            "R1 is no longer the winner: {body}"
        );
    }
    a.stop().await;
    b.stop().await;
}

/// Reconcile re-seeds a token it read as issued while a fast consume that
/// Postgres decided was on its way to Redis; the consume's write-back lands
/// after the seed. It still applies (a newer generation than the seed's),
/// so a second consume is a duplicate, not a second win in Redis.
#[tokio::test]
async fn a_reseed_racing_a_fast_consume_never_lets_a_second_consume_win() {
    let app = spawn_app().await;
    let r = app.redis().await;
    let fast = fast_tier(&app.stores).0;
    let token = app.issue(PAYMENTS, "like", "u-1").await;
    let key = app.token_key(&token);
    // Redis lost the key: the consume goes to Postgres, which decides.
    let mut rc = r.clone();
    let _: () = rc.del(&key).await.expect("del");
    let (s, _, body) = consume(&app, &token, json!({"subject": "u-1", "request_id": "R1"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    wait_redis_state(&r, &key, "c", 5).await;
    // The race, in its worst order: reconcile's seed (at the generation it
    // read, 0) lands first, then the consume's write-back (generation 1).
    let _: () = rc.del(&key).await.expect("del");
    assert!(fast.reseed(&token, 60_000, 0).await.expect("reseed"));
    let at = DateTime::parse_from_rfc3339(body["consumed_at"].as_str().expect("at"))
        .expect("time")
        .timestamp_millis();
    let marker = Marker {
        at_ms: at,
        request_id: Some("R1".into()),
        fingerprint: None,
        result: None,
    };
    assert!(fast
        .write_consumed(&token, 1, &marker)
        .await
        .expect("write back"));
    assert_eq!(redis_state(&app, &token).await.as_deref(), Some("c"));
    let (s, _, body) = consume(&app, &token, json!({"subject": "u-1"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate")),
        "{body}"
    );
    // The other order: the write-back first, then the seed, which never
    // overwrites a key.
    assert!(!fast.reseed(&token, 60_000, 0).await.expect("reseed"));
    assert_eq!(redis_state(&app, &token).await.as_deref(), Some("c"));
    app.stop().await;
}

/// Instance A consumes a durable token while it cannot reach Redis (the
/// write-back waits in its queue); B releases the token. When A reaches Redis
/// again its queued write-back (an older generation) is refused: the token
/// stays released and B's next consume wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resync_after_a_release_never_writes_the_old_winner_back() {
    let redis = RedisProc::start();
    let proxy = Proxy::start(redis.port).await;
    let stores = Stores::fresh().with(QUICK);
    let a = spawn_app_on(stores.clone().redis(&proxy.url())).await;
    let b = spawn_app_on(stores.clone().redis(&redis.url())).await;
    let r = redis.conn().await;
    let token = b.issue(PAYMENTS, "order", "u-1").await;
    let key = b.token_key(&token);
    proxy.cut();
    let (s, _, body) = consume(&a, &token, json!({"subject": "u-1", "request_id": "R1"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{body}"
    );
    // A's write-back of R1's consume waits for Redis.
    eventually(10, || async {
        (gauge(&a, "ledger_redis_resync_depth").await >= 1.0).then_some(())
    })
    .await;
    assert_eq!(release(&b, &token, "u-1").await, StatusCode::OK);
    eventually(5, || async {
        (redis_gen(&r, &key).await == Some(2)).then_some(())
    })
    .await;

    proxy.restore();
    eventually(15, || async {
        let drained = gauge(&a, "ledger_redis_resync_depth").await == 0.0;
        (drained && a.ledger.mode().as_str() == "normal").then_some(())
    })
    .await;
    assert_eq!(redis_gen(&r, &key).await, Some(2), "still released");
    let (s, replayed, body) =
        consume(&b, &token, json!({"subject": "u-1", "request_id": "R2"})).await;
    assert_eq!(
        (s, replayed, body["outcome"].as_str()),
        (StatusCode::OK, false, Some("consumed")),
        "{body}"
    );
    a.stop().await;
    b.stop().await;
}

/// After a release and a stale consumed marker restored in Redis (as in
/// the failover above), the old winner's retry is not told `consumed` by
/// Redis alone: Postgres, which holds the token issued, decides, and that
/// retry becomes a new consume recorded in Postgres.
#[tokio::test]
async fn the_winners_retry_under_a_stale_marker_is_confirmed_by_postgres() {
    let app = spawn_app().await;
    let mut r = app.redis().await;
    let token = app.issue(PAYMENTS, "order", "u-1").await;
    let key = app.token_key(&token);
    let r1 = json!({"subject": "u-1", "request_id": "R1"});
    let (s, _, _) = consume(&app, &token, r1.clone()).await;
    assert_eq!(s, StatusCode::OK);
    wait_redis_state(&r, &key, "c", 5).await;
    let dump: Vec<u8> = redis::cmd("DUMP")
        .arg(&key)
        .query_async(&mut r)
        .await
        .expect("dump");
    assert_eq!(release(&app, &token, "u-1").await, StatusCode::OK);
    wait_redis_state(&r, &key, "i", 5).await;
    let _: () = redis::cmd("RESTORE")
        .arg(&key)
        .arg(60_000)
        .arg(dump)
        .arg("REPLACE")
        .query_async(&mut r)
        .await
        .expect("restore");

    let (s, replayed, body) = consume(&app, &token, r1).await;
    assert_eq!(
        (s, replayed, body["outcome"].as_str()),
        (StatusCode::OK, false, Some("consumed")),
        "a new consume, not a replay: {body}"
    );
    let pg = app.pg().await;
    let state: String = sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
        .bind(&token)
        .fetch_one(&pg)
        .await
        .expect("row");
    assert_eq!(state, "consumed", "Postgres recorded it");
    let (s, _, body) = consume(&app, &token, json!({"subject": "u-1", "request_id": "R2"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate"))
    );
    app.stop().await;
}

// ---- read your writes -------------------------------------------------------

/// Once `result` answered 200, every later duplicate answers `completed`
/// with it, on every instance: right after the answer, and when the write
/// of the result to Redis failed on the instance that recorded it (its
/// Redis cut off; the other instance still reads the marker without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_right_after_a_result_answers_completed() {
    let redis = RedisProc::start();
    let proxy = Proxy::start(redis.port).await;
    let stores = Stores::fresh().with(QUICK);
    let a = spawn_app_on(stores.clone().redis(&proxy.url())).await;
    let b = spawn_app_on(stores.clone().redis(&redis.url())).await;
    let r = redis.conn().await;

    for (round, cut) in [(0, false), (1, true)] {
        let subject = format!("u-{round}");
        let token = b.issue(PAYMENTS, "order", &subject).await;
        let key = b.token_key(&token);
        let (s, _, _) = consume(&b, &token, json!({"subject": subject, "request_id": "R1"})).await;
        assert_eq!(s, StatusCode::OK);
        wait_redis_state(&r, &key, "c", 5).await;
        if cut {
            proxy.cut();
        }
        let result = json!({"paid": round});
        let recorded = a
            .post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/result"),
                &json!({"subject": subject, "result": result}),
            )
            .await;
        assert_eq!(recorded.status(), StatusCode::OK, "round {round}");
        for app in [&b, &a] {
            let (s, _, body) = consume(app, &token, json!({"subject": subject})).await;
            assert_eq!(
                (s, body["outcome"].as_str(), body["status"].as_str()),
                (StatusCode::OK, Some("duplicate"), Some("completed")),
                "round {round}: {body}"
            );
            assert_eq!(body["result"], result);
        }
        if cut {
            proxy.restore();
            // The queued write reaches Redis once A does.
            eventually(15, || async {
                let mut r = r.clone();
                let res: Option<String> = r.hget(&key, "res").await.ok()?;
                res.is_some().then_some(())
            })
            .await;
        }
    }
    a.stop().await;
    b.stop().await;
}

// ---- the API's new rules ----------------------------------------------------

/// A result holding U+0000 anywhere is 400 `invalid_request` for durable and
/// fast types alike, and changes nothing: the right result is recorded after
/// it, and reaches Postgres.
#[tokio::test]
async fn a_result_holding_nul_is_400_for_every_biz_type() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    for biz in ["order", "like"] {
        let token = app.issue(PAYMENTS, biz, "u-1").await;
        let (s, _, _) = consume(&app, &token, json!({"subject": "u-1"})).await;
        assert_eq!(s, StatusCode::OK);
        for bad in [
            json!({"note": "nul\u{0}byte"}),
            json!({"k\u{0}": 1}),
            json!([["\u{0}"]]),
        ] {
            let r = app
                .post(
                    PAYMENTS,
                    &format!("/v1/tokens/{token}/result"),
                    &json!({"subject": "u-1", "result": bad}),
                )
                .await;
            let (s, _, body) = answer(r).await;
            assert_eq!(
                (s, body["error"].as_str()),
                (StatusCode::BAD_REQUEST, Some("invalid_request")),
                "{biz}: {body}"
            );
        }
        let good = json!({"note": "no nul"});
        let r = app
            .post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/result"),
                &json!({"subject": "u-1", "result": good}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK, "{biz}");
        eventually(15, || async {
            let result: Option<Value> =
                sqlx::query_scalar("SELECT result FROM tokens WHERE token = $1")
                    .bind(&token)
                    .fetch_optional(&pg)
                    .await
                    .expect("query")
                    .flatten();
            (result == Some(good.clone())).then_some(())
        })
        .await;
    }
    app.stop().await;
}

/// An order event replayed with the same token but another amount (refund)
/// or another fingerprint (pay) is 422 `fingerprint_mismatch` and changes
/// nothing; only the identical event is a `duplicate`.
#[tokio::test]
async fn an_order_event_replayed_with_another_amount_or_fingerprint_is_422() {
    let app = spawn_app().await;
    let created = app
        .post(
            PAYMENTS,
            "/v1/orders",
            &json!({"order_id": "o-12", "subject": "u-1", "amount_minor": 1000, "currency": "CNY"}),
        )
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let order = || async { answer(app.get(PAYMENTS, "/v1/orders/o-12").await).await.2 };
    let pay = app.issue(PAYMENTS, "order", "u-1").await;
    let event = |path: &'static str, body: Value| {
        let app = &app;
        async move {
            answer(
                app.post(PAYMENTS, &format!("/v1/orders/o-12/{path}"), &body)
                    .await,
            )
            .await
        }
    };
    let (s, _, body) = event("pay", json!({"token": pay, "fingerprint": "sha256:a"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{body}"
    );
    let (s, _, body) = event("pay", json!({"token": pay, "fingerprint": "sha256:b"})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        ),
        "{body}"
    );
    let (s, replayed, body) = event("pay", json!({"token": pay, "fingerprint": "sha256:a"})).await;
    assert_eq!(
        (s, replayed, body["outcome"].as_str()),
        (StatusCode::OK, true, Some("duplicate"))
    );

    let refund = app.issue(PAYMENTS, "refund", "u-1").await;
    let (s, _, body) = event("refund", json!({"token": refund, "amount_minor": 300})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{body}"
    );
    let before = order().await;
    let (s, _, body) = event("refund", json!({"token": refund, "amount_minor": 500})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        ),
        "{body}"
    );
    let after = order().await;
    assert_eq!(before, after, "nothing changed");
    assert_eq!(after["refunded_minor"], 300);
    let (s, replayed, body) = event("refund", json!({"token": refund, "amount_minor": 300})).await;
    assert_eq!(
        (s, replayed, body["outcome"].as_str()),
        (StatusCode::OK, true, Some("duplicate"))
    );
    app.stop().await;
}
