#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_port::afxdp::netlink::fuzz_netlink_ack(data));
