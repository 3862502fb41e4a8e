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
        .controller()
        .create_volume(create_req("pvc-metrics", 16 * MIB, cap.clone()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
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
    h.controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
}
