//! Device models and the PCIe function that hosts one, as the device bridge sees them.
//!
//! Layer: pcie engine, device side; sans-IO. A [`DeviceModel`] implements only its own registers
//! and reacts to DMA results; the [`Function`] around it owns the configuration space and the
//! MSI-X table/PBA, routes memory accesses through the BARs (PCIe Base Specification 7.5.1.2),
//! and turns the model's DMA and interrupt requests into [`HostRequest`]s toward the host: MSI-X
//! as memory writes of the vector's message (7.7.2), only with Bus Master Enable set (7.5.1.1).
//!
//! Call order for a bridge: deliver configuration and memory requests with
//! [`Function::config_read`]/[`config_write`](Function::config_write)/[`memory_read`](Function::memory_read)/
//! [`memory_write`](Function::memory_write); drain [`Function::poll_host_request`] after each and
//! send what it returns (splitting reads by MRRS and writes by MPS); hand each read's outcome back
//! with [`Function::dma_read_done`], then drain again.
//!
//! Invariants: a model's request is never lost silently: a read that cannot be sent (bus
//! mastering off) is answered at once with [`DmaError::BusMasterDisabled`]; writes and interrupts
//! that cannot be sent are counted in [`FunctionCounters`]; a masked MSI-X vector becomes pending
//! and is sent once unmasked.

use std::collections::VecDeque;

use crate::config::{ConfigSpace, ConfigSpec, MsixTable};
use crate::request::{completions_for_read, refuse, RequestShape};
use crate::tlp::{Bdf, Header, Tlp, TlpKind};
use crate::{CplStatus, Error, Result};

/// Names one DMA read of a device model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DmaId(pub u64);

/// Why a DMA read returned no data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DmaError {
    /// Bus Master Enable is clear: the function may not issue requests.
    #[error("bus mastering is disabled")]
    BusMasterDisabled,
    /// The host answered with a completion status other than success.
    #[error("host answered {0}")]
    Completion(CplStatus),
    /// The completions did not arrive in time.
    #[error("completion timeout")]
    Timeout,
    /// The host is gone (heartbeats stopped, or the device moved to another group).
    #[error("host unreachable")]
    HostUnreachable,
    /// A read was asked for where nothing may wait (a blocking model's
    /// [`process_posted`](crate::blocking::BlockingDevice::process_posted)); nothing was sent.
    #[error("a DMA read where waiting is not allowed")]
    WouldBlock,
}

/// A memory request the function sends toward the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRequest {
    /// Read `len` bytes at `address`; answer with [`Function::dma_read_done`] and `id`.
    Read {
        /// The read's name.
        id: DmaId,
        /// Byte address in host memory.
        address: u64,
        /// Bytes to read.
        len: usize,
    },
    /// Write `data` at `address` (posted). MSI-X messages are these too.
    Write {
        /// Byte address in host memory.
        address: u64,
        /// The bytes.
        data: Vec<u8>,
    },
}

/// One thing a model asked of its [`DeviceIo`], in order (for a host that runs a model itself,
/// without a [`Function`] around it: see [`DeviceIo::next_op`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoOp {
    /// A DMA read or write; a read's outcome goes back with [`DeviceModel::dma_read_done`].
    Dma(HostRequest),
    /// An MSI-X vector raised.
    Interrupt(u16),
}

/// A device model's handle to the host: DMA and MSI-X. Requests are queued and leave through
/// [`Function::poll_host_request`].
#[derive(Debug, Default)]
pub struct DeviceIo {
    next_id: u64,
    queue: VecDeque<IoOp>,
}

impl DeviceIo {
    /// Asks for `len` bytes of host memory at `address`; the result comes to
    /// [`DeviceModel::dma_read_done`] with the returned id.
    pub fn dma_read(&mut self, address: u64, len: usize) -> DmaId {
        let id = DmaId(self.next_id);
        self.next_id += 1;
        self.queue.push_back(IoOp::Dma(HostRequest::Read { id, address, len }));
        id
    }

    /// Writes `data` to host memory at `address` (posted: no answer).
    pub fn dma_write(&mut self, address: u64, data: Vec<u8>) {
        self.queue.push_back(IoOp::Dma(HostRequest::Write { address, data }));
    }

    /// Raises MSI-X `vector`. Requests queued before it reach the host first, as PCIe ordering
    /// requires of posted writes.
    pub fn signal_msix(&mut self, vector: u16) {
        self.queue.push_back(IoOp::Interrupt(vector));
    }

    /// Takes the oldest request, for a host that runs a model without a [`Function`] (tests,
    /// in-process buses); a [`Function`] drains them itself.
    pub fn next_op(&mut self) -> Option<IoOp> {
        self.queue.pop_front()
    }
}

/// A BAR access the device refuses (answered with Completer Abort).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("completer abort")]
pub struct CompleterAbort;

/// Why a memory access to the function was not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MmioError {
    /// No BAR decodes the address (or memory space is disabled): Unsupported Request.
    #[error("no BAR decodes the address")]
    Unsupported,
    /// The device refused the access: Completer Abort.
    #[error("completer abort")]
    Abort,
}

/// What a PCIe function model implements. Everything is synchronous and sans-IO: work toward
/// the host goes through the [`DeviceIo`] passed in.
pub trait DeviceModel {
    /// The configuration space the function is built with (IDs, class, BARs, MSI-X placement).
    fn config_spec(&self) -> ConfigSpec;

    /// Reads `data.len()` bytes at `offset` of memory BAR `bar` (MSI-X regions never reach the
    /// model). Unimplemented registers should read as zero.
    fn bar_read(
        &mut self,
        bar: usize,
        offset: u64,
        data: &mut [u8],
        io: &mut DeviceIo,
    ) -> core::result::Result<(), CompleterAbort>;

    /// Writes `data` at `offset` of memory BAR `bar`.
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8], io: &mut DeviceIo);

    /// The outcome of a read the model asked for with [`DeviceIo::dma_read`].
    fn dma_read_done(&mut self, id: DmaId, result: core::result::Result<&[u8], DmaError>, io: &mut DeviceIo);

    /// [`DeviceModel::dma_read_done`] with the buffer the read was assembled in, for a model
    /// that keeps the bytes (no copy). The default lends it.
    fn dma_read_done_owned(
        &mut self,
        id: DmaId,
        result: core::result::Result<Vec<u8>, DmaError>,
        io: &mut DeviceIo,
    ) {
        self.dma_read_done(id, result.as_deref().map_err(|e| *e), io);
    }

    /// Whether the model has work of its own, started by nothing on the bus (a frame that
    /// arrived on a NIC's wire, say). The default has none.
    fn has_work(&self) -> bool {
        false
    }

    /// Runs that work (see [`DeviceModel::has_work`]). The default does nothing.
    fn poll(&mut self, io: &mut DeviceIo) {
        let _ = io;
    }

    /// Gives the model a way to ask for a [`DeviceModel::poll`] soon from another thread (when
    /// outside work arrives). The default drops it.
    fn set_waker(&mut self, waker: crate::blocking::Waker) {
        let _ = waker;
    }

    /// Called after software wrote the configuration DW at `register` (for example to notice
    /// Bus Master Enable going off). The default does nothing.
    fn config_written(&mut self, register: u16, config: &ConfigSpace, io: &mut DeviceIo) {
        let _ = (register, config, io);
    }
}

/// What a [`Function`] could not do, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FunctionCounters {
    /// DMA writes dropped because bus mastering was off.
    pub writes_dropped: u64,
    /// DMA reads failed at once because bus mastering was off.
    pub reads_refused: u64,
    /// Interrupts dropped (bus mastering or MSI-X off, or no such vector).
    pub interrupts_dropped: u64,
    /// Interrupts left pending by a mask.
    pub interrupts_pended: u64,
    /// Interrupts sent.
    pub interrupts_sent: u64,
    /// Memory writes no BAR decoded (posted, so only counted).
    pub unsupported_writes: u64,
    /// Poisoned writes dropped.
    pub poisoned_writes: u64,
    /// Non-posted requests answered with Unsupported Request or Completer Abort.
    pub refused_requests: u64,
}

/// One PCIe function: configuration space, MSI-X, and the model behind its BARs.
#[derive(Debug)]
pub struct Function<D> {
    /// The function's ID, captured from type 0 configuration writes (PCIe 2.2.6.2).
    id: Bdf,
    config: ConfigSpace,
    msix: Option<MsixTable>,
    /// Set when a write may have unmasked something: the pending vectors are looked at again.
    msix_recheck: bool,
    device: D,
    io: DeviceIo,
    counters: FunctionCounters,
}

impl<D: DeviceModel> Function<D> {
    /// Builds the function around `device`.
    pub fn new(device: D) -> Result<Function<D>> {
        let config = ConfigSpace::new(device.config_spec())?;
        let msix = config.spec().msix.map(|m| MsixTable::new(m.table_size));
        Ok(Function {
            id: Bdf::default(),
            config,
            msix,
            msix_recheck: false,
            device,
            io: DeviceIo::default(),
            counters: FunctionCounters::default(),
        })
    }

    /// The function's ID as captured from the last type 0 configuration write addressed to it
    /// (00:00.0 before any); completions for memory reads carry it.
    pub fn id(&self) -> Bdf {
        self.id
    }

    /// The configuration space.
    pub fn config(&self) -> &ConfigSpace {
        &self.config
    }

    /// Marks the function as one of a multi-function device (see
    /// [`ConfigSpace::set_multi_function`]).
    pub fn set_multi_function(&mut self) {
        self.config.set_multi_function();
    }

    /// The MSI-X table, if the function has one.
    pub fn msix(&self) -> Option<&MsixTable> {
        self.msix.as_ref()
    }

    /// The model.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The model, mutably (for tests and local control).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// What could not be done so far.
    pub fn counters(&self) -> FunctionCounters {
        self.counters
    }

    /// A configuration read (CfgRd0 to this function).
    pub fn config_read(&mut self, register: u16, first_be: u8) -> [u8; 4] {
        self.config.read(register, first_be)
    }

    /// A configuration write (CfgWr0 to this function).
    pub fn config_write(&mut self, register: u16, first_be: u8, data: [u8; 4]) {
        self.config.write(register, first_be, data);
        self.msix_recheck = true;
        self.device.config_written(register & !3, &self.config, &mut self.io);
    }

    /// Which MSI-X region (0 table, 1 PBA) of BAR `bar` holds `offset..offset+len`, and the
    /// offset in it.
    fn msix_region(&self, bar: usize, offset: u64, len: usize) -> Option<(u8, u64)> {
        let spec = self.config.spec().msix?;
        let table = self.msix.as_ref()?;
        let regions = [
            (0u8, spec.table_bar, u64::from(spec.table_offset), table.table_len()),
            (1u8, spec.pba_bar, u64::from(spec.pba_offset), table.pba_len()),
        ];
        regions.into_iter().find_map(|(which, b, start, size)| {
            let off = offset.checked_sub(start)?;
            (usize::from(b) == bar && off < size as u64)
                .then_some((which, off))
                .filter(|_| off + len as u64 <= size as u64)
        })
    }

    /// A memory read request to the function's BARs.
    pub fn memory_read(&mut self, address: u64, data: &mut [u8]) -> core::result::Result<(), MmioError> {
        let (bar, offset) =
            self.config.decode_memory(address, data.len() as u64).ok_or(MmioError::Unsupported)?;
        if let Some((which, off)) = self.msix_region(bar, offset, data.len()) {
            let t = self.msix.as_ref().expect("region implies a table");
            let ok = if which == 0 { t.read_table(off, data) } else { t.read_pba(off, data) };
            return if ok { Ok(()) } else { Err(MmioError::Abort) };
        }
        self.device.bar_read(bar, offset, data, &mut self.io).map_err(|_| MmioError::Abort)
    }

    /// A memory write request to the function's BARs (posted: the error is for counting).
    pub fn memory_write(&mut self, address: u64, data: &[u8]) -> core::result::Result<(), MmioError> {
        let (bar, offset) =
            self.config.decode_memory(address, data.len() as u64).ok_or(MmioError::Unsupported)?;
        if let Some((which, off)) = self.msix_region(bar, offset, data.len()) {
            // The PBA is read-only; writes to it are ignored.
            if which == 0 {
                self.msix.as_mut().expect("region implies a table").write_table(off, data);
                self.msix_recheck = true;
            }
            return Ok(());
        }
        self.device.bar_write(bar, offset, data, &mut self.io);
        Ok(())
    }

    /// Hands the outcome of a [`HostRequest::Read`] to the model.
    pub fn dma_read_done(&mut self, id: DmaId, result: core::result::Result<&[u8], DmaError>) {
        self.device.dma_read_done(id, result, &mut self.io);
    }

    /// [`Function::dma_read_done`] with the buffer the read was assembled in (see
    /// [`DeviceModel::dma_read_done_owned`]).
    pub fn dma_read_done_owned(&mut self, id: DmaId, result: core::result::Result<Vec<u8>, DmaError>) {
        self.device.dma_read_done_owned(id, result, &mut self.io);
    }

    /// Whether the model has work of its own (see [`DeviceModel::has_work`]).
    pub fn has_work(&self) -> bool {
        self.device.has_work()
    }

    /// Runs the model's own work, if it has any; then drain [`Function::poll_host_request`].
    pub fn poll(&mut self) {
        if self.device.has_work() {
            self.device.poll(&mut self.io);
        }
    }

    /// Answers a request routed to this function (PCIe completer rules, 2.2.8 and 2.3): the
    /// completions to send back, in order; none for posted writes. Configuration type 0 requests
    /// go to the configuration space (a write also captures the function's ID); memory requests
    /// go through the BARs (reads only touch the enabled bytes, and their completions are split
    /// by the programmed max payload size and read completion boundary); poisoned writes are
    /// dropped; I/O and type 1 configuration requests, and addresses no BAR decodes, get
    /// Unsupported Request; a device refusal gets Completer Abort. A completion is not a request:
    /// that is an error (the caller routes completions to the DMA reads).
    pub fn handle_request(&mut self, req: &Tlp) -> Result<Vec<Tlp>> {
        let status_of = |e: MmioError| match e {
            MmioError::Unsupported => CplStatus::UnsupportedRequest,
            MmioError::Abort => CplStatus::CompleterAbort,
        };
        let out = match (req.kind, &req.header) {
            (TlpKind::CfgRd0, Header::Config(h)) => {
                let d = self.config_read(h.register, h.first_be);
                let mut c = Tlp::completion(
                    h.completer_id,
                    h.requester_id,
                    req.tag,
                    CplStatus::Success,
                    4,
                    0,
                    d.to_vec(),
                );
                c.tc = req.tc;
                c.attr = req.attr;
                vec![c]
            }
            (TlpKind::CfgWr0, Header::Config(h)) => {
                self.id = h.completer_id;
                if let (false, Ok(d)) = (req.ep, <[u8; 4]>::try_from(&req.data[..])) {
                    self.config_write(h.register, h.first_be, d);
                }
                let mut c = Tlp::completion(
                    h.completer_id,
                    h.requester_id,
                    req.tag,
                    CplStatus::Success,
                    4,
                    0,
                    vec![],
                );
                c.tc = req.tc;
                c.attr = req.attr;
                vec![c]
            }
            (TlpKind::MRd32 | TlpKind::MRd64, Header::Mem(h)) => {
                let shape = RequestShape::of_memory(h, req.length_dw);
                let (first, len) = shape.byte_range();
                let address = h.address.saturating_add(first);
                let mut bytes = vec![0u8; len];
                let result = if RequestShape::for_range(address, len).is_err() {
                    Err(MmioError::Unsupported)
                } else if len == 0 {
                    // A zero-length read only asks whether the address is there.
                    self.config.decode_memory(h.address, 4).map(|_| ()).ok_or(MmioError::Unsupported)
                } else {
                    self.memory_read(address, &mut bytes)
                };
                match result {
                    Ok(()) => {
                        let (mps, rcb) =
                            (self.config.max_payload_size(), self.config.read_completion_boundary());
                        completions_for_read(req, self.id, mps, rcb, |a, buf| {
                            for (i, b) in buf.iter_mut().enumerate() {
                                let at = (a + i as u64).wrapping_sub(address);
                                *b =
                                    usize::try_from(at).ok().and_then(|k| bytes.get(k)).copied().unwrap_or(0);
                            }
                            Ok(())
                        })?
                    }
                    Err(e) => {
                        self.counters.refused_requests += 1;
                        refuse(req, self.id, status_of(e)).into_iter().collect()
                    }
                }
            }
            (TlpKind::MWr32 | TlpKind::MWr64, Header::Mem(h)) => {
                if req.ep {
                    self.counters.poisoned_writes += 1;
                    return Ok(vec![]);
                }
                // Contiguous runs of enabled bytes, each one BAR write.
                let n = req.data.len();
                let enabled = |i: usize| {
                    let be = if i < 4 {
                        h.first_be
                    } else if i + 4 >= n {
                        h.last_be
                    } else {
                        0xf
                    };
                    be >> (i % 4) & 1 == 1
                };
                let mut i = 0;
                while i < n {
                    if !enabled(i) {
                        i += 1;
                        continue;
                    }
                    let start = i;
                    while i < n && enabled(i) {
                        i += 1;
                    }
                    let Some(address) = h.address.checked_add(start as u64) else { break };
                    if self.memory_write(address, &req.data[start..i]).is_err() {
                        self.counters.unsupported_writes += 1;
                        break;
                    }
                }
                vec![]
            }
            (TlpKind::Cpl | TlpKind::CplD, _) => {
                return Err(Error::BadRequest("a completion is not a request".into()));
            }
            // I/O space is not decoded by device models; type 1 configuration is for bridges.
            _ => {
                self.counters.refused_requests += 1;
                refuse(req, self.id, CplStatus::UnsupportedRequest).into_iter().collect()
            }
        };
        Ok(out)
    }

    fn msi_write(msg: crate::config::MsiMessage) -> HostRequest {
        HostRequest::Write { address: msg.address, data: msg.data.to_le_bytes().to_vec() }
    }

    /// The next request to send toward the host, in the order the model made them; `None` when
    /// there is nothing to send.
    #[must_use]
    pub fn poll_host_request(&mut self) -> Option<HostRequest> {
        let bus_master = self.config.bus_master();
        if self.msix_recheck && bus_master {
            let (en, masked) = (self.config.msix_enabled(), self.config.msix_function_masked());
            if let Some((_, msg)) = self.msix.as_mut().and_then(|t| t.poll_pending(en, masked)) {
                self.counters.interrupts_sent += 1;
                return Some(Self::msi_write(msg));
            }
            self.msix_recheck = false;
        }
        while let Some(op) = self.io.queue.pop_front() {
            match op {
                IoOp::Dma(HostRequest::Read { id, address, len }) => {
                    if bus_master {
                        return Some(HostRequest::Read { id, address, len });
                    }
                    self.counters.reads_refused += 1;
                    self.device.dma_read_done(id, Err(DmaError::BusMasterDisabled), &mut self.io);
                }
                IoOp::Dma(HostRequest::Write { address, data }) => {
                    if bus_master {
                        return Some(HostRequest::Write { address, data });
                    }
                    self.counters.writes_dropped += 1;
                }
                IoOp::Interrupt(vector) => {
                    let (en, masked) = (self.config.msix_enabled(), self.config.msix_function_masked());
                    let Some(table) = self.msix.as_mut().filter(|_| bus_master) else {
                        self.counters.interrupts_dropped += 1;
                        continue;
                    };
                    if !en || usize::from(vector) >= table.len() {
                        self.counters.interrupts_dropped += 1;
                        continue;
                    }
                    match table.signal(vector, en, masked) {
                        Some(msg) => {
                            self.counters.interrupts_sent += 1;
                            return Some(Self::msi_write(msg));
                        }
                        None => self.counters.interrupts_pended += 1,
                    }
                }
            }
        }
        None
    }
}
