//! A host for unit tests: usage figures, device sizes and writability are
//! set by the test; paths are real (tests work in temporary directories, no
//! root needed).

use super::{FsUsage, Host, SystemHost};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[derive(Default)]
pub struct FakeHost {
    usage: Mutex<HashMap<PathBuf, FsUsage>>,
    sizes: Mutex<HashMap<PathBuf, u64>>,
    read_only: Mutex<Vec<PathBuf>>,
    /// Device links: what `canonical` resolves a path to.
    links: Mutex<HashMap<PathBuf, PathBuf>>,
}

impl FakeHost {
    pub fn new() -> Self {
        Self::default()
    }

    /// What fs_usage reports for `path` and everything below it.
    pub fn set_usage(&self, path: &Path, usage: FsUsage) {
        self.usage.lock().unwrap().insert(path.to_path_buf(), usage);
    }

    /// What device_size reports for `path`.
    pub fn set_device_size(&self, path: &Path, bytes: u64) {
        self.sizes.lock().unwrap().insert(path.to_path_buf(), bytes);
    }

    /// Makes `canonical(from)` answer `to` (a device link); a path with
    /// no link set is its own canonical form.
    pub fn set_link(&self, from: &Path, to: &Path) {
        self.links
            .lock()
            .unwrap()
            .insert(from.to_path_buf(), to.to_path_buf());
    }

    /// Makes `dir` not writable.
    pub fn set_read_only(&self, dir: &Path) {
        self.read_only.lock().unwrap().push(dir.to_path_buf());
    }
}

impl Host for FakeHost {
    fn fs_usage(&self, path: &Path) -> Result<FsUsage> {
        let usage = self.usage.lock().unwrap();
        path.ancestors()
            .find_map(|p| usage.get(p).copied())
            .ok_or_else(|| Error::internal(format!("no usage set for {}", path.display())))
    }

    fn device_size(&self, path: &Path) -> Result<u64> {
        self.sizes
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .ok_or_else(|| Error::not_found(format!("no device {}", path.display())))
    }

    fn writable_dir(&self, dir: &Path) -> Result<()> {
        if self
            .read_only
            .lock()
            .unwrap()
            .iter()
            .any(|p| dir.starts_with(p))
        {
            return Err(Error::precondition(format!(
                "{} is not writable",
                dir.display()
            )));
        }
        SystemHost.writable_dir(dir)
    }

    fn require_dir(&self, path: &Path, field: &str) -> Result<()> {
        SystemHost.require_dir(path, field)
    }

    fn make_target(&self, path: &Path, block: bool) -> Result<bool> {
        SystemHost.make_target(path, block)
    }

    fn remove_target(&self, path: &Path) -> Result<()> {
        SystemHost.remove_target(path)
    }

    fn exists(&self, path: &Path) -> bool {
        SystemHost.exists(path)
    }

    fn canonical(&self, path: &Path) -> Result<PathBuf> {
        Ok(self
            .links
            .lock()
            .unwrap()
            .get(path)
            .cloned()
            .unwrap_or_else(|| path.to_path_buf()))
    }
}
