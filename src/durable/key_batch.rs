//! Group commit of durable client-key consumes: [`KeyBatcher`] sends a key's
//! consume at once while no key statement runs, and the ones that arrive
//! meanwhile form the next batch, decided by one statement over arrays
//! ([`consume_key_batch`]) with an answer per item. The queue is
//! [`super::group`]'s, keyed by the key's derived id: one consume per key in
//! flight, no wait when idle, with the token consumes' limits
//! (`postgres.consume_batch_size`, `postgres.consume_batches_in_flight`,
//! `postgres.acquire_timeout`), on a queue of its own.
//!
//! The guarantees are [`super::batch`]'s, for keys:
//! - **No wait when idle.** A consume that finds no key statement running
//!   runs the single statement of [`keys::consume`] on its own task.
//! - **Exactly once** is still the key's unique index's: a batch is the same
//!   upsert and `key.consumed` audit row per item as the single statement,
//!   in one implicit transaction, and its answers (won, existing, bound to
//!   another subject; the generation and the subject) are the single
//!   statement's.
//! - **Racing first consumes.** Within a batch no two items share a key (the
//!   queue); a later consume of a key waits for the next batch and sees the
//!   earlier one's row. Across instances the unique index decides: a batch
//!   that meets a concurrent first insert with a unique violation is refused
//!   as a whole, and its items are decided one by one, each by
//!   [`keys::consume`], which sends itself again on that violation.
//! - **No deadlocks.** Every batch writes its rows in id order.
//! - **One item never fails another.** A batch Postgres refuses (an error of
//!   the statement, which rolled it back) is decided again item by item.
//! - **Unknown stays unknown.** A batch whose outcome is unknown answers
//!   every item [`DurableError::Batch`] (503), as the single statement's
//!   failure is; an item that waited longer than `postgres.acquire_timeout`
//!   is answered `PoolTimedOut` (503) without being sent.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use sqlx::{PgPool, Row};

use super::batch::decide_items;
use super::group::{GroupCommit, Limits, Slot, Turn, Work};
use super::keys::{self, KeyConsumed};
use super::tokens::{existing, ConsumeRow, TokenRecord, TokenState};
use super::{DurableError, Pools};
use crate::clock::Clock;
use crate::config::PostgresSettings;
use crate::metrics::Metrics;
use crate::tasks::OffPath;

type Answer = Result<KeyConsumed, DurableError>;

/// One durable consume of a key: its row (`record.key` set, `record.subject`
/// the subject this call names, `''`: none) and who wins it.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyItem {
    pub record: TokenRecord,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
}

/// Durable key consumes, sent at once or in batches (see the module's
/// docs). Shared by every request of the service.
#[derive(Debug)]
pub struct KeyBatcher {
    queue: GroupCommit<KeyConsumes>,
}

/// How a batch of key consumes is decided.
struct KeyConsumes {
    pools: Pools,
}

impl KeyBatcher {
    /// `clock` times the queue bound; the batches run on `off_path`.
    pub fn new(
        pools: Pools,
        metrics: Arc<Metrics>,
        settings: &PostgresSettings,
        clock: Arc<dyn Clock>,
        off_path: OffPath,
    ) -> KeyBatcher {
        let limits = Limits::for_pool(
            settings.consume_batch_size,
            settings.consume_batches_in_flight,
            settings.pool_size,
            // As long as a request may wait for a pooled connection.
            settings.acquire_timeout,
        );
        KeyBatcher {
            queue: GroupCommit::new(
                KeyConsumes { pools },
                limits,
                metrics.pg_key_consume_queue.clone(),
                metrics.pg_key_batch_size.clone(),
                clock,
                off_path,
            ),
        }
    }

    /// Decides one durable consume of a key, as [`keys::consume`] does.
    pub async fn consume(
        &self,
        record: &TokenRecord,
        fingerprint: Option<&str>,
        request_id: Option<&str>,
    ) -> Answer {
        let turn = self.queue.enter([record.id], || KeyItem {
            record: record.clone(),
            fingerprint: fingerprint.map(str::to_owned),
            request_id: request_id.map(str::to_owned),
        });
        match turn {
            // The slot is given back when this is done or dropped.
            Turn::Now(_slot) => {
                let pools = &self.queue.work().pools;
                pools
                    .bounded(keys::consume(&pools.hot, record, fingerprint, request_id))
                    .await
            }
            // The batch task ended without answering: only when the runtime
            // stops under it, after the statement may have been sent.
            Turn::Queued(answer) => answer
                .await
                .unwrap_or_else(|_| Err(DurableError::Batch(None))),
        }
    }
}

impl Work for KeyConsumes {
    type Key = i64;
    type Keys = [i64; 1];
    type Item = KeyItem;
    type Answer = Answer;

    fn keys(item: &KeyItem) -> [i64; 1] {
        [item.record.id]
    }

    fn waited_too_long() -> Answer {
        Err(DurableError::Unavailable(sqlx::Error::PoolTimedOut))
    }

    /// By id: every batch writes its rows in id order.
    fn batch_order(a: &KeyItem, b: &KeyItem) -> Ordering {
        a.record.id.cmp(&b.record.id)
    }

    async fn run(&self, items: Vec<KeyItem>, _slot: Slot<Self>) -> Vec<Answer> {
        decide_items(
            "key consume",
            &items,
            |item| self.single(item),
            |refs| async move {
                self.pools
                    .bounded(consume_key_batch(&self.pools.hot, &refs))
                    .await
            },
        )
        .await
    }
}

impl KeyConsumes {
    async fn single(&self, item: &KeyItem) -> Answer {
        self.pools
            .bounded(keys::consume(
                &self.pools.hot,
                &item.record,
                item.fingerprint.as_deref(),
                item.request_id.as_deref(),
            ))
            .await
    }
}

/// Decides a batch of durable key consumes (distinct ids, sorted by id) in
/// one statement: for each item, in order, what [`keys::consume`] would
/// answer it. Exposed for the tests; the service goes through
/// [`KeyBatcher`].
///
/// `Err` only when the claim statement failed: then nothing of the batch
/// committed. Once it succeeded its winners are answered `Won` whatever
/// happens next; an item the fresh read after it should have settled, when
/// that read fails, gets its own error (it did not win).
pub async fn consume_key_batch(
    pool: &PgPool,
    items: &[&KeyItem],
) -> Result<Vec<Answer>, DurableError> {
    let n = items.len();
    let (mut ids, mut toks, mut key_texts, mut biz, mut dur) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut subjects, mut clients, mut fps, mut rids) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for it in items {
        let r = &it.record;
        ids.push(r.id);
        toks.push(r.token.as_str());
        key_texts.push(r.key.as_deref());
        biz.push(r.biz_type.as_str());
        dur.push(r.durability.as_str());
        subjects.push(r.subject.as_str());
        clients.push(r.client.as_str());
        fps.push(it.fingerprint.as_deref());
        rids.push(it.request_id.as_deref());
    }
    // The single statement's upsert and audit row, per item; the rows come
    // back as the claims that won and, for the others, the row as the
    // statement's snapshot saw it: read by `tokens_row` (V20) for them only
    // (the fence `OFFSET 0` keeps the call after the filter), so the plan
    // holds no scan of the partitions of `tokens` to set up on every run.
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            r#"
        WITH r AS (
            SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],
                                 $6::text[], $7::text[], $8::text[], $9::text[])
                       AS r(id, token, key, biz_type, durability, subject, client, fingerprint,
                            request_id)
        ), claim AS (
            INSERT INTO tokens AS t (id, token, key, biz_type, durability, subject, client,
                                     issued_at, expires_at, state, gen, consumed_at, fingerprint,
                                     request_id)
            SELECT id, token, key, biz_type, durability::durability, subject, client, now(), now(),
                   'consumed', 1, now(), fingerprint, request_id
              FROM r
             ORDER BY id
            ON CONFLICT (client, biz_type, key, id) WHERE key IS NOT NULL DO UPDATE
               SET state = 'consumed', gen = t.gen + 1, consumed_at = now(),
                   fingerprint = EXCLUDED.fingerprint, request_id = EXCLUDED.request_id
             WHERE t.state = 'issued' AND (EXCLUDED.subject = '' OR t.subject = EXCLUDED.subject)
            RETURNING t.id, t.consumed_at, t.gen, t.subject
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, subject, biz_type, client, gen, detail)
            SELECT c.consumed_at, 'key.consumed', r.id, nullif(c.subject, ''), r.biz_type, r.client,
                   c.gen,
                   jsonb_strip_nulls(jsonb_build_object('key', r.key, 'fingerprint', r.fingerprint,
                                                        'request_id', r.request_id))
              FROM claim c JOIN r USING (id)
             ORDER BY r.id
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )
        SELECT c.id, true AS won, 'consumed'::token_state AS state, c.consumed_at,
               NULL::text AS fingerprint, NULL::text AS request_id, NULL::jsonb AS result,
               NULL::text AS order_id, c.consumed_at AS expires_at, c.gen, c.subject,
               NULL::timestamptz AS uncertain_since
          FROM claim c
        UNION ALL
        SELECT t.id, false, t.state, t.consumed_at, t.fingerprint, t.request_id, t.result,
               t.order_id, t.expires_at, t.gen, t.subject, t.uncertain_since
          FROM (SELECT r.id FROM r WHERE NOT EXISTS (SELECT 1 FROM claim c WHERE c.id = r.id)
                 OFFSET 0) o
         CROSS JOIN LATERAL tokens_row(o.id) t
        "#,
        )
        .bind(&ids)
        .bind(&toks)
        .bind(&key_texts)
        .bind(&biz)
        .bind(&dur)
        .bind(&subjects)
        .bind(&clients)
        .bind(&fps)
        .bind(&rids)
    })
    .await?;
    let named: HashMap<i64, &str> = items
        .iter()
        .map(|it| (it.record.id, it.record.subject.as_str()))
        .collect();
    let mut decided: HashMap<i64, KeyConsumed> = HashMap::with_capacity(n);
    for row in &rows {
        let id: i64 = row.try_get("id")?;
        let subject: String = row.try_get("subject")?;
        if row.try_get::<bool, _>("won")? {
            let row_answer = ConsumeRow::Won {
                consumed_at: row.try_get("consumed_at")?,
            };
            decided.insert(
                id,
                KeyConsumed {
                    row: row_answer,
                    gen: row.try_get("gen")?,
                    subject,
                },
            );
            continue;
        }
        let e = existing(row)?;
        let call = named.get(&id).copied().unwrap_or("");
        if e.state == TokenState::Consumed || (!call.is_empty() && subject != call) {
            decided.insert(
                id,
                KeyConsumed {
                    gen: e.gen,
                    row: ConsumeRow::Existing(e),
                    subject,
                },
            );
        }
        // Otherwise not claimed, yet our snapshot says issued: a concurrent
        // consume committed after the snapshot (the fresh read tells).
    }
    // Not claimed and not settled by the snapshot (or not in it at all: a
    // concurrent first consume inserted the row after it): a fresh read,
    // as in the single statement.
    let unsettled: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| !decided.contains_key(id))
        .collect();
    let mut read_failed: Option<Arc<DurableError>> = None;
    if !unsettled.is_empty() {
        match fresh_rows(pool, &unsettled).await {
            Ok(fresh) => decided.extend(fresh),
            Err(e) => {
                tracing::debug!(error = %e, items = unsettled.len(), "the read after a key consume batch failed");
                read_failed = Some(Arc::new(e));
            }
        }
    }
    Ok(ids
        .iter()
        .map(|id| match (decided.remove(id), &read_failed) {
            (Some(answer), _) => Ok(answer),
            (None, Some(cause)) => Err(DurableError::Batch(Some(cause.clone()))),
            // Purged between the two reads: the caller retries (as the
            // single statement answers it).
            (None, None) => Err(DurableError::Other(sqlx::Error::RowNotFound)),
        })
        .collect())
}

/// The key rows of `ids` as they are now (a fresh snapshot).
async fn fresh_rows(pool: &PgPool, ids: &[i64]) -> Result<Vec<(i64, KeyConsumed)>, DurableError> {
    let fresh = super::fetch_all(pool, || {
        sqlx::query(
            "SELECT id, state, consumed_at, fingerprint, request_id, result, order_id, expires_at,
                    gen, subject
               FROM tokens WHERE id = ANY($1) AND key IS NOT NULL",
        )
        .bind(ids)
    })
    .await?;
    let mut out = Vec::with_capacity(fresh.len());
    for row in &fresh {
        let id: i64 = row.try_get("id")?;
        let e = existing(row)?;
        out.push((
            id,
            KeyConsumed {
                gen: e.gen,
                row: ConsumeRow::Existing(e),
                subject: row.try_get("subject")?,
            },
        ));
    }
    Ok(out)
}
