//! I/O limits per volume on the real kernel: the limits a class sets are
//! written to `io.max` of the pod's cgroup (made here as kubelet makes
//! it, with either cgroup driver) at NodePublish, for the device the
//! pod's I/O goes to, and fio run inside that cgroup is held to them;
//! without them, or outside the pod, it is not.

use super::*;
use ferrovol::host::iolimit::{Cgroups, Limits, POD_UID_KEY};
use std::path::{Path, PathBuf};

/// The cgroup v2 tree, mounted where kubelet and the driver look for it
/// (the guest boots without one there).
const ROOT: &str = "/sys/fs/cgroup";

fn mount_cgroups() {
    if !Path::new(ROOT).join("cgroup.procs").exists() {
        run("mount", &["-t", "cgroup2", "cgroup2", ROOT]);
    }
}

/// A pod's cgroup as kubelet makes it, the io controller enabled down to
/// it: the systemd driver's place for a Burstable pod, or the cgroupfs
/// driver's for a BestEffort one. Dropped, it is removed with the parents
/// it made.
struct PodCgroup {
    uid: String,
    dir: PathBuf,
    made: Vec<PathBuf>,
}

impl PodCgroup {
    fn new(uid: &str, systemd: bool) -> Self {
        mount_cgroups();
        let root = PathBuf::from(ROOT);
        let unit = uid.replace('-', "_");
        let parts: Vec<String> = match systemd {
            true => vec![
                "kubepods.slice".into(),
                "kubepods-burstable.slice".into(),
                format!("kubepods-burstable-pod{unit}.slice"),
            ],
            false => vec!["kubepods".into(), "besteffort".into(), format!("pod{uid}")],
        };
        let mut made = Vec::new();
        let mut dir = root.clone();
        for part in parts {
            std::fs::write(dir.join("cgroup.subtree_control"), "+io").unwrap();
            dir = dir.join(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).unwrap();
                made.push(dir.clone());
            }
        }
        PodCgroup {
            uid: uid.into(),
            dir,
            made,
        }
    }

    /// What `io.max` says for device `dev`.
    fn limits_on(&self, dev: (u64, u64)) -> Limits {
        Cgroups::new(ROOT.into()).get(&self.dir, dev).unwrap()
    }

    /// fio in this cgroup (or, `None`, in the test's own), `rw` at block
    /// size `bs`, direct, for 3 s after a 1 s ramp (in a pod; 2 s outside
    /// one): (IOPS, bytes/s) of the direction it ran.
    fn fio(pod: Option<&PodCgroup>, file: &Path, rw: &str, bs: &str) -> (f64, f64) {
        let (enter, runtime) = match pod {
            Some(p) => (format!("echo $$ > {}/cgroup.procs && ", p.dir.display()), 3),
            None => (String::new(), 2),
        };
        let script = format!(
            "{enter}exec fio --name=limit --filename={} --rw={rw} --bs={bs} --direct=1 \
             --ioengine=psync --size=8M --ramp_time=1 --runtime={runtime} --time_based \
             --output-format=json",
            file.display()
        );
        let out = run("sh", &["-c", &script]);
        let json: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
        let dir = if rw.contains("read") { "read" } else { "write" };
        let job = &json["jobs"][0][dir];
        (
            job["iops"].as_f64().unwrap(),
            job["bw_bytes"].as_f64().unwrap(),
        )
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for d in self.made.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// A volume made with the class's parameters `params` (the backend's
/// selector among them), attached where the backend attaches, and
/// staged.
struct Staged {
    id: String,
    cap: pb::VolumeCapability,
    staging: PathBuf,
    context: HashMap<String, String>,
    attach: bool,
    block: bool,
}

async fn staged(
    h: &Harness,
    name: &str,
    block: bool,
    params: &[(&str, &str)],
    secrets: &HashMap<String, String>,
    attach: bool,
) -> Staged {
    staged_on(h, h, name, block, params, secrets, attach).await
}

/// [`staged`] with the controller and the node in two processes.
async fn staged_on(
    ctl: &Harness,
    h: &Harness,
    name: &str,
    block: bool,
    params: &[(&str, &str)],
    secrets: &HashMap<String, String>,
    attach: bool,
) -> Staged {
    let cap = match block {
        true => block_cap(SNW),
        false => mount_cap("ext4", SNW),
    };
    let mut req = create_req(name, 32 * MIB, cap.clone());
    for (k, v) in params {
        req.parameters.insert(k.to_string(), v.to_string());
    }
    req.secrets = secrets.clone();
    let vol = ctl.create(req).await;
    let publish_context = match attach {
        true => {
            ctl.controller()
                .controller_publish_volume(pb::ControllerPublishVolumeRequest {
                    volume_id: vol.volume_id.clone(),
                    node_id: h.node_id().await,
                    volume_capability: Some(cap.clone()),
                    secrets: secrets.clone(),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("attach {name}: {e:?}\n{}", ctl.log()))
                .into_inner()
                .publish_context
        }
        false => HashMap::new(),
    };
    let staging = h.path(&format!("kubelet/staging/{name}"));
    std::fs::create_dir_all(&staging).unwrap();
    h.node()
        .node_stage_volume(pb::NodeStageVolumeRequest {
            secrets: secrets.clone(),
            publish_context,
            volume_context: vol.volume_context.clone(),
            ..stage_req(&vol.volume_id, &staging, cap.clone())
        })
        .await
        .unwrap_or_else(|e| panic!("stage {name}: {e:?}\n{}", h.log()));
    Staged {
        id: vol.volume_id,
        cap,
        staging,
        context: vol.volume_context,
        attach,
        block,
    }
}

impl Staged {
    /// NodePublish for the pod of `uid` (none: a publish that names no
    /// pod) at `kubelet/pods/<name>`; the file fio reads and writes there
    /// (the device, or an 8 MiB file written beforehand, outside any pod).
    async fn publish(&self, h: &Harness, name: &str, uid: Option<&str>) -> (PathBuf, PathBuf) {
        let target = h.path(&format!("kubelet/pods/{name}"));
        let mut context = self.context.clone();
        if let Some(uid) = uid {
            context.insert(POD_UID_KEY.into(), uid.into());
        }
        h.node()
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_context: context,
                ..publish_req(&self.id, &self.staging, &target, self.cap.clone(), false)
            })
            .await
            .unwrap_or_else(|e| panic!("publish {name}: {e:?}\n{}", h.log()));
        let file = match self.block {
            true => target.clone(),
            false => {
                let f = target.join("fio.dat");
                if !f.exists() {
                    run(
                        "dd",
                        &[
                            "if=/dev/zero",
                            &format!("of={}", f.display()),
                            "bs=1M",
                            "count=8",
                            "conv=fsync",
                            "status=none",
                        ],
                    );
                }
                f
            }
        };
        (target, file)
    }

    /// The device the node stages the volume on (its number), as the
    /// mount table or the target's device node says.
    fn dev(&self, target: &Path) -> (u64, u64) {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(target).unwrap();
        let raw = if self.block { m.rdev() } else { m.dev() };
        (
            nix::sys::stat::major(raw) as u64,
            nix::sys::stat::minor(raw) as u64,
        )
    }

    async fn drop_all(self, h: &Harness, secrets: &HashMap<String, String>) {
        self.drop_on(h, h, secrets).await
    }

    /// Unstaged on `h`'s node, detached from it and deleted by `ctl`.
    async fn drop_on(self, ctl: &Harness, h: &Harness, secrets: &HashMap<String, String>) {
        h.node()
            .node_unstage_volume(unstage_req(&self.id, &self.staging))
            .await
            .unwrap();
        if self.attach {
            ctl.controller()
                .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                    volume_id: self.id.clone(),
                    node_id: h.node_id().await,
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("detach {}: {e:?}\n{}", self.id, ctl.log()));
        }
        ctl.controller()
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: self.id.clone(),
                secrets: secrets.clone(),
            })
            .await
            .unwrap();
    }
}

/// `measured` within 10% of `limit`.
fn near(what: &str, measured: f64, limit: f64) {
    if let Some(wrong) = off_limit(what, measured, limit) {
        panic!("{wrong}");
    }
}

/// What is wrong when `measured` is not within 10% of `limit`.
fn off_limit(what: &str, measured: f64, limit: f64) -> Option<String> {
    ((measured - limit).abs() > limit * 0.1)
        .then(|| format!("{what}: {measured:.1} against a limit of {limit}"))
}

const UID_A: &str = "3f1c2b4a-5d6e-4f70-8a9b-0c1d2e3f4a5b";
const UID_B: &str = "9e8d7c6b-5a49-4382-9170-6f5e4d3c2b1a";

/// The limits, and how each is measured: 4 KiB random reads and writes
/// for the operations, 64 KiB sequential ones for the bytes.
/// Low enough that the slowest backend under the guest's emulated CPU
/// (rbd: about 390 random reads a second, 12 MiB/s written) runs well
/// over three times as fast unlimited, on a busy machine too.
const IOPS: u64 = 50;
const BPS: u64 = 2 << 20;

/// The limits a class sets are the pod's, on every block backend: fio in
/// the pod's cgroup (the systemd driver's Burstable place) reads and
/// writes within 10% of each limit (4 KiB random I/O against the
/// operations, 64 KiB sequential I/O against the bytes), and the same
/// runs with no limit set are at least three times faster; `io.max`
/// names the device the pod's I/O goes to (the loop device, the LV, the
/// iSCSI disk, the NVMe head, the rbd device) and nothing is left in it
/// after the unpublish.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_io_limits_hold_a_pod_s_fio_on_every_block_backend() {
    require_guest();
    let every = EveryBackend::new("iolim", 256, false);
    let h = Harness::start_with(Some(&every.config)).await;
    let none = HashMap::new();
    let ceph = every.cluster.secrets();
    let iops = IOPS.to_string();
    let bps = format!("{}Mi", BPS >> 20);
    let mut report = Vec::new();
    let luks = HashMap::from([(
        "encryptionPassphrase".to_string(),
        "limits hold above the cipher".to_string(),
    )]);
    for (backend, encrypted, block, attach, secrets) in [
        ("file", false, false, false, &none),
        ("file", true, false, false, &luks),
        ("lvm", false, true, false, &none),
        ("iscsi", false, false, true, &none),
        ("nvmf", false, true, true, &none),
        ("rbd", false, false, true, &ceph),
    ] {
        let name = match encrypted {
            true => format!("lim-{backend}-luks"),
            false => format!("lim-{backend}"),
        };
        let limited = staged(
            &h,
            &name,
            block,
            &[
                ("backend", backend),
                ("encrypted", if encrypted { "true" } else { "false" }),
                ("readIops", &iops),
                ("writeIops", &iops),
                ("readBps", &bps),
                ("writeBps", &bps),
            ],
            secrets,
            attach,
        )
        .await;
        let pod = PodCgroup::new(UID_A, true);
        let (target, file) = limited.publish(&h, &name, Some(&pod.uid)).await;
        let dev = limited.dev(&target);
        if encrypted {
            // The LUKS mapping the filesystem is on, not the loop device
            // under it.
            let name =
                std::fs::read_to_string(format!("/sys/dev/block/{}:{}/dm/name", dev.0, dev.1))
                    .unwrap_or_default();
            assert!(
                name.starts_with("fvc-"),
                "{dev:?} is not a LUKS mapping: {name:?}"
            );
        }
        assert_eq!(
            pod.limits_on(dev),
            Limits {
                read_iops: Some(IOPS),
                write_iops: Some(IOPS),
                read_bps: Some(BPS),
                write_bps: Some(BPS),
            },
            "{backend}: io.max of the pod for {dev:?}"
        );
        let rr = PodCgroup::fio(Some(&pod), &file, "randread", "4k");
        let rw = PodCgroup::fio(Some(&pod), &file, "randwrite", "4k");
        let sr = PodCgroup::fio(Some(&pod), &file, "read", "64k");
        let sw = PodCgroup::fio(Some(&pod), &file, "write", "64k");
        near(&format!("{backend}: read IOPS"), rr.0, IOPS as f64);
        near(&format!("{backend}: write IOPS"), rw.0, IOPS as f64);
        near(&format!("{backend}: read bytes/s"), sr.1, BPS as f64);
        near(&format!("{backend}: write bytes/s"), sw.1, BPS as f64);
        // The same volume outside the pod: not limited.
        let free_r = PodCgroup::fio(None, &file, "randread", "4k");
        let free_w = PodCgroup::fio(None, &file, "write", "64k");
        assert!(
            free_r.0 >= 3.0 * IOPS as f64,
            "{backend}: unlimited reads {free_r:?}"
        );
        assert!(
            free_w.1 >= 3.0 * BPS as f64,
            "{backend}: unlimited writes {free_w:?}"
        );
        h.node()
            .node_unpublish_volume(unpublish_req(&limited.id, &target))
            .await
            .unwrap();
        assert!(pod.limits_on(dev).is_empty(), "{backend}: left in io.max");
        report.push(format!(
            "{name} ({}): limited to {IOPS} IOPS and {} MiB/s: read {:.0} IOPS, write {:.0} \
             IOPS, read {:.2} MiB/s, write {:.2} MiB/s; unlimited: read {:.0} IOPS, write {:.1} \
             MiB/s",
            match (block, encrypted) {
                (true, _) => "raw block",
                (false, true) => "ext4 on LUKS2",
                (false, false) => "ext4",
            },
            BPS >> 20,
            rr.0,
            rw.0,
            sr.1 / MIB as f64,
            sw.1 / MIB as f64,
            free_r.0,
            free_w.1 / MIB as f64,
        ));
        limited.drop_all(&h, secrets).await;
    }
    for line in report {
        println!("{line}");
    }
}

/// Two pods on one volume (a filesystem on the file backend), one in each
/// driver's place: each pod's cgroup gets the limit on the volume's
/// device, and the unpublish of one leaves the other's in place; a
/// publish for a pod whose cgroup is not there succeeds, warns, and the
/// volume's health says `IoLimitNotApplied` until that target goes; a
/// publish naming no pod likewise. Killed at `publish.limited`, the next
/// start writes the recorded limits and the retry finds the publish done.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_io_limits_are_each_pod_s_outlive_a_kill_and_a_pod_without_a_cgroup_is_published_unlimited(
) {
    require_guest();
    let (_local, mut h, port) = metered("iolim2").await;
    let none = HashMap::new();
    let vol = staged(
        &h,
        "lim-two",
        false,
        &[("backend", "file"), ("writeIops", "50")],
        &none,
        false,
    )
    .await;
    let sample = |uid: &str, family: &str, key: &str| sample(port, family, &vol.id, uid, key);
    let (a, b) = (PodCgroup::new(UID_A, true), PodCgroup::new(UID_B, false));
    let (ta, fa) = vol.publish(&h, "lim-two-a", Some(&a.uid)).await;
    let (tb, fb) = vol.publish(&h, "lim-two-b", Some(&b.uid)).await;
    let dev = vol.dev(&ta);
    let fifty = Limits {
        write_iops: Some(50),
        ..Default::default()
    };
    assert_eq!(a.limits_on(dev), fifty);
    assert_eq!(b.limits_on(dev), fifty);
    let stalled = |uid: &str| stalled(port, &vol.id, uid).expect("no stall sample");
    let idle = (stalled(UID_A), stalled(UID_B));
    near(
        "pod A's writes",
        PodCgroup::fio(Some(&a), &fa, "randwrite", "4k").0,
        50.0,
    );
    near(
        "pod B's writes",
        PodCgroup::fio(Some(&b), &fb, "randwrite", "4k").0,
        50.0,
    );
    // The metrics: each pod's limit, and its writes on the device (about
    // 200 in the 4 s fio ran, its ramp's included).
    for uid in [UID_A, UID_B] {
        assert_eq!(sample(uid, "volume_io_limit", "writeIops"), Some(50));
        let writes = sample(uid, "volume_pod_io", "wios").unwrap_or(0);
        assert!(
            (150..=260).contains(&writes),
            "{uid}: {writes} writes counted"
        );
    }
    // And how long each stalled on I/O (its cgroup's io.pressure), by
    // the write: held to 50 a second, each write waits about 20 ms, of
    // which the kernel's pressure counted about half (10.7 ms; 0.07 ms
    // with no limit, 2026-12-04).
    for (uid, before) in [(UID_A, idle.0), (UID_B, idle.1)] {
        let waited = stalled(uid) - before;
        let writes = sample(uid, "volume_pod_io", "wios").unwrap_or(1).max(1);
        let per_write = waited * 1e3 / writes as f64;
        println!(
            "pod {uid}: stalled on I/O {waited:.2} s in its 4 s of fio at 50 writes a second, \
             {per_write:.1} ms a write"
        );
        assert!(before < 1.0, "{uid}: stalled {before} s before any I/O");
        assert!(
            waited <= 8.0 && per_write >= 5.0,
            "{uid}: stalled {waited} s, {per_write} ms a write"
        );
    }
    let said = h
        .node()
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: vol.id.clone(),
            volume_path: tb.display().to_string(),
            staging_target_path: vol.staging.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner()
        .volume_condition
        .unwrap_or_default()
        .message;
    assert!(
        said.contains("writeIops=50; the pod stalled on I/O "),
        "{said}"
    );
    h.node()
        .node_unpublish_volume(unpublish_req(&vol.id, &ta))
        .await
        .unwrap();
    assert!(a.limits_on(dev).is_empty());
    assert_eq!(b.limits_on(dev), fifty, "B's limit went with A's unpublish");
    assert_eq!(sample(UID_A, "volume_io_limit", "writeIops"), None);
    assert_eq!(sample(UID_B, "volume_io_limit", "writeIops"), Some(50));
    near(
        "pod B's writes after A left",
        PodCgroup::fio(Some(&b), &fb, "randwrite", "4k").0,
        50.0,
    );

    // A pod with no cgroup here, and a publish that names none.
    let health = |target: PathBuf| {
        let h = &h;
        let id = vol.id.clone();
        let staging = vol.staging.clone();
        async move {
            h.node()
                .node_get_volume_health(pb::NodeGetVolumeHealthRequest {
                    volume_id: id,
                    volume_publish_path: target.display().to_string(),
                    staging_target_path: staging.display().to_string(),
                })
                .await
                .unwrap()
                .into_inner()
                .volume_health
                .unwrap_or_default()
                .health_statuses
        }
    };
    assert!(health(tb.clone()).await.is_empty());
    let (tc, _) = vol
        .publish(
            &h,
            "lim-two-c",
            Some("00000000-0000-4000-8000-00000000c0de"),
        )
        .await;
    let (td, _) = vol.publish(&h, "lim-two-d", None).await;
    let said = health(tc.clone()).await;
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(said[0].reason, "IoLimitNotApplied", "{said:?}");
    for (target, why) in [(&tc, "no cgroup of pod"), (&td, "the publish names no pod")] {
        let told = format!("{}: {why}", target.display());
        assert!(said[0].message.contains(&told), "{said:?}");
    }
    assert!(h
        .log()
        .contains("the volume's I/O limits are not set for this pod"));
    for t in [&tb, &tc, &td] {
        h.node()
            .node_unpublish_volume(unpublish_req(&vol.id, t))
            .await
            .unwrap();
    }
    assert!(b.limits_on(dev).is_empty());
    assert!(health(tb).await.is_empty());

    // Killed at `publish.limited` (bound, the limits recorded, not yet
    // written): the next start writes them, the CO's retry of the publish
    // finds it done, and the unpublish clears them.
    h.env
        .push(("FERROVOL_KILL_AT".into(), "publish.limited".into()));
    h.kill();
    h.spawn().await;
    let tk = h.path("kubelet/pods/lim-two-k");
    let mut context = vol.context.clone();
    context.insert(POD_UID_KEY.into(), UID_A.into());
    let publish = pb::NodePublishVolumeRequest {
        volume_context: context,
        ..publish_req(&vol.id, &vol.staging, &tk, vol.cap.clone(), false)
    };
    let died = h.node().node_publish_volume(publish.clone()).await;
    assert!(died.is_err(), "{died:?}");
    h.kill();
    assert!(a.limits_on(dev).is_empty(), "written before the kill point");
    h.env.retain(|(k, _)| k != "FERROVOL_KILL_AT");
    h.spawn().await;
    assert_eq!(a.limits_on(dev), fifty, "not written again at start");
    h.node()
        .node_publish_volume(publish)
        .await
        .unwrap_or_else(|e| panic!("the retry: {e:?}\n{}", h.log()));
    assert_eq!(a.limits_on(dev), fifty);
    h.node()
        .node_unpublish_volume(unpublish_req(&vol.id, &tk))
        .await
        .unwrap();
    assert!(a.limits_on(dev).is_empty());
    vol.drop_all(&h, &none).await;
}

/// A driver on the local backends (named `name`), serving metrics on the
/// port answered.
async fn metered(name: &str) -> (LocalBackends, Harness, u16) {
    let local = LocalBackends::new(name, 64);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let h = Harness::start_with_env(Some(&local.config), &[("FERROVOL_METRICS_ADDR", &addr)]).await;
    (local, h, port)
}

/// The metrics' sample of `family` for a pod's key on a volume, if there
/// is one.
fn sample(port: u16, family: &str, volume: &str, uid: &str, key: &str) -> Option<u64> {
    sample_text(port, family, volume, uid, key).map(|v| v.parse().unwrap())
}

/// Pod `uid`'s stall on I/O (`some`) as the metrics give it for `volume`,
/// in seconds.
fn stalled(port: u16, volume: &str, uid: &str) -> Option<f64> {
    sample_text(port, "volume_pod_io_stalled_seconds", volume, uid, "some")
        .map(|v| v.parse().unwrap())
}

/// The text of the metrics' sample of `family` for a pod's key on a
/// volume, if there is one.
fn sample_text(port: u16, family: &str, volume: &str, uid: &str, key: &str) -> Option<String> {
    let text = http_get(port, "/metrics").unwrap().1;
    let want =
        format!("ferrovol_{family}{{volume_id=\"{volume}\",pod_uid=\"{uid}\",key=\"{key}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&want))
        .map(|v| v.trim().to_string())
}

/// fio writing 4 KiB at random in `pod` for `secs` seconds, started on a
/// thread: each second's write IOPS, in order, once it is done.
fn fio_by_second(pod: &PodCgroup, file: &Path, secs: u32) -> std::thread::JoinHandle<Vec<f64>> {
    let log = std::env::temp_dir().join(format!("fio-{}-{secs}", pod.uid));
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec fio --name=modify --filename={} --rw=randwrite \
         --bs=4k --direct=1 --ioengine=psync --size=8M --runtime={secs} --time_based \
         --write_iops_log={} --log_avg_msec=1000 --output-format=json",
        pod.dir.display(),
        file.display(),
        log.display()
    );
    let procs = pod.dir.join("cgroup.procs");
    let fio = std::thread::spawn(move || {
        run("sh", &["-c", &script]);
        let path = format!("{}_iops.1.log", log.display());
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        // `msec, iops, direction, bs, offset[, ...]`: one line a second.
        text.lines()
            .filter_map(|l| l.split(',').nth(1)?.trim().parse().ok())
            .collect()
    });
    // Answered once fio is in the pod (its seconds start about then), so
    // that a change made some seconds later falls where it is meant to
    // on a busy machine too.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::fs::read_to_string(&procs)
        .unwrap_or_default()
        .trim()
        .is_empty()
        && std::time::Instant::now() < until
        && !fio.is_finished()
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    fio
}

/// What NodeGetVolumeHealth says of `vol` published at `target`.
async fn health_of(
    h: &Harness,
    vol: &Staged,
    target: &Path,
) -> Vec<pb::volume_health::VolumeHealthEntry> {
    h.node()
        .node_get_volume_health(pb::NodeGetVolumeHealthRequest {
            volume_id: vol.id.clone(),
            volume_publish_path: target.display().to_string(),
            staging_target_path: vol.staging.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner()
        .volume_health
        .unwrap_or_default()
        .health_statuses
}

/// The mean of `per_second[from..to]`.
fn mean(per_second: &[f64], from: usize, to: usize) -> f64 {
    let part = &per_second[from..to.min(per_second.len())];
    part.iter().sum::<f64>() / part.len() as f64
}

/// ControllerModifyVolume reaches the pods using the volume where the
/// controller is their node: while fio writes in a pod, a change of the
/// write limit from 50 to 200 IOPS holds it to 200 from the next second,
/// and lifting it (`max`) leaves it unthrottled; a pod that had no limit
/// (its volume made without one) gets one; a publish naming no pod is said
/// unlimited in health while there is a limit. The new limits show in
/// `io.max` when the modify returns, and in the metrics. Killed after the
/// change is recorded (`modify.limits`), the next start sets it, and the
/// CO's retry of the modify succeeds.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_io_limits_a_modify_reaches_the_running_pods_within_a_second_and_max_lifts_it() {
    require_guest();
    let (_local, mut h, port) = metered("iolim3").await;
    let none = HashMap::new();
    let vol = staged(
        &h,
        "lim-mod",
        false,
        &[("backend", "file"), ("writeIops", "50"), ("readIops", "40")],
        &none,
        false,
    )
    .await;
    let plain = staged(&h, "lim-plain", true, &[("backend", "lvm")], &none, false).await;
    let (a, b) = (PodCgroup::new(UID_A, true), PodCgroup::new(UID_B, false));
    let (ta, fa) = vol.publish(&h, "lim-mod-a", Some(&a.uid)).await;
    let (tb, _) = plain.publish(&h, "lim-plain-b", Some(&b.uid)).await;
    let (tn, _) = plain.publish(&h, "lim-plain-n", None).await;
    let (dev, dev_b) = (vol.dev(&ta), plain.dev(&tb));
    assert_eq!(a.limits_on(dev).write_iops, Some(50));
    assert!(b.limits_on(dev_b).is_empty());
    // 50, then 200 from second 4, then none from second 8 (the seconds
    // after each change's own are measured).
    let fio = fio_by_second(&a, &fa, 12);
    let started = std::time::Instant::now();
    let at = |secs: u64| started + std::time::Duration::from_secs(secs);
    tokio::time::sleep_until(at(4).into()).await;
    let t1 = started.elapsed().as_secs_f64();
    h.modify(&vol.id, &[("writeIops", "200")])
        .await
        .unwrap_or_else(|e| panic!("modify: {e:?}\n{}", h.log()));
    let raised = Limits {
        read_iops: Some(40),
        write_iops: Some(200),
        ..Default::default()
    };
    assert_eq!(a.limits_on(dev), raised, "io.max when the modify returned");
    assert_eq!(
        sample(port, "volume_io_limit", &vol.id, UID_A, "writeIops"),
        Some(200)
    );
    tokio::time::sleep_until(at(8).into()).await;
    let t2 = started.elapsed().as_secs_f64();
    h.modify(&vol.id, &[("writeIops", "max")]).await.unwrap();
    assert_eq!(
        a.limits_on(dev),
        Limits {
            read_iops: Some(40),
            ..Default::default()
        }
    );
    assert_eq!(
        sample(port, "volume_io_limit", &vol.id, UID_A, "writeIops"),
        None
    );
    let seconds = tokio::task::spawn_blocking(move || fio.join().unwrap())
        .await
        .unwrap();
    println!("write IOPS by second: {seconds:.0?} (changed at {t1:.1} s and {t2:.1} s)");
    // fio's seconds start a little after `started`: a change made at t
    // seconds shows from fio's second floor(t) at the latest, the
    // second it fell in mixed, unless it took longer to reach the pod.
    let i1 = seconds.iter().position(|&v| v > 75.0).unwrap();
    let i2 = seconds.iter().position(|&v| v > 260.0).unwrap();
    assert!(
        i1 <= t1 as usize + 1 && i2 <= t2 as usize + 1 && i1 >= 3 && i2 >= i1 + 3,
        "the changes did not show within a second: {seconds:.0?}"
    );
    // fio's first second holds its start; the second before each
    // change's first may be mixed too (a change late in it moves its mean
    // only a little): left out.
    let (before, between, after) = (
        mean(&seconds, 1, i1 - 1),
        mean(&seconds, i1 + 1, i2 - 1),
        mean(&seconds, i2 + 1, seconds.len()),
    );
    near("writes at 50", before, 50.0);
    near("writes at 200", between, 200.0);
    assert!(after >= 3.0 * 200.0, "writes lifted: {after:.0} IOPS");
    println!("limited to 50: {before:.1} IOPS; to 200: {between:.1}; lifted: {after:.0}");

    // A volume made with no limit: its pod gets one; the publish naming
    // no pod is said unlimited while there is one.
    assert!(health_of(&h, &plain, &tn).await.is_empty());
    h.modify(&plain.id, &[("readBps", "1Mi")]).await.unwrap();
    assert_eq!(b.limits_on(dev_b).read_bps, Some(1 << 20));
    let said = health_of(&h, &plain, &tn).await;
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(said[0].reason, "IoLimitNotApplied", "{said:?}");
    assert!(
        said[0].message.contains(&tn.display().to_string()),
        "{said:?}"
    );
    let sr = PodCgroup::fio(Some(&b), &tb, "read", "64k").1;
    near("pod B's reads at 1 MiB/s", sr, (1 << 20) as f64);

    // Killed with the change recorded and not yet set: the next start
    // sets it; the CO's retry succeeds and changes nothing more.
    h.env
        .push(("FERROVOL_KILL_AT".into(), "modify.limits".into()));
    h.kill();
    h.spawn().await;
    let died = h
        .modify(&plain.id, &[("readBps", "max"), ("writeIops", "30")])
        .await;
    assert!(died.is_err(), "{died:?}");
    h.kill();
    assert_eq!(
        b.limits_on(dev_b).read_bps,
        Some(1 << 20),
        "set before the kill"
    );
    h.env.retain(|(k, _)| k != "FERROVOL_KILL_AT");
    h.spawn().await;
    let lowered = Limits {
        write_iops: Some(30),
        ..Default::default()
    };
    assert_eq!(b.limits_on(dev_b), lowered, "not set at start");
    h.modify(&plain.id, &[("readBps", "max"), ("writeIops", "30")])
        .await
        .unwrap();
    assert_eq!(b.limits_on(dev_b), lowered);
    // Lifted whole: nothing in io.max, nothing said.
    h.modify(&plain.id, &[("writeIops", "max")]).await.unwrap();
    assert!(b.limits_on(dev_b).is_empty());
    assert!(health_of(&h, &plain, &tn).await.is_empty());
    for (v, t) in [(&vol, &ta), (&plain, &tb), (&plain, &tn)] {
        h.node()
            .node_unpublish_volume(unpublish_req(&v.id, t))
            .await
            .unwrap();
    }
    assert!(a.limits_on(dev).is_empty());
    vol.drop_all(&h, &none).await;
    plain.drop_all(&h, &none).await;
}

/// The remote backends as a cluster runs them, on the real kernel: the
/// controller and the node in two processes, the node asking the
/// controller's `/limits` every second. A change at the controller (50 to
/// 30 write IOPS: well under what rbd does on a busy machine's emulated
/// CPU) reaches the pod's `io.max` within the refresh, and fio in the pod
/// is held to each limit, on iscsi and on rbd. A new rbd controller
/// whose state directory is empty (an emptyDir) reads the changes kept in
/// the image's metadata: a further change keeps the earlier one. The
/// node's volume stats say the limits in force.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_io_limits_a_change_at_the_remote_controller_reaches_the_node_s_running_pods() {
    require_guest();
    let every = EveryBackend::new("iolim4", 256, false);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let config = format!(
        "[node]\nlimits_from = \"http://{addr}\"\nlimits_refresh_seconds = 1\n\n{}",
        every.config
    );
    let mut ctl = Harness::start_with_env(
        Some(&config),
        &[
            ("FERROVOL_MODE", "controller"),
            ("FERROVOL_METRICS_ADDR", &addr),
        ],
    )
    .await;
    let node = Harness::start_with_env(Some(&config), &[("FERROVOL_MODE", "node")]).await;
    let ceph = every.cluster.secrets();
    let none = HashMap::new();
    let pod = PodCgroup::new(UID_A, true);
    let mut report = Vec::new();
    for (backend, secrets) in [("iscsi", &none), ("rbd", &ceph)] {
        let name = format!("lim-remote-{backend}");
        let vol = staged_on(
            &ctl,
            &node,
            &name,
            true,
            &[("backend", backend), ("writeIops", "50")],
            secrets,
            true,
        )
        .await;
        let (target, _) = vol.publish(&node, &name, Some(&pod.uid)).await;
        let dev = vol.dev(&target);
        assert_eq!(pod.limits_on(dev).write_iops, Some(50), "{backend}");
        // What is wrong is said once the volume is gone: a test that
        // panics with a volume staged leaves its target's hold device to
        // the tests after it.
        let mut wrong = Vec::new();
        let before = PodCgroup::fio(Some(&pod), &target, "randwrite", "4k").0;
        let changed = std::time::Instant::now();
        ctl.modify(&vol.id, &[("writeIops", "30")])
            .await
            .unwrap_or_else(|e| panic!("modify {name}: {e:?}\n{}", ctl.log()));
        // The node asks every second: its pod has the change within the
        // refresh (and a request), as long as a busy machine makes it.
        while pod.limits_on(dev).write_iops != Some(30)
            && changed.elapsed() < std::time::Duration::from_secs(10)
        {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let took = changed.elapsed().as_secs_f64();
        if pod.limits_on(dev).write_iops != Some(30) || took > 3.0 {
            wrong.push(format!(
                "{backend}: the change reached the pod's io.max after {took:.1} s: {:?}",
                pod.limits_on(dev)
            ));
        }
        let after = PodCgroup::fio(Some(&pod), &target, "randwrite", "4k").0;
        wrong.extend(off_limit(&format!("{backend}: writes at 50"), before, 50.0));
        wrong.extend(off_limit(&format!("{backend}: writes at 30"), after, 30.0));
        report.push(format!(
            "{backend}: {before:.1} write IOPS at 50; the change to 30 in the pod's io.max \
             after {took:.2} s; then {after:.1} write IOPS"
        ));
        let stats = node
            .node()
            .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: vol.id.clone(),
                volume_path: target.display().to_string(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let said = stats.volume_condition.unwrap().message;
        // The limit in force, then the pod's stall (the guest's kernel
        // keeps pressure, and fio waited under the limit).
        if !said.contains(&format!(
            "pod {UID_A}: writeIops=30; the pod stalled on I/O "
        )) {
            wrong.push(format!("{backend}: the stats say {said:?}"));
        }
        if backend == "rbd" {
            // A new controller with an empty state directory: the kept
            // change is read back from the image, and the next one is made
            // over it.
            ctl.kill();
            std::fs::remove_file(ctl.state_dir().join("controller/limits.json")).unwrap();
            ctl.spawn().await;
            let modified = ctl.modify(&vol.id, &[("readIops", "30")]).await;
            let want = Limits {
                read_iops: Some(30),
                write_iops: Some(30),
                ..Default::default()
            };
            let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while modified.is_ok()
                && pod.limits_on(dev) != want
                && std::time::Instant::now() < until
            {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            if let Err(e) = modified {
                wrong.push(format!(
                    "rbd: a new controller's modify: {e:?}\n{}",
                    ctl.log()
                ));
            } else if pod.limits_on(dev) != want {
                wrong.push(format!(
                    "rbd: {:?} after a new controller's change",
                    pod.limits_on(dev)
                ));
            }
        }
        node.node()
            .node_unpublish_volume(unpublish_req(&vol.id, &target))
            .await
            .unwrap();
        let left = pod.limits_on(dev);
        vol.drop_on(&ctl, &node, secrets).await;
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        assert!(left.is_empty(), "{backend}: left in io.max");
    }
    for line in report {
        println!("{line}");
    }
}
