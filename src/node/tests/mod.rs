//! Node orchestration over the fake mounter, the scripted runner and a
//! recording backend: failures at each step are undone.

use super::*;
use crate::exec::{FakeRunner, Reply};
use crate::mount::{FakeMounter, MountOp};
use crate::plugin::{AccessMode, DeviceMounter, Provisioner, Stager};
use std::collections::BTreeMap;
use std::sync::Mutex;

mod publish;
mod stage;
mod stats;

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
    /// While set, a health check waits on it (storage that does not
    /// answer); how many checks were started.
    health_gate: Mutex<Option<Arc<tokio::sync::Notify>>>,
    health_checks: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl Backend for Recorder {
    fn name(&self) -> &str {
        "rec"
    }

    fn kind(&self) -> &'static crate::plugin::Kind {
        &crate::plugin::DOUBLE
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

    async fn node_health(&self, _id: &VolumeId, _att: &Attachment) -> Result<Vec<Finding>> {
        self.health_checks
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let gate = self.health_gate.lock().unwrap().clone();
        if let Some(gate) = gate {
            gate.notified().await;
            return Ok(vec![Finding::degraded(
                Reason::DeviceIOErrors,
                "answered late",
            )]);
        }
        Ok(Vec::new())
    }
}

#[async_trait::async_trait]
impl DeviceMounter for Recorder {
    fn node_device(&self) -> Option<crate::host::devices::DeviceClass> {
        Some(crate::host::devices::LOOP)
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
    /// The limit changes its publishes follow (a controller's, in one
    /// process with it).
    book: Arc<crate::plugin::LimitBook>,
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
    ))
    .with_cgroups(crate::host::iolimit::Cgroups::new(
        dir.path().join("cgroup"),
    ));
    let book = Arc::new(crate::plugin::LimitBook::open(&dir.path().join("controller")).unwrap());
    let ops = ops.with_limit_book(book.clone());
    Fixture {
        book,
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

/// Stages the fixture's volume (an ext4 filesystem, blkid says) for
/// SINGLE_NODE_MULTI_WRITER publishes.
async fn stage_ext4(f: &Fixture) {
    f.runner.expect("blkid", Reply::Ok("TYPE=ext4\n".into()));
    f.ops
        .stage(stage_req(f, AccessMode::SingleNodeMultiWriter))
        .await
        .unwrap();
}

fn publish_req(f: &Fixture, target: &str, mode: AccessMode, readonly: bool) -> PublishRequest {
    PublishRequest {
        volume_id: id(),
        staging_path: f.dir.path().join("staging"),
        target_path: f.dir.path().join("pods").join(target),
        capability: mount_cap(mode),
        readonly,
        secrets: Default::default(),
        io: Default::default(),
    }
}

/// A mount table entry's `major:minor` is matched against a recorded
/// mount's device number (major in the high 32 bits), and nothing else.
#[test]
fn a_table_device_matches_its_recorded_number() {
    let id = MountId {
        dev: 253 << 32 | 4,
        rdev: 0,
    };
    assert!(super::same_device("253:4", id));
    assert!(!super::same_device("253:5", id));
    assert!(!super::same_device("4:253", id));
    assert!(!super::same_device("0:0", id));
    assert!(!super::same_device("nonsense", id));
}
