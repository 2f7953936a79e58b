//! A Redis marker or write-back older than the token's generation never
//! wins: a consumed marker restored after a release gives way on reconcile
//! (and the old winner's retry is decided by Postgres), no marker outlives
//! the retention, a late write-back or a queued resync of an old winner is
//! refused, a reseed racing a fast consume never lets a second consume win;
//! and once `result` answered 200, every duplicate on every instance answers
//! `completed` (read your writes), even when its write to Redis failed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use chrono::DateTime;
use idempotency_ledger::fast::Marker;
use redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::calls::{consume, metric, reconcile, release};
use crate::helpers::procs::RedisProc;
use crate::helpers::tiers::fast_tier;
use crate::helpers::*;

async fn redis_state(app: &TestApp, token: &str) -> Option<String> {
    let mut r = app.redis().await;
    r.hget(app.token_key(token), "s").await.expect("hget")
}

/// A durable token consumed, released, and then its consumed marker back in
/// Redis (a failover to a replica that still held it: DUMP before the
/// release, RESTORE after). Reconcile finds it (`redis_consumed_but_live`),
/// the marker gives way to Postgres's issued state, a new consume wins, and a
/// second run finds nothing.
#[tokio::test]
async fn a_consumed_marker_restored_after_a_release_gives_way_on_reconcile() {
    let app = spawn_app().await;
    let mut r = app.redis().await;
    let token = app.issue(PAYMENTS, "order", "u-1").await;
    let key = app.token_key(&token);
    let (status, _, _) = consume(&app, &token, json!({"subject": "u-1", "request_id": "R1"})).await;
    assert_eq!(status, StatusCode::OK);
    wait_redis_state(&r, &key, "c", 5).await;
    let dump: Vec<u8> = redis::cmd("DUMP")
        .arg(&key)
        .query_async(&mut r)
        .await
        .expect("dump");
    let released = app
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{token}/release"),
            &json!({"subject": "u-1"}),
        )
        .await;
    assert_eq!(released.status(), StatusCode::OK);
    wait_redis_state(&r, &key, "i", 5).await;
    let _: () = redis::cmd("RESTORE")
        .arg(&key)
        .arg(60_000)
        .arg(dump)
        .arg("REPLACE")
        .query_async(&mut r)
        .await
        .expect("restore");
    assert_eq!(redis_state(&app, &token).await.as_deref(), Some("c"));

    let report = reconcile(&app).await;
    assert_eq!(report["found"]["redis_consumed_but_live"], 1, "{report}");
    assert_eq!(report["repaired"]["redis_consumed_but_live"], 1, "{report}");
    assert_eq!(redis_state(&app, &token).await.as_deref(), Some("i"));

    let (status, replayed, body) =
        consume(&app, &token, json!({"subject": "u-1", "request_id": "R2"})).await;
    assert_eq!(
        (status, replayed, body["outcome"].as_str()),
        (StatusCode::OK, false, Some("consumed")),
        "{body}"
    );
    wait_redis_state(&r, &key, "c", 5).await;
    let report = reconcile(&app).await;
    assert_eq!(report["found"]["redis_consumed_but_live"], 0, "{report}");
    app.stop().await;
}

/// With `tokens.retention = "4s"`, a consumed token past its expiry and the
/// retention answers `token_expired` once reconcile purged its record: its
/// Redis marker is gone by then (durable and fast alike).
#[tokio::test]
async fn no_redis_marker_outlives_the_retention() {
    let app = spawn_app_on(Stores::fresh().with("tokens.retention = \"4s\"")).await;
    let pg = app.pg().await;
    let mut tokens = Vec::new();
    for biz in ["order", "like"] {
        let r = app
            .post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": biz, "subject": "u-1", "ttl_seconds": 1}),
            )
            .await;
        let (status, _, body) = answer(r).await;
        assert_eq!(status, StatusCode::CREATED);
        let token = body["token"].as_str().expect("token").to_owned();
        let (status, _, body) = consume(&app, &token, json!({"subject": "u-1"})).await;
        assert_eq!(body["outcome"], "consumed", "{status} {body}");
        tokens.push(token);
    }
    // Reconcile until it purged both records (consumed 4 s ago, expired).
    eventually(30, || async {
        reconcile(&app).await;
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE token = ANY($1)")
            .bind(&tokens)
            .fetch_one(&pg)
            .await
            .expect("count");
        (left == 0).then_some(())
    })
    .await;
    let r = app.redis().await;
    for token in &tokens {
        // The marker lives `redis.consumed_ttl` from its consume, held to the
        // retention: it is gone (or going) by the purge.
        let key = app.token_key(token);
        eventually(3, || {
            let mut r = r.clone();
            let key = key.clone();
            async move {
                let n: i64 = r.exists(&key).await.expect("exists");
                (n == 0).then_some(())
            }
        })
        .await;
        let (status, _, body) = consume(&app, token, json!({"subject": "u-1"})).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_expired")),
            "{token}: {body}"
        );
    }
    app.stop().await;
}

/// A TCP proxy in front of a private Redis: `cut` closes every connection
/// through it and refuses new ones, so that one instance loses Redis while
/// another, connected directly, keeps it.
struct Proxy {
    port: u16,
    open: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("proxy port");
        let port = listener.local_addr().expect("addr").port();
        let open = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (open, conns) = (open.clone(), conns.clone());
            tokio::spawn(async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    if !open.load(Ordering::SeqCst) {
                        continue; // dropped: closed at once
                    }
                    let task = tokio::spawn(async move {
                        if let Ok(mut out) =
                            tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                        {
                            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                        }
                    });
                    conns.lock().expect("conns").push(task);
                }
            })
        };
        Proxy {
            port,
            open,
            conns,
            accept,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for task in self.conns.lock().expect("conns").drain(..) {
            task.abort();
        }
    }

    fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// Fast breaker and Redis timeout, for the tests that cut Redis.
const QUICK: &str = r#"
redis.timeout = "300ms"
redis.down_backoff = "300ms"
"#;

/// The number in a metric line of `/metrics` (0 when absent).
async fn gauge(app: &TestApp, line_prefix: &str) -> f64 {
    metric(app, line_prefix).await
}

async fn redis_gen(r: &redis::aio::MultiplexedConnection, key: &str) -> Option<i64> {
    let mut r = r.clone();
    let g: Option<String> = r.hget(key, "g").await.expect("hget");
    g.and_then(|g| g.parse().ok())
}

/// A durable token consumed on A (R1), released on B, consumed again on A
/// (R3); then R1's consume's write-back arrives late. It is refused (an
/// older generation): duplicates answer from R3's consume, R3's retry is
/// told `consumed`, R1's is not.
#[tokio::test]
async fn durable_consume_release_consume_over_instances_with_a_late_write_back() {
    let stores = Stores::fresh();
    let a = spawn_app_on(stores.clone()).await;
    let b = spawn_app_on(stores.clone()).await;
    let r = a.redis().await;
    let token = a.issue(PAYMENTS, "order", "u-1").await;
    let key = a.token_key(&token);
    let first = json!({"subject": "u-1", "request_id": "R1", "fingerprint": "f1"});
    let (s, _, body) = consume(&a, &token, first.clone()).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let first_at = body["consumed_at"].as_str().expect("at").to_owned();
    wait_redis_state(&r, &key, "c", 5).await;
    assert_eq!(release(&b, &token, "u-1").await, StatusCode::OK);
    eventually(5, || async {
        (redis_gen(&r, &key).await == Some(2)).then_some(())
    })
    .await;
    let third = json!({"subject": "u-1", "request_id": "R3", "fingerprint": "f3"});
    let (s, _, body) = consume(&a, &token, third.clone()).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    eventually(5, || async {
        (redis_gen(&r, &key).await == Some(3)).then_some(())
    })
    .await;

    // R1's write-back, late.
    let at = DateTime::parse_from_rfc3339(&first_at)
        .expect("time")
        .timestamp_millis();
    let late = fast_tier(&stores)
        .0
        .write_consumed(
            &token,
            1,
            &Marker {
                at_ms: at,
                request_id: Some("R1".into()),
                fingerprint: Some("f1".into()),
                result: None,
            },
        )
        .await
        .expect("write");
    assert!(!late, "an older generation is refused");
    let mut rc = r.clone();
    let rid: Option<String> = rc.hget(&key, "rid").await.expect("hget");
    assert_eq!(rid.as_deref(), Some("R3"));

    for app in [&a, &b] {
        let (s, replayed, body) = consume(app, &token, third.clone()).await;
        assert_eq!(
            (s, replayed, body["outcome"].as_str()),
            (StatusCode::OK, true, Some("consumed")),
            "{body}"
        );
        let (s, _, body) =
            consume(app, &token, json!({"subject": "u-1", "fingerprint": "f3"})).await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate"))
        );
        let (s, _, body) = consume(app, &token, first.clone()).await;
        assert_eq!(
            (s, body["error"].as_str()),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                Some("fingerprint_mismatch")
            ),
            "R1 is no longer the winner: {body}"
        );
    }
    a.stop().await;
    b.stop().await;
}

/// Reconcile re-seeds a token it read as issued while a fast consume that
/// Postgres decided was on its way to Redis; the consume's write-back lands
/// after the seed. It still applies (a newer generation than the seed's),
/// so a second consume is a duplicate, not a second win in Redis.
#[tokio::test]
async fn a_reseed_racing_a_fast_consume_never_lets_a_second_consume_win() {
    let app = spawn_app().await;
    let r = app.redis().await;
    let fast = fast_tier(&app.stores).0;
    let token = app.issue(PAYMENTS, "like", "u-1").await;
    let key = app.token_key(&token);
    // Redis lost the key: the consume goes to Postgres, which decides.
    let mut rc = r.clone();
    let _: () = rc.del(&key).await.expect("del");
    let (s, _, body) = consume(&app, &token, json!({"subject": "u-1", "request_id": "R1"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    wait_redis_state(&r, &key, "c", 5).await;
    // The race, in its worst order: reconcile's seed (at the generation it
    // read, 0) lands first, then the consume's write-back (generation 1).
    let _: () = rc.del(&key).await.expect("del");
    assert!(fast.reseed(&token, 60_000, 0).await.expect("reseed"));
    let at = DateTime::parse_from_rfc3339(body["consumed_at"].as_str().expect("at"))
        .expect("time")
        .timestamp_millis();
    let marker = Marker {
        at_ms: at,
        request_id: Some("R1".into()),
        fingerprint: None,
        result: None,
    };
    assert!(fast
        .write_consumed(&token, 1, &marker)
        .await
        .expect("write back"));
    assert_eq!(redis_state(&app, &token).await.as_deref(), Some("c"));
    let (s, _, body) = consume(&app, &token, json!({"subject": "u-1"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate")),
        "{body}"
    );
    // The other order: the write-back first, then the seed, which never
    // overwrites a key.
    assert!(!fast.reseed(&token, 60_000, 0).await.expect("reseed"));
    assert_eq!(redis_state(&app, &token).await.as_deref(), Some("c"));
    app.stop().await;
}

/// Instance A consumes a durable token while it cannot reach Redis (the
/// write-back waits in its queue); B releases the token. When A reaches Redis
/// again its queued write-back (an older generation) is refused: the token
/// stays released and B's next consume wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resync_after_a_release_never_writes_the_old_winner_back() {
    let redis = RedisProc::start();
    let proxy = Proxy::start(redis.port).await;
    let stores = Stores::fresh().with(QUICK);
    let a = spawn_app_on(stores.clone().redis(&proxy.url())).await;
    let b = spawn_app_on(stores.clone().redis(&redis.url())).await;
    let r = redis.conn().await;
    let token = b.issue(PAYMENTS, "order", "u-1").await;
    let key = b.token_key(&token);
    proxy.cut();
    let (s, _, body) = consume(&a, &token, json!({"subject": "u-1", "request_id": "R1"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{body}"
    );
    // A's write-back of R1's consume waits for Redis.
    eventually(10, || async {
        (gauge(&a, "ledger_redis_resync_depth").await >= 1.0).then_some(())
    })
    .await;
    assert_eq!(release(&b, &token, "u-1").await, StatusCode::OK);
    eventually(5, || async {
        (redis_gen(&r, &key).await == Some(2)).then_some(())
    })
    .await;

    proxy.restore();
    eventually(15, || async {
        let drained = gauge(&a, "ledger_redis_resync_depth").await == 0.0;
        (drained && a.ledger.mode().as_str() == "normal").then_some(())
    })
    .await;
    assert_eq!(redis_gen(&r, &key).await, Some(2), "still released");
    let (s, replayed, body) =
        consume(&b, &token, json!({"subject": "u-1", "request_id": "R2"})).await;
    assert_eq!(
        (s, replayed, body["outcome"].as_str()),
        (StatusCode::OK, false, Some("consumed")),
        "{body}"
    );
    a.stop().await;
    b.stop().await;
}

/// After a release and a stale consumed marker restored in Redis (as in
/// the failover above), the old winner's retry is not told `consumed` by
/// Redis alone: Postgres, which holds the token issued, decides, and that
/// retry becomes a new consume recorded in Postgres.
#[tokio::test]
async fn the_winners_retry_under_a_stale_marker_is_confirmed_by_postgres() {
    let app = spawn_app().await;
    let mut r = app.redis().await;
    let token = app.issue(PAYMENTS, "order", "u-1").await;
    let key = app.token_key(&token);
    let r1 = json!({"subject": "u-1", "request_id": "R1"});
    let (s, _, _) = consume(&app, &token, r1.clone()).await;
    assert_eq!(s, StatusCode::OK);
    wait_redis_state(&r, &key, "c", 5).await;
    let dump: Vec<u8> = redis::cmd("DUMP")
        .arg(&key)
        .query_async(&mut r)
        .await
        .expect("dump");
    assert_eq!(release(&app, &token, "u-1").await, StatusCode::OK);
    wait_redis_state(&r, &key, "i", 5).await;
    let _: () = redis::cmd("RESTORE")
        .arg(&key)
        .arg(60_000)
        .arg(dump)
        .arg("REPLACE")
        .query_async(&mut r)
        .await
        .expect("restore");

    let (s, replayed, body) = consume(&app, &token, r1).await;
    assert_eq!(
        (s, replayed, body["outcome"].as_str()),
        (StatusCode::OK, false, Some("consumed")),
        "a new consume, not a replay: {body}"
    );
    let pg = app.pg().await;
    let state: String = sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
        .bind(&token)
        .fetch_one(&pg)
        .await
        .expect("row");
    assert_eq!(state, "consumed", "Postgres recorded it");
    let (s, _, body) = consume(&app, &token, json!({"subject": "u-1", "request_id": "R2"})).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate"))
    );
    app.stop().await;
}

/// Once `result` answered 200, every later duplicate answers `completed`
/// with it, on every instance: right after the answer, and when the write
/// of the result to Redis failed on the instance that recorded it (its
/// Redis cut off; the other instance still reads the marker without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_right_after_a_result_answers_completed() {
    let redis = RedisProc::start();
    let proxy = Proxy::start(redis.port).await;
    let stores = Stores::fresh().with(QUICK);
    let a = spawn_app_on(stores.clone().redis(&proxy.url())).await;
    let b = spawn_app_on(stores.clone().redis(&redis.url())).await;
    let r = redis.conn().await;

    for (round, cut) in [(0, false), (1, true)] {
        let subject = format!("u-{round}");
        let token = b.issue(PAYMENTS, "order", &subject).await;
        let key = b.token_key(&token);
        let (s, _, _) = consume(&b, &token, json!({"subject": subject, "request_id": "R1"})).await;
        assert_eq!(s, StatusCode::OK);
        wait_redis_state(&r, &key, "c", 5).await;
        if cut {
            proxy.cut();
        }
        let result = json!({"paid": round});
        let recorded = a
            .post(
                PAYMENTS,
                &format!("/v1/tokens/{token}/result"),
                &json!({"subject": subject, "result": result}),
            )
            .await;
        assert_eq!(recorded.status(), StatusCode::OK, "round {round}");
        for app in [&b, &a] {
            let (s, _, body) = consume(app, &token, json!({"subject": subject})).await;
            assert_eq!(
                (s, body["outcome"].as_str(), body["status"].as_str()),
                (StatusCode::OK, Some("duplicate"), Some("completed")),
                "round {round}: {body}"
            );
            assert_eq!(body["result"], result);
        }
        if cut {
            proxy.restore();
            // The queued write reaches Redis once A does.
            eventually(15, || async {
                let mut r = r.clone();
                let res: Option<String> = r.hget(&key, "res").await.ok()?;
                res.is_some().then_some(())
            })
            .await;
        }
    }
    a.stop().await;
    b.stop().await;
}
