//! Token statements. The consume is one statement: the primary key decides
//! first use versus duplicate, `now()` decides expiry, and the audit row is
//! written by the same statement, so either both happen or neither does.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde_json::Value as Json;
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use super::DurableError;
use crate::config::Durability;
use crate::metrics::StatCounts;

/// A token's row state (Postgres enum `token_state`, see `durable::pg_enum`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenState {
    Issued,
    Consumed,
}

impl TokenState {
    pub const ALL: [TokenState; 2] = [TokenState::Issued, TokenState::Consumed];

    pub fn as_str(self) -> &'static str {
        match self {
            TokenState::Issued => "issued",
            TokenState::Consumed => "consumed",
        }
    }
}

/// Everything the signed token says, as a row.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRecord {
    pub id: i64,
    pub token: String,
    pub biz_type: String,
    pub durability: Durability,
    pub subject: String,
    pub client: String,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// A client key's text (`/v1/keys`); `None` for a token. A key's `id`
    /// and `token` (its handle) are derived from (client, biz type, key),
    /// see [`crate::domain::key`].
    pub key: Option<String>,
}

/// The consumed state of a token as Postgres holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Existing {
    pub state: TokenState,
    pub consumed_at: Option<DateTime<Utc>>,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
    pub result: Option<Json>,
    pub order_id: Option<String>,
    pub expires_at: DateTime<Utc>,
    /// The token's generation: bumped by every consume and release (odd
    /// while consumed); a result belongs to the consumed generation.
    pub gen: i64,
    /// When a processing lease's sweep found it without result or release
    /// (`on_lease_expiry = "uncertain"`); cleared by a release.
    pub uncertain_since: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ConsumeRow {
    /// This statement consumed it.
    Won { consumed_at: DateTime<Utc> },
    /// It was there already (consumed, or issued but past `now()`).
    Existing(Existing),
    /// No row, and the token is past `now()`: never consumed, expired.
    Expired,
}

pub(crate) fn existing(row: &PgRow) -> Result<Existing, sqlx::Error> {
    Ok(Existing {
        state: row.try_get("state")?,
        consumed_at: row.try_get("consumed_at")?,
        fingerprint: row.try_get("fingerprint")?,
        request_id: row.try_get("request_id")?,
        result: row.try_get("result")?,
        order_id: row.try_get("order_id")?,
        expires_at: row.try_get("expires_at")?,
        gen: row.try_get("gen")?,
        // Read where a duplicate's answer needs it; absent elsewhere.
        uncertain_since: row.try_get("uncertain_since").unwrap_or(None),
    })
}

const SELECT_EXISTING: &str =
    "SELECT state, consumed_at, fingerprint, request_id, result, order_id, expires_at, gen,
            uncertain_since
       FROM tokens WHERE id = $1";

/// Reads a token's state.
pub async fn find(pool: &PgPool, id: i64) -> Result<Option<Existing>, DurableError> {
    let row = super::fetch_optional(pool, || sqlx::query(SELECT_EXISTING).bind(id)).await?;
    Ok(row.as_ref().map(existing).transpose()?)
}

/// [`find`] on one connection (inside a transaction).
pub(crate) async fn find_on(
    conn: &mut sqlx::PgConnection,
    id: i64,
) -> Result<Option<Existing>, DurableError> {
    let row = sqlx::query(SELECT_EXISTING)
        .bind(id)
        .fetch_optional(conn)
        .await?;
    Ok(row.as_ref().map(existing).transpose()?)
}

/// A token's state for a read that changes nothing, with Postgres's clock,
/// which has the last word on expiry (as in the consume statement). One
/// round trip; `None`: no row (the issuance record is still on its way, or
/// the record was purged after its retention).
pub async fn read(
    pool: &PgPool,
    id: i64,
) -> Result<(DateTime<Utc>, Option<Existing>), DurableError> {
    let row = super::fetch_one(pool, || {
        sqlx::query(
            "SELECT now() AS now, t.id IS NOT NULL AS found, t.state, t.consumed_at, t.fingerprint,
                    t.request_id, t.result, t.order_id, t.expires_at, t.gen, t.uncertain_since
               FROM (SELECT 1) AS one LEFT JOIN tokens t ON t.id = $1",
        )
        .bind(id)
    })
    .await?;
    let now = row.try_get("now")?;
    let found: bool = row.try_get("found")?;
    Ok((now, if found { Some(existing(&row)?) } else { None }))
}

/// Whom a token was issued to: its `(subject, client)` as Postgres recorded
/// them (`None`: no record yet, or purged).
pub async fn owner(pool: &PgPool, id: i64) -> Result<Option<(String, String)>, DurableError> {
    let row = super::fetch_optional(pool, || {
        sqlx::query("SELECT subject, client FROM tokens WHERE id = $1").bind(id)
    })
    .await?;
    Ok(match row {
        Some(r) => Some((r.try_get("subject")?, r.try_get("client")?)),
        None => None,
    })
}

/// The durable consume: one statement, one round trip.
pub async fn consume(
    pool: &PgPool,
    rec: &TokenRecord,
    fingerprint: Option<&str>,
    request_id: Option<&str>,
) -> Result<ConsumeRow, DurableError> {
    consume_versioned(pool, rec, fingerprint, request_id)
        .await
        .map(|(row, _)| row)
}

/// The durable consume, with the generation the token is at afterwards
/// (the one this statement moved it to when it won; the row's otherwise,
/// 0 when there is no row). A win moves an issued token to the next
/// generation in the same statement as the state change and its audit row.
pub async fn consume_versioned(
    pool: &PgPool,
    rec: &TokenRecord,
    fingerprint: Option<&str>,
    request_id: Option<&str>,
) -> Result<(ConsumeRow, i64), DurableError> {
    let row =
        super::fetch_optional(pool, || consume_statement(rec, fingerprint, request_id)).await?;
    match consumed_row(row)? {
        Some(decided) => Ok(decided),
        None => fresh_read(pool, rec.id).await,
    }
}

/// The statement of [`consume_versioned`]: claims the token (inserting its
/// row when Postgres has not heard of it) and writes its audit row, or
/// returns the row as it stands.
pub(crate) fn consume_statement<'q>(
    rec: &'q TokenRecord,
    fingerprint: Option<&'q str>,
    request_id: Option<&'q str>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(CONSUME_SQL)
        .bind(rec.id)
        .bind(&rec.token)
        .bind(&rec.biz_type)
        .bind(rec.durability.as_str())
        .bind(&rec.subject)
        .bind(&rec.client)
        .bind(rec.issued_at)
        .bind(rec.expires_at)
        .bind(fingerprint)
        .bind(request_id)
}

const CONSUME_SQL: &str = r#"
        WITH claim AS (
            INSERT INTO tokens AS t (id, token, biz_type, durability, subject, client, issued_at,
                                     expires_at, state, gen, consumed_at, fingerprint, request_id)
            SELECT $1, $2, $3, $4::durability, $5, $6, $7, $8, 'consumed', 1, now(), $9, $10
             WHERE $8 > now()
            ON CONFLICT (id) DO UPDATE
               SET state = 'consumed', gen = t.gen + 1, consumed_at = now(),
                   fingerprint = EXCLUDED.fingerprint, request_id = EXCLUDED.request_id
             WHERE t.state = 'issued' AND t.expires_at > now()
            RETURNING t.consumed_at, t.gen
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT c.consumed_at, 'token.consumed', $1, $2, $5, $3, $6, c.gen,
                   jsonb_strip_nulls(jsonb_build_object('fingerprint', $9::text, 'request_id', $10::text))
              FROM claim c
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )
        SELECT true AS won, 'consumed'::token_state AS state, c.consumed_at,
               NULL::text AS fingerprint, NULL::text AS request_id, NULL::jsonb AS result,
               NULL::text AS order_id, $8 AS expires_at, c.gen,
               NULL::timestamptz AS uncertain_since
          FROM claim c
        UNION ALL
        SELECT false, t.state, t.consumed_at, t.fingerprint, t.request_id, t.result, t.order_id,
               t.expires_at, t.gen, t.uncertain_since
          FROM tokens t
         WHERE t.id = $1 AND NOT EXISTS (SELECT 1 FROM claim)
        "#;

/// What [`consume_statement`]'s row says; `None`: not decided by it (a fresh
/// read, [`fresh_read`], tells the rest).
pub(crate) fn consumed_row(
    row: Option<sqlx::postgres::PgRow>,
) -> Result<Option<(ConsumeRow, i64)>, DurableError> {
    match row {
        Some(r) if r.try_get::<bool, _>("won")? => Ok(Some((
            ConsumeRow::Won {
                consumed_at: r.try_get("consumed_at")?,
            },
            r.try_get("gen")?,
        ))),
        Some(r) => {
            let e = existing(&r)?;
            if e.state == TokenState::Consumed {
                let gen = e.gen;
                return Ok(Some((ConsumeRow::Existing(e), gen)));
            }
            // Not claimed, yet our snapshot says issued: either it is past
            // `now()`, or a concurrent consume committed after our snapshot was
            // taken (the conflict check waited for it and saw `consumed`). A
            // fresh read tells them apart.
            Ok(None)
        }
        // Nothing claimed and nothing in our snapshot: expired and unknown,
        // or a concurrent consume inserted the row after our snapshot.
        None => Ok(None),
    }
}

pub(crate) async fn fresh_read(pool: &PgPool, id: i64) -> Result<(ConsumeRow, i64), DurableError> {
    Ok(match find(pool, id).await? {
        Some(e) => {
            let gen = e.gen;
            (ConsumeRow::Existing(e), gen)
        }
        None => (ConsumeRow::Expired, 0),
    })
}

#[derive(Debug, Clone, PartialEq)]
pub enum ResultRow {
    Recorded,
    Existing(Existing),
    Unknown,
}

/// What [`set_result_versioned`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum ResultDecided {
    /// Recorded now: the consumed state it belongs to, result included.
    Recorded(Existing),
    /// Not recorded: the token as it is (another result, or not consumed).
    Existing(Existing),
    Unknown,
}

/// Records the business result of a consumed token, with its audit row.
pub async fn set_result(pool: &PgPool, id: i64, result: &Json) -> Result<ResultRow, DurableError> {
    Ok(
        match set_result_versioned(pool, id, result, None, None).await? {
            ResultDecided::Recorded(_) => ResultRow::Recorded,
            ResultDecided::Existing(e) => ResultRow::Existing(e),
            ResultDecided::Unknown => ResultRow::Unknown,
        },
    )
}

/// Records the business result of a consumed token, with its audit row, and
/// returns the consumed state it now belongs to (its generation, time,
/// request id and fingerprint: what a write back to Redis needs). A result
/// does not change the generation. `detail` joins the audit row's detail
/// (an operator's result: `{"by", "reason"}`).
pub async fn set_result_versioned(
    pool: &PgPool,
    id: i64,
    result: &Json,
    detail: Option<&Json>,
    of_request: Option<&str>,
) -> Result<ResultDecided, DurableError> {
    let row = super::fetch_optional(pool, || {
        set_result_statement(id, result, detail, of_request)
    })
    .await?;
    if let Some(r) = row {
        return Ok(ResultDecided::Recorded(existing(&r)?));
    }
    Ok(match find(pool, id).await? {
        Some(e) => ResultDecided::Existing(e),
        None => ResultDecided::Unknown,
    })
}

/// The statement of [`set_result_versioned`]: a row when it recorded the
/// result (its audit row in the same statement), none otherwise.
pub(crate) fn set_result_statement<'q>(
    id: i64,
    result: &'q Json,
    detail: Option<&'q Json>,
    of_request: Option<&'q str>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(
        r#"
        WITH lk AS (
            -- The conditions are the locked row's (its newest version, as
            -- the update's): named on the update itself, the row's state
            -- let a cached plan made on statistics that saw few consumed
            -- rows look the id up through the index of every consumed row.
            -- The update names `$1` itself too, so that it is pruned to the
            -- id's partition before it runs (joined on `lk.id` alone, it
            -- set up an update of every partition: a third fewer lone
            -- results a second in pgbench).
            SELECT id, state, result IS NULL AS no_result, request_id
              FROM tokens WHERE id = $1 FOR UPDATE
        ), upd AS (
            UPDATE tokens t SET result = $2, result_at = now()
              FROM lk
             WHERE t.id = $1 AND t.id = lk.id AND lk.state = 'consumed' AND lk.no_result
               AND ($4::text IS NULL OR lk.request_id = $4)
            RETURNING t.id, t.token, t.key, t.subject, t.biz_type, t.client, t.state, t.consumed_at,
                      t.fingerprint, t.request_id, t.result, t.order_id, t.expires_at, t.gen,
                      t.result_at
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT u.result_at, CASE WHEN u.key IS NULL THEN 'token.result' ELSE 'key.result' END::audit_kind,
                   u.id, CASE WHEN u.key IS NULL THEN u.token END, nullif(u.subject, ''), u.biz_type,
                   u.client, u.gen, jsonb_build_object('result', $2) || CASE WHEN u.key IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('key', u.key) END
                   || COALESCE($3::jsonb, '{}'::jsonb)
              FROM upd u
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )
        SELECT state, consumed_at, fingerprint, request_id, result, order_id, expires_at, gen FROM upd
        "#,
    )
    .bind(id)
    .bind(result)
    .bind(detail)
    .bind(of_request)
}

#[derive(Debug, Clone, PartialEq)]
pub enum ReleaseRow {
    /// Released now: issued again at generation `gen`.
    Released {
        expires_at: DateTime<Utc>,
        gen: i64,
    },
    Existing(Existing),
    Unknown,
}

/// Returns a consumed token with no result and no order event to issued, at
/// the next generation, with its audit row.
pub async fn release(pool: &PgPool, id: i64) -> Result<ReleaseRow, DurableError> {
    release_with(pool, id, None, None).await
}

/// [`release`], with `detail` as the audit row's detail (an operator's
/// release: `{"by": "admin", "reason": ...}`), and only while the consume
/// of `of_request` holds it, when given.
pub async fn release_with(
    pool: &PgPool,
    id: i64,
    detail: Option<&Json>,
    of_request: Option<&str>,
) -> Result<ReleaseRow, DurableError> {
    let row = super::fetch_optional(pool, || {
        sqlx::query(
            r#"
        WITH lk AS (
            -- The conditions are the locked row's (see `set_result_versioned`).
            SELECT id, state, result IS NULL AS no_result, order_id IS NULL AS no_order, request_id
              FROM tokens WHERE id = $1 FOR UPDATE
        ), rel AS (
            UPDATE tokens t
               SET state = 'issued', gen = t.gen + 1, consumed_at = NULL, fingerprint = NULL,
                   request_id = NULL,
                   -- A key dates its release here (see V6).
                   expires_at = CASE WHEN t.key IS NULL THEN t.expires_at ELSE now() END
              FROM lk
             WHERE t.id = $1 AND t.id = lk.id AND lk.state = 'consumed' AND lk.no_result
               AND lk.no_order AND ($3::text IS NULL OR lk.request_id = $3)
            RETURNING t.id, t.token, t.key, t.subject, t.biz_type, t.client, t.expires_at, t.gen
        ), audit AS (
            INSERT INTO audit_events (kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT CASE WHEN r.key IS NULL THEN 'token.released' ELSE 'key.released' END::audit_kind,
                   r.id, CASE WHEN r.key IS NULL THEN r.token END, nullif(r.subject, ''), r.biz_type,
                   r.client, r.gen,
                   CASE WHEN r.key IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('key', r.key) END
                   || COALESCE($2::jsonb, '{}'::jsonb)
              FROM rel r
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )
        SELECT expires_at, gen FROM rel
        "#,
        )
        .bind(id)
        .bind(detail)
        .bind(of_request)
    })
    .await?;
    if let Some(r) = row {
        return Ok(ReleaseRow::Released {
            expires_at: r.try_get("expires_at")?,
            gen: r.try_get("gen")?,
        });
    }
    Ok(match find(pool, id).await? {
        Some(e) => ReleaseRow::Existing(e),
        None => ReleaseRow::Unknown,
    })
}

/// Writes a batch of issuance records and their `token.issued` audit rows,
/// and announces the ids on [`super::bloom::CHANNEL`] in the same statement
/// (so the fleet's filters hear of exactly the records that committed).
/// Idempotent: a token a consume already inserted keeps its row, and each
/// token gets one `token.issued` event however often the batch is retried.
/// The rows are written in id order, as a batch of consumes locks them
/// (`super::batch`), so the two never deadlock.
/// The same statement raises `marks`, the issuance marks of `holder`'s
/// leases that these records let rise (see [`crate::issuance::marks`]), and
/// notifies them on [`super::marks::CHANNEL`] after the ids (`ORDER BY`:
/// Postgres evaluates a volatile output expression after the sort), so a
/// peer has the ids of a mark before the mark.
pub async fn insert_issued(
    pool: &PgPool,
    batch: &[TokenRecord],
    holder: uuid::Uuid,
    marks: &[super::marks::Mark],
) -> Result<(), DurableError> {
    if batch.is_empty() {
        return Ok(());
    }
    let mut batch: Vec<&TokenRecord> = batch.iter().collect();
    batch.sort_by_key(|r| r.id);
    let mut ids = Vec::with_capacity(batch.len());
    let mut tokens = Vec::with_capacity(batch.len());
    let mut biz = Vec::with_capacity(batch.len());
    let mut dur = Vec::with_capacity(batch.len());
    let mut subjects = Vec::with_capacity(batch.len());
    let mut clients = Vec::with_capacity(batch.len());
    let mut issued = Vec::with_capacity(batch.len());
    let mut expires = Vec::with_capacity(batch.len());
    for r in &batch {
        ids.push(r.id);
        tokens.push(r.token.as_str());
        biz.push(r.biz_type.as_str());
        dur.push(r.durability.as_str());
        subjects.push(r.subject.as_str());
        clients.push(r.client.as_str());
        issued.push(r.issued_at);
        expires.push(r.expires_at);
    }
    let (mark_workers, mark_froms, mark_values) = super::marks::columns(marks);
    sqlx::query(&format!(
        r#"
        WITH r AS (
            SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],
                                 $6::text[], $7::timestamptz[], $8::timestamptz[])
                       AS r(id, token, biz_type, durability, subject, client, issued_at, expires_at)
        ), ins AS (
            INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at)
            SELECT id, token, biz_type, durability::durability, subject, client, issued_at, expires_at FROM r
            ON CONFLICT (id) DO NOTHING
        ), aud AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, detail)
            SELECT issued_at, 'token.issued', id, token, subject, biz_type, client,
                   jsonb_build_object('expires_at', expires_at, 'durability', durability)
              FROM r
            ON CONFLICT (token_id) WHERE kind = 'token.issued' DO NOTHING
        ), m AS (
            SELECT * FROM UNNEST($11::int[], $12::bigint[], $13::bigint[]) AS m(worker_id, from_ms, mark_ms)
        ), up AS (
            UPDATE issuance_marks i SET mark_ms = m.mark_ms, updated_at = now()
              FROM m
             WHERE i.worker_id = m.worker_id AND i.from_ms = m.from_ms AND i.holder = $14
               AND i.mark_ms < m.mark_ms
            RETURNING i.worker_id, i.from_ms, i.mark_ms
        ), notes AS (
            SELECT 0 AS o, $9::text AS channel, p AS payload FROM UNNEST($10::text[]) AS p
            UNION ALL
            SELECT 1, $15::text, {payload} FROM up
        )
        SELECT pg_notify(channel, payload) FROM notes ORDER BY o
        "#,
        payload = super::marks::PAYLOAD_SQL,
    ))
    .bind(&ids)
    .bind(&tokens)
    .bind(&biz)
    .bind(&dur)
    .bind(&subjects)
    .bind(&clients)
    .bind(&issued)
    .bind(&expires)
    .bind(super::bloom::CHANNEL)
    .bind(super::bloom::encode(&ids))
    .bind(&mark_workers)
    .bind(&mark_froms)
    .bind(&mark_values)
    .bind(holder)
    .bind(super::marks::CHANNEL)
    .execute(pool)
    .await?;
    Ok(())
}

/// A fast-type consume taken from the journal stream.
#[derive(Debug, Clone)]
pub struct JournalConsume {
    pub record: TokenRecord,
    pub consumed_at: DateTime<Utc>,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
}

/// Applies journaled fast consumes written without a generation (by
/// instances older than generations, while a deploy rolls over) in one
/// statement: each consumes an issued token, moving it to the next
/// generation; re-applying is a no-op. Entries with a generation go through
/// [`super::journal::apply`].
pub async fn apply_journal_consumes(
    pool: &PgPool,
    batch: &[JournalConsume],
) -> Result<u64, DurableError> {
    if batch.is_empty() {
        return Ok(0);
    }
    // One row per token: ON CONFLICT DO UPDATE may not touch a row twice.
    let mut seen = std::collections::HashSet::new();
    let batch: Vec<&JournalConsume> = batch.iter().filter(|c| seen.insert(c.record.id)).collect();
    let n = batch.len();
    let (mut ids, mut tokens, mut biz, mut subjects, mut clients) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut issued, mut expires, mut consumed, mut fps, mut rids) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for c in &batch {
        ids.push(c.record.id);
        tokens.push(c.record.token.as_str());
        biz.push(c.record.biz_type.as_str());
        subjects.push(c.record.subject.as_str());
        clients.push(c.record.client.as_str());
        issued.push(c.record.issued_at);
        expires.push(c.record.expires_at);
        consumed.push(c.consumed_at);
        fps.push(c.fingerprint.as_deref());
        rids.push(c.request_id.as_deref());
    }
    let done = sqlx::query(
        r#"
        WITH r AS (
            SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],
                                 $6::timestamptz[], $7::timestamptz[], $8::timestamptz[], $9::text[], $10::text[])
                       AS r(id, token, biz_type, subject, client, issued_at, expires_at, consumed_at, fingerprint, request_id)
        ), ins AS (
            INSERT INTO tokens AS t (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                                     state, gen, consumed_at, fingerprint, request_id)
            SELECT id, token, biz_type, 'fast', subject, client, issued_at, expires_at,
                   'consumed', 1, consumed_at, fingerprint, request_id FROM r
            ON CONFLICT (id) DO UPDATE
               SET state = 'consumed', gen = t.gen + 1, consumed_at = EXCLUDED.consumed_at,
                   fingerprint = EXCLUDED.fingerprint, request_id = EXCLUDED.request_id
             WHERE t.state = 'issued' AND t.durability = 'fast'
            RETURNING t.id, t.gen
        )
        INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, gen, detail)
        SELECT r.consumed_at, 'token.consumed', r.id, r.token, r.subject, r.biz_type, r.client, ins.gen,
               jsonb_strip_nulls(jsonb_build_object('fingerprint', r.fingerprint, 'request_id', r.request_id,
                                                    'via', 'journal'))
          FROM r JOIN ins USING (id)
        ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        "#,
    )
    .bind(&ids)
    .bind(&tokens)
    .bind(&biz)
    .bind(&subjects)
    .bind(&clients)
    .bind(&issued)
    .bind(&expires)
    .bind(&consumed)
    .bind(&fps)
    .bind(&rids)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(done)
}

/// Adds duplicate-attempt counts seen since the last flush to the rows no
/// other transaction holds, and answers the ids of the rows it skipped
/// because one did: their counts are not added (keep them for the next
/// flush). Counts of rows that do not exist are dropped.
///
/// It never waits for a row lock. The payment path's batches lock their
/// rows in id order, so that they never deadlock with each other; counts
/// arrive in no order, and an update that locked them as it met them
/// deadlocked with a consume batch of the same tokens (a double-click
/// storm: the batch lost, and its consumes answered 503 after Postgres's
/// 1 s `deadlock_timeout`). A statement that waits for nothing is in no
/// deadlock, and keeps no payment waiting longer than its own run.
pub async fn add_duplicates(
    pool: &PgPool,
    counts: &HashMap<i64, i64>,
) -> Result<Vec<i64>, DurableError> {
    if counts.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = counts.keys().copied().collect();
    let ns: Vec<i64> = ids.iter().map(|i| counts[i]).collect();
    // Run once, never again on another connection: a count added twice is
    // worse than one kept for the next flush.
    let skipped: Vec<i64> = sqlx::query_scalar(
        "WITH c AS (
            SELECT * FROM UNNEST($1::bigint[], $2::bigint[]) AS c(id, n)
         ), lk AS (
            SELECT t.id FROM tokens t WHERE t.id = ANY($1) FOR UPDATE SKIP LOCKED
         ), upd AS (
            UPDATE tokens t SET duplicate_attempts = t.duplicate_attempts + c.n
              FROM c WHERE t.id = c.id AND t.id IN (SELECT id FROM lk)
            RETURNING t.id
         )
         SELECT t.id FROM tokens t WHERE t.id = ANY($1) AND t.id NOT IN (SELECT id FROM upd)",
    )
    .bind(&ids)
    .bind(&ns)
    .fetch_all(pool)
    .await?;
    Ok(skipped)
}

/// Adds this instance's counters into the fleet-wide per-minute table, a
/// row per biz type, upserted in biz type order: every instance flushes the
/// same rows, and two that locked them in the orders of their own hash maps
/// could deadlock (each holding a row the other waits for, until Postgres
/// fails one after its 1 s `deadlock_timeout`, with the issuance writer
/// stalled meanwhile).
pub async fn flush_stats(
    pool: &PgPool,
    minute: DateTime<Utc>,
    counts: &HashMap<String, StatCounts>,
) -> Result<(), DurableError> {
    if counts.is_empty() {
        return Ok(());
    }
    let mut biz = Vec::new();
    let (mut a, mut b, mut c, mut d, mut e) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut sorted: Vec<(&String, &StatCounts)> = counts.iter().collect();
    sorted.sort_unstable_by(|x, y| x.0.cmp(y.0));
    for (k, v) in sorted {
        biz.push(k.as_str());
        a.push(v.issued);
        b.push(v.consumed);
        c.push(v.duplicates);
        d.push(v.expired);
        e.push(v.invalid);
    }
    sqlx::query(
        r#"
        INSERT INTO stats_minutely AS s (minute, biz_type, issued, consumed, duplicates, expired, invalid)
        SELECT $1, * FROM UNNEST($2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[])
        ON CONFLICT (minute, biz_type) DO UPDATE
           SET issued = s.issued + EXCLUDED.issued, consumed = s.consumed + EXCLUDED.consumed,
               duplicates = s.duplicates + EXCLUDED.duplicates, expired = s.expired + EXCLUDED.expired,
               invalid = s.invalid + EXCLUDED.invalid
        "#,
    )
    .bind(minute)
    .bind(&biz)
    .bind(&a)
    .bind(&b)
    .bind(&c)
    .bind(&d)
    .bind(&e)
    .execute(pool)
    .await?;
    Ok(())
}
