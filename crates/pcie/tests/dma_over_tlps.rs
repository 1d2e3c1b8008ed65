//! The PCIe pieces composed as the two bridges will compose them, with every TLP encoded and
//! decoded in between but no transport: a host enumerates the DMA engine through configuration
//! TLPs, programs it through memory writes, and the engine copies host memory with read requests
//! (split by MRRS, completed split by MPS/RCB) and posted writes, then raises MSI-X.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use lanbus_pcie::config::{command, reg, MSIX_CAP_OFFSET, MSIX_ENABLE};
use lanbus_pcie::device::{DmaError, DmaId, Function, HostRequest};
use lanbus_pcie::dma_engine::{regs, transfer_writes, DmaEngine, DEVICE_ID, VENDOR_ID};
use lanbus_pcie::request::{completions_for_read, refuse, write_requests};
use lanbus_pcie::requester::{Requester, RequesterEvent, TransactionId};
use lanbus_pcie::{Bdf, CplStatus, Error, Header, Tlp, TlpKind};
use lanbus_wire::time::Instant;
use rand::{Rng, SeedableRng};

const HOST: Bdf = Bdf(0x0000);
const DEV: Bdf = Bdf(0x0300);
const HOST_BASE: u64 = 0x2_0000_0000;
const HOST_LEN: usize = 4 << 20;
const MSI_ADDR: u64 = 0xfee0_0000;
const BAR0: u64 = 0xfe00_0000;
const BAR2: u64 = 0xfe10_0000;

fn wire(t: &Tlp) -> Tlp {
    Tlp::decode(&t.encode().unwrap()).unwrap()
}

struct World {
    mem: Vec<u8>,
    interrupts: Vec<u32>,
    host: Requester,
    /// The host's posted writes (they need no requester state), in order.
    host_posted: VecDeque<Tlp>,
    device: Function<DmaEngine>,
    dma: Requester,
    dma_posted: VecDeque<Tlp>,
    dma_ids: HashMap<TransactionId, DmaId>,
    host_done: HashMap<TransactionId, Result<Vec<u8>, Error>>,
}

impl World {
    fn new() -> World {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
        let timeout = Duration::from_millis(50);
        World {
            mem: (0..HOST_LEN).map(|_| rng.random()).collect(),
            interrupts: vec![],
            host: Requester::new(HOST, 32, timeout, 512).unwrap(),
            host_posted: VecDeque::new(),
            device: Function::new(DmaEngine::new()).unwrap(),
            dma: Requester::new(DEV, 64, timeout, 512).unwrap(),
            dma_posted: VecDeque::new(),
            dma_ids: HashMap::new(),
            host_done: HashMap::new(),
        }
    }

    /// Moves everything until nothing moves.
    fn run(&mut self) {
        let now = Instant::ZERO;
        loop {
            let mut moved = false;
            // Host -> device.
            while let Some(t) = self.host_posted.pop_front().or_else(|| self.host.poll_transmit(now)) {
                moved = true;
                for c in self.device.handle_request(&wire(&t)).unwrap() {
                    self.host.handle_completion(now, &wire(&c)).unwrap();
                }
            }
            while let Some(e) = self.host.poll_event() {
                match e {
                    RequesterEvent::Done { id, data } => self.host_done.insert(id, Ok(data)),
                    RequesterEvent::Failed { id, error } => self.host_done.insert(id, Err(error)),
                };
            }
            // The device's DMA and interrupts, through its requester.
            while let Some(r) = self.device.poll_host_request() {
                moved = true;
                match r {
                    HostRequest::Read { id, address, len } => {
                        let t = self.dma.read(now, address, len).unwrap();
                        self.dma_ids.insert(t, id);
                    }
                    HostRequest::Write { address, data } => {
                        self.dma_posted.extend(write_requests(DEV, address, &data, 256).unwrap())
                    }
                }
            }
            // Device -> host: the host bridge's side.
            while let Some(t) = self.dma_posted.pop_front().or_else(|| self.dma.poll_transmit(now)) {
                moved = true;
                let t = wire(&t);
                let Header::Mem(h) = t.header else { panic!("{t:?}") };
                match t.kind {
                    TlpKind::MRd32 | TlpKind::MRd64 => {
                        let mem = &self.mem;
                        let inside = |a: u64, len: usize| {
                            a >= HOST_BASE && a - HOST_BASE + len as u64 <= HOST_LEN as u64
                        };
                        // Unknown addresses get Unsupported Request, as the host bridge answers.
                        let cpls = if inside(h.address, usize::from(t.length_dw) * 4) {
                            completions_for_read(&t, HOST, 256, 64, |a, buf| {
                                let off = (a - HOST_BASE) as usize;
                                buf.copy_from_slice(&mem[off..off + buf.len()]);
                                Ok(())
                            })
                            .unwrap()
                        } else {
                            refuse(&t, HOST, CplStatus::UnsupportedRequest).into_iter().collect()
                        };
                        for c in cpls {
                            self.dma.handle_completion(now, &wire(&c)).unwrap();
                        }
                    }
                    TlpKind::MWr32 | TlpKind::MWr64 if h.address == MSI_ADDR => {
                        self.interrupts.push(u32::from_le_bytes(t.data[..4].try_into().unwrap()));
                    }
                    TlpKind::MWr32 | TlpKind::MWr64 => {
                        // Byte enables: the first and last DW may be partial.
                        let n = t.data.len();
                        for (i, b) in t.data.iter().enumerate() {
                            let be = if i < 4 {
                                h.first_be
                            } else if i + 4 >= n {
                                h.last_be
                            } else {
                                0xf
                            };
                            if be >> (i % 4) & 1 == 1 {
                                self.mem[(h.address - HOST_BASE) as usize + i] = *b;
                            }
                        }
                    }
                    k => panic!("the device sent {k}"),
                }
            }
            while let Some(e) = self.dma.poll_event() {
                moved = true;
                match e {
                    RequesterEvent::Done { id, data } => {
                        let d = self.dma_ids.remove(&id).unwrap();
                        self.device.dma_read_done(d, Ok(&data));
                    }
                    RequesterEvent::Failed { id, error } => {
                        let d = self.dma_ids.remove(&id).unwrap();
                        let e = match error {
                            Error::CompletionStatus(s) => DmaError::Completion(s),
                            _ => DmaError::Timeout,
                        };
                        self.device.dma_read_done(d, Err(e));
                    }
                }
            }
            if !moved {
                return;
            }
        }
    }

    fn config_read(&mut self, register: u16) -> u32 {
        let id = self.host.config_read(Instant::ZERO, DEV, register, 0xf).unwrap();
        self.run();
        let d = self.host_done.remove(&id).unwrap().unwrap();
        u32::from_le_bytes(d.try_into().unwrap())
    }

    fn config_write(&mut self, register: u16, v: u32) {
        let id = self.host.config_write(Instant::ZERO, DEV, register, 0xf, v.to_le_bytes()).unwrap();
        self.run();
        assert_eq!(self.host_done.remove(&id).unwrap(), Ok(vec![]));
    }

    fn mmio_write(&mut self, address: u64, v: u32) {
        self.host_posted.extend(write_requests(HOST, address, &v.to_le_bytes(), 256).unwrap());
        self.run();
    }

    fn mmio_read(&mut self, address: u64) -> u32 {
        let id = self.host.read(Instant::ZERO, address, 4).unwrap();
        self.run();
        u32::from_le_bytes(self.host_done.remove(&id).unwrap().unwrap().try_into().unwrap())
    }
}

#[test]
fn enumerate_program_copy_interrupt() {
    let mut w = World::new();
    // Enumeration: IDs, class, BAR sizes, capabilities.
    assert_eq!(w.config_read(0), u32::from(DEVICE_ID) << 16 | u32::from(VENDOR_ID));
    assert_eq!(w.config_read(0x08) >> 8, lanbus_pcie::dma_engine::CLASS_CODE);
    let mut sizes = vec![];
    for i in 0..6u16 {
        w.config_write(reg::BAR0 + 4 * i, 0xffff_ffff);
        let v = w.config_read(reg::BAR0 + 4 * i);
        sizes.push(if v == 0 { 0 } else { (!(v & !0xf)).wrapping_add(1) });
    }
    assert_eq!(sizes, vec![4096, 0, 4096, 0, 0, 0]);
    let caps = lanbus_pcie::config::walk_capabilities(|off| w.config_read(off));
    assert_eq!(caps, vec![(0x10, 0x40), (0x11, 0x80)]);
    // Assignment and enabling.
    w.config_write(reg::BAR0, BAR0 as u32);
    w.config_write(reg::BAR0 + 8, BAR2 as u32);
    w.config_write(reg::COMMAND, u32::from(command::MEMORY_SPACE | command::BUS_MASTER));
    let ctl = w.config_read(MSIX_CAP_OFFSET);
    w.config_write(MSIX_CAP_OFFSET, ctl | u32::from(MSIX_ENABLE) << 16);
    w.mmio_write(BAR2, MSI_ADDR as u32);
    w.mmio_write(BAR2 + 8, 0x61);
    w.mmio_write(BAR2 + 12, 0);
    assert_eq!(w.device.id(), DEV);

    // Transfers of 4 KiB .. 1 MiB, each checked, each with one interrupt.
    let mut src = 0x1234u64;
    let mut dst = 0x20_0000u64 + 3;
    for (n, len) in [4096u64, 65536, 1 << 20, 777].into_iter().enumerate() {
        let want = w.mem[src as usize..(src + len) as usize].to_vec();
        for (off, v) in transfer_writes(HOST_BASE + src, HOST_BASE + dst, len as u32) {
            w.mmio_write(BAR0 + off, v);
        }
        assert_eq!(&w.mem[dst as usize..(dst + len) as usize], &want[..], "transfer of {len}");
        assert_eq!(w.interrupts, vec![0x61; n + 1]);
        assert_eq!(w.mmio_read(BAR0 + regs::STATUS), regs::STATUS_DONE);
        w.mmio_write(BAR0 + regs::STATUS, regs::STATUS_DONE);
        src += len + 5;
        dst += len + 1;
    }
    // A transfer from memory the host does not have: UR, ERROR, still one interrupt.
    for (r, v) in [(0x00, 0x10_0000u64), (0x08, HOST_BASE)] {
        w.mmio_write(BAR0 + r, v as u32);
        w.mmio_write(BAR0 + r + 4, (v >> 32) as u32);
    }
    w.mmio_write(BAR0 + regs::DOORBELL, 1);
    assert_eq!(w.mmio_read(BAR0 + regs::STATUS), regs::STATUS_ERROR);
    assert_eq!(w.interrupts.len(), 5);
    assert_eq!(w.host.counters().unexpected_completions + w.dma.counters().unexpected_completions, 0);
}
