//! The iscsi backend over the scripted runner, with tgtadm and iscsiadm
//! outputs captured from the real tools, an in-memory store, a fake tgtd
//! management socket and a fake sysfs tree.

use super::initiator::{parse_sessions, Session};
use super::target::{parse_connections, parse_targets};
use super::*;
use crate::error::Kind;
use crate::exec::{FakeRunner, Reply};
use crate::plugin::{locator_for_name, AccessType, VolumeCapability};
use std::sync::Mutex as StdMutex;

/// `tgtadm --op show --mode target` with a logged-in initiator, as tgt
/// 1.0.85 prints it.
const SHOWN: &str = "Target 1: iqn.2026-11.io.ferrovol:cap
    System information:
        Driver: iscsi
        State: ready
    I_T nexus information:
        I_T nexus: 1
            Initiator: iqn.1993-08.org.debian:01:a4a389dc8c9 alias: ferrovol-guest
            Connection: 0
                IP Address: 127.0.0.1
    LUN information:
        LUN: 0
            Type: controller
            SCSI ID: IET     00010000
            SCSI SN: beaf10
            Size: 0 MB, Block size: 1
            Online: Yes
            Backing store type: null
            Backing store path: None
            Backing store flags: 
        LUN: 1
            Type: disk
            SCSI ID: IET     00010001
            SCSI SN: beaf11
            Size: 8 MB, Block size: 512
            Backing store type: rdwr
            Backing store path: /dev/loop0
            Backing store flags: 
    Account information:
        alice
        bob (outgoing)
    ACL information:
        10.0.0.1
        iqn.2026-11.io.test:node-a
Target 2: iqn.2026-11.io.ferrovol:idle
    System information:
        Driver: iscsi
        State: ready
    I_T nexus information:
    LUN information:
    Account information:
    ACL information:
";

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

/// A store that keeps volumes in memory and records what it is asked.
#[derive(Default)]
struct MemStore {
    sizes: StdMutex<BTreeMap<String, u64>>,
    calls: StdMutex<Vec<String>>,
    /// Copies whose filesystem UUID is still their source's.
    copies: StdMutex<BTreeSet<String>>,
    /// A volume whose detach hangs (a store that does not answer) until
    /// the test lets it go: (locator, entered, release).
    stuck: StdMutex<Option<Stuck>>,
}

type Stuck = (String, Arc<tokio::sync::Notify>, Arc<tokio::sync::Notify>);

impl MemStore {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn note(&self, s: String) {
        self.calls.lock().unwrap().push(s);
    }
}

#[async_trait::async_trait]
impl Backend for MemStore {
    fn name(&self) -> &str {
        "iscsi-store"
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    fn validate_parameters(&self, _: &BTreeMap<String, String>) -> Result<()> {
        Ok(())
    }

    fn access_modes(&self) -> Vec<AccessMode> {
        crate::plugin::SINGLE_NODE_MODES.to_vec()
    }

    fn provisioner(&self) -> Option<&dyn Provisioner> {
        Some(self)
    }

    fn expander(&self) -> Option<&dyn Expander> {
        Some(self)
    }

    fn stager(&self) -> Option<&dyn Stager> {
        Some(self)
    }

    fn device_mounter(&self) -> Option<&dyn DeviceMounter> {
        Some(self)
    }
}

#[async_trait::async_trait]
impl Provisioner for MemStore {
    fn clones(&self) -> bool {
        true
    }

    async fn get_volume(&self, id: &VolumeId, _: &Secrets) -> Result<Option<VolumeInfo>> {
        let size = self.sizes.lock().unwrap().get(id.locator()).copied();
        Ok(size.map(|capacity_bytes| VolumeInfo {
            id: id.clone(),
            capacity_bytes,
            context: BTreeMap::new(),
            source: None,
        }))
    }

    async fn list_volumes(&self, _: &Page) -> Result<Vec<VolumeInfo>> {
        Err(Error::internal("the store double lists nothing"))
    }

    async fn capacity(&self, _: &BTreeMap<String, String>) -> Result<Capacity> {
        Err(Error::internal("the store double has no capacity"))
    }

    async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeInfo> {
        let locator = locator_for_name(&req.name);
        self.note(format!("create {locator}"));
        if req.source.is_some() {
            self.copies.lock().unwrap().insert(locator.clone());
        }
        let size = *self
            .sizes
            .lock()
            .unwrap()
            .entry(locator.clone())
            .or_insert(req.required_bytes);
        Ok(VolumeInfo {
            id: VolumeId::new("iscsi-store", &locator)?,
            capacity_bytes: size,
            context: BTreeMap::new(),
            source: None,
        })
    }

    async fn delete_volume(&self, id: &VolumeId, _: &Secrets) -> Result<()> {
        self.note(format!("delete {id}"));
        self.sizes.lock().unwrap().remove(id.locator());
        Ok(())
    }
}

#[async_trait::async_trait]
impl Expander for MemStore {
    fn online(&self) -> bool {
        true
    }

    async fn expand_volume(
        &self,
        id: &VolumeId,
        required: u64,
        _: u64,
        _: &Secrets,
    ) -> Result<u64> {
        self.note(format!("expand {id} {required}"));
        self.sizes
            .lock()
            .unwrap()
            .insert(id.locator().into(), required);
        Ok(required)
    }
}

#[async_trait::async_trait]
impl Stager for MemStore {
    async fn node_attach(&self, id: &VolumeId, _: &AttachContext) -> Result<Attachment> {
        self.note(format!("attach {id}"));
        Ok(Attachment::Device {
            path: "/dev/loop7".into(),
        })
    }

    async fn node_detach(&self, id: &VolumeId, a: Option<&Attachment>) -> Result<()> {
        self.note(format!("detach {id} {}", a.is_some()));
        let stuck = self.stuck.lock().unwrap().clone();
        if let Some((locator, entered, release)) = stuck {
            if locator == id.locator() {
                entered.notify_one();
                release.notified().await;
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl DeviceMounter for MemStore {
    async fn node_refresh_size(&self, id: &VolumeId, _: &Attachment) -> Result<u64> {
        self.note(format!("refresh {id}"));
        Ok(self.sizes.lock().unwrap()[id.locator()])
    }

    async fn node_copy_pending(&self, id: &VolumeId, _: &AttachContext) -> Result<bool> {
        Ok(self.copies.lock().unwrap().contains(id.locator()))
    }

    async fn node_copy_done(&self, id: &VolumeId, _: &AttachContext) -> Result<()> {
        self.note(format!("copy done {id}"));
        self.copies.lock().unwrap().remove(id.locator());
        Ok(())
    }
}

/// One target of the [`FakeTgtd`].
#[derive(Debug, Clone, Default)]
struct FakeTarget {
    iqn: String,
    lun1: Option<String>,
    /// Parameters LUN 1 was updated with, in order.
    updates: Vec<String>,
    acl: BTreeSet<String>,
    incoming: Vec<String>,
    outgoing: Option<String>,
    sessions: Vec<String>,
}

/// What the [`FakeTgtd`] holds.
#[derive(Debug, Default)]
struct TgtdState {
    targets: BTreeMap<u32, FakeTarget>,
    accounts: BTreeMap<String, String>,
    /// Every request: (mode, op, tid, parameters).
    requests: Vec<(u32, u32, i32, String)>,
    /// Refusals to give: the next request of (mode, op) gets the code.
    refuse: Vec<(u32, u32, u32)>,
}

/// tgtd's management socket, in memory: targets, LUN 1, ACLs, accounts and
/// sessions, with tgtd's refusals (taken ids and names, what is bound
/// already or is not, a target with sessions), so the backend is tested
/// against the protocol and the state it leaves, not a script.
struct FakeTgtd {
    state: Arc<StdMutex<TgtdState>>,
    socket: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl FakeTgtd {
    fn start(dir: &Path) -> Self {
        let state: Arc<StdMutex<TgtdState>> = Arc::default();
        let socket = dir.join("socket.0");
        let task = Self::serve(&socket, state.clone());
        FakeTgtd {
            state,
            socket,
            task,
        }
    }

    fn serve(socket: &Path, state: Arc<StdMutex<TgtdState>>) -> tokio::task::JoinHandle<()> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut header = vec![0u8; 120];
                s.read_exact(&mut header).await.unwrap();
                let len = u32::from_ne_bytes(header[72..76].try_into().unwrap()) as usize;
                let mut rest = vec![0u8; len - 120];
                s.read_exact(&mut rest).await.unwrap();
                let (err, text) = state.lock().unwrap().answer(&header, &rest);
                let mut rsp = err.to_ne_bytes().to_vec();
                rsp.extend(((8 + text.len()) as u32).to_ne_bytes());
                rsp.extend(text.as_bytes());
                s.write_all(&rsp).await.unwrap();
            }
        })
    }

    /// tgtd restarts: every target is gone, the socket is a new one.
    fn restart(&mut self) {
        self.task.abort();
        self.state.lock().unwrap().targets.clear();
        self.task = Self::serve(&self.socket, self.state.clone());
    }

    fn target(&self, iqn: &str) -> Option<(u32, FakeTarget)> {
        let st = self.state.lock().unwrap();
        st.targets
            .iter()
            .find(|(_, t)| t.iqn == iqn)
            .map(|(tid, t)| (*tid, t.clone()))
    }

    fn requests(&self) -> Vec<(u32, u32, i32, String)> {
        self.state.lock().unwrap().requests.clone()
    }

    fn refuse_next(&self, mode: u32, op: u32, code: u32) {
        self.state.lock().unwrap().refuse.push((mode, op, code));
    }

    fn edit(&self, f: impl FnOnce(&mut TgtdState)) {
        f(&mut self.state.lock().unwrap())
    }
}

impl TgtdState {
    fn answer(&mut self, header: &[u8], rest: &[u8]) -> (u32, String) {
        use target::ipc::*;
        let word = |at: usize| u32::from_ne_bytes(header[at..at + 4].try_into().unwrap());
        let (mode, op) = (word(0), word(4));
        assert_eq!(&header[8..13], b"iscsi");
        let tid = word(76) as i32;
        let outgoing = word(108) == 1;
        let params = String::from_utf8(rest[..rest.len() - 1].to_vec()).unwrap();
        assert_eq!(rest.last(), Some(&0), "parameters end in NUL");
        self.requests.push((mode, op, tid, params.clone()));
        if let Some(i) = self.refuse.iter().position(|r| (r.0, r.1) == (mode, op)) {
            return (self.refuse.remove(i).2, String::new());
        }
        let param = |key: &str| {
            params
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
                .map(str::to_string)
        };
        let tid_u = tid as u32;
        match (mode, op) {
            (MODE_TARGET, OP_SHOW) if tid == -1 => (0, self.listing()),
            (MODE_TARGET, OP_NEW) => {
                let iqn = param("targetname").expect("targetname");
                if self.targets.contains_key(&tid_u) || self.targets.values().any(|t| t.iqn == iqn) {
                    return (TARGET_EXIST, String::new());
                }
                self.targets.insert(tid_u, FakeTarget { iqn, ..Default::default() });
                (0, String::new())
            }
            (MODE_TARGET, OP_DELETE) => match self.targets.get(&tid_u) {
                None => (NO_TARGET, String::new()),
                Some(t) if !t.sessions.is_empty() => (TARGET_ACTIVE, String::new()),
                Some(_) => {
                    self.targets.remove(&tid_u);
                    (0, String::new())
                }
            },
            (MODE_TARGET, OP_BIND | OP_UNBIND) => {
                let name = param("initiator-name").expect("initiator-name");
                let Some(t) = self.targets.get_mut(&tid_u) else {
                    return (NO_TARGET, String::new());
                };
                match (op, t.acl.contains(&name)) {
                    (OP_BIND, true) => (ACL_EXIST, String::new()),
                    (OP_UNBIND, false) => (ACL_NOEXIST, String::new()),
                    (OP_BIND, false) => {
                        t.acl.insert(name);
                        (0, String::new())
                    }
                    _ => {
                        t.acl.remove(&name);
                        (0, String::new())
                    }
                }
            }
            (MODE_DEVICE, OP_NEW | OP_UPDATE) => {
                assert_eq!(u64::from_ne_bytes(header[88..96].try_into().unwrap()), 1);
                let Some(t) = self.targets.get_mut(&tid_u) else {
                    return (NO_TARGET, String::new());
                };
                match (op, &t.lun1) {
                    (OP_NEW, Some(_)) => (LUN_EXIST, String::new()),
                    (OP_NEW, None) => {
                        t.lun1 = Some(param("path").expect("path"));
                        (0, String::new())
                    }
                    (_, None) => (NO_LUN, String::new()),
                    (_, Some(_)) => {
                        t.updates.push(params.clone());
                        (0, String::new())
                    }
                }
            }
            // Session N is the Nth of the target's sessions, connection 0.
            (MODE_CONNECTION, OP_DELETE) => {
                let sid = u64::from_ne_bytes(header[80..88].try_into().unwrap()) as usize;
                let cid = word(96);
                match self.targets.get_mut(&tid_u) {
                    None => (NO_TARGET, String::new()),
                    Some(t) if sid == 0 || sid > t.sessions.len() => (NO_SESSION, String::new()),
                    Some(_) if cid != 0 => (NO_CONNECTION, String::new()),
                    Some(t) => {
                        t.sessions[sid - 1] = String::new();
                        (0, String::new())
                    }
                }
            }
            (MODE_CONNECTION, OP_SHOW) => match self.targets.get(&tid_u) {
                None => (NO_TARGET, String::new()),
                Some(t) => (
                    0,
                    t.sessions
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| !s.is_empty())
                        .map(|(i, s)| {
                            format!("Session: {}\n\tConnection: 0\n\t\tInitiator: {s}\n\t\tIP Address: 127.0.0.1\n", i + 1)
                        })
                        .collect(),
                ),
            },
            (MODE_ACCOUNT, OP_NEW) => {
                let user = param("user").expect("user");
                if self.accounts.contains_key(&user) {
                    return (USER_EXIST, String::new());
                }
                self.accounts.insert(user, param("password").expect("password"));
                (0, String::new())
            }
            (MODE_ACCOUNT, OP_BIND | OP_UNBIND) => {
                let user = param("user").expect("user");
                if !self.accounts.contains_key(&user) {
                    return (NO_USER, String::new());
                }
                let Some(t) = self.targets.get_mut(&tid_u) else {
                    return (NO_TARGET, String::new());
                };
                match (op, outgoing) {
                    (OP_BIND, true) if t.outgoing.is_some() => (OUTACCOUNT_EXIST, String::new()),
                    (OP_BIND, true) => {
                        t.outgoing = Some(user);
                        (0, String::new())
                    }
                    (OP_BIND, false) if t.incoming.contains(&user) => (USER_EXIST, String::new()),
                    (OP_BIND, false) => {
                        t.incoming.push(user);
                        (0, String::new())
                    }
                    (_, true) if t.outgoing.as_ref() == Some(&user) => {
                        t.outgoing = None;
                        (0, String::new())
                    }
                    (_, false) if t.incoming.contains(&user) => {
                        t.incoming.retain(|u| *u != user);
                        (0, String::new())
                    }
                    _ => (NO_USER, String::new()),
                }
            }
            other => panic!("the fake tgtd has no answer for {other:?}"),
        }
    }

    /// `--op show --mode target`, as tgt 1.0.85 lays it out.
    fn listing(&self) -> String {
        let mut out = String::new();
        for (tid, t) in &self.targets {
            let sessions: Vec<&str> = t.sessions.iter().map(String::as_str).collect();
            let acl: Vec<&str> = t.acl.iter().map(String::as_str).collect();
            let mut accounts: Vec<String> = t.incoming.clone();
            accounts.extend(t.outgoing.iter().map(|o| format!("{o} (outgoing)")));
            let accounts: Vec<&str> = accounts.iter().map(String::as_str).collect();
            out += &target_row(*tid, &t.iqn, &sessions, &acl, &accounts);
        }
        out
    }
}

struct Setup {
    dir: tempfile::TempDir,
    runner: Arc<FakeRunner>,
    store: Arc<MemStore>,
}

impl Setup {
    fn new() -> Self {
        Setup {
            dir: tempfile::tempdir().unwrap(),
            runner: Arc::new(FakeRunner::new()),
            store: Arc::new(MemStore::default()),
        }
    }

    fn settings(&self) -> IscsiSettings {
        IscsiSettings {
            iqn_prefix: "iqn.2026-11.io.ferrovol".into(),
            portals: vec!["10.0.0.5:3260".into()],
            store: None,
            control_port: 0,
            tgt_socket_dir: self.dir.path().to_path_buf(),
            initiator_name_file: self.dir.path().join("initiatorname.iscsi"),
            node_db: self.dir.path().join("nodes"),
            multipath: false,
            login_timeout: 2,
            replacement_timeout: 15,
        }
    }

    /// Volume `iscsi:pvc-1`, made.
    async fn created(&self, b: &IscsiBackend) -> VolumeId {
        b.create_volume(&create("pvc-1")).await.unwrap();
        VolumeId::parse("iscsi:pvc-1").unwrap()
    }

    fn backend(&self) -> IscsiBackend {
        IscsiBackend::new(
            "iscsi",
            self.settings(),
            self.runner.clone(),
            Some(self.store.clone()),
            self.dir.path().join("records"),
        )
        .unwrap()
        .with_roots(self.dir.path())
    }

    /// A node-side backend (no store).
    fn node(&self) -> IscsiBackend {
        IscsiBackend::new(
            "iscsi",
            self.settings(),
            self.runner.clone(),
            None,
            self.dir.path().join("records"),
        )
        .unwrap()
        .with_roots(self.dir.path())
    }
}

fn create(name: &str) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        required_bytes: 8 << 20,
        limit_bytes: 0,
        capabilities: vec![VolumeCapability {
            access: AccessType::Block,
            mode: AccessMode::SingleNodeWriter,
        }],
        parameters: BTreeMap::new(),
        metadata: BTreeMap::new(),
        source: None,
        secrets: Secrets::default(),
    }
}

fn target_row(
    tid: u32,
    iqn: &str,
    sessions: &[&str],
    allowed: &[&str],
    accounts: &[&str],
) -> String {
    let mut t = format!("Target {tid}: {iqn}\n    System information:\n        Driver: iscsi\n    I_T nexus information:\n");
    for (i, s) in sessions.iter().enumerate() {
        t += &format!(
            "        I_T nexus: {}\n            Initiator: {s} alias: n\n",
            i + 1
        );
    }
    t += "    LUN information:\n        LUN: 1\n            Backing store path: /dev/loop7\n    Account information:\n";
    for a in accounts {
        t += &format!("        {a}\n");
    }
    t += "    ACL information:\n";
    for a in allowed {
        t += &format!("        {a}\n");
    }
    t
}

const IQN: &str = "iqn.2026-11.io.ferrovol:pvc-1";
const NODE: &str = "worker-1/iqn.1993-08.org.debian:01:aa";
const INITIATOR: &str = "iqn.1993-08.org.debian:01:aa";

fn attach_req(secrets: &[(&str, &str)]) -> ControllerAttach {
    ControllerAttach {
        node_id: NODE.into(),
        capability: VolumeCapability {
            access: AccessType::Block,
            mode: AccessMode::SingleNodeWriter,
        },
        readonly: false,
        volume_context: BTreeMap::new(),
        secrets: Secrets::new(
            secrets
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
    }
}

#[tokio::test]
async fn create_makes_one_target_and_a_retry_finds_it() {
    use target::ipc::*;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    // Target 4 is there already.
    t.edit(|st| {
        st.targets.insert(
            4,
            FakeTarget {
                iqn: "iqn.other:x".into(),
                ..Default::default()
            },
        );
    });
    let b = s.backend();
    let v = b.create_volume(&create("pvc-1")).await.unwrap();
    assert_eq!(v.id.to_string(), "iscsi:pvc-1");
    let (tid, made) = t.target(IQN).expect("the target was made");
    assert_eq!(tid, 5, "the id after the highest there");
    assert_eq!(made.lun1.as_deref(), Some("/dev/loop7"));
    // LUN 1 gets an identity of its own, from the target name.
    let serial = target::serial_for(IQN);
    assert_eq!(serial.len(), 16);
    assert_eq!(
        made.updates,
        [format!("targetOps scsi_id=fv{serial},scsi_sn={serial},")]
    );
    assert_eq!(
        s.store.calls(),
        ["create pvc-1", "attach iscsi-store:pvc-1"]
    );

    // Retried: the target is known, nothing is asked of tgtd or made.
    let asked = t.requests().len();
    b.create_volume(&create("pvc-1")).await.unwrap();
    assert_eq!(t.requests().len(), asked);

    // A LUN that cannot be made leaves no target behind.
    let iqn_of = |name: &str| b.iqn(&VolumeId::parse(&format!("iscsi:{name}")).unwrap());
    t.refuse_next(MODE_DEVICE, OP_NEW, 23);
    assert!(b.create_volume(&create("pvc-2")).await.is_err());
    assert!(t.target(&iqn_of("pvc-2")).is_none());

    // An id taken behind the backend's back (7, the next it would pick):
    // the server is read again and the next free one is used.
    t.edit(|st| {
        st.targets.insert(
            7,
            FakeTarget {
                iqn: "iqn.other:y".into(),
                ..Default::default()
            },
        );
    });
    b.create_volume(&create("pvc-3")).await.unwrap();
    assert_eq!(t.target(&iqn_of("pvc-3")).unwrap().0, 8);
    assert_eq!(t.target("iqn.other:y").unwrap().1.lun1, None, "left alone");
    // The targets were listed at the first lookup and after the taken id
    // only: creating does not list them.
    let listings = t
        .requests()
        .iter()
        .filter(|r| (r.0, r.1) == (MODE_TARGET, OP_SHOW))
        .count();
    assert_eq!(listings, 2);
}

#[tokio::test]
async fn publish_sets_chap_then_the_acl_and_unpublish_takes_it_back() {
    use target::ipc::*;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let chap = [
        (CHAP_USER, "alice"),
        (CHAP_PASSWORD, "alice-secret-01"),
        (MUTUAL_USER, "target"),
        (MUTUAL_PASSWORD, "target-secret-02"),
    ];
    let ctx = b.controller_attach(&id, &attach_req(&chap)).await.unwrap();
    assert_eq!(ctx["iqn"], IQN);
    assert_eq!(ctx["portals"], "10.0.0.5:3260");
    assert_eq!(ctx["lun"], "1");
    let (tid, published) = t.target(IQN).unwrap();
    assert_eq!(published.incoming, ["alice"]);
    assert_eq!(published.outgoing.as_deref(), Some("target"));
    assert_eq!(published.acl, BTreeSet::from([INITIATOR.to_string()]));
    // CHAP first: the ACL opens last.
    let requests = t.requests();
    let acl_at = requests
        .iter()
        .position(|r| (r.0, r.1) == (MODE_TARGET, OP_BIND))
        .unwrap();
    assert_eq!(acl_at, requests.len() - 1);
    assert!(requests[..acl_at]
        .iter()
        .any(|r| (r.0, r.1, r.2) == (MODE_ACCOUNT, OP_BIND, tid as i32)));
    // The secrets went only in the requests that make the accounts.
    assert_eq!(
        t.state.lock().unwrap().accounts,
        BTreeMap::from([
            ("alice".to_string(), "alice-secret-01".to_string()),
            ("target".to_string(), "target-secret-02".to_string())
        ])
    );
    for r in &requests {
        assert!(
            !r.3.contains("secret") || (r.0, r.1) == (MODE_ACCOUNT, OP_NEW),
            "{r:?}"
        );
    }

    // Published again without CHAP: refused, the accounts stay.
    let e = b
        .controller_attach(&id, &attach_req(&[]))
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert_eq!(t.target(IQN).unwrap().1.incoming, ["alice"]);

    // Published again with the same secrets (a retry): done, nothing
    // doubled (tgt refuses a second outgoing bind even of the same
    // account; this volume's record says it is bound).
    b.controller_attach(&id, &attach_req(&chap)).await.unwrap();
    let again = t.target(IQN).unwrap().1;
    assert_eq!(again.incoming, ["alice"]);
    assert_eq!(again.outgoing.as_deref(), Some("target"));

    // Another node, while it is published here: refused, naming who has
    // it, and tgtd is not asked anything.
    let before = t.requests().len();
    let mut other = attach_req(&chap);
    other.node_id = "worker-2/iqn.1993-08.org.debian:01:bb".into();
    let e = b.controller_attach(&id, &other).await.unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(e.message.contains(INITIATOR), "{e}");
    assert_eq!(t.requests().len(), before);

    // This node again, read-only now: not what it was published as, so
    // ALREADY_EXISTS, and nothing changes on the target.
    let mut ro = attach_req(&chap);
    ro.readonly = true;
    let e = b.controller_attach(&id, &ro).await.unwrap_err();
    assert_eq!(e.kind, Kind::AlreadyExists, "{e}");
    assert_eq!(t.requests().len(), before);

    // A node without an initiator name, and an unknown volume: NOT_FOUND.
    let mut plain = attach_req(&chap);
    plain.node_id = "worker-2".into();
    assert_eq!(
        b.controller_attach(&id, &plain).await.unwrap_err().kind,
        Kind::NotFound
    );
    let unknown = VolumeId::parse("iscsi:nope").unwrap();
    assert_eq!(
        b.controller_attach(&unknown, &attach_req(&chap))
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );

    // Unpublish takes the initiator out of the ACL and, when the node is
    // still logged in (lost: its unstage never came), closes its
    // connections: another initiator's stay. Again, and for an unknown
    // volume, it is a no-op.
    let tid = t.target(IQN).unwrap().0;
    t.edit(|st| {
        st.targets.get_mut(&tid).unwrap().sessions =
            vec!["iqn.2026-01.io.other:n".into(), INITIATOR.into()]
    });
    b.controller_detach(&id, Some(NODE), &Secrets::default())
        .await
        .unwrap();
    let (_, after) = t.target(IQN).unwrap();
    assert!(after.acl.is_empty());
    assert_eq!(after.sessions, ["iqn.2026-01.io.other:n", ""]);
    let closes: Vec<_> = t
        .requests()
        .into_iter()
        .filter(|r| (r.0, r.1) == (MODE_CONNECTION, OP_DELETE))
        .collect();
    assert_eq!(closes.len(), 1);
    // The ACL went first: a closed connection cannot log in again.
    let order: Vec<_> = t.requests().into_iter().map(|r| (r.0, r.1)).collect();
    let unbind = order
        .iter()
        .rposition(|r| *r == (MODE_TARGET, OP_UNBIND))
        .unwrap();
    let close = order
        .iter()
        .rposition(|r| *r == (MODE_CONNECTION, OP_DELETE))
        .unwrap();
    assert!(unbind < close, "{order:?}");
    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions.clear());
    b.controller_detach(&id, Some(NODE), &Secrets::default())
        .await
        .unwrap();
    b.controller_detach(&unknown, Some(NODE), &Secrets::default())
        .await
        .unwrap();
    // None of it listed the targets again.
    let listings = t
        .requests()
        .iter()
        .filter(|r| (r.0, r.1) == (MODE_TARGET, OP_SHOW))
        .count();
    assert_eq!(listings, 1);
}

/// tgtd restarted under a running driver: it forgot every target. The
/// next call finds the server is a new run and makes the volume's target
/// again, accounts and ACL with it; a create after it goes on.
#[tokio::test]
async fn a_restarted_target_server_gets_its_targets_back() {
    let s = Setup::new();
    let mut t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let chap = [(CHAP_USER, "alice"), (CHAP_PASSWORD, "alice-secret-01")];
    b.controller_attach(&id, &attach_req(&chap)).await.unwrap();
    t.restart();
    t.edit(|st| st.accounts.clear());
    assert!(t.target(IQN).is_none());
    b.controller_attach(&id, &attach_req(&chap)).await.unwrap();
    let (_, back) = t.target(IQN).expect("made again");
    assert_eq!(back.lun1.as_deref(), Some("/dev/loop7"));
    assert_eq!(back.incoming, ["alice"]);
    assert_eq!(back.acl, BTreeSet::from([INITIATOR.to_string()]));
    b.create_volume(&create("pvc-2")).await.unwrap();
    assert_eq!(t.state.lock().unwrap().targets.len(), 2);
}

#[tokio::test]
async fn delete_is_refused_while_logged_in_and_cleans_up_after() {
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let (tid, _) = t.target(IQN).unwrap();
    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions = vec![INITIATOR.into()]);
    let e = b.delete_volume(&id, &Secrets::default()).await.unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition);
    assert!(e.message.contains(INITIATOR), "{e}");
    assert!(!s.store.calls().iter().any(|c| c.starts_with("delete")));
    assert!(t.target(IQN).is_some());

    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions.clear());
    b.delete_volume(&id, &Secrets::default()).await.unwrap();
    assert!(t.target(IQN).is_none());
    assert_eq!(
        s.store.calls()[2..],
        ["detach iscsi-store:pvc-1 true", "delete iscsi-store:pvc-1"]
    );
    assert!(b.load(&id).unwrap().is_none());
    // Gone already: success, and the store is still asked to make sure.
    b.delete_volume(&id, &Secrets::default()).await.unwrap();
    assert_eq!(s.store.calls().len(), 6);
}

/// tgtd lost its targets and the driver restarted (the CHAP secret is not
/// known): the target comes back with its LUN but a closed ACL, and the
/// next publish with the secret opens it.
#[tokio::test]
async fn a_lost_target_is_rebuilt_closed_until_the_secret_comes_back() {
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    {
        let b = s.backend();
        b.save(
            &id,
            &Record {
                iqn: IQN.into(),
                device: "/dev/loop7".into(),
                attachment: Attachment::Device {
                    path: "/dev/loop7".into(),
                },
                initiators: BTreeSet::from([INITIATOR.to_string()]),
                terms: Default::default(),
                incoming_user: Some("alice".into()),
                outgoing_user: None,
                copy: None,
                lun_bytes: None,
                thin_provisioning: true,
                hold: None,
            },
        )
        .unwrap();
    }
    let b = s.backend();
    b.health().await.unwrap();
    let (_, rebuilt) = t.target(IQN).expect("rebuilt");
    assert_eq!(rebuilt.lun1.as_deref(), Some("/dev/loop7"));
    // Its recorded thin provisioning with it.
    assert_eq!(
        rebuilt.updates.last().map(String::as_str),
        Some("thin_provisioning=1")
    );
    assert!(rebuilt.acl.is_empty() && rebuilt.incoming.is_empty());
    // Probe does not check again for a while.
    let asked = t.requests().len();
    b.health().await.unwrap();
    assert_eq!(t.requests().len(), asked);

    b.controller_attach(
        &id,
        &attach_req(&[(CHAP_USER, "alice"), (CHAP_PASSWORD, "alice-secret-01")]),
    )
    .await
    .unwrap();
    let (_, open) = t.target(IQN).unwrap();
    assert_eq!(open.incoming, ["alice"]);
    assert_eq!(open.acl, BTreeSet::from([INITIATOR.to_string()]));
}

/// An unused volume grows: the store, then LUN 1 reopened on it in one
/// update (same LUN, same SCSI identity).
#[tokio::test]
async fn expansion_grows_the_store_and_refreshes_the_lun() {
    use target::ipc::*;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    assert_eq!(
        b.expand_volume(&id, 16 << 20, 0, &Secrets::default())
            .await
            .unwrap(),
        16 << 20
    );
    assert_eq!(
        t.target(IQN).unwrap().1.updates.last().unwrap(),
        "targetOps online=0,path=/dev/loop7,"
    );
    assert!(s
        .store
        .calls()
        .contains(&"refresh iscsi-store:pvc-1".to_string()));

    // The LUN cannot be reopened: the error is the caller's.
    t.refuse_next(MODE_DEVICE, OP_UPDATE, 2);
    assert!(b
        .expand_volume(&id, 32 << 20, 0, &Secrets::default())
        .await
        .is_err());
}

/// A volume in use (published, or an initiator logged in) is not grown:
/// reopening the LUN's store under I/O fails commands in flight. A repeat
/// of an expansion already done still succeeds.
#[tokio::test]
async fn a_volume_in_use_is_not_grown() {
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let created = b.load(&id).unwrap().unwrap().lun_bytes.unwrap();
    let before = s.store.calls().len();

    // Logged in without a publish record (a session left behind).
    let (tid, _) = t.target(IQN).unwrap();
    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions = vec![INITIATOR.into()]);
    let e = b
        .expand_volume(&id, created * 2, 0, &Secrets::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    assert!(e.to_string().contains(INITIATOR), "{e}");

    // Published, nobody logged in yet.
    t.edit(|st| st.targets.get_mut(&tid).unwrap().sessions.clear());
    let mut record = b.load(&id).unwrap().unwrap();
    record.initiators.insert(INITIATOR.into());
    b.save(&id, &record).unwrap();
    let e = b
        .expand_volume(&id, created * 2, 0, &Secrets::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, Kind::FailedPrecondition, "{e}");
    // Nothing was grown.
    assert_eq!(s.store.calls().len(), before, "{:?}", s.store.calls());
    // What the LUN already has is no expansion: done.
    assert_eq!(
        b.expand_volume(&id, created, 0, &Secrets::default())
            .await
            .unwrap(),
        created
    );
    assert_eq!(s.store.calls().len(), before);
}

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
    let record_dir = s.dir.path().join("nodes").join(IQN);
    std::fs::create_dir_all(&record_dir).unwrap();
    let record = record_dir.join("10.0.0.5,3260");
    std::fs::write(
        &record,
        "# BEGIN RECORD 2.1.8\nnode.name = x\nnode.session.auth.authmethod = None\n\
         node.session.timeo.replacement_timeout = 120\n# END RECORD\n",
    )
    .unwrap();
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

#[tokio::test]
async fn a_refused_login_leaves_no_record() {
    let s = Setup::new();
    let b = s.node();
    let id = VolumeId::parse("iscsi:pvc-1").unwrap();
    let record_dir = s.dir.path().join("nodes").join(IQN);
    std::fs::create_dir_all(&record_dir).unwrap();
    std::fs::write(record_dir.join("10.0.0.5,3260"), "node.name = x\n").unwrap();
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
    assert_eq!(b.node_condition(&id, &dev).await.unwrap(), None);
    sysfs_session(s.dir.path(), 4, "sdc", "FAILED", 32768);
    s.runner.expect("iscsiadm", Reply::Ok(SESSION.into()));
    let c = b.node_condition(&id, &dev).await.unwrap().unwrap();
    assert!(c.contains("FAILED"), "{c}");
    s.runner.expect("iscsiadm", Reply::Fail(21, String::new()));
    let c = b.node_condition(&id, &dev).await.unwrap().unwrap();
    assert!(c.contains("no iSCSI session"), "{c}");
    sysfs_session(s.dir.path(), 4, "sdc", "LOGGED_IN", 32768);
    s.runner.expect("iscsiadm", Reply::Ok(SESSION.into()));
    let gone = Attachment::Device {
        path: "/dev/sdz".into(),
    };
    assert!(b.node_condition(&id, &gone).await.unwrap().is_some());
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
    let record_dir = s.dir.path().join("nodes").join(IQN);
    std::fs::create_dir_all(&record_dir).unwrap();
    std::fs::write(record_dir.join("10.0.0.6,3260"), "node.name = x\n").unwrap();
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
    assert_eq!(b.node_condition(&id, &map).await.unwrap(), None);
    std::fs::write(
        s.dir.path().join("sys/class/iscsi_session/session5/state"),
        "FAILED\n",
    )
    .unwrap();
    s.runner.expect("iscsiadm", Reply::Ok(both.clone()));
    s.runner.expect("iscsiadm", Reply::Ok(both.clone()));
    let c = b.node_condition(&id, &map).await.unwrap().unwrap();
    assert!(c.contains("10.0.0.6:3260") && c.contains("down"), "{c}");

    // Unstage flushes the map first; a map that stays (held open) stops it
    // before any disk or session is touched.
    s.runner
        .expect("iscsiadm", Reply::Ok(both.clone()))
        .ok("multipath");
    let e = b.node_detach(&id, Some(&map)).await.unwrap_err();
    assert!(e.message.contains("still there"), "{e}");
    assert_eq!(
        s.runner.lines().last().unwrap(),
        "multipath -f 360000000000000f0aa"
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

/// tgtadm reads `-C` into a signed 16-bit integer: a control port above
/// 32767 is refused when the backend is built, not on every later call.
#[test]
fn a_control_port_tgtadm_cannot_take_is_refused_at_startup() {
    let s = Setup::new();
    let build = |port| {
        let mut settings = s.settings();
        settings.control_port = port;
        IscsiBackend::new(
            "iscsi",
            settings,
            s.runner.clone(),
            Some(s.store.clone()),
            s.dir.path().join("records"),
        )
    };
    let err = build(32768).err().expect("32768 is refused");
    assert!(err.to_string().contains("0 to 32767"), "{err}");
    assert!(build(32767).is_ok());
}

/// Slow store work on one volume holds up no call on another: a delete
/// whose store does not answer is still in its store's detach while a
/// ControllerUnpublish of another volume runs to the end (the backend's
/// one admin lock was held across every call before).
#[tokio::test]
async fn a_stuck_volume_does_not_hold_up_another() {
    let s = Setup::new();
    let _tgtd = FakeTgtd::start(s.dir.path());
    let b = Arc::new(s.backend());
    let one = s.created(&b).await;
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    *s.store.stuck.lock().unwrap() = Some(("pvc-1".to_string(), entered.clone(), release.clone()));
    // The delete removes pvc-1's target, then hangs in the store.
    let deleting = {
        let b = b.clone();
        let one = one.clone();
        tokio::spawn(async move { b.delete_volume(&one, &Secrets::default()).await })
    };
    entered.notified().await;
    // Another volume's unpublish (its record: published to INITIATOR).
    let other = VolumeId::parse("iscsi:pvc-9").unwrap();
    let mut record = b.load(&one).unwrap().unwrap();
    record.iqn = format!("{IQN}-9");
    record.initiators = BTreeSet::from([INITIATOR.to_string()]);
    b.save(&other, &record).unwrap();
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        b.controller_detach(&other, Some(NODE), &Secrets::default()),
    )
    .await
    .expect("the other volume's unpublish waited on the stuck delete")
    .unwrap();
    assert!(!deleting.is_finished());
    assert!(b.load(&other).unwrap().unwrap().initiators.is_empty());
    release.notify_one();
    deleting.await.unwrap().unwrap();
}

/// Thin provisioning is changed on the live LUN only when it differs, and
/// recorded (a rebuilt target gets it back); a refusal leaves the record.
#[tokio::test]
async fn thin_provisioning_is_set_on_the_live_lun_and_recorded() {
    use target::ipc::*;
    let s = Setup::new();
    let t = FakeTgtd::start(s.dir.path());
    let b = s.backend();
    let id = s.created(&b).await;
    let none = Secrets::default();
    let set = |v: &str| BTreeMap::from([(THIN_PROVISIONING.to_string(), v.to_string())]);
    let e = b.check_mutable(&set("maybe")).unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument);
    assert!(e.message.contains(THIN_PROVISIONING), "{}", e.message);
    assert_eq!(b.mutable_keys(), [THIN_PROVISIONING]);

    let updates = || t.target(IQN).unwrap().1.updates;
    let before = updates().len();
    b.modify_volume(&id, &set("true"), &none).await.unwrap();
    assert_eq!(updates().last().unwrap(), "thin_provisioning=1");
    assert!(b.load(&id).unwrap().unwrap().thin_provisioning);
    b.modify_volume(&id, &set("true"), &none).await.unwrap();
    assert_eq!(updates().len(), before + 1, "no change asked twice");

    t.refuse_next(MODE_DEVICE, OP_UPDATE, 2);
    assert!(b.modify_volume(&id, &set("false"), &none).await.is_err());
    assert!(b.load(&id).unwrap().unwrap().thin_provisioning);
    b.modify_volume(&id, &set("false"), &none).await.unwrap();
    assert_eq!(updates().last().unwrap(), "thin_provisioning=0");
    assert!(!b.load(&id).unwrap().unwrap().thin_provisioning);

    let missing = VolumeId::parse("iscsi:nope").unwrap();
    assert_eq!(
        b.modify_volume(&missing, &set("true"), &none)
            .await
            .unwrap_err()
            .kind,
        Kind::NotFound
    );
}

/// thinProvisioning on an lvm store is refused before anything is made or
/// changed: tgt would answer the initiators' UNMAP with a hardware error
/// (it punches holes, which a logical volume cannot take). A file store
/// takes it.
#[test]
fn thin_provisioning_is_refused_on_an_lvm_store() {
    let s = Setup::new();
    let thin = BTreeMap::from([(THIN_PROVISIONING.to_string(), "true".to_string())]);
    s.backend().check_mutable(&thin).unwrap();
    let mut settings = s.settings();
    settings.store = Some(crate::config::BackendConfig {
        kind: "lvm".into(),
        name: None,
        settings: Default::default(),
    });
    let b = IscsiBackend::new(
        "iscsi",
        settings,
        s.runner.clone(),
        Some(s.store.clone()),
        s.dir.path().join("records"),
    )
    .unwrap();
    let e = b.check_mutable(&thin).unwrap_err();
    assert_eq!(e.kind, Kind::InvalidArgument, "{e}");
    assert!(e.message.contains("cannot punch"), "{e}");
    let off = BTreeMap::from([(THIN_PROVISIONING.to_string(), "false".to_string())]);
    b.check_mutable(&off).unwrap();
}
