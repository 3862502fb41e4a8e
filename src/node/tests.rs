//! Node orchestration over the fake mounter, the scripted runner and a
//! recording backend: failures at each step are undone.

use super::*;
use crate::exec::{FakeRunner, Reply};
use crate::mount::{FakeMounter, MountOp};
use crate::plugin::{AccessMode, DeviceMounter, Provisioner, Stager};
use std::collections::BTreeMap;
use std::sync::Mutex;

#[derive(Default)]
struct Recorder {
    detached: Mutex<Vec<Option<Attachment>>>,
    fail_attach: Mutex<bool>,
    /// What the device reports after a refresh.
    device_size: Mutex<u64>,
    /// Whether the volume is a copy whose filesystem still carries its
    /// source's UUID; and how many times the node said it renewed it.
    copy_pending: Mutex<bool>,
    copies_done: Mutex<usize>,
}

#[async_trait::async_trait]
impl Backend for Recorder {
    fn name(&self) -> &str {
        "rec"
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    fn access_modes(&self) -> Vec<AccessMode> {
        crate::plugin::SINGLE_NODE_MODES.to_vec()
    }

    fn provisioner(&self) -> Option<&dyn Provisioner> {
        Some(self)
    }

    fn stager(&self) -> Option<&dyn Stager> {
        Some(self)
    }

    fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
        Some(self)
    }
}

#[async_trait::async_trait]
impl Provisioner for Recorder {
    fn clones(&self) -> bool {
        false
    }

    async fn create_volume(
        &self,
        _: &crate::plugin::CreateVolume,
    ) -> Result<crate::plugin::VolumeInfo> {
        Err(Error::internal("the node's double makes no volumes"))
    }

    async fn delete_volume(&self, _: &VolumeId, _: &crate::plugin::Secrets) -> Result<()> {
        Err(Error::internal("the node's double deletes no volumes"))
    }

    async fn list_volumes(
        &self,
        _: &crate::plugin::Page,
    ) -> Result<Vec<crate::plugin::VolumeInfo>> {
        Ok(Vec::new())
    }

    async fn capacity(&self, _: &BTreeMap<String, String>) -> Result<crate::plugin::Capacity> {
        Err(Error::internal("the node's double has no capacity"))
    }

    async fn get_volume(
        &self,
        _id: &VolumeId,
        _: &crate::plugin::Secrets,
    ) -> Result<Option<crate::plugin::VolumeInfo>> {
        Ok(None)
    }
}

#[async_trait::async_trait]
impl Stager for Recorder {
    async fn node_attach(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<Attachment> {
        if *self.fail_attach.lock().unwrap() {
            return Err(Error::internal("attach failed"));
        }
        Ok(Attachment::Device {
            path: "/dev/fake0".into(),
        })
    }

    async fn node_detach(&self, _id: &VolumeId, attachment: Option<&Attachment>) -> Result<()> {
        self.detached.lock().unwrap().push(attachment.cloned());
        Ok(())
    }
}

#[async_trait::async_trait]
impl DeviceMounter for Recorder {
    fn node_device(&self) -> Option<DeviceKind> {
        Some(DeviceKind::Loop)
    }

    async fn node_refresh_size(&self, _id: &VolumeId, _attachment: &Attachment) -> Result<u64> {
        Ok(*self.device_size.lock().unwrap())
    }

    async fn node_copy_pending(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<bool> {
        Ok(*self.copy_pending.lock().unwrap())
    }

    async fn node_copy_done(&self, _id: &VolumeId, _ctx: &AttachContext) -> Result<()> {
        *self.copy_pending.lock().unwrap() = false;
        *self.copies_done.lock().unwrap() += 1;
        Ok(())
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    ops: Arc<NodeOps>,
    registry: Arc<Registry>,
    mounter: Arc<FakeMounter>,
    runner: Arc<FakeRunner>,
    backend: Arc<Recorder>,
    host: Arc<crate::host::FakeHost>,
    /// The loop driver the node's read-only block publishes use.
    loops: Arc<crate::host::loopdev::FakeLoops>,
}

fn fixture() -> Fixture {
    fixture_with(Deadlines::default())
}

fn fixture_with(deadlines: Deadlines) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(Recorder::default());
    let mut registry = Registry::new();
    registry.register(backend.clone()).unwrap();
    let runner = Arc::new(FakeRunner::new());
    let state = NodeState::open(&dir.path().join("state")).unwrap();
    let registry = Arc::new(registry);
    let host = Arc::new(crate::host::FakeHost::new());
    host.add_dir(&dir.path().join("staging"));
    host.add_dir(&dir.path().join("pods"));
    let mounter = Arc::new(FakeMounter::on(host.clone()));
    let sys_block = dir.path().join("sys-block");
    let loops = Arc::new(crate::host::loopdev::FakeLoops::new(&sys_block, 50).releasing());
    let ops = NodeOps::new(
        registry.clone(),
        mounter.clone(),
        runner.clone(),
        state,
        crate::locks::OpLocks::new(),
        host.clone(),
    )
    .with_deadlines(deadlines)
    .with_loops(crate::host::loopdev::LoopDevices::with_sysfs(
        loops.clone(),
        sys_block,
    ));
    Fixture {
        dir,
        ops: Arc::new(ops),
        registry,
        mounter,
        runner,
        backend,
        host,
        loops,
    }
}

fn id() -> VolumeId {
    VolumeId::parse("rec:v1").unwrap()
}

fn mount_cap(mode: AccessMode) -> VolumeCapability {
    VolumeCapability {
        access: AccessType::Mount {
            fs_type: String::new(),
            mount_flags: vec![],
        },
        mode,
    }
}

fn stage_req(f: &Fixture, mode: AccessMode) -> StageRequest {
    StageRequest {
        volume_id: id(),
        staging_path: f.dir.path().join("staging"),
        capability: mount_cap(mode),
        ctx: AttachContext::default(),
    }
}

fn publish_req(f: &Fixture, target: &str, mode: AccessMode, readonly: bool) -> PublishRequest {
    PublishRequest {
        volume_id: id(),
        staging_path: f.dir.path().join("staging"),
        target_path: f.dir.path().join("pods").join(target),
        capability: mount_cap(mode),
        readonly,
        secrets: Default::default(),
    }
}

#[tokio::test]
async fn stage_formats_empty_device_and_mounts_once() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Fail(2, String::new()));
    f.runner.ok("mkfs.ext4");
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(
        f.runner.lines(),
        vec![
            "blkid -p -o export /dev/fake0",
            "mkfs.ext4 -F -q -m 0 /dev/fake0"
        ]
    );
    let m = f.mounter.get(&f.dir.path().join("staging")).unwrap();
    assert_eq!(
        (m.source.to_str().unwrap(), m.fstype.as_str(), m.bind),
        ("/dev/fake0", "ext4", false)
    );
    // Again: idempotent, no second mount, no second format.
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(f.mounter.count(), 1);
    assert_eq!(f.runner.calls().len(), 2);
}

/// A copy (a restored snapshot, a clone) gets a filesystem UUID of its
/// own at its first stage, checked first, told to the backend once done;
/// staged again, it is left alone.
#[tokio::test]
async fn a_copy_gets_its_own_filesystem_uuid_at_its_first_stage() {
    let f = fixture();
    *f.backend.copy_pending.lock().unwrap() = true;
    f.runner
        .expect("blkid", Reply::Ok("TYPE=ext4\n".into()))
        .expect("blkid", Reply::Ok("1111-source\n".into()))
        .expect("e2fsck", Reply::Fail(1, "fixed".into()))
        .ok("tune2fs")
        .expect("blkid", Reply::Ok("2222-copy\n".into()))
        .expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(
        f.runner.lines(),
        vec![
            "blkid -p -o export /dev/fake0",
            "blkid -p -o value -s UUID /dev/fake0",
            "e2fsck -f -y /dev/fake0",
            "tune2fs -U random /dev/fake0",
            "blkid -p -o value -s UUID /dev/fake0",
            "blkid -p -o export /dev/fake0",
        ]
    );
    assert_eq!(*f.backend.copies_done.lock().unwrap(), 1);
    assert_eq!(f.mounter.count(), 1);
    // Unstaged and staged again: the copy is its own now, nothing renewed.
    f.ops
        .unstage(&id(), &f.dir.path().join("staging"))
        .await
        .unwrap();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert_eq!(f.runner.calls().len(), 7);
    assert_eq!(*f.backend.copies_done.lock().unwrap(), 1);
}

/// A renewal that leaves the source's UUID in place fails the stage, which
/// is undone; the backend still counts the copy as pending.
#[tokio::test]
async fn a_uuid_renewal_that_changes_nothing_fails_the_stage() {
    let f = fixture();
    *f.backend.copy_pending.lock().unwrap() = true;
    f.runner
        .expect("blkid", Reply::Ok("TYPE=ext4\n".into()))
        .expect("blkid", Reply::Ok("1111-source\n".into()))
        .ok("e2fsck")
        .ok("tune2fs")
        .expect("blkid", Reply::Ok("1111-source\n".into()));
    let e = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::Internal, "{}", e.message);
    assert!(e.message.contains("source's UUID"), "{}", e.message);
    assert_eq!(*f.backend.copies_done.lock().unwrap(), 0);
    assert!(*f.backend.copy_pending.lock().unwrap());
    assert_eq!(f.mounter.count(), 0, "nothing mounted");
    assert_eq!(f.backend.detached.lock().unwrap().len(), 1, "attach undone");
    assert!(f.ops.state().stage(&id()).is_none(), "no stage recorded");
}

#[tokio::test]
async fn failed_mount_is_undone() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.mounter.fail_next(MountOp::MountFs, 1);
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert!(err.message.contains("MountFs"), "{}", err.message);
    assert_eq!(
        *f.backend.detached.lock().unwrap(),
        vec![Some(Attachment::Device {
            path: "/dev/fake0".into()
        })]
    );
    assert!(f.ops.state().stage(&id()).is_none());
    assert_eq!(f.mounter.count(), 0);
}

#[tokio::test]
async fn failed_format_and_failed_attach_leave_nothing() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Fail(2, String::new()));
    f.runner.expect("mkfs.ext4", Reply::Timeout);
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert!(err.message.contains("timed out"), "{}", err.message);
    assert!(f.ops.state().stage(&id()).is_none());
    assert_eq!(f.backend.detached.lock().unwrap().len(), 1);

    *f.backend.fail_attach.lock().unwrap() = true;
    assert!(f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .is_err());
    // Nothing was attached, but detach is still asked to release whatever
    // a half-done attach may have set up.
    assert_eq!(f.backend.detached.lock().unwrap().last().unwrap(), &None);
    assert!(f.ops.state().stage(&id()).is_none());
}

#[tokio::test]
async fn never_formats_a_device_with_another_filesystem() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=xfs\n".into()));
    let err = f
        .ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition);
    assert!(!f.runner.lines().iter().any(|l| l.starts_with("mkfs")));
}

/// A second target on the node: allowed for every pair of single-node
/// modes but where either publish is SINGLE_NODE_SINGLE_WRITER, which is
/// FAILED_PRECONDITION with nothing made at the second target; the first
/// publish gone, the second goes through.
#[tokio::test]
async fn second_targets_on_a_node_are_refused_only_for_single_writer_pods() {
    use AccessMode::*;
    let modes = [
        SingleNodeWriter,
        SingleNodeMultiWriter,
        SingleNodeSingleWriter,
        SingleNodeReaderOnly,
    ];
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops.stage(stage_req(&f, SingleNodeWriter)).await.unwrap();
    let ro = |m: AccessMode| m.is_readonly();
    for first in modes {
        for second in modes {
            let what = format!("{} then {}", first.name(), second.name());
            f.ops
                .publish(publish_req(&f, "a", first, ro(first)))
                .await
                .unwrap();
            let b = f.dir.path().join("pods/b");
            let got = f
                .ops
                .publish(publish_req(&f, "b", second, ro(second)))
                .await;
            let refused = first == SingleNodeSingleWriter || second == SingleNodeSingleWriter;
            match got {
                Ok(()) => assert!(!refused, "{what}: a second target was taken"),
                Err(e) => {
                    assert!(refused, "{what}: {}", e.message);
                    assert_eq!(e.kind, Kind::FailedPrecondition, "{what}");
                    assert!(e.message.contains("pods/a"), "{what}: {}", e.message);
                    assert!(f.mounter.get(&b).is_none(), "{what}");
                    assert!(!f.host.contains(&b), "{what}: target made");
                    assert!(f.ops.state().publish(&b).is_none(), "{what}");
                }
            }
            f.ops
                .unpublish(&id(), &f.dir.path().join("pods/a"))
                .await
                .unwrap();
            if refused {
                // The only other publish gone, the same call goes through.
                f.ops
                    .publish(publish_req(&f, "b", second, ro(second)))
                    .await
                    .unwrap();
            }
            f.ops.unpublish(&id(), &b).await.unwrap();
            assert!(f.ops.state().publishes_of(&id()).is_empty(), "{what}");
        }
    }
}

/// A single-writer publish locks its volume against every other publish
/// or unpublish under way (two at once would each find no other record);
/// publishes of other modes to other targets run side by side.
#[test]
fn a_single_writer_publish_excludes_others_of_its_volume_while_it_runs() {
    let f = fixture();
    let (a, b) = (f.dir.path().join("pods/a"), f.dir.path().join("pods/b"));
    let only = f.ops.lock_only_target(&id(), &a).unwrap();
    let err = f.ops.lock_target(&id(), &b).unwrap_err();
    assert_eq!(err.kind, Kind::Aborted, "{}", err.message);
    let err = f.ops.lock_only_target(&id(), &b).unwrap_err();
    assert_eq!(err.kind, Kind::Aborted, "{}", err.message);
    drop(only);
    let shared = f.ops.lock_target(&id(), &a).unwrap();
    let beside = f.ops.lock_target(&id(), &b).unwrap();
    let err = f
        .ops
        .lock_only_target(&id(), &f.dir.path().join("pods/c"))
        .unwrap_err();
    assert_eq!(err.kind, Kind::Aborted, "{}", err.message);
    drop((shared, beside));
    f.ops.lock_only_target(&id(), &b).unwrap();
}

#[tokio::test]
async fn publish_binds_and_failed_bind_is_undone() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeMultiWriter))
        .await
        .unwrap();
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

#[tokio::test]
async fn failed_unmount_keeps_the_record_for_a_retry() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    f.mounter.fail_next(MountOp::Unmount, 1);
    assert!(f
        .ops
        .unstage(&id(), &f.dir.path().join("staging"))
        .await
        .is_err());
    assert!(f.ops.state().stage(&id()).is_some());
    assert!(
        f.backend.detached.lock().unwrap().is_empty(),
        "device released under a live mount"
    );
    f.ops
        .unstage(&id(), &f.dir.path().join("staging"))
        .await
        .unwrap();
    assert!(f.ops.state().stage(&id()).is_none());
}

#[tokio::test]
async fn interrupted_stage_is_repaired_and_stale_publishes_reconciled() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    f.ops
        .publish(publish_req(&f, "a", AccessMode::SingleNodeWriter, false))
        .await
        .unwrap();
    // The node lost its mounts (say, a reboot): reconcile drops the publish
    // record and a repeated stage mounts again.
    f.mounter.unmount(&f.dir.path().join("pods/a")).unwrap();
    f.mounter.unmount(&f.dir.path().join("staging")).unwrap();
    assert_eq!(f.ops.reconcile().unwrap(), (1, 1));
    assert!(f.ops.state().publishes().is_empty());
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    assert!(f.mounter.get(&f.dir.path().join("staging")).is_some());
}

#[tokio::test]
async fn concurrent_stage_is_aborted() {
    let f = fixture();
    let _busy = f.ops.lock_volume(&id()).unwrap();
    assert_eq!(
        f.ops
            .stage(stage_req(&f, AccessMode::SingleNodeWriter))
            .await
            .unwrap_err()
            .kind,
        Kind::Aborted
    );
    assert_eq!(
        f.ops
            .unstage(&id(), Path::new("/x"))
            .await
            .unwrap_err()
            .kind,
        Kind::Aborted
    );
    assert_eq!(
        f.ops
            .publish(publish_req(&f, "a", AccessMode::SingleNodeWriter, false))
            .await
            .unwrap_err()
            .kind,
        Kind::Aborted
    );
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
        controller: crate::plugin::ControllerOps::new(
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

    runner.expect("mount", Reply::Timeout);
    let err = ops.stage(req("")).await.unwrap_err();
    assert_eq!(err.kind, Kind::Unavailable, "{}", err.message);
    let line = format!(
        "mount -t nfs -o rw,noatime,nfsvers=4.2 -- 10.0.0.1:/export/vol {}",
        staging.display()
    );
    assert_eq!(runner.lines(), [line]);
    assert_eq!(runner.calls()[0].timeout, Deadlines::default().mount);
    assert!(ops
        .state()
        .stage(&VolumeId::parse("net:v1").unwrap())
        .is_none());
    // Nothing is formatted and no mount(2) is made for a remote filesystem.
    assert!(mounter
        .calls()
        .iter()
        .all(|(op, _)| *op != MountOp::MountFs));
}

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

#[tokio::test]
async fn stats_come_from_the_filesystem_and_the_condition_from_the_mounts() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
    let staging = f.dir.path().join("staging");
    f.host
        .set_usage(&staging, usage(100 * MIB, 40 * MIB, 30 * MIB));
    let s = f.ops.stats(&id(), staging.to_str().unwrap()).await.unwrap();
    assert_eq!(
        (s.total_bytes, s.available_bytes, s.used_bytes),
        (100 * MIB, Some(30 * MIB), Some(60 * MIB))
    );
    assert_eq!((s.total_inodes, s.free_inodes), (Some(1000), Some(600)));
    assert_eq!(s.abnormal, None);
    // The staging mount goes away under the driver: abnormal, with why.
    f.mounter.unmount(&staging).unwrap();
    let s = f.ops.stats(&id(), staging.to_str().unwrap()).await.unwrap();
    assert!(s.abnormal.unwrap().contains("is gone"));
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
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
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
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeWriter))
        .await
        .unwrap();
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
    runner.ok("mount");
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
    let why = stats.abnormal.expect("abnormal");
    assert!(why.contains("Stale file handle"), "{why}");
    let target = dir.path().join("pods/t");
    let err = ops
        .publish(PublishRequest {
            volume_id: id.clone(),
            staging_path: staging.clone(),
            target_path: target.clone(),
            capability: cap,
            readonly: false,
            secrets: Default::default(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind, Kind::FailedPrecondition, "{}", err.message);
    assert!(err.message.contains("stale"), "{}", err.message);
    assert!(!host.contains(&target), "nothing is left at the target");
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
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeMultiWriter))
        .await
        .unwrap();
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
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(&f, AccessMode::SingleNodeMultiWriter))
        .await
        .unwrap();
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
