//! `lanbus stack`: programs that use a running `lanbus stackd` (send and receive like `nc`,
//! through the client library).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use lanbus_stack::client::StackClient;
use lanbus_stack::CopyUnit;

/// Where `lanbus stackd` serves programs by default.
pub const STACK_SOCKET: &str = "/tmp/lanbus-stackd.sock";

/// Programs that use a running `lanbus stackd`.
#[derive(Debug, clap::Subcommand)]
pub enum StackCommand {
    /// Connects to IP:PORT through the stack, sends standard input (or --bytes of a pattern),
    /// shuts its side down, and writes what the peer sends to standard output until the peer
    /// closes (like `nc -N`).
    Send(SendArgs),
    /// Listens on PORT through the stack, accepts one connection and writes what arrives to
    /// standard output (or counts it with --discard), then prints what it received.
    Recv(RecvArgs),
}

/// Options every `lanbus stack` program takes.
#[derive(Debug, clap::Args)]
pub struct ClientArgs {
    /// The stack server's socket.
    #[arg(long, default_value = STACK_SOCKET)]
    socket: PathBuf,
    /// The copy unit: CLUSTER_BYTESxCLUSTERS[,socket] (e.g. 2048x16; `2048x1,socket` is the
    /// rump-kernel study's baseline: one 2 KiB cluster per request over the Unix socket).
    #[arg(long, default_value_t = CopyUnit::DEFAULT)]
    unit: CopyUnit,
    /// Bytes per read or write call of the program.
    #[arg(long, default_value_t = 128 * 1024)]
    buffer: usize,
}

/// Options of `lanbus stack send`.
#[derive(Debug, clap::Args)]
pub struct SendArgs {
    /// Where to connect: IP:PORT (an IPv6 address in brackets: [fd00::2]:80).
    to: SocketAddr,
    #[command(flatten)]
    client: ClientArgs,
    /// Send this many bytes of a fixed pattern (byte k of the stream is k mod 251) instead of
    /// standard input.
    #[arg(long)]
    bytes: Option<u64>,
    /// Send through a zero-copy connection: the bytes are read (or made) straight into the
    /// connection's send buffer, shared with the stack server, which sends them from there.
    #[arg(long)]
    zero_copy: bool,
}

/// Where `lanbus stack send` puts its bytes: `fill` writes at most the slice's length and says
/// how many it wrote (0: the end).
trait Sink {
    fn put(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>) -> std::io::Result<usize>;
}

/// The copying path: through the program's own buffer.
struct Copying<'a> {
    stream: &'a mut lanbus_stack::client::TcpStream,
    buf: Vec<u8>,
}

impl Sink for Copying<'_> {
    fn put(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>) -> std::io::Result<usize> {
        let n = fill(&mut self.buf)?;
        self.stream.write_all(&self.buf[..n])?;
        Ok(n)
    }
}

/// The zero-copy path: straight into the shared send buffer.
impl Sink for lanbus_stack::client::ZeroCopyStream {
    fn put(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> std::io::Result<usize>) -> std::io::Result<usize> {
        let room = self.reserve()?;
        let n = fill(room)?;
        self.commit(n)?;
        Ok(n)
    }
}

/// Sends standard input, or `bytes` of the pattern, through `sink`; returns the bytes sent.
fn send_all(sink: &mut dyn Sink, bytes: Option<u64>, max: usize) -> std::io::Result<u64> {
    let mut sent = 0u64;
    match bytes {
        Some(total) => {
            let pattern: Vec<u8> = (0..max + 251).map(|i| (i % 251) as u8).collect();
            while sent < total {
                let at = (sent % 251) as usize;
                sent += sink.put(&mut |buf| {
                    let n = ((total - sent) as usize).min(buf.len()).min(max);
                    buf[..n].copy_from_slice(&pattern[at..at + n]);
                    Ok(n)
                })? as u64;
            }
        }
        None => {
            let mut stdin = std::io::stdin().lock();
            loop {
                let n = sink.put(&mut |buf| loop {
                    let len = buf.len().min(max);
                    match stdin.read(&mut buf[..len]) {
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        other => return other,
                    }
                })?;
                if n == 0 {
                    break;
                }
                sent += n as u64;
            }
        }
    }
    Ok(sent)
}

/// Options of `lanbus stack recv`.
#[derive(Debug, clap::Args)]
pub struct RecvArgs {
    /// The TCP port to listen on.
    port: u16,
    #[command(flatten)]
    client: ClientArgs,
    /// Count the bytes instead of writing them out.
    #[arg(long)]
    discard: bool,
    /// Give up if no connection arrives within this many seconds.
    #[arg(long, default_value_t = 60)]
    accept_timeout: u64,
}

fn rate(bytes: u64, t: Duration) -> String {
    format!(
        "{bytes} bytes in {:.3} s ({:.1} Mbit/s)",
        t.as_secs_f64(),
        bytes as f64 * 8.0 / t.as_secs_f64().max(1e-9) / 1e6
    )
}

/// Runs a `lanbus stack` program.
pub fn run(cmd: StackCommand) -> anyhow::Result<()> {
    match cmd {
        StackCommand::Send(a) => {
            let client = StackClient::attach(&a.client.socket, a.client.unit)?;
            let max = a.client.buffer.max(1);
            let start = Instant::now();
            let connecting = || format!("connecting to {}", a.to);
            let (sent, mut reader): (u64, Box<dyn Read>) = if a.zero_copy {
                let mut stream = client.connect_zero_copy(a.to).with_context(connecting)?;
                let sent = send_all(&mut stream, a.bytes, max).context("sending")?;
                stream.shutdown_write()?;
                (sent, Box::new(stream))
            } else {
                let mut stream = client.connect(a.to).with_context(connecting)?;
                let mut sink = Copying { stream: &mut stream, buf: vec![0u8; max] };
                let sent = send_all(&mut sink, a.bytes, max).context("sending")?;
                stream.shutdown_write()?;
                (sent, Box::new(stream))
            };
            // Until the peer's close: the bytes are then delivered, not merely queued.
            let mut buf = vec![0u8; max];
            let mut out = std::io::stdout().lock();
            let mut got = 0u64;
            loop {
                let n = reader.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                out.write_all(&buf[..n])?;
                got += n as u64;
            }
            out.flush()?;
            eprintln!("lanbus stack send: sent {}; received {got} bytes", rate(sent, start.elapsed()));
            Ok(())
        }
        StackCommand::Recv(a) => {
            let client = StackClient::attach(&a.client.socket, a.client.unit)?;
            let listener =
                client.listen(a.port, 1).with_context(|| format!("listening on port {}", a.port))?;
            let (mut stream, peer) =
                listener.accept_timeout(Some(Duration::from_secs(a.accept_timeout))).with_context(|| {
                    format!("waiting {} s for a connection on port {}", a.accept_timeout, a.port)
                })?;
            drop(listener);
            let mut buf = vec![0u8; a.client.buffer.max(1)];
            let start = Instant::now();
            let mut got = 0u64;
            let mut out = std::io::stdout().lock();
            loop {
                let n = stream.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                if !a.discard {
                    out.write_all(&buf[..n])?;
                }
                got += n as u64;
            }
            out.flush()?;
            eprintln!("lanbus stack recv: from {peer}: {}", rate(got, start.elapsed()));
            Ok(())
        }
    }
}
