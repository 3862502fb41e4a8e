//! The plain types backends and services exchange.

use super::{GroupSnapshotId, Secrets, SnapshotId, VolumeId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::SystemTime;

/// What a backend can do, as derived from the capability traits it
/// implements (`<dyn Backend>::capabilities`); the services derive the CSI
/// capabilities they advertise from the union over all backends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// CreateVolume / DeleteVolume / ListVolumes / GetCapacity.
    pub provision: bool,
    /// ControllerPublish / ControllerUnpublish.
    pub attach: bool,
    /// NodeStage gives a block device, formatted and mounted once.
    pub device_mount: bool,
    /// ControllerExpand (and node filesystem growth).
    pub expand: bool,
    /// Expansion while the volume is published. Without it, expanding a
    /// volume in use is refused (FAILED_PRECONDITION) until it is not.
    pub expand_online: bool,
    /// CreateSnapshot / DeleteSnapshot / ListSnapshots, and volumes from them.
    pub snapshot: bool,
    /// Group snapshots, and how.
    pub group_snapshot: GroupSnapshots,
    /// What instant a snapshot of a volume in use shows.
    pub snapshot_instant: SnapshotInstant,
    /// Volumes cloned from volumes.
    pub clone: bool,
    /// Raw block access.
    pub block: bool,
    /// Volumes live on one node: they carry its topology segment.
    pub node_local: bool,
    /// The access modes this backend serves.
    pub access_modes: Vec<AccessMode>,
    /// Changed block tracking: which blocks of a snapshot hold data, which
    /// changed between two snapshots of a volume (the SnapshotMetadata
    /// service).
    pub snapshot_metadata: bool,
}

/// One page of a snapshot's block metadata (changed block tracking): byte
/// ranges in ascending order, none overlapping.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockPage {
    /// Every range is this many bytes (FIXED_LENGTH); None: each range its
    /// own length (VARIABLE_LENGTH).
    pub fixed: Option<u64>,
    /// The snapshot's size (the target's, for a delta).
    pub capacity: u64,
    /// (offset, length) of each range.
    pub ranges: Vec<(u64, u64)>,
    /// Where the next page starts; None: the last page.
    pub next: Option<u64>,
}

/// How the volume is consumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessType {
    Mount {
        fs_type: String,
        mount_flags: Vec<String>,
    },
    Block,
}

/// CSI access modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

impl AccessMode {
    /// Modes that forbid writes.
    pub fn is_readonly(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }
    /// The mode's name in publish terms and messages.
    pub fn name(self) -> &'static str {
        match self {
            AccessMode::SingleNodeWriter => "single_node_writer",
            AccessMode::SingleNodeReaderOnly => "single_node_reader_only",
            AccessMode::MultiNodeReaderOnly => "multi_node_reader_only",
            AccessMode::MultiNodeSingleWriter => "multi_node_single_writer",
            AccessMode::MultiNodeMultiWriter => "multi_node_multi_writer",
            AccessMode::SingleNodeSingleWriter => "single_node_single_writer",
            AccessMode::SingleNodeMultiWriter => "single_node_multi_writer",
        }
    }
    /// Modes that let more than one node use the volume at once.
    pub fn is_multi_node(self) -> bool {
        matches!(
            self,
            AccessMode::MultiNodeReaderOnly
                | AccessMode::MultiNodeSingleWriter
                | AccessMode::MultiNodeMultiWriter
        )
    }
    /// Modes that allow one publish of the volume on a node at a time:
    /// SINGLE_NODE_SINGLE_WRITER alone (Kubernetes' ReadWriteOncePod).
    /// Every other mode serves several targets on its node: Kubernetes
    /// reads SINGLE_NODE_WRITER (ReadWriteOnce) as "one node", whose pods
    /// may share the volume, and read-only modes harm nobody.
    pub fn is_one_publish(self) -> bool {
        self == AccessMode::SingleNodeSingleWriter
    }
}

/// A validated volume capability.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeCapability {
    pub access: AccessType,
    pub mode: AccessMode,
}

/// Where a new volume's content comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentSource {
    Snapshot(SnapshotId),
    Volume(VolumeId),
}

/// A CreateVolume request as a backend sees it.
#[derive(Debug, Clone)]
pub struct CreateVolume {
    pub name: String,
    /// Minimum size in bytes (0: backend default).
    pub required_bytes: u64,
    /// Maximum size in bytes (0: no limit).
    pub limit_bytes: u64,
    pub capabilities: Vec<VolumeCapability>,
    /// The backend's own parameters (the `backend` selector and the CO's
    /// `csi.storage.k8s.io/` keys are taken out).
    pub parameters: BTreeMap<String, String>,
    /// What the CO added with `--extra-create-metadata` (PVC name and
    /// namespace, PV name), for backends that name things after them.
    pub metadata: BTreeMap<String, String>,
    pub source: Option<ContentSource>,
    pub secrets: Secrets,
}

/// A CreateSnapshot request as a backend sees it.
#[derive(Debug, Clone)]
pub struct CreateSnapshot {
    pub source: VolumeId,
    pub name: String,
    /// The backend's own parameters (the CO's keys are taken out).
    pub parameters: BTreeMap<String, String>,
    /// What the CO added with `--extra-create-metadata`.
    pub metadata: BTreeMap<String, String>,
    pub secrets: Secrets,
}

/// A ControllerPublish request as a backend sees it.
#[derive(Debug, Clone)]
pub struct ControllerAttach {
    pub node_id: String,
    pub capability: VolumeCapability,
    pub readonly: bool,
    pub volume_context: BTreeMap<String, String>,
    pub secrets: Secrets,
}

impl ControllerAttach {
    /// What this publish promises the node: access mode, access type and
    /// whether it is read-only, as one string a backend keeps beside its
    /// record of the node. A later publish of the volume to the same node
    /// must ask for the same (see [`check_publish_terms`]).
    pub fn terms(&self) -> String {
        let access = match self.capability.access {
            AccessType::Block => "block",
            AccessType::Mount { .. } => "mount",
        };
        let rw = if self.readonly { "ro" } else { "rw" };
        format!("{}/{access}/{rw}", self.capability.mode.name())
    }
}

/// A publish to a node the volume is already published to: the same
/// terms are a repeat (OK), others are ALREADY_EXISTS (CSI: "published at
/// the node but incompatible with the volume_capability or readonly
/// flag"). `recorded` is `None` for records from before terms were kept.
pub fn check_publish_terms(
    id: &VolumeId,
    node: &str,
    recorded: Option<&str>,
    req: &ControllerAttach,
) -> crate::error::Result<()> {
    let asked = req.terms();
    match recorded {
        Some(had) if had != asked => Err(crate::error::Error::already_exists(format!(
            "volume {id} is published to node {node} as {had}; this publish asks for {asked}: \
             unpublish it first"
        ))),
        _ => Ok(()),
    }
}

/// Which page of a listing to return: entries whose locator sorts after
/// `after` (all when `None`), at most `limit` of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub after: Option<String>,
    pub limit: usize,
}

impl Page {
    /// Every entry.
    pub fn all() -> Self {
        Page {
            after: None,
            limit: usize::MAX,
        }
    }

    /// Whether `locator` belongs on this page's side of the cursor.
    pub fn admits(&self, locator: &str) -> bool {
        self.after.as_deref().is_none_or(|a| locator > a)
    }

    /// Sorts `items` by locator and keeps this page of them.
    pub fn apply<T>(&self, mut items: Vec<T>, locator: impl Fn(&T) -> &str) -> Vec<T> {
        items.retain(|i| self.admits(locator(i)));
        items.sort_by(|a, b| locator(a).cmp(locator(b)));
        items.truncate(self.limit);
        items
    }
}

/// A provisioned volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub id: VolumeId,
    pub capacity_bytes: u64,
    pub context: BTreeMap<String, String>,
    pub source: Option<ContentSource>,
}

/// A snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: SnapshotId,
    pub source_volume: VolumeId,
    pub size_bytes: u64,
    pub created: SystemTime,
    pub ready: bool,
    /// The group snapshot it was taken in, if any (the plugin layer, which
    /// keeps the groups, fills it in).
    pub group: Option<GroupSnapshotId>,
}

/// What a snapshot of a volume in use shows: one instant of it, or its
/// data copied over a while (a mix of before and after its writes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SnapshotInstant {
    /// No instant: the copy runs while the volume's writers go on (nothing
    /// the driver controls can hold them).
    #[default]
    Unheld,
    /// The backend's own snapshot is one instant of the device, as a power
    /// cut leaves it (crash-consistent).
    Own,
    /// The backend holds the volume's writers around its copy (every write
    /// acknowledged before is in it, none issued after): one instant of the
    /// device, crash-consistent.
    Held,
    /// The node freezes the volume's staged filesystem around the copy
    /// (its writes wait, its dirty data is written first): one instant,
    /// and a clean filesystem. A volume staged as a raw block device has
    /// nothing to freeze: its copy is not held.
    Frozen,
}

/// How a backend takes a group snapshot (several volumes at one instant).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GroupSnapshots {
    /// It cannot.
    #[default]
    None,
    /// One ordinary snapshot per member, taken while the node holds the
    /// members' writes (their staged filesystems frozen together).
    Frozen,
    /// One ordinary snapshot per member, taken only while no member is
    /// staged (nothing writes them): the backend's own snapshot must hold
    /// the device itself, which a frozen filesystem refuses (LVM suspends
    /// each origin, and before Linux 6.8 a filesystem frozen from
    /// userspace cannot be frozen again under it).
    Unstaged,
    /// One ordinary snapshot per member, each made from a point-in-time
    /// cut the backend takes of all of them at once
    /// ([`super::GroupCutter::cut_group`]).
    Cut,
}

/// Free space as a backend reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub available_bytes: u64,
    pub maximum_volume_bytes: Option<u64>,
    pub minimum_volume_bytes: Option<u64>,
}

/// What node attach gets from the request.
#[derive(Debug, Clone, Default)]
pub struct AttachContext {
    pub publish_context: BTreeMap<String, String>,
    pub volume_context: BTreeMap<String, String>,
    pub secrets: Secrets,
    pub readonly: bool,
    /// This node's id (as NodeGetInfo reports it).
    pub node_id: String,
}

/// What node attach set up, persisted in the node state so it can be undone
/// after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Attachment {
    /// A local block device (a loop device, an LV, an iSCSI LUN, an rbd map).
    Device { path: PathBuf },
    /// A filesystem mounted from elsewhere (NFS).
    Remote {
        source: String,
        fs_type: String,
        options: Vec<String>,
    },
}
