//! Two nodes in two kernels: this guest (the servers, the controller and
//! node B) and the peer guest (node A), booted side by side by
//! `tests/guest/suite`. Volumes move between them, and a node that stops
//! answering while it holds a volume is fenced.

use super::common::fixtures::*;
use super::common::peer::*;
use super::common::*;
use ferrovol::proto as pb;
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

const MNRO: i32 = 3;
const SNSW: i32 = 6;

/// An iscsi backend on `tgtd` (listening on the private network), its LUNs
/// in a file pool; the same text configures both nodes. A session that
/// lost its connection fails its I/O after 10 s (open-iscsi's default is
/// 120 s): how long a fenced node's writers stay blocked.
fn iscsi_config(prefix: &str, tgtd: &Tgtd) -> String {
    format!(
        "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"{prefix}\"\nportals = [\"{}\"]\n\
         control_port = {}\nreplacement_timeout = 10\n\
         [backend.store]\ntype = \"file\"\npool = \"@DIR@/pool\"\n",
        tgtd.portal(),
        tgtd.control_port
    )
}

type Secrets = HashMap<String, String>;

fn attach_req(
    id: &str,
    node: &str,
    cap: &pb::VolumeCapability,
    secrets: &Secrets,
) -> pb::ControllerPublishVolumeRequest {
    pb::ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        volume_capability: Some(cap.clone()),
        secrets: secrets.clone(),
        ..Default::default()
    }
}

fn detach_req(id: &str, node: &str, secrets: &Secrets) -> pb::ControllerUnpublishVolumeRequest {
    pb::ControllerUnpublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        secrets: secrets.clone(),
    }
}

/// Stage and publish on the peer, with the context of the controller's
/// attach to it.
async fn stage_on_peer(
    peer: &PeerDriver,
    id: &str,
    name: &str,
    cap: &pb::VolumeCapability,
    ctx: &HashMap<String, String>,
    secrets: &Secrets,
) -> (String, String) {
    let staging = peer.path(&format!("kubelet/staging/{name}"));
    let target = peer.path(&format!("kubelet/pods/{name}"));
    peer.peer.sh(&format!("mkdir -p {staging}"));
    let stage = pb::NodeStageVolumeRequest {
        publish_context: ctx.clone(),
        secrets: secrets.clone(),
        ..stage_req(id, Path::new(&staging), cap.clone())
    };
    if let Err(e) = peer.node().node_stage_volume(stage).await {
        panic!("stage on the peer: {e}\n{}", peer.log());
    }
    peer.node()
        .node_publish_volume(publish_req(
            id,
            Path::new(&staging),
            Path::new(&target),
            cap.clone(),
            false,
        ))
        .await
        .unwrap();
    (staging, target)
}

/// Stage and publish on this guest's node.
async fn stage_here(
    h: &Harness,
    id: &str,
    name: &str,
    cap: &pb::VolumeCapability,
    ctx: &HashMap<String, String>,
    secrets: &Secrets,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let staging = h.path(&format!("kubelet/staging/{name}"));
    let target = h.path(&format!("kubelet/pods/{name}"));
    std::fs::create_dir_all(&staging).unwrap();
    let stage = pb::NodeStageVolumeRequest {
        publish_context: ctx.clone(),
        secrets: secrets.clone(),
        ..stage_req(id, &staging, cap.clone())
    };
    h.node().node_stage_volume(stage).await.unwrap();
    h.node()
        .node_publish_volume(publish_req(id, &staging, &target, cap.clone(), false))
        .await
        .unwrap();
    (staging, target)
}

/// The checksum of a file read past the page cache.
fn direct_sum(path: &Path) -> String {
    run(
        "sh",
        &[
            "-c",
            &format!(
                "dd if={} iflag=direct bs=64k status=none | sha256sum",
                path.display()
            ),
        ],
    )
}

/// What differs between the backends in [`move_and_fence`].
struct Backend<'a> {
    secrets: Secrets,
    /// How a refusal names node A.
    a_named: &'a str,
    /// Node A's kernel still holds the volume (a session, a mapping).
    a_holds: &'a dyn Fn() -> bool,
    /// After a detach of A: A can no longer reach the volume, as the
    /// server sees it (its connections gone, its client blocklisted).
    a_shut_out: &'a dyn Fn() -> Result<(), String>,
}

/// A volume moves between two kernels the way the CO moves it (teardown
/// on A, detach, attach to B, stage on B) and keeps its data; B is refused,
/// naming A, in every single-node mode while A holds it. Then A holds it
/// and writes without pause, A's guest is frozen, and the CO detaches it
/// from A with no teardown (a forced detach after a node is lost): the
/// detach fences A before it answers, B takes the volume over, and when A
/// runs again none of its writes reach the volume. A's node reports the
/// volume abnormal and unstages cleanly; nothing is left on A.
async fn move_and_fence(h: &Harness, a: &PeerDriver, b: &Backend<'_>, name: &str) {
    let t0 = std::time::Instant::now();
    let step = |what: &str| eprintln!("[{:6.1} s] {name}: {what}", t0.elapsed().as_secs_f64());
    let node_a = a.node_id().await;
    let node_b = h.node_id().await;
    let secrets = &b.secrets;
    let cap = mount_cap("ext4", SNW);
    let mut create = create_req(name, 64 * MIB, cap.clone());
    create.secrets = secrets.clone();
    let id = h
        .controller()
        .create_volume(create)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let attach = |node: &str| {
        let r = attach_req(&id, node, &cap, secrets);
        let mut c = h.controller();
        async move {
            c.controller_publish_volume(r)
                .await
                .unwrap()
                .into_inner()
                .publish_context
        }
    };
    let detach = |node: &str| {
        let r = detach_req(&id, node, secrets);
        let mut c = h.controller();
        async move { c.controller_unpublish_volume(r).await.unwrap() }
    };

    step("attach to A, stage, write");
    // On A: attached, staged, published, written.
    let ctx = attach(&node_a).await;
    let (a_staging, a_target) = stage_on_peer(a, &id, "v", &cap, &ctx, secrets).await;
    a.peer
        .sh(&format!("echo written-on-a > {a_target}/data && sync"));
    assert!((b.a_holds)());
    // B is refused while A holds it, in every single-node mode.
    for mode in [SNW, SNRO, SNSW, SNMW] {
        let r = h
            .controller()
            .controller_publish_volume(attach_req(&id, &node_b, &mount_cap("ext4", mode), secrets))
            .await;
        assert_eq!(
            code(&r),
            tonic::Code::FailedPrecondition,
            "mode {mode}: {r:?}"
        );
        assert!(format!("{r:?}").contains(b.a_named), "{r:?}");
    }

    step("move to B");
    // The CO's move: teardown on A, detach, attach to B, stage on B.
    a.node()
        .node_unpublish_volume(unpublish_req(&id, Path::new(&a_target)))
        .await
        .unwrap();
    a.node()
        .node_unstage_volume(unstage_req(&id, Path::new(&a_staging)))
        .await
        .unwrap();
    assert!(!(b.a_holds)(), "A still holds the volume after its unstage");
    detach(&node_a).await;
    let ctx = attach(&node_b).await;
    let (b_staging, b_target) = stage_here(h, &id, "v", &cap, &ctx, secrets).await;
    assert_eq!(
        std::fs::read_to_string(b_target.join("data")).unwrap(),
        "written-on-a\n"
    );
    step("back to A");
    // And back to A, for the lost-node round.
    h.unpublish_unstage(&id, &b_staging, &b_target).await;
    detach(&node_b).await;
    let ctx = attach(&node_a).await;
    let (a_staging, a_target) = stage_on_peer(a, &id, "v", &cap, &ctx, secrets).await;

    step("A writes");
    // A writes without pause: 64 KiB blocks straight to the device.
    a.peer.sh(&format!(
        "dd if=/dev/zero of={a_target}/blob bs=64k count=16 conv=fsync status=none
         rm -f /tmp/a-writes
         (n=0; while :; do n=$((n+1))
            dd if=/dev/urandom of={a_target}/blob bs=64k count=1 seek=$((n % 16)) \\
               conv=notrunc oflag=direct status=none || break
            echo $n > /tmp/a-writes
          done) </dev/null >/dev/null 2>&1 &
         echo $! > /tmp/a-writer.pid"
    ));
    let writes = || -> u64 {
        Peer::try_sh("cat /tmp/a-writes 2>/dev/null || echo 0")
            .map(|(_, o)| o.trim().parse().unwrap_or(0))
            .unwrap_or(0)
    };
    let writing = || {
        a.peer
            .sh("kill -0 $(cat /tmp/a-writer.pid) 2>/dev/null && echo yes; true")
            .contains("yes")
    };
    let started = writes();
    wait_for("A to write", Duration::from_secs(60), || {
        writes() > started + 3
    });

    step("freeze A, detach it, attach to B");
    // A is lost: frozen, no teardown. The CO detaches it anyway, and
    // attaches the volume to B.
    a.peer.freeze();
    detach(&node_a).await;
    // What the server says once the detach answered (checked below,
    // after the data).
    let shut_out = (b.a_shut_out)();
    let ctx = attach(&node_b).await;
    let (b_staging, b_target) = stage_here(h, &id, "v", &cap, &ctx, secrets).await;
    let handed_over = direct_sum(&b_target.join("blob"));

    // A runs again; its writer fails (at once, or once the kernel gives
    // up on the volume) and none of its writes land. (Were A not fenced,
    // its writes would go on: the wait ends either way.)
    step("thaw A");
    let before_thaw = writes();
    a.peer.thaw();
    wait_for(
        "A's writer to fail, or A to write again",
        Duration::from_secs(120),
        || writes() > before_thaw + 3 || !writing(),
    );
    assert_eq!(
        direct_sum(&b_target.join("blob")),
        handed_over,
        "A's writes reached the volume after B took it over ({} since the thaw)",
        writes() - before_thaw
    );
    if let Err(e) = shut_out {
        panic!("A could still reach the volume when the detach answered: {e}");
    }
    let stats = a
        .node()
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: a_target.clone(),
            staging_target_path: a_staging.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let condition = stats.volume_condition.expect("a condition");
    assert!(condition.abnormal, "{condition:?}");

    step("teardown on A");
    // A's kubelet tears down what it had, and nothing is left. A writer
    // still blocked holds the mount busy until the kernel fails its
    // write: the kubelet retries the unpublish until then, as here.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let r = a
            .node()
            .node_unpublish_volume(unpublish_req(&id, Path::new(&a_target)))
            .await;
        match r {
            Ok(_) => break,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("unpublish on the fenced node, again: {}", e.message());
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => panic!("unpublish on the fenced node: {e}"),
        }
    }
    a.node()
        .node_unstage_volume(unstage_req(&id, Path::new(&a_staging)))
        .await
        .unwrap_or_else(|e| panic!("unstage on the fenced node: {e}\n{}", a.log()));
    assert!(!(b.a_holds)(), "the fenced node still holds the volume");
    assert_eq!(
        a.peer
            .sh(&format!("grep -c ' {}' /proc/mounts || true", a.dir))
            .trim(),
        "0"
    );
    // B's data is as B found it.
    assert_eq!(direct_sum(&b_target.join("blob")), handed_over);
    h.unpublish_unstage(&id, &b_staging, &b_target).await;
    detach(&node_b).await;
    h.controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: secrets.clone(),
        })
        .await
        .unwrap();
}

/// A raw block volume moves from A to B the way the CO moves it, and B
/// reads what A wrote to the device; B is refused, naming A, in every
/// single-node mode while A holds it.
async fn move_block(h: &Harness, a: &PeerDriver, b: &Backend<'_>, name: &str) {
    let node_a = a.node_id().await;
    let node_b = h.node_id().await;
    let secrets = &b.secrets;
    let cap = block_cap(SNW);
    let mut create = create_req(name, 32 * MIB, cap.clone());
    create.secrets = secrets.clone();
    let id = h
        .controller()
        .create_volume(create)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let ctx = h
        .controller()
        .controller_publish_volume(attach_req(&id, &node_a, &cap, secrets))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let (a_staging, a_target) = stage_on_peer(a, &id, "blk", &cap, &ctx, secrets).await;
    let pattern = format!("moved-block-{name}");
    a.peer.sh(&format!(
        "printf %s {pattern} | dd of={a_target} bs=4096 conv=sync,notrunc,fsync status=none"
    ));
    for mode in [SNW, SNRO, SNSW, SNMW] {
        let r = h
            .controller()
            .controller_publish_volume(attach_req(&id, &node_b, &block_cap(mode), secrets))
            .await;
        assert_eq!(
            code(&r),
            tonic::Code::FailedPrecondition,
            "mode {mode}: {r:?}"
        );
        assert!(format!("{r:?}").contains(b.a_named), "{r:?}");
    }
    a.node()
        .node_unpublish_volume(unpublish_req(&id, Path::new(&a_target)))
        .await
        .unwrap();
    a.node()
        .node_unstage_volume(unstage_req(&id, Path::new(&a_staging)))
        .await
        .unwrap();
    assert!(
        !(b.a_holds)(),
        "A still holds the block volume after its unstage"
    );
    h.controller()
        .controller_unpublish_volume(detach_req(&id, &node_a, secrets))
        .await
        .unwrap();
    let ctx = h
        .controller()
        .controller_publish_volume(attach_req(&id, &node_b, &cap, secrets))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let (b_staging, b_target) = stage_here(h, &id, "blk", &cap, &ctx, secrets).await;
    let head = run(
        "sh",
        &[
            "-c",
            &format!(
                "dd if={} bs=4096 count=1 iflag=direct status=none | head -c {}",
                b_target.display(),
                pattern.len()
            ),
        ],
    );
    assert_eq!(head, pattern);
    h.unpublish_unstage(&id, &b_staging, &b_target).await;
    h.controller()
        .controller_unpublish_volume(detach_req(&id, &node_b, secrets))
        .await
        .unwrap();
    h.controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: secrets.clone(),
        })
        .await
        .unwrap();
}

/// An rbd block volume shared by both nodes: MULTI_NODE_MULTI_WRITER
/// published to both, each reads what the other wrote; then read-only on
/// both (MULTI_NODE_READER_ONLY), where writes fail on both.
async fn share_block(h: &Harness, a: &PeerDriver, b: &Backend<'_>) {
    let node_a = a.node_id().await;
    let node_b = h.node_id().await;
    let secrets = &b.secrets;
    let cap = block_cap(MNMW);
    let mut create = create_req("pvc-two-shared", 32 * MIB, cap.clone());
    create.secrets = secrets.clone();
    let id = h
        .controller()
        .create_volume(create)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let mut on = Vec::new();
    for node in [&node_a, &node_b] {
        on.push(
            h.controller()
                .controller_publish_volume(attach_req(&id, node, &cap, secrets))
                .await
                .unwrap()
                .into_inner()
                .publish_context,
        );
    }
    let (a_staging, a_target) = stage_on_peer(a, &id, "shared", &cap, &on[0], secrets).await;
    let (b_staging, b_target) = stage_here(h, &id, "shared", &cap, &on[1], secrets).await;
    let b_dev = b_target.display().to_string();
    a.peer.sh(&format!(
        "printf from-a | dd of={a_target} bs=4096 conv=sync,notrunc,fsync status=none"
    ));
    run(
        "sh",
        &[
            "-c",
            &format!(
                "printf from-b | dd of={b_dev} bs=4096 seek=1 conv=sync,notrunc,fsync status=none"
            ),
        ],
    );
    let read = |dev: &str, block: u32| {
        format!("dd if={dev} bs=4096 skip={block} count=1 iflag=direct status=none | head -c 6")
    };
    assert_eq!(run("sh", &["-c", &read(&b_dev, 0)]), "from-a");
    assert_eq!(a.peer.sh(&read(&a_target, 1)), "from-b");
    for (node, ctx) in [(&node_a, &on[0]), (&node_b, &on[1])] {
        let _ = ctx;
        if node == &node_a {
            a.node()
                .node_unpublish_volume(unpublish_req(&id, Path::new(&a_target)))
                .await
                .unwrap();
            a.node()
                .node_unstage_volume(unstage_req(&id, Path::new(&a_staging)))
                .await
                .unwrap();
        } else {
            h.unpublish_unstage(&id, &b_staging, &b_target).await;
        }
        h.controller()
            .controller_unpublish_volume(detach_req(&id, node, secrets))
            .await
            .unwrap();
    }

    // Read-only on both: both read, neither writes.
    let ro = block_cap(MNRO);
    let mut on = Vec::new();
    for node in [&node_a, &node_b] {
        let mut r = attach_req(&id, node, &ro, secrets);
        r.readonly = true;
        on.push(
            h.controller()
                .controller_publish_volume(r)
                .await
                .unwrap()
                .into_inner()
                .publish_context,
        );
    }
    let (a_staging, a_target) = stage_on_peer(a, &id, "ro", &ro, &on[0], secrets).await;
    let (b_staging, b_target) = stage_here(h, &id, "ro", &ro, &on[1], secrets).await;
    let b_dev = b_target.display().to_string();
    assert_eq!(a.peer.sh(&read(&a_target, 1)), "from-b");
    assert_eq!(run("sh", &["-c", &read(&b_dev, 0)]), "from-a");
    let write =
        |dev: &str| format!("printf x | dd of={dev} bs=4096 conv=sync,notrunc,fsync status=none");
    assert_ne!(
        Peer::try_sh(&write(&a_target)).unwrap().0,
        0,
        "A wrote to a read-only volume"
    );
    assert!(
        !std::process::Command::new("sh")
            .args(["-c", &write(&b_dev)])
            .status()
            .unwrap()
            .success(),
        "B wrote to a read-only volume"
    );
    a.node()
        .node_unpublish_volume(unpublish_req(&id, Path::new(&a_target)))
        .await
        .unwrap();
    a.node()
        .node_unstage_volume(unstage_req(&id, Path::new(&a_staging)))
        .await
        .unwrap();
    h.unpublish_unstage(&id, &b_staging, &b_target).await;
    for node in [&node_a, &node_b] {
        h.controller()
            .controller_unpublish_volume(detach_req(&id, node, secrets))
            .await
            .unwrap();
    }
    h.controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: secrets.clone(),
        })
        .await
        .unwrap();
}

/// An nfs volume staged on both nodes at once: each sees the files the
/// other writes, through its own mount of the export. (nfs has no attach:
/// nothing to publish to a node, nothing to fence.)
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_nfs_volume_is_written_from_both() {
    require_guest();
    let server = NfsServer::new();
    let config = format!(
        "[[backend]]\ntype = \"nfs\"\n[[backend.export]]\nname = \"main\"\nserver = \"{MAIN_ADDR}\"\n\
         share = \"/\"\nversion = \"4.2\"\n"
    );
    let h = Harness::start_with(Some(&config)).await;
    let a = PeerDriver::start(&config, "node-a").await;
    let cap = mount_cap("", MNMW);
    let vol = h
        .controller()
        .create_volume(create_req("pvc-two-nfs", 64 * MIB, cap.clone()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let id = vol.volume_id.clone();
    let none = HashMap::new();
    let (a_staging, a_target) = stage_on_peer(&a, &id, "nfs", &cap, &none, &none).await;
    let (b_staging, b_target) = stage_here(&h, &id, "nfs", &cap, &none, &none).await;
    // Both write at once; each sees the other's file.
    let writer_a = Peer::try_sh(&format!(
        "for i in $(seq 50); do echo $i >> {a_target}/from-a; done; sync"
    ));
    for i in 1..=50 {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(b_target.join("from-b"))
            .unwrap();
        writeln!(f, "{i}").unwrap();
    }
    assert_eq!(writer_a.unwrap().0, 0);
    let lines = |text: String| text.lines().count();
    wait_for("B to see A's file", Duration::from_secs(30), || {
        std::fs::read_to_string(b_target.join("from-a")).is_ok_and(|t| lines(t) == 50)
    });
    wait_for("A to see B's file", Duration::from_secs(30), || {
        Peer::try_sh(&format!("cat {a_target}/from-b"))
            .is_ok_and(|(rc, out)| rc == 0 && lines(out) == 50)
    });
    assert_eq!(
        std::fs::read_to_string(server.export.join("pvc-two-nfs/from-a"))
            .map(lines)
            .unwrap(),
        50
    );
    a.node()
        .node_unpublish_volume(unpublish_req(&id, Path::new(&a_target)))
        .await
        .unwrap();
    a.node()
        .node_unstage_volume(unstage_req(&id, Path::new(&a_staging)))
        .await
        .unwrap();
    h.unpublish_unstage(&id, &b_staging, &b_target).await;
    assert_eq!(
        a.peer
            .sh(&format!("grep -c ' {}' /proc/mounts || true", a.dir))
            .trim(),
        "0"
    );
    h.controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await
        .unwrap();
}

/// [`move_block`] and [`move_and_fence`] on iscsi: the detach takes A's
/// initiator out of the target's ACL and closes its connections.
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_iscsi_moves_and_fences_a_lost_node() {
    require_guest();
    let prefix = "iqn.2026-11.io.ferrovol.two";
    let tgtd = Tgtd::on(MAIN_ADDR);
    let _iscsid = Iscsid::new();
    let config = iscsi_config(prefix, &tgtd);
    let h = Harness::start_with(Some(&config)).await;
    let sessions = || {
        Peer::try_sh("iscsiadm -m session 2>/dev/null; true")
            .unwrap()
            .1
            .lines()
            .filter(|l| l.contains(prefix))
            .count()
    };
    let shut_out = || {
        let t = tgtd.tgtadm(&["--op", "show", "--mode", "target"]);
        match t.contains(PEER_INITIATOR) {
            true => Err(format!("the target still lists A:\n{t}")),
            false => Ok(()),
        }
    };
    let backend = Backend {
        secrets: Secrets::new(),
        a_named: PEER_INITIATOR,
        a_holds: &|| sessions() > 0,
        a_shut_out: &shut_out,
    };
    let a = PeerDriver::start(&config, "node-a").await;
    move_block(&h, &a, &backend, "pvc-two-iscsi-blk").await;
    move_and_fence(&h, &a, &backend, "pvc-two-iscsi").await;
    let left = tgtd.tgtadm(&["--op", "show", "--mode", "target"]);
    assert!(!left.contains(prefix), "{left}");
}

/// [`move_block`] and [`move_and_fence`] on rbd: the detach blocklists the
/// client A recorded at stage (each mapping has its own), before A's mark
/// goes.
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_rbd_moves_and_fences_a_lost_node() {
    require_guest();
    let cluster = CephCluster::on(MAIN_ADDR);
    let peer_config = format!(
        "[[backend]]\ntype = \"rbd\"\ncluster_id = \"two\"\nmonitors = [\"v1:{}\"]\npools = [\"rbd\"]\n",
        cluster.mon_addr
    );
    let config = format!(
        "{peer_config}user = \"ferrovol\"\nkeyring = \"{}\"\n",
        cluster.client_keyring.display()
    );
    let h = Harness::start_with(Some(&config)).await;
    let secrets = Secrets::from([
        ("userID".to_string(), "ferrovol".to_string()),
        ("userKey".to_string(), cluster.client_key()),
    ]);
    let mapped = || {
        Peer::try_sh("rbd device list 2>/dev/null; true")
            .unwrap()
            .1
            .lines()
            .filter(|l| l.contains("rbd "))
            .count()
    };
    let blocklist = || cluster.ceph(&["osd", "blocklist", "ls"]);
    let before = blocklist();
    let shut_out = || {
        let now = blocklist();
        match now.contains(&format!("{PEER_ADDR}:0/")) && now != before {
            true => Ok(()),
            false => Err(format!("A's client is not blocklisted:\n{now}")),
        }
    };
    let a = PeerDriver::start(&peer_config, "node-a").await;
    let backend = Backend {
        secrets: secrets.clone(),
        a_named: "node-a",
        a_holds: &|| mapped() > 0,
        a_shut_out: &shut_out,
    };
    move_block(&h, &a, &backend, "pvc-two-rbd-blk").await;
    share_block(&h, &a, &backend).await;
    move_and_fence(&h, &a, &backend, "pvc-two-rbd").await;
    let left = cluster.rbd(&["ls", "rbd"]);
    assert!(left.trim().is_empty(), "{left}");
}
