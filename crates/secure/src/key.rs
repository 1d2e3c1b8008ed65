//! Fabric keys: the 256-bit secret every member of a keyed fabric holds, the file it lives in,
//! and the ring of keys a node sends under and accepts.
//!
//! A key file is text, one key per line, the first the one this node sends under, every one
//! accepted from peers:
//!
//! ```text
//! # lanbus fabric keys: the first is sent under, every one is accepted. Keep secret.
//! key 1f2e3d4c 6b1d...(64 hex digits)
//! ```
//!
//! Rotation is three edits of that file, each followed by `SIGHUP` (or a restart) on every member
//! in its own time: append the new key (accepted only), move it to the top (sent under), remove
//! the old one. Invariants: a file that anyone but its owner may read is refused; secrets are
//! zeroized when dropped and never formatted (`Debug` prints the id only).

use std::fmt;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use zeroize::{Zeroize as _, Zeroizing};

/// Bytes of a fabric key's secret.
pub const KEY_LEN: usize = 32;

/// The public name of a fabric key: 32 bits drawn when the key is made, carried in handshakes and
/// broadcast frames so that a receiver knows which of its keys to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(pub u32);

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:08x}", self.0)
    }
}

impl std::str::FromStr for KeyId {
    type Err = String;
    fn from_str(s: &str) -> Result<KeyId, String> {
        if s.len() != 8 {
            return Err(format!("a key id is 8 hex digits, not {s:?}"));
        }
        u32::from_str_radix(s, 16).map(KeyId).map_err(|_| format!("a key id is 8 hex digits, not {s:?}"))
    }
}

/// A fabric key: its id and its secret. The secret is zeroized on drop and never printed.
#[derive(Clone)]
pub struct FabricKey {
    id: KeyId,
    secret: Zeroizing<[u8; KEY_LEN]>,
}

impl fmt::Debug for FabricKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FabricKey({})", self.id)
    }
}

/// Why a key file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The file could not be read or written.
    #[error("key file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Others than its owner may read or write the file: its secret may be known.
    #[error(
        "key file {path} has mode {mode:04o}: others may read it, so it is refused (chmod 600 {path} and \
         make a new key if it may have been read)"
    )]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The file's text is not a key file.
    #[error("key file {path}, line {line}: {why}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The line (from 1; 0 for the file as a whole).
        line: usize,
        /// What is wrong.
        why: String,
    },
    /// `keygen` would overwrite an existing file.
    #[error("key file {path} exists: give another path, or --add to append a key to it")]
    Exists {
        /// The file.
        path: PathBuf,
    },
}

impl FabricKey {
    /// A key from its id and secret (test vectors, the simulator's fixed keys).
    pub fn from_parts(id: KeyId, secret: [u8; KEY_LEN]) -> FabricKey {
        FabricKey { id, secret: Zeroizing::new(secret) }
    }

    /// A new key from the system's random source.
    pub fn generate() -> FabricKey {
        let mut bytes = Zeroizing::new([0u8; KEY_LEN + 4]);
        crate::entropy::system_fill(&mut bytes[..]);
        let mut secret = Zeroizing::new([0u8; KEY_LEN]);
        secret.copy_from_slice(&bytes[..KEY_LEN]);
        let id = u32::from_be_bytes(bytes[KEY_LEN..].try_into().expect("4 bytes"));
        FabricKey { id: KeyId(id), secret }
    }

    /// The key's public id.
    pub fn id(&self) -> KeyId {
        self.id
    }

    pub(crate) fn secret(&self) -> &[u8; KEY_LEN] {
        &self.secret
    }
}

/// The keys of one node: the one it sends under (first) and every one it accepts.
#[derive(Debug, Clone)]
pub struct KeyRing {
    keys: Vec<FabricKey>,
}

impl KeyRing {
    /// A ring that sends under `send` and also accepts `accepted`. Duplicate ids are dropped (the
    /// first of an id is kept).
    pub fn new(send: FabricKey, accepted: impl IntoIterator<Item = FabricKey>) -> KeyRing {
        let mut keys = vec![send];
        for k in accepted {
            if keys.iter().all(|have| have.id != k.id) {
                keys.push(k);
            }
        }
        KeyRing { keys }
    }

    /// The key this node sends under.
    pub fn send_key(&self) -> &FabricKey {
        &self.keys[0]
    }

    /// The accepted key with this id.
    pub fn find(&self, id: KeyId) -> Option<&FabricKey> {
        self.keys.iter().find(|k| k.id == id)
    }

    /// The ids of every key, the send key first.
    pub fn ids(&self) -> Vec<KeyId> {
        self.keys.iter().map(|k| k.id).collect()
    }

    /// Reads a key file (see the module docs), refusing one that others may read.
    pub fn read(path: &Path) -> Result<KeyRing, KeyError> {
        let io = |source| KeyError::Io { path: path.into(), source };
        let meta = std::fs::metadata(path).map_err(io)?;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(KeyError::Exposed { path: path.into(), mode });
        }
        let text = Zeroizing::new(std::fs::read_to_string(path).map_err(io)?);
        KeyRing::parse(&text).map_err(|(line, why)| KeyError::Malformed { path: path.into(), line, why })
    }

    /// Parses a key file's text; on error, the line (from 1) and what is wrong.
    pub fn parse(text: &str) -> Result<KeyRing, (usize, String)> {
        let mut keys: Vec<FabricKey> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some("key"), Some(id), Some(secret), None) =
                (words.next(), words.next(), words.next(), words.next())
            else {
                return Err((i + 1, "expected `key <8 hex digits of id> <64 hex digits of secret>`".into()));
            };
            let id: KeyId = id.parse().map_err(|e| (i + 1, e))?;
            let secret = parse_secret(secret).ok_or((i + 1, "the secret is 64 hex digits".to_string()))?;
            if keys.iter().any(|k| k.id == id) {
                return Err((i + 1, format!("key {id} appears twice")));
            }
            keys.push(FabricKey { id, secret });
        }
        if keys.is_empty() {
            return Err((0, "no key in the file (make one with `lanbus keygen FILE`)".into()));
        }
        Ok(KeyRing { keys })
    }

    /// The file text of this ring (secrets included: write it only to a file of mode 0600).
    fn to_text(&self) -> Zeroizing<String> {
        let mut text = Zeroizing::new(String::from(
            "# lanbus fabric keys: the first is sent under, every one is accepted. Keep this file secret.\n",
        ));
        for k in &self.keys {
            text.push_str(&format!("key {} ", k.id));
            for b in k.secret.iter() {
                text.push_str(&format!("{b:02x}"));
            }
            text.push('\n');
        }
        text
    }

    /// Writes the ring to `path` with mode 0600: a new file unless `replace`, in which case the
    /// file is replaced atomically (written beside it, then renamed over it).
    pub fn write(&self, path: &Path, replace: bool) -> Result<(), KeyError> {
        let io = |source| KeyError::Io { path: path.into(), source };
        let target = if replace {
            let mut t = path.as_os_str().to_owned();
            t.push(".new");
            PathBuf::from(t)
        } else {
            path.to_path_buf()
        };
        if replace {
            let _ = std::fs::remove_file(&target);
        }
        let mut file =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&target).map_err(
                |e| {
                    if e.kind() == std::io::ErrorKind::AlreadyExists && !replace {
                        KeyError::Exists { path: path.into() }
                    } else {
                        io(e)
                    }
                },
            )?;
        file.write_all(self.to_text().as_bytes()).and_then(|()| file.sync_all()).map_err(io)?;
        if replace {
            std::fs::rename(&target, path).map_err(io)?;
        }
        Ok(())
    }

    /// Appends a key (accepted, not sent under).
    pub fn add(&mut self, key: FabricKey) {
        if self.find(key.id).is_none() {
            self.keys.push(key);
        }
    }

    /// Makes key `id` the one sent under; false if the ring lacks it.
    pub fn promote(&mut self, id: KeyId) -> bool {
        let Some(i) = self.keys.iter().position(|k| k.id == id) else { return false };
        let k = self.keys.remove(i);
        self.keys.insert(0, k);
        true
    }

    /// Removes key `id`. Refused (false) for the key sent under or one the ring lacks.
    pub fn remove(&mut self, id: KeyId) -> bool {
        match self.keys.iter().position(|k| k.id == id) {
            Some(i) if i > 0 => {
                self.keys.remove(i);
                true
            }
            _ => false,
        }
    }
}

fn parse_secret(hex: &str) -> Option<Zeroizing<[u8; KEY_LEN]>> {
    if hex.len() != 2 * KEY_LEN || !hex.is_ascii() {
        return None;
    }
    let mut secret = Zeroizing::new([0u8; KEY_LEN]);
    for (i, b) in secret.iter_mut().enumerate() {
        let Ok(v) = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16) else {
            secret.zeroize();
            return None;
        };
        *b = v;
    }
    Some(secret)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_through_a_file_of_mode_0600() {
        let dir = std::env::temp_dir().join(format!("lanbus-key-test-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("fabric.key");
        let _ = std::fs::remove_file(&path);
        let mut ring = KeyRing::new(FabricKey::generate(), []);
        ring.write(&path, false).unwrap();
        assert!(matches!(ring.write(&path, false), Err(KeyError::Exists { .. })));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let next = FabricKey::generate();
        ring.add(next.clone());
        ring.write(&path, true).unwrap();
        let back = KeyRing::read(&path).unwrap();
        assert_eq!(back.ids(), ring.ids());
        assert_eq!(back.find(next.id()).unwrap().secret(), next.secret());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = KeyRing::read(&path).unwrap_err();
        assert!(matches!(err, KeyError::Exposed { mode: 0o644, .. }), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let k = FabricKey::from_parts(KeyId(0x0102_0304), [0xc7; KEY_LEN]);
        let shown = format!("{k:?} {:?}", KeyRing::new(k.clone(), []));
        assert!(!shown.contains("c7c7"), "{shown}");
        assert!(shown.contains("01020304"));
    }

    #[test]
    fn rotation_steps_edit_the_ring() {
        let (a, b) = (FabricKey::from_parts(KeyId(1), [1; 32]), FabricKey::from_parts(KeyId(2), [2; 32]));
        let mut ring = KeyRing::new(a, []);
        ring.add(b);
        assert_eq!(ring.ids(), [KeyId(1), KeyId(2)]);
        assert!(!ring.remove(KeyId(1)), "the key sent under is not removed");
        assert!(ring.promote(KeyId(2)));
        assert!(ring.remove(KeyId(1)));
        assert_eq!(ring.ids(), [KeyId(2)]);
    }

    proptest! {
        #[test]
        fn any_text_parses_or_says_which_line(text in ".{0,300}") {
            if let Err((line, why)) = KeyRing::parse(&text) {
                prop_assert!(line <= text.lines().count());
                prop_assert!(!why.is_empty());
            }
        }

        #[test]
        fn written_text_parses_back(ids in proptest::collection::btree_set(any::<u32>(), 1..5), fill in any::<u8>()) {
            let keys: Vec<_> = ids.iter().map(|&i| FabricKey::from_parts(KeyId(i), [fill ^ i as u8; 32])).collect();
            let ring = KeyRing::new(keys[0].clone(), keys[1..].iter().cloned());
            let back = KeyRing::parse(&ring.to_text()).unwrap();
            prop_assert_eq!(back.ids(), ring.ids());
        }
    }
}
