//! The lvm backend's controller calls beside their floor: the bare lvm
//! commands that do the same work, run by hand in the same run on the
//! same volume group. Device-mapper is needed, so it runs in the
//! real-kernel guest only:
//!
//!     cargo bench --bench remote --no-run
//!     tests/guest/run -- env FERROVOL_IN_GUEST=1 FERROVOL_BENCH_ONLY=lvm \
//!         target/release/deps/remote-<hash> --bench
//!
//! FERROVOL_BENCH_CALLS sets the calls per phase and round (8 by default
//! here), FERROVOL_BENCH_ROUNDS the rounds (2), FERROVOL_BENCH_LVM_LIBRARY=0
//! turns the driver's `lvm_library` off (lvm processes, not its helpers);
//! the driver and the floor take turns going first, round by round, in
//! every phase.
//!
//! The floor of each call, for each class:
//! - CreateVolume: one `lvcreate` of the same size and type, left
//!   inactive as the driver leaves it (thick: no zeroing or wiping of the
//!   start, as the driver asks; thin: in the class's pool);
//! - ControllerExpandVolume: one `lvextend`;
//! - CreateSnapshot: one `lvcreate -s` (thick: a copy-on-write area of
//!   the size the class gives, half the origin here);
//! - DeleteSnapshot and DeleteVolume: one `lvremove` (thin), and for a
//!   thick class, which zeroes what it frees (`zero_on_delete`, the
//!   default), the same zeroing by hand first: a classic snapshot split
//!   from its origin, the LV activated, `blkdiscard --zeroout`.

use super::results::{record, Against, Row};
use super::*;
use common::fixtures::{require_guest, LvmVg};

const VG: &str = "fvbench";
const SIZE: i64 = 8 * MIB;
const GROWN: i64 = 16 * MIB;

/// One call's samples for the driver and for its floor, over all rounds.
#[derive(Default)]
struct Pair {
    ours: Vec<Duration>,
    floor: Vec<Duration>,
    ours_time: Duration,
    floor_time: Duration,
}

impl Pair {
    fn figures(samples: &[Duration], elapsed: Duration) -> Figures {
        Figures {
            elapsed,
            samples: samples.to_vec(),
            cpu: None,
        }
    }
}

/// `n` calls of `op(i)` in a row, each timed.
async fn timed(n: usize, mut op: impl AsyncFnMut(usize)) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        op(i).await;
        out.push(t.elapsed());
    }
    out
}

fn lvm_floor(vg: &LvmVg, n: usize, mut step: impl FnMut(&LvmVg, usize)) -> Vec<Duration> {
    (0..n)
        .map(|i| {
            let t = Instant::now();
            step(vg, i);
            t.elapsed()
        })
        .collect()
}

const PHASES: [&str; 5] = [
    "CreateVolume",
    "ControllerExpandVolume",
    "CreateSnapshot",
    "DeleteSnapshot",
    "DeleteVolume",
];

pub async fn lvm(n: usize, rounds: usize) {
    require_guest();
    let vg = LvmVg::new(VG, 1536);
    vg.thin_pool("pool", "512M", &[]);
    // FERROVOL_BENCH_LVM_LIBRARY=0: the driver runs an lvm process per
    // command, as `lvm_library = false` says, not its helpers.
    let library = std::env::var("FERROVOL_BENCH_LVM_LIBRARY").as_deref() != Ok("0");
    let config = format!(
        "[[backend]]\ntype = \"lvm\"\nlvm_library = {library}\n\
         [[backend.device_class]]\nname = \"thick\"\nvolume_group = \"{VG}\"\nsnapshot_size_percent = 50\n\
         [[backend.device_class]]\nname = \"thin\"\nvolume_group = \"{VG}\"\nthin_pool = \"pool\"\n"
    );
    let h = Harness::start_with(Some(&config)).await;
    let cap = mount_cap("ext4", 1);
    println!("\nlvm: each call beside the bare lvm commands doing its work ({n} calls a phase, {rounds} rounds, turns alternating; lvm_library = {library})");
    for class in ["thick", "thin"] {
        let thin = class == "thin";
        let mut pairs: Vec<Pair> = PHASES.iter().map(|_| Pair::default()).collect();
        for r in 0..rounds {
            let floor_first = r % 2 == 0;
            let vol_name = |i: usize| format!("{class}-{r}-{i}");
            let snap_name = |i: usize| format!("{class}-s-{r}-{i}");
            let fl = |i: usize| format!("fl-{class}-{r}-{i}");
            let fls = |i: usize| format!("fls-{class}-{r}-{i}");
            let mut ids: Vec<String> = Vec::new();
            let mut snaps: Vec<String> = Vec::new();
            for (p, phase) in PHASES.iter().enumerate() {
                for side in 0..2 {
                    let floor_now = (side == 0) == floor_first;
                    let start = Instant::now();
                    if floor_now {
                        let samples = lvm_floor(&vg, n, |vg, i| match *phase {
                            "CreateVolume" if thin => {
                                vg.lvm(
                                    "lvcreate",
                                    &[
                                        "-y",
                                        "-an",
                                        "-V",
                                        "8m",
                                        "--thinpool",
                                        &format!("{VG}/pool"),
                                        "-n",
                                        &fl(i),
                                    ],
                                );
                            }
                            "CreateVolume" => {
                                vg.lvm(
                                    "lvcreate",
                                    &["-y", "-an", "-Zn", "-Wn", "-L", "8m", "-n", &fl(i), VG],
                                );
                            }
                            "ControllerExpandVolume" => {
                                vg.lvm("lvextend", &["-L", "16m", &format!("{VG}/{}", fl(i))]);
                            }
                            "CreateSnapshot" if thin => {
                                vg.lvm(
                                    "lvcreate",
                                    &["-y", "-s", "-n", &fls(i), &format!("{VG}/{}", fl(i))],
                                );
                            }
                            "CreateSnapshot" => {
                                vg.lvm(
                                    "lvcreate",
                                    &[
                                        "-y",
                                        "-s",
                                        "-L",
                                        "8m",
                                        "-n",
                                        &fls(i),
                                        &format!("{VG}/{}", fl(i)),
                                    ],
                                );
                            }
                            "DeleteSnapshot" => remove_by_hand(vg, &fls(i), !thin, true),
                            _ => remove_by_hand(vg, &fl(i), !thin, false),
                        });
                        let pair = &mut pairs[p];
                        pair.floor.extend(samples);
                        pair.floor_time += start.elapsed();
                    } else {
                        let mut c = h.controller();
                        let samples = match *phase {
                            "CreateVolume" => {
                                timed(n, async |i| {
                                    let mut req = create_req(&vol_name(i), SIZE, cap.clone());
                                    req.parameters = HashMap::from([(
                                        "deviceClass".to_string(),
                                        class.to_string(),
                                    )]);
                                    let v = c.create_volume(req).await.expect("CreateVolume");
                                    ids.push(v.into_inner().volume.unwrap().volume_id);
                                })
                                .await
                            }
                            "ControllerExpandVolume" => {
                                timed(n, async |i| {
                                    c.controller_expand_volume(expand_req(&ids[i], GROWN))
                                        .await
                                        .expect("ControllerExpandVolume");
                                })
                                .await
                            }
                            "CreateSnapshot" => {
                                timed(n, async |i| {
                                    let req = pb::CreateSnapshotRequest {
                                        name: snap_name(i),
                                        source_volume_id: ids[i].clone(),
                                        ..Default::default()
                                    };
                                    let s = c.create_snapshot(req).await.expect("CreateSnapshot");
                                    snaps.push(s.into_inner().snapshot.unwrap().snapshot_id);
                                })
                                .await
                            }
                            "DeleteSnapshot" => {
                                timed(n, async |i| {
                                    let req = pb::DeleteSnapshotRequest {
                                        snapshot_id: snaps[i].clone(),
                                        ..Default::default()
                                    };
                                    c.delete_snapshot(req).await.expect("DeleteSnapshot");
                                })
                                .await
                            }
                            _ => {
                                timed(n, async |i| {
                                    let req = pb::DeleteVolumeRequest {
                                        volume_id: ids[i].clone(),
                                        ..Default::default()
                                    };
                                    c.delete_volume(req).await.expect("DeleteVolume");
                                })
                                .await
                            }
                        };
                        let pair = &mut pairs[p];
                        pair.ours.extend(samples);
                        pair.ours_time += start.elapsed();
                    }
                }
            }
        }
        let left = run("lvs", &["--noheadings", "-o", "lv_name", VG]);
        assert!(
            left.lines()
                .all(|l| l.trim() == "pool" || l.trim().is_empty()),
            "the bench left LVs behind: {left}"
        );
        header(&format!("lvm, {class} class"));
        for (phase, pair) in PHASES.iter().zip(&pairs) {
            let ours = Pair::figures(&pair.ours, pair.ours_time);
            let floor = Pair::figures(&pair.floor, pair.floor_time);
            let what = match (*phase, thin) {
                ("CreateVolume", _) => "lvcreate",
                ("ControllerExpandVolume", _) => "lvextend",
                ("CreateSnapshot", _) => "lvcreate -s",
                ("DeleteSnapshot", false) => "split, zero, lvremove",
                ("DeleteVolume", false) => "activate, zero, lvremove",
                _ => "lvremove",
            };
            row(phase, &ours, Some((what, &floor)));
            let (call, floor_name) = (format!("{phase}, {class}"), format!("bare lvm: {what}"));
            record(Row::times(
                "lvm",
                &call,
                ours.p50_p99(),
                &floor_name,
                Against::Floor,
                floor.p50_p99(),
            ));
        }
    }
    println!(
        "driver peak RSS (VmHWM): {:.1} MB",
        h.status_kb("VmHWM") as f64 / 1024.0
    );
}

/// What a thick class's delete does, by hand: a classic snapshot split
/// from its origin first, the LV activated and zeroed, then removed; a
/// thin LV is only removed.
fn remove_by_hand(vg: &LvmVg, lv: &str, zero: bool, snapshot: bool) {
    let target = format!("{VG}/{lv}");
    if zero {
        if snapshot {
            vg.lvm("lvconvert", &["-y", "--splitsnapshot", &target]);
        }
        vg.lvm("lvchange", &["-ay", "-y", &target]);
        run("blkdiscard", &["--zeroout", &format!("/dev/{target}")]);
    }
    vg.lvm("lvremove", &["-y", &target]);
}
