//! A rendered overlay run as a one-node cluster would run it: every
//! workload's ferrovol container started as its pod runs it (on one host,
//! whose host paths outlive the pods), and each call shaped as the stock
//! sidecars and the kubelet shape it from the rendered objects: the
//! StorageClass's parameters (its `csi.storage.k8s.io/*` keys taken out:
//! the fs type, mount options and the secrets each call carries), the
//! provisioner's `--default-fstype`, `--extra-create-metadata` and
//! `--node-deployment` (the node's topology), the snapshotter's node mode,
//! the resizer's choice between controller and node expansion, the
//! attacher only where the controller publishes. Pods are replaced as a
//! roll or a drain replaces them: emptyDirs new, host paths kept.

use super::deployed::*;
use super::snapshot_source;
use ferrovol::proto as pb;
use serde_yaml::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use tonic::transport::Channel;

/// The node every DaemonSet and Deployment runs on.
pub const NODE: &str = "node-1";

/// Rewrites a config file of the overlay for the test's servers.
pub type Edit = Box<dyn Fn(String) -> String>;
/// Rewrites a Secret of the overlay (by name) for the test's servers.
pub type SecretEdit = Box<dyn Fn(&str, HashMap<String, String>) -> HashMap<String, String>>;

pub struct Cluster {
    pub r: Rendered,
    pub host: tempfile::TempDir,
    /// By workload name.
    pub pods: BTreeMap<String, Started>,
    edit: Edit,
    secret_edit: SecretEdit,
    uid: std::cell::Cell<u32>,
}

/// A claim made in a class, as the provisioner made its volume.
#[derive(Clone, Debug)]
pub struct Claim {
    pub class: String,
    pub driver: String,
    pub pv: String,
    pub id: String,
    pub capability: pb::VolumeCapability,
    pub context: HashMap<String, String>,
    pub bytes: i64,
}

/// A claim mounted in a pod on the node.
#[derive(Clone, Debug)]
pub struct Mounted {
    pub claim: Claim,
    pub staging: PathBuf,
    pub target: PathBuf,
    pub publish_context: HashMap<String, String>,
    /// The pod's name and UID (its folder under the kubelet's `pods/`).
    pub pod: (String, String),
}

fn strip(params: &Value) -> HashMap<String, String> {
    params
        .as_mapping()
        .into_iter()
        .flatten()
        .map(|(k, v)| (s(k).to_string(), s(v).to_string()))
        .filter(|(k, _)| !k.starts_with("csi.storage.k8s.io/"))
        .collect()
}

impl Cluster {
    /// Starts every workload of `r` on one host.
    pub async fn start(r: Rendered, edit: Edit, secret_edit: SecretEdit) -> Self {
        let host = tempfile::tempdir().unwrap();
        let mut c = Cluster {
            r,
            host,
            pods: BTreeMap::new(),
            edit,
            secret_edit,
            uid: std::cell::Cell::new(0),
        };
        c.start_pods().await;
        c
    }

    async fn start_pods(&mut self) {
        // The controllers first: the node plugins are told where their
        // Services are.
        let mut workloads = self.r.workloads();
        workloads.sort_by_key(|w| s(&w["kind"]) != "Deployment");
        let names: Vec<String> = workloads
            .iter()
            .map(|w| s(&w["metadata"]["name"]).to_string())
            .collect();
        for name in names {
            let t = std::time::Instant::now();
            let w = self
                .r
                .workloads()
                .into_iter()
                .find(|w| s(&w["metadata"]["name"]) == name)
                .unwrap();
            // A Service's address in a config, as the cluster's DNS would
            // answer it: the metrics port of the pod it selects, here.
            let services = self.service_addresses();
            let cgroups = self.cgroup_root();
            std::fs::create_dir_all(&cgroups).unwrap();
            let edit = |text: String| {
                let text = services
                    .iter()
                    .fold((self.edit)(text), |t, (from, to)| t.replace(from, to));
                // The node plugins set pods' I/O limits in the test's
                // stand-in cgroup tree (see [`Cluster::io_max`]), and ask
                // for changes every second.
                match text.contains("[node]\n") && !text.contains("cgroup_root") {
                    true => text.replacen(
                        "[node]\n",
                        &format!("[node]\ncgroup_root = \"{}\"\n", cgroups.display()),
                        1,
                    ),
                    false => text,
                }
                .replace("limits_refresh_seconds = 10", "limits_refresh_seconds = 1")
            };
            let started =
                start_pod_with_secrets(&self.r, w, self.host.path(), &edit, &*self.secret_edit)
                    .await;
            eprintln!(
                "{}: pod {name} started in {:.1}s",
                self.r.name,
                t.elapsed().as_secs_f64()
            );
            self.pods.insert(name, started);
        }
    }

    /// The node plugins' cgroup tree: folders laid out as kubelet lays out
    /// pods' cgroups (cgroupfs, BestEffort), each with an `io.max` file
    /// the node plugin writes the pod's lines to (the kernel's own tree is
    /// the guest's tests': tests/guest/iolimits.rs).
    pub fn cgroup_root(&self) -> PathBuf {
        self.host.path().join("cgroup")
    }

    fn pod_cgroup(&self, uid: &str) -> PathBuf {
        self.cgroup_root()
            .join(format!("kubepods/besteffort/pod{uid}"))
    }

    /// What the node plugin last wrote to the `io.max` of a mounted
    /// claim's pod (empty: nothing).
    pub fn io_max(&self, m: &Mounted) -> String {
        std::fs::read_to_string(self.pod_cgroup(&m.pod.1).join("io.max")).unwrap_or_default()
    }

    /// The end of the `io.max` line of attributes class `vac`'s limits
    /// (after the device's number).
    pub fn tier_line(&self, vac: &str) -> String {
        let params: BTreeMap<String, String> =
            strip(&self.r.named("VolumeAttributesClass", vac)["parameters"])
                .into_iter()
                .collect();
        let line = ferrovol::host::iolimit::Limits::parse(&params)
            .unwrap()
            .io_max_line((0, 0));
        line.split_once(' ').unwrap().1.to_string()
    }

    /// Each Service's `http://<name>.<namespace>.svc:<port>` of a port
    /// that targets `metrics`, and the address the started pod it selects
    /// serves its metrics on.
    fn service_addresses(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for svc in self.r.kind("Service") {
            let selector = &svc["spec"]["selector"];
            let Some((_, started)) = self.pods.iter().find(|(name, _)| {
                let labels = &self.workload(name)["spec"]["template"]["metadata"]["labels"];
                selector
                    .as_mapping()
                    .is_some_and(|m| m.iter().all(|(k, v)| labels[k] == *v))
            }) else {
                continue;
            };
            for port in seq(&svc["spec"]["ports"]) {
                if port["targetPort"].as_str() != Some("metrics") {
                    continue;
                }
                out.push((
                    format!(
                        "http://{}.{}.svc:{}",
                        s(&svc["metadata"]["name"]),
                        s(&svc["metadata"]["namespace"]),
                        port["port"].as_u64().unwrap()
                    ),
                    format!("http://127.0.0.1:{}", started.metrics),
                ));
            }
        }
        out
    }

    /// Every pod replaced, as a roll or a drain does: each process killed
    /// with its emptyDirs, a new one started on the host's paths. What the
    /// kernel holds (mounts, devices, sessions) stays.
    pub async fn replace_pods(&mut self) {
        for (_, mut p) in std::mem::take(&mut self.pods) {
            // Its host paths are the cluster's, not the pod's.
            p.host = None;
            drop(p);
        }
        self.start_pods().await;
    }

    fn workload(&self, name: &str) -> &Value {
        self.r
            .workloads()
            .into_iter()
            .find(|w| s(&w["metadata"]["name"]) == name)
            .unwrap()
    }

    /// The workload whose ferrovol serves `driver` and that runs
    /// `sidecar` (the kubelet's, `None`: the DaemonSet's).
    fn serving(&self, driver: &str, sidecar: Option<&str>) -> String {
        self.r
            .workloads()
            .into_iter()
            .filter(|w| flag(container(w, "ferrovol"), "driver-name").as_deref() == Some(driver))
            .find(|w| match sidecar {
                Some(sc) => containers(w).iter().any(|c| s(&c["name"]) == sc),
                None => w["kind"].as_str() == Some("DaemonSet"),
            })
            .map(|w| s(&w["metadata"]["name"]).to_string())
            .unwrap_or_else(|| panic!("{}: no pod of {driver} runs {sidecar:?}", self.r.name))
    }

    fn channel(&self, workload: &str) -> Channel {
        self.pods[workload].channel.clone()
    }

    fn sidecar_of(&self, workload: &str, name: &str) -> &Value {
        container(self.workload(workload), name)
    }

    fn next(&self, prefix: &str) -> String {
        let n = self.uid.get() + 1;
        self.uid.set(n);
        format!("{prefix}-{n:08x}-{}", std::process::id())
    }

    /// The Secret a class names for `op` (`provisioner`, `node-stage`, ...).
    pub fn secrets(&self, params: &Value, op: &str) -> HashMap<String, String> {
        let Some(name) = params[format!("csi.storage.k8s.io/{op}-secret-name").as_str()].as_str()
        else {
            return HashMap::new();
        };
        let secret = self.r.named("Secret", name);
        let data: HashMap<String, String> =
            serde_yaml::from_value(secret["stringData"].clone()).unwrap_or_default();
        (self.secret_edit)(name, data)
    }

    pub fn class(&self, name: &str) -> &Value {
        self.r.named("StorageClass", name)
    }

    /// The node plugin's NodeGetInfo.
    pub async fn node_info(&self, driver: &str) -> pb::NodeGetInfoResponse {
        let ds = self.serving(driver, None);
        pb::node_client::NodeClient::new(self.channel(&ds))
            .node_get_info(pb::NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    fn capability(&self, class: &Value, prov: &Value) -> pb::VolumeCapability {
        let params = &class["parameters"];
        let fs = params["csi.storage.k8s.io/fstype"]
            .as_str()
            .map(str::to_string)
            .or_else(|| flag(prov, "default-fstype"))
            .unwrap_or_default();
        let flags = seq(&class["mountOptions"])
            .iter()
            .map(|o| s(o).to_string())
            .collect();
        pb::VolumeCapability {
            access_mode: Some(pb::volume_capability::AccessMode {
                mode: pb::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(pb::volume_capability::AccessType::Mount(
                pb::volume_capability::MountVolume {
                    fs_type: fs,
                    mount_flags: flags,
                    ..Default::default()
                },
            )),
        }
    }

    /// CreateVolume as the provisioner sends it for a claim of `class`
    /// (named `claim`, in namespace `default`), of `bytes`, in the
    /// attributes class `vac`, from `source`.
    pub async fn provision(
        &self,
        class: &str,
        bytes: i64,
        vac: Option<&str>,
        source: Option<pb::VolumeContentSource>,
    ) -> Result<Claim, tonic::Status> {
        let sc = self.class(class);
        let driver = s(&sc["provisioner"]).to_string();
        let w = self.serving(&driver, Some("csi-provisioner"));
        let prov = self.sidecar_of(&w, "csi-provisioner");
        let pv = self.next("pvc");
        let mut parameters = strip(&sc["parameters"]);
        if flag(prov, "extra-create-metadata").as_deref() == Some("true") {
            parameters.insert("csi.storage.k8s.io/pvc/name".into(), format!("claim-{pv}"));
            parameters.insert("csi.storage.k8s.io/pvc/namespace".into(), "default".into());
            parameters.insert("csi.storage.k8s.io/pv/name".into(), pv.clone());
        }
        let accessibility_requirements = if flag(prov, "node-deployment").as_deref() == Some("true")
        {
            let topo = self.node_info(&driver).await.accessible_topology.unwrap();
            Some(pb::TopologyRequirement {
                requisite: vec![topo.clone()],
                preferred: vec![topo],
            })
        } else {
            None
        };
        let capability = self.capability(sc, prov);
        let mutable_parameters = vac
            .map(|v| strip(&self.r.named("VolumeAttributesClass", v)["parameters"]))
            .unwrap_or_default();
        let made = pb::controller_client::ControllerClient::new(self.channel(&w))
            .create_volume(pb::CreateVolumeRequest {
                name: pv.clone(),
                capacity_range: Some(pb::CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![capability.clone()],
                parameters,
                secrets: self.secrets(&sc["parameters"], "provisioner"),
                volume_content_source: source,
                accessibility_requirements,
                mutable_parameters,
            })
            .await?
            .into_inner()
            .volume
            .unwrap();
        Ok(Claim {
            class: class.to_string(),
            driver,
            pv,
            id: made.volume_id,
            capability,
            context: made.volume_context,
            bytes: made.capacity_bytes,
        })
    }

    /// What the central controller of the claim's driver offers.
    async fn controller_caps(&self, driver: &str) -> Vec<i32> {
        // The attacher and resizer talk to the pod that runs them.
        let w = self.serving(driver, Some("csi-resizer"));
        pb::controller_client::ControllerClient::new(self.channel(&w))
            .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
            .capabilities
            .iter()
            .filter_map(|c| match &c.r#type {
                Some(pb::controller_service_capability::Type::Rpc(r)) => Some(r.r#type),
                _ => None,
            })
            .collect()
    }

    /// A pod on the node uses the claim: the attacher's ControllerPublish
    /// (where the driver attaches), the kubelet's NodeStage at the
    /// driver's global mount and NodePublish into the pod's folder.
    pub async fn mount(&self, claim: &Claim) -> Mounted {
        use pb::controller_service_capability::rpc::Type as Ctl;
        let sc = self.class(&claim.class);
        let params = &sc["parameters"];
        let node_id = self.node_info(&claim.driver).await.node_id;
        let publish_context = if self
            .controller_caps(&claim.driver)
            .await
            .contains(&(Ctl::PublishUnpublishVolume as i32))
        {
            let w = self.serving(&claim.driver, Some("csi-attacher"));
            pb::controller_client::ControllerClient::new(self.channel(&w))
                .controller_publish_volume(pb::ControllerPublishVolumeRequest {
                    volume_id: claim.id.clone(),
                    node_id,
                    volume_capability: Some(claim.capability.clone()),
                    readonly: false,
                    secrets: self.secrets(params, "controller-publish"),
                    volume_context: claim.context.clone(),
                })
                .await
                .unwrap_or_else(|e| panic!("ControllerPublish {}: {e}", claim.id))
                .into_inner()
                .publish_context
        } else {
            HashMap::new()
        };
        let kubelet = self.host.path().join("var/lib/kubelet");
        let staging = kubelet
            .join("plugins/kubernetes.io/csi")
            .join(&claim.driver)
            .join(&claim.pv)
            .join("globalmount");
        std::fs::create_dir_all(&staging).unwrap();
        let pod = self.next("pod");
        // A pod's UID is a UUID; its folder is named by it.
        let n = self.uid.get();
        let uid = format!("{:08x}-0000-4000-8000-{:012x}", std::process::id(), n);
        let target = kubelet
            .join("pods")
            .join(&uid)
            .join("volumes/kubernetes.io~csi")
            .join(&claim.pv)
            .join("mount");
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let cgroup = self.pod_cgroup(&uid);
        std::fs::create_dir_all(&cgroup).unwrap();
        std::fs::write(cgroup.join("io.max"), "").unwrap();
        let mounted = Mounted {
            claim: claim.clone(),
            staging,
            target,
            publish_context,
            pod: (pod, uid),
        };
        self.stage_and_publish(&mounted).await;
        mounted
    }

    /// NodeStage and NodePublish of a mounted claim (again, after a
    /// replacement: both are idempotent).
    pub async fn stage_and_publish(&self, m: &Mounted) {
        let params = &self.class(&m.claim.class)["parameters"];
        let mut node =
            pb::node_client::NodeClient::new(self.channel(&self.serving(&m.claim.driver, None)));
        node.node_stage_volume(pb::NodeStageVolumeRequest {
            volume_id: m.claim.id.clone(),
            publish_context: m.publish_context.clone(),
            staging_target_path: m.staging.display().to_string(),
            volume_capability: Some(m.claim.capability.clone()),
            secrets: self.secrets(params, "node-stage"),
            volume_context: m.claim.context.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("NodeStage {}: {e}", m.claim.id));
        node.node_publish_volume(pb::NodePublishVolumeRequest {
            volume_id: m.claim.id.clone(),
            publish_context: m.publish_context.clone(),
            staging_target_path: m.staging.display().to_string(),
            target_path: m.target.display().to_string(),
            volume_capability: Some(m.claim.capability.clone()),
            readonly: false,
            secrets: self.secrets(params, "node-publish"),
            volume_context: self.publish_context_of(m),
        })
        .await
        .unwrap_or_else(|e| panic!("NodePublish {}: {e}", m.claim.id));
    }

    /// The volume context kubelet gives NodePublish: the claim's, with the
    /// pod's own keys where the driver's CSIDriver asks for them
    /// (`podInfoOnMount`).
    fn publish_context_of(&self, m: &Mounted) -> HashMap<String, String> {
        let mut context = m.claim.context.clone();
        let driver = self.r.named("CSIDriver", &m.claim.driver);
        if driver["spec"]["podInfoOnMount"].as_bool() == Some(true) {
            let (name, uid) = &m.pod;
            for (key, value) in [
                ("pod.name", name.as_str()),
                ("pod.namespace", "default"),
                ("pod.uid", uid.as_str()),
                ("serviceAccount.name", "default"),
                ("ephemeral", "false"),
            ] {
                context.insert(format!("csi.storage.k8s.io/{key}"), value.to_string());
            }
        }
        context
    }

    /// The pod goes: NodeUnpublish, NodeUnstage, and the attacher's
    /// ControllerUnpublish where the driver attaches.
    pub async fn unmount(&self, m: &Mounted) {
        use pb::controller_service_capability::rpc::Type as Ctl;
        let mut node =
            pb::node_client::NodeClient::new(self.channel(&self.serving(&m.claim.driver, None)));
        node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
            volume_id: m.claim.id.clone(),
            target_path: m.target.display().to_string(),
        })
        .await
        .unwrap_or_else(|e| panic!("NodeUnpublish {}: {e}", m.claim.id));
        node.node_unstage_volume(pb::NodeUnstageVolumeRequest {
            volume_id: m.claim.id.clone(),
            staging_target_path: m.staging.display().to_string(),
        })
        .await
        .unwrap_or_else(|e| {
            // Who else has the claim mounted (another mount namespace).
            let pv = &m.claim.pv;
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "for f in /proc/[0-9]*/mountinfo; do grep -q -- '{pv}' $f 2>/dev/null && \
                     p=${{f#/proc/}} && p=${{p%/mountinfo}} && echo \"$p $(tr '\\0' ' ' < /proc/$p/cmdline | cut -c1-200)\"; done"
                ))
                .output()
                .unwrap();
            panic!(
                "NodeUnstage {}: {e}\nprocesses with it mounted:\n{}",
                m.claim.id,
                String::from_utf8_lossy(&out.stdout)
            )
        });
        if self
            .controller_caps(&m.claim.driver)
            .await
            .contains(&(Ctl::PublishUnpublishVolume as i32))
        {
            let params = &self.class(&m.claim.class)["parameters"];
            let w = self.serving(&m.claim.driver, Some("csi-attacher"));
            pb::controller_client::ControllerClient::new(self.channel(&w))
                .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                    volume_id: m.claim.id.clone(),
                    node_id: self.node_info(&m.claim.driver).await.node_id,
                    secrets: self.secrets(params, "controller-publish"),
                })
                .await
                .unwrap_or_else(|e| panic!("ControllerUnpublish {}: {e}", m.claim.id));
        }
    }

    /// The claim deleted (reclaimPolicy Delete): DeleteVolume.
    pub async fn delete(&self, claim: &Claim) {
        let sc = self.class(&claim.class);
        let w = self.serving(&claim.driver, Some("csi-provisioner"));
        pb::controller_client::ControllerClient::new(self.channel(&w))
            .delete_volume(pb::DeleteVolumeRequest {
                volume_id: claim.id.clone(),
                secrets: self.secrets(&sc["parameters"], "provisioner"),
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteVolume {}: {e}", claim.id));
    }

    /// The snapshotter (central, or the node's in node mode) cuts a
    /// VolumeSnapshot of the claim in snapshot class `vsc`.
    pub async fn snapshot(&self, claim: &Claim, vsc: &str) -> String {
        let class = self.r.named("VolumeSnapshotClass", vsc);
        let w = self.serving(&claim.driver, Some("csi-snapshotter"));
        let snapshotter = self.sidecar_of(&w, "csi-snapshotter");
        let name = self.next("snapshot");
        let mut parameters = strip(&class["parameters"]);
        if flag(snapshotter, "extra-create-metadata").as_deref() == Some("true") {
            for (k, v) in [
                ("volumesnapshot/name", format!("vs-{name}")),
                ("volumesnapshot/namespace", "default".to_string()),
                ("volumesnapshotcontent/name", name.clone()),
            ] {
                parameters.insert(format!("csi.storage.k8s.io/{k}"), v);
            }
        }
        let snap = pb::controller_client::ControllerClient::new(self.channel(&w))
            .create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: claim.id.clone(),
                name,
                secrets: self.secrets(&class["parameters"], "snapshotter"),
                parameters,
            })
            .await
            .unwrap_or_else(|e| panic!("CreateSnapshot of {}: {e}", claim.id))
            .into_inner()
            .snapshot
            .unwrap();
        assert!(snap.ready_to_use, "{snap:?}");
        snap.snapshot_id
    }

    pub async fn delete_snapshot(&self, driver: &str, vsc: &str, id: &str) {
        let class = self.r.named("VolumeSnapshotClass", vsc);
        let w = self.serving(driver, Some("csi-snapshotter"));
        pb::controller_client::ControllerClient::new(self.channel(&w))
            .delete_snapshot(pb::DeleteSnapshotRequest {
                snapshot_id: id.to_string(),
                secrets: self.secrets(&class["parameters"], "snapshotter"),
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteSnapshot {id}: {e}"));
    }

    /// A VolumeGroupSnapshot of `claims` in group class `vgsc`; answers
    /// the group's id and its members' snapshot ids, in the claims' order.
    pub async fn group_snapshot(&self, claims: &[&Claim], vgsc: &str) -> (String, Vec<String>) {
        let class = self.r.named("VolumeGroupSnapshotClass", vgsc);
        let driver = &claims[0].driver;
        let w = self.serving(driver, Some("csi-snapshotter"));
        let req = pb::CreateVolumeGroupSnapshotRequest {
            name: self.next("groupsnapshot"),
            source_volume_ids: claims.iter().map(|c| c.id.clone()).collect(),
            secrets: self.secrets(&class["parameters"], "group-snapshotter"),
            parameters: strip(&class["parameters"]),
        };
        let g = super::as_the_snapshotter("CreateVolumeGroupSnapshot", || {
            let mut c = pb::group_controller_client::GroupControllerClient::new(self.channel(&w));
            let req = req.clone();
            async move { c.create_volume_group_snapshot(req).await }
        })
        .await
        .unwrap_or_else(|e| panic!("CreateVolumeGroupSnapshot: {e}"))
        .group_snapshot
        .unwrap();
        let members = claims
            .iter()
            .map(|c| {
                g.snapshots
                    .iter()
                    .find(|s| s.source_volume_id == c.id)
                    .expect("a member per source")
                    .snapshot_id
                    .clone()
            })
            .collect();
        (g.group_snapshot_id, members)
    }

    pub async fn delete_group_snapshot(
        &self,
        driver: &str,
        vgsc: &str,
        id: &str,
        members: &[String],
    ) {
        let class = self.r.named("VolumeGroupSnapshotClass", vgsc);
        let w = self.serving(driver, Some("csi-snapshotter"));
        pb::group_controller_client::GroupControllerClient::new(self.channel(&w))
            .delete_volume_group_snapshot(pb::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: id.to_string(),
                snapshot_ids: members.to_vec(),
                secrets: self.secrets(&class["parameters"], "group-snapshotter"),
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteVolumeGroupSnapshot {id}: {e}"));
    }

    /// The claim moved to attributes class `vac`: the resizer's
    /// ControllerModifyVolume, to the pod that runs it.
    pub async fn modify(&self, claim: &Claim, vac: &str) -> Result<(), tonic::Status> {
        let class = self.r.named("VolumeAttributesClass", vac);
        let w = self.serving(&claim.driver, Some("csi-resizer"));
        pb::controller_client::ControllerClient::new(self.channel(&w))
            .controller_modify_volume(pb::ControllerModifyVolumeRequest {
                volume_id: claim.id.clone(),
                secrets: self.secrets(&self.class(&claim.class)["parameters"], "provisioner"),
                mutable_parameters: strip(&class["parameters"]),
            })
            .await
            .map(drop)
    }

    /// The claim grown to `bytes` while mounted: the resizer's
    /// ControllerExpandVolume where the controller offers it, then the
    /// kubelet's NodeExpandVolume where the node must grow it (always, for
    /// a driver whose controller does not expand). Answers the size the
    /// filesystem shows.
    pub async fn expand(&self, m: &Mounted, bytes: i64) -> Result<u64, tonic::Status> {
        use pb::controller_service_capability::rpc::Type as Ctl;
        let node_needed = if self
            .controller_caps(&m.claim.driver)
            .await
            .contains(&(Ctl::ExpandVolume as i32))
        {
            self.controller_expand(&m.claim, bytes).await?
        } else {
            true
        };
        if node_needed {
            self.node_expand(m, bytes).await?;
        }
        Ok(fs_bytes(m))
    }

    /// The kubelet's NodeExpandVolume of a mounted claim.
    pub async fn node_expand(&self, m: &Mounted, bytes: i64) -> Result<(), tonic::Status> {
        let params = &self.class(&m.claim.class)["parameters"];
        pb::node_client::NodeClient::new(self.channel(&self.serving(&m.claim.driver, None)))
            .node_expand_volume(pb::NodeExpandVolumeRequest {
                volume_id: m.claim.id.clone(),
                volume_path: m.target.display().to_string(),
                capacity_range: Some(pb::CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                staging_target_path: m.staging.display().to_string(),
                volume_capability: Some(m.claim.capability.clone()),
                secrets: self.secrets(params, "node-expand"),
            })
            .await
            .map(drop)
    }

    /// The resizer's ControllerExpandVolume; answers whether the node
    /// must grow it too.
    pub async fn controller_expand(
        &self,
        claim: &Claim,
        bytes: i64,
    ) -> Result<bool, tonic::Status> {
        let params = &self.class(&claim.class)["parameters"];
        let w = self.serving(&claim.driver, Some("csi-resizer"));
        Ok(
            pb::controller_client::ControllerClient::new(self.channel(&w))
                .controller_expand_volume(pb::ControllerExpandVolumeRequest {
                    volume_id: claim.id.clone(),
                    capacity_range: Some(pb::CapacityRange {
                        required_bytes: bytes,
                        limit_bytes: 0,
                    }),
                    secrets: self.secrets(params, "controller-expand"),
                    volume_capability: Some(claim.capability.clone()),
                })
                .await?
                .into_inner()
                .node_expansion_required,
        )
    }

    /// The mounts under the host's kubelet folder.
    pub fn kubelet_mounts(&self) -> Vec<PathBuf> {
        super::mounts_under(&self.host.path().join("var/lib/kubelet"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A failed test shows what each pod's driver said.
        if std::thread::panicking() {
            for (name, p) in &self.pods {
                let log = std::fs::read_to_string(p.dir.path().join("log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                eprintln!("--- {name}'s log, last lines:");
                for l in tail.iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
        for (_, mut p) in std::mem::take(&mut self.pods) {
            p.host = None;
            drop(p);
        }
        super::cleanup(self.host.path());
    }
}

/// Where a class's run spends its time: each step's seconds, printed as
/// it ends (the guest suite's output shows them).
struct Laps {
    class: String,
    at: std::time::Instant,
}

impl Laps {
    fn new(class: &str) -> Self {
        Laps {
            class: class.to_string(),
            at: std::time::Instant::now(),
        }
    }

    fn lap(&mut self, step: &str) {
        eprintln!(
            "{}: {step} {:.1}s",
            self.class,
            self.at.elapsed().as_secs_f64()
        );
        self.restart();
    }

    fn restart(&mut self) {
        self.at = std::time::Instant::now();
    }
}

/// Writes `text` into the mounted claim and reads it back.
/// Synced, file and folder, as an application that wants its data in a
/// snapshot syncs it: a snapshot of a volume in use is crash-consistent,
/// and only a filesystem the node freezes for it flushes more.
pub fn write_and_read(m: &Mounted, name: &str, text: &str) {
    let f = m.target.join(name);
    std::fs::write(&f, text).unwrap();
    std::fs::File::open(&f).unwrap().sync_all().unwrap();
    std::fs::File::open(&m.target).unwrap().sync_all().unwrap();
    assert_eq!(std::fs::read_to_string(&f).unwrap(), text);
}

/// A file of the mounted claim.
pub fn read(m: &Mounted, name: &str) -> String {
    std::fs::read_to_string(m.target.join(name))
        .unwrap_or_else(|e| panic!("{} in {}: {e}", name, m.target.display()))
}

/// The size the mounted claim's filesystem shows.
pub fn fs_bytes(m: &Mounted) -> u64 {
    let st = nix::sys::statvfs::statvfs(&m.target).unwrap();
    st.blocks() * st.fragment_size()
}

/// Every StorageClass the overlay ships, through the whole life of a
/// claim as a cluster runs it, with the classes the overlay ships for its
/// backend: made (in its backend's VolumeAttributesClass), mounted in a
/// pod and written, snapshotted and restored into a new claim (in the
/// backend's bronze I/O limit tier, where it has tiers: its pod gets
/// bronze's limits), cut in a group with a second claim (where the
/// backend has a group class), moved to the attributes class (node-local
/// volumes: refused, saying why) and to its gold tier (the pod's limits
/// change), grown; then every pod replaced with every class's claim still
/// mounted, each claim used again from the new pods, and everything
/// deleted, no mount left. The pods are replaced once, with every class's
/// claim mounted. The classes run at once, as a cluster's claims come
/// (in the guest, the all overlay's seven took 171 s against 265 s one
/// after another, 2026-12-02; on 2026-11-28, with the drivers' calls
/// slower, at once took as long, and an iscsi group snapshot ran past
/// the 20 s its writers may be held: it answers Unavailable, not taken,
/// and [`Cluster::group_snapshot`] calls again as the snapshotter does).
/// Answers what it did, a line per class.
pub async fn every_class(c: &mut Cluster) -> Vec<String> {
    let classes: Vec<String> =
        c.r.kind("StorageClass")
            .iter()
            .map(|sc| s(&sc["metadata"]["name"]).to_string())
            .collect();
    // Each class's claims are its own; the drivers serve calls for
    // different volumes side by side.
    let used = all(classes.iter().map(|class| use_class(c, class))).await;
    // A roll: the pods go and come back with every claim mounted.
    let t = std::time::Instant::now();
    c.replace_pods().await;
    eprintln!(
        "{}: every pod replaced in {:.1}s",
        c.r.name,
        t.elapsed().as_secs_f64()
    );
    let done = all(used.into_iter().map(|u| use_again(c, u))).await;
    assert!(c.kubelet_mounts().is_empty(), "{:?}", c.kubelet_mounts());
    done
}

/// Runs `futures` at once on this task (each makes progress while the
/// others wait on a driver) and answers their outputs in their order.
async fn all<F: std::future::Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    use std::task::Poll;
    let mut running: Vec<_> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut out: Vec<Option<F::Output>> = running.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, o) in running.iter_mut().zip(out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => {
                        *o = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("every future ended"))
        .collect()
}

/// A class's claim as [`use_class`] leaves it: mounted, grown, its
/// snapshot kept or not.
struct Used {
    class: String,
    claim: Claim,
    m: Mounted,
    vsc: String,
    snap: String,
    snapshot_kept: bool,
    line: String,
    lap: Laps,
}

/// A class's claim made, mounted, written, snapshotted and restored,
/// grouped, modified and grown (see [`every_class`]).
async fn use_class(c: &Cluster, class: &str) -> Used {
    const MIB: i64 = 1 << 20;
    let class = class.to_string();
    let sc = c.class(&class).clone();
    let backend = s(&sc["parameters"]["backend"]).to_string();
    let vac_name = format!("ferrovol-{backend}-example");
    let vac =
        c.r.has("VolumeAttributesClass", &vac_name)
            .then_some(vac_name.as_str());
    let vsc = format!("ferrovol-{backend}");
    let mut lap = Laps::new(&class);
    let claim = c
        .provision(&class, 64 * MIB, vac, None)
        .await
        .unwrap_or_else(|e| panic!("{}: CreateVolume in {class}: {e}", c.r.name));
    lap.lap("provision");
    let m = c.mount(&claim).await;
    lap.lap("mount");
    write_and_read(&m, "first", &format!("{class} before its snapshot"));
    let snap = c.snapshot(&claim, &vsc).await;
    lap.lap("snapshot");
    write_and_read(&m, "second", "after the snapshot");
    // The restore in the backend's first I/O limit tier, where it has
    // them (every block backend): its pod gets the tier's limits.
    let bronze = format!("ferrovol-{backend}-bronze");
    let bronze = c.r.has("VolumeAttributesClass", &bronze).then_some(bronze);
    let restored = c
        .provision(
            &class,
            64 * MIB,
            bronze.as_deref(),
            Some(snapshot_source(&snap)),
        )
        .await
        .unwrap_or_else(|e| panic!("{}: restore in {class}: {e}", c.r.name));
    lap.lap("restore");
    let rm = c.mount(&restored).await;
    lap.lap("mount");
    if let Some(bronze) = &bronze {
        let want = c.tier_line(bronze);
        assert!(
            c.io_max(&rm).ends_with(&want),
            "{class}: the pod's io.max is {:?}, not ...{want}",
            c.io_max(&rm)
        );
    }
    assert_eq!(read(&rm, "first"), format!("{class} before its snapshot"));
    assert!(
        !rm.target.join("second").exists(),
        "{class}: the restore is of the snapshot's instant"
    );
    c.unmount(&rm).await;
    lap.lap("unmount");
    c.delete(&restored).await;
    lap.lap("delete");
    let mut line = format!("{class}: made, mounted, snapshot restored");
    if c.r.has("VolumeGroupSnapshotClass", &vsc) {
        let other = c.provision(&class, 64 * MIB, None, None).await.unwrap();
        let om = c.mount(&other).await;
        write_and_read(&om, "g", "the other member");
        let (group, members) = c.group_snapshot(&[&claim, &other], &vsc).await;
        for (member, (m, file)) in members.iter().zip([(&m, "first"), (&om, "g")]) {
            let copy = c
                .provision(&class, 64 * MIB, None, Some(snapshot_source(member)))
                .await
                .unwrap_or_else(|e| panic!("{class}: restore of a group member: {e}"));
            let cm = c.mount(&copy).await;
            assert_eq!(read(&cm, file), read(m, file));
            c.unmount(&cm).await;
            c.delete(&copy).await;
        }
        c.delete_group_snapshot(&claim.driver, &vsc, &group, &members)
            .await;
        c.unmount(&om).await;
        c.delete(&other).await;
        lap.lap("group snapshot");
        line += ", group snapshot restored";
    }
    if let Some(vac) = vac {
        let modified = c.modify(&claim, vac).await;
        lap.lap("modify");
        match modified {
            Ok(()) => {
                assert_eq!(
                    claim.driver, REMOTE,
                    "{class}: a node-local volume was modified centrally"
                );
                line += ", modified";
            }
            Err(e) => {
                assert_eq!(claim.driver, LOCAL, "{class}: ControllerModifyVolume: {e}");
                assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
                line += ", modify refused (node-local)";
            }
        }
    }
    // Moved to the backend's top I/O limit tier: the pod using it gets
    // the tier's limits within the node plugin's refresh (a remote
    // volume's node asks the controller; a node-local volume's takes the
    // change the central controller offers, which answers once it did).
    let gold = format!("ferrovol-{backend}-gold");
    if c.r.has("VolumeAttributesClass", &gold) {
        c.modify(&claim, &gold)
            .await
            .unwrap_or_else(|e| panic!("{class}: to {gold}: {e}"));
        let want = c.tier_line(&gold);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !c.io_max(&m).ends_with(&want) {
            assert!(
                std::time::Instant::now() < until,
                "{class}: the pod's io.max is {:?}, not ...{want}",
                c.io_max(&m)
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        line += ", moved to its gold tier (the pod's limits changed)";
        lap.lap("tier");
    }
    // An nfs volume of an export without quotas (the shipped exports
    // set none) shows the export's size: its capacity is a record, not
    // a limit (docs/backends/nfs.md).
    let enforced = backend != "nfs";
    let grew = |before: u64, after: u64| {
        assert!(after > before || !enforced, "{class}: {before} -> {after}");
    };
    let before = fs_bytes(&m);
    let bigger = claim.bytes + 64 * MIB;
    let mut snapshot_kept = true;
    let mut grown = c.expand(&m, bigger).await;
    if let Err(e) = &grown {
        if e.code() == tonic::Code::FailedPrecondition && e.message().contains("has snapshots") {
            // A thick LV with snapshots grows only once they are gone.
            c.delete_snapshot(&claim.driver, &vsc, &snap).await;
            snapshot_kept = false;
            line += ", grown once its snapshot was deleted";
            grown = c.expand(&m, bigger).await;
        }
    }
    let m = match grown {
        Ok(after) => {
            grew(before, after);
            line += ", grown online";
            m
        }
        Err(e) if e.code() == tonic::Code::FailedPrecondition => {
            // Offline expansion (iscsi): the resizer retries once the
            // pod is gone; the filesystem grows at the next stage.
            c.unmount(&m).await;
            let node = c
                .controller_expand(&claim, bigger)
                .await
                .unwrap_or_else(|e| panic!("{class}: expansion once unmounted: {e}"));
            // The kubelet's NodeExpandVolume follows the next stage.
            let grown = c.mount(&claim).await;
            if node {
                if let Err(e) = c.node_expand(&grown, bigger).await {
                    let out = std::process::Command::new("sh")
                        .args(["-c", "lvs -a -o lv_name,lv_size,lv_attr,origin; dmsetup table; dmsetup info -c; lsblk -b -o NAME,SIZE,TYPE; dmesg | tail -30"])
                        .output()
                        .unwrap();
                    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
                    panic!("{class}: NodeExpandVolume after the stage: {e}");
                }
            }
            grew(before, fs_bytes(&grown));
            line += ", grown offline";
            grown
        }
        Err(e) => panic!("{class}: expansion: {e}"),
    };
    lap.lap("expand");
    Used {
        class,
        claim,
        m,
        vsc,
        snap,
        snapshot_kept,
        line,
        lap,
    }
}

/// A class's claim after the roll: staged and published again by the new
/// pods (both idempotent), read, mounted by a new pod, read, deleted.
async fn use_again(c: &Cluster, u: Used) -> String {
    let Used {
        class,
        claim,
        m,
        vsc,
        snap,
        snapshot_kept,
        mut line,
        mut lap,
    } = u;
    lap.restart();
    c.stage_and_publish(&m).await;
    lap.lap("staged again");
    assert_eq!(read(&m, "second"), "after the snapshot");
    c.unmount(&m).await;
    let again = c.mount(&claim).await;
    assert_eq!(
        read(&again, "first"),
        format!("{class} before its snapshot")
    );
    c.unmount(&again).await;
    if snapshot_kept {
        c.delete_snapshot(&claim.driver, &vsc, &snap).await;
    }
    c.delete(&claim).await;
    lap.lap("remount, unmount, delete");
    line += ", used again after every pod was replaced, deleted";
    line
}

/// `text` with every line that sets `key` (`key = ...`, in any table)
/// setting it to `value` instead; `None` removes those lines.
pub fn set_key(text: &str, key: &str, value: Option<&str>) -> String {
    let mut out = Vec::new();
    for l in text.lines() {
        let sets = l
            .trim_start()
            .strip_prefix(key)
            .is_some_and(|rest| rest.trim_start().starts_with('='));
        match (sets, value) {
            (true, Some(v)) => out.push(format!("{key} = {v}")),
            (true, None) => {}
            (false, _) => out.push(l.to_string()),
        }
    }
    out.join("\n") + "\n"
}

/// `text` with `key` set to `value` in the `[[table]]` whose `name` is
/// `name` only.
pub fn set_in(text: &str, table: &str, name: &str, key: &str, value: &str) -> String {
    let header = format!("[[{table}]]");
    let mut parts: Vec<String> = text.split(&header).map(str::to_string).collect();
    for p in parts.iter_mut().skip(1) {
        let named = p.lines().any(|l| {
            l.trim_start().strip_prefix("name").is_some_and(|r| {
                r.trim_start().trim_start_matches('=').trim() == format!("\"{name}\"")
            })
        });
        if named {
            *p = set_key(p, key, Some(value));
        }
    }
    parts.join(&header)
}

/// The overlay's first StorageClass, one claim: made, mounted, written and
/// read back, unmounted and deleted (an overlay whose every class
/// `every_class` runs in the `all` overlay: here, that the overlay's own
/// pods and config serve its backend). Answers the class.
pub async fn one_claim(c: &mut Cluster) -> String {
    let class = s(&c.r.kind("StorageClass")[0]["metadata"]["name"]).to_string();
    let claim = c
        .provision(&class, 64 << 20, None, None)
        .await
        .unwrap_or_else(|e| panic!("{}: CreateVolume in {class}: {e}", c.r.name));
    let m = c.mount(&claim).await;
    write_and_read(&m, "f", &class);
    c.unmount(&m).await;
    c.delete(&claim).await;
    assert!(
        c.kubelet_mounts().is_empty(),
        "{class}: {:?}",
        c.kubelet_mounts()
    );
    class
}
