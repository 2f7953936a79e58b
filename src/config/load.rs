//! The layers of configuration: the embedded defaults, then a file, then
//! `LEDGER__*` variables, merged and handed to validation.

use std::path::Path;

use figment::providers::{Format, Toml};
use figment::Figment;

use super::raw::Raw;
use super::redact::redact;
use super::settings::Settings;
use super::{invalid, ConfigError, DEFAULT_TOML};

impl Settings {
    /// Loads defaults, then `file` (if any), then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::load_with_env(file, env)
    }

    /// Like [`Settings::load`] with an explicit environment (tests never touch
    /// the process environment).
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        Self::over_defaults(user_layers(file, env)?)
    }

    /// Loads and validates like [`Settings::load_with_env`], and also returns
    /// the merged configuration as TOML with every secret redacted
    /// ([`redact`]): what `config check` prints.
    pub fn effective_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(Settings, toml::Table), ConfigError> {
        let user = user_layers(file, env)?;
        let settings = Self::over_defaults(user.clone())?;
        let mut table: toml::Table = merged(user).extract().map_err(Box::new)?;
        redact(&mut table);
        Ok((settings, table))
    }

    /// Loads from a TOML string merged over the defaults (used by tests).
    pub fn from_toml_over_defaults(toml: &str) -> Result<Settings, ConfigError> {
        Self::over_defaults(Figment::from(Toml::string(toml)))
    }

    /// The user's layers (file, environment) merged over the embedded
    /// defaults, validated.
    fn over_defaults(user: Figment) -> Result<Settings, ConfigError> {
        let raw: Raw = merged(user).extract().map_err(Box::new)?;
        raw.validate()
    }
}

/// The file (if any), then the `LEDGER__*` variables among `env`.
fn user_layers(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Figment, ConfigError> {
    let mut fig = Figment::new();
    if let Some(path) = file {
        if !path.exists() {
            return Err(invalid(
                "--config",
                format!("file {} does not exist", path.display()),
            ));
        }
        fig = fig.merge(Toml::file(path));
    }
    let env: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with("LEDGER__"))
        .collect();
    if !env.is_empty() {
        // Figment reads only the process environment, so pass ours through
        // a TOML document built from the pairs instead of mutating it.
        fig = fig.merge(Toml::string(&env_to_toml(&env)?));
    }
    Ok(fig)
}

/// The user's layers merged over the embedded defaults. Naming
/// `redis.cluster_nodes` without a `redis.url` of one's own means the
/// cluster: the default standalone URL is dropped (both set by the user is
/// still a configuration error).
fn merged(user: Figment) -> Figment {
    let cluster_only = user.contains("redis.cluster_nodes") && !user.contains("redis.url");
    let mut fig = Figment::from(Toml::string(DEFAULT_TOML)).merge(user);
    if cluster_only {
        fig = fig.merge(Toml::string("[redis]\nurl = \"\"\n"));
    }
    fig
}

/// Turns `LEDGER__A__B=value` pairs into a TOML document `[a] b = value`.
/// Values that parse as TOML (numbers, booleans, arrays, inline tables) keep
/// their type; anything else is a string.
fn env_to_toml(env: &[(String, String)]) -> Result<String, ConfigError> {
    let mut root = toml::Table::new();
    for (key, value) in env {
        let path: Vec<String> = key["LEDGER__".len()..]
            .split("__")
            .map(|p| p.to_ascii_lowercase())
            .collect();
        if path.iter().any(|p| p.is_empty()) {
            return Err(invalid(key.clone(), "empty path segment"));
        }
        let parsed: toml::Value = format!("v = {value}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.clone()));
        let mut table = &mut root;
        for segment in &path[..path.len() - 1] {
            let entry = table
                .entry(segment.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = match entry {
                toml::Value::Table(t) => t,
                _ => return Err(invalid(key.clone(), "conflicts with another variable")),
            };
        }
        let last = path[path.len() - 1].clone();
        table.insert(last, parsed);
    }
    toml::to_string(&root).map_err(|e| invalid("LEDGER__*", e.to_string()))
}
