//! The same hosted functions driven in-process, with no fabric: the ceiling the bridges are
//! measured against (`lanbus bench pcie`, row `local`), and a quick way to exercise a model.
//!
//! Layer: pcie engine. Single-threaded: every call runs the functions' work to completion on the
//! caller's thread. DMA goes straight to [`DmaRegion`]s; a write into the MSI-X window counts an
//! interrupt. Setup assigns BARs, max payload/read request sizes and MSI-X vectors the way the
//! host bridge does, without configuration TLPs.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::hosted::{Hosted, HostedFunction, OpId, Path};
use crate::region::{DmaRegion, RegionMap};
use crate::{BridgeError, BridgeResult};
use lanbus_pcie::config::{command, reg, BarKind, MSIX_CAP_OFFSET, MSIX_ENABLE, PCIE_CAP_OFFSET};
use lanbus_pcie::device::{DmaError, MmioError};
use lanbus_pcie::CplStatus;

/// Host memory and the MSI-X window, seen by local functions.
struct LocalPath {
    regions: RegionMap,
    msix_base: u64,
    /// Interrupts by (function, vector).
    interrupts: HashMap<(usize, u16), u64>,
    current: usize,
    next_op: OpId,
    finished: VecDeque<(OpId, Result<Vec<u8>, DmaError>)>,
}

impl Path for LocalPath {
    fn start_read(&mut self, address: u64, len: usize) -> OpId {
        let id = self.next_op;
        self.next_op += 1;
        let result = match self.regions.find(address, len as u64) {
            Some((r, off)) => {
                let mut buf = vec![0; len];
                r.read(off, &mut buf);
                Ok(buf)
            }
            None => Err(DmaError::Completion(CplStatus::UnsupportedRequest)),
        };
        self.finished.push_back((id, result));
        id
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), DmaError> {
        if address == self.msix_base && data.len() == 4 {
            let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as u16;
            *self.interrupts.entry((self.current, v)).or_default() += 1;
            return Ok(());
        }
        if let Some((r, off)) = self.regions.find(address, data.len() as u64) {
            r.write(off, data);
        }
        Ok(())
    }

    fn poll_read(&mut self) -> Option<(OpId, Result<Vec<u8>, DmaError>)> {
        self.finished.pop_front()
    }

    fn wait_read(&mut self, op: OpId) -> Result<Vec<u8>, DmaError> {
        let i = self.finished.iter().position(|(id, _)| *id == op).ok_or(DmaError::Timeout)?;
        self.finished.remove(i).expect("found").1
    }

    fn set_limits(&mut self, _mps: usize, _mrrs: usize) {}
}

/// Functions on an in-process bus.
pub struct LocalBus {
    functions: Vec<Box<dyn Hosted>>,
    path: LocalPath,
}

impl LocalBus {
    /// Puts `functions` on the bus and sets each up like the host bridge would: BARs from
    /// `bar_base` up (aligned to size), max payload `mps` and read request `mrrs`, memory space
    /// and bus mastering on, every MSI-X vector pointed at `msix_base` with data = vector.
    pub fn new(
        functions: Vec<HostedFunction>,
        bar_base: u64,
        msix_base: u64,
        mps: usize,
        mrrs: usize,
    ) -> BridgeResult<LocalBus> {
        let mut bus = LocalBus {
            functions: functions.into_iter().map(|f| f.inner).collect(),
            path: LocalPath {
                regions: RegionMap::default(),
                msix_base,
                interrupts: HashMap::new(),
                current: 0,
                next_op: 0,
                finished: VecDeque::new(),
            },
        };
        let mut next = bar_base;
        for f in bus.functions.iter_mut() {
            let spec = f.config().spec().clone();
            for (i, bar) in spec.bars.iter().enumerate() {
                let Some(bar) = bar else { continue };
                if bar.kind == BarKind::Io {
                    continue;
                }
                let at = next.next_multiple_of(bar.size);
                next = at + bar.size;
                let off = reg::BAR0 + 4 * i as u16;
                f.config_write(off, 0xf, (at as u32).to_le_bytes());
                if matches!(bar.kind, BarKind::Memory64 { .. }) {
                    f.config_write(off + 4, 0xf, ((at >> 32) as u32).to_le_bytes());
                }
            }
            let code = |b: usize| (b.clamp(128, 4096).trailing_zeros() - 7) as u16;
            let ctl = code(mps) << 5 | code(mrrs) << 12;
            f.config_write(PCIE_CAP_OFFSET + 8, 0b0011, [ctl as u8, (ctl >> 8) as u8, 0, 0]);
            let cmd = command::MEMORY_SPACE | command::BUS_MASTER;
            f.config_write(reg::COMMAND, 0b0011, [cmd as u8, (cmd >> 8) as u8, 0, 0]);
            if let Some(m) = spec.msix {
                let table = f.config().bar_address(usize::from(m.table_bar)).unwrap_or(0);
                for v in 0..u32::from(m.table_size) {
                    let mut e = [0u8; 16];
                    e[0..4].copy_from_slice(&(msix_base as u32).to_le_bytes());
                    e[4..8].copy_from_slice(&((msix_base >> 32) as u32).to_le_bytes());
                    e[8..12].copy_from_slice(&v.to_le_bytes());
                    let _ = f.memory_write(table + u64::from(m.table_offset) + 16 * u64::from(v), &e);
                }
                let mc = MSIX_ENABLE.to_le_bytes();
                f.config_write(MSIX_CAP_OFFSET, 0b1100, [0, 0, mc[0], mc[1]]);
            }
        }
        Ok(bus)
    }

    /// The address BAR `bar` of function `index` got.
    pub fn bar_address(&self, index: usize, bar: usize) -> Option<u64> {
        self.functions.get(index)?.config().bar_address(bar)
    }

    /// Lends `region` at `bus_addr`.
    pub fn add_region(&mut self, bus_addr: u64, region: Arc<dyn DmaRegion>) -> BridgeResult<()> {
        self.path.regions.add(bus_addr, region).map_err(BridgeError::BadRequest)
    }

    /// A memory read of function `index`, then its work run to completion.
    pub fn mmio_read(&mut self, index: usize, address: u64, buf: &mut [u8]) -> BridgeResult<()> {
        let f =
            self.functions.get_mut(index).ok_or(BridgeError::BadRequest(format!("no function {index}")))?;
        let r = f.memory_read(address, buf).map_err(|e| match e {
            MmioError::Unsupported => BridgeError::Completion(CplStatus::UnsupportedRequest),
            _ => BridgeError::Completion(CplStatus::CompleterAbort),
        });
        self.run();
        r
    }

    /// A memory write to function `index`, then its work run to completion.
    pub fn mmio_write(&mut self, index: usize, address: u64, data: &[u8]) -> BridgeResult<()> {
        let f =
            self.functions.get_mut(index).ok_or(BridgeError::BadRequest(format!("no function {index}")))?;
        let _ = f.memory_write(address, data);
        self.run();
        Ok(())
    }

    /// Runs every function's work until none progresses.
    pub fn run(&mut self) {
        loop {
            let mut work = 0;
            for (i, f) in self.functions.iter_mut().enumerate() {
                self.path.current = i;
                work += f.run(&mut self.path);
            }
            if work == 0 {
                return;
            }
        }
    }

    /// Interrupts function `index` raised on `vector`.
    pub fn interrupt_count(&self, index: usize, vector: u16) -> u64 {
        self.path.interrupts.get(&(index, vector)).copied().unwrap_or(0)
    }
}
