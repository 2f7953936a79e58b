//! Every row of API.md's consume table, for durable and fast biz types.

use std::sync::Arc;

use idempotency_ledger::clock::{Clock, ManualClock, SystemClock};
use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::*;

const BIZES: [&str; 2] = ["order", "like"];

#[tokio::test]
async fn first_use_then_duplicate_then_replay() {
    let app = spawn_app().await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "user-42").await;
        let body = json!({"subject": "user-42", "request_id": "req-1", "fingerprint": "sha256:aa"});
        let (status, replayed, first) = answer(app.consume(PAYMENTS, &token, &body).await).await;
        assert_eq!(status, StatusCode::OK, "{biz}: {first}");
        assert_eq!(first["outcome"], "consumed");
        assert_eq!(first["token"], token.as_str());
        assert!(!replayed, "{biz}: the winner has no replay header");
        chrono::DateTime::parse_from_rfc3339(first["consumed_at"].as_str().unwrap()).unwrap();

        // The same attempt again: consumed, with the header, same time.
        let (status, replayed, again) = answer(app.consume(PAYMENTS, &token, &body).await).await;
        assert_eq!((status, replayed), (StatusCode::OK, true), "{biz}: {again}");
        assert_eq!(again["outcome"], "consumed");
        assert_eq!(again["consumed_at"], first["consumed_at"]);

        // Another attempt: duplicate, processing, no result yet.
        let other = json!({"subject": "user-42", "request_id": "req-2"});
        let (status, replayed, dup) = answer(app.consume(PAYMENTS, &token, &other).await).await;
        assert_eq!((status, replayed), (StatusCode::OK, true), "{biz}: {dup}");
        assert_eq!(dup["outcome"], "duplicate");
        assert_eq!(dup["status"], "processing");
        assert!(dup["result"].is_null());
        assert_eq!(dup["consumed_at"], first["consumed_at"]);

        // No request id at all: duplicate too.
        let (_, _, dup) = answer(
            app.consume(PAYMENTS, &token, &json!({"subject": "user-42"}))
                .await,
        )
        .await;
        assert_eq!(dup["outcome"], "duplicate", "{biz}");
    }
}

#[tokio::test]
async fn fingerprint_mismatch_is_422_only_when_both_present() {
    let app = spawn_app().await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "u").await;
        let (s, _, _) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "fingerprint": "fp-a"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        let (s, _, body) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "fingerprint": "fp-b"}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                Some("fingerprint_mismatch")
            ),
            "{biz}"
        );
        let (s, _, body) = answer(
            app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
                .await,
        )
        .await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate")),
            "{biz}"
        );
        let (s, _, body) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "fingerprint": "fp-a"}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate")),
            "{biz}"
        );
    }
}

#[tokio::test]
async fn expired_never_consumed_is_token_expired() {
    let app = spawn_app().await;
    let past = (chrono::Utc::now().timestamp() - 5) as u32;
    for biz in BIZES {
        let token = app.sign(biz, 123_456_789 + biz.len() as u64, past, "payments", "u");
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
    // Nothing was recorded as consumed.
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE state = 'consumed'")
        .fetch_one(&app.pg().await)
        .await
        .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn a_consumed_token_stays_duplicate_past_its_ttl() {
    // One-second tokens, and the service's clock in the test's hands.
    let clock = ManualClock::new(SystemClock.now_ms());
    let app = spawn_app_with_clock(Stores::fresh(), Arc::new(clock.clone())).await;
    // Starting may take over a second (the suite's first test also starts
    // its Postgres): the service's clock starts from now, not from before.
    clock.set_ms(SystemClock.now_ms());
    for biz in BIZES {
        let token = {
            let r = app
                .post(
                    PAYMENTS,
                    "/v1/tokens",
                    &json!({"biz_type": biz, "subject": "late", "ttl_seconds": 1}),
                )
                .await;
            r.json::<serde_json::Value>().await.unwrap()["token"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        let (s, _, _) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "late", "request_id": "r"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        // The token's own expiry passes on the service's clock (tokens carry
        // whole seconds).
        clock.advance_ms(2_100);
        let (s, replayed, body) = answer(
            app.consume(PAYMENTS, &token, &json!({"subject": "late"}))
                .await,
        )
        .await;
        assert_eq!((s, replayed), (StatusCode::OK, true), "{biz}: {body}");
        assert_eq!(body["outcome"], "duplicate", "{biz}");
        // The late retry of the winner still learns it won.
        let (_, _, body) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "late", "request_id": "r"}),
            )
            .await,
        )
        .await;
        assert_eq!(body["outcome"], "consumed", "{biz}");
    }
}

#[tokio::test]
async fn durable_duplicates_survive_redis_losing_the_key() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "u").await;
    let (_, _, first) = answer(
        app.consume(
            PAYMENTS,
            &token,
            &json!({"subject": "u", "request_id": "w"}),
        )
        .await,
    )
    .await;
    assert_eq!(first["outcome"], "consumed");
    // A failover to a stale replica: the key is back to issued, or gone.
    let mut redis = app.redis().await;
    let key = app.token_key(&token);
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut redis)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("s")
        .arg("i")
        .query_async(&mut redis)
        .await
        .unwrap();
    let (s, _, body) = answer(
        app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
            .await,
    )
    .await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate")),
        "{body}"
    );
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut redis)
        .await
        .unwrap();
    let (_, replayed, body) = answer(
        app.consume(
            PAYMENTS,
            &token,
            &json!({"subject": "u", "request_id": "w"}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (body["outcome"].as_str(), replayed),
        (Some("consumed"), true)
    );
    assert_eq!(body["consumed_at"], first["consumed_at"]);
}

#[tokio::test]
async fn invalid_tokens() {
    let app = spawn_app().await;
    let good = app.issue(PAYMENTS, "order", "u").await;
    let mut flipped = good.clone().into_bytes();
    let last = flipped.len() - 3;
    flipped[last] = if flipped[last] == b'A' { b'B' } else { b'A' };
    let flipped = String::from_utf8(flipped).unwrap();
    let other_key = good.replacen("_dev1_", "_zz9_", 1);
    let swapped = good.replacen("order_", "refund_", 1);
    for bad in [
        flipped.as_str(),
        other_key.as_str(),
        swapped.as_str(),
        "order_x_y",
        "garbage",
        &"a".repeat(129),
    ] {
        let (s, _, body) = answer(app.consume(PAYMENTS, bad, &json!({"subject": "u"})).await).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_invalid")),
            "{bad}"
        );
    }
    // The genuine token is untouched by all that.
    let (_, _, body) = answer(app.consume(PAYMENTS, &good, &json!({"subject": "u"})).await).await;
    assert_eq!(body["outcome"], "consumed");
}

#[tokio::test]
async fn mismatched_subject_client_or_biz_type_is_403() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "refund", "alice").await;
    let cases = [
        (PAYMENTS, json!({"subject": "bob"})),
        (REFUNDS, json!({"subject": "alice"})),
        (ADMIN, json!({"subject": "alice"})),
        (PAYMENTS, json!({"subject": "alice", "biz_type": "order"})),
    ];
    for (key, body) in cases {
        let (s, _, out) = answer(app.consume(key, &token, &body).await).await;
        assert_eq!(
            (s, out["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("token_mismatch")),
            "{key} {body}"
        );
    }
    // A client without the grant is `forbidden` before the binding is looked at.
    let order = app.issue(PAYMENTS, "order", "alice").await;
    let (s, _, out) = answer(
        app.consume(REFUNDS, &order, &json!({"subject": "alice"}))
            .await,
    )
    .await;
    assert_eq!(
        (s, out["error"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden"))
    );
    // Still consumable by its owner.
    let (_, _, out) = answer(
        app.consume(
            PAYMENTS,
            &token,
            &json!({"subject": "alice", "biz_type": "refund"}),
        )
        .await,
    )
    .await;
    assert_eq!(out["outcome"], "consumed");
}

#[tokio::test]
async fn a_consume_that_never_committed_frees_the_token() {
    // A process that claimed the token in Redis and died before Postgres:
    // simulated by running the claim script ourselves.
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "u").await;
    let mut redis = app.redis().await;
    let key = app.token_key(&token);
    let deadline = chrono::Utc::now().timestamp_millis() + 1000;
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("s")
        .arg("p")
        .arg("o")
        .arg("dead-owner")
        .arg("d")
        .arg(deadline)
        .arg("at")
        .arg(chrono::Utc::now().timestamp_millis())
        .arg("rid")
        .arg("")
        .arg("fp")
        .arg("")
        .query_async(&mut redis)
        .await
        .unwrap();
    let (_, _, body) = answer(
        app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
            .await,
    )
    .await;
    assert_eq!(
        (body["outcome"].as_str(), body["status"].as_str()),
        (Some("duplicate"), Some("processing"))
    );
    // Within the provisional lifetime (1 s in tests, 5 s by default) it is
    // free again. Redis's clock judges the marker's deadline, so this waits
    // real time rather than driving the service's clock.
    let body = eventually(5, || async {
        let (_, _, body) = answer(
            app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
                .await,
        )
        .await;
        (body["outcome"] == "consumed").then_some(body)
    })
    .await;
    assert_eq!(body["token"], token.as_str());
}

#[tokio::test]
async fn fast_consumes_reach_postgres_through_the_journal() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "like", "u").await;
    let (_, _, body) = answer(
        app.consume(
            PAYMENTS,
            &token,
            &json!({"subject": "u", "request_id": "r9"}),
        )
        .await,
    )
    .await;
    assert_eq!(body["outcome"], "consumed");
    let pool = app.pg().await;
    let (state, rid): (String, Option<String>) = eventually(10, || {
        let pool = pool.clone();
        let token = token.clone();
        async move {
            sqlx::query_as("SELECT state::text, request_id FROM tokens WHERE token = $1 AND state = 'consumed'")
                .bind(&token)
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten()
        }
    })
    .await;
    assert_eq!((state.as_str(), rid.as_deref()), ("consumed", Some("r9")));
    let audits: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind = 'token.consumed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(audits, 1);
}
