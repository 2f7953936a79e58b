//! What a run of the checker explores: the protocol's switches (one per fix
//! of issue 24, and item 15's for Redis restarting empty), the faults it may inject, the timing in ticks, and the
//! size of the world (instances, tokens, clients).

/// The consume protocol as it is today, or as it was before one of the
/// fixes of issue 24 (items 2 to 6, the model's findings 11 to 14) or item
/// 15 (Redis restarts empty). `Protocol::default()` is today's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Protocol {
    /// Item 2. `true` (fix): a member whose reports fail on Postgres keeps
    /// its gate open only until the lease from its last committed report
    /// runs out. `false` (before): `pg_failing` keeps the gate open with no
    /// time limit (what `fleet.decide_without_postgres = true` still does).
    pub lease_bounds_failing_reports: bool,
    /// Item 3. `true` (fix): the going-down flush writes every Redis
    /// decision not known to be in Postgres (known once the journal stream
    /// was seen empty after it), and Redis stops deciding on an instance
    /// with `recent_limit` of them outstanding. `false` (before): only the
    /// decisions of the last `recent_window` ticks (the old "last 30 s").
    pub flush_every_unapplied: bool,
    /// Item 4. `true` (fix): the lease is checked again when a script's
    /// reply is in; a win that comes back after the peers may have stopped
    /// counting the instance is answered 503. `false` (before): only when
    /// the decision starts.
    pub lease_checked_after_reply: bool,
    /// Item 5. `true` (fix): the bloom filter asks the issuance marks before
    /// the clock. `false` (before): an unknown id stamped more than `grace`
    /// ahead of the local clock is refused before the marks are asked.
    pub filter_marks_first: bool,
    /// Item 6. `true` (fix): a consume script carries its caller's deadline
    /// (not-after, in Redis's clock); past it, it answers `late` and writes
    /// nothing. `false` (before): no bound.
    pub script_not_after: bool,
    /// Found by the model (F1) and the chaos test. `true` (fix): the fleet
    /// turns `redis_down` only when no silent member whose last report said
    /// Redis up is left unaccounted for; a member that reaches Redis
    /// retires such members once it sees the journal empty after the
    /// report that found them silent. `false` (before): a member not seen
    /// within the member timeout is simply not counted.
    pub account_for_silent_members: bool,
    /// Found by the model (F2). `true` (fix): a replay of a win answered
    /// from Redis (`consumed` again to the same `request_id`) is recorded
    /// for the going-down flush as a win is. `false` (before): only a win
    /// whose reply came back in time.
    pub flush_replayed_wins: bool,
    /// Found by the model (F4) and the chaos test. `true` (fix): a release
    /// goes to Redis only through the instance's gate and is recorded for
    /// the going-down flush. `false` (before): to Redis whenever the
    /// instance's view said `normal` and Redis answered, and never flushed.
    pub releases_through_gate: bool,
    /// Found by the model (F3). `true` (fix): for `redis.timeout` after a
    /// release in Redis, nobody consumes the token (`cooling`): a script
    /// sent before the release passes its not-after bound first. `false`
    /// (before): a script of a caller that died or gave up, still within
    /// its deadline, could consume the released token for nobody.
    pub release_waits_out_scripts: bool,
    /// Item 15: Redis restarts empty (the `redis_restart` fault). `true`
    /// (fix): Postgres's fleet row records a dataset id and Redis holds it
    /// (`<prefix>dataset`); a fast consume script carries the id of the
    /// instance's view and decides nothing on another dataset (`foreign`,
    /// answered 503); the journal counts as drained (`recent` dropped,
    /// silent members retired) only on the view's dataset; an instance
    /// that finds Redis foreign reports it down (flushing `recent` first);
    /// the member that ends the episode writes the id back into Redis; the
    /// first member records one while the fleet has none. `false` (before):
    /// an emptied Redis looks drained (`XLEN` 0) and decides on.
    pub redis_dataset: bool,
}

impl Default for Protocol {
    fn default() -> Self {
        Protocol::TODAY
    }
}

impl Protocol {
    /// Every fix on: the protocol of today's `main`.
    pub const TODAY: Protocol = Protocol {
        lease_bounds_failing_reports: true,
        flush_every_unapplied: true,
        lease_checked_after_reply: true,
        filter_marks_first: true,
        script_not_after: true,
        account_for_silent_members: true,
        flush_replayed_wins: true,
        releases_through_gate: true,
        release_waits_out_scripts: true,
        redis_dataset: true,
    };

    /// Today's protocol with the fix of issue 24's `item` (2 to 6, the
    /// model's findings 11 to 14, 15) undone. Any other item gives today's
    /// protocol.
    pub fn without_fix(item: u8) -> Protocol {
        let mut p = Protocol::TODAY;
        match item {
            2 => p.lease_bounds_failing_reports = false,
            3 => p.flush_every_unapplied = false,
            4 => p.lease_checked_after_reply = false,
            5 => p.filter_marks_first = false,
            6 => p.script_not_after = false,
            // The model's own findings, numbered after the review's items.
            11 => p.account_for_silent_members = false,
            12 => p.flush_replayed_wins = false,
            13 => p.release_waits_out_scripts = false,
            14 => p.releases_through_gate = false,
            // Redis restarts empty: the dataset id.
            15 => p.redis_dataset = false,
            _ => {}
        }
        p
    }
}

/// The faults the checker may inject, each an action it may take at any
/// point, up to `max_faults` in one run. Healing (restart, resume, links
/// back, a tier back) is free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Faults {
    /// An instance dies (losing its memory: its view, its unflushed recent
    /// decisions, its calls) and may restart.
    pub crash: bool,
    /// An instance is paused (SIGSTOP, a VM pause): it takes no step while
    /// time advances, then resumes.
    pub pause: bool,
    /// One network partition: {an instance + Redis} | {Postgres + the
    /// other instances}.
    pub partition: bool,
    /// One instance's link to Redis is cut (its scripts and replies wait).
    pub cut_redis: bool,
    /// One instance's link to Postgres is cut.
    pub cut_pg: bool,
    /// A script's reply is lost (the caller times out).
    pub lost_reply: bool,
    /// A script is held in a stalled link: it may reach Redis after its
    /// caller's deadline (late delivery).
    pub stall: bool,
    /// Postgres is unreachable for everyone, then back.
    pub pg_outage: bool,
    /// Redis is unreachable for everyone (paused, dead with persistence),
    /// then back with its data.
    pub redis_outage: bool,
    /// Redis (without persistence) restarts empty between two calls, so
    /// quickly that no instance sees it down: its markers, its journal
    /// stream, its cooling marks and its dataset key are gone.
    pub redis_restart: bool,
    /// The issuer's clock runs ahead of its peers' by `Timing::skew`.
    pub clock_skew: bool,
    /// At most this many faults in one run.
    pub max_faults: u8,
}

impl Faults {
    /// No fault at all.
    pub fn none() -> Faults {
        Faults::default()
    }

    /// Every kind of fault, at most `max_faults` of them.
    pub fn all(max_faults: u8) -> Faults {
        Faults {
            crash: true,
            pause: true,
            partition: true,
            cut_redis: true,
            cut_pg: true,
            lost_reply: true,
            stall: true,
            pg_outage: true,
            redis_outage: true,
            redis_restart: true,
            clock_skew: true,
            max_faults,
        }
    }
}

/// Durations in ticks of the logical clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Timing {
    /// `fleet.lease`: a gate stays open this long after the report that
    /// opened it.
    pub lease: u8,
    /// `redis.timeout`: a caller gives up on a script this long after
    /// sending it (503).
    pub timeout: u8,
    /// Peers count a member this long after its last report:
    /// `fleet.lease + redis.timeout + 1s`.
    pub member_timeout: u8,
    /// Before item 3's fix: the going-down flush covered the decisions of
    /// the last this many ticks (the old 30 s).
    pub recent_window: u8,
    /// Item 3's fix: with this many decisions not known to be in Postgres,
    /// Redis stops deciding on the instance (the real `RECENT_LIMIT`).
    pub recent_limit: u8,
    /// `bloom.grace`.
    pub grace: u8,
    /// How far beyond the grace an id of a known lease above its mark may be
    /// ahead (the real `MAX_AHEAD_MS`, a worker lease's ttl).
    pub max_ahead: u8,
    /// How far the issuer's clock runs ahead under the `clock_skew` fault.
    pub skew: u8,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            lease: 1,
            timeout: 1,
            member_timeout: 3,
            recent_window: 1,
            recent_limit: 2,
            grace: 1,
            max_ahead: 2,
            skew: 2,
        }
    }
}

/// One run of the checker: the world, the protocol, the faults, the bound.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// Instances of the service (2 or 3).
    pub instances: u8,
    /// Fast tokens (1 or 2), all seeded in Redis (live, generation 0).
    pub tokens: u8,
    /// One entry per client: the token it consumes. Each client is one
    /// payment attempt with its own `request_id`, retried on 503.
    pub clients: Vec<u8>,
    /// A client that won may release the token (a fast release script).
    pub release: bool,
    /// Model issuance and the bloom filter: tokens start unissued, instance
    /// 0 issues them, peers learn them through Postgres.
    pub filter: bool,
    /// Logical time runs from 0 to this.
    pub max_time: u8,
    /// Attempts (first send and retries) per client.
    pub max_tries: u8,
    pub protocol: Protocol,
    pub faults: Faults,
    pub timing: Timing,
}

impl Config {
    /// Two instances, one token raced by two clients, today's protocol, no
    /// faults; the tests change what they need.
    pub fn small() -> Config {
        Config {
            instances: 2,
            tokens: 1,
            clients: vec![0, 0],
            release: false,
            filter: false,
            max_time: 4,
            max_tries: 2,
            protocol: Protocol::TODAY,
            faults: Faults::none(),
            timing: Timing::default(),
        }
    }
}
