//! The TCP/IP stack server on its port, with its control socket: what `lanbus stackd` runs.
//!
//! Layer: assembly, over `lanbus-stack`. Programs attach at the server's Unix socket (through
//! the client library or `liblanbus_sock.so`); the control socket answers `status` with the
//! server's clients, connections and counters as one JSON object.

use std::path::Path;
use std::sync::Arc;

use lanbus_port::afpacket::AfPacketConfig;
use lanbus_port::{PortKind, PortSpec};
use lanbus_stack::server::{Server, ServerConfig, ServerStatus};
use serde_json::{json, Value};

use crate::control::ControlServer;
use crate::{Error, Result};

/// A running stack server and its control socket.
pub struct StackDaemon {
    server: Arc<Server>,
    control: ControlServer,
    mac: lanbus_wire::MacAddr,
    mtu: usize,
}

/// The port spec a stack server opens: an afpacket port that receives every EtherType (the
/// stack speaks ARP, IPv4 and IPv6, not only lanbus frames).
pub fn port_spec(spec: &PortSpec) -> Result<PortSpec> {
    match &spec.kind {
        PortKind::AfPacket(config) => {
            let config = AfPacketConfig { all_ethertypes: true, ..config.clone() };
            Ok(PortSpec { kind: PortKind::AfPacket(config), ..spec.clone() })
        }
        PortKind::AfXdp { .. } => Err(Error::BadSpec(format!(
            "{spec}: the afxdp port's XDP program passes only lanbus frames to the socket; use afpacket:IFACE"
        ))),
        PortKind::Udp(_) | PortKind::Shm { .. } | PortKind::Sim => {
            Err(Error::BadSpec(format!("{spec}: a TCP/IP stack needs raw Ethernet; use afpacket:IFACE")))
        }
        _ => Err(Error::BadSpec(format!("{spec}: use afpacket:IFACE"))),
    }
}

impl StackDaemon {
    /// Opens the port of `spec` (see [`port_spec`]), starts the server with `config` and serves
    /// its status at `control`.
    pub fn start(spec: &PortSpec, config: ServerConfig, control: &Path) -> Result<StackDaemon> {
        let port = port_spec(spec)?.open()?;
        let (mac, mtu) = (port.mac(), port.mtu());
        let at = config.socket.display().to_string();
        let server =
            Arc::new(Server::start(port, config).map_err(|e| Error::Stack(format!("at {at}: {e}")))?);
        let s = server.clone();
        let control = ControlServer::start(
            control,
            Arc::new(move |line: &str| match line {
                "status" | "status json" => status_json(&s.status()).to_string(),
                other => json!({ "error": format!("unknown command {other:?}; ask `status`") }).to_string(),
            }),
        )?;
        Ok(StackDaemon { server, control, mac, mtu })
    }

    /// The server.
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// The port's MAC address.
    pub fn mac(&self) -> lanbus_wire::MacAddr {
        self.mac
    }

    /// The port's MTU.
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// Stops the control socket, then the server (programs still attached see their connections
    /// end).
    pub fn stop(self) {
        self.control.stop();
        drop(self.server);
    }
}

/// A server's status as `lanbus status` shows it.
pub fn status_json(s: &ServerStatus) -> Value {
    let c = &s.counters;
    json!({
        "clients": s.clients,
        "listening": s.listening,
        "connections": s.connections.iter().map(|c| json!({
            "local": c.local.map(|a| a.to_string()),
            "remote": c.remote.map(|a| a.to_string()),
            "state": c.state,
            "pid": c.pid,
        })).collect::<Vec<_>>(),
        "counters": {
            "clients_attached": c.clients_attached,
            "clients_broken": c.clients_broken,
            "clients_refused": c.clients_refused,
            "connections_opened": c.connections_opened,
            "connections_freed": c.connections_freed,
            "rx_frames": c.rx_frames,
            "tx_frames": c.tx_frames,
            "tx_offloaded": c.tx_offloaded,
            "rx_dropped": c.rx_dropped,
            "tx_dropped": c.tx_dropped,
            "bytes_from_clients": c.tx_bytes,
            "bytes_to_clients": c.rx_bytes,
            "zero_copy_bytes": c.zero_copy_bytes,
            "zero_copy_moved_bytes": c.zero_copy_moved_bytes,
        },
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn stack_ports_are_afpacket_with_every_ethertype() {
        let stack = |s: &str| super::port_spec(&s.parse().unwrap()).map(|s| s.to_string());
        assert_eq!(stack("afpacket:veth0").unwrap(), "afpacket:veth0,ethertypes=all");
        assert_eq!(stack("afpacket:v,ethertypes=all").unwrap(), "afpacket:v,ethertypes=all");
        for bad in ["afxdp:veth0", "udp:127.0.0.1:1", "sim", "dpdk"] {
            assert!(stack(bad).is_err(), "{bad}");
        }
    }
}
