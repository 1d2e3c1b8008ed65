//! `lanbus`: the command-line front of the fabric: daemons, simulator, benchmarks and tools.
#![deny(unsafe_code)]

mod bench;
mod demo;
mod nbd;
mod pcie;
mod plot;
mod port;
mod progress;
mod signals;
mod sim_cmd;
mod tlp;

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
    /// Packet ports: check that a port spec opens here, and see its MAC, MTU and counters.
    #[command(subcommand)]
    Port(port::PortCommand),
    /// Network Block Device tools: export a file or RAM disk to fio, qemu-img, QEMU.
    #[command(subcommand)]
    Nbd(nbd::NbdCommand),
    /// A host bridge that lists the remote PCIe functions of its group like `lspci -v`.
    Lspci(pcie::LspciArgs),
    /// A device bridge hosting PCIe functions (the DMA engine) until SIGINT/SIGTERM.
    Device(pcie::DeviceArgs),
    /// Sends a command (`group N`, `status`) to a running `lanbus device --control PATH`.
    DeviceCtl(pcie::DeviceCtlArgs),
    /// The main job for now: two transport endpoints over a simulated wire with 1% loss; prints
    /// goodput, retransmissions and latency, and fails unless every message arrived intact.
    Demo(demo::DemoArgs),
    /// Simulator scenarios: the faulty-wire transfer and the retransmission paper's figures.
    #[command(subcommand)]
    Sim(sim_cmd::SimCommand),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(c) => bench::run(c),
        Command::Tlp(c) => tlp::run(c),
        Command::Port(c) => port::run(c),
        Command::Nbd(c) => nbd::run(c),
        Command::Lspci(a) => pcie::lspci(a),
        Command::Device(a) => pcie::device(a),
        Command::DeviceCtl(a) => pcie::device_ctl(a),
        Command::Demo(a) => demo::run(a),
        Command::Sim(c) => sim_cmd::run(c),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lanbus: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
