//! The properties the checker verifies in every reachable state: the
//! guarantees of docs/design.md as invariants (`always`), and examples that
//! show the model is not vacuous (`sometimes`).

use stateright::Property;

use crate::model::ConsumeModel;
use crate::state::{Fleet, Phase, State, Tier};

/// Guarantees 1 and 8 (for fast types, within the faults the model injects):
/// at most one `request_id` is ever answered `consumed` per (token,
/// generation).
pub const ONE_WINNER: &str = "at most one winner per token generation";
/// Guarantees 8 and 9: when the fleet decides in Postgres, Postgres knows
/// every consume Redis answered `consumed`, so it never lets a second
/// consume win that generation.
pub const NO_ACK_LOST: &str = "no acknowledged decision lost";
/// Guarantees 3 and 14: a token consumed at its newest generation was
/// answered `consumed` to that generation's `request_id`, or its client is
/// still retrying (and will learn it): a late script never consumes a token
/// for nobody.
pub const NO_BURNED_TOKEN: &str = "no burned token";
/// Guarantee 3 (and the "no burned token" of issue 24): `duplicate` is never
/// answered while the token's newest decision anywhere is a release (or
/// none): a released token stays consumable.
pub const NO_FALSE_DUPLICATE: &str = "no false duplicate";
/// Guarantee 5's other side: a genuinely issued token is never refused as
/// forged by the filter.
pub const GENUINE_NEVER_FORGED: &str = "a genuine token is never refused as forged";

/// Guarantee 9: a win Redis decided is answered `consumed` only while the
/// peers still count the instance (its report that opened the gate plus the
/// member timeout).
pub const LEASE_HELD: &str = "a redis win is answered only while the instance is a member";
/// Operations, "Fast types and the fleet's agreement": before an instance
/// reports Redis down, Postgres knows every consume Redis decided for it
/// and it answered.
pub const FLUSH_COMPLETE: &str = "going down, an instance's redis wins are in postgres";

/// Every `always` property, by name.
pub const ALWAYS: [&str; 7] = [
    ONE_WINNER,
    NO_ACK_LOST,
    NO_BURNED_TOKEN,
    NO_FALSE_DUPLICATE,
    GENUINE_NEVER_FORGED,
    LEASE_HELD,
    FLUSH_COMPLETE,
];

pub const SOMETIMES_CONSUMED: &str = "sometimes a token is consumed";
pub const SOMETIMES_REDIS_DOWN: &str = "sometimes the fleet is redis_down";
pub const SOMETIMES_PG_DECIDES: &str = "sometimes postgres decides a fast consume";
pub const SOMETIMES_RELEASED: &str = "sometimes a token is released";
pub const SOMETIMES_LATE: &str = "sometimes a script reaches redis after its caller's deadline";
pub const SOMETIMES_RETRY_WINS: &str = "sometimes a retry after a 503 wins";
/// The fleet came back: Redis decides a token at a later generation than
/// one Postgres decided (an episode ended, and Redis holds what Postgres
/// decided).
pub const SOMETIMES_REDIS_BACK: &str =
    "sometimes redis decides a token again after postgres decided it";

fn one_winner(_: &ConsumeModel, s: &State) -> bool {
    s.answers.iter().all(|a| {
        s.answers
            .iter()
            .all(|b| a.token != b.token || a.gen != b.gen || a.rid == b.rid)
    })
}

fn no_ack_lost(_: &ConsumeModel, s: &State) -> bool {
    s.pg.fleet != Fleet::RedisDown
        || s.answers
            .iter()
            .filter(|a| a.via == Tier::Redis)
            .all(|a| s.pg.rows[a.token as usize].gen >= a.gen)
}

fn no_burned_token(_: &ConsumeModel, s: &State) -> bool {
    (0..s.redis.markers.len()).all(|t| {
        let newest = s.newest(t as u8);
        if !newest.consumed() {
            return true;
        }
        // Someone was told they won this generation (two conflicting
        // decisions of one generation are the first property's concern).
        let answered = s
            .answers
            .iter()
            .any(|a| a.token as usize == t && a.gen == newest.gen);
        let retrying = s
            .clients
            .iter()
            .any(|c| c.rid == newest.rid && c.retrying());
        answered || retrying
    })
}

fn no_false_duplicate(_: &ConsumeModel, s: &State) -> bool {
    !s.false_duplicate
}

fn genuine_never_forged(_: &ConsumeModel, s: &State) -> bool {
    !s.refused_genuine
}

fn lease_held(_: &ConsumeModel, s: &State) -> bool {
    !s.won_outside_membership
}

fn flush_complete(_: &ConsumeModel, s: &State) -> bool {
    !s.flush_missed
}

fn sometimes_consumed(_: &ConsumeModel, s: &State) -> bool {
    !s.answers.is_empty()
}

fn sometimes_redis_down(_: &ConsumeModel, s: &State) -> bool {
    s.pg.fleet == Fleet::RedisDown
}

fn sometimes_pg_decides(_: &ConsumeModel, s: &State) -> bool {
    s.answers.iter().any(|a| a.via == Tier::Postgres)
}

fn sometimes_released(_: &ConsumeModel, s: &State) -> bool {
    s.clients.iter().any(|c| c.phase == Phase::Released)
}

fn sometimes_late(_: &ConsumeModel, s: &State) -> bool {
    s.scripts.iter().any(|x| x.stalled && s.now > x.deadline)
}

fn sometimes_retry_wins(_: &ConsumeModel, s: &State) -> bool {
    s.clients
        .iter()
        .any(|c| c.tries > 1 && matches!(c.phase, Phase::Won { .. }))
}

fn sometimes_redis_back(_: &ConsumeModel, s: &State) -> bool {
    s.answers.iter().any(|a| {
        a.via == Tier::Redis
            && a.first
            && s.answers
                .iter()
                .any(|b| b.via == Tier::Postgres && b.token == a.token && b.gen < a.gen)
    })
}

/// Every property the checker evaluates.
pub fn all() -> Vec<Property<ConsumeModel>> {
    vec![
        Property::always(ONE_WINNER, one_winner),
        Property::always(NO_ACK_LOST, no_ack_lost),
        Property::always(NO_BURNED_TOKEN, no_burned_token),
        Property::always(NO_FALSE_DUPLICATE, no_false_duplicate),
        Property::always(GENUINE_NEVER_FORGED, genuine_never_forged),
        Property::always(LEASE_HELD, lease_held),
        Property::always(FLUSH_COMPLETE, flush_complete),
        Property::sometimes(SOMETIMES_CONSUMED, sometimes_consumed),
        Property::sometimes(SOMETIMES_REDIS_DOWN, sometimes_redis_down),
        Property::sometimes(SOMETIMES_PG_DECIDES, sometimes_pg_decides),
        Property::sometimes(SOMETIMES_RELEASED, sometimes_released),
        Property::sometimes(SOMETIMES_LATE, sometimes_late),
        Property::sometimes(SOMETIMES_RETRY_WINS, sometimes_retry_wins),
        Property::sometimes(SOMETIMES_REDIS_BACK, sometimes_redis_back),
    ]
}
