//! `ferrovol client lifecycle`: one volume through its whole life against a
//! running driver (create, stage, publish, write, expand, snapshot,
//! restore, unpublish, unstage, delete), printing each step. Run it as root
//! on the driver's node; the work dir holds the staging and target paths.

use crate::proto::controller_client::ControllerClient;
use crate::proto::identity_client::IdentityClient;
use crate::proto::node_client::NodeClient;
use crate::proto::{self as pb, volume_capability as vc};
use std::collections::HashMap;
use std::path::Path;
use tonic::transport::Channel;
use tonic::Status;

fn local(e: std::io::Error) -> Status {
    Status::internal(format!("on this machine: {e}"))
}

fn capability() -> pb::VolumeCapability {
    pb::VolumeCapability {
        access_type: Some(vc::AccessType::Mount(vc::MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
        access_mode: Some(vc::AccessMode {
            mode: vc::access_mode::Mode::SingleNodeWriter as i32,
        }),
    }
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// The walk's clients, volume and paths.
struct Walk {
    c: ControllerClient<Channel>,
    n: NodeClient<Channel>,
    cap: pb::VolumeCapability,
    secrets: HashMap<String, String>,
    staging: std::path::PathBuf,
    target: std::path::PathBuf,
}

/// The size the walk's volume is made with (and twice it, expanded).
const SIZE: i64 = 64 << 20;

pub async fn walk(
    channel: Channel,
    work: &Path,
    secrets: HashMap<String, String>,
) -> Result<(), Status> {
    let info = IdentityClient::new(channel.clone())
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await?
        .into_inner();
    println!("driver {} {}", info.name, info.vendor_version);
    let mut w = Walk {
        c: ControllerClient::new(channel.clone()),
        n: NodeClient::new(channel),
        cap: capability(),
        secrets,
        staging: work.join("staging"),
        target: work.join("pod"),
    };
    let vol = w.create().await?;
    w.mount(&vol).await?;
    w.expand(&vol).await?;
    let (snapshot, restored) = w.snapshot_and_restore(&vol).await?;
    w.take_down(&vol, &[&restored, &vol], &snapshot).await?;
    let _ = std::fs::remove_dir(&w.staging);
    let _ = std::fs::remove_dir(work);
    println!("deleted both volumes and the snapshot: done");
    Ok(())
}

impl Walk {
    async fn create(&mut self) -> Result<String, Status> {
        let vol = self
            .c
            .create_volume(pb::CreateVolumeRequest {
                name: "lifecycle-volume".into(),
                capacity_range: Some(pb::CapacityRange {
                    required_bytes: SIZE,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![self.cap.clone()],
                secrets: self.secrets.clone(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .volume
            .ok_or_else(|| Status::internal("no volume in the answer"))?;
        println!("created {} ({} bytes)", vol.volume_id, vol.capacity_bytes);
        Ok(vol.volume_id)
    }

    /// Staged, published, and a file written into it.
    async fn mount(&mut self, vol: &str) -> Result<(), Status> {
        std::fs::create_dir_all(&self.staging).map_err(local)?;
        self.n
            .node_stage_volume(pb::NodeStageVolumeRequest {
                volume_id: vol.to_string(),
                staging_target_path: path(&self.staging),
                volume_capability: Some(self.cap.clone()),
                ..Default::default()
            })
            .await?;
        println!("staged at {}", self.staging.display());
        self.n
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: vol.to_string(),
                staging_target_path: path(&self.staging),
                target_path: path(&self.target),
                volume_capability: Some(self.cap.clone()),
                ..Default::default()
            })
            .await?;
        std::fs::write(self.target.join("hello.txt"), "hello from ferrovol\n").map_err(local)?;
        println!("published at {} and wrote hello.txt", self.target.display());
        Ok(())
    }

    /// Grown to twice its size while published, and its usage read.
    async fn expand(&mut self, vol: &str) -> Result<(), Status> {
        let range = Some(pb::CapacityRange {
            required_bytes: 2 * SIZE,
            limit_bytes: 0,
        });
        let grown = self
            .c
            .controller_expand_volume(pb::ControllerExpandVolumeRequest {
                volume_id: vol.to_string(),
                capacity_range: range,
                ..Default::default()
            })
            .await?
            .into_inner();
        let node_grow = self
            .n
            .node_expand_volume(pb::NodeExpandVolumeRequest {
                volume_id: vol.to_string(),
                volume_path: path(&self.target),
                capacity_range: range,
                ..Default::default()
            })
            .await;
        match node_grow {
            Ok(_) => println!("expanded online to {} bytes", grown.capacity_bytes),
            // Some sandboxes forbid growing a mounted ext4 (resize2fs needs
            // CAP_SYS_RESOURCE): say so and carry on with the rest.
            Err(e) => println!(
                "volume grew to {} bytes, but the filesystem could not grow here: {}",
                grown.capacity_bytes,
                e.message()
            ),
        }
        let stats = self
            .n
            .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: vol.to_string(),
                volume_path: path(&self.target),
                ..Default::default()
            })
            .await?
            .into_inner();
        if let Some(bytes) = stats.usage.first() {
            println!(
                "filesystem: {} bytes total, {} used",
                bytes.total, bytes.used
            );
        }
        Ok(())
    }

    /// A snapshot of the volume, and a new volume restored from it: their
    /// ids.
    async fn snapshot_and_restore(&mut self, vol: &str) -> Result<(String, String), Status> {
        let snap = self
            .c
            .create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: vol.to_string(),
                name: "lifecycle-snapshot".into(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .snapshot
            .ok_or_else(|| Status::internal("no snapshot in the answer"))?;
        println!("snapshot {}", snap.snapshot_id);
        let restored = self
            .c
            .create_volume(pb::CreateVolumeRequest {
                name: "lifecycle-restored".into(),
                volume_capabilities: vec![self.cap.clone()],
                volume_content_source: Some(pb::VolumeContentSource {
                    r#type: Some(pb::volume_content_source::Type::Snapshot(
                        pb::volume_content_source::SnapshotSource {
                            snapshot_id: snap.snapshot_id.clone(),
                        },
                    )),
                }),
                ..Default::default()
            })
            .await?
            .into_inner()
            .volume
            .ok_or_else(|| Status::internal("no volume in the answer"))?;
        println!("restored into {}", restored.volume_id);
        Ok((snap.snapshot_id, restored.volume_id))
    }

    /// Unpublished and unstaged; the volumes and the snapshot deleted.
    async fn take_down(
        &mut self,
        vol: &str,
        volumes: &[&str],
        snapshot: &str,
    ) -> Result<(), Status> {
        self.n
            .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                volume_id: vol.to_string(),
                target_path: path(&self.target),
            })
            .await?;
        self.n
            .node_unstage_volume(pb::NodeUnstageVolumeRequest {
                volume_id: vol.to_string(),
                staging_target_path: path(&self.staging),
            })
            .await?;
        println!("unpublished and unstaged");
        for id in volumes {
            self.c
                .delete_volume(pb::DeleteVolumeRequest {
                    volume_id: id.to_string(),
                    ..Default::default()
                })
                .await?;
        }
        self.c
            .delete_snapshot(pb::DeleteSnapshotRequest {
                snapshot_id: snapshot.to_string(),
                ..Default::default()
            })
            .await?;
        Ok(())
    }
}
