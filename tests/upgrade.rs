//! Upgrades: the state directory's format stamp, through the binary. A
//! directory that a newer version wrote is refused at start, with an error
//! naming both versions, and left as it was; a new one is stamped.

use std::process::Command;

fn serve(state: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .args(["serve", "--mode", "controller", "--state-dir"])
        .arg(state)
        .arg("--endpoint")
        .arg(format!("unix://{}/csi.sock", state.display()))
        .output()
        .unwrap()
}

#[test]
fn a_state_directory_a_newer_version_wrote_is_refused_at_start() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let stamp = format!(
        r#"{{"format":{},"written_by":"7.3.0"}}"#,
        ferrovol::format::FORMAT + 1
    );
    std::fs::write(state.join(ferrovol::format::FILE), &stamp).unwrap();
    let out = serve(&state);
    assert!(!out.status.success(), "it started: {out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("7.3.0"), "{said}");
    assert!(said.contains(env!("CARGO_PKG_VERSION")), "{said}");
    assert!(said.contains("refusing to start"), "{said}");
    assert_eq!(
        std::fs::read_to_string(state.join(ferrovol::format::FILE)).unwrap(),
        stamp,
        "the newer stamp was changed"
    );
    // Nothing else was written there.
    let names: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from(ferrovol::format::FILE)]
    );
}
