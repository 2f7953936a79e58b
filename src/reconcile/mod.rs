//! Reconciliation: compares the tiers and repairs what diverged, in batches,
//! under a Postgres advisory lock (one run at a time across the fleet).
//!
//! Phases, in this order (each one makes the next one's comparison truer):
//! 1. `journal_not_durable`: fast-type journal entries still in the Redis
//!    stream are written to Postgres (the journal drainer's own code).
//! 2. A `SCAN` of `<prefix>tok:*` (tokens' and client keys' hashes) in
//!    pages, each page read with one pipeline (on a cluster, one per primary)
//!    and compared with Postgres in one query:
//!    `redis_live_but_consumed` (Redis says issued at a generation older than
//!    the one Postgres consumed the token at: the key is deleted, so Postgres
//!    answers; a fast release Redis decided and the journal has not carried
//!    yet is newer, and left alone), `stale_provisional` (a provisional
//!    marker past its deadline: back to issued with the remaining TTL, or to
//!    consumed when Postgres consumed it) and `redis_consumed_but_live` (a
//!    durable token's consumed marker while Postgres holds it issued: a
//!    release lost in a failover, a write-back that lost a race; the marker
//!    gives way to the issued state with the remaining TTL).
//! 3. Keyset pages of the tokens Postgres holds as issued and live:
//!    `redis_missing_but_live` (re-seeded at Postgres's generation with the
//!    remaining TTL by Postgres's clock; never overwriting a key; undone when
//!    a consume won meanwhile).
//! 4. Keyset pages of orders: `order_inconsistent` (reported, never repaired).
//! 5. `expired_purgeable`: records past `tokens.retention` (and past their
//!    own expiry) go, order-bound ones too (the order keeps its events);
//!    they then answer `token_expired`. A day partition of `tokens` past its
//!    bound whose rows have all gone past retention is dropped whole; the
//!    rest (client keys, tokens from before migration V16, `tokens_default`,
//!    a day partition past its bound with a row still within retention) are
//!    deleted in batches. The day partitions ahead are made first.
//!
//! Every repair writes a `reconcile.repaired` audit event whose detail names
//! the class and who asked for the run (`by`, also in the report). Every Redis repair is one script on one key that checks the
//! state and generation it expects first, so a repair racing live traffic
//! does nothing rather than something wrong. No repair makes a token live
//! that Postgres holds consumed. Journal entries that can never apply (the
//! dead-letter stream) are named in the report's `errors`.
//! The run stops between batches when cancelled; rerunning continues the job.
//!
//! The files: `run` (the lock, the run record, the phases in order), one per
//! phase (`journal`, `keys`, `live`, `orders`, `purge`), [`report`] (classes,
//! phases, the report, progress) and `metrics` (the last run's gauges).

mod journal;
mod keys;
mod live;
mod metrics;
mod orders;
mod purge;
pub mod report;
mod run;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::audit_seal::Seals;
use crate::clock::Clock;
use crate::durable::DurableError;
use crate::fast::FastTier;
use crate::token::TokenCodec;

pub use crate::durable::reconcile::LOCK_KEY;
pub use metrics::{conflict_metric, last_run_metrics, LAST_RUN_REFRESH};
pub use report::{
    Class, Classes, InconsistentOrder, LogProgress, Phase, Progress, Quiet, Report, Scanned,
};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// Another run holds the advisory lock (CLI exit 3, HTTP 409).
    #[error("another reconcile run holds the lock")]
    Running,
    #[error("postgres")]
    Postgres(#[from] DurableError),
}

/// What to do. The default is the `reconcile` subcommand without flags: a
/// real run over everything, `by` [`BY_CLI`].
#[derive(Debug, Clone)]
pub struct Options {
    /// Find and report only; change nothing.
    pub dry_run: bool,
    /// Only tokens issued, and orders updated, this recently (the journal and
    /// the retention purge are always whole).
    pub since: Option<Duration>,
    /// Who asked, kept in the report (`by`) and in the detail of the run's
    /// `reconcile.repaired` events: the acting client's name over HTTP,
    /// [`BY_CLI`] for the `reconcile` subcommand.
    pub by: String,
}

/// `by` of a run the `reconcile` subcommand started (by hand or by a
/// scheduler: the CLI cannot tell them apart).
pub const BY_CLI: &str = "cli";

impl Default for Options {
    fn default() -> Options {
        Options {
            dry_run: false,
            since: None,
            by: BY_CLI.to_owned(),
        }
    }
}

/// Runs reconciliations. Cheap to build; holds the admin pool.
#[derive(Debug, Clone)]
pub struct Reconciler {
    pool: PgPool,
    fast: Arc<FastTier>,
    codec: TokenCodec,
    retention: Duration,
    /// The longest `ttl` of any biz type: a day partition's rows have all
    /// expired by the end of its day plus this.
    max_ttl: Duration,
    batch: usize,
    /// `audit.retention` (`None`: audit kept for ever) and the sealer that
    /// verifies and records an audit day partition before its drop.
    audit_retention: Option<Duration>,
    seals: Seals,
    /// Only for the report's start and finish times: Postgres `now()` and
    /// Redis's clock judge expiry and deadlines.
    clock: Arc<dyn Clock>,
}
