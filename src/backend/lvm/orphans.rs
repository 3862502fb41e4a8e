//! A thin snapshot's lvcreate cut short, and the thin device id it leaves.
//!
//! lvcreate makes a thin snapshot (a snapshot, a restore or a clone in a
//! thin pool) in two steps: it sends the pool `create_snap <id> <origin's
//! id>`, the id one past the highest its metadata names, and only then
//! commits the metadata that names the new LV with it. Killed between the
//! two (the driver died and took it along, or its timeout ran out), it
//! leaves the pool holding a thin device no LV names, and every later
//! snapshot in that pool is refused: lvm picks the same id again, and the
//! pool has it ("Thin pool ... already contain thin device with device_id
//! N", lvm 2.03.16, seen in the guest). (A new thin volume's `create_thin`
//! is not stopped by it: lvm takes that id over. And where the refused
//! snapshot's origin was inactive, lvm queues the id's removal in its
//! metadata, a transaction ahead of the pool, and sends it with its next
//! command on the pool; where the origin was active, as a staged volume's
//! is, it queues nothing, and the pool stays blocked.)
//!
//! So each such lvcreate is recorded first (an intent naming the group,
//! the pool and the LV), and the record goes once lvcreate has answered.
//! One that is left (the driver died), or whose lvcreate failed, is
//! settled at every start and after the failure: under lvm's own lock of
//! the group (no lvm command is half-way through meanwhile), and only
//! while the pool's transaction id in the kernel is the metadata's (no
//! change lvm began is unfinished, and none was committed since the
//! metadata was read), the id one past the highest the metadata names is
//! deleted from the pool if the pool has it: the id the cut-short
//! lvcreate sent, which nothing names. An LV the intent names that the
//! metadata has was made: its intent just goes. An id no intent of ours
//! explains is left alone, and the create fails with lvm's words (see
//! docs/troubleshooting.md).

use super::report::{parse_lvs, Lv};
use super::{DeviceClass, LvmBackend, LVM_TIMEOUT};
use crate::error::{Error, Result};
use crate::exec::Command;
use crate::intents::{IntentId, Intents};
use serde::{Deserialize, Serialize};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// What lvm says when the pool already has the id it picked.
const TAKEN: &str = "already contain thin device with device_id";

/// The intent recorded before each thin snapshot's lvcreate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ThinSnapshot {
    pub vg: String,
    pub pool: String,
    pub lv: String,
}

/// The intents of one lvm backend (`<state-dir>/lvm/<backend>/intents`).
pub(super) type ThinIntents = Intents<ThinSnapshot>;

/// What settling a pool's cut-short thin snapshots came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settled {
    /// The pool held this id, which a cut-short lvcreate of ours left and
    /// no LV names: deleted.
    Deleted(u32),
    /// Nothing of ours was left in the pool (or nothing was recorded).
    Nothing,
    /// lvm's metadata is a transaction ahead of the pool: a change of
    /// lvm's own is queued (after a refused lvcreate with its origin
    /// inactive, lvm queues the removal of the id it tried), sent by its
    /// next command on the pool. Records stay for a later start.
    Queued,
    /// The pool is not active: records stay until it is.
    Inactive,
}

/// A recorded thin snapshot's lvcreate, about to run.
pub(super) struct Noted {
    id: IntentId,
    cut: ThinSnapshot,
}

/// The device-mapper name lvm gives `vg`'s LV `lv` (a `-` inside a name
/// doubled) with its layer.
fn dm_name(vg: &str, lv: &str, layer: &str) -> String {
    format!(
        "{}-{}-{layer}",
        vg.replace('-', "--"),
        lv.replace('-', "--")
    )
}

/// A held lock of lvm's on a volume group: the file lock lvm's commands
/// take (`<locking_dir>/V_<vg>`), released when dropped.
struct GroupLock {
    _file: nix::fcntl::Flock<std::fs::File>,
}

impl GroupLock {
    /// Takes the lock as lvm does: an exclusive flock on the file, checked
    /// to still be the file at that path once held (lvm removes the file
    /// when it lets go of a lock no one else holds).
    async fn take(dir: &Path, vg: &str) -> Result<GroupLock> {
        use nix::fcntl::{Flock, FlockArg};
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(format!("V_{vg}"));
        let err = |e: std::io::Error| Error::io(format!("lock {}", path.display()), e);
        let deadline = Instant::now() + LVM_TIMEOUT;
        // lvm makes its folder when it first locks; so does this.
        std::fs::create_dir_all(dir).map_err(err)?;
        loop {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)
                .map_err(err)?;
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(held) => {
                    let same = match (held.metadata(), std::fs::metadata(&path)) {
                        (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
                        _ => false,
                    };
                    if same {
                        return Ok(GroupLock { _file: held });
                    }
                }
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => {}
                Err((_, e)) => return Err(err(e.into())),
            }
            if Instant::now() > deadline {
                return Err(Error::unavailable(format!(
                    "volume group {vg} stayed locked by lvm for {}s",
                    LVM_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl LvmBackend {
    /// Records the lvcreate that makes `lv` as a thin snapshot of `src`
    /// in `class`, when it is one (a thin source in the class's pool).
    pub(super) async fn note_thin_snapshot(
        &self,
        class: &DeviceClass,
        src: &Lv,
        lv: &str,
    ) -> Result<Option<Noted>> {
        let Some(pool) = &class.thin_pool else {
            return Ok(None);
        };
        if src.pool_lv != *pool {
            return Ok(None);
        }
        self.note(ThinSnapshot {
            vg: class.volume_group.clone(),
            pool: pool.clone(),
            lv: lv.to_string(),
        })
        .await
    }

    /// Records `cut`, about to run, and counts it running (none where
    /// the backend keeps no records).
    async fn note(&self, cut: ThinSnapshot) -> Result<Option<Noted>> {
        let Some(intents) = &self.intents else {
            return Ok(None);
        };
        let (intents, record) = (intents.clone(), cut.clone());
        let id = crate::host::off_worker(
            "recording a thin snapshot's making",
            LVM_TIMEOUT,
            move || intents.record(&record),
        )
        .await?;
        self.running_cuts().insert(id.to_string());
        Ok(Some(Noted { id, cut }))
    }

    /// Runs `cmd`, the lvcreate of a snapshot (judged as [`run_judged`]
    /// does, `cow` taken from the group), settling what it may leave
    /// when it is a thin one `noted` first.
    ///
    /// [`run_judged`]: LvmBackend::run_judged
    pub(super) async fn run_snapshot_lvcreate(
        &self,
        class: &DeviceClass,
        cow: u64,
        noted: Option<Noted>,
        cmd: Command,
    ) -> Result<()> {
        let Some(mut noted) = noted else {
            return self.run_judged(class, cow, cmd).await;
        };
        let mut settled_before = false;
        loop {
            let ran = self.runner.run(cmd.clone()).await;
            self.running_cuts().remove(&noted.id.to_string());
            let e = match ran {
                Ok(_) => {
                    self.forget_cut(&noted.id).await;
                    return Ok(());
                }
                Err(e) => Error::from(e),
            };
            let (vg, pool) = (noted.cut.vg.clone(), noted.cut.pool.clone());
            if !e.message.contains(TAKEN) {
                // Failed some other way (its timeout among them): it may
                // have been cut between its two steps.
                if let Err(s) = self.settle_cuts(&vg, &pool, false).await {
                    tracing::warn!(error = %s.message, pool = %format!("{vg}/{pool}"), "could not settle a thin snapshot's failed lvcreate");
                }
                return Err(self.judge_failure(class, cow, e).await);
            }
            // lvm refused before sending anything: this lvcreate left
            // nothing. The id it found taken is ours only if an earlier
            // lvcreate of ours was cut short in this pool.
            self.forget_cut(&noted.id).await;
            let settled = if settled_before {
                Settled::Nothing
            } else {
                self.settle_cuts(&vg, &pool, true).await?
            };
            settled_before = true;
            match settled {
                Settled::Deleted(_) => {}
                // lvm queued the id's removal itself (its origin was
                // inactive): its next lvcreate sends that first.
                Settled::Queued => tracing::info!(
                    pool = %format!("{vg}/{pool}"),
                    "lvm queued the removal of the thin device id it found taken: running lvcreate again"
                ),
                Settled::Nothing | Settled::Inactive => {
                    return Err(e.context(format!(
                        "thin pool {vg}/{pool} holds a thin device that no LV names and no \
                         cut-short lvcreate of this driver's left: it blocks every snapshot \
                         in the pool until it is removed by hand (see the troubleshooting guide)"
                    )))
                }
            }
            // The id freed, the lvcreate runs again (recorded again).
            let Some(again) = self.note(noted.cut.clone()).await? else {
                return Err(e);
            };
            noted = again;
        }
    }

    fn running_cuts(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.running_cuts.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn forget_cut(&self, id: &IntentId) {
        let Some(intents) = &self.intents else { return };
        let (intents, id) = (intents.clone(), id.clone());
        let shown = id.to_string();
        let done = crate::host::off_worker(
            "removing a thin snapshot's record",
            LVM_TIMEOUT,
            move || intents.done(&id),
        )
        .await;
        if let Err(e) = done {
            // Left, it is settled at the next start: its LV is there.
            tracing::warn!(intent = %shown, error = %e.message, "could not remove a thin snapshot's record");
        }
    }

    /// Settles every thin snapshot's lvcreate recorded in `vg`/`pool`
    /// that is not running now (see the module's text). `always`: reads
    /// the pool's state even with nothing recorded (an lvcreate refused
    /// for a taken id asks whether lvm queued its removal).
    pub(super) async fn settle_cuts(&self, vg: &str, pool: &str, always: bool) -> Result<Settled> {
        let Some(intents) = &self.intents else {
            return Ok(Settled::Nothing);
        };
        let list = intents.clone();
        let pending =
            crate::host::off_worker("reading thin snapshots' records", LVM_TIMEOUT, move || {
                list.pending()
            })
            .await?;
        let running = self.running_cuts().clone();
        let pending: Vec<(IntentId, ThinSnapshot)> = pending
            .into_iter()
            .filter(|(id, c)| c.vg == vg && c.pool == pool && !running.contains(&id.to_string()))
            .collect();
        if pending.is_empty() && !always {
            return Ok(Settled::Nothing);
        }
        let rows = self.pool_ids(vg).await?;
        let mut cut = Vec::new();
        for (id, c) in pending {
            if rows.iter().any(|l| l.lv_name == c.lv) {
                // lvcreate finished: nothing was left.
                self.forget_cut(&id).await;
            } else {
                cut.push((id, c));
            }
        }
        if cut.is_empty() && !always {
            return Ok(Settled::Nothing);
        }
        let Some(pool_row) = rows.iter().find(|l| l.lv_name == pool) else {
            // The pool is gone, and what it held with it.
            for (id, _) in &cut {
                self.forget_cut(id).await;
            }
            return Ok(Settled::Nothing);
        };
        let named = rows
            .iter()
            .filter(|l| l.pool_lv == pool)
            .filter_map(|l| l.thin_id.trim().parse::<u32>().ok())
            .max()
            .unwrap_or(0);
        let next = named + 1;
        let tpool = dm_name(vg, pool, "tpool");
        let _lock = GroupLock::take(&self.lock_dir, vg).await?;
        let status = self
            .runner
            .run(
                Command::new("dmsetup")
                    .timeout(LVM_TIMEOUT)
                    .args(["status", &tpool]),
            )
            .await;
        let Ok(status) = status else {
            // The pool is not active: settled when it is (a later start,
            // or the next snapshot's lvcreate, which activates it).
            return Ok(Settled::Inactive);
        };
        let fields: Vec<&str> = status.stdout.split_whitespace().collect();
        let kernel = (fields.get(2) == Some(&"thin-pool"))
            .then(|| fields.get(3).and_then(|t| t.parse::<u64>().ok()))
            .flatten();
        let meta = pool_row.transaction_id.trim().parse::<u64>().ok();
        if let (Some(k), Some(m)) = (kernel, meta) {
            if m == k + 1 {
                return Ok(Settled::Queued);
            }
        }
        if cut.is_empty() {
            return Ok(Settled::Nothing);
        }
        if kernel.is_none() || kernel != meta {
            tracing::warn!(
                pool = %format!("{vg}/{pool}"),
                kernel = ?kernel,
                metadata = ?meta,
                "the thin pool's transaction ids are not lvm's next: the cut-short snapshot's \
                 id is left alone"
            );
            return Ok(Settled::Nothing);
        }
        let deleted = self
            .runner
            .run(Command::new("dmsetup").timeout(LVM_TIMEOUT).args([
                "message",
                &tpool,
                "0",
                &format!("delete {next}"),
            ]))
            .await;
        let deleted = match deleted {
            Ok(_) => Settled::Deleted(next),
            // The pool has no such id: the cut came before lvcreate sent it.
            Err(e) if e.to_string().contains("No data available") => Settled::Nothing,
            Err(e) => {
                return Err(
                    Error::from(e).context(format!("delete thin device {next} of {vg}/{pool}"))
                )
            }
        };
        let names: Vec<&str> = cut.iter().map(|(_, c)| c.lv.as_str()).collect();
        match deleted {
            Settled::Deleted(id) => tracing::warn!(
                pool = %format!("{vg}/{pool}"),
                lvs = ?names,
                "deleted thin device id {id}, which a cut-short lvcreate of a snapshot left in the pool and no LV names"
            ),
            _ => tracing::info!(
                pool = %format!("{vg}/{pool}"),
                lvs = ?names,
                "a cut-short lvcreate of a snapshot left nothing in the pool"
            ),
        }
        for (id, _) in &cut {
            self.forget_cut(id).await;
        }
        Ok(deleted)
    }

    /// Every LV of group `vg` with its thin id, and each pool's transaction
    /// id: one lvs.
    async fn pool_ids(&self, vg: &str) -> Result<Vec<Lv>> {
        let out = self
            .runner
            .run(
                self.lvm("lvs")
                    .args(["--reportformat", "json", "--units", "b", "--nosuffix", "-o"])
                    .arg("lv_name,vg_name,lv_size,pool_lv,thin_id,transaction_id")
                    .arg(vg),
            )
            .await?;
        parse_lvs(&out.stdout)
    }

    /// Settles, at start, the thin snapshots' lvcreates a driver that died
    /// left recorded, pool by pool.
    pub(super) async fn settle_all_cuts(&self) -> Vec<String> {
        let mut done = Vec::new();
        let mut pools: Vec<(&str, &str)> = self
            .settings
            .device_classes
            .iter()
            .filter_map(|c| Some((c.volume_group.as_str(), c.thin_pool.as_deref()?)))
            .collect();
        pools.sort();
        pools.dedup();
        for (vg, pool) in pools {
            match self.settle_cuts(vg, pool, false).await {
                Ok(Settled::Deleted(id)) => done.push(format!(
                    "deleted thin device id {id} from {vg}/{pool}: a snapshot's lvcreate cut short left it"
                )),
                Ok(Settled::Queued) => done.push(format!(
                    "left the cut-short snapshots of {vg}/{pool} for a later start: lvm has a change of the pool queued"
                )),
                Ok(Settled::Nothing | Settled::Inactive) => {}
                Err(e) => done.push(format!(
                    "could not settle the cut-short snapshots of {vg}/{pool}: {}",
                    e.message
                )),
            }
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_mapper_names_double_the_dashes_inside_names() {
        assert_eq!(dm_name("vg-a", "pool", "tpool"), "vg--a-pool-tpool");
        assert_eq!(dm_name("vg", "my-pool", "tpool"), "vg-my--pool-tpool");
    }

    #[tokio::test]
    async fn the_group_lock_excludes_another_holder_and_is_taken_once_free() {
        let dir = tempfile::tempdir().unwrap();
        let held = GroupLock::take(dir.path(), "vg0").await.unwrap();
        // lvm's own lock on the file: refused while ours is held.
        let other = std::fs::File::open(dir.path().join("V_vg0")).unwrap();
        let other = nix::fcntl::Flock::lock(other, nix::fcntl::FlockArg::LockExclusiveNonblock);
        assert!(other.is_err());
        drop(other);
        let waiter = tokio::spawn({
            let dir = dir.path().to_path_buf();
            async move { GroupLock::take(&dir, "vg0").await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished());
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
