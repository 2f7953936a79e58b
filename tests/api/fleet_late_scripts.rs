//! Scripts that reach Redis late (`crate::fleet`, `fast::deadline`): a
//! consume run after the fleet decided the token in Postgres never wins; a
//! script held in a stalled link, or sent by an instance that died, never
//! consumes a token released meanwhile; a fresh instance's first script is
//! bounded too.
//! Every test counts, per fast token, how many answers said `consumed`
//! across the instances: never more than one.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::fleet_answers::*;
use crate::helpers::link::Link;
use crate::helpers::procs::*;
use crate::helpers::*;

/// A fast consume whose script timed out on its way to a paused Redis runs
/// there when Redis resumes, after Postgres decided the token for another
/// caller during the episode: Redis then holds a consumed marker at the
/// generation Postgres decided, naming a caller that was never told it won.
/// The return to normal writes Postgres's decision over it, so that
/// caller's retry learns the token went to the other, not that it won.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consume_that_reaches_redis_after_the_fleet_decided_in_postgres_never_wins() {
    let redis = RedisProc::start();
    let (a, b) = pair_on(&redis).await;
    let tokens = issue_likes(&a, 30).await;
    // The consume script is loaded on this Redis (a NOSCRIPT reply would
    // stop the late scripts before they do anything).
    let warm = issue_likes(&a, 1).await;
    assert!(consumed(&consume_on(&a, &warm[0]).await));
    // The tokens are in Redis, issued.
    for t in &tokens {
        wait_redis_state(&redis.conn().await, &a.token_key(t), "i", 5).await;
    }

    redis.cli(&["CONFIG", "SET", "slowlog-log-slower-than", "0"]);
    redis.cli(&["CONFIG", "SET", "slowlog-max-len", "100000"]);
    // Redis stops answering with these consumes' scripts on their way: A
    // times them out (503, outcome unknown) and they wait in Redis's socket.
    redis.pause();
    consume_into_a_paused_redis(&a, &tokens).await;
    wait_fleet(&a, 15, "redis_down").await;
    wait_fleet(&b, 15, "redis_down").await;
    // Postgres decides the tokens, for other callers, via B.
    for (i, t) in tokens.iter().enumerate() {
        let x = consume_as(&b, t, &format!("pg-{i}")).await;
        assert!(consumed(&x), "{t}: {x:?}");
    }
    // Redis runs the waiting scripts first, then the fleet returns.
    redis.resume();
    wait_fleet(&a, 15, "normal").await;
    wait_fleet(&b, 15, "normal").await;
    // Redis's slow log (every command, see above) shows the scripts ran.
    let log = redis.cli(&["SLOWLOG", "GET", "-1"]);
    let ran_late = (0..tokens.len())
        .filter(|i| log.lines().any(|l| l.trim() == format!("late-{i}")))
        .count();
    assert!(
        ran_late > 0,
        "the timed-out scripts ran in Redis after it resumed (else this test proves nothing)"
    );

    let (mut twice, mut lost) = (Vec::new(), Vec::new());
    for (i, t) in tokens.iter().enumerate() {
        for app in [&a, &b] {
            let x = eventually(10, || async move {
                let x = consume_as(app, t, &format!("late-{i}")).await;
                (x.0 != StatusCode::SERVICE_UNAVAILABLE).then_some(x)
            })
            .await;
            assert_eq!(x.0, StatusCode::OK, "{t}: {x:?}");
            if consumed(&x) {
                twice.push(t.clone());
            }
        }
        // The winner's retry replays its win.
        if !consumed(&consume_as(&a, t, &format!("pg-{i}")).await) {
            lost.push(t.clone());
        }
    }
    assert!(
        twice.is_empty() && lost.is_empty(),
        "of {} tokens: {} answers `consumed` to callers that were told 503, {} winners whose retry no longer said `consumed`",
        tokens.len(),
        twice.len(),
        lost.len()
    );
}

/// Issue 24, item 6: a fast consume whose script is held in a stalled link
/// (its caller heard 503) reaches Redis after the caller retried on another
/// instance, won, and released the token. Run then, it consumed the token
/// for nobody (the next attempt heard `duplicate`). Scripts carry a
/// not-after bound in Redis's clock: past it, they decide nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_script_held_in_a_stalled_link_never_consumes_a_token_released_meanwhile() {
    let redis = RedisProc::start();
    let link = Link::to(redis.port).await;
    let stores = Stores::fresh()
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"30s\"");
    let a = spawn_app_on(
        stores
            .clone()
            .redis(&format!("redis://127.0.0.1:{}", link.port())),
    )
    .await;
    let b = spawn_app_on(stores.redis(&redis.url())).await;
    // Both instances have run a script (loaded, and Redis's clock known).
    for app in [&a, &b] {
        let warm = issue_likes(app, 1).await;
        assert!(consumed(&consume_on(app, &warm[0]).await));
    }
    let token = issue_likes(&b, 1).await.remove(0);
    wait_redis_state(&redis.conn().await, &b.token_key(&token), "i", 5).await;

    // A's consume is held in the link: A answers 503 (outcome unknown).
    link.stall();
    let held = consume_as(&a, &token, "r-1").await;
    assert_eq!(held.0, StatusCode::SERVICE_UNAVAILABLE, "{held:?}");
    // The client retries on B: it wins, then its step fails before any side
    // effect and it releases the token.
    let retried = consume_as(&b, &token, "r-1").await;
    assert!(consumed(&retried), "{retried:?}");
    let r = b
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{token}/release"),
            &json!({"subject": "fan", "request_id": "r-1"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    // The held script reaches Redis now.
    link.open();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The token is free: the next attempt consumes it.
    let next = consume_as(&b, &token, "r-2").await;
    assert!(
        consumed(&next),
        "the late script consumed the released token for nobody: {next:?}"
    );
}

/// Found by the protocol model (F3): a consume script of an instance that
/// died was still on its way, within its not-after bound, when the
/// client's retry elsewhere won and released the token; arriving then, it
/// consumed the released token for nobody (nobody is left to hear it), and
/// every later consume heard `duplicate`. For `redis.timeout` after a
/// release nobody consumes the token (`cooling`), so such a script has
/// passed its bound first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_script_of_an_instance_that_died_never_consumes_a_token_released_meanwhile() {
    let redis = RedisProc::start();
    let link = Link::to(redis.port).await;
    let stores = Stores::fresh()
        .redis(&redis.url())
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"30s\"");
    let b = &spawn_app_on(stores.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = LedgerProc::start(
        dir.path(),
        "a",
        &format!(
            "[postgres]\nurl = \"{}\"\n[redis]\nurl = \"redis://127.0.0.1:{}\"\nkey_prefix = \"{}\"\ntimeout = \"250ms\"\ndown_after = \"30s\"\n[biz.like]\nttl = \"60s\"\nissue_rate = \"100000/s\"\n",
            stores.db_url(),
            link.port(),
            stores.prefix
        ),
    );
    a.wait_ready().await;
    let http = reqwest::Client::new();
    let consume_on_a = |t: String, rid: &'static str| {
        let (http, url) = (
            http.clone(),
            format!("{}/v1/tokens/{t}/consume", a.address()),
        );
        async move {
            http.post(url)
                .bearer_auth(PAYMENTS)
                .json(&json!({"subject": "fan", "request_id": rid}))
                .send()
                .await
        }
    };
    // A has run a script (loaded, and Redis's clock known).
    let warm = issue_likes(b, 1).await.remove(0);
    let r = eventually(10, || {
        let f = consume_on_a(warm.clone(), "warm");
        async move { f.await.ok().filter(|r| r.status() == StatusCode::OK) }
    })
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let t = issue_likes(b, 1).await.remove(0);

    // A's script waits in the stalled link; then A dies.
    link.stall();
    let gone = tokio::spawn(consume_on_a(t.clone(), "gone"));
    tokio::time::sleep(Duration::from_millis(30)).await;
    a.kill();
    assert!(
        gone.await.expect("task").is_err(),
        "A died before answering"
    );
    // The client's retry on B wins and releases, well within A's script's
    // not-after bound; then the link lets A's script through.
    let won = consume_as(b, &t, "gone").await;
    assert!(consumed(&won), "{won:?}");
    let r = b
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{t}/release"),
            &json!({"subject": "fan", "request_id": "gone"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    link.open();

    // Once A's script is surely through, the released token is still free.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let next = consume_as(b, &t, "next").await;
    assert!(consumed(&next), "the released token was burned: {next:?}");
}

/// Found in review: an instance's scripts carry a not-after bound only once
/// a reply has told it Redis's time, so the first fast consume of a fresh
/// instance went out unbounded. Held in a stalled link past its caller's
/// 503, past the client's retry elsewhere, its win and release, and past
/// the release's cooling, it still consumed the released token for
/// nobody. Redis now decides on an instance only once its clock is known
/// (the fleet's beat asks `TIME` first).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fresh_instance_s_first_script_is_bounded_too() {
    let redis = RedisProc::start();
    let link = Link::to(redis.port).await;
    let stores = Stores::fresh()
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"30s\"");
    let b = spawn_app_on(stores.clone().redis(&redis.url())).await;
    // A has never run a deciding script.
    let a = spawn_app_on(stores.redis(&format!("redis://127.0.0.1:{}", link.port()))).await;
    wait_fleet(&a, 10, "normal").await;
    let token = issue_likes(&b, 1).await.remove(0);
    wait_redis_state(&redis.conn().await, &b.token_key(&token), "i", 5).await;

    link.stall();
    let held = consume_as(&a, &token, "r-1").await;
    assert_eq!(held.0, StatusCode::SERVICE_UNAVAILABLE, "{held:?}");
    let retried = consume_as(&b, &token, "r-1").await;
    assert!(consumed(&retried), "{retried:?}");
    let r = b
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{token}/release"),
            &json!({"subject": "fan", "request_id": "r-1"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    // Past the release's cooling (250 ms), the held script reaches Redis.
    tokio::time::sleep(Duration::from_millis(400)).await;
    link.open();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let next = consume_as(&b, &token, "r-2").await;
    assert!(
        consumed(&next),
        "the unbounded script consumed the released token for nobody: {next:?}"
    );
}
