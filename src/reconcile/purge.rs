//! Phase 5: records past `tokens.retention` (and past their own expiry).
//! First the day partitions ahead are made (`partitions::ensure`); then each
//! day partition past its bound (the end of its day plus the longest biz-type
//! `ttl` plus the retention) whose rows are all past retention is dropped
//! whole; then what is left outside the day partitions not yet past their
//! bound is deleted in batches (`expired_purgeable`). Last, with
//! `audit.retention` set, each day partition of `audit_events` whose tokens'
//! partition is gone and whose events are all past it is verified against
//! its seals, recorded and dropped (`crate::audit_seal::retire`; not counted
//! in the report's classes: a partition kept because its events do not
//! verify is named in its errors).

use super::report::{Class, Phase};
use super::run::{PhaseError, Run};
use crate::audit_seal::retire::{Keep, Retire};
use crate::durable::partitions::{self, Dropped};
use crate::durable::reconcile::{self as sql, PurgeKind};

/// A partition's drop gives up on a busy `tokens` after this many tries, this
/// far apart (each waits at most 200 ms for its lock).
const DROP_ATTEMPTS: u32 = 3;
const DROP_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

impl Run<'_> {
    /// Phase 5: records past retention.
    pub(super) async fn purge(&mut self) -> Result<(), PhaseError> {
        let secs = self.r.retention.as_secs_f64();
        if !self.opts.dry_run {
            partitions::ensure(self.pool()).await?;
        }
        let grace = (self.r.max_ttl + self.r.retention).as_secs_f64();
        let days = partitions::days(self.pool(), grace).await?;
        let mut kept = partitions::kept_range(&days);
        let mut total = 0u64;
        for kind in [PurgeKind::Consumed, PurgeKind::Issued] {
            total += u64::try_from(sql::count_purgeable(self.pool(), kind, secs, kept).await?)
                .unwrap_or(0);
        }
        self.progress.phase(Phase::Purge, Some(total));
        self.found.add(Class::ExpiredPurgeable, total);
        if self.opts.dry_run {
            return Ok(());
        }
        for day in days.iter().filter(|d| d.past_bound) {
            if self.cancel.is_cancelled() {
                return Ok(());
            }
            let mut dropped = Dropped::Busy;
            for attempt in 0..DROP_ATTEMPTS {
                if attempt > 0 {
                    tokio::time::sleep(DROP_PAUSE).await;
                }
                dropped = partitions::drop_if_all_purgeable(self.pool(), day, secs, &self.opts.by)
                    .await?;
                if dropped != Dropped::Busy {
                    break;
                }
            }
            match dropped {
                Dropped::Rows(n) => {
                    let n = u64::try_from(n).unwrap_or(0);
                    tracing::info!(partition = %day.name, rows = n, "reconcile: partition dropped");
                    self.repaired.add(Class::ExpiredPurgeable, n);
                    self.progress.advance(n);
                }
                // Its purgeable rows go in batches below.
                Dropped::Kept => {}
                // Left whole for the next run: the batches below leave it,
                // and the days after it, alone.
                Dropped::Busy => {
                    tracing::warn!(partition = %day.name, "reconcile: partition busy, left for the next run");
                    if kept.0 == kept.1 || day.first_id < kept.0 {
                        kept = (day.first_id, days.last().map_or(day.end_id, |d| d.end_id));
                    }
                }
            }
        }
        for kind in [PurgeKind::Consumed, PurgeKind::Issued] {
            loop {
                if self.cancel.is_cancelled() {
                    return Ok(());
                }
                let n = sql::purge_batch(
                    self.pool(),
                    kind,
                    secs,
                    kept,
                    self.r.batch as i64,
                    &self.opts.by,
                )
                .await?;
                if n == 0 {
                    break;
                }
                self.repaired.add(Class::ExpiredPurgeable, n);
                self.progress.advance(n);
            }
        }
        self.retire_audit().await
    }

    /// The audit day partitions past `audit.retention`, one at a time.
    async fn retire_audit(&mut self) -> Result<(), PhaseError> {
        let Some(retention) = self.r.audit_retention else {
            return Ok(());
        };
        let days = partitions::audit_days(self.pool(), retention.as_secs_f64()).await?;
        for day in days.iter().filter(|d| d.past_bound && d.tokens_gone) {
            if self.cancel.is_cancelled() {
                return Ok(());
            }
            let mut outcome = Retire::Busy;
            for attempt in 0..DROP_ATTEMPTS {
                if attempt > 0 {
                    tokio::time::sleep(DROP_PAUSE).await;
                }
                outcome = self.r.seals.retire(day, retention, &self.opts.by).await?;
                if outcome != Retire::Busy {
                    break;
                }
            }
            match outcome {
                Retire::Dropped { events } => {
                    tracing::info!(partition = %day.name, events, "reconcile: audit partition retired");
                }
                Retire::Busy => {
                    tracing::warn!(partition = %day.name, "reconcile: audit partition busy, left for the next run");
                }
                Retire::Kept(Keep::DoesNotVerify(why)) => {
                    tracing::error!(partition = %day.name, why = %why, "reconcile: audit partition does not verify; kept");
                    self.errors.push(format!(
                        "audit retention: {} kept, its events do not verify against their seals: {why}",
                        day.name
                    ));
                }
                Retire::Kept(why) => {
                    tracing::info!(partition = %day.name, why = ?why, "reconcile: audit partition kept");
                }
            }
        }
        Ok(())
    }
}
