#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_ring::fuzz_shared_region(data));
