//! The error codes the CSI spec requires, and bad input: malformed ids,
//! path traversal, oversized names, absent or wrong paths. Each gets a clear
//! error with the right code, and nothing is created. Needs root.

mod common;

use common::*;
use ferrovol::proto as pb;
use std::collections::HashMap;
use tonic::Code;

/// The expected gRPC codes of a spec test, case by case. A case is named
/// by its section (the comment above it), its place there and the call it
/// makes; every case runs, and `done` fails the test naming each case that
/// got another code, with the driver's message.
struct Cases {
    test: &'static str,
    section: String,
    n: usize,
    ran: usize,
    failed: Vec<String>,
}

impl Cases {
    fn new(test: &'static str) -> Self {
        Cases {
            test,
            section: "start".into(),
            n: 0,
            ran: 0,
            failed: Vec::new(),
        }
    }

    fn section(&mut self, name: &str) {
        self.section = name.to_string();
        self.n = 0;
    }

    fn expect(&mut self, call: &str, got: Code, message: &str, want: Code, detail: Option<String>) {
        self.n += 1;
        self.ran += 1;
        if got != want {
            let call: String = call.split_whitespace().collect::<Vec<_>>().join(" ");
            self.failed.push(format!(
                "[{} #{}{}] {call}: got {got:?} ({message}), want {want:?}",
                self.section,
                self.n,
                detail.map(|d| format!(", {d}")).unwrap_or_default()
            ));
        }
    }

    fn done(self) {
        assert!(
            self.failed.is_empty(),
            "{}: {} of {} cases failed:\n{}",
            self.test,
            self.failed.len(),
            self.ran,
            self.failed.join("\n")
        );
    }
}

/// One case: `case!(cases, code(&answer), Code::X)`, or with a detail
/// that tells apart the cases of a loop.
macro_rules! case {
    ($cases:ident, code($answer:expr), $want:expr) => {
        case!(@ $cases, $answer, $want, None)
    };
    ($cases:ident, code($answer:expr), $want:expr, $detail:expr) => {
        case!(@ $cases, $answer, $want, Some($detail.to_string()))
    };
    (@ $cases:ident, $answer:expr, $want:expr, $detail:expr) => {{
        let answer = $answer;
        let message = match &answer {
            Ok(_) => String::new(),
            Err(s) => s.message().to_string(),
        };
        $cases.expect(stringify!($answer), code(answer), &message, $want, $detail)
    }};
}

fn pool_entries(h: &Harness) -> usize {
    std::fs::read_dir(h.state_dir().join("pool/volumes"))
        .unwrap()
        .count()
        + std::fs::read_dir(h.state_dir().join("pool/snapshots"))
            .unwrap()
            .count()
}

#[tokio::test]
async fn controller_codes() {
    let h = Harness::start().await;
    let mut cases = Cases::new("controller_codes");
    let mut c = h.controller();
    let cap = mount_cap("ext4", SNW);

    cases.section("Missing fields");
    let r = c
        .create_volume(pb::CreateVolumeRequest {
            name: String::new(),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await;
    case!(cases, code(&r), Code::InvalidArgument);
    let r = c
        .create_volume(pb::CreateVolumeRequest {
            name: "v".into(),
            ..Default::default()
        })
        .await;
    case!(cases, code(&r), Code::InvalidArgument);
    let mut no_mode = cap.clone();
    no_mode.access_mode = None;
    case!(
        cases,
        code(&c.create_volume(create_req("v", MIB, no_mode)).await),
        Code::InvalidArgument
    );
    // Names: too long, control characters; traversal-looking names are fine
    // (they become digests) but never paths.
    cases.section("Names: too long, control characters; traversal-looking names are fine (they become digests) but never paths");
    case!(
        cases,
        code(
            &c.create_volume(create_req(&"n".repeat(129), MIB, cap.clone()))
                .await
        ),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &c.create_volume(create_req("bad\u{1}name", MIB, cap.clone()))
                .await
        ),
        Code::InvalidArgument
    );
    let odd = h
        .create(create_req("../../etc/passwd", MIB, cap.clone()))
        .await;
    assert!(odd.volume_id.starts_with("file:h-"), "{}", odd.volume_id);
    let max_name = h
        .create(create_req(&"m".repeat(128), MIB, cap.clone()))
        .await;
    assert!(max_name.volume_id.len() <= 128);
    cases.section("Unsupported access mode, unknown parameter, unknown backend");
    case!(
        cases,
        code(
            &c.create_volume(create_req("v", MIB, mount_cap("ext4", MNMW)))
                .await
        ),
        Code::InvalidArgument
    );
    let mut p = create_req("v", MIB, cap.clone());
    p.parameters = HashMap::from([("bogus".into(), "1".into())]);
    case!(
        cases,
        code(&c.create_volume(p).await),
        Code::InvalidArgument
    );
    let mut p = create_req("v", MIB, cap.clone());
    p.parameters = HashMap::from([("backend".into(), "nfs".into())]);
    case!(
        cases,
        code(&c.create_volume(p).await),
        Code::InvalidArgument
    );
    cases.section("Capacity out of range; limit below required");
    case!(
        cases,
        code(
            &c.create_volume(create_req("huge", 1 << 50, cap.clone()))
                .await
        ),
        Code::OutOfRange
    );
    let mut r = create_req("v", 10 * MIB, cap.clone());
    r.capacity_range = Some(pb::CapacityRange {
        required_bytes: 10 * MIB,
        limit_bytes: 5 * MIB,
    });
    case!(cases, code(&c.create_volume(r).await), Code::OutOfRange);
    let mut r = create_req("v", 0, cap.clone());
    r.capacity_range = Some(pb::CapacityRange {
        required_bytes: -1,
        limit_bytes: 0,
    });
    case!(
        cases,
        code(&c.create_volume(r).await),
        Code::InvalidArgument
    );
    cases.section("Topology that is not this node");
    let mut r = create_req("v", MIB, cap.clone());
    r.accessibility_requirements = Some(pb::TopologyRequirement {
        requisite: vec![pb::Topology {
            segments: HashMap::from([("topology.ferrovol.io/node".into(), "elsewhere".into())]),
        }],
        preferred: vec![],
    });
    case!(
        cases,
        code(&c.create_volume(r).await),
        Code::ResourceExhausted
    );
    cases.section("Sources that do not exist");
    let mut r = create_req("v", MIB, cap.clone());
    r.volume_content_source = Some(snapshot_source("file:nope"));
    case!(cases, code(&c.create_volume(r).await), Code::NotFound);
    let mut r = create_req("v", MIB, cap.clone());
    r.volume_content_source = Some(volume_source("file:../../x"));
    case!(cases, code(&c.create_volume(r).await), Code::NotFound);
    assert_eq!(pool_entries(&h), 4, "only the two good volumes exist");

    cases.section("Delete: missing id is INVALID_ARGUMENT; unknown or malformed ids are done");
    case!(
        cases,
        code(&c.delete_volume(pb::DeleteVolumeRequest::default()).await),
        Code::InvalidArgument
    );
    for id in ["file:never-made", "file:../../etc", "nfs:x", "garbage"] {
        case!(
            cases,
            code(
                &c.delete_volume(pb::DeleteVolumeRequest {
                    volume_id: id.into(),
                    ..Default::default()
                })
                .await
            ),
            Code::Ok,
            id
        );
    }
    case!(
        cases,
        code(
            &c.delete_snapshot(pb::DeleteSnapshotRequest::default())
                .await
        ),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &c.delete_snapshot(pb::DeleteSnapshotRequest {
                snapshot_id: "file:none".into(),
                ..Default::default()
            })
            .await
        ),
        Code::Ok
    );

    cases.section("Validate: NOT_FOUND for unknown volumes; unconfirmed for bad modes");
    let v = |id: &str, caps: Vec<pb::VolumeCapability>| pb::ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        volume_capabilities: caps,
        ..Default::default()
    };
    case!(
        cases,
        code(
            &c.validate_volume_capabilities(v("", vec![cap.clone()]))
                .await
        ),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &c.validate_volume_capabilities(v(&odd.volume_id, vec![]))
                .await
        ),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &c.validate_volume_capabilities(v("file:missing", vec![cap.clone()]))
                .await
        ),
        Code::NotFound
    );
    let ok = c
        .validate_volume_capabilities(v(&odd.volume_id, vec![cap.clone()]))
        .await
        .unwrap()
        .into_inner();
    assert!(ok.confirmed.is_some());
    let no = c
        .validate_volume_capabilities(v(&odd.volume_id, vec![mount_cap("ext4", MNMW)]))
        .await
        .unwrap()
        .into_inner();
    assert!(no.confirmed.is_none() && !no.message.is_empty());

    cases.section("Expand: missing range, unknown volume, over the limit");
    let e = |id: &str, range: Option<pb::CapacityRange>| pb::ControllerExpandVolumeRequest {
        volume_id: id.into(),
        capacity_range: range,
        ..Default::default()
    };
    case!(
        cases,
        code(&c.controller_expand_volume(e(&odd.volume_id, None)).await),
        Code::InvalidArgument
    );
    let range = Some(pb::CapacityRange {
        required_bytes: 2 * MIB,
        limit_bytes: 0,
    });
    case!(
        cases,
        code(&c.controller_expand_volume(e("file:missing", range)).await),
        Code::NotFound
    );
    case!(
        cases,
        code(
            &c.controller_expand_volume(e(
                &odd.volume_id,
                Some(pb::CapacityRange {
                    required_bytes: 1 << 50,
                    limit_bytes: 0
                })
            ))
            .await
        ),
        Code::OutOfRange
    );
    cases.section("Shrinking is a no-op success reporting the current size");
    let same = c
        .controller_expand_volume(e(
            &odd.volume_id,
            Some(pb::CapacityRange {
                required_bytes: 1,
                limit_bytes: 0,
            }),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(same.capacity_bytes, MIB);

    cases.section("Snapshots");
    let s = |src: &str, name: &str| pb::CreateSnapshotRequest {
        source_volume_id: src.into(),
        name: name.into(),
        ..Default::default()
    };
    case!(
        cases,
        code(&c.create_snapshot(s("", "n")).await),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(&c.create_snapshot(s(&odd.volume_id, "")).await),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(&c.create_snapshot(s("file:missing", "n")).await),
        Code::NotFound
    );
    let gs = c
        .get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: "file:nope".into(),
            ..Default::default()
        })
        .await;
    case!(cases, code(&gs), Code::NotFound);
    let none = c
        .list_snapshots(pb::ListSnapshotsRequest {
            snapshot_id: "garbage".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(none.entries.is_empty());

    cases.section("Listing: bad token is ABORTED; negative max is INVALID_ARGUMENT");
    case!(
        cases,
        code(
            &c.list_volumes(pb::ListVolumesRequest {
                max_entries: 0,
                starting_token: "bogus".into()
            })
            .await
        ),
        Code::Aborted
    );
    case!(
        cases,
        code(
            &c.list_volumes(pb::ListVolumesRequest {
                max_entries: -1,
                starting_token: String::new()
            })
            .await
        ),
        Code::InvalidArgument
    );

    cases.section("GetVolume / capacity");
    case!(
        cases,
        code(
            &c.controller_get_volume(pb::ControllerGetVolumeRequest {
                volume_id: "file:missing".into()
            })
            .await
        ),
        Code::NotFound
    );
    let cap_resp = c
        .get_capacity(pb::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(cap_resp.available_capacity > 0);
    let far = c
        .get_capacity(pb::GetCapacityRequest {
            accessible_topology: Some(pb::Topology {
                segments: HashMap::from([("topology.ferrovol.io/node".into(), "elsewhere".into())]),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(far.available_capacity, 0);
    // ControllerModifyVolume: no key is no change (as csi-sanity asks), a
    // key the backend cannot change is refused, a volume that is not there
    // is NOT_FOUND.
    cases.section("ControllerModifyVolume: no key is no change (as csi-sanity asks), a key the backend cannot change is refused, a volume that is not there is NOT_FOUND");
    let modify = |id: &str, kv: &[(&str, &str)]| pb::ControllerModifyVolumeRequest {
        volume_id: id.into(),
        mutable_parameters: kv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let r = c
        .controller_modify_volume(modify(&odd.volume_id, &[]))
        .await;
    case!(cases, code(&r), Code::Ok);
    let r = c
        .controller_modify_volume(modify(&odd.volume_id, &[("tier", "gold")]))
        .await;
    case!(cases, code(&r), Code::InvalidArgument);
    let r = c
        .controller_modify_volume(modify("file:no-such-volume", &[("preallocate", "true")]))
        .await;
    case!(cases, code(&r), Code::NotFound);
    let r = c
        .controller_modify_volume(modify("", &[("preallocate", "true")]))
        .await;
    case!(cases, code(&r), Code::InvalidArgument);
    cases.done();
}

#[tokio::test]
async fn node_codes_and_bad_paths() {
    let h = Harness::start().await;
    let mut cases = Cases::new("node_codes_and_bad_paths");
    let mut n = h.node();
    let cap = mount_cap("ext4", SNW);
    let vol = h.create(create_req("pvc-n", 16 * MIB, cap.clone())).await;
    let staging = h.path("kubelet/staging/n");
    std::fs::create_dir_all(&staging).unwrap();

    cases.section("Stage: missing fields, malformed ids, bad staging paths");
    case!(
        cases,
        code(
            &n.node_stage_volume(stage_req("", &staging, cap.clone()))
                .await
        ),
        Code::InvalidArgument
    );
    let mut r = stage_req(&vol.volume_id, &staging, cap.clone());
    r.volume_capability = None;
    case!(
        cases,
        code(&n.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = stage_req(&vol.volume_id, &staging, cap.clone());
    r.staging_target_path = String::new();
    case!(
        cases,
        code(&n.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    for id in ["file:../../etc/passwd", "file:missing", "zzz:x"] {
        case!(
            cases,
            code(
                &n.node_stage_volume(stage_req(id, &staging, cap.clone()))
                    .await
            ),
            Code::NotFound,
            id
        );
    }
    let traversal = format!("{}/../../etc", staging.display());
    let mut r = stage_req(&vol.volume_id, &staging, cap.clone());
    r.staging_target_path = traversal;
    case!(
        cases,
        code(&n.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    let mut r = stage_req(&vol.volume_id, &staging, cap.clone());
    r.staging_target_path = "relative/path".into();
    case!(
        cases,
        code(&n.node_stage_volume(r).await),
        Code::InvalidArgument
    );
    let file = h.path("kubelet/not-a-dir");
    std::fs::write(&file, b"").unwrap();
    case!(
        cases,
        code(
            &n.node_stage_volume(stage_req(&vol.volume_id, &file, cap.clone()))
                .await
        ),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &n.node_stage_volume(stage_req(
                &vol.volume_id,
                &h.path("kubelet/absent"),
                cap.clone()
            ))
            .await
        ),
        Code::InvalidArgument
    );
    let link = h.path("kubelet/link");
    std::os::unix::fs::symlink("/etc", &link).unwrap();
    case!(
        cases,
        code(
            &n.node_stage_volume(stage_req(&vol.volume_id, &link, cap.clone()))
                .await
        ),
        Code::InvalidArgument
    );
    let mut bad_flags = cap.clone();
    if let Some(pb::volume_capability::AccessType::Mount(m)) = &mut bad_flags.access_type {
        m.mount_flags = vec!["x;reboot".into()];
    }
    case!(
        cases,
        code(
            &n.node_stage_volume(stage_req(&vol.volume_id, &staging, bad_flags))
                .await
        ),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &n.node_stage_volume(stage_req(&vol.volume_id, &staging, mount_cap("ntfs", SNW)))
                .await
        ),
        Code::InvalidArgument
    );
    assert!(
        h.loop_devices().is_empty(),
        "a refused stage attached a device"
    );
    assert!(h.mounts().is_empty());

    cases.section(
        "A filesystem type the backend does not serve: a bad request at stage and publish alike",
    );
    let target = h.path("kubelet/pods/t");
    let nfs = mount_cap("nfs4", SNW);
    case!(
        cases,
        code(
            &n.node_stage_volume(stage_req(&vol.volume_id, &staging, nfs.clone()))
                .await
        ),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &n.node_publish_volume(publish_req(&vol.volume_id, &staging, &target, nfs, false))
                .await
        ),
        Code::InvalidArgument
    );

    cases.section("Publish before stage: FAILED_PRECONDITION; no staging path: the same");
    case!(
        cases,
        code(
            &n.node_publish_volume(publish_req(
                &vol.volume_id,
                &staging,
                &target,
                cap.clone(),
                false
            ))
            .await
        ),
        Code::FailedPrecondition
    );
    let mut r = publish_req(&vol.volume_id, &staging, &target, cap.clone(), false);
    r.staging_target_path = String::new();
    case!(
        cases,
        code(&n.node_publish_volume(r).await),
        Code::FailedPrecondition
    );
    case!(
        cases,
        code(
            &n.node_publish_volume(publish_req(
                "file:missing",
                &staging,
                &target,
                cap.clone(),
                false
            ))
            .await
        ),
        Code::NotFound
    );
    let mut r = publish_req(&vol.volume_id, &staging, &target, cap.clone(), false);
    r.target_path = String::new();
    case!(
        cases,
        code(&n.node_publish_volume(r).await),
        Code::InvalidArgument
    );
    assert!(!target.exists(), "a refused publish created its target");

    // Stage, then publish into a target whose parent is missing or which is a symlink.
    cases
        .section("Stage, then publish into a target whose parent is missing or which is a symlink");
    n.node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let r = n
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &h.path("kubelet/nowhere/t"),
            cap.clone(),
            false,
        ))
        .await;
    case!(cases, code(&r), Code::InvalidArgument);
    let evil = h.path("kubelet/pods/evil");
    std::os::unix::fs::symlink(h.path("kubelet"), &evil).unwrap();
    let r = n
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &evil,
            cap.clone(),
            false,
        ))
        .await;
    case!(cases, code(&r), Code::InvalidArgument);
    assert_eq!(
        h.mounts().len(),
        1,
        "only the staging mount: {:?}",
        h.mounts()
    );
    cases.section("Staged for mount, published as block: refused");
    let r = n
        .node_publish_volume(publish_req(
            &vol.volume_id,
            &staging,
            &target,
            block_cap(SNW),
            false,
        ))
        .await;
    case!(cases, code(&r), Code::FailedPrecondition);
    cases.section("Staging again elsewhere: refused");
    let other = h.path("kubelet/staging/other");
    std::fs::create_dir_all(&other).unwrap();
    case!(
        cases,
        code(
            &n.node_stage_volume(stage_req(&vol.volume_id, &other, cap.clone()))
                .await
        ),
        Code::FailedPrecondition
    );

    cases.section("Stats: unknown volume, unknown path, missing fields");
    let st = |id: &str, p: &str| pb::NodeGetVolumeStatsRequest {
        volume_id: id.into(),
        volume_path: p.into(),
        staging_target_path: String::new(),
    };
    case!(
        cases,
        code(&n.node_get_volume_stats(st("", "/x")).await),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(&n.node_get_volume_stats(st(&vol.volume_id, "")).await),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &n.node_get_volume_stats(st("file:missing", &staging.display().to_string()))
                .await
        ),
        Code::NotFound
    );
    case!(
        cases,
        code(
            &n.node_get_volume_stats(st(&vol.volume_id, "/not/here"))
                .await
        ),
        Code::NotFound
    );
    cases.section("Expand: unknown volume");
    let ex = pb::NodeExpandVolumeRequest {
        volume_id: "file:missing".into(),
        volume_path: staging.display().to_string(),
        ..Default::default()
    };
    case!(cases, code(&n.node_expand_volume(ex).await), Code::NotFound);

    cases.section("Unpublish/unstage: missing fields; absent targets are fine");
    let up = |id: &str, t: &str| pb::NodeUnpublishVolumeRequest {
        volume_id: id.into(),
        target_path: t.into(),
    };
    case!(
        cases,
        code(&n.node_unpublish_volume(up("", "/x")).await),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(&n.node_unpublish_volume(up(&vol.volume_id, "")).await),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(
            &n.node_unpublish_volume(up(&vol.volume_id, &target.display().to_string()))
                .await
        ),
        Code::Ok
    );
    case!(
        cases,
        code(
            &n.node_unpublish_volume(up("file:missing", &target.display().to_string()))
                .await
        ),
        Code::NotFound
    );
    let us = |id: &str, p: &str| pb::NodeUnstageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: p.into(),
    };
    case!(
        cases,
        code(&n.node_unstage_volume(us("", "/x")).await),
        Code::InvalidArgument
    );
    case!(
        cases,
        code(&n.node_unstage_volume(us(&vol.volume_id, "")).await),
        Code::InvalidArgument
    );
    n.node_unstage_volume(us(&vol.volume_id, &staging.display().to_string()))
        .await
        .unwrap();
    assert!(h.loop_devices().is_empty());
    assert!(h.mounts().is_empty());
    cases.done();
}

#[tokio::test]
async fn secrets_never_reach_logs_or_errors() {
    let h = Harness::start().await;
    let secret = "S3cr3t-Value-4f9a";
    let secrets = HashMap::from([("password".to_string(), secret.to_string())]);
    let mut c = h.controller();
    let mut n = h.node();
    let mut r = create_req("sec", 1 << 50, mount_cap("ext4", SNW));
    r.secrets = secrets.clone();
    let e = c.create_volume(r).await.unwrap_err();
    assert!(!e.message().contains(secret));
    let mut r = stage_req(
        "file:missing",
        &h.path("kubelet/staging"),
        mount_cap("ext4", SNW),
    );
    r.secrets = secrets.clone();
    let e = n.node_stage_volume(r).await.unwrap_err();
    assert!(!e.message().contains(secret));
    let e = c
        .create_snapshot(pb::CreateSnapshotRequest {
            source_volume_id: "file:missing".into(),
            name: "s".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(!e.message().contains(secret));
    // An error that repeats what the request said (an unknown parameter
    // named by the same text as a secret it carried) shows no secret.
    let mut r = create_req("sec2", MIB, mount_cap("ext4", SNW));
    r.parameters = HashMap::from([(secret.to_string(), "x".to_string())]);
    r.secrets = secrets.clone();
    let e = c.create_volume(r).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        !e.message().contains(secret) && e.message().contains("***"),
        "{}",
        e.message()
    );
    let log = h.log();
    assert!(log.contains("CreateVolume"), "debug log was written");
    assert!(!log.contains(secret), "secret in the log:\n{log}");
}

/// What the stock sidecars send works: the external-snapshotter with
/// `--extra-create-metadata` adds its own keys to CreateSnapshot's
/// parameters (taken out, never refused); a key of no one is refused.
#[tokio::test]
async fn the_snapshotters_metadata_is_accepted() {
    let h = Harness::start().await;
    let mut c = h.controller();
    let vol = h
        .create(create_req("meta", 16 * MIB, mount_cap("ext4", SNW)))
        .await;
    let snapshot = |parameters: &[(&str, &str)]| pb::CreateSnapshotRequest {
        source_volume_id: vol.volume_id.clone(),
        name: "snap-meta".into(),
        parameters: parameters
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let extra = [
        ("csi.storage.k8s.io/volumesnapshot/name", "snap"),
        ("csi.storage.k8s.io/volumesnapshot/namespace", "default"),
        (
            "csi.storage.k8s.io/volumesnapshotcontent/name",
            "snapcontent-1",
        ),
    ];
    let s = c
        .create_snapshot(snapshot(&extra))
        .await
        .unwrap()
        .into_inner();
    assert!(s.snapshot.unwrap().ready_to_use);
    assert_eq!(
        code(&c.create_snapshot(snapshot(&[("speed", "fast")])).await),
        Code::InvalidArgument
    );
    c.delete_snapshot(pb::DeleteSnapshotRequest {
        snapshot_id: "file:snap-meta".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: vol.volume_id,
        ..Default::default()
    })
    .await
    .unwrap();
}

/// NodeGetVolumeStats and NodeExpandVolume for a volume this node does not
/// know answer NOT_FOUND whatever the path looks like (what csi-sanity
/// sends: a random id and `some/path`); a missing path is still
/// INVALID_ARGUMENT.
#[tokio::test]
async fn unknown_volumes_are_not_found_before_the_path_is_judged() {
    let h = Harness::start().await;
    let mut n = h.node();
    for path in ["some/path", "/nowhere", "../x"] {
        let stats = n
            .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: "file:unknown-volume".into(),
                volume_path: path.into(),
                staging_target_path: String::new(),
            })
            .await;
        assert_eq!(code(&stats), Code::NotFound, "stats {path}");
        let expand = n
            .node_expand_volume(pb::NodeExpandVolumeRequest {
                volume_id: "file:unknown-volume".into(),
                volume_path: path.into(),
                ..Default::default()
            })
            .await;
        assert_eq!(code(&expand), Code::NotFound, "expand {path}");
    }
    let no_path = n
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: "file:unknown-volume".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&no_path), Code::InvalidArgument);
}
