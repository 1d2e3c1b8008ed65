#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_nvme::sgl::fuzz_walk(data));
