//! A daemon's control socket: one server and one client, used by `lanbus status` and
//! `lanbus device-ctl`.
//!
//! Layer: assembly. The protocol is a Unix stream socket, one request per connection: the client
//! writes one line (`status`, `status json`, or on an I/O box `group N`), the daemon answers one
//! line (a JSON object for `status json`) and closes. A client that sends nothing is given up on
//! after two seconds; a line longer than 4 KiB is cut there. A stale socket file (no daemon
//! answers on it) is replaced when a daemon binds; a live one is refused.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use std::net::TcpListener;

use crate::metrics::{MetricsServer, Sample};
use crate::{Error, Result};

/// Default control socket of `lanbus device`.
pub const DEVICE_CONTROL: &str = "/tmp/lanbus-device.sock";
/// Default control socket of `lanbus host`.
pub const HOST_CONTROL: &str = "/tmp/lanbus-host.sock";
/// Default control socket of `lanbus stackd`.
pub const STACK_CONTROL: &str = "/tmp/lanbus-stackd.ctl";

/// The longest request line read.
const MAX_LINE: u64 = 4096;

/// What answers a daemon's control lines.
pub type Answer = dyn Fn(&str) -> String + Send + Sync;

/// A control socket served on a thread of its own until stopped or dropped; the socket file is
/// removed then.
pub struct ControlServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Binds `path` (replacing a stale socket, refusing one a live daemon answers on) and serves
    /// it: each request line gets `answer(line)`.
    pub fn start(path: &Path, answer: Arc<Answer>) -> Result<ControlServer> {
        ControlServer::start_on(bind(path)?, path, answer)
    }

    /// Serves `listener`, bound at `path` by [`bind`] (before anything else started, so that a
    /// socket in use fails early), with `answer`.
    pub fn start_on(listener: UnixListener, path: &Path, answer: Arc<Answer>) -> Result<ControlServer> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("lanbus-control".into())
            .spawn(move || serve(&listener, &flag, &*answer))
            .map_err(|e| Error::Io { what: "starting the control thread".into(), source: e })?;
        Ok(ControlServer { path: path.to_path_buf(), stop, thread: Some(thread) })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops serving and removes the socket file.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        // Relaxed: the flag only asks the loop to end; the join below orders the rest.
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.halt();
    }
}

/// A daemon that answers control lines and gives its counters.
pub trait Daemon: Send + Sync + 'static {
    /// The answer to one control line.
    fn answer(&self, line: &str) -> String;
    /// Every counter, as the metrics endpoint serves them.
    fn samples(&self) -> Vec<Sample>;
}

/// A daemon's control socket and, if asked for, its metrics endpoint, served until closed.
pub struct Endpoints {
    control: ControlServer,
    metrics: Option<MetricsServer>,
}

impl Endpoints {
    /// Serves `daemon` on `control` (bound at `path` by [`bind`]) and on `metrics` (bound by
    /// [`MetricsServer::bind`]).
    pub fn open<D: Daemon>(
        daemon: Arc<D>,
        control: UnixListener,
        path: &Path,
        metrics: Option<TcpListener>,
    ) -> Result<Endpoints> {
        let d = daemon.clone();
        let control = ControlServer::start_on(control, path, Arc::new(move |l: &str| d.answer(l)))?;
        let metrics =
            metrics.map(|l| MetricsServer::start(l, Arc::new(move || daemon.samples()))).transpose()?;
        Ok(Endpoints { control, metrics })
    }

    /// Stops serving both and removes the control socket file.
    pub fn close(self) {
        drop(self.metrics);
        self.control.stop();
    }
}

/// Binds a control socket, replacing a stale one (refusing one a live daemon answers on).
pub fn bind(path: &Path) -> Result<UnixListener> {
    let io = |what: String| move |source| Error::Io { what, source };
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(Error::InUse(format!(
                "{} is in use by another daemon: give this one --control PATH",
                path.display()
            )));
        }
        std::fs::remove_file(path).map_err(io(format!("removing stale {}", path.display())))?;
    }
    let l = UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))?;
    l.set_nonblocking(true).map_err(io(format!("setting up {}", path.display())))?;
    Ok(l)
}

/// Serves `listener` until `stop`: each request line gets `answer(line)`.
pub fn serve(listener: &UnixListener, stop: &AtomicBool, answer: &Answer) {
    // Relaxed: a flag polled every 50 ms; nothing else is published through it.
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((s, _)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                let mut line = String::new();
                if BufReader::new((&s).take(MAX_LINE)).read_line(&mut line).is_ok() {
                    let v = answer(line.trim());
                    let _ = (&s).write_all(format!("{}\n", v.trim_end()).as_bytes());
                }
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Sends one line to the daemon at `path` and returns its answer (without the newline).
pub fn ask(path: &Path, line: &str) -> Result<String> {
    let io = |what: &str| {
        let what = format!("{what} {}", path.display());
        move |source| Error::Io { what, source }
    };
    let mut s = UnixStream::connect(path).map_err(io("connecting to"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(io("setting up"))?;
    writeln!(s, "{line}").map_err(io("writing to"))?;
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply).map_err(io("reading from"))?;
    Ok(reply.trim_end().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_each_line_and_removes_its_socket() {
        let dir = std::env::temp_dir().join(format!("lanbus-control-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ctl.sock");
        let server = ControlServer::start(&path, Arc::new(|l: &str| format!("got {l}"))).unwrap();
        assert_eq!(ask(&path, "status").unwrap(), "got status");
        assert_eq!(ask(&path, "  group 3 ").unwrap(), "got group 3");
        // A second daemon on the same socket is refused while the first answers.
        assert!(matches!(bind(&path), Err(Error::InUse(_))));
        // A client that connects and says nothing costs the server one bounded read.
        drop(UnixStream::connect(&path).unwrap());
        assert_eq!(ask(&path, "x").unwrap(), "got x");
        server.stop();
        assert!(!path.exists());
        // A stale socket file is replaced.
        let stale = UnixListener::bind(&path).unwrap();
        drop(stale);
        let server = ControlServer::start(&path, Arc::new(|_: &str| "ok".into())).unwrap();
        assert_eq!(ask(&path, "status").unwrap(), "ok");
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
