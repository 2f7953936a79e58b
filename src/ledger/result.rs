//! Result and release of a consumed token or client key (a client's, or an
//! operator's release of a token stuck in `processing`): Redis decides for fast types
//! (the journal carries it to Postgres), Postgres for durable ones.
//!
//! Read your writes: a result recorded in Postgres is written to Redis
//! (the consumed marker at its generation, result included) before the
//! answer, so every later duplicate, on any instance, answers `completed`.
//! The results one batch recorded reach Redis together, in the pipelines of
//! the write-backs (`settle`).
//! When that write fails, the answer waits until the token's consume is
//! older than `redis.processing_trust`: from then on a marker without a
//! result no longer answers `processing` alone (Postgres is asked), and the
//! write is queued for when Redis answers.

use crate::durable::fleet as fleet_store;
use std::time::Duration;

use serde_json::Value as Json;

use super::api::{LedgerError, ResultAnswer};
use super::core::Ledger;
use super::held::Held;
use super::resync::Resync;
use super::util::{ms, ms_to_time, Tally};
use crate::auth::Client;
use crate::config::Durability;
use crate::domain::{Reason, RequestId, Subject};
use crate::durable::timed;
use crate::durable::tokens::{self, Existing, ReleaseRow, ResultDecided, TokenRecord, TokenState};
use crate::fast::{ConsumedWrite, FastError, Marker, Peek, ReleaseWrite, ResultWrite};
use crate::fleet::FleetState;
use crate::journal;
use crate::token::VerifiedToken;

/// The consumed marker of a Postgres row (its result included).
fn marker_of_row(e: &Existing) -> Marker {
    Marker::from(e)
}

impl Ledger {
    // ---- result -----------------------------------------------------------

    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn record_result(
        &self,
        caller: &Client,
        text: &str,
        subject: &Subject,
        result: &Json,
        of_request: Option<&RequestId>,
    ) -> Result<ResultAnswer, LedgerError> {
        let (token, settings) = self.verifier.authorize(caller, text, subject, None)?;
        let held = Held {
            handle: token.text.clone(),
            record: self
                .verifier
                .record_for(&token, settings.durability, caller, subject),
            durability: settings.durability,
            issued_until_ms: token.claims.expires_at_ms(),
            of_request: of_request.map(|r| r.as_str().to_owned()),
        };
        self.record_result_of(&held, result).await
    }

    /// Records the result of a token or key (see [`Held`]): Redis decides
    /// for fast types, Postgres for durable ones (and for fast ones Redis
    /// does not know).
    pub(super) async fn record_result_of(
        &self,
        held: &Held,
        result: &Json,
    ) -> Result<ResultAnswer, LedgerError> {
        self.record_result_as(held, result, None).await
    }

    /// [`Ledger::record_result_of`], by an operator when `operator` holds
    /// `(by, reason)`: they go into the result's audit row.
    pub(super) async fn record_result_as(
        &self,
        held: &Held,
        result: &Json,
        operator: Option<(&str, &str)>,
    ) -> Result<ResultAnswer, LedgerError> {
        let answer = self.record_result_in_tiers(held, result, operator).await;
        if matches!(answer, Ok(ResultAnswer::Recorded)) {
            // Waiting consumes of it answer `completed` now.
            self.changes.changed(held.record.id);
        }
        answer
    }

    async fn record_result_in_tiers(
        &self,
        held: &Held,
        result: &Json,
        operator: Option<(&str, &str)>,
    ) -> Result<ResultAnswer, LedgerError> {
        let id = held.record.id;
        let encoded = result.to_string();
        let detail = operator.map(|(by, reason)| serde_json::json!({"by": by, "reason": reason}));
        if held.durability == Durability::Fast {
            let fleet = self.fleet.view();
            if fleet.state == FleetState::RedisDown {
                // Postgres decides while the fleet has Redis down, also here,
                // where Redis answers: a consumed marker there may be a
                // script's that ran after its caller gave up on it (see
                // `crate::fleet`), and a result recorded onto it would carry
                // that caller's request_id to Postgres with the result's
                // journal entry. Fenced: if the episode ended meanwhile,
                // Redis may hold a consume Postgres has not heard of, and
                // Redis decides (below).
                if let Some(row) = self
                    .result_fenced(held, result, detail.as_ref(), fleet.epoch)
                    .await?
                {
                    return self.result_answer(row, held, result).await;
                }
            }
            let mut fields = journal::result_fields_for(&held.record, &encoded);
            if let Some((by, reason)) = operator {
                fields.set_operator(by, reason);
            }
            // Redis decides only through this instance's gate, as for a
            // consume: with the gate closed, Redis may not be the decider
            // (the fleet may have turned `redis_down` without this instance
            // hearing of it), and its marker may not know the consume.
            let Some(gate) = self.fleet.redis_may_decide() else {
                return self.result_without_redis(held, result, detail, None).await;
            };
            let reply = self
                .fast
                .write_result(
                    &held.handle,
                    encoded.clone(),
                    held.of_request.as_deref(),
                    &fields,
                    Some(gate.dataset()),
                )
                .await;
            let in_time = gate.still_held();
            drop(gate);
            if !in_time && !matches!(reply, Err(FastError::Down)) {
                return Err(LedgerError::Unavailable {
                    what: "fleet membership ran out during the result (outcome unknown; retry)",
                    retry_after_secs: 1,
                    source: None,
                });
            }
            match reply {
                Ok(ResultWrite::Recorded) => return Ok(ResultAnswer::Recorded),
                Ok(ResultWrite::Same) => return Ok(ResultAnswer::AlreadyRecorded),
                Ok(ResultWrite::Conflict(stored)) => {
                    let stored: Option<Json> = serde_json::from_str(&stored).ok();
                    return if stored.as_ref() == Some(result) {
                        Ok(ResultAnswer::AlreadyRecorded)
                    } else {
                        Err(LedgerError::ResultAlreadySet)
                    };
                }
                Ok(ResultWrite::NotConsumed) => return Err(LedgerError::NotConsumed),
                Ok(ResultWrite::Miss) => {} // Postgres decides
                // Redis restarted empty: the consume may be in a journal
                // Postgres has not seen yet; nobody decides until the
                // fleet has accounted for it (see `crate::fleet`).
                Ok(ResultWrite::Foreign) => {
                    self.fleet.redis_foreign();
                    return Err(LedgerError::Unavailable {
                        what: "redis (it holds another dataset than the fleet agreed on: it restarted empty; retry)",
                        retry_after_secs: 1,
                        source: None,
                    });
                }
                Err(e) => {
                    return self
                        .result_without_redis(held, result, detail, Some(e))
                        .await
                }
            }
        }
        let row = timed(
            &self.metrics,
            "result",
            self.finisher
                .result(id, result, detail.as_ref(), held.of_request.as_deref()),
        )
        .await
        .map_err(LedgerError::postgres)?;
        self.result_answer(row, held, result).await
    }

    /// A fast type's result when Redis may not decide it here (`cause`: the
    /// call that failed; `None`: the gate is closed): Postgres decides under
    /// the fleet's fence if the fleet has Redis down, else 503.
    async fn result_without_redis(
        &self,
        held: &Held,
        result: &Json,
        detail: Option<Json>,
        cause: Option<FastError>,
    ) -> Result<ResultAnswer, LedgerError> {
        let fenced = match self.fleet.postgres_may_decide().await {
            Some(epoch) => {
                self.result_fenced(held, result, detail.as_ref(), epoch)
                    .await?
            }
            None => None,
        };
        match fenced {
            Some(row) => self.result_answer(row, held, result).await,
            None => Err(LedgerError::Unavailable {
                what: "redis may not decide here now (unreachable from this instance, or its fleet membership is not fresh), and the fleet has not agreed that it is down; retry",
                retry_after_secs: 1,
                source: cause.map(Into::into),
            }),
        }
    }

    /// A fast type's result decided by Postgres while the fleet has Redis
    /// down at `epoch` (see [`fleet_store::set_result_fenced`]); `None`:
    /// the fleet is no longer there.
    async fn result_fenced(
        &self,
        held: &Held,
        result: &Json,
        detail: Option<&Json>,
        epoch: i64,
    ) -> Result<Option<ResultDecided>, LedgerError> {
        timed(
            &self.metrics,
            "result",
            self.pools.bounded(fleet_store::set_result_fenced(
                &self.pools.hot,
                epoch,
                held.record.id,
                &held.handle,
                result,
                detail,
                held.of_request.as_deref(),
            )),
        )
        .await
        .map_err(LedgerError::postgres)
    }

    /// The answer to a result Postgres decided.
    async fn result_answer(
        &self,
        row: ResultDecided,
        held: &Held,
        result: &Json,
    ) -> Result<ResultAnswer, LedgerError> {
        match row {
            ResultDecided::Recorded(e) => {
                self.result_to_redis(&held.handle, &e).await;
                Ok(ResultAnswer::Recorded)
            }
            // Consumed by another attempt than the one the caller names (its
            // consume was released and the token consumed again).
            ResultDecided::Existing(e)
                if held
                    .of_request
                    .as_deref()
                    .is_some_and(|rid| e.request_id.as_deref() != Some(rid)) =>
            {
                Err(LedgerError::NotConsumed)
            }
            ResultDecided::Existing(e) if e.state == TokenState::Consumed => match &e.result {
                Some(stored) if stored == result => {
                    // Heals a marker whose earlier write failed, off the path.
                    self.catch_up.write_back(ConsumedWrite {
                        token: held.handle.clone(),
                        gen: e.gen,
                        marker: marker_of_row(&e),
                    });
                    Ok(ResultAnswer::AlreadyRecorded)
                }
                Some(_) => Err(LedgerError::ResultAlreadySet),
                None => Err(LedgerError::NotConsumed),
            },
            ResultDecided::Existing(_) | ResultDecided::Unknown => Err(LedgerError::NotConsumed),
        }
    }

    /// Writes a result Postgres recorded to Redis before the answer (see the
    /// module docs); when that fails, queues it and waits out the trust in a
    /// marker without a result.
    async fn result_to_redis(&self, handle: &str, e: &Existing) {
        let marker = marker_of_row(e);
        let write = ConsumedWrite {
            token: handle.to_owned(),
            gen: e.gen,
            marker: marker.clone(),
        };
        match self.catch_up.write_now(write).await {
            Ok(_) => {}
            Err(err) => {
                tracing::debug!(error = %err, "result not written to redis; queued, waiting out the marker's trust");
                self.catch_up.queue(Resync::Consumed {
                    token: handle.to_owned(),
                    gen: e.gen,
                    marker: marker.clone(),
                });
                let trust = ms(self.settings.redis.processing_trust);
                // A little beyond the trust, for the clocks of Postgres
                // (consumed_at) and Redis (which judges the marker's age).
                let wait = marker.at_ms + trust + 50 - self.clock.now_ms();
                if wait > 0 {
                    tokio::time::sleep(Duration::from_millis(wait.unsigned_abs())).await;
                }
            }
        }
    }

    // ---- release ----------------------------------------------------------

    /// A client gives back a token it consumed: see [`Ledger::release_verified`].
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn release(
        &self,
        caller: &Client,
        text: &str,
        subject: &Subject,
        of_request: Option<&RequestId>,
    ) -> Result<(), LedgerError> {
        let (token, settings) = self.verifier.authorize(caller, text, subject, None)?;
        let held = Held {
            handle: token.text.clone(),
            record: self
                .verifier
                .record_for(&token, settings.durability, caller, subject),
            durability: settings.durability,
            issued_until_ms: token.claims.expires_at_ms(),
            of_request: of_request.map(|r| r.as_str().to_owned()),
        };
        self.release_of(&held).await
    }

    /// An operator frees a token stuck in `processing` (its consumer died
    /// before recording a result or releasing it): the rule of a client's
    /// release, for any client's token, audited as `token.released` with
    /// `{"by": <the acting client's name>, "reason": ...}`. A refused token is not counted as
    /// a consume attempt.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn release_by_admin(
        &self,
        caller: &Client,
        text: &str,
        reason: &Reason,
    ) -> Result<(), LedgerError> {
        let (token, settings) = self
            .verifier
            .authorize_unbound_as(caller, text, Tally::Quiet)?;
        let (record, fields) = match settings.durability {
            Durability::Fast => {
                let record = self.recorded_owner(&token).await?;
                let fields =
                    journal::admin_release_fields_for(&record, &caller.name, reason.as_str());
                (record, Some(fields))
            }
            // Postgres decides and knows the owner: the record's id is all
            // the release needs.
            Durability::Durable => (self.unowned_record(&token, settings.durability), None),
        };
        let held = Held {
            handle: token.text.clone(),
            record,
            durability: settings.durability,
            issued_until_ms: token.claims.expires_at_ms(),
            of_request: None,
        };
        let detail = serde_json::json!({"by": caller.name, "reason": reason.as_str()});
        self.release_held(&held, fields, Some(&detail)).await
    }

    /// An operator records the outcome of a consumed token that has none
    /// (typically an uncertain one, after checking the payment provider):
    /// the rule of a client's result, for any client's token, audited as
    /// `token.result` with `{"by": <the acting client's name>, "reason"}`.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn record_result_by_admin(
        &self,
        caller: &Client,
        text: &str,
        result: &Json,
        reason: &Reason,
    ) -> Result<ResultAnswer, LedgerError> {
        let (token, settings) = self
            .verifier
            .authorize_unbound_as(caller, text, Tally::Quiet)?;
        let record = match settings.durability {
            Durability::Fast => self.recorded_owner(&token).await?,
            Durability::Durable => self.unowned_record(&token, settings.durability),
        };
        let held = Held {
            handle: token.text.clone(),
            record,
            durability: settings.durability,
            issued_until_ms: token.claims.expires_at_ms(),
            of_request: None,
        };
        self.record_result_as(&held, result, Some((&caller.name, reason.as_str())))
            .await
    }

    /// A fast token's record for its release's journal entry, which needs
    /// whom it was issued to: an operator does not say, and the token binds
    /// them without naming them, so Postgres's issuance record does. Without
    /// one, a token Redis holds consumed has its record still on its way
    /// (503, retry); any other is not releasable.
    async fn recorded_owner(&self, token: &VerifiedToken) -> Result<TokenRecord, LedgerError> {
        let id = token.claims.id.as_i64();
        let owner = timed(
            &self.metrics,
            "owner",
            self.pools.bounded(tokens::owner(&self.pools.hot, id)),
        )
        .await
        .map_err(LedgerError::postgres)?;
        let Some((subject, client)) = owner else {
            let peek = self.fast.peek(&token.text).await;
            return Err(match peek {
                Ok((Peek::Consumed(_), _)) => LedgerError::Unavailable {
                    what: "the token's record (not in postgres yet)",
                    retry_after_secs: 1,
                    source: None,
                },
                _ => LedgerError::NotReleasable,
            });
        };
        let c = &token.claims;
        Ok(TokenRecord {
            id,
            token: token.text.clone(),
            biz_type: c.biz_type.to_string(),
            durability: Durability::Fast,
            subject,
            client,
            issued_at: ms_to_time(c.issued_at_ms()).unwrap_or_else(|| self.clock.now()),
            expires_at: ms_to_time(c.expires_at_ms()).unwrap_or_else(|| self.clock.now()),
            key: None,
        })
    }

    /// Releases a token or key (see [`Held`]).
    pub(super) async fn release_of(&self, held: &Held) -> Result<(), LedgerError> {
        self.release_held(held, None, None).await
    }

    /// A durable token's record for an operator's release, who names no
    /// subject: Postgres decides by the id and knows the owner, so only the
    /// id is used (no journal entry is written for a durable type).
    fn unowned_record(&self, token: &VerifiedToken, durability: Durability) -> TokenRecord {
        let c = &token.claims;
        TokenRecord {
            id: c.id.as_i64(),
            token: token.text.clone(),
            biz_type: c.biz_type.to_string(),
            durability,
            subject: String::new(),
            client: String::new(),
            issued_at: ms_to_time(c.issued_at_ms()).unwrap_or_else(|| self.clock.now()),
            expires_at: ms_to_time(c.expires_at_ms()).unwrap_or_else(|| self.clock.now()),
            key: None,
        }
    }

    /// Returns a consumed token or key with no result and no order event to
    /// unconsumed. Fast types: Redis decides, and the journal entry (`fields`,
    /// by default the release of the held record) carries the release to
    /// Postgres; when Redis does not hold it, Postgres decides. Durable
    /// types: Postgres decides. `detail` goes into the audit row.
    pub(super) async fn release_held(
        &self,
        held: &Held,
        fields: Option<crate::fast::Record>,
        detail: Option<&Json>,
    ) -> Result<(), LedgerError> {
        let released = self.release_in_tiers(held, fields, detail).await;
        if released.is_ok() {
            // Waiting consumes of it may consume it now.
            self.changes.changed(held.record.id);
        }
        released
    }

    async fn release_in_tiers(
        &self,
        held: &Held,
        fields: Option<crate::fast::Record>,
        detail: Option<&Json>,
    ) -> Result<(), LedgerError> {
        let id = held.record.id;
        let expires_at_ms = held.issued_until_ms;
        let remaining = expires_at_ms - self.clock.now_ms();
        if held.durability == Durability::Fast {
            let fields = fields.unwrap_or_else(|| journal::release_fields_for(&held.record));
            // Through the gate, as a consume and a result (see above).
            let Some(gate) = self.fleet.redis_may_decide() else {
                return Err(LedgerError::Unavailable {
                    what: "redis may not decide here now (unreachable from this instance, or its fleet membership is not fresh); retry",
                    retry_after_secs: 1,
                    source: None,
                });
            };
            // Cooling for `redis.timeout` after it (see `FastTier::release`).
            let reply = self
                .fast
                .release(
                    &held.handle,
                    remaining,
                    held.of_request.as_deref(),
                    &fields,
                    Some(gate.dataset()),
                )
                .await;
            // A release Redis decided is recorded for the going-down flush,
            // as a consume is: Postgres must know it before it decides.
            if let Ok(ReleaseWrite::Released { gen, at_ms }) = &reply {
                self.fleet
                    .decided_in_redis(&gate, journal::decided(fields.clone(), *gen, *at_ms));
            }
            let in_time = gate.still_held();
            drop(gate);
            if !in_time && reply.is_ok() {
                return Err(LedgerError::Unavailable {
                    what: "fleet membership ran out during the release (outcome unknown; retry)",
                    retry_after_secs: 1,
                    source: None,
                });
            }
            match reply {
                // The journal entry carries the release (and its audit row) to Postgres.
                Ok(ReleaseWrite::Released { .. }) => return Ok(()),
                Ok(ReleaseWrite::NotReleasable) => return Err(LedgerError::NotReleasable),
                Ok(ReleaseWrite::Miss) => {} // Postgres decides
                // Redis restarted empty: as for a result (above).
                Ok(ReleaseWrite::Foreign) => {
                    self.fleet.redis_foreign();
                    return Err(LedgerError::Unavailable {
                        what: "redis (it holds another dataset than the fleet agreed on: it restarted empty; retry)",
                        retry_after_secs: 1,
                        source: None,
                    });
                }
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
            // next, Postgres answers for this token. While Redis is down
            // there is nothing to drop now: the issued state is written
            // when it is back (below).
            match self.fast.forget(&held.handle).await {
                Ok(()) | Err(FastError::Down) => {}
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
            self.finisher
                .release(id, detail, held.of_request.as_deref()),
        )
        .await
        .map_err(LedgerError::postgres)?;
        match row {
            ReleaseRow::Released { gen, .. } => {
                // Redis holds `issued` at the new generation, so that a
                // consumed marker written late by the consume this release
                // undid (an older generation) is refused.
                let fast = self.fast.clone();
                let catch_up = self.catch_up.clone();
                let text = held.handle.clone();
                self.off_path.spawn(async move {
                    if fast.write_issued(&text, gen, remaining).await.is_err() {
                        catch_up.queue(Resync::Issued {
                            token: text,
                            gen,
                            expires_at_ms,
                        });
                    }
                });
                Ok(())
            }
            ReleaseRow::Existing(_) | ReleaseRow::Unknown => Err(LedgerError::NotReleasable),
        }
    }
}

impl From<&Existing> for Marker {
    /// The consumed marker of a Postgres row (its result included).
    fn from(e: &Existing) -> Marker {
        Marker {
            at_ms: e.consumed_at.map(|t| t.timestamp_millis()).unwrap_or(0),
            request_id: e.request_id.clone(),
            fingerprint: e.fingerprint.clone(),
            result: e.result.as_ref().map(Json::to_string),
        }
    }
}
