//! A journal entry's layout in the stream (the stream is this tier's, see
//! `journal.rs`): its field names, its [`Op`], and [`Record`] and
//! [`Stamped`], which are encoded into stream fields here and nowhere else.
//! The ledger's part of an entry (one packed JSON array, see [`ENTRY`]) is
//! built above this tier (`crate::journal::entry`, which also parses entries
//! back with these names) and carried here as it is.

use super::JournalEntry;

/// The field that holds what the ledger knows of an entry: one JSON array
/// (`["consume", id, token, biz, subject, client, issued_at_ms,
/// expires_at_ms, request_id, fingerprint]`, `["result", id,
/// result_json_text, token, biz, subject, client, issued_at_ms,
/// expires_at_ms]`, `["release", id, token, biz, subject, client,
/// issued_at_ms, expires_at_ms]`; the first element is the [`Op`]). The
/// script that decided adds what only it knows as fields of their own: `at`
/// (when, ms), `g` (the generation it decided), and for a result the consumed
/// state it belongs to (`cat` consumed at, `rid`, `fp`). One field for the
/// ledger's part keeps both the script's `XADD` and the drainer's parsing of
/// the stream reply cheap.
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
/// A client key's text (`/v1/keys`), in entries of keys only.
pub const KEY: &str = "k";
/// An operator's release or result (and a processing lease's release): who
/// released it and why, for its audit row. Fields of their own, so that a
/// drainer that does not know them still applies the release.
pub const BY: &str = "by";
pub const REASON: &str = "reason";

/// What an entry reports: the first element of its packed array (and its
/// `op` field in the layout written before 0.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Consume,
    Result,
    Release,
}

impl Op {
    /// Its name in the stream.
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Consume => "consume",
            Op::Result => "result",
            Op::Release => "release",
        }
    }

    /// The op named `name` in the stream, if any.
    pub fn parse(name: &str) -> Option<Op> {
        [Op::Consume, Op::Result, Op::Release]
            .into_iter()
            .find(|op| op.as_str() == name)
    }
}

/// Who released a token (or recorded its result) in an operator's name, and
/// why ([`BY`], [`REASON`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Operator {
    by: String,
    reason: String,
}

/// A journal entry as the ledger writes it, before the script that decides
/// adds what only it knows: what a deciding script receives to append.
///
/// `Default` is the empty record (no op, an empty packed part): only what
/// `std::mem::take` leaves behind in a record moved out, not an entry to
/// append.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    op: Option<Op>,
    /// The ledger's part, packed (see [`ENTRY`]).
    packed: String,
    /// A client key's text ([`KEY`]).
    key: Option<String>,
    operator: Option<Operator>,
}

impl Record {
    /// An entry of `op` whose ledger's part is `packed` (see [`ENTRY`]), of
    /// client key `key` if it is one.
    pub fn new(op: Op, packed: String, key: Option<String>) -> Record {
        Record {
            op: Some(op),
            packed,
            key,
            operator: None,
        }
    }

    /// What the entry reports (`None` for the empty record).
    pub fn op(&self) -> Option<Op> {
        self.op
    }

    /// The entry says who released the token (or recorded its result) and
    /// why ([`BY`], [`REASON`]).
    pub fn set_operator(&mut self, by: &str, reason: &str) {
        self.operator = Some(Operator {
            by: by.to_owned(),
            reason: reason.to_owned(),
        });
    }

    /// The record as its script decided it: when (`at_ms`) and at which
    /// generation.
    pub fn decided(self, gen: i64, at_ms: i64) -> Stamped {
        Stamped {
            record: self,
            stamp: Stamp::Decided { at_ms, gen },
        }
    }

    /// A consume replayed onto a key Redis no longer holds: its time only,
    /// no generation (Postgres applies it as a consume of an issued token).
    pub fn replayed_at(self, at_ms: i64) -> Stamped {
        Stamped {
            record: self,
            stamp: Stamp::At(at_ms),
        }
    }

    /// A result or release `fast_write.lua` wrote on a cluster (where it
    /// cannot append itself): what it would have added, as it answered it.
    pub(super) fn written(self, gen: String, at: String, of_consume: Option<OfConsume>) -> Stamped {
        Stamped {
            record: self,
            stamp: Stamp::Written {
                gen,
                at,
                of_consume,
            },
        }
    }

    /// The record's fields, in the order they are written: what a deciding
    /// script receives to append (after the ones it adds itself).
    pub(super) fn pairs(&self) -> impl Iterator<Item = (&'static str, &str)> {
        let operator = self
            .operator
            .iter()
            .flat_map(|o| [(BY, o.by.as_str()), (REASON, o.reason.as_str())]);
        std::iter::once((ENTRY, self.packed.as_str()))
            .chain(self.key.as_deref().map(|k| (KEY, k)))
            .chain(operator)
    }

    /// The record's fields, owned (see [`Self::pairs`]).
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        self.pairs().map(|(k, v)| (k, v.to_owned())).collect()
    }
}

/// The consumed state a result belongs to, as `fast_write.lua` answered it:
/// [`CONSUMED_AT`], [`REQUEST_ID`], [`FINGERPRINT`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct OfConsume {
    pub(super) consumed_at: String,
    pub(super) request_id: String,
    pub(super) fingerprint: String,
}

/// What the script that decided adds to a record.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stamp {
    /// [`AT`] then [`GEN`]: a consume's (or the going-down flush's record of
    /// any decision).
    Decided { at_ms: i64, gen: i64 },
    /// [`AT`] alone (see [`Record::replayed_at`]).
    At(i64),
    /// [`GEN`], [`AT`], then for a result the consumed state it belongs to:
    /// a cluster's result or release, as the script answered.
    Written {
        gen: String,
        at: String,
        of_consume: Option<OfConsume>,
    },
}

/// A record and what its script added: an entry as it is appended to the
/// stream (on a cluster, by this tier after the call) or handed to Postgres
/// directly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamped {
    record: Record,
    stamp: Stamp,
}

impl Stamped {
    /// Every field of the entry, in the order `XADD` writes them: the
    /// record's, then the script's.
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        let mut fields = self.record.fields();
        match &self.stamp {
            Stamp::Decided { at_ms, gen } => {
                fields.push((AT, at_ms.to_string()));
                fields.push((GEN, gen.to_string()));
            }
            Stamp::At(at_ms) => fields.push((AT, at_ms.to_string())),
            Stamp::Written {
                gen,
                at,
                of_consume,
            } => {
                fields.push((GEN, gen.clone()));
                fields.push((AT, at.clone()));
                if let Some(c) = of_consume {
                    fields.push((CONSUMED_AT, c.consumed_at.clone()));
                    fields.push((REQUEST_ID, c.request_id.clone()));
                    fields.push((FINGERPRINT, c.fingerprint.clone()));
                }
            }
        }
        fields
    }

    /// The entry as the drainer would read it back, under stream id `id`.
    pub fn entry(&self, id: String) -> JournalEntry {
        JournalEntry {
            id,
            fields: self
                .fields()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.into_bytes()))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_are_named_as_in_the_stream() {
        for op in [Op::Consume, Op::Result, Op::Release] {
            assert_eq!(Op::parse(op.as_str()), Some(op));
        }
        assert_eq!(Op::parse("unclaim"), None);
    }

    #[test]
    fn fields_are_written_in_the_order_they_were_before_records() {
        let mut rec = Record::new(Op::Release, "[]".into(), Some("k-1".into()));
        rec.set_operator("ops", "why");
        let names = |s: &Stamped| s.fields().into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        assert_eq!(
            names(&rec.clone().decided(2, 5)),
            [ENTRY, KEY, BY, REASON, AT, GEN]
        );
        assert_eq!(
            names(&rec.clone().written("2".into(), "5".into(), None)),
            [ENTRY, KEY, BY, REASON, GEN, AT]
        );
        let of = OfConsume {
            consumed_at: "4".into(),
            request_id: "r".into(),
            fingerprint: "".into(),
        };
        let plain = Record::new(Op::Result, "[]".into(), None);
        assert_eq!(
            names(&plain.clone().written("1".into(), "5".into(), Some(of))),
            [ENTRY, GEN, AT, CONSUMED_AT, REQUEST_ID, FINGERPRINT]
        );
        assert_eq!(names(&plain.replayed_at(5)), [ENTRY, AT]);
    }
}
