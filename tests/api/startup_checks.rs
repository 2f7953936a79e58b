//! Start-up checks from DESIGN.md's measured facts.

use std::process::{Child, Command, Stdio};

use crate::helpers::*;

struct PrivateRedis(Child);

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

async fn private_redis(args: &[&str]) -> (PrivateRedis, String) {
    let port = free_port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server starts");
    let url = format!("redis://127.0.0.1:{port}");
    let guard = PrivateRedis(child);
    let client = redis::Client::open(url.as_str()).expect("url");
    eventually(10, || {
        let client = client.clone();
        async move {
            client
                .get_multiplexed_async_connection()
                .await
                .ok()
                .map(|_| ())
        }
    })
    .await;
    (guard, url)
}

#[tokio::test]
async fn an_evicting_redis_is_flagged() {
    let (_redis, url) =
        private_redis(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]).await;
    let app = spawn_app_on(Stores::fresh().redis(&url)).await;
    let text = app.metrics_text().await;
    assert!(text.contains("ledger_redis_eviction_unsafe 1"), "{text}");

    let app = spawn_app().await;
    let text = app.metrics_text().await;
    let policy: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut app.redis().await)
        .await
        .unwrap();
    let expected = if policy[1] == "noeviction" { 0 } else { 1 };
    assert!(text.contains(&format!("ledger_redis_eviction_unsafe {expected}")));
}

#[tokio::test]
async fn durable_sessions_commit_synchronously_whatever_the_database_default() {
    let stores = Stores::fresh();
    // Create the database with synchronous_commit off as its default.
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!("{PG_BASE}/postgres"))
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE \"{}\"", stores.db_name))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(&format!(
        "ALTER DATABASE \"{}\" SET synchronous_commit = off",
        stores.db_name
    ))
    .execute(&admin)
    .await
    .unwrap();
    let app = spawn_app_on(stores).await;
    // Pools built as the service builds its own (same connect options).
    let pools = idempotency_ledger::durable::Pools::new(&app.stores.settings().postgres).unwrap();
    let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&pools.hot)
        .await
        .unwrap();
    assert_eq!(setting, "on");
    // A plain session of that database does get `off`: the check is not vacuous.
    let plain: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&app.pg().await)
        .await
        .unwrap();
    assert_eq!(plain, "off");
}
