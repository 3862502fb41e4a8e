//! The plugin layer, after Kubernetes' volume plugin framework: a backend
//! is a [`Backend`] and implements the capability traits it offers
//! ([`Provisioner`], [`Attacher`], [`DeviceMounter`], ...); a [`Registry`]
//! finds backends by name or by volume id, and the CSI services speak to
//! them only through those traits. Backends know nothing of gRPC.

mod attached;
mod capability;
mod fields;
mod groups;
pub mod health;
mod registry;
mod secrets;
mod sizing;
mod types;

pub use crate::id::{
    digest_hex, is_dns_label, is_locator, locator_for_name, validate_name, GroupSnapshotId,
    SnapshotId, VolumeId, MAX_ID_LEN, MAX_LOCATOR_LEN,
};
pub use attached::Ledger;
pub use capability::*;
pub use fields::{join_fields, split_fields};
pub use groups::{GroupRecord, GroupStore};
pub use health::{Finding, Reason};
pub use registry::{Registry, BACKEND_PARAMETER};
pub use secrets::Secrets;
pub use sizing::{check_existing, filesystem_floor, own_source, round_up, SizeRules};
pub use types::*;

/// The node's name in a node id (`<name>` or `<name>/<suffix>`): the
/// topology value, and what node-local volumes are compared with.
pub fn node_name(node_id: &str) -> &str {
    node_id.split_once('/').map_or(node_id, |(n, _)| n)
}

/// A mutable parameter that is `true` or `false`: its value, if given;
/// INVALID_ARGUMENT naming it otherwise.
pub fn mutable_bool(changes: &BTreeMap<String, String>, key: &str) -> Result<Option<bool>> {
    match changes.get(key).map(String::as_str) {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(v) => Err(Error::invalid(format!(
            "mutable parameter {key}: {v:?} is not true or false"
        ))),
    }
}

/// The tokens of a node id: `<name>/<token>,<token>...`, what the node's
/// attaching backends told controllers about it (see
/// [`Attacher::node_id_suffix`]).
pub fn node_tokens(node_id: &str) -> impl Iterator<Item = &str> {
    node_id
        .split_once('/')
        .map_or("", |(_, s)| s)
        .split(',')
        .filter(|t| !t.is_empty())
}

/// The publish-context key ControllerPublish sets for a read-only publish
/// (its `readonly` flag, which backends do not see as a key of their own):
/// the node stages and publishes such a volume read-only.
pub const CTX_READONLY: &str = "readonly";

/// Whether a publish context (any map type) is a read-only publish's.
pub fn published_read_only<'a>(get: impl FnOnce(&str) -> Option<&'a String>) -> bool {
    get(CTX_READONLY).is_some_and(|v| v == "true")
}

use crate::error::{Error, Result};
use std::collections::BTreeMap;
