//! `lanbus keygen` and the `--key FILE` / `--encrypt` options every fabric daemon takes.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use lanbus_node::security::{Keyed, OPEN_FABRIC};
use lanbus_port::Port;
use lanbus_secure::{FabricKey, KeyId, KeyRing};

/// Options of `lanbus keygen`.
#[derive(Debug, clap::Args)]
pub struct KeygenArgs {
    /// The key file. Without other options: a new file (mode 0600) with one new 256-bit key.
    file: PathBuf,
    /// Rotation step 1: append a new key to the file, accepted but not yet sent under.
    #[arg(long, conflicts_with_all = ["send", "drop"])]
    add: bool,
    /// Rotation step 2: send under key ID (8 hex digits) from now on; the others stay accepted.
    #[arg(long, value_name = "ID", conflicts_with = "drop")]
    send: Option<KeyId>,
    /// Rotation step 3: remove key ID from the file (not the one sent under).
    #[arg(long, value_name = "ID")]
    drop: Option<KeyId>,
}

/// Runs `lanbus keygen`: prints key ids, never secrets.
pub fn keygen(args: KeygenArgs) -> anyhow::Result<()> {
    let path = &args.file;
    if !args.add && args.send.is_none() && args.drop.is_none() {
        let key = FabricKey::generate();
        let id = key.id();
        KeyRing::new(key, []).write(path, false)?;
        println!(
            "{}: new fabric key {id}; give every member of the fabric --key {}",
            path.display(),
            path.display()
        );
        return Ok(());
    }
    let mut ring = KeyRing::read(path)?;
    if args.add {
        let key = FabricKey::generate();
        println!(
            "{}: added key {} (accepted; send under it with --send {} once every member holds it)",
            path.display(),
            key.id(),
            key.id()
        );
        ring.add(key);
    }
    if let Some(id) = args.send {
        anyhow::ensure!(ring.promote(id), "{}: no key {id} (keys: {})", path.display(), ids(&ring));
        println!("{}: sending under key {id}", path.display());
    }
    if let Some(id) = args.drop {
        anyhow::ensure!(
            ring.remove(id),
            "{}: key {id} is not in the file or is the one sent under (keys: {})",
            path.display(),
            ids(&ring)
        );
        println!("{}: dropped key {id}", path.display());
    }
    ring.write(path, true)?;
    println!("keys now: {}; send SIGHUP to each daemon that uses the file (or restart it)", ids(&ring));
    Ok(())
}

fn ids(ring: &KeyRing) -> String {
    ring.ids().iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// The options a fabric daemon takes for its key.
#[derive(Debug, Clone, clap::Args)]
pub struct KeyArgs {
    /// The fabric key file (`lanbus keygen FILE`; mode 0600): peers must prove they hold it and
    /// every frame is authenticated. Read again on SIGHUP (key rotation).
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// With --key: encrypt payloads too (AES-256-GCM, or ChaCha20-Poly1305 without AES instructions).
    #[arg(long)]
    pub encrypt: bool,
}

/// The daemon's keys from its arguments or its file (the command line wins): `None`, said once,
/// for an open fabric. A key re-read on SIGHUP from then on.
pub fn keyed(
    args: &KeyArgs,
    file_key: Option<PathBuf>,
    file_encrypt: Option<bool>,
    who: &str,
) -> anyhow::Result<Option<Arc<Keyed>>> {
    let encrypt = args.encrypt || file_encrypt.unwrap_or(false);
    let Some(path) = args.key.clone().or(file_key) else {
        anyhow::ensure!(!encrypt, "--encrypt needs --key FILE");
        eprintln!("{who}: {OPEN_FABRIC}");
        return Ok(None);
    };
    let keyed = Arc::new(Keyed::open(&path, encrypt)?);
    let reloader = keyed.clone();
    let name = who.to_string();
    let mut signals =
        signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP]).context("handling SIGHUP")?;
    std::thread::Builder::new()
        .name("key-reload".into())
        .spawn(move || {
            for _ in signals.forever() {
                match reloader.reload() {
                    Ok(now) => eprintln!("{name}: keys read again: {now}"),
                    Err(e) => eprintln!("{name}: keys kept as they were: {e}"),
                }
            }
        })
        .context("starting the key reload thread")?;
    eprintln!("{who}: {}", keyed.describe());
    Ok(Some(keyed))
}

/// `port` behind the keyed layer where there is a key.
pub fn wrap(keyed: Option<&Arc<Keyed>>, port: Box<dyn Port>) -> Box<dyn Port> {
    match keyed {
        Some(k) => k.wrap(port),
        None => port,
    }
}

/// The port specs of a daemon: those given with `--port` (each one a path), else the file's.
pub fn port_specs(
    given: Vec<lanbus_port::PortSpec>,
    file: Option<lanbus_node::config::Ports>,
) -> anyhow::Result<Vec<lanbus_port::PortSpec>> {
    let specs = if given.is_empty() { file.map(|p| p.into_vec()).unwrap_or_default() } else { given };
    anyhow::ensure!(
        !specs.is_empty(),
        "give --port SPEC (once per link for several paths), or port = \"...\" in --config"
    );
    Ok(specs)
}

/// The ports of `specs`, each keyed where the fabric is, joined into one node with several
/// paths when there are several.
pub fn open_ports(
    keyed: Option<&Arc<Keyed>>,
    specs: &[lanbus_port::PortSpec],
) -> anyhow::Result<Box<dyn Port>> {
    let mut ports = Vec::with_capacity(specs.len());
    for spec in specs {
        ports.push(wrap(keyed, spec.open()?));
    }
    if ports.len() == 1 {
        return Ok(ports.remove(0));
    }
    let multi = lanbus_port::MultiPort::new(ports, lanbus_port::MultiConfig::default())
        .context("joining the ports as paths of one node")?;
    Ok(Box::new(multi))
}

/// With several paths a node's frames may arrive out of order by a run of frames: unless the
/// duplicate-ACK threshold was set, it is raised past one run so that reordering is not taken
/// for loss.
pub fn multipath_dup_acks(set: Option<u32>, specs: &[lanbus_port::PortSpec]) -> Option<u32> {
    match set {
        None if specs.len() > 1 => Some(lanbus_port::multi::RUN_FRAMES),
        other => other,
    }
}

/// The specs for a log line: `afpacket:a` or `afpacket:a + afpacket:b`.
pub fn describe_ports(specs: &[lanbus_port::PortSpec]) -> String {
    specs.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" + ")
}
