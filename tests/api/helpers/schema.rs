//! Databases at an older schema version, and snowflake ids of a given day:
//! for the tests of migrations and of day partitions.

use chrono::{Duration, NaiveTime, Utc};

use idempotency_ledger::token::SnowflakeId;

use super::Stores;

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// `stores`' database created and migrated up to `version`.
pub async fn database_at(stores: &Stores, version: u32) {
    let url = stores.db_url();
    idempotency_ledger::durable::setup::create_database_if_missing(&url)
        .await
        .expect("database");
    let (mut client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let task = tokio::spawn(conn);
    embedded::migrations::runner()
        .set_target(refinery::Target::Version(version))
        .run_async(&mut client)
        .await
        .expect("V1..");
    drop(client);
    let _ = task.await;
}

/// A snowflake id at noon (UTC) `days` from today.
pub fn id_at_noon(days: i64) -> i64 {
    let day = Utc::now().date_naive() + Duration::days(days);
    let noon = day.and_time(NaiveTime::from_hms_opt(12, 0, 0).expect("noon"));
    SnowflakeId::from_parts(noon.and_utc().timestamp_millis(), 1, 1).as_i64()
}
