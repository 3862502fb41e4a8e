//! The controller's ledger of attachments: which volumes ControllerPublish
//! granted to which node and ControllerUnpublish has not taken back. A
//! publish to a node that holds its limit is refused, RESOURCE_EXHAUSTED,
//! before anything is attached (the kubelet then reads the node's count
//! again at once, KEP-4876).
//!
//! A publish reserves its place first (counted with the node's grants, so
//! two publishes racing for the last place cannot both have it) and keeps
//! it only when the backend attached; a publish already granted is
//! answered again whatever the count. The ledger is a journal under the
//! state dir: a restarted controller still knows what it granted.
//!
//! The place is written to the journal before the backend attaches, and
//! taken out again if the attach fails: a controller that dies between
//! the two finds the place held when it starts (the volume may be
//! attached: the backend's grant outlives the process). It stays held
//! until the CO's retry of the publish (answered as held, the backend's
//! attach done again) or its unpublish settles it: a node is never given
//! more than its limit, and a grant the driver made is never forgotten.

use super::VolumeId;
use crate::error::{Error, Result};
use crate::records::Journal;
use crate::sync::LockExt;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

/// One grant: a volume and the node (by name) it is attached to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
struct Grant {
    volume: String,
    node: String,
}

pub struct Ledger {
    grants: Journal<(String, String), Grant>,
    /// Per node: grants held, and publishes under way.
    tally: Mutex<HashMap<String, Count>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Count {
    held: u64,
    pending: u64,
}

/// A place held for one publish while the backend attaches; given back
/// when dropped unless [`Reservation::commit`] kept it.
pub struct Reservation<'a> {
    ledger: &'a Ledger,
    /// `None`: the node holds the volume already.
    grant: Option<Grant>,
}

fn key(g: &Grant) -> (String, String) {
    (g.volume.clone(), g.node.clone())
}

impl Ledger {
    /// Opens the ledger in `dir` (made private if missing).
    pub fn open(dir: &Path) -> Result<Self> {
        crate::records::private_dir(dir)?;
        let grants: Journal<(String, String), Grant> =
            Journal::open(&dir.join("attached.log"), [])?;
        let mut tally: HashMap<String, Count> = HashMap::new();
        for g in grants.values() {
            tally.entry(g.node.clone()).or_default().held += 1;
        }
        Ok(Self {
            grants,
            tally: Mutex::new(tally),
        })
    }

    /// Holds a place on `node` (a node name) for `volume`, within `limit`
    /// volumes (`None`: no limit).
    pub fn reserve(
        &self,
        volume: &VolumeId,
        node: &str,
        limit: Option<u64>,
    ) -> Result<Reservation<'_>> {
        let grant = Grant {
            volume: volume.to_string(),
            node: node.to_string(),
        };
        let mut tally = self.tally.locked();
        if self.grants.get(&key(&grant)).is_some() {
            return Ok(Reservation {
                ledger: self,
                grant: None,
            });
        }
        let count = tally.entry(grant.node.clone()).or_default();
        if let Some(limit) = limit {
            if count.held + count.pending >= limit {
                return Err(Error::exhausted(format!(
                    "node {node} has {} volumes of this driver attached{} and takes at most \
                     {limit} (max_volumes_per_node): volume {volume} is not attached",
                    count.held,
                    match count.pending {
                        0 => String::new(),
                        n => format!(" and {n} being attached"),
                    }
                )));
            }
        }
        // Durable before the backend attaches (see the module's text).
        self.grants.put(key(&grant), grant.clone())?;
        count.pending += 1;
        Ok(Reservation {
            ledger: self,
            grant: Some(grant),
        })
    }

    /// Takes back the grants of `volume`: to `node` (a node name), or to
    /// every node.
    pub fn release(&self, volume: &VolumeId, node: Option<&str>) -> Result<()> {
        let volume = volume.to_string();
        let mut tally = self.tally.locked();
        let gone = self
            .grants
            .filtered(|g| g.volume == volume && node.is_none_or(|n| g.node == n));
        for g in gone {
            self.grants.remove(&key(&g))?;
            if let Some(c) = tally.get_mut(&g.node) {
                c.held = c.held.saturating_sub(1);
            }
        }
        Ok(())
    }

    /// Makes the ledger's grants of `backend`'s volumes what the backend
    /// says they are (`grants`: volume and node name): those it does not
    /// name go, those missing are added. Called at start, before any
    /// publish; answers how many grants were added and removed.
    pub fn adopt(&self, backend: &str, grants: &[(VolumeId, String)]) -> Result<(usize, usize)> {
        let truth: Vec<Grant> = grants
            .iter()
            .map(|(v, n)| Grant {
                volume: v.to_string(),
                node: n.clone(),
            })
            .collect();
        let mut tally = self.tally.locked();
        let stale = self.grants.filtered(|g| {
            VolumeId::parse(&g.volume).is_ok_and(|v| v.backend() == backend) && !truth.contains(g)
        });
        for g in &stale {
            self.grants.remove(&key(g))?;
            if let Some(c) = tally.get_mut(&g.node) {
                c.held = c.held.saturating_sub(1);
            }
        }
        let mut added = 0;
        for g in truth {
            if self.grants.get(&key(&g)).is_none() {
                self.grants.put(key(&g), g.clone())?;
                tally.entry(g.node).or_default().held += 1;
                added += 1;
            }
        }
        Ok((added, stale.len()))
    }

    /// How many volumes `node` holds.
    pub fn held(&self, node: &str) -> u64 {
        self.tally.locked().get(node).map_or(0, |c| c.held)
    }
}

impl Reservation<'_> {
    /// Keeps the place: the volume is attached to the node.
    pub fn commit(mut self) -> Result<()> {
        let Some(grant) = self.grant.take() else {
            return Ok(());
        };
        let mut tally = self.ledger.tally.locked();
        let count = tally.entry(grant.node.clone()).or_default();
        count.pending = count.pending.saturating_sub(1);
        count.held += 1;
        Ok(())
    }
}

impl Drop for Reservation<'_> {
    /// The attach failed (or the call was cancelled): the place goes back,
    /// from the journal too.
    fn drop(&mut self) {
        if let Some(g) = &self.grant {
            let mut tally = self.ledger.tally.locked();
            if let Err(e) = self.ledger.grants.remove(&key(g)) {
                tracing::error!(volume = %g.volume, node = %g.node, error = %e.message, "could not give an attach place back");
            }
            if let Some(c) = tally.get_mut(&g.node) {
                c.pending = c.pending.saturating_sub(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

    fn vol(n: u32) -> VolumeId {
        VolumeId::parse(&format!("file:v{n}")).unwrap()
    }

    /// A ledger started empty (a controller pod replaced on another node)
    /// takes the grants its backends keep: the node's places are held
    /// again, and a grant the backend no longer has is dropped; another
    /// backend's grants are left as they are.
    #[test]
    fn an_empty_ledger_adopts_the_grants_the_backend_keeps() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let other = VolumeId::parse("rbd:x").unwrap();
        ledger.reserve(&other, "b", None).unwrap().commit().unwrap();
        ledger
            .reserve(&vol(9), "b", None)
            .unwrap()
            .commit()
            .unwrap();
        let kept = [(vol(1), "a".to_string()), (vol(2), "a".to_string())];
        assert_eq!(ledger.adopt("file", &kept).unwrap(), (2, 1));
        assert_eq!(ledger.held("a"), 2);
        assert_eq!(ledger.held("b"), 1, "rbd:x stays, file:v9 went");
        let e = ledger.reserve(&vol(3), "a", Some(2)).err().unwrap();
        assert_eq!(e.kind, Kind::ResourceExhausted);
        // A grant the backend keeps is answered as held.
        ledger
            .reserve(&vol(1), "a", Some(2))
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(ledger.adopt("file", &kept).unwrap(), (0, 0));
        drop(ledger);
        let again = Ledger::open(dir.path()).unwrap();
        assert_eq!(again.held("a"), 2, "adopted grants are in the journal");
    }

    /// A place is on disk from the reservation on: a failed attach gives
    /// it back (from the journal too), and a controller that dies before
    /// the attach answered finds it held when it starts again.
    #[test]
    fn a_reserved_place_outlives_a_death_and_a_failed_attach_gives_it_back() {
        let dir = tempfile::tempdir().unwrap();
        // (One ledger open at a time: opening rewrites the journal.)
        let ledger = Ledger::open(dir.path()).unwrap();
        drop(ledger.reserve(&vol(0), "a", Some(1)).unwrap());
        drop(ledger);
        let ledger = Ledger::open(dir.path()).unwrap();
        assert_eq!(ledger.held("a"), 0);
        // The process dies with the reservation open.
        std::mem::forget(ledger.reserve(&vol(2), "a", Some(1)).unwrap());
        drop(ledger);
        let again = Ledger::open(dir.path()).unwrap();
        assert_eq!(again.held("a"), 1);
        let e = again.reserve(&vol(3), "a", Some(1)).err().unwrap();
        assert_eq!(e.kind, Kind::ResourceExhausted);
        // The CO's retry of that publish is answered as held; its
        // unpublish frees the place.
        again
            .reserve(&vol(2), "a", Some(1))
            .unwrap()
            .commit()
            .unwrap();
        again.release(&vol(2), Some("a")).unwrap();
        assert_eq!(again.held("a"), 0);
        again
            .reserve(&vol(3), "a", Some(1))
            .unwrap()
            .commit()
            .unwrap();
    }

    #[test]
    fn a_node_at_its_limit_is_refused_until_a_volume_leaves() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        for n in 0..3 {
            ledger
                .reserve(&vol(n), "a", Some(3))
                .unwrap()
                .commit()
                .unwrap();
        }
        let e = ledger.reserve(&vol(3), "a", Some(3)).err().unwrap();
        assert_eq!(e.kind, Kind::ResourceExhausted);
        assert!(e.message.contains("node a has 3 volumes"), "{}", e.message);
        // Another node has its own count; a volume held is answered again.
        ledger
            .reserve(&vol(3), "b", Some(3))
            .unwrap()
            .commit()
            .unwrap();
        ledger
            .reserve(&vol(1), "a", Some(3))
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(ledger.held("a"), 3);
        ledger.release(&vol(1), Some("a")).unwrap();
        ledger
            .reserve(&vol(3), "a", Some(3))
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(ledger.held("a"), 3);
        assert_eq!(ledger.held("b"), 1);
    }

    #[test]
    fn a_publish_under_way_holds_its_place_and_a_failed_one_gives_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let first = ledger.reserve(&vol(0), "a", Some(1)).unwrap();
        let e = ledger.reserve(&vol(1), "a", Some(1)).err().unwrap();
        assert!(e.message.contains("1 being attached"), "{}", e.message);
        drop(first); // the backend failed
        assert_eq!(ledger.held("a"), 0);
        ledger
            .reserve(&vol(1), "a", Some(1))
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(ledger.held("a"), 1);
    }

    #[test]
    fn grants_outlive_a_restart_and_a_volume_released_everywhere_leaves_every_node() {
        let dir = tempfile::tempdir().unwrap();
        {
            let ledger = Ledger::open(dir.path()).unwrap();
            ledger
                .reserve(&vol(0), "a", None)
                .unwrap()
                .commit()
                .unwrap();
            ledger
                .reserve(&vol(0), "b", None)
                .unwrap()
                .commit()
                .unwrap();
            ledger
                .reserve(&vol(1), "a", None)
                .unwrap()
                .commit()
                .unwrap();
        }
        let ledger = Ledger::open(dir.path()).unwrap();
        assert_eq!((ledger.held("a"), ledger.held("b")), (2, 1));
        assert!(ledger.reserve(&vol(2), "a", Some(2)).is_err());
        ledger.release(&vol(0), None).unwrap();
        assert_eq!((ledger.held("a"), ledger.held("b")), (1, 0));
        drop(ledger);
        let ledger = Ledger::open(dir.path()).unwrap();
        assert_eq!((ledger.held("a"), ledger.held("b")), (1, 0));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("attached.log"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "the ledger is root's alone");
    }
}
