//! The controller policy over an in-memory backend that records what it is
//! given.

use super::*;
use crate::plugin::{
    AccessMode, AccessType, AttachContext, Attacher, Attachment, Capabilities, DeviceMounter,
    Expander, GroupCutter, GroupSnapshots, Groups, Modifier, Provisioner, Registry,
    SnapshotInstant, Snapshotter, Stager,
};
use std::sync::Mutex;
use tokio::sync::Notify;

mod calls;
mod groups;
mod health;
mod publish;

/// An in-memory backend that records the secrets and pages it receives and
/// can hold a create open until told to go on.
struct Memory {
    name: &'static str,
    caps: Capabilities,
    volumes: Mutex<BTreeMap<String, VolumeInfo>>,
    snapshots: Mutex<BTreeMap<String, SnapshotInfo>>,
    secrets_seen: Mutex<Vec<(&'static str, Secrets)>>,
    pages: Mutex<Vec<Page>>,
    /// How many volumes list_volumes has handed out in all.
    returned: Mutex<usize>,
    metadata_seen: Mutex<Vec<BTreeMap<String, String>>>,
    /// When set, create_volume and controller_attach wait on `release`
    /// after telling `entered`.
    hold: Option<(Arc<Notify>, Arc<Notify>)>,
    /// What modify_volume was asked, per volume.
    modified: Mutex<Vec<(String, BTreeMap<String, String>)>>,
    /// A volume whose snapshots fail.
    fail_snapshots_of: Mutex<Option<VolumeId>>,
    /// What `grants` answers.
    kept_grants: Mutex<Option<Vec<(VolumeId, String)>>>,
    /// The required bytes of each create_volume.
    required_seen: Mutex<Vec<u64>>,
    /// Volumes listed whose lookups find nothing (their storage lost), and
    /// volumes whose lookups fail as storage that does not answer.
    lost: Mutex<std::collections::BTreeSet<String>>,
    not_answering: Mutex<std::collections::BTreeSet<String>>,
    /// Its listing fails (its storage does not answer).
    list_fails: std::sync::atomic::AtomicBool,
    /// It logs each call's secrets as a careless backend would. Only the
    /// test that captures the log sets it: a log line reached first on
    /// another test's thread, with no subscriber there, may have its
    /// interest cached as "never" while this test's subscriber is being
    /// set, and then the line is not written at all.
    logs: std::sync::atomic::AtomicBool,
}

impl Memory {
    fn new(name: &'static str, caps: Capabilities) -> Self {
        Memory {
            name,
            caps,
            volumes: Default::default(),
            snapshots: Default::default(),
            secrets_seen: Default::default(),
            pages: Default::default(),
            returned: Default::default(),
            metadata_seen: Default::default(),
            hold: None,
            modified: Default::default(),
            fail_snapshots_of: Default::default(),
            kept_grants: Default::default(),
            required_seen: Default::default(),
            lost: Default::default(),
            not_answering: Default::default(),
            list_fails: Default::default(),
            logs: Default::default(),
        }
    }

    fn with_volumes(self, n: usize) -> Self {
        for i in 0..n {
            self.add(&format!("v{i:04}"));
        }
        self
    }

    fn add(&self, locator: &str) {
        let id = VolumeId::new(self.name, locator).unwrap();
        self.volumes.lock().unwrap().insert(
            locator.into(),
            VolumeInfo {
                id,
                capacity_bytes: 1,
                context: BTreeMap::new(),
                source: None,
            },
        );
    }

    fn saw(&self, op: &'static str, secrets: &Secrets) {
        // A careless backend logs what it got: the values must not show.
        if self.logs.load(std::sync::atomic::Ordering::Relaxed) {
            tracing::info!(op, ?secrets, %secrets, "backend called");
        }
        self.secrets_seen
            .lock()
            .unwrap()
            .push((op, secrets.clone()));
    }
}

#[async_trait::async_trait]
impl Backend for Memory {
    fn name(&self) -> &str {
        self.name
    }

    fn kind(&self) -> &'static crate::plugin::Kind {
        &crate::plugin::DOUBLE
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    fn access_modes(&self) -> Vec<AccessMode> {
        self.caps.access_modes.clone()
    }

    fn node_local(&self) -> bool {
        self.caps.node_local
    }

    // The double plays the backend its capabilities describe.
    fn provisioner(&self) -> Option<&dyn Provisioner> {
        self.caps.provision.then_some(self as &dyn Provisioner)
    }

    fn expander(&self) -> Option<&dyn Expander> {
        self.caps.expand.then_some(self as &dyn Expander)
    }

    fn snapshotter(&self) -> Option<&dyn Snapshotter> {
        self.caps.snapshot.then_some(self as &dyn Snapshotter)
    }

    fn modifier(&self) -> Option<&dyn Modifier> {
        Some(self)
    }

    fn attacher(&self) -> Option<&dyn Attacher> {
        self.caps.attach.then_some(self as &dyn Attacher)
    }

    fn stager(&self) -> Option<&dyn Stager> {
        self.caps.device_mount.then_some(self as &dyn Stager)
    }

    fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
        self.caps.device_mount.then_some(self as &dyn DeviceMounter)
    }
}

#[async_trait::async_trait]
impl Provisioner for Memory {
    fn clones(&self) -> bool {
        self.caps.clone
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        self.saw("create_volume", &req.secrets);
        self.required_seen.lock().unwrap().push(req.required_bytes);
        self.metadata_seen
            .lock()
            .unwrap()
            .push(req.metadata.clone());
        if let Some((entered, release)) = &self.hold {
            entered.notify_one();
            release.notified().await;
        }
        let locator = crate::plugin::locator_for_name(&req.name);
        self.add(&locator);
        Ok(self.volumes.lock().unwrap()[&locator].clone())
    }

    async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()> {
        self.saw("delete_volume", secrets);
        self.volumes.lock().unwrap().remove(id.locator());
        Ok(())
    }

    async fn get_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        if self.not_answering.lock().unwrap().contains(id.locator()) {
            return Err(Error::unavailable("the server did not answer within 5 s"));
        }
        if self.lost.lock().unwrap().contains(id.locator()) {
            return Ok(None);
        }
        Ok(self.volumes.lock().unwrap().get(id.locator()).cloned())
    }

    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
        if self.list_fails.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Error::unavailable("the store did not answer within 5 s"));
        }
        self.pages.lock().unwrap().push(page.clone());
        let all: Vec<VolumeInfo> = self.volumes.lock().unwrap().values().cloned().collect();
        let out = page.apply(all, |v| v.id.locator());
        *self.returned.lock().unwrap() += out.len();
        Ok(out)
    }

    async fn capacity(&self, _: &BTreeMap<String, String>) -> Result<Capacity> {
        Ok(Capacity {
            available_bytes: 42,
            maximum_volume_bytes: None,
            minimum_volume_bytes: None,
        })
    }
}

#[async_trait::async_trait]
impl Expander for Memory {
    fn online(&self) -> bool {
        self.caps.expand_online
    }

    async fn expand_volume(&self, _: &VolumeId, required: u64, _: u64, s: &Secrets) -> Result<u64> {
        self.saw("expand_volume", s);
        Ok(required)
    }
}

#[async_trait::async_trait]
impl Snapshotter for Memory {
    fn instant(&self) -> SnapshotInstant {
        self.caps.snapshot_instant
    }

    fn groups(&self) -> Groups<'_> {
        match self.caps.group_snapshot {
            GroupSnapshots::None => Groups::Refused(format!("{} takes no groups", self.name)),
            GroupSnapshots::Frozen => Groups::Frozen,
            GroupSnapshots::Unstaged => Groups::Unstaged,
            GroupSnapshots::Cut => Groups::Cut(self),
        }
    }

    async fn create_snapshot(&self, req: &CreateSnapshot) -> Result<SnapshotInfo> {
        self.saw("create_snapshot", &req.secrets);
        if self.fail_snapshots_of.lock().unwrap().as_ref() == Some(&req.source) {
            return Err(Error::exhausted("no room for this one"));
        }
        self.metadata_seen
            .lock()
            .unwrap()
            .push(req.metadata.clone());
        let info = SnapshotInfo {
            id: self.snapshot_id_for(req)?,
            source_volume: req.source.clone(),
            size_bytes: 1,
            created: std::time::UNIX_EPOCH,
            ready: true,
            group: None,
        };
        self.snapshots
            .lock()
            .unwrap()
            .insert(info.id.locator().to_string(), info.clone());
        Ok(info)
    }

    async fn delete_snapshot(&self, id: &SnapshotId, secrets: &Secrets) -> Result<()> {
        self.saw("delete_snapshot", secrets);
        self.snapshots.lock().unwrap().remove(id.locator());
        Ok(())
    }

    async fn get_snapshot(
        &self,
        id: &SnapshotId,
        _secrets: &Secrets,
    ) -> Result<Option<SnapshotInfo>> {
        Ok(self.snapshots.lock().unwrap().get(id.locator()).cloned())
    }

    async fn list_snapshots(
        &self,
        source: Option<&VolumeId>,
        page: &Page,
    ) -> Result<Vec<SnapshotInfo>> {
        let all: Vec<SnapshotInfo> = self
            .snapshots
            .lock()
            .unwrap()
            .values()
            .filter(|s| source.is_none_or(|v| &s.source_volume == v))
            .cloned()
            .collect();
        Ok(page.apply(all, |s| s.id.locator()))
    }
}

#[async_trait::async_trait]
impl Modifier for Memory {
    fn mutable_keys(&self) -> Vec<&'static str> {
        vec!["tier", "iops"]
    }

    fn check_mutable(&self, changes: &BTreeMap<String, String>) -> Result<()> {
        match changes.get("tier").map(String::as_str) {
            None | Some("gold" | "silver") => Ok(()),
            Some(v) => Err(Error::invalid(format!("mutable parameter tier: {v:?}"))),
        }
    }

    async fn modify_volume(
        &self,
        id: &VolumeId,
        changes: &BTreeMap<String, String>,
        secrets: &Secrets,
    ) -> Result<()> {
        self.saw("modify_volume", secrets);
        self.modified
            .lock()
            .unwrap()
            .push((id.to_string(), changes.clone()));
        Ok(())
    }
}

#[async_trait::async_trait]
impl Attacher for Memory {
    async fn grants(&self) -> Result<Option<Vec<(VolumeId, String)>>> {
        Ok(self.kept_grants.lock().unwrap().clone())
    }

    async fn controller_attach(
        &self,
        _: &VolumeId,
        req: &ControllerAttach,
    ) -> Result<BTreeMap<String, String>> {
        self.saw("controller_attach", &req.secrets);
        if let Some((entered, release)) = &self.hold {
            entered.notify_one();
            release.notified().await;
        }
        Ok(BTreeMap::from([("node".to_string(), req.node_id.clone())]))
    }

    async fn controller_detach(
        &self,
        _: &VolumeId,
        _: Option<&str>,
        secrets: &Secrets,
    ) -> Result<()> {
        self.saw("controller_detach", secrets);
        Ok(())
    }
}

#[async_trait::async_trait]
impl GroupCutter for Memory {
    async fn cut_group(&self, _: &[CreateSnapshot]) -> Result<()> {
        Ok(())
    }
}

// The controller never stages: a local backend's double names the node
// capabilities its kind has and refuses the calls.
#[async_trait::async_trait]
impl Stager for Memory {
    async fn node_attach(&self, _: &VolumeId, _: &AttachContext) -> Result<Attachment> {
        Err(Error::internal("the controller's double stages nothing"))
    }

    async fn node_detach(&self, _: &VolumeId, _: Option<&Attachment>) -> Result<()> {
        Err(Error::internal("the controller's double stages nothing"))
    }
}

#[async_trait::async_trait]
impl DeviceMounter for Memory {
    async fn node_refresh_size(&self, _: &VolumeId, _: &Attachment) -> Result<u64> {
        Err(Error::internal("the controller's double stages nothing"))
    }
}

/// What the `file` and `lvm` backends offer.
fn local() -> Capabilities {
    Capabilities {
        provision: true,
        device_mount: true,
        expand: true,
        expand_online: true,
        snapshot: true,
        group_snapshot: GroupSnapshots::Frozen,
        snapshot_instant: SnapshotInstant::Frozen,
        clone: true,
        block: true,
        node_local: true,
        access_modes: crate::plugin::SINGLE_NODE_MODES.to_vec(),
        ..Default::default()
    }
}

fn remote_attach() -> Capabilities {
    Capabilities {
        provision: true,
        attach: true,
        snapshot: true,
        expand: true,
        access_modes: vec![
            AccessMode::SingleNodeWriter,
            AccessMode::MultiNodeMultiWriter,
        ],
        ..Default::default()
    }
}

fn ops(backends: Vec<Arc<Memory>>) -> ControllerOps {
    let mut r = Registry::new();
    for b in backends {
        r.register(b).unwrap();
    }
    ControllerOps::new(
        Arc::new(r),
        OpLocks::new(),
        "node-a",
        "topology.ferrovol.io/node",
    )
}

fn cap() -> VolumeCapability {
    VolumeCapability {
        access: AccessType::Mount {
            fs_type: String::new(),
            mount_flags: vec![],
        },
        mode: AccessMode::SingleNodeWriter,
    }
}

/// A parameter map of `pairs`.
fn kv(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn new_volume(name: &str, parameters: &[(&str, &str)]) -> NewVolume {
    NewVolume {
        name: name.into(),
        required_bytes: 0,
        limit_bytes: 0,
        capabilities: vec![cap()],
        parameters: parameters
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        source: None,
        requisite: vec![],
        secrets: secrets(),
        mutable: BTreeMap::new(),
    }
}

fn secrets() -> Secrets {
    Secrets::new(BTreeMap::from([(
        "key".to_string(),
        "value-never-shown".to_string(),
    )]))
}
