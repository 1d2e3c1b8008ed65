//! The library example builds a host and an I/O box on its own and verifies the data it moves
//! through them (`cargo test` builds the examples before running this).

use std::process::Command;

#[test]
fn remote_drive_example_runs_and_verifies() {
    let deps = std::env::current_exe().unwrap();
    let example = deps.parent().and_then(|d| d.parent()).unwrap().join("examples/remote_drive");
    assert!(example.exists(), "{} was not built", example.display());
    let out = Command::new(&example).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("Mass storage controller"), "{stdout}");
    assert!(stdout.contains("read back: identical"), "{stdout}");
}
