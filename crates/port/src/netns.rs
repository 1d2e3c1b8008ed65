//! Test hosts in network namespaces: two namespaces joined by a veth pair, made and removed by the
//! process that uses them.
//!
//! Tests and benchmarks that need real packet I/O (AF_PACKET, AF_XDP, kernel UDP across a link)
//! create a [`VethPair`]: namespaces and interfaces get names unique to the process and call, the
//! addresses live only inside those namespaces, and everything is deleted on drop. Code runs inside
//! a namespace on a thread that has entered it ([`Netns::run`]); sockets opened there belong to it.
//! Creating namespaces needs root: without it [`VethPair::create`] returns a [`Skip`] whose
//! message a test prints before returning.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use lanbus_wire::MacAddr;

/// Why a namespace test cannot run here; print it and skip the test.
#[derive(Debug, Clone)]
pub struct Skip(pub String);

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "skipped: {}", self.0)
    }
}

/// Whether this process may create namespaces and interfaces, and if not, why.
pub fn check_root() -> Result<(), Skip> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(Skip("needs root (network namespaces and veth pairs); run as root, as CI does".into()));
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Err(Skip(
            "needs the `ip` command (Debian package iproute2; scripts/setup installs it)".into(),
        ));
    }
    Ok(())
}

fn ip(args: &[&str]) -> std::io::Result<Output> {
    let out = Command::new("ip").args(args).output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(out)
}

/// A network namespace owned by this process: deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

/// Namespaces this process made and has not deleted yet, for [`delete_all`]; `closed` once that
/// ran (no namespace is made after it).
struct Held {
    names: Vec<String>,
    closed: bool,
}

static HELD: Mutex<Held> = Mutex::new(Held { names: Vec::new(), closed: false });

fn held() -> std::sync::MutexGuard<'static, Held> {
    HELD.lock().unwrap_or_else(|e| e.into_inner())
}

/// Deletes every namespace this process made and still holds, returns how many it deleted, and
/// makes later [`Netns::create`] calls fail: for a signal handler about to end the process
/// without running destructors (an interrupted bench). Dropping one of them afterwards is
/// harmless.
pub fn delete_all() -> usize {
    let mut held = held();
    held.closed = true;
    let names = std::mem::take(&mut held.names);
    names.iter().filter(|name| ip(&["netns", "del", name]).is_ok()).count()
}

/// Moves the calling thread into the namespace `ip netns` knows as `name` (for a thread that
/// cannot hold the [`Netns`] itself). Sockets it opens afterwards belong there.
pub fn enter(name: &str) -> std::io::Result<()> {
    let file = File::open(format!("/var/run/netns/{name}"))?;
    // SAFETY: setns with a valid namespace fd and CLONE_NEWNET changes only this thread's
    // network namespace; the fd stays open for the duration of the call.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Netns {
    /// Creates a namespace with loopback up.
    pub fn create(name: &str) -> std::io::Result<Netns> {
        // Made and registered under the registry's lock, so `delete_all` sees every one.
        let mut held = held();
        if held.closed {
            return Err(std::io::Error::other("the process is shutting down (netns::delete_all ran)"));
        }
        // Registered before `ip` runs: a Ctrl-C reaches `ip` too, and may end it after the
        // namespace exists but before it reports success.
        held.names.push(name.to_string());
        if let Err(e) = ip(&["netns", "add", name]) {
            held.names.retain(|n| n != name);
            return Err(e);
        }
        drop(held);
        let ns = Netns { name: name.to_string() };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name (as `ip netns` knows it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip ARGS` inside the namespace; an error carries ip's message.
    pub fn ip(&self, args: &[&str]) -> std::io::Result<Output> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        ip(&full)
    }

    /// Runs a program inside the namespace (`ip netns exec`) and waits for it.
    pub fn exec(&self, program: &str, args: &[&str]) -> std::io::Result<Output> {
        Command::new("ip").args(["netns", "exec", &self.name, program]).args(args).output()
    }

    /// A `Command` that will run `program` inside the namespace, for callers that spawn it.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Moves the calling thread into the namespace. Sockets it opens afterwards belong there.
    /// Threads it spawns afterwards start there too.
    pub fn enter_current_thread(&self) -> std::io::Result<()> {
        enter(&self.name)
    }

    /// Runs `f` on a new thread inside the namespace and returns its result (a panic in `f` is
    /// resumed here).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> std::io::Result<T> {
        let path = format!("/var/run/netns/{}", self.name);
        let handle = std::thread::spawn(move || -> std::io::Result<T> {
            let file = File::open(&path)?;
            // SAFETY: as in `enter_current_thread`.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(f())
        });
        match handle.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let mut held = held();
        // Deleting the namespace also deletes the interfaces inside it.
        let _ = ip(&["netns", "del", &self.name]);
        held.names.retain(|n| *n != self.name);
    }
}

/// One end of a [`VethPair`].
#[derive(Debug)]
pub struct VethEnd {
    /// The namespace this end lives in.
    pub netns: Netns,
    /// Interface name inside the namespace.
    pub ifname: String,
    /// The interface's MAC address.
    pub mac: MacAddr,
    /// Its IPv4 address (/24, only inside the namespace).
    pub ipv4: std::net::Ipv4Addr,
}

/// Two namespaces joined by a veth pair, both ends up and addressed (10.77.0.1 and 10.77.0.2/24,
/// which exist only inside these namespaces).
#[derive(Debug)]
pub struct VethPair {
    /// The first end.
    pub a: VethEnd,
    /// The second end.
    pub b: VethEnd,
}

impl VethPair {
    /// Creates the pair, or says why it cannot (not root, no `ip`) or what failed.
    pub fn create() -> Result<VethPair, Skip> {
        check_root()?;
        Self::create_as_root().map_err(|e| Skip(format!("could not create the test namespaces: {e}")))
    }

    fn create_as_root() -> std::io::Result<VethPair> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // Relaxed: only uniqueness of the value matters.
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let tag = format!("{pid:x}x{n:x}");
        let a_ns = Netns::create(&format!("lanbus-{tag}-a"))?;
        let b_ns = Netns::create(&format!("lanbus-{tag}-b"))?;
        // Interface names are at most 15 bytes; they live in their own namespaces, so short
        // fixed names cannot clash with the machine's.
        let (a_if, b_if) = ("lbveth-a".to_string(), "lbveth-b".to_string());
        let unique = (pid << 8) ^ n;
        let (a_mac, b_mac) = (MacAddr::local(unique << 1), MacAddr::local((unique << 1) | 1));
        let (a_mac_s, b_mac_s) = (a_mac.to_string(), b_mac.to_string());
        ip(&[
            "link",
            "add",
            &a_if,
            "address",
            &a_mac_s,
            "netns",
            a_ns.name(),
            "type",
            "veth",
            "peer",
            "name",
            &b_if,
            "address",
            &b_mac_s,
            "netns",
            b_ns.name(),
        ])?;
        let a_ip = std::net::Ipv4Addr::new(10, 77, 0, 1);
        let b_ip = std::net::Ipv4Addr::new(10, 77, 0, 2);
        for (ns, ifname, addr) in [(&a_ns, &a_if, a_ip), (&b_ns, &b_if, b_ip)] {
            ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", ifname])?;
            ns.ip(&["link", "set", ifname, "up"])?;
        }
        let pair = VethPair {
            a: VethEnd { netns: a_ns, ifname: a_if, mac: a_mac, ipv4: a_ip },
            b: VethEnd { netns: b_ns, ifname: b_if, mac: b_mac, ipv4: b_ip },
        };
        pair.wait_until_carrying()?;
        Ok(pair)
    }

    /// Sets the MTU of both ends (a veth takes 68..=65535; with an XDP program attached, only what
    /// the program can see: see the `afxdp` port).
    pub fn set_mtu(&self, mtu: usize) -> std::io::Result<()> {
        for end in [&self.a, &self.b] {
            end.netns.ip(&["link", "set", &end.ifname, "mtu", &mtu.to_string()])?;
        }
        Ok(())
    }

    /// The MTU of end a (both ends have the same unless someone changed one).
    pub fn mtu(&self) -> std::io::Result<usize> {
        let out = self.a.netns.ip(&["-o", "link", "show", "dev", &self.a.ifname])?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mut words = text.split_whitespace();
        words
            .by_ref()
            .find(|w| *w == "mtu")
            .and(words.next())
            .and_then(|m| m.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no MTU in `ip link show`: {text}")))
    }

    /// Waits (at most 3 s) until plain UDP datagrams cross from a to b and back. Right after the
    /// link comes up the kernel may still drop traffic (carrier and qdisc activation are
    /// asynchronous) and neighbours are unresolved, so a fresh pair sometimes loses its very
    /// first burst; after this, both directions carry and ARP is resolved.
    fn wait_until_carrying(&self) -> std::io::Result<()> {
        use std::net::{SocketAddr, UdpSocket};
        use std::time::{Duration, Instant};
        let (a_addr, b_addr) = (SocketAddr::from((self.a.ipv4, 7999)), SocketAddr::from((self.b.ipv4, 7999)));
        let a = self.a.netns.run(move || UdpSocket::bind(a_addr))??;
        let b = self.b.netns.run(move || UdpSocket::bind(b_addr))??;
        for s in [&a, &b] {
            s.set_read_timeout(Some(Duration::from_millis(20)))?;
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut buf = [0u8; 8];
        for (from, to, to_addr) in [(&a, &b, b_addr), (&b, &a, a_addr)] {
            loop {
                from.send_to(b"warm", to_addr)?;
                if to.recv_from(&mut buf).is_ok() {
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(std::io::Error::other(
                        "datagrams do not cross the fresh veth pair within 3 s",
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn veth_pair_carries_ping_and_is_removed() {
        let pair = match VethPair::create() {
            Ok(p) => p,
            Err(skip) => {
                eprintln!("veth_pair_carries_ping_and_is_removed {skip}");
                return;
            }
        };
        // A UDP datagram from a to b crosses the veth (no external tools needed).
        let b_addr = std::net::SocketAddr::from((pair.b.ipv4, 7077));
        let rx = pair.b.netns.run(move || std::net::UdpSocket::bind(b_addr)).unwrap().unwrap();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        pair.a
            .netns
            .run(move || {
                let tx = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                tx.send_to(b"over the veth", b_addr).unwrap();
            })
            .unwrap();
        let mut buf = [0u8; 64];
        let (n, from) = rx.recv_from(&mut buf).expect("datagram crosses the veth");
        assert_eq!(&buf[..n], b"over the veth");
        assert_eq!(from.ip(), std::net::IpAddr::V4(pair.a.ipv4));
        // sysfs shows the mounting process's namespace, so ask ip for the address.
        let link = pair.b.netns.ip(&["-br", "link", "show", &pair.b.ifname]).unwrap();
        let link = String::from_utf8_lossy(&link.stdout);
        assert!(link.contains(&pair.b.mac.to_string()), "{link}");
        let names = [pair.a.netns.name().to_string(), pair.b.netns.name().to_string()];
        drop(pair);
        let list = String::from_utf8(ip(&["netns", "list"]).unwrap().stdout).unwrap();
        for n in names {
            assert!(!list.contains(&n), "{n} left behind");
        }
    }
}
