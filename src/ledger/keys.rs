//! Client-supplied keys (`/v1/keys`): consume, result, release and state of
//! a key that belongs to (client, biz type). The token's protocol and its
//! helpers (`consume`, `result`), with what differs:
//!
//! - no token checks: a key is not signed. Its row id and the hash tag of
//!   its Redis key are derived from (client, biz type, key)
//!   ([`crate::domain::key`]); the first consume creates the key;
//! - a key's subject, when a consume names one, must be the one it was
//!   created with (403 `token_mismatch`);
//! - durable types: Redis claims, Postgres decides through the unique index
//!   on (client, biz type, key) (`durable::keys::consume`), Redis learns
//!   the decision afterwards. A consumed marker answers a plain duplicate
//!   only to a call that names no subject (markers do not carry it);
//! - fast types: Redis decides. A key Redis does not hold is first looked up
//!   in Postgres (one read): consumed there, it answers from Postgres and
//!   Redis gets its marker back; otherwise the script creates it at
//!   Postgres's generation and wins it, so a key whose journal reached
//!   Postgres never looks fresh again after Redis lost it. While Redis
//!   cannot be reached fast keys answer 503: no instance decides one
//!   without Redis (durable keys keep working on Postgres alone).

use serde_json::Value as Json;

use super::consume::{answer_from_row, classify, Attempted, Look, MarkerAnswer, Prior};
use super::core::ms;
use super::result::Held;
use super::{ConsumeAnswer, Ledger, LedgerError, ResultAnswer};
use crate::auth::Client;
use crate::config::Durability;
use crate::domain::key::{identity, ClientKey};
use crate::domain::{BizType, Fingerprint, Reason, RequestId, Subject};
use crate::durable::keys::{self as sql, KeyState};
use crate::durable::timed;
use crate::durable::tokens::{ConsumeRow, TokenRecord, TokenState};
use crate::fast::{Attempt, ConsumeMode, FastError, KeyArgs, ScriptOutcome};
use crate::journal;

/// A consume of a key, parsed.
#[derive(Debug, Clone)]
pub struct KeyInput {
    pub biz_type: BizType,
    pub key: ClientKey,
    pub subject: Option<Subject>,
    pub fingerprint: Option<Fingerprint>,
    pub request_id: Option<RequestId>,
}

impl Attempted for KeyInput {
    fn fingerprint(&self) -> Option<&Fingerprint> {
        self.fingerprint.as_ref()
    }
    fn request_id(&self) -> Option<&RequestId> {
        self.request_id.as_ref()
    }
}

impl Ledger {
    /// The key of `caller` under `biz`, if the biz type is known (422) and
    /// granted (403). `subject`: the one the call names (`''`: none).
    fn held_key(
        &self,
        caller: &Client,
        biz: &BizType,
        key: &ClientKey,
        subject: &str,
    ) -> Result<Held, LedgerError> {
        let settings = self.biz_settings_for(caller, biz)?;
        Ok(self.held_key_of(&caller.name, settings.durability, biz, key, subject))
    }

    /// The key `key` of client `owner` under `biz` (a biz type known to be
    /// of `durability`).
    fn held_key_of(
        &self,
        owner: &str,
        durability: Durability,
        biz: &BizType,
        key: &ClientKey,
        subject: &str,
    ) -> Held {
        let id = identity(owner, biz, key);
        let now = self.clock.now();
        Held {
            handle: id.handle.clone(),
            record: TokenRecord {
                id: id.id,
                token: id.handle,
                biz_type: biz.to_string(),
                durability,
                subject: subject.to_owned(),
                client: owner.to_owned(),
                issued_at: now,
                expires_at: now,
                key: Some(key.as_str().to_owned()),
            },
            durability,
            // A released key's issued state (and generation) stays in Redis
            // as long as a consumed marker would.
            issued_until_ms: self.clock.now_ms() + self.fast.consumed_ttl_ms(),
            of_request: None,
        }
    }

    /// Consumes a key: the first consume creates it and answers `consumed`.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn consume_key(
        &self,
        caller: &Client,
        input: &KeyInput,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let look = self.look_consume_key(caller, input).await?;
        self.tally(look)
    }

    /// One consume of a key, not yet counted (see [`Look`]).
    pub(super) async fn look_consume_key(
        &self,
        caller: &Client,
        input: &KeyInput,
    ) -> Result<Look, LedgerError> {
        let subject = input.subject.as_ref().map(Subject::as_str).unwrap_or("");
        let held = self.held_key(caller, &input.biz_type, &input.key, subject)?;
        let answer = match held.durability {
            Durability::Durable => self.consume_key_durable(&held, input).await,
            Durability::Fast => self.consume_key_fast(&held, input).await,
        };
        Ok(Look {
            biz: input.biz_type.clone(),
            id: held.record.id,
            of_key: true,
            answer,
        })
    }

    async fn consume_key_durable(
        &self,
        held: &Held,
        input: &KeyInput,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let attempt = Attempt {
            owner: &owner,
            request_id: input.request_id.as_ref().map(RequestId::as_str),
            fingerprint: input.fingerprint.as_ref().map(Fingerprint::as_str),
        };
        let provisional = ms(self.settings.tokens.provisional_ttl);
        let remaining = held.issued_until_ms - self.clock.now_ms();
        // Redis's markers do not carry a key's subject: a call that names one
        // is answered by Postgres.
        let from_marker = input.subject.is_none();
        let mut claimed = false;
        let mut fallback = None;
        let reply = if self.fast.health().bypass() {
            self.metrics
                .redis_bypass
                .with_label_values(&["degraded_sample"])
                .inc();
            Err(FastError::Down)
        } else {
            self.fast
                .consume_key(
                    &held.handle,
                    ConsumeMode::Durable,
                    &attempt,
                    provisional,
                    &[],
                    KeyArgs::default(),
                )
                .await
        };
        match reply {
            Ok((ScriptOutcome::Consumed(m), version)) if from_marker => {
                match self.durable_marker_answer(&m, version, input) {
                    MarkerAnswer::Answer(answer) => return Ok(answer),
                    MarkerAnswer::UnlessPostgresSays(answer) => fallback = Some(answer),
                    MarkerAnswer::AskPostgres => {}
                }
            }
            Ok((ScriptOutcome::Provisional(m), _)) if from_marker => {
                if let Some(answer) =
                    classify(&Prior::from_marker(&m), input, true, self.clock.now())?
                {
                    return Ok(answer);
                }
            }
            Ok((ScriptOutcome::Claimed, _)) => claimed = true,
            Ok(_) | Err(FastError::Down) => {}
            Err(e) => tracing::debug!(error = %e, "redis failed; postgres decides alone"),
        }
        let decided = timed(
            &self.metrics,
            "consume",
            self.pools.bounded(sql::consume(
                &self.pools.hot,
                &held.record,
                attempt.fingerprint,
                attempt.request_id,
            )),
        )
        .await;
        let decided = match decided {
            Ok(d) => d,
            Err(e) => {
                if claimed {
                    self.spawn_unclaim(&held.handle, remaining, owner.clone());
                }
                if let (Some(answer), true) = (fallback, e.is_unavailable()) {
                    return Ok(answer);
                }
                return Err(LedgerError::postgres(e));
            }
        };
        let owner = claimed.then_some(owner.clone());
        self.settle_row(
            &held.handle,
            remaining,
            &decided.row,
            decided.gen,
            owner,
            &attempt,
        );
        if input
            .subject
            .as_ref()
            .is_some_and(|s| s.as_str() != decided.subject)
        {
            return Err(LedgerError::TokenMismatch);
        }
        key_answer(&decided.row, input, self)
    }

    async fn consume_key_fast(
        &self,
        held: &Held,
        input: &KeyInput,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let attempt = Attempt {
            owner: "",
            request_id: input.request_id.as_ref().map(RequestId::as_str),
            fingerprint: input.fingerprint.as_ref().map(Fingerprint::as_str),
        };
        let provisional = ms(self.settings.tokens.provisional_ttl);
        let fields = journal::consume_fields(&held.record, attempt.request_id, attempt.fingerprint);
        let subject = input.subject.as_ref().map(Subject::as_str);
        let mut args = KeyArgs {
            subject,
            create_at_gen: None,
            subject_checked: false,
        };
        // At most two rounds: Redis, then (when it lacks the key or its
        // subject) Postgres and Redis again.
        for round in 0..2 {
            let reply = self
                .fast
                .consume_key(
                    &held.handle,
                    ConsumeMode::Fast,
                    &attempt,
                    provisional,
                    &fields,
                    args,
                )
                .await;
            match reply {
                Ok((ScriptOutcome::Won { at_ms }, _)) => {
                    return Ok(ConsumeAnswer::Consumed {
                        consumed_at: super::core::ms_to_time(at_ms)
                            .unwrap_or_else(|| self.clock.now()),
                        replayed: false,
                    })
                }
                Ok((ScriptOutcome::Consumed(m), version)) => {
                    let ran_out =
                        self.lease_ran_out(&held.record.biz_type, m.at_ms, version.now_ms);
                    let prior = Prior::from_marker(&m).lease_ran_out(ran_out);
                    if let Some(answer) = classify(&prior, input, false, self.clock.now())? {
                        return Ok(answer);
                    }
                }
                Ok((ScriptOutcome::Mismatch, _)) => return Err(LedgerError::TokenMismatch),
                Ok((ScriptOutcome::Miss | ScriptOutcome::Unbound, _)) if round == 0 => {
                    let found = timed(
                        &self.metrics,
                        "find",
                        self.pools
                            .bounded(sql::find(&self.pools.hot, held.record.id)),
                    )
                    .await
                    .map_err(LedgerError::postgres)?;
                    match found {
                        Some((e, bound)) => {
                            if subject.is_some_and(|s| s != bound) {
                                return Err(LedgerError::TokenMismatch);
                            }
                            if e.state == TokenState::Consumed {
                                let gen = e.gen;
                                let row = ConsumeRow::Existing(e);
                                self.settle_row(&held.handle, 0, &row, gen, None, &attempt);
                                return key_answer(&row, input, self);
                            }
                            args.create_at_gen = Some(e.gen);
                        }
                        None => args.create_at_gen = Some(0),
                    }
                    args.subject_checked = true;
                    continue;
                }
                Ok(_) => {}
                Err(FastError::Down) => {
                    return Err(LedgerError::Unavailable {
                        what: "redis (it decides fast keys)",
                        retry_after_secs: 1,
                        source: None,
                    })
                }
                // The script may have run: the caller retries with its
                // request_id and learns the outcome.
                Err(e) => {
                    return Err(LedgerError::Unavailable {
                        what: "redis (outcome unknown; retry with the same request_id)",
                        retry_after_secs: 1,
                        source: Some(e.into()),
                    })
                }
            }
            break;
        }
        // A provisional marker (a durable claim: the biz type changed its
        // durability) or an answer that cannot be: nothing was decided.
        Err(LedgerError::Unavailable {
            what: "redis (the key is being decided; retry with the same request_id)",
            retry_after_secs: 1,
            source: None,
        })
    }

    /// Records the result of a key this client consumed.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn record_key_result(
        &self,
        caller: &Client,
        biz: &BizType,
        key: &ClientKey,
        result: &Json,
        of_request: Option<&RequestId>,
    ) -> Result<ResultAnswer, LedgerError> {
        let mut held = self.held_key(caller, biz, key, "")?;
        held.of_request = of_request.map(|r| r.as_str().to_owned());
        self.record_result_of(&held, result).await
    }

    /// Gives a consumed key with no result back.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn release_key(
        &self,
        caller: &Client,
        biz: &BizType,
        key: &ClientKey,
        of_request: Option<&RequestId>,
    ) -> Result<(), LedgerError> {
        let mut held = self.held_key(caller, biz, key, "")?;
        held.of_request = of_request.map(|r| r.as_str().to_owned());
        self.release_of(&held).await
    }

    /// An operator frees client `owner`'s key stuck in `processing`: the
    /// rule of a client's release, audited as `key.released` with
    /// `{"by": <the acting client's name>, "reason": ...}`.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn release_key_by_admin(
        &self,
        caller: &Client,
        owner: &str,
        biz: &BizType,
        key: &ClientKey,
        reason: &Reason,
    ) -> Result<(), LedgerError> {
        let settings = self.biz_settings_for(caller, biz)?;
        let held = self.held_key_of(owner, settings.durability, biz, key, "");
        let fields = (held.durability == Durability::Fast).then(|| {
            journal::admin_release_fields_for(&held.record, &caller.name, reason.as_str())
        });
        let detail = serde_json::json!({"by": caller.name, "reason": reason.as_str()});
        self.release_held(&held, fields, Some(&detail)).await
    }

    /// An operator records the outcome of client `owner`'s consumed key
    /// (see [`Ledger::record_result_by_admin`]).
    pub async fn record_key_result_by_admin(
        &self,
        caller: &Client,
        owner: &str,
        biz: &BizType,
        key: &ClientKey,
        result: &Json,
        reason: &Reason,
    ) -> Result<ResultAnswer, LedgerError> {
        let settings = self.biz_settings_for(caller, biz)?;
        let held = self.held_key_of(owner, settings.durability, biz, key, "");
        self.record_result_as(&held, result, Some((&caller.name, reason.as_str())))
            .await
    }

    /// A key's state (`None`: no consume of it is known, or it was purged).
    /// Read-only. Fast keys are read from Redis first (the journal may not
    /// have reached Postgres yet), durable ones from Postgres.
    pub async fn key_state(
        &self,
        caller: &Client,
        biz: &BizType,
        key: &ClientKey,
    ) -> Result<Option<KeyState>, LedgerError> {
        let held = self.held_key(caller, biz, key, "")?;
        if held.durability == Durability::Fast {
            let attempt = Attempt {
                owner: "",
                request_id: None,
                fingerprint: None,
            };
            let peek = self
                .fast
                .consume_key(
                    &held.handle,
                    ConsumeMode::Peek,
                    &attempt,
                    0,
                    &[],
                    KeyArgs::default(),
                )
                .await;
            match peek {
                Ok((ScriptOutcome::Consumed(m), _)) => {
                    let prior = Prior::from_marker(&m);
                    return Ok(Some(KeyState {
                        state: TokenState::Consumed,
                        consumed_at: prior.consumed_at,
                        result: m
                            .result
                            .as_deref()
                            .and_then(|r| serde_json::from_str(r).ok()),
                    }));
                }
                Ok((ScriptOutcome::Issued, _)) => {
                    return Ok(Some(KeyState {
                        state: TokenState::Issued,
                        consumed_at: None,
                        result: None,
                    }))
                }
                Ok(_) | Err(_) => {}
            }
        }
        timed(
            &self.metrics,
            "find",
            self.pools
                .bounded(sql::state(&self.pools.hot, held.record.id)),
        )
        .await
        .map_err(LedgerError::postgres)
    }
}

/// The answer a key's row gives. A key is never `token_expired`: a row that
/// is not consumed here was released concurrently, and the caller retries.
fn key_answer(
    row: &ConsumeRow,
    input: &KeyInput,
    ledger: &Ledger,
) -> Result<ConsumeAnswer, LedgerError> {
    match row {
        ConsumeRow::Won { .. } => answer_from_row(row, input, ledger.clock.now()),
        ConsumeRow::Existing(e) if e.state == TokenState::Consumed => {
            answer_from_row(row, input, ledger.clock.now())
        }
        ConsumeRow::Existing(_) | ConsumeRow::Expired => Err(LedgerError::Unavailable {
            what: "postgres (the key was released meanwhile; retry)",
            retry_after_secs: 1,
            source: None,
        }),
    }
}
