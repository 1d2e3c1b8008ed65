//! The committed seed corpus of the `tlp` fuzz target runs through the same body on stable Rust:
//! every seed but the deliberately broken ones decodes, and none panics.

#[test]
fn corpus_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/tlp");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        lanbus_pcie::fuzz_tlp(&bytes);
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        assert_eq!(lanbus_pcie::Tlp::decode(&bytes).is_ok(), !name.starts_with("truncated"), "{name}");
        n += 1;
    }
    assert!(n >= 12, "only {n} seeds");
}
