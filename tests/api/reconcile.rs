//! Reconciliation: every divergence class made for real (Redis keys deleted or
//! rewritten, journal leftovers added with XADD, orders broken in SQL, records
//! aged past retention), then a dry run, a real run and a run that finds
//! nothing; one run at a time (library, CLI and HTTP racing a paused run).

use std::process::Output;
use std::sync::mpsc;

use idempotency_ledger::durable::Pools;
use idempotency_ledger::reconcile::{
    Class, Classes, Options, Phase, Progress, Quiet, ReconcileError, Reconciler, Report,
};
use redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::helpers::procs::Cluster;
use crate::helpers::tiers::{fast_tier, reconciler_on, run_on};
use crate::helpers::*;

/// A reconciler of its own (own pools and Redis connections), as the CLI has.
fn reconciler(stores: &Stores) -> (Reconciler, Pools) {
    reconciler_on(stores, fast_tier(stores).0)
}

async fn run(stores: &Stores, dry_run: bool) -> Report {
    run_on(reconciler(stores), dry_run).await
}

async fn token_id(pg: &PgPool, token: &str) -> i64 {
    eventually(5, || async {
        sqlx::query_scalar::<_, i64>("SELECT id FROM tokens WHERE token = $1")
            .bind(token)
            .fetch_optional(pg)
            .await
            .expect("query")
    })
    .await
}

async fn state_of(r: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
    r.hget(key, "s").await.expect("hget")
}

/// Inserts a token row by hand (for ages no real clock reaches in a test).
#[allow(clippy::too_many_arguments)]
async fn insert_token(
    pg: &PgPool,
    id: i64,
    token: &str,
    state: &str,
    expires_at: &str,
    consumed_at: Option<&str>,
    order_id: Option<&str>,
) {
    sqlx::query(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                             state, consumed_at, order_id)
         VALUES ($1, $2, split_part($2, '_', 1), 'durable', 'u-old', 'payments',
                 now() - interval '30 days', now() + $3::interval, $4::token_state,
                 now() + $5::interval, $6)",
    )
    .bind(id)
    .bind(token)
    .bind(expires_at)
    .bind(state)
    .bind(consumed_at)
    .bind(order_id)
    .execute(pg)
    .await
    .expect("token row inserted");
}

fn expected(
    live_consumed: u64,
    missing: u64,
    stale: u64,
    journal: u64,
    orders: u64,
    purge: u64,
) -> Classes {
    [
        (Class::RedisLiveButConsumed, live_consumed),
        (Class::RedisMissingButLive, missing),
        (Class::StaleProvisional, stale),
        (Class::JournalNotDurable, journal),
        (Class::OrderInconsistent, orders),
        (Class::ExpiredPurgeable, purge),
    ]
    .into_iter()
    .collect()
}

#[tokio::test]
async fn every_divergence_class_dry_run_then_repair_then_nothing() {
    // Small batches, so every phase pages.
    let stores = Stores::fresh().with("reconcile.batch_size = 2");
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    let mut r = redis_conn().await;

    // Background tokens that are fine and must stay untouched.
    for i in 0..5 {
        app.issue(PAYMENTS, "order", &format!("fine-{i}")).await;
    }

    // A: consumed in Postgres, its Redis key put back to "issued".
    let a = app.issue(PAYMENTS, "order", "u-a").await;
    let (s, _, _) = answer(
        app.consume(
            PAYMENTS,
            &a,
            &json!({"subject": "u-a", "request_id": "r-a"}),
        )
        .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let key_a = app.token_key(&a);
    wait_redis_state(&r, &key_a, "c", 5).await;
    // B: live and issued, Redis lost its key.
    let b = app.issue(PAYMENTS, "order", "u-b").await;
    // C: live and issued, a provisional marker whose owner died long ago.
    let c = app.issue(PAYMENTS, "order", "u-c").await;
    // D: a fast token Redis consumed, whose journal entry never reached Postgres.
    let d = app.issue(PAYMENTS, "like", "u-d").await;
    token_id(&pg, &b).await;
    token_id(&pg, &c).await;
    let d_id = token_id(&pg, &d).await;
    token_id(&pg, &a).await;

    // Break things (the journal only once no instance runs: its drainer would race us).
    let _: () = r.hset(&key_a, "s", "i").await.expect("hset");
    let key_b = app.token_key(&b);
    let _: () = r.del(&key_b).await.expect("del");
    let key_c = app.token_key(&c);
    let _: () = r
        .hset_multiple(
            &key_c,
            &[
                ("s", "p".to_owned()),
                ("o", "dead-owner".to_owned()),
                ("d", (now_ms() - 10_000).to_string()),
                ("at", (now_ms() - 11_000).to_string()),
            ],
        )
        .await
        .expect("hset");
    let key_d = app.token_key(&d);
    let at_d = now_ms();
    let _: () = r
        .hset_multiple(&key_d, &[("s", "c".to_owned()), ("at", at_d.to_string())])
        .await
        .expect("hset");
    let (iat, exp): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT issued_at, expires_at FROM tokens WHERE id = $1")
            .bind(d_id)
            .fetch_one(&pg)
            .await
            .expect("d row");
    let journal = format!("{}journal", stores.prefix);
    let xadd = redis::cmd("XADD")
        .arg(&journal)
        .arg("*")
        .arg(&[
            ("op", "consume".to_owned()),
            ("id", d_id.to_string()),
            ("token", d.clone()),
            ("biz", "like".to_owned()),
            ("sub", "u-d".to_owned()),
            ("cl", "payments".to_owned()),
            ("iat", iat.timestamp_millis().to_string()),
            ("exp", exp.timestamp_millis().to_string()),
            ("rid", "r-d".to_owned()),
            ("fp", String::new()),
            ("at", at_d.to_string()),
        ])
        .clone();

    // E: orders broken by hand. o-good is consistent and must not be reported.
    let p1 = app.sign("order", 9_000_001, 1_000, "payments", "u-o");
    let p2 = app.sign("order", 9_000_002, 1_000, "payments", "u-o");
    let r1 = app.sign("refund", 9_000_003, 1_000, "payments", "u-o");
    // Tokens bound to orders, consumed (with their events) within retention.
    for (id, t, order) in [
        (9_000_001, &p1, "o-amounts"),
        (9_000_002, &p2, "o-nopaid"),
        (9_000_003, &r1, "o-amounts"),
    ] {
        insert_token(
            &pg,
            id,
            t,
            "consumed",
            "-1 hour",
            Some("-2 hours"),
            Some(order),
        )
        .await;
    }
    sqlx::query(
        "INSERT INTO orders (order_id, client, subject, state, amount_minor, refunded_minor, currency)
         VALUES ('o-good', 'payments', 'u-o', 'CREATED', 1000, 0, 'CNY'),
                ('o-amounts', 'payments', 'u-o', 'PARTIALLY_REFUNDED', 1000, 300, 'CNY'),
                ('o-nopaid', 'payments', 'u-o', 'PAID', 1000, 0, 'CNY')",
    )
    .execute(&pg)
    .await
    .expect("orders");
    sqlx::query(
        "INSERT INTO order_events (order_id, kind, token_id, token, amount_minor)
         VALUES ('o-good', 'order.created', NULL, NULL, 1000),
                ('o-amounts', 'order.created', NULL, NULL, 1000),
                ('o-amounts', 'order.paid', 9000001, $1, 1000),
                ('o-amounts', 'order.refunded', 9000003, $2, 500),
                ('o-nopaid', 'order.created', NULL, NULL, 1000)",
    )
    .bind(&p1)
    .bind(&r1)
    .execute(&pg)
    .await
    .expect("order events");

    // F: past retention (7 d): consumed 8 days ago and expired, and never
    // consumed and expired 8 days ago. G: consumed 8 days ago but its own
    // expiry is still ahead: purging it would make it consumable again.
    let exp_old = (now_ms() / 1000 - 8 * 86_400) as u32;
    let exp_future = (now_ms() / 1000 + 86_400) as u32;
    let f1 = app.sign("order", 9_100_001, exp_old, "payments", "u-old");
    let f2 = app.sign("order", 9_100_002, exp_old, "payments", "u-old");
    let g = app.sign("order", 9_100_003, exp_future, "payments", "u-old");
    insert_token(
        &pg,
        9_100_001,
        &f1,
        "consumed",
        "-8 days",
        Some("-8 days"),
        None,
    )
    .await;
    insert_token(&pg, 9_100_002, &f2, "issued", "-8 days", None, None).await;
    insert_token(
        &pg,
        9_100_003,
        &g,
        "consumed",
        "1 day",
        Some("-8 days"),
        None,
    )
    .await;
    app.stop().await;
    let _: String = xadd.query_async(&mut r).await.expect("xadd");

    let want = expected(1, 1, 1, 1, 2, 2);

    // Dry run: reports everything, changes nothing.
    let dry = run(&stores, true).await;
    assert!(dry.dry_run);
    assert_eq!(dry.found, want, "{dry:#?}");
    assert_eq!(dry.repaired, Classes::default());
    assert!(
        dry.scanned.tokens >= 10 && dry.scanned.orders == 3,
        "{:?}",
        dry.scanned
    );
    let ids: Vec<&str> = dry
        .inconsistent_orders
        .iter()
        .map(|o| o.order_id.as_str())
        .collect();
    assert_eq!(ids, ["o-amounts", "o-nopaid"]);
    assert_eq!(state_of(&mut r, &key_a).await.as_deref(), Some("i"));
    assert_eq!(state_of(&mut r, &key_b).await, None);
    assert_eq!(state_of(&mut r, &key_c).await.as_deref(), Some("p"));
    let xlen: u64 = r.xlen(&journal).await.expect("xlen");
    assert_eq!(xlen, 1);
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tokens WHERE id IN (9100001, 9100002)")
            .fetch_one(&pg)
            .await
            .expect("count");
    assert_eq!(rows, 2);
    let repairs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind = 'reconcile.repaired'")
            .fetch_one(&pg)
            .await
            .expect("count");
    assert_eq!(repairs, 0, "a dry run writes no audit rows");

    // The real run repairs every class but the orders, and reports the same.
    let real = run(&stores, false).await;
    assert!(!real.dry_run);
    assert_eq!(real.found, want, "{real:#?}");
    assert_eq!(real.repaired, expected(1, 1, 1, 1, 0, 2), "{real:#?}");
    assert_eq!(real.inconsistent_orders, dry.inconsistent_orders);
    let problems = &real.inconsistent_orders[0].problems;
    assert!(
        problems
            .iter()
            .any(|p| p.contains("300") && p.contains("500")),
        "{problems:?}"
    );
    assert!(real.inconsistent_orders[1].problems[0].contains("without an order.paid"));

    assert_eq!(
        state_of(&mut r, &key_a).await,
        None,
        "A: Postgres answers now"
    );
    assert_eq!(state_of(&mut r, &key_b).await.as_deref(), Some("i"));
    let ttl: i64 = r.pttl(&key_b).await.expect("pttl");
    // The token's expiry is rounded up to a whole second: at most 61 s away.
    assert!(
        ttl > 0 && ttl <= 61_000,
        "B re-seeded with its remaining ttl: {ttl}"
    );
    assert_eq!(state_of(&mut r, &key_c).await.as_deref(), Some("i"));
    let xlen: u64 = r.xlen(&journal).await.expect("xlen");
    assert_eq!(xlen, 0);
    let d_state: String = sqlx::query_scalar("SELECT state::text FROM tokens WHERE id = $1")
        .bind(d_id)
        .fetch_one(&pg)
        .await
        .expect("d");
    assert_eq!(d_state, "consumed");
    let left: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM tokens WHERE id BETWEEN 9100001 AND 9100003 ORDER BY id",
    )
    .fetch_all(&pg)
    .await
    .expect("ids");
    assert_eq!(left, [9_100_003], "only G (not yet expired) is kept");
    let classes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT detail->>'class', count(*) FROM audit_events WHERE kind = 'reconcile.repaired'
          GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&pg)
    .await
    .expect("classes");
    let classes: Vec<(&str, i64)> = classes.iter().map(|(c, n)| (c.as_str(), *n)).collect();
    assert_eq!(
        classes,
        [
            ("expired_purgeable", 2),
            ("journal_not_durable", 1),
            ("redis_live_but_consumed", 1),
            ("redis_missing_but_live", 1),
            ("stale_provisional", 1),
        ]
    );
    let by: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT DISTINCT detail->>'by' FROM audit_events WHERE kind = 'reconcile.repaired'",
    )
    .fetch_all(&pg)
    .await
    .expect("by");
    assert_eq!(by, [Some("cli".to_owned())], "who asked, in every repair");

    // Right after: nothing left to repair; the orders are still reported.
    let again = run(&stores, false).await;
    assert_eq!(again.found, expected(0, 0, 0, 0, 2, 0), "{again:#?}");
    assert_eq!(again.repaired, Classes::default());

    // The service agrees with the repairs.
    let app = spawn_app_on(stores.clone()).await;
    let dup = answer(app.consume(PAYMENTS, &a, &json!({"subject": "u-a"})).await).await;
    assert_eq!(dup.2["outcome"], "duplicate", "A stays consumed: {dup:?}");
    for (t, sub) in [(&b, "u-b"), (&c, "u-c")] {
        let won = answer(app.consume(PAYMENTS, t, &json!({"subject": sub})).await).await;
        assert_eq!(won.2["outcome"], "consumed", "{won:?}");
    }
    let dup = answer(app.consume(PAYMENTS, &d, &json!({"subject": "u-d"})).await).await;
    assert_eq!(dup.2["outcome"], "duplicate", "D consumed once: {dup:?}");

    // The recorded runs (newest first: again, real, dry) keep the
    // inconsistent orders' ids and problems, and who asked.
    let (s, _, runs) = answer(app.get(AUDITOR, "/v1/admin/reconcile/runs").await).await;
    assert_eq!(s, StatusCode::OK, "{runs}");
    let runs = runs["runs"].as_array().expect("runs");
    let dry_runs: Vec<&Value> = runs.iter().map(|r| &r["dry_run"]).collect();
    assert_eq!(dry_runs, [&json!(false), &json!(false), &json!(true)]);
    let ids: Vec<String> = [&again, &real, &dry]
        .iter()
        .map(|r| r.id.clone().expect("recorded"))
        .collect();
    let listed: Vec<&str> = runs.iter().filter_map(|r| r["id"].as_str()).collect();
    assert_eq!(listed, ids);
    for run in runs {
        assert_eq!(
            run["inconsistent_orders"],
            json!(["o-amounts", "o-nopaid"]),
            "{run}"
        );
        let problems: Vec<&Value> = run["order_problems"]
            .as_array()
            .expect("order_problems")
            .iter()
            .map(|o| &o["order_id"])
            .collect();
        assert_eq!(problems, [&json!("o-amounts"), &json!("o-nopaid")]);
        assert!(
            run["order_problems"][1]["problems"][0]
                .as_str()
                .is_some_and(|p| p.contains("without an order.paid")),
            "{run}"
        );
        assert_eq!(run["by"], "cli", "{run}");
    }
    let gone = answer(
        app.consume(PAYMENTS, &f1, &json!({"subject": "u-old"}))
            .await,
    )
    .await;
    assert_eq!(
        (gone.0, gone.2["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_expired")),
        "purged after retention: {gone:?}"
    );
    let kept = answer(
        app.consume(PAYMENTS, &g, &json!({"subject": "u-old"}))
            .await,
    )
    .await;
    assert_eq!(kept.2["outcome"], "duplicate", "never revived: {kept:?}");
    app.stop().await;
}

#[tokio::test]
async fn dry_run_and_since_over_http_and_cli_change_nothing() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "u-h").await;
    let pg = app.pg().await;
    token_id(&pg, &token).await;
    let mut r = redis_conn().await;
    let _: () = r.del(app.token_key(&token)).await.expect("del");

    let resp = app
        .post(ADMIN, "/v1/admin/reconcile", &json!({"dry_run": true}))
        .await;
    let (s, _, body) = answer(resp).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(body["dry_run"], true);
    assert_eq!(body["by"], "admin", "the acting client: {body}");
    assert_eq!(body["found"]["redis_missing_but_live"], 1, "{body}");
    assert_eq!(body["repaired"]["redis_missing_but_live"], 0);
    for k in ["started_at", "finished_at"] {
        chrono::DateTime::parse_from_rfc3339(body[k].as_str().expect(k)).expect(k);
    }
    assert_eq!(state_of(&mut r, &app.token_key(&token)).await, None);

    // --since leaves older tokens alone (the window ends before this one).
    let config = cli_config(&app.stores);
    let out = cli(&config, &["reconcile", "--dry-run", "--since", "1ms"]).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("json report");
    assert_eq!(report["found"]["redis_missing_but_live"], 0, "{report}");
    assert_eq!(report["by"], "cli", "{report}");

    let out = cli(&config, &["reconcile", "--dry-run", "--format", "text"]).await;
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("redis_missing_but_live") && text.contains("dry run"),
        "{text}"
    );
    assert_eq!(state_of(&mut r, &app.token_key(&token)).await, None);

    // A body that is not JSON is refused and runs nothing.
    let resp = app
        .http
        .post(app.url("/v1/admin/reconcile"))
        .bearer_auth("dev-reconciler-key")
        .header("content-type", "text/plain")
        .body("dry_run")
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(state_of(&mut r, &app.token_key(&token)).await, None);

    // The reconciler role may run it, with no body at all (a cron's
    // `curl -X POST`): a real run, which repairs.
    let resp = app
        .http
        .post(app.url("/v1/admin/reconcile"))
        .bearer_auth("dev-reconciler-key")
        .send()
        .await
        .expect("sent");
    let (s, _, body) = answer(resp).await;
    assert_eq!(body["dry_run"], false, "{body}");
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(body["repaired"]["redis_missing_but_live"], 1, "{body}");
    assert_eq!(body["by"], "reconciler", "{body}");
    assert_eq!(
        state_of(&mut r, &app.token_key(&token)).await.as_deref(),
        Some("i")
    );
    // Its repair names who asked.
    let by: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT detail->>'class', detail->>'by' FROM audit_events
          WHERE kind = 'reconcile.repaired' ORDER BY id",
    )
    .fetch_all(&pg)
    .await
    .expect("repairs");
    assert_eq!(
        by,
        [(
            "redis_missing_but_live".to_owned(),
            Some("reconciler".to_owned())
        )]
    );
    // And so do the recorded runs, newest first (the refused POST ran nothing).
    let (s, _, runs) = answer(app.get(AUDITOR, "/v1/admin/reconcile/runs").await).await;
    assert_eq!(s, StatusCode::OK, "{runs}");
    let by: Vec<&Value> = runs["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .map(|r| &r["by"])
        .collect();
    assert_eq!(
        by,
        [
            &json!("reconciler"),
            &json!("cli"),
            &json!("cli"),
            &json!("admin")
        ],
        "{runs}"
    );
    app.stop().await;
}

/// Pauses a run at its first phase until told to go on.
struct Paused {
    started: mpsc::Sender<()>,
    go: std::sync::Mutex<mpsc::Receiver<()>>,
}

impl Progress for Paused {
    fn phase(&self, _: Phase, _: Option<u64>) {
        let _ = self.started.send(());
        let _ = self.go.lock().expect("lock").recv();
    }
    fn advance(&self, _: u64) {}
}

fn exit_code(out: &Output) -> Option<i32> {
    out.status.code()
}

#[tokio::test]
async fn one_run_at_a_time_across_library_cli_and_http() {
    let app = spawn_app().await;
    let stores = app.stores.clone();

    // Run 1 on a thread of its own, paused inside the lock.
    let (started_tx, started_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel();
    let first = {
        let stores = stores.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let (r, pools) = reconciler(&stores);
                let progress = Paused {
                    started: started_tx,
                    go: std::sync::Mutex::new(go_rx),
                };
                let out = r
                    .run(&Options::default(), &progress, &CancellationToken::new())
                    .await;
                pools.close().await;
                out.map(|_| ())
            })
        })
    };
    tokio::task::spawn_blocking(move || {
        started_rx.recv_timeout(std::time::Duration::from_secs(30))
    })
    .await
    .expect("join")
    .expect("the first run started");

    // While it holds the lock: the library says so, the CLI exits 3, HTTP 409.
    let (second, pools) = reconciler(&stores);
    let out = second
        .run(&Options::default(), &Quiet, &CancellationToken::new())
        .await;
    assert!(matches!(out, Err(ReconcileError::Running)), "{out:?}");
    pools.close().await;
    let config = cli_config(&stores);
    let out = cli(&config, &["reconcile"]).await;
    assert_eq!(
        exit_code(&out),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("another reconcile run"));
    let (s, _, body) = answer(
        app.post(ADMIN, "/v1/admin/reconcile", &json!({"dry_run": true}))
            .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::CONFLICT, Some("reconcile_running")),
        "{body}"
    );

    // Let the first run finish; then the lock is free again.
    go_tx.send(()).expect("go");
    for _ in 0..4 {
        let _ = go_tx.send(()); // one per remaining phase
    }
    let first = tokio::task::spawn_blocking(move || first.join())
        .await
        .expect("join")
        .expect("thread");
    assert!(first.is_ok(), "{first:?}");
    let out = cli(&config, &["reconcile"]).await;
    assert_eq!(
        exit_code(&out),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(report["dry_run"], false);

    // Two library runs at once: exactly one of them runs.
    let (a, pa) = reconciler(&stores);
    let (b, pb) = reconciler(&stores);
    let cancel = CancellationToken::new();
    let opts = Options::default();
    let (ra, rb) = tokio::join!(a.run(&opts, &Quiet, &cancel), b.run(&opts, &Quiet, &cancel));
    let ran = [ra.is_ok(), rb.is_ok()].iter().filter(|x| **x).count();
    let refused = [&ra, &rb]
        .iter()
        .filter(|r| matches!(r, Err(ReconcileError::Running)))
        .count();
    // Either they overlapped (one refused) or one finished before the other
    // took the lock (both ran); never both refused, never an error.
    assert!(ran >= 1 && ran + refused == 2, "{ra:?} {rb:?}");
    pa.close().await;
    pb.close().await;
    app.stop().await;
}

#[tokio::test]
async fn cli_usage_errors_exit_2() {
    let stores = Stores::fresh();
    let config = cli_config(&stores);
    for args in [
        vec!["reconcile", "--since", "soon"],
        vec!["reconcile", "--format", "xml"],
        vec!["audit", "events", "--limit", "1001"],
        vec!["audit", "events", "--since", "yesterday"],
        vec!["audit", "events", "--kind", "token.eaten"],
        vec!["audit", "events", "--format", "yaml"],
        vec!["audit", "token"],
    ] {
        let out = cli(&config, &args).await;
        assert_eq!(exit_code(&out), Some(2), "{args:?}");
    }
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-ledger"))
        .args(["--config", "/nonexistent/ledger.toml", "reconcile"])
        .output()
        .await
        .expect("runs");
    assert_eq!(exit_code(&out), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--config"));
}

/// Cancels the run once `phase` has done `after` items (a Ctrl-C mid-phase).
struct CancelIn {
    phase: Phase,
    after: u64,
    cancel: CancellationToken,
    state: std::sync::Mutex<(Option<Phase>, u64)>,
}

impl Progress for CancelIn {
    fn phase(&self, phase: Phase, _: Option<u64>) {
        *self.state.lock().expect("lock") = (Some(phase), 0);
    }
    fn advance(&self, n: u64) {
        let mut s = self.state.lock().expect("lock");
        s.1 += n;
        if s.0 == Some(self.phase) && s.1 >= self.after {
            self.cancel.cancel();
        }
    }
}

#[tokio::test]
async fn an_interrupted_run_stops_between_batches_and_a_rerun_finishes() {
    let stores = Stores::fresh().with("reconcile.batch_size = 2");
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    let mut r = redis_conn().await;
    let mut keys = Vec::new();
    for i in 0..6 {
        let t = app.issue(PAYMENTS, "order", &format!("int-{i}")).await;
        token_id(&pg, &t).await;
        keys.push(app.token_key(&t));
    }
    for k in &keys {
        let _: () = r.del(k).await.expect("del");
    }

    let (rec, pools) = reconciler(&stores);
    let cancel = CancellationToken::new();
    let progress = CancelIn {
        phase: Phase::LiveTokens,
        after: 1,
        cancel: cancel.clone(),
        state: std::sync::Mutex::new((None, 0)),
    };
    let first = rec
        .run(&Options::default(), &progress, &cancel)
        .await
        .expect("runs");
    assert!(first.interrupted, "{first:#?}");
    assert_eq!(
        first.repaired.get(Class::RedisMissingButLive),
        2,
        "one batch, then stop"
    );
    assert_eq!(
        first.found.get(Class::ExpiredPurgeable),
        0,
        "later phases did not run"
    );

    // The lock went with the interrupted run; the rerun does the rest.
    let second = rec
        .run(&Options::default(), &Quiet, &CancellationToken::new())
        .await
        .expect("runs");
    assert!(!second.interrupted);
    assert_eq!(
        second.repaired.get(Class::RedisMissingButLive),
        4,
        "{second:#?}"
    );
    let third = rec
        .run(&Options::default(), &Quiet, &CancellationToken::new())
        .await
        .expect("runs");
    assert_eq!(third.found, Classes::default());
    for k in &keys {
        assert_eq!(state_of(&mut r, k).await.as_deref(), Some("i"));
    }
    pools.close().await;
    app.stop().await;
}

/// On a Redis Cluster, `reconcile` scans every master (each holds a share of
/// the token keys) and repairs through the cluster connection. With 12
/// tokens per class, all of a class on one master has probability 3 x 3^-12:
/// a reconcile that scanned one node only would find a third of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_every_master_is_scanned_and_repaired() {
    let cluster = Cluster::start();
    let stores = Stores::fresh()
        .redis("")
        .with(&cluster.config_line())
        .with("reconcile.batch_size = 5");
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    let mut r = redis::cluster::ClusterClient::new(cluster.urls())
        .expect("cluster client")
        .get_async_connection()
        .await
        .expect("cluster connection");
    async fn state(r: &mut redis::cluster_async::ClusterConnection, key: &str) -> Option<String> {
        r.hget(key, "s").await.expect("hget")
    }

    // Consumed in Postgres; their Redis markers are put back to "issued".
    let mut spent = Vec::new();
    for i in 0..12 {
        let subject = format!("spent-{i}");
        let token = app.issue(PAYMENTS, "order", &subject).await;
        let (s, _, body) = answer(
            app.consume(PAYMENTS, &token, &json!({"subject": subject}))
                .await,
        )
        .await;
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("consumed"))
        );
        spent.push((token, subject));
    }
    // Live; Redis loses their keys.
    let mut live = Vec::new();
    for i in 0..12 {
        let subject = format!("live-{i}");
        live.push((app.issue(PAYMENTS, "order", &subject).await, subject));
    }
    for (token, _) in spent.iter().chain(&live) {
        token_id(&pg, token).await;
    }
    for (token, _) in &spent {
        let key = app.token_key(token);
        wait_redis_state(&r, &key, "c", 5).await;
        let _: () = r.hset(&key, "s", "i").await.expect("hset");
    }
    for (token, _) in &live {
        let _: () = r.del(app.token_key(token)).await.expect("del");
    }

    let want = expected(12, 12, 0, 0, 0, 0);
    let dry = run(&stores, true).await;
    assert_eq!(dry.found, want, "{dry:#?}");
    assert_eq!(dry.repaired, Classes::default());
    let real = run(&stores, false).await;
    assert_eq!(real.found, want, "{real:#?}");
    assert_eq!(real.repaired, want, "{real:#?}");
    for (token, _) in &spent {
        assert_eq!(
            state(&mut r, &app.token_key(token)).await,
            None,
            "Postgres answers now"
        );
    }
    for (token, _) in &live {
        assert_eq!(
            state(&mut r, &app.token_key(token)).await.as_deref(),
            Some("i")
        );
    }
    let again = run(&stores, false).await;
    assert_eq!(again.found, Classes::default(), "{again:#?}");

    // The service agrees: spent stays spent, live consumes once.
    for (token, subject) in &spent {
        let body = answer(
            app.consume(PAYMENTS, token, &json!({"subject": subject}))
                .await,
        )
        .await
        .2;
        assert_eq!(body["outcome"], "duplicate", "{body}");
    }
    for (token, subject) in &live {
        let body = answer(
            app.consume(PAYMENTS, token, &json!({"subject": subject}))
                .await,
        )
        .await
        .2;
        assert_eq!(body["outcome"], "consumed", "{body}");
    }
    app.stop().await;
}

/// Postgres restored to a point before a durable consume (the row back to
/// `issued` at the generation before it) while Redis kept the consume's
/// marker: the marker is the only record of that consume. Reconcile reports
/// it (`redis_ahead_of_postgres`, with the token, in its recorded run too)
/// and keeps it, run after run; the token keeps answering `duplicate`.
/// Before the generations were compared, the marker was reset to live
/// (`redis_consumed_but_live`) and the paid token could be consumed again.
#[tokio::test]
async fn a_consume_redis_holds_ahead_of_a_restored_postgres_is_kept_and_reported() {
    let stores = Stores::fresh();
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    let mut r = redis_conn().await;
    let token = app.issue(PAYMENTS, "order", "u-restore").await;
    let body = json!({"subject": "u-restore", "request_id": "paid-1"});
    let (s, _, b) = answer(app.consume(PAYMENTS, &token, &body).await).await;
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let key = app.token_key(&token);
    wait_redis_state(&r, &key, "c", 5).await;
    // The restore: Postgres forgets the consume (row and audit as before it).
    let id = token_id(&pg, &token).await;
    sqlx::query(
        "UPDATE tokens SET state = 'issued', gen = gen - 1, consumed_at = NULL,
                           fingerprint = NULL, request_id = NULL
          WHERE id = $1",
    )
    .bind(id)
    .execute(&pg)
    .await
    .unwrap();

    for _ in 0..2 {
        let report = run(&stores, false).await;
        assert_eq!(report.found.get(Class::RedisAheadOfPostgres), 1);
        assert_eq!(report.repaired.get(Class::RedisAheadOfPostgres), 0);
        assert_eq!(report.found.get(Class::RedisConsumedButLive), 0);
        assert_eq!(report.redis_ahead_of_postgres, vec![token.clone()]);
        assert_eq!(state_of(&mut r, &key).await.as_deref(), Some("c"), "kept");
    }
    let other = json!({"subject": "u-restore", "request_id": "second-try"});
    let (s, _, b) = answer(app.consume(PAYMENTS, &token, &other).await).await;
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate")),
        "{b}"
    );

    // The recorded runs keep the whole report, for auditors too.
    let (s, _, runs) = answer(app.get(AUDITOR, "/v1/admin/reconcile/runs?limit=1").await).await;
    assert_eq!(s, StatusCode::OK, "{runs}");
    let last = &runs["runs"][0];
    assert_eq!(last["found"]["redis_ahead_of_postgres"], 1, "{runs}");
    assert_eq!(last["redis_ahead_of_postgres"], json!([token]), "{runs}");
    assert!(last["id"].as_str().is_some_and(|id| !id.is_empty()));
    assert!(
        runs["next_cursor"].is_string(),
        "two runs, a page of one: {runs}"
    );
    let cursor = runs["next_cursor"].as_str().unwrap().to_owned();
    let (s, _, older) = answer(
        app.get(
            AUDITOR,
            &format!("/v1/admin/reconcile/runs?limit=1&cursor={cursor}"),
        )
        .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(older["runs"].as_array().map(Vec::len), Some(1));
    assert!(older["next_cursor"].is_null(), "{older}");
    let (s, _, bad) = answer(app.get(AUDITOR, "/v1/admin/reconcile/runs?cursor=x").await).await;
    assert_eq!(
        (s, bad["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_cursor"))
    );
}

/// Rows the database's backends have returned, once the numbers settle
/// (backends report their counts at exit or within seconds of going idle).
/// `stats` holds one connection, kept open: a new connection's catalog reads
/// would count too.
async fn rows_returned_settled(stats: &PgPool, above: i64) -> i64 {
    let read = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT tup_returned FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(stats)
        .await
        .expect("pg_stat_database")
    };
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let (mut last, mut same_since) = (read().await, tokio::time::Instant::now());
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let n = read().await;
        let now = tokio::time::Instant::now();
        if n != last {
            (last, same_since) = (n, now);
        } else if n > above && now - same_since >= std::time::Duration::from_secs(2) {
            return n;
        }
        assert!(now < deadline, "the statistics did not settle: {n}");
    }
}

/// Phase 3 pages the live tokens by `(expires_at, id)`. For tokens issued
/// after the table's last `ANALYZE` the planner expected no row past the
/// cursor, so it read every row past the cursor and sorted them, on every
/// page: a run over N such tokens read about N²/2/page rows (200,000 of them
/// made a run take 34 s instead of 2). Each page now reads about a page.
#[tokio::test]
async fn live_tokens_newer_than_the_statistics_are_paged_not_read_again_per_page() {
    let stores = Stores::fresh().with("reconcile.batch_size = 100");
    let app = spawn_app_on(stores.clone()).await;
    app.stop().await;
    let pg = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&stores.db_url())
        .await
        .expect("setup pool");
    let fill = |from: i64, to: i64, expiry: &'static str| {
        let pg = pg.clone();
        async move {
            sqlx::query(
                "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at,
                                     expires_at)
                 SELECT tokens_day_first_id((now() AT TIME ZONE 'UTC')::date) - 1000000000 + g,
                        'order_t' || g, 'order', 'durable', 'u', 'payments', now(),
                        date_trunc('second', now()) + $3::interval + g * interval '1 second'
                   FROM generate_series($1::bigint, $2::bigint - 1) g",
            )
            .bind(from)
            .bind(to)
            .bind(expiry)
            .execute(&pg)
            .await
            .expect("tokens inserted");
        }
    };
    // 2,000 live tokens the statistics know, then 20,000 expiring later
    // that they do not (no autovacuum to analyze them meanwhile).
    sqlx::query("ALTER TABLE tokens_base SET (autovacuum_enabled = false)")
        .execute(&pg)
        .await
        .expect("autovacuum off");
    fill(0, 2_000, "1 hour").await;
    sqlx::query("ANALYZE tokens")
        .execute(&pg)
        .await
        .expect("analyze");
    fill(2_000, 22_000, "2 hours").await;
    pg.close().await;

    let stats = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect(&stores.db_url())
        .await
        .expect("stats pool");
    let before = rows_returned_settled(&stats, 0).await;
    let report = run(&stores, true).await;
    assert_eq!(report.found.get(Class::RedisMissingButLive), 22_000);
    let read = rows_returned_settled(&stats, before).await - before;
    // Linear: the 22,000 live rows, the purge's count and the run's own
    // bookkeeping (26,000 when measured); the rescan read 2,000,000.
    assert!(
        read < 100_000,
        "a dry run over 22,000 live tokens in pages of 100 read {read} rows"
    );
}
