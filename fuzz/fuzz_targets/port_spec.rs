#![no_main]
// Any bytes as a port spec: parsing never panics, every error explains itself, and a spec that
// parses comes back the same from its canonical text.
libfuzzer_sys::fuzz_target!(|data: &[u8]| lanbus_port::spec::fuzz_spec(data));
