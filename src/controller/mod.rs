//! The controller's policy over the plugin layer, as [`crate::node`] is
//! the node's: provisioning policy in one place. The Controller service validates a request, calls one function
//! here, and builds its response; this module picks the backend, splits its
//! parameters from the CO's, gates capabilities, content sources and
//! topology, takes the operation guard over every id the operation touches,
//! and delegates to the backend.

use crate::error::{Error, Kind, Result};
use crate::host::freeze::Frozen;
use crate::locks::{Key, OpGuard, OpLocks};
use crate::plugin::{
    Backend, Capacity, ContentSource, ControllerAttach, CreateSnapshot, CreateVolume, GroupStore,
    Ledger, LimitBook, Page, Registry, Relimit, Secrets, SnapshotId, SnapshotInfo, SnapshotInstant,
    VolumeCapability, VolumeId, VolumeInfo,
};
use crate::sync::LockExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// The StorageClass parameter that picks a backend.
pub use crate::plugin::BACKEND_PARAMETER;

/// The prefix of the keys a CO adds to parameters and contexts for itself
/// (`csi.storage.k8s.io/pvc/name`, `.../fstype`, the snapshotter's
/// `.../volumesnapshot/name`): never a backend's own parameter.
pub const CO_PREFIX: &str = "csi.storage.k8s.io/";

/// A topology segment map, as the wire carries it.
pub type Topology = HashMap<String, String>;

/// Splits request parameters into the backend's own and the CO's metadata:
/// the `backend` selector goes to neither.
pub fn split_parameters(
    all: &BTreeMap<String, String>,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let mut own = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (k, v) in all {
        if k == BACKEND_PARAMETER
            || k == ENCRYPTED_PARAMETER
            || crate::host::iolimit::KEYS.contains(&k.as_str())
        {
            continue;
        }
        if k.starts_with(CO_PREFIX) {
            metadata.insert(k.clone(), v.clone());
        } else {
            own.insert(k.clone(), v.clone());
        }
    }
    (own, metadata)
}

/// The StorageClass parameter that turns LUKS2 encryption on (`"true"`)
/// for a block backend's volumes: the node formats, opens and closes it.
pub const ENCRYPTED_PARAMETER: &str = "encrypted";

/// Whether the parameters ask for encryption; a value other than true or
/// false, or a backend without devices, is INVALID_ARGUMENT.
fn wants_encryption(backend: &dyn Backend, all: &BTreeMap<String, String>) -> Result<bool> {
    let on = match all.get(ENCRYPTED_PARAMETER).map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(Error::invalid(format!(
                "parameter {ENCRYPTED_PARAMETER} must be true or false, not {other:?}"
            )))
        }
    };
    if on && !backend.capabilities().block {
        return Err(Error::invalid(format!(
            "backend {} serves no block devices: its volumes cannot be encrypted",
            backend.name()
        )));
    }
    Ok(on)
}

/// The I/O limits the parameters set (see [`crate::host::iolimit`]),
/// checked: a bad value, or a limit for a backend without block devices
/// (nfs: nothing to limit), is INVALID_ARGUMENT.
fn io_limits(
    backend: &dyn Backend,
    all: &BTreeMap<String, String>,
    mutable: &BTreeMap<String, String>,
) -> Result<crate::host::iolimit::Limits> {
    // A class's, then its claim's VolumeAttributesClass's in their place.
    let mut given = all.clone();
    given.extend(mutable.clone());
    let limits = crate::host::iolimit::Limits::parse(&given)?;
    if !limits.is_empty() && !backend.capabilities().block {
        return Err(Error::invalid(format!(
            "backend {} serves no block devices: its volumes' I/O cannot be limited ({})",
            backend.name(),
            crate::host::iolimit::KEYS.join(", ")
        )));
    }
    Ok(limits)
}

/// Mutable parameters less the I/O limits (the plugin layer's own).
fn without_limits(mutable: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    mutable
        .iter()
        .filter(|(k, _)| !crate::host::iolimit::KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// How long ControllerModifyVolume of a node-local volume waits for its
/// node to take the change (the node asks every limits_refresh_seconds;
/// the resizer's own deadline is longer).
const RELAY_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// A validated CreateVolume request.
#[derive(Debug, Clone)]
pub struct NewVolume {
    pub name: String,
    pub required_bytes: u64,
    pub limit_bytes: u64,
    pub capabilities: Vec<VolumeCapability>,
    /// Every parameter as the request carried it.
    pub parameters: BTreeMap<String, String>,
    pub source: Option<ContentSource>,
    /// The requisite topologies; empty when the request has none.
    pub requisite: Vec<Topology>,
    pub secrets: Secrets,
    /// Mutable parameters (a VolumeAttributesClass's), applied once made.
    pub mutable: BTreeMap<String, String>,
}

/// Mutable parameters checked against a backend: each key one it has
/// (INVALID_ARGUMENT naming the first that is not, and the ones it has),
/// each value valid.
fn check_mutable(backend: &dyn Backend, changes: &BTreeMap<String, String>) -> Result<()> {
    let known = backend
        .modifier()
        .map(|m| m.mutable_keys())
        .unwrap_or_default();
    if let Some(key) = changes.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(Error::invalid(match known.is_empty() {
            true => format!(
                "mutable parameter {key:?}: backend {} has no mutable parameters",
                backend.name()
            ),
            false => format!(
                "mutable parameter {key:?} is not one backend {} can change (it can: {})",
                backend.name(),
                known.join(", ")
            ),
        }));
    }
    match backend.modifier() {
        Some(m) => m.check_mutable(changes),
        None => Ok(()),
    }
}

/// A validated CreateSnapshot request.
#[derive(Debug, Clone)]
pub struct NewSnapshot {
    pub source: VolumeId,
    pub name: String,
    pub parameters: BTreeMap<String, String>,
    pub secrets: Secrets,
}

/// A volume and the topology it is reachable from (`None`: everywhere).
#[derive(Debug, Clone)]
pub struct Placed {
    pub volume: VolumeInfo,
    pub topology: Option<Topology>,
}

/// One page of a listing and the token of the next (empty: the last page).
#[derive(Debug, Clone)]
pub struct Listing<T> {
    pub entries: Vec<T>,
    pub next_token: String,
}

/// What GetCapacity answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityAnswer {
    pub available_bytes: u64,
    pub maximum_volume_bytes: Option<u64>,
    pub minimum_volume_bytes: Option<u64>,
}

/// Controller operations over the registry.
pub struct ControllerOps {
    registry: Arc<Registry>,
    locks: OpLocks,
    node_id: String,
    topology_key: String,
    /// What ControllerPublish granted, for attach limits; `None`: none kept.
    ledger: Option<Ledger>,
    /// Group snapshots taken here; `None`: none served.
    groups: Option<GroupStore>,
    /// What freezes the staged filesystems of a group's sources.
    quiesce: Option<Arc<dyn crate::plugin::Quiesce>>,
    /// What each volume's health was when last measured.
    health: Arc<health::VolumeBook>,
    /// How a change to a volume's I/O limits is kept and reaches its
    /// pods; `None`: limits are not changed here.
    limits: Option<Keeping>,
    /// The central controller of node-local volumes: the changes it
    /// offers their nodes.
    relay: Option<Arc<crate::plugin::Relay>>,
}

/// How a controller keeps the changes to volumes' I/O limits.
struct Keeping {
    /// Every volume's changes, as this controller knows them (in its
    /// state directory; for a backend that keeps them itself, a copy).
    book: Arc<LimitBook>,
    /// The node in this process, which publishes the volumes and sets a
    /// change on their pods at once; `None`: the nodes ask for them.
    node: Option<Arc<dyn Relimit>>,
    /// The volumes of backends that keep their changes themselves whose
    /// changes were read into the book since this controller started.
    read: std::sync::Mutex<std::collections::HashSet<String>>,
}

mod group;
mod health;
mod metadata;
pub use group::{GroupSnapshotInfo, NewGroupSnapshot, FREEZE_DEADLINE};

/// Parses a page token: the id of the last entry of the previous page, as
/// `(backend, locator)`. The entry itself may be gone since; the walk goes
/// on after where it stood.
fn cursor(token: &str) -> Result<Option<(String, String)>> {
    if token.is_empty() {
        return Ok(None);
    }
    let bad = || {
        Error::aborted(format!(
            "starting_token {:?} is not valid",
            token.escape_debug().to_string()
        ))
    };
    if token.len() > 256 {
        return Err(bad());
    }
    let (backend, locator) = token.split_once(':').ok_or_else(bad)?;
    if !crate::plugin::is_dns_label(backend) || locator.is_empty() || locator.len() > 200 {
        return Err(bad());
    }
    Ok(Some((backend.to_string(), locator.to_string())))
}

/// An id from a request to delete or release something: one that cannot be
/// ours names nothing (`None`: done); a missing or oversized one is still
/// INVALID_ARGUMENT.
fn known<T>(parsed: Result<T>) -> Result<Option<T>> {
    match parsed {
        Ok(id) => Ok(Some(id)),
        Err(e) if e.kind == Kind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn max_entries(max: i32) -> Result<usize> {
    match max {
        m if m < 0 => Err(Error::invalid("max_entries must not be negative")),
        0 => Ok(usize::MAX),
        m => Ok(m as usize),
    }
}

impl ControllerOps {
    pub fn new(registry: Arc<Registry>, locks: OpLocks, node_id: &str, topology_key: &str) -> Self {
        Self {
            registry,
            locks,
            node_id: node_id.to_string(),
            topology_key: topology_key.to_string(),
            ledger: None,
            groups: None,
            quiesce: None,
            health: Default::default(),
            limits: None,
            relay: None,
        }
    }

    /// Offers changes to node-local volumes' limits to their nodes (the
    /// central controller of node-local volumes, which keeps none).
    pub fn with_relay(mut self, relay: Arc<crate::plugin::Relay>) -> Self {
        self.relay = Some(relay);
        self
    }

    /// The offers to node-local volumes' nodes, if this controller makes
    /// them.
    pub fn relay(&self) -> Option<&crate::plugin::Relay> {
        self.relay.as_deref()
    }

    /// ControllerModifyVolume of a node-local volume at the central
    /// controller: only its I/O limits may change (its other mutable
    /// parameters are the node's backend's, set at creation), offered to
    /// the volume's node; done when the node has taken the change.
    pub async fn relay_limits(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
    ) -> Result<()> {
        let Some(relay) = &self.relay else {
            return Err(Error::unimplemented(
                "this controller offers no limit changes",
            ));
        };
        let limits = crate::host::iolimit::LimitChanges::parse(changes)?;
        if let Some(key) = without_limits(changes).keys().next() {
            return Err(Error::invalid(format!(
                "mutable parameter {key}: volume {id} is on a node, and this central \
                 controller of a node-local driver reaches none: a node-local volume's mutable \
                 parameters are set when it is created (the VolumeAttributesClass its PVC names \
                 then) and cannot be changed afterwards, but its I/O limits ({}); name the \
                 class in a new PVC and copy the data (a snapshot or a clone of this one)",
                crate::host::iolimit::KEYS.join(", ")
            )));
        }
        if limits.is_empty() {
            return Ok(());
        }
        let _guard = self.guard(&[Key::Volume(id.clone())], &[])?;
        relay.offer(id, &limits, RELAY_PATIENCE).await
    }

    /// Changes volumes' I/O limits: kept in `book` (and by a backend
    /// that keeps them itself), set by `node` (this process's, which
    /// publishes the volumes) or asked for by the nodes
    /// ([`ControllerOps::current_limits`]).
    pub fn with_limits(mut self, book: Arc<LimitBook>, node: Option<Arc<dyn Relimit>>) -> Self {
        self.limits = Some(Keeping {
            book,
            node,
            read: Default::default(),
        });
        self
    }

    /// Whether this controller changes volumes' I/O limits.
    pub fn keeps_limits(&self) -> bool {
        self.limits.is_some()
    }

    /// The changes made to volume `id`'s limits since it was made: the
    /// book's, read first from a backend that keeps them itself.
    async fn limits_of(
        &self,
        keeping: &Keeping,
        backend: &dyn Backend,
        id: &VolumeId,
        secrets: &Secrets,
    ) -> Result<crate::host::iolimit::LimitChanges> {
        let key = id.to_string();
        if let Some(keeper) = backend.limit_keeper() {
            if !keeping.read.locked().contains(&key) {
                let kept = keeper.kept_limits(id, secrets).await?;
                keeping.book.set(id, &kept)?;
                keeping.read.locked().insert(key);
            }
        }
        Ok(keeping.book.get(id))
    }

    /// What the nodes ask for: the changes made to each of `ids`' limits
    /// (by id), for those this controller can say; none when it changes
    /// no limits.
    pub async fn current_limits(
        &self,
        ids: &[VolumeId],
    ) -> BTreeMap<String, crate::host::iolimit::LimitChanges> {
        let mut out = BTreeMap::new();
        let Some(keeping) = &self.limits else {
            return out;
        };
        for id in ids {
            let Ok(backend) = self.registry.for_volume(id) else {
                continue;
            };
            match self
                .limits_of(keeping, backend.as_ref(), id, &Secrets::default())
                .await
            {
                Ok(changes) => {
                    out.insert(id.to_string(), changes);
                }
                Err(e) if e.kind == Kind::NotFound => {}
                Err(e) => {
                    tracing::warn!(volume = %id, error = %e.message,
                        "a volume's I/O limit changes could not be read for a node")
                }
            }
        }
        out
    }

    /// Keeps a ledger of grants: publishes beyond a node's limit are
    /// refused.
    pub fn with_ledger(mut self, ledger: Ledger) -> Self {
        self.ledger = Some(ledger);
        self
    }

    /// Brings the ledger in line with the grants each attaching backend
    /// keeps in its own storage (see [`crate::plugin::Attacher::grants`]): a
    /// controller started in a new pod, its ledger empty, counts what its
    /// predecessor attached. A backend that cannot say, or fails to, is
    /// left as the journal has it. Answers how many grants changed.
    pub async fn settle_ledger(&self) -> usize {
        let Some(ledger) = &self.ledger else {
            return 0;
        };
        let mut changed = 0;
        for backend in self.registry.all() {
            let Some(attacher) = backend.attacher() else {
                continue;
            };
            match attacher.grants().await {
                Ok(Some(grants)) => match ledger.adopt(backend.name(), &grants) {
                    Ok((added, removed)) => {
                        if added + removed > 0 {
                            tracing::info!(backend = %backend.name(), added, removed, "attach ledger brought in line with the backend's grants");
                        }
                        changed += added + removed;
                    }
                    Err(e) => {
                        tracing::warn!(backend = %backend.name(), error = %e.message, "attach ledger not brought in line with the backend's grants")
                    }
                },
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(backend = %backend.name(), error = %e.message, "the backend's grants could not be read; the attach ledger is as its journal has it")
                }
            }
        }
        changed
    }

    /// How many volumes the ledger has attached to `node_id`'s node.
    pub fn attached_to(&self, node_id: &str) -> u64 {
        self.ledger
            .as_ref()
            .map_or(0, |l| l.held(crate::plugin::node_name(node_id)))
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// This node's topology segment.
    pub fn node_topology(&self) -> Topology {
        HashMap::from([(
            self.topology_key.clone(),
            crate::plugin::node_name(&self.node_id).to_string(),
        )])
    }

    fn topology_of(&self, backend: &dyn Backend) -> Option<Topology> {
        backend
            .capabilities()
            .node_local
            .then(|| self.node_topology())
    }

    fn here(&self, segments: &Topology) -> bool {
        let ours = self.node_topology();
        segments.iter().all(|(k, v)| ours.get(k) == Some(v))
    }

    fn backend(&self, name: &str) -> Option<Arc<dyn Backend>> {
        self.registry.get(name).cloned()
    }

    fn guard(&self, exclusive: &[Key], shared: &[Key]) -> Result<OpGuard> {
        self.locks.try_lock(exclusive, shared)
    }

    /// CreateVolume.
    pub async fn create_volume(&self, req: NewVolume) -> Result<Placed> {
        let backend = self.registry.for_parameters(&req.parameters)?.clone();
        let (parameters, metadata) = split_parameters(&req.parameters);
        crate::plugin::check_parameters(backend.as_ref(), &parameters)?;
        let encrypted = wants_encryption(backend.as_ref(), &req.parameters)?;
        let limits = io_limits(backend.as_ref(), &req.parameters, &req.mutable)?;
        let mutable = without_limits(&req.mutable);
        let caps = backend.capabilities();
        backend.provisioning()?;
        for cap in &req.capabilities {
            backend
                .supports(cap)
                .map_err(crate::plugin::Unsupported::at_controller)?;
        }
        match &req.source {
            Some(ContentSource::Snapshot(_)) if !caps.snapshot => {
                return Err(Error::invalid(format!(
                    "backend {} cannot create volumes from snapshots",
                    backend.name()
                )))
            }
            Some(ContentSource::Volume(_)) if !caps.clone => {
                return Err(Error::invalid(format!(
                    "backend {} cannot clone volumes",
                    backend.name()
                )))
            }
            _ => {}
        }
        check_mutable(backend.as_ref(), &mutable)?;
        // A volume too small for its filesystem would fail every stage
        // (mkfs refuses it): it is made as large as the filesystem needs,
        // which CSI allows (the answer says the size made).
        let floor = crate::plugin::filesystem_floor(&req.capabilities, encrypted);
        let required_bytes = if req.required_bytes < floor {
            if req.limit_bytes > 0 && req.limit_bytes < floor {
                return Err(Error::out_of_range(format!(
                    "limit_bytes {} is under {floor} bytes, the least its filesystem takes \
                     (mkfs refuses a smaller one)",
                    req.limit_bytes
                )));
            }
            floor
        } else {
            req.required_bytes
        };
        let topology = self.topology_of(backend.as_ref());
        if topology.is_some()
            && !req.requisite.is_empty()
            && !req.requisite.iter().any(|t| self.here(t))
        {
            return Err(Error::exhausted(format!(
                "volumes of backend {} live on node {}, which no requisite topology names",
                backend.name(),
                self.node_id
            )));
        }
        let request = CreateVolume {
            name: req.name,
            required_bytes,
            limit_bytes: req.limit_bytes,
            capabilities: req.capabilities,
            parameters,
            metadata,
            source: req.source,
            secrets: req.secrets,
        };
        let id = backend.provisioning()?.volume_id_for(&request)?;
        let shared: Vec<Key> = match &request.source {
            Some(ContentSource::Snapshot(s)) => vec![Key::Snapshot(s.clone())],
            Some(ContentSource::Volume(v)) => vec![Key::Volume(v.clone())],
            None => vec![],
        };
        let _guard = self.guard(
            &[
                Key::VolumeName(request.name.clone()),
                Key::Volume(id.clone()),
            ],
            &shared,
        )?;
        let mut volume = backend.provisioning()?.create_volume(&request).await?;
        if encrypted {
            volume.context.insert(
                crate::host::crypt::CONTEXT_KEY.to_string(),
                crate::host::crypt::LUKS2.to_string(),
            );
        }
        limits.to_context(&mut volume.context);
        // A retried create applies them again: no change when they hold.
        if !mutable.is_empty() {
            backend
                .modifying()?
                .modify_volume(&volume.id, &mutable, &request.secrets)
                .await?;
        }
        Ok(Placed { volume, topology })
    }

    /// ControllerModifyVolume: every key checked (known to the volume's
    /// backend, a valid value) before the backend changes anything. The
    /// I/O limits are the plugin layer's: kept in the limit book once the
    /// backend's keys are made, then set on the pods that use the volume.
    pub async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        secrets: &Secrets,
    ) -> Result<()> {
        let backend = self.registry.for_volume(id)?.clone();
        let limits = crate::host::iolimit::LimitChanges::parse(changes)?;
        let rest = without_limits(changes);
        let keeping = match (limits.is_empty(), &self.limits) {
            (true, _) => None,
            (false, Some(keeping)) => Some(keeping),
            (false, None) => {
                let key = limits.0.keys().next().cloned().unwrap_or_default();
                return Err(Error::invalid(format!(
                    "mutable parameter {key}: this controller cannot change a volume's I/O \
                     limits, as it does not run where the volume's pods do (they are set when \
                     the volume is made: its StorageClass, or the VolumeAttributesClass its \
                     claim names then; see docs/io-limits.md)"
                )));
            }
        };
        if keeping.is_some() && !backend.capabilities().block {
            return Err(Error::invalid(format!(
                "backend {} serves no block devices: its volumes' I/O cannot be limited ({})",
                backend.name(),
                crate::host::iolimit::KEYS.join(", ")
            )));
        }
        check_mutable(backend.as_ref(), &rest)?;
        let _guard = self.guard(&[Key::Volume(id.clone())], &[])?;
        if backend
            .provisioning()?
            .get_volume(id, secrets)
            .await?
            .is_none()
        {
            return Err(Error::no_volume(id));
        }
        // No key, no change (what csi-sanity asks of an empty class; the
        // spec: nothing is changed for keys that are absent).
        if !rest.is_empty() {
            backend
                .modifying()?
                .modify_volume(id, &rest, secrets)
                .await?;
        }
        // Each step is safe to repeat: a retry of a modify cut short
        // makes the backend's change again (no change), records the same
        // limits, and sets them again.
        let Some(keeping) = keeping else {
            return Ok(());
        };
        let now = self
            .limits_of(keeping, backend.as_ref(), id, secrets)
            .await?
            .then(&limits);
        if let Some(keeper) = backend.limit_keeper() {
            keeper.keep_limits(id, &now, secrets).await?;
        }
        keeping.book.set(id, &now)?;
        crate::killpoint::hit(crate::killpoint::Step::ModifyLimits);
        match &keeping.node {
            Some(node) => {
                let set = node.relimit(id).await;
                tracing::info!(volume = %id, publishes = set, "the volume's I/O limits changed");
            }
            None => tracing::info!(volume = %id, changes = ?now,
                "the volume's I/O limits changed; the nodes publishing it take them when they ask"),
        }
        Ok(())
    }

    /// DeleteVolume. An id that cannot be ours names nothing: done.
    pub async fn delete_volume(&self, raw_id: &str, secrets: &Secrets) -> Result<()> {
        let Some(id) = known(VolumeId::parse(raw_id))? else {
            return Ok(());
        };
        let Some(backend) = self.backend(id.backend()) else {
            return Ok(());
        };
        let _guard = self.guard(&[Key::Volume(id.clone())], &[])?;
        backend.provisioning()?.delete_volume(&id, secrets).await?;
        self.health.forget(&id.to_string());
        if let Some(keeping) = &self.limits {
            keeping.book.forget(&id)?;
            keeping.read.locked().remove(&id.to_string());
        }
        match &self.ledger {
            Some(ledger) => ledger.release(&id, None),
            None => Ok(()),
        }
    }

    /// ControllerGetVolume.
    pub async fn get_volume(&self, id: &VolumeId) -> Result<Placed> {
        let backend = self.registry.for_volume(id)?.clone();
        let volume = backend
            .provisioning()?
            .get_volume(id, &Secrets::default())
            .await?
            .ok_or_else(|| Error::no_volume(id))?;
        Ok(Placed {
            topology: self.topology_of(backend.as_ref()),
            volume,
        })
    }

    /// ValidateVolumeCapabilities: `None` when every capability and
    /// parameter is served, else why not.
    pub async fn validate_capabilities(
        &self,
        id: &VolumeId,
        capabilities: &[VolumeCapability],
        parameters: &BTreeMap<String, String>,
        secrets: &Secrets,
    ) -> Result<Option<String>> {
        let backend = self.registry.for_volume(id)?.clone();
        if backend
            .provisioning()?
            .get_volume(id, secrets)
            .await?
            .is_none()
        {
            return Err(Error::no_volume(id));
        }
        let (own, _) = split_parameters(parameters);
        Ok(capabilities
            .iter()
            .map(|c| {
                backend
                    .supports(c)
                    .map_err(crate::plugin::Unsupported::at_controller)
            })
            .chain(std::iter::once(crate::plugin::check_parameters(
                backend.as_ref(),
                &own,
            )))
            .find_map(Result::err)
            .map(|e| e.message))
    }

    /// ControllerPublishVolume. Backends that attach do the work; for the
    /// others (a deployment may mix them) the volume is reachable as it is,
    /// and the answer is an empty publish context once the volume and the
    /// node check out.
    ///
    /// `limit` is the most volumes the node takes (`None`: no limit): a
    /// publish of a volume it does not hold yet to a node holding that
    /// many is refused, RESOURCE_EXHAUSTED, before the backend attaches.
    pub async fn publish(
        &self,
        id: &VolumeId,
        req: ControllerAttach,
        limit: Option<u64>,
    ) -> Result<BTreeMap<String, String>> {
        let backend = self.registry.for_volume(id)?.clone();
        backend
            .supports(&req.capability)
            .map_err(crate::plugin::Unsupported::at_controller)?;
        // A single-node publish holds the whole volume: a backend's "is it
        // published elsewhere?" check and its record of this node cannot
        // interleave with a publish to another node. Multi-node publishes
        // of one volume go side by side.
        let publish = Key::Publish(id.clone(), req.node_id.to_string());
        let volume = Key::Volume(id.clone());
        let _guard = if req.capability.mode.is_multi_node() {
            self.guard(&[publish], &[volume])?
        } else {
            self.guard(&[publish, volume], &[])?
        };
        if backend
            .provisioning()?
            .get_volume(id, &req.secrets)
            .await?
            .is_none()
        {
            return Err(Error::no_volume(id));
        }
        let mut context = if backend.capabilities().attach {
            let place = match &self.ledger {
                Some(ledger) => {
                    Some(ledger.reserve(id, crate::plugin::node_name(&req.node_id), limit)?)
                }
                None => None,
            };
            crate::killpoint::hit(crate::killpoint::Step::AttachReserved);
            let context = backend.attaching()?.controller_attach(id, &req).await?;
            crate::killpoint::hit(crate::killpoint::Step::AttachAttached);
            if let Some(place) = place {
                place.commit()?;
            }
            context
        } else if backend.capabilities().node_local
            && crate::plugin::node_name(&req.node_id) != crate::plugin::node_name(&self.node_id)
        {
            return Err(Error::not_found(format!(
                "volume {id} lives on node {}; node {:?} cannot reach it",
                self.node_id, req.node_id
            )));
        } else {
            BTreeMap::new()
        };
        // A read-only publish: the node stages and publishes read-only.
        if req.readonly {
            context.insert(crate::plugin::CTX_READONLY.into(), "true".into());
        }
        Ok(context)
    }

    /// ControllerUnpublishVolume: idempotent; a volume or node we cannot
    /// find is one that is not published.
    pub async fn unpublish(
        &self,
        raw_id: &str,
        node_id: Option<&str>,
        secrets: &Secrets,
    ) -> Result<()> {
        let Some(id) = known(VolumeId::parse(raw_id))? else {
            return Ok(());
        };
        let Some(backend) = self.backend(id.backend()) else {
            return Ok(());
        };
        if !backend.capabilities().attach {
            return Ok(());
        }
        let exclusive = match node_id {
            Some(node) => Key::Publish(id.clone(), node.to_string()),
            None => Key::Volume(id.clone()),
        };
        let shared = match node_id {
            Some(_) => vec![Key::Volume(id.clone())],
            None => vec![],
        };
        let _guard = self.guard(&[exclusive], &shared)?;
        backend
            .attaching()?
            .controller_detach(&id, node_id, secrets)
            .await?;
        match &self.ledger {
            Some(ledger) => ledger.release(&id, node_id.map(crate::plugin::node_name)),
            None => Ok(()),
        }
    }

    /// ListVolumes: one page, from a cursor (the last id of the previous
    /// page), so a whole walk costs what the volumes cost once. Backends are
    /// walked in name order, each in locator order.
    pub async fn list_volumes(&self, max: i32, token: &str) -> Result<Listing<Placed>> {
        let limit = max_entries(max)?;
        let from = cursor(token)?;
        let mut entries = Vec::new();
        for backend in self.registry.all() {
            let caps = backend.capabilities();
            if !caps.provision {
                continue;
            }
            let Some(page) = page_for(backend.name(), from.as_ref(), limit, entries.len()) else {
                continue;
            };
            let topology = self.topology_of(backend.as_ref());
            for volume in backend.provisioning()?.list_volumes(&page).await? {
                entries.push(Placed {
                    volume,
                    topology: topology.clone(),
                });
            }
            if entries.len() > limit {
                break;
            }
        }
        Ok(finish(entries, limit, |p| p.volume.id.to_string()))
    }

    /// GetCapacity. A capability or topology the backend cannot serve has
    /// no capacity: zero.
    pub async fn capacity(
        &self,
        parameters: &BTreeMap<String, String>,
        capabilities: &[VolumeCapability],
        topology: Option<&Topology>,
    ) -> Result<CapacityAnswer> {
        let backend = self.registry.for_parameters(parameters)?.clone();
        let (own, _) = split_parameters(parameters);
        crate::plugin::check_parameters(backend.as_ref(), &own)?;
        let served = capabilities.iter().all(|c| backend.supports(c).is_ok());
        let reachable = match topology {
            Some(t) if backend.capabilities().node_local => self.here(t),
            _ => true,
        };
        if !served || !reachable {
            return Ok(CapacityAnswer {
                available_bytes: 0,
                maximum_volume_bytes: Some(0),
                minimum_volume_bytes: None,
            });
        }
        let Capacity {
            available_bytes,
            maximum_volume_bytes,
            minimum_volume_bytes,
        } = backend.provisioning()?.capacity(&own).await?;
        Ok(CapacityAnswer {
            available_bytes,
            maximum_volume_bytes,
            minimum_volume_bytes,
        })
    }

    /// ControllerExpandVolume: the new size, and whether the node must act.
    pub async fn expand(
        &self,
        id: &VolumeId,
        required: u64,
        limit: u64,
        capability: Option<&VolumeCapability>,
        secrets: &Secrets,
    ) -> Result<(u64, bool)> {
        let backend = self.registry.for_volume(id)?.clone();
        backend.expanding()?;
        if let Some(cap) = capability {
            backend
                .supports(cap)
                .map_err(crate::plugin::Unsupported::at_controller)?;
        }
        let _guard = self.guard(&[Key::Volume(id.clone())], &[])?;
        let size = backend
            .expanding()?
            .expand_volume(id, required, limit, secrets)
            .await?;
        // Devices on the node must learn the new size and filesystems grow.
        Ok((size, backend.capabilities().device_mount))
    }

    /// CreateSnapshot.
    pub async fn create_snapshot(&self, req: NewSnapshot) -> Result<SnapshotInfo> {
        let backend = self.registry.for_volume(&req.source)?.clone();
        backend.snapshotting()?;
        let (parameters, metadata) = split_parameters(&req.parameters);
        backend
            .snapshotting()?
            .validate_snapshot_parameters(&parameters)?;
        let request = CreateSnapshot {
            source: req.source,
            name: req.name,
            parameters,
            metadata,
            secrets: req.secrets,
        };
        let id = backend.snapshotting()?.snapshot_id_for(&request)?;
        let _guard = self.guard(
            &[
                Key::SnapshotName(request.name.clone()),
                Key::Snapshot(id.clone()),
            ],
            &[Key::Volume(request.source.clone())],
        )?;
        // A volume staged here whose backend copies it over time is held
        // at one instant for the copy: its filesystem frozen (and thawed
        // by the freeze's holder should this process die meanwhile).
        let frozen = match (&self.quiesce, backend.capabilities().snapshot_instant) {
            (Some(quiesce), SnapshotInstant::Frozen) => {
                quiesce
                    .freeze(
                        std::slice::from_ref(&request.source),
                        true,
                        true,
                        group::FREEZE_DEADLINE,
                    )
                    .await?
            }
            _ => Frozen::none(),
        };
        // A failure drops the freeze, which thaws.
        let made = backend.snapshotting()?.create_snapshot(&request).await?;
        if let Err(e) = frozen.thaw().await {
            // Not one instant after all: the copy goes, and the call fails
            // (the CO retries it).
            let _ = backend
                .snapshotting()?
                .delete_snapshot(&made.id, &request.secrets)
                .await;
            return Err(e);
        }
        Ok(made)
    }

    /// DeleteSnapshot. An id that cannot be ours names nothing: done.
    pub async fn delete_snapshot(&self, raw_id: &str, secrets: &Secrets) -> Result<()> {
        let Some(id) = known(SnapshotId::parse(raw_id))? else {
            return Ok(());
        };
        let Some(backend) = self.backend(id.backend()) else {
            return Ok(());
        };
        let _guard = self.guard(&[Key::Snapshot(id.clone())], &[])?;
        backend
            .snapshotting()?
            .delete_snapshot(&id, secrets)
            .await?;
        self.forget_member(&id)
    }

    /// GetSnapshot.
    pub async fn get_snapshot(&self, id: &SnapshotId, secrets: &Secrets) -> Result<SnapshotInfo> {
        let backend = self.registry.for_snapshot(id)?.clone();
        backend
            .snapshotting()?
            .get_snapshot(id, secrets)
            .await?
            .map(|s| self.with_group(s))
            .ok_or_else(|| Error::no_snapshot(id))
    }

    /// ListSnapshots: one snapshot by id, the snapshots of one volume, or
    /// all, a page at a time (see [`ControllerOps::list_volumes`]). Ids that
    /// cannot be ours match nothing.
    pub async fn list_snapshots(
        &self,
        snapshot_id: &str,
        source_volume_id: &str,
        max: i32,
        token: &str,
    ) -> Result<Listing<SnapshotInfo>> {
        let limit = max_entries(max)?;
        let from = cursor(token)?;
        let source = match source_volume_id {
            "" => None,
            raw => match VolumeId::parse(raw) {
                Ok(id) => Some(id),
                Err(_) => {
                    return Ok(finish(Vec::new(), limit, |s: &SnapshotInfo| {
                        s.id.to_string()
                    }))
                }
            },
        };
        if !snapshot_id.is_empty() {
            let mut found = Vec::new();
            if let Ok(id) = SnapshotId::parse(snapshot_id) {
                if let Some(b) = self.backend(id.backend()) {
                    if b.capabilities().snapshot {
                        found.extend(
                            b.snapshotting()?
                                .get_snapshot(&id, &Secrets::default())
                                .await?,
                        );
                    }
                }
            }
            found.retain(|s| source.as_ref().is_none_or(|v| &s.source_volume == v));
            found.retain(|s| {
                from.as_ref().is_none_or(|(b, l)| {
                    (s.id.backend(), s.id.locator()) > (b.as_str(), l.as_str())
                })
            });
            let found = found.into_iter().map(|s| self.with_group(s)).collect();
            return Ok(finish(found, limit, |s| s.id.to_string()));
        }
        let mut entries = Vec::new();
        for backend in self.registry.all() {
            if !backend.capabilities().snapshot {
                continue;
            }
            // A volume's snapshots live in its own backend.
            if source
                .as_ref()
                .is_some_and(|v| v.backend() != backend.name())
            {
                continue;
            }
            let Some(page) = page_for(backend.name(), from.as_ref(), limit, entries.len()) else {
                continue;
            };
            let page = backend
                .snapshotting()?
                .list_snapshots(source.as_ref(), &page)
                .await?;
            entries.extend(page.into_iter().map(|s| self.with_group(s)));
            if entries.len() > limit {
                break;
            }
        }
        Ok(finish(entries, limit, |s| s.id.to_string()))
    }
}

/// The page to ask `backend` for, given the cursor and how many entries the
/// walk has so far; `None` when the backend lies before the cursor. One more
/// than the page needs is asked for, to know whether another page follows.
fn page_for(
    backend: &str,
    from: Option<&(String, String)>,
    limit: usize,
    have: usize,
) -> Option<Page> {
    let after = match from {
        Some((b, _)) if backend < b.as_str() => return None,
        Some((b, l)) if backend == b.as_str() => Some(l.clone()),
        _ => None,
    };
    Some(Page {
        after,
        limit: limit.saturating_sub(have).saturating_add(1),
    })
}

fn finish<T>(mut entries: Vec<T>, limit: usize, id: impl Fn(&T) -> String) -> Listing<T> {
    let next_token = if entries.len() > limit {
        entries.truncate(limit);
        entries.last().map(&id).unwrap_or_default()
    } else {
        String::new()
    };
    Listing {
        entries,
        next_token,
    }
}

#[cfg(test)]
mod tests;
