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
use crate::error::Result;
use crate::node::NodeOps;
use crate::plugin::{ControllerOps, Registry};
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
}

impl Driver {
    /// What Probe answers: every backend healthy.
    pub async fn health(&self) -> crate::error::Result<()> {
        for b in self.registry.all() {
            b.health().await.map_err(|e| {
                crate::error::Error::precondition(format!(
                    "backend {} is not healthy: {}",
                    b.name(),
                    e.message
                ))
            })?;
        }
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
