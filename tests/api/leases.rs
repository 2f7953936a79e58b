//! Processing leases: a consume with neither result nor release past its
//! biz type's `processing_lease` becomes `uncertain` (durable `refund`, fast
//! `like`; tokens and client keys), is listed, counted and audited, and is
//! resolved by a late result, an operator's release or an operator's
//! result; the state survives a restart of every instance; under
//! `on_lease_expiry = "release"` the step runs again.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

const UNCERTAIN: &str = r#"
[biz.refund]
processing_lease = "1s"
[biz.like]
processing_lease = "1s"
"#;

const RELEASE: &str = r#"
[biz.refund]
processing_lease = "1s"
on_lease_expiry = "release"
[biz.like]
processing_lease = "1s"
on_lease_expiry = "release"
# Released, a fast token cools for `redis.timeout` (2 s in the tests)
# before it is consumed again: longer than the default ttl of 3 s allows.
ttl = "60s"
"#;

const BIZES: [&str; 2] = ["refund", "like"];

async fn consume(app: &TestApp, token: &str, request_id: &str) -> (StatusCode, Value) {
    let (s, _, body) = answer(
        app.consume(
            PAYMENTS,
            token,
            &json!({"subject": "u", "request_id": request_id}),
        )
        .await,
    )
    .await;
    (s, body)
}

async fn consume_key(app: &TestApp, biz: &str, key: &str, request_id: &str) -> (StatusCode, Value) {
    let (s, _, body) = answer(
        app.post(
            PAYMENTS,
            "/v1/keys/consume",
            &json!({"biz_type": biz, "key": key, "request_id": request_id}),
        )
        .await,
    )
    .await;
    (s, body)
}

/// Polls the duplicate answer of `token` until its status is `want`.
async fn token_status_becomes(app: &TestApp, token: &str, want: &str) -> Value {
    eventually(10, || async move {
        let (s, body) = consume(app, token, "r-dup").await;
        assert_eq!(s, StatusCode::OK, "{body}");
        (body["status"] == want).then_some(body)
    })
    .await
}

async fn uncertain_items(app: &TestApp, biz: &str) -> Vec<Value> {
    let (s, _, page) = answer(
        app.get(ADMIN, &format!("/v1/admin/uncertain?biz_type={biz}"))
            .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{page}");
    page["items"].as_array().cloned().unwrap_or_default()
}

async fn listed(app: &TestApp, biz: &str, field: &str, value: &str) -> bool {
    uncertain_items(app, biz)
        .await
        .iter()
        .any(|i| i[field] == value)
}

async fn events_of(app: &TestApp, token: &str) -> Vec<Value> {
    let (s, _, view) = answer(app.get(ADMIN, &format!("/v1/admin/tokens/{token}")).await).await;
    assert_eq!(s, StatusCode::OK, "{view}");
    view["events"].as_array().cloned().unwrap_or_default()
}

#[tokio::test]
async fn a_lease_runs_out_into_uncertain_and_a_late_result_resolves_it() {
    let app = spawn_app_on(Stores::fresh().with(UNCERTAIN)).await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "u").await;
        let (s, won) = consume(&app, &token, "r-1").await;
        assert_eq!(
            (s, won["outcome"].as_str()),
            (StatusCode::OK, Some("consumed"))
        );
        // Within the lease: processing.
        let (_, dup) = consume(&app, &token, "r-2").await;
        assert_eq!(dup["status"], "processing", "{biz}: {dup}");

        let dup = token_status_becomes(&app, &token, "uncertain").await;
        assert_eq!(dup["outcome"], "duplicate", "{biz}");
        assert_eq!(dup["result"], Value::Null, "{biz}");
        let (s, _, read) = answer(
            app.get(PAYMENTS, &format!("/v1/tokens/{token}?subject=u"))
                .await,
        )
        .await;
        assert_eq!(
            (s, read["state"].as_str()),
            (StatusCode::OK, Some("uncertain")),
            "{biz}: {read}"
        );
        // Listed (Postgres's sweep; a fast type's consume reaches Postgres by the journal).
        eventually(10, || async {
            listed(&app, biz, "token", &token).await.then_some(())
        })
        .await;
        let events = events_of(&app, &token).await;
        let uncertain: Vec<&Value> = events
            .iter()
            .filter(|e| e["kind"] == "token.uncertain")
            .collect();
        assert_eq!(uncertain.len(), 1, "{biz}: {events:?}");
        assert_eq!(uncertain[0]["detail"]["by"], "lease", "{biz}");

        // The consumer's late result resolves it.
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/result"),
                &json!({"subject": "u", "result": {"ok": true}}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}: {body}");
        let dup = token_status_becomes(&app, &token, "completed").await;
        assert_eq!(dup["result"], json!({"ok": true}), "{biz}");
        eventually(10, || async {
            (!listed(&app, biz, "token", &token).await).then_some(())
        })
        .await;
    }
    // The gauge counts what is uncertain now: nothing.
    let metrics = app.metrics_text().await;
    assert!(
        metrics.contains("ledger_uncertain_items{biz_type=\"refund\"} 0"),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_operator_resolves_an_uncertain_token_or_key_either_way() {
    // A fast token released in Redis is consumable again only once
    // `redis.timeout` (2 s in the tests) has passed: `like` lives longer.
    // (`UNCERTAIN` ends in `[biz.like]`.)
    let app = spawn_app_on(Stores::fresh().with(UNCERTAIN).with("ttl = \"60s\"")).await;
    for biz in BIZES {
        // A token, released by an operator: the next consume wins.
        let token = app.issue(PAYMENTS, biz, "u").await;
        consume(&app, &token, "r-1").await;
        token_status_becomes(&app, &token, "uncertain").await;
        eventually(10, || async {
            listed(&app, biz, "token", &token).await.then_some(())
        })
        .await;
        let (s, _, body) = answer(
            app.post(
                ADMIN,
                &format!("/v1/admin/tokens/{token}/release"),
                &json!({"reason": "provider has no charge; INC-1"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}: {body}");
        let (s, again) = consume(&app, &token, "r-3").await;
        assert_eq!(
            (s, again["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{biz}: {again}"
        );

        // A client key, its outcome recorded by an operator.
        let key = format!("k-{}", uuid::Uuid::new_v4());
        let (s, won) = consume_key(&app, biz, &key, "r-1").await;
        assert_eq!(
            (s, won["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{won}"
        );
        eventually(10, || async {
            let (_, dup) = consume_key(&app, biz, &key, "r-2").await;
            (dup["status"] == "uncertain").then_some(())
        })
        .await;
        eventually(10, || async {
            listed(&app, biz, "key", &key).await.then_some(())
        })
        .await;
        // An auditor may read the queue, not resolve it.
        let (s, _, _) = answer(app.get(AUDITOR, "/v1/admin/uncertain").await).await;
        assert_eq!(s, StatusCode::OK);
        let body = json!({"client": "payments", "biz_type": biz, "key": key,
                          "result": {"captured": true}, "reason": "provider says captured; INC-2"});
        let (s, _, refused) = answer(app.post(AUDITOR, "/v1/admin/keys/result", &body).await).await;
        assert_eq!(
            (s, refused["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("forbidden"))
        );
        let (s, _, ok) = answer(app.post(ADMIN, "/v1/admin/keys/result", &body).await).await;
        assert_eq!(s, StatusCode::OK, "{biz}: {ok}");
        // The same result again: recorded, replayed; another: 409.
        let (s, replayed, _) = answer(app.post(ADMIN, "/v1/admin/keys/result", &body).await).await;
        assert_eq!((s, replayed), (StatusCode::OK, true));
        let mut other = body.clone();
        other["result"] = json!({"captured": false});
        let (s, _, conflict) = answer(app.post(ADMIN, "/v1/admin/keys/result", &other).await).await;
        assert_eq!(
            (s, conflict["error"].as_str()),
            (StatusCode::CONFLICT, Some("result_already_set"))
        );
        let (_, dup) = consume_key(&app, biz, &key, "r-4").await;
        assert_eq!(
            (dup["status"].as_str(), &dup["result"]),
            (Some("completed"), &json!({"captured": true})),
            "{biz}"
        );
        // Audited with who and why (a fast type's by the journal).
        eventually(10, || async {
            let (_, _, page) = answer(
                app.get(
                    ADMIN,
                    &format!("/v1/admin/audit?biz_type={biz}&kind=key.result"),
                )
                .await,
            )
            .await;
            page["events"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|e| {
                    e["detail"]["key"] == key.as_str()
                        && e["detail"]["by"] == "admin"
                        && e["detail"]["reason"] == "provider says captured; INC-2"
                })
                .then_some(())
        })
        .await;
        eventually(10, || async {
            (!listed(&app, biz, "key", &key).await).then_some(())
        })
        .await;
    }
    // An operator's result for a token.
    let token = app.issue(PAYMENTS, "refund", "u").await;
    consume(&app, &token, "r-1").await;
    token_status_becomes(&app, &token, "uncertain").await;
    let (s, _, body) = answer(
        app.post(
            ADMIN,
            &format!("/v1/admin/tokens/{token}/result"),
            &json!({"result": {"refunded": 500}, "reason": "provider says refunded"}),
        )
        .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let dup = token_status_becomes(&app, &token, "completed").await;
    assert_eq!(dup["result"], json!({"refunded": 500}));
    // Bad input changes nothing.
    let (s, _, bad) = answer(
        app.post(
            ADMIN,
            &format!("/v1/admin/tokens/{token}/result"),
            &json!({"result": 1}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, bad["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_request"))
    );
    let (s, _, bad) = answer(app.get(ADMIN, "/v1/admin/uncertain?cursor=nope").await).await;
    assert_eq!(
        (s, bad["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_cursor"))
    );
    let (s, _, bad) = answer(app.get(ADMIN, "/v1/admin/uncertain?limit=0").await).await;
    assert_eq!(
        (s, bad["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_request"))
    );
}

/// The lease is judged by Postgres's clock and Postgres's state: it runs
/// out while no instance runs, and the first instance back marks it.
#[tokio::test]
async fn a_lease_runs_out_across_a_restart_of_every_instance() {
    let stores = Stores::fresh().with(UNCERTAIN);
    let app = spawn_app_on(stores.clone()).await;
    let mut tokens = Vec::new();
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "u").await;
        consume(&app, &token, "r-1").await;
        let (_, dup) = consume(&app, &token, "r-2").await;
        assert_eq!(dup["status"], "processing", "{biz}");
        tokens.push((biz, token));
    }
    app.stop().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let app = spawn_app_on(stores).await;
    for (biz, token) in &tokens {
        token_status_becomes(&app, token, "uncertain").await;
        eventually(10, || async {
            listed(&app, biz, "token", token).await.then_some(())
        })
        .await;
    }
}

/// A consume waiting for the winner (`wait_ms`) answers `uncertain` when the
/// lease runs out during its wait.
#[tokio::test]
async fn a_waiting_consume_answers_uncertain_when_the_lease_runs_out() {
    let app = spawn_app_on(Stores::fresh().with(UNCERTAIN)).await;
    let token = app.issue(PAYMENTS, "refund", "u").await;
    consume(&app, &token, "r-1").await;
    let started = std::time::Instant::now();
    let (s, _, body) = answer(
        app.consume(
            PAYMENTS,
            &token,
            &json!({"subject": "u", "request_id": "r-2", "wait_ms": 8000}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, body["status"].as_str()),
        (StatusCode::OK, Some("uncertain")),
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(7),
        "woken by the sweep, not the end of the wait"
    );
}

#[tokio::test]
async fn the_release_policy_lets_the_step_run_again() {
    let app = spawn_app_on(Stores::fresh().with(RELEASE)).await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "u").await;
        let (s, won) = consume(&app, &token, "r-1").await;
        assert_eq!(
            (s, won["outcome"].as_str()),
            (StatusCode::OK, Some("consumed"))
        );
        // After the lease, a new attempt consumes it (the step runs again).
        let again = eventually(10, || async {
            let (s, body) = consume(&app, &token, "r-2").await;
            assert_eq!(s, StatusCode::OK, "{biz}: {body}");
            (body["outcome"] == "consumed").then_some(body)
        })
        .await;
        assert_eq!(again["outcome"], "consumed", "{biz}");
        eventually(10, || async {
            let events = events_of(&app, &token).await;
            events
                .iter()
                .any(|e| e["kind"] == "token.released" && e["detail"]["by"] == "lease")
                .then_some(())
        })
        .await;
        // Nothing is ever uncertain under this policy.
        assert!(uncertain_items(&app, biz).await.is_empty(), "{biz}");
    }
}
