//! The remote NIC: a virtio-net network card in the I/O box that a host uses over the fabric.
//!
//! Layering, as for the NVMe drive (`lanbus_nvme`), over the same DMA memory and interrupt waits
//! (`lanbus_bridge::dma`):
//!
//! ```text
//!   host:   TAP lanbus0 ── NetDriver ── MMIO (common/notify/ISR/device config in BAR0) ── HostRegion
//!                                 │                                      ▲ queues and frame buffers
//!                          (host bridge: MRd/MWr TLPs)          (device DMA lands here, MSI-X)
//!                                 ▼                                      │
//!   device: NetDevice (virtio 1.x modern PCI function) ── Wire: a TAP in the I/O box
//! ```
//!
//! - [`device`]: the virtio-net function model (VIRTIO 1.2 sections 4.1 "Virtio Over PCI Bus" and
//!   5.1 "Network Device"): the vendor capabilities, common configuration, notification, ISR and
//!   device configuration structures in BAR0, MSI-X, a receive and a transmit split virtqueue
//!   (section 2.7) read and written only by DMA, checksum and segmentation offload passed through
//!   in the `virtio_net_hdr`. Hostile rings make the device set DEVICE_NEEDS_RESET, never crash.
//! - [`driver`]: the user-space virtio-net driver over MMIO, DMA memory and MSI-X eventfds.
//! - [`tap`]: TAP interfaces with `IFF_VNET_HDR` (the I/O box's wire, the host's export).
//! - [`local`]: the device and the driver joined in-process (tests, the fuzz target).
//! - [`pcie`]: the function for a device bridge and the driver over a host bridge.
//!
//! Every frame crosses the fabric as the function's own DMA of the host's virtqueues and buffers,
//! with standard registers: Linux's `virtio_net` could drive the same function.

pub mod device;
pub mod driver;
pub mod local;
pub mod pcie;
pub mod tap;
mod virtq;

#[cfg(test)]
mod tests;

pub use device::{Inbound, NetConfig, NetDevice, NetStats, Offloads, Wire};
pub use driver::{DriverError, NetDriver, NetDriverStats};
pub use virtq::QueueError;

/// PCI vendor ID of virtio devices.
pub const VENDOR_ID: u16 = 0x1af4;
/// PCI device ID of a modern (virtio 1.x) network device: 0x1040 + device type 1.
pub const DEVICE_ID: u16 = 0x1041;
/// PCI class code: network controller, Ethernet.
pub const CLASS_CODE: u32 = 0x02_00_00;

/// Bytes of the `virtio_net_hdr` in front of every frame (VERSION_1: with `num_buffers`).
pub const NET_HDR_LEN: usize = 12;
/// The largest frame (Ethernet header, VLAN tag and a 64 KiB IP packet) a buffer carries, after
/// the header: what segmentation offload produces.
pub const MAX_FRAME: usize = 65_550;
/// The largest buffer a frame needs: header and frame.
pub const MAX_BUFFER: usize = NET_HDR_LEN + MAX_FRAME;

/// Feature bits (VIRTIO 1.2 sections 5.1.3 and 6).
pub mod feature {
    /// The device handles packets with partial checksum (the driver may leave it to the device).
    pub const CSUM: u64 = 1 << 0;
    /// The driver handles packets with partial checksum (the device may hand them over).
    pub const GUEST_CSUM: u64 = 1 << 1;
    /// The device reports its maximum MTU.
    pub const MTU: u64 = 1 << 3;
    /// The device has a MAC address.
    pub const MAC: u64 = 1 << 5;
    /// The driver takes TCPv4 segments larger than the MTU.
    pub const GUEST_TSO4: u64 = 1 << 7;
    /// The driver takes TCPv6 segments larger than the MTU.
    pub const GUEST_TSO6: u64 = 1 << 8;
    /// The driver takes large segments with ECN.
    pub const GUEST_ECN: u64 = 1 << 9;
    /// The device takes TCPv4 segments larger than the MTU and segments them.
    pub const HOST_TSO4: u64 = 1 << 11;
    /// The device takes TCPv6 segments larger than the MTU.
    pub const HOST_TSO6: u64 = 1 << 12;
    /// The device takes large segments with ECN.
    pub const HOST_ECN: u64 = 1 << 13;
    /// The link status field of the device configuration is valid.
    pub const STATUS: u64 = 1 << 16;
    /// Virtio 1.x (modern) interface.
    pub const VERSION_1: u64 = 1 << 32;
    /// The driver's notification carries the queue's next available index (saves the device
    /// reading it).
    pub const NOTIFICATION_DATA: u64 = 1 << 38;

    /// What the device offers.
    pub const OFFERED: u64 = CSUM
        | GUEST_CSUM
        | MTU
        | MAC
        | GUEST_TSO4
        | GUEST_TSO6
        | GUEST_ECN
        | HOST_TSO4
        | HOST_TSO6
        | HOST_ECN
        | STATUS
        | VERSION_1
        | NOTIFICATION_DATA;
}

/// Device status bits (VIRTIO 1.2 section 2.1).
pub mod status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u8 = 1;
    /// The guest knows how to drive it.
    pub const DRIVER: u8 = 2;
    /// The driver is ready.
    pub const DRIVER_OK: u8 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u8 = 8;
    /// The device hit an error it cannot recover from without a reset.
    pub const NEEDS_RESET: u8 = 0x40;
    /// The driver gave up on the device.
    pub const FAILED: u8 = 0x80;
}

/// Where the structures live in BAR0 (offsets) and the virtio PCI capability types (VIRTIO 1.2
/// section 4.1.4).
pub mod layout {
    /// BAR holding every structure.
    pub const BAR: u8 = 0;
    /// Size of BAR0.
    pub const BAR_SIZE: u64 = 0x8000;
    /// Common configuration (`virtio_pci_common_cfg`).
    pub const COMMON: u64 = 0x0000;
    /// Bytes of the common configuration (up to `queue_reset`).
    pub const COMMON_LEN: u64 = 0x3c;
    /// ISR status.
    pub const ISR: u64 = 0x1000;
    /// Device-specific configuration (`virtio_net_config`).
    pub const DEVICE: u64 = 0x2000;
    /// Bytes of the device configuration: mac, status, max_virtqueue_pairs, mtu.
    pub const DEVICE_LEN: u64 = 12;
    /// Notification area: queue N's doorbell is at `NOTIFY + N * NOTIFY_MULTIPLIER`.
    pub const NOTIFY: u64 = 0x3000;
    /// `notify_off_multiplier`.
    pub const NOTIFY_MULTIPLIER: u32 = 4;
    /// MSI-X table.
    pub const MSIX_TABLE: u32 = 0x4000;
    /// MSI-X pending bit array.
    pub const MSIX_PBA: u32 = 0x5000;
    /// MSI-X vectors: configuration changes, receive queue, transmit queue, one spare.
    pub const MSIX_VECTORS: u16 = 4;

    /// `cfg_type` of the common configuration capability.
    pub const CAP_COMMON: u8 = 1;
    /// `cfg_type` of the notification capability.
    pub const CAP_NOTIFY: u8 = 2;
    /// `cfg_type` of the ISR capability.
    pub const CAP_ISR: u8 = 3;
    /// `cfg_type` of the device configuration capability.
    pub const CAP_DEVICE: u8 = 4;
}

/// Common configuration register offsets (VIRTIO 1.2 section 4.1.4.3).
pub mod common {
    /// le32 device_feature_select.
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    /// le32 device_feature.
    pub const DEVICE_FEATURE: u64 = 0x04;
    /// le32 driver_feature_select.
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    /// le32 driver_feature.
    pub const DRIVER_FEATURE: u64 = 0x0c;
    /// le16 config_msix_vector.
    pub const CONFIG_MSIX_VECTOR: u64 = 0x10;
    /// le16 num_queues.
    pub const NUM_QUEUES: u64 = 0x12;
    /// u8 device_status.
    pub const DEVICE_STATUS: u64 = 0x14;
    /// u8 config_generation.
    pub const CONFIG_GENERATION: u64 = 0x15;
    /// le16 queue_select.
    pub const QUEUE_SELECT: u64 = 0x16;
    /// le16 queue_size.
    pub const QUEUE_SIZE: u64 = 0x18;
    /// le16 queue_msix_vector.
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    /// le16 queue_enable.
    pub const QUEUE_ENABLE: u64 = 0x1c;
    /// le16 queue_notify_off.
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    /// le64 queue_desc.
    pub const QUEUE_DESC: u64 = 0x20;
    /// le64 queue_driver (the available ring).
    pub const QUEUE_DRIVER: u64 = 0x28;
    /// le64 queue_device (the used ring).
    pub const QUEUE_DEVICE: u64 = 0x30;
    /// No MSI-X vector.
    pub const NO_VECTOR: u16 = 0xffff;
}

/// Queue indices of the single queue pair.
pub const RX_QUEUE: u16 = 0;
/// The transmit queue (driver to device).
pub const TX_QUEUE: u16 = 1;

/// Fields of the `virtio_net_hdr` (VIRTIO 1.2 section 5.1.6).
pub mod hdr {
    /// flags: the checksum at `csum_start + csum_offset` is partial.
    pub const F_NEEDS_CSUM: u8 = 1;
    /// flags: the checksum is known good.
    pub const F_DATA_VALID: u8 = 2;
    /// gso_type: not a large segment.
    pub const GSO_NONE: u8 = 0;
    /// gso_type: TCPv4 segment.
    pub const GSO_TCPV4: u8 = 1;
    /// gso_type: UDP (fragmentation offload).
    pub const GSO_UDP: u8 = 3;
    /// gso_type: TCPv6 segment.
    pub const GSO_TCPV6: u8 = 4;
    /// gso_type bit: ECN.
    pub const GSO_ECN: u8 = 0x80;
}
