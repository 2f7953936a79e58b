//! Snowflake ids: 41 bits of milliseconds since 2024-01-01, 10 bits of worker
//! id (leased, see `lease`), 12 bits of sequence. Unique across the fleet while
//! worker ids are; ordered by time; never repeated when the clock steps back.

use std::sync::Mutex;

/// 2024-01-01T00:00:00Z in Unix milliseconds.
pub const EPOCH_MS: i64 = 1_704_067_200_000;
pub const WORKER_BITS: u32 = 10;
pub const SEQUENCE_BITS: u32 = 12;
pub const MAX_WORKER: u16 = (1 << WORKER_BITS) - 1;
const MAX_SEQUENCE: u16 = (1 << SEQUENCE_BITS) - 1;

/// A snowflake id. Always positive as an `i64` (the top bit is zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SnowflakeId(pub u64);

impl SnowflakeId {
    pub fn from_parts(ms: i64, worker: u16, sequence: u16) -> SnowflakeId {
        let t = (ms - EPOCH_MS).max(0) as u64 & ((1 << 41) - 1);
        SnowflakeId(
            (t << (WORKER_BITS + SEQUENCE_BITS))
                | (u64::from(worker & MAX_WORKER) << SEQUENCE_BITS)
                | u64::from(sequence & MAX_SEQUENCE),
        )
    }
    /// Unix milliseconds at which the id was made.
    pub fn timestamp_ms(self) -> i64 {
        (self.0 >> (WORKER_BITS + SEQUENCE_BITS)) as i64 + EPOCH_MS
    }
    pub fn worker(self) -> u16 {
        ((self.0 >> SEQUENCE_BITS) & u64::from(MAX_WORKER)) as u16
    }
    pub fn sequence(self) -> u16 {
        (self.0 & u64::from(MAX_SEQUENCE)) as u16
    }
    pub fn as_i64(self) -> i64 {
        self.0 as i64
    }
}

#[derive(Debug)]
struct State {
    /// The millisecond the last id used; never decreases.
    last_ms: i64,
    sequence: u16,
}

/// Makes ids for one worker id. When the clock steps back, it keeps counting
/// on the last millisecond it used (borrowing the next millisecond when the
/// sequence runs out) instead of waiting or repeating.
#[derive(Debug)]
pub struct IdGenerator {
    worker: u16,
    state: Mutex<State>,
}

impl IdGenerator {
    /// `floor_ms`: no id will carry an earlier millisecond (the high-water mark
    /// the previous holder of this worker id may have reached).
    pub fn new(worker: u16, floor_ms: i64) -> IdGenerator {
        IdGenerator {
            worker: worker & MAX_WORKER,
            state: Mutex::new(State {
                last_ms: floor_ms,
                sequence: MAX_SEQUENCE,
            }),
        }
    }

    pub fn worker(&self) -> u16 {
        self.worker
    }

    /// The highest millisecond used so far.
    pub fn high_water_ms(&self) -> i64 {
        self.state
            .lock()
            .map(|s| s.last_ms)
            .unwrap_or_else(|p| p.into_inner().last_ms)
    }

    /// Closes the milliseconds up to `now_ms` (or up to the last one used,
    /// if later) and returns that millisecond: no id made afterwards carries
    /// it or an earlier one. What an issuance mark needs: the ids below the
    /// returned millisecond are all made already.
    pub fn seal(&self, now_ms: i64) -> i64 {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if now_ms > s.last_ms {
            s.last_ms = now_ms;
        }
        s.sequence = MAX_SEQUENCE;
        s.last_ms
    }

    pub fn next(&self, now_ms: i64) -> SnowflakeId {
        // A poisoned lock only means another thread panicked while holding it;
        // the state is two integers that are always consistent.
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if now_ms > s.last_ms {
            s.last_ms = now_ms;
            s.sequence = 0;
        } else if s.sequence < MAX_SEQUENCE {
            s.sequence += 1;
        } else {
            s.last_ms += 1;
            s.sequence = 0;
        }
        SnowflakeId::from_parts(s.last_ms, self.worker, s.sequence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Arc;

    #[test]
    fn parts_round_trip() {
        let id = SnowflakeId::from_parts(EPOCH_MS + 123_456, 1023, 4095);
        assert_eq!(id.timestamp_ms(), EPOCH_MS + 123_456);
        assert_eq!(id.worker(), 1023);
        assert_eq!(id.sequence(), 4095);
        assert!(id.as_i64() > 0);
    }

    #[test]
    fn clock_stepping_back_never_repeats() {
        let g = IdGenerator::new(7, 0);
        let mut seen = HashSet::new();
        let mut last = SnowflakeId(0);
        let base = EPOCH_MS + 1_000_000;
        for i in 0..20_000i64 {
            // A clock that jumps back by a second every 1000 ids.
            let now = base + (i % 1000) - (i / 1000) * 1000;
            let id = g.next(now);
            assert!(id > last, "ids must increase");
            assert!(seen.insert(id));
            last = id;
        }
    }

    #[test]
    fn a_sealed_millisecond_gets_no_more_ids() {
        let base = EPOCH_MS + 1_000;
        let g = IdGenerator::new(2, 0);
        let first = g.next(base);
        assert_eq!(g.seal(base), base);
        // Same millisecond again: the next id moves on.
        assert!(g.next(base).timestamp_ms() > base);
        // Sealing at a later clock closes everything up to it.
        assert_eq!(g.seal(base + 50), base + 50);
        assert!(g.next(base + 10).timestamp_ms() > base + 50);
        // A clock behind the last id seals the last id's millisecond.
        let last = g.high_water_ms();
        assert_eq!(g.seal(base), last);
        assert!(g.next(base).timestamp_ms() > last);
        assert!(first.timestamp_ms() == base);
    }

    #[test]
    fn floor_is_respected() {
        let g = IdGenerator::new(1, EPOCH_MS + 5_000);
        assert!(g.next(EPOCH_MS + 10).timestamp_ms() >= EPOCH_MS + 5_000);
    }

    #[test]
    fn unique_and_ordered_across_threads() {
        let g = Arc::new(IdGenerator::new(3, 0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let g = g.clone();
                std::thread::spawn(move || {
                    let mut v = Vec::new();
                    for _ in 0..10_000 {
                        v.push(g.next(EPOCH_MS + 42));
                    }
                    v
                })
            })
            .collect();
        let mut all = HashSet::new();
        for h in handles {
            let v = h.join().expect("thread");
            assert!(v.windows(2).all(|w| w[0] < w[1]), "ordered per thread");
            for id in v {
                assert!(all.insert(id), "unique");
            }
        }
        assert_eq!(all.len(), 40_000);
    }
}
