//! Backends: one module per kind of storage, each a [`crate::plugin::Backend`]
//! described by the [`Kind`] its folder exports.

pub mod export;
pub mod file;
pub mod iscsi;
pub mod lvm;
pub mod nfs;
pub mod nvmf;
pub mod rbd;

use crate::config::{BackendConfig, Config};
use crate::error::{Error, Result};
use crate::exec::CommandRunner;
use crate::host::Host;
use crate::mount::Mounter;
use crate::plugin::Registry;
pub use crate::plugin::{Env, Helper, Kind, StoreKind};
use std::sync::Arc;

/// Every kind of backend: adding one is its folder and two lines here
/// (its `mod` and its entry in this list).
pub const KINDS: &[Kind] = &[
    file::KIND,
    lvm::KIND,
    nfs::KIND,
    iscsi::KIND,
    rbd::KIND,
    nvmf::KIND,
];

/// The backend a driver started without a config serves: the embedded
/// `file` backend, its pool in the state directory (runs on any Linux
/// box).
pub fn built_in(state_dir: &std::path::Path) -> BackendConfig {
    file::built_in(state_dir)
}

/// The helper subcommand of the driver's binary of this name, if any
/// kind has one.
pub fn helper(command: &str) -> Option<&'static Helper> {
    KINDS
        .iter()
        .flat_map(|k| k.helpers)
        .find(|h| h.command == command)
}

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

/// Whether the tokens a node's backends give for its node id can be told
/// apart: two different tokens of one kind (two iSCSI initiator names from
/// two iscsi backends) would leave controllers guessing which is this
/// node's. INVALID_ARGUMENT naming the kind when they cannot.
pub fn node_tokens_agree(tokens: &[String]) -> Result<()> {
    for k in KINDS {
        let Some(claims) = k.node_token else { continue };
        let theirs: std::collections::BTreeSet<&str> = tokens
            .iter()
            .map(String::as_str)
            .filter(|t| claims(t))
            .collect();
        if theirs.len() > 1 {
            return Err(Error::invalid(format!(
                "this node's {} backends give different node id tokens ({}): give them one",
                k.name,
                theirs.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
    }
    Ok(())
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
    use super::*;

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

    #[test]
    fn the_built_in_backend_is_a_file_pool_in_the_state_directory() {
        let b = super::built_in(std::path::Path::new("/var/lib/ferrovol"));
        assert_eq!(b.name(), "file");
        assert_eq!(b.kind, "file");
        assert_eq!(b.settings["pool"].as_str(), Some("/var/lib/ferrovol/pool"));
        assert_eq!(b.settings.len(), 1);
    }

    #[test]
    fn helper_subcommands_are_found_by_name_and_none_is_a_public_one() {
        assert!(super::helper("lvm-helper").is_some());
        for public in ["serve", "client", "freeze-holder", "help", ""] {
            assert!(super::helper(public).is_none(), "{public}");
        }
    }

    #[test]
    fn an_iscsi_store_is_of_a_kind_that_can_hold_luns_and_gets_what_it_needs_as_one() {
        let runner: Arc<dyn CommandRunner> = Arc::new(crate::exec::FakeRunner::new());
        let host: Arc<dyn Host> = Arc::new(crate::host::FakeHost::new());
        let mounter: Arc<dyn Mounter> = Arc::new(crate::mount::FakeMounter::new());
        let dir = tempfile::tempdir().unwrap();
        let env = Env {
            runner: &runner,
            host: &host,
            mounter: &mounter,
            state_dir: dir.path(),
            attached: &[],
        };
        let iscsi = |store: &str| {
            let text = format!(
                "[[backend]]\ntype = \"iscsi\"\niqn_prefix = \"iqn.2026-11.x\"\n\
                 portals = [\"127.0.0.1:3260\"]\n[backend.store]\n{store}"
            );
            Config::parse(&text).unwrap().backends.remove(0)
        };
        let e = build_backend(&iscsi("type = \"nfs\"\n"), &env)
            .err()
            .unwrap();
        assert_eq!(e.kind, crate::error::Kind::InvalidArgument);
        assert!(
            e.message
                .contains("the store must be of a type that can hold LUNs (file, lvm)"),
            "{}",
            e.message
        );
        // lvm's scans skip suspended devices when it is a store.
        let mut lvm = iscsi("type = \"lvm\"\nlvm_config = \"log/verbose=0\"\n")
            .settings::<crate::backend::iscsi::IscsiSettings>()
            .unwrap()
            .store
            .unwrap();
        (kind("lvm").unwrap().store.as_ref().unwrap().as_store)(&mut lvm);
        assert_eq!(
            lvm.settings["lvm_config"].as_str(),
            Some("devices/ignore_suspended_devices=1 log/verbose=0")
        );
    }

    #[test]
    fn a_node_with_two_initiator_names_is_refused_and_one_name_and_rbd_are_not() {
        let t = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        super::node_tokens_agree(&t(&["iqn.2026-11.a:n1", "rbd"])).unwrap();
        super::node_tokens_agree(&t(&[])).unwrap();
        let e = super::node_tokens_agree(&t(&["iqn.2026-11.a:n1", "rbd", "iqn.2026-11.b:n1"]))
            .unwrap_err();
        assert_eq!(e.kind, crate::error::Kind::InvalidArgument);
        assert!(
            e.message
                .contains("iscsi backends give different node id tokens"),
            "{}",
            e.message
        );
    }
}
