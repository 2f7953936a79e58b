//! Postgres lost, on a private Postgres (`procs`): stopped, durable
//! consumes fail closed and are exactly once after it is back; restarted
//! behind idle pooled connections, no request fails; while it is down,
//! issuance records wait in a bounded buffer, and a full buffer refuses
//! issuing for every biz type.
//! These are among the slow tests of the suite (each a few seconds); they run
//! in CI with the rest (filter: `cargo test --test api faults`). Every
//! request carries a client timeout (`helpers::bounded`): a hung request
//! fails the test instead of hanging it.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::bounded::*;
use crate::helpers::calls::consumed_in_postgres;
use crate::helpers::procs::*;
use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_stopped_durable_consumes_fail_closed_then_exactly_once() {
    let pg = PgProc::start();
    let base = pg.base();
    let app = Arc::new(
        spawn_app_on(Stores::fresh().postgres(&base).with(
            r#"
postgres.acquire_timeout = "1s"
postgres.statement_timeout = "2s"
biz.like.ttl = "60s"
fleet.decide_without_postgres = true
"#,
        ))
        .await,
    );
    let pool = app.pg().await;
    let tokens = issue_many(&app, "order", 12).await;
    let likes = issue_many(&app, "like", 4).await;
    let (spent, fresh) = tokens.split_at(4);
    for (token, subject) in spent {
        let (_, _, body) = consume(&app, token, &json!({"subject": subject})).await;
        assert_eq!(body["outcome"], "consumed");
    }
    // The issuance records are in Postgres before it goes.
    eventually(10, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens")
                .fetch_one(&pool)
                .await
                .ok()?;
            (n == 16).then_some(())
        }
    })
    .await;
    pool.close().await;

    pg.stop_immediate();
    // Copies racing the one that claimed the token in Redis hear that it is
    // being processed; the claimer, and every later attempt, gets 503.
    let refusing = std::time::Instant::now();
    let (consumed, answers) = storm(&app, fresh, 3, "down").await;
    eprintln!(
        "postgres down: {} concurrent durable consumes answered in {:?}",
        answers.len(),
        refusing.elapsed()
    );
    assert!(consumed.iter().all(|&n| n == 0), "{consumed:?}");
    let mut refused = vec![0; fresh.len()];
    for (i, s, body) in &answers {
        if *s == StatusCode::OK {
            assert_eq!(
                (body["outcome"].as_str(), body["status"].as_str()),
                (Some("duplicate"), Some("processing")),
                "token {i}: {body}"
            );
            continue;
        }
        assert_eq!(*s, StatusCode::SERVICE_UNAVAILABLE, "token {i}: {body}");
        assert_eq!(body["error"], "unavailable");
        let retry: u64 = body["retry_after"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .expect("Retry-After");
        assert!(retry >= 1);
        refused[*i] += 1;
    }
    assert!(refused.iter().all(|&n| n >= 1), "{refused:?}");
    let again = fresh.iter().map(|(token, subject)| {
        let app = &app;
        async move { consume(app, token, &json!({"subject": subject})).await }
    });
    for (s, _, body) in futures_util::future::join_all(again).await {
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
            "{body}"
        );
    }
    // Duplicates that Redis knows are still answered.
    let (s, _, body) = consume(&app, &spent[0].0, &json!({"subject": spent[0].1})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate"))
    );
    let (s, body) = readyz(&bounded_client(), &app.address)
        .await
        .expect("readyz");
    assert_eq!(
        (s, body["postgres"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("down"))
    );
    // With fleet.decide_without_postgres, fast types keep working: Redis
    // decides, the journal waits (by default the gate closes after its
    // lease: `an_instance_that_cannot_renew_its_membership_stops_deciding`).
    let (consumed, answers) = storm(&app, &likes, 4, "fast").await;
    assert_all_ok(&answers);
    assert!(consumed.iter().all(|&n| n == 1), "{consumed:?}");

    pg.start_again();
    let http = bounded_client();
    eventually(15, || {
        let (http, base) = (http.clone(), app.address.clone());
        async move {
            let (s, _) = readyz(&http, &base).await?;
            (s == StatusCode::OK).then_some(())
        }
    })
    .await;
    let pool = app.pg().await;
    // Nothing changed while it was down.
    let changed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM tokens WHERE biz_type = 'order' AND state = 'consumed'",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(changed, 4);
    // The same tokens now consume exactly once; the spent ones never again.
    let (consumed, answers) = storm(&app, &tokens, 5, "up").await;
    assert_all_ok(&answers);
    assert_eq!(&consumed[..4], &[0, 0, 0, 0]);
    assert!(consumed[4..].iter().all(|&n| n == 1), "{consumed:?}");
    // The fast journal reached Postgres.
    consumed_in_postgres(&pool, "like", 4, 15).await;
}

/// Postgres restarts (`-m immediate`: no goodbye on the sockets, like a crash)
/// behind idle pooled connections: the next consumes, more than the pool has
/// connections, all succeed; none meets a dead connection (the pool pings a
/// connection that has been idle for `postgres.idle_check_after` before
/// using it, and the restart took longer than that), and each consumes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restarted_behind_idle_connections_fails_no_request() {
    let pg = PgProc::start();
    let app = Arc::new(
        spawn_app_on(
            Stores::fresh()
                .postgres(&pg.base())
                .with("postgres.pool_size = 4"),
        )
        .await,
    );
    let tokens = issue_many(&app, "order", 20).await;
    // Fill the pool: concurrent consumes open every connection it may have.
    let (warm, rest) = tokens.split_at(8);
    let (consumed, answers) = storm(&app, warm, 1, "warm").await;
    assert_all_ok(&answers);
    assert!(consumed.iter().all(|&n| n == 1), "{consumed:?}");

    pg.stop_immediate();
    pg.start_again();
    for (i, (token, subject)) in rest.iter().enumerate() {
        let body = json!({"subject": subject, "request_id": format!("after-{i}")});
        let (s, replayed, answer) = consume(&app, token, &body).await;
        assert_eq!(
            (s, answer["outcome"].as_str(), replayed),
            (StatusCode::OK, Some("consumed"), false),
            "token {i}: {answer}"
        );
    }
    let pool = app.pg().await;
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE state = 'consumed'")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(n, 20);
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT token_id) FROM audit_events WHERE kind = 'token.consumed'",
    )
    .fetch_one(&pool)
    .await
    .expect("audit");
    assert_eq!(audited, 20);
}

/// While Postgres is down, issuance records wait in a bounded buffer. Once it
/// is full, issuing answers 503 for fast types too: a token without its record
/// has no `token.issued` row and would be refused as forged by the other
/// instances' bloom filters. What was issued reaches Postgres afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_issuance_buffer_refuses_issuing_for_every_biz_type() {
    let _heavy = heavy().await;
    let pg = PgProc::start();
    let app = spawn_app_on(
        Stores::fresh()
            .postgres(&pg.base())
            .with("tokens.issue_buffer = 20\npostgres.acquire_timeout = \"1s\""),
    )
    .await;
    pg.stop_immediate();
    let mut issued = 0;
    let mut refused = std::collections::HashSet::new();
    for i in 0..2_000 {
        let biz = if i % 2 == 0 { "like" } else { "order" };
        let r = app
            .post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": biz, "subject": format!("b{i}")}),
            )
            .await;
        let (s, _, body) = answer(r).await;
        match s {
            StatusCode::CREATED => issued += 1,
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(body["error"], "unavailable", "{body}");
                refused.insert(biz);
            }
            other => panic!("{other}: {body}"),
        }
        if refused.len() == 2 {
            break;
        }
    }
    assert_eq!(
        refused.len(),
        2,
        "both biz types refused once the buffer is full"
    );
    assert!(issued >= 20, "{issued} issued before the buffer was full");
    pg.start_again();
    let pool = app.pg().await;
    eventually(30, || {
        let pool = pool.clone();
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind = 'token.issued'")
                    .fetch_one(&pool)
                    .await
                    .ok()?;
            (n == issued).then_some(())
        }
    })
    .await;
}
