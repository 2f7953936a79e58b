//! From the raw tree to [`Settings`]: every check, naming the key at fault,
//! including the cross-field ones (retention bounds the markers and the
//! filter, clients' grants name configured biz types, production refuses
//! development secrets). One function per section; [`Raw::validate`] runs
//! them in a fixed order, so that of several problems the same one is
//! named first.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use super::invalid;
use super::parse::{is_key_id, parse_duration, parse_rate};
use super::raw::{
    Raw, RawAudit, RawBiz, RawBloom, RawClient, RawFleet, RawKey, RawLimits, RawPostgres,
    RawReconcile, RawRedis, RawServer, RawTokens,
};
use super::settings::{
    AuditSettings, BizSettings, BloomSettings, CaFile, Environment, FleetSettings, LimitSettings,
    PostgresSettings, ProcessingLease, ReconcileSettings, RedisSettings, RedisTopology, SealKey,
    ServerSettings, Settings, SigningKey, TokenSettings,
};
use super::ConfigError;
use crate::auth::Client;
use crate::domain::BizType;

impl RawBloom {
    pub(super) fn validate(self, retention: Duration) -> Result<BloomSettings, ConfigError> {
        if !(self.fp_rate > 0.0 && self.fp_rate < 0.5) {
            return Err(invalid(
                "bloom.fp_rate",
                "must be above 0 and below 0.5, e.g. 0.01",
            ));
        }
        if !(1_000..=1_000_000_000).contains(&self.capacity) {
            return Err(invalid("bloom.capacity", "must be between 1000 and 10^9"));
        }
        let generation = parse_duration("bloom.generation", &self.generation)?;
        if generation < Duration::from_secs(1) {
            return Err(invalid("bloom.generation", "must be at least 1s"));
        }
        // Tokens older than the retention have no record left to answer for
        // them, so covering them would only turn `token_expired` into
        // `token_invalid`.
        let horizon = parse_duration("bloom.horizon", &self.horizon)?.min(retention);
        let grace = parse_duration("bloom.grace", &self.grace)?;
        if grace >= horizon {
            return Err(invalid("bloom.grace", "must be shorter than bloom.horizon"));
        }
        let settings = BloomSettings {
            enabled: self.enabled,
            capacity: self.capacity,
            fp_rate: self.fp_rate,
            generation,
            horizon,
            grace,
        };
        if settings.max_generations() > 10_000 {
            return Err(invalid(
                "bloom.generation",
                "too short for bloom.horizon: more than 10000 generations",
            ));
        }
        Ok(settings)
    }
}

impl RawAudit {
    /// `tokens_retention`: the audit of a token is kept at least as long as
    /// the token itself.
    pub(super) fn validate(self, tokens_retention: Duration) -> Result<AuditSettings, ConfigError> {
        let seal_every = parse_duration("audit.seal_every", &self.seal_every)?;
        if seal_every < Duration::from_millis(100) || seal_every > Duration::from_secs(86_400) {
            return Err(invalid(
                "audit.seal_every",
                "must be between 100ms and 1d, e.g. 1m",
            ));
        }
        if self.seal_keys.is_empty() {
            return Err(invalid(
                "audit.seal_keys",
                "at least one key is required (the first seals, all verify)",
            ));
        }
        let seal_keys = key_ring("audit.seal_keys", self.seal_keys)?
            .into_iter()
            .map(|(id, secret)| SealKey { id, secret })
            .collect();
        let retention = match self.retention.as_deref() {
            None => None,
            Some(text) => {
                let r = parse_duration("audit.retention", text)?;
                if r < tokens_retention.max(Duration::from_secs(86_400)) {
                    return Err(invalid(
                        "audit.retention",
                        "must be at least tokens.retention and at least 1d, e.g. 400d (leave it out to keep audit events for ever)",
                    ));
                }
                Some(r)
            }
        };
        Ok(AuditSettings {
            seal_every,
            seal_keys,
            retention,
        })
    }
}

impl RawLimits {
    pub(super) fn validate(self) -> Result<LimitSettings, ConfigError> {
        let client_rate = parse_rate("limits.client_rate", &self.client_rate)?;
        if !(1024..=131_072).contains(&self.max_uri_bytes) {
            return Err(invalid(
                "limits.max_uri_bytes",
                "must be between 1024 and 131072",
            ));
        }
        if !(1024..=131_072).contains(&self.max_header_bytes) {
            return Err(invalid(
                "limits.max_header_bytes",
                "must be between 1024 and 131072 (actix refuses request heads above 128 KiB anyway)",
            ));
        }
        if !(2..=128).contains(&self.max_json_depth) {
            return Err(invalid(
                "limits.max_json_depth",
                "must be between 2 and 128",
            ));
        }
        let request_head_timeout =
            parse_duration("limits.request_head_timeout", &self.request_head_timeout)?;
        if request_head_timeout < Duration::from_millis(100) {
            return Err(invalid(
                "limits.request_head_timeout",
                "must be at least 100ms",
            ));
        }
        Ok(LimitSettings {
            client_rate,
            max_uri_bytes: self.max_uri_bytes,
            max_header_bytes: self.max_header_bytes,
            max_json_depth: self.max_json_depth,
            request_head_timeout,
        })
    }
}

/// A ring of keys (`section` names it: `tokens.signing_keys`,
/// `audit.seal_keys`): each id well formed and once, each secret at least
/// 32 bytes; (id, secret) in order.
fn key_ring(section: &str, keys: Vec<RawKey>) -> Result<Vec<(String, Vec<u8>)>, ConfigError> {
    let mut ring: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, k) in keys.into_iter().enumerate() {
        if !is_key_id(&k.id) {
            return Err(invalid(
                format!("{section}[{i}].id"),
                "must be 1 to 16 characters of [A-Za-z0-9-]",
            ));
        }
        if k.secret.len() < 32 {
            return Err(invalid(
                format!("{section}[{i}].secret"),
                "must be at least 32 bytes",
            ));
        }
        if ring.iter().any(|(id, _)| *id == k.id) {
            return Err(invalid(format!("{section}[{i}].id"), "duplicate key id"));
        }
        ring.push((k.id, k.secret.into_bytes()));
    }
    Ok(ring)
}

impl RawServer {
    fn validate(self) -> Result<ServerSettings, ConfigError> {
        let listen: SocketAddr = self
            .listen
            .parse()
            .map_err(|_| invalid("server.listen", "expected host:port, e.g. 127.0.0.1:8080"))?;
        if self.workers == Some(0) {
            return Err(invalid("server.workers", "must be at least 1"));
        }
        Ok(ServerSettings {
            listen,
            workers: self.workers,
            shutdown_timeout: parse_duration("server.shutdown_timeout", &self.shutdown_timeout)?,
            log_format: self.log_format,
        })
    }
}

impl RawPostgres {
    fn validate(self) -> Result<PostgresSettings, ConfigError> {
        if !self.url.starts_with("postgres://") && !self.url.starts_with("postgresql://") {
            return Err(invalid("postgres.url", "expected a postgres:// URL"));
        }
        crate::tls::PgTls::from_url(&self.url).map_err(|e| invalid("postgres.url", e))?;
        if self.pool_size == 0 || self.admin_pool_size == 0 {
            return Err(invalid(
                "postgres.pool_size",
                "pool sizes must be at least 1",
            ));
        }
        let postgres = PostgresSettings {
            read_url: read_url(self.read_url)?,
            url: self.url,
            pool_size: self.pool_size,
            admin_pool_size: self.admin_pool_size,
            acquire_timeout: parse_duration("postgres.acquire_timeout", &self.acquire_timeout)?,
            statement_timeout: parse_duration(
                "postgres.statement_timeout",
                &self.statement_timeout,
            )?,
            idle_check_after: parse_duration("postgres.idle_check_after", &self.idle_check_after)?,
            idle_timeout: parse_duration("postgres.idle_timeout", &self.idle_timeout)?,
            max_lifetime: parse_duration("postgres.max_lifetime", &self.max_lifetime)?,
            consume_batch_size: self.consume_batch_size,
            consume_batches_in_flight: self.consume_batches_in_flight,
            order_batch_size: self.order_batch_size,
            order_batches_in_flight: self.order_batches_in_flight,
        };
        if postgres.consume_batch_size == 0 || postgres.consume_batch_size > 10_000 {
            return Err(invalid(
                "postgres.consume_batch_size",
                "must be between 1 and 10000",
            ));
        }
        if postgres.consume_batches_in_flight == 0 {
            return Err(invalid(
                "postgres.consume_batches_in_flight",
                "must be at least 1",
            ));
        }
        if postgres.order_batch_size == 0 || postgres.order_batch_size > 10_000 {
            return Err(invalid(
                "postgres.order_batch_size",
                "must be between 1 and 10000",
            ));
        }
        if postgres.order_batches_in_flight == 0 {
            return Err(invalid(
                "postgres.order_batches_in_flight",
                "must be at least 1",
            ));
        }
        if postgres.idle_timeout.is_zero() || postgres.max_lifetime.is_zero() {
            return Err(invalid(
                "postgres.idle_timeout",
                "idle_timeout and max_lifetime must be longer than 0s",
            ));
        }
        Ok(postgres)
    }
}

/// `redis.url` or `redis.cluster_nodes` (one of them), each a redis:// or
/// rediss:// URL.
fn redis_topology(
    url: Option<String>,
    nodes: Option<Vec<String>>,
) -> Result<RedisTopology, ConfigError> {
    let url = url.filter(|u| !u.is_empty());
    let nodes = nodes.filter(|n| !n.is_empty());
    let topology = match (url, nodes) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "redis.cluster_nodes",
                "set either redis.url or redis.cluster_nodes, not both",
            ))
        }
        (Some(url), None) => RedisTopology::Standalone(url),
        (None, Some(nodes)) => RedisTopology::Cluster(nodes),
        _ => return Err(invalid("redis.url", "set redis.url or redis.cluster_nodes")),
    };
    let check_url = |key: &str, url: &str| {
        if !url.starts_with("redis://") && !url.starts_with("rediss://") {
            return Err(invalid(key, "expected a redis:// or rediss:// URL"));
        }
        if url.ends_with("#insecure") {
            return Err(invalid(
                key,
                "#insecure (no certificate check) is not supported; name a private CA with redis.ca_file",
            ));
        }
        Ok(())
    };
    match &topology {
        RedisTopology::Standalone(url) => check_url("redis.url", url)?,
        RedisTopology::Cluster(nodes) => {
            for n in nodes {
                check_url("redis.cluster_nodes", n)?;
            }
        }
    }
    Ok(topology)
}

/// `redis.ca_file`: read and parsed, and only with a rediss:// URL to use it.
fn redis_ca(
    ca_file: Option<String>,
    topology: &RedisTopology,
) -> Result<Option<CaFile>, ConfigError> {
    let tls_urls = match topology {
        RedisTopology::Standalone(url) => url.starts_with("rediss://"),
        RedisTopology::Cluster(nodes) => nodes.iter().any(|n| n.starts_with("rediss://")),
    };
    match ca_file.filter(|f| !f.is_empty()) {
        None => Ok(None),
        Some(_) if !tls_urls => Err(invalid(
            "redis.ca_file",
            "set, but no rediss:// URL would use it (redis.url or redis.cluster_nodes)",
        )),
        Some(file) => {
            let path = std::path::PathBuf::from(&file);
            let pem = std::fs::read(&path)
                .map_err(|e| invalid("redis.ca_file", format!("cannot read {file}: {e}")))?;
            crate::tls::parse_certs(&pem)
                .map_err(|e| invalid("redis.ca_file", format!("{file}: {e}")))?;
            Ok(Some(CaFile { path, pem }))
        }
    }
}

impl RawRedis {
    /// The Redis settings as written; [`redis_ranges`] checks the rest
    /// (after the fleet's) and [`Raw::validate`] holds `consumed_ttl` to the
    /// retention.
    fn validate(self) -> Result<RedisSettings, ConfigError> {
        let topology = redis_topology(self.url, self.cluster_nodes)?;
        let ca = redis_ca(self.ca_file, &topology)?;
        if self.connections == 0 {
            return Err(invalid("redis.connections", "must be at least 1"));
        }
        let redis = RedisSettings {
            topology,
            key_prefix: self.key_prefix,
            connections: self.connections,
            timeout: parse_duration("redis.timeout", &self.timeout)?,
            consumed_ttl: parse_duration("redis.consumed_ttl", &self.consumed_ttl)?,
            processing_trust: parse_duration("redis.processing_trust", &self.processing_trust)?,
            down_backoff: parse_duration("redis.down_backoff", &self.down_backoff)?,
            slow_threshold: parse_duration("redis.slow_threshold", &self.slow_threshold)?,
            slow_window: parse_duration("redis.slow_window", &self.slow_window)?,
            degraded_sample: self.degraded_sample,
            fallback_rate: parse_rate("redis.fallback_rate", &self.fallback_rate)?,
            fallback_capacity: self.fallback_capacity,
            ca,
            down_after_failures: self.down_after_failures,
            down_after: parse_duration("redis.down_after", &self.down_after)?,
            background_timeout: parse_duration(
                "redis.background_timeout",
                &self.background_timeout,
            )?,
            memory_fallback: self.memory_fallback,
        };
        if redis.down_after_failures == 0 {
            return Err(invalid("redis.down_after_failures", "must be at least 1"));
        }
        Ok(redis)
    }
}

/// The ranges of the degraded mode and the fallback cache.
fn redis_ranges(redis: &RedisSettings) -> Result<(), ConfigError> {
    if !(0.0..=1.0).contains(&redis.degraded_sample) {
        return Err(invalid(
            "redis.degraded_sample",
            "must be a fraction between 0 and 1",
        ));
    }
    if redis.slow_window < Duration::from_millis(250) {
        return Err(invalid("redis.slow_window", "must be at least 250ms"));
    }
    if redis.fallback_capacity == 0 {
        return Err(invalid("redis.fallback_capacity", "must be at least 1"));
    }
    Ok(())
}

impl RawFleet {
    fn validate(self) -> Result<FleetSettings, ConfigError> {
        let fleet = FleetSettings {
            heartbeat: parse_duration("fleet.heartbeat", &self.heartbeat)?,
            lease: parse_duration("fleet.lease", &self.lease)?,
            decide_without_postgres: self.decide_without_postgres,
        };
        if fleet.heartbeat < Duration::from_millis(10) {
            return Err(invalid("fleet.heartbeat", "must be at least 10ms"));
        }
        if fleet.lease < fleet.heartbeat * 2 {
            return Err(invalid(
                "fleet.lease",
                "must be at least twice fleet.heartbeat",
            ));
        }
        Ok(fleet)
    }
}

impl RawTokens {
    fn validate(self) -> Result<TokenSettings, ConfigError> {
        if self.signing_keys.is_empty() {
            return Err(invalid(
                "tokens.signing_keys",
                "at least one key is required",
            ));
        }
        let signing_keys = key_ring("tokens.signing_keys", self.signing_keys)?
            .into_iter()
            .map(|(id, secret)| SigningKey { id, secret })
            .collect();
        let tokens = TokenSettings {
            signing_keys,
            retention: parse_duration("tokens.retention", &self.retention)?,
            provisional_ttl: parse_duration("tokens.provisional_ttl", &self.provisional_ttl)?,
            worker_lease_ttl: parse_duration("tokens.worker_lease_ttl", &self.worker_lease_ttl)?,
            issue_buffer: self.issue_buffer.max(1),
        };
        if tokens.worker_lease_ttl < Duration::from_secs(3) {
            return Err(invalid("tokens.worker_lease_ttl", "must be at least 3s"));
        }
        Ok(tokens)
    }
}

impl RawBiz {
    /// The section `[biz.<name>]`.
    fn validate(self, name: &str) -> Result<(BizType, BizSettings), ConfigError> {
        let key = format!("biz.{name}");
        let biz_type = BizType::parse(name)
            .map_err(|_| invalid(&key, "biz type names match [a-z][a-z0-9-]{0,31}"))?;
        let ttl = parse_duration(&format!("{key}.ttl"), &self.ttl)?;
        if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(366 * 86_400) {
            return Err(invalid(format!("{key}.ttl"), "must be between 1s and 366d"));
        }
        let issue_rate = self
            .issue_rate
            .as_deref()
            .map(|r| parse_rate(&format!("{key}.issue_rate"), r))
            .transpose()?;
        let min_ttl = match self.min_ttl.as_deref() {
            Some(t) => parse_duration(&format!("{key}.min_ttl"), t)?,
            None => Duration::from_secs(1),
        };
        if min_ttl < Duration::from_secs(1) || min_ttl > ttl || min_ttl.subsec_nanos() != 0 {
            return Err(invalid(
                format!("{key}.min_ttl"),
                format!(
                    "must be whole seconds, at least 1s and at most the ttl ({})",
                    self.ttl
                ),
            ));
        }
        let lease = match self.processing_lease.as_deref() {
            Some(t) => {
                let length = parse_duration(&format!("{key}.processing_lease"), t)?;
                if length < Duration::from_secs(1)
                    || length > Duration::from_secs(366 * 86_400)
                    || length.subsec_nanos() != 0
                {
                    return Err(invalid(
                        format!("{key}.processing_lease"),
                        "must be whole seconds, between 1s and 366d",
                    ));
                }
                Some(ProcessingLease {
                    length,
                    on_expiry: self.on_lease_expiry.unwrap_or_default(),
                })
            }
            None if self.on_lease_expiry.is_some() => {
                return Err(invalid(
                    format!("{key}.on_lease_expiry"),
                    "needs processing_lease",
                ))
            }
            None => None,
        };
        let settings = BizSettings {
            ttl,
            durability: self.durability,
            issue_rate,
            min_ttl,
            lease,
        };
        Ok((biz_type, settings))
    }
}

/// The `[biz.*]` sections, in name order.
fn validate_biz(
    raw: BTreeMap<String, RawBiz>,
) -> Result<BTreeMap<BizType, BizSettings>, ConfigError> {
    let mut biz = BTreeMap::new();
    for (name, b) in raw {
        let (biz_type, settings) = b.validate(&name)?;
        biz.insert(biz_type, settings);
    }
    Ok(biz)
}

impl RawClient {
    /// `clients[i]`, given the clients before it (names and keys are
    /// unique), the biz types configured (its grants must name them) and
    /// `limits.client_rate` (its default rate).
    fn validate(
        self,
        i: usize,
        before: &[Client],
        biz: &BTreeMap<BizType, BizSettings>,
        default_rate: NonZeroU32,
    ) -> Result<Client, ConfigError> {
        let key = format!("clients[{i}]");
        if self.name.is_empty() || self.name.len() > 64 {
            return Err(invalid(format!("{key}.name"), "must be 1 to 64 characters"));
        }
        if before.iter().any(|x| x.name == self.name) {
            return Err(invalid(format!("{key}.name"), "duplicate client name"));
        }
        let hash = hex::decode(self.key_sha256.trim())
            .ok()
            .and_then(|v| <[u8; 32]>::try_from(v).ok())
            .ok_or_else(|| invalid(format!("{key}.key_sha256"), "must be 64 hex digits"))?;
        if before.iter().any(|x| x.key_sha256 == hash) {
            return Err(invalid(
                format!("{key}.key_sha256"),
                "two clients share one key",
            ));
        }
        let mut grants = Vec::new();
        for b in &self.biz_types {
            let bt = BizType::parse(b).map_err(|_| {
                invalid(
                    format!("{key}.biz_types"),
                    format!("`{b}` is not a biz type name"),
                )
            })?;
            if !biz.contains_key(&bt) {
                return Err(invalid(
                    format!("{key}.biz_types"),
                    format!("`{b}` has no [biz.{b}] section"),
                ));
            }
            grants.push(bt);
        }
        let rate = match self.rate.as_deref() {
            Some(r) => parse_rate(&format!("{key}.rate"), r)?,
            None => default_rate,
        };
        Ok(Client {
            name: self.name,
            role: self.role,
            key_sha256: hash,
            biz_types: grants,
            rate,
        })
    }
}

/// The `[[clients]]`, in order.
fn validate_clients(
    raw: Vec<RawClient>,
    biz: &BTreeMap<BizType, BizSettings>,
    limits: &LimitSettings,
) -> Result<Vec<Client>, ConfigError> {
    let mut clients: Vec<Client> = Vec::new();
    for (i, c) in raw.into_iter().enumerate() {
        let client = c.validate(i, &clients, biz, limits.client_rate)?;
        clients.push(client);
    }
    Ok(clients)
}

impl RawReconcile {
    fn validate(self) -> Result<ReconcileSettings, ConfigError> {
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(invalid(
                "reconcile.batch_size",
                "must be between 1 and 10000",
            ));
        }
        Ok(ReconcileSettings {
            batch_size: self.batch_size,
        })
    }
}

/// Production refuses development secrets still in effect.
fn refuse_development_secrets(settings: &Settings) -> Result<(), ConfigError> {
    if settings.env == Environment::Production {
        let dev = settings.development_secrets_in_use();
        if !dev.is_empty() {
            return Err(invalid(
                "env",
                format!(
                    "production refuses development secrets still in effect: {}",
                    dev.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

impl Raw {
    /// Every section, in this order (the first problem found is the one
    /// named): server, postgres, redis, fleet, redis's ranges, tokens,
    /// bloom, limits, audit, biz types, clients, reconcile, then the
    /// production check over the whole.
    pub(super) fn validate(self) -> Result<Settings, ConfigError> {
        let server = self.server.validate()?;
        let postgres = self.postgres.validate()?;
        let redis = self.redis.validate()?;
        let fleet = self.fleet.validate()?;
        redis_ranges(&redis)?;
        let tokens = self.tokens.validate()?;
        // No Redis marker outlives the retention: a record purged after it
        // must answer `token_expired` on every tier. A consumed marker lives
        // `consumed_ttl` from its consume, so it is held to the retention.
        let redis = RedisSettings {
            consumed_ttl: redis.consumed_ttl.min(tokens.retention),
            ..redis
        };
        let bloom = self.bloom.validate(tokens.retention)?;
        let limits = self.limits.validate()?;
        let audit = self.audit.validate(tokens.retention)?;
        let biz = validate_biz(self.biz)?;
        let clients = validate_clients(self.clients, &biz, &limits)?;
        let reconcile = self.reconcile.validate()?;
        let settings = Settings {
            env: self.env,
            server,
            postgres,
            redis,
            tokens,
            bloom,
            limits,
            clients,
            biz,
            fleet,
            audit,
            reconcile,
        };
        refuse_development_secrets(&settings)?;
        Ok(settings)
    }
}

/// `postgres.read_url`: absent or empty is none; else a `postgres://` URL
/// whose TLS parameters parse, as `postgres.url`.
fn read_url(url: Option<String>) -> Result<Option<String>, ConfigError> {
    let Some(url) = url.filter(|u| !u.is_empty()) else {
        return Ok(None);
    };
    if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
        return Err(invalid("postgres.read_url", "expected a postgres:// URL"));
    }
    crate::tls::PgTls::from_url(&url).map_err(|e| invalid("postgres.read_url", e))?;
    Ok(Some(url))
}
