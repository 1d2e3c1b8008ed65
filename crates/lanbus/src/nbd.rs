//! `lanbus nbd ...`: serve a file or a RAM disk over NBD, for manual checks and the daemons.
//!
//! `lanbus nbd serve --ram 1G --socket /tmp/nbd.sock` exports until SIGINT or SIGTERM, then stops
//! accepting, finishes the requests in flight, flushes the device and prints the counters.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use lanbus_node::nbd::{Backing, LocalExport, LocalOptions};

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
    let backing = match (&args.file, &args.ram) {
        (Some(path), None) => Backing::File(path.clone()),
        (None, Some(size)) => Backing::Ram(lanbus_node::parse_size(size)?),
        _ => bail!("give exactly one of --file PATH or --ram SIZE"),
    };
    // Registered before any thread starts, so every thread inherits the blocked-by-handler state.
    let mut signals =
        signal_hook::iterator::Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM])
            .context("installing SIGINT/SIGTERM handlers")?;
    let export = LocalExport::start(LocalOptions {
        backing,
        name: args.name.clone(),
        read_only: args.read_only,
        block_size: args.block_size,
        workers: args.workers,
        socket: args.socket,
        tcp: args.tcp,
    })?;
    for uri in export.uris() {
        eprintln!("lanbus nbd: serving {:?} ({} bytes) on {uri}", args.name, export.size_bytes());
    }
    let signal = signals.forever().next();
    eprintln!("lanbus nbd: signal {signal:?}: finishing requests in flight and flushing");
    let stats = export.stop()?;
    eprintln!("lanbus nbd: stopped: {stats:?}");
    Ok(())
}
