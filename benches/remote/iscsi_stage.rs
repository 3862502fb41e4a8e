//! The iscsi backend's node side beside the initiator's own work: a
//! NodeStageVolume (the node record, the login, the LUN's disk, its
//! filesystem mounted at the staging path) beside open-iscsi and mount(8)
//! doing the same by hand, and a NodeUnstageVolume beside the unmount, the
//! logout and the node record's removal. A login needs the kernel's
//! iscsi_tcp, so it runs in the real-kernel guest only:
//!
//!     cargo bench --bench remote --no-run
//!     tests/guest/run -- env FERROVOL_IN_GUEST=1 FERROVOL_BENCH_ONLY=iscsi-stage \
//!         target/release/deps/remote-<hash> --bench
//!
//! FERROVOL_BENCH_CALLS sets the volumes (4 by default here), each staged
//! and unstaged once a round, FERROVOL_BENCH_ROUNDS the rounds (4); the
//! driver and the floor take turns going first, round by round.
//!
//! Both sides log in to the same tgtd on loopback, to LUNs of the same
//! size in files on the same filesystem, each already holding its ext4
//! (the driver's volumes are staged and unstaged once before the rounds:
//! their first stage makes the filesystem, which no floor does). The
//! floor waits for the disk the way the driver does, until its device
//! node opens, polling every millisecond.

use super::results::{record, Against, Row};
use super::*;
use common::fixtures::{require_guest, Iscsid};
use std::path::PathBuf;

const SIZE: i64 = 32 * MIB;
const PREFIX: &str = "iqn.2026-12.io.ferrovol.stagebench";

/// The floor's targets: tids far above the driver's.
const FLOOR_TID: usize = 900;

pub async fn iscsi_stage(n: usize, rounds: usize) {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let h = Harness::start_with(Some(&tgtd.file_store_config(PREFIX))).await;
    let cap = mount_cap("ext4", SNW);
    let portal = tgtd.portal();

    // The driver's volumes: made, granted to this node, staged once (the
    // filesystem made) and unstaged.
    let mut ours = Vec::new();
    for i in 0..n {
        let v = h
            .create(create_req(&format!("stage-{i}"), SIZE, cap.clone()))
            .await;
        let ctx = h.attach_here(&v.volume_id, &cap, &HashMap::new()).await;
        let staging = h.path(&format!("kubelet/staging/{i}"));
        std::fs::create_dir_all(&staging).unwrap();
        let req = pb::NodeStageVolumeRequest {
            publish_context: ctx,
            ..stage_req(&v.volume_id, &staging, cap.clone())
        };
        h.node().node_stage_volume(req.clone()).await.unwrap();
        h.node()
            .node_unstage_volume(unstage_req(&v.volume_id, &staging))
            .await
            .unwrap();
        ours.push((v.volume_id, staging, req));
    }

    // The floor's LUNs: a target each, an ext4 in its file, open to any
    // initiator (as the driver's are granted to this node).
    let dir = tempfile::tempdir().unwrap();
    let floor: Vec<Floor> = (0..n)
        .map(|i| {
            let tid = (FLOOR_TID + i).to_string();
            let iqn = format!("{PREFIX}:floor-{i}");
            let image = dir.path().join(format!("floor-{i}.img"));
            std::fs::File::create(&image)
                .unwrap()
                .set_len(SIZE as u64)
                .unwrap();
            run("mkfs.ext4", &["-q", "-F", image.to_str().unwrap()]);
            tgtd.serve(&tid, &iqn, image.to_str().unwrap());
            tgtd.tgtadm(&[
                "--op", "bind", "--mode", "target", "--tid", &tid, "-I", "ALL",
            ]);
            let staging = dir.path().join(format!("staging-{i}"));
            std::fs::create_dir_all(&staging).unwrap();
            Floor {
                disk: PathBuf::from(format!("/dev/disk/by-path/ip-{portal}-iscsi-{iqn}-lun-1")),
                iqn,
                staging,
            }
        })
        .collect();

    println!(
        "\niscsi: NodeStage and NodeUnstage beside open-iscsi and mount by hand ({n} volumes, {rounds} rounds, turns alternating; ext4 on {} MiB LUNs)",
        SIZE / MIB
    );
    let mut pairs: [(Vec<Duration>, Vec<Duration>); 2] = Default::default();
    for r in 0..rounds {
        for side in 0..2 {
            if (side == 0) == (r % 2 == 0) {
                let mut stage = Vec::new();
                for f in &floor {
                    let t = Instant::now();
                    f.stage(&portal);
                    stage.push(t.elapsed());
                }
                let mut unstage = Vec::new();
                for f in &floor {
                    let t = Instant::now();
                    f.unstage(&portal);
                    unstage.push(t.elapsed());
                }
                pairs[0].1.extend(stage);
                pairs[1].1.extend(unstage);
            } else {
                let mut node = h.node();
                for (_, _, req) in &ours {
                    let t = Instant::now();
                    node.node_stage_volume(req.clone())
                        .await
                        .expect("NodeStageVolume");
                    pairs[0].0.push(t.elapsed());
                }
                for (id, staging, _) in &ours {
                    let t = Instant::now();
                    node.node_unstage_volume(unstage_req(id, staging))
                        .await
                        .expect("NodeUnstageVolume");
                    pairs[1].0.push(t.elapsed());
                }
            }
        }
    }

    header("iscsi, the node's stage and unstage");
    let calls = [
        ("NodeStageVolume", "open-iscsi: node record, login, mount"),
        (
            "NodeUnstageVolume",
            "open-iscsi: umount, logout, node record",
        ),
    ];
    for ((call, what), (o, f)) in calls.iter().zip(&pairs) {
        let (ours, floor) = (Figures::of(o), Figures::of(f));
        row(call, &ours, Some((what, &floor)));
        record(Row::times(
            "iscsi",
            call,
            ours.p50_p99(),
            what,
            Against::Floor,
            floor.p50_p99(),
        ));
    }

    // Nothing left: the driver's volumes released and deleted, the
    // floor's targets removed, no session of either.
    for (id, _, _) in &ours {
        h.detach_here(id).await;
        h.controller()
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            })
            .await
            .expect("DeleteVolume");
    }
    for i in 0..n {
        let tid = (FLOOR_TID + i).to_string();
        tgtd.tgtadm(&["--op", "delete", "--mode", "target", "--tid", &tid]);
    }
    let left: Vec<String> = Iscsid::sessions()
        .into_iter()
        .filter(|s| s.contains(PREFIX))
        .collect();
    assert!(left.is_empty(), "the bench left sessions: {left:?}");
}

/// One of the floor's LUNs, staged by hand.
struct Floor {
    iqn: String,
    disk: PathBuf,
    staging: PathBuf,
}

impl Floor {
    /// The node record, the login, the disk once it opens, the mount.
    fn stage(&self, portal: &str) {
        let node = ["-m", "node", "-T", &self.iqn, "-p", portal];
        run("iscsiadm", &[&node[..], &["-o", "new"]].concat());
        run("iscsiadm", &[&node[..], &["--login"]].concat());
        let t = Instant::now();
        while std::fs::File::open(&self.disk).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{} did not open in 60 s",
                self.disk.display()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        run(
            "mount",
            &[
                "-t",
                "ext4",
                self.disk.to_str().unwrap(),
                self.staging.to_str().unwrap(),
            ],
        );
    }

    /// The unmount, the logout, the node record removed.
    fn unstage(&self, portal: &str) {
        run("umount", &[self.staging.to_str().unwrap()]);
        let node = ["-m", "node", "-T", &self.iqn, "-p", portal];
        run("iscsiadm", &[&node[..], &["--logout"]].concat());
        run("iscsiadm", &[&node[..], &["-o", "delete"]].concat());
    }
}
