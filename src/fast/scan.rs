//! Reconciliation's view of the fast tier: key scans (every cluster
//! primary), reads of a page of key states with their generations and
//! their node's clock (one pipeline per page, on a cluster one per primary
//! by the slot map in `slots`; keys a resharding redirected read again
//! alone), and repairs that each touch one token's key and check the state
//! they expect first (see `reconcile.lua`).

use futures_util::stream::{self, StreamExt};
use redis::aio::ConnectionLike;
use redis::cluster_routing::SingleNodeRoutingInfo;
use redis::Value;

use super::slots::{slot_of, Primary};
use super::{Conn, FastError, FastTier, Marker};

/// Pipelines sent for one page (the first, then again after redirects)
/// before the keys still unread are read alone.
const MAX_ROUNDS: usize = 3;
/// Keys read alone at once.
const ALONE_IN_FLIGHT: usize = 16;

/// What reconciliation reads of one token's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    Missing,
    Issued,
    /// A provisional marker; `deadline_ms` in the clock of the key's node.
    Provisional {
        deadline_ms: i64,
    },
    Consumed,
    /// Anything else (a hash without a known state).
    Unknown,
}

/// What reconciliation reads of one token's key: its state and its `g`
/// field as stored (`None` for a key without one, or a missing key), and
/// the clock of the node that answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRead {
    pub state: KeyState,
    pub stored_gen: Option<i64>,
    /// The `TIME` of the node that answered for the key (ms), read just
    /// before the key: the clock its provisional deadline is judged by.
    pub now_ms: i64,
}

impl KeyRead {
    fn of((s, d, g): StateFields, now_ms: i64) -> KeyRead {
        KeyRead {
            state: match s.as_deref() {
                None => KeyState::Missing,
                Some("i") => KeyState::Issued,
                Some("c") => KeyState::Consumed,
                Some("p") => KeyState::Provisional {
                    deadline_ms: d.and_then(|d| d.parse().ok()).unwrap_or(0),
                },
                Some(_) => KeyState::Unknown,
            },
            stored_gen: g.and_then(|g| g.parse().ok()),
            now_ms,
        }
    }

    /// A provisional marker past its deadline by the key's node's clock.
    pub fn stale_provisional(&self) -> bool {
        matches!(self.state, KeyState::Provisional { deadline_ms } if deadline_ms <= self.now_ms)
    }

    /// The key's generation: its `g` field, or for a key written before
    /// generations what its state stands for (consumed 1, otherwise 0); -1
    /// for a missing key (older than any).
    /// A stored generation that contradicts the state (odd means consumed)
    /// is not trusted either, as in the scripts.
    pub fn gen(&self) -> i64 {
        let consumed = self.state == KeyState::Consumed;
        match (self.stored_gen, self.state) {
            (Some(g), _) if (g % 2 == 1) == consumed => g,
            (_, KeyState::Missing) => -1,
            (_, KeyState::Consumed) => 1,
            (_, _) => 0,
        }
    }
}

/// The arguments of one reconcile repair (see `reconcile.lua`).
#[derive(Debug, Clone, Copy)]
struct Repair<'a> {
    remaining_ms: i64,
    consumed: Option<&'a Marker>,
    /// The generation Postgres holds the token at.
    pg_gen: i64,
    /// The key's `g` field as reconcile read it (give_way only).
    seen_gen: Option<i64>,
}

impl Repair<'_> {
    fn at(pg_gen: i64) -> Repair<'static> {
        Repair {
            remaining_ms: 0,
            consumed: None,
            pg_gen,
            seen_gen: None,
        }
    }
}

/// The `s`, `d` and `g` fields of one token's hash.
type StateFields = (Option<String>, Option<String>, Option<String>);

/// `TIME`'s `(seconds, microseconds)` in ms.
fn millis((secs, micros): (i64, i64)) -> i64 {
    secs * 1000 + micros / 1000
}

/// Why a key of a page is read again alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reread {
    /// Its slot has another owner than the kept map said.
    Moved,
    /// Its slot is being migrated.
    Ask,
    /// Its pipeline met `TRYAGAIN` (a slot being migrated; the reply names
    /// none, so every key of that pipeline is read alone).
    TryAgain,
    /// No primary known for its slot, or no connection to it.
    NoRoute,
}

impl Reread {
    fn as_str(self) -> &'static str {
        match self {
            Reread::Moved => "moved",
            Reread::Ask => "ask",
            Reread::TryAgain => "try_again",
            Reread::NoRoute => "no_route",
        }
    }
}

/// What one pipeline of a page brought back.
#[derive(Debug)]
enum PipelineRead {
    /// Every key's fields, after `TIME` on that node.
    Read { now_ms: i64, rows: Vec<StateFields> },
    /// The cluster client answers a pipeline that met a `MOVED` or `ASK`
    /// with that first reply alone: the keys in `slot` were not read there,
    /// and the others' replies are not handed out.
    Redirected { slot: u16, reason: Reread },
    /// As `Redirected`, for a `TRYAGAIN` (which names no slot).
    TryAgain,
    /// The cluster client holds no connection to that primary.
    Unrouted,
}

impl PipelineRead {
    /// What a pipeline's error means for its keys (`Err`: the error).
    fn of_error(e: redis::RedisError) -> Result<PipelineRead, redis::RedisError> {
        use redis::{ErrorKind, ServerErrorKind as S};
        let reason = match e.kind() {
            ErrorKind::Server(S::Moved) => Reread::Moved,
            ErrorKind::Server(S::Ask) => Reread::Ask,
            ErrorKind::Server(S::TryAgain) => return Ok(PipelineRead::TryAgain),
            ErrorKind::ClusterConnectionNotFound => return Ok(PipelineRead::Unrouted),
            _ => return Err(e),
        };
        match e.redirect_node() {
            Some((_, slot)) => Ok(PipelineRead::Redirected { slot, reason }),
            None => Err(e),
        }
    }
}

/// One node a key scan walks: the standalone server, or one cluster primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanNode(Option<Primary>);

/// Escapes glob characters so a key prefix matches only itself in `SCAN MATCH`.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl FastTier {
    /// The nodes a full key scan must walk (on a cluster, the primaries
    /// of a fresh `CLUSTER SLOTS`, which is kept as the slot map).
    pub async fn scan_nodes(&self) -> Result<Vec<ScanNode>, FastError> {
        if !self.cluster {
            return Ok(vec![ScanNode(None)]);
        }
        let map = self.read_slot_map().await?;
        Ok(map
            .primaries()
            .iter()
            .map(|p| ScanNode(Some(p.clone())))
            .collect())
    }

    /// One `SCAN` page of `<prefix>tok:*` on `node`: the next cursor (0 at the
    /// end) and the token texts of the keys found (a key may repeat across pages).
    pub async fn scan_tokens(
        &self,
        node: &ScanNode,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<String>), FastError> {
        let prefix = format!("{}tok:{{", self.settings.key_prefix);
        let pattern = format!("{}*", glob_escape(&prefix));
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(count);
        let (target, cmd) = (&node.0, &cmd);
        let (next, keys): (u64, Vec<String>) = self
            .call_background("scan", |mut c| async move {
                match (&mut c, target) {
                    (Conn::Cluster(cc), Some((host, port))) => {
                        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                        let v = cc
                            .route_command(
                                cmd.clone(),
                                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                                    host: host.clone(),
                                    port: *port,
                                }),
                            )
                            .await?;
                        redis::from_redis_value(v).map_err(Into::into)
                    }
                    _ => cmd.query_async(&mut c).await,
                }
            })
            .await?;
        let tokens = keys
            .into_iter()
            .filter_map(|k| {
                k.strip_prefix(&prefix)
                    .and_then(|t| t.strip_suffix('}'))
                    .map(str::to_owned)
            })
            .collect();
        Ok((next, tokens))
    }

    /// Reads the state and generation of many tokens' keys, each with the
    /// clock of the node that answered for it (for judging provisional
    /// deadlines: a deadline is set by the key's own node, in its clock), in
    /// the order of `tokens`.
    ///
    /// On a standalone Redis: one pipeline, `TIME` then one `HMGET` per key.
    /// On a cluster: the keys grouped by the primary that serves their slot
    /// (the kept slot map), one such pipeline per primary, sent to it by
    /// address, all at once. The cluster client answers a pipeline that met
    /// a `MOVED`, `ASK` or `TRYAGAIN` with that first reply alone (the slot
    /// map changed, or a slot is being migrated): the keys of the slot it
    /// names are then read alone, each following its redirects, and the
    /// others go again in their primary's pipeline (by a fresh slot map after
    /// a `MOVED`), at most [`MAX_ROUNDS`] times in all.
    pub async fn key_states(&self, tokens: &[String]) -> Result<Vec<KeyRead>, FastError> {
        let keys: Vec<String> = tokens.iter().map(|t| self.token_key(t)).collect();
        let mut reads: Vec<Option<KeyRead>> = vec![None; keys.len()];
        if !self.cluster {
            let all: Vec<usize> = (0..keys.len()).collect();
            let PipelineRead::Read { now_ms, rows } = self.read_pipeline(None, &keys, &all).await?
            else {
                return Err(FastError::Protocol(
                    "a standalone redis answered a cluster redirect".into(),
                ));
            };
            return Ok(rows
                .into_iter()
                .map(|row| KeyRead::of(row, now_ms))
                .collect());
        }
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut alone: Vec<(usize, Reread)> = Vec::new();
        for _ in 0..MAX_ROUNDS {
            if pending.is_empty() {
                break;
            }
            let map = self.slot_map().await?;
            let mut groups: Vec<Vec<usize>> = vec![Vec::new(); map.primaries().len()];
            for i in pending.drain(..) {
                match map.primary_of(keys[i].as_bytes()) {
                    Some(at) => groups[at].push(i),
                    None => alone.push((i, Reread::NoRoute)),
                }
            }
            let (map, keys) = (&map, &keys);
            let sent = groups
                .iter()
                .enumerate()
                .filter(|(_, g)| !g.is_empty())
                .map(|(at, group)| async move {
                    let to = map.primaries().get(at);
                    (group, self.read_pipeline(to, keys, group).await)
                });
            let mut failed = None;
            for (group, outcome) in futures_util::future::join_all(sent).await {
                match outcome {
                    Ok(PipelineRead::Read { now_ms, rows }) => {
                        for (&i, row) in group.iter().zip(rows) {
                            reads[i] = Some(KeyRead::of(row, now_ms));
                        }
                    }
                    Ok(PipelineRead::Redirected { slot, reason }) => {
                        if reason == Reread::Moved {
                            self.forget_slot_map();
                        }
                        for &i in group {
                            if slot_of(keys[i].as_bytes()) == slot {
                                alone.push((i, reason));
                            } else {
                                pending.push(i);
                            }
                        }
                    }
                    Ok(PipelineRead::TryAgain) => {
                        alone.extend(group.iter().map(|&i| (i, Reread::TryAgain)));
                    }
                    Ok(PipelineRead::Unrouted) => {
                        self.forget_slot_map();
                        alone.extend(group.iter().map(|&i| (i, Reread::NoRoute)));
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
        alone.extend(pending.drain(..).map(|i| (i, Reread::NoRoute)));
        let keys = &keys;
        let alone: Vec<(usize, Result<KeyRead, FastError>)> = stream::iter(alone)
            .map(|(i, why)| {
                self.metrics
                    .redis_key_rereads
                    .with_label_values(&[why.as_str()])
                    .inc();
                async move { (i, self.read_alone(&keys[i]).await) }
            })
            .buffer_unordered(ALONE_IN_FLIGHT)
            .collect()
            .await;
        for (i, read) in alone {
            reads[i] = Some(read?);
        }
        reads
            .into_iter()
            .map(|r| r.ok_or_else(|| FastError::Protocol("a key of the page went unread".into())))
            .collect()
    }

    /// One pipeline: `TIME`, then an `HMGET` of each of `keys[at]` for `at`
    /// in `of`; to the primary `to` by address on a cluster, else on the
    /// standalone connection. A background call.
    async fn read_pipeline(
        &self,
        to: Option<&Primary>,
        keys: &[String],
        of: &[usize],
    ) -> Result<PipelineRead, FastError> {
        let mut p = redis::pipe();
        p.cmd("TIME");
        for &at in of {
            if let Some(k) = keys.get(at) {
                p.cmd("HMGET").arg(k).arg("s").arg("d").arg("g");
            }
        }
        let (p, n) = (&p, p.len());
        let sent = &self.metrics.redis_pipeline_keys;
        self.call_background("key_states", |mut c| async move {
            sent.observe((n - 1) as f64);
            let replies = match (&mut c, to) {
                (Conn::Cluster(cc) | Conn::Redirected(cc, _), Some((host, port))) => {
                    let to = SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    };
                    match cc.route_pipeline(p.clone(), 0, n, to).await {
                        Ok(replies) => replies,
                        Err(e) => return PipelineRead::of_error(e),
                    }
                }
                _ => c.req_packed_commands(p, 0, n).await?,
            };
            let mut replies = replies.into_iter().map(|v| match v {
                Value::ServerError(e) => Err(redis::RedisError::from(e)),
                v => Ok(v),
            });
            let time: (i64, i64) =
                redis::from_redis_value(replies.next().unwrap_or(Ok(Value::Nil))?)?;
            let rows = replies
                .map(|v| redis::from_redis_value::<StateFields>(v?).map_err(Into::into))
                .collect::<Result<Vec<_>, redis::RedisError>>()?;
            if rows.len() != n - 1 {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "a pipeline answered fewer replies than it sent commands",
                )));
            }
            Ok(PipelineRead::Read {
                now_ms: millis(time),
                rows,
            })
        })
        .await
    }

    /// One key read alone (`key_state.lua`: `TIME` and `HMGET` on the key's
    /// node), following redirects like any call.
    async fn read_alone(&self, key: &str) -> Result<KeyRead, FastError> {
        let script = &self.scripts.key_state;
        let (time, row): ((i64, i64), StateFields) = self
            .call_background("key_state", |mut c| async move {
                script.key(key).invoke_async(&mut c).await
            })
            .await?;
        Ok(KeyRead::of(row, millis(time)))
    }

    /// Seeds a live token whose key is missing, at Postgres's generation;
    /// `false` when a key exists (never overwrites: a consume may have claimed
    /// it meanwhile).
    pub async fn reseed(&self, token: &str, ttl_ms: i64, gen: i64) -> Result<bool, FastError> {
        let key = &self.token_key(token);
        let script = &self.scripts.issue;
        self.call_background("reseed", |mut c| async move {
            script
                .key(key)
                .arg(ttl_ms.max(1))
                .arg(gen)
                .invoke_async::<i64>(&mut c)
                .await
                .map(|n| n == 1)
        })
        .await
    }

    /// Deletes a token's key if it still says issued at a generation older
    /// than `consumed_gen`, the one Postgres consumed it at.
    pub async fn drop_if_issued(&self, token: &str, consumed_gen: i64) -> Result<bool, FastError> {
        self.repair(token, "drop_live", Repair::at(consumed_gen))
            .await
    }

    /// Clears a provisional marker past its deadline: to `consumed` when
    /// Postgres consumed the token (the marker and its generation), else
    /// back to issued with `remaining_ms` to live, at `issued_gen` if that
    /// is newer than the key's.
    pub async fn clear_stale(
        &self,
        token: &str,
        remaining_ms: i64,
        consumed: Option<(&Marker, i64)>,
        issued_gen: i64,
    ) -> Result<bool, FastError> {
        let r = match consumed {
            Some((m, gen)) => Repair {
                remaining_ms,
                consumed: Some(m),
                pg_gen: gen,
                seen_gen: None,
            },
            None => Repair {
                remaining_ms,
                ..Repair::at(issued_gen)
            },
        };
        self.repair(token, "clear_stale", r).await
    }

    /// A durable token's consumed marker gives way to the issued state
    /// Postgres holds (at `issued_gen`, with `remaining_ms` to live; <= 0
    /// deletes it), if its `g` field still reads `seen_gen`, as reconcile
    /// saw it.
    pub async fn give_way(
        &self,
        token: &str,
        seen_gen: Option<i64>,
        issued_gen: i64,
        remaining_ms: i64,
    ) -> Result<bool, FastError> {
        let r = Repair {
            remaining_ms,
            seen_gen,
            ..Repair::at(issued_gen)
        };
        self.repair(token, "give_way", r).await
    }

    async fn repair(
        &self,
        token: &str,
        op: &'static str,
        r: Repair<'_>,
    ) -> Result<bool, FastError> {
        let key = &self.token_key(token);
        let script = &self.scripts.reconcile;
        let m = &r.consumed.cloned().unwrap_or_default();
        let is_consumed = r.consumed.is_some();
        let consumed_ttl = self.consumed_ttl_ms();
        let seen = &r.seen_gen.map(|g| g.to_string()).unwrap_or_default();
        let r = &r;
        self.call_background("reconcile", |mut c| async move {
            script
                .key(key)
                .arg(op)
                .arg(r.remaining_ms)
                .arg(if is_consumed { "1" } else { "0" })
                .arg(m.at_ms)
                .arg(m.request_id.as_deref().unwrap_or(""))
                .arg(m.fingerprint.as_deref().unwrap_or(""))
                .arg(m.result.as_deref().unwrap_or(""))
                .arg(consumed_ttl)
                .arg(r.pg_gen)
                .arg(seen)
                .invoke_async::<i64>(&mut c)
                .await
                .map(|n| n == 1)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use redis::{ErrorKind, RedisError, ServerErrorKind};

    use super::*;

    #[test]
    fn a_pipelines_redirect_names_the_slot_read_again_alone() {
        let reply = |kind: ServerErrorKind, detail: &str| {
            RedisError::from((ErrorKind::Server(kind), "redirect", detail.to_owned()))
        };
        for (kind, reason) in [
            (ServerErrorKind::Moved, Reread::Moved),
            (ServerErrorKind::Ask, Reread::Ask),
        ] {
            match PipelineRead::of_error(reply(kind, "1244 127.0.0.1:7001")) {
                Ok(PipelineRead::Redirected { slot, reason: r }) => {
                    assert_eq!((slot, r), (1244, reason));
                }
                other => panic!("{kind:?}: {other:?}"),
            }
        }
        assert!(matches!(
            PipelineRead::of_error(reply(ServerErrorKind::TryAgain, "")),
            Ok(PipelineRead::TryAgain)
        ));
        let unrouted = RedisError::from((ErrorKind::ClusterConnectionNotFound, "none"));
        assert!(matches!(
            PipelineRead::of_error(unrouted),
            Ok(PipelineRead::Unrouted)
        ));
        for fatal in [
            reply(ServerErrorKind::ClusterDown, ""),
            RedisError::from((ErrorKind::Io, "io")),
        ] {
            assert!(PipelineRead::of_error(fatal).is_err());
        }
    }

    #[test]
    fn a_provisional_marker_is_stale_by_its_nodes_clock() {
        let read = |deadline_ms, now_ms| KeyRead {
            state: KeyState::Provisional { deadline_ms },
            stored_gen: Some(0),
            now_ms,
        };
        assert!(read(1_000, 1_000).stale_provisional());
        assert!(!read(1_001, 1_000).stale_provisional());
        let issued = KeyRead::of((Some("i".into()), None, Some("0".into())), 5);
        assert_eq!(
            (issued.state, issued.stored_gen, issued.now_ms),
            (KeyState::Issued, Some(0), 5)
        );
        assert!(!issued.stale_provisional());
    }
}
