//! Backends: one module per kind of storage, each a [`crate::plugin::Backend`]
//! described by the [`Kind`] its folder exports.

pub mod file;
pub mod iscsi;
mod kind;
pub mod lvm;
pub mod nfs;
pub mod rbd;

use crate::config::{BackendConfig, Config};
use crate::error::{Error, Result};
use crate::exec::CommandRunner;
use crate::host::Host;
use crate::mount::Mounter;
use crate::plugin::Registry;
pub use kind::{Env, Kind};
use std::sync::Arc;

/// Every kind of backend: adding one is its folder and a line here.
pub const KINDS: &[Kind] = &[file::KIND, lvm::KIND, nfs::KIND, iscsi::KIND, rbd::KIND];

/// The kind a config's `type` names: INVALID_ARGUMENT listing the kinds
/// there are otherwise.
pub fn kind(name: &str) -> Result<&'static Kind> {
    KINDS.iter().find(|k| k.name == name).ok_or_else(|| {
        let available: Vec<&str> = KINDS.iter().map(|k| k.name).collect();
        Error::invalid(format!(
            "unknown type {name:?} (available: {})",
            available.join(", ")
        ))
    })
}

/// The devices ferrovol's volumes attach on a node, as patterns of lvm's
/// `global_filter`: each kind's [`Kind::attaches`], then the dm-crypt maps
/// of encrypted volumes, which every block backend opens.
pub fn attached_devices() -> Vec<&'static str> {
    let mut all: Vec<&'static str> = KINDS.iter().flat_map(|k| k.attaches).copied().collect();
    all.push(crate::host::crypt::MAPS);
    all
}

/// Every health reason the driver gives: the shared ones, then each kind's.
pub fn reasons() -> Vec<crate::plugin::health::Reason> {
    let mut all = crate::plugin::health::Reason::SHARED.to_vec();
    for k in KINDS {
        all.extend(k.reasons);
    }
    all
}

/// Every kill point there is: the driver's own and each backend's.
pub fn kill_points() -> Vec<&'static str> {
    let mut all = crate::killpoint::Step::NAMES.to_vec();
    for k in KINDS {
        all.extend(k.kill_points);
    }
    all
}

/// Builds the registry from the config: each `[[backend]]` by its type.
pub fn build_registry(
    config: &Config,
    runner: Arc<dyn CommandRunner>,
    host: Arc<dyn Host>,
    mounter: Arc<dyn Mounter>,
    state_dir: &std::path::Path,
) -> Result<Registry> {
    let mut registry = Registry::new();
    let attached = attached_devices();
    let env = Env {
        runner: &runner,
        host: &host,
        mounter: &mounter,
        state_dir,
        attached: &attached,
    };
    for bc in &config.backends {
        let backend = build_backend(bc, &env)?;
        registry
            .register(backend)
            .map_err(|e| e.context("config"))?;
    }
    if let Some(name) = &config.default_backend {
        registry.set_default(name)?;
    }
    Ok(registry)
}

/// One backend from its config table, built by its kind.
pub fn build_backend(bc: &BackendConfig, env: &Env) -> Result<Arc<dyn crate::plugin::Backend>> {
    let kind = kind(&bc.kind).map_err(|e| e.context(format!("backend {:?}", bc.name())))?;
    (kind.build)(bc, env)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reasons_are_camel_case_words_each_given_once() {
        let mut seen = std::collections::BTreeSet::new();
        for r in super::reasons() {
            let s = r.as_str();
            assert!(s.chars().next().unwrap().is_ascii_uppercase(), "{s}");
            assert!(s.chars().all(|c| c.is_ascii_alphanumeric()), "{s}");
            assert!(seen.insert(s), "{s} twice");
        }
        assert!(seen.len() > crate::plugin::health::Reason::SHARED.len());
    }
}
