//! Reading a `/metrics` text: one sample by name and labels, and the counts
//! the fleet and batching tests compare before and after.

/// The value of the first sample of `name` carrying every `labels` pair.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (n, rest) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let all = labels
                .iter()
                .all(|(k, v)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            all.then(|| value.parse().ok()).flatten()
        })
}

/// `ledger_fast_tier_total{result="error"}`: the serving path's failed Redis calls.
pub fn serving_errors(text: &str) -> Option<f64> {
    sample(text, "ledger_fast_tier_total", &[("result", "error")])
}

/// How many Redis calls of `op` were timed (`ledger_tier_duration_seconds_count`).
pub fn redis_calls(text: &str, op: &str) -> f64 {
    sample(
        text,
        "ledger_tier_duration_seconds_count",
        &[("tier", "redis"), ("op", op)],
    )
    .unwrap_or(0.0)
}
