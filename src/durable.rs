//! The durable tier: Postgres. Owns the pools and every SQL statement
//! ([`tokens`] for the token ledger, [`journal`] for the fast-type journal's
//! versioned apply, [`lease`] for snowflake worker ids,
//! [`setup`] for database creation, migrations and start-up checks,
//! [`admin`] for audit queries and stats, [`reconcile`] for reconciliation,
//! [`bloom`] for the issued-token filter's channel and load).
//! Every hot statement touches one token or one order key.

pub mod admin;
pub mod bloom;
pub mod journal;
pub mod lease;
pub mod orders;
pub mod reconcile;
pub mod setup;
pub mod tokens;

use std::time::Instant;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use crate::config::PostgresSettings;
use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum DurableError {
    /// Postgres could not be reached or did not answer in time: nothing was
    /// decided (or the outcome is unknown and the caller must retry).
    #[error("postgres unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// No answer within the client-side bound (a stopped or partitioned
    /// server never trips `statement_timeout`): the outcome is unknown.
    #[error("postgres did not answer within {0:?}")]
    TimedOut(std::time::Duration),
    #[error("postgres")]
    Other(#[source] sqlx::Error),
}

impl From<sqlx::Error> for DurableError {
    fn from(e: sqlx::Error) -> Self {
        let unavailable = match &e {
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => true,
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default();
                // 08: connection exception; 57: operator intervention (query
                // canceled by statement_timeout, admin shutdown); 53: out of
                // resources; 40001/40P01: serialization failure and deadlock
                // (retryable).
                code.starts_with("08")
                    || code.starts_with("57")
                    || code.starts_with("53")
                    || code == "40001"
                    || code == "40P01"
            }
            _ => false,
        };
        if unavailable {
            DurableError::Unavailable(e)
        } else {
            DurableError::Other(e)
        }
    }
}

impl DurableError {
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            DurableError::Unavailable(_) | DurableError::TimedOut(_)
        )
    }
}

/// The two pools: payments never wait behind admin queries.
#[derive(Debug, Clone)]
pub struct Pools {
    /// Consumes, issuance records, order events, the journal.
    pub hot: PgPool,
    /// Audit queries, stats, reconciliation.
    pub admin: PgPool,
    /// The longest a payment-path call may take on the client side:
    /// `acquire_timeout + statement_timeout` and a little for the network.
    pub deadline: std::time::Duration,
}

/// Connection options every pool uses: durable commits and bounded statements.
pub fn connect_options(settings: &PostgresSettings) -> Result<PgConnectOptions, sqlx::Error> {
    let timeout_ms = settings.statement_timeout.as_millis().to_string();
    let opts: PgConnectOptions = settings.url.parse()?;
    Ok(opts.application_name("idempotency-ledger").options([
        // Acknowledged consumes must survive a crash (DESIGN.md: with
        // synchronous_commit off, 1 to 47 acknowledged commits were lost).
        ("synchronous_commit", "on"),
        ("statement_timeout", timeout_ms.as_str()),
        ("lock_timeout", timeout_ms.as_str()),
        ("idle_in_transaction_session_timeout", "30000"),
    ]))
}

impl Pools {
    /// Lazily connecting pools: the first query connects.
    pub fn new(settings: &PostgresSettings) -> Result<Pools, sqlx::Error> {
        let opts = connect_options(settings)?;
        // No ping before each use: it is a round trip per statement (sqlx
        // already pings every connection when it goes back to the pool, so
        // an idle one was alive when it was returned). A connection that
        // dies while idle fails its next statement: that request answers
        // 503 `unavailable` and the connection is dropped.
        let hot = PgPoolOptions::new()
            .max_connections(settings.pool_size)
            .min_connections(0)
            .acquire_timeout(settings.acquire_timeout)
            .test_before_acquire(false)
            .connect_lazy_with(opts.clone());
        let admin = PgPoolOptions::new()
            .max_connections(settings.admin_pool_size)
            .min_connections(0)
            .acquire_timeout(settings.acquire_timeout)
            .connect_lazy_with(opts);
        let deadline = settings.acquire_timeout
            + settings.statement_timeout
            + std::time::Duration::from_millis(500);
        Ok(Pools {
            hot,
            admin,
            deadline,
        })
    }

    /// Runs one payment-path call with the client-side deadline, so that a
    /// Postgres that stopped answering (SIGSTOP, a network partition) costs a
    /// bounded time and answers [`DurableError::TimedOut`].
    pub async fn bounded<T, E, F>(&self, f: F) -> Result<T, DurableError>
    where
        F: std::future::Future<Output = Result<T, E>>,
        E: Into<DurableError>,
    {
        match tokio::time::timeout(self.deadline, f).await {
            Ok(out) => out.map_err(Into::into),
            Err(_) => Err(DurableError::TimedOut(self.deadline)),
        }
    }

    pub async fn close(&self) {
        self.hot.close().await;
        self.admin.close().await;
    }
}

/// Times one statement into `ledger_tier_duration_seconds{tier="postgres"}`.
pub(crate) async fn timed<T, E, F>(
    metrics: &Metrics,
    op: &'static str,
    f: F,
) -> Result<T, DurableError>
where
    F: std::future::Future<Output = Result<T, E>>,
    E: Into<DurableError>,
{
    let start = Instant::now();
    let out = f.await;
    metrics
        .tier_duration
        .with_label_values(&["postgres", op])
        .observe(start.elapsed().as_secs_f64());
    out.map_err(Into::into)
}

impl Pools {
    /// Whether the payment pool answers `SELECT 1` within `within` (readiness).
    pub async fn hot_reachable(&self, within: std::time::Duration) -> bool {
        let ping = sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(&self.hot);
        matches!(tokio::time::timeout(within, ping).await, Ok(Ok(_)))
    }
}
