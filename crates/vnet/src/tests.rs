//! The device and the driver together in-process, and a hostile driver against the device.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::driver::DriverConfig;
use crate::local::{fuzz_rings, LocalNic};
use crate::{common, feature, layout, status, NetConfig, NET_HDR_LEN};

fn frame(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut f = vec![0u8; NET_HDR_LEN + len];
    rng.fill(&mut f[NET_HDR_LEN..]);
    f
}

fn nic(queue_size: u16) -> (LocalNic, crate::NetDriver) {
    let cfg = DriverConfig { queue_size, refuse: 0 };
    let nic = LocalNic::new(NetConfig { queue_size, ..NetConfig::default() }, &cfg);
    let drv = nic.driver(cfg).expect("driver starts");
    (nic, drv)
}

#[test]
fn the_driver_negotiates_offloads_and_reads_mac_and_mtu() {
    let (nic, drv) = nic(8);
    let f = drv.features();
    for want in [
        feature::VERSION_1,
        feature::CSUM,
        feature::HOST_TSO4,
        feature::GUEST_TSO6,
        feature::NOTIFICATION_DATA,
    ] {
        assert_ne!(f & want, 0, "feature {want:#x} negotiated");
    }
    assert_eq!(drv.mac(), NetConfig::default().mac);
    assert_eq!(drv.mtu(), 1500);
    let o = nic.wire_offloads();
    assert!(o.csum && o.tso4 && o.tso6, "the wire hands over what the driver takes: {o:?}");
    assert_eq!(drv.device_status().unwrap() & status::DRIVER_OK, status::DRIVER_OK);
}

#[test]
fn frames_cross_both_ways_intact_through_many_laps_of_the_rings() {
    let (nic, drv) = nic(8);
    let mut sent = Vec::new();
    for i in 0..100u64 {
        let len = [60usize, 1514, 9000, 65_550][i as usize % 4];
        let f = frame(i, len);
        while drv.tx_room().unwrap() == 0 {}
        assert!(drv.tx_push(&f).unwrap());
        if i % 3 == 0 {
            drv.tx_flush().unwrap();
        }
        sent.push(f);
    }
    drv.tx_flush().unwrap();
    assert_eq!(nic.take_sent(), sent, "the wire got every frame, in order, with its header");
    assert_eq!(drv.tx_room().unwrap(), 8, "every transmit buffer came back");

    let mut got = Vec::new();
    let mut arrived = Vec::new();
    for i in 0..100u64 {
        let f = frame(1000 + i, [60usize, 1514, 65_550][i as usize % 3]);
        assert!(nic.arrive(f.clone()));
        arrived.push(f);
        if i % 5 == 4 {
            nic.pump();
            drv.rx_poll(&mut |b| got.push(b.to_vec())).unwrap();
        }
    }
    nic.pump();
    drv.rx_poll(&mut |b| got.push(b.to_vec())).unwrap();
    assert_eq!(got.len(), arrived.len());
    for (g, mut a) in got.into_iter().zip(arrived) {
        a[10..12].copy_from_slice(&1u16.to_le_bytes());
        assert_eq!(g, a, "num_buffers is 1, the rest intact");
    }
    let s = nic.stats();
    assert_eq!(s.tx_frames.load(std::sync::atomic::Ordering::Relaxed), 100);
    assert_eq!(s.rx_frames.load(std::sync::atomic::Ordering::Relaxed), 100);
}

#[test]
fn transmit_batches_in_flight_leave_in_order_whatever_order_their_reads_end() {
    let (nic, drv) = nic(8);
    nic.hold_reads(true);
    let (a, b) = ([frame(1, 1514), frame(2, 60)], frame(3, 9000));
    for f in &a {
        assert!(drv.tx_push(f).unwrap());
    }
    drv.tx_flush().unwrap();
    assert_eq!(nic.release_reads(false), 1, "the rings of the first batch");
    // Its two frames are being read; the second batch's rings are read meanwhile.
    assert!(drv.tx_push(&b).unwrap());
    drv.tx_flush().unwrap();
    assert_eq!(nic.release_reads(true), 1, "the rings of the second batch");
    assert_eq!(nic.release_reads(true), 1, "the second batch's frame");
    assert!(nic.take_sent().is_empty(), "the second batch waits for the first");
    assert_eq!(drv.tx_room().unwrap(), 5, "no buffer came back yet");
    assert_eq!(nic.release_reads(false), 2, "the first batch's frames");
    assert_eq!(nic.take_sent(), vec![a[0].clone(), a[1].clone(), b], "in the driver's order");
    assert_eq!(drv.tx_room().unwrap(), 8, "every buffer came back");
    nic.hold_reads(false);
}

#[test]
fn a_reset_drops_the_reads_in_flight() {
    let (nic, drv) = nic(8);
    nic.hold_reads(true);
    assert!(drv.tx_push(&frame(1, 100)).unwrap());
    drv.tx_flush().unwrap();
    assert_eq!(nic.release_reads(false), 1);
    nic.bar_write(layout::COMMON + common::DEVICE_STATUS, &[0]);
    nic.release_reads(false);
    assert!(nic.take_sent().is_empty(), "a frame read for a reset device goes nowhere");
    assert_eq!(nic.stats().tx_frames.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn frames_wait_on_the_wire_side_until_the_driver_gives_buffers() {
    let (nic, drv) = nic(4);
    for i in 0..10 {
        assert!(nic.arrive(frame(i, 100)));
    }
    nic.pump();
    let mut n = 0;
    // Four buffers: four frames now, the rest after the driver hands them back.
    while n < 10 {
        let before = n;
        drv.rx_poll(&mut |_| n += 1).unwrap();
        assert!(n - before <= 4);
        nic.pump();
        assert!(n > before || n == 10, "progress");
    }
}

#[test]
fn a_driver_without_version_1_is_refused() {
    let cfg = DriverConfig::default();
    let nic = LocalNic::new(NetConfig::default(), &cfg);
    nic.bar_write(common::DEVICE_STATUS, &[status::ACKNOWLEDGE | status::DRIVER]);
    nic.bar_write(common::DRIVER_FEATURE_SELECT, &0u32.to_le_bytes());
    nic.bar_write(common::DRIVER_FEATURE, &(feature::MAC as u32).to_le_bytes());
    nic.bar_write(common::DEVICE_STATUS, &[status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK]);
    let mut s = [0u8];
    nic.bar_read(common::DEVICE_STATUS, &mut s);
    assert_eq!(s[0] & status::FEATURES_OK, 0, "FEATURES_OK reads back clear");
}

#[test]
fn a_hostile_available_index_breaks_the_device_not_the_box() {
    let (nic, drv) = nic(8);
    let [_, (_, tx_avail, _)] = drv.queue_areas();
    lanbus_bridge::dma::DmaMemory::write(nic.memory(), tx_avail + 2, &500u16.to_le_bytes()).unwrap();
    // Notified with the same wild index.
    let v = u32::from(crate::TX_QUEUE) | 500 << 16;
    nic.bar_write(
        layout::NOTIFY + u64::from(crate::TX_QUEUE) * u64::from(layout::NOTIFY_MULTIPLIER),
        &v.to_le_bytes(),
    );
    assert_ne!(drv.device_status().unwrap() & status::NEEDS_RESET, 0);
    assert!(drv.config_changed(), "the configuration vector said so");
    assert_eq!(nic.stats().broken.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert!(nic.take_sent().is_empty());
    // A reset and a new driver bring it back.
    drop(drv);
    let drv = nic.driver(DriverConfig { queue_size: 8, refuse: 0 }).unwrap();
    assert!(drv.tx_push(&frame(1, 64)).unwrap());
    drv.tx_flush().unwrap();
    assert_eq!(nic.take_sent().len(), 1);
}

#[test]
fn a_looping_chain_breaks_the_device() {
    let (nic, drv) = nic(8);
    let [_, (desc, avail, _)] = drv.queue_areas();
    let mem = nic.memory();
    // Descriptor 0 -> 1 -> 0 (NEXT set on both), made available.
    for (i, next) in [(0u64, 1u16), (1, 0)] {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&(desc + 4096).to_le_bytes());
        d[8..12].copy_from_slice(&64u32.to_le_bytes());
        d[12..14].copy_from_slice(&1u16.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        lanbus_bridge::dma::DmaMemory::write(mem, desc + 16 * i, &d).unwrap();
    }
    lanbus_bridge::dma::DmaMemory::write(mem, avail + 4, &0u16.to_le_bytes()).unwrap();
    lanbus_bridge::dma::DmaMemory::write(mem, avail + 2, &1u16.to_le_bytes()).unwrap();
    let v = u32::from(crate::TX_QUEUE) | 1 << 16;
    nic.bar_write(layout::NOTIFY + u64::from(layout::NOTIFY_MULTIPLIER), &v.to_le_bytes());
    assert_ne!(drv.device_status().unwrap() & status::NEEDS_RESET, 0);
}

#[test]
fn the_capabilities_point_at_the_structures() {
    let space = lanbus_pcie::config::ConfigSpace::new(crate::device::config_spec()).unwrap();
    let caps = lanbus_pcie::config::walk_capabilities(|r| u32::from_le_bytes(space.clone().read(r, 0xf)));
    let vendor: Vec<u16> = caps.iter().filter(|(id, _)| *id == 0x09).map(|(_, at)| *at).collect();
    assert_eq!(vendor.len(), 4, "common, notify, ISR, device: {caps:?}");
    let types: Vec<u8> = vendor.iter().map(|at| space.clone().read(*at, 0xf)[3]).collect();
    assert_eq!(types, [layout::CAP_COMMON, layout::CAP_NOTIFY, layout::CAP_ISR, layout::CAP_DEVICE]);
    let notify = vendor[1];
    assert_eq!(u32::from_le_bytes(space.clone().read(notify + 16, 0xf)), layout::NOTIFY_MULTIPLIER);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
    #[test]
    fn hostile_rings_never_crash_the_device(data in proptest::collection::vec(any::<u8>(), 0..1200)) {
        fuzz_rings(&data);
    }
}

#[test]
fn frames_filled_in_place_cross_intact_and_a_fill_without_a_frame_keeps_its_buffer() {
    let (nic, drv) = nic(8);
    let fill = |f: &[u8]| {
        let f = f.to_vec();
        move |bufs: &mut [&mut [u8]]| {
            let mut at = 0;
            for b in bufs.iter_mut() {
                let n = b.len().min(f.len() - at);
                b[..n].copy_from_slice(&f[at..at + n]);
                at += n;
            }
            f.len()
        }
    };
    let sent: Vec<Vec<u8>> = (0..3).map(|i| frame(i, [60, 9000, 65_550][i as usize])).collect();
    for f in &sent {
        assert!(drv.tx_fill(&mut fill(f)).unwrap().is_some_and(|n| n == f.len()));
    }
    assert_eq!(drv.tx_fill(&mut |_| 0).unwrap(), Some(0), "no frame, nothing queued");
    assert!(drv.tx_fill(&mut |_| NET_HDR_LEN - 1).is_err(), "a frame shorter than its header");
    assert_eq!(drv.tx_room().unwrap(), 5, "only the three frames took buffers");
    drv.tx_flush().unwrap();
    assert_eq!(nic.take_sent(), sent);
}

#[test]
fn transmit_interrupts_come_only_when_the_buffers_run_low() {
    let (nic, drv) = nic(8);
    let interrupts = || nic.stats().interrupts.load(std::sync::atomic::Ordering::Relaxed);
    let before = interrupts();
    for i in 0..3 {
        assert!(drv.tx_push(&frame(i, 100)).unwrap());
    }
    drv.tx_flush().unwrap();
    assert_eq!(nic.take_sent().len(), 3);
    assert_eq!(interrupts(), before, "five of eight buffers free: no interrupt asked for");
    assert!(!drv.tx_wait(std::time::Duration::ZERO));
    // Take every free buffer: the batch that leaves three of eight free asks for the interrupt.
    let mut pushed = 0;
    while drv.tx_push(&frame(10 + pushed, 100)).unwrap() {
        pushed += 1;
    }
    assert_eq!(pushed, 5, "the three sent are not taken back before the flush");
    drv.tx_flush().unwrap();
    assert_eq!(nic.take_sent().len(), 5);
    assert_eq!(interrupts(), before + 1, "the device interrupted once the buffers ran out");
    assert!(drv.tx_wait(std::time::Duration::ZERO), "the waiting driver is woken");
    assert_eq!(drv.tx_room().unwrap(), 8);
}
