//! csi-sanity, the upstream conformance suite, against every backend that
//! needs the real kernel, in each mode CI covers: lvm (thick and thin),
//! nfs (plain, over xfs project quotas, and on btrfs subvolumes: its
//! volume, snapshot and node parts), iscsi (plain, and with CHAP and
//! mutual CHAP), nvmf (plain, and with DH-HMAC-CHAP both ways), rbd (with
//! its secrets). 0 failed in each; the JSON
//! reports, the suite's output and the driver's log stay under
//! target/sanity/. Under the guest's emulated CPU the whole suite takes
//! about 30 minutes, so the default run (CI's) runs each backend's first
//! mode whole and the second mode's own parts (publish, stage, create,
//! capacity, expansion), and passes over rbd's snapshot specs (6 of its
//! 12 minutes; the rbd lifecycle test covers its snapshots);
//! `FERROVOL_SANITY=full tests/guest/suite guest_sanity` runs all of it.

use super::*;
use common::sanity::Sanity;
use std::collections::BTreeMap;

/// What a backend's second mode changes: publish, stage, create,
/// capacity and expansion.
const MODE_SPECIFIC: &str =
    "ControllerPublishVolume|Node Service|CreateVolume|GetCapacity|ExpandVolume";

/// A node count small enough for the attach-limit spec, which
/// publishes that many volumes and one more.
const LIMITED: &str = "[node]\nmax_volumes_per_node = 6\n";

pub(crate) fn map(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_sanity_lvm_thick_and_thin() {
    require_guest();
    let vg = LvmVg::new("fvsanity", 1024);
    vg.thin_pool("pool", "384M", &[]);
    let config = "[[backend]]\ntype = \"lvm\"\n\
        [[backend.device_class]]\nname = \"thick\"\nvolume_group = \"fvsanity\"\n\
        [[backend.device_class]]\nname = \"thin\"\nvolume_group = \"fvsanity\"\nthin_pool = \"pool\"\n";
    let h = Harness::start_with(Some(config)).await;
    for class in ["thick", "thin"] {
        Sanity {
            name: &format!("lvm-{class}"),
            parameters: map(&[("deviceClass", class)]),
            mutable: map(&[("readAhead", "256")]),
            volume_bytes: Some(16 << 20),
            // The whole suite on thin volumes, whose snapshots are
            // cheap; thick classic snapshots cost a copy-on-write area
            // each and zeroing at delete (the snapshot listing specs
            // took over three minutes of the thick run under TCG).
            focus_unless_full: (class == "thick").then_some(MODE_SPECIFIC),
            ..Default::default()
        }
        .run(&h);
    }
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_sanity_nfs_plain_quota_and_btrfs() {
    require_guest();
    let plain = NfsServer::new();
    let config = NFS_LOOPBACK_CONFIG;
    let mut h = Harness::start_with(Some(config)).await;
    Sanity {
        name: "nfs",
        mutable: map(&[("mountPermissions", "0770"), ("onDelete", "delete")]),
        ..Default::default()
    }
    .run(&h);
    // The controller's working mount goes with the driver.
    assert_eq!(h.terminate().code(), Some(0));
    assert!(
        h.mounts().is_empty(),
        "left mounted after exit: {:?}",
        h.mounts()
    );
    drop(h);
    drop(plain);
    // The modes with the export's filesystem reached locally: xfs
    // quotas change publish, stage, create, capacity and expansion;
    // btrfs how volumes, snapshots, restores and clones are made, and
    // that the controller mounts nothing.
    let modes = [
        ("quota", "xfs_quota_path", MODE_SPECIFIC),
        (
            "btrfs",
            "btrfs_path",
            "CreateVolume|DeleteVolume|ListVolumes|Snapshot|Node Service",
        ),
    ];
    for (mode, key, focus) in modes {
        let server = match mode {
            "btrfs" => NfsServer::on_btrfs(),
            _ => NfsServer::on_xfs_with_quotas(),
        };
        let config = format!(
            "[[backend]]\ntype = \"nfs\"\n\
             [[backend.export]]\nname = \"{mode}\"\nserver = \"127.0.0.1\"\nshare = \"/\"\n\
             {key} = \"{}\"\n",
            server.export.display()
        );
        let mut h = Harness::start_with(Some(&config)).await;
        Sanity {
            name: &format!("nfs-{mode}"),
            focus_unless_full: Some(focus),
            ..Default::default()
        }
        .run(&h);
        assert_eq!(h.terminate().code(), Some(0));
        assert!(h.mounts().is_empty(), "{mode}: {:?}", h.mounts());
        if mode == "btrfs" {
            let left = run(
                "btrfs",
                &["subvolume", "list", server.export.to_str().unwrap()],
            );
            assert_eq!(left.trim(), "", "subvolumes left: {left}");
        }
    }
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_sanity_iscsi_plain_and_chap() {
    require_guest();
    let tgtd = Tgtd::new();
    let _iscsid = Iscsid::new();
    let config = tgtd.file_store_config("iqn.2026-11.io.ferrovol.sanity");
    let h = Harness::start_with(Some(&format!("{LIMITED}{config}"))).await;
    Sanity {
        name: "iscsi",
        attach_limit: true,
        mutable: map(&[("thinProvisioning", "true"), ("preallocate", "true")]),
        volume_bytes: Some(16 << 20),
        ..Default::default()
    }
    .run(&h);
    Sanity {
        name: "iscsi-chap",
        attach_limit: true,
        volume_bytes: Some(16 << 20),
        focus_unless_full: Some(MODE_SPECIFIC),
        secrets: map(&[
            ("chapUsername", "sanity-user"),
            ("chapPassword", "sanity-secret-01"),
            ("chapMutualUsername", "sanity-target"),
            ("chapMutualPassword", "sanity-secret-02"),
        ]),
        ..Default::default()
    }
    .run(&h);
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
}

/// Two DH-HMAC-CHAP keys as `nvme gen-dhchap-key` makes them (32 random
/// bytes and their CRC-32, base64).
const DHCHAP_KEY: &str = "DHHC-1:00:mLDyoHSmTd48/lDKCe/n5bfzHtigiD7SKHzxtj/ccdhXXaOR:";
const DHCHAP_CTRL_KEY: &str = "DHHC-1:00:1KGEBVqg35OOGSvFrckEJApz9mSDEZXhr+nA4DZvGzAPdk1H:";

/// nvmf over the kernel's nvmet on loopback (a file store), plain and with
/// DH-HMAC-CHAP both ways; every volume made with a reconnect setting of
/// its class (checked at creation, carried to the node, connected with).
/// Nothing is left: no controller, no subsystem, no host entry (where the
/// keys were), and no key in the log.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_sanity_nvmf_plain_and_dhchap() {
    require_guest();
    let nvmet = NvmetPort::new("nqn.2026-12.io.ferrovol.sanity");
    let config = format!("{LIMITED}{}", nvmet.file_store_config());
    let h = Harness::start_with(Some(&config)).await;
    Sanity {
        name: "nvmf",
        attach_limit: true,
        parameters: map(&[("fastIoFailTmo", "30")]),
        mutable: map(&[("preallocate", "true")]),
        volume_bytes: Some(16 << 20),
        ..Default::default()
    }
    .run(&h);
    Sanity {
        name: "nvmf-dhchap",
        attach_limit: true,
        volume_bytes: Some(16 << 20),
        focus_unless_full: Some(MODE_SPECIFIC),
        secrets: map(&[
            ("dhchapKey", DHCHAP_KEY),
            ("dhchapCtrlKey", DHCHAP_CTRL_KEY),
        ]),
        ..Default::default()
    }
    .run(&h);
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    assert_eq!(
        nvmet.controllers(),
        Vec::<String>::new(),
        "controllers left"
    );
    assert_eq!(nvmet.subsystems(), Vec::<String>::new(), "subsystems left");
    // The node's host entry, where its keys were, went with its last
    // volume's unpublish.
    let entry = std::path::Path::new(NVMET)
        .join("hosts")
        .join(&nvmet.host_nqn);
    assert!(!entry.exists(), "{} left", entry.display());
    for key in [DHCHAP_KEY, DHCHAP_CTRL_KEY] {
        assert!(!h.log().contains(&key[10..40]), "a key reached the log");
    }
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_sanity_rbd() {
    require_guest();
    let cluster = CephCluster::shared();
    let config = format!("{LIMITED}{}", cluster.backend_config("sanity"));
    let h = Harness::start_with(Some(&config)).await;
    let key = cluster.client_key();
    Sanity {
        name: "rbd",
        attach_limit: true,
        mutable: map(&[("qosIopsLimit", "500")]),
        volume_bytes: Some(16 << 20),
        skip_unless_full: Some("Snapshot"),
        secrets: map(&[("userID", "ferrovol"), ("userKey", &key)]),
        ..Default::default()
    }
    .run(&h);
    assert!(h.mounts().is_empty(), "{:?}", h.mounts());
    assert!(!h.log().contains(&key), "the key reached the log");
}
