//! The issuance wing, the forgery defence: what lets a verified token be
//! trusted as one this fleet issued.
//!
//! - [`lease`]: the snowflake worker id this instance holds, leased from
//!   Postgres and renewed;
//! - [`marks`]: issuance marks, how far each lease's tokens are known to
//!   Postgres (the issuer's owed ids, the peers' view of the marks);
//! - [`writer`]: the batched Postgres writes that may lag the answer
//!   (issuance records and their marks, attempt counts, stats counters);
//! - [`filter`]: the fleet-wide filter of issued token ids, which refuses a
//!   forgery before any I/O.

pub mod filter;
pub mod lease;
pub mod marks;
pub mod writer;
