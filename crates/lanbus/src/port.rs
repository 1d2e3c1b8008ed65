//! `lanbus port ...`: tools for the packet ports (is this spec usable here, and if not, why).

use std::time::{Duration, Instant};

use clap::Subcommand;
use lanbus_port::{Port, PortCounters, PortSpec};

/// Port tools.
#[derive(Debug, Subcommand)]
pub enum PortCommand {
    /// Opens the port a spec names and prints its MAC, MTU and counters, or why it cannot open.
    #[command(after_help = lanbus_port::SPEC_HELP)]
    Check {
        /// The port spec (see below), e.g. udp:127.0.0.1:7000,peer=127.0.0.1:7001 or afpacket:eth1.
        spec: PortSpec,
        /// Receive for this many seconds before printing the counters (shows whether lanbus
        /// frames arrive, and how many were dropped as malformed).
        #[arg(long, default_value_t = 0.0)]
        listen: f64,
    },
}

/// Runs a port subcommand.
pub fn run(command: PortCommand) -> anyhow::Result<()> {
    match command {
        PortCommand::Check { spec, listen } => check(&spec, listen),
    }
}

fn check(spec: &PortSpec, listen_secs: f64) -> anyhow::Result<()> {
    anyhow::ensure!(
        listen_secs.is_finite() && (0.0..=86_400.0).contains(&listen_secs),
        "--listen takes seconds between 0 and 86400"
    );
    // The error names the spec and says what is missing; nothing to add.
    let mut port = spec.open()?;
    println!("port      {spec}");
    println!("mac       {}", port.mac());
    println!("mtu       {} bytes of payload (frames up to {} bytes)", port.mtu(), port.frame_capacity());
    if listen_secs > 0.0 {
        let deadline = Instant::now() + Duration::from_secs_f64(listen_secs);
        println!("listening {listen_secs} s ...");
        loop {
            port.rx_burst(64, &mut |_| {})?;
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            port.wait(Some((deadline - now).min(Duration::from_millis(100))))?;
        }
    }
    print_counters(&port.counters());
    println!("ok: the port opened and works here");
    Ok(())
}

fn print_counters(c: &PortCounters) {
    println!("rx        {} frames, {} bytes, {} dropped", c.rx_frames, c.rx_bytes, c.rx_dropped);
    println!("tx        {} frames, {} bytes, {} dropped", c.tx_frames, c.tx_bytes, c.tx_dropped);
}
