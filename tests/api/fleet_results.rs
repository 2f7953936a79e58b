//! Fast results around an episode of Redis down (`crate::fleet`): recorded
//! while the fleet has Redis down, a result is decided in Postgres; on an
//! instance that has not seen the episode end, it never denies a winner; on
//! an instance whose gate is closed, it never goes to Redis.
//! Every test counts, per fast token, how many answers said `consumed`
//! across the instances: never more than one.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::fleet_answers::*;
use crate::helpers::link::Link;
use crate::helpers::procs::*;
use crate::helpers::*;

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
