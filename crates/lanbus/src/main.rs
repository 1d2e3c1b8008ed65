//! `lanbus`: the command-line front of the fabric: daemons, simulator, benchmarks and tools.
#![deny(unsafe_code)]

mod daemon;
mod demo;
mod keys;
mod msgd;
mod nbd;
mod pcie;
mod port;
mod sim_cmd;
mod stack;
mod stackd;
mod status;
mod tlp;

use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's malloc: the fabric's threads allocate TLPs and frames on one
/// thread and free them on another, which glibc serves by growing and trimming per-thread arenas
/// (page faults and an arena lock on every large transfer).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// lanbus: share PCIe devices, messages and sockets between machines over ordinary Ethernet.
#[derive(Debug, Parser)]
#[command(name = "lanbus", version, about, long_about = None, after_help = lanbus_port::SPEC_HELP)]
struct Cli {
    /// More log lines on stderr: -v for the libraries' informational events, -vv for debugging
    /// (RUST_LOG, e.g. `RUST_LOG=lanbus_bridge=debug`, selects them finer and wins over -v).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// How log lines look: `text` (coloured only when stderr is a terminal) or `json` (one
    /// object per line, for log collectors).
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// The shape of log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines, coloured only on a terminal.
    Text,
    /// One JSON object per line.
    Json,
}

/// Sends the libraries' `tracing` events to stderr: warnings by default, more with `-v`/`-vv`,
/// or exactly what `RUST_LOG` says. Colour escapes only when stderr is a terminal, so that a log
/// written to a file or the journal is plain text.
fn install_logging(verbose: u8, format: LogFormat) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measurements, each with its peer (kernel sockets, rte_ring, qemu-nbd...) in the same run.
    #[command(subcommand)]
    Bench(lanbus_bench::BenchCommand),
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
    /// A host bridge that lists the remote PCIe functions of its group like `lspci -v`.
    Lspci(pcie::LspciArgs),
    /// The I/O box daemon: a device bridge hosting an NVMe drive (file or RAM) and/or the DMA
    /// engine for the host of its group, until SIGINT/SIGTERM.
    Device(daemon::DeviceArgs),
    /// Sends a command (`group N`, `status`) to a running `lanbus device --control PATH`.
    DeviceCtl(pcie::DeviceCtlArgs),
    /// The host daemon: enumerates its group's NVMe drive and NIC through the fabric, runs their
    /// drivers and exports the namespace over NBD or to VMs as a vhost-user-blk backend, and the
    /// NIC as a TAP or to a VM as a vhost-user-net backend.
    Host(daemon::HostArgs),
    /// Asks a running `lanbus host` or `lanbus device` for peers, devices, queues and counters.
    Status(status::StatusArgs),
    /// The messaging daemon: owns the port; the node's processes attach to it over a Unix
    /// socket and shared memory to send and receive MPI-style messages, until SIGINT/SIGTERM.
    Msgd(msgd::MsgdArgs),
    /// The TCP/IP stack server: a user-level TCP/IP stack on a port; programs attach to it over
    /// a Unix socket and shared memory, until SIGINT/SIGTERM.
    Stackd(stackd::StackdArgs),
    /// Programs that use a running `lanbus stackd`: send and receive over TCP like `nc`.
    #[command(subcommand)]
    Stack(stack::StackCommand),
    /// Makes a fabric key file for `--key` (mode 0600), or rotates the keys in one: --add a new
    /// key, --send under it once every member holds it, --drop the old one; after each step send
    /// SIGHUP to the daemons that use the file.
    Keygen(keys::KeygenArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    install_logging(cli.verbose, cli.log_format);
    let result = match cli.command {
        Command::Bench(c) => lanbus_bench::run(c),
        Command::Tlp(c) => tlp::run(c),
        Command::Port(c) => port::run(c),
        Command::Nbd(c) => nbd::run(c),
        Command::Lspci(a) => pcie::lspci(a),
        Command::Demo(a) => demo::run(a),
        Command::Sim(c) => sim_cmd::run(c),
        Command::Device(a) => daemon::device(a),
        Command::DeviceCtl(a) => pcie::device_ctl(a),
        Command::Host(a) => daemon::host(a),
        Command::Status(a) => status::run(a),
        Command::Msgd(a) => msgd::run(a),
        Command::Stackd(a) => stackd::run(a),
        Command::Keygen(a) => keys::keygen(a),
        Command::Stack(c) => stack::run(c),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lanbus: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
