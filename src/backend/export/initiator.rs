//! The initiator seam: what a node's side of the export layer asks of the
//! protocol's initiator, by export name: connect to an export and find its
//! device, let it go, grow it, say what is wrong with it and with the
//! node's paths.

use super::target::Credential;
use crate::error::Result;
use crate::plugin::health::{Finding, Reason};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The words a protocol's node-side messages use, and its health reasons
/// for paths down.
#[derive(Debug, Clone, Copy)]
pub struct NodeTerms {
    /// One path to an export ("session").
    pub path: &'static str,
    /// The node's paths, in an error ("the iSCSI sessions").
    pub paths: &'static str,
    /// The publish context's key of the export's name ("iqn").
    pub ctx_export: &'static str,
    /// The publish context's key of the export's unit ("lun").
    pub ctx_unit: &'static str,
    /// Every path of the node's exports down.
    pub all_down: Reason,
    /// Some paths down, others carrying the exports.
    pub some_down: Reason,
}

/// Where and how a node connects to an export.
pub struct Connection<'a> {
    pub export: &'a str,
    /// `host:port` of each portal the export is served through.
    pub portals: &'a [&'a str],
    /// The unit of the export that is the volume (an iSCSI LUN).
    pub unit: u32,
    /// The credential the node proves itself with.
    pub incoming: Option<&'a Credential>,
    /// The credential the server proves itself with.
    pub outgoing: Option<&'a Credential>,
    /// The volume's own settings for its connection: the protocol's
    /// StorageClass parameters, as its volume context carries them.
    pub settings: &'a BTreeMap<String, String>,
}

/// The node's paths to this driver's exports.
#[derive(Debug, Default)]
pub struct Paths {
    /// The portal of each path that is down.
    pub down: Vec<String>,
    /// The portals with a path up.
    pub up: BTreeSet<String>,
}

#[async_trait::async_trait]
pub trait Initiator: Send + Sync {
    fn terms(&self) -> &'static NodeTerms;

    /// Connects to the export (reusing a connection that exists, after a
    /// restart) and returns the volume's device: with multipath, through
    /// every portal, the map over their devices.
    async fn attach(&self, to: &Connection<'_>) -> Result<PathBuf>;

    /// Flushes and removes the export's devices and disconnects. Nothing
    /// there is success.
    async fn detach(&self, export: &str) -> Result<()>;

    /// Connections to the export that lost the server, none up: given a
    /// moment to come back, then disconnected, which fails their queued
    /// I/O at once (an unmount would otherwise wait for the protocol's
    /// long timeout).
    async fn release_lost(&self, export: &str) -> Result<()>;

    /// Rescans the export so its device shows its new size; returns it.
    async fn rescan(&self, export: &str) -> Result<u64>;

    /// What is wrong with the export's connection or `device`, if
    /// anything.
    async fn condition(&self, export: &str, device: &Path) -> Result<Option<Finding>>;

    /// The node's paths to exports named `<prefix>:...`.
    async fn paths(&self, prefix: &str) -> Result<Paths>;
}
