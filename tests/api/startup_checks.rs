//! Start-up checks from DESIGN.md's measured facts.

use crate::helpers::procs::RedisProc;
use crate::helpers::*;

#[tokio::test]
async fn an_evicting_redis_is_flagged() {
    let redis =
        RedisProc::start_with_args(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]);
    let url = redis.url();
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
        .connect(&format!("{}/postgres", stores.pg_base))
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

/// The code's states are exactly the migrations' Postgres enums, and each
/// round-trips: what the service binds is what the column holds, and every
/// label the column can hold reads back (the mapping is by hand, in
/// `durable::pg_enum`).
#[tokio::test]
async fn every_stored_state_round_trips_through_its_postgres_enum() {
    use idempotency_ledger::domain::order::OrderState;
    use idempotency_ledger::durable::tokens::TokenState;
    let app = spawn_app().await;
    let pg = app.pg().await;

    let labels: Vec<String> =
        sqlx::query_scalar("SELECT unnest(enum_range(NULL::token_state))::text")
            .fetch_all(&pg)
            .await
            .expect("token_state labels");
    assert_eq!(labels, TokenState::ALL.map(|s| s.as_str().to_owned()));
    for state in TokenState::ALL {
        let (text, back): (String, TokenState) =
            sqlx::query_as("SELECT $1::token_state::text, $1::token_state")
                .bind(state)
                .fetch_one(&pg)
                .await
                .expect("token_state round trip");
        assert_eq!((text.as_str(), back), (state.as_str(), state));
    }

    let labels: Vec<String> =
        sqlx::query_scalar("SELECT unnest(enum_range(NULL::order_state))::text")
            .fetch_all(&pg)
            .await
            .expect("order_state labels");
    assert_eq!(labels, OrderState::ALL.map(|s| s.as_str().to_owned()));
    for state in OrderState::ALL {
        let (text, back): (String, OrderState) =
            sqlx::query_as("SELECT $1::order_state::text, $1::order_state")
                .bind(state)
                .fetch_one(&pg)
                .await
                .expect("order_state round trip");
        assert_eq!((text.as_str(), back), (state.as_str(), state));
    }
    app.stop().await;
}
