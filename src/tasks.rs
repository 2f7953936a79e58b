//! Who owns what runs in the background: [`Tasks`], the service's named
//! background tasks, started together by [`crate::startup`] and stopped
//! together at shutdown (bounded, naming any that did not stop), and
//! [`OffPath`], the work requests start on tasks of their own (the writes
//! off an answer's path, the group-commit batches), which shutdown waits
//! for (bounded) instead of dropping it.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// The background tasks, each with a name (its logs carry it, in the span
/// `task`). Every task gets the same token, which says stop; dropping the
/// set (a start that failed half-way) cancels it too.
pub struct Tasks {
    shutdown: CancellationToken,
    running: Vec<(&'static str, JoinHandle<()>)>,
}

impl Default for Tasks {
    fn default() -> Self {
        Tasks::new()
    }
}

impl Tasks {
    pub fn new() -> Tasks {
        Tasks {
            shutdown: CancellationToken::new(),
            running: Vec::new(),
        }
    }

    /// Starts `task` under `name`, handing it the token that says stop.
    pub fn spawn<F>(&mut self, name: &'static str, task: impl FnOnce(CancellationToken) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let run = task(self.shutdown.clone()).instrument(tracing::info_span!("task", name));
        self.running.push((name, tokio::spawn(run)));
    }

    /// The names of the tasks started, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.running.iter().map(|(name, _)| *name).collect()
    }

    /// Tells every task to stop and waits for them all, `bound` in all; a
    /// task still running then is named in the log and aborted.
    pub async fn stop(mut self, bound: Duration) {
        self.shutdown.cancel();
        let deadline = tokio::time::Instant::now() + bound;
        for (name, mut handle) in std::mem::take(&mut self.running) {
            match tokio::time::timeout_at(deadline, &mut handle).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) if e.is_panic() => {
                    tracing::error!(task = name, error = %e, "background task panicked");
                }
                Ok(Err(_)) => {}
                Err(_) => {
                    tracing::warn!(
                        task = name,
                        ?bound,
                        "background task did not stop in time; aborted"
                    );
                    handle.abort();
                }
            }
        }
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The owner of the work requests start on tasks of their own: the writes a
/// request does not wait for (Redis write-backs, a marker given back, a
/// fleet notification) and the group-commit batches requests wait on
/// ([`crate::durable::group`]). It counts them, and shutdown waits, bounded,
/// until none runs. Spawning one costs what `tokio::spawn` does (the count
/// lives in the task, no allocation).
#[derive(Debug, Clone, Default)]
pub struct OffPath(Arc<Running>);

#[derive(Debug, Default)]
struct Running {
    count: AtomicUsize,
    /// Told when `count` comes back to zero.
    idle: Notify,
}

/// One write's place in the count, given back when its task ends (or is
/// dropped by a stopping runtime).
struct Counted(Arc<Running>);

impl Drop for Counted {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl OffPath {
    pub fn new() -> OffPath {
        OffPath::default()
    }

    /// Runs `work` on a task of its own, counted.
    pub fn spawn<F>(&self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.0.count.fetch_add(1, Ordering::AcqRel);
        let counted = Counted(self.0.clone());
        tokio::spawn(async move {
            let _counted = counted;
            work.await
        });
    }

    /// Waits, `bound` at most, until none runs (also those a late request
    /// starts meanwhile); logs how many were left running.
    pub async fn drain(&self, bound: Duration) {
        let idle = async {
            loop {
                let notified = self.0.idle.notified();
                tokio::pin!(notified);
                // Registered before the look: a count reaching zero after
                // it still wakes this wait.
                notified.as_mut().enable();
                if self.is_empty() {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(bound, idle).await.is_err() {
            tracing::warn!(
                left = self.len(),
                ?bound,
                "off-path writes did not finish in time; left to the runtime"
            );
        }
    }

    /// How many are running (tests, logs).
    pub fn len(&self) -> usize {
        self.0.count.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[tokio::test]
    async fn shutdown_waits_for_the_writes_requests_left_running() {
        let off_path = OffPath::new();
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        off_path.spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            d.store(true, Ordering::Release);
        });
        assert_eq!(off_path.len(), 1);
        off_path.drain(Duration::from_secs(5)).await;
        assert!(done.load(Ordering::Acquire));
        assert!(off_path.is_empty());
    }

    #[tokio::test]
    async fn a_write_that_hangs_holds_shutdown_only_until_the_bound() {
        let off_path = OffPath::new();
        off_path.spawn(std::future::pending());
        let started = std::time::Instant::now();
        off_path.drain(Duration::from_millis(100)).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(off_path.len(), 1);
    }

    #[tokio::test]
    async fn tasks_stop_together_and_a_straggler_is_aborted() {
        let mut tasks = Tasks::new();
        let stopped = Arc::new(AtomicBool::new(false));
        let s = stopped.clone();
        tasks.spawn("obedient", |stop| async move {
            stop.cancelled().await;
            s.store(true, Ordering::Release);
        });
        tasks.spawn("deaf", |_stop| std::future::pending());
        assert_eq!(tasks.names(), ["obedient", "deaf"]);
        let started = std::time::Instant::now();
        tasks.stop(Duration::from_millis(100)).await;
        assert!(stopped.load(Ordering::Acquire));
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
