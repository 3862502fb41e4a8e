//! Stage and publish orchestration shared by every backend: the backend
//! attaches a device (or names a remote filesystem); this module formats,
//! mounts once at the staging path, bind-mounts into each target, and keeps
//! the node state that lets every step be undone after a restart.

use crate::host::fs;
mod health;
mod iolimit;
pub use iolimit::{ask_limits, limits_authority, LimitsAnswer, LIMITS_PATH};
pub mod paths;
mod publish;
mod stage;

use crate::error::{Error, Kind, Result};
use crate::exec::CommandRunner;
use crate::host::crypt;
use crate::host::devices::{DeviceClass, DeviceTables};
use crate::host::loopdev::LoopDevices;
use crate::host::Host;
use crate::locks::{Key, OpGuard, OpLocks};
use crate::mount::{MountId, MountInfo, MountOptions, Mounter};
use crate::plugin::{
    AccessMode, AccessType, AttachContext, Attachment, Backend, Finding, Reason, Registry, Secrets,
    VolumeCapability, VolumeId,
};
use crate::state::{NodeState, PublishRecord, StageRecord};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How often unmount is retried on stacked mounts before giving up.
const MAX_STACKED_MOUNTS: usize = 16;

/// What a stage record finds at its staging path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presence {
    /// Its own mount (or, for block access, nothing needed).
    Ours,
    /// Nothing mounted.
    Absent,
    /// Its own remote mount, gone stale.
    Stale,
    /// Something else's mount.
    Foreign,
}

/// The error for a path where another's filesystem is mounted.
fn foreign(path: &Path) -> Error {
    Error::not_ours(
        format_args!("the filesystem mounted at {}", path.display()),
        "neither used nor unmounted",
    )
}

/// The source string the kernel shows for a stage's mount.
fn mount_source(record: &StageRecord, att: &Attachment) -> String {
    match (record.device(), att) {
        (Some(device), _) => device.display().to_string(),
        (None, Attachment::Remote { source, .. }) => source.clone(),
        (None, Attachment::Device { path }) => path.display().to_string(),
    }
}

/// Whether a mount table entry's device (`major:minor`) is the one a
/// [`MountId`] names (its `dev`, the major in the high 32 bits).
fn same_device(table_dev: &str, id: MountId) -> bool {
    let Some((major, minor)) = table_dev.split_once(':') else {
        return false;
    };
    match (major.parse::<u64>(), minor.parse::<u64>()) {
        (Ok(major), Ok(minor)) => (major << 32 | minor) == id.dev,
        _ => false,
    }
}

/// An error a stat of a filesystem that lost its storage answers: a shut
/// down one's EIO, a remote one's stale handle.
fn storage_lost(e: &Error) -> bool {
    matches!(e.os_error, Some(libc::EIO) | Some(libc::ESTALE))
}

/// A remote filesystem that did not answer a call.
fn not_answering(e: &Error) -> Finding {
    Finding::inaccessible(
        Reason::FilesystemNotAnswering,
        format!("the filesystem does not answer: {}", e.message),
    )
}

/// Whether an error is ESTALE: a handle the server no longer knows.
fn is_stale(e: &Error) -> bool {
    e.os_error == Some(libc::ESTALE)
}

/// A NodeStageVolume request, validated.
#[derive(Debug, Clone)]
pub struct StageRequest {
    pub volume_id: VolumeId,
    pub staging_path: PathBuf,
    pub capability: VolumeCapability,
    pub ctx: AttachContext,
}

/// A NodePublishVolume request, validated.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub volume_id: VolumeId,
    pub staging_path: PathBuf,
    pub target_path: PathBuf,
    pub capability: VolumeCapability,
    pub readonly: bool,
    pub secrets: Secrets,
    /// The pod's I/O limits on the volume and its UID (what
    /// `podInfoOnMount` gives), to find its cgroup.
    pub io: IoPublish,
}

/// What a publish limits: the volume's I/O limits (from its context), for
/// the pod of `pod_uid`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IoPublish {
    pub limits: crate::host::iolimit::Limits,
    pub pod_uid: Option<String>,
}

/// Usage figures for NodeGetVolumeStats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeStats {
    pub total_bytes: u64,
    pub available_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    pub total_inodes: Option<u64>,
    pub free_inodes: Option<u64>,
    /// What is wrong with the volume, as this node sees it (empty:
    /// nothing known).
    pub health: Vec<Finding>,
    /// The I/O limits in force for the pod the volume is published to at
    /// the path asked about, said in words; none: not limited.
    pub io_limits: Option<String>,
}

/// How long a call into the mount table may take before its RPC gives up.
/// A mount of an unreachable server, or a statx on a mount whose server
/// went away, can block in the kernel for as long as the server is gone;
/// such a call holds one thread of the blocking pool, never an async
/// worker, and its RPC fails with UNAVAILABLE at the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// statx, bind, unmount.
    pub quick: Duration,
    /// Mounting a filesystem (a device's, or a remote one).
    pub mount: Duration,
}

impl Deadlines {
    /// The same, none longer than `cap` (`--command-timeout`).
    pub fn capped(self, cap: Option<Duration>) -> Self {
        match cap {
            Some(cap) => Deadlines {
                quick: self.quick.min(cap),
                mount: self.mount.min(cap),
            },
            None => self,
        }
    }
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            quick: Duration::from_secs(30),
            mount: Duration::from_secs(120),
        }
    }
}

/// The node side of the driver.
pub struct NodeOps {
    registry: Arc<Registry>,
    mounter: Arc<dyn Mounter>,
    runner: Arc<dyn CommandRunner>,
    state: Arc<NodeState>,
    locks: OpLocks,
    host: Arc<dyn Host>,
    deadlines: Deadlines,
    /// Where staging paths and targets may be; empty: anywhere.
    allowed_paths: Vec<PathBuf>,
    /// The key derivation of the encrypted volumes it formats.
    kdf: crate::host::crypt::Kdf,
    /// Read-only loop devices for read-only block publishes.
    loops: LoopDevices,
    /// The kernel's device tables, for the node's volume limit.
    devices: DeviceTables,
    /// What freezes staged filesystems for group snapshots (none: the
    /// node freezes nothing, as in the unit tests).
    freezer: Option<Arc<crate::host::freeze::Freezer>>,
    /// What each staged volume's health was when last measured.
    health: health::VolumeBook,
    /// What each backend's readiness was when last checked.
    storage: Arc<health::StorageBook>,
    /// Where the pods' cgroups are, for their volumes' I/O limits.
    cgroups: crate::host::iolimit::Cgroups,
    /// The limit changes ControllerModifyVolume made, where this node is
    /// its volumes' controller (none: a volume's limits are its context's).
    limit_book: Option<Arc<crate::plugin::LimitBook>>,
    /// Held while a publish's limits are worked out and written, so that
    /// the last to write read the book last.
    limits_held: tokio::sync::Mutex<()>,
    /// The controller (`host:port`) this node asks for the changes to its
    /// volumes' limits; none: it asks none.
    limits_from: Option<String>,
    /// Its book mirrors that controller's (a remote driver's node);
    /// otherwise it is its own and takes what is offered.
    limits_mirrored: bool,
}

impl NodeOps {
    pub fn new(
        registry: Arc<Registry>,
        mounter: Arc<dyn Mounter>,
        runner: Arc<dyn CommandRunner>,
        state: NodeState,
        locks: OpLocks,
        host: Arc<dyn Host>,
    ) -> Self {
        Self {
            registry,
            mounter,
            runner,
            state: Arc::new(state),
            locks,
            host,
            deadlines: Deadlines::default(),
            allowed_paths: Vec::new(),
            kdf: Default::default(),
            loops: LoopDevices::new(),
            devices: DeviceTables::default(),
            freezer: None,
            health: Default::default(),
            storage: Default::default(),
            cgroups: Default::default(),
            limit_book: None,
            limits_held: Default::default(),
            limits_from: None,
            limits_mirrored: false,
        }
    }

    /// The same, finding the pods' cgroups under this cgroup v2 root.
    pub fn with_cgroups(mut self, cgroups: crate::host::iolimit::Cgroups) -> Self {
        self.cgroups = cgroups;
        self
    }

    /// The same, its publishes' limits changed as `book` says.
    pub fn with_limit_book(mut self, book: Arc<crate::plugin::LimitBook>) -> Self {
        self.limit_book = Some(book);
        self
    }

    /// The same, asking the controller at `authority` (`host:port`) for
    /// the changes to its volumes' limits: mirroring its book (`mirror`,
    /// a remote controller), or taking what it offers for this node's own
    /// volumes (the central controller of node-local volumes).
    pub fn with_limits_from(mut self, authority: String, mirror: bool) -> Self {
        self.limits_from = Some(authority);
        self.limits_mirrored = mirror;
        self
    }

    /// The controller it asks for its volumes' limit changes, if any.
    pub fn limits_from(&self) -> Option<&str> {
        self.limits_from.as_deref()
    }

    /// The same, freezing staged filesystems through `freezer`.
    pub fn with_freezer(mut self, freezer: crate::host::freeze::Freezer) -> Self {
        self.freezer = Some(Arc::new(freezer));
        self
    }

    /// Finishes or undoes what a dead driver's intents name, before
    /// anything is served: a freeze's filesystems are thawed (each only
    /// while the staging path still holds the mount this node made there).
    /// Each intent goes once handled.
    pub fn recover(&self, intents: &crate::intents::Intents) -> Result<usize> {
        let pending = intents.pending()?;
        for (id, intent) in &pending {
            match intent {
                crate::intents::Intent::Freeze { paths } => {
                    crate::host::freeze::undo_intent(paths, |path| self.holds_own_mount(path));
                }
            }
            intents.done(id)?;
        }
        Ok(pending.len())
    }

    /// Whether `path` is a staging path of this node's where the mount this
    /// node made is still in place.
    fn holds_own_mount(&self, path: &Path) -> bool {
        let Some(stage) = self
            .state
            .stages()
            .into_iter()
            .find(|s| s.staging_path == path)
        else {
            return false;
        };
        match (self.mounter.mounted(path), stage.mounted) {
            (Ok(Some(now)), Some(made)) => now == made,
            _ => false,
        }
    }

    /// The same, reading these device tables (a test's fixture tree).
    pub fn with_device_tables(mut self, devices: DeviceTables) -> Self {
        self.devices = devices;
        self
    }

    /// NodeGetInfo's `max_volumes_per_node`: `cap` (the configured count;
    /// 0 or less: none) bounded by the room the kernel leaves for each kind
    /// of device this node's backends attach, counting the devices of
    /// staged volumes as ferrovol's own (see [`crate::host::devices`]).
    /// 0 when nothing bounds it, as CSI reads 0: no limit.
    pub async fn volume_limit(&self, cap: i64) -> Result<i64> {
        let kinds: Vec<DeviceClass> = self
            .registry
            .all()
            .filter_map(|b| b.device_mounter()?.node_device())
            .collect();
        let cap = u64::try_from(cap).ok().filter(|c| *c > 0);
        if kinds.is_empty() {
            return Ok(cap.unwrap_or(0) as i64);
        }
        let staged: Vec<PathBuf> = self
            .state
            .stages()
            .into_iter()
            .filter_map(|s| match s.attachment {
                Some(Attachment::Device { path }) => Some(path),
                _ => None,
            })
            .collect();
        let tables = self.devices.clone();
        let room = crate::host::off_worker(
            "reading the kernel's device tables",
            self.deadlines.quick,
            move || {
                // Devices as /dev names them: an iSCSI disk's by-path link
                // resolves to its sdX.
                let ours: HashSet<String> = staged
                    .iter()
                    .filter_map(|p| std::fs::canonicalize(p).ok())
                    .filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
                    .collect();
                Ok(kinds.iter().map(|k| tables.room(k, &ours)).min())
            },
        )
        .await?;
        Ok(match (cap, room) {
            (None, None) => 0,
            // CSI reads 0 as no limit: a node with no room left says 1,
            // and the stage that would take a second device fails.
            (cap, room) => cap
                .unwrap_or(u64::MAX)
                .min(room.unwrap_or(u64::MAX))
                .clamp(1, i64::MAX as u64) as i64,
        })
    }

    /// The same, with these loop devices (a test's fake kernel).
    #[cfg(test)]
    pub fn with_loops(mut self, loops: LoopDevices) -> Self {
        self.loops = loops;
        self
    }

    /// The same, formatting encrypted volumes with key derivation `kdf`.
    pub fn with_kdf(mut self, kdf: crate::host::crypt::Kdf) -> Self {
        self.kdf = kdf;
        self
    }

    /// The same, with staging paths and targets kept under these prefixes.
    pub fn with_allowed_paths(mut self, prefixes: Vec<PathBuf>) -> Self {
        // Judged against resolved paths, so resolve the prefixes too.
        self.allowed_paths = prefixes
            .into_iter()
            .map(|p| self.host.canonical(&p).unwrap_or(p))
            .collect();
        self
    }

    /// Refuses a staging path or target outside the allowed prefixes,
    /// judged on the path with its symlinks resolved, before anything is
    /// created or mounted.
    fn check_allowed(&self, path: &Path, field: &str) -> Result<()> {
        if self.allowed_paths.is_empty() {
            return Ok(());
        }
        let resolved = self.host.resolve(path)?;
        if self.allowed_paths.iter().any(|p| resolved.starts_with(p)) {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "{field} {} is outside the paths this node mounts under ({})",
            resolved.display(),
            self.allowed_paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }

    /// The same, with other deadlines for mount-table calls.
    pub fn with_deadlines(mut self, deadlines: Deadlines) -> Self {
        self.deadlines = deadlines;
        self
    }

    /// Runs a mount-table call on the blocking pool, within `deadline`.
    async fn off_worker<T, F>(&self, what: String, deadline: Duration, call: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&dyn Mounter) -> Result<T> + Send + 'static,
    {
        let mounter = self.mounter.clone();
        // Each names its path: one stuck call per path at most.
        crate::host::off_worker_once(&what, deadline, move || call(mounter.as_ref())).await
    }

    async fn is_mounted(&self, path: &Path) -> Result<bool> {
        let p = path.to_path_buf();
        self.off_worker(
            format!("checking whether {} is mounted", path.display()),
            self.deadlines.quick,
            move |m| m.is_mount_point(&p),
        )
        .await
    }

    /// Writes a stage record (durable: fsynced) off the async workers.
    async fn put_stage(&self, record: StageRecord) -> Result<()> {
        let state = self.state.clone();
        crate::host::off_worker("writing a stage record", self.deadlines.quick, move || {
            state.put_stage(record)
        })
        .await
    }

    /// Removes a stage record (durable) off the async workers.
    async fn remove_stage(&self, id: &VolumeId) -> Result<()> {
        self.health.forget(&id.to_string());
        let (state, id) = (self.state.clone(), id.clone());
        crate::host::off_worker("removing a stage record", self.deadlines.quick, move || {
            state.remove_stage(&id)
        })
        .await
    }

    pub fn state(&self) -> &NodeState {
        &self.state
    }

    fn backend(&self, id: &VolumeId) -> Result<&Arc<dyn Backend>> {
        self.registry.for_volume(id)
    }

    fn lock_volume(&self, id: &VolumeId) -> Result<OpGuard> {
        self.locks.try_exclusive(&[Key::Volume(id.clone())])
    }

    fn lock_target(&self, id: &VolumeId, target: &Path) -> Result<OpGuard> {
        self.locks.try_lock(
            &[Key::Target(target.to_path_buf())],
            &[Key::Volume(id.clone())],
        )
    }

    /// The lock of a publish that must be the volume's only one on the
    /// node: the volume too is taken exclusively, so that no other publish
    /// of it is under way while its records are read (two at once would
    /// each find none).
    fn lock_only_target(&self, id: &VolumeId, target: &Path) -> Result<OpGuard> {
        self.locks
            .try_exclusive(&[Key::Target(target.to_path_buf()), Key::Volume(id.clone())])
    }

    /// Brings the state in line with the mount table after a start: publish
    /// records whose mount is gone are dropped. Stage records are kept (an
    /// unstage still needs them to release the device).
    pub fn reconcile(&self) -> Result<(usize, usize)> {
        let mut dropped = 0;
        for p in self.state.publishes() {
            // Kept only where the mount there is still ours: gone, or
            // another's since, the record goes (and the mount stays).
            let expected = self.state.stage(&p.volume_id).and_then(|stage| {
                match (&stage.capability.access, &stage.attachment) {
                    _ if p.device.is_some() => {
                        p.device.as_ref().and_then(|d| self.mounter.node_id(d).ok())
                    }
                    (AccessType::Block, Some(Attachment::Device { .. })) => {
                        stage.device().and_then(|d| self.mounter.node_id(&d).ok())
                    }
                    (AccessType::Mount { .. }, _) => stage.mounted,
                    _ => None,
                }
            });
            let ours = match (self.mounter.mounted(&p.target_path)?, expected) {
                (Some(found), Some(want)) => found == want,
                // A record from before identities were kept: as before.
                (Some(_), None) => true,
                // Unmounted, but a read-only device made for it may remain:
                // kept, so unpublish or unstage releases that device.
                (None, _) => p.device.is_some(),
            };
            if !ours {
                self.state.remove_publish(&p.target_path)?;
                dropped += 1;
            }
        }
        let mut unmounted = 0;
        for s in self.state.stages() {
            if matches!(s.capability.access, AccessType::Mount { .. })
                && !self.mounter.is_mount_point(&s.staging_path)?
            {
                unmounted += 1;
            }
        }
        Ok((dropped, unmounted))
    }

    /// What is mounted at `path` (one statx, off the workers).
    async fn mount_id(&self, path: &Path) -> Result<Option<MountId>> {
        let p = path.to_path_buf();
        self.off_worker(
            format!("checking what is mounted at {}", path.display()),
            self.deadlines.quick,
            move |m| m.mounted(&p),
        )
        .await
    }

    /// The topmost mount-table entry at `path`.
    async fn top_entry(&self, path: &Path) -> Result<Option<MountInfo>> {
        let p = path.to_path_buf();
        self.off_worker(
            format!("reading the mount table for {}", path.display()),
            self.deadlines.quick,
            move |m| Ok(m.mounts()?.into_iter().rev().find(|i| i.mount_point == p)),
        )
        .await
    }

    /// What a publish target of this stage shows when it is ours: the
    /// staged filesystem (mount access), or the attached device's node
    /// (block access).
    async fn target_identity(&self, stage: &StageRecord) -> Result<Option<MountId>> {
        match (&stage.capability.access, &stage.attachment) {
            (AccessType::Block, Some(Attachment::Device { .. })) => {
                let p = stage.device().unwrap_or_default();
                self.off_worker(
                    format!("identifying {}", p.display()),
                    self.deadlines.quick,
                    move |m| m.node_id(&p).map(Some),
                )
                .await
            }
            (AccessType::Mount { .. }, _) => match stage.mounted {
                Some(id) => Ok(Some(id)),
                None => self.mount_id(&stage.staging_path).await,
            },
            _ => Ok(None),
        }
    }

    /// Whether a mount of the record's own source sits anywhere at its
    /// staging path (under another's).
    async fn ours_below(&self, record: &StageRecord) -> Result<bool> {
        let Some(att) = &record.attachment else {
            return Ok(false);
        };
        let (p, source) = (record.staging_path.clone(), mount_source(record, att));
        self.off_worker(
            format!(
                "reading the mount table for {}",
                record.staging_path.display()
            ),
            self.deadlines.quick,
            move |m| {
                Ok(m.mounts()?
                    .iter()
                    .any(|i| i.mount_point == p && i.source == source))
            },
        )
        .await
    }

    /// Unmounts the topmost mount at `path`, off the async workers.
    async fn unmount_once(&self, path: &Path) -> Result<()> {
        let p = path.to_path_buf();
        self.off_worker(
            format!("unmounting {}", path.display()),
            self.deadlines.quick,
            move |m| m.unmount(&p).map(|_| ()),
        )
        .await
    }

    fn loops(&self) -> &LoopDevices {
        &self.loops
    }

    /// Where a volume this node has staged is: its stage record and the
    /// path asked about, which must be its staging path or one of its
    /// publish targets. Anything else, an unknown volume first, is
    /// NOT_FOUND, whatever the path looks like.
    async fn locate(&self, id: &VolumeId, raw_path: &str) -> Result<(StageRecord, PathBuf)> {
        self.backend(id)?;
        let stage = self
            .state
            .stage(id)
            .ok_or_else(|| Error::not_found(format!("volume {id} is not staged on this node")))?;
        let not_here = || {
            Error::not_found(format!(
                "volume {id} is not at {:?}",
                raw_path.escape_debug().to_string()
            ))
        };
        let path = paths::validate(raw_path, "volume_path").map_err(|_| not_here())?;
        let known = path == stage.staging_path
            || self
                .state
                .publish(&path)
                .is_some_and(|p| &p.volume_id == id);
        if !known {
            return Err(not_here());
        }
        // A mount point is there by the mount table's word: a stat of it
        // would ask its filesystem, and one whose server does not answer
        // (NFS) would hold the call, and the worker under it, for as long.
        if self.top_entry(&path).await?.is_some() {
            return Ok((stage, path));
        }
        let (p, host) = (path.clone(), self.host.clone());
        let there = self
            .off_worker(
                format!("looking for {}", path.display()),
                self.deadlines.quick,
                move |_| Ok(host.exists(&p)),
            )
            .await?;
        if !there {
            return Err(not_here());
        }
        Ok((stage, path))
    }

    /// NodeGetVolumeStats.
    pub async fn stats(&self, id: &VolumeId, raw_path: &str) -> Result<VolumeStats> {
        let (stage, path) = self.locate(id, raw_path).await?;
        let volume_path = path.as_path();
        // Every step shares one deadline: the call answers within it.
        let until = std::time::Instant::now() + self.deadlines.quick;
        let mut stats = VolumeStats {
            health: self.measured_health(id, &stage).await?,
            io_limits: self.limits_in_force(&path),
            ..Default::default()
        };
        match stage.capability.access {
            AccessType::Mount { .. } => {
                let remote = matches!(stage.attachment, Some(Attachment::Remote { .. }));
                match self.mounted_by(&stage.staging_path, until).await {
                    Ok(true) => {}
                    Ok(false) => {
                        stats.health.push(Finding::inaccessible(
                            Reason::StagingMountGone,
                            format!("staging mount {} is gone", stage.staging_path.display()),
                        ));
                    }
                    // The server of a remote mount does not answer: say so,
                    // within the deadline, rather than wait on it again.
                    Err(e) if remote => {
                        stats.health.push(not_answering(&e));
                        return Ok(stats);
                    }
                    Err(e) => return Err(e),
                }
                // statvfs on a mount whose server is gone blocks: off the
                // workers, within the deadline, like a mount-table call.
                let (p, host) = (volume_path.to_path_buf(), self.host.clone());
                let usage = self
                    .off_worker(
                        format!("reading usage of {}", volume_path.display()),
                        until.saturating_duration_since(std::time::Instant::now()),
                        move |_| host.fs_usage(&p),
                    )
                    .await;
                match usage {
                    Ok(usage) => {
                        stats.total_bytes = usage.total_bytes;
                        stats.available_bytes = Some(usage.available_bytes);
                        stats.used_bytes = Some(usage.total_bytes - usage.free_bytes);
                        stats.total_inodes = Some(usage.total_inodes);
                        stats.free_inodes = Some(usage.free_inodes);
                    }
                    // A remote filesystem whose server does not answer (or
                    // a stale handle) is an abnormal volume, not a failed
                    // call: the answer comes within the deadline and says so.
                    Err(e) if matches!(stage.attachment, Some(Attachment::Remote { .. })) => {
                        stats.health.push(not_answering(&e));
                    }
                    Err(e) => return Err(e),
                }
            }
            AccessType::Block => {
                // A publish target is the device itself; the staging path
                // of a block volume is a plain folder, so ask the device.
                let device = match (stage.device(), volume_path == stage.staging_path) {
                    (Some(device), true) => device,
                    _ => volume_path.to_path_buf(),
                };
                // Off the workers too: a device whose path is dead may
                // hold its open.
                let host = self.host.clone();
                stats.total_bytes = self
                    .off_worker(
                        format!("reading the size of {}", device.display()),
                        until.saturating_duration_since(std::time::Instant::now()),
                        move |_| host.device_size(&device),
                    )
                    .await?;
            }
        }
        Ok(stats)
    }

    /// NodeExpandVolume: the device learns its new size, then the filesystem
    /// grows online. Returns the volume's size.
    pub async fn expand(
        &self,
        id: &VolumeId,
        raw_path: &str,
        required: u64,
        limit: u64,
    ) -> Result<u64> {
        let (stage, _path) = self.locate(id, raw_path).await?;
        let _guard = self.lock_volume(id)?;
        let backend = self.backend(id)?.clone();
        let attachment = stage
            .attachment
            .clone()
            .ok_or_else(|| Error::precondition(format!("volume {id} has no attached device")))?;
        // A remote filesystem (NFS) grows where it is served: the
        // controller's expansion was the whole of it, and the node has no
        // device or filesystem of its own to grow. Its size is not known
        // here (0: unset).
        if matches!(attachment, Attachment::Remote { .. }) {
            return Ok(0);
        }
        let mut size = backend
            .device_mounting()?
            .node_refresh_size(id, &attachment)
            .await?;
        // A node-local volume lives here: when no controller grew it (the
        // node-local driver offers no controller expansion, so the resizer
        // leaves it all to kubelet), the node grows the LV or image itself.
        if required > 0 && size < required && backend.capabilities().node_local {
            backend
                .expanding()?
                .expand_volume(id, required, limit, &crate::plugin::Secrets::default())
                .await?;
            size = backend
                .device_mounting()?
                .node_refresh_size(id, &attachment)
                .await?;
        }
        if required > 0 && size < required {
            return Err(Error::out_of_range(format!(
                "the device has {size} bytes, fewer than the {required} asked; expand the volume first"
            )));
        }
        // An encrypted volume's mapping grows to its device first.
        if let Some(name) = &stage.crypt {
            crypt::resize(self.runner.as_ref(), name).await?;
        }
        if let (AccessType::Mount { .. }, Some(path)) = (&stage.capability.access, &stage.device())
        {
            let fs = stage
                .fs_type
                .clone()
                .unwrap_or_else(|| fs::DEFAULT_FS.into());
            fs::grow(self.runner.as_ref(), &fs, path, &stage.staging_path)
                .await
                .map_err(|e| {
                    if e.kind == Kind::Internal {
                        e.context("grow filesystem")
                    } else {
                        e
                    }
                })?;
        }
        Ok(size)
    }
}

#[cfg(test)]
mod tests;
