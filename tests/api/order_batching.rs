//! Group commit of order events (`orders::batch`): events on distinct
//! orders that arrive while a transaction runs share the next one, each with
//! the answer, rows and counters it would have alone; events of one order
//! serialise; an event Postgres refuses fails only itself; a batch that
//! fails as a whole answers 503 to the events it was writing.

use std::collections::HashMap;
use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::scrape::sample;
use crate::helpers::*;

/// One statement in flight, long bounds: the events that arrive while it
/// runs queue for the next batch.
const ONE_IN_FLIGHT: &str = "postgres.order_batches_in_flight = 1\npostgres.acquire_timeout = \"10s\"\npostgres.statement_timeout = \"20s\"";

async fn create(app: &TestApp, key: &str, id: &str, subject: &str, amount: i64) {
    let r = app
        .post(
            key,
            "/v1/orders",
            &json!({"order_id": id, "subject": subject, "amount_minor": amount, "currency": "CNY"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED, "create {id}");
}

async fn event(app: &TestApp, id: &str, what: &str, body: &Value) -> (StatusCode, bool, Value) {
    answer(
        app.post(PAYMENTS, &format!("/v1/orders/{id}/{what}"), body)
            .await,
    )
    .await
}

/// The batch-size histogram: (transactions, events in them, transactions
/// of at most `le` events).
async fn batches(app: &TestApp, le: &str) -> (f64, f64, f64) {
    let text = app.metrics_text().await;
    let count = sample(&text, "ledger_pg_order_batch_size_count", &[]).expect("histogram");
    let sum = sample(&text, "ledger_pg_order_batch_size_sum", &[]).expect("histogram");
    let small = sample(&text, "ledger_pg_order_batch_size_bucket", &[("le", le)]).expect("bucket");
    (count, sum, small)
}

/// Waits until the metric `name` (no labels) says `n`.
async fn wait_metric(app: &TestApp, name: &'static str, n: f64) {
    eventually(20, || async move {
        let text = app.metrics_text().await;
        (sample(&text, name, &[]) == Some(n)).then_some(())
    })
    .await
}

/// A transaction of the test's own holding the row lock of `order_id`, so
/// that the service's event on it waits: the events after it queue.
async fn hold_order(
    pg: &sqlx::PgPool,
    order_id: &str,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pg.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM orders WHERE order_id = $1 FOR UPDATE")
        .bind(order_id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// 60 orders, each paid by 5 identical requests fired together, with one
/// transaction in flight at a time so that the events arriving meanwhile
/// are batched: each order is paid exactly once (one `applied`; the other
/// copies replays with its request_id, duplicates without one), with one
/// event, audit row and consumed token each; the histogram shows batches of
/// more than one; the consume counters count one `consumed` per order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storm_of_identical_pays_is_decided_in_batches_each_order_paid_once() {
    let _heavy = heavy().await;
    let app = Arc::new(spawn_app_on(Stores::fresh().with(ONE_IN_FLIGHT)).await);
    const ORDERS: usize = 60;
    const COPIES: usize = 5;
    let mut tokens = Vec::new();
    for i in 0..ORDERS {
        create(
            &app,
            PAYMENTS,
            &format!("st-{i}"),
            &format!("u-{i}"),
            100 + i as i64,
        )
        .await;
        tokens.push(app.issue(PAYMENTS, "order", &format!("u-{i}")).await);
    }
    // Even orders: copies with one request_id; odd: plain bodies.
    let body = |i: usize, token: &str| {
        if i.is_multiple_of(2) {
            json!({"token": token, "request_id": format!("r-{i}"), "fingerprint": "sha256:f"})
        } else {
            json!({"token": token})
        }
    };
    let barrier = Arc::new(Barrier::new(ORDERS * COPIES));
    let mut handles = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        for _ in 0..COPIES {
            let (app, barrier, b) = (app.clone(), barrier.clone(), body(i, token));
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                (i, event(&app, &format!("st-{i}"), "pay", &b).await)
            }));
        }
    }
    let mut won = vec![0usize; ORDERS];
    for h in handles {
        let (i, (s, replayed, b)) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK, "order {i}: {b}");
        assert_eq!(b["order"]["state"], "PAID", "order {i}: {b}");
        match (b["outcome"].as_str(), replayed) {
            (Some("applied"), false) => won[i] += 1,
            (Some("applied"), true) => assert_eq!(i % 2, 0, "a replay without a request_id: {b}"),
            (Some("duplicate"), true) => {
                assert_eq!(i % 2, 1, "the winner's copy as duplicate: {b}")
            }
            other => panic!("order {i}: unexpected {other:?}: {b}"),
        }
    }
    assert!(won.iter().all(|&n| n == 1), "applied per order: {won:?}");

    let (count, _, singles) = batches(&app, "1").await;
    assert!(
        count > singles,
        "no transaction decided more than one event: {count} transactions, {singles} of one"
    );
    let text = app.metrics_text().await;
    let counted = |outcome: &str| {
        sample(
            &text,
            "ledger_consume_total",
            &[("biz_type", "order"), ("outcome", outcome)],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(counted("consumed"), ORDERS as f64);
    assert_eq!(
        counted("replayed") + counted("duplicate"),
        (ORDERS * (COPIES - 1)) as f64
    );

    let pg = app.pg().await;
    let (paid, events, audits, consumed): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders WHERE state = 'PAID'),
                (SELECT count(*) FROM order_events WHERE kind = 'order.paid'),
                (SELECT count(*) FROM audit_events WHERE kind = 'order.paid'),
                (SELECT count(*) FROM tokens WHERE state = 'consumed' AND gen = 1 AND order_id IS NOT NULL)",
    )
    .fetch_one(&pg)
    .await
    .unwrap();
    let n = ORDERS as i64;
    assert_eq!((paid, events, audits, consumed), (n, n, n, n));
}

/// One hot order (1000) gets its pay and 30 refunds (20 to 107 each, 1905
/// in all) at once, among pays of 20 other orders, one transaction in
/// flight: the hot order's events serialise. Its events, in the order they
/// committed, are a sequence the state machine allows from CREATED; their
/// tokens are exactly the answers `applied`; its state and refunded amount
/// are that sequence's; every refused refund was refused for a reason the
/// final state proves (too much for what was still refundable then, or
/// not paid yet / nothing left); every other order is paid once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pay_and_refunds_racing_on_one_hot_order_serialise_as_a_sequential_model() {
    let _heavy = heavy().await;
    let app = Arc::new(spawn_app_on(Stores::fresh().with(ONE_IN_FLIGHT)).await);
    const AMOUNT: i64 = 1000;
    create(&app, PAYMENTS, "hot", "h", AMOUNT).await;
    const OTHERS: usize = 20;
    let mut calls: Vec<(String, &'static str, Value)> = Vec::new();
    let pay = app.issue(PAYMENTS, "order", "h").await;
    calls.push(("hot".into(), "pay", json!({"token": pay})));
    for i in 0..30 {
        let t = app.issue(PAYMENTS, "order", "h").await;
        calls.push((
            "hot".into(),
            "refund",
            json!({"token": t, "amount_minor": 20 + 3 * i, "request_id": format!("rf-{i}")}),
        ));
    }
    for i in 0..OTHERS {
        create(&app, PAYMENTS, &format!("cold-{i}"), &format!("c-{i}"), 10).await;
        let t = app.issue(PAYMENTS, "order", &format!("c-{i}")).await;
        calls.push((format!("cold-{i}"), "pay", json!({"token": t})));
    }
    let barrier = Arc::new(Barrier::new(calls.len()));
    let handles: Vec<_> = calls
        .iter()
        .cloned()
        .map(|(id, what, body)| {
            let (app, barrier) = (app.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let r = event(&app, &id, what, &body).await;
                (id, what, body, r)
            })
        })
        .collect();
    let mut applied_tokens = Vec::new();
    let mut refused = Vec::new();
    for h in handles {
        let (id, what, body, (s, _, b)) = h.await.unwrap();
        let token = body["token"].as_str().unwrap().to_owned();
        if id != "hot" {
            assert_eq!(
                (s, b["outcome"].as_str()),
                (StatusCode::OK, Some("applied")),
                "{id}: {b}"
            );
            continue;
        }
        match (s, b["outcome"].as_str(), b["error"].as_str()) {
            (StatusCode::OK, Some("applied"), _) => applied_tokens.push(token),
            (StatusCode::CONFLICT, _, Some(e @ ("illegal_transition" | "refund_exceeds_paid"))) => {
                refused.push((
                    what,
                    body["amount_minor"].as_i64(),
                    e.to_owned(),
                    b.clone(),
                    token,
                ))
            }
            other => panic!("{what} on the hot order: unexpected {other:?}: {b}"),
        }
    }
    let (_, _, order) = answer(app.get(PAYMENTS, "/v1/orders/hot").await).await;
    // The committed sequence, replayed through a model of the state machine.
    let events = order["events"].as_array().unwrap();
    assert_eq!(events[0]["kind"], "order.created");
    let (mut state, mut refunded) = ("CREATED", 0i64);
    let mut tokens_in_events = Vec::new();
    for e in &events[1..] {
        tokens_in_events.push(e["token"].as_str().unwrap().to_owned());
        match (state, e["kind"].as_str().unwrap()) {
            ("CREATED", "order.paid") => state = "PAID",
            ("PAID" | "PARTIALLY_REFUNDED", "order.refunded") => {
                refunded += e["amount_minor"].as_i64().unwrap();
                assert!(refunded <= AMOUNT, "refunded beyond the amount: {order}");
                state = if refunded == AMOUNT {
                    "REFUNDED"
                } else {
                    "PARTIALLY_REFUNDED"
                };
            }
            other => panic!("a sequence the state machine forbids: {other:?} in {order}"),
        }
    }
    assert_eq!(order["state"], state, "{order}");
    assert_eq!(order["refunded_minor"], refunded, "{order}");
    applied_tokens.sort();
    tokens_in_events.sort();
    assert_eq!(applied_tokens, tokens_in_events);
    assert_eq!(tokens_in_events.len(), 1 + 30 - refused.len());
    for (what, amount, error, b, _) in &refused {
        match (*what, error.as_str()) {
            // Refundable only shrinks: refused then means refused now.
            ("refund", "refund_exceeds_paid") => {
                assert!(
                    amount.unwrap() > AMOUNT - refunded,
                    "{b} with {refunded} refunded"
                )
            }
            ("refund", "illegal_transition") => assert!(
                b["state"] == "CREATED" || (b["state"] == "REFUNDED" && state == "REFUNDED"),
                "{b}"
            ),
            other => panic!("{other:?}: {b}"),
        }
    }
    assert!(
        batches(&app, "1").await.0 > batches(&app, "1").await.2,
        "no batch of more than one"
    );
    // A refused event left its token unconsumed.
    if let Some((_, _, _, _, token)) = refused.first() {
        let (_, _, b) = answer(app.consume(PAYMENTS, token, &json!({"subject": "h"})).await).await;
        assert_eq!(b["outcome"], "consumed", "{b}");
    }
}

/// An event whose write Postgres refuses (a constraint the schema gained: no
/// order of subject `blocked` leaves CREATED) sits in a batch with ten
/// others: the batch fails as a whole, its events are decided one by one,
/// and only the refused one fails (500); the others are applied, once.
/// Nothing of the refused one changed, and once the constraint is gone the
/// same call (its request_id) applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_postgres_refuses_fails_only_itself_in_a_batch() {
    let app = Arc::new(spawn_app_on(Stores::fresh().with(ONE_IN_FLIGHT)).await);
    let pg = app.pg().await;
    sqlx::query(
        "ALTER TABLE orders ADD CONSTRAINT test_blocked_subject
             CHECK (state = 'CREATED' OR subject <> 'blocked') NOT VALID",
    )
    .execute(&pg)
    .await
    .unwrap();
    create(&app, PAYMENTS, "blocker", "u-blocker", 5).await;
    create(&app, PAYMENTS, "victim", "blocked", 5).await;
    let blocker = app.issue(PAYMENTS, "order", "u-blocker").await;
    let victim = app.issue(PAYMENTS, "order", "blocked").await;
    let mut others = Vec::new();
    for i in 0..10 {
        create(&app, PAYMENTS, &format!("ok-{i}"), &format!("u-{i}"), 5).await;
        others.push(app.issue(PAYMENTS, "order", &format!("u-{i}")).await);
    }
    let lock = hold_order(&pg, "blocker").await;
    let send = |id: String, token: String| {
        let app = app.clone();
        tokio::spawn(async move {
            event(
                &app,
                &id,
                "pay",
                &json!({"token": token, "request_id": "r-1"}),
            )
            .await
        })
    };
    let first = send("blocker".into(), blocker);
    wait_metric(&app, "ledger_pg_order_batch_size_count", 1.0).await;
    let refused = send("victim".into(), victim.clone());
    let rest: Vec<_> = others
        .iter()
        .enumerate()
        .map(|(i, t)| send(format!("ok-{i}"), t.clone()))
        .collect();
    wait_metric(&app, "ledger_pg_order_queue", 11.0).await;
    lock.commit().await.unwrap();

    let (s, _, b) = first.await.unwrap();
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{b}"
    );
    for (i, h) in rest.into_iter().enumerate() {
        let (s, replayed, b) = h.await.unwrap();
        assert_eq!(
            (s, b["outcome"].as_str()),
            (StatusCode::OK, Some("applied")),
            "ok-{i}: {b}"
        );
        assert!(!replayed);
    }
    let (s, _, b) = refused.await.unwrap();
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{b}");
    let (count, sum, _) = batches(&app, "1").await;
    assert_eq!(
        (count, sum),
        (2.0, 12.0),
        "the blocker alone, then the eleven together"
    );

    let (state, consumed): (String, Option<String>) = sqlx::query_as(
        "SELECT o.state::text, (SELECT state::text FROM tokens WHERE token = $1)
           FROM orders o WHERE order_id = 'victim'",
    )
    .bind(&victim)
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!(state, "CREATED");
    assert_ne!(consumed.as_deref(), Some("consumed"));
    let (events, audits): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM order_events WHERE kind = 'order.paid'),
                (SELECT count(*) FROM audit_events WHERE kind = 'order.paid')",
    )
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!((events, audits), (11, 11));
    sqlx::query("ALTER TABLE orders DROP CONSTRAINT test_blocked_subject")
        .execute(&pg)
        .await
        .unwrap();
    let (s, replayed, b) = send("victim".into(), victim).await.unwrap();
    assert_eq!(
        (s, replayed, b["outcome"].as_str()),
        (StatusCode::OK, false, Some("applied")),
        "{b}"
    );
}

/// A batch cut as a whole: the service's link to Postgres is cut while the
/// batch's write waits on a token row the test holds. The four events it
/// was writing answer 503 `unavailable`; the event of the same batch that
/// was refused before the write (a pay of a paid order) keeps its 409.
/// Nothing of the batch committed: the retries, with the same request_ids,
/// apply each order exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_cut_as_a_whole_answers_its_writes_unavailable_and_retries_apply_once() {
    let link = link::Link::to(suite_pg::port()).await;
    let stores = Stores::fresh()
        .postgres(&format!("postgres://postgres@127.0.0.1:{}", link.port()))
        .with("postgres.order_batches_in_flight = 1\npostgres.acquire_timeout = \"2s\"\npostgres.statement_timeout = \"20s\"");
    let direct_url = format!("{}/{}", suite_pg::base(), stores.db_name);
    let app = Arc::new(spawn_app_on(stores).await);
    let pg = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .connect(&direct_url)
        .await
        .unwrap();
    create(&app, PAYMENTS, "paid", "u-paid", 7).await;
    let t = app.issue(PAYMENTS, "order", "u-paid").await;
    let (s, _, _) = event(&app, "paid", "pay", &json!({"token": t})).await;
    assert_eq!(s, StatusCode::OK);
    let again = app.issue(PAYMENTS, "order", "u-paid").await;
    let mut tokens = Vec::new();
    for i in 0..5 {
        create(&app, PAYMENTS, &format!("cut-{i}"), &format!("u-{i}"), 7).await;
        tokens.push(app.issue(PAYMENTS, "order", &format!("u-{i}")).await);
    }
    // The issuance records of the first two tokens are in Postgres: their
    // rows can be locked.
    eventually(10, || {
        let (pg, held) = (pg.clone(), tokens[..2].to_vec());
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE token = ANY($1)")
                .bind(&held)
                .fetch_one(&pg)
                .await
                .ok()?;
            (n == 2).then_some(())
        }
    })
    .await;
    let hold = |token: String| {
        let pg = pg.clone();
        async move {
            let mut tx = pg.begin().await.unwrap();
            sqlx::query("SELECT 1 FROM tokens WHERE token = $1 FOR UPDATE")
                .bind(&token)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        }
    };
    let first_lock = hold(tokens[0].clone()).await;
    let batch_lock = hold(tokens[1].clone()).await;
    let send = |id: String, token: String| {
        let app = app.clone();
        tokio::spawn(async move {
            event(
                &app,
                &id,
                "pay",
                &json!({"token": token, "request_id": format!("r-{id}")}),
            )
            .await
        })
    };
    let (before, sum_before, _) = batches(&app, "1").await;
    // cut-0 goes alone and waits in its write for the first lock; the rest
    // queue, then run as one batch whose write waits for the second.
    let first = send("cut-0".into(), tokens[0].clone());
    wait_metric(&app, "ledger_pg_order_batch_size_count", before + 1.0).await;
    let mut waiting: Vec<_> = (1..5)
        .map(|i| send(format!("cut-{i}"), tokens[i].clone()))
        .collect();
    let illegal = send("paid".into(), again);
    wait_metric(&app, "ledger_pg_order_queue", 5.0).await;
    first_lock.commit().await.unwrap();
    let (s, _, b) = first.await.unwrap();
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{b}"
    );
    // The batch's write waits on the second lock.
    let db = app.stores.db_name.clone();
    eventually(10, || {
        let (pg, db) = (pg.clone(), db.clone());
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = $1 AND application_name = 'idempotency-ledger'
                    AND wait_event_type = 'Lock' AND query LIKE '%UNNEST%'",
            )
            .bind(&db)
            .fetch_one(&pg)
            .await
            .ok()?;
            (n == 1).then_some(())
        }
    })
    .await;
    link.cut();
    let (s, _, b) = illegal.await.unwrap();
    assert_eq!(
        (s, b["error"].as_str(), b["state"].as_str()),
        (
            StatusCode::CONFLICT,
            Some("illegal_transition"),
            Some("PAID")
        ),
        "decided before the write: {b}"
    );
    for (i, h) in waiting.drain(..).enumerate() {
        let (s, _, b) = h.await.unwrap();
        assert_eq!(
            (s, b["error"].as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
            "cut-{}: {b}",
            i + 1
        );
    }
    let (count, sum, _) = batches(&app, "1").await;
    assert_eq!(
        (count - before, sum - sum_before),
        (2.0, 6.0),
        "cut-0 alone, then the five together"
    );
    batch_lock.rollback().await.unwrap();

    link.open();
    // Retried as a client does: a 503 again (a pooled connection the cut
    // killed, met before the pool replaced it) is retried with the same
    // request_id, which replays a pay that did commit.
    for (i, t) in tokens.iter().enumerate().skip(1) {
        let b = eventually(10, || {
            let send = send(format!("cut-{i}"), t.clone());
            async move {
                let (s, _, b) = send.await.unwrap();
                (s != StatusCode::SERVICE_UNAVAILABLE).then_some((s, b))
            }
        })
        .await;
        assert_eq!(
            (b.0, b.1["outcome"].as_str()),
            (StatusCode::OK, Some("applied")),
            "cut-{i}: {}",
            b.1
        );
    }
    let (events, audits, consumed): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM order_events WHERE kind = 'order.paid' AND order_id LIKE 'cut-%'),
                (SELECT count(*) FROM audit_events WHERE kind = 'order.paid' AND order_id LIKE 'cut-%'),
                (SELECT count(*) FROM tokens WHERE state = 'consumed' AND gen = 1 AND order_id LIKE 'cut-%')",
    )
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!((events, audits, consumed), (5, 5, 5));
}

// ---- the same inputs alone and batched ------------------------------------

/// Which token an event carries.
#[derive(Debug, Clone, Copy)]
enum Tok {
    /// A fresh token of the order's subject.
    Fresh,
    /// The token of step `n` of the same case.
    OfStep(usize),
    /// A fresh token of another subject.
    OtherSubject,
    /// A token consumed by a plain consume.
    Consumed,
    /// A token that paid another order of the same subject.
    OtherOrder,
    /// A token whose embedded expiry has passed.
    Expired,
}

#[derive(Debug, Clone, Copy)]
struct Step {
    what: &'static str,
    amount: Option<i64>,
    tok: Tok,
    request_id: Option<&'static str>,
    fingerprint: Option<&'static str>,
    reason: Option<&'static str>,
}

const fn step(what: &'static str, tok: Tok) -> Step {
    Step {
        what,
        amount: None,
        tok,
        request_id: None,
        fingerprint: None,
        reason: None,
    }
}

const fn refund(amount: i64, tok: Tok) -> Step {
    Step {
        amount: Some(amount),
        ..step("refund", tok)
    }
}

/// Where the case's order comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Owner {
    Payments,
    /// Created by another client: not visible to `payments`.
    Refunds,
    /// No such order.
    Missing,
}

/// Every kind of answer an event has: (owner, the steps before, the event).
fn cases() -> Vec<(Owner, Vec<Step>, Step)> {
    use Tok::*;
    let pay = step("pay", Fresh);
    let paid = || vec![pay];
    vec![
        (
            Owner::Payments,
            vec![],
            Step {
                request_id: Some("p"),
                fingerprint: Some("f"),
                ..pay
            },
        ),
        (Owner::Payments, vec![], step("close", Fresh)),
        (Owner::Payments, vec![], refund(5, Fresh)),
        (Owner::Payments, paid(), pay),
        (
            Owner::Payments,
            paid(),
            Step {
                reason: Some("damaged"),
                request_id: Some("r"),
                ..refund(300, Fresh)
            },
        ),
        (Owner::Payments, paid(), refund(1000, Fresh)),
        (Owner::Payments, paid(), refund(1001, Fresh)),
        (
            Owner::Payments,
            vec![Step {
                request_id: Some("p"),
                ..pay
            }],
            step("pay", OfStep(0)),
        ),
        (
            Owner::Payments,
            vec![Step {
                request_id: Some("p"),
                fingerprint: Some("f"),
                ..pay
            }],
            Step {
                request_id: Some("p"),
                ..step("pay", OfStep(0))
            },
        ),
        (
            Owner::Payments,
            vec![Step {
                fingerprint: Some("f"),
                ..pay
            }],
            Step {
                fingerprint: Some("g"),
                ..step("pay", OfStep(0))
            },
        ),
        (Owner::Payments, paid(), refund(5, OfStep(0))),
        (
            Owner::Payments,
            vec![pay, refund(100, Fresh)],
            refund(200, OfStep(1)),
        ),
        (
            Owner::Payments,
            vec![pay, refund(100, Fresh)],
            refund(100, OfStep(1)),
        ),
        (
            Owner::Payments,
            vec![pay, refund(400, Fresh), refund(600, Fresh)],
            refund(1, Fresh),
        ),
        (Owner::Payments, vec![step("close", Fresh)], pay),
        (Owner::Payments, vec![], step("pay", OtherSubject)),
        (Owner::Payments, vec![], step("pay", Consumed)),
        (Owner::Payments, vec![], step("pay", OtherOrder)),
        (Owner::Payments, vec![], step("pay", Expired)),
        (Owner::Missing, vec![], pay),
        (Owner::Refunds, vec![], pay),
    ]
}

/// One case set up under `set` (its order ids start with it): the
/// tokens it uses, in the order they were made (placeholders in the rows),
/// and the body of its last event.
struct Prepared {
    order_id: String,
    tokens: Vec<String>,
    last: Value,
}

/// A fresh token whose issuance record is in Postgres (so that both sets
/// read and write the same token rows, in the same order).
async fn recorded(app: &TestApp, pg: &sqlx::PgPool, subject: &str) -> String {
    let t = app.issue(PAYMENTS, "order", subject).await;
    eventually(10, || {
        let (pg, t) = (pg.clone(), t.clone());
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE token = $1")
                .bind(&t)
                .fetch_one(&pg)
                .await
                .ok()?;
            (n == 1).then_some(())
        }
    })
    .await;
    t
}

/// The token `tok` stands for in case `k` of `set` (`steps`: the tokens of
/// the steps before).
async fn token_for(
    app: &TestApp,
    pg: &sqlx::PgPool,
    set: &str,
    k: usize,
    tok: Tok,
    steps: &[String],
) -> String {
    let subject = format!("s-{k}");
    match tok {
        Tok::Fresh => recorded(app, pg, &subject).await,
        Tok::OfStep(n) => steps[n].clone(),
        Tok::OtherSubject => recorded(app, pg, &format!("{subject}-other")).await,
        Tok::Consumed => {
            let t = recorded(app, pg, &subject).await;
            let (s, _, b) = answer(
                app.consume(PAYMENTS, &t, &json!({"subject": subject}))
                    .await,
            )
            .await;
            assert_eq!(
                (s, b["outcome"].as_str()),
                (StatusCode::OK, Some("consumed"))
            );
            t
        }
        Tok::OtherOrder => {
            let other = format!("{set}-{k}-other");
            create(app, PAYMENTS, &other, &subject, 1000).await;
            let t = recorded(app, pg, &subject).await;
            let (s, _, b) = event(app, &other, "pay", &json!({"token": t})).await;
            assert_eq!(s, StatusCode::OK, "{b}");
            t
        }
        Tok::Expired => app.sign(
            "order",
            900_000_000 + k as u64 + if set == "a" { 0 } else { 1000 },
            (chrono::Utc::now().timestamp() - 1) as u32,
            "payments",
            &subject,
        ),
    }
}

async fn prepare(
    app: &TestApp,
    pg: &sqlx::PgPool,
    set: &str,
    k: usize,
    (owner, steps, last): &(Owner, Vec<Step>, Step),
) -> Prepared {
    let order_id = format!("{set}-{k}");
    let subject = format!("s-{k}");
    match owner {
        Owner::Payments => create(app, PAYMENTS, &order_id, &subject, 1000).await,
        Owner::Refunds => create(app, REFUNDS, &order_id, &subject, 1000).await,
        Owner::Missing => {}
    }
    let mut tokens: Vec<String> = Vec::new();
    let mut step_tokens: Vec<String> = Vec::new();
    for s in steps {
        let t = token_for(app, pg, set, k, s.tok, &step_tokens).await;
        if !tokens.contains(&t) {
            tokens.push(t.clone());
        }
        step_tokens.push(t.clone());
        let (status, _, b) = event(app, &order_id, s.what, &body(s, &t)).await;
        assert_eq!(status, StatusCode::OK, "{set}-{k} setup {s:?}: {b}");
    }
    let t = token_for(app, pg, set, k, last.tok, &step_tokens).await;
    if !tokens.contains(&t) {
        tokens.push(t.clone());
    }
    Prepared {
        order_id,
        tokens,
        last: body(last, &t),
    }
}

fn body(s: &Step, token: &str) -> Value {
    let mut b = json!({"token": token});
    if let Some(n) = s.amount {
        b["amount_minor"] = json!(n);
    }
    for (k, v) in [
        ("request_id", s.request_id),
        ("fingerprint", s.fingerprint),
        ("reason", s.reason),
    ] {
        if let Some(v) = v {
            b[k] = json!(v);
        }
    }
    b
}

/// `v` with the case's order id and tokens as placeholders and without
/// the times the clocks wrote.
fn normal(v: &Value, p: &Prepared) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| {
                    !matches!(
                        k.as_str(),
                        "at" | "created_at" | "updated_at" | "expires_at"
                    )
                })
                .map(|(k, v)| (k.clone(), normal(v, p)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(|v| normal(v, p)).collect()),
        Value::String(s) => {
            if let Some(i) = p.tokens.iter().position(|t| t == s) {
                json!(format!("token-{i}"))
            } else if let Some(rest) = s.strip_prefix(p.order_id.as_str()) {
                json!(format!("order{rest}"))
            } else {
                v.clone()
            }
        }
        _ => v.clone(),
    }
}

/// What Postgres holds of a case: its order, events, audit rows and tokens.
async fn rows(pg: &sqlx::PgPool, p: &Prepared) -> Value {
    let v: Value = sqlx::query_scalar(
        r#"SELECT jsonb_build_object(
             'order', (SELECT jsonb_build_object('state', state, 'amount', amount_minor, 'refunded', refunded_minor, 'client', client)
                         FROM orders WHERE order_id = $1),
             'events', (SELECT coalesce(jsonb_agg(jsonb_build_array(kind, token, amount_minor, request_id, reason) ORDER BY id), '[]')
                          FROM order_events WHERE order_id = $1),
             'audit', (SELECT coalesce(jsonb_agg(jsonb_build_array(kind, token, subject, biz_type, client, gen, detail) ORDER BY id), '[]')
                         FROM audit_events WHERE order_id = $1 OR token = ANY($2)),
             'tokens', (SELECT coalesce(jsonb_agg(jsonb_build_array(token, state, gen, fingerprint, request_id, order_id, subject, client) ORDER BY token), '[]')
                          FROM tokens WHERE token = ANY($2)))"#,
    )
    .bind(&p.order_id)
    .bind(&p.tokens)
    .fetch_one(pg)
    .await
    .unwrap();
    let mut v = normal(&v, p);
    // By placeholder, not by the token texts (which differ between sets).
    if let Some(tokens) = v["tokens"].as_array_mut() {
        tokens.sort_by_key(|t| t[0].as_str().map(str::to_owned));
    }
    v
}

/// The consume counters of biz type `order`, by outcome.
async fn counters(app: &TestApp) -> HashMap<String, f64> {
    let text = app.metrics_text().await;
    [
        "consumed",
        "replayed",
        "duplicate",
        "expired",
        "fingerprint_mismatch",
        "mismatch",
    ]
    .iter()
    .map(|o| {
        let n = sample(
            &text,
            "ledger_consume_total",
            &[("biz_type", "order"), ("outcome", o)],
        );
        (o.to_string(), n.unwrap_or(0.0))
    })
    .collect()
}

/// Every kind of event answer (applied, replayed, duplicate, each refusal,
/// expired, not found, another client's order, a mismatched token), twice:
/// set `b` one at a time (each event alone), set `a` all in one batch
/// transaction. Each batched event answers exactly as its twin did (status,
/// replay header, body), leaves the same rows (order, events, audit rows,
/// tokens), and moves the consume counters the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_event_of_a_batch_answers_and_writes_as_it_does_alone() {
    let app = Arc::new(spawn_app_on(Stores::fresh().with(ONE_IN_FLIGHT)).await);
    let pg = app.pg().await;
    let cases = cases();
    let mut alone = Vec::new();
    let mut batched = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        alone.push(prepare(&app, &pg, "b", k, case).await);
        batched.push(prepare(&app, &pg, "a", k, case).await);
    }
    create(&app, PAYMENTS, "blocker", "u-blocker", 5).await;
    let blocker = recorded(&app, &pg, "u-blocker").await;

    // Alone: one at a time.
    let start = counters(&app).await;
    let mut answers_alone = Vec::new();
    for (p, (_, _, last)) in alone.iter().zip(&cases) {
        answers_alone.push(event(&app, &p.order_id, last.what, &p.last).await);
    }
    let after_alone = counters(&app).await;

    // Batched: all queued behind the blocker, then one transaction.
    let lock = hold_order(&pg, "blocker").await;
    let (before, events_before, _) = batches(&app, "1").await;
    let first = {
        let app = app.clone();
        tokio::spawn(async move { event(&app, "blocker", "pay", &json!({"token": blocker})).await })
    };
    wait_metric(&app, "ledger_pg_order_batch_size_count", before + 1.0).await;
    let handles: Vec<_> = batched
        .iter()
        .zip(&cases)
        .map(|(p, (_, _, last))| {
            let (app, id, what, body) =
                (app.clone(), p.order_id.clone(), last.what, p.last.clone());
            tokio::spawn(async move { event(&app, &id, what, &body).await })
        })
        .collect();
    wait_metric(&app, "ledger_pg_order_queue", cases.len() as f64).await;
    let after_blocked = counters(&app).await;
    lock.commit().await.unwrap();
    let (s, _, b) = first.await.unwrap();
    assert_eq!(s, StatusCode::OK, "{b}");
    let mut answers_batched = Vec::new();
    for h in handles {
        answers_batched.push(h.await.unwrap());
    }
    let (count, events, _) = batches(&app, "1").await;
    assert_eq!(
        (count - before, events - events_before),
        (2.0, 1.0 + cases.len() as f64),
        "the blocker alone, then every case in one transaction"
    );
    let after_batched = counters(&app).await;

    for (k, case) in cases.iter().enumerate() {
        let (s_a, r_a, b_a) = &answers_batched[k];
        let (s_b, r_b, b_b) = &answers_alone[k];
        assert_eq!(
            (s_a, r_a, normal(b_a, &batched[k])),
            (s_b, r_b, normal(b_b, &alone[k])),
            "case {k} {case:?}"
        );
        assert_eq!(
            rows(&pg, &batched[k]).await,
            rows(&pg, &alone[k]).await,
            "rows of case {k} {case:?}"
        );
    }
    // The blocker's pay counts one `consumed` of its own.
    for (outcome, n) in &after_batched {
        let blocker = if outcome == "consumed" { 1.0 } else { 0.0 };
        assert_eq!(
            n - after_blocked[outcome] - blocker,
            after_alone[outcome] - start[outcome],
            "ledger_consume_total{{outcome=\"{outcome}\"}}"
        );
    }
    // A sanity check of the table itself: it holds every answer.
    let statuses: Vec<u16> = answers_alone.iter().map(|(s, _, _)| s.as_u16()).collect();
    for want in [200, 400, 403, 404, 409, 422] {
        assert!(
            statuses.contains(&want),
            "no case answers {want}: {statuses:?}"
        );
    }
}

/// 20,000 orders of `subject` (`a-000001` to `a-020000`) sorting before the
/// 10 of a batch (`z-20001` to `z-20010`), analyzed.
async fn orders_before_the_batch(pg: &sqlx::PgPool, subject: &str) {
    sqlx::query(
        "INSERT INTO orders (order_id, client, subject, amount_minor, currency)
         SELECT CASE WHEN g <= 20000 THEN 'a-' || lpad(g::text, 6, '0') ELSE 'z-' || g END,
                'payments', $1, 100, 'CNY'
           FROM generate_series(1, 20010) g",
    )
    .bind(subject)
    .execute(pg)
    .await
    .unwrap();
    sqlx::query("ANALYZE orders").execute(pg).await.unwrap();
}

/// A transaction without nested loops and hash joins: a merge join is what
/// Postgres picks if `pg`'s sessions allow it.
async fn merge_joins_only(pg: &sqlx::PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pg.begin().await.unwrap();
    for off in [
        "SET LOCAL enable_nestloop = off",
        "SET LOCAL enable_hashjoin = off",
    ] {
        sqlx::query(off).execute(&mut *tx).await.unwrap();
    }
    tx
}

/// Rows of `orders` this transaction has read so far.
async fn orders_read(tx: &mut sqlx::Transaction<'static, sqlx::Postgres>) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0)
           FROM pg_stat_xact_user_tables WHERE relname = 'orders'",
    )
    .fetch_one(&mut **tx)
    .await
    .unwrap()
}

/// A batch locks its orders by `order_id`, sorted. In a full bench run
/// (95,000 orders) the planner merged the batch's ids with the
/// `orders_pkey` index from its first entry, reading every order that sorts
/// before the batch's last one, in every batch: 94,010 rows and 33 ms for a
/// batch of 10, order-pay at 0.6x of pgbench instead of 2x. Here that plan
/// is the only one allowed (no nested loop, no hash join), 20,000 orders
/// sort before the 10 locked, and the statement must read about 10 orders,
/// not 20,000.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_locks_its_orders_without_reading_the_orders_before_them() {
    use idempotency_ledger::durable::orders::{lock_many, LockItem};
    use idempotency_ledger::token::{Claims, SnowflakeId, TokenCodec};

    let app = spawn_app_on(Stores::fresh()).await;
    let pg = app.pg().await;
    orders_before_the_batch(&pg, "u-lock").await;

    let codec = TokenCodec::new(app.stores.settings().tokens.signing_keys.clone());
    let exp = u32::try_from(now_ms() / 1000 + 3600).unwrap();
    let tokens: Vec<_> = (0..10u64)
        .map(|i| {
            let claims = Claims {
                biz_type: idempotency_ledger::domain::BizType::parse("order").unwrap(),
                id: SnowflakeId((1 << 40) + i),
                exp,
            };
            codec
                .verify(&codec.sign(&claims, "payments", "u-lock"))
                .expect("a token we signed")
        })
        .collect();
    let ids: Vec<String> = (20001..=20010).map(|g| format!("z-{g}")).collect();
    let items: Vec<LockItem<'_>> = ids
        .iter()
        .zip(&tokens)
        .map(|(order_id, token)| LockItem { order_id, token })
        .collect();

    let mut tx = merge_joins_only(&pg).await;
    let locked = lock_many(&mut tx, &items).await.expect("lock_many");
    assert!(locked.iter().all(Option::is_some), "{locked:?}");
    let read = orders_read(&mut tx).await;
    tx.rollback().await.unwrap();
    assert!(read < 1_000, "{read} orders read to lock 10");
    app.stop().await;
}

/// A batch's events update their orders joined with the batch's items
/// (`durable::orders::write_events`): merge-joined, as the lock above was,
/// it read every order sorting before the batch's last one. On the hot
/// pool's sessions Postgres does not merge-join
/// (`durable::hot_connect_options`): here nested loops and hash joins are
/// off too, so that a merge join is what it would pick if it may, 20,000
/// orders sort before the 10 paid, and the statement must read about 10
/// orders, not 20,000.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_pays_its_orders_without_reading_the_orders_before_them() {
    use chrono::{Duration, Utc};
    use idempotency_ledger::config::Durability;
    use idempotency_ledger::domain::order::OrderState;
    use idempotency_ledger::domain::AuditKind;
    use idempotency_ledger::durable::hot_connect_options;
    use idempotency_ledger::durable::orders::{write_events, OrderChange};
    use idempotency_ledger::durable::tokens::TokenRecord;

    let app = spawn_app_on(Stores::fresh()).await;
    let pg = app.pg().await;
    orders_before_the_batch(&pg, "u-pay").await;

    let now = Utc::now();
    let records: Vec<TokenRecord> = (0..10i64)
        .map(|i| TokenRecord {
            id: (1 << 40) + i,
            token: format!("order_pay_{i}"),
            biz_type: "order".into(),
            durability: Durability::Durable,
            subject: "u-pay".into(),
            client: "payments".into(),
            issued_at: now,
            expires_at: now + Duration::hours(1),
            key: None,
        })
        .collect();
    let order_ids: Vec<String> = (20001..=20010).map(|g| format!("z-{g}")).collect();
    let changes: Vec<OrderChange<'_>> = order_ids
        .iter()
        .map(|order_id| OrderChange {
            order_id,
            kind: AuditKind::OrderPaid,
            next_state: OrderState::Paid,
            refunded_minor: 0,
            amount_minor: 100,
            fingerprint: None,
            request_id: Some("r-pay"),
            reason: None,
        })
        .collect();
    let items: Vec<(&TokenRecord, &OrderChange<'_>)> = records.iter().zip(&changes).collect();

    let hot = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(hot_connect_options(&app.stores.settings().postgres).unwrap())
        .await
        .unwrap();
    let mut tx = merge_joins_only(&hot).await;
    let claimed = write_events(&mut tx, &items).await.expect("write_events");
    assert!(claimed.iter().all(Option::is_some), "{claimed:?}");
    let read = orders_read(&mut tx).await;
    let paid: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE state = 'PAID'")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(paid, 10);
    assert!(read < 1_000, "{read} orders read to pay 10");
    app.stop().await;
}
