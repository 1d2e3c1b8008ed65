//! The server against real NBD clients: qemu-img, qemu-io, nbdinfo (libnbd) and fio's nbd engine.
//! Each test prints why it skips when its tool is missing (scripts/setup installs them).

mod common;

use std::process::Command;
use std::sync::Arc;

use common::*;
use lanbus_block::{BlockDevice, FileDevice, MemDevice};
use lanbus_nbd::{Client, Export};
use rand::{RngCore, SeedableRng};

#[test]
fn qemu_img_convert_and_compare_64_mib_onto_a_file_export() {
    if !have_tool("qemu-img", "qemu-utils") {
        return;
    }
    let scratch = Scratch::new("qemu-img");
    let image = scratch.path("random.img");
    let mut data = vec![0u8; 64 << 20];
    rand_chacha::ChaCha8Rng::seed_from_u64(0x6e62_6401).fill_bytes(&mut data);
    std::fs::write(&image, &data).unwrap();
    let backing = scratch.path("backing.img");
    let dev = Arc::new(FileDevice::create(&backing, 64 << 20).unwrap());
    let srv = TestServer::start("qemu-img", vec![Export::new("export", dev.clone() as Arc<dyn BlockDevice>)]);

    let uri = srv.uri("export");
    let (ok, out) =
        run(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&image).arg(&uri));
    assert!(ok, "qemu-img convert failed: {out}");
    let (ok, out) =
        run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&image).arg(&uri));
    assert!(ok && out.contains("identical"), "qemu-img compare: {out}");

    // The comparison must be able to fail: change one byte behind the server's back.
    dev.write_at(40 << 20, &[!data[40 << 20]; 512], false).unwrap();
    let (ok, out) =
        run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&image).arg(&uri));
    assert!(!ok && out.contains("mismatch"), "qemu-img compare should see the change: {out}");
    dev.write_at(40 << 20, &data[40 << 20..(40 << 20) + 512], false).unwrap();

    let stats = srv.server.shutdown().unwrap();
    assert!(stats.bytes_written >= 64 << 20, "{stats:?}");
    assert_eq!(stats.protocol_disconnects, 0, "{stats:?}");
    // Shutdown flushed: the backing file itself holds the image.
    assert!(std::fs::read(&backing).unwrap() == data, "backing file differs from the image");
}

#[test]
fn qemu_io_patterns_over_tcp_match_the_device() {
    if !have_tool("qemu-io", "qemu-utils") {
        return;
    }
    let (dev, export) = mem_export("export", 16 << 20);
    let srv = TestServer::start("qemu-io", vec![export]);
    let uri = srv.tcp_uri("export");
    let qemu_io = |cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        c.arg(&uri);
        run(&mut c)
    };
    let (ok, out) = qemu_io(&[
        "write -P 0xab 0 1M",
        "read -P 0xab 0 1M",
        "write -P 0x5c 1536 4k",
        "write -z 2M 1M",
        "read -P 0 2M 1M",
        "write -P 0x77 5M 128k",
        "write -f -P 0x78 6M 64k",
        "discard 8M 64k",
        "flush",
        "aio_write -P 0x11 10M 64k",
        "aio_write -P 0x22 11M 64k",
        "aio_flush",
    ]);
    assert!(ok && !out.contains("failed"), "qemu-io: {out}");
    assert!(read_all(&*dev, 0, 1536).iter().all(|&b| b == 0xab));
    assert!(read_all(&*dev, 1536, 4096).iter().all(|&b| b == 0x5c));
    assert!(read_all(&*dev, 1536 + 4096, (1 << 20) - 1536 - 4096).iter().all(|&b| b == 0xab));
    assert!(read_all(&*dev, 5 << 20, 128 << 10).iter().all(|&b| b == 0x77));
    assert!(read_all(&*dev, 6 << 20, 64 << 10).iter().all(|&b| b == 0x78));
    assert!(read_all(&*dev, 10 << 20, 64 << 10).iter().all(|&b| b == 0x11));
    assert!(read_all(&*dev, 11 << 20, 64 << 10).iter().all(|&b| b == 0x22));

    // Data written by our own client is what qemu-io reads, and a wrong pattern is noticed.
    let mut client = Client::connect_tcp(srv.tcp.unwrap(), "export").unwrap();
    client.write(4 << 20, &[0xcd; 65536], true).unwrap();
    client.disconnect().unwrap();
    let (ok, out) = qemu_io(&["read -P 0xcd 4M 64k"]);
    assert!(ok && !out.contains("failed"), "{out}");
    let (ok, out) = qemu_io(&["read -P 0xce 4M 64k"]);
    assert!(!ok || out.contains("Pattern verification failed"), "wrong pattern went unnoticed: {out}");

    // Out-of-range requests are refused, not crashes.
    let (_, out) = qemu_io(&["read 16M 4k"]);
    assert!(out.contains("error") || out.contains("Input/output") || out.contains("Invalid"), "{out}");
    let stats = srv.server.shutdown().unwrap();
    assert_eq!(stats.protocol_disconnects, 0, "{stats:?}");
}

#[test]
fn nbdinfo_lists_and_describes_exports() {
    if !have_tool("nbdinfo", "libnbd-bin") {
        return;
    }
    let ram = Arc::new(MemDevice::new(32 << 20));
    let ro = Arc::new(MemDevice::with_block_size(8 << 20, 4096).unwrap());
    let srv = TestServer::start(
        "nbdinfo",
        vec![
            Export::new("disk", ram as Arc<dyn BlockDevice>).description("scratch RAM disk"),
            Export::new("golden", ro as Arc<dyn BlockDevice>).read_only(true),
        ],
    );
    let list_uri = format!("nbd+unix:///?socket={}", srv.socket.display());
    let (ok, out) = run(Command::new("nbdinfo").args(["--list", "--json"]).arg(&list_uri));
    assert!(ok, "nbdinfo --list: {out}");
    let v: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    let exports = v["exports"].as_array().unwrap();
    let names: Vec<&str> = exports.iter().map(|e| e["export-name"].as_str().unwrap()).collect();
    assert_eq!(names, ["disk", "golden"]);
    assert_eq!(exports[0]["description"], "scratch RAM disk");
    assert_eq!(exports[0]["export-size"], 32 << 20);
    assert_eq!(exports[1]["is_read_only"], true);

    let (ok, out) = run(Command::new("nbdinfo").arg("--json").arg(srv.uri("golden")));
    assert!(ok, "nbdinfo: {out}");
    let v: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    let e = &v["exports"][0];
    assert_eq!(e["export-size"], 8 << 20);
    assert_eq!(e["is_read_only"], true);
    assert_eq!(e["can_trim"], false);
    assert_eq!(e["block_size_minimum"], 4096);
    assert_eq!(e["block_size_maximum"], 32 << 20);
    assert_eq!(v["protocol"], "newstyle-fixed");

    let (ok, out) = run(Command::new("nbdinfo").arg(srv.uri("missing")));
    assert!(!ok, "an unknown export must be refused: {out}");
    let (ok, out) = run(Command::new("nbdinfo").arg("--size").arg(srv.uri("")));
    assert!(ok && out.trim() == (32u64 << 20).to_string(), "default export: {out}");
}

fn fio_verify(bs: &str, size_mib: u64, jobs: u32) {
    if !have_tool("fio", "fio") {
        return;
    }
    let (_, out) = run(Command::new("fio").arg("--enghelp=nbd"));
    if !out.contains("uri") {
        eprintln!("SKIP: this fio has no nbd engine ({out})");
        return;
    }
    let (dev, export) = mem_export("export", (size_mib * u64::from(jobs)) << 20);
    let srv = TestServer::start("fio", vec![export]);
    let (ok, out) = run(Command::new("fio")
        .current_dir(&srv.scratch.0)
        .args(["--name=verify", "--ioengine=nbd", "--rw=randwrite", "--iodepth=16"])
        .arg(format!("--uri={}", srv.uri("export")))
        .arg(format!("--bs={bs}"))
        .arg(format!("--size={size_mib}M"))
        .arg(format!("--numjobs={jobs}"))
        .arg(format!("--offset_increment={size_mib}M"))
        .args(["--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0"])
        .args(["--randseed=1234", "--group_reporting"]));
    assert!(ok && out.contains("err= 0"), "fio failed: {out}");
    let stats = srv.server.shutdown().unwrap();
    let total = (size_mib * u64::from(jobs)) << 20;
    assert!(stats.bytes_written >= total && stats.bytes_read >= total, "{stats:?}");
    assert_eq!(stats.device_errors + stats.protocol_disconnects + stats.requests_refused, 0, "{stats:?}");
    assert!(stats.handshakes_completed >= u64::from(jobs));
    // fio's verify headers are in the device: it is not all zeroes.
    assert!(read_all(&*dev, 0, 1 << 20).iter().any(|&b| b != 0));
}

#[test]
fn fio_randwrite_verify_crc32c_4k_two_connections() {
    fio_verify("4k", 16, 2);
}

#[test]
fn fio_randwrite_verify_crc32c_128k() {
    fio_verify("128k", 32, 1);
}
