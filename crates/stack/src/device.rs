//! smoltcp's `Device` on a lanbus port.
//!
//! Layer: stack (the link). Received frames are taken from the port a burst at a time and
//! queued; frames smoltcp transmits are queued and leave in bursts when the server flushes (after
//! each poll), so a window of segments costs one system call, not one per segment. Buffers are
//! recycled, so the steady state does not allocate.
//!
//! Invariants: a frame is handed to smoltcp only if it is a whole Ethernet frame within the MTU
//! (the port checks); smoltcp parses everything above that with its checked views and drops what
//! does not parse. Frames the port would not take (it is full) wait in the queue, in order.

use std::collections::VecDeque;

use lanbus_port::Port;
use smoltcp::phy::{self, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

/// Frames pulled from the port per burst.
const RX_BURST: usize = 64;
/// Transmit frames queued before the device flushes on its own.
const TX_FLUSH: usize = 64;

/// Counters of the link.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LinkCounters {
    /// Frames handed to the stack.
    pub rx_frames: u64,
    /// Frames the stack transmitted.
    pub tx_frames: u64,
    /// Port errors (a failed burst).
    pub port_errors: u64,
}

/// The device: a port plus receive and transmit queues.
pub struct PortDevice {
    rx: VecDeque<Vec<u8>>,
    rx_spare: Vec<Vec<u8>>,
    tx: TxSide,
    mtu: usize,
    rx_frames: u64,
}

/// What transmitting borrows: the port, the queue and its spare buffers (apart from the receive
/// queue, so that smoltcp can hold a receive and a transmit token at once).
struct TxSide {
    port: Box<dyn Port>,
    queue: VecDeque<Vec<u8>>,
    spare: Vec<Vec<u8>>,
    frames: u64,
    port_errors: u64,
}

impl TxSide {
    /// Sends every queued frame the port takes; returns whether frames still wait.
    fn flush(&mut self) -> bool {
        while !self.queue.is_empty() {
            let (queue, spare) = (&mut self.queue, &mut self.spare);
            let sent = self.port.tx_burst(queue.len(), &mut |buf| {
                let frame = queue.pop_front()?;
                let len = frame.len().min(buf.len());
                buf[..len].copy_from_slice(&frame[..len]);
                spare.push(frame);
                Some(len)
            });
            match sent {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => {
                    self.port_errors += 1;
                    tracing::debug!("port transmit: {e}");
                    return !self.queue.is_empty();
                }
            }
        }
        false
    }
}

impl PortDevice {
    /// Wraps `port`.
    pub fn new(port: Box<dyn Port>) -> PortDevice {
        let mtu = port.mtu();
        PortDevice {
            rx: VecDeque::new(),
            rx_spare: Vec::new(),
            tx: TxSide { port, queue: VecDeque::new(), spare: Vec::new(), frames: 0, port_errors: 0 },
            mtu,
            rx_frames: 0,
        }
    }

    /// The port underneath.
    pub fn port(&self) -> &dyn Port {
        &*self.tx.port
    }

    /// Mutable access to the port (waiting on it).
    pub fn port_mut(&mut self) -> &mut dyn Port {
        &mut *self.tx.port
    }

    /// Counters.
    pub fn counters(&self) -> LinkCounters {
        LinkCounters {
            rx_frames: self.rx_frames,
            tx_frames: self.tx.frames,
            port_errors: self.tx.port_errors,
        }
    }

    /// Pulls a burst from the port if nothing is queued; returns whether frames are waiting.
    pub fn fill(&mut self) -> bool {
        if self.rx.is_empty() {
            let (rx, spare) = (&mut self.rx, &mut self.rx_spare);
            let got = self.tx.port.rx_burst(RX_BURST, &mut |frame| {
                let mut buf = spare.pop().unwrap_or_default();
                buf.clear();
                buf.extend_from_slice(frame);
                rx.push_back(buf);
            });
            match got {
                Ok(n) => self.rx_frames += n as u64,
                Err(e) => {
                    self.tx.port_errors += 1;
                    tracing::debug!("port receive: {e}");
                }
            }
        }
        !self.rx.is_empty()
    }

    /// Sends every queued frame the port takes; returns whether frames still wait.
    pub fn flush(&mut self) -> bool {
        self.tx.flush()
    }
}

/// A received frame lent to smoltcp.
pub struct RxToken<'a> {
    frame: Vec<u8>,
    spare: &'a mut Vec<Vec<u8>>,
}

/// Room for one frame smoltcp transmits.
pub struct TxToken<'a> {
    tx: &'a mut TxSide,
}

impl phy::RxToken for RxToken<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        let r = f(&self.frame);
        self.spare.push(self.frame);
        r
    }
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = self.tx.spare.pop().unwrap_or_default();
        buf.clear();
        buf.resize(len, 0);
        let r = f(&mut buf);
        self.tx.queue.push_back(buf);
        self.tx.frames += 1;
        if self.tx.queue.len() >= TX_FLUSH {
            self.tx.flush();
        }
        r
    }
}

impl phy::Device for PortDevice {
    type RxToken<'a> = RxToken<'a>;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, _now: Instant) -> Option<(RxToken<'_>, TxToken<'_>)> {
        if !self.fill() {
            return None;
        }
        let frame = self.rx.pop_front()?;
        Some((RxToken { frame, spare: &mut self.rx_spare }, TxToken { tx: &mut self.tx }))
    }

    fn transmit(&mut self, _now: Instant) -> Option<TxToken<'_>> {
        // Frames the port would not take stay queued; past a bound, smoltcp waits (and TCP
        // retransmits later) rather than the queue growing.
        if self.tx.queue.len() >= 4 * TX_FLUSH && self.tx.flush() {
            return None;
        }
        Some(TxToken { tx: &mut self.tx })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = self.mtu + lanbus_wire::ethernet::HEADER_LEN;
        caps.max_burst_size = Some(TX_FLUSH);
        caps
    }
}
