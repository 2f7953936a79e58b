//! The configuration as written (defaults, file, environment merged), before
//! validation: strings where the settings hold durations and rates.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use super::settings::{Durability, Environment, LeaseExpiry, LogFormat};
use crate::auth::Role;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Raw {
    pub(super) env: Environment,
    pub(super) server: RawServer,
    pub(super) postgres: RawPostgres,
    pub(super) redis: RawRedis,
    pub(super) tokens: RawTokens,
    pub(super) bloom: RawBloom,
    pub(super) limits: RawLimits,
    #[serde(default)]
    pub(super) clients: Vec<RawClient>,
    #[serde(default)]
    pub(super) biz: BTreeMap<String, RawBiz>,
    #[serde(default)]
    pub(super) reconcile: RawReconcile,
    pub(super) fleet: RawFleet,
    pub(super) audit: RawAudit,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAudit {
    pub(super) seal_every: String,
    pub(super) seal_keys: Vec<RawKey>,
    /// Unset: audit events are kept for ever.
    #[serde(default)]
    pub(super) retention: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFleet {
    pub(super) heartbeat: String,
    pub(super) lease: String,
    pub(super) decide_without_postgres: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: String,
    pub(super) workers: Option<usize>,
    pub(super) shutdown_timeout: String,
    pub(super) log_format: LogFormat,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPostgres {
    pub(super) url: String,
    /// Absent: admin and audit reads go to `url`.
    #[serde(default)]
    pub(super) read_url: Option<String>,
    pub(super) pool_size: u32,
    pub(super) admin_pool_size: u32,
    pub(super) acquire_timeout: String,
    pub(super) statement_timeout: String,
    pub(super) idle_check_after: String,
    pub(super) idle_timeout: String,
    pub(super) max_lifetime: String,
    pub(super) consume_batch_size: usize,
    pub(super) consume_batches_in_flight: usize,
    pub(super) order_batch_size: usize,
    pub(super) order_batches_in_flight: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRedis {
    pub(super) url: Option<String>,
    pub(super) cluster_nodes: Option<Vec<String>>,
    pub(super) key_prefix: String,
    pub(super) connections: usize,
    pub(super) timeout: String,
    pub(super) consumed_ttl: String,
    pub(super) processing_trust: String,
    pub(super) down_backoff: String,
    pub(super) slow_threshold: String,
    pub(super) slow_window: String,
    pub(super) degraded_sample: f64,
    pub(super) fallback_rate: String,
    pub(super) fallback_capacity: u64,
    pub(super) ca_file: Option<String>,
    pub(super) down_after_failures: u32,
    pub(super) down_after: String,
    pub(super) background_timeout: String,
    pub(super) memory_fallback: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTokens {
    pub(super) signing_keys: Vec<RawKey>,
    pub(super) retention: String,
    pub(super) provisional_ttl: String,
    pub(super) worker_lease_ttl: String,
    pub(super) issue_buffer: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBloom {
    pub(super) enabled: bool,
    pub(super) capacity: usize,
    pub(super) fp_rate: f64,
    pub(super) generation: String,
    pub(super) horizon: String,
    pub(super) grace: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    pub(super) client_rate: String,
    pub(super) max_uri_bytes: usize,
    pub(super) max_header_bytes: usize,
    pub(super) max_json_depth: usize,
    pub(super) request_head_timeout: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKey {
    pub(super) id: String,
    pub(super) secret: String,
}

impl fmt::Debug for RawKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawKey").field("id", &self.id).finish()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClient {
    pub(super) name: String,
    pub(super) role: Role,
    pub(super) key_sha256: String,
    #[serde(default)]
    pub(super) biz_types: Vec<String>,
    /// Requests per second on every `/v1` route; default `limits.client_rate`.
    pub(super) rate: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReconcile {
    pub(super) batch_size: usize,
}

impl Default for RawReconcile {
    fn default() -> Self {
        RawReconcile { batch_size: 500 }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBiz {
    pub(super) ttl: String,
    pub(super) durability: Durability,
    pub(super) issue_rate: Option<String>,
    pub(super) min_ttl: Option<String>,
    pub(super) processing_lease: Option<String>,
    pub(super) on_lease_expiry: Option<LeaseExpiry>,
}
