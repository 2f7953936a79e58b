//! Result and release of a consumed token: Redis decides for fast types
//! (the journal carries it to Postgres), Postgres for durable ones.

use serde_json::Value as Json;

use super::degraded::Resync;
use super::{Ledger, LedgerError, ResultAnswer};
use crate::auth::Client;
use crate::config::Durability;
use crate::domain::Subject;
use crate::durable::timed;
use crate::durable::tokens::{self, ReleaseRow, ResultRow, TokenState};
use crate::fast::{FastError, FastWrite};
use crate::journal;

impl Ledger {
    // ---- result -----------------------------------------------------------

    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn record_result(
        &self,
        caller: &Client,
        text: &str,
        subject: &Subject,
        result: &Json,
    ) -> Result<ResultAnswer, LedgerError> {
        let (token, settings) = self.authorize(caller, text, subject, None)?;
        let id = token.claims.id.as_i64();
        let encoded = result.to_string();
        if settings.durability == Durability::Fast {
            let fields = journal::result_fields(id, &encoded);
            match self
                .fast
                .fast_write(&token.text, "result", encoded.clone(), &fields)
                .await
            {
                Ok(FastWrite::Recorded) => return Ok(ResultAnswer::Recorded),
                Ok(FastWrite::Same) => return Ok(ResultAnswer::AlreadyRecorded),
                Ok(FastWrite::Conflict(stored)) => {
                    let stored: Option<Json> = serde_json::from_str(&stored).ok();
                    return if stored.as_ref() == Some(result) {
                        Ok(ResultAnswer::AlreadyRecorded)
                    } else {
                        Err(LedgerError::ResultAlreadySet)
                    };
                }
                Ok(FastWrite::NotConsumed) => return Err(LedgerError::NotConsumed),
                Ok(_) | Err(_) => {} // miss or down: Postgres
            }
        }
        let row = timed(
            &self.metrics,
            "result",
            self.pools
                .bounded(tokens::set_result(&self.pools.hot, id, result)),
        )
        .await
        .map_err(LedgerError::postgres)?;
        match row {
            ResultRow::Recorded => {
                let fast = self.fast.clone();
                let text = token.text.clone();
                tokio::spawn(async move {
                    let _ = fast.settle_result(&text, &encoded).await;
                });
                Ok(ResultAnswer::Recorded)
            }
            ResultRow::Existing(e) if e.state == TokenState::Consumed => match &e.result {
                Some(stored) if stored == result => Ok(ResultAnswer::AlreadyRecorded),
                Some(_) => Err(LedgerError::ResultAlreadySet),
                None => Err(LedgerError::NotConsumed),
            },
            ResultRow::Existing(_) | ResultRow::Unknown => Err(LedgerError::NotConsumed),
        }
    }

    // ---- release ----------------------------------------------------------

    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn release(
        &self,
        caller: &Client,
        text: &str,
        subject: &Subject,
    ) -> Result<(), LedgerError> {
        let (token, settings) = self.authorize(caller, text, subject, None)?;
        let id = token.claims.id.as_i64();
        let remaining = token.claims.expires_at_ms() - self.clock.now_ms();
        if settings.durability == Durability::Fast {
            let fields = journal::release_fields(id);
            match self
                .fast
                .fast_write(&token.text, "release", remaining.to_string(), &fields)
                .await
            {
                // The journal entry carries the release (and its audit row) to Postgres.
                Ok(FastWrite::Released) => return Ok(()),
                Ok(FastWrite::NotReleasable | FastWrite::NotConsumed) => {
                    return Err(LedgerError::NotReleasable)
                }
                Ok(_) => {} // miss: Postgres
                Err(e) => {
                    return Err(LedgerError::Unavailable {
                        what: "redis",
                        retry_after_secs: 1,
                        source: Some(e.into()),
                    })
                }
            }
        } else {
            // Durable: drop Redis's marker first, so that whatever happens
            // next, Postgres answers for this token.
            match self.fast.forget(&token.text).await {
                Ok(()) => {}
                Err(FastError::Down) => {
                    if !self.resync.push(Resync::Forget {
                        token: token.text.clone(),
                    }) {
                        return Err(LedgerError::Unavailable {
                            what: "redis",
                            retry_after_secs: 1,
                            source: None,
                        });
                    }
                }
                Err(e) => {
                    return Err(LedgerError::Unavailable {
                        what: "redis",
                        retry_after_secs: 1,
                        source: Some(e.into()),
                    })
                }
            }
        }
        let row = timed(
            &self.metrics,
            "release",
            self.pools.bounded(tokens::release(&self.pools.hot, id)),
        )
        .await
        .map_err(LedgerError::postgres)?;
        match row {
            ReleaseRow::Released { .. } => {
                // Redis holds `issued` again, so that a consumed marker written
                // late by a consume that raced this release is refused.
                let fast = self.fast.clone();
                let text = token.text.clone();
                tokio::spawn(async move {
                    let _ = fast.set_issued(&text, remaining).await;
                });
                Ok(())
            }
            ReleaseRow::Existing(_) | ReleaseRow::Unknown => Err(LedgerError::NotReleasable),
        }
    }
}
