//! Group commit of order events: [`EventBatcher`] runs an event at once, in
//! its own transaction, while no event transaction runs; the events that
//! arrive meanwhile form the next batch, decided in one transaction with an
//! answer per event. The queue is [`crate::durable::group`]'s, keyed by
//! order and by token: up to `postgres.order_batches_in_flight`
//! transactions at once, each beside a running one with a quarter-full
//! batch.
//!
//! A batch's transaction: `BEGIN`; one statement locks every order of the
//! batch ([`sql::lock_many`]); the checks and [`decide`](super::decide) of
//! the single event run in Rust for each; the refusals are decided again on
//! one fresh read of their tokens ([`sql::token_usage_many`]); one statement
//! writes the events that apply ([`sql::write_events`]); `COMMIT`. Then one
//! read of the orders answers them ([`sql::get_many`]). A single event runs
//! the same steps with the one-order statements.
//!
//! What holds, and why:
//! - **No wait when idle.** An event that finds no transaction running runs
//!   alone on its own task; the others wait for a transaction that is
//!   already running, not for a timer.
//! - **Hot orders serialise.** A batch holds at most one event per order
//!   and per token, none whose order or token is in a running transaction:
//!   a later event of an order waits for the next batch after it, and sees
//!   the earlier one's outcome as the order's row.
//! - **No deadlocks.** A batch locks its orders in one statement, in
//!   `order_id` order; a single event locks one; tokens are claimed in id
//!   order, after the orders, as in every statement that takes token rows.
//! - **The same answer as alone.** Each event gets the checks, decision,
//!   counters, rows and Redis write-back of the single path (the functions
//!   of [`super`], shared by both).
//! - **One event never fails another.** Refusals are answers, not errors; a
//!   batch whose statements Postgres refuses (an error that rolled it back)
//!   is decided again event by event, alone, each with its own answer.
//! - **Unknown stays unknown.** When a batch's write or its `COMMIT` fails
//!   unanswered (the connection lost, no answer within the pool's deadline),
//!   every event it was writing gets that failure as its answer
//!   ([`DurableError::Batch`], 503 `unavailable`), as the single event's
//!   would be; the events decided without a write keep their answers.
//! - **Bounded.** Every statement runs under [`Pools::bounded`]; an event
//!   that waited for its batch longer than it could have waited alone for a
//!   connection and its order's lock (`postgres.acquire_timeout +
//!   statement_timeout`) is answered as a pool wait would be (503) without
//!   being sent.

use std::collections::HashMap;
use std::sync::Arc;

use super::{
    answer, judge, settle, Applied, Event, EventInput, Judged, Next, Order, OrderError, Outcome,
};
use crate::auth::Client;
use crate::clock::Clock;
use crate::durable::group::{GroupCommit, Limits, Slot, Turn, Work};
use crate::durable::orders::{self as sql, LockItem, OrderChange};
use crate::durable::tokens::TokenRecord;
use crate::durable::{timed, DurableError, Pools};
use crate::ledger::{Ledger, OrderToken};
use crate::tasks::OffPath;
use crate::token::VerifiedToken;

type Answer = Result<(Applied, Order), OrderError>;

/// Order events, run alone or in batches (see the module's docs). Shared
/// by every request of the service.
#[derive(Debug)]
pub struct EventBatcher {
    queue: GroupCommit<Events>,
}

/// How a batch of events is decided.
struct Events {
    ledger: Arc<Ledger>,
    pools: Pools,
}

/// What serialises events: their order, and the token they spend.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Order(String),
    Token(i64),
}

/// An event waiting for its batch, with what it was called with.
struct Queued {
    caller: Client,
    order_id: String,
    input: EventInput,
    token: OrderToken,
}

impl Queued {
    fn event(&self) -> Event<'_> {
        Event {
            caller: &self.caller,
            order_id: &self.order_id,
            input: &self.input,
            token: &self.token,
        }
    }
}

fn keys(order_id: &str, token: &OrderToken) -> [Key; 2] {
    [
        Key::Order(order_id.to_owned()),
        Key::Token(token.verified().claims.id.as_i64()),
    ]
}

impl EventBatcher {
    /// `clock` times the queue bound; the batches run on `off_path`.
    pub fn new(
        ledger: Arc<Ledger>,
        pools: Pools,
        clock: Arc<dyn Clock>,
        off_path: OffPath,
    ) -> EventBatcher {
        let settings = ledger.postgres_settings();
        let limits = Limits::for_pool(
            settings.order_batch_size,
            settings.order_batches_in_flight,
            settings.pool_size,
            // As long as an event could have waited alone for a pooled
            // connection and then for its order's lock.
            settings.acquire_timeout + settings.statement_timeout,
        );
        let metrics = ledger.metrics();
        let (queued, sizes) = (
            metrics.pg_order_queue.clone(),
            metrics.pg_order_batch_size.clone(),
        );
        EventBatcher {
            queue: GroupCommit::new(
                Events { ledger, pools },
                limits,
                queued,
                sizes,
                clock,
                off_path,
            ),
        }
    }

    /// Runs one event (checked as far as it can be without Postgres) and
    /// answers it.
    pub async fn apply(&self, ev: &Event<'_>) -> Answer {
        let turn = self.queue.enter(keys(ev.order_id, ev.token), || Queued {
            caller: ev.caller.clone(),
            order_id: ev.order_id.to_owned(),
            input: ev.input.clone(),
            token: ev.token.clone(),
        });
        match turn {
            Turn::Now(slot) => {
                // Given back when the transaction ended, or when this is
                // dropped (the request gone).
                let events = self.queue.work();
                let outcome = events.transact(ev).await;
                drop(slot);
                events.finish(ev, outcome).await
            }
            // The batch task ended without answering: only when the runtime
            // stops under it, after its transaction may have committed.
            Turn::Queued(answer) => answer
                .await
                .unwrap_or_else(|_| Err(DurableError::Batch(None).into())),
        }
    }
}

impl Work for Events {
    type Key = Key;
    type Keys = [Key; 2];
    type Item = Queued;
    type Answer = Answer;

    fn keys(q: &Queued) -> [Key; 2] {
        keys(&q.order_id, &q.token)
    }

    fn waited_too_long() -> Answer {
        Err(DurableError::Unavailable(sqlx::Error::PoolTimedOut).into())
    }

    async fn run(&self, items: Vec<Queued>, slot: Slot<Self>) -> Vec<Answer> {
        let events: Vec<Event<'_>> = items.iter().map(Queued::event).collect();
        let outcomes = if let [ev] = events.as_slice() {
            vec![self.transact_bounded(ev).await]
        } else {
            self.transact_batch(&events).await
        };
        // The orders' rows are written: the next events may lock them
        // while these are answered.
        drop(slot);
        self.finish_all(&events, outcomes).await
    }
}

impl Events {
    fn metrics(&self) -> &crate::metrics::Metrics {
        self.ledger.metrics()
    }

    /// One event in its own transaction: lock the order, decide, write,
    /// commit.
    async fn transact(&self, ev: &Event<'_>) -> Outcome {
        match self.try_transact(ev).await {
            Ok(outcome) => outcome,
            Err(e) => Outcome::Refused(e),
        }
    }

    async fn try_transact(&self, ev: &Event<'_>) -> Result<Outcome, OrderError> {
        match self.try_transact_once(ev).await? {
            // The token's claim found it consumed, though the lock's read
            // showed it unused: a transaction on another instance consumed
            // it and committed while this one waited for the order's row
            // (the row is re-read after the wait, the token in the same
            // statement is not). Nothing was written: decided again, on
            // what that transaction committed (a duplicate, or the applied
            // answer again for its request_id), never `token_already_used`
            // from a stale view.
            Outcome::Written(None) => self.try_transact_once(ev).await,
            outcome => Ok(outcome),
        }
    }

    async fn try_transact_once(&self, ev: &Event<'_>) -> Result<Outcome, OrderError> {
        let ledger = &self.ledger;
        let metrics = ledger.metrics();
        let token = ev.token.verified();
        let mut tx = crate::durable::begin(&self.pools.hot)
            .await
            .map_err(DurableError::from)?;
        let locked = timed(
            metrics,
            "order_lock",
            sql::lock(&mut tx, ev.order_id, token),
        )
        .await?;
        let mut judged = judge(ledger, ev, locked)?;
        if judged.needs_fresh_usage() {
            let usage = timed(metrics, "order_token", sql::token_usage(&mut tx, token)).await?;
            judged.decide_again(ev, &usage);
        }
        let (change, subject) = match judged.next(ev) {
            Next::Write { change, subject } => (change, subject),
            Next::Done(outcome) => {
                drop(tx);
                return Ok(outcome);
            }
        };
        let record = ledger.order_record(ev.token, ev.caller, &subject);
        let claimed = ledger.consume_for_order(tx, &record, &change).await?;
        Ok(Outcome::Written(claimed))
    }

    /// [`Events::transact`] within the deadline a request's event has (the
    /// batch task has no request around it).
    async fn transact_bounded(&self, ev: &Event<'_>) -> Outcome {
        let deadline = self.pools.deadline * 2;
        match tokio::time::timeout(deadline, self.transact(ev)).await {
            Ok(outcome) => outcome,
            Err(_) => Outcome::Refused(DurableError::TimedOut(deadline).into()),
        }
    }

    /// Events on distinct orders in one transaction; per event, in order,
    /// how it ended (see the module's docs for a failed batch).
    async fn transact_batch(&self, events: &[Event<'_>]) -> Vec<Outcome> {
        let mut progress = Progress {
            outcomes: events.iter().map(|_| None).collect(),
            committing: false,
        };
        let failure = self.try_batch(events, &mut progress).await.err();
        let Progress {
            outcomes,
            committing,
        } = progress;
        let Some(error) = failure else {
            return outcomes
                .into_iter()
                // Not reached: a batch that succeeded decided every event.
                .map(|o| o.unwrap_or_else(|| Outcome::Refused(DurableError::Batch(None).into())))
                .collect();
        };
        // Refused: an error of a statement, which rolled the transaction
        // back, or a COMMIT Postgres refused. Something an event holds, most
        // likely: each one not yet decided runs alone, with its own answer.
        let refused = if committing {
            matches!(error, DurableError::Other(sqlx::Error::Database(_)))
        } else {
            !error.is_unavailable()
        };
        let mut decided = Vec::with_capacity(events.len());
        if refused {
            tracing::warn!(error = %error, events = events.len(), "postgres refused an order event batch: its events are decided one by one");
            for (ev, outcome) in events.iter().zip(outcomes) {
                decided.push(match outcome {
                    Some(o) => o,
                    None => self.transact_bounded(ev).await,
                });
            }
            return decided;
        }
        // Unavailable, timed out, or a COMMIT without an answer: every
        // event not yet decided gets it, as its single transaction would.
        tracing::debug!(error = %error, events = events.len(), committing, "order event batch failed");
        let cause = Arc::new(error);
        for outcome in outcomes {
            decided.push(outcome.unwrap_or_else(|| {
                Outcome::Refused(DurableError::Batch(Some(cause.clone())).into())
            }));
        }
        decided
    }

    /// The batch's transaction. Fills `p.outcomes` for each event as it is
    /// decided; on an error, the events still `None` are the ones it had
    /// not decided (those being written, when `p.committing`).
    async fn try_batch(&self, events: &[Event<'_>], p: &mut Progress) -> Result<(), DurableError> {
        let (ledger, pools) = (&self.ledger, &self.pools);
        let metrics = ledger.metrics();
        let mut tx = pools.bounded(crate::durable::begin(&pools.hot)).await?;
        let items: Vec<LockItem<'_>> = events
            .iter()
            .map(|ev| LockItem {
                order_id: ev.order_id,
                token: ev.token.verified(),
            })
            .collect();
        let locked = timed(
            metrics,
            "order_lock_batch",
            pools.bounded(sql::lock_many(&mut tx, &items)),
        )
        .await?;
        let mut judged: Vec<Option<Judged>> = Vec::with_capacity(events.len());
        for ((ev, locked), outcome) in events.iter().zip(locked).zip(p.outcomes.iter_mut()) {
            match judge(ledger, ev, locked) {
                Ok(j) => judged.push(Some(j)),
                Err(e) => {
                    *outcome = Some(Outcome::Refused(e));
                    judged.push(None);
                }
            }
        }
        let again: Vec<usize> = judged
            .iter()
            .enumerate()
            .filter(|(_, j)| j.as_ref().is_some_and(Judged::needs_fresh_usage))
            .map(|(i, _)| i)
            .collect();
        if !again.is_empty() {
            let tokens: Vec<&VerifiedToken> =
                again.iter().map(|&i| events[i].token.verified()).collect();
            let usage = timed(
                metrics,
                "order_token_batch",
                pools.bounded(sql::token_usage_many(&mut tx, &tokens)),
            )
            .await?;
            for (&i, usage) in again.iter().zip(&usage) {
                if let Some(j) = judged[i].as_mut() {
                    j.decide_again(&events[i], usage);
                }
            }
        }
        let mut writes: Vec<(usize, TokenRecord, OrderChange<'_>)> = Vec::new();
        for (i, j) in judged.into_iter().enumerate() {
            let Some(j) = j else { continue };
            let ev = &events[i];
            match j.next(ev) {
                Next::Write { change, subject } => {
                    let record = ledger.order_record(ev.token, ev.caller, &subject);
                    writes.push((i, record, change));
                }
                Next::Done(outcome) => p.outcomes[i] = Some(outcome),
            }
        }
        if writes.is_empty() {
            // Nothing to write: dropping the transaction rolls it back.
            return Ok(());
        }
        let refs: Vec<(&TokenRecord, &OrderChange<'_>)> =
            writes.iter().map(|(_, r, c)| (r, c)).collect();
        let claims = pools
            .bounded(ledger.consume_for_orders(&mut tx, &refs))
            .await?;
        p.committing = true;
        pools.bounded(tx.commit()).await?;
        for ((i, _, _), claim) in writes.iter().zip(claims) {
            p.outcomes[*i] = Some(match claim {
                Some(claim) => Outcome::Written(Some(claim)),
                // Consumed by a transaction this one's read did not see
                // (see `try_transact`): nothing of it was written, so it is
                // decided again alone, on a fresh read.
                None => self.transact_bounded(&events[*i]).await,
            });
        }
        Ok(())
    }

    /// The answer to a single event, after its transaction.
    async fn finish(&self, ev: &Event<'_>, outcome: Outcome) -> Answer {
        let applied = settle(&self.ledger, ev, outcome)?;
        let read = timed(
            self.metrics(),
            "order_get",
            self.pools.bounded(sql::get(&self.pools.hot, ev.order_id)),
        )
        .await?;
        answer(ev.caller, applied, read)
    }

    /// The answers to the events of a batch (distinct orders), after its
    /// transaction: one read for every order the answers show.
    async fn finish_all(&self, events: &[Event<'_>], outcomes: Vec<Outcome>) -> Vec<Answer> {
        if let [ev] = events {
            let mut outcomes = outcomes;
            return match outcomes.pop() {
                Some(outcome) => vec![self.finish(ev, outcome).await],
                None => Vec::new(),
            };
        }
        let settled: Vec<Result<Applied, OrderError>> = events
            .iter()
            .zip(outcomes)
            .map(|(ev, outcome)| settle(&self.ledger, ev, outcome))
            .collect();
        let wanted: Vec<&str> = events
            .iter()
            .zip(&settled)
            .filter(|(_, s)| s.is_ok())
            .map(|(ev, _)| ev.order_id)
            .collect();
        let mut read = if wanted.is_empty() {
            Ok(HashMap::new())
        } else {
            timed(
                self.metrics(),
                "order_get_batch",
                self.pools.bounded(sql::get_many(&self.pools.hot, &wanted)),
            )
            .await
            .map_err(Arc::new)
        };
        events
            .iter()
            .zip(settled)
            .map(|(ev, settled)| {
                let applied = settled?;
                match &mut read {
                    Ok(found) => answer(ev.caller, applied, found.remove(ev.order_id)),
                    Err(cause) => Err(DurableError::Batch(Some(cause.clone())).into()),
                }
            })
            .collect()
    }
}

/// A batch's transaction as far as it got.
struct Progress {
    outcomes: Vec<Option<Outcome>>,
    /// The write ran: an error now is the write's or the COMMIT's.
    committing: bool,
}
