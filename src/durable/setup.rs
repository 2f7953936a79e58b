//! Creating the database when it is missing, running the refinery migrations
//! (through tokio-postgres, under an advisory lock so that instances starting
//! together do not race) and then making the day partitions of `tokens`
//! ahead, and the start-up checks from DESIGN.md.

use anyhow::Context;
use sqlx::Row;

use super::Pools;

refinery::embed_migrations!("migrations");

/// Advisory lock key held while migrating.
const MIGRATION_LOCK: i64 = 0x1ed6_e700_0001;

fn split_db(url: &str) -> anyhow::Result<(String, String)> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let slash = base
        .rfind('/')
        .filter(|i| *i > "postgres://".len())
        .context("postgres.url has no database name")?;
    let db = base[slash + 1..].to_owned();
    anyhow::ensure!(!db.is_empty(), "postgres.url has no database name");
    let mut maintenance = format!("{}/postgres", &base[..slash]);
    if let Some(q) = query {
        maintenance.push('?');
        maintenance.push_str(q);
    }
    Ok((maintenance, db))
}

/// One tokio-postgres connection over TLS as `url`'s `sslmode` asks, and the
/// task driving it. A failure names `postgres.url` and its TLS parameters;
/// a TLS failure says so.
async fn connect(
    url: &str,
    what: &str,
) -> anyhow::Result<(
    tokio_postgres::Client,
    tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
)> {
    let (config, tls, pg) = crate::tls::tokio_postgres(url)?;
    match config.connect(tls).await {
        Ok((client, conn)) => Ok((client, tokio::spawn(conn))),
        Err(e) if crate::tls::is_tls_error(&e) => {
            Err(anyhow::Error::new(e)
                .context(format!("{what}: TLS failed; check {}", pg.describe())))
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("{what} ({})", pg.describe()))),
    }
}

/// Creates the database named in `url` unless it exists.
pub async fn create_database_if_missing(url: &str) -> anyhow::Result<()> {
    let (maintenance, db) = split_db(url)?;
    let (client, task) = connect(
        &maintenance,
        "connecting to the postgres maintenance database",
    )
    .await?;
    let exists = client
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&db])
        .await?
        .is_some();
    if !exists {
        let quoted = format!("\"{}\"", db.replace('"', "\"\""));
        match client
            .batch_execute(&format!("CREATE DATABASE {quoted}"))
            .await
        {
            Ok(()) => tracing::info!(database = %db, "created database"),
            // Another instance created it meanwhile.
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_DATABASE) => {}
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {}
            Err(e) => return Err(e).context("creating the database"),
        }
    }
    drop(client);
    let _ = task.await;
    Ok(())
}

/// Applies pending migrations and makes the day partitions of `tokens`
/// ahead; returns how many migrations were applied.
pub async fn migrate(url: &str) -> anyhow::Result<usize> {
    let (mut client, task) = connect(url, "connecting to postgres for migrations").await?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await
        .context("taking the migration lock")?;
    let report = migrations::runner()
        .set_abort_divergent(true)
        .run_async(&mut client)
        .await
        .context("running migrations");
    // The day partitions of `tokens` ahead (V16), under the same lock; the
    // reconcile run makes them too.
    let made = match &report {
        Ok(_) => client
            .query_one(
                "SELECT tokens_ensure_partitions($1)",
                &[&super::partitions::DAYS_AHEAD],
            )
            .await
            .context("making the day partitions of tokens")
            .map(|r| r.get::<_, i32>(0)),
        Err(_) => Ok(0),
    };
    let _ = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await;
    drop(client);
    let _ = task.await;
    let report = report?;
    for m in report.applied_migrations() {
        tracing::info!(migration = %m, "applied migration");
    }
    let made = made?;
    if made > 0 {
        tracing::info!(partitions = made, "made day partitions of tokens");
    }
    Ok(report.applied_migrations().len())
}

/// Names `postgres.url` (and its TLS parameters) in an error of the first
/// sqlx connection; a TLS failure says so. Other errors pass unchanged.
pub fn name_postgres_url(url: &str, e: anyhow::Error) -> anyhow::Error {
    let describe = crate::tls::PgTls::from_url(url)
        .map(|t| t.describe())
        .unwrap_or_else(|_| "postgres.url".to_owned());
    if e.chain().any(crate::tls::is_tls_error) {
        e.context(format!("TLS failed; check {describe}"))
    } else if e.downcast_ref::<sqlx::Error>().is_some() {
        e.context(format!("connecting to postgres ({describe})"))
    } else {
        e
    }
}

/// Refuses to run when commits would not be durable; warns about fsync.
pub async fn check_durability(pools: &Pools) -> anyhow::Result<()> {
    let row = sqlx::query(
        "SELECT current_setting('synchronous_commit') AS sc, current_setting('fsync') AS fs",
    )
    .fetch_one(&pools.hot)
    .await
    .context("checking synchronous_commit")?;
    let sc: String = row.try_get("sc")?;
    let fs: String = row.try_get("fs")?;
    anyhow::ensure!(
        sc != "off" && sc != "local",
        "synchronous_commit is `{sc}` for the service's sessions: acknowledged consumes could be lost; refusing to start"
    );
    if fs == "off" {
        tracing::error!(
            "postgres runs with fsync = off: a crash of the server can lose acknowledged consumes"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::split_db;

    #[test]
    fn splits_database_name() {
        let (m, db) =
            split_db("postgres://postgres@127.0.0.1:5432/ledger?sslmode=disable").unwrap();
        assert_eq!(db, "ledger");
        assert_eq!(
            m,
            "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
        );
        assert!(split_db("postgres://127.0.0.1:5432").is_err());
    }
}
