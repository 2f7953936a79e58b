//! Who owns what runs in the background: [`Tasks`], the service's named
//! background tasks, started together by [`crate::startup`] and stopped
//! together at shutdown (bounded, naming any that did not stop).

use std::future::Future;
use std::time::Duration;

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
