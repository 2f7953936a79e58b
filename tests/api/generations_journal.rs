//! Journal entries reach Postgres by generation, not by arrival: any order,
//! repetition and batching of one token's entries leaves its row at the last
//! decision (checked against the rule it mirrors on a real Postgres); a
//! result applied before its consume on another instance is kept; a fast
//! consume, release and consume spread over instances ends at the last
//! consume; an entry that can never apply is set aside and the journal keeps
//! flowing.

use std::collections::BTreeMap;

use chrono::{DateTime, TimeZone, Utc};
use idempotency_ledger::clock::{Clock, SystemClock};
use idempotency_ledger::config::Durability;
use idempotency_ledger::durable::journal::{self, Decided, Entry, EntryKind, Versioned};
use idempotency_ledger::durable::tokens::TokenRecord;
use idempotency_ledger::fast::{Attempt, ConsumeMode, ScriptOutcome};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::{PgPool, Row};

use crate::helpers::calls::{consume, metric, reconcile};
use crate::helpers::tiers::fast_tier;
use crate::helpers::*;

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
        owner: None,
        request_id: Some("r-1"),
        fingerprint: None,
    };
    let fields = idempotency_ledger::journal::consume_fields(&rec, Some("r-1"), None);
    let (won, _) = fast
        .consume_versioned(
            &rec.token,
            ConsumeMode::Fast,
            &attempt,
            1_000,
            Some(&fields),
        )
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
            None,
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
            owner: None,
            request_id: Some(rid),
            fingerprint: None,
        };
        let fields = idempotency_ledger::journal::consume_fields(&rec, Some(rid), None);
        let (won, v) = fast
            .consume_versioned(
                &rec.token,
                ConsumeMode::Fast,
                &attempt,
                1_000,
                Some(&fields),
            )
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
                    None,
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

/// Every script by which Redis decides (a fast consume, result, release
/// and lease release) checks the fleet's dataset id first: on a Redis that
/// holds another (it restarted empty) it answers `foreign` and writes
/// nothing, neither the key nor the journal. Before, a result on a Redis
/// that had restarted empty missed, and Postgres, which had not yet heard
/// of the consume, answered 409 `not_consumed` to its winner (the chaos
/// test's Redis restarts found it).
#[tokio::test]
async fn no_deciding_script_writes_on_another_redis_dataset() {
    use idempotency_ledger::fast::{Decision, KeyArgs, ReleaseWrite, ResultWrite};
    let stores = Stores::fresh();
    let scratch = Stores::fresh();
    let app = spawn_app_on(stores.clone()).await;
    let fast = fast_tier(&scratch).0;
    let mut r = app.redis().await;
    let agreed = uuid::Uuid::new_v4();
    let other = Some(uuid::Uuid::new_v4());
    fast.write_dataset(agreed).await.expect("dataset");
    let rec = like_record(&app, 7_300_000_001, "u-1");
    fast.seed(&rec.token, 60_000).await.expect("seed");
    let attempt = Attempt {
        owner: None,
        request_id: Some("r-1"),
        fingerprint: None,
    };
    let consume = idempotency_ledger::journal::consume_fields(&rec, Some("r-1"), None);
    let result = json!({"liked": 1}).to_string();
    let result_fields = idempotency_ledger::journal::result_fields_for(&rec, &result);
    let release_fields = idempotency_ledger::journal::release_fields_for(&rec);
    let key = format!("{}tok:{{{}}}", scratch.prefix, rec.token);
    let hash = |r: &mut redis::aio::MultiplexedConnection| {
        let key = key.clone();
        let mut r = r.clone();
        async move {
            let h: BTreeMap<String, String> = r.hgetall(&key).await.expect("hgetall");
            h
        }
    };

    let seeded = hash(&mut r).await;
    let (refused, _) = fast
        .decide(
            &rec.token,
            &attempt,
            1_000,
            &consume,
            KeyArgs::default(),
            other,
        )
        .await
        .expect("decide");
    assert_eq!(refused, Decision::Foreign);
    assert_eq!(hash(&mut r).await, seeded, "nothing written");
    let (won, _) = fast
        .decide(
            &rec.token,
            &attempt,
            1_000,
            &consume,
            KeyArgs::default(),
            Some(agreed),
        )
        .await
        .expect("decide");
    assert!(matches!(won, Decision::Won { .. }), "{won:?}");
    let consumed = hash(&mut r).await;

    let written = fast
        .write_result(&rec.token, result.clone(), None, &result_fields, other)
        .await
        .expect("result");
    assert_eq!(written, ResultWrite::Foreign);
    let released = fast
        .release(&rec.token, 60_000, None, &release_fields, other)
        .await
        .expect("release");
    assert_eq!(released, ReleaseWrite::Foreign);
    let lease = fast
        .lease_release(&rec.token, 60_000, 1, 0, &release_fields, other)
        .await
        .expect("lease release");
    assert_eq!(lease, ReleaseWrite::Foreign);
    assert_eq!(hash(&mut r).await, consumed, "nothing written");
    assert_eq!(
        take_entries(&mut r, &scratch).await.len(),
        1,
        "the win's entry alone"
    );

    // Redis restarted empty: no dataset key at all.
    let _: () = r
        .del(format!("{}dataset", scratch.prefix))
        .await
        .expect("del");
    let written = fast
        .write_result(
            &rec.token,
            result.clone(),
            None,
            &result_fields,
            Some(agreed),
        )
        .await
        .expect("result");
    assert_eq!(written, ResultWrite::Foreign);
    fast.write_dataset(agreed).await.expect("dataset");
    let written = fast
        .write_result(&rec.token, result, None, &result_fields, Some(agreed))
        .await
        .expect("result");
    assert_eq!(written, ResultWrite::Recorded);
    app.stop().await;
}
