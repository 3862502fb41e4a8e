//! Stage and publish orchestration shared by every backend: the backend
//! attaches a device (or names a remote filesystem); this module formats,
//! mounts once at the staging path, bind-mounts into each target, and keeps
//! the node state that lets every step be undone after a restart.

pub mod fs;
pub mod paths;

use crate::error::{Error, Kind, Result};
use crate::exec::CommandRunner;
use crate::host::loopdev::LoopDevices;
use crate::host::Host;
use crate::locks::{self, OpGuard, OpLocks};
use crate::mount::{MountId, MountInfo, MountOptions, Mounter};
use crate::plugin::{
    AccessType, AttachContext, Attachment, Backend, Registry, Secrets, VolumeCapability, VolumeId,
};
use crate::state::{NodeState, PublishRecord, StageRecord};
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
    Error::precondition(format!(
        "another filesystem is mounted at {}; ferrovol does not use or unmount what it did not mount",
        path.display()
    ))
}

/// The source string the kernel shows for a stage's mount.
fn mount_source(att: &Attachment) -> String {
    match att {
        Attachment::Device { path } => path.display().to_string(),
        Attachment::Remote { source, .. } => source.clone(),
    }
}

/// Whether an error is ESTALE: a handle the server no longer knows.
fn is_stale(e: &Error) -> bool {
    e.os_error == Some(libc::ESTALE)
}

/// The error for a publish from a stale remote stage.
fn stale_stage(id: &VolumeId) -> Error {
    Error::precondition(format!(
        "the staged mount of volume {id} is stale (its directory changed on the server): stage it again"
    ))
}

/// A remote stage's mount must be in place before a bind of it: a bind of
/// a stale remote mount succeeds and serves nothing.
fn check_remote_stage(m: &dyn Mounter, id: &VolumeId, staging: &Path) -> Result<()> {
    match m.is_mount_point(staging) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::precondition(format!(
            "volume {id} is not mounted at its staging path: stage it again"
        ))),
        Err(e) if is_stale(&e) => Err(stale_stage(id)),
        Err(e) => Err(e),
    }
}

/// A stage's capability against its backend: a filesystem the backend
/// never serves is a bad request, not a capability this volume lacks.
fn check_stage_capability(backend: &dyn Backend, capability: &VolumeCapability) -> Result<()> {
    if let AccessType::Mount { fs_type, .. } = &capability.access {
        if !fs_type.is_empty() && !backend.fs_types().contains(&fs_type.as_str()) {
            return Err(Error::invalid(format!(
                "fs_type {fs_type:?} is not supported by backend {} (supported: {})",
                backend.name(),
                backend.fs_types().join(", ")
            )));
        }
    }
    backend
        .supports(capability)
        .map_err(|e| Error::precondition(e.message))
}

/// What a publish binds at its target.
struct Bind {
    volume_id: VolumeId,
    source: PathBuf,
    options: MountOptions,
    readonly: bool,
    /// A file target (raw block) rather than a directory.
    block: bool,
    /// A remote stage's mount, checked before the bind.
    staged_remote: Option<PathBuf>,
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
}

/// Usage figures for NodeGetVolumeStats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeStats {
    pub total_bytes: u64,
    pub available_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    pub total_inodes: Option<u64>,
    pub free_inodes: Option<u64>,
    /// Why the volume is abnormal, if it is.
    pub abnormal: Option<String>,
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
    /// Read-only loop devices for read-only block publishes.
    loops: LoopDevices,
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
            loops: LoopDevices::new(),
        }
    }

    /// The same, with these loop devices (a test's fake kernel).
    #[cfg(test)]
    pub fn with_loops(mut self, loops: LoopDevices) -> Self {
        self.loops = loops;
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
        crate::host::off_worker(&what, deadline, move || call(mounter.as_ref())).await
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
        self.locks.try_exclusive(&[locks::volume_key(id)])
    }

    fn lock_target(&self, id: &VolumeId, target: &Path) -> Result<OpGuard> {
        self.locks
            .try_lock(&[locks::target_key(target)], &[locks::volume_key(id)])
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
                    (AccessType::Block, Some(Attachment::Device { path })) => {
                        self.mounter.node_id(path).ok()
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

    /// NodeStageVolume.
    pub async fn stage(&self, req: StageRequest) -> Result<()> {
        let _guard = self.lock_volume(&req.volume_id)?;
        let backend = self.backend(&req.volume_id)?.clone();
        self.check_allowed(&req.staging_path, "staging_target_path")?;
        check_stage_capability(backend.as_ref(), &req.capability)?;
        if let Some(existing) = self.state.stage(&req.volume_id) {
            if self.restage_done(&req, &existing).await? {
                return Ok(());
            }
            // An interrupted stage: carry on from where it stopped.
        }
        // Checked after a stale mount there is let go.
        self.host
            .require_dir(&req.staging_path, "staging_target_path")?;
        // A staging directory handed over for a new stage is empty; one that
        // holds anything is someone's, and is not mounted over.
        if self.mount_id(&req.staging_path).await?.is_none()
            && !self.host.is_empty(&req.staging_path)?
        {
            return Err(Error::precondition(format!(
                "staging_target_path {} is not empty; ferrovol mounts only on an empty directory",
                req.staging_path.display()
            )));
        }
        let mut record = StageRecord {
            volume_id: req.volume_id.clone(),
            staging_path: req.staging_path.clone(),
            capability: req.capability.clone(),
            attachment: None,
            fs_type: None,
            mounted: None,
        };
        if let AccessType::Mount {
            fs_type,
            mount_flags,
        } = &req.capability.access
        {
            // The backend's own fs types (checked above); its first is the
            // default.
            record.fs_type = Some(match fs_type.as_str() {
                "" => backend.fs_types()[0].to_string(),
                named => named.to_string(),
            });
            MountOptions::parse(mount_flags, false)?;
        }
        // Intent first, so a crash during attach leaves something to undo.
        self.put_stage(record.clone()).await?;
        let result = self
            .finish_stage(backend.as_ref(), &mut record, &req.ctx)
            .await;
        if let Err(e) = result {
            // Undo what this attempt did; the CO will retry or unstage.
            let _ = self.undo_stage(backend.as_ref(), &record).await;
            return Err(e);
        }
        Ok(())
    }

    /// A stage of a volume with a stage record: whether it is done already
    /// (the same arguments, its mount in place). Other arguments, or
    /// another's mount there, are refused; a stale remote mount of its own
    /// is let go, to be mounted again.
    async fn restage_done(&self, req: &StageRequest, existing: &StageRecord) -> Result<bool> {
        if existing.staging_path != req.staging_path {
            return Err(Error::precondition(format!(
                "volume {} is already staged at {}",
                req.volume_id,
                existing.staging_path.display()
            )));
        }
        if existing.capability != req.capability {
            return Err(Error::already_exists(format!(
                "volume {} is staged at {} with a different capability",
                req.volume_id,
                req.staging_path.display()
            )));
        }
        if existing.attachment.is_none() {
            return Ok(false);
        }
        match self.stage_presence(existing).await? {
            Presence::Ours => Ok(true),
            Presence::Absent => Ok(false),
            Presence::Stale => {
                tracing::warn!(volume = %req.volume_id, "stale staging mount: mounting again");
                self.unmount_remote(&existing.staging_path).await?;
                Ok(false)
            }
            Presence::Foreign => Err(foreign(&existing.staging_path)),
        }
    }

    /// What is at a stage record's staging path: its own mount, nothing,
    /// a stale remote mount of its own, or something else's.
    async fn stage_presence(&self, record: &StageRecord) -> Result<Presence> {
        if matches!(record.capability.access, AccessType::Block) {
            return Ok(Presence::Ours);
        }
        let Some(attachment) = &record.attachment else {
            return Ok(Presence::Absent);
        };
        let path = &record.staging_path;
        if let Attachment::Remote { source, .. } = attachment {
            // Judged from the mount table (it never asks the server);
            // then one statx says whether the handle is stale.
            return Ok(match self.top_entry(path).await? {
                None => Presence::Absent,
                Some(e) if &e.source != source => Presence::Foreign,
                Some(_) => match self.mount_id(path).await {
                    Ok(_) => Presence::Ours,
                    Err(e) if is_stale(&e) => Presence::Stale,
                    Err(e) => return Err(e),
                },
            });
        }
        let Some(id) = self.mount_id(path).await? else {
            return Ok(Presence::Absent);
        };
        Ok(match record.mounted {
            Some(ours) if ours == id => Presence::Ours,
            Some(_) => Presence::Foreign,
            // Mounted but not yet recorded (a crash in between, or a record
            // older than this check): ours if it is our device's.
            None => match self.top_entry(path).await? {
                Some(e) if e.source == mount_source(attachment) => {
                    let mut updated = record.clone();
                    updated.mounted = Some(id);
                    self.put_stage(updated).await?;
                    Presence::Ours
                }
                _ => Presence::Foreign,
            },
        })
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

    async fn finish_stage(
        &self,
        backend: &dyn Backend,
        record: &mut StageRecord,
        ctx: &AttachContext,
    ) -> Result<()> {
        let attachment = backend.node_attach(&record.volume_id, ctx).await?;
        record.attachment = Some(attachment.clone());
        self.put_stage(record.clone()).await?;
        let AccessType::Mount { mount_flags, .. } = &record.capability.access else {
            return Ok(());
        };
        let fs = record
            .fs_type
            .clone()
            .unwrap_or_else(|| fs::DEFAULT_FS.into());
        // A read-only mode, or a read-only ControllerPublish.
        let readonly = ctx.readonly || record.capability.mode.is_readonly();
        let options = MountOptions::parse(mount_flags, readonly)?;
        match self.stage_presence(record).await? {
            Presence::Ours => return Ok(()),
            Presence::Absent => {}
            Presence::Stale => self.unmount_remote(&record.staging_path).await?,
            Presence::Foreign => return Err(foreign(&record.staging_path)),
        }
        let target = record.staging_path.clone();
        match &attachment {
            Attachment::Device { path } => {
                if backend.node_copy_pending(&record.volume_id, ctx).await? {
                    self.renew_fs_uuid(path, &target).await?;
                    backend.node_copy_done(&record.volume_id, ctx).await?;
                }
                if !readonly {
                    let extra = fs::mkfs_options(
                        Some(&fs),
                        ctx.volume_context
                            .get(fs::MKFS_OPTIONS)
                            .map_or("", String::as_str),
                    )?;
                    fs::format_if_unformatted(self.runner.as_ref(), path, &fs, &extra).await?;
                }
                let device = path.clone();
                let at = target.clone();
                self.off_worker(
                    format!("mounting {} on {}", device.display(), target.display()),
                    self.deadlines.mount,
                    move |m| m.mount_fs(&device, &at, &fs, &options),
                )
                .await?;
                // What we mounted, so it is never mistaken for another's.
                record.mounted = self.mount_id(&target).await?;
                self.put_stage(record.clone()).await
            }
            Attachment::Remote {
                source,
                fs_type,
                options: remote,
            } => {
                // A remote filesystem is mounted by its mount helper in a
                // child process (it resolves the server and negotiates the
                // version), which the exec seam kills at the deadline: a
                // thread stuck in mount(2) could not be killed.
                let mut opts = options.clone();
                opts.data.extend(remote.iter().cloned());
                crate::mount::mount_with_helper(
                    self.runner.as_ref(),
                    source,
                    &target,
                    fs_type,
                    &opts,
                    self.deadlines.mount,
                )
                .await
            }
        }
    }

    /// Gives the filesystem on a copied device a UUID of its own (see
    /// [`Backend::node_copy_pending`]), and checks that it changed: some
    /// tools report success without doing it. `scratch` is an empty
    /// directory of ours (the staging path before the stage mount).
    async fn renew_fs_uuid(&self, device: &Path, scratch: &Path) -> Result<()> {
        let runner = self.runner.as_ref();
        let Some(found) = fs::probe(runner, device).await? else {
            return Ok(()); // never formatted: nothing to renew
        };
        let Some(cmd) = fs::new_uuid_command(&found, device)? else {
            return Ok(());
        };
        let before = fs::uuid(runner, device).await?;
        match found.as_str() {
            "ext4" | "ext3" | "ext2" => fs::check_ext(runner, device).await?,
            // A copy of a mounted xfs has a dirty log, which xfs_admin will
            // not touch: a mount that ignores the duplicate UUID replays
            // it, and the unmount leaves it clean.
            "xfs" => {
                self.replay_by_mount(device, scratch, "xfs", "nouuid")
                    .await?
            }
            // A btrfs tree log must be replayed before the fsid changes.
            // The kernel mounts a single-device copy beside its source
            // under a temporary fsid (Linux 6.7 on); an older one would
            // hand back the source's filesystem and leave the log, which
            // the second check catches.
            "btrfs" if fs::btrfs_log_pending(runner, device).await? => {
                self.replay_by_mount(device, scratch, "btrfs", "").await?;
                if fs::btrfs_log_pending(runner, device).await? {
                    return Err(Error::precondition(format!(
                        "the btrfs copy on {} holds a log that could not be replayed beside \
                         its source; stage it where its source is not mounted",
                        device.display()
                    )));
                }
            }
            _ => {}
        }
        runner
            .run(cmd)
            .await
            .map_err(|e| Error::from(e).context("give the copied filesystem its own UUID"))?;
        let after = fs::uuid(runner, device).await?;
        if after.is_none() || after == before {
            return Err(Error::internal(format!(
                "the {found} filesystem on {} still has its source's UUID",
                device.display()
            )));
        }
        Ok(())
    }

    /// Mounts and unmounts a device once, so the kernel replays its log.
    async fn replay_by_mount(
        &self,
        device: &Path,
        scratch: &Path,
        fs: &str,
        data: &str,
    ) -> Result<()> {
        let (dev, dir, fs_type) = (device.to_path_buf(), scratch.to_path_buf(), fs.to_string());
        let options = MountOptions {
            data: (!data.is_empty())
                .then(|| data.to_string())
                .into_iter()
                .collect(),
            ..Default::default()
        };
        self.off_worker(
            format!("replaying the log of {}", device.display()),
            self.deadlines.mount,
            move |m| {
                m.mount_fs(&dev, &dir, &fs_type, &options)?;
                m.unmount(&dir).map(|_| ())
            },
        )
        .await
    }

    async fn undo_stage(&self, backend: &dyn Backend, record: &StageRecord) -> Result<()> {
        // Only our own mount is unmounted; another's there stays.
        for _ in 0..MAX_STACKED_MOUNTS {
            match self.stage_presence(record).await? {
                Presence::Ours if matches!(record.capability.access, AccessType::Block) => break,
                Presence::Ours | Presence::Stale => match &record.attachment {
                    Some(Attachment::Remote { .. }) => {
                        self.unmount_remote(&record.staging_path).await?
                    }
                    _ => self.unmount_once(&record.staging_path).await?,
                },
                Presence::Absent => break,
                Presence::Foreign => {
                    if self.ours_below(record).await? {
                        return Err(Error::precondition(format!(
                            "another filesystem is mounted over volume {}'s at {}; ferrovol leaves it alone",
                            record.volume_id,
                            record.staging_path.display()
                        )));
                    }
                    break;
                }
            }
        }
        backend
            .node_detach(&record.volume_id, record.attachment.as_ref())
            .await?;
        self.remove_stage(&record.volume_id).await
    }

    /// Unmounts a remote filesystem at `path` with `umount`, forced, and
    /// lazily when its server does not answer (a lazy unmount never waits
    /// on it); whether it is still mounted comes from the mount table,
    /// which never asks the server either.
    async fn unmount_remote(&self, path: &Path) -> Result<()> {
        for _ in 0..MAX_STACKED_MOUNTS {
            let p = path.to_path_buf();
            let mounted = self
                .off_worker(
                    format!("reading the mount table for {}", path.display()),
                    self.deadlines.quick,
                    move |m| Ok(m.mounts()?.iter().any(|i| i.mount_point == p)),
                )
                .await?;
            if !mounted {
                return Ok(());
            }
            crate::mount::unmount_with_helper(self.runner.as_ref(), path, self.deadlines.quick)
                .await?;
        }
        Err(Error::internal(format!(
            "{} still mounted after {MAX_STACKED_MOUNTS} unmounts",
            path.display()
        )))
    }

    /// What a publish target of this stage shows when it is ours: the
    /// staged filesystem (mount access), or the attached device's node
    /// (block access).
    async fn target_identity(&self, stage: &StageRecord) -> Result<Option<MountId>> {
        match (&stage.capability.access, &stage.attachment) {
            (AccessType::Block, Some(Attachment::Device { path })) => {
                let p = path.clone();
                self.off_worker(
                    format!("identifying {}", path.display()),
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
        let (p, source) = (record.staging_path.clone(), mount_source(att));
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

    /// NodeUnstageVolume.
    pub async fn unstage(&self, id: &VolumeId, staging_path: &Path) -> Result<()> {
        let _guard = self.lock_volume(id)?;
        let backend = self.backend(id)?.clone();
        let Some(record) = self.state.stage(id) else {
            // Not staged as far as we know (the record is written before
            // anything is set up, so nothing of ours is mounted there):
            // release what the backend may hold, unmount nothing.
            return backend.node_detach(id, None).await;
        };
        if record.staging_path != staging_path {
            // Not staged at this path: nothing to undo here.
            return Ok(());
        }
        for p in self.state.publishes_of(id) {
            if self.is_mounted(&p.target_path).await.unwrap_or(true) {
                return Err(Error::precondition(format!(
                    "volume {id} is still published at {}; unpublish it first",
                    p.target_path.display()
                )));
            }
        }
        for p in self.state.publishes_of(id) {
            self.release_publish_device(&p, &record).await?;
            self.state.remove_publish(&p.target_path)?;
        }
        self.undo_stage(backend.as_ref(), &record).await
    }

    /// NodePublishVolume.
    pub async fn publish(&self, req: PublishRequest) -> Result<()> {
        let _guard = self.lock_target(&req.volume_id, &req.target_path)?;
        let backend = self.backend(&req.volume_id)?.clone();
        self.check_allowed(&req.target_path, "target_path")?;
        backend
            .supports(&req.capability)
            .map_err(|e| Error::precondition(e.message))?;
        let stage = self.stage_for_publish(&req, backend.as_ref()).await?;
        let mut record = PublishRecord {
            volume_id: req.volume_id.clone(),
            target_path: req.target_path.clone(),
            staging_path: req.staging_path.clone(),
            capability: req.capability.clone(),
            readonly: req.readonly,
            device: None,
        };
        let fresh = match self.state.publish(&req.target_path) {
            Some(existing) => {
                if self.republished(&stage, &existing, &record).await? {
                    return Ok(());
                }
                false
            }
            None => {
                self.check_single_publish(&req)?;
                true
            }
        };
        let bind = match &req.capability.access {
            AccessType::Block => self.block_bind(&req, &stage, &mut record).await?,
            AccessType::Mount { mount_flags, .. } => self.mount_bind(&req, &stage, mount_flags)?,
        };
        let bound = self.bind_target(fresh, record.clone(), bind).await;
        if bound.is_err() {
            let _ = self.release_publish_device(&record, &stage).await;
        }
        bound
    }

    /// The stage a publish binds from: staged on this node, at the
    /// staging path asked for, for the same access kind.
    async fn stage_for_publish(
        &self,
        req: &PublishRequest,
        backend: &dyn Backend,
    ) -> Result<StageRecord> {
        let Some(stage) = self.state.stage(&req.volume_id) else {
            if let Ok(None) = backend.get_volume(&req.volume_id, &req.secrets).await {
                return Err(Error::not_found(format!(
                    "volume {} does not exist",
                    req.volume_id
                )));
            }
            return Err(Error::precondition(format!(
                "volume {} is not staged on this node",
                req.volume_id
            )));
        };
        if stage.staging_path != req.staging_path {
            return Err(Error::precondition(format!(
                "volume {} is staged at {}, not {}",
                req.volume_id,
                stage.staging_path.display(),
                req.staging_path.display()
            )));
        }
        let is_block = matches!(req.capability.access, AccessType::Block);
        if is_block != matches!(stage.capability.access, AccessType::Block) {
            return Err(Error::precondition(format!(
                "volume {} was staged for {} access",
                req.volume_id,
                if is_block { "mount" } else { "block" }
            )));
        }
        Ok(stage)
    }

    /// A publish of a target already recorded: whether it is done already
    /// (the same arguments, our bind in place). The same arguments with
    /// the bind gone go on to bind again; other arguments, or another's
    /// mount there, are refused.
    async fn republished(
        &self,
        stage: &StageRecord,
        existing: &PublishRecord,
        asked: &PublishRecord,
    ) -> Result<bool> {
        let asked = PublishRecord {
            device: existing.device.clone(),
            ..asked.clone()
        };
        if *existing != asked {
            return Err(Error::already_exists(format!(
                "{} is already published with other arguments",
                asked.target_path.display()
            )));
        }
        match self.mount_id(&asked.target_path).await? {
            Some(id) if Some(id) == self.publish_identity(stage, existing).await? => Ok(true),
            Some(_) => Err(foreign(&asked.target_path)),
            // Not bound (any more): a read-only device it made goes
            // before another is made.
            None => {
                self.release_publish_device(existing, stage).await?;
                Ok(false)
            }
        }
    }

    /// A second target for a volume whose access mode allows one publish
    /// is refused.
    fn check_single_publish(&self, req: &PublishRequest) -> Result<()> {
        let others = self.state.publishes_of(&req.volume_id);
        match others.first() {
            Some(other) if !req.capability.mode.allows_multiple_publish() => {
                Err(Error::precondition(format!(
                    "volume {} is already published at {} and its access mode allows one publish",
                    req.volume_id,
                    other.target_path.display()
                )))
            }
            _ => Ok(()),
        }
    }

    /// A filesystem publish: the staging path bound at the target, with
    /// the capability's mount flags.
    fn mount_bind(
        &self,
        req: &PublishRequest,
        stage: &StageRecord,
        mount_flags: &[String],
    ) -> Result<Bind> {
        let readonly = req.readonly || req.capability.mode.is_readonly();
        Ok(Bind {
            volume_id: req.volume_id.clone(),
            source: stage.staging_path.clone(),
            options: MountOptions::parse(mount_flags, readonly)?,
            readonly,
            block: false,
            staged_remote: matches!(stage.attachment, Some(Attachment::Remote { .. }))
                .then(|| stage.staging_path.clone()),
        })
    }

    /// A raw block publish: the staged device bound at the target. A
    /// read-only bind of a device node does not stop writes through it: a
    /// read-only publish binds a read-only loop device of its own over the
    /// staged device (named in the record).
    async fn block_bind(
        &self,
        req: &PublishRequest,
        stage: &StageRecord,
        record: &mut PublishRecord,
    ) -> Result<Bind> {
        let Some(Attachment::Device { path }) = &stage.attachment else {
            return Err(Error::precondition(format!(
                "volume {} has no device attached",
                req.volume_id
            )));
        };
        let readonly = req.readonly || req.capability.mode.is_readonly();
        let source = match readonly {
            true => {
                let ro = self
                    .loops()
                    .attach_read_only(&self.host.canonical(path)?)
                    .await?;
                record.device = Some(ro.clone());
                ro
            }
            false => path.clone(),
        };
        Ok(Bind {
            volume_id: req.volume_id.clone(),
            source,
            options: MountOptions::parse(&[], readonly)?,
            readonly,
            block: true,
            staged_remote: None,
        })
    }

    /// Makes the target, records the publish and binds, in one call on the
    /// blocking pool; on a failure, takes back what it did. A `fresh`
    /// target (no record of it) that was there already is first checked
    /// to hold nothing: never bind over another's mount, nor onto anything
    /// that holds something. One made now holds nothing.
    async fn bind_target(&self, fresh: bool, record: PublishRecord, bind: Bind) -> Result<()> {
        let (host, state) = (self.host.clone(), self.state.clone());
        let target = record.target_path.clone();
        let what = format!("publishing {} at {}", bind.volume_id, target.display());
        self.off_worker(what, self.deadlines.quick, move |m| {
            if let Some(staging) = &bind.staged_remote {
                check_remote_stage(m, &bind.volume_id, staging)?;
            }
            let made_now = host.make_target(&target, bind.block)?;
            if fresh && !made_now {
                if m.mounted(&target)?.is_some() {
                    return Err(foreign(&target));
                }
                if !host.is_empty(&target)? {
                    return Err(Error::precondition(format!(
                        "target_path {} is not empty; ferrovol publishes only onto an empty directory or file",
                        target.display()
                    )));
                }
            }
            if let Err(e) = state.put_publish(record) {
                if made_now {
                    let _ = host.remove_target(&target);
                }
                return Err(e);
            }
            let bound = m.bind(&bind.source, &target, bind.readonly, &bind.options);
            if let Err(e) = bound {
                let _ = state.remove_publish(&target);
                let _ = host.remove_target(&target);
                return Err(match is_stale(&e) {
                    true => stale_stage(&bind.volume_id),
                    false => e,
                });
            }
            Ok(())
        })
        .await
    }

    /// NodeUnpublishVolume.
    pub async fn unpublish(&self, id: &VolumeId, target: &Path) -> Result<()> {
        let _guard = self.lock_target(id, target)?;
        let backend = self.backend(id)?.clone();
        let Some(record) = self.state.publish(target) else {
            return self
                .unpublish_unrecorded(backend.as_ref(), id, target)
                .await;
        };
        if &record.volume_id != id {
            return Err(Error::not_found(format!(
                "{} publishes volume {}, not {id}",
                target.display(),
                record.volume_id
            )));
        }
        let stage = self.state.stage(id);
        let expected = match &stage {
            Some(stage) => self.publish_identity(stage, &record).await?,
            None => None,
        };
        // Unmount our bind (and only ours: another's on top stays) and
        // remove the target, in one call on the blocking pool. A record
        // with a device of its own stays until the device is released.
        let (host, state) = (self.host.clone(), self.state.clone());
        let (t, has_device) = (target.to_path_buf(), record.device.is_some());
        let what = format!("unpublishing {}", target.display());
        let cleared = self
            .off_worker(what, self.deadlines.quick, move |m| {
                let mut current = m.mounted(&t)?;
                for _ in 0..MAX_STACKED_MOUNTS {
                    match current {
                        Some(m_id) if Some(m_id) == expected => {
                            m.unmount(&t)?;
                            current = m.mounted(&t)?;
                        }
                        _ => break,
                    }
                }
                let cleared = current.is_none();
                if cleared {
                    host.remove_target(&t)?;
                }
                if !(cleared && has_device) {
                    state.remove_publish(&t)?;
                }
                Ok(cleared)
            })
            .await?;
        if let (true, true, Some(stage)) = (cleared, has_device, &stage) {
            self.release_publish_device(&record, stage).await?;
            self.state.remove_publish(target)?;
        }
        Ok(())
    }

    /// An unpublish of a target with no record: nothing this driver
    /// published is recorded here, so nothing here is ours to take away
    /// but the empty directory a CO made for a publish that never happened
    /// (or whose record a crash lost), inside the paths this node mounts
    /// under. A file, a device node, a FIFO, a socket, a directory with
    /// anything in it, and whatever is mounted there stay as they are.
    async fn unpublish_unrecorded(
        &self,
        backend: &dyn Backend,
        id: &VolumeId,
        target: &Path,
    ) -> Result<()> {
        self.check_allowed(target, "target_path")?;
        if self.mount_id(target).await?.is_some() {
            return Ok(());
        }
        if !self.host.exists(target) {
            if let Ok(None) = backend.get_volume(id, &Secrets::default()).await {
                return Err(Error::not_found(format!("volume {id} does not exist")));
            }
            return Ok(());
        }
        self.host.remove_empty_dir(target)?;
        Ok(())
    }

    fn loops(&self) -> &LoopDevices {
        &self.loops
    }

    /// What a publish's bind mount is: its own read-only device's, or what
    /// [`NodeOps::target_identity`] says for the stage.
    async fn publish_identity(
        &self,
        stage: &StageRecord,
        record: &PublishRecord,
    ) -> Result<Option<MountId>> {
        match &record.device {
            Some(dev) => {
                let p = dev.clone();
                self.off_worker(
                    format!("identifying {}", dev.display()),
                    self.deadlines.quick,
                    move |m| m.node_id(&p).map(Some),
                )
                .await
            }
            None => self.target_identity(stage).await,
        }
    }

    /// Detaches the read-only device a publish made, if it did (and only
    /// if it still is that: read-only, over the staged device).
    async fn release_publish_device(
        &self,
        record: &PublishRecord,
        stage: &StageRecord,
    ) -> Result<()> {
        let (Some(dev), Some(Attachment::Device { path })) = (&record.device, &stage.attachment)
        else {
            return Ok(());
        };
        // A device gone from /dev (a LUN that went away) still names the
        // loop's backing as it was.
        let backing = self.host.canonical(path).unwrap_or_else(|_| path.clone());
        self.loops().detach_read_only(dev, &backing).await
    }

    /// Where a volume this node has staged is: its stage record and the
    /// path asked about, which must be its staging path or one of its
    /// publish targets. Anything else, an unknown volume first, is
    /// NOT_FOUND, whatever the path looks like.
    fn locate(&self, id: &VolumeId, raw_path: &str) -> Result<(StageRecord, PathBuf)> {
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
        if !known || !self.host.exists(&path) {
            return Err(not_here());
        }
        Ok((stage, path))
    }

    /// NodeGetVolumeStats.
    pub async fn stats(&self, id: &VolumeId, raw_path: &str) -> Result<VolumeStats> {
        let (stage, path) = self.locate(id, raw_path)?;
        let volume_path = path.as_path();
        let backend = self.backend(id)?.clone();
        let mut stats = VolumeStats::default();
        if let Some(att) = &stage.attachment {
            stats.abnormal = backend.node_condition(id, att).await?;
        } else {
            stats.abnormal = Some("the volume's device was never attached".into());
        }
        match stage.capability.access {
            AccessType::Mount { .. } => {
                let remote = matches!(stage.attachment, Some(Attachment::Remote { .. }));
                match self.is_mounted(&stage.staging_path).await {
                    Ok(true) => {}
                    Ok(false) => {
                        stats.abnormal.get_or_insert_with(|| {
                            format!("staging mount {} is gone", stage.staging_path.display())
                        });
                    }
                    // The server of a remote mount does not answer: say so,
                    // within the deadline, rather than wait on it again.
                    Err(e) if remote => {
                        stats.abnormal =
                            Some(format!("the filesystem does not answer: {}", e.message));
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
                        self.deadlines.quick,
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
                        stats.abnormal =
                            Some(format!("the filesystem does not answer: {}", e.message));
                    }
                    Err(e) => return Err(e),
                }
            }
            AccessType::Block => {
                // A publish target is the device itself; the staging path
                // of a block volume is a plain folder, so ask the device.
                let device = match (&stage.attachment, volume_path == stage.staging_path) {
                    (Some(Attachment::Device { path }), true) => path.clone(),
                    _ => volume_path.to_path_buf(),
                };
                stats.total_bytes = self.host.device_size(&device)?;
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
        let (stage, _path) = self.locate(id, raw_path)?;
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
        let mut size = backend.node_refresh_size(id, &attachment).await?;
        // A node-local volume lives here: when no controller grew it (the
        // node-local driver offers no controller expansion, so the resizer
        // leaves it all to kubelet), the node grows the LV or image itself.
        if required > 0 && size < required && backend.capabilities().node_local {
            backend
                .expand_volume(id, required, limit, &crate::plugin::Secrets::default())
                .await?;
            size = backend.node_refresh_size(id, &attachment).await?;
        }
        if required > 0 && size < required {
            return Err(Error::out_of_range(format!(
                "the device has {size} bytes, fewer than the {required} asked; expand the volume first"
            )));
        }
        if let (AccessType::Mount { .. }, Attachment::Device { path }) =
            (&stage.capability.access, &attachment)
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
