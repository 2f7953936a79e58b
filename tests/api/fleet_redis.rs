//! The fleet's agreement on Redis (`crate::fleet`): two instances on one
//! Postgres and one private Redis, one instance's link to Redis through a
//! proxy that the test stalls or cuts, or Redis itself paused for both.
//! Every test counts, per fast token, how many answers said `consumed`
//! across the instances: never more than one.

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::link::Link;
use crate::helpers::procs::*;
use crate::helpers::*;

/// Fast tokens of subject `fan` on `app`.
async fn issue_likes(app: &TestApp, n: usize) -> Vec<String> {
    stream::iter(0..n)
        .map(|_| app.issue(PAYMENTS, "like", "fan"))
        .buffer_unordered(16)
        .collect()
        .await
}

/// A consume's status and outcome (or error code).
type Said = (StatusCode, Option<String>);

async fn consume_on(app: &TestApp, token: &str) -> Said {
    let r = app
        .consume(PAYMENTS, token, &json!({"subject": "fan"}))
        .await;
    let (s, _, body) = answer(r).await;
    let said = body["outcome"].as_str().or(body["error"].as_str());
    (s, said.map(str::to_owned))
}

fn consumed(a: &Said) -> bool {
    a.0 == StatusCode::OK && a.1.as_deref() == Some("consumed")
}

/// Every answer is 200 or 503, never another error.
fn assert_200_or_503(answers: &[Said]) {
    for a in answers {
        assert!(
            a.0 == StatusCode::OK || a.0 == StatusCode::SERVICE_UNAVAILABLE,
            "{a:?}"
        );
    }
}

async fn readyz(app: &TestApp) -> Value {
    let r = app
        .http
        .get(format!("{}/readyz", app.address))
        .send()
        .await
        .expect("readyz");
    r.json().await.expect("json")
}

async fn wait_fleet(app: &TestApp, secs: u64, state: &'static str) -> Value {
    eventually(secs, || async move {
        let body = readyz(app).await;
        (body["fleet"]["state"] == state).then_some(body)
    })
    .await
}

/// The production timeout, so that a 400 ms stall times a call out.
const FAST_TIMEOUT: &str =
    "redis.timeout = \"250ms\"\nbiz.like.issue_rate = \"100000/s\"\nbiz.like.ttl = \"60s\"";

/// Two instances on one Postgres and `redis`, quick to see it down.
async fn pair_on(redis: &RedisProc) -> (TestApp, TestApp) {
    let stores = Stores::fresh()
        .redis(&redis.url())
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"1s\"");
    (
        spawn_app_on(stores.clone()).await,
        spawn_app_on(stores).await,
    )
}

/// With Redis paused: a consume of each token on `app` with request id
/// `late-<i>`, whose script waits in Redis's socket; each answers 503.
async fn consume_into_a_paused_redis(app: &TestApp, tokens: &[String]) {
    let late: Vec<Said> = stream::iter(tokens.iter().enumerate())
        .map(|(i, t)| async move { consume_as(app, t, &format!("late-{i}")).await })
        .buffer_unordered(tokens.len().max(1))
        .collect()
        .await;
    for x in &late {
        assert_eq!(x.0, StatusCode::SERVICE_UNAVAILABLE, "{x:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_link_never_lets_an_instance_decide_fast_consumes_without_redis() {
    let redis = RedisProc::start();
    let link = Arc::new(Link::to(redis.port).await);
    let stores = Stores::fresh().redis(&redis.url()).with(FAST_TIMEOUT);
    let b = spawn_app_on(stores.clone()).await;
    let a = spawn_app_on(stores.redis(&format!("redis://127.0.0.1:{}", link.port()))).await;
    let tokens = issue_likes(&b, 600).await;

    // Six stalls of 400 ms, each long enough for one call to time out.
    let stalls = {
        let link = link.clone();
        tokio::spawn(async move {
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_millis(250)).await;
                link.stall();
                tokio::time::sleep(Duration::from_millis(400)).await;
                link.open();
            }
        })
    };
    // For each token: a consume via B, then one via A.
    let answers: Vec<(Said, Said)> = stream::iter(tokens.iter())
        .map(|t| {
            let (a, b) = (&a, &b);
            async move {
                let first = consume_on(b, t).await;
                let second = consume_on(a, t).await;
                // Paced, so that the load outlasts the stalls.
                tokio::time::sleep(Duration::from_millis(40)).await;
                (first, second)
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    stalls.await.expect("stalls");

    let all: Vec<_> = answers
        .iter()
        .flat_map(|(x, y)| [x.clone(), y.clone()])
        .collect();
    assert_200_or_503(&all);
    let twice = answers
        .iter()
        .filter(|(x, y)| consumed(x) && consumed(y))
        .count();
    assert_eq!(twice, 0, "tokens answered consumed on both instances");
    let unavailable = answers
        .iter()
        .filter(|(_, y)| y.0 == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    assert!(
        unavailable > 0,
        "the stalls made some of A's calls time out (else this test proves nothing)"
    );
    // Redis was never down for the fleet.
    assert_eq!(readyz(&b).await["fleet"]["state"], "normal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_link_makes_that_instance_answer_503_while_the_fleet_uses_redis() {
    let redis = RedisProc::start();
    let link = Link::to(redis.port).await;
    let stores = Stores::fresh().redis(&redis.url()).with(FAST_TIMEOUT);
    let b = spawn_app_on(stores.clone()).await;
    let a = spawn_app_on(stores.redis(&format!("redis://127.0.0.1:{}", link.port()))).await;
    let before = issue_likes(&b, 20).await;
    let during = issue_likes(&b, 40).await;
    for t in &before {
        assert!(consumed(&consume_on(&a, t).await));
    }

    link.cut();
    let started = std::time::Instant::now();
    // A, cut off: never decides a fast consume, answers 503.
    let mut on_a = Vec::new();
    for t in during.iter().take(10) {
        on_a.push(consume_on(&a, t).await);
    }
    assert!(
        on_a.iter().all(|x| x.0 == StatusCode::SERVICE_UNAVAILABLE),
        "{on_a:?} {}",
        readyz(&a).await
    );
    let ready = readyz(&a).await;
    assert_eq!(ready["redis"], "down", "{ready}");
    assert_eq!(ready["fleet"]["state"], "normal", "{ready}");
    assert_eq!(ready["fleet"]["redis_decides_here"], false, "{ready}");
    // B decides in Redis meanwhile, the tokens A refused included.
    let mut on_b = Vec::new();
    for t in &during {
        on_b.push(consume_on(&b, t).await);
    }
    assert!(on_b.iter().all(consumed), "{on_b:?}");
    // Still cut (5 s in all): A still refuses, now with B's decisions made.
    let mut again = Vec::new();
    for t in &during {
        again.push(consume_on(&a, t).await);
    }
    assert!(
        again.iter().all(|x| !consumed(x)),
        "A decided without Redis: {again:?}"
    );
    if let Some(rest) = Duration::from_secs(5).checked_sub(started.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    assert_eq!(readyz(&b).await["fleet"]["state"], "normal");

    // Back: A answers from Redis again (duplicates of what B decided).
    link.open();
    for t in &during {
        let a = &a;
        let x = eventually(10, || async move {
            let x = consume_on(a, t).await;
            (x.0 == StatusCode::OK).then_some(x)
        })
        .await;
        assert_eq!(x.1.as_deref(), Some("duplicate"), "{t}");
    }
    for t in &before {
        assert_eq!(consume_on(&b, t).await.1.as_deref(), Some("duplicate"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_down_for_the_whole_fleet_then_back_keeps_fast_consumes_exactly_once() {
    let redis = RedisProc::start();
    let (a, b) = pair_on(&redis).await;
    let just_before = issue_likes(&a, 40).await;
    let during = issue_likes(&a, 40).await;
    let after = issue_likes(&b, 40).await;

    // Consumed just before Redis stops answering: their journal entries
    // are in Redis, perhaps not yet drained into Postgres.
    let first: Vec<_> = stream::iter(just_before.iter())
        .map(|t| consume_on(&a, t))
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(first.iter().all(consumed), "{first:?}");
    redis.pause();
    // Every instance sees Redis down: the fleet agrees, Postgres decides.
    for app in [&a, &b] {
        eventually(15, || async move {
            let t = issue_likes(app, 1).await.pop()?;
            let x = consume_on(app, &t).await;
            consumed(&x).then_some(())
        })
        .await;
    }
    let ready = wait_fleet(&a, 10, "redis_down").await;
    assert_eq!(ready["fleet"]["redis_down_members"], 2, "{ready}");
    let mut count = std::collections::HashMap::<&str, usize>::new();
    for (i, t) in just_before.iter().chain(during.iter()).enumerate() {
        let app = if i % 2 == 0 { &a } else { &b };
        let other = if i % 2 == 0 { &b } else { &a };
        for x in [consume_on(app, t).await, consume_on(other, t).await] {
            assert_eq!(x.0, StatusCode::OK, "{t}: {x:?}");
            if consumed(&x) {
                *count.entry(t.as_str()).or_default() += 1;
            }
        }
    }
    for t in &just_before {
        assert_eq!(
            count.get(t.as_str()),
            None,
            "consumed again while Redis was down: {t}"
        );
    }
    for t in &during {
        assert_eq!(count.get(t.as_str()), Some(&1), "{t}");
    }

    // Redis answers again: what Postgres decided reaches it before it
    // decides again, so nothing consumed meanwhile is fresh to it.
    redis.resume();
    wait_fleet(&a, 15, "normal").await;
    wait_fleet(&b, 15, "normal").await;
    let mut conn = redis.conn().await;
    for t in &during {
        let state: Option<String> = redis::cmd("HGET")
            .arg(a.token_key(t))
            .arg("s")
            .query_async(&mut conn)
            .await
            .expect("hget");
        assert_eq!(state.as_deref(), Some("c"), "{t}");
    }
    let answers: Vec<[Said; 2]> = stream::iter(just_before.iter().chain(during.iter()))
        .map(|t| {
            let (a, b) = (&a, &b);
            async move { [consume_on(a, t).await, consume_on(b, t).await] }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for pair in &answers {
        assert_200_or_503(pair);
        assert!(!pair.iter().any(consumed), "{pair:?}");
    }
    // Just after: tokens issued before, consumed now on both, once.
    let answers: Vec<[Said; 2]> = stream::iter(after.iter())
        .map(|t| {
            let (a, b) = (&a, &b);
            async move { [consume_on(a, t).await, consume_on(b, t).await] }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for pair in &answers {
        assert_200_or_503(pair);
        assert_eq!(pair.iter().filter(|x| consumed(x)).count(), 1, "{pair:?}");
    }
    let metrics = a.metrics_text().await + &b.metrics_text().await;
    let transitions = |to: &str| -> f64 {
        metrics
            .lines()
            .filter_map(|l| {
                l.strip_prefix(&format!("ledger_fleet_transitions_total{{to=\"{to}\"}} "))
            })
            .filter_map(|v| v.trim().parse::<f64>().ok())
            .sum()
    };
    assert_eq!(transitions("redis_down"), 1.0, "{metrics}");
    assert_eq!(transitions("normal"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_both_tiers_down_fast_consumes_answer_503_unless_memory_fallback_is_set() {
    let mut redis = RedisProc::start();
    let pg = PgProc::start();
    let stores = Stores::fresh()
        .redis(&redis.url())
        .postgres(&pg.base())
        .with(FAST_TIMEOUT);
    let strict = spawn_app_on(stores.clone()).await;
    let lenient = spawn_app_on(stores.with("redis.memory_fallback = true")).await;
    let refused = issue_likes(&strict, 1).await.remove(0);
    let decided = issue_likes(&lenient, 1).await.remove(0);

    redis.kill();
    pg.stop_immediate();
    // The default: nothing is decided where it would be lost with the process.
    for _ in 0..6 {
        let x = consume_on(&strict, &refused).await;
        assert_eq!(x.0, StatusCode::SERVICE_UNAVAILABLE, "{x:?}");
    }
    // Opted in: this instance decides, once.
    let first = eventually(15, || {
        let (app, t) = (&lenient, &decided);
        async move {
            let x = consume_on(app, t).await;
            (x.0 == StatusCode::OK).then_some(x)
        }
    })
    .await;
    assert_eq!(first.1.as_deref(), Some("consumed"));
    let again = consume_on(&lenient, &decided).await;
    assert_eq!(
        (again.0, again.1.as_deref()),
        (StatusCode::OK, Some("duplicate"))
    );
    let metrics = lenient.metrics_text().await;
    assert!(
        metrics.contains("ledger_redis_bypass_total{reason=\"memory\"} 1"),
        "{metrics}"
    );
}

/// A consume with a `request_id`: its status, outcome (or error code) and
/// whether the answer was a replay.
async fn consume_as(app: &TestApp, token: &str, request_id: &str) -> Said {
    let r = app
        .consume(
            PAYMENTS,
            token,
            &json!({"subject": "fan", "request_id": request_id}),
        )
        .await;
    let (s, _, body) = answer(r).await;
    let said = body["outcome"].as_str().or(body["error"].as_str());
    (s, said.map(str::to_owned))
}

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

/// While the fleet has Redis down, Postgres decides fast results too, also
/// on an instance that reaches Redis again before the episode ends. Here the
/// episode is held open (one decision cannot be written back: its key holds
/// a string) with Redis answering, and a consumed marker there is a late
/// script's (as in the test above). Recorded in Redis, the winner's result
/// would go onto that marker, and its journal entry would carry the late
/// caller's request_id into Postgres's row, whose write-back then made the
/// late caller the winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_result_recorded_while_the_fleet_has_redis_down_is_decided_in_postgres() {
    let redis = RedisProc::start();
    let (a, b) = pair_on(&redis).await;
    // The first token id: its write-back is the first the return tries.
    let stuck = issue_likes(&a, 1).await.remove(0);
    let tokens = issue_likes(&a, 10).await;
    let warm = issue_likes(&a, 1).await;
    assert!(consumed(&consume_on(&a, &warm[0]).await));
    let mut conn = redis.conn().await;
    for t in &tokens {
        wait_redis_state(&conn, &a.token_key(t), "i", 5).await;
    }
    let _: () = redis::cmd("SET")
        .arg(a.token_key(&stuck))
        .arg("not a hash")
        .query_async(&mut conn)
        .await
        .expect("set");

    redis.pause();
    consume_into_a_paused_redis(&a, &tokens).await;
    wait_fleet(&a, 15, "redis_down").await;
    wait_fleet(&b, 15, "redis_down").await;
    assert!(consumed(&consume_as(&b, &stuck, "pg-stuck").await));
    for (i, t) in tokens.iter().enumerate() {
        assert!(consumed(&consume_as(&b, t, &format!("pg-{i}")).await));
    }
    redis.resume();
    // Redis answers, the episode stays open (the stuck write-back).
    eventually(10, || async {
        (readyz(&b).await["redis"] != "down").then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(readyz(&b).await["fleet"]["state"], "redis_down");
    for t in &tokens {
        let r = b
            .post(
                PAYMENTS,
                &format!("/v1/tokens/{t}/result"),
                &json!({"subject": "fan", "result": {"paid": true}}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK, "{t}");
    }
    // Postgres has every result (through the journal, if Redis took them).
    let pg = a.pg().await;
    eventually(15, || {
        let pg = pg.clone();
        let tokens = tokens.clone();
        async move {
            let with: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM tokens WHERE token = ANY($1) AND result IS NOT NULL",
            )
            .bind(&tokens)
            .fetch_one(&pg)
            .await
            .ok()?;
            (with == tokens.len() as i64).then_some(())
        }
    })
    .await;
    let _: () = redis::cmd("DEL")
        .arg(a.token_key(&stuck))
        .query_async(&mut conn)
        .await
        .expect("del");
    wait_fleet(&a, 15, "normal").await;
    wait_fleet(&b, 15, "normal").await;

    let (mut twice, mut lost) = (0, 0);
    let a = &a;
    for (i, t) in tokens.iter().enumerate() {
        let x = eventually(10, || async move {
            let x = consume_as(a, t, &format!("late-{i}")).await;
            (x.0 != StatusCode::SERVICE_UNAVAILABLE).then_some(x)
        })
        .await;
        twice += usize::from(consumed(&x));
        lost += usize::from(!consumed(&consume_as(&b, t, &format!("pg-{i}")).await));
    }
    let rids: Vec<String> =
        sqlx::query_scalar("SELECT request_id FROM tokens WHERE token = ANY($1) ORDER BY id")
            .bind(&tokens)
            .fetch_all(&pg)
            .await
            .expect("rows");
    assert!(
        twice == 0 && lost == 0 && rids.iter().all(|r| r.starts_with("pg-")),
        "of {} tokens: {twice} late callers told `consumed`, {lost} winners not; Postgres's request ids: {rids:?}",
        tokens.len()
    );
}

/// One instance whose Redis is reached through `link`, quick to time out.
async fn behind(link: &Link, extra: &str) -> TestApp {
    spawn_app_on(
        Stores::fresh()
            .redis(&format!("redis://127.0.0.1:{}", link.port()))
            .with(FAST_TIMEOUT)
            .with(extra),
    )
    .await
}

/// A Redis that answers, but later than `redis.timeout`, is slow for the
/// instance, not down: each call that times out answers 503 (its outcome
/// unknown), and only calls that could not reach Redis count toward
/// `redis.down_after_failures`. Four timeouts in a row, well within
/// `redis.down_after`, leave Redis up for the instance and the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_that_time_out_on_a_slow_link_are_slowness_not_redis_down() {
    let redis = RedisProc::start();
    let link = Link::to(redis.port).await;
    let a = behind(&link, "redis.down_after = \"30s\"").await;
    let tokens = issue_likes(&a, 6).await;
    assert!(consumed(&consume_on(&a, &tokens[0]).await));

    // Every chunk 400 ms late each way: each call times out at 250 ms.
    link.slow(Duration::from_millis(400));
    for t in &tokens[1..5] {
        let x = consume_on(&a, t).await;
        assert_eq!(
            x.0,
            StatusCode::SERVICE_UNAVAILABLE,
            "{x:?}: {}",
            readyz(&a).await
        );
    }
    let ready = readyz(&a).await;
    assert_ne!(
        ready["redis"], "down",
        "timeouts counted as Redis unreachable: {ready}"
    );
    assert_eq!(ready["fleet"]["state"], "normal", "{ready}");

    // Fast again: the instance decides in Redis at once.
    link.open();
    let x = eventually(10, || async {
        let x = consume_on(&a, &tokens[5]).await;
        (x.0 == StatusCode::OK).then_some(x)
    })
    .await;
    assert!(consumed(&x), "{x:?}");
}

/// An idle instance's health PINGs are evidence for its view of Redis but
/// not lookups of the serving path: when they time out (a slow link, no
/// request served), `ledger_fast_tier_total{result="error"}` stays put,
/// and the instance still learns that Redis is down (after
/// `redis.down_after` of failures).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_instances_failed_health_pings_are_evidence_but_not_serving_errors() {
    let redis = RedisProc::start();
    let link = Link::to(redis.port).await;
    let a = behind(&link, "redis.down_after = \"1s\"").await;
    assert_eq!(wait_fleet(&a, 10, "normal").await["redis"], "up");
    use crate::helpers::scrape::{redis_calls, serving_errors as errors};
    let pings = |text: &str| redis_calls(text, "ping");
    let before = a.metrics_text().await;

    link.slow(Duration::from_millis(400));
    let down = eventually(10, || async {
        let body = readyz(&a).await;
        (body["redis"] == "down").then_some(body)
    })
    .await;
    assert_eq!(down["mode"], "redis_down", "{down}");
    let after = a.metrics_text().await;
    assert!(
        pings(&after) >= pings(&before) + 2.0,
        "the instance PINGed (else this test proves nothing)"
    );
    assert_eq!(
        errors(&after),
        errors(&before),
        "health PINGs counted as the serving path's errors"
    );
    link.open();
}

/// One partition, {instance A + Redis} | {Postgres + instance B}: A can no
/// longer renew its membership, so its gate closes with its lease; B no
/// longer reaches Redis and, past the member timeout, no longer counts A.
/// Before the gate's lease held while Postgres failed, B turned the fleet
/// `redis_down` and every raced token had two winners. Then, with the
/// lease (found by the chaos test): the tokens A decided within its lease,
/// recorded only in Redis's journal, were consumed again by B. The fleet
/// now turns `redis_down` only when it can account for every member that
/// last said Redis was up: during this partition neither side decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partition_never_yields_two_deciders_of_a_fast_token() {
    let redis = RedisProc::start();
    let pg_link = Link::to(suite_pg::port()).await;
    let redis_link = Link::to(redis.port).await;
    let stores = Stores::fresh()
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"1s\"\npostgres.acquire_timeout = \"500ms\"");
    let a = spawn_app_on(
        stores
            .clone()
            .redis(&redis.url())
            .postgres(&format!("postgres://postgres@127.0.0.1:{}", pg_link.port())),
    )
    .await;
    let b = spawn_app_on(
        stores
            .clone()
            .redis(&format!("redis://127.0.0.1:{}", redis_link.port())),
    )
    .await;
    let tokens = issue_likes(&a, 30).await;
    // Their issuance records are in Postgres before the partition.
    let pool = b.pg().await;
    eventually(15, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE biz_type = 'like'")
                .fetch_one(&pool)
                .await
                .ok()?;
            (n == 30).then_some(())
        }
    })
    .await;
    wait_fleet(&b, 10, "normal").await;

    // {A + Redis} | {Postgres + B}. A's lease is still valid for a moment:
    // what it decides then is recorded only in Redis's journal, which B
    // cannot reach.
    pg_link.cut();
    redis_link.cut();
    let (early, rest) = tokens.split_at(10);
    let mut answers = Vec::new();
    let mut a_won = Vec::new();
    for t in early {
        let x = consume_on(&a, t).await;
        if consumed(&x) {
            a_won.push(t.clone());
        }
        answers.push(x);
    }
    assert!(
        !a_won.is_empty(),
        "A decided nothing within its lease: {answers:?}"
    );
    // Past A's member timeout, B no longer counts A as a member; but A's
    // last report said Redis was up and nobody who reaches Redis has seen
    // the journal empty since: the fleet cannot account for A's decisions
    // and must not let Postgres decide.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut both = 0;
    for t in tokens.iter() {
        let (x, y) = tokio::join!(consume_on(&a, t), consume_on(&b, t));
        if consumed(&y) && a_won.contains(t) {
            both += 1;
        }
        if consumed(&x) && consumed(&y) {
            both += 1;
        }
        answers.push(x);
        answers.push(y);
    }
    assert_200_or_503(&answers);
    assert_eq!(both, 0, "tokens consumed on both sides of the partition");
    assert_eq!(readyz(&b).await["fleet"]["state"], "normal");

    // Healed: every token is consumed exactly once, A's early winners
    // answer `duplicate` to anyone else.
    pg_link.open();
    redis_link.open();
    wait_fleet(&b, 20, "normal").await;
    let b = &b;
    for t in &a_won {
        let y = eventually(20, || async move {
            let y = consume_on(b, t).await;
            (y.0 == StatusCode::OK).then_some(y)
        })
        .await;
        assert_eq!(y.1.as_deref(), Some("duplicate"), "{t}");
    }
    for t in rest {
        let y = eventually(20, || async move {
            let y = consume_on(b, t).await;
            (y.0 == StatusCode::OK).then_some(y)
        })
        .await;
        assert!(y.1.is_some(), "{y:?}");
    }
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

/// Found by the chaos test: an instance whose view still said `redis_down`
/// after a peer had ended the episode recorded a fast result in Postgres
/// unfenced. A consume Redis had decided since (its journal entry not yet
/// in Postgres) was unknown there, and the winner's result was answered 409
/// `not_consumed`. The result is now decided by Postgres only under the
/// fleet row's fence at that epoch; past it, Redis decides (here it cannot
/// be reached from B: 503, retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_result_on_an_instance_that_has_not_seen_the_episode_end_never_denies_a_winner() {
    let redis = RedisProc::start();
    let a_pg = Link::to(suite_pg::port()).await;
    let b_redis = Link::to(redis.port).await;
    let stores = Stores::fresh()
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"1s\"\npostgres.acquire_timeout = \"500ms\"");
    let a = spawn_app_on(
        stores
            .clone()
            .redis(&redis.url())
            .postgres(&format!("postgres://postgres@127.0.0.1:{}", a_pg.port())),
    )
    .await;
    // B reports every 5 s (and at once when its view of Redis changes).
    let b = spawn_app_on(
        stores
            .clone()
            .redis(&format!("redis://127.0.0.1:{}", b_redis.port()))
            .with("fleet.heartbeat = \"5s\"\nfleet.lease = \"10s\""),
    )
    .await;
    let tokens = issue_likes(&a, 1).await;
    wait_fleet(&a, 10, "normal").await;

    // The whole fleet loses Redis: both report it down, the fleet agrees.
    redis.pause();
    wait_fleet(&a, 15, "redis_down").await;
    wait_fleet(&b, 15, "redis_down").await;
    // B stays cut off; A sees Redis again and ends the episode. B's view
    // says `redis_down` until its next report.
    b_redis.cut();
    redis.resume();
    wait_fleet(&a, 15, "normal").await;
    eventually(10, || async {
        (readyz(&a).await["fleet"]["redis_decides_here"] == true).then_some(())
    })
    .await;
    assert_eq!(
        readyz(&b).await["fleet"]["state"],
        "redis_down",
        "B reported since the episode ended: the test lost its window"
    );

    // A decides a consume in Redis; its journal entry cannot reach
    // Postgres (A's link stalled, B cannot reach Redis to drain it).
    a_pg.stall();
    let t = &tokens[0];
    let won = consume_as(&a, t, "winner").await;
    assert!(consumed(&won), "{won:?}");
    let r = b
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{t}/result"),
            &json!({"subject": "fan", "result": {"ok": true}, "request_id": "winner"}),
        )
        .await;
    let (status, _, body) = answer(r).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
        "{body}"
    );

    // Healed, the winner's result is recorded.
    a_pg.open();
    b_redis.open();
    eventually(20, || async {
        let r = b
            .post(
                PAYMENTS,
                &format!("/v1/tokens/{t}/result"),
                &json!({"subject": "fan", "result": {"ok": true}, "request_id": "winner"}),
            )
            .await;
        let (status, _, body) = answer(r).await;
        (status == StatusCode::OK).then_some(body)
    })
    .await;
}

/// An instance on its own Redis and Postgres, quick to see either down,
/// whose Redis keeps deciding through a Postgres outage
/// (`fleet.decide_without_postgres`).
fn through_postgres_outages(redis: &RedisProc, pg: &PgProc) -> Stores {
    Stores::fresh()
        .redis(&redis.url())
        .postgres(&pg.base())
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"1s\"\npostgres.acquire_timeout = \"500ms\"")
        .with("fleet.decide_without_postgres = true")
}

/// Issue 24, item 3: a Postgres outage, then a Redis outage. With
/// `fleet.decide_without_postgres`, Redis decides fast consumes through a
/// Postgres outage and their journal entries wait in Redis. Before going
/// down, the instance wrote to Postgres only its decisions of the last
/// 30 s: after a longer Postgres outage, Redis lost before the journal
/// drained, the fleet decided those tokens again in Postgres. The going-down
/// flush now covers every decision not seen to reach Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_older_than_a_long_postgres_outage_are_flushed_before_redis_is_reported_down() {
    let redis = RedisProc::start();
    let pg = PgProc::start();
    let app = &spawn_app_on(through_postgres_outages(&redis, &pg)).await;
    let tokens = issue_likes(app, 10).await;
    wait_fleet(app, 10, "normal").await;

    // Postgres down: Redis decides, the journal waits.
    pg.stop_immediate();
    for (i, t) in tokens.iter().enumerate() {
        let x = eventually(10, || async move {
            let x = consume_as(app, t, &format!("first-{i}")).await;
            (x.0 == StatusCode::OK).then_some(x)
        })
        .await;
        assert!(consumed(&x), "{x:?}");
    }
    // Longer than the old flush's window; then Redis goes before
    // Postgres is back, so the journal cannot drain.
    tokio::time::sleep(Duration::from_secs(32)).await;
    redis.pause();
    tokio::task::block_in_place(|| pg.start_again());
    wait_fleet(app, 20, "redis_down").await;

    for (i, t) in tokens.iter().enumerate() {
        let x = eventually(10, || async move {
            let x = consume_as(app, t, &format!("second-{i}")).await;
            (x.0 == StatusCode::OK).then_some(x)
        })
        .await;
        assert_eq!(x.1.as_deref(), Some("duplicate"), "{t}: decided again");
    }
    redis.resume();
}

/// Found by the chaos test: results (and releases) of fast types went to
/// Redis without the gate that consumes pass. An instance that had reported
/// Redis down and then lost Postgres never heard that the fleet turned
/// `redis_down`; when it reached Redis again, it recorded a winner's result
/// there, where the token was still `issued` (Postgres had decided the
/// consume), and answered the winner 409 `not_consumed`. Results and
/// releases now pass the same gate: closed here, so 503 (retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_result_on_an_instance_whose_gate_is_closed_never_goes_to_redis() {
    let redis = RedisProc::start();
    let a_redis = Link::to(redis.port).await;
    let b_redis = Link::to(redis.port).await;
    let b_pg = Link::to(suite_pg::port()).await;
    let stores = Stores::fresh()
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"1s\"\npostgres.acquire_timeout = \"500ms\"");
    let a = &spawn_app_on(
        stores
            .clone()
            .redis(&format!("redis://127.0.0.1:{}", a_redis.port())),
    )
    .await;
    let b = &spawn_app_on(
        stores
            .clone()
            .redis(&format!("redis://127.0.0.1:{}", b_redis.port()))
            .postgres(&format!("postgres://postgres@127.0.0.1:{}", b_pg.port())),
    )
    .await;
    let t = &issue_likes(a, 1).await[0];
    wait_fleet(b, 10, "normal").await;

    // B loses Redis and reports it down (the fleet stays normal: A has
    // it), then loses Postgres: it hears of nothing after.
    b_redis.cut();
    eventually(10, || async {
        let v = readyz(b).await;
        (v["fleet"]["redis_down_members"] == 1 && v["fleet"]["state"] == "normal").then_some(())
    })
    .await;
    b_pg.stall();
    // A loses Redis too: the fleet turns `redis_down`, Postgres decides.
    a_redis.cut();
    wait_fleet(a, 15, "redis_down").await;
    let won = eventually(10, || async {
        let x = consume_as(a, t, "winner").await;
        (x.0 == StatusCode::OK).then_some(x)
    })
    .await;
    assert!(consumed(&won), "{won:?}");

    // B reaches Redis again, where the token is still `issued`.
    b_redis.open();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let r = b
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{t}/result"),
            &json!({"subject": "fan", "result": {"ok": true}, "request_id": "winner"}),
        )
        .await;
    let (status, _, body) = answer(r).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
        "{body}"
    );
    b_pg.open();
    a_redis.open();
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

/// A fast client key's consume and a fast token's were two implementations,
/// and only the token's passed the fleet's gate: a key Redis decided was
/// not recorded for the going-down flush. With Postgres down (and
/// `fleet.decide_without_postgres`), a key Redis decides waits in the
/// journal; when Redis is then lost before the journal drains, only the
/// flush tells Postgres. Without it, Postgres still held the key released,
/// and the next consume created it again in the new Redis and won: two
/// winners of one key. One consume now serves tokens and keys, so the key's
/// decision goes through the gate and is flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fast_key_decided_in_redis_is_flushed_before_redis_is_reported_down() {
    let mut redis = RedisProc::start();
    let pg = PgProc::start();
    let app = &spawn_app_on(through_postgres_outages(&redis, &pg)).await;
    wait_fleet(app, 10, "normal").await;
    let key = "order-7-refund";
    let consume = |rid: &'static str| async move {
        let body = json!({"biz_type": "like", "key": key, "request_id": rid});
        let (s, _, body) = answer(app.post(PAYMENTS, "/v1/keys/consume", &body).await).await;
        let said = body["outcome"].as_str().or(body["error"].as_str());
        (s, said.map(str::to_owned))
    };
    let in_postgres = |state: &'static str| async move {
        let s: String = sqlx::query_scalar("SELECT state::text FROM tokens WHERE key = $1")
            .bind(key)
            .fetch_optional(&app.pg().await)
            .await
            .ok()??;
        (s == state).then_some(())
    };

    // Consumed and released, both in Postgres: Redis holds it issued.
    assert!(consumed(&consume("first").await));
    let (s, _, body) = answer(
        app.post(
            PAYMENTS,
            "/v1/keys/release",
            &json!({"biz_type": "like", "key": key, "request_id": "first"}),
        )
        .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    eventually(15, || in_postgres("issued")).await;

    // Postgres down: Redis decides the key, its journal entry waits.
    pg.stop_immediate();
    let won = eventually(10, || async {
        let x = consume("second").await;
        (x.0 == StatusCode::OK).then_some(x)
    })
    .await;
    assert!(consumed(&won), "{won:?}");
    // Redis is lost with the journal; Postgres comes back.
    redis.kill();
    tokio::task::block_in_place(|| pg.start_again());
    wait_fleet(app, 20, "redis_down").await;
    // A new, empty Redis.
    tokio::task::block_in_place(|| redis.restart());
    wait_fleet(app, 20, "normal").await;

    let again = eventually(10, || async {
        let x = consume("third").await;
        (x.0 == StatusCode::OK).then_some(x)
    })
    .await;
    assert_eq!(
        again.1.as_deref(),
        Some("duplicate"),
        "decided again: {again:?}"
    );
}
