//! Linux `tgt`, the iscsi backend's target server, by target id: spoken
//! over tgtd's management socket (the protocol `tgtadm` speaks: one
//! request, one answer, each on its own connection). No process per call, an error code instead of a
//! message to read, and a CHAP password never on a command line.

use crate::error::{Error, Kind, Result};
use std::path::{Path, PathBuf};

/// One target as the server reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetState {
    pub tid: u32,
    pub iqn: String,
    /// LUN number and backing store, LUN 0 (the controller) left out.
    pub luns: Vec<(u32, PathBuf)>,
    /// Initiator names allowed to log in.
    pub allowed: Vec<String>,
    /// Bound CHAP accounts: (user, outgoing).
    pub accounts: Vec<(String, bool)>,
    /// Initiators logged in now.
    pub sessions: Vec<String>,
    /// Whether LUN 1 reports thin provisioning.
    pub thin: bool,
}

/// A Linux tgt target server, through its management socket, by target
/// id. Changes that find the server already so (an ACL entry there, an
/// account bound, a target gone) succeed; a target id or name that is
/// taken is ALREADY_EXISTS. [`super::targets::Tgt`] serves it by name.
pub struct Tgtd {
    socket: PathBuf,
}

impl Tgtd {
    /// The tgtd serving control port `control_port` (its socket is
    /// `socket.<port>` in `socket_dir`).
    pub fn new(control_port: u32, socket_dir: &Path) -> Self {
        Tgtd {
            socket: socket_dir.join(format!("socket.{control_port}")),
        }
    }

    async fn call(&self, req: ipc::Request<'_>, what: impl FnOnce() -> String) -> Result<String> {
        match ipc::call(&self.socket, &req).await? {
            Ok(text) => Ok(text),
            Err(code) => Err(ipc::refused(code, &what())),
        }
    }

    /// A change: Ok also when tgtd answers with one of `already`.
    async fn change(
        &self,
        req: ipc::Request<'_>,
        already: &[u32],
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        match ipc::call(&self.socket, &req).await? {
            Ok(_) => Ok(()),
            Err(code) if already.contains(&code) => Ok(()),
            Err(code) => Err(ipc::refused(code, &what())),
        }
    }

    /// Gives LUN 1 of `tid` an identity of its own, from the target name:
    /// tgt's default is made from the target and LUN numbers, which repeat
    /// across target servers and over time, and multipath would take two
    /// volumes with one identity for two paths to one disk.
    /// Every connection to target `tid`.
    async fn connections(&self, tid: u32) -> Result<Vec<Connection>> {
        let text = self
            .call(
                ipc::Request {
                    mode: ipc::MODE_CONNECTION,
                    ..ipc::Request::target(ipc::OP_SHOW, Some(tid), "")
                },
                || format!("list the connections of target {tid}"),
            )
            .await?;
        Ok(parse_connections(&text))
    }

    async fn identify(&self, tid: u32, iqn: &str) -> Result<()> {
        let serial = serial_for(iqn);
        let params = format!("targetOps scsi_id=fv{serial},scsi_sn={serial},");
        self.call(ipc::Request::lun(ipc::OP_UPDATE, tid, &params), || {
            format!("set the identity of target {tid}'s LUN 1")
        })
        .await
        .map(|_| ())
    }

    /// Which run of the server this is: changes when it restarts (and so
    /// has forgotten every target).
    pub async fn instance(&self) -> Result<u64> {
        use std::os::unix::fs::MetadataExt;
        // tgtd makes its socket anew at each start.
        let m = std::fs::metadata(&self.socket).map_err(|e| {
            Error::unavailable(format!(
                "the iSCSI target server: no management socket {}: {e}",
                self.socket.display()
            ))
        })?;
        Ok(m.ino() ^ (m.ctime() as u64).rotate_left(32) ^ m.ctime_nsec() as u64)
    }

    /// Every target the server has (a long listing: kept out of the
    /// per-volume paths).
    pub async fn targets(&self) -> Result<Vec<TargetState>> {
        let text = self
            .call(ipc::Request::target(ipc::OP_SHOW, None, ""), || {
                "list the targets".into()
            })
            .await?;
        Ok(parse_targets(&text))
    }

    /// The initiators logged in to target `tid` (NOT_FOUND: no such
    /// target).
    pub async fn sessions(&self, tid: u32) -> Result<Vec<String>> {
        let mut names: Vec<String> = Vec::new();
        for c in self.connections(tid).await? {
            if !names.contains(&c.initiator) {
                names.push(c.initiator);
            }
        }
        Ok(names)
    }

    /// Closes every connection `initiator` has to target `tid`; returns
    /// how many it closed.
    pub async fn close_connections(&self, tid: u32, initiator: &str) -> Result<usize> {
        let mut closed = 0;
        for c in self.connections(tid).await? {
            if c.initiator != initiator {
                continue;
            }
            // One already gone (the initiator left meanwhile) is closed.
            self.change(
                ipc::Request::connection(ipc::OP_DELETE, tid, c.session, c.connection),
                &[ipc::NO_SESSION, ipc::NO_CONNECTION],
                || {
                    format!(
                        "close connection {} of session {} ({initiator}) on target {tid}",
                        c.connection, c.session
                    )
                },
            )
            .await?;
            closed += 1;
        }
        Ok(closed)
    }

    /// Makes target `tid` named `iqn` with `backing` as LUN 1, or nothing.
    pub async fn create(&self, tid: u32, iqn: &str, backing: &Path) -> Result<()> {
        self.call(
            ipc::Request::target(ipc::OP_NEW, Some(tid), &format!("targetname={iqn}")),
            || format!("make target {tid} ({iqn})"),
        )
        .await?;
        let path = crate::exec::path_arg(backing)?;
        if path.contains(',') {
            let _ = self.delete(tid).await;
            return Err(Error::internal(format!(
                "backing store {path:?} has a comma, which tgtd's parameters cannot carry"
            )));
        }
        let added = match self
            .call(
                ipc::Request::lun(ipc::OP_NEW, tid, &format!("path={path}")),
                || format!("add LUN 1 ({path}) to target {tid}"),
            )
            .await
        {
            Ok(_) => self.identify(tid, iqn).await,
            Err(e) => Err(e),
        };
        if let Err(e) = added {
            // No half-made target left behind.
            let _ = self.delete(tid).await;
            return Err(e);
        }
        Ok(())
    }

    /// Removes target `tid`; refused by the server while sessions exist.
    pub async fn delete(&self, tid: u32) -> Result<()> {
        self.change(
            ipc::Request::target(ipc::OP_DELETE, Some(tid), ""),
            &[ipc::NO_TARGET],
            || format!("delete target {tid}"),
        )
        .await
    }

    /// Makes LUN 1 report the backing store's current size. Only for a
    /// LUN nobody uses: I/O in flight meanwhile may fail.
    pub async fn refresh(&self, tid: u32, backing: &Path) -> Result<()> {
        // tgt reads a backing store's size when it opens it: one update
        // takes LUN 1 offline, reopens its store (same LUN, same SCSI
        // identity) and brings it back online, all inside one request of
        // tgtd's event loop. Commands in flight on its I/O threads during
        // the reopen fail, which is why the backend refreshes only LUNs no
        // initiator is logged in to.
        let path = crate::exec::path_arg(backing)?;
        if path.contains(',') {
            return Err(Error::internal(format!(
                "backing store {path:?} has a comma, which tgtd's parameters cannot carry"
            )));
        }
        self.call(
            ipc::Request::lun(
                ipc::OP_UPDATE,
                tid,
                &format!("targetOps online=0,path={path},"),
            ),
            || format!("reopen target {tid}'s LUN 1"),
        )
        .await
        .map(|_| ())
    }

    /// Whether LUN 1 reports thin provisioning (READ CAPACITY's LBPME and
    /// the Logical Block Provisioning VPD page, UNMAP served by punching
    /// holes in the backing store).
    pub async fn set_thin_provisioning(&self, tid: u32, on: bool) -> Result<()> {
        let params = format!("thin_provisioning={}", u8::from(on));
        self.call(ipc::Request::lun(ipc::OP_UPDATE, tid, &params), || {
            format!("set thin provisioning on target {tid}'s LUN 1")
        })
        .await
        .map(|_| ())
    }

    pub async fn allow(&self, tid: u32, initiator: &str) -> Result<()> {
        self.change(
            ipc::Request::target(
                ipc::OP_BIND,
                Some(tid),
                &format!("initiator-name={initiator}"),
            ),
            &[ipc::ACL_EXIST],
            || format!("allow {initiator} on target {tid}"),
        )
        .await
    }

    pub async fn disallow(&self, tid: u32, initiator: &str) -> Result<()> {
        self.change(
            ipc::Request::target(
                ipc::OP_UNBIND,
                Some(tid),
                &format!("initiator-name={initiator}"),
            ),
            &[ipc::ACL_NOEXIST, ipc::NO_TARGET],
            || format!("disallow {initiator} on target {tid}"),
        )
        .await
    }

    /// Creates a CHAP account; Ok(false) when one of that name exists.
    pub async fn new_account(&self, user: &str, password: &str) -> Result<bool> {
        // The password travels only in this request's parameters, and no
        // error names them.
        match ipc::call(
            &self.socket,
            &ipc::Request::account(
                ipc::OP_NEW,
                None,
                &format!("user={user},password={password}"),
                false,
            ),
        )
        .await?
        {
            Ok(_) => Ok(true),
            Err(ipc::USER_EXIST) => Ok(false),
            Err(code) => Err(ipc::refused(code, &format!("create CHAP account {user:?}"))),
        }
    }

    /// Binds an account to a target. An outgoing account where the target
    /// has one already is FAILED_PRECONDITION (tgt allows one).
    pub async fn bind_account(&self, tid: u32, user: &str, outgoing: bool) -> Result<()> {
        self.change(
            ipc::Request::account(ipc::OP_BIND, Some(tid), &format!("user={user}"), outgoing),
            // Bound already (the same direction).
            &[ipc::USER_EXIST],
            || format!("bind CHAP account {user:?} to target {tid}"),
        )
        .await
    }

    pub async fn unbind_account(&self, tid: u32, user: &str, outgoing: bool) -> Result<()> {
        self.change(
            ipc::Request::account(ipc::OP_UNBIND, Some(tid), &format!("user={user}"), outgoing),
            &[ipc::NO_USER, ipc::NO_TARGET],
            || format!("unbind CHAP account {user:?} from target {tid}"),
        )
        .await
    }
}

/// LUN 1's serial number (16 hex digits) for a target name; its SCSI
/// identity (the NAA name the initiator's WWID comes from) follows it.
pub fn serial_for(iqn: &str) -> String {
    crate::plugin::digest_hex(iqn.as_bytes(), 8)
}

/// Parses `tgtadm --op show --mode target`.
pub fn parse_targets(text: &str) -> Vec<TargetState> {
    #[derive(PartialEq)]
    enum Section {
        Other,
        Nexus,
        Luns,
        Accounts,
        Acl,
    }
    let mut out: Vec<TargetState> = Vec::new();
    let mut section = Section::Other;
    let mut lun: Option<u32> = None;
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim();
        if indent == 0 {
            if let Some(rest) = t.strip_prefix("Target ") {
                if let Some((tid, iqn)) = rest.split_once(": ") {
                    if let Ok(tid) = tid.parse() {
                        out.push(TargetState {
                            tid,
                            iqn: iqn.trim().to_string(),
                            ..Default::default()
                        });
                    }
                }
            }
            section = Section::Other;
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if indent == 4 {
            section = match t {
                "I_T nexus information:" => Section::Nexus,
                "LUN information:" => Section::Luns,
                "Account information:" => Section::Accounts,
                "ACL information:" => Section::Acl,
                _ => Section::Other,
            };
            lun = None;
            continue;
        }
        match section {
            Section::Nexus => {
                if let Some(rest) = t.strip_prefix("Initiator: ") {
                    let name = rest.split_whitespace().next().unwrap_or("").to_string();
                    if !name.is_empty() && !cur.sessions.contains(&name) {
                        cur.sessions.push(name);
                    }
                }
            }
            Section::Luns => {
                if let Some(n) = t.strip_prefix("LUN: ") {
                    lun = n.trim().parse().ok();
                } else if let Some(v) = t.strip_prefix("Thin-provisioning: ") {
                    if lun == Some(1) {
                        cur.thin = v.trim() == "Yes";
                    }
                } else if let Some(path) = t.strip_prefix("Backing store path: ") {
                    if let Some(n) = lun.filter(|n| *n != 0) {
                        cur.luns.push((n, PathBuf::from(path.trim())));
                    }
                }
            }
            Section::Accounts => match t.strip_suffix(" (outgoing)") {
                Some(user) => cur.accounts.push((user.to_string(), true)),
                None => cur.accounts.push((t.to_string(), false)),
            },
            Section::Acl => {
                // Initiator names; address rules (the driver makes none)
                // are left out.
                if t.starts_with("iqn.") || t.starts_with("eui.") || t.starts_with("naa.") {
                    cur.allowed.push(t.to_string());
                }
            }
            Section::Other => {}
        }
    }
    out
}

/// One connection of an initiator to a target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    pub session: u64,
    pub connection: u32,
    pub initiator: String,
}

/// tgtd's connection listing of one target: `Session: N`, under it
/// `Connection: M`, under that `Initiator: NAME` and the address.
pub fn parse_connections(text: &str) -> Vec<Connection> {
    let mut out = Vec::new();
    let (mut session, mut connection) = (None, None);
    for line in text.lines() {
        let t = line.trim();
        if let Some(n) = t.strip_prefix("Session: ") {
            session = n.trim().parse().ok();
            connection = None;
        } else if let Some(n) = t.strip_prefix("Connection: ") {
            connection = n.trim().parse().ok();
        } else if let Some(rest) = t.strip_prefix("Initiator: ") {
            let name = rest.split_whitespace().next().unwrap_or("");
            if let (Some(s), Some(c), false) = (session, connection, name.is_empty()) {
                out.push(Connection {
                    session: s,
                    connection: c,
                    initiator: name.to_string(),
                });
            }
        }
    }
    out
}

/// tgtd's management protocol: a fixed 120-byte request header (mode,
/// operation, driver name, total length, target, session, LUN, connection,
/// host, device type, account direction, pack, force), a NUL-terminated
/// parameter string, and an answer of an error code and a length, then
/// that much text. Error codes as tgt 1.0.85 numbers them.
pub mod ipc {
    use crate::error::{Error, Result};
    use std::path::Path;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const HEADER: usize = 120;
    /// An answer longer than this is refused (800 targets list in 0.9 MB).
    const MAX_ANSWER: usize = 64 << 20;
    /// How long one request may take, connect to last byte.
    const TIMEOUT: Duration = Duration::from_secs(30);

    pub const MODE_TARGET: u32 = 1;
    pub const MODE_DEVICE: u32 = 2;
    pub const MODE_CONNECTION: u32 = 6;
    pub const MODE_ACCOUNT: u32 = 7;

    pub const OP_NEW: u32 = 0;
    pub const OP_DELETE: u32 = 1;
    pub const OP_SHOW: u32 = 2;
    pub const OP_BIND: u32 = 3;
    pub const OP_UNBIND: u32 = 4;
    pub const OP_UPDATE: u32 = 5;

    pub const NO_TARGET: u32 = 4;
    pub const NO_LUN: u32 = 5;
    pub const NO_SESSION: u32 = 6;
    pub const NO_CONNECTION: u32 = 7;
    pub const TARGET_EXIST: u32 = 9;
    pub const LUN_EXIST: u32 = 10;
    pub const ACL_EXIST: u32 = 12;
    pub const ACL_NOEXIST: u32 = 13;
    pub const USER_EXIST: u32 = 14;
    pub const NO_USER: u32 = 15;
    pub const OUTACCOUNT_EXIST: u32 = 18;
    pub const TARGET_ACTIVE: u32 = 19;

    /// One request.
    #[derive(Debug, Clone, Copy)]
    pub struct Request<'a> {
        pub mode: u32,
        pub op: u32,
        pub tid: Option<u32>,
        pub lun: Option<u64>,
        pub outgoing: bool,
        /// A connection: its session id and connection id.
        pub connection: Option<(u64, u32)>,
        pub params: &'a str,
    }

    impl<'a> Request<'a> {
        pub fn target(op: u32, tid: Option<u32>, params: &'a str) -> Self {
            Request {
                mode: MODE_TARGET,
                op,
                tid,
                lun: None,
                outgoing: false,
                connection: None,
                params,
            }
        }
        pub fn lun(op: u32, tid: u32, params: &'a str) -> Self {
            Request {
                mode: MODE_DEVICE,
                lun: Some(1),
                ..Self::target(op, Some(tid), params)
            }
        }
        pub fn account(op: u32, tid: Option<u32>, params: &'a str, outgoing: bool) -> Self {
            Request {
                mode: MODE_ACCOUNT,
                outgoing,
                ..Self::target(op, tid, params)
            }
        }
        /// Connection `cid` of session `sid` of target `tid`.
        pub fn connection(op: u32, tid: u32, sid: u64, cid: u32) -> Self {
            Request {
                mode: MODE_CONNECTION,
                connection: Some((sid, cid)),
                ..Self::target(op, Some(tid), "")
            }
        }

        /// The bytes tgtadm would send for it.
        pub fn encode(&self) -> Vec<u8> {
            let body = self.params.len() + 1;
            let mut req = vec![0u8; HEADER];
            req[0..4].copy_from_slice(&self.mode.to_ne_bytes());
            req[4..8].copy_from_slice(&self.op.to_ne_bytes());
            req[8..13].copy_from_slice(b"iscsi");
            req[72..76].copy_from_slice(&((HEADER + body) as u32).to_ne_bytes());
            // tgtadm's "no target" is -1, "no LUN" all ones; an account
            // bound without a target goes to every target (~0 too).
            let tid = self.tid.map_or(-1i32, |t| t as i32);
            req[76..80].copy_from_slice(&tid.to_ne_bytes());
            if let Some((sid, cid)) = self.connection {
                req[80..88].copy_from_slice(&sid.to_ne_bytes());
                req[96..100].copy_from_slice(&cid.to_ne_bytes());
            }
            req[88..96].copy_from_slice(&self.lun.unwrap_or(u64::MAX).to_ne_bytes());
            req[108..112].copy_from_slice(&u32::from(self.outgoing).to_ne_bytes());
            req.extend_from_slice(self.params.as_bytes());
            req.push(0);
            req
        }
    }

    /// Sends one request: Ok(Ok(text)) when tgtd did it, Ok(Err(code))
    /// when it refused, Err when it could not be asked (UNAVAILABLE).
    pub async fn call(
        socket: &Path,
        req: &Request<'_>,
    ) -> Result<std::result::Result<String, u32>> {
        let exchange = async {
            let mut s = tokio::net::UnixStream::connect(socket).await?;
            s.write_all(&req.encode()).await?;
            let mut rsp = [0u8; 8];
            s.read_exact(&mut rsp).await?;
            let err = u32::from_ne_bytes(rsp[0..4].try_into().expect("4 bytes"));
            let len = u32::from_ne_bytes(rsp[4..8].try_into().expect("4 bytes")) as usize;
            let rest = len.saturating_sub(8);
            if rest > MAX_ANSWER {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("an answer of {rest} bytes"),
                ));
            }
            let mut text = vec![0u8; rest];
            s.read_exact(&mut text).await?;
            Ok::<_, std::io::Error>((err, text))
        };
        let (err, text) = tokio::time::timeout(TIMEOUT, exchange)
            .await
            .map_err(|_| Error::unavailable("tgtd did not answer on its management socket"))?
            .map_err(|e| {
                Error::unavailable(format!(
                    "the iSCSI target server's management socket {}: {e}",
                    socket.display()
                ))
            })?;
        Ok(match err {
            0 => Ok(String::from_utf8_lossy(&text)
                .trim_end_matches('\0')
                .to_string()),
            code => Err(code),
        })
    }

    /// tgtd's refusal of `what`, with the gRPC kind it means.
    pub fn refused(code: u32, what: &str) -> Error {
        let (kind, text) = match code {
            NO_TARGET => (super::Kind::NotFound, "no such target"),
            NO_LUN => (super::Kind::NotFound, "no such logical unit"),
            TARGET_EXIST => (super::Kind::AlreadyExists, "the target id or name is taken"),
            LUN_EXIST => (super::Kind::AlreadyExists, "the logical unit exists"),
            ACL_EXIST => (
                super::Kind::AlreadyExists,
                "the initiator is allowed already",
            ),
            ACL_NOEXIST => (super::Kind::NotFound, "the initiator is not allowed"),
            USER_EXIST => (super::Kind::AlreadyExists, "the account exists"),
            NO_USER => (super::Kind::NotFound, "no such account"),
            OUTACCOUNT_EXIST => (
                super::Kind::FailedPrecondition,
                "the target has an outgoing account already",
            ),
            TARGET_ACTIVE => (super::Kind::FailedPrecondition, "the target has sessions"),
            _ => (super::Kind::Internal, "refused"),
        };
        Error::new(kind, format!("tgtd: {what}: {text} (error {code})"))
    }
}
