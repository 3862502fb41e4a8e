//! The plugin layer, after Kubernetes' volume plugin framework: backends
//! declare what they can do, a [`Registry`] finds them by name or by volume
//! id, and the CSI services speak to them only through [`Backend`]. Backends
//! know nothing of gRPC.

mod id;
mod registry;
mod types;

pub use id::{
    is_dns_label, is_locator, locator_for_name, validate_name, SnapshotId, VolumeId, MAX_ID_LEN,
};
pub use registry::Registry;
pub use types::*;

use crate::error::{Error, Result};
use std::collections::BTreeMap;

/// A storage backend. Every operation has a default that answers
/// UNIMPLEMENTED, so a backend implements exactly what its
/// [`Capabilities`] declare.
#[async_trait::async_trait]
pub trait Backend: Send + Sync {
    /// The registered name: a lowercase DNS label, the prefix of its ids.
    fn name(&self) -> &str;
    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;
    /// Whether the backend can serve requests now (for Probe).
    async fn health(&self) -> Result<()>;

    /// Which access types and modes this backend can serve.
    fn supports(&self, capability: &VolumeCapability) -> Result<()> {
        let caps = self.capabilities();
        if matches!(capability.access, AccessType::Block) && !caps.block {
            return Err(Error::invalid(format!(
                "backend {} does not serve raw block volumes",
                self.name()
            )));
        }
        if !caps.access_modes.contains(&capability.mode) {
            return Err(Error::invalid(format!(
                "backend {} does not support access mode {:?}",
                self.name(),
                capability.mode
            )));
        }
        Ok(())
    }

    /// Checks StorageClass parameters meant for this backend (the
    /// `backend` key and the CO's own `csi.storage.k8s.io/` keys are taken
    /// out first). By default a backend takes none.
    fn validate_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        match parameters.keys().next() {
            Some(key) => Err(Error::invalid(format!(
                "backend {} takes no parameter {key:?}",
                self.name()
            ))),
            None => Ok(()),
        }
    }

    // ---- controller ----

    /// Creates a volume, or returns the existing one of the same name when
    /// it is compatible (ALREADY_EXISTS when it is not).
    async fn create_volume(&self, _req: &CreateVolume) -> Result<VolumeInfo> {
        Err(self.unimplemented("create volumes"))
    }
    /// Deletes a volume; an absent volume is success.
    async fn delete_volume(&self, _id: &VolumeId) -> Result<()> {
        Err(self.unimplemented("delete volumes"))
    }
    /// Looks a volume up; `None` when it does not exist.
    async fn get_volume(&self, _id: &VolumeId) -> Result<Option<VolumeInfo>> {
        Err(self.unimplemented("look up volumes"))
    }
    /// Every volume, in a stable order (ids ascending).
    async fn list_volumes(&self) -> Result<Vec<VolumeInfo>> {
        Err(self.unimplemented("list volumes"))
    }
    /// Free capacity for new volumes with these parameters.
    async fn capacity(&self, _parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        Err(self.unimplemented("report capacity"))
    }
    /// Grows a volume to at least `required` bytes (never above `limit` when
    /// it is non-zero). Returns the new size.
    async fn expand_volume(&self, _id: &VolumeId, _required: u64, _limit: u64) -> Result<u64> {
        Err(self.unimplemented("expand volumes"))
    }
    /// Cuts a snapshot named `name` of `source`, or returns the existing one.
    async fn create_snapshot(&self, _source: &VolumeId, _name: &str) -> Result<SnapshotInfo> {
        Err(self.unimplemented("take snapshots"))
    }
    /// Deletes a snapshot; an absent snapshot is success.
    async fn delete_snapshot(&self, _id: &SnapshotId) -> Result<()> {
        Err(self.unimplemented("delete snapshots"))
    }
    /// Every snapshot, in a stable order (ids ascending).
    async fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        Err(self.unimplemented("list snapshots"))
    }
    /// Makes a volume reachable from a node (ControllerPublish).
    async fn controller_attach(
        &self,
        _id: &VolumeId,
        _node_id: &str,
        _readonly: bool,
    ) -> Result<BTreeMap<String, String>> {
        Err(self.unimplemented("attach volumes to nodes"))
    }
    /// Reverses [`Backend::controller_attach`]; idempotent.
    async fn controller_detach(&self, _id: &VolumeId, _node_id: Option<&str>) -> Result<()> {
        Err(self.unimplemented("detach volumes from nodes"))
    }

    // ---- node ----

    /// Makes the volume's data reachable on this node: a block device to
    /// format and mount, or a remote filesystem to mount.
    async fn node_attach(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<Attachment> {
        Err(self.unimplemented("attach volumes on the node"))
    }
    /// Releases what [`Backend::node_attach`] set up; idempotent. With no
    /// attachment (a stage interrupted before it was recorded) the backend
    /// releases whatever it may have set up for this volume.
    async fn node_detach(&self, _id: &VolumeId, _attachment: Option<&Attachment>) -> Result<()> {
        Err(self.unimplemented("detach volumes on the node"))
    }
    /// After the volume grew: makes the node's device see the new size.
    /// Returns the device's size in bytes.
    async fn node_refresh_size(&self, _id: &VolumeId, _attachment: &Attachment) -> Result<u64> {
        Err(self.unimplemented("expand volumes on the node"))
    }
    /// Whether what [`Backend::node_attach`] set up is still healthy.
    async fn node_condition(
        &self,
        _id: &VolumeId,
        _attachment: &Attachment,
    ) -> Result<Option<String>> {
        Ok(None)
    }

    /// The error for an operation this backend does not offer.
    fn unimplemented(&self, what: &str) -> Error {
        Error::unimplemented(format!("backend {} cannot {what}", self.name()))
    }
}

impl std::fmt::Debug for dyn Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Backend({})", self.name())
    }
}
