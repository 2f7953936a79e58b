//! Reconciliation: compares the tiers and repairs what diverged, in batches,
//! under a Postgres advisory lock (one run at a time across the fleet).
//!
//! Phases, in this order (each one makes the next one's comparison truer):
//! 1. `journal_not_durable`: fast-type journal entries still in the Redis
//!    stream are written to Postgres (the journal drainer's own code).
//! 2. A `SCAN` of `<prefix>tok:*` in pages, each page read with one pipeline
//!    and compared with Postgres in one query:
//!    `redis_live_but_consumed` (Redis says issued at a generation older than
//!    the one Postgres consumed the token at: the key is deleted, so Postgres
//!    answers; a fast release Redis decided and the journal has not carried
//!    yet is newer, and left alone), `stale_provisional` (a provisional
//!    marker past its deadline: back to issued with the remaining TTL, or to
//!    consumed when Postgres consumed it) and `redis_consumed_but_live` (a
//!    durable token's consumed marker while Postgres holds it issued: a
//!    release lost in a failover, a write-back that lost a race; the marker
//!    gives way to the issued state with the remaining TTL).
//! 3. Keyset pages of the tokens Postgres holds as issued and live:
//!    `redis_missing_but_live` (re-seeded at Postgres's generation with the
//!    remaining TTL by Postgres's clock; never overwriting a key; undone when
//!    a consume won meanwhile).
//! 4. Keyset pages of orders: `order_inconsistent` (reported, never repaired).
//! 5. `expired_purgeable`: records past `tokens.retention` (and past their
//!    own expiry) are deleted in batches; they then answer `token_expired`.
//!
//! Every repair writes a `reconcile.repaired` audit event whose detail names
//! the class. Every Redis repair is one script on one key that checks the
//! state and generation it expects first, so a repair racing live traffic
//! does nothing rather than something wrong. No repair makes a token live
//! that Postgres holds consumed. Journal entries that can never apply (the
//! dead-letter stream) are named in the report's `errors`.
//! The run stops between batches when cancelled; rerunning continues the job.

pub mod report;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::stream::{self, StreamExt};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::{Durability, Settings};
use crate::durable::reconcile::{self as sql, PurgeKind, Repair};
use crate::durable::tokens::TokenState;
use crate::durable::DurableError;
use crate::fast::{FastError, FastTier, KeyRead, KeyState, Marker};
use crate::journal::{DrainError, Drainer};
use crate::metrics::OnScrape;
use crate::token::{Clock, SnowflakeId, TokenCodec};
use prometheus::{Gauge, IntGaugeVec};

pub use crate::durable::reconcile::LOCK_KEY;
pub use report::{
    Class, Classes, InconsistentOrder, LogProgress, Phase, Progress, Quiet, Report, Scanned,
};

/// Tokens this close to expiry are left alone by the re-seed.
const RESEED_MARGIN_MS: i64 = 2_000;
/// Re-seed scripts in flight at once.
const RESEED_IN_FLIGHT: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Another run holds the advisory lock (CLI exit 3, HTTP 409).
    #[error("another reconcile run holds the lock")]
    Running,
    #[error("postgres")]
    Postgres(#[from] DurableError),
}

/// What to do.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Find and report only; change nothing.
    pub dry_run: bool,
    /// Only tokens issued, and orders updated, this recently (the journal and
    /// the retention purge are always whole).
    pub since: Option<Duration>,
}

/// Runs reconciliations. Cheap to build; holds the admin pool.
#[derive(Debug, Clone)]
pub struct Reconciler {
    pool: PgPool,
    fast: Arc<FastTier>,
    codec: TokenCodec,
    retention: Duration,
    batch: usize,
    /// Only for the report's start and finish times: Postgres `now()` and
    /// Redis's clock judge expiry and deadlines.
    clock: Arc<dyn Clock>,
}

impl Reconciler {
    pub fn new(
        settings: &Settings,
        admin_pool: PgPool,
        fast: Arc<FastTier>,
        clock: Arc<dyn Clock>,
    ) -> Reconciler {
        Reconciler {
            pool: admin_pool,
            fast,
            clock,
            codec: TokenCodec::new(settings.tokens.signing_keys.clone()),
            retention: settings.tokens.retention,
            batch: settings.reconcile.batch_size.max(1),
        }
    }

    /// One run: takes the lock (or answers [`ReconcileError::Running`]),
    /// goes through every phase, and reports. A phase that fails is named in
    /// `errors` and the run goes on with the next one.
    pub async fn run(
        &self,
        opts: &Options,
        progress: &dyn Progress,
        cancel: &CancellationToken,
    ) -> Result<Report, ReconcileError> {
        // A connection of its own, detached from the pool: if this run is
        // dropped mid-way the connection closes and the lock goes with it,
        // instead of going back to the pool still held.
        let mut lock_conn = self
            .pool
            .acquire()
            .await
            .map_err(DurableError::from)?
            .detach();
        if !sql::try_lock(&mut lock_conn).await? {
            return Err(ReconcileError::Running);
        }
        let started = self.clock.now();
        tracing::info!(dry_run = opts.dry_run, since = ?opts.since, "reconcile: started");
        let mut run = Run {
            r: self,
            opts,
            progress,
            cancel,
            since: opts
                .since
                .and_then(|d| chrono::Duration::from_std(d).ok())
                .and_then(|d| started.checked_sub_signed(d)),
            scanned: Scanned::default(),
            found: Classes::default(),
            repaired: Classes::default(),
            orders: Vec::new(),
            errors: Vec::new(),
        };
        run.all().await;
        progress.finish();
        let finished = self.clock.now();
        let record = sql::RunRecord {
            started_at: started,
            finished_at: finished,
            dry_run: opts.dry_run,
            interrupted: cancel.is_cancelled(),
            errors: run.errors.clone(),
            // A map of integers serializes.
            found: serde_json::to_value(run.found).unwrap_or_default(),
            repaired: serde_json::to_value(run.repaired).unwrap_or_default(),
        };
        if let Err(e) = sql::record_run(&self.pool, &record).await {
            run.errors
                .push(format!("recording the run: {}", error_chain(&e)));
        }
        let _ = sql::unlock(&mut lock_conn).await;
        drop(lock_conn);
        let report = Report {
            started_at: crate::admin::time(started),
            finished_at: crate::admin::time(finished),
            dry_run: opts.dry_run,
            scanned: run.scanned,
            found: run.found,
            repaired: run.repaired,
            inconsistent_orders: run.orders,
            interrupted: cancel.is_cancelled(),
            errors: run.errors,
        };
        tracing::info!(found = ?report.found, repaired = ?report.repaired, interrupted = report.interrupted, errors = report.errors.len(), "reconcile: finished");
        Ok(report)
    }
}

#[derive(Debug, thiserror::Error)]
enum PhaseError {
    #[error("redis")]
    Redis(#[from] FastError),
    #[error("postgres")]
    Postgres(#[from] DurableError),
    #[error("journal")]
    Journal(#[from] DrainError),
}

/// An error and its causes, `a: b: c`, for the report.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// The state of one run.
struct Run<'a> {
    r: &'a Reconciler,
    opts: &'a Options,
    progress: &'a dyn Progress,
    cancel: &'a CancellationToken,
    since: Option<DateTime<Utc>>,
    scanned: Scanned,
    found: Classes,
    repaired: Classes,
    orders: Vec<InconsistentOrder>,
    errors: Vec<String>,
}

fn marker_of(t: &sql::PgToken) -> Marker {
    Marker {
        at_ms: t.consumed_at.map(|c| c.timestamp_millis()).unwrap_or(0),
        request_id: t.request_id.clone(),
        fingerprint: t.fingerprint.clone(),
        result: t.result.clone(),
    }
}

fn repair_of(class: Class, action: &'static str, t: &sql::PgToken) -> Repair {
    Repair {
        class: class.as_str(),
        action,
        token_id: Some(t.id),
        token: Some(t.token.clone()),
        subject: Some(t.subject.clone()),
        biz_type: Some(t.biz_type.clone()),
        client: Some(t.client.clone()),
        count: None,
    }
}

impl Run<'_> {
    async fn all(&mut self) {
        for phase in Phase::ALL {
            if self.cancel.is_cancelled() {
                return;
            }
            let out = match phase {
                Phase::Journal => self.journal().await,
                Phase::RedisKeys => self.redis_keys().await,
                Phase::LiveTokens => self.live_tokens().await,
                Phase::Orders => self.orders().await,
                Phase::Purge => self.purge().await,
            };
            if let Err(e) = out {
                let name = phase.as_str();
                tracing::error!(phase = name, error = %e, "reconcile: phase failed");
                self.errors.push(format!("{name}: {}", error_chain(&e)));
            }
        }
    }

    fn pool(&self) -> &PgPool {
        &self.r.pool
    }

    /// Phase 1: fast-type journal entries not yet in Postgres; then the
    /// entries that can never apply are named in the report's errors.
    async fn journal(&mut self) -> Result<(), PhaseError> {
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

    /// Phase 2: every token key in Redis against Postgres.
    async fn redis_keys(&mut self) -> Result<(), PhaseError> {
        self.progress.phase(Phase::RedisKeys, None);
        let since_ms = self.since.map(|t| t.timestamp_millis());
        for node in self.r.fast.scan_nodes().await? {
            let mut cursor = 0u64;
            loop {
                if self.cancel.is_cancelled() {
                    return Ok(());
                }
                let (next, texts) = self.r.fast.scan_tokens(&node, cursor, self.r.batch).await?;
                let mut seen = HashSet::new();
                let page: Vec<(String, SnowflakeId, i64)> = texts
                    .into_iter()
                    .filter(|t| seen.insert(t.clone()))
                    .filter_map(|t| {
                        let v = self.r.codec.verify(&t).ok()?;
                        let issued = v.claims.issued_at_ms();
                        if since_ms.is_some_and(|s| issued < s) {
                            return None;
                        }
                        Some((t, v.claims.id, v.claims.expires_at_ms()))
                    })
                    .collect();
                self.page_of_keys(&page).await?;
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(())
    }

    async fn page_of_keys(
        &mut self,
        page: &[(String, SnowflakeId, i64)],
    ) -> Result<(), PhaseError> {
        if page.is_empty() {
            return Ok(());
        }
        self.scanned.tokens += page.len() as u64;
        let texts: Vec<String> = page.iter().map(|p| p.0.clone()).collect();
        let (redis_now, states) = self.r.fast.key_states(&texts).await?;
        let suspects: Vec<usize> = states
            .iter()
            .enumerate()
            .filter(|(_, k)| match k.state {
                KeyState::Issued | KeyState::Consumed => true,
                KeyState::Provisional { deadline_ms } => deadline_ms <= redis_now,
                _ => false,
            })
            .map(|(i, _)| i)
            .collect();
        if suspects.is_empty() {
            self.progress.advance(page.len() as u64);
            return Ok(());
        }
        let ids: Vec<i64> = suspects.iter().map(|&i| page[i].1.as_i64()).collect();
        let rows = sql::tokens_by_ids(self.pool(), &ids).await?;
        // A Redis error stops the page, but the repairs made before it are
        // still audited (then the error ends the phase).
        let mut repairs = Vec::new();
        let mut failed: Option<PhaseError> = None;
        for i in suspects {
            let (text, id, exp_ms) = &page[i];
            let row = rows.get(&id.as_i64());
            match self
                .key_repair(text, states[i], row, exp_ms - redis_now)
                .await
            {
                Ok(Some((class, action))) => repairs.push(match row {
                    Some(t) => repair_of(class, action, t),
                    None => Repair {
                        class: class.as_str(),
                        action,
                        token_id: Some(id.as_i64()),
                        token: Some(text.clone()),
                        subject: None,
                        biz_type: text.split('_').next().map(str::to_owned),
                        client: None,
                        count: None,
                    },
                }),
                Ok(None) => {}
                Err(e) => {
                    failed = Some(e.into());
                    break;
                }
            }
        }
        sql::record_repairs(self.pool(), &repairs).await?;
        if let Some(e) = failed {
            return Err(e);
        }
        self.progress.advance(page.len() as u64);
        Ok(())
    }

    /// Compares one Redis key with Postgres's row, counts what diverged and
    /// (unless a dry run) repairs it; returns the repair made, for its audit
    /// event. `left_ms`: the token's time to live by its embedded expiry,
    /// used when Postgres has no row.
    async fn key_repair(
        &mut self,
        text: &str,
        key: KeyRead,
        row: Option<&sql::PgToken>,
        left_ms: i64,
    ) -> Result<Option<(Class, &'static str)>, FastError> {
        let consumed = row.filter(|t| t.state == TokenState::Consumed);
        match key.state {
            // Postgres consumed the token at a newer generation than the
            // issued state Redis holds (a fast release Redis decided and the
            // journal has not carried yet is newer: left alone).
            KeyState::Issued => {
                let Some(t) = consumed.filter(|t| key.gen() < t.gen) else {
                    return Ok(None);
                };
                self.found.add(Class::RedisLiveButConsumed, 1);
                if self.opts.dry_run || !self.r.fast.drop_if_issued(text, t.gen).await? {
                    return Ok(None);
                }
                self.repaired.add(Class::RedisLiveButConsumed, 1);
                Ok(Some((Class::RedisLiveButConsumed, "deleted")))
            }
            // Redis never decides a durable consume: Postgres holds it live.
            KeyState::Consumed => {
                let Some(t) = row.filter(|t| {
                    t.state == TokenState::Issued && t.durability == Durability::Durable.as_str()
                }) else {
                    return Ok(None);
                };
                self.found.add(Class::RedisConsumedButLive, 1);
                if self.opts.dry_run
                    || !self
                        .r
                        .fast
                        .give_way(text, key.stored_gen, t.gen, t.remaining_ms)
                        .await?
                {
                    return Ok(None);
                }
                self.repaired.add(Class::RedisConsumedButLive, 1);
                let action = if t.remaining_ms > 0 {
                    "reset_to_issued"
                } else {
                    "deleted"
                };
                Ok(Some((Class::RedisConsumedButLive, action)))
            }
            KeyState::Provisional { .. } => {
                self.found.add(Class::StaleProvisional, 1);
                if self.opts.dry_run {
                    return Ok(None);
                }
                let remaining = row.map(|t| t.remaining_ms).unwrap_or(left_ms);
                let marker = consumed.map(|t| (marker_of(t), t.gen));
                let issued_gen = row.map(|t| t.gen).unwrap_or(-1);
                let cleared = self
                    .r
                    .fast
                    .clear_stale(
                        text,
                        remaining,
                        marker.as_ref().map(|(m, g)| (m, *g)),
                        issued_gen,
                    )
                    .await?;
                if !cleared {
                    return Ok(None);
                }
                self.repaired.add(Class::StaleProvisional, 1);
                let action = if consumed.is_some() {
                    "marked_consumed"
                } else if remaining > 0 {
                    "reset_to_issued"
                } else {
                    "deleted"
                };
                Ok(Some((Class::StaleProvisional, action)))
            }
            KeyState::Missing | KeyState::Unknown => Ok(None),
        }
    }

    /// Phase 3: tokens Postgres holds as issued and live, against Redis.
    async fn live_tokens(&mut self) -> Result<(), PhaseError> {
        self.progress.phase(Phase::LiveTokens, None);
        let min_id = self
            .since
            .map(|t| SnowflakeId::from_parts(t.timestamp_millis(), 0, 0).as_i64())
            .unwrap_or(0);
        let mut after = None;
        loop {
            if self.cancel.is_cancelled() {
                return Ok(());
            }
            let page = sql::live_issued_page(
                self.pool(),
                after,
                min_id,
                RESEED_MARGIN_MS,
                self.r.batch as i64,
            )
            .await?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            after = Some((last.expires_at, last.id));
            self.scanned.tokens += page.len() as u64;
            let texts: Vec<String> = page.iter().map(|t| t.token.clone()).collect();
            let (_, states) = self.r.fast.key_states(&texts).await?;
            let missing: Vec<&sql::LiveToken> = page
                .iter()
                .zip(&states)
                .filter(|(_, k)| k.state == KeyState::Missing)
                .map(|(t, _)| t)
                .collect();
            self.found
                .add(Class::RedisMissingButLive, missing.len() as u64);
            if !self.opts.dry_run && !missing.is_empty() {
                // One script per key, a few in flight at once (a Redis that
                // lost everything needs every live token back).
                let fast = self.r.fast.clone();
                let outcomes: Vec<Result<(bool, &sql::LiveToken), FastError>> =
                    stream::iter(missing.iter().copied())
                        .map(|t| {
                            let fast = fast.clone();
                            async move {
                                fast.reseed(&t.token, t.remaining_ms, t.gen)
                                    .await
                                    .map(|ok| (ok, t))
                            }
                        })
                        .buffer_unordered(RESEED_IN_FLIGHT)
                        .collect()
                        .await;
                // Seeds made before a Redis error are still checked and
                // audited below; the error ends the phase afterwards.
                let mut seeded = Vec::new();
                let mut failed: Option<PhaseError> = None;
                for o in outcomes {
                    match o {
                        Ok((true, t)) => seeded.push(t),
                        Ok((false, _)) => {}
                        Err(e) => failed = failed.or(Some(e.into())),
                    }
                }
                // A consume may have won in Postgres between our read and the
                // seed: take the seed back so Redis never shows it live.
                let ids: Vec<i64> = seeded.iter().map(|t| t.id).collect();
                let won: HashMap<i64, i64> = sql::consumed_among(self.pool(), &ids)
                    .await?
                    .into_iter()
                    .collect();
                let mut repairs = Vec::new();
                for t in seeded {
                    if let Some(&gen) = won.get(&t.id) {
                        if let Err(e) = self.r.fast.drop_if_issued(&t.token, gen).await {
                            failed = failed.or(Some(e.into()));
                        }
                        continue;
                    }
                    self.repaired.add(Class::RedisMissingButLive, 1);
                    repairs.push(Repair {
                        class: Class::RedisMissingButLive.as_str(),
                        action: "reseeded",
                        token_id: Some(t.id),
                        token: Some(t.token.clone()),
                        subject: Some(t.subject.clone()),
                        biz_type: Some(t.biz_type.clone()),
                        client: Some(t.client.clone()),
                        count: None,
                    });
                }
                sql::record_repairs(self.pool(), &repairs).await?;
                if let Some(e) = failed {
                    return Err(e);
                }
            }
            self.progress.advance(page.len() as u64);
        }
    }

    /// Phase 4: orders whose events, tokens and amounts disagree.
    async fn orders(&mut self) -> Result<(), PhaseError> {
        self.progress.phase(Phase::Orders, None);
        let mut after = String::new();
        loop {
            if self.cancel.is_cancelled() {
                return Ok(());
            }
            let page =
                sql::orders_page(self.pool(), &after, self.since, self.r.batch as i64).await?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            after = last.order_id.clone();
            self.scanned.orders += page.len() as u64;
            for o in &page {
                let problems = order_problems(o);
                if !problems.is_empty() {
                    self.found.add(Class::OrderInconsistent, 1);
                    self.orders.push(InconsistentOrder {
                        order_id: o.order_id.clone(),
                        problems,
                    });
                }
            }
            self.progress.advance(page.len() as u64);
        }
    }

    /// Phase 5: records past retention.
    async fn purge(&mut self) -> Result<(), PhaseError> {
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
                let n = sql::purge_batch(self.pool(), kind, secs, self.r.batch as i64).await?;
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

/// What is wrong with one order, in words (empty: consistent).
fn order_problems(o: &sql::OrderFacts) -> Vec<String> {
    let mut p = Vec::new();
    if o.refunded_minor != o.refund_events_sum {
        p.push(format!(
            "refunded_minor is {} but its order.refunded events sum to {}",
            o.refunded_minor, o.refund_events_sum
        ));
    }
    let paid_state = matches!(o.state.as_str(), "PAID" | "PARTIALLY_REFUNDED" | "REFUNDED");
    if paid_state && o.paid_events == 0 {
        p.push(format!("state {} without an order.paid event", o.state));
    }
    if o.paid_events > 1 {
        p.push(format!("{} order.paid events", o.paid_events));
    }
    if o.state == "CLOSED" && o.closed_events == 0 {
        p.push("state CLOSED without an order.closed event".to_owned());
    }
    if o.state == "CREATED" && (o.paid_events > 0 || o.closed_events > 0) {
        p.push("state CREATED but it has an order.paid or order.closed event".to_owned());
    }
    if o.unbacked_events > 0 {
        p.push(format!(
            "{} event(s) whose token has no consumed tokens row bound to this order",
            o.unbacked_events
        ));
    }
    p
}

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
