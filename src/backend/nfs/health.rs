//! The nfs backend's health, as the controller reaches its exports: an
//! export that cannot be mounted, a volume whose record or directory is
//! gone, a directory whose handle went stale.

use super::*;
use crate::plugin::health::{Finding, Reason};
use crate::plugin::HealthReporter;

crate::reasons! {
    /// The health reasons only this backend gives (the shared ones are
    /// [`crate::plugin::health::Reason`]'s).
    pub mod reasons {
        /// The nfs export cannot be mounted or read from the controller.
        ExportUnreachable,
        /// An nfs server does not answer an RPC on its NFS port from this node.
        ServerNotAnswering,
        /// The nfs volume's directory is gone from its export; its record is
        /// still there.
        VolumeDirectoryMissing,
        /// The room the nfs server gives a volume's directory (its quota, or
        /// its export's filesystem) is nearly used up.
        QuotaNearlyReached,
    }
}

#[async_trait::async_trait]
impl HealthReporter for NfsBackend {
    async fn volume_health(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Vec<Finding>> {
        let not_found = || vec![crate::plugin::health::volume_not_found(id)];
        let Ok(loc) = self.locate(id) else {
            return Ok(not_found());
        };
        let held = match self.hold(&loc).await {
            Ok(held) => held,
            Err(e) => {
                return Ok(vec![Finding::inaccessible(
                    reasons::ExportUnreachable,
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
        let (root, subdir, host) = (held.dir.clone(), loc.subdir.clone(), self.host.clone());
        let dir = blocking("inspecting the share", move || {
            let synced = crate::host::synced::exists_on_server(&root.join(&subdir))?;
            // No symlink on the way (resolve refuses one).
            match resolve(&root, &subdir)? {
                // The room the server gives the directory: its project
                // quota where it has one (XFS reports it as the size),
                // else its export's filesystem.
                Some(dir) if synced => host.fs_usage(&dir).map(Some),
                _ => Ok(None),
            }
        })
        .await;
        Ok(match dir {
            Ok(Some(usage)) => nearly_full(&usage).into_iter().collect(),
            Ok(None) => vec![Finding::inaccessible(
                reasons::VolumeDirectoryMissing,
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

impl NfsBackend {
    /// The configured exports' servers (each server and port once) that
    /// do not answer a NULL call within `within`: the storage unreachable
    /// from this node. Servers a StorageClass names that no export lists
    /// are not known here.
    pub(super) async fn servers_not_answering(
        &self,
        within: Duration,
    ) -> Vec<crate::plugin::health::StorageFinding> {
        use crate::plugin::health::{StorageFinding, StorageStatus};
        let mut servers = BTreeMap::new();
        for e in &self.settings.exports {
            let port = probe::port_of(&Self::options_of(e));
            servers
                .entry((e.server.clone(), port))
                .or_insert_with(|| probe::version_of(e.version.as_deref()));
        }
        let mut asked = tokio::task::JoinSet::new();
        for ((server, port), version) in servers {
            asked.spawn(async move {
                let answer = probe::answers(&server, port, version, within).await;
                (server, port, answer)
            });
        }
        let mut found = Vec::new();
        while let Some(Ok((server, port, answer))) = asked.join_next().await {
            if let Err(why) = answer {
                found.push(StorageFinding {
                    status: StorageStatus::Unreachable,
                    reason: reasons::ServerNotAnswering,
                    message: format!("server {server} port {port}: {why}"),
                });
            }
        }
        found.sort_by(|a, b| a.message.cmp(&b.message));
        found
    }
}

/// A volume's directory with less than this share of its room free is
/// nearly full: its writers meet ENOSPC (or EDQUOT) once it is full.
pub const NEARLY_FULL_PERCENT: u64 = 5;

/// What the server's figures for a volume's directory say: nearly full
/// (its quota, or its export's filesystem) under [`NEARLY_FULL_PERCENT`].
pub fn nearly_full(usage: &crate::host::FsUsage) -> Option<Finding> {
    if usage.total_bytes == 0
        || usage.available_bytes * 100 >= usage.total_bytes * NEARLY_FULL_PERCENT
    {
        return None;
    }
    Some(Finding::degraded(
        reasons::QuotaNearlyReached,
        format!(
            "the server gives the volume's directory {} of {} bytes free (under \
             {NEARLY_FULL_PERCENT}%): its quota, or its export's filesystem, is nearly full; its \
             writes fail with ENOSPC once it is",
            usage.available_bytes, usage.total_bytes
        ),
    ))
}
