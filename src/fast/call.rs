//! One Redis call: a connection (or `Down` while the breaker is open), the
//! command under its lane's timeout, and what its outcome means for the
//! breaker, the latency window and the metrics. Serving calls (a request
//! waits on them) and health checks (the breaker's probe, an idle
//! instance's PING) feed this instance's health; background calls (the
//! journal, reconcile, write-backs off the answer's path) have their own
//! timeout, `redis.background_timeout`, and never move the breaker.

use std::time::{Duration, Instant};

use super::conn::{Lane, Redirect};
use super::{Conn, FastError, FastTier};
use crate::fast::breaker::Failure;

/// `EVALSHA` of `script` naming `keys` keys, to which the caller adds the
/// keys and arguments: one command whose arguments are written into one
/// buffer, where `ScriptInvocation` allocates each on its own and copies
/// them all into such a command. Sent by [`run_script`].
pub(super) fn evalsha(script: &redis::Script, keys: usize) -> redis::Cmd {
    // Room for a consume's arguments and its journal entry, made once
    // instead of grown argument by argument.
    let mut cmd = redis::Cmd::with_capacity(32, 1024);
    cmd.arg("EVALSHA");
    cmd.arg(script.get_hash()).arg(keys);
    cmd
}

/// Sends an [`evalsha`] command; when Redis does not have the script
/// (NOSCRIPT: a restart, a failover, `SCRIPT FLUSH`) it is loaded and the
/// command sent once more, as `ScriptInvocation::invoke_async` does (the
/// command did not run the first time).
pub(super) async fn run_script<T: redis::FromRedisValue>(
    script: &redis::Script,
    cmd: &redis::Cmd,
    c: &mut Conn,
) -> Result<T, redis::RedisError> {
    use redis::{ErrorKind, ServerErrorKind};
    match cmd.query_async(c).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.load_async(c).await?;
            cmd.query_async(c).await
        }
        other => other,
    }
}

/// Redirects followed per call: a resharding can answer `MOVED` (the slot
/// has a new owner) and then `ASK` (the key is being migrated on from it).
const MAX_REDIRECTS: usize = 3;

/// One try of a call: how long it took, and its outcome (`None`: no answer
/// within the lane's timeout).
struct Sent<T> {
    op: &'static str,
    lane: Lane,
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
        self.call_on(Lane::Serving, op, f).await
    }

    /// Runs one background call: skipped while the breaker is open, bounded
    /// by `redis.background_timeout`, and never evidence of health.
    /// Redirects are followed as in [`FastTier::call`].
    pub(super) async fn call_background<T, F, Fut>(
        &self,
        op: &'static str,
        f: F,
    ) -> Result<T, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        self.call_on(Lane::Background, op, f).await
    }

    /// [`FastTier::call`] on `lane` (its timeout, and whether its outcome
    /// is evidence of health).
    pub(super) async fn call_on<T, F, Fut>(
        &self,
        lane: Lane,
        op: &'static str,
        f: F,
    ) -> Result<T, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let sent = self.send(lane, op, &f).await?;
        self.judge(sent)
    }

    /// [`FastTier::call`] for a call that is idempotent per attempt: when the
    /// connection dropped under it (the socket closed before its reply), it
    /// is sent once more, on this thread's connection: the redis client has
    /// replaced it by then (`ConnectionManager` starts a new connection when
    /// a call fails with its socket dropped, before the error comes back),
    /// so the resend waits for the new socket, not the closed one. Safe only
    /// because sending it twice answers what sending it once would have, in
    /// either order (see `consume.lua`); a timeout is never resent (the
    /// first may still be on its way).
    pub(super) async fn call_idempotent<T, F, Fut>(
        &self,
        lane: Lane,
        op: &'static str,
        f: F,
    ) -> Result<T, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let sent = self.send(lane, op, &f).await?;
        match &sent.out {
            Some(Err(e)) if e.is_connection_dropped() => {
                self.count_error(lane);
                tracing::debug!(error = %e, op, "redis connection dropped under the call: sent again");
                let again = self.send(lane, op, &f).await?;
                self.judge(again)
            }
            _ => self.judge(sent),
        }
    }

    /// [`FastTier::try_once`], and on a cluster again after each `MOVED` or
    /// `ASK` reply (each try under its lane's timeout), at most
    /// [`MAX_REDIRECTS`] times.
    async fn send<T, F, Fut>(
        &self,
        lane: Lane,
        op: &'static str,
        f: &F,
    ) -> Result<Sent<T>, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let mut redirect = None;
        let mut followed = 0;
        loop {
            let sent = self.try_once(lane, op, f, redirect.take()).await?;
            if let Some(Err(e)) = &sent.out {
                if self.cluster && followed < MAX_REDIRECTS {
                    if let Some(r) = Redirect::of(e) {
                        tracing::debug!(error = %e, op, "redis cluster redirect: sent again to the node it names");
                        followed += 1;
                        // Boxed: a redirect is rare (a cluster's slot
                        // moving), and it would otherwise take its room in
                        // every call's future.
                        redirect = Some(Box::new(r));
                        continue;
                    }
                }
            }
            return Ok(sent);
        }
    }

    /// One try: a connection (or [`FastError::Down`]), then the call under
    /// its lane's timeout (after `redirect`, on the node it names).
    async fn try_once<T, F, Fut>(
        &self,
        lane: Lane,
        op: &'static str,
        f: &F,
        redirect: Option<Box<Redirect>>,
    ) -> Result<Sent<T>, FastError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let conn = match self.conn(lane).await {
            Ok(c) => c,
            Err(e) => {
                self.count_error(lane);
                return Err(e);
            }
        };
        let conn = match redirect {
            Some(r) => self.redirected(conn, *r),
            None => conn,
        };
        let timeout = match lane {
            Lane::Serving | Lane::Health => self.settings.timeout,
            Lane::Background => self.settings.background_timeout,
        };
        let start = Instant::now();
        let out = tokio::time::timeout(timeout, f(conn)).await.ok();
        let took = start.elapsed();
        self.metrics
            .tier_duration
            .with_label_values(&["redis", op])
            .observe(took.as_secs_f64());
        Ok(Sent {
            op,
            lane,
            took,
            out,
        })
    }

    /// `ledger_fast_tier_total{result="error"}` counts the failed calls a
    /// request waited on (the error share of the serving path's Redis
    /// lookups); background work's failures are not part of it.
    fn count_error(&self, lane: Lane) {
        if lane == Lane::Serving {
            self.metrics
                .fast_tier_total
                .with_label_values(&["error"])
                .inc();
        }
    }

    /// What one try's outcome means for the breaker, the latency window and
    /// the caller.
    fn judge<T>(&self, sent: Sent<T>) -> Result<T, FastError> {
        let serving = sent.lane.is_evidence();
        match sent.out {
            Some(Ok(v)) => {
                if serving {
                    self.health.record(sent.took);
                    self.health.healthy();
                }
                Ok(v)
            }
            Some(Err(e)) => {
                self.count_error(sent.lane);
                if never_ran(&e) {
                    if serving {
                        self.health.failed(Failure::Unreached);
                    }
                    tracing::debug!(error = %e, op = sent.op, "redis refused the call: it did not run");
                    return Err(FastError::Down);
                }
                if connection_failed(&e) {
                    tracing::debug!(error = %e, op = sent.op, "redis call failed on its connection");
                    if serving {
                        self.health.failed(Failure::Unreached);
                    }
                } else if serving {
                    self.health.record(sent.took);
                }
                Err(e.into())
            }
            None => {
                if serving {
                    self.health.record(self.settings.timeout);
                    self.health.failed(Failure::TimedOut);
                }
                self.count_error(sent.lane);
                Err(FastError::Timeout)
            }
        }
    }
}
