//! Expansion of node-local volumes with the stock external-resizer: the
//! node-local driver's controller offers no controller expansion, so the
//! resizer leaves it to kubelet, and NodeExpandVolume grows the image on
//! the node, then the filesystem. Through the binary; needs root.

mod common;

use common::*;
use ferrovol::proto as pb;

#[tokio::test]
async fn without_controller_expansion_the_node_grows_image_and_filesystem() {
    let h = Harness::start_with_env(None, &[("FERROVOL_NO_CONTROLLER_EXPANSION", "true")]).await;
    let caps = h
        .controller()
        .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!format!("{caps:?}").contains("ExpandVolume"), "{caps:?}");
    // The plugin still says volumes grow (online), so the resizer acts.
    let plugin = h
        .identity()
        .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        format!("{plugin:?}").contains("VolumeExpansion"),
        "{plugin:?}"
    );

    // xfs: this host kernel refuses ext4 online resize (the ext4 path runs
    // in the guest).
    let cap = mount_cap("xfs", SNW);
    let p = h.provision("pvc-grow", 320 * MIB, cap.clone()).await;
    let r = h
        .controller()
        .controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: p.id.clone(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 512 * MIB,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&r), tonic::Code::Unimplemented, "{r:?}");

    let before = h.total_bytes(&p.id, &p.target).await;
    let grown = h
        .node()
        .node_expand_volume(pb::NodeExpandVolumeRequest {
            volume_id: p.id.clone(),
            volume_path: p.target.display().to_string(),
            staging_target_path: p.staging.display().to_string(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 512 * MIB,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 512 * MIB);
    let after = h.total_bytes(&p.id, &p.target).await;
    assert!(after > before + 150 * MIB, "filesystem {before} -> {after}");
    // The volume's recorded size grew too.
    let listed = h
        .controller()
        .list_volumes(pb::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.entries[0].volume.as_ref().unwrap().capacity_bytes,
        512 * MIB
    );
    // Again: nothing to do, same answer.
    let again = h
        .node()
        .node_expand_volume(pb::NodeExpandVolumeRequest {
            volume_id: p.id.clone(),
            volume_path: p.target.display().to_string(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 512 * MIB,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.capacity_bytes, 512 * MIB);
    h.teardown(&p).await;
}
