//! What an earlier consume left behind ([`Prior`], from a Redis marker or a
//! Postgres row) and the answer it gives an attempt ([`classify`],
//! [`answer_from_row`]): the rows of API.md's consume table, pure.

use chrono::{DateTime, Utc};
use serde_json::Value as Json;

use super::super::api::{ConsumeAnswer, ConsumeInput, DuplicateStatus, LedgerError};
use super::super::util::ms_to_time;
use crate::domain::{Fingerprint, RequestId};
use crate::durable::tokens::{ConsumeRow, Existing, TokenState};
use crate::fast::Marker;

/// What an earlier consume left behind, from either tier.
#[derive(Debug, Clone)]
pub(in crate::ledger) struct Prior {
    pub(in crate::ledger) consumed_at: Option<DateTime<Utc>>,
    pub(in crate::ledger) fingerprint: Option<String>,
    request_id: Option<String>,
    pub(in crate::ledger) result: Option<Json>,
    /// Past its processing lease without result or release (policy
    /// `uncertain`): Postgres's sweep marked it, or, for a fast type's
    /// marker, Redis's clock says its lease ran out.
    uncertain: bool,
}

impl Prior {
    pub(in crate::ledger) fn from_marker(m: &Marker) -> Prior {
        Prior {
            consumed_at: ms_to_time(m.at_ms),
            fingerprint: m.fingerprint.clone(),
            request_id: m.request_id.clone(),
            result: m
                .result
                .as_deref()
                .and_then(|r| serde_json::from_str(r).ok()),
            uncertain: false,
        }
    }
    /// The same prior, `uncertain` when `ran_out`.
    pub(in crate::ledger) fn lease_ran_out(mut self, ran_out: bool) -> Prior {
        self.uncertain |= ran_out;
        self
    }
    pub(in crate::ledger) fn from_row(e: &Existing) -> Prior {
        Prior {
            consumed_at: e.consumed_at,
            fingerprint: e.fingerprint.clone(),
            request_id: e.request_id.clone(),
            result: e.result.clone(),
            uncertain: e.uncertain_since.is_some(),
        }
    }
}

/// What the answer to a consume attempt depends on besides the prior:
/// its fingerprint and request id (a token's consume and a key's alike).
pub(in crate::ledger) trait Attempted {
    fn fingerprint(&self) -> Option<&Fingerprint>;
    fn request_id(&self) -> Option<&RequestId>;
}

impl Attempted for ConsumeInput {
    fn fingerprint(&self) -> Option<&Fingerprint> {
        self.fingerprint.as_ref()
    }
    fn request_id(&self) -> Option<&RequestId> {
        self.request_id.as_ref()
    }
}

pub(in crate::ledger) fn same_request<I: Attempted>(prior: &Prior, input: &I) -> bool {
    matches!((&prior.request_id, input.request_id()), (Some(a), Some(b)) if a == b.as_str())
}

/// Decides the answer to an attempt that found an earlier consume.
/// `None`: it cannot be decided from this prior (the same request in flight).
/// `now` stands in for a consume time the prior lacks.
pub(in crate::ledger) fn classify<I: Attempted>(
    prior: &Prior,
    input: &I,
    in_flight: bool,
    now: DateTime<Utc>,
) -> Result<Option<ConsumeAnswer>, LedgerError> {
    // A provisional marker belongs to an attempt whose outcome is not known
    // yet (it may fail, or it may itself be a duplicate that found the token
    // consumed in Postgres). Only a plain duplicate, with no request id or
    // fingerprint to compare, is answered from it; anything that needs the
    // winner's identity goes to Postgres.
    if in_flight && (input.request_id().is_some() || input.fingerprint().is_some()) {
        return Ok(None);
    }
    if let (Some(a), Some(b)) = (&prior.fingerprint, input.fingerprint()) {
        if a != b.as_str() {
            return Err(LedgerError::FingerprintMismatch);
        }
    }
    if same_request(prior, input) {
        return Ok(Some(ConsumeAnswer::Consumed {
            consumed_at: prior.consumed_at.unwrap_or(now),
            replayed: true,
        }));
    }
    let status = if in_flight {
        DuplicateStatus::Processing
    } else if prior.result.is_some() {
        DuplicateStatus::Completed
    } else if prior.uncertain {
        DuplicateStatus::Uncertain
    } else {
        DuplicateStatus::Processing
    };
    Ok(Some(ConsumeAnswer::Duplicate {
        status,
        consumed_at: prior.consumed_at,
        result: if in_flight {
            None
        } else {
            prior.result.clone()
        },
    }))
}

pub(in crate::ledger) fn answer_from_row<I: Attempted>(
    row: &ConsumeRow,
    input: &I,
    now: DateTime<Utc>,
) -> Result<ConsumeAnswer, LedgerError> {
    match row {
        ConsumeRow::Won { consumed_at } => Ok(ConsumeAnswer::Consumed {
            consumed_at: *consumed_at,
            replayed: false,
        }),
        ConsumeRow::Existing(e) if e.state == TokenState::Consumed => {
            classify(&Prior::from_row(e), input, false, now).map(|a| {
                a.unwrap_or(ConsumeAnswer::Duplicate {
                    status: DuplicateStatus::Processing,
                    consumed_at: e.consumed_at,
                    result: None,
                })
            })
        }
        // Unconsumed, and Postgres's now() says it is past its expiry.
        ConsumeRow::Existing(_) | ConsumeRow::Expired => Err(LedgerError::TokenExpired),
    }
}
