//! What one client may cost: a cap on open connections, a deadline for a
//! new connection to start talking HTTP/2, and (set on the HTTP/2 server) a
//! cap on concurrent streams per connection.
//!
//! A connection is *unproven* until it has sent the HTTP/2 client preface.
//! At the cap, a new connection takes the slot of the oldest unproven one,
//! which is closed: a flood of connections that say nothing holds no slot
//! a new client needs, and the new client (kubelet) is answered at once
//! instead of after the flood's handshake deadlines. Only with every slot
//! held by a proven client does a new one wait, in the kernel's accept
//! queue. Unproven connections are also closed at the handshake deadline,
//! a preface that is not HTTP/2's at its first wrong byte, and garbage
//! after it by the HTTP/2 server.

use crate::sync::LockExt;
use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// The HTTP/2 client preface: a connection must have sent it by its
/// handshake deadline.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const PREFACE_LEN: usize = PREFACE.len();

/// How long a new connection has to show its preface before a newer one
/// may take its slot: a well-behaved client's preface follows its connect
/// at once, but on a busy machine the task that reads it may run late.
const EVICT_AFTER: Duration = Duration::from_millis(100);

/// One unproven connection's handle: set to close it.
struct Eviction {
    evicted: AtomicBool,
    waker: Mutex<Option<std::task::Waker>>,
    accepted: std::time::Instant,
    /// The connection's socket, to see whether its preface is waiting in
    /// the kernel's buffer (it lives as long as this handle: both go with
    /// the connection).
    fd: std::os::fd::RawFd,
    /// Under TLS: any first bytes count.
    plain: bool,
}

/// What [`Unproven::evict_oldest`] did.
enum Evicted {
    /// Closed the oldest: its slot comes back.
    One,
    /// The oldest is younger than [`EVICT_AFTER`]: try again after this.
    TooYoung(Duration),
    /// No connection is unproven.
    None,
}

impl Eviction {
    fn evict(&self) {
        self.evicted.store(true, Ordering::SeqCst);
        if let Some(w) = self.waker.locked().take() {
            w.wake();
        }
    }
}

/// The unproven connections, oldest first. Entries of connections that
/// have proven themselves or closed are dropped as they are met.
#[derive(Default)]
struct Unproven(Mutex<Queue>);

struct Queue {
    entries: VecDeque<Weak<Eviction>>,
    /// The length at which the next sweep of dead entries happens.
    sweep_at: usize,
}

/// The shortest queue that is swept.
const SWEEP_MIN: usize = 64;

impl Default for Queue {
    fn default() -> Self {
        Queue {
            entries: VecDeque::new(),
            sweep_at: SWEEP_MIN,
        }
    }
}

impl Unproven {
    fn register(&self, fd: std::os::fd::RawFd, plain: bool) -> Arc<Eviction> {
        let e = Arc::new(Eviction {
            evicted: AtomicBool::new(false),
            waker: Mutex::new(None),
            accepted: std::time::Instant::now(),
            fd,
            plain,
        });
        let mut q = self.0.locked();
        // Entries of connections that proved themselves or closed pile up
        // behind a live one, each keeping its handle's memory: sweep them
        // when the queue has doubled since the last sweep. The live ones
        // hold slots, so the queue stays within twice the cap, at O(1) per
        // connection.
        if q.entries.len() >= q.sweep_at {
            q.entries.retain(|w| w.strong_count() > 0);
            q.sweep_at = (2 * q.entries.len()).max(SWEEP_MIN);
        }
        q.entries.push_back(Arc::downgrade(&e));
        e
    }

    /// Whether any connection is still unproven.
    fn has_any(&self) -> bool {
        let q = &mut self.0.locked().entries;
        while q.front().is_some_and(|w| w.strong_count() == 0) {
            q.pop_front();
        }
        !q.is_empty()
    }

    /// Closes the oldest unproven connection, once it has had
    /// [`EVICT_AFTER`] to show its preface.
    fn evict_oldest(&self) -> Evicted {
        let q = &mut self.0.locked().entries;
        while let Some(w) = q.front() {
            let Some(e) = w.upgrade() else {
                q.pop_front();
                continue;
            };
            let age = e.accepted.elapsed();
            if age < EVICT_AFTER {
                return Evicted::TooYoung(EVICT_AFTER - age);
            }
            q.pop_front();
            // Its preface came, but its task has not read it yet (a busy
            // machine): proven, passed over.
            if preface_waiting(e.fd, e.plain) {
                continue;
            }
            e.evict();
            return Evicted::One;
        }
        Evicted::None
    }
}

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
    /// Until the preface has arrived: set when a newer connection needs
    /// the slot.
    eviction: Option<Arc<Eviction>>,
    /// Whether the first bytes must be HTTP/2's preface (plain HTTP/2), or
    /// only be there (TLS, whose handshake comes first).
    plain: bool,
}

impl<S> Limited<S> {
    fn new(
        inner: S,
        slot: OwnedSemaphorePermit,
        timeout: Duration,
        eviction: Option<Arc<Eviction>>,
        plain: bool,
    ) -> Self {
        Limited {
            inner,
            _slot: slot,
            handshake: Some(Box::pin(tokio::time::sleep(timeout))),
            seen: 0,
            eviction,
            plain,
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
        if let Some(e) = &this.eviction {
            if e.evicted.load(Ordering::SeqCst) {
                this.handshake = None;
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "closed for a newer connection: no HTTP/2 preface yet, at the connection cap",
                )));
            }
            *e.waker.locked() = Some(cx.waker().clone());
        }
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
            let got = &buf.filled()[before..];
            let expected = &PREFACE[this.seen.min(PREFACE_LEN)..];
            let n = got.len().min(expected.len());
            if this.plain && got[..n] != expected[..n] {
                this.handshake = None;
                this.eviction = None;
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the client's first bytes are not the HTTP/2 preface",
                )));
            }
            this.seen += got.len();
            if this.seen >= PREFACE_LEN {
                // Proven: no newer connection takes this one's slot.
                this.handshake = None;
                this.eviction = None;
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
    type Conn: Send + 'static + std::os::fd::AsRawFd;
    fn accept(&mut self) -> impl std::future::Future<Output = io::Result<Self::Conn>> + Send;
}

/// Whether the client's preface (under TLS: its first bytes) is in the
/// kernel's buffer for the socket, left in place: a client that sent it
/// is proven before any task of ours reads it.
fn preface_waiting(fd: std::os::fd::RawFd, plain: bool) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    let mut head = [0u8; PREFACE_LEN];
    let n = recv(fd, &mut head, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT).unwrap_or(0);
    n == PREFACE_LEN && (!plain || head == *PREFACE)
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

/// Gives the memory of a surge of connections back to the system once it
/// has passed. Each connection's buffers come from the allocator's
/// per-thread arenas; freed, they stay with the process (a flood of 3,000
/// connections left the heap at 10 MB with 1.3 MB of it in use), because
/// glibc returns an arena's memory only from its top. After a surge (a
/// quarter of the slots taken) has ebbed (an eighth of that left), one
/// `malloc_trim` returns every free page.
struct Surge {
    /// Connections that make a surge.
    high: usize,
    /// Connections left when it has passed.
    low: usize,
    /// Whether a watcher is waiting for the surge to pass.
    armed: Arc<AtomicBool>,
    max: usize,
}

impl Surge {
    /// Checked every second while a surge lasts.
    const EVERY: Duration = Duration::from_secs(1);

    fn new(max_connections: usize) -> Self {
        let high = (max_connections / 4).max(32);
        Surge {
            high,
            low: high / 8,
            armed: Arc::new(AtomicBool::new(false)),
            max: max_connections,
        }
    }

    /// Called as connections come: when they make a surge, watches (once)
    /// for it to pass and then returns the free memory.
    fn watch(&self, slots: &Arc<Semaphore>) {
        let open = self.max - slots.available_permits();
        if open < self.high || self.armed.swap(true, Ordering::SeqCst) {
            return;
        }
        let (slots, armed, low, max) = (
            Arc::downgrade(slots),
            self.armed.clone(),
            self.low,
            self.max,
        );
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Self::EVERY).await;
                // The server stopped accepting: nothing to watch.
                let Some(slots) = slots.upgrade() else { return };
                if max - slots.available_permits() <= low {
                    break;
                }
            }
            let _ = tokio::task::spawn_blocking(return_free_memory).await;
            armed.store(false, Ordering::SeqCst);
        });
    }
}

fn return_free_memory() {
    let released = crate::host::return_free_memory();
    tracing::debug!(
        released,
        "free memory returned after a surge of connections"
    );
}

/// The accepted connections, at most `limits.max_connections` open at
/// once, each passed through `wrap`. The accept loop ends when the stream
/// is dropped (the server stops accepting at shutdown).
pub fn incoming<A: Acceptor, T: Send + 'static>(
    mut listener: A,
    limits: Limits,
    plain: bool,
    wrap: impl Fn(A::Conn) -> T + Send + 'static,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Limited<T>>> {
    let (tx, rx) = mpsc::channel(1);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let unproven = Arc::new(Unproven::default());
    let surge = Surge::new(limits.max_connections);
    tokio::spawn(async move {
        loop {
            surge.watch(&slots);
            // At the cap with no unproven connection to close, wait for a
            // slot before accepting: new clients wait in the kernel's
            // queue, costing nothing of ours.
            if slots.available_permits() == 0 && !unproven.has_any() {
                tokio::select! {
                    s = slots.clone().acquire_owned() => drop(s.expect("never closed")),
                    _ = tx.closed() => return,
                }
            }
            let conn = tokio::select! {
                c = listener.accept() => c,
                _ = tx.closed() => return,
            };
            match conn {
                Ok(conn) => {
                    let slot = match slots.clone().try_acquire_owned() {
                        Ok(s) => s,
                        // The oldest unproven connection makes way (its
                        // slot comes back as soon as it is closed), once it
                        // has had its moment to speak.
                        Err(_) => loop {
                            let retry = match unproven.evict_oldest() {
                                Evicted::TooYoung(left) => Some(left),
                                Evicted::One | Evicted::None => None,
                            };
                            let nap = tokio::time::sleep(retry.unwrap_or(Duration::ZERO));
                            tokio::select! {
                                s = slots.clone().acquire_owned() => break s.expect("never closed"),
                                _ = nap, if retry.is_some() => continue,
                                _ = tx.closed() => return,
                            }
                        },
                    };
                    // Already sent its preface (or, under TLS, its first
                    // bytes): proven, never closed for a newer one.
                    let fd = conn.as_raw_fd();
                    let proven = preface_waiting(fd, plain);
                    let eviction = (!proven).then(|| unproven.register(fd, plain));
                    let conn =
                        Limited::new(wrap(conn), slot, limits.handshake_timeout, eviction, plain);
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

    /// Entries of connections that proved themselves or closed do not
    /// pile up behind one that stays unproven: the queue stays within
    /// twice its live entries (and the sweep's floor).
    #[test]
    fn the_unproven_queue_forgets_connections_gone_behind_a_live_one() {
        let q = Unproven::default();
        let first = q.register(-1, true);
        let mut live = vec![first];
        for i in 0..100_000 {
            let e = q.register(-1, true);
            if i % 1000 == 0 {
                live.push(e);
            }
        }
        let len = q.0.lock().unwrap().entries.len();
        assert!(
            len <= (2 * live.len()).max(SWEEP_MIN) + 1,
            "{len} entries for {} live connections",
            live.len()
        );
        drop(live);
        assert!(!q.has_any());
    }

    #[tokio::test]
    async fn silent_connections_end_at_the_deadline_and_talkers_do_not() {
        let slots = Arc::new(Semaphore::new(2));
        let (_client, server) = tokio::io::duplex(64);
        let mut silent = Limited::new(
            server,
            slots.clone().acquire_owned().await.unwrap(),
            Duration::from_millis(50),
            None,
            true,
        );
        let mut buf = [0u8; 8];
        let err = silent.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);

        let (mut client, server) = tokio::io::duplex(64);
        let mut talker = Limited::new(
            server,
            slots.clone().acquire_owned().await.unwrap(),
            Duration::from_millis(50),
            None,
            true,
        );
        client.write_all(PREFACE).await.unwrap();
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

        // First bytes that are not the preface end the connection at once.
        let (mut client, server) = tokio::io::duplex(64);
        let mut liar = Limited::new(
            server,
            slots.clone().acquire_owned().await.unwrap(),
            Duration::from_secs(30),
            None,
            true,
        );
        client.write_all(b"PRI * HTTP/1.1\r\n").await.unwrap();
        let mut all = [0u8; 64];
        let err = liar.read(&mut all).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    /// At the cap, a new connection takes the slot of the oldest one that
    /// has not sent the HTTP/2 preface, which is closed; a connection that
    /// has sent it keeps its slot, and with only such connections the new
    /// one waits.
    #[tokio::test]
    async fn at_the_cap_a_new_connection_takes_an_unproven_ones_slot() {
        use tokio::io::AsyncReadExt as _;
        use tokio_stream::StreamExt;
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s");
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let limits = Limits {
            max_connections: 2,
            max_streams: 1,
            handshake_timeout: Duration::from_secs(30),
        };
        let mut conns = incoming(listener, limits, true, |s| s);
        // A proven client, and a silent one.
        let mut proven_client = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let mut proven = conns.next().await.unwrap().unwrap();
        proven_client.write_all(PREFACE).await.unwrap();
        let mut got = [0u8; PREFACE_LEN];
        proven.read_exact(&mut got).await.unwrap();
        let _silent_client = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let mut silent = conns.next().await.unwrap().unwrap();
        // A new client at the cap: the silent one is closed for it, at
        // once (not at its 30 s deadline).
        let _new_client = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let mut buf = [0u8; 8];
        let err = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
            .await
            .expect("the silent connection was not closed for the new one")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        drop(silent);
        let mut new = tokio::time::timeout(Duration::from_secs(5), conns.next())
            .await
            .expect("the new connection was not taken")
            .unwrap()
            .unwrap();
        // Both slots are proven or young now: the next client closes the
        // unproven new one, never the proven one.
        let _newer_client = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let err = tokio::time::timeout(Duration::from_secs(5), new.read(&mut buf))
            .await
            .expect("the unproven connection kept its slot")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        drop(new);
        let _newer = tokio::time::timeout(Duration::from_secs(5), conns.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        proven_client.write_all(b"still").await.unwrap();
        let n = proven.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"still");
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
        let mut conns = incoming(listener, limits, true, |s| s);
        use tokio_stream::StreamExt;
        let mut a = tokio::net::UnixStream::connect(&sock).await.unwrap();
        let mut first = conns.next().await.unwrap().unwrap();
        // Proven (it sent the preface): no newer connection takes its slot.
        a.write_all(PREFACE).await.unwrap();
        let mut got = [0u8; PREFACE_LEN];
        first.read_exact(&mut got).await.unwrap();
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
