//! Real MPI programs through the lanbus libfabric provider (`liblanbus-fi.so`, loaded by
//! Debian's libfabric through `FI_PROVIDER_PATH`) and Open MPI's ofi MTL, unmodified:
//!
//! - a C program (`tests/mpi/checks.c`: nonblocking sends and receives, MPI_ANY_SOURCE and
//!   MPI_ANY_TAG, truncation, synchronous sends, probes, a cancelled receive) on 2 and 4 ranks;
//! - an mpi4py program (`tests/mpi/checks.py`: pickles, buffers, Bcast, Reduce, Allreduce,
//!   Barrier) on 2 and 4 ranks, run with Debian's `/usr/bin/python3`;
//! - NetPIPE's `NPopenmpi` up to 8 MiB;
//! - at the libfabric level (`tests/mpi/peer_gone.c`, no launcher), a peer killed in the middle
//!   of a run: the survivor's receive from it and send to it complete with FI_EHOSTUNREACH
//!   through `fi_cq_readerr`, and the daemons go on serving a new job.
//!
//! Without root, ranks spread over two `lanbus msgd` daemons joined by the shm port, as two
//! machines would be. As root, the daemons sit in two network namespaces joined by a veth pair,
//! over afpacket and over afxdp, and the veth's byte counters show the job crossed it; and joined
//! by two veth pairs (`--port` once per link), the checks and NetPIPE (`-u 1048576`) complete
//! while one link goes down and up again and again.
//!
//! Needs Open MPI, libfabric's headers, NetPIPE, mpi4py (`scripts/setup` installs them as root)
//! and the built provider (`scripts/test` builds it); without them it says what is missing and
//! skips, but not as root, where `scripts/test` provides them all.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use lanbus_port::netns::{check_root, VethPair};

mod common;

const PROGRAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mpi");

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn is_root() -> bool {
    check_root().is_ok()
}

/// What the tests need that is not the project's: missing pieces, named.
fn missing_tools() -> Vec<&'static str> {
    let have = |cmd: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {cmd}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut missing = Vec::new();
    for (tool, package) in
        [("mpirun", "openmpi-bin"), ("mpicc", "libopenmpi-dev"), ("NPopenmpi", "netpipe-openmpi")]
    {
        if !have(tool) {
            missing.push(package);
        }
    }
    if !Path::new("/usr/include/rdma/fabric.h").exists() {
        missing.push("libfabric-dev");
    }
    let mpi4py =
        Command::new("/usr/bin/python3").args(["-c", "import mpi4py"]).stderr(Stdio::null()).status();
    if !mpi4py.is_ok_and(|s| s.success()) {
        missing.push("python3-mpi4py");
    }
    if !built_provider().exists() {
        missing.push("liblanbus_fi.so (cargo build -p lanbus-fi)");
    }
    missing
}

/// Skips (returns false) when the tools are missing; as root, where `scripts/setup` installs
/// them, that is a failure.
fn tools_ready(test: &str) -> bool {
    let missing = missing_tools();
    if missing.is_empty() {
        return true;
    }
    assert!(!is_root(), "{test}: missing {missing:?}: scripts/test installs and builds them as root");
    eprintln!("{test}: skipped: missing {missing:?} (scripts/test installs and builds them as root)");
    false
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lanbus-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The provider as cargo built it (`cargo build -p lanbus-fi`, which `scripts/test` runs: a
/// test cannot build a library itself while cargo holds the build folder).
fn built_provider() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_lanbus")).parent().unwrap().join("liblanbus_fi.so")
}

/// A folder holding the provider under the name libfabric looks for (`lib<name>-fi.so`).
fn provider_dir(dir: &Path) -> PathBuf {
    let lib = built_provider();
    let d = dir.join("provider");
    std::fs::create_dir_all(&d).unwrap();
    std::os::unix::fs::symlink(&lib, d.join("liblanbus-fi.so")).unwrap();
    d
}

fn run(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Builds the test programs into `dir`.
fn build_programs(dir: &Path) {
    run(
        Command::new("mpicc")
            .args(["-O2", "-Wall", "-o"])
            .arg(dir.join("checks"))
            .arg(format!("{PROGRAMS}/checks.c")),
        "mpicc checks.c",
    );
    run(
        Command::new("gcc")
            .args(["-O2", "-Wall", "-o"])
            .arg(dir.join("peer_gone"))
            .arg(format!("{PROGRAMS}/peer_gone.c"))
            .arg("-lfabric"),
        "gcc peer_gone.c",
    );
}

/// Starts `lanbus msgd` (in `ns` if given) and waits for its socket.
fn msgd(ns: Option<&lanbus_port::netns::Netns>, port: &str, socket: &Path, log: &Path) -> Daemon {
    msgd_with(ns, port, socket, log, &[])
}

/// [`msgd`] with more arguments.
fn msgd_with(
    ns: Option<&lanbus_port::netns::Netns>,
    port: &str,
    socket: &Path,
    log: &Path,
    extra: &[&str],
) -> Daemon {
    let log = std::fs::File::create(log).unwrap();
    let mut cmd = match ns {
        Some(ns) => ns.command(env!("CARGO_BIN_EXE_lanbus")),
        None => Command::new(env!("CARGO_BIN_EXE_lanbus")),
    };
    cmd.args(["msgd", "--port", port, "--socket"]).arg(socket).args(extra).stdout(Stdio::null()).stderr(log);
    let d = Daemon(cmd.spawn().unwrap());
    let t = Instant::now();
    while !socket.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "msgd never made {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    d
}

/// The environment every process of a job gets: the provider and the daemons, a rank taking the
/// daemon at its rank modulo their number; and the test's own scratch folder as TMPDIR, where
/// Open MPI makes its session folder (named by host and user only, so two tests' jobs at once
/// would race to create the same one in /tmp).
fn job_env(cmd: &mut Command, provider: &Path, sockets: &[PathBuf]) {
    let list: Vec<String> = sockets.iter().map(|s| s.display().to_string()).collect();
    let scratch = provider.parent().expect("the provider folder is in the test's scratch folder");
    cmd.env("TMPDIR", scratch)
        .env("FI_PROVIDER_PATH", provider)
        .env("FI_PROVIDER", "lanbus")
        .env("LANBUS_FI_DAEMON", list.join(","))
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
}

/// `mpirun` over the lanbus provider with `ranks` ranks.
fn mpirun(provider: &Path, sockets: &[PathBuf], ranks: usize, program: &[&str], what: &str) -> String {
    mpirun_with(provider, sockets, None, ranks, program, what)
}

/// [`mpirun_with`] in direct mode, each rank's port sealed under the key file `key`.
fn mpirun_keyed(provider: &Path, ports: &str, key: &Path, program: &[&str]) -> Output {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "--bind-to", "none", "-np", "2"])
        .args(["--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "mtl_ofi_provider_include", "lanbus"])
        .args(["-x", "FI_PROVIDER_PATH", "-x", "FI_PROVIDER", "-x", "LANBUS_FI_PORT", "-x", "LANBUS_FI_KEY"]);
    job_env(&mut cmd, provider, &[]);
    cmd.env_remove("LANBUS_FI_DAEMON").env("LANBUS_FI_PORT", ports).env("LANBUS_FI_KEY", key);
    cmd.args(program);
    cmd.output().expect("running mpirun")
}

/// [`mpirun`]; with `ports`, in direct mode: each rank owns the port of `LANBUS_FI_PORT` at its
/// rank instead of attaching to a daemon.
fn mpirun_with(
    provider: &Path,
    sockets: &[PathBuf],
    ports: Option<&str>,
    ranks: usize,
    program: &[&str],
    what: &str,
) -> String {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "--bind-to", "none", "-np", &ranks.to_string()])
        .args(["--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "mtl_ofi_provider_include", "lanbus"])
        .args(["-x", "FI_PROVIDER_PATH", "-x", "FI_PROVIDER"]);
    job_env(&mut cmd, provider, sockets);
    match ports {
        Some(p) => cmd.args(["-x", "LANBUS_FI_PORT"]).env_remove("LANBUS_FI_DAEMON").env("LANBUS_FI_PORT", p),
        None => cmd.args(["-x", "LANBUS_FI_DAEMON"]),
    };
    cmd.args(program);
    let out = run(&mut cmd, what);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The jobs every wire runs: the C checks and the mpi4py checks on 2 and 4 ranks.
fn checks(dir: &Path, provider: &Path, sockets: &[PathBuf]) {
    let checks = dir.join("checks");
    for ranks in [2, 4] {
        let out = mpirun(provider, sockets, ranks, &[checks.to_str().unwrap()], "checks.c");
        assert!(out.contains(&format!("checks passed on {ranks} ranks")), "{out}");
        let py = format!("{PROGRAMS}/checks.py");
        let out = mpirun(provider, sockets, ranks, &["/usr/bin/python3", &py], "checks.py");
        assert!(out.contains(&format!("python checks passed on {ranks} ranks")), "{out}");
    }
}

/// NetPIPE through Open MPI up to 8 MiB; returns its largest size.
fn netpipe(dir: &Path, provider: &Path, sockets: &[PathBuf]) -> u64 {
    let out_file = dir.join("np.out");
    mpirun(
        provider,
        sockets,
        2,
        &["NPopenmpi", "-p", "0", "-u", "8388608", "-o", out_file.to_str().unwrap()],
        "NPopenmpi",
    );
    let table = std::fs::read_to_string(&out_file).unwrap();
    let largest =
        table.lines().filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok()).max().unwrap_or(0);
    assert!(largest >= 8 << 20, "NetPIPE reached {largest} bytes:\n{table}");
    largest
}

/// A peer killed in the middle: the survivor's operations toward it fail through
/// `fi_cq_readerr` within the bound.
fn peer_killed(dir: &Path, provider: &Path, server_socket: &Path, client_socket: &Path) {
    let addr = dir.join("server.addr");
    let program = dir.join("peer_gone");
    let mut server = Command::new(&program);
    server.arg("serve").arg(&addr);
    job_env(&mut server, provider, &[server_socket.to_path_buf()]);
    let mut server = server.spawn().unwrap();
    let t = Instant::now();
    while !addr.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "the server never wrote its address");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client = Command::new(&program);
    client.arg("client").arg(&addr).stdout(Stdio::piped());
    job_env(&mut client, provider, &[client_socket.to_path_buf()]);
    let mut client = client.spawn().unwrap();
    let mut stdout = std::io::BufReader::new(client.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line.trim(), "posted");
    // Let the rendezvous announcement reach the server before it dies.
    std::thread::sleep(Duration::from_millis(200));
    server.kill().unwrap();
    server.wait().unwrap();
    let killed = Instant::now();
    let status = client.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert!(status.success(), "the survivor's operations did not fail as they should:\n{rest}");
    assert!(rest.matches("No route to host").count() == 2, "{rest}");
    assert!(killed.elapsed() < Duration::from_secs(20), "errors within the bound");
    eprintln!("peer killed: {}", rest.trim().replace('\n', "; "));
}

#[test]
fn mpi_programs_over_two_daemons_joined_by_the_shm_port() {
    if !tools_ready("mpi_programs_over_two_daemons_joined_by_the_shm_port") {
        return;
    }
    let dir = scratch("shm");
    let provider = provider_dir(&dir);
    build_programs(&dir);
    let link = format!("shm:{}", dir.join("link.sock").display());
    let sockets = [dir.join("a.sock"), dir.join("b.sock")];
    let _a = msgd(None, &link, &sockets[0], &dir.join("a.log"));
    let _b = msgd(None, &link, &sockets[1], &dir.join("b.log"));
    checks(&dir, &provider, &sockets);
    let largest = netpipe(&dir, &provider, &sockets);
    eprintln!("NetPIPE through the provider reached {largest} bytes");
    peer_killed(&dir, &provider, &sockets[0], &sockets[1]);
    // The daemons go on serving new jobs.
    let out =
        mpirun(&provider, &sockets, 2, &[dir.join("checks").to_str().unwrap()], "checks.c after the kill");
    assert!(out.contains("checks passed on 2 ranks"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Direct mode: each rank owns a port (udp over loopback, no root) and its own thread moves the
/// messages as it polls the completion queue; the C and Python checks on two ranks.
#[test]
fn mpi_programs_in_direct_mode_each_rank_owning_its_port() {
    if !tools_ready("mpi_programs_in_direct_mode_each_rank_owning_its_port") {
        return;
    }
    let dir = scratch("direct");
    let provider = provider_dir(&dir);
    build_programs(&dir);
    let free = || std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (pa, pb) = (free(), free());
    let ports = format!("udp:127.0.0.1:{pa},peer=127.0.0.1:{pb};udp:127.0.0.1:{pb},peer=127.0.0.1:{pa}");
    let checks = dir.join("checks");
    let out = mpirun_with(&provider, &[], Some(&ports), 2, &[checks.to_str().unwrap()], "checks.c, direct");
    assert!(out.contains("checks passed on 2 ranks"), "{out}");
    let py = format!("{PROGRAMS}/checks.py");
    let out = mpirun_with(&provider, &[], Some(&ports), 2, &["/usr/bin/python3", &py], "checks.py, direct");
    assert!(out.contains("python checks passed on 2 ranks"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A keyed fabric: two daemons whose frames are sealed and encrypted under a fabric key, and
/// ranks in direct mode each sealing its own port's frames under it (`LANBUS_FI_KEY`).
#[test]
fn mpi_programs_over_a_keyed_fabric_in_daemon_and_direct_mode() {
    if !tools_ready("mpi_programs_over_a_keyed_fabric_in_daemon_and_direct_mode") {
        return;
    }
    let dir = scratch("keyed");
    let provider = provider_dir(&dir);
    build_programs(&dir);
    let key = dir.join("fabric.key");
    run(Command::new(env!("CARGO_BIN_EXE_lanbus")).arg("keygen").arg(&key), "lanbus keygen");
    let key_arg = key.to_str().unwrap();
    let link = format!("shm:{}", dir.join("link.sock").display());
    let sockets = [dir.join("a.sock"), dir.join("b.sock")];
    let keyed = ["--key", key_arg, "--encrypt"];
    let a = msgd_with(None, &link, &sockets[0], &dir.join("a.log"), &keyed);
    let b = msgd_with(None, &link, &sockets[1], &dir.join("b.log"), &keyed);
    let checks = dir.join("checks");
    let out = mpirun(&provider, &sockets, 2, &[checks.to_str().unwrap()], "checks.c, keyed daemons");
    assert!(out.contains("checks passed on 2 ranks"), "{out}");
    drop((a, b));
    let log = std::fs::read_to_string(dir.join("a.log")).unwrap();
    assert!(log.contains("authenticated and encrypted"), "{log}");

    let free = || std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (pa, pb) = (free(), free());
    let ports = format!("udp:127.0.0.1:{pa},peer=127.0.0.1:{pb};udp:127.0.0.1:{pb},peer=127.0.0.1:{pa}");
    let out = mpirun_keyed(&provider, &ports, &key, &[checks.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("checks passed on 2 ranks"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The ranks do read the key: one that others may read is refused.
    let exposed = dir.join("exposed.key");
    std::fs::copy(&key, &exposed).unwrap();
    std::fs::set_permissions(&exposed, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = mpirun_keyed(&provider, &ports, &exposed, &[checks.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a rank opened its port under a key file of mode 0644");
    eprintln!(
        "with an exposed key file: {}",
        text.lines().find(|l| l.contains("LANBUS_FI_KEY")).unwrap_or("(no line)")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A veth's bytes received and sent, read inside its namespace.
fn veth_bytes(end: &lanbus_port::netns::VethEnd) -> u64 {
    let out =
        end.netns.exec("cat", &[&format!("/sys/class/net/{}/statistics/rx_bytes", end.ifname)]).unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0)
}

#[test]
fn mpi_programs_across_namespaces_over_afpacket_and_afxdp() {
    if let Err(skip) = check_root() {
        eprintln!("mpi_programs_across_namespaces_over_afpacket_and_afxdp: skipped: {skip}");
        return;
    }
    if !tools_ready("mpi_programs_across_namespaces_over_afpacket_and_afxdp") {
        return;
    }
    for kind in ["afpacket", "afxdp"] {
        let dir = scratch(kind);
        let provider = provider_dir(&dir);
        build_programs(&dir);
        let pair = VethPair::create().unwrap_or_else(|s| panic!("{s}"));
        let sockets = [dir.join("a.sock"), dir.join("b.sock")];
        let _a =
            msgd(Some(&pair.a.netns), &format!("{kind}:{}", pair.a.ifname), &sockets[0], &dir.join("a.log"));
        let _b =
            msgd(Some(&pair.b.netns), &format!("{kind}:{}", pair.b.ifname), &sockets[1], &dir.join("b.log"));
        let before = (veth_bytes(&pair.a), veth_bytes(&pair.b));
        checks(&dir, &provider, &sockets);
        netpipe(&dir, &provider, &sockets);
        let after = (veth_bytes(&pair.a), veth_bytes(&pair.b));
        let crossed = (after.0 - before.0, after.1 - before.1);
        eprintln!("{kind}: the jobs moved {} and {} bytes across the veth", crossed.0, crossed.1);
        // NetPIPE alone sends each size both ways several times: far more than 8 MiB each way.
        assert!(crossed.0 > 8 << 20 && crossed.1 > 8 << 20, "{kind}: {crossed:?} bytes crossed the veth");
        peer_killed(&dir, &provider, &sockets[0], &sockets[1]);
        drop((_a, _b));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Two namespaces joined by two veth pairs (`eth0`, `eth1` on each side); removed on drop.
struct TwoLinks {
    a: lanbus_port::netns::Netns,
    b: lanbus_port::netns::Netns,
}

impl TwoLinks {
    fn create() -> TwoLinks {
        let tag = std::process::id() % 100_000;
        let ns = |w: &str| lanbus_port::netns::Netns::create(&format!("lbmp{tag}-{w}")).expect("a namespace");
        let (a, b) = (ns("a"), ns("b"));
        for link in ["eth0", "eth1"] {
            let out = Command::new("ip")
                .args(["link", "add", link, "netns", a.name(), "type", "veth", "peer", "name", link])
                .args(["netns", b.name()])
                .output()
                .unwrap();
            assert!(out.status.success(), "ip link add: {}", String::from_utf8_lossy(&out.stderr));
            for ns in [&a, &b] {
                let out = ns.ip(&["link", "set", link, "mtu", "9000", "up"]).unwrap();
                assert!(out.status.success(), "ip link set up: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
        TwoLinks { a, b }
    }
}

#[test]
fn mpi_programs_over_two_links_while_one_flaps() {
    if let Err(skip) = check_root() {
        eprintln!("mpi_programs_over_two_links_while_one_flaps: skipped: {skip}");
        return;
    }
    if !tools_ready("mpi_programs_over_two_links_while_one_flaps") {
        return;
    }
    let dir = scratch("two-links");
    let provider = provider_dir(&dir);
    build_programs(&dir);
    let links = TwoLinks::create();
    let sockets = [dir.join("a.sock"), dir.join("b.sock")];
    let second = ["--port", "afpacket:eth1"];
    let _a = msgd_with(Some(&links.a), "afpacket:eth0", &sockets[0], &dir.join("a.log"), &second);
    let _b = msgd_with(Some(&links.b), "afpacket:eth0", &sockets[1], &dir.join("b.log"), &second);
    let flapping = common::Flapping::start(links.a.name(), "eth1", Duration::from_millis(100));

    checks(&dir, &provider, &sockets);
    let out_file = dir.join("np.out");
    mpirun(
        &provider,
        &sockets,
        2,
        &["NPopenmpi", "-p", "0", "-u", "1048576", "-o", out_file.to_str().unwrap()],
        "NPopenmpi",
    );
    let flaps = flapping.stop();
    let table = std::fs::read_to_string(&out_file).unwrap();
    let largest =
        table.lines().filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok()).max().unwrap_or(0);
    assert!(largest >= 1 << 20, "NetPIPE reached {largest} bytes:\n{table}");
    assert!(flaps >= 3, "the link flapped {flaps} times during the jobs");
    eprintln!("two links: the checks and NetPIPE to 1 MiB completed while eth1 flapped {flaps} times");
    drop((_a, _b));
    let _ = std::fs::remove_dir_all(&dir);
}
