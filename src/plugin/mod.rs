//! The plugin layer, after Kubernetes' volume plugin framework: backends
//! declare what they can do, a [`Registry`] finds them by name or by volume
//! id, and the CSI services speak to them only through [`Backend`]. Backends
//! know nothing of gRPC.

mod attached;
pub mod controller;
mod fields;
mod groups;
mod registry;
mod secrets;
mod sizing;
mod types;

pub use crate::id::{
    digest_hex, is_dns_label, is_locator, locator_for_name, validate_name, GroupSnapshotId,
    SnapshotId, VolumeId, MAX_ID_LEN, MAX_LOCATOR_LEN,
};
pub use attached::Ledger;
pub use controller::ControllerOps;
pub use fields::{join_fields, split_fields};
pub use groups::GroupStore;
pub use registry::Registry;
pub use secrets::Secrets;
pub use sizing::{check_existing, own_source, round_up, SizeRules};
pub use types::*;

/// The node's name in a node id (`<name>` or `<name>/<suffix>`): the
/// topology value, and what node-local volumes are compared with.
pub fn node_name(node_id: &str) -> &str {
    node_id.split_once('/').map_or(node_id, |(n, _)| n)
}

/// A mutable parameter that is `true` or `false`: its value, if given;
/// INVALID_ARGUMENT naming it otherwise.
pub fn mutable_bool(changes: &BTreeMap<String, String>, key: &str) -> Result<Option<bool>> {
    match changes.get(key).map(String::as_str) {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(v) => Err(Error::invalid(format!(
            "mutable parameter {key}: {v:?} is not true or false"
        ))),
    }
}

/// The tokens of a node id: `<name>/<token>,<token>...`, what the node's
/// attaching backends told controllers about it (see
/// [`Backend::node_id_suffix`]).
pub fn node_tokens(node_id: &str) -> impl Iterator<Item = &str> {
    node_id
        .split_once('/')
        .map_or("", |(_, s)| s)
        .split(',')
        .filter(|t| !t.is_empty())
}

/// Whether a token is an iSCSI name (RFC 3720: `iqn.`, `eui.`, `naa.`).
pub fn is_iscsi_name(token: &str) -> bool {
    ["iqn.", "eui.", "naa."]
        .iter()
        .any(|p| token.starts_with(p))
}

/// The node's iSCSI initiator name, when its node id carries one.
pub fn node_initiator(node_id: &str) -> Option<&str> {
    node_tokens(node_id).find(|t| is_iscsi_name(t))
}

/// The filesystems a block backend formats, grows and mounts.
/// The publish-context key ControllerPublish sets for a read-only publish
/// (its `readonly` flag, which backends do not see as a key of their own):
/// the node stages and publishes such a volume read-only.
pub const CTX_READONLY: &str = "readonly";

/// Whether a publish context (any map type) is a read-only publish's.
pub fn published_read_only<'a>(get: impl FnOnce(&str) -> Option<&'a String>) -> bool {
    get(CTX_READONLY).is_some_and(|v| v == "true")
}

pub const BLOCK_FS_TYPES: &[&str] = &["ext4", "ext3", "xfs", "btrfs"];

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

    /// Once before the driver serves: lets go of what an earlier run of
    /// this backend left for itself (a killed driver's working mounts).
    async fn start(&self) -> Result<()> {
        Ok(())
    }

    /// Once after the driver stopped serving and its calls are done:
    /// releases what the backend holds for itself (working mounts).
    async fn stop(&self) {}

    /// The nodes (by name) each of this backend's volumes is attached to,
    /// as the backend's own storage records its grants; asked once at a
    /// controller's start, so that a controller replaced on another node
    /// counts what its predecessor granted. `None`: the backend cannot
    /// say (it needs a call's secrets to look) or attaches nothing.
    async fn grants(&self) -> Result<Option<Vec<(VolumeId, String)>>> {
        Ok(None)
    }

    /// What this node must tell controllers about itself for this backend
    /// (an iSCSI initiator name; `rbd` for a node that maps rbd images),
    /// carried in the node id after the node's name as one of
    /// `<name>/<token>,<token>`: a controller publishes a volume only to a
    /// node whose id says it can take it (NOT_FOUND otherwise). Asked once,
    /// at start, on nodes. A token has no `,` or `/`.
    fn node_id_suffix(&self) -> Result<Option<String>> {
        Ok(None)
    }

    /// The kind of device a stage of this backend's volumes attaches on
    /// the node, one per volume; `None` for none (a remote filesystem) or
    /// one the kernel sets no count on (an LV). NodeGetInfo's volume count
    /// is bounded by the room left for each kind the node's backends use.
    fn node_device(&self) -> Option<crate::host::devices::DeviceKind> {
        None
    }

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
        if let AccessType::Mount { fs_type, .. } = &capability.access {
            if !fs_type.is_empty() && !self.fs_types().contains(&fs_type.as_str()) {
                return Err(Error::invalid(format!(
                    "backend {} does not serve fs_type {fs_type:?} (it serves: {})",
                    self.name(),
                    self.fs_types().join(", ")
                )));
            }
        }
        Ok(())
    }

    /// The fs types a mount capability may name for this backend; the
    /// first is used when a capability names none. Block backends format
    /// devices with one of [`BLOCK_FS_TYPES`]; a remote filesystem backend
    /// names its own (`nfs`, `nfs4`).
    fn fs_types(&self) -> &'static [&'static str] {
        BLOCK_FS_TYPES
    }

    /// The id a CreateVolume request names, worked out before anything is
    /// made, so the operation guard can cover it (a delete of the same id
    /// must wait for the create to finish). The default: the backend's name
    /// and the locator of the CSI name.
    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        VolumeId::new(self.name(), &locator_for_name(&req.name))
    }

    /// The id a CreateSnapshot request names (see [`Backend::volume_id_for`]).
    fn snapshot_id_for(&self, req: &CreateSnapshot) -> Result<SnapshotId> {
        SnapshotId::new(self.name(), &locator_for_name(&req.name))
    }

    /// Checks CreateSnapshot parameters meant for this backend (the CO's
    /// own keys are taken out first). By default a backend takes none.
    fn validate_snapshot_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        match parameters.keys().next() {
            Some(key) => Err(Error::invalid(format!(
                "backend {} takes no snapshot parameter {key:?}",
                self.name()
            ))),
            None => Ok(()),
        }
    }

    /// For [`GroupSnapshots::Cut`]: cuts, at one instant, what each
    /// member's `create_snapshot` then makes its snapshot from.
    async fn cut_group(&self, _members: &[CreateSnapshot]) -> Result<()> {
        Err(self.unimplemented("cut group snapshots"))
    }

    /// Removes what [`Backend::cut_group`] cut that no member's snapshot
    /// took over (a group that failed); idempotent.
    async fn uncut_group(&self, _members: &[CreateSnapshot]) -> Result<()> {
        Ok(())
    }

    /// Why this backend takes no group snapshots (FAILED_PRECONDITION).
    fn group_snapshot_refusal(&self) -> String {
        format!(
            "backend {} cannot snapshot volumes together at one instant",
            self.name()
        )
    }

    /// The mutable parameters of this backend's volumes: the keys a
    /// VolumeAttributesClass may set (CreateVolume's `mutable_parameters`)
    /// and ControllerModifyVolume may change. None by default.
    fn mutable_keys(&self) -> Vec<&'static str> {
        Vec::new()
    }

    /// Checks the values of mutable parameters whose keys are among
    /// [`Backend::mutable_keys`], before anything is made or changed:
    /// INVALID_ARGUMENT naming the first key whose value is not valid.
    fn check_mutable(&self, _changes: &BTreeMap<String, String>) -> Result<()> {
        Ok(())
    }

    /// Applies checked mutable parameters to a volume: every one or none
    /// (what cannot be done is found before anything is changed, and is
    /// INVALID_ARGUMENT naming its key); a value the volume has already is
    /// no change. The volume's recorded parameters follow.
    async fn modify_volume(
        &self,
        _id: &VolumeId,
        _changes: &BTreeMap<String, String>,
        _secrets: &Secrets,
    ) -> Result<()> {
        Err(self.unimplemented("modify volumes"))
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
    async fn delete_volume(&self, _id: &VolumeId, _secrets: &Secrets) -> Result<()> {
        Err(self.unimplemented("delete volumes"))
    }
    /// Looks a volume up with the call's secrets (none for
    /// ControllerGetVolume); `None` when it does not exist.
    async fn get_volume(&self, _id: &VolumeId, _secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        Err(self.unimplemented("look up volumes"))
    }
    /// One page of volumes: those whose locator sorts after `page.after`,
    /// ascending, at most `page.limit`. A page costs what its entries cost,
    /// not what the whole pool costs, where the backend's storage allows.
    async fn list_volumes(&self, _page: &Page) -> Result<Vec<VolumeInfo>> {
        Err(self.unimplemented("list volumes"))
    }
    /// Free capacity for new volumes with these parameters.
    async fn capacity(&self, _parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        Err(self.unimplemented("report capacity"))
    }
    /// Grows a volume to at least `required` bytes (never above `limit` when
    /// it is non-zero). Returns the new size.
    async fn expand_volume(
        &self,
        _id: &VolumeId,
        _required: u64,
        _limit: u64,
        _secrets: &Secrets,
    ) -> Result<u64> {
        Err(self.unimplemented("expand volumes"))
    }
    /// Cuts a snapshot of `req.source`, or returns the existing one of the
    /// same name (ALREADY_EXISTS when it has another source).
    async fn create_snapshot(&self, _req: &CreateSnapshot) -> Result<SnapshotInfo> {
        Err(self.unimplemented("take snapshots"))
    }
    /// Deletes a snapshot; an absent snapshot is success.
    async fn delete_snapshot(&self, _id: &SnapshotId, _secrets: &Secrets) -> Result<()> {
        Err(self.unimplemented("delete snapshots"))
    }
    /// Looks a snapshot up; `None` when it does not exist. `secrets` are
    /// the call's (empty when the call carries none).
    async fn get_snapshot(
        &self,
        _id: &SnapshotId,
        _secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        Err(self.unimplemented("look up snapshots"))
    }
    /// One page of snapshots (see [`Backend::list_volumes`]), only those of
    /// `source` when it is given.
    async fn list_snapshots(
        &self,
        _source: Option<&VolumeId>,
        _page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        Err(self.unimplemented("list snapshots"))
    }
    /// Makes a volume reachable from a node (ControllerPublish). Returns the
    /// publish context the node's stage receives.
    async fn controller_attach(
        &self,
        _id: &VolumeId,
        _req: &ControllerAttach,
    ) -> Result<BTreeMap<String, String>> {
        Err(self.unimplemented("attach volumes to nodes"))
    }
    /// Reverses [`Backend::controller_attach`]; idempotent.
    async fn controller_detach(
        &self,
        _id: &VolumeId,
        _node_id: Option<&str>,
        _secrets: &Secrets,
    ) -> Result<()> {
        Err(self.unimplemented("detach volumes from nodes"))
    }

    // ---- node ----

    /// Makes the volume's data reachable on this node: a block device to
    /// format and mount, or a remote filesystem to mount.
    async fn node_attach(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<Attachment> {
        Err(self.unimplemented("attach volumes on the node"))
    }
    /// Whether the volume is a copy (a restored snapshot, a clone) whose
    /// filesystem still carries its source's UUID. The node gives it its
    /// own before its first mount: the kernel refuses a second xfs with
    /// one UUID, and btrfs confuses two devices with one fsid.
    /// `ctx` is the stage's: a backend whose copies live behind a
    /// controller (iscsi) learns it from the publish context.
    async fn node_copy_pending(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<bool> {
        Ok(false)
    }
    /// Records that the copy's filesystem has its own UUID now.
    async fn node_copy_done(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<()> {
        Ok(())
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

    /// Changed block tracking: the ranges of `snapshot` that hold data,
    /// from `start` (rounded down to the backend's granularity), at most
    /// `max` of them.
    async fn allocated_blocks(
        &self,
        _snapshot: &SnapshotId,
        _start: u64,
        _max: usize,
        _secrets: &Secrets,
    ) -> Result<BlockPage> {
        Err(Error::precondition(format!(
            "backend {} has no changed block tracking",
            self.name()
        )))
    }

    /// Changed block tracking: the ranges where `target` differs from
    /// `base`, an earlier snapshot of the same volume, from `start`, at
    /// most `max` of them.
    async fn changed_blocks(
        &self,
        _base: &SnapshotId,
        _target: &SnapshotId,
        _start: u64,
        _max: usize,
        _secrets: &Secrets,
    ) -> Result<BlockPage> {
        Err(Error::precondition(format!(
            "backend {} has no changed block tracking",
            self.name()
        )))
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
