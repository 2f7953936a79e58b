//! Step 4's write-backs of consumed states, off the answer's path and
//! together: [`WriteBacks`] sends the first one at once and collects those
//! that arrive while it is on its way into the next pipeline, so the
//! answers of one consume batch (which reach their requests together) reach
//! Redis in a round trip or two instead of one each.

use std::sync::{Arc, Mutex, MutexGuard};

use super::resync::{Resync, ResyncQueue};
use crate::fast::{ConsumedWrite, FastTier};
use crate::tasks::OffPath;

/// The most write-backs of one pipeline (more wait for the next).
const MAX_PIPELINE: usize = 256;

/// Consumed states waiting to be written back to Redis, one pipeline on
/// its way at a time (group commit, as the consume batcher does). A
/// write-back Redis did not take goes to the resync queue, as a single
/// write-back's does; one whose pipeline got no reply may have been written
/// or not, and is queued too (replays are versioned: sending it again writes
/// nothing).
pub(super) struct WriteBacks {
    fast: Arc<FastTier>,
    resync: Arc<ResyncQueue>,
    state: Mutex<Pending>,
    /// The sender runs here, so that shutdown waits for it.
    off_path: OffPath,
}

#[derive(Default)]
struct Pending {
    items: Vec<ConsumedWrite>,
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
        let start = {
            let mut s = self.lock();
            s.items.push(write);
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
                s.items.drain(..n).collect::<Vec<_>>()
            };
            match self.fast.write_consumed_many(&batch).await {
                Ok(results) => {
                    for (w, r) in batch.into_iter().zip(results) {
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "consumed marker not written to redis; queued");
                            self.queue(w);
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, items = batch.len(), "consumed markers not written to redis; queued");
                    for w in batch {
                        self.queue(w);
                    }
                }
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
