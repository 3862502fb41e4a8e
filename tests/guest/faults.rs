//! Faults injected under the driver in the guest, on every backend, each
//! test printing what it measured: storage taken away under a staged
//! volume before unstage, cycle after cycle.

use super::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How many times each backend's storage is taken away under a staged
/// volume: FERROVOL_FAULT_CYCLES, 20 by default. Under the guest's
/// software emulation an iSCSI cycle takes seconds, so the suite runs 20
/// per backend; a soak run sets 200 (`FERROVOL_FAULT_CYCLES=200
/// tests/guest/suite faults::guest_storage --nocapture`).
fn cycles() -> usize {
    std::env::var("FERROVOL_FAULT_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

/// One backend as the cycles drive it.
struct Under {
    backend: &'static str,
    /// Published to the node by the controller before the stage.
    attach: bool,
    /// Raw block volumes served too (every other cycle is one).
    block: bool,
    secrets: HashMap<String, String>,
}

/// A volume brought up for a cycle.
struct Up {
    id: String,
    name: String,
    staging: PathBuf,
    target: PathBuf,
    publish_context: HashMap<String, String>,
    volume_context: HashMap<String, String>,
}

async fn bring_up(h: &Harness, u: &Under, name: &str, block: bool) -> Up {
    let mut req = create_req(name, 16 * MIB, cap_of(u, block));
    req.parameters.insert("backend".into(), u.backend.into());
    req.parameters
        .insert("csi.storage.k8s.io/pv/name".into(), name.into());
    req.secrets = u.secrets.clone();
    let vol = h.create(req).await;
    let publish_context = match u.attach {
        true => {
            h.attach_here(&vol.volume_id, &cap_of(u, block), &u.secrets)
                .await
        }
        false => HashMap::new(),
    };
    let up = Up {
        id: vol.volume_id,
        name: name.into(),
        staging: h.path(&format!("kubelet/staging/{name}")),
        target: h.path(&format!("kubelet/pods/{name}")),
        publish_context,
        volume_context: vol.volume_context,
    };
    stage_publish(h, u, up, block).await
}

/// The capability a cycle's volume is staged with.
fn cap_of(u: &Under, block: bool) -> pb::VolumeCapability {
    match block {
        true => block_cap(SNW),
        false => mount_cap(if u.backend == "nfs" { "" } else { "ext4" }, SNW),
    }
}

/// Stages and publishes a volume made by [`bring_up`], and writes to it
/// as a pod would.
async fn stage_publish(h: &Harness, u: &Under, up: Up, block: bool) -> Up {
    let cap = cap_of(u, block);
    std::fs::create_dir_all(&up.staging).unwrap();
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            secrets: u.secrets.clone(),
            publish_context: up.publish_context.clone(),
            volume_context: up.volume_context.clone(),
            ..stage_req(&up.id, &up.staging, cap.clone())
        })
        .await
        .unwrap_or_else(|e| panic!("stage {}: {e:?}\n{}", up.name, h.log()));
    h.node()
        .node_publish_volume(pb::NodePublishVolumeRequest {
            volume_context: up.volume_context.clone(),
            ..publish_req(&up.id, &up.staging, &up.target, cap, false)
        })
        .await
        .unwrap_or_else(|e| panic!("publish {}: {e:?}\n{}", up.name, h.log()));
    // The pod wrote something, synced: the filesystem has state to lose,
    // the device has been used.
    if block {
        fill(&up.target, 0, 4096, 0x5A);
    } else {
        let f = up.target.join("data");
        std::fs::write(&f, b"written before the storage went").unwrap();
        std::fs::File::open(&f).unwrap().sync_all().unwrap();
    }
    up
}

/// What the node says of the volume (status, reason).
async fn node_health(h: &Harness, up: &Up) -> BTreeSet<(i32, String)> {
    let r = h
        .node()
        .node_get_volume_health(pb::NodeGetVolumeHealthRequest {
            volume_id: up.id.clone(),
            volume_publish_path: up.target.display().to_string(),
            staging_target_path: up.staging.display().to_string(),
        })
        .await
        .unwrap_or_else(|e| panic!("NodeGetVolumeHealth {}: {e:?}\n{}", up.name, h.log()))
        .into_inner();
    r.volume_health
        .unwrap_or_default()
        .health_statuses
        .into_iter()
        .map(|e| (e.status, e.reason))
        .collect()
}

/// The file backend's image of a volume: `<locator>.img` under the pool.
fn image_of(pool: &Path, id: &str) -> PathBuf {
    let locator = id.split_once(':').unwrap().1;
    let want = format!("{locator}.img");
    let mut stack = vec![pool.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            if e.file_name().to_string_lossy() == want {
                return e.path();
            }
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
    panic!("no image {want} under {}", pool.display())
}

/// The device-mapper name of LV `lv` of volume group `vg`.
fn dm_name(vg: &str, lv: &str) -> String {
    format!("{}-{}", vg.replace('-', "--"), lv.replace('-', "--"))
}

/// The kernel rbd mappings: (device id, image name, client address).
fn rbd_mappings() -> Vec<(String, String, String)> {
    let Ok(dir) = std::fs::read_dir("/sys/bus/rbd/devices") else {
        return Vec::new();
    };
    dir.flatten()
        .map(|d| {
            let read = |f: &str| {
                std::fs::read_to_string(d.path().join(f))
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            };
            (
                d.file_name().to_string_lossy().into_owned(),
                read("name"),
                read("client_addr"),
            )
        })
        .collect()
}

/// Processes of these names still running (none may be left behind).
fn running_named(names: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(comm) = std::fs::read_to_string(p.path().join("comm")) {
            if names.contains(&comm.trim()) {
                found.push(format!(
                    "{} {}",
                    p.file_name().to_string_lossy(),
                    comm.trim()
                ));
            }
        }
    }
    found
}

const INACCESSIBLE: i32 = pb::VolumeHealthErrorType::Inaccessible as i32;
const DATA_LOSS: i32 = pb::VolumeHealthErrorType::DataLoss as i32;

/// Every backend on one driver (its config names each by its type), on
/// servers of the test's own: a volume group `fv<tag>`, a tgtd, an nfs
/// server, the shared Ceph cluster; with how the cycles drive each.
struct Every {
    h: Harness,
    unders: [Under; 5],
    tgtd: Tgtd,
    server: NfsServer,
    cluster: &'static CephCluster,
    _iscsid: Iscsid,
    _vg: LvmVg,
}

async fn every_backend(tag: &str) -> Every {
    let vg_name = format!("fv{tag}");
    let vg = LvmVg::new(&vg_name, 256);
    let tgtd = Tgtd::new();
    let iscsid = Iscsid::new();
    let cluster = CephCluster::shared();
    let server = NfsServer::new();
    let prefix = format!("iqn.2026-11.io.ferrovol.{tag}");
    let config = format!(
        "{}{NFS_LOOPBACK_CONFIG}",
        block_backends_config(&vg_name, &tgtd, &prefix, cluster)
    );
    let h = Harness::start_with_env(Some(&config), &[("FERROVOL_VOLUME_HEALTH", "true")]).await;
    let none = HashMap::new();
    let unders = [
        ("file", false, true, none.clone()),
        ("lvm", false, true, none.clone()),
        ("nfs", false, false, none.clone()),
        ("iscsi", true, true, none.clone()),
        ("rbd", true, true, cluster.secrets()),
    ]
    .map(|(backend, attach, block, secrets)| Under {
        backend,
        attach,
        block,
        secrets,
    });
    Every {
        h,
        unders,
        tgtd,
        server,
        cluster,
        _iscsid: iscsid,
        _vg: vg,
    }
}

/// What a cycle breaks things with.
struct Breakers<'a> {
    pool: PathBuf,
    tgtd: &'a Tgtd,
    export: PathBuf,
    cluster: &'a CephCluster,
}

/// Takes the storage of a staged, published volume away, as it goes in
/// production (see [`guest_storage_gone_before_unstage_leaves_nothing`]).
fn take_away(b: &Breakers, backend: &str, up: &Up, block: bool) {
    match backend {
        "file" => std::fs::remove_file(image_of(&b.pool, &up.id)).unwrap(),
        "lvm" => {
            let dm = dm_name("fvfault", up.id.rsplit('.').next().unwrap());
            // Held open (a mounted filesystem): the table is swapped for an
            // error target and the device stays; else (a raw block
            // volume's node, bound into the pod) it is removed.
            let _ = std::process::Command::new("dmsetup")
                .args(["remove", "--force", &dm])
                .output()
                .unwrap();
            if !block {
                let table = run("dmsetup", &["table", &dm]);
                assert!(table.contains("error"), "{dm}: {table}");
            }
        }
        "nfs" => std::fs::remove_dir_all(b.export.join(&up.name)).unwrap(),
        "iscsi" => {
            let iqn = &up.publish_context["iqn"];
            let tid = b
                .tgtd
                .tgtadm(&["--op", "show", "--mode", "target"])
                .lines()
                .find(|l| l.ends_with(iqn.as_str()))
                .and_then(|l| l.strip_prefix("Target "))
                .and_then(|l| l.split(':').next())
                .unwrap()
                .to_string();
            // tgtd refuses while a command of the LUN is in flight ("this
            // logical unit is still active"): asked again until it takes.
            let c = b.tgtd.control_port.to_string();
            let args = [
                "-C", &c, "--lld", "iscsi", "--op", "delete", "--mode", "target", "--tid", &tid,
                "--force",
            ];
            wait_for("tgtd to delete the target", Duration::from_secs(30), || {
                std::process::Command::new("tgtadm")
                    .args(args)
                    .output()
                    .is_ok_and(|o| o.status.success())
            });
        }
        "rbd" => {
            let image = up.id.rsplit('.').next().unwrap().to_string();
            let (_, _, addr) = rbd_mappings()
                .into_iter()
                .find(|(_, n, _)| *n == image)
                .unwrap_or_else(|| panic!("{image} not mapped: {:?}", rbd_mappings()));
            b.cluster.ceph(&["osd", "blocklist", "add", &addr]);
        }
        other => unreachable!("{other}"),
    }
}

/// `n` cycles on one backend: a volume staged and published (every other
/// one raw block where the backend serves it), written, its storage taken
/// away, its health asked, unpublished and unstaged. Backends whose volume
/// outlives the fault (lvm: the LV is deactivated at unstage; nfs: the
/// directory made again; rbd: the next map is a new client) reuse two
/// volumes; the others make and delete one per cycle. Returns the
/// report's line.
async fn cycles_on(h: &Harness, u: &Under, b: &Breakers<'_>, n: usize) -> String {
    let reuse = matches!(u.backend, "lvm" | "nfs" | "rbd");
    let started = Instant::now();
    let mut said: BTreeMap<(i32, String), usize> = BTreeMap::new();
    let mut slowest = Duration::ZERO;
    // Time per phase: bring up, take away and ask, unpublish and unstage.
    let mut phases = [Duration::ZERO; 3];
    let mut kept: BTreeMap<bool, Up> = BTreeMap::new();
    for i in 0..n {
        let block = u.block && i % 2 == 1;
        let t0 = Instant::now();
        let up = match (reuse, kept.remove(&block)) {
            (true, Some(up)) => {
                if u.backend == "nfs" {
                    std::fs::create_dir(b.export.join(&up.name)).unwrap();
                }
                stage_publish(h, u, up, block).await
            }
            _ => {
                let kind = if block { "block" } else { "fs" };
                let name = match reuse {
                    true => format!("gone-{}-{kind}", u.backend),
                    false => format!("gone-{}-{i}", u.backend),
                };
                bring_up(h, u, &name, block).await
            }
        };
        phases[0] += t0.elapsed();
        let t1 = Instant::now();
        take_away(b, u.backend, &up, block);
        let health = node_health(h, &up).await;
        let wanted = if u.backend == "file" {
            DATA_LOSS
        } else {
            INACCESSIBLE
        };
        assert!(
            health.iter().any(|(s, _)| *s == wanted),
            "{} (cycle {i}): {health:?}\n{}",
            up.name,
            h.log()
        );
        for k in health {
            *said.entry(k).or_default() += 1;
        }
        phases[1] += t1.elapsed();
        let t = Instant::now();
        h.node()
            .node_unpublish_volume(unpublish_req(&up.id, &up.target))
            .await
            .unwrap_or_else(|e| panic!("unpublish {} (cycle {i}): {e:?}\n{}", up.name, h.log()));
        h.node()
            .node_unstage_volume(unstage_req(&up.id, &up.staging))
            .await
            .unwrap_or_else(|e| panic!("unstage {} (cycle {i}): {e:?}\n{}", up.name, h.log()));
        slowest = slowest.max(t.elapsed());
        phases[2] += t.elapsed();
        match reuse {
            true => {
                kept.insert(block, up);
            }
            false => drop_volume(h, u, &up).await,
        }
    }
    for up in kept.into_values() {
        if u.backend == "nfs" {
            let _ = std::fs::create_dir(b.export.join(&up.name));
        }
        drop_volume(h, u, &up).await;
    }
    format!(
        "{}: {n} cycles in {:.1?} ({:.2?} each; in all: up {:.1?}, take away and ask {:.1?}, \
         unpublish+unstage {:.1?}); unpublish+unstage at most {slowest:.2?}; the node said \
         {said:?}",
        u.backend,
        started.elapsed(),
        started.elapsed() / n.max(1) as u32,
        phases[0],
        phases[1],
        phases[2],
    )
}

/// Detaches (where the backend attaches) and deletes a cycle's volume.
async fn drop_volume(h: &Harness, u: &Under, up: &Up) {
    if u.attach {
        h.detach_here(&up.id).await;
    }
    h.controller()
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: up.id.clone(),
            secrets: u.secrets.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("delete {}: {e:?}\n{}", up.name, h.log()));
}

/// Storage taken away under a staged, published volume, [`cycles`] times
/// per backend, the five backends at once on one
/// driver, each the way it goes in production: the file backend's image
/// deleted, the LV's device failed (its table swapped for an error target,
/// as a dead disk or a forced `dmsetup remove` leaves it), the nfs
/// volume's directory removed on the server, the iSCSI target deleted in
/// tgtd with its session logged in, the node's Ceph client fenced
/// (blocklisted). Every other cycle the volume is raw block (nfs: always a
/// filesystem). Meanwhile NodeGetVolumeHealth says the volume is
/// inaccessible (the file backend: data loss, its loop device holding the
/// deleted image's bytes until unstage); then unpublish and unstage
/// succeed, and after all the cycles nothing is left: no mount, loop
/// device, device-mapper device, iSCSI session, rbd mapping, and no
/// mount, umount, iscsiadm or rbd process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_storage_gone_before_unstage_leaves_nothing() {
    require_guest();
    let every = every_backend("fault").await;
    let (mut h, unders, tgtd, cluster) = (every.h, every.unders, every.tgtd, every.cluster);
    let server = every.server;
    let b = Breakers {
        pool: h.path("file-pool"),
        tgtd: &tgtd,
        export: server.export.clone(),
        cluster,
    };
    let n = cycles();
    let started = Instant::now();
    // Each backend's cycles on a thread of its own (their commands and
    // writes block), the clients' connections served by this runtime.
    let lines: Vec<String> = tokio::task::block_in_place(|| {
        std::thread::scope(|s| {
            let runs: Vec<_> = unders
                .iter()
                .map(|u| {
                    let (h, b) = (&h, &b);
                    s.spawn(move || {
                        tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap()
                            .block_on(cycles_on(h, u, b, n))
                    })
                })
                .collect();
            runs.into_iter()
                .map(|r| r.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    });
    let took = started.elapsed();
    // Nothing left behind (the driver stopped: it lets go of its own
    // working mounts too).
    assert!(h.terminate().success());
    assert!(h.mounts().is_empty(), "mounts: {:?}", h.mounts());
    assert!(
        h.loop_devices().is_empty(),
        "loop devices: {:?}",
        h.loop_devices()
    );
    let dm = run("dmsetup", &["ls"]);
    assert!(
        !dm.contains("fvfault-") && !dm.contains("fvh-") && !dm.contains("fvc-"),
        "device-mapper devices: {dm}"
    );
    let sessions = Iscsid::sessions();
    assert!(
        !sessions.iter().any(|s| s.contains("io.ferrovol.fault")),
        "iSCSI sessions: {sessions:?}"
    );
    assert!(
        rbd_mappings().is_empty(),
        "rbd mappings: {:?}",
        rbd_mappings()
    );
    let procs = running_named(&["mount", "umount", "iscsiadm", "rbd", "mkfs.ext4", "blkid"]);
    assert!(procs.is_empty(), "processes left: {procs:?}");
    println!("{n} cycles on each of five backends at once, in {took:.1?}; nothing left behind");
    for line in lines {
        println!("{line}");
    }
}

/// The pods' and staging mounts (and their sources), as the kernel lists
/// them (not the driver's own working mounts, which it releases when it
/// stops).
fn mount_table(h: &Harness) -> BTreeSet<String> {
    let root = h.path("kubelet");
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let at = f.get(4)?;
            let sep = f.iter().position(|x| *x == "-")?;
            let (source, root_of) = (f.get(sep + 2)?, f.get(3)?);
            Path::new(at)
                .starts_with(&root)
                .then(|| format!("{at} {source} {root_of}"))
        })
        .collect()
}

/// What the restarted driver says of a volume it served before: the
/// publish asked again is the one already there, its stats and health
/// are read from it.
async fn adopted(h: &Harness, u: &Under, up: &Up, block: bool) {
    let cap = if block {
        block_cap(SNW)
    } else {
        mount_cap(if u.backend == "nfs" { "" } else { "ext4" }, SNW)
    };
    h.node()
        .node_publish_volume(publish_req(&up.id, &up.staging, &up.target, cap, false))
        .await
        .unwrap_or_else(|e| panic!("publish {} again: {e:?}\n{}", up.name, h.log()));
    let stats = h
        .node()
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: up.id.clone(),
            volume_path: up.target.display().to_string(),
            staging_target_path: up.staging.display().to_string(),
        })
        .await
        .unwrap_or_else(|e| panic!("stats of {}: {e:?}\n{}", up.name, h.log()))
        .into_inner();
    assert!(!stats.usage.is_empty(), "{}: {stats:?}", up.name);
    let health = node_health(h, up).await;
    assert!(health.is_empty(), "{}: {health:?}\n{}", up.name, h.log());
}

/// The node plugin stopped (SIGTERM, then SIGKILL) and started again
/// while a pod writes to each volume of every backend, a filesystem one
/// and (block backends) a raw block one, each write synced: no write
/// fails, the writers go on while the driver is down, the mount table is
/// the same after each restart, and the restarted driver serves every
/// volume it finds (publish again, stats, health); then each is torn down
/// and nothing is left.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_node_plugin_restarts_under_writing_pods() {
    require_guest();
    let every = every_backend("restart").await;
    let (mut h, unders) = (every.h, every.unders);
    let mut volumes = Vec::new();
    for u in &unders {
        for block in [false, true] {
            if block && !u.block {
                continue;
            }
            let name = format!("w-{}-{}", u.backend, if block { "block" } else { "fs" });
            let up = bring_up(&h, u, &name, block).await;
            let path = if block {
                up.target.clone()
            } else {
                up.target.join("steady")
            };
            volumes.push((u, block, up, Steady::start(path)));
        }
    }
    let before = mount_table(&h);
    for how in ["SIGTERM", "SIGKILL"] {
        match how {
            "SIGTERM" => assert!(h.terminate().success()),
            _ => h.kill(),
        }
        // Down: every pod's writes go on.
        for (_, _, up, w) in &volumes {
            assert!(
                w.next_write_within(Duration::from_secs(30)).is_some(),
                "{} stopped writing with the driver down ({how})",
                up.name
            );
        }
        let t = Instant::now();
        h.spawn().await;
        let back = t.elapsed();
        assert_eq!(mount_table(&h), before, "after {how}");
        for (u, block, up, _) in &volumes {
            adopted(&h, u, up, *block).await;
        }
        println!(
            "{how}: {} writers went on; ready again in {back:.2?}, every volume adopted",
            volumes.len()
        );
    }
    let mut writes = BTreeMap::new();
    for (u, _, up, w) in volumes {
        writes.insert(up.name.clone(), w.finish());
        h.unpublish_unstage(&up.id, &up.staging, &up.target).await;
        if u.attach {
            h.detach_here(&up.id).await;
        }
        h.controller()
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: up.id.clone(),
                secrets: u.secrets.clone(),
            })
            .await
            .unwrap_or_else(|e| panic!("delete {}: {e:?}\n{}", up.name, h.log()));
    }
    println!("synced writes per volume, none failed: {writes:?}");
    // Stopped, the driver lets go of its own working mounts too.
    assert!(h.terminate().success());
    assert!(h.mounts().is_empty(), "mounts: {:?}", h.mounts());
    assert!(rbd_mappings().is_empty(), "{:?}", rbd_mappings());
    let sessions = Iscsid::sessions();
    assert!(
        !sessions.iter().any(|s| s.contains("io.ferrovol.restart")),
        "{sessions:?}"
    );
    drop((every.server, every.tgtd));
}

/// Swaps device-mapper device `dm`'s table for `table` (live: suspended,
/// loaded, resumed).
fn dm_swap(dm: &str, table: &str) {
    run("dmsetup", &["suspend", "--noflush", dm]);
    run("dmsetup", &["load", dm, "--table", table]);
    run("dmsetup", &["resume", dm]);
}

/// Device errors under a staged filesystem (the LV's table swapped for an
/// error target, as a failing disk answers), on ext4 and xfs: a pod's
/// synced write fails; the node's health says what the kernel found (ext4:
/// errors counted or made read-only, DATA_LOSS or DEGRADED; xfs: shut
/// down, INACCESSIBLE); a publish to another pod is refused, saying why;
/// with the device still failing, a stage again fails and says why; with
/// the device back, the stage mounts the filesystem again and the data
/// written before the errors is there.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_a_filesystem_with_io_errors_is_not_handed_to_a_pod() {
    require_guest();
    // The volume group's one physical volume is a device-mapper device
    // over a loop device: its table swapped for an error target, every
    // LV on it fails, as on a disk that died, across deactivation too.
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("pv.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(512 << 20)
        .unwrap();
    let lo = run("losetup", &["--find", "--show", image.to_str().unwrap()])
        .trim()
        .to_string();
    // From 1 MiB into the loop device: lvm, scanning the loop device
    // too, finds no second copy of the label there.
    let sectors = 511 * 2048;
    let pv_good = format!("0 {sectors} linear {lo} 2048");
    run("dmsetup", &["create", "fvioerr-pv", "--table", &pv_good]);
    run("pvcreate", &["-q", "/dev/mapper/fvioerr-pv"]);
    run("vgcreate", &["-q", "fvioerr", "/dev/mapper/fvioerr-pv"]);
    let config = "[[backend]]\ntype = \"lvm\"\n[[backend.device_class]]\nname = \"thick\"\n\
                  volume_group = \"fvioerr\"\n";
    let h = Harness::start_with_env(Some(config), &[("FERROVOL_VOLUME_HEALTH", "true")]).await;
    for fs in ["ext4", "xfs"] {
        let name = format!("ioerr-{fs}");
        let cap = mount_cap(fs, SNW);
        let mut req = create_req(&name, 320 * MIB, cap.clone());
        req.parameters.insert("backend".into(), "lvm".into());
        let Published {
            id,
            staging,
            target,
        } = h.provision_req(req).await;
        let kept = target.join("kept");
        std::fs::write(&kept, b"written while the disk was good").unwrap();
        std::fs::File::open(&kept).unwrap().sync_all().unwrap();
        run("sync", &[]);
        let up = Up {
            id: id.clone(),
            name: name.clone(),
            staging: staging.clone(),
            target: target.clone(),
            publish_context: HashMap::new(),
            volume_context: HashMap::new(),
        };
        assert!(node_health(&h, &up).await.is_empty());

        dm_swap("fvioerr-pv", &format!("0 {sectors} error"));
        // The pod writes and syncs: the device fails it.
        let write = std::fs::write(target.join("after"), vec![7u8; 1 << 20])
            .and_then(|_| std::fs::File::open(target.join("after"))?.sync_all());
        assert!(write.is_err(), "a synced write over a failing device");
        // The kernel notices at its own pace (a journal commit): asked
        // until the filesystem's own finding shows, within a minute (the
        // backend may say first what it sees of the device).
        let fs_said =
            |said: &BTreeSet<(i32, String)>| said.iter().any(|(_, r)| r.starts_with("Filesystem"));
        let began = Instant::now();
        let first = node_health(&h, &up).await;
        let said = loop {
            let said = node_health(&h, &up).await;
            if fs_said(&said) || began.elapsed() > Duration::from_secs(60) {
                break said;
            }
            // Another write prods the filesystem into meeting the error.
            let _ = std::fs::write(target.join("prod"), b"x")
                .and_then(|_| std::fs::File::open(target.join("prod"))?.sync_all());
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        println!(
            "{fs} on a failing device: the node said {first:?} at once, {said:?} after {:.1?}",
            began.elapsed()
        );
        let statuses: BTreeSet<i32> = said
            .iter()
            .filter(|(_, r)| r.starts_with("Filesystem"))
            .map(|(s, _)| *s)
            .collect();
        match fs {
            "xfs" => assert!(
                said.contains(&(INACCESSIBLE, "FilesystemShutDown".into())),
                "{said:?}"
            ),
            _ => assert!(
                statuses.contains(&DATA_LOSS)
                    || statuses.contains(&(pb::VolumeHealthErrorType::Degraded as i32)),
                "{said:?}"
            ),
        }
        // Not handed to another pod.
        let other = h.path(&format!("kubelet/pods/{name}-2"));
        let e = h
            .node()
            .node_publish_volume(publish_req(&id, &staging, &other, cap.clone(), false))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("filesystem"), "{e:?}");
        println!("{fs}: a second publish refused: {}", e.message());
        // The pod goes; the node lets go of it, failing device and all.
        h.unpublish_unstage(&id, &staging, &target).await;
        let again = h
            .node()
            .node_stage_volume(stage_req(&id, &staging, cap.clone()))
            .await;
        let e = again.expect_err("a stage over a device that fails");
        println!(
            "{fs}: a stage with the device failing: {:?} {}",
            e.code(),
            e.message()
        );
        assert!(h.mounts().is_empty(), "{:?}", h.mounts());
        // The disk back: staged again, the data from before is there.
        dm_swap("fvioerr-pv", &pv_good);
        h.node()
            .node_stage_volume(stage_req(&id, &staging, cap.clone()))
            .await
            .unwrap_or_else(|e| panic!("{fs}: stage with the device back: {e:?}\n{}", h.log()));
        h.node()
            .node_publish_volume(publish_req(&id, &staging, &target, cap.clone(), false))
            .await
            .unwrap_or_else(|e| panic!("{fs}: publish with the device back: {e:?}\n{}", h.log()));
        assert_eq!(
            std::fs::read(&kept).unwrap(),
            b"written while the disk was good"
        );
        assert!(node_health(&h, &up).await.is_empty());
        h.unpublish_unstage(&id, &staging, &target).await;
        h.delete_volume(&id).await;
    }
    drop(h);
    run("vgremove", &["-q", "-f", "fvioerr"]);
    run("dmsetup", &["remove", "fvioerr-pv"]);
    run("losetup", &["-d", &lo]);
}
