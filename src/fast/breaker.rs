//! Redis health as this instance sees it, and the service's mode. Redis is
//! *down* only on evidence: `redis.down_after_failures` consecutive calls
//! that could not reach it (refused, reset), or calls failing (timeouts
//! too) with no success for `redis.down_after`; one timeout is slowness,
//! not death. While down, calls are skipped at no cost (the breaker) and a
//! probe every `redis.down_backoff` closes it again. A window of recent call
//! latencies makes the rest of the mode: `degraded` while the p99 over
//! `redis.slow_window` is above `redis.slow_threshold`, else `normal`. Every
//! mode change is logged once and exported as `ledger_mode{mode}`; whether
//! the fleet agrees is [`crate::fleet`]'s. Every duration here (the
//! window, `redis.down_after`, the backoff) is measured on the service
//! clock's monotonic reading ([`Clock::monotonic`]), so tests drive them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::config::RedisSettings;
use crate::metrics::Metrics;

/// How the service treats Redis right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every consume asks Redis first.
    Normal,
    /// Redis is slow: a sample of durable consumes bypasses it.
    Degraded,
    /// The breaker is open: Redis is skipped at no cost.
    RedisDown,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Normal, Mode::Degraded, Mode::RedisDown];

    /// The label in `/readyz`, `/v1/admin/stats`, `ledger_mode` and the logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Normal => "normal",
            Mode::Degraded => "degraded",
            Mode::RedisDown => "redis_down",
        }
    }
    fn code(self) -> u8 {
        match self {
            Mode::Normal => 0,
            Mode::Degraded => 1,
            Mode::RedisDown => 2,
        }
    }
}

/// What kind of failure a failed call was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The call did not reach Redis, or its connection broke: counts toward
    /// `redis.down_after_failures`.
    Unreached,
    /// No answer in time: slowness; counts only toward `redis.down_after`.
    TimedOut,
}

/// At most this many latency samples are kept (the oldest go first).
const MAX_SAMPLES: usize = 8192;

pub struct Health {
    threshold: Duration,
    window: Duration,
    sample: f64,
    backoff: Duration,
    /// (when, how long) of recent Redis calls that got an answer or timed out.
    samples: Mutex<VecDeque<(Instant, Duration)>>,
    /// The p99 was above the threshold at the last evaluation.
    slow: AtomicBool,
    /// The breaker is open: the evidence said down, and no call or probe
    /// succeeded since.
    down: AtomicBool,
    /// Consecutive calls that did not reach Redis, since the last success.
    unreached: AtomicU32,
    /// When the first failure since the last success came ([`Health::mono_ms`]);
    /// 0: none.
    failing_since_ms: AtomicI64,
    down_after_failures: u32,
    down_after_ms: i64,
    /// Woken on every change of `down` (the fleet reports at once; one
    /// listener).
    changed: Arc<tokio::sync::Notify>,
    /// Until when calls are skipped without trying ([`Health::mono_ms`]).
    down_until_ms: AtomicI64,
    /// The mode last logged and exported (`Mode::code`).
    reported: AtomicU8,
    /// The clock's monotonic reading when this was made: `mono_ms` counts
    /// from it.
    base: Instant,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("mode", &self.mode())
            .finish_non_exhaustive()
    }
}

/// `ledger_mode{mode}`: 1 for `current`, 0 for the others.
fn export_mode(metrics: &Metrics, current: Mode) {
    for m in Mode::ALL {
        let on = if m == current { 1.0 } else { 0.0 };
        metrics.mode.with_label_values(&[m.as_str()]).set(on);
    }
}

impl Health {
    pub fn new(settings: &RedisSettings, metrics: Arc<Metrics>, clock: Arc<dyn Clock>) -> Health {
        export_mode(&metrics, Mode::Normal);
        Health {
            threshold: settings.slow_threshold,
            window: settings.slow_window,
            sample: settings.degraded_sample,
            backoff: settings.down_backoff,
            samples: Mutex::new(VecDeque::new()),
            slow: AtomicBool::new(false),
            down: AtomicBool::new(false),
            unreached: AtomicU32::new(0),
            failing_since_ms: AtomicI64::new(0),
            down_after_failures: settings.down_after_failures,
            down_after_ms: i64::try_from(settings.down_after.as_millis()).unwrap_or(i64::MAX),
            changed: Arc::new(tokio::sync::Notify::new()),
            down_until_ms: AtomicI64::new(0),
            reported: AtomicU8::new(Mode::Normal.code()),
            base: clock.monotonic(),
            clock,
            metrics,
        }
    }

    /// Now on the clock's monotonic reading: ms since `base`, plus one (so
    /// that 0 stays free to mean "none").
    fn mono_ms(&self) -> i64 {
        let since = self.clock.monotonic().saturating_duration_since(self.base);
        i64::try_from(since.as_millis())
            .unwrap_or(i64::MAX - 1)
            .saturating_add(1)
    }

    pub fn mode(&self) -> Mode {
        if self.down.load(Ordering::Relaxed) {
            Mode::RedisDown
        } else if self.slow.load(Ordering::Relaxed) {
            Mode::Degraded
        } else {
            Mode::Normal
        }
    }

    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    /// Whether calls are skipped right now (the breaker is open and its
    /// backoff has not passed).
    pub fn skipping(&self) -> bool {
        self.down_until_ms.load(Ordering::Relaxed) > self.mono_ms()
    }

    /// Lets the next call through although the backoff has not passed (the
    /// recovery probe).
    pub fn half_open(&self) {
        self.down_until_ms.store(0, Ordering::Relaxed);
    }

    /// Whether this durable consume should skip Redis: while degraded, a
    /// `redis.degraded_sample` fraction of them does.
    pub fn bypass(&self) -> bool {
        self.mode() == Mode::Degraded && rand::random::<f64>() < self.sample
    }

    /// One failed call, and what kind of failure; returns whether Redis is
    /// down for this instance now. The breaker opens (for
    /// `redis.down_backoff`) once the evidence is in, and a failed probe
    /// keeps it open.
    pub fn failed(&self, kind: Failure) -> bool {
        let now = self.mono_ms();
        let _ =
            self.failing_since_ms
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
        let unreached = match kind {
            Failure::Unreached => self.unreached.fetch_add(1, Ordering::Relaxed) + 1,
            Failure::TimedOut => self.unreached.load(Ordering::Relaxed),
        };
        let since = self.failing_since_ms.load(Ordering::Relaxed);
        let evidence = unreached >= self.down_after_failures
            || (since > 0 && now - since >= self.down_after_ms);
        if evidence || self.is_down() {
            self.trip();
        }
        self.is_down()
    }

    /// Opens the breaker for `redis.down_backoff`.
    fn trip(&self) {
        let backoff = i64::try_from(self.backoff.as_millis()).unwrap_or(1000);
        self.down_until_ms
            .store(self.mono_ms().saturating_add(backoff), Ordering::Relaxed);
        if !self.down.swap(true, Ordering::Relaxed) {
            self.changed.notify_one();
        }
        self.report();
    }

    /// A call got an answer: forgets the failures and closes the breaker.
    pub fn healthy(&self) {
        self.unreached.store(0, Ordering::Relaxed);
        self.failing_since_ms.store(0, Ordering::Relaxed);
        if self.down.swap(false, Ordering::Relaxed) {
            self.changed.notify_one();
            self.report();
        }
    }

    /// Notified on every change between down and up.
    pub fn changes(&self) -> Arc<tokio::sync::Notify> {
        self.changed.clone()
    }

    /// Records one call's latency (answered, or timed out).
    pub fn record(&self, took: Duration) {
        let now = self.clock.monotonic();
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() >= MAX_SAMPLES {
            s.pop_front();
        }
        s.push_back((now, took));
    }

    /// The p99 of the calls in the window; `None` without calls.
    pub fn p99(&self) -> Option<Duration> {
        let now = self.clock.monotonic();
        let mut latencies: Vec<Duration> = {
            let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
            while s
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > self.window)
            {
                s.pop_front();
            }
            s.iter().map(|(_, d)| *d).collect()
        };
        if latencies.is_empty() {
            return None;
        }
        // The rank's element in linear time: the window can hold 8,192
        // samples, looked at four times a second.
        let rank = (latencies.len() * 99).div_ceil(100).max(1) - 1;
        latencies.select_nth_unstable(rank);
        latencies.get(rank).copied()
    }

    /// Re-evaluates `degraded` from the window; returns the mode.
    pub fn evaluate(&self) -> Mode {
        let p99 = self.p99();
        self.slow
            .store(p99.is_some_and(|p| p > self.threshold), Ordering::Relaxed);
        if let Some(p) = p99 {
            self.metrics.redis_p99.set(p.as_secs_f64());
        }
        self.report();
        self.mode()
    }

    /// Logs and exports the mode if it changed since the last report.
    fn report(&self) {
        let mode = self.mode();
        let before = self.reported.swap(mode.code(), Ordering::Relaxed);
        if before == mode.code() {
            return;
        }
        export_mode(&self.metrics, mode);
        let p99_ms = self.p99().map(|d| d.as_millis() as u64);
        match mode {
            Mode::Normal => tracing::info!(mode = mode.as_str(), ?p99_ms, "redis healthy again: mode normal"),
            Mode::Degraded => tracing::warn!(
                mode = mode.as_str(),
                ?p99_ms,
                threshold_ms = self.threshold.as_millis() as u64,
                sample = self.sample,
                "redis slow: mode degraded (a sample of durable consumes bypasses it)"
            ),
            Mode::RedisDown => tracing::warn!(
                mode = mode.as_str(),
                "redis unreachable or timing out: mode redis_down (durable: postgres alone; fast: postgres with a local cache)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::Settings;

    fn health(extra: &str) -> Health {
        health_on(extra, Arc::new(crate::clock::SystemClock))
    }

    fn health_on(extra: &str, clock: Arc<dyn Clock>) -> Health {
        let s = Settings::from_toml_over_defaults(extra).expect("valid");
        Health::new(&s.redis, Arc::new(Metrics::new()), clock)
    }

    proptest::proptest! {
        #[test]
        fn the_p99_is_the_rank_of_the_sorted_window(
            ms in proptest::collection::vec(0u64..1_000, 1..400),
        ) {
            let h = health("");
            for m in &ms {
                h.record(Duration::from_millis(*m));
            }
            let mut sorted = ms.clone();
            sorted.sort_unstable();
            let rank = (sorted.len() * 99).div_ceil(100) - 1;
            proptest::prop_assert_eq!(h.p99(), Some(Duration::from_millis(sorted[rank])));
        }
    }

    #[test]
    fn the_window_forgets_samples_older_than_slow_window() {
        let clock = ManualClock::new(0);
        let h = health_on(
            "[redis]\nslow_threshold = \"100ms\"\nslow_window = \"1s\"",
            Arc::new(clock.clone()),
        );
        h.record(Duration::from_millis(150));
        assert_eq!(h.evaluate(), Mode::Degraded);
        clock.advance_monotonic(Duration::from_millis(1000));
        assert_eq!(
            h.p99(),
            Some(Duration::from_millis(150)),
            "still in the window"
        );
        // Wall time alone moves nothing.
        clock.advance_ms(60_000);
        assert_eq!(h.p99(), Some(Duration::from_millis(150)));
        clock.advance_monotonic(Duration::from_millis(1));
        assert_eq!(h.p99(), None, "older than the window");
        assert_eq!(h.evaluate(), Mode::Normal);
    }

    #[test]
    fn down_after_and_the_backoff_follow_the_clock() {
        let clock = ManualClock::new(0);
        let h = health_on(
            "[redis]\ndown_after_failures = 100\ndown_after = \"50ms\"\ndown_backoff = \"1s\"",
            Arc::new(clock.clone()),
        );
        assert!(!h.failed(Failure::TimedOut));
        clock.advance_monotonic(Duration::from_millis(49));
        assert!(!h.failed(Failure::TimedOut), "not for down_after yet");
        clock.advance_monotonic(Duration::from_millis(1));
        assert!(h.failed(Failure::TimedOut), "failing for down_after");
        assert!(h.skipping());
        clock.advance_monotonic(Duration::from_millis(999));
        assert!(h.skipping(), "within the backoff");
        clock.advance_monotonic(Duration::from_millis(1));
        assert!(!h.skipping(), "the backoff has passed: a probe may go");
        assert_eq!(h.mode(), Mode::RedisDown, "down until a call succeeds");
    }

    #[test]
    fn modes_follow_latency_and_breaker() {
        let h = health("[redis]\nslow_threshold = \"100ms\"\nslow_window = \"1s\"");
        assert_eq!(h.evaluate(), Mode::Normal);
        for _ in 0..199 {
            h.record(Duration::from_millis(1));
        }
        h.record(Duration::from_millis(150));
        assert_eq!(
            h.evaluate(),
            Mode::Normal,
            "one slow call in 200 is within the 1 %"
        );
        h.record(Duration::from_millis(150));
        h.record(Duration::from_millis(150));
        assert_eq!(h.evaluate(), Mode::Degraded);
        h.trip();
        assert_eq!(h.mode(), Mode::RedisDown);
        assert!(
            h.failed(Failure::TimedOut),
            "a failure while down keeps it down"
        );
        assert!(h.skipping());
        h.half_open();
        assert!(!h.skipping());
        h.healthy();
        assert_eq!(h.mode(), Mode::Degraded);
        h.samples.lock().unwrap().clear();
        assert_eq!(h.evaluate(), Mode::Normal);
    }

    #[test]
    fn down_needs_evidence() {
        let h = health("[redis]\ndown_after_failures = 3\ndown_after = \"60s\"");
        assert!(!h.failed(Failure::TimedOut), "one timeout is slowness");
        assert!(!h.failed(Failure::TimedOut));
        assert!(!h.failed(Failure::Unreached));
        assert!(!h.failed(Failure::Unreached));
        assert_eq!(h.mode(), Mode::Normal);
        assert!(h.failed(Failure::Unreached), "the third unreached call");
        assert_eq!(h.mode(), Mode::RedisDown);
        h.healthy();
        assert_eq!(h.mode(), Mode::Normal);
        // A success in between starts the count again.
        assert!(!h.failed(Failure::Unreached));
        assert!(!h.failed(Failure::Unreached));
        h.healthy();
        assert!(!h.failed(Failure::Unreached));
        assert_eq!(h.mode(), Mode::Normal);
    }

    #[test]
    fn sustained_timeouts_are_down() {
        let h = health("[redis]\ndown_after_failures = 100\ndown_after = \"50ms\"");
        assert!(!h.failed(Failure::TimedOut));
        std::thread::sleep(Duration::from_millis(60));
        assert!(
            h.failed(Failure::TimedOut),
            "failing with no success for down_after"
        );
    }

    #[test]
    fn bypass_only_while_degraded() {
        let h = health("[redis]\ndegraded_sample = 1.0\nslow_threshold = \"1ms\"");
        assert!(!h.bypass());
        h.record(Duration::from_millis(5));
        h.evaluate();
        assert!(h.bypass());
    }
}
