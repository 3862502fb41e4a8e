//! Persisted node state: which volume is staged where on which device, and
//! which targets it is published to. Each stage record is its own small
//! JSON file written atomically and durably by [`crate::records::write`];
//! publish records, written on every publish, are lines of one
//! [`crate::records::Journal`].

use crate::error::{Error, Result};
use crate::plugin::{Attachment, VolumeCapability, VolumeId};
use crate::records::{self, Journal};
use crate::sync::LockExt;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A staged volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRecord {
    pub volume_id: VolumeId,
    pub staging_path: PathBuf,
    pub capability: VolumeCapability,
    /// What the backend set up; `None` while the attach is under way.
    pub attachment: Option<Attachment>,
    /// The filesystem mounted at the staging path (mount access only).
    pub fs_type: Option<String>,
    /// What ferrovol mounted at the staging path, as statx saw it right
    /// after: compared before a mount there is taken for ours.
    #[serde(default)]
    pub mounted: Option<crate::mount::MountId>,
    /// The LUKS mapping the volume is served through (encrypted volumes),
    /// named before it is opened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crypt: Option<String>,
    /// An intent: a LUKS format of the device was started and is not
    /// known to have finished. A stage that finds it, and a header of
    /// ours with no key slot (the format cut short), formats again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub crypt_formatting: bool,
}

impl StageRecord {
    /// The device the volume is served from: its LUKS mapping when it is
    /// encrypted, else what the backend attached; None for remote
    /// filesystems and attaches under way.
    pub fn device(&self) -> Option<PathBuf> {
        match (&self.crypt, &self.attachment) {
            (Some(name), Some(Attachment::Device { .. })) => Some(crate::host::crypt::path(name)),
            (None, Some(Attachment::Device { path })) => Some(path.clone()),
            _ => None,
        }
    }
}

/// A published target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishRecord {
    pub volume_id: VolumeId,
    pub target_path: PathBuf,
    pub staging_path: PathBuf,
    pub capability: VolumeCapability,
    pub readonly: bool,
    /// The read-only loop device made for a read-only publish of a raw
    /// block volume (bound at the target instead of the staged device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<PathBuf>,
    /// The device node a raw block publish bound at the target, so that
    /// an unpublish knows its own bind after the device is gone from /dev
    /// (an LV removed, a LUN deleted, a mapping dropped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound: Option<crate::mount::MountId>,
    /// The I/O limits this publish set in its pod's cgroup, on the device
    /// its I/O goes to; taken away at unpublish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limited: Option<Limited>,
    /// Why the volume's I/O limits could not be set for this publish's
    /// pod (its cgroup not found): said in the volume's health.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unlimited: Option<String>,
    /// The limits the publish's volume context carried (the volume's at
    /// creation), which changes are made over; `None` in records from
    /// before they were kept (then `limited`'s limits are).
    #[serde(default, skip_serializing_if = "no_limits")]
    pub class_limits: Option<crate::host::iolimit::Limits>,
}

/// Limits that need not be written: none, or none set (read back as
/// none, which means the same).
fn no_limits(l: &Option<crate::host::iolimit::Limits>) -> bool {
    l.is_none_or(|l| l.is_empty())
}

/// I/O limits a publish set in a pod's cgroup (none yet: the pod and
/// device, for a limit a later change sets).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limited {
    /// The pod's UID (records from before it was kept have none).
    #[serde(default)]
    pub pod: String,
    pub cgroup: PathBuf,
    pub dev: crate::host::iolimit::Dev,
    pub limits: crate::host::iolimit::Limits,
}

/// The records, in memory and on disk under `<state-dir>/node`.
pub struct NodeState {
    stage_dir: PathBuf,
    stages: Mutex<HashMap<VolumeId, StageRecord>>,
    publishes: Journal<PathBuf, PublishRecord>,
}

fn digest_name(key: &str) -> String {
    format!("{}.json", crate::plugin::digest_hex(key.as_bytes(), 16))
}

fn load_dir<T: for<'de> Deserialize<'de>>(dir: &Path) -> Result<Vec<T>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| Error::io(format!("read {}", dir.display()), e))? {
        let entry = entry.map_err(|e| Error::io(format!("read {}", dir.display()), e))?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if records::is_leftover(&name) {
            // An interrupted write: the record it was replacing is intact.
            let _ = fs::remove_file(&path);
            continue;
        }
        if !name.ends_with(".json") {
            continue;
        }
        let parsed = fs::read(&path)
            .ok()
            .and_then(|b| records::decode_record::<T>(&path.display().to_string(), &b).ok());
        match parsed {
            Some(r) => out.push(r),
            None => {
                tracing::warn!(path = %path.display(), "unreadable node state record set aside");
                let _ = fs::rename(&path, path.with_extension("bad"));
            }
        }
    }
    Ok(out)
}

impl NodeState {
    /// Opens (creating if needed) the state under `dir` and loads it.
    /// Publish records an older version kept a file each for (under
    /// `node/published/`) move into the journal.
    pub fn open(dir: &Path) -> Result<Self> {
        let node_dir = dir.join("node");
        let stage_dir = node_dir.join("staged");
        for d in [dir, &node_dir, &stage_dir] {
            records::private_dir(d)?;
        }
        let stages = load_dir::<StageRecord>(&stage_dir)?
            .into_iter()
            .map(|r| (r.volume_id.clone(), r))
            .collect();
        let old_dir = node_dir.join("published");
        let carried = match old_dir.is_dir() {
            true => load_dir::<PublishRecord>(&old_dir)?,
            false => Vec::new(),
        };
        let publishes = Journal::open(
            &node_dir.join("published.log"),
            carried.into_iter().map(|r| (r.target_path.clone(), r)),
        )?;
        // In the journal now: the old files go.
        if old_dir.is_dir() {
            fs::remove_dir_all(&old_dir)
                .map_err(|e| Error::io(format!("remove {}", old_dir.display()), e))?;
        }
        Ok(Self {
            stage_dir,
            stages: Mutex::new(stages),
            publishes,
        })
    }

    /// The publish records kept under `dir`, read without changing them
    /// (while the driver runs), and how many journal lines did not parse.
    pub fn peek_publishes(dir: &Path) -> Result<(Vec<PublishRecord>, usize)> {
        Journal::<PathBuf, PublishRecord>::peek(&dir.join("node").join("published.log"))
    }

    fn stage_path(&self, id: &VolumeId) -> PathBuf {
        self.stage_dir.join(digest_name(&id.to_string()))
    }

    pub fn stage(&self, id: &VolumeId) -> Option<StageRecord> {
        self.stages.locked().get(id).cloned()
    }

    pub fn stages(&self) -> Vec<StageRecord> {
        self.stages.locked().values().cloned().collect()
    }

    /// Records a stage, on disk (durably) first: after a power loss the
    /// node must still know which devices to release.
    pub fn put_stage(&self, record: StageRecord) -> Result<()> {
        records::write_json(&self.stage_path(&record.volume_id), &record)?;
        self.stages
            .locked()
            .insert(record.volume_id.clone(), record);
        Ok(())
    }

    pub fn remove_stage(&self, id: &VolumeId) -> Result<()> {
        records::remove(&self.stage_path(id))?;
        self.stages.locked().remove(id);
        Ok(())
    }

    pub fn publish(&self, target: &Path) -> Option<PublishRecord> {
        self.publishes.get(target)
    }

    /// Every target a volume is published to.
    pub fn publishes_of(&self, id: &VolumeId) -> Vec<PublishRecord> {
        self.publishes.filtered(|p| &p.volume_id == id)
    }

    pub fn publishes(&self) -> Vec<PublishRecord> {
        self.publishes.values()
    }

    /// Records a publish. Publish records only need to survive a process
    /// crash (bind mounts do not survive a reboot, and reconcile drops
    /// records whose mount is gone): a line in the journal, not fsynced.
    pub fn put_publish(&self, record: PublishRecord) -> Result<()> {
        self.publishes.put(record.target_path.clone(), record)
    }

    pub fn remove_publish(&self, target: &Path) -> Result<()> {
        self.publishes.remove(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::{AccessMode, AccessType};

    fn stage_record(id: &str) -> StageRecord {
        StageRecord {
            volume_id: VolumeId::parse(id).unwrap(),
            staging_path: "/staging/x".into(),
            capability: VolumeCapability {
                access: AccessType::Mount {
                    fs_type: "ext4".into(),
                    mount_flags: vec![],
                },
                mode: AccessMode::SingleNodeWriter,
            },
            attachment: Some(Attachment::Device {
                path: "/dev/loop3".into(),
            }),
            fs_type: Some("ext4".into()),
            mounted: None,
            crypt: None,
            crypt_formatting: false,
        }
    }

    #[test]
    fn records_survive_reopen_and_removal_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let state = NodeState::open(dir.path()).unwrap();
        state.put_stage(stage_record("file:a")).unwrap();
        state.put_stage(stage_record("file:b")).unwrap();
        let p = PublishRecord {
            volume_id: VolumeId::parse("file:a").unwrap(),
            target_path: "/pods/1/mount".into(),
            staging_path: "/staging/x".into(),
            capability: stage_record("file:a").capability,
            readonly: true,
            device: None,
            bound: None,
            limited: None,
            unlimited: None,
            class_limits: None,
        };
        state.put_publish(p.clone()).unwrap();
        state
            .remove_stage(&VolumeId::parse("file:b").unwrap())
            .unwrap();
        drop(state);

        let again = NodeState::open(dir.path()).unwrap();
        assert_eq!(
            again.stage(&VolumeId::parse("file:a").unwrap()),
            Some(stage_record("file:a"))
        );
        assert_eq!(again.stage(&VolumeId::parse("file:b").unwrap()), None);
        assert_eq!(
            again.publishes_of(&VolumeId::parse("file:a").unwrap()),
            vec![p]
        );
        again.remove_publish(Path::new("/pods/1/mount")).unwrap();
        again.remove_publish(Path::new("/pods/1/mount")).unwrap();
        assert!(NodeState::open(dir.path()).unwrap().publishes().is_empty());
    }

    #[test]
    fn interrupted_writes_and_corrupt_records_do_not_break_loading() {
        let dir = tempfile::tempdir().unwrap();
        let state = NodeState::open(dir.path()).unwrap();
        state.put_stage(stage_record("file:a")).unwrap();
        let staged = dir.path().join("node/staged");
        fs::write(staged.join(".deadbeef.json.tmp"), b"{\"half").unwrap();
        fs::write(staged.join("0000.json"), b"not json").unwrap();
        let again = NodeState::open(dir.path()).unwrap();
        assert_eq!(again.stages().len(), 1);
        assert!(!staged.join(".deadbeef.json.tmp").exists());
        assert!(staged.join("0000.bad").exists());
    }

    #[test]
    fn publish_records_of_the_old_layout_move_into_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("node/published");
        fs::create_dir_all(&old).unwrap();
        let p = PublishRecord {
            volume_id: VolumeId::parse("file:a").unwrap(),
            target_path: "/pods/2/mount".into(),
            staging_path: "/staging/x".into(),
            capability: stage_record("file:a").capability,
            readonly: false,
            device: None,
            bound: None,
            limited: None,
            unlimited: None,
            class_limits: None,
        };
        fs::write(old.join("0001.json"), serde_json::to_vec(&p).unwrap()).unwrap();
        let state = NodeState::open(dir.path()).unwrap();
        assert_eq!(state.publishes(), vec![p.clone()]);
        assert!(!old.exists());
        drop(state);
        assert_eq!(NodeState::open(dir.path()).unwrap().publishes(), vec![p]);
    }

    #[test]
    fn a_publish_costs_no_file_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let state = NodeState::open(dir.path()).unwrap();
        let before = fs::read_dir(dir.path().join("node")).unwrap().count();
        for i in 0..10 {
            state
                .put_publish(PublishRecord {
                    volume_id: VolumeId::parse("file:a").unwrap(),
                    target_path: format!("/pods/{i}/mount").into(),
                    staging_path: "/staging/x".into(),
                    capability: stage_record("file:a").capability,
                    readonly: false,
                    device: None,
                    bound: None,
                    limited: None,
                    unlimited: None,
                    class_limits: None,
                })
                .unwrap();
        }
        assert_eq!(
            fs::read_dir(dir.path().join("node")).unwrap().count(),
            before
        );
        assert_eq!(state.publishes().len(), 10);
    }
}
