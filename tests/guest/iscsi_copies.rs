//! The `iscsi` backend's copies: clones beside their source, an lvm store,
//! snapshots of volumes in use and group snapshots.

use super::*;

/// An iscsi clone of an xfs volume mounts beside its source on one node:
/// the copy, made on the controller, still carries the source's UUID (xfs
/// refuses a second mount of one UUID); ControllerPublish hands the node a
/// token, the node gives the copy its own UUID before mounting it, and the
/// next ControllerPublish sees that and sends no token.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_iscsi_clone_mounts_beside_its_source() {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let prefix = "iqn.2026-11.io.ferrovol.copy";
    let config = tgtd.file_store_config(prefix);
    let h = Harness::start_with(Some(&config)).await;
    let cap = mount_cap("xfs", SNW);
    let publish = |id: String| {
        let (h, cap) = (&h, cap.clone());
        async move { h.attach_here(&id, &cap, &HashMap::new()).await }
    };
    let src = h
        .create(create_req("pvc-src", 300 * MIB, cap.clone()))
        .await
        .volume_id;
    let ctx = publish(src.clone()).await;
    assert!(!ctx.contains_key("fsCopy"), "{ctx:?}");
    let staging = h.path("kubelet/staging/src");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            publish_context: ctx,
            ..stage_req(&src, &staging, cap.clone())
        })
        .await
        .unwrap();
    std::fs::write(staging.join("f"), b"written before the clone").unwrap();
    run("sync", &[]);

    let mut req = create_req("pvc-copy", 300 * MIB, cap.clone());
    req.volume_content_source = Some(volume_source(&src));
    let copy = h.create(req).await.volume_id;
    let ctx = publish(copy.clone()).await;
    assert!(ctx.contains_key("fsCopy"), "the node is told: {ctx:?}");
    let copy_staging = h.path("kubelet/staging/copy");
    std::fs::create_dir_all(&copy_staging).unwrap();
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            publish_context: ctx.clone(),
            ..stage_req(&copy, &copy_staging, cap.clone())
        })
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(copy_staging.join("f")).unwrap(),
        b"written before the clone"
    );
    let uuid_of = |dir: &std::path::Path| {
        let dev = run("findmnt", &["-n", "-o", "SOURCE", dir.to_str().unwrap()]);
        run("blkid", &["-p", "-o", "value", "-s", "UUID", dev.trim()])
            .trim()
            .to_string()
    };
    let (a, b) = (uuid_of(&staging), uuid_of(&copy_staging));
    assert!(!a.is_empty() && a != b, "{a} vs {b}");
    // Staged again under the same publish context: not renewed twice.
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            publish_context: ctx,
            ..stage_req(&copy, &copy_staging, cap.clone())
        })
        .await
        .unwrap();
    assert_eq!(uuid_of(&copy_staging), b);
    h.node()
        .node_unstage_volume(unstage_req(&copy, &copy_staging))
        .await
        .unwrap();
    h.detach_here(&copy).await;
    // The controller sees the device's own UUID now: no token any more.
    let ctx = publish(copy.clone()).await;
    assert!(!ctx.contains_key("fsCopy"), "{ctx:?}");
    h.detach_here(&copy).await;

    h.node()
        .node_unstage_volume(unstage_req(&src, &staging))
        .await
        .unwrap();
    h.detach_here(&src).await;
    for id in [copy, src] {
        h.delete_volume(&id).await;
    }
    assert!(!tgtd
        .tgtadm(&["--op", "show", "--mode", "target"])
        .contains("Target "));
}

/// The iscsi backend over an lvm store: the LUN is an LV (activated on the
/// controller, zeroed when deleted), staged on the node over open-iscsi,
/// and grown while unused (the LV extended, tgt reopening the device).
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_iscsi_over_an_lvm_store() {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let _vg = LvmVg::new("fviscsi", 64);
    let prefix = "iqn.2026-11.io.ferrovol.lvm";
    let config = format!(
        "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"{prefix}\"\nportals = [\"{}\"]\n\
         control_port = {}\n[backend.store]\ntype = \"lvm\"\n\
         [[backend.store.device_class]]\nname = \"luns\"\nvolume_group = \"fviscsi\"\n",
        tgtd.portal(),
        tgtd.control_port
    );
    let h = Harness::start_with(Some(&config)).await;
    let cap = mount_cap("ext4", SNW);
    let mut req = create_req("pvc-lun", 24 * MIB, cap.clone());
    req.parameters.insert("deviceClass".into(), "luns".into());
    let vol = h.create(req).await;
    let id = vol.volume_id.clone();
    assert_eq!(id, "iscsi:luns.fv-pvc-lun");
    // LUN 1 is the LV served through its hold device (device-mapper is
    // here): a linear map of all of it.
    let shown = tgtd.tgtadm(&["--op", "show", "--mode", "target"]);
    let hold = shown
        .lines()
        .find_map(|l| l.trim().strip_prefix("Backing store path: /dev/mapper/"))
        .unwrap_or_else(|| panic!("no hold device behind the LUN: {shown}"))
        .to_string();
    assert!(hold.starts_with("fvh-"), "{shown}");
    let lv = run(
        "lvs",
        &[
            "--noheadings",
            "-o",
            "lv_kernel_major,lv_kernel_minor,lv_size",
            "--units",
            "s",
            "--nosuffix",
            "fviscsi/fv-pvc-lun",
        ],
    );
    let f: Vec<&str> = lv.split_whitespace().collect();
    assert_eq!(
        run("dmsetup", &["table", &hold]).trim(),
        format!("0 {} linear {}:{} 0", f[2], f[0], f[1])
    );
    let ctx = h.attach_here(&id, &cap, &HashMap::new()).await;
    let staging = h.path("kubelet/staging/lun");
    let target = h.path("kubelet/pods/lun");
    std::fs::create_dir_all(&staging).unwrap();
    let stage = pb::NodeStageVolumeRequest {
        publish_context: ctx,
        ..stage_req(&id, &staging, cap.clone())
    };
    h.node().node_stage_volume(stage.clone()).await.unwrap();
    h.node()
        .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
        .await
        .unwrap();
    std::fs::write(target.join("f"), b"an LV behind a LUN").unwrap();
    assert_eq!(
        std::fs::read(target.join("f")).unwrap(),
        b"an LV behind a LUN"
    );
    let before = h.total_bytes(&id, &target).await;
    h.unpublish_unstage(&id, &staging, &target).await;
    h.detach_here(&id).await;

    // Unused, it grows: lvextend, then tgt reopens the LV (a block device:
    // its size comes from the kernel), and the node grows the filesystem.
    h.controller()
        .controller_expand_volume(expand_req(&id, 48 * MIB))
        .await
        .unwrap();
    h.attach_here(&id, &cap, &HashMap::new()).await;
    let after = stage_grown(&h, stage, &target, &cap, 48 * MIB).await;
    assert!(after > before + 16 * MIB, "{before} -> {after}");
    assert_eq!(
        std::fs::read(target.join("f")).unwrap(),
        b"an LV behind a LUN"
    );
    h.unpublish_unstage(&id, &staging, &target).await;
    h.detach_here(&id).await;
    h.delete_volume(&id).await;
    let lvs = run("lvs", &["--noheadings", "-o", "lv_name", "fviscsi"]);
    assert!(lvs.trim().is_empty(), "LVs left: {lvs}");
    assert!(!tgtd
        .tgtadm(&["--op", "show", "--mode", "target"])
        .contains("Target "));
    assert!(
        !std::path::Path::new("/dev/mapper").join(&hold).exists(),
        "the hold device was left"
    );
}

/// An iSCSI volume made (from a snapshot or not), published to this node
/// and staged; answers its id and staging path.
pub(crate) async fn iscsi_bring_up(
    h: &Harness,
    name: &str,
    from: Option<&str>,
    cap: &pb::VolumeCapability,
) -> (String, std::path::PathBuf) {
    let mut req = create_req(name, 16 * MIB, cap.clone());
    req.volume_content_source = from.map(snapshot_source);
    let id = h.create_volume(req).await.volume_id;
    let ctx = h.attach_here(&id, cap, &HashMap::new()).await;
    let staging = h.path(&format!("kubelet/staging/{name}"));
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            publish_context: ctx,
            ..stage_req(&id, &staging, cap.clone())
        })
        .await
        .unwrap();
    (id, staging)
}

/// Unstages, unpublishes and deletes what [`iscsi_bring_up`] made.
pub(crate) async fn iscsi_tear_down(
    h: &Harness,
    node_id: &str,
    id: &str,
    staging: &std::path::Path,
) {
    h.node()
        .node_unstage_volume(unstage_req(id, staging))
        .await
        .unwrap();
    h.controller()
        .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
            volume_id: id.into(),
            node_id: node_id.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    h.delete_volume(id).await;
}

/// A single snapshot of an iSCSI volume in use, on a file store
/// ([`snapshot_of_a_volume_in_use_is_held`]; nvmf's in
/// `tests/guest/nvmf.rs`).
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_iscsi_snapshot_of_a_volume_in_use_is_held() {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let config = tgtd.file_store_config("iqn.2026-11.io.ferrovol.held");
    snapshot_of_a_volume_in_use_is_held(&config, "iscsi.held", "pool").await;
}

/// A single snapshot of an exported volume in use, on a file store (the
/// one backend `config` names, its pool `pool` under the test's folder,
/// killed at `kill_point`): the
/// controller holds the host's writes at the volume's hold device
/// around the store's copy, so the snapshot is one instant of the device.
/// Two files of the volume are written in an interleaved pattern (each
/// write synced) while it is taken; each restore (its journal replayed at
/// the mount) holds a pair some instant held, and its filesystem, once
/// unmounted, passes `e2fsck -fn`. Killed at its `held` point (the
/// hold suspended, no copy yet), the driver leaves the writes waiting;
/// the next start resumes the hold and the writes go on, and the CO's
/// retry of the same snapshot succeeds. No hold is left suspended.
pub(crate) async fn snapshot_of_a_volume_in_use_is_held(
    config: &str,
    kill_point: &str,
    pool: &str,
) {
    let mut h = Harness::start_with(Some(config)).await;
    let node_id = h.node_id().await;
    let cap = mount_cap("ext4", SNW);
    let (a, a_dir) = iscsi_bring_up(&h, "held-src", None, &cap).await;
    let (p, q) = (a_dir.join("p"), a_dir.join("q"));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = interleave(p.clone(), q.clone(), true, stop.clone());
    h.wait_until("the writer's first 20 rounds", &|| read_seq(&p) >= 20);
    let one = h.snapshot("held-one", &a).await;
    let suspended = || {
        run(
            "dmsetup",
            &["info", "-c", "--noheadings", "-o", "name,suspended"],
        )
        .lines()
        .filter(|l| l.contains("fvh-") && l.contains("Suspended"))
        .count()
    };
    assert_eq!(suspended(), 0);
    // Killed while the hold is suspended: the writes wait for the start.
    h.env = vec![("FERROVOL_KILL_AT".into(), kill_point.into())];
    h.kill();
    h.spawn().await;
    let died = h
        .controller()
        .create_snapshot(pb::CreateSnapshotRequest {
            name: "held-two".into(),
            source_volume_id: a.clone(),
            ..Default::default()
        })
        .await;
    assert!(died.is_err(), "{died:?}");
    h.kill();
    h.env.clear();
    let killed = std::time::Instant::now();
    assert_eq!(suspended(), 1, "the hold was not suspended at {kill_point}");
    let stalled = read_seq(&p);
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        read_seq(&p) <= stalled + 1,
        "writes went on through a suspended hold"
    );
    let starting = std::time::Instant::now();
    h.spawn().await;
    h.wait_until("the writer going on after the start", &|| {
        read_seq(&p) > stalled + 2
    });
    eprintln!(
        "{kill_point}: the writes waited {} ms, {} ms of them after the driver was started",
        killed.elapsed().as_millis(),
        starting.elapsed().as_millis()
    );
    assert_eq!(suspended(), 0);
    let two = h.snapshot("held-two", &a).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let last = writer.join().expect("the writer met no error");
    for (i, snap) in [one, two].iter().enumerate() {
        let (r, r_dir) = iscsi_bring_up(&h, &format!("held-r{i}"), Some(snap), &cap).await;
        let (rp, rq) = (read_seq(&r_dir.join("p")), read_seq(&r_dir.join("q")));
        assert!(
            rp >= 20 && one_instant(rp, rq),
            "snapshot {i} holds p={rp} q={rq}: no instant held that (the writer reached {last})"
        );
        eprintln!("snapshot {i}: p={rp} q={rq} (the writer reached {last})");
        // Its filesystem, its journal replayed at that mount and
        // unmounted, is clean: the image in the store, checked directly.
        h.node()
            .node_unstage_volume(unstage_req(&r, &r_dir))
            .await
            .unwrap();
        let image = h.path(&format!("{pool}/volumes/held-r{i}.img"));
        run("e2fsck", &["-fn", image.to_str().unwrap()]);
        h.detach_here(&r).await;
        h.delete_volume(&r).await;
        h.controller()
            .delete_snapshot(pb::DeleteSnapshotRequest {
                snapshot_id: snap.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    iscsi_tear_down(&h, &node_id, &a, &a_dir).await;
    let left = run("dmsetup", &["ls"]);
    assert!(!left.contains("fvh-"), "holds left: {left}");
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

/// iSCSI group snapshots of volumes in use, over each store (files, LVs)
/// (nvmf's: `tests/guest/nvmf.rs`, through [`group_snapshots_being_written`]):
/// two volumes published to this node and staged with ext4, written in an
/// interleaved pattern (1, 2, 3, ... to one then the other, each write
/// synced: a flush the initiator sends) while the group is cut. The
/// controller holds the members' writers at their hold devices (dm
/// suspend), snapshots each member in its store, lets them go: the writer
/// never sees an error, and the restored pair is one some single instant
/// held (equal, or the first one ahead by one). No hold is left suspended.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_iscsi_group_snapshots_of_volumes_being_written() {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let _vg = LvmVg::new("fvigroup", 160);
    let prefix = "iqn.2026-11.io.ferrovol.grp";
    let lvm = format!(
        "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"{prefix}\"\nportals = [\"{}\"]\n\
         control_port = {}\n[backend.store]\ntype = \"lvm\"\n\
         [[backend.store.device_class]]\nname = \"luns\"\nvolume_group = \"fvigroup\"\n",
        tgtd.portal(),
        tgtd.control_port
    );
    group_snapshots_being_written(&[("file", tgtd.file_store_config(prefix)), ("lvm", lvm)]).await;
}

/// The group snapshot test above, over each (store, config) given: an
/// exporting backend (iscsi, nvmf) on a file store, then on an lvm one
/// whose device class is `luns` (its volume group the caller's).
pub(crate) async fn group_snapshots_being_written(cases: &[(&str, String)]) {
    for (store, config) in cases {
        let store = *store;
        let h = Harness::start_with(Some(config)).await;
        let cap = mount_cap("ext4", SNW);
        // Made (from a snapshot or not), published here, staged.
        let bring_up = |name: String, from: Option<String>| {
            let (h, cap) = (&h, cap.clone());
            async move {
                let mut req = create_req(&name, 16 * MIB, cap.clone());
                if store == "lvm" {
                    req.parameters.insert("deviceClass".into(), "luns".into());
                }
                req.volume_content_source = from.as_deref().map(snapshot_source);
                let id = h.create(req).await.volume_id;
                let ctx = h.attach_here(&id, &cap, &HashMap::new()).await;
                let staging = h.path(&format!("kubelet/staging/{name}"));
                std::fs::create_dir_all(&staging).unwrap();
                h.node()
                    .node_stage_volume(pb::NodeStageVolumeRequest {
                        publish_context: ctx,
                        ..stage_req(&id, &staging, cap)
                    })
                    .await
                    .unwrap();
                (id, staging)
            }
        };
        let wait_for = |what: &str, done: &dyn Fn() -> bool| h.wait_until(what, done);
        let (a, a_dir) = bring_up(format!("{store}-data"), None).await;
        let (b, b_dir) = bring_up(format!("{store}-wal"), None).await;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = interleave(a_dir.join("seq"), b_dir.join("seq"), true, stop.clone());
        wait_for("the writer's first 20 rounds", &|| {
            read_seq(&a_dir.join("seq")) >= 20
        });
        let req = pb::CreateVolumeGroupSnapshotRequest {
            name: format!("{store}-group"),
            source_volume_ids: vec![a.clone(), b.clone()],
            ..Default::default()
        };
        let group = as_the_snapshotter("CreateVolumeGroupSnapshot", || {
            let (mut g, req) = (h.group(), req.clone());
            async move { g.create_volume_group_snapshot(req).await }
        })
        .await
        .unwrap()
        .group_snapshot
        .unwrap();
        assert_eq!(group.snapshots.len(), 2);
        let suspended = run(
            "dmsetup",
            &["info", "-c", "--noheadings", "-o", "name,suspended"],
        );
        assert!(
            !suspended
                .lines()
                .any(|l| l.contains("fvh-") && l.contains("Suspended")),
            "{suspended}"
        );
        let after = read_seq(&a_dir.join("seq"));
        wait_for("the writer going on", &|| {
            read_seq(&a_dir.join("seq")) > after + 5
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let last = writer.join().expect("the writer met no error");
        let mut restored = Vec::new();
        let mut held = std::collections::BTreeMap::new();
        for s in &group.snapshots {
            let which = if s.source_volume_id == a {
                "data"
            } else {
                "wal"
            };
            let (id, dir) =
                bring_up(format!("{store}-r-{which}"), Some(s.snapshot_id.clone())).await;
            held.insert(which, read_seq(&dir.join("seq")));
            restored.push((id, dir));
        }
        let (la, lb) = (held["data"], held["wal"]);
        assert!(
            lb >= 20 && one_instant(la, lb),
            "{store}: the group holds data={la} wal={lb}: no single instant held that \
             (the writer reached {last})"
        );
        eprintln!("{store}: writer reached {last}; the group holds data={la} wal={lb}");
        for (id, dir) in restored
            .iter()
            .chain(&[(a.clone(), a_dir.clone()), (b.clone(), b_dir.clone())])
        {
            h.node()
                .node_unstage_volume(unstage_req(id, dir))
                .await
                .unwrap();
            h.detach_here(id).await;
        }
        for (id, _) in &restored {
            h.delete_volume(id).await;
        }
        h.delete_group(&group.group_snapshot_id, Default::default())
            .await;
        for id in [a, b] {
            h.delete_volume(&id).await;
        }
        let left = run("dmsetup", &["ls"]);
        assert!(
            !left.contains("fvh-"),
            "{store}: holds left: {left}; the driver's log:\n{}",
            h.log()
        );
        assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    }
}
