//! The `nfs` backend's copies and capacity: snapshots and clones on plain
//! and btrfs exports, xfs project quotas.

use super::*;

/// nfs snapshots are archives on the share, ready once complete, listed
/// from the share alone; a volume restored from one, and a clone, hold the
/// source's files.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_snapshot_restore_and_clone() {
    require_guest();
    let server = NfsServer::new();
    let config = "[[backend]]\ntype = \"nfs\"\n\
        [[backend.export]]\nname = \"main\"\nserver = \"127.0.0.1\"\nshare = \"/\"\n";
    let mut h = Harness::start_with(Some(config)).await;
    let mut c = h.controller();
    let cap = mount_cap("nfs", 5);
    let src = h.create(create_req("pvc-src", 64 * MIB, cap.clone())).await;
    std::fs::create_dir_all(server.export.join("pvc-src/sub")).unwrap();
    std::fs::write(server.export.join("pvc-src/sub/f"), b"snapshotted").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", server.export.join("pvc-src/link")).unwrap();
    let snap = h.snapshot_made("snap-1", &src.volume_id).await;
    assert!(snap.ready_to_use);
    assert_eq!(snap.size_bytes, 64 * MIB);
    // Changes after the snapshot are not in it.
    std::fs::write(server.export.join("pvc-src/sub/f"), b"changed later").unwrap();
    let listed = c
        .list_snapshots(pb::ListSnapshotsRequest {
            source_volume_id: src.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);
    let got = c
        .get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.snapshot.unwrap().snapshot_id, snap.snapshot_id);

    let from = |name: &str, source: pb::volume_content_source::Type| {
        let mut r = create_req(name, 64 * MIB, cap.clone());
        r.volume_content_source = Some(pb::VolumeContentSource {
            r#type: Some(source),
        });
        r
    };
    let restore = from(
        "pvc-restored",
        pb::volume_content_source::Type::Snapshot(pb::volume_content_source::SnapshotSource {
            snapshot_id: snap.snapshot_id.clone(),
        }),
    );
    // The driver dies with the restore's record written and its directory
    // made, empty (`nfs.fill`): the CO's retry must not take that
    // directory for the restored volume; it fills it again.
    h.kill();
    h.env = vec![("FERROVOL_KILL_AT".into(), "nfs.fill".into())];
    h.spawn().await;
    assert!(h.controller().create_volume(restore.clone()).await.is_err());
    h.kill();
    h.env.clear();
    assert!(server.export.join("pvc-restored").is_dir());
    assert!(!server.export.join("pvc-restored/sub").exists());
    h.spawn().await;
    let mut c = h.controller();
    let listed = c
        .list_volumes(pb::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.entries.len(),
        1,
        "a volume being filled is not listed"
    );
    let restored = h.create(restore).await;
    assert_eq!(
        std::fs::read(server.export.join("pvc-restored/sub/f")).unwrap(),
        b"snapshotted"
    );
    let link = std::fs::read_link(server.export.join("pvc-restored/link")).unwrap();
    assert_eq!(
        link,
        std::path::Path::new("/etc/passwd"),
        "the link is kept as a link"
    );
    let cloned = h
        .create(from(
            "pvc-clone",
            pb::volume_content_source::Type::Volume(pb::volume_content_source::VolumeSource {
                volume_id: src.volume_id.clone(),
            }),
        ))
        .await;
    assert_eq!(
        std::fs::read(server.export.join("pvc-clone/sub/f")).unwrap(),
        b"changed later"
    );
    // A staged clone reads its files over NFS.
    let staging = h.path("kubelet/staging/clone");
    std::fs::create_dir_all(&staging).unwrap();
    let mut n = h.node();
    n.node_stage_volume(stage_req(&cloned.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(staging.join("sub/f")).unwrap(),
        b"changed later"
    );
    n.node_unstage_volume(unstage_req(&cloned.volume_id, &staging))
        .await
        .unwrap();
    for id in [&src.volume_id, &restored.volume_id, &cloned.volume_id] {
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
    let left: Vec<_> = std::fs::read_dir(server.export.join(".ferrovol/snapshots"))
        .unwrap()
        .flatten()
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// An nfs export on btrfs that the controller reaches on its own machine
/// (`btrfs_path`): every volume is a subvolume; a snapshot of a volume
/// being written over NFS (two files in turn, each write synced) restores
/// to a pair one instant held; a restore and a clone are writable
/// snapshots. A driver killed with a snapshot's subvolume made under its
/// temporary name (`nfs.snapshot.made`), or with a restore's record
/// written and nothing made (`nfs.fill`), converges on the CO's retry.
/// Deleting everything leaves no subvolume and no snapshot file.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_btrfs_snapshots_are_one_instant() {
    require_guest();
    let server = NfsServer::on_btrfs();
    let export = server.export.clone();
    let config = format!(
        "[[backend]]\ntype = \"nfs\"\n\
         [[backend.export]]\nname = \"main\"\nserver = \"127.0.0.1\"\nshare = \"/\"\n\
         btrfs_path = \"{}\"\n",
        export.display()
    );
    let mut h = Harness::start_with(Some(&config)).await;
    let cap = mount_cap("nfs", 5);
    let subvolumes = || {
        run("btrfs", &["subvolume", "list", export.to_str().unwrap()])
            .lines()
            .map(|l| l.rsplit(' ').next().unwrap_or_default().to_string())
            .collect::<Vec<_>>()
    };
    let is_subvolume = |name: &str| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(export.join(name)).unwrap().ino() == 256
    };
    let src = h
        .create_volume(create_req("pvc-src", 64 * MIB, cap.clone()))
        .await
        .volume_id;
    assert!(is_subvolume("pvc-src"), "{:?}", subvolumes());
    let staging = h.path("kubelet/staging/src");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(stage_req(&src, &staging, cap.clone()))
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = interleave(staging.join("p"), staging.join("q"), true, stop.clone());
    h.wait_until("the writer's first 20 rounds", &|| {
        read_seq(&staging.join("q")) >= 20
    });
    // Killed with the snapshot made under its temporary name.
    h.kill();
    h.env = vec![("FERROVOL_KILL_AT".into(), "nfs.snapshot.made".into())];
    h.spawn().await;
    let snap_req = pb::CreateSnapshotRequest {
        name: "snap-live".into(),
        source_volume_id: src.clone(),
        ..Default::default()
    };
    assert!(h
        .controller()
        .create_snapshot(snap_req.clone())
        .await
        .is_err());
    h.kill();
    h.env.clear();
    let snaps_dir = export.join(".ferrovol/snapshots");
    let names = || {
        let mut v: Vec<String> = std::fs::read_dir(&snaps_dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    assert!(
        names().iter().any(|n| n.ends_with(".snap.tmp")),
        "{:?}",
        names()
    );
    h.spawn().await;
    let snap = h
        .controller()
        .create_snapshot(snap_req)
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap()
        .snapshot_id;
    assert!(
        !names().iter().any(|n| n.ends_with(".tmp")),
        "the retry left its leftover: {:?}",
        names()
    );
    // Listed (all, and by source) and found, from the local filesystem.
    let all = h.all_snapshots().await;
    assert_eq!(all.len(), 1, "{all:?}");
    let by_source = h
        .controller()
        .list_snapshots(pb::ListSnapshotsRequest {
            source_volume_id: src.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert_eq!(by_source.len(), 1, "{by_source:?}");
    let after = read_seq(&staging.join("q"));
    h.wait_until("the writer going on", &|| {
        read_seq(&staging.join("q")) > after + 5
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let last = writer.join().expect("the writer met no error");
    let from = |name: &str, source: pb::volume_content_source::Type| {
        let mut r = create_req(name, 64 * MIB, cap.clone());
        r.volume_content_source = Some(pb::VolumeContentSource {
            r#type: Some(source),
        });
        r
    };
    let restore = from(
        "pvc-restored",
        pb::volume_content_source::Type::Snapshot(pb::volume_content_source::SnapshotSource {
            snapshot_id: snap.clone(),
        }),
    );
    // Killed with the restore's record written, nothing made.
    h.kill();
    h.env = vec![("FERROVOL_KILL_AT".into(), "nfs.fill".into())];
    h.spawn().await;
    assert!(h.controller().create_volume(restore.clone()).await.is_err());
    h.kill();
    h.env.clear();
    h.spawn().await;
    let restored = h.create_volume(restore).await.volume_id;
    assert!(is_subvolume("pvc-restored"));
    let (rp, rq) = (
        read_seq(&export.join("pvc-restored/p")),
        read_seq(&export.join("pvc-restored/q")),
    );
    assert!(
        rq >= 20 && one_instant(rp, rq),
        "the snapshot holds p={rp} q={rq}: no instant held that (the writer reached {last})"
    );
    eprintln!("the snapshot holds p={rp} q={rq} (the writer reached {last})");
    // Writable, and apart from its snapshot.
    std::fs::write(export.join("pvc-restored/p"), b"0\n").unwrap();
    let clone = h
        .create_volume(from(
            "pvc-clone",
            pb::volume_content_source::Type::Volume(pb::volume_content_source::VolumeSource {
                volume_id: src.clone(),
            }),
        ))
        .await
        .volume_id;
    assert!(is_subvolume("pvc-clone"));
    assert_eq!(read_seq(&export.join("pvc-clone/p")), last);
    h.node()
        .node_unstage_volume(unstage_req(&src, &staging))
        .await
        .unwrap();
    for id in [&restored, &clone, &src] {
        h.delete_volume(id).await;
    }
    h.controller()
        .delete_snapshot(pb::DeleteSnapshotRequest {
            snapshot_id: snap,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(subvolumes(), Vec::<String>::new());
    assert_eq!(names(), Vec::<String>::new());
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

/// An export on XFS with project quotas that the controller reaches
/// locally: each volume's capacity is enforced (writing past it fails with
/// ENOSPC), the client sees the quota as the filesystem's size, the
/// controller's health says the quota is nearly reached before it is, and
/// ControllerExpandVolume raises the limit (and the warning clears).
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_capacity_is_an_xfs_project_quota() {
    require_guest();
    let server = NfsServer::on_xfs_with_quotas();
    let config = format!(
        "[[backend]]\ntype = \"nfs\"\n\
         [[backend.export]]\nname = \"xfs\"\nserver = \"127.0.0.1\"\nshare = \"/\"\n\
         xfs_quota_path = \"{}\"\n",
        server.export.display()
    );
    let h = Harness::start_with_env(Some(&config), &[("FERROVOL_VOLUME_HEALTH", "true")]).await;
    let (mut c, mut n) = (h.controller(), h.node());
    let cap = mount_cap("nfs", 5);
    let vol = h
        .create(create_req("pvc-quota", 32 * MIB, cap.clone()))
        .await;
    let health = || async {
        h.controller_health(&vol.volume_id)
            .await
            .health_statuses
            .into_iter()
            .map(|e| e.reason)
            .collect::<Vec<_>>()
    };
    assert_eq!(health().await, Vec::<String>::new());
    let staging = h.path("kubelet/staging/quota");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let total = |n: &mut ferrovol::proto::node_client::NodeClient<_>| {
        let req = pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: staging.display().to_string(),
            staging_target_path: String::new(),
        };
        let mut n = n.clone();
        async move {
            n.node_get_volume_stats(req)
                .await
                .unwrap()
                .into_inner()
                .usage[0]
                .total
        }
    };
    assert_eq!(total(&mut n).await, 32 * MIB, "the client sees the quota");
    // Writing past the capacity fails.
    let write = |name: &str, mib: usize| {
        use std::io::Write;
        let mut f = std::fs::File::create(staging.join(name))?;
        let chunk = vec![7u8; 1 << 20];
        for _ in 0..mib {
            f.write_all(&chunk)?;
        }
        f.sync_all()
    };
    // 31 of its 32 MiB written: nearly reached, said before a write fails.
    write("most", 31).unwrap();
    assert_eq!(health().await, vec!["QuotaNearlyReached".to_string()]);
    std::fs::remove_file(staging.join("most")).unwrap();
    let err = write("big", 48).unwrap_err();
    assert!(
        err.raw_os_error() == Some(libc::ENOSPC) || err.raw_os_error() == Some(libc::EDQUOT),
        "{err}"
    );
    std::fs::remove_file(staging.join("big")).unwrap();
    // Grown: the new limit holds, and is what the client sees.
    let grown = c
        .controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 96 * MIB,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 96 * MIB);
    assert!(!grown.node_expansion_required);
    assert_eq!(total(&mut n).await, 96 * MIB);
    write("big", 48).unwrap();
    assert_eq!(health().await, Vec::<String>::new());
    n.node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    // The file deleted after the refused write may still be held by this
    // node's NFS client (a silly-renamed `.nfs*` file until its close goes
    // through): the delete fails UNAVAILABLE until it lets go, and the CO
    // retries, as here (within 60 s).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let deleted = c
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: vol.volume_id.clone(),
                ..Default::default()
            })
            .await;
        match deleted {
            Ok(_) => break,
            Err(e)
                if e.code() == tonic::Code::Unavailable
                    && e.message().contains(".nfs")
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(500)).await
            }
            Err(e) => panic!("DeleteVolume: {e:?}"),
        }
    }
}
