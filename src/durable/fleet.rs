//! The fleet's agreement on Redis, in Postgres: members' reports, the
//! fleet state and its epoch, fast decisions fenced by that state, and the
//! queue of those decisions for Redis (`redis_resync`). The protocol is
//! `crate::fleet`'s; this file holds its statements.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use super::tokens::{self, ConsumeRow, Existing, ResultDecided, TokenRecord};
use super::DurableError;

/// The fleet's state, as recorded in `fleet_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetState {
    /// Redis decides fast types.
    Normal,
    /// Every member reported Redis down: Postgres decides fast types.
    RedisDown,
}

impl FleetState {
    pub const ALL: [FleetState; 2] = [FleetState::Normal, FleetState::RedisDown];

    pub fn as_str(self) -> &'static str {
        match self {
            FleetState::Normal => "normal",
            FleetState::RedisDown => "redis_down",
        }
    }

    fn parse(s: &str) -> Result<FleetState, DurableError> {
        match s {
            "normal" => Ok(FleetState::Normal),
            "redis_down" => Ok(FleetState::RedisDown),
            other => Err(DurableError::Other(sqlx::Error::Decode(
                format!("fleet_state.state {other:?}").into(),
            ))),
        }
    }
}

/// What one report found (after it was counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub state: FleetState,
    pub epoch: i64,
    /// Members seen within the member timeout (this one included).
    pub members: i64,
    /// Of those, how many report Redis down.
    pub redis_down_members: i64,
    /// This report turned the fleet to `redis_down`.
    pub flipped: bool,
    /// Members not seen within the member timeout whose last report said
    /// Redis was up: their Redis decisions may be only in the journal, so
    /// the fleet does not turn `redis_down` while any is left (see
    /// [`retire`]).
    pub unaccounted: i64,
    /// When the report was counted (Postgres's clock).
    pub at: DateTime<Utc>,
    /// The Redis dataset the fleet agreed on (`None`: none yet, see
    /// [`adopt_dataset`]).
    pub dataset: Option<Uuid>,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Records this member's view of Redis and returns the fleet's, turning the
/// fleet to `redis_down` (a new epoch) when every member seen within
/// `member_timeout` reports Redis down. Under the lock of the fleet row, so
/// reports are serialised: a member that reported Redis up is counted by
/// every later report.
pub async fn report(
    pool: &PgPool,
    instance: Uuid,
    redis_up: bool,
    member_timeout: Duration,
) -> Result<Report, DurableError> {
    // One statement (`fleet_report`, V9): the row lock is never held across
    // a round trip of ours.
    let row = sqlx::query(
        "SELECT state, epoch, members, redis_down_members, flipped, unaccounted, at, dataset
           FROM fleet_report($1, $2, $3)",
    )
    .bind(instance)
    .bind(redis_up)
    .bind(ms(member_timeout))
    .fetch_one(pool)
    .await?;
    Ok(Report {
        state: FleetState::parse(row.try_get::<&str, _>("state")?)?,
        epoch: row.try_get("epoch")?,
        members: row.try_get("members")?,
        redis_down_members: row.try_get("redis_down_members")?,
        flipped: row.try_get("flipped")?,
        unaccounted: row.try_get("unaccounted")?,
        at: row.try_get("at")?,
        dataset: row.try_get("dataset")?,
    })
}

/// Retires the members that were unaccounted for at `counted_at` (a
/// report's time): silent for longer than `member_timeout` then, and last
/// saying Redis was up. Call it only after seeing the journal empty later
/// than that report: every decision such a member let Redis make happened
/// before its lease ran out (and its scripts' not-after bounds passed),
/// which was before `counted_at`, so its journal entries are in Postgres.
/// A member that reported since is kept.
pub async fn retire(
    pool: &PgPool,
    counted_at: DateTime<Utc>,
    member_timeout: Duration,
) -> Result<u64, DurableError> {
    let done = sqlx::query(
        "DELETE FROM fleet_members
          WHERE redis_up AND seen_at <= $1 - $2 * interval '1 millisecond'",
    )
    .bind(counted_at)
    .bind(ms(member_timeout))
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// A member the fleet no longer waits for ([`forget_silent`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forgotten {
    pub instance: Uuid,
    pub last_seen: DateTime<Utc>,
}

/// Forgets the members that are unaccounted for now (silent for longer
/// than `member_timeout`, last saying Redis was up), by an operator's
/// decision: the Redis decisions of theirs that the journal held are
/// accepted as lost (Redis lost them before any member saw the journal
/// empty). The fleet may then turn `redis_down`.
pub async fn forget_silent(
    pool: &PgPool,
    member_timeout: Duration,
    reason: Option<&str>,
) -> Result<Vec<Forgotten>, DurableError> {
    // One statement: a member is forgotten only together with its
    // `fleet.forgotten` audit event.
    let rows: Vec<(Uuid, DateTime<Utc>)> = sqlx::query_as(
        "WITH gone AS (
             DELETE FROM fleet_members
              WHERE redis_up AND seen_at <= clock_timestamp() - $1 * interval '1 millisecond'
             RETURNING instance, seen_at
         ), logged AS (
             INSERT INTO audit_events (kind, detail)
             SELECT 'fleet.forgotten',
                    jsonb_strip_nulls(jsonb_build_object(
                        'instance', instance::text, 'last_seen', seen_at,
                        'member_timeout_ms', $1::bigint, 'by', 'cli', 'reason', $2::text,
                        'accepted', 'lost_decisions'))
               FROM gone
         )
         SELECT instance, seen_at FROM gone",
    )
    .bind(ms(member_timeout))
    .bind(reason)
    .fetch_all(pool)
    .await?;
    let mut out: Vec<Forgotten> = rows
        .into_iter()
        .map(|(instance, last_seen)| Forgotten {
            instance,
            last_seen,
        })
        .collect();
    out.sort_by_key(|f| f.last_seen);
    Ok(out)
}

/// A member leaving cleanly (after writing its Redis decisions not known
/// to be in Postgres) is no longer waited for; members that last reported
/// Redis down and were not seen for an hour are forgotten. One that last
/// reported Redis up is only ever [`retire`]d.
pub async fn leave(pool: &PgPool, instance: Uuid) -> Result<(), DurableError> {
    sqlx::query(
        "DELETE FROM fleet_members
          WHERE instance = $1 OR (NOT redis_up AND seen_at < now() - interval '1 hour')",
    )
    .bind(instance)
    .execute(pool)
    .await?;
    Ok(())
}

/// A fast consume decided by Postgres while the fleet has Redis down: only
/// under the fleet row's share lock at `epoch` (so the return to normal waits
/// for it and sees it), and with its `redis_resync` row in the same
/// transaction. `None`: the fleet is no longer at that epoch's `redis_down`,
/// nothing was decided.
pub async fn consume_fenced(
    pool: &PgPool,
    epoch: i64,
    rec: &TokenRecord,
    handle: &str,
    fingerprint: Option<&str>,
    request_id: Option<&str>,
) -> Result<Option<(ConsumeRow, i64)>, DurableError> {
    let mut tx = pool.begin().await?;
    if !fenced(&mut tx, epoch).await? {
        return Ok(None);
    }
    let row = tokens::consume_statement(rec, fingerprint, request_id)
        .fetch_optional(&mut *tx)
        .await?;
    let decided = tokens::consumed_row(row)?;
    if let Some((ConsumeRow::Won { .. }, _)) = decided {
        queue(&mut tx, epoch, rec.id, handle).await?;
    }
    tx.commit().await?;
    match decided {
        Some(d) => Ok(Some(d)),
        None => tokens::fresh_read(pool, rec.id).await.map(Some),
    }
}

/// Whether the fleet is at `epoch`'s `redis_down`, holding the share lock
/// on its row until the transaction ends.
async fn fenced(conn: &mut PgConnection, epoch: i64) -> Result<bool, DurableError> {
    let at: Option<i64> = sqlx::query_scalar(
        "SELECT epoch FROM fleet_state WHERE id = 1 AND state = 'redis_down' FOR SHARE",
    )
    .fetch_optional(conn)
    .await?;
    Ok(at == Some(epoch))
}

async fn queue(
    conn: &mut PgConnection,
    epoch: i64,
    id: i64,
    handle: &str,
) -> Result<(), DurableError> {
    sqlx::query(
        "INSERT INTO redis_resync (token_id, handle, epoch) VALUES ($1, $2, $3)
         ON CONFLICT (token_id) DO UPDATE SET epoch = EXCLUDED.epoch",
    )
    .bind(id)
    .bind(handle)
    .bind(epoch)
    .execute(conn)
    .await?;
    Ok(())
}

/// A fast result decided by Postgres while the fleet has Redis down: under
/// the fleet row's share lock at `epoch`, queued for Redis in the same
/// transaction, like [`consume_fenced`]. `None`: the fleet is no longer at
/// that epoch's `redis_down`, nothing was written (Redis decides again, and
/// may hold a consume Postgres has not heard of yet: its answer is not
/// Postgres's to give).
pub async fn set_result_fenced(
    pool: &PgPool,
    epoch: i64,
    id: i64,
    handle: &str,
    result: &serde_json::Value,
    detail: Option<&serde_json::Value>,
    of_request: Option<&str>,
) -> Result<Option<ResultDecided>, DurableError> {
    let mut tx = pool.begin().await?;
    if !fenced(&mut tx, epoch).await? {
        return Ok(None);
    }
    let row = tokens::set_result_statement(id, result, detail, of_request)
        .fetch_optional(&mut *tx)
        .await?;
    let decided = match row.as_ref().map(tokens::existing).transpose()? {
        Some(e) => {
            queue(&mut tx, epoch, id, handle).await?;
            ResultDecided::Recorded(e)
        }
        // Read under the same fence: Postgres's answer while it decides.
        None => match tokens::find_on(&mut tx, id).await? {
            Some(e) => ResultDecided::Existing(e),
            None => ResultDecided::Unknown,
        },
    };
    tx.commit().await?;
    Ok(Some(decided))
}

/// Queues a change Postgres made to a fast token or key while the fleet had
/// Redis down (a result, a release), after the fact: fenced like a consume,
/// so that it is either seen by the return to normal or refused.
/// `false`: the fleet is no longer at that epoch.
pub async fn queue_fenced(
    pool: &PgPool,
    epoch: i64,
    id: i64,
    handle: &str,
) -> Result<bool, DurableError> {
    let mut tx = pool.begin().await?;
    if !fenced(&mut tx, epoch).await? {
        return Ok(false);
    }
    queue(&mut tx, epoch, id, handle).await?;
    tx.commit().await?;
    Ok(true)
}

/// One queued decision: the Redis key's handle and the token as Postgres
/// holds it now.
#[derive(Debug, Clone)]
pub struct Queued {
    pub id: i64,
    pub handle: String,
    pub state: Existing,
}

/// The decisions queued for Redis (any epoch up to `epoch`).
pub async fn queued(conn: &mut PgConnection, epoch: i64) -> Result<Vec<Queued>, DurableError> {
    let rows = sqlx::query(
        "SELECT r.token_id, r.handle, t.state, t.consumed_at, t.fingerprint, t.request_id,
                t.result, t.order_id, t.expires_at, t.gen
           FROM redis_resync r JOIN tokens t ON t.id = r.token_id
          WHERE r.epoch <= $1
          ORDER BY r.token_id",
    )
    .bind(epoch)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Queued {
                id: r.try_get("token_id")?,
                handle: r.try_get("handle")?,
                state: tokens::existing(r)?,
            })
        })
        .collect()
}

/// The fleet row's transaction that ends an episode ([`begin_return`]),
/// with the Redis dataset the fleet agreed on.
pub struct Return {
    pub tx: sqlx::Transaction<'static, sqlx::Postgres>,
    /// `None`: none yet; [`finish_return`] records the one written.
    pub dataset: Option<Uuid>,
}

/// The transaction that ends an episode: holds the fleet row exclusively
/// (every fenced decision has committed or waits and will be refused).
/// `None`: the fleet is not at `epoch`'s `redis_down` (another member
/// ended it already).
pub async fn begin_return(pool: &PgPool, epoch: i64) -> Result<Option<Return>, DurableError> {
    let mut tx = pool.begin().await?;
    let at: Option<(String, i64, Option<Uuid>)> = sqlx::query_as(
        "SELECT state, epoch, redis_dataset FROM fleet_state WHERE id = 1 FOR UPDATE",
    )
    .fetch_optional(&mut *tx)
    .await?;
    match at {
        Some((state, e, dataset)) if state == "redis_down" && e == epoch => {
            Ok(Some(Return { tx, dataset }))
        }
        _ => Ok(None),
    }
}

/// Ends the episode in the transaction of [`begin_return`]: the fleet is
/// normal at a new epoch with `dataset` (written into Redis before), and
/// the queue up to `epoch` is emptied.
pub async fn finish_return(
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    epoch: i64,
    dataset: Uuid,
) -> Result<i64, DurableError> {
    sqlx::query("DELETE FROM redis_resync WHERE epoch <= $1")
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
    let next: i64 = sqlx::query_scalar(
        "UPDATE fleet_state SET state = 'normal', epoch = epoch + 1, since = now(),
                redis_dataset = $1
          WHERE id = 1 RETURNING epoch",
    )
    .bind(dataset)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(next)
}

/// The first member's transaction that records a Redis dataset for the
/// fleet, holding its row: `Some` only while the fleet is normal and has
/// none (a new database, or one migrated from before V17). The caller
/// writes the id into Redis, then [`finish_adopt`].
pub async fn begin_adopt(
    pool: &PgPool,
) -> Result<Option<sqlx::Transaction<'static, sqlx::Postgres>>, DurableError> {
    let mut tx = pool.begin().await?;
    let none_yet: Option<bool> = sqlx::query_scalar(
        "SELECT redis_dataset IS NULL AND state = 'normal' FROM fleet_state WHERE id = 1 FOR UPDATE",
    )
    .fetch_optional(&mut *tx)
    .await?;
    Ok(none_yet.unwrap_or(false).then_some(tx))
}

/// Records `dataset` (already in Redis) as the fleet's, in the transaction
/// of [`begin_adopt`].
pub async fn finish_adopt(
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    dataset: Uuid,
) -> Result<(), DurableError> {
    sqlx::query("UPDATE fleet_state SET redis_dataset = $1 WHERE id = 1")
        .bind(dataset)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}
