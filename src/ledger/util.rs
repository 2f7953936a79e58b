//! Small helpers every part of the ledger shares, importing no other part
//! but [`super::api`]: milliseconds to and from times, whether a refusal
//! counts ([`Tally`]) and the counting of a consume outcome.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};

use super::api::ConsumeOutcome;
use crate::domain::BizType;
use crate::metrics::Metrics;

/// The time of `ms` milliseconds since the epoch (`None`: not positive, or
/// out of range).
pub(super) fn ms_to_time(ms: i64) -> Option<DateTime<Utc>> {
    (ms > 0)
        .then(|| Utc.timestamp_millis_opt(ms).single())
        .flatten()
}

/// A duration in whole milliseconds (saturating).
pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Whether a refused token counts as a consume attempt (`ledger_consume_total`
/// and the fleet's stats: consume, result, release) or not at all (a read of
/// its state, an operator's release).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tally {
    Consume,
    Quiet,
}

/// Counts a consume outcome: `ledger_consume_total` and the fleet's stats.
pub(super) fn count_consume(metrics: &Metrics, biz: &BizType, outcome: ConsumeOutcome) {
    metrics
        .consume_total
        .with_label_values(&[biz.as_str(), outcome.as_str()])
        .inc();
    if let Some(s) = outcome.stat() {
        metrics.stat(biz.as_str(), s);
    }
}
