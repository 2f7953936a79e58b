//! The tier's health as callers see it: down or not, the mode, the probe
//! that closes the breaker, and Redis's eviction policy.

use redis::Value;

use super::conn::Lane;
use super::FastTier;
use crate::fast::breaker::{Health, Mode};

impl FastTier {
    /// Is Redis considered down right now?
    pub fn is_down(&self) -> bool {
        self.health.is_down()
    }

    /// The current mode (see [`crate::fast::breaker`]).
    pub fn mode(&self) -> Mode {
        self.health.mode()
    }

    pub fn health(&self) -> &Health {
        &self.health
    }

    /// One probe: PING, bounded by the timeout. Closes the breaker on success
    /// (it is let through although the breaker is open), and adds a latency
    /// sample either way.
    ///
    /// On a cluster PING goes to every master, so the probe succeeds once
    /// every slot is served again; while it fails the cluster connection is
    /// made afresh, which reads the new slot map after a failover.
    pub async fn probe(&self) -> bool {
        self.health.half_open();
        let ok = self.check().await;
        if !ok {
            self.reconnect_cluster();
        }
        ok
    }

    /// One PING as evidence of health, while Redis is not down: an instance
    /// without traffic learns of a dead or stalled Redis too (the fleet's
    /// report waits for its view).
    pub async fn check(&self) -> bool {
        self.call_on(Lane::Health, "ping", |mut c| async move {
            redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .map(|_| ())
        })
        .await
        .is_ok()
    }

    /// Whether this process knows Redis's clock, which every deciding
    /// script's not-after bound needs (see `deadline`).
    pub fn knows_redis_time(&self) -> bool {
        self.deadline.known()
    }

    /// Asks Redis its time (`TIME`) and notes it for the scripts'
    /// not-after bounds; `false` when Redis did not answer.
    pub async fn learn_redis_time(&self) -> bool {
        let reply = self
            .call_background("time", |mut c| async move {
                redis::cmd("TIME").query_async::<(i64, i64)>(&mut c).await
            })
            .await;
        match reply {
            Ok((secs, micros)) => {
                self.deadline
                    .observe(secs.saturating_mul(1000).saturating_add(micros / 1000));
                true
            }
            Err(_) => false,
        }
    }

    /// `CONFIG GET maxmemory-policy` (standalone only); `None` when unknown.
    pub async fn maxmemory_policy(&self) -> Option<String> {
        if self.cluster {
            return None;
        }
        let reply: Result<Value, _> = self
            .call_background("config", |mut c| async move {
                redis::cmd("CONFIG")
                    .arg("GET")
                    .arg("maxmemory-policy")
                    .query_async(&mut c)
                    .await
            })
            .await;
        // RESP3 answers a map, RESP2 a flat array: [name, value].
        match reply.ok()? {
            Value::Map(pairs) => pairs
                .into_iter()
                .next()
                .and_then(|(_, v)| redis::from_redis_value(v).ok()),
            Value::Array(items) => items
                .into_iter()
                .nth(1)
                .and_then(|v| redis::from_redis_value(v).ok()),
            _ => None,
        }
    }
}
