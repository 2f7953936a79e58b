//! The deploy kit (`deploy/`) against a running service: every metric that a
//! query of the Grafana dashboard or an alert rule names is exported by
//! `/metrics`, and every alert carries what an operator needs (a `for`, a
//! severity, a summary, a description and a runbook section that exists).

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{json, Value};

use crate::helpers::{spawn_app_on, Stores, ADMIN, PAYMENTS};

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

/// Metric names in a PromQL expression: identifiers beginning with `ledger_`
/// or `process_`, outside string literals (label values).
fn metric_names(expr: &str, into: &mut BTreeSet<String>) {
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c == b'"' || c == b'\'' || c == b'`' {
            i += 1;
            while i < bytes.len() && bytes[i] != c {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c.is_ascii_alphabetic() || c == b'_' || c == b':' {
            let start = i;
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b':')
            {
                i += 1;
            }
            let word = &expr[start..i];
            if word.starts_with("ledger_") || word.starts_with("process_") {
                into.insert(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
}

/// Every query string of a Grafana dashboard: panel targets' `expr` and the
/// template variables' queries, wherever they are nested (rows included).
fn dashboard_queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, val) in map {
                match (k.as_str(), val) {
                    ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                    ("query", Value::String(s)) => out.push(s.clone()),
                    _ => dashboard_queries(val, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| dashboard_queries(i, out)),
        _ => {}
    }
}

/// One alert rule of alerts.yml, read line by line (the file's own layout:
/// `- alert:` opens a rule, `expr:` is one line or a `|` block).
#[derive(Debug, Default)]
struct Alert {
    name: String,
    expr: String,
    has_for: bool,
    severity: Option<String>,
    summary: bool,
    description: bool,
    runbook: Option<String>,
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

fn alert_rules(yaml: &str) -> Vec<Alert> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut alerts: Vec<Alert> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let t = line.trim_start();
        let value = |key: &str| {
            t.strip_prefix(key)
                .map(|v| v.trim().trim_matches('"').to_owned())
        };
        if let Some(name) = value("- alert:") {
            alerts.push(Alert {
                name,
                ..Alert::default()
            });
        } else if let Some(alert) = alerts.last_mut() {
            if let Some(rest) = value("expr:") {
                if rest == "|" || rest == ">" || rest.is_empty() {
                    let own = indent(line);
                    while i + 1 < lines.len()
                        && (lines[i + 1].trim().is_empty() || indent(lines[i + 1]) > own)
                    {
                        i += 1;
                        alert.expr.push_str(lines[i].trim());
                        alert.expr.push(' ');
                    }
                } else {
                    alert.expr = rest;
                }
            } else if t.starts_with("for:") {
                alert.has_for = true;
            } else if let Some(s) = value("severity:") {
                alert.severity = Some(s);
            } else if t.starts_with("summary:") {
                alert.summary = true;
            } else if t.starts_with("description:") {
                alert.description = true;
            } else if let Some(r) = value("runbook_url:") {
                alert.runbook = Some(r);
            }
        }
        i += 1;
    }
    alerts
}

/// Names exported in a Prometheus text: every sample's name, and every
/// family named by `# TYPE` (a histogram's also as `_bucket`, `_sum`, `_count`).
fn exported_names(text: &str, into: &mut BTreeSet<String>) {
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                into.insert(name.to_owned());
                if kind == "histogram" || kind == "summary" {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        into.insert(format!("{name}{suffix}"));
                    }
                }
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            into.insert(line[..end].to_owned());
        }
    }
}

fn named_by_the_deploy_kit() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let dashboard: Value =
        serde_json::from_str(&repo_file("deploy/grafana/idempotency-ledger.json"))
            .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    dashboard_queries(&dashboard, &mut queries);
    assert!(
        queries.len() >= 20,
        "the dashboard's queries were not found: {queries:?}"
    );
    for q in &queries {
        metric_names(q, &mut names);
    }
    let alerts = alert_rules(&repo_file("deploy/prometheus/alerts.yml"));
    assert!(
        alerts.len() >= 10,
        "the alert rules were not found: {alerts:?}"
    );
    for a in &alerts {
        metric_names(&a.expr, &mut names);
    }
    names
}

#[test]
fn the_extraction_finds_the_names_and_ignores_label_values() {
    let mut names = BTreeSet::new();
    metric_names(
        r#"sum by (le) (rate(ledger_request_duration_seconds_bucket{endpoint="ledger_fake",x='process_no'}[5m])) / process_open_fds"#,
        &mut names,
    );
    let want: BTreeSet<String> = ["ledger_request_duration_seconds_bucket", "process_open_fds"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(names, want);

    let named = named_by_the_deploy_kit();
    for agreed in [
        "ledger_consume_total",
        "ledger_http_requests_total",
        "ledger_mode",
        "ledger_journal_lag_entries",
        "ledger_reconcile_last_finished_timestamp_seconds",
        "ledger_reconcile_last_found",
        "ledger_request_duration_seconds_bucket",
        "ledger_fast_tier_total",
        "ledger_pg_pool_connections",
        "ledger_postgres_replica_lag_seconds",
    ] {
        assert!(
            named.contains(agreed),
            "{agreed} is not used by the deploy kit"
        );
    }
}

#[test]
fn every_alert_has_a_for_a_severity_and_a_runbook_section() {
    let runbooks = repo_file("docs/operations.md");
    let alerts = alert_rules(&repo_file("deploy/prometheus/alerts.yml"));
    for a in &alerts {
        assert!(!a.expr.trim().is_empty(), "{}: no expr", a.name);
        assert!(a.has_for, "{}: no `for:`", a.name);
        assert!(
            matches!(a.severity.as_deref(), Some("critical" | "warning")),
            "{}: severity {:?}",
            a.name,
            a.severity
        );
        assert!(
            a.summary && a.description,
            "{}: summary and description",
            a.name
        );
        let want = format!("docs/operations.md#{}", a.name.to_lowercase());
        assert_eq!(
            a.runbook.as_deref(),
            Some(want.as_str()),
            "{}: runbook_url",
            a.name
        );
        assert!(
            runbooks.lines().any(|l| l == format!("#### {}", a.name)),
            "docs/operations.md has no section `#### {}`",
            a.name
        );
    }
}

/// Some families appear in the text only once observed: the requests below
/// make every one of them appear (an issue rate of 1/s gives a 429, an
/// instance without Redis bypasses it, a reconcile run records its findings,
/// an instance with `postgres.read_url` reports its replica).
#[tokio::test]
async fn every_metric_of_the_dashboard_and_alerts_is_exported() {
    let wanted = named_by_the_deploy_kit();

    let app = spawn_app_on(Stores::fresh().with(r#"biz.order.issue_rate = "1/s""#)).await;
    let token = app.issue(PAYMENTS, "order", "user-1").await;
    let body = json!({"subject": "user-1", "request_id": "r-1", "fingerprint": "f"});
    assert_eq!(app.consume(PAYMENTS, &token, &body).await.status(), 200);
    assert_eq!(
        app.consume(PAYMENTS, &token, &json!({"subject": "user-1"}))
            .await
            .status(),
        200
    );
    let r = app
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{token}/result"),
            &json!({"subject": "user-1", "result": {"ok": true}}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let limited = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "order", "subject": "user-1"}),
        )
        .await;
    assert_eq!(
        limited.status(),
        429,
        "the second issue within a second at 1/s"
    );
    let fast = app.issue(PAYMENTS, "like", "user-2").await;
    assert_eq!(
        app.consume(PAYMENTS, &fast, &json!({"subject": "user-2"}))
            .await
            .status(),
        200
    );
    let run = app.post(ADMIN, "/v1/admin/reconcile", &json!({})).await;
    assert_eq!(run.status(), 200, "a reconcile run");
    assert_eq!(app.get(PAYMENTS, "/v1/nowhere").await.status(), 404);

    // This one also reads through `postgres.read_url` (its own primary: lag
    // 0), which exports the read replica's metrics.
    let stores = Stores::fresh().redis("redis://127.0.0.1:1");
    let read_url = stores.db_url();
    let cut_off = spawn_app_on(stores.with(&format!("postgres.read_url = \"{read_url}\""))).await;
    let durable = cut_off.issue(PAYMENTS, "order", "user-3").await;
    assert_eq!(
        cut_off
            .consume(PAYMENTS, &durable, &json!({"subject": "user-3"}))
            .await
            .status(),
        200,
        "durable consumes work without Redis"
    );

    // Gauges read from Postgres or refreshed in the background may lag:
    // poll until everything is there (at most 20 s), then name what is missing.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let missing = loop {
        let mut exported = BTreeSet::new();
        exported_names(&app.metrics_text().await, &mut exported);
        exported_names(&cut_off.metrics_text().await, &mut exported);
        let missing: BTreeSet<String> = wanted.difference(&exported).cloned().collect();
        if missing.is_empty() || tokio::time::Instant::now() >= deadline {
            break missing;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(
        missing.is_empty(),
        "named by deploy/ but not exported by /metrics: {missing:?}"
    );
    app.stop().await;
    cut_off.stop().await;
}
