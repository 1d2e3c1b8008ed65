#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_wire::frame::fuzz_lanbus_frame(data));
