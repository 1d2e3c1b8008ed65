//! A PCIe function's configuration space (type 0 header) and its MSI-X table.
//!
//! Layer: pcie engine, device side; plain state, no I/O. Implements PCI Local Bus 3.0 chapter 6
//! (type 0 header: IDs, command/status, BARs sized by writing all ones), PCI Express Base
//! Specification 7.5.3 (PCI Express capability: Device Capabilities Max_Payload_Size Supported,
//! Device Control Max_Payload_Size and Max_Read_Request_Size) and 7.7.2 (MSI-X capability, table
//! and Pending Bit Array inside a BAR).
//!
//! Invariants: every byte of the 4 KiB space has a write mask (bits software may change) and a
//! write-1-to-clear mask, fixed when the space is built, so no write can change a read-only bit
//! (IDs, class, header type, BAR type and size bits, capability structure) and RW1C status bits
//! only clear. Accesses outside the space read as zero and write nothing. Capability pointers are
//! distrusted when walked ([`walk_capabilities`]): loops and pointers into the header end the walk.

use crate::{Error, Result};

/// Bytes of PCIe (extended) configuration space.
pub const CONFIG_SPACE_LEN: usize = 4096;

/// Register offsets of the type 0 header.
pub mod reg {
    /// Vendor ID (16 bits).
    pub const VENDOR_ID: u16 = 0x00;
    /// Device ID (16 bits).
    pub const DEVICE_ID: u16 = 0x02;
    /// Command (16 bits).
    pub const COMMAND: u16 = 0x04;
    /// Status (16 bits).
    pub const STATUS: u16 = 0x06;
    /// Revision ID (8 bits).
    pub const REVISION_ID: u16 = 0x08;
    /// Class code (24 bits: programming interface, subclass, base class).
    pub const CLASS_CODE: u16 = 0x09;
    /// Cache line size (8 bits).
    pub const CACHE_LINE_SIZE: u16 = 0x0c;
    /// Header type (8 bits).
    pub const HEADER_TYPE: u16 = 0x0e;
    /// BAR 0 (BAR n at 0x10 + 4n).
    pub const BAR0: u16 = 0x10;
    /// Subsystem vendor ID (16 bits).
    pub const SUBSYSTEM_VENDOR_ID: u16 = 0x2c;
    /// Subsystem ID (16 bits).
    pub const SUBSYSTEM_ID: u16 = 0x2e;
    /// Capabilities pointer (8 bits).
    pub const CAPABILITIES: u16 = 0x34;
    /// Interrupt line (8 bits).
    pub const INTERRUPT_LINE: u16 = 0x3c;
    /// Interrupt pin (8 bits).
    pub const INTERRUPT_PIN: u16 = 0x3d;
}

/// Command register bits.
pub mod command {
    /// I/O space enable.
    pub const IO_SPACE: u16 = 1 << 0;
    /// Memory space enable.
    pub const MEMORY_SPACE: u16 = 1 << 1;
    /// Bus master enable (the function may issue memory requests, MSI-X included).
    pub const BUS_MASTER: u16 = 1 << 2;
    /// Parity error response.
    pub const PARITY_ERROR_RESPONSE: u16 = 1 << 6;
    /// SERR# enable.
    pub const SERR: u16 = 1 << 8;
    /// INTx emulation disable.
    pub const INTX_DISABLE: u16 = 1 << 10;
    /// Every writable bit.
    pub const WRITABLE: u16 =
        IO_SPACE | MEMORY_SPACE | BUS_MASTER | PARITY_ERROR_RESPONSE | SERR | INTX_DISABLE;
}

/// Status register bits.
pub mod status {
    /// Capabilities list present (read-only, set).
    pub const CAPABILITIES_LIST: u16 = 1 << 4;
    /// Master data parity error (RW1C).
    pub const MASTER_DATA_PARITY_ERROR: u16 = 1 << 8;
    /// Signaled target abort (RW1C).
    pub const SIGNALED_TARGET_ABORT: u16 = 1 << 11;
    /// Received target abort (RW1C).
    pub const RECEIVED_TARGET_ABORT: u16 = 1 << 12;
    /// Received master abort (RW1C; an Unsupported Request completion was received).
    pub const RECEIVED_MASTER_ABORT: u16 = 1 << 13;
    /// Signaled system error (RW1C).
    pub const SIGNALED_SYSTEM_ERROR: u16 = 1 << 14;
    /// Detected parity error (RW1C).
    pub const DETECTED_PARITY_ERROR: u16 = 1 << 15;
    /// Every write-1-to-clear bit.
    pub const RW1C: u16 = MASTER_DATA_PARITY_ERROR
        | SIGNALED_TARGET_ABORT
        | RECEIVED_TARGET_ABORT
        | RECEIVED_MASTER_ABORT
        | SIGNALED_SYSTEM_ERROR
        | DETECTED_PARITY_ERROR;
}

/// Capability IDs.
pub mod cap_id {
    /// PCI Express capability.
    pub const PCI_EXPRESS: u8 = 0x10;
    /// MSI-X capability.
    pub const MSIX: u8 = 0x11;
    /// Vendor-specific capability (virtio's structures are these).
    pub const VENDOR: u8 = 0x09;
}

/// Offset of the PCI Express capability in spaces this module builds.
pub const PCIE_CAP_OFFSET: u16 = 0x40;
/// Length of the PCI Express capability structure (version 2).
pub const PCIE_CAP_LEN: u16 = 0x3c;
/// Offset of the MSI-X capability when there is a PCI Express capability before it.
pub const MSIX_CAP_OFFSET: u16 = 0x80;

/// What a BAR decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BarKind {
    /// Memory, 32-bit address.
    Memory32 {
        /// Prefetchable.
        prefetchable: bool,
    },
    /// Memory, 64-bit address (takes this BAR and the next).
    Memory64 {
        /// Prefetchable.
        prefetchable: bool,
    },
    /// I/O space.
    Io,
}

/// One BAR: its kind and size in bytes (a power of two: 16 bytes .. 2^63 for memory, 4 .. 256
/// for I/O; at most 2 GiB for 32-bit memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bar {
    /// What it decodes.
    pub kind: BarKind,
    /// Size in bytes.
    pub size: u64,
}

impl Bar {
    /// The read-only low bits of the BAR register.
    const fn type_bits(&self) -> u32 {
        match self.kind {
            BarKind::Io => 1,
            BarKind::Memory32 { prefetchable } => (prefetchable as u32) << 3,
            BarKind::Memory64 { prefetchable } => (prefetchable as u32) << 3 | 0b100,
        }
    }
}

/// Where the MSI-X table and PBA live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsixSpec {
    /// Number of vectors (1..=2048).
    pub table_size: u16,
    /// BAR holding the table.
    pub table_bar: u8,
    /// Offset of the table in that BAR (8-byte aligned).
    pub table_offset: u32,
    /// BAR holding the PBA.
    pub pba_bar: u8,
    /// Offset of the PBA in that BAR (8-byte aligned).
    pub pba_offset: u32,
}

/// What a function's configuration space holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigSpec {
    /// Vendor ID.
    pub vendor_id: u16,
    /// Device ID.
    pub device_id: u16,
    /// Revision ID.
    pub revision_id: u8,
    /// Class code (base class << 16 | subclass << 8 | programming interface).
    pub class_code: u32,
    /// Subsystem vendor ID.
    pub subsystem_vendor_id: u16,
    /// Subsystem ID.
    pub subsystem_id: u16,
    /// Interrupt pin (0 none, 1..=4 INTA..INTD).
    pub interrupt_pin: u8,
    /// BARs 0..=5 (the slot after a 64-bit BAR must be `None`).
    pub bars: [Option<Bar>; 6],
    /// Max payload size supported in bytes (128..=4096); a PCI Express capability is always
    /// present.
    pub max_payload_supported: u16,
    /// MSI-X, if the function has it.
    pub msix: Option<MsixSpec>,
    /// Vendor-specific capabilities (ID 09h, PCI Local Bus 6.7): each entry is the structure's
    /// bytes after its ID and next pointer (so byte 0 is the length field, which is set here).
    /// They follow the MSI-X capability, in order, dword aligned; read-only.
    pub vendor_caps: Vec<Vec<u8>>,
}

impl ConfigSpec {
    /// A function with these IDs and class, no BARs, MPS supported 512, no MSI-X.
    pub fn new(vendor_id: u16, device_id: u16, class_code: u32) -> ConfigSpec {
        ConfigSpec {
            vendor_id,
            device_id,
            revision_id: 0,
            class_code,
            subsystem_vendor_id: vendor_id,
            subsystem_id: device_id,
            interrupt_pin: 0,
            bars: [None; 6],
            max_payload_supported: 512,
            msix: None,
            vendor_caps: Vec::new(),
        }
    }

    /// Sets BAR `index`.
    pub fn with_bar(mut self, index: usize, bar: Bar) -> ConfigSpec {
        if let Some(slot) = self.bars.get_mut(index) {
            *slot = Some(bar);
        }
        self
    }

    /// Sets the MSI-X capability.
    pub fn with_msix(mut self, msix: MsixSpec) -> ConfigSpec {
        self.msix = Some(msix);
        self
    }

    /// Adds a vendor-specific capability whose bytes after the ID and next pointer are `body`
    /// (`body[0]`, the length, is filled in).
    pub fn with_vendor_cap(mut self, body: Vec<u8>) -> ConfigSpec {
        self.vendor_caps.push(body);
        self
    }
}

fn pow2_code(bytes: u16) -> Option<u16> {
    (bytes.is_power_of_two() && (128..=4096).contains(&bytes)).then(|| bytes.trailing_zeros() as u16 - 7)
}

/// A function's configuration space.
#[derive(Debug, Clone)]
pub struct ConfigSpace {
    bytes: Vec<u8>,
    wmask: Vec<u8>,
    w1c: Vec<u8>,
    spec: ConfigSpec,
}

impl ConfigSpace {
    /// Builds the space, checking the spec (BAR sizes and placement, MSI-X structures inside
    /// memory BARs). Errors are [`Error::BadConfig`].
    pub fn new(spec: ConfigSpec) -> Result<ConfigSpace> {
        let bad = |m: String| Err(Error::BadConfig(m));
        let mut s = ConfigSpace {
            bytes: vec![0; CONFIG_SPACE_LEN],
            wmask: vec![0; CONFIG_SPACE_LEN],
            w1c: vec![0; CONFIG_SPACE_LEN],
            spec: spec.clone(),
        };
        s.put16(reg::VENDOR_ID, spec.vendor_id);
        s.put16(reg::DEVICE_ID, spec.device_id);
        s.put16(reg::STATUS, status::CAPABILITIES_LIST);
        s.bytes[usize::from(reg::REVISION_ID)] = spec.revision_id;
        if spec.class_code >> 24 != 0 {
            return bad(format!("class code {:#x} is wider than 24 bits", spec.class_code));
        }
        s.bytes[0x09..0x0c].copy_from_slice(&spec.class_code.to_le_bytes()[..3]);
        s.put16(reg::SUBSYSTEM_VENDOR_ID, spec.subsystem_vendor_id);
        s.put16(reg::SUBSYSTEM_ID, spec.subsystem_id);
        if spec.interrupt_pin > 4 {
            return bad(format!("interrupt pin {}", spec.interrupt_pin));
        }
        s.bytes[usize::from(reg::INTERRUPT_PIN)] = spec.interrupt_pin;
        s.mask16(reg::COMMAND, command::WRITABLE, 0);
        s.mask16(reg::STATUS, 0, status::RW1C);
        s.wmask[usize::from(reg::CACHE_LINE_SIZE)] = 0xff;
        s.wmask[usize::from(reg::INTERRUPT_LINE)] = 0xff;

        let mut i = 0;
        while i < 6 {
            let Some(bar) = spec.bars[i] else {
                i += 1;
                continue;
            };
            let off = reg::BAR0 + 4 * i as u16;
            let size_ok = bar.size.is_power_of_two()
                && match bar.kind {
                    BarKind::Io => (4..=256).contains(&bar.size),
                    BarKind::Memory32 { .. } => (16..=1 << 31).contains(&bar.size),
                    BarKind::Memory64 { .. } => (16..=1 << 63).contains(&bar.size),
                };
            if !size_ok {
                return bad(format!("BAR {i}: size {:#x} for {:?}", bar.size, bar.kind));
            }
            let addr_mask = !(bar.size - 1);
            let low_type = if bar.kind == BarKind::Io { 0x3 } else { 0xf };
            s.put32(off, bar.type_bits());
            s.mask32(off, addr_mask as u32 & !low_type, 0);
            if let BarKind::Memory64 { .. } = bar.kind {
                if i == 5 || spec.bars[i + 1].is_some() {
                    return bad(format!("BAR {i} is 64-bit: BAR {} must be free", i + 1));
                }
                s.mask32(off + 4, (addr_mask >> 32) as u32, 0);
                i += 1;
            }
            i += 1;
        }

        // PCI Express capability, version 2, endpoint.
        let c = PCIE_CAP_OFFSET;
        let Some(mps_code) = pow2_code(spec.max_payload_supported) else {
            return bad(format!("max payload size supported {}", spec.max_payload_supported));
        };
        s.bytes[usize::from(reg::CAPABILITIES)] = c as u8;
        s.bytes[usize::from(c)] = cap_id::PCI_EXPRESS;
        s.put16(c + 2, 0x0002);
        // Device capabilities: MPS supported, role-based error reporting.
        s.put32(c + 4, u32::from(mps_code) | 1 << 15);
        // Device control: relaxed ordering and no snoop enabled, MPS 128, MRRS 512 (the reset
        // values); error enables, MPS, extended tags, no snoop, MRRS writable.
        s.put16(c + 8, 1 << 4 | 1 << 11 | 2 << 12);
        s.mask16(c + 8, 0x79ff, 0);
        // Device status: error detected bits RW1C.
        s.mask16(c + 0x0a, 0, 0x000f);
        // Link: 2.5 GT/s x1, up.
        s.put32(c + 0x0c, 0x11);
        s.mask16(c + 0x10, 0x00cb, 0);
        s.put16(c + 0x12, 0x11);
        // Device capabilities 2: completion timeout disable, 10-bit tag completer and requester.
        s.put32(c + 0x24, 1 << 4 | 1 << 16 | 1 << 17);
        // Device control 2: completion timeout value/disable, 10-bit tag requester enable.
        s.mask16(c + 0x28, 0x101f, 0);

        if let Some(m) = spec.msix {
            if !(1..=2048).contains(&m.table_size) {
                return bad(format!("MSI-X table size {}", m.table_size));
            }
            let table_len = u64::from(m.table_size) * 16;
            let pba_len = u64::from(m.table_size).div_ceil(64) * 8;
            for (what, bir, off, len) in
                [("table", m.table_bar, m.table_offset, table_len), ("PBA", m.pba_bar, m.pba_offset, pba_len)]
            {
                let bar = spec.bars.get(usize::from(bir)).copied().flatten();
                match bar {
                    Some(Bar { kind: BarKind::Memory32 { .. } | BarKind::Memory64 { .. }, size })
                        if off % 8 == 0 && u64::from(off) + len <= size => {}
                    _ => {
                        return bad(format!(
                            "MSI-X {what} ({len} bytes at {off:#x} in BAR {bir}) is not inside a memory BAR"
                        ))
                    }
                }
            }
            let (t0, t1) = (u64::from(m.table_offset), u64::from(m.table_offset) + table_len);
            let (p0, p1) = (u64::from(m.pba_offset), u64::from(m.pba_offset) + pba_len);
            if m.table_bar == m.pba_bar && t0 < p1 && p0 < t1 {
                return bad("MSI-X table and PBA overlap".into());
            }
            let x = MSIX_CAP_OFFSET;
            s.bytes[usize::from(c) + 1] = x as u8;
            s.bytes[usize::from(x)] = cap_id::MSIX;
            s.put16(x + 2, m.table_size - 1);
            s.mask16(x + 2, MSIX_ENABLE | MSIX_FUNCTION_MASK, 0);
            s.put32(x + 4, m.table_offset | u32::from(m.table_bar));
            s.put32(x + 8, m.pba_offset | u32::from(m.pba_bar));
        }

        // Vendor-specific capabilities, chained after the last capability above.
        let mut last = if spec.msix.is_some() { MSIX_CAP_OFFSET } else { c };
        let mut at = if spec.msix.is_some() { MSIX_CAP_OFFSET + 12 } else { c + PCIE_CAP_LEN };
        for body in &spec.vendor_caps {
            at = at.next_multiple_of(4);
            let len = body.len() + 2;
            if body.is_empty() || len > 255 || usize::from(at) + len > 256 {
                return bad(format!("vendor capability of {len} bytes does not fit at {at:#x}"));
            }
            s.bytes[usize::from(last) + 1] = at as u8;
            let o = usize::from(at);
            s.bytes[o] = cap_id::VENDOR;
            s.bytes[o + 2..o + len].copy_from_slice(body);
            s.bytes[o + 2] = len as u8;
            last = at;
            at += len as u16;
        }
        Ok(s)
    }

    fn put16(&mut self, off: u16, v: u16) {
        let o = usize::from(off);
        self.bytes[o..o + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn put32(&mut self, off: u16, v: u32) {
        let o = usize::from(off);
        self.bytes[o..o + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn mask16(&mut self, off: u16, wmask: u16, w1c: u16) {
        let o = usize::from(off);
        self.wmask[o..o + 2].copy_from_slice(&wmask.to_le_bytes());
        self.w1c[o..o + 2].copy_from_slice(&w1c.to_le_bytes());
    }

    fn mask32(&mut self, off: u16, wmask: u32, w1c: u32) {
        let o = usize::from(off);
        self.wmask[o..o + 4].copy_from_slice(&wmask.to_le_bytes());
        self.w1c[o..o + 4].copy_from_slice(&w1c.to_le_bytes());
    }

    /// Marks the function as one of a multi-function device (header type bit 7), which tells
    /// enumeration to probe functions 1 to 7 too. Read-only to software.
    pub fn set_multi_function(&mut self) {
        let at = usize::from(reg::HEADER_TYPE);
        self.bytes[at] |= 0x80;
    }

    /// What the space was built from.
    pub fn spec(&self) -> &ConfigSpec {
        &self.spec
    }

    /// A configuration read of the DW at byte offset `register` (low 2 bits ignored): bytes
    /// whose enable bit in `first_be` is clear read as zero, as does anything past 4 KiB.
    pub fn read(&self, register: u16, first_be: u8) -> [u8; 4] {
        let base = usize::from(register & !3);
        let mut out = [0u8; 4];
        for (i, b) in out.iter_mut().enumerate() {
            if first_be >> i & 1 == 1 {
                *b = self.bytes.get(base + i).copied().unwrap_or(0);
            }
        }
        out
    }

    /// A configuration write of the DW at byte offset `register`: only enabled bytes, only
    /// writable bits change; write-1-to-clear bits clear where `data` has ones.
    pub fn write(&mut self, register: u16, first_be: u8, data: [u8; 4]) {
        let base = usize::from(register & !3);
        for (i, v) in data.iter().enumerate() {
            let o = base + i;
            if first_be >> i & 1 == 0 || o >= CONFIG_SPACE_LEN {
                continue;
            }
            let old = self.bytes[o];
            let m = self.wmask[o];
            self.bytes[o] = ((old & !m) | (v & m)) & !(v & self.w1c[o]);
        }
    }

    /// Reads `N` bytes at any offset (a convenience over [`ConfigSpace::read`]).
    fn get<const N: usize>(&self, off: u16) -> [u8; N] {
        let mut out = [0u8; N];
        for (i, b) in out.iter_mut().enumerate() {
            *b = self.bytes.get(usize::from(off) + i).copied().unwrap_or(0);
        }
        out
    }

    /// The 8-bit register at `off`.
    pub fn read_u8(&self, off: u16) -> u8 {
        self.get::<1>(off)[0]
    }

    /// The little-endian 16-bit register at `off`.
    pub fn read_u16(&self, off: u16) -> u16 {
        u16::from_le_bytes(self.get(off))
    }

    /// The little-endian 32-bit register at `off`.
    pub fn read_u32(&self, off: u16) -> u32 {
        u32::from_le_bytes(self.get(off))
    }

    /// Writes the 16-bit register at `off` (2-byte aligned) as a configuration write would.
    pub fn write_u16(&mut self, off: u16, v: u16) {
        let shift = off & 3;
        let mut d = [0u8; 4];
        d[usize::from(shift)..usize::from(shift) + 2].copy_from_slice(&v.to_le_bytes());
        self.write(off, 0b11 << shift, d);
    }

    /// Writes the 32-bit register at `off` (DW-aligned) as a configuration write would.
    pub fn write_u32(&mut self, off: u16, v: u32) {
        self.write(off, 0xf, v.to_le_bytes());
    }

    /// The command register.
    pub fn command(&self) -> u16 {
        self.read_u16(reg::COMMAND)
    }

    /// Whether memory space decoding is on.
    pub fn memory_enabled(&self) -> bool {
        self.command() & command::MEMORY_SPACE != 0
    }

    /// Whether the function may issue requests (DMA, MSI-X).
    pub fn bus_master(&self) -> bool {
        self.command() & command::BUS_MASTER != 0
    }

    /// Sets status bits the device reports (only RW1C bits; software clears them).
    pub fn set_status(&mut self, bits: u16) {
        let v = self.read_u16(reg::STATUS) | (bits & status::RW1C);
        self.put16(reg::STATUS, v);
    }

    /// The address BAR `index` is programmed with (both halves for a 64-bit BAR), `None` for an
    /// absent BAR or the upper half of a 64-bit one.
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let bar = (*self.spec.bars.get(index)?)?;
        let off = reg::BAR0 + 4 * index as u16;
        let lo = u64::from(
            self.read_u32(off) & !bar.type_bits() & if bar.kind == BarKind::Io { !3 } else { !0xf },
        );
        Some(match bar.kind {
            BarKind::Memory64 { .. } => lo | u64::from(self.read_u32(off + 4)) << 32,
            _ => lo,
        })
    }

    /// The memory BAR and offset that decode `address` for `len` bytes, when memory space is
    /// enabled and the access lies wholly inside one BAR.
    pub fn decode_memory(&self, address: u64, len: u64) -> Option<(usize, u64)> {
        if !self.memory_enabled() {
            return None;
        }
        (0..6).find_map(|i| {
            let bar = self.spec.bars[i]?;
            if bar.kind == BarKind::Io {
                return None;
            }
            let base = self.bar_address(i)?;
            let off = address.checked_sub(base)?;
            (off.checked_add(len)? <= bar.size).then_some((i, off))
        })
    }

    /// Max payload size in bytes, as programmed in Device Control (never above what Device
    /// Capabilities says is supported).
    pub fn max_payload_size(&self) -> usize {
        let code = (self.read_u16(PCIE_CAP_OFFSET + 8) >> 5) & 7;
        (128usize << code.min(5)).min(usize::from(self.spec.max_payload_supported))
    }

    /// Read completion boundary in bytes (Link Control bit 3: 64 or 128).
    pub fn read_completion_boundary(&self) -> usize {
        if self.read_u16(PCIE_CAP_OFFSET + 0x10) & 0x8 != 0 {
            128
        } else {
            64
        }
    }

    /// Max read request size in bytes, as programmed in Device Control.
    pub fn max_read_request_size(&self) -> usize {
        128usize << ((self.read_u16(PCIE_CAP_OFFSET + 8) >> 12) & 7).min(5)
    }

    /// Whether MSI-X is enabled (false without the capability).
    pub fn msix_enabled(&self) -> bool {
        self.spec.msix.is_some() && self.read_u16(MSIX_CAP_OFFSET + 2) & MSIX_ENABLE != 0
    }

    /// Whether the MSI-X function mask is set.
    pub fn msix_function_masked(&self) -> bool {
        self.spec.msix.is_some() && self.read_u16(MSIX_CAP_OFFSET + 2) & MSIX_FUNCTION_MASK != 0
    }

    /// The capability list as (ID, offset), walked as a host would.
    pub fn capabilities(&self) -> Vec<(u8, u16)> {
        walk_capabilities(|off| self.read_u32(off))
    }
}

/// MSI-X message control: enable.
pub const MSIX_ENABLE: u16 = 1 << 15;
/// MSI-X message control: function mask.
pub const MSIX_FUNCTION_MASK: u16 = 1 << 14;

/// Walks a capability list through `read_dw` (a configuration read of the DW at a byte offset,
/// local or remote), distrusting it: pointers below 0x40 end the walk, the low two bits are
/// ignored, and at most 48 capabilities (all that fit) are visited, so a loop ends.
pub fn walk_capabilities(mut read_dw: impl FnMut(u16) -> u32) -> Vec<(u8, u16)> {
    let mut out = Vec::new();
    if read_dw(reg::STATUS & !3) >> 16 & u32::from(status::CAPABILITIES_LIST) == 0 {
        return out;
    }
    let mut ptr = (read_dw(reg::CAPABILITIES) & 0xfc) as u16;
    while ptr >= 0x40 && out.len() < 48 {
        let dw = read_dw(ptr);
        out.push((dw as u8, ptr));
        ptr = ((dw >> 8) & 0xfc) as u16;
    }
    out
}

/// An MSI message: a memory write of `data` to `address`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsiMessage {
    /// Message address (DW-aligned).
    pub address: u64,
    /// Message data.
    pub data: u32,
}

/// Bytes per MSI-X table entry.
pub const MSIX_ENTRY_LEN: usize = 16;

/// The MSI-X table and Pending Bit Array of a function (PCIe 7.7.2): what the BAR regions named
/// by the MSI-X capability hold. Entries reset masked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MsixTable {
    table: Vec<u8>,
    pending: Vec<u64>,
}

impl MsixTable {
    /// A table of `vectors` entries (1..=2048), all masked, none pending.
    pub fn new(vectors: u16) -> MsixTable {
        let n = usize::from(vectors.clamp(1, 2048));
        let mut table = vec![0u8; n * MSIX_ENTRY_LEN];
        for e in table.chunks_mut(MSIX_ENTRY_LEN) {
            e[12] = 1;
        }
        MsixTable { table, pending: vec![0; n.div_ceil(64)] }
    }

    /// Number of vectors.
    pub fn len(&self) -> usize {
        self.table.len() / MSIX_ENTRY_LEN
    }

    /// Always false: a table has at least one vector.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes of the table region.
    pub fn table_len(&self) -> usize {
        self.table.len()
    }

    /// Bytes of the PBA region.
    pub fn pba_len(&self) -> usize {
        self.pending.len() * 8
    }

    /// Reads the table region at `offset`; false (and `buf` zeroed) if the access is not inside it.
    pub fn read_table(&self, offset: u64, buf: &mut [u8]) -> bool {
        match range(offset, buf.len(), self.table.len()) {
            Some(r) => {
                buf.copy_from_slice(&self.table[r]);
                true
            }
            None => {
                buf.fill(0);
                false
            }
        }
    }

    /// Writes the table region at `offset`: address bits 1:0 and vector control bits other than
    /// the mask are read-only. False (nothing written) if the access is not inside the table.
    pub fn write_table(&mut self, offset: u64, data: &[u8]) -> bool {
        let Some(r) = range(offset, data.len(), self.table.len()) else {
            return false;
        };
        for (o, v) in r.zip(data) {
            let mask = match o % MSIX_ENTRY_LEN {
                0 => 0xfc,
                12 => 0x01,
                13..=15 => 0x00,
                _ => 0xff,
            };
            self.table[o] = (self.table[o] & !mask) | (v & mask);
        }
        true
    }

    /// Reads the PBA region (read-only to software) at `offset`; false if outside it.
    pub fn read_pba(&self, offset: u64, buf: &mut [u8]) -> bool {
        let bytes: Vec<u8> = self.pending.iter().flat_map(|q| q.to_le_bytes()).collect();
        match range(offset, buf.len(), bytes.len()) {
            Some(r) => {
                buf.copy_from_slice(&bytes[r]);
                true
            }
            None => {
                buf.fill(0);
                false
            }
        }
    }

    /// Entry `vector`: (message, masked).
    pub fn entry(&self, vector: u16) -> Option<(MsiMessage, bool)> {
        let o = usize::from(vector) * MSIX_ENTRY_LEN;
        let e = self.table.get(o..o + MSIX_ENTRY_LEN)?;
        let w = |i: usize| u32::from_le_bytes([e[i], e[i + 1], e[i + 2], e[i + 3]]);
        Some((MsiMessage { address: u64::from(w(4)) << 32 | u64::from(w(0)), data: w(8) }, w(12) & 1 != 0))
    }

    /// Whether `vector`'s pending bit is set.
    pub fn is_pending(&self, vector: u16) -> bool {
        let v = usize::from(vector);
        self.pending.get(v / 64).is_some_and(|q| q >> (v % 64) & 1 == 1)
    }

    /// The function raises `vector`, with MSI-X `enabled` and the function mask `function_masked`
    /// as the capability says: the message to send, or `None` when the vector (or function) is
    /// masked, in which case it becomes pending, or when MSI-X is disabled or `vector` does not
    /// exist.
    pub fn signal(&mut self, vector: u16, enabled: bool, function_masked: bool) -> Option<MsiMessage> {
        let (msg, masked) = self.entry(vector)?;
        if !enabled {
            return None;
        }
        if masked || function_masked {
            let v = usize::from(vector);
            self.pending[v / 64] |= 1 << (v % 64);
            return None;
        }
        Some(msg)
    }

    /// After an unmask: one pending vector that may now be sent, its pending bit cleared.
    pub fn poll_pending(&mut self, enabled: bool, function_masked: bool) -> Option<(u16, MsiMessage)> {
        if !enabled || function_masked {
            return None;
        }
        for v in 0..self.len() as u16 {
            if self.is_pending(v) {
                let (msg, masked) = self.entry(v)?;
                if !masked {
                    let i = usize::from(v);
                    self.pending[i / 64] &= !(1 << (i % 64));
                    return Some((v, msg));
                }
            }
        }
        None
    }
}

fn range(offset: u64, len: usize, size: usize) -> Option<core::ops::Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(len)?;
    (end <= size).then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ConfigSpec {
        ConfigSpec::new(0x1af4, 0x10f0, 0x08_80_00)
            .with_bar(0, Bar { kind: BarKind::Memory32 { prefetchable: false }, size: 0x1000 })
            .with_bar(1, Bar { kind: BarKind::Io, size: 32 })
            .with_bar(2, Bar { kind: BarKind::Memory64 { prefetchable: true }, size: 1 << 20 })
            .with_bar(4, Bar { kind: BarKind::Memory64 { prefetchable: false }, size: 8 << 30 })
            .with_msix(MsixSpec {
                table_size: 70,
                table_bar: 0,
                table_offset: 0x0,
                pba_bar: 0,
                pba_offset: 0x800,
            })
    }

    #[test]
    fn bar_sizing() {
        let mut c = ConfigSpace::new(spec()).unwrap();
        assert_eq!(c.read_u32(0x10), 0);
        assert_eq!(c.read_u32(0x18), 0x0000_000c, "64-bit prefetchable type bits");
        for i in 0..6 {
            c.write_u32(reg::BAR0 + 4 * i, 0xffff_ffff);
        }
        assert_eq!(c.read_u32(0x10), 0xffff_f000, "32-bit 4 KiB");
        assert_eq!(c.read_u32(0x14), 0xffff_ffe1, "I/O 32 bytes");
        assert_eq!((c.read_u32(0x18), c.read_u32(0x1c)), (0xfff0_000c, 0xffff_ffff), "64-bit 1 MiB");
        assert_eq!((c.read_u32(0x20), c.read_u32(0x24)), (0x0000_0004, 0xffff_fffe), "64-bit 8 GiB");
        // Decode sizes as a host does.
        let size32 = |v: u32, mask: u32| (!(v & mask)).wrapping_add(1);
        assert_eq!(size32(c.read_u32(0x10), !0xf), 0x1000);
        assert_eq!(size32(c.read_u32(0x14), !0x3) & 0xffff, 32);
        let v64 = u64::from(c.read_u32(0x20)) | u64::from(c.read_u32(0x24)) << 32;
        assert_eq!((!(v64 & !0xf)).wrapping_add(1), 8 << 30);

        c.write_u32(0x10, 0xfebf_1234);
        c.write_u32(0x18, 0x8000_0000);
        c.write_u32(0x1c, 0x1);
        assert_eq!(c.bar_address(0), Some(0xfebf_1000));
        assert_eq!(c.bar_address(2), Some(0x1_8000_0000));
        assert_eq!((c.bar_address(3), c.bar_address(5)), (None, None));
        assert_eq!(c.decode_memory(0xfebf_1010, 4), None, "memory space disabled");
        c.write_u16(reg::COMMAND, command::MEMORY_SPACE);
        assert_eq!(c.decode_memory(0xfebf_1010, 4), Some((0, 0x10)));
        assert_eq!(c.decode_memory(0xfebf_1ffe, 4), None, "crosses the end");
        assert_eq!(c.decode_memory(0x1_8000_0100, 8), Some((2, 0x100)));

        // A 64-bit BAR in the last slot or with its upper slot taken, odd sizes: refused.
        let b64 = Bar { kind: BarKind::Memory64 { prefetchable: false }, size: 4096 };
        assert!(ConfigSpace::new(ConfigSpec::new(1, 2, 0).with_bar(5, b64)).is_err());
        assert!(ConfigSpace::new(ConfigSpec::new(1, 2, 0).with_bar(0, b64).with_bar(1, b64)).is_err());
        let odd = Bar { kind: BarKind::Memory32 { prefetchable: false }, size: 3000 };
        assert!(ConfigSpace::new(ConfigSpec::new(1, 2, 0).with_bar(0, odd)).is_err());
        let io = Bar { kind: BarKind::Io, size: 512 };
        assert!(ConfigSpace::new(ConfigSpec::new(1, 2, 0).with_bar(0, io)).is_err());
    }

    #[test]
    fn read_only_and_rw1c_bits() {
        let mut c = ConfigSpace::new(spec()).unwrap();
        let before: Vec<u32> = (0..0x40).step_by(4).map(|o| c.read_u32(o)).collect();
        for o in [0x00u16, 0x08, 0x0c, 0x2c, 0x34, 0x3c] {
            c.write_u32(o, 0xffff_ffff);
        }
        assert_eq!(c.read_u16(reg::VENDOR_ID), 0x1af4);
        assert_eq!(c.read_u16(reg::DEVICE_ID), 0x10f0);
        assert_eq!(c.read_u32(0x08), before[2], "revision and class are read-only");
        assert_eq!(c.read_u32(0x0c), 0x0000_00ff, "only cache line size is writable");
        assert_eq!(c.read_u32(0x2c), before[11]);
        assert_eq!(c.read_u8(reg::CAPABILITIES), 0x40);
        assert_eq!(c.read_u8(reg::INTERRUPT_LINE), 0xff);
        assert_eq!(c.read_u8(reg::INTERRUPT_PIN), 0);

        c.write_u32(reg::COMMAND, 0xffff_ffff);
        assert_eq!(c.command(), command::WRITABLE);
        assert!(c.memory_enabled() && c.bus_master());
        assert_eq!(c.read_u16(reg::STATUS), status::CAPABILITIES_LIST);
        c.set_status(
            status::RECEIVED_MASTER_ABORT | status::SIGNALED_TARGET_ABORT | status::CAPABILITIES_LIST,
        );
        let set = status::CAPABILITIES_LIST | status::RECEIVED_MASTER_ABORT | status::SIGNALED_TARGET_ABORT;
        assert_eq!(c.read_u16(reg::STATUS), set);
        c.write_u16(reg::STATUS, 0);
        assert_eq!(c.read_u16(reg::STATUS), set, "writing 0 leaves RW1C bits");
        c.write_u16(reg::STATUS, status::RECEIVED_MASTER_ABORT);
        assert_eq!(c.read_u16(reg::STATUS), set & !status::RECEIVED_MASTER_ABORT, "writing 1 clears");
        // A DW write to command/status with ones in status clears it without touching command.
        c.write(reg::COMMAND, 0b1100, [0, 0, 0xff, 0xff]);
        assert_eq!(c.read_u16(reg::STATUS), status::CAPABILITIES_LIST);
        assert_eq!(c.command(), command::WRITABLE);
    }

    #[test]
    fn byte_enables() {
        let mut c = ConfigSpace::new(spec()).unwrap();
        c.write(0x10, 0b0010, [0xff; 4]);
        assert_eq!(c.read_u32(0x10), 0x0000_f000);
        assert_eq!(c.read(0x10, 0b0010), [0, 0xf0, 0, 0]);
        assert_eq!(c.read(0x00, 0b0011), [0xf4, 0x1a, 0, 0]);
        assert_eq!(c.read(0x1000, 0xf), [0; 4], "past 4 KiB");
        c.write(0xffc, 0xf, [1; 4]);
        assert_eq!(c.read(0xffc, 0xf), [0; 4], "extended space is read-only here");
    }

    #[test]
    fn capability_walk_and_pcie() {
        let mut c = ConfigSpace::new(spec()).unwrap();
        assert_eq!(c.capabilities(), vec![(cap_id::PCI_EXPRESS, 0x40), (cap_id::MSIX, 0x80)]);
        assert_eq!(c.read_u32(0x44) & 7, 2, "MPS supported 512");
        assert_eq!((c.max_payload_size(), c.max_read_request_size()), (128, 512));
        // MPS 256, MRRS 1024.
        let ctl = c.read_u16(0x48) & !(7 << 5) & !(7 << 12) | 1 << 5 | 3 << 12;
        c.write_u16(0x48, ctl);
        assert_eq!((c.max_payload_size(), c.max_read_request_size()), (256, 1024));
        c.write_u16(0x48, 5 << 5);
        assert_eq!(c.max_payload_size(), 512, "clamped to what is supported");
        c.write_u32(0x44, 0);
        assert_eq!(c.read_u32(0x44) & 7, 2, "device capabilities are read-only");

        // Without MSI-X the list ends after the PCI Express capability.
        let plain = ConfigSpace::new(ConfigSpec::new(1, 2, 0)).unwrap();
        assert_eq!(plain.capabilities(), vec![(cap_id::PCI_EXPRESS, 0x40)]);
        // A hostile list: a loop, and a pointer into the header.
        let looped = walk_capabilities(|o| match o {
            0x04 => 0x0010_0000,
            0x34 => 0x40,
            _ => 0x4000 | 0x05,
        });
        assert_eq!(looped.len(), 48);
        assert_eq!(walk_capabilities(|o| if o == 0x34 { 0x20 } else { 0x0010_0000 }), vec![]);
    }

    #[test]
    fn msix_capability_and_table() {
        let mut c = ConfigSpace::new(spec()).unwrap();
        let x = MSIX_CAP_OFFSET;
        assert_eq!(c.read_u16(x + 2), 69, "table size N-1");
        assert_eq!(c.read_u32(x + 4), 0x0000_0000);
        assert_eq!(c.read_u32(x + 8), 0x0000_0800);
        c.write_u32(x, 0xffff_ffff);
        assert_eq!(c.read_u16(x + 2), 69 | MSIX_ENABLE | MSIX_FUNCTION_MASK);
        assert!(c.msix_enabled() && c.msix_function_masked());
        c.write_u16(x + 2, MSIX_ENABLE);
        assert!(c.msix_enabled() && !c.msix_function_masked());

        let mut t = MsixTable::new(70);
        assert_eq!((t.table_len(), t.pba_len()), (70 * 16, 16));
        assert_eq!(t.signal(3, true, false), None, "entries reset masked");
        assert!(t.is_pending(3));
        let mut pba = [0u8; 8];
        assert!(t.read_pba(0, &mut pba));
        assert_eq!(u64::from_le_bytes(pba), 1 << 3);
        // Program vector 3 (DW writes, as a driver does), then unmask it.
        let e = 3 * 16;
        assert!(t.write_table(e, &0xfee0_1003u32.to_le_bytes()));
        assert!(t.write_table(e + 4, &0x1u32.to_le_bytes()));
        assert!(t.write_table(e + 8, &0x4041u32.to_le_bytes()));
        let msg = MsiMessage { address: 0x1_fee0_1000, data: 0x4041 };
        assert_eq!(t.entry(3), Some((msg, true)));
        assert_eq!(t.poll_pending(true, false), None, "still masked");
        assert!(t.write_table(e + 12, &0xffff_fffeu32.to_le_bytes()));
        let mut vc = [0u8; 4];
        assert!(t.read_table(e + 12, &mut vc));
        assert_eq!(u32::from_le_bytes(vc), 0, "only the mask bit is writable");
        assert_eq!(t.poll_pending(true, true), None, "function mask holds it");
        assert_eq!(t.poll_pending(true, false), Some((3, msg)));
        assert!(!t.is_pending(3));
        assert_eq!(t.signal(3, true, false), Some(msg));
        assert_eq!(t.signal(3, false, false), None, "MSI-X disabled");
        assert_eq!(t.signal(70, true, false), None, "no such vector");
        // Vector 69 lives in the second PBA QWORD.
        t.signal(69, true, false);
        assert!(t.read_pba(8, &mut pba));
        assert_eq!(u64::from_le_bytes(pba), 1 << 5);
        assert!(!t.write_table(70 * 16 - 2, &[0; 4]), "past the table");
        assert!(!t.read_pba(12, &mut pba));

        // MSI-X structures must sit inside memory BARs without overlapping.
        let io =
            ConfigSpec::new(1, 2, 0).with_bar(0, Bar { kind: BarKind::Io, size: 256 }).with_msix(MsixSpec {
                table_size: 1,
                table_bar: 0,
                table_offset: 0,
                pba_bar: 0,
                pba_offset: 0x80,
            });
        assert!(ConfigSpace::new(io).is_err());
        let overlap = spec().with_msix(MsixSpec {
            table_size: 70,
            table_bar: 0,
            table_offset: 0,
            pba_bar: 0,
            pba_offset: 0x400,
        });
        assert!(ConfigSpace::new(overlap).is_err());
        let outside = spec().with_msix(MsixSpec {
            table_size: 70,
            table_bar: 0,
            table_offset: 0xc00,
            pba_bar: 0,
            pba_offset: 0,
        });
        assert!(ConfigSpace::new(outside).is_err());
    }
}
