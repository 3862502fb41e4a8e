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

mod backends;
mod scenarios;

const MNRO: i32 = 3;

/// An iscsi backend on `tgtd` (listening on the private network), its LUNs
/// in a file pool; the same text configures both nodes. A session that
/// lost its connection fails its I/O after 10 s (open-iscsi's default is
/// 120 s): how long a fenced node's writers stay blocked.
pub(crate) fn iscsi_config(prefix: &str, tgtd: &Tgtd) -> String {
    format!(
        "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"{prefix}\"\nportals = [\"{}\"]\n\
         control_port = {}\nreplacement_timeout = 10\n\
         [backend.store]\ntype = \"file\"\npool = \"@DIR@/pool\"\n",
        tgtd.portal(),
        tgtd.control_port
    )
}

/// An nvmf backend on `nvmet` (listening on the private network), its
/// namespaces in a file pool, for this guest (the controller and node B,
/// as the fixture's host) and for the peer (node A: its own host NQN and
/// ID, where peer-init wrote them). A controller that lost its subsystem
/// fails its I/O after 5 s and is removed after 20 s: how long a fenced
/// node's writers stay blocked.
pub(crate) fn nvmf_configs(nvmet: &NvmetPort) -> (String, String) {
    let reconnect = "ctrl_loss_tmo = 20\nreconnect_delay = 1\nfast_io_fail_tmo = 5\n";
    let here = nvmet.file_store_config().replacen(
        "[backend.store]",
        &format!("{reconnect}[backend.store]"),
        1,
    );
    let peer: String = here
        .lines()
        .filter(|l| !l.starts_with("host_nqn_file") && !l.starts_with("host_id_file"))
        .map(|l| format!("{l}\n"))
        .collect();
    (here, peer)
}

/// The rbd backend's configuration on `cluster` (on the private network)
/// for this guest (the controller and node B: the client user's keyring)
/// and for the peer (node A: the calls' secrets only).
pub(crate) fn rbd_configs(cluster: &CephCluster) -> (String, String) {
    assert!(
        cluster.mon_addr.starts_with(&format!("{MAIN_ADDR}:")),
        "the shared cluster is not on the private network: {}",
        cluster.mon_addr
    );
    let peer = format!(
        "[[backend]]\ntype = \"rbd\"\ncluster_id = \"two\"\nmonitors = [\"v1:{}\"]\npools = [\"rbd\"]\n",
        cluster.mon_addr
    );
    let here = format!(
        "{peer}user = \"ferrovol\"\nkeyring = \"{}\"\n",
        cluster.client_keyring.display()
    );
    (here, peer)
}

pub(crate) type Secrets = HashMap<String, String>;
pub(crate) type Context = HashMap<String, String>;

/// Both nodes, as the CO drives them: the controller and node B here, node
/// A on the peer, with the secrets every call carries.
pub(crate) struct Nodes<'a> {
    pub(crate) h: &'a Harness,
    pub(crate) a: &'a PeerDriver,
    pub(crate) secrets: Secrets,
    pub(crate) node_a: String,
    pub(crate) node_b: String,
}

impl<'a> Nodes<'a> {
    pub(crate) async fn new(h: &'a Harness, a: &'a PeerDriver, secrets: &Secrets) -> Nodes<'a> {
        Nodes {
            h,
            a,
            secrets: secrets.clone(),
            node_a: a.node_id().await,
            node_b: h.node_id().await,
        }
    }

    pub(crate) async fn create(&self, name: &str, size: i64, cap: &pb::VolumeCapability) -> String {
        let mut r = create_req(name, size, cap.clone());
        r.secrets = self.secrets.clone();
        let vol = self.h.controller().create_volume(r).await.unwrap();
        vol.into_inner().volume.unwrap().volume_id
    }

    pub(crate) async fn delete(&self, id: &str) {
        let r = pb::DeleteVolumeRequest {
            volume_id: id.into(),
            secrets: self.secrets.clone(),
        };
        self.h.controller().delete_volume(r).await.unwrap();
    }

    /// ControllerPublish to `node`.
    pub(crate) async fn try_attach(
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

    pub(crate) async fn attach(&self, id: &str, node: &str, cap: &pb::VolumeCapability) -> Context {
        self.try_attach(id, node, cap, false).await.unwrap()
    }

    /// ControllerUnpublish for `node`.
    pub(crate) async fn detach(&self, id: &str, node: &str) {
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
    pub(crate) async fn stage_a(
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
    pub(crate) async fn stage_on(
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
    pub(crate) async fn unstage_a(&self, id: &str, (staging, target): &(String, String)) {
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

    /// A's kubelet tears down what it had once A runs again after it was
    /// fenced. A writer still blocked holds the mount busy until the kernel
    /// fails its write: the kubelet retries the unpublish until then, as
    /// here (for 120 s at most).
    pub(crate) async fn unstage_fenced_a(&self, id: &str, staging: &str, target: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let r = self
                .a
                .node()
                .node_unpublish_volume(unpublish_req(id, Path::new(target)))
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
        self.a
            .node()
            .node_unstage_volume(unstage_req(id, Path::new(staging)))
            .await
            .unwrap_or_else(|e| panic!("unstage on the fenced node: {e}\n{}", self.a.log()));
    }

    /// Stage and publish on B (this guest) as `name`.
    pub(crate) async fn stage_b(
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

    pub(crate) async fn unstage_b(&self, id: &str, (staging, target): &(PathBuf, PathBuf)) {
        self.h.unpublish_unstage(id, staging, target).await;
    }

    /// Nothing of A's driver folder is mounted on A.
    pub(crate) fn nothing_mounted_on_a(&self) {
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
pub(crate) fn direct_sum(path: &Path) -> String {
    here(&format!(
        "dd if={} iflag=direct bs=64k status=none | sha256sum",
        path.display()
    ))
}

/// A pod on A that writes without pause: 64 KiB blocks straight to the
/// device (O_DIRECT) into `blob` under A's target, over and over, until a
/// write fails; the count of writes made is kept in a file on A.
pub(crate) struct AWriter<'a>(&'a Peer);

impl<'a> AWriter<'a> {
    /// Starts it on A at `target`, and returns once it writes.
    pub(crate) fn start(peer: &'a Peer, target: &str) -> AWriter<'a> {
        peer.sh(&format!(
            "dd if=/dev/zero of={target}/blob bs=64k count=16 conv=fsync status=none
             rm -f /tmp/a-writes
             (n=0; while :; do n=$((n+1))
                dd if=/dev/urandom of={target}/blob bs=64k count=1 seek=$((n % 16)) \\
                   conv=notrunc oflag=direct status=none || break
                echo $n > /tmp/a-writes
              done) </dev/null >/dev/null 2>&1 &
             echo $! > /tmp/a-writer.pid"
        ));
        let writer = AWriter(peer);
        let started = writer.writes();
        wait_for("A to write", Duration::from_secs(60), || {
            writer.writes() > started + 3
        });
        writer
    }

    /// The writes made so far (0 while A does not answer).
    pub(crate) fn writes(&self) -> u64 {
        Peer::try_sh("cat /tmp/a-writes 2>/dev/null || echo 0")
            .map(|(_, o)| o.trim().parse().unwrap_or(0))
            .unwrap_or(0)
    }

    /// Whether it still runs.
    pub(crate) fn running(&self) -> bool {
        self.0
            .sh("kill -0 $(cat /tmp/a-writer.pid) 2>/dev/null && echo yes; true")
            .contains("yes")
    }

    /// Once A runs again after a freeze: waits until its writer has failed
    /// (at once, or once the kernel gives up on the volume) or has made a
    /// few more writes (were A not fenced, they would go on). The writes
    /// it made meanwhile. (While A is frozen its count cannot be read: it
    /// is read once A answers.)
    pub(crate) fn fails_or_writes_on(&self) -> u64 {
        let before = self.writes();
        wait_for(
            "A's writer to fail, or A to write again",
            Duration::from_secs(120),
            || self.writes() > before + 3 || !self.running(),
        );
        self.writes() - before
    }
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
