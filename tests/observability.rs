//! Metrics, health endpoints and logs through the binary. Needs root (the
//! file backend stages real loop devices).

mod common;

use common::*;
use ferrovol::proto as pb;

/// GET `path` over plain HTTP; returns (status, body).
fn get(port: u16, path: &str) -> (u16, String) {
    http_get(port, path).unwrap()
}

/// The value of one sample line (`name{labels} value`), if present.
fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn metrics_health_and_quiet_uncoloured_logs() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let h = Harness::start_with_env(
        None,
        &[
            ("FERROVOL_METRICS_ADDR", addr.as_str()),
            ("RUST_LOG", "info"),
        ],
    )
    .await;
    assert_eq!(get(port, "/healthz"), (200, "ok\n".into()));
    assert_eq!(get(port, "/readyz"), (200, "ready\n".into()));
    assert_eq!(get(port, "/nope").0, 404);

    // Some calls: a volume staged, a NOT_FOUND (the client's mistake) and a
    // FAILED_PRECONDITION.
    let cap = mount_cap("ext4", SNW);
    let vol = h
        .create(create_req("pvc-metrics", 16 * MIB, cap.clone()))
        .await;
    let staging = h.path("kubelet/staging/m");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    let r = h
        .controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: "file:no-such-volume".into(),
            ..Default::default()
        })
        .await;
    assert!(r.is_ok());
    let r = h
        .node()
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: "file:no-such-volume".into(),
            volume_path: "/nowhere".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&r), tonic::Code::NotFound);
    let busy = h
        .controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(code(&busy), tonic::Code::FailedPrecondition, "{busy:?}");

    let (status, text) = get(port, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(
        sample(
            &text,
            r#"ferrovol_rpcs_total{method="CreateVolume",code="Ok"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"ferrovol_rpcs_total{method="DeleteVolume",code="Ok"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"ferrovol_rpcs_total{method="DeleteVolume",code="FailedPrecondition"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"ferrovol_rpcs_total{method="NodeGetVolumeStats",code="NotFound"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"ferrovol_rpc_duration_seconds_count{method="NodeStageVolume",code="Ok"}"#
        ),
        Some(1.0)
    );
    // Probe from the harness's readiness check, and from /healthz not.
    assert!(sample(&text, r#"ferrovol_rpcs_total{method="Probe",code="Ok"}"#).unwrap() >= 1.0);
    assert_eq!(sample(&text, "ferrovol_volumes_staged "), Some(1.0));
    assert_eq!(sample(&text, "ferrovol_volumes_published "), Some(0.0));
    assert_eq!(sample(&text, "ferrovol_rpcs_in_flight "), Some(0.0));
    // The stage ran mkfs and attached a loop device: timed by program.
    assert!(
        sample(
            &text,
            r#"ferrovol_command_duration_seconds_count{command="mkfs.ext4"}"#
        ) >= Some(1.0),
        "{text}"
    );

    // Logs: no colour in a file; the failed precondition at INFO, the
    // client's NOT_FOUND below it (not shown at RUST_LOG=info).
    let log = h.log();
    assert!(!log.contains('\u{1b}'), "colour escapes in a log file");
    assert!(
        log.lines()
            .any(|l| l.contains(" INFO ") && l.contains("DeleteVolume") && l.contains("failed")),
        "{log}"
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("NodeGetVolumeStats") && l.contains("failed")),
        "{log}"
    );

    h.node()
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    h.delete_volume(&vol.volume_id).await;
}

/// A node that lacks what some backends need (the lvm volume group is not
/// here, nor is an iSCSI initiator name) starts, serves the backend it
/// has, and says which are out and why: in `/readyz` (still ready: one
/// backend is served), in `ferrovol_backend_available` and in its log.
/// Probe and `/healthz` stay well, so the liveness probe restarts
/// nothing: a new process would lack the same. Its node id carries no
/// initiator name, so no controller publishes an iscsi volume to it. A
/// node that has none of its backends is ready too, and says so. Needs
/// root and lvm2.
#[tokio::test]
async fn a_node_lacking_a_backend_s_prerequisites_serves_the_others() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let vg = format!("fv-absent-{}", std::process::id());
    let lvm = format!(
        "[[backend]]\ntype = \"lvm\"\nlvm_config = '{}'\n\
         [[backend.device_class]]\nname = \"d\"\nvolume_group = \"{vg}\"\n",
        common::fixtures::LVM_NO_ACTIVATION
    );
    let config = format!(
        "[[backend]]\ntype = \"file\"\npool = \"@DIR@/pool\"\n{lvm}\
         [[backend]]\ntype = \"iscsi\"\niqn_prefix = \"iqn.2026-11.io.ferrovol.test\"\n\
         portals = [\"127.0.0.1:3260\"]\ninitiator_name_file = \"@DIR@/no-initiator-name\"\n"
    );
    let h = Harness::start_with_env(
        Some(&config),
        &[
            ("FERROVOL_METRICS_ADDR", addr.as_str()),
            ("RUST_LOG", "info"),
        ],
    )
    .await;
    let probe = h.identity().probe(pb::ProbeRequest {}).await.unwrap();
    assert_eq!(probe.into_inner().ready, Some(true));
    assert_eq!(get(port, "/healthz"), (200, "ok\n".into()));
    let (status, body) = get(port, "/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("ready\n"), "{body}");
    assert!(body.contains("backend lvm unavailable here:"), "{body}");
    assert!(body.contains(&vg), "why lvm is out names its group: {body}");
    assert!(body.contains("backend iscsi unavailable here:"), "{body}");
    assert!(body.contains("no-initiator-name"), "{body}");
    assert!(!body.contains("backend file"), "{body}");
    let metrics = get(port, "/metrics").1;
    for (backend, up) in [("file", 1.0), ("lvm", 0.0), ("iscsi", 0.0)] {
        assert_eq!(
            sample(
                &metrics,
                &format!("ferrovol_backend_available{{backend=\"{backend}\"}}")
            ),
            Some(up),
            "{backend}: {metrics}"
        );
    }
    let node_id = h.node_id().await;
    assert!(!node_id.contains("iqn."), "{node_id}");
    // The backend this node has is served whole.
    let mut req = create_req("pvc-served", 16 * MIB, mount_cap("ext4", SNW));
    req.parameters.insert("backend".into(), "file".into());
    let p = h.provision_req(req).await;
    std::fs::write(p.target.join("f"), b"served").unwrap();
    h.teardown(&p).await;
    let log = h.log();
    for backend in ["lvm", "iscsi"] {
        let lines = log
            .lines()
            .filter(|l| l.contains("unavailable") && l.contains(&format!("backend={backend}")))
            .count();
        assert!(lines >= 1, "{backend}: {log}");
    }
    drop(h);
    // A node with none of its backends is ready all the same (a node
    // that legitimately lacks the volume group must not hold a DaemonSet's
    // rollout for ever), and says so; Probe well.
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let h = Harness::start_with_env(Some(&lvm), &[("FERROVOL_METRICS_ADDR", addr.as_str())]).await;
    assert!(h.identity().probe(pb::ProbeRequest {}).await.is_ok());
    let (status, body) = get(port, "/readyz");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("ready; no backend available on this node\n"),
        "{body}"
    );
    assert!(body.contains("backend lvm unavailable here:"), "{body}");
}
