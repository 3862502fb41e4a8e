//! A connection-level fix for clients that send the socket path (or the
//! endpoint's URL, `tcp://host:port`) as the HTTP/2 `:authority`, over a
//! unix socket or plain TCP. Kubelet before 1.26, `csc`
//! (gocsi), grpcio for Python and grpc-java all do; the HTTP/2 server under
//! tonic refuses such a request with a stream reset. Go servers accept it,
//! so every other CSI driver works with these clients.
//!
//! [`AuthorityFix`] sits between the unix socket and the HTTP/2 server and
//! reads the client's frames. At the first header block of a connection it
//! decides once:
//! - the authority is one the server accepts (tonic, recent kubelet): every
//!   byte from then on passes through untouched, at no cost;
//! - it is not: every header block of the connection is decoded (HPACK,
//!   tracking the client's dynamic table), its `:authority` set to
//!   `localhost` where the server would refuse it, and encoded again by an
//!   encoder that never indexes, so the server's header table can never
//!   disagree with what the blocks refer to. Other frames pass as they are.

use loona_hpack::{Decoder, Encoder};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame payload a server accepts unless it says otherwise.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this is refused (the server's own limit on a
/// header list is far lower).
const MAX_BLOCK: usize = 1 << 20;
/// What replaces an authority the server would refuse.
const LOCAL: &[u8] = b"localhost";

/// Whether the HTTP/2 server takes `value` as an authority.
pub fn acceptable_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Reading the connection preface and the frames before the first
    /// header block.
    Deciding,
    /// Pass every byte through.
    Raw,
    /// Re-encode every header block.
    Rewrite,
}

/// One header block being gathered (HEADERS, then CONTINUATIONs).
struct Block {
    stream: u32,
    end_stream: bool,
    fragment: Vec<u8>,
    /// The frames as they came, for passing through unchanged.
    original: Vec<u8>,
}

/// A client connection with `:authority` fixed on the way in.
pub struct AuthorityFix<S> {
    inner: S,
    mode: Mode,
    preface_seen: bool,
    /// Bytes read from the client, not yet processed.
    input: Vec<u8>,
    /// Bytes processed, not yet handed to the server.
    output: Vec<u8>,
    sent: usize,
    block: Option<Block>,
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    eof: bool,
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

impl<S> AuthorityFix<S> {
    pub fn new(inner: S) -> Self {
        let mut encoder = Encoder::new();
        // Never insert into the server's table: every block stands alone.
        encoder.set_max_table_size(0);
        AuthorityFix {
            inner,
            mode: Mode::Deciding,
            preface_seen: false,
            input: Vec::new(),
            output: Vec::new(),
            sent: 0,
            block: None,
            decoder: Decoder::new(),
            encoder,
            eof: false,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Moves what can be processed from `input` to `output`.
    fn process(&mut self) -> io::Result<()> {
        if !self.preface_seen {
            let n = self.input.len().min(PREFACE.len());
            if self.input[..n] != PREFACE[..n] {
                // Not HTTP/2 with prior knowledge: the server will say so.
                self.mode = Mode::Raw;
            } else if n < PREFACE.len() {
                return Ok(());
            } else {
                self.output.extend(self.input.drain(..PREFACE.len()));
                self.preface_seen = true;
            }
        }
        loop {
            if self.mode == Mode::Raw {
                self.output.append(&mut self.input);
                return Ok(());
            }
            if self.input.len() < FRAME_HEADER {
                return Ok(());
            }
            let len = u32::from_be_bytes([0, self.input[0], self.input[1], self.input[2]]) as usize;
            if len > MAX_FRAME {
                // Larger than the server allows: it will refuse the frame
                // and close the connection, so hand it over now instead of
                // buffering up to 16 MiB of a client's junk.
                if let Some(block) = self.block.take() {
                    self.output.extend(block.original);
                }
                self.mode = Mode::Raw;
                continue;
            }
            if self.input.len() < FRAME_HEADER + len {
                return Ok(());
            }
            let frame: Vec<u8> = self.input.drain(..FRAME_HEADER + len).collect();
            self.frame(frame)?;
        }
    }

    fn frame(&mut self, frame: Vec<u8>) -> io::Result<()> {
        let (kind, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER..];
        match (kind, self.block.as_mut()) {
            (HEADERS, None) => {
                let mut start = 0;
                let mut end = payload.len();
                if flags & PADDED != 0 {
                    let pad = *payload
                        .first()
                        .ok_or_else(|| invalid("empty padded frame"))?
                        as usize;
                    start = 1;
                    end = end
                        .checked_sub(pad)
                        .ok_or_else(|| invalid("padding too long"))?;
                }
                if flags & PRIORITY != 0 {
                    start += 5;
                }
                if start > end {
                    return Err(invalid("HEADERS frame too short"));
                }
                let block = Block {
                    stream,
                    end_stream: flags & END_STREAM != 0,
                    fragment: payload[start..end].to_vec(),
                    original: frame.clone(),
                };
                self.block = Some(block);
                if flags & END_HEADERS != 0 {
                    self.finish_block()?;
                }
            }
            (CONTINUATION, Some(block)) if block.stream == stream => {
                block.fragment.extend_from_slice(payload);
                block.original.extend_from_slice(&frame);
                if block.original.len() > MAX_BLOCK {
                    return Err(invalid("header block too large"));
                }
                if flags & END_HEADERS != 0 {
                    self.finish_block()?;
                }
            }
            // Anything else in the middle of a block is the client's error:
            // let the server see it as it is.
            (_, Some(_)) => {
                let block = self.block.take().expect("block");
                self.output.extend(block.original);
                self.output.extend(frame);
                self.mode = Mode::Raw;
            }
            (_, None) => self.output.extend(frame),
        }
        Ok(())
    }

    fn finish_block(&mut self) -> io::Result<()> {
        let block = self.block.take().expect("a block to finish");
        let headers = match self.decoder.decode(&block.fragment) {
            Ok(h) => h,
            Err(_) => {
                // The server's decoder will refuse it the same way.
                self.output.extend(block.original);
                self.mode = Mode::Raw;
                return Ok(());
            }
        };
        let refused = headers
            .iter()
            .any(|(n, v)| n == b":authority" && !acceptable_authority(v));
        if self.mode == Mode::Deciding {
            if !refused {
                self.output.extend(block.original);
                self.mode = Mode::Raw;
                return Ok(());
            }
            self.mode = Mode::Rewrite;
        }
        let fixed = headers.iter().map(|(n, v)| {
            if n == b":authority" && !acceptable_authority(v) {
                (n.as_slice(), LOCAL)
            } else {
                (n.as_slice(), v.as_slice())
            }
        });
        let encoded = self.encoder.encode(fixed);
        let chunks: Vec<&[u8]> = if encoded.is_empty() {
            vec![&[]]
        } else {
            encoded.chunks(MAX_FRAME).collect()
        };
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let kind = if i == 0 { HEADERS } else { CONTINUATION };
            let mut flags = 0;
            if i == 0 && block.end_stream {
                flags |= END_STREAM;
            }
            if i == last {
                flags |= END_HEADERS;
            }
            let len = (chunk.len() as u32).to_be_bytes();
            self.output.extend_from_slice(&len[1..]);
            self.output.push(kind);
            self.output.push(flags);
            self.output.extend_from_slice(&block.stream.to_be_bytes());
            self.output.extend_from_slice(chunk);
        }
        Ok(())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.sent < this.output.len() {
                let n = buf.remaining().min(this.output.len() - this.sent);
                buf.put_slice(&this.output[this.sent..this.sent + n]);
                this.sent += n;
                if this.sent == this.output.len() {
                    this.output.clear();
                    this.sent = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.mode == Mode::Raw && this.input.is_empty() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            if this.eof {
                // A frame cut short: hand over what there is and end.
                this.output.append(&mut this.input);
                if let Some(block) = this.block.take() {
                    this.output.extend(block.original);
                }
                if this.output.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let mut chunk = [0u8; 16 * 1024];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.input.extend_from_slice(read.filled());
            this.process()?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
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

impl tonic::transport::server::Connected for AuthorityFix<tokio::net::UnixStream> {
    type ConnectInfo = tonic::transport::server::UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl tonic::transport::server::Connected for AuthorityFix<tokio::net::TcpStream> {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests;
