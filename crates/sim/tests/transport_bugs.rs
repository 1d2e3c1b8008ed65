//! Transport weaknesses the simulator found, as minimal tests. Ignored so the workspace stays
//! green; run with `cargo test -p lanbus-sim --test transport_bugs -- --ignored`, and un-ignore
//! once the transport is fixed.

use lanbus_transport::{Config, Endpoint};
use lanbus_wire::{Instant, MacAddr};

/// The frame checksum is a ones'-complement sum of 32-bit words, which cannot see two flipped
/// bits that cancel: the same bit of the same byte lane going 0→1 in one word and 1→0 in another.
/// The simulated wire flips 1..3 random bits per corrupted frame, and such pairs get through
/// (`lanbus sim transfer --messages 100000 --loss 0.05 --reorder 0.02 --duplicate 0.01
/// --corrupt 0.001 --seed 5` delivers 2 corrupted messages). Ethernet's CRC-32 detects every
/// 1-, 2- and 3-bit error in frames of this size; a CRC-32C would here too.
#[test]
#[ignore = "transport bug: ones'-complement frame checksum misses cancelling bit pairs"]
fn two_cancelling_bit_flips_are_caught() {
    let (a_mac, b_mac) = (MacAddr([2, 0, 0, 0, 0, 1]), MacAddr([2, 0, 0, 0, 0, 2]));
    let now = Instant::ZERO;
    let mut a = Endpoint::new(Config::point_to_point(), a_mac, now);
    let mut b = Endpoint::new(Config::point_to_point(), b_mac, now);
    let message = [0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff];
    a.send(now, b_mac, 0, &message).unwrap();
    let mut frame = vec![0u8; a.config().frame_capacity()];
    let len = a.poll_transmit(now, &mut frame).unwrap();
    frame.truncate(len);
    let at = frame.windows(8).position(|w| w == message).expect("message bytes in the frame");
    // Bit 0 of the first message byte goes 0 -> 1, bit 0 of the byte four later (same lane of the
    // 32-bit sum) goes 1 -> 0: the sum does not change.
    frame[at] ^= 1;
    frame[at + 4] ^= 1;
    b.handle_frame(now, &frame);
    if let Some(m) = b.poll_message() {
        assert_eq!(m.data, &message[..], "a corrupted message was delivered");
    }
}
