//! Postgres writes that may lag behind the answer: issuance records (batched,
//! a few milliseconds late), duplicate-attempt counts and the fleet-wide stats
//! counters (every few seconds). One background task; bounded buffer; retried
//! with backoff while Postgres is down; drained on shutdown.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::DurationRound;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::durable::tokens::{self, TokenRecord};
use crate::metrics::Metrics;
use crate::token::Clock;

/// How often counters reach Postgres (the stats endpoint promises 5 s).
pub const STATS_FLUSH: Duration = Duration::from_secs(2);

#[derive(Debug)]
enum Job {
    Issued(TokenRecord),
    Duplicate(i64),
}

/// The sending side, held by the ledger.
#[derive(Debug, Clone)]
pub struct Writer {
    tx: mpsc::Sender<Job>,
    metrics: Arc<Metrics>,
}

impl Writer {
    /// Queues an issuance record; `false` when the buffer is full.
    pub fn issued(&self, record: TokenRecord) -> bool {
        let ok = self.tx.try_send(Job::Issued(record)).is_ok();
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
    /// Which stats minute a flush counts in.
    clock: Arc<dyn Clock>,
}

pub fn writer(
    capacity: usize,
    pool: PgPool,
    metrics: Arc<Metrics>,
    clock: Arc<dyn Clock>,
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
        },
    )
}

impl WriterTask {
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut issued: Vec<TokenRecord> = Vec::new();
        let mut dups: HashMap<i64, i64> = HashMap::new();
        let mut jobs = Vec::with_capacity(1024);
        let mut stats_tick = tokio::time::interval(STATS_FLUSH);
        let mut backoff = Duration::from_millis(50);
        loop {
            tokio::select! {
                n = self.rx.recv_many(&mut jobs, 1024) => {
                    if n == 0 { break; }
                    for job in jobs.drain(..) {
                        match job {
                            Job::Issued(r) => issued.push(r),
                            Job::Duplicate(id) => *dups.entry(id).or_default() += 1,
                        }
                    }
                }
                _ = stats_tick.tick() => {
                    self.flush_counters(&mut dups).await;
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
                Job::Issued(r) => issued.push(r),
                Job::Duplicate(id) => *dups.entry(id).or_default() += 1,
            }
        }
        if let Err(e) = self.write_issued(&issued).await {
            tracing::error!(error = %e, lost = issued.len(), "issuance records not written at shutdown (consumes still work; reconcile re-seeds)");
        }
        self.flush_counters(&mut dups).await;
    }

    async fn write_issued(
        &self,
        issued: &[TokenRecord],
    ) -> Result<(), crate::durable::DurableError> {
        for chunk in issued.chunks(1000) {
            crate::durable::timed(
                &self.metrics,
                "insert_issued",
                tokens::insert_issued(&self.pool, chunk),
            )
            .await?;
        }
        Ok(())
    }

    async fn flush_counters(&self, dups: &mut HashMap<i64, i64>) {
        if tokens::add_duplicates(&self.pool, dups).await.is_ok() {
            dups.clear();
        }
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
