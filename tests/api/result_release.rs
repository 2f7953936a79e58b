//! Recording results and releasing tokens.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::calls::consume;
use crate::helpers::*;

const BIZES: [&str; 2] = ["order", "like"];

#[tokio::test]
async fn result_rules() {
    let app = spawn_app().await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "u").await;
        let path = format!("/v1/tokens/{token}/result");
        let result = json!({"payment_id": "p-1", "amount": 1000});

        // Not consumed yet.
        let (s, _, body) = answer(
            app.post(PAYMENTS, &path, &json!({"subject": "u", "result": result}))
                .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_consumed")),
            "{biz}"
        );

        app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
            .await;
        let (s, replayed, body) = answer(
            app.post(PAYMENTS, &path, &json!({"subject": "u", "result": result}))
                .await,
        )
        .await;
        assert_eq!(
            (s, replayed, body["outcome"].as_str()),
            (StatusCode::OK, false, Some("recorded")),
            "{biz}"
        );
        // The same again: 200, replayed.
        let (s, replayed, _) = answer(
            app.post(PAYMENTS, &path, &json!({"subject": "u", "result": result}))
                .await,
        )
        .await;
        assert_eq!((s, replayed), (StatusCode::OK, true), "{biz}");
        // Another one: 409.
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                &path,
                &json!({"subject": "u", "result": {"other": true}}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::CONFLICT, Some("result_already_set")),
            "{biz}"
        );
        // Another subject or client: token_mismatch.
        let (s, _, body) = answer(
            app.post(PAYMENTS, &path, &json!({"subject": "v", "result": result}))
                .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("token_mismatch")),
            "{biz}"
        );
        let (s, _, body) = answer(
            app.post(ADMIN, &path, &json!({"subject": "u", "result": result}))
                .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("token_mismatch")),
            "{biz}"
        );

        // Later duplicates replay it as completed.
        let dup = eventually(5, || async {
            let (_, _, body) = answer(
                app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
                    .await,
            )
            .await;
            (body["status"] == "completed").then_some(body)
        })
        .await;
        assert_eq!(dup["outcome"], "duplicate");
        assert_eq!(dup["result"], result, "{biz}");

        // Not releasable once it has a result.
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/release"),
                &json!({"subject": "u"}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}"
        );
    }
}

#[tokio::test]
async fn result_bodies_up_to_64_kib() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "u").await;
    app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
        .await;
    let path = format!("/v1/tokens/{token}/result");
    let big = "x".repeat(70 * 1024);
    let (s, _, body) = answer(
        app.post(PAYMENTS, &path, &json!({"subject": "u", "result": big}))
            .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, Some("payload_too_large"))
    );
    let fits = "x".repeat(60 * 1024);
    let (s, _, _) = answer(
        app.post(PAYMENTS, &path, &json!({"subject": "u", "result": fits}))
            .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn release_returns_the_token_for_a_retry() {
    let app = spawn_app().await;
    for biz in BIZES {
        let token = app.issue(PAYMENTS, biz, "u").await;
        let release = format!("/v1/tokens/{token}/release");
        // Not consumed: not releasable.
        let (s, _, body) =
            answer(app.post(PAYMENTS, &release, &json!({"subject": "u"})).await).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}"
        );

        let (_, _, body) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "request_id": "a"}),
            )
            .await,
        )
        .await;
        assert_eq!(body["outcome"], "consumed");
        let (s, _, body) =
            answer(app.post(PAYMENTS, &release, &json!({"subject": "v"})).await).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("token_mismatch")),
            "{biz}"
        );
        let (s, _, body) =
            answer(app.post(PAYMENTS, &release, &json!({"subject": "u"})).await).await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("released")),
            "{biz}: {body}"
        );

        // Consumable again, by a new attempt; exactly once.
        let (_, replayed, body) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "request_id": "b"}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (body["outcome"].as_str(), replayed),
            (Some("consumed"), false),
            "{biz}: {body}"
        );
        let (_, _, body) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "request_id": "c"}),
            )
            .await,
        )
        .await;
        assert_eq!(body["outcome"], "duplicate", "{biz}");
    }
    // The durable token's story is in the audit trail.
    let pool = app.pg().await;
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind::text FROM audit_events WHERE biz_type = 'order' AND kind <> 'token.issued' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        kinds,
        ["token.consumed", "token.released", "token.consumed"]
    );
}

/// A release racing duplicate consumes: whatever the interleaving, the token
/// is consumed exactly once after the release (no stale consumed marker left
/// in Redis makes it look used, no double consume).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn release_racing_duplicates_never_leaves_a_false_duplicate() {
    let app = std::sync::Arc::new(spawn_app().await);
    let redis = app.redis().await;
    for round in 0..30 {
        let token = app.issue(PAYMENTS, "order", "u").await;
        let (_, _, b) = answer(
            app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
                .await,
        )
        .await;
        assert_eq!(b["outcome"], "consumed");
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(6));
        let mut racers = Vec::new();
        for _ in 0..5 {
            let (app, barrier, token) = (app.clone(), barrier.clone(), token.clone());
            racers.push(tokio::spawn(async move {
                barrier.wait().await;
                let (_, _, b) = answer(
                    app.consume(PAYMENTS, &token, &json!({"subject": "u"}))
                        .await,
                )
                .await;
                b["outcome"] == "consumed"
            }));
        }
        barrier.wait().await;
        let (s, _, b) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/release"),
                &json!({"subject": "u"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "round {round}: {b}");
        let mut consumed_by_racers = 0;
        for r in racers {
            consumed_by_racers += usize::from(r.await.unwrap());
        }
        assert!(consumed_by_racers <= 1, "round {round}");
        // Wait for the release's background write to Redis (`issued` at
        // generation 2) to land, then ask again. A racer that won in Postgres
        // after the release (generation 3) writes its consumed marker over
        // it; the first consume's marker (generation 1) never does.
        let key = app.token_key(&token);
        eventually(5, || {
            let mut redis = redis.clone();
            let key = key.clone();
            async move {
                let (s, g): (Option<String>, Option<i64>) = redis::cmd("HMGET")
                    .arg(&key)
                    .arg("s")
                    .arg("g")
                    .query_async(&mut redis)
                    .await
                    .ok()?;
                matches!(
                    (s.as_deref(), g),
                    (Some("i"), Some(2)) | (Some("c"), Some(3))
                )
                .then_some(())
            }
        })
        .await;
        let (_, _, b) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "request_id": "final"}),
            )
            .await,
        )
        .await;
        let final_consumed = usize::from(b["outcome"] == "consumed");
        assert_eq!(consumed_by_racers + final_consumed, 1, "round {round}: {b}");
    }
}

/// Numbers at the edges of what JSON clients send (found by schemathesis: a
/// result holding -1.7976931348623155e308 was stored, and every later read of
/// it, the duplicate's answer, the key's view and the audit trail, answered
/// 500 because Postgres writes it back as a 309-digit integer).
#[tokio::test]
async fn results_with_extreme_numbers_read_back_as_recorded() {
    let app = spawn_app().await;
    let result = json!({
        "near_min": -1.797_693_134_862_315_5e308,
        "max": f64::MAX,
        "min_positive": f64::MIN_POSITIVE,
        "subnormal": 5e-324,
        "u64_max": u64::MAX,
        "i64_min": i64::MIN,
        "point_three": 0.300_000_000_000_000_04,
        "big": 1e21,
        "nested": [[-0.0, 1.5e300, -2.5e-300]],
    });
    for biz in BIZES {
        // A token.
        let token = app.issue(PAYMENTS, biz, "u").await;
        let consumed = app
            .consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "request_id": "r-1"}),
            )
            .await;
        assert_eq!(consumed.status(), StatusCode::OK, "{biz}");
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/result"),
                &json!({"subject": "u", "result": result}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}: {body}");
        let (s, _, dup) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "request_id": "r-2"}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, dup["status"].as_str()),
            (StatusCode::OK, Some("completed")),
            "{biz}: {dup}"
        );
        assert_eq!(dup["result"], result, "{biz}: the token's duplicate");

        // A client key.
        let key = format!("k-{}", uuid::Uuid::new_v4());
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                "/v1/keys/consume",
                &json!({"biz_type": biz, "key": key, "request_id": "r-1"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}: {body}");
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                "/v1/keys/result",
                &json!({"biz_type": biz, "key": key, "result": result}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}: {body}");
        let (s, _, dup) = answer(
            app.post(
                PAYMENTS,
                "/v1/keys/consume",
                &json!({"biz_type": biz, "key": key, "request_id": "r-2"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}: {dup}");
        assert_eq!(dup["result"], result, "{biz}: the key's duplicate");
        let (s, _, view) = answer(
            app.get(PAYMENTS, &format!("/v1/keys?biz_type={biz}&key={key}"))
                .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}: {view}");
        assert_eq!(view["result"], result, "{biz}: the key's view");
    }
    // The trail holds them too, once journaled.
    eventually(10, || async {
        let (s, _, trail) = answer(app.get(ADMIN, "/v1/admin/audit?limit=200").await).await;
        assert_eq!(s, StatusCode::OK, "{trail}");
        let results = trail["events"]
            .as_array()
            .map(|events| {
                events
                    .iter()
                    .filter(|e| e["detail"]["result"] == result)
                    .count()
            })
            .unwrap_or(0);
        (results >= 4).then_some(())
    })
    .await;
}

/// Issue 24, item 7: a result (or release) names the consume it belongs to
/// (`request_id`). After that consume was released and another attempt
/// consumed the token, the first consumer's late result or release is
/// refused (409) instead of landing on the second attempt's consume.
#[tokio::test]
async fn a_late_result_or_release_never_lands_on_another_attempt_s_consume() {
    let app = spawn_app().await;
    for biz in BIZES {
        // A token.
        let token = app.issue(PAYMENTS, biz, "u").await;
        let path = |op: &str| format!("/v1/tokens/{token}/{op}");
        let (app_ref, token_ref) = (&app, &token);
        let consume = |rid: &'static str| async move {
            app_ref
                .consume(
                    PAYMENTS,
                    token_ref,
                    &json!({"subject": "u", "request_id": rid}),
                )
                .await
        };
        assert_eq!(consume("r-1").await.status(), StatusCode::OK);
        let (s, _, _) = answer(
            app.post(
                PAYMENTS,
                &path("release"),
                &json!({"subject": "u", "request_id": "r-1"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}: r-1 releases its own consume");
        let (_, _, won) = answer(consume("r-2").await).await;
        assert_eq!(won["outcome"], "consumed", "{biz}");
        let (s, _, late) = answer(
            app.post(
                PAYMENTS,
                &path("result"),
                &json!({"subject": "u", "request_id": "r-1", "result": {"from": "r-1"}}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, late["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_consumed")),
            "{biz}: {late}"
        );
        let (s, _, late) = answer(
            app.post(
                PAYMENTS,
                &path("release"),
                &json!({"subject": "u", "request_id": "r-1"}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, late["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}: {late}"
        );
        // The second attempt's own result lands.
        let (s, _, _) = answer(
            app.post(
                PAYMENTS,
                &path("result"),
                &json!({"subject": "u", "request_id": "r-2", "result": {"from": "r-2"}}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}");
        let (_, _, dup) = answer(consume("r-3").await).await;
        assert_eq!(dup["result"], json!({"from": "r-2"}), "{biz}");

        // A client key.
        let key = format!("k-{}", uuid::Uuid::new_v4());
        let (app_ref, key_ref) = (&app, &key);
        let consume_key = |rid: &'static str| async move {
            app_ref
                .post(
                    PAYMENTS,
                    "/v1/keys/consume",
                    &json!({"biz_type": biz, "key": key_ref, "request_id": rid}),
                )
                .await
        };
        assert_eq!(consume_key("r-1").await.status(), StatusCode::OK);
        let (s, _, _) = answer(
            app.post(
                PAYMENTS,
                "/v1/keys/release",
                &json!({"biz_type": biz, "key": key, "request_id": "r-1"}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{biz}");
        let (_, _, won) = answer(consume_key("r-2").await).await;
        assert_eq!(won["outcome"], "consumed", "{biz}");
        let (s, _, late) = answer(
            app.post(
                PAYMENTS,
                "/v1/keys/result",
                &json!({"biz_type": biz, "key": key, "request_id": "r-1", "result": 1}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, late["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_consumed")),
            "{biz}: {late}"
        );
        let (s, _, late) = answer(
            app.post(
                PAYMENTS,
                "/v1/keys/release",
                &json!({"biz_type": biz, "key": key, "request_id": "r-1"}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, late["error"].as_str()),
            (StatusCode::CONFLICT, Some("not_releasable")),
            "{biz}: {late}"
        );
        let (_, _, state) = answer(
            app.get(PAYMENTS, &format!("/v1/keys?biz_type={biz}&key={key}"))
                .await,
        )
        .await;
        assert_eq!(
            (state["state"].as_str(), &state["result"]),
            (Some("consumed"), &Value::Null),
            "{biz}: the second attempt's consume is untouched"
        );
    }
}

/// A result holding U+0000 anywhere is 400 `invalid_request` for durable and
/// fast types alike, and changes nothing: the right result is recorded after
/// it, and reaches Postgres.
#[tokio::test]
async fn a_result_holding_nul_is_400_for_every_biz_type() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    for biz in ["order", "like"] {
        let token = app.issue(PAYMENTS, biz, "u-1").await;
        let (s, _, _) = consume(&app, &token, json!({"subject": "u-1"})).await;
        assert_eq!(s, StatusCode::OK);
        for bad in [
            json!({"note": "nul\u{0}byte"}),
            json!({"k\u{0}": 1}),
            json!([["\u{0}"]]),
        ] {
            let r = app
                .post(
                    PAYMENTS,
                    &format!("/v1/tokens/{token}/result"),
                    &json!({"subject": "u-1", "result": bad}),
                )
                .await;
            let (s, _, body) = answer(r).await;
            assert_eq!(
                (s, body["error"].as_str()),
                (StatusCode::BAD_REQUEST, Some("invalid_request")),
                "{biz}: {body}"
            );
        }
        let good = json!({"note": "no nul"});
        let r = app
            .post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/result"),
                &json!({"subject": "u-1", "result": good}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK, "{biz}");
        eventually(15, || async {
            let result: Option<Value> =
                sqlx::query_scalar("SELECT result FROM tokens WHERE token = $1")
                    .bind(&token)
                    .fetch_optional(&pg)
                    .await
                    .expect("query")
                    .flatten();
            (result == Some(good.clone())).then_some(())
        })
        .await;
    }
    app.stop().await;
}

// ---- group commit of results and releases (`durable::batch::FinishBatcher`) ----

fn finish_record(id: i64) -> idempotency_ledger::durable::tokens::TokenRecord {
    let now = chrono::Utc::now();
    idempotency_ledger::durable::tokens::TokenRecord {
        id,
        token: format!("order_test_{id}"),
        biz_type: "order".into(),
        durability: idempotency_ledger::config::Durability::Durable,
        subject: format!("u-{id}"),
        client: "payments".into(),
        issued_at: now - chrono::Duration::seconds(10),
        expires_at: now + chrono::Duration::hours(1),
        key: None,
    }
}

/// What a result or release answered, without Postgres's clock.
fn finish_shape(f: &idempotency_ledger::durable::batch::Finished) -> Value {
    use idempotency_ledger::durable::batch::Finished;
    use idempotency_ledger::durable::tokens::{Existing, ReleaseRow, ResultDecided};
    let existing = |e: &Existing| json!([format!("{:?}", e.state), e.request_id, e.result, e.gen]);
    match f {
        Finished::Result(ResultDecided::Recorded(e)) => json!(["recorded", existing(e)]),
        Finished::Result(ResultDecided::Existing(e)) => json!(["result-existing", existing(e)]),
        Finished::Result(ResultDecided::Unknown) => json!(["result-unknown"]),
        Finished::Release(ReleaseRow::Released { gen, .. }) => json!(["released", gen]),
        Finished::Release(ReleaseRow::Existing(e)) => json!(["release-existing", existing(e)]),
        Finished::Release(ReleaseRow::Unknown) => json!(["release-unknown"]),
    }
}

/// One batch statement of results and releases answers each item exactly
/// as the single statements answer its twin: a result recorded, one on an
/// issued token, one on a token with a result, one naming another
/// request's consume, one on no row; a release done, one of a token with a
/// result, one naming another request, one of no row; with the same audit
/// rows (kinds, generations, details). So do a batch of the results alone
/// and one of the releases alone (each runs a statement of its own).
#[tokio::test]
async fn one_result_and_release_batch_answers_each_item_as_the_single_statements_do() {
    use idempotency_ledger::durable::batch::{finish_batch, FinishItem, Finished};
    use idempotency_ledger::durable::tokens;
    let app = spawn_app().await;
    let pg = app.pg().await;
    let paid = json!({"payment_id": "p-1"});
    let other = json!({"payment_id": "p-0"});
    let by = json!({"by": "ops", "reason": "test"});
    // (offset, prior state, item)
    let cases = |base: i64| -> Vec<(i64, &'static str, FinishItem)> {
        let result = |i: i64, rid: Option<&str>, detail: Option<&Value>| FinishItem::Result {
            id: base + i,
            result: paid.clone(),
            detail: detail.cloned(),
            of_request: rid.map(str::to_owned),
        };
        let release = |i: i64, rid: Option<&str>, detail: Option<&Value>| FinishItem::Release {
            id: base + i,
            detail: detail.cloned(),
            of_request: rid.map(str::to_owned),
        };
        vec![
            (1, "consumed", result(1, Some("r-first"), None)),
            (2, "consumed", result(2, None, Some(&by))),
            (3, "issued", result(3, None, None)),
            (4, "resulted", result(4, None, None)),
            (5, "consumed", result(5, Some("r-other"), None)),
            (6, "none", result(6, None, None)),
            (7, "consumed", release(7, Some("r-first"), None)),
            (8, "consumed", release(8, None, Some(&by))),
            (9, "resulted", release(9, None, None)),
            (10, "consumed", release(10, Some("r-other"), None)),
            (11, "none", release(11, None, None)),
        ]
    };
    for base in [100, 200, 300, 400] {
        for (i, prior, _) in cases(base) {
            let rec = finish_record(base + i);
            if prior == "none" {
                continue;
            }
            tokens::insert_issued(&pg, std::slice::from_ref(&rec), uuid::Uuid::nil(), &[])
                .await
                .unwrap();
            if prior == "issued" {
                continue;
            }
            tokens::consume(&pg, &rec, Some("sha256:f"), Some("r-first"))
                .await
                .unwrap();
            if prior == "resulted" {
                tokens::set_result(&pg, rec.id, &other).await.unwrap();
            }
        }
    }
    let batched_of = |items: Vec<FinishItem>| {
        let pg = pg.clone();
        async move {
            let refs: Vec<&FinishItem> = items.iter().collect();
            finish_batch(&pg, &refs)
                .await
                .unwrap()
                .iter()
                .map(|a| finish_shape(a.as_ref().unwrap()))
                .collect::<Vec<Value>>()
        }
    };
    let is_result = |it: &FinishItem| matches!(it, FinishItem::Result { .. });
    let batched = batched_of(cases(100).into_iter().map(|(_, _, it)| it).collect()).await;
    let (results_alone, releases_alone): (Vec<FinishItem>, Vec<FinishItem>) = cases(300)
        .into_iter()
        .map(|(_, _, it)| it)
        .filter(is_result)
        .chain(
            cases(400)
                .into_iter()
                .map(|(_, _, it)| it)
                .filter(|it| !is_result(it)),
        )
        .partition(is_result);
    let mut alone = batched_of(results_alone).await;
    alone.extend(batched_of(releases_alone).await);
    let mut single = Vec::new();
    for (_, _, it) in cases(200) {
        let answer = match &it {
            FinishItem::Result {
                id,
                result,
                detail,
                of_request,
            } => Finished::Result(
                tokens::set_result_versioned(
                    &pg,
                    *id,
                    result,
                    detail.as_ref(),
                    of_request.as_deref(),
                )
                .await
                .unwrap(),
            ),
            FinishItem::Release {
                id,
                detail,
                of_request,
            } => Finished::Release(
                tokens::release_with(&pg, *id, detail.as_ref(), of_request.as_deref())
                    .await
                    .unwrap(),
            ),
        };
        single.push(finish_shape(&answer));
    }
    assert_eq!(batched, single);
    assert_eq!(alone, single);
    let consumed = |result: Value| json!(["Consumed", "r-first", result, 1]);
    assert_eq!(
        batched,
        vec![
            json!(["recorded", consumed(paid.clone())]),
            json!(["recorded", consumed(paid.clone())]),
            json!(["result-existing", ["Issued", null, null, 0]]),
            json!(["result-existing", consumed(other.clone())]),
            json!(["result-existing", consumed(Value::Null)]),
            json!(["result-unknown"]),
            json!(["released", 2]),
            json!(["released", 2]),
            json!(["release-existing", consumed(other.clone())]),
            json!(["release-existing", consumed(Value::Null)]),
            json!(["release-unknown"]),
        ]
    );
    let audits = |lo: i64| {
        let pg = pg.clone();
        async move {
            let rows: Vec<(i64, String, Option<i64>, Value)> = sqlx::query_as(
                "SELECT token_id - $1, kind::text, gen, detail FROM audit_events
                  WHERE token_id BETWEEN $1 AND $1 + 99
                    AND kind IN ('token.result', 'token.released')
                  ORDER BY 1, 2, 3",
            )
            .bind(lo)
            .fetch_all(&pg)
            .await
            .unwrap();
            rows
        }
    };
    let batch_audits = audits(100).await;
    assert_eq!(batch_audits, audits(200).await);
    assert_eq!(batch_audits.len(), 6, "{batch_audits:?}");
    // Each base holds all eleven rows (the prior results' audit rows too):
    // the results' offsets are 1 to 6, the releases' 7 to 11.
    let mut alone_audits = audits(300).await;
    alone_audits.retain(|row| row.0 <= 6);
    alone_audits.extend(audits(400).await.into_iter().filter(|row| row.0 >= 7));
    assert_eq!(alone_audits, batch_audits);
    app.stop().await;
}

/// 40 durable tokens consumed, then their results (even) and releases (odd)
/// fired together with one statement in flight at a time: each answered as
/// one at a time would be, and the rows were changed by fewer transactions
/// than tokens (their `xmin`), the histogram showing batches of more than
/// one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn results_and_releases_fired_together_are_decided_in_batches() {
    let _heavy = heavy().await;
    let app = spawn_app_batching().await;
    const N: usize = 40;
    let mut tokens = Vec::new();
    for i in 0..N {
        let subject = format!("u-{i}");
        let token = app.issue(PAYMENTS, "order", &subject).await;
        let (s, _, b) = consume(&app, &token, json!({"subject": subject})).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        tokens.push(token);
    }
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(N));
    let handles: Vec<_> = tokens
        .iter()
        .enumerate()
        .map(|(i, token)| {
            let (app, barrier, token) = (app.clone(), barrier.clone(), token.clone());
            tokio::spawn(async move {
                let subject = format!("u-{i}");
                let (path, body) = if i.is_multiple_of(2) {
                    (
                        format!("/v1/tokens/{token}/result"),
                        json!({"subject": subject, "result": {"n": i}}),
                    )
                } else {
                    (
                        format!("/v1/tokens/{token}/release"),
                        json!({"subject": subject}),
                    )
                };
                barrier.wait().await;
                answer(app.post(PAYMENTS, &path, &body).await).await
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (s, _, b) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "token {i}: {b}");
    }
    let pg = app.pg().await;
    let rows: Vec<(String, Option<Value>, String)> = sqlx::query_as(
        "SELECT state::text, result, xmin::text FROM tokens WHERE token = ANY($1) ORDER BY token COLLATE \"C\"",
    )
    .bind(&tokens)
    .fetch_all(&pg)
    .await
    .unwrap();
    let mut by_token: Vec<(&String, usize)> = tokens.iter().zip(0..).collect();
    by_token.sort();
    for ((state, result, _), (_, i)) in rows.iter().zip(&by_token) {
        if i.is_multiple_of(2) {
            assert_eq!(
                (state.as_str(), result),
                ("consumed", &Some(json!({"n": i})))
            );
        } else {
            assert_eq!((state.as_str(), result), ("issued", &None));
        }
    }
    let transactions: std::collections::HashSet<&String> = rows.iter().map(|r| &r.2).collect();
    assert!(
        transactions.len() < N,
        "{} transactions for {N} results and releases",
        transactions.len()
    );
    let text = app.metrics_text().await;
    let count = crate::helpers::scrape::sample(&text, "ledger_pg_finish_batch_size_count", &[])
        .expect("count");
    let sum =
        crate::helpers::scrape::sample(&text, "ledger_pg_finish_batch_size_sum", &[]).expect("sum");
    assert!(
        count < sum,
        "{count} batches for {sum} results and releases"
    );
    std::sync::Arc::try_unwrap(app)
        .ok()
        .expect("sole owner")
        .stop()
        .await;
}

/// A result Postgres refuses (a constraint the schema gained: no result
/// `{"n": 13}`) sits in a batch with ten releases and results of other
/// tokens: the batch statement fails as a whole, its items are decided one
/// by one, and only the refused one fails (500).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_result_postgres_refuses_fails_only_itself_in_a_batch() {
    let app = std::sync::Arc::new(
        spawn_app_on(Stores::fresh().with(
            "postgres.consume_batches_in_flight = 1\npostgres.acquire_timeout = \"10s\"\npostgres.statement_timeout = \"20s\"",
        ))
        .await,
    );
    let pg = app.pg().await;
    let mut tokens = Vec::new();
    for i in 0..12 {
        let subject = format!("u-{i}");
        let token = app.issue(PAYMENTS, "order", &subject).await;
        let (s, _, b) = consume(&app, &token, json!({"subject": subject})).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        tokens.push(token);
    }
    sqlx::query(
        "ALTER TABLE tokens ADD CONSTRAINT test_refused_result
             CHECK (result IS NULL OR result <> '{\"n\": 13}'::jsonb) NOT VALID",
    )
    .execute(&pg)
    .await
    .unwrap();
    // Token 0's result (the statement in flight) waits on a row lock held
    // here, so the eleven calls after it queue for one batch.
    let mut lock = pg.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM tokens WHERE token = $1 FOR UPDATE")
        .bind(&tokens[0])
        .execute(&mut *lock)
        .await
        .unwrap();
    let send = |i: usize, n: i64| {
        let (app, token) = (app.clone(), tokens[i].clone());
        tokio::spawn(async move {
            let subject = format!("u-{i}");
            let (path, body) = if n < 0 {
                (
                    format!("/v1/tokens/{token}/release"),
                    json!({"subject": subject}),
                )
            } else {
                (
                    format!("/v1/tokens/{token}/result"),
                    json!({"subject": subject, "result": {"n": n}}),
                )
            };
            answer(app.post(PAYMENTS, &path, &body).await).await
        })
    };
    let wait_for = |name: &'static str, n: f64| {
        let app = app.clone();
        async move {
            eventually(10, || {
                let app = app.clone();
                async move {
                    let text = app.metrics_text().await;
                    (crate::helpers::scrape::sample(&text, name, &[]) == Some(n)).then_some(())
                }
            })
            .await
        }
    };
    let first = send(0, 0);
    wait_for("ledger_pg_finish_batch_size_count", 1.0).await;
    let refused = send(1, 13);
    // Even: results; odd: releases.
    let rest: Vec<_> = (2..12)
        .map(|i| send(i, if i % 2 == 0 { i as i64 } else { -1 }))
        .collect();
    wait_for("ledger_pg_finish_queue", 11.0).await;
    lock.commit().await.unwrap();

    let (s, _, b) = first.await.unwrap();
    assert_eq!(s, StatusCode::OK, "{b}");
    for (i, h) in rest.into_iter().enumerate() {
        let (s, _, b) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "token {}: {b}", i + 2);
    }
    let (s, _, b) = refused.await.unwrap();
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{b}");
    let text = app.metrics_text().await;
    let sample = |le: &str| {
        crate::helpers::scrape::sample(&text, "ledger_pg_finish_batch_size_bucket", &[("le", le)])
            .expect("bucket")
    };
    assert!(
        sample("16") > sample("8"),
        "no batch of 9 to 16 items: {text}"
    );
    let (state, result): (String, Option<Value>) =
        sqlx::query_as("SELECT state::text, result FROM tokens WHERE token = $1")
            .bind(&tokens[1])
            .fetch_one(&pg)
            .await
            .unwrap();
    assert_eq!((state.as_str(), result), ("consumed", None));
    std::sync::Arc::try_unwrap(app)
        .ok()
        .expect("sole owner")
        .stop()
        .await;
}
