//! The `file` backend's volumes: making, deleting, looking up, listing,
//! growing and changing them (the controller's side).

use super::*;

#[async_trait::async_trait]
impl Provisioner for FileBackend {
    fn clones(&self) -> bool {
        true
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let locator = locator_for_name(&req.name);
        let (source_image, source_size) = self.create_source(req)?;

        if let Some((meta, size)) = self.load_volume(&locator)? {
            if meta.name != req.name {
                return Err(Error::already_exists(format!(
                    "volume {locator} belongs to another name; choose a different name"
                )));
            }
            check_existing(req, size, meta.source.as_ref())?;
            return self.volume_info(&locator, meta, size);
        }

        let size =
            self.size_rules()
                .new_volume(req.required_bytes, req.limit_bytes, source_size)?;
        // Images are sparse, but a volume the pool could never hold is refused
        // now rather than failing writes later.
        self.ensure_space(size)?;
        let image = self.image(&locator);
        let tmp = self.volumes.join(format!(".{locator}.img.tmp"));
        let made = async {
            self.make_image(source_image.as_deref(), &tmp, size).await?;
            let meta = VolumeMeta {
                name: req.name.clone(),
                capacity_bytes: size,
                source: req.source.clone(),
                copy_pending: req.source.is_some(),
                preallocated: false,
            };
            write_json(&self.meta(&locator), &meta).await?;
            std::fs::rename(&tmp, &image).map_err(io("move new image into place"))?;
            Ok::<_, Error>(meta)
        }
        .await;
        match made {
            Ok(meta) => {
                index_put(&self.index.volumes, &locator);
                self.volume_info(&locator, meta, size)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                let _ = std::fs::remove_file(self.meta(&locator));
                Err(e)
            }
        }
    }

    async fn delete_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<()> {
        self.own(id.backend())?;
        let image = self.image(id.locator());
        if let Some(dev) = self.loops.find(&image) {
            return Err(Error::in_use(
                format_args!("volume {id}"),
                format_args!("on this node, at {}", dev.display()),
                "unstage it first",
            ));
        }
        remove_if_exists(&image)?;
        remove_if_exists(&self.meta(id.locator()))?;
        index_remove(&self.index.volumes, id.locator());
        Ok(())
    }

    async fn get_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        self.own(id.backend())?;
        match self.load_volume(id.locator())? {
            Some((meta, size)) => Ok(Some(self.volume_info(id.locator(), meta, size)?)),
            None => Ok(None),
        }
    }

    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        let mut out = Vec::new();
        for l in page_of(&self.index.volumes, page) {
            // Gone since the index was read: a delete racing the listing.
            if let Some((meta, size)) = self.load_volume(&l)? {
                out.push(self.volume_info(&l, meta, size)?);
            }
        }
        Ok(out)
    }

    async fn capacity(&self, _parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        let free = self.free_bytes()?;
        Ok(Capacity {
            available_bytes: free,
            maximum_volume_bytes: Some(self.settings.max_volume_size.0.min(free / MIB * MIB)),
            minimum_volume_bytes: Some(MIB),
        })
    }
}

#[async_trait::async_trait]
impl Expander for FileBackend {
    fn online(&self) -> bool {
        true
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        _secrets: &Secrets,
    ) -> Result<u64> {
        self.own(id.backend())?;
        let (mut meta, size) = self
            .load_volume(id.locator())?
            .ok_or_else(|| Error::no_volume(id))?;
        let Some(wanted) = self.size_rules().expansion(size, required, limit)? else {
            return Ok(size);
        };
        self.ensure_growth(wanted - size)?;
        let image = self.image(id.locator());
        let grown = image.clone();
        crate::host::off_worker("growing the image", COPY_TIMEOUT, move || {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&grown)
                .map_err(io("open image"))?;
            f.set_len(wanted).map_err(io("grow image"))?;
            f.sync_all().map_err(io("sync image"))
        })
        .await?;
        if meta.preallocated {
            allocate(image, wanted).await?;
        }
        meta.capacity_bytes = wanted;
        write_json(&self.meta(id.locator()), &meta).await?;
        Ok(wanted)
    }
}

#[async_trait::async_trait]
impl Modifier for FileBackend {
    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        preallocate_value(changes).map(|_| ())
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        _secrets: &Secrets,
    ) -> Result<()> {
        self.own(id.backend())?;
        let (mut meta, size) = self
            .load_volume(id.locator())?
            .ok_or_else(|| Error::no_volume(id))?;
        let Some(want) = preallocate_value(changes)? else {
            return Ok(());
        };
        if want == meta.preallocated {
            return Ok(());
        }
        let image = self.image(id.locator());
        if want {
            use std::os::unix::fs::MetadataExt;
            let held = std::fs::metadata(&image)
                .map_err(io("stat image"))?
                .blocks()
                .saturating_mul(512);
            let needed = size.saturating_sub(held);
            let free = self.free_bytes()?;
            if needed > free {
                return Err(Error::invalid(format!(
                    "mutable parameter {PREALLOCATE}: volume {id} needs {needed} more bytes \
                     and pool {} has {free} free; nothing was changed",
                    self.settings.pool.display()
                )));
            }
            allocate(image, size).await?;
        }
        meta.preallocated = want;
        write_json(&self.meta(id.locator()), &meta).await
    }
}
