//! Upgrades. The state directory's format stamp, through the binary: a
//! directory that a newer version wrote is refused at start, with an error
//! naming both versions, and left as it was. And the fixtures: for every
//! format of the state directory (`tests/fixtures/upgrade/format-N/`, as
//! the version that wrote it wrote it, with the values of one run made
//! placeholders), a driver dies with a volume staged and published, its
//! records are replaced by the fixture's, and the current driver started
//! on them knows the volume staged and published, takes it down, deletes
//! it, and leaves nothing. The newest fixture is what this driver writes:
//! a change of any record's layout fails here until it comes with a new
//! format and its fixture (`FERROVOL_WRITE_FIXTURES=1` writes the current
//! one). Needs root for the fixture tests (loop devices, mounts).

mod common;

use common::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/upgrade")
}

/// Every record under the state directory (JSON files, and journals: a
/// JSON value a line), by path; image files and sockets are not records.
fn records(dir: &Path) -> BTreeMap<String, Value> {
    fn walk(root: &Path, at: &Path, out: &mut BTreeMap<String, Value>) {
        for e in std::fs::read_dir(at).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
                continue;
            }
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let text = match p.extension().and_then(|e| e.to_str()) {
                Some("json") | Some("log") => std::fs::read_to_string(&p).unwrap(),
                _ => continue,
            };
            let v = if rel.ends_with(".log") {
                Value::Array(
                    text.lines()
                        .filter(|l| !l.is_empty())
                        .map(|l| serde_json::from_str(l).unwrap())
                        .collect(),
                )
            } else {
                serde_json::from_str(&text).unwrap()
            };
            out.insert(rel, v);
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// One run's values and their placeholders: longest first, so that a path
/// is replaced before the folder it lies in.
struct Run(Vec<(String, String)>);

impl Run {
    /// This run's values made placeholders.
    fn put(&self, v: &Value) -> Value {
        let put = |s: &str| {
            self.0.iter().fold(s.to_string(), |s, (value, name)| {
                s.replace(value.as_str(), name)
            })
        };
        walk(v, &put, &|s| Value::String(put(s)))
    }

    /// The placeholders made this run's values (one that stood for a
    /// number, that number).
    fn fill(&self, v: &Value) -> Value {
        let fill = |s: &str| {
            self.0.iter().fold(s.to_string(), |s, (value, name)| {
                s.replace(name.as_str(), value)
            })
        };
        walk(
            v,
            &fill,
            &|s| match self.0.iter().find(|(_, name)| name == s) {
                Some((value, _)) if value.parse::<u64>().is_ok() => {
                    Value::from(value.parse::<u64>().unwrap())
                }
                _ => Value::String(fill(s)),
            },
        )
    }
}

/// `v` with each object key mapped by `key` and each string by `string`.
fn walk(v: &Value, key: &dyn Fn(&str) -> String, string: &dyn Fn(&str) -> Value) -> Value {
    match v {
        Value::String(s) => string(s),
        Value::Array(a) => Value::Array(a.iter().map(|x| walk(x, key, string)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| (key(k), walk(x, key, string)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn write_records(dir: &Path, all: &BTreeMap<String, Value>) {
    for (rel, v) in all {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let text = if rel.ends_with(".log") {
            v.as_array()
                .unwrap()
                .iter()
                .map(|l| format!("{}\n", serde_json::to_string(l).unwrap()))
                .collect::<String>()
        } else {
            serde_json::to_string_pretty(v).unwrap()
        };
        std::fs::write(&p, text).unwrap();
    }
}

/// The `file` backend: a volume staged and published (ext4, written to)
/// by a driver that dies, its records replaced by each format's fixture,
/// taken down and deleted by the current driver.
#[tokio::test]
async fn the_file_backend_s_volumes_survive_every_state_format() {
    require_root();
    let mut formats: Vec<u32> = std::fs::read_dir(fixtures())
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_prefix("format-")?.parse().ok()
        })
        .collect();
    formats.sort();
    assert_eq!(
        formats.last(),
        Some(&ferrovol::format::FORMAT),
        "no fixture of the current format: run with FERROVOL_WRITE_FIXTURES=1"
    );
    for format in formats {
        survives(format).await;
    }
}

async fn survives(format: u32) {
    let mut h = Harness::start().await;
    let cap = mount_cap("ext4", SNW);
    let vol = h.provision("pvc-upgrade", 16 * MIB, cap.clone()).await;
    let (staging, target) = (&vol.staging, &vol.target);
    std::fs::write(target.join("kept"), b"kept across an upgrade").unwrap();
    h.kill();

    // This run's values: the harness's folder, the loop device, the
    // staged mount's identity.
    let state = h.state_dir();
    let written = records(&state);
    let staged = written
        .iter()
        .find(|(k, _)| k.starts_with("node/staged/"))
        .expect("a stage record")
        .1
        .clone();
    let device = staged["attachment"]["device"]["path"]
        .as_str()
        .unwrap()
        .to_string();
    let mut run = vec![
        (h.dir.path().display().to_string(), "@DIR@".to_string()),
        (device, "@DEVICE@".to_string()),
        (
            env!("CARGO_PKG_VERSION").to_string(),
            "@VERSION@".to_string(),
        ),
    ];
    for (field, name) in [("dev", "@MOUNT_DEV@"), ("rdev", "@MOUNT_RDEV@")] {
        run.push((staged["mounted"][field].to_string(), name.to_string()));
    }
    run.sort_by_key(|(value, _)| std::cmp::Reverse(value.len()));
    let run = Run(run);

    let golden = fixtures().join(format!("format-{format}/file.json"));
    if format == ferrovol::format::FORMAT {
        let mut now: BTreeMap<String, Value> = written
            .iter()
            .map(|(k, v)| (k.clone(), run.put(v)))
            .collect();
        // The staged mount's identity: numbers of this run.
        for (k, v) in now.iter_mut() {
            if k.starts_with("node/staged/") {
                v["mounted"]["dev"] = Value::from("@MOUNT_DEV@");
                v["mounted"]["rdev"] = Value::from("@MOUNT_RDEV@");
            }
        }
        if std::env::var_os("FERROVOL_WRITE_FIXTURES").is_some() {
            std::fs::create_dir_all(golden.parent().unwrap()).unwrap();
            std::fs::write(&golden, serde_json::to_string_pretty(&now).unwrap() + "\n").unwrap();
        }
        let kept: BTreeMap<String, Value> =
            serde_json::from_str(&std::fs::read_to_string(&golden).unwrap()).unwrap();
        assert_eq!(
            now, kept,
            "the driver writes records that format {format}'s fixture does not hold: a new format needs its fixture"
        );
    }

    // The records become the fixture's.
    let fixture: BTreeMap<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(&golden).unwrap()).unwrap();
    for rel in written.keys() {
        std::fs::remove_file(state.join(rel)).unwrap();
    }
    let filled: BTreeMap<String, Value> = fixture
        .iter()
        .map(|(k, v)| {
            (
                run.fill(&Value::String(k.clone()))
                    .as_str()
                    .unwrap()
                    .to_string(),
                run.fill(v),
            )
        })
        .collect();
    write_records(&state, &filled);

    h.spawn().await;
    let mounts = h.mounts();
    // It knows the volume staged and published: both again are no change.
    h.node()
        .node_stage_volume(stage_req(&vol.id, staging, cap.clone()))
        .await
        .unwrap_or_else(|e| panic!("format {format}: stage again: {e:?}\n{}", h.log()));
    h.node()
        .node_publish_volume(publish_req(&vol.id, staging, target, cap.clone(), false))
        .await
        .unwrap_or_else(|e| panic!("format {format}: publish again: {e:?}\n{}", h.log()));
    assert_eq!(h.mounts(), mounts, "format {format}: a mount was added");
    assert_eq!(
        std::fs::read(target.join("kept")).unwrap(),
        b"kept across an upgrade"
    );
    h.teardown(&vol).await;
    h.assert_clean();
    let left: Vec<String> = records(&state)
        .into_keys()
        .filter(|k| k != ferrovol::format::FILE)
        .filter(|k| {
            // Journals may stay, empty of live records.
            !k.ends_with(".log")
        })
        .collect();
    assert!(left.is_empty(), "format {format}: records left: {left:?}");
}
