//! Bad input: a clear error, and nothing changes.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

#[tokio::test]
async fn missing_or_wrong_api_keys_are_401() {
    let app = spawn_app().await;
    let body = json!({"biz_type": "order", "subject": "u"});
    let r = app
        .http
        .post(app.url("/v1/tokens"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let (s, _, b) = answer(r).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("unauthorized"))
    );
    for auth in [
        "Bearer nope",
        "Basic ZGV2LXBheW1lbnRzLWtleTo=",
        "dev-payments-key",
        "Bearer ",
    ] {
        let r = app
            .http
            .post(app.url("/v1/tokens"))
            .header("authorization", auth)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "{auth}");
    }
    // Authentication comes before the body is looked at.
    let r = app
        .http
        .post(app.url("/v1/tokens"))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn bad_bodies_are_400_413_415() {
    let app = spawn_app().await;
    let send = |body: String, ct: Option<&'static str>| {
        let mut req = app
            .http
            .post(app.url("/v1/tokens"))
            .bearer_auth(PAYMENTS)
            .body(body);
        if let Some(ct) = ct {
            req = req.header("content-type", ct);
        }
        req.send()
    };
    let json_ct = Some("application/json");
    let cases: Vec<(String, Option<&'static str>, StatusCode, &str)> = vec![
        (
            r#"{"biz_type":"order","subject":"u","extra":1}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order","subject":42}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order","subject":"u","ttl_seconds":"60"}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order","subject":"u","ttl_seconds":-1}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order","subject":"u","ttl_seconds":1.5}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order"}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"Order!","subject":"u"}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order","subject":""}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            format!(r#"{{"biz_type":"order","subject":"{}"}}"#, "x".repeat(129)),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order","subject":"a\u0007b"}"#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order","#.into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            "[]".into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            "".into(),
            json_ct,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            r#"{"biz_type":"order","subject":"u"}"#.into(),
            None,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            r#"{"biz_type":"order","subject":"u"}"#.into(),
            Some("text/plain"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            format!(
                r#"{{"biz_type":"order","subject":"u","pad":"{}"}}"#,
                "x".repeat(9000)
            ),
            json_ct,
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
    ];
    for (body, ct, status, code) in cases {
        let short: String = body.chars().take(60).collect();
        let (s, _, b) = answer(send(body, ct).await.unwrap()).await;
        assert_eq!(
            (s, b["error"].as_str()),
            (status, Some(code)),
            "{short} ({ct:?}): {b}"
        );
        assert!(b["message"].is_string());
    }
    // application/json with a charset is fine.
    let r = send(
        r#"{"biz_type":"order","subject":"u"}"#.into(),
        Some("application/json; charset=utf-8"),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    // Nothing but that one token was issued.
    let text = app.metrics_text().await;
    assert!(text.contains("ledger_tokens_issued_total{biz_type=\"order\"} 1"));
}

#[tokio::test]
async fn bad_consume_bodies_change_nothing() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "u").await;
    for body in [
        json!({"subject": "u", "unknown": true}),
        json!({"subject": 7}),
        json!({}),
        json!({"subject": "u", "fingerprint": ""}),
        json!({"subject": "u", "request_id": "ü"}),
        json!({"subject": "u", "biz_type": "NOPE"}),
        json!({"subject": "u", "request_id": "x".repeat(129)}),
    ] {
        let (s, _, b) = answer(app.consume(PAYMENTS, &token, &body).await).await;
        assert_eq!(
            (s, b["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_request")),
            "{body}"
        );
    }
    let (_, replayed, b) = answer(
        app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
            .await,
    )
    .await;
    assert_eq!((b["outcome"].as_str(), replayed), (Some("consumed"), false));
}

#[tokio::test]
async fn routing_errors_use_the_error_shape() {
    let app = spawn_app().await;
    let r = app.get(PAYMENTS, "/v1/nothing-here").await;
    let (s, _, b) = answer(r).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    let r = app.get(PAYMENTS, "/v1/tokens").await;
    let (s, _, b) = answer(r).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::METHOD_NOT_ALLOWED, Some("method_not_allowed"))
    );
    let r = app
        .http
        .delete(app.url("/v1/tokens/x/consume"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn odd_token_texts_in_paths_are_token_invalid_never_5xx() {
    let app = spawn_app().await;
    let long = "a".repeat(10_000);
    for path_token in [
        "%2F..%2Fadmin",
        "order_dev1_%00",
        "%E2%82%AC",
        "order_dev1_a%2Fb",
        long.as_str(),
        "order_dev1_===",
    ] {
        let r = app
            .http
            .post(app.url(&format!("/v1/tokens/{path_token}/consume")))
            .bearer_auth(PAYMENTS)
            .json(&json!({"subject": "u"}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        assert!(!status.is_server_error(), "{path_token}: {status}");
        assert!(
            body["error"] == "token_invalid" || body["error"] == "not_found",
            "{}: {status} {body}",
            &path_token[..path_token.len().min(40)]
        );
    }
}

/// Found by the schema fuzzer: an audit filter holding a NUL (`%00`) went
/// to Postgres, which refuses a NUL in text, and the answer was 500. A
/// filter with a control character is the caller's mistake: 400.
#[tokio::test]
async fn audit_filters_with_control_characters_are_400_never_500() {
    let app = spawn_app().await;
    for filter in ["subject", "biz_type", "order_id", "client"] {
        for value in ["%00m", "a%17b", "%0A"] {
            let r = app
                .get(ADMIN, &format!("/v1/admin/audit?{filter}={value}"))
                .await;
            let (s, _, b) = answer(r).await;
            assert_eq!(
                (s, b["error"].as_str()),
                (StatusCode::BAD_REQUEST, Some("invalid_request")),
                "{filter}={value}: {b}"
            );
        }
    }
    let r = app.get(ADMIN, "/v1/admin/audit?subject=alice").await;
    assert_eq!(r.status(), StatusCode::OK);
}
