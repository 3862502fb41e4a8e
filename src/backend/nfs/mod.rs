//! The `nfs` backend: a volume is a subdirectory of an NFS export. The
//! controller mounts the export in a private working directory to make,
//! archive or remove subdirectories; each node mounts a volume's
//! subdirectory once at its staging path and binds it into every pod, so
//! the pods of a node share one NFS mount.
//!
//! Ids carry the server, the share and the subdirectory
//! (`nfs:v1.<server>.<share>.<subdir>`, see [`crate::plugin::join_fields`]),
//! so any controller replica serves any call and keeps no state of its own.
//! What the share must remember (the CSI name, the size asked for, the
//! delete policy) is a small record under `.ferrovol/volumes` on the share;
//! a directory without a record is not ours and is never touched.

mod btrfs;
mod health;
pub use health::reasons;
mod probe;
mod share;
mod snapshots;
mod stage;
mod volumes;

use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner};
use crate::host::Host;
use crate::mount::MountOptions;
use crate::plugin::{
    check_existing, digest_hex, join_fields, locator_for_name, own_source, split_fields,
    AccessMode, AttachContext, Attachment, Backend, Capacity, ContentSource, CreateSnapshot,
    CreateVolume, Page, Secrets, SnapshotId, SnapshotInfo, VolumeId, VolumeInfo,
};
use crate::plugin::{
    Expander, Groups, Modifier, Provisioner, SnapshotInstant, Snapshotter, Stager,
};
use serde::{Deserialize, Serialize};
use share::{
    blocking, check_subdir, ensure_dir, remove_on_share, resolve, write_on_share, writing, Held,
    ShareSpec, WorkMounts,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The `nfs` kind: a directory (or btrfs subvolume) of an export per
/// volume.
pub const KIND: super::Kind = super::Kind {
    name: "nfs",
    parameters: PARAMETERS,
    mutable: MUTABLE,
    kill_points: KillPoint::NAMES,
    attaches: &[],
    node_token: None,
    reasons: reasons::ALL,
    secrets: &[],
    helpers: &[],
    store: None,
    build: |bc, env| {
        Ok(Arc::new(NfsBackend::new(
            bc.name(),
            bc.settings()?,
            env.runner.clone(),
            env.host.clone(),
            env.mounter.clone(),
            env.state_dir.join("nfs").join(bc.name()),
        )?))
    },
};

crate::kill_points! {
    /// Where a test can kill the driver in this backend's operations
    /// ([`crate::killpoint`]).
    pub enum KillPoint {
        /// a volume made from a source has its record (saying it is being
        /// filled) and its empty directory (on a btrfs export, not yet its
        /// subvolume); the copy or the snapshot has not started.
        Fill = "nfs.fill",
        /// on a btrfs export: the snapshot's subvolume is made under its
        /// temporary name; no record says so.
        SnapshotMade = "nfs.snapshot.made",
    }
}

/// Where ferrovol keeps its records on a share.
const META_DIR: &str = ".ferrovol";
const REMOVE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Archiving, restoring or copying a volume's files.
const COPY_TIMEOUT: Duration = Duration::from_secs(4 * 3600);

/// What happens to a volume's directory when the volume is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnDelete {
    /// Removed with everything in it.
    #[default]
    Delete,
    /// Left as it is.
    Retain,
    /// Renamed aside (`.ferrovol/archive/<subdir>-<time>`), kept.
    Archive,
}

impl OnDelete {
    fn parse(text: &str) -> Result<Self> {
        match text {
            "delete" => Ok(OnDelete::Delete),
            "retain" => Ok(OnDelete::Retain),
            "archive" => Ok(OnDelete::Archive),
            other => Err(Error::invalid(format!(
                "onDelete {other:?} is not one of delete, retain, archive"
            ))),
        }
    }
}

/// One export a backend serves.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExportSettings {
    /// How StorageClasses name it (`export` parameter).
    pub name: String,
    pub server: String,
    /// The exported path (`/` for an NFSv4 pseudo-root).
    pub share: String,
    /// NFS protocol version (`nfsvers=`), e.g. "4.2", "3".
    #[serde(default)]
    pub version: Option<String>,
    #[serde(default)]
    pub mount_options: Vec<String>,
    /// Where the exported directory is on this machine, when it is an XFS
    /// filesystem mounted with project quotas (`prjquota`) that the
    /// controller can reach (it runs on the NFS server, or mounts the
    /// export's filesystem): each volume's capacity is then enforced with
    /// an XFS project quota on its subdirectory. Without it capacity is
    /// advisory.
    #[serde(default)]
    pub xfs_quota_path: Option<PathBuf>,
    /// Where the exported directory is on this machine, when it is on a
    /// btrfs filesystem that the controller can reach (it runs on the NFS
    /// server, or mounts the export's filesystem): each new volume is then
    /// a btrfs subvolume, and a snapshot, a restore and a clone are btrfs
    /// snapshots: one instant of the whole volume, made at once whatever
    /// its size. Without it a snapshot is an archive written file by file.
    #[serde(default)]
    pub btrfs_path: Option<PathBuf>,
}

/// `[[backend]] type = "nfs"` settings.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NfsSettings {
    #[serde(rename = "export", default)]
    pub exports: Vec<ExportSettings>,
    /// The export used when a StorageClass names none (default: the first).
    #[serde(default)]
    pub default_export: Option<String>,
    #[serde(default)]
    pub on_delete: OnDelete,
    /// Mode of a new volume directory (TOML takes `0o2777`).
    #[serde(default = "default_mode")]
    pub directory_mode: u32,
    /// The subdirectory template; `${pvc.metadata.name}`,
    /// `${pvc.metadata.namespace}` and `${pv.metadata.name}` are filled from
    /// what the provisioner passes with `--extra-create-metadata`.
    #[serde(default = "default_sub_dir")]
    pub sub_dir: String,
    /// Mount options for servers a StorageClass names that no export lists.
    #[serde(default)]
    pub mount_options: Vec<String>,
}

fn default_mode() -> u32 {
    0o777
}

fn default_sub_dir() -> String {
    "${pv.metadata.name}".into()
}

/// The record of a volume, on the share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct VolumeRecord {
    name: String,
    subdir: String,
    capacity_bytes: u64,
    on_delete: OnDelete,
    #[serde(default)]
    source: Option<ContentSource>,
    /// The XFS project that enforces the capacity, when the export has
    /// quotas.
    #[serde(default)]
    project_id: Option<u32>,
    /// The directory's mode, when a mutable `mountPermissions` set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mode: Option<u32>,
    /// Being filled from its source: the directory may hold part of it
    /// (the driver died while it was filled). A retry of the CreateVolume
    /// empties it and fills it again; nothing lists it meanwhile.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    filling: bool,
}

/// The record of a snapshot, beside its archive on the share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SnapshotRecord {
    name: String,
    source_volume: VolumeId,
    /// The source's size: what a volume restored from it needs.
    size_bytes: u64,
    created_unix_secs: u64,
}

/// Where a volume lives.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Location {
    server: String,
    share: String,
    subdir: PathBuf,
}

/// Whether `server` is a host name, an IPv4 address or a bracketed IPv6
/// address: nothing a mount helper could take for an option or a path.
fn check_server(server: &str) -> Result<()> {
    let ok = if let Some(inner) = server.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        !inner.is_empty()
            && inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
    } else {
        !server.is_empty()
            && server.len() <= 253
            && server
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
            && !server.starts_with(['-', '.'])
    };
    if !ok {
        return Err(Error::invalid(format!(
            "NFS server {server:?} is not a host name or an IP address"
        )));
    }
    Ok(())
}

/// Whether `share` is an absolute path of plain components.
fn check_share(share: &str) -> Result<()> {
    let ok = share.starts_with('/')
        && share.len() <= 200
        && share.split('/').all(|c| {
            c.is_empty()
                || (c != "."
                    && c != ".."
                    && c.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
        });
    if !ok {
        return Err(Error::invalid(format!(
            "NFS share {share:?} must be an absolute path of letters, digits, '.', '_' and '-'"
        )));
    }
    Ok(())
}

/// `share` and `subdir` as one path on the server.
fn remote_path(share: &str, subdir: &Path) -> String {
    let base = share.trim_end_matches('/');
    format!("{base}/{}", subdir.display())
}

/// The StorageClass parameters this backend takes.
pub const PARAMETERS: &[&str] = &[
    "export",
    "server",
    "share",
    "subDir",
    "onDelete",
    "mountPermissions",
];

/// The mutable parameters: the volume directory's mode, and what
/// DeleteVolume does with it.
pub const MUTABLE: &[&str] = &["mountPermissions", "onDelete"];

/// Mutable parameters, parsed.
#[derive(Debug, Default)]
struct Changes {
    mode: Option<u32>,
    on_delete: Option<OnDelete>,
}

impl Changes {
    fn parse(changes: &BTreeMap<String, String>) -> Result<Self> {
        let mode = match changes.get("mountPermissions") {
            Some(v) => Some(parse_mode(v).map_err(|e| e.context("mutable parameter"))?),
            None => None,
        };
        let on_delete = match changes.get("onDelete") {
            Some(v) => Some(OnDelete::parse(v).map_err(|e| e.context("mutable parameter"))?),
            None => None,
        };
        Ok(Self { mode, on_delete })
    }
}

/// An octal directory mode (`mountPermissions`).
fn parse_mode(v: &str) -> Result<u32> {
    u32::from_str_radix(v, 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| Error::invalid(format!("mountPermissions {v:?} is not an octal mode")))
}

/// Sets the mode of the volume directory `rel` under `root` (never through
/// a symlink); returns the mode it had.
fn set_mode(root: &Path, rel: &Path, mode: u32) -> Result<u32> {
    use std::os::unix::fs::PermissionsExt;
    let dir = share::resolve(root, rel)?
        .ok_or_else(|| Error::not_found(format!("{} is gone from the share", rel.display())))?;
    let old = std::fs::symlink_metadata(&dir)
        .map_err(|e| Error::io(format!("inspect {}", dir.display()), e))?
        .permissions()
        .mode()
        & 0o7777;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {}", dir.display()), e))?;
    Ok(old)
}

/// The backend.
pub struct NfsBackend {
    name: String,
    settings: NfsSettings,
    runner: Arc<dyn CommandRunner>,
    host: Arc<dyn Host>,
    mounts: Arc<WorkMounts>,
}

impl NfsBackend {
    pub fn new(
        name: &str,
        settings: NfsSettings,
        runner: Arc<dyn CommandRunner>,
        host: Arc<dyn Host>,
        mounter: Arc<dyn crate::mount::Mounter>,
        work_dir: PathBuf,
    ) -> Result<Self> {
        let mut seen = Vec::new();
        for e in &settings.exports {
            if !crate::plugin::is_dns_label(&e.name) || seen.contains(&e.name) {
                return Err(Error::invalid(format!(
                    "nfs export {:?}: names are unique lowercase DNS labels",
                    e.name
                )));
            }
            seen.push(e.name.clone());
            check_server(&e.server)?;
            check_share(&e.share)?;
            MountOptions::parse(&Self::options_of(e), false)
                .map_err(|err| err.context(format!("nfs export {:?}", e.name)))?;
            for (key, local) in [
                ("xfs_quota_path", &e.xfs_quota_path),
                ("btrfs_path", &e.btrfs_path),
            ] {
                let Some(q) = local else { continue };
                let plain = q.is_absolute()
                    && q.to_str().is_some_and(|t| {
                        t.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"/._-".contains(&b))
                    })
                    && !q.components().any(|c| c == std::path::Component::ParentDir);
                if !plain {
                    return Err(Error::invalid(format!(
                        "nfs export {:?}: {key} must be an absolute path of plain characters",
                        e.name
                    )));
                }
            }
            if e.xfs_quota_path.is_some() && e.btrfs_path.is_some() {
                return Err(Error::invalid(format!(
                    "nfs export {:?}: xfs_quota_path and btrfs_path name one filesystem of two types",
                    e.name
                )));
            }
        }
        if let Some(d) = &settings.default_export {
            if !seen.contains(d) {
                return Err(Error::invalid(format!(
                    "default_export {d:?} is not configured"
                )));
            }
        }
        MountOptions::parse(&settings.mount_options, false)?;
        if settings.directory_mode > 0o7777 {
            return Err(Error::invalid("directory_mode must be at most 0o7777"));
        }
        crate::config::absolute(&work_dir, "nfs working directory")?;
        let mounts = WorkMounts::new(work_dir, runner.clone(), mounter);
        Ok(Self {
            name: name.to_string(),
            settings,
            runner,
            host,
            mounts,
        })
    }

    fn options_of(export: &ExportSettings) -> Vec<String> {
        let mut o = export.mount_options.clone();
        if let Some(v) = &export.version {
            o.push(format!("nfsvers={v}"));
        }
        o
    }

    /// The configured export of a server and share, if one lists them.
    fn export_at(&self, server: &str, share: &str) -> Option<&ExportSettings> {
        self.settings
            .exports
            .iter()
            .find(|e| e.server == server && e.share == share)
    }

    /// The mount options for a server and share: the export's that lists
    /// them, else the backend's.
    fn options_for(&self, server: &str, share: &str) -> Vec<String> {
        self.export_at(server, share)
            .map(Self::options_of)
            .unwrap_or_else(|| self.settings.mount_options.clone())
    }

    fn spec(&self, server: &str, share: &str) -> ShareSpec {
        ShareSpec {
            source: format!("{server}:{share}"),
            options: self.options_for(server, share),
        }
    }

    /// The server and share a StorageClass picks.
    fn export_for(&self, p: &BTreeMap<String, String>) -> Result<(String, String)> {
        match (p.get("server"), p.get("share"), p.get("export")) {
            (Some(server), Some(share), None) => {
                check_server(server)?;
                check_share(share)?;
                Ok((server.clone(), share.clone()))
            }
            (None, None, named) => {
                let wanted = named.or(self.settings.default_export.as_ref());
                let export = match wanted {
                    Some(n) => self.settings.exports.iter().find(|e| &e.name == n),
                    None => self.settings.exports.first(),
                }
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "no export {:?} is configured for backend {}",
                        wanted.map(String::as_str).unwrap_or("(any)"),
                        self.name
                    ))
                })?;
                Ok((export.server.clone(), export.share.clone()))
            }
            _ => Err(Error::invalid(
                "name an export, or both server and share, not a mix",
            )),
        }
    }

    /// The subdirectory for a new volume, from the template.
    fn subdir_for(&self, req: &CreateVolume) -> Result<PathBuf> {
        let template = req
            .parameters
            .get("subDir")
            .unwrap_or(&self.settings.sub_dir);
        let mut out = String::new();
        let mut rest = template.as_str();
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let end = rest[start..]
                .find('}')
                .ok_or_else(|| Error::invalid(format!("subDir {template:?}: unclosed ${{")))?;
            let var = &rest[start + 2..start + end];
            let key = match var {
                "pvc.metadata.name" => "csi.storage.k8s.io/pvc/name",
                "pvc.metadata.namespace" => "csi.storage.k8s.io/pvc/namespace",
                "pv.metadata.name" => "csi.storage.k8s.io/pv/name",
                other => {
                    return Err(Error::invalid(format!(
                        "subDir {template:?}: unknown variable {other:?}"
                    )))
                }
            };
            let value = match req.metadata.get(key) {
                Some(v) => v.clone(),
                // Without the provisioner's metadata (a hand call), the PV
                // name is the CSI name, as the provisioner makes it.
                None if var == "pv.metadata.name" => locator_for_name(&req.name),
                None => {
                    return Err(Error::invalid(format!(
                        "subDir uses ${{{var}}}: run the provisioner with --extra-create-metadata"
                    )))
                }
            };
            out.push_str(&value);
            rest = &rest[start + end + 1..];
        }
        out.push_str(rest);
        check_subdir(&out)
    }

    fn location_for(&self, req: &CreateVolume) -> Result<Location> {
        let (server, share) = self.export_for(&req.parameters)?;
        Ok(Location {
            server,
            share,
            subdir: self.subdir_for(req)?,
        })
    }

    fn id_of(&self, loc: &Location) -> Result<VolumeId> {
        let subdir = loc.subdir.to_string_lossy();
        VolumeId::new(
            &self.name,
            &join_fields(&[&loc.server, &loc.share, &subdir])?,
        )
    }

    /// Where the volume of an id lives; NOT_FOUND for ids this backend
    /// never minted or whose fields are not safe.
    fn locate(&self, id: &VolumeId) -> Result<Location> {
        let not_ours = || Error::no_volume(id);
        let fields = split_fields(id.locator(), 3).map_err(|_| not_ours())?;
        let [server, share, subdir]: [String; 3] = fields.try_into().map_err(|_| not_ours())?;
        check_server(&server).map_err(|_| not_ours())?;
        check_share(&share).map_err(|_| not_ours())?;
        let subdir = check_subdir(&subdir).map_err(|_| not_ours())?;
        Ok(Location {
            server,
            share,
            subdir,
        })
    }

    async fn hold(&self, loc: &Location) -> Result<Held> {
        self.hold_share(&loc.server, &loc.share).await
    }

    /// The share's root, held: mounted in the working directory, or, for an
    /// export with `btrfs_path`, that local path itself (everything on
    /// such an export is done there, never through an NFS client's caches).
    async fn hold_share(&self, server: &str, share: &str) -> Result<Held> {
        match self.btrfs_root(server, share) {
            Some(b) => {
                let b = b.to_path_buf();
                let root = b.clone();
                blocking("inspecting btrfs_path", move || btrfs::check_root(&root)).await?;
                Ok(self.mounts.local(b))
            }
            None => self.mounts.hold(&self.spec(server, share)).await,
        }
    }

    fn record_path(root: &Path, subdir: &Path) -> PathBuf {
        root.join(META_DIR).join("volumes").join(format!(
            "{}.json",
            digest_hex(subdir.as_os_str().as_encoded_bytes(), 16)
        ))
    }

    fn info(&self, loc: &Location, record: &VolumeRecord) -> Result<VolumeInfo> {
        Ok(VolumeInfo {
            id: self.id_of(loc)?,
            capacity_bytes: record.capacity_bytes,
            context: BTreeMap::new(),
            source: record.source.clone(),
        })
    }

    async fn read_record(root: &Path, subdir: &Path) -> Result<Option<VolumeRecord>> {
        let path = Self::record_path(root, subdir);
        blocking("reading a volume record", move || {
            crate::records::read_json(&path)
        })
        .await
    }

    async fn write_record(held: &Held, record: &VolumeRecord) -> Result<()> {
        let path = Self::record_path(&held.dir, Path::new(&record.subdir));
        let bytes = crate::records::encode_record(&path.display().to_string(), record)?;
        let (root, on_nfs) = (held.dir.clone(), held.on_nfs);
        writing("writing a volume record", move || {
            ensure_dir(&root, Path::new(".ferrovol/volumes"), 0o700)?;
            write_on_share(on_nfs, &path, &bytes)
        })
        .await
    }
}

/// XFS project quotas on an export's filesystem, reached locally.
impl NfsBackend {
    /// The local path of the export (server, share), when it has quotas.
    fn quota_path(&self, server: &str, share: &str) -> Option<&Path> {
        self.export_at(server, share)
            .and_then(|e| e.xfs_quota_path.as_deref())
    }

    /// The project id of a volume: from its subdirectory, never 0.
    fn project_id(subdir: &Path) -> u32 {
        let hex = digest_hex(subdir.as_os_str().as_encoded_bytes(), 4);
        (u32::from_str_radix(&hex, 16).unwrap_or(1) & 0x7fff_ffff).max(1)
    }

    /// Runs one xfs_quota expert command on the filesystem holding `path`.
    async fn xfs_quota(&self, path: &Path, command: String) -> Result<()> {
        let mount = self
            .runner
            .run(
                Command::new("findmnt")
                    .args(["-n", "-o", "TARGET", "-T"])
                    .arg(path_arg(path)?)
                    .timeout(Duration::from_secs(30)),
            )
            .await?;
        let mount = mount.stdout.trim().to_string();
        if mount.is_empty() {
            return Err(Error::internal(format!(
                "no filesystem holds {}",
                path.display()
            )));
        }
        self.runner
            .run(
                Command::new("xfs_quota")
                    .args(["-x", "-c", &command])
                    .arg(mount)
                    .timeout(Duration::from_secs(120)),
            )
            .await
            .map_err(|e| Error::from(e).context("set the volume's XFS project quota"))?;
        Ok(())
    }

    /// Puts a volume's directory under its project and limits it.
    async fn apply_quota(&self, loc: &Location, project: u32, bytes: u64) -> Result<()> {
        let Some(base) = self.quota_path(&loc.server, &loc.share) else {
            return Ok(());
        };
        let (base, subdir) = (base.to_path_buf(), loc.subdir.clone());
        let dir = blocking("finding the volume on the local filesystem", move || {
            resolve(&base, &subdir)
        })
        .await?
        .ok_or_else(|| {
            Error::precondition(format!(
                "{} is not under the export's local path: check xfs_quota_path",
                loc.subdir.display()
            ))
        })?;
        let dir_arg = path_arg(&dir)?;
        self.xfs_quota(&dir, format!("project -s -p {dir_arg} {project}"))
            .await?;
        self.set_limit(loc, project, bytes).await
    }

    async fn set_limit(&self, loc: &Location, project: u32, bytes: u64) -> Result<()> {
        let Some(base) = self.quota_path(&loc.server, &loc.share) else {
            return Ok(());
        };
        let base = base.to_path_buf();
        self.xfs_quota(&base, format!("limit -p bhard={bytes} {project}"))
            .await
    }
}

/// Subvolumes on an export's btrfs filesystem, reached locally.
impl NfsBackend {
    /// The local path of the export (server, share), when it is btrfs.
    fn btrfs_root(&self, server: &str, share: &str) -> Option<&Path> {
        self.export_at(server, share)
            .and_then(|e| e.btrfs_path.as_deref())
    }

    /// The subvolume a new volume under `root` can be a snapshot of: its
    /// source's, when that is a subvolume on the same filesystem (the same
    /// export's `btrfs_path`); None when the source must be copied.
    /// NOT_FOUND when the source does not exist.
    async fn subvolume_source(
        &self,
        source: &ContentSource,
        root: &Path,
    ) -> Result<Option<PathBuf>> {
        let same = |server: &str, share: &str| self.btrfs_root(server, share) == Some(root);
        let root = root.to_path_buf();
        match source {
            ContentSource::Snapshot(id) => {
                own_source(&self.name, source)?;
                let (server, share, locator) = self.locate_snapshot(id)?;
                if !same(&server, &share) {
                    return Ok(None);
                }
                if Self::read_snapshot(&root, &locator).await?.is_none() {
                    return Err(Error::not_found(format!(
                        "source snapshot {id} does not exist"
                    )));
                }
                let snap = Self::snapshot_dir(&root).join(format!("{locator}.snap"));
                Ok(btrfs::is_subvolume(&snap).then_some(snap))
            }
            ContentSource::Volume(id) => {
                own_source(&self.name, source)?;
                let loc = self.locate(id)?;
                if !same(&loc.server, &loc.share) {
                    return Ok(None);
                }
                if Self::read_record(&root, &loc.subdir).await?.is_none() {
                    return Err(Error::not_found(format!(
                        "source volume {id} does not exist"
                    )));
                }
                let subdir = loc.subdir.clone();
                let dir = blocking("inspecting the source", move || resolve(&root, &subdir))
                    .await?
                    .ok_or_else(|| {
                        Error::not_found(format!("source volume {id} has no directory"))
                    })?;
                Ok(btrfs::is_subvolume(&dir).then_some(dir))
            }
        }
    }

    /// Makes a volume's directory on a btrfs export: a subvolume, empty or
    /// a snapshot of its source's, or filled by a copy where the source is
    /// no subvolume of this filesystem. Answers its local path.
    async fn make_subvolume(
        &self,
        root: &Path,
        subdir: &Path,
        mode: u32,
        source: Option<&ContentSource>,
    ) -> Result<PathBuf> {
        let parent = {
            let (root, parent) = (
                root.to_path_buf(),
                subdir.parent().unwrap_or(Path::new("")).to_path_buf(),
            );
            blocking("making the volume's parent", move || {
                ensure_dir(&root, &parent, mode)
            })
            .await?
        };
        let name = subdir
            .file_name()
            .ok_or_else(|| Error::internal(format!("no name in {}", subdir.display())))?;
        let target = parent.join(name);
        let from = match source {
            Some(s) => {
                crate::killpoint::hit(KillPoint::Fill);
                self.subvolume_source(s, root).await?
            }
            None => None,
        };
        if let Some(from) = from {
            btrfs::snapshot(self.runner.as_ref(), &from, &target, false).await?;
            return Ok(target);
        }
        btrfs::create(self.runner.as_ref(), &target).await?;
        {
            let target = target.clone();
            blocking("setting the volume's mode", move || {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| Error::io(format!("chmod {}", target.display()), e))
            })
            .await?;
        }
        if let Some(s) = source {
            self.fill_from(s, &target).await?;
        }
        Ok(target)
    }

    /// Removes a volume's directory `dir`: its subvolume, where it is one
    /// on a btrfs export, else the tree.
    async fn remove_volume_dir(&self, loc: &Location, dir: PathBuf) -> Result<()> {
        if self.btrfs_root(&loc.server, &loc.share).is_some() && btrfs::is_subvolume(&dir) {
            return btrfs::delete(self.runner.as_ref(), &dir).await;
        }
        crate::host::off_worker("removing the volume directory", REMOVE_TIMEOUT, move || {
            crate::host::remove_tree(&dir)
        })
        .await
    }

    /// Copies the tree under `from` into the directory `into`, links kept
    /// as links.
    async fn copy_tree(&self, from: &Path, into: &Path, what: &str) -> Result<()> {
        self.runner
            .run(
                Command::new("cp")
                    .args(["-a", "--no-dereference", "--"])
                    .arg(format!("{}/.", path_arg(from)?))
                    .arg(format!("{}/", path_arg(into)?))
                    .timeout(COPY_TIMEOUT),
            )
            .await
            .map_err(|e| Error::from(e).context(what.to_string()))?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl Backend for NfsBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static super::Kind {
        &KIND
    }

    async fn start(&self) -> Result<()> {
        let left = self.mounts.release_all().await;
        if left > 0 {
            tracing::info!(backend = %self.name, released = left, "released working mounts an earlier run left");
        }
        Ok(())
    }

    async fn stop(&self) {
        self.mounts.release_all().await;
    }

    fn fs_types(&self) -> &'static [&'static str] {
        &["nfs", "nfs4"]
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    /// Whether each configured export's server answers this node (an RPC
    /// NULL call on its NFS port; see [`probe`]), all asked at once.
    async fn storage_findings(&self) -> Vec<crate::plugin::health::StorageFinding> {
        self.servers_not_answering(probe::WITHIN).await
    }

    fn validate_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        for (k, v) in parameters {
            match k.as_str() {
                "onDelete" => {
                    OnDelete::parse(v)?;
                }
                "mountPermissions" => {
                    parse_mode(v)?;
                }
                _ => {}
            }
        }
        self.export_for(parameters).map(|_| ())
    }

    fn access_modes(&self) -> Vec<AccessMode> {
        vec![
            AccessMode::SingleNodeWriter,
            AccessMode::SingleNodeReaderOnly,
            AccessMode::MultiNodeReaderOnly,
            AccessMode::MultiNodeSingleWriter,
            AccessMode::MultiNodeMultiWriter,
            AccessMode::SingleNodeSingleWriter,
            AccessMode::SingleNodeMultiWriter,
        ]
    }

    fn health_reporter(&self) -> Option<&dyn crate::plugin::HealthReporter> {
        Some(self)
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
}

#[cfg(test)]
mod tests;
