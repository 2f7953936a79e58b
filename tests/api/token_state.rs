//! `GET /v1/tokens/{token}?subject=`: a token's state, read by its own client
//! (or an admin) without changing anything, for a durable and a fast biz type.

use std::collections::HashSet;

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

const BIZES: [&str; 2] = ["order", "like"];

async fn read(app: &TestApp, key: &str, token: &str, subject: &str) -> (StatusCode, Value) {
    let (s, replayed, v) = answer(
        app.get(key, &format!("/v1/tokens/{token}?subject={subject}"))
            .await,
    )
    .await;
    assert!(!replayed, "a read never carries Idempotent-Replayed");
    (s, v)
}

async fn state_of(app: &TestApp, token: &str, subject: &str) -> Value {
    let (s, v) = read(app, PAYMENTS, token, subject).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

async fn post_ok(app: &TestApp, path: &str, body: &Value) -> Value {
    let (s, _, v) = answer(app.post(PAYMENTS, path, body).await).await;
    assert_eq!(s, StatusCode::OK, "{path}: {v}");
    v
}

#[tokio::test]
async fn a_token_reads_issued_consumed_with_its_result_and_issued_again_after_a_release() {
    let app = spawn_app().await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "user-42").await;
        let v = state_of(&app, &token, "user-42").await;
        let keys: HashSet<&str> = v
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        let want: HashSet<&str> = [
            "token",
            "biz_type",
            "state",
            "expires_at",
            "consumed_at",
            "result",
        ]
        .into_iter()
        .collect();
        assert_eq!(keys, want, "{biz}: exactly the fields of API.md");
        assert_eq!(
            (
                v["token"].as_str(),
                v["biz_type"].as_str(),
                v["state"].as_str()
            ),
            (Some(token.as_str()), Some(biz), Some("issued")),
            "{biz}"
        );
        chrono::DateTime::parse_from_rfc3339(v["expires_at"].as_str().expect("expires_at"))
            .expect("RFC 3339");
        assert!(v["consumed_at"].is_null() && v["result"].is_null(), "{v}");

        // Reading twice consumed nothing: the first consume still wins.
        assert_eq!(state_of(&app, &token, "user-42").await["state"], "issued");
        let won = post_ok(
            &app,
            &format!("/v1/tokens/{token}/consume"),
            &json!({"subject": "user-42"}),
        )
        .await;
        assert_eq!(won["outcome"], "consumed", "{biz}");
        let v = state_of(&app, &token, "user-42").await;
        assert_eq!(v["state"], "consumed", "{biz}: {v}");
        assert!(v["result"].is_null(), "{biz}: processing, no result yet");
        let consumed_at =
            chrono::DateTime::parse_from_rfc3339(v["consumed_at"].as_str().expect("consumed_at"))
                .expect("RFC 3339");
        let answered_at =
            chrono::DateTime::parse_from_rfc3339(won["consumed_at"].as_str().expect("consumed_at"))
                .expect("RFC 3339");
        assert_eq!(consumed_at, answered_at, "{biz}");

        // Given back: issued again, and consumable again.
        let released = post_ok(
            &app,
            &format!("/v1/tokens/{token}/release"),
            &json!({"subject": "user-42"}),
        )
        .await;
        assert_eq!(released["outcome"], "released");
        let v = state_of(&app, &token, "user-42").await;
        assert_eq!(
            (v["state"].as_str(), v["consumed_at"].is_null()),
            (Some("issued"), true),
            "{biz}: {v}"
        );
        let again = post_ok(
            &app,
            &format!("/v1/tokens/{token}/consume"),
            &json!({"subject": "user-42"}),
        )
        .await;
        assert_eq!(again["outcome"], "consumed", "{biz}");

        // Completed: the result is read back as recorded.
        let result = json!({"payment_id": "p-9", "amount_minor": 1000});
        post_ok(
            &app,
            &format!("/v1/tokens/{token}/result"),
            &json!({"subject": "user-42", "result": result}),
        )
        .await;
        let v = state_of(&app, &token, "user-42").await;
        assert_eq!(
            (v["state"].as_str(), &v["result"]),
            (Some("consumed"), &result),
            "{biz}: {v}"
        );
        assert!(v["consumed_at"].is_string(), "{v}");
    }
    app.stop().await;
}

/// A fast type is read from Redis, which decides it; when Redis no longer
/// holds the token, Postgres answers with what the journal brought it.
#[tokio::test]
async fn a_fast_token_redis_no_longer_holds_is_read_from_postgres() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "like", "u").await;
    post_ok(
        &app,
        &format!("/v1/tokens/{token}/consume"),
        &json!({"subject": "u"}),
    )
    .await;
    post_ok(
        &app,
        &format!("/v1/tokens/{token}/result"),
        &json!({"subject": "u", "result": "liked"}),
    )
    .await;
    let pg = app.pg().await;
    eventually(10, || async {
        let with_result: Option<bool> =
            sqlx::query_scalar("SELECT result IS NOT NULL FROM tokens WHERE token = $1")
                .bind(&token)
                .fetch_optional(&pg)
                .await
                .expect("query");
        (with_result == Some(true)).then_some(())
    })
    .await;
    let mut redis = app.redis().await;
    let _: i64 = redis::cmd("DEL")
        .arg(app.token_key(&token))
        .query_async(&mut redis)
        .await
        .expect("DEL");
    let v = state_of(&app, &token, "u").await;
    assert_eq!(
        (v["state"].as_str(), &v["result"]),
        (Some("consumed"), &json!("liked")),
        "{v}"
    );
    // The read wrote nothing back.
    let exists: i64 = redis::cmd("EXISTS")
        .arg(app.token_key(&token))
        .query_async(&mut redis)
        .await
        .expect("EXISTS");
    assert_eq!(exists, 0);
    app.stop().await;
}

#[tokio::test]
async fn a_token_past_its_expiry_reads_expired() {
    let app = spawn_app().await;
    let past = (chrono::Utc::now().timestamp() - 5) as u32;
    for (i, biz) in BIZES.into_iter().enumerate() {
        let token = app.sign(biz, 88_000_001 + i as u64, past, "payments", "u");
        let v = state_of(&app, &token, "u").await;
        assert_eq!(
            (v["state"].as_str(), v["consumed_at"].is_null()),
            (Some("expired"), true),
            "{biz}: {v}"
        );
        // And a consume still answers token_expired: the read changed nothing.
        let (s, _, body) = answer(
            app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
                .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_expired")),
            "{biz}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn only_the_token_s_own_client_and_subject_read_it_and_forgeries_are_refused() {
    let app = spawn_app().await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "alice").await;
        // Another subject.
        let (s, v) = read(&app, PAYMENTS, &token, "bob").await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("token_mismatch")),
            "{biz}: {v}"
        );
        // No subject, an empty one, another query parameter: a bad request.
        for query in ["", "?subject=", "?subject=alice&x=1"] {
            let (s, _, v) = answer(
                app.get(PAYMENTS, &format!("/v1/tokens/{token}{query}"))
                    .await,
            )
            .await;
            assert_eq!(
                (s, v["error"].as_str()),
                (StatusCode::BAD_REQUEST, Some("invalid_request")),
                "{biz} {query:?}: {v}"
            );
        }
        // A forged tag, garbage, an overlong token.
        let mut forged = token.clone();
        let last = forged.pop().expect("char");
        forged.push(if last == 'A' { 'B' } else { 'A' });
        for bad in [
            forged,
            format!("{biz}_nope"),
            format!("{biz}_{}", "x".repeat(130)),
        ] {
            let (s, v) = read(&app, PAYMENTS, &bad, "alice").await;
            assert_eq!(
                (s, v["error"].as_str()),
                (StatusCode::BAD_REQUEST, Some("token_invalid")),
                "{biz} {bad}: {v}"
            );
        }
        // An admin reads any token, with or without a subject.
        for query in ["", "?subject=anyone"] {
            let (s, _, v) =
                answer(app.get(ADMIN, &format!("/v1/tokens/{token}{query}")).await).await;
            assert_eq!(
                (s, v["state"].as_str()),
                (StatusCode::OK, Some("issued")),
                "{biz} {query:?}: {v}"
            );
        }
        // Without a key.
        let r = app
            .http
            .get(app.url(&format!("/v1/tokens/{token}?subject=alice")))
            .send()
            .await
            .expect("sent");
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
    // Another client's token of a biz type both may use: token_mismatch.
    let refund = app.issue(PAYMENTS, "refund", "alice").await;
    let (s, v) = read(&app, REFUNDS, &refund, "alice").await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::FORBIDDEN, Some("token_mismatch")),
        "{v}"
    );
    // A biz type the client may not use at all: forbidden.
    let order = app.issue(PAYMENTS, "order", "alice").await;
    let (s, v) = read(&app, REFUNDS, &order, "alice").await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden")),
        "{v}"
    );
    // The owner still reads it as issued: nothing was consumed by the refusals.
    assert_eq!(state_of(&app, &refund, "alice").await["state"], "issued");
    app.stop().await;
}

/// Reads, refused reads included, are no consume attempts: the fleet's
/// stats, the duplicate counters and `ledger_consume_total` stay as the
/// consumes left them. One real duplicate at the end is the barrier: once
/// the stats show it, everything counted before it has been flushed too.
#[tokio::test]
async fn reads_change_neither_stats_nor_duplicate_counters() {
    let app = spawn_app().await;
    let mut tokens = Vec::new();
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "u").await;
        post_ok(
            &app,
            &format!("/v1/tokens/{token}/consume"),
            &json!({"subject": "u"}),
        )
        .await;
        let mut forged = token.clone();
        let last = forged.pop().expect("char");
        forged.push(if last == 'A' { 'B' } else { 'A' });
        for _ in 0..3 {
            assert_eq!(state_of(&app, &token, "u").await["state"], "consumed");
            assert_eq!(
                read(&app, PAYMENTS, &token, "v").await.0,
                StatusCode::FORBIDDEN
            );
            assert_eq!(
                read(&app, PAYMENTS, &forged, "u").await.0,
                StatusCode::BAD_REQUEST
            );
        }
        tokens.push((biz, token));
    }
    // The barrier: one duplicate of the durable token.
    let (_, _, dup) = answer(
        app.consume(PAYMENTS, &tokens[0].1, &json!({"subject": "u"}))
            .await,
    )
    .await;
    assert_eq!(dup["outcome"], "duplicate");
    let stats = eventually(15, || async {
        let (s, _, v) = answer(app.get(ADMIN, "/v1/admin/stats?window=1h").await).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        (v["biz_types"]["order"]["duplicates"] == 1).then_some(v)
    })
    .await;
    for (biz, duplicates) in [("order", 1), ("like", 0)] {
        let b = &stats["biz_types"][biz];
        assert_eq!(
            (
                &b["issued"],
                &b["consumed"],
                &b["duplicates"],
                &b["invalid"],
                &b["expired"]
            ),
            (
                &json!(1),
                &json!(1),
                &json!(duplicates),
                &json!(0),
                &json!(0)
            ),
            "{biz}: {b}"
        );
    }
    let view = eventually(10, || async {
        let (s, _, v) = answer(
            app.get(ADMIN, &format!("/v1/admin/tokens/{}", tokens[0].1))
                .await,
        )
        .await;
        (s == StatusCode::OK && v["duplicate_attempts"] == 1).then_some(v)
    })
    .await;
    assert_eq!(view["duplicate_attempts"], 1);
    let like = eventually(10, || async {
        let (s, _, v) = answer(
            app.get(ADMIN, &format!("/v1/admin/tokens/{}", tokens[1].1))
                .await,
        )
        .await;
        (s == StatusCode::OK && v["state"] == "consumed").then_some(v)
    })
    .await;
    assert_eq!(like["duplicate_attempts"], 0, "{like}");
    let metrics = app.metrics_text().await;
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("ledger_consume_total{"))
    {
        for refused in ["\"invalid\"", "\"mismatch\""] {
            assert!(
                !line.contains(refused) || line.ends_with(" 0"),
                "a read counted as a consume attempt: {line}"
            );
        }
    }
    app.stop().await;
}
