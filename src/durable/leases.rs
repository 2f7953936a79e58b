//! The SQL of processing leases (`biz.<name>.processing_lease`): the sweep
//! that marks consumes past their lease `uncertain` or finds the ones to
//! release, with Postgres's clock, and the uncertain queue's reads.
//! Candidates come from `tokens_in_flight_idx` (consumes with neither result
//! nor order event), so a sweep reads only what is in flight.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use super::DurableError;

/// Marks the consumes of `biz` past their lease (`lease_secs` after their
/// consume, by Postgres's clock) with neither result, release nor order
/// event as uncertain, with their `token.uncertain` / `key.uncertain` audit
/// row, at most `limit` at once, oldest first. Safe to run on every
/// instance at once: a row is marked once (under its row lock, skipping
/// rows another sweep holds), and its audit row once per generation.
/// Returns the ids marked.
pub async fn mark_uncertain(
    pool: &PgPool,
    biz: &str,
    lease_secs: i64,
    limit: i64,
) -> Result<Vec<i64>, DurableError> {
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            r#"
        WITH due AS (
            SELECT id FROM tokens
             WHERE biz_type = $1 AND state = 'consumed' AND result IS NULL AND order_id IS NULL
               AND uncertain_since IS NULL
               AND consumed_at <= now() - make_interval(secs => $2)
             ORDER BY consumed_at
             LIMIT $3
               FOR UPDATE SKIP LOCKED
        ), marked AS (
            UPDATE tokens t SET uncertain_since = now()
              FROM due
             WHERE t.id = due.id
            RETURNING t.id, t.token, t.key, t.subject, t.biz_type, t.client, t.gen,
                      t.consumed_at, t.request_id, t.uncertain_since
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT m.uncertain_since,
                   CASE WHEN m.key IS NULL THEN 'token.uncertain' ELSE 'key.uncertain' END::audit_kind,
                   m.id, CASE WHEN m.key IS NULL THEN m.token END, nullif(m.subject, ''),
                   m.biz_type, m.client, m.gen,
                   jsonb_strip_nulls(jsonb_build_object(
                       'by', 'lease', 'lease_seconds', $2, 'consumed_at', m.consumed_at,
                       'request_id', m.request_id, 'key', m.key))
              FROM marked m
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )
        SELECT id FROM marked
        "#,
        )
        .bind(biz)
        .bind(lease_secs as f64)
        .bind(limit)
    })
    .await?;
    rows.iter()
        .map(|r| r.try_get("id").map_err(DurableError::from))
        .collect()
}

/// A durable consume released by its lease (policy `release`): what Redis
/// must be told (the issued state at the new generation).
#[derive(Debug, Clone)]
pub struct LeaseReleased {
    pub id: i64,
    /// The token text, or a client key's handle: its Redis key's hash tag.
    pub handle: String,
    pub gen: i64,
    pub expires_at: DateTime<Utc>,
    pub is_key: bool,
}

/// Releases the durable consumes of `biz` past their lease (policy
/// `release`), each with its `token.released` / `key.released` audit row
/// (`detail.by = "lease"`), at most `limit` at once. The due check and the
/// release are one statement: a consume that got a result, a release or a
/// new consume in between is not touched.
pub async fn release_due(
    pool: &PgPool,
    biz: &str,
    lease_secs: i64,
    limit: i64,
) -> Result<Vec<LeaseReleased>, DurableError> {
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            r#"
        WITH due AS (
            SELECT id FROM tokens
             WHERE biz_type = $1 AND durability = 'durable' AND state = 'consumed'
               AND result IS NULL AND order_id IS NULL
               AND consumed_at <= now() - make_interval(secs => $2)
             ORDER BY consumed_at
             LIMIT $3
               FOR UPDATE SKIP LOCKED
        ), rel AS (
            UPDATE tokens t
               SET state = 'issued', gen = t.gen + 1, consumed_at = NULL, fingerprint = NULL,
                   request_id = NULL,
                   expires_at = CASE WHEN t.key IS NULL THEN t.expires_at ELSE now() END
              FROM due
             WHERE t.id = due.id AND t.state = 'consumed' AND t.result IS NULL
            RETURNING t.id, t.token, t.key, t.subject, t.biz_type, t.client, t.expires_at, t.gen
        ), audit AS (
            INSERT INTO audit_events (kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT CASE WHEN r.key IS NULL THEN 'token.released' ELSE 'key.released' END::audit_kind,
                   r.id, CASE WHEN r.key IS NULL THEN r.token END, nullif(r.subject, ''),
                   r.biz_type, r.client, r.gen,
                   jsonb_strip_nulls(jsonb_build_object(
                       'by', 'lease', 'lease_seconds', $2, 'key', r.key))
              FROM rel r
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )
        SELECT id, token, key IS NOT NULL AS is_key, expires_at, gen FROM rel
        "#,
        )
        .bind(biz)
        .bind(lease_secs as f64)
        .bind(limit)
    })
    .await?;
    rows.iter()
        .map(|r| {
            Ok(LeaseReleased {
                id: r.try_get("id")?,
                handle: r.try_get("token")?,
                gen: r.try_get("gen")?,
                expires_at: r.try_get("expires_at")?,
                is_key: r.try_get("is_key")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(DurableError::from)
}

/// A fast consume past its lease, as the journal brought it to Postgres
/// (policy `release`: Redis, which decides, is asked to release it at this
/// generation).
#[derive(Debug, Clone)]
pub struct DueFast {
    pub id: i64,
    pub handle: String,
    pub key: Option<String>,
    pub biz_type: String,
    pub subject: String,
    pub client: String,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub gen: i64,
}

/// The fast consumes of `biz` past their lease by Postgres's clock (see
/// [`DueFast`]), oldest first, at most `limit`.
pub async fn due_fast(
    pool: &PgPool,
    biz: &str,
    lease_secs: i64,
    limit: i64,
) -> Result<Vec<DueFast>, DurableError> {
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            "SELECT id, token, key, biz_type, subject, client, issued_at, expires_at, gen
               FROM tokens
              WHERE biz_type = $1 AND durability = 'fast' AND state = 'consumed'
                AND result IS NULL AND order_id IS NULL AND uncertain_since IS NULL
                AND consumed_at <= now() - make_interval(secs => $2)
              ORDER BY consumed_at
              LIMIT $3",
        )
        .bind(biz)
        .bind(lease_secs as f64)
        .bind(limit)
    })
    .await?;
    rows.iter()
        .map(|r| {
            Ok(DueFast {
                id: r.try_get("id")?,
                handle: r.try_get("token")?,
                key: r.try_get("key")?,
                biz_type: r.try_get("biz_type")?,
                subject: r.try_get("subject")?,
                client: r.try_get("client")?,
                issued_at: r.try_get("issued_at")?,
                expires_at: r.try_get("expires_at")?,
                gen: r.try_get("gen")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(DurableError::from)
}

/// One item of the uncertain queue.
#[derive(Debug, Clone)]
pub struct UncertainRow {
    pub id: i64,
    pub token: Option<String>,
    pub key: Option<String>,
    pub client: String,
    pub biz_type: String,
    pub subject: Option<String>,
    pub consumed_at: Option<DateTime<Utc>>,
    pub request_id: Option<String>,
    pub uncertain_since: DateTime<Utc>,
}

fn uncertain_row(r: &PgRow) -> Result<UncertainRow, sqlx::Error> {
    let key: Option<String> = r.try_get("key")?;
    let token: String = r.try_get("token")?;
    let subject: String = r.try_get("subject")?;
    Ok(UncertainRow {
        id: r.try_get("id")?,
        token: key.is_none().then_some(token),
        key,
        client: r.try_get("client")?,
        biz_type: r.try_get("biz_type")?,
        subject: (!subject.is_empty()).then_some(subject),
        consumed_at: r.try_get("consumed_at")?,
        request_id: r.try_get("request_id")?,
        uncertain_since: r.try_get("uncertain_since")?,
    })
}

/// The uncertain items (marked, still without result or release), oldest
/// first by `(uncertain_since, id)`, after `after` when given, of `biz`
/// when given.
pub async fn uncertain_page(
    pool: &PgPool,
    biz: Option<&str>,
    after: Option<(DateTime<Utc>, i64)>,
    limit: i64,
) -> Result<Vec<UncertainRow>, DurableError> {
    let (after_at, after_id) = match after {
        Some((at, id)) => (Some(at), id),
        None => (None, 0),
    };
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            "SELECT id, token, key, client, biz_type, subject, consumed_at, request_id,
                    uncertain_since
               FROM tokens
              WHERE uncertain_since IS NOT NULL AND result IS NULL
                AND ($1::text IS NULL OR biz_type = $1)
                AND ($2::timestamptz IS NULL OR (uncertain_since, id) > ($2, $3))
              ORDER BY uncertain_since, id
              LIMIT $4",
        )
        .bind(biz)
        .bind(after_at)
        .bind(after_id)
        .bind(limit)
    })
    .await?;
    rows.iter()
        .map(uncertain_row)
        .collect::<Result<_, sqlx::Error>>()
        .map_err(DurableError::from)
}

/// How many items are uncertain, per biz type (for the gauge).
pub async fn uncertain_counts(pool: &PgPool) -> Result<Vec<(String, i64)>, DurableError> {
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            "SELECT biz_type, count(*) AS n FROM tokens
              WHERE uncertain_since IS NOT NULL AND result IS NULL
              GROUP BY biz_type",
        )
    })
    .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("biz_type")?, r.try_get("n")?)))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(DurableError::from)
}
