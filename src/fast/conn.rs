//! Connections to a standalone Redis or a cluster (RESP3, TLS against
//! `redis.ca_file`), made on first use; each calling thread keeps to one.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo, Slot};
use redis::{
    Cmd, ErrorKind, IntoConnectionInfo, Pipeline, ProtocolVersion, RedisError, RedisFuture,
    RedisResult, ServerErrorKind, Value,
};

use super::{FastError, FastTier};
use crate::config::RedisTopology;
use crate::fast::breaker::Failure;

/// Who waits on a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// A request: `redis.timeout`, and the outcome is evidence of health.
    Serving,
    /// The breaker's probe and an idle instance's check: as [`Lane::Serving`]
    /// (`redis.timeout`, evidence of health), but no request waits on it, so
    /// it is not one of the serving path's lookups (`ledger_fast_tier_total`).
    Health,
    /// Background work: `redis.background_timeout`, no evidence.
    Background,
}

impl Lane {
    /// Whether the outcome is evidence of this instance's view of Redis.
    pub(super) fn is_evidence(self) -> bool {
        self != Lane::Background
    }
}

/// A connection to a standalone Redis or a cluster.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// The cluster connection for a call sent again after a redirect: its
    /// commands in the redirect's slot go to the node the redirect named.
    Redirected(ClusterConnection, Arc<Redirect>),
}

/// This thread's slot among the connections: thread `n` (numbered in the
/// order threads first call Redis) uses connection `n % redis.connections`.
///
/// A connection's socket is driven by a task on the thread that made it (an
/// actix worker's runtime is its thread's own), so a call from another
/// thread hands its command over and is woken again for the reply: two
/// thread wake-ups per call. Kept to one thread, a call writes and reads on
/// its own thread. With at least as many connections as calling threads
/// (two actix workers and the runtime's two threads on two cores, against
/// the default four), no connection is shared between threads.
fn thread_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    SLOT.with(|s| *s)
}

/// A `MOVED` or `ASK` reply of a cluster node: the command did not run
/// there, and the reply names the node that serves its slot (`MOVED`: the
/// slot's new owner; `ASK`: the node importing it, which runs the command
/// only right after `ASKING`).
///
/// The cluster client follows redirects itself only within its retries,
/// and those also resend a command whose connection dropped under it (it
/// may have run): they stay off (`retries(0)`), and [`FastTier::call`]
/// follows redirects with this instead.
#[derive(Clone, Debug)]
pub(super) struct Redirect {
    slot: Slot,
    host: String,
    port: u16,
    ask: bool,
    /// The reply itself, answered again when the named node cannot be
    /// reached.
    reply: RedisError,
    /// `ASK`: a client of its own for the named node (the seeds' scheme,
    /// credentials and CA), for a node the cluster client holds no
    /// connection to (see [`FastTier::redirected`]), and its connection
    /// once made (for this call only).
    direct: Option<redis::Client>,
    direct_conn: Arc<tokio::sync::OnceCell<Option<MultiplexedConnection>>>,
}

impl Redirect {
    /// The redirect `e` is, if it is one.
    pub(super) fn of(e: &RedisError) -> Option<Redirect> {
        let ask = match e.kind() {
            ErrorKind::Server(ServerErrorKind::Ask) => true,
            ErrorKind::Server(ServerErrorKind::Moved) => false,
            _ => return None,
        };
        let (addr, slot) = e.redirect_node()?;
        let (host, port) = addr.rsplit_once(':')?;
        Some(Redirect {
            slot: Slot::new(slot)?,
            host: host.to_owned(),
            port: port.parse().ok()?,
            ask,
            reply: e.clone(),
            direct: None,
            direct_conn: Default::default(),
        })
    }

    /// The connection of its own to an `ASK`'s node (`None`: not an `ASK`,
    /// or it cannot be made).
    async fn direct(&self) -> Option<MultiplexedConnection> {
        let client = self.direct.as_ref()?;
        self.direct_conn
            .get_or_init(|| async { client.get_multiplexed_async_connection().await.ok() })
            .await
            .clone()
    }

    /// A script loaded for the cluster (`SCRIPT LOAD`, sent to the masters
    /// the cluster client knows) during an `ASK` followed over a connection
    /// of its own: loaded on that node too, since the script may run there.
    async fn load_direct(&self, cmd: &Cmd) {
        if let Some(mut direct) = self.direct_conn.get().cloned().flatten() {
            if let Err(e) = direct.req_packed_command(cmd).await {
                tracing::debug!(error = %e, "SCRIPT LOAD on the node an ASK named failed");
            }
        }
    }

    /// Whether `cmd`'s key is in the redirect's slot.
    fn covers(&self, cmd: &Cmd) -> bool {
        command_key(cmd).is_some_and(|k| Slot::for_key(k) == self.slot)
    }

    /// `cmd` to the named node (`ASK`: as `ASKING` then `cmd`, one write on
    /// one connection). When the cluster client holds no connection to that
    /// node (one that served no slot when it read the map, such as a master
    /// added since), nothing was sent: after `MOVED` the command goes by the
    /// slot map, which the client reads again on every `MOVED`; after `ASK`
    /// it goes over a connection of its own to the node, made for this
    /// call, and if that cannot be made the call fails with the redirect.
    async fn send(&self, c: &mut ClusterConnection, cmd: &Cmd) -> RedisResult<Value> {
        let to = SingleNodeRoutingInfo::ByAddress {
            host: self.host.clone(),
            port: self.port,
        };
        let sent = if self.ask {
            let mut p = redis::pipe();
            p.cmd("ASKING").add_command(cmd.clone());
            c.route_pipeline(p, 1, 1, to).await.and_then(|mut v| {
                v.pop()
                    .ok_or_else(|| RedisError::from((ErrorKind::Client, "no reply after ASKING")))
            })
        } else {
            c.route_command(cmd.clone(), RoutingInfo::SingleNode(to))
                .await
        };
        match sent {
            Err(e) if e.kind() == ErrorKind::ClusterConnectionNotFound => {
                if !self.ask {
                    return c.req_packed_command(cmd).await;
                }
                let Some(mut direct) = self.direct().await else {
                    return Err(self.reply.clone());
                };
                let mut p = redis::pipe();
                p.cmd("ASKING").add_command(cmd.clone());
                direct
                    .req_packed_commands(&p, 1, 1)
                    .await
                    .and_then(|mut v| {
                        v.pop().ok_or_else(|| {
                            RedisError::from((ErrorKind::Client, "no reply after ASKING"))
                        })
                    })
            }
            other => other,
        }
    }
}

fn is_script_load(cmd: &Cmd) -> bool {
    let mut args = cmd.args_iter().filter_map(|a| match a {
        redis::Arg::Simple(a) => Some(a),
        _ => None,
    });
    args.next()
        .is_some_and(|a| a.eq_ignore_ascii_case(b"SCRIPT"))
        && args.next().is_some_and(|a| a.eq_ignore_ascii_case(b"LOAD"))
}

/// The key a command of this service is routed by (the cluster client's
/// own router is private): the first key of a script, the stream of
/// `XREADGROUP` and `XGROUP`, none for the commands without one, else the
/// first argument.
fn command_key(cmd: &Cmd) -> Option<&[u8]> {
    let args: Vec<&[u8]> = cmd
        .args_iter()
        .map(|a| match a {
            redis::Arg::Simple(a) => a,
            _ => &b""[..],
        })
        .collect();
    let name = args.first()?.to_ascii_uppercase();
    match name.as_slice() {
        b"EVAL" | b"EVALSHA" | b"EVAL_RO" | b"EVALSHA_RO" | b"FCALL" | b"FCALL_RO" => {
            let keys: usize = std::str::from_utf8(args.get(2)?).ok()?.parse().ok()?;
            (keys > 0).then(|| args.get(3).copied()).flatten()
        }
        b"XREADGROUP" | b"XREAD" => {
            let at = args
                .iter()
                .position(|a| a.eq_ignore_ascii_case(b"STREAMS"))?;
            args.get(at + 1).copied()
        }
        b"XGROUP" | b"XINFO" => args.get(2).copied(),
        b"PING" | b"TIME" | b"ECHO" | b"CLUSTER" | b"CONFIG" | b"SCRIPT" | b"FUNCTION"
        | b"SCAN" | b"INFO" | b"ASKING" | b"READONLY" => None,
        _ => args.get(1).copied(),
    }
}

impl Conn {
    /// This connection for a call sent again after `redirect` (a cluster
    /// connection only; a standalone Redis never redirects).
    pub(super) fn redirected(self, redirect: Redirect) -> Conn {
        match self {
            Conn::Cluster(c) | Conn::Redirected(c, _) => Conn::Redirected(c, Arc::new(redirect)),
            single => single,
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Redirected(c, r) => {
                let r = r.clone();
                if r.covers(cmd) {
                    Box::pin(async move { r.send(c, cmd).await })
                } else if is_script_load(cmd) {
                    Box::pin(async move {
                        let loaded = c.req_packed_command(cmd).await;
                        r.load_direct(cmd).await;
                        loaded
                    })
                } else {
                    c.req_packed_command(cmd)
                }
            }
        }
    }
    /// Pipelines are never redirected: a redirect proves only that the
    /// command it answered did not run, not the others of the pipeline.
    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) | Conn::Redirected(c, _) => c.req_packed_commands(cmd, offset, count),
        }
    }
    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) | Conn::Redirected(c, _) => c.get_db(),
        }
    }
}

impl FastTier {
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

    /// The connections' own response timeout: only a backstop, longer than
    /// either lane's, so that the lane of a call decides when it took too
    /// long (`FastTier::try_once`). A call that outlives `redis.timeout` is
    /// then slowness (one timeout, not evidence that Redis is unreachable),
    /// and a background call has `redis.background_timeout`. Were it the
    /// lanes' own, the client's timer would race the lane's, and a timeout
    /// it won would count as a connection failure.
    fn response_backstop(&self) -> Duration {
        self.settings.timeout.max(self.settings.background_timeout) + Duration::from_secs(1)
    }

    fn cluster_client(
        &self,
        nodes: &[String],
    ) -> Result<redis::cluster::ClusterClient, redis::RedisError> {
        let timeout = self.settings.timeout;
        let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.to_vec())
            .use_protocol(ProtocolVersion::RESP3)
            .response_timeout(self.response_backstop())
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
                    .set_response_timeout(Some(self.response_backstop()))
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

    /// This thread's connection (see [`thread_slot`]), if made.
    fn pick(&self) -> Option<Conn> {
        let conns = self
            .conns
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        conns.get(thread_slot() % conns.len().max(1)).cloned()
    }

    pub(super) async fn conn(&self, lane: Lane) -> Result<Conn, FastError> {
        if self.health.skipping() {
            return Err(FastError::Down);
        }
        if let Some(c) = self.pick() {
            return Ok(c);
        }
        // Boxed: connecting happens once (and after a failover); its future
        // would otherwise take its room in every call's.
        Box::pin(self.connect_and_pick(lane)).await
    }

    /// [`Self::conn`] when there are no connections yet: makes them (one
    /// caller at a time), then picks one.
    async fn connect_and_pick(&self, lane: Lane) -> Result<Conn, FastError> {
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
                if lane.is_evidence() {
                    self.health.failed(Failure::Unreached);
                }
                Err(FastError::Down)
            }
            Err(_) => {
                if lane.is_evidence() {
                    self.health.failed(Failure::Unreached);
                }
                Err(FastError::Down)
            }
        }
    }

    /// `conn` for a call sent again after `redirect`; an `ASK` gets a
    /// client for the node it names, in case the cluster client holds no
    /// connection to it (see [`Redirect`]).
    pub(super) fn redirected(&self, conn: Conn, mut redirect: Redirect) -> Conn {
        if redirect.ask {
            redirect.direct = self.node_client(&redirect.host, redirect.port);
        }
        conn.redirected(redirect)
    }

    /// A standalone client of a cluster node at `host:port`, as the first
    /// seed of `redis.cluster_nodes` is reached (scheme, credentials,
    /// `redis.ca_file`, RESP3).
    fn node_client(&self, host: &str, port: u16) -> Option<redis::Client> {
        let RedisTopology::Cluster(nodes) = &self.settings.topology else {
            return None;
        };
        let mut url = url::Url::parse(nodes.first()?).ok()?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        url.set_host(Some(&host)).ok()?;
        url.set_port(Some(port)).ok()?;
        self.standalone_client(url.as_str()).ok()
    }

    /// Drops a cluster connection so that the next call connects afresh from
    /// the seed nodes and reads the slot map again. The cluster client only
    /// refreshes its map on a redirect, and a master that died never sends
    /// one: after a failover it would keep calling the dead address.
    pub(super) fn reconnect_cluster(&self) {
        if self.cluster {
            *self.conns.write().unwrap_or_else(|p| p.into_inner()) = None;
            self.forget_slot_map();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_of_each_command_kind() {
        let key = |c: &Cmd| command_key(c).map(|k| String::from_utf8_lossy(k).into_owned());
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha.arg("abc").arg(1).arg("p:tok:{t}").arg("x");
        assert_eq!(key(&evalsha).as_deref(), Some("p:tok:{t}"));
        let mut keyless = redis::cmd("EVAL");
        keyless.arg("return 1").arg(0).arg("x");
        assert_eq!(key(&keyless), None);
        let mut read = redis::cmd("XREADGROUP");
        read.arg("GROUP").arg("g").arg("c").arg("COUNT").arg(5);
        read.arg("STREAMS").arg("p:journal").arg(">");
        assert_eq!(key(&read).as_deref(), Some("p:journal"));
        let mut group = redis::cmd("XGROUP");
        group.arg("CREATE").arg("p:journal").arg("g").arg("0");
        assert_eq!(key(&group).as_deref(), Some("p:journal"));
        let mut hget = redis::cmd("HGET");
        hget.arg("p:tok:{t}").arg("s");
        assert_eq!(key(&hget).as_deref(), Some("p:tok:{t}"));
        for c in ["PING", "TIME"] {
            assert_eq!(key(&redis::cmd(c)), None, "{c}");
        }
        let mut slots = redis::cmd("CLUSTER");
        slots.arg("SLOTS");
        assert_eq!(key(&slots), None);
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg("return 1");
        assert_eq!(key(&load), None);
        assert!(is_script_load(&load));
        assert!(!is_script_load(&evalsha) && !is_script_load(&slots));
    }

    #[test]
    fn moved_and_ask_replies_are_redirects_that_cover_their_slot() {
        let key = "p:tok:{abc}";
        let slot = redis::cluster_routing::Slot::for_key(key);
        let n = (0..16384u16)
            .find(|n| Slot::new(*n) == Some(slot))
            .expect("a slot");
        let reply = |kind: ServerErrorKind, detail: String| {
            RedisError::from((ErrorKind::Server(kind), "redirect", detail))
        };
        let mut hget = redis::cmd("HGET");
        hget.arg(key).arg("s");
        let mut other = redis::cmd("HGET");
        other.arg("p:tok:{another}").arg("s");

        let moved = Redirect::of(&reply(ServerErrorKind::Moved, format!("{n} 10.0.0.7:6380")))
            .expect("MOVED is a redirect");
        assert_eq!(
            (moved.host.as_str(), moved.port, moved.ask),
            ("10.0.0.7", 6380, false)
        );
        assert!(moved.covers(&hget));
        assert!(!moved.covers(&other));
        assert!(!moved.covers(&redis::cmd("TIME")));
        let ask = Redirect::of(&reply(ServerErrorKind::Ask, format!("{n} 10.0.0.8:6381")))
            .expect("ASK is a redirect");
        assert_eq!(
            (ask.host.as_str(), ask.port, ask.ask),
            ("10.0.0.8", 6381, true)
        );
        for not in [
            reply(ServerErrorKind::TryAgain, String::new()),
            reply(ServerErrorKind::ClusterDown, String::new()),
            RedisError::from((ErrorKind::Io, "io")),
        ] {
            assert!(Redirect::of(&not).is_none(), "{not}");
        }
    }
}
