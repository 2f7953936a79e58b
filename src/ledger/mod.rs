//! The ledger (being split into files that follow the protocol).

mod consume;

pub use consume::*;
