//! Forgery (DESIGN.md invariant 5): forged tokens of every kind cost no
//! Redis or Postgres round trip (counted by a private Redis's
//! `INFO commandstats` and Postgres's statistics views), and the fleet
//! shares its filter of issued ids, so a token validly signed but never
//! issued is refused on every instance.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use idempotency_ledger::token::{SnowflakeId, TokenCodec};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::procs::{PgProc, RedisProc};
use crate::helpers::*;

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

/// Postgres's counters for the test database, in one statement: per token
/// table (`tokens`' partitions, which hold its statistics, and
/// `audit_events`), its scans and its inserted, updated and deleted rows;
/// and the committed transactions. Per table and per counter, so that a
/// failure says which one moved.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PgCounters {
    tables: BTreeMap<String, [i64; 5]>,
    commits: i64,
}

async fn pg_counters(pool: &sqlx::PgPool) -> PgCounters {
    let rows: Vec<(String, i64, i64, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT t.relname::text, t.seq_scan, coalesce(t.idx_scan, 0), t.n_tup_ins, t.n_tup_upd,
                t.n_tup_del,
                (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())
           FROM pg_stat_user_tables t
          WHERE t.relname = 'audit_events'
             OR t.relid IN (SELECT relid FROM pg_partition_tree('tokens'))",
    )
    .fetch_all(pool)
    .await
    .expect("statistics views");
    PgCounters {
        commits: rows.first().map_or(0, |r| r.6),
        tables: rows
            .into_iter()
            .map(|(name, seq, idx, ins, upd, del, _)| (name, [seq, idx, ins, upd, del]))
            .collect(),
    }
}

/// What moved between two readings: per table, `[seq_scan, idx_scan,
/// n_tup_ins, n_tup_upd, n_tup_del]` deltas, only the tables that moved.
fn moved(before: &PgCounters, after: &PgCounters) -> BTreeMap<String, [i64; 5]> {
    after
        .tables
        .iter()
        .filter_map(|(name, a)| {
            let b = before.tables.get(name).copied().unwrap_or_default();
            let d: [i64; 5] = std::array::from_fn(|i| a[i] - b[i]);
            (d != [0; 5]).then(|| (name.clone(), d))
        })
        .collect()
}

/// A backend publishes its statistics when it goes idle, but at most once a
/// second; what it could not publish then waits for Postgres's idle-stats
/// timeout (PGSTAT_IDLE_INTERVAL, 10 s). So: read until the token tables'
/// counters have not moved for 11 s. Returns the counters and how many
/// readings (transactions of our own) it took.
async fn pg_counters_quiet(pool: &sqlx::PgPool) -> (PgCounters, i64) {
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
        if now.tables != last.tables {
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
    // that the count below is the forgeries' alone. The audit sealer reads
    // `audit_events` (its highest id) once a pass, first a minute after the
    // start: a test that ran past that minute (under the whole suite's
    // load) saw the table's scans move by one. It has no pass in this test.
    let app = spawn_app_on(
        Stores::fresh()
            .redis(&redis.url())
            .postgres(&pg.base())
            .with("fleet.heartbeat = \"5s\"\nfleet.lease = \"30s\"\n[audit]\nseal_every = \"24h\""),
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
    let touched = moved(&pg_before, &pg_after);
    assert!(
        touched.is_empty(),
        "forged tokens touched the token tables ([seq_scan, idx_scan, inserted, updated, deleted]): {touched:?}"
    );
    // Background transactions only: this test's own readings, the stats
    // flush (every 2 s, only while there are counts), the lease renewal
    // (every 10 s), the fleet's heartbeat (every 5 s here), the issuance
    // mark (every second) and the filter's re-read of the marks (every
    // 5 s). Without the filter the forgeries alone commit hundreds.
    let elapsed = started.elapsed().as_secs() as i64 + 1;
    let allowed = readings + 7 + elapsed / 2 + elapsed + 2 * (elapsed / 5);
    assert!(
        pg_after.commits - pg_before.commits <= allowed,
        "{} transactions committed during the forgeries (allowed {allowed})",
        pg_after.commits - pg_before.commits
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
        let (pool, pg_after) = (pool.clone(), pg_after.clone());
        async move { (!moved(&pg_after, &pg_counters(&pool).await).is_empty()).then_some(()) }
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
    let b_filter = b.filter.clone();
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
    assert!(b.filter.is_synced(), "synced before serving");
    for t in [&t1, &t2, &t3] {
        assert!(b.filter.contains(id_of(&a, t)), "rebuilt at start");
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
