//! From the raw tree to [`Settings`]: every check, naming the key at fault,
//! including the cross-field ones (retention bounds the markers and the
//! filter, clients' grants name configured biz types, production refuses
//! development secrets).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use super::invalid;
use super::parse::{is_key_id, parse_duration, parse_rate};
use super::raw::{Raw, RawAudit, RawBloom, RawLimits};
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
    pub(super) fn validate(self) -> Result<AuditSettings, ConfigError> {
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
        let mut seal_keys: Vec<SealKey> = Vec::new();
        for (i, k) in self.seal_keys.into_iter().enumerate() {
            if !is_key_id(&k.id) {
                return Err(invalid(
                    format!("audit.seal_keys[{i}].id"),
                    "must be 1 to 16 characters of [A-Za-z0-9-]",
                ));
            }
            if k.secret.len() < 32 {
                return Err(invalid(
                    format!("audit.seal_keys[{i}].secret"),
                    "must be at least 32 bytes",
                ));
            }
            if seal_keys.iter().any(|s| s.id == k.id) {
                return Err(invalid(
                    format!("audit.seal_keys[{i}].id"),
                    "duplicate key id",
                ));
            }
            seal_keys.push(SealKey {
                id: k.id,
                secret: k.secret.into_bytes(),
            });
        }
        Ok(AuditSettings {
            seal_every,
            seal_keys,
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

impl Raw {
    pub(super) fn validate(self) -> Result<Settings, ConfigError> {
        let listen: SocketAddr = self
            .server
            .listen
            .parse()
            .map_err(|_| invalid("server.listen", "expected host:port, e.g. 127.0.0.1:8080"))?;
        if self.server.workers == Some(0) {
            return Err(invalid("server.workers", "must be at least 1"));
        }
        let server = ServerSettings {
            listen,
            workers: self.server.workers,
            shutdown_timeout: parse_duration(
                "server.shutdown_timeout",
                &self.server.shutdown_timeout,
            )?,
            log_format: self.server.log_format,
        };

        if !self.postgres.url.starts_with("postgres://")
            && !self.postgres.url.starts_with("postgresql://")
        {
            return Err(invalid("postgres.url", "expected a postgres:// URL"));
        }
        crate::tls::PgTls::from_url(&self.postgres.url).map_err(|e| invalid("postgres.url", e))?;
        if self.postgres.pool_size == 0 || self.postgres.admin_pool_size == 0 {
            return Err(invalid(
                "postgres.pool_size",
                "pool sizes must be at least 1",
            ));
        }
        let postgres = PostgresSettings {
            read_url: read_url(self.postgres.read_url)?,
            url: self.postgres.url,
            pool_size: self.postgres.pool_size,
            admin_pool_size: self.postgres.admin_pool_size,
            acquire_timeout: parse_duration(
                "postgres.acquire_timeout",
                &self.postgres.acquire_timeout,
            )?,
            statement_timeout: parse_duration(
                "postgres.statement_timeout",
                &self.postgres.statement_timeout,
            )?,
            idle_check_after: parse_duration(
                "postgres.idle_check_after",
                &self.postgres.idle_check_after,
            )?,
            idle_timeout: parse_duration("postgres.idle_timeout", &self.postgres.idle_timeout)?,
            max_lifetime: parse_duration("postgres.max_lifetime", &self.postgres.max_lifetime)?,
            consume_batch_size: self.postgres.consume_batch_size,
            consume_batches_in_flight: self.postgres.consume_batches_in_flight,
            order_batch_size: self.postgres.order_batch_size,
            order_batches_in_flight: self.postgres.order_batches_in_flight,
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

        let url = self.redis.url.filter(|u| !u.is_empty());
        let nodes = self.redis.cluster_nodes.filter(|n| !n.is_empty());
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
        let tls_urls = match &topology {
            RedisTopology::Standalone(url) => url.starts_with("rediss://"),
            RedisTopology::Cluster(nodes) => nodes.iter().any(|n| n.starts_with("rediss://")),
        };
        let ca = match self.redis.ca_file.filter(|f| !f.is_empty()) {
            None => None,
            Some(_) if !tls_urls => {
                return Err(invalid(
                    "redis.ca_file",
                    "set, but no rediss:// URL would use it (redis.url or redis.cluster_nodes)",
                ))
            }
            Some(file) => {
                let path = std::path::PathBuf::from(&file);
                let pem = std::fs::read(&path)
                    .map_err(|e| invalid("redis.ca_file", format!("cannot read {file}: {e}")))?;
                crate::tls::parse_certs(&pem)
                    .map_err(|e| invalid("redis.ca_file", format!("{file}: {e}")))?;
                Some(CaFile { path, pem })
            }
        };
        if self.redis.connections == 0 {
            return Err(invalid("redis.connections", "must be at least 1"));
        }
        let redis = RedisSettings {
            topology,
            key_prefix: self.redis.key_prefix,
            connections: self.redis.connections,
            timeout: parse_duration("redis.timeout", &self.redis.timeout)?,
            consumed_ttl: parse_duration("redis.consumed_ttl", &self.redis.consumed_ttl)?,
            processing_trust: parse_duration(
                "redis.processing_trust",
                &self.redis.processing_trust,
            )?,
            down_backoff: parse_duration("redis.down_backoff", &self.redis.down_backoff)?,
            slow_threshold: parse_duration("redis.slow_threshold", &self.redis.slow_threshold)?,
            slow_window: parse_duration("redis.slow_window", &self.redis.slow_window)?,
            degraded_sample: self.redis.degraded_sample,
            fallback_rate: parse_rate("redis.fallback_rate", &self.redis.fallback_rate)?,
            fallback_capacity: self.redis.fallback_capacity,
            ca,
            down_after_failures: self.redis.down_after_failures,
            down_after: parse_duration("redis.down_after", &self.redis.down_after)?,
            background_timeout: parse_duration(
                "redis.background_timeout",
                &self.redis.background_timeout,
            )?,
            memory_fallback: self.redis.memory_fallback,
        };
        if redis.down_after_failures == 0 {
            return Err(invalid("redis.down_after_failures", "must be at least 1"));
        }
        let fleet = FleetSettings {
            heartbeat: parse_duration("fleet.heartbeat", &self.fleet.heartbeat)?,
            lease: parse_duration("fleet.lease", &self.fleet.lease)?,
            decide_without_postgres: self.fleet.decide_without_postgres,
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

        if self.tokens.signing_keys.is_empty() {
            return Err(invalid(
                "tokens.signing_keys",
                "at least one key is required",
            ));
        }
        let mut signing_keys = Vec::new();
        for (i, k) in self.tokens.signing_keys.into_iter().enumerate() {
            if !is_key_id(&k.id) {
                return Err(invalid(
                    format!("tokens.signing_keys[{i}].id"),
                    "must be 1 to 16 characters of [A-Za-z0-9-]",
                ));
            }
            if k.secret.len() < 32 {
                return Err(invalid(
                    format!("tokens.signing_keys[{i}].secret"),
                    "must be at least 32 bytes",
                ));
            }
            if signing_keys.iter().any(|s: &SigningKey| s.id == k.id) {
                return Err(invalid(
                    format!("tokens.signing_keys[{i}].id"),
                    "duplicate key id",
                ));
            }
            signing_keys.push(SigningKey {
                id: k.id,
                secret: k.secret.into_bytes(),
            });
        }
        let tokens = TokenSettings {
            signing_keys,
            retention: parse_duration("tokens.retention", &self.tokens.retention)?,
            provisional_ttl: parse_duration(
                "tokens.provisional_ttl",
                &self.tokens.provisional_ttl,
            )?,
            worker_lease_ttl: parse_duration(
                "tokens.worker_lease_ttl",
                &self.tokens.worker_lease_ttl,
            )?,
            issue_buffer: self.tokens.issue_buffer.max(1),
        };
        if tokens.worker_lease_ttl < Duration::from_secs(3) {
            return Err(invalid("tokens.worker_lease_ttl", "must be at least 3s"));
        }
        // No Redis marker outlives the retention: a record purged after it
        // must answer `token_expired` on every tier. A consumed marker lives
        // `consumed_ttl` from its consume, so it is held to the retention.
        let redis = RedisSettings {
            consumed_ttl: redis.consumed_ttl.min(tokens.retention),
            ..redis
        };
        let bloom = self.bloom.validate(tokens.retention)?;
        let limits = self.limits.validate()?;
        let audit = self.audit.validate()?;

        let mut biz = BTreeMap::new();
        for (name, b) in self.biz {
            let key = format!("biz.{name}");
            let biz_type = BizType::parse(&name)
                .map_err(|_| invalid(&key, "biz type names match [a-z][a-z0-9-]{0,31}"))?;
            let ttl = parse_duration(&format!("{key}.ttl"), &b.ttl)?;
            if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(366 * 86_400) {
                return Err(invalid(format!("{key}.ttl"), "must be between 1s and 366d"));
            }
            let issue_rate = b
                .issue_rate
                .as_deref()
                .map(|r| parse_rate(&format!("{key}.issue_rate"), r))
                .transpose()?;
            let min_ttl = match b.min_ttl.as_deref() {
                Some(t) => parse_duration(&format!("{key}.min_ttl"), t)?,
                None => Duration::from_secs(1),
            };
            if min_ttl < Duration::from_secs(1) || min_ttl > ttl || min_ttl.subsec_nanos() != 0 {
                return Err(invalid(
                    format!("{key}.min_ttl"),
                    format!(
                        "must be whole seconds, at least 1s and at most the ttl ({})",
                        b.ttl
                    ),
                ));
            }
            let lease = match b.processing_lease.as_deref() {
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
                        on_expiry: b.on_lease_expiry.unwrap_or_default(),
                    })
                }
                None if b.on_lease_expiry.is_some() => {
                    return Err(invalid(
                        format!("{key}.on_lease_expiry"),
                        "needs processing_lease",
                    ))
                }
                None => None,
            };
            biz.insert(
                biz_type,
                BizSettings {
                    ttl,
                    durability: b.durability,
                    issue_rate,
                    min_ttl,
                    lease,
                },
            );
        }

        let mut clients: Vec<Client> = Vec::new();
        for (i, c) in self.clients.into_iter().enumerate() {
            let key = format!("clients[{i}]");
            if c.name.is_empty() || c.name.len() > 64 {
                return Err(invalid(format!("{key}.name"), "must be 1 to 64 characters"));
            }
            if clients.iter().any(|x| x.name == c.name) {
                return Err(invalid(format!("{key}.name"), "duplicate client name"));
            }
            let hash = hex::decode(c.key_sha256.trim())
                .ok()
                .and_then(|v| <[u8; 32]>::try_from(v).ok())
                .ok_or_else(|| invalid(format!("{key}.key_sha256"), "must be 64 hex digits"))?;
            if clients.iter().any(|x| x.key_sha256 == hash) {
                return Err(invalid(
                    format!("{key}.key_sha256"),
                    "two clients share one key",
                ));
            }
            let mut grants = Vec::new();
            for b in &c.biz_types {
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
            let rate = match c.rate.as_deref() {
                Some(r) => parse_rate(&format!("{key}.rate"), r)?,
                None => limits.client_rate,
            };
            clients.push(Client {
                name: c.name,
                role: c.role,
                key_sha256: hash,
                biz_types: grants,
                rate,
            });
        }

        if !(1..=10_000).contains(&self.reconcile.batch_size) {
            return Err(invalid(
                "reconcile.batch_size",
                "must be between 1 and 10000",
            ));
        }
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
            reconcile: ReconcileSettings {
                batch_size: self.reconcile.batch_size,
            },
        };
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
