//! Fast consumes without Redis: decided by Postgres only while the fleet
//! agrees that Redis is down (see `crate::fleet`), behind a per-instance
//! cache of what was consumed meanwhile, the tokens whose Redis outcome is
//! unknown and a stricter rate limit; in this process's memory only with
//! `redis.memory_fallback` and Postgres down too. And the queue of Redis
//! writes replayed when Redis is back.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use super::consume::{answer_from_row, classify, Attempted, Prior};
use super::core::{ms, ms_to_time};
use super::held::{Held, Of};
use super::{ConsumeAnswer, DuplicateStatus, Ledger, LedgerError};
use crate::config::RedisSettings;
use crate::durable::fleet as fleet_store;
use crate::durable::timed;
use crate::fast::breaker::Mode;
use crate::fast::{Attempt, Decision, KeyArgs, Marker};
use crate::journal;

/// A write to Redis that could not be made while it was down, replayed when
/// it is back (so that a fast token consumed through Postgres meanwhile does
/// not look fresh to Redis afterwards). Each carries the generation Postgres
/// decided at, so a replay never writes over a newer state (a release or a
/// consume that happened meanwhile elsewhere).
#[derive(Debug, Clone)]
pub(super) enum Resync {
    /// Postgres consumed the token at `gen` (with the result, once recorded).
    Consumed {
        token: String,
        gen: i64,
        marker: Marker,
    },
    /// Postgres released the token: issued at `gen` until `expires_at_ms`.
    Issued {
        token: String,
        gen: i64,
        expires_at_ms: i64,
    },
    /// A fast consume this instance decided alone (Redis and Postgres both
    /// down, so no generation is known): replayed through the consume script,
    /// which decides it against whatever Redis holds now and journals it.
    FastConsumed {
        token: String,
        marker: Marker,
        journal: crate::fast::Record,
    },
}

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
    pub(super) fn new(redis: &RedisSettings) -> Fallback {
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
}

/// Redis writes kept for later at most (beyond: 503, nothing decided).
const RESYNC_LIMIT: usize = 100_000;

impl Ledger {
    /// A fast consume that Redis may not decide here now. Duplicates this
    /// instance has seen meanwhile are answered from memory; first uses, at
    /// most `redis.fallback_rate` per second (more: 503), are decided by
    /// Postgres while the fleet has Redis down (fenced at its epoch), else
    /// answered 503. With Postgres unreachable too and
    /// `redis.memory_fallback`, this instance decides alone (exactly once per
    /// instance) and the decision reaches Redis and the journal when Redis
    /// is back.
    pub(super) async fn consume_fast_down<I: Attempted>(
        &self,
        held: &Held,
        of: Of<'_>,
        input: &I,
        attempt: &Attempt<'_>,
    ) -> Result<ConsumeAnswer, LedgerError> {
        // A key is created in Redis at Postgres's generation: no instance
        // decides one without Redis.
        if let Of::Key { .. } = of {
            return Err(LedgerError::Unavailable {
                what: "redis (it decides fast keys)",
                retry_after_secs: 1,
                source: None,
            });
        }
        let record = &held.record;
        self.metrics.redis_bypass.with_label_values(&["down"]).inc();
        if let Some(m) = self.fallback.consumed.get(&record.id) {
            if let Some(answer) = classify(&Prior::from_marker(&m), input, false, self.clock.now())?
            {
                return Ok(answer);
            }
        }
        if of.expired() {
            return self.expired_fast(record, input).await;
        }
        if self.fallback.uncertain.contains_key(&record.id) {
            return Err(LedgerError::Unavailable {
                what: "redis (an earlier consume of this token may have run there; retry with the same request_id)",
                retry_after_secs: 1,
                source: None,
            });
        }
        if self.fallback.limiter.check().is_err() {
            return Err(LedgerError::Unavailable {
                what: "fast consumes while redis is down (over redis.fallback_rate)",
                retry_after_secs: 1,
                source: None,
            });
        }
        let Some(epoch) = self.fleet.postgres_may_decide().await else {
            if self.settings.redis.memory_fallback
                && self.fast.is_down()
                && self.fleet.view().postgres_failing()
            {
                tracing::debug!(
                    "redis and postgres down: this instance decides (redis.memory_fallback)"
                );
                return self.consume_fast_in_memory(held, input, attempt);
            }
            return Err(LedgerError::Unavailable {
                what: "redis (unreachable from this instance, and the fleet has not agreed that it is down; retry)",
                retry_after_secs: 1,
                source: None,
            });
        };
        let row = timed(
            &self.metrics,
            "consume",
            self.pools.bounded(fleet_store::consume_fenced(
                &self.pools.hot,
                epoch,
                record,
                &held.handle,
                attempt.fingerprint,
                attempt.request_id,
            )),
        )
        .await;
        match row {
            Ok(Some((row, gen))) => {
                if let Some(m) = self.marker_of(&row, attempt) {
                    self.fallback.consumed.insert(record.id, m);
                }
                self.settle_row(&held.handle, 0, &row, gen, None, attempt);
                answer_from_row(&row, input, self.clock.now())
            }
            Ok(None) => Err(LedgerError::Unavailable {
                what: "redis (the fleet is going back to it; retry)",
                retry_after_secs: 1,
                source: None,
            }),
            Err(e) if e.is_unavailable() && self.settings.redis.memory_fallback => {
                tracing::debug!(error = %e, "redis and postgres down: this instance decides (redis.memory_fallback)");
                self.consume_fast_in_memory(held, input, attempt)
            }
            Err(e) => Err(LedgerError::postgres(e)),
        }
    }

    /// Decides a fast consume in this process: the first attempt here wins.
    fn consume_fast_in_memory<I: Attempted>(
        &self,
        held: &Held,
        input: &I,
        attempt: &Attempt<'_>,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let record = &held.record;
        let marker = Marker {
            at_ms: self.clock.now_ms(),
            request_id: attempt.request_id.map(str::to_owned),
            fingerprint: attempt.fingerprint.map(str::to_owned),
            result: None,
        };
        let entry = self
            .fallback
            .consumed
            .entry(record.id)
            .or_insert_with(|| marker.clone());
        if !entry.is_fresh() {
            let prior = Prior::from_marker(entry.value());
            return Ok(classify(&prior, input, false, self.clock.now())?.unwrap_or(
                ConsumeAnswer::Duplicate {
                    status: DuplicateStatus::Processing,
                    consumed_at: prior.consumed_at,
                    result: None,
                },
            ));
        }
        let journal = journal::consume_fields(record, attempt.request_id, attempt.fingerprint);
        let queued = self.resync.push(Resync::FastConsumed {
            token: held.handle.clone(),
            marker: marker.clone(),
            journal,
        });
        if !queued {
            self.fallback.consumed.invalidate(&record.id);
            return Err(LedgerError::Unavailable {
                what: "redis and postgres (the queue of writes for redis is full)",
                retry_after_secs: 1,
                source: None,
            });
        }
        self.metrics
            .redis_bypass
            .with_label_values(&["memory"])
            .inc();
        Ok(ConsumeAnswer::Consumed {
            consumed_at: ms_to_time(marker.at_ms).unwrap_or_else(|| self.clock.now()),
            replayed: false,
        })
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
        let provisional = ms(self.settings.tokens.provisional_ttl);
        let (decision, _) = self
            .fast
            .decide(token, &attempt, provisional, journal, KeyArgs::default())
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
        }
    }

    /// Redis writes waiting for Redis.
    pub fn resync_pending(&self) -> usize {
        self.resync.len()
    }
}

/// Redis writes waiting for Redis, oldest first, at most `RESYNC_LIMIT`;
/// their number is the gauge `ledger_redis_resync_depth`.
#[derive(Debug)]
pub(super) struct ResyncQueue {
    queue: Mutex<VecDeque<Resync>>,
    depth: prometheus::IntGauge,
}

impl ResyncQueue {
    pub(super) fn new(depth: prometheus::IntGauge) -> ResyncQueue {
        ResyncQueue {
            queue: Mutex::default(),
            depth,
        }
    }

    /// Queues a write for Redis; `false` when the queue is full.
    pub(super) fn push(&self, item: Resync) -> bool {
        let mut q = self.lock();
        let queued = q.len() < RESYNC_LIMIT;
        if queued {
            q.push_back(item);
        }
        self.depth.set(q.len() as i64);
        queued
    }

    fn pop(&self) -> Option<Resync> {
        let mut q = self.lock();
        let item = q.pop_front();
        self.depth.set(q.len() as i64);
        item
    }

    /// Puts a write that failed back in front; returns how many wait.
    fn put_back(&self, item: Resync) -> usize {
        let mut q = self.lock();
        q.push_front(item);
        self.depth.set(q.len() as i64);
        q.len()
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Resync>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}
