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
