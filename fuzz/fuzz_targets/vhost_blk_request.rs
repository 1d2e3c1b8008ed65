#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_vhost::blk::fuzz_request(data));
