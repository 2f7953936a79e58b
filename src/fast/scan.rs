//! Reconciliation's view of the fast tier: key scans (every cluster
//! primary), reads of a page of key states with their generations and
//! their node's clock (one pipeline per page, on a cluster one per primary
//! by `route`; keys a resharding redirected read again alone), and repairs
//! that each touch one token's key and check the state they expect first
//! (see `reconcile.lua`).

use redis::aio::ConnectionLike;
use redis::Value;

use super::route::{At, Routed};
use super::slots::Primary;
use super::{Conn, FastError, FastTier, Marker};

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
    /// On a cluster: one such pipeline per primary, sent by
    /// [`FastTier::route_by_primary`]; the keys of a slot a pipeline met a
    /// redirect in are read alone (`key_state.lua`), each following its
    /// redirects.
    pub async fn key_states(&self, tokens: &[String]) -> Result<Vec<KeyRead>, FastError> {
        let keys: Vec<String> = tokens.iter().map(|t| self.token_key(t)).collect();
        if !self.cluster {
            let all: Vec<usize> = (0..keys.len()).collect();
            let Routed::Answered(reads) = self.read_pipeline(None, &keys, &all).await? else {
                return Err(FastError::Protocol(
                    "a standalone redis answered a cluster redirect".into(),
                ));
            };
            return Ok(reads);
        }
        let keys = &keys;
        let reads = self
            .route_by_primary(
                "reconcile",
                keys,
                |to, group| async move {
                    let read = self.read_pipeline(Some(&to), keys, &group).await?;
                    Ok(read.map(Ok))
                },
                |i| self.read_alone(&keys[i]),
            )
            .await?;
        reads.into_iter().collect()
    }

    /// One pipeline: `TIME`, then an `HMGET` of each of `keys[at]` for `at`
    /// in `of`; to the primary `to` by address on a cluster, else on the
    /// standalone connection. A background call.
    async fn read_pipeline(
        &self,
        to: Option<&Primary>,
        keys: &[String],
        of: &[usize],
    ) -> Result<Routed<KeyRead>, FastError> {
        let mut p = redis::pipe();
        p.cmd("TIME");
        for &at in of {
            if let Some(k) = keys.get(at) {
                p.cmd("HMGET").arg(k).arg("s").arg("d").arg("g");
            }
        }
        let (p, n) = (&p, p.len());
        let sent = &self
            .metrics
            .redis_pipeline_keys
            .with_label_values(&["reconcile"]);
        self.call_background("key_states", |mut c| async move {
            sent.observe((n - 1) as f64);
            let replies = match (At { conn: &mut c, to }).req_packed_commands(p, 0, n).await {
                Ok(replies) => replies,
                Err(e) => return Routed::of_error(e),
            };
            let mut replies = replies.into_iter().map(|v| match v {
                Value::ServerError(e) => Err(redis::RedisError::from(e)),
                v => Ok(v),
            });
            let time: (i64, i64) =
                redis::from_redis_value(replies.next().unwrap_or(Ok(Value::Nil))?)?;
            let now_ms = millis(time);
            let reads = replies
                .map(|v| {
                    let row = redis::from_redis_value::<StateFields>(v?)?;
                    Ok(KeyRead::of(row, now_ms))
                })
                .collect::<Result<Vec<_>, redis::RedisError>>()?;
            if reads.len() != n - 1 {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "a pipeline answered fewer replies than it sent commands",
                )));
            }
            Ok(Routed::Answered(reads))
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
    use super::*;

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
