//! Backends: one module per kind of storage, each a [`crate::plugin::Backend`].

pub mod file;
pub mod iscsi;
pub mod lvm;
pub mod nfs;
pub mod rbd;

use crate::config::{BackendConfig, Config};
use crate::error::{Error, Result};
use crate::exec::CommandRunner;
use crate::host::Host;
use crate::mount::Mounter;
use crate::plugin::Registry;
use std::sync::Arc;

/// The StorageClass parameters each kind of backend takes (besides
/// `backend`, `encrypted` and the CO's `csi.storage.k8s.io/` keys), and
/// its own mutable parameters (an iscsi backend's store adds its own): the
/// lists the backends check with, which the docs' tables must match
/// (tests/docs.rs).
pub fn documented_keys() -> Vec<(&'static str, Vec<&'static str>, Vec<&'static str>)> {
    vec![
        ("file", vec![], vec![file::PREALLOCATE]),
        (
            "lvm",
            vec![lvm::DEVICE_CLASS_PARAMETER],
            vec![lvm::READ_AHEAD],
        ),
        ("nfs", nfs::PARAMETERS.to_vec(), nfs::MUTABLE.to_vec()),
        ("iscsi", vec![], vec![iscsi::THIN_PROVISIONING]),
        ("rbd", rbd::PARAMETERS.to_vec(), rbd::QOS_KEYS.to_vec()),
    ]
}

/// The keys of the CSI secrets each kind of backend reads (the passphrase
/// of encrypted volumes, [`crate::host::crypt::PASSPHRASE_KEY`], is every
/// block backend's): which the docs and the example Secrets must name
/// (tests/docs.rs).
pub fn secret_keys() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("file", vec![]),
        ("lvm", vec![]),
        ("nfs", vec![]),
        (
            "iscsi",
            vec![
                iscsi::CHAP_USER,
                iscsi::CHAP_PASSWORD,
                iscsi::MUTUAL_USER,
                iscsi::MUTUAL_PASSWORD,
            ],
        ),
        ("rbd", vec![rbd::USER_ID, rbd::USER_KEY]),
    ]
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
    for bc in &config.backends {
        let backend = build_backend(bc, &runner, &host, &mounter, state_dir)?;
        registry
            .register(backend)
            .map_err(|e| e.context("config"))?;
    }
    if let Some(name) = &config.default_backend {
        registry.set_default(name)?;
    }
    Ok(registry)
}

/// One backend from its config table.
fn build_backend(
    bc: &BackendConfig,
    runner: &Arc<dyn CommandRunner>,
    host: &Arc<dyn Host>,
    mounter: &Arc<dyn Mounter>,
    state_dir: &std::path::Path,
) -> Result<Arc<dyn crate::plugin::Backend>> {
    Ok(match bc.kind.as_str() {
        "file" => Arc::new(file::FileBackend::new(
            bc.name(),
            bc.settings()?,
            runner.clone(),
            host.clone(),
        )?),
        "lvm" => Arc::new(
            lvm::LvmBackend::new(bc.name(), bc.settings()?, runner.clone())?
                .with_host(host.clone()),
        ),
        "nfs" => Arc::new(nfs::NfsBackend::new(
            bc.name(),
            bc.settings()?,
            runner.clone(),
            host.clone(),
            mounter.clone(),
            state_dir.join("nfs").join(bc.name()),
        )?),
        "rbd" => Arc::new(rbd::RbdBackend::new(
            bc.name(),
            bc.settings()?,
            runner.clone(),
            state_dir.join("rbd").join(bc.name()),
        )?),
        "iscsi" => {
            let settings: iscsi::IscsiSettings = bc.settings()?;
            // The store is private to this backend: built here, never
            // registered, so its volumes are reachable only as LUNs.
            let store = match &settings.store {
                Some(store) if !matches!(store.kind.as_str(), "file" | "lvm") => {
                    return Err(Error::invalid(format!(
                        "backend {:?}: the store must be of type file or lvm",
                        bc.name()
                    )))
                }
                Some(store) => {
                    let mut store = store.clone();
                    store.name = Some(format!("{}-store", bc.name()));
                    if store.kind == "lvm" {
                        // LVM reads every device it scans: one of the LUNs'
                        // hold devices, suspended while a group is cut,
                        // would hold its commands until it is let go.
                        let own = store
                            .settings
                            .get("lvm_config")
                            .and_then(|v| v.as_str())
                            .unwrap_or("")
                            .to_string();
                        store.settings.insert(
                            "lvm_config".into(),
                            toml::Value::String(
                                format!("devices/ignore_suspended_devices=1 {own}")
                                    .trim()
                                    .to_string(),
                            ),
                        );
                    }
                    Some(build_backend(&store, runner, host, mounter, state_dir)?)
                }
                None => None,
            };
            Arc::new(iscsi::IscsiBackend::new(
                bc.name(),
                settings,
                runner.clone(),
                store,
                iscsi::store_dir(state_dir, bc.name()),
            )?)
        }
        other => {
            return Err(Error::invalid(format!(
                "backend {:?}: unknown type {other:?} (available: file, lvm, nfs, iscsi, rbd)",
                bc.name()
            )))
        }
    })
}
