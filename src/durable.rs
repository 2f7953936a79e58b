//! The durable tier: Postgres. Owns the pools and every SQL statement
//! ([`tokens`] for the token ledger, [`keys`] for client keys, [`journal`] for the fast-type journal's
//! versioned apply, [`lease`] for snowflake worker ids, [`leases`] for
//! processing leases and the uncertain queue,
//! [`setup`] for database creation, migrations and start-up checks,
//! [`admin`] for audit queries and stats, [`seal`] for sealed audit
//! checkpoints, [`reconcile`] for reconciliation, [`partitions`] for the
//! day partitions of `tokens` and their drop,
//! [`bloom`] for the issued-token filter's channel and load, `pg_enum` for
//! the Postgres enum types, [`marks`] for
//! the issuance marks, [`usage`] for the pools' use as metrics, [`batch`]
//! for the group commit of durable consumes, results and releases,
//! [`key_batch`] for that of durable client-key consumes, [`group`] for the
//! group-commit queue they share with the order events' batcher).
//! Every hot statement touches one token or one order key; the hot pool's
//! sessions never merge-join ([`hot_connect_options`]).

pub mod admin;
pub mod batch;
pub mod bloom;
mod error;
pub mod fleet;
pub mod group;
pub mod journal;
pub mod key_batch;
pub mod keys;
pub mod lease;
pub mod leases;
pub mod marks;
pub mod orders;
pub mod partitions;
mod pg_enum;
pub mod pools;
pub mod reconcile;
pub mod seal;
pub mod setup;
pub mod tokens;
pub mod usage;

pub use error::DurableError;
pub(crate) use pools::timed;
pub use pools::{
    begin, connect_options, fetch_all, fetch_one, fetch_optional, hot_connect_options, Pools,
};
