//! Transaction tags for non-posted requests, with a completion timeout and a quarantine.
//!
//! Layer: pcie engine, requester side; sans-IO (time comes in as `now`). Implements PCIe Base
//! Specification 2.2.6.2 (a tag identifies one outstanding non-posted request of a requester;
//! 10-bit tags give 1024) and 2.8 (completion timeout).
//!
//! Invariants: a tag is free, outstanding or quarantined, never two at once. Freed tags are reused
//! oldest-freed first. A tag whose request timed out is quarantined: a completion for it may still
//! be on its way, so it is not handed out again until a quarantine of one more completion timeout
//! has passed or the caller [`release`](TagAllocator::release)s it because the channel that
//! carried the request was reset (nothing sent on it can arrive any more). So a late completion
//! can never be taken for a newer request's. A completion for a tag that is not outstanding
//! (unexpected, timed out or quarantined) is reported as such, never accepted. Expired tags come
//! out of [`TagAllocator::poll_expired`] in deadline order.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use lanbus_wire::time::Instant;

use crate::tlp::Tag;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    /// In flight; its completions are due by the deadline.
    Outstanding(Instant),
    /// Timed out; free again at the instant, or when released.
    Quarantined(Instant),
}

/// Allocates tags and tracks their completion deadlines.
///
/// Call order: [`allocate`](Self::allocate) when sending a non-posted request,
/// [`complete`](Self::complete) when its last completion arrives, and whenever `now` reaches
/// [`poll_timeout`](Self::poll_timeout), drain [`poll_expired`](Self::poll_expired) and fail
/// those requests. `now` must never go backwards.
#[derive(Debug, Clone)]
pub struct TagAllocator {
    timeout: Duration,
    /// Per tag: its state, with a generation to spot stale heap entries.
    slots: Vec<(State, u32)>,
    free: VecDeque<u16>,
    quarantined: usize,
    /// Deadlines and quarantine ends, earliest first: (instant, tag, generation). Entries whose
    /// generation no longer matches the slot are stale and skipped.
    deadlines: BinaryHeap<Reverse<(Instant, u16, u32)>>,
}

impl TagAllocator {
    /// An allocator over tags `0..count` (`count` at most 1024; 256 for 8-bit tags, 32 for
    /// 5-bit), each completing within `timeout` or expiring.
    pub fn new(count: u16, timeout: Duration) -> TagAllocator {
        let count = count.clamp(1, Tag::COUNT);
        TagAllocator {
            timeout,
            slots: vec![(State::Free, 0); usize::from(count)],
            free: (0..count).collect(),
            quarantined: 0,
            deadlines: BinaryHeap::new(),
        }
    }

    /// Tags in flight.
    pub fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len() - self.quarantined
    }

    /// Whether a tag is free now (quarantines that have ended count only once
    /// [`poll_expired`](Self::poll_expired) or [`allocate`](Self::allocate) ended them).
    pub fn has_free(&self) -> bool {
        !self.free.is_empty()
    }

    /// Tags in quarantine.
    pub fn quarantined(&self) -> usize {
        self.quarantined
    }

    /// Whether `tag` is in flight.
    pub fn is_outstanding(&self, tag: Tag) -> bool {
        self.slots.get(usize::from(tag.get())).is_some_and(|s| matches!(s.0, State::Outstanding(_)))
    }

    /// A free tag for a request sent at `now`, or `None` if all are in flight or quarantined.
    pub fn allocate(&mut self, now: Instant) -> Option<Tag> {
        // Completed tags leave their deadlines in the heap; the oldest go here, so a requester
        // that never waits for a timeout does not grow it.
        self.drop_stale();
        self.release_ended(now);
        let t = self.free.pop_front()?;
        let deadline = now + self.timeout;
        self.set(t, State::Outstanding(deadline));
        Tag::new(t)
    }

    fn set(&mut self, t: u16, state: State) {
        let slot = &mut self.slots[usize::from(t)];
        slot.0 = state;
        slot.1 = slot.1.wrapping_add(1);
        if let State::Outstanding(at) | State::Quarantined(at) = state {
            self.deadlines.push(Reverse((at, t, slot.1)));
        }
    }

    /// Frees `tag` because its request completed. Returns false (and changes nothing) if the
    /// tag is not outstanding: the completion is unexpected.
    pub fn complete(&mut self, tag: Tag) -> bool {
        let t = tag.get();
        if !self.is_outstanding(tag) {
            return false;
        }
        self.set(t, State::Free);
        self.free.push_back(t);
        true
    }

    /// Gives up on outstanding `tag` at `now` (its request was abandoned, for example because its
    /// completer is unreachable): it is quarantined as if it had timed out, since a completion
    /// for it may still arrive, until one timeout after its deadline or after `now`, whichever is
    /// later. Returns whether it was outstanding.
    pub fn abandon(&mut self, tag: Tag, now: Instant) -> bool {
        let Some((State::Outstanding(deadline), _)) = self.slots.get(usize::from(tag.get())) else {
            return false;
        };
        let end = now.max(*deadline) + self.timeout;
        self.set(tag.get(), State::Quarantined(end));
        self.quarantined += 1;
        true
    }

    /// Ends the quarantine of `tag` early: the channel that carried its request was reset, so
    /// no completion for it can arrive any more. Returns whether it was quarantined.
    pub fn release(&mut self, tag: Tag) -> bool {
        let t = tag.get();
        let Some((State::Quarantined(_), _)) = self.slots.get(usize::from(t)) else {
            return false;
        };
        self.set(t, State::Free);
        self.quarantined -= 1;
        self.free.push_back(t);
        true
    }

    /// Ends every quarantine (the channel that carried their requests was reset); returns how many
    /// tags were released.
    pub fn release_all(&mut self) -> usize {
        if self.quarantined == 0 {
            return 0;
        }
        let count = self.slots.len() as u16;
        (0..count).filter_map(Tag::new).filter(|t| self.release(*t)).count()
    }

    /// The earliest deadline of a tag in flight, or end of a quarantine.
    #[must_use]
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        self.drop_stale();
        self.deadlines.peek().map(|Reverse((d, _, _))| *d)
    }

    /// One tag whose deadline is at or before `now`, now quarantined; `None` when there is none.
    /// Quarantines that ended by `now` end here too.
    #[must_use]
    pub fn poll_expired(&mut self, now: Instant) -> Option<Tag> {
        loop {
            self.drop_stale();
            let Reverse((d, t, _)) = *self.deadlines.peek()?;
            if d > now {
                return None;
            }
            self.deadlines.pop();
            match self.slots[usize::from(t)].0 {
                State::Outstanding(_) => {
                    self.set(t, State::Quarantined(d + self.timeout));
                    self.quarantined += 1;
                    return Tag::new(t);
                }
                State::Quarantined(_) => {
                    self.set(t, State::Free);
                    self.quarantined -= 1;
                    self.free.push_back(t);
                }
                State::Free => {}
            }
        }
    }

    /// Ends the quarantines that ended by `now` and stand first in deadline order (an expired
    /// outstanding tag ahead of them waits for the caller's `poll_expired`). Only when no tag is
    /// free: otherwise the next `poll_expired` does it.
    fn release_ended(&mut self, now: Instant) {
        if !self.free.is_empty() || self.quarantined == 0 {
            return;
        }
        loop {
            self.drop_stale();
            let Some(&Reverse((d, t, _))) = self.deadlines.peek() else { return };
            if d > now || !matches!(self.slots[usize::from(t)].0, State::Quarantined(_)) {
                return;
            }
            self.deadlines.pop();
            self.set(t, State::Free);
            self.quarantined -= 1;
            self.free.push_back(t);
        }
    }

    fn drop_stale(&mut self) {
        while let Some(Reverse((d, t, g))) = self.deadlines.peek() {
            let slot = self.slots[usize::from(*t)];
            let live = match slot.0 {
                State::Outstanding(at) | State::Quarantined(at) => at == *d,
                State::Free => false,
            };
            if live && slot.1 == *g {
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

    fn ms(n: u64) -> Instant {
        Instant::from_nanos(n * 1_000_000)
    }

    #[test]
    fn allocate_complete_expire_quarantine() {
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
        assert_eq!((a.outstanding(), a.quarantined()), (1, 2));
        assert_eq!(a.poll_timeout(), Some(ms(13)));
        assert!(!a.complete(t[0]), "a completion after the timeout is unexpected");
        // Only the completed tag is free; the timed-out ones sit out one more timeout.
        assert_eq!(a.allocate(ms(12)), Some(t[1]));
        assert_eq!(a.allocate(ms(12)), None);
        assert_eq!(a.poll_expired(ms(13)), Some(t[3]));
        // t[0]'s quarantine ends at 20: then it is the oldest free tag.
        assert_eq!(a.allocate(ms(19)), None);
        assert_eq!(a.allocate(ms(20)), Some(t[0]));
        // A channel reset releases a quarantined tag at once; releasing twice does nothing.
        assert!(a.release(t[2]));
        assert!(!a.release(t[2]));
        assert!(!a.release(t[0]), "an outstanding tag is not released");
        assert_eq!(a.allocate(ms(20)), Some(t[2]));
        // Deadline order.
        assert_eq!(a.poll_expired(ms(100)), Some(t[1]));
        assert_eq!(a.poll_expired(ms(100)), Some(t[0]));
        assert_eq!(a.poll_expired(ms(100)), Some(t[2]));
        assert_eq!(a.poll_expired(ms(100)), None);
        assert_eq!(a.outstanding(), 0);
        // Quarantines end at 32 and 33 (t[1]; t[3] expired at 13): nothing is due after that.
        assert_eq!(a.poll_expired(ms(200)), None);
        assert_eq!((a.quarantined(), a.poll_timeout()), (0, None));
    }

    // Against a model: each tag free, outstanding until a deadline or quarantined until an end.
    #[test]
    fn matches_model() {
        #[derive(Clone, Copy, PartialEq, Debug)]
        enum M {
            Out(Instant),
            Quarantine(Instant),
        }
        let timeout = Duration::from_micros(50);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut a = TagAllocator::new(64, timeout);
        let mut model = std::collections::BTreeMap::<u16, M>::new();
        let mut now = Instant::ZERO;
        for _ in 0..50_000 {
            now += Duration::from_nanos(rng.random_range(0..2000));
            match rng.random_range(0..4) {
                0 => {
                    // Expired tags must be polled before a quarantine behind them can end.
                    let due = model.values().any(|m| matches!(m, M::Out(d) if *d <= now));
                    match a.allocate(now) {
                        Some(t) => {
                            let was = model.insert(t.get(), M::Out(now + timeout));
                            let ended = |m: Option<M>| match m {
                                None => true,
                                Some(M::Quarantine(e)) => e <= now,
                                Some(M::Out(_)) => false,
                            };
                            assert!(ended(was), "{t:?} handed out while {was:?}");
                        }
                        None => assert!(
                            due || model.len() == 64
                                && !model.values().any(|m| matches!(m, M::Quarantine(e) if *e <= now)),
                            "no tag although one is free"
                        ),
                    }
                }
                op @ (1 | 2) => {
                    // A completion frees an outstanding tag; a channel reset a quarantined one.
                    let t = Tag::new(rng.random_range(0..64)).unwrap();
                    let state = model.get(&t.get()).copied();
                    let (done, applies) = if op == 1 {
                        (a.complete(t), matches!(state, Some(M::Out(_))))
                    } else {
                        (a.release(t), matches!(state, Some(M::Quarantine(_))))
                    };
                    assert_eq!(done, applies);
                    if applies {
                        model.remove(&t.get());
                    }
                }
                _ => {
                    while let Some(t) = a.poll_expired(now) {
                        let Some(M::Out(d)) = model.get(&t.get()).copied() else {
                            panic!("{t:?} expired but was not outstanding")
                        };
                        assert!(d <= now);
                        model.insert(t.get(), M::Quarantine(d + timeout));
                    }
                    model.retain(|_, m| !matches!(m, M::Quarantine(e) if *e <= now));
                    assert!(model.values().all(|m| match m {
                        M::Out(d) | M::Quarantine(d) => *d > now,
                    }));
                    let next = model.values().map(|m| match m {
                        M::Out(d) | M::Quarantine(d) => *d,
                    });
                    assert_eq!(a.poll_timeout(), next.min());
                }
            }
            let out = model.values().filter(|m| matches!(m, M::Out(_))).count();
            assert_eq!(a.outstanding(), out);
        }
    }
}
