//! `lanbus bench ...`: system measurements, each with its peer measured in the same run.
//!
//! Every benchmark prints a table, writes the common JSON format with `--json FILE` (see
//! [`report`]), quotes medians of several runs, and reports the ratio to its peer.

pub mod fabric;
mod fabric_paths;
mod interrupt;
pub mod msg;
mod msg_mpi;
mod msg_relay;
pub mod nbd;
pub mod nic;
pub mod nic_tunnel;
pub mod nvme;
pub mod pcie;
pub mod plot;
pub mod progress;
pub mod report;
mod ring;
pub mod stack;
mod stack_servers;
pub mod transport;
pub mod transport_core;
pub mod vm;
mod vring;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The paper's Fig. 6: fio random read/write, qd1, 4K..1M, against the NVMe namespace over
    /// NBD: in-process (`local`), over the fabric (sim, udp, afpacket, afxdp) and qemu-nbd.
    Nvme(nvme::NvmeBenchArgs),
    /// fio (nbd engine) against lanbus's NBD server (file and RAM) and qemu-nbd on the same file.
    Nbd(nbd::NbdBenchArgs),
    /// Messages/s through two transport endpoints in one thread, frames handed over directly (no
    /// wire). There is no peer program for an in-process protocol core; frames/s are shown too.
    TransportCore(transport_core::TransportCoreArgs),
    /// The vhost-user cache-efficiency study: factors (a)-(e) on a two-thread virtqueue model.
    Vring(vring::Args),
    /// Our SPSC ring against DPDK rte_ring (dpdk-test) and the rtrb crate, ns per element.
    Ring(ring::Args),
    /// DMA engine throughput and 4 B MMIO read latency through the PCIe bridges over sim, udp,
    /// afpacket and afxdp (root: a veth pair), against the same device in-process (`local`).
    Pcie(pcie::PcieArgs),
    /// The transport over real ports (udp, afpacket, afxdp) on a veth pair between two network
    /// namespaces, one process each: ping-pong latency, streaming goodput, idle CPU; peers
    /// sockperf and iperf3 on the same veth. Needs root.
    Transport(transport::TransportArgs),
    /// Several host and I/O-box pairs streaming at once through one switch (a Linux bridge of
    /// network namespaces): aggregate goodput, Jain's fairness, rate control on and off, with and
    /// without a CPU hog and a shared tbf bottleneck; iperf3 TCP over the same switch as the peer.
    /// Needs root.
    Fabric(fabric::FabricArgs),
    /// MPI-style ping-pong latency through the messaging engine (eager up to 32 KiB, rendezvous
    /// above) over udp, afpacket and afxdp on a veth pair between two namespaces, against
    /// NetPIPE's TCP ping-pong (NPtcp) on the same veth. Needs root.
    Msg(msg::MsgArgs),
    /// iperf3 (TCP 1 and 4 streams, UDP 64 B and 1400 B) from a host through a remote virtio-net
    /// NIC in an I/O box over udp, afpacket and afxdp, against the same iperf3 over a direct veth,
    /// with two floors per port: the same iperf3 TCP through a bare relay between the two TAPs over
    /// the port (`tunnel:PORT`, nothing of PCIe) and the port's raw one-way rate. Needs root.
    Nic(nic::NicBenchArgs),
    /// The TCP/IP stack server against Linux's TCP on a veth at MTU 1500: throughput by the
    /// application's buffer size (1 KiB to 4 MiB), sending and receiving, for the rump-kernel
    /// study's baseline copy path and each copy unit, with the veth's offloads on and off; and
    /// the idle server's CPU. Needs root.
    Stack(stack::StackBenchArgs),
    /// A Linux guest under QEMU on the remote drive (vhost-user-blk) and the remote NIC
    /// (vhost-user-net): dd and wget inside the guest, against qemu-storage-daemon's
    /// vhost-user-blk on a local file, QEMU's NBD client over TCP, and QEMU's virtio-net on a TAP;
    /// with the fabric's own cost (fio over NBD) in the same run. Needs root.
    Vm(vm::VmBenchArgs),
    /// One side of `bench transport` (started by it inside a namespace).
    #[command(hide = true)]
    TransportPeer(transport::PeerArgs),
}

/// Runs one benchmark.
pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    // A peer process is ended by its bench (stdin closed); everything else cleans up on a signal.
    if !matches!(command, BenchCommand::TransportPeer(_)) {
        interrupt::install()?;
    }
    match command {
        BenchCommand::Nbd(args) => nbd::run(args),
        BenchCommand::Nvme(args) => nvme::run(args),
        BenchCommand::TransportCore(args) => transport_core::run(args),
        BenchCommand::Vring(a) => vring::run(a),
        BenchCommand::Ring(a) => ring::run(a),
        BenchCommand::Pcie(args) => pcie::run(args),
        BenchCommand::Transport(args) => transport::run(args),
        BenchCommand::Fabric(args) => fabric::run(args),
        BenchCommand::Msg(args) => msg::run(args),
        BenchCommand::Nic(args) => nic::run(args),
        BenchCommand::Stack(args) => stack::run(args),
        BenchCommand::Vm(args) => vm::run(args),
        BenchCommand::TransportPeer(args) => transport::run_peer(args),
    }
}

fn free_udp_port() -> anyhow::Result<u16> {
    Ok(std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Bytes of IPv4 and UDP headers in front of a `udp` port's datagram.
pub const UDP_IPV4_HEADERS: usize = 28;

/// The port specs of `kind` for the two ends of `v` (a's, then b's), opened inside their
/// namespaces.
pub fn port_specs(kind: &str, v: &lanbus_port::netns::VethPair) -> anyhow::Result<(String, String)> {
    // Datagrams as large as the link takes, as the other ports' frames are.
    let udp_mtu = v.mtu()? - UDP_IPV4_HEADERS;
    let spec = |end: &lanbus_port::netns::VethEnd, peer: &lanbus_port::netns::VethEnd| match kind {
        "udp" => format!("udp:{}:7400,peer={}:7400,mtu={udp_mtu}", end.ipv4, peer.ipv4),
        "afxdp" => format!("afxdp:{}", end.ifname),
        _ => format!("{kind}:{},rx=v2", end.ifname),
    };
    Ok((spec(&v.a, &v.b), spec(&v.b, &v.a)))
}

/// The two ends of a `kind` port (udp, afpacket, afxdp) for a fabric row: over a veth pair between
/// two namespaces when there is one (root), else udp over loopback.
pub fn port_pair(
    kind: &str,
    veth: Option<&lanbus_port::netns::VethPair>,
) -> anyhow::Result<(Box<dyn lanbus_port::Port>, Box<dyn lanbus_port::Port>)> {
    match (kind, veth) {
        ("udp", None) => {
            let (pa, pb) = (free_udp_port()?, free_udp_port()?);
            let a = format!("udp:127.0.0.1:{pa},peer=127.0.0.1:{pb}")
                .parse::<lanbus_port::PortSpec>()
                .and_then(|s| s.open())?;
            let b = format!("udp:127.0.0.1:{pb},peer=127.0.0.1:{pa}")
                .parse::<lanbus_port::PortSpec>()
                .and_then(|s| s.open())?;
            Ok((a, b))
        }
        (_, Some(v)) => {
            let (sa, sb) = port_specs(kind, v)?;
            let a = v.a.netns.run(move || {
                sa.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()).map_err(|e| e.to_string())
            })?;
            let b = v.b.netns.run(move || {
                sb.parse::<lanbus_port::PortSpec>().and_then(|s| s.open()).map_err(|e| e.to_string())
            })?;
            Ok((a.map_err(anyhow::Error::msg)?, b.map_err(anyhow::Error::msg)?))
        }
        _ => anyhow::bail!("{kind} needs a veth pair between two namespaces (root)"),
    }
}

/// The keyed fabric's settings a bench measures in turns (`--security off,auth,encrypt`).
pub const SECURITY: [&str; 3] = ["off", "auth", "encrypt"];

/// `pair` as the bench's `security` setting has it: unchanged (`off`), or both ends behind the
/// authentication layer under one key of this run, sealing (`auth`) or also encrypting
/// (`encrypt`) every frame.
pub fn secured(
    pair: (Box<dyn lanbus_port::Port>, Box<dyn lanbus_port::Port>),
    security: &str,
) -> (Box<dyn lanbus_port::Port>, Box<dyn lanbus_port::Port>) {
    if security == "off" {
        return pair;
    }
    let ring = lanbus_secure::KeyRing::new(lanbus_secure::FabricKey::generate(), []);
    let encrypt = security == "encrypt";
    let (a, b) = (lanbus_secure::Keys::new(ring.clone()), lanbus_secure::Keys::new(ring));
    (
        Box::new(lanbus_secure::SecurePort::new(pair.0, a, encrypt)),
        Box::new(lanbus_secure::SecurePort::new(pair.1, b, encrypt)),
    )
}

/// The AEAD's own rate on one core, GB/s: sealing 64 KiB frames in place for `seconds` with the
/// suite this CPU prefers, authenticating only (`encrypt` false: the frame is associated data)
/// or encrypting. The `crypto:` rows of the benches that take `--security`.
pub fn aead_rate(encrypt: bool, seconds: f64) -> f64 {
    let suite = lanbus_secure::Suite::preferred();
    let key = lanbus_secure::kdf::SealKey::new(suite, &[7; 32]);
    let mut frame = vec![0x5au8; 65_536];
    let started = std::time::Instant::now();
    let mut bytes = 0u64;
    let mut counter = 0u64;
    while started.elapsed().as_secs_f64() < seconds {
        for _ in 0..16 {
            let tag = if encrypt {
                let (head, body) = frame.split_at_mut(54);
                key.seal(counter, head, body)
            } else {
                key.seal(counter, &frame, &mut [])
            };
            std::hint::black_box(tag);
            counter += 1;
            bytes += frame.len() as u64;
        }
    }
    bytes as f64 / 1e9 / started.elapsed().as_secs_f64()
}

/// The `crypto:` rows: the AEAD's rate for `auth` and `encrypt` (whichever of them `security`
/// names), each the median of `runs` runs of half a second.
pub fn crypto_rows(security: &[String], runs: usize) -> Vec<report::Row> {
    let suite = lanbus_secure::Suite::preferred().name();
    let mut rows = Vec::new();
    for s in ["auth", "encrypt"] {
        if !security.iter().any(|x| x == s) {
            continue;
        }
        let mut v: Vec<f64> = (0..runs.max(1)).map(|_| aead_rate(s == "encrypt", 0.5)).collect();
        v.sort_by(f64::total_cmp);
        let gbs = v[v.len() / 2];
        eprintln!("bench: crypto {suite} {s}: {gbs:.2} GB/s per core on 64 KiB frames");
        rows.push(
            report::Row::new(format!("crypto:{}", suite.to_lowercase()), "gb_per_s_per_core", gbs)
                .with("security", s)
                .with("frame_bytes", 65_536u64),
        );
    }
    rows
}

/// For each row of `metric` measured over a keyed fabric (`security` other than `off`): given
/// `ratio`, a row `ratio_vs_security_off`, its value over the value of the row with the same name
/// and parameters under `off`; given `as_us` (the figure turned into µs per operation), a row
/// `added_us_vs_security_off`, what the key adds to each operation.
pub fn versus_security_off(
    report: &mut report::Report,
    metric: &str,
    ratio: bool,
    as_us: Option<fn(f64) -> f64>,
) {
    // A row's settings: its parameters less the security and the figures some rows carry as
    // parameters (their runs, a loss, a ratio to a peer), which differ between the two rows.
    let without = |r: &report::Row| {
        let mut p = r.params.clone();
        p.retain(|k, _| k != "security" && k != "runs" && k != "loss_percent" && !k.starts_with("ratio_"));
        p
    };
    let mut out = Vec::new();
    for r in report.rows.iter().filter(|r| r.metric == metric) {
        if r.params.get("security").and_then(|v| v.as_str()).is_none_or(|s| s == "off") {
            continue;
        }
        let base = report.rows.iter().find(|o| {
            o.metric == metric
                && o.name == r.name
                && o.params.get("security").and_then(|v| v.as_str()) == Some("off")
                && without(o) == without(r)
        });
        let Some(base) = base else { continue };
        let with_params = |mut row: report::Row| {
            for (k, v) in &r.params {
                row = row.with(k, v.clone());
            }
            row
        };
        if ratio {
            out.push(with_params(report::Row::new(
                r.name.clone(),
                "ratio_vs_security_off",
                r.value / base.value,
            )));
        }
        if let Some(us) = as_us {
            out.push(with_params(report::Row::new(
                r.name.clone(),
                "added_us_vs_security_off",
                us(r.value) - us(base.value),
            )));
        }
    }
    report.rows.extend(out);
}

/// The floor of a keyed row's rate: for each row of `metric` (MB/s) over a keyed fabric, the
/// ratio to `off` it would have if each byte's AEAD work on both ends (sealing, then opening,
/// at the `crypto:` row's rate of the same setting) added to the `off` row's time and nothing
/// else changed (`floor_ratio_vs_security_off`): on a machine whose cores every path keeps busy,
/// what the crypto's own cost allows.
pub fn crypto_floor(report: &mut report::Report, metric: &str) {
    let security = |r: &report::Row| r.params.get("security").and_then(|v| v.as_str()).map(str::to_string);
    let mut out = Vec::new();
    for r in report.rows.iter().filter(|r| r.metric == "ratio_vs_security_off") {
        let Some(s) = security(r) else { continue };
        let crypto =
            report.rows.iter().find(|c| c.name.starts_with("crypto:") && security(c).as_deref() == Some(&*s));
        let off = report.rows.iter().find(|o| {
            o.metric == metric
                && o.name == r.name
                && security(o).as_deref() == Some("off")
                && ["rw", "block_size", "iodepth", "numjobs", "mtu", "cmb", "size_bytes", "test"]
                    .iter()
                    .all(|k| o.params.get(*k) == r.params.get(*k))
        });
        let (Some(crypto), Some(off)) = (crypto, off) else { continue };
        // Seconds per byte: the off row's, and the AEAD's on each of the two ends.
        let (t_off, t_crypto) = (1.0 / (off.value * 1e6), 2.0 / (crypto.value * 1e9));
        let mut row =
            report::Row::new(r.name.clone(), "floor_ratio_vs_security_off", t_off / (t_off + t_crypto));
        for (k, v) in &r.params {
            row = row.with(k, v.clone());
        }
        out.push(row);
    }
    report.rows.extend(out);
}

#[cfg(test)]
mod tests {
    use super::report::{Report, Row};

    #[test]
    fn a_keyed_row_is_compared_with_the_open_row_of_the_same_settings_not_the_same_figures() {
        let mut report = Report::new("nic");
        for (security, value, ratio_vs_veth) in [("off", 8.0, 0.4), ("auth", 6.0, 0.3)] {
            for test in ["tcp1", "tcp4"] {
                let scale = if test == "tcp4" { 2.0 } else { 1.0 };
                report.push(
                    Row::new("afpacket", "gbit_per_s", value * scale)
                        .with("security", security)
                        .with("test", test)
                        .with("ratio_vs_veth", ratio_vs_veth)
                        .with("runs", 5),
                );
            }
        }
        super::versus_security_off(&mut report, "gbit_per_s", true, Some(|g| 1.0 / g));
        let got = |metric: &str, test: &str| {
            let rows: Vec<f64> = report
                .rows
                .iter()
                .filter(|r| r.metric == metric && r.params.get("test").and_then(|v| v.as_str()) == Some(test))
                .map(|r| r.value)
                .collect();
            assert_eq!(rows.len(), 1, "{metric} {test}");
            rows[0]
        };
        assert_eq!(got("ratio_vs_security_off", "tcp1"), 0.75);
        assert_eq!(got("ratio_vs_security_off", "tcp4"), 0.75);
        assert!((got("added_us_vs_security_off", "tcp4") - (1.0 / 12.0 - 1.0 / 16.0)).abs() < 1e-12);
    }
}
