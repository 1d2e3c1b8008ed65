#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_msg::wire::fuzz_record(data));
