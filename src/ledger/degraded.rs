//! Fast consumes without Redis: decided by Postgres only while the fleet
//! agrees that Redis is down (see `crate::fleet`), behind the
//! [`super::catch_up::CatchUp`]'s per-instance cache of what was consumed
//! meanwhile, the tokens whose Redis outcome is unknown and a stricter rate
//! limit; in this process's memory only with `redis.memory_fallback` and
//! Postgres down too (queued for Redis, to be replayed when it is back).

use super::api::{ConsumeAnswer, DuplicateStatus, LedgerError};
use super::consume::{answer_from_row, classify, Attempted, Prior};
use super::core::Ledger;
use super::held::{Held, Of};
use super::resync::Resync;
use super::util::ms_to_time;
use crate::durable::fleet as fleet_store;
use crate::durable::timed;
use crate::fast::{Attempt, Marker};
use crate::journal;

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
        if let Some(m) = self.catch_up.fallback().consumed.get(&record.id) {
            if let Some(answer) = classify(&Prior::from_marker(&m), input, false, self.clock.now())?
            {
                return Ok(answer);
            }
        }
        if of.expired() {
            return self.expired_fast(record, input).await;
        }
        if self.catch_up.fallback().uncertain.contains_key(&record.id) {
            return Err(LedgerError::Unavailable {
                what: "redis (an earlier consume of this token may have run there; retry with the same request_id)",
                retry_after_secs: 1,
                source: None,
            });
        }
        if !self.catch_up.fallback().admit() {
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
                    self.catch_up.fallback().consumed.insert(record.id, m);
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
            .catch_up
            .fallback()
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
        let queued = self.catch_up.queue(Resync::FastConsumed {
            token: held.handle.clone(),
            marker: marker.clone(),
            journal,
        });
        if !queued {
            self.catch_up.fallback().consumed.invalidate(&record.id);
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
}
