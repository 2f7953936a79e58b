//! The `reconcile` and `audit` subcommands: they talk to Postgres (admin
//! pool) and Redis directly, with the same code as the HTTP admin routes, and
//! print JSON, text, tables or CSV. `audit --url` asks a running ledger's
//! admin API instead ([`super::remote`]) and prints the same.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

use super::remote::{Remote, RemoteError};
use crate::admin::{self, Admin, AdminError, AuditEvent, AuditPage, AuditQuery, TokenView};
use crate::clock::{Clock, SystemClock};
use crate::config::Settings;
use crate::domain::AuditKind;
use crate::durable::Pools;
use crate::fast::FastTier;
use crate::metrics::Metrics;
use crate::reconcile::{self, Class, LogProgress, Phase, Progress, ReconcileError, Reconciler};

/// Exit code when another reconcile run holds the lock.
pub const EXIT_RUNNING: u8 = 3;
/// Exit code of `reconcile --fail-on-inconsistent` that found
/// `order_inconsistent` (the report is printed as usual).
pub const EXIT_INCONSISTENT: u8 = 4;
/// Exit code of `audit` when Postgres could not be asked (unreachable,
/// failing): unlike 1 (`audit token`: not found), it says nothing about the
/// token.
pub const EXIT_UNAVAILABLE: u8 = 5;
/// Exit code of `audit verify` when a sealed checkpoint does not match its
/// events, its chain or its MAC (API.md).
pub const EXIT_SEAL_MISMATCH: u8 = 5;
/// Exit code of an interrupted reconcile (SIGINT), as shells do.
pub const EXIT_INTERRUPTED: u8 = 130;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    Json,
    Text,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenFormat {
    Json,
    Table,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EventsFormat {
    Json,
    Table,
    Csv,
}

/// `reconcile` options.
#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// Find and report only; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Only tokens issued and orders updated this recently, e.g. 24h, 30m, 7d.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub since: Option<Duration>,
    /// Report format.
    #[arg(long, value_enum, default_value = "json")]
    pub format: ReportFormat,
    /// Exit 4 when the run finished and found order_inconsistent (for cron
    /// jobs that alert on their exit code).
    #[arg(long)]
    pub fail_on_inconsistent: bool,
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// One token: its record and its audit events (exit 1 when unknown).
    Token {
        /// The token text.
        token: String,
        /// Default: table on a terminal, json otherwise.
        #[arg(long, value_enum)]
        format: Option<TokenFormat>,
    },
    /// One client key: its record and its audit events, as JSON (exit 1
    /// when unknown).
    Key {
        /// The client the key belongs to (its `[[clients]]` name).
        #[arg(long)]
        client: String,
        #[arg(long)]
        biz_type: String,
        /// The key.
        key: String,
    },
    /// One order and every audit event that names it, oldest first, as
    /// JSON (exit 1 when there is no such order).
    Order {
        /// The order id.
        order_id: String,
    },
    /// Past reconcile runs, newest first, each with its whole report, as
    /// JSON (`GET /v1/admin/reconcile/runs`).
    ReconcileRuns {
        /// Runs per page, 1 to 100.
        #[arg(long, default_value_t = admin::runs::DEFAULT_RUNS,
              value_parser = clap::value_parser!(u32).range(1..=i64::from(admin::runs::MAX_RUNS)))]
        limit: u32,
        /// `next_cursor` of the previous page.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Audit events, newest first.
    Events(EventsArgs),
    /// Recompute the sealed audit checkpoints from the events and check each
    /// one's MAC; print a JSON summary. Exit 0 when every one matches, 5
    /// naming the first that does not, 1 when it could not run. Reads the
    /// database only (it needs the seal keys): not with --url.
    Verify {
        /// Only the checkpoints sealed at or after T: a duration back from
        /// now (24h, 30m, 7d) or an RFC 3339 time. Default: all.
        #[arg(long, value_name = "T", value_parser = parse_time)]
        since: Option<DateTime<Utc>>,
    },
}

#[derive(Debug, Args)]
pub struct EventsArgs {
    #[arg(long)]
    pub subject: Option<String>,
    #[arg(long)]
    pub biz_type: Option<String>,
    #[arg(long)]
    pub order_id: Option<String>,
    /// The acting or owning client's name (the events' `client`).
    #[arg(long)]
    pub client: Option<String>,
    /// An audit kind, e.g. token.consumed; repeat for any of several.
    #[arg(long = "kind", value_name = "KIND", value_parser = kind_parser())]
    pub kinds: Vec<AuditKind>,
    /// A duration back from now (24h, 30m, 7d) or an RFC 3339 time; inclusive.
    #[arg(long, value_name = "T", value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// A duration back from now or an RFC 3339 time; exclusive.
    #[arg(long, value_name = "T", value_parser = parse_time)]
    pub until: Option<DateTime<Utc>>,
    /// Events per page, 1 to 1000.
    #[arg(long, default_value_t = admin::DEFAULT_LIMIT,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(admin::MAX_LIMIT)))]
    pub limit: u32,
    /// `next_cursor` of the previous page.
    #[arg(long)]
    pub cursor: Option<String>,
    /// Follow the cursor to the last event (an export); --limit is then the
    /// page size.
    #[arg(long)]
    pub all: bool,
    /// Default: table on a terminal, json otherwise.
    #[arg(long, value_enum)]
    pub format: Option<EventsFormat>,
}

pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|_| format!("`{s}` is not a duration; use e.g. 24h, 30m, 7d"))
}

/// The audit kinds, listed by `--help` and in the error for any other value.
fn kind_parser() -> impl clap::builder::TypedValueParser<Value = AuditKind> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(AuditKind::ALL.map(AuditKind::as_str))
        .try_map(|s| admin::parse_kind(&s))
}

fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    admin::parse_time_arg(s, SystemClock.now())
}

fn stdout_is_terminal() -> bool {
    std::io::stdout().is_terminal()
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// Progress as a bar on stderr (a terminal).
struct Bar {
    current: Mutex<Option<ProgressBar>>,
}

impl Progress for Bar {
    fn phase(&self, phase: Phase, total: Option<u64>) {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = cur.take() {
            b.finish();
        }
        let bar = match total {
            Some(n) => ProgressBar::new(n).with_style(
                ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            ),
            None => ProgressBar::new_spinner().with_style(
                ProgressStyle::with_template("{prefix:>12} {spinner} {pos} {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            ),
        };
        bar.set_prefix(phase.as_str());
        bar.enable_steady_tick(Duration::from_millis(200));
        *cur = Some(bar);
    }
    fn advance(&self, n: u64) {
        if let Some(b) = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            b.inc(n);
        }
    }
    fn finish(&self) {
        if let Some(b) = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            b.finish();
        }
    }
}

/// `reconcile`: 0 finished, 3 another run holds the lock, 4 finished with
/// `--fail-on-inconsistent` and found `order_inconsistent`, 130 interrupted,
/// 1 could not run (or a phase failed).
pub async fn reconcile(settings: &Settings, args: ReconcileArgs) -> ExitCode {
    let pools = match Pools::new(&settings.postgres) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("idempotency-ledger: postgres.url: {e}");
            return ExitCode::from(2);
        }
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let fast = FastTier::new(
        settings.redis.clone(),
        Arc::new(Metrics::new()),
        clock.clone(),
    );
    let reconciler = Reconciler::new(settings, pools.admin.clone(), fast, clock);
    let progress: Box<dyn Progress> = if std::io::stderr().is_terminal() {
        Box::new(Bar {
            current: Mutex::new(None),
        })
    } else {
        Box::new(LogProgress::new(Duration::from_secs(5)))
    };
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    let signals = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("idempotency-ledger: interrupted; finishing the current batch");
            on_signal.cancel();
        }
    });
    let opts = reconcile::Options {
        dry_run: args.dry_run,
        since: args.since,
        by: reconcile::BY_CLI.to_owned(),
    };
    let out = reconciler.run(&opts, progress.as_ref(), &cancel).await;
    signals.abort();
    pools.close().await;
    match out {
        Ok(report) => {
            match args.format {
                ReportFormat::Json => println!("{}", json(&report)),
                ReportFormat::Text => print!("{}", report.to_text()),
            }
            if report.interrupted {
                ExitCode::from(EXIT_INTERRUPTED)
            } else if args.fail_on_inconsistent && report.found.get(Class::OrderInconsistent) > 0 {
                // Before a failed phase's 1: the orders need a human either way.
                eprintln!(
                    "idempotency-ledger: {} inconsistent order(s) found",
                    report.found.get(Class::OrderInconsistent)
                );
                ExitCode::from(EXIT_INCONSISTENT)
            } else if report.errors.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(ReconcileError::Running) => {
            eprintln!("idempotency-ledger: another reconcile run holds the lock; not started");
            ExitCode::from(EXIT_RUNNING)
        }
        Err(e) => {
            eprintln!(
                "idempotency-ledger: reconcile could not run: {:#}",
                anyhow::Error::from(e)
            );
            ExitCode::from(1)
        }
    }
}

/// Where the `audit` subcommands ask: Postgres, or a ledger's admin API.
enum Source {
    Db(Admin),
    Http(Remote),
}

/// Why a question got no answer, from either source.
enum Failure {
    Db(AdminError),
    Http(RemoteError),
}

impl From<AdminError> for Failure {
    fn from(e: AdminError) -> Failure {
        Failure::Db(e)
    }
}

impl From<RemoteError> for Failure {
    fn from(e: RemoteError) -> Failure {
        Failure::Http(e)
    }
}

impl Source {
    async fn token(&self, token: &str) -> Result<TokenView, Failure> {
        match self {
            Source::Db(a) => Ok(a.token(token).await?),
            Source::Http(r) => Ok(r.token(token).await?),
        }
    }
    async fn key(
        &self,
        client: &str,
        biz: &crate::domain::BizType,
        key: &crate::domain::key::ClientKey,
    ) -> Result<admin::KeyView, Failure> {
        match self {
            Source::Db(a) => Ok(a.key(client, biz, key).await?),
            Source::Http(r) => Ok(r.key(client, &biz.to_string(), key.as_str()).await?),
        }
    }
    async fn order(&self, order_id: &str) -> Result<Option<admin::order::OrderView>, Failure> {
        match self {
            Source::Db(a) => Ok(a.order(order_id).await?),
            Source::Http(r) => Ok(r.order(order_id).await?),
        }
    }
    async fn reconcile_runs(
        &self,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<admin::runs::RunsPage, Failure> {
        match self {
            Source::Db(a) => Ok(a.reconcile_runs(limit, cursor).await?),
            Source::Http(r) => Ok(r.reconcile_runs(limit, cursor).await?),
        }
    }
    async fn audit(&self, query: &AuditQuery) -> Result<AuditPage, Failure> {
        match self {
            Source::Db(a) => Ok(a.audit(query).await?),
            Source::Http(r) => Ok(r.audit(query).await?),
        }
    }
}

/// `audit token` / `audit events` / ...: 0 found, 1 not found, 2 usage,
/// 5 could not ask; `audit verify`: see [`verify`]. With `url`, every
/// subcommand but `verify` asks that ledger's admin API.
pub async fn audit(settings: &Settings, url: Option<String>, command: AuditCommand) -> ExitCode {
    if let Some(url) = url {
        if matches!(command, AuditCommand::Verify { .. }) {
            eprintln!(
                "idempotency-ledger: audit verify reads the database only (it needs the seal keys); drop --url"
            );
            return ExitCode::from(2);
        }
        return match Remote::new(&url) {
            Ok(remote) => audit_from(&Source::Http(remote), command).await,
            Err(e) => fail(e),
        };
    }
    let pools = match Pools::new(&settings.postgres) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("idempotency-ledger: postgres.url: {e}");
            return ExitCode::from(2);
        }
    };
    let code = match command {
        AuditCommand::Verify { since } => verify(settings, &pools, since).await,
        other => audit_from(&Source::Db(Admin::new(settings, &pools)), other).await,
    };
    pools.close().await;
    code
}

async fn audit_from(audit: &Source, command: AuditCommand) -> ExitCode {
    match command {
        AuditCommand::Token { token, format } => match audit.token(&token).await {
            Ok(view) => {
                let table = format
                    .map(|f| f == TokenFormat::Table)
                    .unwrap_or_else(stdout_is_terminal);
                if table {
                    print!("{}", token_table(&view));
                } else {
                    println!("{}", json(&view));
                }
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        AuditCommand::Key {
            client,
            biz_type,
            key,
        } => {
            let parsed = crate::domain::BizType::parse(&biz_type)
                .map_err(|e| e.to_string())
                .and_then(|b| {
                    crate::domain::key::ClientKey::parse(&key)
                        .map(|k| (b, k))
                        .map_err(|e| e.to_string())
                });
            match parsed {
                Err(e) => {
                    eprintln!("idempotency-ledger: {e}");
                    ExitCode::from(2)
                }
                Ok((biz, key)) => match audit.key(&client, &biz, &key).await {
                    Ok(view) => {
                        println!("{}", json(&view));
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(e),
                },
            }
        }
        AuditCommand::Order { order_id } => match audit.order(&order_id).await {
            Ok(Some(view)) => {
                println!("{}", json(&view));
                ExitCode::SUCCESS
            }
            Ok(None) => {
                eprintln!("idempotency-ledger: no order {order_id}");
                ExitCode::from(1)
            }
            Err(e) => fail(e),
        },
        AuditCommand::ReconcileRuns { limit, cursor } => {
            match audit.reconcile_runs(limit, cursor.as_deref()).await {
                Ok(page) => {
                    println!("{}", json(&page));
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        AuditCommand::Events(args) => events(audit, args).await,
        AuditCommand::Verify { .. } => unreachable!("audit verify is run by `audit`"),
    }
}

/// `audit verify`: 0 every checkpoint matches, 5 one does not (the first
/// named on stderr, all of them in the JSON), 1 could not run.
async fn verify(settings: &Settings, pools: &Pools, since: Option<DateTime<Utc>>) -> ExitCode {
    let seals = crate::audit_seal::Seals::new(&settings.audit, pools.admin.clone());
    match seals.verify(since).await {
        Ok(report) => {
            println!("{}", json(&report));
            match report.mismatches.first() {
                None => ExitCode::SUCCESS,
                Some(m) => {
                    eprintln!(
                        "idempotency-ledger: audit checkpoint {} (sealed {}) does not match: {}{}",
                        m.checkpoint,
                        m.sealed_at,
                        m.message,
                        match report.mismatches.len() {
                            1 => String::new(),
                            n => format!(" ({} more mismatching checkpoint(s) in the JSON)", n - 1),
                        }
                    );
                    ExitCode::from(EXIT_SEAL_MISMATCH)
                }
            }
        }
        Err(e) => {
            eprintln!(
                "idempotency-ledger: audit verify could not run: {:#}",
                anyhow::Error::from(e)
            );
            ExitCode::from(1)
        }
    }
}

/// `audit events`: one page, or with `--all` every page, printed as it comes
/// (JSON keeps the shape of one page: `{"events": [...], "next_cursor": null}`).
async fn events(audit: &Source, args: EventsArgs) -> ExitCode {
    let format = args.format.unwrap_or(if stdout_is_terminal() {
        EventsFormat::Table
    } else {
        EventsFormat::Json
    });
    let mut query = AuditQuery {
        subject: args.subject,
        biz_type: args.biz_type,
        order_id: args.order_id,
        client: args.client,
        kinds: {
            let mut kinds = args.kinds;
            let mut seen = Vec::new();
            kinds.retain(|k| {
                let new = !seen.contains(k);
                seen.push(*k);
                new
            });
            kinds
        },
        since: args.since,
        until: args.until,
        limit: args.limit,
        cursor: args.cursor,
    };
    if !args.all {
        return match audit.audit(&query).await {
            Ok(page) => {
                match format {
                    EventsFormat::Json => println!("{}", json(&page)),
                    EventsFormat::Table => print!("{}", events_table(&page)),
                    EventsFormat::Csv => print!("{}", events_csv(&page.events, true)),
                }
                if let Some(c) = &page.next_cursor {
                    eprintln!(
                        "idempotency-ledger: more events than this page: rerun with --cursor {c}, or --all for every page"
                    );
                }
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        };
    }
    let mut out = std::io::stdout().lock();
    let mut table_events: Vec<AuditEvent> = Vec::new();
    let mut written = 0usize;
    let mut write = |text: &str| {
        use std::io::Write;
        // A closed pipe (`| head`) ends the export quietly.
        out.write_all(text.as_bytes()).is_ok()
    };
    if format == EventsFormat::Json && !write("{\"events\": [") {
        return ExitCode::SUCCESS;
    }
    loop {
        let page = match audit.audit(&query).await {
            Ok(p) => p,
            Err(e) => {
                if format == EventsFormat::Json {
                    write("\n]}\n");
                }
                eprintln!("idempotency-ledger: the export stopped after {written} event(s)");
                return fail(e);
            }
        };
        let ok = match format {
            EventsFormat::Json => page.events.iter().all(|e| {
                let sep = if written == 0 { "\n" } else { ",\n" };
                written += 1;
                write(&format!(
                    "{sep}{}",
                    serde_json::to_string(e).unwrap_or_default()
                ))
            }),
            EventsFormat::Csv => {
                let text = events_csv(&page.events, written == 0);
                written += page.events.len();
                write(&text)
            }
            EventsFormat::Table => {
                written += page.events.len();
                table_events.extend(page.events);
                true
            }
        };
        if !ok {
            return ExitCode::SUCCESS;
        }
        match page.next_cursor {
            Some(c) => query.cursor = Some(c),
            None => break,
        }
    }
    let tail = match format {
        EventsFormat::Json => "\n], \"next_cursor\": null}\n".to_owned(),
        EventsFormat::Csv => String::new(),
        EventsFormat::Table => events_table(&AuditPage {
            events: table_events,
            next_cursor: None,
        }),
    };
    write(&tail);
    ExitCode::SUCCESS
}

fn fail(e: impl Into<Failure>) -> ExitCode {
    let e = match e.into() {
        Failure::Db(e) => e,
        Failure::Http(e) => {
            let code = match &e {
                RemoteError::NotFound(_) => 1,
                RemoteError::Usage(_) => 2,
                RemoteError::Unavailable(_) => EXIT_UNAVAILABLE,
            };
            eprintln!("idempotency-ledger: {e}");
            return ExitCode::from(code);
        }
    };
    let code = match &e {
        AdminError::TokenInvalid | AdminError::InvalidCursor | AdminError::InvalidRequest(_) => 2,
        AdminError::TokenNotFound | AdminError::KeyNotFound => 1,
        AdminError::Postgres(_) => EXIT_UNAVAILABLE,
    };
    match e {
        AdminError::Postgres(d) => {
            eprintln!("idempotency-ledger: {:#}", anyhow::Error::from(d))
        }
        other => eprintln!("idempotency-ledger: {other}"),
    }
    ExitCode::from(code)
}

fn or_dash(v: &Option<String>) -> &str {
    v.as_deref().unwrap_or("-")
}

fn token_table(v: &TokenView) -> String {
    let mut out = String::new();
    let rows: Vec<(&str, String)> = vec![
        ("token", v.token.clone()),
        ("biz_type", v.biz_type.clone()),
        ("subject", or_dash(&v.subject).to_owned()),
        ("client", or_dash(&v.client).to_owned()),
        ("state", v.state.to_owned()),
        ("issued_at", v.issued_at.clone()),
        ("expires_at", v.expires_at.clone()),
        ("consumed_at", or_dash(&v.consumed_at).to_owned()),
        ("fingerprint", or_dash(&v.fingerprint).to_owned()),
        ("request_id", or_dash(&v.request_id).to_owned()),
        (
            "result",
            v.result
                .as_ref()
                .map(|r| r.to_string())
                .unwrap_or_else(|| "-".into()),
        ),
        ("duplicate_attempts", v.duplicate_attempts.to_string()),
    ];
    for (k, val) in rows {
        out.push_str(&format!("{k:<19} {val}\n"));
    }
    out.push_str(&format!("\nevents ({}):\n", v.events.len()));
    out.push_str(&table(&v.events, false));
    out
}

fn events_table(page: &AuditPage) -> String {
    let mut out = table(&page.events, true);
    match &page.next_cursor {
        Some(c) => out.push_str(&format!("\nmore: --cursor {c}\n")),
        None => out.push_str(&format!("\n{} event(s), end\n", page.events.len())),
    }
    out
}

/// Aligned columns, one event a line.
fn table(events: &[AuditEvent], with_token: bool) -> String {
    let mut header = vec![
        "AT", "KIND", "ID", "SUBJECT", "BIZ_TYPE", "ORDER_ID", "CLIENT",
    ];
    if with_token {
        header.push("TOKEN");
    }
    header.push("DETAIL");
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            let mut r = vec![
                e.at.clone(),
                e.kind.to_owned(),
                e.id.clone(),
                or_dash(&e.subject).to_owned(),
                or_dash(&e.biz_type).to_owned(),
                or_dash(&e.order_id).to_owned(),
                or_dash(&e.client).to_owned(),
            ];
            if with_token {
                r.push(or_dash(&e.token).to_owned());
            }
            r.push(e.detail.to_string());
            r
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len() - 1;
        let mut s = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            if i == last {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(header.clone());
    for r in &rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

/// A cell a spreadsheet would run as a formula (`=`, `+`, `-`, `@`, a tab
/// or a carriage return first) gets a `'` in front, so it shows as text
/// (OWASP "CSV injection"). Subjects, order ids and details are chosen by
/// callers.
pub fn spreadsheet_safe(cell: &str) -> std::borrow::Cow<'_, str> {
    if cell.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        std::borrow::Cow::Owned(format!("'{cell}"))
    } else {
        std::borrow::Cow::Borrowed(cell)
    }
}

/// RFC 4180 (the `csv` crate: quoted when needed, quotes doubled), every
/// cell [`spreadsheet_safe`]; the header line first when `header`.
pub fn events_csv(events: &[AuditEvent], header: bool) -> String {
    let mut w = csv::WriterBuilder::new()
        .terminator(csv::Terminator::Any(b'\n'))
        .from_writer(Vec::new());
    // Writing into a Vec cannot fail.
    if header {
        let _ = w.write_record([
            "id", "at", "kind", "token", "subject", "biz_type", "order_id", "client", "detail",
        ]);
    }
    for e in events {
        let detail = e.detail.to_string();
        let cells = [
            e.id.as_str(),
            e.at.as_str(),
            e.kind,
            e.token.as_deref().unwrap_or_default(),
            e.subject.as_deref().unwrap_or_default(),
            e.biz_type.as_deref().unwrap_or_default(),
            e.order_id.as_deref().unwrap_or_default(),
            e.client.as_deref().unwrap_or_default(),
            detail.as_str(),
        ];
        let _ = w.write_record(cells.iter().map(|c| spreadsheet_safe(c).into_owned()));
    }
    String::from_utf8(w.into_inner().unwrap_or_default()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(subject: &str, detail: serde_json::Value) -> AuditEvent {
        AuditEvent {
            id: "7".into(),
            at: "2026-01-02T03:04:05.000000Z".into(),
            kind: "token.issued",
            token: None,
            subject: Some(subject.into()),
            biz_type: Some("order".into()),
            order_id: None,
            client: Some("payments".into()),
            detail,
        }
    }

    #[test]
    fn csv_quotes_when_needed_and_defuses_formulas() {
        let out = events_csv(&[event("a,b", serde_json::json!({"k": 1}))], true);
        let mut lines = out.lines();
        assert_eq!(
            lines.next(),
            Some("id,at,kind,token,subject,biz_type,order_id,client,detail")
        );
        assert_eq!(
            lines.next(),
            Some("7,2026-01-02T03:04:05.000000Z,token.issued,,\"a,b\",order,,payments,\"{\"\"k\"\":1}\"")
        );
        for (subject, cell) in [
            (
                "=HYPERLINK(\"http://x\")",
                "\"'=HYPERLINK(\"\"http://x\"\")\"",
            ),
            ("+1", "'+1"),
            ("-1+1", "'-1+1"),
            ("@SUM(A1)", "'@SUM(A1)"),
            ("\tx", "'\tx"),
            ("\rx", "\"'\rx\""),
            ("plain", "plain"),
        ] {
            let out = events_csv(&[event(subject, serde_json::json!({}))], false);
            let got = out.splitn(5, ',').nth(4).expect("subject cell");
            assert!(got.starts_with(cell), "{subject:?}: {got:?}");
        }
    }
}
