//! The journal stream in Redis: what the scripts decided for fast biz types
//! waits there until [`crate::journal`] has written it to Postgres. Every
//! stream command is here: appends (and, on a cluster, the backlog of
//! appends that failed after their decision), the consumer group's reads,
//! claims and acknowledgements, and the dead-letter stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use redis::streams::{StreamAutoClaimReply, StreamId};
use redis::Value;

use super::{FastError, FastTier, Stamped};

/// The consumer group every instance (and reconcile) drains the stream in.
pub const GROUP: &str = "ledger";

/// Journal entries a cluster instance keeps for a later `XADD` at most.
const JOURNAL_BACKLOG_LIMIT: usize = 100_000;

/// How long a decision's answer waits for Postgres to take a journal entry
/// whose `XADD` failed, before the entry is kept in memory instead (an
/// apply that commits later anyway is harmless: entries apply once).
pub const JOURNAL_FALLBACK_TIMEOUT: Duration = Duration::from_secs(1);

/// Writes one journal entry to Postgres the way the drainer would (its
/// versioned apply); `true` once Postgres has it. Set by
/// [`crate::startup`], so that this tier stays free of SQL.
pub type JournalFallback =
    Arc<dyn Fn(JournalEntry) -> futures_util::future::BoxFuture<'static, bool> + Send + Sync>;

/// One stream entry as read back: its id and its fields, as bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JournalEntry {
    pub id: String,
    pub fields: HashMap<String, Vec<u8>>,
}

impl JournalEntry {
    /// A field as text; `None` when absent or not UTF-8.
    pub fn get(&self, field: &str) -> Option<&str> {
        self.fields
            .get(field)
            .and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// A field's value as bytes: a bulk string as it is, another value as its
/// text when it has one; `None` (the field is left out) otherwise.
fn field_bytes(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        other => redis::from_redis_value::<String>(other)
            .ok()
            .map(String::into_bytes),
    }
}

impl From<StreamId> for JournalEntry {
    fn from(e: StreamId) -> JournalEntry {
        let fields = e
            .map
            .into_iter()
            .filter_map(|(k, v)| Some((k, field_bytes(v)?)))
            .collect();
        JournalEntry { id: e.id, fields }
    }
}

/// The entries of one `XREADGROUP` reply, read straight from the reply's
/// value (RESP3: a map of stream to entries; RESP2: an array of
/// `[stream, entries]`; nil: none). Each entry is `[id, fields]` (more
/// elements, as `CLAIM` adds, are ignored); `fields` is a flat array of
/// name and value, or a map, or nil for an entry deleted while pending
/// (read as no fields). Values are read by [`field_bytes`], as
/// [`JournalEntry::from`] a `StreamId` reads them.
/// The redis crate's `StreamReadReply` clones the whole reply, then reads
/// it into three levels of hash maps.
#[derive(Debug, Default)]
struct GroupRead(Vec<JournalEntry>);

impl GroupRead {
    fn stream(&mut self, entries: Value) -> Result<(), redis::ParsingError> {
        match entries {
            Value::Array(entries) => {
                self.0.reserve(entries.len());
                for entry in entries {
                    self.0.push(read_entry(entry)?);
                }
                Ok(())
            }
            Value::Nil => Ok(()),
            other => {
                Err(format!("a stream's entries: {} instead of an array", kind(&other)).into())
            }
        }
    }
}

fn read_entry(entry: Value) -> Result<JournalEntry, redis::ParsingError> {
    let Value::Array(parts) = entry else {
        return Err(format!("a stream entry: {} instead of an array", kind(&entry)).into());
    };
    let mut parts = parts.into_iter();
    let (Some(id), Some(fields)) = (parts.next(), parts.next()) else {
        return Err("a stream entry without its id and fields".to_owned().into());
    };
    let id: String = redis::from_redis_value(id)?;
    let pairs: Vec<(Value, Value)> = match fields {
        Value::Array(flat) => {
            let mut flat = flat.into_iter();
            let mut pairs = Vec::with_capacity(flat.len() / 2);
            while let Some(name) = flat.next() {
                let Some(value) = flat.next() else {
                    return Err(format!("entry {id}: a field without its value").into());
                };
                pairs.push((name, value));
            }
            pairs
        }
        Value::Map(pairs) => pairs,
        Value::Nil => Vec::new(),
        other => {
            return Err(format!("entry {id}'s fields: {} instead of an array", kind(&other)).into())
        }
    };
    let mut out = HashMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        let name: String = redis::from_redis_value(name)?;
        // A name given twice: its last value counts, as in a map.
        match field_bytes(value) {
            Some(bytes) => out.insert(name, bytes),
            None => out.remove(&name),
        };
    }
    Ok(JournalEntry { id, fields: out })
}

/// What a value that was not expected is, for an error message: never the
/// value itself, which may hold token texts.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Int(_) => "an integer",
        Value::BulkString(_) => "a bulk string",
        Value::Array(_) => "an array",
        Value::SimpleString(_) => "a simple string",
        Value::Okay => "OK",
        Value::Map(_) => "a map",
        Value::Set(_) => "a set",
        Value::Double(_) => "a double",
        Value::Boolean(_) => "a boolean",
        Value::ServerError(_) => "an error",
        _ => "another type",
    }
}

impl redis::FromRedisValue for GroupRead {
    fn from_redis_value(v: Value) -> Result<Self, redis::ParsingError> {
        let mut read = GroupRead::default();
        match v {
            Value::Nil => {}
            Value::Map(streams) => {
                for (_, entries) in streams {
                    read.stream(entries)?;
                }
            }
            Value::Array(streams) => {
                for stream in streams {
                    match stream {
                        Value::Array(pair) if pair.len() == 2 => {
                            if let Some(entries) = pair.into_iter().nth(1) {
                                read.stream(entries)?;
                            }
                        }
                        other => {
                            return Err(format!(
                                "a stream of the reply: {} instead of [name, entries]",
                                kind(&other)
                            )
                            .into())
                        }
                    }
                }
            }
            other => return Err(format!("a group read: {} instead of a map", kind(&other)).into()),
        }
        Ok(read)
    }
}

/// Which entries a group read asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    /// Entries this consumer read before and has not acknowledged.
    OwnPending,
    /// Entries no consumer of the group has read yet.
    New,
}

impl FastError {
    /// The stream lost its consumer group (Redis restarted empty, a failover
    /// to a replica without it, the key deleted): create it again.
    pub fn is_no_group(&self) -> bool {
        matches!(self, FastError::Redis(e) if e.to_string().contains("NOGROUP"))
    }
}

impl FastTier {
    pub fn journal_key(&self) -> &str {
        &self.journal_key
    }

    /// Whether scripts may append to the journal stream in the same call.
    /// On a cluster the stream lives in another slot, so the journal entry is
    /// written by a second command instead.
    pub fn journal_in_script(&self) -> bool {
        !self.cluster
    }

    /// Appends one entry to the journal stream (cluster mode, or repairs).
    pub async fn append_journal(&self, entry: &Stamped) -> Result<(), FastError> {
        let key = self.journal_key();
        let fields = &entry.fields();
        self.call_background("journal", |mut c| async move {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(key).arg("*");
            for (k, v) in fields {
                cmd.arg(*k).arg(v.as_str());
            }
            cmd.query_async::<String>(&mut c).await.map(|_| ())
        })
        .await
    }

    /// Where a cluster decision's journal entry goes when its `XADD` fails
    /// (once, at start).
    pub fn set_journal_fallback(&self, fallback: JournalFallback) {
        let _ = self.journal_fallback.set(fallback);
    }

    /// Cluster: appends the journal entry of a decision the script already
    /// made. A failure must not turn that decision into an error for its
    /// caller (the token is consumed or released in Redis whatever we
    /// answer), so the entry goes to Postgres directly, before the answer
    /// (the drainer's apply: the same entry arriving twice changes nothing).
    /// Only when Postgres does not take it within
    /// [`JOURNAL_FALLBACK_TIMEOUT`] does it wait in this process's backlog
    /// (`ledger_journal_append_fallback_total{to="memory"}`), lost if the
    /// process dies before Redis or Postgres answers.
    pub(super) async fn append_or_queue(&self, entry: Stamped) {
        let Err(e) = self.append_journal(&entry).await else {
            return;
        };
        if let Some(apply) = self.journal_fallback.get() {
            let direct = entry.entry("direct".to_owned());
            let applied = tokio::time::timeout(JOURNAL_FALLBACK_TIMEOUT, apply(direct))
                .await
                .unwrap_or(false);
            if applied {
                tracing::debug!(error = %e, "journal XADD failed; the entry went to postgres directly");
                self.count_fallback("postgres");
                return;
            }
        }
        let mut q = self
            .journal_backlog
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if q.len() < JOURNAL_BACKLOG_LIMIT {
            tracing::warn!(error = %e, "journal entry reached neither redis nor postgres; kept in memory for a later XADD");
            q.push_back(entry);
            self.count_fallback("memory");
        } else {
            tracing::error!(error = %e, "journal backlog full: a fast-type decision will not reach postgres");
            self.count_fallback("dropped");
        }
    }

    fn count_fallback(&self, to: &str) {
        self.metrics
            .journal_append_fallback
            .with_label_values(&[to])
            .inc();
    }

    /// Journal entries waiting in this process for their `XADD` (cluster).
    pub fn journal_backlog_len(&self) -> usize {
        self.journal_backlog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Appends the queued journal entries, oldest first; returns how many
    /// are left (0 on a standalone Redis, whose scripts append in place).
    pub async fn flush_journal_backlog(&self) -> usize {
        loop {
            let next = self
                .journal_backlog
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            let Some(entry) = next else { return 0 };
            if self.append_journal(&entry).await.is_err() {
                let mut q = self
                    .journal_backlog
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                q.push_front(entry);
                return q.len();
            }
        }
    }

    /// The dead-letter stream: journal entries that can never apply.
    pub fn journal_dead_key(&self) -> String {
        format!("{}journal:dead", self.settings.key_prefix)
    }

    /// Sets a journal entry that can never apply aside in the dead-letter
    /// stream, with its stream id (`src`) and why (`reason`), and counts it.
    /// The stream keeps the newest 100,000 (approximately).
    pub async fn dead_letter(&self, entry: &JournalEntry, reason: &str) -> Result<(), FastError> {
        let key = &self.journal_dead_key();
        let mut cmd = redis::cmd("XADD");
        cmd.arg(key)
            .arg("MAXLEN")
            .arg("~")
            .arg(100_000)
            .arg("*")
            .arg("src")
            .arg(&entry.id)
            .arg("reason")
            .arg(reason);
        let mut fields: Vec<(&String, &Vec<u8>)> = entry.fields.iter().collect();
        fields.sort_by(|a, b| a.0.cmp(b.0));
        for (k, v) in fields {
            cmd.arg(k).arg(v.as_slice());
        }
        let cmd = &cmd;
        self.call_background("dead_letter", |mut c| async move {
            cmd.query_async::<Value>(&mut c).await.map(|_| ())
        })
        .await?;
        self.metrics.journal_dead_letters.inc();
        Ok(())
    }

    /// Entries in the dead-letter stream.
    pub async fn dead_letters(&self) -> Result<u64, FastError> {
        let key = &self.journal_dead_key();
        self.call_background("xlen", |mut c| async move {
            redis::cmd("XLEN").arg(key).query_async::<u64>(&mut c).await
        })
        .await
    }

    /// Entries in the journal stream (not yet drained into Postgres, or
    /// drained but not yet deleted).
    pub async fn journal_len(&self) -> Result<u64, FastError> {
        let key = self.journal_key();
        self.call_background("xlen", |mut c| async move {
            redis::cmd("XLEN").arg(key).query_async::<u64>(&mut c).await
        })
        .await
    }

    /// Creates the consumer group (and the stream) unless it exists.
    pub async fn journal_group_create(&self) -> Result<(), FastError> {
        let key = self.journal_key();
        let created = self
            .call_background("xgroup", |mut c| async move {
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
            Err(FastError::Redis(e)) if e.to_string().contains("BUSYGROUP") => Ok(()),
            other => other,
        }
    }

    /// Takes over up to `count` entries that other consumers of the group
    /// read but left unacknowledged for `idle_ms` or more (a dead instance).
    pub async fn journal_claim_idle(
        &self,
        consumer: &str,
        idle_ms: u64,
        count: usize,
    ) -> Result<Vec<JournalEntry>, FastError> {
        let key = self.journal_key();
        let claimed: StreamAutoClaimReply = self
            .call_background("xautoclaim", |mut c| async move {
                redis::cmd("XAUTOCLAIM")
                    .arg(key)
                    .arg(GROUP)
                    .arg(consumer)
                    .arg(idle_ms)
                    .arg("0-0")
                    .arg("COUNT")
                    .arg(count)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(claimed
            .claimed
            .into_iter()
            .map(JournalEntry::from)
            .collect())
    }

    /// Up to `count` entries for `consumer`, oldest first.
    pub async fn journal_read(
        &self,
        consumer: &str,
        from: ReadFrom,
        count: usize,
    ) -> Result<Vec<JournalEntry>, FastError> {
        let key = self.journal_key();
        let start = match from {
            ReadFrom::OwnPending => "0",
            ReadFrom::New => ">",
        };
        let read: GroupRead = self
            .call_background("xreadgroup", |mut c| async move {
                redis::cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(GROUP)
                    .arg(consumer)
                    .arg("COUNT")
                    .arg(count)
                    .arg("STREAMS")
                    .arg(key)
                    .arg(start)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(read.0)
    }

    /// Acknowledges and deletes entries Postgres now has (or that were set
    /// aside).
    pub async fn journal_ack(&self, ids: &[String]) -> Result<(), FastError> {
        let key = self.journal_key();
        self.call_background("xack", |mut c| async move {
            let mut p = redis::pipe();
            p.cmd("XACK").arg(key).arg(GROUP).arg(ids).ignore();
            p.cmd("XDEL").arg(key).arg(ids).ignore();
            p.query_async::<()>(&mut c).await
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use redis::streams::StreamReadReply;
    use redis::FromRedisValue;

    use super::*;

    fn name() -> impl Strategy<Value = Value> {
        prop_oneof![
            prop::sample::select(vec!["op", "rec", "gen", "at"])
                .prop_map(|n| Value::BulkString(n.as_bytes().to_vec())),
            Just(Value::SimpleString("gen".to_owned())),
        ]
    }

    fn field_value() -> impl Strategy<Value = Value> {
        prop_oneof![
            4 => prop::collection::vec(any::<u8>(), 0..12).prop_map(Value::BulkString),
            1 => "[a-z0-9]{0,6}".prop_map(Value::SimpleString),
            1 => any::<i64>().prop_map(Value::Int),
            1 => Just(Value::Nil),
            1 => Just(Value::Array(vec![Value::Int(1)])),
        ]
    }

    fn fields() -> impl Strategy<Value = Value> {
        prop_oneof![
            4 => prop::collection::vec((name(), field_value()), 0..6).prop_map(|pairs| {
                Value::Array(pairs.into_iter().flat_map(|(n, v)| [n, v]).collect())
            }),
            2 => prop::collection::vec((name(), field_value()), 0..6).prop_map(Value::Map),
            1 => Just(Value::Nil),
        ]
    }

    fn entries() -> impl Strategy<Value = Value> {
        prop::collection::vec(("[0-9]{1,4}-[0-9]", fields()), 0..5).prop_map(|es| {
            Value::Array(
                es.into_iter()
                    .map(|(id, f)| Value::Array(vec![Value::BulkString(id.into_bytes()), f]))
                    .collect(),
            )
        })
    }

    /// Replies of a group read of one stream, in RESP3 and RESP2 shapes.
    fn reply() -> impl Strategy<Value = Value> {
        let key = || Value::BulkString(b"ledger:journal".to_vec());
        prop_oneof![
            1 => Just(Value::Nil),
            3 => entries().prop_map(move |e| Value::Map(vec![(key(), e)])),
            3 => entries().prop_map(move |e| Value::Array(vec![Value::Array(vec![key(), e])])),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]
        #[test]
        fn a_group_read_reads_what_the_crate_s_stream_reply_reads(v in reply()) {
            let ours = GroupRead::from_redis_value(v.clone());
            prop_assert!(ours.is_ok(), "{v:?}: {ours:?}");
            let ours = ours.map(|r| r.0).unwrap_or_default();
            if let Ok(theirs) = StreamReadReply::from_redis_value(v.clone()) {
                let theirs: Vec<JournalEntry> = theirs
                    .keys
                    .into_iter()
                    .flat_map(|k| k.ids)
                    .map(JournalEntry::from)
                    .collect();
                prop_assert_eq!(ours, theirs, "{:?}", v);
            }
        }
    }

    #[test]
    fn a_group_read_refuses_what_is_not_a_reply() {
        for v in [
            Value::Int(3),
            Value::Array(vec![Value::Int(3)]),
            Value::Map(vec![(Value::Nil, Value::Int(1))]),
            Value::Array(vec![Value::Array(vec![
                Value::BulkString(b"k".to_vec()),
                Value::Array(vec![Value::Array(vec![Value::BulkString(b"1-0".to_vec())])]),
            ])]),
            Value::Map(vec![(
                Value::Nil,
                Value::Array(vec![Value::Array(vec![
                    Value::BulkString(b"1-0".to_vec()),
                    Value::Array(vec![Value::BulkString(b"op".to_vec())]),
                ])]),
            )]),
        ] {
            assert!(GroupRead::from_redis_value(v.clone()).is_err(), "{v:?}");
        }
    }
}
