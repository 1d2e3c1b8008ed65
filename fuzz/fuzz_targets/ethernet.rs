#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_wire::ethernet::fuzz_frame(data));
