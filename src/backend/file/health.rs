//! The file backend's health: a volume whose image is gone, a pool that
//! cannot be written or is nearly full.

use super::*;
use crate::plugin::health::{Finding, StorageFinding, StorageStatus};
use crate::plugin::HealthReporter;

crate::reasons! {
    /// The health reasons only this backend gives (the shared ones are
    /// [`crate::plugin::health::Reason`]'s).
    pub mod reasons {
        /// The file backend's image file of the volume is gone.
        ImageMissing,
        /// The loop device the volume was staged on no longer backs its image.
        LoopDeviceGone,
        /// The file backend's pool folder cannot be read or written.
        PoolUnreachable,
        /// The file backend's pool has less room left than its threshold.
        PoolNearlyFull,
    }
}

/// A pool with less than this share of its room free is nearly full: its
/// volumes (sparse images) may meet ENOSPC before they are full.
pub const NEARLY_FULL_PERCENT: u64 = 5;

impl FileBackend {
    /// The pool's room, when it is nearly full.
    fn nearly_full(&self) -> Result<Option<String>> {
        let usage = self.host.fs_usage(&self.settings.pool)?;
        if usage.total_bytes == 0
            || usage.available_bytes * 100 >= usage.total_bytes * NEARLY_FULL_PERCENT
        {
            return Ok(None);
        }
        Ok(Some(format!(
            "pool {} has {} of {} bytes free (under {NEARLY_FULL_PERCENT}%): writes to its \
             images may fail with ENOSPC",
            self.settings.pool.display(),
            usage.available_bytes,
            usage.total_bytes
        )))
    }

    /// What NodeGetStorageHealth says of this backend beyond readiness.
    pub(super) fn pool_findings(&self) -> Vec<StorageFinding> {
        match self.nearly_full() {
            Ok(None) => Vec::new(),
            Ok(Some(why)) => vec![StorageFinding {
                status: StorageStatus::Degraded,
                reason: reasons::PoolNearlyFull,
                message: why,
            }],
            Err(e) => vec![StorageFinding {
                status: StorageStatus::Unreachable,
                reason: reasons::PoolUnreachable,
                message: e.message,
            }],
        }
    }
}

#[async_trait::async_trait]
impl HealthReporter for FileBackend {
    async fn known_volumes(&self, page: &Page) -> Result<Vec<VolumeId>> {
        page_of(&self.index.volumes, page)
            .into_iter()
            .map(|l| VolumeId::new(&self.name, &l))
            .collect()
    }

    async fn volume_health(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Vec<Finding>> {
        self.own(id.backend())?;
        let (meta, image) = (self.meta(id.locator()), self.image(id.locator()));
        let mut found = Vec::new();
        match (meta.exists(), image.exists()) {
            (false, false) => return Ok(vec![crate::plugin::health::volume_not_found(id)]),
            (_, false) => found.push(Finding::inaccessible(
                reasons::ImageMissing,
                format!("image {} is missing", image.display()),
            )),
            _ => {}
        }
        match self.nearly_full() {
            Ok(None) => {}
            Ok(Some(why)) => found.push(Finding::degraded(reasons::PoolNearlyFull, why)),
            Err(e) => found.push(Finding::inaccessible(reasons::PoolUnreachable, e.message)),
        }
        Ok(found)
    }
}
