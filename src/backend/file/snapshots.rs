//! The `file` backend's snapshots: taking, deleting, listing them, groups
//! frozen together, and their changed blocks.

use super::*;

#[async_trait::async_trait]
impl Snapshotter for FileBackend {
    /// The node freezes a staged volume's filesystem around the copy.
    fn instant(&self) -> SnapshotInstant {
        SnapshotInstant::Frozen
    }

    /// Frozen together on the node.
    fn groups(&self) -> Groups<'_> {
        Groups::Frozen
    }

    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        let (source, name) = (&req.source, req.name.as_str());
        let locator = locator_for_name(name);
        if let Some(meta) = self.load_snapshot(&locator)? {
            if meta.name != name || &meta.source_volume != source {
                return Err(Error::already_exists(format!(
                    "snapshot {name:?} exists for another source volume ({})",
                    meta.source_volume
                )));
            }
            return self.snapshot_info(&locator, meta);
        }
        let (_, size) = self
            .load_volume(own_source(
                &self.name,
                &ContentSource::Volume(source.clone()),
            )?)?
            .ok_or_else(|| Error::not_found(format!("source volume {source} does not exist")))?;
        let tmp = self.snapshots.join(format!(".{locator}.img.tmp"));
        let made = async {
            self.copy_image(&self.image(source.locator()), &tmp).await?;
            let created = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            let meta = SnapshotMeta {
                name: name.to_string(),
                source_volume: source.clone(),
                size_bytes: size,
                created_unix_nanos: created,
            };
            write_json(&self.snap_meta(&locator), &meta).await?;
            std::fs::rename(&tmp, self.snap_image(&locator))
                .map_err(io("move snapshot into place"))?;
            Ok::<_, Error>(meta)
        }
        .await;
        match made {
            Ok(meta) => {
                index_put(&self.index.snapshots, &locator);
                self.snapshot_info(&locator, meta)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                let _ = std::fs::remove_file(self.snap_meta(&locator));
                // Out of space is judged by the pool, not by cp's words:
                // less room than the source's blocks take (its copy's
                // need) is RESOURCE_EXHAUSTED.
                use std::os::unix::fs::MetadataExt;
                let need = std::fs::metadata(self.image(source.locator()))
                    .map(|m| m.blocks() * 512)
                    .unwrap_or(0);
                match self.free_bytes() {
                    Ok(free) if e.kind != Kind::ResourceExhausted && free < need => {
                        Err(Error::no_room(
                            format_args!("pool {}", self.settings.pool.display()),
                            free,
                            format_args!("{need} for the copy ({})", e.message),
                        ))
                    }
                    _ => Err(e),
                }
            }
        }
    }

    async fn delete_snapshot(&self, id: &SnapshotId, _secrets: &Secrets) -> Result<()> {
        self.own(id.backend())?;
        remove_if_exists(&self.snap_image(id.locator()))?;
        remove_if_exists(&self.snap_meta(id.locator()))?;
        index_remove(&self.index.snapshots, id.locator());
        Ok(())
    }

    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        _secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        self.own(id.backend())?;
        match self.load_snapshot(id.locator())? {
            Some(meta) => Ok(Some(self.snapshot_info(id.locator(), meta)?)),
            None => Ok(None),
        }
    }

    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        let mut out = Vec::new();
        let mut cursor = page.clone();
        // With a source, pages of the index are read until enough of its
        // snapshots are found: the source is in each snapshot's metadata.
        while out.len() < page.limit {
            cursor.limit = (page.limit - out.len()).clamp(1, 1024);
            let batch = page_of(&self.index.snapshots, &cursor);
            let Some(last) = batch.last().cloned() else {
                break;
            };
            for l in batch {
                if let Some(meta) = self.load_snapshot(&l)? {
                    if source.is_none_or(|s| &meta.source_volume == s) && out.len() < page.limit {
                        out.push(self.snapshot_info(&l, meta)?);
                    }
                }
            }
            cursor.after = Some(last);
        }
        Ok(out)
    }
}

#[async_trait::async_trait]
impl BlockTracker for FileBackend {
    async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        _secrets: &Secrets,
    ) -> Result<BlockPage> {
        let (image, meta) = self.snapshot_image(snapshot)?;
        let capacity = meta.size_bytes;
        let (extents, next) = if start < capacity {
            crate::host::off_worker("reading a snapshot's extents", COPY_TIMEOUT, move || {
                let f = std::fs::File::open(&image).map_err(io("open the snapshot"))?;
                crate::host::extents::data_extents(&f, start, capacity, max)
                    .map_err(io("read the snapshot's extents"))
            })
            .await?
        } else {
            (Vec::new(), None)
        };
        Ok(BlockPage {
            fixed: None,
            capacity,
            ranges: extents.iter().map(|e| (e.offset, e.len)).collect(),
            next,
        })
    }

    async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        _secrets: &Secrets,
    ) -> Result<BlockPage> {
        let (base_image, base_meta) = self.snapshot_image(base)?;
        let (target_image, target_meta) = self.snapshot_image(target)?;
        if base_meta.source_volume != target_meta.source_volume {
            return Err(Error::invalid(format!(
                "snapshots {base} and {target} are of different volumes ({} and {})",
                base_meta.source_volume, target_meta.source_volume
            )));
        }
        let capacity = target_meta.size_bytes;
        let (extents, next) = if start < capacity {
            crate::host::off_worker("comparing two snapshots", COPY_TIMEOUT, move || {
                let a = std::fs::File::open(&base_image).map_err(io("open the base snapshot"))?;
                let b =
                    std::fs::File::open(&target_image).map_err(io("open the target snapshot"))?;
                // Both in the pool's snapshots folder: one filesystem.
                crate::host::extents::differing(&a, &b, true, start, capacity, CBT_BLOCK, max)
                    .map_err(io("compare the snapshots"))
            })
            .await?
        } else {
            (Vec::new(), None)
        };
        Ok(BlockPage {
            fixed: None,
            capacity,
            ranges: extents.iter().map(|e| (e.offset, e.len)).collect(),
            next,
        })
    }
}
