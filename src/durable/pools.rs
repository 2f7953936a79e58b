//! The pools (payments never wait behind admin queries; admin and audit
//! reads may go to a replica), their connection options, and the bounded
//! fetch and transaction helpers every statement of the tier goes through.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use futures_util::{FutureExt, TryStreamExt};
use sqlx::postgres::{
    PgArguments, PgConnectOptions, PgDatabaseError, PgPool, PgPoolOptions, PgRow, PgSeverity,
};
use sqlx::{Connection, Either, Executor, Postgres, Transaction};

use super::DurableError;
use crate::config::PostgresSettings;
use crate::metrics::Metrics;

/// The pools: payments never wait behind admin queries.
#[derive(Debug, Clone)]
pub struct Pools {
    /// Consumes, issuance records, order events, the journal.
    pub hot: PgPool,
    /// Reconciliation, audit seals, the issued filter's loads, the metrics
    /// read on scrape: the primary, apart from payments.
    pub admin: PgPool,
    /// The read-only admin and audit queries (one token's, key's or order's
    /// story, event pages, stats, recorded reconcile runs, the uncertain
    /// queue): on `postgres.read_url`'s replica when set, else the very
    /// `admin` pool.
    pub read: PgPool,
    /// Whether `read` is a replica's (its answers may be stale).
    pub read_is_replica: bool,
    /// The longest a payment-path call may take on the client side:
    /// `acquire_timeout + statement_timeout` and a little for the network.
    pub deadline: std::time::Duration,
}

/// Connection options every pool of the primary uses: durable commits and
/// bounded statements.
pub fn connect_options(settings: &PostgresSettings) -> Result<PgConnectOptions, sqlx::Error> {
    connect_options_to(settings, &settings.url)
}

/// The hot pool's connection options: [`connect_options`], and no merge
/// joins. Every hot statement reads a handful of rows by key (a batch is at
/// most `consume_batch_size` items, the journal's at most its read size),
/// where a nested loop over the key's index is the plan. A merge join walks
/// an index from its first entry instead: planned generically for a batch
/// whose ids it cannot see, it read every row sorting before the batch's
/// last one (an order batch, in a full bench run: 94,010 rows and 33 ms for
/// 10 orders). Ruled out for the session, it is ruled out for every hot
/// statement, those to come included, without changing their plans
/// otherwise (`tests/api/batch_plans.rs`).
///
/// Nor JIT compilation. Postgres compiles a statement with LLVM when its
/// estimated cost passes `jit_above_cost` (100,000 by default), which no
/// statement reading a handful of rows needs; but an estimate that is far
/// off, or a plan left with a join the session ruled out (each costed
/// 10^10), passes it, and the statement is compiled before it runs. With
/// every join method ruled out (`tests/api/batch_plans.rs`), the results
/// and releases batch compiled for 1.1 s on an idle machine and ran past
/// the 5 s `statement_timeout` on a loaded one. On the payment path that
/// is latency for nothing, so it is off there; the admin pool's long scans
/// keep it.
pub fn hot_connect_options(settings: &PostgresSettings) -> Result<PgConnectOptions, sqlx::Error> {
    Ok(connect_options(settings)?.options([("enable_mergejoin", "off"), ("jit", "off")]))
}

/// [`connect_options`] for the server at `url` (the primary's or the
/// replica's).
fn connect_options_to(
    settings: &PostgresSettings,
    url: &str,
) -> Result<PgConnectOptions, sqlx::Error> {
    let timeout_ms = settings.statement_timeout.as_millis().to_string();
    let mut opts: PgConnectOptions = url.parse()?;
    // sqlx reads `sslmode` and `sslrootcert` itself; as libpq (and the
    // migrations' connection, `crate::tls`), `require` with a root
    // certificate verifies the chain.
    if let Ok(tls) = crate::tls::PgTls::from_url(url) {
        if tls.effective_mode() == crate::tls::SslMode::VerifyCa {
            opts = opts.ssl_mode(sqlx::postgres::PgSslMode::VerifyCa);
        }
    }
    Ok(opts.application_name("idempotency-ledger").options([
        // Acknowledged consumes must survive a crash (DESIGN.md: with
        // synchronous_commit off, 1 to 47 acknowledged commits were lost).
        ("synchronous_commit", "on"),
        ("statement_timeout", timeout_ms.as_str()),
        ("lock_timeout", timeout_ms.as_str()),
        ("idle_in_transaction_session_timeout", "30000"),
    ]))
}

/// What `before_acquire` answers for a connection used recently: use it as
/// it is. Ready at once and zero-sized, so boxing it allocates nothing: the
/// hot path pays one `Instant` read and one comparison per acquire.
struct UseAsIs;

impl Future for UseAsIs {
    type Output = Result<bool, sqlx::Error>;
    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(Ok(true))
    }
}

/// The hot pool's options. sqlx's own `test_before_acquire` pings before
/// every use: a round trip per statement, measured at 19 to 29 % of durable
/// consume throughput. Instead only a connection that has been idle for
/// `idle_check_after` is pinged, under its own bound (a half-open
/// connection, dropped silently by the network, would otherwise hang until
/// `acquire_timeout`); a dead one is closed and sqlx opens another within
/// the same acquire. That costs at most `pool_size` pings per
/// `idle_check_after`, and none while the pool is busy (sqlx hands idle
/// connections out oldest first, so under load none idles that long). A
/// connection that was used recently is not checked: if Postgres ended its
/// session meanwhile, [`fetch_optional`] and [`begin`] run the statement
/// again on another connection when that is provably safe.
fn hot_pool_options(settings: &PostgresSettings) -> PgPoolOptions {
    let check_after = settings.idle_check_after;
    let ping_bound = settings.acquire_timeout / 2;
    PgPoolOptions::new()
        .max_connections(settings.pool_size)
        .min_connections(0)
        .acquire_timeout(settings.acquire_timeout)
        .idle_timeout(settings.idle_timeout)
        .max_lifetime(settings.max_lifetime)
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            if meta.idle_for < check_after {
                return Box::pin(UseAsIs);
            }
            Box::pin(async move {
                let idle_ms = meta.idle_for.as_millis() as u64;
                match tokio::time::timeout(ping_bound, conn.ping()).await {
                    Ok(Ok(())) => Ok(true),
                    Ok(Err(error)) => {
                        tracing::info!(%error, idle_ms, "a pooled postgres connection died while idle: replaced");
                        Ok(false)
                    }
                    Err(_) => {
                        tracing::info!(idle_ms, "a pooled postgres connection did not answer a ping: replaced");
                        Ok(false)
                    }
                }
            })
        })
}

/// The admin pool's options (and the replica's): admin queries are rare,
/// so sqlx pings before every use.
fn admin_pool_options(settings: &PostgresSettings) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(settings.admin_pool_size)
        .min_connections(0)
        .acquire_timeout(settings.acquire_timeout)
        .idle_timeout(settings.idle_timeout)
        .max_lifetime(settings.max_lifetime)
}

impl Pools {
    /// Lazily connecting pools: the first query connects.
    pub fn new(settings: &PostgresSettings) -> Result<Pools, sqlx::Error> {
        let hot = hot_pool_options(settings).connect_lazy_with(hot_connect_options(settings)?);
        let admin = admin_pool_options(settings).connect_lazy_with(connect_options(settings)?);
        let (read, read_is_replica) = match &settings.read_url {
            Some(url) => (
                admin_pool_options(settings).connect_lazy_with(connect_options_to(settings, url)?),
                true,
            ),
            None => (admin.clone(), false),
        };
        let deadline = settings.acquire_timeout
            + settings.statement_timeout
            + std::time::Duration::from_millis(500);
        Ok(Pools {
            hot,
            admin,
            read,
            read_is_replica,
            deadline,
        })
    }

    /// Runs one payment-path call with the client-side deadline, so that a
    /// Postgres that stopped answering (SIGSTOP, a network partition) costs a
    /// bounded time and answers [`DurableError::TimedOut`].
    ///
    /// The deadline starts at the first poll, as an `async fn`'s would; but
    /// `f` is held once (see [`on_first_poll`]).
    pub fn bounded<T, E, F>(&self, f: F) -> impl Future<Output = Result<T, DurableError>>
    where
        F: Future<Output = Result<T, E>>,
        E: Into<DurableError>,
    {
        within(self.deadline, f)
    }

    pub async fn close(&self) {
        self.hot.close().await;
        self.admin.close().await;
        self.read.close().await;
    }
}

/// Whether Postgres ended the session before it answered any part of the
/// statement sent on it: proof that nothing of it was committed.
///
/// The proof, for one statement without transaction control sent with the
/// extended protocol (Bind, Execute, Sync; what sqlx sends): Postgres
/// commits the statement's implicit transaction when it reads the Sync, after
/// the statement has run and its rows and `CommandComplete` are written to
/// the session's output; its messages reach us in order. A session ended by
/// `pg_terminate_backend`, a fast shutdown (`57P01 admin_shutdown`) or
/// `idle_session_timeout` (`57P05`) says so in a FATAL error, sent after
/// everything it had written before. So a FATAL of those codes with no row
/// and no `CommandComplete` before it means the statement had not finished,
/// or had not even been read, when the session ended: its transaction was
/// rolled back, or never begun. Running it again is what the caller asked
/// for, once.
///
/// What is not proof, and so never retried: an end of stream or a reset
/// without that error (a crashed or killed server, `pg_ctl stop -m
/// immediate`, a proxy closing the socket) may come after a commit whose
/// answer was never sent; a FATAL after rows or `CommandComplete` may follow
/// the commit. Those answer 503 and the caller retries with its
/// `request_id`. The idle ping of [`Pools::new`] keeps them off the
/// connections that died while idle.
fn ended_before_reply(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    db.try_downcast_ref::<PgDatabaseError>().is_some_and(|pg| {
        pg.severity() == PgSeverity::Fatal && matches!(pg.code(), "57P01" | "57P05")
    })
}

/// Runs one statement and returns its first row, like sqlx's
/// `fetch_optional`, but on another pooled connection when Postgres had
/// ended the first one's session before answering (see
/// [`ended_before_reply`]): a connection it terminated while idle in the pool
/// no longer fails a request. `statement` builds the query for each try. Only
/// for a single statement without BEGIN or COMMIT inside (the proof rests on
/// its one implicit transaction).
pub async fn fetch_optional<'q, F>(
    pool: &PgPool,
    statement: F,
) -> Result<Option<PgRow>, sqlx::Error>
where
    F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
{
    Ok(fetch_rows(pool, statement, 1).await?.pop())
}

/// [`fetch_optional`] for a statement whose every row counts (the batched
/// consume of [`batch`]), with the same retry rule.
pub async fn fetch_all<'q, F>(pool: &PgPool, statement: F) -> Result<Vec<PgRow>, sqlx::Error>
where
    F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
{
    fetch_rows(pool, statement, usize::MAX).await
}

/// The first `keep` rows of one statement, run again on another pooled
/// connection when Postgres had ended the first one's session before it
/// answered (see [`fetch_optional`]).
async fn fetch_rows<'q, F>(
    pool: &PgPool,
    statement: F,
    keep: usize,
) -> Result<Vec<PgRow>, sqlx::Error>
where
    F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
{
    // Every pooled connection may have been terminated at once.
    let mut tries_left = pool.options().get_max_connections();
    loop {
        let mut conn = pool.acquire().await?;
        let mut answered = false;
        let mut rows = Vec::new();
        let failed = {
            let mut replies = conn.fetch_many(statement());
            loop {
                match replies.try_next().await {
                    Ok(Some(reply)) => {
                        answered = true;
                        if let Either::Right(row) = reply {
                            if rows.len() < keep {
                                rows.push(row);
                            }
                        }
                    }
                    Ok(None) => break None,
                    Err(e) => break Some(e),
                }
            }
        };
        match failed {
            None => return Ok(rows),
            Some(e) if !answered && tries_left > 0 && ended_before_reply(&e) => {
                tries_left -= 1;
                tracing::info!(error = %e, "postgres had ended this pooled connection's session: the statement runs on another");
            }
            Some(e) => return Err(e),
        }
    }
}

/// [`fetch_optional`] for a statement that always returns a row.
pub async fn fetch_one<'q, F>(pool: &PgPool, statement: F) -> Result<PgRow, sqlx::Error>
where
    F: Fn() -> sqlx::query::Query<'q, Postgres, PgArguments>,
{
    fetch_optional(pool, statement)
        .await?
        .ok_or(sqlx::Error::RowNotFound)
}

/// Starts a transaction. A `BEGIN` changes nothing, so one that fails because
/// the connection is gone (Postgres ended the session, the socket closed) is
/// sent again on another pooled connection: a connection that died while
/// idle no longer fails the request that takes it. Once the transaction has
/// begun nothing is retried (dropping it rolls back).
pub async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let mut tries_left = pool.options().get_max_connections();
    loop {
        match pool.begin().await {
            Err(e) if tries_left > 0 && connection_lost(&e) => {
                tries_left -= 1;
                tracing::info!(error = %e, "a pooled postgres connection was gone: BEGIN runs on another");
            }
            other => return other,
        }
    }
}

/// The connection failed (not the statement, nor the pool's wait).
fn connection_lost(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<PgDatabaseError>()
            .is_some_and(|pg| pg.severity() == PgSeverity::Fatal),
        _ => false,
    }
}

/// `f` under `deadline` from its first poll ([`Pools::bounded`]).
fn within<T, E, F>(
    deadline: std::time::Duration,
    f: F,
) -> impl Future<Output = Result<T, DurableError>>
where
    F: Future<Output = Result<T, E>>,
    E: Into<DurableError>,
{
    on_first_poll(move || {
        tokio::time::timeout(deadline, f).map(move |out| match out {
            Ok(out) => out.map_err(Into::into),
            Err(_) => Err(DurableError::TimedOut(deadline)),
        })
    })
}

/// Times one statement into `ledger_tier_duration_seconds{tier="postgres"}`,
/// from its first poll; `f` is held once (see [`on_first_poll`]).
pub(crate) fn timed<'a, T, E, F>(
    metrics: &'a Metrics,
    op: &'static str,
    f: F,
) -> impl Future<Output = Result<T, DurableError>> + 'a
where
    F: Future<Output = Result<T, E>> + 'a,
    E: Into<DurableError> + 'a,
    T: 'a,
{
    on_first_poll(move || {
        let start = Instant::now();
        f.map(move |out| {
            metrics
                .tier_duration
                .with_label_values(&["postgres", op])
                .observe(start.elapsed().as_secs_f64());
            out.map_err(Into::into)
        })
    })
}

/// The future `make` makes, made at the first poll. A wrapper written as an
/// `async fn` that awaits the future it was given holds that future twice
/// (the argument, and the moved copy it awaits), so each such layer doubled
/// the size of every consume's future, and every request copies its future
/// whole into the HTTP server's box. Made here, `make`'s captures and the
/// future it makes share one place.
fn on_first_poll<M, F>(make: M) -> impl Future<Output = F::Output>
where
    M: FnOnce() -> F,
    F: Future,
{
    futures_util::future::lazy(move |_| make()).flatten()
}

impl Pools {
    /// Whether the payment pool answers `SELECT 1` within `within` (readiness).
    pub async fn hot_reachable(&self, within: std::time::Duration) -> bool {
        let ping = fetch_one(&self.hot, || sqlx::query("SELECT 1"));
        matches!(tokio::time::timeout(within, ping).await, Ok(Ok(_)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A statement's future stand-in: 4 KiB held across its await.
    async fn big() -> Result<usize, DurableError> {
        let buf = [7u8; 4096];
        tokio::task::yield_now().await;
        Ok(buf.iter().map(|b| usize::from(*b)).sum())
    }

    /// Each wrapper adds a few words to the future it wraps: as `async fn`s
    /// they held it twice, and every consume's future is copied whole into
    /// the HTTP server's box.
    #[tokio::test]
    async fn the_postgres_wrappers_hold_their_future_once() {
        let inner = std::mem::size_of_val(&big());
        assert!(inner >= 4096, "{inner}");
        let metrics = Metrics::new();
        let wrapped = timed(&metrics, "test", big());
        assert!(std::mem::size_of_val(&wrapped) < inner + 128);
        assert_eq!(wrapped.await.ok(), Some(7 * 4096));
        let deadline = std::time::Duration::from_secs(5);
        let wrapped = within(deadline, big());
        // A timeout carries its timer (a `Sleep`) beside the future.
        let sleep = std::mem::size_of_val(&tokio::time::sleep(deadline));
        assert!(std::mem::size_of_val(&wrapped) < inner + sleep + 128);
        assert_eq!(wrapped.await.ok(), Some(7 * 4096));
    }
}
