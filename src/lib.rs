//! idempotency-ledger: one-time tokens that make payment-grade requests happen
//! exactly once. Redis turns most duplicates away fast; Postgres decides for
//! durable biz types; a signed token rejects forgeries before any I/O.
//!
//! # Layout
//! - [`config`]: the embedded defaults, a file and `LEDGER__*` variables, validated
//!   (`config/`: `settings`, `raw`, `load`, `validate`, `parse`, `redact`).
//! - [`domain`]: validated request values (biz type, subject, fingerprint, ...);
//!   `domain/order.rs`: the order state machine, one pure `transition`.
//! - [`auth`]: clients, roles, API keys (hashed, compared in constant time).
//! - [`token`]: the token codec, HMAC tags, snowflake ids, the clock. Pure.
//! - [`bloom`]: the fleet-wide filter of issued token ids (forgeries refused without I/O).
//! - [`lease`]: the snowflake worker id this instance holds.
//! - [`issuance`]: issuance marks, how far each lease's tokens are known to
//!   Postgres (the issuer's owed ids, the peers' view of the marks).
//! - [`fast`]: the Redis tier and its Lua scripts (`fast/`: `conn`, `call`,
//!   `deadline`, `consume`, `write`, `health`, `journal`, `scan`; scripts in
//!   `lua/`).
//! - [`health`]: Redis's breaker, latency window and the mode (normal, degraded, redis_down).
//! - [`durable`]: the Postgres tier: pools, migrations, every SQL statement
//!   (`durable/`: `tokens`, `orders`, `journal`, `admin`, `reconcile`, ...;
//!   `group`: the group-commit queue; `batch`: durable consumes in batches).
//! - [`ledger`]: issue, consume, result, release: the payment path over both
//!   tiers, one consume for tokens and keys (`ledger/`: `core`, `issue`,
//!   `held`, `consume`, `degraded`, `orders`, `result`, `keys`, `read`,
//!   `settle`, `wait`, `lease`, `api`).
//! - [`orders`]: orders and their events, each consuming its token through the
//!   ledger in the order's transaction (`orders/batch.rs`: events on
//!   different orders in one transaction, over the same group-commit queue).
//! - [`fleet`]: the fleet's agreement on Redis: who may decide fast consumes
//!   (reports, epochs, the gate and its lease).
//! - [`changes`]: results and releases that waiting consumes (`wait_ms`)
//!   wait for, across the fleet (Postgres `LISTEN`/`NOTIFY`).
//! - [`journal`]: fast-type decisions drained from a Redis stream into Postgres.
//! - [`writer`]: batched Postgres writes that may lag the answer.
//! - [`metrics`]: Prometheus metrics and fleet-wide stats counters.
//! - [`admin`]: audit queries (one token, event pages, stats, recorded
//!   reconcile runs) for HTTP and CLI.
//! - [`reconcile`]: compares the tiers and repairs divergence, one run at a time
//!   (`reconcile/`: `run`, one file per phase, `report`, `metrics`).
//! - [`audit_seal`]: sealed audit checkpoints: the job that chains and
//!   authenticates new audit events, and `audit verify` (`audit_seal/chain.rs`: the arithmetic).
//! - [`http`]: routes, extractors, errors, OpenAPI.
//! - [`startup`]: building and running the service, in steps (Postgres,
//!   metrics, Redis, the components, the background tasks, the server).
//! - [`tasks`]: who owns what runs in the background: the named background
//!   tasks, started and stopped together, and the writes a request leaves
//!   running off its answer's path.
//! - [`cli`]: the command line.
//! - [`telemetry`]: structured logs.
//! - [`tls`]: rustls for Postgres (`sslmode`, `sslrootcert`) and Redis CA files.
//!
//! # How a consume flows
//! 1. [`http`] (`http/tokens.rs`): parse and authenticate, call
//!    `Ledger::consume`, shape the answer. No pool, no Redis connection.
//! 2. [`ledger`] (`ledger/core.rs`): verify the token and ask [`bloom`], no I/O;
//!    then `ledger/consume.rs` runs the protocol.
//! 3. [`fast`] (`fast/consume.rs`, `lua/consume.lua`): one script on the
//!    token's key. A durable type gets a provisional marker and goes on to
//!    [`durable`] (`durable/tokens.rs`, one statement decides); Redis learns
//!    the decision afterwards (`fast/write.rs`). A fast type is decided by the
//!    script, which appends the decision to the journal stream.
//! 4. [`journal`]: the drainer reads the stream (`fast/journal.rs`) and writes
//!    it to Postgres (`durable/journal.rs`).
//!
//! In the degraded modes ([`health`]) step 3 skips Redis: durable types go
//! straight to Postgres, fast types through `ledger/degraded.rs`.

pub mod admin;
pub mod audit_seal;
pub mod auth;
pub mod changes;
pub mod cli;
pub mod clock;
pub mod config;
pub mod domain;
pub mod durable;
pub mod fast;
pub mod fleet;
pub mod http;
pub mod issuance;
pub mod journal;
pub mod ledger;
pub mod metrics;
pub mod orders;
pub mod reconcile;
pub mod startup;
pub mod tasks;
pub mod telemetry;
pub mod tls;
pub mod token;
