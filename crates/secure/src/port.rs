//! [`SecurePort`]: the authentication layer as a port layer over any port, driving a [`Guard`]
//! with the monotonic clock.

use std::sync::{Arc, Mutex};

use lanbus_port::{Layer, Port, Result};
use lanbus_wire::{Clock as _, Instant, MonotonicClock};

use crate::entropy::SystemEntropy;
use crate::guard::{Guard, GuardConfig, SecurityReport, TRAILER_LEN};
use crate::kdf::Suite;
use crate::Keys;

/// The most borrowed frames sealed and handed to the inner port at once.
const BURST: usize = 32;

/// How often the layer publishes its report for [`SecurityView`].
const PUBLISH_EVERY_NS: u64 = 100_000_000;

/// A reader of a [`SecurePort`]'s report (status output, metrics), from any thread.
#[derive(Debug, Clone, Default)]
pub struct SecurityView(Arc<Mutex<SecurityReport>>);

impl SecurityView {
    /// The report as last published (at most a tenth of a second old while frames flow).
    pub fn report(&self) -> SecurityReport {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A port whose every frame is sealed on the way out and opened on the way in; see the crate docs.
/// Its MTU is the inner port's less [`TRAILER_LEN`].
pub struct SecurePort {
    inner: Box<dyn Port>,
    guard: Guard,
    clock: MonotonicClock,
    scratch: Vec<u8>,
    /// Where a burst of borrowed frames is gathered and sealed when the inner port borrows
    /// frames: a frame must lie whole for its tag, and the trailer follows it.
    sealed: Vec<Vec<u8>>,
    view: SecurityView,
    last_publish: Instant,
}

impl SecurePort {
    /// Wraps `inner` with the keys in `keys`; `encrypt` also encrypts payloads.
    pub fn new(inner: Box<dyn Port>, keys: Arc<Keys>, encrypt: bool) -> SecurePort {
        let config = GuardConfig {
            encrypt,
            suite: Suite::preferred(),
            broadcast_counter_start: lanbus_port::realtime_ns(),
        };
        let guard = Guard::new(Port::mac(&*inner), keys, config, Box::new(SystemEntropy));
        let view = SecurityView(Arc::new(Mutex::new(guard.report())));
        let scratch = Vec::with_capacity(Port::frame_capacity(&*inner) + TRAILER_LEN);
        SecurePort {
            inner,
            guard,
            clock: MonotonicClock::new(),
            scratch,
            sealed: Vec::new(),
            view,
            last_publish: Instant::ZERO,
        }
    }

    /// A reader of this layer's report.
    pub fn view(&self) -> SecurityView {
        self.view.clone()
    }

    fn flush(&mut self) -> Result<()> {
        while let Some(frame) = self.guard.poll_transmit() {
            // A full queue loses the handshake frame as a wire would; the handshake retries.
            Port::send_frames(&mut *self.inner, &[&frame])?;
        }
        Ok(())
    }

    /// Gathers each frame's pieces into a buffer of its own, seals it there and hands the burst
    /// to the inner port, which sends it from there (one `sendmmsg` rather than a copy into its
    /// transmit ring and a system call per burst). Frames the guard will not seal yet (no
    /// session) are left out, lost as on a wire: the transport sends them again.
    fn seal_borrowed(&mut self, frames: &[[&[u8]; 2]]) -> Result<usize> {
        self.flush()?;
        let now = self.clock.now();
        let room = Port::frame_capacity(&*self.inner);
        let SecurePort { inner, guard, sealed, .. } = self;
        if sealed.len() < frames.len() {
            sealed.resize_with(frames.len(), || Vec::with_capacity(room));
        }
        let mut lens = [0usize; BURST];
        let mut n = 0;
        for [head, body] in frames.iter().take(BURST) {
            let len = head.len() + body.len();
            if len + TRAILER_LEN > room {
                continue;
            }
            let buf = &mut sealed[n];
            buf.clear();
            buf.extend_from_slice(head);
            buf.extend_from_slice(body);
            buf.resize(len + TRAILER_LEN, 0);
            if let Some(l) = guard.seal(now, buf, len) {
                lens[n] = l;
                n += 1;
            }
        }
        let mut out: [&[u8]; BURST] = [&[]; BURST];
        for (o, (buf, len)) in out.iter_mut().zip(sealed.iter().zip(&lens[..n])) {
            *o = &buf[..*len];
        }
        Port::tx_borrowed(&mut **inner, &out[..n])?;
        self.flush()?;
        Ok(frames.len().min(BURST))
    }

    fn publish(&mut self, now: Instant) {
        if now.as_nanos() - self.last_publish.as_nanos() >= PUBLISH_EVERY_NS {
            self.last_publish = now;
            *self.view.0.lock().unwrap_or_else(|e| e.into_inner()) = self.guard.report();
        }
    }
}

impl Layer for SecurePort {
    type Inner = dyn Port;
    const REWRITES_TX: bool = true;

    fn inner(&self) -> &(dyn Port + 'static) {
        &*self.inner
    }

    fn inner_mut(&mut self) -> &mut (dyn Port + 'static) {
        &mut *self.inner
    }

    fn rx_burst(&mut self, max: usize, on_frame: &mut dyn FnMut(&[u8])) -> Result<usize> {
        Layer::rx_burst_stamped(self, max, &mut |frame, _| on_frame(frame))
    }

    fn rx_burst_stamped(
        &mut self,
        max: usize,
        on_frame: &mut dyn FnMut(&[u8], Option<u64>),
    ) -> Result<usize> {
        let now = self.clock.now();
        let SecurePort { inner, guard, scratch, .. } = self;
        let n = Port::rx_burst_stamped(&mut **inner, max, &mut |frame, stamp| {
            if let Some(open) = guard.open(now, frame, scratch) {
                on_frame(open, stamp);
            }
        })?;
        self.flush()?;
        self.publish(now);
        Ok(n)
    }

    fn tx_burst(&mut self, max: usize, fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>) -> Result<usize> {
        self.flush()?;
        let now = self.clock.now();
        let SecurePort { inner, guard, .. } = self;
        let n = Port::tx_burst(&mut **inner, max, &mut |buf| loop {
            let room = buf.len().saturating_sub(TRAILER_LEN);
            let len = fill(&mut buf[..room])?;
            if let Some(sealed) = guard.seal(now, buf, len) {
                return Some(sealed);
            }
        })?;
        self.flush()?;
        Ok(n)
    }

    fn borrows_frames(&self) -> bool {
        Port::borrows_frames(&*self.inner)
    }

    fn tx_borrowed(&mut self, frames: &[&[u8]]) -> Result<usize> {
        if !Port::borrows_frames(&*self.inner) {
            return lanbus_port::copy_frames(self, frames);
        }
        let mut taken = 0;
        for chunk in frames.chunks(BURST) {
            let mut parts: [[&[u8]; 2]; BURST] = [[&[], &[]]; BURST];
            for (p, f) in parts.iter_mut().zip(chunk) {
                *p = [f, &[]];
            }
            taken += self.seal_borrowed(&parts[..chunk.len()])?;
        }
        Ok(taken)
    }

    fn tx_borrowed_parts(&mut self, frames: &[[&[u8]; 2]]) -> Result<usize> {
        if !Port::borrows_frames(&*self.inner) {
            return lanbus_port::copy_parts(self, frames);
        }
        let mut taken = 0;
        for chunk in frames.chunks(BURST) {
            taken += self.seal_borrowed(chunk)?;
        }
        Ok(taken)
    }

    fn mtu(&self) -> usize {
        Port::mtu(&*self.inner).saturating_sub(TRAILER_LEN)
    }

    fn frame_capacity(&self) -> usize {
        Port::frame_capacity(&*self.inner).saturating_sub(TRAILER_LEN)
    }

    fn authenticates(&self) -> bool {
        true
    }
}
