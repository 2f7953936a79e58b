//! The [`CatchUp`]: what this instance keeps while Redis cannot be used and
//! gives Redis when it is back: the cache and rate limit of fast consumes
//! decided without Redis ([`Fallback`]), the queue of Redis writes and its
//! replay, and the pipelined write-backs of consumed states (step 4).

use std::sync::Arc;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use super::resync::{Resync, ResyncQueue};
use super::settle::WriteBacks;
use super::util::ms;
use crate::clock::Clock;
use crate::config::{RedisSettings, Settings};
use crate::fast::breaker::Mode;
use crate::fast::{Attempt, ConsumedWrite, Decision, FastError, FastTier, KeyArgs, Marker};
use crate::metrics::Metrics;
use crate::tasks::OffPath;

/// Fast consumes while Redis is down.
pub(super) struct Fallback {
    /// Fast tokens this instance saw consumed while Redis was down (by
    /// Postgres, or by itself). Emptied when Redis is back and caught up.
    pub(super) consumed: moka::sync::Cache<i64, Marker>,
    /// Fast tokens whose Redis consume script was sent but never answered:
    /// it may have consumed them, so they wait for Redis.
    pub(super) uncertain: moka::sync::Cache<i64, ()>,
    /// Fast consumes this instance lets through per second meanwhile.
    limiter: DefaultDirectRateLimiter,
}

impl Fallback {
    fn new(redis: &RedisSettings) -> Fallback {
        Fallback {
            consumed: moka::sync::Cache::builder()
                .max_capacity(redis.fallback_capacity)
                .time_to_live(redis.consumed_ttl.max(Duration::from_secs(1)))
                .build(),
            uncertain: moka::sync::Cache::builder()
                .max_capacity(redis.fallback_capacity)
                .time_to_live(redis.consumed_ttl.max(Duration::from_secs(1)))
                .build(),
            limiter: RateLimiter::direct(
                Quota::per_second(redis.fallback_rate).allow_burst(redis.fallback_rate),
            ),
        }
    }

    /// Whether one more fast consume fits `redis.fallback_rate` now.
    pub(super) fn admit(&self) -> bool {
        self.limiter.check().is_ok()
    }
}

/// Redis catching up: the fast consumes this instance decided or saw while
/// Redis was skipped ([`Fallback`]), the writes Redis missed
/// ([`ResyncQueue`]) and those on their way to it ([`WriteBacks`]).
pub struct CatchUp {
    fast: Arc<FastTier>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    /// How long a replayed consume's provisional marker lives
    /// (`tokens.provisional_ttl`).
    provisional_ttl: Duration,
    fallback: Fallback,
    resync: Arc<ResyncQueue>,
    /// Consumed states on their way to Redis (step 4), pipelined.
    writebacks: Arc<WriteBacks>,
}

impl CatchUp {
    /// `off_path`: where the write-backs' sender runs (shutdown waits for it).
    pub fn new(
        settings: &Settings,
        fast: Arc<FastTier>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
        off_path: OffPath,
    ) -> CatchUp {
        let resync = Arc::new(ResyncQueue::new(metrics.resync_depth.clone()));
        CatchUp {
            writebacks: Arc::new(WriteBacks::new(fast.clone(), resync.clone(), off_path)),
            fallback: Fallback::new(&settings.redis),
            provisional_ttl: settings.tokens.provisional_ttl,
            resync,
            fast,
            clock,
            metrics,
        }
    }

    /// Fast consumes while Redis is down.
    pub(super) fn fallback(&self) -> &Fallback {
        &self.fallback
    }

    /// Queues a write for Redis; `false` when the queue is full.
    pub(super) fn queue(&self, item: Resync) -> bool {
        self.resync.push(item)
    }

    /// Writes a consumed state back to Redis off the answer's path, in a
    /// pipeline with the others on their way (queued when Redis does not
    /// take it).
    pub(super) fn write_back(&self, write: ConsumedWrite) {
        self.writebacks.push(write);
    }

    /// Writes a consumed state to Redis and waits for the outcome
    /// (`Ok(true)`: written), in a pipeline with the write-backs on their
    /// way; nothing is queued on a failure (the caller decides).
    pub(super) async fn write_now(&self, write: ConsumedWrite) -> Result<bool, FastError> {
        self.writebacks.send(write).await
    }

    /// Replays Redis writes queued while it was down. Returns how many remain.
    /// Once none remain and Redis is up, this instance's memory of fast
    /// consumes is dropped: Redis knows them now.
    pub async fn resync_redis(&self) -> usize {
        let mut replayed = 0usize;
        let journal_left = self.fast.flush_journal_backlog().await;
        let left = journal_left
            + loop {
                let Some(item) = self.resync.pop() else {
                    break 0;
                };
                let done = match &item {
                    Resync::Consumed { token, gen, marker } => self
                        .fast
                        .write_consumed(token, *gen, marker)
                        .await
                        .map(|_| ()),
                    Resync::Issued {
                        token,
                        gen,
                        expires_at_ms,
                    } => {
                        let remaining = expires_at_ms - self.clock.now_ms();
                        self.fast
                            .write_issued(token, *gen, remaining)
                            .await
                            .map(|_| ())
                    }
                    Resync::FastConsumed {
                        token,
                        marker,
                        journal,
                    } => self.replay_fast_consume(token, marker, journal).await,
                };
                if done.is_err() {
                    break self.resync.put_back(item);
                }
                replayed += 1;
            };
        // The queue keeps the gauge; the cluster journal backlog adds to it.
        self.metrics.resync_depth.set(left as i64);
        if replayed > 0 {
            tracing::info!(
                replayed,
                left,
                "redis writes queued while it was down replayed"
            );
        }
        if left == 0 && self.fast.mode() != Mode::RedisDown {
            self.fallback.consumed.invalidate_all();
            self.fallback.uncertain.invalidate_all();
        }
        left
    }

    /// Replays a fast consume this instance decided alone. The consume
    /// script decides it against what Redis holds now: over a live token it
    /// wins (at the next generation, journaled by the script); over a
    /// consumed one nothing is written (that consume stands). Over a missing
    /// key no generation is known: the marker is written at generation 1 and
    /// the journal entry carries none, so Postgres applies it as a consume of
    /// an issued token, at whatever generation Postgres holds it.
    async fn replay_fast_consume(
        &self,
        token: &str,
        marker: &Marker,
        journal: &crate::fast::Record,
    ) -> Result<(), crate::fast::FastError> {
        let attempt = Attempt {
            owner: None,
            request_id: marker.request_id.as_deref(),
            fingerprint: marker.fingerprint.as_deref(),
        };
        let provisional = ms(self.provisional_ttl);
        let (decision, _) = self
            .fast
            .decide(
                token,
                &attempt,
                provisional,
                journal,
                KeyArgs::default(),
                None,
            )
            .await?;
        match decision {
            Decision::Miss => {
                self.fast.write_consumed(token, 1, marker).await?;
                let entry = journal.clone().replayed_at(marker.at_ms);
                self.fast.append_journal(&entry).await
            }
            Decision::Won { .. }
            | Decision::Consumed(_)
            | Decision::Provisional(_)
            | Decision::Mismatch
            | Decision::Unbound => Ok(()),
            // Not asked to check the dataset: kept, and sent again.
            Decision::Foreign => Err(crate::fast::FastError::Protocol(
                "the consume script answered foreign unasked".into(),
            )),
        }
    }

    /// Redis writes waiting for Redis.
    pub fn resync_pending(&self) -> usize {
        self.resync.len()
    }
}
