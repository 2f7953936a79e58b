//! The client against a ledger spawned in-process (real Postgres and Redis).

mod guard;
mod helpers;
mod keys;
mod layer;
mod orders_admin;
mod retries;
mod tokens;
