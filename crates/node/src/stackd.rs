//! The TCP/IP stack server on its port, with its control socket: what `lanbus stackd` runs.
//!
//! Layer: assembly, over `lanbus-stack`. Programs attach at the server's Unix socket (through
//! the client library or `liblanbus_sock.so`); the control socket answers `status` with the
//! server's clients, connections and counters as one JSON object.

use std::net::{Ipv4Addr, Ipv6Addr};
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

/// Parses a stack's IPv4 address with its prefix length, `A.B.C.D/LEN`, refusing addresses no
/// host may have.
pub fn host_address_v4(s: &str) -> Result<(Ipv4Addr, u8)> {
    let (ip, len) = split_cidr(s, "10.0.0.1/24")?;
    let ip: Ipv4Addr = ip.parse().map_err(|_| Error::BadSpec(format!("{ip:?} is not an IPv4 address")))?;
    let len = prefix(len, 32)?;
    if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
        return Err(Error::BadSpec(format!("{ip} cannot be a host's address")));
    }
    Ok((ip, len))
}

/// Parses a stack's IPv6 address with its prefix length, `IPV6/LEN`, refusing addresses no host
/// may have.
pub fn host_address_v6(s: &str) -> Result<(Ipv6Addr, u8)> {
    let (ip, len) = split_cidr(s, "fd00::1/64")?;
    let ip: Ipv6Addr = ip.parse().map_err(|_| Error::BadSpec(format!("{ip:?} is not an IPv6 address")))?;
    let len = prefix(len, 128)?;
    if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() || ip.to_ipv4_mapped().is_some() {
        return Err(Error::BadSpec(format!("{ip} cannot be a host's address")));
    }
    Ok((ip, len))
}

fn split_cidr<'a>(s: &'a str, example: &str) -> Result<(&'a str, &'a str)> {
    s.split_once('/').ok_or_else(|| Error::BadSpec(format!("{s:?}: write ADDRESS/PREFIX, e.g. {example}")))
}

fn prefix(len: &str, max: u8) -> Result<u8> {
    len.parse()
        .ok()
        .filter(|l| (1..=max).contains(l))
        .ok_or_else(|| Error::BadSpec(format!("/{len}: a prefix is 1 to {max}")))
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
            "syns_dropped": c.syns_dropped,
            "bytes_from_clients": c.tx_bytes,
            "bytes_to_clients": c.rx_bytes,
            "zero_copy_bytes": c.zero_copy_bytes,
            "zero_copy_moved_bytes": c.zero_copy_moved_bytes,
            "forks": c.forks,
            "forks_adopted": c.forks_adopted,
            "forks_refused": c.forks_refused,
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

    #[test]
    fn host_addresses() {
        use super::{host_address_v4 as v4, host_address_v6 as v6};
        assert_eq!(v4("10.0.0.1/24").unwrap(), (std::net::Ipv4Addr::new(10, 0, 0, 1), 24));
        assert_eq!(v6("fd00::1/64").unwrap(), ("fd00::1".parse().unwrap(), 64));
        for bad in ["10.0.0.1", "10.0.0.1/33", "0.0.0.0/8", "224.0.0.1/4", "x/24", "10.0.0.1/"] {
            assert!(v4(bad).is_err(), "{bad}");
        }
        for bad in ["fd00::1/129", "::1/128", "10.0.0.1/24", "::ffff:10.0.0.1/96", "fd00::1"] {
            assert!(v6(bad).is_err(), "{bad}");
        }
    }
}
