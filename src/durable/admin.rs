//! Admin statements: one token with its audit events, audit event pages
//! (keyset over `(at, id)`, newest first, only the filters given), the
//! fleet-wide stats, and how stale a replica's data may be. Run on the read
//! pool (the admin pool, or a replica's), never the payment path's.

use chrono::{DateTime, Utc};
use serde_json::Value as Json;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Postgres, QueryBuilder, Row};

use super::tokens::TokenState;
use super::DurableError;
use crate::domain::AuditKind;

/// A `tokens` row as the admin view needs it.
#[derive(Debug, Clone)]
pub struct TokenRow {
    pub token: String,
    pub biz_type: String,
    pub subject: String,
    pub client: String,
    pub state: TokenState,
    /// `expires_at <= now()` by Postgres's clock.
    pub expired: bool,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub consumed_at: Option<DateTime<Utc>>,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
    pub result: Option<Json>,
    pub duplicate_attempts: i64,
    /// Marked by a processing lease's sweep (see V14).
    pub uncertain_since: Option<DateTime<Utc>>,
}

/// One `audit_events` row.
#[derive(Debug, Clone)]
pub struct EventRow {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub kind: AuditKind,
    pub token: Option<String>,
    pub subject: Option<String>,
    pub biz_type: Option<String>,
    pub order_id: Option<String>,
    pub client: Option<String>,
    pub detail: Json,
}

const EVENT_COLUMNS: &str =
    "id, at, kind::text AS kind, token, subject, biz_type, order_id, client, detail";

fn audit_kind(text: String) -> Result<AuditKind, sqlx::Error> {
    AuditKind::parse(&text)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown audit kind `{text}`").into()))
}

fn event(row: &PgRow) -> Result<EventRow, sqlx::Error> {
    Ok(EventRow {
        id: row.try_get("id")?,
        at: row.try_get("at")?,
        kind: audit_kind(row.try_get("kind")?)?,
        token: row.try_get("token")?,
        subject: row.try_get("subject")?,
        biz_type: row.try_get("biz_type")?,
        order_id: row.try_get("order_id")?,
        client: row.try_get("client")?,
        detail: row.try_get("detail")?,
    })
}

/// The token's row (if Postgres has one) and its audit events (oldest first,
/// at most `limit`), read in one snapshot: a record written between two
/// separate reads cannot show up as events without their row.
pub async fn token_story(
    pool: &PgPool,
    id: i64,
    limit: i64,
) -> Result<(Option<TokenRow>, Vec<EventRow>), DurableError> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    let row = token(&mut tx, id).await?;
    let events = token_events(&mut tx, id, limit).await?;
    tx.commit().await?;
    Ok((row, events))
}

async fn token(conn: &mut PgConnection, id: i64) -> Result<Option<TokenRow>, DurableError> {
    let row = sqlx::query(
        "SELECT token, biz_type, subject, client, state, expires_at <= now() AS expired,
                issued_at, expires_at, consumed_at, fingerprint, request_id, result,
                duplicate_attempts, uncertain_since
           FROM tokens WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(conn)
    .await?;
    let Some(r) = row else { return Ok(None) };
    Ok(Some(TokenRow {
        token: r.try_get("token")?,
        biz_type: r.try_get("biz_type")?,
        subject: r.try_get("subject")?,
        client: r.try_get("client")?,
        state: r.try_get("state")?,
        expired: r.try_get("expired")?,
        issued_at: r.try_get("issued_at")?,
        expires_at: r.try_get("expires_at")?,
        consumed_at: r.try_get("consumed_at")?,
        fingerprint: r.try_get("fingerprint")?,
        request_id: r.try_get("request_id")?,
        result: r.try_get("result")?,
        duplicate_attempts: r.try_get("duplicate_attempts")?,
        uncertain_since: r.try_get("uncertain_since")?,
    }))
}

async fn token_events(
    conn: &mut PgConnection,
    id: i64,
    limit: i64,
) -> Result<Vec<EventRow>, DurableError> {
    let rows = sqlx::query(&format!(
        "SELECT {EVENT_COLUMNS} FROM audit_events WHERE token_id = $1 ORDER BY at, id LIMIT $2"
    ))
    .bind(id)
    .bind(limit)
    .fetch_all(conn)
    .await?;
    Ok(rows.iter().map(event).collect::<Result<_, _>>()?)
}

/// Filters of an audit page; `None` means "any".
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    pub subject: Option<String>,
    pub biz_type: Option<String>,
    pub order_id: Option<String>,
    /// The acting or owning client (`audit_events.client`).
    pub client: Option<String>,
    /// Any of these kinds; empty: any kind.
    pub kinds: Vec<AuditKind>,
    /// Inclusive.
    pub since: Option<DateTime<Utc>>,
    /// Exclusive.
    pub until: Option<DateTime<Utc>>,
    /// Only events strictly older than this `(at, id)` (the cursor).
    pub before: Option<(DateTime<Utc>, i64)>,
}

/// Up to `limit` events, newest first by `(at, id)`. Only the filters given
/// appear in the statement, so each query can use its column's index
/// (`(col, at DESC, id DESC)`), or `(at DESC, id DESC)` without filters.
pub async fn events(
    pool: &PgPool,
    filter: &EventFilter,
    limit: i64,
) -> Result<Vec<EventRow>, DurableError> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!(
        "SELECT {EVENT_COLUMNS} FROM audit_events WHERE true"
    ));
    if let Some(v) = &filter.subject {
        q.push(" AND subject = ").push_bind(v.clone());
    }
    if let Some(v) = &filter.biz_type {
        q.push(" AND biz_type = ").push_bind(v.clone());
    }
    if let Some(v) = &filter.order_id {
        q.push(" AND order_id = ").push_bind(v.clone());
    }
    if let Some(v) = &filter.client {
        q.push(" AND client = ").push_bind(v.clone());
    }
    match filter.kinds.as_slice() {
        [] => {}
        // Equality keeps the ordered scan of `(kind, at DESC, id DESC)`.
        [one] => {
            q.push(" AND kind = ")
                .push_bind(one.as_str())
                .push("::audit_kind");
        }
        many => {
            let texts: Vec<&'static str> = many.iter().map(|k| k.as_str()).collect();
            q.push(" AND kind = ANY(")
                .push_bind(texts)
                .push("::audit_kind[])");
        }
    }
    if let Some(v) = filter.since {
        q.push(" AND at >= ").push_bind(v);
    }
    if let Some(v) = filter.until {
        q.push(" AND at < ").push_bind(v);
    }
    if let Some((at, id)) = filter.before {
        q.push(" AND (at, id) < (")
            .push_bind(at)
            .push(", ")
            .push_bind(id)
            .push(")");
    }
    q.push(" ORDER BY at DESC, id DESC LIMIT ").push_bind(limit);
    let rows = q.build().fetch_all(pool).await?;
    Ok(rows.iter().map(event).collect::<Result<_, _>>()?)
}

/// Fleet-wide counters of one biz type over a window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatRow {
    pub biz_type: String,
    pub issued: i64,
    pub consumed: i64,
    pub duplicates: i64,
    pub expired: i64,
    pub invalid: i64,
}

/// Sums `stats_minutely` over the minutes that overlap the last `window_secs`
/// (by Postgres's clock).
pub async fn stats(pool: &PgPool, window_secs: i64) -> Result<Vec<StatRow>, DurableError> {
    let rows = sqlx::query(
        "SELECT biz_type, sum(issued)::bigint AS issued, sum(consumed)::bigint AS consumed,
                sum(duplicates)::bigint AS duplicates, sum(expired)::bigint AS expired,
                sum(invalid)::bigint AS invalid
           FROM stats_minutely
          WHERE minute >= date_trunc('minute', now() - make_interval(secs => $1))
          GROUP BY biz_type ORDER BY biz_type",
    )
    .bind(window_secs as f64)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(StatRow {
                biz_type: r.try_get("biz_type")?,
                issued: r.try_get("issued")?,
                consumed: r.try_get("consumed")?,
                duplicates: r.try_get("duplicates")?,
                expired: r.try_get("expired")?,
                invalid: r.try_get("invalid")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// How old the data of the server behind `pool` may be, in milliseconds
/// (one cheap statement, no table read).
///
/// 0 on a primary, and on a standby that has replayed all the WAL it
/// received. Else the time since the last transaction it replayed committed
/// on the primary (or, before it replayed any, since it started): an upper
/// bound, and an overstatement when the primary has been idle since that
/// commit. A standby cut off from its primary that had replayed everything
/// it received before also answers 0: it cannot know what it missed.
pub async fn data_lag_ms(pool: &PgPool) -> Result<i64, DurableError> {
    let row = sqlx::query(
        "SELECT CASE
                  WHEN NOT pg_is_in_recovery() THEN 0
                  WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0
                  ELSE greatest(0, (extract(epoch FROM now() - coalesce(
                         pg_last_xact_replay_timestamp(), pg_postmaster_start_time())) * 1000))::bigint
                END AS lag_ms",
    )
    .fetch_one(pool)
    .await?;
    Ok(row.try_get("lag_ms")?)
}
