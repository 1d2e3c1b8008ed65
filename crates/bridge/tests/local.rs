//! The DMA engine on the in-process bus (no fabric): every transfer raises exactly one interrupt
//! and copies its bytes.

use lanbus_bridge::{DmaBuffer, HostedFunction, LocalBus};
use lanbus_pcie::dma_engine::{transfer_writes, DmaEngine};

#[test]
fn local_bus_copies_and_interrupts_once_per_transfer() {
    let mut bus = LocalBus::new(
        vec![HostedFunction::model(DmaEngine::new()).unwrap()],
        0xe000_0000,
        0xfee0_0000,
        128,
        512,
    )
    .unwrap();
    let src: Vec<u8> = (0..1 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let dst = DmaBuffer::new(1 << 20);
    bus.add_region(0x1_0000_0000, DmaBuffer::from_vec(src.clone())).unwrap();
    bus.add_region(0x2_0000_0000, dst.clone()).unwrap();
    let bar0 = bus.bar_address(0, 0).unwrap();
    let mut n = 0;
    for (len, reps) in [(4096usize, 2100), (16384, 900), (1 << 20, 3)] {
        for _ in 0..reps {
            n += 1;
            for (off, v) in transfer_writes(1 << 32, 2 << 32, len as u32) {
                bus.mmio_write(0, bar0 + off, &v.to_le_bytes()).unwrap();
            }
            assert_eq!(bus.interrupt_count(0, 0), n, "transfer {n} of {len} bytes");
        }
        assert_eq!(dst.read_vec(0, len), src[..len]);
    }
}
