//! The rbd backend's controller path on the host, through the binary,
//! against the single-node Ceph fixture (the rbd CLI needs no kernel
//! module; mapping runs in the guest). Needs root and Debian's ceph-mon,
//! ceph-osd and ceph-common.

mod common;

use common::fixtures::CephCluster;
use common::*;
use ferrovol::proto as pb;
use std::collections::HashMap;
use tonic::Code;

/// With the controller's own user, on one client to the cluster
/// (`librbd` or `cli`).
pub fn rbd_config(c: &CephCluster, client: &str) -> String {
    format!(
        "{}user = \"ferrovol\"\nkeyring = \"{}\"\nclient = \"{client}\"\n",
        rbd_config_secrets_only(c),
        c.client_keyring.display()
    )
}

/// The normal deployment: the controller has no credentials of its own;
/// every call brings them in its secrets.
fn rbd_config_secrets_only(c: &CephCluster) -> String {
    format!(
        "[[backend]]\ntype = \"rbd\"\ncluster_id = \"test\"\nmonitors = [\"v1:{}\"]\npools = [\"rbd\"]\n\
         max_clone_depth = 2\n",
        c.mon_addr,
    )
}

fn secrets(c: &CephCluster) -> HashMap<String, String> {
    HashMap::from([
        ("userID".to_string(), "ferrovol".to_string()),
        ("userKey".to_string(), c.client_key()),
    ])
}

fn images(c: &CephCluster) -> Vec<String> {
    let out = c.rbd(&["ls", "rbd", "--format", "json"]);
    let mut v: Vec<String> = serde_json::from_str(&out).unwrap();
    v.sort();
    v
}

/// The whole controller path on both clients to the cluster, one after the
/// other on one cluster.
#[tokio::test]
async fn rbd_controller_on_a_real_cluster() {
    require_root();
    let cluster = CephCluster::new();
    for client in ["librbd", "cli"] {
        controller_path(&cluster, client).await;
        cut_short_creates_and_deletes(&cluster, client).await;
    }
}

/// The whole content of image `image` of the `rbd` pool (`rbd export`).
fn content(c: &CephCluster, image: &str) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("image");
    c.rbd(&[
        "export",
        "--no-progress",
        &format!("rbd/{image}"),
        file.to_str().unwrap(),
    ]);
    std::fs::read(&file).unwrap()
}

/// The images the driver records as being made, in the `rbd` pool.
fn being_made(c: &CephCluster) -> String {
    let out = std::process::Command::new("rados")
        .args(["-c", c.conf.to_str().unwrap(), "--id", "ferrovol"])
        .args(["--keyring", c.client_keyring.to_str().unwrap()])
        .args(["-p", "rbd", "listomapkeys", "ferrovol.making"])
        .output()
        .unwrap();
    // No record at all is none being made.
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A create the driver dies in (`rbd.made`: the image made and sized, no
/// CSI name on it yet), of a new volume and of a restore: the volume is
/// not listed meanwhile, the CO's retry makes it whole, and a delete of
/// one never retried removes it. An image of the same name that the
/// driver did not make is never taken or deleted. Deletes: a clone and
/// its source at once, and one the driver dies in with the image in the
/// trash (`rbd.trashed`).
async fn cut_short_creates_and_deletes(cluster: &CephCluster, client: &str) {
    let mut h = Harness::start_with(Some(&rbd_config(cluster, client))).await;
    let mut c = h.controller();
    let cap = mount_cap("ext4", SNW);
    let req = |name: &str, source: Option<pb::VolumeContentSource>| {
        let mut r = create_req(name, 8 * MIB, cap.clone());
        r.secrets = secrets(cluster);
        r.volume_content_source = source;
        r
    };
    let source = h.create_volume(req("pvc-src", None)).await;
    cluster.rbd(&[
        "bench",
        "--io-type",
        "write",
        "--io-pattern",
        "seq",
        "--io-size",
        "4096",
        "--io-total",
        "65536",
        "rbd/fv-pvc-src",
    ]);
    let snap = h
        .snapshot_with("snap-src", &source.volume_id, secrets(cluster))
        .await;
    let id_of = |name: &str| {
        source
            .volume_id
            .replace("fv-pvc-src", &format!("fv-{name}"))
    };
    for (name, from) in [
        ("pvc-cut", None),
        ("pvc-cut-restore", Some(snapshot_source(&snap))),
        ("pvc-never", None),
    ] {
        h.env = vec![("FERROVOL_KILL_AT".into(), "rbd.made".into())];
        h.kill();
        h.spawn().await;
        let died = h.controller().create_volume(req(name, from.clone())).await;
        assert!(died.is_err(), "{client} {name}: {died:?}");
        h.kill();
        h.env.clear();
        h.spawn().await;
        c = h.controller();
        let left = images(cluster);
        if client == "librbd" {
            // Made under its final name, its making on record.
            assert!(left.contains(&format!("fv-{name}")), "{left:?}");
            assert!(
                being_made(cluster).contains(&format!("fv-{name}")),
                "{client} {name}"
            );
        } else {
            assert!(left.contains(&format!("tmp-fv-{name}")), "{left:?}");
        }
        assert!(
            !h.listed_volume_ids().await.contains(&id_of(name)),
            "{client} {name}: a volume cut short was listed"
        );
        if name == "pvc-never" {
            // The CO gave up: the delete removes what the create left.
            c.delete_volume(pb::DeleteVolumeRequest {
                volume_id: id_of(name),
                secrets: secrets(cluster),
            })
            .await
            .unwrap();
            let left = images(cluster);
            assert!(
                !left.iter().any(|i| i.ends_with(&format!("fv-{name}"))),
                "{client}: {left:?}"
            );
            continue;
        }
        let v = h.create(req(name, from.clone())).await;
        assert_eq!(v.volume_id, id_of(name));
        assert_eq!(
            cluster
                .rbd(&[
                    "image-meta",
                    "get",
                    &format!("rbd/fv-{name}"),
                    "ferrovol.name"
                ])
                .trim(),
            name
        );
        let left = images(cluster);
        assert!(!left.iter().any(|i| i.starts_with("tmp-fv-")), "{left:?}");
    }
    // Every record is gone: each retry's went after its answer, from the
    // running driver or, when the next kill came first, from the next
    // start (this driver has a user of its own); pvc-never's with its
    // delete.
    assert_eq!(being_made(cluster), "", "{client}: records of making left");
    if client == "librbd" {
        // The record's removal after the answer, by a driver that lives
        // on: done once the driver says so (it logs either outcome).
        let v = h.create_volume(req("pvc-whole", None)).await;
        let said = |log: &str| {
            log.lines()
                .any(|l| l.contains("rbd/fv-pvc-whole") && l.contains("record of making"))
        };
        common::fixtures::wait_on(
            "the driver's word on the record of pvc-whole",
            &[("ferrovol", h.pid())],
            || said(&h.log()),
        );
        assert!(
            h.log()
                .lines()
                .any(|l| l.contains("rbd/fv-pvc-whole") && l.contains("record of making removed")),
            "{}",
            h.log()
        );
        assert_eq!(being_made(cluster), "");
        h.delete_volume_with(&v.volume_id, secrets(cluster)).await;

        // Dead after the image got its name, with its record still there
        // (`rbd.named`; the answer may or may not have reached the CO): the
        // volume is whole. A driver without a user of its own cannot look
        // at the cluster before a call brings secrets: the retry answers
        // the volume as it is (not made anew), and its delete takes the
        // record with it.
        let config = h.config.clone().unwrap();
        let own = std::fs::read_to_string(&config).unwrap();
        let image_id = |c: &CephCluster, name: &str| -> String {
            let info: serde_json::Value = serde_json::from_str(&c.rbd(&[
                "info",
                &format!("rbd/fv-{name}"),
                "--format",
                "json",
            ]))
            .unwrap();
            info["id"].as_str().unwrap().to_string()
        };
        let die_named = |h: &mut Harness| {
            h.env = vec![("FERROVOL_KILL_AT".into(), "rbd.named".into())];
            h.kill();
        };
        die_named(&mut h);
        h.spawn().await;
        // Killed there, or killed here before it gets there: the record
        // is left either way (its removal comes after the point).
        let _ = h.controller().create_volume(req("pvc-named", None)).await;
        h.kill();
        h.env.clear();
        std::fs::write(
            &config,
            format!("{}client = \"librbd\"\n", rbd_config_secrets_only(cluster)),
        )
        .unwrap();
        h.spawn().await;
        assert!(being_made(cluster).contains("fv-pvc-named"), "{client}");
        let made = image_id(cluster, "pvc-named");
        let v = h.create_volume(req("pvc-named", None)).await;
        assert_eq!(v.volume_id, id_of("pvc-named"));
        assert_eq!(
            image_id(cluster, "pvc-named"),
            made,
            "the whole volume was made again"
        );
        h.delete_volume_with(&v.volume_id, secrets(cluster)).await;
        assert!(!images(cluster).contains(&"fv-pvc-named".to_string()));
        assert_eq!(being_made(cluster), "", "the delete left the record");

        // The same death, and a driver with a user of its own: its start
        // removes the record; the volume is listed, and the retry answers
        // it as it is.
        die_named(&mut h);
        std::fs::write(&config, &own).unwrap();
        h.spawn().await;
        let _ = h.controller().create_volume(req("pvc-settled", None)).await;
        h.kill();
        h.env.clear();
        h.spawn().await;
        assert_eq!(being_made(cluster), "", "the start left the record");
        let made = image_id(cluster, "pvc-settled");
        assert!(
            h.listed_volume_ids().await.contains(&id_of("pvc-settled")),
            "a whole volume is listed"
        );
        let v = h.create_volume(req("pvc-settled", None)).await;
        assert_eq!(image_id(cluster, "pvc-settled"), made, "made again");
        h.delete_volume_with(&v.volume_id, secrets(cluster)).await;
        c = h.controller();
    }
    // The restore made again holds the snapshot's data.
    assert_eq!(
        content(cluster, "fv-pvc-cut-restore"),
        content(cluster, "fv-pvc-src")
    );

    // An image of a volume's name that the driver did not make (no CSI
    // name, no record of making): neither taken nor deleted.
    cluster.rbd(&["create", "rbd/fv-pvc-foreign", "--size", "8M"]);
    let r = c.create_volume(req("pvc-foreign", None)).await;
    assert_eq!(code(&r), Code::AlreadyExists, "{client}: {r:?}");
    let r = c
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id_of("pvc-foreign"),
            secrets: secrets(cluster),
        })
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{client}: {r:?}");
    assert!(images(cluster).contains(&"fv-pvc-foreign".to_string()));
    cluster.rbd(&["rm", "--no-progress", "rbd/fv-pvc-foreign"]);

    // A clone deleted, then its source at once (csi-sanity's cleanup):
    // the clone's data, removed in the background on librbd, holds the
    // source open meanwhile, and that is not a node using it.
    for i in 0..3 {
        let source = h
            .create_volume(req(&format!("pvc-s{i}"), None))
            .await
            .volume_id;
        let from = Some(volume_source(&source));
        let clone = h
            .create_volume(req(&format!("pvc-c{i}"), from))
            .await
            .volume_id;
        for id in [clone, source] {
            let r = c
                .delete_volume(pb::DeleteVolumeRequest {
                    volume_id: id,
                    secrets: secrets(cluster),
                })
                .await;
            assert!(r.is_ok(), "{client} {i}: {r:?}");
        }
    }
    // A delete the driver dies in once the image is in the trash
    // (`rbd.trashed`, librbd): the image is gone from the pool, the CO's
    // retry succeeds and its purge removes what the trash held.
    if client == "librbd" {
        let id = h.create_volume(req("pvc-trashed", None)).await.volume_id;
        h.env = vec![("FERROVOL_KILL_AT".into(), "rbd.trashed".into())];
        h.kill();
        h.spawn().await;
        let del = || pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: secrets(cluster),
        };
        let died = h.controller().delete_volume(del()).await;
        assert!(died.is_err(), "{died:?}");
        h.kill();
        h.env.clear();
        h.spawn().await;
        c = h.controller();
        assert!(!images(cluster).contains(&"fv-pvc-trashed".to_string()));
        let trash = cluster.rbd(&["trash", "ls", "rbd"]);
        assert!(trash.contains("fv-pvc-trashed"), "{trash}");
        c.delete_volume(del()).await.unwrap();
        common::fixtures::wait_for(
            "the trash to lose the deleted image",
            std::time::Duration::from_secs(60),
            || {
                !cluster
                    .rbd(&["trash", "ls", "rbd"])
                    .contains("fv-pvc-trashed")
            },
        );
    }

    c.delete_snapshot(pb::DeleteSnapshotRequest {
        snapshot_id: snap.clone(),
        secrets: secrets(cluster),
    })
    .await
    .unwrap();
    for name in ["pvc-cut", "pvc-cut-restore", "pvc-src"] {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id_of(name),
            secrets: secrets(cluster),
        })
        .await
        .unwrap();
    }
    assert!(
        images(cluster).is_empty(),
        "{client}: {:?}",
        images(cluster)
    );
}

async fn controller_path(cluster: &CephCluster, client: &str) {
    let h = Harness::start_with(Some(&rbd_config(cluster, client))).await;
    assert!(
        h.log()
            .contains(&format!("rbd controller calls go through {client}")),
        "{}",
        h.log()
    );
    let mut c = h.controller();
    let cap = mount_cap("ext4", SNW);
    let mut req = create_req("pvc-rbd", 10 * MIB + 1, cap.clone());
    req.secrets = secrets(cluster);

    // Wrong and missing secrets.
    let mut wrong = req.clone();
    wrong.secrets.insert(
        "userKey".into(),
        "AQBad0BhAAAAABAAbadbadbadbadbadbadbadbQ==".into(),
    );
    let r = c.create_volume(wrong).await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    let msg = r.unwrap_err().message().to_string();
    assert!(
        msg.contains("refused the credentials") && !msg.contains("AQBad0"),
        "{msg}"
    );
    let mut half = req.clone();
    half.secrets.remove("userKey");
    assert_eq!(code(&c.create_volume(half).await), Code::InvalidArgument);
    assert!(images(cluster).is_empty());

    let vol = h.create(req.clone()).await;
    assert!(
        vol.volume_id.starts_with("rbd:v1.test.rbd."),
        "{}",
        vol.volume_id
    );
    assert_eq!(vol.capacity_bytes, 11 * MIB, "rounded up to whole MiB");
    assert_eq!(images(cluster), ["fv-pvc-rbd"]);
    assert_eq!(
        cluster
            .rbd(&["image-meta", "get", "rbd/fv-pvc-rbd", "ferrovol.name"])
            .trim(),
        "pvc-rbd"
    );
    // Retried: the same; a different size: ALREADY_EXISTS.
    let again = h.create(req.clone()).await;
    assert_eq!(again.volume_id, vol.volume_id);
    let mut bigger = req.clone();
    bigger.capacity_range = Some(pb::CapacityRange {
        required_bytes: 100 * MIB,
        limit_bytes: 0,
    });
    assert_eq!(code(&c.create_volume(bigger).await), Code::AlreadyExists);
    // A pool the config does not allow.
    let mut other_pool = req.clone();
    other_pool.parameters.insert("pool".into(), "other".into());
    assert_eq!(
        code(&c.create_volume(other_pool).await),
        Code::InvalidArgument
    );

    // Expansion.
    let grown = c
        .controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 20 * MIB,
                limit_bytes: 0,
            }),
            secrets: secrets(cluster),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 20 * MIB);
    let info: serde_json::Value =
        serde_json::from_str(&cluster.rbd(&["info", "rbd/fv-pvc-rbd", "--format", "json"]))
            .unwrap();
    assert_eq!(info["size"], 20 << 20);

    // Fencing: published to node a; node b is refused until a lets go.
    let publish = |node: &str| pb::ControllerPublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: node.into(),
        volume_capability: Some(cap.clone()),
        secrets: secrets(cluster),
        ..Default::default()
    };
    c.controller_publish_volume(publish("node-a/rbd"))
        .await
        .unwrap();
    c.controller_publish_volume(publish("node-a/rbd"))
        .await
        .unwrap();
    let r = c.controller_publish_volume(publish("node-b/rbd")).await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    let unpublish = |node: &str| pb::ControllerUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: node.into(),
        secrets: secrets(cluster),
    };
    c.controller_unpublish_volume(unpublish("node-a"))
        .await
        .unwrap();
    c.controller_unpublish_volume(unpublish("node-a"))
        .await
        .unwrap();
    c.controller_publish_volume(publish("node-b/rbd"))
        .await
        .unwrap();
    c.controller_unpublish_volume(unpublish("node-b/rbd"))
        .await
        .unwrap();

    // Known writes for changed block tracking: 8 KiB at 0 before the
    // first snapshot, 64 KiB at 0 after it.
    let bench = |size: &str, total: &str| {
        cluster.rbd(&[
            "bench",
            "--io-type",
            "write",
            "--io-pattern",
            "seq",
            "--io-threads",
            "1",
            "--io-size",
            size,
            "--io-total",
            total,
            "rbd/fv-pvc-rbd",
        ])
    };
    bench("4096", "8192");

    // Snapshots, a restore and a clone chain past the flatten depth.
    let snap = c
        .create_snapshot(pb::CreateSnapshotRequest {
            source_volume_id: vol.volume_id.clone(),
            name: "snap-1".into(),
            secrets: secrets(cluster),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);

    // Changed block tracking, exact: what the first snapshot holds, and
    // what changed up to a second one.
    bench("65536", "65536");
    let snap2 = h.snapshot("snap-2", &vol.volume_id).await;
    let ranges = |v: serde_json::Value| -> Vec<(u64, u64)> {
        v["ranges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r[0].as_u64().unwrap(), r[1].as_u64().unwrap()))
            .collect()
    };
    let allocated = h.client_json(&["allocated", &snap.snapshot_id]);
    assert_eq!(allocated["volume_capacity_bytes"], 20 * MIB, "{allocated}");
    assert_eq!(ranges(allocated), [(0, 8192)], "{client}");
    let delta = h.client_json(&["delta", &snap.snapshot_id, &snap2]);
    assert_eq!(ranges(delta), [(0, 65536)], "{client}");
    let later = h.client_json(&[
        "delta",
        &snap.snapshot_id,
        &snap2,
        "--starting-offset",
        "16384",
    ]);
    assert_eq!(ranges(later), [(16384, 49152)], "{client}");
    c.delete_snapshot(pb::DeleteSnapshotRequest {
        snapshot_id: snap2,
        secrets: secrets(cluster),
    })
    .await
    .unwrap();
    let cuts = cluster.rbd(&["snap", "ls", "rbd/fv-pvc-rbd"]);
    assert!(
        !cuts.contains("fvs-pvc-snap-2"),
        "the second cut stayed: {cuts}"
    );
    assert!(cuts.contains("tmp-tmp-fvs-"), "the first cut went: {cuts}");
    assert_eq!(snap.source_volume_id, vol.volume_id);
    let got = c
        .list_snapshots(pb::ListSnapshotsRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.entries.len(), 1);
    let from_snap = |name: &str, id: &str, snapshot: bool| {
        let mut r = create_req(name, 0, cap.clone());
        r.secrets = secrets(cluster);
        r.volume_content_source = Some(pb::VolumeContentSource {
            r#type: Some(if snapshot {
                pb::volume_content_source::Type::Snapshot(
                    pb::volume_content_source::SnapshotSource {
                        snapshot_id: id.into(),
                    },
                )
            } else {
                pb::volume_content_source::Type::Volume(pb::volume_content_source::VolumeSource {
                    volume_id: id.into(),
                })
            }),
        });
        r
    };
    let restored = h
        .create(from_snap("pvc-restored", &snap.snapshot_id, true))
        .await;
    assert_eq!(restored.capacity_bytes, 20 * MIB);
    // The restore is a clone of the cut the snapshot came from, kept on
    // its source (no cluster snapshot made for it), and holds what the
    // snapshot holds, not the 64 KiB written since.
    let parent = |image: &str| -> serde_json::Value {
        let info: serde_json::Value = serde_json::from_str(&cluster.rbd(&[
            "info",
            &format!("rbd/{image}"),
            "--format",
            "json",
        ]))
        .unwrap();
        info["parent"].clone()
    };
    let from = parent("fv-pvc-restored");
    assert_eq!(from["image"], "fv-pvc-rbd", "{from}");
    assert!(
        from["snapshot"]
            .as_str()
            .is_some_and(|s| s.starts_with("tmp-tmp-fvs-")),
        "{from}"
    );
    let snap_image = images(cluster)
        .into_iter()
        .find(|i| i.starts_with("fvs-"))
        .expect("the snapshot image");
    let content = |image: &str| content(cluster, image);
    let snapshot_content = content(&snap_image);
    assert_eq!(content("fv-pvc-restored"), snapshot_content);
    assert_ne!(content("fv-pvc-rbd"), snapshot_content);
    // A chain of clones: each a clone of the last; past depth 2 the new
    // one is flattened (no parent).
    let mut last = restored.volume_id.clone();
    for i in 0..3 {
        let v = h
            .create(from_snap(&format!("pvc-chain-{i}"), &last, false))
            .await;
        last = v.volume_id;
    }
    // No image's chain of parents is longer than max_clone_depth (2), and
    // the first clone past it was flattened.
    let depth = |image: &str| {
        let mut n = 0;
        let mut cur = image.to_string();
        loop {
            let info: serde_json::Value = serde_json::from_str(&cluster.rbd(&[
                "info",
                &format!("rbd/{cur}"),
                "--format",
                "json",
            ]))
            .unwrap();
            match info.get("parent") {
                Some(p) if p["trash"] == false => {
                    n += 1;
                    cur = p["image"].as_str().unwrap().to_string();
                }
                Some(_) => return n + 1,
                None => return n,
            }
        }
    };
    assert_eq!(depth("fv-pvc-restored"), 1);
    assert_eq!(depth("fv-pvc-chain-0"), 2);
    assert_eq!(depth("fv-pvc-chain-1"), 0, "past the depth: flattened");
    for image in images(cluster) {
        assert!(depth(&image) <= 2, "{image}");
    }

    // The source volume goes while its snapshot and clones live on: the
    // image waits in the trash, and the snapshot still restores.
    let del = |id: &str| pb::DeleteVolumeRequest {
        volume_id: id.into(),
        secrets: secrets(cluster),
    };
    // Four restores run while it goes: each clones the cut or, once the
    // cut has gone to the trash with its volume, the snapshot image's
    // `base`; every one holds the snapshot's data.
    let restores = (0..4).map(|i| {
        let (mut c, req) = (
            c.clone(),
            from_snap(&format!("pvc-many-{i}"), &snap.snapshot_id, true),
        );
        tokio::spawn(async move { c.create_volume(req).await.map(|_| ()) })
    });
    let restores: Vec<_> = restores.collect();
    c.delete_volume(del(&vol.volume_id)).await.unwrap();
    for r in restores {
        r.await.unwrap().unwrap();
    }
    c.delete_volume(del(&vol.volume_id)).await.unwrap();
    assert!(!images(cluster).contains(&"fv-pvc-rbd".to_string()));
    for i in 0..4 {
        assert_eq!(
            content(&format!("fv-pvc-many-{i}")),
            snapshot_content,
            "{i}"
        );
    }
    c.create_volume(from_snap("pvc-restored-2", &snap.snapshot_id, true))
        .await
        .unwrap();
    let from = parent("fv-pvc-restored-2");
    assert_eq!(
        (from["image"].as_str(), from["snapshot"].as_str()),
        (Some(snap_image.as_str()), Some("base")),
        "{from}"
    );
    assert_eq!(content("fv-pvc-restored-2"), snapshot_content);

    // ListVolumes pages through everything.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = c
            .list_volumes(pb::ListVolumesRequest {
                max_entries: 2,
                starting_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        seen.extend(
            page.entries
                .into_iter()
                .map(|e| e.volume.unwrap().volume_id),
        );
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen.len(), 9, "{seen:?}");

    // A mapped image (a watcher) refuses its delete.
    let watcher = std::process::Command::new("rbd")
        .args([
            "-c",
            cluster.conf.to_str().unwrap(),
            "--id",
            "ferrovol",
            "--keyring",
            cluster.client_keyring.to_str().unwrap(),
            "watch",
            "rbd/fv-pvc-restored",
        ])
        // It watches until its input ends.
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    /// Ends the watcher: its input closed, it unwatches and exits (killed
    /// only if it does not).
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            drop(self.0.stdin.take());
            for _ in 0..100 {
                if matches!(self.0.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let watcher = Kill(watcher);
    let status = || cluster.rbd(&["status", "rbd/fv-pvc-restored", "--format", "json"]);
    common::fixtures::wait_for("the watcher", std::time::Duration::from_secs(30), || {
        status().contains("address")
    });
    let r = c.delete_volume(del(&restored.volume_id)).await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    drop(watcher);

    // Everything goes, in any order; the trash empties once nothing needs
    // what it holds.
    c.delete_snapshot(pb::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        secrets: secrets(cluster),
    })
    .await
    .unwrap();
    for id in seen {
        c.delete_volume(del(&id)).await.unwrap();
    }
    assert!(images(cluster).is_empty(), "{:?}", images(cluster));
    // A later delete purges what the trash still holds of ours (on
    // librbd a delete removes its image's data in the background: the
    // trash empties once those removals are done).
    let started = std::time::Instant::now();
    loop {
        c.delete_volume(del(&vol.volume_id)).await.unwrap();
        let trash = cluster.rbd(&["trash", "ls", "rbd", "--format", "json"]);
        if trash.trim() == "[]" {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "{client}: the trash kept {trash}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(
        !h.log().contains(&cluster.client_key()),
        "the key reached the log"
    );
}

/// A controller whose only credentials are each call's secrets: every
/// call that carries them works (ControllerPublish looked the volume up
/// without them and answered INVALID_ARGUMENT); a node that does not map
/// rbd images is NOT_FOUND; a second publish to a node on other terms is
/// ALREADY_EXISTS; GetCapacity, which carries no secrets, says what it
/// needs, and reports the pool's room with the config's own user.
#[tokio::test]
async fn rbd_calls_carry_their_secrets_and_publish_checks_node_and_terms() {
    require_root();
    let cluster = CephCluster::new();
    let h = Harness::start_with(Some(&rbd_config_secrets_only(&cluster))).await;
    // The default client where librbd is installed.
    assert!(h.log().contains("rbd controller calls go through librbd"));
    let mut c = h.controller();
    let cap = mount_cap("ext4", SNW);
    let mut req = create_req("pvc-secrets", 8 * MIB, cap.clone());
    req.secrets = secrets(&cluster);
    let vol = h.create(req).await;
    let publish = |node: &str, readonly: bool| pb::ControllerPublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: node.into(),
        volume_capability: Some(cap.clone()),
        readonly,
        secrets: secrets(&cluster),
        ..Default::default()
    };
    let r = c.controller_publish_volume(publish("node-a", false)).await;
    assert_eq!(code(&r), Code::NotFound, "{r:?}");
    c.controller_publish_volume(publish("node-a/rbd", false))
        .await
        .unwrap();
    let r = c
        .controller_publish_volume(publish("node-a/rbd", true))
        .await;
    assert_eq!(code(&r), Code::AlreadyExists, "{r:?}");
    let valid = c
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: vol.volume_id.clone(),
            volume_capabilities: vec![cap.clone()],
            secrets: secrets(&cluster),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(valid.confirmed.is_some(), "{valid:?}");
    // This node's id says it maps rbd images.
    let node_id = h.node_id().await;
    assert!(node_id.ends_with("/rbd"), "{node_id}");
    let r = c
        .get_capacity(pb::GetCapacityRequest {
            parameters: [("backend".to_string(), "rbd".to_string())].into(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    c.controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: "node-a/rbd".into(),
        secrets: secrets(&cluster),
    })
    .await
    .unwrap();
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        secrets: secrets(&cluster),
    })
    .await
    .unwrap();
    drop(c);
    drop(h);

    // With the config's own user, GetCapacity reports the pool's room,
    // the same on both clients (`ceph df`, the monitor command).
    let mut rooms = Vec::new();
    for client in ["librbd", "cli"] {
        let h = Harness::start_with(Some(&rbd_config(&cluster, client))).await;
        let cap = h
            .controller()
            .get_capacity(pb::GetCapacityRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(cap.available_capacity > 0, "{cap:?}");
        assert_eq!(cap.available_capacity % MIB, 0);
        assert!(!h.log().contains(&cluster.client_key()));
        rooms.push(cap.available_capacity);
    }
    // Nothing was written between the two: within 1% of each other.
    let (a, b) = (rooms[0] as f64, rooms[1] as f64);
    assert!((a - b).abs() <= a.max(b) / 100.0, "{rooms:?}");
}

/// A cluster that does not answer (nothing listens at its monitor): on the
/// librbd client the call answers UNAVAILABLE within librados's connect
/// timeout (20 s) and its deadline, the driver keeps serving meanwhile
/// (the call blocks a thread of the blocking pool, not an async worker),
/// and nothing of the key is said.
#[tokio::test]
async fn rbd_a_cluster_that_does_not_answer_is_unavailable_in_bounded_time() {
    require_root();
    let port = free_port();
    let config = format!(
        "[[backend]]\ntype = \"rbd\"\ncluster_id = \"gone\"\nmonitors = [\"v1:127.0.0.1:{port}\"]\n\
         pools = [\"rbd\"]\nclient = \"librbd\"\n"
    );
    let h = Harness::start_with(Some(&config)).await;
    let key = "AQBad0BhAAAAABAAbadbadbadbadbadbadbadbQ==";
    let mut req = create_req("pvc-gone", 8 * MIB, mount_cap("ext4", SNW));
    req.secrets = HashMap::from([
        ("userID".to_string(), "ferrovol".to_string()),
        ("userKey".to_string(), key.to_string()),
    ]);
    let mut c = h.controller();
    let started = std::time::Instant::now();
    let call = tokio::spawn(async move { c.create_volume(req).await });
    // While it waits on the cluster, the driver answers.
    for _ in 0..5 {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        h.identity()
            .probe(pb::ProbeRequest {})
            .await
            .expect("the driver answers while a cluster call waits");
    }
    let r = call.await.unwrap();
    let took = started.elapsed();
    assert_eq!(code(&r), Code::Unavailable, "{r:?}");
    assert!(
        took >= std::time::Duration::from_secs(15) && took < std::time::Duration::from_secs(60),
        "{took:?}"
    );
    let msg = r.unwrap_err().message().to_string();
    assert!(!msg.contains("AQBad0"), "{msg}");
    assert!(!h.log().contains("AQBad0"), "the key reached the log");

    // A key librados cannot parse is the caller's error, said at once.
    let mut req = create_req("pvc-badkey", 8 * MIB, mount_cap("ext4", SNW));
    req.secrets = HashMap::from([
        ("userID".to_string(), "ferrovol".to_string()),
        (
            "userKey".to_string(),
            "AQDzZkVnAAAAABAAsecretsecretsecretsecretQ==".to_string(),
        ),
    ]);
    let r = h.controller().create_volume(req).await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    assert!(!r.unwrap_err().message().contains("AQDzZkVn"));
}

/// QoS limits as mutable parameters, on both clients: set at create (a
/// VolumeAttributesClass), changed and cleared by ControllerModifyVolume
/// (0 removes the override), a set with one bad value changes nothing.
#[tokio::test]
async fn rbd_qos_limits_are_mutable_parameters() {
    require_root();
    let cluster = CephCluster::new();
    for client in ["librbd", "cli"] {
        let h = Harness::start_with(Some(&rbd_config(&cluster, client))).await;
        let mut c = h.controller();
        let name = format!("pvc-qos-{client}");
        let image = format!("rbd/fv-{name}");
        let overrides = || -> serde_json::Map<String, serde_json::Value> {
            let all: serde_json::Value = serde_json::from_str(&cluster.rbd(&[
                "image-meta",
                "list",
                "--format",
                "json",
                &image,
            ]))
            .unwrap_or(serde_json::json!({}));
            all.as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.starts_with("conf_"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        let mut req = create_req(&name, 4 * MIB, mount_cap("ext4", SNW));
        req.secrets = secrets(&cluster);
        req.mutable_parameters = HashMap::from([("qosIopsLimit".into(), "100".into())]);
        let id = h.create(req).await.volume_id;
        assert_eq!(
            serde_json::Value::Object(overrides()),
            serde_json::json!({"conf_rbd_qos_iops_limit": "100"})
        );
        let modify = |pairs: &[(&str, &str)]| pb::ControllerModifyVolumeRequest {
            volume_id: id.clone(),
            secrets: secrets(&cluster),
            mutable_parameters: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let changed = [("qosIopsLimit", "0"), ("qosBpsLimit", "1048576")];
        c.controller_modify_volume(modify(&changed)).await.unwrap();
        let want = serde_json::json!({"conf_rbd_qos_bps_limit": "1048576"});
        assert_eq!(serde_json::Value::Object(overrides()), want);
        // What librbd's clients read as the image's config.
        assert_eq!(
            cluster
                .rbd(&["config", "image", "get", &image, "rbd_qos_bps_limit"])
                .trim(),
            "1048576"
        );
        // Again: no change.
        c.controller_modify_volume(modify(&changed)).await.unwrap();
        // One bad value or key: INVALID_ARGUMENT naming it, nothing applied.
        for bad in [
            &[("qosBpsLimit", "5"), ("qosWriteIopsLimit", "lots")][..],
            &[("qosBpsLimit", "5"), ("features", "journaling")][..],
        ] {
            let e = c.controller_modify_volume(modify(bad)).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains(bad[1].0), "{client}: {}", e.message());
            assert_eq!(serde_json::Value::Object(overrides()), want);
        }
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: secrets(&cluster),
        })
        .await
        .unwrap();
        let e = c
            .controller_modify_volume(modify(&changed))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
    }
}

/// Group snapshots on a real cluster: on the librbd client every member's
/// exclusive lock is held while all are snapshotted, then each member is
/// an ordinary snapshot image that names its group; an image without the
/// exclusive-lock feature is refused with nothing left behind, and so is
/// the CLI client (it cannot hold locks across calls).
#[tokio::test]
async fn rbd_group_snapshots_cut_every_member_or_leave_nothing() {
    require_root();
    let cluster = CephCluster::new();
    let h = Harness::start_with(Some(&rbd_config(&cluster, "librbd"))).await;
    let c = h.controller();
    let make = |name: &str, features: &str| {
        let mut req = create_req(name, 4 * MIB, mount_cap("ext4", SNW));
        req.secrets = secrets(&cluster);
        req.parameters
            .insert("imageFeatures".into(), features.into());
        req
    };
    let mut ids = Vec::new();
    for (name, features) in [
        ("pvc-g-data", "layering,exclusive-lock"),
        ("pvc-g-wal", "layering,exclusive-lock"),
        ("pvc-g-plain", "layering"),
    ] {
        ids.push(h.create(make(name, features)).await.volume_id);
    }
    let image_snaps = |image: &str| cluster.rbd(&["snap", "ls", &format!("rbd/{image}")]);
    let group = |name: &str, sources: &[&String]| pb::CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: sources.iter().map(|s| s.to_string()).collect(),
        secrets: secrets(&cluster),
        ..Default::default()
    };
    let refused = h
        .group()
        .create_volume_group_snapshot(group("g-plain", &[&ids[0], &ids[2]]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("exclusive-lock"), "{refused:?}");
    assert!(
        image_snaps("fv-pvc-g-data").trim().is_empty(),
        "a cut was left"
    );

    let g = h
        .group()
        .create_volume_group_snapshot(group("g-1", &[&ids[0], &ids[1]]))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(g.snapshots.len(), 2);
    for s in &g.snapshots {
        assert_eq!(s.group_snapshot_id, g.group_snapshot_id);
        assert!(s.ready_to_use);
    }
    // Each member's snapshot is a clone of its cut, which stays on its
    // source (one each: what changed blocks are read between) until the
    // snapshot goes.
    for image in ["fv-pvc-g-data", "fv-pvc-g-wal"] {
        let snaps = image_snaps(image);
        assert_eq!(snaps.matches("tmp-tmp-fvs-").count(), 1, "{image}: {snaps}");
    }
    let fvs = images(&cluster)
        .into_iter()
        .filter(|i| i.starts_with("fvs-"))
        .count();
    assert_eq!(fvs, 2);
    h.delete_group(&g.group_snapshot_id, secrets(&cluster))
        .await;
    assert!(!images(&cluster).iter().any(|i| i.starts_with("fvs-")));
    for image in ["fv-pvc-g-data", "fv-pvc-g-wal"] {
        assert!(
            image_snaps(image).trim().is_empty(),
            "{image}: {}",
            image_snaps(image)
        );
    }

    // The CLI client cannot hold the locks: refused, nothing made.
    drop(c);
    drop(h);
    let h = Harness::start_with(Some(&rbd_config(&cluster, "cli"))).await;
    let refused = h
        .group()
        .create_volume_group_snapshot(group("g-cli", &[&ids[0], &ids[1]]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("librbd"), "{refused:?}");
    let mut c = h.controller();
    for id in ids {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id,
            secrets: secrets(&cluster),
        })
        .await
        .unwrap();
    }
}

/// Group snapshots of images in use (here by librbd writers, `rbd bench`,
/// which hold the exclusive locks): on the librbd client the cut goes
/// through a temporary rbd group, whose snapshot the writers hand their
/// locks over for and go on after; each member is a copy of its cut, and
/// no group, group snapshot or temporary image is left. An in-use member
/// without the exclusive-lock feature is refused leaving nothing, and the
/// CLI client refuses in-use members (it cannot reach a group's snapshots).
#[tokio::test]
async fn rbd_group_snapshots_of_images_being_written() {
    require_root();
    let cluster = CephCluster::new();
    let h = Harness::start_with(Some(&rbd_config(&cluster, "librbd"))).await;
    let c = h.controller();
    let mut ids = Vec::new();
    for (name, features) in [
        ("pvc-w-data", "layering,exclusive-lock"),
        ("pvc-w-wal", "layering,exclusive-lock"),
        ("pvc-w-plain", "layering"),
    ] {
        let mut req = create_req(name, 8 * MIB, mount_cap("ext4", SNW));
        req.secrets = secrets(&cluster);
        req.parameters
            .insert("imageFeatures".into(), features.into());
        ids.push(h.create(req).await.volume_id);
    }
    let conf = cluster.conf.to_str().unwrap().to_string();
    let keyring = cluster.client_keyring.to_str().unwrap().to_string();
    // A writer on each image, known to hold it once it is a watcher.
    let writer = |image: &str| {
        let child = std::process::Command::new("rbd")
            .args(["-c", &conf, "--id", "ferrovol", "--keyring", &keyring])
            .args(["bench", "--io-type", "write", "--io-size", "4096"])
            .args([
                "--io-threads",
                "2",
                "--io-total",
                "100G",
                "--io-pattern",
                "rand",
            ])
            .arg(format!("rbd/{image}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        common::fixtures::wait_for(
            &format!("a writer on {image}"),
            std::time::Duration::from_secs(60),
            || {
                cluster
                    .rbd(&["status", &format!("rbd/{image}")])
                    .contains("watcher=")
            },
        );
        child
    };
    let group = |name: &str, sources: &[&String]| pb::CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: sources.iter().map(|s| s.to_string()).collect(),
        secrets: secrets(&cluster),
        ..Default::default()
    };
    let leftovers = || {
        let groups = cluster.rbd(&["group", "ls", "rbd"]);
        let tmp: Vec<String> = images(&cluster)
            .into_iter()
            .filter(|i| i.starts_with("tmp-"))
            .collect();
        let snaps: Vec<String> = ["fv-pvc-w-data", "fv-pvc-w-wal", "fv-pvc-w-plain"]
            .iter()
            .map(|i| cluster.rbd(&["snap", "ls", "--all", &format!("rbd/{i}")]))
            .filter(|s| !s.trim().is_empty())
            .collect();
        (groups.trim().to_string(), tmp, snaps)
    };
    let nothing = (String::new(), Vec::<String>::new(), Vec::<String>::new());

    let mut writers = vec![writer("fv-pvc-w-data"), writer("fv-pvc-w-plain")];
    let refused = h
        .group()
        .create_volume_group_snapshot(group("w-plain", &[&ids[0], &ids[2]]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("exclusive-lock"), "{refused:?}");
    assert_eq!(leftovers(), nothing);

    writers.push(writer("fv-pvc-w-wal"));
    let g = h
        .group()
        .create_volume_group_snapshot(group("w-1", &[&ids[0], &ids[1]]))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(g.snapshots.len(), 2);
    for s in &g.snapshots {
        assert_eq!(s.group_snapshot_id, g.group_snapshot_id);
        assert!(s.ready_to_use);
        assert_eq!(s.size_bytes, 8 * MIB);
    }
    assert_eq!(leftovers(), nothing);
    // Each member is a flat copy of its own.
    for image in images(&cluster).iter().filter(|i| i.starts_with("fvs-")) {
        let info = cluster.rbd(&["info", &format!("rbd/{image}")]);
        assert!(!info.contains("parent:"), "{image}: {info}");
    }
    // The writers went on through the cut: none has stopped.
    for w in &mut writers {
        if let Some(status) = w.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            w.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            panic!("a writer stopped ({status}) through the group's cut: {err}");
        }
    }
    h.delete_group(&g.group_snapshot_id, secrets(&cluster))
        .await;
    assert!(!images(&cluster).iter().any(|i| i.starts_with("fvs-")));
    // The CLI client cannot read a group's snapshots: in-use members refused.
    drop(c);
    drop(h);
    let h = Harness::start_with(Some(&rbd_config(&cluster, "cli"))).await;
    let refused = h
        .group()
        .create_volume_group_snapshot(group("w-cli", &[&ids[0], &ids[1]]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("librbd"), "{refused:?}");
    assert_eq!(leftovers(), nothing);
    // Killed with the temporary group holding both members and its
    // snapshot (`rbd.group.cut`), the writers still on. A driver with a
    // user of its own undoes the unfinished group at its next start
    // (nothing left); one without keeps it for the CO's retry, which
    // undoes it and makes the group. One nobody retries is removed by the
    // next group snapshot of those volumes (its members cannot join a
    // group while the leftover holds them), and by DeleteVolume.
    drop(h);
    let secrets_only = format!("{}client = \"librbd\"\n", rbd_config_secrets_only(&cluster));
    for (name, own_user, retried) in [
        ("w-cut-1", false, true),
        ("w-cut-2", true, false),
        ("w-cut-3", false, false),
    ] {
        let config = if own_user {
            rbd_config(&cluster, "librbd")
        } else {
            secrets_only.clone()
        };
        let mut h = Harness::start_with(Some(&config)).await;
        h.env = vec![("FERROVOL_KILL_AT".into(), "rbd.group.cut".into())];
        h.kill();
        h.spawn().await;
        let died = h
            .group()
            .create_volume_group_snapshot(group(name, &[&ids[0], &ids[1]]))
            .await;
        assert!(died.is_err(), "{name}: {died:?}");
        h.kill();
        h.env.clear();
        let left = cluster.rbd(&["group", "ls", "rbd"]);
        assert!(
            left.contains("fvg-"),
            "{name}: the kill left no group: {left}"
        );
        h.spawn().await;
        if own_user {
            assert_eq!(leftovers(), nothing, "{name}: the start left it");
        } else {
            let left = cluster.rbd(&["group", "ls", "rbd"]);
            assert!(left.contains("fvg-"), "{name}: not kept for the retry");
        }
        let again = if retried { name } else { "w-after" };
        if retried || !own_user {
            let g = h
                .group()
                .create_volume_group_snapshot(group(again, &[&ids[0], &ids[1]]))
                .await
                .unwrap_or_else(|e| panic!("{name}: {again}: {e:?}\n{}", h.log()))
                .into_inner()
                .group_snapshot
                .unwrap();
            assert_eq!(g.snapshots.len(), 2);
            assert_eq!(leftovers(), nothing, "{name}: after {again}");
            h.delete_group(&g.group_snapshot_id, secrets(&cluster))
                .await;
        }
    }
    let mut h = Harness::start_with(Some(&rbd_config(&cluster, "librbd"))).await;
    // The writers stop; their watches end with them.
    for mut w in writers {
        // SAFETY: a signal to a child of this test.
        unsafe { libc::kill(w.id() as i32, libc::SIGINT) };
        let _ = w.wait();
    }
    for image in ["fv-pvc-w-data", "fv-pvc-w-wal", "fv-pvc-w-plain"] {
        common::fixtures::wait_for(
            &format!("the writer's watch on {image} to end"),
            std::time::Duration::from_secs(90),
            || {
                !cluster
                    .rbd(&["status", &format!("rbd/{image}")])
                    .contains("watcher=")
            },
        );
    }
    // Nobody writes now: the members are cut together, each one's lock
    // held. Killed with the first member's cut made and the locks held
    // (`rbd.group.snapped`): the dead driver's locks hold until the
    // cluster times its watches out, and the CO's retry succeeds then,
    // without the dead try's cut (another instant).
    // The ids of an image's snapshots (`rbd snap ls`: SNAPID first).
    let user_snaps = |image: &str| -> std::collections::BTreeSet<String> {
        cluster
            .rbd(&["snap", "ls", &format!("rbd/{image}")])
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect()
    };
    let sources = ["fv-pvc-w-data", "fv-pvc-w-wal"];
    let before = user_snaps(sources[0]);
    let left_before = leftovers();
    h.env = vec![("FERROVOL_KILL_AT".into(), "rbd.group.snapped".into())];
    h.kill();
    h.spawn().await;
    let died = h
        .group()
        .create_volume_group_snapshot(group("idle-cut", &[&ids[0], &ids[1]]))
        .await;
    assert!(died.is_err(), "{died:?}");
    h.kill();
    h.env.clear();
    let stale: Vec<String> = user_snaps(sources[0])
        .difference(&before)
        .cloned()
        .collect();
    assert_eq!(stale.len(), 1, "the kill left no cut");
    h.spawn().await;
    let restarted = std::time::Instant::now();
    let mut refusals = Vec::new();
    let g = loop {
        match h
            .group()
            .create_volume_group_snapshot(group("idle-cut", &[&ids[0], &ids[1]]))
            .await
        {
            Ok(r) => break r.into_inner().group_snapshot.unwrap(),
            Err(e) => {
                assert!(
                    restarted.elapsed() < std::time::Duration::from_secs(180),
                    "the retries never succeeded: {e:?}\n{}",
                    h.log()
                );
                refusals.push(format!("{:?}: {}", e.code(), e.message()));
                // The CO's backoff.
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        }
    };
    eprintln!(
        "rbd.group.snapped: the retry succeeded {} ms after the restart; refused before: {refusals:#?}",
        restarted.elapsed().as_millis()
    );
    assert!(
        refusals.iter().all(|r| r.starts_with("Unavailable")),
        "a refusal the CO would not retry: {refusals:#?}"
    );
    assert_eq!(g.snapshots.len(), 2);
    // The dead try's cut (another instant) is gone. (The driver's watch
    // outlived it: the retry took the client for members in use, copies.)
    let now = user_snaps(sources[0]);
    assert!(
        !now.contains(&stale[0]),
        "the dead try's cut {} is still there: {now:?}",
        stale[0]
    );
    h.delete_group(&g.group_snapshot_id, secrets(&cluster))
        .await;
    assert_eq!(leftovers(), left_before);
    let mut c = h.controller();
    for id in ids {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id,
            secrets: secrets(&cluster),
        })
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", h.log()));
    }
    assert!(images(&cluster).is_empty(), "{:?}", images(&cluster));
    let groups = cluster.rbd(&["group", "ls", "rbd"]);
    assert!(groups.trim().is_empty(), "groups left: {groups}");
}

/// A driver whose kept connection sat idle while the cluster moved on
/// (more OSD map epochs than an OSD shares at once, then a pg_num change
/// that makes OSDs drop ops sent under older maps) catches up before its
/// next call. Without that, librados missed the epochs between and sent
/// the op again only at its 10 s "laggy" check (seen in the bench: one
/// CreateVolume a run took 12-15 s). Checked in the OSD's own log: the
/// next create's ops are each sent once, none resent.
#[tokio::test]
async fn rbd_an_idle_connection_catches_up_with_the_cluster_map() {
    require_root();
    let cluster = CephCluster::new();
    // Only the test changes the placement: the manager's autoscaler would
    // split the pool on its own a minute after it starts.
    cluster.ceph(&["osd", "pool", "set", "rbd", "pg_autoscale_mode", "off"]);
    // The limit of 40 epochs per message, made 4 so that a few epochs
    // make the gap.
    for daemon in ["mon.a", "osd.0"] {
        for option in ["osd_map_message_max", "osd_map_share_max_epochs"] {
            cluster.ceph(&["tell", daemon, "config", "set", option, "4"]);
        }
    }
    let h = Harness::start_with(Some(&rbd_config(&cluster, "librbd"))).await;
    let make = |name: &str| {
        let mut req = create_req(name, 4 * MIB, mount_cap("ext4", SNW));
        req.secrets = secrets(&cluster);
        req
    };
    let first = h.create_volume(make("pvc-before")).await;
    let idle_from = std::time::Instant::now();
    // Epochs the driver does not see, then a placement change.
    for i in 0..8 {
        cluster.ceph(&["osd", if i % 2 == 0 { "set" } else { "unset" }, "noout"]);
    }
    cluster.ceph(&["osd", "pool", "set", "rbd", "pg_num", "16"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !cluster
        .ceph(&["osd", "pool", "get", "rbd", "pgp_num"])
        .contains("16")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "pgp_num never reached 16"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    // The driver catches up after 5 s unused: that long at least.
    if let Some(rest) = std::time::Duration::from_secs(6).checked_sub(idle_from.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    let log = cluster.dir.path().join("osd.0.log");
    let from = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    cluster.ceph(&["tell", "osd.0", "config", "set", "debug_ms", "1"]);
    let second = h.create_volume(make("pvc-after")).await;
    cluster.ceph(&["tell", "osd.0", "config", "set", "debug_ms", "0"]);
    let text = std::fs::read(&log).unwrap();
    let text = String::from_utf8_lossy(&text[from as usize..]);
    let ops: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("<== client.") && l.contains("osd_op("))
        .collect();
    assert!(
        ops.len() >= 3,
        "the create's ops are in the OSD's log:\n{text}"
    );
    let resent: Vec<&&str> = ops.iter().filter(|l| l.contains("+retry+")).collect();
    assert!(resent.is_empty(), "ops sent again: {resent:#?}");
    h.delete_volume(&first.volume_id).await;
    h.delete_volume(&second.volume_id).await;
    assert!(images(&cluster).is_empty(), "{:?}", images(&cluster));
}

/// A pool that takes no more data (its object quota reached): CreateVolume
/// answers RESOURCE_EXHAUSTED naming the pool and its flags once librados
/// gives up (its op timeout, 30 s), not UNAVAILABLE with "timed out" (the
/// OSD drops the driver's first write, to its record of making, and the
/// client is told nothing else); with the quota lifted, the CO's retry of
/// the same call makes the volume.
#[tokio::test]
async fn rbd_a_full_pool_is_resource_exhausted() {
    require_root();
    let cluster = CephCluster::new();
    let h = Harness::start_with(Some(&rbd_config(&cluster, "librbd"))).await;
    let mut req = create_req("pvc-full", 4 * MIB, mount_cap("ext4", SNW));
    req.secrets = secrets(&cluster);
    let full =
        || {
            let pools: serde_json::Value = serde_json::from_str(
                &cluster.ceph(&["osd", "pool", "ls", "detail", "--format", "json"]),
            )
            .unwrap();
            pools.as_array().unwrap().iter().any(|p| {
                p["pool_name"] == "rbd" && p["flags_names"].as_str().unwrap().contains("full")
            })
        };
    let settle = |want: bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while full() != want {
            assert!(
                std::time::Instant::now() < deadline,
                "the pool's full flag never became {want}"
            );
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
    };
    cluster.ceph(&["osd", "pool", "set-quota", "rbd", "max_objects", "1"]);
    settle(true);
    let asked = std::time::Instant::now();
    let e = h
        .controller()
        .create_volume(req.clone())
        .await
        .expect_err("a volume made in a full pool");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("pool rbd is full ("), "{e:?}");
    assert!(e.message().contains("full_quota"), "{e:?}");
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(80),
        "{:?}",
        asked.elapsed()
    );
    assert!(!h.log().contains(&cluster.client_key()));
    cluster.ceph(&["osd", "pool", "set-quota", "rbd", "max_objects", "0"]);
    settle(false);
    let vol = h.create_volume(req).await;
    h.delete_volume(&vol.volume_id).await;
    assert!(images(&cluster).is_empty(), "{:?}", images(&cluster));
}
