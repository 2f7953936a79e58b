//! The [`Ledger`]: what it holds, how it is built, and the checks every
//! operation shares (token tag, the fleet's filter, biz type known and
//! granted, the binding to client and subject), all without I/O.

use crate::changes::Changes;
use crate::fleet::Fleet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};

use super::degraded::{Fallback, ResyncQueue};
use super::issue::IssueLimits;
use super::settle::WriteBacks;
use super::{ConsumeOutcome, LedgerError};
use crate::auth::Client;
use crate::clock::Clock;
use crate::config::{BizSettings, Durability, Settings};
use crate::domain::{BizType, Subject};
use crate::durable::batch::ConsumeBatcher;
use crate::durable::tokens::TokenRecord;
use crate::durable::Pools;
use crate::fast::breaker::Mode;
use crate::fast::FastTier;
use crate::issuance::filter::{IssuedFilter, Verdict};
use crate::issuance::lease::WorkerLease;
use crate::issuance::writer::Writer;
use crate::metrics::Metrics;
use crate::tasks::OffPath;
use crate::token::{TokenCodec, TokenError, VerifiedToken};

pub(super) fn ms_to_time(ms: i64) -> Option<DateTime<Utc>> {
    (ms > 0)
        .then(|| Utc.timestamp_millis_opt(ms).single())
        .flatten()
}

/// Issue, consume, result and release over both tiers. Built once at start
/// ([`crate::startup`]) and shared by every handler.
pub struct Ledger {
    pub(super) settings: Arc<Settings>,
    pub(super) codec: TokenCodec,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) lease: Arc<WorkerLease>,
    pub(super) fast: Arc<FastTier>,
    pub(super) pools: Pools,
    pub(super) metrics: Arc<Metrics>,
    pub(super) writer: Writer,
    pub(super) limiters: IssueLimits,
    pub(super) resync: Arc<ResyncQueue>,
    pub(super) fallback: Fallback,
    pub(super) bloom: Arc<IssuedFilter>,
    /// Durable consumes go to Postgres through it (group commit).
    pub(super) batcher: ConsumeBatcher,
    /// The fleet's agreement on Redis: who decides fast types now.
    pub(super) fleet: Arc<Fleet>,
    /// Consumed states on their way to Redis (step 4), pipelined.
    pub(super) writebacks: Arc<WriteBacks>,
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
            .field("worker_id", &self.lease.worker_id())
            .finish()
    }
}

/// Whether a refused token counts as a consume attempt (`ledger_consume_total`
/// and the fleet's stats: consume, result, release) or not at all (a read of
/// its state, an operator's release).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tally {
    Consume,
    Quiet,
}

pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Ledger {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: Arc<Settings>,
        clock: Arc<dyn Clock>,
        lease: Arc<WorkerLease>,
        fast: Arc<FastTier>,
        pools: Pools,
        metrics: Arc<Metrics>,
        writer: Writer,
        changes: Arc<Changes>,
        off_path: OffPath,
    ) -> Ledger {
        let bloom = Arc::new(IssuedFilter::new(settings.bloom.clone(), metrics.clone()));
        let batcher = ConsumeBatcher::new(
            pools.clone(),
            metrics.clone(),
            &settings.postgres,
            clock.clone(),
            off_path.clone(),
        );
        let fleet = Arc::new(Fleet::new(
            &settings,
            pools.hot.clone(),
            pools.deadline,
            fast.clone(),
            clock.clone(),
            &metrics,
        ));
        let resync = Arc::new(ResyncQueue::new(metrics.resync_depth.clone()));
        Ledger {
            changes,
            batcher,
            fleet,
            writebacks: Arc::new(WriteBacks::new(
                fast.clone(),
                resync.clone(),
                off_path.clone(),
            )),
            off_path,
            resync,
            fallback: Fallback::new(&settings.redis),
            limiters: IssueLimits::new(&settings),
            bloom,
            codec: TokenCodec::new(settings.tokens.signing_keys.clone()),
            settings,
            clock,
            lease,
            fast,
            pools,
            metrics,
            writer,
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
    /// The fleet-wide filter of issued token ids.
    pub fn bloom(&self) -> &Arc<IssuedFilter> {
        &self.bloom
    }
    /// The fleet's agreement on Redis (see [`crate::fleet`]).
    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }
    pub fn worker_id(&self) -> u16 {
        self.lease.worker_id()
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
            let left = self.resync_redis().await;
            if left > 0 {
                tracing::warn!(left, "redis writes still queued");
            }
        }
        self.fast.health().evaluate();
    }

    /// The biz type's settings, if it is configured (422) and granted (403).
    pub(super) fn biz_settings_for(
        &self,
        caller: &Client,
        biz: &BizType,
    ) -> Result<&BizSettings, LedgerError> {
        let settings = self
            .settings
            .biz(biz)
            .ok_or_else(|| LedgerError::UnknownBizType(biz.to_string()))?;
        if !caller.may_use(biz) {
            return Err(LedgerError::Forbidden(biz.to_string()));
        }
        Ok(settings)
    }

    // ---- shared checks ----------------------------------------------------

    /// Verifies a presented token for `caller` and `subject`: the checks of
    /// API.md in their order (token: tag, then whether the fleet issued it;
    /// biz known, biz granted, binding). No I/O.
    pub(super) fn authorize(
        &self,
        caller: &Client,
        text: &str,
        subject: &Subject,
        biz_type: Option<&BizType>,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        let (token, settings) = self.authorize_unbound(caller, text)?;
        if !self.is_bound(&token, caller, subject)
            || biz_type.is_some_and(|b| *b != token.claims.biz_type)
        {
            self.count_consume(&token.claims.biz_type, ConsumeOutcome::Mismatch);
            return Err(LedgerError::TokenMismatch);
        }
        Ok((token, settings))
    }

    /// The checks that need no subject: tag, issued by the fleet, biz type
    /// known and granted. A refusal counts as a consume attempt.
    pub(super) fn authorize_unbound(
        &self,
        caller: &Client,
        text: &str,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        self.authorize_unbound_as(caller, text, Tally::Consume)
    }

    /// [`Ledger::authorize_unbound`], counting a refusal as `tally` says.
    pub(super) fn authorize_unbound_as(
        &self,
        caller: &Client,
        text: &str,
        tally: Tally,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        let token = self.verify(text, tally)?;
        self.issued_by_fleet(&token, tally)?;
        let settings = self.biz_settings_for(caller, &token.claims.biz_type)?;
        Ok((token, settings))
    }

    /// [`Self::authorize_unbound_as`] for a read: admins and auditors read
    /// every biz type; any other client only those it is granted.
    pub(super) fn authorize_read_as(
        &self,
        caller: &Client,
        text: &str,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        if !caller.reads_all() {
            return self.authorize_unbound_as(caller, text, Tally::Quiet);
        }
        let token = self.verify(text, Tally::Quiet)?;
        self.issued_by_fleet(&token, Tally::Quiet)?;
        let biz = &token.claims.biz_type;
        let settings = self
            .settings
            .biz(biz)
            .ok_or_else(|| LedgerError::UnknownBizType(biz.to_string()))?;
        Ok((token, settings))
    }

    /// Whether the token was issued to this client for this subject.
    pub(super) fn is_bound(
        &self,
        token: &VerifiedToken,
        caller: &Client,
        subject: &Subject,
    ) -> bool {
        self.codec
            .is_bound_to(token, &caller.name, subject.as_str())
    }

    /// Parses and verifies the tag only.
    fn verify(&self, text: &str, tally: Tally) -> Result<VerifiedToken, LedgerError> {
        self.codec.verify(text).map_err(|e: TokenError| {
            if tally == Tally::Consume {
                let prefix = text.split('_').next().unwrap_or("");
                self.count_invalid(BizType::parse(prefix).ok().as_ref());
            }
            tracing::debug!(reason = %e, "token refused");
            LedgerError::TokenInvalid
        })
    }

    /// Refuses a verified token that the fleet's filter says was never
    /// issued (a valid tag under a leaked key, say). No I/O.
    fn issued_by_fleet(&self, token: &VerifiedToken, tally: Tally) -> Result<(), LedgerError> {
        match self.bloom.check(token.claims.id, self.clock.now_ms()) {
            Verdict::Rejected => {
                if tally == Tally::Consume {
                    self.count_invalid(Some(&token.claims.biz_type));
                }
                tracing::debug!(token = %token.redacted(), "token refused: never issued by this fleet");
                Err(LedgerError::TokenInvalid)
            }
            Verdict::Known | Verdict::Young | Verdict::Uncovered | Verdict::Unrecorded => Ok(()),
        }
    }

    fn count_invalid(&self, biz: Option<&BizType>) {
        match biz.filter(|b| self.settings.biz.contains_key(*b)) {
            Some(b) => self.count_consume(b, ConsumeOutcome::Invalid),
            // Not a biz type of ours: no stats row for it.
            None => self
                .metrics
                .consume_total
                .with_label_values(&["unknown", ConsumeOutcome::Invalid.as_str()])
                .inc(),
        }
    }

    /// The row a consume of `token` writes.
    pub(super) fn record_for(
        &self,
        token: &VerifiedToken,
        durability: Durability,
        caller: &Client,
        subject: &Subject,
    ) -> TokenRecord {
        let c = &token.claims;
        TokenRecord {
            id: c.id.as_i64(),
            token: token.text.clone(),
            biz_type: c.biz_type.to_string(),
            durability,
            subject: subject.as_str().to_owned(),
            client: caller.name.clone(),
            issued_at: ms_to_time(c.issued_at_ms()).unwrap_or_else(|| self.clock.now()),
            expires_at: ms_to_time(c.expires_at_ms()).unwrap_or_else(|| self.clock.now()),
            key: None,
        }
    }

    /// Counts a consume outcome (order events count as consumes too).
    pub fn count_consume(&self, biz: &BizType, outcome: ConsumeOutcome) {
        self.metrics
            .consume_total
            .with_label_values(&[biz.as_str(), outcome.as_str()])
            .inc();
        if let Some(s) = outcome.stat() {
            self.metrics.stat(biz.as_str(), s);
        }
    }
}
