//! Phase 2: a `SCAN` of every token's and client key's hash in Redis, page by page, against
//! Postgres (`redis_live_but_consumed`, `stale_provisional`,
//! `redis_consumed_but_live`).

use std::collections::HashSet;

use super::report::{Class, Phase};
use super::run::{marker_of, repair_of, PhaseError, Run};
use crate::config::Durability;
use crate::durable::reconcile::{self as sql, Repair};
use crate::durable::tokens::TokenState;
use crate::fast::{FastError, KeyRead, KeyState};
use crate::token::SnowflakeId;

impl Run<'_> {
    /// Phase 2: every token key in Redis against Postgres.
    pub(super) async fn redis_keys(&mut self) -> Result<(), PhaseError> {
        self.progress.phase(Phase::RedisKeys, None);
        let since_ms = self.since.map(|t| t.timestamp_millis());
        for node in self.r.fast.scan_nodes().await? {
            let mut cursor = 0u64;
            loop {
                if self.cancel.is_cancelled() {
                    return Ok(());
                }
                let (next, texts) = self.r.fast.scan_tokens(&node, cursor, self.r.batch).await?;
                let mut seen = HashSet::new();
                let page: Vec<(String, SnowflakeId, i64)> = texts
                    .into_iter()
                    .filter(|t| seen.insert(t.clone()))
                    .filter_map(|t| {
                        // A client key's hash: its id follows from its handle;
                        // it has no expiry of its own (and no issue time for
                        // `since`).
                        if let Some(id) = crate::domain::key::id_of_handle(&t) {
                            return Some((t, SnowflakeId(id as u64), 0));
                        }
                        let v = self.r.codec.verify(&t).ok()?;
                        let issued = v.claims.issued_at_ms();
                        if since_ms.is_some_and(|s| issued < s) {
                            return None;
                        }
                        Some((t, v.claims.id, v.claims.expires_at_ms()))
                    })
                    .collect();
                self.page_of_keys(&page).await?;
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(())
    }

    async fn page_of_keys(
        &mut self,
        page: &[(String, SnowflakeId, i64)],
    ) -> Result<(), PhaseError> {
        if page.is_empty() {
            return Ok(());
        }
        self.scanned.tokens += page.len() as u64;
        let texts: Vec<String> = page.iter().map(|p| p.0.clone()).collect();
        let states = self.r.fast.key_states(&texts).await?;
        // A provisional deadline is judged by the clock of the key's own
        // node (the one that set it, and that the repair script checks it by).
        let suspects: Vec<usize> = states
            .iter()
            .enumerate()
            .filter(|(_, k)| match k.state {
                KeyState::Issued | KeyState::Consumed => true,
                KeyState::Provisional { .. } => k.stale_provisional(),
                _ => false,
            })
            .map(|(i, _)| i)
            .collect();
        if suspects.is_empty() {
            self.progress.advance(page.len() as u64);
            return Ok(());
        }
        let ids: Vec<i64> = suspects.iter().map(|&i| page[i].1.as_i64()).collect();
        let rows = sql::tokens_by_ids(self.pool(), &ids).await?;
        // A Redis error stops the page, but the repairs made before it are
        // still audited (then the error ends the phase).
        let mut repairs = Vec::new();
        let mut failed: Option<PhaseError> = None;
        for i in suspects {
            let (text, id, exp_ms) = &page[i];
            let row = rows.get(&id.as_i64());
            match self
                .key_repair(text, states[i], row, exp_ms - states[i].now_ms)
                .await
            {
                Ok(Some((class, action))) => repairs.push(match row {
                    Some(t) => repair_of(class, action, t),
                    None => Repair {
                        class: class.as_str(),
                        action,
                        token_id: Some(id.as_i64()),
                        token: Some(text.clone()),
                        subject: None,
                        biz_type: text.split('_').next().map(str::to_owned),
                        client: None,
                        count: None,
                    },
                }),
                Ok(None) => {}
                Err(e) => {
                    failed = Some(e.into());
                    break;
                }
            }
        }
        sql::record_repairs(self.pool(), &self.opts.by, &repairs).await?;
        if let Some(e) = failed {
            return Err(e);
        }
        self.progress.advance(page.len() as u64);
        Ok(())
    }

    /// Compares one Redis key with Postgres's row, counts what diverged and
    /// (unless a dry run) repairs it; returns the repair made, for its audit
    /// event. `left_ms`: the token's time to live by its embedded expiry,
    /// used when Postgres has no row.
    async fn key_repair(
        &mut self,
        text: &str,
        key: KeyRead,
        row: Option<&sql::PgToken>,
        left_ms: i64,
    ) -> Result<Option<(Class, &'static str)>, FastError> {
        let consumed = row.filter(|t| t.state == TokenState::Consumed);
        match key.state {
            // Postgres consumed the token at a newer generation than the
            // issued state Redis holds (a fast release Redis decided and the
            // journal has not carried yet is newer: left alone).
            KeyState::Issued => {
                let Some(t) = consumed.filter(|t| key.gen() < t.gen) else {
                    return Ok(None);
                };
                self.found.add(Class::RedisLiveButConsumed, 1);
                if self.opts.dry_run || !self.r.fast.drop_if_issued(text, t.gen).await? {
                    return Ok(None);
                }
                self.repaired.add(Class::RedisLiveButConsumed, 1);
                Ok(Some((Class::RedisLiveButConsumed, "deleted")))
            }
            // Redis never decides a durable consume: Postgres holds it live.
            KeyState::Consumed => {
                let Some(t) = row.filter(|t| {
                    t.state == TokenState::Issued && t.durability == Durability::Durable.as_str()
                }) else {
                    return Ok(None);
                };
                // A marker of the same or a newer generation than Postgres's
                // issued state records a consume Postgres does not know (it
                // was restored to an earlier point): evidence, kept for a
                // human, never turned back to live.
                if key.gen() >= t.gen {
                    self.found.add(Class::RedisAheadOfPostgres, 1);
                    if self.ahead.len() < super::report::MAX_LISTED {
                        self.ahead.push(text.to_owned());
                    }
                    tracing::warn!(
                        token = %crate::token::codec::redact(text),
                        redis_gen = key.gen(),
                        postgres_gen = t.gen,
                        "reconcile: redis holds a consume postgres does not know; kept"
                    );
                    return Ok(None);
                }
                self.found.add(Class::RedisConsumedButLive, 1);
                if self.opts.dry_run
                    || !self
                        .r
                        .fast
                        .give_way(text, key.stored_gen, t.gen, t.remaining_ms)
                        .await?
                {
                    return Ok(None);
                }
                self.repaired.add(Class::RedisConsumedButLive, 1);
                let action = if t.remaining_ms > 0 {
                    "reset_to_issued"
                } else {
                    "deleted"
                };
                Ok(Some((Class::RedisConsumedButLive, action)))
            }
            KeyState::Provisional { .. } => {
                self.found.add(Class::StaleProvisional, 1);
                if self.opts.dry_run {
                    return Ok(None);
                }
                let remaining = row.map(|t| t.remaining_ms).unwrap_or(left_ms);
                let marker = consumed.map(|t| (marker_of(t), t.gen));
                let issued_gen = row.map(|t| t.gen).unwrap_or(-1);
                let cleared = self
                    .r
                    .fast
                    .clear_stale(
                        text,
                        remaining,
                        marker.as_ref().map(|(m, g)| (m, *g)),
                        issued_gen,
                    )
                    .await?;
                if !cleared {
                    return Ok(None);
                }
                self.repaired.add(Class::StaleProvisional, 1);
                let action = if consumed.is_some() {
                    "marked_consumed"
                } else if remaining > 0 {
                    "reset_to_issued"
                } else {
                    "deleted"
                };
                Ok(Some((Class::StaleProvisional, action)))
            }
            KeyState::Missing | KeyState::Unknown => Ok(None),
        }
    }
}
