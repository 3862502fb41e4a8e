//! Per-RPC tracing as a tower layer over the gRPC router: a span with the
//! method (the handler records the volume id in it), the count of RPCs in
//! flight (so a shutdown waits for exactly those), and one log line per
//! call with its duration and, for a failure, its code and message. The
//! same layer is where metrics will be taken. Request bodies are never
//! looked at: they may carry secrets.

use super::InFlight;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tower::{Layer, Service};
use tracing::Instrument;

/// The layer.
#[derive(Clone)]
pub struct RpcLayer {
    in_flight: Arc<InFlight>,
}

impl RpcLayer {
    pub fn new(in_flight: Arc<InFlight>) -> Self {
        Self { in_flight }
    }
}

impl<S> Layer<S> for RpcLayer {
    type Service = RpcService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcService {
            inner,
            in_flight: self.in_flight.clone(),
        }
    }
}

/// The router, traced.
#[derive(Clone)]
pub struct RpcService<S> {
    inner: S,
    in_flight: Arc<InFlight>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> Service<http::Request<B>> for RpcService<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
    B: Send + 'static,
    R: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // The service that was polled ready serves this call; a clone takes
        // its place for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let method = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let span = tracing::info_span!("rpc", method = %method, volume = tracing::field::Empty);
        let in_flight = self.in_flight.enter();
        let call = inner.call(request);
        Box::pin(
            async move {
                let start = Instant::now();
                let result = call.await;
                drop(in_flight);
                let ms = start.elapsed().as_secs_f64() * 1000.0;
                match &result {
                    Ok(response) => match tonic::Status::from_header_map(response.headers()) {
                        Some(status) if status.code() != tonic::Code::Ok => tracing::info!(
                            duration_ms = ms,
                            code = ?status.code(),
                            error = %status.message(),
                            "failed"
                        ),
                        _ => tracing::debug!(duration_ms = ms, "ok"),
                    },
                    Err(e) => tracing::warn!(duration_ms = ms, error = %e, "transport error"),
                }
                result
            }
            .instrument(span),
        )
    }
}
