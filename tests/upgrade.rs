//! Upgrades. The state directory's format stamp, through the binary: a
//! directory that a newer version wrote is refused at start, with an error
//! naming both versions, and left as it was. And the fixtures of the
//! `file` backend (`tests/fixtures/upgrade/format-N/file.json`, see
//! `common::upgrade`; the other backends' are tested in the guest): a
//! DaemonSet roll with a pod writing, the old driver's records replaced by
//! each format's fixture, the current driver adopting them. Needs root for
//! the fixture test (loop devices, mounts).

mod common;

use common::upgrade::{self, Run};
use common::*;
use std::process::Command;
use std::time::Duration;

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

/// Every state format has a fixture for each kind of backend the driver
/// has, and for no other: a new backend brings its records' fixture.
#[test]
fn every_format_has_a_fixture_for_each_backend() {
    let kinds: std::collections::BTreeSet<String> = ferrovol::backend::KINDS
        .iter()
        .map(|k| format!("{}.json", k.name))
        .collect();
    let formats = upgrade::formats();
    assert!(!formats.is_empty());
    for format in formats {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("tests/fixtures/upgrade/format-{format}"));
        let there: std::collections::BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(there, kinds, "{}", dir.display());
    }
}

/// The `file` backend, as a DaemonSet roll leaves it: a volume staged and
/// published (ext4) with a pod writing to it all along, the driver stopped
/// as a roll stops it (SIGTERM), its records replaced by each format's
/// fixture, and the current driver started on them. It knows the volume
/// staged and published, the pod's writes never stop, a second pod is
/// published from the same staged mount, and it takes everything down and
/// deletes the volume, leaving nothing.
#[tokio::test]
async fn the_file_backend_s_volumes_survive_every_state_format() {
    require_root();
    for format in upgrade::formats() {
        survives(format).await;
    }
}

async fn survives(format: u32) {
    let mut h = Harness::start().await;
    let cap = mount_cap("ext4", SNW);
    let vol = h.provision("pvc-upgrade", 16 * MIB, cap.clone()).await;
    let target = &vol.target;
    std::fs::write(target.join("kept"), upgrade::KEPT).unwrap();
    let pod = Steady::start(target.join("pod-writes"));
    assert!(h.terminate().success(), "{}", h.log());

    // This run's values: the harness's folder, the version, the device and
    // the staged mount's identity.
    let state = h.state_dir();
    let roots = [("", state.as_path())];
    let written = upgrade::read(&roots);
    let values = vec![
        (h.dir.path().display().to_string(), "@DIR@".to_string()),
        (
            env!("CARGO_PKG_VERSION").to_string(),
            "@VERSION@".to_string(),
        ),
    ];
    let run = Run::new(values, &written);
    let fixture = upgrade::expect_fixture("file", format, &written, &run);
    upgrade::replace(&roots, &written, &fixture);

    h.spawn().await;
    upgrade::adopted(
        &h,
        &vol,
        &cap,
        stage_req(&vol.id, &vol.staging, cap.clone()),
        pod,
        Duration::from_secs(60),
        &format!("format {format}"),
    )
    .await;
    h.teardown(&vol).await;
    h.assert_clean();
    let left: Vec<String> = upgrade::read(&roots)
        .into_keys()
        .filter(|k| k != ferrovol::format::FILE)
        .filter(|k| {
            // Journals may stay, empty of live records.
            !k.ends_with(".log")
        })
        .collect();
    assert!(left.is_empty(), "format {format}: records left: {left:?}");
}
