//! The `rbd` backend's snapshots: taking, deleting, listing them, groups
//! cut at one instant, and their changed blocks.

use super::*;

#[async_trait::async_trait]
impl Snapshotter for RbdBackend {
    /// An rbd snapshot is one instant of the image in the cluster.
    fn instant(&self) -> SnapshotInstant {
        SnapshotInstant::Own
    }

    /// Every member's writers hand over their exclusive lock while the
    /// group is cut.
    fn groups(&self) -> Groups<'_> {
        Groups::Cut(self)
    }

    fn snapshot_id_for(&self, req: &CreateSnapshot) -> Result<SnapshotId> {
        let src = self.volume_spec(&req.source)?;
        let spec = src.with_image(&format!("fvs-{}", locator_for_name(&req.name)));
        SnapshotId::new(&self.name, &self.locator(&spec)?)
    }

    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        let src = self.volume_spec(&req.source).map_err(|_| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        let creds = self.creds(&req.secrets)?;
        let spec = Self::snapshot_image(&src, req);
        let source = req.source.to_string();
        if let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? {
            if meta.get(META_NAME) != Some(&req.name) || meta.get(META_SOURCE) != Some(&source) {
                return Err(Error::already_exists(format!(
                    "snapshot {:?} exists for another source volume",
                    req.name
                )));
            }
            return self.snapshot_info(&spec, info.size, &meta);
        }
        let src_info = self.rbd().info(&creds, &src).await?.ok_or_else(|| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        let tmp = Self::snapshot_tmp(&spec);
        if !self.group_copy_or_clear(&creds, &tmp, &req.name).await? {
            self.copy_of(&creds, &src, &tmp, None, true).await?;
            self.flatten_if_deep(&creds, &tmp).await?;
        }
        let created = now_secs().to_string();
        let meta = [
            (META_NAME, req.name.as_str()),
            (META_SOURCE, source.as_str()),
            (META_CREATED, created.as_str()),
        ];
        self.finish(&creds, &tmp, &spec, &meta, true).await?;
        let meta: BTreeMap<String, String> = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.snapshot_info(&spec, src_info.size, &meta)
    }

    async fn delete_snapshot(&self, id: &SnapshotId, secrets: &Secrets) -> Result<()> {
        let Ok(spec) = self.snapshot_spec(id) else {
            return Ok(());
        };
        let creds = self.creds(secrets)?;
        // A restore of it being deleted in the background holds it open.
        self.rbd().settle(&spec).await;
        let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? else {
            // The temporary group a group snapshot cut short left, named
            // after its first member's snapshot (only the librbd client
            // makes them).
            if self.client() == "librbd" {
                let group = format!("fvg-{}", spec.image.trim_start_matches("fvs-"));
                match self.rbd().group_remove(&creds, &spec, &group).await {
                    Ok(()) => {
                        tracing::warn!(group = %group, "removed the rbd group a group snapshot cut short left")
                    }
                    Err(e) if e.kind == Kind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            // A group's copy whose snapshot was never finished goes too.
            let tmp = Self::snapshot_tmp(&spec);
            if self.rbd().info(&creds, &tmp).await?.is_some()
                && self
                    .rbd()
                    .meta(&creds, &tmp)
                    .await?
                    .contains_key(META_GROUP_CUT)
            {
                self.remove(&creds, &tmp, None).await?;
            }
            self.purge_trash(&creds, &spec).await;
            return Ok(());
        };
        // The cut kept on its source goes first (to the snapshot trash
        // while this image is its clone): a retry finds it gone.
        if let Some(src) = meta
            .get(META_SOURCE)
            .and_then(|s| VolumeId::parse(s).ok())
            .and_then(|v| self.volume_spec(&v).ok())
        {
            match self
                .rbd()
                .snap_remove(&creds, &src, &Self::snapshot_cut(&spec))
                .await
            {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        // Its `base` snapshot goes next (format 2: to the snapshot trash
        // while restored volumes still need it).
        match self.rbd().snap_remove(&creds, &spec, BASE).await {
            Ok(_) => {}
            Err(e) if e.kind == Kind::NotFound => {}
            Err(e) => return Err(e),
        }
        let parent = info.parent.as_ref().map(|p| p.image_spec());
        self.remove(&creds, &spec, parent.as_ref()).await
    }

    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        let Ok(spec) = self.snapshot_spec(id) else {
            return Ok(None);
        };
        let creds = self.creds(secrets)?;
        let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Ok(None);
        };
        if !meta.contains_key(META_NAME) {
            return Ok(None);
        }
        Ok(Some(self.snapshot_info(&spec, info.size, &meta)?))
    }

    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        let creds = self.creds(&Secrets::default())?;
        let mut out = Vec::new();
        for (locator, spec) in self.images(&creds, "fvs-").await? {
            if !page.admits(&locator) {
                continue;
            }
            let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? else {
                continue;
            };
            if !meta.contains_key(META_NAME) {
                continue;
            }
            let snap = self.snapshot_info(&spec, info.size, &meta)?;
            if source.is_none_or(|s| &snap.source_volume == s) {
                out.push(snap);
                if out.len() >= page.limit {
                    break;
                }
            }
        }
        Ok(out)
    }
}

#[async_trait::async_trait]
impl GroupCutter for RbdBackend {
    async fn cut_group(&self, members: &[CreateSnapshot]) -> Result<()> {
        let Some(first) = members.first() else {
            return Ok(());
        };
        let creds = self.creds(&first.secrets)?;
        let cuts = members
            .iter()
            .map(|m| self.member_cut(m))
            .collect::<Result<Vec<_>>>()?;
        let mut in_use = false;
        for (src, _) in &cuts {
            in_use |= !self.rbd().watchers(&creds, src).await?.is_empty();
        }
        // A cut an earlier try made before the driver died holds another
        // instant: it goes (each cut is named after this group's member,
        // and no snapshot image is its clone yet: the group's retry
        // deleted the member snapshots first).
        for (src, snap) in &cuts {
            match self.rbd().snap_remove(&creds, src, snap).await {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        if !in_use {
            // Nothing writes: every member's lock held while each is
            // snapshotted, and each member's snapshot a clone of its cut.
            return self.rbd().snap_together(&creds, &cuts).await;
        }
        // Mapped members: a kernel client refused a lock that
        // `snap_together` holds fails its writes, while one an rbd group's
        // snapshot takes makes it wait. Each member is copied from the
        // group's cut into its temporary image, which `create_snapshot`
        // then finishes.
        // A temporary group that a try the driver died in left holding a
        // member: groups live only while a cut is copied, and this call
        // holds every member's lock, so it is a leftover; it goes, or the
        // member could not join this group.
        for (src, _) in &cuts {
            if let Some(group) = self.rbd().leftover_group(&creds, src).await? {
                tracing::warn!(image = %src.arg(), group = %group, "removing the rbd group a group snapshot cut short left");
                self.rbd().group_remove(&creds, src, &group).await?;
            }
        }
        let mut pairs = Vec::new();
        for (m, (src, _)) in members.iter().zip(&cuts) {
            let tmp = Self::snapshot_tmp(&Self::snapshot_image(src, m));
            self.clear_tmp(&creds, &tmp, &m.name).await?;
            pairs.push((src.clone(), tmp));
        }
        // Named after the first member's snapshot, this group's own.
        let first_image = Self::snapshot_image(&pairs[0].0, first).image;
        let group = pairs[0]
            .0
            .with_image(&format!("fvg-{}", first_image.trim_start_matches("fvs-")));
        self.rbd().copy_together(&creds, &group, &pairs).await?;
        for (m, (_, tmp)) in members.iter().zip(&pairs) {
            self.rbd().set_meta(&creds, tmp, META_NAME, &m.name).await?;
            self.rbd()
                .set_meta(&creds, tmp, META_GROUP_CUT, &m.name)
                .await?;
        }
        Ok(())
    }

    async fn uncut_group(&self, members: &[CreateSnapshot]) -> Result<()> {
        let Some(first) = members.first() else {
            return Ok(());
        };
        let creds = self.creds(&first.secrets)?;
        for m in members {
            let (src, snap) = self.member_cut(m)?;
            match self.rbd().snap_remove(&creds, &src, &snap).await {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) => return Err(e),
            }
            let tmp = Self::snapshot_tmp(&Self::snapshot_image(&src, m));
            self.clear_tmp(&creds, &tmp, &m.name).await?;
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl BlockTracker for RbdBackend {
    /// The snapshot image's extents holding data, its source's included
    /// (it is a clone of its cut), exact.
    async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        let creds = self.creds(secrets)?;
        let (spec, capacity, _) = self.snapshot_meta(&creds, snapshot).await?;
        let (ranges, next) = self
            .rbd()
            .diff(&creds, &spec, None, None, start, max)
            .await?;
        Ok(BlockPage {
            fixed: None,
            capacity,
            ranges,
            next,
        })
    }

    /// The extents that changed on the source between the two snapshots'
    /// cuts, exact.
    async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        let creds = self.creds(secrets)?;
        let (base_spec, _, base_meta) = self.snapshot_meta(&creds, base).await?;
        let (target_spec, capacity, target_meta) = self.snapshot_meta(&creds, target).await?;
        let (from, to) = (base_meta.get(META_SOURCE), target_meta.get(META_SOURCE));
        if from != to {
            return Err(Error::invalid(format!(
                "snapshots {base} and {target} are of different volumes"
            )));
        }
        let created =
            |m: &BTreeMap<String, String>| m.get(META_CREATED).and_then(|c| c.parse::<u64>().ok());
        if created(&base_meta) > created(&target_meta) {
            return Err(Error::invalid(format!(
                "base snapshot {base} is newer than target snapshot {target}"
            )));
        }
        let src = to
            .and_then(|s| VolumeId::parse(s).ok())
            .and_then(|v| self.volume_spec(&v).ok())
            .ok_or_else(|| Error::internal(format!("snapshot {target} names no source volume")))?;
        let (from_cut, to_cut) = (
            Self::snapshot_cut(&base_spec),
            Self::snapshot_cut(&target_spec),
        );
        let kept = self.rbd().snaps(&creds, &src).await.map_err(|e| {
            if e.kind == Kind::NotFound {
                Error::precondition(format!(
                    "the source volume of snapshots {base} and {target} is deleted: \
                     the points they were cut at went with it"
                ))
            } else {
                e
            }
        })?;
        for (id, cut) in [(base, &from_cut), (target, &to_cut)] {
            if !kept.contains(cut) {
                return Err(Error::precondition(format!(
                    "snapshot {id} keeps no cut on its source volume (a group snapshot \
                     taken while the volume was in use is a full copy): no changes to read"
                )));
            }
        }
        let (ranges, next) = self
            .rbd()
            .diff(&creds, &src, Some(&to_cut), Some(&from_cut), start, max)
            .await?;
        Ok(BlockPage {
            fixed: None,
            capacity,
            ranges,
            next,
        })
    }
}

impl RbdBackend {
    /// The image a snapshot of `src` is kept as.
    pub(super) fn snapshot_image(src: &Spec, req: &CreateSnapshot) -> Spec {
        src.with_image(&format!("fvs-{}", locator_for_name(&req.name)))
    }

    /// A group member's cut: its source image and the snapshot of it that
    /// `create_snapshot` copies from.
    pub(super) fn member_cut(&self, req: &CreateSnapshot) -> Result<(Spec, String)> {
        let src = self.volume_spec(&req.source).map_err(|_| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        let tmp = Self::snapshot_tmp(&Self::snapshot_image(&src, req));
        Ok((src, cut_name(&tmp)))
    }

    /// Where a snapshot image is made before it is renamed into place.
    pub(super) fn snapshot_tmp(spec: &Spec) -> Spec {
        spec.with_image(&format!("tmp-{}", spec.image))
    }

    /// How many parents the image has.
    pub(super) async fn depth(&self, creds: &Creds, spec: &Spec) -> Result<u32> {
        let mut depth = 0;
        let mut cur = self.rbd().info(creds, spec).await?;
        while let Some(parent) = cur.and_then(|i| i.parent) {
            depth += 1;
            if depth > 64 {
                break;
            }
            cur = self
                .rbd()
                .info(
                    creds,
                    &Spec {
                        pool: parent.pool,
                        namespace: parent.pool_namespace,
                        image: parent.image,
                    },
                )
                .await?;
        }
        Ok(depth)
    }

    pub(super) async fn flatten_if_deep(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        if self.depth(creds, spec).await? > self.settings.max_clone_depth {
            self.rbd().flatten(creds, spec).await?;
        }
        Ok(())
    }

    /// Clones `from` (an image's snapshot `snap`) into `to`.
    pub(super) async fn clone_from(
        &self,
        creds: &Creds,
        from: &Spec,
        snap: &str,
        to: &Spec,
        params: Option<&Params>,
    ) -> Result<()> {
        let layout = params.map(|p| Layout {
            features: &p.features,
            data_pool: &p.data_pool,
        });
        self.rbd().clone_image(creds, from, snap, to, layout).await
    }

    /// A point-in-time clone of image `from` as `to`: a snapshot of `from`
    /// (its cut) and a clone of it. A volume's clone removes the cut again
    /// (format 2 clones keep what they need); a snapshot's keeps it on its
    /// source, where the changes between two snapshots are read.
    pub(super) async fn copy_of(
        &self,
        creds: &Creds,
        from: &Spec,
        to: &Spec,
        params: Option<&Params>,
        keep_cut: bool,
    ) -> Result<()> {
        let snap = cut_name(to);
        match self.rbd().snap_create(creds, from, &snap).await {
            Ok(_) => {}
            Err(e) if e.kind == Kind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let cloned = self.clone_from(creds, from, &snap, to, params).await;
        if keep_cut && cloned.is_ok() {
            return Ok(());
        }
        let removed = self.rbd().snap_remove(creds, from, &snap).await;
        cloned?;
        removed
    }

    /// The cut snapshot image `spec` was cloned from, kept on its source.
    pub(super) fn snapshot_cut(spec: &Spec) -> String {
        cut_name(&Self::snapshot_tmp(spec))
    }

    /// Removes the cuts of this volume's snapshots kept on it (before the
    /// volume goes: its snapshots, clones of them, then keep them in the
    /// trash namespace while they need them).
    pub(super) async fn remove_cuts(
        &self,
        creds: &Creds,
        spec: &Spec,
        snaps: &[String],
    ) -> Result<()> {
        let prefix = Self::snapshot_cut(&spec.with_image("fvs-"));
        for snap in snaps {
            if snap.starts_with(&prefix) {
                match self.rbd().snap_remove(creds, spec, snap).await {
                    Ok(()) => {}
                    Err(e) if e.kind == Kind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// A snapshot image's metadata and size; NOT_FOUND when it is not one.
    pub(super) async fn snapshot_meta(
        &self,
        creds: &Creds,
        id: &SnapshotId,
    ) -> Result<(Spec, u64, BTreeMap<String, String>)> {
        let gone = || Error::no_snapshot(id);
        let spec = self.snapshot_spec(id).map_err(|_| gone())?;
        match self.rbd().describe(creds, &spec).await? {
            Some((info, meta)) if meta.contains_key(META_NAME) => Ok((spec, info.size, meta)),
            _ => Err(gone()),
        }
    }

    pub(super) fn snapshot_info(
        &self,
        spec: &Spec,
        size: u64,
        meta: &BTreeMap<String, String>,
    ) -> Result<SnapshotInfo> {
        let source = meta
            .get(META_SOURCE)
            .and_then(|s| VolumeId::parse(s).ok())
            .ok_or_else(|| {
                Error::internal(format!("snapshot image {} has no source", spec.arg()))
            })?;
        let created = meta
            .get(META_CREATED)
            .and_then(|s| s.parse::<u64>().ok())
            .map(|s| UNIX_EPOCH + Duration::from_secs(s))
            .unwrap_or(UNIX_EPOCH);
        Ok(SnapshotInfo {
            id: SnapshotId::new(&self.name, &self.locator(spec)?)?,
            source_volume: source,
            size_bytes: size,
            created,
            ready: true,
            group: None,
        })
    }

    /// Keeps `tmp` when it is the copy a group's cut made for snapshot
    /// `name` (true), else clears it as [`Self::clear_tmp`] does.
    pub(super) async fn group_copy_or_clear(
        &self,
        creds: &Creds,
        tmp: &Spec,
        name: &str,
    ) -> Result<bool> {
        if self.rbd().info(creds, tmp).await?.is_none() {
            return Ok(false);
        }
        let meta = self.rbd().meta(creds, tmp).await.unwrap_or_default();
        if meta.get(META_GROUP_CUT).map(String::as_str) == Some(name) {
            return Ok(true);
        }
        self.clear_found_tmp(creds, tmp, name, &meta).await?;
        Ok(false)
    }
}
