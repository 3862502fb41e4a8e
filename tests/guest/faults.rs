//! Faults injected under the driver in the guest, on every backend, each
//! test printing what it measured: storage taken away under a staged
//! volume before unstage, cycle after cycle.

use super::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How many times each backend's storage is taken away under a staged
/// volume: FERROVOL_FAULT_CYCLES, 10 by default. Under the guest's
/// software emulation an rbd or iSCSI cycle takes 6 to 9 s, so the suite
/// runs 10 per backend (5 with a filesystem, 5 raw block); a soak run
/// sets 200 (`FERROVOL_FAULT_CYCLES=200 tests/guest/suite
/// faults::guest_storage`: 1,741 s, nothing left, on 2026-11-28).
fn cycles() -> usize {
    std::env::var("FERROVOL_FAULT_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
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
    let up = made(h, u, name, block).await;
    stage_publish(h, u, up, block).await
}

/// A volume created (and attached to this node where the backend
/// attaches), not staged.
async fn made(h: &Harness, u: &Under, name: &str, block: bool) -> Up {
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
    Up {
        id: vol.volume_id,
        name: name.into(),
        staging: h.path(&format!("kubelet/staging/{name}")),
        target: h.path(&format!("kubelet/pods/{name}")),
        publish_context,
        volume_context: vol.volume_context,
    }
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
    h.node()
        .node_stage_volume(stage_request(u, &up, block))
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

/// The NodeStageVolume request of a volume made by [`made`] (its staging
/// directory made, as kubelet makes it).
fn stage_request(u: &Under, up: &Up, block: bool) -> pb::NodeStageVolumeRequest {
    std::fs::create_dir_all(&up.staging).unwrap();
    pb::NodeStageVolumeRequest {
        secrets: u.secrets.clone(),
        publish_context: up.publish_context.clone(),
        volume_context: up.volume_context.clone(),
        ..stage_req(&up.id, &up.staging, cap_of(u, block))
    }
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

/// This test process adopts the orphans of everything it starts (its
/// drivers' commands among them: one that outlived a kill would be
/// reparented here, not to the guest's init), so that [`running_named`]
/// can tell what this process started from what another test process
/// beside it did (tests/guest/lanes). Adopted orphans that end stay
/// zombies until this process ends: dead, and not counted as running.
fn adopt_orphans() {
    nix::sys::prctl::set_child_subreaper(true).expect("PR_SET_CHILD_SUBREAPER");
}

/// A process's parent, from /proc/PID/stat.
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..]
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Whether `pid` was started by this process (it or its adopted
/// orphans' lines: see [`adopt_orphans`]).
fn ours(pid: u32) -> bool {
    let me = std::process::id();
    let mut p = pid;
    for _ in 0..64 {
        match parent(p) {
            Some(parent) if parent == me => return true,
            Some(parent) if parent > 1 => p = parent,
            _ => return false,
        }
    }
    false
}

/// Processes of these names that this process started still running
/// (none may be left behind; a zombie has ended).
fn running_named(names: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if !ours(pid) || !running(pid) {
            continue;
        }
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
/// servers of the test's own: a volume group `fv<tag>`, a tgtd, an nvmet
/// port, an nfs server, the shared Ceph cluster; with how the cycles
/// drive each.
struct Every {
    h: Harness,
    unders: [Under; 6],
    tgtd: Tgtd,
    nvmet: NvmetPort,
    server: NfsServer,
    cluster: &'static CephCluster,
    _iscsid: Iscsid,
    _vg: LvmVg,
}

async fn every_backend(tag: &str) -> Every {
    every_backend_with(tag, &[]).await
}

/// [`every_backend`], the driver started with `env` too.
async fn every_backend_with(tag: &str, env: &[(&str, &str)]) -> Every {
    adopt_orphans();
    let every = EveryBackend::new(tag, 256, true);
    let cluster = every.cluster;
    let mut env = env.to_vec();
    env.push(("FERROVOL_VOLUME_HEALTH", "true"));
    let h = Harness::start_with_env(Some(&every.config), &env).await;
    let none = HashMap::new();
    let unders = [
        ("file", false, true, none.clone()),
        ("lvm", false, true, none.clone()),
        ("nfs", false, false, none.clone()),
        ("iscsi", true, true, none.clone()),
        ("nvmf", true, true, none.clone()),
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
        tgtd: every.tgtd,
        nvmet: every.nvmet,
        server: every.nfs.unwrap(),
        cluster,
        _iscsid: every.iscsid,
        _vg: every.vg,
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
        "nvmf" => {
            // The subsystem removed from nvmet with the node's controllers
            // connected (an operator's teardown, a target host rebuilt
            // without it), then seen by the node: none of its controllers
            // of it live any more.
            let nqn = &up.publish_context["nqn"];
            remove_subsystem(nqn);
            wait_for(
                "the node's controllers of the removed subsystem to leave live",
                Duration::from_secs(30),
                || {
                    std::fs::read_dir("/sys/class/nvme")
                        .into_iter()
                        .flatten()
                        .flatten()
                        .filter(|c| {
                            std::fs::read_to_string(c.path().join("subsysnqn"))
                                .is_ok_and(|n| n.trim() == nqn)
                        })
                        .all(|c| {
                            std::fs::read_to_string(c.path().join("state"))
                                .map_or(true, |s| s.trim() != "live")
                        })
                },
            );
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
/// per backend, the six backends at once on one
/// driver, each the way it goes in production: the file backend's image
/// deleted, the LV's device failed (its table swapped for an error target,
/// as a dead disk or a forced `dmsetup remove` leaves it), the nfs
/// volume's directory removed on the server, the iSCSI target deleted in
/// tgtd with its session logged in, the NVMe subsystem removed from nvmet
/// with the node's controllers connected, the node's Ceph client fenced
/// (blocklisted). Every other cycle the volume is raw block (nfs: always a
/// filesystem). Meanwhile NodeGetVolumeHealth says the volume is
/// inaccessible (the file backend: data loss, its loop device holding the
/// deleted image's bytes until unstage); then unpublish and unstage
/// succeed, and after all the cycles nothing is left: no mount, loop
/// device, device-mapper device, iSCSI session, NVMe controller or
/// subsystem, rbd mapping, and no
/// mount, umount, iscsiadm or rbd process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_storage_gone_before_unstage_leaves_nothing() {
    require_guest();
    let every = every_backend("fault").await;
    let (mut h, unders, tgtd, cluster) = (every.h, every.unders, every.tgtd, every.cluster);
    let nvmet = every.nvmet;
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
    // No LUKS mapping is asked for here (the other lane's tests may have
    // theirs open: tests/guest/lanes).
    let dm = run("dmsetup", &["ls"]);
    assert!(
        !dm.contains("fvfault-") && !dm.contains("fvh-"),
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
    nvmet.assert_clean();
    let procs = running_named(&[
        "mount",
        "mount.nfs",
        "umount",
        "umount.nfs",
        "iscsiadm",
        "rbd",
        "mkfs.ext4",
        "blkid",
    ]);
    assert!(procs.is_empty(), "processes left: {procs:?}");
    println!("{n} cycles on each of six backends at once, in {took:.1?}; nothing left behind");
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
        // The volume group's one disk fails: not "no such volume", but
        // the group unreadable, which a retry may outlast.
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().contains("cannot be read"), "{e:?}");
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
    // udev may still hold the device open after the volume group went (a
    // busy machine's scan): asked again for a few seconds.
    run("dmsetup", &["remove", "--retry", "fvioerr-pv"]);
    run("losetup", &["-d", &lo]);
}

/// Packets dropped in the guest's network namespace: a table of nftables
/// rules of the test's own on the output hook (loopback traffic passes it
/// once, each way), deleted when this is dropped. The deletion is made by
/// a shell started with the rules, before anything waits on the server:
/// while a file of this process on a cut NFS server has data to write, a
/// new child of this process would hang at its exec (closing its copy of
/// that file flushes it to the server).
pub(crate) struct Cut(std::process::Child);

impl Cut {
    const TABLE: &'static str = "ferrovol_cut";

    pub(crate) fn new(rules: &[String]) -> Cut {
        let script = format!(
            "table inet {} {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    {}\n  }}\n}}\n",
            Self::TABLE,
            rules.join("\n    ")
        );
        let lift = std::process::Command::new("sh")
            .args([
                "-c",
                &format!("read _; exec nft delete table inet {}", Self::TABLE),
            ])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), script).unwrap();
        run("nft", &["-f", file.path().to_str().unwrap()]);
        Cut(lift)
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        use std::io::Write;
        if let Some(mut stdin) = self.0.stdin.take() {
            let _ = stdin.write_all(b"lift\n");
        }
        let _ = self.0.wait();
    }
}

/// The TCP ports the Ceph monitor and OSDs listen on.
fn ceph_ports() -> Vec<u16> {
    let mut ports: Vec<u16> = run("ss", &["-Hltnp"])
        .lines()
        .filter(|l| l.contains("\"ceph-mon\"") || l.contains("\"ceph-osd\""))
        .filter_map(|l| {
            l.split_whitespace()
                .nth(3)?
                .rsplit(':')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    assert!(
        !ports.is_empty(),
        "no Ceph daemon listens: {}",
        run("ss", &["-Hltnp"])
    );
    ports
}

/// The cgroup (v2) the driver is moved into, so that the Ceph cut can
/// tell its tools' packets from the daemons' (all run as root).
const DRIVER_CGROUP: &str = "ferrovol-cut";

/// Starts the driver again inside [`DRIVER_CGROUP`] (its children and
/// every socket it makes follow it; the rbd backend's kept cluster
/// connection is made at its start), mounting the cgroup2 hierarchy where
/// nftables looks for it when the guest has none there.
async fn driver_into_cgroup(h: &mut Harness) {
    let root = Path::new("/sys/fs/cgroup");
    if !root.join("cgroup.procs").exists() {
        run("mount", &["-t", "cgroup2", "cgroup2", "/sys/fs/cgroup"]);
    }
    let group = root.join(DRIVER_CGROUP);
    std::fs::create_dir_all(&group).unwrap();
    assert!(h.terminate().success());
    h.wrap = vec![
        "sh".into(),
        "-c".into(),
        format!("echo $$ > {}/cgroup.procs && exec \"$@\"", group.display()),
        "sh".into(),
    ];
    h.spawn().await;
    let cgroup = std::fs::read_to_string(format!("/proc/{}/cgroup", h.pid())).unwrap();
    assert_eq!(cgroup.trim(), format!("0::/{DRIVER_CGROUP}"));
}

/// The rules that make `server` stop answering this node. nfs, iSCSI and
/// NVMe/TCP: every packet to or from the server's port (they serve no one
/// else).
/// Ceph: to the monitor and the OSDs, the packets of the driver's tools
/// (its cgroup, see [`driver_into_cgroup`]) and of the kernel's client
/// (sockets no process owns: `meta skuid` matches only a process's); the
/// daemons go on talking to each other, and the test's ceph CLI to them.
fn cut_rules(server: &str, tgtd: &Tgtd, nvmet: &NvmetPort) -> Vec<String> {
    let both = |port: u16| {
        vec![
            format!("tcp dport {port} drop"),
            format!("tcp sport {port} drop"),
        ]
    };
    match server {
        "nfs" => both(2049),
        "iscsi" => both(tgtd.port),
        "nvmf" => both(nvmet.port),
        "rbd" => {
            let ports = ceph_ports()
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            vec![
                format!("tcp dport {{ {ports} }} socket cgroupv2 level 1 \"{DRIVER_CGROUP}\" drop"),
                format!("tcp dport {{ {ports} }} meta skuid 0 accept"),
                format!("tcp dport {{ {ports} }} drop"),
            ]
        }
        other => unreachable!("{other}"),
    }
}

/// `fut`, or a panic with the driver's log when it takes over 90 s (no
/// call of this test may wait that long).
async fn within<T>(h: &Harness, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(90), fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within 90 s\n{}", h.log()),
    }
}

/// NodeGetVolumeStats of a volume: whether it answered.
async fn stats_answered(h: &Harness, up: &Up) -> Result<(), tonic::Status> {
    h.node()
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: up.id.clone(),
            volume_path: up.target.display().to_string(),
            staging_target_path: up.staging.display().to_string(),
        })
        .await
        .map(|_| ())
}

/// A server that stops answering mid-I/O (its packets dropped in the
/// guest's network namespace), nfs, iSCSI, NVMe/TCP and Ceph in turn, each under a
/// pod writing to a volume of every backend. While it does not answer:
/// its pod's writes wait (the cut bites); the stage of another volume of
/// that server fails at the command deadline (20 s here,
/// `--command-timeout`) and leaves no mount, iscsiadm or rbd process
/// behind; every RPC on the other backends' volumes (health, stats, a
/// publish to another pod and its unpublish), asked while the cut
/// server's own volume's health and stats and NodeGetStorageHealth are
/// in flight, answers within half the command deadline (one held up by
/// the cut server would wait for all of it) and finds them healthy, and
/// those of the cut server's own volume answer within the call's
/// deadline. Once it answers again: its
/// pod's writes go on with none failed, and the first retry of the stage
/// succeeds. At the end nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_a_server_that_stops_answering_stalls_only_its_own_volumes() {
    require_guest();
    let deadline = Duration::from_secs(20);
    let every = every_backend_with("cut", &[]).await;
    let (mut h, unders) = (every.h, every.unders);
    // The pods' volumes come up under the default command timeout: a
    // fresh node's first NFS mount, iSCSI login or rbd map may take longer
    // than the test's deadline on a busy machine.
    let mut live = Vec::new();
    for u in &unders {
        let up = bring_up(&h, u, &format!("cut-{}", u.backend), false).await;
        let writer = Steady::start(up.target.join("steady"));
        live.push((u, up, writer));
    }
    // The deadline the cuts are measured against, from the driver's start
    // in its cgroup on (it finds the staged volumes as it left them).
    h.env.push((
        "FERROVOL_COMMAND_TIMEOUT".into(),
        deadline.as_secs().to_string(),
    ));
    driver_into_cgroup(&mut h).await;
    let mut report = Vec::new();
    for server in ["nfs", "iscsi", "nvmf", "rbd"] {
        let u = unders.iter().find(|u| u.backend == server).unwrap();
        let late = made(&h, u, &format!("late-{server}"), false).await;
        let cut = Cut::new(&cut_rules(server, &every.tgtd, &every.nvmet));
        let cut_at = Instant::now();
        let own = &live.iter().find(|(v, ..)| v.backend == server).unwrap().2;
        // The stage runs out its deadline while the pod's writes are
        // watched.
        let stage = tokio::spawn({
            let mut node = h.node();
            let req = stage_request(u, &late, false);
            async move {
                let t = Instant::now();
                let r = node.node_stage_volume(req).await;
                (r, t.elapsed())
            }
        });
        // The pod's writes are watched from the cut on: none goes through
        // while the rounds below run (at least 10 s: the stage runs out
        // its deadline meanwhile).
        let writes_at_cut = own.count();
        // Meanwhile, every volume asked, round after round: in each, the
        // cut server's own volume (its health, then its stats) and
        // NodeGetStorageHealth side by side with the other volumes'
        // calls, which must not wait on them.
        let (mut worst_other, mut worst_own, mut worst_storage) =
            (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut own_said = BTreeSet::new();
        let mut storage_said = BTreeSet::new();
        let mut rounds = 0;
        // Until the stage has failed and this node has seen the server
        // gone (NVMe/TCP: a refused connect fails in seconds, while the
        // live controller is seen down at its keep-alive), 30 s at most.
        let seen = |said: &BTreeSet<String>| {
            said.iter()
                .any(|s| s.starts_with("STORAGE_UNREACHABLE") && s.contains(&format!("{server}: ")))
        };
        while rounds == 0
            || !stage.is_finished()
            || (!seen(&storage_said) && cut_at.elapsed() < Duration::from_secs(30))
        {
            rounds += 1;
            let (_, own_up, _) = live.iter().find(|(v, ..)| v.backend == server).unwrap();
            // Each call timed on its own: a call held up by the cut
            // server's stuck command waits for that command's deadline,
            // however fast the machine; one that is not answers in its
            // own time, which a busy machine stretches.
            let own_calls = async {
                let t = Instant::now();
                let said = within(
                    &h,
                    &format!("health of {}", own_up.name),
                    node_health(&h, own_up),
                )
                .await;
                let health_took = t.elapsed();
                let t = Instant::now();
                let stats = within(
                    &h,
                    &format!("stats of {}", own_up.name),
                    stats_answered(&h, own_up),
                )
                .await;
                (said, stats, health_took + t.elapsed())
            };
            let storage_call = async {
                let t = Instant::now();
                let mut node = h.node();
                let storage = within(
                    &h,
                    "NodeGetStorageHealth",
                    node.node_get_storage_health(pb::NodeGetStorageHealthRequest::default()),
                )
                .await
                .unwrap_or_else(|e| panic!("NodeGetStorageHealth ({server} cut): {e:?}"))
                .into_inner();
                (storage, t.elapsed())
            };
            let other_calls = async {
                let mut worst = Duration::ZERO;
                for (v, up, _) in live.iter().filter(|(v, ..)| v.backend != server) {
                    let t = Instant::now();
                    let said =
                        within(&h, &format!("health of {}", up.name), node_health(&h, up)).await;
                    worst = worst.max(t.elapsed());
                    assert!(said.is_empty(), "{} ({server} cut): {said:?}", up.name);
                    let t = Instant::now();
                    within(&h, &format!("stats of {}", up.name), stats_answered(&h, up))
                        .await
                        .unwrap_or_else(|e| panic!("stats {} ({server} cut): {e:?}", up.name));
                    worst = worst.max(t.elapsed());
                    let other = h.path(&format!("kubelet/pods/{}-again", up.name));
                    let mut node = h.node();
                    let t = Instant::now();
                    within(
                        &h,
                        &format!("publish {}", up.name),
                        node.node_publish_volume(publish_req(
                            &up.id,
                            &up.staging,
                            &other,
                            cap_of(v, false),
                            false,
                        )),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("publish {} ({server} cut): {e:?}", up.name));
                    worst = worst.max(t.elapsed());
                    let t = Instant::now();
                    within(
                        &h,
                        &format!("unpublish {}", up.name),
                        node.node_unpublish_volume(unpublish_req(&up.id, &other)),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("unpublish {} ({server} cut): {e:?}", up.name));
                    worst = worst.max(t.elapsed());
                }
                worst
            };
            let ((said, stats, own_took), (storage, storage_took), other_took) =
                tokio::join!(own_calls, storage_call, other_calls);
            worst_own = worst_own.max(own_took);
            own_said.extend(said.into_iter().map(|(_, r)| r));
            if let Err(e) = stats {
                own_said.insert(format!("stats {:?}", e.code()));
            }
            worst_other = worst_other.max(other_took);
            worst_storage = worst_storage.max(storage_took);
            storage_said.extend(storage.backend_health.iter().map(|s| {
                let status =
                    pb::StorageHealthErrorType::try_from(s.status).map_or("?", |t| t.as_str_name());
                format!("{status} {}: {}", s.reason, s.message)
            }));
        }
        // The writes waited all along (10 s at least, whatever the rounds
        // took): one in flight at the cut may have ended, no other.
        let watched = cut_at.elapsed();
        if watched < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_secs(10) - watched);
        }
        assert!(
            own.count() <= writes_at_cut + 1,
            "{server}: the pod's writes went on with its server cut off ({} then {} after {:?})",
            writes_at_cut,
            own.count(),
            cut_at.elapsed()
        );
        let (staged, stage_took) = within(&h, "the stage", stage).await.unwrap();
        let e = staged.expect_err("a stage against a server that does not answer");
        assert!(
            stage_took < deadline * 3,
            "{server}: the stage took {stage_took:?}"
        );
        // Half the deadline: a call that waited on the cut server would
        // have waited for its deadline.
        assert!(
            worst_other < deadline / 2,
            "{server} cut: a call on another volume took {worst_other:?}"
        );
        // Each of these waits for one command deadline at most, not for
        // several one after another; the half deadline on top is the
        // calls' own time on a busy machine.
        assert!(
            worst_own < deadline * 2 + deadline / 2,
            "{server} cut: its own volume's health and stats took {worst_own:?}"
        );
        assert!(
            worst_storage < deadline + deadline / 2,
            "{server} cut: NodeGetStorageHealth took {worst_storage:?}"
        );
        // This node cannot reach the server, NodeGetStorageHealth said.
        assert!(
            seen(&storage_said),
            "{server} cut: NodeGetStorageHealth said {storage_said:?}"
        );
        // The helper the stage ran, killed at the deadline, is gone (a
        // check's own helper, started in the last round, is killed at the
        // command deadline too).
        let helpers: &[&str] = match server {
            "nfs" => &["mount.nfs", "mount"],
            "iscsi" => &["iscsiadm", "mount"],
            "nvmf" => &["mount"],
            _ => &["rbd", "ceph", "mount"],
        };
        let until = Instant::now() + deadline + Duration::from_secs(5);
        let left = loop {
            let left = running_named(helpers);
            if left.is_empty() || Instant::now() > until {
                break left;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(
            left.is_empty(),
            "{server} cut: processes left behind: {left:?}"
        );
        assert!(
            !h.mounts().contains(&late.staging),
            "{server}: the failed stage left its mount"
        );
        let cut_for = cut_at.elapsed();
        drop(cut);
        // Back: the pod's writes go on, the stage asked again succeeds.
        let resumed = own
            .next_write_within(Duration::from_secs(240))
            .unwrap_or_else(|| panic!("{server}: the pod's writes did not go on\n{}", h.log()));
        let t = Instant::now();
        let mut node = h.node();
        within(
            &h,
            "the stage asked again",
            node.node_stage_volume(stage_request(u, &late, false)),
        )
        .await
        .unwrap_or_else(|e| panic!("{server}: the stage asked again: {e:?}\n{}", h.log()));
        let retry_took = t.elapsed();
        h.node()
            .node_publish_volume(publish_req(
                &late.id,
                &late.staging,
                &late.target,
                cap_of(u, false),
                false,
            ))
            .await
            .unwrap_or_else(|e| panic!("{server}: publish after the retry: {e:?}\n{}", h.log()));
        std::fs::write(late.target.join("after"), b"the server is back").unwrap();
        std::fs::File::open(late.target.join("after"))
            .unwrap()
            .sync_all()
            .unwrap();
        h.unpublish_unstage(&late.id, &late.staging, &late.target)
            .await;
        drop_volume(&h, u, &late).await;
        report.push(format!(
            "{server} cut off for {cut_for:.1?}: its pod's writes waited, went on {resumed:.1?} \
             after it answered; the stage meanwhile failed in {stage_took:.1?} ({:?}: {}), the \
             first retry took {retry_took:.1?}; {rounds} rounds of calls: other volumes' at \
             most {worst_other:.2?} a call, its own volume's at most {worst_own:.2?} (said \
             {own_said:?}), NodeGetStorageHealth at most {worst_storage:.2?} (said \
             {storage_said:?})",
            e.code(),
            e.message(),
        ));
    }
    let mut writes = BTreeMap::new();
    for (u, up, writer) in live {
        writes.insert(up.name.clone(), writer.finish());
        h.unpublish_unstage(&up.id, &up.staging, &up.target).await;
        drop_volume(&h, u, &up).await;
    }
    assert!(h.terminate().success());
    assert!(h.mounts().is_empty(), "mounts: {:?}", h.mounts());
    let sessions = Iscsid::sessions();
    assert!(
        !sessions.iter().any(|s| s.contains("io.ferrovol.cut")),
        "iSCSI sessions: {sessions:?}"
    );
    assert!(rbd_mappings().is_empty(), "{:?}", rbd_mappings());
    every.nvmet.assert_clean();
    let procs = running_named(&[
        "mount",
        "mount.nfs",
        "umount",
        "umount.nfs",
        "iscsiadm",
        "rbd",
    ]);
    assert!(procs.is_empty(), "processes left: {procs:?}");
    for line in report {
        println!("{line}");
    }
    println!("synced writes per volume, none failed: {writes:?}");
    drop((every.server, every.tgtd));
}

/// What ControllerGetVolumeHealth says of a volume: its reasons.
async fn controller_reasons(h: &Harness, id: &str) -> BTreeSet<String> {
    h.controller_health(id)
        .await
        .health_statuses
        .into_iter()
        .map(|e| e.reason)
        .collect()
}

/// What filling a volume came to: MiB written (each synced) when the
/// controller first said `warning`, and when the first write or sync
/// failed, with its error.
struct Filled {
    warned_at: Option<u64>,
    failed_at: u64,
    error: std::io::Error,
}

/// Writes `mib` MiB to `file`, synced.
fn write_mib(file: &Path, mib: usize) {
    use std::io::Write;
    let mut f = std::fs::File::create(file).unwrap();
    for _ in 0..mib {
        f.write_all(&[0x3Cu8; 1 << 20]).unwrap();
    }
    f.sync_all().unwrap();
}

/// Writes 1 MiB at a time to `file`, each synced, asking the
/// controller after each what it says of volume `id`, until a write or
/// its sync fails (at most `limit` MiB).
async fn fill_until_refused(
    h: &Harness,
    id: &str,
    file: &Path,
    warning: &str,
    limit: u64,
) -> Filled {
    use std::io::Write;
    let mut f = std::fs::File::create(file).unwrap();
    let chunk = vec![0xA5u8; 1 << 20];
    let mut warned_at = None;
    for mib in 0..limit {
        if let Err(error) = f.write_all(&chunk).and_then(|_| f.sync_data()) {
            return Filled {
                warned_at,
                failed_at: mib,
                error,
            };
        }
        if warned_at.is_none() && controller_reasons(h, id).await.contains(warning) {
            warned_at = Some(mib + 1);
        }
    }
    panic!("{} took {limit} MiB without an error", file.display());
}

/// A pool that fills under volumes that overcommit it: the file backend's
/// pool (a filesystem of its own) under a sparse image, and an LVM thin
/// pool (made with `--errorwhenfull y`) under a thin volume. Each is
/// filled by a pod writing 1 MiB at a time, synced: the controller says the
/// pool is nearly full (its threshold) before the first write fails; the
/// writer's error is the kernel's (an I/O error: a filesystem's journal on a
/// device with no room left fails, and ext4 makes itself read-only); the
/// node then says so and refuses to hand that filesystem to another pod,
/// and lets go of it at unstage. A volume made with room of its own
/// (`preallocate`) in the full file pool fills its own filesystem, and its
/// writer's error is ENOSPC. A pod writing to a volume elsewhere on the
/// node (a thick LV) never stops, and its calls answer. Deleting the
/// filling volumes gives the room back: the warnings clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_a_full_pool_is_said_first_and_fails_only_its_own_writers() {
    require_guest();
    // The file pool on a filesystem of its own (96 MiB), so that filling
    // it fills nothing else.
    let dir = tempfile::tempdir().unwrap();
    let pool_image = dir.path().join("pool.img");
    std::fs::File::create(&pool_image)
        .unwrap()
        .set_len(96 << 20)
        .unwrap();
    run(
        "mkfs.ext4",
        &["-q", "-m", "0", pool_image.to_str().unwrap()],
    );
    let pool = dir.path().join("pool");
    std::fs::create_dir(&pool).unwrap();
    run(
        "mount",
        &[
            "-o",
            "loop",
            pool_image.to_str().unwrap(),
            pool.to_str().unwrap(),
        ],
    );
    let vg = LvmVg::new("fvfull", 320);
    vg.thin_pool("pool", "48m", &[]);
    vg.lvm("lvchange", &["--errorwhenfull", "y", "fvfull/pool"]);
    let config = format!(
        "[[backend]]\ntype = \"file\"\npool = \"{}\"\n\
         [[backend]]\ntype = \"lvm\"\n\
         [[backend.device_class]]\nname = \"thin\"\nvolume_group = \"fvfull\"\nthin_pool = \"pool\"\n\
         [[backend.device_class]]\nname = \"thick\"\nvolume_group = \"fvfull\"\n",
        pool.display()
    );
    let h = Harness::start_with_env(Some(&config), &[("FERROVOL_VOLUME_HEALTH", "true")]).await;
    let volume = |name: &str, size: i64, backend: &str, class: Option<&str>| {
        let mut req = create_req(name, size, mount_cap("ext4", SNW));
        req.parameters.insert("backend".into(), backend.into());
        if let Some(class) = class {
            req.parameters.insert("deviceClass".into(), class.into());
        }
        req
    };
    // Elsewhere on the node: a pod writing to a thick LV.
    let elsewhere = h
        .provision_req(volume("full-elsewhere", 32 * MIB, "lvm", Some("thick")))
        .await;
    let steady = Steady::start(elsewhere.target.join("steady"));
    // Room of its own in the file pool, taken before the pool fills.
    let own = h
        .provision_req(volume("full-own", 24 * MIB, "file", None))
        .await;
    h.controller()
        .controller_modify_volume(pb::ControllerModifyVolumeRequest {
            volume_id: own.id.clone(),
            secrets: HashMap::new(),
            mutable_parameters: HashMap::from([("preallocate".into(), "true".into())]),
        })
        .await
        .unwrap_or_else(|e| panic!("preallocate: {e:?}\n{}", h.log()));
    let mut lines = Vec::new();
    let mut filled = Vec::new();
    // Each pool overcommitted by two volumes that each fit it when made
    // (the backends refuse a volume the pool could not hold now): another
    // tenant writes some of its volume first, then the pod fills its own.
    for (name, backend, class, warning, size, tenant_writes) in [
        ("full-sparse", "file", None, "PoolNearlyFull", 40 * MIB, 30),
        (
            "full-thin",
            "lvm",
            Some("thin"),
            "ThinPoolNearlyFull",
            40 * MIB,
            24,
        ),
    ] {
        let tenant = h
            .provision_req(volume(&format!("{name}-tenant"), size, backend, class))
            .await;
        let v = h.provision_req(volume(name, size, backend, class)).await;
        assert!(controller_reasons(&h, &v.id).await.is_empty());
        write_mib(&tenant.target.join("data"), tenant_writes);
        let began = Instant::now();
        let f = fill_until_refused(&h, &v.id, &v.target.join("fill"), warning, 64).await;
        let took = began.elapsed();
        let warned_at = f.warned_at.unwrap_or_else(|| {
            panic!(
                "{name}: no {warning} before the writes failed ({})",
                f.error
            )
        });
        assert!(
            warned_at <= f.failed_at,
            "{name}: warned at {warned_at} MiB, failed at {}",
            f.failed_at
        );
        // Contained: the pod elsewhere goes on, its calls answer.
        assert!(
            steady.next_write_within(Duration::from_secs(10)).is_some(),
            "{name}: the pod elsewhere stopped writing"
        );
        let up = Up {
            id: elsewhere.id.clone(),
            name: "full-elsewhere".into(),
            staging: elsewhere.staging.clone(),
            target: elsewhere.target.clone(),
            publish_context: HashMap::new(),
            volume_context: HashMap::new(),
        };
        assert!(node_health(&h, &up).await.is_empty());
        // The filled volume: what the node says of it a moment later
        // (a write error on data leaves the filesystem sound; one on its
        // journal makes ext4 read-only), and a filesystem that met errors
        // is not handed to another pod.
        let filled_up = Up {
            id: v.id.clone(),
            name: name.into(),
            staging: v.staging.clone(),
            target: v.target.clone(),
            publish_context: HashMap::new(),
            volume_context: HashMap::new(),
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        let said = node_health(&h, &filled_up).await;
        let other = h.path(&format!("kubelet/pods/{name}-2"));
        let published = h
            .node()
            .node_publish_volume(publish_req(
                &v.id,
                &v.staging,
                &other,
                mount_cap("ext4", SNW),
                false,
            ))
            .await;
        match said.iter().any(|(_, r)| r.starts_with("Filesystem")) {
            true => assert_eq!(
                published
                    .expect_err("a filesystem with errors, published")
                    .code(),
                tonic::Code::FailedPrecondition
            ),
            false => {
                published.unwrap_or_else(|e| panic!("{name}: a sound filesystem: {e:?}"));
                h.node()
                    .node_unpublish_volume(unpublish_req(&v.id, &other))
                    .await
                    .unwrap();
            }
        }
        lines.push(format!(
            "{name}: {warning} said after {warned_at} MiB; the write of MiB {} failed ({}, errno \
             {:?}) after {took:.1?}; the node then said {said:?}",
            f.failed_at + 1,
            f.error,
            f.error.raw_os_error()
        ));
        filled.push((v, f.error));
        filled.push((tenant, std::io::Error::other("the other tenant")));
    }
    // In the full file pool, the volume with room of its own fills its
    // own filesystem: ENOSPC.
    let pool_free = std::fs::metadata(&pool)
        .map(|_| run("df", &["--output=avail", "-B1", pool.to_str().unwrap()]))
        .unwrap();
    let f = fill_until_refused(&h, &own.id, &own.target.join("fill"), "PoolNearlyFull", 64).await;
    assert_eq!(
        f.error.raw_os_error(),
        Some(28),
        "a preallocated volume's writer in a full pool: {}",
        f.error
    );
    assert!(f.failed_at >= 16, "only {} MiB of 24 written", f.failed_at);
    lines.push(format!(
        "full-own (preallocated, 24 MiB, the pool full: {} bytes free): the write of MiB {} \
         failed: {}",
        pool_free.lines().last().unwrap_or("").trim(),
        f.failed_at + 1,
        f.error
    ));
    // Torn down; the room back, the warnings clear.
    for (v, _) in &filled {
        h.unpublish_unstage(&v.id, &v.staging, &v.target).await;
        h.delete_volume(&v.id).await;
    }
    h.unpublish_unstage(&own.id, &own.staging, &own.target)
        .await;
    h.delete_volume(&own.id).await;
    assert!(controller_reasons(&h, &elsewhere.id).await.is_empty());
    let writes = steady.finish();
    h.unpublish_unstage(&elsewhere.id, &elsewhere.staging, &elsewhere.target)
        .await;
    h.delete_volume(&elsewhere.id).await;
    let storage = h.storage_health().await;
    assert!(storage.is_empty(), "{storage:?}");
    drop(h);
    for line in lines {
        println!("{line}");
    }
    println!("the pod elsewhere (a thick LV) wrote {writes} synced writes, none failed");
    run("umount", &[pool.to_str().unwrap()]);
    drop(vg);
}

/// rbd: a client that no node the volume is published to recorded opens
/// its image (`rbd watch` as the admin, as a mapping left on another node
/// would hold it). The controller and the node say `WatchersElsewhere`
/// (DEGRADED), naming that client and not the node's own mapping; once it
/// closes the image, both say nothing again.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_rbd_health_names_a_client_no_node_recorded() {
    require_guest();
    let cluster = CephCluster::shared();
    let h = Harness::start_with_env(
        Some(&cluster.backend_config("guest")),
        &[("FERROVOL_VOLUME_HEALTH", "true")],
    )
    .await;
    let u = Under {
        backend: "rbd",
        attach: true,
        block: false,
        secrets: cluster.secrets(),
    };
    let up = bring_up(&h, &u, "watched", false).await;
    let image = up.id.rsplit('.').next().unwrap().to_string();
    let spec = format!("{}/{image}", cluster.pool);
    let watchers = || -> Vec<String> {
        let status: serde_json::Value =
            serde_json::from_str(&cluster.rbd(&["status", &spec, "--format", "json"])).unwrap();
        status["watchers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["address"].as_str().unwrap().to_string())
            .collect()
    };
    let own = watchers();
    assert_eq!(own.len(), 1, "the node's mapping alone: {own:?}");
    assert_eq!(node_health(&h, &up).await, BTreeSet::new());
    assert_eq!(h.controller_health(&up.id).await.health_statuses, vec![]);

    let mut watch = std::process::Command::new("rbd")
        .args(["-c", cluster.conf.to_str().unwrap(), "watch", &spec])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    h.wait_until("the second client to watch the image", &|| {
        watchers().len() == 2
    });
    let other: Vec<String> = watchers()
        .into_iter()
        .filter(|w| !own.contains(w))
        .collect();
    let t = Instant::now();
    let c = h.controller_health(&up.id).await;
    let controller_took = t.elapsed();
    assert_eq!(c.health_statuses.len(), 1, "{c:?}");
    let said = &c.health_statuses[0];
    assert_eq!(
        (said.status, said.reason.as_str()),
        (
            pb::VolumeHealthErrorType::Degraded as i32,
            "WatchersElsewhere"
        ),
        "{c:?}"
    );
    let bare = |a: &str| {
        a.trim_start_matches("v1:")
            .trim_start_matches("v2:")
            .to_string()
    };
    assert!(
        said.message.contains(&bare(&other[0])) && !said.message.contains(&bare(&own[0])),
        "other {other:?}, own {own:?}: {}",
        said.message
    );
    let t = Instant::now();
    assert_eq!(
        node_health(&h, &up).await,
        BTreeSet::from([(
            pb::VolumeHealthErrorType::Degraded as i32,
            "WatchersElsewhere".to_string()
        )])
    );
    let node_took = t.elapsed();

    // It closes the image (rbd watch ends at a line on its input).
    use std::io::Write;
    watch.stdin.take().unwrap().write_all(b"\n").unwrap();
    assert!(watch.wait().unwrap().success());
    h.wait_until("the other client to let go", &|| watchers().len() == 1);
    assert_eq!(h.controller_health(&up.id).await.health_statuses, vec![]);
    assert_eq!(node_health(&h, &up).await, BTreeSet::new());
    println!(
        "rbd, a client no node recorded: the controller said WatchersElsewhere in \
         {controller_took:.2?}, the node in {node_took:.2?}; cleared once it let go"
    );
    h.unpublish_unstage(&up.id, &up.staging, &up.target).await;
    drop_volume(&h, &u, &up).await;
}
