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
mod kind;
mod limits;
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
#[cfg(test)]
pub use kind::DOUBLE;
pub use kind::{Env, Helper, Kind, StoreKind};
pub use limits::{LimitBook, Offer, Relay, Relimit};
pub use registry::{Registry, BACKEND_PARAMETER};
pub use secrets::Secrets;
pub use sizing::{check_existing, filesystem_floor, own_source, round_up, SizeRules};
pub use types::*;

/// The node's name in a node id (`<name>` or `<name>/<suffix>`): the
/// topology value, and what node-local volumes are compared with.
pub fn node_name(node_id: &str) -> &str {
    node_id.split_once('/').map_or(node_id, |(n, _)| n)
}

/// A backend's own StorageClass parameters checked, once, before it sees
/// them: each key one it takes ([`Backend::parameters`], its kind's
/// list; INVALID_ARGUMENT naming the first that is not, and the ones it
/// takes), then the values ([`Backend::validate_parameters`]).
pub fn check_parameters(backend: &dyn Backend, own: &BTreeMap<String, String>) -> Result<()> {
    let known = backend.parameters();
    if let Some(key) = own.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(Error::unknown_parameter(backend.name(), key, &known));
    }
    backend.validate_parameters(own)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A kind that takes one parameter, `size`.
    const SIZED: Kind = Kind {
        name: "sized",
        parameters: &["size"],
        ..DOUBLE
    };

    /// A backend of that kind whose value check counts its calls and
    /// refuses a size of 0.
    #[derive(Default)]
    struct Sized(AtomicUsize);

    #[async_trait::async_trait]
    impl Backend for Sized {
        fn name(&self) -> &str {
            "s"
        }
        fn kind(&self) -> &'static Kind {
            &SIZED
        }
        async fn health(&self) -> Result<()> {
            Ok(())
        }
        fn access_modes(&self) -> Vec<AccessMode> {
            SINGLE_NODE_MODES.to_vec()
        }
        fn validate_parameters(&self, p: &BTreeMap<String, String>) -> Result<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            match p.get("size").map(String::as_str) {
                Some("0") => Err(Error::invalid("size 0")),
                _ => Ok(()),
            }
        }
    }

    #[test]
    fn parameters_are_checked_by_their_kind_s_keys_before_the_backend_sees_their_values() {
        let b = Sized::default();
        let p = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        let e = check_parameters(&b, &p("speed", "0")).unwrap_err();
        assert_eq!(e.kind, crate::error::Kind::InvalidArgument);
        assert!(
            e.message.contains("\"speed\" (it takes size)"),
            "{}",
            e.message
        );
        assert_eq!(b.0.load(Ordering::SeqCst), 0, "the backend never saw it");
        let e = check_parameters(&b, &p("size", "0")).unwrap_err();
        assert_eq!(e.message, "size 0");
        check_parameters(&b, &p("size", "1")).unwrap();
        check_parameters(&b, &BTreeMap::new()).unwrap();
        assert_eq!(b.0.load(Ordering::SeqCst), 3);
    }
}
