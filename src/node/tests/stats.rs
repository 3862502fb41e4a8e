//! Stats, expansion, conditions and the volume limit.

use super::*;

const MIB: u64 = 1 << 20;

fn usage(total: u64, free: u64, available: u64) -> crate::host::FsUsage {
    crate::host::FsUsage {
        total_bytes: total,
        free_bytes: free,
        available_bytes: available,
        total_inodes: 1000,
        free_inodes: 600,
    }
}

/// Stages the test's volume (an ext4 filesystem on its device).
async fn stage_ext4(f: &Fixture) {
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
}

#[tokio::test]
async fn stats_come_from_the_filesystem_and_the_condition_from_the_mounts() {
    let f = fixture();
    stage_ext4(&f).await;
    let staging = f.dir.path().join("staging");
    f.host
        .set_usage(&staging, usage(100 * MIB, 40 * MIB, 30 * MIB));
    let s = f.ops.stats(&id(), staging.to_str().unwrap()).await.unwrap();
    assert_eq!(
        (s.total_bytes, s.available_bytes, s.used_bytes),
        (100 * MIB, Some(30 * MIB), Some(60 * MIB))
    );
    assert_eq!((s.total_inodes, s.free_inodes), (Some(1000), Some(600)));
    assert_eq!(s.health, vec![]);
    // The staging mount goes away under the driver: abnormal, with why.
    f.mounter.unmount(&staging).unwrap();
    let s = f.ops.stats(&id(), staging.to_str().unwrap()).await.unwrap();
    assert_eq!(s.health[0].reason, crate::plugin::Reason::StagingMountGone);
    assert!(s.health[0].message.contains("is gone"));
}

#[tokio::test]
async fn stats_and_expand_answer_not_found_for_what_is_not_there() {
    let f = fixture();
    let unknown = VolumeId::parse("rec:never-staged").unwrap();
    // An unknown volume is NOT_FOUND, whatever the path looks like.
    for path in ["some/path", "/x", "../../etc"] {
        assert_eq!(
            f.ops.stats(&unknown, path).await.unwrap_err().kind,
            Kind::NotFound
        );
        assert_eq!(
            f.ops.expand(&unknown, path, 0, 0).await.unwrap_err().kind,
            Kind::NotFound
        );
    }
    stage_ext4(&f).await;
    // A known volume at a path where it is not: NOT_FOUND too.
    let elsewhere = f.dir.path().join("pods");
    for path in [elsewhere.to_str().unwrap(), "relative", "/"] {
        assert_eq!(
            f.ops.stats(&id(), path).await.unwrap_err().kind,
            Kind::NotFound,
            "{path}"
        );
        assert_eq!(
            f.ops.expand(&id(), path, 0, 0).await.unwrap_err().kind,
            Kind::NotFound,
            "{path}"
        );
    }
}

#[tokio::test]
async fn expand_refreshes_the_device_then_grows_the_filesystem() {
    let f = fixture();
    stage_ext4(&f).await;
    let staging = f.dir.path().join("staging");
    *f.backend.device_size.lock().unwrap() = 200 * MIB;
    // The device did not grow enough: the controller step is missing.
    let err = f
        .ops
        .expand(&id(), staging.to_str().unwrap(), 300 * MIB, 0)
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::OutOfRange);
    f.runner.ok("resize2fs");
    let size = f
        .ops
        .expand(&id(), staging.to_str().unwrap(), 150 * MIB, 0)
        .await
        .unwrap();
    assert_eq!(size, 200 * MIB);
    assert_eq!(f.runner.lines().last().unwrap(), "resize2fs /dev/fake0");
}

#[tokio::test]
async fn block_stats_report_the_device_size() {
    let f = fixture();
    let mut req = stage_req(&f, AccessMode::SingleNodeWriter);
    req.capability.access = AccessType::Block;
    f.ops.stage(req).await.unwrap();
    f.host.set_device_size(Path::new("/dev/fake0"), 64 * MIB);
    let staging = f.dir.path().join("staging");
    let s = f.ops.stats(&id(), staging.to_str().unwrap()).await.unwrap();
    assert_eq!(s.total_bytes, 64 * MIB);
    assert_eq!(s.available_bytes, None);
}

/// A remote staging mount gone stale: the volume condition says so, and a
/// publish is refused with FAILED_PRECONDITION (a bind of it would serve
/// nothing).
#[tokio::test]
async fn a_stale_remote_stage_is_abnormal_and_refuses_publish() {
    struct Share;
    #[async_trait::async_trait]
    impl Backend for Share {
        fn name(&self) -> &str {
            "net"
        }

        fn kind(&self) -> &'static crate::plugin::Kind {
            &crate::plugin::DOUBLE
        }

        fn fs_types(&self) -> &'static [&'static str] {
            &["nfs"]
        }

        async fn health(&self) -> Result<()> {
            Ok(())
        }

        fn access_modes(&self) -> Vec<AccessMode> {
            vec![AccessMode::MultiNodeMultiWriter]
        }

        fn stager(&self) -> Option<&dyn Stager> {
            Some(self)
        }
    }

    #[async_trait::async_trait]
    impl Stager for Share {
        async fn node_attach(&self, _: &VolumeId, _: &AttachContext) -> Result<Attachment> {
            Ok(Attachment::Remote {
                source: "10.0.0.1:/export/vol".into(),
                fs_type: "nfs".into(),
                options: vec![],
            })
        }

        async fn node_detach(&self, _: &VolumeId, _: Option<&Attachment>) -> Result<()> {
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let staging = dir.path().join("staging");
    let mut registry = Registry::new();
    registry.register(Arc::new(Share)).unwrap();
    let runner = Arc::new(FakeRunner::new());
    let host = Arc::new(crate::host::FakeHost::new());
    host.add_dir(&staging);
    let mounter = Arc::new(FakeMounter::on(host.clone()));
    let ops = NodeOps::new(
        Arc::new(registry),
        mounter.clone(),
        runner.clone(),
        NodeState::open(&dir.path().join("state")).unwrap(),
        crate::locks::OpLocks::new(),
        host.clone(),
    );
    let id = VolumeId::parse("net:v1").unwrap();
    let cap = VolumeCapability {
        access: AccessType::Mount {
            fs_type: String::new(),
            mount_flags: vec![],
        },
        mode: AccessMode::MultiNodeMultiWriter,
    };
    runner.ok("mount.nfs");
    ops.stage(StageRequest {
        volume_id: id.clone(),
        staging_path: staging.clone(),
        capability: cap.clone(),
        ctx: AttachContext::default(),
    })
    .await
    .unwrap();
    // What the helper mounted, as the mount table would show it; then the
    // server replaces the directory.
    mounter
        .mount_fs(
            Path::new("10.0.0.1:/export/vol"),
            &staging,
            "nfs",
            &MountOptions::default(),
        )
        .unwrap();
    mounter.set_stale(&staging);
    let stats = ops.stats(&id, staging.to_str().unwrap()).await.unwrap();
    let why = crate::plugin::health::condition(&stats.health).expect("abnormal");
    assert!(why.contains("Stale file handle"), "{why}");
    assert_eq!(
        stats.health[0].reason,
        crate::plugin::Reason::FilesystemNotAnswering
    );
    let target = dir.path().join("pods/t");
    let err = ops
        .publish(PublishRequest {
            volume_id: id.clone(),
            staging_path: staging.clone(),
            target_path: target.clone(),
            capability: cap,
            readonly: false,
            secrets: Default::default(),
            io: Default::default(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition, "{}", err.message);
    assert!(err.message.contains("stale"), "{}", err.message);
    assert!(!host.contains(&target), "nothing is left at the target");
}

#[tokio::test]
async fn the_volume_limit_is_the_cap_within_the_room_the_kernel_leaves() {
    let f = fixture();
    let sys = f.dir.path().join("sys");
    let put = |rel: &str, text: &str| {
        let p = sys.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    // 16 partitions a loop device: 2^16 of them; 3 bound, one ours.
    put("module/loop/parameters/max_part", "15\n");
    for n in 0..3 {
        put(
            &format!("block/loop{n}/loop/backing_file"),
            "/somewhere.img\n",
        );
    }
    let dev = f.dir.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("loop1"), "").unwrap();
    f.ops
        .state()
        .put_stage(StageRecord {
            volume_id: id(),
            staging_path: f.dir.path().join("staging/v1"),
            capability: mount_cap(AccessMode::SingleNodeWriter),
            attachment: Some(Attachment::Device {
                path: dev.join("loop1"),
            }),
            fs_type: Some("ext4".into()),
            mounted: None,
            crypt: None,
            crypt_formatting: false,
        })
        .unwrap();
    let tables = crate::host::devices::DeviceTables::at(&sys, &f.dir.path().join("devices"));
    let ops = Arc::into_inner(f.ops).unwrap().with_device_tables(tables);
    let room = (1 << 16) - 2;
    assert_eq!(ops.volume_limit(256).await.unwrap(), 256);
    assert_eq!(ops.volume_limit(0).await.unwrap(), room);
    assert_eq!(ops.volume_limit(1 << 20).await.unwrap(), room);
    // Another loop device bound by someone else: one place fewer, at once.
    put("block/loop7/loop/backing_file", "/other.img\n");
    assert_eq!(ops.volume_limit(0).await.unwrap(), room - 1);
}

/// A health check that hangs (storage that does not answer) holds no call
/// past the quick deadline, is never started twice, and holds no other
/// call: stats and storage health answer meanwhile; once the storage
/// answers, the next call does too.
#[tokio::test]
async fn a_hung_health_check_answers_late_and_holds_nothing() {
    use crate::plugin::health::Reason;
    use std::sync::atomic::Ordering::SeqCst;
    use std::time::{Duration, Instant};
    let f = fixture_with(Deadlines {
        quick: Duration::from_millis(200),
        ..Deadlines::default()
    });
    stage_ext4(&f).await;
    let staging = f.dir.path().join("staging");
    f.host
        .set_usage(&staging, usage(100 * MIB, 40 * MIB, 30 * MIB));
    let gate = Arc::new(tokio::sync::Notify::new());
    *f.backend.health_gate.lock().unwrap() = Some(gate.clone());
    for _ in 0..3 {
        let start = Instant::now();
        let found = f.ops.volume_health(&id(), "", "").await.unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(found[0].reason, Reason::HealthCheckTimedOut, "{found:?}");
        let s = f.ops.stats(&id(), staging.to_str().unwrap()).await.unwrap();
        assert_eq!(s.health[0].reason, Reason::HealthCheckTimedOut);
        assert_eq!(s.total_bytes, 100 * MIB);
    }
    assert_eq!(
        f.backend.health_checks.load(SeqCst),
        1,
        "one check at a time"
    );
    assert!(f.ops.storage_health().await.is_empty());
    // The storage answers again: the next call is not late.
    *f.backend.health_gate.lock().unwrap() = None;
    gate.notify_one();
    let found = f.ops.volume_health(&id(), "", "").await.unwrap();
    assert!(
        found
            .iter()
            .all(|f| f.reason != Reason::HealthCheckTimedOut),
        "{found:?}"
    );
}
