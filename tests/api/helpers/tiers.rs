//! A test's own clients of the tiers, outside any app (own connections, own
//! metrics), as the CLI has them: the fast tier on a test's Redis and key
//! prefix, and a reconciler with pools of its own.

use std::sync::Arc;

use idempotency_ledger::clock::{Clock, SystemClock};
use idempotency_ledger::durable::Pools;
use idempotency_ledger::fast::FastTier;
use idempotency_ledger::metrics::Metrics;
use idempotency_ledger::reconcile::{Options, Quiet, Reconciler, Report, BY_CLI};
use tokio_util::sync::CancellationToken;

use crate::helpers::Stores;

/// A fast tier of its own on `stores`' Redis and key prefix (own
/// connections, own metrics, the system clock), as the CLI has; with the
/// metrics it counts into.
pub fn fast_tier(stores: &Stores) -> (Arc<FastTier>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let fast = FastTier::new(stores.settings().redis.clone(), metrics.clone(), clock);
    (fast, metrics)
}

/// A reconciler with pools of its own over the fast tier `fast`.
pub fn reconciler_on(stores: &Stores, fast: Arc<FastTier>) -> (Reconciler, Pools) {
    let settings = stores.settings();
    let pools = Pools::new(&settings.postgres).expect("pools");
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    (
        Reconciler::new(&settings, pools.admin.clone(), fast, clock),
        pools,
    )
}

/// One whole run (no errors, not interrupted), then the pools closed.
pub async fn run_on((r, pools): (Reconciler, Pools), dry_run: bool) -> Report {
    let report = r
        .run(
            &Options {
                dry_run,
                since: None,
                by: BY_CLI.to_owned(),
            },
            &Quiet,
            &CancellationToken::new(),
        )
        .await
        .expect("reconcile runs");
    pools.close().await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(!report.interrupted);
    report
}
