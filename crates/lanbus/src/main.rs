//! `lanbus`: the command-line front of the fabric: daemons, simulator, benchmarks and tools.
#![deny(unsafe_code)]

mod bench;
mod port;
mod tlp;
mod nbd;
mod daemon;
mod demo;
mod fabric;
mod plot;
mod progress;
mod sim_cmd;

use clap::{Parser, Subcommand};

/// lanbus: share PCIe devices, messages and sockets between machines over ordinary Ethernet.
#[derive(Debug, Parser)]
#[command(name = "lanbus", version, about, long_about = None, after_help = lanbus_port::SPEC_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measurements, each with its peer (kernel sockets, rte_ring, qemu-nbd...) in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// The PCIe TLP codec: decode hex to JSON, encode JSON to hex.
    #[command(subcommand)]
    Tlp(tlp::TlpCommand),
    /// Network Block Device tools: export a file or RAM disk to fio, qemu-img, QEMU.
    #[command(subcommand)]
    Nbd(nbd::NbdCommand),
    /// The main job: a remote NVMe drive over the simulated wire, exported over NBD, written,
    /// read back and verified (and fio if installed); no root, no NIC. Exits 0 only if all data
    /// verified.
    Demo(demo::DemoArgs),
    /// Simulator scenarios: the faulty-wire transfer and the retransmission paper's figures.
    #[command(subcommand)]
    Sim(sim_cmd::SimCommand),
    /// The I/O box daemon: a device bridge hosting an NVMe drive (file or RAM) for the host of
    /// its group.
    Device(daemon::DeviceArgs),
    /// The host daemon: enumerates its group's NVMe drive through the fabric, runs the NVMe
    /// driver and exports the namespace over NBD.
    Host(daemon::HostArgs),
    /// Asks a running `lanbus host` or `lanbus device` for peers, devices, queues and counters.
    Status(daemon::StatusArgs),
    /// Packet ports: check that a port spec opens here, and see its MAC, MTU and counters.
    #[command(subcommand)]
    Port(port::PortCommand),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(c) => bench::run(c),
        Command::Tlp(c) => tlp::run(c),
        Command::Nbd(c) => nbd::run(c),
        Command::Demo(a) => demo::run(a),
        Command::Sim(c) => sim_cmd::run(c),
        Command::Port(c) => port::run(c),
        Command::Device(a) => daemon::device(a),
        Command::Host(a) => daemon::host(a),
        Command::Status(a) => daemon::status(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lanbus: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
