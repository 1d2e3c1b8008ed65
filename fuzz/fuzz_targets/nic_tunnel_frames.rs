#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_bench::nic_tunnel::fuzz_receive(data));
