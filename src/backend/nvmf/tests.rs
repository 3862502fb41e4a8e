//! The nvmf seams over a sysfs tree of the test's own: controllers and
//! their paths read as the kernel lays them out, the multipath head found
//! among a subsystem's devices, and the options a connection is made with.

use super::fabrics::{Fabrics, Reconnect};
use super::nvmet::identity_for;
use crate::backend::export::initiator::{Connection, Initiator};
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
    let e = node(d, settings(d)).err().unwrap();
    assert!(e.message.contains("host NQN"), "{e}");
    put(&d.join("hostnqn"), HOST);
    put(&d.join("hostid"), "6c1e2d70-3a55-4b8e-9d3c-0f4a2b7e9c11");
    let b = node(d, settings(d)).unwrap();
    use crate::plugin::{Attacher, Backend};
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
