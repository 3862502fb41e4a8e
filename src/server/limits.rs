//! What one client may cost: a cap on open connections, a deadline for a
//! new connection to start talking HTTP/2, and (set on the HTTP/2 server) a
//! cap on concurrent streams per connection.
//!
//! At the cap the driver stops accepting: new clients wait in the kernel's
//! accept queue (no memory of ours) and are taken in as others leave.
//! Connections that never send the HTTP/2 preface are closed at the
//! handshake deadline so they cannot hold the slots; connections that send
//! garbage are closed by the HTTP/2 server at the first bad byte.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// The length of the HTTP/2 client preface: a connection must have sent
/// this many bytes by its handshake deadline.
const PREFACE_LEN: usize = 24;

/// The caps of [`super::serve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Concurrent RPCs (HTTP/2 streams) on one connection.
    pub max_streams: u32,
    /// How long a new connection may take to send its first bytes.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            max_streams: 64,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl Limits {
    pub fn check(&self) -> crate::error::Result<()> {
        if self.max_connections == 0 || self.max_streams == 0 || self.handshake_timeout.is_zero() {
            return Err(crate::error::Error::invalid(
                "--max-connections, --max-streams and --handshake-timeout must be at least 1",
            ));
        }
        Ok(())
    }
}

/// A connection holding one of the slots.
pub struct Limited<S> {
    inner: S,
    _slot: OwnedSemaphorePermit,
    /// Until the preface has arrived.
    handshake: Option<Pin<Box<tokio::time::Sleep>>>,
    seen: usize,
}

impl<S> Limited<S> {
    fn new(inner: S, slot: OwnedSemaphorePermit, timeout: Duration) -> Self {
        Limited {
            inner,
            _slot: slot,
            handshake: Some(Box::pin(tokio::time::sleep(timeout))),
            seen: 0,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Limited<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(deadline) = this.handshake.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() {
                this.handshake = None;
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client sent no HTTP/2 preface in time",
                )));
            }
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if this.handshake.is_some() {
            this.seen += buf.filled().len() - before;
            if this.seen >= PREFACE_LEN {
                this.handshake = None;
            }
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Limited<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Limited<S> {
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Something that accepts connections.
pub trait Acceptor: Send + 'static {
    type Conn: Send + 'static;
    fn accept(&mut self) -> impl std::future::Future<Output = io::Result<Self::Conn>> + Send;
}

impl Acceptor for tokio::net::UnixListener {
    type Conn = tokio::net::UnixStream;
    async fn accept(&mut self) -> io::Result<Self::Conn> {
        tokio::net::UnixListener::accept(self).await.map(|(s, _)| s)
    }
}

impl Acceptor for tokio::net::TcpListener {
    type Conn = tokio::net::TcpStream;
    async fn accept(&mut self) -> io::Result<Self::Conn> {
        let (s, _) = tokio::net::TcpListener::accept(self).await?;
        s.set_nodelay(true)?;
        Ok(s)
    }
}

/// The accepted connections, at most `limits.max_connections` open at
/// once, each passed through `wrap`. The accept loop ends when the stream
/// is dropped (the server stops accepting at shutdown).
pub fn incoming<A: Acceptor, T: Send + 'static>(
    mut listener: A,
    limits: Limits,
    wrap: impl Fn(A::Conn) -> T + Send + 'static,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Limited<T>>> {
    let (tx, rx) = mpsc::channel(1);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    tokio::spawn(async move {
        loop {
            let slot = tokio::select! {
                s = slots.clone().acquire_owned() => s.expect("never closed"),
                _ = tx.closed() => return,
            };
            let conn = tokio::select! {
                c = listener.accept() => c,
                _ = tx.closed() => return,
            };
            match conn {
                Ok(conn) => {
                    let conn = Limited::new(wrap(conn), slot, limits.handshake_timeout);
                    if tx.send(Ok(conn)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    // Out of descriptors, or the client left before we
                    // took it: say so and let the moment pass rather than
                    // spin on the error.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn silent_connections_end_at_the_deadline_and_talkers_do_not() {
        let slots = Arc::new(Semaphore::new(2));
        let (_client, server) = tokio::io::duplex(64);
        let mut silent = Limited::new(
            server,
            slots.clone().acquire_owned().await.unwrap(),
            Duration::from_millis(50),
        );
        let mut buf = [0u8; 8];
        let err = silent.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);

        let (mut client, server) = tokio::io::duplex(64);
        let mut talker = Limited::new(
            server,
            slots.clone().acquire_owned().await.unwrap(),
            Duration::from_millis(50),
        );
        client.write_all(&[7u8; PREFACE_LEN]).await.unwrap();
        let mut got = [0u8; PREFACE_LEN];
        talker.read_exact(&mut got).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        client.write_all(b"later").await.unwrap();
        let n = talker.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"later");
        assert_eq!(slots.available_permits(), 0);
        drop(silent);
        drop(talker);
        assert_eq!(slots.available_permits(), 2, "slots come back on close");
    }

    #[tokio::test]
    async fn at_the_cap_the_next_connection_waits_for_a_slot() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s");
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let limits = Limits {
            max_connections: 1,
            max_streams: 1,
            handshake_timeout: Duration::from_secs(30),
        };
        let mut conns = incoming(listener, limits, |s| s);
        use tokio_stream::StreamExt;
        let _a = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let first = conns.next().await.unwrap().unwrap();
        let _b = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(200), conns.next()).await;
        assert!(
            waited.is_err(),
            "a second connection was taken past the cap"
        );
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), conns.next()).await;
        assert!(
            matches!(second, Ok(Some(Ok(_)))),
            "taken once a slot was free"
        );
    }
}
