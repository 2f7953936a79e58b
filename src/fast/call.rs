//! One Redis call: a connection (or `Down` while the breaker is open), the
//! command under `redis.timeout`, and what its outcome means for the breaker,
//! the latency window and the metrics.

use std::time::{Duration, Instant};

use super::conn::Redirect;
use super::{Conn, FastError, FastTier};

/// Redirects followed per call: a resharding can answer `MOVED` (the slot
/// has a new owner) and then `ASK` (the key is being migrated on from it).
const MAX_REDIRECTS: usize = 3;

/// One try of a call: how long it took, and its outcome (`None`: no answer
/// within `redis.timeout`).
struct Sent<T> {
    op: &'static str,
    took: Duration,
    out: Option<Result<T, redis::RedisError>>,
}

/// Whether an error means the connection (not the command) failed: those
/// open the breaker; a server error reply (BUSYGROUP, a script error,
/// LOADING...) is an answer.
fn connection_failed(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

/// Whether an error proves the command never ran (no connection, or the
/// cluster refused it): safe to decide elsewhere.
fn never_ran(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind as S};
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            ErrorKind::Server(S::TryAgain | S::ClusterDown | S::MasterDown | S::BusyLoading)
                | ErrorKind::ClusterConnectionNotFound
        )
}

impl FastTier {
    /// Runs one call with the tier's timeout, breaker and metrics. On a
    /// cluster, a `MOVED` or `ASK` reply is followed: `f` runs again, its
    /// command going to the node the reply names (see [`Redirect`]). `f`
    /// must send at most one command that changes anything (every caller
    /// does), because a redirect proves only that the command it answered
    /// did not run.
    pub(super) async fn call<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let sent = self.send(op, &f).await?;
        self.judge(sent)
    }

    /// [`FastTier::call`] for a call that is idempotent per attempt: when the
    /// connection dropped under it (the socket closed before its reply), it
    /// is sent once more, on the next connection. Safe only because sending
    /// it twice answers what sending it once would have, in either order
    /// (see `consume.lua`); a timeout is never resent (the first may still
    /// be on its way).
    pub(super) async fn call_idempotent<T, F, Fut>(
        &self,
        op: &'static str,
        f: F,
    ) -> Result<T, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let sent = self.send(op, &f).await?;
        match &sent.out {
            Some(Err(e)) if e.is_connection_dropped() => {
                self.metrics
                    .fast_tier_total
                    .with_label_values(&["error"])
                    .inc();
                tracing::debug!(error = %e, op, "redis connection dropped under the call: sent again");
                let again = self.send(op, &f).await?;
                self.judge(again)
            }
            _ => self.judge(sent),
        }
    }

    /// [`FastTier::try_once`], and on a cluster again after each `MOVED` or
    /// `ASK` reply (each try under `redis.timeout`), at most
    /// [`MAX_REDIRECTS`] times.
    async fn send<T, F, Fut>(&self, op: &'static str, f: &F) -> Result<Sent<T>, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let mut redirect = None;
        let mut followed = 0;
        loop {
            let sent = self.try_once(op, f, redirect.take()).await?;
            if let Some(Err(e)) = &sent.out {
                if self.cluster && followed < MAX_REDIRECTS {
                    if let Some(r) = Redirect::of(e) {
                        tracing::debug!(error = %e, op, "redis cluster redirect: sent again to the node it names");
                        followed += 1;
                        redirect = Some(r);
                        continue;
                    }
                }
            }
            return Ok(sent);
        }
    }

    /// One try: a connection (or [`FastError::Down`]), then the call under
    /// `redis.timeout` (after `redirect`, on the node it names).
    async fn try_once<T, F, Fut>(
        &self,
        op: &'static str,
        f: &F,
        redirect: Option<Redirect>,
    ) -> Result<Sent<T>, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let conn = match self.conn().await {
            Ok(c) => c,
            Err(e) => {
                self.metrics
                    .fast_tier_total
                    .with_label_values(&["error"])
                    .inc();
                return Err(e);
            }
        };
        let conn = match redirect {
            Some(r) => conn.redirected(r),
            None => conn,
        };
        let start = Instant::now();
        let out = tokio::time::timeout(self.settings.timeout, f(conn))
            .await
            .ok();
        let took = start.elapsed();
        self.metrics
            .tier_duration
            .with_label_values(&["redis", op])
            .observe(took.as_secs_f64());
        Ok(Sent { op, took, out })
    }

    /// What one try's outcome means for the breaker, the latency window and
    /// the caller.
    fn judge<T>(&self, sent: Sent<T>) -> Result<T, FastError> {
        match sent.out {
            Some(Ok(v)) => {
                self.health.record(sent.took);
                self.health.healthy();
                Ok(v)
            }
            Some(Err(e)) => {
                self.metrics
                    .fast_tier_total
                    .with_label_values(&["error"])
                    .inc();
                if never_ran(&e) {
                    self.health.trip();
                    tracing::debug!(error = %e, "redis refused the call; skipping it");
                    return Err(FastError::Down);
                }
                if connection_failed(&e) {
                    tracing::debug!(error = %e, op = sent.op, "redis call failed on its connection");
                    self.health.trip();
                } else {
                    self.health.record(sent.took);
                }
                Err(e.into())
            }
            None => {
                self.health.record(self.settings.timeout);
                self.health.trip();
                self.metrics
                    .fast_tier_total
                    .with_label_values(&["error"])
                    .inc();
                Err(FastError::Timeout)
            }
        }
    }
}
