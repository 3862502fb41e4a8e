//! The iscsi backend over the scripted runner, with tgtadm and iscsiadm
//! outputs captured from the real tools, an in-memory store, a fake tgtd
//! management socket and a fake sysfs tree.

use super::initiator::{parse_sessions, Session};
use super::target::{parse_connections, parse_targets};
use super::*;
use crate::backend::export::initiator::{Initiator, Paths};
use crate::backend::export::node::{is_token, CTX_FS_COPY};
use crate::backend::export::record::{Record, Records};
use crate::backend::export::testing::{attach_block, create, MemStore};
use crate::error::Kind;
use crate::exec::{FakeRunner, Reply};
use crate::host::hold::Holds;
use crate::plugin::{
    AttachContext, Attacher, Attachment, ContentSource, ControllerAttach, DeviceMounter, Expander,
    Modifier, Provisioner, Stager,
};
use std::collections::BTreeSet;
use std::sync::Mutex as StdMutex;

mod controller;
mod node;
mod parse;

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
            store: Arc::new(MemStore::new("iscsi")),
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
    attach_block(NODE, secrets)
}
