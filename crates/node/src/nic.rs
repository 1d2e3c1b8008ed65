//! The remote NIC: the virtio-net function of an I/O box and its spec on the command line.
//!
//! Layer: assembly, above `lanbus_vnet`. `lanbus device --nic SPEC` builds the function with
//! [`nic_function`]; `lanbus host --export tap:NAME` attaches the driver with
//! [`lanbus_vnet::pcie::attach`] and exports it with [`lanbus_vnet::pcie::TapExport`].

use std::sync::{Arc, Mutex};

use lanbus_bridge::HostedFunction;
use lanbus_vnet::{NetConfig, NetStats};
use lanbus_wire::MacAddr;

use crate::{Error, Result};

/// Where the NIC's wire is in the I/O box: `tap=NAME[,mac=MAC][,mtu=BYTES]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicSpec {
    /// The TAP interface (created if missing; bridge it to a real interface or route to it).
    pub tap: String,
    /// The function's MAC address (default: a locally administered address made from the name).
    pub mac: [u8; 6],
    /// The MTU the function reports (default 1500).
    pub mtu: u16,
}

/// A locally administered unicast MAC address derived from `name` (stable across restarts).
fn mac_from(name: &str) -> [u8; 6] {
    // FNV-1a over the name.
    let h =
        name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let b = h.to_le_bytes();
    [0x02, 0x4c, b[0], b[1], b[2], b[3]]
}

impl std::str::FromStr for NicSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<NicSpec> {
        let expected = || Error::BadSpec(format!("{s:?}: expected tap=NAME[,mac=MAC][,mtu=BYTES]"));
        let mut parts = s.split(',');
        let tap = match parts.next().and_then(|p| p.split_once('=')) {
            Some(("tap", name)) if !name.is_empty() && name.len() < 16 && !name.contains(['/', ' ']) => {
                name.to_string()
            }
            Some(("tap", name)) => {
                return Err(Error::BadSpec(format!("{name:?}: an interface name is 1 to 15 characters")))
            }
            _ => return Err(expected()),
        };
        let mut spec = NicSpec { mac: mac_from(&tap), tap, mtu: 1500 };
        for p in parts {
            match p.split_once('=') {
                Some(("mac", v)) => {
                    let m: MacAddr =
                        v.parse().map_err(|_| Error::BadSpec(format!("{v:?}: not a MAC address")))?;
                    if m.0[0] & 1 != 0 {
                        return Err(Error::BadSpec(format!("{v}: a multicast address cannot be a NIC's")));
                    }
                    spec.mac = m.0;
                }
                Some(("mtu", v)) => {
                    spec.mtu = v
                        .parse()
                        .ok()
                        .filter(|m| (68..=65_535 - 14).contains(m))
                        .ok_or_else(|| Error::BadSpec(format!("mtu={v}: 68 to 65521")))?;
                }
                _ => {
                    return Err(Error::BadSpec(format!(
                        "unknown option {p:?} in {s:?}: mac=MAC or mtu=BYTES"
                    )))
                }
            }
        }
        Ok(spec)
    }
}

/// The remote NIC's counters and last error, for the daemon's status.
pub struct NicInfo {
    /// The spec it was built from.
    pub spec: NicSpec,
    /// The device's counters.
    pub stats: Arc<NetStats>,
    /// The last error the device hit.
    pub last_error: Arc<Mutex<Option<String>>>,
}

/// The virtio-net function for a device bridge, with its wire on the spec's TAP.
pub fn nic_function(spec: &NicSpec) -> Result<(HostedFunction, NicInfo)> {
    let cfg = NetConfig { mac: spec.mac, mtu: spec.mtu, ..NetConfig::default() };
    let (f, stats, last_error) = lanbus_vnet::pcie::tap_function(&spec.tap, cfg)
        .map_err(|e| Error::BadSpec(format!("the NIC's TAP {}: {e}", spec.tap)))?;
    Ok((f, NicInfo { spec: spec.clone(), stats, last_error }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nic_specs_parse_and_bad_ones_say_why() {
        let s: NicSpec = "tap=nic0,mac=02:00:00:00:00:07,mtu=9000".parse().unwrap();
        assert_eq!((s.tap.as_str(), s.mac, s.mtu), ("nic0", [2, 0, 0, 0, 0, 7], 9000));
        let d: NicSpec = "tap=nic0".parse().unwrap();
        assert_eq!(d.mac, mac_from("nic0"));
        assert_eq!(d.mac[0] & 3, 2, "locally administered unicast");
        for bad in [
            "",
            "tap=",
            "iface=x",
            "tap=nic0,mtu=10",
            "tap=nic0,mac=01:00:00:00:00:01",
            "tap=nic0,x=1",
            "tap=a/b",
        ] {
            assert!(bad.parse::<NicSpec>().is_err(), "{bad:?}");
        }
    }
}
