//! The fleet's agreement on Redis when one instance's link to it fails
//! (`crate::fleet`; the link through a proxy the test stalls, slows or
//! cuts): a stalled or cut instance never decides fast consumes without
//! Redis while the others use it; calls that time out on a slow link are
//! slowness, not Redis down, and an idle instance's failed health pings are
//! evidence but not serving errors; a partition {instance + Redis} |
//! {Postgres + instance} never yields two deciders.
//! Every test counts, per fast token, how many answers said `consumed`
//! across the instances: never more than one.

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use reqwest::StatusCode;

use crate::helpers::fleet_answers::*;
use crate::helpers::link::Link;
use crate::helpers::procs::*;
use crate::helpers::*;

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
