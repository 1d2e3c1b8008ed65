//! The key derivations and sealed frames against vectors computed by an independent
//! implementation (`vectors.py`, Python's `cryptography` package), and that script run again
//! where Python has the package.

use lanbus_secure::kdf::{self, SealKey, SessionParams, Suite};
use lanbus_secure::{FabricKey, KeyId};
use lanbus_wire::MacAddr;
use serde_json::Value;

fn hex(s: &Value) -> Vec<u8> {
    let s = s.as_str().expect("a hex string");
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn vectors() -> Value {
    serde_json::from_str(include_str!("vectors.json")).expect("vectors.json")
}

#[test]
fn derivations_and_seals_match_the_independent_vectors() {
    let v = vectors();
    let secret: [u8; 32] = hex(&v["fabric_key"]["secret"]).try_into().unwrap();
    let key = FabricKey::from_parts(KeyId(0x0102_0304), secret);
    assert_eq!(&kdf::handshake_key_bytes(&key)[..], hex(&v["handshake_key"]));
    let b = &v["broadcast"];
    let sender = MacAddr(hex(&b["sender"]).try_into().unwrap());
    let got = kdf::broadcast_key_bytes(
        &key,
        b["group"].as_u64().unwrap() as u16,
        sender,
        b["epoch"].as_u64().unwrap() as u32,
    );
    assert_eq!(&got[..], hex(&b["key"]));
    let s = &v["session"];
    let n = |f: &str| s[f].as_u64().unwrap() as u32;
    for (name, suite) in [("suite1", Suite::Aes256Gcm), ("suite2", Suite::ChaCha20Poly1305)] {
        let p = SessionParams {
            initiator: MacAddr(hex(&s["initiator"]).try_into().unwrap()),
            responder: MacAddr(hex(&s["responder"]).try_into().unwrap()),
            initiator_epoch: n("initiator_epoch"),
            responder_epoch: n("responder_epoch"),
            initiator_session: n("initiator_session"),
            responder_session: n("responder_session"),
            initiator_nonce: hex(&s["initiator_nonce"]).try_into().unwrap(),
            responder_nonce: hex(&s["responder_nonce"]).try_into().unwrap(),
            suite,
        };
        let keys = kdf::session_key_bytes(&key, &p);
        let want = &s[name];
        assert_eq!(&keys[..], hex(&want["session_keys"]), "{name}");
        let seal = SealKey::new(suite, keys[..32].try_into().unwrap());
        let counter = s["counter"].as_u64().unwrap();
        let frame = hex(&want["auth_frame"]);
        assert_eq!(seal.seal(counter, &frame, &mut []).to_vec(), hex(&want["auth_tag"]), "{name} auth");
        let mut frame = hex(&want["encrypt_frame"]);
        let (head, body) = frame.split_at_mut(54);
        let tag = seal.seal(counter, head, body);
        let mut got = body.to_vec();
        got.extend_from_slice(&tag);
        assert_eq!(got, hex(&want["encrypt_ciphertext_and_tag"]), "{name} encrypt");
    }
}

#[test]
fn python_reproduces_the_vectors() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests");
    // Debian's python3 with python3-cryptography (scripts/setup installs it).
    let python = "/usr/bin/python3";
    let have = std::process::Command::new(python).args(["-c", "import cryptography"]).output();
    if !have.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: {python} has no cryptography package (apt install python3-cryptography)");
        return;
    }
    let out = std::process::Command::new(python)
        .arg(format!("{dir}/vectors.py"))
        .arg(format!("{dir}/vectors.json"))
        .output()
        .expect("running vectors.py");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
