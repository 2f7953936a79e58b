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
    /// The partition that holds it (V22), not a column: a version 2
    /// checkpoint chains each partition's events apart.
    pub partition: String,
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
    /// 1: one chain over the range; 2: one per partition (V22).
    pub version: i16,
    /// Version 2: `[{"partition", "events", "digest"}]` as stored (jsonb's
    /// text), by partition name.
    pub parts: Option<String>,
}

const CHECKPOINT_COLUMNS: &str =
    "id, sealed_at, first_event_id, last_event_id, events, prev_digest, digest, key_id, mac,
     version, parts::text AS parts";

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
        version: row.try_get("version")?,
        parts: row.try_get("parts")?,
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
                (id, sealed_at, first_event_id, last_event_id, events, prev_digest, digest, key_id, mac,
                 version, parts)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb)",
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
    .bind(c.version)
    .bind(&c.parts)
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
                    client, gen, detail::text AS detail, tableoid::regclass::text AS partition
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
        .and_then(|row| async move { Ok(sealed_event(&row)?) }),
    )
}

/// Up to `limit` events of one partition of `audit_events` (its table name,
/// checked by the caller: see `crate::durable::partitions::is_audit_day_name`)
/// with an id above `after`, in id order, as [`events`] gives them.
pub async fn partition_events(
    conn: &mut PgConnection,
    partition: &str,
    after: i64,
    limit: i64,
) -> Result<Vec<SealedEvent>, DurableError> {
    let rows = sqlx::query(&format!(
        "SELECT id, at, kind::text AS kind, token_id, token, subject, biz_type, order_id,
                client, gen, detail::text AS detail, tableoid::regclass::text AS partition
           FROM {partition}
          WHERE id > $1
          ORDER BY id
          LIMIT $2"
    ))
    .bind(after)
    .bind(limit)
    .fetch_all(conn)
    .await?;
    Ok(rows.iter().map(sealed_event).collect::<Result<_, _>>()?)
}

fn sealed_event(row: &PgRow) -> Result<SealedEvent, sqlx::Error> {
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
        partition: row.try_get("partition")?,
    })
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

/// One `audit_retirements` row (V22): a partition of `audit_events` dropped
/// under `audit.retention`, its MAC as stored (hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetirementRow {
    pub partition: String,
    pub retired_at: DateTime<Utc>,
    pub events: i64,
    pub checkpoints: i64,
    pub key_id: String,
    pub mac: String,
}

/// Every retirement, by partition name.
pub async fn retirements(pool: &PgPool) -> Result<Vec<RetirementRow>, DurableError> {
    let rows = sqlx::query(
        "SELECT partition, retired_at, events, checkpoints, key_id, mac
           FROM audit_retirements ORDER BY partition",
    )
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(RetirementRow {
                partition: r.try_get("partition")?,
                retired_at: r.try_get("retired_at")?,
                events: r.try_get("events")?,
                checkpoints: r.try_get("checkpoints")?,
                key_id: r.try_get("key_id")?,
                mac: r.try_get("mac")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

pub async fn insert_retirement(
    conn: &mut PgConnection,
    r: &RetirementRow,
) -> Result<(), DurableError> {
    sqlx::query(
        "INSERT INTO audit_retirements (partition, retired_at, events, checkpoints, key_id, mac)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&r.partition)
    .bind(r.retired_at)
    .bind(r.events)
    .bind(r.checkpoints)
    .bind(&r.key_id)
    .bind(&r.mac)
    .execute(conn)
    .await?;
    Ok(())
}

/// Postgres's clock now (`clock_timestamp()`), inside `conn`'s transaction.
pub async fn clock_now(conn: &mut PgConnection) -> Result<DateTime<Utc>, DurableError> {
    Ok(sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(conn)
        .await?)
}

/// The version 2 checkpoints with a part for `partition`, in id order.
pub async fn checkpoints_with_part(
    conn: &mut PgConnection,
    partition: &str,
) -> Result<Vec<CheckpointRow>, DurableError> {
    let rows = sqlx::query(&format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints
          WHERE version = 2
            AND parts @> jsonb_build_array(jsonb_build_object('partition', $1::text))
          ORDER BY id"
    ))
    .bind(partition)
    .fetch_all(conn)
    .await?;
    Ok(rows.iter().map(checkpoint).collect::<Result<_, _>>()?)
}

/// The highest event id a version 1 checkpoint seals (`None`: there is none).
pub async fn last_flat_event_id(conn: &mut PgConnection) -> Result<Option<i64>, DurableError> {
    Ok(
        sqlx::query_scalar("SELECT max(last_event_id) FROM audit_checkpoints WHERE version = 1")
            .fetch_one(conn)
            .await?,
    )
}

/// What a partition of `audit_events` holds: its events, their lowest and
/// highest ids, and whether the newest of them is older than
/// `retention_secs` by Postgres's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionSpan {
    pub events: i64,
    pub first_id: Option<i64>,
    pub last_id: Option<i64>,
    pub past_retention: bool,
}

pub async fn partition_span(
    conn: &mut PgConnection,
    partition: &str,
    retention_secs: f64,
) -> Result<PartitionSpan, DurableError> {
    let row = sqlx::query(&format!(
        "SELECT count(*) AS n, min(id) AS first_id, max(id) AS last_id,
                coalesce(max(at) < now() - make_interval(secs => $1), true) AS past
           FROM {partition}"
    ))
    .bind(retention_secs)
    .fetch_one(conn)
    .await?;
    Ok(PartitionSpan {
        events: row.try_get("n")?,
        first_id: row.try_get("first_id")?,
        last_id: row.try_get("last_id")?,
        past_retention: row.try_get("past")?,
    })
}

/// Records the drop of an `audit_events` partition in the trail itself
/// (`audit.retired`, no token), in `conn`'s transaction.
pub async fn insert_retired_event(
    conn: &mut PgConnection,
    r: &RetirementRow,
    by: &str,
) -> Result<(), DurableError> {
    sqlx::query(
        "INSERT INTO audit_events (kind, detail)
         VALUES ('audit.retired',
                 jsonb_build_object('partition', $1::text, 'events', $2::bigint,
                                    'checkpoints', $3::bigint, 'by', $4::text))",
    )
    .bind(&r.partition)
    .bind(r.events)
    .bind(r.checkpoints)
    .bind(by)
    .execute(conn)
    .await?;
    Ok(())
}
