//! Client-supplied keys (`/v1/keys`), for a durable (`order`, `refund`) and
//! a fast (`like`) biz type: the token consume rules with a key the client
//! chose, one winner under racing consumes, keys of two clients apart, the
//! subject binding, bad keys, the admin view, audit kinds, stats,
//! reconciliation and the retention purge.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::*;

const BIZES: [&str; 2] = ["order", "like"];

fn fresh_key() -> String {
    format!("k-{}", uuid::Uuid::new_v4())
}

fn key_query(biz: &str, key: &str) -> String {
    let mut url = url::Url::parse("http://x/v1/keys").expect("url");
    url.query_pairs_mut()
        .append_pair("biz_type", biz)
        .append_pair("key", key);
    format!("/v1/keys?{}", url.query().unwrap_or_default())
}

impl TestApp {
    async fn consume_key(&self, api_key: &str, body: &Value) -> (StatusCode, bool, Value) {
        answer(self.post(api_key, "/v1/keys/consume", body).await).await
    }
    async fn key_result(&self, biz: &str, key: &str, result: &Value) -> (StatusCode, bool, Value) {
        answer(
            self.post(
                PAYMENTS,
                "/v1/keys/result",
                &json!({"biz_type": biz, "key": key, "result": result}),
            )
            .await,
        )
        .await
    }
    async fn key_release(&self, biz: &str, key: &str) -> (StatusCode, Value) {
        let (s, _, body) = answer(
            self.post(
                PAYMENTS,
                "/v1/keys/release",
                &json!({"biz_type": biz, "key": key}),
            )
            .await,
        )
        .await;
        (s, body)
    }
    async fn key_state(&self, api_key: &str, biz: &str, key: &str) -> (StatusCode, Value) {
        let (s, _, body) = answer(self.get(api_key, &key_query(biz, key)).await).await;
        (s, body)
    }
}

/// Every client of the development config, `refunds` also granted `like`
/// (so that two clients share a fast biz type).
const TWO_FAST_CLIENTS: &str = r#"
[[clients]]
name = "payments"
role = "service"
key_sha256 = "47270087500f39d054d1f059a00fc29ab03f97ad73583a0248d04c601ab22d9d"
biz_types = ["order", "refund", "like"]

[[clients]]
name = "refunds"
role = "service"
key_sha256 = "ebfda70bbc453aff89524a3e9f56912ccd62717d44ec24b7f789f8615b1af98f"
biz_types = ["refund", "like"]

[[clients]]
name = "admin"
role = "admin"
key_sha256 = "df76ff796f70d2c9cb055ea6280553caa27eda26b70e01082c160de75a05a4a9"
biz_types = []
"#;

#[tokio::test]
async fn a_key_follows_the_consume_result_and_release_rules_of_a_token() {
    let app = spawn_app().await;
    for biz in BIZES {
        let key = fresh_key();
        let first =
            json!({"biz_type": biz, "key": key, "fingerprint": "sha256:a", "request_id": "r-1"});
        // Unknown before its first consume.
        let (s, body) = app.key_state(PAYMENTS, biz, &key).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::NOT_FOUND, Some("key_not_found")),
            "{biz}"
        );
        let (s, replayed, won) = app.consume_key(PAYMENTS, &first).await;
        assert_eq!(
            (s, replayed, won["outcome"].as_str()),
            (StatusCode::OK, false, Some("consumed")),
            "{biz}: {won}"
        );
        assert_eq!(won["key"], json!(key), "{biz}: answers carry the key");
        assert!(
            won["consumed_at"].is_string() && won.get("token").is_none(),
            "{biz}: {won}"
        );

        // The winner's retry: consumed again, replayed.
        let (s, replayed, again) = app.consume_key(PAYMENTS, &first).await;
        assert_eq!(
            (s, replayed, again["outcome"].as_str()),
            (StatusCode::OK, true, Some("consumed")),
            "{biz}"
        );
        assert_eq!(again["consumed_at"], won["consumed_at"], "{biz}");
        // Another attempt: duplicate, processing.
        let other =
            json!({"biz_type": biz, "key": key, "fingerprint": "sha256:a", "request_id": "r-2"});
        let (s, replayed, dup) = app.consume_key(PAYMENTS, &other).await;
        assert_eq!(
            (s, replayed, dup["outcome"].as_str(), dup["status"].as_str()),
            (StatusCode::OK, true, Some("duplicate"), Some("processing")),
            "{biz}: {dup}"
        );
        // Another fingerprint: 422.
        let (s, _, body) = app
            .consume_key(
                PAYMENTS,
                &json!({"biz_type": biz, "key": key, "fingerprint": "sha256:b"}),
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

        // Its state, read-only.
        let (s, state) = app.key_state(PAYMENTS, biz, &key).await;
        assert_eq!(
            (s, state["state"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{biz}: {state}"
        );
        assert_eq!(
            (state["key"].as_str(), state["biz_type"].as_str()),
            (Some(key.as_str()), Some(biz))
        );
        assert_eq!(state["result"], Value::Null);

        // Result: recorded, the same again replayed, another 409.
        let result = json!({"charge": "ch-1", "amount": 1000});
        let (s, replayed, body) = app.key_result(biz, &key, &result).await;
        assert_eq!(
            (s, replayed, body["outcome"].as_str()),
            (StatusCode::OK, false, Some("recorded")),
            "{biz}: {body}"
        );
        let (s, replayed, _) = app.key_result(biz, &key, &result).await;
        assert_eq!((s, replayed), (StatusCode::OK, true), "{biz}");
        let (s, _, body) = app.key_result(biz, &key, &json!({"other": 1})).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::CONFLICT, Some("result_already_set")),
            "{biz}"
        );
        // Later duplicates replay it, completed.
        let (s, replayed, dup) = app
            .consume_key(PAYMENTS, &json!({"biz_type": biz, "key": key}))
            .await;
        assert_eq!(
            (s, replayed, dup["status"].as_str(), &dup["result"]),
            (StatusCode::OK, true, Some("completed"), &result),
            "{biz}: {dup}"
        );
        let (_, state) = app.key_state(PAYMENTS, biz, &key).await;
        assert_eq!(state["result"], result, "{biz}");
        // A key with a result is not releasable.
        let (s, body) = app.key_release(biz, &key).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}"
        );

        // Result and release of a key nobody consumed.
        let nobody = fresh_key();
        let (s, _, body) = app.key_result(biz, &nobody, &result).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_consumed")),
            "{biz}"
        );
        let (s, body) = app.key_release(biz, &nobody).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}"
        );

        // Release: consumable again, by a fresh attempt.
        let released = fresh_key();
        let body = json!({"biz_type": biz, "key": released});
        assert_eq!(
            app.consume_key(PAYMENTS, &body).await.2["outcome"],
            "consumed",
            "{biz}"
        );
        let (s, body_r) = app.key_release(biz, &released).await;
        assert_eq!(
            (s, body_r["outcome"].as_str()),
            (StatusCode::OK, Some("released")),
            "{biz}"
        );
        let (s, state) = app.key_state(PAYMENTS, biz, &released).await;
        assert_eq!(
            (s, state["state"].as_str()),
            (StatusCode::OK, Some("issued")),
            "{biz}"
        );
        let (s, body_r) = app.key_release(biz, &released).await;
        assert_eq!(
            (s, body_r["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}"
        );
        let (_, replayed, again) = app.consume_key(PAYMENTS, &body).await;
        assert_eq!(
            (replayed, again["outcome"].as_str()),
            (false, Some("consumed")),
            "{biz}: {again}"
        );

        // Unknown and ungranted biz types, as for tokens.
        let (s, _, body) = app
            .consume_key(PAYMENTS, &json!({"biz_type": "nope", "key": key}))
            .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some("unknown_biz_type"))
        );
        let (s, _, body) = app
            .consume_key(REFUNDS, &json!({"biz_type": biz, "key": key}))
            .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("forbidden"))
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn racing_consumes_of_one_key_have_exactly_one_winner() {
    let app = Arc::new(spawn_app().await);
    for biz in BIZES {
        let key = fresh_key();
        let barrier = Arc::new(Barrier::new(20));
        let tasks: Vec<_> = (0..20)
            .map(|i| {
                let (app, key, barrier) = (app.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    app.consume_key(
                        PAYMENTS,
                        &json!({"biz_type": biz, "key": key, "request_id": format!("r-{i}")}),
                    )
                    .await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.expect("task"));
        }
        let won = answers
            .iter()
            .filter(|(s, r, b)| *s == StatusCode::OK && !r && b["outcome"] == "consumed")
            .count();
        let dups = answers
            .iter()
            .filter(|(s, r, b)| *s == StatusCode::OK && *r && b["outcome"] == "duplicate")
            .count();
        assert_eq!((won, dups), (1, 19), "{biz}: {answers:?}");
    }
    Arc::try_unwrap(app).ok().expect("sole owner").stop().await;
}

#[tokio::test]
async fn equal_keys_of_two_clients_are_two_keys() {
    let app = spawn_app_on(Stores::fresh().with(TWO_FAST_CLIENTS)).await;
    for biz in ["refund", "like"] {
        let key = fresh_key();
        let body = json!({"biz_type": biz, "key": key, "fingerprint": "sha256:mine"});
        for api_key in [PAYMENTS, REFUNDS] {
            let (s, replayed, won) = app.consume_key(api_key, &body).await;
            assert_eq!(
                (s, replayed, won["outcome"].as_str()),
                (StatusCode::OK, false, Some("consumed")),
                "{biz} {api_key}"
            );
        }
        // Each one's result is its own.
        let (s, _, _) = app.key_result(biz, &key, &json!("payments'")).await;
        assert_eq!(s, StatusCode::OK);
        let (_, refunds_state) = app.key_state(REFUNDS, biz, &key).await;
        assert_eq!(
            (refunds_state["state"].as_str(), &refunds_state["result"]),
            (Some("consumed"), &Value::Null),
            "{biz}"
        );
        let (s, _, body) = answer(
            app.post(
                REFUNDS,
                "/v1/keys/release",
                &json!({"biz_type": biz, "key": key}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("released")),
            "{biz}"
        );
        let (_, payments_state) = app.key_state(PAYMENTS, biz, &key).await;
        assert_eq!(payments_state["result"], json!("payments'"), "{biz}");
    }
    app.stop().await;
}

#[tokio::test]
async fn a_key_s_subject_binds_every_consume_that_names_one() {
    let app = spawn_app().await;
    for biz in BIZES {
        let key = fresh_key();
        let with = |subject: &str| json!({"biz_type": biz, "key": key, "subject": subject});
        assert_eq!(
            app.consume_key(PAYMENTS, &with("alice")).await.2["outcome"],
            "consumed"
        );
        let (s, _, body) = app.consume_key(PAYMENTS, &with("mallory")).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("token_mismatch")),
            "{biz}"
        );
        let (s, replayed, dup) = app.consume_key(PAYMENTS, &with("alice")).await;
        assert_eq!(
            (s, replayed, dup["outcome"].as_str()),
            (StatusCode::OK, true, Some("duplicate")),
            "{biz}"
        );
        // Naming none is allowed.
        let (s, _, dup) = app
            .consume_key(PAYMENTS, &json!({"biz_type": biz, "key": key}))
            .await;
        assert_eq!(
            (s, dup["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate")),
            "{biz}"
        );
        // Released, it stays bound: another subject cannot take it.
        assert_eq!(app.key_release(biz, &key).await.0, StatusCode::OK);
        let (s, _, body) = app.consume_key(PAYMENTS, &with("mallory")).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("token_mismatch")),
            "{biz}"
        );
        let (s, _, won) = app.consume_key(PAYMENTS, &with("alice")).await;
        assert_eq!(
            (s, won["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{biz}: {won}"
        );

        // A key created without a subject is bound to none.
        let bare = fresh_key();
        assert_eq!(
            app.consume_key(PAYMENTS, &json!({"biz_type": biz, "key": bare}))
                .await
                .2["outcome"],
            "consumed"
        );
        let (s, _, body) = app
            .consume_key(
                PAYMENTS,
                &json!({"biz_type": biz, "key": bare, "subject": "alice"}),
            )
            .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("token_mismatch")),
            "{biz}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn bad_keys_are_400_and_change_nothing() {
    let app = spawn_app().await;
    let too_long = "k".repeat(256);
    let longest = "k".repeat(255);
    for biz in BIZES {
        for bad in [
            "",
            too_long.as_str(),
            "tab\there",
            "new\nline",
            "caf\u{e9}",
            "\u{7f}",
        ] {
            for (path, body) in [
                ("/v1/keys/consume", json!({"biz_type": biz, "key": bad})),
                (
                    "/v1/keys/result",
                    json!({"biz_type": biz, "key": bad, "result": 1}),
                ),
                ("/v1/keys/release", json!({"biz_type": biz, "key": bad})),
            ] {
                let (s, _, body) = answer(app.post(PAYMENTS, path, &body).await).await;
                assert_eq!(
                    (s, body["error"].as_str()),
                    (StatusCode::BAD_REQUEST, Some("invalid_request")),
                    "{path} {bad:?}"
                );
            }
            let (s, body) = app.key_state(PAYMENTS, biz, bad).await;
            assert_eq!(
                (s, body["error"].as_str()),
                (StatusCode::BAD_REQUEST, Some("invalid_request")),
                "GET {bad:?}"
            );
        }
        // 255 printable characters, spaces and quotes included, are a key.
        for good in [longest.as_str(), "\"a key\" with: ~all~ {printable}"] {
            let (s, _, won) = app
                .consume_key(PAYMENTS, &json!({"biz_type": biz, "key": good}))
                .await;
            assert_eq!(
                (s, won["outcome"].as_str()),
                (StatusCode::OK, Some("consumed")),
                "{good:?}"
            );
        }
    }
    // Other fields as for tokens.
    for body in [
        json!({"biz_type": "order"}),
        json!({"key": "k"}),
        json!({"biz_type": "order", "key": "k", "subject": ""}),
        json!({"biz_type": "order", "key": "k", "fingerprint": ""}),
        json!({"biz_type": "order", "key": "k", "token": "x"}),
    ] {
        let (s, _, _) = app.consume_key(PAYMENTS, &body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
    }
    // Nothing but the good keys reached either tier.
    let pg = app.pg().await;
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tokens WHERE key IS NOT NULL AND key NOT IN ($1, $2)",
    )
    .bind(&longest)
    .bind("\"a key\" with: ~all~ {printable}")
    .fetch_one(&pg)
    .await
    .expect("count");
    assert_eq!(rows, 0);
    let mut redis = app.redis().await;
    let hashes: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}tok:*", app.stores.prefix))
        .query_async(&mut redis)
        .await
        .expect("keys");
    assert!(hashes.len() <= 4, "{hashes:?}");
    let events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind::text LIKE 'key.%' AND detail->>'key' NOT IN ($1, $2)")
            .bind(&longest)
            .bind("\"a key\" with: ~all~ {printable}")
            .fetch_one(&pg)
            .await
            .expect("count");
    assert_eq!(events, 0);
    app.stop().await;
}

#[tokio::test]
async fn the_admin_view_audit_kinds_and_stats_show_keys() {
    let app = spawn_app().await;
    for biz in BIZES {
        let key = fresh_key();
        let body = json!({"biz_type": biz, "key": key, "subject": "alice", "fingerprint": "sha256:f", "request_id": "r-1"});
        assert_eq!(
            app.consume_key(PAYMENTS, &body).await.2["outcome"],
            "consumed"
        );
        assert_eq!(
            app.consume_key(PAYMENTS, &json!({"biz_type": biz, "key": key}))
                .await
                .2["outcome"],
            "duplicate"
        );
        assert_eq!(app.key_release(biz, &key).await.0, StatusCode::OK);
        assert_eq!(
            app.consume_key(PAYMENTS, &body).await.2["outcome"],
            "consumed"
        );
        assert_eq!(
            app.key_result(biz, &key, &json!({"ok": true})).await.0,
            StatusCode::OK
        );

        let mut url = url::Url::parse("http://x/v1/admin/keys").expect("url");
        url.query_pairs_mut()
            .append_pair("client", "payments")
            .append_pair("biz_type", biz)
            .append_pair("key", &key);
        let path = format!("/v1/admin/keys?{}", url.query().unwrap_or_default());
        // Fast keys reach Postgres through the journal.
        let view = eventually(10, || {
            let path = path.clone();
            let app = &app;
            async move {
                let (s, _, v) = answer(app.get(ADMIN, &path).await).await;
                (s == StatusCode::OK
                    && v["events"].as_array().is_some_and(|e| e.len() == 4)
                    && v["result"] == json!({"ok": true}))
                .then_some(v)
            }
        })
        .await;
        assert_eq!(
            (
                view["key"].as_str(),
                view["client"].as_str(),
                view["biz_type"].as_str()
            ),
            (Some(key.as_str()), Some("payments"), Some(biz))
        );
        assert_eq!(
            (
                view["state"].as_str(),
                view["subject"].as_str(),
                view["fingerprint"].as_str(),
                view["request_id"].as_str()
            ),
            (
                Some("consumed"),
                Some("alice"),
                Some("sha256:f"),
                Some("r-1")
            ),
            "{biz}: {view}"
        );
        assert!(view.get("token").is_none());
        let kinds: Vec<&str> = view["events"]
            .as_array()
            .expect("events")
            .iter()
            .map(|e| e["kind"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(
            kinds,
            ["key.consumed", "key.released", "key.consumed", "key.result"],
            "{biz}"
        );
        for e in view["events"].as_array().expect("events") {
            assert_eq!(
                (e["detail"]["key"].as_str(), &e["token"]),
                (Some(key.as_str()), &Value::Null),
                "{e}"
            );
            assert_eq!(
                (e["client"].as_str(), e["biz_type"].as_str()),
                (Some("payments"), Some(biz))
            );
        }
        // The audit query filters by the key kinds.
        let (s, _, page) = answer(
            app.get(
                ADMIN,
                &format!("/v1/admin/audit?kind=key.released&biz_type={biz}"),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(page["events"].as_array().map(Vec::len), Some(1), "{page}");

        // Not found, not an admin.
        let other = path.replace(&key, "never-consumed");
        let (s, _, body) = answer(app.get(ADMIN, &other).await).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::NOT_FOUND, Some("key_not_found"))
        );
        let (s, _, _) = answer(app.get(PAYMENTS, &path).await).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
    }
    let (s, _, body) = answer(
        app.get(ADMIN, "/v1/admin/keys?client=payments&biz_type=order")
            .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_request"))
    );

    // Stats count key consumes under their biz type (flushed every few seconds).
    let stats = eventually(15, || {
        let app = &app;
        async move {
            let (_, _, s) = answer(app.get(ADMIN, "/v1/admin/stats?window=1h").await).await;
            let ok = BIZES.iter().all(|b| {
                s["biz_types"][b]["consumed"] == json!(2)
                    && s["biz_types"][b]["duplicates"] == json!(1)
            });
            ok.then_some(s)
        }
    })
    .await;
    assert_eq!(stats["biz_types"]["order"]["issued"], json!(0), "{stats}");
    app.stop().await;
}

fn redis_key_of(app: &TestApp, client: &str, biz: &str, key: &str) -> String {
    use idempotency_ledger::domain::key::{identity, ClientKey};
    use idempotency_ledger::domain::BizType;
    let id = identity(
        client,
        &BizType::parse(biz).expect("biz"),
        &ClientKey::parse(key).expect("key"),
    );
    app.token_key(&id.handle)
}

async fn reconcile(app: &TestApp) -> Value {
    let (s, _, report) = answer(
        app.post(ADMIN, "/v1/admin/reconcile", &json!({"dry_run": false}))
            .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{report}");
    assert_eq!(report["errors"], json!([]), "{report}");
    report
}

#[tokio::test]
async fn reconcile_repairs_key_hashes_and_purges_keys_past_retention() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    let mut redis = app.redis().await;
    let consume = |biz: &'static str, key: String| {
        let app = &app;
        async move {
            let (s, _, won) = app
                .consume_key(PAYMENTS, &json!({"biz_type": biz, "key": key}))
                .await;
            assert_eq!(
                (s, won["outcome"].as_str()),
                (StatusCode::OK, Some("consumed"))
            );
        }
    };
    // A: a durable key Postgres consumed, while Redis holds it issued at an
    // older generation (a lost write-back).
    let a = fresh_key();
    consume("order", a.clone()).await;
    let a_redis = redis_key_of(&app, "payments", "order", &a);
    wait_redis_state(&redis, &a_redis, "c", 5).await;
    let _: () = redis::pipe()
        .del(&a_redis)
        .hset_multiple(&a_redis, &[("s", "i"), ("g", "0")])
        .query_async(&mut redis)
        .await
        .expect("diverge");
    // B: a provisional marker past its deadline over a consumed key.
    let b = fresh_key();
    consume("order", b.clone()).await;
    let b_redis = redis_key_of(&app, "payments", "order", &b);
    wait_redis_state(&redis, &b_redis, "c", 5).await;
    let _: () = redis::pipe()
        .del(&b_redis)
        .hset_multiple(
            &b_redis,
            &[
                ("s", "p"),
                ("g", "0"),
                ("d", "1"),
                ("o", "gone"),
                ("at", "1"),
            ],
        )
        .query_async(&mut redis)
        .await
        .expect("stale");
    // C, D, E: a durable key, a fast key and a released key, all past the
    // retention (7 days); Redis let them go when their markers expired.
    let (c, d, e) = (fresh_key(), fresh_key(), fresh_key());
    consume("order", c.clone()).await;
    consume("like", d.clone()).await;
    consume("order", e.clone()).await;
    assert_eq!(app.key_release("order", &e).await.0, StatusCode::OK);
    eventually(10, || {
        let (pg, d) = (&pg, d.clone());
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM tokens WHERE key = $1 AND state = 'consumed'",
            )
            .bind(d)
            .fetch_one(pg)
            .await
            .ok()?;
            (n == 1).then_some(())
        }
    })
    .await;
    sqlx::query(
        "UPDATE tokens SET issued_at = now() - interval '9 days', expires_at = now() - interval '8 days',
                consumed_at = CASE WHEN state = 'consumed' THEN now() - interval '8 days' END
          WHERE key = ANY($1)",
    )
    .bind(vec![c.clone(), d.clone(), e.clone()])
    .execute(&pg)
    .await
    .expect("age");
    // Their last write-backs first (a consumed marker, the released state).
    wait_redis_state(&redis, &redis_key_of(&app, "payments", "order", &c), "c", 5).await;
    wait_redis_state(&redis, &redis_key_of(&app, "payments", "order", &e), "i", 5).await;
    for (biz, k) in [("order", &c), ("like", &d), ("order", &e)] {
        let _: () = redis::cmd("DEL")
            .arg(redis_key_of(&app, "payments", biz, k))
            .query_async(&mut redis)
            .await
            .expect("del");
    }

    let report = reconcile(&app).await;
    for class in ["redis_live_but_consumed", "stale_provisional"] {
        assert_eq!(
            (&report["found"][class], &report["repaired"][class]),
            (&json!(1), &json!(1)),
            "{class}: {report}"
        );
    }
    assert_eq!(report["found"]["expired_purgeable"], json!(3), "{report}");
    assert_eq!(
        report["repaired"]["expired_purgeable"],
        json!(3),
        "{report}"
    );
    // A and B answer duplicate from Redis again; C, D and E are forgotten.
    for k in [&a, &b] {
        let (_, replayed, dup) = app
            .consume_key(PAYMENTS, &json!({"biz_type": "order", "key": k}))
            .await;
        assert_eq!(
            (replayed, dup["outcome"].as_str()),
            (true, Some("duplicate")),
            "{dup}"
        );
    }
    let state: Option<String> = redis::cmd("HGET")
        .arg(&b_redis)
        .arg("s")
        .query_async(&mut redis)
        .await
        .expect("hget");
    assert_eq!(state.as_deref(), Some("c"));
    for (biz, k) in [("order", &c), ("like", &d), ("order", &e)] {
        let (s, body) = app.key_state(PAYMENTS, biz, k).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::NOT_FOUND, Some("key_not_found")),
            "{biz} {k}"
        );
    }
    let purged: Vec<String> = sqlx::query_scalar(
        "SELECT detail->>'key' FROM audit_events
          WHERE kind = 'reconcile.repaired' AND detail->>'class' = 'expired_purgeable'
          ORDER BY 1",
    )
    .fetch_all(&pg)
    .await
    .expect("purge audit");
    let mut want = vec![c.clone(), d.clone(), e.clone()];
    want.sort();
    assert_eq!(purged, want);
    // The second run finds nothing.
    let again = reconcile(&app).await;
    for (class, n) in again["found"].as_object().expect("found") {
        assert_eq!(n, &json!(0), "{class}: {again}");
    }
    // A forgotten key is a new key.
    consume("order", c.clone()).await;
    app.stop().await;
}
