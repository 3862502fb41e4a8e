//! The lvm backend's health: a volume whose LV is gone or unsettled, a thin
//! pool nearly full, a volume group this node cannot read.

use super::*;
use crate::plugin::health::{Finding, StorageFinding, StorageStatus};
use crate::plugin::HealthReporter;

crate::reasons! {
    /// The health reasons only this backend gives (the shared ones are
    /// [`crate::plugin::health::Reason`]'s).
    pub mod reasons {
        /// The logical volume is gone.
        LogicalVolumeGone,
        /// The logical volume is not active.
        LogicalVolumeInactive,
        /// A physical volume under the logical volume is missing.
        LogicalVolumePartial,
        /// lvm reports the logical volume's state as unknown, needing a
        /// refresh, or with mismatches.
        LogicalVolumeUnsettled,
        /// A classic snapshot that overflowed its copy-on-write area.
        SnapshotInvalid,
        /// A thin pool's data or metadata is nearly full.
        ThinPoolNearlyFull,
        /// A device class's thin pool cannot be found.
        ThinPoolMissing,
        /// A device class's volume group cannot be read on this node.
        VolumeGroupMissing,
    }
}

/// A thin pool whose data or metadata is this full or more is nearly full:
/// its volumes' writes fail once it is full.
pub const POOL_NEARLY_FULL_PERCENT: f64 = 90.0;

impl LvmBackend {
    /// A class's thin pool, when it is nearly full.
    async fn pool_nearly_full(&self, class: &DeviceClass) -> Result<Option<String>> {
        let Some(pool) = &class.thin_pool else {
            return Ok(None);
        };
        let p = self.pool(class, pool).await?;
        let pct = |s: &str| s.trim().parse::<f64>().unwrap_or(0.0);
        let (data, meta) = (pct(&p.data_percent), pct(&p.metadata_percent));
        if data < POOL_NEARLY_FULL_PERCENT && meta < POOL_NEARLY_FULL_PERCENT {
            return Ok(None);
        }
        Ok(Some(format!(
            "thin pool {}/{pool} is {data}% full of data and {meta}% of metadata (from \
             {POOL_NEARLY_FULL_PERCENT}% on, nearly full): its volumes' writes fail once it \
             is full",
            class.volume_group
        )))
    }
}

#[async_trait::async_trait]
impl HealthReporter for LvmBackend {
    async fn volume_health(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Vec<Finding>> {
        let (class, lv_name) = self.split(id.locator())?;
        let Some(lv) = self.class_lv(class, lv_name).await? else {
            return Ok(vec![match self.unreadable_group(class).await {
                Some(why) => Finding::inaccessible(reasons::VolumeGroupMissing, why),
                None => crate::plugin::health::volume_not_found(id),
            }]);
        };
        // An LV is inactive while no node has it staged: that is its rest.
        let mut found: Vec<Finding> = lv
            .problem()
            .into_iter()
            .filter(|f| f.reason != reasons::LogicalVolumeInactive)
            .collect();
        if !lv.pool_lv.is_empty() {
            if let Some(why) = self.pool_nearly_full(class).await? {
                found.push(Finding::degraded(reasons::ThinPoolNearlyFull, why));
            }
        }
        Ok(found)
    }
}

impl LvmBackend {
    /// What NodeGetStorageHealth says of this backend beyond readiness:
    /// each device class's volume group and thin pool.
    pub(super) async fn class_findings(&self) -> Vec<StorageFinding> {
        let mut found = Vec::new();
        for class in &self.settings.device_classes {
            if let Err(e) = self.vg(class).await {
                found.push(StorageFinding {
                    status: StorageStatus::Unreachable,
                    reason: reasons::VolumeGroupMissing,
                    message: format!("device class {}: {}", class.name, e.message),
                });
                continue;
            }
            match self.pool_nearly_full(class).await {
                Ok(None) => {}
                Ok(Some(why)) => found.push(StorageFinding {
                    status: StorageStatus::Degraded,
                    reason: reasons::ThinPoolNearlyFull,
                    message: format!("device class {}: {why}", class.name),
                }),
                Err(e) => found.push(StorageFinding {
                    status: StorageStatus::Unreachable,
                    reason: reasons::ThinPoolMissing,
                    message: format!("device class {}: {}", class.name, e.message),
                }),
            }
        }
        found
    }
}
