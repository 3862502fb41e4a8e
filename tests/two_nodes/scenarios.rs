//! What every backend's volume goes through between the two nodes: moved
//! with its old node fenced, moved and shared as a raw block device, and
//! let go when its node is gone.

use super::*;

/// A node that is gone for good (its Node object deleted, the machine
/// never coming back): ControllerUnpublish for it succeeds, as the
/// external-attacher expects, and leaves the volume free for B.
pub(super) async fn node_gone(n: &Nodes<'_>, b: &Backend<'_>) {
    let cap = mount_cap("ext4", SNW);
    let id = n.create("pvc-two-gone", 32 * MIB, &cap).await;
    let (gone, named) = b.gone_node;
    n.attach(&id, gone, &cap).await;
    n.b_refused(&id, std::slice::from_ref(&cap), named).await;
    n.detach(&id, gone).await;
    n.detach(&id, gone).await;
    let ctx = n.attach(&id, &n.node_b, &cap).await;
    let on_b = n.stage_b(&id, "gone", &cap, &ctx).await;
    n.unstage_b(&id, &on_b).await;
    n.detach(&id, &n.node_b).await;
    n.delete(&id).await;
}

/// A volume moves between two kernels the way the CO moves it (teardown
/// on A, detach, attach to B, stage on B) and keeps its data; B is refused,
/// naming A, in every single-node mode while A holds it. Then A holds it
/// and writes without pause, A's guest is frozen, and the CO detaches it
/// from A with no teardown (a forced detach after a node is lost): the
/// detach fences A before it answers, B takes the volume over, and when A
/// runs again none of its writes reach the volume. A's node reports the
/// volume abnormal and unstages cleanly; nothing is left on A.
pub(super) async fn move_and_fence(n: &Nodes<'_>, b: &Backend<'_>, name: &str) {
    let t0 = std::time::Instant::now();
    let step = |what: &str| eprintln!("[{:6.1} s] {name}: {what}", t0.elapsed().as_secs_f64());
    let (a, node_a, node_b) = (n.a, &n.node_a, &n.node_b);
    let cap = mount_cap("ext4", SNW);
    let id = n.create(name, 64 * MIB, &cap).await;

    step("attach to A, stage, write");
    let ctx = n.attach(&id, node_a, &cap).await;
    let on_a = n.stage_a(&id, "v", &cap, &ctx).await;
    a.peer
        .sh(&format!("echo written-on-a > {}/data && sync", on_a.1));
    assert!((b.a_holds)());
    let modes = [SNW, SNRO, SNSW, SNMW].map(|m| mount_cap("ext4", m));
    n.b_refused(&id, &modes, b.a_named).await;

    step("move to B");
    n.unstage_a(&id, &on_a).await;
    assert!(!(b.a_holds)(), "A still holds the volume after its unstage");
    n.detach(&id, node_a).await;
    let ctx = n.attach(&id, node_b, &cap).await;
    let on_b = n.stage_b(&id, "v", &cap, &ctx).await;
    assert_eq!(
        std::fs::read_to_string(on_b.1.join("data")).unwrap(),
        "written-on-a\n"
    );

    step("back to A");
    n.unstage_b(&id, &on_b).await;
    n.detach(&id, node_b).await;
    let ctx = n.attach(&id, node_a, &cap).await;
    let (a_staging, a_target) = n.stage_a(&id, "v", &cap, &ctx).await;

    step("A writes");
    let writer = AWriter::start(&a.peer, &a_target);

    step("freeze A, detach it, attach to B");
    // A is lost: frozen, no teardown. The CO detaches it anyway, and
    // attaches the volume to B.
    a.peer.freeze();
    n.detach(&id, node_a).await;
    // What the server says once the detach answered (checked below,
    // after the data).
    let shut_out = (b.a_shut_out)();
    let ctx = n.attach(&id, node_b, &cap).await;
    let on_b = n.stage_b(&id, "v", &cap, &ctx).await;
    let blob = on_b.1.join("blob");
    let handed_over = direct_sum(&blob);

    // A runs again; its writer fails (at once, or once the kernel gives
    // up on the volume) and none of its writes land. (Were A not fenced,
    // its writes would go on: the wait ends either way.)
    step("thaw A");
    a.peer.thaw();
    let since_thaw = writer.fails_or_writes_on();
    assert_eq!(
        direct_sum(&blob),
        handed_over,
        "A's writes reached the volume after B took it over ({since_thaw} since the thaw)"
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
    n.unstage_fenced_a(&id, &a_staging, &a_target).await;
    assert!(!(b.a_holds)(), "the fenced node still holds the volume");
    n.nothing_mounted_on_a();
    // B's data is as B found it.
    assert_eq!(direct_sum(&blob), handed_over);
    n.unstage_b(&id, &on_b).await;
    n.detach(&id, node_b).await;
    n.delete(&id).await;
}

/// A raw block volume moves from A to B the way the CO moves it, and B
/// reads what A wrote to the device; B is refused, naming A, in every
/// single-node mode while A holds it.
pub(super) async fn move_block(n: &Nodes<'_>, b: &Backend<'_>, name: &str) {
    let (node_a, node_b) = (&n.node_a, &n.node_b);
    let cap = block_cap(SNW);
    let id = n.create(name, 32 * MIB, &cap).await;
    let ctx = n.attach(&id, node_a, &cap).await;
    let on_a = n.stage_a(&id, "blk", &cap, &ctx).await;
    let pattern = format!("moved-block-{name}");
    n.a.peer.sh(&write_block(&on_a.1, 0, &pattern));
    let modes = [SNW, SNRO, SNSW, SNMW].map(block_cap);
    n.b_refused(&id, &modes, b.a_named).await;
    n.unstage_a(&id, &on_a).await;
    assert!(
        !(b.a_holds)(),
        "A still holds the block volume after its unstage"
    );
    n.detach(&id, node_a).await;
    let ctx = n.attach(&id, node_b, &cap).await;
    let on_b = n.stage_b(&id, "blk", &cap, &ctx).await;
    let b_dev = on_b.1.display().to_string();
    assert_eq!(here(&read_block(&b_dev, 0, pattern.len())), pattern);
    n.unstage_b(&id, &on_b).await;
    n.detach(&id, node_b).await;
    n.delete(&id).await;
}

/// A block volume shared by both nodes: MULTI_NODE_MULTI_WRITER
/// published to both, each reads what the other wrote, and B goes on
/// writing once A is detached; then read-only on both
/// (MULTI_NODE_READER_ONLY), where writes fail on both.
pub(super) async fn share_block(n: &Nodes<'_>, name: &str) {
    let (a, node_a, node_b) = (n.a, &n.node_a, &n.node_b);
    let cap = block_cap(MNMW);
    let id = n.create(name, 32 * MIB, &cap).await;
    let ctx_a = n.attach(&id, node_a, &cap).await;
    let ctx_b = n.attach(&id, node_b, &cap).await;
    let on_a = n.stage_a(&id, "shared", &cap, &ctx_a).await;
    let on_b = n.stage_b(&id, "shared", &cap, &ctx_b).await;
    let (a_dev, b_dev) = (on_a.1.clone(), on_b.1.display().to_string());
    a.peer.sh(&write_block(&a_dev, 0, "from-a"));
    here(&write_block(&b_dev, 1, "from-b"));
    assert_eq!(here(&read_block(&b_dev, 0, 6)), "from-a");
    assert_eq!(a.peer.sh(&read_block(&a_dev, 1, 6)), "from-b");
    // A lets go while B goes on: B's grant stays, and its I/O too (on
    // nvmf, across its controllers' reconnect after the subsystem's trip
    // off its ports).
    n.unstage_a(&id, &on_a).await;
    n.detach(&id, node_a).await;
    here(&write_block(&b_dev, 2, "b-alone"));
    assert_eq!(here(&read_block(&b_dev, 2, 7)), "b-alone");
    n.unstage_b(&id, &on_b).await;
    n.detach(&id, node_b).await;

    // Read-only on both: both read, neither writes.
    let ro = block_cap(MNRO);
    let ctx_a = n.try_attach(&id, node_a, &ro, true).await.unwrap();
    let ctx_b = n.try_attach(&id, node_b, &ro, true).await.unwrap();
    let on_a = n.stage_a(&id, "ro", &ro, &ctx_a).await;
    let on_b = n.stage_b(&id, "ro", &ro, &ctx_b).await;
    let (a_dev, b_dev) = (on_a.1.clone(), on_b.1.display().to_string());
    assert_eq!(a.peer.sh(&read_block(&a_dev, 1, 6)), "from-b");
    assert_eq!(here(&read_block(&b_dev, 0, 6)), "from-a");
    let refused = Peer::try_sh(&write_block(&a_dev, 2, "x")).unwrap().0;
    assert_ne!(refused, 0, "A wrote to a read-only volume");
    let written = std::process::Command::new("sh")
        .args(["-c", &write_block(&b_dev, 2, "x")])
        .status()
        .unwrap();
    assert!(!written.success(), "B wrote to a read-only volume");
    n.unstage_a(&id, &on_a).await;
    n.unstage_b(&id, &on_b).await;
    n.detach(&id, node_a).await;
    n.detach(&id, node_b).await;
    n.delete(&id).await;
}
