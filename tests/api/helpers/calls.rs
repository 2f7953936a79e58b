//! One-line calls of the routes that several test files make: a consume of
//! a token or of a client key (status, replayed, body), a release, a
//! reconcile run over HTTP, and one number of `/metrics`.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

/// `POST /v1/admin/reconcile` (not a dry run): the report.
pub async fn reconcile(app: &TestApp) -> Value {
    let r = app.post(ADMIN, "/v1/admin/reconcile", &json!({})).await;
    let (status, _, body) = answer(r).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

/// A consume by the payments client: status, replayed, body.
pub async fn consume(app: &TestApp, token: &str, body: Value) -> (StatusCode, bool, Value) {
    answer(app.consume(PAYMENTS, token, &body).await).await
}

/// A consume of a client key by the payments client (`body`: biz type,
/// key and the rest): status, replayed, body.
pub async fn consume_key(app: &TestApp, body: &Value) -> (StatusCode, bool, Value) {
    answer(app.post(PAYMENTS, "/v1/keys/consume", body).await).await
}

/// The number on the first `/metrics` line that starts with `name` (0 when
/// there is none).
pub async fn metric(app: &TestApp, name: &str) -> f64 {
    app.metrics_text()
        .await
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A release by the payments client for `subject`: its status.
pub async fn release(app: &TestApp, token: &str, subject: &str) -> StatusCode {
    app.post(
        PAYMENTS,
        &format!("/v1/tokens/{token}/release"),
        &json!({ "subject": subject }),
    )
    .await
    .status()
}

/// Waits (up to `secs`) until Postgres holds exactly `n` consumed tokens of
/// `biz` (the journal of a fast type drained, say).
pub async fn consumed_in_postgres(pool: &sqlx::PgPool, biz: &str, n: i64, secs: u64) {
    eventually(secs, || {
        let pool = pool.clone();
        async move {
            let got: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM tokens WHERE biz_type = $1 AND state = 'consumed'",
            )
            .bind(biz)
            .fetch_one(&pool)
            .await
            .ok()?;
            (got == n).then_some(())
        }
    })
    .await;
}

/// `copies` identical consumes of every token at once, spread over `apps` in
/// turn, token `i` bound to `subject(i)`: how many consumes of each token
/// answered `consumed` (every answer must be a 200).
pub async fn consume_race(
    apps: &[std::sync::Arc<TestApp>],
    tokens: &[String],
    copies: usize,
    subject: fn(usize) -> String,
) -> Vec<usize> {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(tokens.len() * copies));
    let mut handles = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        for copy in 0..copies {
            let app = apps[copy % apps.len()].clone();
            let (barrier, token) = (barrier.clone(), token.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                let (s, _, body) = answer(
                    app.consume(PAYMENTS, &token, &json!({"subject": subject(i)}))
                        .await,
                )
                .await;
                (i, s, body["outcome"].as_str().unwrap_or("?").to_owned())
            }));
        }
    }
    let mut consumed = vec![0; tokens.len()];
    for h in handles {
        let (i, s, outcome) = h.await.expect("a consume task");
        assert_eq!(s, StatusCode::OK);
        if outcome == "consumed" {
            consumed[i] += 1;
        }
    }
    consumed
}
