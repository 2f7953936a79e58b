//! Postgres writes that may lag behind the answer: issuance records (batched,
//! a few milliseconds late), duplicate-attempt counts and the fleet-wide stats
//! counters (every few seconds). One background task; bounded buffer; retried
//! with backoff while Postgres is down; drained on shutdown.
//!
//! Issuance marks ([`crate::issuance::marks`]): each batch statement raises the mark
//! of the leases whose records it carries; every [`MARK_TICK`] the marks are
//! raised without records too (an idle lease's mark follows the clock, a
//! replaced lease that is drained ends); a stop that drained everything ends
//! every lease of the instance.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::DurationRound;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::durable::tokens::{self, TokenRecord};
use crate::durable::{marks, DurableError};
use crate::issuance::lease::WorkerLease;
use crate::issuance::marks::{LeaseIds, Mark, ENDED};
use crate::metrics::Metrics;

/// How often counters reach Postgres (the stats endpoint promises 5 s).
pub const STATS_FLUSH: Duration = Duration::from_secs(2);

/// How often the marks are raised without records: how far an idle
/// issuer's mark trails its clock.
pub const MARK_TICK: Duration = Duration::from_secs(1);

/// The most tokens one statement of duplicate counts updates. Each holds
/// its rows until it commits, and a payment statement that needs one of
/// them waits: 4,000 rows took 0.4 s on an idle machine and up to 1.5 s
/// under load; a few hundred take tens of milliseconds.
const DUPLICATES_PER_STATEMENT: usize = 500;

/// How long a stop keeps retrying the owed issuance records (the service
/// waits 10 s for the writer, see [`crate::startup`]).
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(8);

#[derive(Debug)]
enum Job {
    Issued(TokenRecord, Arc<LeaseIds>),
    Duplicate(i64),
}

/// A record and the lease its id is owed to.
type Owed = (TokenRecord, Arc<LeaseIds>);

/// The sending side, held by the ledger.
#[derive(Debug, Clone)]
pub struct Writer {
    tx: mpsc::Sender<Job>,
    metrics: Arc<Metrics>,
}

impl Writer {
    /// Queues an issuance record of `lease`; `false` when the buffer is full
    /// (the caller abandons the id).
    pub fn issued(&self, record: TokenRecord, lease: &Arc<LeaseIds>) -> bool {
        let ok = self.tx.try_send(Job::Issued(record, lease.clone())).is_ok();
        self.metrics
            .issue_buffer_depth
            .set((self.tx.max_capacity() - self.tx.capacity()) as i64);
        ok
    }

    /// Counts a duplicate attempt on a token (best effort).
    pub fn duplicate(&self, id: i64) {
        let _ = self.tx.try_send(Job::Duplicate(id));
    }
}

/// The receiving side: run it with [`WriterTask::run`].
#[derive(Debug)]
pub struct WriterTask {
    rx: mpsc::Receiver<Job>,
    pool: PgPool,
    metrics: Arc<Metrics>,
    /// Which stats minute a flush counts in; the time an idle mark seals.
    clock: Arc<dyn Clock>,
    /// The leases whose marks this task raises.
    lease: Arc<WorkerLease>,
}

pub fn writer(
    capacity: usize,
    pool: PgPool,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
    lease: Arc<WorkerLease>,
) -> (Writer, WriterTask) {
    let (tx, rx) = mpsc::channel(capacity);
    (
        Writer {
            tx,
            metrics: metrics.clone(),
        },
        WriterTask {
            rx,
            pool,
            metrics,
            clock,
            lease,
        },
    )
}

impl WriterTask {
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut issued: Vec<Owed> = Vec::new();
        let mut dups: HashMap<i64, i64> = HashMap::new();
        let mut jobs = Vec::with_capacity(1024);
        let mut stats_tick = tokio::time::interval(STATS_FLUSH);
        let mut mark_tick = tokio::time::interval(MARK_TICK);
        mark_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut backoff = Duration::from_millis(50);
        loop {
            tokio::select! {
                n = self.rx.recv_many(&mut jobs, 1024) => {
                    if n == 0 { break; }
                    for job in jobs.drain(..) {
                        match job {
                            Job::Issued(r, l) => issued.push((r, l)),
                            Job::Duplicate(id) => *dups.entry(id).or_default() += 1,
                        }
                    }
                }
                _ = stats_tick.tick() => {
                    self.flush_counters(&mut dups).await;
                }
                _ = mark_tick.tick(), if issued.is_empty() => {
                    if let Err(e) = self.raise_marks(false).await {
                        tracing::debug!(error = %e, "issuance marks not raised; next tick");
                    }
                }
                _ = shutdown.cancelled() => break,
            }
            if !issued.is_empty() {
                // Write in chunks so one statement stays small.
                match self.write_issued(&issued).await {
                    Ok(()) => {
                        issued.clear();
                        backoff = Duration::from_millis(50);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, pending = issued.len(), "issuance records not written yet; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = shutdown.cancelled() => break,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
            self.metrics
                .issue_buffer_depth
                .set(issued.len() as i64 + self.rx.len() as i64);
        }
        // Shutdown: take what is queued and write it once more.
        self.rx.close();
        while let Ok(job) = self.rx.try_recv() {
            match job {
                Job::Issued(r, l) => issued.push((r, l)),
                Job::Duplicate(id) => *dups.entry(id).or_default() += 1,
            }
        }
        // Retried until SHUTDOWN_DRAIN: a token answered 201 has its record.
        let deadline = tokio::time::Instant::now() + SHUTDOWN_DRAIN;
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.write_issued(&issued).await {
                // Everything recorded: the leases end (their marks say so).
                Ok(()) => {
                    if let Err(e) = self.raise_marks(true).await {
                        tracing::warn!(error = %e, "issuance marks not ended at shutdown (peers accept this instance's unknown ids above its last mark)");
                    }
                    break;
                }
                Err(e) if tokio::time::Instant::now() + backoff < deadline => {
                    tracing::warn!(error = %e, pending = issued.len(), "issuance records not written yet at shutdown; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => {
                    tracing::error!(error = %e, lost = issued.len(), "issuance records not written at shutdown (consumes still work; reconcile re-seeds)");
                    break;
                }
            }
        }
        self.flush_counters(&mut dups).await;
    }

    /// Writes records in chunks, each with the marks of its leases in the
    /// same statement; the ids are no longer owed once their chunk commits.
    async fn write_issued(&self, issued: &[Owed]) -> Result<(), DurableError> {
        for chunk in issued.chunks(1000) {
            let mut leases: Vec<(Arc<LeaseIds>, HashSet<u64>)> = Vec::new();
            for (record, lease) in chunk {
                let id = record.id as u64;
                match leases.iter_mut().find(|(l, _)| Arc::ptr_eq(l, lease)) {
                    Some((_, ids)) => {
                        ids.insert(id);
                    }
                    None => leases.push((lease.clone(), HashSet::from([id]))),
                }
            }
            let now = self.clock.now_ms();
            let marks: Vec<Mark> = leases
                .iter()
                .map(|(lease, ids)| Mark {
                    lease: lease.key(),
                    mark_ms: lease.mark_with(ids, now),
                })
                .collect();
            let records: Vec<TokenRecord> = chunk.iter().map(|(r, _)| r.clone()).collect();
            crate::durable::timed(
                &self.metrics,
                "insert_issued",
                tokens::insert_issued(&self.pool, &records, self.lease.holder(), &marks),
            )
            .await?;
            for (lease, ids) in leases {
                lease.committed(ids);
            }
        }
        Ok(())
    }

    /// Raises every lease's mark to what is owed now; a replaced lease with
    /// nothing owed (every lease, when `stopping`) is closed and ended.
    async fn raise_marks(&self, stopping: bool) -> Result<(), DurableError> {
        let leases = self.lease.leases();
        let now = self.clock.now_ms();
        let mut ended = Vec::new();
        let marks: Vec<Mark> = leases
            .iter()
            .enumerate()
            .map(|(i, lease)| {
                // The first is the current lease: it goes on issuing.
                let retired = i > 0 || stopping;
                let mark_ms = if retired && lease.close_if_drained() {
                    ended.push(lease.clone());
                    ENDED
                } else {
                    lease.mark_with(&HashSet::new(), now)
                };
                Mark {
                    lease: lease.key(),
                    mark_ms,
                }
            })
            .collect();
        crate::durable::timed(
            &self.metrics,
            "raise_marks",
            marks::raise(&self.pool, self.lease.holder(), &marks),
        )
        .await?;
        for lease in &ended {
            self.lease.forget_retired(lease);
        }
        Ok(())
    }

    async fn flush_counters(&self, dups: &mut HashMap<i64, i64>) {
        // A statement per few hundred tokens; counts of rows a payment
        // statement held, and every count from a failed statement on, stay
        // for the next round.
        let mut kept: HashMap<i64, i64> = HashMap::new();
        let mut chunk: HashMap<i64, i64> = HashMap::with_capacity(DUPLICATES_PER_STATEMENT);
        let mut pending = std::mem::take(dups).into_iter().peekable();
        while pending.peek().is_some() {
            chunk.extend(pending.by_ref().take(DUPLICATES_PER_STATEMENT));
            match tokens::add_duplicates(&self.pool, &chunk).await {
                Ok(skipped) => {
                    let skipped: HashSet<i64> = skipped.into_iter().collect();
                    kept.extend(chunk.drain().filter(|(id, _)| skipped.contains(id)));
                }
                // Postgres refused: keep the rest for the next round too,
                // without trying each chunk (the writer has records to
                // write).
                Err(_) => {
                    kept.extend(chunk.drain());
                    kept.extend(pending);
                    break;
                }
            }
        }
        *dups = kept;
        let counts = self.metrics.take_stats();
        if counts.is_empty() {
            return;
        }
        let now = self.clock.now();
        let minute = now
            .duration_trunc(chrono::Duration::minutes(1))
            .unwrap_or(now);
        if let Err(e) = tokens::flush_stats(&self.pool, minute, &counts).await {
            tracing::debug!(error = %e, "stats not flushed; keeping them for the next round");
            self.metrics.restore_stats(counts);
        }
    }
}
