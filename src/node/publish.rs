//! NodePublishVolume and NodeUnpublishVolume: a bind of the staged
//! filesystem (or device) at the target, made, recorded and bound in one
//! call on the blocking pool; and the reverse, taking away only our bind.

use super::*;

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

impl NodeOps {
    /// NodePublishVolume.
    pub async fn publish(&self, req: PublishRequest) -> Result<()> {
        let _guard = match req.capability.mode.is_one_publish() {
            true => self.lock_only_target(&req.volume_id, &req.target_path)?,
            false => self.lock_target(&req.volume_id, &req.target_path)?,
        };
        let backend = self.backend(&req.volume_id)?.clone();
        self.check_allowed(&req.target_path, "target_path")?;
        backend
            .supports(&req.capability)
            .map_err(crate::plugin::Unsupported::at_node)?;
        let stage = self.stage_for_publish(&req, backend.as_ref()).await?;
        let mut record = PublishRecord {
            volume_id: req.volume_id.clone(),
            target_path: req.target_path.clone(),
            staging_path: req.staging_path.clone(),
            capability: req.capability.clone(),
            readonly: req.readonly,
            device: None,
            bound: None,
            limited: None,
            unlimited: None,
            class_limits: None,
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
        self.check_staged_fs(&req.volume_id, &stage).await?;
        let bind = match &req.capability.access {
            AccessType::Block => {
                let bind = self.block_bind(&req, &stage, &mut record).await?;
                record.bound = self.publish_identity(&stage, &record).await?;
                bind
            }
            AccessType::Mount { mount_flags, .. } => self.mount_bind(&req, &stage, mount_flags)?,
        };
        // The limits are recorded before they are written (below). The
        // pod and device are kept even when there are none, for a limit a
        // later change sets.
        record.class_limits = Some(req.io.limits);
        self.ask_first(&req.volume_id).await;
        let wanted = self.limits_now(&record);
        if req.io.pod_uid.is_some() || !wanted.is_empty() {
            match self.io_target(&req, &stage, &record, wanted) {
                Ok(limited) => record.limited = Some(limited),
                Err(why) if !wanted.is_empty() => record.unlimited = Some(why),
                Err(_) => {}
            }
        }
        let bound = self.bind_target(fresh, record.clone(), bind).await;
        if bound.is_err() {
            let _ = self.release_publish_device(&record, &stage).await;
            return bound;
        }
        crate::killpoint::hit(crate::killpoint::Step::PublishLimited);
        self.set_limits(record.clone()).await;
        // A change recorded meanwhile (after this read the book, before
        // its record was there for the change to find) is made now.
        if self.limit_book.is_some() {
            self.relimit_target(&record.target_path).await;
        }
        Ok(())
    }

    /// A staged filesystem the kernel found errors in, made read-only or
    /// shut down is not handed to another pod as if it were healthy: the
    /// publish is refused with what was found.
    async fn check_staged_fs(&self, id: &VolumeId, stage: &StageRecord) -> Result<()> {
        if !matches!(stage.capability.access, AccessType::Mount { .. }) {
            return Ok(());
        }
        let until = std::time::Instant::now() + self.deadlines.quick;
        let found: Vec<String> = self
            .fs_troubles(stage, until)
            .await
            .into_iter()
            .filter(|f| f.reason != crate::plugin::health::Reason::HealthCheckFailed)
            .map(|f| f.message)
            .collect();
        if found.is_empty() {
            return Ok(());
        }
        Err(Error::precondition(format!(
            "volume {id} is not published: {}",
            found.join("; ")
        )))
    }

    /// The stage a publish binds from: staged on this node, at the
    /// staging path asked for, for the same access kind.
    async fn stage_for_publish(
        &self,
        req: &PublishRequest,
        backend: &dyn Backend,
    ) -> Result<StageRecord> {
        let Some(stage) = self.state.stage(&req.volume_id) else {
            if let Some(Ok(None)) = lookup(backend, &req.volume_id, &req.secrets).await {
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
        check_selinux_label(&req.volume_id, &stage.capability, &req.capability)?;
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
            bound: existing.bound,
            limited: existing.limited.clone(),
            unlimited: existing.unlimited.clone(),
            class_limits: existing.class_limits,
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

    /// A second target for a volume on this node is refused when either
    /// publish asks to be the only one (SINGLE_NODE_SINGLE_WRITER): the
    /// new one, or one already there. Every other mode may have as many
    /// targets on the node as the CO asks for.
    fn check_single_publish(&self, req: &PublishRequest) -> Result<()> {
        let others = self.state.publishes_of(&req.volume_id);
        let conflict = match req.capability.mode.is_one_publish() {
            true => others.first(),
            false => others.iter().find(|o| o.capability.mode.is_one_publish()),
        };
        match conflict {
            Some(other) => Err(Error::precondition(format!(
                "volume {} is already published at {} and {} allows one publish on a node",
                req.volume_id,
                other.target_path.display(),
                AccessMode::SingleNodeSingleWriter.name()
            ))),
            None => Ok(()),
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
        let Some(path) = &stage.device() else {
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
        // A raw block publish's bind is known by the device node it bound,
        // recorded then: the device may be gone since. A record from
        // before that was recorded, whose device is gone, takes the device
        // node bound at the target for its own.
        let (expected, any_device_node) = match (&stage, record.bound) {
            (_, Some(bound)) => (Some(bound), false),
            (Some(stage), None) => match self.publish_identity(stage, &record).await {
                Ok(id) => (id, false),
                Err(e) if storage_lost(&e) && by_table(stage).is_some() => {
                    return self.unpublish_lost(stage, &record, target).await;
                }
                Err(e)
                    if e.kind == crate::error::Kind::NotFound
                        && matches!(record.capability.access, AccessType::Block) =>
                {
                    (None, true)
                }
                Err(e) => return Err(e),
            },
            (None, None) => (None, false),
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
                        Some(m_id)
                            if Some(m_id) == expected || (any_device_node && m_id.rdev != 0) =>
                        {
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
            .await;
        // Our bind of a remote filesystem whose directory is gone on its
        // server answers ESTALE, one of a filesystem shut down EIO: known
        // by the mount table instead.
        let cleared = match (cleared, &stage) {
            (Err(e), Some(stage)) if storage_lost(&e) && by_table(stage).is_some() => {
                return self.unpublish_lost(stage, &record, target).await;
            }
            (cleared, _) => cleared?,
        };
        if cleared {
            self.clear_limits(&record).await;
        }
        if let (true, true, Some(stage)) = (cleared, has_device, &stage) {
            self.release_publish_device(&record, stage).await?;
            self.state.remove_publish(target)?;
        }
        Ok(())
    }

    /// [`NodeOps::unpublish_by_table`], then the limits the publish set
    /// cleared.
    async fn unpublish_lost(
        &self,
        stage: &StageRecord,
        record: &PublishRecord,
        target: &Path,
    ) -> Result<()> {
        self.unpublish_by_table(stage, target).await?;
        self.clear_limits(record).await;
        Ok(())
    }

    /// An unpublish whose target answers a stat with an error of storage
    /// that is gone: our bind of a remote filesystem whose directory was
    /// removed or replaced on its server (ESTALE), or of a filesystem the
    /// kernel shut down (EIO). The binds there that are the stage's (by the
    /// mount table, which needs no answer from the filesystem: the remote
    /// source, or the staged device's number) are unmounted, a remote one
    /// through the mount helper, and the target goes with its record.
    /// Another's mount on top stays, and so does the target under it.
    async fn unpublish_by_table(&self, stage: &StageRecord, target: &Path) -> Result<()> {
        let Some(ours) = by_table(stage) else {
            return Err(Error::internal(
                "no way to know this publish by the mount table",
            ));
        };
        for _ in 0..MAX_STACKED_MOUNTS {
            let t = target.to_path_buf();
            let top = self
                .off_worker(
                    format!("reading the mount table for {}", target.display()),
                    self.deadlines.quick,
                    move |m| Ok(m.mounts()?.into_iter().rev().find(|i| i.mount_point == t)),
                )
                .await?;
            match (top, &ours) {
                (Some(e), Known::Remote(source)) if e.source == *source => {
                    crate::mount::unmount_with_helper(
                        self.runner.as_ref(),
                        target,
                        &e.fstype,
                        self.deadlines.quick,
                    )
                    .await?
                }
                (Some(e), Known::Device(id)) if same_device(&e.dev, *id) => {
                    self.unmount_once(target).await?
                }
                (Some(_), _) => return Ok(()),
                (None, _) => {
                    let (host, state, t) =
                        (self.host.clone(), self.state.clone(), target.to_path_buf());
                    return crate::host::off_worker(
                        "removing a stale publish's target",
                        self.deadlines.quick,
                        move || {
                            host.remove_target(&t)?;
                            state.remove_publish(&t)
                        },
                    )
                    .await;
                }
            }
        }
        Err(Error::internal(format!(
            "{} still mounted after {MAX_STACKED_MOUNTS} unmounts",
            target.display()
        )))
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
            if let Some(Ok(None)) = lookup(backend, id, &Secrets::default()).await {
                return Err(Error::no_volume(id));
            }
            return Ok(());
        }
        self.host.remove_empty_dir(target)?;
        Ok(())
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
    pub(super) async fn release_publish_device(
        &self,
        record: &PublishRecord,
        stage: &StageRecord,
    ) -> Result<()> {
        let (Some(dev), Some(path)) = (&record.device, &stage.device()) else {
            return Ok(());
        };
        // A device gone from /dev (a LUN that went away) still names the
        // loop's backing as it was.
        let backing = self.host.canonical(path).unwrap_or_else(|_| path.clone());
        self.loops().detach_read_only(dev, &backing).await
    }
}

/// The volume as its backend finds it, where the backend looks volumes up
/// (`None` where it does not: a node cannot tell a volume that never
/// existed from one it was not given).
async fn lookup(
    backend: &dyn Backend,
    id: &crate::plugin::VolumeId,
    secrets: &Secrets,
) -> Option<Result<Option<crate::plugin::VolumeInfo>>> {
    Some(backend.provisioner()?.get_volume(id, secrets).await)
}

/// How a stage's binds are known by the mount table alone.
enum Known {
    /// A remote filesystem's source.
    Remote(String),
    /// The staged filesystem's device.
    Device(MountId),
}

/// How the binds of a filesystem stage are known by the mount table (a
/// remote source, the staged device's number), if they can be.
fn by_table(stage: &StageRecord) -> Option<Known> {
    if !matches!(stage.capability.access, AccessType::Mount { .. }) {
        return None;
    }
    match (&stage.attachment, stage.mounted) {
        (Some(att @ Attachment::Remote { .. }), _) => Some(Known::Remote(mount_source(stage, att))),
        (Some(Attachment::Device { .. }), Some(id)) => Some(Known::Device(id)),
        _ => None,
    }
}

/// An SELinux label is the staged filesystem's (its superblock's): a
/// publish that asks for one (`context="..."`, KEP-1710) gets the staged
/// filesystem only when it was mounted with the same; the pod would
/// otherwise see files of another label. A publish that asks none binds
/// whatever was staged.
fn check_selinux_label(
    id: &VolumeId,
    staged: &crate::plugin::VolumeCapability,
    asked: &crate::plugin::VolumeCapability,
) -> Result<()> {
    let labels = |cap: &crate::plugin::VolumeCapability| -> Result<Vec<String>> {
        match &cap.access {
            AccessType::Mount { mount_flags, .. } => Ok(MountOptions::parse(mount_flags, false)?
                .selinux()
                .into_iter()
                .map(str::to_string)
                .collect()),
            AccessType::Block => Ok(Vec::new()),
        }
    };
    let asked = labels(asked)?;
    if asked.is_empty() {
        return Ok(());
    }
    let staged = labels(staged)?;
    if asked == staged {
        return Ok(());
    }
    let say = |l: &[String]| match l.is_empty() {
        true => "no SELinux label".to_string(),
        false => l.join(","),
    };
    Err(Error::precondition(format!(
        "volume {id} is staged with {} and cannot be published with {}: an SELinux label \
         belongs to the whole mounted filesystem; unstage it (stop its other pods) to stage it \
         with the new one",
        say(&staged),
        say(&asked)
    )))
}
