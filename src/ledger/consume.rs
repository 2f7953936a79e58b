//! The ledger: issue, consume, result and release. The only module that talks
//! to both tiers, and so the one that owns the consume protocol:
//!
//! 1. verify the token (tag, binding, biz type) and ask the fleet's filter of
//!    issued ids ([`crate::bloom`]) whether it was ever issued: no I/O;
//! 2. Redis, one script: a consumed marker answers `duplicate` at once; for a
//!    durable type an unconsumed token gets a provisional marker (ours, with a
//!    deadline) and Postgres decides; for a fast type Redis decides;
//! 3. Postgres, one statement (durable types, or when Redis does not know the
//!    token): the primary key decides first use, `now()` decides expiry;
//! 4. Redis learns the decision afterwards, off the answer's path. A
//!    provisional marker past its deadline counts as absent, so a crash
//!    between 2 and 4 never burns a token.
//!
//! Degraded modes ([`crate::health`]): while Redis is slow a sample of durable
//! consumes skips step 2; while it is down durable consumes skip it, and fast
//! consumes go to Postgres behind a per-instance cache and rate limit (or, with
//! Postgres down too, are decided by this instance alone); what Redis missed
//! meanwhile is written to it when it is back.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use serde_json::Value as Json;

use crate::auth::Client;
use crate::bloom::{IssuedFilter, Verdict};
use crate::config::{BizSettings, Durability, Settings};
use crate::domain::{BizType, Fingerprint, RequestId, Subject};
use crate::durable::tokens::{
    self, ConsumeRow, Existing, ReleaseRow, ResultRow, TokenRecord, TokenState,
};
use crate::durable::{timed, DurableError, Pools};
use crate::fast::{Attempt, ConsumeMode, FastError, FastTier, FastWrite, Marker, ScriptOutcome};
use crate::health::Mode;
use crate::journal;
use crate::lease::WorkerLease;
use crate::metrics::{Metrics, Stat};
use crate::token::{Claims, Clock, TokenCodec, TokenError, VerifiedToken};
use crate::writer::Writer;

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
        match e {
            DurableError::Unavailable(_) | DurableError::TimedOut(_) => LedgerError::Unavailable {
                what: "postgres",
                retry_after_secs: 1,
                source: Some(e.into()),
            },
            DurableError::Other(_) => LedgerError::Internal(e.into()),
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DuplicateStatus {
    Processing,
    Completed,
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

/// A consume request, parsed.
#[derive(Debug, Clone)]
pub struct ConsumeInput {
    pub subject: Subject,
    pub biz_type: Option<BizType>,
    pub fingerprint: Option<Fingerprint>,
    pub request_id: Option<RequestId>,
}

/// Whether a result was recorded now or had been already (same value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultAnswer {
    Recorded,
    AlreadyRecorded,
}

/// What an earlier consume left behind, from either tier.
#[derive(Debug, Clone)]
struct Prior {
    consumed_at: Option<DateTime<Utc>>,
    fingerprint: Option<String>,
    request_id: Option<String>,
    result: Option<Json>,
}

impl Prior {
    fn from_marker(m: &Marker) -> Prior {
        Prior {
            consumed_at: ms_to_time(m.at_ms),
            fingerprint: m.fingerprint.clone(),
            request_id: m.request_id.clone(),
            result: m
                .result
                .as_deref()
                .and_then(|r| serde_json::from_str(r).ok()),
        }
    }
    fn from_row(e: &Existing) -> Prior {
        Prior {
            consumed_at: e.consumed_at,
            fingerprint: e.fingerprint.clone(),
            request_id: e.request_id.clone(),
            result: e.result.clone(),
        }
    }
}

fn ms_to_time(ms: i64) -> Option<DateTime<Utc>> {
    (ms > 0)
        .then(|| Utc.timestamp_millis_opt(ms).single())
        .flatten()
}

/// A write to Redis that could not be made while it was down, replayed when
/// it is back (so that a fast token consumed through Postgres meanwhile does
/// not look fresh to Redis afterwards).
#[derive(Debug, Clone)]
enum Resync {
    Consumed {
        token: String,
        marker: Marker,
    },
    Forget {
        token: String,
    },
    /// A fast consume this instance decided alone (Redis and Postgres both
    /// down): the consumed marker, then the journal entry that carries it to
    /// Postgres.
    FastConsumed {
        token: String,
        marker: Marker,
        journal: Vec<(&'static str, String)>,
    },
}

/// Fast consumes while Redis is down.
struct Fallback {
    /// Fast tokens this instance saw consumed while Redis was down (by
    /// Postgres, or by itself). Emptied when Redis is back and caught up.
    consumed: moka::sync::Cache<i64, Marker>,
    /// Fast tokens whose Redis consume script was sent but never answered:
    /// it may have consumed them, so they wait for Redis.
    uncertain: moka::sync::Cache<i64, ()>,
    /// Fast consumes this instance lets through per second meanwhile.
    limiter: DefaultDirectRateLimiter,
}

const RESYNC_LIMIT: usize = 100_000;

pub struct Ledger {
    settings: Arc<Settings>,
    codec: TokenCodec,
    clock: Arc<dyn Clock>,
    lease: Arc<WorkerLease>,
    fast: Arc<FastTier>,
    pools: Pools,
    metrics: Arc<Metrics>,
    writer: Writer,
    limiters: HashMap<BizType, DefaultKeyedRateLimiter<(String, String)>>,
    resync: Arc<Mutex<VecDeque<Resync>>>,
    fallback: Fallback,
    bloom: Arc<IssuedFilter>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("worker_id", &self.lease.worker_id())
            .finish()
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Ledger {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: Arc<Settings>,
        clock: Arc<dyn Clock>,
        lease: Arc<WorkerLease>,
        fast: Arc<FastTier>,
        pools: Pools,
        metrics: Arc<Metrics>,
        writer: Writer,
    ) -> Ledger {
        let limiters = settings
            .biz
            .iter()
            .filter_map(|(b, s)| {
                s.issue_rate.map(|r| {
                    (
                        b.clone(),
                        RateLimiter::keyed(Quota::per_second(r).allow_burst(r)),
                    )
                })
            })
            .collect();
        let bloom = Arc::new(IssuedFilter::new(settings.bloom.clone(), metrics.clone()));
        let fallback = Fallback {
            consumed: moka::sync::Cache::builder()
                .max_capacity(settings.redis.fallback_capacity)
                .time_to_live(settings.redis.consumed_ttl.max(Duration::from_secs(1)))
                .build(),
            uncertain: moka::sync::Cache::builder()
                .max_capacity(settings.redis.fallback_capacity)
                .time_to_live(settings.redis.consumed_ttl.max(Duration::from_secs(1)))
                .build(),
            limiter: RateLimiter::direct(
                Quota::per_second(settings.redis.fallback_rate)
                    .allow_burst(settings.redis.fallback_rate),
            ),
        };
        Ledger {
            fallback,
            bloom,
            codec: TokenCodec::new(settings.tokens.signing_keys.clone()),
            settings,
            clock,
            lease,
            fast,
            pools,
            metrics,
            writer,
            limiters,
            resync: Arc::new(Mutex::new(VecDeque::new())),
        }
    }

    pub fn codec(&self) -> &TokenCodec {
        &self.codec
    }
    pub fn settings(&self) -> &Settings {
        &self.settings
    }
    pub fn pools(&self) -> &Pools {
        &self.pools
    }
    pub fn fast(&self) -> &Arc<FastTier> {
        &self.fast
    }
    /// Drops the issue-rate state of pairs whose bucket is full again (they
    /// behave exactly as if never seen); returns how many pairs are left.
    pub fn prune_rate_limiters(&self) -> usize {
        self.limiters
            .values()
            .map(|l| {
                l.retain_recent();
                l.shrink_to_fit();
                l.len()
            })
            .sum()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
    /// The fleet-wide filter of issued token ids.
    pub fn bloom(&self) -> &Arc<IssuedFilter> {
        &self.bloom
    }
    pub fn worker_id(&self) -> u16 {
        self.lease.worker_id()
    }

    /// `normal`, `degraded` (Redis slow) or `redis_down` (breaker open).
    pub fn mode(&self) -> &'static str {
        self.fast.mode().as_str()
    }

    /// The biz type's settings, if it is configured (422) and granted (403).
    pub fn biz_settings_for(
        &self,
        caller: &Client,
        biz: &BizType,
    ) -> Result<&BizSettings, LedgerError> {
        let settings = self
            .settings
            .biz(biz)
            .ok_or_else(|| LedgerError::UnknownBizType(biz.to_string()))?;
        if !caller.may_use(biz) {
            return Err(LedgerError::Forbidden(biz.to_string()));
        }
        Ok(settings)
    }

    // ---- issue ------------------------------------------------------------

    #[tracing::instrument(level = "debug", skip_all, fields(biz_type = %biz, client = %caller.name))]
    pub async fn issue(
        &self,
        caller: &Client,
        biz: &BizType,
        subject: &Subject,
        ttl_seconds: Option<u64>,
    ) -> Result<Issued, LedgerError> {
        let settings = self.biz_settings_for(caller, biz)?;
        let max_ttl = settings.ttl.as_secs().max(1);
        // The floor keeps callers from minting tokens that die before use
        // (config validation keeps it between 1 s and the ttl).
        let min_ttl = settings.min_ttl.as_secs().clamp(1, max_ttl);
        let ttl = match ttl_seconds {
            None => max_ttl,
            Some(t) if (min_ttl..=max_ttl).contains(&t) => t,
            Some(_) => {
                return Err(LedgerError::InvalidRequest(format!(
                    "`ttl_seconds` must be between {min_ttl} and {max_ttl} for biz type `{biz}`"
                )))
            }
        };
        if let Some(limiter) = self.limiters.get(biz) {
            if let Err(not_until) =
                limiter.check_key(&(caller.name.clone(), subject.as_str().to_owned()))
            {
                self.metrics
                    .rate_limited
                    .with_label_values(&["issue"])
                    .inc();
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                return Err(LedgerError::RateLimited {
                    retry_after_secs: wait.as_secs_f64().ceil().max(1.0) as u64,
                });
            }
        }
        let id = self
            .lease
            .next_id()
            .ok_or_else(|| LedgerError::Unavailable {
                what: "token issuing (worker-id lease not renewed)",
                retry_after_secs: 1,
                source: None,
            })?;
        let now_ms = self.clock.now_ms();
        // Known to this instance's filter before anyone can present it; the
        // fleet hears of it when the issuance record commits.
        self.bloom.insert(id, now_ms);
        // Whole seconds in the token, rounded up: the token never lives less than asked.
        let exp_secs = (now_ms + ms(Duration::from_secs(ttl)) + 999) / 1000;
        let claims = Claims {
            biz_type: biz.clone(),
            id,
            exp: u32::try_from(exp_secs).map_err(|_| anyhow::anyhow!("expiry beyond 2106"))?,
        };
        let token = self.codec.sign(&claims, &caller.name, subject.as_str());
        let expires_at = ms_to_time(claims.expires_at_ms()).unwrap_or_else(Utc::now);
        let record = TokenRecord {
            id: id.as_i64(),
            token: token.clone(),
            biz_type: biz.to_string(),
            durability: settings.durability.as_str(),
            subject: subject.as_str().to_owned(),
            client: caller.name.clone(),
            issued_at: ms_to_time(id.timestamp_ms()).unwrap_or_else(Utc::now),
            expires_at,
        };
        // The issuance record (batched to Postgres) first: it is the audit
        // row `token.issued` and what tells the fleet's bloom filters the
        // token is genuine, so a token whose record cannot be kept is not
        // issued at all, whatever its durability.
        if !self.writer.issued(record) {
            return Err(LedgerError::Unavailable {
                what: "postgres (issuance buffer full)",
                retry_after_secs: 1,
                source: None,
            });
        }
        // Then Redis (before answering, when it is up), with a relative TTL.
        // A durable token needs no seed (a consume claims a missing key too),
        // so the degraded sample skips it. A token issued while Redis is down
        // is not seeded later either: its consume misses in Redis and goes to
        // Postgres, which knows whether another instance consumed it meanwhile.
        let seeded = if settings.durability == Durability::Durable && self.fast.health().bypass() {
            Err(FastError::Down)
        } else {
            self.fast
                .seed(&token, claims.expires_at_ms() - now_ms)
                .await
        };
        match seeded {
            Ok(()) | Err(FastError::Down) => {}
            Err(e) => {
                tracing::debug!(error = %e, "token not seeded in redis; consumes fall through to postgres")
            }
        }
        self.metrics
            .tokens_issued
            .with_label_values(&[biz.as_str()])
            .inc();
        self.metrics.stat(biz.as_str(), Stat::Issued);
        tracing::debug!(token = %crate::token::codec::redact(&token), "issued");
        Ok(Issued {
            token,
            biz_type: biz.clone(),
            subject: subject.clone(),
            expires_at,
            ttl_seconds: ttl,
        })
    }

    // ---- shared checks ----------------------------------------------------

    /// Verifies a presented token for `caller` and `subject`: the checks of
    /// API.md in their order (token: tag, then whether the fleet issued it;
    /// biz known, biz granted, binding). No I/O.
    pub fn authorize(
        &self,
        caller: &Client,
        text: &str,
        subject: &Subject,
        biz_type: Option<&BizType>,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        let token = self.verify(text)?;
        self.issued_by_fleet(&token)?;
        let settings = self.biz_settings_for(caller, &token.claims.biz_type)?;
        if !self
            .codec
            .is_bound_to(&token, &caller.name, subject.as_str())
            || biz_type.is_some_and(|b| *b != token.claims.biz_type)
        {
            self.count_consume(&token.claims.biz_type, "mismatch", None);
            return Err(LedgerError::TokenMismatch);
        }
        Ok((token, settings))
    }

    /// Parses and verifies the tag only.
    pub fn verify(&self, text: &str) -> Result<VerifiedToken, LedgerError> {
        self.codec.verify(text).map_err(|e: TokenError| {
            let prefix = text.split('_').next().unwrap_or("");
            self.count_invalid(BizType::parse(prefix).ok().as_ref());
            tracing::debug!(reason = %e, "token refused");
            LedgerError::TokenInvalid
        })
    }

    /// Refuses a verified token that the fleet's filter says was never
    /// issued (a valid tag under a leaked key, say). No I/O.
    pub fn issued_by_fleet(&self, token: &VerifiedToken) -> Result<(), LedgerError> {
        match self.bloom.check(token.claims.id, self.clock.now_ms()) {
            Verdict::Rejected => {
                self.count_invalid(Some(&token.claims.biz_type));
                tracing::debug!(token = %token.redacted(), "token refused: never issued by this fleet");
                Err(LedgerError::TokenInvalid)
            }
            Verdict::Known | Verdict::Young | Verdict::Uncovered => Ok(()),
        }
    }

    fn count_invalid(&self, biz: Option<&BizType>) {
        let biz = biz.filter(|b| self.settings.biz.contains_key(*b));
        let label = biz.map(BizType::as_str).unwrap_or("unknown");
        self.metrics
            .consume_total
            .with_label_values(&[label, "invalid"])
            .inc();
        if let Some(b) = biz {
            self.metrics.stat(b.as_str(), Stat::Invalid);
        }
    }

    /// The row a consume of `token` writes.
    pub fn record_for(
        &self,
        token: &VerifiedToken,
        settings: &BizSettings,
        caller: &Client,
        subject: &Subject,
    ) -> TokenRecord {
        let c = &token.claims;
        TokenRecord {
            id: c.id.as_i64(),
            token: token.text.clone(),
            biz_type: c.biz_type.to_string(),
            durability: settings.durability.as_str(),
            subject: subject.as_str().to_owned(),
            client: caller.name.clone(),
            issued_at: ms_to_time(c.issued_at_ms()).unwrap_or_else(Utc::now),
            expires_at: ms_to_time(c.expires_at_ms()).unwrap_or_else(Utc::now),
        }
    }

    /// Writes a consumed marker to Redis off the answer's path (queued for
    /// later when Redis is down). `owner`: our provisional marker, if we set one.
    pub fn settle_consumed_in_background(
        &self,
        token: &str,
        owner: Option<String>,
        marker: Marker,
    ) {
        let fast = self.fast.clone();
        let text = token.to_owned();
        let resync = self.resync.clone();
        tokio::spawn(async move {
            if let Err(e) = fast
                .settle_consumed(&text, owner.as_deref(), &marker, false)
                .await
            {
                tracing::debug!(error = %e, "consumed marker not written to redis; queued");
                push_resync(
                    &resync,
                    Resync::Consumed {
                        token: text,
                        marker,
                    },
                );
            }
        });
    }

    /// Counts a consume outcome (order events count as consumes too).
    pub fn count_consume(&self, biz: &BizType, outcome: &str, stat: Option<Stat>) {
        self.metrics
            .consume_total
            .with_label_values(&[biz.as_str(), outcome])
            .inc();
        if let Some(s) = stat {
            self.metrics.stat(biz.as_str(), s);
        }
    }

    // ---- consume ----------------------------------------------------------

    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn consume(
        &self,
        caller: &Client,
        text: &str,
        input: &ConsumeInput,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let (token, settings) =
            self.authorize(caller, text, &input.subject, input.biz_type.as_ref())?;
        let biz = token.claims.biz_type.clone();
        let record = self.record_for(&token, settings, caller, &input.subject);
        let answer = match settings.durability {
            Durability::Durable => self.consume_durable(&token, &record, input).await,
            Durability::Fast => self.consume_fast(&token, &record, input).await,
        };
        match &answer {
            Ok(ConsumeAnswer::Consumed {
                replayed: false, ..
            }) => self.count_consume(&biz, "consumed", Some(Stat::Consumed)),
            Ok(ConsumeAnswer::Consumed { replayed: true, .. }) => {
                self.count_consume(&biz, "replayed", None)
            }
            Ok(ConsumeAnswer::Duplicate { .. }) => {
                self.writer.duplicate(record.id);
                self.count_consume(&biz, "duplicate", Some(Stat::Duplicate))
            }
            Err(LedgerError::TokenExpired) => {
                self.count_consume(&biz, "expired", Some(Stat::Expired))
            }
            Err(LedgerError::FingerprintMismatch) => {
                self.count_consume(&biz, "fingerprint_mismatch", None)
            }
            Err(LedgerError::Unavailable { .. }) => self.count_consume(&biz, "unavailable", None),
            Err(_) => {}
        }
        tracing::debug!(token = %token.redacted(), outcome = ?answer.as_ref().map(|_| ()), "consume");
        answer
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
    /// (`tokens::consume`), timed and bounded like every payment-path call.
    async fn consume_in_postgres(
        &self,
        record: &TokenRecord,
        attempt: &Attempt<'_>,
    ) -> Result<ConsumeRow, DurableError> {
        timed(
            &self.metrics,
            "consume",
            self.pools.bounded(tokens::consume(
                &self.pools.hot,
                record,
                attempt.fingerprint,
                attempt.request_id,
            )),
        )
        .await
    }

    async fn consume_durable(
        &self,
        token: &VerifiedToken,
        record: &TokenRecord,
        input: &ConsumeInput,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let attempt = Attempt {
            owner: &owner,
            request_id: input.request_id.as_ref().map(RequestId::as_str),
            fingerprint: input.fingerprint.as_ref().map(Fingerprint::as_str),
        };
        let mode = if self.locally_expired(token) {
            ConsumeMode::Peek
        } else {
            ConsumeMode::Durable
        };
        let mut claimed = false;
        let reply = if self.fast.health().bypass() {
            self.metrics
                .redis_bypass
                .with_label_values(&["degraded_sample"])
                .inc();
            Err(FastError::Down)
        } else {
            self.fast
                .consume(&token.text, mode, &attempt, self.provisional_ms(), &[])
                .await
        };
        match reply {
            Ok(ScriptOutcome::Consumed(m)) => {
                if let Some(answer) = classify(&Prior::from_marker(&m), input, false)? {
                    return Ok(answer);
                }
            }
            // Another attempt is in flight. Racing copies of one request id
            // go to Postgres, which decides which copy answers first (the
            // others replay it); see `classify` for the rest.
            Ok(ScriptOutcome::Provisional(m)) => {
                if let Some(answer) = classify(&Prior::from_marker(&m), input, true)? {
                    return Ok(answer);
                }
            }
            Ok(ScriptOutcome::Claimed) => claimed = true,
            Ok(ScriptOutcome::Won { .. } | ScriptOutcome::Miss | ScriptOutcome::Issued) => {}
            Err(FastError::Down) => {}
            // The script may have run and left a provisional marker: it
            // expires. Postgres decides either way.
            Err(e) => tracing::debug!(error = %e, "redis failed; postgres decides alone"),
        }
        let row = self.consume_in_postgres(record, &attempt).await;
        let row = match row {
            Ok(r) => r,
            Err(e) => {
                if claimed {
                    self.spawn_unclaim(token, owner.clone());
                }
                return Err(LedgerError::postgres(e));
            }
        };
        self.settle_row(token, &row, claimed.then_some(owner.clone()), &attempt);
        answer_from_row(&row, input)
    }

    async fn consume_fast(
        &self,
        token: &VerifiedToken,
        record: &TokenRecord,
        input: &ConsumeInput,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let attempt = Attempt {
            owner: "",
            request_id: input.request_id.as_ref().map(RequestId::as_str),
            fingerprint: input.fingerprint.as_ref().map(Fingerprint::as_str),
        };
        let expired = self.locally_expired(token);
        let mode = if expired {
            ConsumeMode::Peek
        } else {
            ConsumeMode::Fast
        };
        let fields = journal::consume_fields(record, attempt.request_id, attempt.fingerprint);
        match self
            .fast
            .consume(&token.text, mode, &attempt, self.provisional_ms(), &fields)
            .await
        {
            Ok(ScriptOutcome::Won { at_ms }) => {
                return Ok(ConsumeAnswer::Consumed {
                    consumed_at: ms_to_time(at_ms).unwrap_or_else(Utc::now),
                    replayed: false,
                })
            }
            Ok(ScriptOutcome::Consumed(m)) => {
                if let Some(answer) = classify(&Prior::from_marker(&m), input, false)? {
                    return Ok(answer);
                }
            }
            Ok(ScriptOutcome::Provisional(m)) => {
                if let Some(answer) = classify(&Prior::from_marker(&m), input, true)? {
                    return Ok(answer);
                }
            }
            // Issued but past our expiry: Postgres says whether it was consumed.
            Ok(ScriptOutcome::Issued | ScriptOutcome::Claimed | ScriptOutcome::Miss) => {}
            // Nothing reached Redis (breaker open, connection refused).
            Err(FastError::Down) => {
                return self
                    .consume_fast_down(token, record, input, &attempt, expired)
                    .await
            }
            // The script may have run and consumed the token before the reply
            // was lost (or may still run, late): deciding again elsewhere
            // could consume it twice. The caller retries with its request_id
            // and learns the outcome; until Redis answers again, this
            // instance does not decide the token without it.
            Err(e) => {
                self.fallback.uncertain.insert(record.id, ());
                return Err(LedgerError::Unavailable {
                    what: "redis (outcome unknown; retry with the same request_id)",
                    retry_after_secs: 1,
                    source: Some(e.into()),
                });
            }
        }
        if expired {
            return self.expired_fast(record, input).await;
        }
        // Redis lost the key or never had it: Postgres decides.
        let row = self
            .consume_in_postgres(record, &attempt)
            .await
            .map_err(LedgerError::postgres)?;
        self.settle_row(token, &row, None, &attempt);
        answer_from_row(&row, input)
    }

    /// A fast token past its expiry on our clock: never consumed behind
    /// Redis's back; Postgres says whether it was consumed before.
    async fn expired_fast(
        &self,
        record: &TokenRecord,
        input: &ConsumeInput,
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
                answer_from_row(&ConsumeRow::Existing(e), input)
            }
            _ => Err(LedgerError::TokenExpired),
        }
    }

    /// A fast consume while Redis is skipped. Duplicates this instance has
    /// seen meanwhile are answered from memory; first uses, at most
    /// `redis.fallback_rate` per second (more: 503), are decided by Postgres,
    /// which is exact across the fleet. With Postgres unreachable too, this
    /// instance decides alone (exactly once per instance) and the decision
    /// reaches Redis and the journal when Redis is back.
    async fn consume_fast_down(
        &self,
        token: &VerifiedToken,
        record: &TokenRecord,
        input: &ConsumeInput,
        attempt: &Attempt<'_>,
        expired: bool,
    ) -> Result<ConsumeAnswer, LedgerError> {
        self.metrics.redis_bypass.with_label_values(&["down"]).inc();
        if let Some(m) = self.fallback.consumed.get(&record.id) {
            if let Some(answer) = classify(&Prior::from_marker(&m), input, false)? {
                return Ok(answer);
            }
        }
        if expired {
            return self.expired_fast(record, input).await;
        }
        if self.fallback.uncertain.contains_key(&record.id) {
            return Err(LedgerError::Unavailable {
                what: "redis (an earlier consume of this token may have run there; retry with the same request_id)",
                retry_after_secs: 1,
                source: None,
            });
        }
        if self.fallback.limiter.check().is_err() {
            return Err(LedgerError::Unavailable {
                what: "fast consumes while redis is down (over redis.fallback_rate)",
                retry_after_secs: 1,
                source: None,
            });
        }
        let row = self.consume_in_postgres(record, attempt).await;
        match row {
            Ok(row) => {
                if let Some(m) = self.marker_of(&row, attempt) {
                    self.fallback.consumed.insert(record.id, m);
                }
                self.settle_row(token, &row, None, attempt);
                answer_from_row(&row, input)
            }
            Err(e) if e.is_unavailable() => {
                tracing::debug!(error = %e, "redis and postgres down: this instance decides");
                self.consume_fast_in_memory(token, record, input, attempt)
            }
            Err(e) => Err(LedgerError::postgres(e)),
        }
    }

    /// Decides a fast consume in this process: the first attempt here wins.
    fn consume_fast_in_memory(
        &self,
        token: &VerifiedToken,
        record: &TokenRecord,
        input: &ConsumeInput,
        attempt: &Attempt<'_>,
    ) -> Result<ConsumeAnswer, LedgerError> {
        let marker = Marker {
            at_ms: self.clock.now_ms(),
            request_id: attempt.request_id.map(str::to_owned),
            fingerprint: attempt.fingerprint.map(str::to_owned),
            result: None,
        };
        let entry = self
            .fallback
            .consumed
            .entry(record.id)
            .or_insert_with(|| marker.clone());
        if !entry.is_fresh() {
            let prior = Prior::from_marker(entry.value());
            return Ok(
                classify(&prior, input, false)?.unwrap_or(ConsumeAnswer::Duplicate {
                    status: DuplicateStatus::Processing,
                    consumed_at: prior.consumed_at,
                    result: None,
                }),
            );
        }
        let mut journal = journal::consume_fields(record, attempt.request_id, attempt.fingerprint);
        journal.push(("at", marker.at_ms.to_string()));
        let queued = push_resync(
            &self.resync,
            Resync::FastConsumed {
                token: token.text.clone(),
                marker: marker.clone(),
                journal,
            },
        );
        if !queued {
            self.fallback.consumed.invalidate(&record.id);
            return Err(LedgerError::Unavailable {
                what: "redis and postgres (the queue of writes for redis is full)",
                retry_after_secs: 1,
                source: None,
            });
        }
        self.metrics
            .redis_bypass
            .with_label_values(&["memory"])
            .inc();
        Ok(ConsumeAnswer::Consumed {
            consumed_at: ms_to_time(marker.at_ms).unwrap_or_else(Utc::now),
            replayed: false,
        })
    }

    /// The consumed marker a Postgres row stands for (`None`: not consumed).
    fn marker_of(&self, row: &ConsumeRow, attempt: &Attempt<'_>) -> Option<Marker> {
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

    /// Tells Redis what Postgres decided, off the answer's path.
    fn settle_row(
        &self,
        token: &VerifiedToken,
        row: &ConsumeRow,
        owner: Option<String>,
        attempt: &Attempt<'_>,
    ) {
        let Some(marker) = self.marker_of(row, attempt) else {
            if let Some(owner) = owner {
                self.spawn_unclaim(token, owner);
            }
            return;
        };
        self.settle_consumed_in_background(&token.text, owner, marker);
    }

    fn spawn_unclaim(&self, token: &VerifiedToken, owner: String) {
        let fast = self.fast.clone();
        let text = token.text.clone();
        let remaining = token.claims.expires_at_ms() - self.clock.now_ms();
        tokio::spawn(async move {
            // If this fails the marker's deadline frees the token anyway.
            let _ = fast.unclaim(&text, &owner, remaining).await;
        });
    }

    /// Replays Redis writes queued while it was down. Returns how many remain.
    /// Once none remain and Redis is up, this instance's memory of fast
    /// consumes is dropped: Redis knows them now.
    pub async fn resync_redis(&self) -> usize {
        let mut replayed = 0usize;
        let journal_left = self.fast.flush_journal_backlog().await;
        let left = journal_left
            + loop {
                let next = {
                    let mut q = self.resync.lock().unwrap_or_else(|p| p.into_inner());
                    q.pop_front()
                };
                let Some(item) = next else { break 0 };
                let done = match &item {
                    Resync::Consumed { token, marker } => {
                        self.fast.settle_consumed(token, None, marker, true).await
                    }
                    Resync::Forget { token } => self.fast.forget(token).await,
                    Resync::FastConsumed {
                        token,
                        marker,
                        journal,
                    } => match self.fast.settle_consumed(token, None, marker, true).await {
                        Ok(()) => self.fast.append_journal(journal).await,
                        Err(e) => Err(e),
                    },
                };
                if done.is_err() {
                    let mut q = self.resync.lock().unwrap_or_else(|p| p.into_inner());
                    q.push_front(item);
                    break q.len();
                }
                replayed += 1;
            };
        self.metrics.resync_depth.set(left as i64);
        if replayed > 0 {
            tracing::info!(
                replayed,
                left,
                "redis writes queued while it was down replayed"
            );
        }
        if left == 0 && self.fast.mode() != Mode::RedisDown {
            self.fallback.consumed.invalidate_all();
            self.fallback.uncertain.invalidate_all();
        }
        left
    }

    /// Redis writes waiting for Redis.
    pub fn resync_pending(&self) -> usize {
        self.resync.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

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
                    if !push_resync(
                        &self.resync,
                        Resync::Forget {
                            token: token.text.clone(),
                        },
                    ) {
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

/// Queues a write for Redis; `false` when the queue is full.
fn push_resync(queue: &Mutex<VecDeque<Resync>>, item: Resync) -> bool {
    let mut q = queue.lock().unwrap_or_else(|p| p.into_inner());
    if q.len() < RESYNC_LIMIT {
        q.push_back(item);
        true
    } else {
        false
    }
}

fn same_request(prior: &Prior, input: &ConsumeInput) -> bool {
    matches!((&prior.request_id, &input.request_id), (Some(a), Some(b)) if a == b.as_str())
}

/// Decides the answer to an attempt that found an earlier consume.
/// `None`: it cannot be decided from this prior (the same request in flight).
fn classify(
    prior: &Prior,
    input: &ConsumeInput,
    in_flight: bool,
) -> Result<Option<ConsumeAnswer>, LedgerError> {
    // A provisional marker belongs to an attempt whose outcome is not known
    // yet (it may fail, or it may itself be a duplicate that found the token
    // consumed in Postgres). Only a plain duplicate, with no request id or
    // fingerprint to compare, is answered from it; anything that needs the
    // winner's identity goes to Postgres.
    if in_flight && (input.request_id.is_some() || input.fingerprint.is_some()) {
        return Ok(None);
    }
    if let (Some(a), Some(b)) = (&prior.fingerprint, &input.fingerprint) {
        if a != b.as_str() {
            return Err(LedgerError::FingerprintMismatch);
        }
    }
    if same_request(prior, input) {
        return Ok(Some(ConsumeAnswer::Consumed {
            consumed_at: prior.consumed_at.unwrap_or_else(Utc::now),
            replayed: true,
        }));
    }
    let status = if prior.result.is_some() && !in_flight {
        DuplicateStatus::Completed
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

fn answer_from_row(row: &ConsumeRow, input: &ConsumeInput) -> Result<ConsumeAnswer, LedgerError> {
    match row {
        ConsumeRow::Won { consumed_at } => Ok(ConsumeAnswer::Consumed {
            consumed_at: *consumed_at,
            replayed: false,
        }),
        ConsumeRow::Existing(e) if e.state == TokenState::Consumed => {
            classify(&Prior::from_row(e), input, false).map(|a| {
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
