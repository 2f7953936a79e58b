//! Issuance marks: how far each lease's tokens are known to Postgres.
//!
//! A lease is one holding of a worker id ([`crate::issuance::lease`]): its ids carry
//! that worker id and a millisecond above the lease's `from_ms`, so the
//! leases of one worker id split its ids by time. Each lease has a row in
//! `issuance_marks` (migration V8) whose `mark_ms` says: every token this
//! lease made with a millisecond at or below the mark has its issuance
//! record committed in Postgres (and its id notified to the fleet).
//!
//! - **Issuer** ([`LeaseIds`]): every id is *outstanding* from the moment it
//!   is made until its record commits (or the issue is abandoned before the
//!   answer). The mark written with a batch of records is the millisecond
//!   just below the oldest id still outstanding besides the batch; with none
//!   left it is the present, sealed ([`crate::token::IdGenerator::seal`]) so
//!   that no later id can carry it. The batch statement raises the mark in
//!   the same statement that inserts the records, and notifies the ids
//!   first and the mark after them ([`crate::durable::marks`]). A lease that
//!   ends cleanly, with nothing outstanding, is marked [`ENDED`].
//! - **Peers** ([`MarkBook`]): the filter ([`crate::issuance::filter`]) refuses an id it
//!   does not know only when the id's millisecond is at or below the mark of
//!   the lease it belongs to; above the mark its record may still be on its
//!   way (a slow link, a backed-up writer, an issuer killed before its flush)
//!   and the tiers decide (the tag verified already). A killed holder's
//!   unflushed tokens sit above its last mark; the next holder of the worker
//!   id gets a lease of its own whose ids start above them, so they stay
//!   accepted.
//! - **Worker ids with no lease known.** An id whose worker id has no lease
//!   covering its millisecond is refused when it is older than the last full
//!   read of the marks (minus the grace): a lease taken since then starts
//!   after that read.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Mutex;

use uuid::Uuid;

pub use crate::durable::marks::{LeaseKey, Mark, ENDED};
use crate::token::{IdGenerator, SnowflakeId};

#[derive(Debug, Default)]
struct Outstanding {
    ids: BTreeSet<u64>,
    /// No more ids: the lease was replaced or the process is stopping.
    closed: bool,
}

/// The issuer's side of one lease: its id generator and the ids whose
/// records have not committed yet.
#[derive(Debug)]
pub struct LeaseIds {
    key: LeaseKey,
    holder: Uuid,
    ids: IdGenerator,
    /// Taken around making an id, so that a mark never overlooks an id
    /// being made.
    outstanding: Mutex<Outstanding>,
}

impl LeaseIds {
    /// Ids of `worker_id` above `from_ms`.
    pub fn new(worker_id: u16, from_ms: i64, holder: Uuid) -> LeaseIds {
        LeaseIds {
            key: LeaseKey { worker_id, from_ms },
            holder,
            ids: IdGenerator::new(worker_id, from_ms),
            outstanding: Mutex::new(Outstanding::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Outstanding> {
        // A poisoned lock only means a panic elsewhere; the set stays valid.
        self.outstanding.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn key(&self) -> LeaseKey {
        self.key
    }
    pub fn holder(&self) -> Uuid {
        self.holder
    }
    pub fn worker(&self) -> u16 {
        self.key.worker_id
    }
    /// The highest millisecond used so far.
    pub fn high_water_ms(&self) -> i64 {
        self.ids.high_water_ms()
    }

    /// Makes an id, outstanding until [`LeaseIds::committed`] or
    /// [`LeaseIds::abandon`]; `None` once the lease is closed.
    pub fn allocate(&self, now_ms: i64) -> Option<SnowflakeId> {
        let mut out = self.lock();
        if out.closed {
            return None;
        }
        let id = self.ids.next(now_ms);
        out.ids.insert(id.0);
        Some(id)
    }

    /// The token of `id` was not issued after all (its record was never
    /// queued): it no longer holds the mark back.
    pub fn abandon(&self, id: SnowflakeId) {
        self.lock().ids.remove(&id.0);
    }

    /// The records of `ids` committed.
    pub fn committed(&self, ids: impl IntoIterator<Item = u64>) {
        let mut out = self.lock();
        for id in ids {
            out.ids.remove(&id);
        }
    }

    /// Ids made and not committed yet.
    pub fn outstanding(&self) -> usize {
        self.lock().ids.len()
    }

    /// The mark to write in the statement that commits the records of
    /// `batch`: just below the oldest other outstanding id, or, with none,
    /// the present (sealed, so that no id made later carries it).
    pub fn mark_with(&self, batch: &HashSet<u64>, now_ms: i64) -> i64 {
        let out = self.lock();
        match out.ids.iter().find(|id| !batch.contains(id)) {
            Some(&oldest) => SnowflakeId(oldest).timestamp_ms() - 1,
            None => self.ids.seal(now_ms),
        }
    }

    /// Closes the lease for good when nothing is outstanding: `true` when
    /// it is closed (from now on [`ENDED`] is a true mark for it).
    pub fn close_if_drained(&self) -> bool {
        let mut out = self.lock();
        if out.ids.is_empty() {
            out.closed = true;
        }
        out.closed && out.ids.is_empty()
    }
}

/// What the marks say about an id the filter does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkSays {
    /// At or below its lease's mark: its record would be known. Never issued.
    Recorded,
    /// Above its lease's mark: its record may still be on its way.
    Pending,
    /// No lease known for it, and none can have started since the last full
    /// read: never issued.
    NoLease,
    /// No lease known for it, but one may have started since the last full
    /// read (or none was read yet).
    Unknown,
}

/// A peer's view of every lease's mark.
#[derive(Debug, Default)]
pub struct MarkBook {
    /// Worker id, then the lease's `from_ms`, then its mark.
    leases: HashMap<u16, BTreeMap<i64, i64>>,
    /// When (our clock, taken before the query) the last full read started.
    read_at_ms: Option<i64>,
}

impl MarkBook {
    /// Raises a lease's mark (a lower one changes nothing); `true` when it
    /// changed what we knew.
    pub fn raise(&mut self, mark: Mark) -> bool {
        let entry = self
            .leases
            .entry(mark.lease.worker_id)
            .or_default()
            .entry(mark.lease.from_ms)
            .or_insert(i64::MIN);
        if mark.mark_ms > *entry {
            *entry = mark.mark_ms;
            true
        } else {
            false
        }
    }

    /// What we know of a lease's mark.
    pub fn mark_of(&self, lease: LeaseKey) -> Option<i64> {
        self.leases
            .get(&lease.worker_id)
            .and_then(|l| l.get(&lease.from_ms))
            .copied()
    }

    /// A full read of the marks started at `at_ms` (our clock) and has been
    /// applied.
    pub fn read_at(&mut self, at_ms: i64) {
        self.read_at_ms = Some(self.read_at_ms.map_or(at_ms, |r| r.max(at_ms)));
    }

    /// The milliseconds whose ids a full read tells us are recorded while we
    /// did not know it: `(after, up_to)` over every mark in `rows` that is
    /// above what we know. Their ids must be loaded before the marks apply.
    pub fn behind(&self, rows: &[Mark]) -> Option<(i64, i64)> {
        let mut range: Option<(i64, i64)> = None;
        for row in rows {
            let known = self
                .mark_of(row.lease)
                .unwrap_or(row.lease.from_ms)
                .max(row.lease.from_ms);
            if row.mark_ms > known {
                let (lo, hi) = range.get_or_insert((known, row.mark_ms));
                *lo = (*lo).min(known);
                *hi = (*hi).max(row.mark_ms);
            }
        }
        range
    }

    /// What the marks say about `id`, refusing ids of unknown leases older
    /// than the last full read minus `grace_ms`.
    pub fn says(&self, id: SnowflakeId, grace_ms: i64) -> MarkSays {
        let ts = id.timestamp_ms();
        let lease = self
            .leases
            .get(&id.worker())
            .and_then(|l| l.range(..ts).next_back());
        match (lease, self.read_at_ms) {
            (Some((_, &mark)), _) if ts <= mark => MarkSays::Recorded,
            (Some(_), _) => MarkSays::Pending,
            (None, Some(read)) if ts <= read.saturating_sub(grace_ms) => MarkSays::NoLease,
            (None, _) => MarkSays::Unknown,
        }
    }

    /// Forgets leases whose ids are all older than `oldest_ms` (a later
    /// lease of the same worker id starts before it).
    pub fn prune(&mut self, oldest_ms: i64) {
        for leases in self.leases.values_mut() {
            let keep_from = leases.range(..oldest_ms).next_back().map(|(f, _)| *f);
            if let Some(f) = keep_from {
                leases.retain(|from, _| *from >= f);
            }
        }
    }

    /// Leases known (tests and logs).
    pub fn leases(&self) -> usize {
        self.leases.values().map(BTreeMap::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::snowflake::EPOCH_MS;

    const T: i64 = EPOCH_MS + 1_000_000_000;

    fn lease(worker_id: u16, from_ms: i64) -> LeaseKey {
        LeaseKey { worker_id, from_ms }
    }

    #[test]
    fn the_mark_stays_below_every_outstanding_id() {
        let l = LeaseIds::new(4, T - 1_000, Uuid::nil());
        let a = l.allocate(T).unwrap();
        let b = l.allocate(T + 10).unwrap();
        let c = l.allocate(T + 20).unwrap();
        assert_eq!(l.outstanding(), 3);
        // The batch holds a and b; c is still queued: just below c.
        let batch: HashSet<u64> = [a.0, b.0].into();
        assert_eq!(l.mark_with(&batch, T + 30), T + 19);
        l.committed(batch);
        // c's batch, nothing else outstanding: the present, sealed.
        let batch: HashSet<u64> = [c.0].into();
        assert_eq!(l.mark_with(&batch, T + 30), T + 30);
        l.committed(batch);
        // An id made right after the seal is above the mark.
        let d = l.allocate(T + 30).unwrap();
        assert!(d.timestamp_ms() > T + 30);
        // Abandoned: no longer holds the mark back.
        l.abandon(d);
        assert_eq!(l.mark_with(&HashSet::new(), T + 40), T + 40);
        // Closed only when drained; then no more ids.
        let e = l.allocate(T + 50).unwrap();
        assert!(!l.close_if_drained());
        l.committed([e.0]);
        assert!(l.close_if_drained());
        assert!(l.allocate(T + 60).is_none());
    }

    #[test]
    fn marks_refuse_only_what_is_recorded() {
        let mut book = MarkBook::default();
        // Nothing read yet: unknown leases are not refused.
        assert_eq!(
            book.says(SnowflakeId::from_parts(T - 60_000, 3, 0), 2_000),
            MarkSays::Unknown
        );
        // Worker 3: a lease from T - 100 s whose holder died with mark T - 50 s,
        // then a lease from T - 40 s with mark T - 5 s.
        book.raise(Mark {
            lease: lease(3, T - 100_000),
            mark_ms: T - 50_000,
        });
        book.raise(Mark {
            lease: lease(3, T - 40_000),
            mark_ms: T - 5_000,
        });
        book.read_at(T);
        fn says_of(book: &MarkBook, ms: i64, w: u16) -> MarkSays {
            book.says(SnowflakeId::from_parts(ms, w, 7), 2_000)
        }
        let says = |ms, w| says_of(&book, ms, w);
        assert_eq!(says(T - 60_000, 3), MarkSays::Recorded);
        // The dead holder's unflushed tokens: above its mark, below the next lease.
        assert_eq!(says(T - 45_000, 3), MarkSays::Pending);
        assert_eq!(says(T - 40_000, 3), MarkSays::Pending);
        assert_eq!(says(T - 20_000, 3), MarkSays::Recorded);
        assert_eq!(says(T - 5_000, 3), MarkSays::Recorded);
        assert_eq!(says(T - 4_999, 3), MarkSays::Pending);
        // Before any lease of worker 3, and another worker id never leased.
        assert_eq!(says(T - 200_000, 3), MarkSays::NoLease);
        assert_eq!(says(T - 60_000, 9), MarkSays::NoLease);
        // ...but not within the grace of the last read: a lease may be new.
        assert_eq!(says(T - 1_000, 9), MarkSays::Unknown);
        // Marks never go down.
        assert!(!book.raise(Mark {
            lease: lease(3, T - 40_000),
            mark_ms: T - 30_000,
        }));
        assert_eq!(says_of(&book, T - 20_000, 3), MarkSays::Recorded);
        // An ended lease refuses every unknown id of its range.
        book.raise(Mark {
            lease: lease(3, T - 40_000),
            mark_ms: ENDED,
        });
        assert_eq!(says_of(&book, T + 100_000, 3), MarkSays::Recorded);
    }

    #[test]
    fn a_full_read_names_the_ids_to_load_first() {
        let mut book = MarkBook::default();
        book.raise(Mark {
            lease: lease(1, T - 10_000),
            mark_ms: T - 5_000,
        });
        let rows = [
            // Known at the same mark: nothing to load.
            Mark {
                lease: lease(1, T - 10_000),
                mark_ms: T - 5_000,
            },
            // A lease we never heard of: from its start.
            Mark {
                lease: lease(2, T - 3_000),
                mark_ms: T - 1_000,
            },
        ];
        assert_eq!(book.behind(&rows), Some((T - 3_000, T - 1_000)));
        let rows = [Mark {
            lease: lease(1, T - 10_000),
            mark_ms: T - 2_000,
        }];
        assert_eq!(book.behind(&rows), Some((T - 5_000, T - 2_000)));
        assert_eq!(book.behind(&rows[..0]), None);
    }

    #[test]
    fn old_leases_are_forgotten_once_a_later_one_covers_the_horizon() {
        let mut book = MarkBook::default();
        for from in [T - 300_000, T - 200_000, T - 100_000] {
            book.raise(Mark {
                lease: lease(5, from),
                mark_ms: from + 50_000,
            });
        }
        book.prune(T - 150_000);
        // The lease from T - 200 s still covers ids after T - 150 s.
        assert_eq!(book.leases(), 2);
        assert!(book.mark_of(lease(5, T - 300_000)).is_none());
    }
}
