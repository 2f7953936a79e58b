//! Issuance marks in Postgres (`issuance_marks`, see [`crate::issuance::marks`]):
//! their notification channel and payload, the statement that raises marks
//! without records (an idle issuer's mark follows the clock; a drained lease
//! ends), and the full read a peer makes at start and every few seconds.
//! The batch statement that raises a mark with its records is
//! [`super::tokens::insert_issued`]; a new lease's row is written by
//! [`super::lease::acquire`].

use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::DurableError;

/// The mark of a lease that ended with every token it made recorded.
pub const ENDED: i64 = i64::MAX;

/// One lease: a worker id and the millisecond its ids start above.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseKey {
    pub worker_id: u16,
    pub from_ms: i64,
}

/// A lease's mark, as stored and notified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    pub lease: LeaseKey,
    pub mark_ms: i64,
}

/// The channel. Payload: `worker_id:from_ms:mark_ms`, in decimal.
pub const CHANNEL: &str = "ledger_marks";

/// The SQL expression of a row's payload (columns `worker_id`, `from_ms`,
/// `mark_ms`), so that every statement notifies the same format.
pub(super) const PAYLOAD_SQL: &str =
    "worker_id::text || ':' || from_ms::text || ':' || mark_ms::text";

/// The mark of one payload; `None` when it is not one of ours.
pub fn decode(payload: &str) -> Option<Mark> {
    let mut parts = payload.split(':');
    let worker_id = parts.next()?.parse().ok()?;
    let from_ms = parts.next()?.parse().ok()?;
    let mark_ms = parts.next()?.parse().ok()?;
    if parts.next().is_some() {
        return None;
    }
    Some(Mark {
        lease: LeaseKey { worker_id, from_ms },
        mark_ms,
    })
}

/// Columns of `marks` for an `UNNEST($n::int[], $n+1::bigint[], $n+2::bigint[])`.
pub(super) fn columns(marks: &[Mark]) -> (Vec<i32>, Vec<i64>, Vec<i64>) {
    (
        marks.iter().map(|m| i32::from(m.lease.worker_id)).collect(),
        marks.iter().map(|m| m.lease.from_ms).collect(),
        marks.iter().map(|m| m.mark_ms).collect(),
    )
}

/// Raises the marks of `holder`'s leases (never lowers one) and notifies
/// the rows that rose.
pub async fn raise(pool: &PgPool, holder: Uuid, marks: &[Mark]) -> Result<(), DurableError> {
    if marks.is_empty() {
        return Ok(());
    }
    let (workers, froms, values) = columns(marks);
    sqlx::query(&format!(
        r#"
        WITH m AS (
            SELECT * FROM UNNEST($1::int[], $2::bigint[], $3::bigint[]) AS m(worker_id, from_ms, mark_ms)
        ), up AS (
            UPDATE issuance_marks i SET mark_ms = m.mark_ms, updated_at = now()
              FROM m
             WHERE i.worker_id = m.worker_id AND i.from_ms = m.from_ms AND i.holder = $4
               AND i.mark_ms < m.mark_ms
            RETURNING i.worker_id, i.from_ms, i.mark_ms
        )
        SELECT pg_notify($5, {PAYLOAD_SQL}) FROM up
        "#
    ))
    .bind(&workers)
    .bind(&froms)
    .bind(&values)
    .bind(holder)
    .bind(CHANNEL)
    .execute(pool)
    .await?;
    Ok(())
}

/// Every lease's mark.
pub async fn load(pool: &PgPool) -> Result<Vec<Mark>, DurableError> {
    let rows = sqlx::query("SELECT worker_id, from_ms, mark_ms FROM issuance_marks")
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|r| {
            let worker: i32 = r.try_get("worker_id")?;
            Ok(Mark {
                lease: LeaseKey {
                    worker_id: u16::try_from(worker).unwrap_or(0),
                    from_ms: r.try_get("from_ms")?,
                },
                mark_ms: r.try_get("mark_ms")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(DurableError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_decode() {
        let m = decode("17:1704067200123:9223372036854775807").unwrap();
        assert_eq!(m.lease.worker_id, 17);
        assert_eq!(m.lease.from_ms, 1_704_067_200_123);
        assert_eq!(m.mark_ms, i64::MAX);
        assert!(decode("17:1").is_none());
        assert!(decode("17:1:2:3").is_none());
        assert!(decode("AAAA").is_none());
    }
}
