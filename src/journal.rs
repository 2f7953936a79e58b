//! The fast-type journal: what Redis decided for fast biz types (consume,
//! result, release) reaches Postgres through a Redis stream read by a consumer
//! group. An entry is acknowledged only after Postgres has it: after a failed
//! round (Postgres down) this consumer re-reads its own pending entries first;
//! entries left pending by a dead instance are claimed after 30 s. Applying an
//! entry twice changes nothing.

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use serde_json::Value as Json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::durable::tokens::{self, JournalConsume, TokenRecord};
use crate::fast::FastTier;

pub const GROUP: &str = "ledger";
const BATCH: usize = 500;
const CLAIM_IDLE_MS: u64 = 30_000;

/// One journal entry's fields, as the ledger writes them.
pub fn consume_fields(
    rec: &TokenRecord,
    request_id: Option<&str>,
    fingerprint: Option<&str>,
) -> Vec<(&'static str, String)> {
    vec![
        ("op", "consume".into()),
        ("id", rec.id.to_string()),
        ("token", rec.token.clone()),
        ("biz", rec.biz_type.clone()),
        ("sub", rec.subject.clone()),
        ("cl", rec.client.clone()),
        ("iat", rec.issued_at.timestamp_millis().to_string()),
        ("exp", rec.expires_at.timestamp_millis().to_string()),
        ("rid", request_id.unwrap_or("").into()),
        ("fp", fingerprint.unwrap_or("").into()),
    ]
}

pub fn result_fields(id: i64, result: &str) -> Vec<(&'static str, String)> {
    vec![
        ("op", "result".into()),
        ("id", id.to_string()),
        ("res", result.into()),
    ]
}

pub fn release_fields(id: i64) -> Vec<(&'static str, String)> {
    vec![("op", "release".into()), ("id", id.to_string())]
}

#[derive(Debug)]
enum Entry {
    Consume(JournalConsume),
    Result {
        id: i64,
        result: Json,
    },
    Release {
        id: i64,
    },
    /// Unreadable: acknowledged and logged, never retried forever.
    Bad,
}

fn field(e: &StreamId, k: &str) -> String {
    e.get::<String>(k).unwrap_or_default()
}

fn ms_to_time(ms: &str) -> Option<chrono::DateTime<Utc>> {
    ms.parse::<i64>()
        .ok()
        .and_then(|m| Utc.timestamp_millis_opt(m).single())
}

fn parse(e: &StreamId) -> Entry {
    let id: Option<i64> = field(e, "id").parse().ok();
    let opt = |s: String| (!s.is_empty()).then_some(s);
    match (field(e, "op").as_str(), id) {
        ("consume", Some(id)) => {
            let (Some(iat), Some(exp), Some(at)) = (
                ms_to_time(&field(e, "iat")),
                ms_to_time(&field(e, "exp")),
                ms_to_time(&field(e, "at")),
            ) else {
                return Entry::Bad;
            };
            Entry::Consume(JournalConsume {
                record: TokenRecord {
                    id,
                    token: field(e, "token"),
                    biz_type: field(e, "biz"),
                    durability: "fast",
                    subject: field(e, "sub"),
                    client: field(e, "cl"),
                    issued_at: iat,
                    expires_at: exp,
                },
                consumed_at: at,
                fingerprint: opt(field(e, "fp")),
                request_id: opt(field(e, "rid")),
            })
        }
        ("result", Some(id)) => match serde_json::from_str(&field(e, "res")) {
            Ok(result) => Entry::Result { id, result },
            Err(_) => Entry::Bad,
        },
        ("release", Some(id)) => Entry::Release { id },
        _ => Entry::Bad,
    }
}

/// Applies entries in order: runs of consumes in one statement each.
async fn apply(pool: &PgPool, entries: &[StreamId]) -> Result<(), crate::durable::DurableError> {
    let mut run: Vec<JournalConsume> = Vec::new();
    for e in entries {
        match parse(e) {
            Entry::Consume(c) => run.push(c),
            other => {
                tokens::apply_journal_consumes(pool, &run).await?;
                run.clear();
                match other {
                    Entry::Result { id, result } => {
                        tokens::set_result(pool, id, &result).await?;
                    }
                    Entry::Release { id } => {
                        tokens::release(pool, id).await?;
                    }
                    Entry::Bad => {
                        tracing::error!(entry = %e.id, "unreadable journal entry skipped")
                    }
                    Entry::Consume(_) => {}
                }
            }
        }
    }
    tokens::apply_journal_consumes(pool, &run).await?;
    Ok(())
}

/// Drains the journal until `shutdown`. Never blocks a shared connection
/// (no `BLOCK`): it polls, sleeping briefly when the stream is empty.
pub async fn run(fast: Arc<FastTier>, pool: PgPool, consumer: String, shutdown: CancellationToken) {
    let key = fast.journal_key();
    let mut group_ready = false;
    let mut last_claim = tokio::time::Instant::now();
    // Entries this consumer read but did not acknowledge (a failed round, or
    // an earlier life under the same worker id) come first.
    let mut own_pending = true;
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        let idle = match drain_once(
            &fast,
            &pool,
            &key,
            &consumer,
            &mut group_ready,
            &mut last_claim,
            &mut own_pending,
        )
        .await
        {
            Ok(0) => Duration::from_millis(50),
            Ok(_) => Duration::ZERO,
            Err(e) => {
                own_pending = true;
                tracing::debug!(error = %e, "journal not drained this round");
                Duration::from_millis(500)
            }
        };
        if !idle.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(idle) => {}
                _ = shutdown.cancelled() => break,
            }
        }
    }
}

/// One round; returns how many entries were applied. With `own_pending`, it
/// re-reads the entries this consumer holds unacknowledged first (and clears
/// the flag once there are none).
pub async fn drain_once(
    fast: &FastTier,
    pool: &PgPool,
    key: &str,
    consumer: &str,
    group_ready: &mut bool,
    last_claim: &mut tokio::time::Instant,
    own_pending: &mut bool,
) -> anyhow::Result<usize> {
    if !*group_ready {
        let created = fast
            .raw("xgroup", |mut c| async move {
                redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(key)
                    .arg(GROUP)
                    .arg("0")
                    .arg("MKSTREAM")
                    .query_async::<()>(&mut c)
                    .await
            })
            .await;
        match created {
            Ok(()) => {}
            Err(crate::fast::FastError::Redis(e)) if e.to_string().contains("BUSYGROUP") => {}
            Err(e) => return Err(e.into()),
        }
        *group_ready = true;
    }
    let mut entries: Vec<StreamId> = Vec::new();
    if last_claim.elapsed() > Duration::from_secs(10) {
        *last_claim = tokio::time::Instant::now();
        let claimed: StreamAutoClaimReply = fast
            .raw("xautoclaim", |mut c| async move {
                redis::cmd("XAUTOCLAIM")
                    .arg(key)
                    .arg(GROUP)
                    .arg(consumer)
                    .arg(CLAIM_IDLE_MS)
                    .arg("0-0")
                    .arg("COUNT")
                    .arg(BATCH)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        entries.extend(claimed.claimed);
    }
    for from in ["0", ">"] {
        if !entries.is_empty() {
            break;
        }
        if from == "0" && !*own_pending {
            continue;
        }
        let read: StreamReadReply = fast
            .raw("xreadgroup", |mut c| async move {
                redis::cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(GROUP)
                    .arg(consumer)
                    .arg("COUNT")
                    .arg(BATCH)
                    .arg("STREAMS")
                    .arg(key)
                    .arg(from)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        entries = read.keys.into_iter().flat_map(|k| k.ids).collect();
        if from == "0" && entries.is_empty() {
            *own_pending = false;
        }
    }
    if entries.is_empty() {
        return Ok(0);
    }
    apply(pool, &entries).await?;
    let ids: Vec<String> = entries.iter().map(|e| e.id.clone()).collect();
    let n = ids.len();
    fast.raw("xack", |mut c| async move {
        let mut p = redis::pipe();
        p.cmd("XACK").arg(key).arg(GROUP).arg(&ids).ignore();
        p.cmd("XDEL").arg(key).arg(&ids).ignore();
        p.query_async::<()>(&mut c).await
    })
    .await?;
    Ok(n)
}
