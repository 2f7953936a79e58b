//! The versioned journal apply: fast-type decisions (consume, result,
//! release) reach Postgres as the state and generation they were decided at,
//! and one statement per batch moves each token forward only.
//!
//! [`apply_one`] is the rule as a pure function, and [`apply`]'s statement
//! is the same rule in SQL (the test suite checks them against each other):
//!
//! - an entry replaces the row when its generation is newer, or when it is
//!   the same generation and brings the result that generation lacked;
//! - a missing row is created from the entry (the token record travels in
//!   every entry);
//! - nothing else changes: an older entry, a repeated one, or one for a
//!   durable token leaves the row as it is.
//!
//! So the final state is the newest decision whatever order entries arrive in
//! and however often each is delivered. Every entry also writes its audit row
//! (`token.consumed`, `token.result` or `token.released` at its generation),
//! once: the unique index `audit_token_gen_once` keeps the first.

use chrono::{DateTime, Utc};
use serde_json::Value as Json;
use sqlx::PgPool;

use super::tokens::TokenRecord;
use super::DurableError;
use crate::domain::AuditKind;

/// What a journal entry reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Consume,
    Result,
    Release,
}

impl EntryKind {
    /// The kind of its audit row.
    pub fn audit_kind(self) -> AuditKind {
        match self {
            EntryKind::Consume => AuditKind::TokenConsumed,
            EntryKind::Result => AuditKind::TokenResult,
            EntryKind::Release => AuditKind::TokenReleased,
        }
    }

    /// The kind of its audit row for a client key.
    pub fn key_audit_kind(self) -> AuditKind {
        match self {
            EntryKind::Consume => AuditKind::KeyConsumed,
            EntryKind::Result => AuditKind::KeyResult,
            EntryKind::Release => AuditKind::KeyReleased,
        }
    }
}

/// A token's state at one generation.
#[derive(Debug, Clone, PartialEq)]
pub enum Decided {
    Issued,
    Consumed {
        consumed_at: DateTime<Utc>,
        fingerprint: Option<String>,
        request_id: Option<String>,
        /// The result and when it was recorded.
        result: Option<(Json, DateTime<Utc>)>,
    },
}

/// A state and the generation it was decided at (odd: consumed).
#[derive(Debug, Clone, PartialEq)]
pub struct Versioned {
    pub gen: i64,
    pub state: Decided,
}

impl Versioned {
    pub fn has_result(&self) -> bool {
        matches!(
            self.state,
            Decided::Consumed {
                result: Some(_),
                ..
            }
        )
    }

    /// Whether `self` replaces `old`: a newer generation, or the same one
    /// bringing the result it lacked.
    pub fn supersedes(&self, old: &Versioned) -> bool {
        self.gen > old.gen || (self.gen == old.gen && !old.has_result() && self.has_result())
    }
}

/// The rule: the row after applying `entry` to `row` (`None`: no row yet).
pub fn apply_one(row: Option<Versioned>, entry: &Versioned) -> Versioned {
    match row {
        Some(r) if !entry.supersedes(&r) => r,
        _ => entry.clone(),
    }
}

/// One journal entry with a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub record: TokenRecord,
    pub kind: EntryKind,
    /// When the decision was made (its audit row's time).
    pub at: DateTime<Utc>,
    pub version: Versioned,
    /// Merged into its audit row's detail (an operator's release:
    /// `{"by": "admin", "reason": ...}`).
    pub detail: Option<Json>,
}

/// Applies a batch of entries in one statement (see the module docs);
/// returns how many token rows moved. Entries of one token may come in any
/// order in the batch and repeat: only the newest of them is written
/// (`DISTINCT ON`, ordered as [`Versioned::supersedes`]), each writes its
/// audit row once.
pub async fn apply(pool: &PgPool, batch: &[Entry]) -> Result<u64, DurableError> {
    if batch.is_empty() {
        return Ok(0);
    }
    let n = batch.len();
    let mut c = Columns::with_capacity(n);
    for e in batch {
        c.push(e);
    }
    let moved: i64 = sqlx::query_scalar(
        r#"
        WITH e AS (
            SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],
                                 $6::timestamptz[], $7::timestamptz[], $8::bigint[], $9::text[],
                                 $10::timestamptz[], $11::text[], $12::text[], $13::text[],
                                 $14::timestamptz[], $15::text[], $16::timestamptz[], $17::text[], $18::text[])
                     WITH ORDINALITY
                     AS e(id, token, biz_type, subject, client, issued_at, expires_at, gen, state,
                          consumed_at, fingerprint, request_id, result, result_at, kind, at, key, detail,
                          ord)
        ), newest AS (
            SELECT DISTINCT ON (id) * FROM e
             ORDER BY id, gen DESC, (result IS NOT NULL) DESC, ord
        ), subjects AS (
            -- A client key's result and release entries do not know its
            -- subject (''): its consume entries do.
            SELECT id, max(subject) AS subject FROM e WHERE subject <> '' GROUP BY id
        ), up AS (
            INSERT INTO tokens AS t (id, token, biz_type, durability, subject, client, issued_at,
                                     expires_at, state, gen, consumed_at, fingerprint, request_id,
                                     result, result_at, key)
            SELECT n.id, n.token, n.biz_type, 'fast', coalesce(s.subject, n.subject),
                   n.client, n.issued_at, n.expires_at,
                   n.state::token_state, n.gen, n.consumed_at, n.fingerprint, n.request_id,
                   n.result::jsonb, n.result_at, n.key
              FROM newest n LEFT JOIN subjects s ON s.id = n.id
            ON CONFLICT (id) DO UPDATE
               SET state = EXCLUDED.state, gen = EXCLUDED.gen, consumed_at = EXCLUDED.consumed_at,
                   subject = CASE WHEN t.subject = '' THEN EXCLUDED.subject ELSE t.subject END,
                   fingerprint = EXCLUDED.fingerprint, request_id = EXCLUDED.request_id,
                   result = EXCLUDED.result, result_at = EXCLUDED.result_at
             WHERE t.durability = 'fast' AND t.key IS NOT DISTINCT FROM EXCLUDED.key
               AND (t.gen < EXCLUDED.gen
                    OR (t.gen = EXCLUDED.gen AND t.result IS NULL AND EXCLUDED.result IS NOT NULL))
            RETURNING t.id
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT e.at, e.kind::audit_kind, e.id, CASE WHEN e.key IS NULL THEN e.token END,
                   nullif(e.subject, ''), e.biz_type, e.client, e.gen,
                   CASE WHEN e.kind IN ('token.consumed', 'key.consumed') THEN jsonb_strip_nulls(jsonb_build_object(
                           'fingerprint', e.fingerprint, 'request_id', e.request_id, 'via', 'journal'))
                       WHEN e.kind IN ('token.result', 'key.result') THEN jsonb_build_object('result', e.result::jsonb, 'via', 'journal')
                       ELSE jsonb_build_object('via', 'journal')
                   END
                   || CASE WHEN e.key IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('key', e.key) END
                   || COALESCE(e.detail::jsonb, '{}'::jsonb)
              FROM e
             WHERE e.id IN (SELECT id FROM up)
                OR EXISTS (SELECT 1 FROM tokens_row(e.id) t WHERE t.durability = 'fast')
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        ), conflict AS (
            -- A consume of the generation Postgres already holds consumed by
            -- another decision (another consumed_at or request_id): two
            -- deciders both answered `consumed`. Kept as evidence, never
            -- dropped (once per token and generation, so a retried entry
            -- adds nothing). The rows are read for the other consumes only,
            -- one by one by id (`tokens_row`, V20): joined with `tokens`,
            -- the cached plan could scan every consumed row once per entry.
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT e.at, 'token.conflict', e.id, CASE WHEN e.key IS NULL THEN e.token END,
                   nullif(e.subject, ''), e.biz_type, e.client, e.gen,
                   jsonb_strip_nulls(jsonb_build_object(
                       'via', 'journal', 'request_id', e.request_id, 'consumed_at', e.consumed_at,
                       'fingerprint', e.fingerprint,
                       'kept_request_id', t.request_id, 'kept_consumed_at', t.consumed_at))
                   || CASE WHEN e.key IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('key', e.key) END
              FROM e CROSS JOIN LATERAL tokens_row(e.id) t
             WHERE e.kind IN ('token.consumed', 'key.consumed') AND e.state = 'consumed'
               -- Not an entry that moved its row itself without a result:
               -- it met an older generation or no row, so it is no second
               -- decider of the generation it met. (Under NOT, each IN is
               -- a hashed lookup, never a join planned on guessed sizes.)
               AND NOT (e.result IS NULL AND e.id IN (SELECT id FROM up)
                        AND (e.id, e.ord) IN (SELECT id, ord FROM newest))
               AND t.state = 'consumed' AND t.gen = e.gen
               AND (t.consumed_at, t.request_id) IS DISTINCT FROM (e.consumed_at, e.request_id)
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
            RETURNING id
        )
        SELECT (SELECT count(*) FROM up) AS moved, (SELECT count(*) FROM conflict) AS conflicts
        "#,
    )
    .bind(&c.ids)
    .bind(&c.tokens)
    .bind(&c.biz)
    .bind(&c.subjects)
    .bind(&c.clients)
    .bind(&c.issued)
    .bind(&c.expires)
    .bind(&c.gens)
    .bind(&c.states)
    .bind(&c.consumed)
    .bind(&c.fps)
    .bind(&c.rids)
    .bind(&c.results)
    .bind(&c.result_ats)
    .bind(&c.kinds)
    .bind(&c.ats)
    .bind(&c.keys)
    .bind(&c.details)
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(moved).unwrap_or(0))
}

/// The batch as one array per column.
struct Columns<'a> {
    ids: Vec<i64>,
    tokens: Vec<&'a str>,
    biz: Vec<&'a str>,
    subjects: Vec<&'a str>,
    clients: Vec<&'a str>,
    issued: Vec<DateTime<Utc>>,
    expires: Vec<DateTime<Utc>>,
    gens: Vec<i64>,
    states: Vec<&'static str>,
    consumed: Vec<Option<DateTime<Utc>>>,
    fps: Vec<Option<&'a str>>,
    rids: Vec<Option<&'a str>>,
    /// JSON text: cast to jsonb in the statement (where a value Postgres
    /// refuses fails the batch, and the caller sets that entry aside).
    results: Vec<Option<String>>,
    result_ats: Vec<Option<DateTime<Utc>>>,
    kinds: Vec<&'static str>,
    ats: Vec<DateTime<Utc>>,
    /// A client key's text; `None` for tokens.
    keys: Vec<Option<&'a str>>,
    /// JSON text, as `results`.
    details: Vec<Option<String>>,
}

impl<'a> Columns<'a> {
    fn with_capacity(n: usize) -> Columns<'a> {
        Columns {
            ids: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            biz: Vec::with_capacity(n),
            subjects: Vec::with_capacity(n),
            clients: Vec::with_capacity(n),
            issued: Vec::with_capacity(n),
            expires: Vec::with_capacity(n),
            gens: Vec::with_capacity(n),
            states: Vec::with_capacity(n),
            consumed: Vec::with_capacity(n),
            fps: Vec::with_capacity(n),
            rids: Vec::with_capacity(n),
            results: Vec::with_capacity(n),
            result_ats: Vec::with_capacity(n),
            kinds: Vec::with_capacity(n),
            ats: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
            details: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, e: &'a Entry) {
        let r = &e.record;
        self.ids.push(r.id);
        self.tokens.push(&r.token);
        self.biz.push(&r.biz_type);
        self.subjects.push(&r.subject);
        self.clients.push(&r.client);
        self.issued.push(r.issued_at);
        self.expires.push(r.expires_at);
        self.gens.push(e.version.gen);
        let kind = match r.key {
            Some(_) => e.kind.key_audit_kind(),
            None => e.kind.audit_kind(),
        };
        self.kinds.push(kind.as_str());
        self.keys.push(r.key.as_deref());
        self.ats.push(e.at);
        self.details.push(e.detail.as_ref().map(Json::to_string));
        match &e.version.state {
            Decided::Issued => {
                self.states.push("issued");
                self.consumed.push(None);
                self.fps.push(None);
                self.rids.push(None);
                self.results.push(None);
                self.result_ats.push(None);
            }
            Decided::Consumed {
                consumed_at,
                fingerprint,
                request_id,
                result,
            } => {
                self.states.push("consumed");
                self.consumed.push(Some(*consumed_at));
                self.fps.push(fingerprint.as_deref());
                self.rids.push(request_id.as_deref());
                self.results
                    .push(result.as_ref().map(|(j, _)| j.to_string()));
                self.result_ats.push(result.as_ref().map(|(_, at)| *at));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;

    fn t(ms: i64) -> DateTime<Utc> {
        Utc.timestamp_millis_opt(1_790_000_000_000 + ms).unwrap()
    }

    /// One token's decisions as Redis makes them: consume, maybe a result,
    /// maybe a release (only without a result), again. Each step is the
    /// entry the journal carries for it.
    fn history(steps: &[(bool, bool)]) -> Vec<Versioned> {
        let mut out = Vec::new();
        let mut gen = 0;
        for (i, &(with_result, release)) in steps.iter().enumerate() {
            gen += 1;
            let at = t(i as i64 * 100);
            let consumed = |result| Decided::Consumed {
                consumed_at: at,
                fingerprint: Some(format!("fp-{gen}")),
                request_id: (gen % 3 == 0).then(|| format!("r-{gen}")),
                result,
            };
            out.push(Versioned {
                gen,
                state: consumed(None),
            });
            if with_result {
                out.push(Versioned {
                    gen,
                    state: consumed(Some((
                        serde_json::json!({ "n": gen }),
                        t(i as i64 * 100 + 5),
                    ))),
                });
                // A consumed token with a result is never released.
                break;
            }
            if release {
                gen += 1;
                out.push(Versioned {
                    gen,
                    state: Decided::Issued,
                });
            } else {
                break;
            }
        }
        out
    }

    /// The state of the last decision: the newest entry of the history.
    fn last_decision(h: &[Versioned]) -> Option<&Versioned> {
        h.last()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Any order and any repetition of one token's entries (with or
        /// without the issuance record, which only ever creates the row)
        /// leaves the row in the state of the last decision.
        #[test]
        fn any_order_and_repetition_reaches_the_last_decision(
            steps in proptest::collection::vec((any::<bool>(), any::<bool>()), 1..6),
            repeats in proptest::collection::vec(1usize..4, 12),
            issuance_at in proptest::option::of(0usize..30),
            seed in any::<u64>(),
        ) {
            let h = history(&steps);
            let mut deliveries: Vec<Versioned> = Vec::new();
            for (i, e) in h.iter().enumerate() {
                for _ in 0..repeats[i % repeats.len()] {
                    deliveries.push(e.clone());
                }
            }
            // A deterministic shuffle from the seed.
            let mut rng = seed | 1;
            for i in (1..deliveries.len()).rev() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                deliveries.swap(i, (rng % (i as u64 + 1)) as usize);
            }
            if let Some(at) = issuance_at {
                let issued = Versioned { gen: 0, state: Decided::Issued };
                deliveries.insert(at.min(deliveries.len()), issued);
            }
            let mut row = None;
            for e in &deliveries {
                row = Some(apply_one(row, e));
            }
            prop_assert_eq!(row.as_ref(), last_decision(&h));
        }
    }

    #[test]
    fn an_older_generation_never_moves_a_row_back() {
        let h = history(&[(false, true), (true, false)]);
        // consume@1, release@2, consume@3, result@3
        assert_eq!(h.iter().map(|v| v.gen).collect::<Vec<_>>(), [1, 2, 3, 3]);
        let newest = h[3].clone();
        for older in &h[..3] {
            assert_eq!(apply_one(Some(newest.clone()), older), newest);
        }
        // The result of a generation fills in its consume, not the reverse.
        assert_eq!(apply_one(Some(h[2].clone()), &h[3]), h[3]);
        assert_eq!(apply_one(Some(h[3].clone()), &h[2]), h[3]);
    }
}
