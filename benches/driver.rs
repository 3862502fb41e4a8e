//! Benchmarks of the real driver over its unix socket, printed as figures
//! and as ratios to the syscall limit measured in the same run.
//!
//!     cargo bench --bench driver            (as root)
//!
//! FERROVOL_BENCH_SECS (default 5) sets each phase's length,
//! FERROVOL_BENCH_CLIENTS (default 8) the concurrency (each client holds
//! its own connection, as kubelet and each sidecar do), FERROVOL_BENCH_MOUNTS
//! (default 5000) the mount scale phases' size, FERROVOL_BENCH_VOLUMES
//! (default 10000) the pool size for the create and list phases.
//! FERROVOL_BENCH_METRICS=1 runs the driver with metrics on (served on a
//! free local port, scraped once a second during the run), to compare.
//! FERROVOL_BENCH_METRICS=compare runs only the publish phase on two
//! drivers side by side, one with metrics (scraped every second) and one
//! without, in alternating rounds (FERROVOL_BENCH_ROUNDS, default 8), and
//! prints each round and the median ratio: the drift of the machine falls
//! on both alike.
//! FERROVOL_BENCH_HOSTPATH=1 runs only the file backend's publish path
//! beside the reference hostpath driver: FERROVOL_BENCH_PAIRS (3000)
//! NodePublish+NodeUnpublish pairs a round from FERROVOL_BENCH_CLIENTS,
//! FERROVOL_BENCH_ROUNDS (3) rounds turning who goes first, each driver's
//! rate, latency and peak RSS.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "results.rs"]
mod results;

use common::*;
use ferrovol::proto as pb;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env_num(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Latency figures over a set of samples.
struct Figures {
    ops: usize,
    elapsed: Duration,
    samples: Vec<Duration>,
}

impl Figures {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }
    fn pct(&self, p: f64) -> Duration {
        let mut s = self.samples.clone();
        s.sort();
        if s.is_empty() {
            return Duration::ZERO;
        }
        s[((s.len() as f64 - 1.0) * p).round() as usize]
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

/// Runs `op` from `clients` concurrent tasks for `secs`, each task getting
/// its index and an iteration counter.
async fn drive<F, Fut>(clients: usize, secs: u64, op: F) -> Figures
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    drive_until(
        clients,
        Until::Deadline(Instant::now() + Duration::from_secs(secs)),
        op,
    )
    .await
}

/// When [`drive_until`]'s tasks stop.
#[derive(Clone, Copy)]
enum Until {
    /// Each task calls until then.
    Deadline(Instant),
    /// The tasks make this many calls in all, each its share.
    Calls(usize),
}

/// Runs `op` from `clients` concurrent tasks until `until`, each task
/// getting its index and an iteration counter; each call's time.
async fn drive_until<F, Fut>(clients: usize, until: Until, op: F) -> Figures
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let more = |i: usize| match until {
                Until::Deadline(d) => Instant::now() < d,
                Until::Calls(n) => i < n / clients + usize::from(c < n % clients),
            };
            let mut samples = Vec::new();
            let mut i = 0;
            while more(i) {
                let t = Instant::now();
                op(c, i).await;
                samples.push(t.elapsed());
                i += 1;
            }
            samples
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await.unwrap());
    }
    Figures {
        ops: samples.len(),
        elapsed: start.elapsed(),
        samples,
    }
}

/// The syscall limit: bind mount + unmount cycles from `threads` threads.
fn bind_baseline(dir: &Path, threads: usize, secs: u64) -> Figures {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let src = dir.join("bind-src");
    std::fs::create_dir_all(&src).unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let src = src.clone();
            let dst = dir.join(format!("bind-dst-{t}"));
            std::fs::create_dir_all(&dst).unwrap();
            std::thread::spawn(move || {
                let mut samples = Vec::new();
                while Instant::now() < deadline {
                    let s = Instant::now();
                    mount(
                        Some(&src),
                        &dst,
                        None::<&str>,
                        MsFlags::MS_BIND,
                        None::<&str>,
                    )
                    .unwrap();
                    umount2(&dst, MntFlags::empty()).unwrap();
                    samples.push(s.elapsed());
                }
                samples
            })
        })
        .collect();
    let samples: Vec<Duration> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    Figures {
        ops: samples.len(),
        elapsed: start.elapsed(),
        samples,
    }
}

fn row(name: &str, f: &Figures, baseline: Option<f64>, rss_kb: Option<u64>) {
    // A phase that completed nothing measured nothing: fail, even in the
    // smoke run.
    assert!(f.ops > 0, "phase {name:?} completed no operation");
    let ratio = baseline
        .map(|b| format!("{:.1}% of syscall limit", 100.0 * f.rate() / b))
        .unwrap_or_default();
    let rss = rss_kb
        .map(|k| format!("peak RSS {:.1} MB", k as f64 / 1024.0))
        .unwrap_or_default();
    println!(
        "{name:<44} {:>10.0} ops/s  p50 {:>10}  p99 {:>10}  {rss:<18} {ratio}",
        f.rate(),
        ms(f.pct(0.50)),
        ms(f.pct(0.99)),
    );
}

/// The run's settings, from the environment.
#[derive(Clone, Copy)]
struct Settings {
    secs: u64,
    clients: usize,
    /// Mounts for the scale phases.
    scale: usize,
    /// Volumes for the pool phases.
    pool_size: usize,
}

impl Settings {
    fn from_env(full: bool) -> Self {
        Self {
            secs: env_num("FERROVOL_BENCH_SECS", if full { 5 } else { 1 }),
            clients: env_num("FERROVOL_BENCH_CLIENTS", 8) as usize,
            scale: env_num("FERROVOL_BENCH_MOUNTS", if full { 5000 } else { 200 }) as usize,
            pool_size: env_num("FERROVOL_BENCH_VOLUMES", if full { 10_000 } else { 300 }) as usize,
        }
    }
}

/// The staged volume the publish phases publish, and a connection per
/// client.
#[derive(Clone)]
struct Staged {
    id: String,
    staging: PathBuf,
    cap: pb::VolumeCapability,
    channels: Vec<tonic::transport::Channel>,
}

impl Staged {
    /// The same with every client on the driver's one shared connection.
    fn on_one_connection(&self, h: &Harness) -> Staged {
        Staged {
            channels: vec![h.channel.clone().unwrap(); self.channels.len()],
            ..self.clone()
        }
    }

    /// Publish+unpublish cycles from `clients` clients for `secs`, at
    /// fresh targets under `pods`.
    async fn cycles(&self, pods: &Path, clients: usize, secs: u64) -> Figures {
        let cycle = publish_cycle(
            pods.to_path_buf(),
            self.staging.clone(),
            self.id.clone(),
            self.cap.clone(),
            self.channels.clone(),
        );
        drive(clients, secs, cycle).await
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this
    // binary without it, as a short smoke run that keeps the code honest.
    let full = std::env::args().any(|a| a == "--bench");
    if std::env::var("FERROVOL_BENCH_NFS").as_deref() == Ok("1") {
        return nfs_phase(
            env_num("FERROVOL_BENCH_SECS", 5),
            env_num("FERROVOL_BENCH_CLIENTS", 8) as usize,
        )
        .await;
    }
    if std::env::var("FERROVOL_BENCH_HOSTPATH").as_deref() == Ok("1") {
        return hostpath_beside(
            env_num("FERROVOL_BENCH_PAIRS", if full { 3000 } else { 80 }) as usize,
            env_num("FERROVOL_BENCH_CLIENTS", 8) as usize,
            env_num("FERROVOL_BENCH_ROUNDS", if full { 3 } else { 1 }) as usize,
        )
        .await;
    }
    if std::env::var("FERROVOL_BENCH_CRYPT").as_deref() == Ok("1") {
        return crypt_phase(env_num("FERROVOL_BENCH_CYCLES", 5) as usize).await;
    }
    if std::env::var("FERROVOL_BENCH_METRICS").as_deref() == Ok("compare") {
        return metrics_compare(
            env_num("FERROVOL_BENCH_SECS", if full { 3 } else { 1 }),
            env_num("FERROVOL_BENCH_CLIENTS", 8) as usize,
            env_num("FERROVOL_BENCH_ROUNDS", if full { 8 } else { 2 }) as usize,
        )
        .await;
    }
    let set = Settings::from_env(full);
    let metrics_port = (env_num("FERROVOL_BENCH_METRICS", 0) == 1).then(free_port);
    let mut h = start_driver(metrics_port).await;
    if let Some(port) = metrics_port {
        println!("metrics on: scraped from 127.0.0.1:{port} every second");
        spawn_scraper(port);
    }
    println!(
        "ferrovol benchmarks: {} clients, {} s per phase, release build, driver pid {}",
        set.clients,
        set.secs,
        h.pid()
    );
    println!(
        "idle driver RSS {:.1} MB",
        h.status_kb("VmRSS") as f64 / 1024.0
    );
    let base = bind_baseline(h.dir.path(), set.clients, set.secs);
    row("baseline: bind mount(2)+umount2(2)", &base, None, None);
    let limit = base.rate();
    let mut channels = Vec::new();
    for _ in 0..set.clients {
        channels.push(connect(&h.socket()).await.expect("a connection per client"));
    }
    let (probe, probe_cpu) = probe_phase(&h, &channels, set).await;
    // A publish+unpublish cycle is two calls: its floor is half the
    // Probe rate, the cost of the gRPC round trips alone.
    let floor = probe.rate() / 2.0;
    let (id, staging, cap) = stage_bench_volume(&h).await;
    let staged = Staged {
        id,
        staging,
        cap,
        channels: channels.clone(),
    };
    let publish = publish_phases(&h, &staged, set, limit, floor).await;
    let lifecycle = lifecycle_phase(&h, &channels, set).await;
    let reference = reference_lifecycles(set).await;
    match &reference {
        Ok(f) => row("  the same on the reference hostpath driver", f, None, None),
        Err(why) => println!("  (no reference run: {why})"),
    }
    scale_phase(&h, &staged, set).await;
    restart_phase(&mut h, &staged, set).await;
    let pool = pool_phases(&h, set).await;
    summary(
        set,
        (floor, probe_cpu),
        &publish,
        (&lifecycle, &reference),
        &pool,
    );
}

/// Probe from every client: the gRPC floor; and the driver's CPU per
/// call (microseconds).
async fn probe_phase(
    h: &Harness,
    channels: &[tonic::transport::Channel],
    set: Settings,
) -> (Figures, f64) {
    h.reset_peak_rss();
    let channels = channels.to_vec();
    let cpu = cpu_of(h.pid());
    let probe = drive(set.clients, set.secs, move |c, _| {
        let mut id = ferrovol::proto::identity_client::IdentityClient::new(channels[c].clone());
        async move {
            let ready = id
                .probe(pb::ProbeRequest {})
                .await
                .unwrap()
                .into_inner()
                .ready;
            assert_eq!(ready, Some(true), "Probe says the driver is not ready");
        }
    })
    .await;
    row("Probe", &probe, None, Some(h.status_kb("VmHWM")));
    let probe_cpu = per_op(cpu_of(h.pid()) - cpu, &probe);
    println!("  driver CPU {probe_cpu:.1} us per call");
    (probe, probe_cpu)
}

/// Microseconds of CPU per operation of a phase.
fn per_op(cpu: Duration, f: &Figures) -> f64 {
    cpu.as_secs_f64() * 1e6 / f.ops.max(1) as f64
}

/// What the publish phases measured.
struct PublishFigures {
    /// Targets on the test folder's filesystem.
    own: Figures,
    /// The driver's CPU per cycle there (microseconds).
    own_cpu: f64,
    /// Targets on a journaled ext4 (kubelet's usual filesystem), when one
    /// could be made.
    journaled: Option<(Figures, String)>,
    /// Targets on tmpfs.
    in_memory: Option<Figures>,
    /// All clients on one connection.
    shared: Figures,
    peak_rss_kb: u64,
}

/// Publish + unpublish on one staged volume: each client on its own
/// connection, then on a journaled ext4, then all on one connection.
async fn publish_phases(
    h: &Harness,
    staged: &Staged,
    set: Settings,
    limit: f64,
    floor: f64,
) -> PublishFigures {
    let share = |f: &Figures| format!("{:.0}% of the gRPC floor", 100.0 * f.rate() / floor);
    h.reset_peak_rss();
    let cpu = cpu_of(h.pid());
    let own = staged
        .cycles(&h.path("kubelet/pods"), set.clients, set.secs)
        .await;
    let own_cpu = per_op(cpu_of(h.pid()) - cpu, &own);
    let peak_rss_kb = h.status_kb("VmHWM");
    row(
        "NodePublish+NodeUnpublish (one volume)",
        &own,
        Some(limit),
        Some(peak_rss_kb),
    );
    println!(
        "  {} (floor: Probe/2 = {floor:.0} cycles/s); driver CPU {own_cpu:.1} us per cycle",
        share(&own)
    );
    let journaled = match ScratchFs::journaled_ext4(&h.path("kubelet/pods-journaled")) {
        Ok(dir) => {
            let f = staged.cycles(&dir.path, set.clients, set.secs).await;
            row(
                "  the same, targets on a journaled ext4",
                &f,
                Some(limit),
                None,
            );
            println!("  {}", share(&f));
            let fs = describe_fs(h.dir.path());
            Some((f, fs))
        }
        Err(e) => {
            println!("  (no journaled ext4 for targets: {e})");
            None
        }
    };
    // Targets on tmpfs: what the driver reaches when making and removing
    // a target costs next to nothing.
    let in_memory = match ScratchFs::tmpfs(&h.path("kubelet/pods-tmpfs")) {
        Ok(dir) => {
            let f = staged.cycles(&dir.path, set.clients, set.secs).await;
            row("  the same, targets on tmpfs", &f, Some(limit), None);
            println!("  {}", share(&f));
            Some(f)
        }
        Err(e) => {
            println!("  (no tmpfs for targets: {e})");
            None
        }
    };
    let shared = staged
        .on_one_connection(h)
        .cycles(&h.path("kubelet/pods"), set.clients, set.secs)
        .await;
    row(
        "  the same, all clients on one connection",
        &shared,
        Some(limit),
        None,
    );
    PublishFigures {
        own,
        own_cpu,
        journaled,
        in_memory,
        shared,
        peak_rss_kb,
    }
}

/// The mount options of the filesystem holding `path`, as the mount table
/// shows them.
fn describe_fs(path: &Path) -> String {
    std::process::Command::new("findmnt")
        .args(["-n", "-o", "FSTYPE,OPTIONS", "-T"])
        .arg(path)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// A filesystem mounted at `path` for the bench's targets: a journaled
/// ext4 in an image file, or a tmpfs; unmounted (and a loop device freed)
/// when dropped.
struct ScratchFs {
    path: PathBuf,
}

fn run_tool(cmd: &mut std::process::Command) -> Result<(), String> {
    match cmd.output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        Err(e) => Err(e.to_string()),
    }
}

impl ScratchFs {
    fn journaled_ext4(path: &Path) -> Result<Self, String> {
        let image = path.with_extension("img");
        std::fs::create_dir_all(path).map_err(|e| e.to_string())?;
        run_tool(
            std::process::Command::new("truncate")
                .args(["-s", "1G"])
                .arg(&image),
        )?;
        run_tool(
            std::process::Command::new("mkfs.ext4")
                .args(["-q", "-F", "-E", "nodiscard"])
                .arg(&image),
        )?;
        run_tool(
            std::process::Command::new("mount")
                .args(["-o", "loop"])
                .arg(&image)
                .arg(path),
        )?;
        Ok(Self {
            path: path.to_path_buf(),
        })
    }

    fn tmpfs(path: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(path).map_err(|e| e.to_string())?;
        run_tool(
            std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=64m", "ferrovol-bench"])
                .arg(path),
        )?;
        Ok(Self {
            path: path.to_path_buf(),
        })
    }
}

impl Drop for ScratchFs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Full lifecycles on ferrovol: create, stage (mkfs), publish, unpublish,
/// unstage, delete.
async fn lifecycle_phase(
    h: &Harness,
    channels: &[tonic::transport::Channel],
    set: Settings,
) -> Figures {
    h.reset_peak_rss();
    let lifecycle = lifecycles(channels, h.dir.path(), set).await;
    row(
        "full lifecycle (create..delete, ext4 mkfs)",
        &lifecycle,
        None,
        Some(h.status_kb("VmHWM")),
    );
    lifecycle
}

/// Full lifecycles from every client for the phase's length, against
/// whichever driver `channels` reach, with staging paths and targets under
/// `root`'s `kubelet/`.
async fn lifecycles(channels: &[tonic::transport::Channel], root: &Path, set: Settings) -> Figures {
    let channels = channels.to_vec();
    let root = root.to_path_buf();
    drive(set.clients, set.secs, move |c, i| {
        let mut ctl =
            ferrovol::proto::controller_client::ControllerClient::new(channels[c].clone());
        let mut n = ferrovol::proto::node_client::NodeClient::new(channels[c].clone());
        let root = root.clone();
        async move {
            let cap = mount_cap("ext4", SNW);
            let name = format!("life-{c}-{i}");
            let v = ctl
                .create_volume(create_req(&name, 16 * MIB, cap.clone()))
                .await
                .unwrap()
                .into_inner()
                .volume
                .unwrap();
            let staging = root.join(format!("kubelet/staging/{name}"));
            std::fs::create_dir_all(&staging).unwrap();
            let target = root.join(format!("kubelet/pods/{name}"));
            n.node_stage_volume(stage_req(&v.volume_id, &staging, cap.clone()))
                .await
                .unwrap();
            n.node_publish_volume(publish_req(&v.volume_id, &staging, &target, cap, false))
                .await
                .unwrap();
            n.node_unpublish_volume(unpublish_req(&v.volume_id, &target))
                .await
                .unwrap();
            n.node_unstage_volume(unstage_req(&v.volume_id, &staging))
                .await
                .unwrap();
            ctl.delete_volume(pb::DeleteVolumeRequest {
                volume_id: v.volume_id,
                ..Default::default()
            })
            .await
            .unwrap();
            let _ = std::fs::remove_dir(&staging);
            // The reference driver leaves its targets behind.
            let _ = std::fs::remove_dir(&target);
        }
    })
    .await
}

/// The reference driver (the hostpath driver from the shared tools),
/// started in `dir` (its state there, the CO's targets' parent made);
/// it, and a connection per client, or why not.
async fn start_reference(
    dir: &Path,
    clients: usize,
) -> Result<(std::process::Child, Vec<tonic::transport::Channel>), String> {
    let tool = std::env::var_os("FERROVOL_REFERENCE_DRIVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/tools/hostpathplugin")
        });
    if !tool.exists() {
        return Err(format!("no reference driver at {}", tool.display()));
    }
    // The CO makes the targets' parent.
    std::fs::create_dir_all(dir.join("kubelet/pods")).map_err(|e| e.to_string())?;
    let socket = dir.join("hp.sock");
    let mut child = std::process::Command::new(&tool)
        .arg(format!("--endpoint=unix://{}", socket.display()))
        .args(["--nodeid=bench", "--v=0"])
        .arg(format!("--statedir={}", dir.join("state").display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("start {}: {e}", tool.display()))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let first = loop {
        match connect(&socket).await {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline && child.try_wait().ok().flatten().is_none() => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the reference driver never answered: {e}"));
            }
        }
    };
    let mut channels = vec![first];
    while channels.len() < clients {
        match connect(&socket).await {
            Ok(c) => channels.push(c),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e.to_string());
            }
        }
    }
    Ok((child, channels))
}

/// The reference driver run beside ferrovol for the same lifecycles: its
/// figures, or why there are none.
async fn reference_lifecycles(set: Settings) -> Result<Figures, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (mut child, channels) = start_reference(dir.path(), set.clients).await?;
    let figures = lifecycles(&channels, dir.path(), set).await;
    let _ = child.kill();
    let _ = child.wait();
    Ok(figures)
}

/// The file backend's publish path beside the reference hostpath driver
/// (`../shared/tools/hostpathplugin`, or FERROVOL_REFERENCE_DRIVER), as a
/// node under kubelet sees them: each driver with one volume made and
/// staged (hostpath: staged when it says it stages), `clients` callers on
/// connections of their own doing `pairs` NodePublish+NodeUnpublish pairs
/// in all, at a fresh target each; `rounds` rounds that turn who goes
/// first. Each driver's pair rate, p50/p99, and peak RSS (VmHWM, reset
/// before the rounds, read from outside at the end).
async fn hostpath_beside(pairs: usize, clients: usize, rounds: usize) {
    let h = start_driver(None).await;
    let (id, staging, cap) = stage_bench_volume(&h).await;
    let mut ours_ch = Vec::new();
    for _ in 0..clients {
        ours_ch.push(connect(&h.socket()).await.unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut child, theirs_ch) = start_reference(dir.path(), clients)
        .await
        .unwrap_or_else(|e| panic!("the reference driver: {e}"));
    let theirs_pid = child.id();
    let mut c = ferrovol::proto::controller_client::ControllerClient::new(theirs_ch[0].clone());
    let mut n = ferrovol::proto::node_client::NodeClient::new(theirs_ch[0].clone());
    let theirs_id = create_bench_volume(&mut c, &cap).await;
    let stages = n
        .node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .iter()
        .any(|c| {
            matches!(
                &c.r#type,
                Some(pb::node_service_capability::Type::Rpc(r))
                    if r.r#type == pb::node_service_capability::rpc::Type::StageUnstageVolume as i32
            )
        });
    let theirs_staging = dir.path().join("kubelet/staging/bench");
    std::fs::create_dir_all(&theirs_staging).unwrap();
    if stages {
        n.node_stage_volume(stage_req(&theirs_id, &theirs_staging, cap.clone()))
            .await
            .unwrap();
    }
    h.reset_peak_rss();
    reset_peak_rss_of(theirs_pid);
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let (mut ours_time, mut theirs_time) = (Duration::ZERO, Duration::ZERO);
    for round in 0..rounds {
        for turn in 0..2 {
            let ferrovol = (round + turn) % 2 == 0;
            let (pods, staging, id, channels) = if ferrovol {
                (
                    h.path(&format!("kubelet/pods/r{round}")),
                    staging.clone(),
                    id.clone(),
                    ours_ch.clone(),
                )
            } else {
                (
                    dir.path().join(format!("kubelet/pods/r{round}")),
                    // A driver that does not stage gets no staging path,
                    // as from kubelet.
                    if stages {
                        theirs_staging.clone()
                    } else {
                        PathBuf::new()
                    },
                    theirs_id.clone(),
                    theirs_ch.clone(),
                )
            };
            std::fs::create_dir_all(&pods).unwrap();
            let f = drive_until(
                clients,
                Until::Calls(pairs),
                publish_cycle(pods.clone(), staging, id, cap.clone(), channels),
            )
            .await;
            std::fs::remove_dir_all(&pods).unwrap();
            let (samples, time) = if ferrovol {
                (&mut ours, &mut ours_time)
            } else {
                (&mut theirs, &mut theirs_time)
            };
            samples.extend(f.samples);
            *time += f.elapsed;
        }
    }
    let (ours_kb, theirs_kb) = (
        h.status_kb("VmHWM"),
        proc_status_kb(theirs_pid, "VmHWM").unwrap_or(0),
    );
    let _ = child.kill();
    let _ = child.wait();
    let fig = |samples: Vec<Duration>, elapsed: Duration| Figures {
        ops: samples.len(),
        elapsed,
        samples,
    };
    let (ours, theirs) = (fig(ours, ours_time), fig(theirs, theirs_time));
    println!(
        "\nfile: the publish path beside the reference hostpath driver; {clients} clients, \
         {pairs} NodePublish+NodeUnpublish pairs a round on one staged volume, {rounds} rounds \
         turning who goes first (hostpath staged: {stages})"
    );
    for (name, f, kb) in [
        ("ferrovol", &ours, ours_kb),
        ("hostpath", &theirs, theirs_kb),
    ] {
        println!(
            "  {name:<9} {:>8.0} pairs/s, p50 {}, p99 {}, peak RSS {:.1} MiB",
            f.rate(),
            ms(f.pct(0.5)),
            ms(f.pct(0.99)),
            kb as f64 / 1024.0
        );
    }
    println!(
        "  ferrovol / hostpath: {:.1}x the pairs per second, {:.2}x the peak RSS",
        ours.rate() / theirs.rate(),
        ours_kb as f64 / theirs_kb.max(1) as f64
    );
    use results::{record, Against, Better, Row, Value};
    record(Row::times(
        "file",
        "NodePublish+NodeUnpublish pair",
        Value::ms(ours.pct(0.5), ours.pct(0.99)),
        "hostpath",
        Against::Peer,
        Value::ms(theirs.pct(0.5), theirs.pct(0.99)),
    ));
    record(Row {
        backend: "file",
        call: &format!("publish pairs/s, {clients} clients"),
        unit: "pairs/s",
        better: Better::Higher,
        ours: Value::one(ours.rate()),
        against: "hostpath",
        kind: Against::Peer,
        theirs: Value::one(theirs.rate()),
    });
    record(Row::peak_rss(
        "file",
        ours_kb as f64 / 1024.0,
        "hostpath",
        theirs_kb as f64 / 1024.0,
    ));
}

/// Publish latency from one client with no other mounts on the node, and
/// with `scale` of them.
async fn scale_phase(h: &Harness, staged: &Staged, set: Settings) {
    let pods = h.path("kubelet/pods");
    let at_zero = staged.cycles(&pods, 1, set.secs).await;
    let filler = h.path("filler");
    let src = filler.join("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..set.scale {
        let d = filler.join(format!("m{i}"));
        std::fs::create_dir_all(&d).unwrap();
        nix::mount::mount(
            Some(&src),
            &d,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .unwrap();
    }
    let at_scale = staged.cycles(&pods, 1, set.secs).await;
    for i in 0..set.scale {
        nix::mount::umount2(&filler.join(format!("m{i}")), nix::mount::MntFlags::empty()).unwrap();
    }
    row(
        "publish+unpublish, 1 client, 0 other mounts",
        &at_zero,
        None,
        None,
    );
    row(
        &format!("publish+unpublish, 1 client, {} other mounts", set.scale),
        &at_scale,
        None,
        None,
    );
    println!(
        "  p50 latency at {} mounts is {:.0}% of that at 0",
        set.scale,
        100.0 * at_scale.pct(0.5).as_secs_f64() / at_zero.pct(0.5).as_secs_f64()
    );
}

/// A restart with `scale` published volumes: the time until Probe is
/// ready and the state reconciled.
async fn restart_phase(h: &mut Harness, staged: &Staged, set: Settings) {
    let pods = h.path("kubelet/pods");
    let targets: Vec<PathBuf> = (0..set.scale)
        .map(|i| pods.join(format!("many-{i}")))
        .collect();
    let publish_many = Instant::now();
    let mut tasks = Vec::new();
    for (c, chunk) in targets.chunks(set.scale.div_ceil(set.clients)).enumerate() {
        let channel = staged.channels[c % staged.channels.len()].clone();
        let mut n = ferrovol::proto::node_client::NodeClient::new(channel);
        let (chunk, s) = (chunk.to_vec(), staged.clone());
        tasks.push(tokio::spawn(async move {
            for t in chunk {
                n.node_publish_volume(publish_req(&s.id, &s.staging, &t, s.cap.clone(), false))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    println!(
        "published {} targets in {:.1} s",
        set.scale,
        publish_many.elapsed().as_secs_f64()
    );
    h.kill();
    let restart = Instant::now();
    h.spawn().await;
    println!(
        "restart with {} published volumes: Probe ready and state reconciled in {} (RSS {:.1} MB)",
        set.scale,
        ms(restart.elapsed()),
        h.status_kb("VmRSS") as f64 / 1024.0
    );
    let mut n = h.node();
    for t in &targets {
        n.node_unpublish_volume(unpublish_req(&staged.id, t))
            .await
            .unwrap();
    }
    n.node_unstage_volume(unstage_req(&staged.id, &staged.staging))
        .await
        .unwrap();
}

/// What the pool phases measured: creates per second as the pool grew (to
/// each size), and a whole ListVolumes walk (volumes, time).
struct PoolFigures {
    create_rates: Vec<(usize, f64)>,
    walk: (usize, Duration),
}

/// A pool that grows: CreateVolume's rate as the pool fills, and a full
/// ListVolumes walk in pages of 100 at the pool's largest. Last, because
/// the filesystem under the pool is busy for a while after thousands of
/// creates and deletes, which would slow every phase after it.
async fn pool_phases(h: &Harness, set: Settings) -> PoolFigures {
    let mut channels = Vec::new();
    for _ in 0..set.clients {
        channels.push(connect(&h.socket()).await.expect("a connection per client"));
    }
    let mut made = 0usize;
    let mut create_rates = Vec::new();
    for upto in [set.pool_size / 10, set.pool_size] {
        if upto <= made {
            continue;
        }
        let f = create_pool(&channels, made, upto).await;
        row(
            &format!("CreateVolume, pool growing to {upto}"),
            &f,
            None,
            None,
        );
        create_rates.push((upto, f.rate()));
        made = upto;
    }
    let (took, seen, pages) = list_walk(channels[0].clone(), 100).await;
    assert!(
        seen >= set.pool_size,
        "the walk saw {seen} of {} volumes",
        set.pool_size
    );
    println!(
        "ListVolumes walk of {seen} volumes in {pages} pages of 100: {} ({:.3} ms per page)",
        ms(took),
        took.as_secs_f64() * 1000.0 / pages as f64
    );
    on_every_client(&channels, 0, made, |mut ctl, i| async move {
        ctl.delete_volume(pb::DeleteVolumeRequest {
            volume_id: format!("file:pool-{i:06}"),
            ..Default::default()
        })
        .await
        .unwrap();
    })
    .await;
    PoolFigures {
        create_rates,
        walk: (seen, took),
    }
}

/// Runs `op(client, i)` for every i in `from..upto`, the clients taking
/// the next i in turn; each call's latency.
async fn on_every_client<F, Fut>(
    channels: &[tonic::transport::Channel],
    from: usize,
    upto: usize,
    op: F,
) -> Vec<Duration>
where
    F: Fn(
            ferrovol::proto::controller_client::ControllerClient<tonic::transport::Channel>,
            usize,
        ) -> Fut
        + Send
        + Sync
        + Clone
        + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(from));
    let mut tasks = Vec::new();
    for channel in channels.iter().cloned() {
        let (next, op) = (next.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            let ctl = ferrovol::proto::controller_client::ControllerClient::new(channel);
            let mut samples = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= upto {
                    break;
                }
                let t = Instant::now();
                op(ctl.clone(), i).await;
                samples.push(t.elapsed());
            }
            samples
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await.unwrap());
    }
    samples
}

/// Creates pool volumes `from..upto` from every client.
async fn create_pool(channels: &[tonic::transport::Channel], from: usize, upto: usize) -> Figures {
    let started = Instant::now();
    let samples = on_every_client(channels, from, upto, |mut ctl, i| async move {
        ctl.create_volume(create_req(
            &format!("pool-{i:06}"),
            MIB,
            mount_cap("ext4", SNW),
        ))
        .await
        .unwrap();
    })
    .await;
    assert_eq!(samples.len(), upto - from);
    Figures {
        ops: samples.len(),
        elapsed: started.elapsed(),
        samples,
    }
}

/// A whole ListVolumes walk in pages of `page`: (time, volumes, pages).
async fn list_walk(channel: tonic::transport::Channel, page: i32) -> (Duration, usize, usize) {
    let mut ctl = ferrovol::proto::controller_client::ControllerClient::new(channel);
    let started = Instant::now();
    let (mut token, mut seen, mut pages) = (String::new(), 0usize, 0usize);
    loop {
        let r = ctl
            .list_volumes(pb::ListVolumesRequest {
                max_entries: page,
                starting_token: token,
            })
            .await
            .unwrap()
            .into_inner();
        seen += r.entries.len();
        pages += 1;
        if r.next_token.is_empty() {
            break;
        }
        token = r.next_token;
    }
    (started.elapsed(), seen, pages)
}

fn summary(
    set: Settings,
    (floor, probe_cpu): (f64, f64),
    publish: &PublishFigures,
    (lifecycle, reference): (&Figures, &Result<Figures, String>),
    pool: &PoolFigures,
) {
    let clients = set.clients;
    println!();
    println!("summary");
    println!(
        "  gRPC floor (Probe rate / 2, the round trips of a cycle alone): {floor:.0} cycles/s"
    );
    println!(
        "  publish+unpublish: {:.0} cycles/s at {clients} clients, {:.0}% of the floor, p99 {}, driver peak RSS {:.1} MB",
        publish.own.rate(),
        100.0 * publish.own.rate() / floor,
        ms(publish.own.pct(0.99)),
        publish.peak_rss_kb as f64 / 1024.0
    );
    println!(
        "  driver CPU per publish+unpublish cycle: {:.1} us, {:.1}x the {:.1} us of two Probes",
        publish.own_cpu,
        publish.own_cpu / (2.0 * probe_cpu),
        2.0 * probe_cpu
    );
    if let Some((f, fs)) = &publish.journaled {
        println!(
            "  publish+unpublish, targets on a journaled ext4: {:.0} cycles/s, {:.0}% of the floor, p99 {} (the test folder's filesystem: {fs})",
            f.rate(),
            100.0 * f.rate() / floor,
            ms(f.pct(0.99))
        );
    }
    if let Some(f) = &publish.in_memory {
        println!(
            "  publish+unpublish, targets on tmpfs: {:.0} cycles/s, {:.0}% of the floor, p99 {}",
            f.rate(),
            100.0 * f.rate() / floor,
            ms(f.pct(0.99))
        );
    }
    println!(
        "  publish+unpublish, all clients on one connection: {:.0} cycles/s",
        publish.shared.rate()
    );
    println!(
        "  full lifecycle: {:.1}/s, p99 {}",
        lifecycle.rate(),
        ms(lifecycle.pct(0.99))
    );
    if let Ok(r) = reference {
        println!(
            "  the reference hostpath driver: {:.1}/s, p99 {}: ferrovol runs {:.2}x its rate, at {:.2}x its p99",
            r.rate(),
            ms(r.pct(0.99)),
            lifecycle.rate() / r.rate(),
            lifecycle.pct(0.99).as_secs_f64() / r.pct(0.99).as_secs_f64()
        );
    }
    for (n, rate) in &pool.create_rates {
        println!("  CreateVolume while the pool grows to {n}: {rate:.0}/s");
    }
    println!(
        "  ListVolumes, a whole walk of {} volumes in pages of 100: {}",
        pool.walk.0,
        ms(pool.walk.1)
    );
    println!(
        "  targets: publish+unpublish >= 50% of the floor, p99 < 10 ms, peak RSS < 8 MB, latency at {} mounts within 20% of 0; lifecycle >= 2x the reference's rate at a p99 no worse",
        set.scale
    );
}

/// Starts the driver, quiet, with metrics on `metrics_port` if given.
async fn start_driver(metrics_port: Option<u16>) -> Harness {
    let addr = metrics_port.map(|p| format!("127.0.0.1:{p}"));
    let mut env = vec![("RUST_LOG", "warn")];
    if let Some(a) = &addr {
        env.push(("FERROVOL_METRICS_ADDR", a.as_str()));
    }
    Harness::start_with_env(None, &env).await
}

/// Scrapes `/metrics` every second, as Prometheus would; counts the
/// answers that carry the driver's metrics.
fn spawn_scraper(port: u16) -> Arc<std::sync::atomic::AtomicUsize> {
    let scrapes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = scrapes.clone();
    std::thread::spawn(move || loop {
        if let Ok((200, body)) = http_get(port, "/metrics") {
            if body.contains("ferrovol_rpcs_total") {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    });
    scrapes
}

/// The publish phases' volume (64 MiB, `cap`) made through `c`, ours or
/// the reference driver's: its id.
async fn create_bench_volume(
    c: &mut ferrovol::proto::controller_client::ControllerClient<tonic::transport::Channel>,
    cap: &pb::VolumeCapability,
) -> String {
    c.create_volume(create_req("bench-pub", 64 * MIB, cap.clone()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id
}

/// The publish phases' volume: created and staged; (id, staging path,
/// capability).
async fn stage_bench_volume(h: &Harness) -> (String, PathBuf, pb::VolumeCapability) {
    let cap = mount_cap("ext4", SNMW);
    let id = create_bench_volume(&mut h.controller(), &cap).await;
    let staging = h.path("kubelet/staging/bench");
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(stage_req(&id, &staging, cap.clone()))
        .await
        .unwrap();
    (id, staging, cap)
}

/// One publish+unpublish cycle per call, client `c` on its own
/// connection, each at a fresh target under `pods`.
fn publish_cycle(
    pods: PathBuf,
    staging: PathBuf,
    id: String,
    cap: pb::VolumeCapability,
    channels: Vec<tonic::transport::Channel>,
) -> impl Fn(usize, usize) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
       + Send
       + Sync
       + 'static {
    move |c: usize, i: usize| {
        let mut n = ferrovol::proto::node_client::NodeClient::new(channels[c].clone());
        // Each client's targets under a folder of its own, as each pod's
        // are under kubelet (publishes into one shared folder contend for
        // its lock, a cost of the bench's layout, not of the driver).
        let parent = pods.join(format!("c{c}"));
        if i == 0 {
            std::fs::create_dir_all(&parent).unwrap();
        }
        let target = parent.join(format!("{i}"));
        let (id, staging, cap) = (id.clone(), staging.clone(), cap.clone());
        Box::pin(async move {
            n.node_publish_volume(publish_req(&id, &staging, &target, cap, false))
                .await
                .unwrap();
            n.node_unpublish_volume(unpublish_req(&id, &target))
                .await
                .unwrap();
        })
    }
}

/// One driver of the metrics comparison, with one staged volume and a
/// connection per client.
struct PublishRig {
    h: Harness,
    id: String,
    staging: PathBuf,
    cap: pb::VolumeCapability,
    channels: Vec<tonic::transport::Channel>,
    round: usize,
}

impl PublishRig {
    async fn start(clients: usize, metrics_port: Option<u16>) -> Self {
        let h = start_driver(metrics_port).await;
        let (id, staging, cap) = stage_bench_volume(&h).await;
        let mut channels = Vec::new();
        for _ in 0..clients {
            channels.push(connect(&h.socket()).await.unwrap());
        }
        Self {
            h,
            id,
            staging,
            cap,
            channels,
            round: 0,
        }
    }

    /// Publish+unpublish cycles for `secs`; cycles per second.
    async fn round(&mut self, secs: u64) -> f64 {
        self.round += 1;
        let pods = self.h.path(&format!("kubelet/pods/r{}", self.round));
        std::fs::create_dir_all(&pods).unwrap();
        let (id, staging, cap, channels) = (
            self.id.clone(),
            self.staging.clone(),
            self.cap.clone(),
            self.channels.clone(),
        );
        let clients = channels.len();
        let rate = drive(
            clients,
            secs,
            publish_cycle(pods.clone(), staging, id, cap, channels),
        )
        .await
        .rate();
        // Empty targets left behind would slow later rounds down.
        std::fs::remove_dir_all(pods).unwrap();
        rate
    }
}

/// Publish cycles/s with and without metrics, in alternating rounds on two
/// drivers that run side by side (the idle one costs nothing).
async fn metrics_compare(secs: u64, clients: usize, rounds: usize) {
    let port = free_port();
    let mut off = PublishRig::start(clients, None).await;
    let mut on = PublishRig::start(clients, Some(port)).await;
    let scrapes = spawn_scraper(port);
    println!(
        "metrics on vs off: publish+unpublish cycles/s, {clients} clients, {secs} s rounds, alternating"
    );
    // A warm-up round each, not counted.
    off.round(1).await;
    on.round(1).await;
    let mut ratios = Vec::new();
    let (mut sum_off, mut sum_on) = (0.0, 0.0);
    for r in 0..rounds {
        // Alternate which goes first, so neither always runs warm.
        let (a, b) = if r % 2 == 0 {
            let a = off.round(secs).await;
            (a, on.round(secs).await)
        } else {
            let b = on.round(secs).await;
            (off.round(secs).await, b)
        };
        sum_off += a;
        sum_on += b;
        ratios.push(b / a);
        println!(
            "  round {}: off {a:>8.0}  on {b:>8.0}  on/off {:.3}",
            r + 1,
            b / a
        );
    }
    ratios.sort_by(|x, y| x.partial_cmp(y).unwrap());
    let median = ratios[ratios.len() / 2];
    println!(
        "  mean off {:.0}, mean on {:.0}; median on/off {median:.3} ({:+.1}%); {} scrapes answered",
        sum_off / rounds as f64,
        sum_on / rounds as f64,
        (median - 1.0) * 100.0,
        scrapes.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(
        scrapes.load(std::sync::atomic::Ordering::Relaxed) > 0 || rounds * secs as usize <= 1,
        "the metrics endpoint was never scraped"
    );
}

/// Publish + unpublish on a staged NFS volume beside the same on a staged
/// file volume, in one driver: publish is a bind mount either way, so the
/// two should match. Needs an NFS server and client: it runs in the
/// real-kernel guest (`tests/guest/bench-nfs`), whose emulated CPU makes
/// the absolute figures small; the ratio is the point.
async fn nfs_phase(secs: u64, clients: usize) {
    common::fixtures::require_guest();
    let server = common::fixtures::NfsServer::new();
    let config = "[[backend]]\ntype = \"file\"\n\
        pool = \"@DIR@/pool\"\n\
        [[backend]]\ntype = \"nfs\"\n\
        [[backend.export]]\nname = \"main\"\nserver = \"127.0.0.1\"\nshare = \"/\"\n";
    let h = Harness::start_with_env(Some(config), &[("RUST_LOG", "warn")]).await;
    let mut channels = Vec::new();
    for _ in 0..clients {
        channels.push(connect(&h.socket()).await.unwrap());
    }
    println!("ferrovol nfs benchmark (in the guest): {clients} clients, {secs} s per phase");
    let mut rates = Vec::new();
    for (backend, fs, mode) in [("file", "ext4", SNMW), ("nfs", "nfs", 5)] {
        let cap = mount_cap(fs, mode);
        let mut req = create_req(&format!("bench-{backend}"), 64 * MIB, cap.clone());
        req.parameters.insert("backend".into(), backend.into());
        let vol = h
            .controller()
            .create_volume(req)
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let staging = h.path(&format!("kubelet/staging/{backend}"));
        std::fs::create_dir_all(&staging).unwrap();
        h.node()
            .node_stage_volume(stage_req(&vol.volume_id, &staging, cap.clone()))
            .await
            .unwrap();
        let (pods, id, chans) = (
            h.path("kubelet/pods"),
            vol.volume_id.clone(),
            channels.clone(),
        );
        let f = drive(clients, secs, move |c, i| {
            let mut n = ferrovol::proto::node_client::NodeClient::new(chans[c].clone());
            let target = pods.join(format!("{c}-{i}"));
            let (id, staging, cap) = (id.clone(), staging.clone(), cap.clone());
            async move {
                n.node_publish_volume(publish_req(&id, &staging, &target, cap, false))
                    .await
                    .unwrap();
                n.node_unpublish_volume(unpublish_req(&id, &target))
                    .await
                    .unwrap();
            }
        })
        .await;
        row(
            &format!("publish+unpublish, staged {backend} volume"),
            &f,
            None,
            None,
        );
        rates.push(f.rate());
        h.node()
            .node_unstage_volume(unstage_req(
                &vol.volume_id,
                &h.path(&format!("kubelet/staging/{backend}")),
            ))
            .await
            .unwrap();
    }
    println!(
        "  nfs publish cycles run at {:.0}% of the file backend's",
        100.0 * rates[1] / rates[0]
    );
    // The driver (and its mounts of the share) go before the server.
    drop(h);
    drop(server);
}

/// The cost of LUKS2 encryption on each block backend, one driver serving
/// file, lvm, iscsi (file store, tgtd) and rbd: the whole node cycle
/// (NodeStage, NodePublish, NodeUnpublish, NodeUnstage; encryption opens
/// and closes the mapping in it) and a sequential write of 256 MiB through
/// the mounted filesystem (`dd bs=1M oflag=direct conv=fsync`), on a
/// volume of each backend with and without encryption. Needs dm-crypt: it
/// runs in the real-kernel guest (`tests/guest/bench-crypt`), whose
/// emulated CPU makes key derivation and the cipher slow; the ratios are
/// the point.
async fn crypt_phase(cycles: usize) {
    use common::fixtures::{CephCluster, Iscsid, LvmVg, Tgtd};
    common::fixtures::require_guest();
    let _vg = LvmVg::new("fvbench", 1024);
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let cluster = CephCluster::new();
    let config = common::fixtures::block_backends_config(
        "fvbench",
        &tgtd,
        "iqn.2026-11.io.ferrovol.bench",
        &cluster,
    );
    let h = Harness::start_with_env(Some(&config), &[("RUST_LOG", "warn")]).await;
    let node = h.node_id().await;
    println!("ferrovol encryption benchmark (in the guest): {cycles} node cycles, dd 256 MiB");
    println!(
        "  {:<7} {:>14} {:>14} {:>8} {:>12} {:>12} {:>8}",
        "backend", "cycle plain", "cycle LUKS2", "ratio", "dd plain", "dd LUKS2", "ratio"
    );
    for (backend, attach) in [
        ("file", false),
        ("lvm", false),
        ("iscsi", true),
        ("rbd", true),
    ] {
        let mut cycle = Vec::new();
        let mut dd = Vec::new();
        for encrypted in [false, true] {
            let name = format!("bench-{backend}-{encrypted}");
            let cap = mount_cap("ext4", SNW);
            let mut secrets = cluster.secrets();
            secrets.insert("encryptionPassphrase".into(), "bench passphrase".into());
            let mut req = create_req(&name, 320 * MIB, cap.clone());
            req.parameters.insert("backend".into(), backend.into());
            if encrypted {
                req.parameters.insert("encrypted".into(), "true".into());
            }
            req.secrets = secrets.clone();
            let volume = h
                .controller()
                .create_volume(req)
                .await
                .unwrap()
                .into_inner()
                .volume
                .unwrap();
            let (id, volume_context) = (volume.volume_id, volume.volume_context);
            let ctx = match attach {
                true => h.attach_here(&id, &cap, &secrets).await,
                false => std::collections::HashMap::new(),
            };
            let staging = h.path(&format!("kubelet/staging/{name}"));
            let target = h.path(&format!("kubelet/pods/{name}"));
            std::fs::create_dir_all(&staging).unwrap();
            let stage = pb::NodeStageVolumeRequest {
                secrets: secrets.clone(),
                publish_context: ctx,
                volume_context,
                ..stage_req(&id, &staging, cap.clone())
            };
            // The first stage formats (LUKS2 and ext4): not timed.
            h.node().node_stage_volume(stage.clone()).await.unwrap();
            h.node()
                .node_unstage_volume(unstage_req(&id, &staging))
                .await
                .unwrap();
            let start = Instant::now();
            for _ in 0..cycles {
                h.node().node_stage_volume(stage.clone()).await.unwrap();
                h.node()
                    .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
                    .await
                    .unwrap();
                h.node()
                    .node_unpublish_volume(unpublish_req(&id, &target))
                    .await
                    .unwrap();
                h.node()
                    .node_unstage_volume(unstage_req(&id, &staging))
                    .await
                    .unwrap();
            }
            cycle.push(start.elapsed() / cycles as u32);
            h.node().node_stage_volume(stage.clone()).await.unwrap();
            h.node()
                .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
                .await
                .unwrap();
            let start = Instant::now();
            run_tool(
                std::process::Command::new("dd")
                    .arg("if=/dev/zero")
                    .arg(format!("of={}", target.join("dd.bin").display()))
                    .args(["bs=1M", "count=256", "oflag=direct", "conv=fsync"]),
            )
            .unwrap();
            dd.push(256.0 / start.elapsed().as_secs_f64());
            h.node()
                .node_unpublish_volume(unpublish_req(&id, &target))
                .await
                .unwrap();
            h.node()
                .node_unstage_volume(unstage_req(&id, &staging))
                .await
                .unwrap();
            if attach {
                h.controller()
                    .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                        volume_id: id.clone(),
                        node_id: node.clone(),
                        secrets: secrets.clone(),
                    })
                    .await
                    .unwrap();
            }
            h.controller()
                .delete_volume(pb::DeleteVolumeRequest {
                    volume_id: id,
                    secrets,
                })
                .await
                .unwrap();
        }
        println!(
            "  {:<7} {:>14} {:>14} {:>7.2}x {:>8.1} MB/s {:>8.1} MB/s {:>7.2}x",
            backend,
            ms(cycle[0]),
            ms(cycle[1]),
            cycle[1].as_secs_f64() / cycle[0].as_secs_f64(),
            dd[0],
            dd[1],
            dd[0] / dd[1],
        );
    }
    drop(h);
}
