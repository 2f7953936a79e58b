//! The retry policy: which failures are tried again, how long to wait between
//! tries (jittered exponential backoff, never less than `Retry-After`), and
//! when to give up (a number of tries and a total deadline).
//!
//! Retrying is safe because a logical request is built once and sent as the
//! same bytes on every try: a consume carries the same `request_id` each time,
//! so a try whose answer was lost after the ledger committed it is answered
//! `consumed` again on the next try (with `Idempotent-Replayed: true`), never
//! `duplicate`.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use http::HeaderMap;

/// How one logical call is retried. The defaults: at most 5 tries; waits of
/// 50 ms doubling up to 2 s, each lengthened by a random part of up to itself
/// (jitter, so that many clients do not retry in step); everything, tries and
/// waits, within 10 s; each try at most 5 s. A `Retry-After` longer than the
/// computed wait replaces it.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub(crate) max_attempts: usize,
    pub(crate) min_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) jitter: bool,
    pub(crate) deadline: Duration,
    pub(crate) attempt_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 5,
            min_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(2),
            jitter: true,
            deadline: Duration::from_secs(10),
            attempt_timeout: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// One try, no retries (the deadline and per-try timeout still apply).
    pub fn none() -> RetryPolicy {
        RetryPolicy::default().max_attempts(1)
    }

    /// Tries in all, the first included (at least 1).
    pub fn max_attempts(mut self, n: usize) -> RetryPolicy {
        self.max_attempts = n.max(1);
        self
    }

    /// The first wait; each next one doubles, up to `max`.
    pub fn delays(mut self, min: Duration, max: Duration) -> RetryPolicy {
        self.min_delay = min;
        self.max_delay = max.max(min);
        self
    }

    /// Jitter on each wait (on by default; off makes waits predictable).
    pub fn jitter(mut self, on: bool) -> RetryPolicy {
        self.jitter = on;
        self
    }

    /// The whole logical call, tries and waits, ends by then: a wait that
    /// would cross it (a long `Retry-After` included) is not taken, and the
    /// last error is returned.
    pub fn deadline(mut self, total: Duration) -> RetryPolicy {
        self.deadline = total;
        self
    }

    /// One try may take this long (capped by what is left of the deadline).
    pub fn attempt_timeout(mut self, t: Duration) -> RetryPolicy {
        self.attempt_timeout = t;
        self
    }

    /// The waits before the second, third, ... tries.
    pub(crate) fn backoff(&self) -> impl Iterator<Item = Duration> {
        let b = ExponentialBuilder::new()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_factor(2.0)
            .with_max_times(self.max_attempts.saturating_sub(1));
        if self.jitter {
            b.with_jitter().build()
        } else {
            b.build()
        }
    }
}

/// `Retry-After` in whole seconds (the form the ledger sends). An HTTP date
/// or garbage counts as absent: the backoff alone decides then.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_within_bounds_and_stops_after_the_last_try() {
        let p = RetryPolicy::default()
            .max_attempts(4)
            .delays(Duration::from_millis(10), Duration::from_millis(25))
            .jitter(false);
        let waits: Vec<_> = p.backoff().collect();
        assert_eq!(
            waits,
            vec![
                Duration::from_millis(10),
                Duration::from_millis(20),
                Duration::from_millis(25)
            ]
        );
        assert_eq!(RetryPolicy::none().backoff().count(), 0);
    }

    #[test]
    fn retry_after_reads_seconds_only() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(http::header::RETRY_AFTER, "3".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(3)));
        h.insert(
            http::header::RETRY_AFTER,
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap(),
        );
        assert_eq!(retry_after(&h), None);
    }
}
