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
//!   on (client, biz type, key, id) (`durable::keys::consume`, in a batch
//!   of `durable::key_batch`), Redis learns
//!   the decision afterwards. A consumed marker answers a plain duplicate
//!   only to a call that names no subject (markers do not carry it);
//! - fast types: Redis decides. A key Redis does not hold is first looked up
//!   in Postgres (one read): consumed there, it answers from Postgres and
//!   Redis gets its marker back; otherwise the script creates it at
//!   Postgres's generation and wins it, so a key whose journal reached
//!   Postgres never looks fresh again after Redis lost it. Redis decides a
//!   fast key through the fleet's gate, as a fast token: while the gate is
//!   closed or Redis cannot be reached fast keys answer 503, since no
//!   instance decides one without Redis (durable keys keep working on
//!   Postgres alone).
//!
//! The consume itself is `consume::consume_held` with `held::Of::Key`.

use serde_json::Value as Json;

use super::api::{ConsumeAnswer, LedgerError, ResultAnswer};
use super::consume::{Attempted, Look, Prior};
use super::core::Ledger;
use super::held::{Held, Of};
use crate::auth::Client;
use crate::config::Durability;
use crate::domain::key::{identity, ClientKey};
use crate::domain::{BizType, Fingerprint, Reason, RequestId, Subject};
use crate::durable::keys::{self as sql, KeyState};
use crate::durable::timed;
use crate::durable::tokens::{TokenRecord, TokenState};
use crate::fast::Peek;
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
        let settings = self.verifier.biz_settings_for(caller, biz)?;
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
        let of = Of::Key {
            subject: input.subject.as_ref(),
        };
        let answer = self.consume_held(&held, of, input).await;
        Ok(Look {
            biz: input.biz_type.clone(),
            id: held.record.id,
            of_key: true,
            answer,
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
        let settings = self.verifier.biz_settings_for(caller, biz)?;
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
        let settings = self.verifier.biz_settings_for(caller, biz)?;
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
            let peek = self.fast.peek(&held.handle).await;
            match peek {
                Ok((Peek::Consumed(m), _)) => {
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
                Ok((Peek::Issued, _)) => {
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
