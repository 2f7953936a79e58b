//! idempotency-ledger: one-time tokens that make payment-grade requests happen
//! exactly once. Redis turns most duplicates away fast; Postgres decides for
//! durable biz types; a signed token rejects forgeries before any I/O.
//!
//! # Layout
//! The modules in the order of the story, each depending only on those
//! above it and on the shell's leaves (`config`, `metrics`, `tasks`,
//! `telemetry`): the tiers never import the fleet, the protocol or the jobs.
//!
//! Pure parts, no I/O:
//! - [`clock`]: the one clock, wall and monotonic time (tests drive a
//!   `ManualClock`).
//! - [`domain`]: validated request values (biz type, subject, fingerprint,
//!   client key); `domain/order.rs`: the order state machine, one pure
//!   `transition`.
//! - [`token`]: the token codec with its HMAC tags, snowflake ids.
//! - [`auth`]: clients, roles, API keys (hashed, compared in constant time).
//!
//! The issuance wing, the forgery defence ([`issuance`]): `lease` (the
//! snowflake worker id this instance holds), `marks` (how far each lease's
//! tokens are known to Postgres), `writer` (batched writes that may lag the
//! answer: issuance records, attempt counts, stats), `filter` (the
//! fleet-wide filter of issued ids: forgeries refused without I/O).
//!
//! The two tiers, side by side:
//! - [`fast`]: Redis and its Lua scripts (`lua/`): `conn`, `call`,
//!   `deadline`, `breaker` (Redis's health and the mode: normal, degraded,
//!   redis_down), `health`, `consume` (where a fast consume is decided, by
//!   `lua/consume.lua`), `write`, `record` (a journal entry, typed),
//!   `journal` (the stream), `scan`, `slots`,
//!   `route`.
//! - [`durable`]: Postgres: `pools`, `error`, and every SQL statement, one
//!   file per table or job (`tokens`, `keys`, `orders`, `journal`, `fleet`,
//!   `lease`, `leases`, `marks`, `bloom`, `partitions`, `admin`, `seal`, `reconcile`,
//!   `setup`, `usage`); `group`: the group-commit queue, `batch`: durable
//!   consumes in batches.
//!
//! Over both tiers:
//! - [`fleet`]: where the fleet agrees on Redis: who may decide fast
//!   consumes (reports, epochs, the gate and its lease).
//! - [`ledger`]: the consume protocol: issue, consume, result, release over
//!   a token or a client key, with its components (`verify`, `issue`,
//!   `catch_up`) built by [`startup`].
//! - [`changes`]: results and releases that waiting consumes (`wait_ms`)
//!   wait for, across the fleet (`LISTEN`/`NOTIFY`).
//! - [`orders`]: orders and their events, each consuming its token through
//!   the ledger in the order's transaction (`orders/batch.rs`: events on
//!   different orders in one transaction).
//!
//! The jobs and the readers:
//! - [`journal`]: fast-type decisions drained from the Redis stream into
//!   Postgres (`journal/entry.rs`: parsing an entry).
//! - [`reconcile`]: compares the tiers and repairs divergence, one run at a
//!   time (`reconcile/`: `run`, one file per phase, `report`, `metrics`).
//! - [`admin`]: audit queries (one token, event pages, stats, recorded
//!   reconcile runs) for HTTP and CLI.
//! - [`audit_seal`]: sealed audit checkpoints and `audit verify`
//!   (`audit_seal/chain.rs`: the arithmetic).
//! - [`http`]: routes, extractors, errors, OpenAPI, the console.
//!
//! The application shell:
//! - [`startup`]: building and running the service, in steps (Postgres,
//!   metrics, Redis, the components, the background tasks, the server).
//! - [`tasks`]: the named background tasks, started and stopped together,
//!   and the owner of the writes a request leaves running off its path.
//! - [`config`]: the embedded defaults, a file and `LEDGER__*` variables,
//!   validated.
//! - [`metrics`]: Prometheus metrics and fleet-wide stats counters.
//! - [`cli`]: the command line. [`telemetry`]: structured logs.
//!   [`tls`]: rustls for Postgres and Redis.
//!
//! # How a consume flows
//! 1. [`http`] (`http/tokens.rs`): parse and authenticate, call
//!    `Ledger::consume`, shape the answer. No pool, no Redis connection.
//! 2. [`ledger`] (`ledger/verify.rs`): verify the token and ask the filter,
//!    no I/O; then `ledger/consume.rs` runs the protocol.
//! 3. [`fast`] (`fast/consume.rs`, `lua/consume.lua`): one script on the
//!    token's key. A durable type gets a provisional marker and goes on to
//!    [`durable`] (`durable/tokens.rs`, one statement decides, in a batch
//!    of `durable/batch.rs`); Redis learns the decision afterwards
//!    (`fast/write.rs`). A fast type is decided by the script, which appends
//!    the decision to the journal stream, while [`fleet`] says Redis may.
//! 4. [`journal`]: the drainer reads the stream (`fast/journal.rs`) and writes
//!    it to Postgres (`durable/journal.rs`).
//!
//! In the degraded modes (`fast/breaker.rs`) step 3 skips Redis: durable
//! types go straight to Postgres, fast types through `ledger/degraded.rs`.

// Pure parts.
pub mod auth;
pub mod clock;
pub mod domain;
pub mod token;

// The issuance wing.
pub mod issuance;

// The tiers.
pub mod durable;
pub mod fast;

// Over both tiers.
pub mod changes;
pub mod fleet;
pub mod ledger;
pub mod orders;

// The jobs and the readers.
pub mod admin;
pub mod audit_seal;
pub mod http;
pub mod journal;
pub mod reconcile;

// The application shell.
pub mod cli;
pub mod config;
pub mod metrics;
pub mod startup;
pub mod tasks;
pub mod telemetry;
pub mod tls;
