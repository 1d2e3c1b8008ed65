#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_nvme::command::fuzz_command(data));
