//! Calls with a client timeout, for the fault tests: a hung request fails
//! the test instead of hanging it. One consume (or `None` when no answer
//! came), a storm of identical consumes counted per token, the readiness
//! mode waited for, one metric line, and a breaker quick enough to react
//! within a test.

use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::*;

/// No request of these tests may take longer (a bound, not a benchmark).
pub const REQUEST_BOUND: Duration = Duration::from_secs(10);

/// Short Redis timeouts and backoff, so the breaker reacts within a test.
pub const QUICK_BREAKER: &str = r#"
redis.timeout = "300ms"
redis.down_backoff = "300ms"
postgres.acquire_timeout = "5s"
biz.like.ttl = "60s"
"#;

pub fn bounded_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(REQUEST_BOUND)
        .pool_max_idle_per_host(64)
        .build()
        .expect("client")
}

/// One consume; `None` when no answer came (connection lost, timeout).
pub async fn try_consume(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    body: &Value,
) -> Option<(StatusCode, bool, Value)> {
    let r = http
        .post(format!("{base}/v1/tokens/{token}/consume"))
        .bearer_auth(PAYMENTS)
        .json(body)
        .send()
        .await
        .ok()?;
    let status = r.status();
    let replayed = r
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let retry_after = r.headers().get("retry-after").cloned();
    let mut body = r.json::<Value>().await.ok()?;
    if let Some(v) = retry_after {
        body["retry_after"] = json!(v.to_str().unwrap_or(""));
    }
    Some((status, replayed, body))
}

pub async fn consume(app: &TestApp, token: &str, body: &Value) -> (StatusCode, bool, Value) {
    try_consume(&bounded_client(), &app.address, token, body)
        .await
        .expect("the consume answered within the bound")
}

pub async fn readyz(http: &reqwest::Client, base: &str) -> Option<(StatusCode, Value)> {
    let r = http.get(format!("{base}/readyz")).send().await.ok()?;
    let status = r.status();
    Some((status, r.json().await.ok()?))
}

pub async fn wait_mode(app: &TestApp, secs: u64, mode: &'static str) -> Value {
    let http = bounded_client();
    eventually(secs, || {
        let http = http.clone();
        let base = app.address.clone();
        async move {
            let (_, body) = readyz(&http, &base).await?;
            (body["mode"] == mode).then_some(body)
        }
    })
    .await
}

/// `n` tokens of `biz`, subject `s<i>`.
pub async fn issue_many(app: &TestApp, biz: &str, n: usize) -> Vec<(String, String)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let subject = format!("s{i}");
        out.push((app.issue(PAYMENTS, biz, &subject).await, subject));
    }
    out
}

/// Fires `copies` consumes of every token at once (each copy its own
/// request_id); returns the consumed count per token and every answer.
pub async fn storm(
    app: &Arc<TestApp>,
    tokens: &[(String, String)],
    copies: usize,
    tag: &str,
) -> (Vec<usize>, Vec<(usize, StatusCode, Value)>) {
    let barrier = Arc::new(Barrier::new(tokens.len() * copies));
    let http = bounded_client();
    let mut handles = Vec::new();
    for (i, (token, subject)) in tokens.iter().enumerate() {
        for c in 0..copies {
            let (app, barrier, http) = (app.clone(), barrier.clone(), http.clone());
            let body = json!({"subject": subject, "request_id": format!("{tag}-{i}-{c}")});
            let token = token.clone();
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                let (s, replayed, body) = try_consume(&http, &app.address, &token, &body)
                    .await
                    .expect("answered within the bound");
                if body["outcome"] == "consumed" {
                    assert!(!replayed, "a first use is not a replay");
                }
                (i, s, body)
            }));
        }
    }
    let mut consumed = vec![0; tokens.len()];
    let mut answers = Vec::new();
    for h in handles {
        let (i, s, body) = h.await.expect("task");
        if s == StatusCode::OK && body["outcome"] == "consumed" {
            consumed[i] += 1;
        }
        answers.push((i, s, body));
    }
    (consumed, answers)
}

pub fn assert_all_ok(answers: &[(usize, StatusCode, Value)]) {
    for (i, s, body) in answers {
        assert_eq!(*s, StatusCode::OK, "token {i}: {body}");
        assert!(
            body["outcome"] == "consumed" || body["outcome"] == "duplicate",
            "token {i}: {body}"
        );
    }
}

pub async fn metric(app: &TestApp, line_prefix: &str) -> Option<f64> {
    let text = app
        .http
        .get(app.url("/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
