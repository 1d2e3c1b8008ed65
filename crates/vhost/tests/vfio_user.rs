//! The vfio-user server against an independent client: the `vfio_user` crate's `Client` (the
//! rust-vmm one cloud-hypervisor uses) connects to the server of a remote NVMe function (a
//! controller on a device bridge, a host bridge, a simulated wire between them), reads the
//! configuration space and sizes a BAR as a VMM does, maps a memfd for DMA and gives eventfds to
//! the MSI-X vectors. Then lanbus's own NVMe driver runs on top of that client, the way Linux's
//! nvme driver would in a guest: queues, PRP lists and data in the client's memory, doorbells and
//! registers through region writes, completions signalled on the client's eventfds. Hostile
//! clients get errors or are disconnected, and the server goes on serving.
#![allow(unsafe_code)]

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lanbus_bridge::dma::{BusError, DmaMemory, InterruptWait};
use lanbus_bridge::host::RemoteFunction;
use lanbus_bridge::{DeviceBridge, DeviceBridgeConfig, EventFd, HostBridge, HostBridgeConfig};
use lanbus_nvme::driver::Bar;
use lanbus_nvme::pcie::NvmeFunction;
use lanbus_nvme::{Controller, ControllerConfig, DriverConfig, NvmeDriver, RamBacking};
use lanbus_port::{SimWire, SimWireConfig};
use lanbus_runtime::RuntimeConfig;
use lanbus_vhost::vfio_user::{irq, region};
use lanbus_vhost::{serve_vfio_user, VfioUserServer};
use lanbus_wire::{Clock, MacAddr, MonotonicClock};
use vfio_user::Client;
use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory};

const DRIVE: u64 = 32 << 20;
/// Where the client puts its memory in its I/O virtual address space.
const IOVA: u64 = 0x8000_0000;
const MEM: usize = 16 << 20;

fn runtime(name: &str) -> RuntimeConfig {
    let mut c = RuntimeConfig { name: name.into(), ..RuntimeConfig::default() };
    c.transport.rate.enabled = false;
    c
}

/// A host bridge that enumerated an NVMe function on a device bridge over a simulated wire.
fn fabric(loss: f64, seed: u64) -> (Arc<HostBridge>, DeviceBridge, RemoteFunction) {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let wire = SimWireConfig { loss, seed, ..SimWireConfig::default() };
    let macs = [MacAddr([2, 0, 0, 0, 0x61, 1]), MacAddr([2, 0, 0, 0, 0x61, 2])];
    let (a, b) = SimWire::pair_realtime(wire, clock, macs).unwrap();
    let hc = HostBridgeConfig {
        group: 5,
        name: "host".into(),
        runtime: runtime("h"),
        completion_timeout: Duration::from_secs(2),
        mps: 4096,
        mrrs: 4096,
        ..HostBridgeConfig::default()
    };
    let host = Arc::new(HostBridge::start(Box::new(a), hc).unwrap());
    let ctrl = Controller::new(ControllerConfig::default(), Box::new(RamBacking::new(DRIVE))).unwrap();
    let (f, _) = NvmeFunction::hosted(ctrl).unwrap();
    let dc = DeviceBridgeConfig {
        group: 5,
        name: "iobox".into(),
        runtime: runtime("d"),
        completion_timeout: Duration::from_secs(2),
        ..DeviceBridgeConfig::default()
    };
    let dev = DeviceBridge::start(Box::new(b), dc, vec![f]).unwrap();
    let f = host.wait_devices(1, Duration::from_secs(20)).pop().expect("the NVMe function is enumerated");
    (host, dev, f)
}

fn socket(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lanbus-vfio-{name}-{}.sock", std::process::id()))
}

fn serve(name: &str, host: &Arc<HostBridge>, f: &RemoteFunction) -> VfioUserServer {
    serve_vfio_user(&socket(name), host.clone(), f.clone()).unwrap()
}

/// A sealable memfd of `len` bytes.
fn memfd(len: usize) -> File {
    // SAFETY: a NUL-terminated name; the descriptor returned is owned by the File alone.
    let fd =
        unsafe { libc::memfd_create(c"lanbus-dma".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is fresh and owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len as u64).unwrap();
    f
}

/// The client's DMA memory: a memfd mapped here and given to the server at [`IOVA`]; a first-fit
/// allocator of pages. Reads of a completion-sized structure take its last 8 bytes first (the
/// server writes them last), as a driver polls a phase bit before reading the entry.
struct ClientMemory {
    map: MmapRegion<()>,
    used: Mutex<Vec<bool>>,
}

impl ClientMemory {
    fn new(file: &File) -> ClientMemory {
        let map = MmapRegion::build(
            Some(FileOffset::new(file.try_clone().unwrap(), 0)),
            MEM,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
        )
        .unwrap();
        ClientMemory { map, used: Mutex::new(vec![false; MEM / 4096]) }
    }

    fn at(&self, addr: u64, len: usize) -> Result<usize, BusError> {
        addr.checked_sub(IOVA)
            .map(|o| o as usize)
            .filter(|o| o + len <= MEM)
            .ok_or(BusError::Unsupported { addr })
    }
}

impl DmaMemory for ClientMemory {
    fn alloc(&self, pages: usize) -> Option<u64> {
        let mut used = self.used.lock().unwrap();
        let first = (0..=used.len().checked_sub(pages)?).find(|&i| used[i..i + pages].iter().all(|u| !u))?;
        used[first..first + pages].fill(true);
        Some(IOVA + (first * 4096) as u64)
    }
    fn free(&self, addr: u64, pages: usize) {
        let first = ((addr - IOVA) / 4096) as usize;
        self.used.lock().unwrap()[first..first + pages].fill(false);
    }
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), BusError> {
        let s = self.map.get_slice(self.at(addr, buf.len())?, buf.len()).unwrap();
        if buf.len() <= 64 {
            let split = buf.len().saturating_sub(8);
            s.offset(split).unwrap().copy_to(&mut buf[split..]);
            fence(Ordering::Acquire);
            s.subslice(0, split).unwrap().copy_to(&mut buf[..split]);
        } else {
            s.copy_to(buf);
        }
        Ok(())
    }
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        self.map.get_slice(self.at(addr, data.len())?, data.len()).unwrap().copy_from(data);
        Ok(())
    }
}

/// BAR0 through the client's region reads and writes.
struct ClientBar(Arc<Mutex<Client>>);

impl ClientBar {
    fn access(&self, offset: u64, read: Option<&mut [u8]>, write: Option<&[u8]>) -> Result<(), BusError> {
        let mut c = self.0.lock().unwrap();
        let r = match (read, write) {
            (Some(b), _) => c.region_read(0, offset, b),
            (_, Some(d)) => c.region_write(0, offset, d),
            _ => Ok(()),
        };
        r.map_err(|e| BusError::Down(e.to_string()))
    }
}

impl Bar for ClientBar {
    fn read32(&self, offset: u64) -> Result<u32, BusError> {
        let mut b = [0u8; 4];
        self.access(offset, Some(&mut b), None)?;
        Ok(u32::from_le_bytes(b))
    }
    fn read64(&self, offset: u64) -> Result<u64, BusError> {
        let mut b = [0u8; 8];
        self.access(offset, Some(&mut b), None)?;
        Ok(u64::from_le_bytes(b))
    }
    fn write32(&self, offset: u64, value: u32) -> Result<(), BusError> {
        self.access(offset, None, Some(&value.to_le_bytes()))
    }
    fn write64(&self, offset: u64, value: u64) -> Result<(), BusError> {
        self.access(offset, None, Some(&value.to_le_bytes()))
    }
}

struct ClientInterrupts(Vec<Arc<EventFd>>);

impl InterruptWait for ClientInterrupts {
    fn wait_vector(&self, vector: u16, timeout: Duration) -> bool {
        self.0.get(usize::from(vector)).is_some_and(|fd| fd.take() > 0 || fd.wait(timeout) > 0)
    }
}

fn config_read(c: &mut Client, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    c.region_read(region::CONFIG, offset, &mut b).unwrap();
    u32::from_le_bytes(b)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Enumeration as a VMM does it, then the NVMe driver over the client; every write read back.
fn drive_through_the_client(path: &Path, f: &RemoteFunction, host: &HostBridge, seed: u64) {
    let mut client = Client::new(path).expect("the client negotiates and lists the regions");
    let cfg = client.region(region::CONFIG).expect("a configuration region");
    assert_eq!(cfg.size, 4096);
    let bar0 = f.bar(0).unwrap();
    assert_eq!(client.region(0).expect("BAR0").size, bar0.size);
    assert_eq!(client.region(region::ROM).unwrap().size, 0);
    let id = config_read(&mut client, 0);
    assert_eq!((id & 0xffff, id >> 16), (u32::from(f.vendor_id), u32::from(f.device_id)));
    assert_eq!(config_read(&mut client, 8) >> 8, 0x010802, "an NVMe controller's class code");
    // Sizing BAR0 as a VMM does: all ones, read back the mask, place it.
    client.region_write(region::CONFIG, 0x10, &u32::MAX.to_le_bytes()).unwrap();
    let mask = config_read(&mut client, 0x10);
    assert_eq!(u64::from(mask & !0xf), 0x1_0000_0000 - bar0.size, "BAR0 reads back its size");
    client.region_write(region::CONFIG, 0x10, &0xc000_0000u32.to_le_bytes()).unwrap();
    assert_eq!(config_read(&mut client, 0x10) & !0xf, 0xc000_0000);
    // The function itself was not moved: its BAR still holds the host bridge's address.
    assert_eq!(u64::from(host.config_read(f.bdf, 0x10).unwrap() & !0xf), bar0.address & 0xffff_ffff);

    let irq_info = client.get_irq_info(irq::MSIX).unwrap();
    assert_eq!(irq_info.count, u32::from(f.msix_vectors()));
    let fds: Vec<Arc<EventFd>> = (0..irq_info.count).map(|_| Arc::new(EventFd::new().unwrap())).collect();
    let raw: Vec<RawFd> = fds.iter().map(|e| e.fd()).collect();
    client.set_irqs(irq::MSIX, irq::DATA_EVENTFD | irq::ACTION_TRIGGER, 0, irq_info.count, &raw).unwrap();

    let file = memfd(MEM);
    client.dma_map(0, IOVA, MEM as u64, file.as_raw_fd()).unwrap();
    let mem = Arc::new(ClientMemory::new(&file));
    let client = Arc::new(Mutex::new(client));
    let cfg = DriverConfig {
        io_queues: 2,
        msix_vectors: irq_info.count as u16,
        io_timeout: Duration::from_secs(10),
        ..DriverConfig::default()
    };
    let irqs = Arc::new(ClientInterrupts(fds));
    let drv = NvmeDriver::new(Arc::new(ClientBar(client.clone())), mem.clone(), irqs.clone(), cfg)
        .expect("the driver initializes the remote controller through the client");
    assert_eq!(drv.size_bytes(), DRIVE);
    // Sizes from one block to beyond a PRP list page: the device reads the client's memory for
    // commands, lists and write data, and writes it for completions and read data.
    for (i, len) in [4096usize, 8192, 65536, 1 << 20, 512 << 10].into_iter().enumerate() {
        let offset = (i as u64) * (2 << 20) + 4096;
        let data = pattern(seed + i as u64, len);
        drv.write_at(offset, &data, false).unwrap();
        let mut back = vec![0u8; len];
        drv.read_at(offset, &mut back).unwrap();
        assert!(back == data, "{len} bytes at {offset} read back differently");
    }
    drv.flush().unwrap();
    assert!(drv.stats().interrupts.load(Ordering::Relaxed) > 0, "completions came as interrupts");
    assert!(host.stats().dma_reads_served > 0 && host.stats().dma_writes_applied > 0);
    drv.shutdown().unwrap();
    drop(drv);
    client.lock().unwrap().shutdown().unwrap();
}

#[test]
fn an_independent_client_enumerates_maps_memory_and_runs_the_nvme_driver() {
    let (host, _dev, f) = fabric(0.0, 1);
    let server = serve("client", &host, &f);
    drive_through_the_client(server.path(), &f, &host, 10);
    // The next client starts afresh: the first one's memory is no longer the function's.
    std::thread::sleep(Duration::from_millis(300));
    drive_through_the_client(server.path(), &f, &host, 20);
    let s = server.stats();
    assert_eq!(s.connections.load(Ordering::Relaxed), 2);
    assert_eq!(s.protocol_errors.load(Ordering::Relaxed), 0);
    let path = server.path().to_path_buf();
    server.stop();
    assert!(!path.exists(), "the socket goes with the server");
}

#[test]
fn over_a_lossy_wire_every_byte_arrives() {
    let (host, _dev, f) = fabric(0.01, 3);
    let server = serve("lossy", &host, &f);
    drive_through_the_client(server.path(), &f, &host, 30);
}

/// A raw client: messages built by hand.
struct Raw {
    s: UnixStream,
    id: u16,
}

impl Raw {
    fn connect(path: &Path) -> Raw {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = Raw { s, id: 0 };
        let mut v = vec![0, 0, 1, 0];
        v.extend_from_slice(b"{\"capabilities\":{}}\0");
        let (flags, _, body) = r.call(1, &v, &[]);
        assert_eq!(flags, 1, "a VERSION reply");
        assert!(body.ends_with(b"}\0"));
        r
    }

    fn send(&mut self, command: u16, body: &[u8], fds: &[RawFd]) {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        self.id += 1;
        let mut m = Vec::new();
        m.extend_from_slice(&self.id.to_le_bytes());
        m.extend_from_slice(&command.to_le_bytes());
        m.extend_from_slice(&((16 + body.len()) as u32).to_le_bytes());
        m.extend_from_slice(&[0; 8]);
        m.extend_from_slice(body);
        if fds.is_empty() {
            self.s.write_all(&m).unwrap();
        } else {
            let n = self.s.send_with_fds(&[&m[..]], fds).unwrap();
            self.s.write_all(&m[n..]).unwrap();
        }
    }

    /// Sends a message, returns the reply's (flags, error, body).
    fn call(&mut self, command: u16, body: &[u8], fds: &[RawFd]) -> (u32, u32, Vec<u8>) {
        self.send(command, body, fds);
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(u16::from_le_bytes([h[0], h[1]]), self.id);
        let size = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let mut body = vec![0u8; size - 16];
        self.s.read_exact(&mut body).unwrap();
        let w = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        (w(8), w(12), body)
    }

    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}

fn le(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn dma_map_body(offset: u64, address: u64, size: u64) -> Vec<u8> {
    [&le(&[32, 3])[..], &offset.to_le_bytes(), &address.to_le_bytes(), &size.to_le_bytes()].concat()
}

const ERROR: u32 = 0x21;

#[test]
fn hostile_clients_get_errors_or_are_disconnected_and_the_server_goes_on() {
    let (host, _dev, f) = fabric(0.0, 5);
    let server = serve("hostile", &host, &f);
    let path = server.path().to_path_buf();
    {
        let mut r = Raw::connect(&path);
        // A second client while this one is served is closed at once.
        let mut second = UnixStream::connect(&path).unwrap();
        second.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(matches!(second.read(&mut [0u8; 1]), Ok(0) | Err(_)));
        // Region accesses outside the region, of a region that does not exist, of wrong sizes.
        let bar0 = f.bar(0).unwrap().size;
        let read = |offset: u64, region: u32, count: u32| {
            [&offset.to_le_bytes()[..], &le(&[region, count])].concat()
        };
        assert_eq!(r.call(9, &read(bar0 - 2, 0, 4), &[]).1, libc::EINVAL as u32);
        assert_eq!(r.call(9, &read(0, 42, 4), &[]).1, libc::EINVAL as u32);
        // DMA maps: a file too small for the mapping, unaligned, overlapping, two descriptors.
        let small = memfd(4096);
        assert_eq!(r.call(2, &dma_map_body(0, IOVA, 1 << 20), &[small.as_raw_fd()]).0, ERROR);
        let mem = memfd(1 << 20);
        assert_eq!(r.call(2, &dma_map_body(0, IOVA + 1, 4096), &[mem.as_raw_fd()]).0, ERROR);
        assert_eq!(r.call(2, &dma_map_body(0, IOVA, 1 << 20), &[mem.as_raw_fd()]).0, 1);
        assert_eq!(r.call(2, &dma_map_body(0, IOVA + 4096, 4096), &[mem.as_raw_fd()]).1, libc::EEXIST as u32);
        assert_eq!(
            r.call(2, &dma_map_body(0, IOVA + (2 << 20), 4096), &[mem.as_raw_fd(), mem.as_raw_fd()]).0,
            ERROR
        );
        // The mapped memfd can no longer shrink under the server.
        assert!(mem.set_len(4096).is_err());
        // Memory without a descriptor is accepted but out of the function's reach.
        assert_eq!(r.call(2, &dma_map_body(0, IOVA + (4 << 20), 1 << 20), &[]).0, 1);
        assert_eq!(r.call(2, &dma_map_body(0, IOVA + (4 << 20), 4096), &[]).1, libc::EEXIST as u32);
        // Unmapping part of a mapping is refused; all of it is fine.
        let unmap = |address: u64, size: u64| {
            [&le(&[24, 0])[..], &address.to_le_bytes(), &size.to_le_bytes()].concat()
        };
        assert_eq!(r.call(3, &unmap(IOVA + (4 << 20), 4096), &[]).1, libc::EINVAL as u32);
        assert_eq!(r.call(3, &unmap(IOVA + (4 << 20), 1 << 20), &[]).0, 1);
        // Interrupts: a pipe is not an eventfd; vectors beyond the table; masking.
        let (pr, _pw) = std::io::pipe().unwrap();
        let set = |flags: u32, start: u32, count: u32| le(&[20, flags, irq::MSIX, start, count]);
        let eventfd_trigger = irq::DATA_EVENTFD | irq::ACTION_TRIGGER;
        assert_eq!(r.call(8, &set(eventfd_trigger, 0, 1), &[pr.as_raw_fd()]).1, libc::EINVAL as u32);
        let e = EventFd::new().unwrap();
        let n = u32::from(f.msix_vectors());
        assert_eq!(r.call(8, &set(eventfd_trigger, n, 1), &[e.fd()]).1, libc::EINVAL as u32);
        assert_eq!(r.call(8, &set(irq::DATA_NONE | irq::ACTION_MASK, 0, 1), &[]).1, libc::EINVAL as u32);
        // A vector routed to an eventfd, triggered by the client itself.
        assert_eq!(r.call(8, &set(eventfd_trigger, 0, 1), &[e.fd()]).0, 1);
        assert_eq!(r.call(8, &set(irq::DATA_NONE | irq::ACTION_TRIGGER, 0, 1), &[]).0, 1);
        assert_eq!(e.wait(Duration::from_secs(5)), 1);
        // Commands the server does not serve, and a reset it does not offer.
        assert_eq!(r.call(11, &[0; 16], &[]).1, libc::ENOTSUP as u32);
        assert_eq!(r.call(13, &[], &[]).1, libc::ENOTSUP as u32);
        // A header claiming an impossible size ends the connection.
        r.s.write_all(&[1, 0, 9, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        assert!(r.closed(), "an out-of-step stream is disconnected");
    }
    // Messages of the wrong size for their command: an error reply, then the door.
    {
        let read = |offset: u64, region: u32, count: u32| {
            [&offset.to_le_bytes()[..], &le(&[region, count])].concat()
        };
        let malformed: [(u16, Vec<u8>); 4] = [
            (9, read(0, region::CONFIG, 1 << 21)),
            (10, [&read(0, 0, 8)[..], &[1, 2]].concat()),
            (5, le(&[8, 0, 0, 0])),
            (2, le(&[32, 3])),
        ];
        for (command, body) in malformed {
            let mut r = Raw::connect(&path);
            let (flags, error, _) = r.call(command, &body, &[]);
            assert_eq!((flags, error), (ERROR, libc::EINVAL as u32), "command {command}");
            assert!(r.closed(), "command {command}: disconnected after a malformed message");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    {
        // A client that must start with VERSION, and one that hangs up mid-message.
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut m = vec![1, 0, 4, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        m.extend_from_slice(&le(&[16, 0, 0, 0]));
        s.write_all(&m).unwrap();
        let mut h = [0u8; 16];
        s.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_le_bytes([h[8], h[9], h[10], h[11]]), ERROR);
        s.write_all(&[1, 0, 9, 0, 200, 0, 0, 0]).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    // The server still serves a well-behaved client.
    drive_through_the_client(&path, &f, &host, 40);
    let s = server.stats();
    assert_eq!(s.refused.load(Ordering::Relaxed), 1);
    assert_eq!(s.dma_maps_unbacked.load(Ordering::Relaxed), 1);
    assert!(s.protocol_errors.load(Ordering::Relaxed) >= 6);
    assert!(s.errors.load(Ordering::Relaxed) >= 15);
}
