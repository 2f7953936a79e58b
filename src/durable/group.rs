//! The queue of group commit, shared by the consume batcher ([`super::batch`])
//! and the order-event batcher (`crate::orders::batch`): work runs at once
//! while a slot is free and none of its keys is in a running batch; what
//! arrives meanwhile waits in arrival order and forms the next batches,
//! decided by the [`Work`] with an answer per item.
//!
//! What it guarantees, whatever the work:
//! - **No wait when idle.** An item that finds no batch running and none of
//!   its keys busy runs at once on its caller's task ([`Turn::Now`]); the
//!   others wait for a batch that is already running, not for a timer.
//! - **Fill before fanning out.** While a batch runs, a further one starts
//!   (in a free slot) only with at least `fill` items; smaller ones wait for
//!   a running batch to end. Fewer, fuller batches cost Postgres less per
//!   item (one bind, plan and commit for more rows), and a slow batch (a
//!   row lock, a stall) still leaves the other slots to a queue that grows
//!   past `fill`. When no batch runs, whatever may go goes.
//! - **Keys serialise.** No two items with a key in common are in one
//!   batch, or in two batches that run at once: a later item of a key waits
//!   for the next batch after the running one, and sees its outcome.
//! - **Fair.** A batch takes the items that may go in arrival order; no
//!   item that may go is passed over for a later one.
//! - **Bounded.** At most `size` items in a batch and `slots` batches at
//!   once; an item that waited longer than `queue_bound` (on the service
//!   clock's monotonic reading) is answered [`Work::waited_too_long`]
//!   without being sent, and an item whose caller is gone is dropped unsent.
//! - **Owned.** A batch runs on a task of the service's [`OffPath`], which
//!   shutdown waits for (bounded), not on a detached one.
//! - **Released however it ends.** A running batch (or lone item) holds a
//!   [`Slot`]; dropping it (done, failed, or the caller gone) frees the slot
//!   and the keys and starts the batches they allow.
//! - **Answered or known unknown.** A batch's answers go back in order; an
//!   item whose batch ended without answering it (the runtime stopping)
//!   sees its receiver closed, which its caller answers as an outcome
//!   unknown (503).

use std::cmp::Ordering;
use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus::{Histogram, IntGauge};
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::tasks::OffPath;

/// What a [`GroupCommit`] queues and how a batch of it is decided.
pub trait Work: Send + Sync + Sized + 'static {
    /// What serialises items (a token id, an order id).
    type Key: Eq + Hash + Clone + Send + Sync + 'static;
    /// An item's keys, held by value (an array: no allocation).
    type Keys: AsRef<[Self::Key]> + Send + Sync + 'static;
    /// A queued item.
    type Item: Send + 'static;
    type Answer: Send + 'static;

    /// The keys of a queued item.
    fn keys(item: &Self::Item) -> Self::Keys;

    /// The answer of an item that waited longer than the queue's bound.
    fn waited_too_long() -> Self::Answer;

    /// The order of the items within a batch that [`Work::run`] gets
    /// (a stable sort; by default arrival order).
    fn batch_order(_a: &Self::Item, _b: &Self::Item) -> Ordering {
        Ordering::Equal
    }

    /// Decides a batch (no key twice) and gives an answer per item, in
    /// order. `slot` is the batch's hold on its slot and keys: dropping it
    /// (at the latest when the future ends) lets the next batches start.
    fn run(
        &self,
        items: Vec<Self::Item>,
        slot: Slot<Self>,
    ) -> impl Future<Output = Vec<Self::Answer>> + Send;
}

/// How large and how many batches, and how long an item may wait.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The most items of one batch (at least 1).
    pub size: usize,
    /// The most batches running at once (at least 1).
    pub slots: usize,
    /// The fewest items of a batch that starts while another runs (at
    /// least 1, at most `size`).
    pub fill: usize,
    /// How long an item may wait for its batch.
    pub queue_bound: Duration,
}

impl Limits {
    /// The limits of a Postgres batcher: batches of at most `size`, at most
    /// `in_flight` at once (never more than the pool's `pool_size`
    /// connections), each beside a running one a quarter full at least.
    pub fn for_pool(
        size: usize,
        in_flight: usize,
        pool_size: u32,
        queue_bound: Duration,
    ) -> Limits {
        let size = size.max(1);
        Limits {
            size,
            slots: in_flight.clamp(1, pool_size.max(1) as usize),
            fill: size.div_ceil(4),
            queue_bound,
        }
    }
}

/// A group-commit queue in front of a [`Work`] (see the module's docs).
pub struct GroupCommit<W: Work> {
    shared: Arc<Shared<W>>,
}

impl<W: Work> std::fmt::Debug for GroupCommit<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit")
            .field("limits", &self.shared.limits)
            .finish()
    }
}

/// What [`GroupCommit::enter`] decided for an item.
pub enum Turn<W: Work> {
    /// A slot was free and none of the item's keys busy: run it now, alone,
    /// while holding the slot.
    Now(Slot<W>),
    /// Queued: the answer comes from the batch it joins (`Err`: that batch
    /// ended without answering, its outcome unknown).
    Queued(oneshot::Receiver<W::Answer>),
}

/// A running batch's (or lone item's) slot and keys: given back when
/// dropped, which starts the next batches.
pub struct Slot<W: Work> {
    shared: Arc<Shared<W>>,
    keys: Vec<W::Keys>,
}

struct Shared<W: Work> {
    work: W,
    limits: Limits,
    /// Items waiting.
    queued: IntGauge,
    /// Items per batch (1 for an item run at once).
    sizes: Histogram,
    /// Whose monotonic reading times the queue bound.
    clock: Arc<dyn Clock>,
    /// Where the batches run.
    owner: OffPath,
    state: Mutex<State<W>>,
}

struct State<W: Work> {
    running: usize,
    /// Keys in a running batch.
    busy: HashSet<W::Key>,
    /// In arrival order. Either `running == slots`, or fewer than `fill`
    /// of the items here could go together (every one of them, when no
    /// batch runs, waits for a busy key): [`Shared::dispatch`] keeps it so.
    queue: VecDeque<Waiting<W>>,
}

struct Waiting<W: Work> {
    item: W::Item,
    /// When it was queued (the clock's monotonic reading).
    since: Instant,
    reply: oneshot::Sender<W::Answer>,
}

impl<W: Work> GroupCommit<W> {
    /// `clock` times the queue bound; `owner` runs the batches (shutdown
    /// waits for it).
    pub fn new(
        work: W,
        limits: Limits,
        queued: IntGauge,
        sizes: Histogram,
        clock: Arc<dyn Clock>,
        owner: OffPath,
    ) -> GroupCommit<W> {
        let size = limits.size.max(1);
        let limits = Limits {
            size,
            slots: limits.slots.max(1),
            fill: limits.fill.clamp(1, size),
            ..limits
        };
        GroupCommit {
            shared: Arc::new(Shared {
                work,
                limits,
                queued,
                sizes,
                clock,
                owner,
                state: Mutex::new(State {
                    running: 0,
                    busy: HashSet::new(),
                    queue: VecDeque::new(),
                }),
            }),
        }
    }

    pub fn work(&self) -> &W {
        &self.shared.work
    }

    /// Runs an item now or queues it: `keys` are its keys, `item` makes
    /// what is queued (only when it is).
    pub fn enter(&self, keys: W::Keys, item: impl FnOnce() -> W::Item) -> Turn<W> {
        let shared = &self.shared;
        let mut s = shared.lock();
        let alone = s.running == 0 || (shared.limits.fill == 1 && s.running < shared.limits.slots);
        if alone && !keys.as_ref().iter().any(|k| s.busy.contains(k)) {
            s.running += 1;
            s.busy.extend(keys.as_ref().iter().cloned());
            drop(s);
            shared.sizes.observe(1.0);
            return Turn::Now(Slot {
                shared: shared.clone(),
                keys: vec![keys],
            });
        }
        let (reply, answer) = oneshot::channel();
        s.queue.push_back(Waiting {
            item: item(),
            since: shared.clock.monotonic(),
            reply,
        });
        if s.running < shared.limits.slots && s.queue.len() >= shared.limits.fill {
            // Perhaps a full enough batch now: start it.
            shared.dispatch(&mut s);
        } else {
            shared.queued.set(s.queue.len() as i64);
        }
        Turn::Queued(answer)
    }
}

impl<W: Work> Shared<W> {
    fn lock(&self) -> MutexGuard<'_, State<W>> {
        // The state is consistent after every statement under the lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the batches the free slots and keys allow.
    fn dispatch(self: &Arc<Self>, s: &mut State<W>) {
        while s.running < self.limits.slots {
            // A batch beside a running one only when full enough.
            let least = if s.running == 0 { 1 } else { self.limits.fill };
            if s.queue.len() < least {
                break;
            }
            let mut batch = assemble(&mut s.queue, self.limits.size, least, &s.busy, |w| {
                W::keys(&w.item)
            });
            if batch.is_empty() {
                break;
            }
            if tokio::runtime::Handle::try_current().is_err() {
                // No runtime to run it on (the service is stopping): the
                // items are dropped, and their callers answer 503.
                continue;
            }
            batch.sort_by(|a, b| W::batch_order(&a.item, &b.item));
            let keys: Vec<W::Keys> = batch.iter().map(|w| W::keys(&w.item)).collect();
            s.running += 1;
            for k in &keys {
                s.busy.extend(k.as_ref().iter().cloned());
            }
            let slot = Slot {
                shared: self.clone(),
                keys,
            };
            self.owner.spawn(Shared::run(self.clone(), batch, slot));
        }
        self.queued.set(s.queue.len() as i64);
    }

    /// Decides one batch and answers its items.
    async fn run(self: Arc<Self>, batch: Vec<Waiting<W>>, slot: Slot<W>) {
        let mut items = Vec::with_capacity(batch.len());
        let mut replies = Vec::with_capacity(batch.len());
        for w in batch {
            if w.reply.is_closed() {
                continue;
            }
            let waited = self.clock.monotonic().saturating_duration_since(w.since);
            if waited > self.limits.queue_bound {
                let _ = w.reply.send(W::waited_too_long());
                continue;
            }
            items.push(w.item);
            replies.push(w.reply);
        }
        if items.is_empty() {
            return;
        }
        self.sizes.observe(items.len() as f64);
        let answers = self.work.run(items, slot).await;
        for (reply, answer) in replies.into_iter().zip(answers) {
            let _ = reply.send(answer);
        }
    }
}

impl<W: Work> Drop for Slot<W> {
    fn drop(&mut self) {
        let shared = &self.shared;
        let mut s = shared.lock();
        s.running -= 1;
        for keys in &self.keys {
            for k in keys.as_ref() {
                s.busy.remove(k);
            }
        }
        shared.dispatch(&mut s);
    }
}

/// Takes the next batch from `queue`: in arrival order, at most `max`
/// items, none with a key that is `busy` or already in the batch (`keys`
/// gives an item's keys; one named twice counts once); none at all, and the
/// queue untouched, when fewer than `least` could go. The items left keep
/// their order.
pub fn assemble<T, K, Ks>(
    queue: &mut VecDeque<T>,
    max: usize,
    least: usize,
    busy: &HashSet<K>,
    keys: impl Fn(&T) -> Ks,
) -> Vec<T>
where
    K: Eq + Hash + Clone,
    Ks: AsRef<[K]>,
{
    let mut chosen: Vec<bool> = Vec::with_capacity(queue.len());
    let mut taken: HashSet<K> = HashSet::new();
    let mut count = 0;
    for item in queue.iter() {
        let go = count < max && {
            let ks = keys(item);
            let ks = ks.as_ref();
            let free = ks.iter().all(|k| !busy.contains(k) && !taken.contains(k));
            if free {
                taken.extend(ks.iter().cloned());
            }
            free
        };
        count += usize::from(go);
        chosen.push(go);
    }
    if count == 0 || count < least {
        return Vec::new();
    }
    let mut batch = Vec::with_capacity(count);
    let mut rest = VecDeque::with_capacity(queue.len() - count);
    for (item, go) in queue.drain(..).zip(chosen) {
        if go {
            batch.push(item);
        } else {
            rest.push_back(item);
        }
    }
    *queue = rest;
    batch
}

#[cfg(test)]
mod tests {
    use super::{assemble, GroupCommit, Limits, Slot, Turn, Work};
    use crate::clock::{Clock, ManualClock, SystemClock};
    use crate::tasks::OffPath;
    use proptest::prelude::*;
    use std::collections::{HashSet, VecDeque};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// Batches that record their size and wait until the test opens them.
    struct Held {
        sizes: Arc<Mutex<Vec<usize>>>,
        open: tokio::sync::watch::Receiver<bool>,
    }

    impl Work for Held {
        type Key = u32;
        type Keys = [u32; 1];
        type Item = u32;
        type Answer = u32;

        fn keys(item: &u32) -> [u32; 1] {
            [*item]
        }

        fn waited_too_long() -> u32 {
            u32::MAX
        }

        async fn run(&self, items: Vec<u32>, _slot: Slot<Self>) -> Vec<u32> {
            self.sizes.lock().expect("sizes").push(items.len());
            let mut open = self.open.clone();
            let _ = open.wait_for(|o| *o).await;
            items
        }
    }

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    /// Waits (at most 5 s) until the batches started are `want`.
    async fn started(sizes: &Mutex<Vec<usize>>, want: &[usize]) {
        for _ in 0..500 {
            if sizes.lock().expect("sizes").as_slice() == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(sizes.lock().expect("sizes").as_slice(), want);
    }

    /// A queue of [`Held`] batches (each held until `open` says `true`),
    /// recording the sizes of the batches it starts.
    #[allow(clippy::type_complexity)]
    fn held_queue(
        limits: Limits,
        clock: Arc<dyn Clock>,
        owner: OffPath,
    ) -> (
        GroupCommit<Held>,
        Arc<Mutex<Vec<usize>>>,
        tokio::sync::watch::Sender<bool>,
    ) {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let (open, rx) = tokio::sync::watch::channel(false);
        let q = GroupCommit::new(
            Held {
                sizes: sizes.clone(),
                open: rx,
            },
            limits,
            prometheus::IntGauge::new("q", "q").expect("gauge"),
            prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("s", "s"))
                .expect("histogram"),
            clock,
            owner,
        );
        (q, sizes, open)
    }

    /// While a batch runs, a further one starts only with `fill` items;
    /// once none runs, whatever may go goes.
    #[tokio::test]
    async fn a_batch_beside_a_running_one_starts_only_when_full_enough() {
        let (q, sizes, open) = held_queue(
            Limits {
                size: 8,
                slots: 2,
                fill: 4,
                queue_bound: Duration::from_secs(60),
            },
            Arc::new(SystemClock),
            OffPath::new(),
        );
        let Turn::Now(alone) = q.enter([0], || 0) else {
            panic!("an idle queue runs the first item at once");
        };
        let mut waiting = Vec::new();
        for k in 1..4 {
            match q.enter([k], || k) {
                Turn::Queued(rx) => waiting.push(rx),
                Turn::Now(_) => panic!("{k} ran beside a running item"),
            }
        }
        settle().await;
        assert!(
            sizes.lock().expect("sizes").is_empty(),
            "three of four: no batch yet"
        );
        let Turn::Queued(fourth) = q.enter([4], || 4) else {
            panic!("4 ran alone");
        };
        waiting.push(fourth);
        // The fourth filled a batch.
        started(&sizes, &[4]).await;
        // Both slots busy (the lone item and the batch): 5 waits, and still
        // waits when the lone item is done (one of one is not full).
        let Turn::Queued(fifth) = q.enter([5], || 5) else {
            panic!("5 ran with both slots busy");
        };
        drop(alone);
        settle().await;
        assert_eq!(*sizes.lock().expect("sizes"), vec![4]);
        // The batch ends: no batch runs, so 5 goes alone.
        open.send_replace(true);
        for (rx, want) in waiting.into_iter().zip(1..) {
            assert_eq!(rx.await.expect("answered"), want);
        }
        assert_eq!(fifth.await.expect("answered"), 5);
        started(&sizes, &[4, 1]).await;
    }

    /// An item that waited past the queue bound (on the clock) is answered
    /// without being sent; the batch runs on the owner shutdown waits for.
    #[tokio::test]
    async fn an_item_past_the_queue_bound_is_not_sent_and_batches_are_owned() {
        let clock = ManualClock::new(0);
        let owner = OffPath::new();
        let (q, sizes, open) = held_queue(
            Limits {
                size: 8,
                slots: 1,
                fill: 1,
                queue_bound: Duration::from_secs(1),
            },
            Arc::new(clock.clone()),
            owner.clone(),
        );
        let Turn::Now(alone) = q.enter([0], || 0) else {
            panic!("an idle queue runs the first item at once");
        };
        let Turn::Queued(late) = q.enter([1], || 1) else {
            panic!("1 ran with the only slot busy");
        };
        // Wall time alone moves nothing.
        clock.advance_ms(60_000);
        clock.advance_monotonic(Duration::from_millis(1001));
        let Turn::Queued(fresh) = q.enter([2], || 2) else {
            panic!("2 ran with the only slot busy");
        };
        assert_eq!(owner.len(), 0, "no batch yet");
        drop(alone);
        assert_eq!(late.await.expect("answered"), u32::MAX, "waited too long");
        started(&sizes, &[1]).await;
        assert_eq!(owner.len(), 1, "the batch runs on the owner");
        open.send_replace(true);
        assert_eq!(fresh.await.expect("answered"), 2);
        owner.drain(Duration::from_secs(5)).await;
        assert!(owner.is_empty());
    }

    proptest! {
        /// A batch holds no key twice and no busy key, at most `max` items,
        /// in arrival order; with what stays queued (in its order) it is
        /// exactly the queue; it is as full as the queue allows, the first
        /// item that may go goes, and no item that could have gone is left
        /// behind for a later one. Below `least` items there is no batch and
        /// the queue is as it was.
        #[test]
        fn batches_are_distinct_bounded_and_fair(
            items in proptest::collection::vec(proptest::collection::vec(0u8..16, 1..3), 0..80),
            busy in proptest::collection::hash_set(0u8..16, 0..5),
            max in 1usize..70,
            least in 1usize..12,
        ) {
            // Items are (arrival index, keys).
            let input: Vec<(usize, Vec<u8>)> = items.iter().cloned().enumerate().collect();
            let mut queue: VecDeque<(usize, Vec<u8>)> = input.iter().cloned().collect();
            let least = least.min(max);
            let mut whole = queue.clone();
            let batch = assemble(&mut queue, max, least, &busy, |(_, ks)| ks.clone());
            // What a batch of at least one would have been.
            let unbounded = assemble(&mut whole, max, 1, &busy, |(_, ks)| ks.clone());
            if unbounded.len() < least {
                prop_assert!(batch.is_empty(), "no batch below least");
                prop_assert_eq!(queue.iter().cloned().collect::<Vec<_>>(), input.clone(), "queue untouched");
                return Ok(());
            }
            prop_assert_eq!(&batch, &unbounded, "least does not change a batch it lets go");

            prop_assert!(batch.len() <= max);
            // Each item's keys once, however often it names them.
            let taken: Vec<u8> = batch
                .iter()
                .flat_map(|(_, ks)| ks.iter().copied().collect::<HashSet<u8>>())
                .collect();
            let distinct: HashSet<u8> = taken.iter().copied().collect();
            prop_assert_eq!(distinct.len(), taken.len(), "no key in two items");
            prop_assert!(taken.iter().all(|k| !busy.contains(k)), "no busy key");
            prop_assert!(batch.windows(2).all(|w| w[0].0 < w[1].0), "arrival order");

            let mut all: Vec<(usize, Vec<u8>)> = batch.iter().chain(queue.iter()).cloned().collect();
            all.sort();
            prop_assert_eq!(&all, &input);
            prop_assert!(queue.iter().zip(queue.iter().skip(1)).all(|(a, b)| a.0 < b.0), "queue order kept");

            let could_go = |ks: &[u8]| ks.iter().all(|k| !busy.contains(k));
            let blocked = |ks: &[u8]| !could_go(ks) || ks.iter().any(|k| distinct.contains(k));
            if batch.len() < max {
                prop_assert!(queue.iter().all(|(_, ks)| blocked(ks)), "as full as it may be");
            }
            if let Some(first) = input.iter().find(|(_, ks)| could_go(ks)) {
                prop_assert!(batch.iter().any(|(i, _)| *i == first.0), "the first that may go goes");
            }
            if let Some(last) = batch.iter().map(|(i, _)| *i).max() {
                prop_assert!(queue.iter().all(|(i, ks)| *i > last || blocked(ks)), "none passed over");
            }
        }
    }
}
