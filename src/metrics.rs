//! Prometheus metrics: per-RPC counts and latency by method and gRPC code,
//! RPCs in flight, external command durations and failures by command,
//! volumes staged and published, and each limited pod's I/O limits and
//! what it did on the volume (served with `/healthz` and `/readyz` on
//! `--metrics-addr` by `server::http`). Recording is a
//! few atomic operations on the RPC path; the text is made only when
//! scraped, by the `prometheus-client` crate.

use crate::exec::{Command, CommandRunner, ExecError, Output};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommandLabels {
    pub command: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub backend: String,
}

/// A pod's figure on a volume: which one (`key`: a limit's parameter
/// name, or an `io.stat` counter).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodIoLabels {
    pub volume_id: String,
    pub pod_uid: String,
    pub key: String,
}

/// One pod's I/O limits on a volume and what it did there, as the node
/// reads them when scraped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodIo {
    pub volume_id: String,
    pub pod_uid: String,
    /// The limits in force, by parameter name (unset ones left out).
    pub limits: Vec<(&'static str, u64)>,
    /// The pod's `io.stat` counters on the volume's device.
    pub usage: Vec<(String, u64)>,
    /// How long the pod's tasks were stalled on I/O, on any device
    /// (`some`, `full`: its cgroup's `io.pressure`), in seconds.
    pub stalled: Vec<(String, f64)>,
}

/// What a node says when scraped.
#[derive(Clone, Debug, Default)]
pub struct NodeFigures {
    pub staged: usize,
    pub published: usize,
    pub pods: Vec<PodIo>,
}

fn rpc_histogram() -> Histogram {
    // 100 µs to about 26 s.
    Histogram::new(exponential_buckets(0.0001, 4.0, 10))
}

fn command_histogram() -> Histogram {
    // 1 ms to about 4.4 min.
    Histogram::new(exponential_buckets(0.001, 4.0, 10))
}

/// The driver's metrics.
pub struct Metrics {
    registry: Registry,
    rpcs: Family<RpcLabels, Counter>,
    rpc_seconds: Family<RpcLabels, Histogram, fn() -> Histogram>,
    pub in_flight: Gauge,
    commands: Family<CommandLabels, Histogram, fn() -> Histogram>,
    command_failures: Family<CommandLabels, Counter>,
    staged: Gauge,
    published: Gauge,
    available: Family<BackendLabels, Gauge>,
    io_limits: Family<PodIoLabels, Gauge>,
    pod_io: Family<PodIoLabels, Gauge>,
    pod_stalled: Family<PodIoLabels, Gauge<f64, AtomicU64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ferrovol");
        let rpcs = Family::<RpcLabels, Counter>::default();
        let rpc_seconds =
            Family::<RpcLabels, Histogram, fn() -> Histogram>::new_with_constructor(rpc_histogram);
        let in_flight = Gauge::default();
        let commands = Family::<CommandLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            command_histogram,
        );
        let command_failures = Family::<CommandLabels, Counter>::default();
        let staged = Gauge::default();
        let published = Gauge::default();
        let available = Family::<BackendLabels, Gauge>::default();
        let io_limits = Family::<PodIoLabels, Gauge>::default();
        let pod_io = Family::<PodIoLabels, Gauge>::default();
        let pod_stalled = Family::<PodIoLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "rpcs",
            "CSI calls served, by method and gRPC code",
            rpcs.clone(),
        );
        registry.register(
            "rpc_duration_seconds",
            "How long CSI calls took, by method and gRPC code",
            rpc_seconds.clone(),
        );
        registry.register(
            "rpcs_in_flight",
            "CSI calls being served",
            in_flight.clone(),
        );
        registry.register(
            "command_duration_seconds",
            "How long external commands ran, by program",
            commands.clone(),
        );
        registry.register(
            "command_failures",
            "External commands that failed or timed out, by program",
            command_failures.clone(),
        );
        registry.register(
            "volumes_staged",
            "Volumes staged on this node",
            staged.clone(),
        );
        registry.register(
            "volumes_published",
            "Volume publications (targets) on this node",
            published.clone(),
        );
        registry.register(
            "backend_available",
            "1 when the backend's prerequisites are met here (its last health check passed), else 0",
            available.clone(),
        );
        registry.register(
            "volume_io_limit",
            "A volume's I/O limit in force for a pod on this node, by parameter \
             (readIops, writeIops: operations a second; readBps, writeBps: bytes a second)",
            io_limits.clone(),
        );
        registry.register(
            "volume_pod_io",
            "What a limited pod did on a volume's device since its cgroup was made, as the \
             kernel's io.stat counts it (rbytes, wbytes, rios, wios)",
            pod_io.clone(),
        );
        registry.register(
            "volume_pod_io_stalled_seconds",
            "How long a limited pod's tasks were stalled on I/O since its cgroup was made, on any \
             device, from its cgroup's io.pressure (some: at least one task; full: all); a pod \
             held back by its limit waits here (io.stat keeps no throttled time)",
            pod_stalled.clone(),
        );
        Metrics {
            registry,
            rpcs,
            rpc_seconds,
            in_flight,
            commands,
            command_failures,
            staged,
            published,
            available,
            io_limits,
            pod_io,
            pod_stalled,
        }
    }

    /// A backend's availability, as its last health check found it.
    pub fn backend_available(&self, backend: &str, available: bool) {
        self.available
            .get_or_create(&BackendLabels {
                backend: backend.to_string(),
            })
            .set(i64::from(available));
    }

    /// One finished CSI call.
    pub fn rpc(&self, method: &str, code: tonic::Code, took: Duration) {
        let labels = RpcLabels {
            method: method.to_string(),
            code: format!("{code:?}"),
        };
        self.rpcs.get_or_create(&labels).inc();
        self.rpc_seconds
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// One finished external command.
    pub fn command(&self, program: &str, took: Duration, ok: bool) {
        let labels = CommandLabels {
            command: program.rsplit('/').next().unwrap_or(program).to_string(),
        };
        self.commands
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        if !ok {
            self.command_failures.get_or_create(&labels).inc();
        }
    }

    /// The exposition text, with the node's figures (volumes staged and
    /// published, limited pods) as they are now, on a node.
    pub fn render(&self, node: Option<NodeFigures>) -> String {
        if let Some(n) = node {
            self.staged.set(n.staged as i64);
            self.published.set(n.published as i64);
            // Only the pods that hold a volume now.
            self.io_limits.clear();
            self.pod_io.clear();
            self.pod_stalled.clear();
            for pod in &n.pods {
                let labels = |key: &str| PodIoLabels {
                    volume_id: pod.volume_id.clone(),
                    pod_uid: pod.pod_uid.clone(),
                    key: key.to_string(),
                };
                for (key, value) in &pod.limits {
                    self.io_limits
                        .get_or_create(&labels(key))
                        .set(i64::try_from(*value).unwrap_or(i64::MAX));
                }
                for (key, value) in &pod.usage {
                    self.pod_io
                        .get_or_create(&labels(key))
                        .set(i64::try_from(*value).unwrap_or(i64::MAX));
                }
                for (key, secs) in &pod.stalled {
                    self.pod_stalled.get_or_create(&labels(key)).set(*secs);
                }
            }
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String does not fail");
        out
    }
}

/// A command runner that times every command it runs.
pub struct MeteredRunner {
    pub inner: Arc<dyn CommandRunner>,
    pub metrics: Arc<Metrics>,
}

#[async_trait::async_trait]
impl CommandRunner for MeteredRunner {
    async fn run(&self, command: Command) -> Result<Output, ExecError> {
        let program = command.program.clone();
        let start = Instant::now();
        let result = self.inner.run(command).await;
        self.metrics
            .command(&program, start.elapsed(), result.is_ok());
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A limited pod's limits and counters are samples labelled by volume,
    /// pod and key; a pod gone from the figures is gone from the text.
    #[test]
    fn a_limited_pod_s_limits_and_io_are_samples_while_it_holds_the_volume() {
        let m = Metrics::new();
        let pod = PodIo {
            volume_id: "lvm:pvc-1".into(),
            pod_uid: "3f1c2b4a-5d6e-4f70-8a9b-0c1d2e3f4a5b".into(),
            limits: vec![("readIops", 50), ("writeBps", 2 << 20)],
            usage: vec![("rios".into(), 150), ("wbytes".into(), 4096)],
            stalled: vec![("some".into(), 3.9), ("full".into(), 3.85)],
        };
        let text = m.render(Some(NodeFigures {
            staged: 1,
            published: 1,
            pods: vec![pod],
        }));
        let labels = "volume_id=\"lvm:pvc-1\",pod_uid=\"3f1c2b4a-5d6e-4f70-8a9b-0c1d2e3f4a5b\"";
        for line in [
            format!("ferrovol_volume_io_limit{{{labels},key=\"readIops\"}} 50"),
            format!("ferrovol_volume_io_limit{{{labels},key=\"writeBps\"}} 2097152"),
            format!("ferrovol_volume_pod_io{{{labels},key=\"rios\"}} 150"),
            format!("ferrovol_volume_pod_io{{{labels},key=\"wbytes\"}} 4096"),
            format!("ferrovol_volume_pod_io_stalled_seconds{{{labels},key=\"some\"}} 3.9"),
            format!("ferrovol_volume_pod_io_stalled_seconds{{{labels},key=\"full\"}} 3.85"),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
        }
        let text = m.render(Some(NodeFigures::default()));
        assert!(!text.contains("lvm:pvc-1"), "{text}");
    }
}
