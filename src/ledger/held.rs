//! What a consume, result or release acts on: a signed token or a client
//! key ([`Held`]), and what differs between the two in a consume ([`Of`]).
//! Everything else about the protocol is one implementation over them.

use crate::config::Durability;
use crate::domain::Subject;
use crate::durable::tokens::TokenRecord;

/// A token, or a client key, as the tiers know it.
pub(super) struct Held {
    /// The hash tag of its Redis key: the token text, or the key's handle.
    pub(super) handle: String,
    /// Its row (the id, and what a journal entry carries).
    pub(super) record: TokenRecord,
    pub(super) durability: Durability,
    /// Until when its issued state lives in Redis after a release, ms since
    /// the epoch: a token's expiry; for a key, `redis.consumed_ttl` from now.
    pub(super) issued_until_ms: i64,
    /// The `request_id` of the consume a result or release belongs to, when
    /// the caller names it: the call then applies only while that consume
    /// holds the token (not after a release and another consume).
    pub(super) of_request: Option<String>,
}

/// What a consume of a token does differently from a consume of a key.
#[derive(Debug, Clone, Copy)]
pub(super) enum Of<'a> {
    /// A signed token. `expired`: past its embedded expiry by our clock, so
    /// Redis is only looked at (nothing is claimed or decided there) and
    /// Postgres says whether it was consumed.
    Token { expired: bool },
    /// A client key. `subject`: the one the call names, which must be the
    /// one the key was created with. Redis does not hold a key it lost: the
    /// key is looked up in Postgres and created again at its generation.
    /// A key is never expired: a row found unconsumed was released
    /// meanwhile (retry).
    Key { subject: Option<&'a Subject> },
}

impl<'a> Of<'a> {
    pub(super) fn expired(self) -> bool {
        matches!(self, Of::Token { expired: true })
    }

    /// Whether a Redis marker may answer without Postgres: markers do not
    /// carry a key's subject, so a call that names one is answered by
    /// Postgres.
    pub(super) fn markers_answer(self) -> bool {
        !matches!(self, Of::Key { subject: Some(_) })
    }

    /// The subject a fast consume asks Redis to check (a key's).
    pub(super) fn subject(self) -> Option<&'a str> {
        match self {
            Of::Key { subject } => subject.map(Subject::as_str),
            Of::Token { .. } => None,
        }
    }
}
