//! The integration suite: real Postgres and Redis, one fresh database and
//! Redis key prefix per test (see `helpers`).

mod admin;
mod admin_release;
mod audit_seal;
mod bad_input;
mod batching;
mod cli;
mod concurrency;
mod consume;
mod deploy_kit;
mod docs_links;
mod durability;
mod faults;
mod fleet;
mod fleet_redis;
mod helpers;
mod idle_connections;
mod issue;
mod keys;
mod link;
mod metrics;
mod order_batching;
mod orders;
mod orders_model;
mod reconcile;
mod reconcile_cluster;
mod redirects;
mod result_release;
mod security;
mod startup_checks;
mod tls;
mod token_state;
mod versions;
mod waiting;
mod writeback;
mod writeback_cluster;
