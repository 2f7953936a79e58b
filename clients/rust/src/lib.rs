//! The Rust client of idempotency-ledger: exactly-once business steps without
//! working the protocol out from prose.
//!
//! - [`Client`]: typed requests and answers for every `/v1` route; retries
//!   that are safe by construction (a `request_id` drawn per logical attempt
//!   and kept across its retries; connection errors, timeouts, 429 and 503
//!   retried with jittered exponential backoff that honours `Retry-After`;
//!   other 4xx never retried; bounded by [`RetryPolicy`]).
//! - [`Guard`]: consume, run your step, record its result, or release the
//!   token when the step failed before any side effect.
//! - [`IdempotencyLayer`]: a tower layer (axum or any tower stack) that
//!   implements the `Idempotency-Key` header on top of the ledger's keys.
//!
//! ```no_run
//! use idempotency_ledger_client::{Client, ConsumeRequest, Guarded, IssueRequest, SideEffects, StepError};
//!
//! # async fn charge(_: &str) -> Result<String, std::io::Error> { Ok("ch_1".into()) }
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let ledger = Client::new("http://127.0.0.1:8080", "dev-payments-key")?;
//! // When showing the pay button:
//! let token = ledger.issue(&IssueRequest::new("order", "user-42")).await?.token;
//! // When the pay request arrives (as often as the user clicks):
//! let outcome = ledger
//!     .guard_token(&token, ConsumeRequest::new("user-42"))
//!     .run(|| async {
//!         let cart = "cart-7"; // validate here: `.before_side_effects()?` gives the token back
//!         let charge_id = charge(cart).await?; // `?` alone: after side effects, the token is kept
//!         Ok::<_, StepError<std::io::Error>>(charge_id)
//!     })
//!     .await?;
//! match outcome {
//!     Guarded::Ran(id) | Guarded::Completed(id) => println!("paid: {id}"),
//!     Guarded::InProgress { .. } => println!("still processing, ask again"),
//!     Guarded::Uncertain { .. } => println!("outcome unknown: being checked"),
//! }
//! # Ok(()) }
//! ```
//!
//! # Decision table: each answer, and what your code must do
//!
//! | answer | meaning | your code |
//! |---|---|---|
//! | [`ConsumeOutcome::Won`] `{ replayed: false }` | this attempt consumed it | run the step once; then [`Client::record_result`], or [`Client::release`] if it failed before any side effect |
//! | [`ConsumeOutcome::Won`] `{ replayed: true }` | an earlier try of this attempt (same `request_id`) won; its answer was lost | the same as `Won`: you are the winner. (If you persist request ids across restarts, your earlier process may have started the step: check your own records.) |
//! | [`ConsumeOutcome::InProgress`] | another attempt consumed it and recorded nothing yet: running, or died | do not run the step; answer "processing" (HTTP 409 or 202); ask again later. Stuck for good: an operator's [`Client::admin_release_token`] |
//! | [`ConsumeOutcome::Uncertain`] | another attempt consumed it, and its biz type's processing lease ran out with neither result nor release: its outcome is unknown | do not run the step and do not start over with a new token; answer "being checked"; an operator resolves it (records the result or releases it) |
//! | [`ConsumeOutcome::Completed`] `{ result }` | already done by another attempt | do not run the step; answer with `result` |
//! | [`Error::TokenExpired`] | never consumed and past its expiry | [`Client::issue`] a new token and start over; the user's action did not happen |
//! | [`Error::FingerprintMismatch`] | consumed earlier for a different request | do not run the step; the token (key) belongs to another request: a new token |
//! | [`Error::TokenInvalid`], [`Error::TokenMismatch`] | forged, mangled, or another user's / client's token | do not run the step; refuse the request (4xx); never retry |
//! | [`Error::Unavailable`], [`Error::RateLimited`] (after the policy's retries) | the ledger could not decide; nothing changed | do not run the step; answer 503, or try again later with the same request value |
//! | [`Error::Transport`] (after the policy's retries) | no answer: the consume may or may not have happened | do not run the step; try again later with the **same** request value (same `request_id`): a `Won { replayed: true }` then tells you it was yours |
//! | [`Error::ResultAlreadySet`] | another result is recorded | a bug: one attempt records one result |
//! | [`Error::NotReleasable`] | it has a result or an order event, or it is not consumed | keep it; after a retried release, an earlier try may have released it: read [`Client::token_state`] |
//! | [`Error::Unauthorized`], [`Error::Forbidden`], [`Error::UnknownBizType`], [`Error::InvalidRequest`] | configuration or a bug | fix the API key, the grants, the biz type or the values; never retry |
//!
//! A [`Guard`] does the left column for you: see [`Guard::run`].
//!
//! Instead of polling an `InProgress` answer, a consume can wait for the
//! winner: [`ConsumeRequest::with_wait`] (and [`KeyConsumeRequest::with_wait`],
//! [`Guard::wait`]) holds the call on the ledger until the winner records its
//! result (`Completed`), releases it (this attempt may win), its lease runs out
//! (`Uncertain`), or the wait ends (`InProgress`).
//!
//! # Retries
//! Every request value (a [`ConsumeRequest`], [`KeyConsumeRequest`], [`Pay`],
//! ...) draws a random `request_id` when it is built, and every try of it
//! sends the same bytes. Retried: no answer (connect errors, broken
//! connections, timeouts), 429 and 503 (and a non-JSON 503 from a proxy).
//! Never retried: any other answer. [`RetryPolicy`] bounds the tries and the
//! total time; a `Retry-After` that would cross the deadline ends the call
//! with its error (which carries [`Error::retry_after`]).
//!
//! # Layout
//! - [`client`](Client): the connection pool, the API key, sending and retrying.
//! - `tokens`, `keys`, `orders`, `admin`: the routes, one module each.
//! - [`ConsumeOutcome`], [`Recorded`], [`Released`], [`State`]: shared answers.
//! - [`Error`]: one variant per API error code.
//! - [`RetryPolicy`]: tries, waits, deadline.
//! - [`Guard`], [`StepError`]: the consume-run-record pattern.
//! - [`IdempotencyLayer`]: the `Idempotency-Key` tower layer.
//! - [`fingerprint`](fingerprint()): request fingerprints.

mod admin;
mod client;
mod error;
mod fingerprint;
mod guard;
mod keys;
pub mod layer;
mod orders;
mod outcome;
mod retry;
mod tokens;

pub use admin::{
    AuditEvent, AuditPage, AuditQuery, BizStats, KeyView, ReconcileReport, ReconcileRequest, Stats,
    TokenView,
};
pub use client::{Client, ClientBuilder, REPLAYED};
pub use error::{Error, Problem};
pub use fingerprint::{fingerprint, fingerprint_json, request_fingerprint};
pub use guard::{Guard, GuardError, Guarded, SideEffects, StepError};
pub use keys::{KeyConsumeRequest, KeyState};
pub use layer::{Idempotency, IdempotencyLayer, BODY_OMITTED, IDEMPOTENCY_KEY};
pub use orders::{
    Close, CreateOrder, EventOutcome, Order, OrderCreated, OrderEvent, OrderState, Pay, Refund,
};
pub use outcome::{ConsumeOutcome, Recorded, Released, State, Timestamp};
pub use retry::RetryPolicy;
pub use tokens::{ConsumeRequest, IssueRequest, Issued, TokenState, MAX_WAIT};
