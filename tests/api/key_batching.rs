//! Group commit of durable client-key consumes (`durable::key_batch`): many
//! keys consumed at once are decided in fewer statements than keys, each
//! key exactly once (identical first consumes of one key included); one
//! batch statement answers every item as the single statement would; a
//! batch Postgres refuses is decided item by item, failing only its own.

use std::sync::Arc;

use chrono::Utc;
use idempotency_ledger::config::Durability;
use idempotency_ledger::domain::key::{identity, ClientKey};
use idempotency_ledger::domain::BizType;
use idempotency_ledger::durable::key_batch::{consume_key_batch, KeyItem};
use idempotency_ledger::durable::keys::{self, KeyConsumed};
use idempotency_ledger::durable::tokens::{self, ConsumeRow, Existing, TokenRecord, TokenState};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::calls::consume_key;
use crate::helpers::scrape::sample;
use crate::helpers::*;

/// The key histogram's count (its statements and lone consumes), its sum
/// (the consumes they decided), and the count of batches of at most `le`.
fn key_batches(text: &str, le: &str) -> (f64, f64, f64) {
    let count = sample(text, "ledger_pg_key_batch_size_count", &[]).expect("count");
    let sum = sample(text, "ledger_pg_key_batch_size_sum", &[]).expect("sum");
    let small = sample(text, "ledger_pg_key_batch_size_bucket", &[("le", le)]).expect("bucket");
    (count, sum, small)
}

/// 60 new keys of the durable `order` type, each claimed by 5 identical
/// requests fired together (even keys: one request_id; odd: plain bodies),
/// with one key statement in flight at a time: per key exactly one
/// `consumed` and one `key.consumed` audit row; the keys were created by
/// fewer transactions than keys (their rows' `xmin`), and the consumes
/// that reached Postgres were queued in fewer batches than consumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn identical_first_consumes_of_many_keys_are_batched_each_key_once() {
    let _heavy = heavy().await;
    let app = spawn_app_batching().await;
    const KEYS: usize = 60;
    const COPIES: usize = 5;
    let run = uuid::Uuid::new_v4();
    let key = |i: usize| format!("k-{run}-{i}");
    let body = |i: usize| {
        if i.is_multiple_of(2) {
            json!({"biz_type": "order", "key": key(i), "request_id": format!("r-{i}")})
        } else {
            json!({"biz_type": "order", "key": key(i)})
        }
    };
    let barrier = Arc::new(Barrier::new(KEYS * COPIES));
    let mut handles = Vec::new();
    for i in 0..KEYS {
        for _ in 0..COPIES {
            let (app, barrier, body) = (app.clone(), barrier.clone(), body(i));
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                (i, consume_key(&app, &body).await)
            }));
        }
    }
    let mut won = vec![0usize; KEYS];
    for h in handles {
        let (i, (s, replayed, b)) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "key {i}: {b}");
        match b["outcome"].as_str() {
            Some("consumed") if !replayed => won[i] += 1,
            Some("consumed" | "duplicate") => {}
            other => panic!("key {i}: {other:?} {b}"),
        }
    }
    assert!(won.iter().all(|w| *w == 1), "winners per key: {won:?}");

    let pg = app.pg().await;
    let audits: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_events WHERE kind = 'key.consumed' AND detail->>'key' LIKE $1",
    )
    .bind(format!("k-{run}-%"))
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!(audits, KEYS as i64);
    // The rows one statement created share its transaction id: fewer than
    // the keys, or each key was sent on its own.
    let transactions: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM tokens WHERE key LIKE $1")
            .bind(format!("k-{run}-%"))
            .fetch_one(&pg)
            .await
            .unwrap();
    assert!(
        transactions < KEYS as i64,
        "{transactions} transactions created {KEYS} keys"
    );

    let text = app.metrics_text().await;
    let (statements, consumes, singles) = key_batches(&text, "1");
    assert!(
        consumes >= KEYS as f64,
        "{consumes} consumes reached Postgres"
    );
    assert!(
        statements < consumes,
        "{statements} statements for {consumes} key consumes"
    );
    assert!(statements > singles, "no batch of more than one: {text}");
    Arc::try_unwrap(app).ok().expect("sole owner").stop().await;
}

fn key_record(key: &str, subject: &str) -> TokenRecord {
    let biz = BizType::parse("order").expect("biz");
    let id = identity("payments", &biz, &ClientKey::parse(key).expect("key"));
    let now = Utc::now();
    TokenRecord {
        id: id.id,
        token: id.handle,
        biz_type: "order".into(),
        durability: Durability::Durable,
        subject: subject.into(),
        client: "payments".into(),
        issued_at: now,
        expires_at: now,
        key: Some(key.into()),
    }
}

/// What a key consume answers, without Postgres's clock.
fn shape(k: &KeyConsumed) -> Value {
    match &k.row {
        ConsumeRow::Won { .. } => json!(["won", k.gen, k.subject]),
        ConsumeRow::Existing(Existing {
            state,
            fingerprint,
            request_id,
            gen,
            ..
        }) => json!([
            "existing",
            matches!(state, TokenState::Consumed),
            fingerprint,
            request_id,
            gen,
            k.gen,
            k.subject
        ]),
        ConsumeRow::Expired => json!(["expired", k.gen]),
    }
}

/// One batch statement over every case answers each item exactly as the
/// single statement answers its twin: a new key with and without a subject
/// (won at generation 1, the subject recorded), a released key (won at
/// generation 3), a released key bound to another subject (existing, its
/// subject), a released key claimed without naming one (won), a consumed
/// key (the winner's fingerprint and request_id); with one `key.consumed`
/// audit row per win, its detail naming the key.
#[tokio::test]
async fn one_key_batch_statement_answers_each_item_as_the_single_statement_does() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    let cases = |set: &str| {
        vec![
            (key_record(&format!("{set}-new"), "u-1"), None),
            (key_record(&format!("{set}-new-bare"), ""), None),
            (
                key_record(&format!("{set}-released"), "u-1"),
                Some("released"),
            ),
            (key_record(&format!("{set}-other"), "u-2"), Some("released")),
            (key_record(&format!("{set}-bare"), ""), Some("released")),
            (
                key_record(&format!("{set}-consumed"), "u-1"),
                Some("consumed"),
            ),
        ]
    };
    for set in ["a", "b"] {
        for (rec, prior) in cases(set) {
            let Some(prior) = prior else { continue };
            // Created by a consume naming u-1.
            let first = TokenRecord {
                subject: "u-1".into(),
                ..rec.clone()
            };
            keys::consume(&pg, &first, Some("sha256:first"), Some("r-first"))
                .await
                .unwrap();
            if prior == "released" {
                tokens::release(&pg, rec.id).await.unwrap();
            }
        }
    }
    let item = |rec: TokenRecord| KeyItem {
        record: rec,
        fingerprint: Some("sha256:now".into()),
        request_id: Some("r-now".into()),
    };
    let mut batch: Vec<KeyItem> = cases("a").into_iter().map(|(r, _)| item(r)).collect();
    batch.sort_by_key(|it| it.record.id);
    let refs: Vec<&KeyItem> = batch.iter().collect();
    let batched: Vec<KeyConsumed> = consume_key_batch(&pg, &refs)
        .await
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let by_key = |items: &[KeyItem], answers: Vec<KeyConsumed>| {
        let mut out: Vec<(String, Value)> = items
            .iter()
            .zip(answers.iter())
            .map(|(it, a)| {
                let k = it.record.key.clone().unwrap_or_default();
                (k[2..].to_owned(), shape(a))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    };
    let batched = by_key(&batch, batched);
    let singles: Vec<KeyItem> = cases("b").into_iter().map(|(r, _)| item(r)).collect();
    let mut single = Vec::new();
    for it in &singles {
        single.push(
            keys::consume(
                &pg,
                &it.record,
                it.fingerprint.as_deref(),
                it.request_id.as_deref(),
            )
            .await
            .unwrap(),
        );
    }
    let single = by_key(&singles, single);
    assert_eq!(batched, single);
    let expect: Vec<(String, Value)> = vec![
        ("bare".into(), json!(["won", 3, "u-1"])),
        (
            "consumed".into(),
            json!(["existing", true, "sha256:first", "r-first", 1, 1, "u-1"]),
        ),
        ("new".into(), json!(["won", 1, "u-1"])),
        ("new-bare".into(), json!(["won", 1, ""])),
        (
            "other".into(),
            json!(["existing", false, null, null, 2, 2, "u-1"]),
        ),
        ("released".into(), json!(["won", 3, "u-1"])),
    ];
    assert_eq!(batched, expect);

    let audits: Vec<(String, i64, Option<String>, Value)> = sqlx::query_as(
        "SELECT detail->>'key', gen, subject, detail FROM audit_events
          WHERE kind = 'key.consumed' AND detail->>'key' LIKE 'a-%' ORDER BY 1, 2",
    )
    .fetch_all(&pg)
    .await
    .unwrap();
    let now = |k: &str| json!({"key": k, "fingerprint": "sha256:now", "request_id": "r-now"});
    let first = |k: &str| json!({"key": k, "fingerprint": "sha256:first", "request_id": "r-first"});
    let u1 = Some("u-1".to_owned());
    assert_eq!(
        audits,
        vec![
            ("a-bare".into(), 1, u1.clone(), first("a-bare")),
            ("a-bare".into(), 3, u1.clone(), now("a-bare")),
            ("a-consumed".into(), 1, u1.clone(), first("a-consumed")),
            ("a-new".into(), 1, u1.clone(), now("a-new")),
            ("a-new-bare".into(), 1, None, now("a-new-bare")),
            ("a-other".into(), 1, u1.clone(), first("a-other")),
            ("a-released".into(), 1, u1.clone(), first("a-released")),
            ("a-released".into(), 3, u1, now("a-released")),
        ]
    );
    app.stop().await;
}

/// A key whose consume Postgres refuses (a constraint the schema gained: no
/// consumed key bound to subject `blocked`) sits in a batch with ten
/// others: the batch statement fails as a whole, its items are decided one
/// by one, and only the refused one fails (500); the others are consumed.
/// Nothing of the refused key was written, and once the constraint is gone
/// the same attempt consumes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_postgres_refuses_fails_only_its_own_consume_in_a_batch() {
    // Long bounds: the queue fills while the blocker waits on its lock.
    let app = Arc::new(
        spawn_app_on(Stores::fresh().with(
            "postgres.consume_batches_in_flight = 1\npostgres.acquire_timeout = \"10s\"\npostgres.statement_timeout = \"20s\"",
        ))
        .await,
    );
    let pg = app.pg().await;
    let run = uuid::Uuid::new_v4();
    let key = |name: &str| format!("k-{run}-{name}");
    let body = |name: &str, subject: &str| json!({"biz_type": "order", "key": key(name), "subject": subject, "request_id": "r-1"});
    // The blocker exists (consumed, then released), so that its next
    // consume waits on its row's lock.
    let (s, _, b) = consume_key(&app, &body("blocker", "u-blocker")).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let (s, _, b) = answer(
        app.post(
            PAYMENTS,
            "/v1/keys/release",
            &json!({"biz_type": "order", "key": key("blocker")}),
        )
        .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    sqlx::query(
        "ALTER TABLE tokens ADD CONSTRAINT test_blocked_subject
             CHECK (state = 'issued' OR subject <> 'blocked') NOT VALID",
    )
    .execute(&pg)
    .await
    .unwrap();
    let mut lock = pg.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM tokens WHERE key = $1 FOR UPDATE")
        .bind(key("blocker"))
        .execute(&mut *lock)
        .await
        .unwrap();
    let send = |body: Value| {
        let app = app.clone();
        tokio::spawn(async move { consume_key(&app, &body).await })
    };
    let wait_for = |name: &'static str, n: f64| {
        let app = app.clone();
        async move {
            eventually(10, || {
                let app = app.clone();
                async move {
                    let text = app.metrics_text().await;
                    (sample(&text, name, &[]) == Some(n)).then_some(())
                }
            })
            .await
        }
    };
    let first = send(body("blocker", "u-blocker"));
    wait_for("ledger_pg_key_batch_size_count", 2.0).await;
    let refused = send(body("victim", "blocked"));
    let rest: Vec<_> = (0..10)
        .map(|i| send(body(&format!("k{i}"), &format!("u-{i}"))))
        .collect();
    wait_for("ledger_pg_key_consume_queue", 11.0).await;
    lock.commit().await.unwrap();

    let (s, _, b) = first.await.unwrap();
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{b}"
    );
    for (i, h) in rest.into_iter().enumerate() {
        let (s, replayed, b) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "key {i}: {b}");
        assert_eq!(b["outcome"], "consumed", "key {i}: {b}");
        assert!(!replayed);
    }
    let (s, _, b) = refused.await.unwrap();
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{b}");

    let text = app.metrics_text().await;
    let (_, _, up_to_8) = key_batches(&text, "8");
    let (_, _, up_to_16) = key_batches(&text, "16");
    assert!(up_to_16 > up_to_8, "no batch of 9 to 16 items: {text}");

    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE key = $1")
        .bind(key("victim"))
        .fetch_one(&pg)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    sqlx::query("ALTER TABLE tokens DROP CONSTRAINT test_blocked_subject")
        .execute(&pg)
        .await
        .unwrap();
    let (s, _, b) = consume_key(&app, &body("victim", "blocked")).await;
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{b}"
    );
    Arc::try_unwrap(app).ok().expect("sole owner").stop().await;
}
