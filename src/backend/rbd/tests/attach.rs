//! Fencing and grants: publish, detach, fenced stages, client addresses, grants read back.

use super::*;
use crate::plugin::{AccessType, VolumeCapability};

fn attach(node: &str, mode: AccessMode) -> ControllerAttach {
    ControllerAttach {
        node_id: node.into(),
        capability: VolumeCapability {
            access: AccessType::Block,
            mode,
        },
        readonly: false,
        volume_context: BTreeMap::new(),
        secrets: secrets(),
    }
}

#[tokio::test]
async fn publish_fences_single_node_volumes() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    // A node whose id does not say it maps rbd images does not exist for
    // this backend: NOT_FOUND before the cluster is asked anything.
    for stranger in ["node-b", "node-b/iqn.2026-01.io.x:y", "some-fake-node-id"] {
        let e = b
            .controller_attach(&id, &attach(stranger, AccessMode::SingleNodeWriter))
            .await
            .unwrap_err();
        assert_eq!(e.kind, Kind::NotFound, "{stranger}: {e}");
    }
    assert!(ops(&r).is_empty());
    let held =
        r#"{"ferrovol.name":"a","ferrovol.node.node-a":"single;single_node_writer/block/rw"}"#;
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(held.into()));
    let e = b
        .controller_attach(&id, &attach("node-b/rbd", AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert!(e.message.contains("node-a"), "{e}");
    // The holder again, on the same terms: idempotent (the key set again).
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(held.into()))
        .ok("rbd");
    b.controller_attach(
        &id,
        &attach(
            "node-a/iqn.2026-01.io.x:y,rbd",
            AccessMode::SingleNodeWriter,
        ),
    )
    .await
    .unwrap();
    assert_eq!(
        ops(&r).last().unwrap(),
        "image-meta set rbd/fv-a ferrovol.node.node-a single;single_node_writer/block/rw"
    );
    // The holder on other terms (read-only now): ALREADY_EXISTS, the mark
    // left as it was.
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(held.into()));
    let mut ro = attach("node-a/rbd", AccessMode::SingleNodeWriter);
    ro.readonly = true;
    let e = b.controller_attach(&id, &ro).await.unwrap_err();
    assert_eq!(e.kind, Kind::AlreadyExists, "{e}");
    assert!(!ops(&r).last().unwrap().contains("set"));
    // A mark from before terms were kept (a bare `single`) is taken as
    // compatible.
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect(
            "rbd",
            Reply::Ok(r#"{"ferrovol.node.node-a":"single"}"#.into()),
        )
        .ok("rbd");
    b.controller_attach(&id, &ro).await.unwrap();
    // Multi-node block: several holders, all multi.
    let multi =
        r#"{"ferrovol.name":"a","ferrovol.node.node-a":"multi;multi_node_multi_writer/block/rw"}"#;
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(multi.into()))
        .ok("rbd");
    b.controller_attach(&id, &attach("node-b/rbd", AccessMode::MultiNodeMultiWriter))
        .await
        .unwrap();
    // Read-only on many nodes: readers share with readers only.
    let readers = r#"{"ferrovol.node.node-a":"readers;multi_node_reader_only/block/ro"}"#;
    let mut ro_many = attach("node-b/rbd", AccessMode::MultiNodeReaderOnly);
    ro_many.readonly = true;
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(readers.into()))
        .ok("rbd");
    b.controller_attach(&id, &ro_many).await.unwrap();
    assert!(ops(&r)
        .last()
        .unwrap()
        .contains("ferrovol.node.node-b readers;"));
    for (held, wanted) in [
        (
            readers,
            attach("node-b/rbd", AccessMode::MultiNodeMultiWriter),
        ),
        (multi, ro_many.clone()),
        (held, ro_many.clone()),
    ] {
        r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
            .expect("rbd", Reply::Ok(held.into()));
        let e = b.controller_attach(&id, &wanted).await.unwrap_err();
        assert_eq!(e.kind, Kind::FailedPrecondition, "{held}: {e}");
        assert!(e.message.contains("node-a"), "{e}");
    }
    // Unpublish removes only that node's key; unknown volume is fine.
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(r#"{"ferrovol.name":"a","ferrovol.node.node-a":"multi","ferrovol.node.node-b":"multi"}"#.into()))
        .ok("rbd");
    b.controller_detach(&id, Some("node-b/rbd"), &secrets())
        .await
        .unwrap();
    assert_eq!(
        ops(&r).last().unwrap(),
        "image-meta remove rbd/fv-a ferrovol.node.node-b"
    );
    r.expect("rbd", Reply::Fail(2, NO_IMAGE.into()));
    b.controller_detach(&id, Some("node-b"), &secrets())
        .await
        .unwrap();
    // Filesystems on one image are never multi-node.
    let fs = VolumeCapability {
        access: AccessType::Mount {
            fs_type: "ext4".into(),
            mount_flags: vec![],
        },
        mode: AccessMode::MultiNodeMultiWriter,
    };
    assert_eq!(
        (&b as &dyn Backend)
            .supports(&fs)
            .unwrap_err()
            .at_controller()
            .kind,
        Kind::InvalidArgument
    );
}

/// A detach that finds a node's client record (the node never unstaged:
/// lost, frozen) blocklists that client before the node's mark goes; a
/// node that unstaged left no record, and nothing is blocklisted.
#[tokio::test]
async fn detach_fences_a_client_still_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    let held = r#"{"ferrovol.name":"a","ferrovol.node.node-a":"single","ferrovol.client.node-a":"10.0.0.2:0/3459289423"}"#;
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(held.into()))
        .ok("ceph")
        .ok("rbd")
        .ok("rbd");
    b.controller_detach(&id, Some("node-a/rbd"), &secrets())
        .await
        .unwrap();
    let o = ops(&r);
    let n = o.len();
    assert!(
        o[n - 3].ends_with("--connect-timeout 20 osd blocklist add 10.0.0.2:0/3459289423 3600"),
        "{o:?}"
    );
    assert_eq!(
        o[n - 2..],
        [
            "image-meta remove rbd/fv-a ferrovol.client.node-a",
            "image-meta remove rbd/fv-a ferrovol.node.node-a"
        ]
    );
    // Unstaged there: no record, no blocklist.
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect(
            "rbd",
            Reply::Ok(r#"{"ferrovol.name":"a","ferrovol.node.node-a":"single"}"#.into()),
        )
        .ok("rbd");
    b.controller_detach(&id, Some("node-a/rbd"), &secrets())
        .await
        .unwrap();
    assert!(r.lines().iter().filter(|l| l.contains("blocklist")).count() == 1);
    // A record that is not a client address is never put on a command line.
    let bad = r#"{"ferrovol.name":"a","ferrovol.client.node-a":"10.0.0.2:0/1 --yes"}"#;
    r.expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect("rbd", Reply::Ok(bad.into()));
    let e = b
        .controller_detach(&id, Some("node-a/rbd"), &secrets())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::Internal, "{e}");
    assert!(r.lines().iter().filter(|l| l.contains("blocklist")).count() == 1);
}

/// A node whose recorded client left the image while it was staged there
/// (a detach fenced it) reports the volume abnormal, naming the client.
#[tokio::test]
async fn a_fenced_stage_is_abnormal() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    let b = backend(r.clone(), dir.path(), false);
    let id = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    let dev0 = dir.path().join("sys/bus/rbd/devices/0");
    std::fs::create_dir_all(&dev0).unwrap();
    std::fs::write(dev0.join("client_addr"), "10.0.0.2:0/77\n").unwrap();
    let recorded = r#"{"ferrovol.node.node-a":"single","ferrovol.client.node-a":"10.0.0.2:0/77"}"#;
    // Found mapped, its client recorded already: nothing written.
    mapped(dir.path());
    r.expect("rbd", Reply::Ok(recorded.into()));
    let a = b.node_attach(&id, &stage_ctx("node-a")).await.unwrap();
    assert!(!ops(&r).iter().any(|l| l.contains("image-meta set")));
    r.expect("rbd", Reply::Ok(recorded.into()));
    assert_eq!(b.node_health(&id, &a).await.unwrap(), vec![]);
    r.expect("rbd", Reply::Ok(r#"{"ferrovol.name":"a"}"#.into()));
    let c = b.node_health(&id, &a).await.unwrap().remove(0);
    assert!(
        c.message.contains("fenced") && c.message.contains("10.0.0.2:0/77"),
        "{c:?}"
    );
    assert_eq!(c.reason, reasons::ClientFenced);
}

#[test]
fn client_addresses_are_checked() {
    for ok in [
        "10.0.0.2:0/3459289423",
        "[fd00::2]:0/17",
        "127.0.0.1:6789/0",
    ] {
        cluster::check_client_addr(ok).unwrap();
    }
    for bad in [
        "",
        "10.0.0.2:0",
        "10.0.0.2/1",
        "10.0.0.2:0/x",
        "a b:0/1",
        "10.0.0.2:0/1;x",
    ] {
        assert!(cluster::check_client_addr(bad).is_err(), "{bad}");
    }
}

#[test]
fn a_full_pool_is_told_by_its_flags() {
    let ls = r#"[
        {"pool_name":"rbd","pool_id":2,"flags_names":"hashpspool,full_quota,full,selfmanaged_snaps"},
        {"pool_name":"osd-full","pool_id":3,"flags_names":"hashpspool,full"},
        {"pool_name":"near","pool_id":4,"flags_names":"hashpspool,nearfull,backfillfull"},
        {"pool_name":"bare","pool_id":5}]"#;
    assert_eq!(
        cluster::pool_full(ls, "rbd").as_deref(),
        Some("full_quota,full")
    );
    assert_eq!(cluster::pool_full(ls, "osd-full").as_deref(), Some("full"));
    assert_eq!(cluster::pool_full(ls, "near"), None);
    assert_eq!(cluster::pool_full(ls, "bare"), None);
    assert_eq!(cluster::pool_full(ls, "gone"), None);
    assert_eq!(cluster::pool_full("nonsense", "rbd"), None);
}

#[test]
fn capacity_is_what_the_pool_can_still_take() {
    let df = r#"{"stats":{},"pools":[
        {"name":"other","id":1,"stats":{"max_avail":1,"stored":0,"quota_bytes":0}},
        {"name":"rbd","id":2,"stats":{"max_avail":10000,"stored":300,"quota_bytes":0}},
        {"name":"capped","id":3,"stats":{"max_avail":10000,"stored":300,"quota_bytes":1000}}]}"#;
    assert_eq!(cluster::pool_available(df, "rbd").unwrap(), 10000);
    assert_eq!(cluster::pool_available(df, "capped").unwrap(), 700);
    assert_eq!(
        cluster::pool_available(df, "gone").unwrap_err().kind,
        Kind::NotFound
    );
    assert_eq!(
        cluster::pool_available("nonsense", "rbd").unwrap_err().kind,
        Kind::Internal
    );
}

/// A controller with a user of its own reads back what each image's
/// metadata says it is published to (a controller in a new pod counts its
/// predecessor's grants); one without asks the cluster nothing.
#[tokio::test]
async fn grants_are_read_back_from_the_images_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    assert_eq!(
        backend(r.clone(), dir.path(), false)
            .grants()
            .await
            .unwrap(),
        None
    );
    assert!(ops(&r).is_empty());
    let b = backend(r.clone(), dir.path(), true);
    r.expect("rbd", Reply::Ok("[]".into())) // namespaces of rbd
        .expect("rbd", Reply::Ok("[]".into())) // namespaces of fast
        .expect("rbd", Reply::Ok(r#"["fv-b","other","fv-a"]"#.into()))
        .expect("rbd", Reply::Ok("[]".into()))
        .expect("rbd", Reply::Ok(info("fv-a", MIB)))
        .expect(
            "rbd",
            Reply::Ok(
                r#"{"ferrovol.name":"a","ferrovol.node.node-a":"multi","ferrovol.node.node-b":"multi"}"#
                    .into(),
            ),
        )
        .expect("rbd", Reply::Ok(info("fv-b", MIB)))
        .expect("rbd", Reply::Ok(r#"{"ferrovol.name":"b"}"#.into()));
    let grants = b.grants().await.unwrap().unwrap();
    let a = VolumeId::parse("rbd:v1.c1.rbd._e.fv-a").unwrap();
    assert_eq!(
        grants,
        [(a.clone(), "node-a".to_string()), (a, "node-b".to_string())]
    );
}

/// The storage as a node sees it: the cluster asked with the config's own
/// user; a node without one asks nothing.
#[tokio::test]
async fn storage_health_asks_the_cluster_with_the_node_s_own_user() {
    use crate::plugin::health::StorageStatus;
    let dir = tempfile::tempdir().unwrap();
    let r = Arc::new(FakeRunner::new());
    assert_eq!(
        backend(r.clone(), dir.path(), false)
            .storage_findings()
            .await,
        vec![]
    );
    assert!(r.lines().is_empty());
    let b = backend(r.clone(), dir.path(), true);
    let df = r#"{"stats":{},"pools":[{"name":"rbd","id":2,"stats":{"max_avail":10000,"stored":300,"quota_bytes":0}}]}"#;
    r.expect("ceph", Reply::Ok(df.into()));
    assert_eq!(b.storage_findings().await, vec![]);
    r.expect("ceph", Reply::Timeout);
    let f = b.storage_findings().await;
    assert_eq!(
        (f[0].status, f[0].reason),
        (StorageStatus::Unreachable, reasons::ClusterNotAnswering),
        "{f:?}"
    );
    assert!(f[0].message.starts_with("cluster c1:"), "{f:?}");
}
