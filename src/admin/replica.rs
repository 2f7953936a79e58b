//! Reads off the primary: how stale the answers of the admin reads may be
//! when `postgres.read_url` sends them to a replica (the `Ledger-Data-Lag`
//! header, [`Admin::data_lag`]) and the replica's lag as a gauge
//! ([`lag_metric`]).

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Gauge, IntGauge};
use sqlx::PgPool;

use super::{Admin, AdminError};
use crate::durable::admin::data_lag_ms;
use crate::metrics::OnScrape;

/// How often a scraped service asks the replica for its lag.
pub const LAG_REFRESH: Duration = Duration::from_secs(5);

impl Admin {
    /// How old the data of the next read may be: `None` when the reads go
    /// to the primary (always current); else the replica's lag, measured
    /// before the read, so the read's data is at most that old plus the
    /// time between (see [`data_lag_ms`] for what a replica can tell). A
    /// replica that cannot be reached fails it as any read
    /// ([`AdminError::Postgres`]: 503 `unavailable`).
    pub async fn data_lag(&self) -> Result<Option<Duration>, AdminError> {
        if !self.replica {
            return Ok(None);
        }
        let ms = data_lag_ms(&self.pool).await?;
        Ok(Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
    }
}

/// `ledger_postgres_replica_lag_seconds` (the replica's lag as last read,
/// see [`data_lag_ms`]) and `ledger_postgres_replica_up` (1 when that read
/// succeeded, 0 when the replica could not be asked; the lag then keeps its
/// last value), refreshed on scrape at most every [`LAG_REFRESH`]. Only
/// registered when `postgres.read_url` is set.
pub fn lag_metric(pool: PgPool) -> OnScrape {
    // Static, valid definitions.
    let lag = Gauge::new(
        "ledger_postgres_replica_lag_seconds",
        "How old the data of the read replica (postgres.read_url) may be, as last read: 0 when it has replayed all it received.",
    )
    .expect("valid metric");
    let up = IntGauge::new(
        "ledger_postgres_replica_up",
        "1 when the read replica (postgres.read_url) answered the last lag query, 0 when it did not.",
    )
    .expect("valid metric");
    let (l, u) = (lag.clone(), up.clone());
    OnScrape::new(
        vec![Box::new(lag), Box::new(up)],
        LAG_REFRESH,
        Arc::new(move || {
            let (pool, l, u) = (pool.clone(), l.clone(), u.clone());
            Box::pin(async move {
                match data_lag_ms(&pool).await {
                    Ok(ms) => {
                        l.set(ms as f64 / 1000.0);
                        u.set(1);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "the read replica's lag not read");
                        u.set(0);
                    }
                }
            })
        }),
    )
}
