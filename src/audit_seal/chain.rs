//! The seal's arithmetic, pure (no I/O): each event's canonical bytes, the
//! digest chained over them, and the checkpoint's MAC.
//!
//! A checkpoint of version 1 ([`Version::Flat`], every checkpoint sealed
//! before migration V22) chains its events in id order:
//!
//! ```text
//! digest = SHA-256(prev_digest || event(e1) || event(e2) || ... || event(en))
//! mac    = HMAC-SHA256(seal key, message(checkpoint fields, prev_digest, digest))
//! ```
//!
//! A checkpoint of version 2 ([`Version::ByPartition`]) chains them per
//! partition of `audit_events` (V22: one per day of issue of the tokens),
//! so that a partition dropped whole under `audit.retention` leaves every
//! other part of the checkpoint verifiable:
//!
//! ```text
//! part(P) = SHA-256(32 zero bytes || event(e) for each event of P in the range, in id order)
//! digest  = SHA-256(string("idempotency-ledger audit checkpoint v2 parts") || prev_digest
//!                   || for each partition P, by name: string(P) || count(P) || part(P))
//! mac     = HMAC-SHA256(seal key, message(checkpoint fields, prev_digest, digest)), v2 context
//! ```
//!
//! A dropped partition is recorded by a retirement ([`RetirementFields`]):
//! its name, when, how many events and over how many checkpoints, under its
//! own MAC. `audit verify` takes a retired partition's parts from the
//! checkpoint as sealed, and recomputes every other.
//!
//! `event(e)` is every column of `audit_events`, in this order, each
//! self-delimiting, so that no two different events (or sequences of events)
//! give the same bytes:
//!
//! | field | encoding |
//! |---|---|
//! | `id` | 8 bytes, big-endian two's complement |
//! | `at` | microseconds since the Unix epoch, 8 bytes big-endian |
//! | `kind` | string |
//! | `token_id` | optional integer |
//! | `token`, `subject`, `biz_type`, `order_id`, `client` | optional strings |
//! | `gen` | optional integer |
//! | `detail` | string: the jsonb's canonical text (below) |
//!
//! A string is its UTF-8 length as 4 bytes big-endian, then its bytes; an
//! optional value is one byte `0` (NULL) or `1` followed by the value.
//!
//! `detail` is sealed as the text Postgres renders for the stored jsonb:
//! jsonb keeps one copy of each key, in its own fixed order (shorter keys
//! first, then bytewise), with fixed spacing, and numbers exactly as
//! stored. That is a canonical JSON form of the value, and an exact one:
//! re-serialising in Rust would pass numbers through `f64`
//! (serde_json has no arbitrary precision here) and could miss an edit of a
//! large number.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use sha2::{Digest as _, Sha256};

/// A SHA-256 value.
pub type Digest = [u8; 32];

/// The `prev_digest` of the first checkpoint.
pub const GENESIS: Digest = [0; 32];

/// Domain separation of the MAC's message (a seal key is never used for
/// anything else, but the message says what it is anyway).
const MAC_CONTEXT: &str = "idempotency-ledger audit checkpoint v1";
const MAC_CONTEXT_V2: &str = "idempotency-ledger audit checkpoint v2";
const PARTS_CONTEXT: &str = "idempotency-ledger audit checkpoint v2 parts";
const RETIREMENT_CONTEXT: &str = "idempotency-ledger audit retirement v1";

/// How a checkpoint chains its events (`audit_checkpoints.version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// 1: one chain over every event of the range, in id order.
    Flat,
    /// 2: one chain per partition, the parts digested in name order.
    ByPartition,
}

impl Version {
    pub fn from_i16(v: i16) -> Option<Version> {
        match v {
            1 => Some(Version::Flat),
            2 => Some(Version::ByPartition),
            _ => None,
        }
    }

    pub fn as_i16(self) -> i16 {
        match self {
            Version::Flat => 1,
            Version::ByPartition => 2,
        }
    }
}

/// One audit event as it is sealed: the row the durable tier reads.
pub use crate::durable::seal::SealedEvent;

fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_be_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Audit texts are far below 4 GiB (Postgres caps a field at 1 GB).
    let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_opt_i64(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        None => out.push(0),
        Some(v) => {
            out.push(1);
            put_i64(out, v);
        }
    }
}

fn put_opt_str(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        None => out.push(0),
        Some(s) => {
            out.push(1);
            put_str(out, s);
        }
    }
}

impl SealedEvent {
    /// Appends the event's canonical bytes (see the module's table) to `out`.
    pub fn canonical_bytes(&self, out: &mut Vec<u8>) {
        put_i64(out, self.id);
        put_i64(out, self.at.timestamp_micros());
        put_str(out, &self.kind);
        put_opt_i64(out, self.token_id);
        put_opt_str(out, self.token.as_deref());
        put_opt_str(out, self.subject.as_deref());
        put_opt_str(out, self.biz_type.as_deref());
        put_opt_str(out, self.order_id.as_deref());
        put_opt_str(out, self.client.as_deref());
        put_opt_i64(out, self.gen);
        put_str(out, &self.detail);
    }
}

/// The digest of one checkpoint, fed its events in id order.
#[derive(Clone)]
pub struct Chain {
    hasher: Sha256,
    buf: Vec<u8>,
    events: i64,
    first: Option<i64>,
    last: Option<i64>,
}

/// What a [`Chain`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sealed {
    pub digest: Digest,
    pub events: i64,
    /// The lowest and highest event id (`None`: no event).
    pub first_event_id: Option<i64>,
    pub last_event_id: Option<i64>,
}

impl Chain {
    /// A chain continuing from the previous checkpoint's digest
    /// ([`GENESIS`] for the first).
    pub fn new(prev: &Digest) -> Chain {
        let mut hasher = Sha256::new();
        hasher.update(prev);
        Chain {
            hasher,
            buf: Vec::with_capacity(512),
            events: 0,
            first: None,
            last: None,
        }
    }

    /// The next event, in id order.
    pub fn push(&mut self, e: &SealedEvent) {
        self.buf.clear();
        e.canonical_bytes(&mut self.buf);
        self.hasher.update(&self.buf);
        self.events += 1;
        self.first.get_or_insert(e.id);
        self.last = Some(e.id);
    }

    /// The id of the last event pushed, if any.
    pub fn last_event_id(&self) -> Option<i64> {
        self.last
    }

    pub fn finish(self) -> Sealed {
        Sealed {
            digest: self.hasher.finalize().into(),
            events: self.events,
            first_event_id: self.first,
            last_event_id: self.last,
        }
    }
}

/// One partition's share of a version 2 checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The partition's table name (`audit_events_p20261205`).
    pub partition: String,
    pub events: i64,
    pub digest: Digest,
}

/// The chains of a version 2 checkpoint, one per partition, fed the range's
/// events in id order.
#[derive(Clone, Default)]
pub struct Parts {
    chains: BTreeMap<String, Chain>,
    events: i64,
    first: Option<i64>,
    last: Option<i64>,
}

impl Parts {
    pub fn new() -> Parts {
        Parts::default()
    }

    /// The next event, in id order, into its partition's chain.
    pub fn push(&mut self, e: &SealedEvent) {
        match self.chains.get_mut(&e.partition) {
            Some(chain) => chain.push(e),
            None => {
                let mut chain = Chain::new(&GENESIS);
                chain.push(e);
                self.chains.insert(e.partition.clone(), chain);
            }
        }
        self.events += 1;
        self.first.get_or_insert(e.id);
        self.last = Some(e.id);
    }

    /// The id of the last event pushed, if any.
    pub fn last_event_id(&self) -> Option<i64> {
        self.last
    }

    /// The parts, by partition name, and the checkpoint's digest over them.
    pub fn finish(self, prev: &Digest) -> (Vec<Part>, Sealed) {
        let parts: Vec<Part> = self
            .chains
            .into_iter()
            .map(|(partition, chain)| {
                let s = chain.finish();
                Part {
                    partition,
                    events: s.events,
                    digest: s.digest,
                }
            })
            .collect();
        let sealed = Sealed {
            digest: parts_digest(prev, &parts),
            events: self.events,
            first_event_id: self.first,
            last_event_id: self.last,
        };
        (parts, sealed)
    }
}

/// A version 2 checkpoint's digest over its parts (given in name order).
pub fn parts_digest(prev: &Digest, parts: &[Part]) -> Digest {
    let mut buf = Vec::with_capacity(64 + parts.len() * 80);
    put_str(&mut buf, PARTS_CONTEXT);
    buf.extend_from_slice(prev);
    for p in parts {
        put_str(&mut buf, &p.partition);
        put_i64(&mut buf, p.events);
        buf.extend_from_slice(&p.digest);
    }
    Sha256::digest(&buf).into()
}

fn hmac_over(secret: &[u8], message: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    mac.update(message);
    mac
}

/// A checkpoint's fields as its MAC covers them.
#[derive(Debug, Clone, Copy)]
pub struct MacFields<'a> {
    pub version: Version,
    pub id: i64,
    pub sealed_at: DateTime<Utc>,
    pub first_event_id: i64,
    pub last_event_id: i64,
    pub events: i64,
    pub prev_digest: &'a Digest,
    pub digest: &'a Digest,
    pub key_id: &'a str,
}

impl MacFields<'_> {
    fn message(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(160);
        put_str(
            &mut m,
            match self.version {
                Version::Flat => MAC_CONTEXT,
                Version::ByPartition => MAC_CONTEXT_V2,
            },
        );
        put_i64(&mut m, self.id);
        put_i64(&mut m, self.sealed_at.timestamp_micros());
        put_i64(&mut m, self.first_event_id);
        put_i64(&mut m, self.last_event_id);
        put_i64(&mut m, self.events);
        m.extend_from_slice(self.prev_digest);
        m.extend_from_slice(self.digest);
        put_str(&mut m, self.key_id);
        m
    }

    fn hmac(&self, secret: &[u8]) -> Hmac<Sha256> {
        hmac_over(secret, &self.message())
    }

    /// The MAC under `secret`.
    pub fn mac(&self, secret: &[u8]) -> [u8; 32] {
        self.hmac(secret).finalize().into_bytes().into()
    }

    /// Whether `tag` is the MAC under `secret` (compared in constant time).
    pub fn verify(&self, secret: &[u8], tag: &[u8]) -> bool {
        self.hmac(secret).verify_slice(tag).is_ok()
    }
}

/// A retirement's fields as its MAC covers them: the partition dropped under
/// `audit.retention`, when (Postgres's clock), how many sealed events it
/// held and over how many checkpoints' parts they were verified before the
/// drop, and the key.
#[derive(Debug, Clone, Copy)]
pub struct RetirementFields<'a> {
    pub partition: &'a str,
    pub retired_at: DateTime<Utc>,
    pub events: i64,
    pub checkpoints: i64,
    pub key_id: &'a str,
}

impl RetirementFields<'_> {
    fn message(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(128);
        put_str(&mut m, RETIREMENT_CONTEXT);
        put_str(&mut m, self.partition);
        put_i64(&mut m, self.retired_at.timestamp_micros());
        put_i64(&mut m, self.events);
        put_i64(&mut m, self.checkpoints);
        put_str(&mut m, self.key_id);
        m
    }

    /// The MAC under `secret`.
    pub fn mac(&self, secret: &[u8]) -> [u8; 32] {
        hmac_over(secret, &self.message())
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `tag` is the MAC under `secret` (compared in constant time).
    pub fn verify(&self, secret: &[u8], tag: &[u8]) -> bool {
        hmac_over(secret, &self.message()).verify_slice(tag).is_ok()
    }
}

/// Parses a stored hex digest or MAC (64 lower-case hex digits).
pub fn parse_hex32(text: &str) -> Option<[u8; 32]> {
    hex::decode(text)
        .ok()
        .and_then(|v| <[u8; 32]>::try_from(v).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn event(id: i64, detail: &str) -> SealedEvent {
        SealedEvent {
            id,
            at: Utc
                .timestamp_micros(1_767_225_600_123_456)
                .single()
                .expect("a time"),
            kind: "token.consumed".into(),
            token_id: Some(7),
            token: Some("order_abc".into()),
            subject: Some("user-42".into()),
            biz_type: Some("order".into()),
            order_id: None,
            client: Some("payments".into()),
            gen: Some(1),
            detail: detail.into(),
            partition: "audit_events_base".into(),
        }
    }

    fn digest(prev: &Digest, events: &[SealedEvent]) -> Digest {
        let mut c = Chain::new(prev);
        for e in events {
            c.push(e);
        }
        c.finish().digest
    }

    /// The chain is SHA-256 over the previous digest and the events' bytes,
    /// exactly as the module documents it: an independent verifier can
    /// recompute it from this description.
    #[test]
    fn the_chain_is_sha256_over_the_previous_digest_and_the_documented_bytes() {
        let e = event(5, r#"{"request_id": "r-1"}"#);
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&5i64.to_be_bytes());
        bytes.extend_from_slice(&1_767_225_600_123_456i64.to_be_bytes());
        bytes.extend_from_slice(&14u32.to_be_bytes());
        bytes.extend_from_slice(b"token.consumed");
        bytes.push(1);
        bytes.extend_from_slice(&7i64.to_be_bytes());
        for s in ["order_abc", "user-42", "order"] {
            bytes.push(1);
            bytes.extend_from_slice(&(s.len() as u32).to_be_bytes());
            bytes.extend_from_slice(s.as_bytes());
        }
        bytes.push(0); // order_id NULL
        bytes.push(1);
        bytes.extend_from_slice(&8u32.to_be_bytes());
        bytes.extend_from_slice(b"payments");
        bytes.push(1);
        bytes.extend_from_slice(&1i64.to_be_bytes());
        let detail = br#"{"request_id": "r-1"}"#;
        bytes.extend_from_slice(&(detail.len() as u32).to_be_bytes());
        bytes.extend_from_slice(detail);
        let mut own = Vec::new();
        e.canonical_bytes(&mut own);
        assert_eq!(own, bytes);

        let mut h = Sha256::new();
        h.update(GENESIS);
        h.update(&bytes);
        let want: Digest = h.finalize().into();
        assert_eq!(digest(&GENESIS, &[e]), want);
    }

    /// Every change to the sealed events changes the digest: an edited
    /// field, a NULL for an empty string, a deleted, inserted or reordered
    /// event, another previous digest; and the chain of two checkpoints is
    /// the first's digest carried into the second.
    #[test]
    fn any_change_to_the_events_or_the_previous_digest_changes_the_digest() {
        let events = vec![
            event(1, "{}"),
            event(2, r#"{"by": "admin"}"#),
            event(4, r#"{"n": 12345678901234567890123}"#),
        ];
        let base = digest(&GENESIS, &events);
        let mut variants: Vec<Vec<SealedEvent>> = Vec::new();
        let mut edited = events.clone();
        edited[1].detail = r#"{"by": "admim"}"#.into();
        variants.push(edited);
        let mut edited = events.clone();
        edited[2].detail = r#"{"n": 12345678901234567890124}"#.into();
        variants.push(edited);
        let mut edited = events.clone();
        edited[0].order_id = Some(String::new());
        variants.push(edited);
        let mut edited = events.clone();
        edited[0].at += chrono::Duration::microseconds(1);
        variants.push(edited);
        let mut edited = events.clone();
        edited[2].gen = None;
        variants.push(edited);
        // A field's bytes moved into its neighbour: length prefixes tell them apart.
        let mut edited = events.clone();
        edited[0].token = Some("order_abcuser-42".into());
        edited[0].subject = Some(String::new());
        variants.push(edited);
        variants.push(vec![events[0].clone(), events[2].clone()]);
        variants.push(vec![
            events[0].clone(),
            events[1].clone(),
            event(3, "{}"),
            events[2].clone(),
        ]);
        variants.push(vec![
            events[1].clone(),
            events[0].clone(),
            events[2].clone(),
        ]);
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(digest(&GENESIS, v), base, "variant {i}");
        }
        assert_ne!(digest(&[1; 32], &events), base, "another previous digest");

        let first = digest(&GENESIS, &events[..2]);
        let second = digest(&first, &events[2..]);
        assert_ne!(second, digest(&GENESIS, &events[2..]));
        let sealed = {
            let mut c = Chain::new(&first);
            c.push(&events[2]);
            c.finish()
        };
        assert_eq!(sealed.digest, second);
        assert_eq!(sealed.events, 1);
        assert_eq!(
            (sealed.first_event_id, sealed.last_event_id),
            (Some(4), Some(4))
        );
    }

    /// The MAC covers every field of the checkpoint and verifies only under
    /// its own key.
    #[test]
    fn the_mac_covers_every_field_and_only_its_key_verifies_it() {
        let prev = GENESIS;
        let d = digest(&GENESIS, &[event(1, "{}")]);
        let at = Utc
            .timestamp_micros(1_767_225_600_000_001)
            .single()
            .expect("a time");
        let fields = MacFields {
            version: Version::Flat,
            id: 3,
            sealed_at: at,
            first_event_id: 1,
            last_event_id: 1,
            events: 1,
            prev_digest: &prev,
            digest: &d,
            key_id: "a1",
        };
        let key = b"a seal key of at least thirty-two bytes";
        let tag = fields.mac(key);
        assert!(fields.verify(key, &tag));
        assert!(!fields.verify(b"another seal key, also long enough!!", &tag));
        let other = [9u8; 32];
        let changed = [
            MacFields { id: 4, ..fields },
            MacFields {
                sealed_at: at + chrono::Duration::microseconds(1),
                ..fields
            },
            MacFields {
                first_event_id: 0,
                ..fields
            },
            MacFields {
                last_event_id: 2,
                ..fields
            },
            MacFields {
                events: 2,
                ..fields
            },
            MacFields {
                prev_digest: &other,
                ..fields
            },
            MacFields {
                digest: &other,
                ..fields
            },
            MacFields {
                key_id: "a2",
                ..fields
            },
            MacFields {
                version: Version::ByPartition,
                ..fields
            },
        ];
        for (i, c) in changed.iter().enumerate() {
            assert!(!c.verify(key, &tag), "field {i} not covered");
        }
        assert_eq!(parse_hex32(&hex::encode(tag)), Some(tag));
        assert_eq!(parse_hex32("00"), None);
        assert_eq!(parse_hex32(&"zz".repeat(32)), None);
    }
    fn in_partition(mut e: SealedEvent, partition: &str) -> SealedEvent {
        e.partition = partition.into();
        e
    }

    fn parts_of(prev: &Digest, events: &[SealedEvent]) -> (Vec<Part>, Sealed) {
        let mut p = Parts::new();
        for e in events {
            p.push(e);
        }
        p.finish(prev)
    }

    /// A version 2 digest is SHA-256 over the documented bytes: each
    /// partition's part is its own chain from 32 zero bytes, the parts in
    /// name order whatever the order of their events.
    #[test]
    fn a_version_2_digest_is_sha256_over_the_parts_as_documented() {
        let (a, b) = ("audit_events_p20261205", "audit_events_default");
        let events = vec![
            in_partition(event(1, "{}"), a),
            in_partition(event(2, "{}"), b),
            in_partition(event(3, r#"{"x": 1}"#), a),
        ];
        let (parts, sealed) = parts_of(&[7; 32], &events);
        let part_a = digest(&GENESIS, &[events[0].clone(), events[2].clone()]);
        let part_b = digest(&GENESIS, &[events[1].clone()]);
        assert_eq!(
            parts,
            [
                Part {
                    partition: b.into(),
                    events: 1,
                    digest: part_b
                },
                Part {
                    partition: a.into(),
                    events: 2,
                    digest: part_a
                },
            ]
        );
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&(PARTS_CONTEXT.len() as u32).to_be_bytes());
        bytes.extend_from_slice(PARTS_CONTEXT.as_bytes());
        bytes.extend_from_slice(&[7; 32]);
        for (name, n, d) in [(b, 1i64, part_b), (a, 2, part_a)] {
            bytes.extend_from_slice(&(name.len() as u32).to_be_bytes());
            bytes.extend_from_slice(name.as_bytes());
            bytes.extend_from_slice(&n.to_be_bytes());
            bytes.extend_from_slice(&d);
        }
        let want: Digest = Sha256::digest(&bytes).into();
        assert_eq!(sealed.digest, want);
        assert_eq!(
            (sealed.events, sealed.first_event_id, sealed.last_event_id),
            (3, Some(1), Some(3))
        );
    }

    /// Moving an event to another partition, editing one, dropping one or
    /// another previous digest changes a version 2 digest; a part can be
    /// taken as sealed (a retired partition) and the digest still recomputed
    /// from the parts alone.
    #[test]
    fn any_change_to_a_part_changes_the_version_2_digest() {
        let (a, b) = ("audit_events_p20261205", "audit_events_p20261206");
        let events = vec![
            in_partition(event(1, "{}"), a),
            in_partition(event(2, "{}"), b),
            in_partition(event(3, "{}"), b),
        ];
        let (parts, base) = parts_of(&GENESIS, &events);
        assert_eq!(parts_digest(&GENESIS, &parts), base.digest);
        let mut moved = events.clone();
        moved[1].partition = a.into();
        let mut edited = events.clone();
        edited[2].detail = r#"{"y": 2}"#.into();
        for (i, v) in [moved, edited, events[..2].to_vec()].iter().enumerate() {
            assert_ne!(parts_of(&GENESIS, v).1.digest, base.digest, "variant {i}");
        }
        assert_ne!(parts_of(&[1; 32], &events).1.digest, base.digest);
        let mut renamed = parts.clone();
        renamed[0].partition = "audit_events_p20261207".into();
        assert_ne!(parts_digest(&GENESIS, &renamed), base.digest);
        let mut recounted = parts;
        recounted[1].events = 1;
        assert_ne!(parts_digest(&GENESIS, &recounted), base.digest);
    }

    /// A retirement's MAC covers each of its fields.
    #[test]
    fn a_retirement_s_mac_covers_every_field() {
        let at = Utc
            .timestamp_micros(1_767_225_600_000_001)
            .single()
            .expect("a time");
        let r = RetirementFields {
            partition: "audit_events_p20261205",
            retired_at: at,
            events: 10,
            checkpoints: 2,
            key_id: "a1",
        };
        let key = b"a seal key of at least thirty-two bytes";
        let tag = r.mac(key);
        assert!(r.verify(key, &tag));
        assert!(!r.verify(b"another seal key, also long enough!!", &tag));
        let changed = [
            RetirementFields {
                partition: "audit_events_p20261206",
                ..r
            },
            RetirementFields {
                retired_at: at + chrono::Duration::microseconds(1),
                ..r
            },
            RetirementFields { events: 11, ..r },
            RetirementFields {
                checkpoints: 3,
                ..r
            },
            RetirementFields { key_id: "a2", ..r },
        ];
        for (i, c) in changed.iter().enumerate() {
            assert!(!c.verify(key, &tag), "field {i} not covered");
        }
    }
}
