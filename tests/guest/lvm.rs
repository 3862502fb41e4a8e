//! The `lvm` backend on a real device-mapper: lifecycles of thick and thin
//! volumes, old data never shown, growth on the node.

use super::*;

#[test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
fn guest_lvm_fixture_activates_and_mounts() {
    require_guest();
    let vg = LvmVg::new("fvtest", 128);
    run(
        "lvcreate",
        &["-q", "-y", "-L", "32M", "-n", "lv0", &vg.name],
    );
    let dev = format!("/dev/{}/lv0", vg.name);
    wait_for("the LV's device node", Duration::from_secs(30), || {
        std::path::Path::new(&dev).exists()
    });
    let attrs = run(
        "lvs",
        &["--noheadings", "-o", "lv_attr", &format!("{}/lv0", vg.name)],
    );
    assert_eq!(
        attrs.trim().chars().nth(4),
        Some('a'),
        "LV not active: {attrs}"
    );
    run("mkfs.ext4", &["-q", "-F", &dev]);
    let mnt = vg.dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    run("mount", &[&dev, mnt.to_str().unwrap()]);
    std::fs::write(mnt.join("f"), b"on an LV").unwrap();
    run("umount", &[mnt.to_str().unwrap()]);
    run("lvremove", &["-q", "-y", &format!("{}/lv0", vg.name)]);
}

/// The lvm backend's whole life on a real device-mapper: for a thick and a
/// thin device class: create, stage, publish, write, grow online, snapshot,
/// restore into a new volume and read the data back, tear down.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_lvm_backend_full_lifecycle() {
    require_guest();
    let vg = LvmVg::new("fvguest", 768);
    vg.thin_pool("pool", "256M", &[]);
    let config = "[[backend]]\ntype = \"lvm\"\n\
        [[backend.device_class]]\nname = \"thick\"\nvolume_group = \"fvguest\"\n\
        [[backend.device_class]]\nname = \"thin\"\nvolume_group = \"fvguest\"\nthin_pool = \"pool\"\n";
    let h = Harness::start_with(Some(config)).await;
    let (mut c, mut n) = (h.controller(), h.node());
    let cap = mount_cap("ext4", SNW);
    for class in ["thick", "thin"] {
        let params = HashMap::from([("deviceClass".to_string(), class.to_string())]);
        let mut req = create_req(&format!("pvc-{class}"), 64 * MIB, cap.clone());
        req.parameters = params.clone();
        let vol = h.create(req).await;
        assert_eq!(vol.volume_id, format!("lvm:{class}.fv-pvc-{class}"));
        let staging = h.path(&format!("kubelet/staging/{class}"));
        std::fs::create_dir_all(&staging).unwrap();
        n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
            .await
            .unwrap();
        let target = h.path(&format!("kubelet/pods/{class}"));
        n.node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &target,
            cap.clone(),
            false,
        ))
        .await
        .unwrap();
        std::fs::write(target.join("data"), format!("written on {class}")).unwrap();
        let stats_req = pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: target.display().to_string(),
            staging_target_path: staging.display().to_string(),
        };
        let before = n
            .node_get_volume_stats(stats_req.clone())
            .await
            .unwrap()
            .into_inner();
        assert!(!before.volume_condition.unwrap().abnormal);

        // Grow online.
        let range = Some(pb::CapacityRange {
            required_bytes: 128 * MIB,
            limit_bytes: 0,
        });
        let e = c
            .controller_expand_volume(pb::ControllerExpandVolumeRequest {
                volume_id: vol.volume_id.clone(),
                capacity_range: range,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(e.capacity_bytes, 128 * MIB);
        n.node_expand_volume(pb::NodeExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: target.display().to_string(),
            staging_target_path: staging.display().to_string(),
            capacity_range: range,
            ..Default::default()
        })
        .await
        .unwrap();
        let after = n
            .node_get_volume_stats(stats_req.clone())
            .await
            .unwrap()
            .into_inner();
        assert!(
            after.usage[0].total > before.usage[0].total + 50 * MIB,
            "{class}: no online growth"
        );

        // Snapshot, and a new volume restored from it.
        run("sync", &[]);
        let snap = h
            .snapshot_made(&format!("snap-{class}"), &vol.volume_id)
            .await;
        assert_eq!(snap.size_bytes, 128 * MIB);
        // The snapshot carries its own tags and none of its origin's: the
        // driver takes none off after lvcreate, so an lvm that copied an
        // origin's tags onto its snapshots would fail here.
        let snap_lv = format!("fvguest/{}", snap.snapshot_id.split_once('.').unwrap().1);
        let tags = vg.lvm("lvs", &["--noheadings", "-o", "lv_tags", &snap_lv]);
        let mut tags: Vec<&str> = tags.trim().split(',').collect();
        tags.sort();
        let time = tags.iter().position(|t| t.starts_with("ferrovol-time:"));
        assert!(
            time.is_some(),
            "{class}: no time tag on {snap_lv}: {tags:?}"
        );
        tags.remove(time.unwrap());
        let size = format!("ferrovol-size:{}", 128 * MIB);
        let name = format!("ferrovol-name:snap-{class}");
        let own_class = format!("ferrovol-class:{class}");
        let source = format!("ferrovol-source:fv-pvc-{class}");
        let mut own = vec!["ferrovol", &own_class, &name, &size, &source];
        own.sort();
        assert_eq!(tags, own, "{class}: the tags of {snap_lv}");
        let mut restore = create_req(&format!("restored-{class}"), 0, cap.clone());
        restore.parameters = params.clone();
        restore.volume_content_source = Some(snapshot_source(&snap.snapshot_id));
        let restored = h.create(restore).await;
        assert_eq!(restored.capacity_bytes, 128 * MIB);
        let staging2 = h.path(&format!("kubelet/staging/{class}-r"));
        std::fs::create_dir_all(&staging2).unwrap();
        n.node_stage_volume(stage_req(&restored.volume_id, &staging2, cap.clone()))
            .await
            .unwrap();
        let target2 = h.path(&format!("kubelet/pods/{class}-r"));
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
            std::fs::read_to_string(target2.join("data")).unwrap(),
            format!("written on {class}")
        );

        // A clone of the original carries its data too (staged and read,
        // then removed).
        let mut clone = create_req(&format!("clone-{class}"), 0, cap.clone());
        clone.parameters = params.clone();
        clone.volume_content_source = Some(volume_source(&vol.volume_id));
        let cloned = h.create(clone).await;
        assert_eq!(cloned.capacity_bytes, 128 * MIB);
        let staging3 = h.path(&format!("kubelet/staging/{class}-c"));
        std::fs::create_dir_all(&staging3).unwrap();
        n.node_stage_volume(stage_req(&cloned.volume_id, &staging3, cap.clone()))
            .await
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(staging3.join("data")).unwrap(),
            format!("written on {class}")
        );
        n.node_unstage_volume(unstage_req(&cloned.volume_id, &staging3))
            .await
            .unwrap();
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: cloned.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();

        // Tear down.
        for (id, t, s) in [
            (&vol.volume_id, &target, &staging),
            (&restored.volume_id, &target2, &staging2),
        ] {
            n.node_unpublish_volume(unpublish_req(id, t)).await.unwrap();
            n.node_unstage_volume(unstage_req(id, s)).await.unwrap();
        }
        // What lvm's udev rule runs once a group's disks are all seen (at
        // boot, or late, when udev is behind): it leaves unstaged volumes
        // alone.
        vg.lvm("vgchange", &["-aay", "fvguest"]);
        for lv in [
            format!("fvguest/fv-pvc-{class}"),
            format!("fvguest/fv-restored-{class}"),
        ] {
            let attrs = vg.lvm("lvs", &["--noheadings", "-o", "lv_attr", &lv]);
            assert_ne!(
                attrs.trim().chars().nth(4),
                Some('a'),
                "{class}: {lv} active after its unstage and an autoactivation: {attrs}"
            );
        }
        if class == "thick" {
            // A classic snapshot depends on its origin: the origin cannot go first.
            let r = c
                .delete_volume(pb::DeleteVolumeRequest {
                    volume_id: vol.volume_id.clone(),
                    ..Default::default()
                })
                .await;
            assert_eq!(code(&r), tonic::Code::FailedPrecondition);
        }
        c.delete_snapshot(pb::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        for id in [&vol.volume_id, &restored.volume_id] {
            c.delete_volume(pb::DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        }
    }
    assert!(c
        .list_volumes(pb::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .is_empty());
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

/// A recycled extent never shows its old contents: a new LV on the space a
/// deleted one used starts empty (and a control round without ferrovol
/// shows the old filesystem on the same extents).
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_lvm_new_volume_never_exposes_old_data() {
    require_guest();
    let vg = LvmVg::new("fvwipe", 64);
    let config = "[[backend]]\ntype = \"lvm\"\n[[backend.device_class]]\nname = \"d\"\nvolume_group = \"fvwipe\"\n";
    let h = Harness::start_with(Some(config)).await;
    // Leave a filesystem behind on the VG's extents.
    vg.lvm(
        "lvcreate",
        &["-q", "-y", "-L", "32M", "-n", "old", "fvwipe"],
    );
    run("mkfs.ext4", &["-q", "-F", "/dev/fvwipe/old"]);
    vg.lvm("lvremove", &["-q", "-y", "fvwipe/old"]);
    let (mut c, mut n) = (h.controller(), h.node());
    let cap = block_cap(SNW);
    let vol = h.create(create_req("fresh", 32 * MIB, cap.clone())).await;
    let staging = h.path("kubelet/staging/w");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let target = h.path("kubelet/pods/w");
    n.node_publish_volume(publish_req(
        &vol.volume_id,
        &staging,
        &target,
        cap.clone(),
        false,
    ))
    .await
    .unwrap();
    let probe = std::process::Command::new("blkid")
        .args(["-p", target.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(
        probe.status.code(),
        Some(2),
        "old signature visible: {}",
        String::from_utf8_lossy(&probe.stdout)
    );
    n.node_unpublish_volume(unpublish_req(&vol.volume_id, &target))
        .await
        .unwrap();
    n.node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();

    // The control: the same recycling without ferrovol (an LV made with
    // no wiping and no zeroing) does show the old filesystem, so the check
    // above could have failed.
    vg.lvm(
        "lvcreate",
        &["-q", "-y", "-L", "32M", "-n", "old2", "fvwipe"],
    );
    run("mkfs.ext4", &["-q", "-F", "/dev/fvwipe/old2"]);
    vg.lvm("lvremove", &["-q", "-y", "fvwipe/old2"]);
    vg.lvm(
        "lvcreate",
        &[
            "-q", "-y", "-W", "n", "-Z", "n", "-L", "32M", "-n", "ctl", "fvwipe",
        ],
    );
    let probe = std::process::Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE", "/dev/fvwipe/ctl"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&probe.stdout).trim(),
        "ext4",
        "the control round saw no old data: the check above proves nothing"
    );
    vg.lvm("lvremove", &["-q", "-y", "fvwipe/ctl"]);
}

/// Thick LVs and classic snapshots are zeroed when they are deleted: an old
/// tenant fills its volume with a pattern, snapshots it and overwrites part
/// of it (so the snapshot's own extents hold copies of the pattern), and
/// both are deleted; a new block volume on the same extents reads back no
/// byte of either.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_lvm_deleted_volumes_leave_no_data_on_their_extents() {
    require_guest();
    // Room for 32 MiB: the volume (24 MiB) and its snapshot (25%, rounded
    // up to 8 MiB) now, the new tenant on the same extents after.
    let _vg = LvmVg::new("fvrecycle", 40);
    let config = "[[backend]]\ntype = \"lvm\"\n[[backend.device_class]]\nname = \"d\"\nvolume_group = \"fvrecycle\"\n";
    let h = Harness::start_with(Some(config)).await;
    let (old, dev) = block_volume(&h, "old-tenant", "d", 24 * MIB).await;
    fill(&dev, 0, 24 << 20, 0xAB);
    let snap = h.snapshot_made("old-snap", &old).await;
    // Overwriting copies the old blocks into the snapshot's extents.
    fill(&dev, 0, 4 << 20, 0xCD);
    h.controller()
        .delete_snapshot(pb::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id,
            ..Default::default()
        })
        .await
        .unwrap();
    drop_block_volume(&h, "old-tenant", &old).await;

    let (new, dev) = block_volume(&h, "new-tenant", "d", 32 * MIB).await;
    assert_eq!(std::fs::metadata(&dev).map(|_| ()).ok(), Some(()));
    let leaked = count_bytes(&dev, &[0xAB, 0xCD]);
    assert_eq!(
        leaked, 0,
        "{leaked} bytes of the old tenant's data are readable"
    );
    drop_block_volume(&h, "new-tenant", &new).await;
}

/// In a thin pool, chunks freed by a deleted volume go to the next one; the
/// pool zeroes a chunk when it hands it out, so a new tenant that writes a
/// little into each chunk reads zeros around its writes. The driver refuses
/// a pool that does not zero; a class that opts out (zero_on_delete =
/// false) is the control: there the old data shows, so this test sees it
/// when it is there.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_lvm_thin_volumes_never_show_freed_chunks() {
    require_guest();
    let vg = LvmVg::new("fvthinrc", 48);
    // 64 KiB chunks, 16 MiB of data: a second volume gets the first one's.
    vg.thin_pool("pool", "16m", &["--chunksize", "64k", "--zero", "y"]);
    let config = "[[backend]]\ntype = \"lvm\"\n\
        [[backend.device_class]]\nname = \"t\"\nvolume_group = \"fvthinrc\"\nthin_pool = \"pool\"\n\
        [[backend.device_class]]\nname = \"optout\"\nvolume_group = \"fvthinrc\"\nthin_pool = \"pool\"\nzero_on_delete = false\n";
    let h = Harness::start_with(Some(config)).await;
    const SIZE: i64 = 16 * MIB;
    const CHUNK: u64 = 64 << 10;

    // One round: an old tenant fills its volume and goes; a new one writes
    // 4 KiB at the start of every chunk and reads everything back. Returns
    // how many bytes of the old pattern it saw.
    async fn round(h: &Harness, class: &str, tag: &str) -> usize {
        let old_name = format!("old-{tag}");
        let (old, dev) = block_volume(h, &old_name, class, SIZE).await;
        fill(&dev, 0, SIZE as usize, 0xAB);
        drop_block_volume(h, &old_name, &old).await;
        let new_name = format!("new-{tag}");
        let (new, dev) = block_volume(h, &new_name, class, SIZE).await;
        for chunk in 0..(SIZE as u64 / CHUNK) {
            fill(&dev, chunk * CHUNK, 4096, 0x11);
        }
        let seen = count_bytes(&dev, &[0xAB]);
        drop_block_volume(h, &new_name, &new).await;
        seen
    }

    let leaked = round(&h, "t", "zeroing").await;
    assert_eq!(
        leaked, 0,
        "{leaked} bytes of the old tenant's data are readable"
    );

    // Zeroing off: the zeroing class refuses to create in the pool...
    vg.lvm("lvchange", &["-q", "--zero", "n", "fvthinrc/pool"]);
    let mut req = create_req("refused", SIZE, block_cap(SNW));
    req.parameters.insert("deviceClass".into(), "t".into());
    let r = h.controller().create_volume(req).await;
    assert_eq!(code(&r), tonic::Code::FailedPrecondition, "{r:?}");
    // ...and where a class opts out, the old data is there to be seen.
    let shown = round(&h, "optout", "control").await;
    assert!(
        shown > 0,
        "the control round saw no old data: the check above proves nothing"
    );
}

/// Node-local expansion on lvm without controller expansion: the node
/// grows the LV (lvextend) and then the mounted ext4, as kubelet asks it
/// to when the resizer finds no ControllerExpandVolume.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_lvm_volume_grows_on_the_node() {
    require_guest();
    let _vg = LvmVg::new("fvnodegrow", 256);
    let config = "[[backend]]\ntype = \"lvm\"\n[[backend.device_class]]\nname = \"d\"\nvolume_group = \"fvnodegrow\"\n";
    let h = Harness::start_with_env(
        Some(config),
        &[("FERROVOL_NO_CONTROLLER_EXPANSION", "true")],
    )
    .await;
    let cap = mount_cap("ext4", SNW);
    let p = h.provision("pvc-nodegrow", 64 * MIB, cap.clone()).await;
    let before = h.total_bytes(&p.id, &p.target).await;
    let grown = h
        .node()
        .node_expand_volume(pb::NodeExpandVolumeRequest {
            volume_id: p.id.clone(),
            volume_path: p.target.display().to_string(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 128 * MIB,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 128 * MIB);
    let lv = run(
        "lvs",
        &[
            "--noheadings",
            "--units",
            "b",
            "--nosuffix",
            "-o",
            "lv_size",
            "fvnodegrow",
        ],
    );
    assert_eq!(lv.trim().parse::<i64>().unwrap(), 128 * MIB);
    let after = h.total_bytes(&p.id, &p.target).await;
    assert!(after > before + 48 * MIB, "{before} -> {after}");
    h.teardown(&p).await;
}
