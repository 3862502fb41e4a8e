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

mod attach;
mod cli;
mod cluster;
mod creds;
mod health;
pub use health::reasons;
mod librbd;
mod snapshots;
pub(crate) mod stage;
#[cfg(test)]
mod tests;
mod volumes;

use crate::error::{Error, Kind, Result};
use crate::exec::CommandRunner;
use crate::plugin::{
    check_existing, check_publish_terms, join_fields, locator_for_name, node_name, node_tokens,
    split_fields, AccessMode, AttachContext, Attachment, Backend, BlockPage, Capacity,
    ContentSource, ControllerAttach, CreateSnapshot, CreateVolume, Page, Secrets, SizeRules,
    SnapshotId, SnapshotInfo, VolumeId, VolumeInfo,
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
    // A mapped image.
    attaches: &["^/dev/rbd"],
    node_token: Some(|t| t == NODE_TOKEN),
    reasons: reasons::ALL,
    secrets: &[USER_ID, USER_KEY],
    helpers: &[],
    store: None,
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
        /// temporary name (the CLI client); it carries no CSI name yet.
        Made = "rbd.made",
        /// (librbd client) a volume made in place has its CSI name; the
        /// record of its making is still there (its removal runs after the
        /// answer, in the background).
        Named = "rbd.named",
        /// (librbd client) a deleted image is in the trash, out of the
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

/// The StorageClass parameters this backend takes.
pub const PARAMETERS: &[&str] = &[
    "pool",
    "radosNamespace",
    "dataPool",
    "imageFeatures",
    "mapOptions",
    "mkfsOptions",
];

/// The mutable parameters: librbd's QoS limits on the image, each set as
/// the image's own config override (`conf_rbd_qos_*` metadata, what `rbd
/// config image set` writes). 0 is no limit.
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
    /// The controller's client to the cluster.
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
        let cap = runner.max_timeout();
        let cli = Arc::new(CliCluster {
            runner,
            monitors: settings.monitors.clone(),
        });
        let cluster: Arc<dyn Cluster> = match settings.client {
            Client::Cli => cli.clone(),
            Client::Librbd => Arc::new(
                librbd::LibCluster::new(&settings.monitors, cap)
                    .map_err(|e| bad(format!("client = \"librbd\": {e}")))?,
            ),
            Client::Auto => match librbd::LibCluster::new(&settings.monitors, cap) {
                Ok(lib) => Arc::new(lib),
                Err(e) => {
                    tracing::info!(backend = name, reason = %e, "librbd is not available: the controller runs the rbd command line");
                    cli.clone()
                }
            },
        };
        tracing::info!(
            backend = name,
            client = cluster.client(),
            "rbd controller calls go through {}",
            cluster.client()
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

    fn rbd(&self) -> &dyn Cluster {
        self.cluster.as_ref()
    }

    /// Which client the controller takes: `librbd` or `cli`.
    pub fn client(&self) -> &'static str {
        self.cluster.client()
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
            match k.as_str() {
                "pool" => p.pool = v.clone(),
                "radosNamespace" => p.namespace = v.clone(),
                "dataPool" => p.data_pool = v.clone(),
                "imageFeatures" => p.features = v.clone(),
                "mapOptions" => p.map_options = v.clone(),
                "mkfsOptions" => p.mkfs_options = v.clone(),
                // Refused before (not in KIND.parameters); never read.
                other => return Err(Error::unknown_parameter(&self.name, other, PARAMETERS)),
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
        crate::host::fs::mkfs_options(None, &p.mkfs_options)?;
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
                    crate::host::fs::MKFS_OPTIONS.to_string(),
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

    fn kind(&self) -> &'static super::Kind {
        &KIND
    }

    /// Whether this node reaches the cluster, asked with the config's own
    /// user (a node without one has no way to ask: nothing is said).
    async fn storage_findings(&self) -> Vec<crate::plugin::health::StorageFinding> {
        use crate::plugin::health::{Reason, StorageFinding, StorageStatus};
        if self.settings.user.is_none() {
            return Vec::new();
        }
        let asked = match self.creds(&Secrets::default()) {
            Ok(creds) => {
                self.rbd()
                    .pool_available(&creds, &self.settings.pools[0])
                    .await
            }
            Err(e) => Err(e),
        };
        match asked {
            Ok(_) => Vec::new(),
            Err(e) => vec![StorageFinding {
                status: StorageStatus::Unreachable,
                reason: if e.kind == crate::error::Kind::Unavailable {
                    reasons::ClusterNotAnswering
                } else {
                    Reason::HealthCheckFailed
                },
                message: format!("cluster {}: {}", self.settings.cluster_id, e.message),
            }],
        }
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

    fn limit_keeper(&self) -> Option<&dyn crate::plugin::LimitKeeper> {
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

    fn health_reporter(&self) -> Option<&dyn crate::plugin::HealthReporter> {
        Some(self)
    }
}
