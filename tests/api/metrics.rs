//! `/metrics` of a running service: every family API.md's Operations section
//! and the agreed names list, with values that follow what was done (a 404
//! counted under `unmatched`, a route under its pattern, the pools' sizes,
//! the last reconcile run as every instance reads it from Postgres).

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::scrape::{redis_calls, sample, serving_errors};
use crate::helpers::tiers::fast_tier;
use crate::helpers::*;

fn has_family(text: &str, name: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with(&format!("# TYPE {name} ")))
}

#[tokio::test]
async fn metrics_export_requests_by_status_process_build_pools_journal_and_reconcile() {
    let app = spawn_app().await;
    let r = app
        .http
        .get(app.url("/no/such/route"))
        .send()
        .await
        .expect("get");
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let token = app.issue(PAYMENTS, "order", "u-m").await;
    let r = app
        .consume(PAYMENTS, &token, &json!({"subject": "u-m"}))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = app
        .http
        .delete(app.url("/v1/tokens"))
        .bearer_auth(PAYMENTS)
        .send()
        .await
        .expect("delete");
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);

    let text = app.metrics_text().await;
    let requests = |endpoint: &str, method: &str, status: &str| {
        sample(
            &text,
            "ledger_http_requests_total",
            &[
                ("endpoint", endpoint),
                ("method", method),
                ("status", status),
            ],
        )
    };
    assert_eq!(requests("unmatched", "GET", "404"), Some(1.0), "{text}");
    assert_eq!(requests("/v1/tokens", "POST", "201"), Some(1.0), "{text}");
    assert_eq!(
        requests("/v1/tokens/{token}/consume", "POST", "200"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(requests("/v1/tokens", "DELETE", "405"), Some(1.0), "{text}");
    assert!(
        !text.contains(&token),
        "a raw path (with its token) became a label"
    );

    for family in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        let v = sample(&text, family, &[]).unwrap_or_else(|| panic!("{family}: {text}"));
        // CPU time is counted in whole seconds: a young process may have 0.
        let least = if family == "process_cpu_seconds_total" {
            0.0
        } else {
            1.0
        };
        assert!(v >= least, "{family} = {v}");
    }
    assert_eq!(
        sample(
            &text,
            "ledger_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0)
    );

    // The test config: pool_size 8, admin_pool_size 2; the consume used hot.
    let pool = |name: &str| sample(&text, "ledger_pg_pool_max_connections", &[("pool", name)]);
    assert_eq!(pool("hot"), Some(8.0));
    assert_eq!(pool("admin"), Some(2.0));
    let conns = |name: &str, state: &str| {
        sample(
            &text,
            "ledger_pg_pool_connections",
            &[("pool", name), ("state", state)],
        )
        .unwrap_or_else(|| panic!("{name}/{state}: {text}"))
    };
    let hot = conns("hot", "idle") + conns("hot", "busy");
    assert!((1.0..=8.0).contains(&hot), "hot connections {hot}");
    assert!(conns("admin", "idle") + conns("admin", "busy") <= 2.0);

    assert!(
        sample(&text, "ledger_journal_lag_entries", &[]).is_some(),
        "{text}"
    );
    assert_eq!(
        sample(&text, "ledger_journal_dead_letters_total", &[]),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &text,
            "ledger_reconcile_last_finished_timestamp_seconds",
            &[]
        ),
        Some(0.0),
        "never reconciled"
    );
    for class in [
        "redis_live_but_consumed",
        "redis_missing_but_live",
        "stale_provisional",
        "journal_not_durable",
        "order_inconsistent",
        "expired_purgeable",
        "redis_consumed_but_live",
    ] {
        assert_eq!(
            sample(&text, "ledger_reconcile_last_found", &[("class", class)]),
            Some(0.0),
            "{class}"
        );
    }
    // The families API.md lists from the start are still there.
    for family in [
        "ledger_tokens_issued_total",
        "ledger_consume_total",
        "ledger_request_duration_seconds",
        "ledger_tier_duration_seconds",
        "ledger_mode",
        "ledger_bloom_fill_ratio",
        "ledger_fast_tier_total",
    ] {
        assert!(has_family(&text, family), "{family}");
    }
    app.stop().await;
}

/// A run recorded in Postgres is exported by every instance, including one
/// that did not run it; a dry run is not a run that the alert counts.
#[tokio::test]
async fn the_last_complete_reconcile_run_is_exported_by_every_instance() {
    let a = spawn_app().await;
    let b = spawn_app_on(a.stores.clone()).await;
    let pg = a.pg().await;
    sqlx::query(
        "INSERT INTO orders (order_id, client, subject, state, amount_minor, refunded_minor, currency)
         VALUES ('o-metrics', 'payments', 'u-o', 'PAID', 1000, 0, 'CNY')",
    )
    .execute(&pg)
    .await
    .expect("order");
    sqlx::query(
        "INSERT INTO order_events (order_id, kind, token_id, token, amount_minor)
         VALUES ('o-metrics', 'order.created', NULL, NULL, 1000)",
    )
    .execute(&pg)
    .await
    .expect("event");

    let r = a
        .post(ADMIN, "/v1/admin/reconcile", &json!({"dry_run": true}))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = a
        .post(ADMIN, "/v1/admin/reconcile", &json!({"dry_run": false}))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let report: serde_json::Value = r.json().await.expect("report");
    let finished =
        chrono::DateTime::parse_from_rfc3339(report["finished_at"].as_str().expect("finished_at"))
            .expect("rfc 3339")
            .timestamp();

    let runs: Vec<(bool, bool)> =
        sqlx::query_as("SELECT dry_run, complete FROM reconcile_runs ORDER BY id")
            .fetch_all(&pg)
            .await
            .expect("runs");
    assert_eq!(runs, [(true, false), (false, true)]);

    let text = eventually(20, || async {
        let text = b.metrics_text().await;
        let at = sample(
            &text,
            "ledger_reconcile_last_finished_timestamp_seconds",
            &[],
        )?;
        (at > 0.0).then_some(text)
    })
    .await;
    let at = sample(
        &text,
        "ledger_reconcile_last_finished_timestamp_seconds",
        &[],
    )
    .expect("timestamp");
    assert!((at - finished as f64).abs() <= 1.0, "{at} vs {finished}");
    assert_eq!(
        sample(
            &text,
            "ledger_reconcile_last_found",
            &[("class", "order_inconsistent")]
        ),
        Some(1.0),
        "{text}"
    );
    b.stop().await;
    a.stop().await;
}

/// The lag is the journal stream's length: entries Postgres does not have yet
/// (no drainer runs here, so the entries stay), read when scraped.
#[tokio::test]
async fn journal_lag_counts_entries_waiting_in_the_stream() {
    let stores = Stores::fresh();
    let (fast, _) = fast_tier(&stores);
    let mut r = redis::Client::open(stores.redis_url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    for i in 0..3 {
        let _: String = redis::cmd("XADD")
            .arg(fast.journal_key())
            .arg("*")
            .arg("e")
            .arg(format!("[\"release\", {i}]"))
            .query_async(&mut r)
            .await
            .expect("xadd");
    }
    // Read when scraped: the first gather starts the read, a later one sees it.
    let registry = prometheus::Registry::new();
    registry
        .register(Box::new(idempotency_ledger::journal::lag_metric(&fast)))
        .expect("register");
    eventually(10, || async {
        let lag = registry
            .gather()
            .iter()
            .find(|f| f.name() == "ledger_journal_lag_entries")
            .and_then(|f| f.get_metric().first().map(|m| m.get_gauge().get_value()));
        (lag == Some(3.0)).then_some(())
    })
    .await;
    let _: () = redis::cmd("DEL")
        .arg(fast.journal_key())
        .query_async(&mut r)
        .await
        .expect("del");
}

/// `ledger_fast_tier_total{result="error"}` is the error share of the Redis
/// calls requests wait on: background work that fails (here the journal
/// drain, its stream replaced by a string, so every read is `WRONGTYPE`)
/// does not count, while a request's failed call does.
#[tokio::test]
async fn background_redis_failures_are_not_counted_as_the_serving_paths_errors() {
    let app = spawn_app().await;
    let (errors, reads) = (serving_errors, |text: &str| redis_calls(text, "xreadgroup"));
    let mut redis = app.redis().await;
    let journal = format!("{}journal", app.stores.prefix);
    let () = redis::pipe()
        .del(&journal)
        .ignore()
        .set(&journal, "not a stream")
        .ignore()
        .query_async(&mut redis)
        .await
        .expect("journal replaced");
    let before = app.metrics_text().await;
    // The drain tries again and again (every 500 ms after an error).
    let after = eventually(10, || {
        let (app, before) = (&app, &before);
        async move {
            let text = app.metrics_text().await;
            (reads(&text) >= reads(before) + 3.0).then_some(text)
        }
    })
    .await;
    assert_eq!(
        errors(&after),
        errors(&before),
        "background failures counted"
    );

    // A request's failed call is counted: a token whose key is not a hash.
    let token = app.issue(PAYMENTS, "order", "u-err").await;
    let key = format!("{}tok:{{{token}}}", app.stores.prefix);
    let () = redis::cmd("SET")
        .arg(&key)
        .arg("x")
        .query_async(&mut redis)
        .await
        .expect("key replaced");
    let r = app
        .consume(PAYMENTS, &token, &json!({"subject": "u-err"}))
        .await;
    let _ = r.status();
    let text = app.metrics_text().await;
    assert!(
        errors(&text) > errors(&before),
        "the consume's failed call counted: {:?} -> {:?}",
        errors(&before),
        errors(&text)
    );
    let () = redis::cmd("DEL")
        .arg(&journal)
        .query_async(&mut redis)
        .await
        .expect("journal key dropped");
    app.stop().await;
}
