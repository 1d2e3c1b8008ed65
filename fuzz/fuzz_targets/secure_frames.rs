#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_secure::fuzz_frames(data));
