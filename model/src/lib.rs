//! A model of the ledger's consume protocol for fast biz types (Redis
//! decides, Postgres receives a journal) and of the fleet's switch to
//! Postgres deciding (`redis_down`), checked with the `stateright` model
//! checker under crashes, pauses, partitions, lost replies, late scripts,
//! tier outages, Redis restarting empty and clock skew. See README.md.

pub mod config;
pub mod model;
pub mod properties;
pub mod scenarios;
pub mod state;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model};

pub use config::{Config, Faults, Protocol, Timing};
pub use model::{Action, ConsumeModel};
pub use state::State;

/// What one exploration found.
#[derive(Debug)]
pub struct Outcome {
    /// States generated and distinct states visited.
    pub states: usize,
    pub unique_states: usize,
    pub max_depth: usize,
    pub elapsed: Duration,
    /// For each property with a discovery (a counterexample of an `always`
    /// property, an example of a `sometimes` one): the actions that reach
    /// it, and the state reached.
    pub discoveries: BTreeMap<&'static str, (Vec<Action>, State)>,
}

impl Outcome {
    /// The `always` properties violated.
    pub fn violations(&self) -> Vec<&'static str> {
        properties::ALWAYS
            .iter()
            .copied()
            .filter(|p| self.discoveries.contains_key(p))
            .collect()
    }

    /// The path to a discovery, one action a line.
    pub fn describe(&self, name: &str) -> String {
        match self.discoveries.get(name) {
            None => format!("{name}: no discovery"),
            Some((actions, last)) => {
                let mut out = format!("{name}: {} steps\n", actions.len());
                for a in actions {
                    out.push_str(&format!("  {a:?}\n"));
                }
                out.push_str(&format!(
                    "  answers: {:?}\n  redis: {:?}\n  postgres: {:?}\n  clients: {:?}\n",
                    last.answers, last.redis, last.pg, last.clients
                ));
                out
            }
        }
    }
}

/// The threads a whole exploration runs on: `MODEL_THREADS`, by default
/// one. On the two shared cores the suite runs on, a second thread made
/// the biggest exploration slower, not faster (`todays_protocol_holds_
/// every_property_under_every_fault_but_a_crash` at `MODEL_DEPTH=1`: 131 s
/// on two threads, 104 s on one; the threads contend for the allocator),
/// and the test harness runs explorations side by side anyway. On a
/// machine of its own, more may pay.
pub fn threads() -> usize {
    std::env::var("MODEL_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(1)
}

/// When an exploration may stop.
#[derive(Clone, Debug)]
pub enum StopAt {
    /// Explore every reachable state within the bound.
    Everything,
    /// Stop at the first counterexample of this `always` property.
    First(&'static str),
}

/// Explores every state reachable under `cfg`, breadth first (with
/// `StopAt::First`, on one thread, so its counterexample is a shortest one;
/// a whole exploration runs on [`threads`] and its paths may be a little
/// longer than the shortest with more than one).
pub fn explore(cfg: Config, stop: StopAt) -> Outcome {
    // One thread keeps breadth first exact (a shortest counterexample).
    let threads = match stop {
        StopAt::First(_) => 1,
        StopAt::Everything => threads(),
    };
    let started = Instant::now();
    let builder = ConsumeModel::new(cfg).checker().threads(threads);
    let builder = match stop {
        StopAt::Everything => builder.finish_when(HasDiscoveries::AllFailures),
        StopAt::First(name) => builder.finish_when(HasDiscoveries::AnyOf([name].into())),
    };
    let checker = builder.spawn_bfs().join();
    let discoveries = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| {
            let last = path.last_state().clone();
            (name, (path.into_actions(), last))
        })
        .collect();
    Outcome {
        states: checker.state_count(),
        unique_states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        elapsed: started.elapsed(),
        discoveries,
    }
}
