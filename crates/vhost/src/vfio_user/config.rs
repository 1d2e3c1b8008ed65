//! The configuration space a vfio-user client sees of a remote function: the function's own
//! registers, except those the host bridge owns.
//!
//! Layer: sans-IO, under the server. The host bridge placed the function's BARs in its bus
//! address window, programmed every MSI-X table entry to reach it and enabled decoding and bus
//! mastering; a client that moved a BAR, disabled the function or reprogrammed MSI-X would cut it
//! off. So, as Linux's vfio-pci does for a VMM, these registers are virtual: the BARs (sized and
//! placed by the client in its own address space; region offsets, not bus addresses, reach the
//! function), the expansion ROM (none), the command register's low half, MSI-X's enable and
//! function-mask bits (interrupts are set up with `SET_IRQS`), the interrupt pin (no INTx
//! crosses the fabric) and the PCI Express capability's Initiate Function Level Reset bit. Every
//! other byte is read from and written to the function.

use lanbus_bridge::host::{RemoteBar, RemoteFunction};
use lanbus_pcie::config::{cap_id, reg, BarKind};

/// What a configuration write becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Absorbed by the virtual registers.
    Local,
    /// Sent to the function: the DW at the same offset, these byte enables, this value.
    Forward {
        /// Byte enables (bit n: byte n of the DW).
        be: u8,
        /// The DW.
        value: u32,
    },
}

/// The virtual registers of one function's configuration space.
#[derive(Debug, Clone)]
pub struct ConfigView {
    bars: Vec<RemoteBar>,
    /// BAR registers as the client last wrote them.
    regs: [u32; 6],
    command: u16,
    msix_cap: Option<u16>,
    /// MSI-X enable (bit 15) and function mask (bit 14).
    msix_control: u16,
    pcie_cap: Option<u16>,
    /// 4096 with a PCI Express capability, else 256.
    size: u64,
}

const MSIX_ENABLE: u16 = 1 << 15;
const MSIX_MASK: u16 = 1 << 14;
/// Device Control's Initiate Function Level Reset.
const INITIATE_FLR: u32 = 1 << 15;

fn merge(old: u32, be: u8, value: u32) -> u32 {
    let mask = (0..4).filter(|b| be & (1 << b) != 0).fold(0u32, |m, b| m | 0xff << (8 * b));
    (old & !mask) | (value & mask)
}

impl ConfigView {
    /// The view of `f`; the client first sees the BARs at the function's bus addresses, the
    /// command register clear.
    pub fn new(f: &RemoteFunction) -> ConfigView {
        let mut regs = [0u32; 6];
        let bars: Vec<RemoteBar> = f.bars.iter().filter(|b| b.kind != BarKind::Io).copied().collect();
        for b in &bars {
            regs[b.index] = b.address as u32;
            if matches!(b.kind, BarKind::Memory64 { .. }) && b.index < 5 {
                regs[b.index + 1] = (b.address >> 32) as u32;
            }
        }
        let cap = |id| f.capabilities.iter().find(|(c, _)| *c == id).map(|(_, o)| *o);
        let pcie_cap = cap(cap_id::PCI_EXPRESS);
        ConfigView {
            bars,
            regs,
            command: 0,
            msix_cap: cap(cap_id::MSIX),
            msix_control: 0,
            pcie_cap,
            size: if pcie_cap.is_some() { 4096 } else { 256 },
        }
    }

    /// The configuration region's size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The memory BARs a client can reach (I/O BARs are not served).
    pub fn bar(&self, index: usize) -> Option<RemoteBar> {
        self.bars.iter().find(|b| b.index == index).copied()
    }

    /// Whether the DW at `off` is wholly virtual (no need to read the function).
    pub fn is_virtual(&self, off: u16) -> bool {
        (reg::BAR0..reg::BAR0 + 24).contains(&off) || off == 0x30
    }

    /// The BAR register at index `i` as the client sees it.
    fn bar_reg(&self, i: usize) -> u32 {
        if let Some(b) = self.bar(i) {
            let mask = !(b.size - 1);
            let low = (self.regs[i] & mask as u32) & !0xf;
            return match b.kind {
                BarKind::Memory32 { prefetchable } => low | if prefetchable { 8 } else { 0 },
                BarKind::Memory64 { prefetchable } => low | 4 | if prefetchable { 8 } else { 0 },
                BarKind::Io => 0,
            };
        }
        match i.checked_sub(1).and_then(|j| self.bar(j)) {
            Some(b) if matches!(b.kind, BarKind::Memory64 { .. }) => {
                self.regs[i] & ((!(b.size - 1)) >> 32) as u32
            }
            _ => 0,
        }
    }

    /// The DW at `off` (DW-aligned) as the client sees it, given the function's own DW there
    /// (ignored for a virtual DW).
    pub fn read(&self, off: u16, remote: u32) -> u32 {
        let off = off & !3;
        if (reg::BAR0..reg::BAR0 + 24).contains(&off) {
            return self.bar_reg(usize::from((off - reg::BAR0) / 4));
        }
        match off {
            0x30 => 0,
            reg::COMMAND => (remote & 0xffff_0000) | u32::from(self.command),
            reg::INTERRUPT_LINE => remote & !0xff00,
            o if Some(o) == self.msix_cap => {
                (remote & !(u32::from(MSIX_ENABLE | MSIX_MASK) << 16))
                    | u32::from(self.msix_control & (MSIX_ENABLE | MSIX_MASK)) << 16
            }
            _ => remote,
        }
    }

    /// Applies a client's write of `value` with byte enables `be` to the DW at `off`.
    pub fn write(&mut self, off: u16, be: u8, value: u32) -> Write {
        let off = off & !3;
        let be = be & 0xf;
        if (reg::BAR0..reg::BAR0 + 24).contains(&off) {
            let i = usize::from((off - reg::BAR0) / 4);
            self.regs[i] = merge(self.regs[i], be, value);
            return Write::Local;
        }
        let forward = |be: u8, value: u32| if be == 0 { Write::Local } else { Write::Forward { be, value } };
        match off {
            0x30 => Write::Local,
            reg::COMMAND => {
                self.command = merge(u32::from(self.command), be & 0b0011, value) as u16;
                // The status half is write-one-to-clear: the function clears what the client
                // acknowledges.
                forward(be & 0b1100, value)
            }
            o if Some(o) == self.msix_cap => {
                let c = merge(u32::from(self.msix_control) << 16, be & 0b1100, value);
                self.msix_control = (c >> 16) as u16 & (MSIX_ENABLE | MSIX_MASK);
                Write::Local
            }
            o if self.pcie_cap.map(|p| p + 8) == Some(o) => forward(be, value & !INITIATE_FLR),
            _ => forward(be, value),
        }
    }

    /// Whether the client enabled MSI-X.
    pub fn msix_enabled(&self) -> bool {
        self.msix_control & MSIX_ENABLE != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanbus_bridge::host::RemoteMsix;
    use lanbus_pcie::Bdf;
    use lanbus_wire::MacAddr;
    use proptest::prelude::*;

    fn function() -> RemoteFunction {
        RemoteFunction {
            mac: MacAddr([2, 0, 0, 0, 0, 1]),
            name: "iobox".into(),
            group: 0,
            bdf: Bdf(0x100),
            vendor_id: 0x1b36,
            device_id: 0x10,
            revision_id: 0,
            class_code: 0x010802,
            header_type: 0,
            subsystem_vendor_id: 0,
            subsystem_id: 0,
            bars: vec![
                RemoteBar {
                    index: 0,
                    address: 0xe000_0000,
                    size: 0x4000,
                    kind: BarKind::Memory64 { prefetchable: false },
                },
                RemoteBar {
                    index: 2,
                    address: 0xe100_0000,
                    size: 0x1000,
                    kind: BarKind::Memory32 { prefetchable: true },
                },
            ],
            capabilities: vec![(cap_id::PCI_EXPRESS, 0x40), (cap_id::MSIX, 0x80)],
            msix: Some(RemoteMsix {
                vectors: 4,
                table_bar: 0,
                table_offset: 0x2000,
                pba_bar: 0,
                pba_offset: 0x3000,
            }),
            mps: 256,
            mrrs: 512,
        }
    }

    #[test]
    fn bars_size_and_move_in_the_view_only() {
        let mut v = ConfigView::new(&function());
        assert_eq!(v.read(0x10, 0), 0xe000_0004);
        assert_eq!(v.write(0x10, 0xf, 0xffff_ffff), Write::Local);
        assert_eq!(v.write(0x14, 0xf, 0xffff_ffff), Write::Local);
        assert_eq!(v.read(0x10, 0), 0xffff_c004, "a 16 KiB 64-bit BAR");
        assert_eq!(v.read(0x14, 0), 0xffff_ffff);
        v.write(0x10, 0xf, 0x8000_0000);
        v.write(0x14, 0xf, 0x1);
        assert_eq!((v.read(0x10, 0), v.read(0x14, 0)), (0x8000_0004, 1));
        v.write(0x18, 0xf, 0xffff_ffff);
        assert_eq!(v.read(0x18, 0), 0xffff_f008, "a 4 KiB prefetchable 32-bit BAR");
        assert_eq!(v.read(0x1c, 0x1234), 0, "no BAR 3");
        assert_eq!(v.read(0x30, 0xffff_ffff), 0, "no expansion ROM");
    }

    #[test]
    fn command_msix_enable_pin_and_flr_stay_with_the_bridge() {
        let mut v = ConfigView::new(&function());
        assert_eq!(v.write(0x04, 0b0011, 0x0000_0006), Write::Local);
        assert_eq!(v.read(0x04, 0x0010_0006), 0x0010_0006);
        assert_eq!(v.write(0x04, 0b1100, 0x0100_0000), Write::Forward { be: 0b1100, value: 0x0100_0000 });
        assert_eq!(v.read(0x3c, 0x0000_010b), 0x0000_000b);
        assert_eq!(
            v.read(0x80, 0xc003_0011),
            0x0003_0011,
            "MSI-X reads disabled until the client enables it"
        );
        assert_eq!(v.write(0x80, 0b1100, 0x8000_0000), Write::Local);
        assert!(v.msix_enabled());
        assert_eq!(v.read(0x80, 0x0003_0011), 0x8003_0011);
        assert_eq!(v.write(0x48, 0xf, 0x0000_8000 | 0x20), Write::Forward { be: 0xf, value: 0x20 });
        assert_eq!(v.write(0x100, 0x1, 0xab), Write::Forward { be: 1, value: 0xab });
        assert_eq!(v.size(), 4096);
    }

    proptest! {
        #[test]
        fn writes_to_bars_never_reach_the_function_and_reads_keep_the_type_bits(
            off in 0u16..0x40, be in 0u8..16, value: u32
        ) {
            let mut v = ConfigView::new(&function());
            let w = v.write(off, be, value);
            if (0x10..0x28).contains(&(off & !3)) || off & !3 == 0x30 {
                prop_assert_eq!(w, Write::Local);
            }
            prop_assert_eq!(v.read(0x10, 0) & 0xf, 4);
            prop_assert_eq!(v.read(0x18, 0) & 0xf, 8);
            prop_assert_eq!(v.read(0x10, 0) & 0x3ff0, 0, "the size bits of BAR0 read as zero");
        }
    }
}
