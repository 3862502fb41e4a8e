//! The CSI services: thin adapters that validate a request, take the
//! operation guard, delegate to the plugin layer or the node machinery, and
//! build the response. Errors become gRPC codes only in `crate::error`.

pub mod controller;
pub mod convert;
pub mod group;
pub mod identity;
pub mod metadata;
pub mod node;
pub mod trace;

use crate::config::NodeSettings;
use crate::controller::ControllerOps;
use crate::error::Result;
use crate::node::NodeOps;
use crate::plugin::Registry;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

/// Which services this process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Controller,
    Node,
    All,
}

impl Mode {
    pub fn controller(self) -> bool {
        matches!(self, Mode::Controller | Mode::All)
    }
    pub fn node(self) -> bool {
        matches!(self, Mode::Node | Mode::All)
    }
}

/// Counts the RPCs being served, so a shutdown can wait for exactly those
/// (idle client connections do not hold it up).
#[derive(Debug, Default)]
pub struct InFlight {
    count: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

/// One RPC being served; counted until dropped.
pub struct InFlightGuard(Arc<InFlight>);

impl InFlight {
    pub fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlightGuard(self.clone())
    }

    pub fn count(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Resolves once no RPC is being served.
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.count() == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self
            .0
            .count
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            == 1
        {
            self.0.idle.notify_waiters();
        }
    }
}

/// What the services share.
pub struct Driver {
    pub name: String,
    pub version: String,
    pub node_id: String,
    pub mode: Mode,
    pub settings: NodeSettings,
    pub registry: Arc<Registry>,
    pub node: Arc<NodeOps>,
    pub controller: ControllerOps,
    /// RPCs being served right now.
    pub in_flight: Arc<InFlight>,
    /// Recorded when `--metrics-addr` is set.
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
    /// Set once the endpoint accepts calls (`/readyz`).
    pub serving: std::sync::atomic::AtomicBool,
    /// Whether ControllerExpandVolume is offered; without it the resizer
    /// leaves expansion to NodeExpandVolume.
    pub controller_expansion: bool,
    /// The central controller of a node-local driver (`--volumes-on-nodes`):
    /// the volumes are on the nodes, and ModifyVolume cannot reach them.
    pub volumes_on_nodes: bool,
    /// Whether CSI v1.13's volume health capabilities are advertised (the
    /// calls are answered either way).
    pub volume_health: bool,
    /// Backends this node lacks what they need for, found at start (an
    /// iSCSI initiator name): unavailable until the driver restarts.
    pub lacking: std::collections::BTreeMap<String, String>,
    /// Backends whose last health check failed, with why.
    pub unavailable: std::sync::Mutex<std::collections::BTreeMap<String, String>>,
}

impl Driver {
    /// Checks every backend's prerequisites (its health), and answers
    /// each backend's name with why it is unavailable on this node, if it
    /// is. A backend that becomes unavailable, or available again, is
    /// logged once, at the change. What a node lacks for one backend does
    /// not stop the others: the driver serves them, and says which are
    /// out in `/readyz` and `ferrovol_backend_available`.
    pub async fn backends(&self) -> Vec<(String, Option<String>)> {
        let mut out = Vec::new();
        for b in self.registry.all() {
            let why = match self.lacking.get(b.name()) {
                Some(why) => Some(why.clone()),
                None => b.health().await.err().map(|e| e.message),
            };
            out.push((b.name().to_string(), why));
        }
        use crate::sync::LockExt;
        let mut unavailable = self.unavailable.locked();
        for (name, why) in &out {
            match why {
                Some(why) if unavailable.get(name) != Some(why) => {
                    tracing::warn!(backend = %name, reason = %why, "backend unavailable on this node; the others are served");
                    unavailable.insert(name.clone(), why.clone());
                }
                None if unavailable.remove(name).is_some() => {
                    tracing::info!(backend = %name, "backend available again");
                }
                _ => {}
            }
            if let Some(m) = &self.metrics {
                m.backend_available(name, why.is_none());
            }
        }
        out
    }

    /// What Probe answers: the driver works. A backend this node lacks
    /// what it needs for is no reason to restart the driver (a new
    /// process would lack it too, and take the other backends' calls down
    /// with it); the check is made, and what it finds is in `/readyz`.
    pub async fn health(&self) -> crate::error::Result<()> {
        self.backends().await;
        Ok(())
    }

    /// The most volumes ControllerPublish attaches to `node_id`'s node
    /// (`None`: no limit). For this process's own node, what its
    /// NodeGetInfo answers; for another node, the configured count, which
    /// bounds every node's answer (the scheduler holds each node to its
    /// own, read through CSINode).
    pub async fn volume_limit_of(&self, node_id: &str) -> Result<Option<u64>> {
        let configured = self.settings.max_volumes_per_node;
        let here = crate::plugin::node_name(node_id) == crate::plugin::node_name(&self.node_id);
        let limit = match self.mode.node() && here {
            true => self.node.volume_limit(configured).await?,
            false => configured,
        };
        Ok(u64::try_from(limit).ok().filter(|l| *l > 0))
    }

    /// This node's topology segment.
    pub fn topology(&self) -> HashMap<String, String> {
        self.controller.node_topology()
    }
}

/// The version string: crate version plus git revision when known.
pub fn version() -> String {
    let rev = env!("FERROVOL_GIT_REV");
    if rev.is_empty() {
        env!("CARGO_PKG_VERSION").to_string()
    } else {
        format!("{}+{rev}", env!("CARGO_PKG_VERSION"))
    }
}

/// Runs one RPC's work: records the volume it concerns in the RPC's span
/// (opened by the [`trace::RpcLayer`]) and turns its error into a gRPC
/// status, in the one place that does.
pub async fn respond<T, F>(volume: &str, work: F) -> Result<tonic::Response<T>, tonic::Status>
where
    F: Future<Output = Result<T>>,
{
    if !volume.is_empty() {
        tracing::Span::current().record("volume", tracing::field::display(volume.escape_debug()));
    }
    work.await
        .map(tonic::Response::new)
        .map_err(|e| e.to_status())
}

/// [`respond`] for a request that carries a CSI `secrets` map: its values
/// are hidden from every command line, stderr and error text the runner
/// reports while the RPC runs (whichever backend runs the command), and
/// from the status the RPC answers with, which is also what its log line
/// shows.
pub async fn respond_hiding<T, F>(
    volume: &str,
    secrets: &HashMap<String, String>,
    work: F,
) -> Result<tonic::Response<T>, tonic::Status>
where
    F: Future<Output = Result<T>>,
{
    let values = crate::exec::call_secret_values(secrets.values().map(String::as_str));
    if values.is_empty() {
        return respond(volume, work).await;
    }
    respond(volume, async {
        crate::exec::hiding(values.clone(), work)
            .await
            .map_err(|e| crate::error::Error {
                message: crate::exec::redact(&e.message, &values),
                ..e
            })
    })
    .await
}
