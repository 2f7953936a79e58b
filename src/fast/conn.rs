//! Connections to a standalone Redis or a cluster (RESP3, TLS against
//! `redis.ca_file`), made on first use and shared round-robin.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, IntoConnectionInfo, Pipeline, ProtocolVersion, RedisFuture, Value};

use super::{FastError, FastTier};
use crate::config::RedisTopology;

/// A connection to a standalone Redis or a cluster.
#[derive(Clone)]
pub(super) enum Conn {
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

    pub(super) async fn conn(&self) -> Result<Conn, FastError> {
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
    pub(super) fn reconnect_cluster(&self) {
        if self.cluster {
            *self.conns.write().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }
}
