//! The `rbd` backend: block volumes from a Ceph cluster, through librbd on
//! kept connections or the `rbd` command line (`cluster.rs` is the seam;
//! docs/backends/rbd.md says why, docs/performance.md what each costs); nodes map with `rbd device
//! map`.
//!
//! A volume is image `fv-<name>` in a pool (and namespace) the config
//! allows; its CSI name, source and attachments are image metadata, so
//! any controller replica sees them. A snapshot is an image of its own,
//! `fvs-<name>`: a clone (format 2) of a moment of its source (its cut,
//! which the source keeps), so volumes and snapshots can be deleted in any
//! order. A restore clones that cut while the source keeps it, else the
//! snapshot image's own snapshot `base` (taken at the first restore that
//! needs it): a snapshot costs the cluster one snapshot, a restore none.
//! An image that still has clone children goes to the trash instead and
//! is purged once they are gone. Clone chains are flattened past
//! `max_clone_depth`.

mod cli;
mod cluster;
mod creds;
mod librbd;
#[cfg(test)]
mod tests;

use crate::error::{Error, Kind, Result};
use crate::exec::CommandRunner;
use crate::plugin::{
    check_existing, check_publish_terms, join_fields, locator_for_name, node_name, node_tokens,
    split_fields, AccessMode, AccessType, AttachContext, Attachment, Backend, BlockPage, Capacity,
    ContentSource, ControllerAttach, CreateSnapshot, CreateVolume, Page, Secrets, SizeRules,
    SnapshotId, SnapshotInfo, VolumeCapability, VolumeId, VolumeInfo,
};
use crate::plugin::{
    Attacher, BlockTracker, DeviceMounter, Expander, GroupCutter, Groups, Modifier, Provisioner,
    SnapshotInstant, Snapshotter, Stager, SINGLE_NODE_MODES,
};
use crate::sync::LockExt;
use cli::CliCluster;
use cluster::{check_name, Cluster, Layout, Spec};
use creds::Creds;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The `rbd` kind: Ceph RBD images, mapped with the kernel client.
pub const KIND: super::Kind = super::Kind {
    name: "rbd",
    parameters: PARAMETERS,
    mutable: &QOS_KEYS,
    kill_points: KillPoint::NAMES,
    secrets: &[USER_ID, USER_KEY],
    build: |bc, env| {
        Ok(Arc::new(RbdBackend::new(
            bc.name(),
            bc.settings()?,
            env.runner.clone(),
            env.state_dir.join("rbd").join(bc.name()),
        )?))
    },
};

crate::kill_points! {
    /// Where a test can kill the driver in this backend's operations
    /// ([`crate::killpoint`]).
    pub enum KillPoint {
        /// a new volume's image is made (a clone, for a copy) and sized,
        /// under its final name with its making recorded (librbd) or under its
        /// temporary name (the CLI road); it carries no CSI name yet.
        Made = "rbd.made",
        /// (librbd road) a volume made in place has its CSI name; the
        /// record of its making is still there (its removal runs after the
        /// answer, in the background).
        Named = "rbd.named",
        /// (librbd road) a deleted image is in the trash, out of the
        /// pool's directory; the removal of its data has not begun.
        Trashed = "rbd.trashed",
        /// a group snapshot of volumes in use: the temporary rbd group
        /// holds every member and its snapshot; no member is copied.
        GroupCut = "rbd.group.cut",
        /// a group snapshot of volumes nobody writes: every member's
        /// exclusive lock is held, and the member's cut is made (`@n`: the n-th
        /// member's); the rest are not.
        GroupSnapped = "rbd.group.snapped",
    }
}

/// Secrets keys (as ceph-csi names them).
pub const USER_ID: &str = "userID";
pub const USER_KEY: &str = "userKey";

const MIB: u64 = 1 << 20;
const META_NAME: &str = "ferrovol.name";
const META_SOURCE: &str = "ferrovol.source";
const META_CREATED: &str = "ferrovol.created";
/// On a copy (a restore, a clone) whose filesystem still carries its
/// source's UUID, until the node that first stages it renews it.
const META_FS_COPY: &str = "ferrovol.fscopy";
/// On a group member's temporary image copied from the group's cut (see
/// `cut_group`): the snapshot's name, whose `create_snapshot` finishes it.
const META_GROUP_CUT: &str = "ferrovol.groupcut";
/// `ferrovol.node.<node name>` = `single;<terms>` | `multi;<terms>`: who
/// may use the image, and on what terms it was published there (see
/// `ControllerAttach::terms`; older marks are a bare `single` or `multi`).
const META_NODE: &str = "ferrovol.node.";
/// `ferrovol.client.<node name>` = the address of the kernel client that
/// maps the image on that node (`ip:port/nonce`), recorded at stage and
/// removed at unstage: a detach that still finds it fences that client.
const META_CLIENT: &str = "ferrovol.client.";

/// The metadata key of `node`'s client record.
fn client_key(node: &str) -> String {
    format!("{META_CLIENT}{node}")
}
/// The token a node that maps rbd images carries in its node id.
pub const NODE_TOKEN: &str = "rbd";
/// The snapshot of a snapshot image that restores clone from (the image
/// never changes: it is the same whenever it is taken).
const BASE: &str = "base";
/// The volume context key that carries map options to the node.
const CTX_MAP_OPTIONS: &str = "mapOptions";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RbdSettings {
    /// Names the cluster in volume ids.
    pub cluster_id: String,
    /// `host:port` of the monitors.
    pub monitors: Vec<String>,
    /// The pools volumes may live in; the first is the default.
    pub pools: Vec<String>,
    /// The controller's own cephx user and keyring file, for calls that
    /// carry no secrets (ListVolumes, GetSnapshot, ...). Calls with
    /// secrets use those.
    pub user: Option<String>,
    pub keyring: Option<PathBuf>,
    /// Flatten a clone whose chain of parents is longer than this.
    #[serde(default = "default_depth")]
    pub max_clone_depth: u32,
    /// Features of new images (krbd supports `layering` everywhere).
    #[serde(default = "default_features")]
    pub image_features: String,
    /// Options for `rbd device map` on nodes (`noshare` is always added:
    /// each mapping has a client of its own, so fencing one volume's
    /// client on a node touches none of its other volumes).
    #[serde(default)]
    pub map_options: String,
    /// How long a client fenced at detach stays blocklisted (seconds):
    /// longer than any node may stay frozen and come back.
    #[serde(default = "default_fence_expiry")]
    pub fence_expiry: u64,
    /// How the controller talks to the cluster: `librbd` (kept
    /// connections in the driver's process), `cli` (an `rbd` process per
    /// step), or `auto`: librbd when its libraries load, else the CLI.
    #[serde(default)]
    pub client: Client,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Client {
    #[default]
    Auto,
    Librbd,
    Cli,
}

fn default_fence_expiry() -> u64 {
    30 * 24 * 3600
}
fn default_depth() -> u32 {
    4
}
fn default_features() -> String {
    "layering".into()
}

/// The snapshot of the source a copy into `to` is made from: cut by the
/// copy itself, or beforehand for a group (made at one instant with the
/// group's other members), in which case the copy finds it there.
fn cut_name(to: &Spec) -> String {
    format!("tmp-{}", to.image)
}

/// The mutable parameters: librbd's QoS limits on the image, each set as
/// the image's own config override (`conf_rbd_qos_*` metadata, what `rbd
/// config image set` writes). 0 is no limit.
/// The StorageClass parameters this backend takes.
pub const PARAMETERS: &[&str] = &[
    "pool",
    "radosNamespace",
    "dataPool",
    "imageFeatures",
    "mapOptions",
    "mkfsOptions",
];

pub const QOS_KEYS: [&str; 6] = [
    "qosIopsLimit",
    "qosBpsLimit",
    "qosReadIopsLimit",
    "qosWriteIopsLimit",
    "qosReadBpsLimit",
    "qosWriteBpsLimit",
];

/// The rbd config options the QoS keys set, in [`QOS_KEYS`]'s order.
const QOS_OPTIONS: [&str; 6] = [
    "rbd_qos_iops_limit",
    "rbd_qos_bps_limit",
    "rbd_qos_read_iops_limit",
    "rbd_qos_write_iops_limit",
    "rbd_qos_read_bps_limit",
    "rbd_qos_write_bps_limit",
];

/// QoS changes as (rbd option, value in decimal), each value a whole
/// number from 0 to 2^53.
fn qos_changes(changes: &BTreeMap<String, String>) -> Result<Vec<(&'static str, String)>> {
    let mut out = Vec::new();
    for (key, option) in QOS_KEYS.iter().zip(QOS_OPTIONS) {
        let Some(v) = changes.get(*key) else {
            continue;
        };
        let n = v
            .parse::<u64>()
            .ok()
            .filter(|n| *n <= 1 << 53)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "mutable parameter {key}: {v:?} is not a whole number from 0 (no limit) to 2^53"
                ))
            })?;
        out.push((option, n.to_string()));
    }
    Ok(out)
}

/// The StorageClass parameters of a volume.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Params {
    pool: String,
    namespace: String,
    data_pool: String,
    features: String,
    map_options: String,
    mkfs_options: String,
}

pub struct RbdBackend {
    name: String,
    settings: RbdSettings,
    /// The controller's road to the cluster.
    cluster: Arc<dyn Cluster>,
    /// The command line: mapping on nodes.
    cli: Arc<CliCluster>,
    /// Where private keyrings are written for one call.
    keys: PathBuf,
    sysfs: PathBuf,
    /// Parameter sets parsed already (a StorageClass sends the same set
    /// with every create, and a create reads it three times: validation,
    /// the id, the create itself).
    parsed: Mutex<HashMap<BTreeMap<String, String>, Arc<Params>>>,
    /// Node side, per staged volume (in memory only): what unstage needs
    /// to remove the node's client record, and the condition check to see
    /// the record gone (the node fenced).
    staged: Mutex<HashMap<String, Staged>>,
}

/// A volume staged on this node.
#[derive(Clone)]
struct Staged {
    /// The stage's secrets.
    secrets: Secrets,
    node: String,
    /// The client address recorded in the image, if one was.
    client: Option<String>,
}

/// How many parameter sets are kept parsed; past it the memo starts over.
const PARSED_SETS: usize = 32;

fn check_features(f: &str) -> Result<()> {
    for feature in f.split(',') {
        if !matches!(
            feature,
            "layering"
                | "exclusive-lock"
                | "object-map"
                | "fast-diff"
                | "deep-flatten"
                | "journaling"
        ) {
            return Err(Error::invalid(format!(
                "imageFeatures: unknown feature {feature:?}"
            )));
        }
    }
    Ok(())
}

fn check_map_options(o: &str) -> Result<()> {
    if o.len() > 256
        || !o
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_=,.-".contains(&b))
    {
        return Err(Error::invalid(
            "mapOptions: comma-separated krbd options (a-z, 0-9, '_', '=', '.', '-')",
        ));
    }
    Ok(())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl RbdBackend {
    pub fn new(
        name: &str,
        settings: RbdSettings,
        runner: Arc<dyn CommandRunner>,
        state_dir: PathBuf,
    ) -> Result<Self> {
        let bad = |what: String| Error::invalid(format!("backend {name:?}: {what}"));
        check_name("cluster_id", &settings.cluster_id, false).map_err(|e| bad(e.message))?;
        // `[v1:|v2:]host:port`: the messenger protocol when the port does
        // not tell it (6789 is v1, 3300 v2).
        let monitor_ok = |m: &str| {
            let addr = m
                .strip_prefix("v1:")
                .or_else(|| m.strip_prefix("v2:"))
                .unwrap_or(m);
            crate::config::is_host_port(addr)
        };
        if settings.monitors.is_empty() || settings.monitors.iter().any(|m| !monitor_ok(m)) {
            return Err(bad("monitors must be [v1:|v2:]host:port".into()));
        }
        if settings.pools.is_empty() {
            return Err(bad("pools must name at least one pool".into()));
        }
        for p in &settings.pools {
            check_name("pool", p, false).map_err(|e| bad(e.message))?;
        }
        check_features(&settings.image_features).map_err(|e| bad(e.message))?;
        check_map_options(&settings.map_options).map_err(|e| bad(e.message))?;
        match (&settings.user, &settings.keyring) {
            (Some(u), Some(k)) => {
                creds::check_user(u).map_err(|e| bad(e.message))?;
                crate::config::absolute(k, "keyring")?;
            }
            (None, None) => {}
            _ => return Err(bad("user and keyring go together".into())),
        }
        let cli = Arc::new(CliCluster {
            runner,
            monitors: settings.monitors.clone(),
        });
        let cluster: Arc<dyn Cluster> = match settings.client {
            Client::Cli => cli.clone(),
            Client::Librbd => Arc::new(
                librbd::LibCluster::new(&settings.monitors)
                    .map_err(|e| bad(format!("client = \"librbd\": {e}")))?,
            ),
            Client::Auto => match librbd::LibCluster::new(&settings.monitors) {
                Ok(lib) => Arc::new(lib),
                Err(e) => {
                    tracing::info!(backend = name, reason = %e, "librbd is not available: the controller runs the rbd command line");
                    cli.clone()
                }
            },
        };
        tracing::info!(
            backend = name,
            road = cluster.road(),
            "rbd controller calls go through {}",
            cluster.road()
        );
        Ok(RbdBackend {
            name: name.into(),
            settings,
            cluster,
            cli,
            keys: state_dir.join("keys"),
            sysfs: "/sys".into(),
            parsed: Mutex::default(),
            staged: Mutex::default(),
        })
    }

    #[cfg(test)]
    fn with_sysfs(mut self, sysfs: PathBuf) -> Self {
        self.sysfs = sysfs;
        self
    }

    /// The image a snapshot of `src` is kept as.
    fn snapshot_image(src: &Spec, req: &CreateSnapshot) -> Spec {
        src.with_image(&format!("fvs-{}", locator_for_name(&req.name)))
    }

    /// A group member's cut: its source image and the snapshot of it that
    /// `create_snapshot` copies from.
    fn member_cut(&self, req: &CreateSnapshot) -> Result<(Spec, String)> {
        let src = self.volume_spec(&req.source).map_err(|_| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        let tmp = Self::snapshot_tmp(&Self::snapshot_image(&src, req));
        Ok((src, cut_name(&tmp)))
    }

    /// Where a snapshot image is made before it is renamed into place.
    fn snapshot_tmp(spec: &Spec) -> Spec {
        spec.with_image(&format!("tmp-{}", spec.image))
    }

    fn rbd(&self) -> &dyn Cluster {
        self.cluster.as_ref()
    }

    /// Which road the controller takes: `librbd` or `cli`.
    pub fn road(&self) -> &'static str {
        self.cluster.road()
    }

    /// Credentials: the call's secrets, else the config's own user.
    fn creds(&self, secrets: &Secrets) -> Result<Creds> {
        match (secrets.get(USER_ID), secrets.get(USER_KEY)) {
            (Some(user), Some(key)) => Creds::from_key(user, key, &self.keys),
            (None, None) => match (&self.settings.user, &self.settings.keyring) {
                (Some(user), Some(keyring)) => Creds::from_file(user, keyring),
                _ => Err(Error::invalid(format!(
                    "backend {}: secrets {USER_ID} and {USER_KEY} are required (or set user and keyring in the config)",
                    self.name
                ))),
            },
            _ => Err(Error::invalid(format!(
                "secrets: {USER_ID} and {USER_KEY} go together"
            ))),
        }
    }

    /// A parameter set, parsed and checked once.
    fn params(&self, parameters: &BTreeMap<String, String>) -> Result<Arc<Params>> {
        if let Some(p) = self.parsed.locked().get(parameters) {
            return Ok(p.clone());
        }
        let p = Arc::new(self.parse_params(parameters)?);
        let mut parsed = self.parsed.locked();
        if parsed.len() >= PARSED_SETS {
            parsed.clear();
        }
        parsed.insert(parameters.clone(), p.clone());
        Ok(p)
    }

    fn parse_params(&self, parameters: &BTreeMap<String, String>) -> Result<Params> {
        let mut p = Params {
            pool: self.settings.pools[0].clone(),
            features: self.settings.image_features.clone(),
            ..Default::default()
        };
        for (k, v) in parameters {
            if !PARAMETERS.contains(&k.as_str()) {
                return Err(Error::invalid(format!(
                    "rbd backend: unknown parameter {k:?} (known: {})",
                    PARAMETERS.join(", ")
                )));
            }
            match k.as_str() {
                "pool" => p.pool = v.clone(),
                "radosNamespace" => p.namespace = v.clone(),
                "dataPool" => p.data_pool = v.clone(),
                "imageFeatures" => p.features = v.clone(),
                "mapOptions" => p.map_options = v.clone(),
                "mkfsOptions" => p.mkfs_options = v.clone(),
                other => unreachable!("{other} is in PARAMETERS without its meaning"),
            }
        }
        if !self.settings.pools.contains(&p.pool) {
            return Err(Error::invalid(format!(
                "pool {:?} is not one this backend may use ({})",
                p.pool,
                self.settings.pools.join(", ")
            )));
        }
        check_name("radosNamespace", &p.namespace, true)?;
        check_name("dataPool", &p.data_pool, true)?;
        check_features(&p.features)?;
        check_map_options(&p.map_options)?;
        crate::node::fs::mkfs_options(None, &p.mkfs_options)?;
        Ok(p)
    }

    fn locator(&self, spec: &Spec) -> Result<String> {
        join_fields(&[
            &self.settings.cluster_id,
            &spec.pool,
            &spec.namespace,
            &spec.image,
        ])
    }

    /// The image an id names, checked: this cluster, an allowed pool, and
    /// a name of the kind expected (`fv-` volumes, `fvs-` snapshots).
    fn spec(&self, locator: &str, prefix: &str) -> Result<Spec> {
        let f = split_fields(locator, 4)?;
        let missing = || Error::not_found(format!("{locator:?} is not an image of this backend"));
        if f[0] != self.settings.cluster_id || !self.settings.pools.contains(&f[1]) {
            return Err(missing());
        }
        check_name("namespace", &f[2], true).map_err(|_| missing())?;
        check_name("image", &f[3], false).map_err(|_| missing())?;
        if !f[3].starts_with(prefix) || (prefix == "fv-" && f[3].starts_with("fvs-")) {
            return Err(missing());
        }
        Ok(Spec {
            pool: f[1].clone(),
            namespace: f[2].clone(),
            image: f[3].clone(),
        })
    }

    fn volume_spec(&self, id: &VolumeId) -> Result<Spec> {
        if id.backend() != self.name {
            return Err(Error::not_found(format!(
                "volume {id} is not an {} volume",
                self.name
            )));
        }
        self.spec(id.locator(), "fv-")
    }

    fn snapshot_spec(&self, id: &SnapshotId) -> Result<Spec> {
        if id.backend() != self.name {
            return Err(Error::not_found(format!(
                "snapshot {id} is not an {} snapshot",
                self.name
            )));
        }
        self.spec(id.locator(), "fvs-")
    }

    fn size_rules() -> SizeRules {
        SizeRules {
            step: MIB,
            default: 1 << 30,
            max: None,
        }
    }

    /// How many parents the image has.
    async fn depth(&self, creds: &Creds, spec: &Spec) -> Result<u32> {
        let mut depth = 0;
        let mut cur = self.rbd().info(creds, spec).await?;
        while let Some(parent) = cur.and_then(|i| i.parent) {
            depth += 1;
            if depth > 64 {
                break;
            }
            cur = self
                .rbd()
                .info(
                    creds,
                    &Spec {
                        pool: parent.pool,
                        namespace: parent.pool_namespace,
                        image: parent.image,
                    },
                )
                .await?;
        }
        Ok(depth)
    }

    async fn flatten_if_deep(&self, creds: &Creds, spec: &Spec) -> Result<()> {
        if self.depth(creds, spec).await? > self.settings.max_clone_depth {
            self.rbd().flatten(creds, spec).await?;
        }
        Ok(())
    }

    /// Clones `from` (an image's snapshot `snap`) into `to`.
    async fn clone_from(
        &self,
        creds: &Creds,
        from: &Spec,
        snap: &str,
        to: &Spec,
        params: Option<&Params>,
    ) -> Result<()> {
        let layout = params.map(|p| Layout {
            features: &p.features,
            data_pool: &p.data_pool,
        });
        self.rbd().clone_image(creds, from, snap, to, layout).await
    }

    /// A point-in-time clone of image `from` as `to`: a snapshot of `from`
    /// (its cut) and a clone of it. A volume's clone removes the cut again
    /// (format 2 clones keep what they need); a snapshot's keeps it on its
    /// source, where the changes between two snapshots are read.
    async fn copy_of(
        &self,
        creds: &Creds,
        from: &Spec,
        to: &Spec,
        params: Option<&Params>,
        keep_cut: bool,
    ) -> Result<()> {
        let snap = cut_name(to);
        match self.rbd().snap_create(creds, from, &snap).await {
            Ok(_) => {}
            Err(e) if e.kind == Kind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let cloned = self.clone_from(creds, from, &snap, to, params).await;
        if keep_cut && cloned.is_ok() {
            return Ok(());
        }
        let removed = self.rbd().snap_remove(creds, from, &snap).await;
        cloned?;
        removed
    }

    /// The cut snapshot image `spec` was cloned from, kept on its source.
    fn snapshot_cut(spec: &Spec) -> String {
        cut_name(&Self::snapshot_tmp(spec))
    }

    /// Removes the cuts of this volume's snapshots kept on it (before the
    /// volume goes: its snapshots, clones of them, then keep them in the
    /// trash namespace while they need them).
    async fn remove_cuts(&self, creds: &Creds, spec: &Spec, snaps: &[String]) -> Result<()> {
        let prefix = Self::snapshot_cut(&spec.with_image("fvs-"));
        for snap in snaps {
            if snap.starts_with(&prefix) {
                match self.rbd().snap_remove(creds, spec, snap).await {
                    Ok(()) => {}
                    Err(e) if e.kind == Kind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// A snapshot image's metadata and size; NOT_FOUND when it is not one.
    async fn snapshot_meta(
        &self,
        creds: &Creds,
        id: &SnapshotId,
    ) -> Result<(Spec, u64, BTreeMap<String, String>)> {
        let gone = || Error::not_found(format!("snapshot {id} does not exist"));
        let spec = self.snapshot_spec(id).map_err(|_| gone())?;
        match self.rbd().describe(creds, &spec).await? {
            Some((info, meta)) if meta.contains_key(META_NAME) => Ok((spec, info.size, meta)),
            _ => Err(gone()),
        }
    }

    /// Removes an image (librbd: moved to the trash, its data removed in
    /// the background), or moves it to the trash when clones still need
    /// it; then purges what the trash holds of ours that nothing needs.
    async fn remove(&self, creds: &Creds, spec: &Spec, parent: Option<&Spec>) -> Result<()> {
        match self.rbd().discard(creds, spec, parent).await {
            Ok(_) => {}
            Err(e) if e.kind == Kind::NotFound => {}
            Err(e) if e.os_error == Some(cluster::ENOTEMPTY) => {
                self.rbd().trash_move(creds, spec).await?;
                tracing::info!(image = %spec.arg(), "image has clones: moved to the trash until they are gone");
            }
            Err(e) => return Err(e),
        }
        self.purge_trash(creds, spec).await;
        Ok(())
    }

    /// Tries to remove each of our images in the pool's trash; those that
    /// clones still need stay.
    async fn purge_trash(&self, creds: &Creds, pool: &Spec) {
        let Ok(entries) = self.rbd().trash(creds, pool).await else {
            return;
        };
        for e in entries {
            if !(e.name.starts_with("fv-") || e.name.starts_with("fvs-")) {
                continue;
            }
            if self.rbd().trash_remove(creds, pool, &e.id).await.is_ok() {
                tracing::info!(image = %e.name, "purged from the trash");
            }
        }
    }

    fn volume_info(
        &self,
        spec: &Spec,
        size: u64,
        meta: &BTreeMap<String, String>,
        params: Option<&Params>,
    ) -> Result<VolumeInfo> {
        let source = meta.get(META_SOURCE).and_then(|s| {
            if let Ok(v) = VolumeId::parse(s) {
                return Some(ContentSource::Volume(v));
            }
            SnapshotId::parse(s).ok().map(ContentSource::Snapshot)
        });
        let mut context = BTreeMap::new();
        if let Some(p) = params {
            if !p.map_options.is_empty() {
                context.insert(CTX_MAP_OPTIONS.to_string(), p.map_options.clone());
            }
            if !p.mkfs_options.is_empty() {
                context.insert(
                    crate::node::fs::MKFS_OPTIONS.to_string(),
                    p.mkfs_options.clone(),
                );
            }
        }
        Ok(VolumeInfo {
            id: VolumeId::new(&self.name, &self.locator(spec)?)?,
            capacity_bytes: size,
            context,
            source,
        })
    }

    fn snapshot_info(
        &self,
        spec: &Spec,
        size: u64,
        meta: &BTreeMap<String, String>,
    ) -> Result<SnapshotInfo> {
        let source = meta
            .get(META_SOURCE)
            .and_then(|s| VolumeId::parse(s).ok())
            .ok_or_else(|| {
                Error::internal(format!("snapshot image {} has no source", spec.arg()))
            })?;
        let created = meta
            .get(META_CREATED)
            .and_then(|s| s.parse::<u64>().ok())
            .map(|s| UNIX_EPOCH + Duration::from_secs(s))
            .unwrap_or(UNIX_EPOCH);
        Ok(SnapshotInfo {
            id: SnapshotId::new(&self.name, &self.locator(spec)?)?,
            source_volume: source,
            size_bytes: size,
            created,
            ready: true,
            group: None,
        })
    }

    /// Every pool and namespace this backend may have images in.
    async fn places(&self, creds: &Creds) -> Result<Vec<Spec>> {
        let mut out = Vec::new();
        for pool in &self.settings.pools {
            out.push(Spec {
                pool: pool.clone(),
                namespace: String::new(),
                image: String::new(),
            });
            let names = self.rbd().namespaces(creds, pool).await?;
            for ns in names {
                out.push(Spec {
                    pool: pool.clone(),
                    namespace: ns,
                    image: String::new(),
                });
            }
        }
        Ok(out)
    }

    /// Our images whose names start with `prefix`, with their locators,
    /// sorted by locator (names only: a page reads its own entries).
    async fn images(&self, creds: &Creds, prefix: &str) -> Result<Vec<(String, Spec)>> {
        let mut out = Vec::new();
        for place in self.places(creds).await? {
            for image in self.rbd().list(creds, &place).await? {
                let ours =
                    image.starts_with(prefix) && !(prefix == "fv-" && image.starts_with("fvs-"));
                if ours {
                    let spec = place.with_image(&image);
                    out.push((self.locator(&spec)?, spec));
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Makes image `to` (under its temporary name) ours: its metadata set
    /// (a copy's inherited marks cleared), then renamed into place, so an
    /// image under a final name always carries its CSI name.
    async fn finish(
        &self,
        creds: &Creds,
        tmp: &Spec,
        to: &Spec,
        meta: &[(&str, &str)],
        copied: bool,
    ) -> Result<()> {
        self.rbd().finish(creds, tmp, to, meta, copied).await
    }

    /// The CSI name the image is recorded as being made for, if it is.
    /// Removes every record of making whose image has the CSI name the
    /// record names: the create finished (an image is whole once named) and
    /// the driver was killed before the record's removal, which follows
    /// the answer. Records of images not named (a create cut short, which
    /// the CO's retry or delete settles) and of images not there are kept.
    /// Answers how many went.
    async fn settle_records(&self) -> Result<usize> {
        let creds = self.creds(&Secrets::default())?;
        let mut removed = 0;
        for place in self.places(&creds).await? {
            for (image, name) in self.rbd().intended(&creds, &place).await? {
                let spec = place.with_image(&image);
                let named = match self.rbd().describe(&creds, &spec).await? {
                    Some((_, meta)) => meta.get(META_NAME) == Some(&name),
                    None => false,
                };
                if named {
                    self.rbd().unintend(&creds, &spec).await?;
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    async fn being_made_for(&self, creds: &Creds, spec: &Spec) -> Result<Option<String>> {
        Ok(self.rbd().intended(creds, spec).await?.remove(&spec.image))
    }

    /// Keeps `tmp` when it is the copy a group's cut made for snapshot
    /// `name` (true), else clears it as [`Self::clear_tmp`] does.
    async fn group_copy_or_clear(&self, creds: &Creds, tmp: &Spec, name: &str) -> Result<bool> {
        if self.rbd().info(creds, tmp).await?.is_none() {
            return Ok(false);
        }
        let meta = self.rbd().meta(creds, tmp).await.unwrap_or_default();
        if meta.get(META_GROUP_CUT).map(String::as_str) == Some(name) {
            return Ok(true);
        }
        self.clear_found_tmp(creds, tmp, name, &meta).await?;
        Ok(false)
    }

    /// Clears a leftover temporary image of ours (a create cut short).
    async fn clear_tmp(&self, creds: &Creds, tmp: &Spec, name: &str) -> Result<()> {
        if self.rbd().info(creds, tmp).await?.is_none() {
            return Ok(());
        }
        let meta = self.rbd().meta(creds, tmp).await.unwrap_or_default();
        self.clear_found_tmp(creds, tmp, name, &meta).await
    }

    async fn clear_found_tmp(
        &self,
        creds: &Creds,
        tmp: &Spec,
        name: &str,
        meta: &BTreeMap<String, String>,
    ) -> Result<()> {
        // A copy comes with its parent's keys: a name another request's
        // image would not be made under is the parent's, and the image is
        // this request's leftover. Only a name of the same locator (a
        // crafted collision) is another request's.
        let other = |n: &String| n != name && locator_for_name(n) == locator_for_name(name);
        if meta.get(META_NAME).is_some_and(other) {
            return Err(Error::precondition(format!(
                "image {} is another request's work in progress",
                tmp.arg()
            )));
        }
        self.rbd().remove(creds, tmp).await
    }
}

#[async_trait::async_trait]
impl Backend for RbdBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn supports(&self, capability: &VolumeCapability) -> Result<()> {
        if capability.mode == AccessMode::MultiNodeMultiWriter
            && !matches!(capability.access, AccessType::Block)
        {
            return Err(Error::invalid(
                "rbd: MULTI_NODE_MULTI_WRITER only for raw block volumes (a filesystem on one image cannot be mounted by two nodes)",
            ));
        }
        if !self.access_modes().contains(&capability.mode) {
            return Err(Error::invalid(format!(
                "rbd does not support access mode {:?}",
                capability.mode
            )));
        }
        if let AccessType::Mount { fs_type, .. } = &capability.access {
            if !fs_type.is_empty() && !self.fs_types().contains(&fs_type.as_str()) {
                return Err(Error::invalid(format!(
                    "rbd does not serve fs_type {fs_type:?}"
                )));
            }
        }
        Ok(())
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    /// A driver with a user of its own finishes, before it serves, what
    /// the records of making a killed run left beside whole volumes say
    /// (see [`RbdBackend::settle_records`]). Nothing here stops the start:
    /// a cluster that does not answer leaves the records for the volumes'
    /// deletes.
    async fn start(&self) -> Result<()> {
        if !self.rbd().makes_in_place() || self.settings.user.is_none() {
            return Ok(());
        }
        match self.settle_records().await {
            Ok(0) => tracing::debug!(backend = %self.name, "no record of making to settle"),
            Ok(n) => {
                tracing::info!(backend = %self.name, records = n, "records of making a killed run left beside whole volumes removed")
            }
            Err(e) => {
                tracing::warn!(backend = %self.name, error = %e.message, "records of making not settled at start; each goes with its volume's delete")
            }
        }
        Ok(())
    }

    fn validate_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        self.params(parameters).map(|_| ())
    }

    fn access_modes(&self) -> Vec<AccessMode> {
        let mut modes = SINGLE_NODE_MODES.to_vec();
        modes.extend([
            AccessMode::MultiNodeReaderOnly,
            AccessMode::MultiNodeMultiWriter,
        ]);
        modes
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

    fn attacher(&self) -> Option<&dyn Attacher> {
        Some(self)
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

#[async_trait::async_trait]
impl Provisioner for RbdBackend {
    fn clones(&self) -> bool {
        true
    }

    fn volume_id_for(&self, req: &CreateVolume) -> Result<VolumeId> {
        let p = self.params(&req.parameters)?;
        let spec = Spec {
            pool: p.pool.clone(),
            namespace: p.namespace.clone(),
            image: format!("fv-{}", locator_for_name(&req.name)),
        };
        VolumeId::new(&self.name, &self.locator(&spec)?)
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let p = self.params(&req.parameters)?;
        let creds = self.creds(&req.secrets)?;
        let spec = Spec {
            pool: p.pool.clone(),
            namespace: p.namespace.clone(),
            image: format!("fv-{}", locator_for_name(&req.name)),
        };
        let in_place = self.rbd().makes_in_place();
        if let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? {
            if meta.get(META_NAME) == Some(&req.name) {
                // Made whole (its CSI name is set last), whatever a record
                // left beside it says.
                let v = self.volume_info(&spec, info.size, &meta, Some(&p))?;
                check_existing(req, info.size, v.source.as_ref())?;
                return Ok(v);
            }
            if !(in_place && self.being_made_for(&creds, &spec).await? == Some(req.name.clone())) {
                return Err(Error::already_exists(format!(
                    "image {} exists and is not volume {:?}",
                    spec.arg(),
                    req.name
                )));
            }
            // An earlier try of this call died making it: it is made
            // again (nothing has it yet: its id was never answered).
            tracing::warn!(volume = %req.name, image = %spec.arg(), "removing the image a create cut short left, to make it again");
            self.rbd().remove(&creds, &spec).await?;
        }
        // Where it is made: under its final name, its making recorded
        // first (librbd), or under a temporary name renamed when done.
        let tmp = if in_place {
            self.rbd().intend(&creds, &spec, &req.name).await?;
            spec.clone()
        } else {
            let tmp = spec.with_image(&format!("tmp-{}", spec.image));
            self.clear_tmp(&creds, &tmp, &req.name).await?;
            tmp
        };
        let source_id = req.source.as_ref().map(|s| match s {
            ContentSource::Volume(v) => v.to_string(),
            ContentSource::Snapshot(s) => s.to_string(),
        });
        let source_size = match &req.source {
            None => 0,
            Some(source) => self.copy_source(&creds, source, &tmp, &p).await?,
        };
        let size =
            match Self::size_rules().new_volume(req.required_bytes, req.limit_bytes, source_size) {
                Ok(s) => s,
                Err(e) => {
                    if source_size > 0 {
                        let _ = self.rbd().remove(&creds, &tmp).await;
                    }
                    if in_place {
                        let _ = self.rbd().unintend(&creds, &spec).await;
                    }
                    return Err(e);
                }
            };
        if req.source.is_none() {
            let layout = Layout {
                features: &p.features,
                data_pool: &p.data_pool,
            };
            self.rbd().create(&creds, &tmp, size, layout).await?;
        } else {
            self.flatten_if_deep(&creds, &tmp).await?;
            if size > source_size {
                self.rbd().resize(&creds, &tmp, size).await?;
            }
        }
        let mut meta = vec![(META_NAME, req.name.as_str())];
        if let Some(s) = &source_id {
            meta.push((META_SOURCE, s.as_str()));
            meta.push((META_FS_COPY, "1"));
        }
        crate::killpoint::hit(KillPoint::Made);
        self.finish(&creds, &tmp, &spec, &meta, req.source.is_some())
            .await?;
        let meta: BTreeMap<String, String> = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.volume_info(&spec, size, &meta, Some(&p))
    }

    async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()> {
        let Ok(spec) = self.volume_spec(id) else {
            return Ok(());
        };
        let creds = self.creds(secrets)?;
        // A clone of it being deleted in the background holds it open (a
        // watch of the driver's own, not a node's).
        self.rbd().settle(&spec).await;
        let Some(image) = self.rbd().inspect(&creds, &spec).await? else {
            // A create the driver died in may have left its temporary
            // image (the CLI road's, or an earlier version's).
            let tmp = spec.with_image(&format!("tmp-{}", spec.image));
            if self.rbd().info(&creds, &tmp).await?.is_some() {
                tracing::warn!(volume = %id, "removing the temporary image a create cut short left");
                self.rbd().remove(&creds, &tmp).await?;
            }
            self.purge_trash(&creds, &spec).await;
            // A record of its making that a driver killed before removing
            // it left (after the answer, or with the image in the trash at
            // `rbd.trashed`): with the image gone it says nothing, and
            // nothing else would ever remove it.
            return self.rbd().unintend(&creds, &spec).await;
        };
        let recorded = if self.rbd().makes_in_place() {
            self.being_made_for(&creds, &spec).await?
        } else {
            None
        };
        if recorded.is_some() && recorded.as_ref() != image.meta.get(META_NAME) {
            // Half made by a create the driver died in (ours: recorded
            // before it was made), and never named.
            self.rbd().remove(&creds, &spec).await?;
            return self.rbd().unintend(&creds, &spec).await;
        }
        if !image.meta.contains_key(META_NAME) {
            return Err(Error::precondition(format!(
                "image {} was not made by ferrovol; not deleting it",
                spec.arg()
            )));
        }
        if !image.watchers.is_empty() {
            let at: Vec<&str> = image.watchers.iter().map(String::as_str).collect();
            return Err(Error::precondition(format!(
                "volume {id} is in use (mapped by {})",
                at.join(", ")
            )));
        }
        // A group snapshot the driver died making can leave its temporary
        // group holding the image (and a snapshot of it): it goes first.
        if let Some(group) = &image.group {
            tracing::warn!(volume = %id, group = %group, "removing the rbd group a group snapshot cut short left");
            self.rbd().group_remove(&creds, &spec, group).await?;
        }
        self.remove_cuts(&creds, &spec, &image.snaps).await?;
        let parent = image.info.parent.as_ref().map(|p| p.image_spec());
        self.remove(&creds, &spec, parent.as_ref()).await?;
        if recorded.is_some() {
            // A whole volume's record a driver that died left.
            self.rbd().unintend(&creds, &spec).await?;
        }
        Ok(())
    }

    async fn get_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        let Ok(spec) = self.volume_spec(id) else {
            return Ok(None);
        };
        let creds = self.creds(secrets)?;
        let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Ok(None);
        };
        if !meta.contains_key(META_NAME) {
            return Ok(None);
        }
        Ok(Some(self.volume_info(&spec, info.size, &meta, None)?))
    }

    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        let creds = self.creds(&Secrets::default())?;
        let mut all = self.images(&creds, "fv-").await?;
        if self.rbd().makes_in_place() {
            // Volumes still being made (or half made by a driver that
            // died) are not listed: recorded, and not yet named as the
            // record says.
            let mut unnamed = Vec::new();
            for place in self.places(&creds).await? {
                for (image, name) in self.rbd().intended(&creds, &place).await? {
                    let spec = place.with_image(&image);
                    if !all.iter().any(|(_, s)| *s == spec) {
                        continue;
                    }
                    let named = match self.rbd().describe(&creds, &spec).await? {
                        Some((_, meta)) => meta.get(META_NAME) == Some(&name),
                        None => false,
                    };
                    if !named {
                        unnamed.push(spec);
                    }
                }
            }
            all.retain(|(_, spec)| !unnamed.contains(spec));
        }
        let specs: Vec<Spec> = all
            .into_iter()
            .filter(|(l, _)| page.admits(l))
            .take(page.limit)
            .map(|(_, spec)| spec)
            .collect();
        let sizes = self.rbd().sizes(&creds, &specs).await?;
        specs
            .iter()
            .zip(sizes)
            // Gone since the listing: not listed.
            .filter_map(|(spec, size)| Some((spec, size?)))
            .map(|(spec, size)| self.volume_info(spec, size, &BTreeMap::new(), None))
            .collect()
    }

    async fn capacity(&self, parameters: &BTreeMap<String, String>) -> Result<Capacity> {
        // GetCapacity carries no secrets: only the config's own user can ask.
        if self.settings.user.is_none() {
            return Err(Error::precondition(format!(
                "backend {}: GetCapacity carries no secrets; set user and keyring in the backend's config to report capacity",
                self.name
            )));
        }
        let p = self.params(parameters)?;
        let creds = self.creds(&Secrets::default())?;
        let pool = if p.data_pool.is_empty() {
            &p.pool
        } else {
            &p.data_pool
        };
        let free = self.rbd().pool_available(&creds, pool).await?;
        Ok(Capacity {
            // Images are made in whole MiB.
            available_bytes: free - free % MIB,
            maximum_volume_bytes: None,
            minimum_volume_bytes: None,
        })
    }
}

#[async_trait::async_trait]
impl Expander for RbdBackend {
    fn online(&self) -> bool {
        true
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        secrets: &Secrets,
    ) -> Result<u64> {
        let spec = self.volume_spec(id)?;
        let creds = self.creds(secrets)?;
        let info = self
            .rbd()
            .info(&creds, &spec)
            .await?
            .ok_or_else(|| Error::not_found(format!("volume {id} does not exist")))?;
        match Self::size_rules().expansion(info.size, required, limit)? {
            None => Ok(info.size),
            Some(size) => {
                self.rbd().resize(&creds, &spec, size).await?;
                Ok(size)
            }
        }
    }
}

#[async_trait::async_trait]
impl Snapshotter for RbdBackend {
    /// An rbd snapshot is one instant of the image in the cluster.
    fn instant(&self) -> SnapshotInstant {
        SnapshotInstant::Own
    }

    /// Every member's writers hand over their exclusive lock while the
    /// group is cut.
    fn groups(&self) -> Groups<'_> {
        Groups::Cut(self)
    }

    fn snapshot_id_for(&self, req: &CreateSnapshot) -> Result<SnapshotId> {
        let src = self.volume_spec(&req.source)?;
        let spec = src.with_image(&format!("fvs-{}", locator_for_name(&req.name)));
        SnapshotId::new(&self.name, &self.locator(&spec)?)
    }

    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        let src = self.volume_spec(&req.source).map_err(|_| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        let creds = self.creds(&req.secrets)?;
        let spec = Self::snapshot_image(&src, req);
        let source = req.source.to_string();
        if let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? {
            if meta.get(META_NAME) != Some(&req.name) || meta.get(META_SOURCE) != Some(&source) {
                return Err(Error::already_exists(format!(
                    "snapshot {:?} exists for another source volume",
                    req.name
                )));
            }
            return self.snapshot_info(&spec, info.size, &meta);
        }
        let src_info = self.rbd().info(&creds, &src).await?.ok_or_else(|| {
            Error::not_found(format!("source volume {} does not exist", req.source))
        })?;
        let tmp = Self::snapshot_tmp(&spec);
        if !self.group_copy_or_clear(&creds, &tmp, &req.name).await? {
            self.copy_of(&creds, &src, &tmp, None, true).await?;
            self.flatten_if_deep(&creds, &tmp).await?;
        }
        let created = now_secs().to_string();
        let meta = [
            (META_NAME, req.name.as_str()),
            (META_SOURCE, source.as_str()),
            (META_CREATED, created.as_str()),
        ];
        self.finish(&creds, &tmp, &spec, &meta, true).await?;
        let meta: BTreeMap<String, String> = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.snapshot_info(&spec, src_info.size, &meta)
    }

    async fn delete_snapshot(&self, id: &SnapshotId, secrets: &Secrets) -> Result<()> {
        let Ok(spec) = self.snapshot_spec(id) else {
            return Ok(());
        };
        let creds = self.creds(secrets)?;
        // A restore of it being deleted in the background holds it open.
        self.rbd().settle(&spec).await;
        let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? else {
            // The temporary group a group snapshot cut short left, named
            // after its first member's snapshot (only the librbd road
            // makes them).
            if self.road() == "librbd" {
                let group = format!("fvg-{}", spec.image.trim_start_matches("fvs-"));
                match self.rbd().group_remove(&creds, &spec, &group).await {
                    Ok(()) => {
                        tracing::warn!(group = %group, "removed the rbd group a group snapshot cut short left")
                    }
                    Err(e) if e.kind == Kind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            // A group's copy whose snapshot was never finished goes too.
            let tmp = Self::snapshot_tmp(&spec);
            if self.rbd().info(&creds, &tmp).await?.is_some()
                && self
                    .rbd()
                    .meta(&creds, &tmp)
                    .await?
                    .contains_key(META_GROUP_CUT)
            {
                self.remove(&creds, &tmp, None).await?;
            }
            self.purge_trash(&creds, &spec).await;
            return Ok(());
        };
        // The cut kept on its source goes first (to the snapshot trash
        // while this image is its clone): a retry finds it gone.
        if let Some(src) = meta
            .get(META_SOURCE)
            .and_then(|s| VolumeId::parse(s).ok())
            .and_then(|v| self.volume_spec(&v).ok())
        {
            match self
                .rbd()
                .snap_remove(&creds, &src, &Self::snapshot_cut(&spec))
                .await
            {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        // Its `base` snapshot goes next (format 2: to the snapshot trash
        // while restored volumes still need it).
        match self.rbd().snap_remove(&creds, &spec, BASE).await {
            Ok(_) => {}
            Err(e) if e.kind == Kind::NotFound => {}
            Err(e) => return Err(e),
        }
        let parent = info.parent.as_ref().map(|p| p.image_spec());
        self.remove(&creds, &spec, parent.as_ref()).await
    }

    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        let Ok(spec) = self.snapshot_spec(id) else {
            return Ok(None);
        };
        let creds = self.creds(secrets)?;
        let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Ok(None);
        };
        if !meta.contains_key(META_NAME) {
            return Ok(None);
        }
        Ok(Some(self.snapshot_info(&spec, info.size, &meta)?))
    }

    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        let creds = self.creds(&Secrets::default())?;
        let mut out = Vec::new();
        for (locator, spec) in self.images(&creds, "fvs-").await? {
            if !page.admits(&locator) {
                continue;
            }
            let Some((info, meta)) = self.rbd().describe(&creds, &spec).await? else {
                continue;
            };
            if !meta.contains_key(META_NAME) {
                continue;
            }
            let snap = self.snapshot_info(&spec, info.size, &meta)?;
            if source.is_none_or(|s| &snap.source_volume == s) {
                out.push(snap);
                if out.len() >= page.limit {
                    break;
                }
            }
        }
        Ok(out)
    }
}

#[async_trait::async_trait]
impl GroupCutter for RbdBackend {
    async fn cut_group(&self, members: &[CreateSnapshot]) -> Result<()> {
        let Some(first) = members.first() else {
            return Ok(());
        };
        let creds = self.creds(&first.secrets)?;
        let cuts = members
            .iter()
            .map(|m| self.member_cut(m))
            .collect::<Result<Vec<_>>>()?;
        let mut in_use = false;
        for (src, _) in &cuts {
            in_use |= !self.rbd().watchers(&creds, src).await?.is_empty();
        }
        // A cut an earlier try made before the driver died holds another
        // instant: it goes (each cut is named after this group's member,
        // and no snapshot image is its clone yet: the group's retry
        // deleted the member snapshots first).
        for (src, snap) in &cuts {
            match self.rbd().snap_remove(&creds, src, snap).await {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        if !in_use {
            // Nothing writes: every member's lock held while each is
            // snapshotted, and each member's snapshot a clone of its cut.
            return self.rbd().snap_together(&creds, &cuts).await;
        }
        // Mapped members: a kernel client refused a lock that
        // `snap_together` holds fails its writes, while one an rbd group's
        // snapshot takes makes it wait. Each member is copied from the
        // group's cut into its temporary image, which `create_snapshot`
        // then finishes.
        // A temporary group that a try the driver died in left holding a
        // member: groups live only while a cut is copied, and this call
        // holds every member's lock, so it is a leftover; it goes, or the
        // member could not join this group.
        for (src, _) in &cuts {
            if let Some(group) = self.rbd().leftover_group(&creds, src).await? {
                tracing::warn!(image = %src.arg(), group = %group, "removing the rbd group a group snapshot cut short left");
                self.rbd().group_remove(&creds, src, &group).await?;
            }
        }
        let mut pairs = Vec::new();
        for (m, (src, _)) in members.iter().zip(&cuts) {
            let tmp = Self::snapshot_tmp(&Self::snapshot_image(src, m));
            self.clear_tmp(&creds, &tmp, &m.name).await?;
            pairs.push((src.clone(), tmp));
        }
        // Named after the first member's snapshot, this group's own.
        let first_image = Self::snapshot_image(&pairs[0].0, first).image;
        let group = pairs[0]
            .0
            .with_image(&format!("fvg-{}", first_image.trim_start_matches("fvs-")));
        self.rbd().copy_together(&creds, &group, &pairs).await?;
        for (m, (_, tmp)) in members.iter().zip(&pairs) {
            self.rbd().set_meta(&creds, tmp, META_NAME, &m.name).await?;
            self.rbd()
                .set_meta(&creds, tmp, META_GROUP_CUT, &m.name)
                .await?;
        }
        Ok(())
    }

    async fn uncut_group(&self, members: &[CreateSnapshot]) -> Result<()> {
        let Some(first) = members.first() else {
            return Ok(());
        };
        let creds = self.creds(&first.secrets)?;
        for m in members {
            let (src, snap) = self.member_cut(m)?;
            match self.rbd().snap_remove(&creds, &src, &snap).await {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) => return Err(e),
            }
            let tmp = Self::snapshot_tmp(&Self::snapshot_image(&src, m));
            self.clear_tmp(&creds, &tmp, &m.name).await?;
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Modifier for RbdBackend {
    fn mutable_keys(&self) -> Vec<&'static str> {
        QOS_KEYS.to_vec()
    }

    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        qos_changes(changes).map(|_| ())
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        secrets: &Secrets,
    ) -> Result<()> {
        let wanted = qos_changes(changes)?;
        let gone = || Error::not_found(format!("volume {id} does not exist"));
        let spec = self.volume_spec(id).map_err(|_| gone())?;
        let creds = self.creds(secrets)?;
        let Some((_, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Err(gone());
        };
        if !meta.contains_key(META_NAME) {
            return Err(gone());
        }
        // The image's config overrides are its record: what differs is
        // changed, and a failure puts back what was changed before it.
        let mut done: Vec<(&str, Option<&String>)> = Vec::new();
        for (option, value) in &wanted {
            let key = format!("conf_{option}");
            let old = meta.get(&key);
            let now = old.map(String::as_str).unwrap_or("0");
            if now == value {
                continue;
            }
            let applied = match value.as_str() {
                "0" => self.rbd().remove_meta(&creds, &spec, &key).await,
                v => self.rbd().set_meta(&creds, &spec, &key, v).await,
            };
            if let Err(e) = applied {
                for (option, old) in done.into_iter().rev() {
                    let key = format!("conf_{option}");
                    let _ = match old {
                        Some(v) => self.rbd().set_meta(&creds, &spec, &key, v).await,
                        None => self.rbd().remove_meta(&creds, &spec, &key).await,
                    };
                }
                return Err(e);
            }
            done.push((option, old));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Attacher for RbdBackend {
    /// With a user of its own: the nodes each image's metadata names as
    /// published to (`ferrovol.node.<name>`).
    async fn grants(&self) -> Result<Option<Vec<(VolumeId, String)>>> {
        if self.settings.user.is_none() {
            return Ok(None);
        }
        let creds = self.creds(&Secrets::default())?;
        let mut out = Vec::new();
        for (locator, spec) in self.images(&creds, "fv-").await? {
            let Some((_, meta)) = self.rbd().describe(&creds, &spec).await? else {
                continue;
            };
            let id = VolumeId::new(&self.name, &locator)?;
            for node in meta.keys().filter_map(|k| k.strip_prefix(META_NODE)) {
                out.push((id.clone(), node.to_string()));
            }
        }
        Ok(Some(out))
    }

    fn node_id_suffix(&self) -> Result<Option<String>> {
        Ok(Some(NODE_TOKEN.to_string()))
    }

    async fn controller_attach(
        &self,
        id: &VolumeId,
        req: &ControllerAttach,
    ) -> Result<BTreeMap<String, String>> {
        let spec = self.volume_spec(id)?;
        let creds = self.creds(&req.secrets)?;
        let node = node_name(&req.node_id);
        check_name("node name", node, false)?;
        if !node_tokens(&req.node_id).any(|t| t == NODE_TOKEN) {
            return Err(Error::not_found(format!(
                "node {:?} does not map rbd images (its node id does not say so: is an rbd backend configured on it?)",
                req.node_id
            )));
        }
        let Some((_, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Err(Error::not_found(format!("volume {id} does not exist")));
        };
        // Nodes may share the image only in the same many-node mode: all
        // writers of a raw block volume, or all read-only.
        let kind = match req.capability.mode {
            AccessMode::MultiNodeMultiWriter => "multi",
            AccessMode::MultiNodeReaderOnly => "readers",
            _ => "single",
        };
        let mark = format!("{kind};{}", req.terms());
        for (key, value) in &meta {
            let Some(other) = key.strip_prefix(META_NODE) else {
                continue;
            };
            let (their_kind, terms) = value.split_once(';').unwrap_or((value.as_str(), ""));
            if other == node {
                check_publish_terms(id, node, Some(terms).filter(|t| !t.is_empty()), req)?;
                continue;
            }
            if kind == "single" || their_kind != kind {
                return Err(Error::precondition(format!(
                    "volume {id} is published to node {other} ({}); it is shared only by nodes that all publish it in one many-node mode",
                    if their_kind == "single" { "single-node" } else { their_kind }
                )));
            }
        }
        self.rbd()
            .set_meta(&creds, &spec, &format!("{META_NODE}{node}"), &mark)
            .await?;
        Ok(BTreeMap::new())
    }

    async fn controller_detach(
        &self,
        id: &VolumeId,
        node_id: Option<&str>,
        secrets: &Secrets,
    ) -> Result<()> {
        let Ok(spec) = self.volume_spec(id) else {
            return Ok(());
        };
        let creds = self.creds(secrets)?;
        let Some((_, meta)) = self.rbd().describe(&creds, &spec).await? else {
            return Ok(());
        };
        for (key, addr) in meta.iter().filter(|(k, _)| k.starts_with(META_CLIENT)) {
            let holder = &key[META_CLIENT.len()..];
            if node_id.is_none_or(|n| node_name(n) == holder) {
                self.fence(&creds, &spec, id, holder, addr).await?;
            }
        }
        for key in meta.keys().filter(|k| k.starts_with(META_NODE)) {
            let holder = &key[META_NODE.len()..];
            if node_id.is_none_or(|n| node_name(n) == holder) {
                self.rbd().remove_meta(&creds, &spec, key).await?;
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Stager for RbdBackend {
    // ---- node ----

    async fn node_attach(&self, id: &VolumeId, ctx: &AttachContext) -> Result<Attachment> {
        let spec = self.volume_spec(id)?;
        let creds = self.creds(&ctx.secrets)?;
        let node = node_name(&ctx.node_id);
        // Fenced: an image published to other nodes only is not mapped here.
        let meta = self.rbd().meta(&creds, &spec).await?;
        let holders: Vec<&str> = meta
            .keys()
            .filter_map(|k| k.strip_prefix(META_NODE))
            .collect();
        if !holders.is_empty() && !holders.contains(&node) {
            return Err(Error::precondition(format!(
                "volume {id} is published to {}, not to this node ({node})",
                holders.join(", ")
            )));
        }
        let path = match self.find_mapping(&spec).await? {
            Some(m) => m,
            None => self.map(&creds, &spec, ctx).await?,
        };
        let client = self
            .record_client(&creds, &spec, node, &path, &meta)
            .await?;
        self.staged.locked().insert(
            id.to_string(),
            Staged {
                secrets: ctx.secrets.clone(),
                node: node.to_string(),
                client,
            },
        );
        Ok(Attachment::Device { path })
    }

    async fn node_detach(&self, id: &VolumeId, _attachment: Option<&Attachment>) -> Result<()> {
        let spec = self.volume_spec(id)?;
        while let Some(dev) = self.find_mapping(&spec).await? {
            match self.cli.unmap(&dev).await {
                Ok(()) => {}
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) => {
                    // Gone meanwhile is what was wanted.
                    if self.find_mapping(&spec).await?.as_ref() == Some(&dev) {
                        return Err(e);
                    }
                }
            }
        }
        // Unmapped: this node's client record goes, so the detach has no
        // one to fence. Without the stage's secrets (the driver restarted
        // since) it stays, and the detach fences a client that is gone.
        let staged = self.staged.locked().get(&id.to_string()).cloned();
        if let Some(Staged { secrets, node, .. }) = staged {
            let creds = self.creds(&secrets)?;
            self.rbd()
                .remove_meta(&creds, &spec, &client_key(&node))
                .await?;
            self.staged.locked().remove(&id.to_string());
        }
        Ok(())
    }

    async fn node_condition(
        &self,
        id: &VolumeId,
        attachment: &Attachment,
    ) -> Result<Option<String>> {
        let spec = self.volume_spec(id)?;
        let Attachment::Device { path } = attachment else {
            return Ok(Some("unexpected attachment".into()));
        };
        if self.find_mapping(&spec).await?.as_ref() != Some(path) {
            return Ok(Some(format!(
                "{} is no longer mapped to {}",
                path.display(),
                spec.arg()
            )));
        }
        // The client this node recorded at stage is no longer in the
        // image: a detach fenced it (blocklisted; its I/O fails).
        let staged = self.staged.locked().get(&id.to_string()).cloned();
        if let Some(Staged {
            secrets,
            node,
            client: Some(addr),
        }) = staged
        {
            let meta = self.rbd().meta(&self.creds(&secrets)?, &spec).await?;
            if meta.get(&client_key(&node)) != Some(&addr) {
                return Ok(Some(format!(
                    "the volume was detached from this node while staged here: its client {addr} is fenced"
                )));
            }
        }
        // With credentials of its own, the node also asks the cluster
        // (bounded by the command timeout).
        if let Ok(creds) = self.creds(&Secrets::default()) {
            if let Err(e) = self.rbd().watchers(&creds, &spec).await {
                return Ok(Some(format!("the cluster does not answer: {}", e.message)));
            }
        }
        Ok(None)
    }
}

#[async_trait::async_trait]
impl DeviceMounter for RbdBackend {
    fn node_device(&self) -> Option<crate::host::devices::DeviceKind> {
        Some(crate::host::devices::DeviceKind::Rbd)
    }

    async fn node_copy_pending(&self, id: &VolumeId, ctx: &AttachContext) -> Result<bool> {
        // Mapped read-only: the UUID cannot change here; a writer's stage
        // renews it.
        if ctx.readonly {
            return Ok(false);
        }
        let spec = self.volume_spec(id)?;
        let creds = self.creds(&ctx.secrets)?;
        Ok(self
            .rbd()
            .meta(&creds, &spec)
            .await?
            .contains_key(META_FS_COPY))
    }

    async fn node_copy_done(&self, id: &VolumeId, ctx: &AttachContext) -> Result<()> {
        let spec = self.volume_spec(id)?;
        let creds = self.creds(&ctx.secrets)?;
        self.rbd().remove_meta(&creds, &spec, META_FS_COPY).await
    }

    async fn node_refresh_size(&self, id: &VolumeId, attachment: &Attachment) -> Result<u64> {
        self.volume_spec(id)?;
        let Attachment::Device { path } = attachment else {
            return Err(Error::internal("rbd volumes are block devices"));
        };
        // krbd follows the image's header: the new size is there once the
        // resize is done.
        let dev = path
            .file_name()
            .map(|d| d.to_string_lossy().into_owned())
            .ok_or_else(|| Error::internal("no device name"))?;
        let sectors = std::fs::read_to_string(self.sysfs.join("block").join(&dev).join("size"))
            .map_err(|e| Error::io(format!("size of {dev}"), e))?;
        Ok(sectors.trim().parse::<u64>().unwrap_or(0) * 512)
    }
}

#[async_trait::async_trait]
impl BlockTracker for RbdBackend {
    /// The snapshot image's extents holding data, its source's included
    /// (it is a clone of its cut), exact.
    async fn allocated_blocks(
        &self,
        snapshot: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        let creds = self.creds(secrets)?;
        let (spec, capacity, _) = self.snapshot_meta(&creds, snapshot).await?;
        let (ranges, next) = self
            .rbd()
            .diff(&creds, &spec, None, None, start, max)
            .await?;
        Ok(BlockPage {
            fixed: None,
            capacity,
            ranges,
            next,
        })
    }

    /// The extents that changed on the source between the two snapshots'
    /// cuts, exact.
    async fn changed_blocks(
        &self,
        base: &SnapshotId,
        target: &SnapshotId,
        start: u64,
        max: usize,
        secrets: &Secrets,
    ) -> Result<BlockPage> {
        let creds = self.creds(secrets)?;
        let (base_spec, _, base_meta) = self.snapshot_meta(&creds, base).await?;
        let (target_spec, capacity, target_meta) = self.snapshot_meta(&creds, target).await?;
        let (from, to) = (base_meta.get(META_SOURCE), target_meta.get(META_SOURCE));
        if from != to {
            return Err(Error::invalid(format!(
                "snapshots {base} and {target} are of different volumes"
            )));
        }
        let created =
            |m: &BTreeMap<String, String>| m.get(META_CREATED).and_then(|c| c.parse::<u64>().ok());
        if created(&base_meta) > created(&target_meta) {
            return Err(Error::invalid(format!(
                "base snapshot {base} is newer than target snapshot {target}"
            )));
        }
        let src = to
            .and_then(|s| VolumeId::parse(s).ok())
            .and_then(|v| self.volume_spec(&v).ok())
            .ok_or_else(|| Error::internal(format!("snapshot {target} names no source volume")))?;
        let (from_cut, to_cut) = (
            Self::snapshot_cut(&base_spec),
            Self::snapshot_cut(&target_spec),
        );
        let kept = self.rbd().snaps(&creds, &src).await.map_err(|e| {
            if e.kind == Kind::NotFound {
                Error::precondition(format!(
                    "the source volume of snapshots {base} and {target} is deleted: \
                     the points they were cut at went with it"
                ))
            } else {
                e
            }
        })?;
        for (id, cut) in [(base, &from_cut), (target, &to_cut)] {
            if !kept.contains(cut) {
                return Err(Error::precondition(format!(
                    "snapshot {id} keeps no cut on its source volume (a group snapshot \
                     taken while the volume was in use is a full copy): no changes to read"
                )));
            }
        }
        let (ranges, next) = self
            .rbd()
            .diff(&creds, &src, Some(&to_cut), Some(&from_cut), start, max)
            .await?;
        Ok(BlockPage {
            fixed: None,
            capacity,
            ranges,
            next,
        })
    }
}

impl RbdBackend {
    /// Maps the image on this node, with its own client (`noshare`).
    async fn map(&self, creds: &Creds, spec: &Spec, ctx: &AttachContext) -> Result<PathBuf> {
        let mut options: Vec<&str> = Vec::new();
        if !self.settings.map_options.is_empty() {
            options.push(&self.settings.map_options);
        }
        if let Some(o) = ctx.volume_context.get(CTX_MAP_OPTIONS) {
            check_map_options(o)?;
            options.push(o);
        }
        if ctx.readonly {
            options.push("ro");
        }
        if !options.iter().any(|o| o.split(',').any(|x| x == "noshare")) {
            options.push("noshare");
        }
        self.cli.map(creds, spec, &options.join(",")).await
    }

    /// Records in the image which client maps it on `node` (the mapping at
    /// `device`), unless it says so already; returns the address. A kernel
    /// that does not show its client's address leaves nothing to fence
    /// (logged).
    async fn record_client(
        &self,
        creds: &Creds,
        spec: &Spec,
        node: &str,
        device: &std::path::Path,
        meta: &BTreeMap<String, String>,
    ) -> Result<Option<String>> {
        let dev_id = device
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("rbd"))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| Error::internal(format!("{} is not an rbd device", device.display())))?;
        let attr = self
            .sysfs
            .join("bus/rbd/devices")
            .join(dev_id)
            .join("client_addr");
        let addr = match std::fs::read_to_string(&attr) {
            Ok(a) => a.trim().to_string(),
            Err(e) => {
                tracing::warn!(device = %device.display(), error = %e,
                    "the kernel shows no client address for the mapping: a detach cannot fence it");
                return Ok(None);
            }
        };
        cluster::check_client_addr(&addr)?;
        let key = client_key(node);
        if meta.get(&key) != Some(&addr) {
            self.rbd().set_meta(creds, spec, &key, &addr).await?;
        }
        Ok(Some(addr))
    }

    /// Controller side, at detach: the client `node` recorded is denied
    /// the cluster before its mark goes, so none of its writes land once
    /// the volume is someone else's. A node that unstaged removed its
    /// record; one that did not (lost, frozen, its teardown never came)
    /// is fenced.
    async fn fence(
        &self,
        creds: &Creds,
        spec: &Spec,
        id: &VolumeId,
        node: &str,
        addr: &str,
    ) -> Result<()> {
        self.rbd()
            .blocklist(creds, addr, self.settings.fence_expiry)
            .await?;
        tracing::warn!(volume = %id, %node, client = %addr, expire_secs = self.settings.fence_expiry,
            "fenced: the node still had the image mapped at detach; its client is blocklisted");
        self.rbd().remove_meta(creds, spec, &client_key(node)).await
    }

    /// Makes `tmp` a copy of a new volume's source (a volume's full copy,
    /// or a clone of a snapshot's `base`); the source's size.
    async fn copy_source(
        &self,
        creds: &Creds,
        source: &ContentSource,
        tmp: &Spec,
        p: &Params,
    ) -> Result<u64> {
        let gone = |what: &str, id: &dyn std::fmt::Display| {
            Error::not_found(format!("source {what} {id} does not exist"))
        };
        match source {
            ContentSource::Volume(v) => {
                let from = self.volume_spec(v).map_err(|_| gone("volume", v))?;
                let info = self
                    .rbd()
                    .info(creds, &from)
                    .await?
                    .ok_or_else(|| gone("volume", v))?;
                self.copy_of(creds, &from, tmp, Some(p), false).await?;
                Ok(info.size)
            }
            ContentSource::Snapshot(s) => {
                let from = self.snapshot_spec(s).map_err(|_| gone("snapshot", s))?;
                let (info, meta) = self
                    .rbd()
                    .describe(creds, &from)
                    .await?
                    .filter(|(_, meta)| meta.contains_key(META_NAME))
                    .ok_or_else(|| gone("snapshot", s))?;
                // While its source volume lives, the cut the snapshot image
                // was cloned from holds the same data (a snapshot image is
                // never written): a clone of it costs no cluster snapshot
                // (each one is a monitor commit, about a second) and its
                // chain of parents is one shorter. A cut that is gone (its
                // volume deleted, the snapshot being deleted, a snapshot a
                // group copied whole) is NOT_FOUND, and `base` serves.
                if let Some(src) = meta
                    .get(META_SOURCE)
                    .and_then(|v| VolumeId::parse(v).ok())
                    .and_then(|v| self.volume_spec(&v).ok())
                {
                    let cut = Self::snapshot_cut(&from);
                    match self.clone_from(creds, &src, &cut, tmp, Some(p)).await {
                        Ok(()) => return Ok(info.size),
                        Err(e) if e.kind == Kind::NotFound => {}
                        Err(e) => return Err(e),
                    }
                }
                // Else the snapshot image's `base`, taken at the first
                // restore that needs it.
                match self.rbd().snap_create(creds, &from, BASE).await {
                    Ok(()) => {}
                    Err(e) if e.kind == Kind::AlreadyExists => {}
                    Err(e) => return Err(e),
                }
                self.clone_from(creds, &from, BASE, tmp, Some(p)).await?;
                Ok(info.size)
            }
        }
    }

    /// The device this node has the image mapped at, if any.
    async fn find_mapping(&self, spec: &Spec) -> Result<Option<PathBuf>> {
        Ok(self
            .cli
            .mapped()
            .await?
            .into_iter()
            .find(|m| {
                m.pool == spec.pool
                    && m.namespace == spec.namespace
                    && m.name == spec.image
                    && (m.snap.is_empty() || m.snap == "-")
            })
            .map(|m| PathBuf::from(m.device)))
    }
}
