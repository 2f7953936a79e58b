//! Snowflake worker-id leases. An instance takes a free or expired worker id
//! with one conditional upsert, renews it every third of its lifetime, and
//! stops issuing when it cannot renew in time (see `crate::issuance::lease`).

use std::time::Duration;

use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::DurableError;

/// A lease just taken: the worker id, and the millisecond this holder's ids
/// must start above (the previous holder's high-water mark, or the
/// holder's clock when later): the lease's `from_ms` in `issuance_marks`.
#[derive(Debug, Clone, Copy)]
pub struct Taken {
    pub worker_id: u16,
    pub floor_ms: i64,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Takes a free worker id, or `None` when all 1024 are held. In the same
/// statement: the lease's row in `issuance_marks` (its mark at its start:
/// nothing made yet), notified to the fleet, and the rows of leases not
/// updated for `marks_kept` deleted.
pub async fn acquire(
    pool: &PgPool,
    holder: Uuid,
    ttl: Duration,
    now_ms: i64,
    marks_kept: Duration,
) -> Result<Option<Taken>, DurableError> {
    for _ in 0..32 {
        let row = sqlx::query(&format!(
            r#"
            WITH candidate AS (
                SELECT g AS worker_id
                  FROM generate_series(0, 1023) AS g
                 WHERE NOT EXISTS (SELECT 1 FROM worker_leases l
                                    WHERE l.worker_id = g AND l.expires_at > now())
                 ORDER BY random()
                 LIMIT 1
            ), taken AS (
            INSERT INTO worker_leases AS l (worker_id, holder, expires_at)
            SELECT worker_id, $1, now() + $2 * interval '1 millisecond' FROM candidate
            ON CONFLICT (worker_id) DO UPDATE
               SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
             WHERE l.expires_at <= now()
            RETURNING l.worker_id, GREATEST(l.high_water_ms, $3) AS from_ms
            ), mark AS (
            INSERT INTO issuance_marks AS m (worker_id, from_ms, holder, mark_ms)
            SELECT worker_id, from_ms, $1, from_ms FROM taken
            ON CONFLICT (worker_id, from_ms) DO UPDATE
               SET holder = EXCLUDED.holder, mark_ms = EXCLUDED.mark_ms, updated_at = now()
            ), pruned AS (
            DELETE FROM issuance_marks
             WHERE updated_at < now() - $4 * interval '1 millisecond'
               AND (worker_id, from_ms) NOT IN (SELECT worker_id, from_ms FROM taken)
            )
            SELECT worker_id, from_ms, pg_notify($5, {payload})
              FROM (SELECT worker_id, from_ms, from_ms AS mark_ms FROM taken) t
            "#,
            payload = super::marks::PAYLOAD_SQL,
        ))
        .bind(holder)
        .bind(ms(ttl))
        .bind(now_ms)
        .bind(ms(marks_kept))
        .bind(super::marks::CHANNEL)
        .fetch_optional(pool)
        .await?;
        match row {
            Some(r) => {
                let worker: i32 = r.try_get("worker_id")?;
                let floor_ms: i64 = r.try_get("from_ms")?;
                return Ok(Some(Taken {
                    worker_id: u16::try_from(worker).unwrap_or(0),
                    floor_ms,
                }));
            }
            None => {
                // Either every id is held, or another instance took our
                // candidate between the two halves of the statement.
                let free: i64 = sqlx::query_scalar(
                    "SELECT 1024 - count(*) FROM worker_leases WHERE expires_at > now()",
                )
                .fetch_one(pool)
                .await?;
                if free == 0 {
                    return Ok(None);
                }
            }
        }
    }
    Ok(None)
}

/// Renews the lease and records the high-water mark; `false` when the lease
/// was lost (expired and taken by someone else).
pub async fn renew(
    pool: &PgPool,
    worker_id: u16,
    holder: Uuid,
    ttl: Duration,
    high_water_ms: i64,
) -> Result<bool, DurableError> {
    let n = sqlx::query(
        "UPDATE worker_leases
            SET expires_at = now() + $3 * interval '1 millisecond',
                high_water_ms = GREATEST(high_water_ms, $4)
          WHERE worker_id = $1 AND holder = $2",
    )
    .bind(i32::from(worker_id))
    .bind(holder)
    .bind(ms(ttl))
    .bind(high_water_ms)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// Gives the lease back (clean shutdown), keeping the high-water mark.
pub async fn release(
    pool: &PgPool,
    worker_id: u16,
    holder: Uuid,
    high_water_ms: i64,
) -> Result<(), DurableError> {
    sqlx::query(
        "UPDATE worker_leases SET expires_at = now(), high_water_ms = GREATEST(high_water_ms, $3)
          WHERE worker_id = $1 AND holder = $2",
    )
    .bind(i32::from(worker_id))
    .bind(holder)
    .bind(high_water_ms)
    .execute(pool)
    .await?;
    Ok(())
}
