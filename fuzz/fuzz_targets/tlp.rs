#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_pcie::fuzz_tlp(data));
