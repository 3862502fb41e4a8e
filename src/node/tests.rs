//! Node orchestration over the fake mounter, the scripted runner and a
//! recording backend: failures at each step are undone.

use super::*;
use crate::exec::{FakeRunner, Reply};
use crate::mount::{FakeMounter, MountOp};
use crate::plugin::{AccessMode, Capabilities};
use std::sync::Mutex;

#[derive(Default)]
struct Recorder {
    detached: Mutex<Vec<Option<Attachment>>>,
    fail_attach: Mutex<bool>,
}

#[async_trait::async_trait]
impl Backend for Recorder {
    fn name(&self) -> &str {
        "rec"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            device_mount: true,
            block: true,
            access_modes: vec![
                AccessMode::SingleNodeWriter,
                AccessMode::SingleNodeMultiWriter,
            ],
            ..Default::default()
        }
    }
    async fn health(&self) -> Result<()> {
        Ok(())
    }
    async fn get_volume(&self, _id: &VolumeId) -> Result<Option<crate::plugin::VolumeInfo>> {
        Ok(None)
    }
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

struct Fixture {
    dir: tempfile::TempDir,
    ops: NodeOps,
    mounter: Arc<FakeMounter>,
    runner: Arc<FakeRunner>,
    backend: Arc<Recorder>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("staging")).unwrap();
    std::fs::create_dir_all(dir.path().join("pods")).unwrap();
    let backend = Arc::new(Recorder::default());
    let mut registry = Registry::new();
    registry.register(backend.clone()).unwrap();
    let mounter = Arc::new(FakeMounter::new());
    let runner = Arc::new(FakeRunner::new());
    let state = NodeState::open(&dir.path().join("state")).unwrap();
    let ops = NodeOps::new(
        Arc::new(registry),
        mounter.clone(),
        runner.clone(),
        state,
        crate::locks::OpLocks::new(),
    );
    Fixture {
        dir,
        ops,
        mounter,
        runner,
        backend,
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
    }
}

#[tokio::test]
async fn stage_formats_empty_device_and_mounts_once() {
    let f = fixture();
    f.runner.expect("blkid", Reply::Fail(2, String::new()));
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
    assert!(!f.dir.path().join("pods/b").exists(), "target left behind");
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
    assert!(!target.exists());
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
