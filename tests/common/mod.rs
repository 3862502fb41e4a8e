//! Test support: start the real `ferrovol` binary on a temporary state dir
//! and socket, talk to it over the socket, and clean up every mount, loop
//! device and file afterwards, even when the test fails.
#![allow(dead_code)]

pub mod cluster;
pub mod deployed;
pub mod fixtures;
pub mod peer;
pub mod sanity;
pub mod sharing;
pub mod upgrade;

use ferrovol::proto::controller_client::ControllerClient;
use ferrovol::proto::group_controller_client::GroupControllerClient;
use ferrovol::proto::identity_client::IdentityClient;
use ferrovol::proto::node_client::NodeClient;
use ferrovol::proto::snapshot_metadata_client::SnapshotMetadataClient;
use ferrovol::proto::{self as pb};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint, Uri};

pub const MIB: i64 = 1 << 20;

/// Fails loudly when not root: these tests need real mounts and loop devices.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (real mounts and loop devices): run the suite as root"
    );
}

/// A running driver and everything it may leave behind.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub child: Option<Child>,
    pub channel: Option<Channel>,
    pub config: Option<PathBuf>,
    /// Extra environment for the driver process.
    pub env: Vec<(String, String)>,
    /// A command the driver runs under (`unshare ...`), the driver's own
    /// command line after it.
    pub wrap: Vec<String>,
}

impl Harness {
    /// Starts a driver in `all` mode with the default config.
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    pub async fn start_with(config: Option<&str>) -> Self {
        Self::start_with_env(config, &[]).await
    }

    /// Starts a driver with a config and extra environment.
    pub async fn start_with_env(config: Option<&str>, env: &[(&str, &str)]) -> Self {
        require_root();
        let dir = tempfile::Builder::new()
            .prefix("ferrovol-test-")
            .tempdir()
            .unwrap();
        for sub in ["state", "kubelet/staging", "kubelet/pods"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        let config = config.map(|text| {
            let p = dir.path().join("config.toml");
            std::fs::write(&p, text.replace("@DIR@", &dir.path().display().to_string())).unwrap();
            p
        });
        let mut h = Harness {
            dir,
            child: None,
            channel: None,
            config,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            wrap: Vec::new(),
        };
        h.spawn().await;
        h
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("csi.sock")
    }
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("driver.log")).unwrap_or_default()
    }

    pub fn command(&self) -> Command {
        // FERROVOL_TEST_BIN: another build of the driver (a release one,
        // for a bench built as a test).
        let bin = std::env::var_os("FERROVOL_TEST_BIN")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_ferrovol").into());
        let mut cmd = match self.wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        cmd.arg("serve")
            .arg("--endpoint")
            .arg(format!("unix://{}", self.socket().display()))
            .arg("--node-id")
            .arg("test-node")
            .arg("--state-dir")
            .arg(self.state_dir())
            .arg("--shutdown-grace")
            .arg("5")
            .env("RUST_LOG", DRIVER_LOG)
            // The tests' folders are not a pod's volumes: should the
            // suite itself run in a pod, the driver must not judge them so.
            .env_remove("KUBERNETES_SERVICE_HOST");
        // Set after the default so a caller's RUST_LOG wins.
        if let Some(c) = &self.config {
            cmd.arg("--config").arg(c);
        }
        cmd.envs(self.env.iter().cloned());
        cmd
    }

    /// Starts the driver and waits until Probe answers.
    pub async fn spawn(&mut self) {
        let before = self.log().len();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("driver.log"))
            .unwrap();
        let child = self
            .command()
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start ferrovol");
        self.child = Some(child);
        self.channel = Some(self.wait_ready().await);
        // A test that aims at a kill point needs a driver that has them
        // (a plain build put in the binary's place has none, and would
        // run past the point as if the step were not there).
        if self.env.iter().any(|(k, _)| k == "FERROVOL_KILL_AT") {
            let log = self.log();
            assert!(
                log.get(before..)
                    .is_some_and(|new| new.contains("kill point armed")),
                "the driver did not arm its kill point (a build without the kill-points \
                 feature, or an unknown point):\n{}",
                log.get(before..).unwrap_or_default()
            );
        }
    }

    async fn wait_ready(&mut self) -> Channel {
        // Bounded by the driver: one that exits fails this at once; one
        // that runs on and never gets ready, after the fixtures' backstop.
        let deadline = Instant::now() + fixtures::DAEMON_BACKSTOP;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("driver exited early with {status}:\n{}", self.log());
            }
            if let Ok(channel) = connect(&self.socket()).await {
                let mut id = IdentityClient::new(channel.clone());
                if let Ok(r) = id.probe(pb::ProbeRequest {}).await {
                    if r.into_inner().ready == Some(true) {
                        return channel;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "driver runs and was not ready in {} s:\n{}",
                fixtures::DAEMON_BACKSTOP.as_secs(),
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the driver to die (at its kill point), the runtime free
    /// meanwhile to run the call that leads it there.
    pub async fn wait_exit(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let child = self.child.as_mut().expect("driver running");
            if child.try_wait().unwrap().is_some() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the driver did not die at its kill point within {within:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.child = None;
        self.channel = None;
    }

    /// SIGKILLs the driver (a crash).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.channel = None;
    }

    /// SIGTERMs the driver and returns its exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("driver running");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                self.channel = None;
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "driver did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(self.channel.clone().expect("driver running"))
    }
    pub fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel.clone().expect("driver running"))
    }
    pub fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel.clone().expect("driver running"))
    }
    pub fn group(&self) -> GroupControllerClient<Channel> {
        GroupControllerClient::new(self.channel.clone().expect("driver running"))
    }
    pub fn metadata(&self) -> SnapshotMetadataClient<Channel> {
        SnapshotMetadataClient::new(self.channel.clone().expect("driver running"))
    }

    /// Takes snapshot `name` of `volume`; answers its id.
    pub async fn snapshot(&self, name: &str, volume: &str) -> String {
        self.snapshot_with(name, volume, HashMap::new()).await
    }

    /// Takes snapshot `name` of `volume` with the call's `secrets`;
    /// answers its id.
    pub async fn snapshot_with(
        &self,
        name: &str,
        volume: &str,
        secrets: HashMap<String, String>,
    ) -> String {
        self.snapshot_made_with(name, volume, secrets)
            .await
            .snapshot_id
    }

    /// Takes snapshot `name` of `volume`; answers the snapshot.
    pub async fn snapshot_made(&self, name: &str, volume: &str) -> pb::Snapshot {
        self.snapshot_made_with(name, volume, HashMap::new()).await
    }

    /// Takes snapshot `name` of `volume` with the call's `secrets`, which
    /// must succeed; answers the snapshot.
    pub async fn snapshot_made_with(
        &self,
        name: &str,
        volume: &str,
        secrets: HashMap<String, String>,
    ) -> pb::Snapshot {
        let req = pb::CreateSnapshotRequest {
            name: name.into(),
            source_volume_id: volume.into(),
            secrets,
            ..Default::default()
        };
        as_the_snapshotter("CreateSnapshot", || {
            let (mut c, req) = (self.controller(), req.clone());
            async move { c.create_snapshot(req).await }
        })
        .await
        .unwrap_or_else(|e| panic!("CreateSnapshot {name}: {e:?}\n{}", self.log()))
        .snapshot
        .expect("CreateSnapshot answers a snapshot")
    }

    /// Loop devices whose image lives under this test's folder.
    pub fn loop_devices(&self) -> Vec<String> {
        loops_under(self.dir.path())
    }

    /// Mounts under this test's folder.
    pub fn mounts(&self) -> Vec<PathBuf> {
        mounts_under(self.dir.path())
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- last driver log lines ---");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        self.kill();
        // FERROVOL_KEEP_DRIVER_LOGS=DIR keeps each driver's log there
        // (named by the test's thread), to see where a test's time goes.
        if let Some(dir) = std::env::var_os("FERROVOL_KEEP_DRIVER_LOGS") {
            let name = std::thread::current()
                .name()
                .unwrap_or("test")
                .replace("::", "-");
            static KEPT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = KEPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let to = Path::new(&dir).join(format!("{name}.{n}.log"));
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::copy(self.dir.path().join("driver.log"), to);
        }
        cleanup(self.dir.path());
        if std::thread::panicking() && std::env::var("FERROVOL_IN_GUEST").as_deref() == Ok("1") {
            release_sessions_and_mappings();
        }
    }
}

/// After a guest test that failed half way: every iSCSI session logged
/// out and every rbd mapping removed, so that the next tests, which find
/// none of their own left behind by asking the whole node, judge their own
/// work, not this one's leftovers. The guest runs one test at a time, so
/// all of them are the failed test's. The test's daemons (iscsid, tgtd)
/// still run: the harness is dropped before them.
fn release_sessions_and_mappings() {
    let _ = Command::new("timeout")
        .args(["60", "iscsiadm", "-m", "node", "--logoutall=all"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let remove = ["/sys/bus/rbd/remove_single_major", "/sys/bus/rbd/remove"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    if let (Some(remove), Ok(devices)) = (remove, std::fs::read_dir("/sys/bus/rbd/devices")) {
        for d in devices.flatten() {
            let id = d.file_name().to_string_lossy().into_owned();
            let _ = std::fs::write(remove, format!("{id} force"));
        }
    }
}

/// Unmounts everything under `dir` (deepest first) and detaches every loop
/// device backed by a file under it.
pub fn cleanup(dir: &Path) {
    for _ in 0..4 {
        let mut mounts = mounts_under(dir);
        if mounts.is_empty() {
            break;
        }
        mounts.sort_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
        for m in mounts {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    for dev in loops_under(dir) {
        let _ = Command::new("losetup").arg("-d").arg(&dev).status();
    }
}

pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    ferrovol::mount::parse_mountinfo(&text)
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect()
}

pub fn loops_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if Path::new(b.trim_end()).starts_with(dir) {
                out.push(format!("/dev/{name}"));
            }
        }
    }
    out
}

/// A gRPC channel over a unix socket.
pub async fn connect(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_path_buf();
    Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
}

pub fn mount_cap(fs: &str, mode: i32) -> pb::VolumeCapability {
    use pb::volume_capability as vc;
    pb::VolumeCapability {
        access_type: Some(vc::AccessType::Mount(vc::MountVolume {
            fs_type: fs.into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
        access_mode: Some(vc::AccessMode { mode }),
    }
}

pub fn block_cap(mode: i32) -> pb::VolumeCapability {
    use pb::volume_capability as vc;
    pb::VolumeCapability {
        access_type: Some(vc::AccessType::Block(vc::BlockVolume {})),
        access_mode: Some(vc::AccessMode { mode }),
    }
}

pub const SNW: i32 = 1;
pub const SNRO: i32 = 2;
pub const MNMW: i32 = 5;
pub const SNSW: i32 = 6;
pub const SNMW: i32 = 7;

/// A content source naming a snapshot (a restore).
pub fn snapshot_source(id: &str) -> pb::VolumeContentSource {
    pb::VolumeContentSource {
        r#type: Some(pb::volume_content_source::Type::Snapshot(
            pb::volume_content_source::SnapshotSource {
                snapshot_id: id.to_string(),
            },
        )),
    }
}

/// A volume's content source: volume `id` (a clone).
pub fn volume_source(id: &str) -> pb::VolumeContentSource {
    pb::VolumeContentSource {
        r#type: Some(pb::volume_content_source::Type::Volume(
            pb::volume_content_source::VolumeSource {
                volume_id: id.to_string(),
            },
        )),
    }
}

pub fn create_req(name: &str, size: i64, cap: pb::VolumeCapability) -> pb::CreateVolumeRequest {
    pb::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: size,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap],
        ..Default::default()
    }
}

pub fn stage_req(
    id: &str,
    staging: &Path,
    cap: pb::VolumeCapability,
) -> pb::NodeStageVolumeRequest {
    pb::NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

pub fn publish_req(
    id: &str,
    staging: &Path,
    target: &Path,
    cap: pb::VolumeCapability,
    readonly: bool,
) -> pb::NodePublishVolumeRequest {
    pb::NodePublishVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap),
        readonly,
        ..Default::default()
    }
}

/// The gRPC code of a call's result.
pub fn code<T>(r: &Result<tonic::Response<T>, tonic::Status>) -> tonic::Code {
    match r {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    }
}

pub fn unpublish_req(id: &str, target: &Path) -> pb::NodeUnpublishVolumeRequest {
    pb::NodeUnpublishVolumeRequest {
        volume_id: id.into(),
        target_path: target.display().to_string(),
    }
}

pub fn unstage_req(id: &str, staging: &Path) -> pb::NodeUnstageVolumeRequest {
    pb::NodeUnstageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
    }
}

/// ControllerExpandVolume to at least `bytes`.
pub fn expand_req(id: &str, bytes: i64) -> pb::ControllerExpandVolumeRequest {
    pb::ControllerExpandVolumeRequest {
        volume_id: id.into(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        ..Default::default()
    }
}

impl Harness {
    /// The driver's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("driver running").id()
    }

    /// A field of /proc/<driver>/status in kB (VmHWM, VmRSS).
    pub fn status_kb(&self, field: &str) -> u64 {
        proc_status_kb(self.pid(), field).unwrap()
    }

    /// Resets the driver's peak RSS (VmHWM) to its current RSS.
    pub fn reset_peak_rss(&self) {
        reset_peak_rss_of(self.pid());
    }
}

/// A field of /proc/<pid>/status in kB (VmHWM, VmRSS); 0 when the field
/// is not there.
pub fn proc_status_kb(pid: u32, field: &str) -> std::io::Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

/// Resets a process's peak RSS (VmHWM) to its current RSS.
pub fn reset_peak_rss_of(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

/// A small deterministic generator (xorshift64*) for randomized tests. The
/// seed is printed; FERROVOL_SEED replays a run.
pub struct Rng(pub u64);

impl Rng {
    pub fn seeded(test: &str) -> Self {
        let seed = std::env::var("FERROVOL_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        println!("{test}: seed {seed} (replay with FERROVOL_SEED={seed})");
        Rng(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A volume created, staged and published by [`Harness::provision`].
pub struct Published {
    pub id: String,
    pub staging: PathBuf,
    pub target: PathBuf,
}

impl Harness {
    /// Creates a volume, stages it under `kubelet/staging/<name>` and
    /// publishes it at `kubelet/pods/<name>`.
    pub async fn provision(&self, name: &str, size: i64, cap: pb::VolumeCapability) -> Published {
        self.provision_req(create_req(name, size, cap)).await
    }

    /// Waits (up to 120 s, polling every 20 ms) until `done`; a wait that
    /// runs out fails the test with the driver's log.
    pub fn wait_until(&self, what: &str, done: &dyn Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !done() {
            assert!(
                Instant::now() < deadline,
                "{what}: not within 120 s; the driver's log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `ferrovol client ARGS --output json` against this driver and
    /// answers what it printed; a failed call fails the test, with the
    /// driver's log.
    pub fn client_json(&self, args: &[&str]) -> serde_json::Value {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrovol"))
            .arg("client")
            .arg("--endpoint")
            .arg(format!("unix://{}", self.socket().display()))
            .arg("--output")
            .arg("json")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The condition NodeGetVolumeStats gives a volume [`Harness::provision`]
    /// made.
    pub async fn condition(&self, vol: &Published) -> pb::VolumeCondition {
        self.node()
            .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: vol.id.clone(),
                volume_path: vol.target.display().to_string(),
                staging_target_path: vol.staging.display().to_string(),
            })
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "stats of {}: {e:?}
{}",
                    vol.id,
                    self.log()
                )
            })
            .into_inner()
            .volume_condition
            .expect("a volume condition")
    }

    /// Asks [`Harness::condition`] every 250 ms until it is abnormal (or,
    /// `abnormal` false, normal), for up to `limit`; the condition then,
    /// or `None` when it never became so.
    pub async fn condition_becomes(
        &self,
        vol: &Published,
        abnormal: bool,
        limit: Duration,
    ) -> Option<pb::VolumeCondition> {
        let deadline = Instant::now() + limit;
        loop {
            let c = self.condition(vol).await;
            if c.abnormal == abnormal {
                return Some(c);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Modifies a volume's mutable parameters to `pairs`.
    pub async fn modify(&self, id: &str, pairs: &[(&str, &str)]) -> Result<(), tonic::Status> {
        self.controller()
            .controller_modify_volume(pb::ControllerModifyVolumeRequest {
                volume_id: id.to_string(),
                mutable_parameters: pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..Default::default()
            })
            .await
            .map(drop)
    }

    /// [`Harness::provision`] of a request of the caller's (parameters, a
    /// content source), with its first capability.
    pub async fn provision_req(&self, req: pb::CreateVolumeRequest) -> Published {
        self.provision_on(req, false).await
    }

    /// [`Harness::provision_req`] for a backend that attaches: the volume
    /// published to this node by the controller (with the request's
    /// secrets) before the node stages it.
    pub async fn provision_attached(&self, req: pb::CreateVolumeRequest) -> Published {
        self.provision_on(req, true).await
    }

    async fn provision_on(&self, req: pb::CreateVolumeRequest, attach: bool) -> Published {
        let (name, cap) = (req.name.clone(), req.volume_capabilities[0].clone());
        let secrets = req.secrets.clone();
        let volume = self
            .controller()
            .create_volume(req)
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let (id, volume_context) = (volume.volume_id, volume.volume_context);
        let publish_context = match attach {
            true => self.attach_here(&id, &cap, &secrets).await,
            false => HashMap::new(),
        };
        let staging = self.path(&format!("kubelet/staging/{name}"));
        std::fs::create_dir_all(&staging).unwrap();
        let target = self.path(&format!("kubelet/pods/{name}"));
        self.node()
            .node_stage_volume(pb::NodeStageVolumeRequest {
                secrets,
                publish_context,
                volume_context: volume_context.clone(),
                ..stage_req(&id, &staging, cap.clone())
            })
            .await
            .unwrap();
        self.node()
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_context,
                ..publish_req(&id, &staging, &target, cap, false)
            })
            .await
            .unwrap();
        Published {
            id,
            staging,
            target,
        }
    }

    /// CreateVolume of `req`; the volume made.
    pub async fn create_volume(&self, req: pb::CreateVolumeRequest) -> pb::Volume {
        self.controller()
            .create_volume(req)
            .await
            .unwrap_or_else(|e| panic!("CreateVolume: {e:?}\n{}", self.log()))
            .into_inner()
            .volume
            .unwrap()
    }

    /// DeleteVolumeGroupSnapshot of `id` (the group and its members) with
    /// `secrets`, which must succeed.
    pub async fn delete_group(&self, id: &str, secrets: HashMap<String, String>) {
        self.group()
            .delete_volume_group_snapshot(pb::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: id.into(),
                secrets,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteVolumeGroupSnapshot {id}: {e:?}\n{}", self.log()));
    }

    /// DeleteSnapshot of `id`, which must succeed.
    pub async fn delete_snapshot(&self, id: &str) {
        self.controller()
            .delete_snapshot(pb::DeleteSnapshotRequest {
                snapshot_id: id.into(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteSnapshot {id}: {e:?}\n{}", self.log()));
    }

    /// DeleteVolume of `id`, which must succeed.
    pub async fn delete_volume(&self, id: &str) {
        self.delete_volume_with(id, HashMap::new()).await
    }

    /// DeleteVolume of `id` with the call's `secrets`, which must succeed.
    pub async fn delete_volume_with(&self, id: &str, secrets: HashMap<String, String>) {
        self.controller()
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: id.into(),
                secrets,
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteVolume {id}: {e:?}\n{}", self.log()));
    }

    /// Nothing left behind: mounts, loop devices, pool files, node records.
    pub fn assert_clean(&self) {
        assert!(
            self.mounts().is_empty(),
            "mounts leaked: {:?}",
            self.mounts()
        );
        assert!(
            self.loop_devices().is_empty(),
            "loop devices leaked: {:?}",
            self.loop_devices()
        );
        let (published, _) = ferrovol::state::NodeState::peek_publishes(&self.state_dir())
            .expect("the publish journal reads");
        assert!(published.is_empty(), "publish records left: {published:?}");
        for sub in ["pool/volumes", "pool/snapshots", "node/staged"] {
            let left: Vec<_> = std::fs::read_dir(self.state_dir().join(sub))
                .unwrap()
                .flatten()
                .map(|e| e.file_name())
                .collect();
            assert!(left.is_empty(), "{sub} not empty: {left:?}");
        }
    }

    /// The ids of every volume ListVolumes shows (one page).
    pub async fn listed_volume_ids(&self) -> Vec<String> {
        self.controller()
            .list_volumes(pb::ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
            .into_iter()
            .map(|e| e.volume.unwrap().volume_id)
            .collect()
    }

    /// Every snapshot ListSnapshots shows (one page).
    pub async fn all_snapshots(&self) -> Vec<pb::list_snapshots_response::Entry> {
        self.controller()
            .list_snapshots(pb::ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
    }

    /// ControllerPublishVolume of `id` to this node; its publish context.
    pub async fn attach_here(
        &self,
        id: &str,
        cap: &pb::VolumeCapability,
        secrets: &HashMap<String, String>,
    ) -> HashMap<String, String> {
        self.controller()
            .controller_publish_volume(pb::ControllerPublishVolumeRequest {
                volume_id: id.into(),
                node_id: self.node_id().await,
                volume_capability: Some(cap.clone()),
                secrets: secrets.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .publish_context
    }

    /// CreateVolume, which must succeed; the volume made.
    pub async fn create(&self, req: pb::CreateVolumeRequest) -> pb::Volume {
        let name = req.name.clone();
        self.controller()
            .create_volume(req)
            .await
            .unwrap_or_else(|e| panic!("CreateVolume {name}: {e:?}\n{}", self.log()))
            .into_inner()
            .volume
            .expect("CreateVolume answers a volume")
    }

    /// ControllerGetVolumeHealth of `id`, which must answer.
    pub async fn controller_health(&self, id: &str) -> pb::VolumeHealth {
        self.controller()
            .controller_get_volume_health(pb::ControllerGetVolumeHealthRequest {
                volume_id: id.into(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("ControllerGetVolumeHealth {id}: {e:?}\n{}", self.log()))
            .into_inner()
            .volume_health
            .expect("a volume_health")
    }

    /// NodeGetStorageHealth, which must answer: what is wrong with each
    /// backend as this node sees it.
    pub async fn storage_health(
        &self,
    ) -> Vec<pb::node_get_storage_health_response::StorageBackendHealth> {
        self.node()
            .node_get_storage_health(pb::NodeGetStorageHealthRequest::default())
            .await
            .unwrap_or_else(|e| panic!("NodeGetStorageHealth: {e:?}\n{}", self.log()))
            .into_inner()
            .backend_health
    }

    /// ControllerUnpublishVolume of `id` from this node, which must
    /// succeed.
    pub async fn detach_here(&self, id: &str) {
        self.controller()
            .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                volume_id: id.into(),
                node_id: self.node_id().await,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("ControllerUnpublishVolume {id}: {e:?}\n{}", self.log()));
    }

    /// The node id NodeGetInfo reports.
    pub async fn node_id(&self) -> String {
        self.node()
            .node_get_info(pb::NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .node_id
    }

    /// NodeUnpublishVolume at `target`, then NodeUnstageVolume at `staging`.
    pub async fn unpublish_unstage(&self, id: &str, staging: &Path, target: &Path) {
        self.node()
            .node_unpublish_volume(unpublish_req(id, target))
            .await
            .unwrap();
        self.node()
            .node_unstage_volume(unstage_req(id, staging))
            .await
            .unwrap();
    }

    /// Unpublishes, unstages and deletes what [`Harness::provision`] made.
    pub async fn teardown(&self, p: &Published) {
        self.unpublish_unstage(&p.id, &p.staging, &p.target).await;
        self.controller()
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: p.id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    /// ControllerExpandVolume then NodeExpandVolume at `path`; returns the
    /// sizes both report.
    pub async fn grow(&self, id: &str, path: &Path, bytes: i64) -> (i64, i64) {
        self.grow_staged(id, path, None, &HashMap::new(), bytes)
            .await
    }

    /// [`Harness::grow`] as kubelet calls it for a staged volume: the
    /// controller call carries `secrets`, the node call the staging path
    /// and the volume's capability.
    pub async fn grow_staged(
        &self,
        id: &str,
        path: &Path,
        staged: Option<(&Path, &pb::VolumeCapability)>,
        secrets: &HashMap<String, String>,
        bytes: i64,
    ) -> (i64, i64) {
        let range = Some(pb::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        });
        let controller = self
            .controller()
            .controller_expand_volume(pb::ControllerExpandVolumeRequest {
                volume_id: id.into(),
                capacity_range: range,
                secrets: secrets.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let node = self
            .node()
            .node_expand_volume(pb::NodeExpandVolumeRequest {
                volume_id: id.into(),
                volume_path: path.display().to_string(),
                staging_target_path: staged
                    .map(|(s, _)| s.display().to_string())
                    .unwrap_or_default(),
                volume_capability: staged.map(|(_, c)| c.clone()),
                capacity_range: range,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        (controller.capacity_bytes, node.capacity_bytes)
    }

    /// The total bytes NodeGetVolumeStats reports for a volume at `path`.
    pub async fn total_bytes(&self, id: &str, path: &Path) -> i64 {
        let req = pb::NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.display().to_string(),
            staging_target_path: String::new(),
        };
        self.node()
            .node_get_volume_stats(req)
            .await
            .unwrap()
            .into_inner()
            .usage[0]
            .total
    }

    /// A filesystem grows while published: data written before survives
    /// and the filesystem's size rises by more than `min_gain`.
    pub async fn check_online_growth(&self, fs: &str, size: i64, grown: i64, min_gain: i64) {
        let p = self
            .provision(&format!("grow-{fs}"), size, mount_cap(fs, SNW))
            .await;
        std::fs::write(p.target.join("data"), b"before growth").unwrap();
        let before = self.total_bytes(&p.id, &p.target).await;
        assert_eq!(self.grow(&p.id, &p.target, grown).await, (grown, grown));
        let after = self.total_bytes(&p.id, &p.target).await;
        assert!(
            after > before + min_gain,
            "{fs} did not grow online: {before} -> {after}"
        );
        assert_eq!(
            std::fs::read(p.target.join("data")).unwrap(),
            b"before growth"
        );
        self.teardown(&p).await;
        assert!(self.loop_devices().is_empty());
        assert!(self.mounts().is_empty());
    }
}

/// A blkid on the driver's PATH that, the first time it runs, says so
/// (a marker file) and waits until the test releases it: an RPC held in
/// flight on an event, not on a clock.
pub struct BlkidGate {
    /// The PATH to give the driver.
    pub path: String,
    entered: std::path::PathBuf,
    release: std::path::PathBuf,
}

impl BlkidGate {
    pub fn new(dir: &Path) -> Self {
        let bin = dir.join("gate-bin");
        std::fs::create_dir_all(&bin).unwrap();
        let entered = dir.join("gate-entered");
        let release = dir.join("gate-release");
        let script = format!(
            "#!/bin/bash\nif [ ! -e {e} ]; then touch {e}; while [ ! -e {r} ]; do sleep 0.01; done; fi\nexec /usr/sbin/blkid \"$@\"\n",
            e = entered.display(),
            r = release.display()
        );
        let fake = bin.join("blkid");
        std::fs::write(&fake, script).unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        BlkidGate {
            path,
            entered,
            release,
        }
    }

    /// Waits until a call sits in the gate.
    pub async fn wait_entered(&self) {
        let start = Instant::now();
        while !self.entered.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no call reached blkid"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Lets the held call go on.
    pub fn release(&self) {
        std::fs::write(&self.release, b"").unwrap();
    }
}

/// A free TCP port on loopback (bound and let go: free until someone else
/// takes it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET `path` from `127.0.0.1:port` over plain HTTP/1.1; (status, body).
pub fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// CPU time (user and system, its waited-for children included) a
/// process has used.
pub fn cpu_of(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime, stime, cutime, cstime: fields 14-17 of stat (11-14 counted
    // from the state after the name), in clock ticks of 10 ms.
    let ticks: u64 = fields
        .get(11..15)
        .map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum())
        .unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// Writes 1, 2, 3, ... to `a` then the same number to `b` (each at offset
/// 0, each write synced when `sync`), until `stop` is set; the thread
/// answers the last number written. A write that fails panics the thread:
/// joining it says whether the writer met an error. A group snapshot of
/// the two restores to a pair some instant held: equal, or `a` one ahead.
pub fn interleave(
    a: PathBuf,
    b: PathBuf,
    sync: bool,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        use std::os::unix::fs::FileExt;
        let open = |p: &Path| {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(p)
                .unwrap()
        };
        let (fa, fb) = (open(&a), open(&b));
        let mut i = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            i += 1;
            let line = format!("{i:020}\n");
            for f in [&fa, &fb] {
                f.write_all_at(line.as_bytes(), 0).unwrap();
                if sync {
                    f.sync_data().unwrap();
                }
            }
        }
        i
    })
}

/// Whether a restored pair of [`interleave`]'s files is one some instant
/// of the writer held: equal, or the first one ahead by one.
pub fn one_instant(first: u64, second: u64) -> bool {
    first == second || first == second + 1
}

/// The number [`interleave`] last wrote to `p` (0: none).
pub fn read_seq(p: &Path) -> u64 {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(0)
}

/// A pod's steady writer: writes a counter to `path` and syncs it, again
/// and again, until stopped, keeping the longest time one write took to
/// go through (a frozen or suspended device makes it wait).
pub struct Steady {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    count: std::sync::Arc<std::sync::atomic::AtomicU64>,
    longest_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Steady {
    pub fn start(path: PathBuf) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let stop = Arc::new(AtomicBool::new(false));
        let count = Arc::new(AtomicU64::new(0));
        let longest_ms = Arc::new(AtomicU64::new(0));
        let (s, c, l) = (stop.clone(), count.clone(), longest_ms.clone());
        let handle = std::thread::spawn(move || {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .unwrap();
            let mut i = 0u64;
            while !s.load(Ordering::Relaxed) {
                i += 1;
                let began = Instant::now();
                f.write_all_at(format!("{i:020}\n").as_bytes(), 0).unwrap();
                f.sync_data().unwrap();
                l.fetch_max(began.elapsed().as_millis() as u64, Ordering::Relaxed);
                c.store(i, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Steady {
            stop,
            count,
            longest_ms,
            handle: Some(handle),
        }
    }

    /// How many writes have gone through so far.
    pub fn count(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How long until the next write goes through, or None within `limit`.
    pub fn next_write_within(&self, limit: Duration) -> Option<Duration> {
        let began = Instant::now();
        let now = self.count.load(std::sync::atomic::Ordering::Relaxed);
        while began.elapsed() < limit {
            if self.count.load(std::sync::atomic::Ordering::Relaxed) > now + 1 {
                return Some(began.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// The longest one write took since the last call, and starts over.
    pub fn take_longest(&self) -> Duration {
        Duration::from_millis(
            self.longest_ms
                .swap(0, std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Stops it; panics if a write failed.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle
            .take()
            .unwrap()
            .join()
            .expect("the writer met no error");
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Steady {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Calls `call` until it answers anything but UNAVAILABLE, three times at
/// most, as the snapshotter does: a driver that could not take a snapshot
/// while its writers were held says UNAVAILABLE (on a busy machine the
/// commands under the hold can outlast its deadline), and is asked again.
pub async fn as_the_snapshotter<T, F, Fut>(what: &str, call: F) -> Result<T, tonic::Status>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let mut tries = 0;
    loop {
        tries += 1;
        match call().await {
            Err(e) if e.code() == tonic::Code::Unavailable && tries < 3 => {
                eprintln!("{what}, try {tries}: {}", e.message());
            }
            r => return r.map(tonic::Response::into_inner),
        }
    }
}

/// The drivers' log filter in the tests: the driver's own debug lines
/// (each command it runs, each call's time), and the gRPC stack's at
/// info: its debug lines, a line per HTTP/2 frame, were four in five of
/// a log and cost the emulated guest CPU for nothing a test reads.
pub const DRIVER_LOG: &str = "debug,h2=info,hyper=info,hyper_util=info,tower=info,tonic=info";
