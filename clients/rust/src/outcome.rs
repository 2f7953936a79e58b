//! The answers shared by tokens and keys: the consume outcome a caller must
//! match, and the acknowledgements of a result and a release.

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::Value;

use crate::client::Answer;
use crate::error::Error;

/// An RFC 3339 time from the ledger.
pub type Timestamp = DateTime<Utc>;

/// What a consume answered. Match it: only [`ConsumeOutcome::Won`] lets you
/// run the business step. The crate's documentation has the decision table.
#[must_use = "only `Won` lets you run the business step: match the outcome"]
#[derive(Debug, Clone, PartialEq)]
pub enum ConsumeOutcome {
    /// This logical attempt consumed it: run the business step now, then
    /// record its result (or release it when the step failed before any side
    /// effect). `replayed` is true when an earlier try of this same attempt
    /// (same `request_id`) won and its answer was lost: you are still the
    /// winner.
    Won {
        replayed: bool,
        consumed_at: Timestamp,
    },
    /// Another attempt consumed it and has recorded no result yet: it is
    /// running, or it died (then an operator releases it). Do not run the
    /// step; answer "in progress" and ask again later.
    InProgress { consumed_at: Option<Timestamp> },
    /// Another attempt consumed it, and the biz type's processing lease ran
    /// out with neither result nor release: whether its step had its effect
    /// is unknown until its consumer or an operator records the result or
    /// releases it. Do not run the step, and do not retry with a new token
    /// or key: answer "being checked" and ask again later.
    Uncertain { consumed_at: Option<Timestamp> },
    /// Another attempt consumed it and recorded this result: do not run the
    /// step; answer with this result as if you had run it.
    Completed {
        result: Value,
        consumed_at: Option<Timestamp>,
    },
}

impl ConsumeOutcome {
    /// Whether this attempt may run the business step.
    pub fn is_won(&self) -> bool {
        matches!(self, ConsumeOutcome::Won { .. })
    }

    pub(crate) fn from_answer(answer: &Answer) -> Result<ConsumeOutcome, Error> {
        #[derive(Deserialize)]
        #[serde(tag = "outcome", rename_all = "lowercase")]
        enum Wire {
            Consumed {
                consumed_at: Timestamp,
            },
            Duplicate {
                status: DuplicateStatus,
                #[serde(default)]
                consumed_at: Option<Timestamp>,
                #[serde(default)]
                result: Option<Value>,
            },
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "lowercase")]
        enum DuplicateStatus {
            Processing,
            Completed,
            Uncertain,
        }
        Ok(match answer.json::<Wire>()? {
            Wire::Consumed { consumed_at } => ConsumeOutcome::Won {
                replayed: answer.replayed,
                consumed_at,
            },
            Wire::Duplicate {
                status: DuplicateStatus::Processing,
                consumed_at,
                ..
            } => ConsumeOutcome::InProgress { consumed_at },
            Wire::Duplicate {
                status: DuplicateStatus::Uncertain,
                consumed_at,
                ..
            } => ConsumeOutcome::Uncertain { consumed_at },
            Wire::Duplicate {
                status: DuplicateStatus::Completed,
                consumed_at,
                result,
            } => ConsumeOutcome::Completed {
                // A recorded `null` reads back as an absent key.
                result: result.unwrap_or(Value::Null),
                consumed_at,
            },
        })
    }
}

/// A result was recorded. `replayed`: this very result was already recorded
/// (by an earlier try whose answer was lost, or an earlier call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    pub replayed: bool,
}

/// A consumed token (key) was given back: it can be consumed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released;

/// The state of a token or key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum State {
    /// Not consumed (issued and unexpired; a key: released).
    Issued,
    Consumed,
    /// Consumed, with neither result nor release past its biz type's
    /// processing lease.
    Uncertain,
    /// Never consumed and past its expiry.
    Expired,
    /// A state this version of the client does not know.
    #[serde(other)]
    Other,
}

pub(crate) fn expect_outcome(answer: &Answer, want: &str) -> Result<(), Error> {
    #[derive(Deserialize)]
    struct Wire {
        outcome: String,
    }
    let wire: Wire = answer.json()?;
    if wire.outcome == want {
        Ok(())
    } else {
        Err(Error::Decode {
            status: answer.status,
            source: serde::de::Error::custom(format!(
                "expected outcome {want:?}, got {:?}",
                wire.outcome
            )),
        })
    }
}
