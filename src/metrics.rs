//! Prometheus metrics, and the per-biz-type counters that every instance
//! flushes to Postgres for the fleet-wide `/v1/admin/stats`. Gauges that need
//! a query to know ([`OnScrape`]: journal lag, the last reconcile run) are
//! refreshed in the background when scraped, at most once per interval.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Counters of one biz type since the last flush.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatCounts {
    pub issued: i64,
    pub consumed: i64,
    pub duplicates: i64,
    pub expired: i64,
    pub invalid: i64,
}

#[derive(Debug, Clone, Copy)]
pub enum Stat {
    Issued,
    Consumed,
    Duplicate,
    Expired,
    Invalid,
}

impl StatCounts {
    fn add(&mut self, stat: Stat) {
        match stat {
            Stat::Issued => self.issued += 1,
            Stat::Consumed => self.consumed += 1,
            Stat::Duplicate => self.duplicates += 1,
            Stat::Expired => self.expired += 1,
            Stat::Invalid => self.invalid += 1,
        }
    }
}

pub struct Metrics {
    pub registry: Registry,
    pub tokens_issued: IntCounterVec,
    pub consume_total: IntCounterVec,
    pub request_duration: HistogramVec,
    pub tier_duration: HistogramVec,
    pub mode: GaugeVec,
    pub bloom_fill_ratio: Gauge,
    pub bloom_fp_rate: Gauge,
    pub bloom_tokens: IntGauge,
    pub bloom_synced: IntGauge,
    pub bloom_checks: IntCounterVec,
    pub rate_limited: IntCounterVec,
    pub fast_tier_total: IntCounterVec,
    pub redis_eviction_unsafe: IntGauge,
    pub issue_buffer_depth: IntGauge,
    pub redis_p99: Gauge,
    pub redis_bypass: IntCounterVec,
    pub resync_depth: IntGauge,
    /// Answers by route pattern, method and status code.
    pub http_requests: IntCounterVec,
    pub journal_dead_letters: IntCounter,
    /// Durable consumes decided by one statement (group commit).
    pub pg_batch_size: Histogram,
    /// Durable consumes waiting for the next batch.
    pub pg_consume_queue: IntGauge,
    /// Durable client-key consumes decided by one statement (group commit).
    pub pg_key_batch_size: Histogram,
    /// Durable client-key consumes waiting for the next batch.
    pub pg_key_consume_queue: IntGauge,
    /// Results and releases decided by one statement (group commit).
    pub pg_finish_batch_size: Histogram,
    /// Results and releases waiting for the next batch.
    pub pg_finish_queue: IntGauge,
    /// Order events decided by one transaction (their batches).
    pub pg_order_batch_size: Histogram,
    /// Order events waiting for the next batch.
    pub pg_order_queue: IntGauge,
    /// Cluster journal entries whose `XADD` failed, by where they went.
    pub journal_append_fallback: IntCounterVec,
    /// Keys per Redis pipeline (its count: the pipelines), by what sent it:
    /// `reconcile` (a page's reads) or `writeback` (a batch's write-backs).
    pub redis_pipeline_keys: HistogramVec,
    /// Cluster: keys of such a pipeline sent again alone, by what sent it
    /// and why.
    pub redis_key_rereads: IntCounterVec,
    pending: Mutex<HashMap<String, StatCounts>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Buckets of a histogram of items per batch or pipeline.
const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

// Metric definitions are static and valid, and every name is registered
// once into a fresh registry: neither making nor registering one can fail.

fn register<C: Collector + Clone + 'static>(registry: &Registry, c: C) -> C {
    registry
        .register(Box::new(c.clone()))
        .expect("distinct metric names");
    c
}

fn int_counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    register(registry, IntCounter::new(name, help).expect("valid metric"))
}

fn int_counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    register(registry, c)
}

fn int_gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    register(registry, IntGauge::new(name, help).expect("valid metric"))
}

fn gauge(registry: &Registry, name: &str, help: &str) -> Gauge {
    register(registry, Gauge::new(name, help).expect("valid metric"))
}

fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    register(registry, g)
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    register(registry, Histogram::with_opts(opts).expect("valid metric"))
}

fn histogram_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    buckets: &[f64],
    labels: &[&str],
) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
    register(
        registry,
        HistogramVec::new(opts, labels).expect("valid metric"),
    )
}

/// `ledger_build_info`, and the process's own (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, `process_open_fds`,
/// `process_start_time_seconds`, ...; Linux).
fn register_process(registry: &Registry) {
    let build_info = IntGaugeVec::new(
        Opts::new("ledger_build_info", "1, labelled with the running version."),
        &["version"],
    )
    .expect("valid metric");
    build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    register(registry, build_info);
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("distinct metric names");
}

/// The payment path: issues, consumes, HTTP answers and their latency, 429s.
struct PaymentPath {
    tokens_issued: IntCounterVec,
    consume_total: IntCounterVec,
    request_duration: HistogramVec,
    http_requests: IntCounterVec,
    rate_limited: IntCounterVec,
}

impl PaymentPath {
    fn register(r: &Registry) -> PaymentPath {
        let tokens_issued = int_counter_vec(
            r,
            "ledger_tokens_issued_total",
            "Tokens issued.",
            &["biz_type"],
        );
        let consume_total = int_counter_vec(
            r,
            "ledger_consume_total",
            "Consume attempts (order events included) by outcome: consumed, replayed, duplicate, fingerprint_mismatch, expired, invalid, mismatch, unavailable.",
            &["biz_type", "outcome"],
        );
        let request_duration = histogram_vec(
            r,
            "ledger_request_duration_seconds",
            "HTTP request latency.",
            LATENCY_BUCKETS,
            &["endpoint"],
        );
        let http_requests = int_counter_vec(
            r,
            "ledger_http_requests_total",
            "HTTP answers by endpoint (the route pattern; `unmatched` for no route), method and status code.",
            &["endpoint", "method", "status"],
        );
        let rate_limited = int_counter_vec(
            r,
            "ledger_rate_limited_total",
            "Requests answered 429: scope client (the per-client ceiling) or issue (per client and subject).",
            &["scope"],
        );
        for s in ["client", "issue"] {
            rate_limited.with_label_values(&[s]);
        }
        PaymentPath {
            tokens_issued,
            consume_total,
            request_duration,
            http_requests,
            rate_limited,
        }
    }
}

/// The tiers: call latency, the mode, Redis's health and what bypassed it,
/// its write-backs and pipelines.
struct Tiers {
    tier_duration: HistogramVec,
    mode: GaugeVec,
    fast_tier_total: IntCounterVec,
    redis_eviction_unsafe: IntGauge,
    redis_p99: Gauge,
    redis_bypass: IntCounterVec,
    resync_depth: IntGauge,
    redis_pipeline_keys: HistogramVec,
    redis_key_rereads: IntCounterVec,
}

impl Tiers {
    fn register(r: &Registry) -> Tiers {
        let tier_duration = histogram_vec(
            r,
            "ledger_tier_duration_seconds",
            "Latency of one call to a tier.",
            LATENCY_BUCKETS,
            &["tier", "op"],
        );
        let mode = gauge_vec(
            r,
            "ledger_mode",
            "1 for the current mode (normal, degraded, redis_down).",
            &["mode"],
        );
        let fast_tier_total = int_counter_vec(
            r,
            "ledger_fast_tier_total",
            "Redis lookups on the consume path: hit (Redis knew the token), miss, error (a Redis call a request waited on failed).",
            &["result"],
        );
        let redis_eviction_unsafe = int_gauge(
            r,
            "ledger_redis_eviction_unsafe",
            "1 when Redis maxmemory-policy is not noeviction (fast biz types may lose tokens).",
        );
        let redis_p99 = gauge(
            r,
            "ledger_redis_p99_seconds",
            "p99 latency of Redis calls over redis.slow_window (above redis.slow_threshold: mode degraded).",
        );
        let redis_bypass = int_counter_vec(
            r,
            "ledger_redis_bypass_total",
            "Consumes decided without Redis: degraded_sample (the sample while degraded), down (breaker open), memory (fast type decided by this instance alone).",
            &["reason"],
        );
        let resync_depth = int_gauge(
            r,
            "ledger_redis_resync_depth",
            "Redis writes queued while it was down, replayed when it is back.",
        );
        let redis_pipeline_keys = histogram_vec(
            r,
            "ledger_redis_pipeline_keys",
            "Keys sent with one Redis pipeline, by op: reconcile (a page's reads) or writeback (a batch's consumed write-backs); one per page or batch on a standalone Redis, one per primary and page or batch on a cluster; its _count is the pipelines sent.",
            BATCH_BUCKETS,
            &["op"],
        );
        let redis_key_rereads = int_counter_vec(
            r,
            "ledger_redis_key_rereads_total",
            "Cluster: keys of a reconcile page read again alone, or write-backs of a batch sent again alone (op: reconcile, writeback), following redirects, instead of in their primary's pipeline, by reason: moved, ask, try_again (the pipeline met that reply in the key's slot), no_route (no known primary for the slot, or no connection to it).",
            &["op", "reason"],
        );
        for res in ["hit", "miss", "error"] {
            fast_tier_total.with_label_values(&[res]);
        }
        for res in ["degraded_sample", "down", "memory"] {
            redis_bypass.with_label_values(&[res]);
        }
        for op in ["reconcile", "writeback"] {
            redis_pipeline_keys.with_label_values(&[op]);
            for res in ["moved", "ask", "try_again", "no_route"] {
                redis_key_rereads.with_label_values(&[op, res]);
            }
        }
        Tiers {
            tier_duration,
            mode,
            fast_tier_total,
            redis_eviction_unsafe,
            redis_p99,
            redis_bypass,
            resync_depth,
            redis_pipeline_keys,
            redis_key_rereads,
        }
    }
}

/// The issued-token filter.
struct Bloom {
    fill_ratio: Gauge,
    fp_rate: Gauge,
    tokens: IntGauge,
    synced: IntGauge,
    checks: IntCounterVec,
}

impl Bloom {
    fn register(r: &Registry) -> Bloom {
        let fill_ratio = gauge(
            r,
            "ledger_bloom_fill_ratio",
            "Fraction of bits set in the fullest live bloom filter (refreshed every 5 s).",
        );
        let fp_rate = gauge(
            r,
            "ledger_bloom_false_positive_rate",
            "Estimated false-positive rate of the fullest bloom filter (fill ratio ^ hash functions): the share of forged tokens let through to the tiers.",
        );
        let tokens = int_gauge(
            r,
            "ledger_bloom_tokens",
            "Token ids held by the bloom filter's live generations.",
        );
        let synced = int_gauge(
            r,
            "ledger_bloom_synced",
            "1 while the bloom filter hears every issuance (listening and loaded); 0: unknown tokens go on to the tiers.",
        );
        let checks = int_counter_vec(
            r,
            "ledger_bloom_checks_total",
            "Bloom filter checks of verified tokens by verdict: known, young (unknown but within the grace), uncovered (older than the horizon, or the filter not synced), rejected (never issued: 400 token_invalid without I/O).",
            &["verdict"],
        );
        for v in ["known", "young", "uncovered", "unrecorded", "rejected"] {
            checks.with_label_values(&[v]);
        }
        Bloom {
            fill_ratio,
            fp_rate,
            tokens,
            synced,
            checks,
        }
    }
}

/// Group commit on Postgres: batch sizes and queues of consumes (tokens and
/// client keys), of results and releases, and of order events.
struct Batches {
    consume_size: Histogram,
    consume_queue: IntGauge,
    key_size: Histogram,
    key_queue: IntGauge,
    finish_size: Histogram,
    finish_queue: IntGauge,
    order_size: Histogram,
    order_queue: IntGauge,
}

impl Batches {
    fn register(r: &Registry) -> Batches {
        Batches {
            consume_size: histogram(
                r,
                "ledger_pg_batch_size",
                "Durable consumes decided by one Postgres statement (1: sent at once; more: collected while postgres.consume_batches_in_flight statements ran).",
                BATCH_BUCKETS,
            ),
            consume_queue: int_gauge(
                r,
                "ledger_pg_consume_queue",
                "Durable consumes waiting for the next batch statement.",
            ),
            key_size: histogram(
                r,
                "ledger_pg_key_batch_size",
                "Durable client-key consumes decided by one Postgres statement (1: sent at once; more: collected while postgres.consume_batches_in_flight key statements ran).",
                BATCH_BUCKETS,
            ),
            key_queue: int_gauge(
                r,
                "ledger_pg_key_consume_queue",
                "Durable client-key consumes waiting for the next batch statement.",
            ),
            finish_size: histogram(
                r,
                "ledger_pg_finish_batch_size",
                "Results and releases (of durable tokens and keys, and of tokens Redis did not hold) decided by one Postgres statement (1: sent at once; more: collected while postgres.consume_batches_in_flight such statements ran).",
                BATCH_BUCKETS,
            ),
            finish_queue: int_gauge(
                r,
                "ledger_pg_finish_queue",
                "Results and releases waiting for the next batch statement.",
            ),
            order_size: histogram(
                r,
                "ledger_pg_order_batch_size",
                "Order events (on distinct orders) decided by one Postgres transaction (1: sent at once; more: collected while postgres.order_batches_in_flight transactions ran).",
                BATCH_BUCKETS,
            ),
            order_queue: int_gauge(
                r,
                "ledger_pg_order_queue",
                "Order events waiting for the next batch transaction.",
            ),
        }
    }
}

/// Writes that lag the answer: issuance records and the fast types'
/// journal.
struct Lagging {
    issue_buffer_depth: IntGauge,
    journal_dead_letters: IntCounter,
    journal_append_fallback: IntCounterVec,
}

impl Lagging {
    fn register(r: &Registry) -> Lagging {
        let issue_buffer_depth = int_gauge(
            r,
            "ledger_issue_buffer_depth",
            "Issuance records waiting to be written to Postgres.",
        );
        let journal_dead_letters = int_counter(
            r,
            "ledger_journal_dead_letters_total",
            "Fast-type journal entries that can never apply (unreadable, or refused by Postgres for what they hold), set aside in the stream <prefix>journal:dead.",
        );
        let journal_append_fallback = int_counter_vec(
            r,
            "ledger_journal_append_fallback_total",
            "Cluster: fast-type journal entries whose XADD failed after the decision, by where they went: postgres (applied directly before the answer), memory (Postgres failed too: kept in this process until Redis answers), dropped (that backlog was full).",
            &["to"],
        );
        for to in ["postgres", "memory", "dropped"] {
            journal_append_fallback.with_label_values(&[to]);
        }
        Lagging {
            issue_buffer_depth,
            journal_dead_letters,
            journal_append_fallback,
        }
    }
}

impl Metrics {
    /// A fresh registry with every family of this struct (by group), the
    /// build info and the process's own metrics. The families of other
    /// components (the fleet, pool usage, journal lag, reconcile, ...) are
    /// registered by their owners.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        register_process(&registry);
        let payment = PaymentPath::register(&registry);
        let tiers = Tiers::register(&registry);
        let bloom = Bloom::register(&registry);
        let batches = Batches::register(&registry);
        let lagging = Lagging::register(&registry);
        Metrics {
            registry,
            tokens_issued: payment.tokens_issued,
            consume_total: payment.consume_total,
            request_duration: payment.request_duration,
            http_requests: payment.http_requests,
            rate_limited: payment.rate_limited,
            tier_duration: tiers.tier_duration,
            mode: tiers.mode,
            fast_tier_total: tiers.fast_tier_total,
            redis_eviction_unsafe: tiers.redis_eviction_unsafe,
            redis_p99: tiers.redis_p99,
            redis_bypass: tiers.redis_bypass,
            resync_depth: tiers.resync_depth,
            redis_pipeline_keys: tiers.redis_pipeline_keys,
            redis_key_rereads: tiers.redis_key_rereads,
            bloom_fill_ratio: bloom.fill_ratio,
            bloom_fp_rate: bloom.fp_rate,
            bloom_tokens: bloom.tokens,
            bloom_synced: bloom.synced,
            bloom_checks: bloom.checks,
            pg_batch_size: batches.consume_size,
            pg_consume_queue: batches.consume_queue,
            pg_key_batch_size: batches.key_size,
            pg_key_consume_queue: batches.key_queue,
            pg_finish_batch_size: batches.finish_size,
            pg_finish_queue: batches.finish_queue,
            pg_order_batch_size: batches.order_size,
            pg_order_queue: batches.order_queue,
            issue_buffer_depth: lagging.issue_buffer_depth,
            journal_dead_letters: lagging.journal_dead_letters,
            journal_append_fallback: lagging.journal_append_fallback,
            pending: Mutex::new(HashMap::new()),
        }
    }

    /// Counts one HTTP answer. `endpoint` is a route pattern (bounded);
    /// methods outside the standard ones count as `other`.
    pub fn http_request(&self, endpoint: &str, method: &str, status: u16) {
        const METHODS: &[&str] = &[
            "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "CONNECT", "TRACE",
        ];
        let method = METHODS
            .iter()
            .find(|m| **m == method)
            .copied()
            .unwrap_or("other");
        self.http_requests
            .with_label_values(&[endpoint, method, &status.to_string()])
            .inc();
    }

    /// Counts one event for the fleet-wide stats.
    pub fn stat(&self, biz_type: &str, stat: Stat) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        // The biz type's name is copied only the first time it is counted
        // since the last flush.
        match pending.get_mut(biz_type) {
            Some(c) => c.add(stat),
            None => {
                let mut c = StatCounts::default();
                c.add(stat);
                pending.insert(biz_type.to_owned(), c);
            }
        }
    }

    /// Takes the counts accumulated since the last call.
    pub fn take_stats(&self) -> HashMap<String, StatCounts> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *pending)
    }

    /// Puts counts back after a failed flush.
    pub fn restore_stats(&self, counts: HashMap<String, StatCounts>) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for (biz, c) in counts {
            let e = pending.entry(biz).or_default();
            e.issued += c.issued;
            e.consumed += c.consumed;
            e.duplicates += c.duplicates;
            e.expired += c.expired;
            e.invalid += c.invalid;
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let encoder = TextEncoder::new();
        if encoder.encode(&self.registry.gather(), &mut buf).is_err() {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
/// What [`OnScrape`] runs to bring its gauges up to date.
pub type Refresh = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

#[derive(Debug, Default)]
struct ScrapeState {
    last: Option<Instant>,
    running: bool,
}

/// Gauges whose values cost a query (Redis or Postgres): a scrape returns the
/// values as last read and, when they are older than `every`, starts one
/// refresh in the background for the next scrape. So a service nobody
/// scrapes sends no such queries, and one scraped often sends at most one per
/// `every`; the values a scrape sees are at most `every` plus one query old.
pub struct OnScrape {
    gauges: Vec<Box<dyn Collector>>,
    every: Duration,
    refresh: Refresh,
    state: Arc<Mutex<ScrapeState>>,
}

impl OnScrape {
    pub fn new(gauges: Vec<Box<dyn Collector>>, every: Duration, refresh: Refresh) -> OnScrape {
        OnScrape {
            gauges,
            every,
            refresh,
            state: Arc::default(),
        }
    }

    /// Starts a refresh unless one runs or the last one is recent enough.
    fn refresh_if_due(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let fresh = s.last.is_some_and(|t| t.elapsed() < self.every);
            if s.running || fresh {
                return;
            }
            s.running = true;
        }
        let work = (self.refresh)();
        let state = self.state.clone();
        runtime.spawn(async move {
            work.await;
            let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
            s.running = false;
            s.last = Some(Instant::now());
        });
    }
}

impl Collector for OnScrape {
    fn desc(&self) -> Vec<&Desc> {
        self.gauges.iter().flat_map(|g| g.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.refresh_if_due();
        self.gauges.iter().flat_map(|g| g.collect()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_count_each_event_under_its_biz_type_until_taken() {
        let m = Metrics::new();
        for (biz, stat) in [
            ("order", Stat::Issued),
            ("order", Stat::Consumed),
            ("refund", Stat::Duplicate),
            ("order", Stat::Consumed),
            ("refund", Stat::Expired),
            ("refund", Stat::Invalid),
        ] {
            m.stat(biz, stat);
        }
        let taken = m.take_stats();
        assert_eq!(
            taken.get("order"),
            Some(&StatCounts {
                issued: 1,
                consumed: 2,
                ..StatCounts::default()
            })
        );
        assert_eq!(
            taken.get("refund"),
            Some(&StatCounts {
                duplicates: 1,
                expired: 1,
                invalid: 1,
                ..StatCounts::default()
            })
        );
        assert_eq!(taken.len(), 2);
        assert!(m.take_stats().is_empty());
    }
}
