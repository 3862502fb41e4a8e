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
        tracing::info!(op, ?secrets, %secrets, "backend called");
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
        let locator = super::super::locator_for_name(&req.name);
        self.add(&locator);
        Ok(self.volumes.lock().unwrap()[&locator].clone())
    }

    async fn delete_volume(&self, id: &VolumeId, secrets: &Secrets) -> Result<()> {
        self.saw("delete_volume", secrets);
        self.volumes.lock().unwrap().remove(id.locator());
        Ok(())
    }

    async fn get_volume(&self, id: &VolumeId, _secrets: &Secrets) -> Result<Option<VolumeInfo>> {
        Ok(self.volumes.lock().unwrap().get(id.locator()).cloned())
    }

    async fn list_volumes(&self, page: &Page) -> Result<Vec<VolumeInfo>> {
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

#[tokio::test]
async fn secrets_reach_the_backend_for_every_rpc_that_carries_them() {
    // Everything logged during the test, at every level.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let _logging = tracing::subscriber::set_default(subscriber);

    let b = Arc::new(Memory::new("net", remote_attach()));
    let c = ops(vec![b.clone()]);
    let v = c
        .create_volume(new_volume("pvc-1", &[]))
        .await
        .unwrap()
        .volume;
    c.expand(&v.id, 10, 0, None, &secrets()).await.unwrap();
    c.publish(
        &v.id,
        ControllerAttach {
            node_id: "node-b".into(),
            capability: cap(),
            readonly: false,
            volume_context: BTreeMap::new(),
            secrets: secrets(),
        },
        None,
    )
    .await
    .unwrap();
    c.unpublish(&v.id.to_string(), Some("node-b"), &secrets())
        .await
        .unwrap();
    let s = c
        .create_snapshot(NewSnapshot {
            source: v.id.clone(),
            name: "snap-1".into(),
            parameters: BTreeMap::new(),
            secrets: secrets(),
        })
        .await
        .unwrap();
    c.delete_snapshot(&s.id.to_string(), &secrets())
        .await
        .unwrap();
    c.delete_volume(&v.id.to_string(), &secrets())
        .await
        .unwrap();
    let seen = b.secrets_seen.lock().unwrap().clone();
    let ops: Vec<&str> = seen.iter().map(|(op, _)| *op).collect();
    assert_eq!(
        ops,
        [
            "create_volume",
            "expand_volume",
            "controller_attach",
            "controller_detach",
            "create_snapshot",
            "delete_snapshot",
            "delete_volume"
        ]
    );
    for (op, s) in &seen {
        assert_eq!(s.get("key"), Some("value-never-shown"), "{op}");
        assert!(!format!("{s:?} {s}").contains("never-shown"), "{op}");
    }
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert_eq!(log.matches("backend called").count(), 7, "{log}");
    assert!(
        !log.contains("never-shown"),
        "a secret reached the log:\n{log}"
    );
}

#[tokio::test]
async fn snapshot_parameters_keep_the_cos_keys_out_and_pass_them_as_metadata() {
    let b = Arc::new(Memory::new("file", local()));
    let c = ops(vec![b.clone()]);
    let v = c
        .create_volume(new_volume(
            "pvc-1",
            &[("csi.storage.k8s.io/pvc/name", "data")],
        ))
        .await
        .unwrap()
        .volume;
    let co_keys = BTreeMap::from([
        (
            "csi.storage.k8s.io/volumesnapshot/name".to_string(),
            "snap".to_string(),
        ),
        (
            "csi.storage.k8s.io/volumesnapshot/namespace".to_string(),
            "default".to_string(),
        ),
        (
            "csi.storage.k8s.io/volumesnapshotcontent/name".to_string(),
            "snapcontent-1".to_string(),
        ),
    ]);
    let new_snapshot = |parameters: BTreeMap<String, String>| NewSnapshot {
        source: v.id.clone(),
        name: "snap-1".into(),
        parameters,
        secrets: Secrets::default(),
    };
    c.create_snapshot(new_snapshot(co_keys.clone()))
        .await
        .unwrap();
    let metadata = b.metadata_seen.lock().unwrap().clone();
    assert_eq!(
        metadata[0]
            .get("csi.storage.k8s.io/pvc/name")
            .map(String::as_str),
        Some("data")
    );
    assert_eq!(metadata[1], co_keys);
    let mut own = co_keys;
    own.insert("speed".into(), "fast".into());
    let err = c.create_snapshot(new_snapshot(own)).await.unwrap_err();
    assert_eq!(err.kind, Kind::InvalidArgument);
    assert!(err.message.contains("speed"), "{}", err.message);
}

#[tokio::test]
async fn one_guard_covers_the_name_the_id_and_the_source() {
    let entered = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let mut m = Memory::new("file", local());
    m.hold = Some((entered.clone(), release.clone()));
    let b = Arc::new(m);
    b.add("origin");
    let c = Arc::new(ops(vec![b.clone()]));
    let origin = VolumeId::new("file", "origin").unwrap();
    let mut clone = new_volume("pvc-clone", &[]);
    clone.source = Some(ContentSource::Volume(origin.clone()));
    let c2 = c.clone();
    let creating = tokio::spawn(async move { c2.create_volume(clone).await });
    entered.notified().await;

    // While the clone is being made: its id, its name and its source are
    // guarded, each as it should be.
    let aborted = |r: Result<()>| assert_eq!(r.unwrap_err().kind, Kind::Aborted);
    aborted(c.delete_volume("file:pvc-clone", &Secrets::default()).await);
    aborted(c.delete_volume("file:origin", &Secrets::default()).await);
    aborted(
        c.expand(&origin, 5, 0, None, &Secrets::default())
            .await
            .map(|_| ()),
    );
    assert_eq!(
        c.create_volume(new_volume("pvc-clone", &[]))
            .await
            .unwrap_err()
            .kind,
        Kind::Aborted
    );
    // The source is shared: a snapshot of it goes ahead meanwhile.
    c.create_snapshot(NewSnapshot {
        source: origin.clone(),
        name: "snap".into(),
        parameters: BTreeMap::new(),
        secrets: Secrets::default(),
    })
    .await
    .unwrap();

    release.notify_one();
    creating.await.unwrap().unwrap();
    c.delete_volume("file:origin", &Secrets::default())
        .await
        .unwrap();
    assert_eq!(c.locks.held(), 0);
}

#[tokio::test]
async fn a_walk_reads_each_volume_once_across_backends() {
    let a = Arc::new(Memory::new("alpha", local()).with_volumes(25));
    let b = Arc::new(Memory::new("beta", remote_attach()).with_volumes(12));
    let c = ops(vec![a.clone(), b.clone()]);
    let mut token = String::new();
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let page = c.list_volumes(10, &token).await.unwrap();
        assert!(page.entries.len() <= 10);
        pages += 1;
        for p in &page.entries {
            // Node-local volumes carry this node's topology, others none.
            assert_eq!(p.topology.is_some(), p.volume.id.backend() == "alpha");
        }
        seen.extend(page.entries.into_iter().map(|p| p.volume.id.to_string()));
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(pages, 4);
    assert_eq!(seen.len(), 37);
    let mut sorted = seen.clone();
    sorted.dedup();
    assert_eq!(sorted, seen, "no volume twice");
    // Each page read at most one volume more than it returned: the cost of
    // a walk is the cost of its volumes, not pages times the pool.
    let read = *a.returned.lock().unwrap() + *b.returned.lock().unwrap();
    assert!(read <= 37 + pages, "read {read} volumes for a walk of 37");
    assert!(a.pages.lock().unwrap().iter().all(|p| p.limit <= 11));
}

#[tokio::test]
async fn a_cursor_survives_deletes_and_sees_new_volumes() {
    let a = Arc::new(Memory::new("file", local()).with_volumes(6));
    let c = ops(vec![a.clone()]);
    let first = c.list_volumes(3, "").await.unwrap();
    assert_eq!(first.next_token, "file:v0002");
    // The last entry of the page goes, and new volumes come.
    c.delete_volume("file:v0002", &Secrets::default())
        .await
        .unwrap();
    a.add("v0001a");
    a.add("w-new");
    let rest = c.list_volumes(0, &first.next_token).await.unwrap();
    let ids: Vec<String> = rest
        .entries
        .iter()
        .map(|p| p.volume.id.to_string())
        .collect();
    assert_eq!(
        ids,
        ["file:v0003", "file:v0004", "file:v0005", "file:w-new"]
    );
    assert!(rest.next_token.is_empty());
    for bad in ["garbage", "Nope:x", "file:", &"x".repeat(300)] {
        assert_eq!(
            c.list_volumes(1, bad).await.unwrap_err().kind,
            Kind::Aborted,
            "{bad}"
        );
    }
    assert_eq!(
        c.list_volumes(-1, "").await.unwrap_err().kind,
        Kind::InvalidArgument
    );
}

#[tokio::test]
async fn publish_answers_for_backends_that_do_not_attach() {
    let local_backend = Arc::new(Memory::new("file", local()));
    let remote = Arc::new(Memory::new("net", remote_attach()));
    let c = ops(vec![local_backend.clone(), remote.clone()]);
    let v = c
        .create_volume(new_volume("pvc-1", &[("backend", "file")]))
        .await
        .unwrap()
        .volume;
    let attach = |node: &str| ControllerAttach {
        node_id: node.into(),
        capability: cap(),
        readonly: false,
        volume_context: BTreeMap::new(),
        secrets: Secrets::default(),
    };
    // Reachable as it is on its own node: an empty context, twice.
    for _ in 0..2 {
        assert!(c
            .publish(&v.id, attach("node-a"), None)
            .await
            .unwrap()
            .is_empty());
    }
    // A read-only publish says so to the node, in the context.
    let ro = ControllerAttach {
        readonly: true,
        ..attach("node-a")
    };
    assert_eq!(
        c.publish(&v.id, ro, None).await.unwrap(),
        BTreeMap::from([(super::super::CTX_READONLY.to_string(), "true".to_string())])
    );
    // Another node cannot reach a node-local volume; unknown volumes are NOT_FOUND.
    assert_eq!(
        c.publish(&v.id, attach("node-b"), None)
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
    let missing = VolumeId::new("file", "nope").unwrap();
    assert_eq!(
        c.publish(&missing, attach("node-a"), None)
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
    // Unpublish is idempotent, for unknown volumes and nodes too.
    for (id, node) in [
        ("file:pvc-1", Some("node-a")),
        ("file:nope", None),
        ("zzz:x", Some("n")),
        ("bad id", None),
    ] {
        c.unpublish(id, node, &Secrets::default()).await.unwrap();
    }
    assert!(
        remote.secrets_seen.lock().unwrap().is_empty(),
        "the remote backend was never asked"
    );
}

/// A single-node publish holds the whole volume, so a backend's check for
/// other nodes and its record of this one cannot interleave with a publish
/// to another node: that one is ABORTED (the CO retries and then meets
/// the backend's refusal). Multi-node publishes go side by side.
#[tokio::test]
async fn a_single_node_publish_holds_the_volume() {
    let entered = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let mut m = Memory::new("net", remote_attach());
    m.hold = Some((entered.clone(), release.clone()));
    let b = Arc::new(m);
    b.add("v");
    let c = Arc::new(ops(vec![b.clone()]));
    let id = VolumeId::new("net", "v").unwrap();
    let attach = |node: &str, mode: AccessMode| ControllerAttach {
        node_id: node.into(),
        capability: VolumeCapability { mode, ..cap() },
        readonly: false,
        volume_context: BTreeMap::new(),
        secrets: Secrets::default(),
    };
    for (first, second, overlap) in [
        (
            AccessMode::SingleNodeWriter,
            AccessMode::SingleNodeWriter,
            false,
        ),
        (
            AccessMode::SingleNodeWriter,
            AccessMode::MultiNodeMultiWriter,
            false,
        ),
        (
            AccessMode::MultiNodeMultiWriter,
            AccessMode::SingleNodeWriter,
            false,
        ),
        (
            AccessMode::MultiNodeMultiWriter,
            AccessMode::MultiNodeMultiWriter,
            true,
        ),
    ] {
        let spawn = |node: &str, mode| {
            let (c2, id2, a) = (c.clone(), id.clone(), attach(node, mode));
            tokio::spawn(async move { c2.publish(&id2, a, None).await })
        };
        let held = spawn("node-a", first);
        entered.notified().await;
        let other = spawn("node-b", second);
        if overlap {
            // Both are in the backend at once.
            entered.notified().await;
            release.notify_one();
            release.notify_one();
            other.await.unwrap().unwrap();
        } else {
            let r = tokio::time::timeout(std::time::Duration::from_secs(5), other)
                .await
                .unwrap_or_else(|_| panic!("{first:?} then {second:?}: both in the backend"));
            assert_eq!(
                r.unwrap().unwrap_err().kind,
                Kind::Aborted,
                "{first:?} then {second:?}"
            );
            release.notify_one();
        }
        held.await.unwrap().unwrap();
        assert_eq!(c.locks.held(), 0);
    }
}

#[tokio::test]
async fn topology_is_checked_for_node_local_backends_only() {
    let a = Arc::new(Memory::new("file", local()));
    let b = Arc::new(Memory::new("net", remote_attach()));
    let c = ops(vec![a, b]);
    let elsewhere = HashMap::from([(
        "topology.ferrovol.io/node".to_string(),
        "node-z".to_string(),
    )]);
    let mut req = new_volume("pvc-1", &[("backend", "file")]);
    req.requisite = vec![elsewhere.clone()];
    assert_eq!(
        c.create_volume(req.clone()).await.unwrap_err().kind,
        Kind::ResourceExhausted
    );
    req.requisite.push(c.node_topology());
    assert!(c.create_volume(req).await.unwrap().topology.is_some());
    let mut remote = new_volume("pvc-2", &[("backend", "net")]);
    remote.requisite = vec![elsewhere.clone()];
    assert!(c.create_volume(remote).await.unwrap().topology.is_none());
    let params = BTreeMap::from([("backend".to_string(), "file".to_string())]);
    assert_eq!(
        c.capacity(&params, &[cap()], Some(&elsewhere))
            .await
            .unwrap()
            .available_bytes,
        0
    );
    assert_eq!(
        c.capacity(&params, &[cap()], Some(&c.node_topology()))
            .await
            .unwrap()
            .available_bytes,
        42
    );
}

#[tokio::test]
async fn a_node_holding_its_limit_is_refused_before_the_backend_attaches() {
    let b = Arc::new(Memory::new("net", remote_attach()));
    let dir = tempfile::tempdir().unwrap();
    let c = ops(vec![b.clone()]).with_ledger(super::Ledger::open(dir.path()).unwrap());
    let mut ids = Vec::new();
    for n in 0..4 {
        let v = c
            .create_volume(new_volume(&format!("pvc-{n}"), &[]))
            .await
            .unwrap();
        ids.push(v.volume.id);
    }
    let attach = |node: &str| ControllerAttach {
        node_id: node.into(),
        capability: cap(),
        readonly: false,
        volume_context: BTreeMap::new(),
        secrets: Secrets::default(),
    };
    let attaches = || {
        b.secrets_seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(op, _)| *op == "controller_attach")
            .count()
    };
    // The node's id carries tokens after its name: counted by the name.
    let node_b = "node-b/iqn.2026-11.io.example:b";
    for id in &ids[..2] {
        c.publish(id, attach(node_b), Some(2)).await.unwrap();
    }
    let e = c
        .publish(&ids[2], attach(node_b), Some(2))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::ResourceExhausted);
    assert!(
        e.message.contains("node node-b has 2 volumes"),
        "{}",
        e.message
    );
    assert_eq!(attaches(), 2, "the backend was not asked");
    assert_eq!(c.attached_to(node_b), 2);
    // A volume the node holds is answered again; another node has room.
    c.publish(&ids[0], attach(node_b), Some(2)).await.unwrap();
    c.publish(&ids[2], attach("node-c"), Some(2)).await.unwrap();
    // An unpublish (by the name alone too) frees a place; so does a
    // volume deleted while attached.
    c.unpublish(&ids[0].to_string(), Some("node-b"), &Secrets::default())
        .await
        .unwrap();
    c.publish(&ids[2], attach(node_b), Some(2)).await.unwrap();
    c.delete_volume(&ids[1].to_string(), &Secrets::default())
        .await
        .unwrap();
    assert_eq!(c.attached_to(node_b), 1);
    c.publish(&ids[3], attach(node_b), Some(2)).await.unwrap();
    assert_eq!(c.attached_to(node_b), 2);
    assert_eq!(c.attached_to("node-c"), 1);
    // No limit: none enforced, still counted.
    c.publish(&ids[0], attach(node_b), None).await.unwrap();
    assert_eq!(c.attached_to(node_b), 3);
}

#[tokio::test]
async fn modify_checks_every_key_before_the_backend_changes_anything() {
    let b = Arc::new(Memory::new("net", remote_attach()));
    let c = ops(vec![b.clone()]);
    let kv = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    // At create: a bad key or value makes nothing; good ones are applied.
    let mut bad = new_volume("pvc-bad", &[]);
    bad.mutable = kv(&[("tier", "gold"), ("colour", "red")]);
    let e = c.create_volume(bad).await.unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    assert!(
        e.message.contains("\"colour\"") && e.message.contains("tier, iops"),
        "{}",
        e.message
    );
    let mut bad = new_volume("pvc-bad", &[]);
    bad.mutable = kv(&[("tier", "bronze")]);
    assert_eq!(
        c.create_volume(bad).await.unwrap_err().kind,
        Kind::InvalidArgument
    );
    assert!(b.volumes.lock().unwrap().is_empty(), "nothing made");
    let mut good = new_volume("pvc-1", &[]);
    good.mutable = kv(&[("tier", "gold")]);
    let v = c.create_volume(good).await.unwrap().volume;
    assert_eq!(
        b.modified.lock().unwrap().clone(),
        vec![(v.id.to_string(), kv(&[("tier", "gold")]))]
    );

    // Modify: every key checked first; the backend sees none of a bad set.
    for changes in [
        kv(&[("tier", "silver"), ("x", "1")]),
        kv(&[("tier", "tin")]),
    ] {
        let e = c
            .modify_volume(&v.id, &changes, &secrets())
            .await
            .unwrap_err();
        assert_eq!(e.kind, Kind::InvalidArgument, "{changes:?}");
    }
    // No key: no change, and the backend is not asked.
    c.modify_volume(&v.id, &kv(&[]), &secrets()).await.unwrap();
    assert_eq!(b.modified.lock().unwrap().len(), 1);
    c.modify_volume(
        &v.id,
        &kv(&[("tier", "silver"), ("iops", "100")]),
        &secrets(),
    )
    .await
    .unwrap();
    assert_eq!(b.modified.lock().unwrap().len(), 2);
    let missing = VolumeId::new("net", "nope").unwrap();
    assert_eq!(
        c.modify_volume(&missing, &kv(&[("tier", "gold")]), &secrets())
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
}

/// A node that records what it was asked to freeze, or refuses.
#[derive(Default)]
struct FakeNode {
    frozen: Mutex<Vec<Vec<VolumeId>>>,
    refuse: Mutex<bool>,
}

#[async_trait::async_trait]
impl super::Quiesce for FakeNode {
    async fn freeze(
        &self,
        volumes: &[VolumeId],
        _staged_ok: bool,
        _block_ok: bool,
        deadline: std::time::Duration,
    ) -> Result<crate::host::freeze::Frozen> {
        if *self.refuse.lock().unwrap() {
            return Err(Error::precondition("staged as a raw block device"));
        }
        self.frozen.lock().unwrap().push(volumes.to_vec());
        let _ = deadline;
        Ok(crate::host::freeze::Frozen::none())
    }
}

#[tokio::test]
async fn a_group_snapshot_is_one_snapshot_per_member_under_one_freeze_or_nothing() {
    use super::NewGroupSnapshot;
    let b = Arc::new(Memory::new("file", local()));
    let nfs = Arc::new(Memory::new("nfs", remote_attach()));
    let node = Arc::new(FakeNode::default());
    let dir = tempfile::tempdir().unwrap();
    let groups = || crate::plugin::GroupStore::open(&dir.path().join("groups")).unwrap();
    let c = ops(vec![b.clone(), nfs.clone()])
        .with_groups(groups(), Some(node.clone() as Arc<dyn super::Quiesce>));
    assert!(c.groups_served());
    let mut ids = Vec::new();
    for name in ["data", "wal", "other"] {
        ids.push(
            c.create_volume(new_volume(name, &[("backend", "file")]))
                .await
                .unwrap()
                .volume
                .id,
        );
    }
    let n = c
        .create_volume(new_volume("share", &[("backend", "nfs")]))
        .await
        .unwrap()
        .volume
        .id;
    let group = |name: &str, sources: &[&VolumeId]| NewGroupSnapshot {
        name: name.into(),
        sources: sources.iter().map(|v| (*v).clone()).collect(),
        parameters: BTreeMap::new(),
        secrets: secrets(),
    };
    let g = c
        .create_group_snapshot(group("g1", &[&ids[0], &ids[1]]))
        .await
        .unwrap();
    assert_eq!(
        node.frozen.lock().unwrap().clone(),
        vec![vec![ids[0].clone(), ids[1].clone()]]
    );
    assert_eq!(g.snapshots.len(), 2);
    assert!(g.ready);
    for (s, source) in g.snapshots.iter().zip(&ids) {
        assert_eq!(&s.source_volume, source);
        assert_eq!(s.group.as_ref(), Some(&g.id));
        // Members are ordinary snapshots that say their group.
        assert_eq!(
            c.get_snapshot(&s.id, &Secrets::default())
                .await
                .unwrap()
                .group
                .as_ref(),
            Some(&g.id)
        );
    }
    let listed = c.list_snapshots("", "", 0, "").await.unwrap().entries;
    assert!(
        listed.iter().all(|s| s.group.as_ref() == Some(&g.id)),
        "{listed:?}"
    );
    // Idempotent by name; another set under the name is ALREADY_EXISTS.
    assert_eq!(
        c.create_group_snapshot(group("g1", &[&ids[0], &ids[1]]))
            .await
            .unwrap(),
        g
    );
    assert_eq!(node.frozen.lock().unwrap().len(), 1, "not cut again");
    let e = c
        .create_group_snapshot(group("g1", &[&ids[0], &ids[2]]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::AlreadyExists);
    // A group spans one backend; a backend that cannot is refused.
    let e = c
        .create_group_snapshot(group("g2", &[&ids[0], &n]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument, "{}", e.message);
    let e = c
        .create_group_snapshot(group("g3", &[&n]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{}", e.message);
    let e = c
        .create_group_snapshot(group("g4", &[&ids[0], &ids[0]]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);

    // A member that fails: the others made go, and no group is left.
    let before = b.snapshots.lock().unwrap().len();
    *b.fail_snapshots_of.lock().unwrap() = Some(ids[2].clone());
    let e = c
        .create_group_snapshot(group("g5", &[&ids[1], &ids[2]]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::ResourceExhausted);
    assert_eq!(b.snapshots.lock().unwrap().len(), before);
    *b.fail_snapshots_of.lock().unwrap() = None;
    // A freeze the node refuses: nothing made.
    *node.refuse.lock().unwrap() = true;
    let e = c
        .create_group_snapshot(group("g6", &[&ids[1], &ids[2]]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert_eq!(b.snapshots.lock().unwrap().len(), before);
    *node.refuse.lock().unwrap() = false;

    // Get and delete check the member list; the group outlives a restart.
    let members: Vec<String> = g.snapshots.iter().map(|s| s.id.to_string()).collect();
    let c = ops(vec![b.clone(), nfs.clone()])
        .with_groups(groups(), Some(node.clone() as Arc<dyn super::Quiesce>));
    assert_eq!(
        c.get_group_snapshot(&g.id.to_string(), &members, &Secrets::default())
            .await
            .unwrap(),
        g
    );
    let wrong = vec![members[0].clone()];
    assert_eq!(
        c.get_group_snapshot(&g.id.to_string(), &wrong, &Secrets::default())
            .await
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
    assert_eq!(
        c.delete_group_snapshot(&g.id.to_string(), &wrong, &secrets())
            .await
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
    c.delete_group_snapshot(&g.id.to_string(), &members, &secrets())
        .await
        .unwrap();
    assert!(b.snapshots.lock().unwrap().is_empty());
    assert_eq!(
        c.get_group_snapshot(&g.id.to_string(), &[], &Secrets::default())
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
    c.delete_group_snapshot(&g.id.to_string(), &[], &secrets())
        .await
        .unwrap();
    c.delete_group_snapshot("not an id", &[], &secrets())
        .await
        .unwrap();
    assert_eq!(
        c.get_group_snapshot("", &[], &Secrets::default())
            .await
            .unwrap_err()
            .kind,
        Kind::InvalidArgument
    );
}

#[tokio::test]
async fn encryption_is_asked_in_the_volume_context_of_block_backends_only() {
    let file = Arc::new(Memory::new("file", local()));
    let net = Arc::new(Memory::new("net", remote_attach()));
    let c = ops(vec![file.clone(), net.clone()]);
    let v = c
        .create_volume(new_volume(
            "pvc-1",
            &[("backend", "file"), ("encrypted", "true")],
        ))
        .await
        .unwrap()
        .volume;
    assert_eq!(
        v.context.get("encrypted").map(String::as_str),
        Some("luks2")
    );
    // The backend never sees the parameter (its own validation would
    // refuse a key it does not know).
    let plain = c
        .create_volume(new_volume(
            "pvc-2",
            &[("backend", "file"), ("encrypted", "false")],
        ))
        .await
        .unwrap()
        .volume;
    assert!(!plain.context.contains_key("encrypted"));
    for (params, what) in [
        (&[("backend", "file"), ("encrypted", "yes")][..], "yes"),
        (
            &[("backend", "net"), ("encrypted", "true")][..],
            "no block devices",
        ),
    ] {
        let e = c
            .create_volume(new_volume("pvc-3", params))
            .await
            .unwrap_err();
        assert_eq!(e.kind, Kind::InvalidArgument, "{e}");
        assert!(e.message.contains(what), "{e}");
    }
}

/// A controller started in a new pod (its ledger's journal empty) counts
/// what its predecessor attached, as the backend keeps it: the node's
/// limit holds across the replacement.
#[tokio::test]
async fn a_controller_in_a_new_pod_counts_the_grants_the_backend_keeps() {
    let b = Arc::new(Memory::new("net", remote_attach()));
    let ids: Vec<VolumeId> = (0..3)
        .map(|n| VolumeId::new("net", &format!("v{n}")).unwrap())
        .collect();
    for id in &ids {
        b.add(id.locator());
    }
    *b.kept_grants.lock().unwrap() = Some(vec![
        (ids[0].clone(), "node-b".to_string()),
        (ids[1].clone(), "node-b".to_string()),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let c = ops(vec![b.clone()]).with_ledger(super::Ledger::open(dir.path()).unwrap());
    assert_eq!(c.attached_to("node-b"), 0);
    assert_eq!(c.settle_ledger().await, 2);
    assert_eq!(c.attached_to("node-b/rbd"), 2);
    let attach = ControllerAttach {
        node_id: "node-b/rbd".into(),
        capability: cap(),
        readonly: false,
        volume_context: BTreeMap::new(),
        secrets: Secrets::default(),
    };
    let e = c
        .publish(&ids[2], attach.clone(), Some(2))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::ResourceExhausted, "{e}");
    c.publish(&ids[0], attach, Some(2)).await.unwrap();
    // Settled again with nothing new: nothing changes.
    assert_eq!(c.settle_ledger().await, 0);
}

/// A volume asked for smaller than its filesystem can be made on (mkfs.xfs
/// refuses under 300 MiB) is made as large as the filesystem needs, and
/// one whose limit leaves no room for it is OUT_OF_RANGE; ext4 and raw
/// block volumes keep their size.
#[tokio::test]
async fn a_volume_too_small_for_its_filesystem_is_made_as_large_as_it_needs() {
    const MIB: u64 = 1 << 20;
    let b = Arc::new(Memory::new("net", remote_attach()));
    let c = ops(vec![b.clone()]);
    let asked = |name: &str, fs: &str, required: u64, limit: u64| {
        let mut v = new_volume(name, &[]);
        v.required_bytes = required;
        v.limit_bytes = limit;
        v.capabilities = vec![VolumeCapability {
            access: AccessType::Mount {
                fs_type: fs.into(),
                mount_flags: vec![],
            },
            mode: AccessMode::SingleNodeWriter,
        }];
        v
    };
    c.create_volume(asked("pvc-xfs", "xfs", 64 * MIB, 0))
        .await
        .unwrap();
    c.create_volume(asked("pvc-ext4", "ext4", 64 * MIB, 0))
        .await
        .unwrap();
    c.create_volume(asked("pvc-big", "xfs", 512 * MIB, 0))
        .await
        .unwrap();
    assert_eq!(
        *b.required_seen.lock().unwrap(),
        [300 * MIB, 64 * MIB, 512 * MIB]
    );
    let e = c
        .create_volume(asked("pvc-tight", "xfs", 64 * MIB, 100 * MIB))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::OutOfRange, "{e}");
    assert!(e.message.contains("least its filesystem takes"), "{e}");
}
