//! The nvmf seams over a sysfs tree of the test's own: controllers and
//! their paths read as the kernel lays them out, the multipath head found
//! among a subsystem's devices, and the options a connection is made with.

use super::fabrics::{Fabrics, Reconnect};
use super::nvmet::identity_for;
use crate::backend::export::initiator::{Connection, Initiator};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaa";
const NQN: &str = "nqn.2026-12.io.ferrovol:pvc-1";

fn put(path: &Path, value: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, format!("{value}\n")).unwrap();
}

/// Controller `nvme<n>` of `nqn` through `addr`, in `state`.
fn controller(root: &Path, n: u32, nqn: &str, host: &str, addr: &str, state: &str) {
    let dir = root.join(format!("sys/class/nvme/nvme{n}"));
    put(&dir.join("subsysnqn"), nqn);
    put(&dir.join("hostnqn"), host);
    put(&dir.join("state"), state);
    put(&dir.join("address"), addr);
}

/// Subsystem `nvme-subsys<s>` of `nqn` with its head `nvme<s>n1`, a path
/// device and a generic device beside it.
fn subsystem(root: &Path, s: u32, nqn: &str) {
    let dir = root.join(format!("sys/class/nvme-subsystem/nvme-subsys{s}"));
    put(&dir.join("subsysnqn"), nqn);
    for name in [format!("nvme{s}n1"), format!("ng{s}n1"), format!("nvme{s}")] {
        std::fs::create_dir_all(dir.join(name)).unwrap();
    }
    put(&root.join(format!("sys/block/nvme{s}n1/nsid")), "1");
    put(&root.join(format!("sys/block/nvme{s}n1/size")), "262144");
    put(&root.join(format!("sys/block/nvme{s}c{s}n1/nsid")), "1");
}

fn fabrics(root: &Path) -> Fabrics {
    Fabrics {
        sysfs: root.join("sys"),
        dev: root.join("dev"),
        host_nqn: HOST.into(),
        host_id: "aaaa".into(),
        multipath: true,
        timeout: Duration::from_secs(1),
        reconnect: Reconnect {
            ctrl_loss_tmo: 600,
            reconnect_delay: 10,
            fast_io_fail_tmo: -1,
        },
    }
}

#[tokio::test]
async fn controllers_paths_and_the_namespace_are_read_as_the_kernel_lays_them_out() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    controller(
        root,
        0,
        NQN,
        HOST,
        "traddr=10.0.0.5,trsvcid=4420,src_addr=10.0.0.9",
        "live",
    );
    controller(
        root,
        1,
        NQN,
        HOST,
        "traddr=fd00::6,trsvcid=4420",
        "connecting",
    );
    // Another host's, another driver's, and one half made: not ours.
    controller(
        root,
        2,
        NQN,
        "nqn.other-host",
        "traddr=10.0.0.5,trsvcid=4420",
        "live",
    );
    controller(
        root,
        3,
        "nqn.2014-08.org.other:x",
        HOST,
        "traddr=10.0.0.7,trsvcid=4420",
        "live",
    );
    put(&root.join("sys/class/nvme/nvme4/subsysnqn"), NQN);
    subsystem(root, 0, NQN);
    let f = fabrics(root);

    let all = f.controllers();
    assert_eq!(all.len(), 4, "{all:?}");
    assert_eq!(all[0].portal, "10.0.0.5:4420");
    assert_eq!(all[1].portal, "[fd00::6]:4420");
    assert_eq!(f.namespace(NQN, 1).as_deref(), Some("nvme0n1"));
    assert_eq!(f.namespace(NQN, 2), None);
    assert_eq!(f.namespace("nqn.none:x", 1), None);

    let paths = f.paths("nqn.2026-12.io.ferrovol").await.unwrap();
    assert_eq!(paths.down, ["[fd00::6]:4420"]);
    assert_eq!(paths.up.into_iter().collect::<Vec<_>>(), ["10.0.0.5:4420"]);
    // One path down: degraded; the device not the namespace: inaccessible.
    let dev = root.join("dev/nvme0n1");
    let found = f.condition(NQN, &dev).await.unwrap().unwrap();
    assert_eq!(found.reason, super::reasons::NvmePathDown);
    put(&root.join("sys/class/nvme/nvme1/state"), "live");
    assert!(f.condition(NQN, &dev).await.unwrap().is_none());
    let found = f
        .condition(NQN, &root.join("dev/nvme9n1"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.reason, super::reasons::NamespaceMissing);
    for n in [0, 1] {
        put(
            &root.join(format!("sys/class/nvme/nvme{n}/state")),
            "resetting",
        );
    }
    let found = f.condition(NQN, &dev).await.unwrap().unwrap();
    assert_eq!(found.reason, super::reasons::ControllerDown);
    let found = f.condition("nqn.none:x", &dev).await.unwrap().unwrap();
    assert_eq!(found.reason, super::reasons::ControllerMissing);
    // Live, but the subsystem says a path cannot serve the namespace (its
    // ANA state): that path is down; optimized and non-optimized are not.
    for n in [0, 1] {
        put(&root.join(format!("sys/class/nvme/nvme{n}/state")), "live");
        put(
            &root.join(format!("sys/class/nvme/nvme{n}/nvme0c{n}n1/ana_state")),
            "optimized",
        );
    }
    put(
        &root.join("sys/class/nvme/nvme1/nvme0c1n1/ana_state"),
        "non-optimized",
    );
    assert!(f.condition(NQN, &dev).await.unwrap().is_none());
    put(
        &root.join("sys/class/nvme/nvme1/nvme0c1n1/ana_state"),
        "inaccessible",
    );
    let found = f.condition(NQN, &dev).await.unwrap().unwrap();
    assert_eq!(found.reason, super::reasons::NvmePathDown);
    assert!(
        found.message.contains("live, ANA inaccessible"),
        "{}",
        found.message
    );
    let paths = f.paths("nqn.2026-12.io.ferrovol").await.unwrap();
    assert_eq!(paths.down, ["[fd00::6]:4420"]);
    put(
        &root.join("sys/class/nvme/nvme0/nvme0c0n1/ana_state"),
        "persistent-loss",
    );
    let found = f.condition(NQN, &dev).await.unwrap().unwrap();
    assert_eq!(found.reason, super::reasons::ControllerDown);
}

/// A connection's options carry the keys in the one write to
/// /dev/nvme-fabrics; the refusal names neither options nor keys.
#[tokio::test]
async fn a_refused_connection_shows_no_key() {
    let dir = tempfile::tempdir().unwrap();
    let f = fabrics(dir.path());
    let key = (
        "h".to_string(),
        "DHHC-1:00:c2VjcmV0LWtleS1ub3QtdG8tc2hvdw==:".to_string(),
    );
    let portals = ["10.0.0.5:4420"];
    let to = Connection {
        export: NQN,
        portals: &portals,
        unit: 1,
        incoming: Some(&key),
        outgoing: None,
        settings: &BTreeMap::new(),
    };
    // No /dev/nvme-fabrics under the test's root: the connection fails.
    let e = f.attach(&to).await.unwrap_err();
    assert!(e.message.contains(NQN), "{e}");
    assert!(!e.message.contains("DHHC-1"), "{e}");
    assert!(!e.message.contains("dhchap"), "{e}");
}

#[test]
fn a_subsystem_s_identity_is_its_name_s() {
    let (nguid, serial) = identity_for(NQN);
    assert_eq!(nguid.len(), 32);
    assert_eq!(serial.len(), 16);
    assert_eq!(identity_for(NQN), (nguid.clone(), serial));
    assert_ne!(identity_for("nqn.2026-12.io.ferrovol:pvc-2").0, nguid);
}

fn settings(dir: &Path) -> super::NvmfSettings {
    super::NvmfSettings {
        nqn_prefix: "nqn.2026-12.io.ferrovol".into(),
        portals: vec!["10.0.0.5:4420".into(), "[fd00::6]:4420".into()],
        store: None,
        first_port_id: 4420,
        configfs: dir.join("nvmet"),
        host_nqn_file: dir.join("hostnqn"),
        host_id_file: dir.join("hostid"),
        multipath: true,
        connect_timeout: 2,
        ctrl_loss_tmo: 1800,
        reconnect_delay: 2,
        fast_io_fail_tmo: 120,
    }
}

fn node(dir: &Path, s: super::NvmfSettings) -> crate::error::Result<super::NvmfBackend> {
    super::NvmfBackend::new(
        "nvmf",
        s,
        std::sync::Arc::new(crate::exec::FakeRunner::new()),
        None,
        dir.join("records"),
    )
}

/// A node needs its host NQN and host ID; the settings are checked
/// before anything is made.
#[test]
fn a_node_is_built_from_its_host_nqn_and_checked_settings() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    use crate::plugin::{Attacher, Backend};
    // Without them it is built, but gives no node id token: the node
    // leaves it out, saying why, and serves its other backends.
    let b = node(d, settings(d)).unwrap();
    let e = b.node_id_suffix().unwrap_err();
    assert!(e.message.contains("host ID"), "{e}");
    put(&d.join("hostid"), "6c1e2d70-3a55-4b8e-9d3c-0f4a2b7e9c11");
    let e = b.node_id_suffix().unwrap_err();
    assert!(e.message.contains("host NQN"), "{e}");
    put(&d.join("hostnqn"), "iqn.not-an-nqn");
    let e = b.node_id_suffix().unwrap_err();
    assert!(e.message.contains("is not valid"), "{e}");
    put(&d.join("hostnqn"), HOST);
    let b = node(d, settings(d)).unwrap();
    assert_eq!(b.kind().name, "nvmf");
    assert_eq!(b.node_id_suffix().unwrap().as_deref(), Some(HOST));
    for (bad, what) in [
        (
            super::NvmfSettings {
                nqn_prefix: "iqn.2026-12.io.ferrovol".into(),
                ..settings(d)
            },
            "nqn_prefix",
        ),
        (
            super::NvmfSettings {
                portals: vec!["target.example:4420".into()],
                ..settings(d)
            },
            "IP address",
        ),
        (
            super::NvmfSettings {
                first_port_id: u16::MAX,
                ..settings(d)
            },
            "first_port_id",
        ),
        (
            super::NvmfSettings {
                reconnect_delay: 0,
                ..settings(d)
            },
            "reconnect settings: reconnectDelay",
        ),
        (
            super::NvmfSettings {
                fast_io_fail_tmo: 1801,
                ..settings(d)
            },
            "reconnect settings: fastIoFailTmo (1801) is longer than ctrlLossTmo (1800)",
        ),
    ] {
        let e = node(d, bad).err().unwrap();
        assert!(e.message.contains(what), "{what}: {e}");
    }
}

/// DH-HMAC-CHAP keys from the secrets: checked as keys, the controller's
/// only with the host's, and no error shows one.
#[test]
fn keys_are_taken_from_the_secrets_checked_and_never_shown() {
    use crate::backend::export::Protocol;
    let dir = tempfile::tempdir().unwrap();
    let p = super::Nvmf {
        settings: settings(dir.path()),
    };
    let key = "DHHC-1:00:mLDyoHSmTd48/lDKCe/n5bfzHtigiD7SKHzxtj/ccdhXXaOR:";
    let secrets = |pairs: &[(&str, &str)]| {
        crate::plugin::Secrets::new(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    let (incoming, outgoing) = p
        .credentials(&secrets(&[(super::DHCHAP_KEY, key)]), Some(HOST))
        .unwrap();
    assert_eq!(incoming, Some((HOST.to_string(), key.to_string())));
    assert_eq!(outgoing, None);
    assert_eq!(
        p.credentials(&secrets(&[]), Some(HOST)).unwrap(),
        (None, None)
    );
    let e = p
        .credentials(&secrets(&[(super::DHCHAP_CTRL_KEY, key)]), Some(HOST))
        .unwrap_err();
    assert!(e.message.contains(super::DHCHAP_KEY), "{e}");
    for bad in [
        "DHHC-1:00:short:",
        "secret-of-someone-else",
        "DHHC-1:0x:AAAA:",
    ] {
        let e = p
            .credentials(&secrets(&[(super::DHCHAP_KEY, bad)]), Some(HOST))
            .unwrap_err();
        assert!(!e.message.contains(bad), "{e}");
    }
    // The host a node id names: its host NQN token.
    assert_eq!(
        p.host_in(&format!("node-1/iqn.2026-01.x:y,{HOST}")),
        Some(HOST)
    );
    assert_eq!(p.host_in("node-1/iqn.2026-01.x:y"), None);
    assert_eq!(
        super::nqn_for("nqn.2026-12.io.ferrovol", "pvc-1"),
        "nqn.2026-12.io.ferrovol:pvc-1"
    );
    assert!(super::nqn_for("nqn.2026-12.io.ferrovol", "Weird/Name").contains(":v-"));
}

/// A volume's reconnect settings (its class's parameters, in its volume
/// context) take the place of the node's in the connection's options;
/// values that are not whole seconds in range, or that would hold I/O past
/// the controller's removal, are refused naming the key, before anything
/// is written.
#[tokio::test]
async fn a_volume_s_reconnect_settings_reach_the_connection_checked() {
    let dir = tempfile::tempdir().unwrap();
    let f = fabrics(dir.path());
    // A file where the kernel's device is: the write lands in it, no
    // controller appears.
    let fabrics_dev = dir.path().join("dev/nvme-fabrics");
    put(&fabrics_dev, "");
    std::fs::write(&fabrics_dev, "").unwrap();
    let written = || std::fs::read_to_string(dir.path().join("dev/nvme-fabrics")).unwrap();
    let portals = ["10.0.0.5:4420"];
    let given = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let attach = |settings: BTreeMap<String, String>| {
        let f = &f;
        async move {
            let to = Connection {
                export: NQN,
                portals: &portals,
                unit: 1,
                incoming: None,
                outgoing: None,
                settings: &settings,
            };
            f.attach(&to).await.unwrap_err()
        }
    };
    use super::{CTRL_LOSS_TMO as LOSS, FAST_IO_FAIL_TMO as FAIL, RECONNECT_DELAY as DELAY};
    for (bad, says) in [
        (
            given(&[(LOSS, "ten")]),
            "parameter ctrlLossTmo: \"ten\" is not -1",
        ),
        (given(&[(LOSS, "-2")]), "parameter ctrlLossTmo"),
        (
            given(&[(DELAY, "0")]),
            "parameter reconnectDelay: \"0\" is not 1 to 86400",
        ),
        (given(&[(FAIL, "86401")]), "parameter fastIoFailTmo"),
        (
            given(&[(LOSS, "30"), (FAIL, "60")]),
            "fastIoFailTmo (60) is longer than ctrlLossTmo (30)",
        ),
    ] {
        let e = attach(bad).await;
        assert_eq!(e.kind, crate::error::Kind::InvalidArgument, "{e}");
        assert!(e.message.contains(says), "{says}: {e}");
        assert_eq!(written(), "", "nothing is written for {says}");
    }
    // The node's own (fabrics(): 600, 10, -1) where the volume says
    // nothing...
    attach(BTreeMap::new()).await;
    assert!(
        written().contains("ctrl_loss_tmo=600,reconnect_delay=10,fast_io_fail_tmo=-1"),
        "{}",
        written()
    );
    // ...and the volume's where it does.
    std::fs::write(&fabrics_dev, "").unwrap();
    attach(given(&[(LOSS, "-1"), (DELAY, "3"), (FAIL, "0")])).await;
    assert!(
        written().contains("ctrl_loss_tmo=-1,reconnect_delay=3,fast_io_fail_tmo=0"),
        "{}",
        written()
    );
}

/// A controller's volume: the reconnect settings are the backend's own
/// parameters, checked at creation and handed to the node in the volume
/// context; the store is given only its own.
#[tokio::test]
async fn reconnect_parameters_are_checked_at_creation_and_go_to_the_node_not_the_store() {
    use crate::backend::export::testing::{create, MemStore};
    use crate::plugin::{Backend, Provisioner};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let store = std::sync::Arc::new(MemStore::new("nvmf"));
    // A controller: configfs is the test's own tree, with the groups
    // configfs would make by itself (a subsystem's namespaces, a port's
    // subsystems and its attributes, empty).
    let nvmet = d.join("nvmet");
    std::fs::create_dir_all(nvmet.join("subsystems").join(NQN).join("namespaces")).unwrap();
    for port in ["4420", "4421"] {
        std::fs::create_dir_all(nvmet.join("ports").join(port).join("subsystems")).unwrap();
        for attr in ["addr_trtype", "addr_traddr", "addr_trsvcid"] {
            std::fs::write(nvmet.join("ports").join(port).join(attr), "").unwrap();
        }
    }
    let b = super::NvmfBackend::new(
        "nvmf",
        settings(d),
        std::sync::Arc::new(crate::exec::FakeRunner::new()),
        Some(store.clone()),
        d.join("records"),
    )
    .unwrap();
    let keys = b.parameters();
    for k in [
        super::CTRL_LOSS_TMO,
        super::RECONNECT_DELAY,
        super::FAST_IO_FAIL_TMO,
    ] {
        assert!(keys.contains(&k), "{k}: {keys:?}");
    }
    let mut req = create("pvc-1");
    req.parameters = BTreeMap::from([
        (super::FAST_IO_FAIL_TMO.to_string(), "5".to_string()),
        ("storeKey".to_string(), "x".to_string()),
    ]);
    let mut bad = req.clone();
    bad.parameters
        .insert(super::CTRL_LOSS_TMO.to_string(), "2".to_string());
    let e = b.validate_parameters(&bad.parameters).unwrap_err();
    assert!(e.message.contains("longer than ctrlLossTmo (2)"), "{e}");
    let e = b.create_volume(&bad).await.unwrap_err();
    assert_eq!(e.kind, crate::error::Kind::InvalidArgument, "{e}");
    b.validate_parameters(&req.parameters).unwrap();
    let info = b.create_volume(&req).await.unwrap();
    assert_eq!(
        info.context,
        BTreeMap::from([(super::FAST_IO_FAIL_TMO.to_string(), "5".to_string())])
    );
    assert_eq!(store.calls()[0], "create pvc-1 storeKey=x");
}

/// An Identify Namespace data structure's size: NSZE blocks of the LBA
/// format FLBAS names (its low and high bits both).
#[test]
fn a_namespace_s_size_is_read_from_its_identify_data() {
    let mut id = vec![0u8; 4096];
    id[0..8].copy_from_slice(&65536u64.to_le_bytes());
    // Format 0: 512-byte blocks (LBADS 9).
    id[128 + 2] = 9;
    assert_eq!(super::fabrics::namespace_bytes(&id), 65536 * 512);
    // Format 1 (4 KiB) chosen by FLBAS's low bits...
    id[132 + 2] = 12;
    id[26] = 1;
    assert_eq!(super::fabrics::namespace_bytes(&id), 65536 * 4096);
    // ...and format 17 by its high bits (bit 5: +16).
    id[128 + 4 * 17 + 2] = 13;
    id[26] = 0x21;
    assert_eq!(super::fabrics::namespace_bytes(&id), 65536 * 8192);
}
