//! Per-RPC tracing as a tower layer over the gRPC router: a span with the
//! method (the handler records the volume id in it), the count of RPCs in
//! flight (so a shutdown waits for exactly those), and one log line per
//! call with its duration and, for a failure, its code and message. The
//! same layer is where metrics will be taken. Request bodies are never
//! looked at: they may carry secrets.

use super::InFlight;
use crate::metrics::Metrics;
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
    metrics: Option<Arc<Metrics>>,
}

impl RpcLayer {
    pub fn new(in_flight: Arc<InFlight>, metrics: Option<Arc<Metrics>>) -> Self {
        Self { in_flight, metrics }
    }
}

/// How loudly a failed call is logged: the server's own failures as
/// errors or warnings, the client's mistakes and retries below INFO, what
/// the operator may want to know in between.
pub fn failure_level(code: tonic::Code) -> tracing::Level {
    use tonic::Code::*;
    match code {
        Internal | Unknown | DataLoss => tracing::Level::ERROR,
        Unavailable | DeadlineExceeded | ResourceExhausted | Cancelled => tracing::Level::WARN,
        FailedPrecondition | AlreadyExists | OutOfRange | Unimplemented | PermissionDenied
        | Unauthenticated => tracing::Level::INFO,
        InvalidArgument | NotFound | Aborted | Ok => tracing::Level::DEBUG,
    }
}

impl<S> Layer<S> for RpcLayer {
    type Service = RpcService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcService {
            inner,
            in_flight: self.in_flight.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

/// The router, traced.
#[derive(Clone)]
pub struct RpcService<S> {
    inner: S,
    in_flight: Arc<InFlight>,
    metrics: Option<Arc<Metrics>>,
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
        let metrics = self.metrics.clone();
        if let Some(m) = &metrics {
            m.in_flight.inc();
        }
        let call = inner.call(request);
        Box::pin(
            async move {
                let start = Instant::now();
                let result = call.await;
                drop(in_flight);
                let took = start.elapsed();
                let ms = round3(took.as_secs_f64() * 1000.0);
                let code = match &result {
                    Ok(response) => match tonic::Status::from_header_map(response.headers()) {
                        Some(status) if status.code() != tonic::Code::Ok => {
                            let code = status.code();
                            macro_rules! failed {
                                ($level:expr) => {
                                    tracing::event!(
                                        $level,
                                        duration_ms = ms,
                                        code = ?code,
                                        error = %status.message(),
                                        "failed"
                                    )
                                };
                            }
                            match failure_level(code) {
                                tracing::Level::ERROR => failed!(tracing::Level::ERROR),
                                tracing::Level::WARN => failed!(tracing::Level::WARN),
                                tracing::Level::INFO => failed!(tracing::Level::INFO),
                                _ => failed!(tracing::Level::DEBUG),
                            }
                            code
                        }
                        _ => {
                            tracing::debug!(duration_ms = ms, "ok");
                            tonic::Code::Ok
                        }
                    },
                    Err(e) => {
                        tracing::warn!(duration_ms = ms, error = %e, "transport error");
                        tonic::Code::Unavailable
                    }
                };
                if let Some(m) = &metrics {
                    m.in_flight.dec();
                    m.rpc(&method, code, took);
                }
                result
            }
            .instrument(span),
        )
    }
}

/// `x` to three significant digits (whole numbers from 100 up), so that a
/// duration prints as `0.0123`, `4.56` or `789`, not `0.012313999999999999`.
fn round3(x: f64) -> f64 {
    if !x.is_finite() || x <= 0.0 {
        return x;
    }
    let decimals = (2 - x.log10().floor() as i32).max(0);
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

#[cfg(test)]
mod tests {
    #[test]
    fn durations_print_with_three_significant_digits() {
        for (x, shown) in [
            (0.012313999999999999, "0.0123"),
            (4.5649, "4.56"),
            (12.345, "12.3"),
            (789.4, "789"),
            (12345.6, "12346"),
            (0.0, "0"),
        ] {
            assert_eq!(super::round3(x).to_string(), shown, "{x}");
        }
    }

    use super::*;

    #[test]
    fn server_failures_are_loud_and_client_mistakes_quiet() {
        use tonic::Code;
        assert_eq!(failure_level(Code::Internal), tracing::Level::ERROR);
        assert_eq!(failure_level(Code::Unavailable), tracing::Level::WARN);
        assert_eq!(failure_level(Code::ResourceExhausted), tracing::Level::WARN);
        assert_eq!(
            failure_level(Code::FailedPrecondition),
            tracing::Level::INFO
        );
        for quiet in [Code::InvalidArgument, Code::NotFound, Code::Aborted] {
            assert_eq!(failure_level(quiet), tracing::Level::DEBUG, "{quiet:?}");
        }
    }
}
