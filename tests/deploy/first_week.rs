//! An operator's first week, as the docs walk it: the quick start's
//! commands leave the cluster whole, the values and configs that cannot
//! work are refused where they are written (the chart's render, the
//! driver's start) with what to do, and the docs say what renders.

use super::common::deployed::*;
use serde_yaml::Value;
use std::path::Path;

/// The README's "On a cluster" section.
pub fn quick_start() -> String {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    readme
        .split("## On a cluster")
        .nth(1)
        .unwrap()
        .split("\n## ")
        .next()
        .unwrap()
        .to_string()
}

/// The shell commands of a doc's ```sh blocks, each split into words as
/// the shell would (quotes, line continuations; comments dropped).
pub fn commands(doc: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut inside = false;
    let mut line = String::new();
    for l in doc.lines() {
        if l.trim_start().starts_with("```") {
            inside = l.trim() == "```sh" || l.trim() == "```bash";
            continue;
        }
        if !inside || (line.is_empty() && l.trim_start().starts_with('#')) {
            continue;
        }
        match l.strip_suffix('\\') {
            Some(more) => line.push_str(more),
            None => {
                line.push_str(l);
                let words = words(&line);
                if !words.is_empty() {
                    out.push(words);
                }
                line.clear();
            }
        }
    }
    out
}

/// One command line's words: single and double quotes kept together and
/// taken off, unquoted `#` to the end a comment.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word: Option<String> = None;
    let mut quote = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_with(String::new).push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                word.get_or_insert_with(String::new);
            }
            (None, '#') if word.is_none() => break,
            (None, c) if c.is_whitespace() => out.extend(word.take()),
            (None, c) => word.get_or_insert_with(String::new).push(c),
        }
    }
    out.extend(word);
    out
}

/// Whether command `c` begins with `words`.
fn is(c: &[String], words: &[&str]) -> bool {
    c.len() >= words.len() && c.iter().zip(words).all(|(a, b)| a == b)
}

/// The value command `c` gives the first of `names` (an option and the
/// word after it).
fn option<'a>(c: &'a [String], names: &[&str]) -> Option<&'a str> {
    c.windows(2)
        .find(|w| names.contains(&w[0].as_str()))
        .map(|w| w[1].as_str())
}

/// What each flag the quick start gives the snapshot-controller needs
/// the controller to be allowed beyond upstream's RBAC: (flag, API group,
/// resource, verbs). A flag the quick start adds that is not here fails
/// the test below: its needs must be written down first.
const SNAPSHOT_CONTROLLER_FLAGS: [(&str, &str, &str, &[&str]); 1] = [(
    "--enable-distributed-snapshotting",
    "",
    "nodes",
    &["get", "list", "watch"],
)];

/// Whether the objects in `docs` let ServiceAccount `ns/sa` do each verb
/// on `group/resource` cluster-wide, through a ClusterRoleBinding to a
/// ClusterRole that they hold too.
fn grants(docs: &[Value], ns: &str, sa: &str, group: &str, resource: &str, verbs: &[&str]) -> bool {
    let role_allows = |name: &str| {
        docs.iter()
            .filter(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == name)
            .flat_map(|d| seq(&d["rules"]))
            .any(|r| {
                let has = |k: &str, v: &str| seq(&r[k]).iter().any(|x| x == v || x == "*");
                has("apiGroups", group)
                    && has("resources", resource)
                    && verbs.iter().all(|v| has("verbs", v))
            })
    };
    docs.iter()
        .filter(|d| d["kind"] == "ClusterRoleBinding" && d["roleRef"]["kind"] == "ClusterRole")
        .filter(|d| {
            seq(&d["subjects"])
                .iter()
                .any(|x| x["kind"] == "ServiceAccount" && x["name"] == sa && x["namespace"] == ns)
        })
        .any(|d| role_allows(s(&d["roleRef"]["name"])))
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    use serde::Deserialize;
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// Finding 1 of the first week: the quick start patched the common
/// snapshot-controller with `--enable-distributed-snapshotting` and
/// granted it nothing, and upstream's RBAC leaves the node rule that
/// mode needs commented out, so the controller stopped handling every
/// VolumeSnapshot in the cluster. Now every flag the quick start adds is
/// matched by a grant it applies earlier, from a file of ours that
/// validates against the API schemas; and the deploy README's command to
/// check an existing controller asks for that grant.
#[test]
fn the_quick_starts_snapshot_controller_is_granted_what_its_flags_need() {
    let cmds = commands(&quick_start());
    let patch = cmds
        .iter()
        .position(|c| {
            c.windows(3)
                .any(|w| w == ["patch", "deployment", "snapshot-controller"])
        })
        .expect("the quick start patches the snapshot-controller");
    let ns = option(&cmds[patch], &["-n", "--namespace"])
        .expect("the patch names the controller's namespace");
    let p = option(&cmds[patch], &["-p"]).expect("a JSON patch");
    let ops: serde_json::Value = serde_json::from_str(p).unwrap();
    let added: Vec<&str> = ops
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["path"].as_str().unwrap().contains("/args"))
        .map(|o| o["value"].as_str().unwrap())
        .collect();
    assert!(!added.is_empty(), "{p}");
    // The grants applied before the patch, from files of this repository.
    let mut granted: Vec<Value> = Vec::new();
    let mut files = Vec::new();
    for c in &cmds[..patch] {
        if is(c, &["kubectl", "apply"]) {
            if let Some(file) = option(c, &["-f"]) {
                let f = root().join(file);
                granted.extend(yaml_docs(&f));
                files.push(f);
            }
        }
    }
    for flag in added {
        let name = flag.split('=').next().unwrap();
        let (_, group, resource, verbs) = SNAPSHOT_CONTROLLER_FLAGS
            .iter()
            .find(|(f, ..)| *f == name)
            .unwrap_or_else(|| {
                panic!("{name}: what does it need of RBAC? (SNAPSHOT_CONTROLLER_FLAGS)")
            });
        assert!(
            grants(&granted, ns, "snapshot-controller", group, resource, verbs),
            "the quick start adds {name} to the snapshot-controller without first \
             granting it {verbs:?} on {resource} (applied before the patch: {files:?})"
        );
    }
    let (ok, log) = validate(&files);
    assert!(ok, "{log}");
    // The check for a controller the cluster already runs names the same
    // account and the grant's file.
    let deploy = std::fs::read_to_string(root().join("deploy/README.md")).unwrap();
    let check = format!(
        "kubectl auth can-i list nodes --as=system:serviceaccount:{ns}:snapshot-controller"
    );
    assert!(deploy.contains(&check), "deploy/README.md lacks {check:?}");
    for f in &files {
        let rel = f.strip_prefix(root()).unwrap().to_str().unwrap();
        assert!(deploy.contains(rel), "deploy/README.md does not name {rel}");
    }
}

#[test]
fn commands_are_split_as_the_shell_splits_them() {
    let doc = "text\n```sh\n# a comment\nkubectl -n a patch x \\\n  -p '[{\"op\": \"add\"}]'\necho \"a b\" c # d\n```\nkubectl not a command\n";
    assert_eq!(
        commands(doc),
        vec![
            vec![
                "kubectl",
                "-n",
                "a",
                "patch",
                "x",
                "-p",
                "[{\"op\": \"add\"}]"
            ],
            vec!["echo", "a b", "c"],
        ]
    );
}

/// The pools of image files a config text names (a `file` backend's, an
/// iSCSI store's).
fn pools(config: &str) -> Vec<String> {
    let v: toml::Value = toml::from_str(config).unwrap();
    let mut out = Vec::new();
    for b in v
        .get("backend")
        .and_then(|b| b.as_array())
        .into_iter()
        .flatten()
    {
        for p in [b.get("pool"), b.get("store").and_then(|s| s.get("pool"))] {
            out.extend(p.and_then(|p| p.as_str()).map(String::from));
        }
    }
    out
}

/// Finding 2: a pool outside what the pod mounts from the host is in the
/// container's own writable layer, and its volumes are lost with the
/// container. Every pool the overlays and the chart's defaults configure
/// is on a hostPath volume of the pod that runs it (not an emptyDir,
/// which goes with the pod either); the chart refuses one that is not,
/// naming the folder.
#[test]
fn every_shipped_pool_is_on_a_host_path_and_the_chart_refuses_one_elsewhere() {
    let mut rendered = all_rendered();
    rendered.push(render_chart("chart", "file", &serde_json::json!({})));
    let mut seen = 0;
    for r in &rendered {
        for w in r.workloads() {
            let f = container(w, "ferrovol");
            let Some(dir) = flag(f, "config") else {
                continue;
            };
            let m = mount(f, &dir).unwrap();
            let cm = s(&volume(w, s(&m["name"]))["configMap"]["name"]);
            for (file, text) in r.config_files(cm) {
                for pool in pools(&text) {
                    let (v, _) = volume_at(w, f, &pool).unwrap_or_else(|| {
                        panic!("{}: {file}'s pool {pool} is on no volume", r.name)
                    });
                    assert!(
                        v.get("hostPath").is_some(),
                        "{}: {file}'s pool {pool} is on {v:?}, not the host's",
                        r.name
                    );
                    seen += 1;
                }
            }
        }
    }
    assert!(seen >= 2, "{seen}");
    let file = |pool: &str| {
        serde_json::json!({"backends": {"file": {"config":
            format!("[[backend]]\ntype = \"file\"\npool = \"{pool}\"\n")}}})
    };
    // The pool the docs named before, and one that climbs out.
    for pool in ["/var/lib/ferrovol/pool", "/var/lib/ferrovol/local/../pool"] {
        let e = try_render_chart(&file(pool)).expect_err(pool);
        assert!(
            e.contains(&format!(
                "pool {pool:?} is not below /var/lib/ferrovol/local"
            )),
            "{e}"
        );
    }
    try_render_chart(&file("/var/lib/ferrovol/local/big")).unwrap();
    // Each doc's example config in a pod's terms.
    for doc in [
        "docs/install.md",
        "docs/backends/file.md",
        "docs/backends/iscsi.md",
    ] {
        let text = std::fs::read_to_string(root().join(doc)).unwrap();
        for l in text
            .lines()
            .filter(|l| l.trim_start().starts_with("pool = "))
        {
            assert!(
                l.contains("\"/var/lib/ferrovol/local/")
                    || l.contains("\"/var/lib/ferrovol/controller/"),
                "{doc}: {l}"
            );
        }
    }
}

/// Finding 2, at the driver: started as in a pod (the kubelet sets
/// KUBERNETES_SERVICE_HOST in every container; its volumes are mounts in
/// its own mount namespace), the driver refuses a pool on the container's
/// root filesystem at start, naming the path that needs a volume, and
/// makes nothing there; with the pool below its mounted state directory
/// it serves. Needs root (a mount namespace).
#[tokio::test]
async fn the_driver_in_a_pod_refuses_a_pool_on_its_own_root_filesystem() {
    super::common::require_root();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    // On the root filesystem whatever else this machine mounts: a folder
    // of `/` itself, which no test makes.
    let lost = format!("/ferrovol-not-a-volume-{}/pool", std::process::id());
    let run = |pool: &str| {
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!("[[backend]]\ntype = \"file\"\npool = \"{pool}\"\n"),
        )
        .unwrap();
        let socket = dir.path().join("csi.sock");
        let _ = std::fs::remove_file(&socket);
        // The pod's volumes: the state directory (a hostPath) bound onto
        // itself in the container's own mount namespace.
        let script = r#"mount --bind "$1" "$1"; shift; exec "$@""#;
        std::process::Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-ec",
                script,
                "sh",
            ])
            .arg(&state)
            .arg(env!("CARGO_BIN_EXE_ferrovol"))
            .args(["serve", "--node-id=node-1"])
            .arg(format!("--state-dir={}", state.display()))
            .arg(format!("--config={}", config.display()))
            .arg(format!("--endpoint=unix://{}", socket.display()))
            .env("KUBERNETES_SERVICE_HOST", "10.96.0.1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Refused at once: one that is still running after a minute took
    // the pool (and is stopped, its folder removed, before failing).
    let mut child = run(&lost);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            let _ = std::fs::remove_dir_all(Path::new(&lost).parent().unwrap());
            panic!("the driver started with its pool at {lost}, on the container's own root");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "backend file's pool {lost} is on the container's own root filesystem"
        )),
        "{err}"
    );
    assert!(
        !Path::new(&lost).parent().unwrap().exists(),
        "it made {lost}"
    );
    // Below the mounted state directory: it serves.
    let pool = state.join("pool");
    let mut child = run(pool.to_str().unwrap());
    let socket = dir.path().join("csi.sock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while super::common::connect(&socket).await.is_err() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("exited {status}: {err}");
        }
        assert!(std::time::Instant::now() < deadline, "not serving");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(pool.join("volumes").is_dir());
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Values with backends turned on only in node groups, as a mixed pool
/// has them: rbd only for the nodes labelled `ceph`, file only on the
/// `edge` nodes, and nothing of the node-local driver on the `gpu` nodes.
fn grouped() -> serde_json::Value {
    serde_json::json!({
        "backends": {"file": {"enabled": false}},
        "local": {
            "node": {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [
                    {"key": "node.example.com/disk", "operator": "In", "values": ["ssd"]}]}}]}}},
            "nodeGroups": [
                {"name": "edge", "nodeSelector": {"pool": "edge"}, "backends": {"file": {"enabled": true}}},
                {"name": "gpu", "nodeSelector": {"pool": "gpu"}, "backends": {"lvm": {"enabled": false}}}
            ]
        },
        "remote": {"nodeGroups": [
            {"name": "ceph", "nodeSelector": {"ceph": "true"}, "backends": {"rbd": {"enabled": true}}}
        ]}
    })
}

/// Finding 3: a backend on only in a node group got no classes, no
/// Secret and no controller config, and a group that turns every backend
/// of a driver off still got a node plugin, which then served the
/// built-in file backend. Now what is on anywhere is served centrally,
/// a group with nothing of a driver runs no plugin of it (and the main
/// one still keeps off its nodes), groups keep the driver's node
/// affinity, and the driver refuses a config that names no backend.
#[test]
fn backends_on_in_node_groups_get_their_classes_secrets_and_controller_config() {
    let r = render_chart("chart", "all", &grouped());
    for (kind, name) in [
        ("StorageClass", "ferrovol-rbd"),
        ("VolumeSnapshotClass", "ferrovol-rbd"),
        ("Secret", "ferrovol-rbd"),
        ("Secret", "ferrovol-rbd-keyring"),
        ("StorageClass", "ferrovol-file"),
        ("DaemonSet", "ferrovol-local-node-edge"),
        ("DaemonSet", "ferrovol-node-ceph"),
        ("Deployment", "ferrovol-controller"),
    ] {
        assert!(r.has(kind, name), "no {kind} {name}");
    }
    let cm =
        s(&volume(r.named("Deployment", "ferrovol-controller"), "config")["configMap"]["name"]);
    assert!(
        r.config_files(cm).contains_key("rbd.toml"),
        "{:?}",
        r.config_files(cm).keys()
    );
    // No file or lvm at the top level: no main node-local plugin; none
    // on the gpu nodes either; the main remote one has no rbd.
    assert!(!r.has("DaemonSet", "ferrovol-local-node"));
    assert!(!r.has("DaemonSet", "ferrovol-local-node-gpu"));
    assert!(!r.has("StorageClass", "ferrovol-lvm-ssd"));
    for w in r.kind("DaemonSet") {
        let f = container(w, "ferrovol");
        let cm = s(&volume(w, "config")["configMap"]["name"]);
        let files = r.config_files(cm);
        let backends: usize = files
            .values()
            .map(|t| t.matches("[[backend]]").count())
            .sum();
        assert!(
            backends > 0,
            "{}: a node plugin with no backend",
            s(&w["metadata"]["name"])
        );
        assert!(flag(f, "config").is_some());
    }
    let edge = pod(r.named("DaemonSet", "ferrovol-local-node-edge"));
    assert_eq!(
        edge["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
            ["weight"]
            .as_i64(),
        Some(1),
        "the group keeps local.node.affinity: {edge:?}"
    );
    // Two groups that turn one backend on with different configs, with
    // it off at the top: the controller could take only one.
    let mut v = grouped();
    v["remote"]["nodeGroups"] = serde_json::json!([
        {"name": "a", "nodeSelector": {"a": "1"}, "backends": {"nfs": {"enabled": true, "config": "[[backend]]\ntype = \"nfs\"\n"}}},
        {"name": "b", "nodeSelector": {"b": "1"}, "backends": {"nfs": {"enabled": true, "config": "[[backend]]\ntype = \"nfs\"\nname = \"nfs\"\n"}}}
    ]);
    let e = try_render_chart(&v).unwrap_err();
    assert!(e.contains("backends.nfs is off at the top level and on in node groups a, b with different configs"), "{e}");
    // The driver side: a config directory of no backend is refused.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("00-driver.toml"),
        "[node]\nmax_volumes_per_node = 8\n",
    )
    .unwrap();
    let e = ferrovol::config::Config::load(Some(dir.path()), || {
        ferrovol::backend::built_in(Path::new("/state"))
    })
    .unwrap_err();
    assert!(e.message.contains("names no backend"), "{}", e.message);
}

/// Finding 4: the shipped classes named the example config's export,
/// pool, device class and Secret; an operator who replaced a config got
/// classes that rendered and then failed every claim. Now a class is
/// checked against every config that serves it when the chart renders,
/// and the shipped classes follow the backend's `secret.name`.
#[test]
fn classes_that_name_what_their_config_lacks_are_refused_at_render() {
    let cases = [
        (
            serde_json::json!({"backends": {"nfs": {"enabled": true, "config":
                "[[backend]]\ntype = \"nfs\"\nname = \"nfs\"\ndefault_export = \"main\"\n[[backend.export]]\nname = \"main\"\nserver = \"nas\"\nshare = \"/k8s\"\n"}}}),
            "class ferrovol-nfs-retain (backends.nfs) names export \"archive\", but backends.nfs.config has exports [main]",
        ),
        (
            serde_json::json!({"backends": {"rbd": {"enabled": true, "config":
                "[[backend]]\ntype = \"rbd\"\ncluster_id = \"c\"\nmonitors = [\"192.0.2.1:6789\"]\npools = [\"rbd\"]\n"}}}),
            "class ferrovol-rbd (backends.rbd) names pool \"kubernetes\", but backends.rbd.config has pools [rbd]",
        ),
        (
            serde_json::json!({"backends": {"lvm": {"enabled": true, "config":
                "[[backend]]\ntype = \"lvm\"\n[[backend.device_class]]\nname = \"ssd\"\nvolume_group = \"vg\"\n"}}}),
            "class ferrovol-lvm-thin (backends.lvm) names device class \"thin\", but backends.lvm.config has device classes [ssd]",
        ),
        (
            serde_json::json!({"backends": {"iscsi": {"enabled": true, "store":
                "[backend.store]\ntype = \"file\"\npool = \"/var/lib/ferrovol/luns\"\n"}}}),
            "class ferrovol-iscsi (backends.iscsi) names device class \"luns\"",
        ),
        (
            serde_json::json!({"backends": {"nfs": {"enabled": true, "config":
                "[[backend]]\ntype = \"nfs\"\nname = \"shares\"\n"}}}),
            "class ferrovol-nfs (backends.nfs) names backend \"nfs\", but backends.nfs.config has no [[backend]] of type \"nfs\" named so",
        ),
        (
            serde_json::json!({"backends": {"rbd": {"enabled": true, "storageClasses": [
                {"name": "mine", "parameters": {"backend": "rbd", "pool": "kubernetes",
                 "csi.storage.k8s.io/node-stage-secret-name": "other"}}]}}}),
            "class mine (backends.rbd) hands csi.storage.k8s.io/node-stage-secret-name Secret \"other\", but the chart's Secret for rbd is \"ferrovol-rbd\"",
        ),
        (
            serde_json::json!({"backends": {"nfs": {"enabled": true, "config": "[[backend]\n"}}}),
            "backends.nfs.config: not TOML the driver can read",
        ),
        (
            // A group's own config counts too.
            serde_json::json!({"backends": {"lvm": {"enabled": true}}, "local": {"nodeGroups": [
                {"name": "small", "nodeSelector": {"s": "1"}, "backends": {"lvm": {"config":
                    "[[backend]]\ntype = \"lvm\"\n[[backend.device_class]]\nname = \"ssd\"\nvolume_group = \"vg\"\n"}}}]}}),
            "names device class \"thin\", but local.nodeGroups small: backends.lvm.config has device classes [ssd]",
        ),
    ];
    for (values, says) in cases {
        let e = try_render_chart(&values).expect_err(says);
        assert!(e.contains(says), "{values}: {e}");
    }
    // A group that turns lvm on with a config lacking `thin` is refused
    // (its classes would fail there), naming the group.
    let v = serde_json::json!({"local": {"nodeGroups": [
        {"name": "small", "nodeSelector": {"s": "1"}, "backends": {"lvm": {"enabled": true, "config":
            "[[backend]]\ntype = \"lvm\"\n[[backend.device_class]]\nname = \"ssd\"\nvolume_group = \"vg\"\n"}}}]}});
    let e = try_render_chart(&v).unwrap_err();
    assert!(e.contains("names device class \"thin\""), "{e}");
    // A class that names no backend gets the config's one backend, by
    // whatever name the config gives it (as the driver does).
    let v = serde_json::json!({"backends": {"nfs": {"enabled": true,
        "storageClasses": [{"name": "plain", "parameters": {"export": "main"}}],
        "config": "[[backend]]\ntype = \"nfs\"\nname = \"shares\"\ndefault_export = \"main\"\n\
                   [[backend.export]]\nname = \"main\"\nserver = \"nas\"\nshare = \"/k8s\"\n"}}});
    try_render_chart(&v).unwrap();
    // A Secret of one's own, by name: the shipped classes follow it.
    let v = serde_json::json!({"backends": {"rbd": {"enabled": true, "secret": {"create": false, "name": "ceph-csi-user"}}}});
    let r = render_chart("chart", "rbd", &v);
    let sc = r.named("StorageClass", "ferrovol-rbd");
    let named: Vec<&str> = sc["parameters"]
        .as_mapping()
        .unwrap()
        .iter()
        .filter(|(k, _)| s(k).ends_with("-secret-name"))
        .map(|(_, v)| s(v))
        .collect();
    assert_eq!(named.len(), 4, "{sc:?}");
    assert!(named.iter().all(|n| *n == "ceph-csi-user"), "{named:?}");
    assert!(!r.has("Secret", "ferrovol-rbd"));
}

/// The Pod Security level every pod of a render needs at the most.
fn level_needed(r: &Rendered) -> &'static str {
    let rank = |l: &str| {
        ["restricted", "baseline", "privileged"]
            .iter()
            .position(|x| *x == l)
            .unwrap()
    };
    r.workloads()
        .into_iter()
        .map(|w| super::pod_security_level(w).0)
        .max_by_key(|l| rank(l))
        .unwrap()
}

/// Finding 5: the Helm quick start made the namespace with
/// `--create-namespace`, unlabelled, so on a cluster that enforces a
/// stricter Pod Security level by default the node DaemonSets made no
/// pods. Now the README makes the namespace and labels it with the level
/// the chart's pods need (computed from what renders) before installing;
/// the chart's notes warn when the namespace is not labelled so; and on
/// OpenShift each pod's service account is granted the SCC its level
/// calls for.
#[test]
fn the_helm_quick_start_labels_its_namespace_for_the_node_plugins() {
    let cmds = commands(&quick_start());
    let install = cmds
        .iter()
        .position(|c| is(c, &["helm", "install"]))
        .expect("a helm install");
    let ns = option(&cmds[install], &["--namespace"]).unwrap();
    let before = &cmds[..install];
    assert!(
        before
            .iter()
            .any(|c| c == &["kubectl", "create", "namespace", ns]),
        "{before:?}"
    );
    let r = render_chart("chart", "file", &serde_json::json!({}));
    let need = level_needed(&r);
    assert_eq!(need, "privileged");
    let label = format!("pod-security.kubernetes.io/enforce={need}");
    assert!(
        before
            .iter()
            .any(|c| is(c, &["kubectl", "label", "namespace", ns]) && c.contains(&label)),
        "the namespace is labelled {label} before the chart installs: {before:?}"
    );
    assert!(!cmds[install].contains(&"--create-namespace".to_string()));
    // The other docs' Helm commands do the same.
    for doc in ["deploy/README.md", "deploy/chart/README.md"] {
        let cmds = commands(&std::fs::read_to_string(root().join(doc)).unwrap());
        for (i, c) in cmds.iter().enumerate() {
            if is(c, &["helm", "install"]) {
                assert!(
                    cmds[..i]
                        .iter()
                        .any(|b| is(b, &["kubectl", "label", "namespace"]) && b.contains(&label)),
                    "{doc}: {c:?} without the namespace labelled {label} before it"
                );
            }
        }
    }
    // The notes: a warning with the command while the namespace is not
    // known to be labelled (offline, `lookup` finds nothing); none when
    // the chart makes the namespace itself, labelled.
    let notes = |v: serde_json::Value| {
        let out = std::process::Command::new(python())
            .arg(root().join("tests/deploy/chart.py"))
            .args(["notes", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin
                    .take()
                    .unwrap()
                    .write_all(v.to_string().as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let warned = notes(serde_json::json!({}));
    assert!(
        warned.contains(&format!(
            "kubectl label namespace ferrovol {label} --overwrite"
        )),
        "{warned}"
    );
    let made = notes(serde_json::json!({"createNamespace": true}));
    assert!(!made.contains("WARNING"), "{made}");
    let with = render_chart(
        "chart",
        "file",
        &serde_json::json!({"createNamespace": true}),
    );
    let labelled = &with.named("Namespace", "ferrovol")["metadata"]["labels"]
        ["pod-security.kubernetes.io/enforce"];
    assert_eq!(labelled.as_str(), Some(need));
    // OpenShift: each pod's service account bound to the SCC its level
    // calls for, and no other binding.
    for of in ["all", "rbd"] {
        let mut v = chart_values(of);
        v["openshift"] = serde_json::json!({"securityContextConstraints": true});
        let r = render_chart("chart", "all", &v);
        let bound: std::collections::BTreeSet<(String, String)> = r
            .kind("RoleBinding")
            .into_iter()
            .filter_map(|b| {
                s(&b["roleRef"]["name"])
                    .strip_prefix("system:openshift:scc:")
                    .map(|scc| {
                        (
                            s(&seq(&b["subjects"])[0]["name"]).to_string(),
                            scc.to_string(),
                        )
                    })
            })
            .collect();
        let wanted: std::collections::BTreeSet<(String, String)> = r
            .workloads()
            .into_iter()
            .map(|w| {
                let scc = match super::pod_security_level(w).0 {
                    "privileged" => "privileged",
                    "restricted" => "nonroot-v2",
                    other => panic!("{other}"),
                };
                (
                    s(&pod(w)["serviceAccountName"]).to_string(),
                    scc.to_string(),
                )
            })
            .collect();
        assert_eq!(bound, wanted, "{of}");
    }
    let (ok, log) = {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("openshift.yaml");
        let mut v = chart_values("all");
        v["openshift"] = serde_json::json!({"securityContextConstraints": true});
        std::fs::write(&f, try_render_chart(&v).unwrap()).unwrap();
        validate(&[f])
    };
    assert!(ok, "{log}");
}

/// Finding 7: values that were accepted and did nothing, or harm. A
/// misspelt container under `*.resources`, a remote backend in a local
/// node group and a metrics address no driver can bind are refused by
/// the schema; `image.pullPolicy` is ferrovol's image's alone (the
/// sidecars' is `sidecars.pullPolicy`); `$(POD_IP)` in a metrics address,
/// as deploy/README suggests, is defined in the container (the start
/// test's harness refuses any `$(NAME)` the kubelet would pass on
/// literally, and `metrics_addr_with_pod_ip_starts` starts one).
#[test]
fn values_that_would_do_nothing_or_harm_are_refused() {
    for (values, says) in [
        (
            serde_json::json!({"local": {"node": {"resources": {"ferovol": {"requests": {"cpu": "1"}}}}}}),
            "ferovol",
        ),
        (
            serde_json::json!({"remote": {"controller": {"resources": {"csi-provisioner": {"request": {"cpu": "1"}}}}}}),
            "request",
        ),
        (
            serde_json::json!({"local": {"nodeGroups": [{"name": "g", "nodeSelector": {"a": "b"},
                "backends": {"nfs": {"enabled": true}}}]}}),
            "nfs",
        ),
        (
            serde_json::json!({"remote": {"node": {"metricsAddr": "$(NODE_IP):9819"}}}),
            "metricsAddr",
        ),
        (
            serde_json::json!({"local": {"node": {"metricsAddr": "node-1:9809"}}}),
            "metricsAddr",
        ),
        (
            serde_json::json!({"remote": {"controller": {"affinity": {"nodeAfinity": {}}}}}),
            "nodeAfinity",
        ),
    ] {
        let e = try_render_chart(&values).expect_err(&values.to_string());
        assert!(e.contains(says), "{values}: {e}");
    }
    let v = serde_json::json!({
        "backends": {"nfs": {"enabled": true}},
        "image": {"pullPolicy": "Always"},
        "sidecars": {"pullPolicy": "Never"},
        "remote": {"node": {"metricsAddr": "$(POD_IP):9819"}}
    });
    let r = render_chart("chart", "all", &v);
    for w in r.workloads() {
        for c in containers(w) {
            let want = if s(&c["name"]) == "ferrovol" {
                "Always"
            } else {
                "Never"
            };
            assert_eq!(s(&c["imagePullPolicy"]), want, "{}", s(&c["name"]));
        }
        let f = container(w, "ferrovol");
        assert!(
            seq(&f["env"]).iter().any(|e| s(&e["name"]) == "POD_IP"
                && s(&e["valueFrom"]["fieldRef"]["fieldPath"]) == "status.podIP"),
            "{}",
            s(&w["metadata"]["name"])
        );
    }
}

/// `$(POD_IP)` in the remote node plugin's metrics address, as deploy/README
/// suggests for scraping it: the plugin starts (before, the kubelet passed
/// the literal text, and the driver crash-looped). Needs root.
#[tokio::test]
async fn metrics_addr_with_pod_ip_starts() {
    super::common::require_root();
    let mut v = chart_values("nfs");
    v["remote"] = serde_json::json!({"node": {"metricsAddr": "$(POD_IP):9819"}});
    let r = render_chart("chart", "nfs", &v);
    let ds = r.named("DaemonSet", "ferrovol-node");
    assert_eq!(
        flag(container(ds, "ferrovol"), "metrics-addr").as_deref(),
        Some("$(POD_IP):9819")
    );
    let started = start_container(&r, ds).await;
    let (code, _) = super::common::http_get(started.metrics, "/healthz").unwrap();
    assert_eq!(code, 200);
}

/// Finding 8: docs that disagreed with what renders. hardened-clusters.md
/// says every sidecar drops its capabilities and has a read-only root
/// (the node DaemonSets' had no securityContext); the chart's notes, the
/// README and docs/support.md name one external-snapshotter release, the
/// one the manifests' csi-snapshotter is; the CHANGELOG, the README's
/// table and values.yaml agree on which backends track changed blocks.
#[test]
fn the_docs_say_what_renders() {
    let mut rendered = all_rendered();
    rendered.push(render_chart("chart", "all", &chart_values("all")));
    for r in &rendered {
        for w in r.workloads() {
            for c in containers(w).iter().filter(|c| s(&c["name"]) != "ferrovol") {
                let sc = &c["securityContext"];
                let what = format!("{}/{}/{}", r.name, s(&w["metadata"]["name"]), s(&c["name"]));
                assert_eq!(
                    sc["allowPrivilegeEscalation"].as_bool(),
                    Some(false),
                    "{what}"
                );
                assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true), "{what}");
                assert!(
                    seq(&sc["capabilities"]["drop"]).iter().any(|d| d == "ALL"),
                    "{what}"
                );
            }
        }
    }
    // What `/readyz` means, one way in every doc that says it: ready once
    // serving (tests/observability.rs holds the driver to it), a missing
    // backend said in its body, never a 503.
    for doc in [
        "docs/monitoring.md",
        "docs/troubleshooting.md",
        "deploy/README.md",
    ] {
        let text = std::fs::read_to_string(root().join(doc)).unwrap();
        let said: Vec<&str> = text
            .split("\n\n")
            .filter(|p| p.contains("/readyz"))
            .collect();
        assert!(!said.is_empty(), "{doc}");
        for p in said {
            for wrong in [
                "503",
                "not ready while",
                "not Ready when none",
                "not ready (503)",
            ] {
                assert!(!p.contains(wrong), "{doc} says {wrong:?} of /readyz:\n{p}");
            }
        }
    }
    // A removed node's node-local claims stay Bound (their pods Pending),
    // and the runbook has the commands for their PVs.
    let deploy = std::fs::read_to_string(root().join("deploy/README.md")).unwrap();
    let removing = deploy
        .split("**Removing a node.**")
        .nth(1)
        .unwrap()
        .split("\n\n")
        .next()
        .unwrap();
    assert!(!removing.contains("claims stay Pending"), "{removing}");
    assert!(removing.contains("stay Bound"), "{removing}");
    assert!(
        removing.contains("operations.md#removing-a-node-and-its-volumes"),
        "{removing}"
    );
    let hardened = std::fs::read_to_string(root().join("docs/hardened-clusters.md")).unwrap();
    assert!(
        hardened.contains("## OpenShift"),
        "the README links its OpenShift section"
    );
    // One snapshot release everywhere it is named.
    let r = render("all");
    let tag = r
        .workloads()
        .iter()
        .flat_map(|w| containers(w))
        .map(|c| s(&c["image"]))
        .find(|i| i.contains("/csi-snapshotter:"))
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .to_string();
    let notes = std::fs::read_to_string(root().join("deploy/chart/templates/NOTES.txt")).unwrap();
    for (doc, text) in [("NOTES.txt", notes.as_str()), ("README.md", &quick_start())] {
        let named: Vec<&str> = text
            .split(|c: char| c.is_whitespace() || c == '=' || c == '\'' || c == '+')
            .filter(|w| w.starts_with("v8."))
            .map(|w| w.trim_end_matches([',', '.', ')', ';']))
            .collect();
        assert!(!named.is_empty(), "{doc}");
        assert!(
            named.iter().all(|v| *v == tag),
            "{doc} names {named:?}, the snapshotter is {tag}"
        );
    }
    // Changed block tracking: the README's table row says which backends
    // have it; the CHANGELOG names each of them; values.yaml the remote
    // ones among them (the sidecar runs beside the central controller).
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let header: Vec<String> = readme
        .lines()
        .find(|l| l.starts_with("| | `file`"))
        .unwrap()
        .split('|')
        .map(|c| c.trim().trim_matches('`').to_string())
        .collect();
    let row: Vec<&str> = readme
        .lines()
        .find(|l| l.starts_with("| changed block tracking"))
        .unwrap()
        .split('|')
        .map(str::trim)
        .collect();
    let tracking: Vec<&str> = (2..header.len() - 1)
        .filter(|i| row[*i] != "no")
        .map(|i| header[i].as_str())
        .collect();
    assert_eq!(tracking, ["file", "lvm", "iscsi", "nvmf", "rbd"]);
    let changelog = std::fs::read_to_string(root().join("CHANGELOG.md")).unwrap();
    let said = changelog
        .split("SnapshotMetadata service")
        .nth(1)
        .unwrap()
        .split("csi-sanity")
        .next()
        .unwrap();
    for b in &tracking {
        assert!(said.contains(&format!("`{b}`")), "CHANGELOG: {said}");
    }
    let values = std::fs::read_to_string(root().join("deploy/chart/values.yaml")).unwrap();
    let comment = values.split("\nsnapshotMetadata:").next().unwrap();
    let comment = comment.rsplit("\n\n").next().unwrap();
    for b in ["rbd", "iscsi", "nvmf"] {
        assert!(comment.contains(b), "values.yaml: {comment}");
    }
    for b in ["file", "lvm"] {
        assert!(
            !comment.contains(&format!(" {b} ")),
            "values.yaml: {comment}"
        );
    }
}

/// The subcommands `ferrovol client --help` lists.
fn client_commands() -> Vec<String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .args(["client", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    help.split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

/// Finding 9: the day-two runbook (docs/operations.md). Each command it
/// gives names what exists: the workloads, pod labels and containers it
/// reaches are rendered by the overlays or the chart, the socket it asks
/// is where the ferrovol containers serve, every `ferrovol client`
/// command is one the binary has, and its upgrade repeats the quick
/// start's snapshot prerequisites in their order. And what its upgrade
/// section says of `helm upgrade` holds: a changed config, image or
/// sidecar tag changes the pod templates that use it (so the pods roll),
/// and nothing else.
#[test]
fn the_runbook_names_what_exists() {
    let doc = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let cmds = commands(&doc);
    assert!(cmds.len() > 15, "{}", cmds.len());
    let mut rendered = all_rendered();
    rendered.push(render_chart("chart", "all", &chart_values("all")));
    let workloads: Vec<(&Rendered, &Value)> = rendered
        .iter()
        .flat_map(|r| r.workloads().into_iter().map(move |w| (r, w)))
        .collect();
    let find = |kind: &str, name: &str| {
        workloads
            .iter()
            .find(|(_, w)| w["kind"] == kind && w["metadata"]["name"] == name)
            .map(|(_, w)| *w)
            .unwrap_or_else(|| panic!("the runbook names {kind} {name}, which nothing renders"))
    };
    let client = client_commands();
    let mut asked = 0;
    for c in &cmds {
        let line = c.join(" ");
        for w in c {
            let (kind, name) = match w.split_once('/') {
                Some(("daemonset", n)) => ("DaemonSet", n),
                Some(("deployment" | "deploy", n)) => ("Deployment", n),
                _ => continue,
            };
            if !name.starts_with("ferrovol") {
                continue;
            }
            let workload = find(kind, name);
            if let Some(container_name) = option(c, &["-c"]) {
                assert!(
                    containers(workload)
                        .iter()
                        .any(|x| x["name"] == container_name),
                    "{line}: {name} has no container {container_name}"
                );
            }
        }
        if let Some(label) = option(c, &["-l"]) {
            let (k, v) = label.split_once('=').unwrap();
            assert!(
                workloads
                    .iter()
                    .any(|(_, w)| w["spec"]["template"]["metadata"]["labels"][k] == v),
                "{line}: no pod is labelled {k}={v}"
            );
        }
        if c.first().map(String::as_str) == Some("kubectl") && c.contains(&"$POD".to_string()) {
            if let Some(name) = option(c, &["-c"]) {
                for ds in ["ferrovol-node", "ferrovol-local-node"] {
                    assert!(
                        containers(find("DaemonSet", ds))
                            .iter()
                            .any(|x| x["name"] == name),
                        "{line}: {ds} has no container {name}"
                    );
                }
            }
        }
        if let Some(i) = c.windows(2).position(|w| w == ["ferrovol", "client"]) {
            let rest = &c[i + 2..];
            let mut j = 0;
            while rest[j].starts_with("--") {
                if rest[j] == "--endpoint" {
                    let endpoint = &rest[j + 1];
                    for (_, w) in &workloads {
                        assert_eq!(
                            flag(container(w, "ferrovol"), "endpoint").as_deref(),
                            Some(endpoint.as_str()),
                            "{line}"
                        );
                    }
                }
                j += if rest[j].contains('=') { 1 } else { 2 };
            }
            assert!(
                client.contains(&rest[j]),
                "{line}: no client command {}",
                rest[j]
            );
            asked += 1;
        }
    }
    assert!(asked >= 4, "{asked}");
    // The upgrade repeats the quick start's snapshot steps, in order.
    let quick: Vec<Vec<String>> = commands(&quick_start())
        .into_iter()
        .filter(|c| c.iter().any(|w| w.contains("snapshot")))
        .collect();
    let upgrade: Vec<&Vec<String>> = cmds
        .iter()
        .filter(|c| c.iter().any(|w| w.contains("snapshot")))
        .collect();
    assert!(quick.len() >= 4);
    assert_eq!(
        upgrade[..quick.len()]
            .iter()
            .map(|c| (*c).clone())
            .collect::<Vec<_>>(),
        quick
    );
    assert!(cmds
        .iter()
        .any(|c| is(c, &["helm", "upgrade", "ferrovol", "deploy/chart"])));
    // `helm upgrade`: what changes rolls, and only that.
    let template = |v: &serde_json::Value, name: &str| {
        let r = render_chart("chart", "all", v);
        r.named("DaemonSet", name)["spec"]["template"].clone()
    };
    let base = chart_values("all");
    let before = template(&base, "ferrovol-local-node");
    assert_eq!(before, template(&base, "ferrovol-local-node"));
    let mut config = base.clone();
    config["node"] = serde_json::json!({"maxVolumesPerNode": 100});
    let mut image = base.clone();
    image["image"] = serde_json::json!({"tag": "0.1.1"});
    let mut sidecar = base.clone();
    sidecar["sidecars"] =
        serde_json::json!({"registrar": {"image": "csi-node-driver-registrar", "tag": "v2.99.0"}});
    for (what, v) in [("config", config), ("image", image), ("sidecar", sidecar)] {
        assert_ne!(
            before,
            template(&v, "ferrovol-local-node"),
            "{what} rolls the node plugins"
        );
    }
    let mut other = base.clone();
    other["remote"] = serde_json::json!({"node": {"metricsAddr": "127.0.0.1:9829"}});
    assert_eq!(
        before,
        template(&other, "ferrovol-local-node"),
        "the remote plugin's value leaves the local one"
    );
}
