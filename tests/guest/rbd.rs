//! The `rbd` backend: krbd maps against the guest's Ceph, changed blocks,
//! group snapshots of mapped and unmapped images.

use super::*;

/// The rbd backend with krbd: a mounted volume and a raw block one, data
/// written before a snapshot read back from a restore and from a clone, a
/// driver restart between stage and unstage (the mapping is found, not
/// made twice), expansion seen by the node, the fencing refusal for a
/// node the volume is not published to, and nothing left mapped.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_rbd_backend_full_lifecycle() {
    require_guest();
    let cluster = CephCluster::shared();
    let config = cluster.backend_config("guest");
    let mut h = Harness::start_with(Some(&config)).await;
    let secrets = cluster.secrets();
    let mapped = || -> usize {
        let out = run("rbd", &["device", "list", "--format", "json"]);
        serde_json::from_str::<Vec<serde_json::Value>>(if out.trim().is_empty() {
            "[]"
        } else {
            &out
        })
        .unwrap()
        .len()
    };
    let cap = mount_cap("ext4", SNW);
    let create = |name: &str, source: Option<pb::volume_content_source::Type>| {
        let mut r = create_req(name, 32 * MIB, cap.clone());
        r.secrets = secrets.clone();
        r.volume_content_source = source.map(|t| pb::VolumeContentSource { r#type: Some(t) });
        r
    };
    let mut first = create("pvc-rbd", None);
    first.parameters = HashMap::from([("mkfsOptions".to_string(), "-L rbdvol".to_string())]);
    let vol = h.create(first).await;
    let vol_context = vol.volume_context.clone();
    let id = vol.volume_id;
    assert_eq!(
        vol_context.get("mkfsOptions").map(String::as_str),
        Some("-L rbdvol")
    );
    let vol_id_for_context = id.clone();
    let publish =
        |id: &str, node: &str, cap: pb::VolumeCapability| pb::ControllerPublishVolumeRequest {
            volume_id: id.into(),
            node_id: node.into(),
            volume_capability: Some(cap),
            secrets: secrets.clone(),
            ..Default::default()
        };
    // The node gets each volume's context, as kubelet passes the PV's
    // volume attributes.
    let stage = |id: &str, staging: &std::path::Path, cap: pb::VolumeCapability| {
        pb::NodeStageVolumeRequest {
            secrets: secrets.clone(),
            volume_context: if id == vol_id_for_context {
                vol_context.clone()
            } else {
                HashMap::new()
            },
            ..stage_req(id, staging, cap)
        }
    };

    // Published to another node: this node refuses to map it.
    h.controller()
        .controller_publish_volume(publish(&id, "other-node/rbd", cap.clone()))
        .await
        .unwrap();
    let staging = h.path("kubelet/staging/rbd");
    let target = h.path("kubelet/pods/rbd");
    std::fs::create_dir_all(&staging).unwrap();
    let r = h
        .node()
        .node_stage_volume(stage(&id, &staging, cap.clone()))
        .await;
    assert_eq!(code(&r), tonic::Code::FailedPrecondition, "{r:?}");
    assert_eq!(mapped(), 0);
    h.controller()
        .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: "other-node/rbd".into(),
            secrets: secrets.clone(),
        })
        .await
        .unwrap();
    h.controller()
        .controller_publish_volume(publish(&id, "test-node/rbd", cap.clone()))
        .await
        .unwrap();
    h.node()
        .node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .unwrap();
    h.node()
        .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
        .await
        .unwrap();
    std::fs::write(target.join("data"), b"before the snapshot").unwrap();
    run("sync", &[]);
    // The class's mkfs options reached mkfs.
    let source = run(
        "findmnt",
        &["-n", "-o", "SOURCE", staging.to_str().unwrap()],
    );
    let label = run("blkid", &["-s", "LABEL", "-o", "value", source.trim()]);
    assert_eq!(label.trim(), "rbdvol");
    let uuid_of = |dev: &str| {
        run("blkid", &["-p", "-s", "UUID", "-o", "value", dev.trim()])
            .trim()
            .to_string()
    };
    let source_uuid = uuid_of(&source);
    assert!(!source_uuid.is_empty());

    // A snapshot; data after it must not show in restores.
    let snap = h
        .controller()
        .create_snapshot(pb::CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: "snap-rbd".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    std::fs::write(target.join("data"), b"after the snapshot!").unwrap();

    // Expansion seen by the node.
    let before = h.total_bytes(&id, &target).await;
    h.grow_staged(&id, &target, Some((&staging, &cap)), &secrets, 64 * MIB)
        .await;
    let after = h.total_bytes(&id, &target).await;
    assert!(after > before + 16 * MIB, "{before} -> {after}");

    // A driver restart between stage and unstage.
    h.kill();
    h.spawn().await;
    h.node()
        .node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .unwrap();
    assert_eq!(mapped(), 1, "mapped twice");
    h.unpublish_unstage(&id, &staging, &target).await;
    assert_eq!(mapped(), 0);
    h.node()
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();

    // The restore and the clone read what was there at each moment.
    let restored = h
        .create(create(
            "pvc-restored",
            Some(pb::volume_content_source::Type::Snapshot(
                pb::volume_content_source::SnapshotSource {
                    snapshot_id: snap.snapshot_id.clone(),
                },
            )),
        ))
        .await
        .volume_id;
    let cloned = h
        .create(create(
            "pvc-cloned",
            Some(pb::volume_content_source::Type::Volume(
                pb::volume_content_source::VolumeSource {
                    volume_id: id.clone(),
                },
            )),
        ))
        .await
        .volume_id;
    for (v, want) in [
        (&restored, &b"before the snapshot"[..]),
        (&cloned, &b"after the snapshot!"[..]),
    ] {
        let st = h.path(&format!("kubelet/staging/{}", &v[v.len() - 8..]));
        let tg = h.path(&format!("kubelet/pods/{}", &v[v.len() - 8..]));
        std::fs::create_dir_all(&st).unwrap();
        h.node()
            .node_stage_volume(stage(v, &st, cap.clone()))
            .await
            .unwrap();
        h.node()
            .node_publish_volume(publish_req(v, &st, &tg, cap.clone(), false))
            .await
            .unwrap();
        assert_eq!(std::fs::read(tg.join("data")).unwrap(), want, "{v}");
        // A copy is not published anywhere, whatever its source was: no
        // fencing key came along with the clone.
        let image = format!("rbd/{}", v.rsplit('.').next().unwrap());
        let meta = cluster.rbd(&["image-meta", "list", &image, "--format", "json"]);
        assert!(!meta.contains("ferrovol.node."), "{v}: {meta}");
        // A copy gets a filesystem UUID of its own at its first stage.
        let dev = run("findmnt", &["-n", "-o", "SOURCE", st.to_str().unwrap()]);
        let own = uuid_of(&dev);
        assert!(!own.is_empty() && own != source_uuid, "{v}: {own}");
        h.unpublish_unstage(v, &st, &tg).await;
    }

    // A raw block volume, published as the device.
    let bcap = block_cap(SNW);
    let mut breq = create_req("pvc-rbd-block", 8 * MIB, bcap.clone());
    breq.secrets = secrets.clone();
    let bid = h.create(breq).await.volume_id;
    let bst = h.path("kubelet/staging/rbd-block");
    let btg = h.path("kubelet/pods/rbd-block");
    std::fs::create_dir_all(&bst).unwrap();
    h.node()
        .node_stage_volume(stage(&bid, &bst, bcap.clone()))
        .await
        .unwrap();
    h.node()
        .node_publish_volume(publish_req(&bid, &bst, &btg, bcap.clone(), false))
        .await
        .unwrap();
    {
        use std::io::{Read, Seek, Write};
        let mut dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&btg)
            .unwrap();
        dev.write_all(b"raw rbd").unwrap();
        dev.sync_all().unwrap();
        dev.seek(std::io::SeekFrom::Start(0)).unwrap();
        let mut back = [0u8; 7];
        dev.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"raw rbd");
    }
    // Mapped (a watcher): the delete is refused.
    let r = h
        .controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: bid.clone(),
            secrets: secrets.clone(),
        })
        .await;
    assert_eq!(code(&r), tonic::Code::FailedPrecondition, "{r:?}");
    h.unpublish_unstage(&bid, &bst, &btg).await;
    assert_eq!(mapped(), 0);

    for v in [&id, &restored, &cloned, &bid] {
        h.controller()
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: v.to_string(),
                secrets: secrets.clone(),
            })
            .await
            .unwrap();
    }
    h.controller()
        .delete_snapshot(pb::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            secrets: secrets.clone(),
        })
        .await
        .unwrap();
    assert_eq!(cluster.rbd(&["ls", "rbd"]).trim(), "");
}

/// Changed block tracking of rbd snapshots on the librbd client (its
/// diff_iterate2; the `rbd diff` command line client is checked against the
/// same kind of writes on the host, `tests/rbd_host.rs`, and here too with
/// `FERROVOL_SANITY=full`: the command line costs seconds a call under
/// TCG, and the two clients took almost ten minutes): a raw block
/// volume mapped here by the kernel client, written between two snapshots
/// (see [`changed_blocks_backup`]); exact within the objects the base
/// snapshot held, from an object's start for one first written after. The
/// snapshot's cut stays on the volume while the snapshot lives, and goes
/// with it; the delta of two volumes' snapshots is INVALID_ARGUMENT.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_rbd_changed_blocks() {
    require_guest();
    let cluster = CephCluster::shared();
    let clients: &[&str] = match std::env::var("FERROVOL_SANITY").as_deref() {
        Ok("full") => &["librbd", "cli"],
        _ => &["librbd"],
    };
    for client in clients {
        let config = format!("{}client = \"{client}\"\n", cluster.backend_config("guest"));
        let h = Harness::start_with(Some(&config)).await;
        let cap = block_cap(SNW);
        let bring_up = |name: String, from: Option<String>| {
            let mut req = create_req(&format!("{client}-{name}"), 16 * MIB, cap.clone());
            req.secrets = cluster.secrets();
            req.volume_content_source = from.as_deref().map(snapshot_source);
            h.provision_attached(req)
        };
        // Exact within an object (4 MiB) the base snapshot held; an object
        // first written after it, and every object of the allocated walk,
        // comes from its start to its last write's end (librbd knows no
        // finer for an object without a clone).
        let m = MIB as u64;
        let expected = Expected {
            allocated: vec![(0, m + 4096)],
            delta: vec![(m, 4096), (4 * m, m + 4096)],
        };
        let (vol, snaps, copied) = changed_blocks_backup(&h, "cbt-rbd", expected, bring_up).await;
        eprintln!("{client}: the backup copied {copied} bytes");
        let image = |id: &str| format!("rbd/{}", id.rsplit('.').next().unwrap());
        let cuts = cluster.rbd(&["snap", "ls", &image(&vol.id)]);
        assert_eq!(cuts.matches("tmp-tmp-fvs-").count(), 2, "{cuts}");

        let other = bring_up("cbt-other".into(), None).await;
        let o1 = h
            .snapshot(&format!("{client}-cbt-other-1"), &other.id)
            .await;
        let e = h
            .metadata()
            .get_metadata_delta(pb::GetMetadataDeltaRequest {
                base_snapshot_id: snaps[0].clone(),
                target_snapshot_id: o1.clone(),
                secrets: cluster.secrets(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

        for s in snaps.into_iter().chain([o1]) {
            h.controller()
                .delete_snapshot(pb::DeleteSnapshotRequest {
                    snapshot_id: s,
                    secrets: cluster.secrets(),
                })
                .await
                .unwrap();
        }
        let cuts = cluster.rbd(&["snap", "ls", &image(&vol.id)]);
        assert!(!cuts.contains("tmp-tmp-fvs-"), "{cuts}");
        for p in [&vol, &other] {
            h.teardown(p).await;
        }
        assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    }
    let left = cluster.rbd(&["ls", "rbd"]);
    assert!(left.trim().is_empty(), "{left}");
}

/// rbd group snapshots with kernel clients: two volumes mapped and written
/// here (1, 2, 3, ... to one then the other, each write synced) are cut as
/// a group while the writer runs (an rbd group's snapshot: the kernel
/// clients hand over their locks and wait), the writer never sees an
/// error, and the restored pair is one some single instant held: equal, or
/// the first one ahead by one. Once both are unstaged a second group is
/// cut the other way (locks held, clones) and restores the last number.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_rbd_group_snapshots_of_mapped_and_unmapped_volumes() {
    require_guest();
    let cluster = CephCluster::shared();
    let config = cluster.backend_config("guest");
    let h = Harness::start_with(Some(&config)).await;
    let secrets = cluster.secrets();
    let cap = mount_cap("ext4", SNW);
    let node = h.node_id().await;
    // Made (from a snapshot or not), published here, staged.
    let bring_up = |name: String, from: Option<String>| {
        let (h, secrets, cap, node) = (&h, secrets.clone(), cap.clone(), node.clone());
        async move {
            let mut req = create_req(&name, 32 * MIB, cap.clone());
            req.secrets = secrets.clone();
            req.parameters
                .insert("imageFeatures".into(), "layering,exclusive-lock".into());
            req.volume_content_source = from.as_deref().map(snapshot_source);
            let id = h.create(req).await.volume_id;
            h.controller()
                .controller_publish_volume(pb::ControllerPublishVolumeRequest {
                    volume_id: id.clone(),
                    node_id: node,
                    volume_capability: Some(cap.clone()),
                    secrets: secrets.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
            let staging = h.path(&format!("kubelet/staging/{name}"));
            std::fs::create_dir_all(&staging).unwrap();
            h.node()
                .node_stage_volume(pb::NodeStageVolumeRequest {
                    secrets: secrets.clone(),
                    ..stage_req(&id, &staging, cap)
                })
                .await
                .unwrap();
            (id, staging)
        }
    };
    let (a, a_dir) = bring_up("grp-data".into(), None).await;
    let (b, b_dir) = bring_up("grp-wal".into(), None).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = interleave(a_dir.join("seq"), b_dir.join("seq"), true, stop.clone());
    // A second writer, on `a` alone, for its single snapshot.
    let alone = interleave(a_dir.join("p"), a_dir.join("q"), true, stop.clone());
    let read = |p: &std::path::Path| read_seq(p);
    let wait_for = |what: &str, done: &dyn Fn() -> bool| h.wait_until(what, done);
    wait_for("the writer's first 20 rounds", &|| {
        read(&a_dir.join("seq")) >= 20 && read(&a_dir.join("q")) >= 20
    });
    let group_of = |name: &str| pb::CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: vec![a.clone(), b.clone()],
        secrets: secrets.clone(),
        ..Default::default()
    };
    let live = h
        .group()
        .create_volume_group_snapshot(group_of("rbd-live"))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(live.snapshots.len(), 2);
    let single = h.snapshot_with("rbd-single", &a, secrets.clone()).await;
    let after = read(&a_dir.join("seq"));
    wait_for("the writer going on", &|| {
        read(&a_dir.join("seq")) > after + 5
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let last = writer.join().expect("the writer met no error");
    let last_alone = alone.join().expect("the second writer met no error");
    // The single snapshot restores to a pair one instant held, and its
    // filesystem (the journal replayed at the stage's mount, then
    // unmounted) is clean.
    {
        let (r, r_dir) = bring_up("grp-single".into(), Some(single.clone())).await;
        let (rp, rq) = (read(&r_dir.join("p")), read(&r_dir.join("q")));
        assert!(
            rq >= 20 && one_instant(rp, rq),
            "the single snapshot holds p={rp} q={rq}: no instant held that \
             (the writer reached {last_alone})"
        );
        eprintln!("single snapshot holds p={rp} q={rq} (the writer reached {last_alone})");
        h.node()
            .node_unstage_volume(unstage_req(&r, &r_dir))
            .await
            .unwrap();
        let c = cluster.conf.to_str().unwrap();
        let dev = run("rbd", &["-c", c, "map", "rbd/fv-grp-single"]);
        let dev = dev.trim();
        let checked = std::process::Command::new("e2fsck")
            .args(["-fn", dev])
            .output()
            .unwrap();
        run("rbd", &["-c", c, "unmap", dev]);
        assert!(
            checked.status.success(),
            "the single snapshot's restore is not clean: {}",
            String::from_utf8_lossy(&checked.stdout)
        );
        h.controller()
            .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                volume_id: r.clone(),
                node_id: node.clone(),
                secrets: secrets.clone(),
            })
            .await
            .unwrap();
        h.controller()
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: r,
                secrets: secrets.clone(),
            })
            .await
            .unwrap();
        h.controller()
            .delete_snapshot(pb::DeleteSnapshotRequest {
                snapshot_id: single,
                secrets: secrets.clone(),
            })
            .await
            .unwrap();
    }
    for (id, dir) in [(&a, &a_dir), (&b, &b_dir)] {
        h.node()
            .node_unstage_volume(unstage_req(id, dir))
            .await
            .unwrap();
    }
    // No group or group snapshot is left on the sources.
    let c = cluster.conf.to_str().unwrap().to_string();
    assert_eq!(run("rbd", &["-c", &c, "group", "ls", "rbd"]).trim(), "");
    for image in ["fv-grp-data", "fv-grp-wal"] {
        let snaps = run(
            "rbd",
            &["-c", &c, "snap", "ls", "--all", &format!("rbd/{image}")],
        );
        assert!(!snaps.contains("group"), "{image}: {snaps}");
    }
    let group = h
        .group()
        .create_volume_group_snapshot(group_of("rbd-group"))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(group.snapshots.len(), 2);
    let mut restored = std::collections::BTreeMap::new();
    for (g, tag) in [(&live, "live"), (&group, "idle")] {
        for s in &g.snapshots {
            let which = if s.source_volume_id == a {
                "data"
            } else {
                "wal"
            };
            let (id, dir) =
                bring_up(format!("grp-{tag}-{which}"), Some(s.snapshot_id.clone())).await;
            restored.insert((tag, s.source_volume_id.clone()), (id, dir));
        }
    }
    let seq = |tag: &'static str, v: &String| read(&restored[&(tag, v.clone())].1.join("seq"));
    let (la, lb) = (seq("live", &a), seq("live", &b));
    assert!(
        lb >= 20 && one_instant(la, lb),
        "the live group holds data={la} wal={lb}: no single instant held that \
         (the writer reached {last})"
    );
    eprintln!("writer reached {last}; the live group holds data={la} wal={lb}");
    assert_eq!(
        (seq("idle", &a), seq("idle", &b)),
        (last, last),
        "the group holds what was last written"
    );

    for (id, dir) in restored.values() {
        h.node()
            .node_unstage_volume(unstage_req(id, dir))
            .await
            .unwrap();
    }
    for id in restored
        .values()
        .map(|(id, _)| id.clone())
        .chain([a.clone(), b.clone()])
    {
        h.controller()
            .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                volume_id: id,
                node_id: node.clone(),
                secrets: secrets.clone(),
            })
            .await
            .unwrap();
    }
    for g in [&live, &group] {
        h.delete_group(&g.group_snapshot_id, secrets.clone()).await;
    }
    for id in restored.values().map(|(id, _)| id.clone()).chain([a, b]) {
        h.controller()
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: id,
                secrets: secrets.clone(),
            })
            .await
            .unwrap();
    }
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}
