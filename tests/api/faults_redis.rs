//! Redis lost under load, on a private Redis (`procs`): killed during a
//! durable load, consumes stay exactly once and the mode comes back to
//! normal; slowed, then paused, the mode goes `redis_slow`, `redis_down`
//! and back; a stale snapshot restored (a replica behind) never allows a
//! second durable consume.
//! These are among the slow tests of the suite (each a few seconds); they run
//! in CI with the rest (filter: `cargo test --test api faults`). Every
//! request carries a client timeout (`helpers::bounded`): a hung request
//! fails the test instead of hanging it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::bounded::*;
use crate::helpers::procs::*;
use crate::helpers::*;

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
    // The marker is written back before the episode ends; Redis decides
    // here again once the fleet is normal on its dataset (until then a fast
    // consume may answer 503 and a retry).
    let http = bounded_client();
    eventually(10, || {
        let (http, base) = (http.clone(), app.address.clone());
        async move {
            let (_, body) = readyz(&http, &base).await?;
            (body["fleet"]["redis_decides_here"] == true).then_some(())
        }
    })
    .await;
    let (status, replayed, body) = consume(&app, &like, &json!({"subject": "fan"})).await;
    assert_eq!(
        (body["outcome"].as_str(), replayed),
        (Some("duplicate"), true),
        "{status} {body}"
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
