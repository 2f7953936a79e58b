//! Sealed audit checkpoints' statements (`audit_checkpoints`, V13): the
//! probes of the settle rule (the highest visible event id, the
//! transactions holding a write lock on `audit_events`), the sealing
//! transaction's reads and insert, and the verifier's pages. Admin pool only:
//! nothing here runs on the payment path. The rule itself and its proof are
//! in [`crate::audit_seal`].

use chrono::{DateTime, Utc};
use futures_util::stream::BoxStream;
use futures_util::TryStreamExt;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};

use super::DurableError;

/// One audit event as it is sealed: every column of `audit_events` (its
/// digest and MAC are `crate::audit_seal::chain`'s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedEvent {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub kind: String,
    pub token_id: Option<i64>,
    pub token: Option<String>,
    pub subject: Option<String>,
    pub biz_type: Option<String>,
    pub order_id: Option<String>,
    pub client: Option<String>,
    pub gen: Option<i64>,
    /// The jsonb's text as Postgres renders it (`detail::text`).
    pub detail: String,
}

/// Advisory lock key of one sealing transaction (the migration lock is
/// ...0001, the reconcile run's ...0003).
pub const SEAL_LOCK_KEY: i64 = 0x1ed6_e700_0005;

/// One `audit_checkpoints` row, digests and mac as stored (hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRow {
    pub id: i64,
    pub sealed_at: DateTime<Utc>,
    pub first_event_id: i64,
    pub last_event_id: i64,
    pub events: i64,
    pub prev_digest: String,
    pub digest: String,
    pub key_id: String,
    pub mac: String,
}

const CHECKPOINT_COLUMNS: &str =
    "id, sealed_at, first_event_id, last_event_id, events, prev_digest, digest, key_id, mac";

fn checkpoint(row: &PgRow) -> Result<CheckpointRow, sqlx::Error> {
    Ok(CheckpointRow {
        id: row.try_get("id")?,
        sealed_at: row.try_get("sealed_at")?,
        first_event_id: row.try_get("first_event_id")?,
        last_event_id: row.try_get("last_event_id")?,
        events: row.try_get("events")?,
        prev_digest: row.try_get("prev_digest")?,
        digest: row.try_get("digest")?,
        key_id: row.try_get("key_id")?,
        mac: row.try_get("mac")?,
    })
}

/// The highest event id visible now (`None`: no event yet).
pub async fn max_event_id(pool: &PgPool) -> Result<Option<i64>, DurableError> {
    Ok(sqlx::query_scalar("SELECT max(id) FROM audit_events")
        .fetch_one(pool)
        .await?)
}

/// The virtual transaction ids of every other session that holds (or waits
/// for) a `RowExclusiveLock` on `audit_events` in this database: every
/// transaction that has inserted into it or is inserting now. A prepared
/// transaction (no backend, `pid` NULL) counts too.
pub async fn audit_writers(pool: &PgPool) -> Result<Vec<String>, DurableError> {
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT l.virtualtransaction
           FROM pg_locks l
          WHERE l.locktype = 'relation'
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND l.relation = 'audit_events'::regclass
            AND l.mode = 'RowExclusiveLock'
            AND l.pid IS DISTINCT FROM pg_backend_pid()",
    )
    .fetch_all(pool)
    .await?)
}

/// How many of `writers` still hold (or wait for) their lock on `audit_events`.
pub async fn writers_still_running(pool: &PgPool, writers: &[String]) -> Result<i64, DurableError> {
    Ok(sqlx::query_scalar(
        "SELECT count(DISTINCT l.virtualtransaction)
           FROM pg_locks l
          WHERE l.locktype = 'relation'
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND l.relation = 'audit_events'::regclass
            AND l.mode = 'RowExclusiveLock'
            AND l.virtualtransaction = ANY($1)",
    )
    .bind(writers)
    .fetch_one(pool)
    .await?)
}

/// The cache size of the sequence behind `audit_events.id` (1 unless someone
/// changed it: the settle rule needs ids handed out in time order).
pub async fn id_sequence_cache(pool: &PgPool) -> Result<i64, DurableError> {
    Ok(sqlx::query_scalar(
        "SELECT s.seqcache FROM pg_sequence s
          WHERE s.seqrelid = pg_get_serial_sequence('audit_events', 'id')::regclass",
    )
    .fetch_one(pool)
    .await?)
}

/// Takes the sealing lock for the rest of `conn`'s transaction, without
/// waiting; `false` when another session's transaction holds it.
pub async fn try_seal_lock(conn: &mut PgConnection) -> Result<bool, DurableError> {
    Ok(sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(SEAL_LOCK_KEY)
        .fetch_one(conn)
        .await?)
}

/// The newest checkpoint (the one ending at the highest event id).
pub async fn last_checkpoint<'e, E>(conn: E) -> Result<Option<CheckpointRow>, DurableError>
where
    E: sqlx::PgExecutor<'e>,
{
    let row = sqlx::query(&format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints ORDER BY last_event_id DESC LIMIT 1"
    ))
    .fetch_optional(conn)
    .await?;
    Ok(row.as_ref().map(checkpoint).transpose()?)
}

/// The id the next checkpoint will have and its `sealed_at` (Postgres's
/// clock now, after the lock: later than the previous checkpoint's commit).
/// Both are covered by its mac, so they are known before it is written.
pub async fn next_checkpoint_id(
    conn: &mut PgConnection,
) -> Result<(i64, DateTime<Utc>), DurableError> {
    let row = sqlx::query(
        "SELECT nextval(pg_get_serial_sequence('audit_checkpoints', 'id')) AS id, clock_timestamp() AS at",
    )
    .fetch_one(conn)
    .await?;
    Ok((row.try_get("id")?, row.try_get("at")?))
}

pub async fn insert_checkpoint(
    conn: &mut PgConnection,
    c: &CheckpointRow,
) -> Result<(), DurableError> {
    sqlx::query(
        "INSERT INTO audit_checkpoints
                (id, sealed_at, first_event_id, last_event_id, events, prev_digest, digest, key_id, mac)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(c.id)
    .bind(c.sealed_at)
    .bind(c.first_event_id)
    .bind(c.last_event_id)
    .bind(c.events)
    .bind(&c.prev_digest)
    .bind(&c.digest)
    .bind(&c.key_id)
    .bind(&c.mac)
    .execute(conn)
    .await?;
    Ok(())
}

/// The events with `after < id <= upto` (`after` `None`: from the lowest),
/// in id order, at most `limit`, streamed: every column as the seal covers
/// it, `detail` as jsonb's text (see [`crate::audit_seal::chain`]).
pub fn events<'e, E>(
    conn: E,
    after: Option<i64>,
    upto: i64,
    limit: i64,
) -> BoxStream<'e, Result<SealedEvent, DurableError>>
where
    E: sqlx::PgExecutor<'e> + 'e,
{
    Box::pin(
        sqlx::query(
            "SELECT id, at, kind::text AS kind, token_id, token, subject, biz_type, order_id,
                    client, gen, detail::text AS detail
               FROM audit_events
              WHERE id > $1 AND id <= $2
              ORDER BY id
              LIMIT $3",
        )
        .bind(after.unwrap_or(i64::MIN))
        .bind(upto)
        .bind(limit)
        .fetch(conn)
        .map_err(DurableError::from)
        .and_then(|row| async move {
            Ok(SealedEvent {
                id: row.try_get("id")?,
                at: row.try_get("at")?,
                kind: row.try_get("kind")?,
                token_id: row.try_get("token_id")?,
                token: row.try_get("token")?,
                subject: row.try_get("subject")?,
                biz_type: row.try_get("biz_type")?,
                order_id: row.try_get("order_id")?,
                client: row.try_get("client")?,
                gen: row.try_get("gen")?,
                detail: row.try_get("detail")?,
            })
        }),
    )
}

/// Up to `limit` checkpoints with an id at or above `from_id`, in id order
/// (the order they were sealed in).
pub async fn checkpoints_page(
    pool: &PgPool,
    from_id: i64,
    limit: i64,
) -> Result<Vec<CheckpointRow>, DurableError> {
    let rows = sqlx::query(&format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints WHERE id >= $1 ORDER BY id LIMIT $2"
    ))
    .bind(from_id)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(checkpoint).collect::<Result<_, _>>()?)
}

/// The id of the first checkpoint sealed at or after `since`, if any.
pub async fn first_checkpoint_since(
    pool: &PgPool,
    since: DateTime<Utc>,
) -> Result<Option<i64>, DurableError> {
    Ok(
        sqlx::query_scalar("SELECT min(id) FROM audit_checkpoints WHERE sealed_at >= $1")
            .bind(since)
            .fetch_one(pool)
            .await?,
    )
}

/// The checkpoint sealed just before checkpoint `id`, if any.
pub async fn checkpoint_before(
    pool: &PgPool,
    id: i64,
) -> Result<Option<CheckpointRow>, DurableError> {
    let row = sqlx::query(&format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints WHERE id < $1 ORDER BY id DESC LIMIT 1"
    ))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(row.as_ref().map(checkpoint).transpose()?)
}

/// How many events lie above `after` (not sealed yet); all of them for `None`.
pub async fn events_above(pool: &PgPool, after: Option<i64>) -> Result<i64, DurableError> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE id > $1")
            .bind(after.unwrap_or(i64::MIN))
            .fetch_one(pool)
            .await?,
    )
}
