//! Processing leases (`biz.<name>.processing_lease`): the sweep that ends
//! them and the uncertain queue.
//!
//! One decider per tier, one clock each. Postgres's clock ends a lease in
//! Postgres: the sweep (every instance runs it each second; a row is marked
//! once under its row lock) marks a consume with neither result, release
//! nor order event `uncertain`, or, under `on_lease_expiry = "release"`,
//! releases a durable one in the same statement that finds it due. For a
//! fast type Redis decides: its duplicates answer `uncertain` once Redis's
//! clock says the marker outlived the lease ([`ran_out`]), and a `release`
//! lease is released by Redis, only at the generation the sweep found and
//! only once Redis's clock agrees (`fast_write.lua`, `lease_release`); the
//! journal carries the release to Postgres. Nothing runs on the consume
//! path: the sweep reads only consumes in flight (a partial index).

use chrono::{DateTime, Utc};

use super::api::LedgerError;
use super::core::Ledger;
use super::resync::Resync;
use crate::config::{Durability, LeaseExpiry, ProcessingLease};
use crate::durable::leases::{self as sql, UncertainRow};
use crate::durable::timed;
use crate::durable::tokens::TokenRecord;
use crate::fast::ReleaseWrite;
use crate::journal;

/// At most this many consumes are marked or released per biz type and sweep.
const SWEEP_BATCH: i64 = 1000;

/// Whether a consumed marker made at `at_ms` (Redis's clock) has outlived an
/// `uncertain` lease at `now_ms` (Redis's clock too).
pub(super) fn ran_out(lease: Option<ProcessingLease>, at_ms: i64, now_ms: i64) -> bool {
    match lease {
        Some(l) if l.on_expiry == LeaseExpiry::Uncertain && at_ms > 0 && now_ms > 0 => {
            now_ms.saturating_sub(at_ms) >= lease_ms(l)
        }
        _ => false,
    }
}

fn lease_ms(l: ProcessingLease) -> i64 {
    i64::try_from(l.length.as_millis()).unwrap_or(i64::MAX)
}

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    pub marked_uncertain: usize,
    pub released: usize,
}

impl Ledger {
    /// The lease of biz type `biz`, if it has one.
    fn lease_of(&self, biz: &str) -> Option<ProcessingLease> {
        self.settings
            .biz
            .iter()
            .find(|(name, _)| name.as_str() == biz)
            .and_then(|(_, b)| b.lease)
    }

    /// [`ran_out`] for biz type `biz`.
    pub(super) fn lease_ran_out(&self, biz: &str, at_ms: i64, now_ms: i64) -> bool {
        ran_out(self.lease_of(biz), at_ms, now_ms)
    }

    /// Ends the leases that ran out, for every biz type with one (see the
    /// module docs). Each item it changes wakes its waiting consumes.
    pub async fn sweep_leases(&self) -> Result<SweepReport, LedgerError> {
        let mut report = SweepReport::default();
        for (biz, b) in &self.settings.biz {
            let Some(lease) = b.lease else { continue };
            let secs = i64::try_from(lease.length.as_secs()).unwrap_or(i64::MAX);
            match (lease.on_expiry, b.durability) {
                (LeaseExpiry::Uncertain, _) => {
                    let ids = timed(
                        &self.metrics,
                        "lease_sweep",
                        self.pools.bounded(sql::mark_uncertain(
                            &self.pools.hot,
                            biz.as_str(),
                            secs,
                            SWEEP_BATCH,
                        )),
                    )
                    .await
                    .map_err(LedgerError::postgres)?;
                    for id in &ids {
                        self.changes.changed(*id);
                    }
                    if !ids.is_empty() {
                        tracing::info!(biz_type = %biz, items = ids.len(), "processing lease ran out: uncertain");
                    }
                    report.marked_uncertain += ids.len();
                }
                (LeaseExpiry::Release, Durability::Durable) => {
                    report.released += self.release_durable_due(biz.as_str(), secs).await?;
                }
                (LeaseExpiry::Release, Durability::Fast) => {
                    report.released += self.release_fast_due(biz.as_str(), lease, secs).await?;
                }
            }
        }
        Ok(report)
    }

    /// Releases the durable consumes of `biz` past their lease, and tells
    /// Redis the issued state at the new generation (queued when Redis
    /// does not answer).
    async fn release_durable_due(&self, biz: &str, secs: i64) -> Result<usize, LedgerError> {
        let released = timed(
            &self.metrics,
            "lease_sweep",
            self.pools
                .bounded(sql::release_due(&self.pools.hot, biz, secs, SWEEP_BATCH)),
        )
        .await
        .map_err(LedgerError::postgres)?;
        for r in &released {
            let until_ms = if r.is_key {
                self.clock.now_ms() + self.fast.consumed_ttl_ms()
            } else {
                r.expires_at.timestamp_millis()
            };
            let remaining = until_ms - self.clock.now_ms();
            if self
                .fast
                .write_issued(&r.handle, r.gen, remaining)
                .await
                .is_err()
            {
                self.catch_up.queue(Resync::Issued {
                    token: r.handle.clone(),
                    gen: r.gen,
                    expires_at_ms: until_ms,
                });
            }
            self.changes.changed(r.id);
        }
        if !released.is_empty() {
            tracing::info!(
                biz_type = biz,
                items = released.len(),
                "processing lease ran out: released"
            );
        }
        Ok(released.len())
    }

    /// Asks Redis to release the fast consumes of `biz` that Postgres's
    /// copy shows past their lease, each only at the generation found and
    /// once Redis's clock agrees the lease ran out.
    async fn release_fast_due(
        &self,
        biz: &str,
        lease: ProcessingLease,
        secs: i64,
    ) -> Result<usize, LedgerError> {
        let due = timed(
            &self.metrics,
            "lease_sweep",
            self.pools
                .bounded(sql::due_fast(&self.pools.hot, biz, secs, SWEEP_BATCH)),
        )
        .await
        .map_err(LedgerError::postgres)?;
        let mut released = 0;
        for d in due {
            let until_ms = if d.key.is_some() {
                self.clock.now_ms() + self.fast.consumed_ttl_ms()
            } else {
                d.expires_at.timestamp_millis()
            };
            let remaining = until_ms - self.clock.now_ms();
            let record = TokenRecord {
                id: d.id,
                token: d.handle.clone(),
                biz_type: d.biz_type,
                durability: Durability::Fast,
                subject: d.subject,
                client: d.client,
                issued_at: d.issued_at,
                expires_at: d.expires_at,
                key: d.key,
            };
            let fields =
                journal::admin_release_fields_for(&record, "lease", "processing lease ran out");
            // Through the fleet's gate, as a client's release, and recorded
            // for the going-down flush; with the gate closed, the next
            // sweep tries again.
            let Some(gate) = self.fleet.redis_may_decide() else {
                break;
            };
            let reply = self
                .fast
                .lease_release(
                    &d.handle,
                    remaining,
                    d.gen,
                    lease_ms(lease),
                    &fields,
                    Some(gate.dataset()),
                )
                .await;
            if let Ok(ReleaseWrite::Released { gen, at_ms }) = &reply {
                self.fleet
                    .decided_in_redis(&gate, journal::decided(fields.clone(), *gen, *at_ms));
            }
            drop(gate);
            match reply {
                Ok(ReleaseWrite::Released { .. }) => {
                    released += 1;
                    self.changes.changed(d.id);
                }
                // Resolved or consumed again meanwhile, Redis's clock not there
                // yet, or Redis no longer holds it (reconcile's case).
                Ok(ReleaseWrite::NotReleasable | ReleaseWrite::Miss) => {}
                // Redis restarted empty: the next sweep after the fleet's
                // episode tries again.
                Ok(ReleaseWrite::Foreign) => {
                    self.fleet.redis_foreign();
                    break;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "lease release not sent to redis; the next sweep tries again");
                    break;
                }
            }
        }
        if released > 0 {
            tracing::info!(
                biz_type = biz,
                items = released,
                "processing lease ran out: released"
            );
        }
        Ok(released)
    }

    /// A page of the uncertain queue (oldest first, after `after`), from the
    /// read pool (`postgres.read_url`'s replica when set).
    pub async fn uncertain_page(
        &self,
        biz: Option<&str>,
        after: Option<(DateTime<Utc>, i64)>,
        limit: i64,
    ) -> Result<Vec<UncertainRow>, LedgerError> {
        timed(
            &self.metrics,
            "uncertain",
            self.pools
                .bounded(sql::uncertain_page(&self.pools.read, biz, after, limit)),
        )
        .await
        .map_err(LedgerError::postgres)
    }

    /// How many items are uncertain, per biz type (from the read pool).
    pub async fn uncertain_counts(&self) -> Result<Vec<(String, i64)>, LedgerError> {
        self.pools
            .bounded(sql::uncertain_counts(&self.pools.read))
            .await
            .map_err(LedgerError::postgres)
    }

    /// Whether any biz type has a processing lease (the sweep runs only then).
    pub fn has_leases(&self) -> bool {
        self.settings.biz.values().any(|b| b.lease.is_some())
    }
}

/// `ledger_uncertain_items{biz_type}`: how many tokens and keys are
/// uncertain (past their lease with neither result nor release), fleet-wide,
/// read from Postgres when scraped. Alert `LedgerUncertainItems`.
pub fn uncertain_metric(pool: sqlx::PgPool, biz_types: Vec<String>) -> crate::metrics::OnScrape {
    // A static, valid definition.
    let gauge = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            "ledger_uncertain_items",
            "Consumed tokens and client keys whose processing lease ran out with neither result nor release (the uncertain queue, GET /v1/admin/uncertain), per biz type; each needs a human or a lookup at the payment provider.",
        ),
        &["biz_type"],
    )
    .expect("valid metric");
    for b in &biz_types {
        gauge.with_label_values(&[b]);
    }
    let g = gauge.clone();
    crate::metrics::OnScrape::new(
        vec![Box::new(gauge)],
        crate::reconcile::LAST_RUN_REFRESH,
        std::sync::Arc::new(move || {
            let (pool, g, bizes) = (pool.clone(), g.clone(), biz_types.clone());
            Box::pin(async move {
                match sql::uncertain_counts(&pool).await {
                    Ok(counts) => {
                        for b in &bizes {
                            let n = counts
                                .iter()
                                .find(|(name, _)| name == b)
                                .map_or(0, |(_, n)| *n);
                            g.with_label_values(&[b]).set(n);
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "uncertain items not counted"),
                }
            })
        }),
    )
}

/// Every second, while `shutdown` is not cancelled: [`Ledger::sweep_leases`]
/// (nothing when no biz type has a lease).
pub async fn run_sweeps(
    ledger: std::sync::Arc<Ledger>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    if !ledger.has_leases() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            _ = shutdown.cancelled() => return,
        }
        if let Err(e) = ledger.sweep_leases().await {
            tracing::warn!(error = %e, "processing lease sweep failed; the next one tries again");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn lease(secs: u64, on_expiry: LeaseExpiry) -> Option<ProcessingLease> {
        Some(ProcessingLease {
            length: Duration::from_secs(secs),
            on_expiry,
        })
    }

    #[test]
    fn a_marker_is_uncertain_from_the_lease_s_end_by_redis_s_clock() {
        let l = lease(2, LeaseExpiry::Uncertain);
        assert!(!ran_out(l, 10_000, 11_999));
        assert!(ran_out(l, 10_000, 12_000));
        assert!(ran_out(l, 10_000, 99_000));
    }

    #[test]
    fn no_lease_a_release_lease_or_an_unknown_time_is_never_uncertain() {
        assert!(!ran_out(None, 10_000, 99_000));
        assert!(!ran_out(lease(2, LeaseExpiry::Release), 10_000, 99_000));
        assert!(!ran_out(lease(2, LeaseExpiry::Uncertain), 0, 99_000));
        assert!(!ran_out(lease(2, LeaseExpiry::Uncertain), 10_000, 0));
    }
}
