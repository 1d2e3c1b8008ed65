//! The Open MPI rows of `lanbus bench msg --mpi`: a ping-pong program built with `mpicc`
//! (`mpi/pingpong.c`) under `mpirun`, its two ranks in the bench's two namespaces, talking across
//! the same veth: through the lanbus libfabric provider (Open MPI's ofi MTL) in direct mode (each
//! rank owns a port) and in daemon mode (each rank attached to a messaging daemon in its
//! namespace), and, as the peer, through Open MPI's tcp BTL (`--mca pml ob1 --mca btl tcp,self`).
//! NetPIPE's `NPopenmpi` runs the same ways, for a second, independent program's view.
//!
//! How the ranks get into two namespaces: `mpirun` runs inside namespace a and starts the second
//! rank's daemon (orted) through a launch agent that enters namespace b with its own host name
//! (`ip netns exec B unshare --uts`), so Open MPI sees two machines whose out-of-band and tcp
//! BTL traffic crosses the veth. Two settings make the tcp BTL work there: IPv6 off (it would
//! also try the veth's link-local addresses) and a first exchange that only rank 0 starts (when
//! both ranks connect to each other at the same moment, the BTL can wedge). Every row runs
//! with `mpi_yield_when_idle`: on two cores, ranks that spin without yielding starve the threads
//! that move their messages (the kernel's and lanbus's alike).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanbus_node::msgd::MsgDaemon;
use lanbus_node::process::end_with_parent;
use lanbus_port::netns::{VethEnd, VethPair};

const PINGPONG: &str = include_str!("../mpi/pingpong.c");

/// What a job runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport<'a> {
    /// The lanbus provider over a port of this kind, each rank owning its port.
    Direct(&'a str),
    /// The lanbus provider over a port of this kind, through a daemon in each namespace.
    Daemon(&'a str),
    /// Open MPI's tcp BTL.
    Tcp,
}

/// The program a job runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Program {
    /// `mpi/pingpong.c`, built with mpicc: latency and osu_bw-style bandwidth.
    PingPong,
    /// NetPIPE's `NPopenmpi` (Debian package netpipe-openmpi): its ping-pong latency.
    NetPipe,
}

impl Program {
    pub fn name(self) -> &'static str {
        match self {
            Program::PingPong => "pingpong",
            Program::NetPipe => "NPopenmpi",
        }
    }
}

/// One job's figures: per size asked for, latency (µs) and bandwidth (MB/s, 0 when not
/// measured), `None` where the program gave none; and the bytes that crossed the veth during it.
pub(crate) struct Job {
    pub figures: Vec<Option<(f64, f64)>>,
    pub veth_bytes: u64,
}

/// The program, the provider and the launch agent, made once per bench run.
pub(crate) struct Mpi {
    dir: PathBuf,
    program: PathBuf,
    provider: PathBuf,
    agent: PathBuf,
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The folder holding `liblanbus-fi.so`: `dir` if given; else one made in `scratch` around the
/// library cargo built next to this binary; else the install folder.
fn provider_dir(given: Option<&Path>, scratch: &Path) -> anyhow::Result<PathBuf> {
    if let Some(d) = given {
        if !d.join("liblanbus-fi.so").exists() {
            bail!(
                "--fi-provider {}: no liblanbus-fi.so there (scripts/install-fi-provider DIR)",
                d.display()
            );
        }
        return Ok(d.to_path_buf());
    }
    let exe = std::env::current_exe()?;
    let built = exe.parent().map(|p| p.join("liblanbus_fi.so"));
    if let Some(lib) = built.filter(|l| l.exists()) {
        let d = scratch.join("provider");
        std::fs::create_dir_all(&d)?;
        let _ = std::fs::remove_file(d.join("liblanbus-fi.so"));
        std::os::unix::fs::symlink(&lib, d.join("liblanbus-fi.so"))?;
        return Ok(d);
    }
    let installed = Path::new("/usr/local/lib/lanbus/libfabric");
    if installed.join("liblanbus-fi.so").exists() {
        return Ok(installed.to_path_buf());
    }
    bail!(
        "no lanbus libfabric provider: build it next to this binary (cargo build --release -p lanbus-fi), \
         install it (scripts/install-fi-provider) or give --fi-provider DIR"
    )
}

/// Asks libfabric itself (`fi_info -p lanbus`, Debian package libfabric-bin, where installed)
/// whether the provider in `dir` loads. A library built before libfabric-dev was installed has
/// no entry point; Open MPI would then only say that no pml component could be opened.
fn check_provider(dir: &Path) -> anyhow::Result<()> {
    let out = match Command::new("fi_info").args(["-p", "lanbus"]).env("FI_PROVIDER_PATH", dir).output() {
        Ok(out) => out,
        Err(_) => return Ok(()),
    };
    if !out.status.success() {
        bail!(
            "libfabric does not load the lanbus provider in {} (`fi_info -p lanbus`: {}); a library \
             built before libfabric-dev was installed has no provider in it: rebuild it \
             (cargo build --release -p lanbus-fi, or scripts/install-fi-provider)",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Mpi {
    /// Builds the program with `mpicc` and finds the provider.
    pub fn prepare(dir: &Path, provider: Option<&Path>) -> anyhow::Result<Mpi> {
        let source = dir.join("pingpong.c");
        std::fs::write(&source, PINGPONG)?;
        let program = dir.join("pingpong");
        let out = Command::new("mpicc")
            .args(["-O2", "-o"])
            .arg(&program)
            .arg(&source)
            .output()
            .context("running mpicc (Debian packages openmpi-bin, libopenmpi-dev)")?;
        if !out.status.success() {
            bail!("mpicc failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let agent = dir.join("launch-agent");
        std::fs::write(
            &agent,
            "#!/bin/sh\n# mpirun's launch agent: \"launch-agent HOST COMMAND...\" runs COMMAND in namespace HOST,\n\
             # under HOST as its host name.\nhost=$1; shift\nexec ip netns exec \"$host\" unshare --uts sh -c \"hostname $host; exec $*\"\n",
        )?;
        std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let provider = provider_dir(provider, dir)?;
        check_provider(&provider)?;
        Ok(Mpi { dir: dir.to_path_buf(), program, provider, agent })
    }

    /// Runs one job over `transport`; a job that does not finish within `limit` is an error.
    /// Over lanbus, `eager_limit` sets the provider's eager limit (`LANBUS_FI_EAGER_LIMIT`); over
    /// the tcp BTL, its eager limit and first rendezvous fragment (`btl_tcp_eager_limit`,
    /// `btl_tcp_rndv_eager_limit`); `None`: the default.
    #[allow(clippy::too_many_arguments)]
    pub fn job(
        &self,
        veth: &VethPair,
        transport: Transport<'_>,
        eager_limit: Option<usize>,
        program: Program,
        sizes: &[usize],
        window: usize,
        limit: Duration,
    ) -> anyhow::Result<Job> {
        let subnet = {
            let o = veth.a.ipv4.octets();
            format!("{}.{}.{}.0/24", o[0], o[1], o[2])
        };
        let (ha, hb) = (veth.a.netns.name(), veth.b.netns.name());
        let mut args: Vec<String> = vec![
            "mpirun".into(),
            "--host".into(),
            format!("{ha}:1,{hb}:1"),
            "-np".into(),
            "2".into(),
            "--bind-to".into(),
            "none".into(),
        ];
        let mut mca = |k: &str, v: &str| args.extend(["--mca".to_string(), k.to_string(), v.to_string()]);
        mca("plm_rsh_agent", &self.agent.display().to_string());
        mca("oob_tcp_if_include", &subnet);
        mca("mpi_yield_when_idle", "1");
        // The daemons of daemon mode live as long as the job.
        let mut daemons = Vec::new();
        let mut env: Vec<(String, String)> = Vec::new();
        match transport {
            Transport::Tcp => {
                mca("pml", "ob1");
                mca("btl", "tcp,self");
                mca("btl_tcp_if_include", &subnet);
                mca("btl_tcp_disable_family", "6");
                if let Some(limit) = eager_limit {
                    mca("btl_tcp_eager_limit", &limit.to_string());
                    mca("btl_tcp_rndv_eager_limit", &limit.to_string());
                }
            }
            Transport::Direct(kind) | Transport::Daemon(kind) => {
                mca("pml", "cm");
                mca("mtl", "ofi");
                mca("mtl_ofi_provider_include", "lanbus");
                env.push(("FI_PROVIDER_PATH".into(), self.provider.display().to_string()));
                env.push(("FI_PROVIDER".into(), "lanbus".into()));
                if let Some(limit) = eager_limit {
                    env.push(("LANBUS_FI_EAGER_LIMIT".into(), limit.to_string()));
                }
                if let Transport::Direct(_) = transport {
                    let (sa, sb) = super::port_specs(kind, veth)?;
                    env.push(("LANBUS_FI_PORT".into(), format!("{sa};{sb}")));
                } else {
                    let (pa, pb) = super::port_pair(kind, Some(veth))?;
                    let rc = |name: &str| {
                        let mut c = lanbus_node::config::msgd_runtime_config(name);
                        c.transport.heartbeat.enabled = false;
                        c
                    };
                    let (sa, sb) = (self.dir.join("msgd-a.sock"), self.dir.join("msgd-b.sock"));
                    daemons.push(MsgDaemon::start(pa, &sa, rc("msgd-a"))?);
                    daemons.push(MsgDaemon::start(pb, &sb, rc("msgd-b"))?);
                    env.push(("LANBUS_FI_DAEMON".into(), format!("{},{}", sa.display(), sb.display())));
                }
            }
        }
        for (k, v) in &env {
            args.extend(["-x".to_string(), format!("{k}={v}")]);
        }
        let np_file = self.dir.join("np.out");
        let _ = std::fs::remove_file(&np_file);
        match program {
            Program::PingPong => {
                args.push(self.program.display().to_string());
                args.push(window.to_string());
                args.extend(sizes.iter().map(|s| s.to_string()));
            }
            Program::NetPipe => {
                // Powers of two (no perturbations) from 1 byte to the largest size.
                let upto = sizes.iter().copied().max().unwrap_or(1).to_string();
                args.extend(["NPopenmpi", "-p", "0", "-l", "1", "-u", &upto, "-o"].map(String::from));
                args.push(np_file.display().to_string());
            }
        }
        let script =
            format!("hostname {ha}; exec {}", args.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" "));
        let out_file = self.dir.join("mpi.out");
        let err_file = self.dir.join("mpi.err");
        let before = veth_bytes(&veth.a);
        let mut child = end_with_parent(veth.a.netns.command("unshare").args(["--uts", "sh", "-c", &script]))
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out_file)?)
            .stderr(std::fs::File::create(&err_file)?)
            .spawn()
            .context("running mpirun (Debian package openmpi-bin)")?;
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break s;
            }
            if start.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                kill_stragglers(&self.dir);
                bail!("the job did not finish within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let veth_bytes = veth_bytes(&veth.a).saturating_sub(before);
        drop(daemons);
        let text = std::fs::read_to_string(&out_file)?;
        if !status.success() {
            let err = std::fs::read_to_string(&err_file).unwrap_or_default();
            bail!("mpirun failed ({status}): {}", err.lines().take(8).collect::<Vec<_>>().join(" | "));
        }
        // pingpong prints "bytes µs MB/s"; NPopenmpi writes "bytes Mbps seconds" (one way).
        let table = match program {
            Program::PingPong => text,
            Program::NetPipe => std::fs::read_to_string(&np_file).context("NPopenmpi wrote no table")?,
        };
        let measured: Vec<(usize, f64, f64)> = table
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let (bytes, a, b): (usize, f64, f64) =
                    (f.next()?.parse().ok()?, f.next()?.parse().ok()?, f.next()?.parse().ok()?);
                Some(match program {
                    Program::PingPong => (bytes, a, b),
                    Program::NetPipe => (bytes, b * 1e6, 0.0),
                })
            })
            .collect();
        let figures: Vec<Option<(f64, f64)>> = sizes
            .iter()
            .map(|&s| measured.iter().find(|m| m.0 == s).map(|&(_, us, mbs)| (us, mbs)))
            .collect();
        if figures.iter().all(Option::is_none) {
            bail!("{} gave no figures: {table}", program.name());
        }
        Ok(Job { figures, veth_bytes })
    }
}

/// Ranks left behind by a job that was ended (its daemon in the other namespace may outlive
/// mpirun): every process whose command line names this bench's folder (the ping-pong lives
/// there, NPopenmpi writes its table there).
fn kill_stragglers(dir: &Path) {
    let _ = Command::new("pkill").arg("-KILL").arg("-f").arg(dir).status();
}

/// Bytes received and sent by a veth end.
fn veth_bytes(end: &VethEnd) -> u64 {
    ["rx_bytes", "tx_bytes"]
        .iter()
        .map(|c| {
            end.netns
                .exec("cat", &[&format!("/sys/class/net/{}/statistics/{c}", end.ifname)])
                .ok()
                .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}
