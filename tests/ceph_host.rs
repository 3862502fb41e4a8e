//! The Ceph fixture on the host: the rbd CLI operations need no kernel
//! module, so they run in the ordinary suite. Needs root and Debian's
//! ceph-mon, ceph-osd and ceph-common (.ci/run installs them).

mod common;

use common::fixtures::CephCluster;

#[test]
fn ceph_fixture_serves_rbd_cli_with_cephx() {
    common::require_root();
    let cluster = CephCluster::new();
    cluster.rbd(&["create", "rbd/vol-a", "--size", "32M"]);
    cluster.rbd(&["resize", "rbd/vol-a", "--size", "64M"]);
    cluster.rbd(&["snap", "create", "rbd/vol-a@s1"]);
    let info: serde_json::Value =
        serde_json::from_str(&cluster.rbd(&["info", "rbd/vol-a", "--format", "json"])).unwrap();
    assert_eq!(info["size"], 64 << 20);
    // cephx is on: a wrong key is refused.
    let out = std::process::Command::new("rbd")
        .args([
            "-c",
            cluster.conf.to_str().unwrap(),
            "--id",
            "ferrovol",
            "--key",
            "AQBad0BhAAAAABAAbadbadbadbadbadbadbadbQ==",
            "ls",
            "rbd",
        ])
        .args(["--connect-timeout", "5"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "a wrong key was accepted");
    assert!(cluster.client_key().len() >= 40);
    cluster.rbd(&["snap", "purge", "rbd/vol-a"]);
    cluster.rbd(&["rm", "rbd/vol-a"]);
    assert_eq!(cluster.rbd(&["ls", "rbd"]).trim(), "");
}

/// The shared cluster (the guest's tests take it one after another): one
/// that cannot take a write fails the test that asks for it, with what the
/// cluster says of itself, and the next test gets a new one; a pool made
/// anew between two tests is not taken for a broken cluster.
#[test]
fn a_shared_cluster_renews_a_used_pool_and_is_replaced_when_it_takes_no_write() {
    common::require_root();
    // The shared cluster's daemons would outlive this process: they are
    // stopped at the end, failed or not.
    struct LetGo;
    impl Drop for LetGo {
        fn drop(&mut self) {
            CephCluster::let_go_of_shared();
        }
    }
    let _let_go = LetGo;
    let first = CephCluster::shared();
    let first_mon = first.mon_addr.clone();
    assert_eq!(first.ceph(&["--pool-contents", "rbd"]), "");
    // A pool a test left an image in is made anew by the next test's
    // ask, and so is one with an image in its trash only; the test after
    // that finds the new pool taking writes (the admin's connection knew
    // the old pool's id until it asked again).
    first.rbd(&["create", "rbd/left", "--size", "8M"]);
    assert!(std::ptr::eq(CephCluster::shared(), first));
    assert!(first.rbd(&["ls", "rbd"]).trim().is_empty());
    first.rbd(&["create", "rbd/trashed", "--size", "8M"]);
    first.rbd(&["trash", "mv", "rbd/trashed"]);
    assert!(first.rbd(&["ls", "rbd"]).trim().is_empty());
    assert!(std::ptr::eq(CephCluster::shared(), first));
    assert!(first.rbd(&["trash", "ls", "rbd"]).trim().is_empty());
    assert!(std::ptr::eq(CephCluster::shared(), first));
    // Writes held cluster-wide, as a full cluster holds them.
    first.ceph(&["osd", "pause"]);
    // What a test's panic says of the cluster: the flag, and that the OSD
    // holds no operation (the clients do).
    let glance = first.at_a_glance();
    assert!(glance.contains("flags pauserd,pausewr"), "{glance}");
    assert!(glance.contains("OSD ops in flight 0"), "{glance}");
    assert!(glance.contains("\"active+clean\": 8"), "{glance}");
    let said = std::panic::catch_unwind(CephCluster::shared)
        .map(|_| ())
        .expect_err("a paused cluster handed out");
    let said = said.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(said.contains("the shared Ceph cluster is broken"), "{said}");
    assert!(said.contains("the write probe"), "{said}");
    // The cluster's own word on why: the flag, in its health and its map.
    assert!(said.contains("pausewr"), "{said}");
    let second = CephCluster::shared();
    assert_ne!(second.mon_addr, first_mon);
    second.rbd(&["create", "rbd/after", "--size", "8M"]);
    second.rbd(&["rm", "rbd/after"]);
    assert_eq!(second.ceph(&["--pool-contents", "rbd"]), "");
}
