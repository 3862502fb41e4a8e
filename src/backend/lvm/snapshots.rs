//! The `lvm` backend's snapshots: taking, deleting, listing them, groups,
//! and changed blocks from thin pools.

use super::*;
use std::time::{SystemTime, UNIX_EPOCH};

#[async_trait::async_trait]
impl Snapshotter for LvmBackend {
    /// lvcreate suspends the origin to cut it: one instant.
    fn instant(&self) -> SnapshotInstant {
        SnapshotInstant::Own
    }

    /// Frozen together where the kernel nests freezes, else only while no
    /// member is staged.
    fn groups(&self) -> Groups<'_> {
        match self.group_snapshots {
            crate::plugin::GroupSnapshots::Unstaged => Groups::Unstaged,
            _ => Groups::Frozen,
        }
    }

    fn snapshot_id_for(&self, req: &CreateSnapshot) -> Result<SnapshotId> {
        let (class, _) = self.split(req.source.locator()).map_err(|_| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        SnapshotId::new(
            &self.name,
            &format!("{}.fvs-{}", class.name, locator_for_name(&req.name)),
        )
    }

    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        let (source, name) = (&req.source, req.name.as_str());
        let (class, src_lv) = (source.backend() == self.name)
            .then(|| self.split(source.locator()))
            .transpose()
            .ok()
            .flatten()
            .ok_or_else(|| Error::not_found(format!("source volume {source} does not exist")))?;
        let class = class.clone();
        let vg_name = class.volume_group.clone();
        let snap_name = format!("fvs-{}", locator_for_name(name));
        let tag = name_tag(name);
        let source_tag = format!("{SOURCE_TAG}{src_lv}");
        let target = format!("{vg_name}/{snap_name}");
        // One read answers a new snapshot's questions: whether it exists,
        // its source, and the group's room for its copy-on-write area.
        let (seen, mut vg) = self.look(&class, &[&snap_name, src_lv]).await?;
        let ours = |name: &str| {
            seen.iter()
                .find(|l| l.lv_name == name && l.has_tag(TAG))
                .cloned()
        };
        let source_lv =
            ours(src_lv).filter(|lv| self.owner(lv).is_some_and(|c| c.name == class.name));
        let mut existing = ours(&snap_name);
        if let Some(lv) = existing.as_ref().filter(|lv| lv.plain()) {
            // lvcreate makes a classic snapshot's copy-on-write area as a
            // plain LV (with the snapshot's tags) and only then turns it
            // into the snapshot: killed between, it leaves that LV, which
            // holds nothing. It is ours when it carries this snapshot's
            // tags; it goes, and the snapshot is made again.
            if !(lv.has_tag(&tag) && lv.has_tag(&source_tag)) {
                return Err(Error::already_exists(format!(
                    "LV {target} exists and is not snapshot {name:?}"
                )));
            }
            // lvcreate was cut short with the driver alive (its timeout).
            for what in self.settle().await? {
                tracing::warn!("{what}");
            }
            // The group's room changed with what settling removed.
            vg = None;
            existing = self.lv(&vg_name, &snap_name).await?;
            if existing.as_ref().is_some_and(|lv| lv.plain()) {
                return Err(Error::unavailable(format!(
                    "the half-made snapshot {target} is still there: retry"
                )));
            }
        }
        if let Some(existing) = existing {
            // Membership, not the first tag of a kind: a snapshot made by
            // an lvm that copies its origin's tags carries them beside its
            // own (a name tag among them).
            let same = existing.has_tag(&tag)
                && existing.has_tag(&source_tag)
                && self.owner(&existing).is_some_and(|c| c.name == class.name);
            if !same {
                return Err(Error::already_exists(format!(
                    "snapshot {name:?} exists for another source volume"
                )));
            }
            let inherited = match &source_lv {
                // Its own: what this call would give it, and the time tag
                // its first call gave it (one the source lacks).
                Some(src) => {
                    let mut own = own_tags(&tag, &class, &source_tag, src);
                    own.extend(
                        existing
                            .tags()
                            .filter(|t| t.starts_with(TIME_TAG) && !src.has_tag(t))
                            .map(str::to_string),
                    );
                    inherited_tags(src, &own, &existing)
                }
                None => Vec::new(),
            };
            if inherited.is_empty() {
                return self.snapshot_info(&class, &existing);
            }
            tracing::warn!(snapshot = %target, "the snapshot carries tags of its origin's: dropping them");
            self.drop_tags(&target, &inherited).await?;
            let lv = self
                .lv(&vg_name, &snap_name)
                .await?
                .ok_or_else(|| Error::internal(format!("snapshot {target} vanished")))?;
            return self.snapshot_info(&class, &lv);
        }
        let src = source_lv
            .ok_or_else(|| Error::not_found(format!("source volume {source} does not exist")))?;
        let mut cmd = self.lvm("lvcreate").args(["-y", "-s", "-n", &snap_name]);
        // What the snapshot takes from the group: its copy-on-write area
        // (a thin snapshot takes nothing from the group, only pool chunks).
        let mut cow = 0;
        if class.thin_pool.is_none() || src.pool_lv.is_empty() {
            let vg = match vg {
                Some(vg) => vg,
                None => self.vg(&class).await?,
            };
            cow = round_up(src.size() * class.snapshot_size_percent / 100, vg.extent());
            if cow > vg.free() {
                return Err(Error::no_room(
                    format_args!("volume group {vg_name}"),
                    vg.free(),
                    format_args!("{cow} for the snapshot"),
                ));
            }
            cmd = cmd.args(["-L", &format!("{cow}b")]);
        }
        let cut = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut tags = own_tags(&tag, &class, &source_tag, &src);
        tags.push(format!("{TIME_TAG}{cut}"));
        for t in &tags {
            cmd = cmd.args(["--addtag", t]);
        }
        // lvcreate suspends the origin while it cuts the snapshot; killed
        // part way, it can leave the origin suspended (resumed at start),
        // or a thin device id in the pool that nothing names (recorded
        // first, see `orphans`).
        let noted = self.note_thin_snapshot(&class, &src, &snap_name).await?;
        crate::killpoint::hit(KillPoint::Snapshot);
        self.run_snapshot_lvcreate(&class, cow, noted, cmd.arg(format!("{vg_name}/{src_lv}")))
            .await?;
        crate::killpoint::hit(KillPoint::SnapshotMade);
        // The snapshot carries the tags given here and none of its
        // origin's: lvcreate copies no tag onto a snapshot, classic or
        // thin (lvm 2.03.16, the image's and the guest's, checked there by
        // `guest_lvm_backend_full_lifecycle`). So what the call answers is
        // known without reading the snapshot: its tags, name and source are
        // this call's, its time its time tag. (A snapshot found carrying
        // tags of its origin's, made by an lvm that copies them, has them
        // taken off by the retry above.)
        let made = Lv {
            lv_name: snap_name,
            vg_name,
            lv_size: src.lv_size.clone(),
            lv_tags: tags.join(","),
            origin: src.lv_name.clone(),
            ..Lv::default()
        };
        self.snapshot_info(&class, &made)
    }

    async fn delete_snapshot(&self, id: &SnapshotId, _secrets: &Secrets) -> Result<()> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(());
        };
        if !lv_name.starts_with("fvs-") {
            return Ok(());
        }
        let Some(lv) = self.class_lv(class, lv_name).await? else {
            return Ok(());
        };
        // A classic snapshot's own extents hold copies of the origin's old
        // blocks: zeroed before they go back to the volume group, as a
        // thick volume's are. (A thin snapshot's chunks stay in the pool,
        // which zeroes them when it hands them out again.)
        let classic = lv.lv_attr.starts_with('s') || lv.has_tag(DELETING_TAG);
        if classic && lv.pool_lv.is_empty() && class.zero_on_delete {
            self.zero_extents(class, &lv, &format!("snapshot {id}"))
                .await?;
        }
        self.remove_lv(class, lv_name).await
    }

    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        _secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(None);
        };
        if !lv_name.starts_with("fvs-") {
            return Ok(None);
        }
        match self.class_lv(class, lv_name).await? {
            Some(lv) if !lv.has_tag(DELETING_TAG) => Ok(Some(self.snapshot_info(class, &lv)?)),
            _ => Ok(None),
        }
    }

    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        let mut out = Vec::new();
        for (class, lv) in self.all_lvs().await? {
            if lv.lv_name.starts_with("fvs-") && !lv.has_tag(DELETING_TAG) {
                let snap = self.snapshot_info(class, &lv)?;
                if source.is_none_or(|s| &snap.source_volume == s) {
                    out.push(snap);
                }
            }
        }
        Ok(page.apply(out, |s| s.id.locator()))
    }
}

#[async_trait::async_trait]
impl BlockTracker for LvmBackend {
    async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        _secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.thin_allocated(snapshot, start, max).await
    }

    async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        _secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.thin_changed(base, target, start, max).await
    }
}

/// The tags a snapshot of `src` named by `name_tag` in `class` carries as
/// its own (besides its time tag).
fn own_tags(name_tag: &str, class: &DeviceClass, source_tag: &str, src: &Lv) -> Vec<String> {
    vec![
        TAG.to_string(),
        name_tag.to_string(),
        format!("{CLASS_TAG}{}", class.name),
        source_tag.to_string(),
        format!("ferrovol-size:{}", src.size()),
    ]
}
