//! Phase 3: keyset pages of the tokens Postgres holds as issued and live,
//! against Redis (`redis_missing_but_live`: re-seeded).

use std::collections::HashMap;

use futures_util::stream::{self, StreamExt};

use super::report::{Class, Phase};
use super::run::{PhaseError, Run};
use crate::durable::reconcile::{self as sql, Repair};
use crate::fast::{FastError, KeyState};
use crate::token::SnowflakeId;

/// Tokens this close to expiry are left alone by the re-seed.
const RESEED_MARGIN_MS: i64 = 2_000;
/// Re-seed scripts in flight at once.
const RESEED_IN_FLIGHT: usize = 32;

impl Run<'_> {
    /// Phase 3: tokens Postgres holds as issued and live, against Redis.
    pub(super) async fn live_tokens(&mut self) -> Result<(), PhaseError> {
        self.progress.phase(Phase::LiveTokens, None);
        let min_id = self
            .since
            .map(|t| SnowflakeId::from_parts(t.timestamp_millis(), 0, 0).as_i64())
            .unwrap_or(0);
        let mut after = None;
        loop {
            if self.cancel.is_cancelled() {
                return Ok(());
            }
            let page = sql::live_issued_page(
                self.pool(),
                after,
                min_id,
                RESEED_MARGIN_MS,
                self.r.batch as i64,
            )
            .await?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            after = Some((last.expires_at, last.id));
            self.scanned.tokens += page.len() as u64;
            let texts: Vec<String> = page.iter().map(|t| t.token.clone()).collect();
            let states = self.r.fast.key_states(&texts).await?;
            let missing: Vec<&sql::LiveToken> = page
                .iter()
                .zip(&states)
                .filter(|(_, k)| k.state == KeyState::Missing)
                .map(|(t, _)| t)
                .collect();
            self.found
                .add(Class::RedisMissingButLive, missing.len() as u64);
            if !self.opts.dry_run && !missing.is_empty() {
                // One script per key, a few in flight at once (a Redis that
                // lost everything needs every live token back).
                let fast = self.r.fast.clone();
                let outcomes: Vec<Result<(bool, &sql::LiveToken), FastError>> =
                    stream::iter(missing.iter().copied())
                        .map(|t| {
                            let fast = fast.clone();
                            async move {
                                fast.reseed(&t.token, t.remaining_ms, t.gen)
                                    .await
                                    .map(|ok| (ok, t))
                            }
                        })
                        .buffer_unordered(RESEED_IN_FLIGHT)
                        .collect()
                        .await;
                // Seeds made before a Redis error are still checked and
                // audited below; the error ends the phase afterwards.
                let mut seeded = Vec::new();
                let mut failed: Option<PhaseError> = None;
                for o in outcomes {
                    match o {
                        Ok((true, t)) => seeded.push(t),
                        Ok((false, _)) => {}
                        Err(e) => failed = failed.or(Some(e.into())),
                    }
                }
                // A consume may have won in Postgres between our read and the
                // seed: take the seed back so Redis never shows it live.
                let ids: Vec<i64> = seeded.iter().map(|t| t.id).collect();
                let won: HashMap<i64, i64> = sql::consumed_among(self.pool(), &ids)
                    .await?
                    .into_iter()
                    .collect();
                let mut repairs = Vec::new();
                for t in seeded {
                    if let Some(&gen) = won.get(&t.id) {
                        if let Err(e) = self.r.fast.drop_if_issued(&t.token, gen).await {
                            failed = failed.or(Some(e.into()));
                        }
                        continue;
                    }
                    self.repaired.add(Class::RedisMissingButLive, 1);
                    repairs.push(Repair {
                        class: Class::RedisMissingButLive.as_str(),
                        action: "reseeded",
                        token_id: Some(t.id),
                        token: Some(t.token.clone()),
                        subject: Some(t.subject.clone()),
                        biz_type: Some(t.biz_type.clone()),
                        client: Some(t.client.clone()),
                        count: None,
                    });
                }
                sql::record_repairs(self.pool(), &self.opts.by, &repairs).await?;
                if let Some(e) = failed {
                    return Err(e);
                }
            }
            self.progress.advance(page.len() as u64);
        }
    }
}
