//! NVMe over TCP on the real kernel: the nvmf backend's target server
//! (nvmet through configfs) and initiator (the kernel's NVMe-oF host
//! through /dev/nvme-fabrics) driven as the export layer drives them, on
//! loopback: a subsystem served on two ports (a create cut short
//! finished by the next), granted, connected over both
//! (native multipath, one device), grown under writes, refused without its
//! DH-HMAC-CHAP key, a path cut and back, a path the target makes ANA
//! inaccessible and optimized again, a fenced host's writes failing, a
//! host's entry and keys removed once no subsystem allows it, and nothing
//! left behind.

use super::*;
use ferrovol::backend::export::initiator::{Connection, Initiator};
use ferrovol::backend::export::Target;
use ferrovol::backend::nvmf::fabrics::{Fabrics, Reconnect};
use ferrovol::backend::nvmf::nvmet::{Nvmet, Port};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const NQN: &str = "nqn.2026-12.io.ferrovol.guest:pvc-1";
const PREFIX: &str = "nqn.2026-12.io.ferrovol.guest";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6c1e2d70-3a55-4b8e-9d3c-0f4a2b7e9c11";
const HOST_ID: &str = "6c1e2d70-3a55-4b8e-9d3c-0f4a2b7e9c11";
/// Two keys as `nvme gen-dhchap-key` makes them (32 random bytes and
/// their CRC, base64, untransformed).
const KEY: &str = "DHHC-1:00:mLDyoHSmTd48/lDKCe/n5bfzHtigiD7SKHzxtj/ccdhXXaOR:";
const CTRL_KEY: &str = "DHHC-1:00:1KGEBVqg35OOGSvFrckEJApz9mSDEZXhr+nA4DZvGzAPdk1H:";

fn ports() -> Vec<Port> {
    [(4420, 4420u16), (4421, 4421)]
        .into_iter()
        .map(|(id, service)| Port {
            id,
            addr: "127.0.0.1".parse().unwrap(),
            service,
        })
        .collect()
}

fn fabrics() -> Fabrics {
    Fabrics {
        sysfs: "/sys".into(),
        dev: "/dev".into(),
        host_nqn: HOST.into(),
        host_id: HOST_ID.into(),
        multipath: true,
        timeout: Duration::from_secs(20),
        reconnect: Reconnect {
            ctrl_loss_tmo: 10,
            reconnect_delay: 1,
            fast_io_fail_tmo: 2,
        },
    }
}

/// Writes 64 KiB at `offset` and flushes it to the device; the error, if
/// any (a device that lost every path fails the flush).
fn write_synced(dev: &Path, offset: u64) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(dev)?;
    f.seek(SeekFrom::Start(offset))?;
    f.write_all(&[0xa5u8; 65536])?;
    f.sync_all()
}

fn size_of(dev: &Path) -> u64 {
    let name = dev.file_name().unwrap().to_str().unwrap();
    let sectors = std::fs::read_to_string(format!("/sys/block/{name}/size")).unwrap();
    sectors.trim().parse::<u64>().unwrap() * 512
}

struct Backing {
    dir: tempfile::TempDir,
    device: PathBuf,
}

impl Backing {
    fn new(mib: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("ns.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        let device = run("losetup", &["--find", "--show", image.to_str().unwrap()])
            .trim()
            .into();
        Backing { dir, device }
    }

    fn grow(&self, mib: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.path().join("ns.img"))
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        run("losetup", &["-c", self.device.to_str().unwrap()]);
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        try_run("losetup", &["-d", self.device.to_str().unwrap()]);
    }
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nvmf_target_and_initiator_serve_grow_authenticate_and_fence() {
    require_guest();
    let backing = Backing::new(64);
    let target = Nvmet::new("/sys/kernel/config/nvmet".into(), ports());
    let host = fabrics();
    let portals = ["127.0.0.1:4420", "127.0.0.1:4421"];
    let defaults = std::collections::BTreeMap::new();
    let to = |incoming, outgoing| Connection {
        export: NQN,
        portals: &portals,
        unit: 1,
        incoming,
        outgoing,
        settings: &defaults,
    };

    // Made, not yet granted: the connection is refused.
    target.create(NQN, &backing.device).await.unwrap();
    assert!(target.serves(NQN).await.unwrap());
    // A create cut short (its namespace not enabled, one port not linked:
    // the driver killed between the steps) is not served, and a create
    // again finishes it.
    let subsystem = format!("/sys/kernel/config/nvmet/subsystems/{NQN}");
    std::fs::write(format!("{subsystem}/namespaces/1/enable"), "0").unwrap();
    std::fs::remove_file(format!(
        "/sys/kernel/config/nvmet/ports/4421/subsystems/{NQN}"
    ))
    .unwrap();
    assert!(!target.serves(NQN).await.unwrap());
    target.create(NQN, &backing.device).await.unwrap();
    assert!(target.serves(NQN).await.unwrap());
    let refused = host.attach(&to(None, None)).await.unwrap_err();
    assert!(refused.message.contains(NQN), "{refused}");
    assert!(host.controllers().is_empty(), "{:?}", host.controllers());

    // Granted: one controller per portal, one device (native multipath).
    target.grant(NQN, HOST).await.unwrap();
    let dev = host.attach(&to(None, None)).await.unwrap();
    let ours: Vec<_> = host
        .controllers()
        .into_iter()
        .filter(|c| c.subsystem == NQN)
        .collect();
    assert_eq!(ours.len(), 2, "{ours:?}");
    assert_eq!(size_of(&dev), 64 << 20);
    // The head is linked by the model the driver's subsystems report (what
    // lvm's filter leaves out; a node's own NVMe disks have their maker's).
    let (_, serial) = ferrovol::backend::nvmf::nvmet::identity_for(NQN);
    let by_id = PathBuf::from(format!("/dev/disk/by-id/nvme-ferrovol_{serial}"));
    wait_for(
        "udev's by-id link of the head",
        Duration::from_secs(20),
        || std::fs::canonicalize(&by_id).ok() == std::fs::canonicalize(&dev).ok(),
    );
    let paths = host.paths(PREFIX).await.unwrap();
    assert!(paths.down.is_empty(), "{paths:?}");
    assert_eq!(paths.up.len(), 2, "{paths:?}");
    // A second attach finds the connections: none made twice.
    assert_eq!(host.attach(&to(None, None)).await.unwrap(), dev);
    assert_eq!(host.controllers().len(), 2);

    // Grown under writes: the host sees the new size without a rescan.
    let writer = {
        let dev = dev.clone();
        std::thread::spawn(move || {
            for i in 0..200u64 {
                write_synced(&dev, (i % 512) * 65536).unwrap();
            }
        })
    };
    backing.grow(128);
    target.refresh(NQN, &backing.device).await.unwrap();
    writer.join().unwrap();
    wait_for(
        "the host to see the namespace grown",
        Duration::from_secs(20),
        || size_of(&dev) == 128 << 20,
    );
    assert_eq!(host.rescan(NQN).await.unwrap(), 128 << 20);

    // A path cut: the subsystem leaves one port; I/O goes on through the
    // other, and the path is reported down until it comes back.
    let port2 = format!("/sys/kernel/config/nvmet/ports/4421/subsystems/{NQN}");
    std::fs::remove_file(&port2).unwrap();
    write_synced(&dev, 0).unwrap();
    paths_become(&host, "the cut path down", Duration::from_secs(20), |p| {
        p.down == ["127.0.0.1:4421"] && p.up.len() == 1
    })
    .await;
    let found = host.condition(NQN, &dev).await.unwrap().unwrap();
    assert_eq!(found.reason.as_str(), "NvmePathDown", "{found:?}");
    std::os::unix::fs::symlink(format!("/sys/kernel/config/nvmet/subsystems/{NQN}"), &port2)
        .unwrap();
    paths_become(&host, "the path back", Duration::from_secs(30), |p| {
        p.down.is_empty() && p.up.len() == 2
    })
    .await;
    assert!(host.condition(NQN, &dev).await.unwrap().is_none());

    // ANA: the second port's group made inaccessible (the target telling
    // its hosts that path cannot serve the namespace): that path is down
    // though its controller is live, I/O goes on through the other; back
    // to optimized, both carry it.
    let ana = "/sys/kernel/config/nvmet/ports/4421/ana_groups/1/ana_state";
    std::fs::write(ana, "inaccessible").unwrap();
    paths_become(
        &host,
        "the inaccessible path down",
        Duration::from_secs(20),
        |p| p.down == ["127.0.0.1:4421"] && p.up.len() == 1,
    )
    .await;
    write_synced(&dev, 0).unwrap();
    let found = host.condition(NQN, &dev).await.unwrap().unwrap();
    assert_eq!(found.reason.as_str(), "NvmePathDown", "{found:?}");
    assert!(found.message.contains("ANA inaccessible"), "{found:?}");
    std::fs::write(ana, "optimized").unwrap();
    paths_become(
        &host,
        "the path optimized again",
        Duration::from_secs(20),
        |p| p.down.is_empty() && p.up.len() == 2,
    )
    .await;

    // Fenced: revoked and disconnected, its writes fail, and the host
    // lets go of the controllers it cannot get back.
    target.revoke(NQN, HOST).await.unwrap();
    target.disconnect(NQN, HOST).await.unwrap();
    wait_for(
        "a fenced host's writes to fail",
        Duration::from_secs(30),
        || write_synced(&dev, 0).is_err(),
    );
    wait_for(
        "the fenced controllers to go",
        Duration::from_secs(30),
        || host.controllers().is_empty(),
    );
    host.detach(NQN).await.unwrap();

    // DH-HMAC-CHAP: the host's key on its entry; without it the connection
    // is refused as a key matter, with it (and the controller's key, both
    // ways) it is made.
    target
        .add_credential(&(HOST.to_string(), KEY.to_string()), false)
        .await
        .unwrap();
    target
        .add_credential(&(HOST.to_string(), CTRL_KEY.to_string()), true)
        .await
        .unwrap();
    target.grant(NQN, HOST).await.unwrap();
    let e = host.attach(&to(None, None)).await.unwrap_err();
    assert!(e.message.contains("DH-HMAC-CHAP"), "{e}");
    assert!(!e.message.contains("DHHC-1"), "{e}");
    let key = (HOST.to_string(), KEY.to_string());
    let ctrl = (NQN.to_string(), CTRL_KEY.to_string());
    let dev = host.attach(&to(Some(&key), Some(&ctrl))).await.unwrap();
    write_synced(&dev, 0).unwrap();

    // A host's entry (its keys on it) is forgotten only once no subsystem
    // allows it: not while this one does, nor while one that is not the
    // driver's does.
    let entry = PathBuf::from(format!("{NVMET}/hosts/{HOST}"));
    assert!(!target.forget_host(HOST).await.unwrap());
    assert!(entry.join("dhchap_key").exists());
    let foreign = PathBuf::from(format!("{NVMET}/subsystems/nqn.2026-12.org.example:theirs"));
    std::fs::create_dir(&foreign).unwrap();
    std::os::unix::fs::symlink(&entry, foreign.join("allowed_hosts").join(HOST)).unwrap();
    target.revoke(NQN, HOST).await.unwrap();
    assert!(!target.forget_host(HOST).await.unwrap());
    assert!(entry.is_dir());
    std::fs::remove_file(foreign.join("allowed_hosts").join(HOST)).unwrap();
    std::fs::remove_dir(&foreign).unwrap();
    assert!(target.forget_host(HOST).await.unwrap());
    assert!(!entry.exists());
    assert!(!target.forget_host(HOST).await.unwrap());

    // Let go and removed: nothing left on either side.
    host.detach(NQN).await.unwrap();
    assert!(host.controllers().is_empty());
    target.delete(NQN).await.unwrap();
    assert!(!target.serves(NQN).await.unwrap());
    assert!(!Path::new(&format!("/sys/kernel/config/nvmet/subsystems/{NQN}")).exists());
    // A second delete finds nothing to do.
    target.delete(NQN).await.unwrap();
}

/// Waits up to `limit` for the node's paths to satisfy `check`.
async fn paths_become(
    host: &Fabrics,
    what: &str,
    limit: Duration,
    check: impl Fn(&ferrovol::backend::export::initiator::Paths) -> bool,
) {
    let start = std::time::Instant::now();
    loop {
        let paths = host.paths(PREFIX).await.unwrap();
        if check(&paths) {
            return;
        }
        assert!(start.elapsed() < limit, "{what}: still {paths:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Group snapshots of nvmf volumes in use, over each store (files, LVs),
/// as iscsi's ([`super::iscsi_copies::group_snapshots_being_written`]):
/// the writer (on this node, through its NVMe/TCP connection) never sees
/// an error, the restored pair is one instant, no hold is left suspended.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nvmf_group_snapshots_of_volumes_being_written() {
    require_guest();
    let _vg = LvmVg::new("fvngroup", 160);
    let nvmet = NvmetPort::new("nqn.2026-12.io.ferrovol.grp");
    let file = nvmet.file_store_config();
    let lvm = file.replace(
        "[backend.store]\ntype = \"file\"\npool = \"@DIR@/nvmf-pool\"\n",
        "[backend.store]\ntype = \"lvm\"\n[[backend.store.device_class]]\nname = \"luns\"\n\
         volume_group = \"fvngroup\"\n",
    );
    assert_ne!(file, lvm);
    super::iscsi_copies::group_snapshots_being_written(&[("file", file), ("lvm", lvm)]).await;
    assert_eq!(nvmet.subsystems(), Vec::<String>::new(), "subsystems left");
    assert_eq!(
        nvmet.controllers(),
        Vec::<String>::new(),
        "controllers left"
    );
}

/// The whole target cut under a staged raw block volume (its port's
/// packets dropped), with the class's reconnect settings (`ctrlLossTmo`
/// 60, `reconnectDelay` 1, `fastIoFailTmo` 3, carried to the node in the
/// volume context): a write fails within seconds, not the node's two
/// minutes, and the volume's condition is abnormal meanwhile; the cut
/// lifted within `ctrlLossTmo`, the controller connects again by itself
/// and writes land, with no restage.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nvmf_target_cut_follows_the_class_reconnect_settings() {
    require_guest();
    let nvmet = NvmetPort::new("nqn.2026-12.io.ferrovol.cut");
    let h = Harness::start_with(Some(&nvmet.file_store_config())).await;
    let mut req = create_req("pvc-cut", 16 * MIB, block_cap(SNW));
    for (k, v) in [
        ("ctrlLossTmo", "60"),
        ("reconnectDelay", "1"),
        ("fastIoFailTmo", "3"),
    ] {
        req.parameters.insert(k.into(), v.into());
    }
    let vol = h.provision_attached(req).await;
    write_synced(&vol.target, 0).unwrap();
    assert!(!h.condition(&vol).await.abnormal);

    let port = nvmet.port;
    let cut = super::faults::Cut::new(&[
        format!("tcp dport {port} drop"),
        format!("tcp sport {port} drop"),
    ]);
    // A write in a thread of its own: it fails once the controller has
    // lost its connection (keep-alive) and fastIoFailTmo has run out.
    let start = std::time::Instant::now();
    let target = vol.target.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut n = 0;
        let r = loop {
            if let Err(e) = write_synced(&target, (n % 64) * 65536) {
                break e;
            }
            n += 1;
        };
        let _ = tx.send(r);
    });
    let e = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a write under the cut did not fail within 60 s");
    let failed_after = start.elapsed();
    eprintln!("the writes failed {failed_after:?} after the cut: {e}");
    // Well inside the node's default of 120 s: the class's 3 s, after the
    // keep-alive (5 s) saw the connection gone.
    assert!(failed_after < Duration::from_secs(45), "{failed_after:?}");
    let down = h.condition(&vol).await;
    assert!(down.abnormal, "{down:?}");
    assert!(down.message.contains("down"), "{down:?}");

    drop(cut);
    wait_for(
        "the controller to connect again and a write to land",
        Duration::from_secs(45),
        || write_synced(&vol.target, 0).is_ok(),
    );
    let normal = h
        .condition_becomes(&vol, false, Duration::from_secs(10))
        .await;
    assert!(normal.is_some(), "{:?}", h.condition(&vol).await);
    h.teardown(&vol).await;
    nvmet.assert_clean();
}

/// A volume staged over two portals through the driver (native
/// multipath: a controller through each, one device), one portal's
/// packets dropped while a writer's synced writes go on: they go on
/// through the other path with no error, and the volume's condition
/// names the cut path as down; the cut lifted, the path connects again by
/// itself and the condition is normal, with no restage; nothing is left.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nvmf_a_path_cut_under_writes_leaves_the_other_path_carrying_them() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    require_guest();
    let nvmet = NvmetPort::new("nqn.2026-12.io.ferrovol.paths");
    let h = Harness::start_with(Some(&nvmet.two_portal_config())).await;
    let vol = h
        .provision_attached(create_req("pvc-paths", 16 * MIB, block_cap(SNW)))
        .await;
    assert_eq!(nvmet.controllers().len(), 2, "{:?}", nvmet.controllers());
    assert!(!h.condition(&vol).await.abnormal);

    // The writer: synced 64 KiB writes until told to stop, counted; the
    // first error stops it and is kept.
    let written = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (target, written, stop) = (vol.target.clone(), written.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let n = written.load(Ordering::Relaxed);
                write_synced(&target, (n % 64) * 65536)?;
                written.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<(), std::io::Error>(())
        })
    };
    let progress = |what: &str| {
        let from = written.load(Ordering::Relaxed);
        wait_for(what, Duration::from_secs(60), || {
            assert!(!writer.is_finished(), "the writer stopped: {what}");
            written.load(Ordering::Relaxed) >= from + 20
        });
    };
    progress("writes over both paths");

    let port = nvmet.port2;
    let cut = super::faults::Cut::new(&[
        format!("tcp dport {port} drop"),
        format!("tcp sport {port} drop"),
    ]);
    // The cut path is seen down (its keep-alive fails), and named.
    let down = h
        .condition_becomes(&vol, true, Duration::from_secs(60))
        .await
        .expect("the cut path was not seen down within 60 s");
    eprintln!("under the cut: {down:?}");
    assert!(down.message.contains(&format!(":{port}")), "{down:?}");
    assert!(down.message.contains("is down"), "{down:?}");
    progress("writes through the path left");

    drop(cut);
    let normal = h
        .condition_becomes(&vol, false, Duration::from_secs(60))
        .await;
    assert!(
        normal.is_some(),
        "the path did not come back: {:?}",
        h.condition(&vol).await
    );
    assert_eq!(nvmet.controllers().len(), 2, "{:?}", nvmet.controllers());
    progress("writes over both paths again");
    stop.store(true, Ordering::Relaxed);
    writer
        .join()
        .unwrap()
        .expect("a write failed while one path was left");
    eprintln!(
        "{} synced writes, none failed",
        written.load(Ordering::Relaxed)
    );
    h.teardown(&vol).await;
    nvmet.assert_clean();
}

/// A single snapshot of an nvmf volume in use, on a file store, as
/// iscsi's ([`super::iscsi_copies::snapshot_of_a_volume_in_use_is_held`]):
/// the host's writes held at the hold device around the copy, each
/// restore one instant and clean; killed at `nvmf.held`, the next start
/// resumes the hold and the writes go on, and the retry succeeds.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nvmf_snapshot_of_a_volume_in_use_is_held() {
    require_guest();
    let nvmet = NvmetPort::new("nqn.2026-12.io.ferrovol.held");
    let config = nvmet.file_store_config();
    super::iscsi_copies::snapshot_of_a_volume_in_use_is_held(&config, "nvmf.held", "nvmf-pool")
        .await;
    nvmet.assert_clean();
}

/// ControllerModifyVolume on nvmf passes the store's keys on (a file
/// store's `preallocate`: the namespace's image allocated whole). Killed
/// at `nvmf.modify.store` (the store changed, nothing after it yet), the
/// driver is started again and the CO's retry of the same call succeeds,
/// the change made once; a key the store does not take is refused,
/// INVALID_ARGUMENT naming it, with nothing changed.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nvmf_a_modify_killed_after_the_store_s_change_is_finished_by_its_retry() {
    require_guest();
    let nvmet = NvmetPort::new("nqn.2026-12.io.ferrovol.mut");
    let mut h = Harness::start_with(Some(&nvmet.file_store_config())).await;
    let id = h
        .create(create_req("pvc-mut", 16 * MIB, mount_cap("ext4", SNW)))
        .await
        .volume_id;
    let image = h.path("nvmf-pool/volumes/pvc-mut.img");
    let allocated = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&image).unwrap().blocks() * 512
    };
    assert!(allocated() < MIB as u64, "{}", allocated());
    let bad = h
        .modify(&id, &[("preallocate", "maybe")])
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("preallocate"), "{bad:?}");
    assert!(allocated() < MIB as u64, "nothing changed: {}", allocated());

    h.env = vec![("FERROVOL_KILL_AT".into(), "nvmf.modify.store".into())];
    h.kill();
    h.spawn().await;
    let died = h.modify(&id, &[("preallocate", "true")]).await;
    assert!(died.is_err(), "{died:?}");
    h.kill();
    h.env.clear();
    assert_eq!(allocated(), 16 * MIB as u64, "the store's change was made");
    h.spawn().await;
    h.modify(&id, &[("preallocate", "true")])
        .await
        .unwrap_or_else(|e| panic!("the retry: {e:?}\n{}", h.log()));
    assert_eq!(allocated(), 16 * MIB as u64);
    h.delete_volume(&id).await;
    assert!(nvmet.subsystems().is_empty(), "{:?}", nvmet.subsystems());
    assert!(!image.exists());
}
