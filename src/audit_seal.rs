//! Sealed audit checkpoints: the background job that seals the audit events
//! written since the last checkpoint ([`Seals::run`], one pass:
//! [`Seals::seal_once`]), the verifier behind `audit verify`
//! ([`Seals::verify`]), the last checkpoint for `GET /v1/admin/audit/seal`
//! ([`Seals::last`]) and its gauge ([`last_seal_metric`]). The arithmetic
//! (canonical bytes, chain, MAC) is in [`chain`]; the SQL in
//! [`crate::durable::seal`]. Everything runs on the admin pool: sealing
//! costs nothing on the consume path, which only ever inserts audit rows.
//!
//! # What holds, and why
//!
//! - **Only settled events are sealed.** An event's id is taken from the
//!   identity sequence when it is inserted, but it becomes visible only when
//!   its transaction commits: a transaction still running may commit an id
//!   below one already visible. Sealing past it would later look like an
//!   event inserted into a sealed range. `at` cannot tell either: it is the
//!   inserting transaction's start, or a time the journal carries from
//!   Redis, minutes old after an outage. The rule: read `H`, the highest
//!   visible id; *then* list the transactions holding a write lock
//!   (`RowExclusiveLock`) on `audit_events`; wait until none of them holds
//!   it any more; only then read and seal the events up to `H`. Why that is
//!   enough: take an event `k <= H` that commits some day, inserted by a
//!   transaction `T`. The sequence hands ids out in time order (cache 1, the
//!   identity default, checked before every pass), so `k` was taken before
//!   `H`, and `H` was committed before it was read. `T` took its lock on
//!   `audit_events` before it took `k` (the lock comes with the statement,
//!   before any row is built) and holds it until it ends. So when the list
//!   is read, `T` has either ended (committed: visible to every later read)
//!   or is on the list, and the events are read only after everything on
//!   the list has ended. Transactions that start later take ids above `H`.
//!   A write lock held for long (a transaction left open) holds sealing back
//!   until it ends; the pass gives up after [`settle_wait`] and the next one
//!   tries again. Nothing on the payment path waits for the sealer: it only
//!   reads `pg_locks` and the table.
//! - **One instance seals at a time, each checkpoint in one transaction.**
//!   The sealing transaction takes `pg_try_advisory_xact_lock` first and
//!   reads the last checkpoint under it, so two instances never seal the
//!   same range; one that finds the lock taken leaves the pass to the other.
//!   Ranges are contiguous: checkpoint N covers the ids in
//!   (N-1's `last_event_id`, N's `last_event_id`], so every id is covered by
//!   exactly one checkpoint once sealed, and ids lost to rolled-back
//!   transactions need no record.
//! - **What a checkpoint proves.** Its digest chains the previous digest and
//!   every event of its range (version 2, since V22: per partition of
//!   `audit_events`, see [`chain`]); its MAC under a seal key covers the
//!   digest and its own fields (version, id, time, range, count, previous
//!   digest, key id).
//!   Changing, removing or adding an event in a sealed range, or a
//!   checkpoint, without the seal key shows in `audit verify`. Removing the
//!   newest checkpoints (with their events) does not break the chain: the
//!   last seal's id and time are exported
//!   (`ledger_audit_last_seal_timestamp_seconds`, the console) so that an
//!   outside record can tell.
//! - **A partition dropped under `audit.retention` keeps its checkpoints
//!   verifiable** ([`retire`]): it goes only after its events verified
//!   against every part that seals them, with a retirement under the seal
//!   key's MAC; the verifier takes a retired partition's parts as sealed
//!   and recomputes the rest.

pub mod chain;
pub mod retire;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use futures_util::TryStreamExt;
use prometheus::Gauge;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

use crate::config::{AuditSettings, SealKey};
use crate::durable::seal::{self as sql, CheckpointRow};
use crate::durable::DurableError;
use crate::metrics::OnScrape;
use chain::{Chain, Digest, MacFields, Part, Parts, RetirementFields, Version, GENESIS};

/// The most events one checkpoint seals; a pass with more writes several
/// checkpoints (each one transaction of bounded length).
pub const MAX_EVENTS_PER_CHECKPOINT: i64 = 50_000;

/// Checkpoints read per page by the verifier.
const VERIFY_PAGE: i64 = 500;

/// How often the settle rule looks again at the transactions it waits for.
const SETTLE_POLL: Duration = Duration::from_millis(20);

/// How often a scrape may have the last checkpoint read again.
pub const LAST_SEAL_REFRESH: Duration = Duration::from_secs(5);

/// How long one pass waits for the transactions writing audit events when
/// it began to end: `seal_every`, at most 30 s.
pub fn settle_wait(seal_every: Duration) -> Duration {
    seal_every.min(Duration::from_secs(30))
}

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("postgres")]
    Postgres(#[from] DurableError),
    /// Ids handed out from a cache are not in time order: the settle rule
    /// would not hold, so nothing is sealed.
    #[error(
        "the sequence of audit_events.id caches {0} values per session; sealing needs CACHE 1 (ALTER TABLE audit_events ALTER COLUMN id SET CACHE 1)"
    )]
    SequenceCached(i64),
}

/// What one sealing pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealPass {
    /// Wrote `checkpoints` checkpoints sealing `events` events (0 and 0:
    /// nothing new had settled).
    Sealed { checkpoints: u32, events: i64 },
    /// Another instance's sealing transaction held the lock: the pass is
    /// theirs (after `checkpoints` checkpoints of this one's, if any).
    Busy { checkpoints: u32 },
    /// `waiting` transactions that were writing audit events when the pass
    /// began were still running at its deadline: nothing sealed.
    Unsettled { waiting: usize },
}

/// The last checkpoint as `GET /v1/admin/audit/seal` and `audit verify`
/// show it. Ids are strings, as audit event ids are.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CheckpointView {
    #[schema(example = "17")]
    pub id: String,
    /// When it was sealed (Postgres's clock), RFC 3339.
    #[schema(value_type = String, format = DateTime)]
    pub sealed_at: String,
    /// The lowest audit event id it seals.
    #[schema(example = "1001")]
    pub first_event_id: String,
    /// The highest: the next checkpoint seals the ids above it.
    #[schema(example = "1342")]
    pub last_event_id: String,
    /// How many events it seals.
    pub events: i64,
    /// Hex SHA-256 chained over the previous checkpoint's digest and its events.
    pub digest: String,
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

impl From<&CheckpointRow> for CheckpointView {
    fn from(c: &CheckpointRow) -> CheckpointView {
        CheckpointView {
            id: c.id.to_string(),
            sealed_at: time(c.sealed_at),
            first_event_id: c.first_event_id.to_string(),
            last_event_id: c.last_event_id.to_string(),
            events: c.events,
            digest: c.digest.clone(),
        }
    }
}

/// Why a checkpoint does not verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Problem {
    /// Its `key_id` names no key of `audit.seal_keys`.
    UnknownKey,
    /// Its MAC does not verify under its key: the checkpoint row was
    /// changed (or made) without the seal key.
    Mac,
    /// Its `prev_digest` is not the previous checkpoint's digest: a
    /// checkpoint was removed or changed.
    Chain,
    /// The events of its range no longer hash to its digest: one was
    /// edited, deleted or inserted.
    Events,
}

/// One checkpoint that does not verify.
#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    pub checkpoint: String,
    pub sealed_at: String,
    pub problem: Problem,
    /// For humans: what differs.
    pub message: String,
}

/// `audit verify`'s summary.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// Every checkpoint checked matched.
    pub ok: bool,
    /// Checkpoints checked (from `--since`, else all).
    pub checkpoints: u64,
    /// Events recomputed over them.
    pub events: i64,
    /// The newest checkpoint (the last one checked), if any.
    pub last_checkpoint: Option<CheckpointView>,
    /// Events above the newest checkpoint: not sealed yet.
    pub unsealed_events: i64,
    /// Events sealed in partitions dropped under `audit.retention`, whose
    /// parts were taken as sealed (their retirement's MAC verified), not
    /// recomputed.
    pub retired_events: i64,
    /// Every checkpoint that does not match, oldest first.
    pub mismatches: Vec<Mismatch>,
}

/// The seal job and its reads, over the admin pool.
#[derive(Clone)]
pub struct Seals {
    pool: PgPool,
    /// The first seals; every one verifies.
    keys: Arc<Vec<SealKey>>,
    every: Duration,
}

impl std::fmt::Debug for Seals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seals")
            .field("keys", &self.keys)
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

impl Seals {
    pub fn new(settings: &AuditSettings, admin_pool: PgPool) -> Seals {
        Seals {
            pool: admin_pool,
            keys: Arc::new(settings.seal_keys.clone()),
            every: settings.seal_every,
        }
    }

    /// Every `audit.seal_every`, one [`Seals::seal_once`], until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.every) => {}
                _ = shutdown.cancelled() => return,
            }
            let pass = tokio::select! {
                p = self.seal_once() => p,
                _ = shutdown.cancelled() => return,
            };
            match pass {
                Ok(SealPass::Sealed {
                    checkpoints: 0, ..
                })
                | Ok(SealPass::Busy { .. }) => {}
                Ok(SealPass::Sealed {
                    checkpoints,
                    events,
                }) => tracing::debug!(checkpoints, events, "audit events sealed"),
                Ok(SealPass::Unsettled { waiting }) => tracing::warn!(
                    waiting,
                    "audit sealing waits for transactions still writing audit events; trying again next pass"
                ),
                Err(e) => tracing::warn!(error = ?anyhow::Error::from(e), "audit sealing pass failed"),
            }
        }
    }

    /// One pass: waits (at most [`settle_wait`]) for the events up to the
    /// highest visible id to settle (the module's rule), then seals them
    /// into as many checkpoints as [`MAX_EVENTS_PER_CHECKPOINT`] needs.
    #[tracing::instrument(skip(self), level = "debug")]
    pub async fn seal_once(&self) -> Result<SealPass, SealError> {
        let cache = sql::id_sequence_cache(&self.pool).await?;
        if cache != 1 {
            return Err(SealError::SequenceCached(cache));
        }
        let Some(ceiling) = sql::max_event_id(&self.pool).await? else {
            return Ok(SealPass::Sealed {
                checkpoints: 0,
                events: 0,
            });
        };
        let sealed_to = sql::last_checkpoint(&self.pool)
            .await?
            .map(|c| c.last_event_id);
        if sealed_to.is_some_and(|s| s >= ceiling) {
            return Ok(SealPass::Sealed {
                checkpoints: 0,
                events: 0,
            });
        }
        // After the ceiling was read: see the module's proof.
        let writers = sql::audit_writers(&self.pool).await?;
        if !writers.is_empty() {
            let deadline = tokio::time::Instant::now() + settle_wait(self.every);
            loop {
                let running = sql::writers_still_running(&self.pool, &writers).await?;
                if running == 0 {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Ok(SealPass::Unsettled {
                        waiting: usize::try_from(running).unwrap_or(usize::MAX),
                    });
                }
                tokio::time::sleep(SETTLE_POLL).await;
            }
        }
        let (mut checkpoints, mut events) = (0u32, 0i64);
        loop {
            match self.seal_one(ceiling).await? {
                One::Busy => return Ok(SealPass::Busy { checkpoints }),
                One::Done => break,
                One::Sealed { events: n, full } => {
                    checkpoints += 1;
                    events += n;
                    if !full {
                        break;
                    }
                }
            }
        }
        Ok(SealPass::Sealed {
            checkpoints,
            events,
        })
    }

    /// One checkpoint over the settled events above the last one, up to
    /// `ceiling`, in one transaction under the seal lock.
    async fn seal_one(&self, ceiling: i64) -> Result<One, DurableError> {
        let mut tx = self.pool.begin().await?;
        if !sql::try_seal_lock(&mut tx).await? {
            return Ok(One::Busy);
        }
        let last = sql::last_checkpoint(&mut *tx).await?;
        let after = last.as_ref().map(|c| c.last_event_id);
        if after.is_some_and(|a| a >= ceiling) {
            return Ok(One::Done);
        }
        let prev = match &last {
            Some(c) => chain::parse_hex32(&c.digest).ok_or_else(|| {
                DurableError::Other(sqlx::Error::Decode(
                    format!("audit checkpoint {} holds a malformed digest", c.id).into(),
                ))
            })?,
            None => GENESIS,
        };
        let mut parts = Parts::new();
        {
            let mut rows = sql::events(&mut *tx, after, ceiling, MAX_EVENTS_PER_CHECKPOINT);
            while let Some(e) = rows.try_next().await? {
                parts.push(&e);
            }
        }
        let (parts, sealed) = parts.finish(&prev);
        let (Some(first), Some(last_id)) = (sealed.first_event_id, sealed.last_event_id) else {
            // Every id up to the ceiling was rolled back: nothing to seal.
            return Ok(One::Done);
        };
        let key = self.keys.first().ok_or_else(|| {
            DurableError::Other(sqlx::Error::Protocol("no audit.seal_keys".into()))
        })?;
        let (id, sealed_at) = sql::next_checkpoint_id(&mut tx).await?;
        let fields = MacFields {
            version: Version::ByPartition,
            id,
            sealed_at,
            first_event_id: first,
            last_event_id: last_id,
            events: sealed.events,
            prev_digest: &prev,
            digest: &sealed.digest,
            key_id: &key.id,
        };
        let row = CheckpointRow {
            id,
            sealed_at,
            first_event_id: first,
            last_event_id: last_id,
            events: sealed.events,
            prev_digest: hex::encode(prev),
            digest: hex::encode(sealed.digest),
            key_id: key.id.clone(),
            mac: hex::encode(fields.mac(&key.secret)),
            version: Version::ByPartition.as_i16(),
            parts: Some(parts_json(&parts)),
        };
        sql::insert_checkpoint(&mut tx, &row).await?;
        tx.commit().await?;
        Ok(One::Sealed {
            events: sealed.events,
            full: sealed.events >= MAX_EVENTS_PER_CHECKPOINT,
        })
    }

    /// The newest checkpoint, if any.
    pub async fn last(&self) -> Result<Option<CheckpointView>, DurableError> {
        Ok(sql::last_checkpoint(&self.pool)
            .await?
            .as_ref()
            .map(CheckpointView::from))
    }

    /// Recomputes every checkpoint sealed at or after `since` (all without
    /// it) from the events and the previous checkpoint's digest, and checks
    /// each MAC under the key its `key_id` names. Errors only when Postgres
    /// could not be read; mismatches are in the report.
    pub async fn verify(&self, since: Option<DateTime<Utc>>) -> Result<VerifyReport, DurableError> {
        let keys: HashMap<&str, &[u8]> = self
            .keys
            .iter()
            .map(|k| (k.id.as_str(), k.secret.as_slice()))
            .collect();
        let mut report = VerifyReport {
            ok: true,
            checkpoints: 0,
            events: 0,
            last_checkpoint: None,
            unsealed_events: 0,
            retired_events: 0,
            mismatches: Vec::new(),
        };
        let mut retired = trusted_retirements(&sql::retirements(&self.pool).await?, &keys);
        let start = match since {
            None => Some(i64::MIN),
            Some(t) => sql::first_checkpoint_since(&self.pool, t).await?,
        };
        let mut prev: Option<CheckpointRow> = None;
        if let Some(start) = start {
            // With --since, the checkpoint before the first one checked is
            // the anchor: its digest and range are taken as they are, once
            // its MAC verifies.
            if since.is_some() {
                prev = sql::checkpoint_before(&self.pool, start).await?;
                if let Some(p) = &prev {
                    if let Some(m) = check_mac(p, &keys) {
                        report.mismatches.push(m);
                    }
                }
            }
            let mut from = start;
            loop {
                let page = sql::checkpoints_page(&self.pool, from, VERIFY_PAGE).await?;
                let Some(tail) = page.last() else { break };
                from = tail.id.saturating_add(1);
                for c in page {
                    let checked = self.check(&c, prev.as_ref(), &keys, &mut retired).await?;
                    report.checkpoints += 1;
                    report.events += checked.events;
                    report.retired_events += checked.retired_events;
                    report.mismatches.extend(checked.mismatch);
                    prev = Some(c);
                }
            }
        }
        let newest = sql::last_checkpoint(&self.pool).await?;
        report.unsealed_events =
            sql::events_above(&self.pool, newest.as_ref().map(|c| c.last_event_id)).await?;
        report.last_checkpoint = newest.as_ref().map(CheckpointView::from);
        report.ok = report.mismatches.is_empty();
        Ok(report)
    }

    /// One checkpoint against its predecessor: key, MAC, link, then its
    /// events recomputed (a version 2 checkpoint's parts: each one of a
    /// partition in `retired` as sealed).
    async fn check(
        &self,
        c: &CheckpointRow,
        prev: Option<&CheckpointRow>,
        keys: &HashMap<&str, &[u8]>,
        retired: &mut HashSet<String>,
    ) -> Result<Checked, DurableError> {
        let after = prev.map(|p| p.last_event_id);
        let prev_digest = chain::parse_hex32(&c.prev_digest).unwrap_or(GENESIS);
        let version = Version::from_i16(c.version);
        let mut flat = Chain::new(&prev_digest);
        let mut parts = Parts::new();
        let mut rows = sql::events(&self.pool, after, c.last_event_id, i64::MAX);
        while let Some(e) = rows.try_next().await? {
            match version {
                Some(Version::ByPartition) => parts.push(&e),
                _ => flat.push(&e),
            }
        }
        drop(rows);
        let (found, got) = match version {
            Some(Version::ByPartition) => {
                let (found, got) = parts.finish(&prev_digest);
                (Some(found), got)
            }
            _ => (None, flat.finish()),
        };
        if let Some(m) = check_mac(c, keys) {
            return Ok(Checked::found(got.events, Some(m)));
        }
        let want_prev = prev
            .map(|p| p.digest.clone())
            .unwrap_or_else(|| hex::encode(GENESIS));
        if c.prev_digest != want_prev {
            let message = match prev {
                Some(p) => format!(
                    "its prev_digest is not the digest of checkpoint {}, the one sealed before it: a checkpoint was removed or changed",
                    p.id
                ),
                None => "it is the first checkpoint, but its prev_digest is not 64 zeros: earlier checkpoints were removed".to_owned(),
            };
            return Ok(Checked::found(
                got.events,
                Some(mismatch(c, Problem::Chain, message)),
            ));
        }
        let range = match after {
            Some(a) => format!("ids {} to {}", a + 1, c.last_event_id),
            None => format!("ids up to {}", c.last_event_id),
        };
        if let Some(found) = found {
            let mut checked = check_parts(c, &prev_digest, &range, &found, retired);
            if checked.1.is_some() {
                // A partition retired since `retired` was read: its retirement
                // commits with its drop, so one read after the events were
                // found gone sees it.
                *retired = trusted_retirements(&sql::retirements(&self.pool).await?, keys);
                checked = check_parts(c, &prev_digest, &range, &found, retired);
            }
            let (retired_events, mismatch) = checked;
            return Ok(Checked {
                events: got.events,
                retired_events,
                mismatch,
            });
        }
        let matches = hex::encode(got.digest) == c.digest
            && got.events == c.events
            && got.first_event_id == Some(c.first_event_id)
            && got.last_event_id == Some(c.last_event_id);
        if matches {
            return Ok(Checked::found(got.events, None));
        }
        let message = if got.events < c.events {
            format!(
                "{} event(s) of its range ({range}) are gone: {} sealed, {} found (deleted)",
                c.events - got.events,
                c.events,
                got.events
            )
        } else if got.events > c.events {
            format!(
                "{} event(s) more in its range ({range}) than it sealed: {} sealed, {} found (inserted)",
                got.events - c.events,
                c.events,
                got.events
            )
        } else {
            format!(
                "the {} event(s) of its range ({range}) no longer hash to its digest (an event edited, or one deleted and another inserted)",
                c.events
            )
        };
        Ok(Checked::found(
            got.events,
            Some(mismatch(c, Problem::Events, message)),
        ))
    }
}

/// What [`Seals::check`] found in one checkpoint.
struct Checked {
    /// Events recomputed.
    events: i64,
    /// Events of retired partitions' parts, taken as sealed.
    retired_events: i64,
    mismatch: Option<Mismatch>,
}

impl Checked {
    fn found(events: i64, mismatch: Option<Mismatch>) -> Checked {
        Checked {
            events,
            retired_events: 0,
            mismatch,
        }
    }
}

/// What [`Seals::seal_one`] did.
enum One {
    Busy,
    Done,
    Sealed { events: i64, full: bool },
}

fn mismatch(c: &CheckpointRow, problem: Problem, message: String) -> Mismatch {
    Mismatch {
        checkpoint: c.id.to_string(),
        sealed_at: time(c.sealed_at),
        problem,
        message,
    }
}

/// The checkpoint's key and MAC: `None` when they verify.
fn check_mac(c: &CheckpointRow, keys: &HashMap<&str, &[u8]>) -> Option<Mismatch> {
    let Some(secret) = keys.get(c.key_id.as_str()) else {
        return Some(mismatch(
            c,
            Problem::UnknownKey,
            format!(
                "sealed with key `{}`, which audit.seal_keys does not list (keep retired keys listed: they verify only)",
                c.key_id
            ),
        ));
    };
    let fields = (
        chain::parse_hex32(&c.prev_digest),
        chain::parse_hex32(&c.digest),
        chain::parse_hex32(&c.mac),
    );
    let (Some(prev), Some(digest), Some(tag)) = fields else {
        return Some(mismatch(
            c,
            Problem::Mac,
            "its digests or mac are not 64 hex digits".to_owned(),
        ));
    };
    let Some(version) = Version::from_i16(c.version) else {
        return Some(mismatch(
            c,
            Problem::Mac,
            format!("its version {} is none this ledger writes", c.version),
        ));
    };
    let fields = MacFields {
        version,
        id: c.id,
        sealed_at: c.sealed_at,
        first_event_id: c.first_event_id,
        last_event_id: c.last_event_id,
        events: c.events,
        prev_digest: &prev,
        digest: &digest,
        key_id: &c.key_id,
    };
    if fields.verify(secret, &tag) {
        None
    } else {
        Some(mismatch(
            c,
            Problem::Mac,
            format!(
                "its mac does not verify under key `{}`: the checkpoint was changed, or made without the seal key",
                c.key_id
            ),
        ))
    }
}

/// A version 2 checkpoint's parts as stored in `audit_checkpoints.parts`.
#[derive(Debug, Serialize, Deserialize)]
struct StoredPart {
    partition: String,
    events: i64,
    digest: String,
}

/// The parts as `audit_checkpoints.parts` stores them (jsonb's text).
fn parts_json(parts: &[Part]) -> String {
    let stored: Vec<StoredPart> = parts
        .iter()
        .map(|p| StoredPart {
            partition: p.partition.clone(),
            events: p.events,
            digest: hex::encode(p.digest),
        })
        .collect();
    // Strings and integers only: serialising cannot fail.
    serde_json::to_string(&stored).unwrap_or_else(|_| "[]".to_owned())
}

/// The parts of a stored checkpoint, in their stored order; `None` when
/// they are not the stored form (changed by hand).
fn parse_parts(text: &str) -> Option<Vec<Part>> {
    let stored: Vec<StoredPart> = serde_json::from_str(text).ok()?;
    stored
        .into_iter()
        .map(|p| {
            Some(Part {
                digest: chain::parse_hex32(&p.digest)?,
                partition: p.partition,
                events: p.events,
            })
        })
        .collect()
}

/// The partitions whose retirement's MAC verifies under its key: only
/// those are taken as dropped on purpose.
fn trusted_retirements(
    rows: &[sql::RetirementRow],
    keys: &HashMap<&str, &[u8]>,
) -> HashSet<String> {
    rows.iter()
        .filter(|r| {
            let (Some(secret), Some(tag)) =
                (keys.get(r.key_id.as_str()), chain::parse_hex32(&r.mac))
            else {
                return false;
            };
            RetirementFields {
                partition: &r.partition,
                retired_at: r.retired_at,
                events: r.events,
                checkpoints: r.checkpoints,
                key_id: &r.key_id,
            }
            .verify(secret, &tag)
        })
        .map(|r| r.partition.clone())
        .collect()
}

/// A version 2 checkpoint's parts against the events found in its range
/// (`found`, chained per partition): the parts must hash to its digest and
/// add up to its count, and each part must match its partition's events,
/// unless the partition is retired and holds none of them any more.
fn check_parts(
    c: &CheckpointRow,
    prev: &Digest,
    range: &str,
    found: &[Part],
    retired: &HashSet<String>,
) -> (i64, Option<Mismatch>) {
    let Some(sealed) = c.parts.as_deref().and_then(parse_parts) else {
        return (
            0,
            Some(mismatch(
                c,
                Problem::Mac,
                "its parts are not readable: the checkpoint was changed".to_owned(),
            )),
        );
    };
    let total: i64 = sealed.iter().map(|p| p.events).sum();
    if hex::encode(chain::parts_digest(prev, &sealed)) != c.digest || total != c.events {
        return (
            0,
            Some(mismatch(
                c,
                Problem::Mac,
                "its parts do not hash to its digest and count: the checkpoint was changed"
                    .to_owned(),
            )),
        );
    }
    let mut retired_events = 0;
    let by_name: HashMap<&str, &Part> = found.iter().map(|p| (p.partition.as_str(), p)).collect();
    for s in &sealed {
        let message = match by_name.get(s.partition.as_str()) {
            Some(f) if f.events == s.events && f.digest == s.digest => continue,
            None if retired.contains(&s.partition) => {
                retired_events += s.events;
                continue;
            }
            None => format!(
                "the {} event(s) it sealed in partition {} ({range}) are gone, and no retirement (with a MAC that verifies) records the partition's drop",
                s.events, s.partition
            ),
            Some(f) if f.events < s.events => format!(
                "{} event(s) of partition {} in its range ({range}) are gone: {} sealed, {} found (deleted)",
                s.events - f.events,
                s.partition,
                s.events,
                f.events
            ),
            Some(f) if f.events > s.events => format!(
                "{} event(s) more in partition {} in its range ({range}) than it sealed: {} sealed, {} found (inserted)",
                f.events - s.events,
                s.partition,
                s.events,
                f.events
            ),
            Some(_) => format!(
                "the {} event(s) of partition {} in its range ({range}) no longer hash to its part (an event edited, or one deleted and another inserted)",
                s.events, s.partition
            ),
        };
        return (retired_events, Some(mismatch(c, Problem::Events, message)));
    }
    let sealed_names: HashSet<&str> = sealed.iter().map(|p| p.partition.as_str()).collect();
    let inserted = found
        .iter()
        .find(|f| !sealed_names.contains(f.partition.as_str()))
        .map(|f| {
            mismatch(
                c,
                Problem::Events,
                format!(
                    "{} event(s) in partition {} in its range ({range}), which it did not seal (inserted)",
                    f.events, f.partition
                ),
            )
        });
    (retired_events, inserted)
}

/// `ledger_audit_last_seal_timestamp_seconds`: when the newest checkpoint was
/// sealed, as recorded in Postgres by whichever instance sealed it, read
/// when scraped (see [`OnScrape`]). 0 if none. An idle ledger writes no
/// checkpoint, so it stays put while no audit event is written.
pub fn last_seal_metric(pool: PgPool) -> OnScrape {
    // A static, valid definition.
    let gauge = Gauge::new(
        "ledger_audit_last_seal_timestamp_seconds",
        "When the newest sealed audit checkpoint was sealed, in Unix seconds, as recorded in Postgres; 0 if none.",
    )
    .expect("valid metric");
    let g = gauge.clone();
    OnScrape::new(
        vec![Box::new(gauge)],
        LAST_SEAL_REFRESH,
        Arc::new(move || {
            let (pool, g) = (pool.clone(), g.clone());
            Box::pin(async move {
                match sql::last_checkpoint(&pool).await {
                    Ok(last) => g.set(
                        last.map(|c| c.sealed_at.timestamp_millis() as f64 / 1000.0)
                            .unwrap_or(0.0),
                    ),
                    Err(e) => tracing::debug!(error = %e, "last audit seal not read"),
                }
            })
        }),
    )
}
