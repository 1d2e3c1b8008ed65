//! A daemon's fabric key: read from its file, put between the port and the transport as the
//! authentication layer (`lanbus_secure::SecurePort`), read again on request (`SIGHUP`, a
//! rotation step), and shown in status output. Key ids are public and shown; secrets never are.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use lanbus_port::Port;
use lanbus_secure::{KeyRing, Keys, SecurePort, SecurityReport, SecurityView};
use serde_json::{json, Value};

use crate::Result;

/// What a daemon without a key says once at start.
pub const OPEN_FABRIC: &str = "no fabric key: the fabric is open, and any machine on the segment can join it and \
                               reach this node's devices (make a key with `lanbus keygen FILE`, give every member \
                               --key FILE)";

/// A daemon's keys and the layer they seal its port with.
#[derive(Debug)]
pub struct Keyed {
    path: Option<PathBuf>,
    keys: Arc<Keys>,
    encrypt: bool,
    view: Mutex<Option<SecurityView>>,
}

impl Keyed {
    /// Reads the key file at `path` (refused if others may read it).
    pub fn open(path: &Path, encrypt: bool) -> Result<Keyed> {
        let ring = KeyRing::read(path)?;
        Ok(Keyed { path: Some(path.into()), keys: Keys::new(ring), encrypt, view: Mutex::new(None) })
    }

    /// Keys held in memory only (`lanbus demo`'s own random key, tests).
    pub fn in_memory(ring: KeyRing, encrypt: bool) -> Keyed {
        Keyed { path: None, keys: Keys::new(ring), encrypt, view: Mutex::new(None) }
    }

    /// The shared key ring (to rotate it in memory).
    pub fn keys(&self) -> &Arc<Keys> {
        &self.keys
    }

    /// `port` behind the authentication layer. The last port wrapped is the one whose report
    /// [`Keyed::view`] gives.
    pub fn wrap(&self, port: Box<dyn Port>) -> Box<dyn Port> {
        let secure = SecurePort::new(port, self.keys.clone(), self.encrypt);
        *self.view.lock().unwrap_or_else(|e| e.into_inner()) = Some(secure.view());
        Box::new(secure)
    }

    /// The layer's report, once a port is wrapped.
    pub fn view(&self) -> Option<SecurityView> {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reads the key file again and hands the new ring to the layer; returns what it holds now.
    /// An unreadable or malformed file leaves the keys as they were.
    pub fn reload(&self) -> Result<String> {
        if let Some(path) = &self.path {
            self.keys.replace(KeyRing::read(path)?);
        }
        Ok(self.describe())
    }

    /// One line: the key sent under, those also accepted, and what is sealed.
    pub fn describe(&self) -> String {
        let ids = self.keys.ring().ids();
        let also: Vec<String> = ids[1..].iter().map(ToString::to_string).collect();
        format!(
            "fabric key {}{}; frames {}",
            ids[0],
            if also.is_empty() { String::new() } else { format!(" (also accepting {})", also.join(", ")) },
            if self.encrypt { "authenticated and encrypted" } else { "authenticated" }
        )
    }
}

/// A layer's report as JSON (status output).
pub fn report_json(r: &SecurityReport) -> Value {
    let rejected = |x: &lanbus_secure::Rejected| {
        json!({
            "unsealed": x.unsealed, "bad_tag": x.bad_tag, "replay": x.replay, "stale_epoch": x.stale_epoch,
            "no_session": x.no_session, "unknown_key": x.unknown_key, "bad_handshake": x.bad_handshake,
        })
    };
    let c = &r.counters;
    json!({
        "mode": if r.encrypt { "encrypt" } else { "auth" },
        "keys": r.key_ids.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "sealed": c.sealed,
        "opened": c.opened,
        "handshakes_started": c.handshakes_started,
        "sessions_established": c.sessions_established,
        "tx_waiting_for_handshake": c.tx_waiting,
        "held_for_handshake": c.held_for_handshake,
        "stale_handshakes": c.stale_handshakes,
        "drop_other_group": c.drop_other_group,
        "rejected": rejected(&c.rejected),
        "peers": r.peers.iter().map(|p| json!({
            "mac": p.mac.to_string(),
            "state": p.state.name(),
            "key": p.key_id.map(|k| k.to_string()),
            "suite": p.suite.map(|s| s.name()),
            "rejected": rejected(&p.rejected),
        })).collect::<Vec<_>>(),
    })
}

/// The `security` member of a daemon's status: the layer's report, or that the fabric is open.
pub fn status_json(view: Option<&SecurityView>) -> Value {
    match view {
        Some(v) => report_json(&v.report()),
        None => json!({"mode": "open"}),
    }
}
