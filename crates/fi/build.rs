//! Builds the provider's C tables (libfabric's objects and entry point) where libfabric's
//! headers are installed (Debian: libfabric-dev); without them the crate builds without the
//! provider and says so.

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=c/provider.c");
    // Installing libfabric-dev after a first build must bring the provider in: cargo looks at the
    // header again (and, while it is missing, runs this script on every build).
    println!("cargo:rerun-if-changed=/usr/include/rdma/fabric.h");
    println!("cargo:rustc-check-cfg=cfg(libfabric)");
    if !Path::new("/usr/include/rdma/fabric.h").exists() {
        println!(
            "cargo:warning=libfabric-dev is not installed: liblanbus_fi.so is built without the provider"
        );
        return;
    }
    // The tables' stubs take the parameters their slots declare and use none.
    cc::Build::new()
        .file("c/provider.c")
        .warnings(true)
        .extra_warnings(true)
        .flag("-Wno-unused-parameter")
        .compile("lanbus_fi_tables");
    println!("cargo:rustc-link-lib=dylib=fabric");
    println!("cargo:rustc-cfg=libfabric");
}
