//! Writes to a token's key outside the consume script: the seed of an
//! issued token, write-backs of what Postgres decided (versioned by
//! generation; many at once in one pipeline, on a cluster one per primary),
//! forgetting a key, and result or release of fast types.

use redis::aio::ConnectionLike;
use redis::{ServerErrorKind, Value};
use uuid::Uuid;

use super::call::{evalsha, run_script};
use super::conn::Lane;
use super::record::OfConsume;
use super::route::{At, Routed};
use super::slots::Primary;
use super::{FastError, FastTier, Marker, Record};

/// One token's consumed state, as Postgres decided it at generation `gen`,
/// to be written back (see [`FastTier::write_consumed_many`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumedWrite {
    pub token: String,
    pub gen: i64,
    pub marker: Marker,
}

/// A fast result's reply ([`FastTier::write_result`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResultWrite {
    Recorded,
    /// The same result was recorded before.
    Same,
    /// Another result was recorded before (it is this).
    Conflict(String),
    /// Not consumed, or consumed by another attempt than the one named.
    NotConsumed,
    /// Redis does not hold it: Postgres decides.
    Miss,
    /// Redis holds another dataset than the one asked about (it restarted
    /// empty): nothing was written, and nobody decides it now.
    Foreign,
}

/// A fast release's reply ([`FastTier::release`],
/// [`FastTier::lease_release`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseWrite {
    /// Issued again at generation `gen`, at `at_ms` (Redis's clock), what
    /// its journal entry records.
    Released { gen: i64, at_ms: i64 },
    /// Not consumed, already with a result, consumed by another attempt
    /// than the one named, or (a lease release) not the generation or not
    /// yet past its lease by Redis's clock.
    NotReleasable,
    /// Redis does not hold it: Postgres decides.
    Miss,
    /// Redis holds another dataset than the one asked about: nothing was
    /// written, and nobody decides it now.
    Foreign,
}

/// Which consume a fast write belongs to (`None`: any), and the dataset it
/// is made on (`None`: not checked).
#[derive(Debug, Clone, Copy)]
struct On<'a> {
    of_request: Option<&'a str>,
    dataset: Option<Uuid>,
}

/// The writes of `fast_write.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteOp {
    Result,
    Release,
    LeaseRelease,
}

impl WriteOp {
    fn as_str(self) -> &'static str {
        match self {
            WriteOp::Result => "result",
            WriteOp::Release => "release",
            WriteOp::LeaseRelease => "lease_release",
        }
    }
}

/// The writes of `writeback.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Writeback<'a> {
    /// Postgres's consumed state.
    Consumed,
    /// Postgres's issued state.
    Issued,
    /// Our provisional marker goes back to issued, if `owner` still holds it.
    Unclaim { owner: &'a str },
}

impl<'a> Writeback<'a> {
    fn as_str(self) -> &'static str {
        match self {
            Writeback::Consumed => "consumed",
            Writeback::Issued => "issued",
            Writeback::Unclaim { .. } => "unclaim",
        }
    }

    /// The owner the script compares (`''` for the writes that have none).
    fn owner(self) -> &'a str {
        match self {
            Writeback::Unclaim { owner } => owner,
            Writeback::Consumed | Writeback::Issued => "",
        }
    }
}

/// What `fast_write.lua` answered, whichever the write.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Written {
    Result(ResultWrite),
    Release(ReleaseWrite),
}

/// The error of a pipeline whose replies do not match its commands.
fn fewer_replies() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Client,
        "a pipeline answered fewer replies than it sent commands",
    ))
}

impl FastTier {
    pub fn token_key(&self, token: &str) -> String {
        let prefix = &self.settings.key_prefix;
        let mut key = String::with_capacity(prefix.len() + token.len() + 6);
        key.push_str(prefix);
        key.push_str("tok:{");
        key.push_str(token);
        key.push('}');
        key
    }

    pub fn consumed_ttl_ms(&self) -> i64 {
        i64::try_from(self.settings.consumed_ttl.as_millis()).unwrap_or(i64::MAX)
    }

    /// Seeds a freshly issued token with a relative TTL.
    pub async fn seed(&self, token: &str, ttl_ms: i64) -> Result<(), FastError> {
        let key = &self.token_key(token);
        let script = &self.scripts.issue;
        self.call("issue", |mut c| async move {
            script
                .key(key)
                .arg(ttl_ms.max(1))
                .arg(0)
                .invoke_async::<i64>(&mut c)
                .await
                .map(|_| ())
        })
        .await
    }

    /// Writes Postgres's consumed state at generation `gen` back (see
    /// `writeback.lua`): only over an older generation, or to add the result
    /// to the same generation's marker. The marker lives `redis.consumed_ttl`
    /// from its consume (`marker.at_ms`), never past the retention. `true`
    /// when written.
    pub async fn write_consumed(
        &self,
        token: &str,
        gen: i64,
        marker: &Marker,
    ) -> Result<bool, FastError> {
        let life = self.consumed_ttl_ms();
        self.writeback(token, Writeback::Consumed, gen, life, Some(marker))
            .await
    }

    /// Writes the consumed state Postgres decided at generation `gen` while
    /// the fleet had Redis down (see `crate::fleet`): as
    /// [`FastTier::write_consumed`], and it also replaces a marker Redis
    /// holds at that same generation. Redis can hold one only from a
    /// consume script that reached it after its caller had given up on the
    /// call (a paused Redis, a stalled link): that caller was answered 503
    /// and never told it won, while Postgres's winner was.
    pub async fn write_consumed_over(
        &self,
        token: &str,
        gen: i64,
        marker: &Marker,
    ) -> Result<bool, FastError> {
        let life = self.consumed_ttl_ms();
        self.writeback_with(token, Writeback::Consumed, gen, life, Some(marker), true)
            .await
    }

    /// [`FastTier::write_consumed`] for many tokens, with a result per item
    /// in order (`Ok(true)`: written). The write-backs go out as one
    /// pipeline (background lane): on a standalone Redis one for them all,
    /// one write and one round trip on one connection; on a cluster one per
    /// primary serving their slots, each to its primary by address, all at
    /// once (see [`FastTier::route_by_primary`]). A script error of one item
    /// (a key of another type, say) is that item's. A node that lost the
    /// script (`NOSCRIPT`: a restart, a failover, `SCRIPT FLUSH`) has it
    /// loaded and the items it refused sent again (they did not run). On a
    /// cluster, the items of a slot a pipeline met a `MOVED`, `ASK` or
    /// `TRYAGAIN` in (a resharding) are sent alone, each following its
    /// redirects, and that pipeline's others again: each is versioned, so
    /// one that ran the first time writes nothing the second (and answers
    /// `Ok(false)`). The outer `Err`: a pipeline got no reply (its
    /// connection failed or it timed out), and any item may or may not have
    /// been written; the caller may send them again or leave them to
    /// reconcile.
    pub async fn write_consumed_many(
        &self,
        items: &[ConsumedWrite],
    ) -> Result<Vec<Result<bool, FastError>>, FastError> {
        match items {
            [] => return Ok(Vec::new()),
            [w] => return Ok(vec![self.write_consumed(&w.token, w.gen, &w.marker).await]),
            _ => {}
        }
        if !self.cluster {
            let all: Vec<usize> = (0..items.len()).collect();
            let Routed::Answered(out) = self.write_pipeline(None, items, &all).await? else {
                return Err(FastError::Protocol(
                    "a standalone redis answered a cluster redirect".into(),
                ));
            };
            return Ok(out);
        }
        let keys: Vec<String> = items.iter().map(|w| self.token_key(&w.token)).collect();
        self.route_by_primary(
            "writeback",
            &keys,
            |to, group| async move { self.write_pipeline(Some(&to), items, &group).await },
            |i| async move {
                let w = &items[i];
                self.write_consumed(&w.token, w.gen, &w.marker).await
            },
        )
        .await
    }

    /// One pipeline of write-backs, the items `items[at]` for `at` in `of`:
    /// to the primary `to` by address on a cluster, else on the standalone
    /// connection. Versioned, so safe to send again (see `connect`).
    async fn write_pipeline(
        &self,
        to: Option<&Primary>,
        items: &[ConsumedWrite],
        of: &[usize],
    ) -> Result<Routed<Result<bool, FastError>>, FastError> {
        let life = self.consumed_ttl_ms();
        let script = &self.scripts.writeback;
        let writes: Vec<&ConsumedWrite> = of.iter().filter_map(|&at| items.get(at)).collect();
        let mut p = redis::pipe();
        for w in &writes {
            p.add_command(self.consumed_cmd(w, life));
        }
        let (p, writes) = (&p, &writes);
        let sent = &self
            .metrics
            .redis_pipeline_keys
            .with_label_values(&["writeback"]);
        let replies = self
            .call_idempotent(Lane::Background, "writeback_pipeline", |mut c| async move {
                let mut at = At { conn: &mut c, to };
                sent.observe(p.len() as f64);
                let mut replies = match at.req_packed_commands(p, 0, p.len()).await {
                    Ok(replies) if replies.len() == p.len() => replies,
                    Ok(_) => return Err(fewer_replies()),
                    Err(e) => return Routed::of_error(e),
                };
                let no_script = |v: &Value| {
                    matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript))
                };
                let refused: Vec<usize> = (0..replies.len())
                    .filter(|&k| no_script(&replies[k]))
                    .collect();
                if refused.is_empty() {
                    return Ok(Routed::Answered(replies));
                }
                // The node lost its scripts: load it there and send the
                // items it refused again (they did not run).
                script.load_async(&mut at).await?;
                let mut again = redis::pipe();
                for w in refused.iter().filter_map(|&k| writes.get(k)) {
                    again.add_command(self.consumed_cmd(w, life));
                }
                sent.observe(again.len() as f64);
                let second = match at.req_packed_commands(&again, 0, again.len()).await {
                    Ok(second) if second.len() == refused.len() => second,
                    Ok(_) => return Err(fewer_replies()),
                    Err(e) => return Routed::of_error(e),
                };
                for (k, v) in refused.into_iter().zip(second) {
                    if let Some(slot) = replies.get_mut(k) {
                        *slot = v;
                    }
                }
                Ok(Routed::Answered(replies))
            })
            .await?;
        Ok(replies.map(|v| match v {
            Value::ServerError(e) => Err(FastError::Redis(e.into())),
            v => redis::from_redis_value::<i64>(v)
                .map(|n| n == 1)
                .map_err(|e| FastError::Redis(e.into())),
        }))
    }

    /// The `writeback` command of one consumed state.
    fn consumed_cmd(&self, w: &ConsumedWrite, life: i64) -> redis::Cmd {
        self.writeback_cmd(
            &w.token,
            Writeback::Consumed,
            w.gen,
            life,
            Some(&w.marker),
            false,
        )
    }

    /// The one `writeback` command (its arguments as `writeback.lua` reads
    /// them): `op` (and an unclaim's owner) at generation `gen`, `ttl_ms` to
    /// live, the marker's fields, and `over` (see
    /// [`FastTier::write_consumed_over`]).
    fn writeback_cmd(
        &self,
        token: &str,
        op: Writeback<'_>,
        gen: i64,
        ttl_ms: i64,
        marker: Option<&Marker>,
        over: bool,
    ) -> redis::Cmd {
        let field = |f: fn(&Marker) -> Option<&str>| marker.and_then(f).unwrap_or("");
        let mut cmd = evalsha(&self.scripts.writeback, 1);
        cmd.arg(self.token_key(token))
            .arg(op.as_str())
            .arg(gen)
            .arg(ttl_ms)
            .arg(marker.map_or(0, |m| m.at_ms))
            .arg(field(|m| m.request_id.as_deref()))
            .arg(field(|m| m.fingerprint.as_deref()))
            .arg(field(|m| m.result.as_deref()))
            .arg(op.owner())
            .arg(if over { "1" } else { "0" });
        cmd
    }

    /// Writes Postgres's issued state at generation `gen` back, with
    /// `remaining_ms` to live (<= 0 deletes the key): only over an older
    /// generation. `true` when written.
    pub async fn write_issued(
        &self,
        token: &str,
        gen: i64,
        remaining_ms: i64,
    ) -> Result<bool, FastError> {
        self.writeback(token, Writeback::Issued, gen, remaining_ms, None)
            .await
    }

    pub(super) async fn writeback(
        &self,
        token: &str,
        op: Writeback<'_>,
        gen: i64,
        ttl_ms: i64,
        marker: Option<&Marker>,
    ) -> Result<bool, FastError> {
        self.writeback_with(token, op, gen, ttl_ms, marker, false)
            .await
    }

    /// `over`: a consumed state replaces the same generation's marker (see
    /// [`FastTier::write_consumed_over`]).
    async fn writeback_with(
        &self,
        token: &str,
        op: Writeback<'_>,
        gen: i64,
        ttl_ms: i64,
        marker: Option<&Marker>,
        over: bool,
    ) -> Result<bool, FastError> {
        let script = &self.scripts.writeback;
        let cmd = &self.writeback_cmd(token, op, gen, ttl_ms, marker, over);
        // Versioned, so safe to send again (see `connect`).
        self.call_idempotent(Lane::Background, "writeback", |mut c| async move {
            run_script::<i64>(script, cmd, &mut c).await.map(|n| n == 1)
        })
        .await
    }

    /// Deletes a token's key (before a durable release, so Postgres decides).
    pub async fn forget(&self, token: &str) -> Result<(), FastError> {
        let key = &self.token_key(token);
        self.call("forget", |mut c| async move {
            redis::cmd("DEL")
                .arg(key)
                .query_async::<i64>(&mut c)
                .await
                .map(|_| ())
        })
        .await
    }

    /// Records a fast type's result (`encoded`, JSON) on `handle`'s key, for
    /// the consume of `of_request` (any, if `None`), journaled with
    /// `journal`; only on `dataset` (the fleet's; `None`: not checked).
    pub async fn write_result(
        &self,
        handle: &str,
        encoded: String,
        of_request: Option<&str>,
        journal: &Record,
        dataset: Option<Uuid>,
    ) -> Result<ResultWrite, FastError> {
        let on = On {
            of_request,
            dataset,
        };
        match self
            .write_script(handle, WriteOp::Result, encoded, on, journal)
            .await?
        {
            Written::Result(r) => Ok(r),
            Written::Release(r) => Err(FastError::Protocol(format!(
                "fast_write (result) answered {r:?}"
            ))),
        }
    }

    /// Releases a fast type's consumed `handle` (of the consume of
    /// `of_request`, if named): issued again for `remaining_ms`, and
    /// consumed by nobody for `redis.timeout` after it (`cooling`, see
    /// `fast_write.lua`), so a consume script sent before it, whose caller
    /// died or gave up, passes its not-after bound first.
    pub async fn release(
        &self,
        handle: &str,
        remaining_ms: i64,
        of_request: Option<&str>,
        journal: &Record,
        dataset: Option<Uuid>,
    ) -> Result<ReleaseWrite, FastError> {
        let cool = self.settings.timeout.as_millis();
        let arg = format!("{remaining_ms}:{cool}");
        let on = On {
            of_request,
            dataset,
        };
        self.release_script(handle, WriteOp::Release, arg, on, journal)
            .await
    }

    /// A release by the processing lease: only of generation `gen`, and
    /// only once its consume is `lease_ms` old by Redis's clock; cooling
    /// as [`Self::release`].
    pub async fn lease_release(
        &self,
        handle: &str,
        remaining_ms: i64,
        gen: i64,
        lease_ms: i64,
        journal: &Record,
        dataset: Option<Uuid>,
    ) -> Result<ReleaseWrite, FastError> {
        let cool = self.settings.timeout.as_millis();
        let arg = format!("{remaining_ms}:{gen}:{lease_ms}:{cool}");
        let on = On {
            of_request: None,
            dataset,
        };
        self.release_script(handle, WriteOp::LeaseRelease, arg, on, journal)
            .await
    }

    async fn release_script(
        &self,
        handle: &str,
        op: WriteOp,
        arg: String,
        on: On<'_>,
        journal: &Record,
    ) -> Result<ReleaseWrite, FastError> {
        match self.write_script(handle, op, arg, on, journal).await? {
            Written::Release(r) => Ok(r),
            Written::Result(r) => Err(FastError::Protocol(format!(
                "fast_write ({}) answered {r:?}",
                op.as_str()
            ))),
        }
    }

    /// Runs `fast_write.lua`.
    async fn write_script(
        &self,
        token: &str,
        op: WriteOp,
        arg: String,
        on: On<'_>,
        journal: &Record,
    ) -> Result<Written, FastError> {
        let of_request = on.of_request.unwrap_or("");
        let dataset = match on.dataset {
            Some(d) if self.checks_dataset() => d.to_string(),
            _ => String::new(),
        };
        let (timeout, deadline) = (self.settings.timeout, &self.deadline);
        let (key, journal_key, arg) = (&self.token_key(token), self.journal_key(), &arg);
        let (dataset_key, dataset) = (self.dataset_key(), dataset.as_str());
        let script = &self.scripts.fast_write;
        let append = self.journal_in_script();
        let reply: Vec<String> = self
            .call("fast_write", |mut c| async move {
                let mut inv = script.key(key);
                if append {
                    inv.key(journal_key).key(dataset_key);
                }
                inv.arg(op.as_str())
                    .arg(arg)
                    .arg(if append { "1" } else { "0" })
                    .arg(of_request)
                    .arg(deadline.arg(timeout))
                    .arg(dataset);
                if append {
                    for (k, v) in journal.pairs() {
                        inv.arg(k).arg(v);
                    }
                }
                inv.invoke_async(&mut c).await
            })
            .await?;
        let field = |i: usize| reply.get(i).cloned().unwrap_or_default();
        if let Ok(redis_now) = field(3).parse::<i64>() {
            self.deadline.observe(redis_now);
        }
        let kind = reply.first().map(String::as_str).unwrap_or("");
        let detail = field(1);
        let is_result = op == WriteOp::Result;
        let out = match (kind, is_result) {
            // It reached Redis after this call's deadline and wrote nothing
            // (see `deadline`): to a caller still waiting, a timeout.
            ("late", _) => return Err(FastError::Timeout),
            ("recorded", true) => Written::Result(ResultWrite::Recorded),
            ("same", true) => Written::Result(ResultWrite::Same),
            ("conflict", true) => Written::Result(ResultWrite::Conflict(detail)),
            ("not_consumed", true) => Written::Result(ResultWrite::NotConsumed),
            ("miss", true) => Written::Result(ResultWrite::Miss),
            ("foreign", true) => Written::Result(ResultWrite::Foreign),
            ("foreign", false) => Written::Release(ReleaseWrite::Foreign),
            ("released", false) => Written::Release(ReleaseWrite::Released {
                gen: field(2).parse().unwrap_or(0),
                at_ms: field(3).parse().unwrap_or(0),
            }),
            ("not_releasable", false) => Written::Release(ReleaseWrite::NotReleasable),
            ("miss", false) => Written::Release(ReleaseWrite::Miss),
            (other, _) => {
                return Err(FastError::Protocol(format!(
                    "fast_write ({}) answered {other:?}",
                    op.as_str()
                )))
            }
        };
        let journaled = matches!(
            out,
            Written::Result(ResultWrite::Recorded)
                | Written::Release(ReleaseWrite::Released { .. })
        );
        if !append && journaled {
            // Cluster: what the script would have added to the entry.
            let of_consume = is_result.then(|| OfConsume {
                consumed_at: field(4),
                request_id: field(5),
                fingerprint: field(6),
            });
            let entry = journal.clone().written(field(2), field(3), of_consume);
            self.append_or_queue(entry).await;
        }
        Ok(out)
    }
}
