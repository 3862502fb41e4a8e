//! End-to-end tests of the real binary on the `file` backend: real loop
//! devices, real filesystems, real mounts. They need root.

mod common;

use common::*;
use ferrovol::proto as pb;
use tonic::Code;

#[tokio::test]
async fn identity_and_node_info() {
    let h = Harness::start().await;
    let info = h
        .identity()
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "csi.ferrovol.io");
    assert!(info.vendor_version.starts_with(env!("CARGO_PKG_VERSION")));
    let caps = h
        .identity()
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    // CONTROLLER_SERVICE, VOLUME_ACCESSIBILITY_CONSTRAINTS,
    // GROUP_CONTROLLER_SERVICE, SNAPSHOT_METADATA_SERVICE, and online
    // expansion.
    assert_eq!(caps.capabilities.len(), 5, "{caps:?}");
    assert!(
        format!("{caps:?}").contains("GroupControllerService"),
        "{caps:?}"
    );
    let node = h
        .node()
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(node.node_id, "test-node");
    assert_eq!(node.max_volumes_per_node, 256);
    assert_eq!(
        node.accessible_topology.unwrap().segments["topology.ferrovol.io/node"],
        "test-node"
    );
    let ctrl = h
        .controller()
        .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(ctrl.capabilities.len() >= 8);
    // ControllerPublish is not offered by the file backend.
    let r = h
        .controller()
        .controller_publish_volume(pb::ControllerPublishVolumeRequest {
            volume_id: "file:x".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&r), Code::Unimplemented);
}

#[tokio::test]
async fn mount_lifecycle_with_snapshot_clone_and_readonly() {
    let h = Harness::start().await;
    let mut c = h.controller();
    let mut n = h.node();
    let cap = mount_cap("ext4", SNW);

    let vol = h
        .create(create_req("pvc-life", 40 * MIB + 5, cap.clone()))
        .await;
    assert_eq!(vol.volume_id, "file:pvc-life");
    assert_eq!(vol.capacity_bytes, 41 * MIB, "rounded up to 1 MiB");
    assert_eq!(
        vol.accessible_topology[0].segments["topology.ferrovol.io/node"],
        "test-node"
    );
    // Idempotent create; incompatible size is ALREADY_EXISTS.
    let again = h
        .create(create_req("pvc-life", 40 * MIB, cap.clone()))
        .await;
    assert_eq!(again.volume_id, vol.volume_id);
    let r = c
        .create_volume(create_req("pvc-life", 80 * MIB, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::AlreadyExists);

    let staging = h.path("kubelet/staging/life");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    assert_eq!(h.loop_devices().len(), 1);
    let r = n
        .node_stage_volume(stage_req(&vol.volume_id, &staging, mount_cap("xfs", SNW)))
        .await;
    assert_eq!(code(&r), Code::AlreadyExists);

    let target = h.path("kubelet/pods/p1");
    n.node_publish_volume(publish_req(
        &vol.volume_id,
        &staging,
        &target,
        cap.clone(),
        false,
    ))
    .await
    .unwrap();
    n.node_publish_volume(publish_req(
        &vol.volume_id,
        &staging,
        &target,
        cap.clone(),
        false,
    ))
    .await
    .unwrap();
    std::fs::write(target.join("hello.txt"), b"data from pod 1").unwrap();
    // Same target, other arguments: ALREADY_EXISTS. A second target of a
    // SINGLE_NODE_WRITER volume is another pod on the node: served. One
    // that asks to be the only one (SINGLE_NODE_SINGLE_WRITER) is refused.
    let r = n
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &target,
            cap.clone(),
            true,
        ))
        .await;
    assert_eq!(code(&r), Code::AlreadyExists);
    let second = h.path("kubelet/pods/p2");
    n.node_publish_volume(publish_req(
        &vol.volume_id,
        &staging,
        &second,
        cap.clone(),
        false,
    ))
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(second.join("hello.txt")).unwrap(),
        b"data from pod 1"
    );
    n.node_unpublish_volume(unpublish_req(&vol.volume_id, &second))
        .await
        .unwrap();
    let r = n
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &h.path("kubelet/pods/p3"),
            mount_cap("ext4", SNSW),
            false,
        ))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition);

    let stats = n
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: target.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let bytes = &stats.usage[0];
    assert!(
        bytes.total > 30 * MIB && bytes.total <= 41 * MIB,
        "{stats:?}"
    );
    assert!(bytes.used > 0 && bytes.available > 0);
    assert_eq!(stats.usage[1].unit, pb::volume_usage::Unit::Inodes as i32);
    assert!(!stats.volume_condition.unwrap().abnormal);

    // Snapshot (of the live volume) and a volume restored from it.
    std::process::Command::new("sync").status().unwrap();
    let snap = h.snapshot_made("snap-1", &vol.volume_id).await;
    assert!(snap.ready_to_use);
    assert_eq!(snap.size_bytes, 41 * MIB);
    let r = c
        .create_snapshot(pb::CreateSnapshotRequest {
            source_volume_id: "file:other".into(),
            name: "snap-1".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&r), Code::AlreadyExists);
    let listed = c
        .list_snapshots(pb::ListSnapshotsRequest {
            source_volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);

    let mut from_snap = create_req("pvc-restored", 0, cap.clone());
    from_snap.volume_content_source = Some(snapshot_source(&snap.snapshot_id));
    let restored = h.create(from_snap).await;
    assert_eq!(restored.capacity_bytes, 41 * MIB);
    assert!(restored.content_source.is_some());

    // Restored volume published read-only shows the data and refuses writes.
    let staging2 = h.path("kubelet/staging/restored");
    std::fs::create_dir_all(&staging2).unwrap();
    n.node_stage_volume(stage_req(&restored.volume_id, &staging2, cap.clone()))
        .await
        .unwrap();
    let target2 = h.path("kubelet/pods/p3");
    n.node_publish_volume(publish_req(
        &restored.volume_id,
        &staging2,
        &target2,
        cap.clone(),
        true,
    ))
    .await
    .unwrap();
    assert_eq!(
        std::fs::read(target2.join("hello.txt")).unwrap(),
        b"data from pod 1"
    );
    assert!(
        std::fs::write(target2.join("new.txt"), b"x").is_err(),
        "read-only publish accepted a write"
    );

    // Clone of the original.
    let mut clone = create_req("pvc-clone", 64 * MIB, cap.clone());
    clone.volume_content_source = Some(volume_source(&vol.volume_id));
    let cloned = h.create(clone).await;
    assert_eq!(cloned.capacity_bytes, 64 * MIB);

    // Deleting a staged volume is refused; tear everything down in order.
    let r = c
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition);
    let r = n
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await;
    assert_eq!(
        code(&r),
        Code::FailedPrecondition,
        "unstage while published"
    );
    for (id, t) in [(&vol.volume_id, &target), (&restored.volume_id, &target2)] {
        let req = unpublish_req(id, t);
        n.node_unpublish_volume(req.clone()).await.unwrap();
        n.node_unpublish_volume(req).await.unwrap();
        assert!(!t.exists(), "target left behind");
    }
    for (id, s) in [(&vol.volume_id, &staging), (&restored.volume_id, &staging2)] {
        let req = unstage_req(id, s);
        n.node_unstage_volume(req.clone()).await.unwrap();
        n.node_unstage_volume(req).await.unwrap();
    }
    assert!(h.mounts().is_empty(), "mounts left: {:?}", h.mounts());
    assert!(
        h.loop_devices().is_empty(),
        "loop devices left: {:?}",
        h.loop_devices()
    );

    // Pagination over three volumes, two at a time.
    let page1 = c
        .list_volumes(pb::ListVolumesRequest {
            max_entries: 2,
            starting_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page1.entries.len(), 2);
    assert!(!page1.next_token.is_empty());
    let page2 = c
        .list_volumes(pb::ListVolumesRequest {
            max_entries: 2,
            starting_token: page1.next_token,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page2.entries.len(), 1);
    assert!(page2.next_token.is_empty());

    for id in [&vol.volume_id, &restored.volume_id, &cloned.volume_id] {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    c.delete_snapshot(pb::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.delete_snapshot(pb::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let left = c
        .list_volumes(pb::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(left.entries.is_empty());
    let pool: Vec<_> = std::fs::read_dir(h.state_dir().join("pool/volumes"))
        .unwrap()
        .collect();
    assert!(pool.is_empty(), "pool not empty: {pool:?}");
}

#[tokio::test]
async fn block_volume_lifecycle() {
    let h = Harness::start().await;
    let (mut c, mut n) = (h.controller(), h.node());
    let cap = block_cap(SNMW);
    let vol = h
        .create(create_req("pvc-block", 8 * MIB, cap.clone()))
        .await;
    let staging = h.path("kubelet/staging/blk");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let t1 = h.path("kubelet/pods/b1");
    let t2 = h.path("kubelet/pods/b2");
    n.node_publish_volume(publish_req(
        &vol.volume_id,
        &staging,
        &t1,
        cap.clone(),
        false,
    ))
    .await
    .unwrap();
    // A multi-writer volume may be published twice on the node.
    n.node_publish_volume(publish_req(
        &vol.volume_id,
        &staging,
        &t2,
        cap.clone(),
        false,
    ))
    .await
    .unwrap();
    {
        use std::io::{Read, Seek, SeekFrom, Write};
        let mut dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&t1)
            .unwrap();
        dev.seek(SeekFrom::Start(MIB as u64)).unwrap();
        dev.write_all(b"raw block bytes").unwrap();
        dev.sync_all().unwrap();
        let mut other = std::fs::File::open(&t2).unwrap();
        other.seek(SeekFrom::Start(MIB as u64)).unwrap();
        let mut buf = [0u8; 15];
        other.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"raw block bytes");
    }
    let stats = n
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: t1.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.usage[0].total, 8 * MIB);
    // Asked by its staging path, a block volume reports its device's size.
    let by_staging = n
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: staging.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_staging.usage[0].total, 8 * MIB);

    // Expanding a block volume: the loop device sees the new size.
    let e = c
        .controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 16 * MIB,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(e.capacity_bytes, 16 * MIB);
    assert!(e.node_expansion_required);
    let ne = n
        .node_expand_volume(pb::NodeExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: t1.display().to_string(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 16 * MIB,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ne.capacity_bytes, 16 * MIB);

    for t in [&t1, &t2] {
        n.node_unpublish_volume(unpublish_req(&vol.volume_id, t))
            .await
            .unwrap();
        assert!(!t.exists());
    }
    n.node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty());
    assert!(h.mounts().is_empty());
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
}

/// A read-only publish of a raw block volume cannot be written: a
/// read-only bind of a device node does not stop writes through it (the
/// kernel checks a mount's read-only flag for files, not for devices), so
/// the target gets a read-only loop device of its own over the staged one,
/// detached at unpublish, also after a driver restart.
#[tokio::test]
async fn a_read_only_block_publish_cannot_be_written() {
    use std::io::{Read, Seek, SeekFrom, Write};
    require_root();
    let mut h = Harness::start().await;
    let cap = block_cap(SNMW);
    let id = h
        .create(create_req("pvc-ro-block", 8 * MIB, cap.clone()))
        .await
        .volume_id;
    let staging = h.path("kubelet/staging/ro");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    let staged = h.loop_devices();
    assert_eq!(staged.len(), 1, "{staged:?}");
    // Loop devices over the staged one, and whether each is read-only.
    let over_staged = || -> Vec<(String, bool)> {
        let mut out = Vec::new();
        for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
            let b = std::fs::read_to_string(e.path().join("loop/backing_file")).unwrap_or_default();
            if b.trim_end() == staged[0] {
                let ro = std::fs::read_to_string(e.path().join("ro")).unwrap();
                out.push((
                    e.file_name().to_string_lossy().into_owned(),
                    ro.trim() == "1",
                ));
            }
        }
        out
    };
    let (rw, ro) = (h.path("kubelet/pods/rw"), h.path("kubelet/pods/ro"));
    h.node()
        .node_publish_volume(publish_req(&id, &staging, &rw, cap.clone(), false))
        .await
        .unwrap();
    {
        let mut dev = std::fs::OpenOptions::new().write(true).open(&rw).unwrap();
        dev.seek(SeekFrom::Start(MIB as u64)).unwrap();
        dev.write_all(b"written rw").unwrap();
        dev.sync_all().unwrap();
    }
    assert!(
        over_staged().is_empty(),
        "a read-write publish binds the device"
    );
    for _ in 0..2 {
        h.node()
            .node_publish_volume(publish_req(&id, &staging, &ro, cap.clone(), true))
            .await
            .unwrap();
    }
    let made = over_staged();
    assert_eq!(
        made.len(),
        1,
        "one read-only device, also when asked twice: {made:?}"
    );
    assert!(made[0].1, "{made:?}");
    let mut back = [0u8; 10];
    let mut dev = std::fs::File::open(&ro).unwrap();
    dev.seek(SeekFrom::Start(MIB as u64)).unwrap();
    dev.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"written rw");
    let wrote = std::fs::OpenOptions::new()
        .write(true)
        .open(&ro)
        .and_then(|mut d| d.write_all(b"must not land").and_then(|()| d.sync_all()));
    assert!(wrote.is_err(), "a read-only block publish took a write");
    drop(dev);

    // A restart keeps the publish; unpublish then releases the device.
    h.kill();
    h.spawn().await;
    h.node()
        .node_unpublish_volume(unpublish_req(&id, &ro))
        .await
        .unwrap();
    assert!(over_staged().is_empty(), "{:?}", over_staged());
    assert!(!ro.exists());

    // The bind goes away behind the driver's back while it is down: after
    // the restart, unpublish still releases the read-only device.
    h.node()
        .node_publish_volume(publish_req(&id, &staging, &ro, cap.clone(), true))
        .await
        .unwrap();
    assert_eq!(over_staged().len(), 1);
    h.kill();
    nix::mount::umount(&ro).unwrap();
    h.spawn().await;
    // Published again (kubelet retries): the old device goes, one new one.
    h.node()
        .node_publish_volume(publish_req(&id, &staging, &ro, cap.clone(), true))
        .await
        .unwrap();
    assert_eq!(over_staged().len(), 1, "{:?}", over_staged());
    h.node()
        .node_unpublish_volume(unpublish_req(&id, &ro))
        .await
        .unwrap();
    assert!(over_staged().is_empty(), "{:?}", over_staged());
    h.unpublish_unstage(&id, &staging, &rw).await;
    assert!(h.loop_devices().is_empty());
    assert!(h.mounts().is_empty());
}

/// Two pods on one node share a volume (a ReadWriteOnce claim's rolling
/// update, two replicas placed together, a debug pod): under
/// SINGLE_NODE_WRITER and SINGLE_NODE_MULTI_WRITER both targets write and
/// read each other's data, also across a driver restart, and one
/// unpublished leaves the other serving; SINGLE_NODE_SINGLE_WRITER
/// (ReadWriteOncePod) refuses the second target; two read-only targets
/// read. A filesystem volume and a raw block one, on the file backend.
#[tokio::test]
async fn two_pods_on_one_node_share_a_single_node_volume() {
    let mut h = Harness::start().await;
    for (name, cap) in [
        ("share-fs", mount_cap("ext4", SNW)),
        ("share-blk", block_cap(SNW)),
    ] {
        let id = h
            .create_volume(create_req(name, 16 * MIB, cap.clone()))
            .await
            .volume_id;
        let staging = h.path(&format!("kubelet/staging/{name}"));
        std::fs::create_dir_all(&staging).unwrap();
        h.two_pods_on_one_node(&stage_req(&id, &staging, cap), name)
            .await;
        h.delete_volume(&id).await;
    }
    assert!(h.loop_devices().is_empty(), "{:?}", h.loop_devices());
}

#[tokio::test]
async fn restart_between_stage_and_unstage() {
    let mut h = Harness::start().await;
    let cap = mount_cap("", SNW);
    let vol = h
        .create(create_req("pvc-restart", 16 * MIB, cap.clone()))
        .await;
    let staging = h.path("kubelet/staging/r");
    std::fs::create_dir_all(&staging).unwrap();
    let target = h.path("kubelet/pods/r1");
    h.node()
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    h.node()
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &target,
            cap.clone(),
            false,
        ))
        .await
        .unwrap();
    std::fs::write(target.join("kept"), b"survives a crash").unwrap();

    h.kill();
    h.spawn().await;

    // The restarted driver knows the volume is staged and published.
    h.node()
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &target,
            cap.clone(),
            false,
        ))
        .await
        .unwrap();
    let stats = h
        .node()
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: staging.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!stats.volume_condition.unwrap().abnormal);
    h.node()
        .node_unpublish_volume(unpublish_req(&vol.volume_id, &target))
        .await
        .unwrap();
    h.node()
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    assert!(h.loop_devices().is_empty());

    // The data is still there when staged again (default fs is ext4).
    h.node()
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(staging.join("kept")).unwrap(),
        b"survives a crash"
    );
    h.node()
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty());
}

/// While a stage of a volume is in flight, every other stage of it is
/// refused with ABORTED at once (never queued), and the first completes.
#[tokio::test]
async fn concurrent_rpcs_on_one_volume_one_wins_others_aborted() {
    let dir = tempfile::tempdir().unwrap();
    let gate = BlkidGate::new(dir.path());
    let h = Harness::start_with_env(None, &[("PATH", gate.path.as_str())]).await;
    let cap = mount_cap("ext4", SNW);
    let vol = h
        .create(create_req("pvc-race", 64 * MIB, cap.clone()))
        .await;
    let staging = h.path("kubelet/staging/race");
    std::fs::create_dir_all(&staging).unwrap();
    let mut first = h.node();
    let req = stage_req(&vol.volume_id, &staging, cap.clone());
    let winner = tokio::spawn(async move { code(&first.node_stage_volume(req).await) });
    // The first stage holds the volume while it sits in blkid.
    gate.wait_entered().await;
    let mut tasks = Vec::new();
    for _ in 0..7 {
        let mut n = h.node();
        let req = stage_req(&vol.volume_id, &staging, cap.clone());
        tasks.push(tokio::spawn(async move {
            code(&n.node_stage_volume(req).await)
        }));
    }
    let mut codes = Vec::new();
    for t in tasks {
        codes.push(t.await.unwrap());
    }
    assert_eq!(codes, vec![Code::Aborted; 7]);
    gate.release();
    assert_eq!(winner.await.unwrap(), Code::Ok);
    assert_eq!(h.loop_devices().len(), 1);
    h.node()
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty());
}

#[tokio::test]
async fn xfs_grows_online() {
    // xfs needs at least 300 MB; ext4 cannot grow while mounted in this
    // sandbox and is grown in the real-kernel guest instead.
    Harness::start()
        .await
        .check_online_growth("xfs", 320 * MIB, 512 * MIB, 150 * MIB)
        .await;
}

#[tokio::test]
async fn sigterm_exits_cleanly_and_removes_socket() {
    let mut h = Harness::start().await;
    let status = h.terminate();
    assert!(status.success(), "{status:?}");
    assert!(!h.socket().exists());
    // A stale socket left by a crash does not stop the next start.
    let stale = std::os::unix::net::UnixListener::bind(h.socket()).unwrap();
    drop(stale);
    h.spawn().await;
    // And a second driver on a live socket is refused.
    let out = h.command().output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("another process"));
}

#[tokio::test]
async fn mount_flags_are_honoured_and_json_logs_parse() {
    let mut h = Harness::start().await;
    // Restart with JSON logs.
    h.kill();
    std::fs::write(h.path("driver.log"), b"").unwrap();
    h.env.push(("FERROVOL_LOG_FORMAT".into(), "json".into()));
    h.spawn().await;

    let mut cap = mount_cap("ext4", SNW);
    if let Some(pb::volume_capability::AccessType::Mount(m)) = &mut cap.access_type {
        m.mount_flags = vec!["noatime".into(), "nodev,nosuid".into()];
    }
    let vol = h
        .create(create_req("pvc-flags", 16 * MIB, cap.clone()))
        .await;
    let staging = h.path("kubelet/staging/f");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let target = h.path("kubelet/pods/f1");
    h.node()
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &target,
            cap.clone(),
            false,
        ))
        .await
        .unwrap();
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let table = ferrovol::mount::parse_mountinfo(&text);
    for path in [&staging, &target] {
        let m = table
            .iter()
            .rev()
            .find(|m| &m.mount_point == path)
            .expect("mounted");
        for flag in ["noatime", "nodev", "nosuid"] {
            assert!(
                m.options.iter().any(|o| o == flag),
                "{flag} missing on {}: {:?}",
                path.display(),
                m.options
            );
        }
    }
    h.node()
        .node_unpublish_volume(unpublish_req(&vol.volume_id, &target))
        .await
        .unwrap();
    h.node()
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    let log = h.log();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() > 3);
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v.get("level").is_some());
    }
    assert!(log.contains("NodeStageVolume"));
}

#[tokio::test]
async fn modes_serve_only_their_services() {
    let node_only = Harness::start_with_env(None, &[("FERROVOL_MODE", "node")]).await;
    let r = node_only
        .controller()
        .create_volume(create_req("m", MIB, mount_cap("ext4", SNW)))
        .await;
    assert_eq!(code(&r), Code::Unimplemented);
    node_only
        .node()
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap();
    // Every instance reports the same plugin capabilities, whatever its mode.
    let caps = node_only
        .identity()
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 5);

    let controller_only = Harness::start_with_env(None, &[("FERROVOL_MODE", "controller")]).await;
    let r = controller_only
        .node()
        .node_get_info(pb::NodeGetInfoRequest {})
        .await;
    assert_eq!(code(&r), Code::Unimplemented);
    let v = controller_only
        .controller()
        .create_volume(create_req("m", MIB, mount_cap("ext4", SNW)))
        .await
        .unwrap();
    let id = v.into_inner().volume.unwrap().volume_id;
    controller_only
        .controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn serves_over_tcp_too() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .args([
            "serve",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
            "--node-id",
            "tcp-node",
            "--state-dir",
        ])
        .arg(dir.path().join("state"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let ready = loop {
        if let Ok(ch) = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
        {
            let mut id = ferrovol::proto::identity_client::IdentityClient::new(ch);
            if let Ok(r) = id.probe(pb::ProbeRequest {}).await {
                break r.into_inner().ready == Some(true);
            }
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert!(ready, "no Probe answer over TCP");
    assert!(status.success(), "{status:?}");
}

/// docs/client.md's walk (`ferrovol client lifecycle`) works against the driver.
#[tokio::test]
async fn the_client_lifecycle_walk_drives_a_volume_through_its_life() {
    let h = Harness::start().await;
    let work = h.path("example-work");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .args(["client", "--endpoint"])
        .arg(format!("unix://{}", h.socket().display()))
        .args(["lifecycle", "--work"])
        .arg(&work)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("deleted both volumes and the snapshot: done"),
        "{stdout}"
    );
    assert!(h.mounts().is_empty() && h.loop_devices().is_empty());
    assert!(h
        .controller()
        .list_volumes(pb::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .is_empty());
}

/// A restored snapshot and a clone of a mounted volume stage beside their
/// source: each copy gets its own filesystem UUID before its first mount
/// (the kernel refuses a second xfs with one UUID; btrfs mixes up two
/// devices with one fsid), and both show the source's data.
#[tokio::test]
async fn copies_mount_beside_their_source_with_their_own_uuid() {
    let h = Harness::start().await;
    for fs in ["ext4", "xfs", "btrfs"] {
        let cap = mount_cap(fs, SNW);
        let source = h
            .provision(&format!("src-{fs}"), 320 * MIB, cap.clone())
            .await;
        {
            // fsync'd, not unmounted: the copy holds it in the journal/log.
            use std::io::Write;
            let mut f = std::fs::File::create(source.target.join("data")).unwrap();
            write!(f, "written on {fs}").unwrap();
            f.sync_all().unwrap();
        }
        // Snapshot and clone while the source stays mounted (a copy of a
        // live filesystem: xfs's log is dirty in it).
        let snap = h.snapshot_made(&format!("snap-{fs}"), &source.id).await;
        let mut copies = Vec::new();
        for (name, src) in [
            (
                format!("restored-{fs}"),
                pb::volume_content_source::Type::Snapshot(
                    pb::volume_content_source::SnapshotSource {
                        snapshot_id: snap.snapshot_id.clone(),
                    },
                ),
            ),
            (
                format!("clone-{fs}"),
                pb::volume_content_source::Type::Volume(pb::volume_content_source::VolumeSource {
                    volume_id: source.id.clone(),
                }),
            ),
        ] {
            let mut req = create_req(&name, 0, cap.clone());
            req.volume_content_source = Some(pb::VolumeContentSource { r#type: Some(src) });
            let id = h.create(req).await.volume_id;
            let staging = h.path(&format!("kubelet/staging/{name}"));
            std::fs::create_dir_all(&staging).unwrap();
            let target = h.path(&format!("kubelet/pods/{name}"));
            h.node()
                .node_stage_volume(stage_req(&id, &staging, cap.clone()))
                .await
                .unwrap_or_else(|e| panic!("staging {name} beside its source: {e}"));
            h.node()
                .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
                .await
                .unwrap();
            assert_eq!(
                std::fs::read_to_string(target.join("data")).unwrap(),
                format!("written on {fs}"),
                "{name}"
            );
            copies.push(Published {
                id,
                staging,
                target,
            });
        }
        // Three mounted filesystems, three UUIDs.
        let mut uuids: Vec<String> = std::iter::once(&source)
            .chain(copies.iter())
            .map(|p| mounted_uuid(&p.staging))
            .collect();
        uuids.sort();
        uuids.dedup();
        assert_eq!(uuids.len(), 3, "{fs}: {uuids:?}");
        for p in copies.iter().chain(std::iter::once(&source)) {
            h.teardown(p).await;
        }
        h.controller()
            .delete_snapshot(pb::DeleteSnapshotRequest {
                snapshot_id: snap.snapshot_id,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(h.mounts().is_empty());
    assert!(h.loop_devices().is_empty());
}

/// The UUID of the filesystem mounted at `path`, from its device.
fn mounted_uuid(path: &std::path::Path) -> String {
    let out = std::process::Command::new("findmnt")
        .args(["-n", "-o", "UUID", "--mountpoint"])
        .arg(path)
        .output()
        .unwrap();
    let uuid = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(!uuid.is_empty(), "no UUID for {}", path.display());
    uuid
}

/// Every RPC of the CSI services called by grpcio for Python at
/// `endpoint` (a socket's path, or `tcp://HOST:PORT`) with `authority`
/// (see tests/clients/csi_calls.py): a line per call, its code.
fn csi_calls(endpoint: &str, authority: &str) -> String {
    let out = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/clients/csi_calls.py"
        ))
        .arg(endpoint)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/proto/csi.proto"))
        .arg(authority)
        .output()
        .expect("python3 runs (install grpcio and grpcio-tools)");
    assert!(
        out.status.success(),
        "{authority}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Clients that send the socket path as `:authority` (kubelet before 1.26
/// with the node-driver-registrar, csc, grpcio, grpc-java) reach every RPC
/// of the five services, and get the answers a well-behaved client gets.
/// Needs python3 with grpcio and grpcio-tools (`.ci/run` installs them).
#[tokio::test]
async fn clients_sending_the_socket_path_as_authority_reach_every_rpc() {
    let h = Harness::start().await;
    let socket = h.socket().display().to_string();
    let run = |authority: &str| csi_calls(&socket, authority);
    // What a client with an authority the server takes gets: the reference.
    let reference = run("localhost");
    let lines: Vec<&str> = reference.lines().collect();
    // Identity, Controller, GroupController, SnapshotMetadata, Node.
    assert_eq!(lines.len(), 3 + 17 + 4 + 2 + 10, "{reference}");
    assert!(
        lines.contains(&"SnapshotMetadata/GetMetadataDelta INVALID_ARGUMENT"),
        "{reference}"
    );
    assert!(
        lines.contains(&"GroupController/GroupControllerGetCapabilities OK"),
        "{reference}"
    );
    assert!(lines.contains(&"Identity/Probe OK"), "{reference}");
    assert!(lines.contains(&"Node/NodeGetInfo OK"), "{reference}");
    assert!(
        lines.contains(&"Controller/CreateVolume INVALID_ARGUMENT"),
        "{reference}"
    );
    assert!(!reference.contains("INTERNAL"), "{reference}");
    for authority in ["socket", "default"] {
        assert_eq!(run(authority), reference, "authority mode {authority}");
    }
    assert!(!h.log().contains("malformed"), "{}", h.log());
}

/// Over plain TCP (`--endpoint tcp://...` on loopback), a client that
/// sends the endpoint's URL as `:authority` (csc sends
/// `tcp://127.0.0.1:PORT`) reaches every RPC and gets what a client with a
/// plain authority gets. Needs python3 with grpcio and grpcio-tools.
#[tokio::test]
async fn clients_sending_the_endpoint_url_as_authority_over_tcp_reach_every_rpc() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[[backend]]\ntype = \"file\"\npool = \"{}\"\n",
            dir.path().join("pool").display()
        ),
    )
    .unwrap();
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let log = std::fs::File::create(dir.path().join("log")).unwrap();
    let mut driver = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .args(["serve", "--endpoint", &endpoint, "--node-id", "tcp-node"])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--config")
        .arg(&config)
        .stderr(log)
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    // Serving once it takes a connection; one that exited fails at once.
    loop {
        if let Some(status) = driver.try_wait().unwrap() {
            panic!(
                "exited with {status}: {}",
                std::fs::read_to_string(dir.path().join("log")).unwrap()
            );
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let _driver = Kill(driver);
    let run = |authority: &str| csi_calls(&endpoint, authority);
    let reference = run("localhost");
    assert!(reference.contains("Identity/Probe OK"), "{reference}");
    assert!(reference.contains("Node/NodeGetInfo OK"), "{reference}");
    assert!(!reference.contains("UNAVAILABLE"), "{reference}");
    assert_eq!(run("socket"), reference, "the endpoint's URL as authority");
}

/// A controller and a node in two processes, as a cluster runs the remote
/// driver: a change to a volume's I/O limits at the controller reaches the
/// node's pod within its refresh (the node asks the controller's
/// `/limits`), including one made while the node was down; the node keeps
/// what it was told, and writes it again at a start with the controller
/// gone. The pod's cgroup is a folder with an `io.max` file here (the
/// kernel's is tested in the guest); the device is a real loop device.
#[tokio::test]
async fn a_limit_change_at_a_controller_reaches_a_node_that_asks_it() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let uid = "7c1d2e3f-4a5b-4c6d-8e7f-90a1b2c3d4e5";
    let (config, pod) = asking_node(dir.path(), port, uid);
    let metrics = format!("127.0.0.1:{port}");
    let mut controller = Harness::start_with_env(
        Some(&config),
        &[
            ("FERROVOL_MODE", "controller"),
            ("FERROVOL_METRICS_ADDR", &metrics),
        ],
    )
    .await;
    let mut node = Harness::start_with_env(Some(&config), &[("FERROVOL_MODE", "node")]).await;
    let (vol, staging, target) = limited_in_a_pod(&controller, &node, uid).await;
    let io_max = || std::fs::read_to_string(pod.join("io.max")).unwrap();
    let line = |riops: &str, wiops: &str| format!("rbps=max wbps=max riops={riops} wiops={wiops}");
    assert!(io_max().ends_with(&line("max", "50")), "{}", io_max());
    // Within the node's refresh (1 s here), as long as a busy machine
    // makes it.
    let becomes = |want: String| {
        let io_max = &io_max;
        async move {
            let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while !io_max().ends_with(&want) {
                assert!(
                    std::time::Instant::now() < until,
                    "io.max is {:?}, not ...{want}",
                    io_max()
                );
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    };
    controller
        .modify(&vol.volume_id, &[("writeIops", "200")])
        .await
        .unwrap();
    becomes(line("max", "200")).await;
    // The limits in force, in the CLI's volume stats (on the condition's
    // message: CSI's stats have no field for them); with the pod's stall
    // on I/O once its cgroup keeps pressure (the kernel's is tested in
    // the guest).
    let stats = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
            .args(["client", "--endpoint"])
            .arg(format!("unix://{}", node.socket().display()))
            .args(["--output", "json", "stats", &vol.volume_id, "--path"])
            .arg(&target)
            .output()
            .unwrap();
        let stats: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        stats["volume_condition"]["message"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        stats(),
        format!("volume is healthy; I/O limited for pod {uid}: writeIops=200")
    );
    std::fs::write(
        pod.join("io.pressure"),
        "some avg10=90.00 avg60=30.00 avg300=7.00 total=2540000\n\
         full avg10=90.00 avg60=30.00 avg300=7.00 total=2500000\n",
    )
    .unwrap();
    assert_eq!(
        stats(),
        format!(
            "volume is healthy; I/O limited for pod {uid}: writeIops=200; \
             the pod stalled on I/O 2.5 s in all"
        )
    );
    // Made while the node is down: taken when it is back.
    node.kill();
    controller
        .modify(&vol.volume_id, &[("readIops", "20")])
        .await
        .unwrap();
    node.spawn().await;
    becomes(line("20", "200")).await;
    // The controller gone (its answers with it): a node started again
    // writes what it was last told.
    controller.kill();
    node.kill();
    std::fs::write(pod.join("io.max"), "").unwrap();
    node.spawn().await;
    assert!(io_max().ends_with(&line("20", "200")), "{}", io_max());
    assert!(
        node.log()
            .contains("the volumes keep the I/O limits they have"),
        "{}",
        node.log()
    );
    controller.spawn().await;
    // What a node may ask, and what it is told.
    let (status, body) = http_get(port, &format!("/limits?volumes={}", vol.volume_id)).unwrap();
    assert_eq!(status, 200, "{body}");
    let said: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(said["volumes"][&vol.volume_id]["writeIops"], 200, "{body}");
    assert_eq!(http_get(port, "/limits?volumes=../x").unwrap().0, 400);
    assert_eq!(http_get(port, "/limits").unwrap().0, 400);
    // Lifted: the line goes.
    controller
        .modify(&vol.volume_id, &[("readIops", "max"), ("writeIops", "max")])
        .await
        .unwrap();
    becomes(line("max", "max")).await;
    gone(&controller, &node, &vol, &staging, &target).await;
}

/// The node-local driver as a cluster runs it: the central controller
/// (`--volumes-on-nodes`, keeping no volume) offers a change to a
/// volume's I/O limits, and the node that holds the volume (its own
/// controller, asking the central one) takes it, keeps it and sets it on
/// the pod; the modify is done once it did, so the pod's `io.max` has the
/// change when the call returns. The volume's other mutable parameters
/// are still refused there.
#[tokio::test]
async fn a_limit_change_at_the_central_controller_is_taken_by_the_volume_s_node() {
    let dir = tempfile::tempdir().unwrap();
    let uid = "2a3b4c5d-6e7f-4a8b-9c0d-1e2f3a4b5c6d";
    let (central, node, pod) = central_and_its_node(dir.path(), uid, &[]).await;
    let (vol, staging, target) = limited_in_a_pod(&node, &node, uid).await;
    let io_max = || std::fs::read_to_string(pod.join("io.max")).unwrap();
    assert!(io_max().ends_with("wiops=50"), "{}", io_max());
    central
        .modify(&vol.volume_id, &[("writeIops", "200"), ("readBps", "1Mi")])
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}\n{}", central.log(), node.log()));
    assert!(
        io_max().ends_with("rbps=1048576 wbps=max riops=max wiops=200"),
        "{}",
        io_max()
    );
    // Kept on the node: a node started again has it.
    let book = std::fs::read_to_string(node.state_dir().join("controller/limits.json")).unwrap();
    assert!(book.contains("\"writeIops\": 200"), "{book}");
    let e = central
        .modify(&vol.volume_id, &[("preallocate", "true")])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("set when it is created"), "{e}");
    gone(&node, &node, &vol, &staging, &target).await;
}

/// The node-local path cut at `limits.taken`: the node dies with the
/// offered change in its book, its pod not yet set and the central
/// controller not yet told. The modify waits on; the node started again
/// sets the change from its book, takes the same offer again (which
/// changes nothing more) and says so, and the modify then answers.
#[tokio::test]
async fn a_node_killed_as_it_takes_an_offer_sets_it_at_start_and_the_modify_answers() {
    let dir = tempfile::tempdir().unwrap();
    let uid = "3b4c5d6e-7f8a-4b9c-8d1e-2f3a4b5c6d7e";
    let (central, mut node, pod) =
        central_and_its_node(dir.path(), uid, &[("FERROVOL_KILL_AT", "limits.taken")]).await;
    let (vol, staging, target) = limited_in_a_pod(&node, &node, uid).await;
    let io_max = || std::fs::read_to_string(pod.join("io.max")).unwrap();
    assert!(io_max().ends_with("wiops=50"), "{}", io_max());
    let mut ctl = central.controller();
    let id = vol.volume_id.clone();
    let modify = tokio::spawn(async move {
        ctl.controller_modify_volume(pb::ControllerModifyVolumeRequest {
            volume_id: id,
            mutable_parameters: [("writeIops".to_string(), "200".to_string())].into(),
            ..Default::default()
        })
        .await
    });
    node.wait_exit(std::time::Duration::from_secs(30)).await;
    // Dead at the point: the book has the change, the pod the old limit,
    // and the modify has not answered.
    let book = std::fs::read_to_string(node.state_dir().join("controller/limits.json")).unwrap();
    assert!(book.contains("\"writeIops\": 200"), "{book}");
    assert!(io_max().ends_with("wiops=50"), "{}", io_max());
    assert!(
        !modify.is_finished(),
        "the modify answered before the node said it took the change"
    );
    node.env.clear();
    node.spawn().await;
    let answered = tokio::time::timeout(std::time::Duration::from_secs(30), modify)
        .await
        .expect("the modify did not answer once the node was back")
        .unwrap();
    answered.unwrap_or_else(|e| panic!("{e:?}\n{}\n{}", central.log(), node.log()));
    assert!(io_max().ends_with("wiops=200"), "{}", io_max());
    let book = std::fs::read_to_string(node.state_dir().join("controller/limits.json")).unwrap();
    assert!(book.contains("\"writeIops\": 200"), "{book}");
    gone(&node, &node, &vol, &staging, &target).await;
}

/// The node-local driver's central controller (`--volumes-on-nodes`, its
/// endpoint on a free port) and a node asking it (config by
/// [`asking_node`] under `dir`, with `node_env`); the folder of pod
/// `uid`'s cgroup.
async fn central_and_its_node(
    dir: &std::path::Path,
    uid: &str,
    node_env: &[(&str, &str)],
) -> (Harness, Harness, std::path::PathBuf) {
    let port = free_port();
    let (node_config, pod) = asking_node(dir, port, uid);
    let metrics = format!("127.0.0.1:{port}");
    let central = Harness::start_with_env(
        None,
        &[
            ("FERROVOL_VOLUMES_ON_NODES", "true"),
            ("FERROVOL_METRICS_ADDR", &metrics),
        ],
    )
    .await;
    let node = Harness::start_with_env(Some(&node_config), node_env).await;
    (central, node, pod)
}

/// A node's config that asks the controller on `port` for limit changes
/// every second, on a file pool under `dir`, its cgroup tree there too;
/// and the folder of pod `uid`'s cgroup in it, with an empty `io.max`
/// (the kernel's is tested in the guest).
fn asking_node(dir: &std::path::Path, port: u16, uid: &str) -> (String, std::path::PathBuf) {
    let pod = dir.join(format!("cgroup/kubepods/burstable/pod{uid}"));
    std::fs::create_dir_all(&pod).unwrap();
    std::fs::write(pod.join("io.max"), "").unwrap();
    let config = format!(
        "[node]\ncgroup_root = \"{}/cgroup\"\nlimits_from = \"http://127.0.0.1:{port}\"\n\
         limits_refresh_seconds = 1\n\n[[backend]]\ntype = \"file\"\nname = \"file\"\n\
         pool = \"{}/pool\"\n",
        dir.display(),
        dir.display()
    );
    (config, pod)
}

/// A file volume made by `ctl` with a limit of 50 write IOPS, staged on
/// `node` and published to pod `uid` there: the volume, its staging path
/// and its target.
async fn limited_in_a_pod(
    ctl: &Harness,
    node: &Harness,
    uid: &str,
) -> (pb::Volume, std::path::PathBuf, std::path::PathBuf) {
    let cap = mount_cap("ext4", SNW);
    let mut req = create_req("lim", 16 * MIB, cap.clone());
    req.parameters.insert("writeIops".into(), "50".into());
    let vol = ctl.create(req).await;
    let staging = node.path("kubelet/staging/lim");
    let target = node.path("kubelet/pods/lim");
    std::fs::create_dir_all(&staging).unwrap();
    node.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            volume_context: vol.volume_context.clone(),
            ..stage_req(&vol.volume_id, &staging, cap.clone())
        })
        .await
        .unwrap_or_else(|e| panic!("stage: {e:?}\n{}", node.log()));
    let mut context = vol.volume_context.clone();
    context.insert("csi.storage.k8s.io/pod.uid".into(), uid.into());
    node.node()
        .node_publish_volume(pb::NodePublishVolumeRequest {
            volume_context: context,
            ..publish_req(&vol.volume_id, &staging, &target, cap, false)
        })
        .await
        .unwrap_or_else(|e| panic!("publish: {e:?}\n{}", node.log()));
    (vol, staging, target)
}

/// The volume unpublished and unstaged on `node`, deleted by `ctl`.
async fn gone(
    ctl: &Harness,
    node: &Harness,
    vol: &pb::Volume,
    staging: &std::path::Path,
    target: &std::path::Path,
) {
    node.node()
        .node_unpublish_volume(unpublish_req(&vol.volume_id, target))
        .await
        .unwrap();
    node.node()
        .node_unstage_volume(unstage_req(&vol.volume_id, staging))
        .await
        .unwrap();
    ctl.controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
}
