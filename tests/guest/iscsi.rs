//! The `iscsi` backend: tgtd and open-iscsi in the guest, plain and CHAP
//! logins, two pods on one node, multipath.

use super::*;

#[test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
fn guest_iscsi_fixture_logs_in_and_mounts_a_lun() {
    require_guest();
    let target = IscsiTarget::new("iqn.2026-11.io.ferrovol:fixture", 64);
    let lun = target.login();
    let dev = std::fs::canonicalize(&lun).unwrap();
    assert!(
        dev.to_string_lossy().starts_with("/dev/sd"),
        "{}",
        dev.display()
    );
    run("mkfs.ext4", &["-q", "-F", lun.to_str().unwrap()]);
    let mnt = target.dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    run("mount", &[lun.to_str().unwrap(), mnt.to_str().unwrap()]);
    std::fs::write(mnt.join("f"), b"over iSCSI").unwrap();
    run("umount", &[mnt.to_str().unwrap()]);
    target.logout();
    wait_for("the LUN to go away", Duration::from_secs(30), || {
        !lun.exists()
    });
}

/// The iscsi backend end to end with open-iscsi against tgtd: CHAP and
/// mutual CHAP, a mounted and a raw block volume, a driver restart between
/// stage and unstage (the session is found, not logged in twice),
/// expansion seen by the node, delete refused while logged in, a wrong
/// secret refused at stage with nothing left behind, unstage after the
/// target dropped the LUN, and no session, disk or node record left.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_iscsi_backend_full_lifecycle() {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let prefix = "iqn.2026-11.io.ferrovol.guest";
    let config = tgtd.file_store_config(prefix);
    let mut h = Harness::start_with(Some(&config)).await;
    let node_id = h.node_id().await;
    assert!(node_id.starts_with("test-node/iqn."), "{node_id}");
    let secrets = HashMap::from([
        ("chapUsername".to_string(), "guest-user".to_string()),
        ("chapPassword".to_string(), "guest-secret-0001".to_string()),
        ("chapMutualUsername".to_string(), "target-user".to_string()),
        (
            "chapMutualPassword".to_string(),
            "target-secret-002".to_string(),
        ),
    ]);
    let ours =
        |lines: Vec<String>| -> usize { lines.iter().filter(|l| l.contains(prefix)).count() };

    // A mounted volume.
    let cap = mount_cap("ext4", SNW);
    let vol = h
        .create(create_req("pvc-iscsi-fs", 32 * MIB, cap.clone()))
        .await;
    let id = vol.volume_id.clone();
    let ctx = h.attach_here(&id, &cap, &secrets).await;
    let staging = h.path("kubelet/staging/fs");
    let target = h.path("kubelet/pods/fs");
    std::fs::create_dir_all(&staging).unwrap();
    // Stages from here on carry no volume context: the header on the
    // device is what says the volume is encrypted.
    let stage = |secrets: HashMap<String, String>| pb::NodeStageVolumeRequest {
        publish_context: ctx.clone(),
        secrets,
        ..stage_req(&id, &staging, cap.clone())
    };

    // A wrong secret: refused, no session and no record left.
    let mut wrong = secrets.clone();
    wrong.insert("chapPassword".into(), "not-the-secret-9".into());
    let r = h.node().node_stage_volume(stage(wrong)).await;
    assert_eq!(code(&r), tonic::Code::FailedPrecondition, "{r:?}");
    assert!(format!("{r:?}").contains("CHAP"), "{r:?}");
    assert_eq!(ours(Iscsid::sessions()), 0);
    // A target that answers with the wrong mutual secret is not trusted.
    let mut wrong = secrets.clone();
    wrong.insert("chapMutualPassword".into(), "not-the-target-9".into());
    let r = h.node().node_stage_volume(stage(wrong)).await;
    assert!(r.is_err(), "a wrong mutual CHAP secret was accepted");
    assert_eq!(ours(Iscsid::sessions()), 0);
    let records = std::process::Command::new("iscsiadm")
        .args(["-m", "node"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&records.stdout).contains(prefix));

    h.node()
        .node_stage_volume(stage(secrets.clone()))
        .await
        .unwrap();
    assert_eq!(ours(Iscsid::sessions()), 1);
    let record = run(
        "iscsiadm",
        &["-m", "node", "-T", &ctx["iqn"], "-p", &tgtd.portal()],
    );
    assert!(record.contains("node.startup = manual"), "{record}");
    h.node()
        .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
        .await
        .unwrap();
    std::fs::write(target.join("data"), b"over iSCSI with CHAP").unwrap();

    // Delete is refused while the node is logged in.
    let r = h
        .controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&r), tonic::Code::FailedPrecondition, "{r:?}");

    // A volume in use is not grown (tgt reopens a LUN's store to learn its
    // size, failing I/O in flight): refused, and the volume goes on.
    let before = h.total_bytes(&id, &target).await;
    let r = h
        .controller()
        .controller_expand_volume(expand_req(&id, 64 * MIB))
        .await;
    assert_eq!(code(&r), tonic::Code::FailedPrecondition, "{r:?}");
    std::fs::write(target.join("more"), b"still writable").unwrap();

    // A driver restart between stage and unstage: a repeated stage finds
    // the session instead of logging in twice, and unstage undoes it all.
    h.kill();
    h.spawn().await;
    h.node()
        .node_stage_volume(stage(secrets.clone()))
        .await
        .unwrap();
    assert_eq!(ours(Iscsid::sessions()), 1);
    assert_eq!(
        std::fs::read(target.join("data")).unwrap(),
        b"over iSCSI with CHAP"
    );
    h.unpublish_unstage(&id, &staging, &target).await;
    assert_eq!(ours(Iscsid::sessions()), 0);
    let nodes = std::process::Command::new("iscsiadm")
        .args(["-m", "node"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&nodes.stdout).contains(prefix));

    // Unused, it grows: unpublished, expanded, published and staged again
    // (the node logs in to the grown LUN), and the node grows the
    // filesystem.
    let publish_fs = pb::ControllerPublishVolumeRequest {
        volume_id: id.clone(),
        node_id: node_id.clone(),
        volume_capability: Some(cap.clone()),
        secrets: secrets.clone(),
        ..Default::default()
    };
    h.detach_here(&id).await;
    h.controller()
        .controller_expand_volume(expand_req(&id, 64 * MIB))
        .await
        .unwrap();
    h.controller()
        .controller_publish_volume(publish_fs.clone())
        .await
        .unwrap();
    let after = stage_grown(&h, stage(secrets.clone()), &target, &cap, 64 * MIB).await;
    assert!(after > before + 16 * MIB, "{before} -> {after}");
    assert_eq!(
        std::fs::read(target.join("more")).unwrap(),
        b"still writable"
    );
    h.unpublish_unstage(&id, &staging, &target).await;
    assert_eq!(ours(Iscsid::sessions()), 0);

    // A raw block volume, published as the device; then the target drops
    // the LUN while it is staged, and unstage still cleans up.
    let bcap = block_cap(SNW);
    let bvol = h
        .create(create_req("pvc-iscsi-block", 16 * MIB, bcap.clone()))
        .await;
    let bid = bvol.volume_id.clone();
    let bctx = h.attach_here(&bid, &bcap, &secrets).await;
    let bstaging = h.path("kubelet/staging/block");
    let btarget = h.path("kubelet/pods/block");
    std::fs::create_dir_all(&bstaging).unwrap();
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            publish_context: bctx.clone(),
            secrets: secrets.clone(),
            ..stage_req(&bid, &bstaging, bcap.clone())
        })
        .await
        .unwrap();
    h.node()
        .node_publish_volume(publish_req(&bid, &bstaging, &btarget, bcap.clone(), false))
        .await
        .unwrap();
    {
        use std::io::{Read, Seek, Write};
        let mut dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&btarget)
            .unwrap();
        dev.write_all(b"raw block over iSCSI").unwrap();
        dev.sync_all().unwrap();
        dev.seek(std::io::SeekFrom::Start(0)).unwrap();
        let mut back = [0u8; 20];
        dev.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"raw block over iSCSI");
        assert_eq!(dev.seek(std::io::SeekFrom::End(0)).unwrap(), 16 << 20);
    }
    // The target drops the LUN under the node.
    let tid = tgtd
        .tgtadm(&["--op", "show", "--mode", "target"])
        .lines()
        .find(|l| l.contains(&bctx["iqn"]))
        .and_then(|l| l.strip_prefix("Target "))
        .and_then(|l| l.split(':').next())
        .unwrap()
        .to_string();
    tgtd.tgtadm(&[
        "--op",
        "delete",
        "--mode",
        "logicalunit",
        "--tid",
        &tid,
        "--lun",
        "1",
    ]);
    h.unpublish_unstage(&bid, &bstaging, &btarget).await;
    assert_eq!(ours(Iscsid::sessions()), 0);

    // Clean up through the controller: nothing of ours left anywhere.
    for v in [&id, &bid] {
        h.detach_here(v).await;
        h.delete_volume(v).await;
    }
    assert!(!tgtd
        .tgtadm(&["--op", "show", "--mode", "target"])
        .contains("Target "));
    let sessions_left = std::fs::read_dir("/sys/class/iscsi_session")
        .map(|d| d.flatten().count())
        .unwrap_or(0);
    assert_eq!(sessions_left, 0, "iSCSI sessions left in sysfs");
}

/// Two portals with `multipath = true`: the node logs in through both and
/// stages a dm-multipath map over the two disks; expansion reaches the
/// map; the volume goes on when one path goes away; unstage flushes the map and
/// leaves no session, disk or record.
/// Two pods on one node share an iscsi volume (LUNs in tgtd's file
/// store), a filesystem one and a raw block one: the walk of
/// [`Harness::two_pods_on_one_node`] (SINGLE_NODE_WRITER and
/// SINGLE_NODE_MULTI_WRITER serve two writable targets, also across a
/// driver restart; SINGLE_NODE_SINGLE_WRITER refuses the second;
/// SINGLE_NODE_READER_ONLY serves two read-only ones), then no session
/// of ours is left.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_iscsi_two_pods_on_one_node_share_a_volume() {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let prefix = "iqn.2026-11.io.ferrovol.share";
    let mut h = Harness::start_with(Some(&tgtd.file_store_config(prefix))).await;
    for (name, cap) in [
        ("share-fs", mount_cap("ext4", SNW)),
        ("share-blk", block_cap(SNW)),
    ] {
        let vol = h
            .create_volume(create_req(name, 32 * MIB, cap.clone()))
            .await;
        let publish_context = h.attach_here(&vol.volume_id, &cap, &HashMap::new()).await;
        let staging = h.path(&format!("kubelet/staging/{name}"));
        std::fs::create_dir_all(&staging).unwrap();
        let stage = pb::NodeStageVolumeRequest {
            publish_context,
            volume_context: vol.volume_context.clone(),
            ..stage_req(&vol.volume_id, &staging, cap)
        };
        h.two_pods_on_one_node(&stage, name).await;
        assert!(
            !Iscsid::sessions().iter().any(|l| l.contains(prefix)),
            "{:?}",
            Iscsid::sessions()
        );
        h.detach_here(&vol.volume_id).await;
        h.delete_volume(&vol.volume_id).await;
    }
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_iscsi_multipath_over_two_portals() {
    require_guest();
    let tgtd = Tgtd::new();
    // A second portal on another loopback address.
    let second = format!("127.0.0.2:{}", tgtd.port);
    tgtd.tgtadm(&[
        "--op",
        "new",
        "--mode",
        "portal",
        "--param",
        &format!("portal={second}"),
    ]);
    let _iscsid = Iscsid::new();
    let prefix = "iqn.2026-11.io.ferrovol.mpath";
    let config = format!(
        "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"{prefix}\"\nportals = [\"{}\", \"{second}\"]\n\
         control_port = {}\nmultipath = true\n[backend.store]\ntype = \"file\"\npool = \"@DIR@/pool\"\n",
        tgtd.portal(),
        tgtd.control_port
    );
    let h = Harness::start_with(Some(&config)).await;
    let cap = mount_cap("ext4", SNW);
    let id = h
        .create(create_req("pvc-mpath", 32 * MIB, cap.clone()))
        .await
        .volume_id;
    let ctx = h.attach_here(&id, &cap, &HashMap::new()).await;
    let staging = h.path("kubelet/staging/mp");
    let target = h.path("kubelet/pods/mp");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            publish_context: ctx.clone(),
            ..stage_req(&id, &staging, cap.clone())
        })
        .await
        .unwrap();
    let sessions: Vec<String> = Iscsid::sessions()
        .into_iter()
        .filter(|l| l.contains(prefix))
        .collect();
    assert_eq!(sessions.len(), 2, "{sessions:?}");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mounts
        .lines()
        .find(|l| l.contains(staging.to_str().unwrap()))
        .expect("staged");
    assert!(
        line.contains("/dev/mapper/") || line.contains(" /dev/dm-"),
        "{line}"
    );
    h.node()
        .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
        .await
        .unwrap();
    std::fs::write(target.join("data"), b"over two paths").unwrap();

    // Expansion (while unused: refused in use, see the lifecycle test)
    // reaches the map: staged again over the grown LUN, the node grows
    // the filesystem on the map.
    let before = h.total_bytes(&id, &target).await;
    h.unpublish_unstage(&id, &staging, &target).await;
    h.detach_here(&id).await;
    h.controller()
        .controller_expand_volume(expand_req(&id, 64 * MIB))
        .await
        .unwrap();
    h.attach_here(&id, &cap, &HashMap::new()).await;
    let restage = pb::NodeStageVolumeRequest {
        publish_context: ctx.clone(),
        ..stage_req(&id, &staging, cap.clone())
    };
    let after = stage_grown(&h, restage, &target, &cap, 64 * MIB).await;
    assert!(after > before + 16 * MIB, "{before} -> {after}");
    let sessions: Vec<String> = Iscsid::sessions()
        .into_iter()
        .filter(|l| l.contains(prefix))
        .collect();
    assert_eq!(sessions.len(), 2, "{sessions:?}");

    // One path goes away: the volume goes on through the other.
    let sid = sessions[1]
        .split_whitespace()
        .nth(1)
        .unwrap()
        .trim_matches(|c| c == '[' || c == ']')
        .to_string();
    run("iscsiadm", &["-m", "session", "-r", &sid, "--logout"]);
    std::fs::write(target.join("more"), b"after a path went away").unwrap();
    run("sync", &[]);
    assert_eq!(
        std::fs::read(target.join("data")).unwrap(),
        b"over two paths"
    );

    h.unpublish_unstage(&id, &staging, &target).await;
    assert_eq!(
        Iscsid::sessions()
            .iter()
            .filter(|l| l.contains(prefix))
            .count(),
        0
    );
    // Multipath maps only: other device-mapper devices (the target
    // side's hold devices, a second lane's LVs) are not this test's.
    let maps = run("dmsetup", &["ls", "--target", "multipath"]);
    assert!(
        maps.trim().is_empty() || maps.trim() == "No devices found",
        "a multipath map was left behind: {maps}"
    );
    h.detach_here(&id).await;
    h.delete_volume(&id).await;
}
