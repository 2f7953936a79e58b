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
//! The files follow the protocol:
//! - [`api`]: what callers pass and get back, and [`LedgerError`];
//! - `core`: the [`Ledger`] itself and the checks every operation shares
//!   (step 1);
//! - `issue`: issuing, its rate limit and the Redis seed;
//! - `held`: what an operation acts on, a token or a client key, and what
//!   differs between the two in a consume;
//! - `consume`: steps 2 to 4, written once for tokens and keys, talking to
//!   Redis through one reply type per operation (claim, decide, peek), with
//!   `classify` and `answer_from_row`, which turn what an earlier consume
//!   left behind into an answer;
//! - `settle`: step 4's write-backs of consumed states, pipelined;
//! - `degraded`: fast consumes while Redis is skipped, and the queue of
//!   Redis writes replayed when it is back;
//! - `orders`: the token of an order event, consumed in the order's
//!   transaction;
//! - `result`: result and release (of a token or a client key), a client's
//!   and an operator's;
//! - `read`: a token's state, read without changing anything;
//! - `keys`: client-supplied keys (`/v1/keys`): a key that belongs to
//!   (client, biz type) instead of a signed token, handed to the same
//!   consume, result and release.

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
