//! Build-script helper for the crates with a `dpdk` feature (lanbus-port's DPDK port, lanbus-ring's
//! rte_ring shim): compiles a C shim against the system's DPDK with the flags `pkg-config --cflags
//! --libs libdpdk` gives, and links DPDK's libraries after it. Only build scripts use it; a missing
//! DPDK stops the build with a message that says what to install.
#![deny(missing_docs)]

use std::process::Command;

pub use cc;

/// What a machine without DPDK's development files needs.
pub const HOW_TO_FIX: &str = "the `dpdk` feature needs DPDK's development files: on Debian or Ubuntu \
    `apt-get install libdpdk-dev dpdk` (pkg-config and a C compiler too: `apt-get install pkg-config \
    gcc`), or build without `--features dpdk`";

/// Stops the build with a message cargo shows as is.
pub fn fail(msg: String) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1);
}

/// The words `pkg-config ARGS libdpdk` prints; stops the build if pkg-config or libdpdk is missing.
pub fn pkg_config(args: &[&str]) -> Vec<String> {
    let out = match Command::new("pkg-config").args(args).arg("libdpdk").output() {
        Ok(out) => out,
        Err(e) => fail(format!("cannot run pkg-config ({e}); {HOW_TO_FIX}")),
    };
    if !out.status.success() {
        fail(format!(
            "pkg-config {} libdpdk failed: {}; {HOW_TO_FIX}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_string).collect()
}

/// Compiles the C file `source` (relative to the crate) into the static library `lib_name` with
/// DPDK's compiler flags (`configure` may add the crate's own), then links DPDK's libraries after
/// it so the linker resolves the shim's references from them (rustc links with --as-needed, so
/// only what is used stays). Returns DPDK's version as pkg-config reports it.
pub fn compile_shim(source: &str, lib_name: &str, configure: impl FnOnce(&mut cc::Build)) -> String {
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_LIBDIR");
    let version = pkg_config(&["--modversion"]).join(" ");
    let cflags = pkg_config(&["--cflags"]);
    let libs = pkg_config(&["--libs"]);

    let mut build = cc::Build::new();
    build.file(source).warnings(true);
    configure(&mut build);
    let mut it = cflags.iter();
    while let Some(flag) = it.next() {
        if let Some(dir) = flag.strip_prefix("-I") {
            build.include(dir);
        } else if flag == "-include" {
            // `-include rte_config.h`: two words, one flag.
            if let Some(file) = it.next() {
                build.flag("-include").flag(file);
            }
        } else {
            build.flag(flag);
        }
    }
    build.compile(lib_name);

    for flag in &libs {
        if let Some(lib) = flag.strip_prefix("-l") {
            println!("cargo:rustc-link-lib=dylib={lib}");
        } else if let Some(dir) = flag.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
        }
        // `-Wl,--as-needed` and the like: rustc already links with --as-needed.
    }
    version
}
