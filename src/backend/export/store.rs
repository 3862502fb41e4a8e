//! An exporting backend's store: the private backend its volumes live in
//! (a kind with [`crate::plugin::StoreKind`]), and the one mapping between
//! the exporting backend's ids and the store's: a volume or snapshot has
//! the same locator in both, under each backend's name.

use crate::config::BackendConfig;
use crate::error::{Error, Result};
use crate::plugin::{
    Backend, BlockPage, Capacity, ContentSource, CreateSnapshot, CreateVolume, Env, Page, Secrets,
    SnapshotId, SnapshotInfo, StoreKind, VolumeId, VolumeInfo,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Builds the store a `[backend.store]` table describes for backend
/// `owner`: a kind that can be a store (INVALID_ARGUMENT listing those
/// that can otherwise), named `<owner>-store`, with what that kind needs as
/// a store added to its table. Never registered: its volumes are reached
/// only through the exporting backend.
pub fn build(
    owner: &str,
    table: Option<&BackendConfig>,
    env: &Env,
) -> Result<Option<Arc<dyn Backend>>> {
    let Some(table) = table else {
        return Ok(None);
    };
    let as_store = crate::backend::kind(&table.kind)
        .ok()
        .and_then(|k| k.store.as_ref())
        .ok_or_else(|| {
            let stores: Vec<&str> = crate::backend::KINDS
                .iter()
                .filter(|k| k.store.is_some())
                .map(|k| k.name)
                .collect();
            Error::invalid(format!(
                "backend {owner:?}: the store must be of a type that can hold LUNs ({})",
                stores.join(", ")
            ))
        })?;
    let mut table = table.clone();
    table.name = Some(format!("{owner}-store"));
    (as_store.as_store)(&mut table);
    crate::backend::build_backend(&table, env).map(Some)
}

/// The store of backend `owner`, where this host has one (a controller);
/// a node has none.
pub struct Store {
    owner: String,
    backend: Option<Arc<dyn Backend>>,
}

impl Store {
    pub fn new(owner: &str, backend: Option<Arc<dyn Backend>>) -> Self {
        Store {
            owner: owner.to_string(),
            backend,
        }
    }

    /// The store, or FAILED_PRECONDITION where this host has none.
    pub fn get(&self) -> Result<&Arc<dyn Backend>> {
        self.backend.as_ref().ok_or_else(|| {
            Error::precondition(format!(
                "backend {}: no [backend.store] here; volumes are managed by the controller that has one",
                self.owner
            ))
        })
    }

    /// The store, if this host has one.
    pub fn here(&self) -> Option<&Arc<dyn Backend>> {
        self.backend.as_ref()
    }

    /// What its kind offers as a store, if this host has one.
    pub fn kind(&self) -> Option<&'static StoreKind> {
        self.backend.as_ref().and_then(|s| s.kind().store.as_ref())
    }

    /// The StorageClass parameters it takes (none without a store).
    pub fn parameters(&self) -> Vec<&'static str> {
        self.here().map(|s| s.parameters()).unwrap_or_default()
    }

    /// A volume's id in the store.
    pub fn volume(&self, id: &VolumeId) -> Result<VolumeId> {
        VolumeId::new(self.get()?.name(), id.locator())
    }

    /// A store volume's id in the exporting backend.
    pub fn owner_volume(&self, id: &VolumeId) -> Result<VolumeId> {
        VolumeId::new(&self.owner, id.locator())
    }

    /// A snapshot's id in the store.
    pub fn snapshot(&self, id: &SnapshotId) -> Result<SnapshotId> {
        SnapshotId::new(self.get()?.name(), id.locator())
    }

    /// A store snapshot's id in the exporting backend.
    pub fn owner_snapshot(&self, id: &SnapshotId) -> Result<SnapshotId> {
        SnapshotId::new(&self.owner, id.locator())
    }

    /// A store volume as the exporting backend shows it: its id and its
    /// source's.
    pub fn volume_info(&self, mut v: VolumeInfo) -> Result<VolumeInfo> {
        v.id = self.owner_volume(&v.id)?;
        v.source = match v.source {
            Some(ContentSource::Volume(s)) => Some(ContentSource::Volume(self.owner_volume(&s)?)),
            Some(ContentSource::Snapshot(s)) => {
                Some(ContentSource::Snapshot(self.owner_snapshot(&s)?))
            }
            None => None,
        };
        Ok(v)
    }

    /// A store snapshot as the exporting backend shows it.
    pub fn snapshot_info(&self, mut s: SnapshotInfo) -> Result<SnapshotInfo> {
        s.id = self.owner_snapshot(&s.id)?;
        s.source_volume = self.owner_volume(&s.source_volume)?;
        Ok(s)
    }

    // What an exporting backend's calls ask of the store alone, with the
    // ids mapped both ways. An id of another backend is a volume or
    // snapshot that does not exist here.

    /// Whether the store makes clones.
    pub fn clones(&self) -> bool {
        self.here()
            .and_then(|s| s.provisioner())
            .is_some_and(|p| p.clones())
    }

    /// The id a CreateVolume makes.
    pub fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        self.owner_volume(&self.get()?.provisioning()?.volume_id_for(req)?)
    }

    pub async fn get_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        if id.backend() != self.owner {
            return Ok(None);
        }
        match self
            .get()?
            .provisioning()?
            .get_volume(&self.volume(id)?, secrets)
            .await?
        {
            Some(v) => Ok(Some(self.volume_info(v)?)),
            None => Ok(None),
        }
    }

    pub async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        self.get()?
            .provisioning()?
            .list_volumes(page)
            .await?
            .into_iter()
            .map(|v| self.volume_info(v))
            .collect()
    }

    pub async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        self.get()?.provisioning()?.capacity(parameters).await
    }

    /// The id a CreateSnapshot makes.
    pub fn snapshot_id_for(&self, req: &CreateSnapshot) -> Result<SnapshotId> {
        let mut r = req.clone();
        r.source = self.volume(&req.source)?;
        self.owner_snapshot(&self.get()?.snapshotting()?.snapshot_id_for(&r)?)
    }

    pub fn validate_snapshot_parameters(
        &self,
        parameters: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.get()?
            .snapshotting()?
            .validate_snapshot_parameters(parameters)
    }

    /// The store's snapshot of volume `req.source` (holding its writers,
    /// if it must be, is the exporting backend's).
    pub async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        let mut r = req.clone();
        r.source = self.volume(&req.source)?;
        self.snapshot_info(self.get()?.snapshotting()?.create_snapshot(&r).await?)
    }

    pub async fn delete_snapshot(&self, id: &SnapshotId, secrets: &Secrets) -> Result<()> {
        if id.backend() != self.owner {
            return Ok(());
        }
        self.get()?
            .snapshotting()?
            .delete_snapshot(&self.snapshot(id)?, secrets)
            .await
    }

    pub async fn get_snapshot(
        &self,
        id: &SnapshotId,
        secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        if id.backend() != self.owner {
            return Ok(None);
        }
        match self
            .get()?
            .snapshotting()?
            .get_snapshot(&self.snapshot(id)?, secrets)
            .await?
        {
            Some(s) => Ok(Some(self.snapshot_info(s)?)),
            None => Ok(None),
        }
    }

    pub async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        let source = match source {
            Some(s) if s.backend() != self.owner => return Ok(Vec::new()),
            Some(s) => Some(self.volume(s)?),
            None => None,
        };
        self.get()?
            .snapshotting()?
            .list_snapshots(source.as_ref(), page)
            .await?
            .into_iter()
            .map(|s| self.snapshot_info(s))
            .collect()
    }

    pub async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.get()?
            .tracking_blocks()?
            .allocated_blocks(&self.snapshot(snapshot)?, start, max, secrets)
            .await
    }

    pub async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        let (base, target) = (self.snapshot(base)?, self.snapshot(target)?);
        self.get()?
            .tracking_blocks()?
            .changed_blocks(&base, &target, start, max, secrets)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where there is no store (a node), what needs one is
    /// FAILED_PRECONDITION naming the backend, and another backend's ids
    /// are absent without asking a store; ids map by locator.
    #[tokio::test]
    async fn without_a_store_what_needs_one_is_refused_and_ids_map_by_locator() {
        let s = Store::new("iscsi", None);
        let e = s.get().err().unwrap();
        assert_eq!(e.kind, crate::error::Kind::FailedPrecondition);
        assert!(
            e.message.contains("backend iscsi: no [backend.store] here"),
            "{e}"
        );
        assert!(s.parameters().is_empty());
        assert!(s.kind().is_none());
        assert!(!s.clones());
        let other = VolumeId::parse("lvm:pvc-1").unwrap();
        let secrets = Secrets::default();
        assert!(s.get_volume(&other, &secrets).await.unwrap().is_none());
        let mine = VolumeId::parse("iscsi:pvc-1").unwrap();
        assert!(s.get_volume(&mine, &secrets).await.is_err());
        let snap = SnapshotId::parse("lvm:snap-1").unwrap();
        s.delete_snapshot(&snap, &secrets).await.unwrap();
        assert_eq!(
            s.owner_volume(&VolumeId::parse("iscsi-store:pvc-1").unwrap())
                .unwrap(),
            mine
        );
    }
}
