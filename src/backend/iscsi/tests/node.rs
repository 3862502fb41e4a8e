//! The node's side: logins, unstage, sessions, multipath, copies' UUIDs.

use super::*;
use crate::plugin::health::Status;

/// A fake sysfs: session `sid` with LUN 1 as disk `disk`.
fn sysfs_session(root: &Path, sid: u32, disk: &str, state: &str, sectors: u64) {
    let session = root.join(format!("sys/class/iscsi_session/session{sid}"));
    let unit = session.join("device/target2:0:0/2:0:0:1/block").join(disk);
    std::fs::create_dir_all(&unit).unwrap();
    std::fs::create_dir_all(session.join("device/target2:0:0/2:0:0:0")).unwrap();
    std::fs::write(session.join("state"), format!("{state}\n")).unwrap();
    let block = root.join("sys/block").join(disk);
    std::fs::create_dir_all(block.join("device")).unwrap();
    std::fs::write(block.join("size"), format!("{sectors}\n")).unwrap();
    // Its device node (a plain file stands in for it).
    std::fs::create_dir_all(root.join("dev")).unwrap();
    std::fs::write(root.join("dev").join(disk), b"").unwrap();
}

/// What the kernel shows of session `sid` besides its state and disks:
/// its target's name, and its connection's persistent address and port.
fn sysfs_identity(root: &Path, sid: u32, iqn: &str, address: &str, port: &str) {
    let session = root.join(format!("sys/class/iscsi_session/session{sid}"));
    std::fs::create_dir_all(&session).unwrap();
    std::fs::write(session.join("targetname"), format!("{iqn}\n")).unwrap();
    let conn = root.join(format!("sys/class/iscsi_connection/connection{sid}:0"));
    std::fs::create_dir_all(&conn).unwrap();
    std::fs::write(conn.join("persistent_address"), format!("{address}\n")).unwrap();
    std::fs::write(conn.join("persistent_port"), format!("{port}\n")).unwrap();
}

/// The sessions are read from sysfs, as iscsiadm lists them (an IPv6
/// portal in brackets), with no process; while an entry is not whole
/// (a session being made: no address yet) iscsiadm is asked instead.
#[tokio::test]
async fn sessions_are_read_from_sysfs_and_asked_of_iscsiadm_while_one_is_being_made() {
    let s = Setup::new();
    let b = s.node();
    let root = s.dir.path();
    sysfs_session(root, 4, "sdc", "LOGGED_IN", 16384);
    sysfs_identity(root, 4, IQN, "10.0.0.5", "3260");
    sysfs_session(root, 5, "sdd", "LOGGED_IN", 16384);
    sysfs_identity(root, 5, IQN, "fd00::6", "3261");
    sysfs_session(root, 6, "sde", "LOGGED_IN", 16384);
    sysfs_identity(root, 6, "iqn.other:lun", "10.0.0.9", "3260");
    let i = b.initiator();
    let found = i.sessions(IQN).await.unwrap();
    assert_eq!(
        found,
        vec![
            Session {
                sid: 4,
                portal: "10.0.0.5:3260".into(),
                iqn: IQN.into()
            },
            Session {
                sid: 5,
                portal: "[fd00::6]:3261".into(),
                iqn: IQN.into()
            },
        ]
    );
    assert!(s.runner.lines().is_empty(), "{:#?}", s.runner.lines());
    // The health check's view: both portals logged in, none down.
    let Paths { down, up } = i.paths("iqn.2026-11.io.ferrovol").await.unwrap();
    assert!(down.is_empty(), "{down:?}");
    assert_eq!(
        up.into_iter().collect::<Vec<_>>(),
        ["10.0.0.5:3260", "[fd00::6]:3261"]
    );
    assert!(s.runner.lines().is_empty());

    // Session 7 is being made: its connection has no address yet.
    sysfs_session(root, 7, "sdf", "FREE", 16384);
    sysfs_identity(root, 7, IQN, "(null)", "3260");
    s.runner.expect(
        "iscsiadm",
        Reply::Ok(format!(
            "{SESSION}tcp: [7] 10.0.0.7:3260,1 {IQN} (non-flash)\n"
        )),
    );
    let found = i.sessions(IQN).await.unwrap();
    assert_eq!(
        found.iter().map(|s| s.sid).collect::<Vec<_>>(),
        [4, 7],
        "iscsiadm's listing, not sysfs's"
    );
    assert_eq!(s.runner.lines(), ["iscsiadm -m session"]);
}

/// A stage after a restart finds the session in sysfs: no login, and no
/// process at all.
#[tokio::test]
async fn a_stage_finds_its_session_in_sysfs_with_no_process() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 16384);
    sysfs_identity(s.dir.path(), 4, IQN, "10.0.0.5", "3260");
    let a = b.node_attach(&id, &stage_ctx(&[])).await.unwrap();
    assert_eq!(
        a,
        Attachment::Device {
            path: s.dir.path().join("dev/sdc")
        }
    );
    assert!(s.runner.lines().is_empty(), "{:#?}", s.runner.lines());
}

/// A disk found in sysfs whose node does not open yet (ENXIO: the kernel
/// has not finished adding it; a unix socket stands in, which opens with
/// the same error) is waited for, not handed on.
#[tokio::test]
async fn a_disk_whose_node_does_not_open_yet_is_waited_for() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 16384);
    sysfs_identity(s.dir.path(), 4, IQN, "10.0.0.5", "3260");
    let node = s.dir.path().join("dev/sdc");
    std::fs::remove_file(&node).unwrap();
    let listener = std::os::unix::net::UnixListener::bind(&node).unwrap();
    let ready = tokio::spawn({
        let node = node.clone();
        async move {
            tokio::time::sleep(std::time::Duration::from_millis(400)).await;
            drop(listener);
            std::fs::remove_file(&node).unwrap();
            std::fs::write(&node, b"").unwrap();
        }
    });
    let started = std::time::Instant::now();
    let a = b.node_attach(&id, &stage_ctx(&[])).await.unwrap();
    assert!(started.elapsed() >= std::time::Duration::from_millis(400));
    assert_eq!(a, Attachment::Device { path: node });
    ready.await.unwrap();
}

/// iscsiadm's node record of target `IQN` at `portal` (`host,port`)
/// under the setup's node database, holding `text`; its path.
fn node_record(root: &Path, portal: &str, text: &str) -> PathBuf {
    let dir = root.join("nodes").join(IQN);
    std::fs::create_dir_all(&dir).unwrap();
    let record = dir.join(portal);
    std::fs::write(&record, text).unwrap();
    record
}

fn stage_ctx(secrets: &[(&str, &str)]) -> AttachContext {
    AttachContext {
        publish_context: BTreeMap::from([
            ("iqn".to_string(), IQN.to_string()),
            ("portals".to_string(), "10.0.0.5:3260".to_string()),
            ("lun".to_string(), "1".to_string()),
        ]),
        volume_context: BTreeMap::new(),
        secrets: Secrets::new(
            secrets
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        readonly: false,
        node_id: NODE.into(),
    }
}

const SESSION: &str = "tcp: [4] 10.0.0.5:3260,1 iqn.2026-11.io.ferrovol:pvc-1 (non-flash)\n";

#[tokio::test]
async fn stage_logs_in_with_chap_from_the_record_file() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    let record = node_record(
        s.dir.path(),
        "10.0.0.5,3260",
        "# BEGIN RECORD 2.1.8\nnode.name = x\nnode.session.auth.authmethod = None\n\
         node.session.timeo.replacement_timeout = 120\n# END RECORD\n",
    );
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 16384);
    s.runner
        .expect(
            "iscsiadm",
            Reply::Fail(21, "iscsiadm: No active sessions.".into()),
        )
        .ok("iscsiadm")
        .ok("iscsiadm")
        .ok("iscsiadm")
        .expect("iscsiadm", Reply::Ok(SESSION.into()));
    let a = b
        .node_attach(
            &id,
            &stage_ctx(&[(CHAP_USER, "alice"), (CHAP_PASSWORD, "alice-secret-01")]),
        )
        .await
        .unwrap();
    assert_eq!(
        a,
        Attachment::Device {
            path: s.dir.path().join("dev/sdc")
        }
    );
    let lines = s.runner.lines();
    assert_eq!(
        lines[1..4],
        [
            format!("iscsiadm -m node -T {IQN} -p 10.0.0.5:3260 -o new"),
            format!(
                "iscsiadm -m node -T {IQN} -p 10.0.0.5:3260 -o update -n node.startup -v manual"
            ),
            format!("iscsiadm -m node -T {IQN} -p 10.0.0.5:3260 --login"),
        ]
    );
    assert!(lines.iter().all(|l| !l.contains("secret")));
    let text = std::fs::read_to_string(&record).unwrap();
    assert!(text.contains("node.session.auth.authmethod = CHAP\nnode.session.auth.username = alice\nnode.session.auth.password = alice-secret-01\nnode.session.timeo.replacement_timeout = 15\n# END RECORD"), "{text}");
    assert!(!text.contains("authmethod = None"));
    // The backend's replacement timeout replaces open-iscsi's.
    assert!(!text.contains("replacement_timeout = 120"), "{text}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&record).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // After a restart the session is found: no second login.
    s.runner.expect("iscsiadm", Reply::Ok(SESSION.into()));
    b.node_attach(&id, &stage_ctx(&[])).await.unwrap();
    assert_eq!(s.runner.lines().len(), lines.len() + 1);

    // A publish context for another volume's target is refused.
    let mut other = stage_ctx(&[]);
    other
        .publish_context
        .insert("iqn".into(), "iqn.2026-11.io.ferrovol:pvc-2".into());
    assert_eq!(
        b.node_attach(&id, &other).await.unwrap_err().kind,
        Kind::InvalidArgument
    );
    let mut bad = stage_ctx(&[]);
    bad.publish_context
        .insert("portals".into(), "10.0.0.5:3260,-oops".into());
    assert_eq!(
        b.node_attach(&id, &bad).await.unwrap_err().kind,
        Kind::InvalidArgument
    );
}

/// A stage asked again after its login was stopped at the deadline:
/// iscsid still has that login under way (it says the session exists
/// before it lists it), and the stage waits for it rather than failing.
#[tokio::test]
async fn a_login_still_under_way_in_iscsid_is_waited_for() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    node_record(s.dir.path(), "10.0.0.5,3260", "node.name = x\n");
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 16384);
    let none = || Reply::Fail(21, "iscsiadm: No active sessions.".into());
    s.runner
        .expect("iscsiadm", none())
        .ok("iscsiadm")
        .ok("iscsiadm")
        .expect(
            "iscsiadm",
            Reply::Fail(
                15,
                "iscsiadm: default: 1 session requested, but 1 already present.".into(),
            ),
        )
        .expect("iscsiadm", none())
        .expect("iscsiadm", none())
        .expect("iscsiadm", Reply::Ok(SESSION.into()));
    let a = b.node_attach(&id, &stage_ctx(&[])).await.unwrap();
    assert_eq!(
        a,
        Attachment::Device {
            path: s.dir.path().join("dev/sdc")
        }
    );
    let lines = s.runner.lines();
    assert_eq!(lines.len(), 7, "{lines:#?}");
    assert!(
        lines[4..].iter().all(|l| l == "iscsiadm -m session"),
        "{lines:#?}"
    );
    // No record was deleted meanwhile: the login goes on through it.
    assert!(lines.iter().all(|l| !l.contains("-o delete")), "{lines:#?}");
}

/// iscsid says a session exists and never lists it: the stage gives up
/// at the login's timeout, UNAVAILABLE (the CO asks again), saying why.
#[tokio::test]
async fn a_login_under_way_that_never_ends_is_unavailable() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    node_record(s.dir.path(), "10.0.0.5,3260", "node.name = x\n");
    s.runner
        .expect("iscsiadm", Reply::Fail(21, String::new()))
        .ok("iscsiadm")
        .ok("iscsiadm")
        .expect("iscsiadm", Reply::Fail(15, String::new()));
    // Every listing after that, one each 200 ms for the login's 2 s and
    // one more: none; then the node record goes (none left either).
    for _ in 0..12 {
        s.runner.expect("iscsiadm", Reply::Fail(21, String::new()));
    }
    let e = b.node_attach(&id, &stage_ctx(&[])).await.unwrap_err();
    assert_eq!(e.kind, Kind::Unavailable, "{e}");
    assert!(e.message.contains("still logging in"), "{e}");
    let lines = s.runner.lines();
    assert_eq!(
        lines.last().unwrap(),
        &format!("iscsiadm -m node -T {IQN} -o delete")
    );
}

#[tokio::test]
async fn a_refused_login_leaves_no_record() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    node_record(s.dir.path(), "10.0.0.5,3260", "node.name = x\n");
    s.runner
        .expect("iscsiadm", Reply::Fail(21, String::new()))
        .ok("iscsiadm")
        .ok("iscsiadm")
        .expect(
            "iscsiadm",
            Reply::Fail(
                24,
                "iscsiadm: initiator reported error (24 - iSCSI login failed due to authorization failure)".into(),
            ),
        )
        .ok("iscsiadm")
        .ok("iscsiadm");
    let e = b
        .node_attach(
            &id,
            &stage_ctx(&[(CHAP_USER, "alice"), (CHAP_PASSWORD, "wrong-secret-01")]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert!(
        e.message.contains("CHAP") && !e.message.contains("wrong-secret"),
        "{e}"
    );
    let lines = s.runner.lines();
    assert_eq!(
        lines[lines.len() - 2..],
        [
            format!("iscsiadm -m node -T {IQN} -p 10.0.0.5:3260 -o delete"),
            format!("iscsiadm -m node -T {IQN} -o delete"),
        ]
    );
}

/// Unstage of volume `iscsi:pvc-1` with one session (sid 4, disk sdc) in
/// kernel state `state`: the disk is deleted; the commands run after the
/// session listing.
async fn unstage_with_a_session(
    s: &Setup,
    b: &IscsiBackend,
    state: &str,
    flushes: bool,
) -> Vec<String> {
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    sysfs_session(s.dir.path(), 4, "sdc", state, 16384);
    s.runner.expect("iscsiadm", Reply::Ok(SESSION.into()));
    if flushes {
        s.runner.ok("blockdev");
    }
    s.runner.ok("iscsiadm").ok("iscsiadm");
    b.node_detach(&id, None).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(s.dir.path().join("sys/block/sdc/device/delete")).unwrap(),
        "1"
    );
    s.runner.lines()[1..].to_vec()
}

#[tokio::test]
async fn unstage_removes_disks_logs_out_and_is_idempotent() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    // The disk's buffers are flushed, then it is deleted, then logout.
    assert_eq!(
        unstage_with_a_session(&s, &b, "LOGGED_IN", true).await,
        [
            format!(
                "blockdev --flushbufs {}",
                s.dir.path().join("dev/sdc").display()
            ),
            "iscsiadm -m session -r 4 --logout".to_string(),
            format!("iscsiadm -m node -T {IQN} -o delete"),
        ]
    );
    // Nothing there: still success; another target's session untouched.
    s.runner
        .expect(
            "iscsiadm",
            Reply::Ok("tcp: [9] 10.0.0.5:3260,1 iqn.2026-11.io.other:x (non-flash)\n".into()),
        )
        .expect(
            "iscsiadm",
            Reply::Fail(21, "iscsiadm: No records found".into()),
        );
    b.node_detach(&id, None).await.unwrap();
    assert!(!s.runner.lines().iter().any(|l| l.contains("-r 9")));
}

/// A session that lost its target (its node fenced at detach) takes no
/// flush: its disk is removed unflushed, and the logout and the record's
/// removal follow as for a live one.
#[tokio::test]
async fn unstage_of_a_failed_session_removes_its_disk_unflushed() {
    let s = Setup::new();
    let b = s.node();
    assert_eq!(
        unstage_with_a_session(&s, &b, "FAILED", false).await,
        [
            "iscsiadm -m session -r 4 --logout".to_string(),
            format!("iscsiadm -m node -T {IQN} -o delete"),
        ]
    );
}

/// Before an unstage unmounts: a logged-in session is left alone; one that
/// lost its target and does not log in again within the grace is logged
/// out (its disk removed unflushed), so the unmount does not wait on I/O
/// that can never complete.
#[tokio::test]
async fn a_session_that_lost_its_target_is_let_go_before_the_unmount() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    let dev = Attachment::Device {
        path: "/dev/sdc".into(),
    };
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 16384);
    s.runner.expect("iscsiadm", Reply::Ok(SESSION.into()));
    b.node_release_io(&id, &dev).await.unwrap();
    assert_eq!(s.runner.lines().len(), 1, "only the listing");

    sysfs_session(s.dir.path(), 4, "sdc", "FAILED", 16384);
    s.runner
        .expect("iscsiadm", Reply::Ok(SESSION.into()))
        .expect("iscsiadm", Reply::Ok(SESSION.into()))
        .ok("iscsiadm")
        .ok("iscsiadm");
    b.node_release_io(&id, &dev).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(s.dir.path().join("sys/block/sdc/device/delete")).unwrap(),
        "1"
    );
    assert_eq!(
        s.runner.lines()[3..],
        [
            "iscsiadm -m session -r 4 --logout".to_string(),
            format!("iscsiadm -m node -T {IQN} -o delete"),
        ]
    );
}

#[tokio::test]
async fn rescan_and_condition_read_the_session() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 32768);
    s.runner
        .expect("iscsiadm", Reply::Ok(SESSION.into()))
        .ok("iscsiadm")
        .expect("iscsiadm", Reply::Ok(SESSION.into()));
    let dev = Attachment::Device {
        path: "/dev/sdc".into(),
    };
    assert_eq!(b.node_refresh_size(&id, &dev).await.unwrap(), 16 << 20);
    assert_eq!(
        std::fs::read_to_string(s.dir.path().join("sys/block/sdc/device/rescan")).unwrap(),
        "1"
    );

    s.runner.expect("iscsiadm", Reply::Ok(SESSION.into()));
    assert_eq!(b.node_health(&id, &dev).await.unwrap(), vec![]);
    sysfs_session(s.dir.path(), 4, "sdc", "FAILED", 32768);
    s.runner.expect("iscsiadm", Reply::Ok(SESSION.into()));
    let c = b.node_health(&id, &dev).await.unwrap().remove(0);
    assert!(c.message.contains("FAILED"), "{c:?}");
    assert_eq!(c.reason, reasons::SessionDown);
    s.runner.expect("iscsiadm", Reply::Fail(21, String::new()));
    let c = b.node_health(&id, &dev).await.unwrap().remove(0);
    assert!(c.message.contains("no iSCSI session"), "{c:?}");
    assert_eq!(c.reason, reasons::SessionMissing);
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 32768);
    s.runner.expect("iscsiadm", Reply::Ok(SESSION.into()));
    let gone = Attachment::Device {
        path: "/dev/sdz".into(),
    };
    let c = b.node_health(&id, &gone).await.unwrap().remove(0);
    assert_eq!(c.reason, reasons::LunMissing);
}

#[test]
fn the_initiator_name_is_read_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("initiatorname.iscsi");
    std::fs::write(
        &f,
        "## comment\nInitiatorName=iqn.1993-08.org.debian:01:abc\n",
    )
    .unwrap();
    assert_eq!(
        initiator::initiator_name(&f).unwrap(),
        "iqn.1993-08.org.debian:01:abc"
    );
    std::fs::write(&f, "InitiatorName=not a name\n").unwrap();
    assert!(initiator::initiator_name(&f).is_err());
    assert!(initiator::initiator_name(&dir.path().join("missing")).is_err());
}

/// With multipath: a login through each portal, the map made over the two
/// disks (found through their holders), and at unstage the map flushed
/// before the disks go and the sessions end.
#[tokio::test]
async fn multipath_logs_in_everywhere_and_stages_the_map() {
    let s = Setup::new();
    let mut settings = s.settings();
    settings.multipath = true;
    settings.portals = vec!["10.0.0.5:3260".into(), "10.0.0.6:3260".into()];
    let b = IscsiBackend::new(
        "iscsi",
        settings,
        s.runner.clone(),
        None,
        s.dir.path().join("r"),
    )
    .unwrap()
    .with_roots(s.dir.path());
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 16384);
    sysfs_session(s.dir.path(), 5, "sdd", "LOGGED_IN", 16384);
    let both = format!("{SESSION}tcp: [5] 10.0.0.6:3260,1 {IQN} (non-flash)\n");
    node_record(s.dir.path(), "10.0.0.6,3260", "node.name = x\n");
    // One path is there (after a restart); the other is logged in now.
    s.runner
        .expect("iscsiadm", Reply::Ok(SESSION.into()))
        .ok("iscsiadm")
        .ok("iscsiadm")
        .ok("iscsiadm")
        .expect("iscsiadm", Reply::Ok(both.clone()))
        .ok("multipath");
    // An encrypted volume's mapping over a disk is a holder too, not a map.
    let sys = s.dir.path().join("sys");
    std::fs::create_dir_all(sys.join("block/sdc/holders/dm-4")).unwrap();
    std::fs::create_dir_all(sys.join("block/dm-4/dm")).unwrap();
    std::fs::write(sys.join("block/dm-4/dm/name"), "fvc-0123\n").unwrap();
    std::fs::write(
        sys.join("block/dm-4/dm/uuid"),
        "CRYPT-LUKS2-0123-fvc-0123\n",
    )
    .unwrap();
    // The kernel makes the map a moment after `multipath` runs.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for disk in ["sdc", "sdd"] {
            std::fs::create_dir_all(sys.join("block").join(disk).join("holders/dm-3")).unwrap();
        }
        std::fs::create_dir_all(sys.join("block/dm-3/dm")).unwrap();
        std::fs::write(sys.join("block/dm-3/dm/name"), "360000000000000f0aa\n").unwrap();
        std::fs::write(
            sys.join("block/dm-3/dm/uuid"),
            "mpath-360000000000000f0aa\n",
        )
        .unwrap();
    });
    let mut ctx = stage_ctx(&[]);
    ctx.publish_context
        .insert("portals".into(), "10.0.0.5:3260,10.0.0.6:3260".into());
    let a = b.node_attach(&id, &ctx).await.unwrap();
    assert_eq!(
        a,
        Attachment::Device {
            path: s.dir.path().join("dev/mapper/360000000000000f0aa")
        }
    );
    let lines = s.runner.lines();
    assert_eq!(
        lines[3],
        format!("iscsiadm -m node -T {IQN} -p 10.0.0.6:3260 --login")
    );
    assert_eq!(
        lines.last().unwrap(),
        &format!("multipath {}", s.dir.path().join("dev/sdc").display())
    );

    // Healthy; then a path down shows.
    s.runner.expect("iscsiadm", Reply::Ok(both.clone()));
    s.runner.expect("iscsiadm", Reply::Ok(both.clone()));
    let map = Attachment::Device {
        path: s.dir.path().join("dev/mapper/360000000000000f0aa"),
    };
    assert_eq!(b.node_health(&id, &map).await.unwrap(), vec![]);
    std::fs::write(
        s.dir.path().join("sys/class/iscsi_session/session5/state"),
        "FAILED\n",
    )
    .unwrap();
    s.runner.expect("iscsiadm", Reply::Ok(both.clone()));
    s.runner.expect("iscsiadm", Reply::Ok(both.clone()));
    let c = b.node_health(&id, &map).await.unwrap().remove(0);
    assert!(
        c.message.contains("10.0.0.6:3260") && c.message.contains("down"),
        "{c:?}"
    );
    assert_eq!((c.status, c.reason), (Status::Degraded, reasons::PathDown));

    // Unstage flushes the map first; a map that stays (held open) stops it
    // before any disk or session is touched. A flush refused for a moment
    // (udev probing the map) is tried again.
    s.runner
        .expect("iscsiadm", Reply::Ok(both.clone()))
        .expect(
            "multipath",
            Reply::Fail(1, "360000000000000f0aa: map in use".into()),
        )
        .ok("multipath");
    let e = b.node_detach(&id, Some(&map)).await.unwrap_err();
    assert!(e.message.contains("still there"), "{e}");
    let lines = s.runner.lines();
    assert_eq!(
        lines[lines.len() - 2..],
        [
            "multipath -f 360000000000000f0aa",
            "multipath -f 360000000000000f0aa"
        ]
    );
    // Once it is gone, the disks and both sessions go; the disk of the
    // path that is down goes unflushed.
    for disk in ["sdc", "sdd"] {
        std::fs::remove_dir_all(
            s.dir
                .path()
                .join("sys/block")
                .join(disk)
                .join("holders/dm-3"),
        )
        .unwrap();
    }
    s.runner
        .expect("iscsiadm", Reply::Ok(both.clone()))
        .ok("blockdev")
        .ok("iscsiadm")
        .ok("iscsiadm")
        .ok("iscsiadm");
    b.node_detach(&id, Some(&map)).await.unwrap();
    let lines = s.runner.lines();
    let n = lines.len();
    let flush = |disk: &str| {
        format!(
            "blockdev --flushbufs {}",
            s.dir.path().join("dev").join(disk).display()
        )
    };
    assert_eq!(
        lines[n - 5..n - 1],
        [
            "iscsiadm -m session".to_string(),
            flush("sdc"),
            "iscsiadm -m session -r 4 --logout".to_string(),
            "iscsiadm -m session -r 5 --logout".to_string(),
        ]
    );
    assert_eq!(
        lines.last().unwrap(),
        &format!("iscsiadm -m node -T {IQN} -o delete")
    );
}

/// A copy made on the controller still has its source's filesystem UUID;
/// the nodes mount it, so they renew it: ControllerPublish hands them a
/// token until the controller sees the device with a UUID of its own, and
/// each node renews once per token.
#[tokio::test]
async fn a_copy_token_goes_to_nodes_until_the_uuid_changes_and_each_node_renews_once() {
    let s = Setup::new();
    let _tgtd = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    b.create_volume(&create("pvc-src")).await.unwrap();
    // A clone: the store marks it; CreateVolume takes it over with the
    // UUID it carries.
    let mut req = create("pvc-copy");
    req.source = Some(ContentSource::Volume(
        VolumeId::parse("iscsi:pvc-src").unwrap(),
    ));
    s.runner.expect("blkid", Reply::Ok("1111-2222\n".into()));
    b.create_volume(&req).await.unwrap();
    assert!(
        s.store.copies.lock().unwrap().is_empty(),
        "the record has it now"
    );
    assert!(s
        .store
        .calls()
        .contains(&"copy done iscsi-store:pvc-copy".to_string()));
    let id = VolumeId::parse("iscsi:pvc-copy").unwrap();
    assert_eq!(
        b.load(&id).unwrap().unwrap().copy.unwrap().uuid,
        "1111-2222"
    );

    // Published: the device still shows the source's UUID, so the token goes
    // to the node.
    s.runner.expect("blkid", Reply::Ok("1111-2222\n".into()));
    let ctx = b.controller_attach(&id, &attach_req(&[])).await.unwrap();
    let token = ctx.get(CTX_FS_COPY).expect("a copy token").clone();
    assert!(is_token(&token), "{token}");
    assert!(s
        .runner
        .lines()
        .last()
        .unwrap()
        .starts_with("blkid -p -o value -s UUID /dev/loop7"));

    // The node renews under that token once.
    let node = s.node();
    let stage = AttachContext {
        publish_context: ctx.clone(),
        ..AttachContext::default()
    };
    assert!(node.node_copy_pending(&id, &stage).await.unwrap());
    node.node_copy_done(&id, &stage).await.unwrap();
    assert!(
        !node.node_copy_pending(&id, &stage).await.unwrap(),
        "a restage does not renew again"
    );
    let mut other = stage.clone();
    other
        .publish_context
        .insert(CTX_FS_COPY.into(), "0000-1111".into());
    assert!(
        node.node_copy_pending(&id, &other).await.unwrap(),
        "a new token renews again"
    );
    let mut bad = stage.clone();
    bad.publish_context
        .insert(CTX_FS_COPY.into(), "../../x".into());
    assert_eq!(
        node.node_copy_pending(&id, &bad).await.unwrap_err().kind,
        Kind::InvalidArgument
    );
    // Not a copy: nothing to renew.
    let mut plain = stage.clone();
    plain.publish_context.remove(CTX_FS_COPY);
    assert!(!node.node_copy_pending(&id, &plain).await.unwrap());

    // Published again after the renewal: the device shows its own UUID, the
    // copy is let go and no token is sent.
    s.runner.expect("blkid", Reply::Ok("3333-4444\n".into()));
    let ctx = b.controller_attach(&id, &attach_req(&[])).await.unwrap();
    assert!(!ctx.contains_key(CTX_FS_COPY), "{ctx:?}");
    assert!(b.load(&id).unwrap().unwrap().copy.is_none());
    // And later publishes ask nothing more of the device.
    let before = s.runner.lines().len();
    b.controller_attach(&id, &attach_req(&[])).await.unwrap();
    assert!(s.runner.lines()[before..]
        .iter()
        .all(|l| !l.starts_with("blkid")));
}

/// The storage as this node sees it: this driver's sessions, by state.
#[tokio::test]
async fn storage_health_counts_the_sessions_that_are_down() {
    use crate::plugin::health::StorageStatus;
    let s = Setup::new();
    let b = s.node();
    let two = "tcp: [4] 10.0.0.5:3260,1 iqn.2026-11.io.ferrovol:pvc-1 (non-flash)\n\
               tcp: [5] 10.0.0.6:3260,1 iqn.2026-11.io.ferrovol:pvc-1 (non-flash)\n\
               tcp: [6] 10.0.0.9:3260,1 iqn.other:lun (non-flash)\n";
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 32768);
    sysfs_session(s.dir.path(), 5, "sdd", "LOGGED_IN", 32768);
    // Another driver's session, down: not ours to report.
    sysfs_session(s.dir.path(), 6, "sde", "FAILED", 32768);
    s.runner.expect("iscsiadm", Reply::Ok(two.into()));
    assert_eq!(b.storage_findings().await, vec![]);
    // One path down, the other up: degraded.
    sysfs_session(s.dir.path(), 5, "sdd", "FAILED", 32768);
    s.runner.expect("iscsiadm", Reply::Ok(two.into()));
    let f = b.storage_findings().await;
    assert_eq!(
        (f[0].status, f[0].reason),
        (StorageStatus::Degraded, reasons::PathDown),
        "{f:?}"
    );
    assert!(f[0].message.contains("10.0.0.6:3260"), "{f:?}");
    // Both down: unreachable from here.
    sysfs_session(s.dir.path(), 4, "sdc", "FAILED", 32768);
    s.runner.expect("iscsiadm", Reply::Ok(two.into()));
    let f = b.storage_findings().await;
    assert_eq!(
        (f[0].status, f[0].reason),
        (StorageStatus::Unreachable, reasons::SessionDown),
        "{f:?}"
    );
    // No session at all: nothing down.
    s.runner.expect("iscsiadm", Reply::Fail(21, String::new()));
    assert_eq!(b.storage_findings().await, vec![]);
}
