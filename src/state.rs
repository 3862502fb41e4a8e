//! Persisted node state: which volume is staged where on which device, and
//! which targets it is published to. Each record is its own small JSON file
//! written atomically (temporary file, fsync, rename, fsync of the folder), so
//! a crash leaves either the old record or the new one, never half of one.

use crate::error::{Error, Result};
use crate::plugin::{Attachment, VolumeCapability, VolumeId};
use crate::sync::LockExt;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Writes `bytes` to `path` atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_replace(path, bytes, true)
}

/// Writes `bytes` to `path` by writing a temporary file and renaming it over
/// the old one: a crash of the process leaves the old record or the new
/// one. With `durable`, both are fsynced so a power loss does too.
fn write_replace(path: &Path, bytes: &[u8], durable: bool) -> std::io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("path has no parent"))?;
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("path has no file name"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    if durable {
        f.sync_all()?;
    }
    drop(f);
    fs::rename(&tmp, path)?;
    if durable {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

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
}

/// The records, in memory and on disk under `<state-dir>/node`.
pub struct NodeState {
    stage_dir: PathBuf,
    publish_dir: PathBuf,
    stages: Mutex<HashMap<VolumeId, StageRecord>>,
    publishes: Mutex<HashMap<PathBuf, PublishRecord>>,
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
        if name.starts_with('.') && name.ends_with(".tmp") {
            // An interrupted write: the record it was replacing is intact.
            let _ = fs::remove_file(&path);
            continue;
        }
        if !name.ends_with(".json") {
            continue;
        }
        let parsed = fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<T>(&b).ok());
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

/// Creates `dir` (and its missing parents) private to the driver's user:
/// mode 0700, an existing one made so too. What the driver keeps (records,
/// images, keyrings) is root's alone.
pub fn private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .and_then(|()| fs::set_permissions(dir, fs::Permissions::from_mode(0o700)))
        .map_err(|e| Error::io(format!("create {}", dir.display()), e))
}

impl NodeState {
    /// Opens (creating if needed) the state under `dir` and loads it.
    pub fn open(dir: &Path) -> Result<Self> {
        let stage_dir = dir.join("node").join("staged");
        let publish_dir = dir.join("node").join("published");
        for d in [dir, &dir.join("node"), &stage_dir, &publish_dir] {
            private_dir(d)?;
        }
        let stages = load_dir::<StageRecord>(&stage_dir)?
            .into_iter()
            .map(|r| (r.volume_id.clone(), r))
            .collect();
        let publishes = load_dir::<PublishRecord>(&publish_dir)?
            .into_iter()
            .map(|r| (r.target_path.clone(), r))
            .collect();
        Ok(Self {
            stage_dir,
            publish_dir,
            stages: Mutex::new(stages),
            publishes: Mutex::new(publishes),
        })
    }

    /// Stage records are written durably: after a power loss the node must
    /// still know which devices to release. Publish records only need to
    /// survive a process crash (bind mounts do not survive a reboot, and
    /// reconcile drops records whose mount is gone), so they skip the fsyncs
    /// that would otherwise dominate every publish.
    fn save<T: Serialize>(dir: &Path, key: &str, record: &T, durable: bool) -> Result<()> {
        let path = dir.join(digest_name(key));
        let bytes = serde_json::to_vec_pretty(record)
            .map_err(|e| Error::internal(format!("encode state: {e}")))?;
        write_replace(&path, &bytes, durable)
            .map_err(|e| Error::io(format!("write {}", path.display()), e))
    }

    fn delete(dir: &Path, key: &str, durable: bool) -> Result<()> {
        let path = dir.join(digest_name(key));
        match fs::remove_file(&path) {
            Ok(()) if !durable => Ok(()),
            Ok(()) => fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::io("sync state dir", e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(format!("remove {}", path.display()), e)),
        }
    }

    pub fn stage(&self, id: &VolumeId) -> Option<StageRecord> {
        self.stages.locked().get(id).cloned()
    }

    pub fn stages(&self) -> Vec<StageRecord> {
        self.stages.locked().values().cloned().collect()
    }

    /// Records a stage, on disk first.
    pub fn put_stage(&self, record: StageRecord) -> Result<()> {
        Self::save(
            &self.stage_dir,
            &record.volume_id.to_string(),
            &record,
            true,
        )?;
        self.stages
            .locked()
            .insert(record.volume_id.clone(), record);
        Ok(())
    }

    pub fn remove_stage(&self, id: &VolumeId) -> Result<()> {
        Self::delete(&self.stage_dir, &id.to_string(), true)?;
        self.stages.locked().remove(id);
        Ok(())
    }

    pub fn publish(&self, target: &Path) -> Option<PublishRecord> {
        self.publishes.locked().get(target).cloned()
    }

    /// Every target a volume is published to.
    pub fn publishes_of(&self, id: &VolumeId) -> Vec<PublishRecord> {
        self.publishes
            .locked()
            .values()
            .filter(|p| &p.volume_id == id)
            .cloned()
            .collect()
    }

    pub fn publishes(&self) -> Vec<PublishRecord> {
        self.publishes.locked().values().cloned().collect()
    }

    pub fn put_publish(&self, record: PublishRecord) -> Result<()> {
        Self::save(
            &self.publish_dir,
            &record.target_path.to_string_lossy(),
            &record,
            false,
        )?;
        self.publishes
            .locked()
            .insert(record.target_path.clone(), record);
        Ok(())
    }

    pub fn remove_publish(&self, target: &Path) -> Result<()> {
        Self::delete(&self.publish_dir, &target.to_string_lossy(), false)?;
        self.publishes.locked().remove(target);
        Ok(())
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
    fn write_atomic_replaces_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        write_atomic(&p, b"first version, long").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"second");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
