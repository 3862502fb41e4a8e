//! The target seam: what the iscsi backend asks of an iSCSI target server,
//! and its implementation for Linux `tgt` (`tgtadm` through the exec seam,
//! and tgtd's management socket for the one request that carries a secret,
//! so a CHAP password never appears on a command line).

use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

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
}

/// What the backend needs from a target server.
#[async_trait::async_trait]
pub trait Target: Send + Sync {
    /// Every target the server has.
    async fn targets(&self) -> Result<Vec<TargetState>>;
    /// Makes target `tid` named `iqn` with `backing` as LUN 1.
    async fn create(&self, tid: u32, iqn: &str, backing: &Path) -> Result<()>;
    /// Removes target `tid`; refused by the server while sessions exist.
    async fn delete(&self, tid: u32) -> Result<()>;
    /// Makes LUN 1 report the backing store's current size. Only for a
    /// LUN nobody uses: I/O in flight meanwhile may fail.
    async fn refresh(&self, tid: u32, backing: &Path) -> Result<()>;
    async fn allow(&self, tid: u32, initiator: &str) -> Result<()>;
    async fn disallow(&self, tid: u32, initiator: &str) -> Result<()>;
    /// The CHAP account names the server knows.
    async fn accounts(&self) -> Result<Vec<String>>;
    /// Creates a CHAP account; the password travels only over the server's
    /// management socket.
    async fn new_account(&self, user: &str, password: &str) -> Result<()>;
    async fn bind_account(&self, tid: u32, user: &str, outgoing: bool) -> Result<()>;
    async fn unbind_account(&self, tid: u32, user: &str, outgoing: bool) -> Result<()>;
}

const TGTADM_TIMEOUT: Duration = Duration::from_secs(30);

/// A Linux tgt target server.
pub struct Tgt {
    runner: Arc<dyn CommandRunner>,
    control_port: u32,
    socket_dir: PathBuf,
}

impl Tgt {
    pub fn new(runner: Arc<dyn CommandRunner>, control_port: u32, socket_dir: PathBuf) -> Self {
        Tgt {
            runner,
            control_port,
            socket_dir,
        }
    }

    fn tgtadm(&self) -> Command {
        Command::new("tgtadm")
            .args(["-C", &self.control_port.to_string(), "--lld", "iscsi"])
            .timeout(TGTADM_TIMEOUT)
    }

    /// Gives LUN 1 of `tid` an identity of its own, from the target name:
    /// tgt's default is made from the target and LUN numbers, which repeat
    /// across target servers and over time, and multipath would take two
    /// volumes with one identity for two paths to one disk.
    async fn identify(&self, tid: &str, iqn: &str) -> Result<()> {
        let serial = serial_for(iqn);
        self.run(self.tgtadm().args([
            "--op",
            "update",
            "--mode",
            "logicalunit",
            "--tid",
            tid,
            "--lun",
            "1",
            "--params",
            &format!("scsi_id=fv{serial},scsi_sn={serial}"),
        ]))
        .await
        .map(|_| ())
    }

    async fn run(&self, cmd: Command) -> Result<String> {
        Ok(self.runner.run(cmd).await.map_err(Error::from)?.stdout)
    }

    /// Runs a tgtadm change; an error saying it is already so is success.
    async fn change(&self, cmd: Command, already: &[&str]) -> Result<()> {
        match self.runner.run(cmd).await {
            Ok(_) => Ok(()),
            Err(e) if already.iter().any(|a| e.to_string().contains(a)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[async_trait::async_trait]
impl Target for Tgt {
    async fn targets(&self) -> Result<Vec<TargetState>> {
        let out = self
            .run(self.tgtadm().args(["--op", "show", "--mode", "target"]))
            .await
            .map_err(|e| Error::unavailable(format!("the iSCSI target server: {}", e.message)))?;
        Ok(parse_targets(&out))
    }

    async fn create(&self, tid: u32, iqn: &str, backing: &Path) -> Result<()> {
        let tid = tid.to_string();
        self.run(self.tgtadm().args([
            "--op",
            "new",
            "--mode",
            "target",
            "--tid",
            &tid,
            "--targetname",
            iqn,
        ]))
        .await?;
        let added = self
            .run(self.tgtadm().args([
                "--op",
                "new",
                "--mode",
                "logicalunit",
                "--tid",
                &tid,
                "--lun",
                "1",
                "--backing-store",
                &path_arg(backing)?,
            ]))
            .await;
        let added = match added {
            Ok(_) => self.identify(&tid, iqn).await,
            Err(e) => Err(e),
        };
        if let Err(e) = added {
            // No half-made target left behind.
            let _ = self
                .run(
                    self.tgtadm()
                        .args(["--op", "delete", "--mode", "target", "--tid", &tid]),
                )
                .await;
            return Err(e);
        }
        Ok(())
    }

    async fn delete(&self, tid: u32) -> Result<()> {
        self.change(
            self.tgtadm().args([
                "--op",
                "delete",
                "--mode",
                "target",
                "--tid",
                &tid.to_string(),
            ]),
            &["can't find the target"],
        )
        .await
    }

    async fn refresh(&self, tid: u32, backing: &Path) -> Result<()> {
        // tgt reads a backing store's size when it opens it: one update
        // takes LUN 1 offline, reopens its store (same LUN, same SCSI
        // identity) and brings it back online, all inside one request of
        // tgtd's event loop. Commands in flight on its I/O threads during
        // the reopen fail, which is why the backend refreshes only LUNs no
        // initiator is logged in to.
        let path = path_arg(backing)?;
        if path.contains(',') {
            return Err(Error::internal(format!(
                "backing store {path:?} has a comma, which tgtadm's --params cannot carry"
            )));
        }
        self.run(self.tgtadm().args([
            "--op",
            "update",
            "--mode",
            "logicalunit",
            "--tid",
            &tid.to_string(),
            "--lun",
            "1",
            "--params",
            &format!("online=0,path={path}"),
        ]))
        .await
        .map(|_| ())
    }

    async fn allow(&self, tid: u32, initiator: &str) -> Result<()> {
        self.change(
            self.tgtadm().args([
                "--op",
                "bind",
                "--mode",
                "target",
                "--tid",
                &tid.to_string(),
                "--initiator-name",
                initiator,
            ]),
            &["already exists"],
        )
        .await
    }

    async fn disallow(&self, tid: u32, initiator: &str) -> Result<()> {
        self.change(
            self.tgtadm().args([
                "--op",
                "unbind",
                "--mode",
                "target",
                "--tid",
                &tid.to_string(),
                "--initiator-name",
                initiator,
            ]),
            &["not found", "doesn't exist", "does not exist"],
        )
        .await
    }

    async fn accounts(&self) -> Result<Vec<String>> {
        let out = self
            .run(self.tgtadm().args(["--op", "show", "--mode", "account"]))
            .await?;
        Ok(out
            .lines()
            .skip_while(|l| !l.starts_with("Account list"))
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect())
    }

    async fn new_account(&self, user: &str, password: &str) -> Result<()> {
        let socket = self
            .socket_dir
            .join(format!("socket.{}", self.control_port));
        ipc::new_account(&socket, user, password).await
    }

    async fn bind_account(&self, tid: u32, user: &str, outgoing: bool) -> Result<()> {
        let mut cmd = self.tgtadm().args([
            "--op",
            "bind",
            "--mode",
            "account",
            "--tid",
            &tid.to_string(),
            "--user",
            user,
        ]);
        if outgoing {
            cmd = cmd.arg("--outgoing");
        }
        self.change(cmd, &["already exists"]).await
    }

    async fn unbind_account(&self, tid: u32, user: &str, outgoing: bool) -> Result<()> {
        let mut cmd = self.tgtadm().args([
            "--op",
            "unbind",
            "--mode",
            "account",
            "--tid",
            &tid.to_string(),
            "--user",
            user,
        ]);
        if outgoing {
            cmd = cmd.arg("--outgoing");
        }
        self.change(cmd, &["can't find", "not found", "doesn't exist"])
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

/// tgtd's management protocol, for the request a command line must not
/// carry: a fixed 120-byte request header (mode, operation, driver name,
/// total length, target, session, LUN, ...), a NUL-terminated parameter
/// string, and an 8-byte answer (error code, length) with optional text.
mod ipc {
    use crate::error::{Error, Result};
    use std::path::Path;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const HEADER: usize = 120;
    const MODE_ACCOUNT: u32 = 7;
    const OP_NEW: u32 = 0;
    /// tgtd's code for "this account already exists".
    const USER_EXISTS: u32 = 14;

    pub fn request(mode: u32, op: u32, params: &str) -> Vec<u8> {
        let body = params.len() + 1;
        let mut req = vec![0u8; HEADER];
        req[0..4].copy_from_slice(&mode.to_ne_bytes());
        req[4..8].copy_from_slice(&op.to_ne_bytes());
        req[8..13].copy_from_slice(b"iscsi");
        req[72..76].copy_from_slice(&((HEADER + body) as u32).to_ne_bytes());
        req[76..80].copy_from_slice(&(-1i32).to_ne_bytes()); // no target
        req[88..96].copy_from_slice(&u64::MAX.to_ne_bytes()); // no LUN
        req.extend_from_slice(params.as_bytes());
        req.push(0);
        req
    }

    pub async fn new_account(socket: &Path, user: &str, password: &str) -> Result<()> {
        let params = format!("user={user},password={password}");
        let exchange = async {
            let mut s = tokio::net::UnixStream::connect(socket).await?;
            s.write_all(&request(MODE_ACCOUNT, OP_NEW, &params)).await?;
            let mut rsp = [0u8; 8];
            s.read_exact(&mut rsp).await?;
            Ok::<_, std::io::Error>(u32::from_ne_bytes(rsp[0..4].try_into().unwrap()))
        };
        let err = tokio::time::timeout(Duration::from_secs(30), exchange)
            .await
            .map_err(|_| Error::unavailable("tgtd did not answer on its management socket"))?
            .map_err(|e| {
                Error::unavailable(format!("tgtd management socket {}: {e}", socket.display()))
            })?;
        match err {
            0 | USER_EXISTS => Ok(()),
            code => Err(Error::internal(format!(
                "tgtd refused to create CHAP account {user:?} (error {code})"
            ))),
        }
    }
}

#[cfg(test)]
pub use ipc::request as ipc_request;
