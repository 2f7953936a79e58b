//! Exactly once under concurrency: many identical requests at once, outcomes counted.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::json;
use tokio::sync::Barrier;

use crate::helpers::calls::consume_race;
use crate::helpers::*;

/// 100 tokens x 10 identical consumes fired together: exactly one `consumed`
/// per token, every other answer a `duplicate`, no errors.
async fn storm(biz: &str) {
    let app = Arc::new(spawn_app().await);
    const TOKENS: usize = 100;
    const COPIES: usize = 10;
    let mut tokens = Vec::new();
    for i in 0..TOKENS {
        tokens.push(app.issue(PAYMENTS, biz, &format!("user-{i}")).await);
    }
    let barrier = Arc::new(Barrier::new(TOKENS * COPIES));
    let mut handles = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        for _ in 0..COPIES {
            let (app, barrier, token) = (app.clone(), barrier.clone(), token.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                let (s, replayed, body) = answer(
                    app.consume(PAYMENTS, &token, &json!({"subject": format!("user-{i}")}))
                        .await,
                )
                .await;
                let outcome = match body["outcome"].as_str() {
                    Some(outcome) => outcome.to_owned(),
                    None => body.to_string(),
                };
                (i, s, replayed, outcome)
            }));
        }
    }
    let mut consumed = vec![0usize; TOKENS];
    let mut duplicates = 0;
    for h in handles {
        let (i, s, replayed, outcome) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "token {i}: {outcome}");
        match outcome.as_str() {
            "consumed" => {
                assert!(!replayed);
                consumed[i] += 1
            }
            "duplicate" => {
                assert!(replayed);
                duplicates += 1
            }
            other => panic!("unexpected outcome {other}"),
        }
    }
    assert!(
        consumed.iter().all(|&n| n == 1),
        "{biz}: consumed counts {consumed:?}"
    );
    assert_eq!(duplicates, TOKENS * (COPIES - 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_durable() {
    let _heavy = heavy().await;
    storm("order").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_fast() {
    let _heavy = heavy().await;
    storm("like").await;
}

/// Racing copies of one request_id all answer `consumed`; exactly one
/// without the replay header.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_copies_of_one_request_id() {
    let _heavy = heavy().await;
    let app = Arc::new(spawn_app().await);
    for round in 0..20 {
        let token = app.issue(PAYMENTS, "order", "u").await;
        let barrier = Arc::new(Barrier::new(8));
        let mut handles = Vec::new();
        for _ in 0..8 {
            let (app, barrier, token) = (app.clone(), barrier.clone(), token.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                answer(
                    app.consume(
                        PAYMENTS,
                        &token,
                        &json!({"subject": "u", "request_id": "same"}),
                    )
                    .await,
                )
                .await
            }));
        }
        let mut fresh = 0;
        for h in handles {
            let (s, replayed, body) = h.await.unwrap();
            assert_eq!(
                (s, body["outcome"].as_str()),
                (StatusCode::OK, Some("consumed")),
                "round {round}: {body}"
            );
            if !replayed {
                fresh += 1;
            }
        }
        assert_eq!(fresh, 1, "round {round}");
    }
}

/// Durable consumes with Redis skipped entirely (Postgres decides alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_durable_without_redis() {
    let _heavy = heavy().await;
    // A Redis URL where nothing listens: every call fails, the breaker opens.
    let stores = Stores::fresh().redis("redis://127.0.0.1:1");
    let app = Arc::new(spawn_app_on(stores).await);
    let mut tokens = Vec::new();
    for i in 0..30 {
        tokens.push(app.issue(PAYMENTS, "order", &format!("u{i}")).await);
    }
    let consumed = consume_race(std::slice::from_ref(&app), &tokens, 5, |i| format!("u{i}")).await;
    assert!(consumed.iter().all(|&n| n == 1), "{consumed:?}");
    let r = app.http.get(app.url("/readyz")).send().await.unwrap();
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (body["redis"].as_str(), body["mode"].as_str()),
        (Some("down"), Some("redis_down"))
    );
}
