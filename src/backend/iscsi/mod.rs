//! The `iscsi` backend: volumes served as iSCSI LUNs, one target per
//! volume, with a controller that really grants access.
//!
//! Controller side (where the target server runs): the backing store is a
//! private backend of another type (`[backend.store]`, a `file` pool or an
//! `lvm` device class), driven exactly as a node drives it: create, attach
//! (a loop device or an active LV), expand, snapshot, delete. Each volume
//! gets target `<iqn_prefix>:<volume>` with the store's device as LUN 1;
//! ControllerPublish adds the node's initiator name (carried in its node
//! id) to the target's ACL and sets CHAP from the secrets; what was made is
//! recorded under the state dir, so targets are rebuilt when the target
//! server lost them (tgt keeps nothing across its own restart).
//!
//! Node side: open-iscsi (`iscsiadm`) logs in to exactly the published
//! target with manual startup, CHAP secrets written into the node record
//! (never on a command line), finds the LUN's disk through sysfs, and undoes
//! it all at unstage. See `initiator.rs`.

mod health;
pub use health::reasons;
mod initiator;
pub mod target;
mod targets;
#[cfg(test)]
mod tests;

use super::export::{self, Exported, Exports};
use crate::config::BackendConfig;
use crate::error::{Error, Kind, Result};
use crate::exec::CommandRunner;
use crate::plugin::{Backend, Secrets, VolumeId};
use initiator::OpenIscsi;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use targets::Tgt;

/// The `iscsi` kind: a LUN of a tgt target per volume, kept in a private
/// `file` or `lvm` store.
pub const KIND: super::Kind = super::Kind {
    name: "iscsi",
    parameters: &[],
    mutable: &[THIN_PROVISIONING],
    kill_points: KillPoint::NAMES,
    // A LUN's disk, by its by-path link.
    attaches: &["/dev/disk/by-path/.*-iscsi-"],
    node_token: Some(is_iscsi_name),
    reasons: reasons::ALL,
    secrets: &[CHAP_USER, CHAP_PASSWORD, MUTUAL_USER, MUTUAL_PASSWORD],
    helpers: &[],
    store: None,
    build,
};

crate::kill_points! {
    /// Where a test can kill the driver in this backend's operations
    /// ([`crate::killpoint`]).
    pub enum KillPoint {
        /// the hold devices of the volumes in use are suspended (their
        /// initiators' writes wait); no snapshot is taken.
        Held = "iscsi.held",
        /// ModifyVolume: the store's keys are changed; the LUN's and the
        /// record are not.
        ModifyStore = "iscsi.modify.store",
    }
}

/// An iscsi backend and its store. The store is private to it: built
/// here, never registered, so its volumes are reachable only as LUNs.
fn build(
    bc: &crate::config::BackendConfig,
    env: &super::Env,
) -> Result<Arc<dyn crate::plugin::Backend>> {
    let settings: IscsiSettings = bc.settings()?;
    let store = super::export::store::build(bc.name(), settings.store.as_ref(), env)?;
    Ok(Arc::new(IscsiBackend::new(
        bc.name(),
        settings,
        env.runner.clone(),
        store,
        store_dir(env.state_dir, bc.name()),
    )?))
}

/// Secrets keys: CHAP the initiator answers (ControllerPublish sets the
/// account on the target, NodeStage logs in with it)...
pub const CHAP_USER: &str = "chapUsername";
pub const CHAP_PASSWORD: &str = "chapPassword";
/// ...and mutual CHAP, the target's answer to the initiator.
pub const MUTUAL_USER: &str = "chapMutualUsername";
pub const MUTUAL_PASSWORD: &str = "chapMutualPassword";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IscsiSettings {
    /// Targets are named `<iqn_prefix>:<volume>`; the node logs in only to
    /// targets under it.
    pub iqn_prefix: String,
    /// `host:port` of the target server as nodes reach it (the publish
    /// context carries them).
    #[serde(default)]
    pub portals: Vec<String>,
    /// The backing store (controller side): a backend table of its own.
    pub store: Option<BackendConfig>,
    /// tgtd's control port (`tgtd -C`, `tgtadm -C`) and socket directory.
    #[serde(default)]
    pub control_port: u32,
    #[serde(default = "default_tgt_socket_dir")]
    pub tgt_socket_dir: PathBuf,
    /// Where this node's initiator name is (node side).
    #[serde(default = "default_initiator_file")]
    pub initiator_name_file: PathBuf,
    /// open-iscsi's node records (node side).
    #[serde(default = "default_node_db")]
    pub node_db: PathBuf,
    /// Log in through every portal and stage a dm-multipath map over the
    /// paths (needs multipath-tools on the node).
    #[serde(default)]
    pub multipath: bool,
    /// How long a login may take, and the LUN's disk to appear (seconds).
    #[serde(default = "default_login_timeout")]
    pub login_timeout: u64,
    /// How long a session that lost its connection holds the volume's
    /// I/O before failing it (seconds; open-iscsi's
    /// `replacement_timeout`). Also how long the processes of a node
    /// fenced at detach stay blocked before their writes fail.
    #[serde(default = "default_replacement_timeout")]
    pub replacement_timeout: u64,
}

fn default_tgt_socket_dir() -> PathBuf {
    "/var/run/tgtd".into()
}
fn default_initiator_file() -> PathBuf {
    "/etc/iscsi/initiatorname.iscsi".into()
}
fn default_node_db() -> PathBuf {
    "/etc/iscsi/nodes".into()
}
fn default_replacement_timeout() -> u64 {
    120
}
fn default_login_timeout() -> u64 {
    30
}

/// The mutable parameter of the LUN itself; the store's own are passed on.
pub const THIN_PROVISIONING: &str = "thinProvisioning";

/// `thinProvisioning`'s value.
fn thin_value(changes: &BTreeMap<String, String>) -> Result<Option<bool>> {
    crate::plugin::mutable_bool(changes, THIN_PROVISIONING)
}

/// The iscsi backend: its volumes exported as tgt's targets, logged in
/// to with open-iscsi.
pub type IscsiBackend = Exported<Iscsi>;

/// iSCSI, as the export layer's protocol.
pub struct Iscsi {
    settings: IscsiSettings,
    /// open-iscsi on this node (the exports' initiator; the tests look at
    /// it).
    #[cfg_attr(not(test), allow(dead_code))]
    initiator: Arc<OpenIscsi>,
}

/// Whether `s` is a valid iSCSI qualified name we accept (the `iqn.`
/// form, lowercase).
pub fn is_iqn(s: &str) -> bool {
    s.len() <= 223
        && s.starts_with("iqn.")
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.:".contains(&b))
}

/// Whether a node id's token is an iSCSI name (RFC 3720: `iqn.`, `eui.`,
/// `naa.`): the iscsi backends' token ([`super::Kind::node_token`]).
fn is_iscsi_name(token: &str) -> bool {
    ["iqn.", "eui.", "naa."]
        .iter()
        .any(|p| token.starts_with(p))
}

/// The node's iSCSI initiator name, when its node id carries one.
fn node_initiator(node_id: &str) -> Option<&str> {
    crate::plugin::node_tokens(node_id).find(|t| is_iscsi_name(t))
}

/// A portal: `host:port` (see `config::is_host_port`).
pub use crate::config::is_host_port as is_portal;

/// CHAP names: printable, no separators tgt or iscsiadm would split on.
fn check_chap_user(user: &str) -> Result<()> {
    if user.is_empty()
        || user.len() > 64
        || !user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:@-".contains(&b))
    {
        return Err(Error::invalid(
            "CHAP user name: 1 to 64 of a-z, A-Z, 0-9, '.', '_', ':', '@', '-'",
        ));
    }
    Ok(())
}

/// CHAP secrets: 12 to 64 printable characters without spaces, ',' or
/// '=' (the error never shows the value).
fn check_chap_password(password: &str) -> Result<()> {
    if password.len() < 12
        || password.len() > 64
        || !password
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b',' && b != b'=')
    {
        return Err(Error::invalid(
            "CHAP secret: 12 to 64 printable characters without spaces, ',' or '='",
        ));
    }
    Ok(())
}

/// A CHAP pair: user name and secret.
pub type Chap = export::Credential;

/// The CHAP pairs in a secrets map: (incoming, outgoing), each checked.
pub fn chap_from(secrets: &Secrets) -> Result<(Option<Chap>, Option<Chap>)> {
    let pair = |u: &str, p: &str| -> Result<Option<Chap>> {
        match (secrets.get(u), secrets.get(p)) {
            (None, None) => Ok(None),
            (Some(user), Some(password)) => {
                check_chap_user(user)?;
                check_chap_password(password)?;
                Ok(Some((user.to_string(), password.to_string())))
            }
            _ => Err(Error::invalid(format!("secrets: {u} and {p} go together"))),
        }
    };
    let incoming = pair(CHAP_USER, CHAP_PASSWORD)?;
    let outgoing = pair(MUTUAL_USER, MUTUAL_PASSWORD)?;
    if outgoing.is_some() && incoming.is_none() {
        return Err(Error::invalid(
            "secrets: mutual CHAP needs CHAP in the other direction too",
        ));
    }
    Ok((incoming, outgoing))
}

impl Exported<Iscsi> {
    pub fn new(
        name: &str,
        settings: IscsiSettings,
        runner: Arc<dyn CommandRunner>,
        store: Option<Arc<dyn Backend>>,
        state_dir: PathBuf,
    ) -> Result<Self> {
        let bad = |what: &str| Error::invalid(format!("backend {name:?}: {what}"));
        if !is_iqn(&settings.iqn_prefix) || settings.iqn_prefix.len() > 160 {
            return Err(bad(
                "iqn_prefix must be an iqn. name (lowercase, at most 160 bytes)",
            ));
        }
        if let Some(p) = settings.portals.iter().find(|p| !is_portal(p)) {
            return Err(bad(&format!("portal {p:?} is not host:port")));
        }
        // tgtadm keeps `-C` in a signed 16-bit integer: a tgtd on a larger
        // port could not be administered by hand.
        if settings.control_port > 32767 {
            return Err(bad(&format!(
                "control_port {} is out of range: tgtadm takes 0 to 32767",
                settings.control_port
            )));
        }
        if store.is_some() && settings.portals.is_empty() {
            return Err(bad("a controller (with a store) needs at least one portal"));
        }
        for (what, p) in [
            ("tgt_socket_dir", &settings.tgt_socket_dir),
            ("initiator_name_file", &settings.initiator_name_file),
            ("node_db", &settings.node_db),
        ] {
            crate::config::absolute(p, what)?;
        }
        let target = Arc::new(Tgt::new(settings.control_port, &settings.tgt_socket_dir));
        let prefix = settings.iqn_prefix.clone();
        let setup = export::Setup {
            name: name.to_string(),
            export_name: Box::new(move |locator| Self::iqn_for(&prefix, locator)),
            prefix: settings.iqn_prefix.clone(),
            portals: settings.portals.clone(),
            dir: state_dir,
            held: || crate::killpoint::hit(KillPoint::Held),
        };
        let initiator = Arc::new(OpenIscsi {
            runner: runner.clone(),
            multipath: settings.multipath,
            node_db: settings.node_db.clone(),
            sysfs: "/sys".into(),
            dev: "/dev".into(),
            timeout: Duration::from_secs(settings.login_timeout),
            replacement_timeout: settings.replacement_timeout,
        });
        let exports = Exports::new(setup, target, initiator.clone(), store, runner);
        Ok(Exported::from_parts(
            Iscsi {
                settings,
                initiator,
            },
            exports,
            || crate::killpoint::hit(KillPoint::ModifyStore),
        ))
    }

    /// A test's own `sys` and `dev` directories under `root`.
    #[cfg(test)]
    fn with_roots(mut self, root: &std::path::Path) -> Self {
        let old = &self.protocol.initiator;
        let initiator = Arc::new(OpenIscsi {
            runner: old.runner.clone(),
            sysfs: root.join("sys"),
            dev: root.join("dev"),
            node_db: old.node_db.clone(),
            ..**old
        });
        self.exports = self
            .exports
            .without_holds()
            .with_initiator(initiator.clone());
        self.protocol.initiator = initiator;
        self
    }

    /// The target name of a volume ([`export::name_for`]).
    pub fn iqn_for(prefix: &str, locator: &str) -> String {
        export::name_for(prefix, locator)
    }

    /// A volume's target name (the tests look).
    #[cfg(test)]
    fn iqn(&self, id: &VolumeId) -> String {
        self.exports.export_name(id)
    }

    /// A volume's record (the tests look).
    #[cfg(test)]
    fn load(&self, id: &VolumeId) -> Result<Option<export::record::Record>> {
        self.exports.load(id)
    }

    #[cfg(test)]
    fn save(&self, id: &VolumeId, record: &export::record::Record) -> Result<()> {
        self.exports.save(id, record)
    }

    /// open-iscsi on this node (the tests look at its sessions).
    #[cfg(test)]
    fn initiator(&self) -> &OpenIscsi {
        &self.protocol.initiator
    }
}

#[async_trait::async_trait]
impl export::Protocol for Iscsi {
    fn kind(&self) -> &'static super::Kind {
        &KIND
    }

    fn node_token(&self) -> Result<String> {
        initiator::initiator_name(&self.settings.initiator_name_file)
    }

    /// The node's initiator name, when its node id carries an `iqn.` one.
    fn host_in<'a>(&self, node_id: &'a str) -> Option<&'a str> {
        node_initiator(node_id).filter(|i| is_iqn(i))
    }

    /// CHAP, and mutual CHAP, from the secrets.
    fn credentials(&self, secrets: &Secrets, _host: Option<&str>) -> Result<export::Credentials> {
        chap_from(secrets)
    }

    fn mutable_keys(&self) -> &'static [&'static str] {
        &[THIN_PROVISIONING]
    }

    fn check_mutable(&self, exports: &Exports, own: &BTreeMap<String, String>) -> Result<()> {
        // tgt answers UNMAP (and WRITE SAME with UNMAP, which Linux zeroes
        // with) by punching a hole in LUN 1's backing store: a file can
        // take it, a logical volume (through its hold device) cannot, and
        // tgt then fails the command with a hardware error: discards,
        // fstrim and ext4's online resize all fail on the node.
        let holes = exports.store().kind().is_none_or(|s| s.punches_holes);
        if thin_value(own)? == Some(true) && !holes {
            return Err(Error::invalid(format!(
                "{THIN_PROVISIONING}: backend {}'s LUNs are logical volumes, which cannot punch \
                 the holes tgt makes for a LUN that reports thin provisioning (every discard, \
                 and a filesystem's online resize, would fail with a hardware error on the \
                 node); thin provisioning is for a file store",
                exports.name()
            )));
        }
        Ok(())
    }

    /// Thin provisioning on the LUN (a change tgt cannot refuse), the
    /// record last; undone on the LUN if the record cannot be saved.
    async fn modify(
        &self,
        exports: &Exports,
        id: &VolumeId,
        record: &mut export::record::Record,
        own: &BTreeMap<String, String>,
    ) -> Result<()> {
        let Some(on) = thin_value(own)?.filter(|on| *on != record.thin_provisioning) else {
            return Ok(());
        };
        exports.ensure(id, record).await?;
        let target = exports.target();
        target.set_thin_provisioning(&record.export, on).await?;
        record.thin_provisioning = on;
        if let Err(e) = exports.save(id, record) {
            let _ = target.set_thin_provisioning(&record.export, !on).await;
            return Err(e);
        }
        Ok(())
    }
}

/// Where a store's records live when it is the iscsi backend's.
pub fn store_dir(state_dir: &Path, name: &str) -> PathBuf {
    state_dir.join("iscsi").join(name)
}
