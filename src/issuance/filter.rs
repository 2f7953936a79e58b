//! The fleet-wide filter of issued token ids: a token whose tag verifies but
//! that no instance of the fleet issued (signed with a leaked key, say) is
//! refused here, in-process, before any Redis or Postgres round trip.
//!
//! - **What it holds.** The snowflake id of every token issued within the
//!   last `bloom.horizon`, in generations: one per `bloom.generation` window
//!   of the id's own timestamp. Whole generations expire, so the filter never
//!   fills; a generation that receives more than `bloom.capacity` ids grows
//!   another filter instead of degrading.
//! - **How it learns.** This instance inserts its own ids before answering
//!   the issue. The writer's batched issuance statement also sends the ids on
//!   the Postgres channel [`crate::durable::bloom::CHANNEL`] (in the same
//!   statement, so a notification goes out exactly when the records commit);
//!   every instance listens on its own dedicated connection ([`run`]). At
//!   start, and after the listening connection was lost, it loads the ids
//!   from the `tokens` table, after listening again, so nothing falls in
//!   between.
//! - **Issuance marks** ([`crate::issuance::marks`]): every lease publishes how far
//!   its tokens' records are committed, on a second channel after the ids
//!   of the same statement, and the marks are read again every
//!   [`MARK_REREAD`] (the ids a read shows recorded are loaded before its
//!   marks apply).
//! - **What it decides** ([`Verdict`]): a token the filter knows goes on; an
//!   unknown token younger than `bloom.grace` (propagation delay, clock skew)
//!   goes on too; so does a token older than the horizon, and every token
//!   while the filter is not synced (listener down or not loaded yet: fail
//!   open, the tiers still decide). An unknown token above its lease's mark
//!   goes on (its record may be late: a slow Postgres link, a backed-up
//!   writer, an issuer killed before its flush). Everything else (at or
//!   below the mark, from beyond the grace in the future, of a worker id no
//!   lease covers) is `token_invalid`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bloomfilter::Bloom;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::config::{BloomSettings, PostgresSettings};
use crate::durable::{bloom as sql, marks as marks_sql, Pools};
use crate::issuance::marks::{Mark, MarkBook, MarkSays};
use crate::metrics::Metrics;
use crate::token::SnowflakeId;

/// What the filter says about a verified token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Issued by the fleet (or a false positive): the tiers decide.
    Known,
    /// Unknown, but younger than the grace: its issuance may still be on its
    /// way. The tiers decide.
    Young,
    /// Outside what the filter covers (older than the horizon, or the filter
    /// is disabled or not synced): the tiers decide.
    Uncovered,
    /// Unknown, but above its lease's issuance mark: its record has not
    /// committed yet. The tiers decide.
    Unrecorded,
    /// Never issued: refuse without I/O.
    Rejected,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Known => "known",
            Verdict::Young => "young",
            Verdict::Uncovered => "uncovered",
            Verdict::Unrecorded => "unrecorded",
            Verdict::Rejected => "rejected",
        }
    }
}

/// One bloom filter of a generation.
struct Part {
    bloom: Bloom<u64>,
    /// Ids set in it; every set of a bit comes with an increment, under the
    /// write lock.
    items: usize,
    /// Its bits last counted: `(items, ones)` at that moment. A part whose
    /// `items` has not moved since has the same bits, and is not counted
    /// again (only the generations still receiving ids are).
    counted: Mutex<Option<(usize, u64)>>,
}

impl Part {
    fn new(bloom: Bloom<u64>) -> Part {
        Part {
            bloom,
            items: 0,
            counted: Mutex::new(None),
        }
    }

    /// Share of bits set, counted exactly (again only if ids were set since
    /// the last count), and whether this call counted them.
    fn fill_ratio(&self) -> (f64, bool) {
        let bits = self.bloom.len();
        if bits == 0 {
            return (0.0, false);
        }
        let mut counted = self.counted.lock().unwrap_or_else(|p| p.into_inner());
        let (ones, recounted) = match *counted {
            Some((items, ones)) if items == self.items => (ones, false),
            _ => {
                // `as_slice` is a header followed by the bitmap: the bitmap is the tail.
                let slice = self.bloom.as_slice();
                let bytes = usize::try_from(bits / 8)
                    .unwrap_or(slice.len())
                    .min(slice.len());
                let ones = count_ones(&slice[slice.len() - bytes..]);
                *counted = Some((self.items, ones));
                (ones, true)
            }
        };
        (ones as f64 / bits as f64, recounted)
    }
}

/// Bits set in `bytes`, eight bytes at a time.
fn count_ones(bytes: &[u8]) -> u64 {
    let words = bytes.chunks_exact(8);
    let tail: u64 = words
        .remainder()
        .iter()
        .map(|b| u64::from(b.count_ones()))
        .sum();
    words
        .map(|w| {
            let mut word = [0u8; 8];
            word.copy_from_slice(w);
            u64::from(u64::from_ne_bytes(word).count_ones())
        })
        .sum::<u64>()
        + tail
}

/// The ids issued in one window of time.
#[derive(Default)]
struct Generation {
    parts: Vec<Part>,
}

/// The filter. Cheap to check (a read lock and a few hashes); inserts take a
/// short write lock.
pub struct IssuedFilter {
    settings: BloomSettings,
    generation_ms: i64,
    horizon_ms: i64,
    grace_ms: i64,
    /// Generations by window index (`timestamp_ms / generation_ms`).
    generations: RwLock<BTreeMap<i64, Generation>>,
    /// Whether every issuance since `now - horizon` has reached us.
    synced: AtomicBool,
    /// A filter could not be allocated: fail open from then on.
    broken: AtomicBool,
    /// Every lease's issuance mark as far as we know it.
    marks: RwLock<MarkBook>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for IssuedFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedFilter")
            .field("settings", &self.settings)
            .field("synced", &self.is_synced())
            .finish_non_exhaustive()
    }
}

/// How far beyond the grace ahead of this instance's clock a token's id may
/// be stamped and still be taken as real (when a lease we know covers it and
/// its mark is below it): a worker id's new lease starts at most
/// `tokens.worker_lease_ttl` (30 s by default) ahead, and an issuer's clock
/// runs early by seconds, not minutes.
pub const MAX_AHEAD_MS: i64 = 120_000;

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl IssuedFilter {
    pub fn new(settings: BloomSettings, metrics: Arc<Metrics>) -> IssuedFilter {
        IssuedFilter {
            generation_ms: ms(settings.generation).max(1),
            horizon_ms: ms(settings.horizon),
            grace_ms: ms(settings.grace),
            settings,
            generations: RwLock::new(BTreeMap::new()),
            synced: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            marks: RwLock::new(MarkBook::default()),
            metrics,
        }
    }

    pub fn settings(&self) -> &BloomSettings {
        &self.settings
    }

    pub fn is_enabled(&self) -> bool {
        self.settings.enabled
    }

    /// Whether the filter has heard every issuance within the horizon.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    pub fn set_synced(&self, synced: bool) {
        self.synced.store(synced, Ordering::Release);
        self.metrics.bloom_synced.set(i64::from(synced));
    }

    fn window(&self, timestamp_ms: i64) -> i64 {
        timestamp_ms.div_euclid(self.generation_ms)
    }

    /// Records issued ids. Ids older than the horizon are skipped (they are
    /// not covered anyway), and so are ids more than one generation ahead of
    /// our clock (a peer whose clock is that far off).
    pub fn insert_many(&self, ids: impl IntoIterator<Item = u64>, now_ms: i64) {
        if !self.settings.enabled {
            return;
        }
        let oldest = now_ms.saturating_sub(self.horizon_ms);
        let newest = now_ms.saturating_add(self.generation_ms);
        let mut gens = self.generations.write().unwrap_or_else(|p| p.into_inner());
        for id in ids {
            let ts = SnowflakeId(id).timestamp_ms();
            if ts < oldest || ts > newest {
                continue;
            }
            let generation = gens.entry(self.window(ts)).or_default();
            let full = generation
                .parts
                .last()
                .is_none_or(|p| p.items >= self.settings.capacity);
            if full {
                // A scalable bloom filter: a lookup asks every part of the
                // generation, so each extra part gets half the false-positive
                // rate of the one before, and the generation as a whole stays
                // under twice `fp_rate` however many parts it grows.
                let fp_rate = part_fp_rate(self.settings.fp_rate, generation.parts.len());
                match Bloom::new_for_fp_rate(self.settings.capacity, fp_rate) {
                    Ok(bloom) => generation.parts.push(Part::new(bloom)),
                    Err(e) => {
                        if !self.broken.swap(true, Ordering::Relaxed) {
                            tracing::error!(
                                error = e,
                                "bloom filter not allocated; every token goes on to the tiers"
                            );
                        }
                        continue;
                    }
                }
            }
            if let Some(part) = generation.parts.last_mut() {
                part.bloom.set(&id);
                part.items += 1;
            }
        }
    }

    pub fn insert(&self, id: SnowflakeId, now_ms: i64) {
        self.insert_many([id.0], now_ms);
    }

    /// Whether the filter holds `id` (false positives included).
    pub fn contains(&self, id: SnowflakeId) -> bool {
        let gens = self.generations.read().unwrap_or_else(|p| p.into_inner());
        gens.get(&self.window(id.timestamp_ms()))
            .is_some_and(|g| g.parts.iter().any(|p| p.bloom.check(&id.0)))
    }

    /// Decides about a token whose tag verified, and counts the verdict.
    pub fn check(&self, id: SnowflakeId, now_ms: i64) -> Verdict {
        let verdict = self.verdict(id, now_ms);
        self.metrics
            .bloom_checks
            .with_label_values(&[verdict.label()])
            .inc();
        verdict
    }

    fn verdict(&self, id: SnowflakeId, now_ms: i64) -> Verdict {
        if !self.settings.enabled || self.broken.load(Ordering::Relaxed) {
            return Verdict::Uncovered;
        }
        let ts = id.timestamp_ms();
        if ts < now_ms.saturating_sub(self.horizon_ms) {
            return Verdict::Uncovered;
        }
        if self.contains(id) {
            return Verdict::Known;
        }
        // Both ways: a peer whose clock runs a little early makes ids from
        // our future, and its notification may not have arrived yet.
        if (now_ms - ts).abs() <= self.grace_ms {
            return Verdict::Young;
        }
        if !self.is_synced() {
            return Verdict::Uncovered;
        }
        // The marks are asked before the clock: a real id can be ahead of
        // ours by more than the grace (a worker id leased again right after
        // a clean stop starts at its old lease's floor, up to a lease ttl
        // ahead; an issuer's clock may run early). Ahead of the grace, only
        // an id of a lease we know, above its mark, and at most
        // `MAX_AHEAD_MS` ahead goes on.
        let says = self
            .marks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .says(id, self.grace_ms);
        let ahead = ts > now_ms.saturating_add(self.grace_ms);
        match says {
            MarkSays::Recorded | MarkSays::NoLease => Verdict::Rejected,
            MarkSays::Pending if ahead => {
                if ts <= now_ms.saturating_add(self.grace_ms + MAX_AHEAD_MS) {
                    Verdict::Unrecorded
                } else {
                    Verdict::Rejected
                }
            }
            // No lease we know of covers an id from our future.
            MarkSays::Unknown if ahead => Verdict::Rejected,
            MarkSays::Pending | MarkSays::Unknown => Verdict::Unrecorded,
        }
    }

    /// A notified mark (its ids came before it on the same connection).
    pub fn raise_mark(&self, mark: Mark) {
        self.marks
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .raise(mark);
    }

    /// The milliseconds `(after, up_to]` whose ids must be loaded before
    /// `rows` (a full read of the marks) may apply.
    pub fn marks_behind(&self, rows: &[Mark]) -> Option<(i64, i64)> {
        self.marks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .behind(rows)
    }

    /// Applies a full read of the marks that started at `read_at_ms`, once
    /// the ids it shows recorded are in the filter.
    pub fn apply_marks(&self, rows: &[Mark], read_at_ms: i64) {
        let mut book = self.marks.write().unwrap_or_else(|p| p.into_inner());
        for row in rows {
            book.raise(*row);
        }
        book.read_at(read_at_ms);
    }

    /// The marks as we know them (tests and logs).
    pub fn mark_of(&self, lease: crate::issuance::marks::LeaseKey) -> Option<i64> {
        self.marks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .mark_of(lease)
    }

    /// Drops generations wholly older than the horizon and updates the
    /// gauges (fill ratio of the fullest filter, estimated false-positive
    /// rate of the worst generation, ids held). Returns how many filters had
    /// their bits counted: only those that took ids since their last count.
    pub fn maintain(&self, now_ms: i64) -> usize {
        let oldest = self.window(now_ms.saturating_sub(self.horizon_ms));
        self.generations
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|w, _| *w >= oldest);
        self.marks
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .prune(now_ms.saturating_sub(self.horizon_ms));
        // Counting bits takes a moment: under the read lock, so checks go on.
        let gens = self.generations.read().unwrap_or_else(|p| p.into_inner());
        let (mut fill, mut fp, mut items, mut recounted) = (0.0f64, 0.0f64, 0usize, 0usize);
        for generation in gens.values() {
            // A lookup is refused only if no part of its generation matches.
            let mut all_miss = 1.0f64;
            for part in &generation.parts {
                let (f, counted) = part.fill_ratio();
                recounted += usize::from(counted);
                fill = fill.max(f);
                let hashes = i32::try_from(part.bloom.number_of_hash_functions()).unwrap_or(1);
                all_miss *= 1.0 - f.powi(hashes);
                items += part.items;
            }
            fp = fp.max(1.0 - all_miss);
        }
        drop(gens);
        self.metrics.bloom_fill_ratio.set(fill);
        self.metrics.bloom_fp_rate.set(fp);
        self.metrics
            .bloom_tokens
            .set(i64::try_from(items).unwrap_or(i64::MAX));
        recounted
    }

    /// Live generations (tests and logs).
    pub fn generations(&self) -> usize {
        self.generations
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }
}

/// How far back a reload reaches after the listening connection was lost:
/// notifications of records committed while we were not listening are gone,
/// and their ids can be older than the moment of the loss by the writer's lag.
const RELOAD_MARGIN: Duration = Duration::from_secs(300);

/// How often the marks are read again besides their notifications (a
/// backup: a notification is lost with the listening connection).
pub const MARK_REREAD: Duration = Duration::from_secs(5);

/// Reads every lease's mark, loads the ids that the read shows recorded
/// while we did not know it (with `since_ms`: every id from then on, too),
/// then applies the marks: a mark never applies before its ids. Returns how
/// many ids were loaded.
async fn read_marks(
    filter: &IssuedFilter,
    pools: &Pools,
    clock: &dyn Clock,
    since_ms: Option<i64>,
) -> Result<u64, crate::durable::DurableError> {
    let read_at = clock.now_ms();
    let rows = marks_sql::load(&pools.admin).await?;
    let now = clock.now_ms();
    let oldest = now.saturating_sub(filter.horizon_ms);
    let newest = now.saturating_add(filter.generation_ms);
    let insert = |ids: &[i64]| filter.insert_many(ids.iter().map(|&id| id as u64), clock.now_ms());
    let loaded = match (since_ms, filter.marks_behind(&rows)) {
        (Some(since), behind) => {
            let from = behind
                .map_or(since, |(after, _)| since.min(after.saturating_add(1)))
                .max(oldest);
            let from = SnowflakeId::from_parts(from, 0, 0).as_i64();
            sql::load_since(&pools.admin, from, insert).await?
        }
        (None, Some((after, up_to))) => {
            let from = after.saturating_add(1).max(oldest);
            let until = up_to.min(newest).saturating_add(1);
            if from < until {
                sql::load_between(
                    &pools.admin,
                    SnowflakeId::from_parts(from, 0, 0).as_i64(),
                    SnowflakeId::from_parts(until, 0, 0).as_i64(),
                    insert,
                )
                .await?
            } else {
                0
            }
        }
        (None, None) => 0,
    };
    filter.apply_marks(&rows, read_at);
    Ok(loaded)
}

/// Reads the marks again every [`MARK_REREAD`] while the filter is synced
/// (the listener's own load reads them when it (re)connects).
pub async fn reread_marks(
    filter: Arc<IssuedFilter>,
    pools: Pools,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) {
    if !filter.is_enabled() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(MARK_REREAD) => {}
            _ = shutdown.cancelled() => return,
        }
        if !filter.is_synced() {
            continue;
        }
        match read_marks(&filter, &pools, clock.as_ref(), None).await {
            Ok(0) => {}
            Ok(loaded) => tracing::debug!(
                loaded,
                "issuance marks read: ids their notifications had not brought yet"
            ),
            Err(e) => tracing::debug!(error = %e, "issuance marks not read again; next round"),
        }
    }
}

/// Keeps the filter in step with the fleet until `shutdown`: listens on the
/// channel (its own connection, never one of the request pools'), loads the
/// ids within the horizon, then inserts every notified id. When the
/// connection is lost it marks the filter unsynced (fail open), reconnects
/// with backoff, and reloads from a little before the loss. `ready` fires
/// after the first load (or the first failure), so that start-up can wait.
pub async fn run(
    filter: Arc<IssuedFilter>,
    postgres: PostgresSettings,
    pools: Pools,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
    ready: oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    if !filter.is_enabled() {
        if let Some(r) = ready.take() {
            let _ = r.send(());
        }
        return;
    }
    let horizon = filter.settings().horizon;
    let mut since_ms = clock.now_ms() - ms(horizon);
    let mut backoff = Duration::from_millis(250);
    let listen_pool = match sql::listen_pool(&postgres) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "bloom filter cannot listen; every token goes on to the tiers");
            if let Some(r) = ready.take() {
                let _ = r.send(());
            }
            return;
        }
    };
    loop {
        filter.set_synced(false);
        let attempt = async {
            let listener = sql::listen(&listen_pool).await?;
            let loaded = read_marks(&filter, &pools, clock.as_ref(), Some(since_ms)).await?;
            Ok::<_, crate::durable::DurableError>((listener, loaded))
        };
        let outcome = tokio::select! {
            o = attempt => o,
            _ = shutdown.cancelled() => return,
        };
        let mut listener = match outcome {
            Ok((listener, loaded)) => {
                filter.set_synced(true);
                filter.maintain(clock.now_ms());
                tracing::info!(loaded, "bloom filter synced with the fleet");
                backoff = Duration::from_millis(250);
                listener
            }
            Err(e) => {
                tracing::warn!(error = %e, "bloom filter not synced; unknown tokens go on to the tiers meanwhile");
                if let Some(r) = ready.take() {
                    let _ = r.send(());
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.cancelled() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if let Some(r) = ready.take() {
            let _ = r.send(());
        }
        loop {
            let next = tokio::select! {
                n = listener.try_recv() => n,
                _ = shutdown.cancelled() => return,
            };
            match next {
                Ok(Some(note)) if note.channel() == marks_sql::CHANNEL => {
                    match marks_sql::decode(note.payload()) {
                        Some(mark) => filter.raise_mark(mark),
                        None => tracing::warn!("unreadable issuance mark notification ignored"),
                    }
                }
                Ok(Some(note)) => match sql::decode(note.payload()) {
                    Some(ids) => filter.insert_many(ids, clock.now_ms()),
                    None => tracing::warn!("unreadable issuance notification ignored"),
                },
                Ok(None) | Err(_) => {
                    filter.set_synced(false);
                    tracing::warn!("bloom filter lost its listening connection; unknown tokens go on to the tiers until it is back");
                    since_ms =
                        (clock.now_ms() - ms(RELOAD_MARGIN)).max(clock.now_ms() - ms(horizon));
                    break;
                }
            }
        }
    }
}

/// The false-positive rate of the `index`-th filter of a generation:
/// `fp_rate / 2^index`, so the parts together stay below `2 * fp_rate`.
pub fn part_fp_rate(fp_rate: f64, index: usize) -> f64 {
    let halvings = i32::try_from(index.min(40)).unwrap_or(40);
    fp_rate * 0.5f64.powi(halvings)
}

/// Expires generations and refreshes the gauges every few seconds.
pub async fn maintain(
    filter: Arc<IssuedFilter>,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) {
    if !filter.is_enabled() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = shutdown.cancelled() => return,
        }
        filter.maintain(clock.now_ms());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::snowflake::EPOCH_MS;

    fn settings(capacity: usize) -> BloomSettings {
        BloomSettings {
            enabled: true,
            capacity,
            fp_rate: 0.01,
            generation: Duration::from_secs(60),
            horizon: Duration::from_secs(600),
            grace: Duration::from_secs(2),
        }
    }

    const NOW: i64 = EPOCH_MS + 1_000_000_000;

    fn id(ts: i64, seq: u16) -> SnowflakeId {
        SnowflakeId::from_parts(ts, 1, seq)
    }

    #[test]
    fn verdicts() {
        let f = IssuedFilter::new(settings(1000), Arc::new(Metrics::new()));
        let issued = id(NOW - 30_000, 1);
        f.insert(issued, NOW);
        // Not synced: unknown tokens are not refused.
        assert_eq!(f.check(id(NOW - 30_000, 2), NOW), Verdict::Uncovered);
        f.set_synced(true);
        // Synced, marks not read yet: a lease may exist that we do not know.
        assert_eq!(f.check(id(NOW - 30_000, 2), NOW), Verdict::Unrecorded);
        // The marks read: no lease covers worker 1 before now.
        f.apply_marks(&[], NOW);
        assert_eq!(f.check(issued, NOW), Verdict::Known);
        assert_eq!(f.check(id(NOW - 30_000, 2), NOW), Verdict::Rejected);
        // Within the grace, either side of now.
        assert_eq!(f.check(id(NOW - 1_500, 1), NOW), Verdict::Young);
        assert_eq!(f.check(id(NOW + 1_500, 1), NOW), Verdict::Young);
        // Ahead of the grace, of no lease we know: nobody issued it.
        assert_eq!(f.check(id(NOW + 60_000, 1), NOW), Verdict::Rejected);
        // Older than the horizon: the tiers decide.
        assert_eq!(f.check(id(NOW - 700_000, 1), NOW), Verdict::Uncovered);
        // Disabled: never refuses.
        let mut s = settings(1000);
        s.enabled = false;
        let off = IssuedFilter::new(s, Arc::new(Metrics::new()));
        off.set_synced(true);
        assert_eq!(off.check(id(NOW - 30_000, 2), NOW), Verdict::Uncovered);
    }

    #[test]
    fn unknown_ids_are_refused_only_at_or_below_their_leases_mark() {
        use crate::issuance::marks::{LeaseKey, ENDED};
        let f = IssuedFilter::new(settings(1000), Arc::new(Metrics::new()));
        f.set_synced(true);
        let lease = LeaseKey {
            worker_id: 1,
            from_ms: NOW - 120_000,
        };
        // The issuer's records are committed up to 10 s ago.
        f.apply_marks(
            &[Mark {
                lease,
                mark_ms: NOW - 10_000,
            }],
            NOW - 60_000,
        );
        // A real token whose record is late (5 s old, past the grace): on.
        assert_eq!(f.check(id(NOW - 5_000, 1), NOW), Verdict::Unrecorded);
        // A valid tag on an id the fleet never issued, below the mark: refused.
        assert_eq!(f.check(id(NOW - 30_000, 9), NOW), Verdict::Rejected);
        // Before the lease started, no lease covers it: refused.
        assert_eq!(f.check(id(NOW - 130_000, 9), NOW), Verdict::Rejected);
        // The mark rises with the record (its id notified first).
        f.insert(id(NOW - 5_000, 1), NOW);
        f.raise_mark(Mark {
            lease,
            mark_ms: NOW - 3_000,
        });
        assert_eq!(f.check(id(NOW - 5_000, 1), NOW), Verdict::Known);
        assert_eq!(f.check(id(NOW - 5_000, 2), NOW), Verdict::Rejected);
        // A mark below what we know changes nothing.
        f.raise_mark(Mark {
            lease,
            mark_ms: NOW - 20_000,
        });
        assert_eq!(f.check(id(NOW - 5_000, 2), NOW), Verdict::Rejected);
        // A worker id we hear no lease of: refused unless a lease may have
        // started since the last read (within the grace of it).
        let other = SnowflakeId::from_parts(NOW - 65_000, 7, 0);
        assert_eq!(f.check(other, NOW), Verdict::Rejected);
        let recent = SnowflakeId::from_parts(NOW - 59_000, 7, 0);
        let f2 = IssuedFilter::new(settings(1000), Arc::new(Metrics::new()));
        f2.set_synced(true);
        f2.apply_marks(&[], NOW - 60_000);
        assert_eq!(f2.check(recent, NOW), Verdict::Unrecorded);
        // Ahead of our clock by more than the grace, of a lease we know and
        // above its mark: real (a worker id leased again right after a clean
        // stop starts up to a lease ttl ahead; an issuer's clock runs early).
        assert_eq!(f.check(id(NOW + 5_000, 1), NOW), Verdict::Unrecorded);
        assert_eq!(f.check(id(NOW + 60_000, 1), NOW), Verdict::Unrecorded);
        // ...but not further ahead than any lease can be, nor of a worker id
        // no lease we know covers.
        let too_far = NOW + 2_000 + MAX_AHEAD_MS + 1;
        assert_eq!(f.check(id(too_far, 1), NOW), Verdict::Rejected);
        assert_eq!(
            f.check(SnowflakeId::from_parts(NOW + 5_000, 9, 0), NOW),
            Verdict::Rejected
        );
        // A lease ended cleanly: every unknown id of it is refused.
        f.raise_mark(Mark {
            lease,
            mark_ms: ENDED,
        });
        assert_eq!(f.check(id(NOW - 2_500, 3), NOW), Verdict::Rejected);
        // The verdict costs no I/O: it is synchronous, on memory only.
    }

    #[test]
    fn generations_rotate_and_never_fill() {
        let metrics = Arc::new(Metrics::new());
        let f = IssuedFilter::new(settings(1000), metrics.clone());
        f.set_synced(true);
        f.apply_marks(&[], NOW);
        // 5000 ids in one window: the generation grows parts instead of filling.
        let ids: Vec<u64> = (0..5000).map(|i| id(NOW - 10_000, i).0).collect();
        f.insert_many(ids.iter().copied(), NOW);
        assert!(ids.iter().all(|&i| f.contains(SnowflakeId(i))));
        f.maintain(NOW);
        let fill = metrics.bloom_fill_ratio.get();
        assert!(fill > 0.3 && fill < 0.6, "fill {fill}");
        // Five parts at 1 %, 0.5 %, 0.25 %, ...: about 1.9 % together
        // (five parts at 1 % each would be 4.9 %).
        let fp = metrics.bloom_fp_rate.get();
        assert!(fp > 0.012 && fp < 0.025, "estimated fp {fp}");
        assert_eq!(metrics.bloom_tokens.get(), 5000);
        // Unknown ids of the same window are refused but for the false
        // positives: ~78 of 4000 expected (sd ~9); untightened parts would
        // let ~196 through.
        let let_through = (0..4000u16)
            .filter(|s| {
                f.check(SnowflakeId::from_parts(NOW - 10_000, 2, *s), NOW) != Verdict::Rejected
            })
            .count();
        assert!(let_through < 140, "{let_through} of 4000 let through");
        // Past the horizon the generation is dropped and the ids are uncovered.
        let later = NOW + 700_000;
        f.maintain(later);
        assert_eq!(f.generations(), 0);
        assert_eq!(f.check(SnowflakeId(ids[0]), later), Verdict::Uncovered);
        assert_eq!(metrics.bloom_tokens.get(), 0);
    }

    #[test]
    fn a_filter_s_bits_are_counted_again_only_after_it_took_ids() {
        let metrics = Arc::new(Metrics::new());
        let f = IssuedFilter::new(settings(1000), metrics.clone());
        // Two generations: one part in the older, five in the newer.
        f.insert_many((0..500).map(|i| id(NOW - 120_000, i).0), NOW);
        f.insert_many((0..4500).map(|i| id(NOW - 10_000, i).0), NOW);
        assert_eq!(f.maintain(NOW), 6);
        let (fill, fp) = (metrics.bloom_fill_ratio.get(), metrics.bloom_fp_rate.get());
        assert!(fill > 0.3 && fill < 0.6, "fill {fill}");
        // Nothing new: nothing counted, the same gauges.
        assert_eq!(f.maintain(NOW), 0);
        assert_eq!(metrics.bloom_fill_ratio.get(), fill);
        assert_eq!(metrics.bloom_fp_rate.get(), fp);
        // One more id in the older generation: only its part is counted,
        // and the gauges still see the newer generation's fuller parts.
        f.insert(id(NOW - 120_000, 600), NOW);
        assert_eq!(f.maintain(NOW), 1);
        assert_eq!(metrics.bloom_fill_ratio.get(), fill);
        assert_eq!(metrics.bloom_fp_rate.get(), fp);
        // Filling the newer generation's last part is counted, and moves
        // the estimated false-positive rate.
        f.insert_many((4500..5000).map(|i| id(NOW - 10_000, i).0), NOW);
        assert_eq!(f.maintain(NOW), 1);
        assert!(metrics.bloom_fp_rate.get() > fp);
        assert_eq!(metrics.bloom_tokens.get(), 5501);
    }

    proptest::proptest! {
        #[test]
        fn bits_counted_by_words_are_the_bits_counted_by_bytes(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..100),
        ) {
            let by_byte: u64 = bytes.iter().map(|b| u64::from(b.count_ones())).sum();
            proptest::prop_assert_eq!(count_ones(&bytes), by_byte);
        }
    }

    #[test]
    fn memory_per_setting() {
        let mut s = settings(10_000_000);
        let mb = s.bytes_per_filter() as f64 / 1e6;
        assert!((11.5..12.5).contains(&mb), "{mb} MB at 1 %");
        s.fp_rate = 0.001;
        let mb = s.bytes_per_filter() as f64 / 1e6;
        assert!((17.5..18.5).contains(&mb), "{mb} MB at 0.1 %");
        assert_eq!(settings(1000).max_generations(), 12);
        assert!((part_fp_rate(0.01, 0) - 0.01).abs() < 1e-15);
        assert!((part_fp_rate(0.01, 3) - 0.00125).abs() < 1e-15);
        let total: f64 = (0..40).map(|i| part_fp_rate(0.01, i)).sum();
        assert!(total < 0.02);
    }
}
