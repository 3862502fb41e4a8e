//! Two nodes in two kernels: this guest (the servers, the controller and
//! node B) and the peer guest (node A), booted side by side by
//! `tests/guest/suite`. Volumes move between them, and a node that stops
//! answering while it holds a volume is fenced.

use super::common::fixtures::*;
use super::common::peer::*;
use super::common::*;
use ferrovol::proto as pb;
use ferrovol::proto::node_client::NodeClient;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::Channel;

const MNRO: i32 = 3;

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
type Context = HashMap<String, String>;

/// Both nodes, as the CO drives them: the controller and node B here, node
/// A on the peer, with the secrets every call carries.
struct Nodes<'a> {
    h: &'a Harness,
    a: &'a PeerDriver,
    secrets: Secrets,
    node_a: String,
    node_b: String,
}

impl<'a> Nodes<'a> {
    async fn new(h: &'a Harness, a: &'a PeerDriver, secrets: &Secrets) -> Nodes<'a> {
        Nodes {
            h,
            a,
            secrets: secrets.clone(),
            node_a: a.node_id().await,
            node_b: h.node_id().await,
        }
    }

    async fn create(&self, name: &str, size: i64, cap: &pb::VolumeCapability) -> String {
        let mut r = create_req(name, size, cap.clone());
        r.secrets = self.secrets.clone();
        let vol = self.h.controller().create_volume(r).await.unwrap();
        vol.into_inner().volume.unwrap().volume_id
    }

    async fn delete(&self, id: &str) {
        let r = pb::DeleteVolumeRequest {
            volume_id: id.into(),
            secrets: self.secrets.clone(),
        };
        self.h.controller().delete_volume(r).await.unwrap();
    }

    /// ControllerPublish to `node`.
    async fn try_attach(
        &self,
        id: &str,
        node: &str,
        cap: &pb::VolumeCapability,
        readonly: bool,
    ) -> Result<Context, tonic::Status> {
        let r = pb::ControllerPublishVolumeRequest {
            volume_id: id.into(),
            node_id: node.into(),
            volume_capability: Some(cap.clone()),
            readonly,
            secrets: self.secrets.clone(),
            ..Default::default()
        };
        let answer = self.h.controller().controller_publish_volume(r).await?;
        Ok(answer.into_inner().publish_context)
    }

    async fn attach(&self, id: &str, node: &str, cap: &pb::VolumeCapability) -> Context {
        self.try_attach(id, node, cap, false).await.unwrap()
    }

    /// ControllerUnpublish for `node`.
    async fn detach(&self, id: &str, node: &str) {
        let r = pb::ControllerUnpublishVolumeRequest {
            volume_id: id.into(),
            node_id: node.into(),
            secrets: self.secrets.clone(),
        };
        self.h
            .controller()
            .controller_unpublish_volume(r)
            .await
            .unwrap();
    }

    /// B is refused, naming A, in each mode of `caps` while A holds `id`.
    async fn b_refused(&self, id: &str, caps: &[pb::VolumeCapability], a_named: &str) {
        for cap in caps {
            let r = self.try_attach(id, &self.node_b, cap, false).await;
            let e = r.expect_err("B was let in while A holds the volume");
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{cap:?}: {e}");
            assert!(e.message().contains(a_named), "{e}");
        }
    }

    /// Stage and publish on A (the peer) as `name`, with the context of
    /// the attach to A.
    async fn stage_a(
        &self,
        id: &str,
        name: &str,
        cap: &pb::VolumeCapability,
        ctx: &Context,
    ) -> (String, String) {
        let staging = self.a.path(&format!("kubelet/staging/{name}"));
        let target = self.a.path(&format!("kubelet/pods/{name}"));
        self.a.peer.sh(&format!("mkdir -p {staging}"));
        let (s, t) = (Path::new(&staging), Path::new(&target));
        if let Err(e) = self.stage_on(self.a.node(), id, s, t, cap, ctx).await {
            panic!("stage on the peer: {e}\n{}", self.a.log());
        }
        (staging, target)
    }

    /// NodeStage at `staging` and NodePublish at `target` through `node`,
    /// with the context of the attach to that node.
    async fn stage_on(
        &self,
        mut node: NodeClient<Channel>,
        id: &str,
        staging: &Path,
        target: &Path,
        cap: &pb::VolumeCapability,
        ctx: &Context,
    ) -> Result<(), tonic::Status> {
        let stage = pb::NodeStageVolumeRequest {
            publish_context: ctx.clone(),
            secrets: self.secrets.clone(),
            ..stage_req(id, staging, cap.clone())
        };
        node.node_stage_volume(stage).await?;
        let publish = publish_req(id, staging, target, cap.clone(), false);
        node.node_publish_volume(publish).await?;
        Ok(())
    }

    /// Unpublish and unstage on A.
    async fn unstage_a(&self, id: &str, (staging, target): &(String, String)) {
        let unpublish = unpublish_req(id, Path::new(target));
        self.a
            .node()
            .node_unpublish_volume(unpublish)
            .await
            .unwrap();
        let unstage = unstage_req(id, Path::new(staging));
        if let Err(e) = self.a.node().node_unstage_volume(unstage).await {
            panic!("unstage on the peer: {e}\n{}", self.a.log());
        }
    }

    /// Stage and publish on B (this guest) as `name`.
    async fn stage_b(
        &self,
        id: &str,
        name: &str,
        cap: &pb::VolumeCapability,
        ctx: &Context,
    ) -> (PathBuf, PathBuf) {
        let staging = self.h.path(&format!("kubelet/staging/{name}"));
        let target = self.h.path(&format!("kubelet/pods/{name}"));
        std::fs::create_dir_all(&staging).unwrap();
        let node = self.h.node();
        self.stage_on(node, id, &staging, &target, cap, ctx)
            .await
            .unwrap();
        (staging, target)
    }

    async fn unstage_b(&self, id: &str, (staging, target): &(PathBuf, PathBuf)) {
        self.h.unpublish_unstage(id, staging, target).await;
    }

    /// Nothing of A's driver folder is mounted on A.
    fn nothing_mounted_on_a(&self) {
        let script = format!("grep -c ' {}' /proc/mounts || true", self.a.dir);
        assert_eq!(self.a.peer.sh(&script).trim(), "0");
    }
}

/// The first `len` bytes of 4 KiB block `block` of `dev`, read past the
/// page cache (a shell script for either node).
fn read_block(dev: &str, block: u32, len: usize) -> String {
    format!("dd if={dev} bs=4096 skip={block} count=1 iflag=direct status=none | head -c {len}")
}

/// Writes `text` as 4 KiB block `block` of `dev`, synchronously (a shell
/// script for either node).
fn write_block(dev: &str, block: u32, text: &str) -> String {
    format!(
        "printf %s {text} | dd of={dev} bs=4096 seek={block} conv=sync,notrunc,fsync status=none"
    )
}

/// Runs a shell script on this guest; its output.
fn here(script: &str) -> String {
    run("sh", &["-c", script])
}

/// The checksum of a file read past the page cache.
fn direct_sum(path: &Path) -> String {
    here(&format!(
        "dd if={} iflag=direct bs=64k status=none | sha256sum",
        path.display()
    ))
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
    /// The id of a node this backend would serve, which does not exist,
    /// and how a refusal names it.
    gone_node: (&'a str, &'a str),
}

/// A node that is gone for good (its Node object deleted, the machine
/// never coming back): ControllerUnpublish for it succeeds, as the
/// external-attacher expects, and leaves the volume free for B.
async fn node_gone(n: &Nodes<'_>, b: &Backend<'_>) {
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
async fn move_and_fence(n: &Nodes<'_>, b: &Backend<'_>, name: &str) {
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
    let before_thaw = writes();
    a.peer.thaw();
    wait_for(
        "A's writer to fail, or A to write again",
        Duration::from_secs(120),
        || writes() > before_thaw + 3 || !writing(),
    );
    assert_eq!(
        direct_sum(&blob),
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
async fn move_block(n: &Nodes<'_>, b: &Backend<'_>, name: &str) {
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

/// An rbd block volume shared by both nodes: MULTI_NODE_MULTI_WRITER
/// published to both, each reads what the other wrote; then read-only on
/// both (MULTI_NODE_READER_ONLY), where writes fail on both.
async fn share_block(n: &Nodes<'_>) {
    let (a, node_a, node_b) = (n.a, &n.node_a, &n.node_b);
    let cap = block_cap(MNMW);
    let id = n.create("pvc-two-shared", 32 * MIB, &cap).await;
    let ctx_a = n.attach(&id, node_a, &cap).await;
    let ctx_b = n.attach(&id, node_b, &cap).await;
    let on_a = n.stage_a(&id, "shared", &cap, &ctx_a).await;
    let on_b = n.stage_b(&id, "shared", &cap, &ctx_b).await;
    let (a_dev, b_dev) = (on_a.1.clone(), on_b.1.display().to_string());
    a.peer.sh(&write_block(&a_dev, 0, "from-a"));
    here(&write_block(&b_dev, 1, "from-b"));
    assert_eq!(here(&read_block(&b_dev, 0, 6)), "from-a");
    assert_eq!(a.peer.sh(&read_block(&a_dev, 1, 6)), "from-b");
    n.unstage_a(&id, &on_a).await;
    n.unstage_b(&id, &on_b).await;
    n.detach(&id, node_a).await;
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
    let n = Nodes::new(&h, &a, &Secrets::new()).await;
    let cap = mount_cap("", MNMW);
    let id = n.create("pvc-two-nfs", 64 * MIB, &cap).await;
    let on_a = n.stage_a(&id, "nfs", &cap, &Context::new()).await;
    let on_b = n.stage_b(&id, "nfs", &cap, &Context::new()).await;
    let (a_target, b_target) = (&on_a.1, &on_b.1);
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
    n.unstage_a(&id, &on_a).await;
    n.unstage_b(&id, &on_b).await;
    n.nothing_mounted_on_a();
    n.delete(&id).await;
}

/// [`move_block`] and [`move_and_fence`] on iscsi: the detach takes A's
/// initiator out of the target's ACL and closes its connections.
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_iscsi_moves_fences_and_lets_a_gone_node_go() {
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
        gone_node: (
            "node-gone/iqn.2026-11.io.ferrovol:gone",
            "iqn.2026-11.io.ferrovol:gone",
        ),
    };
    let a = PeerDriver::start(&config, "node-a").await;
    let n = Nodes::new(&h, &a, &backend.secrets).await;
    node_gone(&n, &backend).await;
    move_block(&n, &backend, "pvc-two-iscsi-blk").await;
    move_and_fence(&n, &backend, "pvc-two-iscsi").await;
    let left = tgtd.tgtadm(&["--op", "show", "--mode", "target"]);
    assert!(!left.contains(prefix), "{left}");
}

/// [`move_block`] and [`move_and_fence`] on rbd: the detach blocklists the
/// client A recorded at stage (each mapping has its own), before A's mark
/// goes.
#[tokio::test]
#[ignore = "needs the two-node guest: run tests/guest/suite"]
async fn guest_two_nodes_rbd_moves_shares_fences_and_lets_a_gone_node_go() {
    require_guest();
    let cluster = CephCluster::shared();
    assert!(
        cluster.mon_addr.starts_with(&format!("{MAIN_ADDR}:")),
        "the shared cluster is not on the private network: {}",
        cluster.mon_addr
    );
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
        gone_node: ("node-gone/rbd", "node-gone"),
    };
    let n = Nodes::new(&h, &a, &backend.secrets).await;
    node_gone(&n, &backend).await;
    move_block(&n, &backend, "pvc-two-rbd-blk").await;
    share_block(&n).await;
    move_and_fence(&n, &backend, "pvc-two-rbd").await;
    let left = cluster.rbd(&["ls", "rbd"]);
    assert!(left.trim().is_empty(), "{left}");
}
