//! A host and an I/O box built from the library, without the `lanbus` command line.
//!
//! The I/O box is a device bridge hosting an NVMe controller with a RAM namespace; the host is a
//! host bridge that enumerates it, runs the user-space NVMe driver on it and exports the
//! namespace over NBD on a Unix socket. The two talk over UDP on the loopback interface (any port
//! spec works: `afxdp:eth1` between two machines). Then an NBD client writes a pattern through
//! the export and reads it back.
//!
//! ```sh
//! cargo run --release -p lanbus-node --example remote_drive
//! ```

use std::sync::Arc;
use std::time::Duration;

use lanbus_bridge::{DeviceBridge, HostBridge};
use lanbus_nbd::{Client, Export, Server};
use lanbus_node::config::{device_config, host_config};
use lanbus_node::drive::{controller, is_nvme, nvme_function, start_driver, NvmeBacking, NvmeBlock};
use lanbus_runtime::ThreadMode;

const GROUP: u16 = 7;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let free = || std::net::UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).map(|a| a.port());
    let (box_port, host_port) = (free()?, free()?);
    let mode = ThreadMode::RunToCompletion;

    // The I/O box: one NVMe drive of 64 MiB in RAM.
    let ctrl = controller(&NvmeBacking::Ram(64 << 20), 512)?;
    let (function, _stats) = nvme_function(ctrl)?;
    let port = format!("udp:127.0.0.1:{box_port},peer=127.0.0.1:{host_port}")
        .parse::<lanbus_port::PortSpec>()
        .and_then(|s| s.open())?;
    let io_box = DeviceBridge::start(port, device_config(GROUP, "example-iobox", mode), vec![function])?;

    // The host: enumerate the group's devices and start the driver on the NVMe controller.
    let port = format!("udp:127.0.0.1:{host_port},peer=127.0.0.1:{box_port}")
        .parse::<lanbus_port::PortSpec>()
        .and_then(|s| s.open())?;
    let host = Arc::new(HostBridge::start(port, host_config(GROUP, "example-host", mode))?);
    let found = host.wait_devices(1, Duration::from_secs(10));
    let f = found.iter().find(|f| is_nvme(f)).ok_or("no NVMe controller appeared in 10 s")?;
    print!("{}", lanbus_node::lspci::describe(f));
    let driver = start_driver(&host, f)?;

    // The export, and a client of it.
    let dir = std::env::temp_dir().join(format!("lanbus-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("nvme0.sock");
    let server =
        Server::builder().export(Export::new("nvme0", Arc::new(NvmeBlock::new(driver.clone())))).build()?;
    server.serve(std::os::unix::net::UnixListener::bind(&socket)?)?;
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
    server.shutdown()?;
    driver.shutdown()?;
    io_box.shutdown();
    std::fs::remove_dir_all(&dir)?;
    if verified {
        Ok(())
    } else {
        Err("the data read back differs".into())
    }
}
