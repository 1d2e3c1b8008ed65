//! A vfio-user server for a raw PCIe function of an I/O box: a VMM (QEMU 10.1 and later,
//! cloud-hypervisor) gives the remote function itself to its guest, whose own driver then
//! talks to the device across the fabric:
//!
//! ```text
//! lanbus host --port afpacket:eth1 --export vfio-user:/run/lanbus/nvme.sock
//! qemu-system-x86_64 -object memory-backend-memfd,id=mem,size=4G,share=on -numa node,memdev=mem \
//!   -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/run/lanbus/nvme.sock"}}' ...
//! ```
//!
//! (QEMU 7.2, Debian 12's, has no vfio-user client; its guests reach the drive through
//! vhost-user-blk instead.)
//!
//! Layer: frontend, beside the vhost-user backends, over the host bridge. What the client sees:
//!
//! - **Regions**: BARs 0-5 as the function has them (memory BARs; reads and writes become memory
//!   TLPs at the BAR's bus address plus the offset), no ROM, the configuration space (region 7:
//!   the function's own registers, with the BARs, the command register, MSI-X control, the
//!   interrupt pin and FLR virtual: see `config.rs`). Nothing is mmap-able: every access is a
//!   message. The MSI-X table is virtual too (the client's entries are kept, the function's stay
//!   as the host bridge programmed them); the PBA reads through.
//! - **DMA**: the client maps its memory with `DMA_MAP` and a file descriptor (a memfd, sealed
//!   against shrinking); the function gets a DMA domain of its own on the host bridge holding
//!   exactly these mappings, at the client's I/O virtual addresses, so its memory requests reach
//!   the client's memory and nothing else. A mapping without a descriptor (memory the client
//!   would serve through `DMA_READ`/`DMA_WRITE` messages, such as a VMM's ROMs) is accepted and
//!   counted but not served: the function's requests there get Unsupported Request, as the
//!   fabric's DMA runs on the host bridge's receive thread, which never waits for a client.
//! - **Interrupts**: MSI-X only; `SET_IRQS` with eventfds routes each vector the host bridge
//!   receives straight to the client's eventfd (made non-blocking).
//! - **Reset**: not offered (the device flags say so): a function in an I/O box has no reset a
//!   host may pull, and its drivers reset it through its own registers.
//!
//! One client at a time: another that connects meanwhile is closed at once. A request the device
//! cannot grant (an access outside a region, a mapping over another, a descriptor that is not an
//! eventfd) gets an error reply (`EINVAL`, `EEXIST`, `ENOTSUP`) and the client goes on; a message
//! of the wrong size for its command gets an error reply and the client is disconnected, as is
//! one whose stream is out of step (a header claiming a size no message has) or that stalls
//! mid-message. When a client goes, its mappings and interrupt routes go with it.

mod config;
mod fd;
pub mod proto;

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use lanbus_bridge::host::RemoteFunction;
use lanbus_bridge::{BridgeError, DmaRegion, EventFd, HostBridge};
use lanbus_pcie::CplStatus;
use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

pub use config::{ConfigView, Write as ConfigWrite};
pub use proto::fuzz_messages;
use proto::{error_reply, reply, words, BadRequest, Header, Request, HEADER_LEN};

/// Region indexes (Linux's `VFIO_PCI_*_REGION_INDEX`).
pub mod region {
    /// The expansion ROM.
    pub const ROM: u32 = 6;
    /// The configuration space.
    pub const CONFIG: u32 = 7;
    /// VGA (none).
    pub const VGA: u32 = 8;
    /// Regions in all.
    pub const COUNT: u32 = 9;
    /// Region flag: readable.
    pub const READ: u32 = 1;
    /// Region flag: writable.
    pub const WRITE: u32 = 2;
}

/// Interrupt types (Linux's `VFIO_PCI_*_IRQ_INDEX`) and `SET_IRQS` flags.
pub mod irq {
    /// MSI-X.
    pub const MSIX: u32 = 2;
    /// Interrupt types in all (INTx, MSI, MSI-X, error, request).
    pub const COUNT: u32 = 5;
    /// Info flag: signalled through eventfds.
    pub const INFO_EVENTFD: u32 = 1;
    /// Info flag: the vector count is fixed.
    pub const INFO_NORESIZE: u32 = 8;
    /// No data: trigger (or, with count 0, tear down).
    pub const DATA_NONE: u32 = 1;
    /// One byte per vector: trigger the ones set.
    pub const DATA_BOOL: u32 = 2;
    /// One eventfd per vector.
    pub const DATA_EVENTFD: u32 = 4;
    /// Mask.
    pub const ACTION_MASK: u32 = 8;
    /// Unmask.
    pub const ACTION_UNMASK: u32 = 16;
    /// Trigger.
    pub const ACTION_TRIGGER: u32 = 32;
}

/// Device flag: a PCI device (Linux's `VFIO_DEVICE_FLAGS_PCI`).
const DEVICE_FLAGS_PCI: u32 = 1 << 1;
/// Mappings one client may hold.
const MAX_MAPPINGS: usize = 1024;
/// How long a message may take to arrive once it started, and a reply to be taken.
const STALL: Duration = Duration::from_secs(5);
/// The I/O page size (mappings are whole pages).
const PAGE: u64 = 4096;

/// Counters of a vfio-user server.
#[derive(Debug, Default)]
pub struct VfioUserStats {
    /// Clients served.
    pub connections: AtomicU64,
    /// Clients closed because another was being served.
    pub refused: AtomicU64,
    /// Messages handled.
    pub messages: AtomicU64,
    /// Messages answered with an error.
    pub errors: AtomicU64,
    /// Clients disconnected for a broken stream.
    pub protocol_errors: AtomicU64,
    /// DMA mappings added (with memory the function reaches).
    pub dma_maps: AtomicU64,
    /// DMA mappings without a descriptor: accepted, not reachable by the function.
    pub dma_maps_unbacked: AtomicU64,
    /// Region reads and writes.
    pub region_accesses: AtomicU64,
}

fn bump(c: &AtomicU64) {
    // Relaxed: counters.
    c.fetch_add(1, Ordering::Relaxed);
}

/// A running vfio-user server; [`VfioUserServer::stop`] (or dropping it) ends it.
pub struct VfioUserServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<VfioUserStats>,
}

/// Serves `function` of `bridge` to vfio-user clients on the Unix socket `path` (a stale socket
/// file there is replaced), one at a time, until stopped. From now until then the function has a
/// DMA domain of its own: it reaches only the memory its client maps.
pub fn serve_vfio_user(
    path: &Path,
    bridge: Arc<HostBridge>,
    function: RemoteFunction,
) -> Result<VfioUserServer, crate::Error> {
    let socket_error = |source| crate::Error::Socket { path: path.to_path_buf(), source };
    if function.msix.is_none() {
        return Err(crate::Error::Options(format!(
            "{} has no MSI-X: nothing to interrupt a client with",
            function.bdf
        )));
    }
    let (listener, epoll) = crate::listen(path).map_err(socket_error)?;
    bridge.set_dma_domain(function.bdf, true);
    let stop = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(VfioUserStats::default());
    let thread = {
        let (stop, stats) = (stop.clone(), stats.clone());
        let name = format!("vfio-user {}", path.display());
        std::thread::Builder::new()
            .name("vfio-user".into())
            .spawn(move || {
                let s = Server { listener, epoll, bridge, function, stats, name };
                s.run(&stop);
                s.bridge.set_dma_domain(s.function.bdf, false);
            })
            .map_err(socket_error)?
    };
    Ok(VfioUserServer { path: path.to_path_buf(), stop, thread: Some(thread), stats })
}

impl VfioUserServer {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<VfioUserStats> {
        &self.stats
    }

    /// Disconnects the client, stops accepting, takes the function's DMA domain away and removes
    /// the socket file.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        // Relaxed: polled by the server's thread, which is joined below.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for VfioUserServer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shutdown();
        }
    }
}

struct Server {
    listener: UnixListener,
    epoll: Epoll,
    bridge: Arc<HostBridge>,
    function: RemoteFunction,
    stats: Arc<VfioUserStats>,
    name: String,
}

/// Epoll data of the listener and of the client.
const LISTENER: u64 = 0;
const CLIENT: u64 = 1;

impl Server {
    fn run(&self, stop: &AtomicBool) {
        let name = &self.name;
        let mut client: Option<(UnixStream, Connection)> = None;
        let mut events = [EpollEvent::default(); 2];
        while !stop.load(Ordering::Relaxed) {
            let n = match self.epoll.wait(200, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("{name}: waiting: {e}");
                    break;
                }
            };
            for e in &events[..n] {
                if e.data() == LISTENER {
                    let Ok((s, _)) = self.listener.accept() else { continue };
                    if client.is_some() {
                        bump(&self.stats.refused);
                        tracing::warn!("{name}: a second client refused: the function is in use");
                        continue;
                    }
                    let registered = s
                        .set_read_timeout(Some(STALL))
                        .and_then(|()| s.set_write_timeout(Some(STALL)))
                        .and_then(|()| {
                            self.epoll.ctl(
                                ControlOperation::Add,
                                s.as_raw_fd(),
                                EpollEvent::new(EventSet::IN, CLIENT),
                            )
                        });
                    if let Err(err) = registered {
                        tracing::error!("{name}: cannot serve a client: {err}");
                        continue;
                    }
                    bump(&self.stats.connections);
                    tracing::info!("{name}: client connected");
                    client =
                        Some((s, Connection::new(self.bridge.clone(), &self.function, self.stats.clone())));
                    continue;
                }
                let Some((s, conn)) = client.as_mut() else { continue };
                match conn.serve_one(s) {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::info!("{name}: client disconnected");
                        self.end(&mut client);
                    }
                    Err(err) => {
                        bump(&self.stats.protocol_errors);
                        tracing::warn!("{name}: client disconnected: {err}");
                        self.end(&mut client);
                    }
                }
            }
        }
        self.end(&mut client);
    }

    fn end(&self, client: &mut Option<(UnixStream, Connection)>) {
        if let Some((s, conn)) = client.take() {
            let _ = self.epoll.ctl(ControlOperation::Delete, s.as_raw_fd(), EpollEvent::default());
            conn.close();
        }
    }
}

/// Client memory mapped into the server, lent to the host bridge: the device's reads and writes
/// land in it.
struct MappedDma {
    map: MmapRegion<()>,
    writable: bool,
}

impl DmaRegion for MappedDma {
    fn len(&self) -> u64 {
        self.map.size() as u64
    }

    fn read(&self, offset: u64, buf: &mut [u8]) {
        match self.map.get_slice(offset as usize, buf.len()) {
            Ok(s) => {
                s.copy_to(buf);
            }
            Err(_) => buf.fill(0),
        }
    }

    /// The last 8 bytes land after the rest, behind a fence: a driver that polls the end of a
    /// structure (an NVMe completion's phase bit) and then reads the rest sees it whole.
    fn write(&self, offset: u64, data: &[u8]) {
        if !self.writable {
            return;
        }
        let Ok(s) = self.map.get_slice(offset as usize, data.len()) else { return };
        let split = data.len().saturating_sub(8);
        if let (Ok(body), Ok(tail)) = (s.subslice(0, split), s.offset(split)) {
            body.copy_from(&data[..split]);
            fence(Ordering::Release);
            tail.copy_from(&data[split..]);
        }
    }
}

/// One client: its mappings, its interrupt routes and its view of the function.
struct Connection {
    bridge: Arc<HostBridge>,
    function: RemoteFunction,
    stats: Arc<VfioUserStats>,
    view: ConfigView,
    /// The MSI-X table as the client wrote it.
    table: Vec<u8>,
    /// (I/O virtual address, bytes, lent to the function) of each mapping.
    mappings: Vec<(u64, u64, bool)>,
    routed: Vec<bool>,
    versioned: bool,
}

fn bridge_errno(e: &BridgeError) -> i32 {
    match e {
        BridgeError::DeviceGone { .. } | BridgeError::NoSuchDevice(_) | BridgeError::Shutdown => libc::ENODEV,
        BridgeError::Timeout(_) => libc::ETIMEDOUT,
        _ => libc::EIO,
    }
}

fn failed(errno: i32, why: impl Into<String>) -> BadRequest {
    BadRequest { errno, why: why.into() }
}

impl Connection {
    fn new(bridge: Arc<HostBridge>, function: &RemoteFunction, stats: Arc<VfioUserStats>) -> Connection {
        let vectors = usize::from(function.msix_vectors());
        // Every entry masked, as after a reset (PCIe Base Specification 7.7.2).
        let mut table = vec![0u8; vectors * 16];
        for e in table.chunks_exact_mut(16) {
            e[12] = 1;
        }
        Connection {
            bridge,
            function: function.clone(),
            stats,
            view: ConfigView::new(function),
            table,
            mappings: Vec::new(),
            routed: vec![false; vectors],
            versioned: false,
        }
    }

    /// Takes the client's mappings and interrupt routes away.
    fn close(self) {
        let bdf = self.function.bdf;
        for (address, _, backed) in &self.mappings {
            if *backed {
                self.bridge.remove_domain_region(bdf, *address);
            }
        }
        for (v, routed) in self.routed.iter().enumerate() {
            if *routed {
                self.bridge.route_interrupt(bdf, v as u16, None);
            }
        }
    }

    /// Reads one message and answers it; `Ok(false)` when the client hung up.
    fn serve_one(&mut self, s: &mut UnixStream) -> io::Result<bool> {
        let mut head = [0u8; HEADER_LEN];
        let (n, fds) = fd::recv_with_fds(s, &mut head)?;
        if n == 0 {
            return Ok(false);
        }
        s.read_exact(&mut head[n..])?;
        let h = Header::decode(&head).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let mut body = vec![0u8; h.body_len()];
        s.read_exact(&mut body)?;
        bump(&self.stats.messages);
        let req = match proto::decode(&h, &body) {
            Ok(req) => req,
            Err(e) => {
                // A message of the wrong size for its command: the client is told, then
                // disconnected (its next bytes cannot be trusted to mean what it thinks).
                bump(&self.stats.errors);
                if !h.no_reply() {
                    s.write_all(&error_reply(&h, e.errno))?;
                }
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("command {}: {}", h.command, e.why),
                ));
            }
        };
        let answer = self.handle(&h, req, fds);
        let out = match answer {
            Ok(bytes) => bytes,
            Err(e) => {
                bump(&self.stats.errors);
                tracing::debug!("vfio-user: command {} refused: {}", h.command, e.why);
                error_reply(&h, e.errno)
            }
        };
        if !h.no_reply() {
            s.write_all(&out)?;
        }
        Ok(true)
    }

    fn handle(&mut self, h: &Header, req: Request<'_>, fds: Vec<File>) -> Result<Vec<u8>, BadRequest> {
        if !self.versioned && !matches!(req, Request::Version { .. }) {
            return Err(failed(libc::EINVAL, "the first message must be VERSION"));
        }
        if !fds.is_empty() && !matches!(req, Request::DmaMap { .. } | Request::SetIrqs { .. }) {
            return Err(failed(libc::EINVAL, "descriptors with a message that takes none"));
        }
        match req {
            Request::Version { major, minor, .. } => {
                if major != 0 {
                    return Err(failed(
                        libc::ENOTSUP,
                        format!("version {major}.{minor} (this server speaks 0.1)"),
                    ));
                }
                self.versioned = true;
                let caps = format!(
                    "{{\"capabilities\":{{\"max_msg_fds\":{},\"max_data_xfer_size\":{},\"pgsizes\":{PAGE}}}}}\0",
                    proto::MAX_FDS,
                    proto::MAX_DATA_XFER
                );
                Ok(reply(h, &[&0u16.to_le_bytes(), &minor.min(1).to_le_bytes(), caps.as_bytes()]))
            }
            Request::DeviceGetInfo { .. } => {
                Ok(reply(h, &[&words(&[16, DEVICE_FLAGS_PCI, region::COUNT, irq::COUNT])]))
            }
            Request::RegionInfo { index, .. } => {
                let (flags, size) = self.region(index)?;
                let rw = region::READ | region::WRITE;
                let flags = if size == 0 { 0 } else { flags & rw };
                Ok(reply(h, &[&words(&[32, flags, index, 0]), &size.to_le_bytes(), &0u64.to_le_bytes()]))
            }
            Request::IrqInfo { index, .. } => {
                if index >= irq::COUNT {
                    return Err(failed(libc::EINVAL, format!("interrupt type {index}")));
                }
                let (flags, count) = if index == irq::MSIX {
                    (irq::INFO_EVENTFD | irq::INFO_NORESIZE, u32::from(self.function.msix_vectors()))
                } else {
                    (0, 0)
                };
                Ok(reply(h, &[&words(&[16, flags, index, count])]))
            }
            Request::SetIrqs { flags, index, start, count, data } => {
                self.set_irqs(flags, index, start, count, data, fds)?;
                Ok(reply(h, &[]))
            }
            Request::RegionRead { offset, region, count } => {
                bump(&self.stats.region_accesses);
                let mut data = vec![0u8; count as usize];
                self.region_access(region, offset, Access::Read(&mut data))?;
                let args = [&offset.to_le_bytes()[..], &words(&[region, count])].concat();
                Ok(reply(h, &[&args, &data]))
            }
            Request::RegionWrite { offset, region, data } => {
                bump(&self.stats.region_accesses);
                self.region_access(region, offset, Access::Write(data))?;
                let args = [&offset.to_le_bytes()[..], &words(&[region, data.len() as u32])].concat();
                Ok(reply(h, &[&args]))
            }
            Request::DmaMap { flags, offset, address, size } => {
                if fds.len() > 1 {
                    return Err(failed(libc::EINVAL, "DMA_MAP with more than one descriptor"));
                }
                let backed = !fds.is_empty();
                self.map(flags, offset, address, size, fds.into_iter().next())?;
                bump(if backed { &self.stats.dma_maps } else { &self.stats.dma_maps_unbacked });
                Ok(reply(h, &[]))
            }
            Request::DmaUnmap { argsz, flags, address, size } => {
                self.unmap(flags, address, size)?;
                let args = [&words(&[argsz.min(24), flags])[..], &address.to_le_bytes(), &size.to_le_bytes()]
                    .concat();
                Ok(reply(h, &[&args]))
            }
            Request::Reset => Err(failed(libc::ENOTSUP, "the function has no reset (its driver resets it)")),
            Request::Unsupported(c) => Err(failed(libc::ENOTSUP, format!("command {c}"))),
        }
    }

    /// A region's flags and size.
    fn region(&self, index: u32) -> Result<(u32, u64), BadRequest> {
        let rw = region::READ | region::WRITE;
        match index {
            0..=5 => Ok(self.view.bar(index as usize).map_or((0, 0), |b| (rw, b.size))),
            region::ROM | region::VGA => Ok((0, 0)),
            region::CONFIG => Ok((rw, self.view.size())),
            _ => Err(failed(libc::EINVAL, format!("region {index}"))),
        }
    }

    fn region_access(&mut self, index: u32, offset: u64, access: Access<'_>) -> Result<(), BadRequest> {
        let (_, size) = self.region(index)?;
        let len = access.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(failed(
                libc::EINVAL,
                format!("{len} bytes at {offset:#x} of region {index} ({size} bytes)"),
            ));
        }
        if index == region::CONFIG {
            return self.config_access(offset as u16, access);
        }
        let bar = self.view.bar(index as usize).ok_or_else(|| failed(libc::EINVAL, "no such BAR"))?;
        let table = self
            .function
            .msix
            .filter(|m| u32::from(m.table_bar) == index)
            .map(|m| u64::from(m.table_offset)..u64::from(m.table_offset) + self.table.len() as u64);
        // Pieces: before the table, in it, after it.
        let end = offset + len;
        let mut cuts = vec![offset, end];
        if let Some(t) = &table {
            cuts.extend([t.start, t.end].into_iter().filter(|c| (offset..end).contains(c)));
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut access = access;
        for w in cuts.windows(2) {
            let (a, b) = (w[0], w[1]);
            let at = (a - offset) as usize..(b - offset) as usize;
            let in_table = table.as_ref().and_then(|t| t.contains(&a).then(|| (a - t.start) as usize));
            let bdf = self.function.bdf;
            match (&mut access, in_table) {
                (Access::Read(buf), Some(t)) => buf[at.clone()].copy_from_slice(&self.table[t..t + at.len()]),
                (Access::Write(data), Some(t)) => {
                    self.table[t..t + at.len()].copy_from_slice(&data[at.clone()])
                }
                (Access::Read(buf), None) => self
                    .bridge
                    .mmio_read(bdf, bar.address + a, &mut buf[at.clone()])
                    .map_err(|e| failed(bridge_errno(&e), e.to_string()))?,
                (Access::Write(data), None) => self
                    .bridge
                    .mmio_write(bdf, bar.address + a, &data[at.clone()])
                    .map_err(|e| failed(bridge_errno(&e), e.to_string()))?,
            }
        }
        Ok(())
    }

    fn config_access(&mut self, offset: u16, mut access: Access<'_>) -> Result<(), BadRequest> {
        let bdf = self.function.bdf;
        let len = access.len() as u16;
        let first = offset & !3;
        let mut dw = first;
        while dw < offset + len {
            // The bytes of this DW the access covers.
            let lo = offset.max(dw);
            let hi = (offset + len).min(dw + 4);
            let span = usize::from(lo - offset)..usize::from(hi - offset);
            let shift = usize::from(lo - dw);
            match &mut access {
                Access::Read(buf) => {
                    let remote = if self.view.is_virtual(dw) {
                        0
                    } else {
                        match self.bridge.config_read(bdf, dw) {
                            Ok(v) => v,
                            Err(BridgeError::Completion(CplStatus::UnsupportedRequest)) => 0xffff_ffff,
                            Err(e) => return Err(failed(bridge_errno(&e), e.to_string())),
                        }
                    };
                    let bytes = self.view.read(dw, remote).to_le_bytes();
                    buf[span.clone()].copy_from_slice(&bytes[shift..shift + span.len()]);
                }
                Access::Write(data) => {
                    let mut bytes = [0u8; 4];
                    bytes[shift..shift + span.len()].copy_from_slice(&data[span.clone()]);
                    let be = (((1u16 << span.len()) - 1) << shift) as u8;
                    if let ConfigWrite::Forward { be, value } =
                        self.view.write(dw, be, u32::from_le_bytes(bytes))
                    {
                        self.bridge
                            .config_write(bdf, dw, be, value)
                            .map_err(|e| failed(bridge_errno(&e), e.to_string()))?;
                    }
                }
            }
            dw += 4;
        }
        Ok(())
    }

    fn set_irqs(
        &mut self,
        flags: u32,
        index: u32,
        start: u32,
        count: u32,
        data: &[u8],
        fds: Vec<File>,
    ) -> Result<(), BadRequest> {
        let data_type = flags & (irq::DATA_NONE | irq::DATA_BOOL | irq::DATA_EVENTFD);
        let action = flags & (irq::ACTION_MASK | irq::ACTION_UNMASK | irq::ACTION_TRIGGER);
        if !data_type.is_power_of_two() || !action.is_power_of_two() || flags & !0x3f != 0 {
            return Err(failed(libc::EINVAL, format!("SET_IRQS flags {flags:#x}")));
        }
        if index >= irq::COUNT {
            return Err(failed(libc::EINVAL, format!("interrupt type {index}")));
        }
        if action != irq::ACTION_TRIGGER {
            return Err(failed(libc::EINVAL, "MSI-X vectors are masked by the client's table, not SET_IRQS"));
        }
        let vectors = self.routed.len() as u32;
        let bdf = self.function.bdf;
        if data_type == irq::DATA_NONE && count == 0 {
            // Tear down every vector of the type.
            if index == irq::MSIX {
                for v in 0..vectors {
                    self.route(v, None);
                }
            }
            return Ok(());
        }
        if index != irq::MSIX || start.checked_add(count).is_none_or(|end| end > vectors) {
            return Err(failed(
                libc::EINVAL,
                format!("vectors {start}+{count} of type {index} ({vectors} MSI-X vectors)"),
            ));
        }
        match data_type {
            irq::DATA_EVENTFD => {
                if fds.len() != count as usize {
                    return Err(failed(
                        libc::EINVAL,
                        format!("{count} vectors but {} descriptors", fds.len()),
                    ));
                }
                let mut targets = Vec::with_capacity(fds.len());
                for f in fds {
                    if !fd::is_eventfd(&f) {
                        return Err(failed(libc::EINVAL, "an interrupt descriptor that is not an eventfd"));
                    }
                    fd::set_nonblocking(&f).map_err(|e| failed(libc::EINVAL, e.to_string()))?;
                    targets.push(Arc::new(EventFd::from_owned(OwnedFd::from(f))));
                }
                for (i, t) in targets.into_iter().enumerate() {
                    self.route(start + i as u32, Some(t));
                }
            }
            _ => {
                if !fds.is_empty() {
                    return Err(failed(libc::EINVAL, "descriptors without eventfd data"));
                }
                let fire =
                    |i: u32| data_type == irq::DATA_NONE || data.get(i as usize).is_some_and(|b| *b != 0);
                if data_type == irq::DATA_BOOL && data.len() < count as usize {
                    return Err(failed(libc::EINVAL, "fewer booleans than vectors"));
                }
                for i in (0..count).filter(|i| fire(*i)) {
                    if let Ok(fd) = self.bridge.interrupt_eventfd(bdf, (start + i) as u16) {
                        if self.routed[(start + i) as usize] {
                            fd.signal();
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn route(&mut self, vector: u32, target: Option<Arc<EventFd>>) {
        self.routed[vector as usize] = target.is_some();
        self.bridge.route_interrupt(self.function.bdf, vector as u16, target);
    }

    fn map(
        &mut self,
        flags: u32,
        offset: u64,
        address: u64,
        size: u64,
        file: Option<File>,
    ) -> Result<(), BadRequest> {
        let bad = |why: String| failed(libc::EINVAL, why);
        if flags & !3 != 0 || flags == 0 {
            return Err(bad(format!("DMA_MAP flags {flags:#x}")));
        }
        if size == 0 || !(address | offset | size).is_multiple_of(PAGE) || address.checked_add(size).is_none()
        {
            return Err(bad(format!("DMA_MAP of {size:#x} bytes at {address:#x}: whole pages")));
        }
        if self.mappings.len() >= MAX_MAPPINGS {
            return Err(failed(libc::ENOSPC, format!("more than {MAX_MAPPINGS} mappings")));
        }
        let end = address + size;
        if self.mappings.iter().any(|(a, s, _)| *a < end && address < a + s) {
            return Err(failed(libc::EEXIST, format!("{size:#x} bytes at {address:#x} overlap a mapping")));
        }
        let Some(file) = file else {
            tracing::info!(
                "vfio-user: {size:#x} bytes at {address:#x} mapped without a descriptor: the function \
                 cannot reach them (DMA through messages is not served)"
            );
            self.mappings.push((address, size, false));
            return Ok(());
        };
        let file_len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
        if offset.checked_add(size).is_none_or(|end| end > file_len) {
            return Err(bad(format!("{size:#x} bytes at {offset:#x} of a {file_len}-byte file")));
        }
        fd::seal_against_shrinking(&file).map_err(|e| bad(e.to_string()))?;
        let writable = flags & 2 != 0;
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        let len = usize::try_from(size).map_err(|_| bad("too large".into()))?;
        let map = MmapRegion::build(Some(FileOffset::new(file, offset)), len, prot, libc::MAP_SHARED)
            .map_err(|e| bad(format!("cannot map the memory: {e}")))?;
        self.bridge
            .add_domain_region(self.function.bdf, address, Arc::new(MappedDma { map, writable }))
            .map_err(|e| failed(libc::EEXIST, e.to_string()))?;
        self.mappings.push((address, size, true));
        Ok(())
    }

    fn unmap(&mut self, flags: u32, address: u64, size: u64) -> Result<(), BadRequest> {
        const ALL: u32 = 4;
        if flags & !ALL != 0 {
            return Err(failed(
                libc::ENOTSUP,
                format!("DMA_UNMAP flags {flags:#x} (dirty pages are not tracked)"),
            ));
        }
        let end = address.saturating_add(size);
        let inside = |(a, s, _): &(u64, u64, bool)| flags & ALL != 0 || (*a >= address && a + s <= end);
        if flags & ALL == 0 && self.mappings.iter().any(|m| !inside(m) && m.0 < end && address < m.0 + m.1) {
            return Err(failed(libc::EINVAL, format!("{size:#x} bytes at {address:#x} cut a mapping")));
        }
        let bdf = self.function.bdf;
        let bridge = self.bridge.clone();
        self.mappings.retain(|m| {
            let gone = inside(m);
            if gone && m.2 {
                bridge.remove_domain_region(bdf, m.0);
            }
            !gone
        });
        Ok(())
    }
}

enum Access<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl Access<'_> {
    fn len(&self) -> usize {
        match self {
            Access::Read(b) => b.len(),
            Access::Write(d) => d.len(),
        }
    }
}
