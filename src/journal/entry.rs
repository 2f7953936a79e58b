//! What a journal entry holds: the ledger's part the ledger writes
//! ([`consume_fields`] and the others, packed into a [`Record`]) and what the
//! drainer reads back ([`parse`]), including the layouts written before
//! generations and before 0.1. The stream's field names and the encoding of
//! a record into stream fields are the fast tier's ([`crate::fast::record`]).

use chrono::{TimeZone, Utc};
use serde_json::Value as Json;

use crate::config::Durability;
use crate::durable::journal::{self as versioned, Decided, EntryKind, Versioned};
use crate::durable::tokens::{JournalConsume, TokenRecord};
use crate::fast::record::{
    Op, Record, Stamped, AT, BY, CONSUMED_AT, ENTRY, FINGERPRINT, GEN, KEY, REASON, REQUEST_ID,
};
use crate::fast::JournalEntry;

/// The record of an entry of `op`: the ledger's part, and a client key's text.
fn fields_of(op: Op, rec: &TokenRecord, packed: String) -> Record {
    Record::new(op, packed, rec.key.clone())
}

/// A decision's entry as its script completed it: `fields`, with the
/// generation it decided and the time (Redis's clock, ms) it decided it.
pub fn decided(fields: Record, gen: i64, at_ms: i64) -> Stamped {
    fields.decided(gen, at_ms)
}

/// The journal record of a fast-type consume.
pub fn consume_fields(
    rec: &TokenRecord,
    request_id: Option<&str>,
    fingerprint: Option<&str>,
) -> Record {
    let entry = (
        Op::Consume.as_str(),
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
    fields_of(Op::Consume, rec, pack(&entry))
}

/// The journal record of a fast-type result, in the layout without a token
/// record (see [`result_fields_for`]).
pub fn result_fields(id: i64, result: &str) -> Record {
    // `result` is the JSON text as stored, carried as a string.
    let packed = pack(&(Op::Result.as_str(), id, result));
    Record::new(Op::Result, packed, None)
}

/// The journal record of a fast-type release, in the layout without a token
/// record (see [`release_fields_for`]).
pub fn release_fields(id: i64) -> Record {
    Record::new(Op::Release, pack(&(Op::Release.as_str(), id)), None)
}

/// The journal record of a fast-type result, with the token record (so that
/// it applies even before its consume entry has).
pub fn result_fields_for(rec: &TokenRecord, result: &str) -> Record {
    let entry = (
        Op::Result.as_str(),
        rec.id,
        result,
        &rec.token,
        &rec.biz_type,
        &rec.subject,
        &rec.client,
        rec.issued_at.timestamp_millis(),
        rec.expires_at.timestamp_millis(),
    );
    fields_of(Op::Result, rec, pack(&entry))
}

/// The journal record of a fast-type release, with the token record.
pub fn release_fields_for(rec: &TokenRecord) -> Record {
    let entry = (
        Op::Release.as_str(),
        rec.id,
        &rec.token,
        &rec.biz_type,
        &rec.subject,
        &rec.client,
        rec.issued_at.timestamp_millis(),
        rec.expires_at.timestamp_millis(),
    );
    fields_of(Op::Release, rec, pack(&entry))
}

/// The journal record of a fast-type release by an operator: the release's
/// with who (the acting client's name) and why, which its audit row's detail
/// records.
pub fn admin_release_fields_for(rec: &TokenRecord, by: &str, reason: &str) -> Record {
    let mut fields = release_fields_for(rec);
    fields.set_operator(by, reason);
    fields
}

/// The audit detail an entry's own fields add (an operator's release or result, a lease's release).
fn detail_of(e: &JournalEntry) -> Option<Json> {
    let by = e.get(BY)?;
    let mut detail = serde_json::Map::new();
    detail.insert("by".to_owned(), Json::from(by));
    if let Some(reason) = e.get(REASON) {
        detail.insert("reason".to_owned(), Json::from(reason));
    }
    Some(Json::Object(detail))
}

fn pack(entry: &impl serde::Serialize) -> String {
    // Serializing strings, integers and JSON values into a String cannot fail.
    serde_json::to_string(entry).unwrap_or_default()
}

/// A consume: op, id, token, biz type, subject, client, issued at, expires
/// at (ms), request id, fingerprint.
type ConsumeLayout = (
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
);
/// A result with its token record: op, id, result (JSON text), token, biz
/// type, subject, client, issued at, expires at.
type ResultForLayout = (
    String,
    i64,
    String,
    String,
    String,
    String,
    String,
    i64,
    i64,
);
/// A release with its token record: op, id, token, biz type, subject,
/// client, issued at, expires at.
type ReleaseForLayout = (String, i64, String, String, String, String, i64, i64);
/// A result without a token record: op, id, result.
type ResultLayout = (String, i64, String);
/// A release without a token record: op, id.
type ReleaseLayout = (String, i64);

/// What [`ENTRY`] holds: an array whose first element names the operation
/// and whose length tells the layouts of one operation apart.
#[derive(Debug, PartialEq)]
enum Packed {
    Consume(ConsumeLayout),
    ResultFor(ResultForLayout),
    ReleaseFor(ReleaseForLayout),
    Result(ResultLayout),
    Release(ReleaseLayout),
}

impl<'de> serde::Deserialize<'de> for Packed {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(PackedVisitor)
    }
}

/// Reads a [`Packed`] element by element: the operation first, then the
/// layout it names, each value once into its own type (an untagged enum
/// would buffer every value and try each layout in turn). An entry is read
/// only as a layout of the operation it names; anything else (another
/// length, another type at any place, an unknown operation) is an error.
struct PackedVisitor;

/// The next element, which must be there (the `at`-th, counting from 0).
fn element<'de, T, A>(seq: &mut A, at: usize) -> Result<T, A::Error>
where
    T: serde::Deserialize<'de>,
    A: serde::de::SeqAccess<'de>,
{
    seq.next_element()?
        .ok_or_else(|| serde::de::Error::invalid_length(at, &PackedVisitor))
}

/// The sequence must end after its `len` elements.
fn end<'de, A: serde::de::SeqAccess<'de>>(seq: &mut A, len: usize) -> Result<(), A::Error> {
    match seq.next_element::<serde::de::IgnoredAny>()? {
        None => Ok(()),
        Some(_) => Err(serde::de::Error::invalid_length(len + 1, &PackedVisitor)),
    }
}

impl<'de> serde::de::Visitor<'de> for PackedVisitor {
    type Value = Packed;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a journal entry: [operation, id, ...] in one of its layouts")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Packed, A::Error> {
        let op: String = element(&mut seq, 0)?;
        let id: i64 = element(&mut seq, 1)?;
        let packed = match Op::parse(&op) {
            Some(Op::Consume) => {
                let (token, biz, subject, client) = (
                    element(&mut seq, 2)?,
                    element(&mut seq, 3)?,
                    element(&mut seq, 4)?,
                    element(&mut seq, 5)?,
                );
                let (iat, exp) = (element(&mut seq, 6)?, element(&mut seq, 7)?);
                let (rid, fp) = (element(&mut seq, 8)?, element(&mut seq, 9)?);
                end(&mut seq, 10)?;
                Packed::Consume((op, id, token, biz, subject, client, iat, exp, rid, fp))
            }
            Some(Op::Result) => {
                let text: String = element(&mut seq, 2)?;
                match seq.next_element::<String>()? {
                    None => Packed::Result((op, id, text)),
                    Some(token) => {
                        let (biz, subject, client) = (
                            element(&mut seq, 4)?,
                            element(&mut seq, 5)?,
                            element(&mut seq, 6)?,
                        );
                        let (iat, exp) = (element(&mut seq, 7)?, element(&mut seq, 8)?);
                        end(&mut seq, 9)?;
                        Packed::ResultFor((op, id, text, token, biz, subject, client, iat, exp))
                    }
                }
            }
            Some(Op::Release) => match seq.next_element::<String>()? {
                None => Packed::Release((op, id)),
                Some(token) => {
                    let (biz, subject, client) = (
                        element(&mut seq, 3)?,
                        element(&mut seq, 4)?,
                        element(&mut seq, 5)?,
                    );
                    let (iat, exp) = (element(&mut seq, 6)?, element(&mut seq, 7)?);
                    end(&mut seq, 8)?;
                    Packed::ReleaseFor((op, id, token, biz, subject, client, iat, exp))
                }
            },
            None => {
                return Err(serde::de::Error::invalid_value(
                    serde::de::Unexpected::Str(&op),
                    &PackedVisitor,
                ))
            }
        };
        Ok(packed)
    }
}

#[derive(Debug)]
pub(super) enum Entry {
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

fn field(e: &JournalEntry, k: &str) -> String {
    e.get(k).unwrap_or_default().to_owned()
}

fn ms_to_time(ms: &str) -> Option<chrono::DateTime<Utc>> {
    ms.parse::<i64>()
        .ok()
        .and_then(|m| Utc.timestamp_millis_opt(m).single())
}

fn opt(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

pub(super) fn parse(e: &JournalEntry) -> Entry {
    let entry = match e.get(ENTRY) {
        Some(packed) => parse_packed(e, packed),
        None => parse_fields(e),
    };
    match (entry, e.get(KEY)) {
        (entry, None) => entry,
        (Entry::Versioned(mut v), Some(key)) => {
            v.record.key = Some(key.to_owned());
            Entry::Versioned(v)
        }
        (Entry::Bad(why), Some(_)) => Entry::Bad(why),
        // Keys are journaled with generations only.
        (_, Some(_)) => Entry::Bad("a client key's entry without a generation"),
    }
}

/// The generation a script added, checked against what the entry says:
/// odd for a consumed state, even (and past the issued one) for a release.
fn gen_of(e: &JournalEntry, consumed: bool) -> Result<Option<i64>, &'static str> {
    let Some(text) = e.get(GEN) else {
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
        key: None,
    })
}

fn parse_packed(e: &JournalEntry, packed: &str) -> Entry {
    let at = ms_to_time(&field(e, AT));
    match serde_json::from_str::<Packed>(packed) {
        Ok(Packed::Consume((op, id, token, biz, subject, client, iat, exp, rid, fp)))
            if op == Op::Consume.as_str() =>
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
                    detail: None,
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
            if op == Op::Result.as_str() =>
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
                        // An operator's result: who and why.
                        detail: detail_of(e),
                    })
                }
                Ok(None) => Entry::Result { id, result },
                Err(why) => Entry::Bad(why),
            }
        }
        Ok(Packed::ReleaseFor((op, id, token, biz, subject, client, iat, exp)))
            if op == Op::Release.as_str() =>
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
                    detail: detail_of(e),
                }),
                Ok(None) => Entry::Release { id },
                Err(why) => Entry::Bad(why),
            }
        }
        Ok(Packed::Result((op, id, text))) if op == Op::Result.as_str() => {
            match serde_json::from_str(&text) {
                Ok(result) => Entry::Result { id, result },
                Err(_) => Entry::Bad("result is not JSON"),
            }
        }
        Ok(Packed::Release((op, id))) if op == Op::Release.as_str() => Entry::Release { id },
        _ => Entry::Bad("unreadable entry"),
    }
}

/// The older layout: one stream field per value.
fn parse_fields(e: &JournalEntry) -> Entry {
    let id: Option<i64> = field(e, "id").parse().ok();
    match (Op::parse(&field(e, "op")), id) {
        (Some(Op::Consume), Some(id)) => {
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
                    key: None,
                },
                consumed_at: at,
                fingerprint: opt(field(e, "fp")),
                request_id: opt(field(e, "rid")),
            })
        }
        (Some(Op::Result), Some(id)) => match serde_json::from_str(&field(e, "res")) {
            Ok(result) => Entry::Result { id, result },
            Err(_) => Entry::Bad("result is not JSON"),
        },
        (Some(Op::Release), Some(id)) => Entry::Release { id },
        _ => Entry::Bad("unreadable entry"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A stream entry as XREADGROUP returns it, with the fields a script adds.
    fn entry_with(fields: &[(&'static str, String)], added: &[(&str, String)]) -> JournalEntry {
        let fields = fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_str()))
            .chain(added.iter().map(|(k, v)| (k.to_string(), v.as_str())))
            .map(|(k, v)| (k, v.as_bytes().to_vec()))
            .collect();
        JournalEntry {
            id: "1-0".into(),
            fields,
        }
    }

    /// With only the `at` a script adds (the layout without generations).
    fn entry(fields: &[(&'static str, String)], at: i64) -> JournalEntry {
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
            key: None,
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
            let fields = consume_fields(&rec, rid.as_deref(), fp.as_deref()).fields();
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
            let fields = consume_fields(&rec, rid.as_deref(), None).fields();
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
        match parse(&entry_with(&result_fields_for(&rec, text).fields(), &added)) {
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
        match parse(&entry_with(&release_fields_for(&rec).fields(), &added)) {
            Entry::Versioned(v) => {
                assert_eq!(v.kind, EntryKind::Release);
                assert_eq!(
                    v.version,
                    Versioned {
                        gen: 4,
                        state: Decided::Issued
                    }
                );
                assert_eq!(v.detail, None);
            }
            other => panic!("{other:?}"),
        }
        // An operator's release says who and why.
        let fields = admin_release_fields_for(&rec, "ops-alice", "consumer died; OPS-7").fields();
        match parse(&entry_with(&fields, &added)) {
            Entry::Versioned(v) => {
                assert_eq!((v.kind, v.version.gen), (EntryKind::Release, 4));
                assert_eq!(
                    v.detail,
                    Some(serde_json::json!({"by": "ops-alice", "reason": "consumer died; OPS-7"}))
                );
            }
            other => panic!("{other:?}"),
        }
        // A generation that contradicts the state can never apply.
        let odd = [(AT, "1790000003000".to_owned()), (GEN, "5".to_owned())];
        assert!(matches!(
            parse(&entry_with(&release_fields_for(&rec).fields(), &odd)),
            Entry::Bad(_)
        ));
    }

    #[test]
    fn the_layouts_without_generations_are_still_read() {
        let text = r#"{"order":"o-1"}"#;
        match parse(&entry(&result_fields(42, text).fields(), 5)) {
            Entry::Result { id, result } => {
                assert_eq!(id, 42);
                assert_eq!(result, serde_json::from_str::<Json>(text).unwrap());
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse(&entry(&release_fields(43).fields(), 5)),
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

    /// The layouts as an untagged enum, as entries were read before
    /// [`PackedVisitor`]: the oracle the visitor must agree with.
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Oracle {
        Consume(ConsumeLayout),
        ResultFor(ResultForLayout),
        ReleaseFor(ReleaseForLayout),
        Result(ResultLayout),
        Release(ReleaseLayout),
    }

    impl Oracle {
        /// What the oracle read, if its first element names its layout's
        /// operation (the untagged enum took any name; `parse_packed`
        /// then refused the others).
        fn packed(self) -> Option<Packed> {
            let (op, packed) = match self {
                Oracle::Consume(t) => (Op::Consume, Packed::Consume(t)),
                Oracle::ResultFor(t) => (Op::Result, Packed::ResultFor(t)),
                Oracle::ReleaseFor(t) => (Op::Release, Packed::ReleaseFor(t)),
                Oracle::Result(t) => (Op::Result, Packed::Result(t)),
                Oracle::Release(t) => (Op::Release, Packed::Release(t)),
            };
            let named = match &packed {
                Packed::Consume(t) => &t.0,
                Packed::ResultFor(t) => &t.0,
                Packed::ReleaseFor(t) => &t.0,
                Packed::Result(t) => &t.0,
                Packed::Release(t) => &t.0,
            };
            (named == op.as_str()).then_some(packed)
        }
    }

    /// Any JSON value a damaged entry could hold in one place.
    fn any_value() -> impl Strategy<Value = Json> {
        prop_oneof![
            any::<i64>().prop_map(Json::from),
            (i64::MAX as u64 + 1..=u64::MAX).prop_map(Json::from),
            (-1e9f64..1e9).prop_map(Json::from),
            "[ -~]{0,6}".prop_map(Json::from),
            any::<bool>().prop_map(Json::from),
            Just(Json::Null),
            Just(serde_json::json!(["consume", 1])),
            Just(serde_json::json!({"op": "release"})),
        ]
    }

    /// An entry in one of the layouts (`true`: a string's place), under any
    /// operation's name, then damaged or not: an element dropped, one
    /// added, or one replaced by any value.
    fn entries() -> impl Strategy<Value = Vec<Json>> {
        const S: bool = true;
        const I: bool = false;
        let layouts: [&'static [bool]; 5] = [
            &[S, I, S, S, S, S, I, I, S, S],
            &[S, I, S, S, S, S, S, I, I],
            &[S, I, S, S, S, S, I, I],
            &[S, I, S],
            &[S, I],
        ];
        let op = prop_oneof![
            Just("consume"),
            Just("result"),
            Just("release"),
            Just("drop"),
            Just(""),
        ];
        (
            proptest::sample::select(layouts.to_vec()),
            op,
            proptest::collection::vec(("[ -~]{0,6}", any::<i64>()), 10),
            0..4u8,
            any::<proptest::sample::Index>(),
            any_value(),
        )
            .prop_map(|(layout, op, values, damage, at, value)| {
                let mut entry: Vec<Json> = layout
                    .iter()
                    .zip(values)
                    .map(|(string, (s, i))| {
                        if *string {
                            Json::from(s)
                        } else {
                            Json::from(i)
                        }
                    })
                    .collect();
                entry[0] = Json::from(op);
                match damage {
                    1 => {
                        entry.pop();
                    }
                    2 => entry.push(value),
                    3 => {
                        let i = at.index(entry.len());
                        entry[i] = value;
                    }
                    _ => {}
                }
                entry
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The visitor reads an entry exactly when the untagged layouts
        /// read it under its own operation's name, and reads the same.
        #[test]
        fn the_visitor_reads_what_the_untagged_layouts_read(entry in entries()) {
            let text = serde_json::to_string(&entry).unwrap();
            let read = serde_json::from_str::<Packed>(&text).ok();
            let oracle = serde_json::from_str::<Oracle>(&text).ok().and_then(Oracle::packed);
            prop_assert_eq!(read, oracle, "{}", text);
        }
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
                &consume_fields(&rec, None, None).fields(),
                &[(AT, "1".into()), (GEN, gen.into())],
            );
            assert!(matches!(parse(&e), Entry::Bad(_)), "gen {gen}");
        }
    }
}
