#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_vnet::local::fuzz_rings(data));
