//! A model of the ledger's consume protocol for fast biz types (Redis
//! decides, Postgres receives a journal) and of the fleet's switch to
//! Postgres deciding (`redis_down`), checked with the `stateright` model
//! checker under crashes, pauses, partitions, lost replies, late scripts,
//! tier outages and clock skew. See README.md.

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
/// a whole exploration runs on every core and its paths may be a little
/// longer than the shortest).
pub fn explore(cfg: Config, stop: StopAt) -> Outcome {
    // One thread keeps breadth first exact (a shortest counterexample);
    // a whole exploration uses every core.
    let threads = match stop {
        StopAt::First(_) => 1,
        StopAt::Everything => std::thread::available_parallelism().map_or(1, |n| n.get()),
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
