//! The node side: the kernel's NVMe over Fabrics host, driven as nvme-cli
//! drives it but without a process: a connection is one write of its
//! options to `/dev/nvme-fabrics` (its DH-HMAC-CHAP keys in that write,
//! never on a command line), answered with the controller's instance; a
//! controller is let go by writing its `delete_controller`. Controllers,
//! their state and paths, and the namespace's block device are read from
//! sysfs. With the kernel's native multipath (`nvme_core.multipath=Y`,
//! Debian's default) one controller per portal serves the one block
//! device of the subsystem's namespace.

use super::reasons;
use crate::backend::export::initiator::{Connection, Initiator, NodeTerms, Paths};
use crate::error::{Error, Result};
use crate::plugin::health::Finding;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What the kernel's NVMe host's messages call things, and its reasons.
static TERMS: NodeTerms = NodeTerms {
    path: "controller",
    paths: "the NVMe controllers",
    ctx_export: "nqn",
    ctx_unit: "nsid",
    all_down: reasons::ControllerDown,
    some_down: reasons::NvmePathDown,
};

/// How a controller that lost its connection behaves (seconds; the
/// kernel's options of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reconnect {
    /// How long a controller tries to connect again before it is removed
    /// and the I/O it holds fails (-1: for ever).
    pub ctrl_loss_tmo: i32,
    /// The pause between two tries.
    pub reconnect_delay: u32,
    /// How long I/O waits on a controller connecting again before it
    /// fails (-1: until the controller is removed).
    pub fast_io_fail_tmo: i32,
}

/// The kernel's NVMe-oF host on this node.
pub struct Fabrics {
    /// `/sys` (a test's own tree in unit tests).
    pub sysfs: PathBuf,
    /// `/dev`.
    pub dev: PathBuf,
    /// This node's host NQN and host ID.
    pub host_nqn: String,
    pub host_id: String,
    /// Connect through every portal (native multipath), or through the
    /// first that answers.
    pub multipath: bool,
    /// How long a connection may take, and the namespace's device to
    /// appear.
    pub timeout: Duration,
    pub reconnect: Reconnect,
}

/// One controller of this node, as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Controller {
    /// `nvme<N>`.
    pub name: String,
    pub subsystem: String,
    pub host: String,
    /// `live`, `connecting`, `resetting`, `deleting`, ...
    pub state: String,
    /// `host:port`, as a portal is written.
    pub portal: String,
}

/// A portal from a controller's `address` (`traddr=A,trsvcid=P,...`).
fn portal_of(address: &str) -> Option<String> {
    let field = |k: &str| {
        address
            .split(',')
            .find_map(|f| f.trim().strip_prefix(k).map(str::to_string))
    };
    let (addr, port) = (field("traddr=")?, field("trsvcid=")?);
    Some(if addr.contains(':') {
        format!("[{addr}]:{port}")
    } else {
        format!("{addr}:{port}")
    })
}

/// Whether a name is a namespace's multipath head, `nvme<S>n<N>` (not a
/// path's `nvme<S>c<C>n<N>`, nor a controller or a generic `ng` device).
fn is_head(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    name.strip_prefix("nvme")
        .and_then(|r| r.split_once('n'))
        .is_some_and(|(s, n)| digits(s) && digits(n))
}

fn read(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(text.trim().to_string())
}

impl Fabrics {
    /// This node's controllers (those being made or taken down, with an
    /// attribute not whole, left out).
    pub fn controllers(&self) -> Vec<Controller> {
        let class = self.sysfs.join("class/nvme");
        let Ok(entries) = std::fs::read_dir(&class) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for e in entries.flatten() {
            let dir = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let (Some(subsystem), Some(host), Some(state), Some(address)) = (
                read(&dir.join("subsysnqn")),
                read(&dir.join("hostnqn")),
                read(&dir.join("state")),
                read(&dir.join("address")),
            ) else {
                continue;
            };
            let Some(portal) = portal_of(&address) else {
                continue;
            };
            found.push(Controller {
                name,
                subsystem,
                host,
                state,
                portal,
            });
        }
        found.sort_by(|a, b| a.name.cmp(&b.name));
        found
    }

    /// This node's controllers of subsystem `nqn` (this node's host NQN).
    fn of(&self, nqn: &str) -> Vec<Controller> {
        let mut c = self.controllers();
        c.retain(|c| c.subsystem == nqn && c.host == self.host_nqn);
        c
    }

    /// The options of a connection, as `/dev/nvme-fabrics` takes them.
    fn options(&self, to: &Connection<'_>, portal: &str) -> Result<String> {
        let (addr, port) = portal
            .rsplit_once(':')
            .ok_or_else(|| Error::invalid(format!("portal {portal:?} is not host:port")))?;
        let addr = addr.trim_start_matches('[').trim_end_matches(']');
        let r = self.reconnect;
        let mut opts = format!(
            "nqn={},transport=tcp,traddr={addr},trsvcid={port},hostnqn={},hostid={},\
             ctrl_loss_tmo={},reconnect_delay={},fast_io_fail_tmo={}",
            to.export,
            self.host_nqn,
            self.host_id,
            r.ctrl_loss_tmo,
            r.reconnect_delay,
            r.fast_io_fail_tmo
        );
        if let Some((_, key)) = to.incoming {
            opts += &format!(",dhchap_secret={key}");
        }
        if let Some((_, key)) = to.outgoing {
            opts += &format!(",dhchap_ctrl_secret={key}");
        }
        Ok(opts)
    }

    /// One connection through `portal`: the options written, the
    /// kernel's answer read. The error never shows the options (they may
    /// hold keys).
    async fn connect(&self, to: &Connection<'_>, portal: &str) -> Result<()> {
        let opts = self.options(to, portal)?;
        let fabrics = self.dev.join("nvme-fabrics");
        let (nqn, portal_s) = (to.export.to_string(), portal.to_string());
        let connect = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
            use std::io::{Read, Write};
            let mut f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&fabrics)?;
            f.write_all(opts.as_bytes())?;
            let mut answer = String::new();
            f.read_to_string(&mut answer)?;
            Ok(answer)
        });
        match tokio::time::timeout(self.timeout, connect).await {
            Ok(Ok(Ok(_))) => Ok(()),
            Ok(Ok(Err(e))) => Err(connect_error(&nqn, &portal_s, e)),
            Ok(Err(e)) => Err(Error::internal(format!("connect to {nqn}: {e}"))),
            Err(_) => Err(Error::unavailable(format!(
                "no connection to {nqn} through {portal_s} within {:?}",
                self.timeout
            ))),
        }
    }

    /// The block device of namespace `nsid` of subsystem `nqn`, once it
    /// opens.
    async fn wait_for_device(&self, nqn: &str, nsid: u32) -> Result<PathBuf> {
        let start = Instant::now();
        loop {
            if let Some(name) = self.namespace(nqn, nsid) {
                let path = self.dev.join(&name);
                if std::fs::File::open(&path).is_ok() {
                    return Ok(path);
                }
            }
            if start.elapsed() >= self.timeout {
                return Err(Error::unavailable(format!(
                    "namespace {nsid} of {nqn} did not appear within {:?}",
                    self.timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The block device (`nvme<S>n<N>`) of namespace `nsid` of subsystem
    /// `nqn`: the native multipath head under its `nvme-subsys<S>`.
    pub fn namespace(&self, nqn: &str, nsid: u32) -> Option<String> {
        let class = self.sysfs.join("class/nvme-subsystem");
        for s in std::fs::read_dir(class).ok()?.flatten() {
            if read(&s.path().join("subsysnqn")).as_deref() != Some(nqn) {
                continue;
            }
            for e in std::fs::read_dir(s.path()).ok()?.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if is_head(&name)
                    && read(&self.sysfs.join("block").join(&name).join("nsid"))
                        == Some(nsid.to_string())
                {
                    return Some(name);
                }
            }
        }
        None
    }

    /// Deletes controller `name` and waits for it to go (UNAVAILABLE when
    /// it is still there after the timeout).
    async fn delete(&self, name: &str) -> Result<()> {
        let dir = self.sysfs.join("class/nvme").join(name);
        match std::fs::write(dir.join("delete_controller"), "1") {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io(format!("delete controller {name}"), e)),
        }
        let start = Instant::now();
        while dir.exists() {
            if start.elapsed() >= self.timeout {
                return Err(Error::unavailable(format!(
                    "controller {name} is still there {:?} after its delete",
                    self.timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }
}

/// A refused connection, as the kernel says it.
fn connect_error(nqn: &str, portal: &str, e: std::io::Error) -> Error {
    use nix::errno::Errno;
    match e.raw_os_error().map(Errno::from_raw) {
        Some(Errno::ENOKEY | Errno::EKEYREJECTED) => Error::precondition(format!(
            "{nqn} through {portal}: the subsystem asks for a DH-HMAC-CHAP key this node was \
             not given, or refused the one it was"
        )),
        _ => Error::unavailable(format!("connect to {nqn} through {portal}: {e}")),
    }
}

/// How long a controller that lost its subsystem gets to connect again
/// before an unstage lets go of it.
pub const RECOVERY_GRACE: Duration = Duration::from_secs(5);

#[async_trait::async_trait]
impl Initiator for Fabrics {
    fn terms(&self) -> &'static NodeTerms {
        &TERMS
    }

    async fn attach(&self, to: &Connection<'_>) -> Result<PathBuf> {
        let mut have = self.of(to.export);
        let mut last = None;
        for portal in to.portals {
            let there = have.iter().any(|c| c.portal == *portal);
            if there || (!self.multipath && !have.is_empty()) {
                continue;
            }
            match self.connect(to, portal).await {
                Ok(()) => have = self.of(to.export),
                Err(e) => last = Some(e),
            }
        }
        if have.is_empty() {
            return Err(last
                .unwrap_or_else(|| Error::unavailable(format!("no connection to {}", to.export))));
        }
        if let Some(e) = last {
            tracing::warn!(subsystem = to.export, error = %e.message,
                "a portal refused the connection; going on with the others");
        }
        self.wait_for_device(to.export, to.unit).await
    }

    async fn detach(&self, nqn: &str) -> Result<()> {
        for c in self.of(nqn) {
            self.delete(&c.name).await?;
        }
        Ok(())
    }

    async fn release_lost(&self, nqn: &str) -> Result<()> {
        let lost = |c: &Controller| c.state != "live";
        let ours = self.of(nqn);
        if ours.is_empty() || !ours.iter().all(lost) {
            return Ok(());
        }
        let start = Instant::now();
        while start.elapsed() < RECOVERY_GRACE {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if self.of(nqn).iter().any(|c| !lost(c)) {
                return Ok(());
            }
        }
        tracing::warn!(
            subsystem = nqn,
            "its controllers lost the subsystem: let go"
        );
        self.detach(nqn).await
    }

    async fn rescan(&self, nqn: &str) -> Result<u64> {
        for c in self.of(nqn) {
            let path = self
                .sysfs
                .join("class/nvme")
                .join(&c.name)
                .join("rescan_controller");
            std::fs::write(&path, "1")
                .map_err(|e| Error::io(format!("rescan controller {}", c.name), e))?;
        }
        let name = self
            .namespace(nqn, super::nvmet::NSID)
            .ok_or_else(|| Error::not_found(format!("no namespace of {nqn} on this node")))?;
        let sectors: u64 = read(&self.sysfs.join("block").join(&name).join("size"))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::internal(format!("no size for {name}")))?;
        Ok(sectors * 512)
    }

    async fn condition(&self, nqn: &str, device: &Path) -> Result<Option<Finding>> {
        let ours = self.of(nqn);
        if ours.is_empty() {
            return Ok(Some(Finding::inaccessible(
                reasons::ControllerMissing,
                format!("no NVMe controller of {nqn}"),
            )));
        }
        let down: Vec<&Controller> = ours.iter().filter(|c| c.state != "live").collect();
        if down.len() == ours.len() {
            return Ok(Some(Finding::inaccessible(
                reasons::ControllerDown,
                format!("every controller of {nqn} is {}", down[0].state),
            )));
        }
        if let Some(c) = down.first() {
            return Ok(Some(Finding::degraded(
                reasons::NvmePathDown,
                format!("path {} of {nqn} is down ({})", c.portal, c.state),
            )));
        }
        let disk = device.file_name().map(|d| d.to_string_lossy().into_owned());
        if disk != self.namespace(nqn, super::nvmet::NSID) {
            return Ok(Some(Finding::inaccessible(
                reasons::NamespaceMissing,
                format!("{} is no longer {nqn}'s namespace", device.display()),
            )));
        }
        Ok(None)
    }

    async fn paths(&self, prefix: &str) -> Result<Paths> {
        let mut paths = Paths::default();
        for c in self.controllers() {
            let ours = c.host == self.host_nqn
                && c.subsystem
                    .strip_prefix(prefix)
                    .is_some_and(|r| r.starts_with(':'));
            if !ours {
                continue;
            }
            if c.state == "live" {
                paths.up.insert(c.portal);
            } else {
                paths.down.push(c.portal);
            }
        }
        Ok(paths)
    }
}
