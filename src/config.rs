//! Configuration: the embedded default TOML, a user file and `LEDGER__*`
//! environment variables, merged in that order and validated into typed
//! [`Settings`] before anything starts.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::Path;
use std::time::Duration;

use figment::providers::{Format, Toml};
use figment::Figment;
use serde::Deserialize;

use crate::auth::{Client, Role};
use crate::domain::BizType;

/// The documented defaults, compiled into the binary.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// A configuration problem, naming the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("configuration key `{key}`: {problem}")]
    Invalid { key: String, problem: String },
}

fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        problem: problem.into(),
    }
}

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

// ---- raw (as written) ------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    env: Environment,
    server: RawServer,
    postgres: RawPostgres,
    redis: RawRedis,
    tokens: RawTokens,
    bloom: RawBloom,
    limits: RawLimits,
    #[serde(default)]
    clients: Vec<RawClient>,
    #[serde(default)]
    biz: BTreeMap<String, RawBiz>,
    #[serde(default)]
    reconcile: RawReconcile,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: String,
    workers: Option<usize>,
    shutdown_timeout: String,
    log_format: LogFormat,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPostgres {
    url: String,
    pool_size: u32,
    admin_pool_size: u32,
    acquire_timeout: String,
    statement_timeout: String,
    idle_check_after: String,
    idle_timeout: String,
    max_lifetime: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRedis {
    url: Option<String>,
    cluster_nodes: Option<Vec<String>>,
    key_prefix: String,
    connections: usize,
    timeout: String,
    consumed_ttl: String,
    processing_trust: String,
    down_backoff: String,
    slow_threshold: String,
    slow_window: String,
    degraded_sample: f64,
    fallback_rate: String,
    fallback_capacity: u64,
    ca_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTokens {
    signing_keys: Vec<RawKey>,
    retention: String,
    provisional_ttl: String,
    worker_lease_ttl: String,
    issue_buffer: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBloom {
    enabled: bool,
    capacity: usize,
    fp_rate: f64,
    generation: String,
    horizon: String,
    grace: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    client_rate: String,
    max_uri_bytes: usize,
    max_header_bytes: usize,
    max_json_depth: usize,
    request_head_timeout: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    id: String,
    secret: String,
}

impl fmt::Debug for RawKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawKey").field("id", &self.id).finish()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClient {
    name: String,
    role: Role,
    key_sha256: String,
    #[serde(default)]
    biz_types: Vec<String>,
    /// Requests per second on every `/v1` route; default `limits.client_rate`.
    rate: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReconcile {
    batch_size: usize,
}

impl Default for RawReconcile {
    fn default() -> Self {
        RawReconcile { batch_size: 500 }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBiz {
    ttl: String,
    durability: Durability,
    issue_rate: Option<String>,
    min_ttl: Option<String>,
}

// ---- typed -----------------------------------------------------------------

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
}

/// The filter of issued token ids (see `crate::bloom`).
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
}

/// Development secrets shipped in the default config; refused in production.
const DEV_SECRETS: &[&str] = &["development-only-signing-secret-0123456789"];

impl Settings {
    /// Loads defaults, then `file` (if any), then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::load_with_env(file, env)
    }

    /// Like [`Settings::load`] with an explicit environment (tests never touch
    /// the process environment).
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        Self::over_defaults(user_layers(file, env)?)
    }

    /// Loads and validates like [`Settings::load_with_env`], and also returns
    /// the merged configuration as TOML with every secret redacted
    /// ([`redact`]): what `config check` prints.
    pub fn effective_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(Settings, toml::Table), ConfigError> {
        let user = user_layers(file, env)?;
        let settings = Self::over_defaults(user.clone())?;
        let mut table: toml::Table = merged(user).extract().map_err(Box::new)?;
        redact(&mut table);
        Ok((settings, table))
    }

    /// Loads from a TOML string merged over the defaults (used by tests).
    pub fn from_toml_over_defaults(toml: &str) -> Result<Settings, ConfigError> {
        Self::over_defaults(Figment::from(Toml::string(toml)))
    }

    /// The user's layers (file, environment) merged over the embedded
    /// defaults, validated.
    fn over_defaults(user: Figment) -> Result<Settings, ConfigError> {
        let raw: Raw = merged(user).extract().map_err(Box::new)?;
        raw.validate()
    }

    pub fn biz(&self, biz: &BizType) -> Option<&BizSettings> {
        self.biz.get(biz)
    }
}

/// The file (if any), then the `LEDGER__*` variables among `env`.
fn user_layers(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Figment, ConfigError> {
    let mut fig = Figment::new();
    if let Some(path) = file {
        if !path.exists() {
            return Err(invalid(
                "--config",
                format!("file {} does not exist", path.display()),
            ));
        }
        fig = fig.merge(Toml::file(path));
    }
    let env: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with("LEDGER__"))
        .collect();
    if !env.is_empty() {
        // Figment reads only the process environment, so pass ours through
        // a TOML document built from the pairs instead of mutating it.
        fig = fig.merge(Toml::string(&env_to_toml(&env)?));
    }
    Ok(fig)
}

/// The user's layers merged over the embedded defaults. Naming
/// `redis.cluster_nodes` without a `redis.url` of one's own means the
/// cluster: the default standalone URL is dropped (both set by the user is
/// still a configuration error).
fn merged(user: Figment) -> Figment {
    let cluster_only = user.contains("redis.cluster_nodes") && !user.contains("redis.url");
    let mut fig = Figment::from(Toml::string(DEFAULT_TOML)).merge(user);
    if cluster_only {
        fig = fig.merge(Toml::string("[redis]\nurl = \"\"\n"));
    }
    fig
}

/// What replaces a secret in printed configuration.
pub const REDACTED: &str = "REDACTED";

/// Replaces every secret in a configuration tree: values of keys named like
/// a secret (`secret`, `password`, `*_secret`, `*_password`), and the
/// password of any URL (`scheme://user:password@host`, or a `password`
/// query parameter). Key hashes (`key_sha256`) are not secrets and stay.
pub fn redact(table: &mut toml::Table) {
    for (key, value) in table.iter_mut() {
        redact_value(key, value);
    }
}

fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k == "secret" || k == "password" || k.ends_with("_secret") || k.ends_with("_password")
}

fn redact_value(key: &str, value: &mut toml::Value) {
    match value {
        toml::Value::String(s) if is_secret_key(key) => *s = REDACTED.to_owned(),
        toml::Value::String(s) => {
            if let Some(r) = redact_url(s) {
                *s = r;
            }
        }
        toml::Value::Array(items) => {
            for item in items {
                redact_value(key, item);
            }
        }
        toml::Value::Table(t) => redact(t),
        other if is_secret_key(key) => *other = toml::Value::String(REDACTED.to_owned()),
        _ => {}
    }
}

/// The URL with its password replaced, or `None` when it holds none (or is
/// not a URL).
pub fn redact_url(text: &str) -> Option<String> {
    if !text.contains("://") {
        return None;
    }
    let Ok(mut url) = url::Url::parse(text) else {
        // Unparsable but URL-like: hide whatever sits before an `@`.
        return text.rfind('@').map(|at| {
            let scheme_end = text.find("://").map(|i| i + 3).unwrap_or(0);
            format!("{}{REDACTED}{}", &text[..scheme_end], &text[at..])
        });
    };
    let mut changed = false;
    if url.password().is_some() {
        // Only fails for URLs that cannot have a password (no host).
        changed = url.set_password(Some(REDACTED)).is_ok();
    }
    let pairs: Vec<(String, String)> = url
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    if pairs
        .iter()
        .any(|(k, _)| k.to_ascii_lowercase().contains("password"))
    {
        let mut q = url.query_pairs_mut();
        q.clear();
        for (k, v) in &pairs {
            if k.to_ascii_lowercase().contains("password") {
                q.append_pair(k, REDACTED);
            } else {
                q.append_pair(k, v);
            }
        }
        drop(q);
        changed = true;
    }
    changed.then(|| url.to_string())
}

impl Settings {
    /// Development keys or secrets in effect (named, never printed in full).
    pub fn development_secrets_in_use(&self) -> Vec<String> {
        let mut found = Vec::new();
        for key in &self.tokens.signing_keys {
            if DEV_SECRETS.iter().any(|s| s.as_bytes() == key.secret) {
                found.push(format!("tokens.signing_keys[{}]", key.id));
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

/// Turns `LEDGER__A__B=value` pairs into a TOML document `[a] b = value`.
/// Values that parse as TOML (numbers, booleans, arrays, inline tables) keep
/// their type; anything else is a string.
fn env_to_toml(env: &[(String, String)]) -> Result<String, ConfigError> {
    let mut root = toml::Table::new();
    for (key, value) in env {
        let path: Vec<String> = key["LEDGER__".len()..]
            .split("__")
            .map(|p| p.to_ascii_lowercase())
            .collect();
        if path.iter().any(|p| p.is_empty()) {
            return Err(invalid(key.clone(), "empty path segment"));
        }
        let parsed: toml::Value = format!("v = {value}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.clone()));
        let mut table = &mut root;
        for segment in &path[..path.len() - 1] {
            let entry = table
                .entry(segment.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = match entry {
                toml::Value::Table(t) => t,
                _ => return Err(invalid(key.clone(), "conflicts with another variable")),
            };
        }
        let last = path[path.len() - 1].clone();
        table.insert(last, parsed);
    }
    toml::to_string(&root).map_err(|e| invalid("LEDGER__*", e.to_string()))
}

/// Parses `60s`, `10m`, `7d`, `250ms` (humantime).
pub fn parse_duration(key: &str, text: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        invalid(
            key,
            format!("`{text}` is not a duration ({e}); use e.g. 60s, 10m, 7d"),
        )
    })
}

/// Parses `100/s`, `6000/m`, `1000/h`: issues per second, rounded up.
fn parse_rate(key: &str, text: &str) -> Result<NonZeroU32, ConfigError> {
    let bad = || {
        invalid(
            key,
            format!("`{text}` is not a rate; use e.g. 100/s or 600/m"),
        )
    };
    let (n, unit) = text.trim().split_once('/').ok_or_else(bad)?;
    let n: u64 = n.trim().parse().map_err(|_| bad())?;
    let per = match unit.trim() {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(bad()),
    };
    let per_second = n.div_ceil(per);
    u32::try_from(per_second)
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(bad)
}

fn is_key_id(id: &str) -> bool {
    (1..=16).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

impl RawBloom {
    fn validate(self, retention: Duration) -> Result<BloomSettings, ConfigError> {
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

impl RawLimits {
    fn validate(self) -> Result<LimitSettings, ConfigError> {
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
    fn validate(self) -> Result<Settings, ConfigError> {
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
        };
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
        };
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
            biz.insert(
                biz_type,
                BizSettings {
                    ttl,
                    durability: b.durability,
                    issue_rate,
                    min_ttl,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_load() {
        let s = Settings::load_with_env(None, Vec::new()).expect("defaults are valid");
        assert_eq!(s.env, Environment::Development);
        assert_eq!(s.biz.len(), 3);
        assert_eq!(s.clients.len(), 4);
        assert!(!s.development_secrets_in_use().is_empty());
    }

    #[test]
    fn env_overrides_and_names_bad_keys() {
        let s = Settings::load_with_env(
            None,
            vec![
                ("LEDGER__BIZ__ORDER__TTL".into(), "90s".into()),
                ("LEDGER__SERVER__LISTEN".into(), "127.0.0.1:9999".into()),
            ],
        )
        .expect("valid");
        assert_eq!(
            s.biz[&BizType::parse("order").unwrap()].ttl,
            Duration::from_secs(90)
        );
        assert_eq!(s.server.listen.port(), 9999);

        let err = Settings::load_with_env(
            None,
            vec![("LEDGER__TOKENS__RETENTION".into(), "soon".into())],
        )
        .unwrap_err();
        assert!(err.to_string().contains("tokens.retention"), "{err}");
    }

    #[test]
    fn production_refuses_dev_secrets() {
        let err = Settings::load_with_env(None, vec![("LEDGER__ENV".into(), "production".into())])
            .unwrap_err();
        assert!(err.to_string().contains("development"), "{err}");
    }

    #[test]
    fn lists_replace_whole() {
        let s = Settings::from_toml_over_defaults(
            r#"
            [[clients]]
            name = "only"
            role = "admin"
            key_sha256 = "0000000000000000000000000000000000000000000000000000000000000000"
            "#,
        )
        .expect("valid");
        assert_eq!(s.clients.len(), 1);
    }

    #[test]
    fn cluster_nodes_alone_replace_the_default_url_but_both_are_an_error() {
        let nodes = vec!["redis://127.0.0.1:7000".to_owned()];
        let s = Settings::from_toml_over_defaults(
            "[redis]\ncluster_nodes = [\"redis://127.0.0.1:7000\"]",
        )
        .expect("a file naming only cluster nodes");
        assert_eq!(s.redis.topology, RedisTopology::Cluster(nodes.clone()));
        let s = Settings::load_with_env(
            None,
            vec![(
                "LEDGER__REDIS__CLUSTER_NODES".into(),
                "[\"redis://127.0.0.1:7000\"]".into(),
            )],
        )
        .expect("the environment naming only cluster nodes");
        assert_eq!(s.redis.topology, RedisTopology::Cluster(nodes));
        let err = Settings::from_toml_over_defaults(
            "[redis]\nurl = \"redis://127.0.0.1:6379\"\ncluster_nodes = [\"redis://127.0.0.1:7000\"]",
        )
        .unwrap_err();
        assert!(err.to_string().contains("redis.cluster_nodes"), "{err}");
    }

    #[test]
    fn degraded_mode_keys_are_checked() {
        let s = Settings::load_with_env(None, Vec::new()).expect("defaults are valid");
        assert_eq!(s.redis.slow_threshold, Duration::from_millis(200));
        assert_eq!(s.redis.degraded_sample, 0.1);
        assert_eq!(s.postgres.acquire_timeout, Duration::from_secs(1));
        let err = Settings::from_toml_over_defaults("[redis]\ndegraded_sample = 1.5").unwrap_err();
        assert!(err.to_string().contains("redis.degraded_sample"), "{err}");
        let err = Settings::from_toml_over_defaults("[redis]\nslow_window = \"10ms\"").unwrap_err();
        assert!(err.to_string().contains("redis.slow_window"), "{err}");
        let err =
            Settings::from_toml_over_defaults("[redis]\nfallback_rate = \"fast\"").unwrap_err();
        assert!(err.to_string().contains("redis.fallback_rate"), "{err}");
    }

    #[test]
    fn tls_settings_are_checked_when_the_configuration_loads() {
        let err = Settings::from_toml_over_defaults(
            "[postgres]\nurl = \"postgres://u@h/db?sslmode=sometimes\"",
        )
        .unwrap_err();
        assert!(err.to_string().contains("postgres.url"), "{err}");
        let err = Settings::from_toml_over_defaults(
            "[postgres]\nurl = \"postgres://u@h/db?sslmode=verify-full&sslrootcert=/no/ca.pem\"",
        )
        .unwrap_err();
        assert!(err.to_string().contains("/no/ca.pem"), "{err}");
        let err = Settings::from_toml_over_defaults(
            "[redis]\nurl = \"rediss://h:6380\"\nca_file = \"/no/ca.pem\"",
        )
        .unwrap_err();
        assert!(err.to_string().contains("redis.ca_file"), "{err}");
        let err =
            Settings::from_toml_over_defaults("[redis]\nca_file = \"/etc/hostname\"").unwrap_err();
        assert!(err.to_string().contains("rediss://"), "no TLS URL: {err}");
        let err = Settings::from_toml_over_defaults("[redis]\nurl = \"rediss://h:6380/#insecure\"")
            .unwrap_err();
        assert!(err.to_string().contains("redis.url"), "{err}");
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("k", "100/s").unwrap().get(), 100);
        assert_eq!(parse_rate("k", "90/m").unwrap().get(), 2);
        assert!(parse_rate("k", "0/s").is_err());
        assert!(parse_rate("k", "fast").is_err());
    }
}
