//! Volume and storage health (CSI v1.13) with each backend's storage broken
//! for real: a thin pool filled, an LV removed behind the driver's back, an
//! export's directory removed and its server stopped. Each reads what the
//! calls report, and how long they took.

use super::*;
use std::collections::BTreeSet;
use std::time::Instant;

type Kinds = BTreeSet<(i32, String)>;

fn kinds(h: &pb::VolumeHealth) -> Kinds {
    h.health_statuses
        .iter()
        .map(|e| (e.status, e.reason.clone()))
        .collect()
}

async fn storage_health(h: &Harness) -> BTreeSet<(i32, String)> {
    h.storage_health()
        .await
        .into_iter()
        .map(|b| (b.status, b.reason))
        .collect()
}

const DEGRADED: i32 = pb::VolumeHealthErrorType::Degraded as i32;
const INACCESSIBLE: i32 = pb::VolumeHealthErrorType::Inaccessible as i32;
const STORAGE_DEGRADED: i32 = pb::StorageHealthErrorType::StorageDegraded as i32;

/// lvm: a thin pool filled past its threshold is said of its volumes and of
/// the backend before writes fail; an LV removed behind the driver's back
/// is a volume the backend no longer has.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_lvm_health_sees_a_pool_fill_and_an_lv_go() {
    require_guest();
    let vg = LvmVg::new("fvhealth", 64);
    vg.thin_pool("pool", "16m", &["--chunksize", "64k", "--zero", "y"]);
    let config = "[[backend]]\ntype = \"lvm\"\n\
        [[backend.device_class]]\nname = \"t\"\nvolume_group = \"fvhealth\"\nthin_pool = \"pool\"\n";
    let h = Harness::start_with_env(Some(config), &[("FERROVOL_VOLUME_HEALTH", "true")]).await;
    let (id, dev) = block_volume(&h, "full", "t", 16 * MIB).await;
    assert_eq!(kinds(&h.controller_health(&id).await), Kinds::new());
    assert_eq!(storage_health(&h).await, BTreeSet::new());

    // 15 of the pool's 16 MiB written: over 90%, writes still succeed.
    fill(&dev, 0, 15 * MIB as usize, 0xAB);
    let started = Instant::now();
    let c = h.controller_health(&id).await;
    println!(
        "lvm pool at 15/16 MiB: {:?} in {:?}",
        c.health_statuses,
        started.elapsed()
    );
    assert!(
        kinds(&c).contains(&(DEGRADED, "ThinPoolNearlyFull".into())),
        "{c:?}"
    );
    let s = storage_health(&h).await;
    assert!(
        s.contains(&(STORAGE_DEGRADED, "ThinPoolNearlyFull".into())),
        "{s:?}"
    );
    drop_block_volume(&h, "full", &id).await;
    assert_eq!(storage_health(&h).await, BTreeSet::new());

    // An LV removed behind the driver's back.
    let mut req = create_req("gone", 4 * MIB, block_cap(SNW));
    req.parameters.insert("deviceClass".into(), "t".into());
    let gone = h.create(req).await.volume_id;
    let lv = gone.rsplit('.').next().unwrap();
    vg.lvm("lvremove", &["-q", "-y", &format!("fvhealth/{lv}")]);
    let c = h.controller_health(&gone).await;
    assert_eq!(
        kinds(&c),
        Kinds::from([(INACCESSIBLE, "VolumeNotFound".into())]),
        "{c:?}"
    );
    h.delete_volume(&gone).await;
}

/// nfs: a volume's directory removed on the server, then the server
/// stopped: the controller says which, within its deadline, and answers
/// again once the server is back.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_nfs_health_sees_a_directory_go_and_the_server_stop() {
    require_guest();
    let server = NfsServer::new();
    let h = Harness::start_with_env(
        Some(NFS_LOOPBACK_CONFIG),
        &[
            ("FERROVOL_COMMAND_TIMEOUT", "8"),
            ("FERROVOL_VOLUME_HEALTH", "true"),
        ],
    )
    .await;
    let mut req = create_req("pvc-h", 64 * MIB, mount_cap("", 5));
    req.parameters
        .insert("csi.storage.k8s.io/pv/name".into(), "pvc-h".into());
    let id = h.create(req).await.volume_id;
    assert_eq!(kinds(&h.controller_health(&id).await), Kinds::new());

    std::fs::remove_dir(server.export.join("pvc-h")).unwrap();
    let c = h.controller_health(&id).await;
    assert_eq!(
        kinds(&c),
        Kinds::from([(INACCESSIBLE, "VolumeDirectoryMissing".into())]),
        "{c:?}"
    );
    // Made again on the server: seen at once (the client asks the server,
    // not its cache of the directory).
    std::fs::create_dir(server.export.join("pvc-h")).unwrap();
    let c = h.controller_health(&id).await;
    assert_eq!(kinds(&c), Kinds::new(), "{c:?}");

    // The server stopped: said within the deadline (the book's 10 s, the
    // mount's 8), never a hung call.
    server.stop();
    let started = Instant::now();
    let c = h.controller_health(&id).await;
    let took = started.elapsed();
    println!("nfs server stopped: {:?} in {took:?}", c.health_statuses);
    assert!(took < Duration::from_secs(30), "{took:?}");
    let reasons: BTreeSet<String> = c.health_statuses.iter().map(|e| e.reason.clone()).collect();
    assert!(
        [
            "ExportUnreachable",
            "StorageNotAnswering",
            "HealthCheckTimedOut"
        ]
        .iter()
        .any(|r| reasons.contains(*r)),
        "{c:?}"
    );
    server.start();
    // Once the server is back, the checks clear (a check still hung on
    // the old connection finishes first, so more than one may be late).
    let (back, deadline) = (Instant::now(), Instant::now() + Duration::from_secs(120));
    let mut calls = 0;
    loop {
        calls += 1;
        let c = h.controller_health(&id).await;
        if c.health_statuses.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still {c:?}\n{}", h.log());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "nfs server back: healthy after {calls} call(s), {:?}",
        back.elapsed()
    );
    h.delete_volume(&id).await;
}
