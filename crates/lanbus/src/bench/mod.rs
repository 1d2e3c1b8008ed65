//! `lanbus bench ...`: system measurements, each with its peer measured in the same run.
//!
//! Every benchmark prints a table, writes the common JSON format with `--json FILE` (see
//! [`report`]), quotes medians of several runs, and reports the ratio to its peer.

pub mod nbd;
pub mod nvme;
pub mod pcie;
pub mod report;
pub mod transport_core;

use clap::Subcommand;

/// The benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The paper's Fig. 6: fio random read/write, qd1, 4K..1M, against the NVMe namespace over
    /// NBD: in-process (`local`), over the fabric (sim, udp, afpacket, afxdp) and qemu-nbd.
    Nvme(nvme::NvmeBenchArgs),
    /// fio (nbd engine) against lanbus's NBD server (file and RAM) and qemu-nbd on the same file.
    Nbd(nbd::NbdBenchArgs),
    /// Messages/s through two transport endpoints in one thread, frames handed over directly (no
    /// wire). There is no peer program for an in-process protocol core; frames/s are shown too.
    TransportCore(transport_core::TransportCoreArgs),
    /// DMA engine throughput and 4 B MMIO read latency through the PCIe bridges over sim, udp
    /// and afpacket (root: a veth pair), against the same device in-process (`local`).
    Pcie(pcie::PcieArgs),
}

/// Runs one benchmark.
pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Nbd(args) => nbd::run(args),
        BenchCommand::Nvme(args) => nvme::run(args),
        BenchCommand::TransportCore(args) => transport_core::run(args),
        BenchCommand::Pcie(args) => pcie::run(args),
    }
}
