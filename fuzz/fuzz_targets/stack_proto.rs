#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_stack::proto::fuzz_parse(data));
