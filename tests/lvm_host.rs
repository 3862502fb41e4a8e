//! The lvm backend's controller path on the host, through the real binary:
//! real lvm2 metadata on a loop-device volume group. The host kernel has no
//! device-mapper, so lvm runs with activation off; the node path and
//! snapshots are tested in the real-kernel guest. Needs root and lvm2.

mod common;

use common::fixtures::{wait_for, LvmVg, LVM_NO_ACTIVATION};
use common::*;
use ferrovol::proto as pb;
use std::collections::HashMap;
use tonic::Code;

fn config(vg: &str) -> String {
    format!(
        "[[backend]]\ntype = \"lvm\"\nlvm_config = '{LVM_NO_ACTIVATION}'\n\
         [[backend.device_class]]\nname = \"fast\"\nvolume_group = \"{vg}\"\n\
         zero_on_delete = false\n"
    )
}

#[tokio::test]
async fn lvm_controller_lifecycle_on_real_metadata() {
    require_root();
    let vg_name = format!("fvhost{}", std::process::id());
    let vg = LvmVg::with_config(&vg_name, 256, LVM_NO_ACTIVATION);
    let h = Harness::start_with(Some(&config(&vg_name))).await;
    let mut c = h.controller();
    let cap = mount_cap("ext4", SNW);

    let mut req = create_req("pvc-lvm", 10 * MIB, cap.clone());
    req.parameters = HashMap::from([("deviceClass".into(), "fast".into())]);
    let vol = h.create(req.clone()).await;
    assert_eq!(vol.volume_id, "lvm:fast.fv-pvc-lvm");
    assert_eq!(vol.capacity_bytes, 12 * MIB, "rounded up to 4 MiB extents");
    assert_eq!(
        vol.accessible_topology[0].segments["topology.ferrovol.io/node"],
        "test-node"
    );
    let tags = vg.lv_tags("fv-pvc-lvm").expect("LV exists");
    assert!(
        tags.contains("ferrovol-name:pvc-lvm") && tags.contains("ferrovol-fresh"),
        "{tags}"
    );
    // Idempotent; incompatible; unknown device class.
    assert_eq!(h.create(req.clone()).await.volume_id, vol.volume_id);
    assert_eq!(
        code(
            &c.create_volume(create_req("pvc-lvm", 100 * MIB, cap.clone()))
                .await
        ),
        Code::AlreadyExists
    );
    let mut bad = create_req("pvc-x", MIB, cap.clone());
    bad.parameters = HashMap::from([("deviceClass".into(), "slow".into())]);
    assert_eq!(code(&c.create_volume(bad).await), Code::InvalidArgument);
    // The VG cannot hold it ever / right now.
    assert_eq!(
        code(
            &c.create_volume(create_req("pvc-huge", 1 << 40, cap.clone()))
                .await
        ),
        Code::OutOfRange
    );
    c.create_volume(create_req("pvc-big", 200 * MIB, cap.clone()))
        .await
        .unwrap();
    assert_eq!(
        code(
            &c.create_volume(create_req("pvc-more", 60 * MIB, cap.clone()))
                .await
        ),
        Code::ResourceExhausted
    );

    // Capacity and listing.
    let cap_resp = c
        .get_capacity(pb::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        cap_resp.available_capacity,
        (252 - 12 - 200) * MIB,
        "{cap_resp:?}"
    );
    let listed = c
        .list_volumes(pb::ListVolumesRequest {
            max_entries: 1,
            starting_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);
    assert!(!listed.next_token.is_empty());

    // Expand.
    let e = c
        .controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 20 * MIB,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(e.capacity_bytes, 20 * MIB);
    assert!(e.node_expansion_required);
    let got = c
        .controller_get_volume(pb::ControllerGetVolumeRequest {
            volume_id: vol.volume_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 20 * MIB);

    // Delete, twice; an LV ferrovol did not make is never touched.
    vg.lvm(
        "lvcreate",
        &[
            "-q",
            "-y",
            "-Zn",
            "-Wn",
            "-L",
            "4M",
            "-n",
            "fv-foreign",
            &vg_name,
        ],
    );
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: "lvm:fast.fv-foreign".to_string(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(
        vg.lv_tags("fv-foreign").is_some(),
        "an untagged LV was removed"
    );
    for id in [vol.volume_id.clone(), "lvm:fast.fv-pvc-big".to_string()] {
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    assert!(vg.lv_tags("fv-pvc-lvm").is_none());
    assert!(c
        .list_volumes(pb::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .is_empty());
}

/// Creates racing for the last of a group's space: as many land as fit,
/// every other one is RESOURCE_EXHAUSTED (whether the check before lvcreate
/// or lvm itself turned it away), and nothing is left half made.
#[tokio::test]
async fn lvm_creates_racing_for_the_last_space() {
    require_root();
    let vg_name = format!("fvrace{}", std::process::id());
    // 64 MiB: 15 extents of 4 MiB after lvm's metadata.
    let vg = LvmVg::with_config(&vg_name, 64, LVM_NO_ACTIVATION);
    let h = Harness::start_with(Some(&config(&vg_name))).await;
    let cap = mount_cap("ext4", SNW);
    let calls: Vec<_> = (0..5)
        .map(|i| {
            let mut c = h.controller();
            let mut req = create_req(&format!("pvc-race-{i}"), 24 * MIB, cap.clone());
            req.parameters = HashMap::from([("deviceClass".into(), "fast".into())]);
            tokio::spawn(async move { c.create_volume(req).await })
        })
        .collect();
    let mut results = Vec::new();
    for call in calls {
        results.push(call.await.unwrap());
    }
    let landed = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(landed, 2, "6 extents each, 15 in the group");
    for r in &results {
        if let Err(s) = r {
            assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
        }
    }
    let lvs = vg.lvm("lvs", &["--noheadings", "-o", "lv_name", &vg_name]);
    assert_eq!(lvs.split_whitespace().count(), 2, "{lvs}");
}

/// The pids of the driver's lvm helpers (`ferrovol lvm-helper`).
fn helpers_of(driver: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if parent == Some(driver) && cmdline.split(|b| *b == 0).any(|a| a == b"lvm-helper") {
            out.push(pid);
        }
    }
    out
}

/// lvm's commands run in the driver's helpers (liblvm2cmd) by default,
/// and as one process each with `lvm_library = false`: the same calls
/// answer the same either way, and the helpers go with the driver.
#[tokio::test]
async fn lvm_commands_answer_alike_in_helpers_and_as_processes() {
    require_root();
    let mut answers = Vec::new();
    for library in [true, false] {
        let vg_name = format!("fvlib{}{}", std::process::id(), library as u8);
        let _vg = LvmVg::with_config(&vg_name, 64, LVM_NO_ACTIVATION);
        let config = config(&vg_name).replacen(
            "type = \"lvm\"\n",
            &format!("type = \"lvm\"\nlvm_library = {library}\n"),
            1,
        );
        let h = Harness::start_with(Some(&config)).await;
        let mut c = h.controller();
        let mut seen = Vec::new();
        for (name, mib) in [("a", 10), ("a", 10), ("a", 20), ("huge", 4096)] {
            let mut req = create_req(name, mib * MIB, mount_cap("ext4", SNW));
            req.parameters = HashMap::from([("deviceClass".into(), "fast".into())]);
            seen.push(match c.create_volume(req).await {
                Ok(r) => format!("{:?}", r.into_inner().volume.unwrap().capacity_bytes),
                Err(e) => format!("{:?}", e.code()),
            });
        }
        let listed = c
            .list_volumes(pb::ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
            .len();
        seen.push(listed.to_string());
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: "lvm:fast.fv-a".into(),
            ..Default::default()
        })
        .await
        .unwrap();
        let log = h.log();
        assert_eq!(
            log.contains("liblvm2cmd"),
            library,
            "lvm_library = {library}: the log says otherwise:\n{log}"
        );
        let helpers = helpers_of(h.pid());
        assert_eq!(!helpers.is_empty(), library, "helpers: {helpers:?}");
        drop(h);
        for pid in helpers {
            wait_for(
                "the helper to go with the driver",
                std::time::Duration::from_secs(30),
                || !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            );
        }
        answers.push(seen);
    }
    assert_eq!(answers[0], answers[1]);
    assert_eq!(
        answers[0],
        ["12582912", "12582912", "AlreadyExists", "OutOfRange", "1"]
    );
}
