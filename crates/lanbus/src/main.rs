//! `lanbus`: the command-line front of the fabric: daemons, simulator, benchmarks and tools.
#![deny(unsafe_code)]

mod bench;
mod port;
mod tlp;
mod nbd;
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
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lanbus: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
