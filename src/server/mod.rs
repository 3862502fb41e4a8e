//! The gRPC endpoint: unix socket or TCP, stale socket handling, the services
//! the mode asks for, and graceful shutdown.

use crate::error::{Error, Result};
use crate::proto::{
    controller_server::ControllerServer, group_controller_server::GroupControllerServer,
    identity_server::IdentityServer, node_server::NodeServer,
    snapshot_metadata_server::SnapshotMetadataServer,
};
use crate::service::{
    controller::ControllerService, identity::IdentityService, node::NodeService, Driver,
};
use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub mod authority;
pub mod http;
pub mod limits;
pub use limits::Limits;

/// Where the driver listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl Endpoint {
    /// Parses `unix:///path/csi.sock` (or `unix:/path`) and `tcp://host:port`.
    pub fn parse(raw: &str) -> Result<Self> {
        if let Some(rest) = raw
            .strip_prefix("unix://")
            .or_else(|| raw.strip_prefix("unix:"))
        {
            let path = PathBuf::from(rest);
            if !path.is_absolute() {
                return Err(Error::invalid(format!(
                    "endpoint {raw:?}: the socket path must be absolute"
                )));
            }
            return Ok(Endpoint::Unix(path));
        }
        if let Some(rest) = raw.strip_prefix("tcp://") {
            use std::net::ToSocketAddrs;
            let addr = rest
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| Error::invalid(format!("endpoint {raw:?}: not a host:port")))?;
            return Ok(Endpoint::Tcp(addr));
        }
        Err(Error::invalid(format!(
            "endpoint {raw:?} must start with unix:// or tcp://"
        )))
    }
}

/// The files of mutual TLS on a TCP endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
}

impl TlsFiles {
    /// All three flags, or none.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
    ) -> Result<Option<Self>> {
        match (cert, key, client_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(client_ca)) => Ok(Some(TlsFiles {
                cert,
                key,
                client_ca,
            })),
            _ => Err(Error::invalid(
                "TLS needs all of --tls-cert, --tls-key and --tls-client-ca (clients must present a certificate)",
            )),
        }
    }

    fn config(&self) -> Result<tonic::transport::ServerTlsConfig> {
        let read =
            |p: &Path| std::fs::read(p).map_err(|e| Error::io(format!("read {}", p.display()), e));
        Ok(tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(
                read(&self.cert)?,
                read(&self.key)?,
            ))
            .client_ca_root(tonic::transport::Certificate::from_pem(read(
                &self.client_ca,
            )?)))
    }
}

/// The node API mounts as root and has no authentication of its own: a TCP
/// endpoint serves only on a loopback address unless mutual TLS is set up,
/// and TLS is for TCP endpoints only. Refusals name the flags.
pub fn check_endpoint(endpoint: &Endpoint, tls: Option<&TlsFiles>) -> Result<()> {
    match (endpoint, tls) {
        (Endpoint::Tcp(addr), None) if !addr.ip().is_loopback() => Err(Error::invalid(format!(
            "refusing to serve tcp://{addr} without TLS: the node API mounts filesystems as root; \
             use a loopback address, a unix socket, or --tls-cert, --tls-key and --tls-client-ca"
        ))),
        (Endpoint::Unix(_), Some(_)) => Err(Error::invalid(
            "--tls-cert, --tls-key and --tls-client-ca apply to tcp:// endpoints; a unix socket is guarded by its file mode",
        )),
        _ => Ok(()),
    }
}

/// Clears the way for a unix socket at `path`: a stale socket (nobody
/// answering) is removed; a live one, or anything that is not a socket, is
/// refused.
pub fn prepare_socket(path: &Path) -> Result<()> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| Error::io(format!("create {}", parent.display()), e))?;
            }
            return Ok(());
        }
        Err(e) => return Err(Error::io(format!("socket path {}", path.display()), e)),
    };
    if !md.file_type().is_socket() {
        return Err(Error::precondition(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        )));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(Error::precondition(format!(
            "another process is serving {}; refusing to start",
            path.display()
        )));
    }
    std::fs::remove_file(path)
        .map_err(|e| Error::io(format!("remove stale socket {}", path.display()), e))?;
    tracing::info!(socket = %path.display(), "removed stale socket");
    Ok(())
}

/// After `shutdown`: stops accepting (through `stop`), then waits for the
/// RPCs being served (not for idle client connections, which kubelet keeps
/// open), at most `grace`.
async fn drain(
    driver: Arc<Driver>,
    shutdown: impl Future<Output = ()>,
    stop: Arc<tokio::sync::Notify>,
    grace: Duration,
) {
    shutdown.await;
    tracing::info!(
        in_flight = driver.in_flight.count(),
        "shutting down: no new connections; waiting for in-flight calls"
    );
    stop.notify_one();
    tokio::select! {
        _ = driver.in_flight.idle() => {
            // The last handlers have returned; give their responses a
            // moment to reach the socket.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            tracing::info!("no calls in flight; exiting");
        }
        _ = tokio::time::sleep(grace) => tracing::warn!("in-flight calls did not finish in time; exiting"),
    }
}

/// The gRPC server's settings. Streams per connection are an HTTP/2
/// setting (clients queue beyond it); keepalive pings find peers that
/// vanished without closing.
fn server_builder(limits: &Limits, tls: Option<&TlsFiles>) -> Result<tonic::transport::Server> {
    let builder = tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_streams)
        .http2_keepalive_interval(Some(Duration::from_secs(60)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)));
    match tls {
        Some(files) => builder
            .tls_config(files.config()?)
            .map_err(|e| Error::invalid(format!("TLS: {e}"))),
        None => Ok(builder),
    }
}

/// The unix socket, bound where a stale one is cleared away, open to the
/// driver's user and group.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener> {
    prepare_socket(path)?;
    let listener = tokio::net::UnixListener::bind(path)
        .map_err(|e| Error::io(format!("bind {}", path.display()), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| Error::io(format!("chmod {}", path.display()), e))?;
    Ok(listener)
}

/// Serves until `shutdown` resolves; then stops accepting, gives in-flight
/// RPCs up to `grace` to finish, and removes the socket.
pub async fn serve(
    driver: Arc<Driver>,
    endpoint: Endpoint,
    tls: Option<TlsFiles>,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> Result<()> {
    let mode = driver.mode;
    check_endpoint(&endpoint, tls.as_ref())?;
    limits.check()?;
    // Every RPC is traced (span, in-flight count, one log line) by a layer.
    let mut builder = server_builder(&limits, tls.as_ref())?.layer(
        crate::service::trace::RpcLayer::new(driver.in_flight.clone(), driver.metrics.clone()),
    );
    let router = builder.add_service(IdentityServer::new(IdentityService(driver.clone())));
    let router = router
        .add_optional_service(
            mode.controller()
                .then(|| ControllerServer::new(ControllerService(driver.clone()))),
        )
        .add_optional_service(mode.controller().then(|| {
            GroupControllerServer::new(crate::service::group::GroupControllerService(
                driver.clone(),
            ))
        }))
        .add_optional_service(
            (mode.controller() && driver.controller.metadata_served()).then(|| {
                SnapshotMetadataServer::new(crate::service::metadata::SnapshotMetadataService(
                    driver.clone(),
                ))
            }),
        )
        .add_optional_service(
            mode.node()
                .then(|| NodeServer::new(NodeService(driver.clone()))),
        );

    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = {
        let stop = stop.clone();
        async move { stop.notified().await }
    };
    let drained = drain(driver.clone(), shutdown, stop, grace);

    let socket = match &endpoint {
        Endpoint::Unix(p) => Some(p.clone()),
        Endpoint::Tcp(_) => None,
    };
    let served = match endpoint {
        Endpoint::Unix(path) => {
            let listener = bind_unix(&path)?;
            tracing::info!(endpoint = %format!("unix://{}", path.display()), driver = %driver.name, node = %driver.node_id, ?mode, "serving");
            driver
                .serving
                .store(true, std::sync::atomic::Ordering::Relaxed);
            // Clients that send the socket path as :authority (kubelet
            // before 1.26, csc, grpcio, grpc-java) get it fixed on the way in.
            let incoming = limits::incoming(listener, limits, true, authority::AuthorityFix::new);
            let serving = router.serve_with_incoming_shutdown(incoming, stopped);
            tokio::select! {
                r = serving => r.map_err(|e| Error::internal(format!("server: {e}"))),
                _ = drained => Ok(()),
            }
        }
        Endpoint::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| Error::io(format!("bind {addr}"), e))?;
            tracing::info!(endpoint = %format!("tcp://{addr}"), driver = %driver.name, ?mode, "serving");
            driver
                .serving
                .store(true, std::sync::atomic::Ordering::Relaxed);
            type Serving = std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<(), tonic::transport::Error>> + Send>,
            >;
            let serving: Serving = if tls.is_none() {
                // Plain HTTP/2: clients that send the endpoint's URL as
                // :authority (csc sends `tcp://host:port`) get it fixed on
                // the way in, as on the unix socket.
                let incoming =
                    limits::incoming(listener, limits, true, authority::AuthorityFix::new);
                Box::pin(router.serve_with_incoming_shutdown(incoming, stopped))
            } else {
                // Under TLS the first bytes are its handshake, not HTTP/2's
                // (and a TLS client names a host as its authority).
                let incoming = limits::incoming(listener, limits, false, |conn| conn);
                Box::pin(router.serve_with_incoming_shutdown(incoming, stopped))
            };
            tokio::select! {
                r = serving => r.map_err(|e| Error::internal(format!("server: {e}"))),
                _ = drained => Ok(()),
            }
        }
    };
    if let Some(path) = socket {
        let _ = std::fs::remove_file(&path);
    }
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints() {
        assert_eq!(
            Endpoint::parse("unix:///run/csi.sock").unwrap(),
            Endpoint::Unix("/run/csi.sock".into())
        );
        assert_eq!(
            Endpoint::parse("unix:/run/csi.sock").unwrap(),
            Endpoint::Unix("/run/csi.sock".into())
        );
        assert_eq!(
            Endpoint::parse("tcp://127.0.0.1:10000").unwrap(),
            Endpoint::Tcp("127.0.0.1:10000".parse().unwrap())
        );
        assert!(Endpoint::parse("unix://relative.sock").is_err());
        assert!(Endpoint::parse("http://x").is_err());
    }

    #[test]
    fn stale_socket_is_removed_live_one_and_files_refused() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("csi.sock");
        let live = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        assert!(prepare_socket(&sock)
            .unwrap_err()
            .message
            .contains("another process"));
        drop(live);
        prepare_socket(&sock).unwrap();
        assert!(!sock.exists());
        let file = dir.path().join("file");
        std::fs::write(&file, b"data").unwrap();
        assert!(prepare_socket(&file).is_err());
        assert!(file.exists());
    }
}
