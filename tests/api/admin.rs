//! Admin routes and the `audit` CLI: one token's story, audit pages under
//! concurrent writes, stats that match what the test did, role checks, exit
//! codes and output formats.

use std::collections::HashSet;

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

async fn get_json(app: &TestApp, key: &str, path: &str) -> (StatusCode, Value) {
    let (s, _, body) = answer(app.get(key, path).await).await;
    (s, body)
}

#[tokio::test]
async fn token_story_with_events_and_duplicate_attempts() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "user-7").await;
    let body = json!({"subject": "user-7", "fingerprint": "sha256:ab", "request_id": "req-1"});
    assert_eq!(
        app.consume(PAYMENTS, &token, &body).await.status(),
        StatusCode::OK
    );
    let r = app
        .post(
            PAYMENTS,
            &format!("/v1/tokens/{token}/result"),
            &json!({"subject": "user-7", "result": {"paid": true}}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    for i in 0..2 {
        let (_, _, dup) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "user-7", "request_id": format!("other-{i}")}),
            )
            .await,
        )
        .await;
        assert_eq!(dup["outcome"], "duplicate");
    }
    let path = format!("/v1/admin/tokens/{token}");
    // duplicate_attempts reach Postgres with the writer's next flush.
    let view = eventually(10, || async {
        let (s, v) = get_json(&app, ADMIN, &path).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        (v["duplicate_attempts"] == 2).then_some(v)
    })
    .await;
    let keys: HashSet<&str> = view
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    let want: HashSet<&str> = [
        "token",
        "biz_type",
        "subject",
        "client",
        "state",
        "issued_at",
        "expires_at",
        "consumed_at",
        "fingerprint",
        "request_id",
        "result",
        "duplicate_attempts",
        "events",
    ]
    .into_iter()
    .collect();
    assert_eq!(keys, want, "exactly the fields of API.md");
    assert_eq!(view["token"], token.as_str());
    assert_eq!(view["biz_type"], "order");
    assert_eq!(view["subject"], "user-7");
    assert_eq!(view["client"], "payments");
    assert_eq!(view["state"], "consumed");
    assert_eq!(view["fingerprint"], "sha256:ab");
    assert_eq!(view["request_id"], "req-1");
    assert_eq!(view["result"], json!({"paid": true}));
    for k in ["issued_at", "expires_at", "consumed_at"] {
        chrono::DateTime::parse_from_rfc3339(view[k].as_str().expect(k)).expect(k);
    }
    let kinds: Vec<&str> = view["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["kind"].as_str().expect("kind"))
        .collect();
    assert_eq!(kinds, ["token.issued", "token.consumed", "token.result"]);
    assert!(view["events"][0]["id"].is_string(), "ids are strings");

    // Issued and live; issued and past expiry (its row inserted by hand).
    let fresh = app.issue(PAYMENTS, "order", "user-8").await;
    let v = eventually(5, || async {
        let (s, v) = get_json(&app, ADMIN, &format!("/v1/admin/tokens/{fresh}")).await;
        (s == StatusCode::OK).then_some(v)
    })
    .await;
    assert_eq!(v["state"], "issued", "{v}");
    assert!(v["consumed_at"].is_null() && v["result"].is_null());
    let old_exp = (chrono::Utc::now().timestamp() - 60) as u32;
    let old = app.sign("order", 77_000_001, old_exp, "payments", "user-9");
    sqlx::query(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at)
         VALUES (77000001, $1, 'order', 'durable', 'user-9', 'payments', now() - interval '2 minutes',
                 now() - interval '1 minute')",
    )
    .bind(&old)
    .execute(&app.pg().await)
    .await
    .expect("row");
    let (s, v) = get_json(&app, ADMIN, &format!("/v1/admin/tokens/{old}")).await;
    assert_eq!(
        (s, v["state"].as_str()),
        (StatusCode::OK, Some("expired")),
        "{v}"
    );

    // A valid token nobody recorded: 404; garbage and overlong: 400.
    let unknown = app.sign("order", 77_000_002, old_exp + 10_000, "payments", "user-9");
    let (s, v) = get_json(&app, ADMIN, &format!("/v1/admin/tokens/{unknown}")).await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::NOT_FOUND, Some("token_not_found"))
    );
    let mut forged = token.clone();
    let last = forged.pop().expect("char");
    forged.push(if last == 'A' { 'B' } else { 'A' });
    for bad in [
        forged,
        "order_nope".to_owned(),
        format!("order_{}", "x".repeat(130)),
    ] {
        let (s, v) = get_json(&app, ADMIN, &format!("/v1/admin/tokens/{bad}")).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_invalid")),
            "{bad}"
        );
    }
    app.stop().await;
}

/// Inserts `n` audit events for `subject`; every ten share one `at`.
async fn insert_events(pg: &sqlx::PgPool, n: i64, subject: &str) {
    sqlx::query(
        "INSERT INTO audit_events (at, kind, subject, biz_type, client, detail)
         SELECT timestamptz '2026-01-01T00:00:00Z' + (g / 10) * interval '1 ms', 'token.issued',
                $2, 'order', 'payments', jsonb_build_object('n', g)
           FROM generate_series(1, $1) AS g",
    )
    .bind(n)
    .bind(subject)
    .execute(pg)
    .await
    .expect("events inserted");
}

#[tokio::test]
async fn paging_2500_events_while_writing_has_no_duplicates_or_gaps() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    insert_events(&pg, 2_500, "pager").await;
    let before: HashSet<String> = sqlx::query_scalar::<_, i64>("SELECT id FROM audit_events")
        .fetch_all(&pg)
        .await
        .expect("ids")
        .into_iter()
        .map(|i| i.to_string())
        .collect();
    assert!(before.len() >= 2_500);

    // Writers: new events at now() (ahead of every page) and in the middle
    // of the range being paged (at times pages have already passed or not).
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = {
        let pg = pg.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.is_cancelled() {
                sqlx::query(
                    "INSERT INTO audit_events (at, kind, subject, biz_type, detail)
                     VALUES (now(), 'token.consumed', 'pager', 'order', '{}'),
                            (timestamptz '2026-01-01T00:00:00Z' + random() * interval '250 ms',
                             'token.consumed', 'pager', 'order', '{}')",
                )
                .execute(&pg)
                .await
                .expect("concurrent insert");
                n += 2;
                tokio::task::yield_now().await;
            }
            n
        })
    };

    for filter in ["", "&subject=pager"] {
        let mut seen: Vec<String> = Vec::new();
        let mut cursor: Option<String> = None;
        let mut last_at: Option<String> = None;
        loop {
            let path = match &cursor {
                None => format!("/v1/admin/audit?limit=97{filter}"),
                Some(c) => format!("/v1/admin/audit?limit=97{filter}&cursor={c}"),
            };
            let (s, page) = get_json(&app, ADMIN, &path).await;
            assert_eq!(s, StatusCode::OK, "{page}");
            let events = page["events"].as_array().expect("events");
            assert!(events.len() <= 97);
            for e in events {
                let at = e["at"].as_str().expect("at").to_owned();
                if let Some(prev) = &last_at {
                    assert!(at <= *prev, "newest first: {at} after {prev}");
                }
                last_at = Some(at);
                seen.push(e["id"].as_str().expect("id is a string").to_owned());
            }
            match page["next_cursor"].as_str() {
                Some(c) => cursor = Some(c.to_owned()),
                None => break,
            }
        }
        let unique: HashSet<&String> = seen.iter().collect();
        assert_eq!(unique.len(), seen.len(), "no event twice ({filter})");
        let missing = before.iter().filter(|id| !unique.contains(id)).count();
        assert_eq!(
            missing, 0,
            "every event that existed at the start ({filter})"
        );
    }
    stop.cancel();
    let written = writer.await.expect("writer");
    assert!(written > 0, "events were written while paging");
    app.stop().await;
}

#[tokio::test]
async fn audit_filters_limits_and_cursors() {
    let app = spawn_app().await;
    let t1 = app.issue(PAYMENTS, "order", "alice").await;
    let _t2 = app.issue(PAYMENTS, "refund", "alice").await;
    let _t3 = app.issue(PAYMENTS, "order", "bob").await;
    assert_eq!(
        app.consume(PAYMENTS, &t1, &json!({"subject": "alice"}))
            .await
            .status(),
        StatusCode::OK
    );
    // Issuance records are written in batches after the answer: wait for
    // all four events (bob's record may come in a later batch than alice's).
    eventually(5, || async {
        let (_, p) = get_json(&app, ADMIN, "/v1/admin/audit").await;
        (p["events"].as_array().map(Vec::len) == Some(4)).then_some(())
    })
    .await;
    let (_, page) = get_json(&app, ADMIN, "/v1/admin/audit?subject=alice").await;
    assert_eq!(page["events"].as_array().map(Vec::len), Some(3), "{page}");
    assert!(page["next_cursor"].is_null());
    let e = &page["events"][0];
    assert_eq!(e["kind"], "token.consumed", "newest first");
    let keys: HashSet<&str> = e
        .as_object()
        .expect("obj")
        .keys()
        .map(String::as_str)
        .collect();
    let want: HashSet<&str> = [
        "id", "at", "kind", "token", "subject", "biz_type", "order_id", "client", "detail",
    ]
    .into_iter()
    .collect();
    assert_eq!(keys, want);

    let count = |p: &Value| p["events"].as_array().map(Vec::len).unwrap_or(0);
    let (_, p) = get_json(&app, ADMIN, "/v1/admin/audit?subject=alice&biz_type=order").await;
    assert_eq!(count(&p), 2);
    let (_, p) = get_json(&app, ADMIN, "/v1/admin/audit?kind=token.issued").await;
    assert_eq!(count(&p), 3);
    let (_, p) = get_json(
        &app,
        ADMIN,
        "/v1/admin/audit?kind=token.consumed&subject=bob",
    )
    .await;
    assert_eq!(count(&p), 0);
    let (_, p) = get_json(&app, ADMIN, "/v1/admin/audit?since=2999-01-01T00:00:00Z").await;
    assert_eq!(count(&p), 0);
    let (_, p) = get_json(&app, ADMIN, "/v1/admin/audit?until=2000-01-01T00:00:00Z").await;
    assert_eq!(count(&p), 0);
    let (_, p) = get_json(
        &app,
        ADMIN,
        "/v1/admin/audit?since=2000-01-01T00:00:00Z&subject=",
    )
    .await;
    assert_eq!(count(&p), 4, "empty filter values mean any");

    // Pages of one: three pages, then null.
    let (_, p1) = get_json(&app, ADMIN, "/v1/admin/audit?subject=alice&limit=2").await;
    assert_eq!(count(&p1), 2);
    let c = p1["next_cursor"].as_str().expect("cursor");
    let (_, p2) = get_json(
        &app,
        ADMIN,
        &format!("/v1/admin/audit?subject=alice&limit=2&cursor={c}"),
    )
    .await;
    assert_eq!(count(&p2), 1);
    assert!(p2["next_cursor"].is_null());

    for (q, code) in [
        ("limit=1001", "invalid_request"),
        ("limit=0", "invalid_request"),
        ("limit=ten", "invalid_request"),
        ("kind=token.eaten", "invalid_request"),
        ("since=yesterday", "invalid_request"),
        ("colour=red", "invalid_request"),
        ("cursor=garbage!", "invalid_cursor"),
        ("cursor=YzE6eDox", "invalid_cursor"),
    ] {
        let (s, v) = get_json(&app, ADMIN, &format!("/v1/admin/audit?{q}")).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some(code)),
            "{q}: {v}"
        );
    }
    let (s, p) = get_json(&app, ADMIN, "/v1/admin/audit?limit=1000").await;
    assert_eq!((s, count(&p)), (StatusCode::OK, 4));
    app.stop().await;
}

#[tokio::test]
async fn stats_match_what_happened() {
    let app = spawn_app().await;
    let mut tokens = Vec::new();
    for i in 0..3 {
        tokens.push(app.issue(PAYMENTS, "order", &format!("s-{i}")).await);
    }
    for (i, t) in tokens.iter().take(2).enumerate() {
        let sub = format!("s-{i}");
        let (_, _, b) = answer(app.consume(PAYMENTS, t, &json!({"subject": sub})).await).await;
        assert_eq!(b["outcome"], "consumed");
    }
    let (_, _, b) = answer(
        app.consume(PAYMENTS, &tokens[0], &json!({"subject": "s-0"}))
            .await,
    )
    .await;
    assert_eq!(b["outcome"], "duplicate");
    let mut forged = tokens[2].clone();
    let last = forged.pop().expect("char");
    forged.push(if last == 'A' { 'B' } else { 'A' });
    let (s, _, _) = answer(
        app.consume(PAYMENTS, &forged, &json!({"subject": "s-2"}))
            .await,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let expired = app.sign(
        "order",
        55_000_001,
        (chrono::Utc::now().timestamp() - 5) as u32,
        "payments",
        "s-9",
    );
    let (s, _, b) = answer(
        app.consume(PAYMENTS, &expired, &json!({"subject": "s-9"}))
            .await,
    )
    .await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_expired"))
    );
    let like = app.issue(PAYMENTS, "like", "s-l").await;
    let (_, _, b) = answer(
        app.consume(PAYMENTS, &like, &json!({"subject": "s-l"}))
            .await,
    )
    .await;
    assert_eq!(b["outcome"], "consumed");

    let stats = eventually(10, || async {
        let (s, v) = get_json(&app, ADMIN, "/v1/admin/stats?window=1h").await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let order = &v["biz_types"]["order"];
        (order["issued"] == 3
            && order["consumed"] == 2
            && order["duplicates"] == 1
            && order["expired"] == 1
            && order["invalid"] == 1
            && v["biz_types"]["like"]["consumed"] == 1)
            .then_some(v)
    })
    .await;
    assert_eq!(stats["window"], "1h");
    assert_eq!(stats["mode"], "normal");
    let rate = stats["biz_types"]["order"]["duplicate_rate"]
        .as_f64()
        .expect("rate");
    assert!((rate - 1.0 / 3.0).abs() < 1e-9, "{rate}");
    assert_eq!(stats["biz_types"]["like"]["duplicate_rate"], 0.0);
    assert_eq!(
        stats["biz_types"]["refund"]["issued"], 0,
        "configured types are listed"
    );
    assert_eq!(
        stats["biz_types"]["refund"]["duplicate_rate"], 0.0,
        "0 when nothing was consumed"
    );

    let (s, v) = get_json(&app, ADMIN, "/v1/admin/stats").await;
    assert_eq!(
        (s, v["window"].as_str()),
        (StatusCode::OK, Some("1h")),
        "default window"
    );
    for bad in ["0m", "1w", "h", "-5m", "400d"] {
        let (s, v) = get_json(&app, ADMIN, &format!("/v1/admin/stats?window={bad}")).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_request")),
            "{bad}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn only_admins_reach_admin_routes() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "u").await;
    let gets = [
        format!("/v1/admin/tokens/{token}"),
        "/v1/admin/audit".to_owned(),
        "/v1/admin/stats?window=1h".to_owned(),
    ];
    for key in [PAYMENTS, REFUNDS] {
        for path in &gets {
            let (s, v) = get_json(&app, key, path).await;
            assert_eq!(
                (s, v["error"].as_str()),
                (StatusCode::FORBIDDEN, Some("forbidden")),
                "{path}"
            );
        }
        // Refused before the body is read: even a bad body is 403.
        for body in [json!({"dry_run": true}), json!({"nonsense": 1})] {
            let (s, _, v) = answer(app.post(key, "/v1/admin/reconcile", &body).await).await;
            assert_eq!(
                (s, v["error"].as_str()),
                (StatusCode::FORBIDDEN, Some("forbidden"))
            );
        }
    }
    // The reconciler runs reconciliations and nothing else.
    for path in &gets {
        let (s, _) = get_json(&app, "dev-reconciler-key", path).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{path}");
    }
    // No key or a wrong one: 401 first.
    for path in &gets {
        let r = app.http.get(app.url(path)).send().await.expect("sent");
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        let (s, _) = get_json(&app, "wrong-key", path).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }
    let (s, _, v) = answer(
        app.post(ADMIN, "/v1/admin/reconcile", &json!({"dry_run": "yes"}))
            .await,
    )
    .await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_request"))
    );
    let r = app
        .http
        .get(app.url("/v1/admin/reconcile"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("sent");
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    let doc = app
        .get(ADMIN, "/openapi.json")
        .await
        .json::<Value>()
        .await
        .expect("json");
    for p in [
        "/v1/admin/tokens/{token}",
        "/v1/admin/audit",
        "/v1/admin/stats",
        "/v1/admin/reconcile",
    ] {
        assert!(
            doc["paths"][p].is_object(),
            "{p} in the OpenAPI description"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn audit_cli_formats_and_exit_codes() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "carol").await;
    assert_eq!(
        app.consume(
            PAYMENTS,
            &token,
            &json!({"subject": "carol", "request_id": "r-c"})
        )
        .await
        .status(),
        StatusCode::OK
    );
    let (_, http_view) = eventually(5, || async {
        let (s, v) = get_json(&app, ADMIN, &format!("/v1/admin/tokens/{token}")).await;
        (s == StatusCode::OK && v["events"].as_array().map(Vec::len) == Some(2)).then_some((s, v))
    })
    .await;
    let config = cli_config(&app.stores);

    // audit token: json (also the default off a terminal) is the HTTP object.
    for args in [
        vec!["audit", "token", &token, "--format", "json"],
        vec!["audit", "token", &token],
    ] {
        let out = cli(&config, &args).await;
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(v, http_view);
    }
    let out = cli(&config, &["audit", "token", &token, "--format", "table"]).await;
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("consumed") && text.contains("carol") && text.contains("token.issued"),
        "{text}"
    );
    let unknown = app.sign("order", 88_000_001, 4_000_000_000, "payments", "carol");
    let out = cli(&config, &["audit", "token", &unknown]).await;
    assert_eq!(out.status.code(), Some(1), "not found");
    let out = cli(&config, &["audit", "token", "order_garbage"]).await;
    assert_eq!(out.status.code(), Some(2), "malformed token");

    // audit events: json (the HTTP page), csv, table.
    let out = cli(
        &config,
        &["audit", "events", "--subject", "carol", "--since", "1h"],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page: Value = serde_json::from_slice(&out.stdout).expect("json by default off a terminal");
    let (_, http_page) = get_json(&app, ADMIN, "/v1/admin/audit?subject=carol").await;
    assert_eq!(page, http_page);
    let out = cli(
        &config,
        &["audit", "events", "--subject", "carol", "--format", "csv"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0));
    let csv = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(
        lines[0],
        "id,at,kind,token,subject,biz_type,order_id,client,detail"
    );
    assert_eq!(lines.len(), 3, "{csv}");
    assert!(
        lines[1].contains("token.consumed")
            && lines[1].contains("\"{\"\"request_id\"\":\"\"r-c\"\"}\""),
        "{csv}"
    );
    let out = cli(
        &config,
        &[
            "audit",
            "events",
            "--subject",
            "carol",
            "--format",
            "table",
            "--limit",
            "1",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.starts_with("AT") && table.contains("KIND") && table.contains("--cursor"),
        "{table}"
    );
    let out = cli(
        &config,
        &[
            "audit",
            "events",
            "--kind",
            "order.paid",
            "--until",
            "2000-01-01T00:00:00Z",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0));
    let empty: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(empty, json!({"events": [], "next_cursor": null}));
    let out = cli(&config, &["audit", "events", "--cursor", "nope"]).await;
    assert_eq!(out.status.code(), Some(2), "bad cursor is a usage error");
    app.stop().await;
}

/// The auditor role reads every admin view (tokens, keys, audit, stats,
/// reconcile runs), and any token or order, and changes nothing: every call
/// that could change state answers 403 `forbidden`, whatever the route, and
/// leaves the token as it was. An operator's action records who acted.
#[tokio::test]
async fn an_auditor_reads_everything_and_changes_nothing() {
    let clients = r#"
[[clients]]
name = "payments"
role = "service"
key_sha256 = "47270087500f39d054d1f059a00fc29ab03f97ad73583a0248d04c601ab22d9d"
biz_types = ["order", "refund", "like"]

[[clients]]
name = "auditor"
role = "auditor"
key_sha256 = "46151c35c1c09bca0b049ce55099e4f67fd04efe91716eec70fd1fa8ce898163"
biz_types = []

[[clients]]
name = "ops-alice"
role = "admin"
key_sha256 = "83deaa74469f7bf0114d4cc85d4e30cb4f3b4760101302b33903e29c9bda450b"
biz_types = []
"#;
    // The last key's SHA-256 is that of "ops-alice-key".
    let app = spawn_app_on(Stores::fresh().with(clients)).await;
    let token = app.issue(PAYMENTS, "order", "u-audit").await;
    let body = json!({"subject": "u-audit", "request_id": "r-1"});
    assert_eq!(app.consume(PAYMENTS, &token, &body).await.status(), 200);
    let key_body = json!({"biz_type": "order", "key": "k-audit-1", "subject": "u-audit"});
    assert_eq!(
        app.post(PAYMENTS, "/v1/keys/consume", &key_body)
            .await
            .status(),
        200
    );
    let order =
        json!({"order_id": "o-audit", "subject": "u-audit", "amount_minor": 10, "currency": "EUR"});
    assert_eq!(app.post(PAYMENTS, "/v1/orders", &order).await.status(), 201);

    for path in [
        format!("/v1/admin/tokens/{token}"),
        "/v1/admin/keys?client=payments&biz_type=order&key=k-audit-1".to_owned(),
        "/v1/admin/audit?subject=u-audit".to_owned(),
        "/v1/admin/stats?window=1h".to_owned(),
        "/v1/admin/reconcile/runs".to_owned(),
        format!("/v1/tokens/{token}"),
        "/v1/orders/o-audit".to_owned(),
    ] {
        let (s, v) = get_json(&app, AUDITOR, &path).await;
        assert_eq!(s, StatusCode::OK, "{path}: {v}");
    }
    let (_, view) = get_json(&app, AUDITOR, &format!("/v1/admin/tokens/{token}")).await;
    assert_eq!(view["state"], "consumed");

    let reason = json!({"reason": "checking"});
    let writes: Vec<(String, Value)> = vec![
        (format!("/v1/admin/tokens/{token}/release"), reason.clone()),
        (
            "/v1/admin/keys/release".to_owned(),
            json!({"client": "payments", "biz_type": "order", "key": "k-audit-1", "reason": "x"}),
        ),
        ("/v1/admin/reconcile".to_owned(), json!({"dry_run": true})),
        (
            "/v1/tokens".to_owned(),
            json!({"biz_type": "order", "subject": "u-audit"}),
        ),
        (
            format!("/v1/tokens/{token}/release"),
            json!({"subject": "u-audit"}),
        ),
        (
            format!("/v1/tokens/{token}/result"),
            json!({"subject": "u-audit", "result": 1}),
        ),
        (
            "/v1/keys/consume".to_owned(),
            json!({"biz_type": "order", "key": "k-2"}),
        ),
        (
            "/v1/orders".to_owned(),
            json!({"order_id": "o-auditor", "subject": "u", "amount_minor": 1, "currency": "EUR"}),
        ),
    ];
    for (path, body) in &writes {
        let (s, _, v) = answer(app.post(AUDITOR, path, body).await).await;
        assert_eq!(
            (s, v["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("forbidden")),
            "{path}"
        );
    }
    let (_, view) = get_json(&app, AUDITOR, &format!("/v1/admin/tokens/{token}")).await;
    assert_eq!(view["state"], "consumed", "nothing changed");
    let (s, _) = get_json(&app, AUDITOR, "/v1/orders/o-auditor").await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // An operator's releases record who acted, for a token and for a key.
    let (s, _, v) = answer(
        app.post(
            "ops-alice-key",
            &format!("/v1/admin/tokens/{token}/release"),
            &reason,
        )
        .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let key_release = json!({"client": "payments", "biz_type": "order", "key": "k-audit-1", "reason": "stuck; INC-7"});
    let (s, _, v) = answer(
        app.post("ops-alice-key", "/v1/admin/keys/release", &key_release)
            .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, _, v) = answer(
        app.post("ops-alice-key", "/v1/admin/keys/release", &key_release)
            .await,
    )
    .await;
    assert_eq!(
        (s, v["error"].as_str()),
        (StatusCode::CONFLICT, Some("not_releasable")),
        "{v}"
    );
    let (_, page) = get_json(&app, AUDITOR, "/v1/admin/audit?kind=token.released").await;
    assert_eq!(page["events"][0]["detail"]["by"], "ops-alice", "{page}");
    let (_, page) = get_json(&app, AUDITOR, "/v1/admin/audit?kind=key.released").await;
    assert_eq!(page["events"][0]["detail"]["by"], "ops-alice", "{page}");
    assert_eq!(
        page["events"][0]["detail"]["reason"], "stuck; INC-7",
        "{page}"
    );
    // The key is consumable again.
    let (s, _, v) = answer(app.post(PAYMENTS, "/v1/keys/consume", &key_body).await).await;
    assert_eq!(
        (s, v["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{v}"
    );
    app.stop().await;
}
