//! Whether an NFS server answers this node: an RPC NULL call (procedure 0
//! of the NFS program, RFC 5531) over TCP to its port, with a deadline.
//! Nothing is mounted and no kernel client is involved, so a server that
//! does not answer holds nothing but this task: NodeGetStorageHealth asks
//! it of every configured export's server.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The NFS program's number (RFC 1813, RFC 7530).
const NFS_PROGRAM: u32 = 100003;
/// How long a server has to answer NodeGetStorageHealth's call: well
/// inside the call's quick deadline.
pub const WITHIN: Duration = Duration::from_secs(5);
/// The port a server serves NFS on when the options name none.
pub const NFS_PORT: u16 = 2049;

/// The call's bytes: one record (its mark says last fragment), xid, CALL,
/// RPC version 2, the program, its version, procedure 0, and AUTH_NONE as
/// both the credential and the verifier.
fn null_call(xid: u32, version: u32) -> Vec<u8> {
    let words = [
        xid,
        0, // CALL
        2, // RPC version
        NFS_PROGRAM,
        version,
        0, // NULL
        0, // credential: AUTH_NONE
        0, // of no bytes
        0, // verifier: AUTH_NONE
        0, // of no bytes
    ];
    let body: Vec<u8> = words.iter().flat_map(|w| w.to_be_bytes()).collect();
    let mark = 0x8000_0000u32 | body.len() as u32;
    let mut out = mark.to_be_bytes().to_vec();
    out.extend(body);
    out
}

/// What a reply's first bytes say: a reply to `xid` (accepted or not: a
/// server that refuses the version still answers), or why it is none.
fn read_reply(head: &[u8; 12], xid: u32) -> Result<(), String> {
    let word = |i: usize| u32::from_be_bytes(head[i..i + 4].try_into().expect("4 bytes"));
    if word(4) != xid {
        return Err(format!(
            "a reply to another call (xid {:#x}, asked {xid:#x})",
            word(4)
        ));
    }
    if word(8) != 1 {
        return Err(format!("not an RPC reply (message type {})", word(8)));
    }
    Ok(())
}

/// The NFS version a NULL call names: the export's (`4.2` asks 4), else 4.
pub fn version_of(version: Option<&str>) -> u32 {
    version
        .and_then(|v| v.split('.').next())
        .and_then(|major| major.parse().ok())
        .unwrap_or(4)
}

/// The port named by mount options (`port=N`; 0 or none: [`NFS_PORT`]).
pub fn port_of(options: &[String]) -> u16 {
    options
        .iter()
        .flat_map(|o| o.split(','))
        .filter_map(|o| o.strip_prefix("port="))
        .filter_map(|p| p.parse::<u16>().ok())
        .next_back()
        .filter(|p| *p != 0)
        .unwrap_or(NFS_PORT)
}

/// Asks `server` (a host name, an IPv4 address or a bracketed IPv6 one)
/// a NULL call on `port` and waits for its reply, all within `within`.
/// The error says what failed, for an operator.
pub async fn answers(
    server: &str,
    port: u16,
    version: u32,
    within: Duration,
) -> Result<(), String> {
    let host = server
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or(server)
        .to_string();
    let xid = std::process::id().rotate_left(16)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
    let ask = async move {
        let mut stream = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        stream
            .write_all(&null_call(xid, version))
            .await
            .map_err(|e| format!("the call could not be sent: {e}"))?;
        let mut head = [0u8; 12];
        stream
            .read_exact(&mut head)
            .await
            .map_err(|e| format!("no reply: {e}"))?;
        read_reply(&head, xid)
    };
    match tokio::time::timeout(within, ask).await {
        Ok(answer) => answer,
        Err(_) => Err(format!(
            "no answer to an NFS NULL call within {} s",
            within.as_secs()
        )),
    }
}

#[cfg(test)]
pub(super) mod fake {
    //! A server that answers NULL calls as a test says.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A server that reads one call and answers it as `reply` says.
    pub async fn server(reply: impl Fn(&[u8]) -> Option<Vec<u8>> + Send + 'static) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut call = [0u8; 44];
            s.read_exact(&mut call).await.unwrap();
            match reply(&call) {
                Some(bytes) => s.write_all(&bytes).await.unwrap(),
                // Holds the connection, answering nothing.
                None => std::future::pending::<()>().await,
            }
        });
        port
    }

    /// A reply to `call`: its xid changed by `xid_delta` (0: the call's),
    /// of message type `kind` (1: a reply).
    pub fn reply_to(call: &[u8], xid_delta: u32, kind: u32) -> Vec<u8> {
        let xid = u32::from_be_bytes(call[4..8].try_into().unwrap()) ^ xid_delta;
        // Accepted, AUTH_NONE verifier, PROG_MISMATCH: still an answer.
        let words = [xid, kind, 0, 0, 0, 2, 4, 4];
        let body: Vec<u8> = words.iter().flat_map(|w| w.to_be_bytes()).collect();
        let mut out = (0x8000_0000u32 | body.len() as u32).to_be_bytes().to_vec();
        out.extend(body);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::fake::{reply_to, server};
    use super::*;
    use tokio::net::TcpListener;

    #[test]
    fn the_call_is_a_null_call_of_the_nfs_program() {
        let call = null_call(0x1234_5678, 3);
        assert_eq!(call.len(), 44);
        assert_eq!(&call[0..4], &[0x80, 0, 0, 40]);
        let word = |i: usize| u32::from_be_bytes(call[i..i + 4].try_into().unwrap());
        assert_eq!(word(4), 0x1234_5678);
        assert_eq!((word(8), word(12)), (0, 2));
        assert_eq!((word(16), word(20), word(24)), (100003, 3, 0));
        assert!(call[28..].iter().all(|b| *b == 0));
    }

    #[tokio::test]
    async fn a_server_that_replies_answers() {
        let port = server(|call| {
            assert_eq!(&call[16..20], &NFS_PROGRAM.to_be_bytes());
            Some(reply_to(call, 0, 1))
        })
        .await;
        answers("127.0.0.1", port, 4, Duration::from_secs(5))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn silence_a_closed_port_and_a_wrong_reply_are_not_answers() {
        let silent = server(|_| None).await;
        let t = std::time::Instant::now();
        let e = answers("127.0.0.1", silent, 4, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(e.contains("no answer"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());

        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let e = answers("127.0.0.1", port, 4, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(e.contains("cannot connect"), "{e}");

        let other = server(|call| Some(reply_to(call, 1, 1))).await;
        let e = answers("127.0.0.1", other, 4, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(e.contains("another call"), "{e}");

        let not_reply = server(|call| Some(reply_to(call, 0, 0))).await;
        // Brackets (an IPv6 address's, in the config) are taken off.
        let e = answers("[127.0.0.1]", not_reply, 4, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(e.contains("not an RPC reply"), "{e}");
    }

    #[test]
    fn the_port_and_version_come_from_the_options() {
        assert_eq!(port_of(&[]), 2049);
        assert_eq!(port_of(&["hard,port=20049".into()]), 20049);
        assert_eq!(port_of(&["port=0".into()]), 2049);
        assert_eq!(version_of(Some("4.2")), 4);
        assert_eq!(version_of(Some("3")), 3);
        assert_eq!(version_of(None), 4);
    }
}
