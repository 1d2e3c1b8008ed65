//! Remote PCIe functions described the way `lspci -v` describes local ones.
//!
//! Layer: assembly (text for `lanbus lspci`, `lanbus status` and the daemons' logs, and the
//! short-lived host bridge `lanbus lspci` enumerates with).

use std::time::Duration;

use lanbus_bridge::{HostBridge, RemoteFunction};
use lanbus_pcie::config::{cap_id, BarKind};
use lanbus_port::Port;
use lanbus_runtime::ThreadMode;

/// Enumerates the remote functions of `group` reachable through `port`: a host bridge of its
/// own listens for `wait` (device bridges announce themselves every heartbeat interval and are
/// enumerated at once), lets the enumerations under way finish, and stops.
pub fn enumerate(
    port: Box<dyn Port>,
    group: u16,
    wait: Duration,
    threads: ThreadMode,
) -> crate::Result<Vec<RemoteFunction>> {
    let config = lanbus_bridge::HostBridgeConfig {
        group,
        name: "lanbus-lspci".into(),
        runtime: crate::config::runtime_config("lspci", threads),
        ..lanbus_bridge::HostBridgeConfig::default()
    };
    let host = HostBridge::start(port, config)?;
    std::thread::sleep(wait.min(Duration::from_millis(300)));
    let mut devices = host.wait_devices(1, wait.saturating_sub(Duration::from_millis(300)));
    let settle = std::time::Instant::now();
    while settle.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(50));
        devices = host.devices();
    }
    host.shutdown();
    Ok(devices)
}

/// One function as `lspci -v` would show it.
pub fn describe(f: &RemoteFunction) -> String {
    let mut s = format!(
        "{} {} [{:04x}]: Device {:04x}:{:04x} (rev {:02x})\n",
        f.bdf,
        class_name(f.class_code),
        f.class_code >> 8,
        f.vendor_id,
        f.device_id,
        f.revision_id
    );
    s += &format!("\tSubsystem: Device {:04x}:{:04x}\n", f.subsystem_vendor_id, f.subsystem_id);
    s += &format!("\tDevice bridge: {} \"{}\", group {}\n", f.mac, f.name, f.group);
    s += "\tFlags: bus master, fast devsel\n";
    for b in &f.bars {
        match b.kind {
            BarKind::Io => s += &format!("\tI/O ports [disabled] [size={}]\n", size_text(b.size)),
            BarKind::Memory32 { prefetchable } | BarKind::Memory64 { prefetchable } => {
                let bits = if matches!(b.kind, BarKind::Memory64 { .. }) { 64 } else { 32 };
                let p = if prefetchable { "prefetchable" } else { "non-prefetchable" };
                s += &format!(
                    "\tMemory at {:x} ({bits}-bit, {p}) [size={}] (BAR{})\n",
                    b.address,
                    size_text(b.size),
                    b.index
                );
            }
        }
    }
    for (id, off) in &f.capabilities {
        match *id {
            cap_id::PCI_EXPRESS => {
                s += &format!(
                "\tCapabilities: [{off:02x}] Express Endpoint, MaxPayload {} bytes, MaxReadReq {} bytes\n",
                f.mps, f.mrrs
            )
            }
            cap_id::MSIX => {
                if let Some(m) = f.msix {
                    s += &format!("\tCapabilities: [{off:02x}] MSI-X: Enable+ Count={} Masked-\n", m.vectors);
                    s += &format!("\t\tVector table: BAR={} offset={:08x}\n", m.table_bar, m.table_offset);
                    s += &format!("\t\tPBA: BAR={} offset={:08x}\n", m.pba_bar, m.pba_offset);
                }
            }
            other => s += &format!("\tCapabilities: [{off:02x}] ID {other:02x}\n"),
        }
    }
    s
}

fn class_name(class: u32) -> &'static str {
    match class >> 16 {
        0x01 => "Mass storage controller",
        0x02 => "Network controller",
        0x03 => "Display controller",
        0x04 => "Multimedia controller",
        0x05 => "Memory controller",
        0x06 => "Bridge",
        0x07 => "Communication controller",
        0x08 => "System peripheral",
        0x0c => "Serial bus controller",
        0x12 => "Processing accelerators",
        _ => "Unclassified device",
    }
}

fn size_text(size: u64) -> String {
    match size {
        s if s >= 1 << 30 && s % (1 << 30) == 0 => format!("{}G", s >> 30),
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{}M", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{}K", s >> 10),
        s => format!("{s}"),
    }
}
