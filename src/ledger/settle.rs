//! Step 4's write-backs of consumed states, together: [`WriteBacks`] sends
//! the first one at once and collects those that arrive while it is on its
//! way into the next pipeline, so the answers of one batch (which reach
//! their requests together) reach Redis in a round trip or two instead of
//! one each. A consume's write-back is off the answer's path
//! ([`WriteBacks::push`]); a recorded result's is awaited before the answer
//! ([`WriteBacks::send`]), and rides the same pipelines.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::resync::{Resync, ResyncQueue};
use crate::fast::{ConsumedWrite, FastError, FastTier};
use crate::tasks::OffPath;

/// The most write-backs of one pipeline (more wait for the next).
const MAX_PIPELINE: usize = 256;

/// Consumed states waiting to be written back to Redis, one pipeline on
/// its way at a time (group commit, as the consume batcher does). A pushed
/// write-back Redis did not take goes to the resync queue, as a single
/// write-back's does; one whose pipeline got no reply may have been written
/// or not, and is queued too (replays are versioned: sending it again writes
/// nothing). A sent one's outcome goes to its caller instead, which decides
/// what a failure means for its answer.
pub(super) struct WriteBacks {
    fast: Arc<FastTier>,
    resync: Arc<ResyncQueue>,
    state: Mutex<Pending>,
    /// The sender runs here, so that shutdown waits for it.
    off_path: OffPath,
}

/// Who learns a write-back's outcome.
enum Outcome {
    /// Nobody waits: a failure is queued for resync.
    Queued,
    /// A caller awaits it ([`WriteBacks::send`]).
    Told(oneshot::Sender<Result<bool, FastError>>),
}

#[derive(Default)]
struct Pending {
    items: Vec<(ConsumedWrite, Outcome)>,
    /// A task is sending (it takes what waits before it ends).
    sending: bool,
}

impl WriteBacks {
    pub(super) fn new(
        fast: Arc<FastTier>,
        resync: Arc<ResyncQueue>,
        off_path: OffPath,
    ) -> WriteBacks {
        WriteBacks {
            fast,
            resync,
            state: Mutex::default(),
            off_path,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Consistent after every statement under the lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues one write-back; starts the sender if none runs.
    pub(super) fn push(self: &Arc<Self>, write: ConsumedWrite) {
        self.add(write, Outcome::Queued);
    }

    /// Writes one consumed state and waits for its outcome, as
    /// [`FastTier::write_consumed`] does (`Ok(true)`: written), but in the
    /// pipeline of the write-backs that arrive with it. Nothing is queued
    /// for resync on a failure: the caller decides. A sender stopped before
    /// it answered (the runtime stopping) answers [`FastError::Timeout`]:
    /// the write may or may not have reached Redis.
    pub(super) async fn send(self: &Arc<Self>, write: ConsumedWrite) -> Result<bool, FastError> {
        let (tell, told) = oneshot::channel();
        self.add(write, Outcome::Told(tell));
        told.await.unwrap_or(Err(FastError::Timeout))
    }

    fn add(self: &Arc<Self>, write: ConsumedWrite, outcome: Outcome) {
        let start = {
            let mut s = self.lock();
            s.items.push((write, outcome));
            !std::mem::replace(&mut s.sending, true)
        };
        if start {
            let me = self.clone();
            self.off_path.spawn(async move { me.send_all().await });
        }
    }

    /// Sends what waits, pipeline after pipeline, until nothing does.
    async fn send_all(&self) {
        // Ends the sending if this task is dropped mid-pipeline (the
        // runtime stopping), so that a later push starts a sender again.
        struct Dropped<'a>(&'a WriteBacks, bool);
        impl Drop for Dropped<'_> {
            fn drop(&mut self) {
                if self.1 {
                    self.0.lock().sending = false;
                }
            }
        }
        let mut dropped = Dropped(self, true);
        loop {
            let batch = {
                let mut s = self.lock();
                if s.items.is_empty() {
                    s.sending = false;
                    dropped.1 = false;
                    return;
                }
                let n = s.items.len().min(MAX_PIPELINE);
                s.items.drain(..n).unzip::<_, _, Vec<_>, Vec<_>>()
            };
            let (writes, outcomes) = batch;
            match self.fast.write_consumed_many(&writes).await {
                Ok(results) => {
                    for ((w, outcome), r) in writes.into_iter().zip(outcomes).zip(results) {
                        self.settle(w, outcome, r);
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, items = writes.len(), "consumed markers not written to redis; queued or told");
                    // No reply: each may or may not have been written.
                    for (w, outcome) in writes.into_iter().zip(outcomes) {
                        match outcome {
                            Outcome::Queued => self.queue(w),
                            Outcome::Told(tell) => {
                                let _ = tell.send(Err(FastError::Timeout));
                            }
                        }
                    }
                }
            }
        }
    }

    /// One write-back's outcome to whom it belongs.
    fn settle(&self, w: ConsumedWrite, outcome: Outcome, r: Result<bool, FastError>) {
        match (outcome, r) {
            (Outcome::Told(tell), r) => {
                // A caller that stopped waiting left nothing to tell.
                let _ = tell.send(r);
            }
            (Outcome::Queued, Ok(_)) => {}
            (Outcome::Queued, Err(e)) => {
                tracing::debug!(error = %e, "consumed marker not written to redis; queued");
                self.queue(w);
            }
        }
    }

    fn queue(&self, w: ConsumedWrite) {
        self.resync.push(Resync::Consumed {
            token: w.token,
            gen: w.gen,
            marker: w.marker,
        });
    }
}
