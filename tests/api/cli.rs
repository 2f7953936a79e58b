//! The operator commands run as the built binary: `config check`, `client
//! new`, `audit events --all` (and the notice of a page that has more),
//! `audit token`'s "not found" versus "could not ask", `reconcile
//! --fail-on-inconsistent`, CSV cells that a spreadsheet would run, and
//! `health`.

use std::process::Output;

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

/// Runs the binary with `args` and extra environment variables (`LEDGER__*`
/// of the test process are not passed on).
async fn bin(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-ledger"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("LEDGER__")) {
        cmd.env_remove(k);
    }
    cmd.args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("the binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test]
async fn config_check_prints_the_effective_configuration_with_every_secret_redacted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("ledger.toml");
    std::fs::write(
        &file,
        r#"
[postgres]
url = "postgres://ledger:pg-pass-123@db.internal:5432/ledger?sslmode=disable"

[redis]
url = "redis://:redis-pass-456@cache.internal:6379/0"

[tokens]
signing_keys = [{ id = "k2", secret = "a-signing-secret-of-at-least-32-bytes-789" }]

[[clients]]
name = "shop"
role = "service"
key_sha256 = "1111111111111111111111111111111111111111111111111111111111111111"
biz_types = ["order"]
"#,
    )
    .expect("config");
    let path = file.to_str().expect("utf-8 path");
    let out = bin(
        &["config", "check", "--config", path],
        &[("LEDGER__SERVER__LISTEN", "0.0.0.0:9090")],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    for secret in ["pg-pass-123", "redis-pass-456", "a-signing-secret"] {
        assert!(!shown.contains(secret), "{secret} shown:\n{shown}");
    }
    // What it prints is the effective configuration, as TOML.
    let effective: toml::Table = shown.parse().expect("TOML");
    assert_eq!(effective["server"]["listen"].as_str(), Some("0.0.0.0:9090"));
    assert_eq!(
        effective["postgres"]["url"].as_str(),
        Some("postgres://ledger:REDACTED@db.internal:5432/ledger?sslmode=disable")
    );
    assert_eq!(
        effective["redis"]["url"].as_str(),
        Some("redis://:REDACTED@cache.internal:6379/0")
    );
    assert_eq!(
        effective["tokens"]["signing_keys"][0]["secret"].as_str(),
        Some("REDACTED")
    );
    assert_eq!(
        effective["clients"][0]["key_sha256"].as_str(),
        Some("1111111111111111111111111111111111111111111111111111111111111111"),
        "a key hash is no secret"
    );
    assert_eq!(effective["clients"].as_array().map(Vec::len), Some(1));

    // The embedded defaults alone are valid; their development secrets are
    // redacted too, and named on stderr.
    let out = bin(&["config", "check"], &[]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).contains("development-only-signing-secret"));
    assert!(
        text(&out.stderr).contains("development"),
        "{}",
        text(&out.stderr)
    );

    // Problems: exit 2 naming the first one.
    for (env, key) in [
        (("LEDGER__TOKENS__RETENTION", "soon"), "tokens.retention"),
        (("LEDGER__POSTGRES__POOL_SIZE", "many"), "pool_size"),
        (("LEDGER__SERVER__NO_SUCH_KEY", "1"), "no_such_key"),
        (("LEDGER__ENV", "production"), "development"),
    ] {
        let out = bin(&["config", "check"], &[env]).await;
        assert_eq!(out.status.code(), Some(2), "{env:?}");
        assert!(
            text(&out.stderr).contains(key),
            "{env:?}: {}",
            text(&out.stderr)
        );
        assert!(out.stdout.is_empty());
    }
    let out = bin(&["config", "check", "--config", "/no/such/file.toml"], &[]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--config"));
}

#[tokio::test]
async fn client_new_prints_a_fresh_key_once_and_a_block_that_admits_it() {
    let out = bin(
        &[
            "client",
            "new",
            "--name",
            "checkout",
            "--role",
            "service",
            "--biz-types",
            "order,refund",
        ],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    let key = shown
        .lines()
        .find(|l| l.starts_with("ilk_"))
        .expect("the key on a line of its own")
        .to_owned();
    assert_eq!(shown.matches(&key).count(), 1, "the key is printed once");
    let block = &shown[shown.find("[[clients]]").expect("the block")..];
    assert!(!block.contains(&key));
    let parsed: toml::Table = block.parse().expect("the block is TOML");
    let client = &parsed["clients"][0];
    use sha2::Digest;
    assert_eq!(
        client["key_sha256"].as_str(),
        Some(hex::encode(sha2::Sha256::digest(key.as_bytes())).as_str())
    );
    assert_eq!(client["role"].as_str(), Some("service"));

    // The block, pasted into the configuration, lets the key in.
    let app = spawn_app_on(Stores::fresh().with(block)).await;
    let r = app
        .post(
            &key,
            "/v1/tokens",
            &json!({"biz_type": "order", "subject": "u-new"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
    let r = app
        .post(
            PAYMENTS,
            "/v1/tokens",
            &json!({"biz_type": "order", "subject": "u-new"}),
        )
        .await;
    assert_eq!(
        r.status(),
        StatusCode::UNAUTHORIZED,
        "the list replaced the defaults"
    );
    app.stop().await;

    // JSON, for scripts; a second key is another key.
    let out = bin(
        &[
            "client", "new", "--name", "ops", "--role", "admin", "--format", "json",
        ],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(0));
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_ne!(v["api_key"].as_str(), Some(key.as_str()));
    assert_eq!(v["role"], "admin");
    assert!(v["toml"].as_str().expect("toml").contains("[[clients]]"));

    for bad in [
        vec!["client", "new", "--name", "x", "--role", "root"],
        vec![
            "client",
            "new",
            "--name",
            "x",
            "--role",
            "service",
            "--biz-types",
            "Order",
        ],
        vec!["client", "new", "--name", "", "--role", "service"],
    ] {
        let out = bin(&bad, &[]).await;
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
    }
}

async fn insert_events(app: &TestApp, subject: &str, n: i64) {
    let pg = app.pg().await;
    sqlx::query(
        "INSERT INTO audit_events (at, kind, subject, biz_type, client, detail)
         SELECT now() - make_interval(secs => g), 'token.issued', $1, 'order', 'payments', '{}'
           FROM generate_series(1, $2) g",
    )
    .bind(subject)
    .bind(n)
    .execute(&pg)
    .await
    .expect("events");
}

#[tokio::test]
async fn audit_events_all_exports_every_page_and_one_page_says_it_has_more() {
    let app = spawn_app().await;
    insert_events(&app, "=HYPERLINK(\"http://evil\")", 25).await;
    let config = cli_config(&app.stores);
    let subject = "=HYPERLINK(\"http://evil\")";

    let out = cli(
        &config,
        &[
            "audit",
            "events",
            "--subject",
            subject,
            "--limit",
            "10",
            "--format",
            "csv",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).lines().count(), 11);
    let notice = text(&out.stderr);
    assert!(
        notice.contains("--cursor") && notice.contains("--all"),
        "{notice}"
    );

    let out = cli(
        &config,
        &[
            "audit",
            "events",
            "--subject",
            subject,
            "--limit",
            "10",
            "--format",
            "csv",
            "--all",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let csv = text(&out.stdout);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 26, "one header, 25 events: {csv}");
    assert_eq!(lines.iter().filter(|l| l.starts_with("id,")).count(), 1);
    assert!(text(&out.stderr).is_empty(), "{}", text(&out.stderr));
    // The formula is text for a spreadsheet: a quote in front.
    let mut reader = csv::Reader::from_reader(csv.as_bytes());
    let subjects: Vec<String> = reader
        .records()
        .map(|r| r.expect("record")[4].to_owned())
        .collect();
    assert_eq!(subjects.len(), 25);
    assert!(
        subjects.iter().all(|s| s == &format!("'{subject}")),
        "{subjects:?}"
    );

    // JSON keeps the page's shape, every event in it, newest first, no cursor.
    let out = cli(
        &config,
        &[
            "audit",
            "events",
            "--subject",
            subject,
            "--limit",
            "7",
            "--all",
            "--format",
            "json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let all: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(all["next_cursor"], Value::Null);
    let events = all["events"].as_array().expect("events");
    assert_eq!(events.len(), 25);
    let ids: std::collections::HashSet<&str> = events
        .iter()
        .map(|e| e["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids.len(), 25, "no event twice");
    let at: Vec<&str> = events
        .iter()
        .map(|e| e["at"].as_str().expect("at"))
        .collect();
    assert!(at.windows(2).all(|w| w[0] >= w[1]), "newest first");
    // The first page of the export is the HTTP page.
    let (_, page) = {
        let r = app
            .get(
                ADMIN,
                &format!("/v1/admin/audit?limit=7&subject={}", url_escape(subject)),
            )
            .await;
        (r.status(), r.json::<Value>().await.expect("json"))
    };
    assert_eq!(
        &events[..7],
        page["events"].as_array().expect("events").as_slice()
    );

    // The table holds every event too.
    let out = cli(
        &config,
        &[
            "audit",
            "events",
            "--subject",
            subject,
            "--limit",
            "10",
            "--all",
            "--format",
            "table",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0));
    let table = text(&out.stdout);
    assert_eq!(table.matches("token.issued").count(), 25, "{table}");
    assert!(!table.contains("--cursor"));
    app.stop().await;
}

fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test]
async fn audit_token_tells_not_found_from_could_not_ask() {
    let app = spawn_app().await;
    let config = cli_config(&app.stores);
    let unknown = app.sign("order", 77_000_001, 4_000_000_000, "payments", "u");
    let out = cli(&config, &["audit", "token", &unknown]).await;
    assert_eq!(out.status.code(), Some(1), "not found");
    app.stop().await;

    // Postgres where nothing listens: nothing can be said about the token.
    let mut down = Stores::fresh();
    down.pg_base = format!("postgres://postgres@127.0.0.1:{}", free_port());
    let config = cli_config(&down);
    let out = cli(&config, &["audit", "token", &unknown]).await;
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    let out = cli(&config, &["audit", "events", "--limit", "1"]).await;
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
}

#[tokio::test]
async fn reconcile_fail_on_inconsistent_exits_4_when_it_found_an_inconsistent_order() {
    let app = spawn_app().await;
    let config = cli_config(&app.stores);
    let out = cli(&config, &["reconcile", "--fail-on-inconsistent"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    let pg = app.pg().await;
    sqlx::query(
        "INSERT INTO orders (order_id, client, subject, state, amount_minor, refunded_minor, currency)
         VALUES ('o-cli', 'payments', 'u-o', 'PAID', 1000, 0, 'CNY')",
    )
    .execute(&pg)
    .await
    .expect("order");
    sqlx::query(
        "INSERT INTO order_events (order_id, kind, token_id, token, amount_minor)
         VALUES ('o-cli', 'order.created', NULL, NULL, 1000)",
    )
    .execute(&pg)
    .await
    .expect("event");
    let out = cli(&config, &["reconcile", "--fail-on-inconsistent"]).await;
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).expect("the report still prints");
    assert_eq!(report["found"]["order_inconsistent"], 1);
    let out = cli(&config, &["reconcile"]).await;
    assert_eq!(out.status.code(), Some(0), "without the flag: finished");
    app.stop().await;
}

#[tokio::test]
async fn health_exits_0_while_the_service_answers_and_1_when_it_does_not() {
    let app = spawn_app().await;
    let port = app.address.rsplit(':').next().expect("port").to_owned();
    for path in ["/readyz", "/healthz"] {
        let url = format!("http://127.0.0.1:{port}{path}");
        let out = bin(&["health", "--url", &url], &[]).await;
        assert_eq!(out.status.code(), Some(0), "{url}: {}", text(&out.stderr));
    }
    // Without --url: server.listen of the configuration, 0.0.0.0 asked on loopback.
    let out = bin(
        &["health"],
        &[("LEDGER__SERVER__LISTEN", &format!("0.0.0.0:{port}"))],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // A 404 is no health.
    let out = bin(
        &["health", "--url", &format!("http://127.0.0.1:{port}/nope")],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("404"), "{}", text(&out.stderr));
    app.stop().await;

    let free = free_port();
    let out = bin(
        &[
            "health",
            "--url",
            &format!("http://127.0.0.1:{free}/readyz"),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    let out = bin(&["health", "--url", "https://127.0.0.1/readyz"], &[]).await;
    assert_eq!(out.status.code(), Some(2), "usage");
}

/// `audit order`, `audit key` and `audit reconcile-runs`: the admin views of
/// an order (with its events, oldest first), a client key, and the recorded
/// reconcile runs, as JSON; an unknown order or key exits 1.
#[tokio::test]
async fn audit_order_key_and_reconcile_runs_print_the_admin_views() {
    let app = spawn_app().await;
    let config = cli_config(&app.stores);
    let order = json!({"order_id": "o-audit-cli", "subject": "u-a", "amount_minor": 500, "currency": "EUR"});
    assert_eq!(app.post(PAYMENTS, "/v1/orders", &order).await.status(), 201);
    let token = app.issue(PAYMENTS, "order", "u-a").await;
    let r = app
        .post(
            PAYMENTS,
            "/v1/orders/o-audit-cli/pay",
            &json!({"token": token}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let key = json!({"biz_type": "order", "key": "k-cli", "subject": "u-a"});
    assert_eq!(
        app.post(PAYMENTS, "/v1/keys/consume", &key).await.status(),
        200
    );

    let out = cli(&config, &["audit", "order", "o-audit-cli"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let view: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(view["state"], "PAID");
    let kinds: Vec<&str> = view["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert_eq!(kinds, ["order.created", "order.paid"], "{view}");
    let out = cli(&config, &["audit", "order", "no-such-order"]).await;
    assert_eq!(out.status.code(), Some(1));

    let out = cli(
        &config,
        &[
            "audit",
            "key",
            "--client",
            "payments",
            "--biz-type",
            "order",
            "k-cli",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let view: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        (view["key"].as_str(), view["state"].as_str()),
        (Some("k-cli"), Some("consumed"))
    );
    let out = cli(
        &config,
        &[
            "audit",
            "key",
            "--client",
            "refunds",
            "--biz-type",
            "order",
            "k-cli",
        ],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(1),
        "another client's equal key is another key"
    );

    let out = cli(&config, &["reconcile", "--dry-run"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = cli(&config, &["audit", "reconcile-runs", "--limit", "5"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let page: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(page["runs"].as_array().map(Vec::len), Some(1), "{page}");
    assert_eq!(page["runs"][0]["dry_run"], true);
    assert!(page["runs"][0]["inconsistent_orders"].is_array());
    app.stop().await;
}

/// Runs the binary with `--config`, `args` and `LEDGER_API_KEY` set to
/// `key` (removed when `None`, whatever the test process has).
async fn cli_with_key(
    config: &tempfile::NamedTempFile,
    args: &[&str],
    key: Option<&str>,
) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-ledger"));
    cmd.arg("--config")
        .arg(config.path())
        .args(args)
        .env("RUST_LOG", "warn");
    match key {
        Some(k) => cmd.env("LEDGER_API_KEY", k),
        None => cmd.env_remove("LEDGER_API_KEY"),
    };
    cmd.output().await.expect("the binary runs")
}

/// Events of several kinds and clients for the filters.
async fn insert_mixed_events(app: &TestApp, subject: &str) {
    let pg = app.pg().await;
    sqlx::query(
        "INSERT INTO audit_events (at, kind, subject, biz_type, client, detail)
         SELECT now() - make_interval(secs => g),
                (ARRAY['token.issued', 'token.consumed', 'token.released'])[g % 3 + 1]::audit_kind,
                $1, 'order', (ARRAY['payments', 'refunds'])[g % 2 + 1], jsonb_build_object('g', g)
           FROM generate_series(1, 30) g",
    )
    .bind(subject)
    .execute(&pg)
    .await
    .expect("events");
}

fn kinds_and_clients(page: &Value) -> Vec<(String, String)> {
    page["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().expect("kind").to_owned(),
                e["client"].as_str().expect("client").to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn audit_events_filter_by_client_and_any_of_several_kinds_in_both_modes_and_the_api() {
    let app = spawn_app().await;
    let subject = "u-audit-filters";
    insert_mixed_events(&app, subject).await;
    let config = cli_config(&app.stores);

    // The API: kind repeated is any of them; client narrows.
    let r = app
        .get(
            AUDITOR,
            &format!("/v1/admin/audit?subject={subject}&kind=token.consumed&kind=token.released&client=refunds&limit=1000"),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let api: Value = r.json().await.expect("json");
    let got = kinds_and_clients(&api);
    // g in 1..=30 with g odd (refunds) and g % 3 != 0 (not token.issued).
    let want = (1..=30).filter(|g| g % 2 == 1 && g % 3 != 0).count();
    assert_eq!(got.len(), want, "{api}");
    assert!(got
        .iter()
        .all(|(k, c)| c == "refunds" && (k == "token.consumed" || k == "token.released")));
    assert!(got.iter().any(|(k, _)| k == "token.consumed"));
    assert!(got.iter().any(|(k, _)| k == "token.released"));
    // One kind, and no kind: the other counts.
    let one = app
        .get(
            AUDITOR,
            &format!("/v1/admin/audit?subject={subject}&kind=token.released&limit=1000"),
        )
        .await
        .json::<Value>()
        .await
        .expect("json");
    assert_eq!(
        kinds_and_clients(&one).len(),
        (1..=30).filter(|g| g % 3 == 1).count()
    );
    // Errors as before: an unknown kind (even beside a good one), an unknown
    // parameter, a parameter given twice.
    for query in [
        "kind=token.consumed&kind=token.eaten",
        "clients=refunds",
        "client=a&client=b",
    ] {
        let r = app.get(AUDITOR, &format!("/v1/admin/audit?{query}")).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{query}");
        let body: Value = r.json().await.expect("json");
        assert_eq!(body["error"], "invalid_request", "{query}: {body}");
    }

    // The keyset cursor still pages a filtered query: pages of 3 (JSON: the
    // CLI's stdout is a pipe).
    let filters = [
        "--subject",
        subject,
        "--kind",
        "token.consumed",
        "--kind",
        "token.released",
        "--client",
        "refunds",
    ];
    let db_all = cli(
        &config,
        &[&["audit", "events", "--limit", "3", "--all"], &filters[..]].concat(),
    )
    .await;
    assert_eq!(db_all.status.code(), Some(0), "{}", text(&db_all.stderr));
    let db_all: Value = serde_json::from_slice(&db_all.stdout).expect("json");
    assert_eq!(
        db_all["events"], api["events"],
        "the CLI's export is the API's page"
    );

    // Over HTTP with an auditor key: the very same bytes as the database
    // mode, for one page (JSON, table, CSV) and for --all.
    for extra in [
        vec!["--limit", "1000"],
        vec!["--limit", "4"],
        vec!["--limit", "3", "--all"],
        vec!["--limit", "3", "--all", "--format", "csv"],
        vec!["--limit", "5", "--format", "table"],
    ] {
        let args = [&["audit", "events"], &filters[..], &extra[..]].concat();
        let db = cli(&config, &args).await;
        let url_args = [&["audit", "--url", app.address.as_str()], &args[1..]].concat();
        let http = cli_with_key(&config, &url_args, Some(AUDITOR)).await;
        assert_eq!(db.status.code(), Some(0), "{extra:?}: {}", text(&db.stderr));
        assert_eq!(
            http.status.code(),
            Some(0),
            "{extra:?}: {}",
            text(&http.stderr)
        );
        assert!(!db.stdout.is_empty());
        assert_eq!(text(&http.stdout), text(&db.stdout), "{extra:?}");
        assert_eq!(text(&http.stderr), text(&db.stderr), "{extra:?}");
    }
    // --url after the subcommand too.
    let http = cli_with_key(
        &config,
        &[
            &["audit", "events"],
            &filters[..],
            &["--limit", "1000", "--url", app.address.as_str()],
        ]
        .concat(),
        Some(AUDITOR),
    )
    .await;
    assert_eq!(http.status.code(), Some(0), "{}", text(&http.stderr));
    let page: Value = serde_json::from_slice(&http.stdout).expect("json");
    assert_eq!(page["events"], api["events"]);
    app.stop().await;
}

#[tokio::test]
async fn audit_over_http_prints_what_the_database_mode_prints_and_maps_errors_to_exit_codes() {
    let app = spawn_app().await;
    let config = cli_config(&app.stores);
    let url = app.address.clone();
    let order = json!({"order_id": "o-audit-http", "subject": "u-h", "amount_minor": 700, "currency": "EUR"});
    assert_eq!(app.post(PAYMENTS, "/v1/orders", &order).await.status(), 201);
    let token = app.issue(PAYMENTS, "order", "u-h").await;
    let r = app
        .post(
            PAYMENTS,
            "/v1/orders/o-audit-http/pay",
            &json!({"token": token}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let key = json!({"biz_type": "order", "key": "k-http", "subject": "u-h"});
    assert_eq!(
        app.post(PAYMENTS, "/v1/keys/consume", &key).await.status(),
        200
    );
    let out = cli(&config, &["reconcile", "--dry-run"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    for args in [
        vec!["token", token.as_str(), "--format", "json"],
        vec!["token", token.as_str(), "--format", "table"],
        vec![
            "key",
            "--client",
            "payments",
            "--biz-type",
            "order",
            "k-http",
        ],
        vec!["order", "o-audit-http"],
        vec!["reconcile-runs", "--limit", "5"],
    ] {
        let db = cli(&config, &[&["audit"], &args[..]].concat()).await;
        let http = cli_with_key(
            &config,
            &[&["audit", "--url", url.as_str()], &args[..]].concat(),
            Some(AUDITOR),
        )
        .await;
        assert_eq!(db.status.code(), Some(0), "{args:?}: {}", text(&db.stderr));
        assert_eq!(
            http.status.code(),
            Some(0),
            "{args:?}: {}",
            text(&http.stderr)
        );
        assert_eq!(text(&http.stdout), text(&db.stdout), "{args:?}");
    }

    // Not found: 1, as in the database mode.
    let unknown = app.sign("order", 77_000_002, 4_000_000_000, "payments", "u");
    for args in [
        vec!["token", unknown.as_str()],
        vec!["order", "no-such-order"],
        vec![
            "key",
            "--client",
            "refunds",
            "--biz-type",
            "order",
            "k-http",
        ],
    ] {
        let out = cli_with_key(
            &config,
            &[&["audit", "--url", url.as_str()], &args[..]].concat(),
            Some(AUDITOR),
        )
        .await;
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    // Usage: 2 without a key, with a service key (naming forbidden), with a
    // wrong key, a bad URL, or for verify.
    let events = ["audit", "--url", url.as_str(), "events", "--limit", "1"];
    let out = cli_with_key(&config, &events, None).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("LEDGER_API_KEY"),
        "{}",
        text(&out.stderr)
    );
    let out = cli_with_key(&config, &events, Some(PAYMENTS)).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("forbidden"),
        "{}",
        text(&out.stderr)
    );
    let out = cli_with_key(&config, &events, Some("not-a-key")).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("unauthorized"),
        "{}",
        text(&out.stderr)
    );
    for bad in ["not a url", "ftp://127.0.0.1/", "127.0.0.1:8080"] {
        let out = cli_with_key(&config, &["audit", "--url", bad, "events"], Some(AUDITOR)).await;
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", text(&out.stderr));
    }
    let out = cli_with_key(
        &config,
        &["audit", "--url", url.as_str(), "verify"],
        Some(AUDITOR),
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("database only"),
        "{}",
        text(&out.stderr)
    );
    // A bad filter is the API's 400: 2.
    let out = cli_with_key(
        &config,
        &["audit", "--url", url.as_str(), "events", "--cursor", "nope"],
        Some(AUDITOR),
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("invalid_cursor"),
        "{}",
        text(&out.stderr)
    );
    app.stop().await;

    // Nothing listens there: could not ask, 5.
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    for args in [
        vec!["token", token.as_str()],
        vec!["events", "--limit", "1"],
    ] {
        let out = cli_with_key(
            &config,
            &[&["audit", "--url", nowhere.as_str()], &args[..]].concat(),
            Some(AUDITOR),
        )
        .await;
        assert_eq!(
            out.status.code(),
            Some(5),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}
