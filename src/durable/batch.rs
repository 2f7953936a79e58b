//! Group commit of durable consumes: [`ConsumeBatcher`] sends a consume at
//! once while fewer than `postgres.consume_batches_in_flight` consume
//! statements run, and collects the ones that arrive meanwhile into the next
//! batch, decided by one statement over arrays ([`consume_batch`]) with an
//! answer per item.
//!
//! What holds, and why:
//! - **No wait when idle.** A consume that finds a free slot runs the single
//!   statement of [`tokens::consume_versioned`] on its own task, as without
//!   the batcher; only consumes that find every slot busy wait, and they
//!   wait for a statement that is already running, not for a timer.
//! - **Exactly once** is still the primary key's: a batch is the same upsert
//!   and audit row per item as the single statement, in one implicit
//!   transaction.
//! - **One consume per token in flight.** A batch holds at most one item per
//!   token id, and an item whose token is in a running statement waits for
//!   the next batch after it: it sees the earlier consume's outcome as a row.
//! - **No deadlocks.** Every batch locks its rows in id order (the items are
//!   sorted, and so are the issuance records of `tokens::insert_issued`).
//! - **One item never fails another.** Per-item conditions (consumed,
//!   expired, no row) are answers, not errors; a batch that Postgres refuses
//!   for what it holds (an error of the statement, which rolled it back) is
//!   decided again item by item, each with its own answer.
//! - **Unknown stays unknown.** A batch whose outcome is unknown (the
//!   connection lost, no answer within the pool's deadline) answers every
//!   item [`DurableError::Batch`], which is `unavailable` (503), exactly as
//!   the single statement's failure is.
//! - **Bounded.** Each statement runs under [`Pools::bounded`]; an item that
//!   waited longer than `postgres.acquire_timeout` for its batch is answered
//!   as a pool wait would be (`PoolTimedOut`, 503) without being sent.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};
use tokio::sync::oneshot;

use super::tokens::{self, ConsumeRow, TokenRecord, TokenState};
use super::{DurableError, Pools};
use crate::config::PostgresSettings;
use crate::metrics::Metrics;

type Answer = Result<(ConsumeRow, i64), DurableError>;

/// One durable consume: the row it writes and who wins it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumeItem {
    pub record: TokenRecord,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
}

/// Durable consumes, sent at once or in batches (see the module's docs).
/// Shared by every request of the service.
pub struct ConsumeBatcher {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ConsumeBatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumeBatcher")
            .field("size", &self.inner.size)
            .field("slots", &self.inner.slots)
            .finish()
    }
}

struct Inner {
    pools: Pools,
    metrics: Arc<Metrics>,
    /// The most items of one statement.
    size: usize,
    /// The most consume statements running at once.
    slots: usize,
    /// How long an item may wait for its batch: as long as a request may
    /// wait for a pooled connection.
    queue_bound: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    running: usize,
    /// Token ids in a running statement.
    busy: HashSet<i64>,
    /// In arrival order. Either `running == slots`, or every item here
    /// waits for a busy token: [`Inner::dispatch`] keeps it so.
    queue: VecDeque<Waiting>,
}

struct Waiting {
    item: ConsumeItem,
    since: Instant,
    reply: oneshot::Sender<Answer>,
}

impl ConsumeBatcher {
    pub fn new(pools: Pools, metrics: Arc<Metrics>, settings: &PostgresSettings) -> ConsumeBatcher {
        ConsumeBatcher {
            inner: Arc::new(Inner {
                pools,
                metrics,
                size: settings.consume_batch_size.max(1),
                slots: settings
                    .consume_batches_in_flight
                    .clamp(1, settings.pool_size.max(1) as usize),
                queue_bound: settings.acquire_timeout,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Decides one durable consume: the row, and the generation the token
    /// is at afterwards (as [`tokens::consume_versioned`]).
    pub async fn consume(
        &self,
        record: &TokenRecord,
        fingerprint: Option<&str>,
        request_id: Option<&str>,
    ) -> Answer {
        let inner = &self.inner;
        let waiting = {
            let mut s = inner.lock();
            if s.running < inner.slots && !s.busy.contains(&record.id) {
                s.running += 1;
                s.busy.insert(record.id);
                None
            } else {
                let (reply, answer) = oneshot::channel();
                s.queue.push_back(Waiting {
                    item: ConsumeItem {
                        record: record.clone(),
                        fingerprint: fingerprint.map(str::to_owned),
                        request_id: request_id.map(str::to_owned),
                    },
                    since: Instant::now(),
                    reply,
                });
                inner.metrics.pg_consume_queue.set(s.queue.len() as i64);
                Some(answer)
            }
        };
        match waiting {
            None => {
                // Given back when this is done or dropped (the request gone).
                let _slot = Slot {
                    inner: inner.clone(),
                    ids: vec![record.id],
                };
                inner.metrics.pg_batch_size.observe(1.0);
                inner
                    .pools
                    .bounded(tokens::consume_versioned(
                        &inner.pools.hot,
                        record,
                        fingerprint,
                        request_id,
                    ))
                    .await
            }
            // The batch task ended without answering: only when the runtime
            // stops under it, after the statement may have been sent.
            Some(answer) => answer
                .await
                .unwrap_or_else(|_| Err(DurableError::Batch(None))),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is consistent after every statement under the lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the batches the free slots allow (after a statement ended).
    fn dispatch(self: &Arc<Self>, s: &mut State) {
        while s.running < self.slots {
            let busy = &s.busy;
            let batch = assemble(&mut s.queue, self.size, |w| {
                let id = w.item.record.id;
                (id, busy.contains(&id))
            });
            if batch.is_empty() {
                break;
            }
            s.running += 1;
            s.busy.extend(batch.iter().map(|w| w.item.record.id));
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                // No runtime to run it on (the service is stopping): the
                // items are dropped, and their callers answer 503.
                s.running -= 1;
                for w in &batch {
                    s.busy.remove(&w.item.record.id);
                }
                continue;
            };
            runtime.spawn(self.clone().run(batch));
        }
        self.metrics.pg_consume_queue.set(s.queue.len() as i64);
    }

    /// Decides one batch and answers its items.
    async fn run(self: Arc<Self>, batch: Vec<Waiting>) {
        let _slot = Slot {
            inner: self.clone(),
            ids: batch.iter().map(|w| w.item.record.id).collect(),
        };
        // Items whose caller is gone are not sent; items that waited too
        // long are answered as a pool wait that timed out (never sent).
        let mut live = Vec::with_capacity(batch.len());
        for w in batch {
            if w.reply.is_closed() {
                continue;
            }
            if w.since.elapsed() > self.queue_bound {
                let _ = w
                    .reply
                    .send(Err(DurableError::Unavailable(sqlx::Error::PoolTimedOut)));
                continue;
            }
            live.push(w);
        }
        if live.is_empty() {
            return;
        }
        self.metrics.pg_batch_size.observe(live.len() as f64);
        if live.len() == 1 {
            let w = live.remove(0);
            let answer = self.single(&w.item).await;
            let _ = w.reply.send(answer);
            return;
        }
        let items: Vec<&ConsumeItem> = live.iter().map(|w| &w.item).collect();
        match self
            .pools
            .bounded(consume_batch(&self.pools.hot, &items))
            .await
        {
            Ok(answers) => {
                for (w, answer) in live.into_iter().zip(answers) {
                    let _ = w.reply.send(Ok(answer));
                }
            }
            // Refused by Postgres: an error of the statement, which rolled
            // it back. Something an item holds, most likely: each is
            // decided alone, with its own answer.
            Err(DurableError::Other(sqlx::Error::Database(db))) => {
                tracing::warn!(error = %db, items = live.len(), "postgres refused a consume batch: its items are decided one by one");
                for w in live {
                    if w.reply.is_closed() {
                        continue;
                    }
                    let answer = self.single(&w.item).await;
                    let _ = w.reply.send(answer);
                }
            }
            // Unavailable, timed out, or an answer we could not read (after
            // a commit, maybe): every item gets it, as the single statement
            // would have.
            Err(e) => {
                tracing::debug!(error = %e, items = live.len(), "consume batch failed");
                let cause = Arc::new(e);
                for w in live {
                    let _ = w.reply.send(Err(DurableError::Batch(Some(cause.clone()))));
                }
            }
        }
    }

    async fn single(&self, item: &ConsumeItem) -> Answer {
        self.pools
            .bounded(tokens::consume_versioned(
                &self.pools.hot,
                &item.record,
                item.fingerprint.as_deref(),
                item.request_id.as_deref(),
            ))
            .await
    }
}

/// A running statement's slot and token ids: given back when it ends
/// (however it ends), which starts the next batches.
struct Slot {
    inner: Arc<Inner>,
    ids: Vec<i64>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.inner.lock();
        s.running -= 1;
        for id in &self.ids {
            s.busy.remove(id);
        }
        self.inner.dispatch(&mut s);
    }
}

/// Takes the next batch from `queue`: in arrival order, at most `max`
/// items, at most one per token id, none whose token is busy (`key` gives
/// an item's id and whether its token is busy), sorted by id. The items
/// left keep their order.
pub fn assemble<T>(
    queue: &mut VecDeque<T>,
    max: usize,
    mut key: impl FnMut(&T) -> (i64, bool),
) -> Vec<T> {
    let mut batch: Vec<T> = Vec::new();
    let mut ids = HashSet::new();
    let mut skipped = Vec::new();
    while batch.len() < max {
        let Some(item) = queue.pop_front() else {
            break;
        };
        let (id, busy) = key(&item);
        if !busy && ids.insert(id) {
            batch.push(item);
        } else {
            skipped.push(item);
        }
    }
    for item in skipped.into_iter().rev() {
        queue.push_front(item);
    }
    batch.sort_by_key(|item| key(item).0);
    batch
}

/// Decides a batch of durable consumes (distinct token ids, sorted by id)
/// in one statement: for each item, in order, what
/// [`tokens::consume_versioned`] would answer it. Exposed for the tests;
/// the service goes through [`ConsumeBatcher`].
pub async fn consume_batch(
    pool: &PgPool,
    items: &[&ConsumeItem],
) -> Result<Vec<(ConsumeRow, i64)>, DurableError> {
    let n = items.len();
    let (mut ids, mut toks, mut biz, mut dur, mut subjects) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut clients, mut issued, mut expires, mut fps, mut rids) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for it in items {
        let r = &it.record;
        ids.push(r.id);
        toks.push(r.token.as_str());
        biz.push(r.biz_type.as_str());
        dur.push(r.durability.as_str());
        subjects.push(r.subject.as_str());
        clients.push(r.client.as_str());
        issued.push(r.issued_at);
        expires.push(r.expires_at);
        fps.push(it.fingerprint.as_deref());
        rids.push(it.request_id.as_deref());
    }
    // The single statement's upsert and audit row, per item; the rows come
    // back as the claims that won and, for the others, the row as the
    // statement's snapshot saw it.
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            r#"
        WITH r AS (
            SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],
                                 $6::text[], $7::timestamptz[], $8::timestamptz[], $9::text[], $10::text[])
                       AS r(id, token, biz_type, durability, subject, client, issued_at, expires_at,
                            fingerprint, request_id)
        ), claim AS (
            INSERT INTO tokens AS t (id, token, biz_type, durability, subject, client, issued_at,
                                     expires_at, state, gen, consumed_at, fingerprint, request_id)
            SELECT id, token, biz_type, durability::durability, subject, client, issued_at,
                   expires_at, 'consumed', 1, now(), fingerprint, request_id
              FROM r
             WHERE expires_at > now()
             ORDER BY id
            ON CONFLICT (id) DO UPDATE
               SET state = 'consumed', gen = t.gen + 1, consumed_at = now(),
                   fingerprint = EXCLUDED.fingerprint, request_id = EXCLUDED.request_id
             WHERE t.state = 'issued' AND t.expires_at > now()
            RETURNING t.id, t.consumed_at, t.gen
        ), audit AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT c.consumed_at, 'token.consumed', r.id, r.token, r.subject, r.biz_type, r.client, c.gen,
                   jsonb_strip_nulls(jsonb_build_object('fingerprint', r.fingerprint, 'request_id', r.request_id))
              FROM claim c JOIN r USING (id)
             ORDER BY r.id
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )
        SELECT c.id, true AS won, 'consumed'::token_state AS state, c.consumed_at,
               NULL::text AS fingerprint, NULL::text AS request_id, NULL::jsonb AS result,
               NULL::text AS order_id, NULL::timestamptz AS expires_at, c.gen
          FROM claim c
        UNION ALL
        SELECT t.id, false, t.state, t.consumed_at, t.fingerprint, t.request_id, t.result,
               t.order_id, t.expires_at, t.gen
          FROM r JOIN tokens t ON t.id = r.id
         WHERE NOT EXISTS (SELECT 1 FROM claim c WHERE c.id = r.id)
        "#,
        )
        .bind(&ids)
        .bind(&toks)
        .bind(&biz)
        .bind(&dur)
        .bind(&subjects)
        .bind(&clients)
        .bind(&issued)
        .bind(&expires)
        .bind(&fps)
        .bind(&rids)
    })
    .await?;
    let mut decided: HashMap<i64, (ConsumeRow, i64)> = HashMap::with_capacity(n);
    for row in &rows {
        let id: i64 = row.try_get("id")?;
        if row.try_get::<bool, _>("won")? {
            let consumed_at: DateTime<Utc> = row.try_get("consumed_at")?;
            decided.insert(id, (ConsumeRow::Won { consumed_at }, row.try_get("gen")?));
            continue;
        }
        let e = tokens::existing(row)?;
        if e.state == TokenState::Consumed {
            let gen = e.gen;
            decided.insert(id, (ConsumeRow::Existing(e), gen));
        }
    }
    // Not claimed and not consumed in the snapshot: past `now()`, or a
    // consume elsewhere committed after the snapshot was taken (the
    // conflict check waited for it). A fresh read tells them apart, as in
    // the single statement.
    let unsettled: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| !decided.contains_key(id))
        .collect();
    if !unsettled.is_empty() {
        let fresh = super::fetch_all(pool, || {
            sqlx::query(
                "SELECT id, state, consumed_at, fingerprint, request_id, result, order_id, expires_at, gen
                   FROM tokens WHERE id = ANY($1)",
            )
            .bind(&unsettled)
        })
        .await?;
        for row in &fresh {
            let id: i64 = row.try_get("id")?;
            let e = tokens::existing(row)?;
            let gen = e.gen;
            decided.insert(id, (ConsumeRow::Existing(e), gen));
        }
    }
    Ok(ids
        .iter()
        .map(|id| decided.remove(id).unwrap_or((ConsumeRow::Expired, 0)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::assemble;
    use proptest::prelude::*;
    use std::collections::{HashSet, VecDeque};

    proptest! {
        /// A batch holds each token once, none that is busy, at most `max`
        /// items, sorted by id; with what stays queued (in its order) it is
        /// exactly the queue; it is as full as the queue allows, and the
        /// first item that may go goes.
        #[test]
        fn batches_are_distinct_sorted_bounded_and_fair(
            ids in proptest::collection::vec(0i64..20, 0..80),
            busy in proptest::collection::hash_set(0i64..20, 0..5),
            max in 1usize..70,
        ) {
            // Items are (arrival index, token id).
            let mut queue: VecDeque<(usize, i64)> = ids.iter().copied().enumerate().collect();
            let batch = assemble(&mut queue, max, |&(_, id)| (id, busy.contains(&id)));

            prop_assert!(batch.len() <= max);
            let taken: HashSet<i64> = batch.iter().map(|&(_, id)| id).collect();
            prop_assert_eq!(taken.len(), batch.len(), "one item per token");
            prop_assert!(batch.iter().all(|(_, id)| !busy.contains(id)));
            prop_assert!(batch.windows(2).all(|w| w[0].1 < w[1].1), "sorted by id");

            let mut all: Vec<(usize, i64)> = batch.iter().chain(queue.iter()).copied().collect();
            all.sort();
            let input: Vec<(usize, i64)> = ids.iter().copied().enumerate().collect();
            prop_assert_eq!(all, input);
            prop_assert!(queue.iter().zip(queue.iter().skip(1)).all(|(a, b)| a.0 < b.0), "queue order kept");

            if batch.len() < max {
                prop_assert!(queue.iter().all(|(_, id)| taken.contains(id) || busy.contains(id)), "as full as it may be");
            }
            if let Some(first) = ids.iter().enumerate().find(|(_, id)| !busy.contains(id)) {
                prop_assert!(batch.iter().any(|&(i, _)| i == first.0), "the first that may go goes");
            }
            // Every item of the batch arrived before any item left behind
            // that could have gone in its place.
            if let Some(last) = batch.iter().map(|&(i, _)| i).max() {
                prop_assert!(queue.iter().all(|&(i, id)| i > last || taken.contains(&id) || busy.contains(&id)));
            }
        }
    }
}
