//! The fast tier: Redis. One Lua script per operation, each touching one
//! token's key (the token text is the key's hash tag, so a token's keys share a
//! cluster slot). For durable biz types Redis only turns duplicates away and
//! holds provisional markers; for fast biz types it decides, and appends what
//! it decided to the journal stream that [`crate::journal`] drains into
//! Postgres. Every call is bounded by `redis.timeout`; a connection error or a
//! timeout opens a short circuit breaker so that a dead Redis costs nothing per
//! request, and every answered call's latency feeds [`crate::health`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, IntoConnectionInfo, Pipeline, ProtocolVersion, RedisFuture, Script, Value};

mod journal;
mod scan;

pub use journal::{JournalEntry, ReadFrom, GROUP};
pub use scan::{KeyRead, KeyState, ScanNode};

use crate::config::{RedisSettings, RedisTopology};
use crate::health::{Health, Mode};
use crate::metrics::Metrics;
use crate::token::Clock;

#[derive(Debug, thiserror::Error)]
pub enum FastError {
    /// The call never reached Redis (the breaker is open, the connection was
    /// refused, or the cluster refused it): nothing ran.
    #[error("redis is marked down")]
    Down,
    #[error("redis call timed out")]
    Timeout,
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis answered something unexpected: {0}")]
    Protocol(String),
}

/// A connection to a standalone Redis or a cluster.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }
    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// One try of a call: how long it took, and its outcome (`None`: no answer
/// within `redis.timeout`).
struct Sent<T> {
    op: &'static str,
    took: Duration,
    out: Option<Result<T, redis::RedisError>>,
}

/// What the consume script found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScriptOutcome {
    /// Fast mode: consumed now (journal appended).
    Won { at_ms: i64 },
    /// Durable mode: our provisional marker is set; Postgres decides.
    Claimed,
    /// Consumed before.
    Consumed(Marker),
    /// Another attempt holds a live provisional marker.
    Provisional(Marker),
    /// No key.
    Miss,
    /// Peek: live and unconsumed.
    Issued,
}

/// The fields of a consumed or provisional marker.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Marker {
    pub at_ms: i64,
    pub request_id: Option<String>,
    pub fingerprint: Option<String>,
    pub result: Option<String>,
}

/// The generation a consume script found or decided, and Redis's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyVersion {
    /// The key's generation (bumped by every consume and release, odd while
    /// consumed); after a win, the one it decided; -1 for a missing key.
    pub gen: i64,
    /// Redis's clock when the script ran, ms.
    pub now_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumeMode {
    Durable,
    Fast,
    Peek,
}

/// The arguments of one consume attempt.
#[derive(Debug, Clone)]
pub struct Attempt<'a> {
    pub owner: &'a str,
    pub request_id: Option<&'a str>,
    pub fingerprint: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FastWrite {
    Recorded,
    Same,
    Conflict(String),
    NotConsumed,
    Released,
    NotReleasable,
    Miss,
}

struct Scripts {
    consume: Script,
    writeback: Script,
    fast_write: Script,
    issue: Script,
    reconcile: Script,
}

pub struct FastTier {
    settings: RedisSettings,
    /// The connections, made on first use; dropped to be made again from
    /// the seed nodes when a cluster stays unreachable (see [`FastTier::probe`]).
    conns: std::sync::RwLock<Option<Arc<Vec<Conn>>>>,
    /// Held while connecting, so that one caller connects and the others wait.
    connecting: tokio::sync::Mutex<()>,
    next: AtomicUsize,
    /// The breaker, the latency window and the mode.
    health: Health,
    scripts: Scripts,
    /// The service's clock (the breaker's backoff, fallbacks for replies).
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    cluster: bool,
    /// Cluster only: journal entries of decisions already made whose
    /// separate `XADD` failed. The decision stands (its caller is told the
    /// outcome); the entry is appended later ([`FastTier::flush_journal_backlog`]).
    journal_backlog: std::sync::Mutex<std::collections::VecDeque<Vec<(&'static str, String)>>>,
}

impl std::fmt::Debug for FastTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastTier")
            .field("prefix", &self.settings.key_prefix)
            .field("mode", &self.health.mode())
            .finish()
    }
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

fn opt(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

impl FastTier {
    /// Creates the tier without connecting: connections are made lazily, so
    /// the service starts while Redis is down.
    pub fn new(
        settings: RedisSettings,
        metrics: Arc<Metrics>,
        clock: Arc<dyn Clock>,
    ) -> Arc<FastTier> {
        let cluster = matches!(settings.topology, RedisTopology::Cluster(_));
        Arc::new(FastTier {
            health: Health::new(&settings, metrics.clone(), clock.clone()),
            clock,
            settings,
            conns: std::sync::RwLock::new(None),
            connecting: tokio::sync::Mutex::new(()),
            next: AtomicUsize::new(0),
            scripts: Scripts {
                consume: Script::new(include_str!("lua/consume.lua")),
                writeback: Script::new(include_str!("lua/writeback.lua")),
                fast_write: Script::new(include_str!("lua/fast_write.lua")),
                issue: Script::new(include_str!("lua/issue.lua")),
                reconcile: Script::new(include_str!("lua/reconcile.lua")),
            },
            metrics,
            cluster,
            journal_backlog: Default::default(),
        })
    }

    /// `redis.ca_file` for the redis crate (`None`: the system's roots).
    fn tls_certs(&self) -> Option<redis::TlsCertificates> {
        self.settings.ca.as_ref().map(|ca| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca.pem.clone()),
        })
    }

    /// A standalone client: `rediss://` URLs verify against `redis.ca_file`
    /// when set.
    /// Speaks RESP3 (see [`FastTier::connect`]).
    fn standalone_client(&self, url: &str) -> Result<redis::Client, redis::RedisError> {
        let info = url.into_connection_info()?;
        let resp3 = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let info = info.set_redis_settings(resp3);
        match self.tls_certs() {
            Some(certs) if url.starts_with("rediss://") => {
                redis::Client::build_with_tls(info, certs)
            }
            _ => redis::Client::open(info),
        }
    }

    fn cluster_client(
        &self,
        nodes: &[String],
    ) -> Result<redis::cluster::ClusterClient, redis::RedisError> {
        let timeout = self.settings.timeout;
        let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.to_vec())
            .use_protocol(ProtocolVersion::RESP3)
            .response_timeout(timeout)
            .connection_timeout(timeout.max(Duration::from_millis(500)))
            .retries(0);
        if let Some(certs) = self.tls_certs() {
            builder = builder.certs(certs);
        }
        builder.build()
    }

    /// At start, for `rediss://` URLs only: one connection and a PING. A TLS
    /// failure (a certificate that does not verify, a server that does not
    /// speak TLS) is an error naming the setting; Redis unreachable is not
    /// (the service starts without Redis, see `health`).
    pub async fn check_tls(&self) -> anyhow::Result<()> {
        let (setting, tls) = match &self.settings.topology {
            RedisTopology::Standalone(url) => ("redis.url", url.starts_with("rediss://")),
            RedisTopology::Cluster(nodes) => (
                "redis.cluster_nodes",
                nodes.iter().any(|n| n.starts_with("rediss://")),
            ),
        };
        if !tls {
            return Ok(());
        }
        let bound = self.settings.timeout.max(Duration::from_secs(2));
        let attempt = async {
            match &self.settings.topology {
                RedisTopology::Standalone(url) => {
                    let config = redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(bound))
                        .set_response_timeout(Some(bound));
                    let mut c = self
                        .standalone_client(url)?
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?;
                    redis::cmd("PING").query_async::<()>(&mut c).await
                }
                RedisTopology::Cluster(nodes) => {
                    let mut c = self.cluster_client(nodes)?.get_async_connection().await?;
                    redis::cmd("PING").query_async::<()>(&mut c).await
                }
            }
        };
        let ca = match &self.settings.ca {
            Some(ca) => format!("redis.ca_file ({})", ca.path.display()),
            None => "the system's root certificates (or set redis.ca_file)".to_owned(),
        };
        match tokio::time::timeout(bound, attempt).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) if crate::tls::is_tls_error(&e) => Err(anyhow::Error::new(e).context(
                format!("{setting}: TLS failed; check the server's certificate against {ca}, and that the port speaks TLS"),
            )),
            Ok(Err(e)) if !e.is_timeout() => {
                tracing::warn!(error = %e, "{setting}: redis not reachable at start; TLS not checked yet");
                Ok(())
            }
            Ok(Err(_)) | Err(_) => {
                // A port that accepts TCP but completes no TLS handshake is
                // most likely plaintext Redis (it waits for a command end).
                let first = match &self.settings.topology {
                    RedisTopology::Standalone(url) => url.clone(),
                    RedisTopology::Cluster(nodes) => nodes.first().cloned().unwrap_or_default(),
                };
                let addr = url::Url::parse(&first)
                    .ok()
                    .and_then(|u| Some(format!("{}:{}", u.host_str()?, u.port().unwrap_or(6379))));
                if let Some(addr) = addr {
                    let tcp = tokio::time::timeout(bound, tokio::net::TcpStream::connect(&addr)).await;
                    if matches!(tcp, Ok(Ok(_))) {
                        anyhow::bail!(
                            "{setting}: TLS failed; {addr} accepts connections but completed no TLS handshake within {bound:?} (does that port speak TLS?)"
                        );
                    }
                }
                tracing::warn!("{setting}: no answer from redis within {bound:?} at start; TLS not checked yet");
                Ok(())
            }
        }
    }

    /// Makes the connections. Both kinds speak RESP3, for one reason: a
    /// RESP3 connection tells its owner when its socket closes (a
    /// disconnection push), and the redis client then reconnects at once, in
    /// the background. A connection that Redis closed while it was idle
    /// (`CLIENT KILL`, a `timeout` reaper, a restart) is thus replaced before
    /// the next call instead of failing it; the next call waits for the new
    /// connection, bounded by `redis.timeout`.
    ///
    /// A call that failed after it was handed to a connection may have run:
    /// its reply can be lost with the socket. Only the consume script and
    /// the write-backs are sent again then (once, see
    /// [`FastTier::call_idempotent`]): the consume is idempotent per attempt
    /// owner, so a second copy answers what the first did (`consume.lua`),
    /// and a write-back applies only over an older generation (or, to give a
    /// claim back, only while its owner holds it), so a second copy writes
    /// nothing (`writeback.lua`). The others are not, and are never resent:
    /// `fast_write.lua` sent again answers `same` or `not_releasable` for
    /// what it just did, an `XADD` would journal a decision twice. Their
    /// failure stays an error for the caller (503 where the outcome is
    /// unknown). For the same reason the cluster client's own resend after a
    /// dropped connection is switched off (`retries(0)`): it would resend
    /// any of them.
    async fn connect(&self) -> Result<Vec<Conn>, redis::RedisError> {
        let timeout = self.settings.timeout;
        match &self.settings.topology {
            RedisTopology::Standalone(url) => {
                let client = self.standalone_client(url)?;
                let config = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(timeout.max(Duration::from_millis(500))))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                let mut conns = Vec::new();
                for _ in 0..self.settings.connections {
                    conns.push(Conn::Single(ConnectionManager::new_lazy_with_config(
                        client.clone(),
                        config.clone(),
                    )?));
                }
                Ok(conns)
            }
            RedisTopology::Cluster(nodes) => {
                let conn = self.cluster_client(nodes)?.get_async_connection().await?;
                Ok(vec![Conn::Cluster(conn)])
            }
        }
    }

    fn pick(&self) -> Option<Conn> {
        let conns = self
            .conns
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        let i = self.next.fetch_add(1, Ordering::Relaxed) % conns.len();
        conns.get(i).cloned()
    }

    async fn conn(&self) -> Result<Conn, FastError> {
        if self.health.skipping() {
            return Err(FastError::Down);
        }
        if let Some(c) = self.pick() {
            return Ok(c);
        }
        let bound = self.settings.timeout.max(Duration::from_millis(500));
        let made = tokio::time::timeout(bound, async {
            let _one = self.connecting.lock().await;
            if let Some(c) = self.pick() {
                return Ok(c);
            }
            let conns = self.connect().await?;
            *self.conns.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(conns));
            self.pick().ok_or_else(|| {
                redis::RedisError::from((redis::ErrorKind::Client, "no connections"))
            })
        })
        .await;
        match made {
            Ok(Ok(c)) => Ok(c),
            // No connection: nothing was sent.
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot connect to redis");
                self.health.trip();
                Err(FastError::Down)
            }
            Err(_) => {
                self.health.trip();
                Err(FastError::Down)
            }
        }
    }

    /// Drops a cluster connection so that the next call connects afresh from
    /// the seed nodes and reads the slot map again. The cluster client only
    /// refreshes its map on a redirect, and a master that died never sends
    /// one: after a failover it would keep calling the dead address.
    fn reconnect_cluster(&self) {
        if self.cluster {
            *self.conns.write().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }

    /// Is Redis considered down right now?
    pub fn is_down(&self) -> bool {
        self.health.is_down()
    }

    /// The current mode (see [`crate::health`]).
    pub fn mode(&self) -> Mode {
        self.health.mode()
    }

    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Runs one call with the tier's timeout, breaker and metrics.
    async fn call<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T, FastError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let sent = self.send(op, f).await?;
        self.judge(sent)
    }

    /// [`FastTier::call`] for a call that is idempotent per attempt: when the
    /// connection dropped under it (the socket closed before its reply), it
    /// is sent once more, on the next connection. Safe only because sending
    /// it twice answers what sending it once would have, in either order
    /// (see `consume.lua`); a timeout is never resent (the first may still
    /// be on its way).
    async fn call_idempotent<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T, FastError>
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

    /// One try: a connection (or [`FastError::Down`]), then the call under
    /// `redis.timeout`.
    async fn send<T, F, Fut>(&self, op: &'static str, f: F) -> Result<Sent<T>, FastError>
    where
        F: FnOnce(Conn) -> Fut,
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

    pub fn token_key(&self, token: &str) -> String {
        format!("{}tok:{{{}}}", self.settings.key_prefix, token)
    }

    pub fn consumed_ttl_ms(&self) -> i64 {
        i64::try_from(self.settings.consumed_ttl.as_millis()).unwrap_or(i64::MAX)
    }

    /// Seeds a freshly issued token with a relative TTL.
    pub async fn seed(&self, token: &str, ttl_ms: i64) -> Result<(), FastError> {
        let key = self.token_key(token);
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

    /// Runs the consume script. `journal` holds the journal entry's fields
    /// (fast mode on a standalone Redis).
    pub async fn consume(
        &self,
        token: &str,
        mode: ConsumeMode,
        attempt: &Attempt<'_>,
        provisional_ms: i64,
        journal: &[(&'static str, String)],
    ) -> Result<ScriptOutcome, FastError> {
        self.consume_versioned(token, mode, attempt, provisional_ms, journal)
            .await
            .map(|(outcome, _)| outcome)
    }

    /// Runs the consume script, and says which generation the key is at
    /// (the one it decided, after a fast win) and Redis's clock.
    pub async fn consume_versioned(
        &self,
        token: &str,
        mode: ConsumeMode,
        attempt: &Attempt<'_>,
        provisional_ms: i64,
        journal: &[(&'static str, String)],
    ) -> Result<(ScriptOutcome, KeyVersion), FastError> {
        let key = self.token_key(token);
        let journal_key = self.journal_key();
        let script = &self.scripts.consume;
        let mode_arg = match mode {
            ConsumeMode::Durable => "durable",
            ConsumeMode::Fast => "fast",
            ConsumeMode::Peek => "peek",
        };
        let append = mode == ConsumeMode::Fast && self.journal_in_script() && !journal.is_empty();
        let consumed_ttl = self.consumed_ttl_ms();
        // The script is idempotent per owner, so every attempt needs its own
        // (a fast consume's caller may not name one).
        let fresh_owner;
        let owner = if attempt.owner.is_empty() {
            fresh_owner = uuid::Uuid::new_v4().simple().to_string();
            fresh_owner.as_str()
        } else {
            attempt.owner
        };
        let (key, journal_key) = (&key, &journal_key);
        let reply: Vec<String> = self
            .call_idempotent("consume", |mut c| async move {
                let mut inv = script.key(key);
                if append {
                    inv.key(journal_key);
                }
                inv.arg(mode_arg)
                    .arg(owner)
                    .arg(provisional_ms)
                    .arg(attempt.request_id.unwrap_or(""))
                    .arg(attempt.fingerprint.unwrap_or(""))
                    .arg(consumed_ttl)
                    .arg(if append { "1" } else { "0" });
                if append {
                    for (k, v) in journal {
                        inv.arg(*k).arg(v.as_str());
                    }
                }
                inv.invoke_async(&mut c).await
            })
            .await?;
        let (outcome, version) = parse_consume_reply(&reply, self.clock.now_ms())?;
        let label = match outcome {
            ScriptOutcome::Miss => "miss",
            _ => "hit",
        };
        self.metrics
            .fast_tier_total
            .with_label_values(&[label])
            .inc();
        if append {
            if let ScriptOutcome::Won { .. } = outcome {
                return Ok((outcome, version));
            }
        } else if let (ScriptOutcome::Won { at_ms }, ConsumeMode::Fast) = (&outcome, mode) {
            // Cluster: the journal stream is in another slot.
            if !journal.is_empty() {
                let mut entry: Vec<(&'static str, String)> = journal.to_vec();
                entry.push((crate::journal::AT, at_ms.to_string()));
                entry.push((crate::journal::GEN, version.gen.to_string()));
                self.append_or_queue(entry).await;
            }
        }
        Ok((outcome, version))
    }

    /// Our provisional marker goes back to issued, at its generation, with
    /// `remaining_ms` to live, if we still own it (see `writeback.lua`).
    pub async fn unclaim(
        &self,
        token: &str,
        owner: &str,
        remaining_ms: i64,
    ) -> Result<(), FastError> {
        self.writeback(token, "unclaim", 0, remaining_ms, None, owner)
            .await
            .map(|_| ())
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
        self.writeback(token, "consumed", gen, life, Some(marker), "")
            .await
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
        self.writeback(token, "issued", gen, remaining_ms, None, "")
            .await
    }

    async fn writeback(
        &self,
        token: &str,
        op: &'static str,
        gen: i64,
        ttl_ms: i64,
        marker: Option<&Marker>,
        owner: &str,
    ) -> Result<bool, FastError> {
        let key = self.token_key(token);
        let script = &self.scripts.writeback;
        let m = marker.cloned().unwrap_or_default();
        let (key, m) = (&key, &m);
        // Versioned, so safe to send again (see `connect`).
        self.call_idempotent("writeback", |mut c| async move {
            script
                .key(key)
                .arg(op)
                .arg(gen)
                .arg(ttl_ms)
                .arg(m.at_ms)
                .arg(m.request_id.as_deref().unwrap_or(""))
                .arg(m.fingerprint.as_deref().unwrap_or(""))
                .arg(m.result.as_deref().unwrap_or(""))
                .arg(owner)
                .invoke_async::<i64>(&mut c)
                .await
                .map(|n| n == 1)
        })
        .await
    }

    /// Deletes a token's key (before a durable release, so Postgres decides).
    pub async fn forget(&self, token: &str) -> Result<(), FastError> {
        let key = self.token_key(token);
        self.call("forget", |mut c| async move {
            redis::cmd("DEL")
                .arg(key)
                .query_async::<i64>(&mut c)
                .await
                .map(|_| ())
        })
        .await
    }

    /// Result or release of a fast biz type (see `fast_write.lua`).
    pub async fn fast_write(
        &self,
        token: &str,
        op: &'static str,
        arg: String,
        journal: &[(&'static str, String)],
    ) -> Result<FastWrite, FastError> {
        let key = self.token_key(token);
        let journal_key = self.journal_key();
        let script = &self.scripts.fast_write;
        let append = self.journal_in_script() && !journal.is_empty();
        let reply: Vec<String> = self
            .call("fast_write", |mut c| async move {
                let mut inv = script.key(key);
                if append {
                    inv.key(journal_key);
                }
                inv.arg(op).arg(arg).arg(if append { "1" } else { "0" });
                if append {
                    for (k, v) in journal {
                        inv.arg(*k).arg(v.as_str());
                    }
                }
                inv.invoke_async(&mut c).await
            })
            .await?;
        let field = |i: usize| reply.get(i).cloned().unwrap_or_default();
        let kind = reply.first().map(String::as_str).unwrap_or("");
        let detail = field(1);
        let out = match kind {
            "recorded" => FastWrite::Recorded,
            "same" => FastWrite::Same,
            "conflict" => FastWrite::Conflict(detail),
            "not_consumed" => FastWrite::NotConsumed,
            "released" => FastWrite::Released,
            "not_releasable" => FastWrite::NotReleasable,
            "miss" => FastWrite::Miss,
            other => {
                return Err(FastError::Protocol(format!(
                    "fast_write answered {other:?}"
                )))
            }
        };
        if !append
            && matches!(out, FastWrite::Recorded | FastWrite::Released)
            && !journal.is_empty()
        {
            // Cluster: what the script would have added to the entry.
            use crate::journal::{AT, CONSUMED_AT, FINGERPRINT, GEN, REQUEST_ID};
            let mut entry = journal.to_vec();
            entry.push((GEN, field(2)));
            entry.push((AT, field(3)));
            if out == FastWrite::Recorded {
                entry.push((CONSUMED_AT, field(4)));
                entry.push((REQUEST_ID, field(5)));
                entry.push((FINGERPRINT, field(6)));
            }
            self.append_or_queue(entry).await;
        }
        Ok(out)
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
        let ok = self
            .call("ping", |mut c| async move {
                redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .map(|_| ())
            })
            .await
            .is_ok();
        if !ok {
            self.reconnect_cluster();
        }
        ok
    }

    /// `CONFIG GET maxmemory-policy` (standalone only); `None` when unknown.
    pub async fn maxmemory_policy(&self) -> Option<String> {
        if self.cluster {
            return None;
        }
        let reply: Result<Value, _> = self
            .call("config", |mut c| async move {
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

/// `now_ms`: ours, for a reply that lacks Redis's (never from our scripts).
fn parse_consume_reply(
    reply: &[String],
    now_ms: i64,
) -> Result<(ScriptOutcome, KeyVersion), FastError> {
    let field = |i: usize| reply.get(i).map(String::as_str).unwrap_or("");
    let version = KeyVersion {
        gen: field(5).parse().unwrap_or(-1),
        now_ms: field(6).parse().unwrap_or(now_ms),
    };
    let marker = || Marker {
        at_ms: field(1).parse().unwrap_or(0),
        request_id: opt(field(2)),
        fingerprint: opt(field(3)),
        result: opt(field(4)),
    };
    let outcome = match field(0) {
        "won" => ScriptOutcome::Won {
            at_ms: field(1).parse().unwrap_or(now_ms),
        },
        "claimed" => ScriptOutcome::Claimed,
        "consumed" => ScriptOutcome::Consumed(marker()),
        "provisional" => ScriptOutcome::Provisional(marker()),
        "miss" => ScriptOutcome::Miss,
        "issued" => ScriptOutcome::Issued,
        other => return Err(FastError::Protocol(format!("consume answered {other:?}"))),
    };
    Ok((outcome, version))
}
