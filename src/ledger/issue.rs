//! The [`Issuer`]: issuing a token of a biz type the caller may use: the
//! ttl bounds, the per-(client, subject) rate limit, a snowflake id from the
//! leased worker id, the signed token (known to the fleet's filter at once),
//! its issuance record (batched to Postgres) and its Redis seed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

use super::api::{Issued, LedgerError};
use super::util::{ms, ms_to_time};
use crate::auth::Client;
use crate::clock::Clock;
use crate::config::{BizSettings, Durability, Settings};
use crate::domain::{BizType, Subject};
use crate::durable::tokens::TokenRecord;
use crate::fast::{FastError, FastTier};
use crate::issuance::filter::IssuedFilter;
use crate::issuance::lease::WorkerLease;
use crate::issuance::writer::Writer;
use crate::metrics::{Metrics, Stat};
use crate::token::{Claims, TokenCodec};

/// The issue rate per (client, subject), per biz type that sets `issue_rate`.
struct IssueLimits(HashMap<BizType, DefaultKeyedRateLimiter<(String, String)>>);

impl IssueLimits {
    fn new(settings: &Settings) -> IssueLimits {
        IssueLimits(
            settings
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
                .collect(),
        )
    }

    /// `Err(seconds to wait)` when this pair is over its biz type's rate.
    fn check(&self, biz: &BizType, client: &str, subject: &Subject) -> Result<(), u64> {
        let Some(limiter) = self.0.get(biz) else {
            return Ok(());
        };
        limiter
            .check_key(&(client.to_owned(), subject.as_str().to_owned()))
            .map_err(|not_until| {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                wait.as_secs_f64().ceil().max(1.0) as u64
            })
    }

    /// Drops the state of pairs whose bucket is full again; returns how many
    /// pairs are left.
    fn prune(&self) -> usize {
        self.0
            .values()
            .map(|l| {
                l.retain_recent();
                l.shrink_to_fit();
                l.len()
            })
            .sum()
    }
}

/// Issues tokens: the rate limiters, the worker-id lease ids come from, the
/// issuance writer, the codec that signs, the filter each new id goes into
/// and Redis, where a token is seeded.
pub struct Issuer {
    limiters: IssueLimits,
    lease: Arc<WorkerLease>,
    writer: Writer,
    codec: TokenCodec,
    filter: Arc<IssuedFilter>,
    fast: Arc<FastTier>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
}

impl Issuer {
    /// The rate limiters are those of `settings`' biz types.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: &Settings,
        lease: Arc<WorkerLease>,
        writer: Writer,
        codec: TokenCodec,
        filter: Arc<IssuedFilter>,
        fast: Arc<FastTier>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Issuer {
        Issuer {
            limiters: IssueLimits::new(settings),
            lease,
            writer,
            codec,
            filter,
            fast,
            clock,
            metrics,
        }
    }

    /// The snowflake worker id this instance leases.
    pub fn worker_id(&self) -> u16 {
        self.lease.worker_id()
    }

    /// Drops the issue-rate state of pairs whose bucket is full again (they
    /// behave exactly as if never seen); returns how many pairs are left.
    pub fn prune_rate_limiters(&self) -> usize {
        self.limiters.prune()
    }

    /// Issues a token of `biz`, whose `settings` the caller was checked for
    /// (known and granted: [`super::verify::Verifier::biz_settings_for`]).
    pub(super) async fn issue(
        &self,
        settings: &BizSettings,
        caller: &Client,
        biz: &BizType,
        subject: &Subject,
        ttl_seconds: Option<u64>,
    ) -> Result<Issued, LedgerError> {
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
        if let Err(retry_after_secs) = self.limiters.check(biz, &caller.name, subject) {
            self.metrics
                .rate_limited
                .with_label_values(&["issue"])
                .inc();
            return Err(LedgerError::RateLimited { retry_after_secs });
        }
        let (id, lease) = self
            .lease
            .allocate()
            .ok_or_else(|| LedgerError::Unavailable {
                what: "token issuing (worker-id lease not renewed)",
                retry_after_secs: 1,
                source: None,
            })?;
        let now_ms = self.clock.now_ms();
        // Known to this instance's filter before anyone can present it; the
        // fleet hears of it when the issuance record commits, and until then
        // the id is above this lease's issuance mark (outstanding from
        // `allocate` until the record commits), so no peer refuses it.
        self.filter.insert(id, now_ms);
        // Whole seconds in the token, rounded up: the token never lives less than asked.
        let exp_secs = (now_ms + ms(Duration::from_secs(ttl)) + 999) / 1000;
        let Ok(exp) = u32::try_from(exp_secs) else {
            lease.abandon(id);
            return Err(anyhow::anyhow!("expiry beyond 2106").into());
        };
        let claims = Claims {
            biz_type: biz.clone(),
            id,
            exp,
        };
        let token = self.codec.sign(&claims, &caller.name, subject.as_str());
        let expires_at = ms_to_time(claims.expires_at_ms()).unwrap_or_else(|| self.clock.now());
        let record = TokenRecord {
            id: id.as_i64(),
            token: token.clone(),
            biz_type: biz.to_string(),
            durability: settings.durability,
            subject: subject.as_str().to_owned(),
            client: caller.name.clone(),
            issued_at: ms_to_time(id.timestamp_ms()).unwrap_or_else(|| self.clock.now()),
            expires_at,
            key: None,
        };
        // The issuance record (batched to Postgres) first: it is the audit
        // row `token.issued` and what tells the fleet's bloom filters the
        // token is genuine, so a token whose record cannot be kept is not
        // issued at all, whatever its durability.
        if !self.writer.issued(record, &lease) {
            lease.abandon(id);
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
}
