//! Reliability: a concurrency storm, crashes at random points, hung
//! commands, oversized requests, and secrets in every RPC that carries them.
//! Random choices come from a seed that is printed (set FERROVOL_SEED to
//! replay one). Needs root.

mod common;

use common::*;
use ferrovol::proto as pb;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Code;

/// Every call must answer within this; a hang fails the test.
const RPC_LIMIT: Duration = Duration::from_secs(60);

async fn bounded<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Code {
    match tokio::time::timeout(RPC_LIMIT, fut).await {
        Ok(Ok(_)) => Code::Ok,
        Ok(Err(s)) => {
            if !matches!(
                s.code(),
                Code::Aborted | Code::NotFound | Code::FailedPrecondition | Code::AlreadyExists
            ) {
                eprintln!("{what}: {:?}: {}", s.code(), s.message());
            }
            s.code()
        }
        Err(_) => panic!("{what} did not answer within {RPC_LIMIT:?}"),
    }
}

fn volume_id(name: &str) -> String {
    format!("file:{name}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_storm_answers_allowed_codes_and_leaks_nothing() {
    let mut seed_rng = Rng::seeded("storm");
    let h = Harness::start_with_env(None, &[("RUST_LOG", "info")]).await;
    let names = ["storm-a", "storm-b", "storm-c"];
    for n in names {
        std::fs::create_dir_all(h.path(&format!("kubelet/staging/{n}"))).unwrap();
    }
    let cap = mount_cap("ext4", SNMW);
    // The storm runs until it has made 2,000 calls and seen a publish answer
    // OK and a call refused as ABORTED (the two things it checks), however
    // slow the machine; past 120 s it stops and the checks below fail.
    use std::sync::atomic::AtomicUsize;
    let deadline = Instant::now() + Duration::from_secs(120);
    let (calls, published, aborted) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let mut tasks = Vec::new();
    for _client in 0..8u64 {
        let mut rng = Rng(seed_rng.next() | 1);
        let (mut c, mut n) = (h.controller(), h.node());
        let root = h.dir.path().to_path_buf();
        let cap = cap.clone();
        let (calls, published, aborted) = (calls.clone(), published.clone(), aborted.clone());
        tasks.push(tokio::spawn(async move {
            let mut seen: HashMap<String, usize> = HashMap::new();
            let done = || {
                calls.load(Ordering::Relaxed) >= 2000
                    && published.load(Ordering::Relaxed)
                    && aborted.load(Ordering::Relaxed)
            };
            while !done() && Instant::now() < deadline {
                let name = names[rng.below(3) as usize];
                let id = volume_id(name);
                let staging = root.join(format!("kubelet/staging/{name}"));
                let target = root.join(format!("kubelet/pods/{name}-{}", rng.below(3)));
                let op = rng.below(11);
                let (what, got, allowed): (&str, Code, &[Code]) = match op {
                    0 => {
                        let size = if rng.below(4) == 0 { 48 } else { 32 } * MIB;
                        (
                            "create",
                            bounded(
                                "create",
                                c.create_volume(create_req(name, size, cap.clone())),
                            )
                            .await,
                            &[Code::AlreadyExists],
                        )
                    }
                    1 => (
                        "delete",
                        bounded(
                            "delete",
                            c.delete_volume(pb::DeleteVolumeRequest {
                                volume_id: id.clone(),
                                ..Default::default()
                            }),
                        )
                        .await,
                        &[Code::FailedPrecondition],
                    ),
                    2 | 3 => (
                        "stage",
                        bounded(
                            "stage",
                            n.node_stage_volume(stage_req(&id, &staging, cap.clone())),
                        )
                        .await,
                        &[Code::NotFound],
                    ),
                    4 => (
                        "unstage",
                        bounded("unstage", n.node_unstage_volume(unstage_req(&id, &staging))).await,
                        &[Code::FailedPrecondition],
                    ),
                    5 | 6 => (
                        "publish",
                        bounded(
                            "publish",
                            n.node_publish_volume(publish_req(
                                &id,
                                &staging,
                                &target,
                                cap.clone(),
                                rng.below(5) == 0,
                            )),
                        )
                        .await,
                        &[
                            Code::NotFound,
                            Code::FailedPrecondition,
                            Code::AlreadyExists,
                        ],
                    ),
                    7 => (
                        "unpublish",
                        bounded(
                            "unpublish",
                            n.node_unpublish_volume(unpublish_req(&id, &target)),
                        )
                        .await,
                        &[Code::NotFound],
                    ),
                    8 => (
                        "expand",
                        bounded(
                            "expand",
                            c.controller_expand_volume(pb::ControllerExpandVolumeRequest {
                                volume_id: id.clone(),
                                capacity_range: Some(pb::CapacityRange {
                                    required_bytes: 40 * MIB,
                                    limit_bytes: 0,
                                }),
                                ..Default::default()
                            }),
                        )
                        .await,
                        &[Code::NotFound],
                    ),
                    9 => (
                        "snapshot",
                        bounded(
                            "snapshot",
                            c.create_snapshot(pb::CreateSnapshotRequest {
                                source_volume_id: id.clone(),
                                name: format!("snap-{name}"),
                                ..Default::default()
                            }),
                        )
                        .await,
                        &[Code::NotFound],
                    ),
                    _ => (
                        "stats",
                        bounded(
                            "stats",
                            n.node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                                volume_id: id.clone(),
                                volume_path: staging.display().to_string(),
                                staging_target_path: String::new(),
                            }),
                        )
                        .await,
                        &[Code::NotFound],
                    ),
                };
                assert!(
                    got == Code::Ok || got == Code::Aborted || allowed.contains(&got),
                    "{what} on {name} answered {got:?}, not a spec-allowed code"
                );
                *seen.entry(format!("{what}:{got:?}")).or_default() += 1;
                calls.fetch_add(1, Ordering::Relaxed);
                if what == "publish" && got == Code::Ok {
                    published.store(true, Ordering::Relaxed);
                }
                if got == Code::Aborted {
                    aborted.store(true, Ordering::Relaxed);
                }
            }
            seen
        }));
    }
    let mut totals: HashMap<String, usize> = HashMap::new();
    for t in tasks {
        for (k, v) in t.await.unwrap() {
            *totals.entry(k).or_default() += v;
        }
    }
    let mut keys: Vec<_> = totals.iter().collect();
    keys.sort();
    println!("storm answers: {keys:?}");
    assert!(
        totals.get("publish:Ok").copied().unwrap_or(0) > 0,
        "the storm never published anything"
    );
    assert!(
        totals.keys().any(|k| k.ends_with(":Aborted")),
        "no call ever overlapped another"
    );

    // Every surviving volume is consistent: it can be staged, published,
    // written and read, then torn down.
    let (mut c, mut n) = (h.controller(), h.node());
    for name in names {
        let id = volume_id(name);
        let staging = h.path(&format!("kubelet/staging/{name}"));
        for i in 0..3 {
            let t = h.path(&format!("kubelet/pods/{name}-{i}"));
            let r = n.node_unpublish_volume(unpublish_req(&id, &t)).await;
            assert!(matches!(code(&r), Code::Ok | Code::NotFound), "{r:?}");
            assert!(!t.exists());
        }
        let exists = c
            .controller_get_volume(pb::ControllerGetVolumeRequest {
                volume_id: id.clone(),
            })
            .await
            .is_ok();
        if exists {
            n.node_stage_volume(stage_req(&id, &staging, cap.clone()))
                .await
                .unwrap();
            let t = h.path(&format!("kubelet/pods/{name}-check"));
            n.node_publish_volume(publish_req(&id, &staging, &t, cap.clone(), false))
                .await
                .unwrap();
            std::fs::write(t.join("probe"), b"consistent").unwrap();
            assert_eq!(std::fs::read(t.join("probe")).unwrap(), b"consistent");
            n.node_unpublish_volume(unpublish_req(&id, &t))
                .await
                .unwrap();
        }
        n.node_unstage_volume(unstage_req(&id, &staging))
            .await
            .unwrap();
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        c.delete_snapshot(pb::DeleteSnapshotRequest {
            snapshot_id: format!("file:snap-{name}"),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    h.assert_clean();
}

/// Writes `data` to `path` and waits until it is on the device.
fn write_synced(path: &Path, data: &str) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(data.as_bytes()).unwrap();
    f.sync_all().unwrap();
}

/// One full lifecycle, each step retried until it succeeds (as a CO does).
/// With `written`, the volume already holds the file an earlier attempt
/// wrote, and it must still be there once the volume is published again.
async fn lifecycle(h: &Harness, name: &str, written: bool) {
    let (mut c, mut n) = (h.controller(), h.node());
    let cap = mount_cap("ext4", SNW);
    let staging = h.path(&format!("kubelet/staging/{name}"));
    std::fs::create_dir_all(&staging).unwrap();
    let target = h.path(&format!("kubelet/pods/{name}"));
    let id = h
        .create(create_req(name, 24 * MIB, cap.clone()))
        .await
        .volume_id;
    n.node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    n.node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
        .await
        .unwrap();
    if written {
        assert_eq!(
            std::fs::read_to_string(target.join("f")).ok().as_deref(),
            Some(name),
            "{name}: data written before the crash is gone"
        );
    }
    write_synced(&target.join("f"), name);
    c.create_snapshot(pb::CreateSnapshotRequest {
        source_volume_id: id.clone(),
        name: format!("{name}-snap"),
        ..Default::default()
    })
    .await
    .unwrap();
    n.node_unpublish_volume(unpublish_req(&id, &target))
        .await
        .unwrap();
    n.node_unstage_volume(unstage_req(&id, &staging))
        .await
        .unwrap();
    c.delete_snapshot(pb::DeleteSnapshotRequest {
        snapshot_id: format!("file:{name}-snap"),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crashes_at_random_points_lose_and_leak_nothing() {
    let mut rng = Rng::seeded("crash");
    let iterations: u64 = std::env::var("FERROVOL_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let mut h = Harness::start_with_env(None, &[("RUST_LOG", "info")]).await;
    // How long one undisturbed lifecycle takes, to aim the kills inside it.
    let t = Instant::now();
    lifecycle(&h, "warmup", false).await;
    let span = t.elapsed().as_micros() as u64;
    h.assert_clean();
    for i in 0..iterations {
        let name = format!("crash-{i}");
        let kill_after = Duration::from_micros(rng.below(span.max(1)));
        // Run the lifecycle against the driver and kill it part way. What
        // the driver confirmed before it died must survive it: the data
        // written to the published volume, and a snapshot it reported.
        let pid = h.pid();
        let wrote = Arc::new(AtomicBool::new(false));
        let snapped = Arc::new(AtomicBool::new(false));
        let run = {
            let (wrote, snapped) = (wrote.clone(), snapped.clone());
            let (mut c, mut n) = (h.controller(), h.node());
            let cap = mount_cap("ext4", SNW);
            let staging = h.path(&format!("kubelet/staging/{name}"));
            std::fs::create_dir_all(&staging).unwrap();
            let target = h.path(&format!("kubelet/pods/{name}"));
            let name = name.clone();
            tokio::spawn(async move {
                // Errors are expected once the driver dies.
                let Ok(v) = c
                    .create_volume(create_req(&name, 24 * MIB, cap.clone()))
                    .await
                else {
                    return;
                };
                let id = v.into_inner().volume.unwrap().volume_id;
                if n.node_stage_volume(stage_req(&id, &staging, cap.clone()))
                    .await
                    .is_err()
                {
                    return;
                }
                if n.node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
                    .await
                    .is_err()
                {
                    return;
                }
                write_synced(&target.join("f"), &name);
                wrote.store(true, Ordering::SeqCst);
                if c.create_snapshot(pb::CreateSnapshotRequest {
                    source_volume_id: id.clone(),
                    name: format!("{name}-snap"),
                    ..Default::default()
                })
                .await
                .is_ok()
                {
                    snapped.store(true, Ordering::SeqCst);
                }
                let _ = n.node_unpublish_volume(unpublish_req(&id, &target)).await;
                let _ = n.node_unstage_volume(unstage_req(&id, &staging)).await;
            })
        };
        tokio::time::sleep(kill_after).await;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let _ = run.await;
        h.kill();
        h.spawn().await;
        // The state on disk is whole: every record parses (the restarted
        // driver rewrote the journal whole when it opened it).
        let (_, torn) = ferrovol::state::NodeState::peek_publishes(&h.state_dir())
            .expect("the publish journal reads after a crash");
        assert_eq!(torn, 0, "iteration {i}: torn journal lines");
        let bad: Vec<_> = std::fs::read_dir(h.state_dir().join("node/staged"))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".bad"))
            .map(|e| e.file_name())
            .collect();
        assert!(
            bad.is_empty(),
            "iteration {i}: half-written records {bad:?}"
        );
        if snapped.load(Ordering::SeqCst) {
            h.controller()
                .get_snapshot(pb::GetSnapshotRequest {
                    snapshot_id: format!("file:{name}-snap"),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("iteration {i}: a reported snapshot is gone: {e}"));
        }
        // The CO retries the whole lifecycle; every step completes, and
        // the data written before the crash is read back.
        let written = wrote.load(Ordering::SeqCst);
        tokio::time::timeout(RPC_LIMIT, lifecycle(&h, &name, written))
            .await
            .unwrap_or_else(|_| {
                panic!("iteration {i} (kill after {kill_after:?}): lifecycle hung after restart")
            });
        h.assert_clean();
    }
}

#[tokio::test]
async fn a_hung_command_is_killed_and_the_volume_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let fakebin = dir.path().join("bin");
    std::fs::create_dir_all(&fakebin).unwrap();
    let marker = dir.path().join("hung-once");
    let tag = format!("ferrovol-hung-{}", std::process::id());
    // The first blkid hangs; later ones are the real tool.
    let script = format!(
        "#!/bin/bash\nif [ ! -e {m} ]; then touch {m}; exec -a {tag} sleep 1000; fi\nexec /usr/sbin/blkid \"$@\"\n",
        m = marker.display()
    );
    let fake = fakebin.join("blkid");
    std::fs::write(&fake, script).unwrap();
    std::os::unix::fs::PermissionsExt::set_mode(
        &mut std::fs::metadata(&fake).unwrap().permissions(),
        0o755,
    );
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        fakebin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let h = Harness::start_with_env(
        None,
        &[("PATH", path.as_str()), ("FERROVOL_COMMAND_TIMEOUT", "2")],
    )
    .await;
    let cap = mount_cap("ext4", SNW);
    let vol = h.create(create_req("hung", 16 * MIB, cap.clone())).await;
    let staging = h.path("kubelet/staging/hung");
    std::fs::create_dir_all(&staging).unwrap();
    let start = Instant::now();
    let err = h
        .node()
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "the hung command was not cut short"
    );
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("timed out"), "{}", err.message());
    assert!(marker.exists(), "the fake blkid never ran");
    // The hung child is gone.
    let alive = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| String::from_utf8_lossy(&c).starts_with(&tag));
    assert!(!alive, "the timed-out command is still running");
    // The failed stage was undone, and the next call on the volume works.
    assert!(h.loop_devices().is_empty());
    h.node()
        .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
        .await
        .unwrap();
    h.node()
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    h.delete_volume(&vol.volume_id).await;
    h.assert_clean();
}

#[tokio::test]
async fn oversized_requests_are_refused_and_nothing_is_created() {
    let h = Harness::start().await;
    let mut c = h.controller();
    let cap = mount_cap("ext4", SNW);
    // Larger than CSI allows, smaller than the transport limit.
    let r = c
        .create_volume(create_req(&"n".repeat(64 << 10), MIB, cap.clone()))
        .await;
    assert_eq!(code(&r), Code::InvalidArgument);
    // Larger than the transport accepts at all.
    let r = c
        .create_volume(create_req(&"n".repeat(5 << 20), MIB, cap.clone()))
        .await;
    assert!(code(&r) != Code::Ok, "a 5 MiB request was accepted");
    let mut big = create_req("params", MIB, cap.clone());
    big.parameters = (0..2000)
        .map(|i| (format!("k{i}"), "v".repeat(64)))
        .collect();
    assert_eq!(code(&c.create_volume(big).await), Code::InvalidArgument);
    let mut flags = cap.clone();
    if let Some(pb::volume_capability::AccessType::Mount(m)) = &mut flags.access_type {
        m.mount_flags = vec!["noatime".repeat(1000)];
    }
    let staging = h.path("kubelet/staging/o");
    std::fs::create_dir_all(&staging).unwrap();
    let r = h
        .node()
        .node_stage_volume(stage_req("file:nothing", &staging, flags))
        .await;
    assert!(
        matches!(code(&r), Code::InvalidArgument | Code::NotFound),
        "{r:?}"
    );
    let long_path = format!("/{}", "p".repeat(5000));
    let r = h
        .node()
        .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
            volume_id: "file:x".into(),
            target_path: long_path,
        })
        .await;
    assert_eq!(code(&r), Code::InvalidArgument);
    // The driver is still healthy and nothing was made.
    h.identity().probe(pb::ProbeRequest {}).await.unwrap();
    h.assert_clean();
}

/// Every RPC that carries a `secrets` map has its values hidden from its
/// error and the log, whichever keys they are and whether or not a backend
/// reads them (the service layer's redaction; the backends that read real
/// secrets are the next test's).
#[tokio::test]
async fn secret_values_in_every_rpc_are_hidden_from_errors_and_the_log() {
    let h = Harness::start_with_env(None, &[("RUST_LOG", "trace")]).await;
    let secret = "Sup3r-S3cret-Vaule-7d1c";
    let secrets: HashMap<String, String> = HashMap::from([
        ("password".into(), secret.into()),
        ("chap".into(), secret.into()),
    ]);
    let (mut c, mut n) = (h.controller(), h.node());
    let cap = mount_cap("ext4", SNW);
    let staging = h.path("kubelet/staging");
    let target = h.path("kubelet/pods/x");
    let mut messages = Vec::new();
    let mut note = |r: Result<(), tonic::Status>| {
        if let Err(s) = r {
            messages.push(s.message().to_string());
        }
    };
    // Each call is made to fail, so its error message is produced too.
    let mut cv = create_req("sec", 1 << 50, cap.clone());
    cv.secrets = secrets.clone();
    note(c.create_volume(cv).await.map(|_| ()));
    note(
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: "".into(),
            secrets: secrets.clone(),
        })
        .await
        .map(|_| ()),
    );
    note(
        c.controller_publish_volume(pb::ControllerPublishVolumeRequest {
            volume_id: "file:x".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    note(
        c.controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
            volume_id: "file:x".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    note(
        c.validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: "file:x".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    note(
        c.create_snapshot(pb::CreateSnapshotRequest {
            source_volume_id: "file:x".into(),
            name: "s".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    note(
        c.delete_snapshot(pb::DeleteSnapshotRequest {
            snapshot_id: "".into(),
            secrets: secrets.clone(),
        })
        .await
        .map(|_| ()),
    );
    note(
        c.list_snapshots(pb::ListSnapshotsRequest {
            starting_token: "bad".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    note(
        c.get_snapshot(pb::GetSnapshotRequest {
            snapshot_id: "file:none".into(),
            secrets: secrets.clone(),
        })
        .await
        .map(|_| ()),
    );
    note(
        c.controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: "file:x".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    note(
        c.controller_modify_volume(pb::ControllerModifyVolumeRequest {
            volume_id: "file:x".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    let mut st = stage_req("file:x", &staging, cap.clone());
    st.secrets = secrets.clone();
    note(n.node_stage_volume(st).await.map(|_| ()));
    let mut pu = publish_req("file:x", &staging, &target, cap.clone(), false);
    pu.secrets = secrets.clone();
    note(n.node_publish_volume(pu).await.map(|_| ()));
    note(
        n.node_expand_volume(pb::NodeExpandVolumeRequest {
            volume_id: "file:x".into(),
            volume_path: "/x".into(),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    assert_eq!(messages.len(), 14, "every call failed: {messages:?}");
    for m in &messages {
        assert!(!m.contains(secret), "secret in an error: {m}");
    }
    let log = h.log();
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "the log ran at trace level"
    );
    assert!(!log.contains(secret), "secret in the log");
    assert!(!Path::new(&target).exists());
}

#[tokio::test]
async fn sigterm_lets_the_call_in_flight_finish_then_exits_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let gate = BlkidGate::new(dir.path());
    // A long grace period: the exit must not wait it out for the idle
    // connection the test still holds.
    let mut h = Harness::start_with_env(
        None,
        &[
            ("PATH", gate.path.as_str()),
            ("FERROVOL_SHUTDOWN_GRACE", "120"),
        ],
    )
    .await;
    let cap = mount_cap("ext4", SNW);
    let vol = h
        .create(create_req("inflight", 16 * MIB, cap.clone()))
        .await;
    let staging = h.path("kubelet/staging/inflight");
    std::fs::create_dir_all(&staging).unwrap();
    let mut n = h.node();
    let req = stage_req(&vol.volume_id, &staging, cap.clone());
    let call = tokio::spawn(async move { n.node_stage_volume(req).await });
    // The stage is in flight once it sits in blkid.
    gate.wait_entered().await;
    let pid = nix::unistd::Pid::from_raw(h.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    gate.release();
    let answer = call.await.unwrap();
    assert!(answer.is_ok(), "the call in flight was cut: {answer:?}");
    let finished = Instant::now();
    let mut child = h.child.take().unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            finished.elapsed() < Duration::from_secs(60),
            "the driver waited out its grace period for an idle connection"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
    // Clean up what the finished stage set up.
    h.spawn().await;
    h.node()
        .node_unstage_volume(unstage_req(&vol.volume_id, &staging))
        .await
        .unwrap();
    h.delete_volume(&vol.volume_id).await;
    h.assert_clean();
}

/// The real secrets of the backends that read them, through the binary at
/// trace level: iscsi's CHAP secrets (ControllerPublish hands them to a
/// real tgtd; a second publish with another password, a stage and a
/// publish to another node fail with them in hand) and rbd's cephx key (CreateVolume
/// connects with it on a real cluster; a wrong key, an expansion and a
/// snapshot fail with it). Neither reaches an error or the log.
#[tokio::test]
async fn real_secrets_of_iscsi_and_rbd_never_reach_logs_or_errors() {
    use common::fixtures::{CephCluster, Tgtd};
    require_root();
    let tgtd = Tgtd::new();
    let ceph = CephCluster::new();
    let names = tempfile::tempdir().unwrap();
    let initiator_file = names.path().join("initiatorname.iscsi");
    std::fs::write(
        &initiator_file,
        "InitiatorName=iqn.2026-11.io.ferrovol.test:this-node\n",
    )
    .unwrap();
    let config = format!(
        "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"iqn.2026-11.io.ferrovol.test\"\n\
         portals = [\"{}\"]\ncontrol_port = {}\ninitiator_name_file = \"{}\"\n\
         [backend.store]\ntype = \"file\"\npool = \"@DIR@/pool\"\n\
         [[backend]]\ntype = \"rbd\"\ncluster_id = \"test\"\nmonitors = [\"v1:{}\"]\npools = [\"rbd\"]\n",
        tgtd.portal(),
        tgtd.control_port,
        initiator_file.display(),
        ceph.mon_addr,
    );
    let h = Harness::start_with_env(Some(&config), &[("RUST_LOG", "trace")]).await;
    let (mut c, mut n) = (h.controller(), h.node());
    let chap = "Sup3r-S3cret-Vaule-7d1c";
    let other = "0ther-S3cret-Vaule-9e2f";
    let key = ceph.client_key();
    let wrong_key = "AQBad0BhAAAAABAAbadbadbadbadbadbadbadbQ==";
    let chap_secrets = |password: &str| {
        HashMap::from([
            ("chapUsername".to_string(), "alice".to_string()),
            ("chapPassword".to_string(), password.to_string()),
        ])
    };
    let ceph_secrets = |key: &str| {
        HashMap::from([
            ("userID".to_string(), "ferrovol".to_string()),
            ("userKey".to_string(), key.to_string()),
        ])
    };
    let cap = mount_cap("ext4", SNW);
    let create = |name: &str, backend: &str, secrets: HashMap<String, String>| {
        let mut r = create_req(name, 16 * MIB, cap.clone());
        r.parameters.insert("backend".into(), backend.into());
        r.secrets = secrets;
        r
    };
    let mut messages = Vec::new();
    let mut failed = |r: Result<(), tonic::Status>| match r {
        Ok(()) => panic!("call {} was to fail", messages.len() + 1),
        Err(s) => messages.push(s.message().to_string()),
    };

    // iscsi: the secret reaches tgtd; then calls that fail holding it.
    let vol = h
        .create(create("sec-iscsi", "iscsi", chap_secrets(chap)))
        .await;
    let publish = |secrets: HashMap<String, String>| pb::ControllerPublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: "node/iqn.2026-11.io.ferrovol.test:node-a".into(),
        volume_capability: Some(cap.clone()),
        secrets,
        ..Default::default()
    };
    c.controller_publish_volume(publish(chap_secrets(chap)))
        .await
        .unwrap();
    failed(
        c.controller_publish_volume(publish(chap_secrets(other)))
            .await
            .map(|_| ()),
    );
    let staging = h.path("kubelet/staging");
    let mut st = stage_req(&vol.volume_id, &staging, cap.clone());
    st.secrets = chap_secrets(chap);
    failed(n.node_stage_volume(st).await.map(|_| ()));
    let mut to_b = publish(chap_secrets(chap));
    to_b.node_id = "node/iqn.2026-11.io.ferrovol.test:node-b".into();
    failed(c.controller_publish_volume(to_b).await.map(|_| ()));
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        secrets: chap_secrets(chap),
    })
    .await
    .unwrap();

    // rbd: the key makes a volume on the cluster; then calls that fail.
    let rv = h.create(create("sec-rbd", "rbd", ceph_secrets(&key))).await;
    failed(
        c.create_volume(create("sec-rbd-2", "rbd", ceph_secrets(wrong_key)))
            .await
            .map(|_| ()),
    );
    failed(
        c.controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: rv.volume_id.clone(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 32 * MIB,
                limit_bytes: 0,
            }),
            secrets: ceph_secrets(wrong_key),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    failed(
        c.create_snapshot(pb::CreateSnapshotRequest {
            source_volume_id: rv.volume_id.clone(),
            name: "sec-snap".into(),
            secrets: ceph_secrets(wrong_key),
            ..Default::default()
        })
        .await
        .map(|_| ()),
    );
    c.delete_volume(pb::DeleteVolumeRequest {
        volume_id: rv.volume_id.clone(),
        secrets: ceph_secrets(&key),
    })
    .await
    .unwrap();

    assert_eq!(messages.len(), 6, "{messages:?}");
    let log = h.log();
    assert!(log.contains("TRACE"), "the log ran at trace level");
    for secret in [chap, other, key.as_str(), wrong_key] {
        for m in &messages {
            assert!(!m.contains(secret), "a secret in an error: {m}");
        }
        assert!(!log.contains(secret), "a secret in the log");
    }
}
