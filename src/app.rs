//! Building the driver from settings: config, registry, node state.

use crate::backend::build_registry;
use crate::config::Config;
use crate::controller::ControllerOps;
use crate::error::{Error, Result};
use crate::exec::{CommandRunner, SystemRunner};
use crate::host::{Host, SystemHost};
use crate::locks::OpLocks;
use crate::mount::{Mounter, SystemMounter};
use crate::node::{Deadlines, NodeOps};
use crate::plugin::Registry;
use crate::service::{Driver, Mode};
use crate::state::NodeState;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What `ferrovol serve` needs besides the endpoint.
#[derive(Debug, Clone)]
pub struct Settings {
    pub driver_name: String,
    pub node_id: String,
    pub mode: Mode,
    pub state_dir: PathBuf,
    pub config: Option<PathBuf>,
    /// An upper bound on every external command's timeout.
    pub command_timeout: Option<std::time::Duration>,
    /// Record metrics (they are served on `--metrics-addr`).
    pub metrics: bool,
    /// Offer ControllerExpandVolume (off: nodes grow node-local volumes).
    pub controller_expansion: bool,
    /// The central controller of a node-local driver: no volume is here.
    pub volumes_on_nodes: bool,
    /// Advertise CSI v1.13's volume health capabilities.
    pub volume_health: bool,
}

/// Checks a driver name: DNS-style, at most 63 characters.
pub fn validate_driver_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !ok {
        return Err(Error::invalid(format!(
            "driver name {name:?} must be DNS-style and at most 63 characters"
        )));
    }
    Ok(())
}

/// Builds the driver on the real system seams and reconciles node state.
pub fn build(settings: &Settings) -> Result<Arc<Driver>> {
    let runner = SystemRunner {
        max_timeout: settings.command_timeout,
    };
    build_with(settings, Arc::new(runner), Arc::new(SystemMounter))
}

/// Metrics, when asked for, and the runner that times commands for them.
fn metered(
    settings: &Settings,
    runner: Arc<dyn CommandRunner>,
) -> (Arc<dyn CommandRunner>, Option<Arc<crate::metrics::Metrics>>) {
    if !settings.metrics {
        return (runner, None);
    }
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let runner = Arc::new(crate::metrics::MeteredRunner {
        inner: runner,
        metrics: metrics.clone(),
    });
    (runner, Some(metrics))
}

/// Builds the driver on the given seams.
pub fn build_with(
    settings: &Settings,
    runner: Arc<dyn CommandRunner>,
    mounter: Arc<dyn Mounter>,
) -> Result<Arc<Driver>> {
    validate_driver_name(&settings.driver_name)?;
    let (runner, metrics) = metered(settings, runner);
    if settings.node_id.is_empty() || settings.node_id.len() > 128 {
        return Err(Error::invalid("node id must be 1 to 128 bytes"));
    }
    let state_dir = absolute(&settings.state_dir)?;
    crate::records::private_dir(&state_dir)?;
    // Before anything reads it: a directory a newer version wrote is
    // refused whole.
    crate::format::adopt(&state_dir)?;
    let config = Config::load(settings.config.as_deref(), || {
        crate::backend::built_in(&state_dir)
    })?;
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| Error::io("read /proc/self/mountinfo", e))?;
        kept_on_volumes(&kept_paths(&config, &state_dir), &mounts)?;
    }
    let host: Arc<dyn Host> = Arc::new(SystemHost);
    for p in &config.node.allowed_paths {
        crate::config::absolute(p, "node.allowed_paths entry")?;
    }
    crate::config::absolute(&config.node.cgroup_root, "node.cgroup_root")?;
    let kdf = config.node.kdf()?;
    let registry = Arc::new(build_registry(
        &config,
        runner.clone(),
        host.clone(),
        mounter.clone(),
        &state_dir,
    )?);
    let (node_id, lacking) = full_node_id(settings, &registry)?;
    let state = NodeState::open(&state_dir)?;
    let intents = Arc::new(crate::intents::Intents::open(&state_dir)?);
    // One guard table for both services: an operation on a volume excludes
    // every other operation on it, whichever service it came through.
    let locks = OpLocks::new();
    // The changes to volumes' I/O limits: a controller's (the central
    // controller of node-local volumes makes none), which its node in the
    // same process reads; a node alone keeps what its controller says.
    let limit_book = match settings.mode.controller() {
        true if settings.volumes_on_nodes => None,
        true => Some(state_dir.join("controller")),
        false => Some(state_dir.join("limits")),
    }
    .map(|dir| crate::plugin::LimitBook::open(&dir).map(Arc::new))
    .transpose()?;
    let limits_from = config
        .node
        .limits_from
        .as_deref()
        .map(crate::node::limits_authority)
        .transpose()?;
    let mut node = NodeOps::new(
        registry.clone(),
        mounter,
        runner,
        state,
        locks.clone(),
        host,
    )
    .with_deadlines(Deadlines::default().capped(settings.command_timeout))
    .with_allowed_paths(config.node.allowed_paths.clone())
    .with_kdf(kdf)
    .with_cgroups(crate::host::iolimit::Cgroups::new(
        config.node.cgroup_root.clone(),
    ))
    // The holder is this binary, as the kernel has it even if its
    // file was replaced meanwhile (an upgrade).
    .with_freezer(crate::host::freeze::Freezer::new(
        PathBuf::from("/proc/self/exe"),
        intents.clone(),
    ));
    if let Some(book) = &limit_book {
        node = node.with_limit_book(book.clone());
    }
    // A node alone mirrors its controller's changes; a node that is its
    // own controller (the node-local driver's) takes what the central
    // controller offers for its volumes. The central controller asks no
    // one.
    if let (Some(from), true) = (
        &limits_from,
        settings.mode.node() && !settings.volumes_on_nodes,
    ) {
        node = node.with_limits_from(from.clone(), !settings.mode.controller());
    }
    let node = Arc::new(node);
    let mut controller =
        ControllerOps::new(registry.clone(), locks, &node_id, &config.node.topology_key);
    if settings.mode.controller() {
        let ledger = crate::plugin::Ledger::open(&state_dir.join("controller"))?;
        let groups = crate::plugin::GroupStore::open(&state_dir.join("controller/groups"))?;
        // The node freezes what it stages; a controller alone has nothing
        // staged here to freeze.
        let quiesce = settings
            .mode
            .node()
            .then(|| node.clone() as Arc<dyn crate::plugin::Quiesce>);
        controller = controller.with_ledger(ledger).with_groups(groups, quiesce);
    }
    if settings.mode.controller() && settings.volumes_on_nodes {
        controller = controller.with_relay(Arc::new(crate::plugin::Relay::default()));
    }
    if let (Some(book), true) = (limit_book, settings.mode.controller()) {
        let here = settings
            .mode
            .node()
            .then(|| node.clone() as Arc<dyn crate::plugin::Relimit>);
        controller = controller.with_limits(book, here);
    }
    if settings.mode.node() {
        // What a dead driver left half done comes first: a filesystem it
        // froze takes no writes until this thaws it.
        let recovered = node.recover(&intents)?;
        if recovered > 0 {
            tracing::warn!(
                intents = recovered,
                "a previous run's intents finished or undone"
            );
        }
        let limited = node.restore_limits();
        if limited > 0 {
            tracing::info!(publishes = limited, "the pods' I/O limits written again");
        }
        let (dropped, unmounted) = node.reconcile()?;
        tracing::info!(
            staged = node.state().stages().len(),
            published = node.state().publishes().len(),
            stale_publishes_dropped = dropped,
            staged_without_mount = unmounted,
            "node state reconciled with the mount table"
        );
    }
    Ok(Arc::new(Driver {
        name: settings.driver_name.clone(),
        version: crate::service::version(),
        node_id,
        mode: settings.mode,
        settings: config.node.clone(),
        registry,
        node,
        controller,
        in_flight: Default::default(),
        metrics,
        serving: Default::default(),
        controller_expansion: settings.controller_expansion,
        volumes_on_nodes: settings.volumes_on_nodes,
        volume_health: settings.volume_health,
        lacking,
        unavailable: Default::default(),
    }))
}

/// The node id this driver reports. A node tells controllers what its
/// backends need to know of it (an initiator name, that it maps images of a
/// kind) in its node id: `<name>/<token>,<token>`. A backend that cannot
/// say (this node lacks what it needs: no initiator name) is left out of
/// it, and answered with why: the node serves its other backends, and no
/// controller publishes that backend's volumes to it.
fn full_node_id(
    settings: &Settings,
    registry: &Registry,
) -> Result<(String, BTreeMap<String, String>)> {
    let node_id = settings.node_id.clone();
    if node_id.contains('/') {
        return Err(Error::invalid("node id must not contain '/'"));
    }
    let mut lacking = BTreeMap::new();
    if !settings.mode.node() {
        return Ok((node_id, lacking));
    }
    let mut tokens: Vec<String> = Vec::new();
    for b in registry.all() {
        let token = match b.attacher().map_or(Ok(None), |a| a.node_id_suffix()) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(backend = %b.name(), error = %e.message, "this node lacks what the backend needs; it serves the others");
                lacking.insert(b.name().to_string(), e.message);
                continue;
            }
        };
        if let Some(t) = token {
            if t.is_empty() || t.contains([',', '/']) {
                return Err(Error::invalid(format!(
                    "backend {}: node id token {t:?} is empty or has ',' or '/'",
                    b.name()
                )));
            }
            if !tokens.contains(&t) {
                tokens.push(t);
            }
        }
    }
    crate::backend::node_tokens_agree(&tokens)?;
    let full = match tokens.is_empty() {
        true => node_id,
        false => format!("{node_id}/{}", tokens.join(",")),
    };
    if full.len() > 256 {
        return Err(Error::invalid(
            "node id with its backends' tokens is over 256 bytes",
        ));
    }
    Ok((full, lacking))
}

/// What the driver keeps across its own restarts, by what it is: the
/// state directory and every pool of image files (a `file` backend's, an
/// iSCSI store's).
fn kept_paths(config: &Config, state_dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out = vec![("state directory".to_string(), state_dir.to_path_buf())];
    for b in &config.backends {
        let pools = [
            b.settings.get("pool"),
            b.settings
                .get("store")
                .and_then(|s| s.as_table())
                .and_then(|s| s.get("pool")),
        ];
        for pool in pools.into_iter().flatten().filter_map(|p| p.as_str()) {
            out.push((format!("backend {}'s pool", b.name()), PathBuf::from(pool)));
        }
    }
    out
}

/// In a container (a Kubernetes pod: the kubelet sets
/// KUBERNETES_SERVICE_HOST in every one), refuses to keep anything on the
/// container's own root filesystem: it is the image's writable layer, and
/// every volume, record and snapshot there would be gone with the
/// container at its next restart. Each path must be at or below a mounted
/// volume (`mountinfo`: the process's mount table). The error names the
/// path that needs one.
fn kept_on_volumes(kept: &[(String, PathBuf)], mountinfo: &str) -> Result<()> {
    let mounts = crate::mount::parse_mountinfo(mountinfo);
    for (what, path) in kept {
        let on = mounts
            .iter()
            .filter(|m| path.starts_with(&m.mount_point))
            .max_by_key(|m| m.mount_point.components().count());
        if on.is_none_or(|m| m.mount_point == Path::new("/")) {
            return Err(Error::invalid(format!(
                "{what} {} is on the container's own root filesystem, lost whenever the \
                 container is replaced: mount a volume (a hostPath) at it or at a folder \
                 above it, or move it below one the pod mounts (the manifests mount the \
                 node's state directory, /var/lib/ferrovol/local or /var/lib/ferrovol/remote)",
                path.display()
            )));
        }
    }
    Ok(())
}

fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        std::env::current_dir()
            .map(|d| d.join(p))
            .map_err(|e| Error::io("current dir", e))
    }
}

/// A node that asks its controller for the changes to its volumes' I/O
/// limits asks every `limits_refresh_seconds` from now on.
pub fn start_limit_refresh(driver: &Arc<Driver>) {
    let Some(from) = driver.node.limits_from().map(str::to_string) else {
        return;
    };
    let every = std::time::Duration::from_secs(driver.settings.limits_refresh_seconds.max(1));
    let node = driver.node.clone();
    tracing::info!(controller = %from, every = ?every, "asking the controller for I/O limit changes");
    tokio::spawn(async move {
        let mut failing = false;
        loop {
            match node.refresh_limits(&from).await {
                Ok(changed) => {
                    if changed > 0 || failing {
                        tracing::info!(
                            volumes = changed,
                            "I/O limit changes taken from the controller"
                        );
                    }
                    failing = false;
                }
                // Said once until it answers again.
                Err(e) if !failing => {
                    tracing::warn!(error = %e.message, "the volumes keep the I/O limits they have");
                    failing = true;
                }
                Err(_) => {}
            }
            tokio::time::sleep(every).await;
        }
    });
}

/// Lets every backend clear what an earlier run left for itself, before
/// the driver serves.
pub async fn start_backends(driver: &Driver) -> Result<()> {
    for b in driver.registry.all() {
        b.start().await?;
    }
    // Grants the backends keep that the ledger lacks (a controller in a
    // new pod) or holds but the backends no longer do.
    driver.controller.settle_ledger().await;
    // A group snapshot a dead run was taking: undone (its members were
    // made by the backends just started).
    let settled = driver.controller.settle_groups().await;
    if settled > 0 {
        tracing::warn!(groups = settled, "unfinished group snapshots undone");
    }
    Ok(())
}

/// Lets every backend release what it holds for itself, after the driver
/// stopped serving.
pub async fn stop_backends(driver: &Driver) {
    for b in driver.registry.all() {
        b.stop().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod's mount table: the image's overlay at `/`, the node's state
    /// directory (a hostPath) and the config (a ConfigMap) mounted in it.
    const POD: &str = "\
1 0 0:50 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
2 1 0:5 / /proc rw - proc proc rw
3 1 8:1 /var/lib/ferrovol/local /var/lib/ferrovol/local rw - ext4 /dev/sda1 rw
4 1 8:1 /var/lib/kubelet/pods/x/volumes/cm /etc/ferrovol/config.d ro - ext4 /dev/sda1 rw
";

    fn kept(config: &str) -> Vec<(String, PathBuf)> {
        kept_paths(
            &Config::parse(config).unwrap(),
            Path::new("/var/lib/ferrovol/local"),
        )
    }

    #[test]
    fn a_pool_on_the_containers_root_is_refused_naming_it() {
        let ok = kept("[[backend]]\ntype = \"file\"\npool = \"/var/lib/ferrovol/local/pool\"\n");
        assert_eq!(ok.len(), 2);
        kept_on_volumes(&ok, POD).unwrap();
        // The documented host default, inside a pod that mounts only
        // /var/lib/ferrovol/local.
        let lost = kept("[[backend]]\ntype = \"file\"\npool = \"/var/lib/ferrovol/pool\"\n");
        let e = kept_on_volumes(&lost, POD).unwrap_err();
        assert_eq!(e.kind, crate::error::Kind::InvalidArgument);
        assert!(
            e.message.contains("backend file's pool /var/lib/ferrovol/pool is on the container's own root filesystem"),
            "{}",
            e.message
        );
        // A prefix of a mount point's name is not below it.
        let near = kept("[[backend]]\ntype = \"file\"\npool = \"/var/lib/ferrovol/local2/pool\"\n");
        assert!(kept_on_volumes(&near, POD).is_err());
        // An iSCSI store's file pool counts too.
        let store = kept(
            "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"iqn.2026-11.x\"\nportals = [\"127.0.0.1:3260\"]\n\
             [backend.store]\ntype = \"file\"\npool = \"/luns\"\n",
        );
        let e = kept_on_volumes(&store, POD).unwrap_err();
        assert!(
            e.message.contains("backend iscsi's pool /luns"),
            "{}",
            e.message
        );
        // The state directory itself.
        let state = vec![(
            "state directory".to_string(),
            PathBuf::from("/var/lib/ferrovol"),
        )];
        assert!(kept_on_volumes(&state, POD).is_err());
    }
}
