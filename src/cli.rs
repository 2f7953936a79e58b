//! The command line: `serve`, `migrate`, `reconcile` and `audit` (the last
//! two in [`admin`]), `config check` ([`config_check`]), `client new`
//! ([`client`]), `health` ([`health`]) and `fleet forget-silent`
//! ([`fleet`]). `--config FILE` is global.
//!
//! Exit codes, for every command:
//! - 0: done (`reconcile`: finished, even with repairs; `health`: answered 2xx);
//! - 1: failed at run time (`audit token`: not found; `health`: no 2xx answer;
//!   `reconcile`: could not run, or a phase failed; `audit verify`: could not
//!   run, e.g. Postgres unreachable);
//! - 2: usage or configuration error, naming the problem;
//! - 3: `reconcile`: another run holds the lock;
//! - 4: `reconcile --fail-on-inconsistent`: finished and found `order_inconsistent`;
//! - 5: `audit token`, `audit events`, `fleet forget-silent`, ...: could not ask (Postgres unreachable
//!   or failing; with `--url`, nothing listening, a timeout or a 5xx: a 401
//!   or 403 is 2, a 404 is 1); `audit verify`: a sealed checkpoint does not match (an event
//!   edited, deleted or inserted into its range, a checkpoint changed or
//!   removed, a MAC that does not verify, an unknown seal key id), the first
//!   one named on stderr, all of them in the JSON summary;
//! - 130: interrupted (SIGINT).

pub mod admin;
pub mod client;
pub mod config_check;
pub mod fleet;
pub mod health;
pub mod remote;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::clock::SystemClock;
use crate::config::Settings;
use crate::durable::setup;
use crate::startup::{Application, BuildOptions};
use crate::telemetry;

#[derive(Debug, Parser)]
#[command(
    name = "idempotency-ledger",
    version,
    about = "Exactly-once tokens for payment-grade requests"
)]
pub struct Cli {
    /// A TOML file merged over the embedded defaults.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run migrations (unless --no-migrate), then serve HTTP.
    Serve {
        /// Do not create the database or apply migrations.
        #[arg(long)]
        no_migrate: bool,
    },
    /// Create the database if missing, apply pending migrations, exit.
    Migrate,
    /// Find and repair divergence between Redis and Postgres; print the report.
    /// Exit 0 when it finished (even with repairs), 3 when another run holds
    /// the lock, 4 with --fail-on-inconsistent when it found
    /// order_inconsistent, 1 when it could not run.
    Reconcile(admin::ReconcileArgs),
    /// What happened to a token, a user or an order (exit 5: could not ask;
    /// `audit verify`: 5 a sealed checkpoint does not match, 1 could not run).
    Audit {
        /// Ask this ledger's admin API (e.g. http://127.0.0.1:8080) instead
        /// of Postgres, with the API key (role auditor or admin) in the
        /// environment variable LEDGER_API_KEY. Not for `audit verify`.
        #[arg(long, global = true, value_name = "URL")]
        url: Option<String>,
        #[command(subcommand)]
        what: admin::AuditCommand,
    },
    /// The configuration.
    Config {
        #[command(subcommand)]
        what: ConfigCommand,
    },
    /// API clients.
    Client {
        #[command(subcommand)]
        what: ClientCommand,
    },
    /// Ask a running service (for container health checks): exit 0 when it
    /// answers 2xx, 1 otherwise.
    Health(health::HealthArgs),
    /// The fleet's agreement on Redis.
    Fleet {
        #[command(subcommand)]
        what: fleet::FleetCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate the configuration (embedded defaults, --config, LEDGER__*
    /// variables) and print the effective one with every secret redacted;
    /// exit 2 naming the first problem.
    Check,
}

#[derive(Debug, Subcommand)]
pub enum ClientCommand {
    /// Print a fresh random API key (once) and the [[clients]] block holding
    /// only its SHA-256.
    New(client::NewArgs),
}

/// Runs one command; the exit codes are in the module's documentation.
pub fn run(cli: Cli) -> ExitCode {
    crate::tls::install_provider();
    let file = cli.config.as_deref();
    // Commands that need no runtime, no logs, and (for `client new`) not even
    // a valid configuration.
    let command = match cli.command {
        Command::Config {
            what: ConfigCommand::Check,
        } => return config_check::run(file),
        Command::Client {
            what: ClientCommand::New(args),
        } => return client::run(file, args),
        Command::Health(args) => return health::run(file, args),
        other => other,
    };
    let settings = match Settings::load(file) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("idempotency-ledger: {e}");
            return ExitCode::from(2);
        }
    };
    telemetry::init(settings.server.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("idempotency-ledger: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let outcome: anyhow::Result<ExitCode> = runtime.block_on(async move {
        match command {
            Command::Serve { no_migrate } => {
                let app = Application::build(
                    settings,
                    BuildOptions {
                        migrate: !no_migrate,
                    },
                    Arc::new(SystemClock),
                )
                .await?;
                app.run_until_stopped().await?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Migrate => {
                setup::create_database_if_missing(&settings.postgres.url).await?;
                let n = setup::migrate(&settings.postgres.url).await?;
                println!("applied {n} migration(s)");
                Ok(ExitCode::SUCCESS)
            }
            Command::Reconcile(args) => Ok(admin::reconcile(&settings, args).await),
            Command::Audit { url, what } => Ok(admin::audit(&settings, url, what).await),
            Command::Fleet { what } => Ok(fleet::run(&settings, what).await),
            Command::Config { .. } | Command::Client { .. } | Command::Health(_) => {
                unreachable!("handled before the configuration is loaded")
            }
        }
    });
    match outcome {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = ?e, "failed");
            eprintln!("idempotency-ledger: {e:#}");
            ExitCode::from(1)
        }
    }
}
