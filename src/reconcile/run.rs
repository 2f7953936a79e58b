//! One run: the advisory lock, the phases in order (a failed phase is named
//! in the report and the next one runs), the run record and the report.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::report::{Class, Classes, InconsistentOrder, Phase, Progress, Report, Scanned};
use super::{Options, ReconcileError, Reconciler};
use crate::audit_seal::Seals;
use crate::clock::Clock;
use crate::config::Settings;
use crate::durable::reconcile::{self as sql, Repair};
use crate::durable::DurableError;
use crate::fast::{FastError, FastTier, Marker};
use crate::journal::DrainError;
use crate::telemetry::error_chain;
use crate::token::TokenCodec;

impl Reconciler {
    pub fn new(
        settings: &Settings,
        admin_pool: PgPool,
        fast: Arc<FastTier>,
        clock: Arc<dyn Clock>,
    ) -> Reconciler {
        Reconciler {
            pool: admin_pool.clone(),
            fast,
            clock,
            codec: TokenCodec::new(settings.tokens.signing_keys.clone()),
            retention: settings.tokens.retention,
            max_ttl: settings
                .biz
                .values()
                .map(|b| b.ttl)
                .max()
                .unwrap_or_default(),
            batch: settings.reconcile.batch_size.max(1),
            audit_retention: settings.audit.retention,
            seals: Seals::new(&settings.audit, admin_pool),
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
        tracing::info!(dry_run = opts.dry_run, since = ?opts.since, by = %opts.by, "reconcile: started");
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
            ahead: Vec::new(),
            errors: Vec::new(),
        };
        run.all().await;
        progress.finish();
        let finished = self.clock.now();
        let mut report = Report {
            id: None,
            by: opts.by.clone(),
            started_at: crate::admin::time(started),
            finished_at: crate::admin::time(finished),
            dry_run: opts.dry_run,
            scanned: run.scanned,
            found: run.found,
            repaired: run.repaired,
            inconsistent_orders: run.orders,
            redis_ahead_of_postgres: run.ahead,
            interrupted: cancel.is_cancelled(),
            errors: run.errors,
        };
        let record = sql::RunRecord {
            started_at: started,
            finished_at: finished,
            dry_run: opts.dry_run,
            interrupted: report.interrupted,
            errors: report.errors.clone(),
            // Maps of integers, strings and lists serialize.
            found: serde_json::to_value(report.found).unwrap_or_default(),
            repaired: serde_json::to_value(report.repaired).unwrap_or_default(),
            report: serde_json::to_value(&report).unwrap_or_default(),
        };
        match sql::record_run(&self.pool, &record).await {
            Ok(id) => report.id = Some(id.to_string()),
            Err(e) => report
                .errors
                .push(format!("recording the run: {}", error_chain(&e))),
        }
        let _ = sql::unlock(&mut lock_conn).await;
        drop(lock_conn);
        tracing::info!(found = ?report.found, repaired = ?report.repaired, interrupted = report.interrupted, errors = report.errors.len(), "reconcile: finished");
        Ok(report)
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum PhaseError {
    #[error("redis")]
    Redis(#[from] FastError),
    #[error("postgres")]
    Postgres(#[from] DurableError),
    #[error("journal")]
    Journal(#[from] DrainError),
}

/// The state of one run.
pub(super) struct Run<'a> {
    pub(super) r: &'a Reconciler,
    pub(super) opts: &'a Options,
    pub(super) progress: &'a dyn Progress,
    pub(super) cancel: &'a CancellationToken,
    pub(super) since: Option<DateTime<Utc>>,
    pub(super) scanned: Scanned,
    pub(super) found: Classes,
    pub(super) repaired: Classes,
    pub(super) orders: Vec<InconsistentOrder>,
    /// The keys counted in `redis_ahead_of_postgres` (at most `MAX_LISTED`).
    pub(super) ahead: Vec<String>,
    pub(super) errors: Vec<String>,
}

pub(super) fn marker_of(t: &sql::PgToken) -> Marker {
    Marker {
        at_ms: t.consumed_at.map(|c| c.timestamp_millis()).unwrap_or(0),
        request_id: t.request_id.clone(),
        fingerprint: t.fingerprint.clone(),
        result: t.result.clone(),
    }
}

pub(super) fn repair_of(class: Class, action: &'static str, t: &sql::PgToken) -> Repair {
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

    pub(super) fn pool(&self) -> &PgPool {
        &self.r.pool
    }
}
