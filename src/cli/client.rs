//! `client new`: a fresh random API key, printed once, and the `[[clients]]`
//! block that holds only its SHA-256 (the service never stores a key).

use std::path::Path;
use std::process::ExitCode;

use base64::Engine;
use clap::{Args, ValueEnum};
use rand::RngCore;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::config::Settings;
use crate::domain::BizType;

/// What every generated key starts with (easy to spot in a leak scan).
pub const KEY_PREFIX: &str = "ilk_";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RoleArg {
    Service,
    Reconciler,
    Auditor,
    Admin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NewFormat {
    /// The key, then the TOML block.
    Text,
    /// `{"name", "role", "biz_types", "api_key", "key_sha256", "toml"}`.
    Json,
}

/// `client new` options.
#[derive(Debug, Args)]
pub struct NewArgs {
    /// The client's name (1 to 64 characters, unique in `[[clients]]`).
    #[arg(long)]
    pub name: String,
    #[arg(long, value_enum)]
    pub role: RoleArg,
    /// Biz types it may issue and consume, comma separated (admins see all).
    #[arg(long, value_delimiter = ',', value_name = "B,...")]
    pub biz_types: Vec<String>,
    #[arg(long, value_enum, default_value = "text")]
    pub format: NewFormat,
}

#[derive(Serialize)]
struct Block<'a> {
    name: &'a str,
    role: RoleArg,
    key_sha256: String,
    biz_types: &'a [String],
}

#[derive(Serialize)]
struct Clients<'a> {
    clients: Vec<Block<'a>>,
}

/// A fresh key: 32 random bytes from the OS, base64url.
pub fn new_key() -> String {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

pub fn key_sha256_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

pub fn run(file: Option<&Path>, args: NewArgs) -> ExitCode {
    if args.name.is_empty() || args.name.chars().count() > 64 {
        eprintln!("idempotency-ledger: --name must be 1 to 64 characters");
        return ExitCode::from(2);
    }
    let mut biz_types: Vec<String> = Vec::new();
    for b in args
        .biz_types
        .iter()
        .map(|b| b.trim())
        .filter(|b| !b.is_empty())
    {
        if BizType::parse(b).is_err() {
            eprintln!("idempotency-ledger: --biz-types: `{b}` is not a biz type name ([a-z][a-z0-9-]{{0,31}})");
            return ExitCode::from(2);
        }
        if !biz_types.iter().any(|x| x == b) {
            biz_types.push(b.to_owned());
        }
    }
    // Checked against the configuration in effect, when it loads: a warning,
    // since the block may be meant for another deployment's file.
    if let Ok(settings) = Settings::load(file) {
        for b in &biz_types {
            let known = BizType::parse(b)
                .map(|bt| settings.biz.contains_key(&bt))
                .unwrap_or(false);
            if !known {
                eprintln!("idempotency-ledger: warning: the configuration has no [biz.{b}] section; `config check` will refuse this block until it does");
            }
        }
        if settings.clients.iter().any(|c| c.name == args.name) {
            eprintln!(
                "idempotency-ledger: warning: a client named `{}` is already configured; names must be unique",
                args.name
            );
        }
    }
    let key = new_key();
    let hash = key_sha256_hex(&key);
    let block = toml::to_string(&Clients {
        clients: vec![Block {
            name: &args.name,
            role: args.role,
            key_sha256: hash.clone(),
            biz_types: &biz_types,
        }],
    })
    .unwrap_or_default();
    match args.format {
        NewFormat::Text => {
            println!("API key for client `{}` (shown only now, stored nowhere; hand it to the client over a secure channel):", args.name);
            println!("{key}");
            println!();
            println!("Add this block to the configuration file (it holds only the key's SHA-256):");
            print!("{block}");
        }
        NewFormat::Json => {
            let v = serde_json::json!({
                "name": args.name,
                "role": args.role,
                "biz_types": biz_types,
                "api_key": key,
                "key_sha256": hash,
                "toml": block,
            });
            println!("{v:#}");
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_fresh_and_hashed_like_the_service_does() {
        let a = new_key();
        let b = new_key();
        assert_ne!(a, b);
        assert!(
            a.starts_with(KEY_PREFIX) && a.len() == KEY_PREFIX.len() + 43,
            "{a}"
        );
        // The development key's published hash (config/default.toml).
        assert_eq!(
            key_sha256_hex("dev-payments-key"),
            "47270087500f39d054d1f059a00fc29ab03f97ad73583a0248d04c601ab22d9d"
        );
    }
}
