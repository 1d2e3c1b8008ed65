//! Enumeration of a device bridge's functions, on the host bridge's configuration thread.
//!
//! Layer: bridges, host side. PCIe Base Specification 7.5.1: each device bridge of our group gets
//! a bus number; functions 0..7 of device 0 are probed (function 0 alone unless its header type
//! says multi-function; an Unsupported Request means no function); BARs are sized by writing all
//! ones (32/64-bit, prefetchable) and placed in `bar_window` aligned to their size; the capability
//! list is walked; the PCI Express capability gets our max payload size and max read request
//! size; the MSI-X table gets one entry per vector (address `msix_window.0`, data = vector
//! number), then memory space, bus mastering and MSI-X are enabled.

use super::*;

/// Finds room for `size` bytes aligned to `size` in the window, avoiding `used`.
fn place(window: (u64, u64), size: u64, below_4g: bool, used: &[(u64, u64, MacAddr)]) -> Option<u64> {
    let (base, len) = window;
    let end = base.checked_add(len)?;
    let limit = if below_4g { end.min(1 << 32) } else { end };
    let mut at = base.checked_next_multiple_of(size)?;
    loop {
        let stop = at.checked_add(size)?;
        if stop > limit {
            return None;
        }
        match used.iter().find(|(b, l, _)| at < b + l && *b < stop) {
            Some((b, l, _)) => at = (b + l).checked_next_multiple_of(size)?,
            None => return Some(at),
        }
    }
}

fn size_code(bytes: usize) -> u32 {
    (bytes.clamp(128, 4096).trailing_zeros() - 7).min(5)
}

/// Enumerates one function; `Ok(None)` when there is none at `bdf`.
fn enumerate_function(sh: &Shared, mac: MacAddr, bdf: Bdf) -> BridgeResult<Option<RemoteFunction>> {
    let id = match sh.config_read(bdf, reg::VENDOR_ID) {
        Ok(v) => v,
        Err(BridgeError::Completion(CplStatus::UnsupportedRequest)) => return Ok(None),
        Err(e) => return Err(e),
    };
    if id & 0xffff == 0xffff || id & 0xffff == 0 {
        return Ok(None);
    }
    let class_rev = sh.config_read(bdf, 0x08)?;
    let header_type = (sh.config_read(bdf, 0x0c)? >> 16) as u8;
    let subsys = sh.config_read(bdf, reg::SUBSYSTEM_VENDOR_ID)?;
    // Decoding off while the BARs are sized and moved.
    sh.config_write(bdf, reg::COMMAND, 0b0011, 0)?;
    let mut bars = Vec::new();
    let mut i = 0;
    while i < 6 {
        let off = reg::BAR0 + 4 * i as u16;
        sh.config_write(bdf, off, 0xf, 0xffff_ffff)?;
        let v = sh.config_read(bdf, off)?;
        if v == 0 {
            i += 1;
            continue;
        }
        if v & 1 == 1 {
            let size = u64::from((!(v & !3)).wrapping_add(1) & 0xffff);
            bars.push(RemoteBar { index: i, address: 0, size, kind: BarKind::Io });
            i += 1;
            continue;
        }
        let prefetchable = v & 8 != 0;
        let is64 = (v >> 1) & 3 == 2;
        let mask = if is64 {
            sh.config_write(bdf, off + 4, 0xf, 0xffff_ffff)?;
            u64::from(sh.config_read(bdf, off + 4)?) << 32 | u64::from(v & !0xf)
        } else {
            0xffff_ffff_0000_0000 | u64::from(v & !0xf)
        };
        let size = (!mask).wrapping_add(1);
        if size == 0 || !size.is_power_of_two() {
            return Err(BridgeError::Enumeration { mac, why: format!("{bdf} BAR{i} reads back {v:#x}") });
        }
        let address = {
            let mut st = lock(&sh.state);
            let a = place(sh.config.bar_window, size, !is64, &st.allocations).ok_or_else(|| {
                BridgeError::Enumeration { mac, why: format!("no room for {bdf} BAR{i} ({size:#x} bytes)") }
            })?;
            st.allocations.push((a, size, mac));
            a
        };
        sh.config_write(bdf, off, 0xf, address as u32)?;
        let kind = if is64 {
            sh.config_write(bdf, off + 4, 0xf, (address >> 32) as u32)?;
            BarKind::Memory64 { prefetchable }
        } else {
            BarKind::Memory32 { prefetchable }
        };
        bars.push(RemoteBar { index: i, address, size, kind });
        i += if is64 { 2 } else { 1 };
    }
    let status = (sh.config_read(bdf, reg::COMMAND)? >> 16) as u16;
    let mut capabilities = Vec::new();
    if status & lanbus_pcie::config::status::CAPABILITIES_LIST != 0 {
        let mut failed = None;
        capabilities = walk_capabilities(|off| match sh.config_read(bdf, off) {
            Ok(v) => v,
            Err(e) => {
                failed.get_or_insert(e);
                0
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
    }
    let (mut mps, mut mrrs) = (128, 128);
    let mut msix = None;
    for (cap, off) in &capabilities {
        match *cap {
            cap_id::PCI_EXPRESS => {
                let devcap = sh.config_read(bdf, off + 4)?;
                let supported = 128usize << (devcap & 7).min(5);
                mps = sh.config.mps.min(supported).clamp(128, 4096);
                mrrs = sh.config.mrrs.clamp(128, 4096);
                let ctl = sh.config_read(bdf, off + 8)? & 0xffff;
                let ctl = (ctl & !(7 << 5) & !(7 << 12)) | size_code(mps) << 5 | size_code(mrrs) << 12;
                sh.config_write(bdf, off + 8, 0b0011, ctl)?;
            }
            cap_id::MSIX => {
                let control = sh.config_read(bdf, *off)? >> 16;
                let table = sh.config_read(bdf, off + 4)?;
                let pba = sh.config_read(bdf, off + 8)?;
                msix = Some((
                    *off,
                    control,
                    RemoteMsix {
                        vectors: (control & 0x7ff) as u16 + 1,
                        table_bar: (table & 7) as u8,
                        table_offset: table & !7,
                        pba_bar: (pba & 7) as u8,
                        pba_offset: pba & !7,
                    },
                ));
            }
            _ => {}
        }
    }
    sh.config_write(bdf, reg::COMMAND, 0b0011, u32::from(command::MEMORY_SPACE | command::BUS_MASTER))?;
    if let Some((off, control, m)) = msix {
        let table = bars.iter().find(|b| b.index == usize::from(m.table_bar) && b.kind != BarKind::Io);
        let Some(table) = table else {
            return Err(BridgeError::Enumeration { mac, why: format!("{bdf} MSI-X table in a missing BAR") });
        };
        let mask_on = (control | u32::from(MSIX_ENABLE | MSIX_FUNCTION_MASK)) << 16;
        sh.config_write(bdf, off, 0b1100, mask_on)?;
        let address = sh.config.msix_window.0;
        for v in 0..u32::from(m.vectors) {
            let mut entry = [0u8; 16];
            entry[0..4].copy_from_slice(&(address as u32).to_le_bytes());
            entry[4..8].copy_from_slice(&((address >> 32) as u32).to_le_bytes());
            entry[8..12].copy_from_slice(&v.to_le_bytes());
            let at = table.address + u64::from(m.table_offset) + 16 * u64::from(v);
            sh.mmio_write(bdf, at, &entry)?;
        }
        let enabled = ((control | u32::from(MSIX_ENABLE)) & !u32::from(MSIX_FUNCTION_MASK)) << 16;
        sh.config_write(bdf, off, 0b1100, enabled)?;
    }
    let (name, group) = {
        let st = lock(&sh.state);
        let name = st.devices.get(&mac).map(|d| d.name.clone()).unwrap_or_default();
        (name, sh.config.group)
    };
    Ok(Some(RemoteFunction {
        mac,
        name,
        group,
        bdf,
        vendor_id: id as u16,
        device_id: (id >> 16) as u16,
        revision_id: class_rev as u8,
        class_code: class_rev >> 8,
        header_type,
        subsystem_vendor_id: subsys as u16,
        subsystem_id: (subsys >> 16) as u16,
        bars,
        capabilities,
        msix: msix.map(|(_, _, m)| m),
        mps,
        mrrs,
    }))
}

fn enumerate(sh: &Shared, mac: MacAddr, generation: u64, bus: u8) -> BridgeResult<()> {
    let mut found = Vec::new();
    for f in 0..8u8 {
        let bdf = Bdf::new(bus, 0, f).expect("valid numbers");
        match enumerate_function(sh, mac, bdf)? {
            Some(rf) => {
                let multi = rf.header_type & 0x80 != 0;
                found.push(rf);
                if f == 0 && !multi {
                    break;
                }
            }
            None if f == 0 => break,
            None => {}
        }
    }
    let mut st = lock(&sh.state);
    match st.devices.get_mut(&mac) {
        Some(d) if d.generation == generation => d.functions = found.clone(),
        _ => return Ok(()),
    }
    drop(st);
    sh.changed.notify_all();
    for f in found {
        sh.emit(HostEvent::DeviceAdded(f));
    }
    Ok(())
}

/// The configuration thread: enumerates each device bridge that appears, retrying a failed
/// enumeration twice, each time as a new session, while the device is still there.
pub(super) fn config_thread(sh: Arc<Shared>, jobs: mpsc::Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        match job {
            Job::Enumerate { mac, generation, bus } => {
                // A failure while the device is still there (a timeout on a loaded machine) is
                // retried twice; a device that went away meanwhile is left alone.
                for attempt in 1..=3 {
                    let Err(e) = enumerate(&sh, mac, generation, bus) else { break };
                    bump(&sh.counters.enumeration_failures);
                    let still_there =
                        lock(&sh.state).devices.get(&mac).is_some_and(|d| d.generation == generation);
                    if !still_there || sh.stop.load(Ordering::Acquire) {
                        break;
                    }
                    tracing::warn!("enumeration: {e} (attempt {attempt} of 3)");
                    let mut st = lock(&sh.state);
                    st.allocations.retain(|(_, _, m)| *m != mac);
                    // Retry as a new session, on the next channel: whatever of the failed
                    // attempt is still under way (a late completion) arrives on the old one and
                    // is dropped.
                    let channel = st.session_channel();
                    if let Some(d) = st.devices.get_mut(&mac) {
                        d.channel = channel;
                    }
                    drop(st);
                    // Nothing of the old channel is taken any more: its tags are free.
                    if let Some(s) = lock(&sh.sessions).get_mut(&mac) {
                        s.requester.handle_reset();
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}
