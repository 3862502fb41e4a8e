//! The Helm chart (deploy/chart), rendered and linted offline with Helm's
//! own library (tests/deploy/chart.py), held to the overlays: for each
//! overlay, the chart with that overlay's choices (deploy/chart/ci)
//! renders the same objects, so every test of the overlays holds for the
//! chart too. What only the chart offers (values for images, the kubelet
//! directory, resources, priority classes, node groups, the PodMonitor) is
//! checked here from the rendered objects, and the node groups' drivers
//! are started from them.

use super::common;
use super::common::deployed::*;
use serde_json::json;
use serde_yaml::Value;
use std::collections::BTreeMap;
use std::process::Command;

/// The labels Helm's objects carry and kustomize's do not: who made them.
const HELM_LABELS: [&str; 3] = [
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
];

/// A rendered object as the API server would take it, less what only
/// says which tool made it: the tool's labels, kustomize's hash suffix on
/// ConfigMap names (the chart rolls pods by a checksum annotation
/// instead), comments (gone with the YAML parse; a config file is
/// compared as the TOML it parses to), and the order of named lists
/// (volumes, mounts, env, containers), which the API does not keep by
/// meaning.
fn comparable(r: &Rendered) -> BTreeMap<String, Value> {
    fn unhash(name: &str) -> String {
        match name.rsplit_once('-') {
            Some((base, h)) if h.len() == 10 && h.chars().all(|c| c.is_ascii_alphanumeric()) => {
                base.to_string()
            }
            _ => name.to_string(),
        }
    }
    fn sorted(v: &mut Value) {
        match v {
            Value::Mapping(m) => m.iter_mut().for_each(|(_, v)| sorted(v)),
            Value::Sequence(items) => {
                items.iter_mut().for_each(sorted);
                if !items.is_empty() && items.iter().all(|i| i.get("name").is_some()) {
                    // By content, whatever the keys' order (serde_json's
                    // maps are sorted).
                    items.sort_by_key(|i| serde_json::to_value(i).unwrap().to_string());
                }
            }
            _ => {}
        }
    }
    let mut out = BTreeMap::new();
    for d in &r.docs {
        let mut d = d.clone();
        let md = d["metadata"].as_mapping_mut().unwrap();
        if let Some(Value::Mapping(labels)) = md.get_mut("labels") {
            for l in HELM_LABELS {
                labels.remove(l);
            }
            if labels.is_empty() {
                md.remove("labels");
            }
        }
        if d["kind"] == "ConfigMap" {
            d["metadata"]["name"] = unhash(s(&d["metadata"]["name"])).into();
            for (_, text) in d["data"].as_mapping_mut().unwrap().iter_mut() {
                let parsed: toml::Value = toml::from_str(s(text)).unwrap();
                *text = serde_yaml::to_value(parsed).unwrap();
            }
        }
        if let Some(t) = d.get_mut("spec").and_then(|s| s.get_mut("template")) {
            if let Some(Value::Mapping(a)) = t["metadata"].get_mut("annotations") {
                a.remove("checksum/config");
                if a.is_empty() {
                    t["metadata"]
                        .as_mapping_mut()
                        .unwrap()
                        .remove("annotations");
                }
            }
            if let Some(Value::Sequence(vols)) = t["spec"].get_mut("volumes") {
                for v in vols {
                    if let Some(cm) = v.get_mut("configMap") {
                        cm["name"] = unhash(s(&cm["name"])).into();
                    }
                }
            }
        }
        sorted(&mut d);
        let key = format!(
            "{} {}/{}",
            s(&d["kind"]),
            d["metadata"]["namespace"].as_str().unwrap_or("-"),
            s(&d["metadata"]["name"])
        );
        assert!(
            out.insert(key.clone(), d).is_none(),
            "{}: two {key}",
            r.name
        );
    }
    out
}

/// Where two objects first differ, as a path and both values.
fn difference(a: &Value, b: &Value, at: &str) -> Option<String> {
    match (a, b) {
        (Value::Mapping(x), Value::Mapping(y)) => {
            let mut keys: Vec<&Value> = x.keys().chain(y.keys()).collect();
            keys.sort_by_key(|k| serde_yaml::to_string(k).unwrap());
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let name = serde_yaml::to_string(k).unwrap();
                let at = format!("{at}.{}", name.trim());
                difference(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    &at,
                )
            })
        }
        (Value::Sequence(x), Value::Sequence(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (a, b))| difference(a, b, &format!("{at}[{i}]"))),
        _ if a == b => None,
        _ => Some(format!(
            "{at}: {} against {}",
            serde_yaml::to_string(a).unwrap().trim(),
            serde_yaml::to_string(b).unwrap().trim()
        )),
    }
}

/// Every way `chart` differs from `overlay`, one line each.
fn differences(overlay: &Rendered, chart: &Rendered) -> Vec<String> {
    let (k, h) = (comparable(overlay), comparable(chart));
    let mut out = Vec::new();
    for (key, a) in &k {
        match h.get(key) {
            None => out.push(format!("{key}: only in the overlay")),
            Some(b) => out.extend(difference(a, b, key)),
        }
    }
    out.extend(
        h.keys()
            .filter(|key| !k.contains_key(*key))
            .map(|key| format!("{key}: only in the chart")),
    );
    out
}

/// One source of truth for two install paths: for every overlay, the
/// chart given that overlay's choices (deploy/chart/ci/<overlay>-values.yaml)
/// renders the same objects, field by field: workloads with their args,
/// images and tags, volumes and mounts, the config files (as the TOML they
/// parse to), classes, Secrets, RBAC. And the comparison sees a change: the
/// chart with another kubelet directory differs where that directory is
/// used.
#[test]
fn the_chart_renders_what_each_overlay_applies() {
    for overlay in overlays() {
        let k = render(overlay);
        let h = render_chart("chart", k.of, &chart_values(overlay));
        let diff = differences(&k, &h);
        assert!(
            diff.is_empty(),
            "the chart with deploy/chart/ci/{overlay}-values.yaml differs from \
             deploy/overlays/{overlay} (overlay's value first):\n{}",
            diff.join("\n")
        );
        println!("{overlay}: {} objects alike", h.docs.len());
    }
    let mut values = chart_values("file");
    values["kubeletDir"] = json!("/var/lib/k0s/kubelet");
    let diff = differences(&render("file"), &render_chart("chart", "file", &values));
    let joined = diff.join("\n");
    for changed in [
        "kubelet-registration-path=/var/lib/k0s/kubelet/plugins/local.csi.ferrovol.io/csi.sock",
        "allowed_paths[0]: /var/lib/kubelet against /var/lib/k0s/kubelet",
    ] {
        assert!(joined.contains(changed), "{changed} not seen in:\n{joined}");
    }
}

/// The values a mixed cluster sets: images from a mirror, another kubelet
/// directory, a pull policy, priority classes, resources, node groups on
/// both drivers, and the PodMonitor.
fn operator_values() -> serde_json::Value {
    let f = root().join("deploy/chart/ci/groups-values.yaml");
    let mut v: serde_json::Value =
        serde_yaml::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
    v["image"] =
        json!({"repository": "mirror.example/ferrovol", "tag": "9.9.9", "pullPolicy": "Always"});
    v["sidecars"]["registry"] = json!("mirror.example/sig-storage");
    v["sidecars"]["pullPolicy"] = json!("Always");
    v["kubeletDir"] = json!("/var/lib/k0s/kubelet");
    v["local"]["node"]["priorityClassName"] = json!("storage-critical");
    v["remote"]["controller"]["resources"]["ferrovol"] =
        json!({"requests": {"cpu": "100m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}});
    v["volumeHealth"] = json!({"enabled": true, "listInterval": "10m", "monitorInterval": "2m"});
    v
}

/// Each value reaches what it names, and nothing else: every container
/// pulls from the mirror with the policy; the kubelet directory is the
/// registrar's path, the node plugins' mounts (at the same path: the
/// kubelet names host paths in its calls) and the configs' allowed paths;
/// node groups get their own DaemonSet and config on their label's nodes
/// while the main DaemonSet keeps off them, and a group without lvm
/// mounts none of lvm's host paths; the PodMonitor skips the plugins that
/// listen on loopback.
#[test]
fn chart_values_reach_what_they_name() {
    let r = render_chart("chart", "all", &operator_values());
    for w in r.workloads() {
        let name = s(&w["metadata"]["name"]);
        // Volume health on every ferrovol container, node groups' too;
        // the monitor's intervals on its flags.
        let env = seq(&container(w, "ferrovol")["env"])
            .iter()
            .any(|e| s(&e["name"]) == "FERROVOL_VOLUME_HEALTH" && s(&e["value"]) == "true");
        assert!(env, "{name}");
        if name == "ferrovol-controller" {
            let m = container(w, "csi-external-health-monitor-controller");
            assert_eq!(flag(m, "list-volumes-interval").as_deref(), Some("10m"));
            assert_eq!(flag(m, "monitor-interval").as_deref(), Some("2m"));
        }
        for c in containers(w) {
            let image = s(&c["image"]);
            assert!(image.starts_with("mirror.example/"), "{name}: {image}");
            assert_eq!(s(&c["imagePullPolicy"]), "Always", "{name}");
            assert!(c["resources"]["requests"]["cpu"].is_string(), "{name}");
        }
        assert_eq!(
            s(&container(w, "ferrovol")["image"]),
            "mirror.example/ferrovol:9.9.9"
        );
        if w["kind"] == "DaemonSet" {
            let reg = flag(
                container(w, "node-driver-registrar"),
                "kubelet-registration-path",
            )
            .unwrap();
            assert!(reg.starts_with("/var/lib/k0s/kubelet/plugins/"), "{reg}");
            let f = container(w, "ferrovol");
            let m = mount(f, "/var/lib/k0s/kubelet").expect("the kubelet dir at its own path");
            assert_eq!(s(&m["mountPropagation"]), "Bidirectional");
            assert_eq!(
                host_path_at(w, f, "/var/lib/k0s/kubelet"),
                Some("/var/lib/k0s/kubelet")
            );
            let cm = s(&volume(w, "config")["configMap"]["name"]);
            let node = &r.config_files(cm)["00-driver.toml"];
            let node: toml::Value = toml::from_str(node).unwrap();
            assert_eq!(
                node["node"]["allowed_paths"],
                toml::Value::Array(vec!["/var/lib/k0s/kubelet".into()])
            );
        }
    }
    assert_eq!(
        s(&pod(r.named("DaemonSet", "ferrovol-local-node"))["priorityClassName"]),
        "storage-critical"
    );
    let c = container(r.named("Deployment", "ferrovol-controller"), "ferrovol");
    assert_eq!(s(&c["resources"]["limits"]["memory"]), "256Mi");

    // The groups.
    let groups = chart_values_groups();
    assert!(!groups.is_empty());
    for (driver, main, group, selector) in &groups {
        let g = r.named("DaemonSet", group);
        let (key, value) = selector;
        assert_eq!(s(&pod(g)["nodeSelector"][key.as_str()]), value, "{group}");
        let terms = &pod(r.named("DaemonSet", main))["affinity"]["nodeAffinity"]
            ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
        let exprs = seq(&seq(terms)[0]["matchExpressions"]);
        assert!(
            exprs.iter().any(|e| e["key"].as_str() == Some(key.as_str())
                && e["operator"] == "NotIn"
                && seq(&e["values"])
                    .iter()
                    .any(|v| v.as_str() == Some(value.as_str()))),
            "{main} keeps off {group}'s nodes: {exprs:?}"
        );
        let cm = s(&volume(g, "config")["configMap"]["name"]);
        assert!(cm.ends_with(&group[group.rfind('-').unwrap()..]), "{cm}");
        let files = r.config_files(cm);
        let main_cm = s(&volume(r.named("DaemonSet", main), "config")["configMap"]["name"]);
        assert_ne!(files, r.config_files(main_cm), "{group}: its own config");
        println!("{driver}: {group} on {key}={value}: {:?}", files.keys());
    }
    // The example's bulk group turns lvm off: no lvm file, no lvm mounts.
    let bulk = r.named("DaemonSet", "ferrovol-local-node-bulk");
    let cm = s(&volume(bulk, "config")["configMap"]["name"]);
    assert!(!r.config_files(cm).contains_key("lvm.toml"));
    assert!(mount(container(bulk, "ferrovol"), "/run/lvm").is_none());
    assert!(mount(
        container(r.named("DaemonSet", "ferrovol-local-node"), "ferrovol"),
        "/run/lvm"
    )
    .is_some());

    // The PodMonitor: the driver's metrics port on the pod network.
    let pm = &r.kind("PodMonitor")[0];
    assert_eq!(
        s(&seq(&pm["spec"]["podMetricsEndpoints"])[0]["port"]),
        "metrics"
    );
    let skipped: Vec<&str> = seq(&seq(&pm["spec"]["selector"]["matchExpressions"])[0]["values"])
        .iter()
        .map(s)
        .collect();
    let loopback: Vec<&str> = r
        .kind("DaemonSet")
        .into_iter()
        .filter(|d| {
            flag(container(d, "ferrovol"), "metrics-addr")
                .unwrap()
                .starts_with("127.")
        })
        .map(|d| s(&d["metadata"]["name"]))
        .collect();
    assert!(!loopback.is_empty());
    assert_eq!(skipped, loopback);
}

/// The example's node groups: (driver, main DaemonSet, group DaemonSet,
/// the group's label).
fn chart_values_groups() -> Vec<(String, String, String, (String, String))> {
    let v = operator_values();
    let mut out = Vec::new();
    for (driver, main) in [
        ("local", "ferrovol-local-node"),
        ("remote", "ferrovol-node"),
    ] {
        for g in v[driver]["nodeGroups"].as_array().into_iter().flatten() {
            let (k, val) = g["nodeSelector"]
                .as_object()
                .unwrap()
                .iter()
                .next()
                .unwrap();
            out.push((
                driver.to_string(),
                main.to_string(),
                format!("{main}-{}", g["name"].as_str().unwrap()),
                (k.clone(), val.as_str().unwrap().to_string()),
            ));
        }
    }
    out
}

/// Values that cannot work are refused when the chart is rendered, with
/// what to do: a node group picked by two labels (the other plugins could
/// not be kept off its nodes), a group named what no object may be named,
/// changed block tracking without its CA or without a backend that
/// serves it, and a misspelt value (the schema).
#[test]
fn the_chart_refuses_values_that_cannot_work() {
    let group = |g: serde_json::Value| json!({"local": {"nodeGroups": [g]}});
    for (values, says) in [
        (
            group(json!({"name": "two", "nodeSelector": {"a": "1", "b": "2"}})),
            "names exactly one label",
        ),
        (
            group(json!({"name": "Bad_Name", "nodeSelector": {"a": "1"}})),
            "is no DNS label",
        ),
        (
            json!({"backends": {"file": {"enabled": false}, "rbd": {"enabled": true}},
                   "snapshotMetadata": {"enabled": true}}),
            "snapshotMetadata.caCert",
        ),
        (
            json!({"snapshotMetadata": {"enabled": true, "caCert": "eA=="}}),
            "turn one of them on",
        ),
        (json!({"backend": {"lvm": {"enabled": true}}}), "backend"),
        (json!({"backends": {"lvm": {"enable": true}}}), "enable"),
    ] {
        let e = try_render_chart(&values).expect_err(&values.to_string());
        assert!(e.contains(says), "{values}: {e}");
    }
}

/// `helm lint --strict` finds nothing with the chart's defaults, each
/// overlay's choices and the mixed cluster's values, on the oldest and
/// newest Kubernetes the manifests are for; and what they render
/// validates against the API schemas (the PodMonitor against
/// prometheus-operator's, beside the validator).
#[test]
fn the_chart_lints_clean_and_validates_for_every_choice() {
    let mut sets = vec![
        ("defaults".to_string(), json!({})),
        ("groups".to_string(), operator_values()),
    ];
    for o in overlays() {
        sets.push((o.to_string(), chart_values(o)));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for (name, values) in &sets {
        let f = dir.path().join(format!("{name}.json"));
        std::fs::write(&f, values.to_string()).unwrap();
        for k in KUBERNETES {
            let out = Command::new("python3")
                .arg(root().join("tests/deploy/chart.py"))
                .args(["lint", f.to_str().unwrap(), "--kube-version", k])
                .output()
                .expect("python3");
            assert!(
                out.status.success(),
                "lint {name} on {k}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let f = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&f, try_render_chart(values).unwrap()).unwrap();
        files.push(f);
    }
    let (ok, log) = validate(&files);
    assert!(ok, "{log}");
    assert!(log.contains(" checked, 0 failed"), "{log}");
}

/// The node groups' drivers start from their DaemonSets as rendered, each
/// with its own config: on this host (no volume group) the main node-local
/// plugin has lvm and reports it unavailable, the bulk group's has no lvm
/// at all, and both serve file volumes. Needs root (real backends).
#[tokio::test]
async fn node_groups_start_with_their_own_config() {
    common::require_root();
    let mut values = chart_values("all");
    let groups = operator_values();
    values["local"]["nodeGroups"] = groups["local"]["nodeGroups"].clone();
    let r = render_chart("chart", "all", &values);
    for (name, lvm) in [
        ("ferrovol-local-node", true),
        ("ferrovol-local-node-bulk", false),
    ] {
        let started = start_container(&r, r.named("DaemonSet", name)).await;
        // /readyz checks every backend (and sets the metric).
        let (ready, body) = common::http_get(started.metrics, "/readyz").unwrap();
        assert_eq!(ready, 200, "{name}: {body}");
        assert_eq!(
            body.contains("backend lvm unavailable"),
            lvm,
            "{name}: {body}"
        );
        let (code, metrics) = common::http_get(started.metrics, "/metrics").unwrap();
        assert_eq!(code, 200);
        let line = |b: &str| {
            metrics
                .lines()
                .find(|l| l.starts_with(&format!("ferrovol_backend_available{{backend=\"{b}\"}}")))
                .map(|l| l.rsplit(' ').next().unwrap().to_string())
        };
        assert_eq!(line("file").as_deref(), Some("1"), "{name}: {metrics}");
        assert_eq!(
            line("lvm").as_deref(),
            lvm.then_some("0"),
            "{name}: {metrics}"
        );
    }
}

/// The README's Helm command installs what the tests render and the guest
/// runs (`guest_deployed_chart_defaults_run_every_class_they_ship`): the
/// chart's defaults, as release `ferrovol` in namespace `ferrovol`, the
/// namespace made (and labelled: first_week.rs) beforehand by kubectl
/// (the chart's own Namespace is off by default, so the two do not
/// collide).
#[test]
fn the_quick_starts_helm_command_installs_what_the_tests_render() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let commands: Vec<Vec<&str>> = readme
        .lines()
        .filter(|l| l.trim_start().starts_with("helm install"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(commands.len(), 1, "{commands:?}");
    let c = &commands[0];
    assert_eq!(&c[2..4], ["ferrovol", "deploy/chart"], "{c:?}");
    let flags = &c[4..];
    assert!(
        flags.windows(2).any(|w| w == ["--namespace", "ferrovol"]),
        "{c:?}"
    );
    assert!(
        !flags
            .iter()
            .any(|f| f.starts_with("-f") || f.starts_with("--set") || f.starts_with("--values")),
        "the quick start installs the defaults: {c:?}"
    );
    let r = render_chart("chart", "file", &json!({}));
    assert!(r.kind("Namespace").is_empty());
    assert!(r
        .docs
        .iter()
        .filter_map(|d| d["metadata"]["namespace"].as_str())
        .all(|ns| ns == "ferrovol"));
    assert_eq!(r.drivers(), [LOCAL.to_string()].into_iter().collect());
}
