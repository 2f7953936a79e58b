//! Write-backs of durable consumes to Redis, many at once: the answers of a
//! consume batch reach Redis in one pipeline (`FastTier::write_consumed_many`),
//! each item at its own generation and with its own outcome; a pipeline that
//! gets no reply leaves the keys as they were, for the resync queue or
//! reconcile to repair.

use std::sync::Arc;

use idempotency_ledger::clock::{Clock, SystemClock};
use idempotency_ledger::config::Durability;
use idempotency_ledger::domain::key::{identity, ClientKey};
use idempotency_ledger::domain::BizType;
use idempotency_ledger::durable::batch::{consume_batch, ConsumeItem};
use idempotency_ledger::durable::tokens::{ConsumeRow, TokenRecord};
use idempotency_ledger::durable::Pools;
use idempotency_ledger::fast::{Attempt, ConsumeMode, ConsumedWrite, Marker};
use idempotency_ledger::reconcile::{Class, Options, Quiet, Reconciler, BY_CLI};
use redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::Row;
use tokio_util::sync::CancellationToken;

use crate::helpers::calls;
use crate::helpers::link::Link;
use crate::helpers::procs::RedisProc;
use crate::helpers::scrape;
use crate::helpers::tiers::fast_tier;
use crate::helpers::*;

async fn field(r: &redis::aio::MultiplexedConnection, key: &str, f: &str) -> Option<String> {
    let mut r = r.clone();
    r.hget(key, f).await.expect("hget")
}

/// The row a consume of `token` writes, read back from its issuance record.
async fn record(pg: &sqlx::PgPool, token: &str) -> TokenRecord {
    let row = eventually(10, || async {
        sqlx::query(
            "SELECT id, biz_type, subject, client, issued_at, expires_at FROM tokens WHERE token = $1",
        )
        .bind(token)
        .fetch_optional(pg)
        .await
        .expect("query")
    })
    .await;
    TokenRecord {
        id: row.get("id"),
        token: token.to_owned(),
        biz_type: row.get("biz_type"),
        durability: Durability::Durable,
        subject: row.get("subject"),
        client: row.get("client"),
        issued_at: row.get("issued_at"),
        expires_at: row.get("expires_at"),
        key: None,
    }
}

/// Forty durable consumes sent together (so that they are decided in
/// batches): every token ends consumed in Redis, at the generation Postgres
/// holds, with its own request id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batchs_write_backs_all_end_consumed_with_their_generations() {
    let app = spawn_app().await;
    let r = app.redis().await;
    let pg = app.pg().await;
    let mut tokens = Vec::new();
    for i in 0..40 {
        tokens.push(app.issue(PAYMENTS, "order", &format!("u-{i}")).await);
    }
    let consumes = tokens.iter().enumerate().map(|(i, t)| {
        let app = &app;
        async move {
            let body = json!({"subject": format!("u-{i}"), "request_id": format!("r-{i}")});
            answer(app.consume(PAYMENTS, t, &body).await).await
        }
    });
    for (status, _, body) in futures_util::future::join_all(consumes).await {
        assert_eq!(
            (status, body["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{body}"
        );
    }
    for (i, t) in tokens.iter().enumerate() {
        let key = app.token_key(t);
        wait_redis_state(&r, &key, "c", 10).await;
        let gen: i64 = sqlx::query_scalar("SELECT gen FROM tokens WHERE token = $1")
            .bind(t)
            .fetch_one(&pg)
            .await
            .expect("gen");
        assert_eq!(gen, 1);
        assert_eq!(field(&r, &key, "g").await, Some(gen.to_string()), "{key}");
        assert_eq!(field(&r, &key, "rid").await, Some(format!("r-{i}")));
    }
    app.stop().await;
}

/// One pipeline for twenty write-backs (one Redis call), each applied at its
/// generation; a key Redis refuses (not a hash) fails only its own item; the
/// same write-backs again write nothing (versioned); after `SCRIPT FLUSH` the
/// script is loaded and the pipeline sent again.
#[tokio::test]
async fn write_backs_go_out_as_one_pipeline_and_each_item_has_its_own_outcome() {
    let redis = RedisProc::start();
    let stores = Stores::fresh().redis(&redis.url());
    let app = spawn_app_on(stores.clone()).await;
    let r = redis.conn().await;
    let (fast, metrics) = fast_tier(&stores);
    let mut items = Vec::new();
    for i in 0..20 {
        let token = app.issue(PAYMENTS, "order", &format!("u-{i}")).await;
        items.push(ConsumedWrite {
            token,
            gen: 1,
            marker: Marker {
                at_ms: now_ms(),
                request_id: Some(format!("r-{i}")),
                fingerprint: Some(format!("f-{i}")),
                result: None,
            },
        });
    }
    // Item 7's key is a string: the script fails on it, and on it only.
    let broken = app.token_key(&items[7].token);
    let mut rc = r.clone();
    let _: () = rc.set(&broken, "not a hash").await.expect("set");

    let calls = |op: &str| {
        metrics
            .tier_duration
            .with_label_values(&["redis", op])
            .get_sample_count()
    };
    let out = fast.write_consumed_many(&items).await.expect("a reply");
    assert_eq!(out.len(), 20);
    for (i, (w, o)) in items.iter().zip(&out).enumerate() {
        if i == 7 {
            assert!(o.is_err(), "the string key fails its item: {o:?}");
            continue;
        }
        assert!(matches!(o, Ok(true)), "item {i}: {o:?}");
        let key = app.token_key(&w.token);
        assert_eq!(field(&r, &key, "s").await.as_deref(), Some("c"));
        assert_eq!(field(&r, &key, "g").await.as_deref(), Some("1"));
        assert_eq!(field(&r, &key, "rid").await, Some(format!("r-{i}")));
    }
    assert_eq!(
        (calls("writeback_pipeline"), calls("writeback")),
        (1, 0),
        "one call for twenty"
    );

    // Again: the same generation is there, nothing is written.
    let again = fast.write_consumed_many(&items).await.expect("a reply");
    assert!(again
        .iter()
        .enumerate()
        .all(|(i, o)| i == 7 || matches!(o, Ok(false))));

    // Redis lost its scripts: loaded, and the pipeline sent again.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut rc)
        .await
        .expect("flush");
    let newer: Vec<ConsumedWrite> = items
        .iter()
        .map(|w| ConsumedWrite {
            gen: 3,
            ..w.clone()
        })
        .collect();
    let out = fast.write_consumed_many(&newer).await.expect("a reply");
    assert!(out
        .iter()
        .enumerate()
        .all(|(i, o)| i == 7 || matches!(o, Ok(true))));
    assert_eq!(
        field(&r, &app.token_key(&items[0].token), "g")
            .await
            .as_deref(),
        Some("3")
    );
    app.stop().await;
}

/// A batch of durable consumes committed in Postgres whose write-back
/// pipeline gets no reply (its link to Redis cut): nothing is written, every
/// key keeps the provisional marker of its claim, and reconcile, once the
/// markers are past their deadline, writes each token's consumed state at
/// Postgres's generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_back_pipeline_that_fails_leaves_reconcile_able_to_repair() {
    let redis = RedisProc::start();
    let link = Link::to(redis.port).await;
    let stores = Stores::fresh().redis(&redis.url());
    let app = spawn_app_on(stores.clone()).await;
    let r = redis.conn().await;
    let pg = app.pg().await;
    let (direct, _) = fast_tier(&stores);
    let (linked, _) = fast_tier(
        &stores
            .clone()
            .redis(&format!("redis://127.0.0.1:{}", link.port())),
    );

    // Ten tokens claimed in Redis (as step 2 of a consume does), then
    // decided together in Postgres (one batch statement).
    let mut items = Vec::new();
    let mut records = Vec::new();
    for i in 0..10 {
        let token = app.issue(PAYMENTS, "order", &format!("u-{i}")).await;
        records.push(record(&pg, &token).await);
        let owner = format!("owner-{i}");
        let attempt = Attempt {
            owner: Some(&owner),
            request_id: None,
            fingerprint: None,
        };
        direct
            .consume_versioned(&token, ConsumeMode::Durable, &attempt, 300, None)
            .await
            .expect("claimed");
    }
    records.sort_by_key(|r| r.id);
    let batch: Vec<ConsumeItem> = records
        .iter()
        .map(|record| ConsumeItem {
            record: record.clone(),
            fingerprint: None,
            request_id: Some(format!("r-{}", record.id)),
        })
        .collect();
    let refs: Vec<&ConsumeItem> = batch.iter().collect();
    let decided: Vec<_> = consume_batch(&pg, &refs)
        .await
        .expect("batch")
        .into_iter()
        .map(|a| a.expect("decided"))
        .collect();
    for ((row, gen), item) in decided.iter().zip(&batch) {
        let ConsumeRow::Won { consumed_at } = row else {
            panic!("not won: {row:?}");
        };
        items.push(ConsumedWrite {
            token: item.record.token.clone(),
            gen: *gen,
            marker: Marker {
                at_ms: consumed_at.timestamp_millis(),
                request_id: item.request_id.clone(),
                fingerprint: None,
                result: None,
            },
        });
    }

    // The link is cut under the pipeline's connection.
    linked.probe().await;
    link.cut();
    assert!(
        linked.write_consumed_many(&items).await.is_err(),
        "no reply, no outcome"
    );
    for w in &items {
        let key = app.token_key(&w.token);
        assert_eq!(field(&r, &key, "s").await.as_deref(), Some("p"), "{key}");
    }

    // Reconcile, once every claim is past its deadline (300 ms) by Redis's
    // clock.
    eventually(10, || async {
        let mut rc = r.clone();
        let (secs, micros): (i64, i64) =
            redis::cmd("TIME").query_async(&mut rc).await.expect("time");
        let now = secs * 1000 + micros / 1000;
        for w in &items {
            let d = field(&r, &app.token_key(&w.token), "d").await?;
            if d.parse::<i64>().ok()? >= now {
                return None;
            }
        }
        Some(())
    })
    .await;
    let settings = stores.settings();
    let pools = Pools::new(&settings.postgres).expect("pools");
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let reconciler = Reconciler::new(&settings, pools.admin.clone(), direct.clone(), clock);
    let report = reconciler
        .run(
            &Options {
                dry_run: false,
                since: None,
                by: BY_CLI.to_owned(),
            },
            &Quiet,
            &CancellationToken::new(),
        )
        .await
        .expect("reconcile runs");
    assert_eq!(report.repaired.get(Class::StaleProvisional), 10);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    for w in &items {
        let key = app.token_key(&w.token);
        assert_eq!(field(&r, &key, "s").await.as_deref(), Some("c"), "{key}");
        assert_eq!(field(&r, &key, "g").await, Some(w.gen.to_string()));
    }
    pools.close().await;
    app.stop().await;
}

/// Forty durable keys consumed, then their results sent at once (one result
/// statement at a time, so the others queue into batches): every result is
/// in Redis when its `recorded` answer arrives (read your writes), and the
/// results reach Redis in fewer calls than results, since those one batch
/// recorded ride one pipeline instead of a call each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn results_recorded_together_reach_redis_in_pipelines_before_their_answers() {
    let _heavy = heavy().await;
    let app = spawn_app_batching().await;
    const KEYS: usize = 40;
    let run = uuid::Uuid::new_v4();
    let biz = BizType::parse("order").expect("biz");
    let key = |i: usize| format!("k-{run}-{i}");
    for i in 0..KEYS {
        let (s, _, b) = calls::consume_key(
            &app,
            &json!({"biz_type": "order", "key": key(i), "request_id": format!("r-{i}")}),
        )
        .await;
        assert_eq!(
            (s, b["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{b}"
        );
    }
    // The consumes' own write-backs are done before the results start.
    let r = app.redis().await;
    for i in 0..KEYS {
        let handle = identity("payments", &biz, &ClientKey::parse(&key(i)).expect("key")).handle;
        let k = app.token_key(&handle);
        eventually(10, || {
            let r = &r;
            let k = &k;
            async move { (field(r, k, "s").await.as_deref() == Some("c")).then_some(()) }
        })
        .await;
    }
    let writes = |text: &str| {
        scrape::redis_calls(text, "writeback") + scrape::redis_calls(text, "writeback_pipeline")
    };
    let before = writes(&app.metrics_text().await);

    let barrier = Arc::new(tokio::sync::Barrier::new(KEYS));
    let mut handles = Vec::new();
    for i in 0..KEYS {
        let (app, barrier, r, biz, key) =
            (app.clone(), barrier.clone(), r.clone(), biz.clone(), key(i));
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            let (s, _, b) = answer(
                app.post(
                    PAYMENTS,
                    "/v1/keys/result",
                    &json!({"biz_type": "order", "key": key, "result": {"n": i}}),
                )
                .await,
            )
            .await;
            // Read at once, before anything else can have written it.
            let handle = identity("payments", &biz, &ClientKey::parse(&key).expect("key")).handle;
            let res = field(&r, &app.token_key(&handle), "res").await;
            (i, s, b, res)
        }));
    }
    for h in handles {
        let (i, s, b, res) = h.await.expect("task");
        assert_eq!(
            (s, b["outcome"].as_str()),
            (StatusCode::OK, Some("recorded")),
            "key {i}: {b}"
        );
        let res: Value = serde_json::from_str(res.as_deref().unwrap_or("null")).expect("json");
        assert_eq!(
            res,
            json!({"n": i}),
            "key {i}: Redis holds its result when it is answered"
        );
    }
    let calls = writes(&app.metrics_text().await) - before;
    assert!(
        calls < KEYS as f64,
        "{calls} Redis write calls for {KEYS} results recorded together"
    );
    Arc::try_unwrap(app).ok().expect("sole owner").stop().await;
}

/// A durable key's result whose write to Redis fails (its instance's link to
/// Redis cut): Postgres recorded it, so it is answered `recorded` (after the
/// marker's trust), and the write is not forgotten: once the link is back,
/// Redis gets the marker with the result, and a duplicate answers with it.
/// The result rides the write-backs' pipeline, so its failure comes back to
/// the result's caller from there (`WriteBacks::send`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_result_whose_redis_write_fails_is_answered_and_written_once_redis_is_back() {
    let redis = RedisProc::start();
    let link = Link::to(redis.port).await;
    let stores = Stores::fresh().redis(&format!("redis://127.0.0.1:{}", link.port()));
    let app = spawn_app_on(stores.clone()).await;
    let r = redis.conn().await;
    let key = format!("k-{}", uuid::Uuid::new_v4());
    let biz = BizType::parse("order").expect("biz");
    let handle = identity("payments", &biz, &ClientKey::parse(&key).expect("key")).handle;
    let redis_key = app.token_key(&handle);
    let (s, _, b) = calls::consume_key(
        &app,
        &json!({"biz_type": "order", "key": key, "request_id": "r-1"}),
    )
    .await;
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{b}"
    );
    eventually(10, || {
        let (r, k) = (&r, &redis_key);
        async move { (field(r, k, "s").await.as_deref() == Some("c")).then_some(()) }
    })
    .await;

    link.cut();
    let result = json!({"payment_id": "p-1"});
    let (s, _, b) = answer(
        app.post(
            PAYMENTS,
            "/v1/keys/result",
            &json!({"biz_type": "order", "key": key, "result": result}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("recorded")),
        "{b}"
    );
    assert_eq!(
        field(&r, &redis_key, "res").await,
        None,
        "the link was cut: nothing reached Redis"
    );

    link.open();
    let res = eventually(30, || {
        let (r, k) = (&r, &redis_key);
        async move { field(r, k, "res").await }
    })
    .await;
    let res: Value = serde_json::from_str(&res).expect("json");
    assert_eq!(res, result, "the queued write reached Redis");
    let (s, _, dup) = calls::consume_key(
        &app,
        &json!({"biz_type": "order", "key": key, "request_id": "r-2"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{dup}");
    assert_eq!(dup["result"], result, "{dup}");
    app.stop().await;
}
