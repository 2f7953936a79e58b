//! The configurations the tests and the `model` binary explore: one scoped
//! run per fix of issue 24 and per fix of a fault added since (only the
//! faults its counterexample needs), and today's protocol under every kind
//! of fault.

use crate::config::{Config, Faults, Protocol};

/// Item 2: one partition, {instance 0 + Redis} | {Postgres + instance 1}.
pub fn item_2(protocol: Protocol) -> Config {
    Config {
        protocol,
        faults: Faults {
            partition: true,
            max_faults: 1,
            ..Faults::none()
        },
        max_time: 4,
        clients: vec![0],
        ..Config::small()
    }
}

/// Item 3: a Postgres outage, then a Redis outage.
pub fn item_3(protocol: Protocol) -> Config {
    Config {
        protocol,
        faults: Faults {
            pg_outage: true,
            redis_outage: true,
            max_faults: 2,
            ..Faults::none()
        },
        max_time: 4,
        clients: vec![0],
        ..Config::small()
    }
}

/// Item 4: a paused member while its peers lose Redis.
pub fn item_4(protocol: Protocol) -> Config {
    Config {
        protocol,
        faults: Faults {
            pause: true,
            cut_redis: true,
            max_faults: 2,
            ..Faults::none()
        },
        max_time: 4,
        clients: vec![0],
        ..Config::small()
    }
}

/// Item 5: an issuer whose clock runs ahead; one client on the peer.
pub fn item_5(protocol: Protocol) -> Config {
    Config {
        protocol,
        filter: true,
        clients: vec![0],
        faults: Faults {
            clock_skew: true,
            max_faults: 1,
            ..Faults::none()
        },
        max_time: 4,
        ..Config::small()
    }
}

/// Item 6: a script held in a stalled link; its caller retries, wins and
/// releases the token.
pub fn item_6(protocol: Protocol) -> Config {
    Config {
        protocol,
        release: true,
        clients: vec![0],
        faults: Faults {
            stall: true,
            max_faults: 1,
            ..Faults::none()
        },
        max_time: 4,
        ..Config::small()
    }
}

/// Item 15: Redis restarts empty, unseen; two clients race one token, and
/// a winner may release it. Within 2 ticks the fleet lives through the
/// restart: a script refused as foreign, the episode, its end writing the
/// dataset back, Redis deciding again, and a consume and a release that
/// miss in Redis decided by Postgres.
pub fn item_15(protocol: Protocol) -> Config {
    Config {
        protocol,
        release: true,
        faults: Faults {
            redis_restart: true,
            max_faults: 1,
            ..Faults::none()
        },
        max_time: 2,
        ..Config::small()
    }
}

/// The scoped run of `item` (2 to 6, 15).
pub fn item(item: u8, protocol: Protocol) -> Option<Config> {
    match item {
        2 => Some(item_2(protocol)),
        3 => Some(item_3(protocol)),
        4 => Some(item_4(protocol)),
        5 => Some(item_5(protocol)),
        6 => Some(item_6(protocol)),
        15 => Some(item_15(protocol)),
        _ => None,
    }
}

/// Today's protocol under every kind of fault, `max_faults` of them, time
/// up to `max_time`.
pub fn everything(protocol: Protocol, max_time: u8, max_faults: u8) -> Config {
    Config {
        protocol,
        release: true,
        filter: true,
        faults: Faults::all(max_faults),
        max_time,
        ..Config::small()
    }
}
