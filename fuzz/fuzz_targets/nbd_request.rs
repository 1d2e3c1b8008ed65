#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_nbd::fuzz_request(data));
