//! Group commit of durable consumes (and of results and releases, below):
//! [`ConsumeBatcher`] sends a consume at once while no consume statement
//! runs, and the ones that arrive meanwhile form the next batch, decided by
//! one statement over arrays ([`consume_batch`]) with an answer per item.
//! The queue is [`super::group`]'s, keyed by token id: one consume per token in flight,
//! no wait when idle, up to `postgres.consume_batches_in_flight` statements
//! at once (each beside a running one with a quarter-full batch), bounded.
//!
//! What holds, and why:
//! - **No wait when idle.** A consume that finds no statement running runs
//!   the single statement of [`tokens::consume_versioned`] on its own task,
//!   as without the batcher.
//! - **Exactly once** is still the primary key's: a batch is the same upsert
//!   and audit row per item as the single statement, in one implicit
//!   transaction.
//! - **One consume per token in flight.** An item whose token is in a
//!   running statement waits for the next batch after it: it sees the
//!   earlier consume's outcome as a row.
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
//!
//! Results and releases (of durable tokens and keys, and of fast tokens
//! Redis did not hold) go through [`FinishBatcher`] the same way, on a
//! queue of their own keyed by id (a result and a release of one token never
//! run at once) with the consumes' limits: a batch is
//! [`tokens::set_result_versioned`]'s and [`tokens::release_with`]'s
//! updates and audit rows per item in one statement ([`finish_batch`]),
//! which locks its rows in id order first; the rows it did not change are
//! read after it, in one read, as the single statements read theirs. A
//! refused batch is decided item by item; an unknown outcome is answered to
//! each item.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};

use serde_json::Value as Json;

use super::group::{GroupCommit, Limits, Slot, Turn, Work};

use super::tokens::{
    self, ConsumeRow, Existing, ReleaseRow, ResultDecided, TokenRecord, TokenState,
};
use super::{DurableError, Pools};
use crate::clock::Clock;
use crate::config::PostgresSettings;
use crate::metrics::Metrics;
use crate::tasks::OffPath;

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
#[derive(Debug)]
pub struct ConsumeBatcher {
    queue: GroupCommit<Consumes>,
}

/// How a batch of consumes is decided.
struct Consumes {
    pools: Pools,
}

impl ConsumeBatcher {
    /// `clock` times the queue bound; the batches run on `off_path`.
    pub fn new(
        pools: Pools,
        metrics: Arc<Metrics>,
        settings: &PostgresSettings,
        clock: Arc<dyn Clock>,
        off_path: OffPath,
    ) -> ConsumeBatcher {
        let limits = Limits::for_pool(
            settings.consume_batch_size,
            settings.consume_batches_in_flight,
            settings.pool_size,
            // As long as a request may wait for a pooled connection.
            settings.acquire_timeout,
        );
        ConsumeBatcher {
            queue: GroupCommit::new(
                Consumes { pools },
                limits,
                metrics.pg_consume_queue.clone(),
                metrics.pg_batch_size.clone(),
                clock,
                off_path,
            ),
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
        let turn = self.queue.enter([record.id], || ConsumeItem {
            record: record.clone(),
            fingerprint: fingerprint.map(str::to_owned),
            request_id: request_id.map(str::to_owned),
        });
        match turn {
            // The slot is given back when this is done or dropped (the
            // request gone).
            Turn::Now(_slot) => {
                let pools = &self.queue.work().pools;
                pools
                    .bounded(tokens::consume_versioned(
                        &pools.hot,
                        record,
                        fingerprint,
                        request_id,
                    ))
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

impl Work for Consumes {
    type Key = i64;
    type Keys = [i64; 1];
    type Item = ConsumeItem;
    type Answer = Answer;

    fn keys(item: &ConsumeItem) -> [i64; 1] {
        [item.record.id]
    }

    fn waited_too_long() -> Answer {
        Err(DurableError::Unavailable(sqlx::Error::PoolTimedOut))
    }

    /// By token id: every batch locks its rows in id order.
    fn batch_order(a: &ConsumeItem, b: &ConsumeItem) -> Ordering {
        a.record.id.cmp(&b.record.id)
    }

    async fn run(&self, items: Vec<ConsumeItem>, _slot: Slot<Self>) -> Vec<Answer> {
        decide_items(
            "consume",
            &items,
            |item| self.single(item),
            |refs| async move {
                self.pools
                    .bounded(consume_batch(&self.pools.hot, &refs))
                    .await
            },
        )
        .await
    }
}

/// How every durable batcher decides what its queue hands it: one item
/// alone (`single`), more in one statement (`batch`, an answer per item).
/// A statement Postgres refuses (an error it raised, which rolled the
/// statement back: nothing of the batch committed) is decided again item by
/// item, each with its own answer; any other failure (unavailable, timed
/// out, an answer that could not be read, after a commit maybe) is every
/// item's, as the single statement's would have been.
pub(super) async fn decide_items<'a, I, T, S, SF, B, BF>(
    what: &str,
    items: &'a [I],
    single: S,
    batch: B,
) -> Vec<Result<T, DurableError>>
where
    S: Fn(&'a I) -> SF,
    SF: std::future::Future<Output = Result<T, DurableError>>,
    B: FnOnce(Vec<&'a I>) -> BF,
    BF: std::future::Future<Output = Result<Vec<Result<T, DurableError>>, DurableError>>,
{
    if let [item] = items {
        return vec![single(item).await];
    }
    match batch(items.iter().collect()).await {
        Ok(answers) => answers,
        Err(DurableError::Other(sqlx::Error::Database(db))) => {
            tracing::warn!(error = %db, items = items.len(), "postgres refused a {what} batch: its items are decided one by one");
            let mut answers = Vec::with_capacity(items.len());
            for item in items {
                answers.push(single(item).await);
            }
            answers
        }
        Err(e) => {
            tracing::debug!(error = %e, items = items.len(), "{what} batch failed");
            let cause = Arc::new(e);
            items
                .iter()
                .map(|_| Err(DurableError::Batch(Some(cause.clone()))))
                .collect()
        }
    }
}

impl Consumes {
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

/// Decides a batch of durable consumes (distinct token ids, sorted by id)
/// in one statement: for each item, in order, what
/// [`tokens::consume_versioned`] would answer it. Exposed for the tests;
/// the service goes through [`ConsumeBatcher`].
///
/// `Err` only when the claim statement failed: then nothing of the batch is
/// known to have committed. Once it succeeded, its winners are known and
/// answered `Won` whatever happens next; an item the fresh read after it
/// should have settled, when that read fails, gets its own error (it did
/// not win: nothing of it changed), and is never decided again as if the
/// batch had been refused.
pub async fn consume_batch(
    pool: &PgPool,
    items: &[&ConsumeItem],
) -> Result<Vec<Answer>, DurableError> {
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
    // statement's snapshot saw it: read by `tokens_row` (V20) for them only
    // (the fence `OFFSET 0` keeps the call after the filter), so the plan
    // holds no scan of the partitions of `tokens` to set up on every run.
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
               NULL::text AS order_id, NULL::timestamptz AS expires_at, c.gen,
               NULL::timestamptz AS uncertain_since
          FROM claim c
        UNION ALL
        SELECT t.id, false, t.state, t.consumed_at, t.fingerprint, t.request_id, t.result,
               t.order_id, t.expires_at, t.gen, t.uncertain_since
          FROM (SELECT r.id FROM r WHERE NOT EXISTS (SELECT 1 FROM claim c WHERE c.id = r.id)
                 OFFSET 0) o
         CROSS JOIN LATERAL tokens_row(o.id) t
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
    let mut read_failed: Option<Arc<DurableError>> = None;
    if !unsettled.is_empty() {
        match fresh_rows(pool, &unsettled).await {
            Ok(fresh) => decided.extend(fresh),
            Err(e) => {
                tracing::debug!(error = %e, items = unsettled.len(), "the read after a consume batch failed");
                read_failed = Some(Arc::new(e));
            }
        }
    }
    Ok(ids
        .iter()
        .map(|id| match (decided.remove(id), &read_failed) {
            (Some(answer), _) => Ok(answer),
            (None, Some(cause)) => Err(DurableError::Batch(Some(cause.clone()))),
            (None, None) => Ok((ConsumeRow::Expired, 0)),
        })
        .collect())
}

/// The rows of `ids` as they are now (a fresh snapshot).
async fn fresh_rows(
    pool: &PgPool,
    ids: &[i64],
) -> Result<Vec<(i64, (ConsumeRow, i64))>, DurableError> {
    let fresh = super::fetch_all(pool, || {
        sqlx::query(
            "SELECT id, state, consumed_at, fingerprint, request_id, result, order_id, expires_at, gen,
                    uncertain_since
               FROM tokens WHERE id = ANY($1)",
        )
        .bind(ids)
    })
    .await?;
    let mut out = Vec::with_capacity(fresh.len());
    for row in &fresh {
        let id: i64 = row.try_get("id")?;
        let e = tokens::existing(row)?;
        let gen = e.gen;
        out.push((id, (ConsumeRow::Existing(e), gen)));
    }
    Ok(out)
}

/// A result or a release of a consumed token or client key.
#[derive(Debug, Clone, PartialEq)]
pub enum FinishItem {
    /// [`tokens::set_result_versioned`]'s arguments.
    Result {
        id: i64,
        result: Json,
        detail: Option<Json>,
        of_request: Option<String>,
    },
    /// [`tokens::release_with`]'s arguments.
    Release {
        id: i64,
        detail: Option<Json>,
        of_request: Option<String>,
    },
}

impl FinishItem {
    fn id(&self) -> i64 {
        match self {
            FinishItem::Result { id, .. } | FinishItem::Release { id, .. } => *id,
        }
    }
}

/// What a [`FinishItem`] did: its statement's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Finished {
    Result(ResultDecided),
    Release(ReleaseRow),
}

type FinishAnswer = Result<Finished, DurableError>;

/// Results and releases, sent at once or in batches, as [`ConsumeBatcher`]
/// sends consumes: one queue for both, keyed by id (a result and a release
/// of one token never run at once), the consumes' limits, one statement
/// per batch ([`finish_batch`]) with an answer per item, a refused batch
/// decided item by item, an unknown outcome answered to each item.
#[derive(Debug)]
pub struct FinishBatcher {
    queue: GroupCommit<Finishes>,
}

/// How a batch of results and releases is decided.
struct Finishes {
    pools: Pools,
}

impl FinishBatcher {
    /// `clock` times the queue bound; the batches run on `off_path`.
    pub fn new(
        pools: Pools,
        metrics: Arc<Metrics>,
        settings: &PostgresSettings,
        clock: Arc<dyn Clock>,
        off_path: OffPath,
    ) -> FinishBatcher {
        let limits = Limits::for_pool(
            settings.consume_batch_size,
            settings.consume_batches_in_flight,
            settings.pool_size,
            settings.acquire_timeout,
        );
        FinishBatcher {
            queue: GroupCommit::new(
                Finishes { pools },
                limits,
                metrics.pg_finish_queue.clone(),
                metrics.pg_finish_batch_size.clone(),
                clock,
                off_path,
            ),
        }
    }

    /// Records a result, as [`tokens::set_result_versioned`] does.
    pub async fn result(
        &self,
        id: i64,
        result: &Json,
        detail: Option<&Json>,
        of_request: Option<&str>,
    ) -> Result<ResultDecided, DurableError> {
        let item = || FinishItem::Result {
            id,
            result: result.clone(),
            detail: detail.cloned(),
            of_request: of_request.map(str::to_owned),
        };
        match self.finish(id, item).await? {
            Finished::Result(r) => Ok(r),
            // Never: a batch answers each item in its own kind.
            Finished::Release(_) => Err(DurableError::Batch(None)),
        }
    }

    /// Releases, as [`tokens::release_with`] does.
    pub async fn release(
        &self,
        id: i64,
        detail: Option<&Json>,
        of_request: Option<&str>,
    ) -> Result<ReleaseRow, DurableError> {
        let item = || FinishItem::Release {
            id,
            detail: detail.cloned(),
            of_request: of_request.map(str::to_owned),
        };
        match self.finish(id, item).await? {
            Finished::Release(r) => Ok(r),
            Finished::Result(_) => Err(DurableError::Batch(None)),
        }
    }

    async fn finish(&self, id: i64, item: impl Fn() -> FinishItem) -> FinishAnswer {
        match self.queue.enter([id], &item) {
            // The slot is given back when this is done or dropped.
            Turn::Now(_slot) => self.queue.work().single(&item()).await,
            // The batch task ended without answering (the runtime stopping).
            Turn::Queued(answer) => answer
                .await
                .unwrap_or_else(|_| Err(DurableError::Batch(None))),
        }
    }
}

impl Work for Finishes {
    type Key = i64;
    type Keys = [i64; 1];
    type Item = FinishItem;
    type Answer = FinishAnswer;

    fn keys(item: &FinishItem) -> [i64; 1] {
        [item.id()]
    }

    fn waited_too_long() -> FinishAnswer {
        Err(DurableError::Unavailable(sqlx::Error::PoolTimedOut))
    }

    /// By id: every batch locks its rows in id order.
    fn batch_order(a: &FinishItem, b: &FinishItem) -> Ordering {
        a.id().cmp(&b.id())
    }

    async fn run(&self, items: Vec<FinishItem>, _slot: Slot<Self>) -> Vec<FinishAnswer> {
        decide_items(
            "result/release",
            &items,
            |item| self.single(item),
            |refs| async move {
                self.pools
                    .bounded(finish_batch(&self.pools.hot, &refs))
                    .await
            },
        )
        .await
    }
}

impl Finishes {
    async fn single(&self, item: &FinishItem) -> FinishAnswer {
        let pool = &self.pools.hot;
        match item {
            FinishItem::Result {
                id,
                result,
                detail,
                of_request,
            } => self
                .pools
                .bounded(tokens::set_result_versioned(
                    pool,
                    *id,
                    result,
                    detail.as_ref(),
                    of_request.as_deref(),
                ))
                .await
                .map(Finished::Result),
            FinishItem::Release {
                id,
                detail,
                of_request,
            } => self
                .pools
                .bounded(tokens::release_with(
                    pool,
                    *id,
                    detail.as_ref(),
                    of_request.as_deref(),
                ))
                .await
                .map(Finished::Release),
        }
    }
}

// The results and releases batch statement, in parts ([`finish_batch`]).
// The rows are locked in id order first (`lk`), as every consume batch
// locks them, so that batches of both kinds never deadlock; then the single
// statements' updates and audit rows, per item.
macro_rules! finish_locked {
    () => {
        r#"
        WITH r AS (
            SELECT * FROM UNNEST($1::bigint[], $2::bool[], $3::text[], $4::text[], $5::text[])
                       AS r(id, rel, result, detail, of_request)
        ), lk AS (
            SELECT t.id, t.state, t.result IS NULL AS no_result, t.order_id IS NULL AS no_order,
                   t.request_id
              FROM tokens t WHERE t.id = ANY($1) ORDER BY t.id FOR UPDATE
        )"#
    };
}
macro_rules! finish_results {
    () => {
        r#"
        , upd AS (
            -- The conditions are the locked rows' (`lk`: each row's newest
            -- version, locked by this statement, so the same in the update).
            -- On `t` itself only its id: a condition on its state would let
            -- a cached plan, made on statistics that saw few consumed rows,
            -- find the batch's rows through an index of every consumed row.
            UPDATE tokens t SET result = r.result::jsonb, result_at = now()
              FROM r JOIN lk ON lk.id = r.id
             WHERE NOT r.rel AND t.id = r.id
               AND lk.state = 'consumed' AND lk.no_result
               AND (r.of_request IS NULL OR lk.request_id = r.of_request)
            RETURNING t.id, t.token, t.key, t.subject, t.biz_type, t.client, t.state, t.consumed_at,
                      t.fingerprint, t.request_id, t.result, t.order_id, t.expires_at, t.gen,
                      t.result_at, r.detail::jsonb AS detail
        ), audit_result AS (
            INSERT INTO audit_events (at, kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT u.result_at, CASE WHEN u.key IS NULL THEN 'token.result' ELSE 'key.result' END::audit_kind,
                   u.id, CASE WHEN u.key IS NULL THEN u.token END, nullif(u.subject, ''), u.biz_type,
                   u.client, u.gen, jsonb_build_object('result', u.result) || CASE WHEN u.key IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('key', u.key) END
                   || COALESCE(u.detail, '{}'::jsonb)
              FROM upd u
             ORDER BY u.id
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )"#
    };
}
macro_rules! finish_releases {
    () => {
        r#"
        , rel AS (
            UPDATE tokens t
               SET state = 'issued', gen = t.gen + 1, consumed_at = NULL, fingerprint = NULL,
                   request_id = NULL,
                   -- A key dates its release here (see V6).
                   expires_at = CASE WHEN t.key IS NULL THEN t.expires_at ELSE now() END
              FROM r JOIN lk ON lk.id = r.id
             WHERE r.rel AND t.id = r.id
               AND lk.state = 'consumed' AND lk.no_result AND lk.no_order
               AND (r.of_request IS NULL OR lk.request_id = r.of_request)
            RETURNING t.id, t.token, t.key, t.subject, t.biz_type, t.client, t.expires_at, t.gen,
                      r.detail::jsonb AS detail
        ), audit_release AS (
            INSERT INTO audit_events (kind, token_id, token, subject, biz_type, client, gen, detail)
            SELECT CASE WHEN l.key IS NULL THEN 'token.released' ELSE 'key.released' END::audit_kind,
                   l.id, CASE WHEN l.key IS NULL THEN l.token END, nullif(l.subject, ''), l.biz_type,
                   l.client, l.gen,
                   CASE WHEN l.key IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('key', l.key) END
                   || COALESCE(l.detail, '{}'::jsonb)
              FROM rel l
             ORDER BY l.id
            ON CONFLICT (token_id, kind, gen) WHERE gen IS NOT NULL DO NOTHING
        )"#
    };
}
macro_rules! finish_results_answered {
    () => {
        r#"
        SELECT u.id, false AS released, u.state, u.consumed_at, u.fingerprint, u.request_id,
               u.result, u.order_id, u.expires_at, u.gen
          FROM upd u"#
    };
}
macro_rules! finish_releases_answered {
    () => {
        r#"
        SELECT l.id, true AS released, 'issued'::token_state AS state,
               NULL::timestamptz AS consumed_at, NULL::text AS fingerprint,
               NULL::text AS request_id, NULL::jsonb AS result, NULL::text AS order_id,
               l.expires_at, l.gen
          FROM rel l"#
    };
}

/// A batch of results only.
const FINISH_RESULTS: &str = concat!(
    finish_locked!(),
    finish_results!(),
    finish_results_answered!()
);
/// A batch of releases only.
const FINISH_RELEASES: &str = concat!(
    finish_locked!(),
    finish_releases!(),
    finish_releases_answered!()
);
/// A batch of both.
const FINISH_RESULTS_AND_RELEASES: &str = concat!(
    finish_locked!(),
    finish_results!(),
    finish_releases!(),
    finish_results_answered!(),
    "        UNION ALL",
    finish_releases_answered!()
);

/// Decides a batch of results and releases (distinct ids, sorted by id) in
/// one statement: for each item, in order, what
/// [`tokens::set_result_versioned`] or [`tokens::release_with`] would
/// answer it (the same updates and audit rows; the rows neither changed
/// read afterwards, in one read). Exposed for the tests; the service goes
/// through [`FinishBatcher`].
///
/// `Err` only when the statement failed: then nothing of the batch
/// committed. Once it succeeded, an item it did not change whose read
/// after it fails gets that error on its own.
pub async fn finish_batch(
    pool: &PgPool,
    items: &[&FinishItem],
) -> Result<Vec<FinishAnswer>, DurableError> {
    let n = items.len();
    let (mut ids, mut rel, mut results, mut details, mut rids) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for it in items {
        let (result, detail, of_request) = match it {
            FinishItem::Result {
                result,
                detail,
                of_request,
                ..
            } => (Some(result.to_string()), detail, of_request),
            FinishItem::Release {
                detail, of_request, ..
            } => (None, detail, of_request),
        };
        ids.push(it.id());
        rel.push(matches!(it, FinishItem::Release { .. }));
        results.push(result);
        details.push(detail.as_ref().map(Json::to_string));
        rids.push(of_request.as_deref());
    }
    // A batch with no release (or no result) runs a statement without that
    // part: each part's update sets up a scan of every partition of
    // `tokens` whether or not an item needs it.
    let statement = match (rel.contains(&false), rel.contains(&true)) {
        (true, false) => FINISH_RESULTS,
        (false, true) => FINISH_RELEASES,
        _ => FINISH_RESULTS_AND_RELEASES,
    };
    let rows = super::fetch_all(pool, || {
        sqlx::query(statement)
            .bind(&ids)
            .bind(&rel)
            .bind(&results)
            .bind(&details)
            .bind(&rids)
    })
    .await?;
    let mut decided: HashMap<i64, Finished> = HashMap::with_capacity(n);
    for row in &rows {
        let id: i64 = row.try_get("id")?;
        let answer = if row.try_get::<bool, _>("released")? {
            Finished::Release(ReleaseRow::Released {
                expires_at: row.try_get("expires_at")?,
                gen: row.try_get("gen")?,
            })
        } else {
            Finished::Result(ResultDecided::Recorded(tokens::existing(row)?))
        };
        decided.insert(id, answer);
    }
    // Not changed: the row as it is now, as the single statements read it.
    let unchanged: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| !decided.contains_key(id))
        .collect();
    let mut found: HashMap<i64, Existing> = HashMap::new();
    let mut read_failed: Option<Arc<DurableError>> = None;
    if !unchanged.is_empty() {
        match read_rows(pool, &unchanged).await {
            Ok(rows) => found = rows,
            Err(e) => {
                tracing::debug!(error = %e, items = unchanged.len(), "the read after a result/release batch failed");
                read_failed = Some(Arc::new(e));
            }
        }
    }
    Ok(items
        .iter()
        .map(|it| {
            let id = it.id();
            if let Some(answer) = decided.remove(&id) {
                return Ok(answer);
            }
            if let Some(cause) = &read_failed {
                return Err(DurableError::Batch(Some(cause.clone())));
            }
            let e = found.remove(&id);
            Ok(match it {
                FinishItem::Result { .. } => Finished::Result(match e {
                    Some(e) => ResultDecided::Existing(e),
                    None => ResultDecided::Unknown,
                }),
                FinishItem::Release { .. } => Finished::Release(match e {
                    Some(e) => ReleaseRow::Existing(e),
                    None => ReleaseRow::Unknown,
                }),
            })
        })
        .collect())
}

/// The rows of `ids` as [`tokens::find`] reads them.
async fn read_rows(pool: &PgPool, ids: &[i64]) -> Result<HashMap<i64, Existing>, DurableError> {
    let rows = super::fetch_all(pool, || {
        sqlx::query(
            "SELECT id, state, consumed_at, fingerprint, request_id, result, order_id, expires_at,
                    gen, uncertain_since
               FROM tokens WHERE id = ANY($1)",
        )
        .bind(ids)
    })
    .await?;
    let mut out = HashMap::with_capacity(rows.len());
    for row in &rows {
        out.insert(row.try_get("id")?, tokens::existing(row)?);
    }
    Ok(out)
}
