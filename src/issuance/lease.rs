//! The snowflake worker id this instance holds: taken from Postgres at start,
//! renewed in the background. When it cannot be renewed in time, issuing
//! stops (503) rather than risk another instance making the same ids; when it
//! turns out to be lost, a fresh worker id is leased and issuing resumes.
//! Each holding is a lease of its own ([`LeaseIds`]: its ids and the ones
//! whose records are still owed), with its issuance mark in Postgres (see
//! [`crate::issuance::marks`]).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::clock::Clock;
use crate::durable::{lease, DurableError};
use crate::issuance::marks::LeaseIds;
use crate::token::SnowflakeId;

#[derive(Debug)]
pub struct WorkerLease {
    holder: Uuid,
    /// Replaced when the lease is lost and a new worker id is taken.
    ids: RwLock<Arc<LeaseIds>>,
    /// Replaced leases whose records may still be owed; the writer ends
    /// their marks once they are drained.
    retired: Mutex<Vec<Arc<LeaseIds>>>,
    ttl: Duration,
    /// How long a lease's mark row is kept without updates (twice the
    /// filter's horizon): pruned by the next acquire.
    marks_kept: Duration,
    /// Local (clock) ms until which the lease is surely ours.
    valid_until_ms: AtomicI64,
    clock: Arc<dyn Clock>,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("all 1024 worker ids are leased")]
    Exhausted,
    #[error(transparent)]
    Durable(#[from] DurableError),
}

impl WorkerLease {
    /// Takes a worker id. The lease is trusted for 80 % of its lifetime after
    /// the request started, so that a slow round trip cannot stretch it.
    pub async fn acquire(
        pool: &PgPool,
        ttl: Duration,
        marks_kept: Duration,
        clock: Arc<dyn Clock>,
    ) -> Result<Arc<WorkerLease>, LeaseError> {
        let holder = Uuid::new_v4();
        let started = clock.now_ms();
        let taken = lease::acquire(pool, holder, ttl, started, marks_kept)
            .await?
            .ok_or(LeaseError::Exhausted)?;
        let floor = taken.floor_ms.max(0);
        tracing::info!(worker_id = taken.worker_id, "leased snowflake worker id");
        Ok(Arc::new(WorkerLease {
            holder,
            ids: RwLock::new(Arc::new(LeaseIds::new(taken.worker_id, floor, holder))),
            retired: Mutex::new(Vec::new()),
            ttl,
            marks_kept,
            valid_until_ms: AtomicI64::new(started + trusted_ms(ttl)),
            clock,
        }))
    }

    fn ids(&self) -> Arc<LeaseIds> {
        self.ids.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn worker_id(&self) -> u16 {
        self.ids().worker()
    }

    /// Who holds the leases (the same for every lease of this instance).
    pub fn holder(&self) -> Uuid {
        self.holder
    }

    /// The next id and the lease it belongs to (its record is owed to it
    /// until committed or abandoned), or `None` when the lease may have
    /// lapsed.
    pub fn allocate(&self) -> Option<(SnowflakeId, Arc<LeaseIds>)> {
        let now = self.clock.now_ms();
        if now >= self.valid_until_ms.load(Ordering::Acquire) {
            return None;
        }
        let ids = self.ids();
        let id = ids.allocate(now)?;
        Some((id, ids))
    }

    /// The current lease, then the replaced ones not ended yet.
    pub fn leases(&self) -> Vec<Arc<LeaseIds>> {
        let mut all = vec![self.ids()];
        all.extend(
            self.retired
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned(),
        );
        all
    }

    /// A replaced lease's mark is ended: forget it.
    pub fn forget_retired(&self, lease: &Arc<LeaseIds>) {
        self.retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|l| !Arc::ptr_eq(l, lease));
    }

    /// The mark the next holder must start above: nothing this holder makes
    /// before its lease runs out can carry a later millisecond.
    fn promise_ms(&self) -> i64 {
        self.ids().high_water_ms().max(self.clock.now_ms())
            + i64::try_from(self.ttl.as_millis()).unwrap_or(0)
    }

    /// Renews once; `Ok(false)` when the lease was lost.
    pub async fn renew(&self, pool: &PgPool) -> Result<bool, DurableError> {
        let started = self.clock.now_ms();
        let ok = lease::renew(
            pool,
            self.worker_id(),
            self.holder,
            self.ttl,
            self.promise_ms(),
        )
        .await?;
        if ok {
            self.valid_until_ms
                .store(started + trusted_ms(self.ttl), Ordering::Release);
        } else {
            self.valid_until_ms.store(0, Ordering::Release);
        }
        Ok(ok)
    }

    /// Renews every third of the lifetime until `shutdown`, then gives the id back.
    pub async fn run(self: Arc<Self>, pool: PgPool, shutdown: CancellationToken) {
        let every = self.ttl / 3;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = shutdown.cancelled() => break,
            }
            match self.renew(&pool).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::error!(
                        worker_id = self.worker_id(),
                        "worker-id lease lost; issuing stops until re-leased"
                    );
                    self.lease_again(&pool).await;
                }
                Err(e) => tracing::warn!(error = %e, "could not renew the worker-id lease"),
            }
        }
        // Nothing more is issued: the next holder may start right above what
        // this one used.
        let mark = self.ids().high_water_ms().max(self.clock.now_ms());
        let _ = lease::release(&pool, self.worker_id(), self.holder, mark).await;
    }

    /// Takes a fresh worker id after the old lease was lost.
    async fn lease_again(&self, pool: &PgPool) {
        let started = self.clock.now_ms();
        match lease::acquire(pool, self.holder, self.ttl, started, self.marks_kept).await {
            Ok(Some(taken)) => {
                let ids = Arc::new(LeaseIds::new(
                    taken.worker_id,
                    taken.floor_ms.max(0),
                    self.holder,
                ));
                let old = std::mem::replace(
                    &mut *self.ids.write().unwrap_or_else(|p| p.into_inner()),
                    ids,
                );
                self.retired
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(old);
                self.valid_until_ms
                    .store(started + trusted_ms(self.ttl), Ordering::Release);
                tracing::warn!(
                    worker_id = taken.worker_id,
                    "leased a new snowflake worker id; issuing resumes"
                );
            }
            Ok(None) => tracing::error!("no free worker id to lease"),
            Err(e) => tracing::warn!(error = %e, "could not lease a new worker id"),
        }
    }
}

fn trusted_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis() * 8 / 10).unwrap_or(i64::MAX)
}
