//! The queue of Redis writes that could not be made while Redis was down
//! ([`Resync`], [`ResyncQueue`]), each versioned, replayed in order when it
//! is back (by [`super::catch_up::CatchUp`]).

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::fast::Marker;

/// A write to Redis that could not be made while it was down, replayed when
/// it is back (so that a fast token consumed through Postgres meanwhile does
/// not look fresh to Redis afterwards). Each carries the generation Postgres
/// decided at, so a replay never writes over a newer state (a release or a
/// consume that happened meanwhile elsewhere).
#[derive(Debug, Clone)]
pub(super) enum Resync {
    /// Postgres consumed the token at `gen` (with the result, once recorded).
    Consumed {
        token: String,
        gen: i64,
        marker: Marker,
    },
    /// Postgres released the token: issued at `gen` until `expires_at_ms`.
    Issued {
        token: String,
        gen: i64,
        expires_at_ms: i64,
    },
    /// A fast consume this instance decided alone (Redis and Postgres both
    /// down, so no generation is known): replayed through the consume script,
    /// which decides it against whatever Redis holds now and journals it.
    FastConsumed {
        token: String,
        marker: Marker,
        journal: crate::fast::Record,
    },
}

/// Redis writes kept for later at most (beyond: 503, nothing decided).
const RESYNC_LIMIT: usize = 100_000;

/// Redis writes waiting for Redis, oldest first, at most `RESYNC_LIMIT`;
/// their number is the gauge `ledger_redis_resync_depth`.
#[derive(Debug)]
pub(super) struct ResyncQueue {
    queue: Mutex<VecDeque<Resync>>,
    depth: prometheus::IntGauge,
}

impl ResyncQueue {
    pub(super) fn new(depth: prometheus::IntGauge) -> ResyncQueue {
        ResyncQueue {
            queue: Mutex::default(),
            depth,
        }
    }

    /// Queues a write for Redis; `false` when the queue is full.
    pub(super) fn push(&self, item: Resync) -> bool {
        let mut q = self.lock();
        let queued = q.len() < RESYNC_LIMIT;
        if queued {
            q.push_back(item);
        }
        self.depth.set(q.len() as i64);
        queued
    }

    pub(super) fn pop(&self) -> Option<Resync> {
        let mut q = self.lock();
        let item = q.pop_front();
        self.depth.set(q.len() as i64);
        item
    }

    /// Puts a write that failed back in front; returns how many wait.
    pub(super) fn put_back(&self, item: Resync) -> usize {
        let mut q = self.lock();
        q.push_front(item);
        self.depth.set(q.len() as i64);
        q.len()
    }

    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Resync>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}
