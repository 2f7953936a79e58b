//! One command per key to a Redis Cluster, in one pipeline per primary:
//! the keys grouped by the slot map (`slots`), each group's pipeline sent to
//! its primary by address, all at once; a pipeline that met a redirect sent
//! again without the keys of the slot it names, which go alone, each
//! following its redirects. Reconcile's page reads and write-backs use it.

use std::future::Future;

use futures_util::stream::{self, StreamExt};
use redis::aio::ConnectionLike;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use super::slots::{slot_of, Primary};
use super::{Conn, FastError, FastTier};

/// Pipelines sent for one batch of keys (the first, then again after
/// redirects) before the keys still unsent go alone.
const MAX_ROUNDS: usize = 3;
/// Keys sent alone at once.
const ALONE_IN_FLIGHT: usize = 16;

/// Why a key goes alone instead of in its primary's pipeline (the `reason`
/// of `ledger_redis_key_rereads_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Alone {
    /// Its slot has another owner than the kept map said.
    Moved,
    /// Its slot is being migrated.
    Ask,
    /// Its pipeline met `TRYAGAIN` (a slot being migrated; the reply names
    /// none, so every key of that pipeline goes alone).
    TryAgain,
    /// No primary known for its slot, or no connection to it.
    NoRoute,
}

impl Alone {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Alone::Moved => "moved",
            Alone::Ask => "ask",
            Alone::TryAgain => "try_again",
            Alone::NoRoute => "no_route",
        }
    }
}

/// What one pipeline to one primary brought back.
#[derive(Debug)]
pub(super) enum Routed<T> {
    /// A reply per key sent, in their order.
    Answered(Vec<T>),
    /// The cluster client answers a pipeline that met a `MOVED` or `ASK`
    /// with that first reply alone: the keys in `slot` did not run there,
    /// and the others' replies are not handed out (they may have run).
    Redirected { slot: u16, reason: Alone },
    /// As `Redirected`, for a `TRYAGAIN` (which names no slot).
    TryAgain,
    /// The cluster client holds no connection to that primary.
    Unrouted,
}

impl<T> Routed<T> {
    /// What a pipeline's error means for its keys (`Err`: the error).
    pub(super) fn of_error(e: redis::RedisError) -> Result<Routed<T>, redis::RedisError> {
        use redis::{ErrorKind, ServerErrorKind as S};
        let reason = match e.kind() {
            ErrorKind::Server(S::Moved) => Alone::Moved,
            ErrorKind::Server(S::Ask) => Alone::Ask,
            ErrorKind::Server(S::TryAgain) => return Ok(Routed::TryAgain),
            ErrorKind::ClusterConnectionNotFound => return Ok(Routed::Unrouted),
            _ => return Err(e),
        };
        match e.redirect_node() {
            Some((_, slot)) => Ok(Routed::Redirected { slot, reason }),
            None => Err(e),
        }
    }

    pub(super) fn map<U>(self, f: impl FnMut(T) -> U) -> Routed<U> {
        match self {
            Routed::Answered(v) => Routed::Answered(v.into_iter().map(f).collect()),
            Routed::Redirected { slot, reason } => Routed::Redirected { slot, reason },
            Routed::TryAgain => Routed::TryAgain,
            Routed::Unrouted => Routed::Unrouted,
        }
    }
}

/// A connection whose commands and pipelines all go to one primary, by
/// address (the standalone connection, or no primary named: as they are).
/// A redirect is answered, never followed.
pub(super) struct At<'a> {
    pub(super) conn: &'a mut Conn,
    pub(super) to: Option<&'a Primary>,
}

impl At<'_> {
    fn route(&self) -> Option<SingleNodeRoutingInfo> {
        let (host, port) = self.to?;
        Some(SingleNodeRoutingInfo::ByAddress {
            host: host.clone(),
            port: *port,
        })
    }
}

impl ConnectionLike for At<'_> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let route = self.route();
        match (&mut *self.conn, route) {
            (Conn::Cluster(cc) | Conn::Redirected(cc, _), Some(to)) => {
                Box::pin(cc.route_command(cmd.clone(), RoutingInfo::SingleNode(to)))
            }
            (c, _) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        p: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let route = self.route();
        match (&mut *self.conn, route) {
            (Conn::Cluster(cc) | Conn::Redirected(cc, _), Some(to)) => {
                Box::pin(cc.route_pipeline(p.clone(), offset, count, to))
            }
            (c, _) => c.req_packed_commands(p, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

impl FastTier {
    /// One command per key of `keys` on a cluster, with an answer per key in
    /// their order: the keys grouped by the primary that serves their slot
    /// (the kept slot map), and `pipeline(primary, group)` (the indices into
    /// `keys` of one group; the answers in their order) sent for each
    /// group, all at once. The cluster client answers a pipeline that met a
    /// `MOVED`, `ASK` or `TRYAGAIN` with that first reply alone (the slot
    /// map changed, or a slot is being migrated): the keys of the slot it
    /// names then go alone (`alone(index)`, which follows redirects; at
    /// most [`ALONE_IN_FLIGHT`] at once, each counted in
    /// `ledger_redis_key_rereads_total{op}`), and the others go again in
    /// their primary's pipeline (by a fresh slot map after a `MOVED`), at
    /// most [`MAX_ROUNDS`] times in all. `Err`: the slot map could not be
    /// read, or a pipeline got no reply (its connection failed or it timed
    /// out; the slot map is dropped, as after a failover it names a dead
    /// primary).
    pub(super) async fn route_by_primary<T, P, PF, A, AF>(
        &self,
        op: &'static str,
        keys: &[String],
        pipeline: P,
        alone: A,
    ) -> Result<Vec<T>, FastError>
    where
        P: Fn(Primary, Vec<usize>) -> PF,
        PF: Future<Output = Result<Routed<T>, FastError>>,
        A: Fn(usize) -> AF,
        AF: Future<Output = T>,
    {
        let mut out: Vec<Option<T>> = (0..keys.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut lone: Vec<(usize, Alone)> = Vec::new();
        for _ in 0..MAX_ROUNDS {
            if pending.is_empty() {
                break;
            }
            let map = self.slot_map().await?;
            let mut groups: Vec<Vec<usize>> = vec![Vec::new(); map.primaries().len()];
            for i in pending.drain(..) {
                match map.primary_of(keys[i].as_bytes()) {
                    Some(at) => groups[at].push(i),
                    None => lone.push((i, Alone::NoRoute)),
                }
            }
            let sent = map
                .primaries()
                .iter()
                .zip(groups)
                .filter(|(_, g)| !g.is_empty())
                .map(|(to, group)| {
                    let sent = pipeline(to.clone(), group.clone());
                    async move { (group, sent.await) }
                });
            let mut failed = None;
            for (group, outcome) in futures_util::future::join_all(sent).await {
                match outcome {
                    Ok(Routed::Answered(answers)) => {
                        if answers.len() != group.len() {
                            failed = failed.or(Some(FastError::Protocol(
                                "a pipeline answered fewer replies than it sent commands".into(),
                            )));
                            continue;
                        }
                        for (i, a) in group.into_iter().zip(answers) {
                            out[i] = Some(a);
                        }
                    }
                    Ok(Routed::Redirected { slot, reason }) => {
                        if reason == Alone::Moved {
                            self.forget_slot_map();
                        }
                        for i in group {
                            if slot_of(keys[i].as_bytes()) == slot {
                                lone.push((i, reason));
                            } else {
                                pending.push(i);
                            }
                        }
                    }
                    Ok(Routed::TryAgain) => {
                        lone.extend(group.into_iter().map(|i| (i, Alone::TryAgain)));
                    }
                    Ok(Routed::Unrouted) => {
                        self.forget_slot_map();
                        lone.extend(group.into_iter().map(|i| (i, Alone::NoRoute)));
                    }
                    Err(e) => failed = failed.or(Some(e)),
                }
            }
            if let Some(e) = failed {
                // A node failed or timed out: perhaps a failover, after
                // which the map names a dead primary.
                self.forget_slot_map();
                return Err(e);
            }
        }
        lone.extend(pending.drain(..).map(|i| (i, Alone::NoRoute)));
        let alone = &alone;
        let lone: Vec<(usize, T)> = stream::iter(lone)
            .map(|(i, why)| {
                self.metrics
                    .redis_key_rereads
                    .with_label_values(&[op, why.as_str()])
                    .inc();
                async move { (i, alone(i).await) }
            })
            .buffer_unordered(ALONE_IN_FLIGHT)
            .collect()
            .await;
        for (i, a) in lone {
            out[i] = Some(a);
        }
        out.into_iter()
            .map(|a| a.ok_or_else(|| FastError::Protocol("a key of the batch went unsent".into())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use redis::{ErrorKind, RedisError, ServerErrorKind};

    use super::*;

    #[test]
    fn a_pipelines_redirect_names_the_slot_sent_again_alone() {
        let reply = |kind: ServerErrorKind, detail: &str| {
            RedisError::from((ErrorKind::Server(kind), "redirect", detail.to_owned()))
        };
        for (kind, reason) in [
            (ServerErrorKind::Moved, Alone::Moved),
            (ServerErrorKind::Ask, Alone::Ask),
        ] {
            match Routed::<()>::of_error(reply(kind, "1244 127.0.0.1:7001")) {
                Ok(Routed::Redirected { slot, reason: r }) => {
                    assert_eq!((slot, r), (1244, reason));
                }
                other => panic!("{kind:?}: {other:?}"),
            }
        }
        assert!(matches!(
            Routed::<()>::of_error(reply(ServerErrorKind::TryAgain, "")),
            Ok(Routed::TryAgain)
        ));
        let unrouted = RedisError::from((ErrorKind::ClusterConnectionNotFound, "none"));
        assert!(matches!(
            Routed::<()>::of_error(unrouted),
            Ok(Routed::Unrouted)
        ));
        for fatal in [
            reply(ServerErrorKind::ClusterDown, ""),
            RedisError::from((ErrorKind::Io, "io")),
        ] {
            assert!(Routed::<()>::of_error(fatal).is_err());
        }
    }
}
