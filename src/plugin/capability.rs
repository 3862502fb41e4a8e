//! What a backend can do, one trait per capability (after Kubernetes'
//! volume plugin framework: a plugin *is* attachable because it implements
//! the attacher). A backend implements [`Backend`] and the capability
//! traits it offers, and names each in the matching accessor of
//! [`Backend`] (`fn provisioner(&self) -> Option<&dyn Provisioner> {
//! Some(self) }`): the accessor can only return what the type implements.
//! The plugin and service capabilities answered to the CO
//! ([`Capabilities`]) are derived from the accessors, and the CSI services
//! reach an operation only through its capability, so nothing declares one
//! thing and does another.

use super::health::Finding;
use super::types::*;
use super::{locator_for_name, Secrets, SnapshotId, VolumeId};
use crate::error::{Error, Result};
use std::collections::BTreeMap;

/// The access modes of volumes one node uses at a time.
pub const SINGLE_NODE_MODES: [AccessMode; 4] = [
    AccessMode::SingleNodeWriter,
    AccessMode::SingleNodeReaderOnly,
    AccessMode::SingleNodeSingleWriter,
    AccessMode::SingleNodeMultiWriter,
];

/// The filesystems a block backend formats, grows and mounts.
pub const BLOCK_FS_TYPES: &[&str] = &["ext4", "ext3", "xfs", "btrfs"];

/// A storage backend: its name, health and lifecycle, what volumes it
/// serves, and its capabilities (each `None` unless implemented).
#[async_trait::async_trait]
pub trait Backend: Send + Sync {
    /// The registered name: a lowercase DNS label, the prefix of its ids.
    fn name(&self) -> &str;

    /// Its kind: what its folder declares ([`super::Kind`]), read by the
    /// shared code (the parameters it takes, its mutable keys).
    fn kind(&self) -> &'static super::Kind;

    /// The StorageClass parameters it takes: its kind's, by default. The
    /// shared code refuses any other key before the backend sees the map.
    fn parameters(&self) -> Vec<&'static str> {
        self.kind().parameters.to_vec()
    }

    /// Whether the backend can serve requests now (its prerequisites on
    /// this node).
    async fn health(&self) -> Result<()>;

    /// Once before the driver serves: lets go of what an earlier run of
    /// this backend left for itself (a killed driver's working mounts).
    async fn start(&self) -> Result<()> {
        Ok(())
    }

    /// Once after the driver stopped serving and its calls are done:
    /// releases what the backend holds for itself (working mounts).
    async fn stop(&self) {}

    /// What is wrong with this backend as this node sees it, beyond not
    /// being ready ([`Backend::health`]): a pool nearly full, a path down
    /// (NodeGetStorageHealth). Asked through a book with a deadline.
    async fn storage_findings(&self) -> Vec<super::health::StorageFinding> {
        Vec::new()
    }

    /// The access modes this backend serves.
    fn access_modes(&self) -> Vec<AccessMode>;

    /// Whether volumes live on one node (they carry its topology segment).
    fn node_local(&self) -> bool {
        false
    }

    /// The fs types a mount capability may name for this backend; the
    /// first is used when a capability names none. Block backends format
    /// devices with one of [`BLOCK_FS_TYPES`]; a remote filesystem backend
    /// names its own (`nfs`, `nfs4`).
    fn fs_types(&self) -> &'static [&'static str] {
        BLOCK_FS_TYPES
    }

    /// Checks the values of StorageClass parameters meant for this backend:
    /// the shared code took out the `backend` key, `encrypted` and the CO's
    /// own `csi.storage.k8s.io/` keys, and refused any key not in
    /// [`Backend::parameters`], before. By default there is nothing to check.
    fn validate_parameters(&self, _parameters: &BTreeMap<String, String>) -> Result<()> {
        Ok(())
    }

    // ---- capabilities: each `Some(self)` where the type implements it ----

    /// Makes, deletes, looks up and lists volumes (CREATE_DELETE_VOLUME,
    /// LIST_VOLUMES, GET_CAPACITY).
    fn provisioner(&self) -> Option<&dyn Provisioner> {
        None
    }
    /// Grows volumes (EXPAND_VOLUME).
    fn expander(&self) -> Option<&dyn Expander> {
        None
    }
    /// Takes snapshots (CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS), and
    /// group snapshots as it says.
    fn snapshotter(&self) -> Option<&dyn Snapshotter> {
        None
    }
    /// Changes volumes' mutable parameters (MODIFY_VOLUME).
    fn modifier(&self) -> Option<&dyn Modifier> {
        None
    }
    /// Keeps the changes to its volumes' I/O limits with the volumes;
    /// `None`: the controller's limit book keeps them, in its state
    /// directory, where such a backend keeps its own records.
    fn limit_keeper(&self) -> Option<&dyn LimitKeeper> {
        None
    }
    /// Grants volumes to nodes (PUBLISH_UNPUBLISH_VOLUME).
    fn attacher(&self) -> Option<&dyn Attacher> {
        None
    }
    /// Makes volumes reachable on the node (NodeStage, NodeUnstage).
    fn stager(&self) -> Option<&dyn Stager> {
        None
    }
    /// Stages block devices, formatted and mounted once, or handed over
    /// raw (raw block volumes, node expansion).
    fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
        None
    }
    /// Changed block tracking (the SnapshotMetadata service).
    fn block_tracker(&self) -> Option<&dyn BlockTracker> {
        None
    }
    /// Volume health from the controller's side beyond "it exists"
    /// (ControllerGetVolumeHealth, ControllerListVolumeHealth). Without
    /// it, a provisioner's volumes are reported by whether they exist.
    fn health_reporter(&self) -> Option<&dyn HealthReporter> {
        None
    }
}

/// Why a backend cannot serve a volume capability. Each kind has one code
/// wherever it is found: a filesystem type the backend does not make or
/// mount is a bad request (INVALID_ARGUMENT) at CreateVolume, stage and
/// publish alike; an access type or mode it does not serve is
/// INVALID_ARGUMENT when a volume is asked for it, and FAILED_PRECONDITION
/// on the node, where the volume exists and does not have it (the spec's
/// "exceeds capabilities").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsupported {
    /// An access type (raw block) or access mode, and why.
    Access(String),
    /// A filesystem type, and the ones served.
    FsType(String),
}

impl Unsupported {
    /// As CreateVolume, ValidateVolumeCapabilities, ControllerPublish and
    /// expansion answer it.
    pub fn at_controller(self) -> Error {
        match self {
            Unsupported::Access(m) | Unsupported::FsType(m) => Error::invalid(m),
        }
    }

    /// As NodeStage and NodePublish answer it.
    pub fn at_node(self) -> Error {
        match self {
            Unsupported::Access(m) => Error::precondition(m),
            Unsupported::FsType(m) => Error::invalid(m),
        }
    }
}

impl std::fmt::Debug for dyn Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Backend({})", self.name())
    }
}

impl dyn Backend + '_ {
    /// Which access types and modes this backend can serve, and if not,
    /// why ([`Unsupported`]: its code is chosen once, by what is refused
    /// and where). It follows from what the backend implements: raw block
    /// from [`DeviceMounter`], the modes from [`Backend::access_modes`],
    /// the fs types from [`Backend::fs_types`]; a device's many writers
    /// are raw block's alone (a local filesystem on one device cannot be
    /// mounted by two nodes).
    pub fn supports(&self, capability: &VolumeCapability) -> std::result::Result<(), Unsupported> {
        let block = matches!(capability.access, AccessType::Block);
        let devices = self.device_mounter().is_some();
        if block && !devices {
            return Err(Unsupported::Access(format!(
                "backend {} does not serve raw block volumes",
                self.name()
            )));
        }
        if devices && !block && capability.mode == AccessMode::MultiNodeMultiWriter {
            return Err(Unsupported::Access(format!(
                "backend {} serves MULTI_NODE_MULTI_WRITER only for raw block volumes (a \
                 filesystem on one device cannot be mounted by two nodes)",
                self.name()
            )));
        }
        if !self.access_modes().contains(&capability.mode) {
            return Err(Unsupported::Access(format!(
                "backend {} does not support access mode {:?}",
                self.name(),
                capability.mode
            )));
        }
        if let AccessType::Mount { fs_type, .. } = &capability.access {
            if !fs_type.is_empty() && !self.fs_types().contains(&fs_type.as_str()) {
                return Err(Unsupported::FsType(format!(
                    "backend {} does not serve fs_type {fs_type:?} (it serves: {})",
                    self.name(),
                    self.fs_types().join(", ")
                )));
            }
        }
        Ok(())
    }

    /// What this backend can do, as the CO is told: derived from the
    /// capabilities it implements.
    pub fn capabilities(&self) -> Capabilities {
        let snapshotter = self.snapshotter();
        let expander = self.expander();
        Capabilities {
            provision: self.provisioner().is_some(),
            attach: self.attacher().is_some(),
            device_mount: self.device_mounter().is_some(),
            expand: expander.is_some(),
            expand_online: expander.is_some_and(|e| e.online()),
            snapshot: snapshotter.is_some(),
            group_snapshot: snapshotter.map_or(GroupSnapshots::None, |s| s.groups().mode()),
            snapshot_instant: snapshotter.map(|s| s.instant()).unwrap_or_default(),
            clone: self.provisioner().is_some_and(|p| p.clones()),
            block: self.device_mounter().is_some(),
            node_local: self.node_local(),
            access_modes: self.access_modes(),
            snapshot_metadata: self.block_tracker().is_some(),
        }
    }

    /// The error for an operation this backend does not offer.
    pub fn cannot(&self, what: &str) -> Error {
        Error::unimplemented(format!("backend {} cannot {what}", self.name()))
    }

    /// The provisioner, or UNIMPLEMENTED.
    pub fn provisioning(&self) -> Result<&dyn Provisioner> {
        self.provisioner()
            .ok_or_else(|| self.cannot("create volumes"))
    }

    /// The expander, or UNIMPLEMENTED.
    pub fn expanding(&self) -> Result<&dyn Expander> {
        self.expander().ok_or_else(|| self.cannot("expand volumes"))
    }

    /// The snapshotter, or UNIMPLEMENTED.
    pub fn snapshotting(&self) -> Result<&dyn Snapshotter> {
        self.snapshotter()
            .ok_or_else(|| self.cannot("take snapshots"))
    }

    /// The modifier, or UNIMPLEMENTED.
    pub fn modifying(&self) -> Result<&dyn Modifier> {
        self.modifier().ok_or_else(|| self.cannot("modify volumes"))
    }

    /// The attacher, or UNIMPLEMENTED.
    pub fn attaching(&self) -> Result<&dyn Attacher> {
        self.attacher()
            .ok_or_else(|| self.cannot("attach volumes to nodes"))
    }

    /// The stager, or UNIMPLEMENTED.
    pub fn staging(&self) -> Result<&dyn Stager> {
        self.stager()
            .ok_or_else(|| self.cannot("attach volumes on the node"))
    }

    /// The device mounter, or UNIMPLEMENTED.
    pub fn device_mounting(&self) -> Result<&dyn DeviceMounter> {
        self.device_mounter()
            .ok_or_else(|| self.cannot("stage block devices"))
    }

    /// The block tracker, or FAILED_PRECONDITION (the SnapshotMetadata
    /// service is there; this backend's snapshots have no block map).
    pub fn tracking_blocks(&self) -> Result<&dyn BlockTracker> {
        self.block_tracker().ok_or_else(|| {
            Error::precondition(format!(
                "backend {} has no changed block tracking",
                self.name()
            ))
        })
    }
}

/// Makes, deletes, looks up and lists volumes, and reports capacity.
#[async_trait::async_trait]
pub trait Provisioner: Backend {
    /// Whether a volume can be made from another volume (a clone).
    fn clones(&self) -> bool;

    /// The id a CreateVolume request names, worked out before anything is
    /// made, so the operation guard can cover it (a delete of the same id
    /// must wait for the create to finish). The default: the backend's name
    /// and the locator of the CSI name.
    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        VolumeId::new(self.name(), &locator_for_name(&req.name))
    }

    /// Creates a volume, or returns the existing one of the same name when
    /// it is compatible (ALREADY_EXISTS when it is not).
    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo>;

    /// Deletes a volume; an absent volume is success.
    async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()>;

    /// Looks a volume up with the call's secrets (none for
    /// ControllerGetVolume); `None` when it does not exist.
    async fn get_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<Option<VolumeInfo>>;

    /// One page of volumes: those whose locator sorts after `page.after`,
    /// ascending, at most `page.limit`. A page costs what its entries cost,
    /// not what the whole pool costs, where the backend's storage allows.
    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>>;

    /// Free capacity for new volumes with these parameters.
    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity>;
}

/// Grows volumes.
#[async_trait::async_trait]
pub trait Expander: Backend {
    /// Whether a volume grows while it is published. Without it, growing a
    /// volume in use is refused (FAILED_PRECONDITION) until it is not.
    fn online(&self) -> bool;

    /// Grows a volume to at least `required` bytes (never above `limit` when
    /// it is non-zero). Returns the new size.
    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        secrets: &Secrets,
    ) -> Result<u64>;
}

/// How a backend takes group snapshots (several volumes at one instant).
pub enum Groups<'a> {
    /// It cannot, and why (FAILED_PRECONDITION).
    Refused(String),
    /// One ordinary snapshot per member, the members' staged filesystems
    /// frozen together.
    Frozen,
    /// One ordinary snapshot per member, only while no member is staged.
    Unstaged,
    /// One ordinary snapshot per member, each from a cut the backend takes
    /// of all of them at once.
    Cut(&'a dyn GroupCutter),
}

impl Groups<'_> {
    /// The kind, as [`Capabilities`] states it.
    pub fn mode(&self) -> GroupSnapshots {
        match self {
            Groups::Refused(_) => GroupSnapshots::None,
            Groups::Frozen => GroupSnapshots::Frozen,
            Groups::Unstaged => GroupSnapshots::Unstaged,
            Groups::Cut(_) => GroupSnapshots::Cut,
        }
    }
}

/// Takes, deletes, looks up and lists snapshots.
#[async_trait::async_trait]
pub trait Snapshotter: Backend {
    /// What instant a snapshot of a volume in use shows.
    fn instant(&self) -> SnapshotInstant;

    /// How this backend takes group snapshots. By default it does not.
    fn groups(&self) -> Groups<'_> {
        Groups::Refused(format!(
            "backend {} cannot snapshot volumes together at one instant",
            self.name()
        ))
    }

    /// The id a CreateSnapshot request names (see
    /// [`Provisioner::volume_id_for`]).
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

    /// Cuts a snapshot of `req.source`, or returns the existing one of the
    /// same name (ALREADY_EXISTS when it has another source).
    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo>;

    /// Deletes a snapshot; an absent snapshot is success.
    async fn delete_snapshot(&self, id: &SnapshotId, secrets: &Secrets) -> Result<()>;

    /// Looks a snapshot up; `None` when it does not exist. `secrets` are
    /// the call's (empty when the call carries none).
    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>>;

    /// One page of snapshots (see [`Provisioner::list_volumes`]), only
    /// those of `source` when it is given.
    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>>;
}

/// Cuts several volumes at one instant, for a group snapshot.
#[async_trait::async_trait]
pub trait GroupCutter: Send + Sync {
    /// Cuts, at one instant, what each member's `create_snapshot` then
    /// makes its snapshot from.
    async fn cut_group(&self, members: &[CreateSnapshot]) -> Result<()>;

    /// Removes what [`GroupCutter::cut_group`] cut that no member's
    /// snapshot took over (a group that failed); idempotent. By default
    /// there is nothing to remove (each member's snapshot takes over its
    /// cut, or the cut leaves nothing behind).
    async fn uncut_group(&self, _members: &[CreateSnapshot]) -> Result<()> {
        Ok(())
    }
}

/// Changes volumes' mutable parameters.
#[async_trait::async_trait]
pub trait Modifier: Backend {
    /// The mutable parameters of this backend's volumes: the keys a
    /// VolumeAttributesClass may set (CreateVolume's `mutable_parameters`)
    /// and ControllerModifyVolume may change: its kind's, by default.
    fn mutable_keys(&self) -> Vec<&'static str> {
        self.kind().mutable.to_vec()
    }

    /// Checks the values of mutable parameters whose keys are among
    /// [`Modifier::mutable_keys`], before anything is made or changed:
    /// INVALID_ARGUMENT naming the first key whose value is not valid.
    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()>;

    /// Applies checked mutable parameters to a volume: every one or none
    /// (what cannot be done is found before anything is changed, and is
    /// INVALID_ARGUMENT naming its key); a value the volume has already is
    /// no change. The volume's recorded parameters follow.
    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        secrets: &Secrets,
    ) -> Result<()>;
}

/// Keeps the plugin layer's changes to a volume's I/O limits with the
/// volume, for a backend whose controller keeps no records of its own in
/// its state directory (which may be an emptyDir): the backend stores
/// them; it does not read them.
#[async_trait::async_trait]
pub trait LimitKeeper: Backend {
    /// The changes kept with volume `id` (none: empty); NOT_FOUND when
    /// the volume is not there.
    async fn kept_limits(
        &self,
        id: &VolumeId,
        secrets: &Secrets,
    ) -> Result<crate::host::iolimit::LimitChanges>;

    /// Keeps `changes` (all of them, replacing what was kept) with volume
    /// `id`.
    async fn keep_limits(
        &self,
        id: &VolumeId,
        changes: &crate::host::iolimit::LimitChanges,
        secrets: &Secrets,
    ) -> Result<()>;
}

/// Grants volumes to nodes (ControllerPublish), and tells controllers
/// from a node what it needs granted.
#[async_trait::async_trait]
pub trait Attacher: Backend {
    /// Makes a volume reachable from a node (ControllerPublish). Returns the
    /// publish context the node's stage receives.
    async fn controller_attach(
        &self,
        id: &VolumeId,
        req: &ControllerAttach,
    ) -> Result<BTreeMap<String, String>>;

    /// Reverses [`Attacher::controller_attach`]; idempotent.
    async fn controller_detach(
        &self,
        id: &VolumeId,
        node_id: Option<&str>,
        secrets: &Secrets,
    ) -> Result<()>;

    /// The nodes (by name) each of this backend's volumes is attached to,
    /// as the backend's own storage records its grants; asked once at a
    /// controller's start, so that a controller replaced on another node
    /// counts what its predecessor granted. `None`: the backend cannot
    /// say (it needs a call's secrets to look).
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
}

/// Makes volumes' data reachable on the node, and lets go of it.
#[async_trait::async_trait]
pub trait Stager: Backend {
    /// Makes the volume's data reachable on this node: a block device to
    /// format and mount, or a remote filesystem to mount.
    async fn node_attach(&self, id: &VolumeId, ctx: &AttachContext) -> Result<Attachment>;

    /// Releases what [`Stager::node_attach`] set up; idempotent. With no
    /// attachment (a stage interrupted before it was recorded) the backend
    /// releases whatever it may have set up for this volume.
    async fn node_detach(&self, id: &VolumeId, attachment: Option<&Attachment>) -> Result<()>;

    /// Before the filesystem staged on the attachment is unmounted at
    /// unstage: makes I/O that can never complete fail now (its storage is
    /// gone for good), so that the unmount does not wait on it. Nothing by
    /// default.
    async fn node_release_io(&self, _id: &VolumeId, _attachment: &Attachment) -> Result<()> {
        Ok(())
    }

    /// What is wrong with what [`Stager::node_attach`] set up, as this
    /// node sees it (empty: nothing known). Asked through a
    /// [`super::health::Book`], so it may take long without holding a call.
    async fn node_health(&self, _id: &VolumeId, _attachment: &Attachment) -> Result<Vec<Finding>> {
        Ok(Vec::new())
    }
}

/// Stages block devices: what the node does with one beyond attaching it.
#[async_trait::async_trait]
pub trait DeviceMounter: Stager {
    /// After the volume grew: makes the node's device see the new size.
    /// Returns the device's size in bytes.
    async fn node_refresh_size(&self, id: &VolumeId, attachment: &Attachment) -> Result<u64>;

    /// Whether the volume is a copy (a restored snapshot, a clone) whose
    /// filesystem still carries its source's UUID. The node gives it its
    /// own before its first mount: the kernel refuses a second xfs with
    /// one UUID, and btrfs confuses two devices with one fsid. `ctx` is
    /// the stage's: a backend whose copies live behind a controller
    /// (iscsi) learns it from the publish context.
    async fn node_copy_pending(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<bool> {
        Ok(false)
    }

    /// Records that the copy's filesystem has its own UUID now.
    async fn node_copy_done(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<()> {
        Ok(())
    }

    /// The kind of device a stage attaches, one per volume; `None` for one
    /// the kernel sets no count on (an LV; an iSCSI disk, whose sessions,
    /// hosts and disks are numbered without a ceiling). NodeGetInfo's
    /// volume count is bounded by the room left for each kind the node's
    /// backends use.
    fn node_device(&self) -> Option<crate::host::devices::DeviceClass> {
        None
    }
}

/// Says what is wrong with volumes as the controller reaches their storage
/// (v1.13's controller health calls). Every call is made through a
/// [`super::health::Book`] with a deadline: it may take long without
/// holding a call.
#[async_trait::async_trait]
pub trait HealthReporter: Provisioner {
    /// The volumes it knows of, in id order after `page.after`: healthy or
    /// not, one whose storage is gone included where the backend can
    /// (by default, what [`Provisioner::list_volumes`] shows).
    async fn known_volumes(&self, page: &Page) -> Result<Vec<VolumeId>> {
        Ok(self
            .list_volumes(page)
            .await?
            .into_iter()
            .map(|v| v.id)
            .collect())
    }

    /// What is wrong with one (empty: nothing known). One it does not
    /// know is [`super::health::Reason::VolumeNotFound`].
    async fn volume_health(&self, id: &VolumeId, secrets: &Secrets) -> Result<Vec<Finding>>;
}

/// Changed block tracking: which blocks of a snapshot hold data, and which
/// changed between two snapshots of a volume.
#[async_trait::async_trait]
pub trait BlockTracker: Backend {
    /// The ranges of `snapshot` that hold data, from `start` (rounded down
    /// to the backend's granularity), at most `max` of them.
    async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage>;

    /// The ranges where `target` differs from `base`, an earlier snapshot
    /// of the same volume, from `start`, at most `max` of them.
    async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage>;
}

/// What holds the writes of volumes staged on this node while a group's
/// snapshots are cut: the node service, for the controller's group
/// snapshots ([`crate::controller`]).
#[async_trait::async_trait]
pub trait Quiesce: Send + Sync {
    /// Freezes the filesystems of those of `volumes` staged here, all
    /// together; FAILED_PRECONDITION for one staged as a raw block device
    /// (nothing can hold its writes) unless `block_ok` (then it is left as
    /// it is), or for any staged one at all unless `staged_ok`.
    async fn freeze(
        &self,
        volumes: &[super::VolumeId],
        staged_ok: bool,
        block_ok: bool,
        deadline: std::time::Duration,
    ) -> crate::error::Result<crate::host::freeze::Frozen>;
}
