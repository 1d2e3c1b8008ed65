#!/usr/bin/env python3
"""The keyed fabric's key derivations and sealed frames, computed with Python's `cryptography`
package: an implementation independent of lanbus's (AWS-LC through aws-lc-rs).

  vectors.py --write   prints the vectors as JSON (how tests/vectors.json was made)
  vectors.py FILE      checks FILE against this computation; exit status 0 if every value agrees
"""
import json
import sys

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

FABRIC_SALT = b"lanbus fabric v1"
KEY_ID = 0x01020304
SECRET = bytes(range(32))
MAC_I = bytes.fromhex("020000000001")
MAC_R = bytes.fromhex("020000000002")


def hkdf(salt, ikm, info, length):
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


def be(n, size):
    return n.to_bytes(size, "big")


def frame(flags, payload):
    """A DATA frame from MAC_I to MAC_R: Ethernet header, lanbus header (the checksum field holds
    the receiver's session id), payload."""
    eth = MAC_R + MAC_I + be(0x88B5, 2)
    hdr = bytes([2, 1, flags, 0]) + be(7, 2) + be(1, 2) + be(42, 4) + be(0, 4) + be(0, 4) + be(0, 4)
    hdr += be(len(payload), 2) + be(0, 2) + be(0xBBBBBBBB, 4) + be(0x11111111, 4) + be(0x22222222, 4)
    return eth + hdr + payload


def vectors():
    handshake = hkdf(FABRIC_SALT, SECRET, b"lanbus handshake v1", 32)
    broadcast = hkdf(FABRIC_SALT, SECRET, b"lanbus broadcast v1" + be(7, 2) + MAC_I + be(0x11223344, 4), 32)
    nonce_i, nonce_r = bytes(range(0x40, 0x60)), bytes(range(0x80, 0xA0))
    out = {}
    for suite in (1, 2):
        info = (b"lanbus session v1" + MAC_I + MAC_R + be(0x11111111, 4) + be(0x22222222, 4)
                + be(0xAAAAAAAA, 4) + be(0xBBBBBBBB, 4) + bytes([suite]))
        keys = hkdf(nonce_i + nonce_r, SECRET, info, 64)
        aead = (AESGCM if suite == 1 else ChaCha20Poly1305)(keys[:32])
        nonce = bytes(4) + be(5, 8)
        authed = frame(0x10, b"lanbus!!")
        tag = aead.encrypt(nonce, b"", authed)
        sealed = frame(0x30, b"lanbus!!")
        ct = aead.encrypt(nonce, sealed[54:], sealed[:54])
        out[f"suite{suite}"] = {
            "session_keys": keys.hex(),
            "auth_frame": authed.hex(),
            "auth_tag": tag.hex(),
            "encrypt_frame": sealed.hex(),
            "encrypt_ciphertext_and_tag": ct.hex(),
        }
    return {
        "provenance": "computed by crates/secure/tests/vectors.py with Python's cryptography package",
        "fabric_key": {"id": f"{KEY_ID:08x}", "secret": SECRET.hex()},
        "handshake_key": handshake.hex(),
        "broadcast": {"group": 7, "sender": MAC_I.hex(), "epoch": 0x11223344, "key": broadcast.hex()},
        "session": {
            "initiator": MAC_I.hex(), "responder": MAC_R.hex(),
            "initiator_epoch": 0x11111111, "responder_epoch": 0x22222222,
            "initiator_session": 0xAAAAAAAA, "responder_session": 0xBBBBBBBB,
            "initiator_nonce": nonce_i.hex(), "responder_nonce": nonce_r.hex(), "counter": 5,
            **out,
        },
    }


def main():
    if sys.argv[1:] == ["--write"]:
        print(json.dumps(vectors(), indent=2))
        return 0
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        want = json.load(f)
    got = vectors()
    if got != want:
        print("vectors differ from", sys.argv[1], file=sys.stderr)
        return 1
    print("all vectors reproduced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
