//! The `nvmf` backend, NVMe over TCP: the export layer's second protocol
//! ([`super::export`]). Its target server is the kernel's nvmet through
//! configfs ([`nvmet`]): a subsystem per volume, its namespace 1 the
//! store's device, a host granted by its host NQN. Its initiator is the
//! kernel's NVMe-oF host through `/dev/nvme-fabrics` and sysfs
//! ([`fabrics`]), with native multipath over every portal. DH-HMAC-CHAP
//! keys come from the calls' secrets. Not yet in [`super::KINDS`]: its
//! deployment comes first.

pub mod fabrics;
pub mod nvmet;
#[cfg(test)]
mod tests;

use super::export::{self, Exported, Exports};
use crate::config::BackendConfig;
use crate::error::{Error, Result};
use crate::exec::CommandRunner;
use crate::plugin::{Backend, Secrets};
use fabrics::{Fabrics, Reconnect};
use nvmet::{Nvmet, Port};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

crate::reasons! {
    /// The health reasons only this backend gives (the shared ones are
    /// [`crate::plugin::health::Reason`]'s).
    pub mod reasons {
        /// nvmet no longer serves the volume's subsystem.
        SubsystemMissing,
        /// No NVMe controller of the volume's subsystem on the node.
        ControllerMissing,
        /// No controller of the volume's subsystem is live.
        ControllerDown,
        /// One controller (path) of the volume is down; others carry it.
        NvmePathDown,
        /// The staged device is no longer the subsystem's namespace.
        NamespaceMissing,
    }
}

crate::kill_points! {
    /// Where a test can kill the driver in this backend's operations
    /// ([`crate::killpoint`]).
    pub enum KillPoint {
        /// the hold devices of the volumes in use are suspended (their
        /// hosts' writes wait); no snapshot is taken.
        Held = "nvmf.held",
        /// ModifyVolume: the store's keys are changed; the record is not.
        ModifyStore = "nvmf.modify.store",
    }
}

/// The `nvmf` kind: a subsystem of the kernel's nvmet per volume, kept in
/// a private `file` or `lvm` store.
pub const KIND: super::Kind = super::Kind {
    name: "nvmf",
    parameters: &[CTRL_LOSS_TMO, RECONNECT_DELAY, FAST_IO_FAIL_TMO],
    mutable: &[],
    kill_points: KillPoint::NAMES,
    // A namespace's head device, by the model nvmet reports for ferrovol's
    // subsystems (a local NVMe disk has its maker's).
    attaches: &["/dev/disk/by-id/nvme-ferrovol_"],
    node_token: Some(is_nqn),
    reasons: reasons::ALL,
    secrets: &[DHCHAP_KEY, DHCHAP_CTRL_KEY],
    helpers: &[],
    store: None,
    build,
};

/// StorageClass parameters: a volume's own reconnect settings (seconds),
/// in place of its node's config (`ctrl_loss_tmo`, `reconnect_delay`,
/// `fast_io_fail_tmo`); carried to the node in the volume context.
pub const CTRL_LOSS_TMO: &str = "ctrlLossTmo";
pub const RECONNECT_DELAY: &str = "reconnectDelay";
pub const FAST_IO_FAIL_TMO: &str = "fastIoFailTmo";

/// Secrets keys: the key the host proves itself with (ControllerPublish
/// sets it on the host's entry, NodeStage connects with it)...
pub const DHCHAP_KEY: &str = "dhchapKey";
/// ...and the key the subsystem answers with (bidirectional).
pub const DHCHAP_CTRL_KEY: &str = "dhchapCtrlKey";

/// An nvmf backend and its store (see the iscsi backend's: the same
/// layer, another protocol).
fn build(bc: &BackendConfig, env: &super::Env) -> Result<Arc<dyn Backend>> {
    let settings: NvmfSettings = bc.settings()?;
    let store = super::export::store::build(bc.name(), settings.store.as_ref(), env)?;
    Ok(Arc::new(NvmfBackend::new(
        bc.name(),
        settings,
        env.runner.clone(),
        store,
        env.state_dir.join("nvmf").join(bc.name()),
    )?))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmfSettings {
    /// Subsystems are named `<nqn_prefix>:<volume>`; a node connects only
    /// to subsystems under it.
    pub nqn_prefix: String,
    /// `address:port` of each port nvmet listens on, as nodes reach it
    /// (an IP address: nvmet binds it).
    #[serde(default)]
    pub portals: Vec<String>,
    /// The backing store (controller side): a backend table of its own.
    pub store: Option<BackendConfig>,
    /// nvmet's port ids for the portals: this one for the first, the
    /// next for the second, ...
    #[serde(default = "default_first_port_id")]
    pub first_port_id: u16,
    /// nvmet's configfs tree (controller side).
    #[serde(default = "default_configfs")]
    pub configfs: PathBuf,
    /// This node's host NQN and host ID (node side).
    #[serde(default = "default_host_nqn_file")]
    pub host_nqn_file: PathBuf,
    #[serde(default = "default_host_id_file")]
    pub host_id_file: PathBuf,
    /// Connect through every portal (native multipath), not only the
    /// first that answers.
    #[serde(default = "default_multipath")]
    pub multipath: bool,
    /// How long a connection may take, and the namespace's device to
    /// appear (seconds).
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: u64,
    /// How long a controller that lost its subsystem tries to connect
    /// again before it is removed (seconds; -1: for ever).
    #[serde(default = "default_ctrl_loss_tmo")]
    pub ctrl_loss_tmo: i32,
    /// The pause between two tries (seconds).
    #[serde(default = "default_reconnect_delay")]
    pub reconnect_delay: u32,
    /// How long I/O waits on a controller connecting again before it
    /// fails (seconds; -1: until the controller is removed).
    #[serde(default = "default_fast_io_fail_tmo")]
    pub fast_io_fail_tmo: i32,
}

fn default_first_port_id() -> u16 {
    4420
}
fn default_configfs() -> PathBuf {
    "/sys/kernel/config/nvmet".into()
}
fn default_host_nqn_file() -> PathBuf {
    "/etc/nvme/hostnqn".into()
}
fn default_host_id_file() -> PathBuf {
    "/etc/nvme/hostid".into()
}
fn default_multipath() -> bool {
    true
}
fn default_connect_timeout() -> u64 {
    30
}
/// Half an hour of tries: a target host's reboot or a partition heals
/// without a remount.
fn default_ctrl_loss_tmo() -> i32 {
    1800
}
/// Tries are cheap over TCP.
fn default_reconnect_delay() -> u32 {
    2
}
/// I/O held two minutes, as iscsi's `replacement_timeout`, then failed:
/// a pod is never stuck for ever on a volume whose target is gone.
fn default_fast_io_fail_tmo() -> i32 {
    120
}

/// Whether a node id's token is an NVMe qualified name: the nvmf
/// backends' token ([`super::Kind::node_token`]).
fn is_nqn(token: &str) -> bool {
    token.starts_with("nqn.")
}

/// Whether `s` is an NQN we accept: `nqn.`, at most 223 bytes, printable
/// without separators a configfs name or an options string would split.
pub fn valid_nqn(s: &str) -> bool {
    is_nqn(s)
        && s.len() <= 223
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:_".contains(&b))
}

/// A DH-HMAC-CHAP key as `nvme gen-dhchap-key` writes it:
/// `DHHC-1:<hash, 2 digits>:<base64 of the key and its CRC>:`. The error
/// never shows the key.
fn check_key(key: &str, what: &str) -> Result<()> {
    let bad = || {
        Error::invalid(format!(
            "secrets: {what} is not a DH-HMAC-CHAP key (DHHC-1:<hash>:<base64>:)"
        ))
    };
    let rest = key.strip_prefix("DHHC-1:").ok_or_else(bad)?;
    let (hash, rest) = rest.split_once(':').ok_or_else(bad)?;
    let body = rest.strip_suffix(':').ok_or_else(bad)?;
    let hash_ok = hash.len() == 2 && hash.bytes().all(|b| b.is_ascii_digit());
    let body_ok = (36..=92).contains(&body.len())
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b));
    if !hash_ok || !body_ok {
        return Err(bad());
    }
    Ok(())
}

/// The nvmf backend: its volumes exported as nvmet's subsystems, connected
/// to by the kernel's NVMe-oF host.
pub type NvmfBackend = Exported<Nvmf>;

/// NVMe over TCP, as the export layer's protocol.
pub struct Nvmf {
    settings: NvmfSettings,
}

impl Nvmf {
    /// The reconnect settings of this backend's config.
    fn reconnect(&self) -> Reconnect {
        Reconnect {
            ctrl_loss_tmo: self.settings.ctrl_loss_tmo,
            reconnect_delay: self.settings.reconnect_delay,
            fast_io_fail_tmo: self.settings.fast_io_fail_tmo,
        }
    }
}

impl Exported<Nvmf> {
    pub fn new(
        name: &str,
        settings: NvmfSettings,
        runner: Arc<dyn CommandRunner>,
        store: Option<Arc<dyn Backend>>,
        state_dir: PathBuf,
    ) -> Result<Self> {
        let bad = |what: &str| Error::invalid(format!("backend {name:?}: {what}"));
        if !valid_nqn(&settings.nqn_prefix) || settings.nqn_prefix.len() > 160 {
            return Err(bad(
                "nqn_prefix must be an nqn. name (a-z, A-Z, 0-9, '-', '.', ':', '_'; at most 160 bytes)",
            ));
        }
        let mut ports = Vec::new();
        for (i, p) in settings.portals.iter().enumerate() {
            let addr: std::net::SocketAddr = p
                .parse()
                .map_err(|_| bad(&format!("portal {p:?} is not an IP address and a port")))?;
            let id = settings
                .first_port_id
                .checked_add(i as u16)
                .ok_or_else(|| bad("first_port_id leaves no room for every portal"))?;
            ports.push(Port {
                id,
                addr: addr.ip(),
                service: addr.port(),
            });
        }
        if store.is_some() && ports.is_empty() {
            return Err(bad("a controller (with a store) needs at least one portal"));
        }
        for (what, p) in [
            ("configfs", &settings.configfs),
            ("host_nqn_file", &settings.host_nqn_file),
            ("host_id_file", &settings.host_id_file),
        ] {
            crate::config::absolute(p, what)?;
        }
        // A node connects as its host NQN and host ID. A node without them
        // (or a controller alone, which connects nowhere) still builds the
        // backend: its node id token is then refused (`node_token`), so the
        // backend is out on this node, saying why, and the others serve.
        let host_nqn =
            read_token(&settings.host_nqn_file, "host NQN", valid_nqn).unwrap_or_default();
        let host_id =
            read_token(&settings.host_id_file, "host ID", valid_host_id).unwrap_or_default();
        let protocol = Nvmf { settings };
        let reconnect = protocol
            .reconnect()
            .with(&BTreeMap::new())
            .map_err(|e| bad(&format!("reconnect settings: {}", e.message)))?;
        let settings = &protocol.settings;
        let target = Arc::new(Nvmet::new(settings.configfs.clone(), ports));
        let initiator = Arc::new(Fabrics {
            sysfs: "/sys".into(),
            dev: "/dev".into(),
            host_nqn,
            host_id,
            multipath: settings.multipath,
            timeout: Duration::from_secs(settings.connect_timeout),
            reconnect,
        });
        let prefix = settings.nqn_prefix.clone();
        let setup = export::Setup {
            name: name.to_string(),
            export_name: Box::new(move |locator| nqn_for(&prefix, locator)),
            prefix: settings.nqn_prefix.clone(),
            portals: settings.portals.clone(),
            dir: state_dir,
            held: || crate::killpoint::hit(KillPoint::Held),
        };
        let exports = Exports::new(setup, target, initiator, store, runner);
        Ok(Exported::from_parts(protocol, exports, || {
            crate::killpoint::hit(KillPoint::ModifyStore)
        }))
    }
}

/// A subsystem's name ([`export::name_for`]).
pub fn nqn_for(prefix: &str, locator: &str) -> String {
    export::name_for(prefix, locator)
}

/// Whether `s` is a host ID as nvme-cli writes it: a UUID.
fn valid_host_id(s: &str) -> bool {
    s.len() == 36 && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// The one line of a file of nvme-cli's (`/etc/nvme/hostnqn`), checked.
fn read_token(file: &Path, what: &str, valid: fn(&str) -> bool) -> Result<String> {
    let text = std::fs::read_to_string(file).map_err(|e| {
        Error::io(
            format!("read this node's {what} from {}", file.display()),
            e,
        )
    })?;
    let token = text.trim();
    if !valid(token) {
        return Err(Error::invalid(format!(
            "{}: {what} {token:?} is not valid",
            file.display()
        )));
    }
    Ok(token.to_string())
}

#[async_trait::async_trait]
impl export::Protocol for Nvmf {
    fn kind(&self) -> &'static super::Kind {
        &KIND
    }

    /// The host NQN, once both it and the host ID are there and valid
    /// (a connection needs both).
    fn node_token(&self) -> Result<String> {
        read_token(&self.settings.host_id_file, "host ID", valid_host_id)?;
        read_token(&self.settings.host_nqn_file, "host NQN", valid_nqn)
    }

    /// The node's host NQN, when its node id carries one.
    fn host_in<'a>(&self, node_id: &'a str) -> Option<&'a str> {
        crate::plugin::node_tokens(node_id).find(|t| valid_nqn(t))
    }

    /// A volume's reconnect settings, checked over the defaults (the
    /// node's own config is checked at start; see [`Reconnect::with`]).
    fn check_parameters(&self, own: &BTreeMap<String, String>) -> Result<()> {
        self.reconnect().with(own).map(drop)
    }

    /// The host's key and, for both ways, the subsystem's: each a
    /// credential of the host (nvmet keeps them on the host's entry).
    fn credentials(&self, secrets: &Secrets, host: Option<&str>) -> Result<export::Credentials> {
        let user = host.unwrap_or_default().to_string();
        let key = secrets.get(DHCHAP_KEY);
        let ctrl = secrets.get(DHCHAP_CTRL_KEY);
        if let Some(k) = key {
            check_key(k, DHCHAP_KEY)?;
        }
        if let Some(k) = ctrl {
            check_key(k, DHCHAP_CTRL_KEY)?;
            if key.is_none() {
                return Err(Error::invalid(format!(
                    "secrets: {DHCHAP_CTRL_KEY} needs {DHCHAP_KEY} too"
                )));
            }
        }
        Ok((
            key.map(|k| (user.clone(), k.to_string())),
            ctrl.map(|k| (user, k.to_string())),
        ))
    }
}
