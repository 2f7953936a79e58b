//! Telling that the journal was drained past a moment without ever seeing
//! it empty: [`DrainMarks`] keeps what was true at each read of the journal
//! (the newest entry then) until a later read finds every entry up to it
//! gone. Under steady fast traffic the stream is rarely empty, yet each
//! entry leaves it within a drainer's round.

use std::collections::VecDeque;

use crate::fast::{EntryId, Span};

/// Marks kept at most; past it a new one is not kept (the older ones pass
/// first, and the next read after they pass marks again).
const MAX_MARKS: usize = 1024;

/// Reads of the journal not yet passed: what each stands for (`T`: a
/// moment, a report's time), the newest entry id then, and the fleet's
/// epoch then.
#[derive(Debug)]
pub struct DrainMarks<T> {
    marks: VecDeque<(T, EntryId, i64)>,
}

impl<T> Default for DrainMarks<T> {
    fn default() -> Self {
        DrainMarks {
            marks: VecDeque::new(),
        }
    }
}

impl<T: Copy> DrainMarks<T> {
    /// One read of the journal, taken after `what` with this instance's
    /// backlog empty: `Some(what)` when the journal was empty (drained past
    /// `what` now), else a mark for a later read to pass. Marks of another
    /// epoch are dropped first: an episode may have put another Redis
    /// behind the same dataset id, whose entry ids say nothing of the old
    /// one's.
    pub fn read(&mut self, what: T, span: Span, epoch: i64) -> Option<T> {
        self.marks.retain(|m| m.2 == epoch);
        let passed = self.pass(span.first);
        match span.last {
            None => Some(what),
            Some(last) => {
                if self.marks.len() < MAX_MARKS {
                    self.marks.push_back((what, last, epoch));
                }
                passed
            }
        }
    }

    /// A read that cannot count (Redis foreign, down, or this instance's
    /// backlog not empty) passes the marks it can, marks nothing new.
    pub fn read_without_mark(&mut self, span: Span, epoch: i64) -> Option<T> {
        self.marks.retain(|m| m.2 == epoch);
        self.pass(span.first)
    }

    /// Forgets every mark: Redis was foreign or unreachable, so a later
    /// read may be of another stream.
    pub fn clear(&mut self) {
        self.marks.clear();
    }

    /// The latest mark every entry of which left the stream: the oldest
    /// entry now (`first`) is above its newest then, or the stream is
    /// empty. Marks were pushed in read order, so their ids never go down.
    fn pass(&mut self, first: Option<EntryId>) -> Option<T> {
        let mut out = None;
        while let Some(&(what, last, _)) = self.marks.front() {
            if first.is_some_and(|f| f <= last) {
                break;
            }
            out = Some(what);
            self.marks.pop_front();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ms: u64) -> EntryId {
        EntryId::parse(&format!("{ms}-0")).expect("id")
    }

    fn span(first: Option<u64>, last: Option<u64>) -> Span {
        Span {
            first: first.map(id),
            last: last.map(id),
        }
    }

    #[test]
    fn an_empty_journal_is_drained_at_once() {
        let mut m = DrainMarks::default();
        assert_eq!(m.read(1, span(None, None), 7), Some(1));
    }

    #[test]
    fn a_journal_never_empty_is_drained_past_a_read_once_its_entries_are_gone() {
        let mut m = DrainMarks::default();
        // Entries 10..=20 at the first read, 15..=30 at the second: the
        // first read's entries are not all gone yet.
        assert_eq!(m.read(1, span(Some(10), Some(20)), 7), None);
        assert_eq!(m.read(2, span(Some(15), Some(30)), 7), None);
        // 21..=40: everything up to 20 is gone, not yet up to 30.
        assert_eq!(m.read(3, span(Some(21), Some(40)), 7), Some(1));
        // 41..=50: both later reads passed; the latest counts.
        assert_eq!(m.read(4, span(Some(41), Some(50)), 7), Some(3));
    }

    #[test]
    fn an_entry_still_there_holds_every_mark_above_it() {
        let mut m = DrainMarks::default();
        assert_eq!(m.read(1, span(Some(10), Some(20)), 7), None);
        // The oldest entry is still 10 (a consumer died holding it).
        for t in 2..100 {
            assert_eq!(m.read(t, span(Some(10), Some(20 + t)), 7), None);
        }
        assert_eq!(m.read(100, span(Some(20), Some(200)), 7), None);
        assert_eq!(m.read(101, span(Some(21), Some(201)), 7), Some(1));
    }

    #[test]
    fn marks_of_another_epoch_or_a_foreign_redis_do_not_count() {
        let mut m = DrainMarks::default();
        assert_eq!(m.read(1, span(Some(10), Some(20)), 7), None);
        // An episode later, a Redis whose entries are all newer.
        assert_eq!(m.read(2, span(Some(500), Some(600)), 8), None);
        assert_eq!(m.read_without_mark(span(Some(601), Some(700)), 8), Some(2));
        assert_eq!(m.read(3, span(Some(10), Some(20)), 8), None);
        m.clear();
        assert_eq!(m.read_without_mark(span(None, None), 8), None);
    }
}
