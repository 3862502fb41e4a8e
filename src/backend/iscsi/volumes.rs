//! The `iscsi` backend's volumes: making, deleting, looking up, listing,
//! growing and changing them (the controller's side).

use super::*;

#[async_trait::async_trait]
impl Provisioner for IscsiBackend {
    fn clones(&self) -> bool {
        self.store.clones()
    }

    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        self.store.volume_id_for(req)
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let store = self.store.get()?;
        let mut r = req.clone();
        r.source = match &req.source {
            Some(ContentSource::Volume(v)) => {
                self.own_volume(v)
                    .map_err(|_| Error::not_found(format!("source volume {v} does not exist")))?;
                Some(ContentSource::Volume(self.store.volume(v)?))
            }
            Some(ContentSource::Snapshot(s)) => {
                if s.backend() != self.name {
                    return Err(Error::not_found(format!(
                        "source snapshot {s} does not exist"
                    )));
                }
                Some(ContentSource::Snapshot(self.store.snapshot(s)?))
            }
            None => None,
        };
        let info = store.provisioning()?.create_volume(&r).await?;
        let info = self.store.volume_info(info)?;
        let id = info.id.clone();
        let _volume = self.volume_mutex(&id).lock_owned().await;
        let mut record = match self.load(&id)? {
            Some(r) => r,
            None => Record::new(self.iqn(&id)),
        };
        record.bytes.get_or_insert(info.capacity_bytes);
        self.ensure_target(&id, &mut record).await?;
        self.save(&id, &record)?;
        self.take_over_copy(&id, &mut record).await?;
        Ok(info)
    }

    async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()> {
        if id.backend() != self.name {
            return Ok(());
        }
        let store = self.store.get()?;
        let store_id = self.store.volume(id)?;
        let _volume = self.volume_mutex(id).lock_owned().await;
        let record = self.load(id)?;
        let iqn = record
            .as_ref()
            .map(|r| r.export.clone())
            .unwrap_or_else(|| self.iqn(id));
        if let Some((tid, sessions)) = self.target_sessions(&iqn).await? {
            if !sessions.is_empty() {
                return Err(Error::in_use(
                    format_args!("volume {id}"),
                    format_args!("logged in from {}", sessions.join(", ")),
                    "unstage it on those nodes first",
                ));
            }
            self.target.delete(tid).await?;
            self.tids.lock().await.by_iqn.remove(&iqn);
        }
        if let (Some(holds), Some(name)) =
            (&self.holds, record.as_ref().and_then(|r| r.hold.as_ref()))
        {
            holds.remove(name).await?;
        }
        store
            .staging()?
            .node_detach(&store_id, record.as_ref().map(|r| &r.attachment))
            .await?;
        store
            .provisioning()?
            .delete_volume(&store_id, secrets)
            .await?;
        self.forget(id)
    }

    async fn get_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        self.store.get_volume(id, secrets).await
    }

    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        self.store.list_volumes(page).await
    }

    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        self.store.capacity(parameters).await
    }
}

#[async_trait::async_trait]
impl Expander for IscsiBackend {
    /// tgt cannot grow a LUN under I/O (see Target::refresh).
    fn online(&self) -> bool {
        false
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        secrets: &Secrets,
    ) -> Result<u64> {
        self.own_volume(id)?;
        let store = self.store.get()?;
        let store_id = self.store.volume(id)?;
        let record = self
            .load(id)?
            .ok_or_else(|| Error::not_found(format!("volume {id} has no target")))?;
        // Growing the LUN reopens its store, which fails I/O in flight
        // (Target::refresh): only while no node can use it. Publish and
        // expand of one volume never overlap (the volume's guard), and the
        // ACL keeps out initiators that were not published.
        let users = self.users(&record).await?;
        if !users.is_empty() {
            // A repeat of an expansion that is done asks for nothing new.
            if let Some(bytes) = record
                .bytes
                .filter(|&b| b >= required && (limit == 0 || b <= limit))
            {
                return Ok(bytes);
            }
            return Err(Error::in_use(
                format_args!("volume {id}"),
                format_args!(
                    "logged in from {}",
                    users.into_iter().collect::<Vec<_>>().join(", ")
                ),
                "an iSCSI volume grows only while no node uses it (tgt cannot grow a LUN \
                 under I/O): it grows once none does",
            ));
        }
        let size = store
            .expanding()?
            .expand_volume(&store_id, required, limit, secrets)
            .await?;
        let _volume = self.volume_mutex(id).lock_owned().await;
        let mut record = self
            .load(id)?
            .ok_or_else(|| Error::not_found(format!("volume {id} has no target")))?;
        let tid = self.ensure_target(id, &mut record).await?;
        store
            .device_mounting()?
            .node_refresh_size(&store_id, &record.attachment)
            .await?;
        if let (Some(holds), Some(name)) = (&self.holds, &record.hold) {
            holds.resize(name, &record.device).await?;
        }
        self.target.refresh(tid, &record.served()).await?;
        record.bytes = Some(size);
        self.save(id, &record)?;
        Ok(size)
    }
}

#[async_trait::async_trait]
impl Modifier for IscsiBackend {
    fn mutable_keys(&self) -> Vec<&'static str> {
        // The LUN's own key, and the store's.
        let mut keys = vec![THIN_PROVISIONING];
        if let Some(store) = self.store.here() {
            keys.extend(
                store
                    .modifier()
                    .map(|m| m.mutable_keys())
                    .unwrap_or_default(),
            );
        }
        keys
    }

    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        // tgt answers UNMAP (and WRITE SAME with UNMAP, which Linux zeroes
        // with) by punching a hole in LUN 1's backing store: a file can
        // take it, a logical volume (through its hold device) cannot, and
        // tgt then fails the command with a hardware error: discards,
        // fstrim and ext4's online resize all fail on the node.
        let holes = self.store.kind().is_none_or(|s| s.punches_holes);
        if thin_value(changes)? == Some(true) && !holes {
            return Err(Error::invalid(format!(
                "{THIN_PROVISIONING}: backend {}'s LUNs are logical volumes, which cannot punch \
                 the holes tgt makes for a LUN that reports thin provisioning (every discard, \
                 and a filesystem's online resize, would fail with a hardware error on the \
                 node); thin provisioning is for a file store",
                self.name
            )));
        }
        // A store without mutable parameters has none to check (the keys
        // were checked against mutable_keys, which names only the store's).
        match self.store.get()?.modifier() {
            Some(m) => m.check_mutable(&store_changes(changes)),
            None => Ok(()),
        }
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        secrets: &Secrets,
    ) -> Result<()> {
        self.own_volume(id)?;
        let thin = thin_value(changes)?;
        let _volume = self.volume_mutex(id).lock_owned().await;
        let mut record = self.load(id)?.ok_or_else(|| Error::no_volume(id))?;
        // The store's keys first: it checks them whole before it changes
        // anything; then the LUN, whose change cannot be refused.
        let for_store = store_changes(changes);
        if !for_store.is_empty() {
            self.store
                .get()?
                .modifying()?
                .modify_volume(&self.store.volume(id)?, &for_store, secrets)
                .await?;
        }
        // Each step is safe to repeat: the CO's retry of a modify cut
        // short here (or after the LUN's change, before the record) makes
        // every change, the record last.
        crate::killpoint::hit(KillPoint::ModifyStore);
        let Some(on) = thin.filter(|on| *on != record.thin_provisioning) else {
            return Ok(());
        };
        let tid = self.ensure_target(id, &mut record).await?;
        self.target.set_thin_provisioning(tid, on).await?;
        record.thin_provisioning = on;
        if let Err(e) = self.save(id, &record) {
            let _ = self.target.set_thin_provisioning(tid, !on).await;
            return Err(e);
        }
        Ok(())
    }
}
