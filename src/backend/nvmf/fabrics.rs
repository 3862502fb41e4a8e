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

/// The longest any of the reconnect settings may be (seconds): a day. A
/// path lost longer than that is a node to fence, not one to wait for.
pub const MAX_RECONNECT_SECS: i64 = 86_400;

impl Reconnect {
    /// These settings with the ones a volume's context carries (its
    /// class's parameters) in their place, checked: each an integer, -1
    /// (for ever, off) or 0 to a day for the two timeouts, 1 s to a day for
    /// the delay, and I/O failed no later than the controller is removed.
    /// INVALID_ARGUMENT naming the key otherwise.
    pub fn with(self, given: &std::collections::BTreeMap<String, String>) -> Result<Reconnect> {
        let num = |key: &str, low: i64| -> Result<Option<i64>> {
            let Some(v) = given.get(key) else {
                return Ok(None);
            };
            match v.parse::<i64>() {
                Ok(n)
                    if (n == -1 && low == -1) || (low.max(0)..=MAX_RECONNECT_SECS).contains(&n) =>
                {
                    Ok(Some(n))
                }
                _ => Err(Error::invalid(format!(
                    "parameter {key}: {v:?} is not {} to {MAX_RECONNECT_SECS} (seconds)",
                    if low == -1 { "-1 (for ever) or 0" } else { "1" }
                ))),
            }
        };
        let mut r = self;
        if let Some(n) = num(super::CTRL_LOSS_TMO, -1)? {
            r.ctrl_loss_tmo = n as i32;
        }
        if let Some(n) = num(super::RECONNECT_DELAY, 1)? {
            r.reconnect_delay = n as u32;
        }
        if let Some(n) = num(super::FAST_IO_FAIL_TMO, -1)? {
            r.fast_io_fail_tmo = n as i32;
        }
        r.check()?;
        Ok(r)
    }

    /// Whether the three agree: I/O cannot be held past the controller's
    /// removal (the kernel fails it then whatever `fast_io_fail_tmo` says;
    /// -1 is "until then"), and a delay of 0 would spin.
    pub fn check(&self) -> Result<()> {
        if self.reconnect_delay == 0 {
            return Err(Error::invalid(format!(
                "{}: 0 would try again without a pause",
                super::RECONNECT_DELAY
            )));
        }
        let (fail, loss) = (self.fast_io_fail_tmo, self.ctrl_loss_tmo);
        if fail >= 0 && loss >= 0 && fail > loss {
            return Err(Error::invalid(format!(
                "{} ({}) is longer than {} ({}): I/O would be held past the controller's removal",
                super::FAST_IO_FAIL_TMO,
                self.fast_io_fail_tmo,
                super::CTRL_LOSS_TMO,
                self.ctrl_loss_tmo
            )));
        }
        Ok(())
    }
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
    /// The ANA state of its path to the namespace (`optimized`,
    /// `non-optimized`, `inaccessible`, `persistent-loss`, `change`), where
    /// the subsystem reports one.
    pub ana: Option<String>,
}

impl Controller {
    /// Whether I/O can go through it: live, and its path not one the
    /// subsystem says it cannot serve (ANA inaccessible, lost, or
    /// changing).
    pub fn carries_io(&self) -> bool {
        self.state == "live"
            && !matches!(
                self.ana.as_deref(),
                Some("inaccessible" | "persistent-loss" | "change")
            )
    }

    /// Its state as a message says it.
    fn said(&self) -> String {
        match &self.ana {
            Some(ana) if self.state == "live" => format!("live, ANA {ana}"),
            _ => self.state.clone(),
        }
    }
}

/// The ANA state of the first path device (`nvme<S>c<C>n<N>`) in a
/// controller's folder that has one.
fn ana_of(dir: &Path) -> Option<String> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("nvme")
                .and_then(|r| r.split_once('c'))
                .and_then(|(s, r)| r.split_once('n').map(|(c, n)| [s, c, n]))
                .is_some_and(|parts| parts.iter().all(|p| digits(p)))
        })
        .map(|e| e.path())
        .collect();
    paths.sort();
    paths.iter().find_map(|p| read(&p.join("ana_state")))
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
    name.strip_prefix("nvme")
        .and_then(|r| r.split_once('n'))
        .is_some_and(|(s, n)| digits(s) && digits(n))
}

/// Whether `s` is one or more decimal digits (a device name's numbers).
fn digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
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
                ana: ana_of(&dir),
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
        let r = self.reconnect.with(to.settings)?;
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

/// NVMe's admin command passthrough (`struct nvme_passthru_cmd` of
/// `linux/nvme_ioctl.h`).
#[repr(C)]
#[derive(Default)]
struct PassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}

nix::ioctl_readwrite!(nvme_admin_cmd, b'N', 0x41, PassthruCmd);

/// Namespace `nsid`'s size in bytes as the subsystem answers Identify
/// Namespace (its size in blocks, NSZE, times its block size: the LBA
/// format FLBAS names) through controller device `ctrl` (`/dev/nvme<N>`).
#[allow(unsafe_code)] // the kernel's admin passthrough: an ioctl
fn identified_size(ctrl: &Path, nsid: u32) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(ctrl)?;
    let mut data = vec![0u8; 4096];
    let mut cmd = PassthruCmd {
        opcode: 0x06, // Identify
        nsid,
        addr: data.as_mut_ptr() as u64,
        data_len: data.len() as u32,
        cdw10: 0, // CNS 0: the namespace's data structure
        timeout_ms: 10_000,
        ..Default::default()
    };
    // SAFETY: `cmd` is the kernel's layout, and its buffer (`data`) lives,
    // and is as long as it says, until the call returns.
    let status =
        unsafe { nvme_admin_cmd(f.as_raw_fd(), &mut cmd) }.map_err(std::io::Error::from)?;
    if status != 0 {
        return Err(std::io::Error::other(format!(
            "Identify Namespace answered status {status:#x}"
        )));
    }
    Ok(namespace_bytes(&data))
}

/// The size of an Identify Namespace data structure's namespace: NSZE
/// (bytes 0-7) blocks of 2^LBADS bytes, LBADS of the LBA format (at byte
/// 128, 4 bytes each) FLBAS (byte 26, bits 0-3 and 5-6) names.
pub fn namespace_bytes(id: &[u8]) -> u64 {
    let nsze = u64::from_le_bytes(id[0..8].try_into().unwrap());
    let flbas = id[26];
    let format = usize::from(flbas & 0x0f) | (usize::from((flbas >> 5) & 0x03) << 4);
    let at = 128 + 4 * format;
    let lbads = id[at + 2];
    nsze << lbads
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
        if self.host_nqn.is_empty() || self.host_id.is_empty() {
            return Err(Error::precondition(
                "this node has no host NQN and host ID (/etc/nvme/hostnqn, hostid) as the \
                 driver started: it serves no nvmf volume",
            ));
        }
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

    /// The namespace's size once the host shows what the subsystem
    /// reports: a rescan (like the subsystem's own notice of a change)
    /// only queues the host's scan, so the size the subsystem gives in
    /// answer to Identify Namespace, asked through a live controller, is
    /// waited for (at most the connect timeout). Without an answer (no
    /// live controller), the size the host shows.
    async fn rescan(&self, nqn: &str) -> Result<u64> {
        let ours = self.of(nqn);
        for c in &ours {
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
        let shown = || -> Result<u64> {
            let sectors: u64 = read(&self.sysfs.join("block").join(&name).join("size"))
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| Error::internal(format!("no size for {name}")))?;
            Ok(sectors * 512)
        };
        let Some(live) = ours.iter().find(|c| c.state == "live") else {
            return shown();
        };
        let dev = self.dev.join(&live.name);
        let reported =
            tokio::task::spawn_blocking(move || identified_size(&dev, super::nvmet::NSID))
                .await
                .map_err(|e| Error::internal(format!("identify namespace of {nqn}: {e}")))?;
        let reported = match reported {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!(subsystem = nqn, error = %e,
                    "Identify Namespace not answered; taking the size the host shows");
                return shown();
            }
        };
        let start = Instant::now();
        loop {
            let size = shown()?;
            if size >= reported {
                return Ok(size);
            }
            if start.elapsed() >= self.timeout {
                return Err(Error::unavailable(format!(
                    "{name} shows {size} bytes {:?} after a rescan; {nqn} reports {reported}",
                    self.timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn condition(&self, nqn: &str, device: &Path) -> Result<Option<Finding>> {
        let ours = self.of(nqn);
        if ours.is_empty() {
            return Ok(Some(Finding::inaccessible(
                reasons::ControllerMissing,
                format!("no NVMe controller of {nqn}"),
            )));
        }
        let down: Vec<&Controller> = ours.iter().filter(|c| !c.carries_io()).collect();
        if down.len() == ours.len() {
            return Ok(Some(Finding::inaccessible(
                reasons::ControllerDown,
                format!("every controller of {nqn} is down ({})", down[0].said()),
            )));
        }
        if let Some(c) = down.first() {
            return Ok(Some(Finding::degraded(
                reasons::NvmePathDown,
                format!("path {} of {nqn} is down ({})", c.portal, c.said()),
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
            if c.carries_io() {
                paths.up.insert(c.portal);
            } else {
                paths.down.push(c.portal);
            }
        }
        Ok(paths)
    }
}
