//! Changed block tracking (the SnapshotMetadata service): a page of a
//! snapshot's allocated ranges, or of the ranges that changed between two
//! snapshots of one volume, from the snapshot's backend.

use super::ControllerOps;
use crate::error::{Error, Result};
use crate::plugin::{BlockPage, Secrets, SnapshotId};

impl ControllerOps {
    /// Whether any backend tracks changed blocks.
    pub fn metadata_served(&self) -> bool {
        self.registry.capabilities().snapshot_metadata
    }

    /// GetMetadataAllocated's page from `start`.
    pub async fn allocated_blocks(
        &self,
        id: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        let backend = self.registry.for_snapshot(id)?.clone();
        let page = backend
            .tracking_blocks()?
            .allocated_blocks(id, start, max, secrets)
            .await?;
        in_range(start, page)
    }

    /// GetMetadataDelta's page from `start`.
    pub async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        let backend = self.registry.for_snapshot(target)?.clone();
        self.registry.for_snapshot(base)?;
        if base.backend() != target.backend() {
            return Err(Error::invalid(format!(
                "snapshots {base} and {target} are of different backends: not of one volume"
            )));
        }
        let page = backend
            .tracking_blocks()?
            .changed_blocks(base, target, start, max, secrets)
            .await?;
        in_range(start, page)
    }
}

/// A start at or past the end of the snapshot is OUT_OF_RANGE.
fn in_range(start: u64, page: BlockPage) -> Result<BlockPage> {
    if start >= page.capacity {
        return Err(Error::out_of_range(format!(
            "starting_offset {start} is past the snapshot's end ({} bytes)",
            page.capacity
        )));
    }
    Ok(page)
}
