//! The `file` backend: volumes are sparse image files in a pool directory,
//! attached as loop devices on the node. The embedded default: it needs
//! nothing but a Linux kernel with loop devices.
//!
//! Layout: `<pool>/volumes/<locator>.img` with `<locator>.json` beside it
//! (the CSI name, size and source), and the same under `<pool>/snapshots`.
//! A volume exists when both files do; an image is written under a temporary
//! name and renamed into place after its metadata, so a crash never leaves a
//! half-made volume that looks whole.

mod health;
pub use health::reasons;
mod snapshots;
mod stage;
mod volumes;

use crate::config::Size;
use crate::error::{Error, Kind, Result};
use crate::exec::path_arg;
use crate::exec::{Command, CommandRunner};
use crate::host::loopdev::LoopDevices;
use crate::host::Host;
use crate::plugin::{
    check_existing, locator_for_name, own_source, AttachContext, Attachment, Backend, BlockPage,
    Capacity, ContentSource, CreateSnapshot, CreateVolume, Page, Secrets, SizeRules, SnapshotId,
    SnapshotInfo, VolumeId, VolumeInfo,
};
use crate::plugin::{
    AccessMode, BlockTracker, DeviceMounter, Expander, Groups, Modifier, Provisioner,
    SnapshotInstant, Snapshotter, Stager, SINGLE_NODE_MODES,
};
use crate::records::read_json;
use crate::sync::LockExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The backend a driver started without a config serves
/// ([`super::built_in`]): a file backend whose pool is the state
/// directory's `pool`.
pub fn built_in(state_dir: &Path) -> crate::config::BackendConfig {
    crate::config::BackendConfig {
        kind: KIND.name.into(),
        name: None,
        settings: toml::Table::from_iter([(
            "pool".into(),
            toml::Value::String(state_dir.join("pool").display().to_string()),
        )]),
    }
}

/// The `file` kind: image files in a pool, attached as loop devices.
pub const KIND: super::Kind = super::Kind {
    name: "file",
    parameters: &[],
    mutable: &[PREALLOCATE],
    kill_points: &[],
    attaches: &[],
    node_token: None,
    reasons: reasons::ALL,
    secrets: &[],
    helpers: &[],
    store: Some(super::StoreKind {
        punches_holes: true,
        as_store: |_| {},
    }),
    build: |bc, env| {
        Ok(Arc::new(FileBackend::new(
            bc.name(),
            bc.settings()?,
            env.runner.clone(),
            env.host.clone(),
        )?))
    },
};

const MIB: u64 = 1 << 20;
const COPY_TIMEOUT: Duration = Duration::from_secs(3600);
/// The unit changed block tracking compares and reports in: the pool's
/// filesystem block.
const CBT_BLOCK: u64 = 4096;

/// `[[backend]] type = "file"` settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSettings {
    /// The pool directory (absolute).
    pub pool: PathBuf,
    /// Size of a volume whose request names none.
    #[serde(default = "default_size")]
    pub default_volume_size: Size,
    /// The largest volume this pool creates.
    #[serde(default = "max_size")]
    pub max_volume_size: Size,
}

fn default_size() -> Size {
    Size(1 << 30)
}
fn max_size() -> Size {
    Size(1 << 40)
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct VolumeMeta {
    name: String,
    capacity_bytes: u64,
    source: Option<ContentSource>,
    /// A copy whose filesystem still has its source's UUID (cleared at
    /// its first stage, once the node gave it its own).
    #[serde(default)]
    copy_pending: bool,
    /// Every block of the image allocated (mutable `preallocate`): its
    /// writes never meet a full pool, and an expansion allocates too.
    #[serde(default)]
    preallocated: bool,
}

/// The mutable parameter that allocates a volume's whole image.
pub const PREALLOCATE: &str = "preallocate";

/// `preallocate`'s value.
fn preallocate_value(changes: &BTreeMap<String, String>) -> Result<Option<bool>> {
    crate::plugin::mutable_bool(changes, PREALLOCATE)
}

/// Allocates `image`'s blocks up to `len` bytes (its size stays).
async fn allocate(image: PathBuf, len: u64) -> Result<()> {
    crate::host::off_worker("allocating the image", COPY_TIMEOUT, move || {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .map_err(io("open image"))?;
        let len = i64::try_from(len).map_err(|_| Error::invalid("image size out of range"))?;
        nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, len)
            .map_err(|e| Error::io("allocate image", e.into()))?;
        f.sync_all().map_err(io("sync image"))
    })
    .await
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SnapshotMeta {
    name: String,
    source_volume: VolumeId,
    size_bytes: u64,
    created_unix_nanos: u128,
}

/// The backend.
pub struct FileBackend {
    name: String,
    settings: FileSettings,
    volumes: PathBuf,
    snapshots: PathBuf,
    runner: Arc<dyn CommandRunner>,
    host: Arc<dyn Host>,
    loops: LoopDevices,
    /// The locators in the pool, read once at start and kept as volumes
    /// and snapshots come and go, so a page of a listing reads only its
    /// own entries. No lock is needed around an image's "check, then act"
    /// steps: the operation guard already covers every id an operation
    /// touches (a copy's source included), in both services.
    index: PoolIndex,
}

/// The locators of the pool's volumes and snapshots, sorted.
#[derive(Debug, Default)]
struct PoolIndex {
    volumes: Mutex<BTreeSet<String>>,
    snapshots: Mutex<BTreeSet<String>>,
}

/// The page of `set` after the cursor.
fn page_of(set: &Mutex<BTreeSet<String>>, page: &Page) -> Vec<String> {
    use std::ops::Bound::{Excluded, Unbounded};
    let set = set.locked();
    let lower = match &page.after {
        Some(a) => Excluded(a.clone()),
        None => Unbounded,
    };
    set.range((lower, Unbounded))
        .take(page.limit)
        .cloned()
        .collect()
}

fn index_put(set: &Mutex<BTreeSet<String>>, locator: &str) {
    set.locked().insert(locator.to_string());
}

fn index_remove(set: &Mutex<BTreeSet<String>>, locator: &str) {
    set.locked().remove(locator);
}

fn io(context: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::io(context, e)
}

/// Writes a metadata file atomically and durably (fsynced), off the async
/// workers: an fsync can take its time on a busy disk.
async fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let bytes = crate::records::encode_record(&path.display().to_string(), value)?;
    let path = path.to_path_buf();
    crate::host::off_worker("writing volume metadata", RECORD_DEADLINE, move || {
        crate::records::write(&path, &bytes)
    })
    .await
}

/// How long a metadata write may take before its call gives up.
const RECORD_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// The locators with a metadata file in a pool folder, sorted.
fn locators_in(dir: &Path) -> Result<Vec<String>> {
    let entries = std::fs::read_dir(dir).map_err(io(format!("read {}", dir.display())))?;
    let mut locators: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".json"))
                .map(str::to_string)
        })
        .filter(|l| crate::plugin::is_locator(l))
        .collect();
    locators.sort();
    Ok(locators)
}

fn remove_if_exists(path: &Path) -> Result<()> {
    crate::records::remove(path).map(drop)
}

impl FileBackend {
    pub fn new(
        name: &str,
        settings: FileSettings,
        runner: Arc<dyn CommandRunner>,
        host: Arc<dyn Host>,
    ) -> Result<Self> {
        crate::config::absolute(&settings.pool, "file pool")?;
        let volumes = settings.pool.join("volumes");
        let snapshots = settings.pool.join("snapshots");
        for d in [&settings.pool, &volumes, &snapshots] {
            crate::records::private_dir(d)?;
        }
        for d in [&volumes, &snapshots] {
            // Leftovers of an interrupted create or copy.
            for entry in std::fs::read_dir(d)
                .map_err(io(format!("read {}", d.display())))?
                .flatten()
            {
                if entry.file_name().to_string_lossy().ends_with(".tmp") {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        let loops = LoopDevices::new();
        let index = PoolIndex {
            volumes: Mutex::new(locators_in(&volumes)?.into_iter().collect()),
            snapshots: Mutex::new(locators_in(&snapshots)?.into_iter().collect()),
        };
        Ok(Self {
            name: name.to_string(),
            settings,
            volumes,
            snapshots,
            runner,
            loops,
            index,
            host,
        })
    }

    /// Same, with loop devices read from a fixture sysfs (tests).
    pub fn with_loops(mut self, loops: LoopDevices) -> Self {
        self.loops = loops;
        self
    }

    fn image(&self, locator: &str) -> PathBuf {
        self.volumes.join(format!("{locator}.img"))
    }
    fn meta(&self, locator: &str) -> PathBuf {
        self.volumes.join(format!("{locator}.json"))
    }
    fn snap_image(&self, locator: &str) -> PathBuf {
        self.snapshots.join(format!("{locator}.img"))
    }
    fn snap_meta(&self, locator: &str) -> PathBuf {
        self.snapshots.join(format!("{locator}.json"))
    }

    fn own(&self, backend: &str) -> Result<()> {
        if backend != self.name {
            return Err(Error::internal(format!(
                "id of backend {backend} sent to backend {}",
                self.name
            )));
        }
        Ok(())
    }

    fn load_volume(&self, locator: &str) -> Result<Option<(VolumeMeta, u64)>> {
        let Some(meta) = read_json::<VolumeMeta>(&self.meta(locator))? else {
            return Ok(None);
        };
        match std::fs::metadata(self.image(locator)) {
            Ok(m) => Ok(Some((meta, m.len()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("stat image", e)),
        }
    }

    fn volume_info(&self, locator: &str, meta: VolumeMeta, size: u64) -> Result<VolumeInfo> {
        Ok(VolumeInfo {
            id: VolumeId::new(&self.name, locator)?,
            capacity_bytes: size,
            context: BTreeMap::new(),
            source: meta.source,
        })
    }

    fn load_snapshot(&self, locator: &str) -> Result<Option<SnapshotMeta>> {
        let Some(meta) = read_json::<SnapshotMeta>(&self.snap_meta(locator))? else {
            return Ok(None);
        };
        Ok(self.snap_image(locator).exists().then_some(meta))
    }

    /// A snapshot of this pool's image and metadata, or NOT_FOUND.
    fn snapshot_image(&self, id: &SnapshotId) -> Result<(PathBuf, SnapshotMeta)> {
        self.own(id.backend())?;
        let meta = self
            .load_snapshot(id.locator())?
            .ok_or_else(|| Error::no_snapshot(id))?;
        Ok((self.snap_image(id.locator()), meta))
    }

    fn snapshot_info(&self, locator: &str, meta: SnapshotMeta) -> Result<SnapshotInfo> {
        Ok(SnapshotInfo {
            id: SnapshotId::new(&self.name, locator)?,
            source_volume: meta.source_volume,
            size_bytes: meta.size_bytes,
            created: UNIX_EPOCH + Duration::from_nanos(meta.created_unix_nanos as u64),
            ready: true,
            group: None,
        })
    }

    fn free_bytes(&self) -> Result<u64> {
        Ok(self.host.fs_usage(&self.settings.pool)?.available_bytes)
    }

    /// Room for a volume to grow by `bytes`: more than the whole pool
    /// can never be (OUT_OF_RANGE, final: the CO lets the user ask for
    /// less); more than is free now may be later (RESOURCE_EXHAUSTED).
    fn ensure_growth(&self, bytes: u64) -> Result<()> {
        let usage = self.host.fs_usage(&self.settings.pool)?;
        crate::error::room(
            bytes,
            format_args!("pool {}", self.settings.pool.display()),
            usage.total_bytes,
            usage.available_bytes,
        )
    }

    fn ensure_space(&self, bytes: u64) -> Result<()> {
        let free = self.free_bytes()?;
        if bytes > free {
            return Err(Error::no_room(
                format_args!("pool {}", self.settings.pool.display()),
                free,
                bytes,
            ));
        }
        Ok(())
    }

    /// Copies an image, sharing blocks (reflink) where the filesystem can and
    /// keeping holes either way.
    async fn copy_image(&self, from: &Path, to: &Path) -> Result<()> {
        self.runner
            .run(
                Command::new("cp")
                    .args(["--reflink=auto", "--sparse=always", "--"])
                    .arg(path_arg(from)?)
                    .arg(path_arg(to)?)
                    .timeout(COPY_TIMEOUT),
            )
            .await?;
        // The copy has its source's mode from cp: volume data is root's
        // alone whatever the source was.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o600))
            .map_err(io(format!("chmod {}", to.display())))
    }

    /// How this pool sizes volumes: whole MiB, up to its maximum.
    fn size_rules(&self) -> SizeRules {
        SizeRules {
            step: MIB,
            default: self.settings.default_volume_size.0,
            max: Some(self.settings.max_volume_size.0),
        }
    }

    /// A new volume's source image, if any (it must exist), and the size
    /// it sets as the minimum.
    fn create_source(&self, req: &CreateVolume) -> Result<(Option<PathBuf>, u64)> {
        match &req.source {
            None => Ok((None, 0)),
            Some(src @ ContentSource::Snapshot(id)) => {
                let locator = own_source(&self.name, src)?;
                let meta = self.load_snapshot(locator)?.ok_or_else(|| {
                    Error::not_found(format!("source snapshot {id} does not exist"))
                })?;
                Ok((Some(self.snap_image(locator)), meta.size_bytes))
            }
            Some(src @ ContentSource::Volume(id)) => {
                let locator = own_source(&self.name, src)?;
                let (_, size) = self.load_volume(locator)?.ok_or_else(|| {
                    Error::not_found(format!("source volume {id} does not exist"))
                })?;
                Ok((Some(self.image(locator)), size))
            }
        }
    }

    /// Makes the image file at `tmp`: a copy of `source`, or empty; then
    /// sized and synced off the async workers (a copy's sync writes out
    /// gigabytes).
    async fn make_image(&self, source: Option<&Path>, tmp: &Path, size: u64) -> Result<()> {
        match source {
            Some(src) => self.copy_image(src, tmp).await?,
            None => {
                use std::os::unix::fs::OpenOptionsExt;
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(tmp)
                    .map_err(io(format!("create {}", tmp.display())))?;
            }
        }
        let path = tmp.to_path_buf();
        crate::host::off_worker("syncing the new image", COPY_TIMEOUT, move || {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(io("open new image"))?;
            if f.metadata().map_err(io("stat new image"))?.len() < size {
                f.set_len(size).map_err(io("size new image"))?;
            }
            f.sync_all().map_err(io("sync new image"))
        })
        .await
    }
}

#[async_trait::async_trait]
impl Backend for FileBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static super::Kind {
        &KIND
    }

    async fn health(&self) -> Result<()> {
        for d in [&self.volumes, &self.snapshots] {
            self.host
                .writable_dir(d)
                .map_err(|e| Error::precondition(format!("pool folder: {}", e.message)))?;
        }
        Ok(())
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

    fn health_reporter(&self) -> Option<&dyn crate::plugin::HealthReporter> {
        Some(self)
    }

    async fn storage_findings(&self) -> Vec<crate::plugin::health::StorageFinding> {
        self.pool_findings()
    }

    fn stager(&self) -> Option<&dyn Stager> {
        Some(self)
    }

    fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
        Some(self)
    }

    fn block_tracker(&self) -> Option<&dyn BlockTracker> {
        Some(self)
    }
}

#[cfg(test)]
mod tests;
