//! The validated settings every component receives: typed values, secrets
//! kept out of `Debug`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use serde::Deserialize;

use crate::auth::Client;
use crate::domain::BizType;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Environment {
    Development,
    Production,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// Postgres decides every consume; Redis only turns duplicates away.
    Durable,
    /// Redis decides; Postgres receives a journal.
    Fast,
}

impl Durability {
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Durable => "durable",
            Durability::Fast => "fast",
        }
    }
}

/// What a processing lease's expiry does to a consumed token or key that
/// has neither result nor release (`biz.<name>.on_lease_expiry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LeaseExpiry {
    /// The step's outcome is unknown: duplicates answer `uncertain` until the
    /// consumer or an operator records a result or releases it.
    #[default]
    Uncertain,
    /// The token returns to unconsumed by itself (steps safe to run again).
    Release,
}

impl LeaseExpiry {
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseExpiry::Uncertain => "uncertain",
            LeaseExpiry::Release => "release",
        }
    }
}

/// How long a consume may stay without result or release, and what its end does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessingLease {
    pub length: Duration,
    pub on_expiry: LeaseExpiry,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Validated settings. Cheap to share behind an `Arc`.
#[derive(Debug, Clone)]
pub struct Settings {
    pub env: Environment,
    pub server: ServerSettings,
    pub postgres: PostgresSettings,
    pub redis: RedisSettings,
    pub tokens: TokenSettings,
    pub bloom: BloomSettings,
    pub limits: LimitSettings,
    pub clients: Vec<Client>,
    pub biz: BTreeMap<BizType, BizSettings>,
    pub reconcile: ReconcileSettings,
    pub fleet: FleetSettings,
    pub audit: AuditSettings,
}

/// Sealed audit checkpoints (see `crate::audit_seal`).
#[derive(Debug, Clone)]
pub struct AuditSettings {
    /// How often the events written since the last checkpoint are sealed.
    pub seal_every: Duration,
    /// The first seals new checkpoints; every one verifies (rotation, as
    /// `tokens.signing_keys`).
    pub seal_keys: Vec<SealKey>,
    /// How long the audit events of a day's tokens are kept after the
    /// newest of them; `None`: for ever. At least `tokens.retention`.
    pub retention: Option<Duration>,
}

/// A key that authenticates audit checkpoints (HMAC-SHA256). Its own type,
/// not a [`SigningKey`]: a token signing key never seals, and the other way
/// round. The secret never appears in `Debug` output.
#[derive(Clone)]
pub struct SealKey {
    pub id: String,
    pub secret: Vec<u8>,
}

impl fmt::Debug for SealKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// How the instances agree on Redis (see `crate::fleet`).
#[derive(Debug, Clone)]
pub struct FleetSettings {
    /// How often an instance reports its view of Redis to Postgres.
    pub heartbeat: Duration,
    /// How long after its last report began an instance still lets Redis
    /// decide fast consumes; the others count it as a member for
    /// `lease + redis.timeout + 1s` after its last report.
    pub lease: Duration,
    /// Whether Redis keeps deciding fast consumes on an instance whose
    /// reports fail on Postgres (its gate stays open past its lease). Off by
    /// default: under a partition that cuts an instance off from Postgres but
    /// not from Redis, the others may stop counting it and decide the same
    /// tokens in Postgres. On: fast types keep working through a Postgres
    /// outage, at that risk.
    pub decide_without_postgres: bool,
}

/// The filter of issued token ids (see `crate::issuance::filter`).
#[derive(Debug, Clone)]
pub struct BloomSettings {
    /// `false`: every verified token goes on to the tiers (as without a filter).
    pub enabled: bool,
    /// Tokens the whole fleet issues in one generation; a generation that
    /// receives more grows another filter of the same size.
    pub capacity: usize,
    /// Target false-positive rate of one filter at `capacity`.
    pub fp_rate: f64,
    /// The time window of one generation (by the snowflake id's timestamp).
    pub generation: Duration,
    /// How far back the filter covers; older tokens go on to the tiers.
    /// Never more than `tokens.retention`.
    pub horizon: Duration,
    /// Propagation delay plus clock skew: an unknown token whose id is younger
    /// than this goes on to the tiers instead of being refused.
    pub grace: Duration,
}

impl BloomSettings {
    /// Bytes of one filter at `capacity` and `fp_rate`:
    /// `capacity * -ln(p) / (8 * ln(2)^2)`.
    pub fn bytes_per_filter(&self) -> usize {
        let ln2 = std::f64::consts::LN_2;
        ((self.capacity as f64) * -self.fp_rate.ln() / (8.0 * ln2 * ln2)).ceil() as usize
    }

    /// How many generations can be alive at once: the horizon, the current
    /// window, and one window ahead for peers whose clocks run early.
    pub fn max_generations(&self) -> usize {
        let h = self.horizon.as_millis();
        let g = self.generation.as_millis().max(1);
        usize::try_from(h.div_ceil(g))
            .unwrap_or(usize::MAX)
            .saturating_add(2)
    }
}

/// Request limits checked before any I/O.
#[derive(Debug, Clone)]
pub struct LimitSettings {
    /// Default per-client ceiling (requests per second, burst one second's worth).
    pub client_rate: NonZeroU32,
    /// Longest path plus query string; longer: 414 `uri_too_long`.
    pub max_uri_bytes: usize,
    /// Largest total of header names and values; larger: 431 `headers_too_large`.
    pub max_header_bytes: usize,
    /// Deepest nesting of arrays and objects in a request body; deeper: 400.
    pub max_json_depth: usize,
    /// Time a client has to send its request head (actix `client_request_timeout`).
    pub request_head_timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub listen: SocketAddr,
    pub workers: Option<usize>,
    pub shutdown_timeout: Duration,
    pub log_format: LogFormat,
}

#[derive(Debug, Clone)]
pub struct PostgresSettings {
    pub url: String,
    /// A streaming replica for the read-only admin and audit queries
    /// ([`crate::durable::Pools::read`]); `None`: they read the primary.
    pub read_url: Option<String>,
    pub pool_size: u32,
    pub admin_pool_size: u32,
    pub acquire_timeout: Duration,
    pub statement_timeout: Duration,
    /// A pooled connection idle at least this long is pinged before use
    /// (one round trip); a busier one is used as it is.
    pub idle_check_after: Duration,
    /// The pool closes connections idle longer than this.
    pub idle_timeout: Duration,
    /// The pool closes connections older than this once they are returned.
    pub max_lifetime: Duration,
    /// The most items one statement decides (group commit, see
    /// [`crate::durable::batch`]): durable token consumes, and on queues of
    /// their own durable key consumes ([`crate::durable::key_batch`]) and
    /// results and releases decided by Postgres.
    pub consume_batch_size: usize,
    /// How many statements of each of those queues run at once; items
    /// arriving while that many are in flight wait for the next batch.
    pub consume_batches_in_flight: usize,
    /// The most order events (on distinct orders) one transaction decides
    /// (see [`crate::orders`]'s batches).
    pub order_batch_size: usize,
    /// How many order-event transactions run at once; events arriving
    /// while that many are in flight, or whose order is in one, wait for
    /// the next batch.
    pub order_batches_in_flight: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTopology {
    Standalone(String),
    Cluster(Vec<String>),
}

#[derive(Debug, Clone)]
pub struct RedisSettings {
    pub topology: RedisTopology,
    pub key_prefix: String,
    pub connections: usize,
    pub timeout: Duration,
    pub consumed_ttl: Duration,
    /// How long after its consume a durable consumed marker without a
    /// result may answer `processing` on its own; older, Postgres is asked
    /// (a result whose write to Redis failed is then still answered).
    pub processing_trust: Duration,
    pub down_backoff: Duration,
    /// p99 of Redis calls above this over `slow_window`: mode `degraded`.
    pub slow_threshold: Duration,
    /// How far back the latency percentile looks.
    pub slow_window: Duration,
    /// Fraction of durable consumes that bypass Redis while degraded.
    pub degraded_sample: f64,
    /// Fast consumes per second this instance decides while Redis is down.
    pub fallback_rate: NonZeroU32,
    /// Fast tokens this instance remembers as consumed while Redis is down.
    pub fallback_capacity: u64,
    /// `redis.ca_file`: the CA that verifies `rediss://` servers instead of
    /// the system's roots.
    pub ca: Option<CaFile>,
    /// Consecutive failed calls that did not reach Redis (refused, reset)
    /// after which Redis is down for this instance.
    pub down_after_failures: u32,
    /// Failing calls of any kind (timeouts too) with no success for this
    /// long: Redis is down for this instance. One timeout is slowness.
    pub down_after: Duration,
    /// One call of background work (journal, reconcile, write-backs).
    pub background_timeout: Duration,
    /// With Redis and Postgres both unreachable, fast consumes are decided
    /// in this process's memory (per instance, lost on a crash) instead of
    /// answering 503.
    pub memory_fallback: bool,
}

/// A CA file's path and its PEM text, read (and checked) when the
/// configuration loads.
#[derive(Clone, PartialEq, Eq)]
pub struct CaFile {
    pub path: std::path::PathBuf,
    pub pem: Vec<u8>,
}

impl fmt::Debug for CaFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaFile").field("path", &self.path).finish()
    }
}

/// A signing key. The secret never appears in `Debug` output.
#[derive(Clone)]
pub struct SigningKey {
    pub id: String,
    pub secret: Vec<u8>,
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
pub struct TokenSettings {
    /// First signs, all verify.
    pub signing_keys: Vec<SigningKey>,
    pub retention: Duration,
    pub provisional_ttl: Duration,
    pub worker_lease_ttl: Duration,
    pub issue_buffer: usize,
}

#[derive(Debug, Clone)]
pub struct ReconcileSettings {
    /// Keys or rows per batch (one pipeline, one statement).
    pub batch_size: usize,
}

#[derive(Debug, Clone)]
pub struct BizSettings {
    pub ttl: Duration,
    pub durability: Durability,
    /// Issues per second per (client, subject); `None`: unlimited.
    pub issue_rate: Option<NonZeroU32>,
    /// The shortest lifetime a caller may ask for (`ttl_seconds`); at most `ttl`.
    pub min_ttl: Duration,
    /// `processing_lease` and `on_lease_expiry`; `None`: no lease.
    pub lease: Option<ProcessingLease>,
}

/// Development secrets shipped in the default config; refused in production.
pub(super) const DEV_SECRETS: &[&str] = &[
    "development-only-signing-secret-0123456789",
    "development-only-audit-seal-secret-0123456789",
];

impl Settings {
    pub fn biz(&self, biz: &BizType) -> Option<&BizSettings> {
        self.biz.get(biz)
    }

    /// Development keys or secrets in effect (named, never printed in full).
    pub fn development_secrets_in_use(&self) -> Vec<String> {
        let mut found = Vec::new();
        for key in &self.tokens.signing_keys {
            if DEV_SECRETS.iter().any(|s| s.as_bytes() == key.secret) {
                found.push(format!("tokens.signing_keys[{}]", key.id));
            }
        }
        for key in &self.audit.seal_keys {
            if DEV_SECRETS.iter().any(|s| s.as_bytes() == key.secret) {
                found.push(format!("audit.seal_keys[{}]", key.id));
            }
        }
        for client in &self.clients {
            if crate::auth::DEV_KEY_HASHES.contains(&client.key_sha256_hex().as_str()) {
                found.push(format!("clients[{}]", client.name));
            }
        }
        found
    }
}
