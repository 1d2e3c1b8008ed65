//! The I/O box: a device bridge hosting an NVMe drive (file or RAM), a virtio-net NIC whose wire
//! is a TAP, and the DMA engine, for the host of its group.
//!
//! Layer: assembly, over `lanbus-bridge`, the NVMe and virtio-net models. `lanbus device` is
//! argument parsing over [`Device`]; `lanbus demo` and the benches start the same type.
//!
//! The functions are numbered in the order NVMe, NIC, DMA engine (each present one takes the next
//! function number). A group set at run time ([`Device::answer`] to `group N`) is kept in the
//! state file, so that a restart serves the same group while the configured group is unchanged.

use std::path::PathBuf;
use std::sync::Arc;

use lanbus_bridge::{DeviceBridge, HostedFunction};
use lanbus_nvme::pcie::FunctionStats;
use lanbus_pcie::dma_engine::DmaEngine;
use lanbus_port::Port;
use lanbus_runtime::ThreadMode;
use serde_json::{json, Value};

use crate::config::{self, DeviceState};
use crate::drive::{self, NvmeBacking};
use crate::metrics::{self, Sample};
use crate::nic::{NicInfo, NicSpec};
use crate::{Error, Result};

/// What an I/O box hosts, and how it runs.
#[derive(Debug, Clone)]
pub struct DeviceOptions {
    /// The group whose host this I/O box serves (unless a group set at run time is kept in
    /// `state`).
    pub group: u16,
    /// The name announced in heartbeats.
    pub name: String,
    /// The NVMe drive's blocks.
    pub nvme: Option<NvmeBacking>,
    /// Logical block size of the namespace: 512 or 4096.
    pub lba_size: u32,
    /// A virtio-net NIC whose wire is a TAP interface of this machine.
    pub nic: Option<NicSpec>,
    /// Also host the DMA engine model.
    pub dma_engine: bool,
    /// Thread model of the transport.
    pub threads: ThreadMode,
    /// Where a group set at run time is kept (none: not kept across a restart).
    pub state: Option<PathBuf>,
    /// The authentication layer's report, where the port is keyed (shown in status).
    pub security: Option<lanbus_secure::SecurityView>,
    /// Duplicate ACKs that count a frame lost (the transport's default if unset; the
    /// retransmission paper's rule is 1).
    pub dup_acks: Option<u32>,
}

impl DeviceOptions {
    /// An I/O box of `group` with nothing hosted yet, run to completion.
    pub fn new(group: u16, name: &str) -> DeviceOptions {
        DeviceOptions {
            group,
            name: name.into(),
            nvme: None,
            lba_size: 512,
            nic: None,
            dma_engine: false,
            threads: ThreadMode::RunToCompletion,
            state: None,
            security: None,
            dup_acks: None,
        }
    }
}

/// A running I/O box.
pub struct Device {
    bridge: DeviceBridge,
    options: DeviceOptions,
    nvme: Option<(u64, Arc<FunctionStats>)>,
    nic: Option<NicInfo>,
    /// The group came from the state file, not from the options.
    resumed: bool,
}

impl Device {
    /// Builds the functions and starts the device bridge on `port`.
    pub fn start(port: Box<dyn Port>, options: DeviceOptions) -> Result<Device> {
        if options.nvme.is_none() && options.nic.is_none() && !options.dma_engine {
            return Err(Error::BadSpec(
                "no device to host: give --nvme file=PATH[,size=SIZE]|ram=SIZE, --nic tap=NAME and/or \
                 --dma-engine"
                    .into(),
            ));
        }
        if options.lba_size != 512 && options.lba_size != 4096 {
            return Err(Error::BadSpec(format!("--lba-size {}: 512 or 4096", options.lba_size)));
        }
        let group = match &options.state {
            Some(path) => {
                let state = DeviceState::resume(path, options.group)?;
                state.store(path)?;
                state.current_group
            }
            None => options.group,
        };
        let mut functions = Vec::new();
        let mut nvme = None;
        if let Some(b) = &options.nvme {
            let ctrl = drive::controller(b, options.lba_size)?;
            let blocks = ctrl.namespace_blocks();
            let (f, stats) = drive::nvme_function(ctrl)?;
            functions.push(f);
            nvme = Some((blocks, stats));
        }
        let mut nic = None;
        if let Some(spec) = &options.nic {
            let (f, info) = crate::nic::nic_function(spec)?;
            functions.push(f);
            nic = Some(info);
        }
        if options.dma_engine {
            functions.push(HostedFunction::model(DmaEngine::new()).map_err(|e| Error::Nvme(e.to_string()))?);
        }
        let mut config = config::device_config(group, &options.name, options.threads);
        if let Some(n) = options.dup_acks {
            config.runtime.transport.dup_ack_threshold = n;
        }
        let bridge = DeviceBridge::start(port, config, functions)?;
        Ok(Device { bridge, resumed: group != options.group, options, nvme, nic })
    }

    /// The device bridge.
    pub fn bridge(&self) -> &DeviceBridge {
        &self.bridge
    }

    /// The group served now.
    pub fn group(&self) -> u16 {
        self.bridge.group()
    }

    /// Whether the group served was set at run time before a restart (kept in the state file)
    /// rather than given in the options.
    pub fn resumed_group(&self) -> bool {
        self.resumed
    }

    /// One line saying what is hosted: the drive, the NIC, the DMA engine.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let (Some(n), Some((blocks, _))) = (&self.options.nvme, &self.nvme) {
            parts.push(format!("NVMe {n}, {blocks} x {} bytes", self.options.lba_size));
        }
        if let Some(n) = &self.nic {
            let m = lanbus_wire::MacAddr(n.spec.mac);
            parts.push(format!("virtio-net {m} on TAP {} (MTU {})", n.spec.tap, n.spec.mtu));
        }
        if self.options.dma_engine {
            parts.push("the DMA engine".into());
        }
        parts.join(" + ")
    }

    /// Every counter, as the metrics endpoint serves them.
    pub fn samples(&self) -> Vec<Sample> {
        let mut out = Vec::new();
        metrics::runtime_samples(&self.bridge.runtime_stats(), &mut out);
        metrics::path_samples(&self.bridge.paths(), &mut out);
        metrics::device_bridge_samples(&self.bridge, &mut out);
        if let Some((_, st)) = &self.nvme {
            metrics::nvme_samples(st, &mut out);
        }
        if let Some(n) = &self.nic {
            metrics::nic_device_samples(&n.stats, &mut out);
        }
        out
    }

    /// The state `lanbus status` shows: role, peers, functions, the controller's counters and
    /// every metric.
    pub fn status(&self) -> Value {
        let mut devices = Vec::new();
        if let (Some(n), Some((blocks, _))) = (&self.options.nvme, &self.nvme) {
            devices
                .push(json!({"function": "00.0", "kind": "NVMe", "backing": n.to_string(), "blocks": blocks,
                "lba_size": self.options.lba_size}));
        }
        if let Some(n) = &self.nic {
            devices.push(json!({
                "function": format!("00.{}", devices.len()),
                "kind": "virtio-net",
                "tap": n.spec.tap,
                "mac": lanbus_wire::MacAddr(n.spec.mac).to_string(),
                "mtu": n.spec.mtu,
                "last_error": n.last_error.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            }));
        }
        if self.options.dma_engine {
            devices.push(json!({"function": format!("00.{}", devices.len()), "kind": "DMA engine"}));
        }
        let b = &self.bridge;
        json!({
            "role": "device",
            "name": self.options.name,
            "mac": b.local_mac().to_string(),
            "group": b.group(),
            "vlan": b.vlan(),
            "peers": b.host().map(|h| vec![json!({"mac": h.to_string(), "role": "host"})]).unwrap_or_default(),
            "devices": devices,
            "controller": self.nvme.as_ref().map(|(_, st)| controller_json(st)),
            "completion_timeouts": b.stats().dma_read_failures,
            "bridge": format!("{:?}", b.stats()),
            "paths": metrics::paths_json(&b.paths()),
            "security": crate::security::status_json(self.options.security.as_ref()),
            "metrics": metrics::json(&self.samples()),
        })
    }

    /// Answers one control line: `status` (one line of counters), `status json`, or `group N`
    /// (moves the bridge to group N and keeps it in the state file).
    pub fn answer(&self, line: &str) -> String {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["status"] => {
                let b = &self.bridge;
                let (s, rt) = (b.stats(), b.runtime_stats());
                format!(
                    "mac {} group {} host {} tlps {} dma_reads {} dma_writes {} foreign {} ur {} frames_rx {} \
                     frames_tx {} retransmitted {}",
                    b.local_mac(),
                    b.group(),
                    b.host().map_or("none".to_string(), |m| m.to_string()),
                    s.tlps_received,
                    s.dma_reads,
                    s.dma_writes,
                    s.foreign_requests,
                    s.ur_sent,
                    rt.port.rx_frames,
                    rt.port.tx_frames,
                    rt.transport.retransmitted_frames,
                )
            }
            ["status", "json"] => self.status().to_string(),
            ["group", n] => match n.parse::<u16>() {
                Ok(g) => self.set_group(g),
                Err(_) => format!("error: bad group {n:?} (0..=65535)"),
            },
            _ => format!("error: unknown command {line:?} (want `group N`, `status` or `status json`)"),
        }
    }

    fn set_group(&self, g: u16) -> String {
        if let Err(why) = self.bridge.set_group(g) {
            return format!("error: {why}");
        }
        tracing::info!(group = g, "the I/O box moved to another group");
        let Some(path) = &self.options.state else { return format!("ok group {g}") };
        let kept = DeviceState { configured_group: self.options.group, current_group: g };
        match kept.store(path) {
            Ok(()) => format!("ok group {g}"),
            Err(e) => format!("ok group {g} (not kept across a restart: {e})"),
        }
    }

    /// Stops the bridge and, for a file-backed drive, flushes the file to stable storage.
    pub fn shutdown(self) -> Result<()> {
        self.bridge.shutdown();
        if let Some(NvmeBacking::File { path, .. }) = &self.options.nvme {
            // The controller wrote through its own handle; any handle's fsync flushes the file.
            let sync = std::fs::File::open(path).and_then(|f| f.sync_all());
            sync.map_err(|e| Error::Io { what: format!("syncing {}", path.display()), source: e })?;
        }
        Ok(())
    }
}

fn controller_json(stats: &FunctionStats) -> Value {
    let (c, refused) = stats.get();
    json!({
        "io_commands": c.io_commands,
        "admin_commands": c.admin_commands,
        "error_completions": c.error_completions,
        "bytes_read": c.bytes_read,
        "bytes_written": c.bytes_written,
        "writes_in_place": c.writes_in_place,
        "dma_errors": c.dma_errors,
        "interrupts": c.interrupts,
        "invalid_doorbells": c.invalid_doorbells,
        "refused_bar_accesses": refused,
    })
}

impl crate::control::Daemon for Device {
    fn answer(&self, line: &str) -> String {
        Device::answer(self, line)
    }
    fn samples(&self) -> Vec<Sample> {
        Device::samples(self)
    }
}
