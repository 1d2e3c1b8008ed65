//! Transport layer, internal: the (peer MAC, channel id) → index map both halves use on the hot
//! path. Invariant: an index, once handed out, names the same channel for the endpoint's life.
//!
//! The key packs the 48-bit MAC and the 16-bit channel into one `u64`, hashed with one multiply
//! (keys come from peers, but a peer can only choose among its own channels and MAC, and the map
//! is bounded by `max_channels`, so flooding buys an attacker nothing beyond that bound).

use std::collections::HashMap;

use lanbus_wire::hash::BuildIdHasher;
use lanbus_wire::MacAddr;

pub(crate) fn key(peer: MacAddr, channel: u16) -> u64 {
    let m = peer.0;
    u64::from_be_bytes([m[0], m[1], m[2], m[3], m[4], m[5], 0, 0]) | u64::from(channel)
}

pub(crate) type ChannelMap = HashMap<u64, usize, BuildIdHasher>;
