//! The driver's HTTP endpoint on `--metrics-addr`: `/metrics` (the
//! `metrics` module's record), `/healthz` (what Probe answers),
//! `/readyz` (serving) and, on a controller that changes volumes' I/O
//! limits, `/limits` (what the nodes ask for).

use crate::service::Driver;
use std::sync::Arc;
use std::time::Duration;

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` until the process
/// ends.
pub async fn serve(addr: std::net::SocketAddr, driver: Arc<Driver>) -> crate::error::Result<()> {
    use http_body_util::Full;
    use hyper::body::Bytes;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| crate::error::Error::io(format!("bind metrics address {addr}"), e))?;
    tracing::info!(%addr, "serving metrics, /healthz and /readyz");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let driver = driver.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let driver = driver.clone();
                        async move {
                            let (status, kind, body) =
                                answer(&driver, req.uri().path(), req.uri().query()).await;
                            Ok::<_, std::convert::Infallible>(
                                hyper::Response::builder()
                                    .status(status)
                                    .header("content-type", kind)
                                    .body(Full::new(Bytes::from(body)))
                                    .expect("a valid response"),
                            )
                        }
                    },
                );
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    Ok(())
}

const TEXT: &str = "text/plain; charset=utf-8";

async fn answer(driver: &Driver, path: &str, query: Option<&str>) -> (u16, &'static str, String) {
    match path {
        crate::node::LIMITS_PATH
            if driver.controller.keeps_limits() || driver.controller.relay().is_some() =>
        {
            limits(driver, query.unwrap_or_default()).await
        }
        "/metrics" => match &driver.metrics {
            Some(m) => (
                200,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                m.render(driver.mode.node().then(|| {
                    let state = driver.node.state();
                    crate::metrics::NodeFigures {
                        staged: state.stages().len(),
                        published: state.publishes().len(),
                        pods: driver.node.pod_io(),
                    }
                })),
            ),
            None => (404, TEXT, "metrics are off\n".into()),
        },
        "/healthz" => match driver.health().await {
            Ok(()) => (200, TEXT, "ok\n".into()),
            Err(e) => (503, TEXT, format!("{}\n", e.message)),
        },
        "/readyz" => {
            if !driver.serving.load(std::sync::atomic::Ordering::Relaxed) {
                return (503, TEXT, "not serving yet\n".into());
            }
            // Ready once serving, whatever the backends: a node that
            // lacks one (or all) of them is no reason to hold a rollout or
            // take the endpoint away from the others' calls. The body
            // names each backend this node lacks what it needs for, and
            // why (as the log, the metric and NodeGetStorageHealth do).
            let backends = driver.backends().await;
            let out: Vec<String> = backends
                .iter()
                .filter_map(|(name, why)| {
                    why.as_ref()
                        .map(|w| format!("backend {name} unavailable here: {w}\n"))
                })
                .collect();
            let head = match !backends.is_empty() && out.len() == backends.len() {
                true => "ready; no backend available on this node\n",
                false => "ready\n",
            };
            (200, TEXT, format!("{head}{}", out.concat()))
        }
        _ => (404, TEXT, "not found\n".into()),
    }
}

/// What a node asks (`volumes=<id>,<id>...`: the changes to those
/// volumes' limits; `taken=<id>@<generation>,...`: the offers it took),
/// answered as JSON ([`crate::node::LimitsAnswer`]).
async fn limits(driver: &Driver, query: &str) -> (u16, &'static str, String) {
    let field = |name: &str| {
        query
            .split('&')
            .find_map(|p| p.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_default()
    };
    let listed = |name: &str| field(name).split(',').filter(|r| !r.is_empty());
    let mut ids = Vec::new();
    for raw in listed("volumes") {
        match crate::plugin::VolumeId::parse(raw) {
            Ok(id) => ids.push(id),
            Err(_) => return (400, TEXT, "a volume id that is not one\n".into()),
        }
    }
    let mut taken = Vec::new();
    for raw in listed("taken") {
        let parsed = raw.rsplit_once('@').and_then(|(v, g)| {
            crate::plugin::VolumeId::parse(v).ok()?;
            Some((v.to_string(), g.parse::<u64>().ok()?))
        });
        match parsed {
            Some(t) => taken.push(t),
            None => {
                return (
                    400,
                    TEXT,
                    "a taken offer that is not <id>@<generation>\n".into(),
                )
            }
        }
    }
    if !query
        .split('&')
        .any(|p| p.starts_with("volumes=") || p.starts_with("taken="))
    {
        return (
            400,
            TEXT,
            "ask as ?volumes=<id>,...&taken=<id>@<generation>,...\n".into(),
        );
    }
    let mut answer = crate::node::LimitsAnswer {
        volumes: driver.controller.current_limits(&ids).await,
        offers: Vec::new(),
    };
    if let Some(relay) = driver.controller.relay() {
        for (volume, generation) in taken {
            relay.took(&volume, generation);
        }
        answer.offers = relay.open();
    }
    match serde_json::to_string(&answer) {
        Ok(json) => (200, "application/json", json),
        Err(e) => (500, TEXT, format!("{e}\n")),
    }
}
