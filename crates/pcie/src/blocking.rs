//! Device models with synchronous DMA, and the PCIe function that hosts one.
//!
//! Layer: pcie engine, device side; no threads, no clock. Some models are simplest written as
//! straight-line code that reads host memory and waits for the bytes (an NVMe controller fetching
//! a command, then its PRP list, then the data). A [`BlockingDevice`] does that through a
//! [`HostAccess`] whose `read` returns only when the data is there (or failed). The
//! [`BlockingFunction`] around it owns the configuration space and the MSI-X table/PBA exactly as
//! [`crate::device::Function`] does (PCIe Base Specification 7.5.1, 7.7.2), and turns the model's
//! MSI-X signals into memory writes of the vector's message, only with Bus Master Enable set.
//!
//! Where the blocking happens is the caller's business: the device bridge runs
//! [`BlockingFunction::process`] on a worker thread of its own, never on the thread that receives
//! completions, so a read can wait for them.
//!
//! Invariants: no DMA leaves while Bus Master Enable is clear (the access fails with
//! [`DmaError::BusMasterDisabled`]); a masked vector becomes pending and is sent once unmasked;
//! MSI-X structures are never handed to the model.

use crate::config::{ConfigSpace, ConfigSpec, MsiMessage, MsixTable};
use crate::device::{CompleterAbort, DmaError, MmioError};
use crate::Result;

/// What a blocking model gets to reach the host: memory reads that wait for their data, posted
/// memory writes, and MSI-X.
pub trait HostAccess {
    /// Reads `buf.len()` bytes of host memory at `address`; returns when they are in `buf`.
    fn read(&mut self, address: u64, buf: &mut [u8]) -> core::result::Result<(), DmaError>;
    /// Reads several ranges, all in flight together where the path allows (one round trip
    /// instead of one each); returns when all are in. The default reads them one by one.
    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> core::result::Result<(), DmaError> {
        for (address, buf) in reads.iter_mut() {
            self.read(*address, buf)?;
        }
        Ok(())
    }
    /// Reads several ranges (address, length) like [`read_many`](Self::read_many), into buffers
    /// of their own that it returns in order: a path whose reads arrive in buffers hands those
    /// over instead of copying them. The default reads into fresh buffers.
    fn read_owned(&mut self, reads: &[(u64, usize)]) -> core::result::Result<Vec<Vec<u8>>, DmaError> {
        read_into_fresh_buffers(reads, |r| self.read_many(r))
    }
    /// Writes `data` to host memory at `address` (posted: an error means it could not be sent).
    fn write(&mut self, address: u64, data: &[u8]) -> core::result::Result<(), DmaError>;
    /// Raises MSI-X `vector`. Writes made before it reach the host first.
    fn signal_msix(&mut self, vector: u16);
    /// Says that the model will soon read exactly `len` bytes at `address` (a submission queue's
    /// new entries, say), memory the host will not change before then: in its next
    /// [`BlockingDevice::process`], or in a later [`BlockingDevice::process_posted`] once the
    /// data is here. A path that can start that read now does, even from `process_posted`, so
    /// the data may be there by the time the model asks; the next read of exactly that range
    /// takes it. A hint: the default ignores it.
    fn prefetch(&mut self, address: u64, len: usize) {
        let _ = (address, len);
    }
}

/// `read_owned`'s default: fresh buffers for `reads`, filled by `read_many`.
fn read_into_fresh_buffers(
    reads: &[(u64, usize)],
    read_many: impl FnOnce(&mut [(u64, &mut [u8])]) -> core::result::Result<(), DmaError>,
) -> core::result::Result<Vec<Vec<u8>>, DmaError> {
    let mut bufs: Vec<Vec<u8>> = reads.iter().map(|&(_, len)| vec![0; len]).collect();
    let mut ranges: Vec<(u64, &mut [u8])> =
        reads.iter().zip(bufs.iter_mut()).map(|(&(a, _), b)| (a, b.as_mut_slice())).collect();
    read_many(&mut ranges)?;
    Ok(bufs)
}

/// Wakes the thread that runs a [`BlockingFunction`]: a model whose work can come from outside
/// the bus (frames arriving on a network interface) calls it after queueing that work, so the
/// bridge runs [`BlockingDevice::process`] without waiting for the next request from the host.
#[derive(Clone)]
pub struct Waker(std::sync::Arc<dyn Fn() + Send + Sync>);

impl Waker {
    /// A waker that calls `f`.
    pub fn new(f: impl Fn() + Send + Sync + 'static) -> Waker {
        Waker(std::sync::Arc::new(f))
    }

    /// A waker that does nothing (for callers that run the function themselves).
    pub fn none() -> Waker {
        Waker::new(|| {})
    }

    /// Asks for the function's work to be run soon.
    pub fn wake(&self) {
        (self.0)()
    }
}

impl core::fmt::Debug for Waker {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Waker")
    }
}

/// The raw path toward the host a bridge gives a [`BlockingFunction`]: reads and posted writes.
pub trait DmaPath {
    /// Reads `buf.len()` bytes at `address`, waiting for them.
    fn read(&mut self, address: u64, buf: &mut [u8]) -> core::result::Result<(), DmaError>;
    /// Reads several ranges, in flight together where it can (see [`HostAccess::read_many`]).
    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> core::result::Result<(), DmaError> {
        for (address, buf) in reads.iter_mut() {
            self.read(*address, buf)?;
        }
        Ok(())
    }
    /// Reads several ranges into buffers of their own (see [`HostAccess::read_owned`]).
    fn read_owned(&mut self, reads: &[(u64, usize)]) -> core::result::Result<Vec<Vec<u8>>, DmaError> {
        read_into_fresh_buffers(reads, |r| self.read_many(r))
    }
    /// Writes `data` at `address` (posted).
    fn write(&mut self, address: u64, data: &[u8]) -> core::result::Result<(), DmaError>;
    /// Starts a read the model will ask for soon, if the path can (see [`HostAccess::prefetch`]).
    fn prefetch(&mut self, address: u64, len: usize) {
        let _ = (address, len);
    }
    /// Reads `buf.len()` bytes at `address` only if the path holds them already (a prefetch of
    /// exactly that range that ended); [`DmaError::WouldBlock`] otherwise, without waiting. What
    /// [`BlockingFunction::process_posted`] reads through. The default holds nothing.
    fn read_ready(&mut self, address: u64, buf: &mut [u8]) -> core::result::Result<(), DmaError> {
        let _ = (address, buf);
        Err(DmaError::WouldBlock)
    }
    /// [`read_ready`](Self::read_ready) into a buffer of its own: a path that holds the data in a
    /// buffer hands that one over. The default reads into a fresh one.
    fn read_ready_owned(&mut self, address: u64, len: usize) -> core::result::Result<Vec<u8>, DmaError> {
        let mut buf = vec![0; len];
        self.read_ready(address, &mut buf)?;
        Ok(buf)
    }
}

/// A PCIe function model whose DMA is synchronous.
pub trait BlockingDevice {
    /// The configuration space the function is built with (IDs, class, BARs, MSI-X placement).
    fn config_spec(&self) -> ConfigSpec;

    /// Reads `data.len()` bytes at `offset` of memory BAR `bar` (MSI-X regions never reach the
    /// model). Unimplemented registers should read as zero.
    fn bar_read(
        &mut self,
        bar: usize,
        offset: u64,
        data: &mut [u8],
    ) -> core::result::Result<(), CompleterAbort>;

    /// Writes `data` at `offset` of memory BAR `bar`.
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]);

    /// Whether [`process`](Self::process) has something to do (a doorbell was rung...).
    fn has_work(&self) -> bool;

    /// Does the pending work, reaching the host through `host`. Returns how many units of work
    /// were done (0: nothing could progress).
    fn process(&mut self, host: &mut dyn HostAccess) -> usize;

    /// Whether a memory read (`write` false) or write of BAR `bar` at `offset` is quick and
    /// waits for nothing (no storage, no host), so that the device bridge may serve it on the
    /// thread that receives the fabric's frames (which also keeps heartbeats and ACKs going)
    /// instead of handing it to the function's worker. The default: no access is.
    fn serves_inline(&self, bar: usize, offset: u64, write: bool) -> bool {
        let _ = (bar, offset, write);
        false
    }

    /// Does the part of the pending work that needs no host memory read (only posted writes and
    /// MSI-X, and reads of data a prefetch brought already) and is quick (no flush of slow
    /// storage), stopping before the first piece that is not; `process` does the rest. The
    /// device bridge calls it on the thread that receives the fabric's frames, where nothing may
    /// wait (a read of data not here yet fails there with [`DmaError::WouldBlock`] and sends
    /// nothing; [`HostAccess::prefetch`] asks for it), which saves the hand-off to the function's
    /// worker. The bridge calls it again when a prefetch ends. The default does nothing.
    fn process_posted(&mut self, host: &mut dyn HostAccess) -> usize {
        let _ = host;
        0
    }

    /// Receives the waker of the thread that runs the model (see [`Waker`]); the bridge calls
    /// it once, before any other call. The default drops it: work comes only from the host.
    fn set_waker(&mut self, waker: Waker) {
        let _ = waker;
    }
}

/// What a [`BlockingFunction`] could not do, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockingCounters {
    /// DMA refused because bus mastering was off.
    pub dma_refused: u64,
    /// Interrupts dropped (bus mastering or MSI-X off, or no such vector).
    pub interrupts_dropped: u64,
    /// Interrupts left pending by a mask.
    pub interrupts_pended: u64,
    /// Interrupts sent.
    pub interrupts_sent: u64,
}

/// One PCIe function: configuration space, MSI-X, and a blocking model behind its BARs.
#[derive(Debug)]
pub struct BlockingFunction<B> {
    config: ConfigSpace,
    msix: Option<MsixTable>,
    msix_recheck: bool,
    device: B,
    counters: BlockingCounters,
}

/// The [`HostAccess`] a model sees: checks bus mastering, sends MSI-X through the table.
struct Access<'a> {
    config: &'a ConfigSpace,
    msix: Option<&'a mut MsixTable>,
    path: &'a mut dyn DmaPath,
    counters: &'a mut BlockingCounters,
}

impl Access<'_> {
    fn send_msi(&mut self, msg: MsiMessage) {
        if self.path.write(msg.address, &msg.data.to_le_bytes()).is_ok() {
            self.counters.interrupts_sent += 1;
        } else {
            self.counters.interrupts_dropped += 1;
        }
    }
}

impl HostAccess for Access<'_> {
    fn read(&mut self, address: u64, buf: &mut [u8]) -> core::result::Result<(), DmaError> {
        if !self.config.bus_master() {
            self.counters.dma_refused += 1;
            return Err(DmaError::BusMasterDisabled);
        }
        self.path.read(address, buf)
    }

    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> core::result::Result<(), DmaError> {
        if !self.config.bus_master() {
            self.counters.dma_refused += 1;
            return Err(DmaError::BusMasterDisabled);
        }
        self.path.read_many(reads)
    }

    fn read_owned(&mut self, reads: &[(u64, usize)]) -> core::result::Result<Vec<Vec<u8>>, DmaError> {
        if !self.config.bus_master() {
            self.counters.dma_refused += 1;
            return Err(DmaError::BusMasterDisabled);
        }
        self.path.read_owned(reads)
    }

    fn write(&mut self, address: u64, data: &[u8]) -> core::result::Result<(), DmaError> {
        if !self.config.bus_master() {
            self.counters.dma_refused += 1;
            return Err(DmaError::BusMasterDisabled);
        }
        self.path.write(address, data)
    }

    fn prefetch(&mut self, address: u64, len: usize) {
        // A read that could not leave now will not be asked for either.
        if self.config.bus_master() {
            self.path.prefetch(address, len);
        }
    }

    fn signal_msix(&mut self, vector: u16) {
        let (en, masked) = (self.config.msix_enabled(), self.config.msix_function_masked());
        let bus_master = self.config.bus_master();
        let Some(table) = self.msix.as_deref_mut().filter(|_| bus_master && en) else {
            self.counters.interrupts_dropped += 1;
            return;
        };
        if usize::from(vector) >= table.len() {
            self.counters.interrupts_dropped += 1;
            return;
        }
        match table.signal(vector, en, masked) {
            Some(msg) => self.send_msi(msg),
            None => self.counters.interrupts_pended += 1,
        }
    }
}

impl<B: BlockingDevice> BlockingFunction<B> {
    /// Builds the function around `device`.
    pub fn new(device: B) -> Result<BlockingFunction<B>> {
        let config = ConfigSpace::new(device.config_spec())?;
        let msix = config.spec().msix.map(|m| MsixTable::new(m.table_size));
        Ok(BlockingFunction { config, msix, msix_recheck: false, device, counters: Default::default() })
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

    /// The model.
    pub fn device(&self) -> &B {
        &self.device
    }

    /// The model, mutably.
    pub fn device_mut(&mut self) -> &mut B {
        &mut self.device
    }

    /// What could not be done so far.
    pub fn counters(&self) -> BlockingCounters {
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
    }

    fn msix_region(&self, bar: usize, offset: u64, len: usize) -> Option<(u8, u64)> {
        let spec = self.config.spec().msix?;
        let table = self.msix.as_ref()?;
        let regions = [
            (0u8, spec.table_bar, u64::from(spec.table_offset), table.table_len()),
            (1u8, spec.pba_bar, u64::from(spec.pba_offset), table.pba_len()),
        ];
        regions.into_iter().find_map(|(which, b, start, size)| {
            let off = offset.checked_sub(start)?;
            (usize::from(b) == bar && off.checked_add(len as u64)? <= size as u64).then_some((which, off))
        })
    }

    /// A memory read request to the function's BARs.
    pub fn memory_read(&mut self, address: u64, data: &mut [u8]) -> core::result::Result<(), MmioError> {
        let (bar, offset) =
            self.config.decode_memory(address, data.len() as u64).ok_or(MmioError::Unsupported)?;
        if let Some((which, off)) = self.msix_region(bar, offset, data.len()) {
            let Some(t) = self.msix.as_ref() else { return Err(MmioError::Abort) };
            let ok = if which == 0 { t.read_table(off, data) } else { t.read_pba(off, data) };
            return if ok { Ok(()) } else { Err(MmioError::Abort) };
        }
        self.device.bar_read(bar, offset, data).map_err(|_| MmioError::Abort)
    }

    /// A memory write request to the function's BARs (posted: the error is for counting).
    pub fn memory_write(&mut self, address: u64, data: &[u8]) -> core::result::Result<(), MmioError> {
        let (bar, offset) =
            self.config.decode_memory(address, data.len() as u64).ok_or(MmioError::Unsupported)?;
        if let Some((which, off)) = self.msix_region(bar, offset, data.len()) {
            if which == 0 {
                if let Some(t) = self.msix.as_mut() {
                    t.write_table(off, data);
                }
                self.msix_recheck = true;
            }
            return Ok(());
        }
        self.device.bar_write(bar, offset, data);
        Ok(())
    }

    /// Whether a memory request of `len` bytes at `address` may be served on a thread that must
    /// not wait: MSI-X table and PBA accesses always, the model's BARs as it says
    /// ([`BlockingDevice::serves_inline`]).
    pub fn serves_inline(&self, address: u64, len: usize, write: bool) -> bool {
        let Some((bar, offset)) = self.config.decode_memory(address, len as u64) else { return true };
        self.msix_region(bar, offset, len).is_some() || self.device.serves_inline(bar, offset, write)
    }

    /// Whether [`process`](Self::process) has something to do: the model's work, or MSI-X
    /// messages left pending by a mask that may have been lifted.
    pub fn has_work(&self) -> bool {
        self.msix_recheck || self.device.has_work()
    }

    /// Hands the model the waker of the thread that runs it ([`BlockingDevice::set_waker`]).
    pub fn set_waker(&mut self, waker: Waker) {
        self.device.set_waker(waker);
    }

    /// Sends pending MSI-X messages whose mask was lifted, then runs the model's work with
    /// blocking access to the host through `path`. Returns the units of work done.
    pub fn process(&mut self, path: &mut dyn DmaPath) -> usize {
        self.run(path, false)
    }

    /// What [`process`](Self::process) does, limited to the model's
    /// [`process_posted`](BlockingDevice::process_posted): the work that needs no host read to
    /// wait. A read gets only what `path` holds already ([`DmaPath::read_ready`]) and fails with
    /// [`DmaError::WouldBlock`] otherwise; a prefetch reaches `path`.
    pub fn process_posted(&mut self, path: &mut dyn DmaPath) -> usize {
        /// `path` with reads refused, but for data it holds already.
        struct NoReads<'a>(&'a mut dyn DmaPath);
        impl DmaPath for NoReads<'_> {
            fn read(&mut self, address: u64, buf: &mut [u8]) -> core::result::Result<(), DmaError> {
                self.0.read_ready(address, buf)
            }
            fn read_owned(&mut self, reads: &[(u64, usize)]) -> core::result::Result<Vec<Vec<u8>>, DmaError> {
                reads.iter().map(|&(address, len)| self.0.read_ready_owned(address, len)).collect()
            }
            fn write(&mut self, address: u64, data: &[u8]) -> core::result::Result<(), DmaError> {
                self.0.write(address, data)
            }
            fn prefetch(&mut self, address: u64, len: usize) {
                self.0.prefetch(address, len);
            }
        }
        self.run(&mut NoReads(path), true)
    }

    fn run(&mut self, path: &mut dyn DmaPath, posted_only: bool) -> usize {
        let mut done = 0;
        let BlockingFunction { config, msix, msix_recheck, device, counters } = self;
        let mut access = Access { config, msix: msix.as_mut(), path, counters };
        if std::mem::take(msix_recheck) && access.config.bus_master() {
            let (en, masked) = (access.config.msix_enabled(), access.config.msix_function_masked());
            while let Some((_, msg)) = access.msix.as_deref_mut().and_then(|t| t.poll_pending(en, masked)) {
                access.send_msi(msg);
                done += 1;
            }
        }
        if device.has_work() {
            done +=
                if posted_only { device.process_posted(&mut access) } else { device.process(&mut access) };
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{command, reg, Bar, BarKind, MsixSpec, MSIX_CAP_OFFSET, MSIX_ENABLE};

    /// Copies 8 bytes from host 0x1000 to 0x2000 and raises vector 1 when rung; its posted work
    /// reads 4 KiB at 0x3000 into a buffer of their own.
    struct Model {
        rung: bool,
        result: Option<core::result::Result<(), DmaError>>,
        posted: Option<core::result::Result<Vec<Vec<u8>>, DmaError>>,
    }

    impl BlockingDevice for Model {
        fn config_spec(&self) -> ConfigSpec {
            ConfigSpec::new(1, 2, 0x010000)
                .with_bar(0, Bar { kind: BarKind::Memory32 { prefetchable: false }, size: 4096 })
                .with_msix(MsixSpec {
                    table_size: 2,
                    table_bar: 0,
                    table_offset: 0x800,
                    pba_bar: 0,
                    pba_offset: 0xc00,
                })
        }
        fn bar_read(
            &mut self,
            _: usize,
            _: u64,
            data: &mut [u8],
        ) -> core::result::Result<(), CompleterAbort> {
            data.fill(0x5a);
            Ok(())
        }
        fn bar_write(&mut self, _: usize, _: u64, _: &[u8]) {
            self.rung = true;
        }
        fn has_work(&self) -> bool {
            self.rung
        }
        fn process(&mut self, host: &mut dyn HostAccess) -> usize {
            self.rung = false;
            let mut b = [0u8; 8];
            self.result = Some(host.read(0x1000, &mut b).and_then(|()| host.write(0x2000, &b)));
            host.signal_msix(1);
            1
        }
        fn process_posted(&mut self, host: &mut dyn HostAccess) -> usize {
            self.posted = Some(host.read_owned(&[(0x3000, 4096)]));
            1
        }
    }

    #[derive(Default)]
    struct Memory {
        writes: Vec<(u64, Vec<u8>)>,
    }

    impl DmaPath for Memory {
        fn read(&mut self, address: u64, buf: &mut [u8]) -> core::result::Result<(), DmaError> {
            buf.fill(address as u8 + 1);
            Ok(())
        }
        fn write(&mut self, address: u64, data: &[u8]) -> core::result::Result<(), DmaError> {
            self.writes.push((address, data.to_vec()));
            Ok(())
        }
    }

    fn function() -> BlockingFunction<Model> {
        let mut f = BlockingFunction::new(Model { rung: false, result: None, posted: None }).unwrap();
        f.config_write(reg::BAR0, 0xf, 0xfe00_0000u32.to_le_bytes());
        f
    }

    #[test]
    fn dma_needs_bus_mastering() {
        let mut f = function();
        f.config_write(reg::COMMAND, 0b11, (command::MEMORY_SPACE as u32).to_le_bytes());
        f.memory_write(0xfe00_0000, &[1, 0, 0, 0]).unwrap();
        let mut mem = Memory::default();
        assert_eq!(f.process(&mut mem), 1);
        assert_eq!(f.device().result, Some(Err(DmaError::BusMasterDisabled)));
        assert!(mem.writes.is_empty());
        assert_eq!(f.counters().dma_refused, 1);
        assert_eq!(f.counters().interrupts_dropped, 1);
    }

    #[test]
    fn dma_and_a_masked_vector_sent_once_unmasked() {
        let mut f = function();
        let cmd = (command::MEMORY_SPACE | command::BUS_MASTER) as u32;
        f.config_write(reg::COMMAND, 0b11, cmd.to_le_bytes());
        f.config_write(MSIX_CAP_OFFSET, 0b1100, ((MSIX_ENABLE as u32) << 16).to_le_bytes());
        // Vector 1's entry: address 0xfee0_0000, data 7, still masked (entries reset masked).
        let entry = 0xfe00_0000 + 0x800 + 16;
        f.memory_write(entry, &0xfee0_0000u32.to_le_bytes()).unwrap();
        f.memory_write(entry + 8, &7u32.to_le_bytes()).unwrap();
        let mut mem = Memory::default();
        f.process(&mut mem);
        f.memory_write(0xfe00_0000, &[1, 0, 0, 0]).unwrap();
        assert!(f.has_work());
        f.process(&mut mem);
        assert_eq!(f.device().result, Some(Ok(())));
        assert_eq!(mem.writes, vec![(0x2000, vec![1; 8])]);
        assert_eq!(f.counters().interrupts_pended, 1);
        // Unmask: the pending message goes out on the next process, exactly once.
        f.memory_write(entry + 12, &0u32.to_le_bytes()).unwrap();
        assert!(f.has_work());
        f.process(&mut mem);
        f.process(&mut mem);
        assert_eq!(mem.writes.len(), 2);
        assert_eq!(mem.writes[1], (0xfee0_0000, 7u32.to_le_bytes().to_vec()));
        // MSI-X structures never reach the model.
        let mut b = [0u8; 4];
        f.memory_read(entry + 8, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 7);
    }

    /// A path that holds the data of one ended prefetch, in a buffer of its own.
    struct Held(Option<(u64, Vec<u8>)>);

    impl DmaPath for Held {
        fn read(&mut self, _: u64, _: &mut [u8]) -> core::result::Result<(), DmaError> {
            Err(DmaError::Timeout)
        }
        fn write(&mut self, _: u64, _: &[u8]) -> core::result::Result<(), DmaError> {
            Ok(())
        }
        fn read_ready_owned(&mut self, address: u64, len: usize) -> core::result::Result<Vec<u8>, DmaError> {
            match self.0.take() {
                Some((a, data)) if (a, data.len()) == (address, len) => Ok(data),
                _ => Err(DmaError::WouldBlock),
            }
        }
    }

    #[test]
    fn posted_work_is_handed_the_buffer_a_prefetch_arrived_in() {
        let mut f = function();
        let cmd = (command::MEMORY_SPACE | command::BUS_MASTER) as u32;
        f.config_write(reg::COMMAND, 0b11, cmd.to_le_bytes());
        f.memory_write(0xfe00_0000, &[1, 0, 0, 0]).unwrap();
        let data = vec![0x77; 4096];
        let at = data.as_ptr();
        let mut path = Held(Some((0x3000, data)));
        assert_eq!(f.process_posted(&mut path), 1);
        let got = f.device_mut().posted.take().unwrap().unwrap();
        assert_eq!(got.len(), 1);
        assert!(got[0] == vec![0x77; 4096]);
        assert_eq!(got[0].as_ptr(), at, "the very buffer, not a copy");
        // Nothing held: the read would have to wait, which posted work may not.
        assert_eq!(f.process_posted(&mut path), 1);
        assert_eq!(f.device_mut().posted.take(), Some(Err(DmaError::WouldBlock)));
    }

    #[test]
    fn owned_reads_come_back_in_order_and_need_bus_mastering() {
        let mut mem = Memory::default();
        let got = mem.read_owned(&[(0x10, 3), (0x20, 0), (0x30, 5)]).unwrap();
        assert_eq!(got, vec![vec![0x11; 3], vec![], vec![0x31; 5]]);

        let mut config = ConfigSpace::new(ConfigSpec::new(1, 2, 0)).unwrap();
        let mut counters = BlockingCounters::default();
        let mut access = Access { path: &mut mem, config: &config, msix: None, counters: &mut counters };
        assert_eq!(access.read_owned(&[(0x10, 3)]), Err(DmaError::BusMasterDisabled));
        assert_eq!(counters.dma_refused, 1);
        config.write(reg::COMMAND, 0b11, (command::BUS_MASTER as u32).to_le_bytes());
        let mut access = Access { path: &mut mem, config: &config, msix: None, counters: &mut counters };
        assert_eq!(access.read_owned(&[(0x40, 2)]), Ok(vec![vec![0x41; 2]]));
    }
}
