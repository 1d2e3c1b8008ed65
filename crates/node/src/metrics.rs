//! A daemon's counters in the Prometheus text exposition format (version 0.0.4), served over
//! HTTP on a local address (`--metrics ADDR`) and read by `lanbus status` as the same numbers.
//!
//! Layer: assembly. Every table of the daemons' counters is written here once: the runtime's
//! (transport and port), each bridge's, the drive's and the NIC's, as [`Sample`]s; [`render`] writes them (one `# HELP` and `# TYPE` per metric name, names prefixed
//! `lanbus_`); [`serve`] answers `GET /metrics` (anything else gets 404, a request that is not
//! HTTP gets 400) until its stop flag is set. Requests come from the network: a slow or broken
//! client costs one bounded read, never the daemon.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use lanbus_bridge::{DeviceBridge, HostBridge};
use lanbus_nvme::pcie::FunctionStats;
use lanbus_runtime::Stats;
use lanbus_vnet::driver::NetDriver;
use lanbus_vnet::NetStats;

/// Whether a metric only grows or may go either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only grows (since the daemon started).
    Counter,
    /// Goes up and down.
    Gauge,
}

/// One value of one metric.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric's name without the `lanbus_` prefix.
    pub name: &'static str,
    /// What it counts.
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// Label pairs.
    pub labels: Vec<(&'static str, String)>,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// A counter sample without labels.
    pub fn counter(name: &'static str, help: &'static str, value: u64) -> Sample {
        Sample { name, help, kind: Kind::Counter, labels: Vec::new(), value: value as f64 }
    }

    /// A gauge sample without labels.
    pub fn gauge(name: &'static str, help: &'static str, value: f64) -> Sample {
        Sample { name, help, kind: Kind::Gauge, labels: Vec::new(), value }
    }

    /// The series name with its labels, as the exposition format writes it.
    pub fn series(&self) -> String {
        if self.labels.is_empty() {
            return format!("lanbus_{}", self.name);
        }
        let labels: Vec<String> = self.labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        format!("lanbus_{}{{{}}}", self.name, labels.join(","))
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Each path of a node with several ports, labelled by local port index and peer node.
pub fn path_samples(paths: &[lanbus_port::PathReport], out: &mut Vec<Sample>) {
    for p in paths {
        let labels = vec![("path", p.port.to_string()), ("node", p.node.to_string())];
        let mut add = |mut s: Sample| {
            s.labels = labels.clone();
            out.push(s);
        };
        add(Sample::gauge(
            "path_up",
            "Whether frames go by the path (1) or it is down (0).",
            f64::from(u8::from(p.up)),
        ));
        add(Sample::gauge(
            "path_weight",
            "The path's share of its node's frames, relative to the others.",
            p.weight,
        ));
        if let Some(rtt) = p.rtt {
            add(Sample::gauge("path_rtt_seconds", "The path's last probe round trip.", rtt.as_secs_f64()));
        }
        add(Sample::counter("path_tx_frames_total", "Frames sent by the path.", p.tx_frames));
        add(Sample::counter("path_rx_frames_total", "Frames received by the path.", p.rx_frames));
        add(Sample::counter(
            "path_lost_frames_total",
            "Frames sent by the path that the peer did not receive.",
            p.lost_frames,
        ));
        add(Sample::counter("path_failovers_total", "Times the path was taken down.", p.failovers));
    }
}

/// The paths of a node with several ports, for `lanbus status` (an empty list for one port).
pub fn paths_json(paths: &[lanbus_port::PathReport]) -> serde_json::Value {
    paths
        .iter()
        .map(|p| {
            serde_json::json!({
                "port": p.port,
                "local": p.local.to_string(),
                "node": p.node.to_string(),
                "remote": p.remote.to_string(),
                "up": p.up,
                "rtt_us": p.rtt.map(|r| r.as_secs_f64() * 1e6),
                "weight": p.weight,
                "tx_frames": p.tx_frames,
                "rx_frames": p.rx_frames,
                "lost_frames": p.lost_frames,
                "failovers": p.failovers,
            })
        })
        .collect()
}

/// The transport's and the port's counters of a runtime.
pub fn runtime_samples(stats: &Stats, out: &mut Vec<Sample>) {
    let t = &stats.transport;
    let c = Sample::counter;
    out.extend([
        c("frames_sent_total", "Frames the transport wrote (all kinds).", t.frames_sent),
        c("frames_received_total", "Frames handed to the transport.", t.frames_received),
        c("retransmitted_frames_total", "DATA frames sent again.", t.retransmitted_frames),
        c(
            "fast_retransmits_total",
            "Fast retransmits: go-backs on duplicate ACKs, or frames found lost by selective acknowledgements.",
            t.fast_retransmits,
        ),
        c("frames_held_total", "DATA frames held past a hole until it filled (selective repeat).", t.frames_held),
        c("tail_loss_probes_total", "Tail-loss probes sent.", t.tail_loss_probes),
        c(
            "path_resends_total",
            "Frames in flight sent again because a path that may have carried them failed.",
            t.path_resends,
        ),
        c("retransmission_timeouts_total", "Retransmission timer expiries.", t.timeouts),
        c("frames_dropped_total", "Received frames dropped, all reasons.", t.drops()),
        c(
            "frames_wrong_group_total",
            "Frames from nodes of other groups, dropped (with groups as VLANs the port drops them first).",
            t.drop_wrong_group,
        ),
        c("peer_restarts_total", "Peers seen coming back with a new epoch.", t.peer_restarts),
        c("rate_decreases_total", "Rate cuts by rate control (delay above target, timeouts).", t.rate_decreases),
        c("messages_sent_total", "Messages queued for sending.", t.messages_sent),
        c("message_bytes_sent_total", "Bytes of the messages queued for sending.", t.bytes_sent),
        c(
            "message_bytes_lent_total",
            "Bytes of sent messages the frames pointed at where their sender kept them (not copied into frames).",
            t.bytes_lent,
        ),
        c(
            "bytes_copied_on_delivery_total",
            "Bytes the transport copied while delivering (put together from several frames, held past a hole).",
            t.bytes_copied_on_delivery,
        ),
        c("messages_delivered_total", "Messages delivered in order.", t.messages_delivered),
        c("port_rx_frames_total", "Frames the port received.", stats.port.rx_frames),
        c("port_tx_frames_total", "Frames the port sent.", stats.port.tx_frames),
        c("port_rx_bytes_total", "Bytes of the frames the port received.", stats.port.rx_bytes),
        c("port_tx_bytes_total", "Bytes of the frames the port sent.", stats.port.tx_bytes),
        c("port_rx_dropped_total", "Frames the port dropped on receive.", stats.port.rx_dropped),
        c(
            "port_rx_filtered_total",
            "Frames the port filtered out as not for this node's VLAN (groups as VLANs).",
            stats.port.rx_filtered,
        ),
    ]);
    if let Some(rtt) = t.rtt_mean() {
        out.push(Sample::gauge("rtt_mean_seconds", "Mean round trip of the RTT samples.", rtt.as_secs_f64()));
    }
    if let Some(rtt) = t.fabric_rtt_mean() {
        out.push(Sample::gauge(
            "fabric_rtt_mean_seconds",
            "Mean of the fabric's share of the round trips (less the time both hosts held the frame and its ACK).",
            rtt.as_secs_f64(),
        ));
    }
    out.push(Sample::gauge(
        "send_backlog_messages",
        "Messages local threads queued that wait for room in the transport.",
        stats.backlog_messages as f64,
    ));
}

/// A device bridge's counters and state.
pub fn device_bridge_samples(bridge: &DeviceBridge, out: &mut Vec<Sample>) {
    let b = bridge.stats();
    let c = Sample::counter;
    out.extend([
        c("bridge_tlps_received_total", "TLPs the device bridge received.", b.tlps_received),
        c("bridge_dma_reads_total", "DMA reads the functions issued.", b.dma_reads),
        c("bridge_dma_read_failures_total", "DMA reads that failed.", b.dma_read_failures),
        c("bridge_dma_writes_total", "DMA writes the functions issued.", b.dma_writes),
        c(
            "bridge_prefetched_reads_total",
            "DMA reads started before a function's work asked for them (an NVMe command, its PRP list, a write's data).",
            b.prefetched_reads,
        ),
        c("bridge_prefetches_used_total", "Prefetched DMA reads used.", b.prefetches_used),
        c("bridge_foreign_requests_total", "Requests from hosts not ours.", b.foreign_requests),
        c("bridge_host_changes_total", "Times the bridge took up or lost its host.", b.host_changes),
        c(
            "bridge_payload_bytes_copied_total",
            "Payload bytes the bridge copied out of received TLPs or into completions.",
            b.payload_bytes_copied,
        ),
    ]);
    out.push(Sample::gauge("group", "The group the I/O box serves.", f64::from(bridge.group())));
    out.push(Sample::gauge(
        "host_present",
        "1 while a host of the group is served.",
        f64::from(u8::from(bridge.host().is_some())),
    ));
}

/// A host bridge's counters.
pub fn host_bridge_samples(bridge: &HostBridge, out: &mut Vec<Sample>) {
    let b = bridge.stats();
    let c = Sample::counter;
    out.extend([
        c("bridge_tlps_received_total", "TLPs the host bridge received.", b.tlps_received),
        c("bridge_dma_reads_served_total", "Device DMA reads served from host memory.", b.dma_reads_served),
        c(
            "bridge_dma_reads_deferred_total",
            "Device DMA reads served in a later turn than they arrived (a large read in parts).",
            b.dma_reads_deferred,
        ),
        c(
            "bridge_dma_writes_applied_total",
            "Device DMA writes applied to host memory.",
            b.dma_writes_applied,
        ),
        c("bridge_interrupts_total", "MSI-X interrupts delivered.", b.interrupts),
        c("bridge_completion_timeouts_total", "Requests that timed out.", b.timeouts),
        c("bridge_device_gone_total", "Requests failed because their device went.", b.device_gone),
        c(
            "bridge_payload_bytes_copied_total",
            "Payload bytes the bridge copied: device writes into host memory, completions of device reads.",
            b.payload_bytes_copied,
        ),
    ]);
    out.push(Sample::gauge("devices", "Remote functions enumerated.", bridge.devices().len() as f64));
}

/// The NVMe controller's counters, in the I/O box.
pub fn nvme_samples(stats: &FunctionStats, out: &mut Vec<Sample>) {
    let (n, _) = stats.get();
    let c = Sample::counter;
    out.extend([
        c("nvme_io_commands_total", "NVMe I/O commands the drive ran.", n.io_commands),
        c("nvme_bytes_read_total", "Bytes the drive read for hosts.", n.bytes_read),
        c("nvme_bytes_written_total", "Bytes the drive wrote for hosts.", n.bytes_written),
        c("nvme_error_completions_total", "NVMe commands completed with an error.", n.error_completions),
        c(
            "nvme_bytes_copied_total",
            "Bytes the drive copied: host writes into its memory buffer, a command's data into its own buffer.",
            n.bytes_copied,
        ),
    ]);
}

/// The virtio-net function's counters, in the I/O box.
pub fn nic_device_samples(stats: &NetStats, out: &mut Vec<Sample>) {
    let v = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let c = Sample::counter;
    out.extend([
        c("nic_tx_frames_total", "Frames the host sent out through the NIC.", v(&stats.tx_frames)),
        c("nic_tx_bytes_total", "Bytes the host sent out through the NIC.", v(&stats.tx_bytes)),
        c("nic_rx_frames_total", "Frames the NIC received for the host.", v(&stats.rx_frames)),
        c("nic_rx_bytes_total", "Bytes the NIC received for the host.", v(&stats.rx_bytes)),
        c("nic_rx_dropped_total", "Frames dropped: the host took none.", v(&stats.rx_dropped)),
        c("nic_rx_too_big_total", "Frames larger than the host's buffers.", v(&stats.rx_too_big)),
        c("nic_broken_total", "Times the host's driver broke a queue.", v(&stats.broken)),
    ]);
}

/// The remote NIC's driver counters, on the host.
pub fn nic_driver_samples(driver: &NetDriver, out: &mut Vec<Sample>) {
    let s = driver.stats();
    let v = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let c = Sample::counter;
    out.extend([
        c("nic_tx_frames_total", "Frames sent through the remote NIC.", v(&s.tx_frames)),
        c("nic_tx_bytes_total", "Bytes sent through the remote NIC.", v(&s.tx_bytes)),
        c("nic_rx_frames_total", "Frames received through the remote NIC.", v(&s.rx_frames)),
        c("nic_rx_bytes_total", "Bytes received through the remote NIC.", v(&s.rx_bytes)),
    ]);
}

/// The samples as one JSON object (series name: value), as `lanbus status` shows them.
pub fn json(samples: &[Sample]) -> serde_json::Value {
    serde_json::Value::Object(samples.iter().map(|s| (s.series(), serde_json::json!(s.value))).collect())
}

/// Writes `samples` in the text exposition format.
pub fn render(samples: &[Sample]) -> String {
    let mut out = String::new();
    let mut described: Vec<&str> = Vec::new();
    for s in samples {
        if !described.contains(&s.name) {
            described.push(s.name);
            let kind = match s.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
            };
            out += &format!("# HELP lanbus_{} {}\n# TYPE lanbus_{} {kind}\n", s.name, s.help, s.name);
        }
        out += &format!("{} {}\n", s.series(), s.value);
    }
    out
}

/// What gives a daemon's samples at each request.
pub type Collect = dyn Fn() -> Vec<Sample> + Send + Sync;

/// The metrics endpoint served on a thread of its own until stopped or dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (before anything else starts, so that a taken address fails early).
    pub fn bind(addr: SocketAddr) -> crate::Result<TcpListener> {
        TcpListener::bind(addr)
            .map_err(|e| crate::Error::Io { what: format!("binding the metrics address {addr}"), source: e })
    }

    /// Serves `GET /metrics` on `listener` with what `collect` gives at each request.
    pub fn start(listener: TcpListener, collect: Arc<Collect>) -> crate::Result<MetricsServer> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| crate::Error::Io { what, source }
        };
        let addr = listener.local_addr().map_err(io("the metrics address"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("lanbus-metrics".into())
            .spawn(move || serve(&listener, &flag, &*collect))
            .map_err(io("starting the metrics thread"))?;
        Ok(MetricsServer { addr, stop, thread: Some(thread) })
    }

    /// The address served.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        // Relaxed: the flag only asks the loop to end; the join orders the rest.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves `GET /metrics` on `listener` with what `collect` gives at each request, until `stop`.
/// The listener is made non-blocking; a request is answered on this thread, with a bounded wait
/// for the client's request line.
pub fn serve(listener: &TcpListener, stop: &AtomicBool, collect: &dyn Fn() -> Vec<Sample>) {
    let _ = listener.set_nonblocking(true);
    // Relaxed: a flag polled every 50 ms; nothing else is published through it.
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
                let mut line = String::new();
                let _ = BufReader::new((&stream).take(8192)).read_line(&mut line);
                let (status, body) = answer(&line, collect);
                let reply = format!(
                    "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = (&stream).write_all(reply.as_bytes());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// The status line and body for one request line.
fn answer(request_line: &str, collect: &dyn Fn() -> Vec<Sample>) -> (&'static str, String) {
    let mut words = request_line.split_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some("GET"), Some(path), Some(v)) if v.starts_with("HTTP/") => {
            if path == "/metrics" || path.starts_with("/metrics?") {
                ("200 OK", render(&collect()))
            } else {
                ("404 Not Found", "only /metrics is served here\n".into())
            }
        }
        _ => ("400 Bad Request", "expected GET /metrics HTTP/1.x\n".into()),
    }
}

/// The fuzz target's body: any bytes as the request line a client sends get one of the three
/// answers, and only a `GET` of `/metrics` gets the metrics (here none: an empty body). Panics
/// only if that breaks.
#[cfg(any(test, fuzzing))]
pub fn fuzz_request_line(data: &[u8]) {
    let line = String::from_utf8_lossy(data);
    let (status, body) = answer(&line, &Vec::new);
    assert!(["200 OK", "404 Not Found", "400 Bad Request"].contains(&status));
    let words: Vec<&str> = line.split_whitespace().take(3).collect();
    let metrics = matches!(words.as_slice(),
        ["GET", p, v] if (*p == "/metrics" || p.starts_with("/metrics?")) && v.starts_with("HTTP/"));
    assert_eq!(status == "200 OK", metrics && body.is_empty(), "{line:?}");
    assert!(status == "200 OK" || !body.is_empty());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Sample> {
        let mut port = Sample::counter("frames_total", "Frames.", 7);
        port.labels.push(("port", "afxdp:eth\"1\"".into()));
        vec![port, Sample::counter("frames_total", "Frames.", 9), Sample::gauge("group", "The group.", 3.0)]
    }

    #[test]
    fn renders_the_exposition_format() {
        let text = render(&samples());
        assert_eq!(
            text,
            "# HELP lanbus_frames_total Frames.\n# TYPE lanbus_frames_total counter\n\
             lanbus_frames_total{port=\"afxdp:eth\\\"1\\\"\"} 7\nlanbus_frames_total 9\n\
             # HELP lanbus_group The group.\n# TYPE lanbus_group gauge\nlanbus_group 3\n"
        );
    }

    #[test]
    fn answers_get_metrics_and_refuses_the_rest() {
        let c = || samples();
        assert_eq!(answer("GET /metrics HTTP/1.1\r\n", &c).0, "200 OK");
        assert_eq!(answer("GET /metrics?x=1 HTTP/1.0\r\n", &c).0, "200 OK");
        assert_eq!(answer("GET / HTTP/1.1\r\n", &c).0, "404 Not Found");
        for bad in ["", "garbage", "POST /metrics HTTP/1.1", "GET /metrics", "\u{0}\u{1}"] {
            assert_eq!(answer(bad, &c).0, "400 Bad Request", "{bad:?}");
        }
    }

    #[test]
    fn fuzz_body_accepts_its_corpus_and_edge_cases() {
        for line in ["GET /metrics HTTP/1.1\r\n", "GET /metrics", "GET\t/metrics\tHTTP/1.0", "", "\u{0}"] {
            fuzz_request_line(line.as_bytes());
        }
    }

    proptest::proptest! {
        #[test]
        fn any_request_line_gets_an_answer(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            fuzz_request_line(&bytes);
        }

        #[test]
        fn request_lines_that_look_like_http(path in "[ -~]{0,40}", version in "HTTP/[0-9.]{0,4}|[A-Z]{0,5}") {
            fuzz_request_line(format!("GET {path} {version}\r\n").as_bytes());
        }
    }

    #[test]
    fn serves_over_tcp_until_stopped() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| serve(&listener, &stop, &samples));
            let mut conn = std::net::TcpStream::connect(addr).unwrap();
            conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut reply = String::new();
            conn.read_to_string(&mut reply).unwrap();
            assert!(reply.starts_with("HTTP/1.0 200 OK\r\n"), "{reply}");
            assert!(reply.ends_with("lanbus_group 3\n"), "{reply}");
            // A client that sends nothing and goes away does not stop the server.
            drop(std::net::TcpStream::connect(addr).unwrap());
            let mut conn = std::net::TcpStream::connect(addr).unwrap();
            conn.write_all(b"GET /nothing HTTP/1.1\r\n\r\n").unwrap();
            let mut reply = String::new();
            conn.read_to_string(&mut reply).unwrap();
            assert!(reply.starts_with("HTTP/1.0 404"), "{reply}");
            stop.store(true, Ordering::Relaxed);
        });
    }
}
