//! Reads off the primary (`postgres.read_url`): the admin reads are served
//! by a streaming replica and say how old their data may be
//! (`Ledger-Data-Lag`), a token's state for its owner stays on the primary,
//! and a replica that is down fails the admin reads (503 `unavailable`)
//! while payments and `/readyz` carry on.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::procs::PgProc;
use crate::helpers::*;

const DATA_LAG: &str = "Ledger-Data-Lag";

/// An admin read: its status, its `Ledger-Data-Lag` (ms) if any, its body.
async fn admin_read(app: &TestApp, path: &str) -> (StatusCode, Option<u64>, Value) {
    let r = app.get(ADMIN, path).await;
    let lag = r
        .headers()
        .get(DATA_LAG)
        .map(|v| v.to_str().expect("ascii").parse::<u64>().expect("ms"));
    let (status, _, body) = answer(r).await;
    (status, lag, body)
}

/// Runs `statement` on `server`'s `postgres` database.
async fn on(server: &PgProc, statement: &str) {
    let pool = sqlx::PgPool::connect(&format!("{}/postgres", server.base()))
        .await
        .expect("connected");
    sqlx::query(statement)
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
    pool.close().await;
}

#[tokio::test]
async fn admin_reads_come_from_the_replica_and_say_how_stale_they_may_be() {
    let primary = PgProc::start();
    let replica = primary.replica();
    let stores = Stores::fresh().postgres(&primary.base());
    let read_url = format!("{}/{}", replica.base(), stores.db_name);
    let app = spawn_app_on(stores.with(&format!("postgres.read_url = \"{read_url}\""))).await;

    let token = app.issue(PAYMENTS, "order", "user-1").await;
    let path = format!("/v1/admin/tokens/{token}");
    // The issue reaches the replica by streaming.
    eventually(10, || async {
        let (s, lag, v) = admin_read(&app, &path).await;
        (s == StatusCode::OK && v["state"] == "issued" && lag.is_some()).then_some(())
    })
    .await;
    // The replica's lag gauge, read on scrape, and its pool's use.
    eventually(10, || async {
        let text = app.metrics_text().await;
        (text.contains("ledger_postgres_replica_up 1")
            && text.contains("ledger_postgres_replica_lag_seconds")
            && text.contains(r#"ledger_pg_pool_max_connections{pool="read"}"#))
        .then_some(())
    })
    .await;

    on(&replica, "SELECT pg_wal_replay_pause()").await;
    let consumed = app
        .consume(PAYMENTS, &token, &json!({"subject": "user-1"}))
        .await;
    assert_eq!(consumed.status(), StatusCode::OK);
    // Its owner reads the primary: consumed at once.
    let (s, _, owner) = answer(
        app.get(PAYMENTS, &format!("/v1/tokens/{token}?subject=user-1"))
            .await,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{owner}");
    assert_eq!(
        owner["state"], "consumed",
        "a token's state for its owner is fresh"
    );
    // The admin read does not see the consume yet, and says it may be stale.
    eventually(10, || async {
        let (s, lag, v) = admin_read(&app, &path).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["state"], "issued", "served by the paused replica: {v}");
        lag.filter(|ms| *ms > 0).map(|_| ())
    })
    .await;
    for other in [
        "/v1/admin/audit?limit=1",
        "/v1/admin/stats",
        "/v1/admin/reconcile/runs",
        "/v1/admin/uncertain",
    ] {
        let (s, lag, v) = admin_read(&app, other).await;
        assert_eq!(s, StatusCode::OK, "{other}: {v}");
        assert!(lag.is_some_and(|ms| ms > 0), "{other}: {lag:?}");
    }

    on(&replica, "SELECT pg_wal_replay_resume()").await;
    eventually(10, || async {
        let (s, lag, v) = admin_read(&app, &path).await;
        (s == StatusCode::OK && v["state"] == "consumed" && lag.is_some()).then_some(())
    })
    .await;

    // The replica down: admin reads answer 503, payments carry on, and the
    // service stays ready.
    replica.stop_immediate();
    let (s, lag, v) = admin_read(&app, &path).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"], "unavailable", "{v}");
    assert_eq!(lag, None);
    let next = app.issue(PAYMENTS, "order", "user-2").await;
    let r = app
        .consume(PAYMENTS, &next, &json!({"subject": "user-2"}))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let ready = app
        .http
        .get(app.url("/readyz"))
        .send()
        .await
        .expect("readyz");
    assert_eq!(ready.status(), StatusCode::OK);
    app.stop().await;
}

#[tokio::test]
async fn admin_reads_from_the_primary_carry_no_lag_header() {
    let app = spawn_app().await;
    let token = app.issue(PAYMENTS, "order", "user-1").await;
    // The issuance record reaches Postgres after the answer.
    let lag = eventually(10, || async {
        let (s, lag, _) = admin_read(&app, &format!("/v1/admin/tokens/{token}")).await;
        (s == StatusCode::OK).then_some(lag)
    })
    .await;
    assert_eq!(lag, None);
    let (s, lag, _) = admin_read(&app, "/v1/admin/stats").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(lag, None);
    app.stop().await;
}
