//! Group commit of order events: [`EventBatcher`] runs an event at once, in
//! its own transaction, while fewer than `postgres.order_batches_in_flight`
//! event transactions run and none holds its order; the events that arrive
//! meanwhile form the next batch, decided in one transaction with an answer
//! per event.
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
//! - **No wait when idle.** An event that finds a free slot runs alone on
//!   its own task; only events that find every slot busy, or their order in
//!   a running transaction, wait, and they wait for a transaction that is
//!   already running, not for a timer.
//! - **Hot orders serialise.** A batch holds at most one event per order
//!   (and per token), none whose order is in a running transaction: a later
//!   event of an order waits for the next batch after it, and sees the
//!   earlier one's outcome as the order's row.
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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{
    answer, judge, settle, Applied, Event, EventInput, Judged, Next, Order, OrderError, Outcome,
};
use crate::auth::Client;
use crate::durable::orders::{self as sql, LockItem, OrderChange};
use crate::durable::tokens::TokenRecord;
use crate::durable::{timed, DurableError, Pools};
use crate::ledger::{Ledger, OrderToken};
use crate::token::VerifiedToken;

type Answer = Result<(Applied, Order), OrderError>;

/// Order events, run alone or in batches (see the module's docs). Shared
/// by every request of the service.
pub struct EventBatcher {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EventBatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventBatcher")
            .field("size", &self.inner.size)
            .field("slots", &self.inner.slots)
            .finish()
    }
}

struct Inner {
    ledger: Arc<Ledger>,
    pools: Pools,
    /// The most events of one transaction.
    size: usize,
    /// The most event transactions running at once.
    slots: usize,
    /// How long an event may wait for its batch: as long as it could have
    /// waited alone for a pooled connection and then for its order's lock.
    queue_bound: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    running: usize,
    /// Orders in a running transaction.
    busy: HashSet<String>,
    /// In arrival order. Either `running == slots`, or every event here
    /// waits for a busy order: [`Inner::dispatch`] keeps it so.
    queue: VecDeque<Waiting>,
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

struct Waiting {
    queued: Queued,
    since: Instant,
    reply: oneshot::Sender<Answer>,
}

/// What [`assemble`] needs of a queued event.
trait Keyed {
    fn order_id(&self) -> &str;
    fn token_id(&self) -> i64;
}

impl Keyed for Waiting {
    fn order_id(&self) -> &str {
        &self.queued.order_id
    }
    fn token_id(&self) -> i64 {
        self.queued.token.verified().claims.id.as_i64()
    }
}

impl EventBatcher {
    pub fn new(ledger: Arc<Ledger>, pools: Pools) -> EventBatcher {
        let settings = ledger.postgres_settings();
        let size = settings.order_batch_size.max(1);
        let slots = settings
            .order_batches_in_flight
            .clamp(1, settings.pool_size.max(1) as usize);
        let queue_bound = settings.acquire_timeout + settings.statement_timeout;
        EventBatcher {
            inner: Arc::new(Inner {
                ledger,
                pools,
                size,
                slots,
                queue_bound,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Runs one event (checked as far as it can be without Postgres) and
    /// answers it.
    pub async fn apply(&self, ev: &Event<'_>) -> Answer {
        let inner = &self.inner;
        let waiting = {
            let mut s = inner.lock();
            if s.running < inner.slots && !s.busy.contains(ev.order_id) {
                s.running += 1;
                s.busy.insert(ev.order_id.to_owned());
                None
            } else {
                let (reply, answer) = oneshot::channel();
                s.queue.push_back(Waiting {
                    queued: Queued {
                        caller: ev.caller.clone(),
                        order_id: ev.order_id.to_owned(),
                        input: ev.input.clone(),
                        token: ev.token.clone(),
                    },
                    since: Instant::now(),
                    reply,
                });
                inner.metrics().pg_order_queue.set(s.queue.len() as i64);
                Some(answer)
            }
        };
        match waiting {
            None => {
                // Given back when the transaction ended, or when this is
                // dropped (the request gone).
                let slot = Slot {
                    inner: inner.clone(),
                    orders: vec![ev.order_id.to_owned()],
                };
                inner.metrics().pg_order_batch_size.observe(1.0);
                let outcome = inner.transact(ev).await;
                drop(slot);
                inner.finish(ev, outcome).await
            }
            // The batch task ended without answering: only when the runtime
            // stops under it, after its transaction may have committed.
            Some(answer) => answer
                .await
                .unwrap_or_else(|_| Err(DurableError::Batch(None).into())),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is consistent after every statement under the lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn metrics(&self) -> &crate::metrics::Metrics {
        self.ledger.metrics()
    }

    /// Starts the batches the free slots allow (after a transaction ended).
    fn dispatch(self: &Arc<Self>, s: &mut State) {
        while s.running < self.slots {
            let batch = assemble(&mut s.queue, self.size, &s.busy);
            if batch.is_empty() {
                break;
            }
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                // No runtime to run it on (the service is stopping): the
                // events are dropped, and their callers answer 503.
                continue;
            };
            s.running += 1;
            s.busy
                .extend(batch.iter().map(|w| w.queued.order_id.clone()));
            runtime.spawn(self.clone().run(batch));
        }
        self.metrics().pg_order_queue.set(s.queue.len() as i64);
    }

    /// Decides one batch and answers its events.
    async fn run(self: Arc<Self>, batch: Vec<Waiting>) {
        let slot = Slot {
            inner: self.clone(),
            orders: batch.iter().map(|w| w.queued.order_id.clone()).collect(),
        };
        // Events whose caller is gone are not sent; events that waited too
        // long are answered as a pool wait that timed out (never sent).
        let mut live = Vec::with_capacity(batch.len());
        for w in batch {
            if w.reply.is_closed() {
                continue;
            }
            if w.since.elapsed() > self.queue_bound {
                let _ = w.reply.send(Err(
                    DurableError::Unavailable(sqlx::Error::PoolTimedOut).into()
                ));
                continue;
            }
            live.push(w);
        }
        if live.is_empty() {
            return;
        }
        self.metrics()
            .pg_order_batch_size
            .observe(live.len() as f64);
        let events: Vec<Event<'_>> = live.iter().map(|w| w.queued.event()).collect();
        let outcomes = if let [ev] = events.as_slice() {
            vec![self.transact_bounded(ev).await]
        } else {
            self.transact_batch(&events).await
        };
        drop(slot);
        let answers = self.finish_all(&events, outcomes).await;
        drop(events);
        for (w, answer) in live.into_iter().zip(answers) {
            let _ = w.reply.send(answer);
        }
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

    /// [`Inner::transact`] within the deadline a request's event has (the
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
            p.outcomes[*i] = Some(Outcome::Written(claim));
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

/// A running transaction's slot and orders: given back when it ends
/// (however it ends), which starts the next batches.
struct Slot {
    inner: Arc<Inner>,
    orders: Vec<String>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.inner.lock();
        s.running -= 1;
        for id in &self.orders {
            s.busy.remove(id);
        }
        self.inner.dispatch(&mut s);
    }
}

/// Takes the next batch from `queue`: in arrival order, at most `max`
/// events, at most one per order and one per token, none whose order is
/// `busy`. The events left keep their order.
fn assemble<T: Keyed>(queue: &mut VecDeque<T>, max: usize, busy: &HashSet<String>) -> Vec<T> {
    let mut batch: Vec<T> = Vec::new();
    let mut orders: HashSet<String> = HashSet::new();
    let mut tokens: HashSet<i64> = HashSet::new();
    let mut skipped = Vec::new();
    while batch.len() < max {
        let Some(item) = queue.pop_front() else {
            break;
        };
        let order = item.order_id();
        let free =
            !busy.contains(order) && !orders.contains(order) && !tokens.contains(&item.token_id());
        if free {
            orders.insert(order.to_owned());
            tokens.insert(item.token_id());
            batch.push(item);
        } else {
            skipped.push(item);
        }
    }
    for item in skipped.into_iter().rev() {
        queue.push_front(item);
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::{assemble, Keyed};
    use proptest::prelude::*;
    use std::collections::{HashSet, VecDeque};

    /// (arrival index, order, token id)
    #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
    struct Item(usize, String, i64);

    impl Keyed for Item {
        fn order_id(&self) -> &str {
            &self.1
        }
        fn token_id(&self) -> i64 {
            self.2
        }
    }

    proptest! {
        /// A batch holds each order and each token once, no busy order, at
        /// most `max` events; with what stays queued (in its order) it is
        /// exactly the queue; it is as full as the queue allows, and the
        /// first event that may go goes.
        #[test]
        fn batches_are_distinct_bounded_and_fair(
            items in proptest::collection::vec((0u8..12, 0i64..30), 0..80),
            busy in proptest::collection::hash_set(0u8..12, 0..4),
            max in 1usize..70,
        ) {
            let busy: HashSet<String> = busy.iter().map(|o| format!("o-{o}")).collect();
            let input: Vec<Item> = items
                .iter()
                .enumerate()
                .map(|(i, &(o, t))| Item(i, format!("o-{o}"), t))
                .collect();
            let mut queue: VecDeque<Item> = input.iter().cloned().collect();
            let batch = assemble(&mut queue, max, &busy);

            prop_assert!(batch.len() <= max);
            let orders: HashSet<&str> = batch.iter().map(|i| i.1.as_str()).collect();
            let tokens: HashSet<i64> = batch.iter().map(|i| i.2).collect();
            prop_assert_eq!(orders.len(), batch.len(), "one event per order");
            prop_assert_eq!(tokens.len(), batch.len(), "one event per token");
            prop_assert!(batch.iter().all(|i| !busy.contains(&i.1)));
            prop_assert!(batch.windows(2).all(|w| w[0].0 < w[1].0), "arrival order");

            let mut all: Vec<Item> = batch.iter().chain(queue.iter()).cloned().collect();
            all.sort();
            prop_assert_eq!(&all, &input);
            prop_assert!(queue.iter().zip(queue.iter().skip(1)).all(|(a, b)| a.0 < b.0), "queue order kept");

            let blocked = |i: &Item| busy.contains(&i.1) || orders.contains(i.1.as_str()) || tokens.contains(&i.2);
            if batch.len() < max {
                prop_assert!(queue.iter().all(blocked), "as full as it may be");
            }
            if let Some(first) = input.iter().find(|i| !busy.contains(&i.1)) {
                prop_assert!(batch.iter().any(|i| i.0 == first.0), "the first that may go goes");
            }
            // Every event of the batch arrived before any event left behind
            // that could have gone in its place.
            if let Some(last) = batch.iter().map(|i| i.0).max() {
                prop_assert!(queue.iter().all(|i| i.0 > last || blocked(i)));
            }
        }
    }
}
