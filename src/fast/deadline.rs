//! The not-after bound of a deciding script (consume, result, release).
//!
//! A call whose reply does not come within `redis.timeout` is answered 503
//! (outcome unknown), and its caller may retry on another instance, win,
//! even release the token again. The script itself may still be on its way
//! (a stalled link, a paused Redis): run then, it would consume the token
//! for nobody, or release someone else's consume. So each script carries
//! the latest time, in Redis's own clock, at which it may still decide: its
//! caller's deadline. Past it, the script answers `late` and writes nothing.
//!
//! Our deadline is turned into Redis's clock by the offset between the two
//! clocks that the last reply carrying Redis's time allows at least: Redis
//! said `r` and we read it at `e` (our monotonic clock), so Redis's clock
//! minus ours is at least `r - e`. A bound set with that lower offset is
//! never later than the caller's deadline; it may be earlier by the reply's
//! transit time, which at worst refuses a script the caller still waits for
//! (it then hears 503 and retries: nothing was decided). Until a reply has
//! told Redis's time, scripts carry no bound. Our side is monotonic: a step
//! of the wall clock moves nothing.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// Redis's clock minus ours, at least, from the last reply.
#[derive(Debug)]
pub(super) struct Deadline {
    base: Instant,
    /// `i64::MIN`: no reply has told Redis's time yet.
    floor_ms: AtomicI64,
}

impl Deadline {
    pub(super) fn new() -> Deadline {
        Deadline {
            base: Instant::now(),
            floor_ms: AtomicI64::new(i64::MIN),
        }
    }

    fn now_ms(&self) -> i64 {
        i64::try_from(self.base.elapsed().as_millis()).unwrap_or(i64::MAX)
    }

    /// A reply said Redis's clock read `redis_now_ms` when it ran.
    pub(super) fn observe(&self, redis_now_ms: i64) {
        if redis_now_ms > 0 {
            self.floor_ms
                .store(redis_now_ms - self.now_ms(), Ordering::Relaxed);
        }
    }

    /// The bound, in Redis's clock (ms), of a script sent now whose caller
    /// gives up after `timeout`; `None` while Redis's time is unknown.
    pub(super) fn not_after(&self, timeout: Duration) -> Option<i64> {
        let floor = self.floor_ms.load(Ordering::Relaxed);
        if floor == i64::MIN {
            return None;
        }
        let timeout = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX / 4);
        Some(self.now_ms().saturating_add(timeout).saturating_add(floor))
    }

    /// Whether a reply has told Redis's time: until then scripts carry no
    /// bound, and Redis must not decide (see `crate::fleet`).
    pub(super) fn known(&self) -> bool {
        self.floor_ms.load(Ordering::Relaxed) != i64::MIN
    }

    /// [`Deadline::not_after`] as a script argument (`''`: no bound).
    pub(super) fn arg(&self, timeout: Duration) -> String {
        self.not_after(timeout)
            .map(|t| t.to_string())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_bound_until_redis_told_its_time() {
        let d = Deadline::new();
        assert_eq!(d.not_after(Duration::from_millis(250)), None);
        assert_eq!(d.arg(Duration::from_millis(250)), "");
    }

    #[test]
    fn the_bound_is_our_deadline_in_redis_s_clock() {
        let d = Deadline::new();
        // Redis's clock runs 1,000,000 ms ahead of our monotonic base.
        let redis_now = d.now_ms() + 1_000_000;
        d.observe(redis_now);
        let bound = d.not_after(Duration::from_millis(250)).expect("a bound");
        let expected = redis_now + 250;
        // Never later than the deadline; earlier only by the time between
        // the observation and the call.
        assert!(
            bound >= expected && bound <= expected + 50,
            "{bound} vs {expected}"
        );
    }
}
