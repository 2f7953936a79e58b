//! What callers of the ledger pass in and get back: the parsed consume
//! request, the answers, and [`LedgerError`], which the HTTP layer maps to a
//! status and code.

use chrono::{DateTime, Utc};
use serde_json::Value as Json;

use crate::domain::{BizType, Fingerprint, RequestId, Subject, TokenStatus};
use crate::durable::DurableError;
use crate::metrics::Stat;

/// Why the ledger refused; the HTTP layer maps each to a status and code.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("the token is malformed, forged or signed by an unknown key")]
    TokenInvalid,
    #[error("the token expired before it was consumed; fetch a new one")]
    TokenExpired,
    #[error("the token was issued to another subject or client, or for another biz type")]
    TokenMismatch,
    #[error("unknown biz type `{0}`")]
    UnknownBizType(String),
    #[error("this client may not use biz type `{0}`")]
    Forbidden(String),
    #[error("the token was consumed earlier with another fingerprint")]
    FingerprintMismatch,
    #[error("a different result is already recorded for this token")]
    ResultAlreadySet,
    #[error("the token is not consumed")]
    NotConsumed,
    #[error("the token cannot be released (not consumed, or it has a result or an order event)")]
    NotReleasable,
    #[error("too many tokens issued for this subject; retry in {retry_after_secs} s")]
    RateLimited { retry_after_secs: u64 },
    #[error("{what} is unavailable; nothing changed, retry")]
    Unavailable {
        what: &'static str,
        retry_after_secs: u64,
        #[source]
        source: Option<anyhow::Error>,
    },
    #[error("internal error")]
    Internal(#[from] anyhow::Error),
}

impl LedgerError {
    /// Postgres unreachable: 503; anything else: 500.
    pub fn postgres(e: DurableError) -> LedgerError {
        if e.is_unavailable() {
            LedgerError::Unavailable {
                what: "postgres",
                retry_after_secs: 1,
                source: Some(e.into()),
            }
        } else {
            LedgerError::Internal(e.into())
        }
    }
}

/// A freshly issued token.
#[derive(Debug, Clone)]
pub struct Issued {
    pub token: String,
    pub biz_type: BizType,
    pub subject: Subject,
    pub expires_at: DateTime<Utc>,
    pub ttl_seconds: u64,
}

/// What a duplicate learns of the attempt that won: still without a result
/// (`processing`: running, or its consumer died), with one (`completed`), or
/// without one past its biz type's processing lease (`uncertain`: the step's
/// outcome is unknown until someone records it or releases the token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DuplicateStatus {
    Processing,
    Completed,
    Uncertain,
}

impl DuplicateStatus {
    pub const ALL: [DuplicateStatus; 3] = [
        DuplicateStatus::Processing,
        DuplicateStatus::Completed,
        DuplicateStatus::Uncertain,
    ];

    /// The label in JSON (`status`).
    pub fn as_str(self) -> &'static str {
        match self {
            DuplicateStatus::Processing => "processing",
            DuplicateStatus::Completed => "completed",
            DuplicateStatus::Uncertain => "uncertain",
        }
    }
}

/// The `outcome` of a consume answer, one per [`ConsumeAnswer`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerOutcome {
    Consumed,
    Duplicate,
}

impl AnswerOutcome {
    pub const ALL: [AnswerOutcome; 2] = [AnswerOutcome::Consumed, AnswerOutcome::Duplicate];

    /// The label in JSON (`outcome`).
    pub fn as_str(self) -> &'static str {
        match self {
            AnswerOutcome::Consumed => "consumed",
            AnswerOutcome::Duplicate => "duplicate",
        }
    }
}

/// The answer to a consume.
#[derive(Debug, Clone, PartialEq)]
pub enum ConsumeAnswer {
    /// This attempt (or an earlier try of the same `request_id`) consumed it.
    Consumed {
        consumed_at: DateTime<Utc>,
        replayed: bool,
    },
    /// Another attempt consumed it.
    Duplicate {
        status: DuplicateStatus,
        consumed_at: Option<DateTime<Utc>>,
        result: Option<Json>,
    },
}

impl ConsumeAnswer {
    pub fn outcome(&self) -> AnswerOutcome {
        match self {
            ConsumeAnswer::Consumed { .. } => AnswerOutcome::Consumed,
            ConsumeAnswer::Duplicate { .. } => AnswerOutcome::Duplicate,
        }
    }
}

/// A consume request, parsed.
#[derive(Debug, Clone)]
pub struct ConsumeInput {
    pub subject: Subject,
    pub biz_type: Option<BizType>,
    pub fingerprint: Option<Fingerprint>,
    pub request_id: Option<RequestId>,
}

/// How a consume attempt ended: the `outcome` label of
/// `ledger_consume_total` (order events count as consumes too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumeOutcome {
    /// First use.
    Consumed,
    /// A retry of the attempt that consumed it (same `request_id`).
    Replayed,
    Duplicate,
    FingerprintMismatch,
    Expired,
    /// Forged, malformed, or never issued by this fleet.
    Invalid,
    /// Bound to another client or subject, or of another biz type.
    Mismatch,
    /// A tier could not decide (503).
    Unavailable,
}

impl ConsumeOutcome {
    pub const ALL: [ConsumeOutcome; 8] = [
        ConsumeOutcome::Consumed,
        ConsumeOutcome::Replayed,
        ConsumeOutcome::Duplicate,
        ConsumeOutcome::FingerprintMismatch,
        ConsumeOutcome::Expired,
        ConsumeOutcome::Invalid,
        ConsumeOutcome::Mismatch,
        ConsumeOutcome::Unavailable,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ConsumeOutcome::Consumed => "consumed",
            ConsumeOutcome::Replayed => "replayed",
            ConsumeOutcome::Duplicate => "duplicate",
            ConsumeOutcome::FingerprintMismatch => "fingerprint_mismatch",
            ConsumeOutcome::Expired => "expired",
            ConsumeOutcome::Invalid => "invalid",
            ConsumeOutcome::Mismatch => "mismatch",
            ConsumeOutcome::Unavailable => "unavailable",
        }
    }

    /// The fleet-wide stats counter (`/v1/admin/stats`) it also counts in.
    pub fn stat(self) -> Option<Stat> {
        match self {
            ConsumeOutcome::Consumed => Some(Stat::Consumed),
            ConsumeOutcome::Duplicate => Some(Stat::Duplicate),
            ConsumeOutcome::Expired => Some(Stat::Expired),
            ConsumeOutcome::Invalid => Some(Stat::Invalid),
            ConsumeOutcome::Replayed
            | ConsumeOutcome::FingerprintMismatch
            | ConsumeOutcome::Mismatch
            | ConsumeOutcome::Unavailable => None,
        }
    }
}

/// What a token's own client (or an admin) reads of it
/// (`GET /v1/tokens/{token}`): a read that changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenReading {
    pub biz_type: BizType,
    pub state: TokenStatus,
    pub expires_at: DateTime<Utc>,
    pub consumed_at: Option<DateTime<Utc>>,
    pub result: Option<Json>,
}

/// Whether a result was recorded now or had been already (same value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultAnswer {
    Recorded,
    AlreadyRecorded,
}
