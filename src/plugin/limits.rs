//! The I/O limits ControllerModifyVolume changed, per volume, where the
//! node that publishes the volume reads them: a volume's context carries
//! the limits it was made with (its class's, or the VolumeAttributesClass
//! its claim named then), and a publish's limits are those with every
//! change recorded here made over them, in order.
//!
//! The book is one small file, replaced whole and durably at each change
//! (a modify the CO was told is done outlives a power loss). It is kept
//! where the controller and the node are one process, with the volumes
//! (see docs/io-limits.md): the node reads it at every publish, and the
//! controller hands a change to the node's publishes itself
//! ([`Relimit`]).

use super::VolumeId;
use crate::error::Result;
use crate::host::iolimit::LimitChanges;
use crate::sync::LockExt;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub struct LimitBook {
    path: PathBuf,
    changes: Mutex<BTreeMap<String, LimitChanges>>,
}

/// The book's file: each changed volume's changes, by its id.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct File {
    volumes: BTreeMap<String, LimitChanges>,
}

impl LimitBook {
    /// Opens the book in `dir` (made private if missing).
    pub fn open(dir: &Path) -> Result<Self> {
        crate::records::private_dir(dir)?;
        let path = dir.join("limits.json");
        let changes = crate::records::read_json::<File>(&path)?
            .unwrap_or_default()
            .volumes;
        Ok(Self {
            path,
            changes: Mutex::new(changes),
        })
    }

    /// Whether the book has `id` (changed, or said to be unchanged).
    pub fn has(&self, id: &VolumeId) -> bool {
        self.changes.locked().contains_key(&id.to_string())
    }

    /// The changes made to `id`'s limits since it was made (none: empty).
    pub fn get(&self, id: &VolumeId) -> LimitChanges {
        self.changes
            .locked()
            .get(&id.to_string())
            .cloned()
            .unwrap_or_default()
    }

    /// Records `change` over what `id` had, on disk first.
    pub fn change(&self, id: &VolumeId, change: &LimitChanges) -> Result<()> {
        self.replace(|all| {
            let now = all.entry(id.to_string()).or_default();
            *now = now.then(change);
            true
        })
    }

    /// Records `changes` as all that `id`'s limits have had (what a
    /// controller says the volume has now).
    pub fn set(&self, id: &VolumeId, changes: &LimitChanges) -> Result<()> {
        self.replace(|all| {
            let key = id.to_string();
            if all.get(&key) == Some(changes) {
                return false;
            }
            all.insert(key, changes.clone());
            true
        })
    }

    /// Every volume's changes.
    pub fn all(&self) -> BTreeMap<String, LimitChanges> {
        self.changes.locked().clone()
    }

    /// Forgets `id` (deleted); one never changed is fine.
    pub fn forget(&self, id: &VolumeId) -> Result<()> {
        self.replace(|all| all.remove(&id.to_string()).is_some())
    }

    /// The book as `edit` leaves it, written whole (when it says it
    /// changed anything) before it is the book in memory.
    fn replace(
        &self,
        edit: impl FnOnce(&mut BTreeMap<String, LimitChanges>) -> bool,
    ) -> Result<()> {
        let mut all = self.changes.locked();
        let mut next = all.clone();
        if edit(&mut next) {
            crate::records::write_json(
                &self.path,
                &File {
                    volumes: next.clone(),
                },
            )?;
            *all = next;
        }
        Ok(())
    }
}

/// What sets a volume's changed limits on the pods that use it now: the
/// node, when it is the controller's own process.
#[async_trait::async_trait]
pub trait Relimit: Send + Sync {
    /// Sets `id`'s limits, as the book has them now, for every pod it is
    /// published to here. Returns how many publishes were set; a pod whose
    /// limits could not be set is said in the volume's health.
    async fn relimit(&self, id: &VolumeId) -> usize;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::iolimit::Limits;

    fn changes(pairs: &[(&str, &str)]) -> LimitChanges {
        LimitChanges::parse(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
        .unwrap()
    }

    /// A modify waits until a node takes its offer; an offer made over
    /// an untaken one carries both; one no node takes is UNAVAILABLE, and
    /// stays offered.
    #[tokio::test]
    async fn an_offer_is_done_when_a_node_takes_it() {
        let relay = std::sync::Arc::new(Relay::default());
        let id = VolumeId::parse("lvm:vg.fv-a").unwrap();
        let e = relay
            .offer(
                &id,
                &changes(&[("readIops", "10")]),
                std::time::Duration::from_millis(50),
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind, crate::error::Kind::Unavailable, "{e}");
        let waiting = {
            let relay = relay.clone();
            let id = id.clone();
            tokio::spawn(async move {
                relay
                    .offer(
                        &id,
                        &changes(&[("writeIops", "20")]),
                        std::time::Duration::from_secs(30),
                    )
                    .await
            })
        };
        let offer = loop {
            match relay.open().into_iter().find(|o| o.generation == 2) {
                Some(o) => break o,
                None => tokio::task::yield_now().await,
            }
        };
        assert_eq!(
            offer.changes,
            changes(&[("readIops", "10"), ("writeIops", "20")])
        );
        // An older offer's taking does not end the newer one's wait.
        relay.took(&offer.volume, 1);
        assert_eq!(relay.open().len(), 1);
        relay.took(&offer.volume, 2);
        waiting.await.unwrap().unwrap();
        assert!(relay.open().is_empty());
    }

    #[test]
    fn a_volume_s_changes_add_up_outlive_a_reopen_and_go_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let book = LimitBook::open(dir.path()).unwrap();
        let a = VolumeId::parse("file:a").unwrap();
        let b = VolumeId::parse("file:b").unwrap();
        assert!(book.get(&a).is_empty());
        book.change(&a, &changes(&[("readIops", "10"), ("writeIops", "20")]))
            .unwrap();
        book.change(&a, &changes(&[("readIops", "max")])).unwrap();
        book.change(&b, &changes(&[("writeBps", "1Mi")])).unwrap();
        let class = Limits {
            read_iops: Some(5),
            ..Limits::default()
        };
        let want = Limits {
            write_iops: Some(20),
            ..Limits::default()
        };
        assert_eq!(class.changed(&book.get(&a)), want);
        let book = LimitBook::open(dir.path()).unwrap();
        assert_eq!(class.changed(&book.get(&a)), want);
        book.forget(&a).unwrap();
        book.forget(&a).unwrap();
        let book = LimitBook::open(dir.path()).unwrap();
        assert!(book.get(&a).is_empty());
        assert_eq!(book.get(&b).0["writeBps"], Some(1 << 20));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("limits.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
    }
}

/// A change to a node-local volume's limits, offered by the central
/// controller of node-local volumes (which keeps no volume) until the
/// node that holds the volume takes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Offer {
    pub volume: String,
    /// Which offer of the volume's this is (the newest carries every
    /// change not yet taken).
    pub generation: u64,
    pub changes: LimitChanges,
}

/// The central controller's offers: ControllerModifyVolume of a node-local
/// volume waits until the volume's node has taken its change (kept it in
/// its own book, in its state directory, and set it on its pods), so the
/// CO is told it is done only once the change lasts. Offers are kept in
/// memory only: a controller that dies with one untaken never said it was
/// done, and the CO's retry offers it again.
#[derive(Default)]
pub struct Relay {
    state: Mutex<RelayState>,
    taken: tokio::sync::Notify,
}

#[derive(Default)]
struct RelayState {
    next: u64,
    open: BTreeMap<String, Offer>,
    /// Per volume, the newest generation a node took.
    taken: BTreeMap<String, u64>,
}

impl Relay {
    /// Offers `changes` to `id`'s node (over any change still offered)
    /// and waits, at most `patience`, until a node took it: UNAVAILABLE
    /// when none did (the offer stays, for the node to take and the CO's
    /// retry to find taken).
    pub async fn offer(
        &self,
        id: &VolumeId,
        changes: &LimitChanges,
        patience: std::time::Duration,
    ) -> Result<()> {
        let key = id.to_string();
        let generation = {
            let mut s = self.state.locked();
            s.next += 1;
            let generation = s.next;
            let merged = match s.open.get(&key) {
                Some(o) => o.changes.then(changes),
                None => changes.clone(),
            };
            s.open.insert(
                key.clone(),
                Offer {
                    volume: key.clone(),
                    generation,
                    changes: merged,
                },
            );
            generation
        };
        let until = tokio::time::Instant::now() + patience;
        loop {
            let notified = self.taken.notified();
            if self
                .state
                .locked()
                .taken
                .get(&key)
                .is_some_and(|&g| g >= generation)
            {
                return Ok(());
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return Err(crate::error::Error::unavailable(format!(
                    "no node took the change to volume {id}'s I/O limits within {patience:?}: \
                     the node that holds it asks this controller every limits_refresh_seconds \
                     (is its node plugin running?); the change stays offered"
                )));
            }
        }
    }

    /// What is offered now.
    pub fn open(&self) -> Vec<Offer> {
        self.state.locked().open.values().cloned().collect()
    }

    /// A node took `volume`'s offer of `generation`.
    pub fn took(&self, volume: &str, generation: u64) {
        let mut s = self.state.locked();
        if s.open
            .get(volume)
            .is_some_and(|o| o.generation == generation)
        {
            s.open.remove(volume);
        }
        let t = s.taken.entry(volume.to_string()).or_default();
        *t = (*t).max(generation);
        drop(s);
        self.taken.notify_waiters();
    }
}
