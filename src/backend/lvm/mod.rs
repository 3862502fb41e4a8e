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
use std::sync::Arc;
use std::time::Duration;

const LVM_TIMEOUT: Duration = Duration::from_secs(120);
const COPY_TIMEOUT: Duration = Duration::from_secs(3600);
/// Every LV ferrovol makes carries this tag.
const TAG: &str = "ferrovol";
/// The tag carrying the CSI name (or its digest).
const NAME_TAG: &str = "ferrovol-name:";
/// On an LV being deleted: its extents are being zeroed (a retried delete
/// zeroes again, so the extents never go back to the pool unwiped).
const DELETING_TAG: &str = "ferrovol-deleting";
/// Zeroing a whole LV takes a while on a big one.
const ZERO_TIMEOUT: Duration = Duration::from_secs(6 * 3600);
/// The device class an LV belongs to (classes may share a volume group).
const CLASS_TAG: &str = "ferrovol-class:";
/// On a snapshot: the volume it was taken from.
const SOURCE_TAG: &str = "ferrovol-source:";
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
mod report;
mod settle;

#[cfg(test)]
use report::parse_lv_time;

/// The `lvm` kind: logical volumes in the node's volume groups.
pub const KIND: super::Kind = super::Kind {
    name: "lvm",
    parameters: &[DEVICE_CLASS_PARAMETER],
    mutable: &[READ_AHEAD],
    kill_points: KillPoint::NAMES,
    secrets: &[],
    build: |bc, env| {
        Ok(Arc::new(
            LvmBackend::new(bc.name(), bc.settings()?, env.runner.clone())?
                .with_host(env.host.clone()),
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
        /// lvcreate made the snapshot; it still carries its origin's tags.
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

/// The tags `snapshot` took from its origin `src` that are not its own:
/// lvcreate copies the origin's tags onto a snapshot.
fn inherited_tags(src: &Lv, snapshot: &Lv, name_tag: &str, source_tag: &str) -> Vec<String> {
    let size_tag = format!("ferrovol-size:{}", src.size());
    let own = |t: &str| {
        t == TAG || t == name_tag || t == source_tag || t == size_tag || t.starts_with(CLASS_TAG)
    };
    src.tags()
        .filter(|t| !own(t) && snapshot.has_tag(t))
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

    /// The same, on another host seam.
    pub fn with_host(mut self, host: Arc<dyn Host>) -> Self {
        self.host = host;
        self
    }

    fn class(&self, name: &str) -> Result<&DeviceClass> {
        self.settings
            .device_classes
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| Error::not_found(format!("device class {name:?} is not configured")))
    }

    fn class_for(&self, parameters: &BTreeMap<String, String>) -> Result<&DeviceClass> {
        match parameters
            .get(DEVICE_CLASS_PARAMETER)
            .or(self.settings.default_device_class.as_ref())
        {
            Some(name) => self.class(name).map_err(|e| Error::invalid(e.message)),
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
        Ok((self.class(class)?, lv))
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
        if !lv.has_tag(DELETING_TAG) {
            self.runner
                .run(
                    self.lvm("lvchange")
                        .args(["--addtag", DELETING_TAG, &target]),
                )
                .await?;
        }
        if lv.lv_attr.starts_with('s') {
            self.runner
                .run(
                    self.lvm("lvconvert")
                        .args(["-y", "--splitsnapshot", &target]),
                )
                .await?;
        }
        let device = self.activate(&class.volume_group, &lv.lv_name).await?;
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
                Error::precondition(format!(
                    "{what} is in use on this node; unstage it first ({e})"
                ))
            } else {
                Error::from(e).context("zero the extents before they are freed")
            });
        }
        self.deactivate(&class.volume_group, &lv.lv_name).await
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
            return Err(Error::precondition(e.message));
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
        self.run_judged(
            class,
            0,
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
    async fn create_thin(&self, class: &DeviceClass, new: &NewLv, pool: &str) -> Result<()> {
        let vg_name = &class.volume_group;
        let p = self.pool(class, pool).await?;
        if !p.zeroes_new_chunks() && class.zero_on_delete {
            return Err(Error::precondition(format!(
                "thin pool {vg_name}/{pool} does not zero new chunks, so a new volume \
                 could read a previous tenant's data: turn it on with \
                 `lvchange --zero y {vg_name}/{pool}` (or set zero_on_delete = false \
                 for class {:?} if the storage below zeroes freed space)",
                class.name
            )));
        }
        self.run_judged(
            class,
            0,
            self.lvm("lvcreate")
                .args([
                    "-y",
                    "-V",
                    &format!("{}b", new.size),
                    "--thinpool",
                    &format!("{vg_name}/{pool}"),
                    "-n",
                    &new.name,
                ])
                .args(new.tag_args()),
        )
        .await
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
        if size > vg.size() {
            return Err(Error::out_of_range(format!(
                "{size} bytes is more than volume group {vg_name} holds ({})",
                vg.size()
            )));
        }
        if size > vg.free() {
            return Err(Error::exhausted(format!(
                "volume group {vg_name} has {} bytes free, {size} needed",
                vg.free()
            )));
        }
        self.run_judged(
            class,
            size,
            self.lvm("lvcreate")
                .args([
                    "-y",
                    "-Zn",
                    "-Wn",
                    "-L",
                    &format!("{size}b"),
                    "-n",
                    &new.name,
                ])
                .args(new.tag_args())
                .arg(vg_name),
        )
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
        for key in parameters.keys() {
            if key != DEVICE_CLASS_PARAMETER {
                return Err(Error::invalid(format!(
                    "lvm backend: unknown parameter {key:?} (known: {DEVICE_CLASS_PARAMETER})"
                )));
            }
        }
        self.class_for(parameters).map(|_| ())
    }

    fn access_modes(&self) -> Vec<AccessMode> {
        SINGLE_NODE_MODES.to_vec()
    }

    fn node_local(&self) -> bool {
        true
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

#[async_trait::async_trait]
impl Provisioner for LvmBackend {
    fn clones(&self) -> bool {
        true
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let class = self.class_for(&req.parameters)?.clone();
        let lv_name = format!("fv-{}", locator_for_name(&req.name));
        let (source, source_size) = self.create_source(&class, req).await?;
        // A copy the driver died making is finished by this retry (it is
        // this request's when it carries this name in this class, made from
        // this source); any other LV of this name is judged as it is.
        let existing = self.lv(&class.volume_group, &lv_name).await?;
        let unfinished = |lv: &Lv| {
            source.as_ref().is_some_and(|src| {
                lv.has_tag(FILLING_TAG)
                    && lv.has_tag(&name_tag(&req.name))
                    && lv.has_tag(&format!("{SOURCE_TAG}{}", src.lv_name))
                    && self.owner(lv).is_some_and(|c| c.name == class.name)
            })
        };
        if let Some(existing) = existing.as_ref().filter(|lv| !unfinished(lv)) {
            return self.existing_volume(&class, req, existing);
        }
        let vg = self.vg(&class).await?;
        let size = Self::size_rules(&class, vg.extent()).new_volume(
            req.required_bytes,
            req.limit_bytes,
            source_size,
        )?;
        let mut tags = vec![
            TAG.to_string(),
            name_tag(&req.name),
            format!("{CLASS_TAG}{}", class.name),
        ];
        match &source {
            Some(src) => tags.extend([
                format!("{SOURCE_TAG}{}", src.lv_name),
                COPY_TAG.into(),
                FILLING_TAG.into(),
            ]),
            None => tags.push(FRESH_TAG.into()),
        }
        let new = NewLv {
            target: format!("{}/{lv_name}", class.volume_group),
            name: lv_name,
            size,
            tags,
        };
        if let (Some(_), Some(src)) = (&existing, &source) {
            tracing::warn!(lv = %new.target, "finishing a copy whose making was cut short");
            self.fill(&class, &new, src).await?;
            let lv = self
                .lv(&class.volume_group, &new.name)
                .await?
                .ok_or_else(|| Error::internal(format!("LV {} vanished", new.target)))?;
            return self.existing_volume(&class, req, &lv);
        }
        match (&class.thin_pool, &source) {
            (Some(_), Some(src)) => self.create_thin_copy(&class, &new, src).await?,
            (Some(pool), None) => self.create_thin(&class, &new, pool).await?,
            (None, src) => self.create_thick(&class, &new, &vg, src.as_ref()).await?,
        }
        let lv = self
            .lv(&class.volume_group, &new.name)
            .await?
            .ok_or_else(|| Error::internal(format!("LV {} vanished after lvcreate", new.target)))?;
        self.volume_info(&class, &lv)
    }

    async fn delete_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<()> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(());
        };
        let all = self.lvs(&class.volume_group).await?;
        let Some(lv) = all.iter().find(|l| {
            l.lv_name == lv_name
                && l.has_tag(TAG)
                && self.owner(l).is_some_and(|c| c.name == class.name)
        }) else {
            return Ok(());
        };
        if lv.open() {
            return Err(Error::precondition(format!(
                "volume {id} is in use on this node; unstage it first"
            )));
        }
        // Classic (COW) snapshots die with their origin: refuse rather than
        // take them along. Thin snapshots are independent.
        if let Some(snap) = all
            .iter()
            .find(|l| l.origin == lv_name && l.lv_attr.starts_with('s'))
        {
            return Err(Error::precondition(format!(
                "volume {id} has snapshot {} that depends on it; delete the snapshot first",
                snap.lv_name
            )));
        }
        if lv.pool_lv.is_empty() && class.zero_on_delete {
            // A thick LV's extents go back to the volume group and the next
            // LV gets them as they are: zero them first, so no tenant ever
            // reads another's data. Thin pools zero new chunks themselves.
            self.zero_extents(class, lv, &format!("volume {id}"))
                .await?;
        }
        self.remove_lv(class, lv_name).await
    }

    async fn get_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(None);
        };
        if !lv_name.starts_with("fv-") {
            return Ok(None);
        }
        match self.class_lv(class, lv_name).await? {
            Some(lv) => Ok(Some(self.volume_info(class, &lv)?)),
            None => Ok(None),
        }
    }

    /// One `lvs` per volume group for every page: lvm reports a whole
    /// group at once, and a node's LVs number in the hundreds.
    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        let mut out = Vec::new();
        for (class, lv) in self.all_lvs().await? {
            if lv.lv_name.starts_with("fv-") {
                out.push(self.volume_info(class, &lv)?);
            }
        }
        Ok(page.apply(out, |v| v.id.locator()))
    }

    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        let class = self.class_for(parameters)?;
        let vg = self.vg(class).await?;
        let (available, maximum) = match &class.thin_pool {
            Some(pool) => {
                let (size, free) = self.pool_space(class, pool).await?;
                (free, size)
            }
            None => (vg.free(), vg.free()),
        };
        let extent = vg.extent();
        Ok(Capacity {
            available_bytes: available,
            maximum_volume_bytes: Some(maximum / extent * extent),
            minimum_volume_bytes: Some(extent),
        })
    }

    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        let class = self.class_for(&req.parameters)?;
        VolumeId::new(
            &self.name,
            &format!("{}.fv-{}", class.name, locator_for_name(&req.name)),
        )
    }
}

#[async_trait::async_trait]
impl Expander for LvmBackend {
    fn online(&self) -> bool {
        true
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        _secrets: &Secrets,
    ) -> Result<u64> {
        let (class, lv_name) = self.split(id.locator())?;
        let lv = self
            .class_lv(class, lv_name)
            .await?
            .ok_or_else(|| Error::not_found(format!("volume {id} does not exist")))?;
        let vg = self.vg(class).await?;
        let Some(wanted) =
            Self::size_rules(class, vg.extent()).expansion(lv.size(), required, limit)?
        else {
            return Ok(lv.size());
        };
        // LVM grows the origin of classic snapshots only while it is
        // inactive (lvextend refuses, and the resizer would retry it as an
        // internal error for ever).
        if lv.snapshot_origin() && !lv.inactive() {
            return Err(Error::precondition(format!(
                "volume {id} has snapshots, and LVM grows a thick volume that has snapshots only \
                 while it is not active, which a staged volume is: delete its snapshots and the \
                 expansion goes on at its next try; a thin device class's volumes grow with \
                 their snapshots"
            )));
        }
        // A thin volume's virtual size takes nothing from the group.
        let grow = match class.thin_pool {
            None => wanted - lv.size(),
            Some(_) => 0,
        };
        if grow > vg.size() {
            return Err(Error::out_of_range(format!(
                "growing by {grow} bytes is more than volume group {} holds ({} bytes)",
                class.volume_group,
                vg.size()
            )));
        }
        if grow > vg.free() {
            return Err(Error::exhausted(format!(
                "volume group {} has {} bytes free",
                class.volume_group,
                vg.free()
            )));
        }
        self.run_judged(
            class,
            grow,
            self.lvm("lvextend").args([
                "-L",
                &format!("{wanted}b"),
                &format!("{}/{lv_name}", class.volume_group),
            ]),
        )
        .await?;
        Ok(wanted)
    }
}

#[async_trait::async_trait]
impl Snapshotter for LvmBackend {
    /// lvcreate suspends the origin to cut it: one instant.
    fn instant(&self) -> SnapshotInstant {
        SnapshotInstant::Own
    }

    /// Frozen together where the kernel nests freezes, else only while no
    /// member is staged.
    fn groups(&self) -> Groups<'_> {
        match self.group_snapshots {
            crate::plugin::GroupSnapshots::Unstaged => Groups::Unstaged,
            _ => Groups::Frozen,
        }
    }

    fn snapshot_id_for(&self, req: &CreateSnapshot) -> Result<SnapshotId> {
        let (class, _) = self.split(req.source.locator()).map_err(|_| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        SnapshotId::new(
            &self.name,
            &format!("{}.fvs-{}", class.name, locator_for_name(&req.name)),
        )
    }

    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        let (source, name) = (&req.source, req.name.as_str());
        let (class, src_lv) = (source.backend() == self.name)
            .then(|| self.split(source.locator()))
            .transpose()
            .ok()
            .flatten()
            .ok_or_else(|| Error::not_found(format!("source volume {source} does not exist")))?;
        let class = class.clone();
        let vg_name = class.volume_group.clone();
        let snap_name = format!("fvs-{}", locator_for_name(name));
        let tag = name_tag(name);
        let source_tag = format!("{SOURCE_TAG}{src_lv}");
        let target = format!("{vg_name}/{snap_name}");
        let mut existing = self.lv(&vg_name, &snap_name).await?;
        if let Some(lv) = existing.as_ref().filter(|lv| lv.plain()) {
            // lvcreate makes a classic snapshot's copy-on-write area as a
            // plain LV (with the snapshot's tags) and only then turns it
            // into the snapshot: killed between, it leaves that LV, which
            // holds nothing. It is ours when it carries this snapshot's
            // tags; it goes, and the snapshot is made again.
            if !(lv.has_tag(&tag) && lv.has_tag(&source_tag)) {
                return Err(Error::already_exists(format!(
                    "LV {target} exists and is not snapshot {name:?}"
                )));
            }
            // lvcreate was cut short with the driver alive (its timeout).
            for what in self.settle().await? {
                tracing::warn!("{what}");
            }
            existing = self.lv(&vg_name, &snap_name).await?;
            if existing.as_ref().is_some_and(|lv| lv.plain()) {
                return Err(Error::unavailable(format!(
                    "the half-made snapshot {target} is still there: retry"
                )));
            }
        }
        if let Some(existing) = existing {
            // Membership, not the first tag of a kind: a snapshot whose
            // making was cut short still carries its origin's tags beside
            // its own (a name tag among them).
            let same = existing.has_tag(&tag)
                && existing.has_tag(&source_tag)
                && self.owner(&existing).is_some_and(|c| c.name == class.name);
            if !same {
                return Err(Error::already_exists(format!(
                    "snapshot {name:?} exists for another source volume"
                )));
            }
            let inherited = match self.class_lv(&class, src_lv).await? {
                Some(src) => inherited_tags(&src, &existing, &tag, &source_tag),
                None => Vec::new(),
            };
            if inherited.is_empty() {
                return self.snapshot_info(&class, &existing);
            }
            tracing::warn!(snapshot = %target, "finishing a snapshot whose making was cut short: dropping its origin's tags");
            self.drop_tags(&target, &inherited).await?;
            let lv = self
                .lv(&vg_name, &snap_name)
                .await?
                .ok_or_else(|| Error::internal(format!("snapshot {target} vanished")))?;
            return self.snapshot_info(&class, &lv);
        }
        let src = self
            .class_lv(&class, src_lv)
            .await?
            .ok_or_else(|| Error::not_found(format!("source volume {source} does not exist")))?;
        let mut cmd = self.lvm("lvcreate").args(["-y", "-s", "-n", &snap_name]);
        // What the snapshot takes from the group: its copy-on-write area
        // (a thin snapshot takes nothing from the group, only pool chunks).
        let mut cow = 0;
        if class.thin_pool.is_none() || src.pool_lv.is_empty() {
            let vg = self.vg(&class).await?;
            cow = round_up(src.size() * class.snapshot_size_percent / 100, vg.extent());
            if cow > vg.free() {
                return Err(Error::exhausted(format!(
                    "volume group {vg_name} has {} bytes free, the snapshot needs {cow}",
                    vg.free()
                )));
            }
            cmd = cmd.args(["-L", &format!("{cow}b")]);
        }
        let tags = [
            TAG.to_string(),
            tag.clone(),
            format!("{CLASS_TAG}{}", class.name),
            source_tag.clone(),
            format!("ferrovol-size:{}", src.size()),
        ];
        for t in &tags {
            cmd = cmd.args(["--addtag", t]);
        }
        // lvcreate suspends the origin while it cuts the snapshot; killed
        // part way, it can leave the origin suspended (resumed at start).
        crate::killpoint::hit(KillPoint::Snapshot);
        self.run_judged(&class, cow, cmd.arg(format!("{vg_name}/{src_lv}")))
            .await?;
        crate::killpoint::hit(KillPoint::SnapshotMade);
        // The snapshot inherits the origin's tags: drop the ones that are
        // not ours (a retry finishes this if the driver dies first).
        let made = self
            .lv(&vg_name, &snap_name)
            .await?
            .ok_or_else(|| Error::internal(format!("snapshot {target} vanished")))?;
        self.drop_tags(&target, &inherited_tags(&src, &made, &tag, &source_tag))
            .await?;
        let lv = self
            .lv(&vg_name, &snap_name)
            .await?
            .ok_or_else(|| Error::internal(format!("snapshot {target} vanished")))?;
        self.snapshot_info(&class, &lv)
    }

    async fn delete_snapshot(&self, id: &SnapshotId, _secrets: &Secrets) -> Result<()> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(());
        };
        if !lv_name.starts_with("fvs-") {
            return Ok(());
        }
        let Some(lv) = self.class_lv(class, lv_name).await? else {
            return Ok(());
        };
        // A classic snapshot's own extents hold copies of the origin's old
        // blocks: zeroed before they go back to the volume group, as a
        // thick volume's are. (A thin snapshot's chunks stay in the pool,
        // which zeroes them when it hands them out again.)
        let classic = lv.lv_attr.starts_with('s') || lv.has_tag(DELETING_TAG);
        if classic && lv.pool_lv.is_empty() && class.zero_on_delete {
            self.zero_extents(class, &lv, &format!("snapshot {id}"))
                .await?;
        }
        self.remove_lv(class, lv_name).await
    }

    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        _secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(None);
        };
        if !lv_name.starts_with("fvs-") {
            return Ok(None);
        }
        match self.class_lv(class, lv_name).await? {
            Some(lv) if !lv.has_tag(DELETING_TAG) => Ok(Some(self.snapshot_info(class, &lv)?)),
            _ => Ok(None),
        }
    }

    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        let mut out = Vec::new();
        for (class, lv) in self.all_lvs().await? {
            if lv.lv_name.starts_with("fvs-") && !lv.has_tag(DELETING_TAG) {
                let snap = self.snapshot_info(class, &lv)?;
                if source.is_none_or(|s| &snap.source_volume == s) {
                    out.push(snap);
                }
            }
        }
        Ok(page.apply(out, |s| s.id.locator()))
    }
}

#[async_trait::async_trait]
impl Modifier for LvmBackend {
    fn mutable_keys(&self) -> Vec<&'static str> {
        vec![READ_AHEAD]
    }

    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        read_ahead_value(changes).map(|_| ())
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        _secrets: &Secrets,
    ) -> Result<()> {
        let (class, lv_name) = self.split(id.locator())?;
        if self.class_lv(class, lv_name).await?.is_none() {
            return Err(Error::not_found(format!("volume {id} does not exist")));
        }
        let Some(want) = read_ahead_value(changes)? else {
            return Ok(());
        };
        let target = format!("{}/{lv_name}", class.volume_group);
        // LVM's metadata is the record: read it, change it only if it differs.
        if self.read_ahead(&target).await? == want {
            return Ok(());
        }
        self.runner
            .run(self.lvm("lvchange").args(["--readahead", &want, &target]))
            .await?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Stager for LvmBackend {
    async fn node_attach(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<Attachment> {
        let (class, lv_name) = self.split(id.locator())?;
        let vg = class.volume_group.clone();
        let lv = self
            .class_lv(class, lv_name)
            .await?
            .filter(|lv| !lv.has_tag(DELETING_TAG))
            .ok_or_else(|| Error::not_found(format!("volume {id} does not exist")))?;
        let path = self.activate(&vg, lv_name).await?;
        if lv.has_tag(FRESH_TAG) {
            // A new LV may sit on extents an old one used: clear the start
            // (old filesystem signatures and data) before anything reads it.
            let dev = path_arg(&path)?;
            self.runner
                .run(
                    Command::new("wipefs")
                        .args(["-a", "-q"])
                        .arg(dev.clone())
                        .timeout(LVM_TIMEOUT),
                )
                .await?;
            self.runner
                .run(
                    Command::new("dd")
                        .args([
                            "if=/dev/zero".to_string(),
                            format!("of={dev}"),
                            "bs=1M".into(),
                            "count=1".into(),
                        ])
                        .args(["oflag=direct", "conv=notrunc", "status=none"])
                        .timeout(LVM_TIMEOUT),
                )
                .await?;
            self.runner
                .run(
                    self.lvm("lvchange")
                        .args(["--deltag", FRESH_TAG, &format!("{vg}/{lv_name}")]),
                )
                .await?;
        }
        Ok(Attachment::Device { path })
    }

    async fn node_detach(&self, id: &VolumeId, _attachment: Option<&Attachment>) -> Result<()> {
        let Ok((class, lv_name)) = self.split(id.locator()) else {
            return Ok(());
        };
        if !self.settings.deactivate_on_unstage {
            return Ok(());
        }
        // Done only when lvs says so: an LV left active (lvchange raced a
        // udev scan of the device, or answered 0 and left it) fails the
        // unstage, and the CO calls again. Twice, for the udev race.
        for _ in 0..2 {
            match self.lv(&class.volume_group, lv_name).await? {
                None => return Ok(()),
                Some(lv) if lv.inactive() => return Ok(()),
                Some(_) => self.deactivate(&class.volume_group, lv_name).await?,
            }
        }
        match self.lv(&class.volume_group, lv_name).await? {
            Some(lv) if !lv.inactive() => Err(Error::unavailable(format!(
                "LV {}/{lv_name} is still active (attributes {}) after lvchange -an: is its device in use?",
                class.volume_group, lv.lv_attr
            ))),
            _ => Ok(()),
        }
    }

    async fn node_condition(
        &self,
        id: &VolumeId,
        _attachment: &Attachment,
    ) -> Result<Option<String>> {
        let (class, lv_name) = self.split(id.locator())?;
        Ok(match self.lv(&class.volume_group, lv_name).await? {
            None => Some(format!("LV {}/{lv_name} is gone", class.volume_group)),
            Some(lv) => lv.problem(),
        })
    }
}

#[async_trait::async_trait]
impl DeviceMounter for LvmBackend {
    async fn node_copy_pending(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<bool> {
        let (class, lv_name) = self.split(id.locator())?;
        Ok(self
            .class_lv(class, lv_name)
            .await?
            .is_some_and(|lv| lv.has_tag(COPY_TAG)))
    }

    async fn node_copy_done(&self, id: &VolumeId, _ctx: &AttachContext) -> Result<()> {
        let (class, lv_name) = self.split(id.locator())?;
        self.runner
            .run(self.lvm("lvchange").args([
                "--deltag",
                COPY_TAG,
                &format!("{}/{lv_name}", class.volume_group),
            ]))
            .await?;
        Ok(())
    }

    async fn node_refresh_size(&self, id: &VolumeId, attachment: &Attachment) -> Result<u64> {
        let (class, lv_name) = self.split(id.locator())?;
        let Attachment::Device { path } = attachment else {
            return Err(Error::internal("LVs are block devices"));
        };
        // An active LV's device follows lvextend at once; a refresh covers
        // the case of an extend made while it was active elsewhere.
        self.runner
            .run(
                self.lvm("lvchange")
                    .args(["--refresh", &format!("{}/{lv_name}", class.volume_group)]),
            )
            .await?;
        self.host.device_size(path)
    }
}

#[async_trait::async_trait]
impl BlockTracker for LvmBackend {
    async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        _secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.thin_allocated(snapshot, start, max).await
    }

    async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        _secrets: &Secrets,
    ) -> Result<BlockPage> {
        self.thin_changed(base, target, start, max).await
    }
}

#[cfg(test)]
mod tests;
