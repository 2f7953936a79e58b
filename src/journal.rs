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

use crate::config::Durability;
use crate::durable::tokens::{self, JournalConsume, TokenRecord};
use crate::fast::FastTier;

pub const GROUP: &str = "ledger";
const BATCH: usize = 500;
const CLAIM_IDLE_MS: u64 = 30_000;

/// One journal entry's fields, as the ledger writes them.
/// The field that holds an entry: one JSON array (`["consume", id, token,
/// biz, subject, client, issued_at_ms, expires_at_ms, request_id,
/// fingerprint]`, `["result", id, result_json_text]`, `["release", id]`), beside the
/// `at` field the script adds. One field instead of ten keeps both the
/// script's `XADD` and the drainer's parsing of the stream reply cheap.
/// Entries with one field per value (`op`, `id`, ...; written before 0.1)
/// are still read.
pub const ENTRY: &str = "e";

/// The journal fields of a fast-type consume.
pub fn consume_fields(
    rec: &TokenRecord,
    request_id: Option<&str>,
    fingerprint: Option<&str>,
) -> Vec<(&'static str, String)> {
    let entry = (
        "consume",
        rec.id,
        &rec.token,
        &rec.biz_type,
        &rec.subject,
        &rec.client,
        rec.issued_at.timestamp_millis(),
        rec.expires_at.timestamp_millis(),
        request_id.unwrap_or(""),
        fingerprint.unwrap_or(""),
    );
    vec![(ENTRY, pack(&entry))]
}

pub fn result_fields(id: i64, result: &str) -> Vec<(&'static str, String)> {
    // `result` is the JSON text as stored, carried as a string.
    vec![(ENTRY, pack(&("result", id, result)))]
}

pub fn release_fields(id: i64) -> Vec<(&'static str, String)> {
    vec![(ENTRY, pack(&("release", id)))]
}

fn pack(entry: &impl serde::Serialize) -> String {
    // Serializing strings, integers and JSON values into a String cannot fail.
    serde_json::to_string(entry).unwrap_or_default()
}

/// What [`ENTRY`] holds, told apart by length (the first element names it).
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Packed {
    Consume(
        (
            String,
            i64,
            String,
            String,
            String,
            String,
            i64,
            i64,
            String,
            String,
        ),
    ),
    Result((String, i64, String)),
    Release((String, i64)),
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
    match e.get::<String>(ENTRY) {
        Some(packed) => parse_packed(&packed, &field(e, "at")),
        None => parse_fields(e),
    }
}

fn parse_packed(packed: &str, at: &str) -> Entry {
    let opt = |s: String| (!s.is_empty()).then_some(s);
    let time = |ms: i64| Utc.timestamp_millis_opt(ms).single();
    match serde_json::from_str::<Packed>(packed) {
        Ok(Packed::Consume((op, id, token, biz_type, subject, client, iat, exp, rid, fp)))
            if op == "consume" =>
        {
            let (Some(issued_at), Some(expires_at), Some(at)) =
                (time(iat), time(exp), ms_to_time(at))
            else {
                return Entry::Bad;
            };
            Entry::Consume(JournalConsume {
                record: TokenRecord {
                    id,
                    token,
                    biz_type,
                    durability: Durability::Fast,
                    subject,
                    client,
                    issued_at,
                    expires_at,
                },
                consumed_at: at,
                fingerprint: opt(fp),
                request_id: opt(rid),
            })
        }
        Ok(Packed::Result((op, id, text))) if op == "result" => match serde_json::from_str(&text) {
            Ok(result) => Entry::Result { id, result },
            Err(_) => Entry::Bad,
        },
        Ok(Packed::Release((op, id))) if op == "release" => Entry::Release { id },
        _ => Entry::Bad,
    }
}

/// The older layout: one stream field per value.
fn parse_fields(e: &StreamId) -> Entry {
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
                    durability: Durability::Fast,
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
/// the flag once there are none). A stream that lost its consumer group
/// (Redis restarted empty, a failover to a replica without it, the key
/// deleted) answers NOGROUP: the group is created again next round.
pub async fn drain_once(
    fast: &FastTier,
    pool: &PgPool,
    key: &str,
    consumer: &str,
    group_ready: &mut bool,
    last_claim: &mut tokio::time::Instant,
    own_pending: &mut bool,
) -> anyhow::Result<usize> {
    let out = drain_round(
        fast,
        pool,
        key,
        consumer,
        group_ready,
        last_claim,
        own_pending,
    )
    .await;
    if let Err(e) = &out {
        if format!("{e:#}").contains("NOGROUP") {
            *group_ready = false;
        }
    }
    out
}

async fn drain_round(
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A stream entry as XREADGROUP returns it, with the `at` the script adds.
    fn entry(fields: &[(&'static str, String)], at: i64) -> StreamId {
        let mut map: std::collections::HashMap<String, redis::Value> = fields
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    redis::Value::BulkString(v.clone().into_bytes()),
                )
            })
            .collect();
        map.insert(
            "at".into(),
            redis::Value::BulkString(at.to_string().into_bytes()),
        );
        StreamId {
            id: "1-0".into(),
            map,
            ..StreamId::default()
        }
    }

    fn record(subject: String, client: String) -> TokenRecord {
        TokenRecord {
            id: 7_000_000_000_001,
            token: "like_dev1_AAAA".into(),
            biz_type: "like".into(),
            durability: Durability::Fast,
            subject,
            client,
            issued_at: Utc.timestamp_millis_opt(1_790_000_000_123).unwrap(),
            expires_at: Utc.timestamp_millis_opt(1_790_000_060_000).unwrap(),
        }
    }

    proptest! {
        /// Any subject, client, request id and fingerprint (quotes, control
        /// characters, unicode, the old separator) comes back unchanged.
        #[test]
        fn consume_entries_round_trip(
            subject in "\\PC{1,40}|.{1,40}",
            client in ".{1,20}",
            rid in proptest::option::of(".{0,30}"),
            fp in proptest::option::of("[ -~]{0,30}"),
        ) {
            let rid = rid.filter(|s| !s.is_empty());
            let fp = fp.filter(|s| !s.is_empty());
            let rec = record(subject, client);
            let fields = consume_fields(&rec, rid.as_deref(), fp.as_deref());
            prop_assert_eq!(fields.len(), 1);
            match parse(&entry(&fields, 1_790_000_001_000)) {
                Entry::Consume(c) => {
                    prop_assert_eq!(c.record.id, rec.id);
                    prop_assert_eq!(&c.record.token, &rec.token);
                    prop_assert_eq!(&c.record.biz_type, &rec.biz_type);
                    prop_assert_eq!(&c.record.subject, &rec.subject);
                    prop_assert_eq!(&c.record.client, &rec.client);
                    prop_assert_eq!(c.record.issued_at, rec.issued_at);
                    prop_assert_eq!(c.record.expires_at, rec.expires_at);
                    prop_assert_eq!(c.consumed_at.timestamp_millis(), 1_790_000_001_000);
                    prop_assert_eq!(c.request_id, rid);
                    prop_assert_eq!(c.fingerprint, fp);
                }
                other => prop_assert!(false, "{other:?}"),
            }
        }
    }

    #[test]
    fn result_and_release_round_trip() {
        let text = r#"{"order":"o-1","note":"a \"quoted\" \u001f value"}"#;
        match parse(&entry(&result_fields(42, text), 5)) {
            Entry::Result { id, result } => {
                assert_eq!(id, 42);
                assert_eq!(result, serde_json::from_str::<Json>(text).unwrap());
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse(&entry(&release_fields(43), 5)),
            Entry::Release { id: 43 }
        ));
    }

    #[test]
    fn the_older_layout_is_still_read() {
        let fields: Vec<(&'static str, String)> = vec![
            ("op", "consume".into()),
            ("id", "9".into()),
            ("token", "like_dev1_BBBB".into()),
            ("biz", "like".into()),
            ("sub", "u-1".into()),
            ("cl", "payments".into()),
            ("iat", "1790000000000".into()),
            ("exp", "1790000060000".into()),
            ("rid", "".into()),
            ("fp", "sha256:1".into()),
        ];
        match parse(&entry(&fields, 1_790_000_000_500)) {
            Entry::Consume(c) => {
                assert_eq!((c.record.id, c.record.subject.as_str()), (9, "u-1"));
                assert_eq!(c.request_id, None);
                assert_eq!(c.fingerprint.as_deref(), Some("sha256:1"));
            }
            other => panic!("{other:?}"),
        }
        let old_release = vec![("op", "release".into()), ("id", "10".into())];
        assert!(matches!(
            parse(&entry(&old_release, 1)),
            Entry::Release { id: 10 }
        ));
    }

    #[test]
    fn junk_is_bad_never_a_panic() {
        for junk in [
            "",
            "[]",
            "[\"consume\"]",
            "[\"release\",\"x\"]",
            "[\"result\",1,\"not json\"]",
            "[\"drop\",1]",
            "{\"op\":\"consume\"}",
            "\u{0}",
        ] {
            let fields = vec![(ENTRY, junk.to_owned())];
            assert!(matches!(parse(&entry(&fields, 1)), Entry::Bad), "{junk}");
        }
    }
}
