//! The fast-type journal: what Redis decided for fast biz types (consume,
//! result, release) reaches Postgres through a Redis stream read by a consumer
//! group ([`Drainer`]; the stream commands are the fast tier's, in
//! `fast/journal.rs`, and so are the stream's field names and the encoding
//! of an entry, in `fast/record.rs`; what the ledger packs into an entry and
//! how the drainer reads it back are [`entry`]'s). An entry is
//! acknowledged only after Postgres has it: after a failed round (Postgres
//! down) this consumer re-reads its own pending entries first; entries left
//! pending by a dead instance are claimed after 30 s.
//!
//! An entry carries the state and generation its script decided (see
//! [`crate::durable::journal`]): applying it only moves a token forward, so
//! entries of one token may be applied in any order, by any consumer, and
//! more than once. Entries written before generations (no `g` field, or no
//! token record) keep their old meaning, applied in stream order.
//! An entry that can never apply (unreadable, or a value Postgres refuses) is
//! set aside in the dead-letter stream `<prefix>journal:dead` with its reason,
//! counted in `ledger_journal_dead_letters_total` and acknowledged: it never
//! stops the entries behind it.

pub mod entry;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::durable::journal::{self as versioned};
use crate::durable::tokens::{self, JournalConsume};
use crate::durable::DurableError;
use crate::fast::{FastError, FastTier, JournalEntry, ReadFrom};
use entry::{parse, Entry};

pub use crate::fast::record::{AT, BY, CONSUMED_AT, ENTRY, FINGERPRINT, GEN, REASON, REQUEST_ID};
use crate::metrics::OnScrape;
pub use entry::{
    admin_release_fields_for, consume_fields, decided, release_fields, release_fields_for,
    result_fields, result_fields_for,
};
use prometheus::IntGauge;

const BATCH: usize = 500;
const CLAIM_IDLE_MS: u64 = 30_000;

/// Whether a statement failed because of what the entries hold (SQLSTATE
/// class 22, data exception: a string Postgres cannot store; class 23, a
/// constraint the row would break): retrying cannot help. Anything else
/// (Postgres down, a timeout) is retried in a later round.
fn refused_for_its_data(e: &DurableError) -> bool {
    match e {
        DurableError::Other(sqlx::Error::Database(db)) => {
            let code = db.code().unwrap_or_default();
            code.starts_with("22") || code.starts_with("23")
        }
        _ => false,
    }
}

/// Entries of one round that can never apply: their index and why.
type DeadLetters = Vec<(usize, String)>;

/// Applies a batch through `apply_all`; when Postgres refuses the batch for
/// what it holds, applies its entries one at a time, and the ones refused
/// alone become dead letters. Takes the items out of `items`; `apply_all`
/// gives its batch back with its result, so no entry is copied.
async fn apply_or_isolate<T, F, Fut>(
    items: &mut Vec<(usize, T)>,
    dead: &mut DeadLetters,
    apply_all: F,
) -> Result<(), DurableError>
where
    F: Fn(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = (Vec<T>, Result<(), DurableError>)>,
{
    if items.is_empty() {
        return Ok(());
    }
    let (indices, all): (Vec<usize>, Vec<T>) = items.drain(..).unzip();
    let all = match apply_all(all).await {
        (_, Ok(())) => return Ok(()),
        (all, Err(e)) if refused_for_its_data(&e) => all,
        (_, Err(e)) => return Err(e),
    };
    for (i, item) in indices.into_iter().zip(all) {
        match apply_all(vec![item]).await.1 {
            Ok(()) => {}
            Err(e) if refused_for_its_data(&e) => {
                dead.push((i, crate::telemetry::error_chain(&e)));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Applies one round's entries; returns the ones set aside. In stream
/// order, in runs: consecutive versioned entries in one statement,
/// consecutive consumes written without a generation in another, and each
/// other entry written without a generation alone (those keep their old
/// meaning, which depends on the order).
async fn apply(pool: &PgPool, entries: &[JournalEntry]) -> Result<DeadLetters, DurableError> {
    let mut dead = DeadLetters::new();
    let mut current: Vec<(usize, versioned::Entry)> = Vec::new();
    let mut run: Vec<(usize, JournalConsume)> = Vec::new();
    let consumes = |batch: Vec<JournalConsume>| async move {
        let applied = tokens::apply_journal_consumes(pool, &batch).await;
        (batch, applied.map(|_| ()))
    };
    let versioned = |batch: Vec<versioned::Entry>| async move {
        let applied = versioned::apply(pool, &batch).await;
        (batch, applied.map(|_| ()))
    };
    for (i, e) in entries.iter().enumerate() {
        let entry = parse(e);
        if !matches!(entry, Entry::Versioned(_) | Entry::Bad(_)) {
            apply_or_isolate(&mut current, &mut dead, versioned).await?;
        }
        if !matches!(entry, Entry::Consume(_) | Entry::Bad(_)) {
            apply_or_isolate(&mut run, &mut dead, consumes).await?;
        }
        match entry {
            Entry::Versioned(v) => current.push((i, v)),
            Entry::Consume(c) => run.push((i, c)),
            Entry::Bad(why) => {
                tracing::error!(entry = %e.id, reason = why, "unreadable journal entry set aside");
                dead.push((i, why.to_owned()));
            }
            Entry::Result { id, result } => {
                apply_or_isolate(&mut vec![(i, ())], &mut dead, |one| async {
                    (one, tokens::set_result(pool, id, &result).await.map(|_| ()))
                })
                .await?;
            }
            Entry::Release { id } => {
                apply_or_isolate(&mut vec![(i, ())], &mut dead, |one| async move {
                    (one, tokens::release(pool, id).await.map(|_| ()))
                })
                .await?;
            }
        }
    }
    apply_or_isolate(&mut run, &mut dead, consumes).await?;
    apply_or_isolate(&mut current, &mut dead, versioned).await?;
    Ok(dead)
}

/// Applies entries that did not come from the stream (an instance's recent
/// Redis decisions, written to Postgres before it reports Redis down): the
/// drainer's statements, so an entry applied twice changes nothing. Entries
/// set aside are logged, as the drainer's are.
pub async fn apply_entries(pool: &PgPool, entries: &[JournalEntry]) -> Result<(), DurableError> {
    for (i, why) in apply(pool, entries).await? {
        let id = entries.get(i).map(|e| e.id.as_str()).unwrap_or("?");
        tracing::error!(
            entry = id,
            reason = why,
            "journal entry refused by postgres; dropped"
        );
    }
    Ok(())
}

/// How often a scrape may have the journal's length read again.
pub const LAG_REFRESH: Duration = Duration::from_secs(5);

/// `ledger_journal_lag_entries`: fast-type journal entries not yet in
/// Postgres, read when scraped (see [`OnScrape`]). It holds the fast tier
/// weakly: the tier holds the metrics that hold this, and a strong
/// reference would keep both (and the pools the tier holds) alive after the
/// service stopped.
pub fn lag_metric(fast: &Arc<FastTier>) -> OnScrape {
    let fast = Arc::downgrade(fast);
    // A static, valid definition.
    let gauge = IntGauge::new(
        "ledger_journal_lag_entries",
        "Fast-type journal entries not yet in Postgres: the Redis stream's length plus the entries waiting in this instance to be appended (read at most every 5 s, when scraped).",
    )
    .expect("valid metric");
    let g = gauge.clone();
    OnScrape::new(
        vec![Box::new(gauge)],
        LAG_REFRESH,
        Arc::new(move || {
            let fast = fast.upgrade();
            let g = g.clone();
            Box::pin(async move {
                if let Some(fast) = fast {
                    refresh_lag(&fast, &g).await;
                }
            })
        }),
    )
}

/// The stream's length (entries are deleted once Postgres has them) plus this
/// instance's backlog of entries not yet appended. While Redis is unreachable
/// the gauge keeps its last value.
pub async fn refresh_lag(fast: &FastTier, gauge: &IntGauge) {
    if let Ok(n) = fast.journal_len().await {
        let backlog = u64::try_from(fast.journal_backlog_len()).unwrap_or(u64::MAX);
        gauge.set(i64::try_from(n.saturating_add(backlog)).unwrap_or(i64::MAX));
    }
}

/// Why a round did not finish; its entries stay pending and come first next
/// round.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error(transparent)]
    Redis(#[from] FastError),
    #[error(transparent)]
    Postgres(#[from] DurableError),
}

/// One consumer of the journal stream, and what it remembers between rounds.
#[derive(Debug)]
pub struct Drainer {
    fast: Arc<FastTier>,
    pool: PgPool,
    consumer: String,
    /// The consumer group is known to exist (cleared by NOGROUP).
    group_ready: bool,
    /// When entries left by dead consumers were last claimed.
    last_claim: Instant,
    /// Entries this consumer read but did not acknowledge (a failed round,
    /// or an earlier life under the same name) may exist: they come first.
    own_pending: bool,
}

impl Drainer {
    pub fn new(fast: Arc<FastTier>, pool: PgPool, consumer: String) -> Drainer {
        Drainer {
            fast,
            pool,
            consumer,
            group_ready: false,
            last_claim: Instant::now(),
            own_pending: true,
        }
    }

    /// The first round also claims entries a dead instance left pending
    /// (idle for 30 s or more), instead of waiting 10 s for it.
    pub fn claiming_at_once(mut self) -> Drainer {
        self.last_claim = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .unwrap_or_else(Instant::now);
        self
    }

    /// Drains until `shutdown`. Never blocks a shared connection (no
    /// `BLOCK`): it polls, sleeping briefly when the stream is empty.
    pub async fn run(mut self, shutdown: CancellationToken) {
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let idle = match self.drain_once().await {
                Ok(0) => Duration::from_millis(50),
                Ok(_) => Duration::ZERO,
                Err(e) => {
                    self.own_pending = true;
                    tracing::debug!(error = %e, "journal not drained this round");
                    Duration::from_millis(500)
                }
            };
            if !idle.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(idle) => {}
                    _ = shutdown.cancelled() => break,
                }
            }
        }
    }

    /// One round; returns how many entries were applied (or set aside). It
    /// re-reads the entries this consumer holds unacknowledged first (until
    /// there are none). A stream that lost its consumer group (Redis
    /// restarted empty, a failover to a replica without it, the key deleted)
    /// answers NOGROUP: the group is created again next round.
    pub async fn drain_once(&mut self) -> Result<usize, DrainError> {
        let out = self.drain_round().await;
        if let Err(DrainError::Redis(e)) = &out {
            if e.is_no_group() {
                self.group_ready = false;
            }
        }
        out
    }

    async fn drain_round(&mut self) -> Result<usize, DrainError> {
        let fast = &self.fast;
        if !self.group_ready {
            fast.journal_group_create().await?;
            self.group_ready = true;
        }
        let mut entries: Vec<JournalEntry> = Vec::new();
        if self.last_claim.elapsed() > Duration::from_secs(10) {
            self.last_claim = Instant::now();
            entries = fast
                .journal_claim_idle(&self.consumer, CLAIM_IDLE_MS, BATCH)
                .await?;
        }
        for from in [ReadFrom::OwnPending, ReadFrom::New] {
            if !entries.is_empty() {
                break;
            }
            if from == ReadFrom::OwnPending && !self.own_pending {
                continue;
            }
            entries = fast.journal_read(&self.consumer, from, BATCH).await?;
            if from == ReadFrom::OwnPending && entries.is_empty() {
                self.own_pending = false;
            }
        }
        if entries.is_empty() {
            return Ok(0);
        }
        let dead = apply(&self.pool, &entries).await?;
        for (i, reason) in &dead {
            if let Some(e) = entries.get(*i) {
                tracing::error!(entry = %e.id, reason = %reason, "journal entry can never apply: set aside");
                fast.dead_letter(e, reason).await?;
            }
        }
        let ids: Vec<String> = entries.into_iter().map(|e| e.id).collect();
        fast.journal_ack(&ids).await?;
        Ok(ids.len())
    }
}
