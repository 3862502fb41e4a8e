//! The export layer over a protocol of the test's own: an in-memory target
//! server and initiator with words of their own, a server that grows an
//! export under I/O, and the store double. What iscsi's tests check through
//! tgt is checked here without it: the layer depends on no protocol.

use super::initiator::{Connection, Initiator, NodeTerms, Paths};
use super::target::{Credential, Target, Terms};
use super::testing::{attach_block, create, MemStore};
use super::{Exports, Setup};
use crate::error::{Kind, Result};
use crate::exec::FakeRunner;
use crate::plugin::health::{Finding, Reason, StorageStatus};
use crate::plugin::{
    AccessMode, AccessType, AttachContext, Attachment, ControllerAttach, Secrets, VolumeId,
};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const MISSING: Reason = Reason::named("ExportGoneForTest");

static TERMS: Terms = Terms {
    export: "subsystem",
    server: "the test server",
    host: "host",
    connected: "connected from",
    credential: "key",
    missing: MISSING,
    grows_only_unused: None,
};

static NODE_TERMS: NodeTerms = NodeTerms {
    path: "controller",
    paths: "the test's controllers",
    ctx_export: "nqn",
    ctx_unit: "nsid",
    all_down: Reason::HealthCheckFailed,
    some_down: Reason::StagingMountGone,
};

/// One export of the [`MemTarget`].
#[derive(Debug, Clone, Default)]
struct MemExport {
    backing: PathBuf,
    granted: BTreeSet<String>,
    connected: Vec<String>,
    bound: Vec<(String, bool)>,
    refreshed: u32,
}

/// A target server in memory: exports by name, credentials, and every
/// disconnect it was asked for.
#[derive(Default)]
struct MemTarget {
    exports: Mutex<BTreeMap<String, MemExport>>,
    credentials: Mutex<BTreeMap<String, String>>,
    disconnected: Mutex<Vec<(String, String)>>,
    forgotten: Mutex<Vec<String>>,
}

impl MemTarget {
    fn export(&self, name: &str) -> Option<MemExport> {
        self.exports.lock().unwrap().get(name).cloned()
    }

    fn edit<T>(&self, name: &str, f: impl FnOnce(&mut MemExport) -> T) -> Result<T> {
        match self.exports.lock().unwrap().get_mut(name) {
            Some(e) => Ok(f(e)),
            None => Err(crate::error::Error::not_found(format!("no export {name}"))),
        }
    }
}

#[async_trait::async_trait]
impl Target for MemTarget {
    fn terms(&self) -> &'static Terms {
        &TERMS
    }
    async fn serves(&self, name: &str) -> Result<bool> {
        Ok(self.export(name).is_some())
    }
    async fn connected(&self, name: &str) -> Result<Option<Vec<String>>> {
        Ok(self.export(name).map(|e| e.connected))
    }
    async fn reread(&self) {}
    async fn create(&self, name: &str, backing: &Path) -> Result<()> {
        self.exports
            .lock()
            .unwrap()
            .entry(name.to_string())
            .or_insert_with(|| MemExport {
                backing: backing.to_path_buf(),
                ..Default::default()
            });
        Ok(())
    }
    async fn delete(&self, name: &str) -> Result<()> {
        self.exports.lock().unwrap().remove(name);
        Ok(())
    }
    async fn refresh(&self, name: &str, _: &Path) -> Result<()> {
        self.edit(name, |e| e.refreshed += 1)
    }
    async fn grant(&self, name: &str, host: &str) -> Result<()> {
        self.edit(name, |e| e.granted.insert(host.to_string()))
            .map(drop)
    }
    async fn revoke(&self, name: &str, host: &str) -> Result<()> {
        self.edit(name, |e| e.granted.remove(host)).map(drop)
    }
    async fn disconnect(&self, name: &str, host: &str) -> Result<usize> {
        let closed = self.edit(name, |e| {
            let before = e.connected.len();
            e.connected.retain(|h| h != host);
            before - e.connected.len()
        })?;
        self.disconnected
            .lock()
            .unwrap()
            .push((name.to_string(), host.to_string()));
        Ok(closed)
    }
    async fn add_credential(&self, (name, secret): &Credential, _: bool) -> Result<()> {
        self.credentials
            .lock()
            .unwrap()
            .insert(name.clone(), secret.clone());
        Ok(())
    }
    async fn bind(&self, name: &str, user: &str, outgoing: bool) -> Result<()> {
        self.edit(name, |e| {
            if !e.bound.contains(&(user.to_string(), outgoing)) {
                e.bound.push((user.to_string(), outgoing));
            }
        })
    }
    async fn unbind(&self, name: &str, user: &str, outgoing: bool) -> Result<()> {
        self.edit(name, |e| {
            e.bound.retain(|b| b != &(user.to_string(), outgoing))
        })
    }
    async fn forget_host(&self, host: &str) -> Result<bool> {
        self.credentials.lock().unwrap().remove(host);
        self.forgotten.lock().unwrap().push(host.to_string());
        Ok(true)
    }
    async fn set_thin_provisioning(&self, _: &str, _: bool) -> Result<()> {
        Err(crate::error::Error::invalid(
            "the test's protocol has no thin provisioning",
        ))
    }
}

/// A connection asked for: export, portals, unit, the node's credential.
type Asked = (String, Vec<String>, u32, Option<Credential>);

/// An initiator in memory: what it was asked to connect to, and the paths
/// it reports.
#[derive(Default)]
struct MemInitiator {
    attached: Mutex<Vec<Asked>>,
    detached: Mutex<Vec<String>>,
    paths: Mutex<Paths>,
}

#[async_trait::async_trait]
impl Initiator for MemInitiator {
    fn terms(&self) -> &'static NodeTerms {
        &NODE_TERMS
    }
    async fn attach(&self, to: &Connection<'_>) -> Result<PathBuf> {
        self.attached.lock().unwrap().push((
            to.export.to_string(),
            to.portals.iter().map(|p| p.to_string()).collect(),
            to.unit,
            to.incoming.cloned(),
        ));
        Ok("/dev/testdisk1".into())
    }
    async fn detach(&self, export: &str) -> Result<()> {
        self.detached.lock().unwrap().push(export.to_string());
        Ok(())
    }
    async fn release_lost(&self, _: &str) -> Result<()> {
        Ok(())
    }
    async fn rescan(&self, _: &str) -> Result<u64> {
        Ok(0)
    }
    async fn condition(&self, _: &str, _: &Path) -> Result<Option<Finding>> {
        Ok(None)
    }
    async fn paths(&self, prefix: &str) -> Result<Paths> {
        assert_eq!(prefix, "nqn.2026-12.test");
        let p = self.paths.lock().unwrap();
        Ok(Paths {
            down: p.down.clone(),
            up: p.up.clone(),
        })
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    target: Arc<MemTarget>,
    initiator: Arc<MemInitiator>,
    store: Arc<MemStore>,
}

impl Fixture {
    fn new() -> Self {
        Fixture {
            dir: tempfile::tempdir().unwrap(),
            target: Arc::default(),
            initiator: Arc::default(),
            store: Arc::new(MemStore::new("nv")),
        }
    }

    /// The backend's exports, as a (re)started driver has them: secrets
    /// given to an earlier one are not known.
    fn exports(&self) -> Exports {
        let setup = Setup {
            name: "nv".into(),
            export_name: Box::new(|locator| format!("nqn.2026-12.test:{locator}")),
            prefix: "nqn.2026-12.test".into(),
            portals: vec!["10.0.0.5:4420".into(), "10.0.0.6:4420".into()],
            dir: self.dir.path().join("records"),
            held: || {},
        };
        Exports::new(
            setup,
            self.target.clone(),
            self.initiator.clone(),
            Some(self.store.clone()),
            Arc::new(FakeRunner::new()),
        )
        .without_holds()
    }
}

fn attach(node: &str) -> ControllerAttach {
    attach_block(node, &[])
}

const EXPORT: &str = "nqn.2026-12.test:pvc-1";
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:b";

fn key() -> Option<Credential> {
    Some((HOST_A.to_string(), "DHHC-1:00:test-key:".to_string()))
}

#[tokio::test]
async fn exports_are_made_granted_fenced_grown_and_rebuilt_through_any_target() {
    let f = Fixture::new();
    let x = f.exports();
    let info = x.create_volume(&create("pvc-1")).await.unwrap();
    let id = VolumeId::parse("nv:pvc-1").unwrap();
    assert_eq!(info.id, id);
    // The export serves the store's device, granted to nobody yet.
    let made = f.target.export(EXPORT).expect("the export is made");
    assert_eq!(made.backing, PathBuf::from("/dev/loop7"));
    assert!(made.granted.is_empty());

    // Publish: the key bound before the host is granted; the context in
    // the protocol's keys.
    let ctx = x
        .publish(&id, HOST_A, &key(), &None, &attach("node-a"))
        .await
        .unwrap()
        .hosts;
    assert_eq!(ctx, BTreeSet::from([HOST_A.to_string()]));
    let record = x.load(&id).unwrap().unwrap();
    let ctx = x.publish_context(&record);
    assert_eq!(ctx["nqn"], EXPORT);
    assert_eq!(ctx["nsid"], "1");
    assert_eq!(ctx["portals"], "10.0.0.5:4420,10.0.0.6:4420");
    let e = f.target.export(EXPORT).unwrap();
    assert_eq!(e.granted, BTreeSet::from([HOST_A.to_string()]));
    assert_eq!(e.bound, [(HOST_A.to_string(), false)]);
    // Another node is refused in the protocol's words.
    let err = x
        .publish(&id, HOST_B, &None, &None, &attach("node-b"))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition);
    assert!(err.message.contains(&format!("host {HOST_A}")), "{err}");
    // A second key for the same name is refused, the secret unshown.
    let other = Some((HOST_A.to_string(), "DHHC-1:00:other-key:".to_string()));
    let err = x
        .publish(&id, HOST_A, &other, &None, &attach("node-a"))
        .await
        .unwrap_err();
    assert!(err.message.contains("key"), "{err}");
    assert!(!err.message.contains("other-key"), "{err}");

    // In use: not deleted; grown at once (this server grows under I/O).
    f.target
        .edit(EXPORT, |e| e.connected.push(HOST_A.into()))
        .unwrap();
    let err = x.delete_volume(&id, &Secrets::default()).await.unwrap_err();
    assert!(
        err.message.contains(&format!("connected from {HOST_A}")),
        "{err}"
    );
    assert!(x.grows_online());
    let size = x
        .expand_volume(&id, 16 << 20, 0, &Secrets::default())
        .await
        .unwrap();
    assert_eq!(size, 16 << 20);
    assert_eq!(f.target.export(EXPORT).unwrap().refreshed, 1);
    assert_eq!(x.load(&id).unwrap().unwrap().bytes, Some(16 << 20));

    // Lost by the server: health says so in the protocol's words; a
    // reconcile makes it again, the host granted (its key known).
    f.target.exports.lock().unwrap().clear();
    let found = x.volume_health(&id, &Secrets::default()).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].reason, MISSING);
    assert_eq!(
        found[0].message,
        format!("subsystem {EXPORT} is not served by the test server")
    );
    x.reconcile().await.unwrap();
    let e = f.target.export(EXPORT).expect("rebuilt");
    assert_eq!(e.granted, BTreeSet::from([HOST_A.to_string()]));
    assert_eq!(e.bound, [(HOST_A.to_string(), false)]);

    // A restarted driver does not know the key: a rebuilt export stays
    // closed until a publish brings it.
    f.target.exports.lock().unwrap().clear();
    let restarted = f.exports();
    restarted.reconcile().await.unwrap();
    let e = f.target.export(EXPORT).expect("rebuilt");
    assert!(e.granted.is_empty(), "{e:?}");
    let err = restarted
        .publish(&id, HOST_A, &None, &None, &attach("node-a"))
        .await
        .unwrap_err();
    assert!(err.message.contains("published with key"), "{err}");
    restarted
        .publish(&id, HOST_A, &key(), &None, &attach("node-a"))
        .await
        .unwrap();
    assert!(f.target.export(EXPORT).unwrap().granted.contains(HOST_A));

    // Unpublish of a node still connected: revoked, then disconnected.
    f.target
        .edit(EXPORT, |e| e.connected.push(HOST_A.into()))
        .unwrap();
    restarted.unpublish(&id, Some(HOST_A)).await.unwrap();
    let e = f.target.export(EXPORT).unwrap();
    assert!(e.granted.is_empty() && e.connected.is_empty(), "{e:?}");
    assert_eq!(
        *f.target.disconnected.lock().unwrap(),
        [(EXPORT.to_string(), HOST_A.to_string())]
    );
    assert!(restarted.load(&id).unwrap().unwrap().hosts.is_empty());

    // Deleted: export, store volume and record.
    restarted
        .delete_volume(&id, &Secrets::default())
        .await
        .unwrap();
    assert!(f.target.export(EXPORT).is_none());
    assert!(restarted.load(&id).unwrap().is_none());
    assert!(f
        .store
        .calls()
        .contains(&"delete nv-store:pvc-1".to_string()));
}

#[tokio::test]
async fn a_node_connects_as_the_context_says_and_reports_paths_in_the_protocol_s_words() {
    let f = Fixture::new();
    let x = f.exports();
    let id = VolumeId::parse("nv:pvc-1").unwrap();
    let mut ctx = AttachContext {
        publish_context: BTreeMap::from([
            ("nqn".to_string(), EXPORT.to_string()),
            ("nsid".to_string(), "1".to_string()),
            (
                "portals".to_string(),
                "10.0.0.5:4420,10.0.0.6:4420".to_string(),
            ),
        ]),
        ..Default::default()
    };
    let attached = x
        .node_attach(&id, &ctx, key().as_ref(), None, &BTreeMap::new())
        .await
        .unwrap();
    assert_eq!(
        attached,
        Attachment::Device {
            path: "/dev/testdisk1".into()
        }
    );
    assert_eq!(
        *f.initiator.attached.lock().unwrap(),
        [(
            EXPORT.to_string(),
            vec!["10.0.0.5:4420".to_string(), "10.0.0.6:4420".to_string()],
            1,
            key()
        )]
    );
    // Another volume's export, a portal that is not host:port, no unit.
    let wrong = [
        ("nqn", "nqn.2026-12.test:pvc-2"),
        ("portals", "10.0.0.5"),
        ("nsid", "one"),
    ];
    for (k, v) in wrong {
        let mut bad = ctx.clone();
        bad.publish_context.insert(k.into(), v.into());
        let err = x
            .node_attach(&id, &bad, None, None, &BTreeMap::new())
            .await
            .unwrap_err();
        assert_eq!(err.kind, Kind::InvalidArgument, "{k}: {err}");
    }
    ctx.publish_context.remove("nqn");
    let err = x
        .node_attach(&id, &ctx, None, None, &BTreeMap::new())
        .await
        .unwrap_err();
    assert!(err.message.contains("no nqn"), "{err}");
    x.node_detach(&id).await.unwrap();
    assert_eq!(*f.initiator.detached.lock().unwrap(), [EXPORT]);

    // Paths: none down is nothing; some down is degraded, all unreachable.
    assert!(x.path_findings().await.is_empty());
    *f.initiator.paths.lock().unwrap() = Paths {
        down: vec!["10.0.0.6:4420".into()],
        up: BTreeSet::from(["10.0.0.5:4420".to_string()]),
    };
    let found = x.path_findings().await;
    assert_eq!(found[0].status, StorageStatus::Degraded);
    assert_eq!(found[0].reason, NODE_TERMS.some_down);
    assert_eq!(
        found[0].message,
        "1 controller(s) through 10.0.0.6:4420 down; 10.0.0.5:4420 still up"
    );
    f.initiator.paths.lock().unwrap().up.clear();
    let found = x.path_findings().await;
    assert_eq!(found[0].status, StorageStatus::Unreachable);
    assert_eq!(found[0].reason, NODE_TERMS.all_down);
}

/// A publish in a mode of `mode`, on raw block or a filesystem, and
/// read-only or not.
fn attach_as(node: &str, mode: AccessMode, block: bool, readonly: bool) -> ControllerAttach {
    let mut req = attach(node);
    req.capability.mode = mode;
    req.readonly = readonly;
    if !block {
        req.capability.access = AccessType::Mount {
            fs_type: "ext4".into(),
            mount_flags: vec![],
        };
    }
    req
}

/// Nodes share a volume only in one many-node mode: two writers of a raw
/// block volume are both granted, and one's unpublish fences it alone; a
/// single-node publish, another many-node mode, or a record from before
/// terms were kept keeps a second node out, naming the first.
#[tokio::test]
async fn nodes_share_a_volume_only_when_every_publish_is_in_one_many_node_mode() {
    let f = Fixture::new();
    let x = f.exports();
    x.create_volume(&create("pvc-1")).await.unwrap();
    let id = VolumeId::parse("nv:pvc-1").unwrap();
    let mnmw = AccessMode::MultiNodeMultiWriter;
    x.publish(
        &id,
        HOST_A,
        &None,
        &None,
        &attach_as("node-a", mnmw, true, false),
    )
    .await
    .unwrap();
    let record = x
        .publish(
            &id,
            HOST_B,
            &None,
            &None,
            &attach_as("node-b", mnmw, true, false),
        )
        .await
        .unwrap();
    let both = BTreeSet::from([HOST_A.to_string(), HOST_B.to_string()]);
    assert_eq!(record.hosts, both);
    assert_eq!(f.target.export(EXPORT).unwrap().granted, both);

    // Refused while two writers hold it: a single-node publish, and the
    // read-only many-node mode.
    const HOST_C: &str = "nqn.2014-08.org.nvmexpress:uuid:c";
    for (mode, readonly) in [
        (AccessMode::SingleNodeWriter, false),
        (AccessMode::MultiNodeReaderOnly, true),
    ] {
        let err = x
            .publish(
                &id,
                HOST_C,
                &None,
                &None,
                &attach_as("node-c", mode, true, readonly),
            )
            .await
            .unwrap_err();
        assert_eq!(err.kind, Kind::FailedPrecondition, "{mode:?}: {err}");
        assert!(err.message.contains(&format!("host {HOST_A}")), "{err}");
        assert!(
            err.message.contains("multi_node_multi_writer/block/rw"),
            "{err}"
        );
    }
    assert_eq!(f.target.export(EXPORT).unwrap().granted, both);

    // One writer let go: it alone is fenced; the other stays granted.
    f.target
        .edit(EXPORT, |e| {
            e.connected.extend([HOST_A.into(), HOST_B.into()])
        })
        .unwrap();
    x.unpublish(&id, Some(HOST_A)).await.unwrap();
    let e = f.target.export(EXPORT).unwrap();
    assert_eq!(e.granted, BTreeSet::from([HOST_B.to_string()]));
    assert_eq!(e.connected, [HOST_B.to_string()]);
    x.unpublish(&id, Some(HOST_B)).await.unwrap();

    // Read-only on both filesystems' nodes.
    let mnro = AccessMode::MultiNodeReaderOnly;
    for (host, node) in [(HOST_A, "node-a"), (HOST_B, "node-b")] {
        x.publish(&id, host, &None, &None, &attach_as(node, mnro, false, true))
            .await
            .unwrap();
    }
    assert_eq!(f.target.export(EXPORT).unwrap().granted, both);
    x.unpublish(&id, None).await.unwrap();
    assert!(f.target.export(EXPORT).unwrap().granted.is_empty());

    // Single-node first: a many-node publish elsewhere is refused too; so
    // is one beside a record from before terms were kept (its host is
    // single-node).
    x.publish(&id, HOST_A, &None, &None, &attach("node-a"))
        .await
        .unwrap();
    let b_shares = attach_as("node-b", mnmw, true, false);
    let err = x
        .publish(&id, HOST_B, &None, &None, &b_shares)
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition, "{err}");
    assert!(err.message.contains("single_node_writer/block/rw"), "{err}");
    let mut old = x.load(&id).unwrap().unwrap();
    old.terms.clear();
    x.save(&id, &old).unwrap();
    let err = x
        .publish(&id, HOST_B, &None, &None, &b_shares)
        .await
        .unwrap_err();
    assert!(err.message.contains("as single-node"), "{err}");
}

/// A host is forgotten by the server (its key with it) once no volume of
/// the backend is published to it: not at the first of its two volumes'
/// unpublish, but at the second, and at the delete of a volume still
/// published to it; a forgotten host's next publish may bring a new key.
#[tokio::test]
async fn a_host_is_forgotten_with_its_key_once_no_volume_is_published_to_it() {
    let f = Fixture::new();
    let x = f.exports();
    for name in ["pvc-1", "pvc-2"] {
        x.create_volume(&create(name)).await.unwrap();
    }
    let (one, two) = (
        VolumeId::parse("nv:pvc-1").unwrap(),
        VolumeId::parse("nv:pvc-2").unwrap(),
    );
    for id in [&one, &two] {
        x.publish(id, HOST_A, &key(), &None, &attach("node-a"))
            .await
            .unwrap();
    }
    x.unpublish(&one, Some(HOST_A)).await.unwrap();
    assert!(f.target.forgotten.lock().unwrap().is_empty());
    assert!(f.target.credentials.lock().unwrap().contains_key(HOST_A));
    x.unpublish(&two, Some(HOST_A)).await.unwrap();
    assert_eq!(*f.target.forgotten.lock().unwrap(), [HOST_A.to_string()]);
    assert!(!f.target.credentials.lock().unwrap().contains_key(HOST_A));

    // A new key for the forgotten host is taken (it was refused while the
    // old one was in use: see the first test).
    let rotated = Some((HOST_A.to_string(), "DHHC-1:00:rotated-key:".to_string()));
    x.publish(&one, HOST_A, &rotated, &None, &attach("node-a"))
        .await
        .unwrap();
    assert_eq!(
        f.target.credentials.lock().unwrap()[HOST_A],
        "DHHC-1:00:rotated-key:"
    );
    // Deleted while still published to it (its node gone): forgotten.
    x.delete_volume(&one, &Secrets::default()).await.unwrap();
    assert_eq!(f.target.forgotten.lock().unwrap().len(), 2);
}
