//! The exports' snapshots: the store's, taken while the hosts' writes are
//! held where the store's own snapshot is not one instant, and groups cut
//! with every member in use held.

use super::Exports;
use crate::error::{Error, Result};
use crate::plugin::{CreateSnapshot, GroupCutter, SnapshotInfo, SnapshotInstant, VolumeId};
use std::time::Duration;

/// How long a group snapshot may hold its members' writers: well inside
/// a host's command timeout (Linux SCSI: 30 s), past which it aborts the
/// commands held.
const HOLD_DEADLINE: Duration = Duration::from_secs(20);

impl Exports {
    /// The hosts write from afar: a store whose snapshot is one instant
    /// holds the volume itself; another store's copy is held by the
    /// volume's hold device where the host has device-mapper.
    pub fn instant(&self) -> SnapshotInstant {
        match self
            .store
            .here()
            .and_then(|s| s.snapshotter())
            .map(|s| s.instant())
        {
            Some(SnapshotInstant::Own) => SnapshotInstant::Own,
            Some(_) if self.holds.is_some() => SnapshotInstant::Held,
            _ => SnapshotInstant::Unheld,
        }
    }

    /// CreateSnapshot: the store's, with the volume's writers held unless
    /// the store's snapshot is one instant of its own.
    pub async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        self.own_volume(&req.source).map_err(|_| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        let own = self.store.get()?.capabilities().snapshot_instant == SnapshotInstant::Own;
        if own {
            return self.store.create_snapshot(req).await;
        }
        self.while_held(&[&req.source], false, self.store.create_snapshot(req))
            .await
    }

    /// Runs `cut` while the writers of every volume of `sources` that is
    /// in use are held: each one's hold device suspended (what is in
    /// flight finishes, what comes next waits, flushes included), for at
    /// most [`HOLD_DEADLINE`], then resumed. A volume in use without a hold
    /// device (no device-mapper on the target host, or made before holds
    /// were) fails the call when `required`; otherwise `cut` runs with its
    /// writers going on. A driver that dies while holding leaves the holds
    /// suspended: every start resumes its own ([`Exports::start`]).
    pub async fn while_held<T>(
        &self,
        sources: &[&VolumeId],
        required: bool,
        cut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let mut held = Vec::new();
        for source in sources {
            self.own_volume(source)?;
            let record = self.load(source)?.ok_or_else(|| Error::no_volume(source))?;
            let users = self.users(&record).await?;
            if users.is_empty() {
                continue;
            }
            match (&self.holds, &record.hold) {
                (Some(_), Some(name)) => held.push(name.clone()),
                _ if !required => tracing::warn!(
                    volume = %source,
                    "in use and served without a hold device: its snapshot is copied under its writers"
                ),
                _ => {
                    return Err(Error::precondition(format!(
                        "volume {source} is in use by {} and served without a hold device (this \
                         target host has no device-mapper, or the {} was made before \
                         holds were: it gets one when it is next made): nothing can hold its \
                         hosts' writes for a group snapshot; stop the workload, then \
                         snapshot",
                        users.into_iter().collect::<Vec<_>>().join(", "),
                        self.terms().export,
                    )))
                }
            }
        }
        let Some(holds) = self.holds.as_ref().filter(|_| !held.is_empty()) else {
            return cut.await;
        };
        let mut suspended = Vec::new();
        let mut outcome = None;
        for name in &held {
            match holds.suspend(name).await {
                Ok(()) => suspended.push(name),
                Err(e) => {
                    outcome = Some(Err(e));
                    break;
                }
            }
        }
        let mut outcome = match outcome {
            Some(failed) => failed,
            None => {
                (self.held)();
                match tokio::time::timeout(HOLD_DEADLINE, cut).await {
                    Ok(r) => r,
                    Err(_) => Err(Error::unavailable(format!(
                        "the snapshots took longer than the {} s their writers may be held: \
                         not taken",
                        HOLD_DEADLINE.as_secs()
                    ))),
                }
            }
        };
        for name in suspended {
            if let Err(e) = holds.resume(name).await {
                tracing::error!(hold = %name, error = %e.message, "could not resume a hold device");
                if outcome.is_ok() {
                    outcome = Err(e);
                }
            }
        }
        outcome
    }
}

#[async_trait::async_trait]
impl GroupCutter for Exports {
    async fn cut_group(&self, members: &[CreateSnapshot]) -> Result<()> {
        // Writers are remote hosts. Members nobody uses have none
        // (ControllerPublish waits on the group's guard meanwhile), so
        // their store snapshots, one after another, show the same instant.
        // Members in use are held first (see `while_held`), then every
        // member snapshotted, then all let go.
        let sources: Vec<&VolumeId> = members.iter().map(|m| &m.source).collect();
        self.while_held(&sources, true, async {
            for m in members {
                self.store.create_snapshot(m).await?;
            }
            Ok(())
        })
        .await
    }
}
