//! Phase 1: fast-type journal entries still in the Redis stream, written to
//! Postgres by the journal drainer's own code; then the dead letters named.

use super::report::{Class, Phase};
use super::run::{PhaseError, Run};
use crate::durable::reconcile::{self as sql, Repair};
use crate::journal::Drainer;

impl Run<'_> {
    /// Phase 1: fast-type journal entries not yet in Postgres; then the
    /// entries that can never apply are named in the report's errors.
    pub(super) async fn journal(&mut self) -> Result<(), PhaseError> {
        self.drain_journal().await?;
        let dead = self.r.fast.dead_letters().await?;
        if dead > 0 {
            self.errors.push(format!(
                "journal: {dead} entries can never apply and were set aside in the stream {} (each with its reason); they are not in Postgres",
                self.r.fast.journal_dead_key()
            ));
        }
        Ok(())
    }

    async fn drain_journal(&mut self) -> Result<(), PhaseError> {
        let waiting = self.r.fast.journal_len().await?;
        self.progress.phase(Phase::Journal, Some(waiting));
        self.found.add(Class::JournalNotDurable, waiting);
        if self.opts.dry_run || waiting == 0 {
            return Ok(());
        }
        // The journal drainer's own code, as consumer `reconcile`: entries an
        // earlier interrupted run read but did not acknowledge come first,
        // and the first round also claims what dead instances left pending.
        let mut drainer =
            Drainer::new(self.r.fast.clone(), self.pool().clone(), "reconcile".into())
                .claiming_at_once();
        loop {
            if self.cancel.is_cancelled() {
                return Ok(());
            }
            let n = drainer.drain_once().await?;
            if n == 0 {
                return Ok(());
            }
            sql::record_repairs(
                self.pool(),
                &self.opts.by,
                &[Repair {
                    class: Class::JournalNotDurable.as_str(),
                    action: "written",
                    token_id: None,
                    token: None,
                    subject: None,
                    biz_type: None,
                    client: None,
                    count: Some(n as i64),
                }],
            )
            .await?;
            self.repaired.add(Class::JournalNotDurable, n as u64);
            self.progress.advance(n as u64);
        }
    }
}
