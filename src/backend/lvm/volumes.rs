//! The `lvm` backend's volumes: making, deleting, looking up, listing,
//! growing and changing them (the controller's side).

use super::*;

#[async_trait::async_trait]
impl Provisioner for LvmBackend {
    fn clones(&self) -> bool {
        true
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let class = self.class_for(&req.parameters)?.clone();
        let lv_name = format!("fv-{}", locator_for_name(&req.name));
        // A new empty thick volume needs only the group's extent size
        // before lvcreate (a thin one needs its pool read every time: that
        // it zeroes new chunks is checked before each create).
        if req.source.is_none() && class.thin_pool.is_none() {
            return self.create_thick_straight(&class, req, &lv_name).await;
        }
        let (source, source_size) = self.create_source(&class, req).await?;
        // A copy the driver died making is finished by this retry (it is
        // this request's when it carries this name in this class, made from
        // this source); any other LV of this name is judged as it is.
        let sight = self.sight(&class, &lv_name).await?;
        let existing = sight.existing;
        let unfinished = |lv: &Lv| {
            source.as_ref().is_some_and(|src| {
                lv.has_tag(FILLING_TAG)
                    && lv.has_tag(&name_tag(&req.name))
                    && lv.has_tag(&format!("{SOURCE_TAG}{}", src.lv_name))
                    && self.owner(lv).is_some_and(|c| c.name == class.name)
            })
        };
        if let Some(existing) = existing.as_ref().filter(|lv| !unfinished(lv)) {
            return self.existing_volume(&class, req, existing);
        }
        let vg = match sight.vg {
            Some(vg) => vg,
            None => self.vg(&class).await?,
        };
        let size = Self::size_rules(&class, vg.extent()).new_volume(
            req.required_bytes,
            req.limit_bytes,
            source_size,
        )?;
        let new = new_lv(&class, req, &lv_name, size, source.as_ref());
        if let (Some(_), Some(src)) = (&existing, &source) {
            tracing::warn!(lv = %new.target, "finishing a copy whose making was cut short");
            self.fill(&class, &new, src).await?;
            let lv = self
                .lv(&class.volume_group, &new.name)
                .await?
                .ok_or_else(|| Error::internal(format!("LV {} vanished", new.target)))?;
            return self.existing_volume(&class, req, &lv);
        }
        match (&class.thin_pool, &source) {
            (Some(_), Some(src)) => self.create_thin_copy(&class, &new, src).await?,
            (Some(pool), None) => {
                self.create_thin(&class, &new, pool, sight.pool.as_ref())
                    .await?
            }
            (None, src) => self.create_thick(&class, &new, &vg, src.as_ref()).await?,
        }
        if source.is_none() {
            // lvcreate made what it was asked: the size (whole extents
            // already) and the tags; nothing to read back.
            return self.made_info(&class, &new);
        }
        let lv = self
            .lv(&class.volume_group, &new.name)
            .await?
            .ok_or_else(|| Error::internal(format!("LV {} vanished after lvcreate", new.target)))?;
        self.volume_info(&class, &lv)
    }

    async fn delete_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<()> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(());
        };
        let all = self.lvs(&class.volume_group).await?;
        let Some(lv) = all.iter().find(|l| {
            l.lv_name == lv_name
                && l.has_tag(TAG)
                && self.owner(l).is_some_and(|c| c.name == class.name)
        }) else {
            return Ok(());
        };
        if lv.open() {
            return Err(Error::in_use(
                format_args!("volume {id}"),
                "open on this node",
                "unstage it first",
            ));
        }
        // Classic (COW) snapshots die with their origin: refuse rather than
        // take them along. Thin snapshots are independent.
        if let Some(snap) = all
            .iter()
            .find(|l| l.origin == lv_name && l.lv_attr.starts_with('s'))
        {
            return Err(Error::precondition(format!(
                "volume {id} has snapshot {} that depends on it; delete the snapshot first",
                snap.lv_name
            )));
        }
        if lv.pool_lv.is_empty() && class.zero_on_delete {
            // A thick LV's extents go back to the volume group and the next
            // LV gets them as they are: zero them first, so no tenant ever
            // reads another's data. Thin pools zero new chunks themselves.
            self.zero_extents(class, lv, &format!("volume {id}"))
                .await?;
        }
        self.remove_lv(class, lv_name).await
    }

    async fn get_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(None);
        };
        if !lv_name.starts_with("fv-") {
            return Ok(None);
        }
        match self.class_lv(class, lv_name).await? {
            Some(lv) => Ok(Some(self.volume_info(class, &lv)?)),
            None => Ok(None),
        }
    }

    /// One `lvs` per volume group for every page: lvm reports a whole
    /// group at once, and a node's LVs number in the hundreds.
    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        let mut out = Vec::new();
        for (class, lv) in self.all_lvs().await? {
            if lv.lv_name.starts_with("fv-") {
                out.push(self.volume_info(class, &lv)?);
            }
        }
        Ok(page.apply(out, |v| v.id.locator()))
    }

    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        let class = self.class_for(parameters)?;
        let vg = self.vg(class).await?;
        let (available, maximum) = match &class.thin_pool {
            Some(pool) => {
                let (size, free) = self.pool_space(class, pool).await?;
                (free, size)
            }
            None => (vg.free(), vg.free()),
        };
        let extent = vg.extent();
        Ok(Capacity {
            available_bytes: available,
            maximum_volume_bytes: Some(maximum / extent * extent),
            minimum_volume_bytes: Some(extent),
        })
    }

    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        let class = self.class_for(&req.parameters)?;
        VolumeId::new(
            &self.name,
            &format!("{}.fv-{}", class.name, locator_for_name(&req.name)),
        )
    }
}

/// LV `lv_name` about to be made for `req` in `class`, of `size`: its
/// tags say whose it is, and either that it is fresh (its start wiped at
/// the first attach) or a copy of `source` still being filled.
fn new_lv(
    class: &DeviceClass,
    req: &CreateVolume,
    lv_name: &str,
    size: u64,
    source: Option<&Lv>,
) -> NewLv {
    let mut tags = vec![
        TAG.to_string(),
        name_tag(&req.name),
        format!("{CLASS_TAG}{}", class.name),
    ];
    match source {
        Some(src) => tags.extend([
            format!("{SOURCE_TAG}{}", src.lv_name),
            COPY_TAG.into(),
            FILLING_TAG.into(),
        ]),
        None => tags.push(FRESH_TAG.into()),
    }
    NewLv {
        target: format!("{}/{lv_name}", class.volume_group),
        name: lv_name.to_string(),
        size,
        tags,
    }
}

impl LvmBackend {
    /// A new empty thick volume: one lvcreate, on the extent size of a
    /// recent read of its group ([`LvmBackend::fresh_extent`]), or after
    /// one `vgs` (whose figures also check the room first). Whether an LV
    /// of this name is there already is lvcreate's to find: when it
    /// refuses, the LV and the group are read, and the create answers
    /// this name's LV, or RESOURCE_EXHAUSTED (or OUT_OF_RANGE) from lvm's
    /// figures, or lvcreate's failure as it was; the group is read again
    /// before the next create.
    async fn create_thick_straight(
        &self,
        class: &DeviceClass,
        req: &CreateVolume,
        lv_name: &str,
    ) -> Result<VolumeInfo> {
        let whole = format!("volume group {}", class.volume_group);
        let (extent, read) = match self.fresh_extent(class) {
            Some(extent) => (extent, None),
            None => {
                let vg = self.vg(class).await?;
                self.note_facts(class, vg.extent());
                (vg.extent(), Some(vg))
            }
        };
        let size =
            Self::size_rules(class, extent).new_volume(req.required_bytes, req.limit_bytes, 0)?;
        // No room by the group's figures: no lvcreate, but the same
        // questions as after its refusal (this may be a retry of a create
        // that took the last of the room).
        let no_room = read
            .as_ref()
            .and_then(|vg| crate::error::room(size, &whole, vg.size(), vg.free()).err());
        let new = new_lv(class, req, lv_name, size, None);
        let made = match no_room {
            Some(e) => Err(e),
            None => self
                .runner
                .run(self.thick_lvcreate(class, &new))
                .await
                .map_err(Error::from),
        };
        let Err(e) = made else {
            // lvcreate made what it was asked: the size (whole extents
            // already) and the tags; nothing to read back.
            return self.made_info(class, &new);
        };
        self.forget_facts(class);
        let sight = self.sight(class, lv_name).await?;
        if let Some(existing) = &sight.existing {
            return self.existing_volume(class, req, existing);
        }
        let vg = match sight.vg {
            Some(vg) => vg,
            None => self.vg(class).await?,
        };
        crate::error::room(size, &whole, vg.size(), vg.free())?;
        Err(e)
    }

    /// What CreateVolume answers for empty volume `new`, just made.
    fn made_info(&self, class: &DeviceClass, new: &NewLv) -> Result<VolumeInfo> {
        Ok(VolumeInfo {
            id: VolumeId::new(&self.name, &format!("{}.{}", class.name, new.name))?,
            capacity_bytes: new.size,
            context: BTreeMap::new(),
            source: None,
        })
    }
}

#[async_trait::async_trait]
impl Expander for LvmBackend {
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
        let (class, lv_name) = self.split(id.locator())?;
        // The LV and the group's figures in one read.
        let sight = self.sight(class, lv_name).await?;
        let lv = sight
            .existing
            .filter(|lv| self.owner(lv).is_some_and(|c| c.name == class.name))
            .ok_or_else(|| Error::no_volume(id))?;
        let vg = match sight.vg {
            Some(vg) => vg,
            None => self.vg(class).await?,
        };
        let Some(wanted) =
            Self::size_rules(class, vg.extent()).expansion(lv.size(), required, limit)?
        else {
            return Ok(lv.size());
        };
        // LVM grows the origin of classic snapshots only while it is
        // inactive (lvextend refuses, and the resizer would retry it as an
        // internal error for ever).
        if lv.snapshot_origin() && !lv.inactive() {
            return Err(Error::precondition(format!(
                "volume {id} has snapshots, and LVM grows a thick volume that has snapshots only \
                 while it is not active, which a staged volume is: delete its snapshots and the \
                 expansion goes on at its next try; a thin device class's volumes grow with \
                 their snapshots"
            )));
        }
        // A thin volume's virtual size takes nothing from the group.
        let grow = match class.thin_pool {
            None => wanted - lv.size(),
            Some(_) => 0,
        };
        crate::error::room(
            grow,
            format_args!("volume group {}", class.volume_group),
            vg.size(),
            vg.free(),
        )
        .map_err(|e| e.context(format_args!("grow volume {id}")))?;
        self.run_judged(
            class,
            grow,
            self.lvm("lvextend").args([
                "-L",
                &format!("{wanted}b"),
                &format!("{}/{lv_name}", class.volume_group),
            ]),
        )
        .await?;
        Ok(wanted)
    }
}

#[async_trait::async_trait]
impl Modifier for LvmBackend {
    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        read_ahead_value(changes).map(|_| ())
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        _secrets: &Secrets,
    ) -> Result<()> {
        let (class, lv_name) = self.split(id.locator())?;
        if self.class_lv(class, lv_name).await?.is_none() {
            return Err(Error::no_volume(id));
        }
        let Some(want) = read_ahead_value(changes)? else {
            return Ok(());
        };
        let target = format!("{}/{lv_name}", class.volume_group);
        // LVM's metadata is the record: read it, change it only if it differs.
        if self.read_ahead(&target).await? == want {
            return Ok(());
        }
        self.runner
            .run(self.lvm("lvchange").args(["--readahead", &want, &target]))
            .await?;
        Ok(())
    }
}
