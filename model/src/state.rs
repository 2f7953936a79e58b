//! The model's state: instances, Redis, Postgres, clients, messages in
//! flight, and the history of answers the properties are checked against.

/// The fleet's state as recorded in Postgres's `fleet_state` row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fleet {
    /// Redis decides fast consumes (through each instance's gate).
    Normal,
    /// Every counted member reported Redis down: Postgres decides.
    RedisDown,
}

/// An instance's view of the fleet, from its last committed report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct View {
    /// Tick at which its last committed report ran (`None`: never, or since
    /// its restart).
    pub confirmed: Option<u8>,
    /// That report said "Redis up".
    pub reported_up: bool,
    /// That report found Redis reachable, on the fleet's dataset or not
    /// (item 15: a foreign Redis is reported down, and the episode ends on
    /// it). Without item 15's fix, the same as `reported_up`.
    pub redis_reached: bool,
    pub state: Fleet,
    pub epoch: u8,
    /// Its last report, or going-down flush, failed on Postgres.
    pub pg_failing: bool,
    /// The fleet row's dataset id as that report read it (item 15; `None`:
    /// none yet, or never reported).
    pub dataset: Option<u8>,
}

impl Default for View {
    fn default() -> Self {
        View {
            confirmed: None,
            reported_up: false,
            redis_reached: false,
            state: Fleet::Normal,
            epoch: 0,
            pg_failing: false,
            dataset: None,
        }
    }
}

/// A fast consume Redis decided for this instance and answered, kept for the
/// going-down flush (`Fleet::recent` in src/fleet.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Decision {
    pub token: u8,
    pub gen: u8,
    pub rid: u8,
    /// Tick at which the reply was in.
    pub at: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Inst {
    pub alive: bool,
    pub paused: bool,
    /// Its link to Redis is cut.
    pub cut_redis: bool,
    /// Its link to Postgres is cut.
    pub cut_pg: bool,
    pub view: View,
    /// Going down: the gate is closed until a report finds Redis up and the
    /// fleet normal.
    pub closing: bool,
    pub recent: Vec<Decision>,
    /// A going-down beat waits for the calls in flight.
    pub going_down: bool,
    /// Tick of its last heartbeat (an active instance beats every tick).
    pub beat_at: Option<u8>,
}

/// A token's hash in Redis, or its row in Postgres: its generation (odd:
/// consumed) and the winning `request_id` (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Mark {
    pub gen: u8,
    pub rid: u8,
}

impl Mark {
    pub fn consumed(&self) -> bool {
        self.gen % 2 == 1
    }
}

/// A journal entry in the Redis stream: a decision (consume or release) at
/// its generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub token: u8,
    pub mark: Mark,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Redis {
    pub up: bool,
    /// Per token its hash (`None`: no key, after Redis restarted empty; a
    /// consume then misses and Postgres decides).
    pub markers: Vec<Option<Mark>>,
    /// Per token: until when (tick) a release lets nobody consume it
    /// (`ca`, consume.lua's `cooling`).
    pub cooling_until: Vec<Option<u8>>,
    pub journal: Vec<Entry>,
    /// The dataset key (`<prefix>dataset`, item 15): the id the fleet
    /// agreed on, `None` once Redis restarted empty (or before the first).
    pub dataset: Option<u8>,
}

/// A member's last committed report in `fleet_members`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Report {
    pub up: bool,
    pub at: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pg {
    pub up: bool,
    pub rows: Vec<Mark>,
    pub fleet: Fleet,
    pub epoch: u8,
    /// Per instance, its current process's row.
    pub members: Vec<Option<Report>>,
    /// The rows of processes that crashed (sorted): a restarted process is
    /// a new member (`Fleet::new` draws a new instance id), and the old row
    /// stays until it is retired (`Fleet::retire_silent`; one that said
    /// Redis down is forgotten after an hour, beyond the bound).
    pub departed: Vec<Report>,
    /// `redis_resync`: tokens Postgres decided during the episode.
    pub resync: Vec<u8>,
    /// The fleet row's Redis dataset id (`fleet_state.redis_dataset`, item
    /// 15; `None`: none recorded yet).
    pub dataset: Option<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Ready to send (first attempt or a retry after 503).
    Ready,
    /// Waiting on a script sent by `inst` for its attempt number `try_no`.
    Waiting {
        inst: u8,
        try_no: u8,
        deadline: u8,
        /// Until when the gate says peers count the instance (`None`: no
        /// limit, item 2 before its fix).
        counted_until: Option<u8>,
        /// Until when peers really count it: its report that opened the
        /// gate plus the member timeout.
        member_until: u8,
    },
    /// Answered `consumed` at this generation.
    Won { gen: u8 },
    /// Won, then released the token.
    Released,
    /// Finished without winning: `duplicate`, or `token_invalid`.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    pub token: u8,
    /// Its `request_id` (1-based; 0 means none).
    pub rid: u8,
    pub tries: u8,
    pub phase: Phase,
}

impl Client {
    /// Still retrying: a retry with its `request_id` would learn a win.
    pub fn retrying(&self) -> bool {
        matches!(self.phase, Phase::Ready | Phase::Waiting { .. })
    }
}

/// A consume script on its way to Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Script {
    pub inst: u8,
    pub client: u8,
    pub try_no: u8,
    pub token: u8,
    pub rid: u8,
    /// The caller's deadline (it answers 503 after it).
    pub deadline: u8,
    /// The script carries the deadline as its not-after bound (item 6).
    pub bounded: bool,
    /// Held in a stalled link: may arrive after its deadline.
    pub stalled: bool,
    /// The dataset id of the sender's view (item 15): Redis decides only
    /// on it.
    pub dataset: Option<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The script consumed the token at this generation.
    Won { gen: u8 },
    /// A consumed marker was there (`stale`: while the token's newest
    /// decision elsewhere was a release).
    Consumed { gen: u8, rid: u8, stale: bool },
    /// It ran past its not-after bound and wrote nothing.
    Late,
    /// No key (Redis restarted empty): nothing written; Postgres decides.
    Miss,
    /// Redis holds another dataset than the script's (item 15): nothing
    /// written, answered 503.
    Foreign,
}

/// A script's reply on its way back to the instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReplyMsg {
    pub inst: u8,
    pub client: u8,
    pub try_no: u8,
    pub outcome: Outcome,
}

/// Which tier decided an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Redis,
    Postgres,
}

/// A `consumed` answer given to a client (a first win or a replay).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Answer {
    pub token: u8,
    pub gen: u8,
    pub rid: u8,
    pub via: Tier,
    /// The instance that answered (`NOBODY` once it crashed: its memory of
    /// the answer is gone).
    pub by: u8,
    /// A first win (not a replay of a win to its `request_id`).
    pub first: bool,
}

/// `Answer::by` of an instance that crashed since.
pub const NOBODY: u8 = u8::MAX;

/// Issuance, for the bloom filter (only with `Config::filter`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Issued {
    /// The millisecond (tick) stamped in its id, by the issuer's clock.
    pub ts: u8,
    /// Which instances' filters hold it (a peer hears of it once its record
    /// committed; a mark is notified after its ids, so a peer that does not
    /// hold it knows no mark at or above it).
    pub known: Vec<bool>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub now: u8,
    pub faults_used: u8,
    pub insts: Vec<Inst>,
    pub redis: Redis,
    pub pg: Pg,
    pub clients: Vec<Client>,
    pub scripts: Vec<Script>,
    pub replies: Vec<ReplyMsg>,
    pub issued: Vec<Issued>,
    /// The issuer's clock runs ahead (fault).
    pub issuer_skewed: bool,
    /// Every `consumed` answer given (sorted, no repeats).
    pub answers: Vec<Answer>,
    /// A genuinely issued token was refused as forged.
    pub refused_genuine: bool,
    /// A Redis win was answered `consumed` after the peers may have stopped
    /// counting the instance (guarantee 9).
    pub won_outside_membership: bool,
    /// An instance reported Redis down while a win Redis decided for it and
    /// it answered was not in Postgres (the going-down flush missed it).
    pub flush_missed: bool,
    /// A client was answered `duplicate` while the token's newest decision
    /// anywhere was a release (or none).
    pub false_duplicate: bool,
}

impl State {
    /// The newest decision about `token` anywhere (Redis's marker, the
    /// journal, Postgres's row): the highest generation.
    pub fn newest(&self, token: u8) -> Mark {
        let t = token as usize;
        let mut best = self.redis.markers[t].unwrap_or_default();
        let row = self.pg.rows[t];
        if row.gen > best.gen {
            best = row;
        }
        for e in self.redis.journal.iter().filter(|e| e.token == token) {
            if e.mark.gen > best.gen {
                best = e.mark;
            }
        }
        best
    }
}
