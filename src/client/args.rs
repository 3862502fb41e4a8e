//! The client's command line: its calls and their arguments, as clap
//! reads them.

use super::*;

/// Serializes a snapshot's creation time as `seconds.nanos`.
pub fn timestamp<S: serde::Serializer>(
    t: &Option<prost_types::Timestamp>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(&format!("{}.{:09}", t.seconds, t.nanos)),
        None => s.serialize_none(),
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

#[derive(ClapArgs)]
pub struct Args {
    /// The driver: unix:///path/csi.sock or tcp://host:port.
    #[arg(
        long,
        env = "CSI_ENDPOINT",
        default_value = "unix:///run/ferrovol/csi.sock"
    )]
    pub endpoint: String,
    /// How answers are printed.
    #[arg(long, value_enum, default_value = "text")]
    pub output: Output,
    /// Secrets for the call: a JSON object, or `key=value` / `key: value`
    /// lines. Never printed.
    #[arg(long)]
    pub secrets_file: Option<PathBuf>,
    /// Seconds a call may take.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    #[command(subcommand)]
    pub call: Call,
}

/// A volume capability from flags.
#[derive(ClapArgs, Clone)]
pub struct Cap {
    /// A raw block volume (default: a mounted filesystem).
    #[arg(long)]
    pub block: bool,
    /// The filesystem of a mounted volume (empty: the driver's default).
    #[arg(long, default_value = "")]
    pub fs_type: String,
    /// A mount flag (repeatable).
    #[arg(long = "mount-flag")]
    pub mount_flags: Vec<String>,
    #[arg(long, value_enum, default_value = "single-node-writer")]
    pub mode: Mode,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Mode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

impl Cap {
    pub(super) fn build(&self) -> pb::VolumeCapability {
        use vc::access_mode::Mode as M;
        let mode = match self.mode {
            Mode::SingleNodeWriter => M::SingleNodeWriter,
            Mode::SingleNodeReaderOnly => M::SingleNodeReaderOnly,
            Mode::MultiNodeReaderOnly => M::MultiNodeReaderOnly,
            Mode::MultiNodeSingleWriter => M::MultiNodeSingleWriter,
            Mode::MultiNodeMultiWriter => M::MultiNodeMultiWriter,
            Mode::SingleNodeSingleWriter => M::SingleNodeSingleWriter,
            Mode::SingleNodeMultiWriter => M::SingleNodeMultiWriter,
        };
        pb::VolumeCapability {
            access_type: Some(if self.block {
                vc::AccessType::Block(vc::BlockVolume {})
            } else {
                vc::AccessType::Mount(vc::MountVolume {
                    fs_type: self.fs_type.clone(),
                    mount_flags: self.mount_flags.clone(),
                    ..Default::default()
                })
            }),
            access_mode: Some(vc::AccessMode { mode: mode as i32 }),
        }
    }
}

/// `key=value`.
#[derive(Clone, Debug)]
pub struct Kv(pub String, pub String);

impl std::str::FromStr for Kv {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.split_once('=')
            .map(|(k, v)| Kv(k.to_string(), v.to_string()))
            .ok_or_else(|| format!("{s:?} is not key=value"))
    }
}

pub(super) fn map(kvs: &[Kv]) -> HashMap<String, String> {
    kvs.iter().map(|Kv(k, v)| (k.clone(), v.clone())).collect()
}

/// Bytes, with an optional K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti
/// (powers of 1024) suffix.
#[derive(Clone, Copy, Debug)]
pub struct Size(pub i64);

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let digits = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
        let unit = &s[digits.len()..];
        let n: i64 = digits.parse().map_err(|_| format!("{s:?} is not a size"))?;
        let m: i64 = match unit {
            "" => 1,
            "K" => 1000,
            "M" => 1000_i64.pow(2),
            "G" => 1000_i64.pow(3),
            "T" => 1000_i64.pow(4),
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            "Ti" => 1 << 40,
            _ => return Err(format!("{s:?}: unknown unit {unit:?}")),
        };
        n.checked_mul(m)
            .map(Size)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

pub(super) fn range(size: Option<Size>, limit: Option<Size>) -> Option<pb::CapacityRange> {
    (size.is_some() || limit.is_some()).then(|| pb::CapacityRange {
        required_bytes: size.map_or(0, |s| s.0),
        limit_bytes: limit.map_or(0, |s| s.0),
    })
}

/// `key=value,key=value`: one topology segment set.
#[derive(Clone, Debug)]
pub struct Topo(pub HashMap<String, String>);

impl std::str::FromStr for Topo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.split(',')
            .map(|p| p.parse::<Kv>().map(|Kv(k, v)| (k, v)))
            .collect::<Result<_, _>>()
            .map(Topo)
    }
}

/// The arguments of `create-volume`.
#[derive(ClapArgs)]
pub struct CreateArgs {
    pub(super) name: String,
    #[arg(long)]
    pub(super) size: Option<Size>,
    #[arg(long)]
    pub(super) limit: Option<Size>,
    #[command(flatten)]
    pub(super) cap: Cap,
    /// A StorageClass parameter (repeatable).
    #[arg(long = "param")]
    pub(super) params: Vec<Kv>,
    #[arg(long, conflicts_with = "from_volume")]
    pub(super) from_snapshot: Option<String>,
    #[arg(long)]
    pub(super) from_volume: Option<String>,
    /// A requisite topology segment set, key=value,... (repeatable).
    #[arg(long)]
    pub(super) requisite: Vec<Topo>,
    /// A preferred topology segment set (repeatable).
    #[arg(long)]
    pub(super) preferred: Vec<Topo>,
    /// Mutable parameters (repeatable key=value).
    #[arg(long = "mutable-param")]
    pub(super) mutable: Vec<Kv>,
}

#[derive(Subcommand)]
pub enum Call {
    #[command(flatten)]
    Identity(IdentityCall),
    #[command(flatten)]
    Controller(ControllerCall),
    #[command(flatten)]
    Group(GroupCall),
    #[command(flatten)]
    Metadata(MetadataCall),
    #[command(flatten)]
    Node(NodeCall),
    /// Drives one volume through its whole life on this node (create,
    /// stage, publish, write, expand, snapshot, restore, unpublish,
    /// unstage, delete), printing each step. Run it as root on the driver's
    /// node.
    Lifecycle {
        /// Holds the staging and target paths.
        #[arg(long, default_value = "/var/tmp/ferrovol-lifecycle")]
        work: PathBuf,
    },
}

/// The Identity service's calls.
#[derive(Subcommand)]
pub enum IdentityCall {
    /// GetPluginInfo.
    PluginInfo,
    /// GetPluginCapabilities.
    PluginCapabilities,
    /// Probe.
    Probe,
}

/// The Controller service's calls.
#[derive(Subcommand)]
pub enum ControllerCall {
    /// CreateVolume.
    CreateVolume(CreateArgs),
    /// DeleteVolume.
    DeleteVolume { id: String },
    /// ControllerPublishVolume.
    ControllerPublish {
        id: String,
        #[arg(long)]
        node: String,
        #[command(flatten)]
        cap: Cap,
        #[arg(long)]
        readonly: bool,
        /// Volume context (repeatable key=value).
        #[arg(long = "context")]
        context: Vec<Kv>,
    },
    /// ControllerUnpublishVolume (all nodes without --node).
    ControllerUnpublish {
        id: String,
        #[arg(long)]
        node: Option<String>,
    },
    /// ValidateVolumeCapabilities.
    ValidateCapabilities {
        id: String,
        #[command(flatten)]
        cap: Cap,
        #[arg(long = "context")]
        context: Vec<Kv>,
        #[arg(long = "param")]
        params: Vec<Kv>,
    },
    /// ListVolumes (one page).
    ListVolumes {
        #[arg(long, default_value_t = 0)]
        max_entries: i32,
        #[arg(long, default_value = "")]
        starting_token: String,
    },
    /// GetCapacity.
    GetCapacity {
        #[arg(long = "param")]
        params: Vec<Kv>,
        #[arg(long)]
        topology: Option<Topo>,
    },
    /// ControllerGetCapabilities.
    ControllerCapabilities,
    /// CreateSnapshot.
    CreateSnapshot {
        name: String,
        #[arg(long)]
        source: String,
        #[arg(long = "param")]
        params: Vec<Kv>,
    },
    /// DeleteSnapshot.
    DeleteSnapshot { id: String },
    /// ListSnapshots (one page).
    ListSnapshots {
        #[arg(long, default_value = "")]
        snapshot_id: String,
        #[arg(long, default_value = "")]
        source: String,
        #[arg(long, default_value_t = 0)]
        max_entries: i32,
        #[arg(long, default_value = "")]
        starting_token: String,
    },
    /// GetSnapshot.
    GetSnapshot { id: String },
    /// ControllerExpandVolume.
    ControllerExpand {
        id: String,
        #[arg(long)]
        size: Size,
        #[arg(long)]
        limit: Option<Size>,
    },
    /// ControllerGetVolume.
    GetVolume { id: String },
    /// ControllerModifyVolume.
    ModifyVolume {
        id: String,
        #[arg(long = "mutable-param")]
        mutable: Vec<Kv>,
    },
    /// ControllerGetVolumeHealth: what is wrong with a volume, as the
    /// controller reaches its storage.
    VolumeHealth { id: String },
    /// ControllerListVolumeHealth (one page): the volumes with something
    /// wrong.
    ListVolumeHealth {
        #[arg(long, default_value_t = 0)]
        max_entries: i32,
        #[arg(long, default_value = "")]
        starting_token: String,
    },
}

/// The GroupController service's calls.
#[derive(Subcommand)]
pub enum GroupCall {
    /// CreateVolumeGroupSnapshot: the sources' snapshots at one instant.
    CreateGroupSnapshot {
        name: String,
        /// A source volume id (repeatable; at least one).
        #[arg(long = "source", required = true)]
        sources: Vec<String>,
        #[arg(long = "param")]
        params: Vec<Kv>,
    },
    /// DeleteVolumeGroupSnapshot (the group and its members).
    DeleteGroupSnapshot {
        id: String,
        /// A member snapshot id (repeatable; checked against the group).
        #[arg(long = "snapshot")]
        snapshots: Vec<String>,
    },
    /// GetVolumeGroupSnapshot.
    GetGroupSnapshot {
        id: String,
        #[arg(long = "snapshot")]
        snapshots: Vec<String>,
    },
    /// GroupControllerGetCapabilities.
    GroupCapabilities,
}

/// The SnapshotMetadata service's calls (streams, read whole).
#[derive(Subcommand)]
pub enum MetadataCall {
    /// GetMetadataAllocated: the ranges of a snapshot that hold data.
    Allocated {
        snapshot: String,
        #[arg(long, default_value_t = 0)]
        starting_offset: i64,
        #[arg(long, default_value_t = 0)]
        max_results: i32,
    },
    /// GetMetadataDelta: the ranges that changed from BASE to TARGET.
    Delta {
        base: String,
        target: String,
        #[arg(long, default_value_t = 0)]
        starting_offset: i64,
        #[arg(long, default_value_t = 0)]
        max_results: i32,
    },
    /// A backup image by changed block tracking. Without --base: the
    /// snapshot's allocated ranges, read from DATA (the snapshot's bytes: a
    /// volume restored from it, attached as a block device), written into
    /// a new OUT. With --base: the ranges that changed since BASE, read
    /// from DATA, written over OUT (which holds BASE's image). OUT ends as
    /// large as the snapshot.
    Backup {
        snapshot: String,
        #[arg(long)]
        data: std::path::PathBuf,
        #[arg(long)]
        out: std::path::PathBuf,
        #[arg(long)]
        base: Option<String>,
    },
}

/// The Node service's calls.
#[derive(Subcommand)]
pub enum NodeCall {
    /// NodeStageVolume.
    Stage {
        id: String,
        #[arg(long)]
        staging: String,
        #[command(flatten)]
        cap: Cap,
        #[arg(long = "publish-context")]
        publish_context: Vec<Kv>,
        #[arg(long = "context")]
        context: Vec<Kv>,
    },
    /// NodeUnstageVolume.
    Unstage {
        id: String,
        #[arg(long)]
        staging: String,
    },
    /// NodePublishVolume.
    Publish {
        id: String,
        #[arg(long)]
        target: String,
        #[arg(long, default_value = "")]
        staging: String,
        #[command(flatten)]
        cap: Cap,
        #[arg(long)]
        readonly: bool,
        #[arg(long = "publish-context")]
        publish_context: Vec<Kv>,
        #[arg(long = "context")]
        context: Vec<Kv>,
    },
    /// NodeUnpublishVolume.
    Unpublish {
        id: String,
        #[arg(long)]
        target: String,
    },
    /// NodeGetVolumeHealth: what is wrong with a volume, as this node
    /// sees it.
    NodeVolumeHealth {
        id: String,
        #[arg(long, default_value = "")]
        path: String,
        #[arg(long, default_value = "")]
        staging: String,
    },
    /// NodeGetStorageHealth: each backend, as this node sees it.
    StorageHealth,
    /// NodeGetVolumeStats.
    Stats {
        id: String,
        #[arg(long)]
        path: String,
        #[arg(long, default_value = "")]
        staging: String,
    },
    /// NodeExpandVolume.
    NodeExpand {
        id: String,
        #[arg(long)]
        path: String,
        #[arg(long, default_value = "")]
        staging: String,
        #[arg(long)]
        size: Size,
    },
    /// NodeGetCapabilities.
    NodeCapabilities,
    /// NodeGetInfo.
    NodeInfo,
}
