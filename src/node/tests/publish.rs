//! Publishing and what the node must not take: binds, stuck and remote mounts, read-only block publishes, foreign mounts, replaced targets.

use super::*;

#[tokio::test]
async fn publish_binds_and_failed_bind_is_undone() {
    let f = fixture();
    stage_ext4(&f).await;
    f.ops
        .publish(publish_req(
            &f,
            "a",
            AccessMode::SingleNodeMultiWriter,
            true,
        ))
        .await
        .unwrap();
    let target = f.dir.path().join("pods/a");
    let m = f.mounter.get(&target).unwrap();
    assert!(m.bind && m.readonly);
    assert_eq!(m.source, f.dir.path().join("staging"));

    f.mounter.fail_next(MountOp::Bind, 1);
    let err = f
        .ops
        .publish(publish_req(
            &f,
            "b",
            AccessMode::SingleNodeMultiWriter,
            false,
        ))
        .await
        .unwrap_err();
    assert!(err.message.contains("Bind"));
    assert!(
        !f.host.contains(&f.dir.path().join("pods/b")),
        "target left behind"
    );
    assert!(f
        .ops
        .state()
        .publish(&f.dir.path().join("pods/b"))
        .is_none());

    // Unstage is refused while a target is mounted, then succeeds.
    assert_eq!(
        f.ops
            .unstage(&id(), &f.dir.path().join("staging"))
            .await
            .unwrap_err()
            .kind,
        Kind::FailedPrecondition
    );
    f.ops.unpublish(&id(), &target).await.unwrap();
    assert!(!f.host.contains(&target));
    f.ops
        .unstage(&id(), &f.dir.path().join("staging"))
        .await
        .unwrap();
    assert_eq!(f.mounter.count(), 0);
    assert!(f.ops.state().stages().is_empty());
}

/// Mounts that hang in the kernel hold blocking threads, never the async
/// workers: with four stages stuck in mount(2) on a two-worker runtime
/// (the fake holds them until released), Probe and publishes of another
/// volume still answer, and each stuck stage fails with UNAVAILABLE at its
/// deadline while its mount is still stuck. (Bounded by what is checked,
/// not by the clock: were the workers held, the calls would never answer
/// and the generous bounds below would fail.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_mounts_do_not_stall_other_calls() {
    use crate::proto::identity_server::Identity;
    use crate::service::{identity::IdentityService, Driver, Mode};
    use std::time::Instant;

    let deadlines = Deadlines {
        quick: Duration::from_secs(5),
        mount: Duration::from_millis(1500),
    };
    let f = fixture_with(deadlines);
    // One volume staged normally, to publish while the others hang.
    f.runner.expect("blkid", Reply::Fail(2, String::new()));
    f.runner.ok("mkfs.ext4");
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeMultiWriter))
        .await
        .unwrap();
    let stuck_dir = f.dir.path().join("stuck");
    f.mounter.hang_mounts_under(&stuck_dir);
    let mut stuck = Vec::new();
    for i in 0..4 {
        let staging = stuck_dir.join(format!("s{i}"));
        f.host.add_dir(&staging);
        f.runner.expect("blkid", Reply::Fail(2, String::new()));
        f.runner.ok("mkfs.ext4");
        let ops = f.ops.clone();
        let req = StageRequest {
            volume_id: VolumeId::parse(&format!("rec:stuck{i}")).unwrap(),
            staging_path: staging,
            capability: mount_cap(AccessMode::SingleNodeWriter),
            ctx: AttachContext::default(),
        };
        stuck.push(tokio::spawn(async move {
            let started = Instant::now();
            (ops.stage(req).await, started.elapsed())
        }));
    }
    // Wait until all four sit in mount(2). (Were mounts run on the async
    // workers, two stuck ones would keep the other two from ever starting.)
    let waiting = Instant::now();
    while f
        .mounter
        .calls()
        .iter()
        .filter(|(op, p)| *op == MountOp::MountFs && p.starts_with(&stuck_dir))
        .count()
        < 4
    {
        assert!(
            waiting.elapsed() < Duration::from_secs(20),
            "the stages never all reached mount(2): stuck mounts hold the workers"
        );
        std::thread::yield_now();
        tokio::task::yield_now().await;
    }

    let driver = Arc::new(Driver {
        name: "csi.ferrovol.io".into(),
        version: "test".into(),
        node_id: "n1".into(),
        mode: Mode::All,
        settings: Default::default(),
        registry: f.registry.clone(),
        node: f.ops.clone(),
        controller: crate::controller::ControllerOps::new(
            f.registry.clone(),
            crate::locks::OpLocks::new(),
            "n1",
            "topology.ferrovol.io/node",
        ),
        in_flight: Default::default(),
        metrics: None,
        serving: Default::default(),
        controller_expansion: true,
        volumes_on_nodes: false,
        volume_health: false,
        lacking: Default::default(),
        unavailable: Default::default(),
    });
    let identity = IdentityService(driver);
    for i in 0..5 {
        let round = async {
            identity
                .probe(tonic::Request::new(Default::default()))
                .await
                .unwrap();
            let target = format!("t{i}");
            f.ops
                .publish(publish_req(
                    &f,
                    &target,
                    AccessMode::SingleNodeMultiWriter,
                    false,
                ))
                .await
                .unwrap();
            f.ops
                .unpublish(&id(), &f.dir.path().join("pods").join(&target))
                .await
                .unwrap();
        };
        tokio::time::timeout(Duration::from_secs(20), round)
            .await
            .expect("probe + publish + unpublish did not answer with four mounts stuck");
    }
    for task in stuck {
        let (result, took) = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("a stuck stage did not answer at its deadline")
            .unwrap();
        let err = result.unwrap_err();
        assert_eq!(err.kind, Kind::Unavailable, "{}", err.message);
        assert!(
            err.message.contains("did not finish within 1.5s"),
            "{}",
            err.message
        );
        // Never before its deadline; and it answered while its mount was
        // still stuck (released only below).
        assert!(took >= deadlines.mount, "{took:?}");
    }
    f.mounter.release_hung();
}

/// A remote filesystem is mounted by its helper in a child process, which
/// the exec seam kills at the deadline; the failed stage leaves nothing.
#[tokio::test]
async fn remote_mounts_go_through_the_killable_helper() {
    struct Remote;
    #[async_trait::async_trait]
    impl Backend for Remote {
        fn name(&self) -> &str {
            "net"
        }

        fn kind(&self) -> &'static crate::plugin::Kind {
            &crate::plugin::DOUBLE
        }

        fn fs_types(&self) -> &'static [&'static str] {
            &["nfs", "nfs4"]
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
    impl Stager for Remote {
        async fn node_attach(&self, _: &VolumeId, _: &AttachContext) -> Result<Attachment> {
            Ok(Attachment::Remote {
                source: "10.0.0.1:/export/vol".into(),
                fs_type: "nfs".into(),
                options: vec!["nfsvers=4.2".into()],
            })
        }

        async fn node_detach(&self, _: &VolumeId, _: Option<&Attachment>) -> Result<()> {
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let staging = dir.path().join("staging");
    let host = Arc::new(crate::host::FakeHost::new());
    host.add_dir(&staging);
    let mut registry = Registry::new();
    registry.register(Arc::new(Remote)).unwrap();
    let mounter = Arc::new(FakeMounter::on(host.clone()));
    let runner = Arc::new(FakeRunner::new());
    let ops = NodeOps::new(
        Arc::new(registry),
        mounter.clone(),
        runner.clone(),
        NodeState::open(&dir.path().join("state")).unwrap(),
        crate::locks::OpLocks::new(),
        host,
    );
    let req = |fs: &str| StageRequest {
        volume_id: VolumeId::parse("net:v1").unwrap(),
        staging_path: staging.clone(),
        capability: VolumeCapability {
            access: AccessType::Mount {
                fs_type: fs.into(),
                mount_flags: vec!["noatime".into()],
            },
            mode: AccessMode::MultiNodeMultiWriter,
        },
        ctx: AttachContext::default(),
    };
    // ext4 is not this backend's: refused before anything runs.
    assert_eq!(
        ops.stage(req("ext4")).await.unwrap_err().kind,
        Kind::InvalidArgument
    );
    assert!(runner.lines().is_empty());

    runner.expect("mount.nfs", Reply::Timeout);
    let err = ops.stage(req("")).await.unwrap_err();
    assert_eq!(err.kind, Kind::Unavailable, "{}", err.message);
    let line = format!(
        "mount.nfs 10.0.0.1:/export/vol {} -o rw,noatime,nfsvers=4.2",
        staging.display()
    );
    assert_eq!(runner.lines(), [line]);
    assert_eq!(runner.calls()[0].timeout, Deadlines::default().mount);
    assert!(ops
        .state()
        .stage(&VolumeId::parse("net:v1").unwrap())
        .is_none());
    // An SELinux label: the NFS mount gets a superblock of its own.
    runner.expect("mount.nfs", Reply::Timeout);
    let mut labelled = req("");
    labelled.capability.access = AccessType::Mount {
        fs_type: String::new(),
        mount_flags: vec!["context=\"system_u:object_r:container_file_t:s0:c1,c2\"".into()],
    };
    ops.stage(labelled).await.unwrap_err();
    assert_eq!(
        runner.lines()[1],
        format!(
            "mount.nfs 10.0.0.1:/export/vol {} -o rw,context=\"system_u:object_r:container_file_t:s0:c1,c2\",nfsvers=4.2,nosharecache",
            staging.display()
        )
    );
    // Nothing is formatted and no mount(2) is made for a remote filesystem.
    assert!(mounter
        .calls()
        .iter()
        .all(|(op, _)| *op != MountOp::MountFs));
}

/// A read-only block publish binds a read-only loop device of its own over
/// the device the staged path names (its links resolved, as an LV's
/// `/dev/vg/lv` names `/dev/dm-N`), since a read-only bind of a device node
/// does not stop writes; its unpublish detaches that loop device and no
/// other.
#[tokio::test]
async fn a_read_only_block_publish_goes_through_its_own_read_only_loop() {
    let f = fixture();
    let mut req = stage_req(&f, AccessMode::SingleNodeMultiWriter);
    req.capability.access = AccessType::Block;
    f.ops.stage(req).await.unwrap();
    f.host
        .set_link(Path::new("/dev/fake0"), Path::new("/dev/dm-7"));
    let mut p = publish_req(&f, "ro", AccessMode::SingleNodeMultiWriter, true);
    p.capability.access = AccessType::Block;
    let target = p.target_path.clone();
    f.ops.publish(p).await.unwrap();
    assert_eq!(f.loops.calls(), ["attach /dev/dm-7 ro"]);
    let bound = f.mounter.get(&target).unwrap();
    assert_eq!(bound.source, Path::new("/dev/loop50"));
    // A writable publish beside it binds the device itself.
    let mut w = publish_req(&f, "rw", AccessMode::SingleNodeMultiWriter, false);
    w.capability.access = AccessType::Block;
    let writable = w.target_path.clone();
    f.ops.publish(w).await.unwrap();
    assert_eq!(
        f.mounter.get(&writable).unwrap().source,
        Path::new("/dev/fake0")
    );
    assert_eq!(f.loops.calls().len(), 1);

    f.ops.unpublish(&id(), &writable).await.unwrap();
    assert_eq!(f.loops.calls().len(), 1, "the writable one has no loop");
    f.ops.unpublish(&id(), &target).await.unwrap();
    assert_eq!(
        f.loops.calls(),
        ["attach /dev/dm-7 ro", "detach /dev/loop50"]
    );
    assert!(f.mounter.get(&target).is_none());
}

/// A raw block volume's device gone from /dev under its publish (an LV
/// removed, a LUN deleted): the unpublish still takes its own bind away,
/// known by the device node recorded at publish; a record from before
/// that was recorded takes the device node bound there for its own.
#[tokio::test]
async fn a_block_publish_whose_device_is_gone_is_unpublished() {
    let f = fixture();
    let mut req = stage_req(&f, AccessMode::SingleNodeWriter);
    req.capability.access = AccessType::Block;
    f.ops.stage(req).await.unwrap();
    let mut p = publish_req(&f, "pod", AccessMode::SingleNodeWriter, false);
    p.capability.access = AccessType::Block;
    let target = p.target_path.clone();
    f.ops.publish(p.clone()).await.unwrap();
    assert!(f.ops.state().publish(&target).unwrap().bound.is_some());
    f.mounter.set_gone(Path::new("/dev/fake0"));
    f.ops.unpublish(&id(), &target).await.unwrap();
    assert!(f.mounter.get(&target).is_none());
    assert!(f.ops.state().publish(&target).is_none());

    // As an earlier version recorded it: no bound device node.
    let mut old = publish_req(&f, "old", AccessMode::SingleNodeWriter, false);
    old.capability.access = AccessType::Block;
    let old_target = old.target_path.clone();
    f.mounter.clear_gone();
    f.ops.publish(old).await.unwrap();
    let mut record = f.ops.state().publish(&old_target).unwrap();
    record.bound = None;
    f.ops.state().put_publish(record).unwrap();
    f.mounter.set_gone(Path::new("/dev/fake0"));
    f.ops.unpublish(&id(), &old_target).await.unwrap();
    assert!(f.mounter.get(&old_target).is_none());
}

/// Another's filesystem at a staging path or a target is never taken for
/// ours, used, or unmounted.
#[tokio::test]
async fn foreign_mounts_are_refused_and_left_alone() {
    let f = fixture();
    let staging = f.dir.path().join("staging");
    // Someone's tmpfs sits where the volume should be staged.
    f.mounter.mount_foreign(&staging);
    // Refused before the device is probed or formatted.
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition, "{}", err.message);
    assert_eq!(
        f.mounter.get(&staging).unwrap().fstype,
        "tmpfs",
        "left in place"
    );
    assert!(f.ops.state().stage(&id()).is_none(), "nothing recorded");
    assert_eq!(
        f.backend.detached.lock().unwrap().len(),
        1,
        "our device released"
    );
    // Unstage and unpublish with nothing of ours there: OK, tmpfs untouched.
    f.ops.unstage(&id(), &staging).await.unwrap();
    let target = f.dir.path().join("pods/t");
    // Something is mounted there, so there is a directory there.
    f.host.add_dir(&target);
    f.mounter.mount_foreign(&target);
    f.ops.unpublish(&id(), &target).await.unwrap();
    assert_eq!(f.mounter.get(&staging).unwrap().fstype, "tmpfs");
    assert_eq!(f.mounter.get(&target).unwrap().fstype, "tmpfs");

    // Staged for real elsewhere; a publish onto the foreign target is refused.
    f.mounter.unmount(&staging).unwrap();
    stage_ext4(&f).await;
    let err = f
        .ops
        .publish(publish_req(
            &f,
            "t",
            AccessMode::SingleNodeMultiWriter,
            false,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition, "{}", err.message);
    assert_eq!(f.mounter.get(&target).unwrap().fstype, "tmpfs");

    // Our staged mount replaced by another's under the driver: a repeated
    // stage refuses it, and unstage leaves it.
    f.mounter.unmount(&staging).unwrap();
    f.mounter.mount_foreign(&staging);
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeMultiWriter))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition, "{}", err.message);
    f.ops.unstage(&id(), &staging).await.unwrap();
    assert_eq!(f.mounter.get(&staging).unwrap().fstype, "tmpfs");
}

/// A published target whose bind was replaced by another's mount is not
/// "already published", and unpublish leaves the other mount alone.
#[tokio::test]
async fn a_replaced_target_is_not_ours() {
    let f = fixture();
    stage_ext4(&f).await;
    let req = || publish_req(&f, "t", AccessMode::SingleNodeMultiWriter, false);
    f.ops.publish(req()).await.unwrap();
    f.ops.publish(req()).await.unwrap(); // ours: idempotent
    let target = f.dir.path().join("pods/t");
    f.mounter.unmount(&target).unwrap();
    f.mounter.mount_foreign(&target);
    assert_eq!(
        f.ops.publish(req()).await.unwrap_err().kind,
        Kind::FailedPrecondition
    );
    f.ops.unpublish(&id(), &target).await.unwrap();
    assert_eq!(f.mounter.get(&target).unwrap().fstype, "tmpfs");
    assert!(f.ops.state().publish(&target).is_none());
}

/// A staged filesystem's SELinux label is its superblock's: the stage's
/// mount gets it; a publish asking the same label binds it, one asking
/// another (or one staged without) is refused naming both; one asking
/// none binds what was staged.
#[tokio::test]
async fn a_publish_gets_the_selinux_label_it_was_staged_with_or_none() {
    let f = fixture();
    let labelled = |label: Option<&str>| VolumeCapability {
        access: AccessType::Mount {
            fs_type: String::new(),
            mount_flags: label
                .map(|l| {
                    vec![format!(
                        "context=\"system_u:object_r:container_file_t:s0:{l}\""
                    )]
                })
                .unwrap_or_default(),
        },
        mode: AccessMode::SingleNodeMultiWriter,
    };
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(StageRequest {
            capability: labelled(Some("c1,c2")),
            ..stage_req(&f, AccessMode::SingleNodeMultiWriter)
        })
        .await
        .unwrap();
    let staged = f.mounter.get(&f.dir.path().join("staging")).unwrap();
    assert_eq!(
        staged.options.selinux(),
        vec!["context=\"system_u:object_r:container_file_t:s0:c1,c2\""]
    );
    let publish = |target: &str, label: Option<&str>| PublishRequest {
        capability: labelled(label),
        ..publish_req(&f, target, AccessMode::SingleNodeMultiWriter, false)
    };
    f.ops.publish(publish("same", Some("c1,c2"))).await.unwrap();
    f.ops.publish(publish("none", None)).await.unwrap();
    let e = f
        .ops
        .publish(publish("other", Some("c3,c4")))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(
        e.message.contains("s0:c1,c2") && e.message.contains("s0:c3,c4"),
        "{e}"
    );
    assert!(f.mounter.get(&f.dir.path().join("pods/other")).is_none());
    for t in ["same", "none"] {
        f.ops
            .unpublish(&id(), &f.dir.path().join("pods").join(t))
            .await
            .unwrap();
    }
    f.ops
        .unstage(&id(), &f.dir.path().join("staging"))
        .await
        .unwrap();

    // Staged without a label: a publish asking one is refused.
    stage_ext4(&f).await;
    let e = f
        .ops
        .publish(publish("late", Some("c5")))
        .await
        .unwrap_err();
    assert!(e.message.contains("no SELinux label"), "{e}");
}

/// A publish whose limits cannot be set still publishes: for a pod with no
/// cgroup under the node's root, for a device that cannot be limited, and
/// for a publish that names no pod. Each target's record says why, the
/// volume's health says `IoLimitNotApplied` for each, a repeat of a
/// publish is still a repeat, and the findings go with the targets.
#[tokio::test]
async fn a_publish_whose_limits_cannot_be_set_is_published_and_said_unlimited() {
    let f = fixture();
    stage_ext4(&f).await;
    let uid = "0f6e3a8c-1b2d-4c5e-8f90-a1b2c3d4e5f6";
    let limited = |target: &str, pod: Option<&str>| PublishRequest {
        io: IoPublish {
            limits: crate::host::iolimit::Limits {
                write_iops: Some(50),
                ..Default::default()
            },
            pod_uid: pod.map(str::to_string),
        },
        ..publish_req(&f, target, AccessMode::SingleNodeMultiWriter, false)
    };
    f.ops.publish(limited("nocg", Some(uid))).await.unwrap();
    f.ops.publish(limited("nocg", Some(uid))).await.unwrap();
    f.ops.publish(limited("nopod", None)).await.unwrap();
    // The pod's cgroup there (cgroupfs, Burstable), the device a fake one.
    let cg = f
        .dir
        .path()
        .join(format!("cgroup/kubepods/burstable/pod{uid}"));
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::write(cg.join("io.max"), "").unwrap();
    f.ops.publish(limited("nodev", Some(uid))).await.unwrap();
    let why = |t: &str| {
        f.ops
            .state()
            .publish(&f.dir.path().join("pods").join(t))
            .unwrap()
            .unlimited
            .unwrap()
    };
    assert!(why("nocg").contains("no cgroup of pod"), "{}", why("nocg"));
    assert!(why("nopod").contains("names no pod"), "{}", why("nopod"));
    assert!(why("nodev").contains("/dev/fake0"), "{}", why("nodev"));
    assert_eq!(std::fs::read_to_string(cg.join("io.max")).unwrap(), "");
    let said = f.ops.volume_health(&id(), "", "").await.unwrap();
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(said[0].reason, Reason::IoLimitNotApplied);
    assert!(said[0].message.contains("for 3 of its pods"), "{said:?}");
    for t in ["nocg", "nopod", "nodev"] {
        f.ops
            .unpublish(&id(), &f.dir.path().join("pods").join(t))
            .await
            .unwrap();
    }
    assert!(f.ops.volume_health(&id(), "", "").await.unwrap().is_empty());
}

/// A change to the limits of a volume whose publishes' pods were not found
/// (no limits when they were published, so nothing was said then) is said
/// in the volume's health for each of them while the volume has a limit,
/// and no more once every limit is lifted; the records keep what the
/// volume's context set, which the changes are made over.
#[tokio::test]
async fn a_limit_that_cannot_reach_a_publish_is_said_while_it_is_there() {
    use crate::plugin::Relimit;
    let f = fixture();
    stage_ext4(&f).await;
    let req = |target: &str, pod: Option<&str>| PublishRequest {
        io: IoPublish {
            limits: Default::default(),
            pod_uid: pod.map(str::to_string),
        },
        ..publish_req(&f, target, AccessMode::SingleNodeMultiWriter, false)
    };
    f.ops
        .publish(req("nocg", Some("0f6e3a8c-1b2d-4c5e-8f90-a1b2c3d4e5f6")))
        .await
        .unwrap();
    f.ops.publish(req("nopod", None)).await.unwrap();
    let record = |t: &str| {
        f.ops
            .state()
            .publish(&f.dir.path().join("pods").join(t))
            .unwrap()
    };
    for t in ["nocg", "nopod"] {
        assert_eq!(record(t).unlimited, None, "{t}: said with no limit");
        assert_eq!(record(t).class_limits, Some(Default::default()));
    }
    assert!(f.ops.volume_health(&id(), "", "").await.unwrap().is_empty());
    let change = |k: &str, v: &str| {
        crate::host::iolimit::LimitChanges::parse(&[(k.to_string(), v.to_string())].into()).unwrap()
    };
    f.book.change(&id(), &change("writeIops", "50")).unwrap();
    assert_eq!(f.ops.relimit(&id()).await, 0);
    let said = f.ops.volume_health(&id(), "", "").await.unwrap();
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(said[0].reason, Reason::IoLimitNotApplied);
    assert!(said[0].message.contains("for 2 of its pods"), "{said:?}");
    // A publish made now is said at once, as one made with the limit.
    f.ops.publish(req("later", None)).await.unwrap();
    assert!(record("later").unlimited.unwrap().contains("names no pod"));
    f.book.change(&id(), &change("writeIops", "max")).unwrap();
    f.ops.relimit(&id()).await;
    assert!(f.ops.volume_health(&id(), "", "").await.unwrap().is_empty());
}
