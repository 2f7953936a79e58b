//! The day partitions of `tokens` (migration V16) and of `audit_events`
//! (V22): making them ahead, listing them with their retention bound, and
//! dropping a token day whole once every row in it is past retention (an
//! audit day's drop, verified and recorded first, is
//! `crate::audit_seal::retire`'s; its lock and drop are here). The bounds of
//! a day's ids are computed in one place, the SQL function
//! `tokens_day_first_id` of V16.

use sqlx::{PgConnection, PgPool, Row};

use super::reconcile::{PURGE_CONSUMED, PURGE_ISSUED};
use super::DurableError;

/// How many days past today the service makes partitions for (at start, in
/// `setup::migrate`, and at every reconcile run). A day not made in time is
/// no failure: its rows go to `tokens_default`.
pub const DAYS_AHEAD: i32 = 7;

/// How long a partition drop waits for its lock on `tokens`: consumes queue
/// behind a waiting `DROP TABLE`, so it gives up quickly and the next run
/// tries again.
const DROP_LOCK_TIMEOUT: &str = "200ms";

/// Makes today's partition (by Postgres's clock, UTC) and the next
/// [`DAYS_AHEAD`] days' unless they exist; how many it made.
pub async fn ensure(pool: &PgPool) -> Result<i32, DurableError> {
    Ok(sqlx::query_scalar("SELECT tokens_ensure_partitions($1)")
        .bind(DAYS_AHEAD)
        .fetch_one(pool)
        .await?)
}

/// One day partition, `tokens_pYYYYMMDD`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DayPartition {
    pub name: String,
    /// Its ids: `first_id <= id < end_id`.
    pub first_id: i64,
    pub end_id: i64,
    /// The end of its day plus `grace_secs` is behind Postgres's `now()`:
    /// every token in it has expired and had its retention, if none
    /// outlived the grace.
    pub past_bound: bool,
}

/// The day partitions, oldest first. `grace_secs`: the longest token
/// lifetime plus the retention (see [`DayPartition::past_bound`]).
pub async fn days(pool: &PgPool, grace_secs: f64) -> Result<Vec<DayPartition>, DurableError> {
    let rows = sqlx::query(
        r#"
        SELECT c.relname::text AS name, tokens_day_first_id(d.day) AS first_id,
               tokens_day_first_id(d.day + 1) AS end_id,
               ((d.day + 1)::timestamp AT TIME ZONE 'UTC') + make_interval(secs => $1) < now()
                   AS past_bound
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
         CROSS JOIN LATERAL (SELECT to_date(substr(c.relname, 9), 'YYYYMMDD') AS day) d
         WHERE i.inhparent = 'tokens'::regclass AND c.relname ~ '^tokens_p[0-9]{8}$'
         ORDER BY d.day
        "#,
    )
    .bind(grace_secs)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(DayPartition {
                name: r.try_get("name")?,
                first_id: r.try_get("first_id")?,
                end_id: r.try_get("end_id")?,
                past_bound: r.try_get("past_bound")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// The ids the row-by-row purge leaves alone, `[lo, hi)`: the day partitions
/// not yet past their bound (their rows go with their partition). Empty
/// (`lo == hi`) when there is none.
pub fn kept_range(days: &[DayPartition]) -> (i64, i64) {
    match (days.iter().find(|d| !d.past_bound), days.last()) {
        (Some(first), Some(last)) => (first.first_id, last.end_id),
        _ => (0, 0),
    }
}

/// The names this module makes: only these are ever put into a statement.
fn is_day_name(name: &str) -> bool {
    name.len() == 16
        && name.starts_with("tokens_p")
        && name[8..].bytes().all(|b| b.is_ascii_digit())
}

/// The names of `audit_events`' day partitions: only these are ever put into
/// a statement by the audit retirement.
pub fn is_audit_day_name(name: &str) -> bool {
    name.len() == 22
        && name.starts_with("audit_events_p")
        && name[14..].bytes().all(|b| b.is_ascii_digit())
}

/// One day partition of `audit_events`, `audit_events_pYYYYMMDD` (V22): the
/// events of the tokens issued that day.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditDay {
    pub name: String,
    /// The day's `tokens` partition is gone (dropped under
    /// `tokens.retention`, or never made: its tokens then sat in
    /// `tokens_default`). A later event of one of its tokens is not lost: the
    /// dropped range falls to `audit_events_default`, sealed like any other.
    pub tokens_gone: bool,
    /// The end of its day plus `retention_secs` is behind Postgres's `now()`.
    pub past_bound: bool,
}

/// The day partitions of `audit_events`, oldest first, with their bound
/// under an audit retention of `retention_secs`.
pub async fn audit_days(pool: &PgPool, retention_secs: f64) -> Result<Vec<AuditDay>, DurableError> {
    let rows = sqlx::query(
        r#"
        SELECT c.relname::text AS name,
               to_regclass('tokens_p' || substr(c.relname, 15)) IS NULL AS tokens_gone,
               ((d.day + 1)::timestamp AT TIME ZONE 'UTC') + make_interval(secs => $1) < now()
                   AS past_bound
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
         CROSS JOIN LATERAL (SELECT to_date(substr(c.relname, 15), 'YYYYMMDD') AS day) d
         WHERE i.inhparent = 'audit_events'::regclass AND c.relname ~ '^audit_events_p[0-9]{8}$'
         ORDER BY d.day
        "#,
    )
    .bind(retention_secs)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(AuditDay {
                name: r.try_get("name")?,
                tokens_gone: r.try_get("tokens_gone")?,
                past_bound: r.try_get("past_bound")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(Into::into)
}

/// Locks one day partition of `audit_events` against writes for the rest of
/// `conn`'s transaction, waiting at most `DROP_LOCK_TIMEOUT` (which then
/// holds for the rest of the transaction, the drop included); `false` when
/// the lock was not granted in time, or the name is not an audit day's.
pub async fn lock_audit_day(conn: &mut PgConnection, name: &str) -> Result<bool, DurableError> {
    if !is_audit_day_name(name) {
        return Ok(false);
    }
    sqlx::query(&format!("SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'"))
        .execute(&mut *conn)
        .await?;
    let locked = sqlx::query(&format!("LOCK TABLE {name} IN SHARE MODE"))
        .execute(&mut *conn)
        .await;
    if is_lock_timeout(&locked) {
        return Ok(false);
    }
    locked?;
    Ok(true)
}

/// Drops one day partition of `audit_events` in `conn`'s transaction (it
/// takes `audit_events` exclusively, briefly); `false` when its lock was not
/// granted in time.
pub async fn drop_audit_day(conn: &mut PgConnection, name: &str) -> Result<bool, DurableError> {
    if !is_audit_day_name(name) {
        return Ok(false);
    }
    let dropped = sqlx::query(&format!("DROP TABLE {name}"))
        .execute(conn)
        .await;
    if is_lock_timeout(&dropped) {
        return Ok(false);
    }
    dropped?;
    Ok(true)
}

/// What [`drop_if_all_purgeable`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Dropped, with this many rows.
    Rows(i64),
    /// Some row is still within retention: kept.
    Kept,
    /// The lock on `tokens` was not granted in time: left for the next run.
    Busy,
}

/// Drops `p` if every row in it is past retention (the row-by-row purge's
/// own conditions), with one `reconcile.repaired` audit row (action
/// `partition_dropped`, the partition and its row count) in the same
/// transaction. The partition is locked against writes while it is counted,
/// so no row comes in between the count and the drop; the drop waits at most
/// `DROP_LOCK_TIMEOUT` for `tokens` (it needs it exclusively, briefly:
/// `DETACH ... CONCURRENTLY` is refused while `tokens_default` exists).
pub async fn drop_if_all_purgeable(
    pool: &PgPool,
    p: &DayPartition,
    retention_secs: f64,
    by: &str,
) -> Result<Dropped, DurableError> {
    if !is_day_name(&p.name) {
        return Ok(Dropped::Kept);
    }
    let mut tx = pool.begin().await?;
    sqlx::query(&format!("SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'"))
        .execute(&mut *tx)
        .await?;
    let locked = sqlx::query(&format!("LOCK TABLE {} IN SHARE MODE", p.name))
        .execute(&mut *tx)
        .await;
    if is_lock_timeout(&locked) {
        return Ok(Dropped::Busy);
    }
    locked?;
    let row = sqlx::query(&format!(
        "SELECT count(*) AS n,
                count(*) FILTER (WHERE NOT (({PURGE_CONSUMED}) OR ({PURGE_ISSUED}))) AS kept
           FROM {}",
        p.name
    ))
    .bind(retention_secs)
    .fetch_one(&mut *tx)
    .await?;
    let (n, kept): (i64, i64) = (row.try_get("n")?, row.try_get("kept")?);
    if kept > 0 {
        return Ok(Dropped::Kept);
    }
    sqlx::query(
        r#"
        INSERT INTO audit_events (kind, detail)
        VALUES ('reconcile.repaired',
                jsonb_build_object('class', 'expired_purgeable', 'action', 'partition_dropped',
                                   'partition', $1::text, 'entries', $2::bigint, 'by', $3::text))
        "#,
    )
    .bind(&p.name)
    .bind(n)
    .bind(by)
    .execute(&mut *tx)
    .await?;
    let dropped = sqlx::query(&format!("DROP TABLE {}", p.name))
        .execute(&mut *tx)
        .await;
    if is_lock_timeout(&dropped) {
        return Ok(Dropped::Busy);
    }
    dropped?;
    tx.commit().await?;
    Ok(Dropped::Rows(n))
}

/// `lock_timeout` fired (SQLSTATE 55P03).
fn is_lock_timeout<T>(r: &Result<T, sqlx::Error>) -> bool {
    matches!(r, Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03"))
}

#[cfg(test)]
mod tests {
    use super::{is_day_name, kept_range, DayPartition};

    fn day(first_id: i64, past_bound: bool) -> DayPartition {
        DayPartition {
            name: "tokens_p20260101".to_owned(),
            first_id,
            end_id: first_id + 10,
            past_bound,
        }
    }

    #[test]
    fn keeps_the_days_not_past_their_bound() {
        assert_eq!(kept_range(&[]), (0, 0));
        assert_eq!(kept_range(&[day(0, true), day(10, true)]), (0, 0));
        assert_eq!(
            kept_range(&[day(0, true), day(10, false), day(20, false)]),
            (10, 30)
        );
    }

    #[test]
    fn only_day_names_go_into_statements() {
        assert!(is_day_name("tokens_p20261203"));
        assert!(!is_day_name("tokens_base"));
        assert!(!is_day_name("tokens_p2026120x"));
        assert!(!is_day_name("tokens_p20261203; DROP TABLE tokens"));
    }
}
