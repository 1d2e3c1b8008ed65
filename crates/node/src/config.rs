//! Settings shared by everything that runs a node: the runtime's and the bridges' (the daemons,
//! `lanbus demo`, the benches and `lanbus lspci` use the same), and the daemons' configuration
//! files.
//!
//! Layer: assembly.

use std::path::{Path, PathBuf};
use std::time::Duration;

use lanbus_bridge::{DeviceBridgeConfig, HostBridgeConfig};
use lanbus_runtime::{RuntimeConfig, ThreadMode};
use serde::Deserialize;

use crate::{Error, Result};

/// The runtime settings the daemons use on a port of this spec.
pub fn runtime_config(name: &str, threads: ThreadMode) -> RuntimeConfig {
    let mut c = RuntimeConfig { name: name.into(), threads, ..RuntimeConfig::default() };
    // Delay-based rate control is on, with the transport's parameters (the simulator's and the
    // benches' too). It reads only the fabric's share of a round trip: both hosts leave out how
    // long they held a frame and its ACK (from the port's receive timestamps), frames are stamped
    // when written, and a short rise that does not stand for half a round trip (a thread or the
    // kernel's softirq work waiting for a core) is not a queue. So it stays out of the way on
    // loaded hosts (the drive at depth 32, four streams beside a CPU hog) and cuts the drops of a
    // real bottleneck (`docs/performance.md`, "Four pairs on one switch").
    c.transport.rate.enabled = true;
    // A peer is down after 1 s with no frame from it (10 heartbeat intervals), not 300 ms: an idle
    // peer is heard only through its heartbeats, and on a loaded machine a starved thread can
    // miss three 100 ms beats; a device that loses its host fails the DMA of the command it is
    // running (the controller then reports a fatal status).
    c.transport.heartbeat.missed_limit = 10;
    // Retransmission timeouts below a few milliseconds fire spuriously on a machine whose
    // threads are descheduled for that long (measured on the 2-core bench VM: every frame the
    // device resent after a timeout had arrived, and Go-Back-N resent its whole window each
    // time). A real loss in the middle of a burst is still repaired by fast retransmit.
    c.transport.min_rto = Duration::from_millis(5);
    // Frames as large as the port's link takes (the runtime lowers this to the port's MTU): a
    // 4 KiB TLP then needs two frames instead of three on a 3500-byte veth, one on jumbo frames.
    c.transport.mtu = 65_535;
    c
}

/// Settings of a messaging node whose engine moves its own messages (direct mode: the libfabric
/// provider's ranks, `bench msg`'s engine rows): [`runtime_config`] with a send queue of two
/// windows. The engine hands the transport a record only while the queue has room and keeps the
/// rest itself, so a deeper queue only lets the copies into frames run further ahead of the
/// wire: with 1024 frames (9 MiB at MTU 9000) a stream's frames were written long before they
/// left and came back to the checksum and the kernel from memory instead of the cache
/// (`docs/performance.md`, "Messages and MPI"). A daemon keeps the default: what does not fit
/// its queue is copied into its backlog.
pub fn msg_runtime_config(name: &str, threads: ThreadMode) -> RuntimeConfig {
    let mut c = runtime_config(name, threads);
    c.transport.send_queue_frames = 2 * c.transport.window_frames as usize;
    c
}

/// Settings of a messaging daemon's node (`lanbus msgd`): [`runtime_config`] on one
/// run-to-completion thread, with a longer hold of a lone frame's ACK. A message through two
/// daemons is answered only after two more hand-offs between polling threads than in direct mode
/// (several microseconds on a busy machine), so with the transport's 5 µs hold the answering
/// daemon sent an ACK frame of its own for almost every message in some runs: a send system call
/// on the thread the answer waits for, and a frame more for the other daemon to take in. Held
/// 30 µs, the answer carries the ACK (a stream still acknowledges every fourth frame at once).
pub fn msgd_runtime_config(name: &str) -> RuntimeConfig {
    let mut c = runtime_config(name, ThreadMode::RunToCompletion);
    c.transport.ack_delay = Duration::from_micros(30);
    c
}

/// Host bridge settings for `group`.
pub fn host_config(group: u16, name: &str, threads: ThreadMode) -> HostBridgeConfig {
    HostBridgeConfig {
        group,
        name: name.into(),
        runtime: runtime_config(name, threads),
        completion_timeout: Duration::from_secs(2),
        // The largest payload PCIe allows (the drive supports it): a software bridge pays per
        // TLP, not per byte, so a 1 MiB transfer is 256 TLPs instead of 4,096 at 256 bytes.
        mps: 4096,
        mrrs: 4096,
        ..HostBridgeConfig::default()
    }
}

/// Device bridge settings for `group`.
pub fn device_config(group: u16, name: &str, threads: ThreadMode) -> DeviceBridgeConfig {
    DeviceBridgeConfig {
        group,
        name: name.into(),
        runtime: runtime_config(name, threads),
        completion_timeout: Duration::from_secs(2),
        ..DeviceBridgeConfig::default()
    }
}

/// The I/O box daemon's configuration file (TOML; every key optional, the command line wins).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceFile {
    /// The port spec, or several (one per path: `port = ["afpacket:eth0", "afpacket:eth1"]`).
    pub port: Option<Ports>,
    /// The group whose host the I/O box serves.
    pub group: Option<u16>,
    /// The NVMe drive's blocks ([`crate::drive::NvmeBacking`]).
    pub nvme: Option<String>,
    /// The remote NIC ([`crate::nic::NicSpec`]).
    pub nic: Option<String>,
    /// The namespace's logical block size: 512 or 4096.
    pub lba_size: Option<u32>,
    /// The control socket.
    pub control: Option<PathBuf>,
    /// The name announced in heartbeats.
    pub name: Option<String>,
    /// Where the group set at run time is kept across restarts ([`DeviceState`]).
    pub state: Option<PathBuf>,
    /// Where the counters are served in the Prometheus text format.
    pub metrics: Option<String>,
    /// The fabric key file (`lanbus keygen`): frames are sealed and peers must prove the key.
    pub key: Option<PathBuf>,
    /// Encrypt payloads too (with `key`).
    pub encrypt: Option<bool>,
    /// Duplicate ACKs that count a frame lost (the transport's default if unset; the
    /// retransmission paper's rule is 1).
    pub dup_acks: Option<u32>,
}

/// What an I/O box keeps across its daemon's restarts: the group it was configured with and the
/// group it was moved to at run time (`lanbus device-ctl PATH group N`). A restart keeps the run
/// time group as long as the configured group is unchanged; a new configured group wins.
///
/// Stored as two lines of TOML (`configured_group = N`, `current_group = M`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct DeviceState {
    /// The group the configuration (command line or file) gave.
    pub configured_group: u16,
    /// The group the device serves.
    pub current_group: u16,
}

impl DeviceState {
    /// The group to serve at start, given the configured one and the state left by the last run
    /// (if `path` holds one): the run time group if the configuration did not change since.
    pub fn resume(path: &Path, configured_group: u16) -> Result<DeviceState> {
        let fresh = DeviceState { configured_group, current_group: configured_group };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(fresh),
            Err(e) => {
                return Err(Error::Config { path: path.to_path_buf(), why: format!("cannot read it: {e}") })
            }
        };
        let last: DeviceState = toml::from_str(&text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            why: format!("not a device state: {e}"),
        })?;
        Ok(if last.configured_group == configured_group { last } else { fresh })
    }

    /// Writes the state to `path` (through a temporary file renamed over it, so a crash leaves
    /// the old state or the new, never half of one).
    pub fn store(&self, path: &Path) -> Result<()> {
        let text =
            format!("configured_group = {}\ncurrent_group = {}\n", self.configured_group, self.current_group);
        let tmp = path.with_extension("state-new");
        let fail = |e: std::io::Error| Error::Config {
            path: path.to_path_buf(),
            why: format!("cannot write it: {e}"),
        };
        std::fs::write(&tmp, text).map_err(fail)?;
        std::fs::rename(&tmp, path).map_err(fail)
    }
}

/// The host daemon's configuration file (TOML; every key optional, the command line wins).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostFile {
    /// The port spec, or several (one per path: `port = ["afpacket:eth0", "afpacket:eth1"]`).
    pub port: Option<Ports>,
    /// The group whose devices the host uses.
    pub group: Option<u16>,
    /// What is exported ([`ExportSpec`]): one spec or a list.
    pub export: Option<Exports>,
    /// The control socket.
    pub control: Option<PathBuf>,
    /// The name announced in heartbeats.
    pub name: Option<String>,
    /// Where the counters are served in the Prometheus text format.
    pub metrics: Option<String>,
    /// The fabric key file (`lanbus keygen`): frames are sealed and peers must prove the key.
    pub key: Option<PathBuf>,
    /// Encrypt payloads too (with `key`).
    pub encrypt: Option<bool>,
    /// Duplicate ACKs that count a frame lost (the transport's default if unset; the
    /// retransmission paper's rule is 1).
    pub dup_acks: Option<u32>,
}

/// The messaging daemon's configuration file (TOML; every key optional, the command line wins).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MsgdFile {
    /// The port spec, or several (one per path: `port = ["afpacket:eth0", "afpacket:eth1"]`).
    pub port: Option<Ports>,
    /// The Unix socket processes attach at.
    pub socket: Option<PathBuf>,
    /// The fabric group.
    pub group: Option<u16>,
    /// The fabric key file (`lanbus keygen`): frames are sealed and peers must prove the key.
    pub key: Option<PathBuf>,
    /// Encrypt payloads too (with `key`).
    pub encrypt: Option<bool>,
    /// Duplicate ACKs that count a frame lost (the transport's default if unset; the
    /// retransmission paper's rule is 1).
    pub dup_acks: Option<u32>,
}

/// The stack server's configuration file (TOML; every key optional, the command line wins).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StackdFile {
    /// The port spec (afpacket:IFACE).
    pub port: Option<lanbus_port::PortSpec>,
    /// The stack's IPv4 address and prefix length.
    pub ip: Option<String>,
    /// The IPv4 default route.
    pub gateway: Option<std::net::Ipv4Addr>,
    /// An IPv6 address and prefix length.
    pub ip6: Option<String>,
    /// The IPv6 default route.
    pub gateway6: Option<std::net::Ipv6Addr>,
    /// The Unix socket programs attach at.
    pub socket: Option<PathBuf>,
    /// The control socket.
    pub control: Option<PathBuf>,
    /// Bytes of each TCP connection's receive and send buffers.
    pub tcp_buffer: Option<usize>,
    /// Seconds a connection waits for a silent peer.
    pub tcp_timeout: Option<u64>,
}

/// One export spec or several, in a host's file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Exports {
    /// `export = "nbd:/tmp/s"`.
    One(String),
    /// `export = ["nbd:/tmp/s", "tap:lanbus0"]`.
    Many(Vec<String>),
}

impl Exports {
    /// The specs.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Exports::One(s) => vec![s],
            Exports::Many(v) => v,
        }
    }
}

/// One port spec or several (one per path), in a daemon's file.
#[derive(Debug, Clone, PartialEq)]
pub enum Ports {
    /// `port = "afpacket:eth0"`.
    One(lanbus_port::PortSpec),
    /// `port = ["afpacket:eth0", "afpacket:eth1"]`.
    Many(Vec<lanbus_port::PortSpec>),
}

impl<'de> Deserialize<'de> for Ports {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> core::result::Result<Ports, D::Error> {
        // Parsed here rather than as an untagged enum of specs, so that a bad spec's own message
        // reaches the user.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(String),
            Many(Vec<String>),
        }
        let parse = |s: String| s.parse::<lanbus_port::PortSpec>().map_err(serde::de::Error::custom);
        match Raw::deserialize(d)? {
            Raw::One(s) => Ok(Ports::One(parse(s)?)),
            Raw::Many(v) => v.into_iter().map(parse).collect::<core::result::Result<_, _>>().map(Ports::Many),
        }
    }
}

impl Ports {
    /// The specs.
    pub fn into_vec(self) -> Vec<lanbus_port::PortSpec> {
        match self {
            Ports::One(s) => vec![s],
            Ports::Many(v) => v,
        }
    }
}

/// Reads a daemon's configuration file (none: every key unset).
pub fn read_toml<T: for<'de> Deserialize<'de> + Default>(path: Option<&Path>) -> Result<T> {
    let Some(path) = path else { return Ok(T::default()) };
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Config { path: path.to_path_buf(), why: format!("cannot read it: {e}") })?;
    toml::from_str(&text).map_err(|e| Error::Config { path: path.to_path_buf(), why: e.to_string() })
}

/// What the host exports: the NVMe namespace over NBD or as a vhost-user-blk backend, the NVMe
/// function itself to a vfio-user client, or the remote NIC as a TAP or a vhost-user-net backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportSpec {
    /// The namespace over NBD on a Unix socket path.
    Unix(PathBuf),
    /// The namespace over NBD on a TCP address.
    Tcp(std::net::SocketAddr),
    /// The namespace as a vhost-user-blk backend on a Unix socket path (for QEMU and other VMMs).
    VhostUserBlk {
        /// The socket path.
        path: PathBuf,
        /// Offered read-only.
        read_only: bool,
        /// Request queues offered (1 to 64).
        queues: u16,
    },
    /// The NIC as the TAP interface of this name.
    Tap(String),
    /// The NIC as a vhost-user-net backend on a Unix socket path (for QEMU's virtio-net).
    VhostUserNet(PathBuf),
    /// The NVMe function itself to a vfio-user client on a Unix socket path (a VMM whose guest
    /// runs its own nvme driver on it).
    VfioUser(PathBuf),
}

impl ExportSpec {
    /// Whether this exports the drive over NBD.
    pub fn is_nbd(&self) -> bool {
        matches!(self, ExportSpec::Unix(_) | ExportSpec::Tcp(_))
    }

    /// Whether this exports the drive's namespace (over NBD or vhost-user-blk).
    pub fn is_drive(&self) -> bool {
        !self.is_nic() && !self.is_raw()
    }

    /// Whether this gives a whole function to a vfio-user client.
    pub fn is_raw(&self) -> bool {
        matches!(self, ExportSpec::VfioUser(_))
    }

    /// Whether this exports the NIC (as a TAP or a vhost-user-net backend).
    pub fn is_nic(&self) -> bool {
        matches!(self, ExportSpec::Tap(_) | ExportSpec::VhostUserNet(_))
    }

    fn parse_vhost_user_blk(spec: &str, rest: &str) -> Result<ExportSpec> {
        let mut parts = rest.split(',');
        let path = parts.next().unwrap_or("");
        if path.is_empty() {
            return Err(Error::BadSpec(format!("{spec:?}: expected vhost-user-blk:PATH[,ro][,queues=N]")));
        }
        let (mut read_only, mut queues) = (false, 1u16);
        for p in parts {
            match p.split_once('=') {
                None if p == "ro" => read_only = true,
                Some(("queues", n)) => {
                    queues = n.parse().ok().filter(|q| (1..=64).contains(q)).ok_or_else(|| {
                        Error::BadSpec(format!("queues={n} in {spec:?}: a number of queues from 1 to 64"))
                    })?
                }
                _ => {
                    return Err(Error::BadSpec(format!(
                        "unknown option {p:?} in {spec:?}: expected ro or queues=N"
                    )))
                }
            }
        }
        Ok(ExportSpec::VhostUserBlk { path: path.into(), read_only, queues })
    }
}

impl std::str::FromStr for ExportSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<ExportSpec> {
        let expected = || {
            Error::BadSpec(format!(
                "{s:?}: expected nbd:PATH, nbd:tcp:ADDR, vhost-user-blk:PATH[,ro][,queues=N], tap:NAME, \
                 vhost-user-net:PATH or vfio-user:PATH"
            ))
        };
        if let Some(rest) = s.strip_prefix("vhost-user-blk:") {
            return ExportSpec::parse_vhost_user_blk(s, rest);
        }
        if let Some(path) = s.strip_prefix("vhost-user-net:") {
            if path.is_empty() || path.contains(',') {
                return Err(Error::BadSpec(format!("{s:?}: expected vhost-user-net:PATH")));
            }
            return Ok(ExportSpec::VhostUserNet(path.into()));
        }
        if let Some(path) = s.strip_prefix("vfio-user:") {
            if path.is_empty() || path.contains(',') {
                return Err(Error::BadSpec(format!("{s:?}: expected vfio-user:PATH")));
            }
            return Ok(ExportSpec::VfioUser(path.into()));
        }
        if let Some(name) = s.strip_prefix("tap:") {
            if name.is_empty() || name.len() > 15 || name.contains(['/', ' ', ',']) {
                return Err(Error::BadSpec(format!("{name:?}: an interface name is 1 to 15 characters")));
            }
            return Ok(ExportSpec::Tap(name.to_string()));
        }
        match s.strip_prefix("nbd:") {
            Some(rest) => match rest.strip_prefix("tcp:") {
                Some(addr) => {
                    let addr = addr.parse().map_err(|_| Error::BadSpec(format!("{addr:?}: not IP:PORT")))?;
                    Ok(ExportSpec::Tcp(addr))
                }
                None if !rest.is_empty() => Ok(ExportSpec::Unix(rest.into())),
                None => Err(expected()),
            },
            None => Err(expected()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lanbus-state-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_run_time_group_is_resumed_while_the_configured_one_stays() {
        let d = dir("resume");
        let p = d.join("dev.state");
        assert_eq!(
            DeviceState::resume(&p, 9).unwrap(),
            DeviceState { configured_group: 9, current_group: 9 }
        );
        DeviceState { configured_group: 9, current_group: 11 }.store(&p).unwrap();
        assert_eq!(DeviceState::resume(&p, 9).unwrap().current_group, 11);
        assert_eq!(DeviceState::resume(&p, 12).unwrap().current_group, 12, "a new configuration wins");
        std::fs::write(&p, "configured_group = 9\ncurrent_group = 70000\n").unwrap();
        assert!(matches!(DeviceState::resume(&p, 9), Err(Error::Config { .. })));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_port_is_parsed_from_the_config_file() {
        let file: HostFile = toml::from_str("port = \"udp:127.0.0.1:7000,peer=127.0.0.1:7001\"").unwrap();
        let port = file.port.unwrap().into_vec().remove(0);
        assert!(matches!(port.kind, lanbus_port::PortKind::Udp(_)));
        assert_eq!(port.to_string(), "udp:127.0.0.1:7000,peer=127.0.0.1:7001");
        let e = toml::from_str::<DeviceFile>("port = \"afxdp:eth0:q\"").unwrap_err().to_string();
        assert!(e.contains("not a receive queue number"), "{e}");
        let two: MsgdFile = toml::from_str("port = [\"afpacket:eth0\", \"afpacket:eth1\"]").unwrap();
        let specs: Vec<String> = two.port.unwrap().into_vec().iter().map(|p| p.to_string()).collect();
        assert_eq!(specs, ["afpacket:eth0", "afpacket:eth1"]);
        let e = toml::from_str::<DeviceFile>("port = [\"afpacket:eth0\", \"afxdp:eth0:q\"]").unwrap_err();
        assert!(e.to_string().contains("not a receive queue number"), "{e}");
    }

    #[test]
    fn vhost_user_blk_export_specs() {
        let parse = |s: &str| s.parse::<ExportSpec>();
        assert_eq!(
            parse("vhost-user-blk:/run/vda.sock").unwrap(),
            ExportSpec::VhostUserBlk { path: "/run/vda.sock".into(), read_only: false, queues: 1 }
        );
        assert_eq!(
            parse("vhost-user-blk:/tmp/v.sock,ro,queues=4").unwrap(),
            ExportSpec::VhostUserBlk { path: "/tmp/v.sock".into(), read_only: true, queues: 4 }
        );
        assert!(parse("vhost-user-blk:/tmp/v.sock").unwrap().is_drive());
        assert!(!parse("vhost-user-blk:/tmp/v.sock").unwrap().is_nbd());
        for bad in [
            "vhost-user-blk:",
            "vhost-user-blk:,ro",
            "vhost-user-blk:/s,queues=0",
            "vhost-user-blk:/s,queues=65",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let e = parse("vhost-user-blk:/s,rw").unwrap_err().to_string();
        assert!(e.contains("expected ro or queues=N"), "{e}");
        let e = parse("vhost:/s").unwrap_err().to_string();
        assert!(e.contains("vhost-user-blk:PATH") && e.contains("vhost-user-net:PATH"), "{e}");
    }

    #[test]
    fn nic_export_specs() {
        let parse = |s: &str| s.parse::<ExportSpec>();
        let raw = parse("vfio-user:/run/nvme.sock").unwrap();
        assert_eq!(raw, ExportSpec::VfioUser("/run/nvme.sock".into()));
        assert!(raw.is_raw() && !raw.is_drive() && !raw.is_nic());
        assert!(parse("vfio-user:").is_err() && parse("vfio-user:/s,ro").is_err());
        let net = parse("vhost-user-net:/run/net0.sock").unwrap();
        assert_eq!(net, ExportSpec::VhostUserNet("/run/net0.sock".into()));
        assert!(net.is_nic() && !net.is_drive() && !net.is_nbd());
        assert!(parse("tap:lanbus0").unwrap().is_nic());
        for bad in ["vhost-user-net:", "vhost-user-net:/s,queues=2"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        // Whatever the state file holds, resuming answers a state or a clear error.
        #[test]
        fn any_state_file_resumes_or_is_refused(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..120), group: u16) {
            let d = dir("fuzz");
            let p = d.join("dev.state");
            std::fs::write(&p, &bytes).unwrap();
            match DeviceState::resume(&p, group) {
                Ok(s) => proptest::prop_assert!(s.configured_group == group),
                Err(e) => proptest::prop_assert!(e.to_string().contains("dev.state")),
            }
        }
    }

    #[test]
    fn export_specs() {
        assert_eq!("nbd:/tmp/a.sock".parse::<ExportSpec>().unwrap(), ExportSpec::Unix("/tmp/a.sock".into()));
        assert_eq!(
            "nbd:tcp:127.0.0.1:10809".parse::<ExportSpec>().unwrap(),
            ExportSpec::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert!("nbd:".parse::<ExportSpec>().is_err());
        assert!("tcp:1.2.3.4:5".parse::<ExportSpec>().is_err());
        assert!("nbd:tcp:nothing".parse::<ExportSpec>().is_err());
    }

    #[test]
    fn config_files() {
        let d: DeviceFile =
            toml::from_str("port = \"udp:127.0.0.1:7000\"\ngroup = 7\nnvme = \"ram=64M\"\nlba_size = 4096\n")
                .unwrap();
        assert_eq!((d.group, d.lba_size, d.nvme.as_deref()), (Some(7), Some(4096), Some("ram=64M")));
        assert!(toml::from_str::<DeviceFile>("colour = 1\n").is_err());
        let h: HostFile = toml::from_str("port = \"sim\"\nexport = \"nbd:/tmp/s\"\n").unwrap();
        assert_eq!(h.export.unwrap().into_vec(), ["nbd:/tmp/s"]);
        let h: HostFile = toml::from_str("port = \"sim\"\nexport = [\"nbd:/tmp/s\", \"tap:lb0\"]\n").unwrap();
        assert_eq!(h.export.unwrap().into_vec(), ["nbd:/tmp/s", "tap:lb0"]);
    }

    #[test]
    fn backings() {
        assert_eq!(
            "ram=1M".parse::<crate::drive::NvmeBacking>().unwrap(),
            crate::drive::NvmeBacking::Ram(1 << 20)
        );
        assert_eq!(
            "file=/x,size=2G".parse::<crate::drive::NvmeBacking>().unwrap(),
            crate::drive::NvmeBacking::File { path: "/x".into(), size: Some(2 << 30) }
        );
        assert!("disk=/x".parse::<crate::drive::NvmeBacking>().is_err());
        assert!("ram=1M,size=2".parse::<crate::drive::NvmeBacking>().is_err());
    }

    #[test]
    fn the_example_configs_describe_the_daemons() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../dist/config");
        let read = |name: &str| std::fs::read_to_string(format!("{dir}/{name}")).unwrap();
        let d: DeviceFile = toml::from_str(&read("device.toml")).unwrap();
        assert!(d.port.is_some() && d.nvme.unwrap().parse::<crate::drive::NvmeBacking>().is_ok());
        let h: HostFile = toml::from_str(&read("host.toml")).unwrap();
        for spec in h.export.unwrap().into_vec() {
            spec.parse::<ExportSpec>().unwrap();
        }
        let m: MsgdFile = toml::from_str(&read("msgd.toml")).unwrap();
        assert!(m.port.is_some());
        let s: StackdFile = toml::from_str(&read("stackd.toml")).unwrap();
        assert!(s.ip.is_some() && s.port.is_some());
        // The keys shown commented out are keys too: taken in, each file still parses.
        let uncommented = |name: &str| {
            read(name)
                .lines()
                .map(|l| match l.strip_prefix("# ") {
                    Some(rest) if rest.split_once(" = ").is_some_and(|(k, _)| !k.contains(' ')) => rest,
                    _ => l,
                })
                .collect::<Vec<_>>()
                .join("\n")
        };
        let d: DeviceFile = toml::from_str(&uncommented("device.toml")).unwrap();
        assert!(d.key.is_some() && d.dup_acks.is_some());
        let h: HostFile = toml::from_str(&uncommented("host.toml")).unwrap();
        assert!(h.key.is_some() && h.dup_acks.is_some());
        let m: MsgdFile = toml::from_str(&uncommented("msgd.toml")).unwrap();
        assert!(m.key.is_some() && m.dup_acks.is_some());
    }
}
