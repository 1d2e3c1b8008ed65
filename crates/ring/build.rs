//! Build script: with the `dpdk` feature, compiles `dpdk/rte_ring_shim.c` against the system's DPDK
//! (flags from `pkg-config --cflags --libs libdpdk`) and links it. Without the feature it does
//! nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "dpdk")]
    dpdk::build();
}

#[cfg(feature = "dpdk")]
mod dpdk {
    use std::process::Command;

    const HOW_TO_FIX: &str = "the `dpdk` feature needs DPDK's development files: on Debian or Ubuntu \
        `apt-get install libdpdk-dev` (pkg-config and a C compiler too: `apt-get install pkg-config \
        gcc`), or build without `--features dpdk`";

    /// Stops the build with a message cargo shows as is.
    fn fail(msg: String) -> ! {
        eprintln!("error: {msg}");
        std::process::exit(1);
    }

    fn pkg_config(args: &[&str]) -> Vec<String> {
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

    pub fn build() {
        println!("cargo:rerun-if-changed=dpdk/rte_ring_shim.c");
        println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
        println!("cargo:rerun-if-env-changed=PKG_CONFIG_LIBDIR");
        let cflags = pkg_config(&["--cflags"]);
        let libs = pkg_config(&["--libs"]);

        let mut build = cc::Build::new();
        build.file("dpdk/rte_ring_shim.c").warnings(true).opt_level(3);
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
        build.compile("lanbus_rte_ring_shim");

        // After the static shim, so the linker resolves its references (rte_ring_init,
        // rte_ring_get_memsize) from these; rustc links with --as-needed, so only what is used stays.
        for flag in &libs {
            if let Some(lib) = flag.strip_prefix("-l") {
                println!("cargo:rustc-link-lib=dylib={lib}");
            } else if let Some(dir) = flag.strip_prefix("-L") {
                println!("cargo:rustc-link-search=native={dir}");
            }
        }
    }
}
