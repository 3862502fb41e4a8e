//! The rbd backend over the scripted runner, with `rbd` outputs captured
//! from Ceph 16 (Debian bookworm).

use super::*;
use crate::exec::{Effect, FakeRunner, Reply};

mod attach;
mod controller;
mod health;
mod node;

const KEY: &str = "AQBad0BhAAAAABAAbadbadbadbadbadbadbadbQ==";

/// `rbd info --format json` of a fresh image, and of a clone.
fn info(name: &str, size: u64) -> String {
    format!(
        r#"{{"name":"{name}","id":"102e3ea2dccd","size":{size},"objects":4,"order":22,"object_size":4194304,"snapshot_count":0,"block_name_prefix":"rbd_data.102e3ea2dccd","format":2,"features":["layering"],"op_features":[],"flags":[],"create_timestamp":"Sun Nov 22 11:18:07 2026","access_timestamp":"Sun Nov 22 11:18:07 2026","modify_timestamp":"Sun Nov 22 11:18:07 2026"}}"#
    )
}

fn clone_info(name: &str, parent: &str) -> String {
    format!(
        r#"{{"name":"{name}","id":"104019085c61","size":16777216,"objects":4,"order":22,"object_size":4194304,"snapshot_count":0,"block_name_prefix":"rbd_data.104019085c61","format":2,"features":["layering","operations"],"op_features":["clone-child"],"flags":[],"create_timestamp":"Sun Nov 22 11:18:08 2026","access_timestamp":"Sun Nov 22 11:18:08 2026","modify_timestamp":"Sun Nov 22 11:18:08 2026","parent":{{"pool":"rbd","pool_namespace":"","image":"{parent}","id":"102e3ea2dccd","snapshot":"s1","trash":false,"overlap":16777216}}}}"#
    )
}

const NO_IMAGE: &str = "rbd: error opening image nope: (2) No such file or directory";

fn backend(r: Arc<FakeRunner>, dir: &std::path::Path, own_user: bool) -> RbdBackend {
    let settings = RbdSettings {
        cluster_id: "c1".into(),
        monitors: vec!["v1:10.0.0.1:6789".into()],
        pools: vec!["rbd".into(), "fast".into()],
        user: own_user.then(|| "ferrovol".into()),
        keyring: own_user.then(|| "/etc/ferrovol/keyring".into()),
        max_clone_depth: 1,
        image_features: "layering".into(),
        map_options: "queue_depth=128".into(),
        fence_expiry: 3600,
        client: Client::Cli,
    };
    RbdBackend::new("rbd", settings, r, dir.to_path_buf())
        .unwrap()
        .with_sysfs(dir.join("sys"))
}

fn secrets() -> Secrets {
    Secrets::new(BTreeMap::from([
        (USER_ID.to_string(), "ferrovol".to_string()),
        (USER_KEY.to_string(), KEY.to_string()),
    ]))
}

fn create(name: &str) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        required_bytes: 10 * MIB + 1,
        limit_bytes: 0,
        capabilities: vec![],
        parameters: BTreeMap::new(),
        metadata: BTreeMap::new(),
        source: None,
        secrets: secrets(),
    }
}

/// The rbd arguments after the connection options.
fn ops(r: &FakeRunner) -> Vec<String> {
    r.lines()
        .iter()
        .map(|l| match l.split_once(" --rados-osd-op-timeout 30 ") {
            Some((_, rest)) => rest.to_string(),
            None => l.trim_start_matches("rbd ").to_string(),
        })
        .collect()
}

/// The kernel shows image rbd/fv-a mapped at /dev/rbd0 (its sysfs entry
/// under the test's `dir`), as `rbd device map` leaves it.
fn mapped(dir: &std::path::Path) {
    let dev = dir.join("sys/bus/rbd/devices/0");
    std::fs::create_dir_all(&dev).unwrap();
    for (attr, value) in [
        ("pool", "rbd"),
        ("pool_ns", ""),
        ("name", "fv-a"),
        ("current_snap", "-"),
    ] {
        std::fs::write(dev.join(attr), format!("{value}\n")).unwrap();
    }
}

/// /dev/rbd0 unmapped: its sysfs entry gone.
fn unmapped(dir: &std::path::Path) {
    let _ = std::fs::remove_dir_all(dir.join("sys/bus/rbd/devices/0"));
}

/// What `rbd device unmap` does to the kernel's table, for the scripted
/// runner.
fn unmaps(dir: &std::path::Path) -> Effect {
    let dir = dir.to_path_buf();
    Effect(Arc::new(move || unmapped(&dir)))
}

fn stage_ctx(node: &str) -> AttachContext {
    AttachContext {
        publish_context: BTreeMap::new(),
        volume_context: BTreeMap::from([("mapOptions".to_string(), "ms_mode=crc".to_string())]),
        secrets: secrets(),
        readonly: true,
        node_id: node.into(),
    }
}
