//! Publish: backends that do not attach, single-node holds, topology, node limits, grants a new controller reads.

use super::*;

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
        BTreeMap::from([(crate::plugin::CTX_READONLY.to_string(), "true".to_string())])
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
