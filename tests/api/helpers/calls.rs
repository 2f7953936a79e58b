//! One-line calls of the routes that several test files make: a consume
//! (status, replayed, body), a release, a reconcile run over HTTP, and one
//! number of `/metrics`.

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
