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

pub async fn walk(
    channel: Channel,
    work: &Path,
    secrets: HashMap<String, String>,
) -> Result<(), Status> {
    let (mut id, mut c, mut n) = (
        IdentityClient::new(channel.clone()),
        ControllerClient::new(channel.clone()),
        NodeClient::new(channel),
    );
    let info = id
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await?
        .into_inner();
    println!("driver {} {}", info.name, info.vendor_version);

    let cap = capability();
    let size = 64 << 20;
    let vol = c
        .create_volume(pb::CreateVolumeRequest {
            name: "lifecycle-volume".into(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: size,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .volume
        .ok_or_else(|| Status::internal("no volume in the answer"))?;
    println!("created {} ({} bytes)", vol.volume_id, vol.capacity_bytes);

    let staging = work.join("staging");
    let target = work.join("pod");
    std::fs::create_dir_all(&staging).map_err(local)?;
    n.node_stage_volume(pb::NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: path(&staging),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    })
    .await?;
    println!("staged at {}", staging.display());
    n.node_publish_volume(pb::NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: path(&staging),
        target_path: path(&target),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    })
    .await?;
    std::fs::write(target.join("hello.txt"), "hello from ferrovol\n").map_err(local)?;
    println!("published at {} and wrote hello.txt", target.display());

    let range = Some(pb::CapacityRange {
        required_bytes: 2 * size,
        limit_bytes: 0,
    });
    let grown = c
        .controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: range,
            ..Default::default()
        })
        .await?
        .into_inner();
    let node_grow = n
        .node_expand_volume(pb::NodeExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: path(&target),
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
    let stats = n
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: path(&target),
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

    let snap = c
        .create_snapshot(pb::CreateSnapshotRequest {
            source_volume_id: vol.volume_id.clone(),
            name: "lifecycle-snapshot".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .ok_or_else(|| Status::internal("no snapshot in the answer"))?;
    println!("snapshot {}", snap.snapshot_id);
    let restored = c
        .create_volume(pb::CreateVolumeRequest {
            name: "lifecycle-restored".into(),
            volume_capabilities: vec![cap.clone()],
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

    n.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: path(&target),
    })
    .await?;
    n.node_unstage_volume(pb::NodeUnstageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: path(&staging),
    })
    .await?;
    println!("unpublished and unstaged");
    for id in [&restored.volume_id, &vol.volume_id] {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await?;
    }
    c.delete_snapshot(pb::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
        ..Default::default()
    })
    .await?;
    let _ = std::fs::remove_dir(&staging);
    let _ = std::fs::remove_dir(work);
    println!("deleted both volumes and the snapshot: done");
    Ok(())
}
