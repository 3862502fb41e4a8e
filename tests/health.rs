//! Volume and storage health (CSI v1.13) on the file backend, through the
//! binary with a v1.13 client (the driver's own generated code), and the
//! v1.12 condition its older callers read from the same findings. Breaks
//! the storage for real (an image deleted under its loop device, a staging
//! mount taken away) and reads what each call reports. Needs root.

mod common;

use common::*;
use ferrovol::proto as pb;
use std::collections::BTreeSet;

fn locator(id: &str) -> &str {
    id.split_once(':').expect("backend:locator").1
}

fn image(h: &Harness, id: &str) -> std::path::PathBuf {
    h.state_dir()
        .join("pool/volumes")
        .join(format!("{}.img", locator(id)))
}

/// (status, reason) of each entry.
fn kinds(health: &pb::VolumeHealth) -> BTreeSet<(pb::VolumeHealthErrorType, String)> {
    health
        .health_statuses
        .iter()
        .map(|e| (e.status(), e.reason.clone()))
        .collect()
}

async fn node_health(h: &Harness, id: &str, staging: &str, target: &str) -> pb::VolumeHealth {
    h.node()
        .node_get_volume_health(pb::NodeGetVolumeHealthRequest {
            volume_id: id.into(),
            volume_publish_path: target.into(),
            staging_target_path: staging.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("NodeGetVolumeHealth {id}: {e:?}\n{}", h.log()))
        .into_inner()
        .volume_health
        .expect("a volume_health")
}

/// Every entry of ControllerListVolumeHealth, page by page of `max`.
async fn listed(h: &Harness, max: i32) -> Vec<pb::VolumeHealth> {
    let (mut all, mut token) = (Vec::new(), String::new());
    for _ in 0..100 {
        let page = h
            .controller()
            .controller_list_volume_health(pb::ControllerListVolumeHealthRequest {
                max_entries: max,
                starting_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(max == 0 || page.entries.len() <= max as usize, "{page:?}");
        all.extend(page.entries);
        if page.next_token.is_empty() {
            return all;
        }
        token = page.next_token;
    }
    panic!("ControllerListVolumeHealth never ended");
}

/// The controller's and the node's capabilities, as text.
async fn capabilities(h: &Harness) -> (String, String) {
    let controller = h
        .controller()
        .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let node = h
        .node()
        .node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    (format!("{controller:?}"), format!("{node:?}"))
}

#[tokio::test]
async fn health_is_reported_by_the_v1_13_calls_and_the_old_condition_alike() {
    let h = Harness::start_with_env(None, &[("FERROVOL_VOLUME_HEALTH", "true")]).await;

    // Capabilities (with --volume-health): v1.13's four calls, and v1.12's
    // condition kept.
    let (controller, node) = capabilities(&h).await;
    for cap in ["ListVolumeHealth", "GetVolumeHealth"] {
        assert!(controller.contains(cap), "{cap} missing: {controller}");
    }
    for cap in ["GetVolumeHealth", "StorageHealth", "VolumeCondition"] {
        assert!(node.contains(cap), "{cap} missing: {node}");
    }

    // Healthy: nothing known wrong anywhere.
    let p = h
        .provision("healthy", 16 * MIB, mount_cap("ext4", SNW))
        .await;
    let (staging, target) = (
        p.staging.display().to_string(),
        p.target.display().to_string(),
    );
    assert!(node_health(&h, &p.id, &staging, &target)
        .await
        .health_statuses
        .is_empty());
    assert!(h.controller_health(&p.id).await.health_statuses.is_empty());
    assert!(listed(&h, 0).await.is_empty());
    let storage = h.storage_health().await;
    assert!(storage.is_empty(), "{storage:?}");

    // The image deleted under its loop device: the controller cannot reach
    // it; the node still holds its data through the loop device until it
    // is unstaged (data loss to come); v1.12's callers see it abnormal.
    std::fs::remove_file(image(&h, &p.id)).unwrap();
    use pb::VolumeHealthErrorType::Inaccessible;
    let c = h.controller_health(&p.id).await;
    assert_eq!(c.volume_id, p.id);
    assert_eq!(
        kinds(&c),
        BTreeSet::from([(Inaccessible, "ImageMissing".to_string())]),
        "{c:?}"
    );
    let n = node_health(&h, &p.id, &staging, &target).await;
    assert_eq!(
        kinds(&n),
        BTreeSet::from([(
            pb::VolumeHealthErrorType::DataLoss,
            "ImageMissing".to_string()
        )]),
        "{n:?}"
    );
    let listed_ids: Vec<String> = listed(&h, 0)
        .await
        .into_iter()
        .map(|v| v.volume_id)
        .collect();
    assert_eq!(listed_ids, vec![p.id.clone()]);
    #[allow(deprecated)]
    let condition = h
        .node()
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: p.id.clone(),
            volume_path: target.clone(),
            staging_target_path: staging.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .volume_condition
        .unwrap();
    assert!(condition.abnormal, "{condition:?}");
    assert!(condition.message.contains("was deleted"), "{condition:?}");

    // The staging mount taken away as well: the node says so.
    h.node()
        .node_unpublish_volume(unpublish_req(&p.id, &p.target))
        .await
        .unwrap();
    let status = std::process::Command::new("umount")
        .arg(&p.staging)
        .status()
        .unwrap();
    assert!(status.success());
    let n = node_health(&h, &p.id, &staging, "").await;
    assert!(
        kinds(&n).contains(&(Inaccessible, "StagingMountGone".to_string())),
        "{n:?}"
    );

    // Ids: another driver's is NOT_FOUND on both sides; one of this
    // driver's that was never made is VolumeNotFound to the controller
    // and nothing this node holds.
    for id in ["other:pvc-1", ""] {
        let e = h
            .controller()
            .controller_get_volume_health(pb::ControllerGetVolumeHealthRequest {
                volume_id: id.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        let want = if id.is_empty() {
            tonic::Code::InvalidArgument
        } else {
            tonic::Code::NotFound
        };
        assert_eq!(e.code(), want, "{id:?}: {e:?}");
    }
    let never = format!("{}:never-made", p.id.split_once(':').unwrap().0);
    let c = h.controller_health(&never).await;
    assert_eq!(
        kinds(&c),
        BTreeSet::from([(Inaccessible, "VolumeNotFound".to_string())])
    );
    // The file backend's volumes live on this node: it says so too.
    assert_eq!(
        kinds(&node_health(&h, &never, "", "").await),
        BTreeSet::from([(Inaccessible, "VolumeNotFound".to_string())])
    );
    // One made but never staged (a stage that failed): its image gone is
    // said by the node as well.
    let unstaged = h
        .create(create_req("unstaged", 4 * MIB, mount_cap("ext4", SNW)))
        .await
        .volume_id;
    std::fs::remove_file(image(&h, &unstaged)).unwrap();
    assert_eq!(
        kinds(&node_health(&h, &unstaged, "", "").await),
        BTreeSet::from([(Inaccessible, "ImageMissing".to_string())])
    );
    h.delete_volume(&unstaged).await;
    let e = h
        .node()
        .node_get_volume_health(pb::NodeGetVolumeHealthRequest {
            volume_id: p.id.clone(),
            staging_target_path: "relative/path".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    h.node()
        .node_unstage_volume(unstage_req(&p.id, &p.staging))
        .await
        .unwrap();
    h.delete_volume(&p.id).await;
    h.assert_clean();
}

/// Without `--volume-health` the capabilities are v1.12's (what csi-sanity
/// v1.12 and other v1.12 callers accept), and the calls still answer.
#[tokio::test]
async fn without_the_flag_capabilities_stay_v1_12_and_the_list_gives_each_unhealthy_volume_once() {
    let h = Harness::start().await;
    let (controller, node) = capabilities(&h).await;
    assert!(!controller.contains("VolumeHealth"), "{controller}");
    assert!(
        !node.contains("VolumeHealth") && !node.contains("StorageHealth"),
        "{node}"
    );
    assert!(node.contains("VolumeCondition"), "{node}");
    let mut broken = BTreeSet::new();
    for i in 0..7 {
        let id = h
            .create(create_req(
                &format!("v{i}"),
                4 * MIB,
                mount_cap("ext4", SNW),
            ))
            .await
            .volume_id;
        if i % 2 == 0 {
            std::fs::remove_file(image(&h, &id)).unwrap();
            broken.insert(id);
        }
    }
    for max in [0, 1, 2, 3, 10] {
        let ids: Vec<String> = listed(&h, max)
            .await
            .into_iter()
            .map(|v| v.volume_id)
            .collect();
        let unique: BTreeSet<String> = ids.iter().cloned().collect();
        assert_eq!(ids.len(), unique.len(), "max {max}: {ids:?}");
        assert_eq!(unique, broken, "max {max}");
    }
    let e = h
        .controller()
        .controller_list_volume_health(pb::ControllerListVolumeHealthRequest {
            starting_token: "not a token".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");
    for id in broken {
        h.delete_volume(&id).await;
    }
}
