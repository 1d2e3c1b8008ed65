//! Who holds each socket: reference counts across attachments, fork tickets, and which holder
//! a socket's arrivals go to.
//!
//! Layer: stack (server side, no I/O). A kernel socket lives while any process holds a
//! descriptor of it; `fork` gives the child one more. Here a socket (a handle) is held by the
//! clients (attachments) that opened or adopted it, and by fork tickets: a client about to fork
//! asks for a ticket, which holds one more reference to each of its sockets until the child,
//! attached anew, claims it with the ticket's secret, or the child ends without claiming it.
//!
//! Invariants (checked by [`Shares::invariants`] and a model test): a handle is known exactly
//! while some client or ticket holds it, and is reported freed exactly once, when the last
//! reference goes; a client holds a handle at most once; a handle's reader, if any, is one of
//! its holders; a ticket lists only live handles; a handle with a client holder has a reader.

use std::collections::{HashMap, VecDeque};

/// A client (attachment) id.
pub(crate) type ClientId = u32;
/// A socket handle.
pub(crate) type HandleId = u32;

#[derive(Debug, Default)]
struct Share {
    /// Clients holding the handle, each once, in the order they came.
    holders: Vec<ClientId>,
    /// References held by unclaimed tickets.
    tickets: u32,
    /// Where arrivals go: data, datagrams, a sole holder's new connections.
    reader: Option<ClientId>,
    /// Clients waiting for one of a shared listener's connections, oldest first.
    wants: VecDeque<ClientId>,
}

/// A fork's reserved references.
#[derive(Debug)]
struct Ticket {
    creator: ClientId,
    /// The child, once the parent reported it.
    pid: Option<u32>,
    handles: Vec<HandleId>,
    /// Handles that ended while the ticket held them, with the errno they ended with (0: an
    /// orderly close): the claimer hears of their end (and never of another socket that took
    /// the number since).
    ended: Vec<(HandleId, i32)>,
}

/// What a claimed ticket gives its claimer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claimed {
    /// The handles it holds from now on.
    pub(crate) handles: Vec<HandleId>,
    /// Those that ended meanwhile, with the errno they ended with (0: an orderly close).
    pub(crate) ended: Vec<(HandleId, i32)>,
}

/// Why a ticket was not claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// No ticket has this secret (never made, claimed already, or released).
    NoTicket,
    /// The ticket's child is another process.
    WrongProcess,
}

/// The holders of every handle, and the fork tickets.
#[derive(Debug, Default)]
pub(crate) struct Shares {
    handles: HashMap<HandleId, Share>,
    tickets: HashMap<u64, Ticket>,
}

impl Shares {
    /// A new handle held by `client` alone.
    pub(crate) fn open(&mut self, h: HandleId, client: ClientId) {
        let share = Share { holders: vec![client], reader: Some(client), ..Share::default() };
        self.handles.insert(h, share);
    }

    /// Whether `client` holds `h`.
    pub(crate) fn holds(&self, h: HandleId, client: ClientId) -> bool {
        self.handles.get(&h).is_some_and(|s| s.holders.contains(&client))
    }

    /// Where `h`'s arrivals go now.
    pub(crate) fn reader(&self, h: HandleId) -> Option<ClientId> {
        self.handles.get(&h).and_then(|s| s.reader)
    }

    /// The clients holding `h`.
    pub(crate) fn holders(&self, h: HandleId) -> &[ClientId] {
        self.handles.get(&h).map_or(&[], |s| &s.holders)
    }

    /// The handles `client` holds.
    pub(crate) fn held_by(&self, client: ClientId) -> Vec<HandleId> {
        let mut hs: Vec<HandleId> =
            self.handles.iter().filter(|(_, s)| s.holders.contains(&client)).map(|(h, _)| *h).collect();
        hs.sort_unstable();
        hs
    }

    /// `client` waits on `h`: a connection's or UDP socket's arrivals go to it from now on; a
    /// listener owes it one connection (at most one owed per client).
    pub(crate) fn want(&mut self, h: HandleId, client: ClientId, listener: bool) {
        let Some(s) = self.handles.get_mut(&h).filter(|s| s.holders.contains(&client)) else { return };
        if listener {
            if !s.wants.contains(&client) {
                s.wants.push_back(client);
            }
        } else {
            s.reader = Some(client);
        }
    }

    /// Who gets listener `h`'s next connection: the holder that has waited longest for one (its
    /// want is used up). `None`: nobody asked yet, and the connection waits in the backlog, as
    /// in a kernel listener's: a process that opened a listener and forks workers without
    /// accepting itself (nginx's master) takes none.
    pub(crate) fn take_accepter(&mut self, h: HandleId) -> Option<ClientId> {
        self.handles.get_mut(&h)?.wants.pop_front()
    }

    /// The holders of listener `h` that are owed no connection (they have not asked for one).
    pub(crate) fn unasked(&self, h: HandleId) -> Vec<ClientId> {
        self.handles
            .get(&h)
            .map_or_else(Vec::new, |s| s.holders.iter().copied().filter(|c| !s.wants.contains(c)).collect())
    }

    /// A ticket `token` holding one more reference to each of `handles` (which `creator` holds);
    /// `false` if the token is taken.
    pub(crate) fn fork(&mut self, token: u64, creator: ClientId, handles: &[HandleId]) -> bool {
        if self.tickets.contains_key(&token) {
            return false;
        }
        let mut kept = Vec::new();
        for &h in handles {
            if let Some(s) = self.handles.get_mut(&h).filter(|s| s.holders.contains(&creator)) {
                if !kept.contains(&h) {
                    s.tickets += 1;
                    kept.push(h);
                }
            }
        }
        self.tickets.insert(token, Ticket { creator, pid: None, handles: kept, ended: Vec::new() });
        true
    }

    /// The fork of ticket `token` made process `pid` (`None`: it failed, and the ticket goes).
    /// Only the ticket's creator may say so, once; returns the handles freed.
    pub(crate) fn forked(
        &mut self,
        token: u64,
        creator: ClientId,
        pid: Option<u32>,
    ) -> Result<Vec<HandleId>, Refused> {
        match self.tickets.get_mut(&token) {
            Some(t) if t.creator == creator && t.pid.is_none() => match pid {
                Some(pid) => {
                    t.pid = Some(pid);
                    Ok(Vec::new())
                }
                None => Ok(self.release_ticket(token)),
            },
            _ => Err(Refused::NoTicket),
        }
    }

    /// Process `pid`, attached as `client`, claims ticket `token`: it holds each of the ticket's
    /// handles from now on.
    pub(crate) fn claim(&mut self, token: u64, client: ClientId, pid: u32) -> Result<Claimed, Refused> {
        let t = self.tickets.get(&token).ok_or(Refused::NoTicket)?;
        if t.pid.is_some_and(|p| p != pid) {
            return Err(Refused::WrongProcess);
        }
        let t = self.tickets.remove(&token).expect("looked up above");
        for &h in &t.handles {
            // A ticket lists only live handles (`forget` takes ended ones out); were it not so,
            // the server would still not panic over what a client asked.
            let Some(s) = self.handles.get_mut(&h) else { continue };
            s.tickets -= 1;
            if !s.holders.contains(&client) {
                s.holders.push(client);
            }
            s.reader.get_or_insert(client);
        }
        Ok(Claimed { handles: t.handles, ended: t.ended })
    }

    /// The unclaimed tickets whose child is known: (token, pid).
    pub(crate) fn children(&self) -> Vec<(u64, u32)> {
        self.tickets.iter().filter_map(|(&k, t)| t.pid.map(|p| (k, p))).collect()
    }

    /// Drops ticket `token` unclaimed; returns the handles freed.
    pub(crate) fn release_ticket(&mut self, token: u64) -> Vec<HandleId> {
        let Some(t) = self.tickets.remove(&token) else { return Vec::new() };
        let mut freed = Vec::new();
        for h in t.handles {
            let Some(s) = self.handles.get_mut(&h) else { continue };
            s.tickets -= 1;
            if s.holders.is_empty() && s.tickets == 0 {
                self.forget(h, 0);
                freed.push(h);
            }
        }
        freed
    }

    /// `client` lets go of `h`; `true` when that was the last reference (the handle is
    /// forgotten, and the caller frees the socket).
    pub(crate) fn release(&mut self, h: HandleId, client: ClientId) -> bool {
        let Some(s) = self.handles.get_mut(&h) else { return false };
        let Some(at) = s.holders.iter().position(|&c| c == client) else { return false };
        s.holders.remove(at);
        s.wants.retain(|&c| c != client);
        if s.reader == Some(client) {
            s.reader = s.holders.first().copied();
        }
        if s.holders.is_empty() && s.tickets == 0 {
            self.forget(h, 0);
            return true;
        }
        false
    }

    /// `client` went away: it lets go of everything it held, and its tickets whose child is not
    /// known yet go too. Returns the handles freed.
    pub(crate) fn client_gone(&mut self, client: ClientId) -> Vec<HandleId> {
        let mut freed: Vec<HandleId> =
            self.held_by(client).into_iter().filter(|&h| self.release(h, client)).collect();
        let orphans: Vec<u64> = self
            .tickets
            .iter()
            .filter(|(_, t)| t.creator == client && t.pid.is_none())
            .map(|(&k, _)| k)
            .collect();
        for token in orphans {
            freed.extend(self.release_ticket(token));
        }
        freed
    }

    /// The handle ended on its own (the connection closed, `errno` as its holders were told):
    /// every reference goes, and tickets holding it tell their claimer it ended.
    pub(crate) fn forget(&mut self, h: HandleId, errno: i32) {
        self.handles.remove(&h);
        for t in self.tickets.values_mut() {
            if let Some(at) = t.handles.iter().position(|&x| x == h) {
                t.handles.remove(at);
                t.ended.push((h, errno));
            }
        }
    }

    /// Tickets `creator` made whose child it has not reported yet.
    pub(crate) fn unreported(&self, creator: ClientId) -> usize {
        self.tickets.values().filter(|t| t.creator == creator && t.pid.is_none()).count()
    }

    /// Checks the invariants of the module doc; panics with the first broken one.
    #[cfg(test)]
    pub(crate) fn invariants(&self) {
        for (h, s) in &self.handles {
            assert!(!s.holders.is_empty() || s.tickets > 0, "handle {h} is held by nobody");
            let mut sorted = s.holders.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), s.holders.len(), "handle {h} held twice by one client");
            if let Some(r) = s.reader {
                assert!(s.holders.contains(&r), "handle {h}'s reader {r} does not hold it");
            }
            assert!(s.holders.is_empty() || s.reader.is_some(), "handle {h} held and unread");
            let in_tickets = self.tickets.values().filter(|t| t.handles.contains(h)).count();
            assert_eq!(in_tickets, s.tickets as usize, "handle {h}'s ticket count");
            assert!(s.wants.iter().all(|c| s.holders.contains(c)), "handle {h} owes a non-holder");
        }
        for t in self.tickets.values() {
            assert!(t.handles.iter().all(|h| self.handles.contains_key(h)), "a ticket lists a dead handle");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    #[derive(Debug, Clone)]
    enum Op {
        Open(ClientId),
        Fork(ClientId),
        Forked(usize, bool),
        Claim(usize, ClientId),
        Release(HandleId, ClientId),
        Gone(ClientId),
        ChildGone(usize),
        End(HandleId),
        Want(HandleId, ClientId),
        Accept(HandleId),
    }

    fn op() -> impl Strategy<Value = Op> {
        let c = 1u32..5;
        let h = 1u32..12;
        prop_oneof![
            c.clone().prop_map(Op::Open),
            c.clone().prop_map(Op::Fork),
            (0usize..8, any::<bool>()).prop_map(|(t, ok)| Op::Forked(t, ok)),
            (0usize..8, c.clone()).prop_map(|(t, c)| Op::Claim(t, c)),
            (h.clone(), c.clone()).prop_map(|(h, c)| Op::Release(h, c)),
            c.clone().prop_map(Op::Gone),
            (0usize..8).prop_map(Op::ChildGone),
            h.clone().prop_map(Op::End),
            (h.clone(), c).prop_map(|(h, c)| Op::Want(h, c)),
            h.prop_map(Op::Accept),
        ]
    }

    /// The reference model: a multiset of holders per handle, tickets as plain lists.
    #[derive(Default)]
    struct Model {
        held: BTreeMap<HandleId, BTreeSet<ClientId>>,
        tickets: BTreeMap<u64, (ClientId, Option<u32>, BTreeSet<HandleId>)>,
    }

    impl Model {
        fn refs(&self, h: HandleId) -> usize {
            self.held.get(&h).map_or(0, BTreeSet::len)
                + self.tickets.values().filter(|t| t.2.contains(&h)).count()
        }

        fn live(&self) -> BTreeSet<HandleId> {
            self.held.keys().copied().filter(|&h| self.refs(h) > 0).collect()
        }
    }

    proptest! {
        /// Against the model: the same handles live after every step, each freed exactly once,
        /// exactly when its last reference went; the invariants hold throughout.
        #[test]
        fn shares_count_references_like_the_kernel(ops in proptest::collection::vec(op(), 1..120)) {
            let mut s = Shares::default();
            let mut m = Model::default();
            let mut next_h = 1;
            let mut tokens: Vec<u64> = Vec::new();
            let mut freed_all: Vec<HandleId> = Vec::new();
            for op in ops {
                let before = m.live();
                let mut freed = Vec::new();
                match op {
                    Op::Open(c) => {
                        s.open(next_h, c);
                        m.held.insert(next_h, BTreeSet::from([c]));
                        next_h += 1;
                    }
                    Op::Fork(c) => {
                        let token = 1000 + tokens.len() as u64;
                        let hs = s.held_by(c);
                        prop_assert!(s.fork(token, c, &hs));
                        m.tickets.insert(token, (c, None, hs.into_iter().collect()));
                        tokens.push(token);
                    }
                    Op::Forked(i, ok) => {
                        let Some(&token) = tokens.get(i) else { continue };
                        let Some((creator, None, _)) = m.tickets.get(&token).cloned() else { continue };
                        freed = s.forked(token, creator, ok.then_some(7000 + i as u32)).unwrap();
                        prop_assert!(s.forked(token, creator + 1, None).is_err(), "another client's report");
                        if ok {
                            m.tickets.get_mut(&token).unwrap().1 = Some(7000 + i as u32);
                        } else {
                            m.tickets.remove(&token);
                        }
                    }
                    Op::Claim(i, c) => {
                        let Some(&token) = tokens.get(i) else { continue };
                        let pid = 7000 + i as u32;
                        let got = s.claim(token, c, pid);
                        match m.tickets.remove(&token) {
                            Some((_, _, hs)) => {
                                let Claimed { handles, .. } = got.expect("a live ticket is claimed");
                                prop_assert_eq!(handles.iter().copied().collect::<BTreeSet<_>>(), hs.clone());
                                for h in hs {
                                    m.held.get_mut(&h).unwrap().insert(c);
                                }
                            }
                            None => prop_assert_eq!(got, Err(Refused::NoTicket)),
                        }
                        // A second claim of the same ticket is refused.
                        prop_assert_eq!(s.claim(token, c, pid), Err(Refused::NoTicket));
                    }
                    Op::Release(h, c) => {
                        if s.release(h, c) {
                            freed.push(h);
                        }
                        if let Some(set) = m.held.get_mut(&h) {
                            set.remove(&c);
                        }
                    }
                    Op::Gone(c) => {
                        freed = s.client_gone(c);
                        for set in m.held.values_mut() {
                            set.remove(&c);
                        }
                        m.tickets.retain(|_, t| !(t.0 == c && t.1.is_none()));
                    }
                    Op::ChildGone(i) => {
                        let Some(&token) = tokens.get(i) else { continue };
                        freed = s.release_ticket(token);
                        m.tickets.remove(&token);
                    }
                    Op::End(h) => {
                        if !before.contains(&h) {
                            continue;
                        }
                        // The connection closed on its own: the server forgets it and frees it.
                        s.forget(h, 0);
                        freed.push(h);
                        m.held.remove(&h);
                        for t in m.tickets.values_mut() {
                            t.2.remove(&h);
                        }
                    }
                    Op::Want(h, c) => s.want(h, c, h % 2 == 0),
                    Op::Accept(h) => {
                        if let Some(c) = s.take_accepter(h) {
                            prop_assert!(s.holds(h, c), "a connection handed to a non-holder");
                        }
                    }
                }
                let after = m.live();
                m.held.retain(|h, _| after.contains(h));
                let want: Vec<HandleId> = before.difference(&after).copied().collect();
                freed.sort_unstable();
                prop_assert_eq!(&freed, &want);
                for h in &freed {
                    prop_assert!(!freed_all.contains(h), "handle {} freed twice", h);
                    freed_all.push(*h);
                }
                prop_assert_eq!(s.handles.keys().copied().collect::<BTreeSet<_>>(), after);
                s.invariants();
            }
        }
    }

    #[test]
    fn a_shared_listener_hands_each_connection_to_one_waiting_worker() {
        let mut s = Shares::default();
        s.open(1, 10);
        assert_eq!(s.take_accepter(1), None, "a sole holder that has not asked takes none");
        s.want(1, 10, true);
        assert_eq!(s.take_accepter(1), Some(10), "a sole holder takes what it asks for");
        assert!(s.fork(77, 10, &[1]));
        assert_eq!(s.forked(77, 10, Some(500)), Ok(vec![]));
        assert_eq!(s.forked(77, 10, Some(501)), Err(Refused::NoTicket), "reported once");
        assert_eq!(s.claim(77, 11, 501), Err(Refused::WrongProcess));
        assert_eq!(s.claim(77, 11, 500), Ok(Claimed { handles: vec![1], ended: vec![] }));
        assert_eq!(s.take_accepter(1), None, "only a worker that asked gets one");
        s.want(1, 11, true);
        s.want(1, 11, true);
        s.want(1, 10, true);
        assert_eq!(s.take_accepter(1), Some(11));
        assert_eq!(s.take_accepter(1), Some(10));
        assert_eq!(s.take_accepter(1), None);
        assert!(!s.release(1, 10));
        assert!(s.release(1, 11));
        s.invariants();
    }
}
