//! The remote backends' controller calls beside the floor of the tools
//! they drive, both measured in the same run against servers started the
//! way the tests start them (tgtd on loopback; the one-monitor, one-OSD
//! Ceph fixture).
//!
//!     cargo bench --bench remote            (as root; tgt, ceph)
//!
//! FERROVOL_BENCH_CALLS (default 40) sets the calls per phase,
//! FERROVOL_BENCH_EXISTING (default 800) the volumes made before the phases
//! "with N", FERROVOL_BENCH_CLIENTS (default 8) the concurrent callers,
//! FERROVOL_BENCH_ONLY (`iscsi` or `rbd`) one backend, or `cephcsi` the
//! rbd backend beside ceph-csi alone (`remote/beside.rs`: its own knobs),
//! or, in the real-kernel guest only, `nfs` (beside csi-driver-nfs,
//! `remote/nfs_beside.rs`, then beside the tools) or `lvm` (`remote/lvm.rs`:
//! lvm beside the bare lvm commands) or `iscsi-stage`
//! (`remote/iscsi_stage.rs`: the node's stage and unstage beside
//! open-iscsi by hand) or `nvmf` (`remote/nvmf_beside.rs`: nvmf's calls,
//! stage and fio beside iscsi's), or, in the two-node guest,
//! `failover` (`remote/failover.rs`: a fenced failover of iscsi and rbd,
//! step by step).
//!
//! Each row: p50 and p99 of one call, calls per second, and the floor: the
//! same work done by the tool itself (one `tgtadm` or `rbd` process per
//! step, run by hand), its p50, and the ratio of the two p50s. A row with 8
//! callers gives its rate beside the sequential rate of the same call.

#[path = "remote/beside.rs"]
mod beside;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "remote/failover.rs"]
mod failover;
#[path = "remote/iscsi_stage.rs"]
mod iscsi_stage;
#[path = "remote/lvm.rs"]
mod lvm;
#[path = "remote/nfs_beside.rs"]
mod nfs_beside;
#[path = "remote/nvmf_beside.rs"]
mod nvmf_beside;
#[path = "results.rs"]
mod results;
// The two-node guest's scenarios (its tests, which a bench does not
// compile, leave part of it unused here).
#[allow(dead_code, unused_imports)]
#[path = "../tests/two_nodes/mod.rs"]
mod two_nodes;

use common::fixtures::{run, CephCluster, NfsServer, Tgtd};
use common::*;
use ferrovol::proto as pb;
use ferrovol::proto::controller_client::ControllerClient;
use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

fn env_num(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One phase's samples.
struct Figures {
    elapsed: Duration,
    samples: Vec<Duration>,
    /// CPU time the driver, and its server when it has one apart, took
    /// per call, when measured.
    cpu: Option<(Duration, Option<Duration>)>,
}

/// `phase`, with the CPU time the driver (and its servers, processes of
/// their own) spent on it per call.
async fn with_cpu(driver: u32, servers: &[u32], phase: impl Future<Output = Figures>) -> Figures {
    let total = |pids: &[u32]| pids.iter().map(|p| cpu_of(*p)).sum::<Duration>();
    let before = (cpu_of(driver), total(servers));
    let mut f = phase.await;
    let calls = f.samples.len().max(1) as u32;
    f.cpu = Some((
        (cpu_of(driver) - before.0) / calls,
        (!servers.is_empty()).then(|| (total(servers) - before.1) / calls),
    ));
    f
}

/// CPU per call: the driver's, `+` the server's.
fn cpu_text(f: &Figures) -> String {
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
    match f.cpu {
        Some((d, Some(s))) => format!("{}+{}", ms(d), ms(s)),
        Some((d, None)) => ms(d),
        None => String::new(),
    }
}

impl Figures {
    /// Calls timed one after another (the phase took their sum), with no
    /// CPU measured.
    fn of(samples: &[Duration]) -> Figures {
        Figures {
            elapsed: samples.iter().sum(),
            samples: samples.to_vec(),
            cpu: None,
        }
    }
    /// The p50 and p99, as a results row takes them.
    fn p50_p99(&self) -> results::Value {
        results::Value::ms(self.pct(0.5), self.pct(0.99))
    }
    fn rate(&self) -> f64 {
        self.samples.len() as f64 / self.elapsed.as_secs_f64()
    }
    fn pct(&self, p: f64) -> Duration {
        let mut s = self.samples.clone();
        s.sort();
        s.get(((s.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or_default()
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// Runs `op(i)` for i in `0..calls` from `clients` tasks at once.
async fn calls<F, Fut>(clients: usize, calls: usize, op: F) -> Figures
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (op, next) = (op.clone(), next.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= calls {
                        return samples;
                    }
                    let t = Instant::now();
                    op(i).await;
                    samples.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await.unwrap());
    }
    Figures {
        elapsed: start.elapsed(),
        samples,
        cpu: None,
    }
}

/// The floor: `step(i)` (a tool run by hand) `calls` times in a row.
fn floor(calls: usize, mut step: impl FnMut(usize)) -> Figures {
    let start = Instant::now();
    let samples = (0..calls)
        .map(|i| {
            let t = Instant::now();
            step(i);
            t.elapsed()
        })
        .collect();
    Figures {
        elapsed: start.elapsed(),
        samples,
        cpu: None,
    }
}

/// Volume ids by name, as CreateVolume answered them.
type Ids = Arc<std::sync::Mutex<HashMap<String, String>>>;

/// Makes 1 MiB volumes `{prefix}-{i}` for i in `0..count` from `clients`
/// callers, each request carrying `secrets`; notes each id in `ids`.
async fn make_volumes(
    c: ControllerClient<Channel>,
    cap: pb::VolumeCapability,
    secrets: HashMap<String, String>,
    ids: Ids,
    (prefix, clients, count): (&'static str, usize, usize),
) -> Figures {
    calls(clients, count, move |i| {
        let (mut c, cap, secrets, ids) = (c.clone(), cap.clone(), secrets.clone(), ids.clone());
        async move {
            let name = format!("{prefix}-{i}");
            let mut req = create_req(&name, MIB, cap);
            req.secrets = secrets;
            let v = c
                .create_volume(req)
                .await
                .expect("CreateVolume")
                .into_inner()
                .volume
                .unwrap();
            ids.lock().unwrap().insert(name, v.volume_id);
        }
    })
    .await
}

/// Deletes volumes `{prefix}-{i}` for i in `which`, one caller, by the ids
/// `ids` noted.
async fn delete_volumes(
    c: ControllerClient<Channel>,
    secrets: HashMap<String, String>,
    ids: Ids,
    prefix: &'static str,
    which: std::ops::Range<usize>,
) -> Figures {
    let first = which.start;
    calls(1, which.len(), move |i| {
        let (mut c, secrets) = (c.clone(), secrets.clone());
        let id = ids.lock().unwrap()[&format!("{prefix}-{}", first + i)].clone();
        async move {
            c.delete_volume(pb::DeleteVolumeRequest {
                volume_id: id,
                secrets,
            })
            .await
            .expect("DeleteVolume");
        }
    })
    .await
}

fn header(title: &str) {
    println!("\n{title}");
    println!(
        "{:<40} {:>10} {:>10} {:>9} {:>9}   {:<34} {:>7}",
        "call", "p50", "p99", "calls/s", "CPU ms", "floor", "ratio"
    );
}

/// One row: the call's figures and, when given, its floor's p50 and the
/// ratio of the p50s.
fn row(name: &str, f: &Figures, floor: Option<(&str, &Figures)>) {
    assert!(!f.samples.is_empty(), "phase {name:?} made no call");
    let (floor_text, ratio) = match floor {
        Some((what, fl)) => (
            format!("{what} {}", ms(fl.pct(0.5))),
            format!(
                "{:.1}x",
                f.pct(0.5).as_secs_f64() / fl.pct(0.5).as_secs_f64().max(1e-9)
            ),
        ),
        None => (String::new(), String::new()),
    };
    println!(
        "{name:<40} {:>10} {:>10} {:>9.1} {:>9}   {floor_text:<34} {ratio:>7}",
        ms(f.pct(0.5)),
        ms(f.pct(0.99)),
        f.rate(),
        cpu_text(f)
    );
}

/// A row for `clients` callers: their rate beside the sequential one.
fn concurrent_row(name: &str, f: &Figures, sequential: &Figures) {
    println!(
        "{name:<40} {:>10} {:>10} {:>9.1} {:>9}   {:<34} {:>7}",
        ms(f.pct(0.5)),
        ms(f.pct(0.99)),
        f.rate(),
        cpu_text(f),
        format!("sequential {:.1} calls/s", sequential.rate()),
        format!("{:.2}x", f.rate() / sequential.rate())
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    require_root();
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this
    // binary without it, as a short smoke run that keeps the code honest.
    let full = std::env::args().any(|a| a == "--bench");
    let n = env_num("FERROVOL_BENCH_CALLS", if full { 40 } else { 4 });
    let existing = env_num("FERROVOL_BENCH_EXISTING", if full { 800 } else { 20 });
    let clients = env_num("FERROVOL_BENCH_CLIENTS", 8);
    // One of them, or several separated by commas.
    let only = std::env::var("FERROVOL_BENCH_ONLY").unwrap_or_default();
    let only: Vec<&str> = only.split(',').filter(|o| !o.is_empty()).collect();
    let all = only.is_empty();
    let only = |name: &str| only.contains(&name);
    if all || only("iscsi") {
        iscsi(n, existing, clients).await;
    }
    if all || only("rbd") || only("cephcsi") {
        rbd(n, existing, clients, only("cephcsi") && !only("rbd"), !full).await;
    }
    // NFS needs the kernel's client and server: the real-kernel guest only
    // (tests/guest/run -- env FERROVOL_IN_GUEST=1 FERROVOL_BENCH_ONLY=nfs
    // target/release/deps/remote-* --bench).
    if only("nfs") {
        nfs_peer().await;
        nfs(n, existing, clients).await;
    }
    // Two nodes: the two-node guest only (remote/failover.rs).
    if only("failover") {
        failover::failover(env_num("FERROVOL_BENCH_FAILOVERS", 10)).await;
    }
    // lvm needs device-mapper: the guest only, as nfs (remote/lvm.rs).
    if only("lvm") {
        lvm::lvm(
            env_num("FERROVOL_BENCH_CALLS", 8),
            env_num("FERROVOL_BENCH_ROUNDS", 2),
        )
        .await;
    }
    // NVMe/TCP needs nvmet and nvme_tcp: the guest only
    // (remote/nvmf_beside.rs: nvmf beside iscsi).
    if only("nvmf") {
        nvmf_beside::nvmf_beside_iscsi(
            env_num("FERROVOL_BENCH_CALLS", 4),
            env_num("FERROVOL_BENCH_ROUNDS", 4),
            env_num("FERROVOL_BENCH_FIO_SECONDS", 10) as u64,
        )
        .await;
    }
    // A login needs iscsi_tcp: the guest only (remote/iscsi_stage.rs).
    if only("iscsi-stage") {
        iscsi_stage::iscsi_stage(
            env_num("FERROVOL_BENCH_CALLS", 4),
            env_num("FERROVOL_BENCH_ROUNDS", 4),
        )
        .await;
    }
}

const INITIATOR: &str = "iqn.2026-11.io.ferrovol.bench";

fn iscsi_config(t: &Tgtd, dir: &std::path::Path) -> String {
    let initiator_file = dir.join("initiatorname.iscsi");
    std::fs::write(&initiator_file, format!("InitiatorName={INITIATOR}:self\n")).unwrap();
    format!(
        "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"iqn.2026-11.io.ferrovol.bench\"\n\
         portals = [\"{}\"]\ncontrol_port = {}\ninitiator_name_file = \"{}\"\n\
         [backend.store]\ntype = \"file\"\npool = \"@DIR@/pool\"\n",
        t.portal(),
        t.control_port,
        initiator_file.display()
    )
}

/// The tools' floor for the iscsi backend: a target and its LUN over a
/// new image file (made and synced as the store makes one), two tgtadm
/// calls; an initiator allowed, one; a target deleted, one.
fn tgt_floor(tgtd: &Tgtd, dir: &Path, base: u32, count: usize) -> (Figures, Figures, Figures) {
    let t = tgtd;
    let made = floor(count, |i| {
        let image = dir.join(format!("{base}-{i}.img"));
        let f = std::fs::File::create(&image).unwrap();
        f.set_len(MIB as u64).unwrap();
        f.sync_all().unwrap();
        let backing = image.to_str().unwrap().to_string();
        let tid = (base + i as u32).to_string();
        t.serve(
            &tid,
            &format!("iqn.2026-11.io.ferrovol.floor:t{tid}"),
            &backing,
        );
    });
    let bound = floor(count, |i| {
        let tid = (base + i as u32).to_string();
        t.tgtadm(&[
            "--op",
            "bind",
            "--mode",
            "target",
            "--tid",
            &tid,
            "-I",
            &format!("{INITIATOR}:floor-{i}"),
        ]);
    });
    let deleted = floor(count, |i| {
        let tid = (base + i as u32).to_string();
        t.tgtadm(&[
            "--op", "delete", "--force", "--mode", "target", "--tid", &tid,
        ]);
    });
    (made, bound, deleted)
}

/// The iscsi rounds' table: [create, publish, delete, create from many
/// callers] beside [the tools' make, bind, delete], per round.
type IscsiRound = (usize, [Figures; 4], [Figures; 3]);

fn print_iscsi(results: &[IscsiRound], clients: usize) {
    // The table's rows: the round with the most volumes there.
    if let Some((round, [created, published, deleted, _], [made, bound, removed])) =
        results.iter().max_by_key(|r| r.0)
    {
        for (call, ours, what, floor) in [
            ("CreateVolume", created, "tgtadm: image, target, LUN", made),
            (
                "ControllerPublishVolume",
                published,
                "tgtadm: ACL bind",
                bound,
            ),
            ("DeleteVolume", deleted, "tgtadm: target delete", removed),
        ] {
            results::record(results::Row {
                backend: "iscsi",
                call: &format!("{call} ({round} volumes there)"),
                unit: "ms",
                better: results::Better::Lower,
                ours: ours.p50_p99(),
                against: what,
                kind: results::Against::Floor,
                theirs: floor.p50_p99(),
            });
        }
    }
    header("iscsi (file store, tgtd on loopback)");
    for (round, [created, published, deleted, together], [made, bound, removed]) in results {
        let with = format!("{round} volumes there");
        row(
            &format!("CreateVolume, {with}"),
            created,
            Some(("image+tgtadm target+LUN", made)),
        );
        row(
            &format!("ControllerPublish, {with}"),
            published,
            Some(("tgtadm ACL bind", bound)),
        );
        row(
            &format!("DeleteVolume, {with}"),
            deleted,
            Some(("tgtadm target delete", removed)),
        );
        concurrent_row(
            &format!("CreateVolume x{clients} callers, {with}"),
            together,
            created,
        );
    }
}

/// The iscsi backend over a file store, against tgtd.
async fn iscsi(n: usize, existing: usize, clients: usize) {
    let tgtd = Arc::new(Tgtd::new());
    let scratch = tempfile::tempdir().unwrap();
    let h = Harness::start_with(Some(&iscsi_config(&tgtd, scratch.path()))).await;
    let cap = mount_cap("ext4", SNW);
    let floor_dir = scratch.path().join("floor");
    std::fs::create_dir_all(&floor_dir).unwrap();

    let ids: Ids = Arc::default();
    let id_of = {
        let ids = ids.clone();
        move |name: String| ids.lock().unwrap()[&name].clone()
    };
    // Makes volumes `{prefix}-{i}` from `clients` callers.
    let create = |prefix: &'static str, clients: usize, count: usize| {
        let run = (prefix, clients, count);
        make_volumes(
            h.controller(),
            cap.clone(),
            HashMap::new(),
            ids.clone(),
            run,
        )
    };
    let publish = |prefix: &'static str, count: usize| {
        let (c, id_of) = (h.controller(), id_of.clone());
        calls(1, count, move |i| {
            let (mut c, id) = (c.clone(), id_of(format!("{prefix}-{i}")));
            async move {
                c.controller_publish_volume(pb::ControllerPublishVolumeRequest {
                    volume_id: id,
                    node_id: format!("node-{i}/{INITIATOR}:node-{i}"),
                    volume_capability: Some(mount_cap("ext4", SNW)),
                    ..Default::default()
                })
                .await
                .expect("ControllerPublishVolume");
            }
        })
    };
    let delete = |prefix: &'static str, count: usize| {
        delete_volumes(
            h.controller(),
            HashMap::new(),
            ids.clone(),
            prefix,
            0..count,
        )
    };
    let mut results = Vec::new();
    for (round, prefix, floor_base) in [(0, "a", 30000u32), (existing, "b", 31000)] {
        if round > 0 {
            // The volumes already there, made by 8 callers.
            let filled = create("fill", clients, existing).await;
            println!(
                "(made {existing} volumes from {clients} callers: {:.1} creates/s)",
                filled.rate()
            );
        }
        let (tgt_made, tgt_bound, tgt_deleted) = tgt_floor(&tgtd, &floor_dir, floor_base, n);
        let (driver, server) = (h.pid(), tgtd.pid());
        let server: &[u32] = match &server {
            Some(p) => std::slice::from_ref(p),
            None => &[],
        };
        let created = with_cpu(driver, server, create(prefix, 1, n)).await;
        let published = with_cpu(driver, server, publish(prefix, n)).await;
        let deleted = with_cpu(driver, server, delete(prefix, n)).await;
        let again = if round == 0 { "c" } else { "d" };
        let together = with_cpu(driver, server, create(again, clients, n * 2)).await;
        results.push((
            round,
            [created, published, deleted, together],
            [tgt_made, tgt_bound, tgt_deleted],
        ));
    }
    print_iscsi(&results, clients);
}

/// The tools' floor for the rbd backend: one rbd process per step, as a
/// user would run it; (create, remove, snapshot).
fn rbd_floor(cluster: &CephCluster, n: usize, snaps: usize) -> (Figures, Figures, Figures) {
    let made = floor(n, |i| {
        cluster.rbd(&["create", &format!("rbd/floor-{i}"), "--size", "1M"]);
    });
    let snapped = floor(snaps, |i| {
        cluster.rbd(&["snap", "create", &format!("rbd/floor-{i}@s")]);
    });
    for i in 0..snaps {
        cluster.rbd(&["snap", "rm", &format!("rbd/floor-{i}@s")]);
    }
    let removed = floor(n, |i| {
        cluster.rbd(&["rm", "--no-progress", &format!("rbd/floor-{i}")]);
    });
    (made, removed, snapped)
}

/// The controller's own user lists volumes (ListVolumes carries no
/// secrets); every other call brings its secrets.
fn rbd_config(cluster: &CephCluster, client: &str) -> String {
    format!("{}client = \"{client}\"\n", cluster.backend_config("bench"))
}

/// The rbd backend against the Ceph fixture, with secrets in every call
/// (the normal deployment), on both of its clients to the cluster: librbd
/// on kept connections, and the rbd command line.
async fn rbd(n: usize, existing: usize, clients: usize, peer_only: bool, smoke: bool) {
    let cluster = Arc::new(CephCluster::new());
    {
        // The level a deployment logs at, as ceph-csi's `--v=0` is
        // (FERROVOL_BENCH_LOG: another).
        let level = std::env::var("FERROVOL_BENCH_LOG").unwrap_or_else(|_| "info".into());
        let h = Harness::start_with_env(
            Some(&rbd_config(&cluster, "librbd")),
            &[("RUST_LOG", &level)],
        )
        .await;
        beside::run(&cluster, &h, smoke).await;
    }
    if peer_only {
        return;
    }
    let secrets = cluster.secrets();
    let snaps = (n / 4).max(2);
    let (made, removed, snapped) = rbd_floor(&cluster, n, snaps);
    let floors = [
        ("rbd create", &made),
        ("rbd rm", &removed),
        ("rbd snap create", &snapped),
    ];
    for client in ["librbd", "cli"] {
        let h = Harness::start_with(Some(&rbd_config(&cluster, client))).await;
        let driver = h.pid();
        let daemons = cluster.pids();
        let phases = RbdPhases {
            h: &h,
            servers: &daemons,
            secrets: &secrets,
            n,
            snaps,
            clients,
        };
        header(&format!(
            "rbd on its {client} client (one monitor, one memstore OSD), 0 volumes"
        ));
        // Names of their own per client: a name made before would be found
        // (an idempotent answer), not made.
        let names = if client == "librbd" {
            ["a", "b", "c"]
        } else {
            ["g", "h", "i"]
        };
        phases.run(driver, names, &floors).await;
        println!(
            "driver memory: {:.1} MiB resident, {:.1} MiB at its peak, {} threads",
            h.status_kb("VmRSS") as f64 / 1024.0,
            h.status_kb("VmHWM") as f64 / 1024.0,
            std::fs::read_dir(format!("/proc/{driver}/task"))
                .map(|d| d.count())
                .unwrap_or(0)
        );
        if client == "librbd" && existing > 0 {
            let ids: Ids = Arc::default();
            let run = ("old", clients, existing);
            make_volumes(
                h.controller(),
                mount_cap("ext4", SNW),
                secrets.clone(),
                ids,
                run,
            )
            .await;
            header(&format!(
                "rbd on its {client} client, {existing} volumes in the pool"
            ));
            phases.run(driver, ["d", "e", "f"], &floors).await;
        }
    }
}

struct RbdPhases<'a> {
    h: &'a Harness,
    /// The Ceph daemons' pids: their CPU is the server's.
    servers: &'a [u32],
    secrets: &'a HashMap<String, String>,
    n: usize,
    snaps: usize,
    clients: usize,
}

impl RbdPhases<'_> {
    /// Creates `n` volumes, snapshots some, deletes the others, then
    /// creates `2n` from `clients` callers; prints each beside its floor.
    async fn run(
        &self,
        driver: u32,
        [first, snap_prefix, again]: [&'static str; 3],
        floors: &[(&str, &Figures); 3],
    ) {
        let (n, snaps) = (self.n, self.snaps);
        let ids: Ids = Arc::default();
        let create = |prefix: &'static str, clients: usize, count: usize| {
            make_volumes(
                self.h.controller(),
                mount_cap("ext4", SNW),
                self.secrets.clone(),
                ids.clone(),
                (prefix, clients, count),
            )
        };
        let created = with_cpu(driver, self.servers, create(first, 1, n)).await;
        let sources: Arc<Vec<String>> = Arc::new(
            (0..snaps)
                .map(|i| ids.lock().unwrap()[&format!("{first}-{i}")].clone())
                .collect(),
        );
        let snapshot = |clients: usize, tag: &'static str| {
            let (c, secrets, sources) =
                (self.h.controller(), self.secrets.clone(), sources.clone());
            with_cpu(
                driver,
                self.servers,
                calls(clients, snaps, move |i| {
                    let (mut c, secrets, source) = (c.clone(), secrets.clone(), sources[i].clone());
                    async move {
                        c.create_snapshot(pb::CreateSnapshotRequest {
                            source_volume_id: source,
                            name: format!("{snap_prefix}-{tag}-{i}"),
                            secrets,
                            ..Default::default()
                        })
                        .await
                        .expect("CreateSnapshot");
                    }
                }),
            )
        };
        let snapshotted = snapshot(1, "snap").await;
        let snapshotted_together = snapshot(self.clients, "many").await;
        let deleted = with_cpu(
            driver,
            self.servers,
            delete_volumes(
                self.h.controller(),
                self.secrets.clone(),
                ids.clone(),
                first,
                snaps..n,
            ),
        )
        .await;
        let together = with_cpu(driver, self.servers, create(again, self.clients, n * 2)).await;
        row("CreateVolume", &created, Some(floors[0]));
        row("DeleteVolume", &deleted, Some(floors[1]));
        row("CreateSnapshot", &snapshotted, Some(floors[2]));
        concurrent_row(
            &format!("CreateVolume x{} callers", self.clients),
            &together,
            &created,
        );
        concurrent_row(
            &format!("CreateSnapshot x{} callers", self.clients),
            &snapshotted_together,
            &snapshotted,
        );
    }
}

/// The nfs backend beside csi-driver-nfs (remote/nfs_beside.rs), on an
/// export of its own.
async fn nfs_peer() {
    let _server = NfsServer::new();
    let h = Harness::start_with(Some(common::fixtures::NFS_LOOPBACK_CONFIG)).await;
    nfs_beside::run(&h).await;
}

/// The tools' floor for the nfs backend: over a mount of the export of
/// its own, a directory and a small record file written and synced (what
/// a volume is on the share), then both removed.
fn nfs_floor(by_hand: &Path, round: usize, count: usize) -> (Figures, Figures) {
    let made = floor(count, |i| {
        let dir = by_hand.join(format!("{round}-{i}"));
        std::fs::create_dir(&dir).unwrap();
        let record = by_hand.join(format!("{round}-{i}.json"));
        let f = std::fs::File::create(&record).unwrap();
        std::io::Write::write_all(&mut &f, b"{}").unwrap();
        f.sync_all().unwrap();
    });
    let removed = floor(count, |i| {
        std::fs::remove_dir(by_hand.join(format!("{round}-{i}"))).unwrap();
        std::fs::remove_file(by_hand.join(format!("{round}-{i}.json"))).unwrap();
    });
    (made, removed)
}

/// The nfs rounds' table: [create, delete, create from many callers]
/// beside [the tools' make, remove], per round.
type NfsRound = (usize, [Figures; 3], [Figures; 2]);

fn print_nfs(results: &[NfsRound], clients: usize) {
    header("nfs (the kernel's nfsd, NFSv4.2, in the guest; CPU: the driver's)");
    for (round, [created, deleted, together], [made, removed]) in results {
        let with = format!("{round} volumes there");
        row(
            &format!("CreateVolume, {with}"),
            created,
            Some(("mkdir + record by hand", made)),
        );
        row(
            &format!("DeleteVolume, {with}"),
            deleted,
            Some(("rmdir + unlink by hand", removed)),
        );
        concurrent_row(
            &format!("CreateVolume x{clients} callers, {with}"),
            together,
            created,
        );
    }
}

/// The nfs backend against the kernel's nfsd, in the guest: volumes are
/// directories with a record each on the export.
async fn nfs(n: usize, existing: usize, clients: usize) {
    let server = NfsServer::new();
    let config = "[[backend]]\ntype = \"nfs\"\n\
        [[backend.export]]\nname = \"main\"\nserver = \"127.0.0.1\"\nshare = \"/\"\nversion = \"4.2\"\n";
    let h = Harness::start_with(Some(config)).await;
    let cap = mount_cap("", 5);
    let ids: Ids = Arc::default();
    let create = |prefix: &'static str, clients: usize, count: usize| {
        let run = (prefix, clients, count);
        make_volumes(
            h.controller(),
            cap.clone(),
            HashMap::new(),
            ids.clone(),
            run,
        )
    };
    let delete = |prefix: &'static str, count: usize| {
        delete_volumes(
            h.controller(),
            HashMap::new(),
            ids.clone(),
            prefix,
            0..count,
        )
    };
    // The floor's own mount of the export.
    let mnt = tempfile::tempdir().unwrap();
    run(
        "mount",
        &[
            "-t",
            "nfs",
            "-o",
            "vers=4.2",
            server.source(),
            mnt.path().to_str().unwrap(),
        ],
    );
    let by_hand = mnt.path().join("floor");
    std::fs::create_dir_all(&by_hand).unwrap();
    let mut results = Vec::new();
    // Volumes on the export: each round leaves its 2n from 8 callers.
    let mut there = 0;
    for (round, fill, prefix, again) in [(10, "fill", "a", "c"), (existing, "more", "b", "d")] {
        if round > there {
            let filled = create(fill, clients, round - there).await;
            println!(
                "(made {} volumes from {clients} callers: {:.1} creates/s)",
                round - there,
                filled.rate()
            );
            there = round;
        }
        there += 2 * n;
        let (made, removed) = nfs_floor(&by_hand, round, n);
        // nfsd's work is the kernel's: not a process to measure.
        let (driver, server): (u32, &[u32]) = (h.pid(), &[]);
        let created = with_cpu(driver, server, create(prefix, 1, n)).await;
        let deleted = with_cpu(driver, server, delete(prefix, n)).await;
        let together = with_cpu(driver, server, create(again, clients, n * 2)).await;
        results.push((round, [created, deleted, together], [made, removed]));
    }
    let _ = std::process::Command::new("umount")
        .arg(mnt.path())
        .status();
    print_nfs(&results, clients);
}
