//! The TCP socket buffers of the stack server, kept for reuse.
//!
//! Layer: stack (the server's memory). Every connection has a receive and a send buffer of the
//! server's buffer size (512 KiB by default), and every accepted connection is replaced in its
//! listener's backlog by a fresh listening socket. A buffer freshly allocated for each costs
//! the allocator a fill of zeroes and the kernel a zeroed page for each page first touched (a
//! 2 MiB one where the allocator asked for transparent huge pages): with connections of one
//! request each that was most of the server's time. Here each buffer is an anonymous mapping
//! of its own that goes back to a free list when its socket is removed, so a new connection
//! writes into pages that are already there.
//!
//! Invariants: a mapping is lent to at most one socket at a time, and stays in `lent` (alive)
//! until that socket has left the socket set and been dropped. A reused buffer holds what its
//! last connection left there; smoltcp reads only bytes it wrote, so nothing of it reaches
//! another connection.

use std::collections::HashMap;

use lanbus_ring::Region;
use smoltcp::iface::SocketHandle;
use smoltcp::socket::tcp;

/// Buffers kept on the free list at most (the rest are unmapped): with the default size,
/// 128 MiB of address space, of which only the pages connections touched are resident.
const MAX_FREE: usize = 256;

/// Socket buffers of one size, lent to sockets and taken back.
pub(crate) struct BufferPool {
    bytes: usize,
    free: Vec<Region>,
    /// The mappings each socket in the set borrows.
    lent: HashMap<SocketHandle, Vec<Region>>,
}

impl BufferPool {
    /// An empty pool of `bytes`-byte buffers.
    pub(crate) fn new(bytes: usize) -> BufferPool {
        BufferPool { bytes, free: Vec::new(), lent: HashMap::new() }
    }

    /// A buffer for a socket about to be made, and the mapping it lies in (`None` when no
    /// mapping could be made: the buffer is then an ordinary allocation the socket owns).
    ///
    /// # Safety
    ///
    /// The mapping must stay alive, and must not be taken again, until the socket the buffer
    /// goes into is dropped: give it to [`lend`](Self::lend) with the socket's handle, or to
    /// [`recycle`](Self::recycle) once the socket is dropped.
    pub(crate) unsafe fn take(&mut self) -> (tcp::SocketBuffer<'static>, Option<Region>) {
        let region = match self.free.pop() {
            Some(r) => Some(r),
            None => Region::anonymous(self.bytes).ok(),
        };
        match region {
            Some(r) => {
                // SAFETY: the mapping is at least `bytes` long (rounded up to a page), nothing
                // else refers to it (it came off the free list or is new), and the caller keeps
                // it alive and unlent for as long as the socket that borrows it.
                let buf = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), self.bytes) };
                (tcp::SocketBuffer::new(buf), Some(r))
            }
            None => (tcp::SocketBuffer::new(vec![0; self.bytes]), None),
        }
    }

    /// Records that socket `sock`, now in the set, borrows `regions`.
    pub(crate) fn lend(&mut self, sock: SocketHandle, regions: Vec<Region>) {
        if !regions.is_empty() {
            self.lent.insert(sock, regions);
        }
    }

    /// Takes back what socket `sock` borrowed: call it once the socket is removed from the set
    /// and dropped.
    pub(crate) fn give_back(&mut self, sock: SocketHandle) {
        if let Some(regions) = self.lent.remove(&sock) {
            self.recycle(regions);
        }
    }

    /// Puts mappings no socket borrows any more on the free list.
    pub(crate) fn recycle(&mut self, regions: Vec<Region>) {
        for r in regions {
            if self.free.len() < MAX_FREE {
                self.free.push(r);
            }
        }
    }

    /// Buffers on the free list.
    #[cfg(test)]
    pub(crate) fn free_buffers(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smoltcp::iface::SocketSet;

    #[test]
    fn a_removed_sockets_buffers_serve_the_next() {
        let mut pool = BufferPool::new(8192);
        let mut set = SocketSet::new(Vec::new());
        // SAFETY: the regions are lent with the socket's handle and given back after it is
        // removed and dropped.
        let ((rx, a), (tx, b)) = unsafe { (pool.take(), pool.take()) };
        let first = (a.as_ref().unwrap().as_ptr(), b.as_ref().unwrap().as_ptr());
        let h = set.add(tcp::Socket::new(rx, tx));
        pool.lend(h, a.into_iter().chain(b).collect());
        assert_eq!(pool.free_buffers(), 0);
        drop(set.remove(h));
        pool.give_back(h);
        assert_eq!(pool.free_buffers(), 2);
        // SAFETY: the buffers are dropped before their regions.
        let ((rx, c), (tx, d)) = unsafe { (pool.take(), pool.take()) };
        drop((rx, tx));
        let again = [c.as_ref().unwrap().as_ptr(), d.as_ref().unwrap().as_ptr()];
        assert!(again.contains(&first.0) && again.contains(&first.1));
        assert_eq!(pool.free_buffers(), 0);
    }
}
