//! The `rbd` backend's volumes: making, deleting, looking up, listing,
//! growing and changing them (the controller's side).

use super::*;

#[async_trait::async_trait]
impl Provisioner for RbdBackend {
    fn clones(&self) -> bool {
        true
    }

    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        let p = self.params(&req.parameters)?;
        let spec = Spec {
            pool: p.pool.clone(),
            namespace: p.namespace.clone(),
            image: format!("fv-{}", locator_for_name(&req.name)),
        };
        VolumeId::new(&self.name, &self.locator(&spec)?)
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let p = self.params(&req.parameters)?;
        let creds = self.creds(&req.secrets)?;
        let spec = Spec {
            pool: p.pool.clone(),
            namespace: p.namespace.clone(),
            image: format!("fv-{}", locator_for_name(&req.name)),
        };
        let in_place = self.rbd().makes_in_place();
        if in_place && req.source.is_none() {
            // A new empty volume, the usual call: made in one go, unless
            // an image of its name is there (below says whose it is).
            let size = Self::size_rules().new_volume(req.required_bytes, req.limit_bytes, 0)?;
            let layout = Layout {
                features: &p.features,
                data_pool: &p.data_pool,
            };
            let meta = [(META_NAME, req.name.as_str())];
            if self
                .rbd()
                .make_new(&creds, &spec, &req.name, size, layout, &meta)
                .await?
            {
                let meta = BTreeMap::from([(META_NAME.to_string(), req.name.clone())]);
                return self.volume_info(&spec, size, &meta, Some(&p));
            }
        }
        if let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? {
            if meta.get(META_NAME) == Some(&req.name) {
                // Made whole (its CSI name is set last), whatever a record
                // left beside it says.
                let v = self.volume_info(&spec, info.size, &meta, Some(&p))?;
                check_existing(req, info.size, v.source.as_ref())?;
                return Ok(v);
            }
            if !(in_place && self.being_made_for(&creds, &spec).await? == Some(req.name.clone())) {
                return Err(Error::already_exists(format!(
                    "image {} exists and is not volume {:?}",
                    spec.arg(),
                    req.name
                )));
            }
            // An earlier try of this call died making it: it is made
            // again (nothing has it yet: its id was never answered).
            tracing::warn!(volume = %req.name, image = %spec.arg(), "removing the image a create cut short left, to make it again");
            self.rbd().remove(&creds, &spec).await?;
        }
        // Where it is made: under its final name, its making recorded
        // first (librbd), or under a temporary name renamed when done.
        let tmp = if in_place {
            self.rbd().intend(&creds, &spec, &req.name).await?;
            spec.clone()
        } else {
            let tmp = spec.with_image(&format!("tmp-{}", spec.image));
            self.clear_tmp(&creds, &tmp, &req.name).await?;
            tmp
        };
        let source_id = req.source.as_ref().map(|s| match s {
            ContentSource::Volume(v) => v.to_string(),
            ContentSource::Snapshot(s) => s.to_string(),
        });
        let source_size = match &req.source {
            None => 0,
            Some(source) => self.copy_source(&creds, source, &tmp, &p).await?,
        };
        let size =
            match Self::size_rules().new_volume(req.required_bytes, req.limit_bytes, source_size) {
                Ok(s) => s,
                Err(e) => {
                    if source_size > 0 {
                        let _ = self.rbd().remove(&creds, &tmp).await;
                    }
                    if in_place {
                        let _ = self.rbd().unintend(&creds, &spec).await;
                    }
                    return Err(e);
                }
            };
        if req.source.is_none() {
            let layout = Layout {
                features: &p.features,
                data_pool: &p.data_pool,
            };
            self.rbd().create(&creds, &tmp, size, layout).await?;
        } else {
            self.flatten_if_deep(&creds, &tmp).await?;
            if size > source_size {
                self.rbd().resize(&creds, &tmp, size).await?;
            }
        }
        let mut meta = vec![(META_NAME, req.name.as_str())];
        if let Some(s) = &source_id {
            meta.push((META_SOURCE, s.as_str()));
            meta.push((META_FS_COPY, "1"));
        }
        crate::killpoint::hit(KillPoint::Made);
        self.finish(&creds, &tmp, &spec, &meta, req.source.is_some())
            .await?;
        let meta: BTreeMap<String, String> = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.volume_info(&spec, size, &meta, Some(&p))
    }

    async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()> {
        let Ok(spec) = self.volume_spec(id) else {
            return Ok(());
        };
        let creds = self.creds(secrets)?;
        // A clone of it being deleted in the background holds it open (a
        // watch of the driver's own, not a node's).
        self.rbd().settle(&spec).await;
        let Some(image) = self.rbd().inspect(&creds, &spec).await? else {
            // A create the driver died in may have left its temporary
            // image (the CLI client's, or an earlier version's).
            let tmp = spec.with_image(&format!("tmp-{}", spec.image));
            if self.rbd().info(&creds, &tmp).await?.is_some() {
                tracing::warn!(volume = %id, "removing the temporary image a create cut short left");
                self.rbd().remove(&creds, &tmp).await?;
            }
            self.purge_trash(&creds, &spec).await;
            // A record of its making that a driver killed before removing
            // it left (after the answer, or with the image in the trash at
            // `rbd.trashed`): with the image gone it says nothing, and
            // nothing else would ever remove it.
            return self.rbd().unintend(&creds, &spec).await;
        };
        let recorded = if self.rbd().makes_in_place() {
            self.being_made_for(&creds, &spec).await?
        } else {
            None
        };
        if recorded.is_some() && recorded.as_ref() != image.meta.get(META_NAME) {
            // Half made by a create the driver died in (ours: recorded
            // before it was made), and never named.
            self.rbd().remove(&creds, &spec).await?;
            return self.rbd().unintend(&creds, &spec).await;
        }
        if !image.meta.contains_key(META_NAME) {
            return Err(Error::not_ours(
                format_args!("image {} (no ferrovol name in its metadata)", spec.arg()),
                "not deleting it",
            ));
        }
        if !image.watchers.is_empty() {
            let at: Vec<&str> = image.watchers.iter().map(String::as_str).collect();
            return Err(Error::in_use(
                format_args!("volume {id}"),
                format_args!("mapped by {}", at.join(", ")),
                "unstage it on those nodes first",
            ));
        }
        // A group snapshot the driver died making can leave its temporary
        // group holding the image (and a snapshot of it): it goes first.
        if let Some(group) = &image.group {
            tracing::warn!(volume = %id, group = %group, "removing the rbd group a group snapshot cut short left");
            self.rbd().group_remove(&creds, &spec, group).await?;
        }
        self.remove_cuts(&creds, &spec, &image.snaps).await?;
        let parent = image.info.parent.as_ref().map(|p| p.image_spec());
        self.remove(&creds, &spec, parent.as_ref()).await?;
        if recorded.is_some() {
            // A whole volume's record a driver that died left.
            self.rbd().unintend(&creds, &spec).await?;
        }
        Ok(())
    }

    async fn get_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        let Ok(spec) = self.volume_spec(id) else {
            return Ok(None);
        };
        let creds = self.creds(secrets)?;
        let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Ok(None);
        };
        if !meta.contains_key(META_NAME) {
            return Ok(None);
        }
        Ok(Some(self.volume_info(&spec, info.size, &meta, None)?))
    }

    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        let creds = self.creds(&Secrets::default())?;
        let mut all = self.images(&creds, "fv-").await?;
        if self.rbd().makes_in_place() {
            // Volumes still being made (or half made by a driver that
            // died) are not listed: recorded, and not yet named as the
            // record says.
            let mut unnamed = Vec::new();
            for place in self.places(&creds).await? {
                for (image, name) in self.rbd().intended(&creds, &place).await? {
                    let spec = place.with_image(&image);
                    if !all.iter().any(|(_, s)| *s == spec) {
                        continue;
                    }
                    let named = match self.rbd().describe(&creds, &spec).await? {
                        Some((_, meta)) => meta.get(META_NAME) == Some(&name),
                        None => false,
                    };
                    if !named {
                        unnamed.push(spec);
                    }
                }
            }
            all.retain(|(_, spec)| !unnamed.contains(spec));
        }
        let specs: Vec<Spec> = all
            .into_iter()
            .filter(|(l, _)| page.admits(l))
            .take(page.limit)
            .map(|(_, spec)| spec)
            .collect();
        let sizes = self.rbd().sizes(&creds, &specs).await?;
        specs
            .iter()
            .zip(sizes)
            // Gone since the listing: not listed.
            .filter_map(|(spec, size)| Some((spec, size?)))
            .map(|(spec, size)| self.volume_info(spec, size, &BTreeMap::new(), None))
            .collect()
    }

    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        // GetCapacity carries no secrets: only the config's own user can ask.
        if self.settings.user.is_none() {
            return Err(Error::precondition(format!(
                "backend {}: GetCapacity carries no secrets; set user and keyring in the backend's config to report capacity",
                self.name
            )));
        }
        let p = self.params(parameters)?;
        let creds = self.creds(&Secrets::default())?;
        let pool = if p.data_pool.is_empty() {
            &p.pool
        } else {
            &p.data_pool
        };
        let free = self.rbd().pool_available(&creds, pool).await?;
        Ok(Capacity {
            // Images are made in whole MiB.
            available_bytes: free - free % MIB,
            maximum_volume_bytes: None,
            minimum_volume_bytes: None,
        })
    }
}

#[async_trait::async_trait]
impl Expander for RbdBackend {
    fn online(&self) -> bool {
        true
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        secrets: &Secrets,
    ) -> Result<u64> {
        let spec = self.volume_spec(id)?;
        let creds = self.creds(secrets)?;
        let info = self
            .rbd()
            .info(&creds, &spec)
            .await?
            .ok_or_else(|| Error::no_volume(id))?;
        match Self::size_rules().expansion(info.size, required, limit)? {
            None => Ok(info.size),
            Some(size) => {
                self.rbd().resize(&creds, &spec, size).await?;
                Ok(size)
            }
        }
    }
}

#[async_trait::async_trait]
impl Modifier for RbdBackend {
    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        qos_changes(changes).map(|_| ())
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        secrets: &Secrets,
    ) -> Result<()> {
        let wanted = qos_changes(changes)?;
        let (spec, creds, meta) = self.volume_meta(id, secrets).await?;
        // The image's config overrides are its record: what differs is
        // changed, and a failure puts back what was changed before it.
        let mut done: Vec<(&str, Option<&String>)> = Vec::new();
        for (option, value) in &wanted {
            let key = format!("conf_{option}");
            let old = meta.get(&key);
            let now = old.map(String::as_str).unwrap_or("0");
            if now == value {
                continue;
            }
            let applied = match value.as_str() {
                "0" => self.rbd().remove_meta(&creds, &spec, &key).await,
                v => self.rbd().set_meta(&creds, &spec, &key, v).await,
            };
            if let Err(e) = applied {
                for (option, old) in done.into_iter().rev() {
                    let key = format!("conf_{option}");
                    let _ = match old {
                        Some(v) => self.rbd().set_meta(&creds, &spec, &key, v).await,
                        None => self.rbd().remove_meta(&creds, &spec, &key).await,
                    };
                }
                return Err(e);
            }
            done.push((option, old));
        }
        Ok(())
    }
}

impl RbdBackend {
    /// A volume's image, the credentials it was read with and its
    /// metadata; NOT_FOUND when there is no such volume of ours.
    async fn volume_meta(
        &self,
        id: &VolumeId,
        secrets: &Secrets,
    ) -> Result<(Spec, Creds, BTreeMap<String, String>)> {
        let gone = || Error::no_volume(id);
        let spec = self.volume_spec(id).map_err(|_| gone())?;
        let creds = self.creds(secrets)?;
        match self.rbd().describe(&creds, &spec).await? {
            Some((_, meta)) if meta.contains_key(META_NAME) => Ok((spec, creds, meta)),
            _ => Err(gone()),
        }
    }
}

/// The image metadata key the changes to its I/O limits are kept under (a
/// JSON object: each key changed, its value or null for none).
const META_LIMITS: &str = "ferrovol.limits";

#[async_trait::async_trait]
impl crate::plugin::LimitKeeper for RbdBackend {
    async fn kept_limits(
        &self,
        id: &VolumeId,
        secrets: &Secrets,
    ) -> Result<crate::host::iolimit::LimitChanges> {
        let (_, _, meta) = self.volume_meta(id, secrets).await?;
        match meta.get(META_LIMITS) {
            None => Ok(Default::default()),
            Some(text) => serde_json::from_str(text).map_err(|e| {
                Error::internal(format!(
                    "volume {id} has I/O limit changes that do not parse ({META_LIMITS}): {e}"
                ))
            }),
        }
    }

    async fn keep_limits(
        &self,
        id: &VolumeId,
        changes: &crate::host::iolimit::LimitChanges,
        secrets: &Secrets,
    ) -> Result<()> {
        let spec = self.volume_spec(id).map_err(|_| Error::no_volume(id))?;
        let creds = self.creds(secrets)?;
        let text = serde_json::to_string(changes)
            .map_err(|e| Error::internal(format!("encode I/O limit changes: {e}")))?;
        self.rbd().set_meta(&creds, &spec, META_LIMITS, &text).await
    }
}
