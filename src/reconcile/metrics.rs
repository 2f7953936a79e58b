//! The last complete run's gauges, read from Postgres when scraped.

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Gauge, IntGaugeVec};
use sqlx::PgPool;

use super::report::Class;
use crate::durable::reconcile as sql;
use crate::durable::DurableError;
use crate::metrics::OnScrape;

/// How often a scrape may have the last run read again.
pub const LAST_RUN_REFRESH: Duration = Duration::from_secs(5);

/// `ledger_reconcile_last_finished_timestamp_seconds` and
/// `ledger_reconcile_last_found{class}`: the last complete run recorded in
/// Postgres, by whichever process ran it, read when scraped (see
/// [`OnScrape`]): one indexed query on the admin pool.
pub fn last_run_metrics(pool: PgPool) -> OnScrape {
    // Static, valid definitions.
    let finished = Gauge::new(
        "ledger_reconcile_last_finished_timestamp_seconds",
        "When the last complete reconcile run (not a dry run, not interrupted, every phase finished) finished, in Unix seconds, as recorded in Postgres; 0 if none.",
    )
    .expect("valid metric");
    let found = IntGaugeVec::new(
        prometheus::Opts::new(
            "ledger_reconcile_last_found",
            "What the last complete reconcile run found, per divergence class (order_inconsistent needs a human).",
        ),
        &["class"],
    )
    .expect("valid metric");
    for class in Class::ALL {
        found.with_label_values(&[class.as_str()]);
    }
    let (f, c) = (finished.clone(), found.clone());
    OnScrape::new(
        vec![Box::new(finished), Box::new(found)],
        LAST_RUN_REFRESH,
        Arc::new(move || {
            let (pool, f, c) = (pool.clone(), f.clone(), c.clone());
            Box::pin(async move {
                if let Err(e) = refresh_last_run(&pool, &f, &c).await {
                    tracing::debug!(error = %e, "last reconcile run not read");
                }
            })
        }),
    )
}

/// One refresh; while Postgres is unreachable the gauges keep their values.
async fn refresh_last_run(
    pool: &PgPool,
    finished: &Gauge,
    found: &IntGaugeVec,
) -> Result<(), DurableError> {
    let last = sql::last_complete_run(pool).await?;
    let (at, counts) = match &last {
        Some((at, counts)) => (at.timestamp_millis() as f64 / 1000.0, Some(counts)),
        None => (0.0, None),
    };
    finished.set(at);
    for class in Class::ALL {
        let n = counts
            .and_then(|f| f.get(class.as_str()))
            .copied()
            .unwrap_or(0);
        found.with_label_values(&[class.as_str()]).set(n);
    }
    Ok(())
}

/// `ledger_token_conflicts`: how many second decisions of one generation
/// (`token.conflict` audit events: two deciders both answered `consumed`)
/// Postgres has recorded, fleet-wide, read when scraped. Anything above 0
/// is a violation of exactly-once to investigate (alert
/// `LedgerTokenConflict`).
pub fn conflict_metric(pool: PgPool) -> OnScrape {
    // A static, valid definition.
    let conflicts = prometheus::IntGauge::new(
        "ledger_token_conflicts",
        "token.conflict audit events recorded in Postgres (a second consume decision for one generation of a token or key); anything above 0 needs a human.",
    )
    .expect("valid metric");
    let g = conflicts.clone();
    OnScrape::new(
        vec![Box::new(conflicts)],
        LAST_RUN_REFRESH,
        Arc::new(move || {
            let (pool, g) = (pool.clone(), g.clone());
            Box::pin(async move {
                match sql::conflicts(&pool).await {
                    Ok(n) => g.set(n),
                    Err(e) => tracing::debug!(error = %e, "conflicts not counted"),
                }
            })
        }),
    )
}
