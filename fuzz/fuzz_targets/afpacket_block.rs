#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_port::afpacket::fuzz_rx_block(data));
