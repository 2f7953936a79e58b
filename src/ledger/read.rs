//! A token's state, read without changing anything (`GET /v1/tokens/{token}`):
//! "did my payment go through?". The read never consumes, never counts as
//! a duplicate or as a consume attempt (a refused token is not counted in
//! `ledger_consume_total` nor in the fleet's stats), and never writes to
//! either tier.
//!
//! Durable biz types are answered by Postgres, which decides them. Fast ones
//! by Redis, which decides them (Postgres learns them through the journal, a
//! moment later); when Redis does not hold the token (it expired there, or
//! Redis lost it) or cannot be reached, by Postgres. Expiry is judged by the
//! clock of the tier that answers, as a consume would.

use chrono::{DateTime, Utc};
use serde_json::Value as Json;

use super::api::{LedgerError, TokenReading};
use super::core::Ledger;
use super::lease::ran_out;
use super::util::ms_to_time;
use crate::auth::Client;
use crate::config::{Durability, ProcessingLease};
use crate::domain::{Subject, TokenStatus};
use crate::durable::timed;
use crate::durable::tokens::{self, Existing, TokenState};
use crate::fast::Peek;
use crate::token::VerifiedToken;

impl Ledger {
    /// Reads a token's state for `caller`: the client it was issued to, with
    /// the subject it is bound to (`subject`), or an admin or auditor (whose
    /// `subject`, if any, is not checked: they read every token). The token
    /// checks are those of a consume: `TokenInvalid`, `UnknownBizType`,
    /// `Forbidden`, `TokenMismatch`; a token past its expiry is no error
    /// but the state `expired`.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn read(
        &self,
        caller: &Client,
        text: &str,
        subject: Option<&Subject>,
    ) -> Result<TokenReading, LedgerError> {
        let (token, settings) = self.verifier.authorize_read_as(caller, text)?;
        if !caller.reads_all() {
            let Some(subject) = subject else {
                return Err(LedgerError::InvalidRequest(
                    "`subject` is required: the user the token was issued to".into(),
                ));
            };
            if !self.verifier.is_bound(&token, caller, subject) {
                return Err(LedgerError::TokenMismatch);
            }
        }
        if settings.durability == Durability::Fast {
            if let Some(reading) = self.read_fast_in_redis(&token, settings.lease).await {
                return Ok(reading);
            }
        }
        self.read_in_postgres(&token).await
    }

    /// A fast token as Redis holds it; `None`: Redis does not know it, or
    /// cannot be asked (Postgres answers then).
    async fn read_fast_in_redis(
        &self,
        token: &VerifiedToken,
        lease: Option<ProcessingLease>,
    ) -> Option<TokenReading> {
        // `peek` only reads: it writes nothing, whatever it finds.
        let reply = self.fast.peek(&token.text).await;
        let (outcome, version) = match reply {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "redis not read; postgres answers");
                return None;
            }
        };
        let expires_at = self.expires_at(token);
        match outcome {
            Peek::Consumed(m) => Some(TokenReading {
                biz_type: token.claims.biz_type.clone(),
                state: if m.result.is_none() && ran_out(lease, m.at_ms, version.now_ms) {
                    TokenStatus::Uncertain
                } else {
                    TokenStatus::Consumed
                },
                expires_at,
                consumed_at: ms_to_time(m.at_ms),
                result: m
                    .result
                    .as_deref()
                    .and_then(|r| serde_json::from_str::<Json>(r).ok()),
            }),
            Peek::Issued => Some(TokenReading {
                biz_type: token.claims.biz_type.clone(),
                state: if token.claims.expires_at_ms() <= version.now_ms {
                    TokenStatus::Expired
                } else {
                    TokenStatus::Issued
                },
                expires_at,
                consumed_at: None,
                result: None,
            }),
            // A provisional marker (not a fast type's), or no key.
            Peek::Provisional(_) | Peek::Miss => None,
        }
    }

    async fn read_in_postgres(&self, token: &VerifiedToken) -> Result<TokenReading, LedgerError> {
        let (now, row) = timed(
            &self.metrics,
            "read",
            self.pools
                .bounded(tokens::read(&self.pools.hot, token.claims.id.as_i64())),
        )
        .await
        .map_err(LedgerError::postgres)?;
        Ok(reading_of_row(
            token,
            self.expires_at(token),
            now,
            row.as_ref(),
        ))
    }

    fn expires_at(&self, token: &VerifiedToken) -> DateTime<Utc> {
        ms_to_time(token.claims.expires_at_ms()).unwrap_or_else(|| self.clock.now())
    }
}

/// What a Postgres row (or its absence) says, `now` being Postgres's clock.
/// No row: the issuance record is still on its way (issued, while the token
/// lives) or was purged after its retention (expired).
fn reading_of_row(
    token: &VerifiedToken,
    expires_at: DateTime<Utc>,
    now: DateTime<Utc>,
    row: Option<&Existing>,
) -> TokenReading {
    let biz_type = token.claims.biz_type.clone();
    match row {
        Some(e) if e.state == TokenState::Consumed => TokenReading {
            biz_type,
            state: if e.result.is_none() && e.uncertain_since.is_some() {
                TokenStatus::Uncertain
            } else {
                TokenStatus::Consumed
            },
            expires_at: e.expires_at,
            consumed_at: e.consumed_at,
            result: e.result.clone(),
        },
        Some(e) => TokenReading {
            biz_type,
            state: if e.expires_at <= now {
                TokenStatus::Expired
            } else {
                TokenStatus::Issued
            },
            expires_at: e.expires_at,
            consumed_at: None,
            result: None,
        },
        None => TokenReading {
            biz_type,
            state: if expires_at <= now {
                TokenStatus::Expired
            } else {
                TokenStatus::Issued
            },
            expires_at,
            consumed_at: None,
            result: None,
        },
    }
}
