//! The fast tier: Redis. One Lua script per operation, each touching one
//! token's key (the token text is the key's hash tag, so a token's keys share a
//! cluster slot). For durable biz types Redis only turns duplicates away and
//! holds provisional markers; for fast biz types it decides, and appends what
//! it decided to the journal stream that [`crate::journal`] drains into
//! Postgres. A call a request waits on is bounded by `redis.timeout`,
//! background work by `redis.background_timeout`; only the former are
//! evidence of health: [`crate::fast::breaker`] opens the breaker (so that a dead
//! Redis costs nothing per request) on repeated failures to reach Redis,
//! never on one timeout, and their latencies make the mode.
//!
//! Each operation has its own reply type, so that no caller handles an
//! answer its operation cannot give: a durable claim ([`Claim`]), a fast
//! decision ([`Decision`]), a look ([`Peek`]), a fast result
//! ([`ResultWrite`]) and a fast release ([`ReleaseWrite`]).
//!
//! The files:
//! - `conn`: connections (standalone or cluster, TLS) made lazily and shared;
//! - `call`: one call under the timeout, the breaker and the metrics;
//! - `deadline`: the not-after bound (in Redis's clock) a deciding script
//!   carries, so that one reaching Redis after its caller gave up decides
//!   nothing;
//! - `consume`: the consume script and what it answers;
//! - `dataset`: the Redis dataset the fleet agreed on, which a fast
//!   decision and a look at the journal check;
//! - `write`: the issue seed, write-backs of Postgres's decisions, result and
//!   release of fast types;
//! - `breaker`: Redis's health as this instance sees it (the breaker, the
//!   latency window on the clock's monotonic time) and the mode;
//! - `health`: the probe that closes the breaker, and the mode as callers
//!   see it;
//! - `journal`: the journal stream; `record`: its entries' layout (field
//!   names, the op, the one encoding into stream fields); `scan`: reading
//!   and repairing keys for reconcile; `slots`: the cluster's slot map;
//!   `route`: one pipeline per primary by that map (redirects met inside one
//!   sent again alone), by which reconcile reads a page and write-backs go
//!   out.

use std::sync::Arc;

use redis::Script;

pub mod breaker;
mod call;
mod conn;
mod consume;
mod dataset;
mod deadline;
mod health;
mod journal;
pub mod record;
mod route;
mod scan;
mod slots;
mod write;

pub use consume::{
    Attempt, Claim, ConsumeMode, Decision, KeyArgs, KeyVersion, Marker, Peek, ScriptOutcome,
};
pub use dataset::{EntryId, JournalState, Span};
pub use journal::{JournalEntry, ReadFrom, GROUP};
pub use record::{Op, Record, Stamped};
pub use scan::{KeyRead, KeyState, ScanNode};
pub use write::{ConsumedWrite, ReleaseWrite, ResultWrite};

use crate::clock::Clock;
use crate::config::{RedisSettings, RedisTopology};
use crate::fast::breaker::Health;
use crate::metrics::Metrics;
use conn::Conn;

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

struct Scripts {
    consume: Script,
    writeback: Script,
    fast_write: Script,
    issue: Script,
    reconcile: Script,
    key_state: Script,
}

pub struct FastTier {
    settings: RedisSettings,
    /// The connections, made on first use; dropped to be made again from
    /// the seed nodes when a cluster stays unreachable (see [`FastTier::probe`]).
    conns: std::sync::RwLock<Option<Arc<Vec<Conn>>>>,
    /// Held while connecting, so that one caller connects and the others wait.
    connecting: tokio::sync::Mutex<()>,
    /// The breaker, the latency window and the mode.
    health: Health,
    scripts: Scripts,
    /// The service's clock (the breaker's backoff, fallbacks for replies).
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    cluster: bool,
    /// Cluster only: the slot map reconcile's reads and write-backs are
    /// grouped by, kept until a reply proves it stale (see `slots`).
    slot_map: std::sync::RwLock<Option<Arc<slots::SlotMap>>>,
    /// Cluster only: journal entries of decisions already made whose
    /// separate `XADD` failed and that Postgres did not take either
    /// ([`FastTier::set_journal_fallback`]). The decision stands (its caller
    /// is told the outcome); the entry is appended later
    /// ([`FastTier::flush_journal_backlog`]).
    journal_backlog: std::sync::Mutex<std::collections::VecDeque<Stamped>>,
    /// Cluster only: where an entry whose `XADD` failed goes before the
    /// answer (Postgres, through the drainer's apply; set at start).
    journal_fallback: std::sync::OnceLock<journal::JournalFallback>,
    /// How a deciding script's not-after bound is set (see `deadline`).
    deadline: deadline::Deadline,
    /// `<prefix>journal` and `<prefix>dataset`, made once.
    journal_key: String,
    dataset_key: String,
}

impl std::fmt::Debug for FastTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastTier")
            .field("prefix", &self.settings.key_prefix)
            .field("mode", &self.health.mode())
            .finish()
    }
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
        let journal_key = format!("{}journal", settings.key_prefix);
        let dataset_key = format!("{}dataset", settings.key_prefix);
        Arc::new(FastTier {
            health: Health::new(&settings, metrics.clone(), clock.clone()),
            clock,
            settings,
            conns: std::sync::RwLock::new(None),
            connecting: tokio::sync::Mutex::new(()),
            scripts: Scripts {
                consume: Script::new(include_str!("../lua/consume.lua")),
                writeback: Script::new(include_str!("../lua/writeback.lua")),
                fast_write: Script::new(include_str!("../lua/fast_write.lua")),
                issue: Script::new(include_str!("../lua/issue.lua")),
                reconcile: Script::new(include_str!("../lua/reconcile.lua")),
                key_state: Script::new(include_str!("../lua/key_state.lua")),
            },
            metrics,
            cluster,
            slot_map: std::sync::RwLock::new(None),
            journal_backlog: Default::default(),
            journal_fallback: std::sync::OnceLock::new(),
            deadline: deadline::Deadline::new(),
            journal_key,
            dataset_key,
        })
    }
}
