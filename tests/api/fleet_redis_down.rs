//! Redis down for the whole fleet (`crate::fleet`): the fleet agrees and
//! Postgres decides fast consumes, and when Redis is back what Postgres
//! decided reaches it first; with both tiers down, fast consumes answer 503
//! unless the memory fallback is set; before Redis is reported down, every
//! decision Redis made that is not seen in Postgres is flushed there (after
//! a long Postgres outage, and for client keys too).
//! Every test counts, per fast token, how many answers said `consumed`
//! across the instances: never more than one.

use std::time::Duration;

use futures_util::stream::{self, StreamExt};
use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::fleet_answers::*;
use crate::helpers::procs::*;
use crate::helpers::scrape::sample;
use crate::helpers::*;

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

/// Redis restarts empty so quickly that the fleet never agrees it was down.
/// Its journal held a decision Postgres lacked (Postgres was down, with
/// `fleet.decide_without_postgres`). The instance read the new, empty
/// stream's length as 0, counted the journal as drained and dropped that
/// decision from its going-down flush; the token then missed in Redis,
/// Postgres held it live, and a second caller was told `consumed`. Now the
/// fleet's dataset id is in Redis: the empty Redis is foreign, decides
/// nothing and is reported down; the decision is flushed to Postgres before
/// Postgres decides, and the episode's end writes the id back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restarted_empty_decides_nothing_until_the_fleet_has_its_lost_decisions() {
    let mut redis = RedisProc::start();
    let pg = PgProc::start();
    let app = &spawn_app_on(through_postgres_outages(&redis, &pg)).await;
    let tokens = issue_likes(app, 3).await;
    wait_fleet(app, 10, "normal").await;

    // Postgres down: Redis decides, the journal waits in Redis.
    pg.stop_immediate();
    let won = eventually(10, || async {
        let x = consume_as(app, &tokens[0], "first").await;
        (x.0 == StatusCode::OK).then_some(x)
    })
    .await;
    assert!(consumed(&won), "{won:?}");

    // Redis restarts empty, and answers again at once.
    tokio::task::block_in_place(|| redis.restart());
    eventually(10, || async {
        let text = app.metrics_text().await;
        (sample(&text, "ledger_fleet_redis_foreign", &[]) == Some(1.0)).then_some(())
    })
    .await;
    // Several heartbeats on the empty Redis before Postgres is back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let meanwhile = consume_as(app, &tokens[1], "meanwhile").await;
    assert_eq!(
        meanwhile.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "decided on a foreign redis: {meanwhile:?}"
    );
    tokio::task::block_in_place(|| pg.start_again());

    let again = eventually(20, || async {
        let x = consume_as(app, &tokens[0], "second").await;
        (x.0 == StatusCode::OK).then_some(x)
    })
    .await;
    assert_eq!(
        again.1.as_deref(),
        Some("duplicate"),
        "decided again: {again:?}"
    );
    // The episode ends on the new Redis, which decides again.
    wait_fleet(app, 20, "normal").await;
    let fresh = eventually(10, || async {
        let x = consume_as(app, &tokens[2], "fresh").await;
        (x.0 == StatusCode::OK).then_some(x)
    })
    .await;
    assert!(consumed(&fresh), "{fresh:?}");
    let text = app.metrics_text().await;
    assert_eq!(sample(&text, "ledger_fleet_redis_foreign", &[]), Some(0.0));
}

/// A member fell silent after saying Redis was up (it crashed), and Redis
/// restarted empty before any member saw the journal empty: the decisions
/// it let Redis make may be lost with Redis, and no member can account for
/// them. The fleet neither decides on the new Redis nor turns `redis_down`
/// (fast consumes answer 503), until an operator accepts the loss with
/// `fleet forget-silent --accept-lost-decisions`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_lost_with_redis_is_waited_for_until_an_operator_forgets_it() {
    let mut redis = RedisProc::start();
    let pg = PgProc::start();
    let app = &spawn_app_on(through_postgres_outages(&redis, &pg)).await;
    let tokens = issue_likes(app, 2).await;
    wait_fleet(app, 10, "normal").await;

    // A member that said Redis was up, then crashed; Redis restarts empty
    // before the fleet could retire it.
    let crashed = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO fleet_members (instance, redis_up, seen_at) VALUES ($1, true, now())")
        .bind(crashed)
        .execute(&app.pg().await)
        .await
        .expect("a member");
    tokio::task::block_in_place(|| redis.restart());
    eventually(10, || async {
        let text = app.metrics_text().await;
        let unaccounted = sample(&text, "ledger_fleet_unaccounted_members", &[]);
        let foreign = sample(&text, "ledger_fleet_redis_foreign", &[]);
        (unaccounted == Some(1.0) && foreign == Some(1.0)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(readyz(app).await["fleet"]["state"], "normal");
    let waiting = consume_as(app, &tokens[0], "waiting").await;
    assert_eq!(waiting.0, StatusCode::SERVICE_UNAVAILABLE, "{waiting:?}");

    let config = cli_config(&app.stores);
    let refused = cli(&config, &["fleet", "forget-silent"]).await;
    assert_eq!(refused.status.code(), Some(2), "the flag is required");
    let out = cli(
        &config,
        &[
            "fleet",
            "forget-silent",
            "--accept-lost-decisions",
            "--reason",
            "INC-7: redis lost with member",
        ],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        said["forgotten"][0]["instance"],
        crashed.to_string(),
        "{said}"
    );
    // The auditors' trail says who forgot which member, and why.
    let (status, _, audit) =
        answer(app.get(ADMIN, "/v1/admin/audit?kind=fleet.forgotten").await).await;
    assert_eq!(status, StatusCode::OK, "{audit}");
    let events = audit["events"].as_array().expect("events");
    assert_eq!(events.len(), 1, "{audit}");
    let detail = &events[0]["detail"];
    assert_eq!(detail["instance"], crashed.to_string(), "{audit}");
    assert_eq!(detail["reason"], "INC-7: redis lost with member", "{audit}");
    assert_eq!(detail["by"], "cli", "{audit}");
    assert_eq!(detail["accepted"], "lost_decisions", "{audit}");
    let bad = cli(
        &config,
        &[
            "fleet",
            "forget-silent",
            "--accept-lost-decisions",
            "--reason",
            " ",
        ],
    )
    .await;
    assert_eq!(bad.status.code(), Some(2), "a blank reason is refused");

    // The fleet goes through an episode and Redis decides again.
    eventually(20, || async {
        let text = app.metrics_text().await;
        let to = |s: &str| sample(&text, "ledger_fleet_transitions_total", &[("to", s)]);
        let foreign = sample(&text, "ledger_fleet_redis_foreign", &[]);
        (to("redis_down") >= Some(1.0) && to("normal") >= Some(1.0) && foreign == Some(0.0))
            .then_some(())
    })
    .await;
    let decided = eventually(20, || async {
        let x = consume_as(app, &tokens[1], "after").await;
        (x.0 == StatusCode::OK).then_some(x)
    })
    .await;
    assert!(consumed(&decided), "{decided:?}");
}

/// A member fell silent after saying Redis was up (it crashed), while the
/// journal is never empty: under steady fast traffic there is always an
/// entry on its way to Postgres. Its decisions are in Postgres once every
/// entry the journal held after its lease ran out has gone, which happens
/// within a drainer's round or a claim; waiting to see the stream empty
/// instead kept it unaccounted for, so that a Redis restart then stopped
/// the fleet for an operator though nothing was lost. Here the journal is
/// kept from emptying by entries a dead consumer holds (each claimed by a
/// live drainer after 30 s), one added every 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_member_is_retired_though_the_journal_is_never_empty() {
    let app = &spawn_app().await;
    wait_fleet(app, 10, "normal").await;
    let journal = format!("{}journal", app.stores.prefix);
    let mut redis = redis::Client::open(app.stores.redis_url.as_str())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    // An entry only a dead consumer has read: it stays until a live
    // drainer claims it (idle 30 s).
    let mut ghosts = 0;
    let mut ghost = |redis: &mut redis::aio::MultiplexedConnection| {
        ghosts += 1;
        let (journal, n) = (journal.clone(), ghosts);
        let mut redis = redis.clone();
        async move {
            let _: (String, redis::Value) = redis::pipe()
                .atomic()
                .cmd("XADD")
                .arg(&journal)
                .arg("*")
                .arg("ghost")
                .arg(n)
                .cmd("XREADGROUP")
                .arg("GROUP")
                .arg("ledger")
                .arg("ghost")
                .arg("STREAMS")
                .arg(&journal)
                .arg(">")
                .query_async(&mut redis)
                .await
                .expect("a ghost entry");
        }
    };
    ghost(&mut redis).await;
    let silent = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO fleet_members (instance, redis_up, seen_at)
         VALUES ($1, true, now() - interval '1 hour')",
    )
    .bind(silent)
    .execute(&app.pg().await)
    .await
    .expect("a silent member");

    let began = tokio::time::Instant::now();
    let mut next_ghost = began + Duration::from_secs(10);
    let mut shortest = u64::MAX;
    let retired = loop {
        let len: u64 = redis::cmd("XLEN")
            .arg(&journal)
            .query_async(&mut redis)
            .await
            .expect("XLEN");
        shortest = shortest.min(len);
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM fleet_members WHERE instance = $1")
                .bind(silent)
                .fetch_one(&app.pg().await)
                .await
                .expect("members");
        if left == 0 {
            break true;
        }
        if began.elapsed() > Duration::from_secs(75) {
            break false;
        }
        if tokio::time::Instant::now() >= next_ghost {
            ghost(&mut redis).await;
            next_ghost += Duration::from_secs(10);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        shortest >= 1,
        "the journal was seen empty: the test proves nothing"
    );
    assert!(
        retired,
        "the silent member is still waited for after 75 s of a journal never empty"
    );
    eventually(10, || async {
        let text = app.metrics_text().await;
        (sample(&text, "ledger_fleet_unaccounted_members", &[]) == Some(0.0)).then_some(())
    })
    .await;
}
