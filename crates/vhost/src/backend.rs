//! The vhost-user side: a [`VhostUserBackend`] that hands each available descriptor chain of a
//! queue to [`crate::blk::handle_request`].
//!
//! Layer: frontend plumbing over the rust-vmm crates (`vhost-user-backend` runs the protocol and
//! one epoll thread per queue; `virtio-queue` walks the rings and checks every index the guest
//! wrote). One backend value serves one connection; the server makes a fresh one for the next, so
//! nothing a frontend negotiated outlives its connection.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use lanbus_block::BlockDevice;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use crate::blk::{handle_request, BlkStats, DeviceInfo, Segment};

/// Largest queue a frontend may configure.
pub const MAX_QUEUE_SIZE: usize = 1024;
/// Requests of one queue served at once.
pub const IN_FLIGHT: usize = 8;

pub(crate) type Memory = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// Signals the guest that `vring` has used buffers, unless it asked not to be told.
pub(crate) fn signal_guest(vring: &VringRwLock<Memory>, kind: &str) {
    if !matches!(vring.needs_notification(), Ok(false)) {
        if let Err(e) = vring.signal_used_queue() {
            tracing::debug!("{kind}: cannot signal the guest: {e}");
        }
    }
}

/// Takes the next available descriptor chain of `vring`: its head and its buffers. The chain
/// iterator stops at a loop or an out-of-table index; the lengths and addresses are checked
/// against guest memory when used.
pub(crate) fn pop_chain(
    vring: &VringRwLock<Memory>,
    mem: &GuestMemoryLoadGuard<GuestMemoryMmap<()>>,
) -> Option<(u16, Vec<Segment>)> {
    let chain = vring.get_mut().get_queue_mut().pop_descriptor_chain(mem.clone())?;
    let head = chain.head_index();
    Some((
        head,
        chain.map(|d| Segment { addr: d.addr().0, len: d.len(), write: d.is_write_only() }).collect(),
    ))
}

/// The virtio-blk device of one vhost-user connection.
pub(crate) struct BlkBackend {
    dev: Arc<dyn BlockDevice>,
    info: DeviceInfo,
    mem: Memory,
    event_idx: AtomicBool,
    stats: Arc<BlkStats>,
}

impl BlkBackend {
    pub(crate) fn new(
        dev: Arc<dyn BlockDevice>,
        info: DeviceInfo,
        mem: Memory,
        stats: Arc<BlkStats>,
    ) -> Self {
        BlkBackend { dev, info, mem, event_idx: AtomicBool::new(false), stats }
    }

    /// Completes every available request of `vring`; false if the ring is broken (then the
    /// guest's driver has to reset the device). Up to [`IN_FLIGHT`] requests run at once, each
    /// on a thread of its own: a guest's large I/O arrives as several requests (at most
    /// `SEG_MAX` pages each), which the remote drive then serves in parallel rather than one
    /// round trip after another. Completions are published in the order the requests were taken:
    /// when a backend dies, QEMU gives the next one every request from the used index on, which is
    /// then exactly the ones the guest has not seen completed.
    fn process_queue(&self, vring: &VringRwLock<Memory>) -> bool {
        let mem = self.mem.memory();
        loop {
            let mut batch: Vec<(u16, Vec<Segment>)> = Vec::new();
            while batch.len() < IN_FLIGHT {
                let chain = vring.get_mut().get_queue_mut().pop_descriptor_chain(mem.clone());
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                // The chain iterator stops at a loop or an out-of-table index; the lengths and
                // addresses are checked against guest memory when used.
                let segments = chain
                    .map(|d| Segment { addr: d.addr().0, len: d.len(), write: d.is_write_only() })
                    .collect();
                batch.push((head, segments));
            }
            if batch.is_empty() {
                return true;
            }
            let run =
                |segments: &[Segment]| handle_request(&*mem, segments, &*self.dev, &self.info, &self.stats);
            let used: Vec<u32> = match batch.as_slice() {
                [(_, one)] => vec![run(one)],
                many => std::thread::scope(|s| {
                    let running: Vec<_> =
                        many.iter().map(|(_, segments)| s.spawn(|| run(segments))).collect();
                    // A request that panicked completes with nothing written.
                    running.into_iter().map(|t| t.join().unwrap_or(0)).collect()
                }),
            };
            for ((head, _), n) in batch.iter().zip(used) {
                if let Err(e) = vring.add_used(*head, n) {
                    tracing::warn!("vhost-user-blk: cannot complete request {head}: {e}");
                    return false;
                }
            }
            signal_guest(vring, "vhost-user-blk");
        }
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock<Memory>;

    fn num_queues(&self) -> usize {
        usize::from(self.info.queues)
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        self.info.features() | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, features: u64) {
        // Relaxed: shown, not synchronised on.
        self.stats.acked_features.store(features, Ordering::Relaxed);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, enabled: bool) {
        // Relaxed: set while the queues are stopped (feature negotiation), read by their threads
        // after they are started through the same vhost-user handler lock.
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.info.config_slice(offset, size)
    }

    fn update_memory(&self, _mem: Memory) -> io::Result<()> {
        // The handler updates the same `GuestMemoryAtomic` the backend holds.
        Ok(())
    }

    /// One thread per queue: the device's calls block, and queues are independent.
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.info.queues.min(64)).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK) {
            Ok(pair) => Some(pair),
            Err(e) => {
                tracing::warn!("vhost-user-blk: no exit event for a queue thread: {e}");
                None
            }
        }
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        // With one queue per thread the event is 0; anything else is not a queue of ours.
        let Some(vring) = vrings.get(usize::from(device_event)) else { return Ok(()) };
        // Relaxed: see set_event_idx.
        if self.event_idx.load(Ordering::Relaxed) {
            // With EVENT_IDX the guest does not kick for requests made while we work: look again
            // after turning notifications back on (virtio 1.2, 2.7.10).
            loop {
                if vring.disable_notification().is_err() || !self.process_queue(vring) {
                    break;
                }
                match vring.enable_notification() {
                    Ok(true) => continue,
                    _ => break,
                }
            }
        } else {
            self.process_queue(vring);
        }
        Ok(())
    }
}
