//! Parsing tgtd's and iscsiadm's answers, and checking names, portals and CHAP.

use super::*;

#[test]
fn target_listing_is_parsed() {
    let t = parse_targets(SHOWN);
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].tid, 1);
    assert_eq!(t[0].iqn, "iqn.2026-11.io.ferrovol:cap");
    assert_eq!(t[0].sessions, ["iqn.1993-08.org.debian:01:a4a389dc8c9"]);
    assert_eq!(t[0].luns, [(1, PathBuf::from("/dev/loop0"))]);
    assert_eq!(
        t[0].accounts,
        [("alice".to_string(), false), ("bob".to_string(), true)]
    );
    assert_eq!(t[0].allowed, ["iqn.2026-11.io.test:node-a"]);
    assert_eq!(t[1].tid, 2);
    assert!(t[1].sessions.is_empty() && t[1].luns.is_empty() && t[1].allowed.is_empty());
}

#[test]
fn session_listing_is_parsed() {
    let s = parse_sessions(
        "tcp: [1] 127.0.0.1:3299,1 iqn.2026-11.io.ferrovol:cap (non-flash)\n\
         tcp: [12] [::1]:3260,1 iqn.2026-11.io.ferrovol:v6 (non-flash)\n",
    );
    assert_eq!(
        s,
        [
            Session {
                sid: 1,
                portal: "127.0.0.1:3299".into(),
                iqn: "iqn.2026-11.io.ferrovol:cap".into()
            },
            Session {
                sid: 12,
                portal: "[::1]:3260".into(),
                iqn: "iqn.2026-11.io.ferrovol:v6".into()
            }
        ]
    );
    assert!(parse_sessions("iscsiadm: No active sessions.\n").is_empty());
}

/// The request bytes are what tgtadm itself writes (captured with strace
/// from tgtadm 1.0.85 creating account alice).
#[test]
fn management_requests_match_tgtadm() {
    use target::ipc::*;
    let req = Request::account(OP_NEW, None, "user=alice,password=s3cretpass", false).encode();
    assert_eq!(req.len(), 151);
    assert_eq!(&req[0..8], &[7, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(&req[8..13], b"iscsi");
    assert!(req[13..72].iter().all(|b| *b == 0));
    assert_eq!(&req[72..80], &[0x97, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
    assert!(req[80..88].iter().all(|b| *b == 0));
    assert!(req[88..96].iter().all(|b| *b == 0xff));
    assert!(req[96..120].iter().all(|b| *b == 0));
    assert_eq!(&req[120..], b"user=alice,password=s3cretpass\0");
    // An outgoing bind to target 3; LUN 1 of target 3.
    let bind = Request::account(OP_BIND, Some(3), "user=bob", true).encode();
    assert_eq!(&bind[76..80], &3i32.to_ne_bytes());
    assert_eq!(&bind[108..112], &1u32.to_ne_bytes());
    let lun = Request::lun(OP_NEW, 3, "path=/dev/x").encode();
    assert_eq!(&lun[0..4], &2u32.to_ne_bytes());
    assert_eq!(&lun[88..96], &1u64.to_ne_bytes());
}

/// tgtd's connection listing of one target.
#[test]
fn connection_listing_is_parsed() {
    let text = "Session: 3\n    Connection: 0\n        Initiator: iqn.1993-08.org.debian:01:aa alias: n\n        IP Address: 127.0.0.1\n\
                Session: 4\n    Connection: 0\n        Initiator: iqn.1993-08.org.debian:01:aa\n        IP Address: 10.0.0.1\n";
    let conn = |session, initiator: &str| super::target::Connection {
        session,
        connection: 0,
        initiator: initiator.into(),
    };
    assert_eq!(
        parse_connections(text),
        [
            conn(3, "iqn.1993-08.org.debian:01:aa"),
            conn(4, "iqn.1993-08.org.debian:01:aa")
        ]
    );
    assert!(parse_connections("").is_empty());
    // An initiator line outside a session's connection names nothing.
    assert!(parse_connections("Initiator: iqn.x:y\n").is_empty());
}

/// Closing a connection sends its session and connection ids where
/// tgtadm's `--op delete --mode conn --tid 3 --sid 5 --cid 1` puts them.
#[test]
fn connection_close_request_carries_session_and_connection() {
    use target::ipc::*;
    let req = Request::connection(OP_DELETE, 3, 5, 1).encode();
    assert_eq!(&req[0..4], &MODE_CONNECTION.to_ne_bytes());
    assert_eq!(&req[4..8], &OP_DELETE.to_ne_bytes());
    assert_eq!(&req[76..80], &3i32.to_ne_bytes());
    assert_eq!(&req[80..88], &5u64.to_ne_bytes());
    assert_eq!(&req[96..100], &1u32.to_ne_bytes());
    assert_eq!(req.len(), 121);
}

#[test]
fn names_portals_and_chap_are_checked() {
    assert!(is_iqn("iqn.2026-11.io.ferrovol:a-b.c"));
    assert!(!is_iqn("iqn.2026-11.io.ferrovol:A"));
    assert!(!is_iqn("iqn.x:a b"));
    assert!(!is_iqn("eui.02004567A425678D"));
    for ok in ["127.0.0.1:3260", "storage.example.com:3260", "[::1]:3260"] {
        assert!(is_portal(ok), "{ok}");
    }
    for bad in [
        "127.0.0.1",
        "-x:1",
        "a:b",
        "[zz]:3260",
        "a b:1",
        "host:99999",
    ] {
        assert!(!is_portal(bad), "{bad}");
    }
    assert_eq!(
        IscsiBackend::iqn_for("iqn.2026-11.io.f", "pvc-1"),
        "iqn.2026-11.io.f:pvc-1"
    );
    let odd = IscsiBackend::iqn_for("iqn.2026-11.io.f", "PVC_1");
    assert!(
        odd.starts_with("iqn.2026-11.io.f:v-") && is_iqn(&odd),
        "{odd}"
    );

    let s = |pairs: &[(&str, &str)]| {
        Secrets::new(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    assert_eq!(chap_from(&s(&[])).unwrap(), (None, None));
    let e = chap_from(&s(&[(CHAP_USER, "u"), (CHAP_PASSWORD, "short-one")])).unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    assert!(!e.message.contains("short-one"), "{e}");
    let e = chap_from(&s(&[(CHAP_USER, "u")])).unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    let e = chap_from(&s(&[
        (MUTUAL_USER, "t"),
        (MUTUAL_PASSWORD, "0123456789abc"),
    ]))
    .unwrap_err();
    assert!(e.message.contains("mutual"), "{e}");
    let e = chap_from(&s(&[(CHAP_USER, "u"), (CHAP_PASSWORD, "has,comma-1234")])).unwrap_err();
    assert!(!e.message.contains("has,comma"), "{e}");
}
