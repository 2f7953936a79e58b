//! Real faults, on private servers (`procs`): Redis killed, paused and slowed,
//! a stale Redis replica, Postgres stopped, the service SIGKILLed mid-load, a
//! Redis Cluster losing a master. These are the slow tests of the suite (each
//! a few seconds); they run in CI with the rest (filter: `cargo test --test
//! api faults`). Every request carries a client timeout: a hung request fails
//! the test instead of hanging it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::Barrier;

use crate::helpers::procs::*;
use crate::helpers::*;

/// No request of these tests may take longer (a bound, not a benchmark).
const REQUEST_BOUND: Duration = Duration::from_secs(10);

/// Short Redis timeouts and backoff, so the breaker reacts within a test.
const QUICK_BREAKER: &str = r#"
redis.timeout = "300ms"
redis.down_backoff = "300ms"
postgres.acquire_timeout = "5s"
biz.like.ttl = "60s"
"#;

fn bounded_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(REQUEST_BOUND)
        .pool_max_idle_per_host(64)
        .build()
        .expect("client")
}

/// One consume; `None` when no answer came (connection lost, timeout).
async fn try_consume(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    body: &Value,
) -> Option<(StatusCode, bool, Value)> {
    let r = http
        .post(format!("{base}/v1/tokens/{token}/consume"))
        .bearer_auth(PAYMENTS)
        .json(body)
        .send()
        .await
        .ok()?;
    let status = r.status();
    let replayed = r
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let retry_after = r.headers().get("retry-after").cloned();
    let mut body = r.json::<Value>().await.ok()?;
    if let Some(v) = retry_after {
        body["retry_after"] = json!(v.to_str().unwrap_or(""));
    }
    Some((status, replayed, body))
}

async fn consume(app: &TestApp, token: &str, body: &Value) -> (StatusCode, bool, Value) {
    try_consume(&bounded_client(), &app.address, token, body)
        .await
        .expect("the consume answered within the bound")
}

async fn readyz(http: &reqwest::Client, base: &str) -> Option<(StatusCode, Value)> {
    let r = http.get(format!("{base}/readyz")).send().await.ok()?;
    let status = r.status();
    Some((status, r.json().await.ok()?))
}

async fn wait_mode(app: &TestApp, secs: u64, mode: &'static str) -> Value {
    let http = bounded_client();
    eventually(secs, || {
        let http = http.clone();
        let base = app.address.clone();
        async move {
            let (_, body) = readyz(&http, &base).await?;
            (body["mode"] == mode).then_some(body)
        }
    })
    .await
}

/// `n` tokens of `biz`, subject `s<i>`.
async fn issue_many(app: &TestApp, biz: &str, n: usize) -> Vec<(String, String)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let subject = format!("s{i}");
        out.push((app.issue(PAYMENTS, biz, &subject).await, subject));
    }
    out
}

/// Fires `copies` consumes of every token at once (each copy its own
/// request_id); returns the consumed count per token and every answer.
async fn storm(
    app: &Arc<TestApp>,
    tokens: &[(String, String)],
    copies: usize,
    tag: &str,
) -> (Vec<usize>, Vec<(usize, StatusCode, Value)>) {
    let barrier = Arc::new(Barrier::new(tokens.len() * copies));
    let http = bounded_client();
    let mut handles = Vec::new();
    for (i, (token, subject)) in tokens.iter().enumerate() {
        for c in 0..copies {
            let (app, barrier, http) = (app.clone(), barrier.clone(), http.clone());
            let body = json!({"subject": subject, "request_id": format!("{tag}-{i}-{c}")});
            let token = token.clone();
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                let (s, replayed, body) = try_consume(&http, &app.address, &token, &body)
                    .await
                    .expect("answered within the bound");
                if body["outcome"] == "consumed" {
                    assert!(!replayed, "a first use is not a replay");
                }
                (i, s, body)
            }));
        }
    }
    let mut consumed = vec![0; tokens.len()];
    let mut answers = Vec::new();
    for h in handles {
        let (i, s, body) = h.await.expect("task");
        if s == StatusCode::OK && body["outcome"] == "consumed" {
            consumed[i] += 1;
        }
        answers.push((i, s, body));
    }
    (consumed, answers)
}

fn assert_all_ok(answers: &[(usize, StatusCode, Value)]) {
    for (i, s, body) in answers {
        assert_eq!(*s, StatusCode::OK, "token {i}: {body}");
        assert!(
            body["outcome"] == "consumed" || body["outcome"] == "duplicate",
            "token {i}: {body}"
        );
    }
}

async fn metric(app: &TestApp, line_prefix: &str) -> Option<f64> {
    let text = app
        .http
        .get(app.url("/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

// ---- Redis killed ---------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_killed_during_durable_load_keeps_exactly_once() {
    let mut redis = RedisProc::start();
    let app = Arc::new(spawn_app_on(Stores::fresh().redis(&redis.url()).with(QUICK_BREAKER)).await);
    let tokens = issue_many(&app, "order", 80).await;
    let like = app.issue(PAYMENTS, "like", "fan").await;

    // The load: 80 tokens x 6 copies; Redis dies when a fifth has answered.
    let answered = Arc::new(AtomicUsize::new(0));
    let load = {
        let (app, tokens, answered) = (app.clone(), tokens.clone(), answered.clone());
        tokio::spawn(async move {
            let http = bounded_client();
            let mut handles = Vec::new();
            for (i, (token, subject)) in tokens.iter().enumerate() {
                for c in 0..6 {
                    let (app, http, answered) = (app.clone(), http.clone(), answered.clone());
                    let (token, body) = (
                        token.clone(),
                        json!({"subject": subject, "request_id": format!("r{i}-{c}")}),
                    );
                    handles.push(tokio::spawn(async move {
                        let out = try_consume(&http, &app.address, &token, &body).await;
                        answered.fetch_add(1, Ordering::Relaxed);
                        (i, out)
                    }));
                }
            }
            let mut out = Vec::new();
            for h in handles {
                out.push(h.await.expect("task"));
            }
            out
        })
    };
    eventually(30, || {
        let answered = answered.clone();
        async move { (answered.load(Ordering::Relaxed) >= 96).then_some(()) }
    })
    .await;
    redis.kill();
    let mut results = load.await.expect("load");
    // A second wave after the kill, so that the load meets the dead Redis
    // however fast the first one finished.
    let http = bounded_client();
    for (i, (token, subject)) in tokens.iter().enumerate() {
        let body = json!({"subject": subject, "request_id": format!("r{i}-late")});
        results.push((i, try_consume(&http, &app.address, token, &body).await));
    }
    // The load met the dead Redis (errors, then the breaker skipping it).
    assert!(
        metric(&app, "ledger_redis_bypass_total{reason=\"down\"}")
            .await
            .unwrap_or(0.0)
            + metric(&app, "ledger_fast_tier_total{result=\"error\"}")
                .await
                .unwrap_or(0.0)
            > 0.0
    );

    let mut consumed = vec![0; tokens.len()];
    for (i, out) in &results {
        let (s, _, body) = out.as_ref().expect("every consume answered");
        // Postgres is up: durable consumes never need Redis.
        assert_eq!(*s, StatusCode::OK, "token {i}: {body}");
        if body["outcome"] == "consumed" {
            consumed[*i] += 1;
        }
    }
    assert!(consumed.iter().all(|&n| n == 1), "{consumed:?}");

    let ready = wait_mode(&app, 10, "redis_down").await;
    assert_eq!(ready["redis"], "down");
    assert_eq!(
        metric(&app, "ledger_mode{mode=\"redis_down\"}").await,
        Some(1.0)
    );

    // Durable and fast consumes keep working without Redis.
    let fresh = app.issue(PAYMENTS, "order", "late").await;
    let (s, _, body) = consume(&app, &fresh, &json!({"subject": "late"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let (_, _, body) = consume(&app, &like, &json!({"subject": "fan", "request_id": "l1"})).await;
    assert_eq!(body["outcome"], "consumed", "{body}");
    let (_, replayed, body) = consume(&app, &like, &json!({"subject": "fan"})).await;
    assert_eq!(
        (body["outcome"].as_str(), replayed),
        (Some("duplicate"), true)
    );

    // Redis returns (empty): the mode goes back to normal, and what was
    // consumed meanwhile is written back to it.
    redis.restart();
    wait_mode(&app, 10, "normal").await;
    let mut conn = redis.conn().await;
    let key = app.token_key(&like);
    wait_redis_state(&conn, &key, "c", 10).await;
    let (_, replayed, body) = consume(&app, &like, &json!({"subject": "fan"})).await;
    assert_eq!(
        (body["outcome"].as_str(), replayed),
        (Some("duplicate"), true)
    );
    let _: () = redis::cmd("PING")
        .query_async(&mut conn)
        .await
        .expect("ping");

    // Every token of the load is spent, and stays so.
    let (again, answers) = storm(&app, &tokens, 2, "after").await;
    assert_all_ok(&answers);
    assert!(again.iter().all(|&n| n == 0), "{again:?}");
}

// ---- Redis slow and paused ------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_slow_then_paused_switches_modes_and_back() {
    let redis = RedisProc::start();
    let app = spawn_app_on(Stores::fresh().redis(&redis.url()).with(
        r#"
redis.timeout = "1s"
redis.down_backoff = "300ms"
redis.slow_threshold = "50ms"
redis.slow_window = "1s"
redis.degraded_sample = 0.5
biz.like.ttl = "60s"
"#,
    ))
    .await;
    let mut n = 0;
    let mut consume_one = || {
        n += 1;
        let subject = format!("u{n}");
        let app = &app;
        async move {
            let token = app.issue(PAYMENTS, "order", &subject).await;
            let (s, _, body) = consume(app, &token, &json!({"subject": subject})).await;
            assert_eq!(
                (s, body["outcome"].as_str()),
                (StatusCode::OK, Some("consumed")),
                "{body}"
            );
            let (_, _, body) = consume(app, &token, &json!({"subject": subject})).await;
            assert_eq!(body["outcome"], "duplicate", "{body}");
        }
    };
    consume_one().await;
    assert_eq!(wait_mode(&app, 5, "normal").await["redis"], "up");

    // Slow: the server sleeps 150 ms at a time, again and again.
    let stop = Arc::new(AtomicBool::new(false));
    let sleeper = {
        let (stop, mut conn) = (stop.clone(), redis.conn().await);
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _: Result<(), _> = redis::cmd("DEBUG")
                    .arg("SLEEP")
                    .arg("0.15")
                    .query_async(&mut conn)
                    .await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let http = bounded_client();
    let mut degraded = None;
    for _ in 0..200 {
        consume_one().await;
        let (_, body) = readyz(&http, &app.address).await.expect("readyz");
        if body["mode"] == "degraded" {
            degraded = Some(body);
            break;
        }
    }
    let degraded = degraded.expect("mode degraded while redis is slow");
    assert_eq!(degraded["redis"], "slow");
    // Requests still answer (a sample of them around Redis).
    for _ in 0..10 {
        consume_one().await;
    }
    assert!(
        metric(
            &app,
            "ledger_redis_bypass_total{reason=\"degraded_sample\"}"
        )
        .await
            > Some(0.0)
    );
    assert_eq!(
        metric(&app, "ledger_mode{mode=\"degraded\"}").await,
        Some(1.0)
    );
    stop.store(true, Ordering::Relaxed);
    sleeper.await.expect("sleeper");
    wait_mode(&app, 10, "normal").await;

    // Paused: nothing answers; consumes wait at most redis.timeout, then
    // Postgres decides alone. A fast consume whose script was sent but never
    // answered may still run (it does, once Redis resumes): its token is not
    // decided elsewhere meanwhile.
    let like = app.issue(PAYMENTS, "like", "fan").await;
    redis.pause();
    let (s, _, body) = consume(&app, &like, &json!({"subject": "fan", "request_id": "a"})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
        "{body}"
    );
    let (s, _, body) = consume(&app, &like, &json!({"subject": "fan", "request_id": "b"})).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
        "{body}"
    );
    consume_one().await;
    assert_eq!(wait_mode(&app, 10, "redis_down").await["redis"], "down");
    consume_one().await;
    redis.resume();
    wait_mode(&app, 10, "normal").await;
    consume_one().await;
    // Exactly one of the two attempts won (the first, if its late script
    // ran), and it alone hears `consumed`. Right after the recovery a retry
    // may still get 503 (nothing changed); it retries.
    let mut winners = std::collections::BTreeSet::new();
    for rid in ["b", "a", "b", "a"] {
        let body = eventually(5, || {
            let (app, like) = (&app, &like);
            async move {
                let (s, _, body) =
                    consume(app, like, &json!({"subject": "fan", "request_id": rid})).await;
                (s == StatusCode::OK).then_some(body)
            }
        })
        .await;
        if body["outcome"] == "consumed" {
            winners.insert(rid);
        }
    }
    assert_eq!(winners.len(), 1, "one of the two attempts won: {winners:?}");
}

// ---- a stale replica ------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_redis_snapshot_never_allows_a_second_durable_consume() {
    let redis = RedisProc::start();
    let app = Arc::new(spawn_app_on(Stores::fresh().redis(&redis.url())).await);
    let mut conn = redis.conn().await;
    let tokens = issue_many(&app, "order", 10).await;

    // A replica that missed the consumes: snapshots taken right after issue.
    let mut snapshots = Vec::new();
    for (token, _) in &tokens {
        let dump: Vec<u8> = redis::cmd("DUMP")
            .arg(app.token_key(token))
            .query_async(&mut conn)
            .await
            .expect("dump");
        snapshots.push(dump);
    }
    for (i, (token, subject)) in tokens.iter().enumerate() {
        let (_, _, body) = consume(
            &app,
            token,
            &json!({"subject": subject, "request_id": format!("w{i}")}),
        )
        .await;
        assert_eq!(body["outcome"], "consumed");
    }
    // Redis learns the consumes (off the answer's path)...
    for (token, _) in &tokens {
        let key = app.token_key(token);
        wait_redis_state(&conn, &key, "c", 5).await;
    }
    // ...and then fails over to the stale copy.
    for ((token, _), dump) in tokens.iter().zip(&snapshots) {
        let _: () = redis::cmd("RESTORE")
            .arg(app.token_key(token))
            .arg(0)
            .arg(dump.as_slice())
            .arg("REPLACE")
            .query_async(&mut conn)
            .await
            .expect("restore");
        let s: String = redis::cmd("HGET")
            .arg(app.token_key(token))
            .arg("s")
            .query_async(&mut conn)
            .await
            .expect("hget");
        assert_eq!(s, "i", "the snapshot says issued");
    }
    // Redis says issued; Postgres decides: duplicates only.
    let (consumed, answers) = storm(&app, &tokens, 8, "stale").await;
    assert_all_ok(&answers);
    assert!(consumed.iter().all(|&n| n == 0), "{consumed:?}");
    for (i, (token, subject)) in tokens.iter().enumerate() {
        // The winner's retry still learns it won.
        let (_, replayed, body) = consume(
            &app,
            token,
            &json!({"subject": subject, "request_id": format!("w{i}")}),
        )
        .await;
        assert_eq!(
            (body["outcome"].as_str(), replayed),
            (Some("consumed"), true)
        );
    }
}

// ---- Postgres stopped -----------------------------------------------------------

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
    eventually(15, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM tokens WHERE biz_type = 'like' AND state = 'consumed'",
            )
            .fetch_one(&pool)
            .await
            .ok()?;
            (n == 4).then_some(())
        }
    })
    .await;
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

// ---- the service SIGKILLed mid-load -----------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn service_killed_mid_load_never_double_consumes_nor_burns_tokens() {
    let stores = Stores::fresh();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!(
        "[postgres]\nurl = \"{}\"\n[redis]\nurl = \"{REDIS_URL}\"\nkey_prefix = \"{}\"\n",
        stores.db_url(),
        stores.prefix
    );
    let mut first = LedgerProc::start(dir.path(), "first", &config);
    first.wait_ready().await;
    let http = bounded_client();
    let base = first.address();
    const N: usize = 150;
    let mut tokens = Vec::new();
    for i in 0..N {
        let subject = format!("s{i}");
        let r = http
            .post(format!("{base}/v1/tokens"))
            .bearer_auth(PAYMENTS)
            .json(&json!({"biz_type": "order", "subject": subject}))
            .send()
            .await
            .expect("issue");
        let body: Value = r.json().await.expect("json");
        tokens.push((body["token"].as_str().expect("token").to_owned(), subject));
    }

    // Three attempts per token (each its own request_id); SIGKILL as soon
    // as a quarter has answered (told by the answer that makes the quarter,
    // not by polling: batched consumes answer many at once, and the rest
    // could all answer within one polling interval).
    let answered = Arc::new(AtomicUsize::new(0));
    let quarter = Arc::new(tokio::sync::Notify::new());
    let mut handles = Vec::new();
    for (i, (token, subject)) in tokens.iter().enumerate() {
        for c in 0..3 {
            let (http, base, answered, quarter) = (
                http.clone(),
                base.clone(),
                answered.clone(),
                quarter.clone(),
            );
            let rid = format!("first-{i}-{c}");
            let (token, body) = (
                token.clone(),
                json!({"subject": subject, "request_id": rid}),
            );
            handles.push(tokio::spawn(async move {
                let out = try_consume(&http, &base, &token, &body).await;
                if out.is_some() && answered.fetch_add(1, Ordering::Relaxed) + 1 == N * 3 / 4 {
                    quarter.notify_one();
                }
                (i, rid, out)
            }));
        }
    }
    tokio::time::timeout(Duration::from_secs(30), quarter.notified())
        .await
        .expect("a quarter of the consumes answered within 30 s");
    first.kill();
    let mut consumed_first = vec![0; N];
    let mut unanswered = vec![Vec::new(); N];
    for h in handles {
        let (i, rid, out) = h.await.expect("task");
        match out {
            Some((s, _, body)) => {
                assert_eq!(s, StatusCode::OK, "{body}");
                if body["outcome"] == "consumed" {
                    consumed_first[i] += 1;
                }
            }
            None => unanswered[i].push(rid),
        }
    }
    let lost: usize = unanswered.iter().map(Vec::len).sum();
    assert!(lost > 0, "the kill came mid-load");
    assert!(consumed_first.iter().all(|&n| n <= 1), "{consumed_first:?}");

    // Postgres finishes what the dead process had sent, then we look.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&stores.db_url())
        .await
        .expect("pool");
    eventually(10, || {
        let pool = pool.clone();
        async move {
            let busy: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                    AND pid <> pg_backend_pid() AND state = 'active'",
            )
            .fetch_one(&pool)
            .await
            .ok()?;
            (busy == 0).then_some(())
        }
    })
    .await;
    let mut committed: HashMap<String, Option<String>> = HashMap::new();
    for (token, _) in &tokens {
        let row: Option<(String, Option<String>)> =
            sqlx::query_as("SELECT state::text, request_id FROM tokens WHERE token = $1")
                .bind(token)
                .fetch_optional(&pool)
                .await
                .expect("row");
        if let Some((state, rid)) = row {
            if state == "consumed" {
                committed.insert(token.clone(), rid);
            }
        }
    }
    // No lost acknowledgement: every `consumed` answer is committed.
    for (i, (token, _)) in tokens.iter().enumerate() {
        if consumed_first[i] == 1 {
            assert!(
                committed.contains_key(token),
                "token {i} answered consumed but not committed"
            );
        }
    }

    let mut second = LedgerProc::start(dir.path(), "second", &config);
    second.wait_ready().await;
    let base = second.address();
    // Committed tokens: duplicates for everyone, `consumed` again only for
    // the attempt that won (whose answer may have been lost).
    for (i, (token, subject)) in tokens.iter().enumerate() {
        let Some(rid) = committed.get(token) else {
            continue;
        };
        let (s, _, body) = try_consume(
            &http,
            &base,
            token,
            &json!({"subject": subject, "request_id": "second"}),
        )
        .await
        .expect("answered");
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate")),
            "token {i}"
        );
        if let Some(rid) = rid {
            let (_, replayed, body) = try_consume(
                &http,
                &base,
                token,
                &json!({"subject": subject, "request_id": rid}),
            )
            .await
            .expect("answered");
            assert_eq!(
                (body["outcome"].as_str(), replayed),
                (Some("consumed"), true),
                "token {i}"
            );
        }
    }
    // Tokens whose consume never committed are consumable again within 10 s
    // (their provisional markers expire), exactly once.
    let open: Vec<usize> = (0..N)
        .filter(|i| !committed.contains_key(&tokens[*i].0))
        .collect();
    assert!(
        open.iter().all(|i| consumed_first[*i] == 0),
        "an uncommitted token answered consumed"
    );
    let lost_but_committed = (0..N)
        .filter(|i| {
            !unanswered[*i].is_empty()
                && consumed_first[*i] == 0
                && committed.contains_key(&tokens[*i].0)
        })
        .count();
    eprintln!(
        "service kill: {lost} consumes unanswered; {} tokens committed ({lost_but_committed} of them with the winner's answer lost); {} open",
        committed.len(),
        open.len()
    );
    let remaining = Arc::new(std::sync::Mutex::new(open.clone()));
    let freeing = std::time::Instant::now();
    eventually(10, || {
        let (http, base, remaining, tokens) = (
            http.clone(),
            base.clone(),
            remaining.clone(),
            tokens.clone(),
        );
        async move {
            let todo: Vec<usize> = remaining.lock().expect("lock").clone();
            let mut left = Vec::new();
            for i in todo {
                let (token, subject) = &tokens[i];
                let out = try_consume(
                    &http,
                    &base,
                    token,
                    &json!({"subject": subject, "request_id": "second"}),
                )
                .await
                .expect("answered");
                match out.2["outcome"].as_str() {
                    Some("consumed") => {}
                    Some("duplicate") => {
                        assert_eq!(
                            out.2["status"], "processing",
                            "token {i} is only held by a dead attempt"
                        );
                        left.push(i);
                    }
                    _ => panic!("token {i}: {:?}", out),
                }
            }
            let done = left.is_empty();
            *remaining.lock().expect("lock") = left;
            done.then_some(())
        }
    })
    .await;
    eprintln!(
        "service kill: open tokens consumable again after {:?}",
        freeing.elapsed()
    );
    // And now every token is spent exactly once.
    for (i, (token, subject)) in tokens.iter().enumerate() {
        let (_, _, body) = try_consume(&http, &base, token, &json!({"subject": subject}))
            .await
            .expect("answered");
        assert_eq!(body["outcome"], "duplicate", "token {i}");
    }
    second.kill();
}

// ---- Redis Cluster --------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_cluster_exactly_once_and_after_a_master_fails_over() {
    let mut cluster = Cluster::start();
    let app = Arc::new(
        spawn_app_on(
            Stores::fresh()
                .redis("")
                .with(&cluster.config_line())
                .with(QUICK_BREAKER),
        )
        .await,
    );
    assert_eq!(wait_mode(&app, 5, "normal").await["redis"], "up");
    for biz in ["order", "like"] {
        let tokens = issue_many(&app, biz, 30).await;
        let (consumed, answers) = storm(&app, &tokens, 6, biz).await;
        assert_all_ok(&answers);
        assert!(consumed.iter().all(|&n| n == 1), "{biz}: {consumed:?}");
    }
    // The keys really are in the cluster, spread over the masters.
    let probe = app.issue(PAYMENTS, "order", "probe").await;
    let key = app.token_key(&probe);
    let exists = redis_cli(cluster.nodes[0].port, &["-c", "exists", &key]);
    assert_eq!(exists.trim(), "1", "{exists}");
    // The fast journal (its stream in another slot) reaches Postgres.
    let pool = app.pg().await;
    eventually(10, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM tokens WHERE biz_type = 'like' AND state = 'consumed'",
            )
            .fetch_one(&pool)
            .await
            .ok()?;
            (n == 30).then_some(())
        }
    })
    .await;

    // Issued before the failover, consumed during and after it.
    let before_orders = issue_many(&app, "order", 30).await;
    let before_likes = issue_many(&app, "like", 30).await;
    let victim = (0..cluster.nodes.len())
        .find(|i| cluster.is_master(*i))
        .expect("a master");
    let heir = cluster.replica_of(victim);
    cluster.nodes[victim].kill();
    let killed = std::time::Instant::now();
    let (during, answers) = storm(&app, &before_orders, 4, "during").await;
    assert_all_ok(&answers);
    assert!(during.iter().all(|&n| n == 1), "{during:?}");

    cluster.wait_promoted(heir);
    cluster.wait_healthy(&[victim]);
    // The service finds the promoted replica: fast consumes through Redis
    // again, on every master (ten fresh tokens in a row spread over the
    // slots; one call failing on a stale route answers 503, and the mode
    // alone does not show a route the client has not refreshed yet).
    eventually(30, || {
        let app = app.clone();
        async move {
            let (_, body) = readyz(&bounded_client(), &app.address).await?;
            if body["mode"] != "normal" {
                return None;
            }
            for _ in 0..10 {
                let token = app.issue(PAYMENTS, "like", "after").await;
                let (s, _, out) = try_consume(
                    &bounded_client(),
                    &app.address,
                    &token,
                    &json!({"subject": "after"}),
                )
                .await?;
                if s != StatusCode::OK || out["outcome"] != "consumed" {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    eprintln!(
        "cluster: master {victim} killed; replica {heir} promoted and serving the service after {:?}; redis errors seen: {:?}",
        killed.elapsed(),
        metric(&app, "ledger_fast_tier_total{result=\"error\"}").await
    );
    let (after, answers) = storm(&app, &before_likes, 6, "after").await;
    assert_all_ok(&answers);
    assert!(after.iter().all(|&n| n == 1), "{after:?}");
    let (again, answers) = storm(&app, &before_orders, 3, "again").await;
    assert_all_ok(&answers);
    assert!(again.iter().all(|&n| n == 0), "{again:?}");
    for biz in ["order", "like"] {
        let tokens = issue_many(&app, biz, 20).await;
        let (consumed, answers) = storm(&app, &tokens, 6, &format!("{biz}-after")).await;
        assert_all_ok(&answers);
        assert!(consumed.iter().all(|&n| n == 1), "{biz}: {consumed:?}");
    }
}

/// On a cluster the journal stream is in another slot, so a fast consume's
/// journal entry is a second command after the script. When that command
/// fails (here: the journal key is not a stream), the script's decision still
/// stands: the caller hears `consumed` (not a 503 that would make its
/// retry a `duplicate`), and the entry is in Postgres before the answer
/// (applied directly, not kept in the process's memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_fast_consume_whose_journal_append_fails_still_wins() {
    let cluster = Cluster::start();
    let app = Arc::new(
        spawn_app_on(
            Stores::fresh()
                .redis("")
                .with(&cluster.config_line())
                .with(QUICK_BREAKER),
        )
        .await,
    );
    assert_eq!(wait_mode(&app, 5, "normal").await["redis"], "up");
    // The journal's key made unusable for XADD (a string, not a stream): the
    // append after the script fails with an error reply.
    let journal = format!("{}journal", app.stores.prefix);
    let port = cluster.nodes[0].port;
    assert_eq!(
        redis_cli(port, &["-c", "set", &journal, "not-a-stream"]).trim(),
        "OK"
    );
    let subject = "fan".to_owned();
    let token = app.issue(PAYMENTS, "like", &subject).await;
    let body = json!({"subject": subject});
    let answered = consume(&app, &token, &body).await;
    // Before Redis takes journal entries again: the entry is in Postgres
    // already, and nothing waits in memory.
    let pool = app.pg().await;
    let state: Option<String> =
        sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
            .bind(&token)
            .fetch_optional(&pool)
            .await
            .expect("read");
    let metrics = app.metrics_text().await;
    let fallback = |to: &str| {
        metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "ledger_journal_append_fallback_total{{to=\"{to}\"}} "
                ))
            })
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    assert_eq!(redis_cli(port, &["-c", "del", &journal]).trim(), "1");
    let (s, _, answer) = answered;
    assert_eq!(
        (s, answer["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{answer}"
    );
    assert_eq!(
        state.as_deref(),
        Some("consumed"),
        "in postgres before the answer"
    );
    assert_eq!(
        (fallback("postgres"), fallback("memory")),
        (Some(1), Some(0)),
        "applied directly, not kept in memory"
    );
    eventually(20, || {
        let pool = pool.clone();
        let token = token.clone();
        async move {
            let state: String =
                sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
                    .bind(&token)
                    .fetch_one(&pool)
                    .await
                    .ok()?;
            (state == "consumed").then_some(())
        }
    })
    .await;
    eventually(10, || {
        let app = app.clone();
        let (token, body) = (token.clone(), body.clone());
        async move {
            let (s, _, again) = consume(&app, &token, &body).await;
            (s == StatusCode::OK && again["outcome"] == "duplicate").then_some(())
        }
    })
    .await;
}

/// The same append failure while this instance cannot reach Postgres either:
/// the decision still stands, the entry waits in the process's memory
/// (counted), and reaches Postgres once both answer again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_journal_entry_neither_redis_nor_postgres_takes_waits_in_memory_then_arrives() {
    let cluster = Cluster::start();
    let link = crate::helpers::link::Link::to(crate::helpers::suite_pg::port()).await;
    let app = spawn_app_on(
        Stores::fresh()
            .postgres(&format!("postgres://postgres@127.0.0.1:{}", link.port()))
            .redis("")
            .with(&cluster.config_line())
            .with(QUICK_BREAKER),
    )
    .await;
    assert_eq!(wait_mode(&app, 5, "normal").await["redis"], "up");
    let journal = format!("{}journal", app.stores.prefix);
    let port = cluster.nodes[0].port;
    let subject = "fan".to_owned();
    let token = app.issue(PAYMENTS, "like", &subject).await;
    let body = json!({"subject": subject});
    assert_eq!(
        redis_cli(port, &["-c", "set", &journal, "not-a-stream"]).trim(),
        "OK"
    );
    // Within the fleet's lease of the last report, Redis still decides.
    link.cut();
    let (s, _, answer) = consume(&app, &token, &body).await;
    assert_eq!(
        (s, answer["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{answer}"
    );
    let metrics = app.metrics_text().await;
    let kept = metrics.lines().find_map(|l| {
        l.strip_prefix("ledger_journal_append_fallback_total{to=\"memory\"} ")
            .and_then(|v| v.trim().parse::<u64>().ok())
    });
    assert_eq!(kept, Some(1), "kept in memory, counted");
    link.open();
    assert_eq!(redis_cli(port, &["-c", "del", &journal]).trim(), "1");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!(
            "{}/{}",
            crate::helpers::suite_pg::base(),
            app.stores.db_name
        ))
        .await
        .expect("test pool");
    eventually(30, || {
        let (pool, token) = (pool.clone(), token.clone());
        async move {
            let state: String =
                sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
                    .bind(&token)
                    .fetch_one(&pool)
                    .await
                    .ok()?;
            (state == "consumed").then_some(())
        }
    })
    .await;
}
