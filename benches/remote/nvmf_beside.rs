//! nvmf beside iscsi: the same driver, the same kind of store (image files
//! on one filesystem), the two transports of the export layer. Each side's
//! controller calls (CreateVolume, ControllerPublish, ControllerUnpublish,
//! DeleteVolume), its node's stage and unstage (ext4), and the data path:
//! fio, 4 KiB random reads and random writes (direct I/O, 16 in flight)
//! on a file in the volume's filesystem. NVMe/TCP needs the kernel's nvmet
//! and nvme_tcp, so it runs in the real-kernel guest only:
//!
//!     cargo bench --bench remote --no-run
//!     tests/guest/run -- env FERROVOL_IN_GUEST=1 FERROVOL_BENCH_ONLY=nvmf \
//!         target/release/deps/remote-<hash> --bench
//!
//! FERROVOL_BENCH_CALLS sets the volumes (4 by default here), made, granted,
//! staged, unstaged, released and deleted once a round,
//! FERROVOL_BENCH_ROUNDS the rounds (4): the two sides take turns going
//! first, round by round. FERROVOL_BENCH_FIO_SECONDS (10) is each fio run's
//! length; each side runs each pattern twice, turns alternating.
//!
//! Both targets serve on loopback: tgtd (in user space) and nvmet (in the
//! kernel). Under the guest's emulated CPU the absolute figures are far
//! below a real machine's; the ratios are what the run is for.

use super::results::{record, Against, Better, Row, Value};
use super::*;
use common::fixtures::{require_guest, Iscsid, NvmetPort};

const SIZE: i64 = 64 * MIB;
/// What the nvmf rows are beside.
const ISCSI: &str = "iscsi (tgt, open-iscsi), same store";

/// One side's timings of each step, over every round.
#[derive(Default)]
struct Steps {
    create: Vec<Duration>,
    publish: Vec<Duration>,
    stage: Vec<Duration>,
    unstage: Vec<Duration>,
    unpublish: Vec<Duration>,
    delete: Vec<Duration>,
}

/// One step's timings of a side.
type StepOf = fn(&Steps) -> &Vec<Duration>;

pub async fn nvmf_beside_iscsi(n: usize, rounds: usize, fio_secs: u64) {
    require_guest();
    assert!(
        std::process::Command::new("fio")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "fio is not installed (apt-get install fio)"
    );
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let nvmet = NvmetPort::new("nqn.2026-12.io.ferrovol.bench");
    let config = format!(
        "{}{}",
        tgtd.file_store_config("iqn.2026-12.io.ferrovol.bench"),
        nvmet.file_store_config()
    );
    let h = Harness::start_with(Some(&config)).await;
    let cap = mount_cap("ext4", SNW);

    println!(
        "\nnvmf beside iscsi: controller calls, stage and unstage ({n} volumes, {rounds} rounds, turns alternating; ext4 on {} MiB volumes in file stores)",
        SIZE / MIB
    );
    let mut steps: [Steps; 2] = Default::default();
    let backends = ["iscsi", "nvmf"];
    for r in 0..rounds {
        let order = if r % 2 == 0 { [1, 0] } else { [0, 1] };
        for side in order {
            one_round(
                &h,
                backends[side],
                &format!("r{r}"),
                n,
                &cap,
                &mut steps[side],
            )
            .await;
        }
    }
    header("nvmf beside iscsi, calls");
    let pairs: [(&str, StepOf); 6] = [
        ("CreateVolume", |s| &s.create),
        ("ControllerPublishVolume", |s| &s.publish),
        ("NodeStageVolume", |s| &s.stage),
        ("NodeUnstageVolume", |s| &s.unstage),
        ("ControllerUnpublishVolume", |s| &s.unpublish),
        ("DeleteVolume", |s| &s.delete),
    ];
    for (call, of) in pairs {
        let (ours, theirs) = (Figures::of(of(&steps[1])), Figures::of(of(&steps[0])));
        row(call, &ours, Some(("iscsi", &theirs)));
        record(Row::times(
            "nvmf",
            call,
            ours.p50_p99(),
            ISCSI,
            Against::Peer,
            theirs.p50_p99(),
        ));
    }

    // The data path: one volume each, staged and published; each pattern
    // twice a side.
    let mut staged = Vec::new();
    for b in backends {
        let mut req = create_req(&format!("fio-{b}"), SIZE, cap.clone());
        req.parameters.insert("backend".into(), b.into());
        staged.push(h.provision_attached(req).await);
    }
    println!("\nnvmf beside iscsi: fio, 4 KiB, direct, 16 in flight, {fio_secs} s a run");
    for pattern in ["randread", "randwrite"] {
        let mut iops = [Vec::new(), Vec::new()];
        let mut p99 = [Vec::new(), Vec::new()];
        for turn in 0..4 {
            let side = turn % 2;
            let side = if turn / 2 == 0 { side } else { 1 - side };
            let (i, lat) = fio(&staged[side].target, pattern, fio_secs);
            iops[side].push(i);
            p99[side].push(lat);
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (ours, theirs) = (mean(&iops[1]), mean(&iops[0]));
        let (ours_p99, theirs_p99) = (mean(&p99[1]), mean(&p99[0]));
        println!(
            "  {pattern:<10} nvmf {ours:>8.0} IOPS (p99 {ours_p99:.2} ms)   iscsi {theirs:>8.0} IOPS (p99 {theirs_p99:.2} ms)   nvmf/iscsi {:.2}x",
            ours / theirs
        );
        let call = format!("fio 4k {pattern}, 16 in flight");
        record(Row {
            backend: "nvmf",
            call: &call,
            unit: "IOPS",
            better: Better::Higher,
            ours: Value::one(ours),
            against: ISCSI,
            kind: Against::Peer,
            theirs: Value::one(theirs),
        });
        let call = format!("fio 4k {pattern}, p99 completion");
        record(Row::times(
            "nvmf",
            &call,
            Value::one(ours_p99),
            ISCSI,
            Against::Peer,
            Value::one(theirs_p99),
        ));
    }
    for vol in &staged {
        h.teardown(vol).await;
    }
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    assert!(nvmet.controllers().is_empty(), "the bench left controllers");
    let left: Vec<String> = Iscsid::sessions()
        .into_iter()
        .filter(|s| s.contains("io.ferrovol.bench"))
        .collect();
    assert!(left.is_empty(), "the bench left sessions: {left:?}");
}

/// `n` volumes of `backend` through their whole life, each step timed.
async fn one_round(
    h: &Harness,
    backend: &str,
    tag: &str,
    n: usize,
    cap: &pb::VolumeCapability,
    steps: &mut Steps,
) {
    let mut made = Vec::new();
    for i in 0..n {
        let mut req = create_req(&format!("{backend}-{tag}-{i}"), SIZE, cap.clone());
        req.parameters.insert("backend".into(), backend.into());
        let t = Instant::now();
        let id = h.create(req).await.volume_id;
        steps.create.push(t.elapsed());
        made.push(id);
    }
    let mut staged = Vec::new();
    for id in &made {
        let t = Instant::now();
        let ctx = h.attach_here(id, cap, &HashMap::new()).await;
        steps.publish.push(t.elapsed());
        let staging = h.path(&format!("kubelet/staging/{}", id.replace(':', "-")));
        std::fs::create_dir_all(&staging).unwrap();
        let req = pb::NodeStageVolumeRequest {
            publish_context: ctx,
            ..stage_req(id, &staging, cap.clone())
        };
        let t = Instant::now();
        h.node()
            .node_stage_volume(req)
            .await
            .expect("NodeStageVolume");
        steps.stage.push(t.elapsed());
        staged.push(staging);
    }
    for (id, staging) in made.iter().zip(&staged) {
        let t = Instant::now();
        h.node()
            .node_unstage_volume(unstage_req(id, staging))
            .await
            .expect("NodeUnstageVolume");
        steps.unstage.push(t.elapsed());
        let t = Instant::now();
        h.detach_here(id).await;
        steps.unpublish.push(t.elapsed());
    }
    for id in &made {
        let t = Instant::now();
        h.delete_volume(id).await;
        steps.delete.push(t.elapsed());
    }
}

/// One fio run in `dir`: its IOPS and its p99 completion latency (ms).
fn fio(dir: &Path, pattern: &str, secs: u64) -> (f64, f64) {
    let file = dir.join("fio.dat");
    let out = run(
        "fio",
        &[
            "--name=bench",
            &format!("--filename={}", file.display()),
            "--size=32M",
            "--bs=4k",
            &format!("--rw={pattern}"),
            "--ioengine=libaio",
            "--iodepth=16",
            "--direct=1",
            "--time_based",
            &format!("--runtime={secs}"),
            "--output-format=json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("fio's JSON");
    let side = if pattern.contains("read") {
        "read"
    } else {
        "write"
    };
    let job = &v["jobs"][0][side];
    let iops = job["iops"].as_f64().expect("iops");
    let p99 = job["clat_ns"]["percentile"]["99.000000"]
        .as_f64()
        .unwrap_or(0.0)
        / 1e6;
    (iops, p99)
}
