//! The consume protocol (steps 2 to 4 in [`super`]): Redis first, Postgres
//! deciding for durable types, Redis told afterwards, written once for a
//! token and a client key (`super::held`). `consume/prior.rs`'s [`classify`]
//! and [`answer_from_row`] turn what an earlier consume left behind into
//! this attempt's answer; their unit tests (`consume/tests.rs`) go through
//! every row of API.md's consume table.

use serde_json::Value as Json;

mod prior;

use prior::same_request;
pub(super) use prior::{answer_from_row, classify, Attempted, Prior};

use super::api::{ConsumeAnswer, ConsumeInput, ConsumeOutcome, LedgerError};
use super::core::Ledger;
use super::held::{Held, Of};
use super::util::{ms, ms_to_time};
use crate::auth::Client;
use crate::config::Durability;
use crate::domain::{Fingerprint, RequestId};
use crate::durable::keys;
use crate::durable::tokens::{self, ConsumeRow, TokenRecord, TokenState};
use crate::durable::{timed, DurableError};
use crate::fast::{
    Attempt, Claim, ConsumedWrite, Decision, FastError, KeyArgs, KeyVersion, Marker, Peek,
};
use crate::journal;
use crate::token::VerifiedToken;

/// A consume's answer before it is counted: a waiting consume
/// ([`super::wait`]) looks several times and counts only its last answer.
pub(super) struct Look {
    pub(super) biz: crate::domain::BizType,
    /// The token's (key's) id.
    pub(super) id: i64,
    /// A client key's consume (whose `TokenMismatch` is counted).
    pub(super) of_key: bool,
    pub(super) answer: Result<ConsumeAnswer, LedgerError>,
}

impl Ledger {
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn consume(
        &self,
        caller: &Client,
        text: &str,
        input: &ConsumeInput,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let look = self.look_consume(caller, text, input).await?;
        self.tally(look)
    }

    /// One consume, not yet counted (see [`Look`]); `Err`: refused before
    /// any tier was asked (the token's checks count themselves).
    pub(super) async fn look_consume(
        &self,
        caller: &Client,
        text: &str,
        input: &ConsumeInput,
    ) -> Result<Look, LedgerError> {
        let (token, settings) =
            self.verifier
                .authorize(caller, text, &input.subject, input.biz_type.as_ref())?;
        let biz = token.claims.biz_type.clone();
        let held = Held {
            handle: token.text.clone(),
            record: self
                .verifier
                .record_for(&token, settings.durability, caller, &input.subject),
            durability: settings.durability,
            issued_until_ms: token.claims.expires_at_ms(),
            of_request: None,
        };
        let of = Of::Token {
            expired: self.locally_expired(&token),
        };
        let answer = self.consume_held(&held, of, input).await;
        tracing::debug!(token = %token.redacted(), outcome = ?answer.as_ref().map(|_| ()), "consume");
        Ok(Look {
            biz,
            id: held.record.id,
            of_key: false,
            answer,
        })
    }

    /// Counts a consume's answer once (metrics, stats, the duplicate
    /// counter) and returns it.
    pub(super) fn tally(&self, look: Look) -> Result<ConsumeAnswer, LedgerError> {
        let outcome = match &look.answer {
            Ok(ConsumeAnswer::Consumed {
                replayed: false, ..
            }) => Some(ConsumeOutcome::Consumed),
            Ok(ConsumeAnswer::Consumed { replayed: true, .. }) => Some(ConsumeOutcome::Replayed),
            Ok(ConsumeAnswer::Duplicate { .. }) => {
                self.writer.duplicate(look.id);
                Some(ConsumeOutcome::Duplicate)
            }
            Err(LedgerError::TokenExpired) => Some(ConsumeOutcome::Expired),
            Err(LedgerError::TokenMismatch) if look.of_key => Some(ConsumeOutcome::Mismatch),
            Err(LedgerError::FingerprintMismatch) => Some(ConsumeOutcome::FingerprintMismatch),
            Err(LedgerError::Unavailable { .. }) => Some(ConsumeOutcome::Unavailable),
            Err(_) => None,
        };
        if let Some(outcome) = outcome {
            self.count_consume(&look.biz, outcome);
        }
        look.answer
    }

    /// Whether our clock says the token's embedded expiry has passed. Only a
    /// hint: an expired token may still be consumed (it answers `duplicate`
    /// for `retention`), and Postgres `now()` decides durable expiry.
    fn locally_expired(&self, token: &VerifiedToken) -> bool {
        token.claims.expires_at_ms() <= self.clock.now_ms()
    }

    fn provisional_ms(&self) -> i64 {
        ms(self.settings.tokens.provisional_ttl)
    }

    /// The one Postgres statement of a consume that reaches Postgres
    /// (`tokens::consume_versioned`), timed and bounded like every
    /// payment-path call: the row and the generation the token is at.
    /// A durable token's goes through the batcher (sent at once, or with
    /// the others that arrive while statements are in flight).
    pub(super) async fn consume_in_postgres(
        &self,
        record: &TokenRecord,
        attempt: &Attempt<'_>,
    ) -> Result<(ConsumeRow, i64), DurableError> {
        let decided = async {
            match record.durability {
                Durability::Durable => {
                    self.batcher
                        .consume(record, attempt.fingerprint, attempt.request_id)
                        .await
                }
                Durability::Fast => {
                    self.pools
                        .bounded(tokens::consume_versioned(
                            &self.pools.hot,
                            record,
                            attempt.fingerprint,
                            attempt.request_id,
                        ))
                        .await
                }
            }
        };
        timed(&self.metrics, "consume", decided).await
    }

    /// What a durable token's consumed marker may answer without Postgres.
    /// Redis never decides a durable consume, and a marker may be stale (a
    /// release lost in a failover, a write-back that lost a race), so only a
    /// plain `duplicate` is answered from it: with its result, or, without
    /// one, while the marker is younger than `redis.processing_trust` (the
    /// double clicks of one consume). The winner's retry (its `request_id`)
    /// and a fingerprint mismatch are confirmed by Postgres, and so is
    /// `processing` from an older marker, so that a result whose write to
    /// Redis failed is still answered.
    pub(super) fn durable_marker_answer<I: Attempted>(
        &self,
        m: &Marker,
        version: KeyVersion,
        input: &I,
    ) -> MarkerAnswer {
        let prior = Prior::from_marker(m);
        let mismatch = matches!((&prior.fingerprint, input.fingerprint()), (Some(a), Some(b)) if a != b.as_str());
        if same_request(&prior, input) || mismatch {
            return MarkerAnswer::AskPostgres;
        }
        let Ok(Some(answer)) = classify(&prior, input, false, self.clock.now()) else {
            return MarkerAnswer::AskPostgres;
        };
        if prior.result.is_some()
            || version.now_ms - m.at_ms < ms(self.settings.redis.processing_trust)
        {
            MarkerAnswer::Answer(answer)
        } else {
            MarkerAnswer::UnlessPostgresSays(answer)
        }
    }

    /// One consume of a token or a key (the protocol of [`super`], steps 2
    /// to 4): Postgres decides a durable one, Redis a fast one.
    pub(super) async fn consume_held<I: Attempted>(
        &self,
        held: &Held,
        of: Of<'_>,
        input: &I,
    ) -> Result<ConsumeAnswer, LedgerError> {
        match held.durability {
            Durability::Durable => self.consume_durable(held, of, input).await,
            Durability::Fast => self.consume_fast(held, of, input).await,
        }
    }

    /// A durable consume: Redis claims (or answers a plain duplicate from
    /// its marker), Postgres decides, Redis learns the decision afterwards.
    async fn consume_durable<I: Attempted>(
        &self,
        held: &Held,
        of: Of<'_>,
        input: &I,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let attempt = attempt_of(Some(&owner), input);
        let mut claimed = false;
        // A marker's own answer, kept for when Postgres cannot be asked.
        let mut fallback = None;
        let reply = if self.fast.health().bypass() {
            self.metrics
                .redis_bypass
                .with_label_values(&["degraded_sample"])
                .inc();
            Err(FastError::Down)
        } else if of.expired() {
            // Past its expiry by our clock: Redis is only looked at.
            self.fast
                .peek(&held.handle)
                .await
                .map(|(p, v)| (claim_seen(p), v))
        } else {
            self.fast
                .claim(&held.handle, &attempt, self.provisional_ms())
                .await
                .map(|(c, v)| (Some(c), v))
        };
        match reply {
            Ok((Some(Claim::Consumed(m)), version)) if of.markers_answer() => {
                match self.durable_marker_answer(&m, version, input) {
                    MarkerAnswer::Answer(answer) => return Ok(answer),
                    MarkerAnswer::UnlessPostgresSays(answer) => fallback = Some(answer),
                    MarkerAnswer::AskPostgres => {}
                }
            }
            // Another attempt is in flight. Racing copies of one request id
            // go to Postgres, which decides which copy answers first (the
            // others replay it); see `classify` for the rest.
            Ok((Some(Claim::Provisional(m)), _)) if of.markers_answer() => {
                if let Some(answer) =
                    classify(&Prior::from_marker(&m), input, true, self.clock.now())?
                {
                    return Ok(answer);
                }
            }
            Ok((Some(Claim::Claimed), _)) => claimed = true,
            Ok(_) | Err(FastError::Down) => {}
            // The script may have run and left a provisional marker: it
            // expires. Postgres decides either way.
            Err(e) => tracing::debug!(error = %e, "redis failed; postgres decides alone"),
        }
        let decided = match self.decide_in_postgres(held, of, &attempt).await {
            Ok(d) => d,
            Err(e) => {
                if claimed {
                    self.spawn_unclaim(&held.handle, self.remaining_of(held), owner.clone());
                }
                // Postgres unreachable: a plain duplicate is still answered
                // from Redis's marker (fail closed: nothing is consumed).
                if let (Some(answer), true) = (fallback, e.is_unavailable()) {
                    return Ok(answer);
                }
                return Err(LedgerError::postgres(e));
            }
        };
        self.settle_row(
            &held.handle,
            self.remaining_of(held),
            &decided.row,
            decided.gen,
            claimed.then_some(owner.clone()),
            &attempt,
        );
        self.answer_row(of, &decided.row, decided.subject.as_deref(), input)
    }

    /// A fast consume: Redis decides, through this instance's gate (see
    /// `crate::fleet`); without it, [`Self::consume_fast_down`].
    ///
    /// The paths off Redis's answer (Redis down or lacking the token, a
    /// key's lookup, an expired token) are boxed: a future is as large as
    /// its largest state, and every request's future is moved whole into
    /// the HTTP server's box, so without them each consume copied some
    /// 9.7 KiB for paths it almost never takes.
    async fn consume_fast<I: Attempted>(
        &self,
        held: &Held,
        of: Of<'_>,
        input: &I,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let attempt = attempt_of(None, input);
        let mut fields =
            journal::consume_fields(&held.record, attempt.request_id, attempt.fingerprint);
        let mut args = KeyArgs {
            subject: of.subject(),
            create_at_gen: None,
            subject_checked: false,
        };
        // At most two rounds: Redis, then (a key it lacks, or lacks the
        // subject of) Postgres and Redis again.
        for round in 0..2 {
            let Some(gate) = self.fleet.redis_may_decide() else {
                return Box::pin(self.consume_fast_down(held, of, input, &attempt)).await;
            };
            let reply = if of.expired() {
                // Past its expiry by our clock: never consumed behind
                // Redis's back, only looked at.
                self.fast
                    .peek(&held.handle)
                    .await
                    .map(|(p, v)| (decision_seen(p), v))
            } else {
                self.fast
                    .decide(
                        &held.handle,
                        &attempt,
                        self.provisional_ms(),
                        &fields,
                        args,
                        Some(gate.dataset()),
                    )
                    .await
            };
            // A win, or a replay of one (the same request_id, whose first
            // answer may have been lost, so that no instance recorded the
            // win), is answered `consumed`: the going-down flush must cover
            // it, and it is answered only while this instance is a member.
            let won = match &reply {
                // A win is answered now (or 503): the entry is not needed
                // for another round.
                Ok((Decision::Won { at_ms }, version)) => Some(journal::decided(
                    std::mem::take(&mut fields),
                    version.gen,
                    *at_ms,
                )),
                Ok((Decision::Consumed(m), version))
                    if attempt.request_id.is_some()
                        && m.request_id.as_deref() == attempt.request_id =>
                {
                    let fields = journal::consume_fields(
                        &held.record,
                        m.request_id.as_deref(),
                        m.fingerprint.as_deref(),
                    );
                    Some(journal::decided(fields, version.gen, m.at_ms))
                }
                _ => None,
            };
            if let Some(entry) = won {
                self.fleet.decided_in_redis(&gate, entry);
                // The lease is checked again now that the reply is in: a win
                // that outlived this instance's membership (it was paused,
                // the call was slow) may meet a decision the fleet made
                // without it. It is not answered as made: the caller retries
                // with its request_id once this instance is a member again.
                if !gate.still_held() {
                    self.catch_up
                        .fallback()
                        .uncertain
                        .insert(held.record.id, ());
                    return Err(LedgerError::Unavailable {
                        what: "fleet membership ran out during the decision (outcome unknown; retry with the same request_id)",
                        retry_after_secs: 1,
                        source: None,
                    });
                }
            }
            drop(gate);
            match reply {
                Ok((Decision::Won { at_ms }, _)) => {
                    return Ok(ConsumeAnswer::Consumed {
                        consumed_at: ms_to_time(at_ms).unwrap_or_else(|| self.clock.now()),
                        replayed: false,
                    })
                }
                Ok((Decision::Consumed(m), version)) => {
                    let ran_out =
                        self.lease_ran_out(&held.record.biz_type, m.at_ms, version.now_ms);
                    let prior = Prior::from_marker(&m).lease_ran_out(ran_out);
                    if let Some(answer) = classify(&prior, input, false, self.clock.now())? {
                        return Ok(answer);
                    }
                }
                Ok((Decision::Provisional(m), _)) => {
                    if let Some(answer) =
                        classify(&Prior::from_marker(&m), input, true, self.clock.now())?
                    {
                        return Ok(answer);
                    }
                }
                Ok((Decision::Mismatch, _)) => return Err(LedgerError::TokenMismatch),
                // Redis restarted empty (or is another server): nothing was
                // decided. The fleet accounts for the decisions it lost
                // before Redis decides again (see `crate::fleet`).
                Ok((Decision::Foreign, _)) => {
                    self.fleet.redis_foreign();
                    return Err(LedgerError::Unavailable {
                        what: "redis (it holds another dataset than the fleet agreed on: it restarted empty; retry)",
                        retry_after_secs: 1,
                        source: None,
                    });
                }
                Ok((Decision::Miss | Decision::Unbound, _)) => {
                    if let (Of::Key { .. }, 0) = (of, round) {
                        match Box::pin(self.key_in_postgres(held, of, &attempt, input)).await? {
                            KeyFound::Answer(answer) => return Ok(answer),
                            KeyFound::CreateAt(gen) => {
                                args.create_at_gen = Some(gen);
                                args.subject_checked = true;
                                continue;
                            }
                        }
                    }
                }
                // Nothing reached Redis (breaker open, connection refused).
                Err(FastError::Down) => {
                    return Box::pin(self.consume_fast_down(held, of, input, &attempt)).await
                }
                // The script may have run and consumed the token before the
                // reply was lost (or may still run, late): deciding again
                // elsewhere could consume it twice. The caller retries with
                // its request_id and learns the outcome; until Redis answers
                // again, this instance does not decide it without Redis.
                Err(e) => {
                    self.catch_up
                        .fallback()
                        .uncertain
                        .insert(held.record.id, ());
                    return Err(LedgerError::Unavailable {
                        what: "redis (outcome unknown; retry with the same request_id)",
                        retry_after_secs: 1,
                        source: Some(e.into()),
                    });
                }
            }
            break;
        }
        match of {
            Of::Token { expired: true } => Box::pin(self.expired_fast(&held.record, input)).await,
            // Redis lost the token or never had it (or a durable claim holds
            // it: its type changed durability): Postgres decides.
            Of::Token { expired: false } => {
                let decided = Box::pin(self.decide_in_postgres(held, of, &attempt))
                    .await
                    .map_err(LedgerError::postgres)?;
                self.settle_row(&held.handle, 0, &decided.row, decided.gen, None, &attempt);
                answer_from_row(&decided.row, input, self.clock.now())
            }
            // A durable claim holds it (its type changed durability), or an
            // answer that cannot be: nothing was decided.
            Of::Key { .. } => Err(LedgerError::Unavailable {
                what: "redis (the key is being decided; retry with the same request_id)",
                retry_after_secs: 1,
                source: None,
            }),
        }
    }

    /// A fast key Redis does not hold (or holds without a subject to check
    /// a call's against), looked up in Postgres (one read): consumed there,
    /// it answers from Postgres and Redis gets its marker back; otherwise
    /// Redis creates it at Postgres's generation and decides, so a key whose
    /// journal reached Postgres never looks fresh again after Redis lost it.
    async fn key_in_postgres<I: Attempted>(
        &self,
        held: &Held,
        of: Of<'_>,
        attempt: &Attempt<'_>,
        input: &I,
    ) -> Result<KeyFound, LedgerError> {
        let found = timed(
            &self.metrics,
            "find",
            self.pools
                .bounded(keys::find(&self.pools.hot, held.record.id)),
        )
        .await
        .map_err(LedgerError::postgres)?;
        let Some((e, bound)) = found else {
            return Ok(KeyFound::CreateAt(0));
        };
        if of.subject().is_some_and(|s| s != bound) {
            return Err(LedgerError::TokenMismatch);
        }
        if e.state != TokenState::Consumed {
            return Ok(KeyFound::CreateAt(e.gen));
        }
        let gen = e.gen;
        let row = ConsumeRow::Existing(e);
        self.settle_row(&held.handle, 0, &row, gen, None, attempt);
        self.answer_row(of, &row, None, input).map(KeyFound::Answer)
    }

    /// Postgres decides a consume (one statement): a durable token's
    /// through the batcher, a key's through the key batcher (the unique
    /// index on (client, biz type, key, id) decides).
    async fn decide_in_postgres(
        &self,
        held: &Held,
        of: Of<'_>,
        attempt: &Attempt<'_>,
    ) -> Result<Decided, DurableError> {
        match of {
            Of::Token { .. } => {
                let (row, gen) = self.consume_in_postgres(&held.record, attempt).await?;
                Ok(Decided {
                    row,
                    gen,
                    subject: None,
                })
            }
            Of::Key { .. } => {
                let d = timed(
                    &self.metrics,
                    "consume",
                    self.key_batcher
                        .consume(&held.record, attempt.fingerprint, attempt.request_id),
                )
                .await?;
                Ok(Decided {
                    row: d.row,
                    gen: d.gen,
                    subject: Some(d.subject),
                })
            }
        }
    }

    /// The answer Postgres's row gives (`bound`: the subject a key was
    /// created with). A key is never `token_expired`: a row that is not
    /// consumed was released concurrently, and the caller retries.
    fn answer_row<I: Attempted>(
        &self,
        of: Of<'_>,
        row: &ConsumeRow,
        bound: Option<&str>,
        input: &I,
    ) -> Result<ConsumeAnswer, LedgerError> {
        if let Of::Key { subject } = of {
            if let (Some(s), Some(b)) = (subject, bound) {
                if s.as_str() != b {
                    return Err(LedgerError::TokenMismatch);
                }
            }
            let consumed = match row {
                ConsumeRow::Won { .. } => true,
                ConsumeRow::Existing(e) => e.state == TokenState::Consumed,
                ConsumeRow::Expired => false,
            };
            if !consumed {
                return Err(LedgerError::Unavailable {
                    what: "postgres (the key was released meanwhile; retry)",
                    retry_after_secs: 1,
                    source: None,
                });
            }
        }
        answer_from_row(row, input, self.clock.now())
    }

    /// A fast token past its expiry on our clock: never consumed behind
    /// Redis's back; Postgres says whether it was consumed before.
    pub(super) async fn expired_fast<I: Attempted>(
        &self,
        record: &TokenRecord,
        input: &I,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let found = timed(
            &self.metrics,
            "find",
            self.pools.bounded(tokens::find(&self.pools.hot, record.id)),
        )
        .await
        .map_err(LedgerError::postgres)?;
        match found {
            Some(e) if e.state == TokenState::Consumed => {
                answer_from_row(&ConsumeRow::Existing(e), input, self.clock.now())
            }
            _ => Err(LedgerError::TokenExpired),
        }
    }

    /// The consumed marker a Postgres row stands for (`None`: not consumed).
    pub(super) fn marker_of(&self, row: &ConsumeRow, attempt: &Attempt<'_>) -> Option<Marker> {
        match row {
            ConsumeRow::Won { consumed_at } => Some(Marker {
                at_ms: consumed_at.timestamp_millis(),
                request_id: attempt.request_id.map(str::to_owned),
                fingerprint: attempt.fingerprint.map(str::to_owned),
                result: None,
            }),
            ConsumeRow::Existing(e) if e.state == TokenState::Consumed => Some(Marker {
                at_ms: e
                    .consumed_at
                    .map(|t| t.timestamp_millis())
                    .unwrap_or_else(|| self.clock.now_ms()),
                request_id: e.request_id.clone(),
                fingerprint: e.fingerprint.clone(),
                result: e.result.as_ref().map(Json::to_string),
            }),
            _ => None,
        }
    }

    /// Writes Postgres's consumed state at generation `gen` to Redis off the
    /// answer's path, in a pipeline with the others on their way (queued
    /// for later when Redis cannot be written). The write applies only over
    /// an older generation, so a late or repeated one never undoes a release
    /// or a newer consume.
    pub(super) fn settle_consumed_in_background(&self, token: &str, gen: i64, marker: Marker) {
        self.catch_up.write_back(ConsumedWrite {
            token: token.to_owned(),
            gen,
            marker,
        });
    }

    /// Tells Redis what Postgres decided (the row, at generation `gen`), off
    /// the answer's path, for the Redis key of `handle` (a token's text, or a
    /// client key's handle). `owner`: our provisional marker, if we set one,
    /// given back (living `remaining_ms`) when Postgres did not consume it.
    pub(super) fn settle_row(
        &self,
        handle: &str,
        remaining_ms: i64,
        row: &ConsumeRow,
        gen: i64,
        owner: Option<String>,
        attempt: &Attempt<'_>,
    ) {
        let Some(marker) = self.marker_of(row, attempt) else {
            if let Some(owner) = owner {
                self.spawn_unclaim(handle, remaining_ms, owner);
            }
            return;
        };
        self.settle_consumed_in_background(handle, gen, marker);
    }

    /// How long a token or key's issued state lives in Redis from now, ms
    /// (a token's by its embedded expiry, by our clock).
    pub(super) fn remaining_of(&self, held: &Held) -> i64 {
        held.issued_until_ms - self.clock.now_ms()
    }

    /// Gives our provisional marker on `handle`'s key back, to live
    /// `remaining` ms (<= 0: deleted), off the answer's path.
    pub(super) fn spawn_unclaim(&self, handle: &str, remaining: i64, owner: String) {
        let fast = self.fast.clone();
        let text = handle.to_owned();
        self.off_path.spawn(async move {
            // If this fails the marker's deadline frees the token anyway.
            let _ = fast.unclaim(&text, &owner, remaining).await;
        });
    }
}

/// What a durable consumed marker answers (see `durable_marker_answer`).
pub(super) enum MarkerAnswer {
    /// This, without Postgres.
    Answer(ConsumeAnswer),
    /// Postgres decides; this, if Postgres cannot be reached.
    UnlessPostgresSays(ConsumeAnswer),
    /// Postgres decides.
    AskPostgres,
}

/// Postgres's decision of a consume: the row, the generation the token or
/// key is at, and (a key's) the subject it was created with.
struct Decided {
    row: ConsumeRow,
    gen: i64,
    subject: Option<String>,
}

/// What a fast key's lookup in Postgres found (see `key_in_postgres`).
enum KeyFound {
    /// Consumed there: this is the answer.
    Answer(ConsumeAnswer),
    /// Not consumed there: Redis creates it at this generation and decides.
    CreateAt(i64),
}

/// A durable attempt's view of a key it only looked at: what a claim would
/// have found, or `None` (live, or missing): Postgres decides.
fn claim_seen(p: Peek) -> Option<Claim> {
    match p {
        Peek::Consumed(m) => Some(Claim::Consumed(m)),
        Peek::Provisional(m) => Some(Claim::Provisional(m)),
        Peek::Issued | Peek::Miss => None,
    }
}

/// A fast attempt's view of a key it only looked at: consumed or in
/// flight, or else not consumed in Redis ([`Decision::Miss`]: Postgres
/// says).
fn decision_seen(p: Peek) -> Decision {
    match p {
        Peek::Consumed(m) => Decision::Consumed(m),
        Peek::Provisional(m) => Decision::Provisional(m),
        Peek::Issued | Peek::Miss => Decision::Miss,
    }
}

/// An attempt's arguments to the consume script (`owner`: its provisional
/// marker's, if it names one).
fn attempt_of<'a, I: Attempted>(owner: Option<&'a str>, input: &'a I) -> Attempt<'a> {
    Attempt {
        owner,
        request_id: input.request_id().map(RequestId::as_str),
        fingerprint: input.fingerprint().map(Fingerprint::as_str),
    }
}

#[cfg(test)]
mod tests;
