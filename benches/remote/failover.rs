//! A fenced failover, timed step by step, for the backends that fence a
//! lost node (iscsi, rbd), between the two nodes of the two-node guest:
//!
//!     cargo bench --bench remote --no-run
//!     tests/guest/run --peer -- env FERROVOL_IN_GUEST=1 FERROVOL_BENCH_ONLY=failover \
//!         target/release/deps/remote-<hash> --bench
//!
//! Each round: a volume (ext4, single-node writer) attached to node A (the
//! peer guest), staged, published, and written there without pause. A's
//! guest is frozen: a node that hangs, its connections open and
//! unanswered. Then what the CO does once it declares the node lost (the
//! node out of service, its pods deleted): ControllerUnpublish for A,
//! which fences A before it answers; ControllerPublish to B (this guest);
//! NodeStage and NodePublish on B; the pod's first write on B, synced.
//! Each step is timed, and the whole from the unpublish to the write. A
//! then runs again: its writer fails and none of its writes reach the
//! volume, or the bench stops there (the fence did not hold). A's kubelet
//! tears down what it had, B lets the volume go, and it is deleted.
//!
//! FERROVOL_BENCH_FAILOVERS sets the rounds per backend (10).

use super::beside::pct;
use super::results::record_figure;
use super::two_nodes::{direct_sum, iscsi_config, rbd_configs, AWriter, Nodes, Secrets};
use super::*;
use common::fixtures::{require_guest, Iscsid};
use common::peer::{PeerDriver, MAIN_ADDR};

/// The steps, in the order the CO takes them.
const STEPS: [&str; 5] = [
    "ControllerUnpublish A (fences A)",
    "ControllerPublish B",
    "NodeStage B",
    "NodePublish B",
    "first synced write on B",
];

pub async fn failover(rounds: usize) {
    require_guest();
    {
        let tgtd = Tgtd::on(MAIN_ADDR);
        let _iscsid = Iscsid::new();
        let config = iscsi_config("iqn.2026-11.io.ferrovol.failover", &tgtd);
        let h = Harness::start_with(Some(&config)).await;
        let a = PeerDriver::start(&config, "node-a").await;
        let n = Nodes::new(&h, &a, &Secrets::new()).await;
        rounds_of(&n, "iscsi", rounds).await;
    }
    {
        let cluster = CephCluster::shared();
        let (config, peer_config) = rbd_configs(cluster);
        let h = Harness::start_with(Some(&config)).await;
        let a = PeerDriver::start(&peer_config, "node-a").await;
        let n = Nodes::new(&h, &a, &cluster.secrets()).await;
        rounds_of(&n, "rbd", rounds).await;
    }
}

/// `rounds` failovers of one backend: each step's p50 and worst printed
/// and recorded, and the whole's.
async fn rounds_of(n: &Nodes<'_>, backend: &str, rounds: usize) {
    let cap = mount_cap("ext4", SNW);
    // One column per step, the whole last.
    let mut took: Vec<Vec<Duration>> = vec![Vec::new(); STEPS.len() + 1];
    for round in 1..=rounds {
        let id = n
            .create(&format!("pvc-failover-{round}"), 64 * MIB, &cap)
            .await;
        let ctx = n.attach(&id, &n.node_a, &cap).await;
        let (a_staging, a_target) = n.stage_a(&id, "v", &cap, &ctx).await;
        let writer = AWriter::start(&n.a.peer, &a_target);
        n.a.peer.freeze();

        let staging = n.h.path("kubelet/staging/v");
        let target = n.h.path("kubelet/pods/v");
        std::fs::create_dir_all(&staging).unwrap();
        let began = Instant::now();
        let mut step = Instant::now();
        let mut lap = |took: &mut Vec<Vec<Duration>>, i: usize| {
            took[i].push(step.elapsed());
            step = Instant::now();
        };
        n.detach(&id, &n.node_a).await;
        lap(&mut took, 0);
        let ctx = n.attach(&id, &n.node_b, &cap).await;
        lap(&mut took, 1);
        let stage = pb::NodeStageVolumeRequest {
            publish_context: ctx,
            secrets: n.secrets.clone(),
            ..stage_req(&id, &staging, cap.clone())
        };
        n.h.node().node_stage_volume(stage).await.unwrap();
        lap(&mut took, 2);
        let publish = publish_req(&id, &staging, &target, cap.clone(), false);
        n.h.node().node_publish_volume(publish).await.unwrap();
        lap(&mut took, 3);
        let written = target.join("from-b");
        std::fs::write(&written, b"B took the volume over\n").unwrap();
        std::fs::File::open(&written).unwrap().sync_all().unwrap();
        lap(&mut took, 4);
        took[STEPS.len()].push(began.elapsed());

        let blob = target.join("blob");
        let handed_over = direct_sum(&blob);
        n.a.peer.thaw();
        let since_thaw = writer.fails_or_writes_on();
        assert_eq!(
            direct_sum(&blob),
            handed_over,
            "{backend}, round {round}: A's writes reached the volume after B took it over \
             ({since_thaw} since the thaw)"
        );
        n.unstage_fenced_a(&id, &a_staging, &a_target).await;
        n.nothing_mounted_on_a();
        n.unstage_b(&id, &(staging, target)).await;
        n.detach(&id, &n.node_b).await;
        n.delete(&id).await;
        let whole = took[STEPS.len()].last().unwrap();
        println!(
            "{backend} failover {round}/{rounds}: {whole:.2?} from the unpublish to B's write"
        );
    }
    println!("{backend}: a fenced failover, {rounds} rounds (p50 / worst)");
    let names = STEPS.iter().copied().chain(["whole failover"]);
    for (name, samples) in names.zip(&took) {
        let (p50, worst) = (pct(samples, 0.5), pct(samples, 1.0));
        println!("  {name:<36} {:>12} {:>12}", ms(p50), ms(worst));
        record_figure(backend, &format!("failover: {name}"), p50, worst);
    }
}
