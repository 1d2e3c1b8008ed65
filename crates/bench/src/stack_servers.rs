//! The server rows of `lanbus bench stack`: nginx (a master and two workers) serving a small
//! page to `wrk`, kept alive on 64 connections (`nginx:stack`/`nginx:linux`, requests/s) and one
//! request per connection (`nginx-close:...`, requests/s and p99 latency), and memcached
//! (`-t 4`) under `memcslap -t get` (`memcached:...`, gets/s). Each server runs through the
//! preload library on the stack server's address and, the peer row, on Linux's TCP at the
//! kernel's address on the same veth; the load comes from the other namespace. Each row also
//! carries the machine's CPU time per request (`cpu_us_per_request`: every CPU's busy time over
//! the run, the load generator's and both stacks' included, over the requests done): on a veth,
//! Linux's TCP work for the server runs partly in the load generator's context, so only the
//! whole machine's time compares fairly.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lanbus_port::netns::Netns;

/// A server that ends with its measurement: SIGTERM (nginx's master then ends its workers),
/// SIGKILL after 5 s.
struct Stopped(std::process::Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One server measurement: (row, metric, value).
pub type Figure = (String, &'static str, f64);

/// Where the servers run and where the load comes from.
pub struct Servers<'a> {
    /// The namespace of the stack server and of Linux's own address (`linux_ip`).
    pub near: &'a Netns,
    /// The load's namespace.
    pub far: &'a Netns,
    pub stack_ip: Ipv4Addr,
    pub linux_ip: Ipv4Addr,
    /// The stack server's socket and the preload library.
    pub socket: &'a Path,
    pub lib: &'a Path,
    pub dir: &'a Path,
    pub seconds: f64,
}

/// The number before `unit` in wrk's line starting with `label` (`Requests/sec:`, `99%`), in
/// the unit's base (latency in ms).
fn wrk_figure(out: &str, label: &str) -> Option<f64> {
    let line = out.lines().map(str::trim).find(|l| l.starts_with(label))?;
    let value = line[label.len()..].split_whitespace().next()?;
    let (num, scale) = if let Some(v) = value.strip_suffix("us") {
        (v, 1e-3)
    } else if let Some(v) = value.strip_suffix("ms") {
        (v, 1.0)
    } else if let Some(v) = value.strip_suffix('s') {
        (v, 1e3)
    } else {
        (value, 1.0)
    };
    num.parse::<f64>().ok().map(|n| n * scale)
}

/// Busy CPU seconds of the whole machine so far (`/proc/stat`'s first line: all but idle and
/// iowait).
fn machine_busy_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<f64> =
        stat.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    let busy: f64 =
        fields.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    busy / hz
}

/// Requests wrk reports done (`N requests in T`).
fn wrk_requests(out: &str) -> Option<f64> {
    let line = out.lines().map(str::trim).find(|l| l.contains(" requests in "))?;
    line.split_whitespace().next()?.parse().ok()
}

/// Operations memcslap reports (`Time to set N keys` and `Time to get N keys by M threads`).
fn memcslap_ops(out: &str) -> Option<f64> {
    let count = |what: &str| -> Option<f64> {
        let line = out.lines().find(|l| l.starts_with(what))?;
        line.split_whitespace().nth(3)?.parse().ok()
    };
    Some(count("Time to set").unwrap_or(0.0) + count("Time to get")?)
}

/// Gets per second from memcslap's `Time to get N keys by M threads: T seconds.`.
fn memcslap_rate(out: &str) -> Option<f64> {
    let line = out.lines().find(|l| l.starts_with("Time to get") && l.contains(" by "))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let keys: f64 = words.get(3)?.parse().ok()?;
    let secs: f64 = words.iter().rev().nth(1)?.parse().ok()?;
    (secs > 0.0).then(|| keys / secs)
}

impl Servers<'_> {
    fn command(&self, program: &str, through_stack: bool) -> Command {
        if through_stack {
            let mut c = Command::new(program);
            c.env("LD_PRELOAD", self.lib).env("LANBUS_STACK_SOCKET", self.socket);
            c
        } else {
            self.near.command(program)
        }
    }

    /// Waits (at most 10 s) until `ip:port` takes a connection from the far namespace.
    fn wait_for(&self, ip: Ipv4Addr, port: u16) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = self
                .far
                .command("bash")
                .arg("-c")
                .arg(format!("exec 3<>/dev/tcp/{ip}/{port}"))
                .stderr(Stdio::null())
                .output();
            if out.is_ok_and(|o| o.status.success()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("nothing answers at {ip}:{port}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn nginx(&self, through_stack: bool, ip: Ipv4Addr, port: u16) -> anyhow::Result<Stopped> {
        let prefix = self.dir.join(format!("nginx-{port}"));
        std::fs::create_dir_all(prefix.join("tmp"))?;
        std::fs::create_dir_all(prefix.join("site"))?;
        std::fs::write(prefix.join("site/index.html"), "<p>a small page</p>\n".repeat(10))?;
        let d = prefix.display();
        let conf = format!(
            "daemon off;\nmaster_process on;\nworker_processes 2;\nuser root;\npid {d}/nginx.pid;\n\
             error_log {d}/error.log;\nevents {{ worker_connections 4096; }}\nhttp {{\naccess_log off;\n\
             client_body_temp_path {d}/tmp/body;\nproxy_temp_path {d}/tmp/proxy;\n\
             fastcgi_temp_path {d}/tmp/fastcgi;\nuwsgi_temp_path {d}/tmp/uwsgi;\nscgi_temp_path {d}/tmp/scgi;\n\
             sendfile on;\ntcp_nopush on;\ntcp_nodelay on;\nkeepalive_requests 1000000;\n\
             server {{ listen {ip}:{port}; root {d}/site; }}\n}}\n"
        );
        let path: PathBuf = prefix.join("nginx.conf");
        std::fs::write(&path, conf)?;
        let child = self
            .command("nginx", through_stack)
            .arg("-p")
            .arg(&prefix)
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("nginx (Debian package nginx; scripts/setup installs it)")?;
        let child = Stopped(child);
        self.wait_for(ip, port)?;
        Ok(child)
    }

    fn wrk(&self, url: &str, close: bool) -> anyhow::Result<String> {
        let secs = format!("{}s", self.seconds.ceil().max(1.0) as u64);
        let mut c = self.far.command("wrk");
        c.args(["-t", "2", "-c", "64", "-d", &secs, "--timeout", "5s", "--latency"]);
        if close {
            c.args(["-H", "Connection: close"]);
        }
        let out = c.arg(url).output().context("wrk (Debian package wrk; scripts/setup installs it)")?;
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.contains("Non-2xx") {
            bail!("wrk {url}: responses other than 2xx/3xx: {out}");
        }
        Ok(out)
    }

    /// The nginx and memcached figures of one run, through the stack (`stack`) and on Linux.
    pub fn run(&self, port: u16) -> anyhow::Result<Vec<Figure>> {
        let mut figures = Vec::new();
        for (through_stack, ip, tag) in [(true, self.stack_ip, "stack"), (false, self.linux_ip, "linux")] {
            let _nginx = self.nginx(through_stack, ip, port)?;
            let url = format!("http://{ip}:{port}/index.html");
            for (close, row) in [(false, "nginx"), (true, "nginx-close")] {
                let busy = machine_busy_s();
                let out = self.wrk(&url, close)?;
                let busy = machine_busy_s() - busy;
                let rate = wrk_figure(&out, "Requests/sec:").context("wrk's requests/s")?;
                figures.push((format!("{row}:{tag}"), "requests_per_s", rate));
                if close {
                    let p99 = wrk_figure(&out, "99%").context("wrk's 99th percentile")?;
                    figures.push((format!("{row}:{tag}"), "p99_ms", p99));
                }
                if let Some(n) = wrk_requests(&out).filter(|&n| n > 0.0) {
                    figures.push((format!("{row}:{tag}"), "cpu_us_per_request", busy * 1e6 / n));
                }
            }
            drop(_nginx);
            let memcached = self
                .command("memcached", through_stack)
                .args([
                    "-u",
                    "root",
                    "-t",
                    "4",
                    "-U",
                    "0",
                    "-l",
                    &ip.to_string(),
                    "-p",
                    &(port + 1).to_string(),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("memcached (Debian package memcached; scripts/setup installs it)")?;
            let _memcached = Stopped(memcached);
            self.wait_for(ip, port + 1)?;
            let busy = machine_busy_s();
            let out = self
                .far
                .command("memcslap")
                .args(["-s", &format!("{ip}:{}", port + 1), "-c", "8", "-e", "20000", "-t", "get"])
                .output()
                .context("memcslap (Debian package libmemcached-tools; scripts/setup installs it)")?;
            let said =
                String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            if said.contains("error") || said.contains("FAILURE") {
                bail!("memcslap against {ip}: {said}");
            }
            let busy = machine_busy_s() - busy;
            let rate = memcslap_rate(&said).with_context(|| format!("memcslap's report: {said}"))?;
            figures.push((format!("memcached:{tag}"), "gets_per_s", rate));
            if let Some(n) = memcslap_ops(&said).filter(|&n| n > 0.0) {
                figures.push((format!("memcached:{tag}"), "cpu_us_per_request", busy * 1e6 / n));
            }
        }
        Ok(figures)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_and_memcslap_reports_parse() {
        let wrk = "  Latency Distribution\n     50%  655.00us\n     99%   11.78ms\n  2 requests in 1s\nRequests/sec:    145.26\n";
        assert_eq!(wrk_figure(wrk, "Requests/sec:"), Some(145.26));
        assert_eq!(wrk_figure(wrk, "99%"), Some(11.78));
        assert_eq!(wrk_figure(wrk, "50%"), Some(0.655));
        assert_eq!(wrk_figure("     99%    1.20s\n", "99%"), Some(1200.0));
        assert_eq!(wrk_figure(wrk, "75%"), None);
        let slap = "Time to set            1000 keys:                     0.090 seconds.\n\
                    Time to get            4000 keys by    4 threads:     0.250 seconds.\n";
        assert_eq!(memcslap_rate(slap), Some(16000.0));
        assert_eq!(memcslap_ops(slap), Some(5000.0));
        assert_eq!(wrk_requests(wrk), Some(2.0));
        assert_eq!(memcslap_rate("Time to get 0 keys by 1 threads: 0.000 seconds.\n"), None);
    }
}
