//! The nfs backend's health, as the controller reaches its exports: an
//! export that cannot be mounted, a volume whose record or directory is
//! gone, a directory whose handle went stale.

use super::*;
use crate::plugin::health::{Finding, Reason};
use crate::plugin::HealthReporter;

#[async_trait::async_trait]
impl HealthReporter for NfsBackend {
    async fn volume_health(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Vec<Finding>> {
        let not_found = || vec![crate::plugin::controller::volume_not_found(id)];
        let Ok(loc) = self.locate(id) else {
            return Ok(not_found());
        };
        let held = match self.hold(&loc).await {
            Ok(held) => held,
            Err(e) => {
                return Ok(vec![Finding::inaccessible(
                    Reason::ExportUnreachable,
                    format!(
                        "export {}:{} cannot be reached: {}",
                        loc.server, loc.share, e.message
                    ),
                )])
            }
        };
        if Self::read_record(&held.dir, &loc.subdir).await?.is_none() {
            return Ok(not_found());
        }
        // Asked of the server, not of this client's caches: a directory
        // removed there is gone here at once.
        let (root, subdir) = (held.dir.clone(), loc.subdir.clone());
        let dir = blocking("inspecting the share", move || {
            let synced = crate::host::synced::exists_on_server(&root.join(&subdir))?;
            // No symlink on the way (resolve refuses one).
            Ok(synced && resolve(&root, &subdir)?.is_some())
        })
        .await;
        Ok(match dir {
            Ok(true) => Vec::new(),
            Ok(false) => vec![Finding::inaccessible(
                Reason::VolumeDirectoryMissing,
                format!(
                    "the volume's directory {} is gone from {}:{} (its record is still there)",
                    loc.subdir.display(),
                    loc.server,
                    loc.share
                ),
            )],
            Err(e) if e.os_error == Some(libc::ESTALE) => vec![Finding::inaccessible(
                Reason::FilesystemNotAnswering,
                format!("the export's handle is stale: {}", e.message),
            )],
            Err(e) => return Err(e),
        })
    }
}
