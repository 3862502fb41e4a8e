//! The `iscsi` backend's snapshots: the store's, taken, deleted and listed
//! through the exports (which hold the initiators' writes for a cut), and
//! their changed blocks.

use super::*;

#[async_trait::async_trait]
impl Snapshotter for IscsiBackend {
    fn instant(&self) -> SnapshotInstant {
        self.exports.instant()
    }

    /// Members in use are held at the target while each is cut.
    fn groups(&self) -> Groups<'_> {
        Groups::Cut(&self.exports)
    }

    fn snapshot_id_for(&self, req: &CreateSnapshot) -> Result<SnapshotId> {
        self.exports.store().snapshot_id_for(req)
    }

    fn validate_snapshot_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        self.exports
            .store()
            .validate_snapshot_parameters(parameters)
    }

    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        self.exports.create_snapshot(req).await
    }

    async fn delete_snapshot(&self, id: &SnapshotId, secrets: &Secrets) -> Result<()> {
        self.exports.store().delete_snapshot(id, secrets).await
    }

    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        self.exports.store().get_snapshot(id, secrets).await
    }

    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        self.exports.store().list_snapshots(source, page).await
    }
}

#[async_trait::async_trait]
impl BlockTracker for IscsiBackend {
    async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.exports
            .store()
            .allocated_blocks(snapshot, start, max, secrets)
            .await
    }

    async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.exports
            .store()
            .changed_blocks(base, target, start, max, secrets)
            .await
    }
}
