//! The shipped overlays as a one-node cluster runs them (the manifests
//! are the fixture: `common::cluster`). The `all` overlay: every
//! StorageClass, snapshot class, group class and attributes class it
//! ships (every backend's), through a claim's whole life with the calls
//! shaped by the rendered sidecars' flags, the pods replaced with the
//! claim mounted and the claim used again. Each backend's own overlay:
//! its pods, as rendered, serve a claim. In the guest: the remote
//! backends' kernel modules, and online growth of ext4, which the host's
//! root cannot do.

use super::common::cluster::{every_class, one_claim, set_in, set_key, Cluster, Edit, SecretEdit};
use super::common::deployed::{render, render_chart};
use super::*;

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_deployed_file_overlay_serves_a_claim() {
    require_guest();
    run_one("file", |t| t, |_, s| s).await;
}

/// One claim of `overlay`'s first class (its every class runs in the
/// `all` overlay's test).
pub(crate) async fn run_one(
    overlay: &'static str,
    edit: impl Fn(String) -> String + 'static,
    secrets: impl Fn(&str, HashMap<String, String>) -> HashMap<String, String> + 'static,
) {
    let mut c = Cluster::start(render(overlay), Box::new(edit), Box::new(secrets)).await;
    println!("{overlay}: a claim of {} served", one_claim(&mut c).await);
    drop(c);
    nothing_left(overlay);
}

/// What the claims made is gone with them: no hold device, LV device
/// (of the groups the manifests name: another test's may be active beside
/// this one, see tests/guest/lanes), or iSCSI session is left for the
/// next test to find.
pub(crate) fn nothing_left(overlay: &str) {
    let maps = run("dmsetup", &["ls"]);
    let ours: Vec<&str> = maps
        .lines()
        .filter(|l| {
            l.starts_with("fvh-")
                || ["ferrovol--ssd-", "vg--iscsi-", "vg--nvmf-"]
                    .iter()
                    .any(|vg| l.starts_with(vg) && l.contains("fv--"))
        })
        .collect();
    assert!(ours.is_empty(), "{overlay}: devices left: {ours:?}");
    let sessions = Iscsid::sessions();
    assert!(
        !sessions
            .iter()
            .any(|s| s.contains("iqn.2026-11.io.ferrovol:")),
        "{overlay}: sessions left: {sessions:?}"
    );
    // No NVMe controller of the manifests' subsystems.
    let controllers: Vec<String> = std::fs::read_dir("/sys/class/nvme")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("subsysnqn")).ok())
        .filter(|n| n.starts_with("nqn.2026-12.io.ferrovol:"))
        .collect();
    assert!(
        controllers.is_empty(),
        "{overlay}: NVMe controllers left: {controllers:?}"
    );
}

/// Runs every class of `overlay` and prints what was done.
pub(crate) async fn run_overlay(
    overlay: &'static str,
    edit: impl Fn(String) -> String + 'static,
    secrets: impl Fn(&str, HashMap<String, String>) -> HashMap<String, String> + 'static,
) {
    let mut c = Cluster::start(render(overlay), Box::new(edit), Box::new(secrets)).await;
    let done = every_class(&mut c).await;
    assert_eq!(done.len(), c.r.kind("StorageClass").len());
    for line in done {
        println!("{line}");
    }
    drop(c);
    nothing_left(overlay);
}

/// Both exports on one server of the test's (NFSv4.2 at its root,
/// NFSv3 at its path): only the servers' addresses are edited.
pub(crate) fn nfs_edit(server: &NfsServer) -> impl Fn(String) -> String {
    let export = format!("\"{}\"", server.export.display());
    move |t| {
        let t = set_key(&t, "server", Some("\"127.0.0.1\""));
        let t = set_in(&t, "backend.export", "main", "share", "\"/\"");
        set_in(&t, "backend.export", "archive", "share", &export)
    }
}

/// A tgtd of the test's on loopback: portals and the control port are
/// edited; the node logs in with the guest's own initiator name.
pub(crate) fn iscsi_edit(t: &Tgtd) -> impl Fn(String) -> String {
    let portal = format!("[\"{}\"]", t.portal());
    let control = t.control_port.to_string();
    move |text| {
        if !text.contains("type = \"iscsi\"") {
            return text;
        }
        let text = set_key(&text, "portals", Some(&portal));
        let text = set_key(&text, "control_port", Some(&control));
        set_key(&text, "initiator_name_file", None)
    }
}

/// An nvmet port of the test's on loopback: the portal and the port's id
/// are edited; the node connects as the fixture's host (its NQN and ID
/// files).
pub(crate) fn nvmf_edit(n: &NvmetPort) -> impl Fn(String) -> String {
    let portal = format!("[\"{}\"]", n.portal());
    let id = n.id;
    let (nqn, hostid) = n.host_files();
    move |text| {
        if !text.contains("type = \"nvmf\"") {
            return text;
        }
        let text = set_key(&text, "portals", Some(&portal));
        let text = set_key(&text, "host_nqn_file", None);
        let text = set_key(&text, "host_id_file", None);
        text.replacen(
            "type = \"nvmf\"\n",
            &format!(
                "type = \"nvmf\"\nfirst_port_id = {id}\nhost_nqn_file = \"{}\"\nhost_id_file = \"{}\"\n",
                nqn.display(),
                hostid.display()
            ),
            1,
        )
    }
}

/// The shared Ceph cluster, with the pools the shipped class and config
/// name, its user allowed on them: the monitors, the user and its
/// keyring are edited; the Secret's user and key are the cluster's.
pub(crate) fn rbd_edit() -> (Edit, SecretEdit) {
    let cluster = CephCluster::shared();
    for pool in ["kubernetes", "kubernetes-ssd"] {
        if !cluster
            .ceph(&["osd", "pool", "ls"])
            .lines()
            .any(|l| l == pool)
        {
            cluster.ceph(&["osd", "pool", "create", pool, "8"]);
            cluster.rbd(&["pool", "init", pool]);
        }
    }
    cluster.ceph(&[
        "auth",
        "caps",
        "client.ferrovol",
        "mon",
        "profile rbd",
        "osd",
        "profile rbd pool=rbd, profile rbd pool=kubernetes, profile rbd pool=kubernetes-ssd",
    ]);
    let monitors = format!("[\"v1:{}\"]", cluster.mon_addr);
    let keyring = std::fs::read_to_string(&cluster.client_keyring).unwrap();
    let secrets = cluster.secrets();
    (
        Box::new(move |t: String| {
            let t = set_key(&t, "monitors", Some(&monitors));
            set_key(&t, "user", Some("\"ferrovol\""))
        }),
        // The CSI secrets, and the controller's own keyring (its Secret,
        // which the pod mounts where the config names it).
        Box::new(move |name: &str, s| match name {
            "ferrovol-rbd" => secrets.clone(),
            "ferrovol-rbd-keyring" => HashMap::from([("keyring".to_string(), keyring.clone())]),
            _ => s,
        }),
    )
}

/// The volume groups the lvm, iscsi and nvmf components name, as they
/// name them.
pub(crate) fn lvm_groups() -> Vec<LvmVg> {
    let ssd = LvmVg::new("ferrovol-ssd", 1024);
    ssd.thin_pool("thinpool", "400M", &[]);
    let luns = LvmVg::new("vg-iscsi", 1024);
    luns.thin_pool("pool0", "600M", &[]);
    let namespaces = LvmVg::new("vg-nvmf", 1024);
    namespaces.thin_pool("pool0", "600M", &[]);
    vec![ssd, luns, namespaces]
}

/// lvm's groups as the manifests name them (thick and thin): no
/// config edited.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_deployed_lvm_overlay_serves_a_claim() {
    require_guest();
    let _groups = lvm_groups();
    run_one("lvm", |t| t, |_, s| s).await;
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_deployed_nfs_overlay_serves_a_claim() {
    require_guest();
    let server = NfsServer::with_v3();
    run_one("nfs", nfs_edit(&server), |_, s| s).await;
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_deployed_iscsi_overlay_serves_a_claim() {
    require_guest();
    let _groups = lvm_groups();
    let t = Tgtd::new();
    let _iscsid = Iscsid::new();
    run_one("iscsi", iscsi_edit(&t), |_, s| s).await;
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_deployed_nvmf_overlay_serves_a_claim() {
    require_guest();
    let _groups = lvm_groups();
    let n = NvmetPort::new("nqn.2026-12.io.ferrovol");
    run_one("nvmf", nvmf_edit(&n), |_, s| s).await;
}

#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_deployed_rbd_overlay_serves_a_claim() {
    require_guest();
    let (edit, secrets) = rbd_edit();
    run_one("rbd", edit, secrets).await;
}

/// The Helm chart with its default values (the file backend on the
/// node-local driver), rendered with Helm's library: every class it
/// ships, as for the overlays. (Each overlay's choices render the same
/// objects as the overlay: tests/deploy/chart.rs.)
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_deployed_chart_defaults_run_every_class_they_ship() {
    require_guest();
    let r = render_chart("chart-defaults", "file", &serde_json::json!({}));
    let mut c = Cluster::start(r, Box::new(|t| t), Box::new(|_, s| s)).await;
    let done = every_class(&mut c).await;
    assert_eq!(done.len(), c.r.kind("StorageClass").len());
    assert!(!done.is_empty());
    for line in done {
        println!("{line}");
    }
    drop(c);
    nothing_left("chart-defaults");
}

/// Every backend at once, both drivers side by side on the node.
#[tokio::test]
#[ignore = "needs the real-kernel guest: run tests/guest/suite"]
async fn guest_deployed_all_overlay_runs_every_class_it_ships() {
    require_guest();
    let _groups = lvm_groups();
    let server = NfsServer::with_v3();
    let t = Tgtd::new();
    let _iscsid = Iscsid::new();
    let n = NvmetPort::new("nqn.2026-12.io.ferrovol");
    let nfs = nfs_edit(&server);
    let iscsi = iscsi_edit(&t);
    let nvmf = nvmf_edit(&n);
    let (rbd, secrets) = rbd_edit();
    run_overlay("all", move |text| nvmf(rbd(iscsi(nfs(text)))), secrets).await;
}
