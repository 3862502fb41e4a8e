//! The upgrade fixtures (`tests/fixtures/upgrade/format-N/<backend>.json`):
//! every record a volume staged and published leaves, as the version that
//! wrote that format wrote it, with one run's values made placeholders.
//! A test reads what its driver wrote ([`read`]), checks the newest
//! fixture against it ([`expect_fixture`]: a layout change fails until it
//! comes with a new format and its fixture; `FERROVOL_WRITE_FIXTURES=1`
//! writes the current one, `FERROVOL_WRITE_FIXTURES=/a/folder` writes it
//! there, and the test goes on with it: `tests/guest/suite` passes the
//! guest a folder of its share), and puts a fixture's records in place of
//! its own ([`replace`]) before a current driver starts on them.

use super::{publish_req, unpublish_req, Harness, Published, Steady};
use ferrovol::proto as pb;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a test writes to its volume before the roll, and reads after.
pub const KEPT: &[u8] = b"kept across an upgrade";

/// Records by name: `<prefix><path under its folder>` for files, or a name
/// of the test's own for what is not a file (lvm tags, rbd metadata).
pub type Records = BTreeMap<String, Value>;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/upgrade")
}

/// The formats with fixtures, oldest first; the newest must be the
/// current one.
pub fn formats() -> Vec<u32> {
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
    formats
}

/// Every record under each folder (JSON files, and journals: a JSON value
/// a line), named by the folder's prefix and its path there; image files
/// and sockets are not records.
pub fn read(roots: &[(&str, &Path)]) -> Records {
    fn walk(prefix: &str, root: &Path, at: &Path, out: &mut Records) {
        for e in std::fs::read_dir(at).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(prefix, root, &p, out);
                continue;
            }
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let journal = match p.extension().and_then(|e| e.to_str()) {
                Some("json") => false,
                Some("log") => true,
                _ => continue,
            };
            let text = std::fs::read_to_string(&p).unwrap();
            let v = if journal {
                Value::Array(
                    text.lines()
                        .filter(|l| !l.is_empty())
                        .map(|l| serde_json::from_str(l).unwrap())
                        .collect(),
                )
            } else {
                serde_json::from_str(&text).unwrap()
            };
            out.insert(format!("{prefix}{rel}"), v);
        }
    }
    let mut out = Records::new();
    for (prefix, root) in roots {
        walk(prefix, root, root, &mut out);
    }
    out
}

/// The file a record name stands for, if it is a file under one of the
/// folders.
fn file_of(roots: &[(&str, &Path)], name: &str) -> Option<PathBuf> {
    roots
        .iter()
        .filter(|(prefix, _)| name.starts_with(prefix))
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(prefix, root)| root.join(&name[prefix.len()..]))
}

/// Removes the files of `old` and writes those of `new` (the records of
/// files; the others are the caller's).
pub fn replace(roots: &[(&str, &Path)], old: &Records, new: &Records) {
    for name in old.keys() {
        if let Some(p) = file_of(roots, name) {
            std::fs::remove_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
    }
    for (name, v) in new {
        let Some(p) = file_of(roots, name) else {
            continue;
        };
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let text = if name.ends_with(".log") {
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

/// One run's values and their placeholders: longest first, so that a path
/// is replaced before the folder it lies in.
/// Numbers (the staged mount's identity) are placeholders only where they
/// stand alone in the stage record.
pub struct Run(Vec<(String, String)>, Vec<(u64, String)>);

impl Run {
    /// `values` (value, placeholder), and what the stage record among
    /// `written` names of this run: the device (`@DEVICE@`) and the staged
    /// mount's identity (`@MOUNT_DEV@`, `@MOUNT_RDEV@`), when it has them.
    pub fn new(mut values: Vec<(String, String)>, written: &Records) -> Self {
        let staged = written
            .iter()
            .find(|(k, _)| k.starts_with("node/staged/"))
            .expect("a stage record")
            .1;
        if let Some(device) = staged["attachment"]["device"]["path"].as_str() {
            values.push((device.to_string(), "@DEVICE@".to_string()));
        }
        let mut numbers = Vec::new();
        for (field, name) in [("dev", "@MOUNT_DEV@"), ("rdev", "@MOUNT_RDEV@")] {
            if let Some(n) = staged["mounted"][field].as_u64() {
                numbers.push((n, name.to_string()));
            }
        }
        values.retain(|(value, _)| !value.is_empty());
        values.sort_by_key(|(value, _)| std::cmp::Reverse(value.len()));
        Run(values, numbers)
    }

    /// This run's values made placeholders (in names and strings).
    pub fn put(&self, v: &Value) -> Value {
        let put = |s: &str| {
            self.0.iter().fold(s.to_string(), |s, (value, name)| {
                s.replace(value.as_str(), name)
            })
        };
        walk(v, &put, &|x| match x {
            Value::String(s) => Value::String(put(s)),
            other => other.clone(),
        })
    }

    /// The placeholders made this run's values (one that stands alone for
    /// a number of the stage record, that number).
    pub fn fill(&self, v: &Value) -> Value {
        let fill = |s: &str| {
            self.0.iter().fold(s.to_string(), |s, (value, name)| {
                s.replace(name.as_str(), value)
            })
        };
        walk(v, &fill, &|x| match x {
            Value::String(s) => match self.1.iter().find(|(_, name)| name == s) {
                Some((n, _)) => Value::from(*n),
                None => Value::String(fill(s)),
            },
            other => other.clone(),
        })
    }

    /// [`Run::fill`] of every name and record.
    pub fn fill_all(&self, r: &Records) -> Records {
        r.iter()
            .map(|(k, v)| {
                let k = self.fill(&Value::String(k.clone()));
                (k.as_str().unwrap().to_string(), self.fill(v))
            })
            .collect()
    }
}

/// `v` with each object key mapped by `key` and each scalar by `scalar`.
fn walk(v: &Value, key: &dyn Fn(&str) -> String, scalar: &dyn Fn(&Value) -> Value) -> Value {
    match v {
        Value::Array(a) => Value::Array(a.iter().map(|x| walk(x, key, scalar)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| (key(k), walk(x, key, scalar)))
                .collect(),
        ),
        other => scalar(other),
    }
}

/// The fixture of `backend` in `format`, this run's values filled in.
/// For the current format, it must be what the driver wrote (`written`,
/// this run's values made placeholders): a driver whose records differ
/// needs a new format and its fixture.
pub fn expect_fixture(backend: &str, format: u32, written: &Records, run: &Run) -> Records {
    let mut golden = fixtures().join(format!("format-{format}/{backend}.json"));
    if format == ferrovol::format::FORMAT {
        let now: Records = written
            .iter()
            .map(|(k, v)| {
                let mut v = run.put(v);
                // The staged mount's identity: numbers of this run.
                if k.starts_with("node/staged/") && v["mounted"].is_object() {
                    v["mounted"]["dev"] = Value::from("@MOUNT_DEV@");
                    v["mounted"]["rdev"] = Value::from("@MOUNT_RDEV@");
                }
                let k = run.put(&Value::String(k.clone()));
                (k.as_str().unwrap().to_string(), v)
            })
            .collect();
        if let Some(to) = std::env::var_os("FERROVOL_WRITE_FIXTURES") {
            // A folder to write them in (the guest writes to its share),
            // or the fixtures themselves.
            if Path::new(&to).is_absolute() {
                golden = Path::new(&to).join(format!("format-{format}/{backend}.json"));
            }
            std::fs::create_dir_all(golden.parent().unwrap()).unwrap();
            std::fs::write(&golden, serde_json::to_string_pretty(&now).unwrap() + "\n").unwrap();
        }
        let kept: Records = serde_json::from_str(
            &std::fs::read_to_string(&golden)
                .unwrap_or_else(|e| panic!("{}: {e}", golden.display())),
        )
        .unwrap();
        assert_eq!(
            serde_json::to_string_pretty(&now).unwrap(),
            serde_json::to_string_pretty(&kept).unwrap(),
            "{backend}: the driver writes records that format {format}'s fixture does not hold: a new format needs its fixture"
        );
    }
    let fixture: Records =
        serde_json::from_str(&std::fs::read_to_string(&golden).unwrap()).unwrap();
    run.fill_all(&fixture)
}

/// After a roll onto a fixture's records: the driver knows `vol` staged
/// and published (`stage`, a repeat of its stage, and a repeated publish
/// add no mount), [`KEPT`] is still there, `pod` writes on (a write within
/// `pod_limit`), and a second pod is published from the same staged mount
/// and unpublished again. `what` names the case in failures.
pub async fn adopted(
    h: &Harness,
    vol: &Published,
    cap: &pb::VolumeCapability,
    stage: pb::NodeStageVolumeRequest,
    pod: Steady,
    pod_limit: Duration,
    what: &str,
) {
    let (staging, target) = (&vol.staging, &vol.target);
    let mounts = h.mounts();
    h.node()
        .node_stage_volume(stage)
        .await
        .unwrap_or_else(|e| panic!("{what}: stage again: {e:?}\n{}", h.log()));
    h.node()
        .node_publish_volume(publish_req(&vol.id, staging, target, cap.clone(), false))
        .await
        .unwrap_or_else(|e| panic!("{what}: publish again: {e:?}\n{}", h.log()));
    assert_eq!(h.mounts(), mounts, "{what}: a mount was added");
    assert_eq!(std::fs::read(target.join("kept")).unwrap(), KEPT);
    // The pod wrote on through the roll, and a second pod on the node gets
    // the same staged volume from the new driver.
    assert!(
        pod.next_write_within(pod_limit).is_some(),
        "{what}: the pod's writes stopped"
    );
    let second = target.with_file_name(format!(
        "{}-second",
        target.file_name().unwrap().to_string_lossy()
    ));
    h.node()
        .node_publish_volume(publish_req(&vol.id, staging, &second, cap.clone(), false))
        .await
        .unwrap_or_else(|e| panic!("{what}: a second pod: {e:?}\n{}", h.log()));
    assert_eq!(std::fs::read(second.join("kept")).unwrap(), KEPT);
    assert!(pod.finish() > 0);
    h.node()
        .node_unpublish_volume(unpublish_req(&vol.id, &second))
        .await
        .unwrap();
}
