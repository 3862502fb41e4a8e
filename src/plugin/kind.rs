//! What the driver knows of a kind of backend before it builds one, and
//! what the shared code asks of a built one's kind ([`super::Backend::kind`]):
//! each backend folder exports one [`Kind`], and
//! [`crate::backend::KINDS`] lists them.

use super::Backend;
use crate::config::BackendConfig;
use crate::error::Result;
use crate::exec::CommandRunner;
use crate::host::Host;
use crate::mount::Mounter;
use std::path::Path;
use std::sync::Arc;

/// A kind of backend: its config `type`, the keys its volumes take, and
/// how one is built from its `[[backend]]` table.
pub struct Kind {
    /// The config's `type`.
    pub name: &'static str,
    /// The StorageClass parameters it takes, besides `backend`,
    /// `encrypted` and the CO's `csi.storage.k8s.io/` keys (the list its
    /// docs page's table must match: tests/docs.rs).
    pub parameters: &'static [&'static str],
    /// Its mutable parameters (VolumeAttributesClass keys); an iscsi
    /// backend's store adds its own.
    pub mutable: &'static [&'static str],
    /// The keys of the CSI secrets it reads (the passphrase of encrypted
    /// volumes, [`crate::host::crypt::PASSPHRASE_KEY`], is every block
    /// backend's): which the docs and the example Secrets must name.
    pub secrets: &'static [&'static str],
    /// Its kill points' names ([`crate::killpoint`]; the enum in its
    /// folder is what its code hits).
    pub kill_points: &'static [&'static str],
    /// Patterns (lvm's regular expressions) matching a name of each device
    /// a volume of this kind attaches on the node: the lvm scans of every
    /// backend that runs lvm leave them out (a device whose server does
    /// not answer would hold each scan). None for a kind that attaches no
    /// device, or only devices lvm may read (a loop device over a file).
    pub attaches: &'static [&'static str],
    /// Tells its token in a node id from the others' (the token its
    /// `Attacher::node_id_suffix` gives: an initiator name). A node whose
    /// backends of this kind give two different tokens cannot be served:
    /// [`crate::backend::node_tokens_agree`] refuses it at start. None for a kind
    /// that gives none.
    pub node_token: Option<fn(&str) -> bool>,
    /// The health reasons only it gives (its folder's `reasons::ALL`); the
    /// shared ones are [`crate::plugin::health::Reason::SHARED`].
    pub reasons: &'static [crate::plugin::health::Reason],
    /// Subcommands of the driver's binary its backends start as children
    /// (the child serves them, then exits with the function's status):
    /// hidden, never for use by hand.
    pub helpers: &'static [Helper],
    /// What it offers as the private store of a network block backend's
    /// exports (iscsi's LUNs): None for a kind that cannot be one.
    pub store: Option<StoreKind>,
    /// Builds one from its config table.
    pub build: fn(&BackendConfig, &Env) -> Result<Arc<dyn Backend>>,
}

/// What a kind whose volumes are block devices offers as a store: a
/// backend another builds privately from its `[backend.store]` table and
/// drives as a node would, each volume a device it exports.
pub struct StoreKind {
    /// Whether its volumes' devices take holes punched in them (an image
    /// file does; a logical volume, through a hold device, does not): an
    /// export that reports thin provisioning punches one at each discard.
    pub punches_holes: bool,
    /// Adds to its config table what it needs as a store (lvm: its scans
    /// skip suspended devices, as a group's cut suspends the exports' hold
    /// devices).
    pub as_store: fn(&mut BackendConfig),
}

/// A subcommand of the driver's binary: its name, and what runs it.
pub struct Helper {
    pub command: &'static str,
    pub main: fn() -> i32,
}

/// What a backend is built with: the driver's seams and its state
/// directory.
pub struct Env<'a> {
    pub runner: &'a Arc<dyn CommandRunner>,
    pub host: &'a Arc<dyn Host>,
    pub mounter: &'a Arc<dyn Mounter>,
    pub state_dir: &'a Path,
    /// What lvm's scans leave out on this node: every kind's
    /// [`Kind::attaches`], and the driver's own dm-crypt maps
    /// ([`crate::backend::attached_devices`]).
    pub attached: &'a [&'static str],
}

/// The kind of the unit tests' backend doubles: no parameters, no mutable
/// keys, nothing else declared; never built from a config.
#[cfg(test)]
pub const DOUBLE: Kind = Kind {
    name: "double",
    parameters: &[],
    mutable: &[],
    secrets: &[],
    kill_points: &[],
    attaches: &[],
    node_token: None,
    reasons: &[],
    helpers: &[],
    store: None,
    build: |_, _| {
        Err(crate::error::Error::internal(
            "a test double is not built from a config",
        ))
    },
};
