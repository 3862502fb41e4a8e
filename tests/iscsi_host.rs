//! The iscsi backend's controller path on the host, through the binary,
//! against a real tgtd on loopback (tgt is user space; the host kernel has
//! no iSCSI initiator, so access is checked from the outside with
//! libiscsi's user-space tools). The node path runs in the guest. Needs
//! root, tgt and libiscsi-bin.

mod common;

use common::fixtures::Tgtd;
use common::*;
use ferrovol::proto as pb;
use std::collections::HashMap;
use std::process::Command;
use tonic::Code;

const NODE_A: &str = "iqn.2026-11.io.ferrovol.test:node-a";
const NODE_B: &str = "iqn.2026-11.io.ferrovol.test:node-b";
const SECRET: &str = "sesame-0123456789";

fn config(t: &Tgtd, initiator_file: &std::path::Path) -> String {
    format!(
        "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"iqn.2026-11.io.ferrovol.test\"\n\
         portals = [\"{}\"]\ncontrol_port = {}\ninitiator_name_file = \"{}\"\n\
         [backend.store]\ntype = \"file\"\npool = \"@DIR@/pool\"\n",
        t.portal(),
        t.control_port,
        initiator_file.display()
    )
}

/// Whether `initiator` can read LUN 1's capacity (a login, an INQUIRY
/// and a READ CAPACITY), with CHAP when `chap` is given. Returns the
/// size in bytes on success.
fn capacity_as(t: &Tgtd, iqn: &str, initiator: &str, chap: Option<(&str, &str)>) -> Option<u64> {
    let url = match chap {
        Some((user, _)) => format!("iscsi://{user}@{}/{iqn}/1", t.portal()),
        None => format!("iscsi://{}/{iqn}/1", t.portal()),
    };
    let mut cmd = Command::new("iscsi-readcapacity16");
    cmd.args(["-i", initiator, &url]);
    if let Some((_, password)) = chap {
        // libiscsi reads the secret from the environment: not on argv.
        cmd.env("LIBISCSI_CHAP_PASSWORD", password);
    }
    let out = cmd.output().expect("iscsi-readcapacity16 (libiscsi-bin)");
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Total size:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The VolumeExpansion mode the driver advertises.
async fn expansion(h: &Harness) -> Option<pb::plugin_capability::volume_expansion::Type> {
    let caps = h
        .identity()
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    caps.capabilities.iter().find_map(|c| match &c.r#type {
        Some(pb::plugin_capability::Type::VolumeExpansion(e)) => e.r#type.try_into().ok(),
        _ => None,
    })
}

/// An initiator-name file naming `iqn.2026-11.io.ferrovol.test:<name>`.
fn initiator_file(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("initiatorname.iscsi");
    std::fs::write(
        &file,
        format!("InitiatorName=iqn.2026-11.io.ferrovol.test:{name}\n"),
    )
    .unwrap();
    (dir, file)
}

fn secrets(user: &str, password: &str) -> HashMap<String, String> {
    HashMap::from([
        ("chapUsername".to_string(), user.to_string()),
        ("chapPassword".to_string(), password.to_string()),
    ])
}

fn publish(id: &str, initiator: &str, secret: &str) -> pb::ControllerPublishVolumeRequest {
    pb::ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: format!("node/{initiator}"),
        volume_capability: Some(mount_cap("ext4", SNW)),
        secrets: secrets("alice", secret),
        ..Default::default()
    }
}

fn unpublish(id: &str, initiator: &str) -> pb::ControllerUnpublishVolumeRequest {
    pb::ControllerUnpublishVolumeRequest {
        volume_id: id.into(),
        node_id: format!("node/{initiator}"),
        ..Default::default()
    }
}

#[tokio::test]
async fn iscsi_controller_grants_access_on_a_real_tgtd() {
    require_root();
    let mut t = Tgtd::new();
    let names = tempfile::tempdir().unwrap();
    let initiator_file = names.path().join("initiatorname.iscsi");
    std::fs::write(
        &initiator_file,
        "## this node\nInitiatorName=iqn.2026-11.io.ferrovol.test:this-node\n",
    )
    .unwrap();
    let h = Harness::start_with(Some(&config(&t, &initiator_file))).await;
    // The node id carries the initiator name.
    let info = h
        .node()
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        info.node_id,
        "test-node/iqn.2026-11.io.ferrovol.test:this-node"
    );
    let mut c = h.controller();

    // ControllerPublish is advertised.
    let caps = c
        .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        format!("{caps:?}").contains("PublishUnpublishVolume"),
        "{caps:?}"
    );
    // Expansion is offline with iscsi alone (a LUN grows only unused).
    assert_eq!(
        expansion(&h).await,
        Some(pb::plugin_capability::volume_expansion::Type::Offline)
    );

    let vol = h
        .create(create_req("pvc-iscsi", 16 * MIB, mount_cap("ext4", SNW)))
        .await;
    let id = vol.volume_id.clone();
    assert!(id.starts_with("iscsi:"), "{id}");
    let shown = t.tgtadm(&["--op", "show", "--mode", "target"]);
    assert!(shown.contains("iqn.2026-11.io.ferrovol.test:"), "{shown}");
    // A retried create finds the same target.
    let again = h
        .create(create_req("pvc-iscsi", 16 * MIB, mount_cap("ext4", SNW)))
        .await;
    assert_eq!(again.volume_id, id);
    assert_eq!(
        t.tgtadm(&["--op", "show", "--mode", "target"])
            .matches("Target ")
            .count(),
        1
    );

    // Before publish nobody gets in.
    let ctx = c
        .controller_publish_volume(publish(&id, NODE_A, SECRET))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let iqn = ctx["iqn"].clone();
    assert_eq!(ctx["portals"], t.portal());
    assert_eq!(ctx["lun"], "1");
    // Idempotent.
    c.controller_publish_volume(publish(&id, NODE_A, SECRET))
        .await
        .unwrap();

    // From the outside: the published initiator with the secret gets in;
    // another initiator, or a wrong secret, or no CHAP, does not.
    assert_eq!(
        capacity_as(&t, &iqn, NODE_A, Some(("alice", SECRET))),
        Some(16 << 20)
    );
    assert_eq!(capacity_as(&t, &iqn, NODE_B, Some(("alice", SECRET))), None);
    assert_eq!(
        capacity_as(&t, &iqn, NODE_A, Some(("alice", "wrong-secret-0000"))),
        None
    );
    assert_eq!(capacity_as(&t, &iqn, NODE_A, None), None);

    // A second node while it is published to the first: refused (every
    // iscsi access mode is single-node), naming the first; B stays out.
    let r = c
        .controller_publish_volume(publish(&id, NODE_B, SECRET))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert!(format!("{r:?}").contains(NODE_A), "{r:?}");
    assert_eq!(capacity_as(&t, &iqn, NODE_B, Some(("alice", SECRET))), None);

    // The secret never reached the log.
    assert!(!h.log().contains(SECRET));

    // A published volume is not grown: tgt reopens a LUN's store to
    // learn its size, and I/O in flight meanwhile fails. The refusal
    // names who uses it, and nothing changed.
    let r = c.controller_expand_volume(expand_req(&id, 32 * MIB)).await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert!(format!("{r:?}").contains(NODE_A), "{r:?}");
    assert_eq!(
        capacity_as(&t, &iqn, NODE_A, Some(("alice", SECRET))),
        Some(16 << 20)
    );
    // Asking for what it has is no expansion: done.
    let same = c
        .controller_expand_volume(expand_req(&id, 16 * MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(same.capacity_bytes, 16 * MIB);

    // tgtd restarts and forgets everything: the next publish rebuilds the
    // target with its LUN, ACL and CHAP.
    t.kill();
    t.start();
    assert_eq!(capacity_as(&t, &iqn, NODE_A, Some(("alice", SECRET))), None);
    c.controller_publish_volume(publish(&id, NODE_A, SECRET))
        .await
        .unwrap();
    assert_eq!(
        capacity_as(&t, &iqn, NODE_A, Some(("alice", SECRET))),
        Some(16 << 20)
    );
    assert_eq!(capacity_as(&t, &iqn, NODE_B, Some(("alice", SECRET))), None);

    // Unpublish takes the node off the ACL; twice is fine.
    for _ in 0..2 {
        c.controller_unpublish_volume(unpublish(&id, NODE_A))
            .await
            .unwrap();
    }
    assert_eq!(capacity_as(&t, &iqn, NODE_A, Some(("alice", SECRET))), None);

    // Unpublished, it grows: the store, then the LUN on the same target
    // (same SCSI identity), which the next publish shows.
    let serial = |t: &Tgtd| {
        let shown = t.tgtadm(&["--op", "show", "--mode", "target"]);
        shown
            .lines()
            .rfind(|l| l.contains("SCSI SN:"))
            .map(str::to_string)
    };
    let before = serial(&t);
    assert!(before.is_some());
    let grown = c
        .controller_expand_volume(expand_req(&id, 32 * MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 32 * MIB);
    assert!(grown.node_expansion_required);
    assert_eq!(serial(&t), before);
    c.controller_publish_volume(publish(&id, NODE_A, SECRET))
        .await
        .unwrap();
    assert_eq!(
        capacity_as(&t, &iqn, NODE_A, Some(("alice", SECRET))),
        Some(32 << 20)
    );
    c.controller_unpublish_volume(unpublish(&id, NODE_A))
        .await
        .unwrap();

    // A node that reported no initiator name is not a node of this backend.
    let r = c
        .controller_publish_volume(pb::ControllerPublishVolumeRequest {
            node_id: "plain-node".into(),
            ..publish(&id, NODE_A, SECRET)
        })
        .await;
    assert_eq!(code(&r), Code::NotFound, "{r:?}");
    let r = c
        .controller_publish_volume(publish("iscsi:no-such-volume", NODE_A, SECRET))
        .await;
    assert_eq!(code(&r), Code::NotFound, "{r:?}");

    // Delete removes target, device and image; twice is fine.
    for _ in 0..2 {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    assert!(!t
        .tgtadm(&["--op", "show", "--mode", "target"])
        .contains("Target "));
    assert!(h.loop_devices().is_empty(), "{:?}", h.loop_devices());
}

/// One driver with file, lvm and iscsi backends: ControllerPublish is
/// advertised, and each backend answers it as it should: the node-local
/// ones with an empty context on their own node and NOT_FOUND for another,
/// iscsi with the target to log in to (and FAILED_PRECONDITION for a
/// second node meanwhile); unpublish is idempotent for all.
#[tokio::test]
async fn a_mixed_deployment_answers_controller_publish_per_backend() {
    require_root();
    use common::fixtures::{LvmVg, LVM_NO_ACTIVATION};
    let t = Tgtd::new();
    let (_names, initiator_file) = initiator_file("mixed");
    let vg_name = format!("fvmixed{}", std::process::id());
    let _vg = LvmVg::with_config(&vg_name, 64, LVM_NO_ACTIVATION);
    let config = format!(
        "default_backend = \"file\"\n\
         [[backend]]\ntype = \"file\"\npool = \"@DIR@/files\"\n\
         [[backend]]\ntype = \"lvm\"\nlvm_config = '{LVM_NO_ACTIVATION}'\n\
         [[backend.device_class]]\nname = \"fast\"\nvolume_group = \"{vg_name}\"\nzero_on_delete = false\n\
         {}",
        config(&t, &initiator_file)
    );
    let h = Harness::start_with(Some(&config)).await;
    let mut c = h.controller();
    let caps = c
        .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        format!("{caps:?}").contains("PublishUnpublishVolume"),
        "{caps:?}"
    );
    // file and lvm grow volumes in use: expansion is online (iscsi still
    // refuses its own volumes while they are published).
    assert_eq!(
        expansion(&h).await,
        Some(pb::plugin_capability::volume_expansion::Type::Online)
    );
    let me = h
        .node()
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(me.node_id, "test-node/iqn.2026-11.io.ferrovol.test:mixed");
    // The topology value stays the plain node name.
    assert_eq!(
        me.accessible_topology.unwrap().segments["topology.ferrovol.io/node"],
        "test-node"
    );
    let other = "other-node/iqn.2026-11.io.ferrovol.test:other";

    let mut ids = Vec::new();
    for (name, backend) in [("pvc-f", "file"), ("pvc-l", "lvm"), ("pvc-i", "iscsi")] {
        let mut req = create_req(name, 8 * MIB, mount_cap("ext4", SNW));
        req.parameters = HashMap::from([("backend".to_string(), backend.to_string())]);
        if backend == "lvm" {
            req.parameters.insert("deviceClass".into(), "fast".into());
        }
        let vol = h.create(req).await;
        assert!(
            vol.volume_id.starts_with(&format!("{backend}:")),
            "{}",
            vol.volume_id
        );
        ids.push((backend, vol.volume_id));
    }
    for (backend, id) in &ids {
        let here = c
            .controller_publish_volume(pb::ControllerPublishVolumeRequest {
                node_id: me.node_id.clone(),
                ..publish(id, "unused", SECRET)
            })
            .await
            .unwrap()
            .into_inner()
            .publish_context;
        let there = c
            .controller_publish_volume(pb::ControllerPublishVolumeRequest {
                node_id: other.into(),
                ..publish(id, "unused", SECRET)
            })
            .await;
        match *backend {
            "iscsi" => {
                assert!(
                    here["iqn"].starts_with("iqn.2026-11.io.ferrovol.test:"),
                    "{here:?}"
                );
                // Single-node: not published to a second node meanwhile.
                assert_eq!(code(&there), Code::FailedPrecondition, "{there:?}");
                let shown = t.tgtadm(&["--op", "show", "--mode", "target"]);
                assert!(
                    shown.contains("iqn.2026-11.io.ferrovol.test:mixed"),
                    "{shown}"
                );
                assert!(
                    !shown.contains("iqn.2026-11.io.ferrovol.test:other"),
                    "{shown}"
                );
            }
            _ => {
                assert!(here.is_empty(), "{backend}: {here:?}");
                assert_eq!(code(&there), Code::NotFound, "{backend}: {there:?}");
            }
        }
        for _ in 0..2 {
            c.controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                volume_id: id.clone(),
                node_id: me.node_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        }
    }
    for (_, id) in &ids {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
}

/// ControllerPublish's `readonly` reaches the node: the publish context
/// says so, and NodeStage and NodePublish then serve the volume read-only
/// whatever NodePublish's own flag. (A file volume here: the iscsi backend
/// makes the driver answer ControllerPublish; its node side needs the
/// guest.)
#[tokio::test]
async fn a_read_only_controller_publish_is_read_only_on_the_node() {
    require_root();
    let t = Tgtd::new();
    let (_names, initiator_file) = initiator_file("ro");
    let config = format!(
        "default_backend = \"file\"\n[[backend]]\ntype = \"file\"\npool = \"@DIR@/files\"\n{}",
        config(&t, &initiator_file)
    );
    let h = Harness::start_with(Some(&config)).await;
    let node_id = h.node_id().await;
    let cap = mount_cap("ext4", SNW);
    let p = h.provision("pvc-ro", 16 * MIB, cap.clone()).await;
    std::fs::write(p.target.join("data"), b"before").unwrap();
    h.unpublish_unstage(&p.id, &p.staging, &p.target).await;

    let publish = |readonly: bool| pb::ControllerPublishVolumeRequest {
        volume_id: p.id.clone(),
        node_id: node_id.clone(),
        volume_capability: Some(cap.clone()),
        readonly,
        ..Default::default()
    };
    let rw = h
        .controller()
        .controller_publish_volume(publish(false))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert!(!rw.contains_key("readonly"), "{rw:?}");
    let ctx = h
        .controller()
        .controller_publish_volume(publish(true))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert_eq!(ctx.get("readonly").map(String::as_str), Some("true"));
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            publish_context: ctx.clone(),
            ..stage_req(&p.id, &p.staging, cap.clone())
        })
        .await
        .unwrap();
    h.node()
        .node_publish_volume(pb::NodePublishVolumeRequest {
            publish_context: ctx.clone(),
            ..publish_req(&p.id, &p.staging, &p.target, cap.clone(), false)
        })
        .await
        .unwrap();
    assert_eq!(std::fs::read(p.target.join("data")).unwrap(), b"before");
    let e = std::fs::write(p.target.join("data"), b"after").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(30), "EROFS: {e}");
    h.teardown(&p).await;
}

/// A publish to node `node-<name>` (the helpers name every node `node`).
fn on(
    mut req: pb::ControllerPublishVolumeRequest,
    name: &str,
) -> pb::ControllerPublishVolumeRequest {
    req.node_id = req.node_id.replacen("node/", &format!("node-{name}/"), 1);
    req
}

fn off(
    mut req: pb::ControllerUnpublishVolumeRequest,
    name: &str,
) -> pb::ControllerUnpublishVolumeRequest {
    req.node_id = req.node_id.replacen("node/", &format!("node-{name}/"), 1);
    req
}

/// Attach limits at the controller: a node holding `max_volumes_per_node`
/// volumes gets no more (RESOURCE_EXHAUSTED, and the target's ACL is left
/// alone), the volumes it holds are answered again, another node has its
/// own count, and the count outlives a crash of the controller.
#[tokio::test]
async fn a_node_at_its_attach_limit_is_refused_and_the_count_outlives_a_crash() {
    require_root();
    let t = Tgtd::new();
    let (_names, initiator_file) = initiator_file("this-node");
    let config = format!(
        "[node]\nmax_volumes_per_node = 2\n{}",
        config(&t, &initiator_file)
    );
    let mut h = Harness::start_with(Some(&config)).await;
    let info = h
        .node()
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    // iSCSI LUNs have no kernel ceiling: the configured count.
    assert_eq!(info.max_volumes_per_node, 2);
    let mut c = h.controller();
    let mut ids = Vec::new();
    for n in 0..3 {
        let v = h
            .create(create_req(
                &format!("pvc-limit-{n}"),
                16 * MIB,
                mount_cap("ext4", SNW),
            ))
            .await;
        ids.push(v.volume_id);
    }
    let grants_to = |initiator: &str| {
        t.tgtadm(&["--op", "show", "--mode", "target"])
            .matches(initiator)
            .count()
    };
    for id in &ids[..2] {
        c.controller_publish_volume(on(publish(id, NODE_A, SECRET), "a"))
            .await
            .unwrap();
    }
    let refused = c
        .controller_publish_volume(on(publish(&ids[2], NODE_A, SECRET), "a"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("node node-a has 2 volumes"),
        "{refused:?}"
    );
    assert_eq!(grants_to(NODE_A), 2, "the refused volume's ACL was touched");
    // Held volumes are answered again; another node has room.
    c.controller_publish_volume(on(publish(&ids[0], NODE_A, SECRET), "a"))
        .await
        .unwrap();
    c.controller_publish_volume(on(publish(&ids[2], NODE_B, SECRET), "b"))
        .await
        .unwrap();

    // A crash: the restarted controller still knows node A is full.
    h.kill();
    h.spawn().await;
    let mut c = h.controller();
    let again = c
        .controller_publish_volume(on(publish(&ids[2], NODE_A, SECRET), "a"))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::ResourceExhausted, "{again:?}");
    // A volume leaves node A: the third (moved from B) gets its place.
    c.controller_unpublish_volume(off(unpublish(&ids[0], NODE_A), "a"))
        .await
        .unwrap();
    c.controller_unpublish_volume(off(unpublish(&ids[2], NODE_B), "b"))
        .await
        .unwrap();
    c.controller_publish_volume(on(publish(&ids[2], NODE_A, SECRET), "a"))
        .await
        .unwrap();
    assert_eq!(grants_to(NODE_A), 2);

    for (id, node) in [(&ids[1], NODE_A), (&ids[2], NODE_A), (&ids[2], NODE_B)] {
        c.controller_unpublish_volume(unpublish(id, node))
            .await
            .unwrap();
    }
    for id in &ids {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    assert_eq!(grants_to(NODE_A) + grants_to(NODE_B), 0);
}

/// A controller killed inside ControllerPublish, before the backend
/// attached (`attach.reserved`) and after it (`attach.attached`): the
/// node's place was on disk first, so the started controller counts it
/// (at a limit of one, another volume is refused: the node never gets more
/// than its limit, and a grant the backend may hold is never forgotten);
/// the CO's retry of the same publish succeeds with the one ACL entry; its
/// unpublish frees the place for the other volume.
#[tokio::test]
async fn a_publish_cut_short_keeps_its_place_until_the_co_settles_it() {
    require_root();
    let t = Tgtd::new();
    let (_names, initiator_file) = initiator_file("this-node");
    let config = format!(
        "[node]\nmax_volumes_per_node = 1\n{}",
        config(&t, &initiator_file)
    );
    let mut h = Harness::start_with(Some(&config)).await;
    let grants_to = |initiator: &str| {
        t.tgtadm(&["--op", "show", "--mode", "target"])
            .matches(initiator)
            .count()
    };
    let mut ids = Vec::new();
    for n in 0..2 {
        ids.push(
            h.create_volume(create_req(
                &format!("pvc-cut-{n}"),
                16 * MIB,
                mount_cap("ext4", SNW),
            ))
            .await
            .volume_id,
        );
    }
    for point in ["attach.reserved", "attach.attached"] {
        h.env = vec![("FERROVOL_KILL_AT".into(), point.into())];
        h.kill();
        h.spawn().await;
        let died = h
            .controller()
            .controller_publish_volume(on(publish(&ids[0], NODE_A, SECRET), "a"))
            .await;
        assert!(died.is_err(), "{point}: {died:?}");
        h.kill();
        h.env.clear();
        h.spawn().await;
        let mut c = h.controller();
        let refused = c
            .controller_publish_volume(on(publish(&ids[1], NODE_A, SECRET), "a"))
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            Code::ResourceExhausted,
            "{point}: {refused:?}"
        );
        c.controller_publish_volume(on(publish(&ids[0], NODE_A, SECRET), "a"))
            .await
            .unwrap_or_else(|e| panic!("{point}: the retry: {e:?}\n{}", h.log()));
        assert_eq!(grants_to(NODE_A), 1, "{point}");
        c.controller_unpublish_volume(off(unpublish(&ids[0], NODE_A), "a"))
            .await
            .unwrap();
        c.controller_publish_volume(on(publish(&ids[1], NODE_A, SECRET), "a"))
            .await
            .unwrap_or_else(|e| panic!("{point}: the place was not freed: {e:?}"));
        c.controller_unpublish_volume(off(unpublish(&ids[1], NODE_A), "a"))
            .await
            .unwrap();
        assert_eq!(grants_to(NODE_A), 0, "{point}");
    }
    for id in &ids {
        h.delete_volume(id).await;
    }
}

/// Mutable parameters through the binary on a real tgtd: the LUN's thin
/// provisioning (changed live, seen in tgt's own listing) and the file
/// store's preallocation passed on; a set with one bad value changes
/// nothing.
#[tokio::test]
async fn iscsi_mutable_parameters_change_the_live_lun_and_the_store() {
    require_root();
    let t = Tgtd::new();
    let (_names, initiator_file) = initiator_file("this-node");
    let mut h = Harness::start_with(Some(&config(&t, &initiator_file))).await;
    let mut c = h.controller();
    let mut req = create_req("pvc-mut", 16 * MIB, mount_cap("ext4", SNW));
    req.mutable_parameters = HashMap::from([("thinProvisioning".into(), "true".into())]);
    let id = h.create(req).await.volume_id;
    // tgt's listing of LUN 1: its Thin-provisioning line.
    let thin = || {
        let shown = t.tgtadm(&["--op", "show", "--mode", "target"]);
        let lun1 = shown.split("LUN: 1").nth(1).expect("LUN 1").to_string();
        lun1.lines()
            .find_map(|l| l.trim().strip_prefix("Thin-provisioning: "))
            .map(|v| v == "Yes")
            .expect("a Thin-provisioning line")
    };
    assert!(thin(), "set at create");
    let image = h.path("pool/volumes/pvc-mut.img");
    let allocated = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&image).unwrap().blocks() * 512
    };
    assert!(allocated() < MIB as u64);
    let modify = |pairs: &[(&str, &str)]| pb::ControllerModifyVolumeRequest {
        volume_id: id.clone(),
        mutable_parameters: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let bad = c
        .controller_modify_volume(modify(&[
            ("thinProvisioning", "false"),
            ("preallocate", "maybe"),
        ]))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("preallocate"), "{bad:?}");
    assert!(thin(), "nothing changed");
    // Killed between the store's change and the LUN's
    // (`iscsi.modify.store`): the volume is half changed until the CO's
    // retry of the same call, which completes it.
    h.env = vec![("FERROVOL_KILL_AT".into(), "iscsi.modify.store".into())];
    h.kill();
    h.spawn().await;
    let died = h
        .controller()
        .controller_modify_volume(modify(&[
            ("thinProvisioning", "false"),
            ("preallocate", "true"),
        ]))
        .await;
    assert!(died.is_err(), "{died:?}");
    h.kill();
    h.env.clear();
    assert_eq!(allocated(), 16 * MIB as u64, "the store's change was made");
    assert!(thin(), "the LUN's change was not");
    h.spawn().await;
    let mut c = h.controller();
    c.controller_modify_volume(modify(&[
        ("thinProvisioning", "false"),
        ("preallocate", "true"),
    ]))
    .await
    .unwrap();
    assert!(!thin());
    assert_eq!(allocated(), 16 * MIB as u64);
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
}

/// iSCSI group snapshots: taken while no member is published (the store's
/// snapshots, one per member, each naming its group); a group with a
/// member published to a node is refused with nothing made.
#[tokio::test]
async fn iscsi_group_snapshots_of_volumes_not_in_use() {
    require_root();
    let t = Tgtd::new();
    let (_names, initiator_file) = initiator_file("this-node");
    let h = Harness::start_with(Some(&config(&t, &initiator_file))).await;
    let mut c = h.controller();
    let mut ids = Vec::new();
    for name in ["pvc-gdata", "pvc-gwal"] {
        ids.push(
            h.create(create_req(name, 8 * MIB, mount_cap("ext4", SNW)))
                .await
                .volume_id,
        );
    }
    let request = |name: &str| pb::CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: ids.clone(),
        ..Default::default()
    };
    let snapshots = || {
        let mut c = h.controller();
        async move {
            c.list_snapshots(pb::ListSnapshotsRequest::default())
                .await
                .unwrap()
                .into_inner()
                .entries
                .len()
        }
    };
    c.controller_publish_volume(on(publish(&ids[0], NODE_A, SECRET), "a"))
        .await
        .unwrap();
    let refused = h
        .group()
        .create_volume_group_snapshot(request("g-busy"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains(NODE_A), "{refused:?}");
    assert_eq!(snapshots().await, 0);
    c.controller_unpublish_volume(off(unpublish(&ids[0], NODE_A), "a"))
        .await
        .unwrap();
    let g = h
        .group()
        .create_volume_group_snapshot(request("g-1"))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(g.snapshots.len(), 2);
    for s in &g.snapshots {
        assert!(s.snapshot_id.starts_with("iscsi:"), "{s:?}");
        assert_eq!(s.group_snapshot_id, g.group_snapshot_id);
    }
    assert_eq!(snapshots().await, 2);
    h.delete_group(&g.group_snapshot_id, Default::default())
        .await;
    assert_eq!(snapshots().await, 0);
    for id in ids {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await
        .unwrap();
    }
}

/// Changed block tracking of iSCSI volumes is their store's: on a file
/// store, blocks written into a LUN's image between two snapshots are the
/// delta, answered under the iscsi backend's own snapshot ids.
#[tokio::test]
async fn iscsi_changed_blocks_come_from_the_store() {
    require_root();
    let t = Tgtd::new();
    let (_names, initiator_file) = initiator_file("this-node");
    let h = Harness::start_with(Some(&config(&t, &initiator_file))).await;
    let id = h
        .create(create_req("pvc-cbt", 8 * MIB, block_cap(SNW)))
        .await
        .volume_id;
    // Written as tgtd would: into the LUN's image, synced.
    let image = h.path("pool/volumes/pvc-cbt.img");
    let write = |block: u64, byte: u8| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .unwrap();
        f.write_all_at(&[byte; 4096], block * 4096).unwrap();
        f.sync_all().unwrap();
    };
    write(3, 1);
    let s1 = h.snapshot("cbt-a", &id).await;
    write(3, 2);
    write(700, 2);
    let s2 = h.snapshot("cbt-b", &id).await;
    assert!(s1.starts_with("iscsi:"), "{s1}");
    let mut stream = h
        .metadata()
        .get_metadata_delta(pb::GetMetadataDeltaRequest {
            base_snapshot_id: s1.clone(),
            target_snapshot_id: s2.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        assert_eq!(m.volume_capacity_bytes, 8 * MIB);
        got.extend(
            m.block_metadata
                .iter()
                .map(|b| (b.byte_offset, b.size_bytes)),
        );
    }
    assert_eq!(got, vec![(3 * 4096, 4096), (700 * 4096, 4096)]);
    let missing = h
        .metadata()
        .get_metadata_allocated(pb::GetMetadataAllocatedRequest {
            snapshot_id: "iscsi:nosuch".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound, "{missing:?}");
}
