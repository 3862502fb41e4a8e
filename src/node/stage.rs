//! NodeStageVolume and NodeUnstageVolume: attach, format (never over
//! another filesystem), renew a copy's UUID, mount once at the staging
//! path; and the reverse, touching only what this driver made.

use super::*;

/// A stage's capability against its backend (see
/// [`crate::plugin::Unsupported`] for the
/// codes).
fn check_stage_capability(backend: &dyn Backend, capability: &VolumeCapability) -> Result<()> {
    backend
        .supports(capability)
        .map_err(crate::plugin::Unsupported::at_node)
}

impl NodeOps {
    /// NodeStageVolume.
    pub async fn stage(&self, req: StageRequest) -> Result<()> {
        let _guard = self.lock_volume(&req.volume_id)?;
        let backend = self.backend(&req.volume_id)?.clone();
        self.check_allowed(&req.staging_path, "staging_target_path")?;
        check_stage_capability(backend.as_ref(), &req.capability)?;
        let existing = self.state.stage(&req.volume_id);
        if let Some(existing) = &existing {
            if self.restage_done(&req, existing).await? {
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
            crypt: None,
            // An interrupted stage's intent is kept: its LUKS format may
            // have been cut short.
            crypt_formatting: existing.is_some_and(|e| e.crypt_formatting),
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
        let id = match self.mount_id(path).await {
            Ok(id) => id,
            // A filesystem shut down after errors answers a stat with EIO:
            // known by the mount table's device number instead.
            Err(e) if e.os_error == Some(libc::EIO) => {
                return Ok(match (self.top_entry(path).await?, record.mounted) {
                    (None, _) => Presence::Absent,
                    (Some(en), Some(ours)) if same_device(&en.dev, ours) => Presence::Ours,
                    _ => Presence::Foreign,
                })
            }
            Err(e) => return Err(e),
        };
        let Some(id) = id else {
            return Ok(Presence::Absent);
        };
        Ok(match record.mounted {
            Some(ours) if ours == id => Presence::Ours,
            Some(_) => Presence::Foreign,
            // Mounted but not yet recorded (a crash in between, or a record
            // older than this check): ours if it is our device's.
            None => match self.top_entry(path).await? {
                Some(e) if e.source == mount_source(record, attachment) => {
                    let mut updated = record.clone();
                    updated.mounted = Some(id);
                    self.put_stage(updated).await?;
                    Presence::Ours
                }
                _ => Presence::Foreign,
            },
        })
    }

    async fn finish_stage(
        &self,
        backend: &dyn Backend,
        record: &mut StageRecord,
        ctx: &AttachContext,
    ) -> Result<()> {
        let attachment = backend
            .staging()?
            .node_attach(&record.volume_id, ctx)
            .await?;
        record.attachment = Some(attachment.clone());
        self.put_stage(record.clone()).await?;
        // A read-only mode, or a read-only ControllerPublish.
        let readonly = ctx.readonly || record.capability.mode.is_readonly();
        if let Attachment::Device { path } = &attachment {
            self.unlock(record, path, ctx, readonly).await?;
        }
        let AccessType::Mount { mount_flags, .. } = &record.capability.access else {
            return Ok(());
        };
        let fs = record
            .fs_type
            .clone()
            .unwrap_or_else(|| fs::DEFAULT_FS.into());
        let options = MountOptions::parse(mount_flags, readonly)?;
        match self.stage_presence(record).await? {
            Presence::Ours => return Ok(()),
            Presence::Absent => {}
            Presence::Stale => self.unmount_remote(&record.staging_path).await?,
            Presence::Foreign => return Err(foreign(&record.staging_path)),
        }
        let target = record.staging_path.clone();
        match &attachment {
            Attachment::Device { .. } => {
                let path = &record.device().unwrap_or_default();
                if backend
                    .device_mounting()?
                    .node_copy_pending(&record.volume_id, ctx)
                    .await?
                {
                    self.renew_fs_uuid(path, &target).await?;
                    backend
                        .device_mounting()?
                        .node_copy_done(&record.volume_id, ctx)
                        .await?;
                }
                if !readonly {
                    let extra = fs::mkfs_options(
                        Some(&fs),
                        ctx.volume_context
                            .get(fs::MKFS_OPTIONS)
                            .map_or("", String::as_str),
                    )?;
                    let made =
                        fs::format_if_unformatted(self.runner.as_ref(), path, &fs, &extra).await?;
                    // A filesystem that recorded errors is checked before
                    // a pod gets it, and refused when they stay.
                    if !made
                        && fs::preen_if_errors(self.runner.as_ref(), self.host.clone(), path, &fs)
                            .await?
                    {
                        tracing::warn!(
                            volume = %record.volume_id,
                            device = %path.display(),
                            "the filesystem had recorded errors: e2fsck -p repaired it before the mount"
                        );
                    }
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
                // A client that shares one superblock among the mounts of
                // a server's export (NFS's) would share one label: an
                // SELinux label is the superblock's, so a labelled volume
                // gets one of its own.
                if let Some(own) = crate::mount::own_superblock_option(fs_type) {
                    if !opts.selinux().is_empty() && !opts.data.iter().any(|d| d == own) {
                        opts.data.push(own.into());
                    }
                }
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

    /// An encrypted volume's device opened (its LUKS2 header made first
    /// when the volume asks for encryption and the device is empty), the
    /// mapping named in the record before it is opened. A device with a
    /// header of ours is opened whatever the volume context says (a
    /// restore or clone of an encrypted volume); one with another's header,
    /// or a volume that asks for encryption over unencrypted data, is
    /// refused. A mapping left open for this device (a restart) is reused.
    async fn unlock(
        &self,
        record: &mut StageRecord,
        device: &Path,
        ctx: &AttachContext,
        readonly: bool,
    ) -> Result<()> {
        let runner = self.runner.as_ref();
        let wanted = ctx
            .volume_context
            .get(crypt::CONTEXT_KEY)
            .is_some_and(|v| v == crypt::LUKS2);
        let header = crypt::header(device).await?;
        if !wanted && header.is_none() {
            return Ok(());
        }
        let name = crypt::name_for(&record.volume_id.to_string());
        // A mapping of ours already open on this device: a stage that
        // was cut short, or a restart.
        let devno = crypt::devno(device)?;
        let open = crypt::backing(runner, &name).await?;
        if open == Some(devno) {
            if record.crypt.is_none() {
                record.crypt = Some(name);
                self.put_stage(record.clone()).await?;
            }
            return Ok(());
        }
        match &header {
            None if !wanted => return Ok(()),
            Some(s) if s != crypt::SUBSYSTEM => {
                return Err(Error::not_ours(
                    format_args!("the LUKS volume on volume {}'s device", record.volume_id),
                    "not opening it",
                ))
            }
            _ => {}
        }
        let passphrase = ctx.secrets.get(crypt::PASSPHRASE_KEY).ok_or_else(|| {
            Error::invalid(format!(
                "volume {} is encrypted: NodeStage needs its passphrase in secret {}",
                record.volume_id,
                crypt::PASSPHRASE_KEY
            ))
        })?;
        crypt::check_passphrase(passphrase)?;
        // A format of ours cut short (the record's intent, and a header of
        // ours with no key slot): nothing was ever opened, so nothing was
        // written behind it; it is formatted again. A header with a key
        // slot is never formatted over, whatever the intent says.
        let cut_short = record.crypt_formatting
            && header.as_deref() == Some(crypt::SUBSYSTEM)
            && !crypt::has_key_slot(device).await?;
        if cut_short {
            tracing::warn!(volume = %record.volume_id, "a LUKS format cut short (no key slot): formatting again");
        }
        if let Some(other) = open {
            // Our name over another device: a mapping left from an earlier
            // attach (the device renamed since); closed only when unused.
            tracing::warn!(volume = %record.volume_id, device = ?other, "closing a stale encryption mapping");
            crypt::close(runner, &name).await?;
        }
        if header.is_none() || cut_short {
            if readonly {
                return Err(Error::precondition(format!(
                    "volume {} asks for encryption but was never formatted; its first stage cannot be read-only",
                    record.volume_id
                )));
            }
            if header.is_none() {
                if let Some(found) = fs::probe(runner, device).await? {
                    return Err(Error::precondition(format!(
                        "volume {} asks for encryption but its device holds unencrypted data ({found}); not formatting over it",
                        record.volume_id
                    )));
                }
            }
            // The intent first: a death inside luksFormat leaves a record
            // that says a header without a key slot is ours to redo.
            record.crypt_formatting = true;
            self.put_stage(record.clone()).await?;
            crate::killpoint::hit(crate::killpoint::Step::CryptFormatting);
            if let Err(e) = crypt::format(runner, device, passphrase, self.kdf).await {
                // A failed format (cryptsetup's error, or its timeout) may
                // leave part of a header: it goes, as the stage's undo
                // takes the intent with the record. The device held
                // nothing before (checked above, or a format of ours).
                if let Err(w) = crypt::wipe_header(device).await {
                    tracing::warn!(volume = %record.volume_id, error = %w.message, "could not wipe a failed LUKS header");
                }
                return Err(e);
            }
            crate::killpoint::hit(crate::killpoint::Step::CryptFormatted);
        }
        record.crypt = Some(name.clone());
        record.crypt_formatting = false;
        self.put_stage(record.clone()).await?;
        crypt::open(runner, device, &name, passphrase, readonly).await
    }

    /// Gives the filesystem on a copied device a UUID of its own (see
    /// [`DeviceMounter::node_copy_pending`](crate::plugin::DeviceMounter::node_copy_pending)), and checks that it changed: some
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
        if let (Some(att @ Attachment::Device { .. }), AccessType::Mount { .. }) =
            (&record.attachment, &record.capability.access)
        {
            if let Err(e) = backend
                .staging()?
                .node_release_io(&record.volume_id, att)
                .await
            {
                tracing::warn!(volume = %record.volume_id, error = %e.message,
                    "could not release the I/O of storage that is gone; unmounting anyway");
            }
        }
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
                        return Err(Error::not_ours(
                            format_args!(
                                "the filesystem mounted over volume {}'s at {}",
                                record.volume_id,
                                record.staging_path.display()
                            ),
                            "left mounted",
                        ));
                    }
                    break;
                }
            }
        }
        if let Some(name) = &record.crypt {
            crypt::close(self.runner.as_ref(), name).await?;
        }
        backend
            .staging()?
            .node_detach(&record.volume_id, record.attachment.as_ref())
            .await?;
        self.remove_stage(&record.volume_id).await
    }

    /// Unmounts a remote filesystem at `path` with `umount`, and lazily
    /// when its server does not answer (a lazy unmount never waits on it;
    /// never forced, which would fail the writes of the node's other
    /// volumes on the same export); whether it is still mounted comes from the mount table,
    /// which never asks the server either.
    async fn unmount_remote(&self, path: &Path) -> Result<()> {
        for _ in 0..MAX_STACKED_MOUNTS {
            let p = path.to_path_buf();
            let mounted = self
                .off_worker(
                    format!("reading the mount table for {}", path.display()),
                    self.deadlines.quick,
                    move |m| {
                        Ok(m.mounts()?
                            .into_iter()
                            .rev()
                            .find(|i| i.mount_point == p)
                            .map(|i| i.fstype))
                    },
                )
                .await?;
            let Some(fs_type) = mounted else {
                return Ok(());
            };
            crate::mount::unmount_with_helper(
                self.runner.as_ref(),
                path,
                &fs_type,
                self.deadlines.quick,
            )
            .await?;
        }
        Err(Error::internal(format!(
            "{} still mounted after {MAX_STACKED_MOUNTS} unmounts",
            path.display()
        )))
    }

    /// NodeUnstageVolume.
    pub async fn unstage(&self, id: &VolumeId, staging_path: &Path) -> Result<()> {
        let _guard = self.lock_volume(id)?;
        let backend = self.backend(id)?.clone();
        let Some(record) = self.state.stage(id) else {
            // Not staged as far as we know (the record is written before
            // anything is set up, so nothing of ours is mounted there):
            // release what the backend may hold, unmount nothing.
            return backend.staging()?.node_detach(id, None).await;
        };
        if record.staging_path != staging_path {
            // Not staged at this path: nothing to undo here.
            return Ok(());
        }
        for p in self.state.publishes_of(id) {
            if self.is_mounted(&p.target_path).await.unwrap_or(true) {
                return Err(Error::in_use(
                    format_args!("volume {id}"),
                    format_args!("published at {}", p.target_path.display()),
                    "unpublish it first",
                ));
            }
        }
        for p in self.state.publishes_of(id) {
            self.release_publish_device(&p, &record).await?;
            self.state.remove_publish(&p.target_path)?;
        }
        self.undo_stage(backend.as_ref(), &record).await
    }
}

/// The node's part in a group snapshot: the staged filesystems of the
/// group's sources frozen together (see `plugin::Quiesce`).
#[async_trait::async_trait]
impl crate::plugin::Quiesce for NodeOps {
    async fn freeze(
        &self,
        volumes: &[VolumeId],
        staged_ok: bool,
        block_ok: bool,
        deadline: std::time::Duration,
    ) -> Result<crate::host::freeze::Frozen> {
        let mut paths = Vec::new();
        for id in volumes {
            let Some(record) = self.state().stage(id) else {
                continue; // not staged here: nothing writes to it here
            };
            if !staged_ok {
                return Err(Error::precondition(format!(
                    "volume {id} is staged at {}: its backend snapshots a volume by holding \
                     the device itself, which this kernel cannot do under a filesystem frozen \
                     for the group (Linux 6.8 and later can), so its group snapshots are taken \
                     only while no member is in use (stop the workload, then snapshot)",
                    record.staging_path.display()
                )));
            }
            if matches!(record.capability.access, AccessType::Block) {
                if block_ok {
                    continue;
                }
                return Err(Error::precondition(format!(
                    "volume {id} is staged as a raw block device at {}: nothing can hold its \
                     writes for a group snapshot (unstage it, or use a filesystem volume)",
                    record.staging_path.display()
                )));
            }
            match self.stage_presence(&record).await? {
                Presence::Ours => paths.push(record.staging_path.clone()),
                Presence::Absent => {}
                Presence::Stale | Presence::Foreign => {
                    return Err(Error::precondition(format!(
                        "volume {id}'s staging path {} does not hold its own filesystem; \
                         it cannot be frozen for a group snapshot",
                        record.staging_path.display()
                    )))
                }
            }
        }
        if paths.is_empty() {
            return Ok(crate::host::freeze::Frozen::none());
        }
        let Some(freezer) = &self.freezer else {
            return Err(Error::internal("this node has no freezer"));
        };
        freezer.freeze(paths, deadline).await
    }
}
