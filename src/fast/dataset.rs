//! The Redis dataset the fleet agreed on: an id the fleet records in
//! Postgres and writes into Redis (`<prefix>dataset`), so that a Redis that
//! restarted empty (or any other Redis behind the same address) is told
//! apart from the one whose journal the fleet drained. The consume script
//! checks it before a fast decision; [`FastTier::journal_state`] reads it with
//! the journal's oldest and newest entry ids. The protocol is [`crate::fleet`]'s.

use redis::streams::StreamRangeReply;
use uuid::Uuid;

use super::{FastError, FastTier};

/// The journal stream as seen in one atomic read with the dataset key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JournalState {
    /// Redis holds the dataset asked about; its journal's oldest and newest
    /// entries.
    Agreed { span: Span },
    /// Redis holds another dataset, or none (it restarted empty, was
    /// flushed, or is another server): its journal says nothing about the
    /// decisions made on the agreed one.
    Foreign,
    /// Not checked: no dataset agreed yet, or a cluster (the dataset key and
    /// the journal stream live in different slots, and scripts touch only
    /// their token's). The journal's oldest and newest entries alone.
    Unchecked { span: Span },
}

/// The ids of the journal's oldest and newest entries (`None`: empty). An
/// entry leaves the stream only once Postgres has it, so every entry at or
/// below an id once seen as `last` is in Postgres when a later read finds
/// `first` above it, or the stream empty: the journal was drained past that
/// read, though it may never be seen empty under steady traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    pub first: Option<EntryId>,
    pub last: Option<EntryId>,
}

impl Span {
    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn of(first: &StreamRangeReply, last: &StreamRangeReply) -> Span {
        let id = |r: &StreamRangeReply| r.ids.first().and_then(|e| EntryId::parse(&e.id));
        Span {
            first: id(first),
            last: id(last),
        }
    }
}

/// A stream entry id, `<ms>-<seq>`, ordered as Redis orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EntryId {
    ms: u64,
    seq: u64,
}

impl EntryId {
    pub fn parse(s: &str) -> Option<EntryId> {
        let (ms, seq) = s.split_once('-')?;
        Some(EntryId {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }
}

impl FastTier {
    pub fn dataset_key(&self) -> &str {
        &self.dataset_key
    }

    /// Whether scripts and journal reads check the dataset: on a standalone
    /// Redis. On a cluster every script touches only its token's slot.
    pub fn checks_dataset(&self) -> bool {
        !self.cluster
    }

    /// Writes the fleet's dataset id into Redis (the first member, and the
    /// member that ends an episode, inside the Postgres transaction that
    /// records it).
    pub async fn write_dataset(&self, dataset: Uuid) -> Result<(), FastError> {
        let key = self.dataset_key();
        let id = dataset.to_string();
        let id = id.as_str();
        self.call_background("dataset", |mut c| async move {
            redis::cmd("SET")
                .arg(key)
                .arg(id)
                .query_async::<()>(&mut c)
                .await
        })
        .await
    }

    /// The journal's oldest and newest entries, with whether Redis holds
    /// `agreed` (read in one `MULTI`, so that a restart cannot fall between
    /// them).
    pub async fn journal_state(&self, agreed: Option<Uuid>) -> Result<JournalState, FastError> {
        let (dataset_key, journal_key) = (self.dataset_key(), self.journal_key());
        let (Some(agreed), true) = (agreed, self.checks_dataset()) else {
            let (first, last): (StreamRangeReply, StreamRangeReply) = self
                .call_background("xrange", |mut c| async move {
                    span_commands(&mut redis::pipe(), journal_key)
                        .query_async(&mut c)
                        .await
                })
                .await?;
            return Ok(JournalState::Unchecked {
                span: Span::of(&first, &last),
            });
        };
        let (held, first, last): (Option<String>, StreamRangeReply, StreamRangeReply) = self
            .call_background("xrange", |mut c| async move {
                let mut p = redis::pipe();
                p.atomic().cmd("GET").arg(dataset_key);
                span_commands(&mut p, journal_key).query_async(&mut c).await
            })
            .await?;
        Ok(match held {
            Some(id) if id == agreed.to_string() => JournalState::Agreed {
                span: Span::of(&first, &last),
            },
            _ => JournalState::Foreign,
        })
    }
}

/// The journal's oldest and newest entries, appended to `p`.
fn span_commands<'p>(p: &'p mut redis::Pipeline, journal_key: &str) -> &'p mut redis::Pipeline {
    p.cmd("XRANGE")
        .arg(journal_key)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .cmd("XREVRANGE")
        .arg(journal_key)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_ids_order_as_redis_orders_them() {
        let id = |s| EntryId::parse(s).expect(s);
        assert!(id("1700000000000-0") < id("1700000000000-1"));
        assert!(id("1700000000000-10") > id("1700000000000-9"));
        assert!(id("999-5") < id("1000-0"));
        for bad in [
            "",
            "1",
            "a-1",
            "1-",
            "-1",
            "1-2-3",
            "18446744073709551616-0",
        ] {
            assert_eq!(EntryId::parse(bad), None, "{bad:?}");
        }
    }
}
