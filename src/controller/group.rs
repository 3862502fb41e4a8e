//! Group snapshots (the GroupController service): several volumes of one
//! backend snapshotted at one instant. For backends whose members are
//! ordinary snapshots ([`GroupSnapshots::Frozen`]), this module takes them
//! itself: every source volume's operation guard, the staged filesystems
//! of the sources frozen together by the node, one snapshot per source,
//! all thawed; a group that did not finish leaves nothing.

use super::{split_parameters, ControllerOps};
use crate::error::{Error, Result};
use crate::locks::Key;
use crate::plugin::{
    Backend, CreateSnapshot, GroupRecord, GroupSnapshotId, GroupSnapshots, GroupStore, Quiesce,
    Secrets, SnapshotId, SnapshotInfo, VolumeId,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long the members' filesystems may stay frozen: every member's
/// snapshot is cut within it, or the group fails (and leaves nothing).
pub const FREEZE_DEADLINE: Duration = Duration::from_secs(60);

/// A validated CreateVolumeGroupSnapshot request.
#[derive(Debug, Clone)]
pub struct NewGroupSnapshot {
    pub name: String,
    pub sources: Vec<VolumeId>,
    pub parameters: BTreeMap<String, String>,
    pub secrets: Secrets,
}

/// A group snapshot as the CO sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSnapshotInfo {
    pub id: GroupSnapshotId,
    pub snapshots: Vec<SnapshotInfo>,
    pub created: SystemTime,
    pub ready: bool,
}

/// A group found: its id, its backend, its record.
type Found = (GroupSnapshotId, Arc<dyn Backend>, GroupRecord);

/// The name of a member's snapshot: the group's and its source's.
fn member_name(group: &str, source: &VolumeId) -> String {
    format!("{group}/{source}")
}

impl ControllerOps {
    /// Keeps group snapshots in `store`, freezing staged members through
    /// `quiesce` (none: only volumes no node here stages can be grouped).
    pub fn with_groups(mut self, store: GroupStore, quiesce: Option<Arc<dyn Quiesce>>) -> Self {
        self.groups = Some(store);
        self.quiesce = quiesce;
        self
    }

    /// At start, before anything is served: a group snapshot an earlier
    /// run recorded and did not finish (the driver died taking it) has the
    /// members it made deleted and its record removed, so that nothing it
    /// made outlives it unnamed when no retry comes. A backend that needs
    /// the call's secrets to delete (rbd without a user of its own) keeps
    /// it for the CO's retry, which does the same first. Answers how many
    /// were settled.
    pub async fn settle_groups(&self) -> usize {
        let Some(store) = &self.groups else {
            return 0;
        };
        let found = match store.incomplete() {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the group snapshot records");
                return 0;
            }
        };
        let mut settled = 0;
        for (id, record) in found {
            let Some(backend) = self.backend(id.backend()) else {
                continue;
            };
            let undone = match self
                .remove_members(backend.as_ref(), &record, &Secrets::default())
                .await
            {
                Ok(()) => store.remove(&id),
                Err(e) => Err(e),
            };
            match undone {
                Ok(()) => {
                    settled += 1;
                    tracing::info!(group = %id, name = %record.name, "a group snapshot an earlier run left unfinished is undone");
                }
                Err(e) => tracing::warn!(
                    group = %id,
                    name = %record.name,
                    error = %e,
                    "a group snapshot an earlier run left unfinished is kept for the CO's retry"
                ),
            }
        }
        settled
    }

    /// Whether group snapshots are answered here (a backend that cannot
    /// take them says why).
    pub fn groups_served(&self) -> bool {
        self.groups.is_some() && self.registry.capabilities().snapshot
    }

    fn store(&self) -> Result<&GroupStore> {
        self.groups
            .as_ref()
            .ok_or_else(|| Error::unimplemented("group snapshots are not served here"))
    }

    /// `s` with the group it was taken in, if any.
    pub(super) fn with_group(&self, mut s: SnapshotInfo) -> SnapshotInfo {
        if let Some(store) = &self.groups {
            s.group = store.group_of(&s.id);
        }
        s
    }

    /// CreateVolumeGroupSnapshot.
    pub async fn create_group_snapshot(&self, req: NewGroupSnapshot) -> Result<GroupSnapshotInfo> {
        let store = self.store()?;
        let Some(first) = req.sources.first() else {
            return Err(Error::invalid("source_volume_ids is required"));
        };
        let unique: BTreeSet<&VolumeId> = req.sources.iter().collect();
        if unique.len() != req.sources.len() {
            return Err(Error::invalid("source_volume_ids names a volume twice"));
        }
        if let Some(other) = req.sources.iter().find(|v| v.backend() != first.backend()) {
            return Err(Error::invalid(format!(
                "a group snapshot spans one backend: {first} and {other} are in different ones"
            )));
        }
        let backend = self.registry.for_volume(first)?.clone();
        if let crate::plugin::Groups::Refused(why) = backend.snapshotting()?.groups() {
            return Err(Error::precondition(why));
        }
        let (parameters, metadata) = split_parameters(&req.parameters);
        backend
            .snapshotting()?
            .validate_snapshot_parameters(&parameters)?;
        let id = GroupSnapshotId::new(backend.name(), &crate::plugin::locator_for_name(&req.name))?;
        let member = |source: &VolumeId| CreateSnapshot {
            source: source.clone(),
            name: member_name(&req.name, source),
            parameters: parameters.clone(),
            metadata: metadata.clone(),
            secrets: req.secrets.clone(),
        };
        let members = req
            .sources
            .iter()
            .map(|s| backend.snapshotting()?.snapshot_id_for(&member(s)))
            .collect::<Result<Vec<SnapshotId>>>()?;
        let mut exclusive = vec![Key::GroupSnapshot(id.clone())];
        exclusive.extend(req.sources.iter().cloned().map(Key::Volume));
        exclusive.extend(members.iter().cloned().map(Key::Snapshot));
        let _guard = self.guard(&exclusive, &[])?;

        if let Some(existing) = store.get(&id)? {
            let same = existing.name == req.name
                && existing.sources == req.sources
                && existing.parameters == parameters;
            if !same {
                return Err(Error::already_exists(format!(
                    "group snapshot {:?} exists with other source volumes or parameters",
                    req.name
                )));
            }
            if existing.complete {
                return self
                    .group_info(backend.as_ref(), &id, &existing, &req.secrets)
                    .await;
            }
            // Cut short (a crash): what it made goes, and it is taken again.
            self.remove_members(backend.as_ref(), &existing, &req.secrets)
                .await?;
        }
        for source in &req.sources {
            if backend
                .provisioning()?
                .get_volume(source, &req.secrets)
                .await?
                .is_none()
            {
                return Err(Error::not_found(format!(
                    "source volume {source} does not exist"
                )));
            }
        }
        let mut record = GroupRecord {
            name: req.name.clone(),
            sources: req.sources.clone(),
            parameters: parameters.clone(),
            members,
            created_unix_nanos: 0,
            complete: false,
        };
        // Recorded before anything is made: a crash leaves a record a
        // retry (or a delete) finds, never snapshots nobody knows of.
        store.put(&id, &record)?;
        crate::killpoint::hit(crate::killpoint::Step::GroupRecorded);
        let taken = self.cut(backend.as_ref(), &req, &member).await;
        match taken {
            Ok(created) => {
                crate::killpoint::hit(crate::killpoint::Step::GroupCut);
                record.created_unix_nanos = created
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos();
                record.complete = true;
                store.put(&id, &record)?;
                self.group_info(backend.as_ref(), &id, &record, &req.secrets)
                    .await
            }
            Err(e) => {
                let cleaned = self
                    .remove_members(backend.as_ref(), &record, &req.secrets)
                    .await;
                if cleaned.is_ok() {
                    store.remove(&id)?;
                }
                Err(e)
            }
        }
    }

    /// Freezes the sources, cuts one snapshot per source, thaws: the
    /// instant the group shows.
    async fn cut(
        &self,
        backend: &dyn Backend,
        req: &NewGroupSnapshot,
        member: &impl Fn(&VolumeId) -> CreateSnapshot,
    ) -> Result<SystemTime> {
        let members: Vec<CreateSnapshot> = req.sources.iter().map(member).collect();
        let snapshotter = backend.snapshotting()?;
        if let crate::plugin::Groups::Cut(cutter) = snapshotter.groups() {
            // The backend holds the instant itself; each member's snapshot
            // is then made from its cut.
            let instant = SystemTime::now();
            cutter.cut_group(&members).await?;
            for m in &members {
                if let Err(e) = snapshotter.create_snapshot(m).await {
                    let _ = cutter.uncut_group(&members).await;
                    return Err(e);
                }
            }
            return Ok(instant);
        }
        let Some(quiesce) = &self.quiesce else {
            return Err(Error::precondition(format!(
                "group snapshots of backend {} need the node service in this process \
                 (--mode all) to hold the members' writes",
                backend.name()
            )));
        };
        let staged_ok = backend.capabilities().group_snapshot == GroupSnapshots::Frozen;
        let frozen = quiesce
            .freeze(&req.sources, staged_ok, false, FREEZE_DEADLINE)
            .await?;
        let instant = SystemTime::now();
        for m in &members {
            // On a failure the freeze is dropped, which thaws.
            backend.snapshotting()?.create_snapshot(m).await?;
            crate::killpoint::hit(crate::killpoint::Step::GroupMember);
        }
        frozen.thaw().await?;
        Ok(instant)
    }

    /// Deletes the members `record` names (those that exist).
    async fn remove_members(
        &self,
        backend: &dyn Backend,
        record: &GroupRecord,
        secrets: &Secrets,
    ) -> Result<()> {
        for m in &record.members {
            backend.snapshotting()?.delete_snapshot(m, secrets).await?;
        }
        Ok(())
    }

    async fn group_info(
        &self,
        backend: &dyn Backend,
        id: &GroupSnapshotId,
        record: &GroupRecord,
        secrets: &Secrets,
    ) -> Result<GroupSnapshotInfo> {
        let mut snapshots = Vec::new();
        for m in &record.members {
            if let Some(mut s) = backend.snapshotting()?.get_snapshot(m, secrets).await? {
                s.group = Some(id.clone());
                snapshots.push(s);
            }
        }
        Ok(GroupSnapshotInfo {
            id: id.clone(),
            ready: snapshots.iter().all(|s| s.ready),
            snapshots,
            created: UNIX_EPOCH + Duration::from_nanos(record.created_unix_nanos as u64),
        })
    }

    /// The group `raw` names and its record; `None` when there is none.
    fn find_group(&self, raw: &str) -> Result<Option<Found>> {
        if raw.is_empty() {
            return Err(Error::invalid("group_snapshot_id is required"));
        }
        let Ok(id) = GroupSnapshotId::parse(raw) else {
            return Ok(None);
        };
        let Some(backend) = self.backend(id.backend()) else {
            return Ok(None);
        };
        Ok(self
            .store()?
            .get(&id)?
            .filter(|r| r.complete)
            .map(|r| (id, backend, r)))
    }

    /// INVALID_ARGUMENT when `snapshot_ids` (if given) is not the group's
    /// members.
    fn check_members(record: &GroupRecord, snapshot_ids: &[String]) -> Result<()> {
        if snapshot_ids.is_empty() {
            return Ok(());
        }
        let given: BTreeSet<&str> = snapshot_ids.iter().map(String::as_str).collect();
        let ours: Vec<String> = record.members.iter().map(|m| m.to_string()).collect();
        let ours: BTreeSet<&str> = ours.iter().map(String::as_str).collect();
        if given != ours {
            return Err(Error::invalid(format!(
                "snapshot_ids do not match the group's members ({})",
                ours.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
        Ok(())
    }

    /// GetVolumeGroupSnapshot.
    pub async fn get_group_snapshot(
        &self,
        raw_id: &str,
        snapshot_ids: &[String],
        secrets: &Secrets,
    ) -> Result<GroupSnapshotInfo> {
        let (id, backend, record) = self
            .find_group(raw_id)?
            .ok_or_else(|| Error::not_found(format!("group snapshot {raw_id:?} does not exist")))?;
        Self::check_members(&record, snapshot_ids)?;
        self.group_info(backend.as_ref(), &id, &record, secrets)
            .await
    }

    /// DeleteVolumeGroupSnapshot: the group and every member; a group that
    /// does not exist is deleted already.
    pub async fn delete_group_snapshot(
        &self,
        raw_id: &str,
        snapshot_ids: &[String],
        secrets: &Secrets,
    ) -> Result<()> {
        let Some((id, backend, record)) = self.find_group(raw_id)? else {
            return Ok(());
        };
        Self::check_members(&record, snapshot_ids)?;
        let mut exclusive = vec![Key::GroupSnapshot(id.clone())];
        exclusive.extend(record.members.iter().cloned().map(Key::Snapshot));
        let _guard = self.guard(&exclusive, &[])?;
        self.remove_members(backend.as_ref(), &record, secrets)
            .await?;
        self.store()?.remove(&id)
    }

    /// A member deleted on its own (the CO should not, but may): the
    /// group's record lets go of it.
    pub(super) fn forget_member(&self, snapshot: &SnapshotId) -> Result<()> {
        let Some(store) = &self.groups else {
            return Ok(());
        };
        let Some(group) = store.group_of(snapshot) else {
            return Ok(());
        };
        let Some(mut record) = store.get(&group)? else {
            return Ok(());
        };
        let at = record.members.iter().position(|m| m == snapshot);
        if let Some(i) = at {
            record.members.remove(i);
            record.sources.remove(i);
        }
        match record.members.is_empty() {
            true => store.remove(&group),
            false => store.put(&group, &record),
        }
    }
}
