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
