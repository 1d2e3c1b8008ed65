//! `lanbus nbd ...`: serve a file or a RAM disk over NBD, for manual checks and the daemons.
//!
//! `lanbus nbd serve --ram 1G --socket /tmp/nbd.sock` exports until SIGINT or SIGTERM, then stops
//! accepting, finishes the requests in flight, flushes the device and prints the counters.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use lanbus_block::{BlockDevice, FileDevice, MemDevice};
use lanbus_nbd::{Export, Server};

/// NBD tools.
#[derive(Debug, Subcommand)]
pub enum NbdCommand {
    /// Export a file or a RAM disk over NBD until SIGINT/SIGTERM (then flush and exit).
    Serve(ServeArgs),
}

/// `lanbus nbd serve` options.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Back the export with this existing file (or block device).
    #[arg(long, conflicts_with = "ram", required_unless_present = "ram")]
    file: Option<PathBuf>,
    /// Back the export with a RAM disk of this size (bytes, or with a K/M/G/T suffix).
    #[arg(long)]
    ram: Option<String>,
    /// Listen on this Unix socket path (a stale socket file there is replaced).
    #[arg(long, required_unless_present = "tcp")]
    socket: Option<PathBuf>,
    /// Listen on this TCP address (NBD has no authentication: keep it on loopback).
    #[arg(long)]
    tcp: Option<SocketAddr>,
    /// Export name (also reachable as the default export).
    #[arg(long, default_value = "export")]
    name: String,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// Minimum block size in bytes (a power of two).
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// Worker threads per connection.
    #[arg(long, default_value_t = 4)]
    workers: usize,
}

/// Runs one `lanbus nbd` command.
pub fn run(command: NbdCommand) -> anyhow::Result<()> {
    match command {
        NbdCommand::Serve(args) => serve(args),
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let device: Arc<dyn BlockDevice> = match (&args.file, &args.ram) {
        (Some(path), None) => {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(!args.read_only)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?;
            let size = file.metadata()?.len();
            Arc::new(FileDevice::from_file(file, size, args.block_size, args.read_only)?)
        }
        (None, Some(size)) => {
            let dev = MemDevice::with_block_size(lanbus_node::parse_size(size)?, args.block_size)?;
            Arc::new(if args.read_only { dev.into_read_only() } else { dev })
        }
        _ => bail!("give exactly one of --file PATH or --ram SIZE"),
    };
    if device.size_bytes() == 0 {
        bail!("the export would be empty (size below one {}-byte block)", args.block_size);
    }
    // Registered before any thread starts, so every thread inherits the blocked-by-handler state.
    let mut signals =
        signal_hook::iterator::Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM])
            .context("installing SIGINT/SIGTERM handlers")?;
    let size = device.size_bytes();
    let server = Server::builder()
        .export(
            Export::new(args.name.clone(), device).read_only(args.read_only).description("lanbus nbd serve"),
        )
        .workers_per_connection(args.workers)
        .build()?;
    // Bind every listener before serving any, so that once one answers all do.
    let mut listeners: Vec<(lanbus_nbd::Listener, String)> = Vec::new();
    if let Some(path) = &args.socket {
        if path.exists() {
            use std::os::unix::fs::FileTypeExt;
            if std::fs::symlink_metadata(path)?.file_type().is_socket() {
                std::fs::remove_file(path)?;
            } else {
                bail!("{} exists and is not a socket", path.display());
            }
        }
        let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
        listeners.push((l.into(), format!("nbd+unix:///{}?socket={}", args.name, path.display())));
    }
    if let Some(addr) = args.tcp {
        let l = TcpListener::bind(addr).with_context(|| format!("binding {addr}"))?;
        let local = l.local_addr()?;
        listeners.push((l.into(), format!("nbd://{local}/{}", args.name)));
    }
    for (l, uri) in listeners {
        server.serve(l)?;
        eprintln!("lanbus nbd: serving {:?} ({size} bytes) on {uri}", args.name);
    }
    let signal = signals.forever().next();
    eprintln!("lanbus nbd: signal {signal:?}: finishing requests in flight and flushing");
    let stats = server.shutdown()?;
    if let Some(path) = &args.socket {
        let _ = std::fs::remove_file(path);
    }
    eprintln!("lanbus nbd: stopped: {stats:?}");
    Ok(())
}
