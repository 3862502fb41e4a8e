//! The iscsi backend's health: as the target host sees it (the exports':
//! the store's view of the volume and whether tgtd still serves its
//! target), and as a node sees its sessions.

use super::*;
use crate::plugin::health::Finding;
use crate::plugin::HealthReporter;

crate::reasons! {
    /// The health reasons only this backend gives (the shared ones are
    /// [`crate::plugin::health::Reason`]'s).
    pub mod reasons {
        /// tgtd no longer serves the volume's target.
        TargetMissing,
        /// No iSCSI session to the volume's target.
        SessionMissing,
        /// The iSCSI session to the volume's target is not logged in.
        SessionDown,
        /// One path of a multipath volume is down; the others carry it.
        PathDown,
        /// The multipath map of the volume is gone.
        MultipathMapGone,
        /// The staged device is no longer a disk of the volume's session.
        LunMissing,
    }
}

#[async_trait::async_trait]
impl HealthReporter for IscsiBackend {
    async fn known_volumes(&self, page: &Page) -> Result<Vec<VolumeId>> {
        self.exports.known_volumes(page).await
    }

    /// The store's findings, and [`reasons::TargetMissing`] where tgtd no
    /// longer serves the volume's target.
    async fn volume_health(&self, id: &VolumeId, secrets: &Secrets) -> Result<Vec<Finding>> {
        self.exports.volume_health(id, secrets).await
    }
}
