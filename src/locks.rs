//! Per-volume operation guards. A second operation on a busy key is refused
//! at once with ABORTED (never queued), as the CSI spec allows. Keys can be
//! held exclusively or shared, so that publishes of one volume to different
//! targets run side by side while stage and unstage exclude them all.

use crate::error::{Error, Result};
use crate::id::{GroupSnapshotId, SnapshotId, VolumeId};
use crate::sync::LockExt;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// A key of the one guard table the controller and node services share.
/// Every operation takes the keys of every id it touches: its own
/// exclusively, a content source or the volume of a per-target publish
/// shared.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Key {
    /// A volume, by id.
    Volume(VolumeId),
    /// A snapshot, by id.
    Snapshot(SnapshotId),
    /// A group snapshot, by id.
    GroupSnapshot(GroupSnapshotId),
    /// A CreateVolume name: two names may not race to one id, nor one
    /// name to two backends.
    VolumeName(String),
    /// A CreateSnapshot name.
    SnapshotName(String),
    /// A node-side publish target.
    Target(PathBuf),
    /// A controller-side publish of a volume to a node.
    Publish(VolumeId, String),
}

/// As ABORTED names the key.
impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::Volume(id) => write!(f, "volume {id}"),
            Key::Snapshot(id) => write!(f, "snapshot {id}"),
            Key::GroupSnapshot(id) => write!(f, "group snapshot {id}"),
            Key::VolumeName(name) => write!(f, "volume name {name}"),
            Key::SnapshotName(name) => write!(f, "snapshot name {name}"),
            Key::Target(path) => write!(f, "target {}", path.display()),
            Key::Publish(id, node) => write!(f, "publish {id} to {node}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Exclusive,
    Shared(usize),
}

/// A table of busy keys.
#[derive(Debug, Default, Clone)]
pub struct OpLocks {
    table: Arc<Mutex<HashMap<Key, Held>>>,
}

/// Holds keys until dropped.
#[derive(Debug)]
pub struct OpGuard {
    table: Arc<Mutex<HashMap<Key, Held>>>,
    exclusive: Vec<Key>,
    shared: Vec<Key>,
}

impl OpLocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes every key in `exclusive` exclusively and every key in `shared`
    /// shared, all or nothing. ABORTED names the first busy key.
    pub fn try_lock(&self, exclusive: &[Key], shared: &[Key]) -> Result<OpGuard> {
        let mut table = self.table.locked();
        for key in exclusive {
            if table.contains_key(key) {
                return Err(Error::aborted(format!(
                    "an operation on {key} is already in progress"
                )));
            }
        }
        for key in shared {
            if table.get(key) == Some(&Held::Exclusive) || exclusive.contains(key) {
                return Err(Error::aborted(format!(
                    "an operation on {key} is already in progress"
                )));
            }
        }
        for key in exclusive {
            table.insert(key.clone(), Held::Exclusive);
        }
        for key in shared {
            let entry = table.entry(key.clone()).or_insert(Held::Shared(0));
            if let Held::Shared(n) = entry {
                *n += 1;
            }
        }
        Ok(OpGuard {
            table: self.table.clone(),
            exclusive: exclusive.to_vec(),
            shared: shared.to_vec(),
        })
    }

    /// Takes `keys` exclusively.
    pub fn try_exclusive(&self, keys: &[Key]) -> Result<OpGuard> {
        self.try_lock(keys, &[])
    }

    /// How many keys are held (for tests and metrics).
    pub fn held(&self) -> usize {
        self.table.locked().len()
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        let mut table = self.table.locked();
        for key in &self.exclusive {
            table.remove(key);
        }
        for key in &self.shared {
            if let Some(Held::Shared(n)) = table.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    table.remove(key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

    fn k(s: &str) -> Key {
        Key::VolumeName(s.to_string())
    }

    #[test]
    fn keys_read_as_before() {
        let id = VolumeId::parse("file:a").unwrap();
        assert_eq!(Key::Volume(id.clone()).to_string(), "volume file:a");
        assert_eq!(
            Key::Publish(id, "n1".into()).to_string(),
            "publish file:a to n1"
        );
        assert_eq!(Key::Target("/t".into()).to_string(), "target /t");
    }

    #[test]
    fn second_exclusive_is_aborted_and_freed_on_drop() {
        let locks = OpLocks::new();
        let g = locks.try_exclusive(&[k("vol:a")]).unwrap();
        let err = locks.try_exclusive(&[k("vol:a")]).unwrap_err();
        assert_eq!(err.kind, Kind::Aborted);
        assert!(err.message.contains("vol:a"));
        assert!(locks.try_exclusive(&[k("vol:b")]).is_ok());
        drop(g);
        assert_eq!(locks.held(), 0);
        assert!(locks.try_exclusive(&[k("vol:a")]).is_ok());
    }

    #[test]
    fn shared_holders_coexist_but_exclude_exclusive() {
        let locks = OpLocks::new();
        let p1 = locks.try_lock(&[k("t:1")], &[k("vol:a")]).unwrap();
        let p2 = locks.try_lock(&[k("t:2")], &[k("vol:a")]).unwrap();
        assert_eq!(
            locks.try_lock(&[k("t:1")], &[k("vol:a")]).unwrap_err().kind,
            Kind::Aborted
        );
        assert_eq!(
            locks.try_exclusive(&[k("vol:a")]).unwrap_err().kind,
            Kind::Aborted
        );
        drop(p1);
        assert!(locks.try_exclusive(&[k("vol:a")]).is_err());
        drop(p2);
        let stage = locks.try_exclusive(&[k("vol:a")]).unwrap();
        assert!(locks.try_lock(&[k("t:3")], &[k("vol:a")]).is_err());
        drop(stage);
        assert_eq!(locks.held(), 0);
    }

    #[test]
    fn all_or_nothing() {
        let locks = OpLocks::new();
        let _g = locks.try_exclusive(&[k("b")]).unwrap();
        assert!(locks.try_exclusive(&[k("a"), k("b")]).is_err());
        // "a" was not left behind by the failed attempt.
        assert!(locks.try_exclusive(&[k("a")]).is_ok());
    }

    #[test]
    fn concurrent_attempts_admit_exactly_one() {
        let locks = OpLocks::new();
        // All eight try at once, and the winner holds on until every
        // attempt has been made: no clock involved.
        let start = std::sync::Arc::new(std::sync::Barrier::new(8));
        let tried = std::sync::Arc::new(std::sync::Barrier::new(8));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let locks = locks.clone();
                let (start, tried) = (start.clone(), tried.clone());
                std::thread::spawn(move || {
                    start.wait();
                    let attempt = locks.try_exclusive(&[k("vol:x")]);
                    tried.wait();
                    attempt.map(drop)
                })
            })
            .collect();
        let ok = handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(Result::is_ok)
            .count();
        assert_eq!(ok, 1);
    }
}
