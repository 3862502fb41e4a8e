//! The iscsi backend's health: as the target host sees it (the exports':
//! the store's view of the volume and whether tgtd still serves its
//! target), and as a node sees its sessions.

use super::*;
use crate::plugin::health::{Finding, Reason};
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

impl IscsiBackend {
    /// What NodeGetStorageHealth says of this backend on a node: sessions
    /// of this driver's targets that are down. Every portal down is the
    /// storage unreachable from here; some down with others up (multipath)
    /// is degraded.
    pub(super) async fn path_findings(&self) -> Vec<crate::plugin::health::StorageFinding> {
        use crate::plugin::health::{StorageFinding, StorageStatus};
        let (down, up) = match self.initiator().paths(&self.settings.iqn_prefix).await {
            Ok(paths) => paths,
            Err(e) => {
                return vec![StorageFinding {
                    status: StorageStatus::Unreachable,
                    reason: Reason::HealthCheckFailed,
                    message: format!("the iSCSI sessions could not be read: {}", e.message),
                }]
            }
        };
        if down.is_empty() {
            return Vec::new();
        }
        let portals: BTreeSet<&str> = down.iter().map(|s| s.portal.as_str()).collect();
        let portals: Vec<&str> = portals.into_iter().collect();
        let targets = down.len();
        let still: Vec<&str> = up.iter().map(String::as_str).collect();
        if still.is_empty() {
            vec![StorageFinding {
                status: StorageStatus::Unreachable,
                reason: reasons::SessionDown,
                message: format!(
                    "{targets} session(s) through {} down, none up",
                    portals.join(", ")
                ),
            }]
        } else {
            vec![StorageFinding {
                status: StorageStatus::Degraded,
                reason: reasons::PathDown,
                message: format!(
                    "{targets} session(s) through {} down; {} still up",
                    portals.join(", "),
                    still.join(", ")
                ),
            }]
        }
    }
}
