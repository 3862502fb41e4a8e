//! Group snapshots through the binary on the host, with the file backend:
//! two volumes staged with ext4 and written in an interleaved pattern (a
//! sequence number to one, then the same to the other) while the group
//! snapshot is cut; the restored pair must be one that some instant held.
//! Needs root (real loop devices and mounts).

mod common;

use common::*;
use ferrovol::proto as pb;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const MIB: i64 = 1 << 20;

#[tokio::test]
async fn a_group_snapshot_restores_to_one_instant_of_interleaved_writes() {
    require_root();
    let h = Harness::start().await;
    let caps = h
        .identity()
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        format!("{caps:?}").contains("GroupControllerService"),
        "{caps:?}"
    );
    let gcaps = h
        .group()
        .group_controller_get_capabilities(pb::GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gcaps.capabilities.len(), 1, "{gcaps:?}");

    let cap = mount_cap("ext4", SNW);
    let data = h.provision("data", 64 * MIB, cap.clone()).await;
    let wal = h.provision("wal", 64 * MIB, cap.clone()).await;
    let (fa, fb) = (data.target.join("seq"), wal.target.join("seq"));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = interleave(fa.clone(), fb.clone(), false, stop.clone());
    while read_seq(&fa) < 1000 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let request = pb::CreateVolumeGroupSnapshotRequest {
        name: "group-1".into(),
        source_volume_ids: vec![data.id.clone(), wal.id.clone()],
        ..Default::default()
    };
    let group = h
        .group()
        .create_volume_group_snapshot(request.clone())
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    // Thawed: the writer goes on.
    let after = read_seq(&fa);
    while read_seq(&fa) <= after {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let last = writer.join().unwrap();
    assert!(group.ready_to_use);
    assert_eq!(group.snapshots.len(), 2);
    for s in &group.snapshots {
        assert_eq!(s.group_snapshot_id, group.group_snapshot_id);
    }
    // Idempotent by name.
    let again = h
        .group()
        .create_volume_group_snapshot(request)
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(again, group);

    // Each member restored into a volume of its own, mounted, read.
    let mut restored = Vec::new();
    for (i, s) in group.snapshots.iter().enumerate() {
        let mut req = create_req(&format!("restored-{i}"), 64 * MIB, cap.clone());
        req.volume_content_source = Some(snapshot_source(&s.snapshot_id));
        let id = h.create(req).await.volume_id;
        let staging = h.path(&format!("kubelet/staging/restored-{i}"));
        std::fs::create_dir_all(&staging).unwrap();
        h.node()
            .node_stage_volume(stage_req(&id, &staging, cap.clone()))
            .await
            .unwrap();
        restored.push((id, staging, s.source_volume_id.clone()));
    }
    let seq_of = |source: &str| {
        let (_, staging, _) = restored.iter().find(|(_, _, s)| s == source).unwrap();
        read_seq(&staging.join("seq"))
    };
    let (ra, rb) = (seq_of(&data.id), seq_of(&wal.id));
    println!("writer reached {last}; the group holds data={ra} wal={rb}");
    assert!(ra > 0 && ra < last, "data={ra} last={last}");
    assert!(
        one_instant(ra, rb),
        "data={ra} wal={rb}: no instant of the writer held this pair"
    );

    // Get answers the same group; delete takes every member with it.
    let members: Vec<String> = group
        .snapshots
        .iter()
        .map(|s| s.snapshot_id.clone())
        .collect();
    let got = h
        .group()
        .get_volume_group_snapshot(pb::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: members.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(got, group);
    h.group()
        .delete_volume_group_snapshot(pb::DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: members,
            ..Default::default()
        })
        .await
        .unwrap();
    let left = h
        .controller()
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(left.entries.is_empty(), "{left:?}");

    // A member staged as a raw block device cannot be held: refused, and
    // nothing is made.
    let raw = h.provision("raw", 16 * MIB, block_cap(SNW)).await;
    let refused = h
        .group()
        .create_volume_group_snapshot(pb::CreateVolumeGroupSnapshotRequest {
            name: "group-2".into(),
            source_volume_ids: vec![data.id.clone(), raw.id.clone()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    let left = h
        .controller()
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(left.entries.is_empty(), "{left:?}");

    for (id, staging, _) in &restored {
        h.node()
            .node_unstage_volume(unstage_req(id, staging))
            .await
            .unwrap();
        h.delete_volume(id).await;
    }
    for p in [&data, &wal, &raw] {
        h.teardown(p).await;
    }
    assert!(h.loop_devices().is_empty(), "{:?}", h.loop_devices());
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

/// A single snapshot of a file volume in use is one instant of it, and a
/// clean filesystem: the volume's ext4 is frozen for the copy. Two files
/// of the volume are written in an interleaved pattern (not synced: what
/// the page cache holds must reach the copy too) while CreateSnapshot
/// runs; the snapshot, restored as a raw block volume, passes `e2fsck -fn`
/// with no journal to replay, and its pair of files is one some instant
/// of the writer held.
#[tokio::test]
async fn a_snapshot_of_a_volume_in_use_is_one_instant_and_clean() {
    require_root();
    let h = Harness::start().await;
    let vol = h.provision("live", 64 * MIB, mount_cap("ext4", SNW)).await;
    let (fa, fb) = (vol.target.join("first"), vol.target.join("second"));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = interleave(fa.clone(), fb.clone(), false, stop.clone());
    while read_seq(&fa) < 1000 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let snap = h.snapshot("live-snap", &vol.id).await;
    let after = read_seq(&fa);
    while read_seq(&fa) <= after {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let last = writer.join().unwrap();

    let mut req = create_req("live-restored", 64 * MIB, block_cap(SNW));
    req.volume_content_source = Some(snapshot_source(&snap));
    let restored = h.provision_req(req).await;
    let fsck = std::process::Command::new("e2fsck")
        .args(["-fn"])
        .arg(&restored.target)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&fsck.stdout).to_string() + &String::from_utf8_lossy(&fsck.stderr);
    assert!(
        fsck.status.success(),
        "the snapshot's ext4 is not clean:\n{said}"
    );
    assert!(!said.contains("recover"), "{said}");
    let cat = |file: &str| -> u64 {
        let out = std::process::Command::new("debugfs")
            .args(["-R", &format!("cat /{file}")])
            .arg(&restored.target)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    };
    let (a, b) = (cat("first"), cat("second"));
    println!("writer reached {last}; the snapshot holds first={a} second={b}");
    assert!(a > 0 && a < last, "first={a} last={last}");
    assert!(
        one_instant(a, b),
        "first={a} second={b}: no instant held this pair"
    );
    h.teardown(&restored).await;
    h.controller()
        .delete_snapshot(pb::DeleteSnapshotRequest {
            snapshot_id: snap,
            ..Default::default()
        })
        .await
        .unwrap();
    h.teardown(&vol).await;
    assert!(h.loop_devices().is_empty(), "{:?}", h.loop_devices());
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}
