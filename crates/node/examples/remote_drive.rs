//! A host and an I/O box built from the library, without the `lanbus` command line.
//!
//! The I/O box ([`Device`]) hosts an NVMe controller with a RAM namespace; the host ([`Host`])
//! enumerates it, runs the user-space NVMe driver on it and exports the namespace over NBD on a
//! Unix socket: the very types `lanbus device` and `lanbus host` run. The two talk over UDP on
//! the loopback interface (any port spec works: `afxdp:eth1` between two machines). Then an NBD
//! client writes a pattern through the export and reads it back.
//!
//! ```sh
//! cargo run --release -p lanbus-node --example remote_drive
//! ```

use std::time::Duration;

use lanbus_nbd::Client;
use lanbus_node::config::ExportSpec;
use lanbus_node::device::{Device, DeviceOptions};
use lanbus_node::drive::NvmeBacking;
use lanbus_node::host::{Host, HostOptions};

const GROUP: u16 = 7;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let free = || std::net::UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).map(|a| a.port());
    let (box_port, host_port) = (free()?, free()?);

    // The I/O box: one NVMe drive of 64 MiB in RAM.
    let mut options = DeviceOptions::new(GROUP, "example-iobox");
    options.nvme = Some(NvmeBacking::Ram(64 << 20));
    let port = format!("udp:127.0.0.1:{box_port},peer=127.0.0.1:{host_port}")
        .parse::<lanbus_port::PortSpec>()?
        .open()?;
    let io_box = Device::start(port, options)?;

    // The host: exports its group's drive over NBD as soon as it is enumerated.
    let dir = std::env::temp_dir().join(format!("lanbus-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("nvme0.sock");
    let options = HostOptions::new(GROUP, "example-host", vec![ExportSpec::Unix(socket.clone())]);
    let port = format!("udp:127.0.0.1:{host_port},peer=127.0.0.1:{box_port}")
        .parse::<lanbus_port::PortSpec>()?
        .open()?;
    let host = Host::start(port, options, Box::new(|line| eprintln!("host: {line}")))?;
    host.wait_exported(Duration::from_secs(10)).ok_or("the drive was not exported within 10 s")?;
    for f in host.bridge().devices() {
        print!("{}", lanbus_node::lspci::describe(&f));
    }

    let mut client = Client::connect_unix(&socket, "nvme0")?;
    let pattern: Vec<u8> = (0..1 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    client.write(1 << 20, &pattern, true)?;
    let mut back = vec![0; pattern.len()];
    client.read(1 << 20, &mut back)?;
    let verified = back == pattern;
    println!(
        "1 MiB written through nbd+unix://{} and read back: {}",
        socket.display(),
        if verified { "identical" } else { "DIFFERENT" }
    );

    drop(client);
    host.shutdown();
    io_box.shutdown()?;
    std::fs::remove_dir_all(&dir)?;
    if verified {
        Ok(())
    } else {
        Err("the data read back differs".into())
    }
}
