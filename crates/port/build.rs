//! Build script: with the `dpdk` feature, compiles `dpdk/shim.c` against the system's DPDK (through
//! `lanbus-dpdk-build`), links DPDK and records its version in `LANBUS_DPDK_VERSION`. Without the
//! feature it does nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "dpdk")]
    {
        let version = lanbus_dpdk_build::compile_shim("dpdk/shim.c", "lanbus_dpdk_shim", |b| {
            b.flag_if_supported("-Wno-unused-parameter");
        });
        println!("cargo:rustc-env=LANBUS_DPDK_VERSION={version}");
    }
}
