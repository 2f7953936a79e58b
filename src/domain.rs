//! Validated request values ("parse, don't validate"): biz types, subjects,
//! fingerprints, request ids, order ids, an operator's release reason. Each
//! newtype can only hold a valid value. Also the closed sets: the token
//! states readers see, and those Postgres stores as enums: the audit kinds,
//! and the order states with their state machine ([`order`]). Pure: nothing here
//! imports the rest of the crate.

pub mod key;
pub mod order;

use std::fmt;

/// Why a value was refused; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// A business type: `[a-z][a-z0-9-]{0,31}`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BizType(String);

impl BizType {
    pub fn parse(s: &str) -> Result<BizType, Invalid> {
        let b = s.as_bytes();
        let ok = !b.is_empty()
            && b.len() <= 32
            && b[0].is_ascii_lowercase()
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-');
        if ok {
            Ok(BizType(s.to_owned()))
        } else {
            Err(Invalid("`biz_type` must match [a-z][a-z0-9-]{0,31}".into()))
        }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BizType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The user a token is bound to: 1 to 128 Unicode characters, no control characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subject(String);

impl Subject {
    pub fn parse(s: &str) -> Result<Subject, Invalid> {
        let n = s.chars().count();
        if n == 0 || n > 128 || s.chars().any(char::is_control) {
            return Err(Invalid(
                "`subject` must be 1 to 128 characters without control characters".into(),
            ));
        }
        Ok(Subject(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn printable_ascii(field: &str, s: &str) -> Result<String, Invalid> {
    if s.is_empty() || s.len() > 128 || !s.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(Invalid(format!(
            "`{field}` must be 1 to 128 printable ASCII characters"
        )));
    }
    Ok(s.to_owned())
}

/// A hash of the business request body, chosen by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(String);

impl Fingerprint {
    pub fn parse(s: &str) -> Result<Fingerprint, Invalid> {
        printable_ascii("fingerprint", s).map(Fingerprint)
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// One attempt of the caller: retries of the same attempt carry the same id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(String);

impl RequestId {
    pub fn parse(s: &str) -> Result<RequestId, Invalid> {
        printable_ascii("request_id", s).map(RequestId)
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An order id: 1 to 64 characters of `[A-Za-z0-9_-]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OrderId(String);

impl OrderId {
    pub fn parse(s: &str) -> Result<OrderId, Invalid> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if ok {
            Ok(OrderId(s.to_owned()))
        } else {
            Err(Invalid(
                "`order_id` must be 1 to 64 characters of [A-Za-z0-9_-]".into(),
            ))
        }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Why an operator released a token (`POST /v1/admin/tokens/{token}/release`):
/// 1 to 500 characters, not only white space, without U+0000 (Postgres
/// cannot store it in the audit event's `jsonb`). Line breaks are allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reason(String);

impl Reason {
    pub fn parse(s: &str) -> Result<Reason, Invalid> {
        let n = s.chars().count();
        if n == 0 || n > 500 || s.trim().is_empty() || s.contains('\0') {
            return Err(Invalid(
                "`reason` must be 1 to 500 characters, not only white space, without U+0000".into(),
            ));
        }
        Ok(Reason(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A token's state as its readers see it (`GET /v1/tokens/{token}`, the
/// admin view). Postgres stores `issued` and `consumed`; `expired` is a token
/// never consumed and past its expiry, or one purged after its retention;
/// `uncertain` a consumed one past its processing lease with neither result
/// nor release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenStatus {
    Issued,
    Consumed,
    Uncertain,
    Expired,
}

impl TokenStatus {
    pub const ALL: [TokenStatus; 4] = [
        TokenStatus::Issued,
        TokenStatus::Consumed,
        TokenStatus::Uncertain,
        TokenStatus::Expired,
    ];

    /// The label in JSON (`state`).
    pub fn as_str(self) -> &'static str {
        match self {
            TokenStatus::Issued => "issued",
            TokenStatus::Consumed => "consumed",
            TokenStatus::Uncertain => "uncertain",
            TokenStatus::Expired => "expired",
        }
    }
}

impl fmt::Display for TokenStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an audit event records (the `audit_kind` enum of V1; order events
/// use the `order.*` ones as their `order_event_kind` too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuditKind {
    TokenIssued,
    TokenConsumed,
    TokenReleased,
    TokenResult,
    KeyConsumed,
    KeyResult,
    KeyReleased,
    OrderCreated,
    OrderPaid,
    OrderRefunded,
    OrderClosed,
    ReconcileRepaired,
    /// A second decision for one generation of a token or key (two deciders
    /// both answered `consumed`): kept, never dropped.
    TokenConflict,
    /// A consumed token whose processing lease ran out with neither result
    /// nor release.
    TokenUncertain,
    /// The same for a client key.
    KeyUncertain,
    /// An operator accepted that a silent fleet member's Redis decisions
    /// are lost (`fleet forget-silent --accept-lost-decisions`).
    FleetForgotten,
    /// A day partition of audit events was dropped under `audit.retention`,
    /// after its events verified against their sealed checkpoints.
    AuditRetired,
}

impl AuditKind {
    pub const ALL: [AuditKind; 17] = [
        AuditKind::TokenIssued,
        AuditKind::TokenConsumed,
        AuditKind::TokenReleased,
        AuditKind::TokenResult,
        AuditKind::KeyConsumed,
        AuditKind::KeyResult,
        AuditKind::KeyReleased,
        AuditKind::OrderCreated,
        AuditKind::OrderPaid,
        AuditKind::OrderRefunded,
        AuditKind::OrderClosed,
        AuditKind::ReconcileRepaired,
        AuditKind::TokenConflict,
        AuditKind::TokenUncertain,
        AuditKind::KeyUncertain,
        AuditKind::FleetForgotten,
        AuditKind::AuditRetired,
    ];

    /// The label in SQL, JSON and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            AuditKind::TokenIssued => "token.issued",
            AuditKind::TokenConsumed => "token.consumed",
            AuditKind::TokenReleased => "token.released",
            AuditKind::TokenResult => "token.result",
            AuditKind::KeyConsumed => "key.consumed",
            AuditKind::KeyResult => "key.result",
            AuditKind::KeyReleased => "key.released",
            AuditKind::OrderCreated => "order.created",
            AuditKind::OrderPaid => "order.paid",
            AuditKind::OrderRefunded => "order.refunded",
            AuditKind::OrderClosed => "order.closed",
            AuditKind::ReconcileRepaired => "reconcile.repaired",
            AuditKind::TokenConflict => "token.conflict",
            AuditKind::TokenUncertain => "token.uncertain",
            AuditKind::KeyUncertain => "key.uncertain",
            AuditKind::FleetForgotten => "fleet.forgotten",
            AuditKind::AuditRetired => "audit.retired",
        }
    }

    pub fn parse(s: &str) -> Option<AuditKind> {
        AuditKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for AuditKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a JSON value holds U+0000 in any string, object keys included, at
/// any depth. Postgres's `jsonb` cannot store it, so a result holding it is
/// refused (400) before any I/O: an accepted result always reaches Postgres.
pub fn json_holds_nul(v: &serde_json::Value) -> bool {
    use serde_json::Value;
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(json_holds_nul),
        Value::Object(map) => map
            .iter()
            .any(|(k, v)| k.contains('\0') || json_holds_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_anywhere_in_a_json_value() {
        use serde_json::json;
        for v in [
            json!("a\u{0}b"),
            json!({"note": "nul\u{0}byte"}),
            json!({"k\u{0}": 1}),
            json!([1, [2, {"x": ["\u{0}"]}]]),
        ] {
            assert!(json_holds_nul(&v), "{v}");
        }
        for v in [json!(null), json!({"a": [1, "b", true]}), json!("\\u0000")] {
            assert!(!json_holds_nul(&v), "{v}");
        }
    }

    #[test]
    fn reasons() {
        assert!(Reason::parse("consumer crashed, ticket OPS-1").is_ok());
        assert!(Reason::parse(&"é".repeat(500)).is_ok());
        assert!(Reason::parse("two\nlines").is_ok());
        for bad in ["", "   ", "\n", "nul\u{0}", &"a".repeat(501)] {
            assert!(Reason::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn audit_kinds_round_trip() {
        for k in AuditKind::ALL {
            assert_eq!(AuditKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(AuditKind::parse("token.burned"), None);
    }

    #[test]
    fn audit_kinds_match_the_sql_enum() {
        let sql = include_str!("../migrations/V1__tokens.sql");
        let start = sql
            .find("CREATE TYPE audit_kind AS ENUM (")
            .expect("audit_kind");
        let body = &sql[start..];
        let body = &body[body.find('(').expect("(") + 1..body.find(");").expect(");")];
        let mut labels: Vec<&str> = body
            .split(',')
            .map(|s| s.trim().trim_matches('\''))
            .collect();
        // Later migrations add labels with `ALTER TYPE ... ADD VALUE`.
        let added = [
            include_str!("../migrations/V6__client_keys.sql"),
            include_str!("../migrations/V11__conflict_and_uncertain_kinds.sql"),
            include_str!("../migrations/V18__fleet_forgotten_audit.sql"),
            include_str!("../migrations/V22__audit_by_token_day.sql"),
        ];
        labels.extend(added.iter().flat_map(|m| m.lines()).filter_map(|l| {
            l.strip_prefix("ALTER TYPE audit_kind ADD VALUE IF NOT EXISTS '")?
                .strip_suffix("';")
        }));
        let mut ours: Vec<&str> = AuditKind::ALL.iter().map(|k| k.as_str()).collect();
        labels.sort_unstable();
        ours.sort_unstable();
        assert_eq!(labels, ours);
    }

    #[test]
    fn biz_types() {
        assert!(BizType::parse("order").is_ok());
        assert!(BizType::parse("a-1").is_ok());
        assert!(BizType::parse(&"a".repeat(32)).is_ok());
        for bad in ["", "Order", "1a", "a_b", &"a".repeat(33), "a b", "é"] {
            assert!(BizType::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn subjects() {
        assert!(Subject::parse("user-42").is_ok());
        assert!(Subject::parse(&"é".repeat(128)).is_ok());
        assert!(Subject::parse(&"é".repeat(129)).is_err());
        assert!(Subject::parse("").is_err());
        assert!(Subject::parse("a\nb").is_err());
    }

    #[test]
    fn ascii_fields() {
        assert!(Fingerprint::parse("sha256:abc").is_ok());
        assert!(Fingerprint::parse("ü").is_err());
        assert!(RequestId::parse(&"r".repeat(129)).is_err());
        assert!(RequestId::parse("req 7").is_ok());
    }
}
