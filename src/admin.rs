//! Audit queries shared by the HTTP admin routes and the `audit` CLI
//! ([`Admin`]): what happened to one token or client key, pages of audit events (opaque
//! keyset cursor over `(at, id)`, newest first), the fleet-wide stats and
//! the recorded reconcile runs ([`runs`]).
//! Reads the read pool only ([`crate::durable::Pools::read`]: the admin
//! pool, or `postgres.read_url`'s replica, whose staleness [`replica`]
//! measures); SQL lives in [`crate::durable::admin`].

pub mod order;
pub mod replica;
pub mod runs;

use std::collections::BTreeMap;
use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chrono::{DateTime, SecondsFormat, TimeZone, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value as Json;
use sqlx::PgPool;
use utoipa::ToSchema;

use crate::config::Settings;
use crate::domain::{AuditKind, TokenStatus};
use crate::durable::admin::{self as sql, EventFilter, EventRow};
use crate::durable::tokens::TokenState;
use crate::durable::DurableError;
use crate::fast::breaker::Mode;
use crate::token::TokenCodec;

/// Default and largest page size of `GET /v1/admin/audit` and `audit events`.
pub const DEFAULT_LIMIT: u32 = 100;
pub const MAX_LIMIT: u32 = 1000;
/// At most this many events are listed under one token.
const TOKEN_EVENTS_LIMIT: i64 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("the token is malformed, forged or signed by an unknown key")]
    TokenInvalid,
    #[error("this fleet has no record of the token")]
    TokenNotFound,
    #[error(
        "this fleet has no record of the key (never consumed, or purged with its audit trail)"
    )]
    KeyNotFound,
    #[error("the cursor is not one this service handed out")]
    InvalidCursor,
    #[error("{0}")]
    InvalidRequest(String),
    #[error("postgres")]
    Postgres(#[from] DurableError),
}

/// RFC 3339 UTC with milliseconds, as every time in the API.
pub fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// One of `known`, read back from the API's JSON (`audit --url`): the views
/// keep their fixed texts as `&'static str`.
fn known_str<'de, D: Deserializer<'de>>(
    d: D,
    known: impl IntoIterator<Item = &'static str>,
) -> Result<&'static str, D::Error> {
    let text = String::deserialize(d)?;
    known
        .into_iter()
        .find(|k| *k == text)
        .ok_or_else(|| serde::de::Error::custom(format!("unknown value `{text}`")))
}

/// A fixed text of a view (a kind, a state). An alias, so that serde's
/// derive does not take the field for one borrowed from the input.
pub type FixedText = &'static str;

pub(crate) fn de_kind<'de, D: Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    known_str(d, AuditKind::ALL.map(AuditKind::as_str))
}

pub(crate) fn de_token_state<'de, D: Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    known_str(d, TokenStatus::ALL.map(TokenStatus::as_str))
}

pub(crate) fn de_order_state<'de, D: Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    known_str(
        d,
        crate::domain::order::OrderState::ALL.map(crate::domain::order::OrderState::as_str),
    )
}

/// One audit event as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AuditEvent {
    /// The event id, as a string.
    #[schema(example = "1042")]
    pub id: String,
    #[schema(value_type = String, format = DateTime)]
    pub at: String,
    #[schema(value_type = crate::domain::AuditKind, example = "token.consumed")]
    #[serde(deserialize_with = "de_kind")]
    pub kind: FixedText,
    pub token: Option<String>,
    pub subject: Option<String>,
    pub biz_type: Option<String>,
    pub order_id: Option<String>,
    pub client: Option<String>,
    #[schema(value_type = Object)]
    pub detail: Json,
}

impl From<EventRow> for AuditEvent {
    fn from(e: EventRow) -> AuditEvent {
        AuditEvent {
            id: e.id.to_string(),
            at: time(e.at),
            kind: e.kind.as_str(),
            token: e.token,
            subject: e.subject,
            biz_type: e.biz_type,
            order_id: e.order_id,
            client: e.client,
            detail: e.detail,
        }
    }
}

/// `GET /v1/admin/tokens/{token}` and `audit token`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenView {
    pub token: String,
    pub biz_type: String,
    pub subject: Option<String>,
    pub client: Option<String>,
    /// `issued`, `consumed` or `expired` (never consumed and past its expiry,
    /// or purged after retention).
    #[schema(value_type = crate::domain::TokenStatus, example = "consumed")]
    #[serde(deserialize_with = "de_token_state")]
    pub state: FixedText,
    #[schema(value_type = String, format = DateTime)]
    pub issued_at: String,
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: String,
    #[schema(value_type = Option<String>, format = DateTime)]
    pub consumed_at: Option<String>,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
    /// Any JSON value, as recorded.
    #[schema(schema_with = crate::http::schema::any_json_or_null)]
    pub result: Option<Json>,
    /// Consume attempts answered `duplicate` (flushed every few seconds).
    pub duplicate_attempts: i64,
    /// The token's audit events, oldest first.
    pub events: Vec<AuditEvent>,
}

/// `GET /v1/admin/keys`: the token view's shape, with `key` and `client`
/// instead of `token`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct KeyView {
    pub key: String,
    pub client: String,
    pub biz_type: String,
    /// The subject its first consume named, if any.
    pub subject: Option<String>,
    /// `issued` (released, consumable again), `consumed`, or `expired`
    /// (forgotten after retention: only its audit events remain).
    #[schema(value_type = String, example = "consumed")]
    #[serde(deserialize_with = "de_token_state")]
    pub state: FixedText,
    /// Its first consume.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub issued_at: Option<String>,
    #[schema(value_type = Option<String>, format = DateTime)]
    pub consumed_at: Option<String>,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
    /// Any JSON value, as recorded.
    #[schema(schema_with = crate::http::schema::any_json_or_null)]
    pub result: Option<Json>,
    /// Consume attempts answered `duplicate` (flushed every few seconds).
    pub duplicate_attempts: i64,
    /// The key's audit events, oldest first.
    pub events: Vec<AuditEvent>,
}

/// The audit queries over the read pool (payments never wait behind them).
#[derive(Debug, Clone)]
pub struct Admin {
    pool: PgPool,
    /// Whether `pool` is a replica's (see [`Admin::data_lag`]).
    replica: bool,
    codec: TokenCodec,
    /// The configured biz types: every one shows in the stats, idle or not.
    biz_types: Vec<String>,
}

impl Admin {
    /// Reads `pools.read`.
    pub fn new(settings: &Settings, pools: &crate::durable::Pools) -> Admin {
        Admin {
            pool: pools.read.clone(),
            replica: pools.read_is_replica,
            codec: TokenCodec::new(settings.tokens.signing_keys.clone()),
            biz_types: settings.biz.keys().map(|b| b.to_string()).collect(),
        }
    }

    /// One token: its record and its audit events. `TokenInvalid` for text
    /// that does not verify; `TokenNotFound` when Postgres has neither a
    /// record nor an audit event of it.
    pub async fn token(&self, text: &str) -> Result<TokenView, AdminError> {
        token(&self.pool, &self.codec, text).await
    }

    /// One client key of `client` under `biz`: its record and its audit
    /// events. `KeyNotFound` when Postgres has neither.
    pub async fn key(
        &self,
        client: &str,
        biz: &crate::domain::BizType,
        key: &crate::domain::key::ClientKey,
    ) -> Result<KeyView, AdminError> {
        let id = crate::domain::key::identity(client, biz, key).id;
        let (row, events) = sql::token_story(&self.pool, id, TOKEN_EVENTS_LIMIT).await?;
        let events: Vec<AuditEvent> = events.into_iter().map(AuditEvent::from).collect();
        let view = KeyView {
            key: key.as_str().to_owned(),
            client: client.to_owned(),
            biz_type: biz.to_string(),
            subject: None,
            state: "expired",
            issued_at: None,
            consumed_at: None,
            fingerprint: None,
            request_id: None,
            result: None,
            duplicate_attempts: 0,
            events,
        };
        let Some(row) = row else {
            if view.events.is_empty() {
                return Err(AdminError::KeyNotFound);
            }
            let subject = view.events.iter().find_map(|e| e.subject.clone());
            return Ok(KeyView { subject, ..view });
        };
        Ok(KeyView {
            subject: Some(row.subject).filter(|s| !s.is_empty()),
            state: match row.state {
                TokenState::Consumed => "consumed",
                TokenState::Issued => "issued",
            },
            issued_at: Some(time(row.issued_at)),
            consumed_at: row.consumed_at.map(time),
            fingerprint: row.fingerprint,
            request_id: row.request_id,
            result: row.result,
            duplicate_attempts: row.duplicate_attempts,
            ..view
        })
    }

    /// One page of audit events, newest first.
    pub async fn audit(&self, query: &AuditQuery) -> Result<AuditPage, AdminError> {
        audit(&self.pool, query).await
    }

    /// Fleet-wide counters over `window`; `mode` is this instance's.
    pub async fn stats(&self, window: &Window, mode: Mode) -> Result<Stats, AdminError> {
        stats(&self.pool, window, mode, self.biz_types.iter().cloned()).await
    }
}

async fn token(pool: &PgPool, codec: &TokenCodec, text: &str) -> Result<TokenView, AdminError> {
    let verified = codec.verify(text).map_err(|_| AdminError::TokenInvalid)?;
    let id = verified.claims.id.as_i64();
    let (row, events) = sql::token_story(pool, id, TOKEN_EVENTS_LIMIT).await?;
    let ms = |m: i64| Utc.timestamp_millis_opt(m).single().map(time);
    let Some(row) = row else {
        // Purged after retention: the audit trail still tells its story.
        if events.is_empty() {
            return Err(AdminError::TokenNotFound);
        }
        let consumed = events
            .iter()
            .rev()
            .find(|e| matches!(e.kind, AuditKind::TokenConsumed | AuditKind::TokenReleased))
            .filter(|e| e.kind == AuditKind::TokenConsumed);
        let detail = |k: &str| {
            consumed
                .and_then(|e| e.detail.get(k))
                .and_then(Json::as_str)
                .map(str::to_owned)
        };
        let result = events
            .iter()
            .rev()
            .find(|e| e.kind == AuditKind::TokenResult)
            .and_then(|e| e.detail.get("result").cloned());
        return Ok(TokenView {
            token: text.to_owned(),
            biz_type: verified.claims.biz_type.to_string(),
            subject: events.iter().find_map(|e| e.subject.clone()),
            client: events.iter().find_map(|e| e.client.clone()),
            state: TokenStatus::Expired.as_str(),
            issued_at: ms(verified.claims.issued_at_ms()).unwrap_or_default(),
            expires_at: ms(verified.claims.expires_at_ms()).unwrap_or_default(),
            consumed_at: consumed.map(|e| time(e.at)),
            fingerprint: detail("fingerprint"),
            request_id: detail("request_id"),
            result,
            duplicate_attempts: 0,
            events: events.into_iter().map(AuditEvent::from).collect(),
        });
    };
    let state = match (row.state, row.expired) {
        (TokenState::Consumed, _) if row.result.is_none() && row.uncertain_since.is_some() => {
            TokenStatus::Uncertain
        }
        (TokenState::Consumed, _) => TokenStatus::Consumed,
        (TokenState::Issued, false) => TokenStatus::Issued,
        (TokenState::Issued, true) => TokenStatus::Expired,
    }
    .as_str();
    Ok(TokenView {
        token: row.token,
        biz_type: row.biz_type,
        subject: Some(row.subject),
        client: Some(row.client),
        state,
        issued_at: time(row.issued_at),
        expires_at: time(row.expires_at),
        consumed_at: row.consumed_at.map(time),
        fingerprint: row.fingerprint,
        request_id: row.request_id,
        result: row.result,
        duplicate_attempts: row.duplicate_attempts,
        events: events.into_iter().map(AuditEvent::from).collect(),
    })
}

/// A page request of `GET /v1/admin/audit` / `audit events`, validated.
#[derive(Debug, Clone, Default)]
pub struct AuditQuery {
    pub subject: Option<String>,
    pub biz_type: Option<String>,
    pub order_id: Option<String>,
    /// The acting or owning client (`audit_events.client`).
    pub client: Option<String>,
    /// Any of these kinds; empty: any kind.
    pub kinds: Vec<AuditKind>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    pub limit: u32,
    pub cursor: Option<String>,
}

impl AuditQuery {
    /// Checks the limit (the cursor is checked when decoded).
    pub fn validate(&self) -> Result<(), AdminError> {
        if !(1..=MAX_LIMIT).contains(&self.limit) {
            return Err(AdminError::InvalidRequest(format!(
                "`limit` must be between 1 and {MAX_LIMIT}"
            )));
        }
        // No value stored in the trail holds a control character (subjects,
        // biz types, order ids and client names are validated on the way
        // in), and Postgres refuses a NUL in text outright: such a filter is
        // the caller's mistake, not a 500.
        for (name, value) in [
            ("subject", &self.subject),
            ("biz_type", &self.biz_type),
            ("order_id", &self.order_id),
            ("client", &self.client),
        ] {
            if value
                .as_deref()
                .is_some_and(|v| v.chars().any(char::is_control))
            {
                return Err(AdminError::InvalidRequest(format!(
                    "`{name}` must not contain control characters"
                )));
            }
        }
        Ok(())
    }
}

/// An audit kind named by a caller (`kind` of `GET /v1/admin/audit`).
pub fn parse_kind(text: &str) -> Result<AuditKind, AdminError> {
    AuditKind::parse(text).ok_or_else(|| {
        let all: Vec<&str> = AuditKind::ALL.iter().map(|k| k.as_str()).collect();
        AdminError::InvalidRequest(format!("`kind` must be one of {}", all.join(", ")))
    })
}

/// `GET /v1/admin/audit` and `audit events --format json`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AuditPage {
    pub events: Vec<AuditEvent>,
    /// Pass as `cursor` for the next (older) page; null at the end.
    pub next_cursor: Option<String>,
}

const CURSOR_VERSION: &str = "c1";

/// The cursor: `(at, id)` of the last event handed out, at microsecond
/// precision (Postgres's), base64url so that nobody relies on its layout.
pub fn encode_cursor(at: DateTime<Utc>, id: i64) -> String {
    URL_SAFE_NO_PAD.encode(format!("{CURSOR_VERSION}:{}:{id}", at.timestamp_micros()))
}

pub fn decode_cursor(cursor: &str) -> Result<(DateTime<Utc>, i64), AdminError> {
    let bytes = URL_SAFE_NO_PAD
        .decode(cursor)
        .map_err(|_| AdminError::InvalidCursor)?;
    let text = String::from_utf8(bytes).map_err(|_| AdminError::InvalidCursor)?;
    let mut parts = text.split(':');
    let (Some(CURSOR_VERSION), Some(micros), Some(id), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(AdminError::InvalidCursor);
    };
    let micros: i64 = micros.parse().map_err(|_| AdminError::InvalidCursor)?;
    let id: i64 = id.parse().map_err(|_| AdminError::InvalidCursor)?;
    let at = DateTime::<Utc>::from_timestamp_micros(micros).ok_or(AdminError::InvalidCursor)?;
    Ok((at, id))
}

async fn audit(pool: &PgPool, query: &AuditQuery) -> Result<AuditPage, AdminError> {
    query.validate()?;
    let before = query.cursor.as_deref().map(decode_cursor).transpose()?;
    let filter = EventFilter {
        subject: query.subject.clone(),
        biz_type: query.biz_type.clone(),
        order_id: query.order_id.clone(),
        client: query.client.clone(),
        kinds: query.kinds.clone(),
        since: query.since,
        until: query.until,
        before,
    };
    let limit = i64::from(query.limit);
    let mut rows = sql::events(pool, &filter, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(query.limit as usize);
    let next_cursor = if more {
        rows.last().map(|e| encode_cursor(e.at, e.id))
    } else {
        None
    };
    Ok(AuditPage {
        events: rows.into_iter().map(AuditEvent::from).collect(),
        next_cursor,
    })
}

/// A stats window: `<n>s|m|h|d`, at most 366 days.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub text: String,
    pub duration: Duration,
}

impl Window {
    pub fn parse(text: &str) -> Result<Window, AdminError> {
        let bad = || {
            AdminError::InvalidRequest(
                "`window` must be <n>s, <n>m, <n>h or <n>d (n >= 1, at most 366d), e.g. 1h".into(),
            )
        };
        let unit = text.chars().last().ok_or_else(bad)?;
        let n: u64 = text[..text.len() - unit.len_utf8()]
            .parse()
            .map_err(|_| bad())?;
        let per = match unit {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => return Err(bad()),
        };
        let secs = n.checked_mul(per).ok_or_else(bad)?;
        if n == 0 || secs > 366 * 86_400 || text.starts_with('+') {
            return Err(bad());
        }
        Ok(Window {
            text: text.to_owned(),
            duration: Duration::from_secs(secs),
        })
    }
}

/// Counters of one biz type over the window.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct BizStats {
    pub issued: i64,
    pub consumed: i64,
    pub duplicates: i64,
    /// `duplicates / (consumed + duplicates)`; 0 when both are 0.
    pub duplicate_rate: f64,
    pub expired: i64,
    pub invalid: i64,
}

/// `GET /v1/admin/stats`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Stats {
    #[schema(example = "1h")]
    pub window: String,
    /// This instance's mode: `normal`, `degraded` or `redis_down`.
    #[schema(value_type = crate::fast::breaker::Mode, example = "normal")]
    pub mode: String,
    /// Every configured biz type (zeros when idle), plus any other seen.
    pub biz_types: BTreeMap<String, BizStats>,
}

/// From `stats_minutely` (minute buckets: the oldest minute that overlaps the
/// window counts whole).
async fn stats(
    pool: &PgPool,
    window: &Window,
    mode: Mode,
    configured: impl IntoIterator<Item = String>,
) -> Result<Stats, AdminError> {
    let secs = i64::try_from(window.duration.as_secs()).unwrap_or(i64::MAX);
    let rows = sql::stats(pool, secs).await?;
    let mut biz_types: BTreeMap<String, BizStats> = configured
        .into_iter()
        .map(|b| (b, BizStats::default()))
        .collect();
    for r in rows {
        let seen = r.consumed + r.duplicates;
        biz_types.insert(
            r.biz_type,
            BizStats {
                issued: r.issued,
                consumed: r.consumed,
                duplicates: r.duplicates,
                duplicate_rate: if seen == 0 {
                    0.0
                } else {
                    r.duplicates as f64 / seen as f64
                },
                expired: r.expired,
                invalid: r.invalid,
            },
        );
    }
    Ok(Stats {
        window: window.text.clone(),
        mode: mode.as_str().to_owned(),
        biz_types,
    })
}

/// `24h`, `30m`, `7d` (back from `now`) or an RFC 3339 time: the CLI's
/// `--since`/`--until`.
pub fn parse_time_arg(text: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let d = humantime::parse_duration(text).map_err(|_| {
        format!("`{text}` is neither a duration (24h, 30m, 7d) nor an RFC 3339 time")
    })?;
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .ok_or_else(|| format!("`{text}` reaches too far back"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_round_trips_and_rejects_garbage() {
        let at = DateTime::<Utc>::from_timestamp_micros(1_700_000_000_123_456).unwrap();
        let c = encode_cursor(at, 42);
        assert_eq!(decode_cursor(&c).unwrap(), (at, 42));
        for bad in [
            "",
            "!!",
            "YWJj",
            &URL_SAFE_NO_PAD.encode("c1:x:1"),
            &URL_SAFE_NO_PAD.encode("c1:1:2:3"),
        ] {
            assert!(
                matches!(decode_cursor(bad), Err(AdminError::InvalidCursor)),
                "{bad}"
            );
        }
    }

    #[test]
    fn windows() {
        assert_eq!(
            Window::parse("1h").unwrap().duration,
            Duration::from_secs(3600)
        );
        assert_eq!(
            Window::parse("90s").unwrap().duration,
            Duration::from_secs(90)
        );
        assert_eq!(
            Window::parse("7d").unwrap().duration,
            Duration::from_secs(604_800)
        );
        for bad in [
            "",
            "h",
            "0m",
            "1w",
            "-1h",
            "+1h",
            "1.5h",
            "367d",
            "99999999999999999999d",
        ] {
            assert!(Window::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn time_args() {
        let now = Utc.timestamp_opt(1_800_000_000, 0).unwrap();
        assert_eq!(
            parse_time_arg("24h", now).unwrap(),
            now - chrono::Duration::hours(24)
        );
        assert_eq!(
            parse_time_arg("7d", now).unwrap(),
            now - chrono::Duration::days(7)
        );
        assert_eq!(
            parse_time_arg("2026-01-02T03:04:05Z", now).unwrap(),
            Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap()
        );
        assert!(parse_time_arg("yesterday", now).is_err());
    }
}
