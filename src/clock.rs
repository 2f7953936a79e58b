//! The one source of "now" for decisions taken in this process, in wall time
//! and in monotonic time. Tests drive a [`ManualClock`]; Postgres `now()`
//! still has the last word on durable expiry.
//!
//! Wall time ([`Clock::now_ms`], [`Clock::now`]) is for what is compared with
//! times other processes wrote (token expiry, leases in Postgres, records).
//! Monotonic time ([`Clock::monotonic`]) is for how long something in this
//! process has lasted; these decisions read it:
//! - Redis's breaker ([`crate::fast::breaker`]): the p99 latency window
//!   (`redis.slow_window`), the failures that make Redis down
//!   (`redis.down_after`) and the breaker's backoff (`redis.down_backoff`);
//! - the fleet's gate ([`crate::fleet`]): its lease (`fleet.lease`), how long
//!   peers still count this instance, and which recent Redis decisions the
//!   journal was seen empty after;
//! - the group-commit queue ([`crate::durable::group`]): how long an item
//!   waited for its batch (the queue bound).
//!
//! Elapsed times measured only for metrics and logs (request and call
//! latencies, pool timings) read `std::time::Instant` directly.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};

pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;

    fn now(&self) -> DateTime<Utc> {
        Utc.timestamp_millis_opt(self.now_ms())
            .single()
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }

    /// A monotonic reading: never goes backwards, whatever wall time does.
    /// Only differences between readings of the same clock mean anything.
    fn monotonic(&self) -> Instant;
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        Utc::now().timestamp_millis()
    }

    fn monotonic(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to. Its wall time and its monotonic
/// time move separately: [`ManualClock::set_ms`] and
/// [`ManualClock::advance_ms`] move wall time only (it may also be set
/// backwards), [`ManualClock::advance_monotonic`] moves monotonic time only
/// (forwards). A service run on one therefore sees no lease, latency window
/// or queue bound run out until the test advances monotonic time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    wall_ms: Arc<AtomicI64>,
    /// The monotonic reading is `base` plus `mono_ns`.
    base: Instant,
    mono_ns: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new(ms: i64) -> ManualClock {
        ManualClock {
            wall_ms: Arc::new(AtomicI64::new(ms)),
            base: Instant::now(),
            mono_ns: Arc::new(AtomicU64::new(0)),
        }
    }
    pub fn set_ms(&self, ms: i64) {
        self.wall_ms.store(ms, Ordering::SeqCst);
    }
    pub fn advance_ms(&self, ms: i64) {
        self.wall_ms.fetch_add(ms, Ordering::SeqCst);
    }
    /// Moves monotonic time forwards by `by` (wall time stays).
    pub fn advance_monotonic(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.mono_ns.fetch_add(ns, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.wall_ms.load(Ordering::SeqCst)
    }

    fn monotonic(&self) -> Instant {
        self.base + Duration::from_nanos(self.mono_ns.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_wall_and_monotonic_time_move_separately() {
        let clock = ManualClock::new(1_000);
        let start = clock.monotonic();
        clock.advance_ms(500);
        clock.set_ms(10);
        assert_eq!(clock.now_ms(), 10);
        assert_eq!(
            clock.monotonic(),
            start,
            "wall time moved, monotonic did not"
        );
        clock.advance_monotonic(Duration::from_millis(250));
        assert_eq!(clock.now_ms(), 10);
        assert_eq!(clock.monotonic() - start, Duration::from_millis(250));
        // Clones share the time.
        let other = clock.clone();
        other.advance_monotonic(Duration::from_millis(1));
        assert_eq!(clock.monotonic() - start, Duration::from_millis(251));
    }
}
