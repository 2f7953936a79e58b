//! Waiting for the winner (`wait_ms`): consumes that would answer
//! `processing` wait for the winner's result or release, on this instance
//! or another, holding no connection; at the end of the wait they answer
//! `processing` as without one.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

async fn consume_waiting(
    app: &TestApp,
    token: &str,
    request_id: &str,
    wait_ms: u64,
) -> (StatusCode, bool, Value) {
    answer(
        app.consume(
            PAYMENTS,
            token,
            &json!({"subject": "u-wait", "request_id": request_id, "wait_ms": wait_ms}),
        )
        .await,
    )
    .await
}

async fn waiters_reach(app: &TestApp, n: usize) {
    eventually(20, || async move {
        (app.ledger.waiting_consumes() >= n).then_some(())
    })
    .await;
}

/// 1,000 retries of one token wait: 980 on one instance and 20 on another; one
/// result answers every one of them `completed` with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_waiter_on_every_instance_is_answered_by_one_result() {
    let _heavy = heavy().await;
    // On the result, the 980 waiters of a durable type each read the token
    // again through 8 connections; beside the rest of the suite on 2 cores
    // that can take longer than the default 1 s acquire bound (a 503, which
    // is the service's answer to overload, not what this test is about).
    let stores = Stores::fresh().with("postgres.acquire_timeout = \"5s\"");
    let a = Arc::new(spawn_app_on(stores.clone()).await);
    let b = Arc::new(spawn_app_on(stores).await);
    for biz in ["order", "like"] {
        let token = a.issue(PAYMENTS, biz, "u-wait").await;
        let (s, _, won) = consume_waiting(&a, &token, "winner", 0).await;
        assert_eq!(
            (s, won["outcome"].as_str()),
            (StatusCode::OK, Some("consumed"))
        );
        let (dup_a, dup_b) = (duplicates(&a, biz).await, duplicates(&b, biz).await);
        let waiting: Vec<_> = (0..1000)
            .map(|i| {
                let app = if i < 980 { a.clone() } else { b.clone() };
                let token = token.clone();
                tokio::spawn(async move {
                    consume_waiting(&app, &token, &format!("retry-{i}"), 10_000).await
                })
            })
            .collect();
        waiters_reach(&a, 980).await;
        waiters_reach(&b, 20).await;
        let r = a
            .post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/result"),
                &json!({"subject": "u-wait", "result": {"paid": biz}}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK, "{biz}");
        let answered = tokio::time::timeout(Duration::from_secs(8), join_all(waiting))
            .await
            .expect("every waiter answered well before its wait ends");
        for w in answered {
            let (s, replayed, body) = w.unwrap();
            assert_eq!(s, StatusCode::OK, "{biz}: {body}");
            assert!(replayed, "{biz}: {body}");
            assert_eq!(
                (body["outcome"].as_str(), body["status"].as_str()),
                (Some("duplicate"), Some("completed")),
                "{biz}: {body}"
            );
            assert_eq!(body["result"], json!({"paid": biz}), "{biz}");
        }
        assert_eq!(a.ledger.waiting_consumes(), 0);
        assert_eq!(b.ledger.waiting_consumes(), 0);
        // Each waiter is one duplicate, however often it looked.
        assert_eq!(
            (
                duplicates(&a, biz).await - dup_a,
                duplicates(&b, biz).await - dup_b
            ),
            (980, 20),
            "{biz}"
        );
    }
}

/// `ledger_consume_total{biz_type, outcome="duplicate"}` of one instance.
async fn duplicates(app: &TestApp, biz: &str) -> u64 {
    let text = app.metrics_text().await;
    let prefix = format!("ledger_consume_total{{biz_type=\"{biz}\",outcome=\"duplicate\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A waiter wins the token its winner releases; the others go on waiting
/// for that new winner, and a wait that ends answers `processing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_wins_after_a_release_and_a_wait_that_ends_answers_processing() {
    let app = Arc::new(spawn_app().await);
    let token = app.issue(PAYMENTS, "order", "u-wait").await;
    let (_, _, won) = consume_waiting(&app, &token, "first", 0).await;
    assert_eq!(won["outcome"], "consumed");
    let waiting: Vec<_> = (0..3)
        .map(|i| {
            let (app, token) = (app.clone(), token.clone());
            tokio::spawn(
                async move { consume_waiting(&app, &token, &format!("w-{i}"), 3_000).await },
            )
        })
        .collect();
    waiters_reach(&app, 3).await;
    let r = app
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{token}/release"),
            &json!({"subject": "u-wait"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let started = std::time::Instant::now();
    let mut consumed = 0;
    for w in join_all(waiting).await {
        let (s, _, body) = w.unwrap();
        assert_eq!(s, StatusCode::OK, "{body}");
        match (body["outcome"].as_str(), body["status"].as_str()) {
            (Some("consumed"), _) => consumed += 1,
            (Some("duplicate"), Some("processing")) => {}
            other => panic!("{other:?}: {body}"),
        }
    }
    assert_eq!(consumed, 1, "exactly one waiter won the released token");
    assert!(
        started.elapsed() >= Duration::from_millis(1_500),
        "the others waited out their wait"
    );

    // Out of range: refused before anything happens.
    for bad in [json!(10_001), json!(-1), json!("5")] {
        let (s, _, body) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u-wait", "wait_ms": bad}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_request")),
            "{bad}"
        );
    }
    // Client keys wait the same way.
    let key = json!({"biz_type": "order", "key": "k-wait", "request_id": "k-1"});
    let (s, _, body) = answer(app.post(PAYMENTS, "/v1/keys/consume", &key).await).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let waiter = {
        let app = app.clone();
        tokio::spawn(async move {
            answer(
                app.post(
                    PAYMENTS,
                    "/v1/keys/consume",
                    &json!({"biz_type": "order", "key": "k-wait", "request_id": "k-2", "wait_ms": 5000}),
                )
                .await,
            )
            .await
        })
    };
    waiters_reach(&app, 1).await;
    let r = app
        .post(
            PAYMENTS,
            "/v1/keys/result",
            &json!({"biz_type": "order", "key": "k-wait", "result": 7}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let (s, _, body) = waiter.await.unwrap();
    assert_eq!(
        (s, body["status"].as_str(), &body["result"]),
        (StatusCode::OK, Some("completed"), &json!(7)),
        "{body}"
    );
}

/// Results recorded together are told to the fleet together: 1,000 durable
/// keys claimed, then given their results all at once, while the test
/// listens on the fleet's channel. Every key's change reaches the listener,
/// and the test database committed fewer transactions in all, from the
/// service's start to its stop, than there were results: a `pg_notify` per
/// result, each in a transaction of its own, would alone have taken one per
/// result.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn results_recorded_together_are_told_to_the_fleet_in_fewer_transactions_than_results() {
    let _heavy = heavy().await;
    // 2,000 requests of one client at once: the default ceiling's whole
    // burst (a 429 is not what this test is about).
    let stores = Stores::fresh()
        .with("postgres.acquire_timeout = \"10s\"")
        .with(UNLIMITED_CLIENTS);
    let app = Arc::new(spawn_app_on(stores.clone()).await);
    let mut listener = sqlx::postgres::PgListener::connect(&stores.db_url())
        .await
        .expect("listener");
    listener
        .listen(idempotency_ledger::changes::CHANNEL)
        .await
        .expect("LISTEN");
    const KEYS: usize = 1000;
    let run = uuid::Uuid::new_v4();
    let fire = |path: &'static str, body: fn(&str) -> Value| {
        let app = app.clone();
        async move {
            let calls = (0..KEYS).map(|i| {
                let (app, body) = (app.clone(), body(&format!("t-{run}-{i}")));
                tokio::spawn(async move { answer(app.post(PAYMENTS, path, &body).await).await })
            });
            for a in join_all(calls).await {
                let (s, _, b) = a.expect("request task");
                assert_eq!(s, StatusCode::OK, "{path}: {b}");
            }
        }
    };
    fire(
        "/v1/keys/consume",
        |k| json!({"biz_type": "order", "key": k}),
    )
    .await;
    fire(
        "/v1/keys/result",
        |k| json!({"biz_type": "order", "key": k, "result": {"ok": true}}),
    )
    .await;

    let pg = app.pg().await;
    let ids: std::collections::HashSet<i64> =
        sqlx::query_scalar("SELECT id FROM tokens WHERE key LIKE $1 AND result IS NOT NULL")
            .bind(format!("t-{run}-%"))
            .fetch_all(&pg)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(ids.len(), KEYS);
    let mut told = std::collections::HashSet::new();
    while !ids.is_subset(&told) {
        let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("every change told within 10 s")
            .expect("notification");
        if let Ok(id) = n.payload().parse::<i64>() {
            told.insert(id);
        }
    }

    // Every other connection to the test database gone, so that its
    // backends have reported their transactions.
    drop(listener);
    Arc::try_unwrap(app).ok().expect("sole owner").stop().await;
    pg.close().await;
    let observer = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&stores.db_url())
        .await
        .unwrap();
    // Up to 20 s for the other backends to go; if one stays, say whose.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let others: Vec<(Option<String>, Option<String>, Option<String>)> = sqlx::query_as(
            "SELECT application_name, state, left(query, 120) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_all(&observer)
        .await
        .unwrap();
        if others.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "other connections to the test database 20 s after the service stopped: {others:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let commits: i64 = sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&observer)
    .await
    .unwrap();
    assert!(
        commits < KEYS as i64,
        "{commits} transactions for {KEYS} claims and {KEYS} results"
    );
}
