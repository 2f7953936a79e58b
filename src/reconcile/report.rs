//! What a run finds and says: the divergence classes ([`Class`]), the phases
//! that look for them ([`Phase`]), the report, and where progress goes. The
//! report's keys, its text and the audit rows' `class` all come from the
//! enums, so a new class or phase does not compile until every one of them
//! knows it.

use std::borrow::Cow;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::ser::SerializeMap;
use serde::Serialize;
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::{RefOr, Schema};
use utoipa::{PartialSchema, ToSchema};

/// One way the tiers can disagree (API.md's report keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// Redis says issued, Postgres consumed: the key is deleted.
    RedisLiveButConsumed,
    /// Postgres holds a live issued token Redis lost: it is re-seeded.
    RedisMissingButLive,
    /// A provisional marker past its deadline: cleared.
    StaleProvisional,
    /// Fast-type journal entries not yet in Postgres: written.
    JournalNotDurable,
    /// An order whose events, tokens and amounts disagree: reported only.
    OrderInconsistent,
    /// Records past retention: purged.
    ExpiredPurgeable,
    /// A durable token's consumed marker while Postgres holds it issued (a
    /// release lost in a failover, a write-back that lost a race): the
    /// marker gives way to the issued state.
    RedisConsumedButLive,
    /// A consumed marker in Redis of the same or a newer generation than
    /// the issued state Postgres holds (after a Postgres restore to an
    /// earlier point, say): evidence of a consume Postgres lost. Reported
    /// with its token and kept, never repaired.
    RedisAheadOfPostgres,
}

impl Class {
    /// In the order of the report.
    pub const ALL: [Class; 8] = [
        Class::RedisLiveButConsumed,
        Class::RedisMissingButLive,
        Class::StaleProvisional,
        Class::JournalNotDurable,
        Class::OrderInconsistent,
        Class::ExpiredPurgeable,
        Class::RedisConsumedButLive,
        Class::RedisAheadOfPostgres,
    ];

    /// The report key, the text's row name and the audit detail's `class`.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::RedisLiveButConsumed => "redis_live_but_consumed",
            Class::RedisMissingButLive => "redis_missing_but_live",
            Class::StaleProvisional => "stale_provisional",
            Class::JournalNotDurable => "journal_not_durable",
            Class::OrderInconsistent => "order_inconsistent",
            Class::ExpiredPurgeable => "expired_purgeable",
            Class::RedisConsumedButLive => "redis_consumed_but_live",
            Class::RedisAheadOfPostgres => "redis_ahead_of_postgres",
        }
    }

    fn index(self) -> usize {
        match self {
            Class::RedisLiveButConsumed => 0,
            Class::RedisMissingButLive => 1,
            Class::StaleProvisional => 2,
            Class::JournalNotDurable => 3,
            Class::OrderInconsistent => 4,
            Class::ExpiredPurgeable => 5,
            Class::RedisConsumedButLive => 6,
            Class::RedisAheadOfPostgres => 7,
        }
    }
}

/// The steps of a run, in order; each makes the next one's comparison truer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Drains the fast-type journal into Postgres.
    Journal,
    /// Every Redis token key against Postgres.
    RedisKeys,
    /// Every live issued token in Postgres against Redis.
    LiveTokens,
    /// Every order against its events and tokens.
    Orders,
    /// Records past retention.
    Purge,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::Journal,
        Phase::RedisKeys,
        Phase::LiveTokens,
        Phase::Orders,
        Phase::Purge,
    ];

    /// As progress and the report's `errors` name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Journal => "journal",
            Phase::RedisKeys => "redis keys",
            Phase::LiveTokens => "live tokens",
            Phase::Orders => "orders",
            Phase::Purge => "purge",
        }
    }
}

/// A count per divergence class; serialized as one key per class, in
/// [`Class::ALL`] order.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Classes([u64; Class::ALL.len()]);

impl Classes {
    pub fn get(&self, class: Class) -> u64 {
        self.0[class.index()]
    }

    pub fn add(&mut self, class: Class, n: u64) {
        self.0[class.index()] += n;
    }

    /// Every class with its count, in report order.
    pub fn iter(&self) -> impl Iterator<Item = (Class, u64)> + '_ {
        Class::ALL.into_iter().map(|c| (c, self.get(c)))
    }
}

impl FromIterator<(Class, u64)> for Classes {
    fn from_iter<I: IntoIterator<Item = (Class, u64)>>(iter: I) -> Classes {
        let mut out = Classes::default();
        for (c, n) in iter {
            out.add(c, n);
        }
        out
    }
}

impl std::fmt::Debug for Classes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(c, n)| (c.as_str(), n)))
            .finish()
    }
}

impl Serialize for Classes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(Class::ALL.len()))?;
        for (c, n) in self.iter() {
            map.serialize_entry(c.as_str(), &n)?;
        }
        map.end()
    }
}

impl PartialSchema for Classes {
    fn schema() -> RefOr<Schema> {
        let mut object = ObjectBuilder::new().description(Some("Counts per divergence class."));
        for c in Class::ALL {
            let count = ObjectBuilder::new()
                .schema_type(Type::Integer)
                .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                .minimum(Some(0));
            object = object.property(c.as_str(), count).required(c.as_str());
        }
        RefOr::T(Schema::Object(object.build()))
    }
}

impl ToSchema for Classes {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Classes")
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct Scanned {
    /// Token records looked at: Redis keys plus Postgres rows.
    pub tokens: u64,
    pub orders: u64,
}

/// An order whose events, tokens and amounts disagree: for a human.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct InconsistentOrder {
    pub order_id: String,
    pub problems: Vec<String>,
}

/// How many items of one kind a report lists by name.
pub const MAX_LISTED: usize = 1000;

/// The report of API.md, plus the inconsistent orders, whether the run was
/// interrupted, and the errors that stopped a phase.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Report {
    /// The run's id in the recorded runs (`GET /v1/admin/reconcile/runs`);
    /// null when it could not be recorded.
    pub id: Option<String>,
    /// Who asked: the acting client's name for `POST /v1/admin/reconcile`,
    /// `cli` for the `reconcile` subcommand.
    #[schema(example = "reconciler")]
    pub by: String,
    #[schema(value_type = String, format = DateTime)]
    pub started_at: String,
    #[schema(value_type = String, format = DateTime)]
    pub finished_at: String,
    pub dry_run: bool,
    pub scanned: Scanned,
    pub found: Classes,
    pub repaired: Classes,
    /// The orders counted in `found.order_inconsistent`.
    pub inconsistent_orders: Vec<InconsistentOrder>,
    /// The tokens (or client keys' handles) counted in
    /// `found.redis_ahead_of_postgres`, at most [`MAX_LISTED`]: for a human.
    pub redis_ahead_of_postgres: Vec<String>,
    /// Stopped early (cancelled); rerun to finish.
    pub interrupted: bool,
    /// Phases that could not finish (e.g. Redis unreachable); the others ran.
    pub errors: Vec<String>,
}

impl Report {
    /// The report for humans (`--format text`).
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "reconcile{} from {} to {}\nscanned: {} token records, {} orders\n\n{:<26} {:>10} {:>10}\n",
            if self.dry_run { " (dry run)" } else { "" },
            self.started_at,
            self.finished_at,
            self.scanned.tokens,
            self.scanned.orders,
            "class",
            "found",
            "repaired"
        );
        for (class, n) in self.found.iter() {
            out.push_str(&format!(
                "{:<26} {:>10} {:>10}\n",
                class.as_str(),
                n,
                self.repaired.get(class)
            ));
        }
        for o in &self.inconsistent_orders {
            out.push_str(&format!(
                "\norder {}: {}",
                o.order_id,
                o.problems.join("; ")
            ));
        }
        if !self.inconsistent_orders.is_empty() {
            out.push('\n');
        }
        for t in &self.redis_ahead_of_postgres {
            out.push_str(&format!(
                "\nredis ahead of postgres (kept as evidence): {t}"
            ));
        }
        if !self.redis_ahead_of_postgres.is_empty() {
            out.push('\n');
        }
        if self.interrupted {
            out.push_str("\ninterrupted: rerun to finish\n");
        }
        for e in &self.errors {
            out.push_str(&format!("\nerror: {e}\n"));
        }
        out
    }
}

/// Where a run reports its progress.
pub trait Progress: Send + Sync {
    /// A phase begins; `total` when it is known.
    fn phase(&self, phase: Phase, total: Option<u64>);
    /// `n` more items of the current phase are done.
    fn advance(&self, n: u64);
    /// The run is over.
    fn finish(&self) {}
}

/// No progress output.
#[derive(Debug, Default)]
pub struct Quiet;

impl Progress for Quiet {
    fn phase(&self, _: Phase, _: Option<u64>) {}
    fn advance(&self, _: u64) {}
}

/// Progress as log lines: one per phase, then at most one every `every`.
#[derive(Debug)]
pub struct LogProgress {
    every: Duration,
    state: Mutex<(&'static str, Option<u64>, u64, Instant)>,
}

impl LogProgress {
    pub fn new(every: Duration) -> LogProgress {
        LogProgress {
            every,
            state: Mutex::new(("", None, 0, Instant::now())),
        }
    }
}

impl Progress for LogProgress {
    fn phase(&self, phase: Phase, total: Option<u64>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        *s = (phase.as_str(), total, 0, Instant::now());
        tracing::info!(phase = phase.as_str(), total, "reconcile: phase started");
    }
    fn advance(&self, n: u64) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.2 += n;
        if s.3.elapsed() >= self.every {
            s.3 = Instant::now();
            tracing::info!(phase = s.0, done = s.2, total = s.1, "reconcile: progress");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_serialize_one_key_per_class_in_order() {
        let c: Classes = [(Class::StaleProvisional, 2), (Class::ExpiredPurgeable, 5)]
            .into_iter()
            .collect();
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(
            json,
            r#"{"redis_live_but_consumed":0,"redis_missing_but_live":0,"stale_provisional":2,"journal_not_durable":0,"order_inconsistent":0,"expired_purgeable":5,"redis_consumed_but_live":0,"redis_ahead_of_postgres":0}"#
        );
        let indexes: Vec<usize> = Class::ALL.iter().map(|c| c.index()).collect();
        assert_eq!(indexes, (0..Class::ALL.len()).collect::<Vec<_>>());
    }
}
