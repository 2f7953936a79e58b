//! `idempotency-ledger`: parse the command line and hand over to the library.

use std::process::ExitCode;

use clap::Parser;
use idempotency_ledger::cli::{self, Cli};

/// mimalloc: a request allocates a few dozen small objects across threads
/// (actix workers, Redis and Postgres driver tasks); measured in docs/development.md's
/// Benchmarks section.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    cli::run(cli)
}
