//! Token and key changes that waiting consumes (`wait_ms`) wait for: a
//! result recorded, a release. Waiters register per token id in this
//! process and hold no connection; a change wakes them at once, whether it
//! happened on this instance or on another (each instance `NOTIFY`s the
//! fleet on Postgres's `ledger_changes` channel and `LISTEN`s to it on one
//! connection of its own). Waiting costs memory, not CPU: nothing polls.
//!
//! What holds, and why:
//! - **No lost wake-up.** A waiter registers (and arms its wake-up) before it
//!   looks at the token; a change after that look wakes it.
//! - **A missed notification costs only time.** When the listening
//!   connection is lost, every waiter is woken once it is back (each looks
//!   again); a waiter never waits past its own `wait_ms`.
//! - **Changes that arrive together are told together.** One statement
//!   sends the notifications of every change made while the previous one
//!   was on its way (at most [`MAX_PER_STATEMENT`] each; none waits when
//!   nothing is being sent), one notification per id as before, so that a
//!   burst of results costs a few transactions, not one each.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::tasks::OffPath;

/// The Postgres channel every instance listens on.
pub const CHANNEL: &str = "ledger_changes";

/// The most notifications one statement sends.
pub const MAX_PER_STATEMENT: usize = 1000;

/// The most changes waiting to be told; beyond, a change is told to this
/// process's waiters only (the fleet's wait out their `wait_ms`).
const MAX_WAITING: usize = 100_000;

/// The waiters of this process, by token (or key) id.
#[derive(Debug)]
pub struct Changes {
    waiters: Mutex<HashMap<i64, (Arc<Notify>, usize)>>,
    outbox: Mutex<Outbox>,
    pool: PgPool,
    /// Where the notifications to the fleet are sent from.
    off_path: OffPath,
}

/// Changes not yet told to the fleet, and whether a sender is running (at
/// most one: it sends until the outbox is empty).
#[derive(Debug, Default)]
struct Outbox {
    ids: Vec<i64>,
    sending: bool,
}

/// One registration; deregisters when dropped.
#[derive(Debug)]
pub struct Watch<'a> {
    changes: &'a Changes,
    id: i64,
    notify: Arc<Notify>,
}

impl Watch<'_> {
    /// The wake-up for the next change of this id; armed at once (see
    /// [`tokio::sync::futures::Notified::enable`]) by the caller pinning it.
    pub fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let mut waiters = self.changes.lock();
        if let Some((_, n)) = waiters.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                waiters.remove(&self.id);
            }
        }
    }
}

impl Changes {
    /// `off_path`: where the notifications to the fleet run (see [`Changes::changed`]).
    pub fn new(pool: PgPool, off_path: OffPath) -> Changes {
        Changes {
            waiters: Mutex::new(HashMap::new()),
            outbox: Mutex::new(Outbox::default()),
            pool,
            off_path,
        }
    }

    fn outbox(&self) -> std::sync::MutexGuard<'_, Outbox> {
        self.outbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, (Arc<Notify>, usize)>> {
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a waiter for `id`.
    pub fn watch(&self, id: i64) -> Watch<'_> {
        let mut waiters = self.lock();
        let entry = waiters
            .entry(id)
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        entry.1 += 1;
        Watch {
            changes: self,
            id,
            notify: entry.0.clone(),
        }
    }

    /// How many waiters this process holds (tests, logs).
    pub fn waiting(&self) -> usize {
        self.lock().values().map(|(_, n)| n).sum()
    }

    /// Wakes this process's waiters of `id`.
    fn wake(&self, id: i64) {
        let notify = self.lock().get(&id).map(|(n, _)| n.clone());
        if let Some(n) = notify {
            n.notify_waiters();
        }
    }

    fn wake_all(&self) {
        let all: Vec<Arc<Notify>> = self.lock().values().map(|(n, _)| n.clone()).collect();
        for n in all {
            n.notify_waiters();
        }
    }

    /// `id` changed here: wakes this process's waiters now, and tells the
    /// fleet off the answer's path: at once when nothing is being sent, else
    /// with the other changes of the next statement (if it fails, the other
    /// instances' waiters only wait longer).
    pub fn changed(self: &Arc<Self>, id: i64) {
        self.wake(id);
        {
            let mut outbox = self.outbox();
            if outbox.ids.len() >= MAX_WAITING {
                tracing::debug!("too many changes waiting; not told to the fleet");
                return;
            }
            outbox.ids.push(id);
            if outbox.sending {
                return;
            }
            outbox.sending = true;
        }
        let this = self.clone();
        self.off_path.spawn(async move { this.send_all().await });
    }

    /// Sends the outbox until it is empty, then lets the next change start
    /// a sender again.
    async fn send_all(&self) {
        loop {
            let mut ids = {
                let mut outbox = self.outbox();
                if outbox.ids.is_empty() {
                    outbox.sending = false;
                    return;
                }
                std::mem::take(&mut outbox.ids)
            };
            ids.sort_unstable();
            ids.dedup();
            for chunk in ids.chunks(MAX_PER_STATEMENT) {
                let sent =
                    sqlx::query("SELECT pg_notify($1, id::text) FROM unnest($2::bigint[]) AS id")
                        .bind(CHANNEL)
                        .bind(chunk)
                        .execute(&self.pool)
                        .await;
                if let Err(e) = sent {
                    tracing::debug!(error = %e, changes = chunk.len(), "changes not sent to the fleet");
                }
            }
        }
    }

    /// Listens for the fleet's changes until `shutdown`, reconnecting after
    /// a lost connection (and then waking every waiter to look again).
    pub async fn listen(self: Arc<Self>, shutdown: CancellationToken) {
        let mut first = true;
        while !shutdown.is_cancelled() {
            let mut listener = match PgListener::connect_with(&self.pool).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::debug!(error = %e, "changes: cannot listen yet");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        _ = shutdown.cancelled() => return,
                    }
                }
            };
            if let Err(e) = listener.listen(CHANNEL).await {
                tracing::debug!(error = %e, "changes: LISTEN failed");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = shutdown.cancelled() => return,
                }
            }
            if !first {
                self.wake_all();
            }
            first = false;
            loop {
                tokio::select! {
                    n = listener.try_recv() => match n {
                        Ok(Some(n)) => {
                            if let Ok(id) = n.payload().parse::<i64>() {
                                self.wake(id);
                            }
                        }
                        // The connection was lost: every waiter looks again
                        // once listening is back.
                        Ok(None) => self.wake_all(),
                        Err(e) => {
                            tracing::debug!(error = %e, "changes: listening connection lost");
                            self.wake_all();
                            break;
                        }
                    },
                    _ = shutdown.cancelled() => return,
                }
            }
        }
    }
}

/// `ledger_consumes_waiting`: how many consumes wait for a winner on this
/// instance (`wait_ms`), read from the registry when scraped.
pub struct WaitingGauge {
    changes: Arc<Changes>,
    gauge: prometheus::IntGauge,
}

impl WaitingGauge {
    pub fn new(changes: Arc<Changes>) -> WaitingGauge {
        // A static, valid definition.
        let gauge = prometheus::IntGauge::new(
            "ledger_consumes_waiting",
            "Consumes waiting for the winner's result or release on this instance (wait_ms); each holds memory, no connection.",
        )
        .expect("valid metric");
        WaitingGauge { changes, gauge }
    }
}

impl prometheus::core::Collector for WaitingGauge {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.gauge
            .set(i64::try_from(self.changes.waiting()).unwrap_or(i64::MAX));
        self.gauge.collect()
    }
}
