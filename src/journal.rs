//! The fast-type journal: what Redis decided for fast biz types (consume,
//! result, release) reaches Postgres through a Redis stream read by a consumer
//! group. An entry is acknowledged only after Postgres has it: after a failed
//! round (Postgres down) this consumer re-reads its own pending entries first;
//! entries left pending by a dead instance are claimed after 30 s.
//!
//! An entry carries the state and generation its script decided (see
//! [`crate::durable::journal`]): applying it only moves a token forward, so
//! entries of one token may be applied in any order, by any consumer, and
//! more than once. Entries written before generations (no `g` field, or no
//! token record) keep their old meaning, applied in stream order.
//! An entry that can never apply (unreadable, or a value Postgres refuses) is
//! set aside in the dead-letter stream `<prefix>journal:dead` with its reason,
//! counted in `ledger_journal_dead_letters_total` and acknowledged: it never
//! stops the entries behind it.

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use serde_json::Value as Json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::config::Durability;
use crate::durable::journal::{self as versioned, Decided, EntryKind, Versioned};
use crate::durable::tokens::{self, JournalConsume, TokenRecord};
use crate::durable::DurableError;
use crate::fast::FastTier;

pub const GROUP: &str = "ledger";
const BATCH: usize = 500;
const CLAIM_IDLE_MS: u64 = 30_000;

/// The field that holds what the ledger knows of an entry: one JSON array
/// (`["consume", id, token, biz, subject, client, issued_at_ms,
/// expires_at_ms, request_id, fingerprint]`, `["result", id,
/// result_json_text, token, biz, subject, client, issued_at_ms,
/// expires_at_ms]`, `["release", id, token, biz, subject, client,
/// issued_at_ms, expires_at_ms]`). The script that decided adds what only it
/// knows as fields of their own: `at` (when, ms), `g` (the generation it
/// decided), and for a result the consumed state it belongs to (`cat`
/// consumed at, `rid`, `fp`). One field for the ledger's part keeps both the
/// script's `XADD` and the drainer's parsing of the stream reply cheap.
///
/// Older layouts are still read: `["result", id, result_json_text]` and
/// `["release", id]` (no token record), entries without `g`, and one stream
/// field per value (`op`, `id`, ...; written before 0.1).
pub const ENTRY: &str = "e";

/// The fields a script adds to an entry.
pub const AT: &str = "at";
pub const GEN: &str = "g";
pub const CONSUMED_AT: &str = "cat";
pub const REQUEST_ID: &str = "rid";
pub const FINGERPRINT: &str = "fp";

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

/// The journal fields of a fast-type result, in the layout without a token
/// record (see [`result_fields_for`]).
pub fn result_fields(id: i64, result: &str) -> Vec<(&'static str, String)> {
    // `result` is the JSON text as stored, carried as a string.
    vec![(ENTRY, pack(&("result", id, result)))]
}

/// The journal fields of a fast-type release, in the layout without a token
/// record (see [`release_fields_for`]).
pub fn release_fields(id: i64) -> Vec<(&'static str, String)> {
    vec![(ENTRY, pack(&("release", id)))]
}

/// The journal fields of a fast-type result, with the token record (so that
/// it applies even before its consume entry has).
pub fn result_fields_for(rec: &TokenRecord, result: &str) -> Vec<(&'static str, String)> {
    let entry = (
        "result",
        rec.id,
        result,
        &rec.token,
        &rec.biz_type,
        &rec.subject,
        &rec.client,
        rec.issued_at.timestamp_millis(),
        rec.expires_at.timestamp_millis(),
    );
    vec![(ENTRY, pack(&entry))]
}

/// The journal fields of a fast-type release, with the token record.
pub fn release_fields_for(rec: &TokenRecord) -> Vec<(&'static str, String)> {
    let entry = (
        "release",
        rec.id,
        &rec.token,
        &rec.biz_type,
        &rec.subject,
        &rec.client,
        rec.issued_at.timestamp_millis(),
        rec.expires_at.timestamp_millis(),
    );
    vec![(ENTRY, pack(&entry))]
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
    ResultFor(
        (
            String,
            i64,
            String,
            String,
            String,
            String,
            String,
            i64,
            i64,
        ),
    ),
    ReleaseFor((String, i64, String, String, String, String, i64, i64)),
    Result((String, i64, String)),
    Release((String, i64)),
}

#[derive(Debug)]
enum Entry {
    /// A state and generation: applied by [`versioned::apply`].
    Versioned(versioned::Entry),
    /// Written without a generation: consume over issued.
    Consume(JournalConsume),
    /// Written without a token record: a result over consumed-without-result.
    Result { id: i64, result: Json },
    /// Written without a token record: consumed-without-result to issued.
    Release { id: i64 },
    /// Can never apply: set aside with this reason.
    Bad(&'static str),
}

fn field(e: &StreamId, k: &str) -> String {
    e.get::<String>(k).unwrap_or_default()
}

fn ms_to_time(ms: &str) -> Option<chrono::DateTime<Utc>> {
    ms.parse::<i64>()
        .ok()
        .and_then(|m| Utc.timestamp_millis_opt(m).single())
}

fn opt(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn parse(e: &StreamId) -> Entry {
    match e.get::<String>(ENTRY) {
        Some(packed) => parse_packed(e, &packed),
        None => parse_fields(e),
    }
}

/// The generation a script added, checked against what the entry says:
/// odd for a consumed state, even (and past the issued one) for a release.
fn gen_of(e: &StreamId, consumed: bool) -> Result<Option<i64>, &'static str> {
    let Some(text) = e.get::<String>(GEN) else {
        return Ok(None);
    };
    let gen: i64 = text.parse().map_err(|_| "generation is not a number")?;
    match (consumed, gen % 2 == 1) {
        (true, true) if gen >= 1 => Ok(Some(gen)),
        (false, false) if gen >= 2 => Ok(Some(gen)),
        _ => Err("generation does not match the state"),
    }
}

#[allow(clippy::too_many_arguments)]
fn record(
    id: i64,
    token: String,
    biz_type: String,
    subject: String,
    client: String,
    iat: i64,
    exp: i64,
) -> Option<TokenRecord> {
    let time = |ms: i64| Utc.timestamp_millis_opt(ms).single();
    Some(TokenRecord {
        id,
        token,
        biz_type,
        durability: Durability::Fast,
        subject,
        client,
        issued_at: time(iat)?,
        expires_at: time(exp)?,
    })
}

fn parse_packed(e: &StreamId, packed: &str) -> Entry {
    let at = ms_to_time(&field(e, AT));
    match serde_json::from_str::<Packed>(packed) {
        Ok(Packed::Consume((op, id, token, biz, subject, client, iat, exp, rid, fp)))
            if op == "consume" =>
        {
            let (Some(record), Some(at)) = (record(id, token, biz, subject, client, iat, exp), at)
            else {
                return Entry::Bad("unreadable time");
            };
            let (fingerprint, request_id) = (opt(fp), opt(rid));
            match gen_of(e, true) {
                Ok(Some(gen)) => Entry::Versioned(versioned::Entry {
                    record,
                    kind: EntryKind::Consume,
                    at,
                    version: Versioned {
                        gen,
                        state: Decided::Consumed {
                            consumed_at: at,
                            fingerprint,
                            request_id,
                            result: None,
                        },
                    },
                }),
                Ok(None) => Entry::Consume(JournalConsume {
                    record,
                    consumed_at: at,
                    fingerprint,
                    request_id,
                }),
                Err(why) => Entry::Bad(why),
            }
        }
        Ok(Packed::ResultFor((op, id, text, token, biz, subject, client, iat, exp)))
            if op == "result" =>
        {
            let Ok(result) = serde_json::from_str::<Json>(&text) else {
                return Entry::Bad("result is not JSON");
            };
            let (Some(record), Some(at)) = (record(id, token, biz, subject, client, iat, exp), at)
            else {
                return Entry::Bad("unreadable time");
            };
            match gen_of(e, true) {
                Ok(Some(gen)) => {
                    let Some(consumed_at) = ms_to_time(&field(e, CONSUMED_AT)) else {
                        return Entry::Bad("result without its consume time");
                    };
                    Entry::Versioned(versioned::Entry {
                        record,
                        kind: EntryKind::Result,
                        at,
                        version: Versioned {
                            gen,
                            state: Decided::Consumed {
                                consumed_at,
                                fingerprint: opt(field(e, FINGERPRINT)),
                                request_id: opt(field(e, REQUEST_ID)),
                                result: Some((result, at)),
                            },
                        },
                    })
                }
                Ok(None) => Entry::Result { id, result },
                Err(why) => Entry::Bad(why),
            }
        }
        Ok(Packed::ReleaseFor((op, id, token, biz, subject, client, iat, exp)))
            if op == "release" =>
        {
            let (Some(record), Some(at)) = (record(id, token, biz, subject, client, iat, exp), at)
            else {
                return Entry::Bad("unreadable time");
            };
            match gen_of(e, false) {
                Ok(Some(gen)) => Entry::Versioned(versioned::Entry {
                    record,
                    kind: EntryKind::Release,
                    at,
                    version: Versioned {
                        gen,
                        state: Decided::Issued,
                    },
                }),
                Ok(None) => Entry::Release { id },
                Err(why) => Entry::Bad(why),
            }
        }
        Ok(Packed::Result((op, id, text))) if op == "result" => match serde_json::from_str(&text) {
            Ok(result) => Entry::Result { id, result },
            Err(_) => Entry::Bad("result is not JSON"),
        },
        Ok(Packed::Release((op, id))) if op == "release" => Entry::Release { id },
        _ => Entry::Bad("unreadable entry"),
    }
}

/// The older layout: one stream field per value.
fn parse_fields(e: &StreamId) -> Entry {
    let id: Option<i64> = field(e, "id").parse().ok();
    match (field(e, "op").as_str(), id) {
        ("consume", Some(id)) => {
            let (Some(iat), Some(exp), Some(at)) = (
                ms_to_time(&field(e, "iat")),
                ms_to_time(&field(e, "exp")),
                ms_to_time(&field(e, AT)),
            ) else {
                return Entry::Bad("unreadable time");
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
            Err(_) => Entry::Bad("result is not JSON"),
        },
        ("release", Some(id)) => Entry::Release { id },
        _ => Entry::Bad("unreadable entry"),
    }
}

/// Whether a statement failed because of what the entries hold (SQLSTATE
/// class 22, data exception: a string Postgres cannot store; class 23, a
/// constraint the row would break): retrying cannot help. Anything else
/// (Postgres down, a timeout) is retried in a later round.
fn refused_for_its_data(e: &DurableError) -> bool {
    match e {
        DurableError::Other(sqlx::Error::Database(db)) => {
            let code = db.code().unwrap_or_default();
            code.starts_with("22") || code.starts_with("23")
        }
        _ => false,
    }
}

/// Entries of one round that can never apply: their index and why.
type DeadLetters = Vec<(usize, String)>;

/// Applies a batch through `apply_all`; when Postgres refuses the batch for
/// what it holds, applies its entries one at a time, and the ones refused
/// alone become dead letters.
async fn apply_or_isolate<T, F, Fut>(
    items: &[(usize, T)],
    dead: &mut DeadLetters,
    apply_all: F,
) -> Result<(), DurableError>
where
    T: Clone,
    F: Fn(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = Result<(), DurableError>>,
{
    if items.is_empty() {
        return Ok(());
    }
    let all: Vec<T> = items.iter().map(|(_, t)| t.clone()).collect();
    match apply_all(all).await {
        Ok(()) => return Ok(()),
        Err(e) if refused_for_its_data(&e) => {}
        Err(e) => return Err(e),
    }
    for (i, item) in items {
        match apply_all(vec![item.clone()]).await {
            Ok(()) => {}
            Err(e) if refused_for_its_data(&e) => {
                dead.push((*i, crate::reconcile::error_chain(&e)));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Applies one round's entries; returns the ones set aside. In stream
/// order, in runs: consecutive versioned entries in one statement,
/// consecutive consumes written without a generation in another, and each
/// other entry written without a generation alone (those keep their old
/// meaning, which depends on the order).
async fn apply(pool: &PgPool, entries: &[StreamId]) -> Result<DeadLetters, DurableError> {
    let mut dead = DeadLetters::new();
    let mut current: Vec<(usize, versioned::Entry)> = Vec::new();
    let mut run: Vec<(usize, JournalConsume)> = Vec::new();
    let consumes = |batch: Vec<JournalConsume>| async move {
        tokens::apply_journal_consumes(pool, &batch)
            .await
            .map(|_| ())
    };
    let versioned = |batch: Vec<versioned::Entry>| async move {
        versioned::apply(pool, &batch).await.map(|_| ())
    };
    for (i, e) in entries.iter().enumerate() {
        let entry = parse(e);
        if !matches!(entry, Entry::Versioned(_) | Entry::Bad(_)) {
            apply_or_isolate(&current, &mut dead, versioned).await?;
            current.clear();
        }
        if !matches!(entry, Entry::Consume(_) | Entry::Bad(_)) {
            apply_or_isolate(&run, &mut dead, consumes).await?;
            run.clear();
        }
        match entry {
            Entry::Versioned(v) => current.push((i, v)),
            Entry::Consume(c) => run.push((i, c)),
            Entry::Bad(why) => {
                tracing::error!(entry = %e.id, reason = why, "unreadable journal entry set aside");
                dead.push((i, why.to_owned()));
            }
            Entry::Result { id, result } => {
                apply_or_isolate(&[(i, ())], &mut dead, |_| async {
                    tokens::set_result(pool, id, &result).await.map(|_| ())
                })
                .await?;
            }
            Entry::Release { id } => {
                apply_or_isolate(&[(i, ())], &mut dead, |_| async move {
                    tokens::release(pool, id).await.map(|_| ())
                })
                .await?;
            }
        }
    }
    apply_or_isolate(&run, &mut dead, consumes).await?;
    apply_or_isolate(&current, &mut dead, versioned).await?;
    Ok(dead)
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
    let dead = apply(pool, &entries).await?;
    for (i, reason) in &dead {
        if let Some(e) = entries.get(*i) {
            tracing::error!(entry = %e.id, reason = %reason, "journal entry can never apply: set aside");
            fast.dead_letter(e, reason).await?;
        }
    }
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

    /// A stream entry as XREADGROUP returns it, with the fields a script adds.
    fn entry_with(fields: &[(&'static str, String)], added: &[(&str, String)]) -> StreamId {
        let map: std::collections::HashMap<String, redis::Value> = fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_str()))
            .chain(added.iter().map(|(k, v)| (k.to_string(), v.as_str())))
            .map(|(k, v)| (k, redis::Value::BulkString(v.as_bytes().to_vec())))
            .collect();
        StreamId {
            id: "1-0".into(),
            map,
            ..StreamId::default()
        }
    }

    /// With only the `at` a script adds (the layout without generations).
    fn entry(fields: &[(&'static str, String)], at: i64) -> StreamId {
        entry_with(fields, &[(AT, at.to_string())])
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
        /// characters, unicode, the old separator) comes back unchanged, with
        /// the generation the script added.
        #[test]
        fn consume_entries_round_trip(
            subject in "\\PC{1,40}|.{1,40}",
            client in ".{1,20}",
            rid in proptest::option::of(".{0,30}"),
            fp in proptest::option::of("[ -~]{0,30}"),
            half_gen in 0i64..1_000_000,
        ) {
            let rid = rid.filter(|s| !s.is_empty());
            let fp = fp.filter(|s| !s.is_empty());
            let rec = record(subject, client);
            let gen = 2 * half_gen + 1;
            let fields = consume_fields(&rec, rid.as_deref(), fp.as_deref());
            prop_assert_eq!(fields.len(), 1);
            let e = entry_with(&fields, &[(AT, "1790000001000".into()), (GEN, gen.to_string())]);
            match parse(&e) {
                Entry::Versioned(v) => {
                    prop_assert_eq!(&v.record, &rec);
                    prop_assert_eq!(v.kind, EntryKind::Consume);
                    prop_assert_eq!(v.at.timestamp_millis(), 1_790_000_001_000);
                    prop_assert_eq!(v.version, Versioned {
                        gen,
                        state: Decided::Consumed {
                            consumed_at: v.at,
                            fingerprint: fp,
                            request_id: rid,
                            result: None,
                        },
                    });
                }
                other => prop_assert!(false, "{other:?}"),
            }
        }

        /// Without `g` (written by an instance older than generations) a
        /// consume keeps its old meaning.
        #[test]
        fn consume_entries_without_a_generation_round_trip(
            subject in "\\PC{1,40}",
            rid in proptest::option::of("[ -~]{1,30}"),
        ) {
            let rec = record(subject, "payments".into());
            let fields = consume_fields(&rec, rid.as_deref(), None);
            match parse(&entry(&fields, 1_790_000_001_000)) {
                Entry::Consume(c) => {
                    prop_assert_eq!(&c.record, &rec);
                    prop_assert_eq!(c.consumed_at.timestamp_millis(), 1_790_000_001_000);
                    prop_assert_eq!(c.request_id, rid);
                    prop_assert_eq!(c.fingerprint, None);
                }
                other => prop_assert!(false, "{other:?}"),
            }
        }
    }

    #[test]
    fn result_and_release_round_trip() {
        let rec = record("u-1".into(), "payments".into());
        let text = r#"{"order":"o-1","note":"a \"quoted\" \u001f value"}"#;
        let added = [
            (AT, "1790000002000".to_owned()),
            (GEN, "3".to_owned()),
            (CONSUMED_AT, "1790000001000".to_owned()),
            (REQUEST_ID, "r-1".to_owned()),
            (FINGERPRINT, "".to_owned()),
        ];
        match parse(&entry_with(&result_fields_for(&rec, text), &added)) {
            Entry::Versioned(v) => {
                assert_eq!(
                    (v.kind, v.version.gen, &v.record),
                    (EntryKind::Result, 3, &rec)
                );
                let Decided::Consumed {
                    consumed_at,
                    fingerprint,
                    request_id,
                    result: Some((result, at)),
                } = v.version.state
                else {
                    panic!("{:?}", v.version);
                };
                assert_eq!(consumed_at.timestamp_millis(), 1_790_000_001_000);
                assert_eq!(at.timestamp_millis(), 1_790_000_002_000);
                assert_eq!((fingerprint, request_id.as_deref()), (None, Some("r-1")));
                assert_eq!(result, serde_json::from_str::<Json>(text).unwrap());
            }
            other => panic!("{other:?}"),
        }
        let added = [(AT, "1790000003000".to_owned()), (GEN, "4".to_owned())];
        match parse(&entry_with(&release_fields_for(&rec), &added)) {
            Entry::Versioned(v) => {
                assert_eq!(v.kind, EntryKind::Release);
                assert_eq!(
                    v.version,
                    Versioned {
                        gen: 4,
                        state: Decided::Issued
                    }
                );
            }
            other => panic!("{other:?}"),
        }
        // A generation that contradicts the state can never apply.
        let odd = [(AT, "1790000003000".to_owned()), (GEN, "5".to_owned())];
        assert!(matches!(
            parse(&entry_with(&release_fields_for(&rec), &odd)),
            Entry::Bad(_)
        ));
    }

    #[test]
    fn the_layouts_without_generations_are_still_read() {
        let text = r#"{"order":"o-1"}"#;
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
            assert!(matches!(parse(&entry(&fields, 1)), Entry::Bad(_)), "{junk}");
        }
        let rec = record("u".into(), "c".into());
        for gen in ["x", "-1", "0", "2"] {
            let e = entry_with(
                &consume_fields(&rec, None, None),
                &[(AT, "1".into()), (GEN, gen.into())],
            );
            assert!(matches!(parse(&e), Entry::Bad(_)), "gen {gen}");
        }
    }
}
