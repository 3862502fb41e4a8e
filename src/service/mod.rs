//! The CSI services: thin adapters that validate a request, take the
//! operation guard, delegate to the plugin layer or the node machinery, and
//! build the response. Errors become gRPC codes only in `crate::error`.

pub mod controller;
pub mod convert;
pub mod identity;
pub mod node;

use crate::config::NodeSettings;
use crate::error::Result;
use crate::node::NodeOps;
use crate::plugin::{ControllerOps, Registry};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

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
}

/// One RPC being served; counted until dropped.
pub struct InFlightGuard<'a>(&'a InFlight);

impl InFlight {
    pub fn enter(&self) -> InFlightGuard<'_> {
        self.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlightGuard(self)
    }

    pub fn count(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Resolves once no RPC is being served.
    pub async fn idle(&self) {
        while self.count() > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.0
            .count
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
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
    pub in_flight: InFlight,
}

impl Driver {
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

/// Runs one RPC inside a span with its method and volume id, logs how it
/// ended and how long it took, and turns its error into a gRPC status.
/// Request bodies are never logged: they may carry secrets.
pub async fn traced<T, F>(
    driver: &Driver,
    method: &'static str,
    volume: &str,
    fut: F,
) -> Result<tonic::Response<T>, tonic::Status>
where
    F: Future<Output = Result<T>>,
{
    let span = tracing::info_span!("rpc", method, volume = %volume.escape_debug());
    let _in_flight = driver.in_flight.enter();
    async move {
        let start = Instant::now();
        let result = fut.await;
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        match result {
            Ok(v) => {
                tracing::debug!(duration_ms = ms, "ok");
                Ok(tonic::Response::new(v))
            }
            Err(e) => {
                let status = e.to_status();
                tracing::info!(duration_ms = ms, code = ?status.code(), error = %e.message, "failed");
                Err(status)
            }
        }
    }
    .instrument(span)
    .await
}
