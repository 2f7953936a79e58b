//! Pooled connections that the server closed while they sat idle: a Postgres
//! session ended by `pg_terminate_backend`, Redis connections ended by
//! `CLIENT KILL`. The next requests, as many as there are connections, all
//! succeed: none meets the broken connection as an error. (A Postgres
//! restart behind idle connections is in `faults`.)

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::link::Link;
use crate::helpers::procs::*;
use crate::helpers::tiers::fast_tier;
use crate::helpers::*;

/// The service's sessions in this test's database that sit idle right now,
/// once every one of them does (a connection going back to the pool is
/// checked first, so it may be busy for a moment after its request).
async fn idle_service_sessions(pg: &sqlx::PgPool, db: &str) -> Vec<i32> {
    eventually(10, || async move {
        let rows: Vec<(i32, Option<String>)> = sqlx::query_as(
            "SELECT pid, state FROM pg_stat_activity
              WHERE datname = $1 AND application_name = 'idempotency-ledger'",
        )
        .bind(db)
        .fetch_all(pg)
        .await
        .ok()?;
        rows.iter()
            .all(|(_, state)| state.as_deref() == Some("idle"))
            .then(|| rows.iter().map(|(pid, _)| *pid).collect())
    })
    .await
}

/// Ends every idle session of the service in this test's database (only
/// this test's: the shared Postgres serves the other tests too); returns
/// how many.
async fn terminate_idle_sessions(pg: &sqlx::PgPool, db: &str) -> usize {
    let pids = idle_service_sessions(pg, db).await;
    for pid in &pids {
        let _: (bool,) = sqlx::query_as("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(pg)
            .await
            .expect("pg_terminate_backend");
    }
    pids.len()
}

async fn consume_ok(app: &TestApp, token: &str, subject: &str, rid: &str) {
    consume_answers(app, token, subject, rid, "consumed").await;
}

/// A consume answers 200 with `outcome` (`duplicate`: replayed).
async fn consume_answers(app: &TestApp, token: &str, subject: &str, rid: &str, outcome: &str) {
    let (s, replayed, body) = answer(
        app.consume(
            PAYMENTS,
            token,
            &json!({"subject": subject, "request_id": rid}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, body["outcome"].as_str(), replayed),
        (StatusCode::OK, Some(outcome), outcome == "duplicate"),
        "{rid}: {body}"
    );
}

/// Postgres ends every idle session of the service (what an operator, an
/// idle-session reaper or a fast shutdown does); right after, as many durable
/// consumes and order payments as the payment pool has connections all
/// succeed. The idle ping is off here (`idle_check_after = "1h"`): what saves
/// them is that a statement whose session Postgres had ended before it
/// answered anything runs again on another connection, and so does a BEGIN.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_sessions_ended_while_idle_fail_no_request() {
    const POOL: usize = 6;
    let app = spawn_app_on(Stores::fresh().with(&format!(
        "postgres.pool_size = {POOL}\npostgres.idle_check_after = \"1h\""
    )))
    .await;
    let pg = app.pg().await;
    let db = app.stores.db_name.clone();
    let mut tokens = Vec::new();
    for i in 0..2 * POOL {
        tokens.push(app.issue(PAYMENTS, "order", &format!("s{i}")).await);
    }
    let mut pay_tokens = Vec::new();
    for _ in 0..POOL {
        pay_tokens.push(app.issue(PAYMENTS, "order", "buyer").await);
    }
    for i in 0..POOL {
        let r = app
            .post(
                PAYMENTS,
                "/v1/orders",
                &json!({"order_id": format!("o-{i}"), "subject": "buyer", "amount_minor": 100, "currency": "CNY"}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    // Concurrent consumes open the pool's connections.
    let warm = (0..POOL).map(|i| {
        let (app, token) = (&app, &tokens[i]);
        async move { consume_ok(app, token, &format!("s{i}"), &format!("warm-{i}")).await }
    });
    futures_util::future::join_all(warm).await;

    let ended = terminate_idle_sessions(&pg, &db).await;
    assert!(ended >= 2, "{ended} sessions ended");
    for (i, token) in tokens.iter().enumerate().skip(POOL) {
        consume_ok(&app, token, &format!("s{i}"), &format!("after-{i}")).await;
    }

    let ended = terminate_idle_sessions(&pg, &db).await;
    assert!(ended >= 2, "{ended} sessions ended");
    for (i, token) in pay_tokens.iter().enumerate() {
        let (s, _, body): (StatusCode, bool, Value) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/orders/o-{i}/pay"),
                &json!({"token": token}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("applied")),
            "pay o-{i}: {body}"
        );
    }
}

/// Redis closes every connection of the service (`CLIENT KILL`, as a
/// `timeout` reaper or an operator would) while they are idle; the next
/// consumes of durable and fast tokens, twice as many as the service has
/// connections, all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_connections_killed_while_idle_fail_no_request() {
    const CONNECTIONS: usize = 4;
    let redis = RedisProc::start();
    let app = spawn_app_on(Stores::fresh().redis(&redis.url()).with(&format!(
        "redis.connections = {CONNECTIONS}\nbiz.like.ttl = \"60s\""
    )))
    .await;
    let n = 2 * CONNECTIONS;
    let mut tokens = Vec::new();
    for round in 0..3 {
        for i in 0..n {
            let biz = if i % 2 == 0 { "like" } else { "order" };
            tokens.push((round, i, app.issue(PAYMENTS, biz, "fan").await));
        }
    }
    for (round, i, token) in &tokens {
        if *round > 0 && *i == 0 {
            let out = redis.cli(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
            let killed: usize = out.trim().parse().expect("CLIENT KILL answers a count");
            assert!(killed >= CONNECTIONS, "{killed} connections killed: {out}");
        }
        consume_ok(&app, token, "fan", &format!("r{round}-{i}")).await;
    }
}

/// A connection Redis closed while it sat idle, whose close the service has
/// not seen when it sends its next consume on it (a link that closes each
/// connection open now when the service next writes on it): the consume did
/// not run, and it is sent again on the same thread's connection, which the
/// redis client has replaced by then (it starts a new connection when a call
/// fails with its socket dropped, before the error comes back). Every
/// consume is answered `consumed`, and another attempt hears it is taken.
/// With `redis.connections = 1` every thread shares the one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consume_sent_on_a_connection_closed_while_idle_is_sent_again_on_a_new_one() {
    let link = Link::to(6379).await;
    let app = spawn_app_on(
        Stores::fresh()
            .redis(&format!("redis://127.0.0.1:{}/2", link.port()))
            .with("redis.connections = 1\nbiz.like.ttl = \"60s\""),
    )
    .await;
    for round in 0..5 {
        let token = app.issue(PAYMENTS, "like", "fan").await;
        link.close_idle_on_write();
        consume_ok(&app, &token, "fan", &format!("r{round}")).await;
        consume_answers(&app, &token, "fan", &format!("other{round}"), "duplicate").await;
    }
}

/// What makes resending a consume after a dropped connection safe: the script
/// sent twice by one attempt answers the same both times and writes nothing
/// more (a fast win is journaled once), while another attempt still hears
/// that the token is taken.
#[tokio::test]
async fn the_consume_script_sent_twice_by_one_attempt_answers_the_same() {
    use idempotency_ledger::fast::{Attempt, ConsumeMode, Op, Record, ScriptOutcome};
    let app = spawn_app().await;
    // The tier alone, on the app's Redis and key prefix.
    let (fast, _) = fast_tier(&app.stores);
    let attempt = |owner| Attempt {
        owner,
        request_id: Some("r1"),
        fingerprint: None,
    };
    let journal = Record::new(Op::Consume, "{}".to_owned(), None);

    let like = app.issue(PAYMENTS, "like", "fan").await;
    let order = app.issue(PAYMENTS, "order", "fan").await;
    // The tokens stay in Redis; the app's journal drainer must not take the
    // entries this test counts.
    app.stop().await;
    let before = fast.journal_len().await.expect("xlen");
    let first = fast
        .consume(
            &like,
            ConsumeMode::Fast,
            &attempt(Some("a1")),
            1000,
            Some(&journal),
        )
        .await
        .expect("consume");
    let again = fast
        .consume(
            &like,
            ConsumeMode::Fast,
            &attempt(Some("a1")),
            1000,
            Some(&journal),
        )
        .await
        .expect("consume");
    assert!(matches!(first, ScriptOutcome::Won { .. }), "{first:?}");
    assert_eq!(first, again);
    assert_eq!(fast.journal_len().await.expect("xlen"), before + 1);
    let other = fast
        .consume(
            &like,
            ConsumeMode::Fast,
            &attempt(Some("a2")),
            1000,
            Some(&journal),
        )
        .await
        .expect("consume");
    assert!(matches!(other, ScriptOutcome::Consumed(_)), "{other:?}");
    // An attempt without an owner of its own gets a fresh one: it never
    // passes for another that had none either.
    let unnamed = fast
        .consume(
            &like,
            ConsumeMode::Fast,
            &attempt(None),
            1000,
            Some(&journal),
        )
        .await
        .expect("consume");
    assert!(matches!(unnamed, ScriptOutcome::Consumed(_)), "{unnamed:?}");

    for _ in 0..2 {
        let claimed = fast
            .consume(
                &order,
                ConsumeMode::Durable,
                &attempt(Some("d1")),
                5000,
                None,
            )
            .await
            .expect("consume");
        assert_eq!(claimed, ScriptOutcome::Claimed);
    }
    let other = fast
        .consume(
            &order,
            ConsumeMode::Durable,
            &attempt(Some("d2")),
            5000,
            None,
        )
        .await
        .expect("consume");
    assert!(matches!(other, ScriptOutcome::Provisional(_)), "{other:?}");
}
