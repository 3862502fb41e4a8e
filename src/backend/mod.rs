//! Backends: one module per kind of storage, each a [`crate::plugin::Backend`].

pub mod file;
pub mod lvm;
pub mod nfs;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::exec::CommandRunner;
use crate::host::Host;
use crate::plugin::Registry;
use std::sync::Arc;

/// Builds the registry from the config: each `[[backend]]` by its type.
pub fn build_registry(
    config: &Config,
    runner: Arc<dyn CommandRunner>,
    host: Arc<dyn Host>,
    state_dir: &std::path::Path,
) -> Result<Registry> {
    let mut registry = Registry::new();
    for bc in &config.backends {
        let backend: Arc<dyn crate::plugin::Backend> = match bc.kind.as_str() {
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
                state_dir.join("nfs").join(bc.name()),
            )?),
            other => {
                return Err(Error::invalid(format!(
                    "backend {:?}: unknown type {other:?} (available: file, lvm, nfs)",
                    bc.name()
                )))
            }
        };
        registry
            .register(backend)
            .map_err(|e| e.context("config"))?;
    }
    if let Some(name) = &config.default_backend {
        registry.set_default(name)?;
    }
    Ok(registry)
}
