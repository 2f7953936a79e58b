//! `config check`: loads the configuration exactly as `serve` does (embedded
//! defaults, `--config FILE`, `LEDGER__*` variables), validates it, and prints
//! the effective configuration as TOML with every secret redacted. Exit 2
//! naming the first problem.

use std::path::Path;
use std::process::ExitCode;

use crate::config::{Environment, Settings};

/// Exit code of a configuration problem (as for every command).
pub const EXIT_CONFIG: u8 = 2;

pub fn run(file: Option<&Path>) -> ExitCode {
    match check(file, std::env::vars()) {
        Ok((text, notes)) => {
            print!("{text}");
            for n in notes {
                eprintln!("idempotency-ledger: note: {n}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idempotency-ledger: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

/// The redacted effective configuration and notes for the operator, or the
/// first problem.
pub fn check(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(String, Vec<String>), crate::config::ConfigError> {
    let (settings, table) = Settings::effective_with_env(file, env)?;
    let body = toml::to_string(&table).unwrap_or_default();
    let text = format!(
        "# idempotency-ledger: the effective configuration (embedded defaults, {}, LEDGER__* variables); secrets are shown as \"{}\"\n{body}",
        match file {
            Some(f) => format!("--config {}", f.display()),
            None => "no --config file".to_owned(),
        },
        crate::config::REDACTED,
    );
    let mut notes = Vec::new();
    let dev = settings.development_secrets_in_use();
    if settings.env == Environment::Development && !dev.is_empty() {
        notes.push(format!(
            "development keys or secrets in effect (refused with env = \"production\"): {}",
            dev.join(", ")
        ));
    }
    Ok((text, notes))
}
