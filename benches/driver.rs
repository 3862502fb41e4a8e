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

#[path = "../tests/common/mod.rs"]
mod common;

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
    let op = Arc::new(op);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut i = 0;
            while Instant::now() < deadline {
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
    if std::env::var("FERROVOL_BENCH_METRICS").as_deref() == Ok("compare") {
        return metrics_compare(
            env_num("FERROVOL_BENCH_SECS", if full { 3 } else { 1 }),
            env_num("FERROVOL_BENCH_CLIENTS", 8) as usize,
            env_num("FERROVOL_BENCH_ROUNDS", if full { 8 } else { 2 }) as usize,
        )
        .await;
    }
    let secs = env_num("FERROVOL_BENCH_SECS", if full { 5 } else { 1 });
    let clients = env_num("FERROVOL_BENCH_CLIENTS", 8) as usize;
    let scale = env_num("FERROVOL_BENCH_MOUNTS", if full { 5000 } else { 200 }) as usize;
    let pool_size = env_num("FERROVOL_BENCH_VOLUMES", if full { 10_000 } else { 300 }) as usize;
    let metrics_port = (env_num("FERROVOL_BENCH_METRICS", 0) == 1).then(free_port);
    let mut h = start_driver(metrics_port).await;
    if let Some(port) = metrics_port {
        println!("metrics on: scraped from 127.0.0.1:{port} every second");
        spawn_scraper(port);
    }
    println!(
        "ferrovol benchmarks: {clients} clients, {secs} s per phase, release build, driver pid {}",
        h.pid()
    );
    println!(
        "idle driver RSS {:.1} MB",
        h.status_kb("VmRSS") as f64 / 1024.0
    );

    // Baseline.
    let base = bind_baseline(h.dir.path(), clients, secs);
    row("baseline: bind mount(2)+umount2(2)", &base, None, None);
    let limit = base.rate();

    // Probe. Each client has its own connection.
    h.reset_peak_rss();
    let mut channels = Vec::new();
    for _ in 0..clients {
        channels.push(connect(&h.socket()).await.expect("a connection per client"));
    }
    let probe = {
        let channels = channels.clone();
        drive(clients, secs, move |c, _| {
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
        .await
    };
    row("Probe", &probe, None, Some(h.status_kb("VmHWM")));

    // Publish + unpublish on one staged volume.
    let (volume_id, staging, cap) = stage_bench_volume(&h).await;
    let pods = h.path("kubelet/pods");
    h.reset_peak_rss();
    let publish = drive(
        clients,
        secs,
        publish_cycle(
            pods.clone(),
            staging.clone(),
            volume_id.clone(),
            cap.clone(),
            channels.clone(),
        ),
    )
    .await;
    row(
        "NodePublish+NodeUnpublish (one volume)",
        &publish,
        Some(limit),
        Some(h.status_kb("VmHWM")),
    );
    let publish_hwm = h.status_kb("VmHWM");
    let shared = vec![h.channel.clone().unwrap(); clients];
    let publish_shared = drive(
        clients,
        secs,
        publish_cycle(
            pods.clone(),
            staging.clone(),
            volume_id.clone(),
            cap.clone(),
            shared,
        ),
    )
    .await;
    row(
        "  the same, all clients on one connection",
        &publish_shared,
        Some(limit),
        None,
    );

    // Full lifecycles.
    h.reset_peak_rss();
    let lifecycle = {
        let channels = channels.clone();
        let root = h.dir.path().to_path_buf();
        drive(clients, secs, move |c, i| {
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
            }
        })
        .await
    };
    row(
        "full lifecycle (create..delete, ext4 mkfs)",
        &lifecycle,
        None,
        Some(h.status_kb("VmHWM")),
    );

    // Scale: publish latency with many mounts on the node.
    let single = |secs| {
        drive(
            1,
            secs,
            publish_cycle(
                pods.clone(),
                staging.clone(),
                volume_id.clone(),
                cap.clone(),
                channels.clone(),
            ),
        )
    };
    let at_zero = single(secs).await;
    let filler = h.path("filler");
    let src = filler.join("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..scale {
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
    let at_scale = single(secs).await;
    for i in 0..scale {
        nix::mount::umount2(&filler.join(format!("m{i}")), nix::mount::MntFlags::empty()).unwrap();
    }
    row(
        "publish+unpublish, 1 client, 0 other mounts",
        &at_zero,
        None,
        None,
    );
    row(
        &format!("publish+unpublish, 1 client, {scale} other mounts"),
        &at_scale,
        None,
        None,
    );
    println!(
        "  p50 latency at {scale} mounts is {:.0}% of that at 0",
        100.0 * at_scale.pct(0.5).as_secs_f64() / at_zero.pct(0.5).as_secs_f64()
    );

    // Restart with many published volumes.
    let targets: Vec<PathBuf> = (0..scale).map(|i| pods.join(format!("many-{i}"))).collect();
    let publish_many = Instant::now();
    {
        let chunks: Vec<Vec<PathBuf>> = targets
            .chunks(scale.div_ceil(clients))
            .map(|c| c.to_vec())
            .collect();
        let mut tasks = Vec::new();
        for (c, chunk) in chunks.into_iter().enumerate() {
            let mut n =
                ferrovol::proto::node_client::NodeClient::new(channels[c % channels.len()].clone());
            let (id, staging, cap) = (volume_id.clone(), staging.clone(), cap.clone());
            tasks.push(tokio::spawn(async move {
                for t in chunk {
                    n.node_publish_volume(publish_req(&id, &staging, &t, cap.clone(), false))
                        .await
                        .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }
    println!(
        "published {scale} targets in {:.1} s",
        publish_many.elapsed().as_secs_f64()
    );
    h.kill();
    let restart = Instant::now();
    h.spawn().await;
    let restart_time = restart.elapsed();
    println!(
        "restart with {scale} published volumes: Probe ready and state reconciled in {} (RSS {:.1} MB)",
        ms(restart_time),
        h.status_kb("VmRSS") as f64 / 1024.0
    );
    {
        let mut n = h.node();
        for t in &targets {
            n.node_unpublish_volume(unpublish_req(&volume_id, t))
                .await
                .unwrap();
        }
    }
    h.node()
        .node_unstage_volume(unstage_req(&volume_id, &staging))
        .await
        .unwrap();

    // A pool that grows: CreateVolume's rate as the pool fills, and a full
    // ListVolumes walk in pages of 100 at the pool's largest. Last, because
    // the filesystem under the pool is busy for a while after thousands of
    // creates and deletes, which would slow every phase after it.
    let mut channels = Vec::new();
    for _ in 0..clients {
        channels.push(connect(&h.socket()).await.expect("a connection per client"));
    }
    let mut made = 0usize;
    let mut create_rates = Vec::new();
    let checkpoints: Vec<usize> = [pool_size / 10, pool_size]
        .into_iter()
        .filter(|n| *n > 0)
        .collect();
    for &upto in &checkpoints {
        let batch = upto - made;
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(made));
        let started = Instant::now();
        let mut tasks = Vec::new();
        for channel in channels.iter().cloned() {
            let next = next.clone();
            tasks.push(tokio::spawn(async move {
                let mut ctl = ferrovol::proto::controller_client::ControllerClient::new(channel);
                let mut samples = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if i >= upto {
                        break;
                    }
                    let t = Instant::now();
                    ctl.create_volume(create_req(
                        &format!("pool-{i:06}"),
                        MIB,
                        mount_cap("ext4", SNW),
                    ))
                    .await
                    .unwrap();
                    samples.push(t.elapsed());
                }
                samples
            }));
        }
        let mut samples = Vec::new();
        for t in tasks {
            samples.extend(t.await.unwrap());
        }
        let f = Figures {
            ops: samples.len(),
            elapsed: started.elapsed(),
            samples,
        };
        assert_eq!(f.ops, batch);
        row(
            &format!("CreateVolume, pool growing to {upto}"),
            &f,
            None,
            None,
        );
        create_rates.push((upto, f.rate()));
        made = upto;
    }
    let walk = |page: i32| {
        let channel = channels[0].clone();
        async move {
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
    };
    let (took, seen, pages) = walk(100).await;
    assert!(
        seen >= pool_size,
        "the walk saw {seen} of {pool_size} volumes"
    );
    println!(
        "ListVolumes walk of {seen} volumes in {pages} pages of 100: {} ({:.3} ms per page)",
        ms(took),
        took.as_secs_f64() * 1000.0 / pages as f64
    );
    let list_walk = (seen, took);
    {
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for channel in channels.iter().cloned() {
            let next = next.clone();
            tasks.push(tokio::spawn(async move {
                let mut ctl = ferrovol::proto::controller_client::ControllerClient::new(channel);
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if i >= made {
                        break;
                    }
                    ctl.delete_volume(pb::DeleteVolumeRequest {
                        volume_id: format!("file:pool-{i:06}"),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }

    println!();
    println!("summary");
    println!("  publish+unpublish: {:.0} cycles/s at {clients} clients ({:.1}% of the bind syscall limit), p99 {}, driver peak RSS {:.1} MB",
        publish.rate(), 100.0 * publish.rate() / limit, ms(publish.pct(0.99)), publish_hwm as f64 / 1024.0);
    println!(
        "  publish+unpublish, all clients on one connection: {:.0} cycles/s",
        publish_shared.rate()
    );
    for (n, rate) in &create_rates {
        println!("  CreateVolume while the pool grows to {n}: {rate:.0}/s");
    }
    println!(
        "  ListVolumes, a whole walk of {} volumes in pages of 100: {}",
        list_walk.0,
        ms(list_walk.1)
    );
    println!("  targets: >= 2000 cycles/s, p99 < 10 ms, peak RSS < 8 MB, latency at {scale} mounts within 20% of 0");
}

/// Publish + unpublish on a staged NFS volume beside the same on a staged
/// file volume, in one driver: publish is a bind mount either way, so the
/// two should match. Needs an NFS server and client: it runs in the
/// real-kernel guest (`tests/guest/bench-nfs`), whose emulated CPU makes
/// the absolute figures small; the ratio is the point.
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

/// The publish phases' volume: created and staged; (id, staging path,
/// capability).
async fn stage_bench_volume(h: &Harness) -> (String, PathBuf, pb::VolumeCapability) {
    let cap = mount_cap("ext4", SNMW);
    let id = h
        .controller()
        .create_volume(create_req("bench-pub", 64 * MIB, cap.clone()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
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
        let target = pods.join(format!("c{c}-{i}"));
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
