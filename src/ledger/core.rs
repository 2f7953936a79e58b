//! The [`Ledger`]: what it holds (the components and the tiers), how it is
//! built, and what it hands to its components (issuing to the [`Issuer`],
//! after the [`Verifier`]'s check of the biz type).

use crate::changes::Changes;
use crate::fleet::Fleet;
use std::sync::Arc;
use std::time::Duration;

use super::api::{ConsumeOutcome, Issued, LedgerError};
use super::catch_up::CatchUp;
use super::issue::Issuer;
use super::util::count_consume;
use super::verify::Verifier;
use crate::auth::Client;
use crate::clock::Clock;
use crate::config::Settings;
use crate::domain::{BizType, Subject};
use crate::durable::batch::{ConsumeBatcher, FinishBatcher};
use crate::durable::key_batch::KeyBatcher;
use crate::durable::Pools;
use crate::fast::breaker::Mode;
use crate::fast::FastTier;
use crate::issuance::writer::Writer;
use crate::metrics::Metrics;
use crate::tasks::OffPath;

/// Issue, consume, result and release over both tiers. Built once at start
/// ([`crate::startup`]) and shared by every handler.
pub struct Ledger {
    pub(super) settings: Arc<Settings>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) fast: Arc<FastTier>,
    pub(super) pools: Pools,
    pub(super) metrics: Arc<Metrics>,
    /// Where a consume answered `duplicate` counts the attempt (best effort).
    pub(super) writer: Writer,
    /// Step 1: the checks of a presented token.
    pub(super) verifier: Verifier,
    /// Issuing.
    pub(super) issuer: Issuer,
    /// Redis catching up: fast consumes without it, the writes it missed,
    /// the write-backs on their way.
    pub(super) catch_up: Arc<CatchUp>,
    /// Durable consumes go to Postgres through it (group commit).
    pub(super) batcher: ConsumeBatcher,
    /// Durable client-key consumes go to Postgres through it (group commit).
    pub(super) key_batcher: KeyBatcher,
    /// Results and releases Postgres decides go through it (group commit).
    pub(super) finisher: FinishBatcher,
    /// The fleet's agreement on Redis: who decides fast types now.
    pub(super) fleet: Arc<Fleet>,
    /// Results and releases that waiting consumes wait for.
    pub(super) changes: Arc<Changes>,
    /// Where the writes a request does not wait for run (write-backs,
    /// markers given back, heals): the application waits for them at
    /// shutdown.
    pub(super) off_path: OffPath,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("worker_id", &self.issuer.worker_id())
            .finish()
    }
}

impl Ledger {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: Arc<Settings>,
        clock: Arc<dyn Clock>,
        fast: Arc<FastTier>,
        pools: Pools,
        metrics: Arc<Metrics>,
        writer: Writer,
        changes: Arc<Changes>,
        off_path: OffPath,
        fleet: Arc<Fleet>,
        verifier: Verifier,
        issuer: Issuer,
        catch_up: CatchUp,
    ) -> Ledger {
        let batcher = ConsumeBatcher::new(
            pools.clone(),
            metrics.clone(),
            &settings.postgres,
            clock.clone(),
            off_path.clone(),
        );
        let key_batcher = KeyBatcher::new(
            pools.clone(),
            metrics.clone(),
            &settings.postgres,
            clock.clone(),
            off_path.clone(),
        );
        let finisher = FinishBatcher::new(
            pools.clone(),
            metrics.clone(),
            &settings.postgres,
            clock.clone(),
            off_path.clone(),
        );
        Ledger {
            changes,
            batcher,
            key_batcher,
            finisher,
            fleet,
            off_path,
            catch_up: Arc::new(catch_up),
            verifier,
            issuer,
            settings,
            clock,
            fast,
            pools,
            metrics,
            writer,
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
    pub fn worker_id(&self) -> u16 {
        self.issuer.worker_id()
    }

    /// How Redis is used right now (see [`crate::fast::breaker`]).
    pub fn mode(&self) -> Mode {
        self.fast.mode()
    }

    /// Whether Postgres answers on the payment pool within `within`: durable
    /// consumes can be decided (readiness).
    pub async fn postgres_reachable(&self, within: Duration) -> bool {
        self.pools.hot_reachable(within).await
    }

    /// One round of Redis upkeep (every 250 ms, see [`crate::startup`]):
    /// probes Redis while it is marked down (the breaker's recovery probe)
    /// or slow (so that the latency window keeps moving without traffic),
    /// replays the writes queued for Redis once it answers, and re-evaluates
    /// the mode (logged once per change, exported as `ledger_mode`).
    pub async fn tend_redis(&self) {
        if self.fast.mode() != Mode::Normal {
            self.fast.probe().await;
        }
        if !self.fast.is_down() {
            let left = self.catch_up.resync_redis().await;
            if left > 0 {
                tracing::warn!(left, "redis writes still queued");
            }
        }
        self.fast.health().evaluate();
    }

    /// Counts a consume outcome (order events count as consumes too).
    pub fn count_consume(&self, biz: &BizType, outcome: ConsumeOutcome) {
        count_consume(&self.metrics, biz, outcome);
    }

    /// Issues a token of `biz` (the biz type known and granted first).
    #[tracing::instrument(level = "debug", skip_all, fields(biz_type = %biz, client = %caller.name))]
    pub async fn issue(
        &self,
        caller: &Client,
        biz: &BizType,
        subject: &Subject,
        ttl_seconds: Option<u64>,
    ) -> Result<Issued, LedgerError> {
        let settings = self.verifier.biz_settings_for(caller, biz)?;
        self.issuer
            .issue(settings, caller, biz, subject, ttl_seconds)
            .await
    }

    /// Drops the issue-rate state of pairs whose bucket is full again (see
    /// [`Issuer::prune_rate_limiters`]); returns how many pairs are left.
    pub fn prune_rate_limiters(&self) -> usize {
        self.issuer.prune_rate_limiters()
    }

    /// Replays the Redis writes queued while it was down (see
    /// [`CatchUp::resync_redis`]); returns how many remain.
    pub async fn resync_redis(&self) -> usize {
        self.catch_up.resync_redis().await
    }

    /// Redis writes waiting for Redis.
    pub fn resync_pending(&self) -> usize {
        self.catch_up.resync_pending()
    }
}
