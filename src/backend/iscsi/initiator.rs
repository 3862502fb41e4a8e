//! The node side: open-iscsi through `iscsiadm` (exec seam, timeouts), the
//! node record's CHAP settings written to its file (a secret never goes on
//! a command line), and the LUN's disk found through sysfs.

use super::reasons;
use crate::backend::export::initiator::{Connection, Initiator, NodeTerms, Paths};
use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner};
use crate::plugin::health::Finding;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a multipath map something holds open for a moment is tried
/// again before its flush's refusal is the unstage's, and the pause
/// between tries.
const FLUSH_WAIT: Duration = Duration::from_secs(10);
const FLUSH_PAUSE: Duration = Duration::from_millis(200);

/// iscsiadm's exit codes that mean "already so".
const NO_OBJECTS: i32 = 21;
const SESSION_EXISTS: i32 = 15;
const LOGIN_AUTH_FAILED: i32 = 24;
/// How long a sysfs write to a SCSI device (delete, rescan) may wait on
/// its path.
const SYSFS_DEADLINE: Duration = Duration::from_secs(60);

/// This node's initiator name, from open-iscsi's file.
pub fn initiator_name(file: &Path) -> Result<String> {
    let text = std::fs::read_to_string(file).map_err(|e| {
        Error::io(
            format!("read the initiator name from {}", file.display()),
            e,
        )
    })?;
    let name = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix("InitiatorName="))
        .map(str::trim)
        .ok_or_else(|| Error::invalid(format!("{} has no InitiatorName=", file.display())))?;
    if !super::is_iqn(name) {
        return Err(Error::invalid(format!(
            "{}: initiator name {name:?} is not an iqn. name",
            file.display()
        )));
    }
    Ok(name.to_string())
}

/// Whether the disk's device node opens: the kernel makes the node and
/// the disk's sysfs entry a moment before the disk can be opened (until
/// then an open fails with ENXIO), and says it is ready only by its
/// uevent. A session is read from sysfs at once after the login, so the
/// disk is often found in that moment. Opened for reading without waiting
/// (`O_NONBLOCK`); any error but the disk's absence is left for whoever
/// uses it to report.
fn opens(dev: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(dev)
    {
        Ok(_) => true,
        Err(e) => !matches!(
            e.raw_os_error(),
            Some(libc::ENXIO | libc::ENOENT | libc::ENODEV)
        ),
    }
}

/// Whether two `host:port` portals are the same (an IPv6 host in brackets
/// or not).
fn same_portal(a: &str, b: &str) -> bool {
    let norm = |p: &str| p.replace(['[', ']'], "");
    norm(a) == norm(b)
}

/// One open-iscsi session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub sid: u32,
    pub portal: String,
    pub iqn: String,
}

/// Parses `iscsiadm -m session`: `tcp: [3] 127.0.0.1:3260,1 iqn... (non-flash)`.
pub fn parse_sessions(text: &str) -> Vec<Session> {
    text.lines()
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let _transport = parts.next()?;
            let sid = parts
                .next()?
                .strip_prefix('[')?
                .strip_suffix(']')?
                .parse()
                .ok()?;
            let portal = parts.next()?.rsplit_once(',')?.0.to_string();
            let iqn = parts.next()?.to_string();
            Some(Session { sid, portal, iqn })
        })
        .collect()
}

/// open-iscsi on this node.
pub struct OpenIscsi {
    pub runner: Arc<dyn CommandRunner>,
    /// Log in through every portal and use a dm-multipath map over them.
    pub multipath: bool,
    pub node_db: PathBuf,
    pub sysfs: PathBuf,
    /// Where device nodes are (`/dev`; a directory of the test's own in
    /// unit tests, as `sysfs` is).
    pub dev: PathBuf,
    pub timeout: Duration,
    /// How long a session that lost its connection holds I/O before
    /// failing it (seconds).
    pub replacement_timeout: u64,
}

/// How long a session that lost its target gets to log in again before
/// an unstage lets go of it (see [`OpenIscsi::release_lost`]).
pub const RECOVERY_GRACE: Duration = Duration::from_secs(5);

/// The node record's setting for [`OpenIscsi::replacement_timeout`].
const REPLACEMENT_TIMEOUT: &str = "node.session.timeo.replacement_timeout";

use super::Chap;

/// What a login came to.
enum Login {
    /// iscsiadm logged in.
    Made,
    /// iscsid has a session (or a login under way) to the target through
    /// the portal already.
    InProgress,
}

impl OpenIscsi {
    fn iscsiadm(&self) -> Command {
        Command::new("iscsiadm").timeout(Duration::from_secs(30))
    }

    /// Runs iscsiadm; `Ok(false)` when it says there is nothing to act on
    /// (or it is already done, for the codes in `already`).
    async fn run(&self, cmd: Command, already: &[i32]) -> Result<bool> {
        match self.runner.run(cmd).await {
            Ok(_) => Ok(true),
            Err(e) if e.exit_code().is_some_and(|c| already.contains(&c)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The sessions to target `iqn`.
    pub async fn sessions(&self, iqn: &str) -> Result<Vec<Session>> {
        let mut all = self.all_sessions().await?;
        all.retain(|s| s.iqn == iqn);
        Ok(all)
    }

    /// Every session of the node: read from sysfs, or listed by
    /// `iscsiadm -m session` where sysfs cannot say.
    async fn all_sessions(&self) -> Result<Vec<Session>> {
        if let Some(found) = self.sysfs_sessions() {
            return Ok(found);
        }
        match self
            .runner
            .run(self.iscsiadm().args(["-m", "session"]))
            .await
        {
            Ok(out) => Ok(parse_sessions(&out.stdout)),
            Err(e) if e.exit_code() == Some(NO_OBJECTS) => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }

    /// Every session, read where `iscsiadm -m session` reads it: the
    /// target name of `class/iscsi_session/session<sid>`, and the
    /// persistent address and port of its connection,
    /// `class/iscsi_connection/connection<sid>:0` (a process of iscsiadm
    /// for each listing cost 50-70 ms of CPU in the guest, and a stage
    /// lists two to four times). `None`, for iscsiadm to answer, when the
    /// kernel has no iSCSI transport class yet (none loaded) or an entry
    /// is not whole: a session being made or taken down has an empty or
    /// unset attribute for a moment.
    fn sysfs_sessions(&self) -> Option<Vec<Session>> {
        let class = self.sysfs.join("class");
        let entries = std::fs::read_dir(class.join("iscsi_session")).ok()?;
        let attr = |path: PathBuf| {
            let text = std::fs::read_to_string(path).ok()?;
            let value = text.trim();
            (!value.is_empty() && value != "(null)").then(|| value.to_string())
        };
        let mut found = Vec::new();
        for entry in entries {
            let name = entry.ok()?.file_name();
            let Some(sid) = name
                .to_str()
                .and_then(|n| n.strip_prefix("session"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let iqn = attr(self.session_dir(sid).join("targetname"))?;
            let conn = class
                .join("iscsi_connection")
                .join(format!("connection{sid}:0"));
            let address = attr(conn.join("persistent_address"))?;
            let port = attr(conn.join("persistent_port"))?;
            // As iscsiadm prints it: an IPv6 address in brackets.
            let portal = if address.contains(':') {
                format!("[{address}]:{port}")
            } else {
                format!("{address}:{port}")
            };
            found.push(Session { sid, portal, iqn });
        }
        found.sort_by_key(|s| s.sid);
        Some(found)
    }

    /// The sessions to `iqn` once one through `portal` is listed: iscsid
    /// said it has one, which it lists once logged in. Asked every 200 ms
    /// for the login's timeout (at least); UNAVAILABLE when none is
    /// listed by then.
    async fn session_through(&self, iqn: &str, portal: &str) -> Result<Vec<Session>> {
        const EVERY: Duration = Duration::from_millis(200);
        let asks = self.timeout.as_millis() / EVERY.as_millis() + 1;
        for ask in 1..=asks {
            let sessions = self.sessions(iqn).await?;
            if sessions.iter().any(|s| same_portal(&s.portal, portal)) {
                return Ok(sessions);
            }
            if ask < asks {
                tokio::time::sleep(EVERY).await;
            }
        }
        Err(Error::unavailable(format!(
            "iscsid is still logging in to {iqn} through {portal} (an earlier login's, which \
             goes on after its iscsiadm was stopped); not logged in within {:?}",
            self.timeout
        )))
    }

    async fn login(
        &self,
        iqn: &str,
        portal: &str,
        incoming: Option<&Chap>,
        outgoing: Option<&Chap>,
    ) -> Result<Login> {
        let node = |cmd: Command| cmd.args(["-m", "node", "-T", iqn, "-p", portal]);
        self.run(node(self.iscsiadm()).args(["-o", "new"]), &[SESSION_EXISTS])
            .await?;
        self.run(
            node(self.iscsiadm()).args(["-o", "update", "-n", "node.startup", "-v", "manual"]),
            &[],
        )
        .await?;
        self.write_session_settings(iqn, portal, incoming, outgoing)?;
        let login = node(self.iscsiadm()).arg("--login").timeout(self.timeout);
        match self.runner.run(login).await {
            Ok(_) => Ok(Login::Made),
            Err(e) if e.exit_code() == Some(SESSION_EXISTS) => Ok(Login::InProgress),
            Err(e) => {
                let auth = e.exit_code() == Some(LOGIN_AUTH_FAILED);
                let err = Error::from(e);
                // This portal's record goes; the others' stay.
                self.run(node(self.iscsiadm()).args(["-o", "delete"]), &[NO_OBJECTS])
                    .await?;
                Err(if auth {
                    Error::precondition(format!(
                        "the target refused this node's CHAP credentials: {}",
                        err.message
                    ))
                } else {
                    err
                })
            }
        }
    }

    /// The multipath map over `disks` (all paths to one LUN), made by
    /// `multipath` when there is none yet.
    async fn map(&self, disks: &[PathBuf]) -> Result<PathBuf> {
        let names: Vec<String> = disks
            .iter()
            .filter_map(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        if let Some(map) = self.holder(&names) {
            return Ok(self.dev.join("mapper").join(map));
        }
        self.run(
            Command::new("multipath")
                .arg(path_arg(&disks[0])?)
                .timeout(Duration::from_secs(60)),
            &[],
        )
        .await?;
        let start = Instant::now();
        loop {
            if let Some(map) = self.holder(&names) {
                return Ok(self.dev.join("mapper").join(map));
            }
            if start.elapsed() >= self.timeout {
                return Err(Error::unavailable(format!(
                    "no multipath map over {} appeared within {:?}",
                    names.join(", "),
                    self.timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The name of the multipath map holding any of `disks`. Other holders
    /// (an encrypted volume's LUKS mapping over the disk) are not maps:
    /// multipath marks its own by their dm uuid, `mpath-...`.
    fn holder(&self, disks: &[String]) -> Option<String> {
        for disk in disks {
            let holders = self.sysfs.join("block").join(disk).join("holders");
            let Ok(holders) = std::fs::read_dir(holders) else {
                continue;
            };
            for h in holders.flatten() {
                let dm = h.file_name().to_string_lossy().into_owned();
                let dm_dir = self.sysfs.join("block").join(&dm).join("dm");
                let uuid = std::fs::read_to_string(dm_dir.join("uuid")).unwrap_or_default();
                if !uuid.starts_with("mpath-") {
                    continue;
                }
                let Ok(name) = std::fs::read_to_string(dm_dir.join("name")) else {
                    continue;
                };
                let name = name.trim();
                if !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
                {
                    return Some(name.to_string());
                }
            }
        }
        None
    }

    /// The dm device (`dm-N`) of map `name`, by its holders.
    fn map_dm(&self, disks: &[String], name: &str) -> Option<String> {
        for disk in disks {
            let holders = self.sysfs.join("block").join(disk).join("holders");
            let Ok(holders) = std::fs::read_dir(holders) else {
                continue;
            };
            for h in holders.flatten() {
                let dm = h.file_name().to_string_lossy().into_owned();
                let n = std::fs::read_to_string(self.sysfs.join("block").join(&dm).join("dm/name"))
                    .unwrap_or_default();
                if n.trim() == name {
                    return Some(dm);
                }
            }
        }
        None
    }

    /// The node record files of `iqn` at `portal` (open-iscsi keeps one per
    /// portal and portal group: `<db>/<iqn>/<host>,<port>,<tpgt>/default`).
    fn records(&self, iqn: &str, portal: &str) -> Result<Vec<PathBuf>> {
        let dir = self.node_db.join(iqn);
        let (host, port) = portal.rsplit_once(':').unwrap_or((portal, "3260"));
        let host = host.trim_start_matches('[').trim_end_matches(']');
        // `<host>,<port>` when made with `-o new`, `<host>,<port>,<tpgt>`
        // when found by discovery.
        let exact = format!("{host},{port}");
        let prefix = format!("{exact},");
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| Error::io(format!("read node records in {}", dir.display()), e))?;
        let mut out = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name != exact && !name.starts_with(&prefix) {
                continue;
            }
            let p = e.path();
            out.push(if p.is_dir() { p.join("default") } else { p });
        }
        Ok(out)
    }

    /// Sets the record's CHAP settings (or clears them) and its
    /// replacement timeout by editing its file, so the secret never
    /// appears on a command line.
    fn write_session_settings(
        &self,
        iqn: &str,
        portal: &str,
        incoming: Option<&Chap>,
        outgoing: Option<&Chap>,
    ) -> Result<()> {
        let records = self.records(iqn, portal)?;
        if records.is_empty() {
            return Err(Error::internal(format!(
                "iscsiadm made no node record for {iqn} at {portal} under {}",
                self.node_db.display()
            )));
        }
        for path in records {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
            let mut lines: Vec<String> = text
                .lines()
                .filter(|l| {
                    let l = l.trim_start();
                    !l.starts_with("node.session.auth.") && !l.starts_with(REPLACEMENT_TIMEOUT)
                })
                .map(str::to_string)
                .collect();
            let mut auth = vec![format!(
                "node.session.auth.authmethod = {}",
                if incoming.is_some() { "CHAP" } else { "None" }
            )];
            if let Some((u, p)) = incoming {
                auth.push(format!("node.session.auth.username = {u}"));
                auth.push(format!("node.session.auth.password = {p}"));
            }
            if let Some((u, p)) = outgoing {
                auth.push(format!("node.session.auth.username_in = {u}"));
                auth.push(format!("node.session.auth.password_in = {p}"));
            }
            auth.push(format!(
                "{REPLACEMENT_TIMEOUT} = {}",
                self.replacement_timeout
            ));
            let at = lines
                .iter()
                .position(|l| l.starts_with("# END RECORD"))
                .unwrap_or(lines.len());
            lines.splice(at..at, auth);
            let mut body = lines.join("\n");
            body.push('\n');
            crate::records::write(&path, body.as_bytes())?;
        }
        Ok(())
    }

    /// The kernel's state of session `sid` (`LOGGED_IN`, `FAILED`,
    /// `FREE`); empty when it is gone.
    fn session_state(&self, sid: u32) -> String {
        std::fs::read_to_string(self.session_dir(sid).join("state"))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    fn session_dir(&self, sid: u32) -> PathBuf {
        self.sysfs
            .join("class/iscsi_session")
            .join(format!("session{sid}"))
    }

    /// The disk of LUN `lun` in session `sid`, if the kernel made it.
    pub fn disk(&self, sid: u32, lun: u32) -> Option<String> {
        let device = self.session_dir(sid).join("device");
        for target in std::fs::read_dir(&device).ok()?.flatten() {
            if !target.file_name().to_string_lossy().starts_with("target") {
                continue;
            }
            for unit in std::fs::read_dir(target.path()).ok()?.flatten() {
                let name = unit.file_name().to_string_lossy().into_owned();
                if name.rsplit(':').next().and_then(|l| l.parse::<u32>().ok()) != Some(lun)
                    || name.split(':').count() != 4
                {
                    continue;
                }
                let block = unit.path().join("block");
                if let Some(disk) = std::fs::read_dir(block).ok()?.flatten().next() {
                    return Some(disk.file_name().to_string_lossy().into_owned());
                }
            }
        }
        None
    }

    /// Every disk of session `sid`.
    fn disks(&self, sid: u32) -> Vec<String> {
        let mut out = Vec::new();
        let device = self.session_dir(sid).join("device");
        let Ok(targets) = std::fs::read_dir(device) else {
            return out;
        };
        for target in targets.flatten() {
            let Ok(units) = std::fs::read_dir(target.path()) else {
                continue;
            };
            for unit in units.flatten() {
                if let Ok(disks) = std::fs::read_dir(unit.path().join("block")) {
                    out.extend(
                        disks
                            .flatten()
                            .map(|d| d.file_name().to_string_lossy().into_owned()),
                    );
                }
            }
        }
        out
    }

    /// Waits (polling sysfs, bounded) for the LUN's disk; asks for a rescan
    /// once if it is slow to appear.
    async fn wait_for_disk(&self, session: &Session, lun: u32) -> Result<PathBuf> {
        let start = Instant::now();
        let mut rescanned = false;
        loop {
            if let Some(disk) = self.disk(session.sid, lun) {
                let dev = self.dev.join(&disk);
                if opens(&dev) {
                    return Ok(dev);
                }
            }
            if start.elapsed() >= self.timeout {
                return Err(Error::unavailable(format!(
                    "LUN {lun} of {} did not appear within {:?}",
                    session.iqn, self.timeout
                )));
            }
            if !rescanned && start.elapsed() >= self.timeout / 3 {
                rescanned = true;
                let sid = session.sid.to_string();
                self.run(
                    self.iscsiadm()
                        .args(["-m", "session", "-r", &sid, "--rescan"]),
                    &[],
                )
                .await?;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Flushes multipath map `map` over `disks`. Something may hold it
    /// open for a moment: udev probes the device as the filesystem just
    /// unmounted from it closes it, multipathd reloads it. Such a flush is
    /// refused ("map in use", or the removal busy), so a refused one is
    /// tried again until [`FLUSH_WAIT`] has passed; then its error stands
    /// (a map still mounted somewhere). A map that went meanwhile is done.
    async fn flush_map(&self, map: &str, disks: &[String]) -> Result<()> {
        let until = Instant::now() + FLUSH_WAIT;
        loop {
            let flushed = self
                .run(
                    Command::new("multipath")
                        .args(["-f", map])
                        .timeout(Duration::from_secs(60)),
                    &[],
                )
                .await;
            match flushed {
                Ok(_) => return Ok(()),
                Err(_) if self.holder(disks).as_deref() != Some(map) => return Ok(()),
                Err(e) if Instant::now() < until => {
                    tracing::debug!(%map, error = %e.message, "multipath map in use for now: trying again");
                    tokio::time::sleep(FLUSH_PAUSE).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// What open-iscsi's messages call things, and its health reasons.
static TERMS: NodeTerms = NodeTerms {
    path: "session",
    paths: "the iSCSI sessions",
    ctx_export: "iqn",
    ctx_unit: "lun",
    all_down: reasons::SessionDown,
    some_down: reasons::PathDown,
};

#[async_trait::async_trait]
impl Initiator for OpenIscsi {
    fn terms(&self) -> &'static NodeTerms {
        &TERMS
    }

    /// Logs in to `iqn` (reusing a session that exists, after a restart)
    /// and returns LUN `lun`'s disk. With multipath, logs in through every
    /// portal and returns the multipath map over the disks.
    async fn attach(&self, to: &Connection<'_>) -> Result<PathBuf> {
        let (iqn, portals, lun) = (to.export, to.portals, to.unit);
        let (incoming, outgoing) = (to.incoming, to.outgoing);
        let mut sessions = self.sessions(iqn).await?;
        let mut last = None;
        for portal in portals {
            let have = sessions.iter().any(|s| same_portal(&s.portal, portal));
            if have || (!self.multipath && !sessions.is_empty()) {
                continue;
            }
            match self.login(iqn, portal, incoming, outgoing).await {
                Ok(Login::Made) => sessions = self.sessions(iqn).await?,
                // An earlier login through this portal goes on in iscsid
                // (its iscsiadm killed at a call's deadline: iscsid keeps
                // trying): this one waits for it to end.
                Ok(Login::InProgress) => match self.session_through(iqn, portal).await {
                    Ok(found) => sessions = found,
                    Err(e) => last = Some(e),
                },
                Err(e) => last = Some(e),
            }
        }
        if sessions.is_empty() {
            // Nothing logged in: no record of ours left behind.
            self.run(
                self.iscsiadm()
                    .args(["-m", "node", "-T", iqn, "-o", "delete"]),
                &[NO_OBJECTS],
            )
            .await?;
            return Err(last.unwrap_or_else(|| Error::unavailable(format!("no session to {iqn}"))));
        }
        if let Some(e) = last {
            tracing::warn!(target_name = iqn, error = %e.message, "a portal refused the login; going on with the others");
        }
        if !self.multipath {
            return self.wait_for_disk(&sessions[0], lun).await;
        }
        let mut disks = Vec::new();
        for session in &sessions {
            disks.push(self.wait_for_disk(session, lun).await?);
        }
        self.map(&disks).await
    }

    async fn detach(&self, iqn: &str) -> Result<()> {
        let sessions = self.sessions(iqn).await?;
        let all: Vec<String> = sessions.iter().flat_map(|s| self.disks(s.sid)).collect();
        while let Some(map) = self.holder(&all) {
            // The map over this target's disks goes first (refused while
            // something holds it open).
            self.flush_map(&map, &all).await?;
            if self.holder(&all).as_deref() == Some(map.as_str()) {
                return Err(Error::internal(format!(
                    "multipath map {map} is still there"
                )));
            }
        }
        for session in sessions {
            // A session that lost its target (a node fenced at detach, a
            // target gone) cannot take a flush: its disk's unwritten data
            // has nowhere to go, and the flush would fail or wait.
            let state = self.session_state(session.sid);
            if state != "LOGGED_IN" {
                tracing::warn!(%iqn, sid = session.sid, %state,
                    "the session is not logged in: its disks are removed unflushed");
            }
            for disk in self.disks(session.sid) {
                let dev = self.dev.join(&disk);
                if state == "LOGGED_IN" && dev.exists() {
                    self.run(
                        Command::new("blockdev")
                            .args(["--flushbufs", &path_arg(&dev)?])
                            .timeout(Duration::from_secs(60)),
                        &[],
                    )
                    .await?;
                }
                let delete = self.sysfs.join("block").join(&disk).join("device/delete");
                crate::host::write_sysfs(delete, "1", SYSFS_DEADLINE).await?;
            }
            let sid = session.sid.to_string();
            let logout = self
                .run(
                    self.iscsiadm()
                        .args(["-m", "session", "-r", &sid, "--logout"]),
                    &[NO_OBJECTS],
                )
                .await;
            // A session that ended meanwhile answers "could not get session
            // info": gone is what was wanted.
            if let Err(e) = logout {
                if self
                    .sessions(iqn)
                    .await?
                    .iter()
                    .any(|s| s.sid == session.sid)
                {
                    return Err(e);
                }
            }
        }
        self.run(
            self.iscsiadm()
                .args(["-m", "node", "-T", iqn, "-o", "delete"]),
            &[NO_OBJECTS],
        )
        .await?;
        Ok(())
    }

    /// Flushes and removes the disks of every session to `iqn`, logs out,
    /// and deletes the node records. Nothing there is success.
    /// Sessions to `iqn` that lost their target, none logged in: given
    /// [`RECOVERY_GRACE`] to come back, then detached (logged out), which
    /// fails their disks' queued I/O at once. Without it, an unmount of a
    /// filesystem on them waits for `replacement_timeout` (two minutes by
    /// default) and the unstage fails meanwhile, stuck in the kernel. What
    /// their disks still held unwritten had nowhere to go.
    async fn release_lost(&self, iqn: &str) -> Result<()> {
        let sessions = self.sessions(iqn).await?;
        let up = |s: &[Session]| s.iter().any(|s| self.session_state(s.sid) == "LOGGED_IN");
        if sessions.is_empty() || up(&sessions) {
            return Ok(());
        }
        let until = std::time::Instant::now() + RECOVERY_GRACE;
        while std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if up(&sessions) {
                return Ok(());
            }
        }
        tracing::warn!(%iqn, "no session to the target is logged in: logging out before the unmount");
        self.detach(iqn).await
    }

    /// Rescans the session so the disk shows the LUN's new size; returns it.
    async fn rescan(&self, iqn: &str) -> Result<u64> {
        let session = self
            .sessions(iqn)
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| Error::precondition(format!("no iSCSI session to {iqn}")))?;
        let sid = session.sid.to_string();
        self.run(
            self.iscsiadm()
                .args(["-m", "session", "-r", &sid, "--rescan"]),
            &[],
        )
        .await?;
        let mut size = 0;
        let mut disks = Vec::new();
        for s in self.sessions(iqn).await? {
            if s.sid != session.sid {
                let sid = s.sid.to_string();
                self.run(
                    self.iscsiadm()
                        .args(["-m", "session", "-r", &sid, "--rescan"]),
                    &[],
                )
                .await?;
            }
            disks.extend(self.disks(s.sid));
        }
        for disk in disks.clone() {
            let rescan = self.sysfs.join("block").join(&disk).join("device/rescan");
            if !crate::host::write_sysfs(rescan.clone(), "1", SYSFS_DEADLINE).await? {
                return Err(Error::not_found(format!("{} is gone", rescan.display())));
            }
            let sectors =
                std::fs::read_to_string(self.sysfs.join("block").join(&disk).join("size"))
                    .map_err(|e| Error::io(format!("size of {disk}"), e))?;
            size = size.max(sectors.trim().parse::<u64>().unwrap_or(0) * 512);
        }
        if let Some(map) = self.holder(&disks) {
            // The map takes its size from its paths when reloaded.
            self.run(
                Command::new("multipath")
                    .args(["-r", &map])
                    .timeout(Duration::from_secs(60)),
                &[],
            )
            .await?;
            let dm = self.map_dm(&disks, &map).ok_or_else(|| {
                Error::internal(format!("multipath map {map} vanished during the rescan"))
            })?;
            let sectors = std::fs::read_to_string(self.sysfs.join("block").join(&dm).join("size"))
                .map_err(|e| Error::io(format!("size of {map}"), e))?;
            size = sectors.trim().parse::<u64>().unwrap_or(0) * 512;
        }
        Ok(size)
    }

    /// What is wrong with the volume's session or disk, if anything.
    async fn condition(&self, iqn: &str, device: &Path) -> Result<Option<Finding>> {
        let Some(session) = self.sessions(iqn).await?.into_iter().next() else {
            return Ok(Some(Finding::inaccessible(
                reasons::SessionMissing,
                format!("no iSCSI session to {iqn}"),
            )));
        };
        let state = self.session_state(session.sid);
        if state != "LOGGED_IN" {
            return Ok(Some(Finding::inaccessible(
                reasons::SessionDown,
                format!(
                    "iSCSI session {} to {iqn} is {}",
                    session.sid,
                    if state.is_empty() { "gone" } else { &state }
                ),
            )));
        }
        let disk = device.file_name().map(|d| d.to_string_lossy().into_owned());
        if device.starts_with(self.dev.join("mapper")) {
            let mut disks = Vec::new();
            for s in self.sessions(iqn).await? {
                let state = self.session_state(s.sid);
                if state != "LOGGED_IN" {
                    return Ok(Some(Finding::degraded(
                        reasons::PathDown,
                        format!("path {} of {iqn} is down ({state})", s.portal),
                    )));
                }
                disks.extend(self.disks(s.sid));
            }
            if self.holder(&disks).as_deref() != disk.as_deref() {
                return Ok(Some(Finding::inaccessible(
                    reasons::MultipathMapGone,
                    format!("multipath map {} is gone", device.display()),
                )));
            }
            return Ok(None);
        }
        if disk.is_none_or(|d| !self.disks(session.sid).contains(&d)) {
            return Ok(Some(Finding::inaccessible(
                reasons::LunMissing,
                format!("{} is no longer a disk of the session", device.display()),
            )));
        }
        Ok(None)
    }

    /// The portals of this driver's sessions (to targets named
    /// `<prefix>:...`) that are not logged in, and those that still have
    /// one that is.
    async fn paths(&self, prefix: &str) -> Result<Paths> {
        let all = self.all_sessions().await?;
        let ours = all.into_iter().filter(|s| {
            s.iqn
                .strip_prefix(prefix)
                .is_some_and(|r| r.starts_with(':'))
        });
        let mut paths = Paths::default();
        for s in ours {
            if self.session_state(s.sid) == "LOGGED_IN" {
                paths.up.insert(s.portal);
            } else {
                paths.down.push(s.portal);
            }
        }
        Ok(paths)
    }
}
