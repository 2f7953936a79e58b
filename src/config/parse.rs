//! Values as written in the configuration: durations, rates, key ids.

use std::num::NonZeroU32;
use std::time::Duration;

use super::{invalid, ConfigError};

/// Parses `60s`, `10m`, `7d`, `250ms` (humantime).
pub fn parse_duration(key: &str, text: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        invalid(
            key,
            format!("`{text}` is not a duration ({e}); use e.g. 60s, 10m, 7d"),
        )
    })
}

/// Parses `100/s`, `6000/m`, `1000/h`: issues per second, rounded up.
pub(super) fn parse_rate(key: &str, text: &str) -> Result<NonZeroU32, ConfigError> {
    let bad = || {
        invalid(
            key,
            format!("`{text}` is not a rate; use e.g. 100/s or 600/m"),
        )
    };
    let (n, unit) = text.trim().split_once('/').ok_or_else(bad)?;
    let n: u64 = n.trim().parse().map_err(|_| bad())?;
    let per = match unit.trim() {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(bad()),
    };
    let per_second = n.div_ceil(per);
    u32::try_from(per_second)
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(bad)
}

pub(super) fn is_key_id(id: &str) -> bool {
    (1..=16).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}
