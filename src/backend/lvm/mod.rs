//! The `lvm` backend: node-local logical volumes. Each device class is a
//! volume group (optionally a thin pool in it); a volume is an LV named from
//! its CSI name, tagged so ferrovol only ever lists or touches its own LVs.
//!
//! Ids: `lvm:<class>.<lv>` for volumes and snapshots. LV names are `fv-`
//! plus the name's locator; snapshot LVs are `fvs-` plus theirs.
//!
//! Every lvm command runs through the exec seam with a timeout and JSON
//! reports (`--reportformat json`); lvm's warnings on stderr are never taken
//! for errors: only the exit status is.

use crate::config::Size;
use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner};
use crate::host::{Host, SystemHost};
use crate::plugin::{
    check_existing, digest_hex, is_dns_label, locator_for_name, own_source, round_up,
    AttachContext, Attachment, Backend, BlockPage, Capacity, ContentSource, CreateSnapshot,
    CreateVolume, Page, Secrets, SizeRules, SnapshotId, SnapshotInfo, VolumeId, VolumeInfo,
};
use crate::plugin::{
    AccessMode, BlockTracker, DeviceMounter, Expander, Groups, Modifier, Provisioner,
    SnapshotInstant, Snapshotter, Stager, SINGLE_NODE_MODES,
};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

const LVM_TIMEOUT: Duration = Duration::from_secs(120);
/// lvm's `locking_dir`, where its group locks are (its default; the
/// manifests mount the host's).
const LVM_LOCK_DIR: &str = "/run/lock/lvm";
const COPY_TIMEOUT: Duration = Duration::from_secs(3600);
/// Every LV ferrovol makes carries this tag.
const TAG: &str = "ferrovol";
/// The tag carrying the CSI name (or its digest).
const NAME_TAG: &str = "ferrovol-name:";
/// On an LV being deleted: its extents are being zeroed (a retried delete
/// zeroes again, so the extents never go back to the pool unwiped).
const DELETING_TAG: &str = "ferrovol-deleting";
/// How long a thick create trusts the extent size a read of its group
/// showed, and goes straight to lvcreate (a group's extent size changes
/// only by `vgchange -s`, and then only to one its LVs fit).
const FACTS_FRESH: Duration = Duration::from_secs(30);
/// Zeroing a whole LV takes a while on a big one.
const ZERO_TIMEOUT: Duration = Duration::from_secs(6 * 3600);
/// The device class an LV belongs to (classes may share a volume group).
const CLASS_TAG: &str = "ferrovol-class:";
/// On a snapshot: the volume it was taken from.
const SOURCE_TAG: &str = "ferrovol-source:";
/// On a snapshot: when it was cut (Unix seconds, the driver's clock just
/// before its lvcreate), so that CreateSnapshot answers its time without
/// reading the LV it made, and every later read answers the same.
/// Snapshots made before it have lvm's `lv_time` instead.
pub(super) const TIME_TAG: &str = "ferrovol-time:";
/// On a new, empty volume: its start is wiped at first attach.
const FRESH_TAG: &str = "ferrovol-fresh";
/// On a copy (restored snapshot, clone): its filesystem still has the
/// source's UUID; the node gives it its own at the first stage.
const COPY_TAG: &str = "ferrovol-copy";
/// On a copy lvcreate made and the driver has not finished (the source's
/// data or tags still to settle): a retry finishes it.
const FILLING_TAG: &str = "ferrovol-filling";
/// The StorageClass parameter that picks a device class.
pub const DEVICE_CLASS_PARAMETER: &str = "deviceClass";

/// The mutable parameter for an LV's read-ahead: `auto`, `none`, or a
/// count of 512-byte sectors, a multiple of 8 up to 65,536 (32 MiB).
pub const READ_AHEAD: &str = "readAhead";

/// `readAhead`'s value, as lvchange and lvs write it (`none` is 0).
fn read_ahead_value(changes: &BTreeMap<String, String>) -> Result<Option<String>> {
    let Some(v) = changes.get(READ_AHEAD) else {
        return Ok(None);
    };
    match v.as_str() {
        "auto" => Ok(Some("auto".into())),
        "none" | "0" => Ok(Some("0".into())),
        n => match n.parse::<u32>() {
            Ok(k) if k % 8 == 0 && (8..=65_536).contains(&k) => Ok(Some(k.to_string())),
            _ => Err(Error::invalid(format!(
                "mutable parameter {READ_AHEAD}: {v:?} is not auto, none, or a multiple of 8 \
                 sectors from 8 to 65536"
            ))),
        },
    }
}

/// `[[backend]] type = "lvm"` settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LvmSettings {
    /// The device class used when a StorageClass names none (default: the
    /// first).
    pub default_device_class: Option<String>,
    #[serde(rename = "device_class")]
    pub device_classes: Vec<DeviceClass>,
    /// Deactivate LVs at NodeUnstage (default true).
    #[serde(default = "yes")]
    pub deactivate_on_unstage: bool,
    /// Extra lvm configuration passed to every command with `--config`.
    #[serde(default)]
    pub lvm_config: String,
    /// lvm commands leave out the devices ferrovol's other backends attach
    /// on this node (iSCSI disks, rbd mappings, its dm-crypt maps): one
    /// whose portal or cluster does not answer would hold every lvm scan
    /// (default true). False for a volume group on such a device.
    #[serde(default = "yes")]
    pub skip_attached_devices: bool,
    /// Run lvm's commands in helper processes kept running, through
    /// liblvm2cmd (installed with lvm2), instead of starting lvm for
    /// each (default true; without the library, processes: see
    /// [`library`]).
    #[serde(default = "yes")]
    pub lvm_library: bool,
}

/// The lvm `devices` section that leaves out the devices `attached`
/// matches ([`LvmSettings::skip_attached_devices`]; each pattern matched
/// on any of a device's names: an iSCSI disk by its by-path link). None
/// when nothing is to be left out.
pub fn skip_filter(attached: &[&str]) -> Option<String> {
    if attached.is_empty() {
        return None;
    }
    let rules: Vec<String> = attached.iter().map(|p| format!("\"r|{p}|\"")).collect();
    Some(format!(
        "devices {{ global_filter = [ {} ] }}",
        rules.join(", ")
    ))
}

impl LvmSettings {
    /// The `--config` text every lvm command takes: the filter of what the
    /// driver attaches on the node (unless turned off, or the operator's
    /// own text has a `devices` section or sets a filter), then the
    /// operator's text. A single `devices/<key>=<value>` setting keeps the
    /// filter: a store's `devices/ignore_suspended_devices=1` (its owner's,
    /// see `as_store`) must not take away what keeps its scans off the
    /// nodes' network devices.
    pub fn config_text(&self, attached: &[&str]) -> String {
        let text = &self.lvm_config;
        let section = text
            .match_indices("devices")
            .any(|(i, w)| text[i + w.len()..].trim_start().starts_with('{'));
        let own_devices = section || text.contains("filter");
        let filter = skip_filter(attached).filter(|_| self.skip_attached_devices && !own_devices);
        match (filter, self.lvm_config.is_empty()) {
            (Some(f), true) => f,
            (Some(f), false) => format!("{f} {}", self.lvm_config),
            (None, _) => self.lvm_config.clone(),
        }
    }
}

fn yes() -> bool {
    true
}

/// One device class: a volume group, optionally a thin pool in it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceClass {
    pub name: String,
    pub volume_group: String,
    pub thin_pool: Option<String>,
    /// Size of a classic (COW) snapshot, as a percentage of its origin.
    #[serde(default = "default_snapshot_percent")]
    pub snapshot_size_percent: u64,
    /// Size of a volume whose request names none.
    #[serde(default = "default_size")]
    pub default_volume_size: Size,
    /// Zero a thick LV's extents before they go back to the volume group,
    /// and refuse thin pools that do not zero new chunks (default true).
    /// Turn it off only where the storage below zeroes freed space itself,
    /// or where LVs cannot be activated (a metadata-only test).
    #[serde(default = "zero_default")]
    pub zero_on_delete: bool,
}

fn zero_default() -> bool {
    true
}

fn default_snapshot_percent() -> u64 {
    25
}
fn default_size() -> Size {
    Size(1 << 30)
}

/// Whether `name` is usable as an LVM VG or LV name.
fn is_lvm_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+_.-".contains(&b))
        && name != "."
        && name != ".."
}

mod blocks;
mod command;
mod health;
pub use health::reasons;
pub mod library;
mod orphans;
mod report;
mod settle;
mod snapshots;
mod stage;
mod volumes;

#[cfg(test)]
use report::parse_lv_time;

/// An lvm backend as a store: lvm reads every device it scans, and one of
/// the exports' hold devices, suspended while a group is cut, would hold
/// its commands until it is let go: its scans skip suspended devices.
fn as_store(store: &mut crate::config::BackendConfig) {
    let own = store
        .settings
        .get("lvm_config")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    store.settings.insert(
        "lvm_config".into(),
        toml::Value::String(
            format!("devices/ignore_suspended_devices=1 {own}")
                .trim()
                .to_string(),
        ),
    );
}

/// The `lvm` kind: logical volumes in the node's volume groups.
pub const KIND: super::Kind = super::Kind {
    name: "lvm",
    parameters: &[DEVICE_CLASS_PARAMETER],
    mutable: &[READ_AHEAD],
    kill_points: KillPoint::NAMES,
    attaches: &[],
    node_token: None,
    reasons: reasons::ALL,
    secrets: &[],
    helpers: &[super::Helper {
        command: library::HELPER_COMMAND,
        main: library::helper_main,
    }],
    store: Some(super::StoreKind {
        punches_holes: false,
        as_store,
    }),
    build: |bc, env| {
        let settings: LvmSettings = bc.settings()?;
        // The helpers are this binary, as the kernel has it even if its
        // file was replaced meanwhile (an upgrade).
        let runner: Arc<dyn CommandRunner> = if settings.lvm_library {
            Arc::new(library::LvmLibrary::new(
                env.runner.clone(),
                PathBuf::from("/proc/self/exe"),
            ))
        } else {
            env.runner.clone()
        };
        Ok(Arc::new(
            LvmBackend::new(bc.name(), settings, runner)?
                .with_attached(env.attached)
                .with_host(env.host.clone())
                .with_records(env.state_dir.join("lvm").join(bc.name()))?,
        ))
    },
};

crate::kill_points! {
    /// Where a test can kill the driver in this backend's operations
    /// ([`crate::killpoint`]).
    pub enum KillPoint {
        /// lvcreate of a snapshot is about to run (with
        /// FERROVOL_KILL_AFTER_MS, it dies part way through, the origin perhaps
        /// suspended).
        Snapshot = "lvm.snapshot",
        /// lvcreate made the snapshot; the call has not answered.
        SnapshotMade = "lvm.snapshot.made",
        /// lvcreate made a copy (restore or clone) with the filling tag;
        /// a thick one holds no data yet, a thin one its source's tags.
        CopyMade = "lvm.copy.made",
    }
}
pub use report::{parse_lvs, parse_vgs, Lv, Vg};

/// The tag value recording a CSI name: the name itself when it is plain
/// enough for an LVM tag, else its full digest.
fn name_tag(name: &str) -> String {
    let plain = name.len() <= 100
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_+.-".contains(&b));
    if plain {
        format!("{NAME_TAG}{name}")
    } else {
        format!("{NAME_TAG}sha256-{}", digest_hex(name.as_bytes(), 32))
    }
}

/// The backend.
/// An LV about to be made: its name, `vg/name`, size and tags.
struct NewLv {
    name: String,
    target: String,
    size: u64,
    tags: Vec<String>,
}

impl NewLv {
    fn tag_args(&self) -> Vec<String> {
        self.tags
            .iter()
            .flat_map(|t| ["--addtag".to_string(), t.clone()])
            .collect()
    }
}

/// A new LV is made inactive: it holds a device on the node only while
/// it is staged (NodeStage activates it, NodeUnstage deactivates it), as
/// a copy already was. lvm's default would activate it, which costs the
/// create a device and udev's rules for it, and an unstage of a volume
/// never staged (a CO's cleanup) a deactivation and a second read.
///
/// It is also flagged to skip activation (the `k` attribute), as lvm
/// flags thin snapshots: only an activation that asks for it (`-K`, as
/// NodeStage's does) activates it. Without the flag, lvm's event
/// autoactivation (its udev rule runs `vgchange -aay` once a group's
/// physical volumes have all been seen, at boot or whenever udev gets to
/// a new one) and any `vgchange -ay` on the node activate every volume
/// not staged, holding devices the driver did not open, and one activated
/// just after its unstage is found active again (the guest's lifecycle
/// test caught this when udev ran late).
const INACTIVE: [&str; 3] = ["-an", "--setactivationskip", "y"];

/// The tags of its origin `src` that snapshot `made` carries and that are
/// not among its own (`own`). lvm 2.03.16 copies no tag onto a snapshot;
/// an lvm that does leaves them, and a retry of the call takes them off.
fn inherited_tags(src: &Lv, own: &[String], made: &Lv) -> Vec<String> {
    src.tags()
        .filter(|t| !own.iter().any(|o| o == t) && made.has_tag(t))
        .map(str::to_string)
        .collect()
}

pub struct LvmBackend {
    name: String,
    settings: LvmSettings,
    runner: Arc<dyn CommandRunner>,
    host: Arc<dyn Host>,
    /// How members of a group are held: lvcreate suspends each origin
    /// itself, which nests under the group's freeze only on kernels that
    /// count nested freezes ([`crate::host::freeze::block_freeze_nests`]);
    /// elsewhere groups are taken only while no member is staged.
    group_snapshots: crate::plugin::GroupSnapshots,
    /// One metadata snapshot at a time per thin pool (see `blocks`).
    pool_locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Whether each LV an attach just read is a copy (its copy tag), for
    /// the stage's next question (`node_copy_pending`) to take instead of
    /// reading the LV again. Taken once; the stage holds the volume's
    /// lock between the two, and only the stage drops the tag.
    copies_seen: std::sync::Mutex<HashMap<String, bool>>,
    /// The extent size of each thick device class's group (by class
    /// name) and when it was read: what a new empty volume's lvcreate
    /// needs first (see [`LvmBackend::fresh_extent`]).
    facts: std::sync::Mutex<HashMap<String, (u64, std::time::Instant)>>,
    /// The intents recorded before each thin snapshot's lvcreate
    /// ([`orphans`]); none in unit tests that do not ask for them.
    intents: Option<Arc<orphans::ThinIntents>>,
    /// The ids of those whose lvcreate is running now.
    running_cuts: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Where lvm keeps its group locks.
    lock_dir: PathBuf,
    /// What its lvm commands leave out (see [`skip_filter`]): the devices
    /// the driver's volumes attach on this node, as the registry's kinds
    /// name them.
    attached: Vec<&'static str>,
    // No lock of its own: the operation guard covers every id an operation
    // touches, and lvm serializes changes to a volume group's metadata
    // itself. A create racing another for the last free extents fails in
    // lvcreate, which is reported as RESOURCE_EXHAUSTED.
}

impl LvmBackend {
    pub fn new(name: &str, settings: LvmSettings, runner: Arc<dyn CommandRunner>) -> Result<Self> {
        if settings.device_classes.is_empty() {
            return Err(Error::invalid(format!(
                "lvm backend {name:?}: configure at least one device_class"
            )));
        }
        let mut seen = Vec::new();
        for c in &settings.device_classes {
            if !is_dns_label(&c.name) || c.name.len() > 16 {
                return Err(Error::invalid(format!(
                    "device class {:?}: names are lowercase DNS labels of at most 16 characters",
                    c.name
                )));
            }
            if seen.contains(&c.name) {
                return Err(Error::invalid(format!(
                    "device class {:?} is configured twice",
                    c.name
                )));
            }
            seen.push(c.name.clone());
            if !is_lvm_name(&c.volume_group)
                || c.thin_pool.as_deref().is_some_and(|p| !is_lvm_name(p))
            {
                return Err(Error::invalid(format!(
                    "device class {:?}: invalid volume group or thin pool name",
                    c.name
                )));
            }
            if c.snapshot_size_percent == 0 || c.snapshot_size_percent > 100 {
                return Err(Error::invalid(format!(
                    "device class {:?}: snapshot_size_percent must be 1 to 100",
                    c.name
                )));
            }
        }
        if let Some(d) = &settings.default_device_class {
            if !seen.contains(d) {
                return Err(Error::invalid(format!(
                    "default_device_class {d:?} is not configured"
                )));
            }
        }
        Ok(Self {
            name: name.to_string(),
            settings,
            runner,
            host: Arc::new(SystemHost),
            pool_locks: Default::default(),
            copies_seen: Default::default(),
            facts: Default::default(),
            intents: None,
            running_cuts: Default::default(),
            lock_dir: PathBuf::from(LVM_LOCK_DIR),
            attached: Vec::new(),
            group_snapshots: if crate::host::freeze::block_freeze_nests() {
                crate::plugin::GroupSnapshots::Frozen
            } else {
                crate::plugin::GroupSnapshots::Unstaged
            },
        })
    }

    /// The lock of thin pool `vg/pool`'s metadata snapshot.
    fn pool_lock(&self, vg: &str, pool: &str) -> Arc<tokio::sync::Mutex<()>> {
        use crate::sync::LockExt;
        self.pool_locks
            .locked()
            .entry(format!("{vg}/{pool}"))
            .or_default()
            .clone()
    }

    /// The same, its lvm commands leaving out the devices `attached`
    /// matches ([`crate::backend::Env::attached`]).
    pub fn with_attached(mut self, attached: &[&'static str]) -> Self {
        self.attached = attached.to_vec();
        self
    }

    /// The same, on another host seam.
    pub fn with_host(mut self, host: Arc<dyn Host>) -> Self {
        self.host = host;
        self
    }

    /// The same, keeping its records (the thin snapshots' intents) in
    /// `dir`.
    pub fn with_records(mut self, dir: PathBuf) -> Result<Self> {
        self.intents = Some(Arc::new(orphans::ThinIntents::open_dir(
            dir.join("intents"),
        )?));
        Ok(self)
    }

    /// The same, taking lvm's group locks in `dir` (lvm's `locking_dir`).
    pub fn with_lock_dir(mut self, dir: PathBuf) -> Self {
        self.lock_dir = dir;
        self
    }

    /// The device class of this name, if configured: each caller says
    /// what its absence means (a parameter naming no class, a volume whose
    /// class is gone).
    fn class(&self, name: &str) -> Option<&DeviceClass> {
        self.settings.device_classes.iter().find(|c| c.name == name)
    }

    fn class_for(&self, parameters: &BTreeMap<String, String>) -> Result<&DeviceClass> {
        match parameters
            .get(DEVICE_CLASS_PARAMETER)
            .or(self.settings.default_device_class.as_ref())
        {
            Some(name) => self.class(name).ok_or_else(|| {
                Error::invalid(format!(
                    "parameter {DEVICE_CLASS_PARAMETER}: device class {name:?} is not configured"
                ))
            }),
            None => Ok(&self.settings.device_classes[0]),
        }
    }

    /// The device class an LV of ours belongs to: the one its class tag
    /// names, or, for an LV made before classes were tagged, the first
    /// class on its volume group whose thin pool (or none) it sits in.
    /// Classes may share a volume group; an LV belongs to exactly one.
    fn owner(&self, lv: &Lv) -> Option<&DeviceClass> {
        let classes = self.settings.device_classes.iter();
        if let Some(name) = lv.tag_value(CLASS_TAG) {
            return classes
                .filter(|c| c.volume_group == lv.vg_name)
                .find(|c| c.name == name);
        }
        classes
            .filter(|c| c.volume_group == lv.vg_name)
            .find(|c| c.thin_pool.as_deref().unwrap_or("") == lv.pool_lv)
    }

    /// The LV `name` of `class`: ours, and of that class.
    /// The extent size of `class`'s group, when a read of it is recent
    /// enough for a create to go straight to lvcreate.
    fn fresh_extent(&self, class: &DeviceClass) -> Option<u64> {
        let facts = self.facts.lock().unwrap_or_else(|e| e.into_inner());
        facts
            .get(&class.name)
            .filter(|(_, read)| read.elapsed() < FACTS_FRESH)
            .map(|(extent, _)| *extent)
    }

    /// Notes the extent size a read of `class`'s group just showed.
    fn note_facts(&self, class: &DeviceClass, extent: u64) {
        let mut facts = self.facts.lock().unwrap_or_else(|e| e.into_inner());
        facts.insert(class.name.clone(), (extent, std::time::Instant::now()));
    }

    fn forget_facts(&self, class: &DeviceClass) {
        let mut facts = self.facts.lock().unwrap_or_else(|e| e.into_inner());
        facts.remove(&class.name);
    }

    async fn class_lv(&self, class: &DeviceClass, name: &str) -> Result<Option<Lv>> {
        Ok(self
            .lv(&class.volume_group, name)
            .await?
            .filter(|lv| self.owner(lv).is_some_and(|c| c.name == class.name)))
    }

    /// Every LV of ours on the configured volume groups, each once, with
    /// the class it belongs to.
    async fn all_lvs(&self) -> Result<Vec<(&DeviceClass, Lv)>> {
        let mut groups: Vec<&str> = self
            .settings
            .device_classes
            .iter()
            .map(|c| c.volume_group.as_str())
            .collect();
        groups.sort();
        groups.dedup();
        let mut out = Vec::new();
        for vg in groups {
            for lv in self.lvs(vg).await? {
                if !lv.has_tag(TAG) {
                    continue;
                }
                if let Some(class) = self.owner(&lv) {
                    out.push((class, lv));
                }
            }
        }
        Ok(out)
    }

    /// Splits a locator `<class>.<lv>` and checks both parts.
    fn split<'a>(&'a self, locator: &'a str) -> Result<(&'a DeviceClass, &'a str)> {
        let (class, lv) = locator
            .split_once('.')
            .ok_or_else(|| Error::not_found(format!("{locator:?} is not an lvm id")))?;
        if !is_lvm_name(lv) || !(lv.starts_with("fv-") || lv.starts_with("fvs-")) {
            return Err(Error::not_found(format!("{locator:?} is not an lvm id")));
        }
        let class = self.class(class).ok_or_else(|| {
            Error::not_found(format!(
                "{locator:?}: device class {class:?} is not configured"
            ))
        })?;
        Ok((class, lv))
    }

    fn volume_info(&self, class: &DeviceClass, lv: &Lv) -> Result<VolumeInfo> {
        let source = lv.tag_value(SOURCE_TAG).and_then(|s| {
            if s.starts_with("fvs-") {
                SnapshotId::new(&self.name, &format!("{}.{s}", class.name))
                    .ok()
                    .map(ContentSource::Snapshot)
            } else {
                VolumeId::new(&self.name, &format!("{}.{s}", class.name))
                    .ok()
                    .map(ContentSource::Volume)
            }
        });
        Ok(VolumeInfo {
            id: VolumeId::new(&self.name, &format!("{}.{}", class.name, lv.lv_name))?,
            capacity_bytes: lv.size(),
            context: BTreeMap::new(),
            source,
        })
    }

    fn snapshot_info(&self, class: &DeviceClass, lv: &Lv) -> Result<SnapshotInfo> {
        let source = lv.tag_value(SOURCE_TAG).unwrap_or(&lv.origin);
        Ok(SnapshotInfo {
            id: SnapshotId::new(&self.name, &format!("{}.{}", class.name, lv.lv_name))?,
            source_volume: VolumeId::new(&self.name, &format!("{}.{source}", class.name))?,
            size_bytes: lv
                .tag_value("ferrovol-size:")
                .and_then(|s| s.parse().ok())
                .unwrap_or(lv.size()),
            created: lv.created(),
            ready: true,
            group: None,
        })
    }

    /// How a device class sizes volumes: whole extents.
    fn size_rules(class: &DeviceClass, extent: u64) -> SizeRules {
        SizeRules {
            step: extent,
            default: class.default_volume_size.0,
            max: None,
        }
    }

    /// The LV behind a content source, which must be ours and in `class`.
    async fn source_lv(&self, class: &DeviceClass, source: &ContentSource) -> Result<Lv> {
        let (kind, shown) = match source {
            ContentSource::Snapshot(id) => ("snapshot", id.to_string()),
            ContentSource::Volume(id) => ("volume", id.to_string()),
        };
        let missing = || Error::not_found(format!("source {kind} {shown} does not exist"));
        let (c, lv) = self
            .split(own_source(&self.name, source)?)
            .map_err(|_| missing())?;
        if c.name != class.name {
            return Err(Error::invalid(format!(
                "source {kind} {shown} is in another device class"
            )));
        }
        self.class_lv(class, lv)
            .await?
            .filter(|lv| !lv.has_tag(DELETING_TAG))
            .ok_or_else(missing)
    }

    /// Zeroes the extents of a thick LV that is being deleted (a classic
    /// snapshot is split from its origin first, so its own extents, the
    /// origin's old blocks, are what is zeroed). The LV is tagged first: an
    /// interrupted delete zeroes again when retried, and nothing stages or
    /// restores from it meanwhile.
    async fn zero_extents(&self, class: &DeviceClass, lv: &Lv, what: &str) -> Result<()> {
        let target = format!("{}/{}", class.volume_group, lv.lv_name);
        let snapshot = lv.lv_attr.starts_with('s');
        let device = PathBuf::from(format!("/dev/{target}"));
        if lv.has_tag(DELETING_TAG) || snapshot {
            if !lv.has_tag(DELETING_TAG) {
                self.runner
                    .run(
                        self.lvm("lvchange")
                            .args(["--addtag", DELETING_TAG, &target]),
                    )
                    .await?;
            }
            if snapshot {
                self.runner
                    .run(
                        self.lvm("lvconvert")
                            .args(["-y", "--splitsnapshot", &target]),
                    )
                    .await?;
            }
            self.activate(&class.volume_group, &lv.lv_name).await?;
        } else {
            // A plain LV: tagged and activated by one lvchange (which
            // takes no `-K` beside a tag: its skip flag is cleared instead,
            // on an LV that is going). Zeroing starts only once both are
            // done; a delete cut short before finds the tag (or not) and
            // does this again.
            self.runner
                .run(self.lvm("lvchange").args([
                    "-ay",
                    "-y",
                    "--setactivationskip",
                    "n",
                    "--addtag",
                    DELETING_TAG,
                    &target,
                ]))
                .await?;
        }
        let zeroed = self
            .runner
            .run(
                Command::new("blkdiscard")
                    .args(["--zeroout"])
                    .arg(path_arg(&device)?)
                    .timeout(ZERO_TIMEOUT),
            )
            .await;
        if let Err(e) = zeroed {
            // blkdiscard opens the device exclusively: whether it failed
            // for a user of the LV is what lvs says of it, not its words.
            return Err(if self.opened(&class.volume_group, &lv.lv_name).await {
                Error::in_use(
                    what,
                    format_args!("open on this node: {e}"),
                    "unstage it first",
                )
            } else {
                Error::from(e).context("zero the extents before they are freed")
            });
        }
        // Left active: lvremove deactivates what it removes.
        Ok(())
    }

    /// Whether lvs says the LV is open (mounted or otherwise in use).
    async fn opened(&self, vg: &str, lv: &str) -> bool {
        matches!(self.lv(vg, lv).await, Ok(Some(l)) if l.open())
    }

    async fn remove_lv(&self, class: &DeviceClass, lv_name: &str) -> Result<()> {
        let removed = self
            .runner
            .run(
                self.lvm("lvremove")
                    .args(["-y", &format!("{}/{lv_name}", class.volume_group)]),
            )
            .await
            .map_err(Error::from);
        let Err(e) = removed else { return Ok(()) };
        // Opened between our check and lvremove (a stage racing it): lvs
        // says so.
        if self.opened(&class.volume_group, lv_name).await {
            return Err(Error {
                kind: crate::error::Kind::FailedPrecondition,
                ..e
            });
        }
        Err(e)
    }

    /// A new volume's source LV and the size it asks for at least.
    async fn create_source(
        &self,
        class: &DeviceClass,
        req: &CreateVolume,
    ) -> Result<(Option<Lv>, u64)> {
        match &req.source {
            None => Ok((None, 0)),
            Some(src @ ContentSource::Snapshot(_)) => {
                let snap = self.source_lv(class, src).await?;
                let size = snap
                    .tag_value("ferrovol-size:")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(snap.size());
                Ok((Some(snap), size))
            }
            Some(src @ ContentSource::Volume(_)) => {
                let vol = self.source_lv(class, src).await?;
                let size = vol.size();
                Ok((Some(vol), size))
            }
        }
    }

    /// A create that finds its LV made already: the same volume when it
    /// carries this name in this class and matches the request.
    fn existing_volume(
        &self,
        class: &DeviceClass,
        req: &CreateVolume,
        existing: &Lv,
    ) -> Result<VolumeInfo> {
        let vg_name = &class.volume_group;
        let tag = name_tag(&req.name);
        if !existing.has_tag(&tag) {
            return Err(Error::already_exists(format!(
                "LV {vg_name}/{} belongs to another name",
                existing.lv_name
            )));
        }
        if self.owner(existing).map(|c| &c.name) != Some(&class.name) {
            return Err(Error::already_exists(format!(
                "volume {:?} exists in another device class of volume group {vg_name}",
                req.name
            )));
        }
        let info = self.volume_info(class, existing)?;
        check_existing(req, existing.size(), info.source.as_ref())?;
        Ok(info)
    }

    /// A copy in a thin pool: a thin snapshot of the source (instant,
    /// shares blocks), then finished by [`LvmBackend::fill`].
    async fn create_thin_copy(&self, class: &DeviceClass, new: &NewLv, src: &Lv) -> Result<()> {
        let noted = self.note_thin_snapshot(class, src, &new.name).await?;
        self.run_snapshot_lvcreate(
            class,
            0,
            noted,
            self.lvm("lvcreate")
                .args(["-y", "-s", "-n", &new.name])
                .args(new.tag_args())
                .arg(format!("{}/{}", class.volume_group, src.lv_name)),
        )
        .await?;
        crate::killpoint::hit(KillPoint::CopyMade);
        self.fill(class, new, src).await
    }

    /// Finishes a copy of `src` that lvcreate made with the filling tag
    /// (again, when a retry finds it still there: every step is safe to
    /// repeat). A thin copy keeps only its own tags (the source's came
    /// along) and grows if asked bigger; a thick one gets the source's
    /// data. The tag goes last: until then the volume is not made.
    async fn fill(&self, class: &DeviceClass, new: &NewLv, src: &Lv) -> Result<()> {
        let vg_name = &class.volume_group;
        let lv = self
            .lv(vg_name, &new.name)
            .await?
            .ok_or_else(|| Error::internal(format!("LV {} vanished after lvcreate", new.target)))?;
        if class.thin_pool.is_some() {
            let inherited: Vec<String> = src
                .tags()
                .filter(|t| !new.tags.iter().any(|x| x == t) && lv.has_tag(t))
                .map(str::to_string)
                .collect();
            self.drop_tags(&new.target, &inherited).await?;
            if new.size > lv.size() {
                self.runner
                    .run(
                        self.lvm("lvextend")
                            .args(["-L", &format!("{}b", new.size), &new.target]),
                    )
                    .await?;
            }
        } else {
            if let Err(e) = self.copy_lv(vg_name, &src.lv_name, &new.name).await {
                let _ = self
                    .runner
                    .run(self.lvm("lvremove").args(["-y", &new.target]))
                    .await;
                return Err(e.context("copy the source into the new volume"));
            }
            let _ = self.deactivate(vg_name, &new.name).await;
        }
        self.drop_tags(&new.target, &[FILLING_TAG.to_string()])
            .await
    }

    /// Takes `tags` off LV `target` (`vg/lv`), in one lvchange.
    async fn drop_tags(&self, target: &str, tags: &[String]) -> Result<()> {
        if tags.is_empty() {
            return Ok(());
        }
        let mut cmd = self.lvm("lvchange");
        for t in tags {
            cmd = cmd.args(["--deltag", t.as_str()]);
        }
        self.runner.run(cmd.arg(target)).await?;
        Ok(())
    }

    /// A new thin volume. The pool must exist (thin volumes may overcommit
    /// its space) and zero the chunks it hands out: without that, a write
    /// into a new chunk leaves the rest of it showing whatever the chunk
    /// last held, another tenant's data.
    async fn create_thin(
        &self,
        class: &DeviceClass,
        new: &NewLv,
        pool: &str,
        seen: Option<&Lv>,
    ) -> Result<()> {
        let vg_name = &class.volume_group;
        let p = seen.ok_or_else(|| {
            Error::precondition(format!("thin pool {}/{pool} not found", class.volume_group))
        })?;
        if !p.zeroes_new_chunks() && class.zero_on_delete {
            return Err(Error::precondition(format!(
                "thin pool {vg_name}/{pool} does not zero new chunks, so a new volume \
                 could read a previous tenant's data: turn it on with \
                 `lvchange --zero y {vg_name}/{pool}` (or set zero_on_delete = false \
                 for class {:?} if the storage below zeroes freed space)",
                class.name
            )));
        }
        self.run_judged(class, 0, self.thin_lvcreate(class, new, pool))
            .await
    }

    /// The lvcreate of new thin volume `new` in `class`'s pool `pool`,
    /// left inactive ([`INACTIVE`]).
    fn thin_lvcreate(&self, class: &DeviceClass, new: &NewLv, pool: &str) -> Command {
        self.lvm("lvcreate")
            .args(["-y"])
            .args(INACTIVE)
            .args([
                "-V",
                &format!("{}b", new.size),
                "--thinpool",
                &format!("{}/{pool}", class.volume_group),
                "-n",
                &new.name,
            ])
            .args(new.tag_args())
    }

    /// The lvcreate of new thick volume `new`, left inactive
    /// ([`INACTIVE`]), with neither the start zeroed nor signatures wiped
    /// (the first attach wipes a fresh one).
    fn thick_lvcreate(&self, class: &DeviceClass, new: &NewLv) -> Command {
        self.lvm("lvcreate")
            .args(["-y"])
            .args(INACTIVE)
            .args([
                "-Zn",
                "-Wn",
                "-L",
                &format!("{}b", new.size),
                "-n",
                &new.name,
            ])
            .args(new.tag_args())
            .arg(&class.volume_group)
    }

    /// A thick volume, a copy of `src` if given. No zeroing here (it needs
    /// activation); the start of a fresh LV is wiped at its first attach
    /// instead.
    async fn create_thick(
        &self,
        class: &DeviceClass,
        new: &NewLv,
        vg: &Vg,
        src: Option<&Lv>,
    ) -> Result<()> {
        let (vg_name, size) = (&class.volume_group, new.size);
        crate::error::room(
            size,
            format_args!("volume group {vg_name}"),
            vg.size(),
            vg.free(),
        )?;
        self.run_judged(class, size, self.thick_lvcreate(class, new))
            .await?;
        if let Some(src) = src {
            crate::killpoint::hit(KillPoint::CopyMade);
            self.fill(class, new, src).await?;
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Backend for LvmBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static super::Kind {
        &KIND
    }

    async fn start(&self) -> Result<()> {
        // A driver that died while lvcreate cut a snapshot took lvcreate
        // along: what it left (an origin suspended or on a table the
        // metadata does not name, a half-made snapshot) is undone before
        // anything is served. lvm's own lock orders this after any lvcreate
        // still running.
        match self.settle().await {
            Ok(done) => {
                for what in done {
                    tracing::warn!("{what}");
                }
            }
            Err(e) => {
                tracing::error!(error = %e.message, "could not settle what cut-short snapshots left")
            }
        }
        // And the thin device ids a thin snapshot's cut-short lvcreate
        // left in its pool.
        for what in self.settle_all_cuts().await {
            tracing::warn!("{what}");
        }
        Ok(())
    }

    async fn health(&self) -> Result<()> {
        for c in &self.settings.device_classes {
            self.vg(c)
                .await
                .map_err(|e| e.context(format!("device class {}", c.name)))?;
        }
        Ok(())
    }

    fn validate_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        self.class_for(parameters).map(|_| ())
    }

    fn access_modes(&self) -> Vec<AccessMode> {
        SINGLE_NODE_MODES.to_vec()
    }

    fn node_local(&self) -> bool {
        true
    }

    fn health_reporter(&self) -> Option<&dyn crate::plugin::HealthReporter> {
        Some(self)
    }

    async fn storage_findings(&self) -> Vec<crate::plugin::health::StorageFinding> {
        self.class_findings().await
    }

    fn provisioner(&self) -> Option<&dyn Provisioner> {
        Some(self)
    }

    fn expander(&self) -> Option<&dyn Expander> {
        Some(self)
    }

    fn snapshotter(&self) -> Option<&dyn Snapshotter> {
        Some(self)
    }

    fn modifier(&self) -> Option<&dyn Modifier> {
        Some(self)
    }

    fn stager(&self) -> Option<&dyn Stager> {
        Some(self)
    }

    fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
        Some(self)
    }

    /// Thin snapshots: from the pool's block map.
    fn block_tracker(&self) -> Option<&dyn BlockTracker> {
        let thin = self
            .settings
            .device_classes
            .iter()
            .any(|c| c.thin_pool.is_some());
        thin.then_some(self as &dyn BlockTracker)
    }
}

#[cfg(test)]
mod tests;
