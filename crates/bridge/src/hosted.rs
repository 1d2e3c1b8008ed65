//! One device path for every kind of hosted function.
//!
//! Layer: pcie engine, device side. [`HostedFunction`] wraps either a sans-IO
//! [`Function`](lanbus_pcie::device::Function) (its DMA reads are started, and their completions fed
//! back with `dma_read_done`, without blocking, so a model like the DMA engine keeps many reads
//! in flight) or a [`BlockingFunction`] (its DMA reads wait). Both answer configuration and memory
//! requests through [`serve`], and reach the host through a [`Path`]: the fabric (the device
//! bridge) or local memory ([`crate::LocalBus`]).

use std::collections::HashMap;

use lanbus_pcie::blocking::{BlockingDevice, BlockingFunction, DmaPath, Waker};
use lanbus_pcie::config::{ConfigSpace, ConfigSpec};
use lanbus_pcie::device::{DeviceModel, DmaError, DmaId, Function, HostRequest, MmioError};
use lanbus_pcie::request::{completions_for_read, RequestShape};
use lanbus_pcie::{Bdf, CplStatus, Header, Tlp, TlpKind};

use crate::ur_completion;

/// Names one read started on a [`Path`].
pub(crate) type OpId = u64;

/// A function's way to host memory.
pub(crate) trait Path {
    /// Starts a read of `len` bytes at `address`; its result comes from `poll_read`/`wait_read`.
    fn start_read(&mut self, address: u64, len: usize) -> OpId;
    /// Starts every read of `reads` (address, length), in order, as one batch: a path that sends
    /// through another thread hands it their requests at once, not one wake-up per read.
    fn start_reads(&mut self, reads: &[(u64, usize)]) -> Vec<OpId> {
        reads.iter().map(|&(address, len)| self.start_read(address, len)).collect()
    }
    /// A posted write.
    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DmaError>;
    /// A finished read, if any, without waiting.
    fn poll_read(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)>;
    /// Waits for read `op` (other reads that finish meanwhile stay for `poll_read`).
    fn wait_read(&mut self, op: OpId) -> Result<Vec<u8>, DmaError>;
    /// The function's max payload size and max read request size, as its host programmed them.
    fn set_limits(&mut self, mps: usize, mrrs: usize);
    /// A read the function will ask for soon (see [`lanbus_pcie::blocking::HostAccess::prefetch`]);
    /// a path that cannot start it here ignores it.
    fn prefetch(&mut self, address: u64, len: usize) {
        let _ = (address, len);
    }
    /// The data of a prefetch of exactly `len` bytes at `address` that ended, if the path holds
    /// one (it is then used up).
    fn read_ready(&mut self, address: u64, len: usize) -> Option<Vec<u8>> {
        let _ = (address, len);
        None
    }
}

/// What the bridge needs of a hosted function.
pub(crate) trait Hosted: Send {
    fn config(&self) -> &ConfigSpace;
    fn config_read(&mut self, register: u16, first_be: u8) -> [u8; 4];
    fn config_write(&mut self, register: u16, first_be: u8, data: [u8; 4]);
    fn memory_read(&mut self, address: u64, data: &mut [u8]) -> Result<(), MmioError>;
    fn memory_write(&mut self, address: u64, data: &[u8]) -> Result<(), MmioError>;
    /// Whether `run` has something to do without new input.
    fn wants_run(&self) -> bool;
    /// Whether the model's DMA reads block (it needs a thread of its own); a sans-IO model runs
    /// inline on the device bridge's receive thread.
    fn blocking(&self) -> bool {
        false
    }
    /// Runs pending work through `path`; returns the units of work done.
    fn run(&mut self, path: &mut dyn Path) -> usize;
    /// Whether a memory request at `address` may be served on the receive thread (see
    /// [`lanbus_pcie::blocking::BlockingFunction::serves_inline`]); only blocking models are asked.
    fn serves_inline(&self, address: u64, len: usize, write: bool) -> bool {
        let _ = (address, len, write);
        false
    }
    /// Runs the pending work of a blocking model that needs no read of host memory (see
    /// [`BlockingDevice::process_posted`]); nothing else has to.
    fn run_posted(&mut self, path: &mut dyn Path) -> usize {
        let _ = path;
        0
    }
    /// Marks the function as one of several in its device (header type bit 7).
    fn set_multi_function(&mut self);
    /// Gives the model the waker of whoever runs it: a blocking model's worker, or the device
    /// bridge's receive thread for a sans-IO one (see [`Waker`]).
    fn set_waker(&mut self, waker: Waker) {
        let _ = waker;
    }
}

/// A PCIe function ready to be hosted by a [`super::DeviceBridge`] or a [`crate::LocalBus`].
pub struct HostedFunction {
    pub(crate) inner: Box<dyn Hosted>,
}

impl core::fmt::Debug for HostedFunction {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let s = self.inner.config().spec();
        write!(f, "HostedFunction({:04x}:{:04x})", s.vendor_id, s.device_id)
    }
}

impl HostedFunction {
    /// A sans-IO device model inside a new [`Function`].
    pub fn model<D: DeviceModel + Send + 'static>(device: D) -> lanbus_pcie::Result<HostedFunction> {
        Ok(Self::from_function(Function::new(device)?))
    }

    /// An existing [`Function`].
    pub fn from_function<D: DeviceModel + Send + 'static>(function: Function<D>) -> HostedFunction {
        HostedFunction { inner: Box::new(ModelHosted { function, reads: HashMap::new() }) }
    }

    /// A model with synchronous DMA inside a new [`BlockingFunction`].
    pub fn blocking<B: BlockingDevice + Send + 'static>(device: B) -> lanbus_pcie::Result<HostedFunction> {
        Ok(Self::from_blocking(BlockingFunction::new(device)?))
    }

    /// An existing [`BlockingFunction`].
    pub fn from_blocking<B: BlockingDevice + Send + 'static>(
        function: BlockingFunction<B>,
    ) -> HostedFunction {
        HostedFunction { inner: Box::new(BlockingHosted { function }) }
    }

    /// The function's configuration space specification.
    pub fn config_spec(&self) -> ConfigSpec {
        self.inner.config().spec().clone()
    }
}

struct ModelHosted<D> {
    function: Function<D>,
    /// Reads in flight: path op -> the model's id.
    reads: HashMap<OpId, DmaId>,
}

impl<D: DeviceModel + Send> Hosted for ModelHosted<D> {
    fn config(&self) -> &ConfigSpace {
        self.function.config()
    }
    fn set_multi_function(&mut self) {
        self.function.set_multi_function();
    }
    fn config_read(&mut self, register: u16, first_be: u8) -> [u8; 4] {
        self.function.config_read(register, first_be)
    }
    fn config_write(&mut self, register: u16, first_be: u8, data: [u8; 4]) {
        self.function.config_write(register, first_be, data)
    }
    fn memory_read(&mut self, address: u64, data: &mut [u8]) -> Result<(), MmioError> {
        self.function.memory_read(address, data)
    }
    fn memory_write(&mut self, address: u64, data: &[u8]) -> Result<(), MmioError> {
        self.function.memory_write(address, data)
    }
    fn wants_run(&self) -> bool {
        self.function.has_work()
    }
    fn run(&mut self, path: &mut dyn Path) -> usize {
        let mut work = 0;
        loop {
            let before = work;
            if self.function.has_work() {
                work += 1;
                self.function.poll();
            }
            while let Some(r) = self.function.poll_host_request() {
                work += 1;
                match r {
                    HostRequest::Read { id, address, len } => {
                        let op = path.start_read(address, len);
                        self.reads.insert(op, id);
                    }
                    // Posted: a write that cannot leave (no host) is counted by the path.
                    HostRequest::Write { address, data } => {
                        let _ = path.write(address, &data);
                    }
                }
            }
            while let Some((op, result)) = path.poll_read() {
                if let Some(id) = self.reads.remove(&op) {
                    work += 1;
                    self.function.dma_read_done_owned(id, result);
                }
            }
            if work == before {
                return work;
            }
        }
    }
    fn set_waker(&mut self, waker: Waker) {
        self.function.device_mut().set_waker(waker);
    }
}

struct BlockingHosted<B> {
    function: BlockingFunction<B>,
}

/// A [`Path`] seen as the blocking [`DmaPath`] a [`BlockingFunction`] wants.
struct Blocking<'a>(&'a mut dyn Path);

impl DmaPath for Blocking<'_> {
    fn read(&mut self, address: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let op = self.0.start_read(address, buf.len());
        let data = self.0.wait_read(op)?;
        if data.len() != buf.len() {
            return Err(DmaError::Completion(CplStatus::CompleterAbort));
        }
        buf.copy_from_slice(&data);
        Ok(())
    }
    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<(), DmaError> {
        let wanted: Vec<(u64, usize)> = reads.iter().map(|(a, b)| (*a, b.len())).collect();
        for ((_, buf), data) in reads.iter_mut().zip(self.read_owned(&wanted)?) {
            buf.copy_from_slice(&data);
        }
        Ok(())
    }
    fn read_owned(&mut self, reads: &[(u64, usize)]) -> Result<Vec<Vec<u8>>, DmaError> {
        // All started, then each waited for: their completions share the round trip. The last
        // first: completions come in order, so the worker sleeps once for the lot rather than
        // once per read. The buffers the reads were reassembled in are handed over as they are.
        let ops = self.0.start_reads(reads);
        let mut got: Vec<Vec<u8>> = vec![Vec::new(); reads.len()];
        let mut first_error = None;
        for ((op, &(_, len)), slot) in ops.into_iter().zip(reads).zip(got.iter_mut()).rev() {
            match self.0.wait_read(op) {
                Ok(data) if data.len() == len => *slot = data,
                Ok(_) => first_error = first_error.or(Some(DmaError::Completion(CplStatus::CompleterAbort))),
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        first_error.map_or(Ok(got), Err)
    }
    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DmaError> {
        self.0.write(address, data)
    }
    fn prefetch(&mut self, address: u64, len: usize) {
        self.0.prefetch(address, len);
    }
    fn read_ready(&mut self, address: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let data = self.read_ready_owned(address, buf.len())?;
        buf.copy_from_slice(&data);
        Ok(())
    }
    fn read_ready_owned(&mut self, address: u64, len: usize) -> Result<Vec<u8>, DmaError> {
        match self.0.read_ready(address, len) {
            Some(data) if data.len() == len => Ok(data),
            Some(_) => Err(DmaError::Completion(CplStatus::CompleterAbort)),
            None => Err(DmaError::WouldBlock),
        }
    }
}

impl<B: BlockingDevice + Send> Hosted for BlockingHosted<B> {
    fn config(&self) -> &ConfigSpace {
        self.function.config()
    }
    fn set_multi_function(&mut self) {
        self.function.set_multi_function();
    }
    fn config_read(&mut self, register: u16, first_be: u8) -> [u8; 4] {
        self.function.config_read(register, first_be)
    }
    fn config_write(&mut self, register: u16, first_be: u8, data: [u8; 4]) {
        self.function.config_write(register, first_be, data)
    }
    fn memory_read(&mut self, address: u64, data: &mut [u8]) -> Result<(), MmioError> {
        self.function.memory_read(address, data)
    }
    fn memory_write(&mut self, address: u64, data: &[u8]) -> Result<(), MmioError> {
        self.function.memory_write(address, data)
    }
    fn wants_run(&self) -> bool {
        self.function.has_work()
    }
    fn blocking(&self) -> bool {
        true
    }
    fn run(&mut self, path: &mut dyn Path) -> usize {
        if !self.function.has_work() {
            return 0;
        }
        self.function.process(&mut Blocking(path))
    }
    fn serves_inline(&self, address: u64, len: usize, write: bool) -> bool {
        self.function.serves_inline(address, len, write)
    }
    fn set_waker(&mut self, waker: Waker) {
        self.function.set_waker(waker);
    }
    fn run_posted(&mut self, path: &mut dyn Path) -> usize {
        if !self.function.has_work() {
            return 0;
        }
        self.function.process_posted(&mut Blocking(path))
    }
}

/// Read completion boundary of the functions' completions.
pub(crate) const DEVICE_RCB: usize = 64;

/// Answers one configuration or memory request to function `h` (whose ID is `me`): the
/// completions to send back (none for a posted write). `payload` is the request's data (its
/// `data`, or the part of the frame it was decoded from with [`Tlp::decode_borrowed`]).
pub(crate) fn serve(h: &mut dyn Hosted, me: Bdf, tlp: &Tlp, payload: &[u8]) -> Vec<Tlp> {
    match (&tlp.kind, &tlp.header) {
        (TlpKind::CfgRd0, Header::Config(c)) => {
            let data = h.config_read(c.register, c.first_be);
            vec![Tlp::completion(me, c.requester_id, tlp.tag, CplStatus::Success, 4, 0, data.to_vec())]
        }
        (TlpKind::CfgWr0, Header::Config(c)) => {
            let mut v = [0u8; 4];
            let n = payload.len().min(4);
            v[..n].copy_from_slice(&payload[..n]);
            h.config_write(c.register, c.first_be, v);
            vec![Tlp::completion(me, c.requester_id, tlp.tag, CplStatus::Success, 4, 0, Vec::new())]
        }
        (TlpKind::MRd32 | TlpKind::MRd64, Header::Mem(m)) => {
            let shape = RequestShape::of_memory(m, tlp.length_dw);
            let (first, count) = shape.byte_range();
            let start = m.address.saturating_add(first);
            let mut bytes = vec![0u8; count];
            let status = match h.memory_read(start, &mut bytes) {
                Ok(()) => None,
                Err(MmioError::Unsupported) => Some(CplStatus::UnsupportedRequest),
                Err(_) => Some(CplStatus::CompleterAbort),
            };
            if let Some(status) = status {
                let bc = count.clamp(1, 4096) as u16;
                return vec![Tlp::completion(
                    me,
                    m.requester_id,
                    tlp.tag,
                    status,
                    bc,
                    (start & 0x7f) as u8,
                    vec![],
                )];
            }
            let mps = h.config().max_payload_size();
            let fill = |a: u64, buf: &mut [u8]| {
                for (i, b) in buf.iter_mut().enumerate() {
                    let at = a + i as u64;
                    *b = at.checked_sub(start).and_then(|o| bytes.get(o as usize)).copied().unwrap_or(0);
                }
                Ok(())
            };
            completions_for_read(tlp, me, mps, DEVICE_RCB, fill)
                .unwrap_or_else(|_| vec![ur_completion(me, m.requester_id, tlp.tag)])
        }
        (TlpKind::MWr32 | TlpKind::MWr64, Header::Mem(m)) => {
            let shape = RequestShape::of_memory(m, tlp.length_dw);
            let (first, count) = shape.byte_range();
            let f = first as usize;
            if let Some(data) = payload.get(f..f + count) {
                // Posted: an unclaimed or refused write has nobody to tell.
                let _ = h.memory_write(m.address.saturating_add(first), data);
            }
            Vec::new()
        }
        _ if crate::is_non_posted(tlp) => vec![ur_completion(me, tlp.requester_id(), tlp.tag)],
        _ => Vec::new(),
    }
}

/// The memory ranges function `h` decodes now: (base, size) of each memory BAR, empty while
/// memory space is disabled. The receive thread routes memory requests with this snapshot.
pub(crate) fn decode_table(h: &dyn Hosted) -> Vec<(u64, u64)> {
    let c = h.config();
    if !c.memory_enabled() {
        return Vec::new();
    }
    (0..6)
        .filter_map(|i| {
            let bar = c.spec().bars[i]?;
            if bar.kind == lanbus_pcie::config::BarKind::Io {
                return None;
            }
            Some((c.bar_address(i)?, bar.size))
        })
        .collect()
}

/// Whether (`address`, `len`) lies in one of `table`'s ranges.
pub(crate) fn decodes(table: &[(u64, u64)], address: u64, len: u64) -> bool {
    table.iter().any(|(base, size)| {
        address.checked_sub(*base).and_then(|o| o.checked_add(len)).is_some_and(|end| end <= *size)
    })
}
