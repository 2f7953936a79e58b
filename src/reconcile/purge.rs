//! Phase 5: records past `tokens.retention` (and past their own expiry),
//! deleted in batches (`expired_purgeable`).

use super::report::{Class, Phase};
use super::run::{PhaseError, Run};
use crate::durable::reconcile::{self as sql, PurgeKind};

impl Run<'_> {
    /// Phase 5: records past retention.
    pub(super) async fn purge(&mut self) -> Result<(), PhaseError> {
        let secs = self.r.retention.as_secs_f64();
        let mut total = 0u64;
        for kind in [PurgeKind::Consumed, PurgeKind::Issued] {
            total +=
                u64::try_from(sql::count_purgeable(self.pool(), kind, secs).await?).unwrap_or(0);
        }
        self.progress.phase(Phase::Purge, Some(total));
        self.found.add(Class::ExpiredPurgeable, total);
        if self.opts.dry_run {
            return Ok(());
        }
        for kind in [PurgeKind::Consumed, PurgeKind::Issued] {
            loop {
                if self.cancel.is_cancelled() {
                    return Ok(());
                }
                let n =
                    sql::purge_batch(self.pool(), kind, secs, self.r.batch as i64, &self.opts.by)
                        .await?;
                if n == 0 {
                    break;
                }
                self.repaired.add(Class::ExpiredPurgeable, n);
                self.progress.advance(n);
            }
        }
        Ok(())
    }
}
