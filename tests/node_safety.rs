//! Node safety through the binary on real mounts: another's filesystem at a
//! staging path or a target is never used, never taken for ours, and never
//! unmounted, before and after a driver restart. Needs root.

mod common;

use common::*;
use std::path::Path;
use tonic::Code;

fn mount_tmpfs_with_a_file(at: &Path) {
    std::fs::create_dir_all(at).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "someone-else"])
        .arg(at)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mount tmpfs");
    std::fs::write(at.join("theirs"), b"another tenant's file").unwrap();
}

fn still_theirs(at: &Path) {
    assert_eq!(
        std::fs::read(at.join("theirs")).unwrap(),
        b"another tenant's file",
        "{} was touched",
        at.display()
    );
}

#[tokio::test]
async fn foreign_mounts_are_refused_and_left_mounted() {
    let mut h = Harness::start().await;
    let cap = mount_cap("ext4", SNMW);
    let vol = h
        .controller()
        .create_volume(create_req("pvc-safe", 16 * MIB, cap.clone()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let id = vol.volume_id.clone();

    // A stage onto someone's tmpfs is refused, and nothing is attached.
    let foreign_staging = h.path("kubelet/staging/foreign");
    mount_tmpfs_with_a_file(&foreign_staging);
    let r = h
        .node()
        .node_stage_volume(stage_req(&id, &foreign_staging, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert!(
        h.loop_devices().is_empty(),
        "a refused stage attached a device"
    );
    still_theirs(&foreign_staging);
    h.node()
        .node_unstage_volume(unstage_req(&id, &foreign_staging))
        .await
        .unwrap();
    still_theirs(&foreign_staging);

    // Staged properly; a publish onto someone's tmpfs is refused.
    let staging = h.path("kubelet/staging/ours");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    let foreign_target = h.path("kubelet/pods/foreign");
    mount_tmpfs_with_a_file(&foreign_target);
    let r = h
        .node()
        .node_publish_volume(publish_req(
            &id,
            &staging,
            &foreign_target,
            cap.clone(),
            false,
        ))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    h.node()
        .node_unpublish_volume(unpublish_req(&id, &foreign_target))
        .await
        .unwrap();
    still_theirs(&foreign_target);

    // After a restart, the same: nothing of another's is taken or unmounted.
    h.kill();
    h.spawn().await;
    let r = h
        .node()
        .node_publish_volume(publish_req(
            &id,
            &staging,
            &foreign_target,
            cap.clone(),
            false,
        ))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    h.node()
        .node_unpublish_volume(unpublish_req(&id, &foreign_target))
        .await
        .unwrap();
    h.node()
        .node_unstage_volume(unstage_req(&id, &foreign_staging))
        .await
        .unwrap();
    still_theirs(&foreign_target);
    still_theirs(&foreign_staging);
    h.node()
        .node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty());
    // Only the two foreign mounts are left, for the harness to clean up.
    assert_eq!(h.mounts().len(), 2, "{:?}", h.mounts());
}

/// Mounts go only where they belong: never onto a directory that holds
/// anything, never outside `[node] allowed_paths` (judged on the resolved
/// path); refused before anything is created, attached or mounted.
#[tokio::test]
async fn mounts_go_only_onto_empty_paths_under_the_allowed_prefixes() {
    let config = "[node]\nallowed_paths = [\"@DIR@/kubelet\"]\n";
    let h = Harness::start_with(Some(config)).await;
    let cap = mount_cap("ext4", SNMW);
    let vol = h
        .controller()
        .create_volume(create_req("pvc-where", 16 * MIB, cap.clone()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let id = vol.volume_id.clone();
    let mut n = h.node();

    // Outside the prefix (the state dir stands in for /etc).
    let outside = h.path("state/etc");
    std::fs::create_dir_all(&outside).unwrap();
    let r = n
        .node_stage_volume(stage_req(&id, &outside, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    // Inside it by name, outside it once a symlink on the way is resolved.
    std::os::unix::fs::symlink(h.path("state"), h.path("kubelet/escape")).unwrap();
    let sneaky = h.path("kubelet/escape/etc");
    let r = n
        .node_stage_volume(stage_req(&id, &sneaky, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    // A staging directory that holds something.
    let full = h.path("kubelet/staging/full");
    std::fs::create_dir_all(&full).unwrap();
    std::fs::write(full.join("config"), b"keep me").unwrap();
    let r = n
        .node_stage_volume(stage_req(&id, &full, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert_eq!(std::fs::read(full.join("config")).unwrap(), b"keep me");
    assert!(h.loop_devices().is_empty() && h.mounts().is_empty());
    assert!(n
        .node_get_volume_stats(ferrovol::proto::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: full.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .is_err());

    // Staged properly: a publish outside the prefix, or onto a target that
    // holds something, is refused and creates nothing.
    let staging = h.path("kubelet/staging/ok");
    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    let out_target = h.path("state/pod-target");
    let r = n
        .node_publish_volume(publish_req(&id, &staging, &out_target, cap.clone(), false))
        .await;
    assert_eq!(code(&r), Code::InvalidArgument, "{r:?}");
    assert!(!out_target.exists(), "a refused publish created its target");
    let busy = h.path("kubelet/pods/busy");
    std::fs::create_dir_all(&busy).unwrap();
    std::fs::write(busy.join("data"), b"x").unwrap();
    let r = n
        .node_publish_volume(publish_req(&id, &staging, &busy, cap.clone(), false))
        .await;
    assert_eq!(code(&r), Code::FailedPrecondition, "{r:?}");
    assert_eq!(
        h.mounts().len(),
        1,
        "only the staging mount: {:?}",
        h.mounts()
    );
    n.node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty() && h.mounts().is_empty());
}
