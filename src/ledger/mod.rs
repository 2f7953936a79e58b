//! The ledger: issue, consume, result and release, the payment path's use of
//! both tiers, and so the owner of the consume protocol (the fleet, the
//! journal drainer and reconcile hold both tiers too, for their own jobs):
//!
//! 1. verify the token (tag, binding, biz type) and ask the fleet's filter of
//!    issued ids ([`crate::issuance::filter`]) whether it was ever issued: no I/O;
//! 2. Redis, one script: a consumed marker answers `duplicate` at once (for
//!    a durable type only a plain duplicate, and without a result only while
//!    the marker is younger than `redis.processing_trust`; the winner's retry
//!    is confirmed by Postgres); for a durable type an unconsumed token gets a
//!    provisional marker (ours, with a deadline) and Postgres decides; for a
//!    fast type Redis decides, at the next generation;
//! 3. Postgres, one statement (durable types, or when Redis does not know the
//!    token): the primary key decides first use, `now()` decides expiry, and
//!    the token moves to its next generation;
//! 4. Redis learns the decision afterwards, off the answer's path, at the
//!    generation Postgres decided: a write-back applies only over an older
//!    generation. A provisional marker past its deadline counts as absent, so
//!    a crash between 2 and 4 never burns a token.
//!
//! A result is written to Redis before its answer (read your writes).
//!
//! Degraded modes ([`crate::fast::breaker`]): while Redis is slow a sample of durable
//! consumes skips step 2; while it is down durable consumes skip it, and fast
//! consumes go to Postgres behind a per-instance cache and rate limit (or, with
//! Postgres down too, are decided by this instance alone); what Redis missed
//! meanwhile is written to it when it is back.
//!
//! The components, each owning its state, built by [`crate::startup`] and
//! handed to [`Ledger::new`] with the tiers, the fleet and the filter:
//! - `verify`: the [`Verifier`]: step 1, the checks of a presented token
//!   (tag, the fleet's filter, biz type known and granted, binding). No I/O;
//! - `issue`: the [`Issuer`]: issuing, its rate limits, the signed token,
//!   its issuance record and its Redis seed;
//! - `catch_up`: the [`CatchUp`]: what Redis misses while it is skipped
//!   (the cache and rate limit of fast consumes without it), the queue of
//!   writes replayed when it is back, and the pipelined write-backs;
//! - `core`: the [`Ledger`], the consume protocol's owner: the components
//!   and the tiers it runs over; issuing and verifying are handed to the
//!   components.
//!
//! The protocol's files, each an `impl Ledger` over `core`:
//! - `consume`: steps 2 to 4, written once for tokens and keys, talking to
//!   Redis through one reply type per operation (claim, decide, peek), with
//!   `classify` and `answer_from_row`, which turn what an earlier consume
//!   left behind into an answer;
//! - `degraded`: fast consumes while Redis is skipped (Postgres decides, or
//!   this instance alone);
//! - `orders`: the token of an order event, consumed in the order's
//!   transaction;
//! - `result`: result and release (of a token or a client key), a client's
//!   and an operator's;
//! - `read`: a token's state, read without changing anything;
//! - `keys`: client-supplied keys (`/v1/keys`): a key that belongs to
//!   (client, biz type) instead of a signed token, handed to the same
//!   consume, result and release;
//! - `wait`: consumes that wait for the winner's result (`wait_ms`);
//! - `lease`: processing leases and the sweeps that release what ran out.
//!
//! And what they share, importing none of the above:
//! - [`api`]: what callers pass and get back, and [`LedgerError`];
//! - `held`: what an operation acts on, a token or a client key, and what
//!   differs between the two in a consume;
//! - `settle`: step 4's write-backs of consumed states, pipelined (owned by
//!   the `CatchUp`);
//! - `resync`: the queue of Redis writes waiting for Redis;
//! - `util`: milliseconds, `Tally`, counting a consume outcome.
//!
//! The `use super::` edges between these files form a DAG: `api`, `held`,
//! `resync` and `util` are leaves; `verify`, `issue`, `settle` and
//! `catch_up` import only leaves (and `settle`); `core` imports the
//! components; the protocol's files import `core` and each other (`keys`
//! and `degraded` import `consume`, `wait` imports `consume` and `keys`,
//! `read` imports `lease`), never the other way.

pub mod api;
mod catch_up;
mod consume;
mod core;
mod degraded;
mod held;
mod issue;
mod keys;
mod lease;
mod orders;
mod read;
mod result;
mod resync;
mod settle;
mod util;
mod verify;
mod wait;
pub use lease::{run_sweeps, uncertain_metric, SweepReport};
pub use wait::MAX_WAIT;

pub use crate::durable::keys::KeyState;
pub use api::{
    AnswerOutcome, ConsumeAnswer, ConsumeInput, ConsumeOutcome, DuplicateStatus, Issued,
    LedgerError, ResultAnswer, TokenReading,
};
pub use catch_up::CatchUp;
pub use core::Ledger;
pub use issue::Issuer;
pub use keys::KeyInput;
pub use orders::OrderToken;
pub use verify::Verifier;
