//! `lanbus tlp decode|encode` through the built binary, on lines of the TLP vectors.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The TLP vectors the PCIe crate keeps as fixtures (see its `tests/fixtures/tlp/PROVENANCE.md`).
fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../pcie/tests/fixtures")
}

fn lanbus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lanbus")).args(args).output().expect("run lanbus")
}

#[test]
fn decode_and_encode_vector_lines() {
    let text = std::fs::read_to_string(vectors_dir().join("tlp/codec.jsonl")).unwrap();
    let all: Vec<&str> = text.lines().collect();
    // One line of each kind, the first of each.
    let mut seen = std::collections::HashSet::new();
    let mut picked = 0;
    for line in all {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if !seen.insert(v["kind"].as_str().unwrap().to_string()) {
            continue;
        }
        picked += 1;
        let hex = v["hex"].as_str().unwrap();
        let out = lanbus(&["tlp", "decode", hex]);
        assert!(out.status.success(), "decode {hex}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8(out.stdout).unwrap().trim_end(), line);
        let out = lanbus(&["tlp", "encode", line]);
        assert!(out.status.success(), "encode {line}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8(out.stdout).unwrap().trim_end(), hex);
    }
    assert_eq!(picked, 12, "every kind is exercised");
}

#[test]
fn malformed_input_fails_with_one_line() {
    for args in [
        &["tlp", "decode", "zz"][..],
        &["tlp", "decode", "0a90"],
        &["tlp", "decode", "4a2c3004caa60d40e670c30f6c189c24"],
        &["tlp", "decode", "0a9010005eb4028e7f893f2a00"],
        &["tlp", "encode", "{\"kind\": \"MRd32\"}"],
        &["tlp", "encode", "not json"],
        &["tlp", "encode", "{\"kind\": \"MWr32\", \"address\": 0, \"data\": \"01\"}"],
    ] {
        let out = lanbus(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("lanbus: error:"), "{err}");
    }
}
