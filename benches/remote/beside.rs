//! ferrovol's rbd backend beside ceph-csi, the rbd driver Ceph users run
//! today (`../shared/tools/cephcsi.xz`, built from its upstream source):
//! both controllers on one cluster, with the same user, pool, image size
//! and features and secrets in every call, in rounds that alternate which
//! goes first; and beside the floor, measured in the same rounds: librbd
//! itself on one open connection (Ceph's Python binding, one librbd call
//! per step), and one `rbd` process per step.
//!
//! FERROVOL_BENCH_ROUNDS (default 6; 1 in the smoke run), and per round
//! FERROVOL_BENCH_VOLUMES (8) volumes of which FERROVOL_BENCH_SNAPSHOTS (4)
//! are snapshotted, restored and cloned.

use super::common::fixtures::CephCluster;
use super::common::{connect, cpu_of};
use super::results::{record, Against, Row, Value};
use super::{env_num, Figures};
use ferrovol::proto as pb;
use ferrovol::proto::controller_client::ControllerClient;
use ferrovol::proto::identity_client::IdentityClient;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Every image in the comparison: 1 GiB, as a PVC would ask.
const SIZE: u64 = 1 << 30;

/// What ceph-csi reads or writes outside its own directory (no flag moves
/// these): each put back as it was when it stops.
const OUTSIDE: [&str; 3] = [
    "/etc/ceph-csi-config/config.json",
    "/etc/ceph/ceph.conf",
    "/etc/ceph/keyring",
];

/// ceph-csi as an rbd controller alone, without Kubernetes.
pub struct CephCsi {
    child: Child,
    dir: tempfile::TempDir,
    was: Vec<(PathBuf, Option<Vec<u8>>)>,
    made_dirs: Vec<PathBuf>,
}

impl CephCsi {
    pub async fn start(cluster: &CephCluster) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = unpack_tool(dir.path(), "cephcsi", "FERROVOL_CEPHCSI", "ceph-csi");
        let was = OUTSIDE
            .iter()
            .map(|p| (PathBuf::from(p), std::fs::read(p).ok()))
            .collect();
        let mut made_dirs = Vec::new();
        for d in ["/etc/ceph-csi-config", "/etc/ceph", "/tmp/csi"] {
            if !Path::new(d).exists() {
                made_dirs.push(PathBuf::from(d));
            }
        }
        std::fs::create_dir_all("/etc/ceph-csi-config").unwrap();
        std::fs::create_dir_all("/tmp/csi/keys").unwrap();
        std::fs::write(
            OUTSIDE[0],
            format!(
                "[{{\"clusterID\":\"bench\",\"monitors\":[\"v1:{}\"]}}]\n",
                cluster.mon_addr
            ),
        )
        .unwrap();
        let socket = dir.path().join("csi.sock");
        let log = std::fs::File::create(dir.path().join("cephcsi.log")).unwrap();
        let child = Command::new(&bin)
            .args([
                "--type=rbd",
                "--controllerserver=true",
                &format!("--endpoint=unix://{}", socket.display()),
                &format!(
                    "--csi-addons-endpoint=unix://{}",
                    dir.path().join("addons.sock").display()
                ),
                "--nodeid=bench",
                "--drivername=rbd.csi.ceph.com",
                "--instanceid=bench",
                "--v=0",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let mut me = CephCsi {
            child,
            dir,
            was,
            made_dirs,
        };
        let (socket, dir) = (me.socket(), &me.dir);
        wait_ready(&mut me.child, &socket, "ceph-csi", 120, || cephcsi_log(dir)).await;
        me
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("csi.sock")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub async fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(connect(&self.socket()).await.unwrap())
    }
}

/// ceph-csi's log, in its folder.
fn cephcsi_log(dir: &tempfile::TempDir) -> String {
    std::fs::read_to_string(dir.path().join("cephcsi.log")).unwrap_or_default()
}

/// A peer driver's binary: the path in `env`, else
/// `../shared/tools/<tool>.xz` beside the project, unpacked into `into`.
pub(super) fn unpack_tool(into: &Path, tool: &str, env: &str, what: &str) -> PathBuf {
    if let Ok(given) = std::env::var(env) {
        return PathBuf::from(given);
    }
    let packed =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../shared/tools/{tool}.xz"));
    assert!(
        packed.exists(),
        "{what} not found at {} (../shared/tools beside the project, or {env})",
        packed.display()
    );
    let bin = into.join(tool);
    let out = std::fs::File::create(&bin).unwrap();
    let status = Command::new("xz")
        .arg("-dc")
        .arg(&packed)
        .stdout(out)
        .status()
        .expect("xz");
    assert!(status.success(), "xz -dc {}: {status}", packed.display());
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// Waits until the peer driver `child` answers a probe on `socket`, for
/// at most `secs`; panics with its log (`log`) if it exits or does not.
pub(super) async fn wait_ready(
    child: &mut Child,
    socket: &Path,
    what: &str,
    secs: u64,
    log: impl Fn() -> String,
) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited ({status}): {}", log());
        }
        if let Ok(ch) = connect(socket).await {
            if IdentityClient::new(ch)
                .probe(pb::ProbeRequest {})
                .await
                .is_ok()
            {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not answer: {}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Drop for CephCsi {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for (path, was) in &self.was {
            match was {
                Some(bytes) => {
                    let _ = std::fs::write(path, bytes);
                }
                None => {
                    let _ = std::fs::remove_file(path);
                }
            }
        }
        for d in &self.made_dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The calls compared, in the order a round makes them.
const CALLS: [&str; 8] = [
    "CreateVolume",
    "CreateSnapshot",
    "CreateVolume from a snapshot",
    "CreateVolume from a volume",
    "DeleteVolume of a restore",
    "DeleteVolume of a clone",
    "DeleteSnapshot",
    "DeleteVolume",
];

/// How long a failing call is retried before the bench gives up on it:
/// a CO's retries, and one try (a call known to fail for ever).
const RETRIED: Duration = Duration::from_secs(120);
const ONCE: Duration = Duration::ZERO;

/// One driver's figures for each call, over every round.
#[derive(Default)]
struct Tally {
    samples: BTreeMap<&'static str, Vec<Duration>>,
    /// CPU time and calls, per call.
    cpu: BTreeMap<&'static str, (Duration, u32)>,
    /// Calls that failed and were retried: how many, by call and error.
    failures: BTreeMap<(&'static str, String), u32>,
    /// Calls that never succeeded, by call.
    given_up: BTreeMap<&'static str, u32>,
    /// Calls that took over 5 s: which, how long, when they started.
    slow: Vec<(&'static str, Duration, Instant)>,
}

/// One of the two controllers, as the rounds call it.
struct Driver {
    name: &'static str,
    c: ControllerClient<Channel>,
    pid: u32,
    parameters: HashMap<String, String>,
    snapshot_parameters: HashMap<String, String>,
    secrets: HashMap<String, String>,
    tally: Tally,
}

fn source(s: pb::volume_content_source::Type) -> Option<pb::VolumeContentSource> {
    Some(pb::VolumeContentSource { r#type: Some(s) })
}

impl Driver {
    fn create_req(
        &self,
        name: String,
        from: Option<pb::VolumeContentSource>,
    ) -> pb::CreateVolumeRequest {
        let mut req = super::create_req(&name, SIZE as i64, super::mount_cap("ext4", super::SNW));
        req.parameters = self.parameters.clone();
        req.secrets = self.secrets.clone();
        req.volume_content_source = from;
        req
    }

    /// Times `op` on each of `items` in turn (with the driver's CPU over
    /// the whole phase) as call `call`; what each returns, in order.
    async fn phase<T: Clone, R, F, Fut>(
        &mut self,
        call: &'static str,
        give_up: Duration,
        items: Vec<T>,
        op: F,
    ) -> (Vec<R>, Vec<usize>)
    where
        F: Fn(ControllerClient<Channel>, T) -> Fut,
        Fut: std::future::Future<Output = Result<R, tonic::Status>>,
    {
        let cpu = cpu_of(self.pid);
        let (mut out, mut left) = (Vec::new(), Vec::new());
        let count = items.len() as u32;
        for (i, item) in items.into_iter().enumerate() {
            // A failed call is retried, as a CO would, and the time to
            // the answer that succeeds counts; the failures are noted. A
            // call that never succeeds (ceph-csi's delete of a clone on
            // this cluster) is noted and left after `give_up`.
            let t = Instant::now();
            let r = loop {
                match op(self.c.clone(), item.clone()).await {
                    Ok(r) => break Some(r),
                    Err(e) => {
                        let key = (call, format!("{:?}: {}", e.code(), e.message()));
                        *self.tally.failures.entry(key).or_default() += 1;
                        if t.elapsed() >= give_up {
                            break None;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            };
            if let Some(r) = r {
                let took = t.elapsed();
                if took > Duration::from_secs(5) {
                    self.tally.slow.push((call, took, t));
                }
                self.tally.samples.entry(call).or_default().push(took);
                out.push(r);
            } else {
                *self.tally.given_up.entry(call).or_default() += 1;
                left.push(i);
            }
        }
        let spent = cpu_of(self.pid) - cpu;
        let e = self.tally.cpu.entry(call).or_default();
        e.0 += spent;
        e.1 += count;
        (out, left)
    }

    /// Times CreateVolume of each request as call `call`; the ids made.
    async fn creates(
        &mut self,
        call: &'static str,
        reqs: Vec<pb::CreateVolumeRequest>,
    ) -> Vec<String> {
        self.phase(call, RETRIED, reqs, |mut c, r| async move {
            Ok(c.create_volume(r)
                .await?
                .into_inner()
                .volume
                .unwrap()
                .volume_id)
        })
        .await
        .0
    }

    /// One round: `volumes` made; the first `snapshots` of them
    /// snapshotted, each snapshot restored and each volume cloned; then
    /// everything deleted, copies first.
    async fn round(&mut self, tag: &str, volumes: usize, snapshots: usize) {
        let reqs: Vec<_> = (0..volumes)
            .map(|i| self.create_req(format!("{tag}-{i}"), None))
            .collect();
        let vols: Vec<String> = self.creates("CreateVolume", reqs).await;
        let (secrets, params) = (self.secrets.clone(), self.snapshot_parameters.clone());
        let snaps: Vec<String> = self
            .phase(
                "CreateSnapshot",
                RETRIED,
                (0..snapshots).map(|i| (i, vols[i].clone())).collect(),
                |mut c, (i, v)| {
                    let req = pb::CreateSnapshotRequest {
                        source_volume_id: v,
                        name: format!("{tag}-snap-{i}"),
                        secrets: secrets.clone(),
                        parameters: params.clone(),
                    };
                    async move {
                        Ok(c.create_snapshot(req)
                            .await?
                            .into_inner()
                            .snapshot
                            .unwrap()
                            .snapshot_id)
                    }
                },
            )
            .await
            .0;
        let restores: Vec<_> = snaps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                self.create_req(
                    format!("{tag}-restore-{i}"),
                    source(pb::volume_content_source::Type::Snapshot(
                        pb::volume_content_source::SnapshotSource {
                            snapshot_id: s.clone(),
                        },
                    )),
                )
            })
            .collect();
        let restored = self.creates("CreateVolume from a snapshot", restores).await;
        let clones: Vec<_> = vols[..snapshots]
            .iter()
            .enumerate()
            .map(|(i, v)| {
                self.create_req(
                    format!("{tag}-clone-{i}"),
                    source(pb::volume_content_source::Type::Volume(
                        pb::volume_content_source::VolumeSource {
                            volume_id: v.clone(),
                        },
                    )),
                )
            })
            .collect();
        let cloned = self.creates("CreateVolume from a volume", clones).await;
        let delete = |secrets: HashMap<String, String>| {
            move |mut c: ControllerClient<Channel>, id: String| {
                let secrets = secrets.clone();
                async move {
                    c.delete_volume(pb::DeleteVolumeRequest {
                        volume_id: id,
                        secrets,
                    })
                    .await
                    .map(|_| ())
                }
            }
        };
        let s = self.secrets.clone();
        self.phase(
            "DeleteVolume of a restore",
            RETRIED,
            restored,
            delete(s.clone()),
        )
        .await;
        // ceph-csi 3.13 cannot delete a volume's clone: it removes the
        // clone's temporary parent first, which fails while the clone
        // lives (ENOTEMPTY; ceph/ceph-csi#6481 changed the order later),
        // and the source volume then cannot go either. Those are left.
        let (_, stuck) = self
            .phase("DeleteVolume of a clone", ONCE, cloned, delete(s.clone()))
            .await;
        let vols: Vec<String> = vols
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !stuck.contains(i))
            .map(|(_, v)| v)
            .collect();
        if !stuck.is_empty() {
            *self.tally.given_up.entry("DeleteVolume").or_default() += stuck.len() as u32;
        }
        self.phase("DeleteSnapshot", RETRIED, snaps, |mut c, id| {
            let secrets = s.clone();
            async move {
                c.delete_snapshot(pb::DeleteSnapshotRequest {
                    snapshot_id: id,
                    secrets,
                })
                .await
                .map(|_| ())
            }
        })
        .await;
        self.phase("DeleteVolume", RETRIED, vols, delete(s.clone()))
            .await;
    }
}

/// The floor's figures for each call, over every round.
#[derive(Default)]
struct Floors {
    librbd: BTreeMap<String, Vec<Duration>>,
    cli: BTreeMap<&'static str, Vec<Duration>>,
}

impl Floors {
    /// One round of librbd's own steps, and of `rbd` processes.
    fn round(&mut self, cluster: &CephCluster, tag: &str, volumes: usize, snapshots: usize) {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/remote/librbd_floor.py");
        let out = Command::new("/usr/bin/python3")
            .arg(&script)
            .args([
                cluster.conf.to_str().unwrap(),
                cluster.client_keyring.to_str().unwrap(),
                "ferrovol",
                cluster.pool,
                &format!("{tag}-floor"),
                &volumes.to_string(),
                &snapshots.to_string(),
                &SIZE.to_string(),
            ])
            .output()
            .expect("python3 (Debian's, with python3-rbd)");
        assert!(
            out.status.success(),
            "librbd floor: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let times: BTreeMap<String, Vec<f64>> = serde_json::from_slice(&out.stdout).unwrap();
        for (step, ms) in times {
            self.librbd
                .entry(step)
                .or_default()
                .extend(ms.iter().map(|m| Duration::from_secs_f64(m / 1e3)));
        }
        let image = |i: usize| format!("{}/{tag}-cli-{i}", cluster.pool);
        let mut timed = |step: &'static str, args: &[&str]| {
            let t = Instant::now();
            cluster.rbd(args);
            self.cli.entry(step).or_default().push(t.elapsed());
        };
        for i in 0..volumes {
            timed("create", &["create", &image(i), "--size", "1G"]);
        }
        for i in 0..snapshots {
            timed(
                "snapshot",
                &["snap", "create", &format!("{}@cut", image(i))],
            );
        }
        for i in 0..snapshots {
            timed(
                "remove snapshot",
                &["snap", "rm", &format!("{}@cut", image(i))],
            );
        }
        for i in 0..volumes {
            timed("remove", &["rm", "--no-progress", &image(i)]);
        }
    }

    /// The librbd and CLI floors of a call, where one is measured.
    fn of(&self, call: &str) -> (Option<Duration>, Option<Duration>) {
        let (lib, cli) = match call {
            "CreateVolume" => ("create", "create"),
            "CreateSnapshot" => ("snapshot", "snapshot"),
            "CreateVolume from a snapshot" => ("clone", ""),
            "DeleteVolume of a restore" => ("remove clone", ""),
            "DeleteSnapshot" => ("remove snapshot", "remove snapshot"),
            "DeleteVolume" => ("remove", "remove"),
            _ => ("", ""),
        };
        (
            self.librbd.get(lib).map(|s| pct(s, 0.5)),
            self.cli.get(cli).map(|s| pct(s, 0.5)),
        )
    }
}

pub(super) fn pct(samples: &[Duration], p: f64) -> Duration {
    Figures::of(samples).pct(p)
}

/// The p50 and p99 of `samples`, as one figure of the table.
pub(super) fn p50_p99(samples: &[Duration]) -> Value {
    Value::ms(pct(samples, 0.5), pct(samples, 0.99))
}

pub(super) fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// A process's peak resident memory (VmHWM) in MiB.
pub(super) fn peak_mib(pid: u32) -> f64 {
    super::common::proc_status_kb(pid, "VmHWM").unwrap_or(0) as f64 / 1024.0
}

/// Memory and threads of a process, as one cell.
pub(super) fn memory(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = |field: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    format!(
        "{:.1} MiB resident ({:.1} at the peak), {} threads",
        kb("VmRSS:") as f64 / 1024.0,
        kb("VmHWM:") as f64 / 1024.0,
        kb("Threads:")
    )
}

/// The side-by-side rounds and their table. `ferrovol` is a driver on the
/// librbd client on `cluster`, its pid `pid`.
pub async fn run(cluster: &CephCluster, h: &super::Harness, smoke: bool) {
    let (ferrovol, pid) = (h.controller(), h.pid());
    let rounds = env_num("FERROVOL_BENCH_ROUNDS", if smoke { 1 } else { 6 });
    let volumes = env_num("FERROVOL_BENCH_VOLUMES", if smoke { 2 } else { 8 });
    let snapshots = env_num("FERROVOL_BENCH_SNAPSHOTS", if smoke { 1 } else { 4 }).min(volumes);
    let load_before = load();
    let peer = CephCsi::start(cluster).await;
    let secrets = cluster.secrets();
    let mut drivers = [
        Driver {
            name: "ferrovol",
            c: ferrovol,
            pid,
            parameters: HashMap::new(),
            snapshot_parameters: HashMap::new(),
            secrets: secrets.clone(),
            tally: Tally::default(),
        },
        Driver {
            name: "ceph-csi",
            c: peer.controller().await,
            pid: peer.pid(),
            parameters: HashMap::from([
                ("clusterID".into(), "bench".into()),
                ("pool".into(), cluster.pool.into()),
                ("imageFeatures".into(), "layering".into()),
            ]),
            snapshot_parameters: HashMap::from([
                ("clusterID".into(), "bench".into()),
                ("pool".into(), cluster.pool.into()),
            ]),
            secrets,
            tally: Tally::default(),
        },
    ];
    // Each driver's first call connects to the cluster (and the pool's
    // first writes find it cold): one volume each, made and deleted
    // untimed, its time printed.
    for d in drivers.iter_mut() {
        let t = Instant::now();
        let mut c = d.c.clone();
        let v = c
            .create_volume(d.create_req(format!("warm-{}", d.name), None))
            .await
            .unwrap_or_else(|e| panic!("{}: {e:?}", d.name))
            .into_inner()
            .volume
            .unwrap();
        let made = t.elapsed();
        c.delete_volume(pb::DeleteVolumeRequest {
            volume_id: v.volume_id,
            secrets: d.secrets.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: {e:?}", d.name));
        println!(
            "{}: first CreateVolume (connecting) {:.1} ms, its DeleteVolume {:.1} ms",
            d.name,
            made.as_secs_f64() * 1e3,
            (t.elapsed() - made).as_secs_f64() * 1e3
        );
    }
    let mut floors = Floors::default();
    let started = Instant::now();
    for round in 0..rounds {
        // Who goes first turns each round: ferrovol, ceph-csi, the floor.
        for turn in 0..3 {
            match (round + turn) % 3 {
                // The floor's tools block: off the async workers, or the
                // gRPC connections' tasks (keepalive pings) would wait.
                2 => tokio::task::block_in_place(|| {
                    floors.round(cluster, &format!("r{round}"), volumes, snapshots)
                }),
                d => {
                    let tag = format!("{}{round}", ["fv", "cc"][d]);
                    drivers[d].round(&tag, volumes, snapshots).await;
                }
            }
        }
    }
    println!(
        "\nrbd: ferrovol beside ceph-csi, one cluster (one monitor, one memstore OSD, one manager), \
         1 GiB images with layering, secrets in every call; {rounds} rounds of {volumes} volumes \
         ({snapshots} snapshotted, restored and cloned), who goes first turning each round; \
         load {load_before} before, {} after",
        load()
    );
    println!(
        "{:<30} {:>18} {:>18} {:>7} {:>13} {:>10} {:>7} {:>9}",
        "call (p50 / p99)",
        "ferrovol",
        "ceph-csi",
        "f/c",
        "CPU ms f / c",
        "librbd",
        "f/lib",
        "rbd CLI"
    );
    let [f, c] = &drivers;
    for call in CALLS {
        let none = Vec::new();
        let samples = |t: &'_ Tally| t.samples.get(call).unwrap_or(&none).clone();
        let (fs, cs) = (&samples(&f.tally), &samples(&c.tally));
        let cpu = |t: &Tally| {
            let (d, n) = t.cpu[call];
            format!("{:.1}", d.as_secs_f64() * 1e3 / n.max(1) as f64)
        };
        let both = |s: &[Duration]| {
            if s.is_empty() {
                return "never succeeds".to_string();
            }
            format!(
                "{:.0} / {:.0} ms",
                pct(s, 0.5).as_secs_f64() * 1e3,
                pct(s, 0.99).as_secs_f64() * 1e3
            )
        };
        let ratio = |a: Duration, b: Duration| {
            if a.is_zero() || b.is_zero() {
                return String::new();
            }
            format!("{:.2}", a.as_secs_f64() / b.as_secs_f64())
        };
        let (lib, cli) = floors.of(call);
        let ms1 = |d: Option<Duration>| {
            d.map(|d| format!("{:.1} ms", d.as_secs_f64() * 1e3))
                .unwrap_or_default()
        };
        if !fs.is_empty() && !cs.is_empty() {
            record(Row::times(
                "rbd",
                call,
                p50_p99(fs),
                "ceph-csi",
                Against::Peer,
                p50_p99(cs),
            ));
        }
        if let (false, Some(l)) = (fs.is_empty(), lib) {
            record(Row::times(
                "rbd",
                call,
                p50_p99(fs),
                "librbd (one call a step)",
                Against::Floor,
                Value::one(l.as_secs_f64() * 1e3),
            ));
        }
        println!(
            "{call:<30} {:>18} {:>18} {:>7} {:>13} {:>10} {:>7} {:>9}",
            both(fs),
            both(cs),
            ratio(pct(fs, 0.5), pct(cs, 0.5)),
            format!("{} / {}", cpu(&f.tally), cpu(&c.tally)),
            ms1(lib),
            lib.map(|l| ratio(pct(fs, 0.5), l)).unwrap_or_default(),
            ms1(cli),
        );
    }
    record(Row::peak_rss(
        "rbd",
        peak_mib(f.pid),
        "ceph-csi",
        peak_mib(c.pid),
    ));
    for d in [f, c] {
        println!("{}: {}", d.name, memory(d.pid));
        for ((call, error), times) in &d.tally.failures {
            println!("  {call}: failed {times} times: {error}");
        }
        for (call, took, at) in &d.tally.slow {
            println!(
                "  {call}: one took {:.1} s, from {:.1} s into the rounds",
                took.as_secs_f64(),
                at.duration_since(started).as_secs_f64()
            );
        }
        if !d.tally.slow.is_empty() {
            // What the cluster's daemons said of authentication meanwhile.
            for daemon in ["osd.0", "mon.a"] {
                let log = std::fs::read_to_string(cluster.dir.path().join(format!("{daemon}.log")))
                    .unwrap_or_default();
                for line in log
                    .lines()
                    .filter(|l| {
                        l.contains("secret_id") || l.contains("rotating") || l.contains("auth")
                    })
                    .take(20)
                {
                    println!("    {daemon}: {line}");
                }
            }
        }
        if d.name == "ferrovol" && !d.tally.slow.is_empty() {
            // What the driver said of its slow calls.
            for line in h.log().lines().filter(|l| {
                l.contains("WARN")
                    || l.contains("ERROR")
                    || l.contains("duration_ms=") && {
                        let ms = l.rsplit("duration_ms=").next().unwrap_or("0");
                        ms.trim().parse::<f64>().unwrap_or(0.0) > 5000.0
                    }
            }) {
                println!("    {line}");
            }
        }
        for (call, times) in &d.tally.given_up {
            println!("  {call}: {times} left on the cluster (the call never succeeded, or a clone of the volume could not go)");
        }
    }
}
