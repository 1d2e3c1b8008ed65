#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_vhost::net::fuzz_frames(data));
