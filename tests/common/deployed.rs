//! The manifests as the tests' fixture: an overlay rendered with
//! kubectl's kustomize, read as YAML, and its ferrovol containers started
//! as their pods would run them (args, env, user, mounted config, emptyDir
//! and hostPath volumes). Used by `tests/deploy.rs` (on the host) and the
//! guest's deployed-overlay tests.

use super::fixtures::DAEMON_BACKSTOP;
use ferrovol::proto as pb;
use serde::Deserialize;
use serde_yaml::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The overlays besides each backend's own: every backend, rbd with
/// changed block tracking, every backend with volume health.
pub const COMBINED: [&str; 3] = ["all", "snapshot-metadata", "volume-health"];

/// Every overlay: one per backend (the driver's kinds), then
/// [`COMBINED`].
pub fn overlays() -> Vec<&'static str> {
    backends()
        .into_iter()
        .map(|(b, _)| b)
        .chain(COMBINED)
        .collect()
}

/// Every backend, as the driver names its kinds (`backend::KINDS`), and
/// the driver name that serves it: [`LOCAL`] or [`REMOTE`], as the base its
/// overlay takes says.
pub fn backends() -> Vec<(&'static str, &'static str)> {
    ferrovol::backend::KINDS
        .iter()
        .map(|k| {
            let path = root().join(format!("deploy/overlays/{}/kustomization.yaml", k.name));
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("backend {} has no overlay: {e}", k.name));
            let bases: Vec<&str> = ["local", "remote"]
                .into_iter()
                .filter(|b| text.contains(&format!("- ../../base/{b}\n")))
                .collect();
            match bases[..] {
                ["local"] => (k.name, LOCAL),
                ["remote"] => (k.name, REMOTE),
                _ => panic!("{}: its overlay takes bases {bases:?}", path.display()),
            }
        })
        .collect()
}

/// The backends one driver name serves, in the kinds' order.
pub fn served_by(driver: &str) -> Vec<&'static str> {
    backends()
        .into_iter()
        .filter(|(_, d)| *d == driver)
        .map(|(b, _)| b)
        .collect()
}

pub const LOCAL: &str = "local.csi.ferrovol.io";
pub const REMOTE: &str = "csi.ferrovol.io";
/// The oldest Kubernetes the manifests are for (the sidecars' floor), and
/// the newest the validator knows.
pub const KUBERNETES: [&str; 2] = ["1.34.0", "1.37.0"];

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// One rendered overlay.
pub struct Rendered {
    pub name: &'static str,
    /// The overlay whose backends it serves (`snapshot-metadata` is the
    /// rbd overlay with changed block tracking, `volume-health` the `all`
    /// overlay with volume health).
    pub of: &'static str,
    pub text: String,
    pub docs: Vec<Value>,
}

pub fn render(overlay: &'static str) -> Rendered {
    let of = match overlay {
        "snapshot-metadata" => "rbd",
        "volume-health" => "all",
        o => o,
    };
    // The guest suite renders every overlay on the host before it boots
    // the guest, with the same kubectl (a render under the guest's
    // emulated CPU takes about 20 s of its CPU).
    if let Some(rendered) = std::env::var_os("FERROVOL_RENDERED") {
        let file = Path::new(&rendered).join(format!("{overlay}.yaml"));
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e} (tests/guest/suite renders it)", file.display()));
        return parsed(overlay, of, text);
    }
    // Each overlay is rendered once per test binary (the deploy tests
    // read every overlay in a dozen tests: 150 kubectl runs): the
    // manifests do not change while the tests run.
    static RENDERS: std::sync::Mutex<Vec<(&str, String)>> = std::sync::Mutex::new(Vec::new());
    let known = RENDERS
        .lock()
        .unwrap()
        .iter()
        .find(|(o, _)| *o == overlay)
        .map(|(_, text)| text.clone());
    let text = known.unwrap_or_else(|| {
        let dir = root().join("deploy/overlays").join(overlay);
        let out = Command::new("kubectl")
            .arg("kustomize")
            .arg(&dir)
            .output()
            .expect("kubectl (for its kustomize) is needed; .ci/run checks for it");
        assert!(
            out.status.success(),
            "kustomize {overlay}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        RENDERS.lock().unwrap().push((overlay, text.clone()));
        text
    });
    parsed(overlay, of, text)
}

fn parsed(name: &'static str, of: &'static str, text: String) -> Rendered {
    let docs = serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect();
    Rendered {
        name,
        of,
        text,
        docs,
    }
}

/// Validates manifest files against the API schemas of every Kubernetes
/// version the manifests are for (tests/deploy/validate.py): whether all
/// passed, and its report.
pub fn validate(files: &[std::path::PathBuf]) -> (bool, String) {
    let mut cmd = Command::new("python3");
    cmd.arg(root().join("tests/deploy/validate.py"));
    for k in KUBERNETES {
        cmd.arg("-k").arg(k);
    }
    let out = cmd.args(files).output().expect("python3");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// The chart's values for an overlay's choices (deploy/chart/ci), as JSON.
pub fn chart_values(overlay: &str) -> serde_json::Value {
    let f = root().join(format!("deploy/chart/ci/{overlay}-values.yaml"));
    serde_yaml::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap()
}

/// The Python that has helm-python-sdk: the host's `python3`, or in the
/// guest (whose PATH has Debian's) the one tests/guest/suite names.
pub fn python() -> String {
    std::env::var("FERROVOL_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// deploy/chart rendered as `helm template` renders it (release and
/// namespace `ferrovol`), with `values` over the chart's defaults: by
/// tests/deploy/chart.py, with Helm's own library. The error is Helm's
/// message.
pub fn try_render_chart(values: &serde_json::Value) -> Result<String, String> {
    use std::io::Write;
    let mut child = Command::new(python())
        .arg(root().join("tests/deploy/chart.py"))
        .args(["render", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(values.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The chart rendered with `values`, as a fixture like an overlay: `of`
/// names the overlay whose backends it serves.
pub fn render_chart(name: &'static str, of: &'static str, values: &serde_json::Value) -> Rendered {
    let text = try_render_chart(values).unwrap_or_else(|e| panic!("the chart ({name}): {e}"));
    parsed(name, of, text)
}

pub fn all_rendered() -> Vec<Rendered> {
    overlays().into_iter().map(render).collect()
}

pub fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

pub fn seq(v: &Value) -> &[Value] {
    v.as_sequence().map(|s| s.as_slice()).unwrap_or(&[])
}

impl Rendered {
    pub fn kind(&self, kind: &str) -> Vec<&Value> {
        self.docs
            .iter()
            .filter(|d| d["kind"].as_str() == Some(kind))
            .collect()
    }

    pub fn named(&self, kind: &str, name: &str) -> &Value {
        self.kind(kind)
            .into_iter()
            .find(|d| d["metadata"]["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("{}: no {kind} {name}", self.name))
    }

    pub fn has(&self, kind: &str, name: &str) -> bool {
        self.kind(kind)
            .iter()
            .any(|d| d["metadata"]["name"].as_str() == Some(name))
    }

    /// Every Deployment and DaemonSet.
    pub fn workloads(&self) -> Vec<&Value> {
        let mut w = self.kind("Deployment");
        w.extend(self.kind("DaemonSet"));
        w
    }

    pub fn drivers(&self) -> BTreeSet<String> {
        self.kind("CSIDriver")
            .iter()
            .map(|d| s(&d["metadata"]["name"]).to_string())
            .collect()
    }

    /// The data of a ConfigMap (by its generated name), as files.
    pub fn config_files(&self, name: &str) -> BTreeMap<String, String> {
        self.named("ConfigMap", name)["data"]
            .as_mapping()
            .unwrap()
            .iter()
            .map(|(k, v)| (s(k).to_string(), s(v).to_string()))
            .collect()
    }
}

pub fn pod(w: &Value) -> &Value {
    &w["spec"]["template"]["spec"]
}

pub fn containers(w: &Value) -> &[Value] {
    seq(&pod(w)["containers"])
}

pub fn container<'a>(w: &'a Value, name: &str) -> &'a Value {
    containers(w)
        .iter()
        .find(|c| c["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("{}: no container {name}", s(&w["metadata"]["name"])))
}

pub fn args(c: &Value) -> Vec<String> {
    seq(&c["args"]).iter().map(|a| s(a).to_string()).collect()
}

/// The value of `--flag=value` in a container's args.
pub fn flag(c: &Value, name: &str) -> Option<String> {
    let prefix = format!("--{name}=");
    args(c)
        .iter()
        .find_map(|a| a.strip_prefix(&prefix).map(str::to_string))
}

pub fn volume<'a>(w: &'a Value, name: &str) -> &'a Value {
    seq(&pod(w)["volumes"])
        .iter()
        .find(|v| v["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The host path mounted at `mount_path` in container `c`, if any.
pub fn host_path_at<'a>(w: &'a Value, c: &Value, mount_path: &str) -> Option<&'a str> {
    let m = seq(&c["volumeMounts"])
        .iter()
        .find(|m| m["mountPath"].as_str() == Some(mount_path))?;
    volume(w, s(&m["name"]))["hostPath"]["path"].as_str()
}

pub fn mount<'a>(c: &'a Value, mount_path: &str) -> Option<&'a Value> {
    seq(&c["volumeMounts"])
        .iter()
        .find(|m| m["mountPath"].as_str() == Some(mount_path))
}

pub fn port(c: &Value, name: &str) -> i64 {
    seq(&c["ports"])
        .iter()
        .find(|p| p["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no port {name}"))["containerPort"]
        .as_i64()
        .unwrap()
}

/// Runs one ferrovol container of a rendered overlay from its own args:
/// the pod's paths become temporary ones, the ConfigMap it mounts is
/// written out, `$(VAR)`s from the pod's fields are filled in, and a pod
/// that runs as a non-root user runs as that user here too.
pub struct Started {
    pub child: std::process::Child,
    pub dir: tempfile::TempDir,
    /// The host's folders, when the pod is the only one to use them.
    pub host: Option<tempfile::TempDir>,
    pub channel: tonic::transport::Channel,
    pub metrics: u16,
}

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        super::cleanup(self.dir.path());
        if let Some(host) = &self.host {
            super::cleanup(host.path());
        }
    }
}

/// Makes `path` as the kubelet makes a pod's volume: an emptyDir is
/// root's, mode 0777 (with the pod's fsGroup: that group's, set-group-id,
/// 2777), empty at every pod start; a hostPath the host made is root's,
/// 0755; a ConfigMap's folder root's, 0755.
pub fn make_volume(path: &Path, volume: &Value, fs_group: Option<u32>) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path).unwrap();
    let mode = if volume.get("emptyDir").is_some() {
        std::os::unix::fs::chown(path, Some(0), fs_group).unwrap();
        if fs_group.is_some() {
            0o2777
        } else {
            0o777
        }
    } else {
        std::os::unix::fs::chown(path, Some(0), Some(0)).unwrap();
        0o755
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The volume mounted at `mount_path` in container `c` of `w`, or at a
/// folder above it, with the path below the mount.
pub fn volume_at<'a>(w: &'a Value, c: &Value, path: &str) -> Option<(&'a Value, String)> {
    seq(&c["volumeMounts"])
        .iter()
        .filter(|m| {
            let at = s(&m["mountPath"]);
            path == at || path.starts_with(&format!("{}/", at.trim_end_matches('/')))
        })
        .max_by_key(|m| s(&m["mountPath"]).len())
        .map(|m| {
            let rest = path[s(&m["mountPath"]).len()..].trim_start_matches('/');
            (volume(w, s(&m["name"])), rest.to_string())
        })
}

pub async fn start_container(r: &Rendered, w: &Value) -> Started {
    let host = tempfile::tempdir().unwrap();
    let mut started = start_pod(r, w, host.path(), &|t| t).await;
    // The host goes with the pod: nothing starts on it again.
    started.host = Some(host);
    started
}

/// A pod of `w` on a node whose host folders are under `host`: its
/// hostPath volumes are kept there (what an earlier pod on that node left
/// is found again), its emptyDirs are new and empty. `edit` rewrites each
/// config file as the test's stand-ins for the real servers need.
pub async fn start_pod(
    r: &Rendered,
    w: &Value,
    host: &Path,
    edit: &dyn Fn(String) -> String,
) -> Started {
    start_pod_with_secrets(r, w, host, edit, &|_, data| data).await
}

/// What a Secret's keys hold, by the Secret's name.
pub type SecretData = std::collections::HashMap<String, String>;

/// [`start_pod`], each Secret the ferrovol container mounts rewritten by
/// `secrets` (its name, its keys) for the test's servers first.
pub async fn start_pod_with_secrets(
    r: &Rendered,
    w: &Value,
    host: &Path,
    edit: &dyn Fn(String) -> String,
    secrets: &dyn Fn(&str, SecretData) -> SecretData,
) -> Started {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // The pod's root is everyone's to walk through.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let f = container(w, "ferrovol");
    let fs_group = pod(w)["securityContext"]["fsGroup"]
        .as_i64()
        .map(|g| g as u32);
    let pod_state = flag(f, "state-dir").unwrap();
    // The state folder is what the pod mounts there (an emptyDir or a
    // hostPath), made as the kubelet makes it.
    let state = match volume_at(w, f, &pod_state) {
        Some((v, rest)) => {
            let at = match v["hostPath"]["path"].as_str() {
                Some(p) => {
                    let at = host.join(p.trim_start_matches('/'));
                    if !at.exists() {
                        make_volume(&at, v, fs_group);
                    }
                    at
                }
                None => {
                    let at = dir.path().join("state-volume");
                    make_volume(&at, v, fs_group);
                    at
                }
            };
            if rest.is_empty() {
                at
            } else {
                at.join(rest)
            }
        }
        None => panic!("{}: the state dir {pod_state} is on no volume", r.name),
    };
    // The Secrets it mounts, as the kubelet writes them: each key a file
    // of the volume's defaultMode (0644 unless given), root's; with the
    // pod's fsGroup the files are that group's and group-readable (0440
    // added: the volume is read-only). Their container paths, named in the
    // config, become these folders.
    let mut secret_dirs: Vec<(String, std::path::PathBuf)> = Vec::new();
    for m in seq(&f["volumeMounts"]) {
        let v = volume(w, s(&m["name"]));
        let Some(name) = v["secret"]["secretName"].as_str() else {
            continue;
        };
        let Some(secret) = r
            .kind("Secret")
            .into_iter()
            .find(|d| d["metadata"]["name"].as_str() == Some(name))
        else {
            assert_eq!(
                v["secret"]["optional"].as_bool(),
                Some(true),
                "no Secret {name}"
            );
            continue;
        };
        let data: SecretData = secret["stringData"]
            .as_mapping()
            .into_iter()
            .flatten()
            .map(|(k, v)| (s(k).to_string(), s(v).to_string()))
            .collect();
        let at = dir.path().join(format!("secret-{}", s(&m["name"])));
        std::fs::create_dir_all(&at).unwrap();
        std::fs::set_permissions(&at, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut mode = v["secret"]["defaultMode"].as_u64().unwrap_or(0o644) as u32;
        if fs_group.is_some() {
            mode |= 0o440;
        }
        for (key, text) in secrets(name, data) {
            let file = at.join(&key);
            std::fs::write(&file, text).unwrap();
            std::os::unix::fs::chown(&file, Some(0), Some(fs_group.unwrap_or(0))).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        secret_dirs.push((s(&m["mountPath"]).to_string(), at));
    }
    let config = dir.path().join("config.d");
    make_volume(&config, &Value::Null, fs_group);
    // The socket's folder is an emptyDir in every pod.
    let csi = dir.path().join("csi");
    let endpoint = flag(f, "endpoint").unwrap();
    let socket_dir = endpoint
        .trim_start_matches("unix://")
        .rsplit_once('/')
        .unwrap()
        .0
        .to_string();
    let (v, _) = volume_at(w, f, &socket_dir).expect("the socket's folder is a volume");
    make_volume(&csi, v, fs_group);
    let socket = csi.join("csi.sock");
    let metrics = super::free_port();
    // The cgroup tree a node plugin sets pods' I/O limits in, when the
    // test gives it one of its own: writable in the pod, as the host's
    // /sys it mounts is.
    let mut cgroup_roots: Vec<std::path::PathBuf> = Vec::new();
    if let Some(cm) = flag(f, "config") {
        let m = mount(f, &cm).expect("the config dir is mounted");
        let cm = s(&volume(w, s(&m["name"]))["configMap"]["name"]);
        for (name, text) in r.config_files(cm) {
            // Paths under the pod's state dir move with it; the kubelet's
            // root is the host's (here, under the host's folders).
            let kubelet = host.join("var/lib/kubelet");
            std::fs::create_dir_all(&kubelet).unwrap();
            let mut text = text.replace(&pod_state, state.to_str().unwrap()).replace(
                "\"/var/lib/kubelet\"",
                &format!("\"{}\"", kubelet.display()),
            );
            for (mount_path, at) in &secret_dirs {
                text = text.replace(&format!("\"{mount_path}/"), &format!("\"{}/", at.display()));
            }
            // The iscsi node reads the host's initiator name (through the
            // pod's /etc/iscsi hostPath): here, one the test writes.
            if text.contains("type = \"iscsi\"") && !text.contains("initiator_name_file") {
                let file = dir.path().join("initiatorname.iscsi");
                std::fs::write(&file, "InitiatorName=iqn.2026-11.io.ferrovol.test:node-1\n")
                    .unwrap();
                text = text.replacen(
                    "type = \"iscsi\"\n",
                    &format!(
                        "type = \"iscsi\"\ninitiator_name_file = \"{}\"\n",
                        file.display()
                    ),
                    1,
                );
            }
            // The nvmf node reads the host's NQN and ID (through the
            // pod's /etc/nvme hostPath): here, ones the test writes.
            if text.contains("type = \"nvmf\"") && !text.contains("host_nqn_file") {
                let (nqn, id) = (dir.path().join("hostnqn"), dir.path().join("hostid"));
                std::fs::write(&nqn, "nqn.2014-08.org.nvmexpress:uuid:node-1\n").unwrap();
                std::fs::write(&id, "5b0f6e1c-7d3a-4c2e-9f11-2a4b6c8d0e13\n").unwrap();
                text = text.replacen(
                    "type = \"nvmf\"\n",
                    &format!(
                        "type = \"nvmf\"\nhost_nqn_file = \"{}\"\nhost_id_file = \"{}\"\n",
                        nqn.display(),
                        id.display()
                    ),
                    1,
                );
            }
            let text = edit(text);
            if let Some(root) = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("cgroup_root = "))
            {
                cgroup_roots.push(std::path::PathBuf::from(root.trim_matches('"')));
            }
            std::fs::write(config.join(&name), text).unwrap();
            std::fs::set_permissions(config.join(name), std::fs::Permissions::from_mode(0o644))
                .unwrap();
        }
    }
    // The kubelet expands $(NAME) in args only for a NAME of the
    // container's env, and passes any other literally: every one must be
    // defined there.
    let defined: BTreeSet<&str> = seq(&f["env"]).iter().map(|e| s(&e["name"])).collect();
    let env = |arg: &str, name: &str| {
        assert!(
            defined.contains(name),
            "{}: {} passes $({name}) in {arg:?}, which its env does not define: \
             the kubelet would hand the driver the literal text",
            r.name,
            s(&w["metadata"]["name"])
        );
        match name {
            "NODE_NAME" => "node-1".to_string(),
            "POD_NAME" => "pod-1".to_string(),
            "POD_IP" => "127.0.0.1".to_string(),
            other => panic!("unexpected $({other})"),
        }
    };
    let mut a = Vec::new();
    for arg in args(f) {
        let mut arg = arg;
        while let Some(start) = arg.find("$(") {
            let end = arg[start..].find(')').unwrap() + start;
            let value = env(&arg, &arg[start + 2..end]);
            arg.replace_range(start..=end, &value);
        }
        let (name, value) = arg.split_once('=').unwrap_or((&arg, ""));
        let value = match name {
            "--endpoint" => format!("unix://{}", socket.display()),
            "--state-dir" => state.display().to_string(),
            "--config" => config.display().to_string(),
            "--metrics-addr" => format!("127.0.0.1:{metrics}"),
            _ => value.to_string(),
        };
        a.push(if value.is_empty() && !arg.contains('=') {
            arg.clone()
        } else {
            format!("{name}={value}")
        });
    }
    // As the container runs: the pod's user and group with its fsGroup as
    // a supplementary group (the volumes are as the kubelet makes them,
    // none of them the user's own), no capabilities where it drops them
    // all, and a read-only root where it has one: every mount of the host
    // read-only in its own mount namespace but its writable volumes (the
    // state and socket folders), so a driver that writes anywhere else
    // fails here as it would in its pod.
    let sc = &f["securityContext"];
    let mut setpriv: Vec<String> = Vec::new();
    // The container's own user and group over the pod's.
    let user = sc["runAsUser"]
        .as_i64()
        .or(pod(w)["securityContext"]["runAsUser"].as_i64());
    if let Some(uid) = user {
        let gid = sc["runAsGroup"]
            .as_i64()
            .or(pod(w)["securityContext"]["runAsGroup"].as_i64())
            .unwrap_or(uid);
        setpriv.push(format!("--reuid={uid}"));
        setpriv.push(format!("--regid={gid}"));
        setpriv.push(match fs_group {
            Some(g) => format!("--groups={g}"),
            None => "--clear-groups".to_string(),
        });
    }
    if seq(&sc["capabilities"]["drop"])
        .iter()
        .any(|c| c.as_str() == Some("ALL"))
    {
        setpriv.push("--bounding-set=-all".into());
        setpriv.push("--inh-caps=-all".into());
    }
    let mut program: Vec<String> = Vec::new();
    if sc["readOnlyRootFilesystem"].as_bool() == Some(true) {
        // Its own mount namespace, as a container has: its writable
        // volumes bound onto themselves (kept writable), every other mount
        // read-only; and a mount the container would not have that pins a
        // device or a session (another volume's: any block device, named
        // however it was mounted, or an export) let go of, or the process
        // would hold it from the node plugin that must release it.
        const READ_ONLY_ROOT: &str = r#"
            n=$1; shift; keep=""
            while [ "$n" -gt 0 ]; do mount --bind "$1" "$1"; keep="$keep $1"; shift; n=$((n-1)); done
            need="$keep $1"; shift
            awk '{ for (i = 7; i <= NF; i++) if ($i == "-") { print $5, $(i+1), $(i+2); break } }' /proc/self/mountinfo \
              | sort -r | while read -r m fs src; do
              case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue;; esac
              if [ "$m" = / ]; then mount -o remount,bind,ro /; continue; fi
              for k in $keep; do [ "$m" = "$k" ] && continue 2; done
              above=0
              for k in $need; do case "$k/" in "$m"/*) above=1;; esac; done
              if [ "$above" = 0 ]; then
                case "$fs:$src" in
                  nfs*|*:/dev/*)
                    umount -l "$m" 2>/dev/null || true; continue;;
                esac
              fi
              mount -o remount,bind,ro "$m" 2>/dev/null || true
            done
            if touch /.ferrovol-rw-probe 2>/dev/null; then rm -f /.ferrovol-rw-probe; echo "the root is still writable" >&2; exit 1; fi
            exec "$@""#;
        program.extend(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-ec",
                READ_ONLY_ROOT,
                "sh",
            ]
            .map(String::from),
        );
        program.push((2 + cgroup_roots.len()).to_string());
        program.push(state.display().to_string());
        program.push(csi.display().to_string());
        program.extend(cgroup_roots.iter().map(|p| p.display().to_string()));
        // What the container runs from: kept mounted.
        let bin = Path::new(env!("CARGO_BIN_EXE_ferrovol"));
        program.push(bin.parent().unwrap().display().to_string());
    }
    if !setpriv.is_empty() {
        program.push("setpriv".into());
        program.extend(setpriv);
        program.push("--".into());
    }
    program.push(env!("CARGO_BIN_EXE_ferrovol").into());
    let mut cmd = Command::new(&program[0]);
    cmd.args(&program[1..]);
    // Its volumes are this host's folders, not mounts of a pod's: the
    // driver's in-a-pod check (tested on its own in first_week.rs) would
    // judge them by the suite's environment.
    cmd.env_remove("KUBERNETES_SERVICE_HOST");
    // The container's literal environment (what `valueFrom` fills comes
    // through its `$(NAME)` in the args, above).
    for e in seq(&f["env"]) {
        if let Some(v) = e["value"].as_str() {
            cmd.env(s(&e["name"]), v);
        }
    }
    let log = std::fs::File::create(dir.path().join("log")).unwrap();
    let mut child = cmd
        .args(&a)
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    // Bounded by the driver: one that exits fails at once.
    let deadline = std::time::Instant::now() + DAEMON_BACKSTOP;
    let channel = loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "{}: {} exited with {status}: {a:?}\n{}",
                r.name,
                s(&w["metadata"]["name"]),
                std::fs::read_to_string(dir.path().join("log")).unwrap()
            );
        }
        if let Ok(ch) = super::connect(&socket).await {
            let mut id = pb::identity_client::IdentityClient::new(ch.clone());
            if id
                .get_plugin_info(pb::GetPluginInfoRequest {})
                .await
                .is_ok()
            {
                break ch;
            }
        }
        assert!(std::time::Instant::now() < deadline, "not serving: {a:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    Started {
        child,
        dir,
        host: None,
        channel,
        metrics,
    }
}
