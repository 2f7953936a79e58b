//! The command line: `serve`, `migrate`, `reconcile` and `audit` (the last
//! two in [`admin`]). `--config FILE` is global. Usage and configuration
//! errors exit 2.

pub mod admin;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::config::Settings;
use crate::durable::setup;
use crate::startup::{Application, BuildOptions};
use crate::telemetry;
use crate::token::SystemClock;

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
    /// the lock, 1 when it could not run.
    Reconcile(admin::ReconcileArgs),
    /// What happened to a token, a user or an order.
    Audit {
        #[command(subcommand)]
        what: admin::AuditCommand,
    },
}

/// Exit codes: 0 done, 1 failed at run time (or `audit token`: not found),
/// 2 usage or configuration, 3 `reconcile`: another run holds the lock.
pub fn run(cli: Cli) -> ExitCode {
    let settings = match Settings::load(cli.config.as_deref()) {
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
        match cli.command {
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
            Command::Audit { what } => Ok(admin::audit(&settings, what).await),
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
