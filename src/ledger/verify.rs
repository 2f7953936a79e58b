//! The [`Verifier`]: the checks every operation on a token shares (step 1
//! in [`super`]): the tag, the fleet's filter of issued ids, the biz type
//! known and granted, the binding to client and subject. No I/O.

use std::sync::Arc;

use super::api::{ConsumeOutcome, LedgerError};
use super::util::{count_consume, ms_to_time, Tally};
use crate::auth::Client;
use crate::clock::Clock;
use crate::config::{BizSettings, Durability, Settings};
use crate::domain::{BizType, Subject};
use crate::durable::tokens::TokenRecord;
use crate::issuance::filter::{IssuedFilter, Verdict};
use crate::metrics::Metrics;
use crate::token::{TokenCodec, TokenError, VerifiedToken};

/// Verifies presented tokens and callers' grants: the codec (tags and
/// bindings), the fleet's filter of issued ids, the biz types' settings.
/// A refusal that counts as a consume attempt counts itself.
pub struct Verifier {
    settings: Arc<Settings>,
    codec: TokenCodec,
    filter: Arc<IssuedFilter>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
}

impl Verifier {
    pub fn new(
        settings: Arc<Settings>,
        codec: TokenCodec,
        filter: Arc<IssuedFilter>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Verifier {
        Verifier {
            settings,
            codec,
            filter,
            clock,
            metrics,
        }
    }

    /// The biz type's settings, if it is configured (422) and granted (403).
    pub(super) fn biz_settings_for(
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

    /// Verifies a presented token for `caller` and `subject`: the checks of
    /// API.md in their order (token: tag, then whether the fleet issued it;
    /// biz known, biz granted, binding). No I/O.
    pub(super) fn authorize(
        &self,
        caller: &Client,
        text: &str,
        subject: &Subject,
        biz_type: Option<&BizType>,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        let (token, settings) = self.authorize_unbound(caller, text)?;
        if !self.is_bound(&token, caller, subject)
            || biz_type.is_some_and(|b| *b != token.claims.biz_type)
        {
            count_consume(
                &self.metrics,
                &token.claims.biz_type,
                ConsumeOutcome::Mismatch,
            );
            return Err(LedgerError::TokenMismatch);
        }
        Ok((token, settings))
    }

    /// The checks that need no subject: tag, issued by the fleet, biz type
    /// known and granted. A refusal counts as a consume attempt.
    pub(super) fn authorize_unbound(
        &self,
        caller: &Client,
        text: &str,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        self.authorize_unbound_as(caller, text, Tally::Consume)
    }

    /// [`Verifier::authorize_unbound`], counting a refusal as `tally` says.
    pub(super) fn authorize_unbound_as(
        &self,
        caller: &Client,
        text: &str,
        tally: Tally,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        let token = self.verify(text, tally)?;
        self.issued_by_fleet(&token, tally)?;
        let settings = self.biz_settings_for(caller, &token.claims.biz_type)?;
        Ok((token, settings))
    }

    /// [`Self::authorize_unbound_as`] for a read: admins and auditors read
    /// every biz type; any other client only those it is granted.
    pub(super) fn authorize_read_as(
        &self,
        caller: &Client,
        text: &str,
    ) -> Result<(VerifiedToken, &BizSettings), LedgerError> {
        if !caller.reads_all() {
            return self.authorize_unbound_as(caller, text, Tally::Quiet);
        }
        let token = self.verify(text, Tally::Quiet)?;
        self.issued_by_fleet(&token, Tally::Quiet)?;
        let biz = &token.claims.biz_type;
        let settings = self
            .settings
            .biz(biz)
            .ok_or_else(|| LedgerError::UnknownBizType(biz.to_string()))?;
        Ok((token, settings))
    }

    /// Whether the token was issued to this client for this subject.
    pub(super) fn is_bound(
        &self,
        token: &VerifiedToken,
        caller: &Client,
        subject: &Subject,
    ) -> bool {
        self.codec
            .is_bound_to(token, &caller.name, subject.as_str())
    }

    /// The token whose tag verifies, checked for nothing else and counting
    /// nothing (`None`: a refusal the full checks will count).
    pub(super) fn tag_only(&self, text: &str) -> Option<VerifiedToken> {
        self.codec.verify(text).ok()
    }

    /// Parses and verifies the tag only.
    fn verify(&self, text: &str, tally: Tally) -> Result<VerifiedToken, LedgerError> {
        self.codec.verify(text).map_err(|e: TokenError| {
            if tally == Tally::Consume {
                let prefix = text.split('_').next().unwrap_or("");
                self.count_invalid(BizType::parse(prefix).ok().as_ref());
            }
            tracing::debug!(reason = %e, "token refused");
            LedgerError::TokenInvalid
        })
    }

    /// Refuses a verified token that the fleet's filter says was never
    /// issued (a valid tag under a leaked key, say). No I/O.
    fn issued_by_fleet(&self, token: &VerifiedToken, tally: Tally) -> Result<(), LedgerError> {
        match self.filter.check(token.claims.id, self.clock.now_ms()) {
            Verdict::Rejected => {
                if tally == Tally::Consume {
                    self.count_invalid(Some(&token.claims.biz_type));
                }
                tracing::debug!(token = %token.redacted(), "token refused: never issued by this fleet");
                Err(LedgerError::TokenInvalid)
            }
            Verdict::Known | Verdict::Young | Verdict::Uncovered | Verdict::Unrecorded => Ok(()),
        }
    }

    fn count_invalid(&self, biz: Option<&BizType>) {
        match biz.filter(|b| self.settings.biz.contains_key(*b)) {
            Some(b) => count_consume(&self.metrics, b, ConsumeOutcome::Invalid),
            // Not a biz type of ours: no stats row for it.
            None => self
                .metrics
                .consume_total
                .with_label_values(&["unknown", ConsumeOutcome::Invalid.as_str()])
                .inc(),
        }
    }

    /// The row a consume of `token` writes.
    pub(super) fn record_for(
        &self,
        token: &VerifiedToken,
        durability: Durability,
        caller: &Client,
        subject: &Subject,
    ) -> TokenRecord {
        let c = &token.claims;
        TokenRecord {
            id: c.id.as_i64(),
            token: token.text.clone(),
            biz_type: c.biz_type.as_str().to_owned(),
            durability,
            subject: subject.as_str().to_owned(),
            client: caller.name.clone(),
            issued_at: ms_to_time(c.issued_at_ms()).unwrap_or_else(|| self.clock.now()),
            expires_at: ms_to_time(c.expires_at_ms()).unwrap_or_else(|| self.clock.now()),
            key: None,
        }
    }
}
