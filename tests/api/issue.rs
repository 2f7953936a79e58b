//! Issuing tokens, and the seed's alias.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

#[tokio::test]
async fn issue_returns_the_contract_fields() {
    let app = spawn_app().await;
    let r = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "order", "subject": "user-42", "ttl_seconds": 30}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
    let body: Value = r.json().await.unwrap();
    let token = body["token"].as_str().unwrap();
    assert!(token.starts_with("order_"), "{token}");
    assert!(token.len() <= 128);
    assert!(token
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'));
    assert_eq!(body["biz_type"], "order");
    assert_eq!(body["subject"], "user-42");
    assert_eq!(body["expire_time"], 30);
    let expires =
        chrono::DateTime::parse_from_rfc3339(body["expires_at"].as_str().unwrap()).unwrap();
    let left = expires.timestamp() - chrono::Utc::now().timestamp();
    assert!((29..=32).contains(&left), "expires in {left} s");

    // The Redis key exists before the answer, with a relative TTL.
    let mut redis = app.redis().await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg(app.token_key(token))
        .query_async(&mut redis)
        .await
        .unwrap();
    assert!(ttl > 25_000 && ttl <= 32_000, "pttl {ttl}");

    // The issuance record reaches Postgres shortly after.
    let pool = app.pg().await;
    eventually(5, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM audit_events WHERE kind = 'token.issued' AND subject = 'user-42'",
            )
            .fetch_one(&pool)
            .await
            .ok()?;
            (n == 1).then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn ttl_defaults_to_the_biz_type_and_is_bounded_by_it() {
    let app = spawn_app().await;
    let r = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "refund", "subject": "u"}),
        )
        .await;
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["expire_time"], 600);
    for bad in [0, 601] {
        let r = app
            .post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": "refund", "subject": "u", "ttl_seconds": bad}),
            )
            .await;
        let (status, _, body) = answer(r).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "ttl {bad}");
        assert_eq!(body["error"], "invalid_request");
    }
}

#[tokio::test]
async fn unknown_and_forbidden_biz_types() {
    let app = spawn_app().await;
    let r = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "nope", "subject": "u"}),
        )
        .await;
    let (status, _, body) = answer(r).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("unknown_biz_type"))
    );
    // Unknown comes before the ttl check.
    let r = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "nope", "subject": "u", "ttl_seconds": 0}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    // refunds may only use `refund`.
    let r = app
        .post(
            REFUNDS,
            "/v1/tokens",
            &json!({"biz_type": "order", "subject": "u"}),
        )
        .await;
    let (status, _, body) = answer(r).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden"))
    );
}

#[tokio::test]
async fn seed_alias_issues_with_the_same_auth() {
    let app = spawn_app().await;
    let r = app
        .get(PAYMENTS, "/api/token/generate?bizType=order&userId=user-42")
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["expireTime"], 60);
    let token = body["token"].as_str().unwrap().to_owned();
    let (status, _, body) = answer(
        app.consume(PAYMENTS, &token, &json!({"subject": "user-42"}))
            .await,
    )
    .await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );

    let r = app
        .http
        .get(app.url("/api/token/generate?bizType=order&userId=u"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = app.get(PAYMENTS, "/api/token/generate?bizType=order").await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = app
        .get(REFUNDS, "/api/token/generate?bizType=order&userId=u")
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn issuing_is_rate_limited_per_subject() {
    let app = spawn_app_on(Stores::fresh().with("biz.order.issue_rate = \"5/s\"")).await;
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let r = app
            .post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": "order", "subject": "hot"}),
            )
            .await;
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        statuses.push((r.status(), retry));
    }
    assert!(
        statuses[..5].iter().all(|(s, _)| *s == StatusCode::CREATED),
        "{statuses:?}"
    );
    assert_eq!(statuses[5].0, StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = statuses[5].1.as_deref().unwrap().parse().unwrap();
    assert!(retry >= 1);
    // Another subject is unaffected.
    let r = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "order", "subject": "calm"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
}

#[tokio::test]
async fn operations_endpoints() {
    let app = spawn_app().await;
    assert_eq!(
        app.http
            .get(app.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    let r = app.http.get(app.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["postgres"], "up");
    assert_eq!(body["redis"], "up");
    assert_eq!(body["mode"], "normal");

    let token = app.issue(PAYMENTS, "order", "m").await;
    app.consume(PAYMENTS, &token, &json!({"subject": "m"}))
        .await;
    let text = app.metrics_text().await;
    for name in [
        "ledger_tokens_issued_total{biz_type=\"order\"} 1",
        "ledger_consume_total{biz_type=\"order\",outcome=\"consumed\"} 1",
        "ledger_request_duration_seconds_bucket",
        "ledger_tier_duration_seconds_bucket",
        "ledger_mode{mode=\"normal\"} 1",
        "ledger_bloom_fill_ratio",
        "ledger_fast_tier_total{result=\"hit\"}",
    ] {
        assert!(text.contains(name), "metrics lack {name}");
    }
    assert!(!text.contains(&token), "metrics never carry token texts");

    let spec: Value = app
        .http
        .get(app.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(spec["openapi"].as_str().unwrap().starts_with("3."));
    for path in [
        "/v1/tokens",
        "/v1/tokens/{token}/consume",
        "/v1/tokens/{token}/result",
        "/v1/tokens/{token}/release",
        "/readyz",
    ] {
        assert!(spec["paths"][path].is_object(), "spec lacks {path}");
    }
}
