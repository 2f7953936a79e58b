//! The integration suite: real Postgres and Redis, one fresh database and
//! Redis key prefix per test (see `helpers`).

mod bad_input;
mod concurrency;
mod consume;
mod fleet;
mod helpers;
mod issue;
mod result_release;
mod security;
