//! Forgery, isolation and abuse (DESIGN.md invariants 5 and 6): forged tokens
//! cost no Redis or Postgres round trip, the fleet shares its filter of issued
//! ids, clients reach only their own tokens, abuse is throttled, signing keys
//! rotate, inputs are bounded, and logs hold no API key and no full token.

use std::collections::HashMap;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use idempotency_ledger::token::{SnowflakeId, TokenCodec};
use reqwest::StatusCode;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::helpers::procs::{PgProc, RedisProc};
use crate::helpers::*;

const DEV_KEYS: [&str; 4] = [
    "dev-payments-key",
    "dev-refunds-key",
    "dev-reconciler-key",
    "dev-admin-key",
];
const DEV_SECRET: &str = "development-only-signing-secret-0123456789";

fn id_of(app: &TestApp, token: &str) -> SnowflakeId {
    TokenCodec::new(app.stores.settings().tokens.signing_keys.clone())
        .verify(token)
        .expect("a valid token")
        .claims
        .id
}

/// Calls per command since the server started (`INFO commandstats`).
async fn redis_calls(redis: &RedisProc) -> HashMap<String, u64> {
    let mut c = redis.conn().await;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .expect("info");
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}
/// Commands of the app's background tasks and of this test's own probes
/// (connection setup, the journal poller, INFO): everything else is the
/// request path.
const BACKGROUND: &[&str] = &[
    "xreadgroup",
    "xautoclaim",
    "xgroup|create",
    "xgroup",
    "info",
    "ping",
    "config|get",
    "config",
    "client|setinfo",
    "client",
    "hello",
    "select",
];

fn request_path_delta(
    before: &HashMap<String, u64>,
    after: &HashMap<String, u64>,
) -> HashMap<String, u64> {
    after
        .iter()
        .filter(|(k, _)| !BACKGROUND.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, d)| *d > 0)
        .collect()
}

/// Postgres's counters for the test database, in one statement: operations
/// on the token tables (scans, inserted, updated and deleted rows) and
/// committed transactions.
async fn pg_counters(pool: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0) + n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint
                   FROM pg_stat_user_tables WHERE relname IN ('tokens', 'audit_events')),
                (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())",
    )
    .fetch_one(pool)
    .await
    .expect("statistics views")
}

/// A backend publishes its statistics when it goes idle, but at most once a
/// second; what it could not publish then waits for Postgres's idle-stats
/// timeout (PGSTAT_IDLE_INTERVAL, 10 s). So: read until the token-table
/// counter has not moved for 11 s. Returns the counters and how many
/// readings (transactions of our own) it took.
async fn pg_counters_quiet(pool: &sqlx::PgPool) -> ((i64, i64), i64) {
    let mut last = pg_counters(pool).await;
    let mut readings = 1;
    let mut since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(90);
    while since.elapsed() < Duration::from_secs(11) {
        assert!(
            Instant::now() < deadline,
            "postgres statistics never settled"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = pg_counters(pool).await;
        readings += 1;
        if now.0 != last.0 {
            since = Instant::now();
        }
        last = now;
    }
    (last, readings)
}

/// Forged texts of every kind, built from genuine tokens.
fn forgeries(app: &TestApp, genuine: &[String]) -> (Vec<String>, Vec<String>) {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    let alphabet: Vec<char> = ('a'..='z')
        .chain('A'..='Z')
        .chain('0'..='9')
        .chain(['-', '_'])
        .collect();
    let mut other = Vec::new();
    let mut signed = Vec::new();
    for i in 0..150 {
        // Bad tag: one character of the payload changed.
        let g = &genuine[i % genuine.len()];
        let mut chars: Vec<char> = g.chars().collect();
        let pos = chars.len() - 1 - (i % 40);
        let orig = chars[pos];
        chars[pos] = *alphabet
            .iter()
            .find(|c| **c != orig && **c != '_')
            .expect("another char");
        other.push(chars.into_iter().collect());
    }
    for i in 0..100 {
        // Swapped biz prefix: the tag covers the biz type.
        let g = &genuine[i % genuine.len()];
        let (biz, rest) = g.split_once('_').expect("prefix");
        let swapped = ["order", "refund", "like"]
            .into_iter()
            .find(|b| *b != biz)
            .expect("another biz");
        other.push(format!("{swapped}_{rest}"));
    }
    for i in 0..100 {
        let g = &genuine[i % genuine.len()];
        other.push(g[..g.len() - 1 - (i % (g.len() - 2))].to_owned());
    }
    for i in 0..150 {
        let len = 1 + (i * 7) % 128;
        other.push((0..len).map(|_| alphabet[rng.gen_range(0..64)]).collect());
    }
    for _ in 0..110 {
        let body: String = (0..50).map(|_| alphabet[rng.gen_range(0..62)]).collect();
        other.push(format!("order_dev1_{body}"));
    }
    for i in 0..20 {
        other.push("a".repeat(10_000 - i));
    }
    for s in [
        "order_dev1_ü",
        "€",
        "order_dev1_💳💳",
        "ordér_dev1_AAAA",
        "order_dev1_\u{202e}abc",
        "like_dev1_日本語",
        "order_dev1_a b",
        "order_dev1_\u{0}",
        "refund_dev1_Ω",
        "order_ⅾev1_x",
    ] {
        for i in 0..5 {
            other.push(format!("{s}{i}"));
        }
    }
    for s in [
        "order_dev1_a%2Fb",
        "%2F..%2Fadmin",
        "order_dev1_%2F%2F",
        "%2e%2e%2Fmetrics",
        "order%2Fdev1%2Fabc",
    ] {
        for i in 0..10 {
            other.push(format!("{s}{i}"));
        }
    }
    // Valid tags under the development key, never issued: ids from before
    // the app started (within the filter's horizon, past its grace) and from
    // the near future (beyond the grace), bound to the caller and subject.
    let now = now_ms();
    let exp = (now / 1000 + 600) as u32;
    for i in 0..270i64 {
        let biz = ["order", "refund", "like"][(i % 3) as usize];
        let ts = if i % 10 == 9 {
            now + 30 * 60_000 + i
        } else {
            now - 20_000 - i * 997
        };
        let id = SnowflakeId::from_parts(ts, 1000 + (i % 20) as u16, (i % 4096) as u16);
        signed.push(app.sign(biz, id.0, exp, "payments", "u"));
    }
    assert_eq!(other.len() + signed.len(), 1000);
    (other, signed)
}

/// Path segment for a forged text: percent-encoded where it must be,
/// keeping the `%2F` forms as they are.
fn path_segment(text: &str) -> String {
    if text.contains("%2") {
        return text.to_owned();
    }
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_tokens_cost_no_redis_or_postgres_round_trip() {
    let redis = RedisProc::start();
    // A private Postgres too: the transaction count below is database-wide,
    // and on the shared server transactions that are not the service's land
    // in the test's database now and then (10 to 40 in a window, seen under
    // load; on a private server the window holds only the service's lease
    // renewal and stats flush).
    let pg = PgProc::start();
    // The fleet's heartbeat commits a transaction per beat: slowed here so
    // that the count below is the forgeries' alone.
    let app = spawn_app_on(
        Stores::fresh()
            .redis(&redis.url())
            .postgres(&pg.base())
            .with("fleet.heartbeat = \"5s\"\nfleet.lease = \"30s\""),
    )
    .await;
    let mut genuine = Vec::new();
    for (biz, subject) in [("order", "u"), ("refund", "u"), ("like", "u")] {
        genuine.push(app.issue(PAYMENTS, biz, subject).await);
    }
    let pool = app.pg().await;
    let (other, signed) = forgeries(&app, &genuine);

    // Before: the issuance records written and every backend's statistics
    // published (the start-up load of the filter scanned `tokens` too).
    let (pg_before, _) = pg_counters_quiet(&pool).await;
    let redis_before = redis_calls(&redis).await;
    let started = Instant::now();

    let mut requests: Vec<(String, &'static str)> = other
        .iter()
        .chain(signed.iter())
        .map(|t| (t.clone(), "consume"))
        .collect();
    // Result and release take the same path.
    for t in signed.iter().take(50) {
        requests.push((t.clone(), "result"));
        requests.push((t.clone(), "release"));
    }
    let answers: Vec<(String, StatusCode, Value)> = stream::iter(requests)
        .map(|(text, op)| {
            let app = &app;
            async move {
                let body = match op {
                    "result" => json!({"subject": "u", "result": {"ok": true}}),
                    _ => json!({"subject": "u"}),
                };
                let r = app
                    .post(
                        PAYMENTS,
                        &format!("/v1/tokens/{}/{op}", path_segment(&text)),
                        &body,
                    )
                    .await;
                let (s, _, b) = answer(r).await;
                (text, s, b)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert_eq!(answers.len(), 1100);
    for (text, status, body) in &answers {
        let shown = &text[..text.len().min(60)];
        assert!(!status.is_server_error(), "{shown}: {status}");
        assert_eq!(
            (*status, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_invalid")),
            "{shown}: {body}"
        );
    }

    let redis_delta = request_path_delta(&redis_before, &redis_calls(&redis).await);
    assert!(
        redis_delta.is_empty(),
        "forged tokens reached redis: {redis_delta:?}"
    );
    let (pg_after, readings) = pg_counters_quiet(&pool).await;
    assert_eq!(
        pg_after.0, pg_before.0,
        "forged tokens touched the token tables"
    );
    // Background transactions only: this test's own readings, the stats
    // flush (every 2 s, only while there are counts), the lease renewal
    // (every 10 s), the fleet's heartbeat (every 5 s here), the issuance
    // mark (every second) and the filter's re-read of the marks (every
    // 5 s). Without the filter the forgeries alone commit hundreds.
    let elapsed = started.elapsed().as_secs() as i64 + 1;
    let allowed = readings + 7 + elapsed / 2 + elapsed + 2 * (elapsed / 5);
    assert!(
        pg_after.1 - pg_before.1 <= allowed,
        "{} transactions committed during the forgeries (allowed {allowed})",
        pg_after.1 - pg_before.1
    );
    let metrics = app.metrics_text().await;
    let rejected: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ledger_bloom_checks_total{verdict=\"rejected\"} "))
        .and_then(|v| v.trim().parse().ok())
        .expect("rejections counted");
    assert_eq!(rejected, signed.len() as u64 + 100);

    // Control: the same counters do see one genuine consume.
    let (s, _, body) = answer(
        app.consume(PAYMENTS, &genuine[0], &json!({"subject": "u"}))
            .await,
    )
    .await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let redis_delta = request_path_delta(&redis_before, &redis_calls(&redis).await);
    assert!(!redis_delta.is_empty(), "the control consume reached redis");
    eventually(15, || {
        let pool = pool.clone();
        async move { (pg_counters(&pool).await.0 > pg_after.0).then_some(()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fleet_shares_what_it_issued_and_refuses_forgeries_everywhere() {
    let stores = Stores::fresh().with("bloom.grace = \"300ms\"");
    let a = spawn_app_on(stores.clone()).await;
    let b = spawn_app_on(stores.clone()).await;
    let forged = |app: &TestApp, biz: &str| {
        let id = SnowflakeId::from_parts(now_ms() - 10_000, 1001, 7);
        app.sign(biz, id.0, (now_ms() / 1000 + 600) as u32, "payments", "u")
    };

    // At once: B may not have heard yet, and the grace lets it through.
    let t1 = a.issue(PAYMENTS, "order", "u").await;
    let (s, _, body) = answer(b.consume(PAYMENTS, &t1, &json!({"subject": "u"})).await).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );

    // B hears of A's tokens through Postgres, and then knows them past the grace.
    let t2 = a.issue(PAYMENTS, "like", "u").await;
    let t3 = a.issue(PAYMENTS, "refund", "u").await;
    let b_filter = b.ledger.bloom().clone();
    for t in [&t2, &t3] {
        let id = id_of(&a, t);
        eventually(10, || {
            let f = b_filter.clone();
            async move { f.contains(id).then_some(()) }
        })
        .await;
    }
    // Past the grace, B accepts it because it knows it.
    let issued_ms = id_of(&a, &t2).timestamp_ms();
    eventually(
        10,
        || async move { (now_ms() - issued_ms > 300).then_some(()) },
    )
    .await;
    let (s, _, body) = answer(b.consume(PAYMENTS, &t2, &json!({"subject": "u"})).await).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );

    for app in [&a, &b] {
        for biz in ["order", "refund", "like"] {
            let f = forged(app, biz);
            for op in ["consume", "result", "release"] {
                let body = if op == "result" {
                    json!({"subject": "u", "result": 1})
                } else {
                    json!({"subject": "u"})
                };
                let (s, _, body) = answer(
                    app.post(PAYMENTS, &format!("/v1/tokens/{f}/{op}"), &body)
                        .await,
                )
                .await;
                assert_eq!(
                    (s, body["error"].as_str()),
                    (StatusCode::BAD_REQUEST, Some("token_invalid")),
                    "{biz} {op}"
                );
            }
        }
    }

    // B restarts: it rebuilds from the tokens table.
    b.stop().await;
    let b = spawn_app_on(stores).await;
    assert!(b.ledger.bloom().is_synced(), "synced before serving");
    for t in [&t1, &t2, &t3] {
        assert!(b.ledger.bloom().contains(id_of(&a, t)), "rebuilt at start");
    }
    let (s, _, body) = answer(b.consume(PAYMENTS, &t3, &json!({"subject": "u"})).await).await;
    assert_eq!(
        (s, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let (_, replayed, body) =
        answer(b.consume(PAYMENTS, &t1, &json!({"subject": "u"})).await).await;
    assert_eq!(
        (body["outcome"].as_str(), replayed),
        (Some("duplicate"), true)
    );
    let f = forged(&b, "order");
    let (s, _, body) = answer(b.consume(PAYMENTS, &f, &json!({"subject": "u"})).await).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_invalid"))
    );
}

/// Clients: the defaults plus `shop2`, a second service client with the same
/// grants as `payments`.
fn two_shops() -> String {
    let hash = |k: &str| hex::encode(Sha256::digest(k.as_bytes()));
    format!(
        r#"
[[clients]]
name = "payments"
role = "service"
key_sha256 = "{p}"
biz_types = ["order", "refund", "like"]

[[clients]]
name = "refunds"
role = "service"
key_sha256 = "{r}"
biz_types = ["refund"]

[[clients]]
name = "shop2"
role = "service"
key_sha256 = "{s}"
biz_types = ["order", "refund", "like"]
"#,
        p = hash(PAYMENTS),
        r = hash(REFUNDS),
        s = hash("shop2-key"),
    )
}

#[tokio::test]
async fn no_client_reaches_another_clients_or_subjects_tokens() {
    let app = spawn_app_on(Stores::fresh().with(&two_shops())).await;
    let shop2 = "shop2-key";
    let error = |r: (StatusCode, bool, Value)| (r.0, r.2["error"].as_str().map(str::to_owned));
    let mismatch = (StatusCode::FORBIDDEN, Some("token_mismatch".to_owned()));
    let forbidden = (StatusCode::FORBIDDEN, Some("forbidden".to_owned()));

    for biz in ["order", "like"] {
        let t = app.issue(PAYMENTS, biz, "alice").await;
        let consume = |key: &'static str, subject: &'static str| {
            let t = t.clone();
            let app = &app;
            async move { answer(app.consume(key, &t, &json!({"subject": subject})).await).await }
        };
        assert_eq!(
            error(consume(shop2, "alice").await),
            mismatch,
            "{biz}: other client"
        );
        assert_eq!(
            error(consume(PAYMENTS, "bob").await),
            mismatch,
            "{biz}: other subject"
        );
        assert_eq!(
            error(consume(REFUNDS, "alice").await),
            forbidden,
            "{biz}: not granted"
        );
        // None of that consumed it.
        let (s, _, body) = consume(PAYMENTS, "alice").await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{biz}"
        );

        for (key, subject, want) in [
            (shop2, "alice", &mismatch),
            (PAYMENTS, "bob", &mismatch),
            (REFUNDS, "alice", &forbidden),
        ] {
            for op in ["result", "release"] {
                let body = if op == "result" {
                    json!({"subject": subject, "result": {"stolen": true}})
                } else {
                    json!({"subject": subject})
                };
                let r = answer(app.post(key, &format!("/v1/tokens/{t}/{op}"), &body).await).await;
                assert_eq!(&error(r), want, "{biz} {op} by {key} for {subject}");
            }
        }
        // The owner's result lands: nobody else's did, nobody released it.
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/tokens/{t}/result"),
                &json!({"subject": "alice", "result": {"paid": biz}}),
            )
            .await,
        )
        .await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("recorded")),
            "{biz}"
        );
    }

    // A refund token of `refunds`, presented by `payments` (also granted refund).
    let t = app.issue(REFUNDS, "refund", "alice").await;
    let r = answer(
        app.consume(PAYMENTS, &t, &json!({"subject": "alice"}))
            .await,
    )
    .await;
    assert_eq!(error(r), mismatch);
    let r = answer(app.consume(REFUNDS, &t, &json!({"subject": "alice"})).await).await;
    assert_eq!(r.2["outcome"], "consumed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_101st_issue_in_a_second_for_one_subject_is_429() {
    // Default config: order issue_rate = "100/s", a token bucket whose burst
    // is one second's worth and which refills one token every 10 ms.
    let app = spawn_app().await;
    let issue = |subject: &'static str| {
        let app = &app;
        async move {
            let r = app
                .post(
                    PAYMENTS,
                    "/v1/tokens",
                    &json!({"biz_type": "order", "subject": subject}),
                )
                .await;
            let retry = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let (s, _, body) = answer(r).await;
            (s, retry, body)
        }
    };
    let started = Instant::now();
    let burst: Vec<_> = futures_util::future::join_all((0..100).map(|_| issue("hot"))).await;
    assert!(
        burst.iter().all(|(s, _, _)| *s == StatusCode::CREATED),
        "the first 100 are always admitted"
    );
    // Past the burst, only the refill is admitted: keep asking until refused.
    let mut admitted = 100u64;
    let mut refused = None;
    for _ in 0..50 {
        let wave: Vec<_> = futures_util::future::join_all((0..50).map(|_| issue("hot"))).await;
        admitted += wave
            .iter()
            .filter(|(s, _, _)| *s == StatusCode::CREATED)
            .count() as u64;
        if let Some(r) = wave.into_iter().find(|(s, _, _)| *s != StatusCode::CREATED) {
            refused = Some(r);
            break;
        }
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let (status, retry, body) = refused.expect("a refusal");
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(body["error"], "rate_limited");
    assert!(
        body["message"].as_str().unwrap_or("").contains("subject"),
        "the per-subject limit, not the client's ceiling: {body}"
    );
    assert!(retry.is_some_and(|r| r >= 1), "Retry-After {retry:?}");
    // The 101st within the same 10 ms of the burst is refused; later ones only
    // as the bucket refills.
    assert!(
        admitted <= 100 + elapsed_ms / 10 + 1,
        "{admitted} admitted in {elapsed_ms} ms"
    );
    // Another subject, and another biz type for the same subject, are unaffected.
    assert_eq!(issue("calm").await.0, StatusCode::CREATED);
    let r = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "like", "subject": "hot"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
}

/// Subjects are chosen by callers: the issue-rate state of every pair seen
/// must not live forever. Once a pair's bucket is full again it is dropped,
/// and the pair behaves as if never seen (its next burst is whole).
#[tokio::test]
async fn issue_rate_state_of_idle_subjects_is_forgotten() {
    let app = spawn_app().await;
    for i in 0..50 {
        app.issue(PAYMENTS, "order", &format!("passer-by-{i}"))
            .await;
    }
    // 100/s refills one token per 10 ms: every bucket is full after 20 ms.
    // The buckets run on a monotonic clock of their own (a wall-clock step
    // must never change a rate), not the service's Clock: this waits real
    // time.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(app.ledger.prune_rate_limiters(), 0);
    // A pair that is still draining its bucket is kept (100 at once empty a
    // bucket that takes 1 s to refill).
    futures_util::future::join_all((0..100).map(|_| app.issue(PAYMENTS, "order", "busy"))).await;
    assert_eq!(app.ledger.prune_rate_limiters(), 1);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_client_has_a_ceiling_on_every_endpoint() {
    // Default ceiling 5/s; `payments` is given 1000/s of its own.
    let clients = two_shops().replacen(
        "biz_types = [\"order\", \"refund\", \"like\"]\n",
        "biz_types = [\"order\", \"refund\", \"like\"]\nrate = \"1000/s\"\n",
        1,
    );
    let app = spawn_app_on(
        Stores::fresh()
            .with("limits.client_rate = \"5/s\"")
            .with(&clients),
    )
    .await;
    let fire = |key: &'static str| {
        let app = &app;
        async move {
            let started = Instant::now();
            let answers: Vec<_> = futures_util::future::join_all((0..30).map(|i| async move {
                let path = if i % 2 == 0 {
                    "/v1/tokens/order_dev1_nope/consume"
                } else {
                    "/v1/tokens/order_dev1_nope/release"
                };
                let r = app.post(key, path, &json!({"subject": "u"})).await;
                let retry = r.headers().get("retry-after").is_some();
                let (s, _, body) = answer(r).await;
                (s, retry, body)
            }))
            .await;
            (answers, started.elapsed().as_millis() as u64)
        }
    };
    let (answers, elapsed_ms) = fire(REFUNDS).await;
    let limited: Vec<_> = answers
        .iter()
        .filter(|(s, _, _)| *s == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    let admitted = answers.len() - limited.len();
    assert!(
        (admitted as u64) <= 5 + elapsed_ms / 200 + 1,
        "{admitted} admitted in {elapsed_ms} ms"
    );
    assert!(!limited.is_empty());
    assert!(limited
        .iter()
        .all(|(_, retry, b)| *retry && b["error"] == "rate_limited"));
    // The ceiling comes after authentication and before the body and token.
    assert!(answers
        .iter()
        .filter(|(s, _, _)| *s != StatusCode::TOO_MANY_REQUESTS)
        .all(|(s, _, b)| *s == StatusCode::BAD_REQUEST && b["error"] == "token_invalid"));
    // Its own ceiling for `payments`; the others' exhaustion does not touch it.
    let (answers, _) = fire(PAYMENTS).await;
    assert!(answers
        .iter()
        .all(|(s, _, _)| *s == StatusCode::BAD_REQUEST));
    // Wrong keys are 401, not counted against anyone.
    let r = app.post("nope", "/v1/tokens", &json!({})).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn ttl_floors_per_biz_type() {
    // No floor by default: API.md allows 1 s to the biz type's ttl.
    let open = spawn_app().await;
    for (biz, ttl) in [("order", 1), ("refund", 1), ("like", 1), ("order", 60)] {
        let (s, _, body) = answer(
            open.post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": biz, "subject": "u", "ttl_seconds": ttl}),
            )
            .await,
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{biz} {ttl}: {body}");
    }
    let app = spawn_app_on(Stores::fresh().with(
        "biz.order.min_ttl = \"10s\"\nbiz.refund.min_ttl = \"10s\"\nbiz.like.min_ttl = \"1s\"",
    ))
    .await;
    for (biz, ttl, want) in [
        ("order", 9, StatusCode::BAD_REQUEST),
        ("order", 10, StatusCode::CREATED),
        ("refund", 1, StatusCode::BAD_REQUEST),
        ("refund", 10, StatusCode::CREATED),
        ("like", 1, StatusCode::CREATED),
        ("like", 3, StatusCode::CREATED),
        ("like", 4, StatusCode::BAD_REQUEST),
    ] {
        let (s, _, body) = answer(
            app.post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": biz, "subject": "u", "ttl_seconds": ttl}),
            )
            .await,
        )
        .await;
        assert_eq!(s, want, "{biz} {ttl}: {body}");
        if s == StatusCode::BAD_REQUEST {
            assert_eq!(body["error"], "invalid_request");
        }
    }
    // A floor above the ttl is a configuration error naming the key.
    let err = idempotency_ledger::config::Settings::from_toml_over_defaults(
        "[biz.like]\nttl = \"3s\"\ndurability = \"fast\"\nmin_ttl = \"10s\"",
    )
    .unwrap_err();
    assert!(err.to_string().contains("biz.like.min_ttl"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn signing_keys_rotate_without_refusing_live_tokens() {
    let base = Stores::fresh();
    let dev1 = format!("{{ id = \"dev1\", secret = \"{DEV_SECRET}\" }}");
    let k2 = "{ id = \"k2\", secret = \"second-signing-secret-for-rotation-0123\" }";
    // Step 0: only dev1.
    let old = spawn_app_on(base.clone()).await;
    let by_old: Vec<String> = futures_util::future::join_all(
        (0..3).map(|i| old.issue(PAYMENTS, "order", if i == 0 { "a" } else { "b" })),
    )
    .await;
    assert!(by_old.iter().all(|t| t.starts_with("order_dev1_")));

    // Steps 1 and 2: k2 added and made active; dev1 stays listed (retired).
    let new = spawn_app_on(
        base.clone()
            .with(&format!("tokens.signing_keys = [{k2}, {dev1}]")),
    )
    .await;
    let by_new = new.issue(PAYMENTS, "order", "c").await;
    assert!(by_new.starts_with("order_k2_"), "{by_new}");
    let (_, _, body) = answer(
        new.consume(PAYMENTS, &by_old[0], &json!({"subject": "a"}))
            .await,
    )
    .await;
    assert_eq!(
        body["outcome"], "consumed",
        "a retired-but-listed key still verifies"
    );
    // An instance that was never told of k2 refuses its tokens: add the key
    // everywhere before making it active (docs/operations.md, "Rotating the signing key").
    let (s, _, body) = answer(
        old.consume(PAYMENTS, &by_new, &json!({"subject": "c"}))
            .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_invalid"))
    );

    // Step 3: dev1 removed.
    let gone = spawn_app_on(base.with(&format!("tokens.signing_keys = [{k2}]"))).await;
    for (t, subject) in [(&by_old[1], "b"), (&by_old[2], "b")] {
        let (s, _, body) = answer(
            gone.consume(PAYMENTS, t, &json!({"subject": subject}))
                .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_invalid")),
            "a removed key no longer verifies"
        );
    }
    let (_, _, body) = answer(
        gone.consume(PAYMENTS, &by_new, &json!({"subject": "c"}))
            .await,
    )
    .await;
    assert_eq!(body["outcome"], "consumed");
    // The retired token consumed under dev1 still answers duplicate where dev1 is listed.
    let (_, replayed, body) = answer(
        new.consume(PAYMENTS, &by_old[0], &json!({"subject": "a"}))
            .await,
    )
    .await;
    assert_eq!(
        (body["outcome"].as_str(), replayed),
        (Some("duplicate"), true)
    );
}

#[tokio::test]
async fn oversized_or_deep_inputs_are_refused_before_any_io() {
    let app = spawn_app().await;
    let t = app.issue(PAYMENTS, "order", "u").await;
    let deep = |n: usize| -> Value {
        let text = format!("{}1{}", "[".repeat(n), "]".repeat(n));
        serde_json::from_str(&text).expect("serde_json parses up to 128")
    };
    // Depth 33 in total (the body object plus 32 arrays): refused.
    let (s, _, body) = answer(
        app.post(
            PAYMENTS,
            &format!("/v1/tokens/{t}/result"),
            &json!({"subject": "u", "result": deep(32)}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_request"))
    );
    assert!(
        body["message"].as_str().unwrap().contains("nested"),
        "{body}"
    );
    // Depth 32 passes the shape checks (and the token is not consumed yet).
    let (s, _, body) = answer(
        app.post(
            PAYMENTS,
            &format!("/v1/tokens/{t}/result"),
            &json!({"subject": "u", "result": deep(31)}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::CONFLICT, Some("not_consumed"))
    );

    // A path and query beyond 16 KiB: 414; headers beyond 16 KiB: 431.
    let long = "a".repeat(17_000);
    let r = app
        .http
        .get(app.url(&format!("/healthz?{long}")))
        .send()
        .await
        .unwrap();
    let (s, _, body) = answer(r).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::URI_TOO_LONG, Some("uri_too_long"))
    );
    let r = app
        .http
        .post(app.url(&format!("/v1/tokens/{t}/consume")))
        .bearer_auth(PAYMENTS)
        .header("x-padding", "b".repeat(17_000))
        .json(&json!({"subject": "u"}))
        .send()
        .await
        .unwrap();
    let (s, _, body) = answer(r).await;
    assert_eq!(
        (s, body["error"].as_str()),
        (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Some("headers_too_large")
        )
    );
    // Nothing consumed it.
    let (_, _, body) = answer(app.consume(PAYMENTS, &t, &json!({"subject": "u"})).await).await;
    assert_eq!(body["outcome"], "consumed");
}

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idempotency-ledger"))
}

#[test]
fn production_refuses_the_development_config_through_the_binary() {
    let out = binary()
        .arg("serve")
        .env("LEDGER__ENV", "production")
        .env_remove("RUST_LOG")
        .output()
        .expect("binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for named in [
        "tokens.signing_keys[dev1]",
        "audit.seal_keys[a1]",
        "clients[payments]",
        "clients[refunds]",
        "clients[reconciler]",
        "clients[admin]",
    ] {
        assert!(stderr.contains(named), "{named} not named: {stderr}");
    }
    assert!(
        !stderr.contains(DEV_SECRET),
        "the secret itself is never printed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_log_holds_no_api_key_and_no_full_token() {
    let stores = Stores::fresh();
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("ledger.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
workers = 1

[postgres]
url = "{db}"

[redis]
url = "{redis}"
key_prefix = "{prefix}"
"#,
            db = stores.db_url(),
            redis = stores.redis_url,
            prefix = stores.prefix,
        ),
    )
    .expect("config written");
    let mut child = binary()
        .args(["--config", config.to_str().expect("utf-8 path"), "serve"])
        .env("RUST_LOG", "info,idempotency_ledger=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("binary starts");
    let log = Arc::new(Mutex::new(String::new()));
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = {
        let log = log.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                log.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    eventually(60, || {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let r = http.get(format!("{base}/healthz")).send().await.ok()?;
            r.status().is_success().then_some(())
        }
    })
    .await;

    let post = |key: &str, path: String, body: Value| {
        http.post(format!("{base}{path}"))
            .bearer_auth(key)
            .json(&body)
            .send()
    };
    let mut tokens = Vec::new();
    for (biz, subject) in [
        ("order", "user-1"),
        ("like", "user-2"),
        ("refund", "user-3"),
    ] {
        let r = post(
            PAYMENTS,
            "/v1/tokens".into(),
            json!({"biz_type": biz, "subject": subject}),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        let t = r.json::<Value>().await.unwrap()["token"]
            .as_str()
            .unwrap()
            .to_owned();
        tokens.push((t, subject));
    }
    let r = http
        .get(format!(
            "{base}/api/token/generate?bizType=order&userId=user-4"
        ))
        .bearer_auth(PAYMENTS)
        .send()
        .await
        .unwrap();
    tokens.push((
        r.json::<Value>().await.unwrap()["token"]
            .as_str()
            .unwrap()
            .to_owned(),
        "user-4",
    ));
    for (t, subject) in &tokens {
        for _ in 0..2 {
            // consumed, then duplicate
            let r = post(
                PAYMENTS,
                format!("/v1/tokens/{t}/consume"),
                json!({"subject": subject}),
            )
            .await
            .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
        }
    }
    let (t0, s0) = &tokens[0];
    let r = post(
        PAYMENTS,
        format!("/v1/tokens/{t0}/result"),
        json!({"subject": s0, "result": {"ok": 1}}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let (t2, s2) = &tokens[2];
    let r = post(
        PAYMENTS,
        format!("/v1/tokens/{t2}/release"),
        json!({"subject": s2}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // Refusals: wrong and near-miss keys, someone else's token, a forged one,
    // an unknown route holding a token.
    for key in ["dev-payments-keyX", "xdev-admin-key", "nope"] {
        let r = post(
            key,
            format!("/v1/tokens/{t0}/consume"),
            json!({"subject": s0}),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
    let r = post(
        REFUNDS,
        format!("/v1/tokens/{t0}/consume"),
        json!({"subject": s0}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let r = post(
        PAYMENTS,
        format!("/v1/tokens/{t0}x/consume"),
        json!({"subject": s0}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    // A read of the token's state logs no full token either.
    let r = http
        .get(format!("{base}/v1/tokens/{t0}?subject={s0}"))
        .bearer_auth(PAYMENTS)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = http
        .get(format!("{base}/v1/tokens/{t0}/history"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_client_error());

    // SIGTERM: the service drains and logs its shutdown.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let exited = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = reader.join();
    let log = log.lock().unwrap().clone();

    assert!(
        log.contains("handled"),
        "requests are logged (our crate at debug, everything else at info):\n{log}"
    );
    for key in DEV_KEYS
        .iter()
        .chain(["dev-payments-keyX", "xdev-admin-key"].iter())
    {
        assert!(!log.contains(key), "API key {key} in the log:\n{log}");
    }
    assert!(!log.contains(DEV_SECRET), "signing secret in the log");
    for (t, _) in &tokens {
        assert!(
            !log.contains(t.as_str()),
            "full token {t} in the log:\n{log}"
        );
        // Not even the tag-carrying body of it.
        // (after `<biz>_<kid>_`: base64url may itself contain `_`).
        let body = t.splitn(3, '_').nth(2).unwrap();
        assert!(!log.contains(body), "token body of {t} in the log");
    }
}
