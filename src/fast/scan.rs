//! Reconciliation's view of the fast tier: key scans (every cluster
//! primary), batch reads of key states with their generations, and repairs
//! that each touch one token's key and check the state they expect first
//! (see `reconcile.lua`).

use redis::Value;

use super::{Conn, FastError, FastTier, Marker};

/// What reconciliation reads of one token's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    Missing,
    Issued,
    /// A provisional marker; `deadline_ms` in Redis's clock.
    Provisional {
        deadline_ms: i64,
    },
    Consumed,
    /// Anything else (a hash without a known state).
    Unknown,
}

/// What reconciliation reads of one token's key: its state and its `g`
/// field as stored (`None` for a key without one, or a missing key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRead {
    pub state: KeyState,
    pub stored_gen: Option<i64>,
}

impl KeyRead {
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

/// One node a key scan walks: the standalone server, or one cluster primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanNode(Option<(String, u16)>);

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
    /// The nodes a full key scan must walk.
    pub async fn scan_nodes(&self) -> Result<Vec<ScanNode>, FastError> {
        if !self.cluster {
            return Ok(vec![ScanNode(None)]);
        }
        // CLUSTER SLOTS: [[start, end, [host, port, id], replicas...], ...]
        let slots: Vec<Value> = self
            .call_background("cluster_slots", |mut c| async move {
                redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut c).await
            })
            .await?;
        let mut nodes: Vec<ScanNode> = Vec::new();
        for range in slots {
            let Value::Array(parts) = range else { continue };
            let Some(Value::Array(primary)) = parts.get(2) else {
                continue;
            };
            let host: Option<String> = primary
                .first()
                .and_then(|v| redis::from_redis_value_ref(v).ok());
            let port: Option<u16> = primary
                .get(1)
                .and_then(|v| redis::from_redis_value_ref(v).ok());
            if let (Some(h), Some(p)) = (host, port) {
                let node = ScanNode(Some((h, p)));
                if !nodes.contains(&node) {
                    nodes.push(node);
                }
            }
        }
        if nodes.is_empty() {
            return Err(FastError::Protocol("CLUSTER SLOTS named no primary".into()));
        }
        Ok(nodes)
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

    /// Reads the state and generation of many tokens' keys in one pipeline
    /// (one `HMGET` per key), with Redis's clock in ms for judging
    /// provisional deadlines. On a cluster, where a pipeline may not cross
    /// slots, the `HMGET`s go out concurrently on the cluster connection,
    /// each to its key's node.
    pub async fn key_states(&self, tokens: &[String]) -> Result<(i64, Vec<KeyRead>), FastError> {
        let keys: &Vec<String> = &tokens.iter().map(|t| self.token_key(t)).collect();
        let cluster = self.cluster;
        let (time, rows): ((i64, i64), Vec<StateFields>) = self
            .call_background("key_states", |mut c| async move {
                if cluster {
                    let time: (i64, i64) = redis::cmd("TIME").query_async(&mut c).await?;
                    let reads = keys.iter().map(|k| {
                        let mut c = c.clone();
                        async move {
                            redis::cmd("HMGET")
                                .arg(k)
                                .arg("s")
                                .arg("d")
                                .arg("g")
                                .query_async::<StateFields>(&mut c)
                                .await
                        }
                    });
                    let rows = futures_util::future::join_all(reads)
                        .await
                        .into_iter()
                        .collect::<Result<Vec<_>, _>>()?;
                    return Ok((time, rows));
                }
                let mut p = redis::pipe();
                p.cmd("TIME");
                for k in keys {
                    p.cmd("HMGET").arg(k).arg("s").arg("d").arg("g");
                }
                let mut values: Vec<Value> = p.query_async(&mut c).await?;
                let time_value = if values.is_empty() {
                    Value::Nil
                } else {
                    values.remove(0)
                };
                let time: (i64, i64) = redis::from_redis_value(time_value)?;
                let rows = values
                    .into_iter()
                    .map(redis::from_redis_value)
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((time, rows))
            })
            .await?;
        let now_ms = time.0 * 1000 + time.1 / 1000;
        let states = rows
            .into_iter()
            .map(|(s, d, g)| KeyRead {
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
            })
            .collect();
        Ok((now_ms, states))
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
