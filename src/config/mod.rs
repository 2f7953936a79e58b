//! Configuration: the embedded default TOML, a user file and `LEDGER__*`
//! environment variables, merged in that order and validated into typed
//! [`Settings`] before anything starts.
//!
//! - `settings`: the typed, validated [`Settings`] and its parts;
//! - `raw`: the configuration as written, before validation;
//! - `load`: the layers (defaults, file, environment) and their merge;
//! - `validate`: from the raw tree to [`Settings`], naming the key at fault;
//! - `parse`: durations, rates and key ids as written in the file;
//! - `redact`: secrets replaced in printed configuration.

mod load;
mod parse;
mod raw;
mod redact;
mod settings;
mod validate;

#[cfg(test)]
mod tests;

pub use parse::parse_duration;
pub use redact::{redact, redact_url, REDACTED};
pub use settings::{
    AuditSettings, BizSettings, BloomSettings, CaFile, Durability, Environment, FleetSettings,
    LeaseExpiry, LimitSettings, LogFormat, PostgresSettings, ProcessingLease, ReconcileSettings,
    RedisSettings, RedisTopology, SealKey, ServerSettings, Settings, SigningKey, TokenSettings,
};

/// The documented defaults, compiled into the binary.
pub const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

/// A configuration problem, naming the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("configuration key `{key}`: {problem}")]
    Invalid { key: String, problem: String },
}

pub(crate) fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        problem: problem.into(),
    }
}
