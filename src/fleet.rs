//! The fleet's agreement on Redis, which lets fast biz types stay exactly
//! once across instances (DESIGN.md, invariant 1). Redis decides fast
//! consumes on an instance only while its own last report to Postgres said
//! "Redis up" and the fleet was `normal` (the *gate*); Postgres decides them
//! only while every member has reported "Redis down" (the fleet is
//! `redis_down`, recorded in `fleet_state`), each decision fenced by that
//! row (see [`crate::durable::fleet`]). In between, an instance that cannot
//! reach Redis answers 503: one slow call, one broken connection or one bad
//! link never moves a decision out of Redis.
//!
//! The protocol, every `fleet.heartbeat` and at once when this instance's
//! view of Redis changes:
//! - **Going down.** Before an instance reports "Redis down" it closes its
//!   gate, waits for the Redis decisions in flight, and writes the fast
//!   consumes Redis decided for it that are not known to be in Postgres to
//!   Postgres (as the journal would), so that when the fleet turns
//!   `redis_down`, Postgres knows every consume an instance answered. A
//!   decision is known to be in Postgres once the journal stream was seen
//!   empty after it (checked every heartbeat), however long a Postgres
//!   outage kept it there; with 200,000 decisions not known to be there,
//!   Redis stops deciding on the instance until the journal catches up.
//! - **Agreeing.** Reports are serialised by the fleet row's lock; the
//!   report that finds every member seen within the member timeout
//!   (`fleet.lease + redis.timeout + 1s`) reporting down turns the fleet to
//!   `redis_down` at a new epoch. A fleet of one agrees with itself at once.
//! - **Accounting.** A member that fell silent (crashed, paused, cut off from
//!   Postgres) after reporting "Redis up" may have let Redis decide consumes
//!   that only the journal in Redis records: while any such member is left
//!   (`unaccounted`), the fleet does not turn `redis_down`. A member that
//!   reaches Redis retires them once it sees the journal empty after the
//!   report that found them silent (their leases and their scripts'
//!   not-after bounds had run out by then, so every decision of theirs is in
//!   Postgres). A member leaving cleanly writes its own recent decisions to
//!   Postgres first, as when going down.
//! - **Coming back.** A member that reaches Redis again while the fleet is
//!   `redis_down` writes what Postgres decided meanwhile (`redis_resync`, with
//!   generations) to Redis, then, holding the fleet row exclusively, writes
//!   whatever arrived since and turns the fleet `normal` in that same
//!   transaction. Only then may an instance's gate open again. These
//!   write-backs replace a consumed marker Redis holds at the same
//!   generation: only a script that reached Redis after its caller timed it
//!   out (and was answered 503) can have written one during the episode.
//! - **Lease.** A gate stays open for `fleet.lease` after the report that
//!   opened it began, so an instance that stalls (paused, starved) or cannot
//!   renew its membership (its reports fail on Postgres) stops letting Redis
//!   decide before its peers stop counting it; a decision whose reply comes
//!   in after the peers may have stopped counting it (`fleet.lease +
//!   redis.timeout + 1s` after the report) is answered 503 (outcome unknown),
//!   never `consumed`.
//!   With `fleet.decide_without_postgres` a report that fails on Postgres
//!   keeps the gate open instead (fast types work through a Postgres outage,
//!   but a partition that leaves one instance with Redis and without
//!   Postgres can then yield two deciders).
//!
//! - **Dataset.** The fleet records an id in Postgres (`fleet_state`) and
//!   in Redis (`<prefix>dataset`). A fast decision's script checks it and
//!   decides nothing on another dataset (`foreign`): a Redis that restarted
//!   empty, however briefly, lost markers and journal entries that Postgres
//!   may lack. Its journal is counted as drained only on that dataset (one
//!   `MULTI` reads both), and an instance that finds Redis foreign reports
//!   it down, as above, so the fleet goes through an episode: every
//!   member's recent decisions reach Postgres first, and the member that
//!   ends it writes the id back in the transaction that turns the fleet
//!   normal. The first member records one (a new id) while the fleet has
//!   none. On a cluster scripts touch only their token's slot, so nothing
//!   checks it there (see docs/operations.md).
//!
//! The lease, the peers' count and the order of recent decisions against
//! the journal's emptiness are measured on the service clock's monotonic
//! reading ([`Clock::monotonic`]), so tests drive them.

mod drain;

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::clock::Clock;
use crate::config::Settings;
pub use crate::durable::fleet::FleetState;
use crate::durable::fleet::{self as store, Queued};
use crate::durable::tokens::TokenState;
use crate::durable::DurableError;
use crate::fast::{FastError, FastTier, JournalEntry, JournalState, Marker, Span};
use crate::metrics::Metrics;
use drain::DrainMarks;

/// A journal entry as its script completed it.
type Fields = crate::fast::Stamped;

/// At most this many fast consumes Redis decided are kept for the
/// going-down flush; with that many not yet known to be in Postgres, Redis
/// stops deciding here until the journal has caught up.
const RECENT_LIMIT: usize = 200_000;

/// This instance's view of the fleet, as of its last report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    pub state: FleetState,
    pub epoch: i64,
    pub members: i64,
    pub redis_down_members: i64,
    /// Silent members whose last report said Redis was up, not retired yet
    /// (the fleet does not turn `redis_down` while any is left).
    pub unaccounted: i64,
    /// This instance's last committed report said Redis was up.
    pub reported_up: bool,
    /// When that report began, on the clock's monotonic reading (`None`: no
    /// report yet).
    confirmed: Option<Instant>,
    /// The reports since have failed on Postgres.
    pg_failing: bool,
    /// The Redis dataset the fleet agreed on, as of that report (`None`:
    /// none yet).
    pub dataset: Option<Uuid>,
}

impl View {
    /// The reports since the last committed one have failed on Postgres.
    pub fn postgres_failing(&self) -> bool {
        self.pg_failing
    }
}

struct FleetMetrics {
    state: IntGaugeVec,
    members: IntGauge,
    redis_down_members: IntGauge,
    unaccounted: IntGauge,
    reports: IntCounterVec,
    episodes: IntCounterVec,
    foreign: IntGauge,
}

impl FleetMetrics {
    fn new(metrics: &Metrics) -> FleetMetrics {
        let state = IntGaugeVec::new(
            Opts::new(
                "ledger_fleet_state",
                "The fleet's state as this instance last saw it: 1 for the current one (normal: Redis decides fast types; redis_down: every member reported Redis down and Postgres decides them).",
            ),
            &["state"],
        )
        .expect("valid metric");
        let members = IntGauge::new(
            "ledger_fleet_members",
            "Instances that reported to the fleet within the member timeout, at this instance's last report.",
        )
        .expect("valid metric");
        let redis_down_members = IntGauge::new(
            "ledger_fleet_redis_down_members",
            "Of those, how many reported Redis down.",
        )
        .expect("valid metric");
        let unaccounted = IntGauge::new(
            "ledger_fleet_unaccounted_members",
            "Members silent for longer than the member timeout whose last report said Redis was up, at this instance's last report: their Redis decisions may be only in the journal, so the fleet cannot turn redis_down until a member that reaches Redis retires them.",
        )
        .expect("valid metric");
        let reports = IntCounterVec::new(
            Opts::new(
                "ledger_fleet_reports_total",
                "This instance's reports of its view of Redis to Postgres, by result (ok, error).",
            ),
            &["result"],
        )
        .expect("valid metric");
        let episodes = IntCounterVec::new(
            Opts::new(
                "ledger_fleet_transitions_total",
                "Fleet state changes made by this instance: to redis_down (every member reported Redis down) and to normal (what Postgres decided was written back to Redis).",
            ),
            &["to"],
        )
        .expect("valid metric");
        let foreign = IntGauge::new(
            "ledger_fleet_redis_foreign",
            "1 while this instance finds Redis holding another dataset than the fleet agreed on (Redis restarted empty, or another server answers at its address): Redis decides no fast consume until the fleet has accounted for the decisions it may have lost (an episode: redis_down, then normal).",
        )
        .expect("valid metric");
        for c in [
            Box::new(state.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(foreign.clone()),
            Box::new(members.clone()),
            Box::new(redis_down_members.clone()),
            Box::new(unaccounted.clone()),
            Box::new(reports.clone()),
            Box::new(episodes.clone()),
        ] {
            // A second ledger on the same registry (tests) keeps the first's.
            let _ = metrics.registry.register(c);
        }
        for r in ["ok", "error"] {
            reports.with_label_values(&[r]);
        }
        for s in FleetState::ALL {
            episodes.with_label_values(&[s.as_str()]);
        }
        FleetMetrics {
            state,
            members,
            redis_down_members,
            unaccounted,
            reports,
            episodes,
            foreign,
        }
    }

    fn show(&self, v: &View) {
        for s in FleetState::ALL {
            self.state
                .with_label_values(&[s.as_str()])
                .set(i64::from(s == v.state));
        }
        self.members.set(v.members);
        self.redis_down_members.set(v.redis_down_members);
        self.unaccounted.set(v.unaccounted);
    }
}

pub struct Fleet {
    instance: Uuid,
    heartbeat: Duration,
    lease: Duration,
    /// `fleet.decide_without_postgres`: the gate outlives its lease while
    /// the reports fail on Postgres.
    decide_without_postgres: bool,
    member_timeout: Duration,
    deadline: Duration,
    pool: PgPool,
    fast: Arc<FastTier>,
    clock: Arc<dyn Clock>,
    view: tokio::sync::watch::Sender<View>,
    /// Set while the gate is closed for going down (and until an "up"
    /// report opens it again).
    closing: AtomicBool,
    /// Held shared by every Redis decision in flight; exclusively by the
    /// going-down flush, which so waits for them.
    deciding: tokio::sync::RwLock<()>,
    /// Fast consumes Redis decided for this instance that are not known to
    /// be in Postgres yet, as journal entries with when they were recorded
    /// (the clock's monotonic reading): kept until the journal stream was
    /// seen empty after them, however long that takes.
    recent: Mutex<VecDeque<(Instant, Fields)>>,
    /// `recent` holds `RECENT_LIMIT` entries: the gate stays closed until
    /// the journal catches up.
    recent_full: AtomicBool,
    /// The journal reads `recent` waits on to pass (each at its monotonic
    /// reading), and those silent members wait on to be retired (each at
    /// its report's time).
    recent_marks: Mutex<DrainMarks<Instant>>,
    retire_marks: Mutex<DrainMarks<DateTime<Utc>>>,
    nudge: tokio::sync::Notify,
    metrics: FleetMetrics,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("instance", &self.instance)
            .field("view", &*self.view.borrow())
            .finish_non_exhaustive()
    }
}

/// A Redis decision may go ahead while this is held.
pub struct RedisGate<'a> {
    _held: tokio::sync::RwLockReadGuard<'a, ()>,
    /// Until when peers still count this instance as a member, by the
    /// report that opened the gate (`None`: with
    /// `fleet.decide_without_postgres` while Postgres fails), on `clock`'s
    /// monotonic reading.
    counted_until: Option<Instant>,
    clock: &'a dyn Clock,
    dataset: Uuid,
}

/// What the lease of this instance's last report allows now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lease {
    /// No report yet, or its lease ran out.
    Out,
    /// Redis may decide by it; peers count this instance until
    /// `counted_until` (`None`: no bound, with `fleet.decide_without_postgres`
    /// while the reports fail on Postgres).
    Held { counted_until: Option<Instant> },
}

impl RedisGate<'_> {
    /// Whether peers still count this instance: checked again when a
    /// decision's reply is in. The script ran before its reply arrived, so a
    /// reply in time proves the decision was made while no peer could have
    /// turned the fleet `redis_down` without this instance; a later one (the
    /// instance was paused, the call stalled) is never answered as made.
    pub fn still_held(&self) -> bool {
        self.counted_until
            .is_none_or(|until| self.clock.monotonic() < until)
    }

    /// The Redis dataset the fleet agreed on: the decision is made only on
    /// it (the consume script checks).
    pub fn dataset(&self) -> Uuid {
        self.dataset
    }
}

/// How long peers count a member after its last report began:
/// `fleet.lease + redis.timeout + 1s`.
pub fn member_timeout(settings: &Settings) -> Duration {
    settings.fleet.lease + settings.redis.timeout + Duration::from_secs(1)
}

/// The journal as one read saw it, on the dataset asked about (or with no
/// dataset checked): its span; `None` when Redis was foreign or the read
/// failed.
fn span_of(seen: &Result<JournalState, FastError>) -> Option<Span> {
    match seen {
        Ok(JournalState::Agreed { span } | JournalState::Unchecked { span }) => Some(*span),
        Ok(JournalState::Foreign) | Err(_) => None,
    }
}

/// One more read for `marks`: marks it when this instance's backlog was
/// empty around it, forgets every mark when Redis was foreign or
/// unreachable; what it found drained.
fn read_marks<T: Copy>(
    marks: &Mutex<DrainMarks<T>>,
    what: T,
    seen: &Result<JournalState, FastError>,
    backlog_empty: bool,
    epoch: i64,
) -> Option<T> {
    let mut marks = marks.lock().unwrap_or_else(|p| p.into_inner());
    match span_of(seen) {
        Some(span) if backlog_empty => marks.read(what, span, epoch),
        Some(span) => marks.read_without_mark(span, epoch),
        None => {
            marks.clear();
            None
        }
    }
}

impl Fleet {
    pub fn new(
        settings: &Settings,
        pool: PgPool,
        deadline: Duration,
        fast: Arc<FastTier>,
        clock: Arc<dyn Clock>,
        metrics: &Metrics,
    ) -> Fleet {
        let lease = settings.fleet.lease;
        let view = View {
            state: FleetState::Normal,
            epoch: 0,
            members: 0,
            redis_down_members: 0,
            unaccounted: 0,
            reported_up: false,
            confirmed: None,
            pg_failing: false,
            dataset: None,
        };
        Fleet {
            instance: Uuid::new_v4(),
            heartbeat: settings.fleet.heartbeat,
            lease,
            decide_without_postgres: settings.fleet.decide_without_postgres,
            member_timeout: member_timeout(settings),
            deadline,
            pool,
            fast,
            clock,
            view: tokio::sync::watch::channel(view).0,
            closing: AtomicBool::new(true),
            deciding: tokio::sync::RwLock::new(()),
            recent: Mutex::new(VecDeque::new()),
            recent_full: AtomicBool::new(false),
            recent_marks: Mutex::new(DrainMarks::default()),
            retire_marks: Mutex::new(DrainMarks::default()),
            nudge: tokio::sync::Notify::new(),
            metrics: FleetMetrics::new(metrics),
        }
    }

    /// This instance's view of the fleet.
    pub fn view(&self) -> View {
        *self.view.borrow()
    }

    /// Whether Redis may decide a fast consume here now; hold the gate
    /// until its answer is in.
    pub fn redis_may_decide(&self) -> Option<RedisGate<'_>> {
        let v = self.view();
        let Lease::Held { counted_until } = self.lease(&v) else {
            return None;
        };
        if !(v.reported_up && v.state == FleetState::Normal) {
            return None;
        }
        let dataset = v.dataset?;
        // A script without a not-after bound could decide any time later,
        // for a caller long gone: Redis decides only once its clock is known.
        if !self.fast.knows_redis_time() {
            return None;
        }
        let held = self.deciding.try_read().ok()?;
        if self.closing.load(Ordering::SeqCst) || self.recent_full.load(Ordering::SeqCst) {
            return None;
        }
        Some(RedisGate {
            _held: held,
            counted_until,
            clock: &*self.clock,
            dataset,
        })
    }

    /// What the lease of the report `v` records allows now (on the clock's
    /// monotonic reading).
    fn lease(&self, v: &View) -> Lease {
        let Some(at) = v.confirmed else {
            return Lease::Out;
        };
        // With `fleet.decide_without_postgres`, reports failing on Postgres
        // keep the gate open, with no bound.
        if v.pg_failing && self.decide_without_postgres {
            return Lease::Held {
                counted_until: None,
            };
        }
        // Membership that cannot be renewed closes the gate: past its
        // lease, peers may stop counting this instance.
        if self.clock.monotonic() >= at + self.lease {
            return Lease::Out;
        }
        // Peers count a member for `member_timeout` after its last report
        // (measured from its commit, which follows the report's start).
        Lease::Held {
            counted_until: Some(at + self.member_timeout),
        }
    }

    /// Records a fast consume Redis decided (its journal entry, with the
    /// time and generation), for the going-down flush.
    pub fn decided_in_redis(&self, _gate: &RedisGate<'_>, entry: Fields) {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        recent.push_back((self.clock.monotonic(), entry));
        if recent.len() >= RECENT_LIMIT {
            self.recent_full.store(true, Ordering::SeqCst);
        }
    }

    /// The journal stream was drained past a read taken after `probe`
    /// (with this instance's backlog of entries not yet appended empty):
    /// every decision recorded before it is in Postgres (an entry leaves
    /// the stream once Postgres has it, and was appended before its
    /// decision was recorded here), so the going-down flush no longer
    /// needs it.
    fn journal_drained_before(&self, probe: Instant) {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        while recent.front().is_some_and(|(at, _)| *at < probe) {
            recent.pop_front();
        }
        if recent.len() < RECENT_LIMIT {
            self.recent_full.store(false, Ordering::SeqCst);
        }
    }

    /// Looks how far the journal is drained (one `MULTI`: the dataset and
    /// the stream's oldest and newest entries; [`DrainMarks`]), see
    /// [`Self::journal_drained_before`]; `false` when Redis holds another
    /// dataset than the fleet agreed on.
    async fn note_journal_progress(&self) -> bool {
        let probe = self.clock.monotonic();
        let view = self.view();
        let backlog_empty = self.fast.journal_backlog_len() == 0;
        let seen = self.fast.journal_state(view.dataset).await;
        let backlog_empty = backlog_empty && self.fast.journal_backlog_len() == 0;
        if let Some(before) =
            read_marks(&self.recent_marks, probe, &seen, backlog_empty, view.epoch)
        {
            self.journal_drained_before(before);
        }
        let foreign = matches!(seen, Ok(JournalState::Foreign));
        self.metrics.foreign.set(i64::from(foreign));
        if foreign && !self.closing.load(Ordering::SeqCst) {
            tracing::warn!("fleet: redis holds another dataset than the fleet agreed on (it restarted empty?): reporting it down until the fleet has written every member's recent decisions to postgres");
        }
        !foreign
    }

    /// A fast decision's script found Redis holding another dataset than
    /// the fleet agreed on: report at once.
    pub fn redis_foreign(&self) {
        self.nudge.notify_one();
    }

    /// The epoch at which Postgres may decide a fast type now, or `None`
    /// (answer 503). When Redis is down for this instance and the fleet has
    /// not agreed yet, this reports at once and waits briefly for the
    /// agreement (a fleet of one agrees at once).
    pub async fn postgres_may_decide(&self) -> Option<i64> {
        let v = self.view();
        if v.state == FleetState::RedisDown {
            return Some(v.epoch);
        }
        if !self.fast.is_down() {
            return None;
        }
        self.nudge.notify_one();
        let mut rx = self.view.subscribe();
        // Two beats and a round trip: a fleet of one agrees within them.
        let wait = (self.heartbeat * 2 + Duration::from_millis(250)).min(Duration::from_secs(2));
        let agreed = tokio::time::timeout(wait, async {
            rx.wait_for(|v| v.state == FleetState::RedisDown)
                .await
                .map(|v| v.epoch)
                .ok()
        })
        .await;
        agreed.ok().flatten()
    }

    /// Reports until `shutdown`, then leaves the fleet.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let changes = self.fast.health().changes();
        loop {
            self.beat().await;
            tokio::select! {
                _ = tokio::time::sleep(self.heartbeat) => {}
                _ = self.nudge.notified() => {}
                _ = changes.notified() => {}
                _ = shutdown.cancelled() => break,
            }
        }
        // Leaving: the gate closes and this instance's Redis decisions not
        // known to be in Postgres go there first, as when going down; else
        // the peers keep waiting for this member until one of them sees
        // the journal empty.
        if !self.go_down().await {
            tracing::warn!("could not write this instance's recent redis decisions to postgres: the fleet keeps waiting for it until the journal drains");
            return;
        }
        if let Err(e) = self.bounded(store::leave(&self.pool, self.instance)).await {
            tracing::warn!(error = %e, "could not leave the fleet: peers wait for this member until the journal drains");
        }
    }

    async fn bounded<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, DurableError>>,
    ) -> Result<T, DurableError> {
        match tokio::time::timeout(self.deadline, f).await {
            Ok(out) => out,
            Err(_) => Err(DurableError::TimedOut(self.deadline)),
        }
    }

    /// One report (see the module docs).
    pub async fn beat(&self) {
        if !self.fast.is_down() {
            self.fast.check().await;
        }
        // Reachable, and (once the fleet agreed on one) on its dataset.
        let reachable = !self.fast.is_down();
        let mut up = reachable;
        if reachable {
            if !self.fast.knows_redis_time() {
                self.fast.learn_redis_time().await;
            }
            up = self.note_journal_progress().await;
        }
        if !up && !self.go_down().await {
            // Postgres did not take the flush: it is failing for us too.
            self.view.send_modify(|v| v.pg_failing = true);
            return;
        }
        let started = self.clock.monotonic();
        let report = self
            .bounded(store::report(
                &self.pool,
                self.instance,
                up,
                self.member_timeout,
            ))
            .await;
        let r = match report {
            Ok(r) => r,
            Err(e) => {
                self.metrics.reports.with_label_values(&["error"]).inc();
                tracing::debug!(error = %e, "fleet report failed");
                self.view.send_modify(|v| v.pg_failing = true);
                return;
            }
        };
        self.metrics.reports.with_label_values(&["ok"]).inc();
        let before = self.view();
        if r.flipped {
            self.metrics
                .episodes
                .with_label_values(&[FleetState::RedisDown.as_str()])
                .inc();
            tracing::warn!(
                epoch = r.epoch,
                members = r.members,
                "fleet: every member reports redis down; postgres decides fast types"
            );
        } else if r.state != before.state && before.confirmed.is_some() {
            tracing::warn!(
                fleet = r.state.as_str(),
                epoch = r.epoch,
                "fleet state changed"
            );
        }
        if up && r.state == FleetState::Normal {
            self.closing.store(false, Ordering::SeqCst);
        }
        let view = View {
            state: r.state,
            epoch: r.epoch,
            members: r.members,
            redis_down_members: r.redis_down_members,
            unaccounted: r.unaccounted,
            reported_up: up,
            confirmed: Some(started),
            pg_failing: false,
            dataset: r.dataset,
        };
        self.metrics.show(&view);
        self.view.send_replace(view);
        if up && r.unaccounted > 0 {
            self.retire_silent(&r).await;
        }
        // A Redis on another dataset is reachable: the episode ends on it.
        if reachable && r.state == FleetState::RedisDown {
            self.end_episode(r.epoch, started).await;
        }
        if reachable && r.dataset.is_none() && r.state == FleetState::Normal {
            self.adopt_dataset().await;
        }
    }

    /// Records a new Redis dataset for a fleet that has none (a new
    /// database, or one from before datasets): written into Redis inside
    /// the Postgres transaction that records it, holding the fleet row.
    async fn adopt_dataset(&self) {
        let tx = match self.bounded(store::begin_adopt(&self.pool)).await {
            Ok(Some(tx)) => tx,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "fleet: could not lock the fleet to record a redis dataset");
                return;
            }
        };
        let dataset = Uuid::new_v4();
        if let Err(e) = self.fast.write_dataset(dataset).await {
            tracing::debug!(error = %e, "fleet: could not write the redis dataset");
            return;
        }
        match self.bounded(store::finish_adopt(tx, dataset)).await {
            Ok(()) => {
                tracing::info!(%dataset, "fleet: redis dataset recorded");
                self.view.send_modify(|v| v.dataset = Some(dataset));
            }
            Err(e) => tracing::debug!(error = %e, "fleet: recording the redis dataset failed"),
        }
    }

    /// Retires the silent members `r` (or an earlier report) found
    /// unaccounted for, once the journal is seen drained past a read taken
    /// after that report ([`DrainMarks`]; it need not ever be seen empty):
    /// their decisions are then in Postgres (see [`store::retire`]).
    async fn retire_silent(&self, r: &store::Report) {
        let backlog_empty = self.fast.journal_backlog_len() == 0;
        let seen = self.fast.journal_state(r.dataset).await;
        let backlog_empty = backlog_empty && self.fast.journal_backlog_len() == 0;
        let Some(counted_at) = read_marks(&self.retire_marks, r.at, &seen, backlog_empty, r.epoch)
        else {
            return;
        };
        match self
            .bounded(store::retire(&self.pool, counted_at, self.member_timeout))
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                members = n,
                "fleet: silent members retired (the journal holds none of their redis decisions)"
            ),
            Err(e) => tracing::debug!(error = %e, "fleet: retiring silent members failed"),
        }
    }

    /// Closes the gate, waits for the Redis decisions in flight and writes
    /// the recent ones to Postgres; `false` when that write failed (the
    /// report waits: reporting down now could let the fleet decide without
    /// them).
    async fn go_down(&self) -> bool {
        self.closing.store(true, Ordering::SeqCst);
        let _all = self.deciding.write().await;
        let entries: Vec<JournalEntry> = {
            let recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            recent
                .iter()
                .enumerate()
                .map(|(i, (_, fields))| fields.entry(format!("recent-{i}")))
                .collect()
        };
        if entries.is_empty() {
            return true;
        }
        match self
            .bounded(crate::journal::apply_entries(&self.pool, &entries))
            .await
        {
            Ok(()) => {
                tracing::info!(
                    entries = entries.len(),
                    "fleet: this instance's recent redis decisions are in postgres"
                );
                self.recent
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clear();
                self.recent_full.store(false, Ordering::SeqCst);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "fleet: recent redis decisions not written to postgres; not reporting redis down yet");
                false
            }
        }
    }

    /// Writes what Postgres decided during the episode to Redis, then ends
    /// it in the transaction that holds the fleet row (see the module docs).
    async fn end_episode(&self, epoch: i64, reported: Instant) {
        let mut written: HashSet<(i64, i64)> = HashSet::new();
        let first = async {
            let mut conn = self.pool.acquire().await?;
            store::queued(&mut conn, epoch).await
        };
        match self.bounded(first).await {
            Ok(rows) => {
                if self.write_back(&rows, &mut written).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "fleet: reading the decisions for redis failed");
                return;
            }
        }
        let ret = match self.bounded(store::begin_return(&self.pool, epoch)).await {
            Ok(Some(ret)) => ret,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "fleet: could not lock the fleet to end the episode");
                return;
            }
        };
        let mut tx = ret.tx;
        let rest = match tokio::time::timeout(self.deadline, store::queued(&mut tx, epoch)).await {
            Ok(Ok(rows)) => rows,
            _ => return,
        };
        if self.write_back(&rest, &mut written).await.is_err() {
            return;
        }
        // Redis holds what Postgres decided: it is the fleet's dataset from
        // this commit (every member's recent decisions are in Postgres).
        let dataset = ret.dataset.unwrap_or_else(Uuid::new_v4);
        if let Err(e) = self.fast.write_dataset(dataset).await {
            tracing::debug!(error = %e, "fleet: could not write the redis dataset; the episode goes on");
            return;
        }
        match self.bounded(store::finish_return(tx, epoch, dataset)).await {
            Ok(next) => {
                self.metrics
                    .episodes
                    .with_label_values(&[FleetState::Normal.as_str()])
                    .inc();
                tracing::info!(
                    epoch = next,
                    written = written.len(),
                    "fleet: redis is back and holds what postgres decided; redis decides fast types again"
                );
                // This instance reported Redis up just before, and the fleet
                // is normal from this commit: its gate opens now, not at its
                // next report (the others' open at theirs).
                self.view.send_modify(|v| {
                    v.state = FleetState::Normal;
                    v.epoch = next;
                    v.redis_down_members = 0;
                    v.confirmed = Some(reported);
                    v.dataset = Some(dataset);
                });
                self.closing.store(false, Ordering::SeqCst);
                self.metrics.show(&self.view());
                self.nudge.notify_one();
            }
            Err(e) => tracing::warn!(error = %e, "fleet: ending the episode failed; retried"),
        }
    }

    /// Writes queued decisions (not written yet) to Redis at their
    /// generations.
    async fn write_back(
        &self,
        rows: &[Queued],
        written: &mut HashSet<(i64, i64)>,
    ) -> Result<(), FastError> {
        for q in rows {
            if written.contains(&(q.id, q.state.gen)) {
                continue;
            }
            let e = &q.state;
            let done = match e.state {
                TokenState::Consumed => self
                    .fast
                    .write_consumed_over(&q.handle, e.gen, &Marker::from(e))
                    .await
                    .map(|_| ()),
                TokenState::Issued => {
                    let remaining = e.expires_at.timestamp_millis() - self.clock.now_ms();
                    self.fast
                        .write_issued(&q.handle, e.gen, remaining)
                        .await
                        .map(|_| ())
                }
            };
            if let Err(err) = done {
                tracing::debug!(error = %err, "fleet: a decision not written to redis; the episode goes on");
                return Err(err);
            }
            written.insert((q.id, e.gen));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    /// A fleet on `clock` that connects to nothing (its pool is lazy, its
    /// Redis tier connects on first use).
    fn fleet_on(clock: &ManualClock, extra: &str) -> Fleet {
        let settings = Settings::from_toml_over_defaults(extra).expect("valid");
        let clock: Arc<dyn Clock> = Arc::new(clock.clone());
        let metrics = Metrics::new();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://ledger@127.0.0.1:1/none")
            .expect("a lazy pool");
        let fast = FastTier::new(
            settings.redis.clone(),
            Arc::new(Metrics::new()),
            clock.clone(),
        );
        Fleet::new(
            &settings,
            pool,
            Duration::from_secs(1),
            fast,
            clock,
            &metrics,
        )
    }

    #[tokio::test]
    async fn the_gate_lease_runs_out_when_the_clock_passes_it() {
        let clock = ManualClock::new(0);
        let fleet = fleet_on(
            &clock,
            "[fleet]\nlease = \"1s\"\n[redis]\ntimeout = \"100ms\"",
        );
        assert_eq!(fleet.lease(&fleet.view()), Lease::Out, "no report yet");
        let at = clock.monotonic();
        fleet.view.send_modify(|v| {
            v.reported_up = true;
            v.confirmed = Some(at);
        });
        // Peers count this instance for lease + redis.timeout + 1s.
        let counted_until = Some(at + Duration::from_millis(2100));
        let held = Lease::Held { counted_until };
        assert_eq!(fleet.lease(&fleet.view()), held);
        // Wall time alone moves nothing.
        clock.advance_ms(60_000);
        clock.advance_monotonic(Duration::from_millis(999));
        assert_eq!(fleet.lease(&fleet.view()), held, "within the lease");
        let gate = RedisGate {
            _held: fleet.deciding.try_read().expect("free"),
            counted_until,
            clock: &*fleet.clock,
            dataset: Uuid::nil(),
        };
        clock.advance_monotonic(Duration::from_millis(1));
        assert_eq!(fleet.lease(&fleet.view()), Lease::Out, "the lease ran out");
        assert!(gate.still_held(), "peers still count this instance");
        clock.advance_monotonic(Duration::from_millis(1100));
        assert!(!gate.still_held(), "peers may have stopped counting it");
    }
}
