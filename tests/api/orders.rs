//! Orders: every response of API.md's Orders section, concurrency, and
//! all-or-nothing under killed connections.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::*;

async fn create(app: &TestApp, id: &str, subject: &str, amount: i64) -> Value {
    let r = app
        .post(
            PAYMENTS,
            "/v1/orders",
            &json!({"order_id": id, "subject": subject, "amount_minor": amount, "currency": "CNY"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED, "create {id}");
    r.json().await.unwrap()
}

async fn event(app: &TestApp, id: &str, what: &str, body: Value) -> (StatusCode, bool, Value) {
    answer(
        app.post(PAYMENTS, &format!("/v1/orders/{id}/{what}"), &body)
            .await,
    )
    .await
}

#[tokio::test]
async fn create_is_idempotent_and_scoped() {
    let app = spawn_app().await;
    let body =
        json!({"order_id": "o-1", "subject": "alice", "amount_minor": 1000, "currency": "CNY"});
    let (s, replayed, order) = answer(app.post(PAYMENTS, "/v1/orders", &body).await).await;
    assert_eq!((s, replayed), (StatusCode::CREATED, false));
    assert_eq!(order["state"], "CREATED");
    assert_eq!(order["refunded_minor"], 0);
    assert_eq!(order["events"][0]["kind"], "order.created");
    assert!(order["events"][0]["token"].is_null());
    let (s, replayed, again) = answer(app.post(PAYMENTS, "/v1/orders", &body).await).await;
    assert_eq!((s, replayed), (StatusCode::OK, true));
    assert_eq!(again, order);
    let other =
        json!({"order_id": "o-1", "subject": "alice", "amount_minor": 999, "currency": "CNY"});
    let (s, _, b) = answer(app.post(PAYMENTS, "/v1/orders", &other).await).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::CONFLICT, Some("order_conflict"))
    );
    // Another client, same id, same body: still a conflict (ids are global).
    let (s, _, b) = answer(app.post(REFUNDS, "/v1/orders", &body).await).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::CONFLICT, Some("order_conflict"))
    );
    // Orders belong to their client; admins see all.
    let (s, _, b) = answer(app.get(REFUNDS, "/v1/orders/o-1").await).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("order_not_found"))
    );
    assert_eq!(
        app.get(ADMIN, "/v1/orders/o-1").await.status(),
        StatusCode::OK
    );
    let (s, _, got) = answer(app.get(PAYMENTS, "/v1/orders/o-1").await).await;
    assert_eq!((s, &got), (StatusCode::OK, &order));
    assert_eq!(
        app.get(PAYMENTS, "/v1/orders/nope").await.status(),
        StatusCode::NOT_FOUND
    );

    for bad in [
        json!({"order_id": "", "subject": "a", "amount_minor": 1, "currency": "CNY"}),
        json!({"order_id": "x".repeat(65), "subject": "a", "amount_minor": 1, "currency": "CNY"}),
        json!({"order_id": "a/b", "subject": "a", "amount_minor": 1, "currency": "CNY"}),
        json!({"order_id": "a", "subject": "a", "amount_minor": 0, "currency": "CNY"}),
        json!({"order_id": "a", "subject": "a", "amount_minor": 1_000_000_000_000_001i64, "currency": "CNY"}),
        json!({"order_id": "a", "subject": "a", "amount_minor": 1, "currency": "cny"}),
        json!({"order_id": "a", "subject": "a", "amount_minor": 1, "currency": "CNYY"}),
        json!({"order_id": "a", "subject": "a", "amount_minor": "1", "currency": "CNY"}),
        json!({"order_id": "a", "subject": "a", "amount_minor": 1}),
        json!({"order_id": "a", "subject": "a", "amount_minor": 1, "currency": "CNY", "x": 1}),
    ] {
        let (s, _, b) = answer(app.post(PAYMENTS, "/v1/orders", &bad).await).await;
        assert_eq!(
            (s, b["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_request")),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn pay_refund_close_and_every_refusal() {
    let app = spawn_app().await;
    create(&app, "o-2", "alice", 1000).await;

    // Refusals that leave the token unconsumed.
    let t = app.issue(PAYMENTS, "order", "alice").await;
    let (s, _, b) = event(
        &app,
        "o-2",
        "refund",
        json!({"token": t, "amount_minor": 1}),
    )
    .await;
    assert_eq!(
        (s, b["error"].as_str(), b["state"].as_str()),
        (
            StatusCode::CONFLICT,
            Some("illegal_transition"),
            Some("CREATED")
        )
    );
    let fast = app.issue(PAYMENTS, "like", "alice").await;
    let (s, _, b) = event(&app, "o-2", "pay", json!({"token": fast})).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("durable_token_required")
        )
    );
    let bob = app.issue(PAYMENTS, "order", "bob").await;
    let (s, _, b) = event(&app, "o-2", "pay", json!({"token": bob})).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::FORBIDDEN, Some("token_mismatch"))
    );
    let (s, _, b) = event(&app, "nope", "pay", json!({"token": t})).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("order_not_found"))
    );
    let (s, _, b) = event(&app, "o-2", "pay", json!({"token": "order_dev1_forged"})).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_invalid"))
    );
    let expired = app.sign(
        "order",
        987_654_321,
        (chrono::Utc::now().timestamp() - 1) as u32,
        "payments",
        "alice",
    );
    let (s, _, b) = event(&app, "o-2", "pay", json!({"token": expired})).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_expired"))
    );
    let used = app.issue(PAYMENTS, "order", "alice").await;
    app.consume(PAYMENTS, &used, &json!({"subject": "alice"}))
        .await;
    let (s, _, b) = event(&app, "o-2", "pay", json!({"token": used})).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::CONFLICT, Some("token_already_used"))
    );
    let (s, _, b) = answer(
        app.post(REFUNDS, "/v1/orders/o-2/pay", &json!({"token": t}))
            .await,
    )
    .await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden")),
        "refunds may not use `order` tokens"
    );

    // Pay with `t` (refused above, so still fresh).
    let (s, replayed, b) = event(
        &app,
        "o-2",
        "pay",
        json!({"token": t, "request_id": "pay-1", "fingerprint": "fp"}),
    )
    .await;
    assert_eq!(
        (s, replayed, b["outcome"].as_str()),
        (StatusCode::OK, false, Some("applied")),
        "{b}"
    );
    assert_eq!(b["order"]["state"], "PAID");
    assert_eq!(b["order"]["events"][1]["kind"], "order.paid");
    assert_eq!(b["order"]["events"][1]["token"], t.as_str());
    assert_eq!(b["order"]["events"][1]["amount_minor"], 1000);
    // The same token again: duplicate; with the winning request id: applied, replayed.
    let (s, replayed, b) = event(&app, "o-2", "pay", json!({"token": t})).await;
    assert_eq!(
        (s, replayed, b["outcome"].as_str()),
        (StatusCode::OK, true, Some("duplicate"))
    );
    let (_, replayed, b) = event(
        &app,
        "o-2",
        "pay",
        json!({"token": t, "request_id": "pay-1"}),
    )
    .await;
    assert_eq!((replayed, b["outcome"].as_str()), (true, Some("applied")));
    let (s, _, b) = event(
        &app,
        "o-2",
        "pay",
        json!({"token": t, "fingerprint": "other"}),
    )
    .await;
    assert_eq!(
        (s, b["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        )
    );
    // The same token for another event: already used.
    let (s, _, b) = event(
        &app,
        "o-2",
        "refund",
        json!({"token": t, "amount_minor": 5}),
    )
    .await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::CONFLICT, Some("token_already_used"))
    );
    // Paying twice with a fresh token: illegal, and the token stays fresh.
    let t2 = app.issue(PAYMENTS, "order", "alice").await;
    let (s, _, b) = event(&app, "o-2", "pay", json!({"token": t2})).await;
    assert_eq!(
        (s, b["error"].as_str(), b["state"].as_str()),
        (
            StatusCode::CONFLICT,
            Some("illegal_transition"),
            Some("PAID")
        )
    );
    let (s, _, b) = event(&app, "o-2", "close", json!({"token": t2})).await;
    assert_eq!(
        (s, b["state"].as_str()),
        (StatusCode::CONFLICT, Some("PAID"))
    );

    // Refunds: partial, too much, the rest, then nothing more.
    let (s, _, b) = event(
        &app,
        "o-2",
        "refund",
        json!({"token": t2, "amount_minor": 300, "reason": "damaged"}),
    )
    .await;
    assert_eq!(
        (
            s,
            b["order"]["state"].as_str(),
            b["order"]["refunded_minor"].as_i64()
        ),
        (StatusCode::OK, Some("PARTIALLY_REFUNDED"), Some(300))
    );
    let t3 = app.issue(PAYMENTS, "order", "alice").await;
    let (s, _, b) = event(
        &app,
        "o-2",
        "refund",
        json!({"token": t3, "amount_minor": 701}),
    )
    .await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::CONFLICT, Some("refund_exceeds_paid"))
    );
    for bad in [
        json!({"token": t3, "amount_minor": 0}),
        json!({"token": t3}),
        json!({"token": t3, "amount_minor": 5, "reason": "x".repeat(300)}),
    ] {
        let (s, _, b) = event(&app, "o-2", "refund", bad.clone()).await;
        assert_eq!(
            (s, b["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_request")),
            "{bad}"
        );
    }
    let (_, _, b) = event(
        &app,
        "o-2",
        "refund",
        json!({"token": t3, "amount_minor": 700}),
    )
    .await;
    assert_eq!(
        (
            b["order"]["state"].as_str(),
            b["order"]["refunded_minor"].as_i64()
        ),
        (Some("REFUNDED"), Some(1000))
    );
    let t4 = app.issue(PAYMENTS, "order", "alice").await;
    let (s, _, b) = event(
        &app,
        "o-2",
        "refund",
        json!({"token": t4, "amount_minor": 1}),
    )
    .await;
    assert_eq!(
        (s, b["state"].as_str()),
        (StatusCode::CONFLICT, Some("REFUNDED"))
    );

    // Close a fresh order.
    create(&app, "o-3", "alice", 50).await;
    let (s, _, b) = event(&app, "o-3", "close", json!({"token": t4})).await;
    assert_eq!(
        (s, b["order"]["state"].as_str()),
        (StatusCode::OK, Some("CLOSED"))
    );
    let t5 = app.issue(PAYMENTS, "order", "alice").await;
    let (_, _, b) = event(&app, "o-3", "pay", json!({"token": t5})).await;
    assert_eq!(b["state"], "CLOSED");

    // A token used for an order event cannot be released, and plain consumes see it as used.
    let (s, _, b) = answer(
        app.post(
            PAYMENTS,
            &format!("/v1/tokens/{t}/release"),
            &json!({"subject": "alice"}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::CONFLICT, Some("not_releasable"))
    );
    let (_, _, b) = answer(
        app.consume(PAYMENTS, &t, &json!({"subject": "alice"}))
            .await,
    )
    .await;
    assert_eq!(b["outcome"], "duplicate");
    // Every refused token is still consumable.
    let (_, _, b) = answer(
        app.consume(PAYMENTS, &t5, &json!({"subject": "alice"}))
            .await,
    )
    .await;
    assert_eq!(b["outcome"], "consumed");

    // The audit trail has each event with its token.
    let pool = app.pg().await;
    let rows: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT kind::text, token FROM audit_events WHERE order_id = 'o-2' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let kinds: Vec<&str> = rows.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "order.created",
            "order.paid",
            "order.refunded",
            "order.refunded"
        ]
    );
    assert_eq!(rows[1].1.as_deref(), Some(t.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_pays_with_twenty_tokens_apply_once() {
    let app = Arc::new(spawn_app().await);
    create(&app, "race-pay", "carol", 500).await;
    let mut tokens = Vec::new();
    for _ in 0..20 {
        tokens.push(app.issue(PAYMENTS, "order", "carol").await);
    }
    let barrier = Arc::new(Barrier::new(20));
    let handles: Vec<_> = tokens
        .iter()
        .cloned()
        .map(|t| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let r = event(&app, "race-pay", "pay", json!({"token": t})).await;
                (t, r)
            })
        })
        .collect();
    let mut applied = 0;
    let mut refused = Vec::new();
    for h in handles {
        let (t, (s, _, b)) = h.await.unwrap();
        match (s, b["outcome"].as_str(), b["error"].as_str()) {
            (StatusCode::OK, Some("applied"), _) => applied += 1,
            (StatusCode::CONFLICT, _, Some("illegal_transition")) => refused.push(t),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((applied, refused.len()), (1, 19));
    for t in refused {
        let (_, _, b) = answer(
            app.consume(PAYMENTS, &t, &json!({"subject": "carol"}))
                .await,
        )
        .await;
        assert_eq!(b["outcome"], "consumed", "a refused token stays consumable");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_partial_refunds_never_exceed_the_amount() {
    let app = Arc::new(spawn_app().await);
    create(&app, "race-refund", "dave", 1000).await;
    let t = app.issue(PAYMENTS, "order", "dave").await;
    event(&app, "race-refund", "pay", json!({"token": t})).await;
    let mut tokens = Vec::new();
    for _ in 0..50 {
        tokens.push(app.issue(PAYMENTS, "order", "dave").await);
    }
    let barrier = Arc::new(Barrier::new(50));
    let handles: Vec<_> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let (app, barrier) = (app.clone(), barrier.clone());
            // 50 refunds of 30..79: far more than 1000 in total.
            let amount = 30 + i as i64;
            tokio::spawn(async move {
                barrier.wait().await;
                (
                    amount,
                    event(
                        &app,
                        "race-refund",
                        "refund",
                        json!({"token": t, "amount_minor": amount}),
                    )
                    .await,
                )
            })
        })
        .collect();
    let mut applied_sum = 0;
    for h in handles {
        let (amount, (s, _, b)) = h.await.unwrap();
        match (s, b["error"].as_str()) {
            (StatusCode::OK, _) => applied_sum += amount,
            (StatusCode::CONFLICT, Some("refund_exceeds_paid" | "illegal_transition")) => {}
            other => panic!("unexpected {other:?} {b}"),
        }
    }
    let (_, _, order) = answer(app.get(PAYMENTS, "/v1/orders/race-refund").await).await;
    let refunded = order["refunded_minor"].as_i64().unwrap();
    assert!(refunded <= 1000);
    assert_eq!(refunded, applied_sum);
    let events_sum: i64 = order["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "order.refunded")
        .map(|e| e["amount_minor"].as_i64().unwrap())
        .sum();
    assert_eq!(events_sum, applied_sum);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_pay_token_ten_times_at_once() {
    let app = Arc::new(spawn_app().await);
    create(&app, "race-same", "erin", 100).await;
    let t = app.issue(PAYMENTS, "order", "erin").await;
    let barrier = Arc::new(Barrier::new(10));
    let handles: Vec<_> = (0..10)
        .map(|_| {
            let (app, barrier, t) = (app.clone(), barrier.clone(), t.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                event(&app, "race-same", "pay", json!({"token": t})).await
            })
        })
        .collect();
    let (mut applied, mut duplicate) = (0, 0);
    for h in handles {
        let (s, replayed, b) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "{b}");
        match b["outcome"].as_str() {
            Some("applied") => {
                assert!(!replayed);
                applied += 1
            }
            Some("duplicate") => {
                assert!(replayed);
                duplicate += 1
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((applied, duplicate), (1, 9));
}

/// Connections killed while events run: afterwards every order, its tokens
/// and its audit trail agree, and every token whose event failed is unused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connections_leave_all_or_nothing() {
    let app = Arc::new(spawn_app().await);
    const N: usize = 40;
    let mut tokens = Vec::new();
    for i in 0..N {
        create(&app, &format!("k-{i}"), "frank", 100).await;
        tokens.push(app.issue(PAYMENTS, "order", "frank").await);
    }
    let pool = app.pg().await;
    let db = app.stores.db_name.clone();
    let killer = {
        let pool = pool.clone();
        tokio::spawn(async move {
            for _ in 0..40 {
                let _ = sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                      WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name = 'idempotency-ledger'",
                )
                .bind(&db)
                .execute(&pool)
                .await;
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
    };
    let handles: Vec<_> = tokens
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, t)| {
            let app = app.clone();
            tokio::spawn(async move {
                (
                    i,
                    event(&app, &format!("k-{i}"), "pay", json!({"token": t})).await,
                )
            })
        })
        .collect();
    let mut failed = Vec::new();
    for h in handles {
        let (i, (s, _, b)) = h.await.unwrap();
        if s != StatusCode::OK {
            assert!(s.is_server_error(), "{s} {b}");
            failed.push(i);
        }
    }
    killer.await.unwrap();
    // Agreement, order by order.
    let rows: Vec<(String, String, i64, i64, i64)> = sqlx::query_as(
        r#"SELECT o.order_id, o.state::text,
                  (SELECT count(*) FROM order_events e WHERE e.order_id = o.order_id AND e.kind = 'order.paid'),
                  (SELECT count(*) FROM tokens t WHERE t.order_id = o.order_id AND t.state = 'consumed'),
                  (SELECT count(*) FROM audit_events a WHERE a.order_id = o.order_id AND a.kind = 'order.paid')
             FROM orders o WHERE o.order_id LIKE 'k-%'"#,
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), N);
    for (id, state, events, tokens, audits) in rows {
        let paid = state == "PAID";
        let n = i64::from(paid);
        assert_eq!((events, tokens, audits), (n, n, n), "{id} {state}");
    }
    // A failed event left its token fresh: retrying pays exactly once.
    for i in failed {
        let (s, _, b) = event(&app, &format!("k-{i}"), "pay", json!({"token": tokens[i]})).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert!(b["outcome"] == "applied" || b["outcome"] == "duplicate");
    }
}

/// Two identical partial refunds (same order, token, amount and
/// `request_id`) reach two instances at once, a double click behind a load
/// balancer: both statements read the token while a third transaction holds
/// the order's row, then wait for it. The one that runs second must decide on
/// what the first committed (the `applied` answer again, for the same
/// `request_id`), never answer 409 `token_already_used` from its old view of
/// the token; a third copy with another `request_id` is a `duplicate`, and
/// one with another amount 422 `fingerprint_mismatch`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn identical_refunds_racing_on_two_instances_answer_as_retries() {
    let stores = Stores::fresh();
    let a = Arc::new(spawn_app_on(stores.clone()).await);
    let b = Arc::new(spawn_app_on(stores).await);
    create(&a, "twin", "erin", 1000).await;
    let pay = a.issue(PAYMENTS, "order", "erin").await;
    let (s, _, _) = event(&a, "twin", "pay", json!({"token": pay})).await;
    assert_eq!(s, StatusCode::OK);
    let refund = a.issue(PAYMENTS, "refund", "erin").await;
    let body = json!({"token": refund, "amount_minor": 300, "request_id": "refund-twin-1"});

    let pg = a.pg().await;
    let mut holder = pg.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM orders WHERE order_id = 'twin' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let sent: Vec<_> = [a.clone(), b.clone()]
        .into_iter()
        .map(|app| {
            let body = body.clone();
            tokio::spawn(async move { event(&app, "twin", "refund", body).await })
        })
        .collect();
    // Both events' statements are waiting for the order's row.
    eventually(20, || {
        let pg = pg.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pg)
            .await
            .ok()?;
            (waiting >= 2).then_some(())
        }
    })
    .await;
    holder.rollback().await.unwrap();

    let mut replayed_flags = Vec::new();
    for h in sent {
        let (s, replayed, b) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(b["outcome"], "applied", "{b}");
        assert_eq!(b["order"]["refunded_minor"], 300, "{b}");
        replayed_flags.push(replayed);
    }
    replayed_flags.sort();
    assert_eq!(replayed_flags, [false, true], "one applied, one its replay");

    let other_attempt =
        json!({"token": refund, "amount_minor": 300, "request_id": "refund-twin-2"});
    let (s, replayed, b) = event(&b, "twin", "refund", other_attempt).await;
    assert_eq!(
        (s, replayed, b["outcome"].as_str()),
        (StatusCode::OK, true, Some("duplicate"))
    );
    let other_amount = json!({"token": refund, "amount_minor": 200, "request_id": "refund-twin-1"});
    let (s, _, b) = event(&a, "twin", "refund", other_amount).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        )
    );
    let (_, _, order) = answer(a.get(PAYMENTS, "/v1/orders/twin").await).await;
    assert_eq!(order["refunded_minor"], 300);
}

/// An order event replayed with the same token but another amount (refund)
/// or another fingerprint (pay) is 422 `fingerprint_mismatch` and changes
/// nothing; only the identical event is a `duplicate`.
#[tokio::test]
async fn an_order_event_replayed_with_another_amount_or_fingerprint_is_422() {
    let app = spawn_app().await;
    let created = app
        .post(
            PAYMENTS,
            "/v1/orders",
            &json!({"order_id": "o-12", "subject": "u-1", "amount_minor": 1000, "currency": "CNY"}),
        )
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let order = || async { answer(app.get(PAYMENTS, "/v1/orders/o-12").await).await.2 };
    let pay = app.issue(PAYMENTS, "order", "u-1").await;
    let event = |path: &'static str, body: Value| {
        let app = &app;
        async move {
            answer(
                app.post(PAYMENTS, &format!("/v1/orders/o-12/{path}"), &body)
                    .await,
            )
            .await
        }
    };
    let (s, _, body) = event("pay", json!({"token": pay, "fingerprint": "sha256:a"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{body}"
    );
    let (s, _, body) = event("pay", json!({"token": pay, "fingerprint": "sha256:b"})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        ),
        "{body}"
    );
    let (s, replayed, body) = event("pay", json!({"token": pay, "fingerprint": "sha256:a"})).await;
    assert_eq!(
        (s, replayed, body["outcome"].as_str()),
        (StatusCode::OK, true, Some("duplicate"))
    );

    let refund = app.issue(PAYMENTS, "refund", "u-1").await;
    let (s, _, body) = event("refund", json!({"token": refund, "amount_minor": 300})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{body}"
    );
    let before = order().await;
    let (s, _, body) = event("refund", json!({"token": refund, "amount_minor": 500})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        ),
        "{body}"
    );
    let after = order().await;
    assert_eq!(before, after, "nothing changed");
    assert_eq!(after["refunded_minor"], 300);
    let (s, replayed, body) = event("refund", json!({"token": refund, "amount_minor": 300})).await;
    assert_eq!(
        (s, replayed, body["outcome"].as_str()),
        (StatusCode::OK, true, Some("duplicate"))
    );
    app.stop().await;
}
