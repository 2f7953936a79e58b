//! The checker against the protocol: each fix of issue 24 (items 2 to 6)
//! and of the faults added since (item 15: Redis restarts empty) undone is
//! found, today's protocol is checked under every kind of fault, and what
//! the model finds in today's protocol is pinned (model/README.md,
//! "Findings"). `MODEL_DEPTH=N` adds N ticks to every bound.

use idempotency_ledger_model::properties::*;
use idempotency_ledger_model::{explore, scenarios, Config, Faults, Outcome, Protocol, StopAt};

/// Extra ticks of logical time from `MODEL_DEPTH` (0 by default).
fn extra_depth() -> u8 {
    std::env::var("MODEL_DEPTH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn deeper(mut cfg: Config) -> Config {
    cfg.max_time = cfg.max_time.saturating_add(extra_depth());
    cfg
}

fn run(cfg: Config, stop: StopAt) -> Outcome {
    let out = explore(deeper(cfg), stop);
    println!(
        "{} states ({} distinct), depth {}, {:.1?}",
        out.states, out.unique_states, out.max_depth, out.elapsed
    );
    out
}

/// The checker finds a counterexample of `property`; prints it.
fn assert_found(out: &Outcome, property: &'static str) {
    let Some((path, _)) = out.discoveries.get(property) else {
        panic!(
            "no counterexample of {property:?}; found {:?}",
            out.violations()
        );
    };
    assert!(!path.is_empty(), "{property:?}: empty path");
    println!("{}", out.describe(property));
}

fn assert_holds(out: &Outcome, properties: &[&'static str]) {
    for p in properties {
        assert!(
            !out.discoveries.contains_key(p),
            "today's protocol violates {p:?}:\n{}",
            out.describe(p)
        );
    }
}

#[test]
fn finds_item_2_partition_two_deciders_without_the_fix() {
    // {instance + Redis} | {Postgres + the other}: the cut-off member keeps
    // deciding past its membership, the fleet turns redis_down without it.
    let out = run(
        scenarios::item_2(Protocol::without_fix(2)),
        StopAt::First(LEASE_HELD),
    );
    assert_found(&out, LEASE_HELD);
    // Before the fix the fleet did not account for silent members either:
    // the others then decided in Postgres what the cut-off member decided.
    let before = Protocol {
        account_for_silent_members: false,
        ..Protocol::without_fix(2)
    };
    let out = run(scenarios::item_2(before), StopAt::Everything);
    assert_found(&out, NO_ACK_LOST);
    let today = run(scenarios::item_2(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
}

#[test]
fn finds_item_3_pg_outage_then_redis_outage_without_the_fix() {
    // The going-down flush wrote only the last window's decisions: after a
    // Postgres outage longer than the window, Postgres misses some.
    let out = run(
        scenarios::item_3(Protocol::without_fix(3)),
        StopAt::Everything,
    );
    assert_found(&out, FLUSH_COMPLETE);
    assert_found(&out, NO_ACK_LOST);
    let today = run(scenarios::item_3(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &[LEASE_HELD, FLUSH_COMPLETE]);
}

#[test]
fn finds_item_4_paused_member_outlives_its_lease_without_the_fix() {
    // A win whose reply comes in after the peers stopped counting the
    // (paused) instance is answered `consumed`.
    let out = run(
        scenarios::item_4(Protocol::without_fix(4)),
        StopAt::Everything,
    );
    assert_found(&out, LEASE_HELD);
    // With the silent member unaccounted for too, as before both fixes.
    let before = Protocol {
        account_for_silent_members: false,
        ..Protocol::without_fix(4)
    };
    let out = run(scenarios::item_4(before), StopAt::Everything);
    assert_found(&out, NO_ACK_LOST);
    let today = run(scenarios::item_4(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
}

#[test]
fn finds_item_5_real_token_refused_as_forged_without_the_fix() {
    let out = run(
        scenarios::item_5(Protocol::without_fix(5)),
        StopAt::First(GENUINE_NEVER_FORGED),
    );
    assert_found(&out, GENUINE_NEVER_FORGED);
    let today = run(scenarios::item_5(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
    assert!(today.discoveries.contains_key(SOMETIMES_CONSUMED));
}

#[test]
fn finds_item_6_late_script_burns_released_token_without_the_fix() {
    let out = run(
        scenarios::item_6(Protocol::without_fix(6)),
        StopAt::First(NO_BURNED_TOKEN),
    );
    assert_found(&out, NO_BURNED_TOKEN);
    let today = run(scenarios::item_6(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
    for example in [SOMETIMES_RELEASED, SOMETIMES_LATE, SOMETIMES_RETRY_WINS] {
        assert!(today.discoveries.contains_key(example), "{example}");
    }
}

/// Every kind of fault, one per run, with issuance, the filter and
/// releases: about a minute and a half in a release build, 55 million
/// states (12 million distinct), so not in the suite's default run
/// (`cargo test -p idempotency-ledger-model --release -- --ignored`); the
/// default run covers a crash in `finds_f3_…`.
#[test]
#[ignore = "about a minute and a half: cargo test -p idempotency-ledger-model --release -- --ignored"]
fn todays_protocol_holds_every_property() {
    let out = run(
        scenarios::everything(Protocol::TODAY, 2, 1),
        StopAt::Everything,
    );
    for p in out.violations() {
        println!("{}", out.describe(p));
    }
    assert_holds(&out, &ALWAYS);
}

/// Today's protocol under every kind of fault but a crash (the crash is
/// explored in `finds_f3_…`, and with the rest in the ignored test above),
/// one per run, with issuance, the filter and releases; and the model is
/// not vacuous.
#[test]
fn todays_protocol_holds_every_property_under_every_fault_but_a_crash() {
    let mut cfg = scenarios::everything(Protocol::TODAY, 2, 1);
    cfg.faults = Faults {
        crash: false,
        ..cfg.faults
    };
    let out = run(cfg, StopAt::Everything);
    assert_holds(&out, &ALWAYS);
    for example in [SOMETIMES_CONSUMED, SOMETIMES_RELEASED, SOMETIMES_RETRY_WINS] {
        assert!(out.discoveries.contains_key(example), "{example}");
    }
}

/// Finding F1, fixed: one partition, {instance + Redis} | {Postgres + the
/// other}. Redis wins the cut-off member answered (before the partition,
/// not yet drained, or within its lease after it) were in Redis's journal
/// only; nobody could flush them, the others turned the fleet redis_down
/// after the member timeout and Postgres decided those tokens again. The
/// fleet now accounts for silent members (`account_for_silent_members`).
#[test]
fn finds_f1_a_partition_strands_redis_wins_without_the_fix() {
    let before = Protocol::without_fix(11);
    let out = run(scenarios::item_2(before), StopAt::Everything);
    assert_found(&out, NO_ACK_LOST);
    let mut two = scenarios::item_2(before);
    two.clients = vec![0, 0];
    two.max_time = 3;
    let out = run(two, StopAt::First(ONE_WINNER));
    assert_found(&out, ONE_WINNER);

    let today = run(scenarios::item_2(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
    let mut two = scenarios::item_2(Protocol::TODAY);
    two.clients = vec![0, 0];
    two.max_time = 3;
    assert_holds(&run(two, StopAt::Everything), &ALWAYS);
}

/// Finding F2, fixed: one Redis outage. A win whose reply timed out, then
/// answered to the caller's retry as a replay (on any instance), was in no
/// instance's going-down flush; the fleet turned redis_down before the
/// journal drained and Postgres decided the token for another caller.
/// Replays are now flushed as wins are (`flush_replayed_wins`).
#[test]
fn finds_f2_a_replayed_win_not_flushed_without_the_fix() {
    let cfg = |protocol| Config {
        protocol,
        faults: Faults {
            redis_outage: true,
            max_faults: 1,
            ..Faults::none()
        },
        max_time: 3,
        ..Config::small()
    };
    let out = run(cfg(Protocol::without_fix(12)), StopAt::First(ONE_WINNER));
    assert_found(&out, ONE_WINNER);
    let today = run(cfg(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
}

/// Finding F3, fixed: one crash. The killed instance's script was still
/// on its way (within its caller's deadline); the client, whose connection
/// broke, retried elsewhere, won and released; the dead instance's script
/// then consumed the released token for nobody. For `redis.timeout` after a
/// release nobody consumes the token now (`release_waits_out_scripts`).
#[test]
fn finds_f3_a_dead_instance_s_script_burns_a_released_token_without_the_fix() {
    let cfg = |protocol| Config {
        protocol,
        release: true,
        clients: vec![0],
        faults: Faults {
            crash: true,
            max_faults: 1,
            ..Faults::none()
        },
        max_time: 3,
        ..Config::small()
    };
    let out = run(
        cfg(Protocol::without_fix(13)),
        StopAt::First(NO_BURNED_TOKEN),
    );
    assert_found(&out, NO_BURNED_TOKEN);
    let today = run(cfg(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
    assert!(today.discoveries.contains_key(SOMETIMES_RELEASED));
}

/// Finding F4, fixed: one Redis outage. A release Redis decided
/// (journaled, not yet drained) was in nobody's going-down flush, which
/// wrote consumes only: while the fleet was redis_down, Postgres held the
/// token consumed and answered `duplicate` to a consume of the released
/// token. Releases now pass the gate and are flushed
/// (`releases_through_gate`).
#[test]
fn finds_f4_a_release_not_drained_without_the_fix() {
    let cfg = |protocol| Config {
        protocol,
        release: true,
        faults: Faults {
            redis_outage: true,
            max_faults: 1,
            ..Faults::none()
        },
        max_time: 2,
        ..Config::small()
    };
    let out = run(
        cfg(Protocol::without_fix(14)),
        StopAt::First(NO_FALSE_DUPLICATE),
    );
    assert_found(&out, NO_FALSE_DUPLICATE);
    let today = run(cfg(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
}

/// Item 15: Redis restarts empty, so quickly that no instance saw it down.
/// Before the fix the emptied Redis decides on: a winner's consumed marker
/// and journal entry are gone (and `note_journal_progress` reads the
/// missing stream's length as 0, so the instance drops the win from its
/// going-down flush), a later consume misses in Redis, Postgres holds the
/// token live and decides it again for another `request_id`. With the
/// dataset id (`redis_dataset`) the empty Redis is foreign: it decides
/// nothing, the instances report it down after flushing their recent
/// decisions, and the episode's end writes the id back.
#[test]
fn finds_item_15_redis_restarted_empty_decides_again_without_the_fix() {
    let out = run(
        scenarios::item_15(Protocol::without_fix(15)),
        StopAt::First(ONE_WINNER),
    );
    assert_found(&out, ONE_WINNER);
    let today = run(scenarios::item_15(Protocol::TODAY), StopAt::Everything);
    assert_holds(&today, &ALWAYS);
    // The restart is lived through: an episode (the only fault here is the
    // restart), Postgres deciding, then Redis again, releases.
    for example in [
        SOMETIMES_REDIS_DOWN,
        SOMETIMES_PG_DECIDES,
        SOMETIMES_REDIS_BACK,
        SOMETIMES_RELEASED,
        SOMETIMES_RETRY_WINS,
    ] {
        assert!(today.discoveries.contains_key(example), "{example}");
    }
}

/// Item 15, deeper: Redis restarts empty and a second fault of another
/// kind strikes in the same run (one kind per run, each kind but a crash):
/// every property holds. About 8 minutes in a release build (the partition
/// alone 4, 44 million states; 9 GB), so not in the default run. A crash
/// with the restart holds too (the crashed process's row waits for an
/// operator), but needs 103 million states and 15 minutes: run by hand.
#[test]
#[ignore = "about 8 minutes: cargo test -p idempotency-ledger-model --release -- --ignored item_15"]
fn item_15_holds_with_a_second_fault_of_each_kind_but_a_crash() {
    type AddFault = fn(&mut Faults);
    let kinds: [(&str, AddFault); 8] = [
        ("pause", |f| f.pause = true),
        ("partition", |f| f.partition = true),
        ("cut_redis", |f| f.cut_redis = true),
        ("cut_pg", |f| f.cut_pg = true),
        ("lost_reply", |f| f.lost_reply = true),
        ("stall", |f| f.stall = true),
        ("pg_outage", |f| f.pg_outage = true),
        ("redis_outage", |f| f.redis_outage = true),
    ];
    for (kind, add) in kinds {
        let mut cfg = scenarios::item_15(Protocol::TODAY);
        add(&mut cfg.faults);
        cfg.faults.max_faults = 2;
        cfg.max_time = 3;
        println!("a restart and {kind}:");
        let out = run(cfg, StopAt::Everything);
        assert_holds(&out, &ALWAYS);
    }
}
