//! Transaction tags for non-posted requests, with a completion timeout.
//!
//! Layer: pcie engine, requester side; sans-IO (time comes in as `now`). Implements PCIe Base
//! Specification 2.2.6.2 (a tag identifies one outstanding non-posted request of a requester;
//! 10-bit tags give 1024) and 2.8 (completion timeout).
//!
//! Invariants: a tag is outstanding at most once; freed tags are reused oldest-first, so a late
//! completion is unlikely to meet a fresh request with its tag; a completion for a tag that is
//! not outstanding (unexpected, or already timed out) is reported as such, never accepted; the
//! expired tags come out of [`TagAllocator::poll_expired`] in deadline order and are free again.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use lanbus_wire::time::Instant;

use crate::tlp::Tag;

/// Allocates tags and tracks their completion deadlines.
///
/// Call order: [`allocate`](Self::allocate) when sending a non-posted request,
/// [`complete`](Self::complete) when its last completion arrives, and whenever `now` reaches
/// [`poll_timeout`](Self::poll_timeout), drain [`poll_expired`](Self::poll_expired) and fail
/// those requests. `now` must never go backwards.
#[derive(Debug, Clone)]
pub struct TagAllocator {
    timeout: Duration,
    /// Per tag: the deadline while outstanding, with a generation to spot stale heap entries.
    slots: Vec<(Option<Instant>, u32)>,
    free: VecDeque<u16>,
    /// Deadlines, earliest first: (deadline, tag, generation). Entries whose generation no
    /// longer matches the slot are stale and skipped.
    deadlines: BinaryHeap<Reverse<(Instant, u16, u32)>>,
}

impl TagAllocator {
    /// An allocator over tags `0..count` (`count` at most 1024; 256 for 8-bit tags, 32 for
    /// 5-bit), each completing within `timeout` or expiring.
    pub fn new(count: u16, timeout: Duration) -> TagAllocator {
        let count = count.clamp(1, Tag::COUNT);
        TagAllocator {
            timeout,
            slots: vec![(None, 0); usize::from(count)],
            free: (0..count).collect(),
            deadlines: BinaryHeap::new(),
        }
    }

    /// Tags in flight.
    pub fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether `tag` is in flight.
    pub fn is_outstanding(&self, tag: Tag) -> bool {
        self.slots.get(usize::from(tag.get())).is_some_and(|s| s.0.is_some())
    }

    /// A free tag for a request sent at `now`, or `None` if all are in flight.
    pub fn allocate(&mut self, now: Instant) -> Option<Tag> {
        let t = self.free.pop_front()?;
        let deadline = now + self.timeout;
        let slot = &mut self.slots[usize::from(t)];
        slot.0 = Some(deadline);
        slot.1 = slot.1.wrapping_add(1);
        self.deadlines.push(Reverse((deadline, t, slot.1)));
        Tag::new(t)
    }

    /// Frees `tag` because its request completed. Returns false (and changes nothing) if the
    /// tag is not outstanding: the completion is unexpected.
    pub fn complete(&mut self, tag: Tag) -> bool {
        let Some(slot) = self.slots.get_mut(usize::from(tag.get())) else {
            return false;
        };
        if slot.0.take().is_none() {
            return false;
        }
        self.free.push_back(tag.get());
        true
    }

    /// The earliest deadline of a tag in flight.
    #[must_use]
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.drop_stale();
        self.deadlines.peek().map(|Reverse((d, _, _))| *d)
    }

    /// One tag whose deadline is at or before `now`, now free again; `None` when there is none.
    #[must_use]
    pub fn poll_expired(&mut self, now: Instant) -> Option<Tag> {
        self.drop_stale();
        let Reverse((d, t, _)) = *self.deadlines.peek()?;
        if d > now {
            return None;
        }
        self.deadlines.pop();
        self.slots[usize::from(t)].0 = None;
        self.free.push_back(t);
        Tag::new(t)
    }

    fn drop_stale(&mut self) {
        while let Some(Reverse((d, t, g))) = self.deadlines.peek() {
            let slot = self.slots[usize::from(*t)];
            if slot.0 == Some(*d) && slot.1 == *g {
                break;
            }
            self.deadlines.pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn allocate_complete_expire() {
        let ms = |n: u64| Instant::from_nanos(n * 1_000_000);
        let mut a = TagAllocator::new(4, Duration::from_millis(10));
        let t: Vec<Tag> = (0..4).map(|i| a.allocate(ms(i)).unwrap()).collect();
        assert_eq!(a.allocate(ms(4)), None);
        assert_eq!(a.outstanding(), 4);
        assert!(a.complete(t[1]));
        assert!(!a.complete(t[1]), "a second completion is unexpected");
        assert!(!a.complete(Tag::new(900).unwrap()));
        assert_eq!(a.poll_timeout(), Some(ms(10)));
        assert_eq!(a.poll_expired(ms(9)), None);
        assert_eq!(a.poll_expired(ms(12)), Some(t[0]));
        assert_eq!(a.poll_expired(ms(12)), Some(t[2]));
        assert_eq!(a.poll_expired(ms(12)), None);
        assert_eq!(a.poll_timeout(), Some(ms(13)));
        assert!(!a.complete(t[0]), "a completion after the timeout is unexpected");
        // Reuse is oldest-freed first.
        assert_eq!(a.allocate(ms(20)), Some(t[1]));
        assert_eq!(a.allocate(ms(20)), Some(t[0]));
        // Deadline order; equal deadlines by tag.
        assert_eq!(a.poll_expired(ms(100)), Some(t[3]));
        assert_eq!(a.poll_expired(ms(100)), Some(t[0]));
        assert_eq!(a.poll_expired(ms(100)), Some(t[1]));
        assert_eq!((a.outstanding(), a.poll_timeout()), (0, None));
    }

    // Against a model: a map of outstanding tags to deadlines.
    #[test]
    fn matches_model() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut a = TagAllocator::new(1024, Duration::from_micros(50));
        let mut model = std::collections::BTreeMap::<u16, Instant>::new();
        let mut now = Instant::ZERO;
        for _ in 0..20_000 {
            now += Duration::from_nanos(rng.random_range(0..200));
            match rng.random_range(0..3) {
                0 => {
                    if let Some(t) = a.allocate(now) {
                        assert!(model.insert(t.get(), now + Duration::from_micros(50)).is_none());
                    } else {
                        assert_eq!(model.len(), 1024);
                    }
                }
                1 => {
                    let t = Tag::new(rng.random_range(0..1024)).unwrap();
                    assert_eq!(a.complete(t), model.remove(&t.get()).is_some());
                }
                _ => {
                    while let Some(t) = a.poll_expired(now) {
                        let d = model.remove(&t.get()).expect("expired tag was outstanding");
                        assert!(d <= now);
                    }
                    assert!(model.values().all(|d| *d > now));
                    assert_eq!(a.poll_timeout(), model.values().min().copied());
                }
            }
            assert_eq!(a.outstanding(), model.len());
        }
    }
}
