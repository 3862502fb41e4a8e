//! The `nfs` backend's volumes: making, deleting, looking up, listing,
//! growing and changing them (the controller's side).

use super::*;

#[async_trait::async_trait]
impl Provisioner for NfsBackend {
    fn clones(&self) -> bool {
        true
    }

    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        self.id_of(&self.location_for(req)?)
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let loc = self.location_for(req)?;
        let on_delete = match req.parameters.get("onDelete") {
            Some(v) => OnDelete::parse(v)?,
            None => self.settings.on_delete,
        };
        let mode = match req.parameters.get("mountPermissions") {
            Some(v) => parse_mode(v)?,
            None => self.settings.directory_mode,
        };
        let held = self.hold(&loc).await?;
        let (root, subdir) = (held.dir.clone(), loc.subdir.clone());
        let exists = {
            let (root, subdir) = (root.clone(), subdir.clone());
            blocking("inspecting the share", move || resolve(&root, &subdir)).await?
        };
        match Self::read_record(&held.dir, &loc.subdir).await? {
            Some(existing) => {
                if existing.name != req.name {
                    return Err(Error::already_exists(format!(
                        "subdirectory {} belongs to volume {:?}",
                        loc.subdir.display(),
                        existing.name
                    )));
                }
                check_existing(req, existing.capacity_bytes, req.source.as_ref())?;
                match exists {
                    Some(_) if !existing.filling => return self.info(&loc, &existing),
                    // A create the driver died in: its record claims the
                    // directory, which holds part of a fill at most.
                    Some(dir) => {
                        tracing::info!(volume = %req.name, "emptying a volume whose fill was cut short");
                        self.remove_volume_dir(&loc, dir).await?;
                    }
                    // Cut short before its directory was made.
                    None => {}
                }
            }
            // A directory without our record: someone else's, never ours to take.
            None if exists.is_some() => {
                return Err(Error::already_exists(format!(
                    "{} already exists on {}:{} and was not made by ferrovol",
                    loc.subdir.display(),
                    loc.server,
                    loc.share
                )));
            }
            None => {}
        }
        let mut record = VolumeRecord {
            name: req.name.clone(),
            subdir: loc.subdir.to_string_lossy().into_owned(),
            source: req.source.clone(),
            project_id: self
                .quota_path(&loc.server, &loc.share)
                .map(|_| Self::project_id(&loc.subdir)),
            // What was asked for (0: no size named): enforced with a
            // project quota where the export has them, else advisory.
            capacity_bytes: if req.required_bytes > 0 {
                req.required_bytes
            } else {
                req.limit_bytes
            },
            on_delete,
            mode: None,
            filling: req.source.is_some(),
        };
        // The record first: a crash in between leaves a record whose
        // directory a retry makes, never a directory nobody claims.
        Self::write_record(&held, &record).await?;
        let made = match self.btrfs_root(&loc.server, &loc.share) {
            Some(b) => self
                .make_subvolume(b, &subdir, mode, req.source.as_ref())
                .await
                .map(drop),
            None => {
                let made = {
                    let root = root.clone();
                    blocking("making the volume directory", move || {
                        ensure_dir(&root, &subdir, mode)
                    })
                    .await?
                };
                match &req.source {
                    Some(source) => {
                        crate::killpoint::hit(KillPoint::Fill);
                        self.fill_from(source, &made).await
                    }
                    None => Ok(()),
                }
            }
        };
        if let Err(e) = made {
            // Leave nothing half-filled behind: the CO retries.
            let left = {
                let (root, subdir) = (root.clone(), loc.subdir.clone());
                blocking("inspecting the share", move || resolve(&root, &subdir)).await
            };
            if let Ok(Some(dir)) = left {
                let _ = self.remove_volume_dir(&loc, dir).await;
            }
            let record_path = Self::record_path(&held.dir, &loc.subdir);
            let _ = std::fs::remove_file(record_path);
            return Err(e);
        }
        if record.filling {
            record.filling = false;
            Self::write_record(&held, &record).await?;
        }
        if let (Some(project), true) = (record.project_id, record.capacity_bytes > 0) {
            self.apply_quota(&loc, project, record.capacity_bytes)
                .await?;
        }
        self.info(&loc, &record)
    }

    async fn delete_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<()> {
        let Ok(loc) = self.locate(id) else {
            return Ok(());
        };
        let held = self.hold(&loc).await?;
        let Some(record) = Self::read_record(&held.dir, &loc.subdir).await? else {
            return Ok(()); // absent, or not ours
        };
        let found = {
            let (root, subdir) = (held.dir.clone(), loc.subdir.clone());
            blocking("inspecting the share", move || resolve(&root, &subdir)).await?
        };
        if let Some(dir) = found {
            match record.on_delete {
                OnDelete::Retain => {}
                OnDelete::Delete => {
                    if let Some(project) = record.project_id {
                        self.set_limit(&loc, project, 0).await?;
                    }
                    // In the process, no `rm`: links are removed themselves,
                    // never followed, and nothing mounted inside is
                    // crossed into.
                    self.remove_volume_dir(&loc, dir).await.map_err(|e| {
                        if e.os_error == Some(libc::EBUSY) {
                            // A node's NFS client still holds a file it
                            // silly-renamed (`.nfs*`, one deleted while
                            // open): gone once its close reaches the
                            // server, so the CO's retry succeeds.
                            Error::unavailable(format!(
                                "{e}: a client still holds a deleted file of the volume open; retry"
                            ))
                        } else {
                            e
                        }
                    })?;
                }
                OnDelete::Archive => {
                    let stamp = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs();
                    let flat = record.subdir.replace('/', "_");
                    let root = held.dir.clone();
                    blocking("archiving the volume directory", move || {
                        let archive = ensure_dir(&root, Path::new(".ferrovol/archive"), 0o700)?;
                        let to = archive.join(format!("{flat}-{stamp}"));
                        std::fs::rename(&dir, &to)
                            .map_err(|e| Error::io(format!("archive {}", dir.display()), e))
                    })
                    .await?;
                }
            }
        }
        let path = Self::record_path(&held.dir, &loc.subdir);
        let on_nfs = held.on_nfs;
        blocking("removing the volume record", move || {
            remove_on_share(on_nfs, &path).map(drop)
        })
        .await
    }

    async fn get_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        let Ok(loc) = self.locate(id) else {
            return Ok(None);
        };
        let held = self.hold(&loc).await?;
        match Self::read_record(&held.dir, &loc.subdir).await? {
            Some(r) => Ok(Some(self.info(&loc, &r)?)),
            None => Ok(None),
        }
    }

    /// The volumes on the configured exports (a server a StorageClass
    /// names directly is not listed: the backend does not know of it).
    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        let mut out = Vec::new();
        for export in &self.settings.exports {
            let held = self.hold_share(&export.server, &export.share).await?;
            let dir = held.dir.join(META_DIR).join("volumes");
            let records: Vec<VolumeRecord> = blocking("listing volume records", move || {
                let mut records = Vec::new();
                let entries = match std::fs::read_dir(&dir) {
                    Ok(e) => e,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(records),
                    Err(e) => return Err(Error::io(format!("read {}", dir.display()), e)),
                };
                for entry in entries.flatten() {
                    if let Ok(bytes) = std::fs::read(entry.path()) {
                        if let Ok(r) = crate::records::decode_record::<VolumeRecord>("", &bytes) {
                            records.push(r);
                        }
                    }
                }
                Ok(records)
            })
            .await?;
            for r in records.into_iter().filter(|r| !r.filling) {
                let Ok(subdir) = check_subdir(&r.subdir) else {
                    continue;
                };
                let loc = Location {
                    server: export.server.clone(),
                    share: export.share.clone(),
                    subdir,
                };
                if let Ok(info) = self.info(&loc, &r) {
                    out.push(info);
                }
            }
        }
        Ok(page.apply(out, |v| v.id.locator()))
    }

    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        let (server, share) = self.export_for(parameters)?;
        let held = self.hold_share(&server, &share).await?;
        let (host, dir) = (self.host.clone(), held.dir.clone());
        let usage = blocking("reading the share's usage", move || host.fs_usage(&dir)).await?;
        Ok(Capacity {
            available_bytes: usage.available_bytes,
            maximum_volume_bytes: Some(usage.available_bytes),
            minimum_volume_bytes: None,
        })
    }
}

#[async_trait::async_trait]
impl Expander for NfsBackend {
    fn online(&self) -> bool {
        true
    }

    /// Capacity on NFS is what the volume was asked for: recorded, and
    /// grown here, but not enforced (every volume of an export shares its
    /// space).
    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        _secrets: &Secrets,
    ) -> Result<u64> {
        let loc = self.locate(id)?;
        let held = self.hold(&loc).await?;
        let mut record = Self::read_record(&held.dir, &loc.subdir)
            .await?
            .ok_or_else(|| Error::no_volume(id))?;
        if limit > 0 && required > limit {
            return Err(Error::over_limit(required, limit));
        }
        if required > record.capacity_bytes {
            if let Some(project) = record.project_id {
                self.set_limit(&loc, project, required).await?;
            }
            record.capacity_bytes = required;
            Self::write_record(&held, &record).await?;
        }
        Ok(record.capacity_bytes)
    }
}

#[async_trait::async_trait]
impl Modifier for NfsBackend {
    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        Changes::parse(changes).map(|_| ())
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        _secrets: &Secrets,
    ) -> Result<()> {
        let changes = Changes::parse(changes)?;
        let gone = || Error::no_volume(id);
        let loc = self.locate(id).map_err(|_| gone())?;
        let held = self.hold(&loc).await?;
        let mut record = Self::read_record(&held.dir, &loc.subdir)
            .await?
            .ok_or_else(gone)?;
        let before = record.clone();
        let (root, subdir) = (held.dir.clone(), loc.subdir.clone());
        // The directory's mode first, remembering the old one: if the
        // record cannot follow, the mode goes back (all or nothing).
        let old_mode = match changes.mode {
            Some(mode) => Some(
                blocking("changing the volume directory's mode", move || {
                    set_mode(&root, &subdir, mode)
                })
                .await?,
            ),
            None => None,
        };
        if let Some(mode) = changes.mode {
            record.mode = Some(mode);
        }
        if let Some(on_delete) = changes.on_delete {
            record.on_delete = on_delete;
        }
        if record == before {
            return Ok(());
        }
        if let Err(e) = Self::write_record(&held, &record).await {
            if let Some(old) = old_mode {
                let (root, subdir) = (held.dir.clone(), loc.subdir.clone());
                let _ = blocking("restoring the directory's mode", move || {
                    set_mode(&root, &subdir, old)
                })
                .await;
            }
            return Err(e);
        }
        Ok(())
    }
}
