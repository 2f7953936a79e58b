//! Isolation and abuse (DESIGN.md invariant 6): no client reaches another
//! client's or subject's tokens; issuing is throttled per subject (and the
//! state of idle subjects forgotten), every client has a ceiling on every
//! endpoint, short TTLs have a floor per biz type, and oversized or deep
//! inputs are refused before any I/O.

use std::time::Instant;

use reqwest::StatusCode;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::helpers::*;

/// Clients: the defaults plus `shop2`, a second service client with the same
/// grants as `payments`.
fn two_shops() -> String {
    let hash = |k: &str| hex::encode(Sha256::digest(k.as_bytes()));
    format!(
        r#"
[[clients]]
name = "payments"
role = "service"
key_sha256 = "{p}"
biz_types = ["order", "refund", "like"]

[[clients]]
name = "refunds"
role = "service"
key_sha256 = "{r}"
biz_types = ["refund"]

[[clients]]
name = "shop2"
role = "service"
key_sha256 = "{s}"
biz_types = ["order", "refund", "like"]
"#,
        p = hash(PAYMENTS),
        r = hash(REFUNDS),
        s = hash("shop2-key"),
    )
}

#[tokio::test]
async fn no_client_reaches_another_clients_or_subjects_tokens() {
    let app = spawn_app_on(Stores::fresh().with(&two_shops())).await;
    let shop2 = "shop2-key";
    let error = |r: (StatusCode, bool, Value)| (r.0, r.2["error"].as_str().map(str::to_owned));
    let mismatch = (StatusCode::FORBIDDEN, Some("token_mismatch".to_owned()));
    let forbidden = (StatusCode::FORBIDDEN, Some("forbidden".to_owned()));

    for biz in ["order", "like"] {
        let t = app.issue(PAYMENTS, biz, "alice").await;
        let consume = |key: &'static str, subject: &'static str| {
            let t = t.clone();
            let app = &app;
            async move { answer(app.consume(key, &t, &json!({"subject": subject})).await).await }
        };
        assert_eq!(
            error(consume(shop2, "alice").await),
            mismatch,
            "{biz}: other client"
        );
        assert_eq!(
            error(consume(PAYMENTS, "bob").await),
            mismatch,
            "{biz}: other subject"
        );
        assert_eq!(
            error(consume(REFUNDS, "alice").await),
            forbidden,
            "{biz}: not granted"
        );
        // None of that consumed it.
        let (s, _, body) = consume(PAYMENTS, "alice").await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{biz}"
        );

        for (key, subject, want) in [
            (shop2, "alice", &mismatch),
            (PAYMENTS, "bob", &mismatch),
            (REFUNDS, "alice", &forbidden),
        ] {
            for op in ["result", "release"] {
                let body = if op == "result" {
                    json!({"subject": subject, "result": {"stolen": true}})
                } else {
                    json!({"subject": subject})
                };
                let r = answer(app.post(key, &format!("/v1/tokens/{t}/{op}"), &body).await).await;
                assert_eq!(&error(r), want, "{biz} {op} by {key} for {subject}");
            }
        }
        // The owner's result lands: nobody else's did, nobody released it.
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/tokens/{t}/result"),
                &json!({"subject": "alice", "result": {"paid": biz}}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("recorded")),
            "{biz}"
        );
    }

    // A refund token of `refunds`, presented by `payments` (also granted refund).
    let t = app.issue(REFUNDS, "refund", "alice").await;
    let r = answer(
        app.consume(PAYMENTS, &t, &json!({"subject": "alice"}))
            .await,
    )
    .await;
    assert_eq!(error(r), mismatch);
    let r = answer(app.consume(REFUNDS, &t, &json!({"subject": "alice"})).await).await;
    assert_eq!(r.2["outcome"], "consumed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_101st_issue_in_a_second_for_one_subject_is_429() {
    // Default config: order issue_rate = "100/s", a token bucket whose burst
    // is one second's worth and which refills one token every 10 ms.
    let app = spawn_app().await;
    let issue = |subject: &'static str| {
        let app = &app;
        async move {
            let r = app
                .post(
                    PAYMENTS,
                    "/v1/tokens",
                    &json!({"biz_type": "order", "subject": subject}),
                )
                .await;
            let retry = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let (s, _, body) = answer(r).await;
            (s, retry, body)
        }
    };
    let started = Instant::now();
    let burst: Vec<_> = futures_util::future::join_all((0..100).map(|_| issue("hot"))).await;
    assert!(
        burst.iter().all(|(s, _, _)| *s == StatusCode::CREATED),
        "the first 100 are always admitted"
    );
    // Past the burst, only the refill is admitted: keep asking until refused.
    let mut admitted = 100u64;
    let mut refused = None;
    for _ in 0..50 {
        let wave: Vec<_> = futures_util::future::join_all((0..50).map(|_| issue("hot"))).await;
        admitted += wave
            .iter()
            .filter(|(s, _, _)| *s == StatusCode::CREATED)
            .count() as u64;
        if let Some(r) = wave.into_iter().find(|(s, _, _)| *s != StatusCode::CREATED) {
            refused = Some(r);
            break;
        }
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let (status, retry, body) = refused.expect("a refusal");
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(body["error"], "rate_limited");
    assert!(
        body["message"].as_str().unwrap_or("").contains("subject"),
        "the per-subject limit, not the client's ceiling: {body}"
    );
    assert!(retry.is_some_and(|r| r >= 1), "Retry-After {retry:?}");
    // The 101st within the same 10 ms of the burst is refused; later ones only
    // as the bucket refills.
    assert!(
        admitted <= 100 + elapsed_ms / 10 + 1,
        "{admitted} admitted in {elapsed_ms} ms"
    );
    // Another subject, and another biz type for the same subject, are unaffected.
    assert_eq!(issue("calm").await.0, StatusCode::CREATED);
    let r = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "like", "subject": "hot"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
}

/// Subjects are chosen by callers: the issue-rate state of every pair seen
/// must not live forever. Once a pair's bucket is full again it is dropped,
/// and the pair behaves as if never seen (its next burst is whole).
#[tokio::test]
async fn issue_rate_state_of_idle_subjects_is_forgotten() {
    let app = spawn_app().await;
    for i in 0..50 {
        app.issue(PAYMENTS, "order", &format!("passer-by-{i}"))
            .await;
    }
    // 100/s refills one token per 10 ms: every bucket is full after 20 ms.
    // The buckets run on a monotonic clock of their own (a wall-clock step
    // must never change a rate), not the service's Clock: this waits real
    // time.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(app.ledger.prune_rate_limiters(), 0);
    // A pair that is still draining its bucket is kept (100 at once empty a
    // bucket that takes 1 s to refill).
    futures_util::future::join_all((0..100).map(|_| app.issue(PAYMENTS, "order", "busy"))).await;
    assert_eq!(app.ledger.prune_rate_limiters(), 1);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_client_has_a_ceiling_on_every_endpoint() {
    // Default ceiling 5/s; `payments` is given 1000/s of its own.
    let clients = two_shops().replacen(
        "biz_types = [\"order\", \"refund\", \"like\"]\n",
        "biz_types = [\"order\", \"refund\", \"like\"]\nrate = \"1000/s\"\n",
        1,
    );
    let app = spawn_app_on(
        Stores::fresh()
            .with("limits.client_rate = \"5/s\"")
            .with(&clients),
    )
    .await;
    let fire = |key: &'static str| {
        let app = &app;
        async move {
            let started = Instant::now();
            let answers: Vec<_> = futures_util::future::join_all((0..30).map(|i| async move {
                let path = if i % 2 == 0 {
                    "/v1/tokens/order_dev1_nope/consume"
                } else {
                    "/v1/tokens/order_dev1_nope/release"
                };
                let r = app.post(key, path, &json!({"subject": "u"})).await;
                let retry = r.headers().get("retry-after").is_some();
                let (s, _, body) = answer(r).await;
                (s, retry, body)
            }))
            .await;
            (answers, started.elapsed().as_millis() as u64)
        }
    };
    let (answers, elapsed_ms) = fire(REFUNDS).await;
    let limited: Vec<_> = answers
        .iter()
        .filter(|(s, _, _)| *s == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    let admitted = answers.len() - limited.len();
    assert!(
        (admitted as u64) <= 5 + elapsed_ms / 200 + 1,
        "{admitted} admitted in {elapsed_ms} ms"
    );
    assert!(!limited.is_empty());
    assert!(limited
        .iter()
        .all(|(_, retry, b)| *retry && b["error"] == "rate_limited"));
    // The ceiling comes after authentication and before the body and token.
    assert!(answers
        .iter()
        .filter(|(s, _, _)| *s != StatusCode::TOO_MANY_REQUESTS)
        .all(|(s, _, b)| *s == StatusCode::BAD_REQUEST && b["error"] == "token_invalid"));
    // Its own ceiling for `payments`; the others' exhaustion does not touch it.
    let (answers, _) = fire(PAYMENTS).await;
    assert!(answers
        .iter()
        .all(|(s, _, _)| *s == StatusCode::BAD_REQUEST));
    // Wrong keys are 401, not counted against anyone.
    let r = app.post("nope", "/v1/tokens", &json!({})).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn ttl_floors_per_biz_type() {
    // No floor by default: API.md allows 1 s to the biz type's ttl.
    let open = spawn_app().await;
    for (biz, ttl) in [("order", 1), ("refund", 1), ("like", 1), ("order", 60)] {
        let (s, _, body) = answer(
            open.post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": biz, "subject": "u", "ttl_seconds": ttl}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{biz} {ttl}: {body}");
    }
    let app = spawn_app_on(Stores::fresh().with(
        "biz.order.min_ttl = \"10s\"\nbiz.refund.min_ttl = \"10s\"\nbiz.like.min_ttl = \"1s\"",
    ))
    .await;
    for (biz, ttl, want) in [
        ("order", 9, StatusCode::BAD_REQUEST),
        ("order", 10, StatusCode::CREATED),
        ("refund", 1, StatusCode::BAD_REQUEST),
        ("refund", 10, StatusCode::CREATED),
        ("like", 1, StatusCode::CREATED),
        ("like", 3, StatusCode::CREATED),
        ("like", 4, StatusCode::BAD_REQUEST),
    ] {
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": biz, "subject": "u", "ttl_seconds": ttl}),
            )
            .await,
        )
        .await;
        assert_eq!(s, want, "{biz} {ttl}: {body}");
        if s == StatusCode::BAD_REQUEST {
            assert_eq!(body["error"], "invalid_request");
        }
    }
    // A floor above the ttl is a configuration error naming the key.
    let err = idempotency_ledger::config::Settings::from_toml_over_defaults(
        "[biz.like]\nttl = \"3s\"\ndurability = \"fast\"\nmin_ttl = \"10s\"",
    )
    .unwrap_err();
    assert!(err.to_string().contains("biz.like.min_ttl"), "{err}");
}

#[tokio::test]
async fn oversized_or_deep_inputs_are_refused_before_any_io() {
    let app = spawn_app().await;
    let t = app.issue(PAYMENTS, "order", "u").await;
    let deep = |n: usize| -> Value {
        let text = format!("{}1{}", "[".repeat(n), "]".repeat(n));
        serde_json::from_str(&text).expect("serde_json parses up to 128")
    };
    // Depth 33 in total (the body object plus 32 arrays): refused.
    let (s, _, body) = answer(
        app.post(
            PAYMENTS,
            &format!("/v1/tokens/{t}/result"),
            &json!({"subject": "u", "result": deep(32)}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_request"))
    );
    assert!(
        body["message"].as_str().unwrap().contains("nested"),
        "{body}"
    );
    // Depth 32 passes the shape checks (and the token is not consumed yet).
    let (s, _, body) = answer(
        app.post(
            PAYMENTS,
            &format!("/v1/tokens/{t}/result"),
            &json!({"subject": "u", "result": deep(31)}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::CONFLICT, Some("not_consumed"))
    );

    // A path and query beyond 16 KiB: 414; headers beyond 16 KiB: 431.
    let long = "a".repeat(17_000);
    let r = app
        .http
        .get(app.url(&format!("/healthz?{long}")))
        .send()
        .await
        .unwrap();
    let (s, _, body) = answer(r).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::URI_TOO_LONG, Some("uri_too_long"))
    );
    let r = app
        .http
        .post(app.url(&format!("/v1/tokens/{t}/consume")))
        .bearer_auth(PAYMENTS)
        .header("x-padding", "b".repeat(17_000))
        .json(&json!({"subject": "u"}))
        .send()
        .await
        .unwrap();
    let (s, _, body) = answer(r).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Some("headers_too_large")
        )
    );
    // Nothing consumed it.
    let (_, _, body) = answer(app.consume(PAYMENTS, &t, &json!({"subject": "u"})).await).await;
    assert_eq!(body["outcome"], "consumed");
}
