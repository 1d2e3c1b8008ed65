#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_port::spec::fuzz_spec(data));
