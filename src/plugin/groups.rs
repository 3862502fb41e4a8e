//! The group snapshots the plugin layer takes for backends whose members
//! are ordinary snapshots cut while the node holds their writes
//! ([`super::GroupSnapshots::Frozen`]): one record per group under the
//! state dir, naming its members, and an index from member to group so
//! GetSnapshot and ListSnapshots can say which group a snapshot is of.

use super::{GroupSnapshotId, SnapshotId, VolumeId};
use crate::error::{Error, Result};
use crate::sync::LockExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One group snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    pub name: String,
    /// The source volumes, in the request's order.
    pub sources: Vec<VolumeId>,
    pub parameters: BTreeMap<String, String>,
    /// The members, one per source in the same order. While `complete`
    /// is false they are what is being taken (some may not exist).
    pub members: Vec<SnapshotId>,
    pub created_unix_nanos: u128,
    pub complete: bool,
}

/// The records, one file per group: `<dir>/<backend>/<locator>.json`.
pub struct GroupStore {
    dir: PathBuf,
    /// Member to group, for complete groups.
    index: Mutex<HashMap<SnapshotId, GroupSnapshotId>>,
}

impl GroupStore {
    /// Opens the store in `dir` (made private if missing) and indexes it.
    pub fn open(dir: &Path) -> Result<Self> {
        crate::records::private_dir(dir)?;
        let store = Self {
            dir: dir.to_path_buf(),
            index: Mutex::default(),
        };
        let mut index = HashMap::new();
        for backend in read_names(dir)? {
            for file in read_names(&dir.join(&backend))? {
                let Some(locator) = file.strip_suffix(".json") else {
                    continue;
                };
                let Ok(id) = GroupSnapshotId::new(&backend, locator) else {
                    continue;
                };
                if let Some(record) = store.get(&id)? {
                    if record.complete {
                        for m in record.members {
                            index.insert(m, id.clone());
                        }
                    }
                }
            }
        }
        *store.index.locked() = index;
        Ok(store)
    }

    fn path(&self, id: &GroupSnapshotId) -> PathBuf {
        self.dir
            .join(id.backend())
            .join(format!("{}.json", id.locator()))
    }

    pub fn get(&self, id: &GroupSnapshotId) -> Result<Option<GroupRecord>> {
        crate::records::read_json(&self.path(id))
    }

    /// Writes `record` durably; a complete one enters the index.
    pub fn put(&self, id: &GroupSnapshotId, record: &GroupRecord) -> Result<()> {
        let path = self.path(id);
        crate::records::private_dir(path.parent().expect("a backend folder"))?;
        crate::records::write_json(&path, record)?;
        let mut index = self.index.locked();
        index.retain(|_, g| g != id);
        if record.complete {
            for m in &record.members {
                index.insert(m.clone(), id.clone());
            }
        }
        Ok(())
    }

    pub fn remove(&self, id: &GroupSnapshotId) -> Result<()> {
        crate::records::remove(&self.path(id))?;
        self.index.locked().retain(|_, g| g != id);
        Ok(())
    }

    /// The groups recorded and not complete: what a driver that died
    /// taking them left.
    pub fn incomplete(&self) -> Result<Vec<(GroupSnapshotId, GroupRecord)>> {
        let mut out = Vec::new();
        for backend in read_names(&self.dir)? {
            for file in read_names(&self.dir.join(&backend))? {
                let Some(locator) = file.strip_suffix(".json") else {
                    continue;
                };
                let Ok(id) = GroupSnapshotId::new(&backend, locator) else {
                    continue;
                };
                if let Some(record) = self.get(&id)?.filter(|r| !r.complete) {
                    out.push((id, record));
                }
            }
        }
        Ok(out)
    }

    /// The group `snapshot` was taken in, if any.
    pub fn group_of(&self, snapshot: &SnapshotId) -> Option<GroupSnapshotId> {
        self.index.locked().get(snapshot).cloned()
    }
}

fn read_names(dir: &Path) -> Result<Vec<String>> {
    match std::fs::read_dir(dir) {
        Ok(entries) => Ok(entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !crate::records::is_leftover(n))
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io(format!("read {}", dir.display()), e)),
    }
}
