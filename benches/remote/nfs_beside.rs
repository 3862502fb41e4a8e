//! ferrovol's nfs backend beside csi-driver-nfs, the NFS driver nfs users
//! run today (`../shared/tools/nfsplugin.xz`, built from its upstream
//! source): one export of the kernel's nfsd, both drivers on it over
//! NFSv4.2 on loopback, in the real-kernel guest, in rounds that turn
//! which driver goes first.
//!
//! A round, for each driver: FERROVOL_BENCH_VOLUMES (6) volumes made; each
//! mounted into a pod's directory as a kubelet mounts it (ferrovol:
//! NodeStageVolume then NodePublishVolume; csi-driver-nfs has no stage:
//! NodePublishVolume), the same files written into it (8 MiB of data and
//! 32 small files), and unmounted; the first FERROVOL_BENCH_SNAPSHOTS (3)
//! snapshotted, each snapshot restored and each of those volumes cloned;
//! every volume expanded; everything deleted, copies first; then
//! FERROVOL_BENCH_BURST (50) volumes created at once (every call in flight
//! together) and deleted at once. FERROVOL_BENCH_ROUNDS rounds (4).

use super::beside::{load, memory, p50_p99, pct, peak_mib, unpack_tool, wait_ready};
use super::common::{connect, cpu_of, mount_cap, publish_req, stage_req, unpublish_req};
use super::common::{unstage_req, Harness, SNW};
use super::results::{record, Against, Row};
use ferrovol::proto as pb;
use ferrovol::proto::controller_client::ControllerClient;
use ferrovol::proto::node_client::NodeClient;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Every volume asks for 1 GiB, as a PVC would.
const SIZE: i64 = 1 << 30;

/// The calls compared, in the order of the table.
const CALLS: [&str; 13] = [
    "CreateVolume",
    "mount in a pod",
    "unmount from a pod",
    "CreateSnapshot",
    "CreateVolume from a snapshot",
    "CreateVolume from a volume",
    "ControllerExpandVolume",
    "DeleteVolume of a copy",
    "DeleteSnapshot",
    "DeleteVolume",
    "CreateVolume, all at once",
    "DeleteVolume, all at once",
    "all at once, whole burst",
];

/// csi-driver-nfs alone, without Kubernetes: its one process serves the
/// controller and the node on one socket.
pub struct NfsPlugin {
    child: Child,
    dir: tempfile::TempDir,
}

impl NfsPlugin {
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = unpack_tool(
            dir.path(),
            "nfsplugin",
            "FERROVOL_NFSPLUGIN",
            "csi-driver-nfs",
        );
        let work = dir.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        let log = std::fs::File::create(dir.path().join("nfsplugin.log")).unwrap();
        let child = Command::new(&bin)
            .arg(format!(
                "--endpoint=unix://{}",
                dir.path().join("nfs.sock").display()
            ))
            .args(["--nodeid=n1", "--drivername=nfs.csi.k8s.io", "--v=2"])
            .arg(format!("--working-mount-dir={}", work.display()))
            .env("TMPDIR", dir.path())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let mut me = NfsPlugin { child, dir };
        let (socket, log) = (me.socket(), me.dir.path().join("nfsplugin.log"));
        wait_ready(&mut me.child, &socket, "csi-driver-nfs", 60, || {
            std::fs::read_to_string(&log).unwrap_or_default()
        })
        .await;
        me
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("nfs.sock")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for NfsPlugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One driver as the rounds call it.
struct Side {
    name: &'static str,
    c: ControllerClient<Channel>,
    n: NodeClient<Channel>,
    pid: u32,
    /// Whether the node stages (ferrovol) or only publishes.
    stages: bool,
    cap: pb::VolumeCapability,
    parameters: HashMap<String, String>,
    /// Where its pods' directories go.
    pods: PathBuf,
    samples: BTreeMap<&'static str, Vec<Duration>>,
    /// CPU time and calls, per call.
    cpu: BTreeMap<&'static str, (Duration, u32)>,
}

/// A volume as CreateVolume answered it.
#[derive(Clone)]
struct Made {
    id: String,
    context: HashMap<String, String>,
}

fn source(s: pb::volume_content_source::Type) -> Option<pb::VolumeContentSource> {
    Some(pb::VolumeContentSource { r#type: Some(s) })
}

impl Side {
    fn note(&mut self, call: &'static str, took: Duration) {
        self.samples.entry(call).or_default().push(took);
    }

    /// Runs `op` once as call `call`: its time, and the driver's CPU.
    async fn timed<R, Fut>(&mut self, call: &'static str, op: Fut) -> R
    where
        Fut: std::future::Future<Output = Result<R, tonic::Status>>,
    {
        let cpu = cpu_of(self.pid);
        let t = Instant::now();
        let r = op
            .await
            .unwrap_or_else(|e| panic!("{}: {call}: {e:?}", self.name));
        self.note(call, t.elapsed());
        let e = self.cpu.entry(call).or_default();
        e.0 += cpu_of(self.pid) - cpu;
        e.1 += 1;
        r
    }

    fn create_req(
        &self,
        name: String,
        from: Option<pb::VolumeContentSource>,
    ) -> pb::CreateVolumeRequest {
        let mut req = super::create_req(&name, SIZE, self.cap.clone());
        req.parameters = self.parameters.clone();
        req.volume_content_source = from;
        req
    }

    async fn create(&mut self, call: &'static str, req: pb::CreateVolumeRequest) -> Made {
        let mut c = self.c.clone();
        let v = self
            .timed(call, async move { c.create_volume(req).await })
            .await
            .into_inner()
            .volume
            .unwrap();
        Made {
            id: v.volume_id,
            context: v.volume_context,
        }
    }

    async fn delete(&mut self, call: &'static str, id: String) {
        let mut c = self.c.clone();
        self.timed(call, async move {
            c.delete_volume(pb::DeleteVolumeRequest {
                volume_id: id,
                ..Default::default()
            })
            .await
        })
        .await;
    }

    /// Mounts `v` into a new pod directory as a kubelet does, writes the
    /// round's files into it, and unmounts it.
    async fn use_in_pod(&mut self, v: &Made, tag: &str) {
        let base = self.pods.join(tag);
        let (staging, target) = (base.join("globalmount"), base.join("pod/mount"));
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let (cap, stages) = (self.cap.clone(), self.stages);
        let mut n = self.n.clone();
        let mut publish = publish_req(&v.id, &staging, &target, cap.clone(), false);
        publish.volume_context = v.context.clone();
        if !stages {
            publish.staging_target_path = String::new();
        }
        let mut stage = stage_req(&v.id, &staging, cap);
        stage.volume_context = v.context.clone();
        self.timed("mount in a pod", async move {
            if stages {
                n.node_stage_volume(stage).await?;
            }
            n.node_publish_volume(publish).await
        })
        .await;
        write_files(&target);
        let (id, mut n) = (v.id.clone(), self.n.clone());
        let (s2, t2) = (staging.clone(), target.clone());
        self.timed("unmount from a pod", async move {
            let r = n.node_unpublish_volume(unpublish_req(&id, &t2)).await?;
            if stages {
                n.node_unstage_volume(unstage_req(&id, &s2)).await?;
            }
            Ok(r)
        })
        .await;
        let _ = std::fs::remove_dir_all(&base);
    }

    /// One round (see the module's text).
    async fn round(&mut self, tag: &str, volumes: usize, snapshots: usize, burst: usize) {
        let mut vols = Vec::new();
        for i in 0..volumes {
            let req = self.create_req(format!("{tag}-{i}"), None);
            vols.push(self.create("CreateVolume", req).await);
        }
        for (i, v) in vols.clone().iter().enumerate() {
            self.use_in_pod(v, &format!("{tag}-{i}")).await;
        }
        let mut snaps = Vec::new();
        for (i, v) in vols[..snapshots].iter().enumerate() {
            let mut c = self.c.clone();
            let req = pb::CreateSnapshotRequest {
                source_volume_id: v.id.clone(),
                name: format!("{tag}-snap-{i}"),
                ..Default::default()
            };
            let s = self
                .timed(
                    "CreateSnapshot",
                    async move { c.create_snapshot(req).await },
                )
                .await
                .into_inner()
                .snapshot
                .unwrap();
            snaps.push(s.snapshot_id);
        }
        let mut copies = Vec::new();
        for (i, s) in snaps.iter().enumerate() {
            let from = source(pb::volume_content_source::Type::Snapshot(
                pb::volume_content_source::SnapshotSource {
                    snapshot_id: s.clone(),
                },
            ));
            let req = self.create_req(format!("{tag}-restore-{i}"), from);
            copies.push(self.create("CreateVolume from a snapshot", req).await);
        }
        for (i, v) in vols[..snapshots].to_vec().iter().enumerate() {
            let from = source(pb::volume_content_source::Type::Volume(
                pb::volume_content_source::VolumeSource {
                    volume_id: v.id.clone(),
                },
            ));
            let req = self.create_req(format!("{tag}-clone-{i}"), from);
            copies.push(self.create("CreateVolume from a volume", req).await);
        }
        for v in &vols {
            let mut c = self.c.clone();
            let req = pb::ControllerExpandVolumeRequest {
                volume_id: v.id.clone(),
                capacity_range: Some(pb::CapacityRange {
                    required_bytes: 2 * SIZE,
                    limit_bytes: 0,
                }),
                volume_capability: Some(self.cap.clone()),
                ..Default::default()
            };
            self.timed("ControllerExpandVolume", async move {
                c.controller_expand_volume(req).await
            })
            .await;
        }
        for v in copies {
            self.delete("DeleteVolume of a copy", v.id).await;
        }
        for s in snaps {
            let mut c = self.c.clone();
            self.timed("DeleteSnapshot", async move {
                c.delete_snapshot(pb::DeleteSnapshotRequest {
                    snapshot_id: s,
                    ..Default::default()
                })
                .await
            })
            .await;
        }
        for v in vols {
            self.delete("DeleteVolume", v.id).await;
        }
        // The burst: every call in flight together.
        let cpu = cpu_of(self.pid);
        let t = Instant::now();
        let reqs: Vec<_> = (0..burst)
            .map(|i| self.create_req(format!("{tag}-burst-{i}"), None))
            .collect();
        let made = self
            .all_at_once(
                reqs,
                |mut c, r| async move {
                    let v = c.create_volume(r).await?.into_inner();
                    Ok(v.volume.unwrap().volume_id)
                },
                "CreateVolume, all at once",
            )
            .await;
        self.all_at_once(
            made.into_iter().map(|id| pb::DeleteVolumeRequest {
                volume_id: id,
                ..Default::default()
            }),
            |mut c, r| async move { c.delete_volume(r).await.map(drop) },
            "DeleteVolume, all at once",
        )
        .await;
        self.note("all at once, whole burst", t.elapsed());
        let e = self.cpu.entry("all at once, whole burst").or_default();
        e.0 += cpu_of(self.pid) - cpu;
        e.1 += burst as u32;
    }

    /// Every request of `reqs` sent at once, each on its own task: each
    /// call's time as `call`, and what each answered, in order.
    async fn all_at_once<Q, R, F, Fut>(
        &mut self,
        reqs: impl IntoIterator<Item = Q>,
        op: F,
        call: &'static str,
    ) -> Vec<R>
    where
        Q: Send + 'static,
        R: Send + 'static,
        F: Fn(ControllerClient<Channel>, Q) -> Fut,
        Fut: std::future::Future<Output = Result<R, tonic::Status>> + Send + 'static,
    {
        let tasks: Vec<_> = reqs
            .into_iter()
            .map(|q| {
                let call_fut = op(self.c.clone(), q);
                tokio::spawn(async move {
                    let t = Instant::now();
                    let r = call_fut.await;
                    (r, t.elapsed())
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            let (r, took) = t.await.unwrap();
            let r = r.unwrap_or_else(|e| panic!("{}: {call}: {e:?}", self.name));
            self.note(call, took);
            out.push(r);
        }
        out
    }
}

/// What every pod writes: 8 MiB of data that does not compress (a tar's
/// gzip meets what a database or media would give it) and 32 small files,
/// synced.
fn write_files(dir: &Path) {
    let mut data = vec![0u8; 8 << 20];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for chunk in data.chunks_mut(8) {
        // xorshift: bytes gzip cannot shrink.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let f = std::fs::File::create(dir.join("data")).unwrap();
    std::io::Write::write_all(&mut &f, &data).unwrap();
    f.sync_all().unwrap();
    std::fs::create_dir_all(dir.join("small")).unwrap();
    for i in 0..32 {
        std::fs::write(dir.join(format!("small/{i}")), format!("file {i}\n")).unwrap();
    }
    std::fs::File::open(dir.join("small"))
        .unwrap()
        .sync_all()
        .unwrap();
}

/// The side-by-side rounds and their table: ferrovol is `h`, a driver on
/// the export of `server` (its config's `main`, NFSv4.2); csi-driver-nfs
/// is given the same server and share.
pub async fn run(h: &Harness) {
    let rounds = super::env_num("FERROVOL_BENCH_ROUNDS", 4);
    let volumes = super::env_num("FERROVOL_BENCH_VOLUMES", 6);
    let snapshots = super::env_num("FERROVOL_BENCH_SNAPSHOTS", 3).min(volumes);
    let burst = super::env_num("FERROVOL_BENCH_BURST", 50);
    let load_before = load();
    let peer = NfsPlugin::start().await;
    let peer_ch = connect(&peer.socket()).await.unwrap();
    let pods = tempfile::tempdir().unwrap();
    let mut peer_cap = mount_cap("", SNW);
    if let Some(pb::volume_capability::AccessType::Mount(m)) = peer_cap.access_type.as_mut() {
        // csi-driver-nfs adds no options of its own: the version ferrovol's
        // export is configured with.
        m.mount_flags = vec!["nfsvers=4.2".into()];
    }
    let mut sides = [
        Side {
            name: "ferrovol",
            c: h.controller(),
            n: h.node(),
            pid: h.pid(),
            stages: true,
            cap: mount_cap("", SNW),
            parameters: HashMap::new(),
            pods: pods.path().join("ferrovol"),
            samples: BTreeMap::new(),
            cpu: BTreeMap::new(),
        },
        Side {
            name: "csi-driver-nfs",
            c: ControllerClient::new(peer_ch.clone()),
            n: NodeClient::new(peer_ch),
            pid: peer.pid(),
            stages: false,
            cap: peer_cap,
            parameters: HashMap::from([
                ("server".into(), "127.0.0.1".into()),
                ("share".into(), "/".into()),
            ]),
            pods: pods.path().join("csi-driver-nfs"),
            samples: BTreeMap::new(),
            cpu: BTreeMap::new(),
        },
    ];
    // Each driver's first call finds the export cold: one volume each,
    // made and deleted untimed.
    for s in sides.iter_mut() {
        let req = s.create_req(format!("warm-{}", s.name), None);
        let v = s.create("warm", req).await;
        s.delete("warm", v.id).await;
        s.samples.remove("warm");
        s.cpu.remove("warm");
    }
    for round in 0..rounds {
        for turn in 0..2 {
            let d = (round + turn) % 2;
            let tag = format!("{}{round}", ["fv", "cdn"][d]);
            sides[d].round(&tag, volumes, snapshots, burst).await;
        }
    }
    println!(
        "\nnfs: ferrovol beside csi-driver-nfs, one export of the kernel's nfsd (NFSv4.2, \
         loopback, the real-kernel guest); {rounds} rounds of {volumes} volumes (each mounted \
         in a pod and written: 8 MiB and 32 small files; {snapshots} snapshotted, restored \
         and cloned; all expanded), then {burst} created and deleted at once; who goes first \
         turning each round; load {load_before} before, {} after",
        load()
    );
    println!(
        "{:<30} {:>20} {:>20} {:>7} {:>15}",
        "call (p50 / p99)", "ferrovol", "csi-driver-nfs", "f/c", "CPU ms f / c"
    );
    let [f, c] = &sides;
    for call in CALLS {
        let none = Vec::new();
        let (fs, cs) = (
            f.samples.get(call).unwrap_or(&none),
            c.samples.get(call).unwrap_or(&none),
        );
        let both = |s: &[Duration]| {
            format!(
                "{:.1} / {:.1} ms",
                pct(s, 0.5).as_secs_f64() * 1e3,
                pct(s, 0.99).as_secs_f64() * 1e3
            )
        };
        let cpu = |s: &Side| {
            s.cpu
                .get(call)
                .map(|(d, n)| format!("{:.1}", d.as_secs_f64() * 1e3 / (*n).max(1) as f64))
                .unwrap_or_else(|| "-".into())
        };
        let ratio = pct(fs, 0.5).as_secs_f64() / pct(cs, 0.5).as_secs_f64().max(1e-9);
        if !fs.is_empty() && !cs.is_empty() {
            record(Row::times(
                "nfs",
                call,
                p50_p99(fs),
                "csi-driver-nfs",
                Against::Peer,
                p50_p99(cs),
            ));
        }
        println!(
            "{call:<30} {:>20} {:>20} {:>7.2} {:>15}",
            both(fs),
            both(cs),
            ratio,
            format!("{} / {}", cpu(f), cpu(c))
        );
    }
    for s in [f, c] {
        println!("{}: {}", s.name, memory(s.pid));
    }
    record(Row::peak_rss(
        "nfs",
        peak_mib(f.pid),
        "csi-driver-nfs",
        peak_mib(c.pid),
    ));
}
