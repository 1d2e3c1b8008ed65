//! Tagged point-to-point messages over lanbus transport channels, the messaging layer of MPI
//! over lanbus (the design of the MPI-over-DPDK paper: eager messages below a size limit,
//! rendezvous above it).
//!
//! Layer: messaging, sans-IO like the transport under it. An [`Engine`] is one endpoint,
//! addressed by its node's MAC and an id on that node ([`Addr`]). It matches arriving messages
//! against posted receives on (context, source, tag), with a wildcard source and a tag ignore
//! mask; what arrives first waits in the unexpected queue, and a receive posted later takes the
//! oldest match. Messages up to [`Config::eager_limit`] travel whole (EAGER); longer ones are
//! announced (RTS), and once a receive matches, the receiver asks for as many bytes as it holds
//! (CTS) and the sender sends them placed by offset (DATA). A message longer than its receive
//! is truncated and says so; nothing is written past a receive's capacity. Probe, claim (matched
//! probe) and cancel of posted receives work as in MPI; a send to the engine itself goes
//! straight to its own matching.
//!
//! The records ([`wire`]) ride one transport channel, [`MSG_CHANNEL`], between two nodes: the
//! transport delivers them reliably and in order, which is what MPI's ordering rule needs
//! (messages from one sender that one receive could match are received in the order sent).
//! The caller moves bytes: it hands each arriving message of that channel to
//! [`Engine::handle_message`] (a node with several engines dispatches on
//! [`wire::destination`]), sends what [`Engine::poll_transmit`] gives, and takes finished
//! requests from [`Engine::poll_completion`]. A peer that goes down fails the requests that
//! need it ([`Engine::peer_down`]).
#![deny(missing_docs)]

mod engine;
pub mod wire;

pub use engine::{
    Addr, Claim, Completion, Config, Counters, Engine, Failure, Match, Out, Outcome, Outgoing, RecvBuf,
    RequestId, RequestMap, SendBuf, Source, Status,
};

/// The transport channel messaging records ride.
pub const MSG_CHANNEL: u16 = 0x6000;
