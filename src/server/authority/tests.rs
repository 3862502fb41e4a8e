//! The fix over an in-memory pipe, fed what kubelet's Go client writes.

use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SOCKET: &str = "/var/lib/kubelet/plugins/csi.ferrovol.io/csi.sock";

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// A literal field with incremental indexing whose name is static entry
/// `index`, as Go's encoder writes `:authority` (so later requests refer
/// to the dynamic entry).
fn literal_indexed_name(index: u8, value: &[u8]) -> Vec<u8> {
    assert!(index < 63 && value.len() < 127);
    let mut out = vec![0x40 | index, value.len() as u8];
    out.extend(value);
    out
}

/// A request's header block: method POST (static 3), scheme http (6),
/// the path as a literal, then the authority as given.
fn request_block(path: &str, authority: &[u8]) -> Vec<u8> {
    let mut b = vec![0x83, 0x86];
    b.extend(literal_indexed_name(4, path.as_bytes()));
    b.extend(authority);
    b
}

/// Runs `input` through the fix and returns what the server would read.
async fn through_fix(input: Vec<u8>) -> Vec<u8> {
    let (mut client, server) = tokio::io::duplex(1 << 20);
    let mut fix = AuthorityFix::new(server);
    client.write_all(&input).await.unwrap();
    drop(client);
    let mut out = Vec::new();
    fix.read_to_end(&mut out).await.unwrap();
    out
}

/// A frame as (type, flags, stream, payload length).
type FrameSummary = (u8, u8, u32, usize);
/// A decoded header block.
type HeaderList = Vec<(String, String)>;

/// Splits the server's input into frames (after the preface) and decodes
/// every header block with one decoder, as the server does.
fn server_view(bytes: &[u8]) -> (Vec<FrameSummary>, Vec<HeaderList>) {
    assert!(bytes.starts_with(PREFACE));
    let mut rest = &bytes[PREFACE.len()..];
    let mut frames = Vec::new();
    let mut blocks = Vec::new();
    let mut decoder = Decoder::new();
    let mut pending = Vec::new();
    while !rest.is_empty() {
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        let (kind, flags) = (rest[3], rest[4]);
        let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
        let payload = &rest[FRAME_HEADER..FRAME_HEADER + len];
        frames.push((kind, flags, stream, len));
        if kind == HEADERS || kind == CONTINUATION {
            pending.extend_from_slice(payload);
            if flags & END_HEADERS != 0 {
                let headers = decoder.decode(&pending).expect("the server can decode it");
                blocks.push(
                    headers
                        .into_iter()
                        .map(|(n, v)| {
                            (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                        })
                        .collect(),
                );
                pending.clear();
            }
        }
        rest = &rest[FRAME_HEADER + len..];
    }
    (frames, blocks)
}

fn authority(block: &[(String, String)]) -> &str {
    &block.iter().find(|(n, _)| n == ":authority").unwrap().1
}

#[tokio::test]
async fn a_socket_path_authority_becomes_localhost_in_every_request() {
    let mut input = PREFACE.to_vec();
    input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
                                         // First request: the authority as a literal added to the client's table.
    let first = request_block(
        "/csi.v1.Node/NodeGetInfo",
        &literal_indexed_name(1, SOCKET.as_bytes()),
    );
    input.extend(frame(HEADERS, END_HEADERS, 1, &first));
    input.extend(frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]));
    // Second request refers to the dynamic entries by index: the authority
    // (now entry 63, the newer path entry is 62), split over a CONTINUATION
    // and padded, with a priority.
    let mut second = vec![0x83, 0x86];
    second.extend(literal_indexed_name(4, b"/csi.v1.Identity/Probe"));
    second.push(0x80 | 63); // the authority: one newer entry since
    let (a, b) = second.split_at(3);
    let mut padded = vec![2];
    padded.extend([0, 0, 0, 0, 16]);
    padded.extend(a);
    padded.extend([0, 0]);
    input.extend(frame(HEADERS, END_STREAM | PADDED | PRIORITY, 3, &padded));
    input.extend(frame(CONTINUATION, END_HEADERS, 3, b));
    // Third: a value larger than one frame, so the block must be split.
    let big = "x".repeat(40_000);
    let mut third = request_block("/csi.v1.Identity/Probe", &[0x80 | 64]);
    third.extend([0x00, 0x03]);
    third.extend(b"big");
    third.extend(loona_hpack::encoder::encode_integer(big.len(), 7));
    third.extend(big.as_bytes());
    // Sent as a client must: in frames no larger than the server allows.
    let parts: Vec<&[u8]> = third.chunks(MAX_FRAME).collect();
    for (i, part) in parts.iter().enumerate() {
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        let flags = if i == parts.len() - 1 { END_HEADERS } else { 0 };
        input.extend(frame(kind, flags, 5, part));
    }

    let out = through_fix(input).await;
    let (frames, blocks) = server_view(&out);
    assert_eq!(blocks.len(), 3);
    for b in &blocks {
        assert_eq!(authority(b), "localhost");
        assert_eq!(b[0], (":method".into(), "POST".into()));
    }
    assert_eq!(blocks[0][2].1, "/csi.v1.Node/NodeGetInfo");
    assert_eq!(blocks[1][2].1, "/csi.v1.Identity/Probe");
    assert_eq!(blocks[2].last().unwrap(), &("big".to_string(), big));
    // Frames in order, none larger than the default maximum, DATA intact,
    // END_STREAM kept on the second request's HEADERS.
    assert!(frames.iter().all(|f| f.3 <= MAX_FRAME));
    assert!(frames.contains(&(0x0, END_STREAM, 1, 5)));
    assert!(frames
        .iter()
        .any(|f| f.0 == HEADERS && f.2 == 3 && f.1 == END_STREAM | END_HEADERS));
    assert!(
        frames
            .iter()
            .filter(|f| f.0 == CONTINUATION && f.2 == 5)
            .count()
            >= 2
    );
}

#[tokio::test]
async fn an_acceptable_authority_passes_byte_for_byte() {
    let mut input = PREFACE.to_vec();
    input.extend(frame(0x4, 0, 0, &[]));
    let block = request_block(
        "/csi.v1.Identity/Probe",
        &literal_indexed_name(1, b"localhost"),
    );
    input.extend(frame(HEADERS, END_HEADERS, 1, &block));
    input.extend(frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]));
    // Later garbage is not looked at: the decision is made once.
    input.extend(b"not a frame at all");
    assert_eq!(through_fix(input.clone()).await, input);
    // Percent-encoded paths (newer Python clients) are refused by the
    // server as well, and fixed too.
    assert!(!acceptable_authority(b"%2Frun%2Fcsi.sock"));
    assert!(!acceptable_authority(SOCKET.as_bytes()));
    assert!(acceptable_authority(b"localhost"));
    assert!(acceptable_authority(b"unix.sock:0"));
}

#[tokio::test]
async fn not_http2_passes_untouched() {
    let input = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    assert_eq!(through_fix(input.clone()).await, input);
}

/// A frame header announcing more than the server accepts is handed over at
/// once (the server refuses it and closes), not buffered while the client
/// trickles in up to 16 MiB.
#[tokio::test]
async fn an_oversized_frame_is_passed_on_without_waiting_for_it() {
    let (mut client, server) = tokio::io::duplex(1 << 16);
    let mut fix = AuthorityFix::new(server);
    let mut input = PREFACE.to_vec();
    input.extend([0xff, 0xff, 0xff, 0x0, 0x0, 0, 0, 0, 1, 0xaa]);
    client.write_all(&input).await.unwrap();
    let mut got = vec![0u8; input.len()];
    tokio::time::timeout(std::time::Duration::from_secs(5), fix.read_exact(&mut got))
        .await
        .expect("the fix held the oversized frame back")
        .unwrap();
    assert_eq!(got, input);
}
