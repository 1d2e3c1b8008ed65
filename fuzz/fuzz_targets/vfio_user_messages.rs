#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_vhost::vfio_user::fuzz_messages(data));
