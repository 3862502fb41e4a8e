//! The `iscsi` backend's volumes: making, deleting, looking up, listing,
//! growing (the exports') and changing them (the LUN's thin provisioning
//! and the store's keys).

use super::*;

#[async_trait::async_trait]
impl Provisioner for IscsiBackend {
    fn clones(&self) -> bool {
        self.exports.store().clones()
    }

    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        self.exports.store().volume_id_for(req)
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        self.exports.create_volume(req).await
    }

    async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()> {
        self.exports.delete_volume(id, secrets).await
    }

    async fn get_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        self.exports.store().get_volume(id, secrets).await
    }

    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        self.exports.store().list_volumes(page).await
    }

    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        self.exports.store().capacity(parameters).await
    }
}

#[async_trait::async_trait]
impl Expander for IscsiBackend {
    /// tgt cannot grow a LUN under I/O (see `Tgtd::refresh`).
    fn online(&self) -> bool {
        self.exports.grows_online()
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        secrets: &Secrets,
    ) -> Result<u64> {
        self.exports
            .expand_volume(id, required, limit, secrets)
            .await
    }
}

#[async_trait::async_trait]
impl Modifier for IscsiBackend {
    fn mutable_keys(&self) -> Vec<&'static str> {
        // The LUN's own key, and the store's.
        let mut keys = vec![THIN_PROVISIONING];
        if let Some(store) = self.exports.store().here() {
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
        let holes = self.exports.store().kind().is_none_or(|s| s.punches_holes);
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
        match self.exports.store().get()?.modifier() {
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
        let exports = &self.exports;
        let _volume = exports.lock(id).await;
        let mut record = exports.load(id)?.ok_or_else(|| Error::no_volume(id))?;
        // The store's keys first: it checks them whole before it changes
        // anything; then the LUN, whose change cannot be refused.
        let for_store = store_changes(changes);
        if !for_store.is_empty() {
            let store = exports.store();
            store
                .get()?
                .modifying()?
                .modify_volume(&store.volume(id)?, &for_store, secrets)
                .await?;
        }
        // Each step is safe to repeat: the CO's retry of a modify cut
        // short here (or after the LUN's change, before the record) makes
        // every change, the record last.
        crate::killpoint::hit(KillPoint::ModifyStore);
        let Some(on) = thin.filter(|on| *on != record.thin_provisioning) else {
            return Ok(());
        };
        exports.ensure(id, &mut record).await?;
        let target = exports.target();
        target.set_thin_provisioning(&record.export, on).await?;
        record.thin_provisioning = on;
        if let Err(e) = exports.save(id, &record) {
            let _ = target.set_thin_provisioning(&record.export, !on).await;
            return Err(e);
        }
        Ok(())
    }
}
