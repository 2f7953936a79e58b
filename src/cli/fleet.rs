//! `fleet forget-silent`: an operator accepts that the Redis decisions of
//! the fleet's silent members are lost, so that the fleet can let Postgres
//! decide fast types again (see docs/operations.md, LedgerFleetStuck). Each
//! member forgotten leaves a `fleet.forgotten` audit event.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::json;

use crate::config::Settings;
use crate::domain::Reason;
use crate::durable::fleet as store;
use crate::durable::pools::Pools;

#[derive(Debug, Subcommand)]
pub enum FleetCommand {
    /// Forget the members that are unaccounted for (silent after saying
    /// Redis was up): their Redis decisions that only the journal held are
    /// accepted as lost. Prints what it forgot (JSON).
    ForgetSilent(ForgetArgs),
}

#[derive(Debug, Args)]
pub struct ForgetArgs {
    /// Required: the decisions those members let Redis make and that never
    /// reached Postgres are lost (a fast token or key one of them consumed
    /// may then be consumed again).
    #[arg(long)]
    pub accept_lost_decisions: bool,
    /// Why (a ticket, an incident): recorded in each member's
    /// `fleet.forgotten` audit event. 1 to 500 characters.
    #[arg(long)]
    pub reason: Option<String>,
}

pub async fn run(settings: &Settings, what: FleetCommand) -> ExitCode {
    let FleetCommand::ForgetSilent(args) = what;
    if !args.accept_lost_decisions {
        eprintln!(
            "idempotency-ledger: fleet forget-silent needs --accept-lost-decisions: the Redis decisions of the members it forgets that never reached Postgres are lost"
        );
        return ExitCode::from(2);
    }
    let reason = match args.reason.as_deref().map(Reason::parse).transpose() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("idempotency-ledger: --reason: {e}");
            return ExitCode::from(2);
        }
    };
    let pools = match Pools::new(&settings.postgres) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("idempotency-ledger: postgres.url: {e}");
            return ExitCode::from(2);
        }
    };
    let timeout = crate::fleet::member_timeout(settings);
    match store::forget_silent(&pools.admin, timeout, reason.as_ref().map(Reason::as_str)).await {
        Ok(forgotten) => {
            for f in &forgotten {
                tracing::warn!(instance = %f.instance, last_seen = %f.last_seen, "fleet: silent member forgotten by an operator; its redis decisions not in postgres are lost");
            }
            let forgotten: Vec<_> = forgotten
                .iter()
                .map(|f| json!({"instance": f.instance.to_string(), "last_seen": f.last_seen.to_rfc3339()}))
                .collect();
            println!("{}", json!({ "forgotten": forgotten }));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idempotency-ledger: could not reach postgres: {e}");
            ExitCode::from(5)
        }
    }
}
