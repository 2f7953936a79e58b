//! `POST /v1/admin/tokens/{token}/release`: an operator frees a token stuck
//! in `processing`, by the rule of a client's release, audited with who and
//! why; for a durable and a fast biz type.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

const BIZES: [&str; 2] = ["order", "like"];
const REASON: &str = "consumer crashed before recording a result; INC-1042";

async fn admin_release(app: &TestApp, key: &str, token: &str, body: &Value) -> (StatusCode, Value) {
    let (s, replayed, v) = answer(
        app.post(key, &format!("/v1/admin/tokens/{token}/release"), body)
            .await,
    )
    .await;
    assert!(!replayed);
    (s, v)
}

async fn consume(app: &TestApp, token: &str, subject: &str) -> Value {
    let (s, _, v) = answer(
        app.consume(PAYMENTS, token, &json!({"subject": subject}))
            .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

/// The `token.released` events of `token`, once `n` of them reached Postgres
/// (a fast type's through the journal).
async fn released_events(app: &TestApp, token: &str, n: usize) -> Vec<Value> {
    eventually(10, || async {
        let (s, _, v) = answer(app.get(ADMIN, &format!("/v1/admin/tokens/{token}")).await).await;
        if s != StatusCode::OK {
            return None;
        }
        let released: Vec<Value> = v["events"]
            .as_array()?
            .iter()
            .filter(|e| e["kind"] == "token.released")
            .cloned()
            .collect();
        (released.len() == n).then_some(released)
    })
    .await
}

#[tokio::test]
async fn an_operator_frees_a_token_stuck_in_processing_and_it_is_consumable_again() {
    // A fast token released in Redis is consumable again once
    // `redis.timeout` (2 s in the tests) has passed: longer than `like`'s
    // default ttl of 3 s leaves once the test's steps are counted.
    let app = spawn_app_on(Stores::fresh().with("biz.like.ttl = \"60s\"")).await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "user-42").await;
        assert_eq!(
            consume(&app, &token, "user-42").await["outcome"],
            "consumed"
        );
        // Its consumer died: every retry hears processing.
        let dup = consume(&app, &token, "user-42").await;
        assert_eq!(
            (dup["outcome"].as_str(), dup["status"].as_str()),
            (Some("duplicate"), Some("processing")),
            "{biz}"
        );
        // Stuck means a while: its issuance record has reached Postgres (a
        // fast token's release needs it to name its client and subject).
        let pg = app.pg().await;
        eventually(10, || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE token = $1")
                .bind(&token)
                .fetch_one(&pg)
                .await
                .expect("query");
            (n == 1).then_some(())
        })
        .await;
        let (s, v) = admin_release(&app, ADMIN, &token, &json!({"reason": REASON})).await;
        assert_eq!(
            (s, v["outcome"].as_str()),
            (StatusCode::OK, Some("released")),
            "{biz}: {v}"
        );
        let state = app
            .get(PAYMENTS, &format!("/v1/tokens/{token}?subject=user-42"))
            .await
            .json::<Value>()
            .await
            .expect("json");
        assert_eq!(state["state"], "issued", "{biz}: {state}");
        // The retry now runs the business step.
        assert_eq!(
            consume(&app, &token, "user-42").await["outcome"],
            "consumed",
            "{biz}"
        );

        // Audited with who and why; a client's own release says neither.
        let events = released_events(&app, &token, 1).await;
        assert_eq!(events[0]["detail"]["by"], "admin", "{biz}: {events:?}");
        assert_eq!(events[0]["detail"]["reason"], REASON, "{biz}");
        assert_eq!(events[0]["client"], "payments", "{biz}: the token's client");
        assert_eq!(events[0]["subject"], "user-42", "{biz}");
        let (s, _, _) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/release"),
                &json!({"subject": "user-42"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        let events = released_events(&app, &token, 2).await;
        assert!(
            events
                .iter()
                .filter(|e| e["detail"]["by"] == "admin")
                .count()
                == 1,
            "{biz}: {events:?}"
        );

        // Completed: a result makes it unreleasable, for operators too.
        consume(&app, &token, "user-42").await;
        let (s, _, _) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/result"),
                &json!({"subject": "user-42", "result": {"ok": true}}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        let (s, v) = admin_release(&app, ADMIN, &token, &json!({"reason": "too late"})).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}: {v}"
        );
        // Never consumed: nothing to release.
        let fresh = app.issue(PAYMENTS, biz, "user-42").await;
        eventually(10, || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE token = $1")
                .bind(&fresh)
                .fetch_one(&pg)
                .await
                .expect("query");
            (n == 1).then_some(())
        })
        .await;
        let (s, v) = admin_release(&app, ADMIN, &fresh, &json!({"reason": REASON})).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}: {v}"
        );
    }
    app.stop().await;
}

/// A fast token Redis no longer holds is released by Postgres, as a
/// client's would be.
#[tokio::test]
async fn a_fast_token_redis_lost_is_released_in_postgres() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "like", "u").await;
    consume(&app, &token, "u").await;
    let pg = app.pg().await;
    eventually(10, || async {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
                .bind(&token)
                .fetch_optional(&pg)
                .await
                .expect("query");
        (state.as_deref() == Some("consumed")).then_some(())
    })
    .await;
    let mut redis = app.redis().await;
    let _: i64 = redis::cmd("DEL")
        .arg(app.token_key(&token))
        .query_async(&mut redis)
        .await
        .expect("DEL");
    let (s, v) = admin_release(&app, ADMIN, &token, &json!({"reason": REASON})).await;
    assert_eq!(
        (s, v["outcome"].as_str()),
        (StatusCode::OK, Some("released")),
        "{v}"
    );
    let events = released_events(&app, &token, 1).await;
    assert_eq!(
        (&events[0]["detail"]["by"], &events[0]["detail"]["reason"]),
        (&json!("admin"), &json!(REASON))
    );
    assert_eq!(consume(&app, &token, "u").await["outcome"], "consumed");
    app.stop().await;
}

#[tokio::test]
async fn a_token_an_order_event_consumed_is_not_releasable() {
    let app = spawn_app().await;
    let r = app
        .post(
            PAYMENTS,
            "/v1/orders",
            &json!({"order_id": "o-rel", "subject": "alice", "amount_minor": 1000, "currency": "CNY"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
    let token = app.issue(PAYMENTS, "order", "alice").await;
    let (s, _, v) = answer(
        app.post(PAYMENTS, "/v1/orders/o-rel/pay", &json!({"token": token}))
            .await,
    )
    .await;
    assert_eq!(
        (s, v["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{v}"
    );
    let (s, v) = admin_release(&app, ADMIN, &token, &json!({"reason": REASON})).await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::CONFLICT, Some("not_releasable")),
        "{v}"
    );
    app.stop().await;
}

#[tokio::test]
async fn admin_release_needs_the_admin_role_a_reason_and_a_valid_token() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "u").await;
    consume(&app, &token, "u").await;
    // Service clients and the reconciler: 403, before the body is read.
    for key in [PAYMENTS, REFUNDS, "dev-reconciler-key"] {
        for body in [json!({"reason": REASON}), json!({"nonsense": 1})] {
            let (s, v) = admin_release(&app, key, &token, &body).await;
            assert_eq!(
                (s, v["error"].as_str()),
                (StatusCode::FORBIDDEN, Some("forbidden")),
                "{key}: {v}"
            );
        }
    }
    let (s, _) = admin_release(&app, "wrong-key", &token, &json!({"reason": REASON})).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // A reason is required: 1 to 500 characters, not only white space.
    for body in [
        json!({}),
        json!({"reason": ""}),
        json!({"reason": "   "}),
        json!({"reason": "x".repeat(501)}),
        json!({"reason": 7}),
        json!({"reason": REASON, "by": "me"}),
    ] {
        let (s, v) = admin_release(&app, ADMIN, &token, &body).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_request")),
            "{body}: {v}"
        );
    }
    let r = app
        .http
        .post(app.url(&format!("/v1/admin/tokens/{token}/release")))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("sent");
    assert_eq!(
        r.status(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "a body is required"
    );
    // A forged tag, garbage, an overlong token.
    let mut forged = token.clone();
    let last = forged.pop().expect("char");
    forged.push(if last == 'A' { 'B' } else { 'A' });
    for bad in [
        forged,
        "order_nope".to_owned(),
        format!("order_{}", "x".repeat(130)),
    ] {
        let (s, v) = admin_release(&app, ADMIN, &bad, &json!({"reason": REASON})).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_invalid")),
            "{bad}: {v}"
        );
    }
    // Nothing above changed it: still processing; 500 characters are enough.
    let dup = consume(&app, &token, "u").await;
    assert_eq!(dup["status"], "processing", "{dup}");
    let (s, v) = admin_release(&app, ADMIN, &token, &json!({"reason": "é".repeat(500)})).await;
    assert_eq!(
        (s, v["outcome"].as_str()),
        (StatusCode::OK, Some("released")),
        "{v}"
    );
    let r = app
        .http
        .get(app.url(&format!("/v1/admin/tokens/{token}/release")))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("sent");
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    app.stop().await;
}
