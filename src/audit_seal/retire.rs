//! Audit retention: dropping a day partition of `audit_events` (V22: the
//! events of the tokens issued that day) once `audit.retention` has passed
//! over every event in it, without breaking `audit verify`
//! ([`Seals::retire`]).
//!
//! A partition is dropped only when, in one transaction holding it locked
//! against writes:
//! - its day's `tokens` partition is gone and its newest event is older than
//!   the retention (an event that still comes for one of its tokens, say
//!   one whose row sat in `tokens_default`, lands in `audit_events_default`
//!   once the day is dropped, and is sealed there);
//! - every event in it is sealed, by version 2 checkpoints only (a version 1
//!   checkpoint chains all its events together: dropping some would leave it
//!   unverifiable);
//! - its events verify: each checkpoint that has a part for it has a MAC
//!   that verifies and parts that hash to its digest, and the partition's
//!   events in that checkpoint's range hash to that part. An event edited,
//!   deleted or inserted before the drop keeps the partition (and is named
//!   in the reconcile run's errors), so a drop never launders a change.
//!
//! Then it writes the retirement (`audit_retirements`: the partition, when,
//! how many events over how many checkpoints, under the seal key's MAC) and
//! an `audit.retired` event, and drops the table. `audit verify` takes a
//! retired partition's parts as sealed.

use std::collections::HashMap;
use std::time::Duration;

use super::chain::{self, Chain, RetirementFields, GENESIS};
use super::{check_mac, parse_parts, Seals};
use crate::durable::partitions::{self, AuditDay};
use crate::durable::seal::{self as sql, RetirementRow};
use crate::durable::DurableError;

/// Events read per page while a partition is verified.
const PAGE: i64 = 10_000;

/// What [`Seals::retire`] did with one partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retire {
    /// Verified, recorded and dropped, with this many events.
    Dropped { events: i64 },
    /// Kept, for this reason.
    Kept(Keep),
    /// A lock was not granted in time: left for the next run.
    Busy,
}

/// Why a partition past its bound was kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keep {
    /// Its tokens' partition is still there, or an event in it is newer
    /// than the retention.
    WithinRetention,
    /// Some event in it is above the newest checkpoint: it goes once sealed.
    Unsealed,
    /// A version 1 checkpoint seals some of its events.
    SealedFlat,
    /// Its events do not verify against their checkpoints: why.
    DoesNotVerify(String),
}

impl Seals {
    /// Drops `day` if it may go and its events verify (see the module), with
    /// its retirement and an `audit.retired` event (`by`: the run's actor) in
    /// the same transaction. Waits at most 200 ms for each lock.
    pub async fn retire(
        &self,
        day: &AuditDay,
        retention: Duration,
        by: &str,
    ) -> Result<Retire, DurableError> {
        if !day.tokens_gone || !day.past_bound {
            return Ok(Retire::Kept(Keep::WithinRetention));
        }
        let Some(key) = self.keys.first() else {
            return Ok(Retire::Kept(Keep::DoesNotVerify(
                "no audit.seal_keys to record a retirement with".to_owned(),
            )));
        };
        let mut tx = self.pool.begin().await?;
        if !partitions::lock_audit_day(&mut tx, &day.name).await? {
            return Ok(Retire::Busy);
        }
        let span = sql::partition_span(&mut tx, &day.name, retention.as_secs_f64()).await?;
        if !span.past_retention {
            return Ok(Retire::Kept(Keep::WithinRetention));
        }
        if let Some(last) = span.last_id {
            let sealed_to = sql::last_checkpoint(&mut *tx)
                .await?
                .map(|c| c.last_event_id);
            if sealed_to.is_none_or(|s| s < last) {
                return Ok(Retire::Kept(Keep::Unsealed));
            }
        }
        if let (Some(first), Some(flat)) = (span.first_id, sql::last_flat_event_id(&mut tx).await?)
        {
            if first <= flat {
                return Ok(Retire::Kept(Keep::SealedFlat));
            }
        }
        let checkpoints = match self.verify_partition(&mut tx, &day.name).await? {
            Ok(n) => n,
            Err(why) => return Ok(Retire::Kept(Keep::DoesNotVerify(why))),
        };
        let retired_at = sql::clock_now(&mut tx).await?;
        let fields = RetirementFields {
            partition: &day.name,
            retired_at,
            events: span.events,
            checkpoints,
            key_id: &key.id,
        };
        let row = RetirementRow {
            partition: day.name.clone(),
            retired_at,
            events: span.events,
            checkpoints,
            key_id: key.id.clone(),
            mac: hex::encode(fields.mac(&key.secret)),
        };
        sql::insert_retirement(&mut tx, &row).await?;
        sql::insert_retired_event(&mut tx, &row, by).await?;
        if !partitions::drop_audit_day(&mut tx, &day.name).await? {
            return Ok(Retire::Busy);
        }
        tx.commit().await?;
        Ok(Retire::Dropped {
            events: span.events,
        })
    }

    /// Recomputes the parts that the checkpoints hold for `partition` from
    /// its events: `Ok(Ok(checkpoints))` when every one matches, else why not.
    async fn verify_partition(
        &self,
        conn: &mut sqlx::PgConnection,
        partition: &str,
    ) -> Result<Result<i64, String>, DurableError> {
        let keys: HashMap<&str, &[u8]> = self
            .keys
            .iter()
            .map(|k| (k.id.as_str(), k.secret.as_slice()))
            .collect();
        let checkpoints = sql::checkpoints_with_part(&mut *conn, partition).await?;
        // Each checkpoint's part for the partition, once the checkpoint itself verifies.
        let mut wanted = Vec::with_capacity(checkpoints.len());
        for c in &checkpoints {
            if let Some(m) = check_mac(c, &keys) {
                return Ok(Err(format!("checkpoint {}: {}", c.id, m.message)));
            }
            let (Some(parts), Some(prev)) = (
                c.parts.as_deref().and_then(parse_parts),
                chain::parse_hex32(&c.prev_digest),
            ) else {
                return Ok(Err(format!(
                    "checkpoint {}: its parts are not readable",
                    c.id
                )));
            };
            if hex::encode(chain::parts_digest(&prev, &parts)) != c.digest {
                return Ok(Err(format!(
                    "checkpoint {}: its parts do not hash to its digest",
                    c.id
                )));
            }
            let Some(part) = parts.into_iter().find(|p| p.partition == partition) else {
                return Ok(Err(format!("checkpoint {}: no part for {partition}", c.id)));
            };
            wanted.push((c, part));
        }
        let mut at = 0usize;
        let mut chain = Chain::new(&GENESIS);
        let mut after = i64::MIN;
        loop {
            let page = sql::partition_events(&mut *conn, partition, after, PAGE).await?;
            let Some(tail) = page.last() else { break };
            after = tail.id;
            for e in &page {
                while at < wanted.len() && e.id > wanted[at].0.last_event_id {
                    if let Err(why) = part_matches(&wanted[at], chain) {
                        return Ok(Err(why));
                    }
                    chain = Chain::new(&GENESIS);
                    at += 1;
                }
                match wanted.get(at) {
                    Some((c, _)) if e.id >= c.first_event_id => chain.push(e),
                    _ => {
                        return Ok(Err(format!(
                            "event {} is in no checkpoint's part for {partition} (inserted)",
                            e.id
                        )))
                    }
                }
            }
        }
        while at < wanted.len() {
            if let Err(why) = part_matches(&wanted[at], chain) {
                return Ok(Err(why));
            }
            chain = Chain::new(&GENESIS);
            at += 1;
        }
        Ok(Ok(i64::try_from(wanted.len()).unwrap_or(i64::MAX)))
    }
}

/// One checkpoint's part against the chain of the partition's events found
/// in its range.
fn part_matches(
    (c, part): &(&sql::CheckpointRow, chain::Part),
    chain: Chain,
) -> Result<(), String> {
    let got = chain.finish();
    if got.events == part.events && got.digest == part.digest {
        return Ok(());
    }
    Err(format!(
        "checkpoint {}: the {} event(s) it sealed in {} are now {} that do not hash to its part (edited, deleted or inserted)",
        c.id, part.events, part.partition, got.events
    ))
}
