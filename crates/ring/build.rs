//! Build script: with the `dpdk` feature, compiles `dpdk/rte_ring_shim.c` against the system's DPDK
//! (through `lanbus-dpdk-build`) and links it. Without the feature it does nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "dpdk")]
    lanbus_dpdk_build::compile_shim("dpdk/rte_ring_shim.c", "lanbus_rte_ring_shim", |b| {
        b.opt_level(3);
    });
}
