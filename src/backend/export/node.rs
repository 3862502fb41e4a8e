//! The exports on a node: what ControllerPublish tells a node (the
//! publish context), the node's connection to a volume's export through
//! the protocol's [`Initiator`](super::Initiator) for a stage, let go at
//! unstage, grown, looked at, and a copy's filesystem UUID renewed once.

use super::initiator::Connection;
use super::record::Record;
use super::target::Credential;
use super::Exports;
use crate::error::{Error, Result};
use crate::plugin::health::{Finding, Reason, StorageFinding, StorageStatus};
use crate::plugin::{AttachContext, Attachment, VolumeId};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Publish context keys every protocol has: the portals...
const CTX_PORTALS: &str = "portals";
/// ...and, for a copy (a restored snapshot, a clone) whose filesystem
/// still carries its source's UUID, a token the node renews it under once.
pub const CTX_FS_COPY: &str = "fsCopy";

/// Whether a publish context's copy token is one ferrovol could have made
/// (it is written to a file on the node).
pub fn is_token(t: &str) -> bool {
    !t.is_empty() && t.len() <= 64 && t.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

impl Exports {
    /// What ControllerPublish hands the node for a volume's record.
    pub fn publish_context(&self, record: &Record) -> BTreeMap<String, String> {
        let terms = self.initiator.terms();
        let mut ctx = BTreeMap::from([
            (CTX_PORTALS.to_string(), self.portals.join(",")),
            (terms.ctx_export.to_string(), record.export.clone()),
            (terms.ctx_unit.to_string(), "1".to_string()),
        ]);
        if let Some(copy) = &record.copy {
            ctx.insert(CTX_FS_COPY.to_string(), copy.token.clone());
        }
        ctx
    }

    /// NodeStage's attach: connects to the export the publish context
    /// names (this volume's, or refused) with the stage's credentials and
    /// the volume's own settings (checked by its protocol).
    pub async fn node_attach(
        &self,
        id: &VolumeId,
        ctx: &AttachContext,
        incoming: Option<&Credential>,
        outgoing: Option<&Credential>,
        settings: &BTreeMap<String, String>,
    ) -> Result<Attachment> {
        self.own_volume(id)?;
        let terms = self.initiator.terms();
        let export = ctx.publish_context.get(terms.ctx_export).ok_or_else(|| {
            Error::invalid(format!(
                "publish context has no {}: was the volume ControllerPublished?",
                terms.ctx_export
            ))
        })?;
        if *export != self.export_name(id) {
            return Err(Error::invalid(format!(
                "publish context names {} {export:?}, not this volume's",
                self.terms().export
            )));
        }
        let portals: Vec<&str> = ctx
            .publish_context
            .get(CTX_PORTALS)
            .map(|p| p.split(',').filter(|p| !p.is_empty()).collect())
            .unwrap_or_default();
        if portals.is_empty() || portals.iter().any(|p| !crate::config::is_host_port(p)) {
            return Err(Error::invalid(
                "publish context: portals must be host:port, comma-separated",
            ));
        }
        let unit: u32 = ctx
            .publish_context
            .get(terms.ctx_unit)
            .and_then(|l| l.parse().ok())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "publish context: {} must be a number",
                    terms.ctx_unit
                ))
            })?;
        let path = self
            .initiator
            .attach(&Connection {
                export,
                portals: &portals,
                unit,
                incoming,
                outgoing,
                settings,
            })
            .await?;
        Ok(Attachment::Device { path })
    }

    /// NodeUnstage's detach: the connection let go, and the copy's mark.
    pub async fn node_detach(&self, id: &VolumeId) -> Result<()> {
        self.own_volume(id)?;
        self.initiator.detach(&self.export_name(id)).await?;
        crate::records::remove(&self.renewed_path(id)).map(drop)
    }

    pub async fn node_release_io(&self, id: &VolumeId) -> Result<()> {
        self.own_volume(id)?;
        self.initiator.release_lost(&self.export_name(id)).await
    }

    pub async fn node_health(
        &self,
        id: &VolumeId,
        attachment: &Attachment,
    ) -> Result<Vec<Finding>> {
        self.own_volume(id)?;
        let Attachment::Device { path } = attachment else {
            return Err(Error::internal("exported volumes are attached as devices"));
        };
        Ok(self
            .initiator
            .condition(&self.export_name(id), path)
            .await?
            .into_iter()
            .collect())
    }

    pub async fn node_refresh_size(&self, id: &VolumeId) -> Result<u64> {
        self.own_volume(id)?;
        self.initiator.rescan(&self.export_name(id)).await
    }

    /// Whether this node has yet to renew the UUID of the copy the
    /// publish context names.
    pub async fn node_copy_pending(&self, id: &VolumeId, ctx: &AttachContext) -> Result<bool> {
        self.own_volume(id)?;
        let Some(token) = ctx.publish_context.get(CTX_FS_COPY) else {
            return Ok(false);
        };
        if !is_token(token) {
            return Err(Error::invalid(format!(
                "publish context: {CTX_FS_COPY} is not a token ferrovol makes"
            )));
        }
        match std::fs::read_to_string(self.renewed_path(id)) {
            Ok(done) => Ok(done.trim() != token),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(Error::io("read the copy's renewal mark", e)),
        }
    }

    /// Marks the copy's UUID renewed on this node.
    pub async fn node_copy_done(&self, id: &VolumeId, ctx: &AttachContext) -> Result<()> {
        self.own_volume(id)?;
        let Some(token) = ctx.publish_context.get(CTX_FS_COPY).filter(|t| is_token(t)) else {
            return Ok(());
        };
        let path = self.renewed_path(id);
        crate::records::private_dir(path.parent().unwrap_or(self.records.dir()))?;
        crate::records::write(&path, token.as_bytes())
    }

    /// Node side: the token under which this node renewed a copy's UUID.
    fn renewed_path(&self, id: &VolumeId) -> PathBuf {
        self.records.dir().join("renewed").join(id.locator())
    }

    /// What NodeGetStorageHealth says of the exports on a node: paths of
    /// this driver's exports that are down. Every portal down is the
    /// storage unreachable from here; some down with others up (multipath)
    /// is degraded.
    pub async fn path_findings(&self) -> Vec<StorageFinding> {
        let terms = self.initiator.terms();
        let paths = match self.initiator.paths(&self.prefix).await {
            Ok(paths) => paths,
            Err(e) => {
                return vec![StorageFinding {
                    status: StorageStatus::Unreachable,
                    reason: Reason::HealthCheckFailed,
                    message: format!("{} could not be read: {}", terms.paths, e.message),
                }]
            }
        };
        if paths.down.is_empty() {
            return Vec::new();
        }
        let portals: BTreeSet<&str> = paths.down.iter().map(String::as_str).collect();
        let portals: Vec<&str> = portals.into_iter().collect();
        let count = paths.down.len();
        let still: Vec<&str> = paths.up.iter().map(String::as_str).collect();
        if still.is_empty() {
            vec![StorageFinding {
                status: StorageStatus::Unreachable,
                reason: terms.all_down,
                message: format!(
                    "{count} {}(s) through {} down, none up",
                    terms.path,
                    portals.join(", ")
                ),
            }]
        } else {
            vec![StorageFinding {
                status: StorageStatus::Degraded,
                reason: terms.some_down,
                message: format!(
                    "{count} {}(s) through {} down; {} still up",
                    terms.path,
                    portals.join(", "),
                    still.join(", ")
                ),
            }]
        }
    }
}
