//! Intents: what an operation is about to leave in the kernel or on disk
//! between two of its steps (a freeze, ...), recorded durably before the
//! step and removed once it is undone. The driver can die between any two
//! steps; every start reads what intents are left and finishes or undoes
//! each before it serves anything.
//!
//! One file per intent under `<state-dir>/intents`, written by
//! [`crate::records`] (atomic, fsynced, root's alone). A backend keeps
//! intents of its own kind in a folder of its own the same way.

use crate::error::Result;
use crate::records;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What was about to be done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Intent {
    /// The filesystems mounted at `paths` (staging paths of this node's
    /// volumes) are about to be frozen together; undone by thawing each
    /// that is still ours.
    Freeze { paths: Vec<PathBuf> },
}

/// The name an intent is recorded under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntentId(String);

impl std::fmt::Display for IntentId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The intents of one driver's state directory (of kind `T`: the
/// driver's own [`Intent`]s, or a backend's).
#[derive(Debug)]
pub struct Intents<T = Intent> {
    dir: PathBuf,
    next: AtomicU64,
    kind: PhantomData<fn() -> T>,
}

impl Intents<Intent> {
    /// Opens (making it) `<state_dir>/intents`.
    pub fn open(state_dir: &Path) -> Result<Self> {
        Self::open_dir(state_dir.join("intents"))
    }
}

impl<T: Serialize + DeserializeOwned> Intents<T> {
    /// Opens (making it) the folder `dir` of intents of kind `T`.
    pub fn open_dir(dir: PathBuf) -> Result<Self> {
        records::private_dir(&dir)?;
        Ok(Intents {
            dir,
            next: AtomicU64::new(0),
            kind: PhantomData,
        })
    }

    /// Records `intent` durably; its id is unique to this process's life
    /// and every earlier one's (the pid and the start time in it).
    pub fn record(&self, intent: &T) -> Result<IntentId> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let id = IntentId(format!("{}-{since}-{n}", std::process::id()));
        records::write_json(&self.path(&id), intent)?;
        Ok(id)
    }

    /// The intent is carried out or undone: its record goes (durably).
    pub fn done(&self, id: &IntentId) -> Result<()> {
        records::remove(&self.path(&id.clone())).map(|_| ())
    }

    /// Every intent left, oldest name first. A record that does not parse
    /// is set aside (renamed `.bad`) with a warning: nothing can be done
    /// from it.
    pub fn pending(&self) -> Result<Vec<(IntentId, T)>> {
        let mut names = Vec::new();
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| crate::error::Error::io(format!("read {}", self.dir.display()), e))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if records::is_leftover(&name) {
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            if let Some(stem) = name.strip_suffix(".json") {
                names.push(stem.to_string());
            }
        }
        names.sort();
        let mut out = Vec::new();
        for name in names {
            let id = IntentId(name);
            let path = self.path(&id);
            match records::read_json::<T>(&path) {
                Ok(Some(intent)) => out.push((id, intent)),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e.message, "unreadable intent set aside");
                    let _ = std::fs::rename(&path, path.with_extension("bad"));
                }
            }
        }
        Ok(out)
    }

    fn path(&self, id: &IntentId) -> PathBuf {
        self.dir.join(format!("{}.json", id.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_intents_outlive_the_process_until_done() {
        let dir = tempfile::tempdir().unwrap();
        let intents = Intents::open(dir.path()).unwrap();
        let a = intents
            .record(&Intent::Freeze {
                paths: vec!["/a".into()],
            })
            .unwrap();
        let b = intents
            .record(&Intent::Freeze {
                paths: vec!["/b".into(), "/c".into()],
            })
            .unwrap();
        assert_ne!(a, b);
        // Another process's view (a restart): both, in order.
        let again = Intents::open(dir.path()).unwrap();
        let pending = again.pending().unwrap();
        assert_eq!(pending.len(), 2);
        assert_eq!(pending[0].0, a);
        assert_eq!(
            pending[1].1,
            Intent::Freeze {
                paths: vec!["/b".into(), "/c".into()]
            }
        );
        again.done(&a).unwrap();
        again.done(&a).unwrap();
        assert_eq!(
            intents.pending().unwrap(),
            vec![(b.clone(), pending[1].1.clone())]
        );
        // A corrupt record is set aside, not fatal.
        std::fs::write(dir.path().join("intents/9-9-9.json"), b"{not json").unwrap();
        assert_eq!(intents.pending().unwrap().len(), 1);
        assert!(dir.path().join("intents/9-9-9.bad").exists());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("intents"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }
}
