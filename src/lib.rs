//! idempotency-ledger: one-time tokens that make payment-grade requests happen
//! exactly once. Redis turns most duplicates away fast; Postgres decides for
//! durable biz types; a signed token rejects forgeries before any I/O.
//!
//! # Layout
//! - [`config`]: the embedded defaults, a file and `LEDGER__*` variables, validated.
//! - [`domain`]: validated request values (biz type, subject, fingerprint, ...).
//! - [`auth`]: clients, roles, API keys (hashed, compared in constant time).
//! - [`token`]: the token codec, HMAC tags, snowflake ids, the clock. Pure.
//! - [`bloom`]: the fleet-wide filter of issued token ids (forgeries refused without I/O).
//! - [`lease`]: the snowflake worker id this instance holds.
//! - [`fast`]: the Redis tier and its Lua scripts.
//! - [`health`]: Redis's breaker, latency window and the mode (normal, degraded, redis_down).
//! - [`durable`]: the Postgres tier: pools, migrations, every SQL statement.
//! - [`ledger`]: issue, consume, result, release: the only module using both tiers.
//! - [`orders`]: the payment state machine, atomic with token consumption.
//! - [`journal`]: fast-type decisions drained from a Redis stream into Postgres.
//! - [`writer`]: batched Postgres writes that may lag the answer.
//! - [`metrics`]: Prometheus metrics and fleet-wide stats counters.
//! - [`admin`]: audit queries (one token, event pages, stats) for HTTP and CLI.
//! - [`reconcile`]: compares the tiers and repairs divergence, one run at a time.
//! - [`http`]: routes, extractors, errors, OpenAPI.
//! - [`startup`]: building and running the service.
//! - [`cli`]: the command line.
//! - [`telemetry`]: structured logs.
//! - [`tls`]: rustls for Postgres (`sslmode`, `sslrootcert`) and Redis CA files.

pub mod admin;
pub mod auth;
pub mod bloom;
pub mod cli;
pub mod config;
pub mod domain;
pub mod durable;
pub mod fast;
pub mod health;
pub mod http;
pub mod journal;
pub mod lease;
pub mod ledger;
pub mod metrics;
pub mod orders;
pub mod reconcile;
pub mod startup;
pub mod telemetry;
pub mod tls;
pub mod token;
pub mod writer;
