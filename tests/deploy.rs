//! Static checks of `deploy/` and the `Dockerfile` (no cluster or Docker
//! engine runs here): the manifests parse, agree with each other and with
//! the driver, and the config they carry is one ferrovol accepts.

use ferrovol::backend::{file::FileSettings, lvm::LvmSettings};
use ferrovol::config::Config;
use serde_yaml::Value;
use std::path::Path;

fn docs(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy")
            .join(file),
    )
    .unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

use serde::Deserialize;

fn kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect()
}

fn container<'a>(ds: &'a Value, name: &str) -> &'a Value {
    ds["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn args(c: &Value) -> Vec<String> {
    c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn node_config() -> Config {
    let all = docs("node-deployment.yaml");
    let cm = kind(&all, "ConfigMap")[0];
    Config::parse(cm["data"]["config.toml"].as_str().unwrap())
        .expect("the ConfigMap's config parses")
}

#[test]
fn node_deployment_is_consistent() {
    let all = docs("node-deployment.yaml");
    let ds = kind(&all, "DaemonSet")[0];
    let ferrovol = container(ds, "ferrovol");
    let fa = args(ferrovol);
    assert!(fa.contains(&"--mode=all".to_string()), "{fa:?}");
    assert!(fa.contains(&"--endpoint=unix:///csi/csi.sock".to_string()));
    assert!(ferrovol["securityContext"]["privileged"].as_bool().unwrap());
    let prov = args(container(ds, "csi-provisioner"));
    for flag in [
        "--node-deployment=true",
        "--enable-capacity=true",
        "--strict-topology=true",
        "--csi-address=/csi/csi.sock",
    ] {
        assert!(
            prov.contains(&flag.to_string()),
            "provisioner lacks {flag}: {prov:?}"
        );
    }
    let prov_env = container(ds, "csi-provisioner")["env"]
        .as_sequence()
        .unwrap();
    assert!(prov_env
        .iter()
        .any(|e| e["name"].as_str() == Some("NODE_NAME")));
    assert!(args(container(ds, "csi-snapshotter")).contains(&"--node-deployment=true".to_string()));
    // The registrar points kubelet at the socket the DaemonSet shares.
    let reg = args(container(ds, "node-driver-registrar"));
    let socket_dir = ds["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"].as_str() == Some("socket-dir"))
        .unwrap()["hostPath"]["path"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reg.contains(&format!(
            "--kubelet-registration-path={socket_dir}/csi.sock"
        )),
        "{reg:?}"
    );
    assert!(socket_dir.ends_with("csi.ferrovol.io"));
    // The kubelet dir propagates mounts both ways.
    let mounts = ferrovol["volumeMounts"].as_sequence().unwrap();
    let kubelet = mounts
        .iter()
        .find(|m| m["name"].as_str() == Some("kubelet-dir"))
        .unwrap();
    assert_eq!(kubelet["mountPropagation"].as_str(), Some("Bidirectional"));
}

#[test]
fn shipped_config_is_accepted() {
    let config = node_config();
    for b in &config.backends {
        match b.kind.as_str() {
            "file" => {
                b.settings::<FileSettings>().unwrap();
            }
            "lvm" => {
                let s = b.settings::<LvmSettings>().unwrap();
                assert!(!s.device_classes.is_empty());
            }
            other => panic!("unknown backend type {other}"),
        }
    }
}

#[test]
fn storage_classes_name_configured_backends_and_classes() {
    let config = node_config();
    let lvm = config
        .backends
        .iter()
        .find(|b| b.kind == "lvm")
        .unwrap()
        .settings::<LvmSettings>()
        .unwrap();
    let driver = kind(&docs("csidriver.yaml"), "CSIDriver")[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        driver, "csi.ferrovol.io",
        "the CSIDriver matches the default driver name"
    );
    for file in ["storageclass.yaml", "storageclass-lvm.yaml"] {
        let all = docs(file);
        for sc in kind(&all, "StorageClass") {
            assert_eq!(sc["provisioner"].as_str(), Some(driver.as_str()));
            assert_eq!(
                sc["volumeBindingMode"].as_str(),
                Some("WaitForFirstConsumer"),
                "node-local volumes wait for the pod"
            );
            let backend = sc["parameters"]["backend"].as_str().unwrap();
            assert!(
                config.backends.iter().any(|b| b.name() == backend),
                "no backend {backend}"
            );
            if let Some(class) = sc["parameters"]["deviceClass"].as_str() {
                assert!(
                    lvm.device_classes.iter().any(|c| c.name == class),
                    "no device class {class}"
                );
            }
        }
        for vsc in kind(&all, "VolumeSnapshotClass") {
            assert_eq!(vsc["driver"].as_str(), Some(driver.as_str()));
        }
    }
}

#[test]
fn dockerfile_builds_from_the_tree() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    let mut copied = 0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let parts: Vec<&str> = line.split_whitespace().collect();
        for src in &parts[1..parts.len() - 1] {
            assert!(root.join(src).exists(), "Dockerfile copies missing {src}");
            copied += 1;
        }
    }
    assert!(copied >= 4);
    assert!(text.contains("cargo build --release --locked"));
    assert!(text.contains(r#"ENTRYPOINT ["/usr/local/bin/ferrovol"]"#));
    for tool in ["util-linux", "e2fsprogs", "xfsprogs", "lvm2"] {
        assert!(text.contains(tool), "the image lacks {tool}");
    }
}

/// The nfs example config is accepted by the backend, and every parameter
/// of the nfs StorageClasses passes its checks.
#[test]
fn nfs_storage_classes_match_the_example_config() {
    use ferrovol::plugin::Backend;
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/nfs-config.toml"
    ))
    .unwrap();
    let config = Config::parse(&text).unwrap();
    let bc = &config.backends[0];
    assert_eq!(bc.kind, "nfs");
    let work = tempfile::tempdir().unwrap();
    let backend = ferrovol::backend::nfs::NfsBackend::new(
        bc.name(),
        bc.settings().unwrap(),
        std::sync::Arc::new(ferrovol::exec::SystemRunner::default()),
        std::sync::Arc::new(ferrovol::host::SystemHost),
        work.path().to_path_buf(),
    )
    .unwrap();
    let all = docs("storageclass-nfs.yaml");
    let classes = kind(&all, "StorageClass");
    assert_eq!(classes.len(), 2);
    for sc in classes {
        let params = sc["parameters"].as_mapping().unwrap();
        assert_eq!(params[&Value::from("backend")].as_str(), Some(bc.name()));
        let own: std::collections::BTreeMap<String, String> = params
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().unwrap().to_string(),
                    v.as_str().unwrap().to_string(),
                )
            })
            .filter(|(k, _)| k != "backend")
            .collect();
        backend
            .validate_parameters(&own)
            .unwrap_or_else(|e| panic!("{:?}: {}", sc["metadata"]["name"], e.message));
    }
}

/// The iscsi example config builds (with its lvm store), the StorageClass's
/// own parameters pass the backend's checks, and the example Secret holds
/// exactly the keys the backend reads.
#[test]
fn iscsi_storage_class_and_secret_match_the_example_config() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/iscsi-config.toml"
    ))
    .unwrap();
    let config = Config::parse(&text).unwrap();
    let state = tempfile::tempdir().unwrap();
    let registry = ferrovol::backend::build_registry(
        &config,
        std::sync::Arc::new(ferrovol::exec::SystemRunner::default()),
        std::sync::Arc::new(ferrovol::host::SystemHost),
        state.path(),
    )
    .unwrap();
    let backend = registry.get("iscsi").expect("an iscsi backend");
    assert!(backend.capabilities().attach);
    let all = docs("storageclass-iscsi.yaml");
    let sc = kind(&all, "StorageClass")[0];
    let params = sc["parameters"].as_mapping().unwrap();
    assert_eq!(params[&Value::from("backend")].as_str(), Some("iscsi"));
    let own: std::collections::BTreeMap<String, String> = params
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().unwrap().to_string(),
                v.as_str().unwrap().to_string(),
            )
        })
        .filter(|(k, _)| k != "backend" && !k.starts_with("csi.storage.k8s.io/"))
        .collect();
    backend.validate_parameters(&own).unwrap();
    let secret = kind(&all, "Secret")[0];
    let mut keys: Vec<&str> = secret["stringData"]
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap())
        .collect();
    keys.sort();
    use ferrovol::backend::iscsi::{CHAP_PASSWORD, CHAP_USER, MUTUAL_PASSWORD, MUTUAL_USER};
    let mut want = vec![CHAP_USER, CHAP_PASSWORD, MUTUAL_USER, MUTUAL_PASSWORD];
    want.sort();
    assert_eq!(keys, want);
    // Both secrets the backend reads are named by the class.
    for key in ["controller-publish-secret-name", "node-stage-secret-name"] {
        assert_eq!(
            params[&Value::from(format!("csi.storage.k8s.io/{key}"))].as_str(),
            secret["metadata"]["name"].as_str()
        );
    }
}

/// The rbd example config builds, the StorageClass's own parameters pass
/// the backend's checks, every secret the CO can send is named, and the
/// example Secret holds the keys the backend reads.
#[test]
fn rbd_storage_class_and_secret_match_the_example_config() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/rbd-config.toml"
    ))
    .unwrap();
    let config = Config::parse(&text).unwrap();
    let state = tempfile::tempdir().unwrap();
    let registry = ferrovol::backend::build_registry(
        &config,
        std::sync::Arc::new(ferrovol::exec::SystemRunner::default()),
        std::sync::Arc::new(ferrovol::host::SystemHost),
        state.path(),
    )
    .unwrap();
    let backend = registry.get("rbd").expect("an rbd backend");
    let all = docs("storageclass-rbd.yaml");
    let sc = kind(&all, "StorageClass")[0];
    let params = sc["parameters"].as_mapping().unwrap();
    let own: std::collections::BTreeMap<String, String> = params
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().unwrap().to_string(),
                v.as_str().unwrap().to_string(),
            )
        })
        .filter(|(k, _)| k != "backend" && !k.starts_with("csi.storage.k8s.io/"))
        .collect();
    backend.validate_parameters(&own).unwrap();
    let secret = kind(&all, "Secret")[0];
    let name = secret["metadata"]["name"].as_str();
    for key in [
        "provisioner-secret-name",
        "controller-publish-secret-name",
        "controller-expand-secret-name",
        "node-stage-secret-name",
    ] {
        assert_eq!(
            params[&Value::from(format!("csi.storage.k8s.io/{key}"))].as_str(),
            name,
            "{key}"
        );
    }
    let vsc = kind(&all, "VolumeSnapshotClass")[0];
    assert_eq!(
        vsc["parameters"]["csi.storage.k8s.io/snapshotter-secret-name"].as_str(),
        name
    );
    let data = secret["stringData"].as_mapping().unwrap();
    use ferrovol::backend::rbd::{USER_ID, USER_KEY};
    assert!(data.contains_key(Value::from(USER_ID)) && data.contains_key(Value::from(USER_KEY)));
}
