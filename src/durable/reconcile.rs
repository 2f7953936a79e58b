//! Reconciliation statements: the run lock, batched reads that compare
//! Postgres with Redis, the order consistency check, the row-by-row
//! retention purge (the day partitions' drop is in [`super::partitions`]) and
//! the `reconcile.repaired` audit rows. Every read is a keyset page; every
//! write is one statement per batch.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Row};

use super::tokens::TokenState;
use super::DurableError;

/// Advisory lock key held for the whole run (the migration lock is ...0001).
pub const LOCK_KEY: i64 = 0x1ed6_e700_0003;

/// Takes the run lock on `conn` without waiting; `false` when another session
/// holds it. Released by [`unlock`] or when the connection closes.
pub async fn try_lock(conn: &mut PgConnection) -> Result<bool, DurableError> {
    Ok(sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(LOCK_KEY)
        .fetch_one(conn)
        .await?)
}

pub async fn unlock(conn: &mut PgConnection) -> Result<(), DurableError> {
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(LOCK_KEY)
        .execute(conn)
        .await?;
    Ok(())
}

/// What Postgres holds of a token that Redis has a key for.
#[derive(Debug, Clone)]
pub struct PgToken {
    pub id: i64,
    pub token: String,
    pub subject: String,
    pub biz_type: String,
    pub client: String,
    /// "durable" or "fast".
    pub durability: String,
    pub state: TokenState,
    /// Its generation (odd while consumed).
    pub gen: i64,
    pub consumed_at: Option<DateTime<Utc>>,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
    pub result: Option<String>,
    /// `expires_at - now()` in ms by Postgres's clock (negative: expired).
    pub remaining_ms: i64,
}

/// The rows of `ids` (missing ids are absent from the map).
pub async fn tokens_by_ids(
    pool: &PgPool,
    ids: &[i64],
) -> Result<HashMap<i64, PgToken>, DurableError> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = sqlx::query(
        "SELECT id, token, subject, biz_type, client, durability::text AS durability, state, gen,
                consumed_at, fingerprint, request_id, result::text AS result,
                (extract(epoch FROM expires_at - now()) * 1000)::bigint AS remaining_ms
           FROM tokens WHERE id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(pool)
    .await?;
    let mut out = HashMap::with_capacity(rows.len());
    for r in rows {
        let t = PgToken {
            id: r.try_get("id")?,
            token: r.try_get("token")?,
            subject: r.try_get("subject")?,
            biz_type: r.try_get("biz_type")?,
            client: r.try_get("client")?,
            durability: r.try_get("durability")?,
            state: r.try_get("state")?,
            gen: r.try_get("gen")?,
            consumed_at: r.try_get("consumed_at")?,
            fingerprint: r.try_get("fingerprint")?,
            request_id: r.try_get("request_id")?,
            result: r.try_get("result")?,
            remaining_ms: r.try_get("remaining_ms")?,
        };
        out.insert(t.id, t);
    }
    Ok(out)
}

/// A token Postgres says is issued and live.
#[derive(Debug, Clone)]
pub struct LiveToken {
    pub id: i64,
    pub token: String,
    pub subject: String,
    pub biz_type: String,
    pub client: String,
    pub expires_at: DateTime<Utc>,
    pub remaining_ms: i64,
    /// Its generation (even: issued).
    pub gen: i64,
}

/// Where a page of live tokens starts: after this `(expires_at, id)`.
pub type LiveCursor = (DateTime<Utc>, i64);

/// One keyset page of live issued tokens, ordered by `(expires_at, id)`
/// (index `tokens_issued_expiry_idx`), after `after`, with `id >= min_id`,
/// at least `margin_ms` from expiry.
///
/// The page is read in its own transaction with `enable_sort` off, so that
/// it comes in index order from each partition (a merge of index scans that
/// stops after `limit` rows). Left to its estimates, the planner expects no
/// row past a cursor beyond what the statistics have seen (tokens issued
/// since the last `ANALYZE`) and reads every row past the cursor to sort
/// them, on every page: N²/2/page rows for N such tokens.
pub async fn live_issued_page(
    pool: &PgPool,
    after: Option<LiveCursor>,
    min_id: i64,
    margin_ms: i64,
    limit: i64,
) -> Result<Vec<LiveToken>, DurableError> {
    let (after_exp, after_id) = after.unwrap_or((DateTime::<Utc>::UNIX_EPOCH, 0));
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL enable_sort = off")
        .execute(&mut *tx)
        .await?;
    let rows = sqlx::query(
        "SELECT id, token, subject, biz_type, client, expires_at, gen,
                (extract(epoch FROM expires_at - now()) * 1000)::bigint AS remaining_ms
           FROM tokens
          WHERE state = 'issued' AND expires_at > now() + make_interval(secs => $3)
            AND (expires_at, id) > ($1, $2) AND id >= $4
          ORDER BY expires_at, id LIMIT $5",
    )
    .bind(after_exp)
    .bind(after_id)
    .bind(margin_ms as f64 / 1000.0)
    .bind(min_id)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    rows.iter()
        .map(|r| {
            Ok(LiveToken {
                id: r.try_get("id")?,
                token: r.try_get("token")?,
                subject: r.try_get("subject")?,
                biz_type: r.try_get("biz_type")?,
                client: r.try_get("client")?,
                expires_at: r.try_get("expires_at")?,
                remaining_ms: r.try_get("remaining_ms")?,
                gen: r.try_get("gen")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// Which of `ids` are consumed now, with their generation (re-checked after
/// re-seeding).
pub async fn consumed_among(pool: &PgPool, ids: &[i64]) -> Result<Vec<(i64, i64)>, DurableError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    Ok(
        sqlx::query_as("SELECT id, gen FROM tokens WHERE id = ANY($1) AND state = 'consumed'")
            .bind(ids)
            .fetch_all(pool)
            .await?,
    )
}

/// One order's events, tokens and amounts as the consistency check sees them.
#[derive(Debug, Clone)]
pub struct OrderFacts {
    pub order_id: String,
    pub state: String,
    pub refunded_minor: i64,
    pub refund_events_sum: i64,
    pub paid_events: i64,
    pub closed_events: i64,
    /// Events whose token has no consumed `tokens` row bound to this order:
    /// one whose row is there but not so, or gone while the event is within
    /// retention (an event and its token's consume share one `now()`, and
    /// the purge takes a consumed row only past retention). A row gone with
    /// an older event is retention's doing, not a fault.
    pub unbacked_events: i64,
}

/// One keyset page of orders (`order_id > after`, updated since `since`);
/// `retention_secs`: `tokens.retention` (see [`OrderFacts::unbacked_events`]).
pub async fn orders_page(
    pool: &PgPool,
    after: &str,
    since: Option<DateTime<Utc>>,
    limit: i64,
    retention_secs: f64,
) -> Result<Vec<OrderFacts>, DurableError> {
    let rows = sqlx::query(
        r#"
        WITH o AS (
            SELECT order_id, state, refunded_minor FROM orders
             WHERE order_id > $1 AND updated_at >= coalesce($2, '-infinity'::timestamptz)
             ORDER BY order_id LIMIT $3
        )
        SELECT o.order_id, o.state::text AS state, o.refunded_minor,
               coalesce(sum(e.amount_minor) FILTER (WHERE e.kind = 'order.refunded'), 0)::bigint
                   AS refund_events_sum,
               count(e.id) FILTER (WHERE e.kind = 'order.paid') AS paid_events,
               count(e.id) FILTER (WHERE e.kind = 'order.closed') AS closed_events,
               count(e.id) FILTER (WHERE e.token_id IS NOT NULL AND NOT EXISTS (
                   SELECT 1 FROM tokens t
                    WHERE t.id = e.token_id AND t.state = 'consumed' AND t.order_id = o.order_id)
                   AND (e.at >= now() - make_interval(secs => $4)
                        OR EXISTS (SELECT 1 FROM tokens t WHERE t.id = e.token_id)))
                   AS unbacked_events
          FROM o LEFT JOIN order_events e ON e.order_id = o.order_id
         GROUP BY o.order_id, o.state, o.refunded_minor
         ORDER BY o.order_id
        "#,
    )
    .bind(after)
    .bind(since)
    .bind(limit)
    .bind(retention_secs)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(OrderFacts {
                order_id: r.try_get("order_id")?,
                state: r.try_get("state")?,
                refunded_minor: r.try_get("refunded_minor")?,
                refund_events_sum: r.try_get("refund_events_sum")?,
                paid_events: r.try_get("paid_events")?,
                closed_events: r.try_get("closed_events")?,
                unbacked_events: r.try_get("unbacked_events")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// Which records the retention purge takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PurgeKind {
    /// Consumed more than `retention` ago (and past their own expiry).
    Consumed,
    /// Never consumed, expired more than `retention` ago.
    Issued,
}

/// The rows each kind takes (`$1`: the retention in seconds); a day
/// partition is dropped when all of its rows meet one of them.
pub(super) const PURGE_CONSUMED: &str =
    "state = 'consumed' AND consumed_at < now() - make_interval(secs => $1)
     AND expires_at < now()";
pub(super) const PURGE_ISSUED: &str =
    "state = 'issued' AND expires_at < now() - make_interval(secs => $1)";

/// Leaves out the ids `[$2, $3)`: the day partitions not yet past their bound
/// (`partitions::kept_range`), whose rows go with their partition.
const OUTSIDE_KEPT: &str = "NOT (id >= $2 AND id < $3)";

fn purge_where(kind: PurgeKind) -> &'static str {
    match kind {
        PurgeKind::Consumed => PURGE_CONSUMED,
        PurgeKind::Issued => PURGE_ISSUED,
    }
}

/// How many records the purge would take outside `kept` (`[lo, hi)`, see
/// [`OUTSIDE_KEPT`]): those the row-by-row purge deletes and those of the day
/// partitions it drops whole.
pub async fn count_purgeable(
    pool: &PgPool,
    kind: PurgeKind,
    retention_secs: f64,
    kept: (i64, i64),
) -> Result<i64, DurableError> {
    Ok(sqlx::query_scalar(&format!(
        "SELECT count(*) FROM tokens WHERE {} AND {OUTSIDE_KEPT}",
        purge_where(kind)
    ))
    .bind(retention_secs)
    .bind(kept.0)
    .bind(kept.1)
    .fetch_one(pool)
    .await?)
}

/// Deletes one batch of purgeable records outside `kept` (`[lo, hi)`, see
/// [`OUTSIDE_KEPT`]), each with its `reconcile.repaired` audit row, in one
/// statement. Returns how many were deleted (0: done). Records bound to an
/// order go too (V19): the order's record of payment is its `order_events`
/// row and audit events, which stay. `by` (who asked for the run) goes into
/// each audit row's detail.
pub async fn purge_batch(
    pool: &PgPool,
    kind: PurgeKind,
    retention_secs: f64,
    kept: (i64, i64),
    limit: i64,
    by: &str,
) -> Result<u64, DurableError> {
    let n: i64 = sqlx::query_scalar(&format!(
        r#"
        WITH victims AS (
            SELECT id FROM tokens WHERE {} AND {OUTSIDE_KEPT} LIMIT $4 FOR UPDATE SKIP LOCKED
        ), del AS (
            DELETE FROM tokens t USING victims v WHERE t.id = v.id
            RETURNING t.id, t.token, t.key, t.subject, t.biz_type, t.client, t.state,
                      t.consumed_at, t.expires_at
        ), audit AS (
            INSERT INTO audit_events (kind, token_id, token, subject, biz_type, client, detail)
            SELECT 'reconcile.repaired', d.id, CASE WHEN d.key IS NULL THEN d.token END,
                   nullif(d.subject, ''), d.biz_type, d.client,
                   jsonb_strip_nulls(jsonb_build_object(
                       'class', 'expired_purgeable', 'action', 'purged',
                       'state', d.state::text, 'consumed_at', d.consumed_at,
                       'expires_at', CASE WHEN d.key IS NULL THEN d.expires_at END,
                       'key', d.key, 'by', $5::text))
              FROM del d
        )
        SELECT count(*) FROM del
        "#,
        purge_where(kind)
    ))
    .bind(retention_secs)
    .bind(kept.0)
    .bind(kept.1)
    .bind(limit)
    .bind(by)
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// One repair, for its `reconcile.repaired` audit row.
#[derive(Debug, Clone)]
pub struct Repair {
    pub class: &'static str,
    pub action: &'static str,
    pub token_id: Option<i64>,
    pub token: Option<String>,
    pub subject: Option<String>,
    pub biz_type: Option<String>,
    pub client: Option<String>,
    /// Extra facts for the detail (e.g. the number of journal entries).
    pub count: Option<i64>,
}

/// Writes the audit rows of a batch of repairs in one statement; `by` (who
/// asked for the run) goes into each one's detail.
pub async fn record_repairs(
    pool: &PgPool,
    by: &str,
    repairs: &[Repair],
) -> Result<(), DurableError> {
    if repairs.is_empty() {
        return Ok(());
    }
    let mut ids = Vec::with_capacity(repairs.len());
    let mut tokens = Vec::with_capacity(repairs.len());
    let mut subjects = Vec::with_capacity(repairs.len());
    let mut bizes = Vec::with_capacity(repairs.len());
    let mut clients = Vec::with_capacity(repairs.len());
    let mut classes = Vec::with_capacity(repairs.len());
    let mut actions = Vec::with_capacity(repairs.len());
    let mut counts = Vec::with_capacity(repairs.len());
    for r in repairs {
        ids.push(r.token_id);
        tokens.push(r.token.as_deref());
        subjects.push(r.subject.as_deref());
        bizes.push(r.biz_type.as_deref());
        clients.push(r.client.as_deref());
        classes.push(r.class);
        actions.push(r.action);
        counts.push(r.count);
    }
    sqlx::query(
        r#"
        INSERT INTO audit_events (kind, token_id, token, subject, biz_type, client, detail)
        SELECT 'reconcile.repaired', r.id, r.token, r.subject, r.biz_type, r.client,
               jsonb_strip_nulls(jsonb_build_object('class', r.class, 'action', r.action,
                                                    'entries', r.n, 'by', $9::text))
          FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                      $7::text[], $8::bigint[])
               AS r(id, token, subject, biz_type, client, class, action, n)
        "#,
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(&subjects)
    .bind(&bizes)
    .bind(&clients)
    .bind(&classes)
    .bind(&actions)
    .bind(&counts)
    .bind(by)
    .execute(pool)
    .await?;
    Ok(())
}

/// One finished run, as `reconcile_runs` records it.
#[derive(Debug, Clone)]
pub struct RunRecord {
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub dry_run: bool,
    pub interrupted: bool,
    pub errors: Vec<String>,
    /// Counts by class name.
    pub found: serde_json::Value,
    pub repaired: serde_json::Value,
    /// The whole report, as answered.
    pub report: serde_json::Value,
}

impl RunRecord {
    /// Not a dry run, not interrupted, every phase finished.
    pub fn complete(&self) -> bool {
        !self.dry_run && !self.interrupted && self.errors.is_empty()
    }
}

/// Records a run (one row, its whole report with `by` included); its id.
pub async fn record_run(pool: &PgPool, run: &RunRecord) -> Result<i64, DurableError> {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO reconcile_runs
             (started_at, finished_at, dry_run, interrupted, errors, complete, found, repaired, report)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         RETURNING id",
    )
    .bind(run.started_at)
    .bind(run.finished_at)
    .bind(run.dry_run)
    .bind(run.interrupted)
    .bind(sqlx::types::Json(&run.errors))
    .bind(run.complete())
    .bind(&run.found)
    .bind(&run.repaired)
    .bind(&run.report)
    .fetch_one(pool)
    .await?;
    Ok(id)
}

/// One recorded run, as [`runs`] reads it.
#[derive(Debug, Clone)]
pub struct RecordedRun {
    pub id: i64,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub dry_run: bool,
    pub interrupted: bool,
    pub errors: serde_json::Value,
    pub found: serde_json::Value,
    pub repaired: serde_json::Value,
    /// `None` for a run recorded before whole reports were kept.
    pub report: Option<serde_json::Value>,
}

/// Recorded runs, newest first: at most `limit`, with ids below `before`.
pub async fn runs(
    pool: &PgPool,
    limit: i64,
    before: Option<i64>,
) -> Result<Vec<RecordedRun>, DurableError> {
    let rows = sqlx::query(
        "SELECT id, started_at, finished_at, dry_run, interrupted, errors, found, repaired, report
           FROM reconcile_runs
          WHERE $2::bigint IS NULL OR id < $2
          ORDER BY id DESC
          LIMIT $1",
    )
    .bind(limit)
    .bind(before)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(RecordedRun {
                id: r.try_get("id")?,
                started_at: r.try_get("started_at")?,
                finished_at: r.try_get("finished_at")?,
                dry_run: r.try_get("dry_run")?,
                interrupted: r.try_get("interrupted")?,
                errors: r.try_get("errors")?,
                found: r.try_get("found")?,
                repaired: r.try_get("repaired")?,
                report: r.try_get("report")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(DurableError::from)
}

/// How many `token.conflict` events the audit trail holds (one indexed
/// count: `audit_kind_idx`).
pub async fn conflicts(pool: &PgPool) -> Result<i64, DurableError> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind = 'token.conflict'")
            .fetch_one(pool)
            .await?,
    )
}

/// The finish time and findings (by class name) of the last complete run.
pub async fn last_complete_run(
    pool: &PgPool,
) -> Result<Option<(DateTime<Utc>, HashMap<String, i64>)>, DurableError> {
    let row = sqlx::query(
        "SELECT finished_at, found FROM reconcile_runs
          WHERE complete ORDER BY finished_at DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let at: DateTime<Utc> = row.try_get("finished_at")?;
    let found: sqlx::types::Json<HashMap<String, i64>> = row.try_get("found")?;
    Ok(Some((at, found.0)))
}
