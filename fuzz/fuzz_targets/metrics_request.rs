#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_node::metrics::fuzz_request_line(data));
