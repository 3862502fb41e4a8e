//! An in-memory mounter for unit tests, with error injection.

use super::{MountId, MountInfo, MountOptions, Mounter};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};

/// An operation the fake can be told to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountOp {
    MountFs,
    Bind,
    Unmount,
}

/// A mount held by the fake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeMount {
    pub source: PathBuf,
    pub fstype: String,
    pub readonly: bool,
    pub bind: bool,
    pub options: MountOptions,
    pub id: MountId,
}

/// A stable fake device number for a source path.
fn fake_dev(source: &Path) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut h);
    h.finish() | 1
}

/// The fake devtmpfs that device nodes live on.
const DEVTMPFS: u64 = 6;

/// Keeps a mount table in memory. Mount points must exist on disk (tests use
/// temporary directories) so path checks behave as on a real node.
#[derive(Default)]
pub struct FakeMounter {
    table: Mutex<BTreeMap<PathBuf, Vec<FakeMount>>>,
    failures: Mutex<Vec<(MountOp, usize)>>,
    calls: Mutex<Vec<(MountOp, PathBuf)>>,
    /// Targets under this prefix hang in mount_fs (as a mount of a dead
    /// server does in the kernel) until [`FakeMounter::release_hung`].
    hang: Mutex<Option<PathBuf>>,
    hung: Condvar,
    /// Paths whose filesystem answers ESTALE.
    stale: Mutex<Vec<PathBuf>>,
    /// Device paths gone from /dev (a removed LV, a deleted LUN).
    gone: Mutex<Vec<PathBuf>>,
    /// The fake filesystem mount points must exist in, if the test has
    /// one (a mount onto nothing fails, as the kernel's does).
    host: Option<std::sync::Arc<dyn crate::host::Host>>,
}

impl FakeMounter {
    pub fn new() -> Self {
        Self::default()
    }

    /// A fake mount table over the fake filesystem `host`: mount points
    /// must exist there.
    pub fn on(host: std::sync::Arc<dyn crate::host::Host>) -> Self {
        Self {
            host: Some(host),
            ..Self::default()
        }
    }

    /// Makes the next `times` calls of `op` fail with EIO.
    pub fn fail_next(&self, op: MountOp, times: usize) {
        self.failures.lock().unwrap().push((op, times));
    }

    /// Makes every mount_fs on a target under `prefix` block its thread
    /// until [`FakeMounter::release_hung`] (then it fails with EIO).
    pub fn hang_mounts_under(&self, prefix: &Path) {
        *self.hang.lock().unwrap() = Some(prefix.to_path_buf());
    }

    /// Puts a foreign mount (someone else's tmpfs) at `target`.
    pub fn mount_foreign(&self, target: &Path) {
        self.push(
            target,
            FakeMount {
                source: "tmpfs".into(),
                fstype: "tmpfs".into(),
                readonly: false,
                bind: false,
                options: MountOptions::default(),
                id: MountId { dev: 99, rdev: 0 },
            },
        );
    }

    /// Makes `path` answer ESTALE, as a remote mount whose directory was
    /// replaced on the server does.
    pub fn set_stale(&self, path: &Path) {
        self.stale.lock().unwrap().push(path.to_path_buf());
    }

    /// Makes the device node `path` gone, as /dev loses an LV's node
    /// when its device is removed.
    pub fn set_gone(&self, path: &Path) {
        self.gone.lock().unwrap().push(path.to_path_buf());
    }

    /// Brings every device gone by [`FakeMounter::set_gone`] back.
    pub fn clear_gone(&self) {
        self.gone.lock().unwrap().clear();
    }

    /// Lets every hung mount_fs return.
    pub fn release_hung(&self) {
        *self.hang.lock().unwrap() = None;
        self.hung.notify_all();
    }

    fn wait_if_hung(&self, target: &Path) -> Result<()> {
        let mut hang = self.hang.lock().unwrap();
        if !hang.as_ref().is_some_and(|p| target.starts_with(p)) {
            return Ok(());
        }
        while hang.is_some() {
            hang = self.hung.wait(hang).unwrap();
        }
        Err(Error::io(
            format!("mount on {}", target.display()),
            std::io::Error::from_raw_os_error(libc::EIO),
        ))
    }

    /// The mount on top at `target`, if any.
    pub fn get(&self, target: &Path) -> Option<FakeMount> {
        self.table
            .lock()
            .unwrap()
            .get(target)
            .and_then(|v| v.last().cloned())
    }

    /// How many mounts the fake holds.
    pub fn count(&self) -> usize {
        self.table.lock().unwrap().values().map(Vec::len).sum()
    }

    pub fn calls(&self) -> Vec<(MountOp, PathBuf)> {
        self.calls.lock().unwrap().clone()
    }

    fn check(&self, op: MountOp, target: &Path) -> Result<()> {
        self.calls.lock().unwrap().push((op, target.to_path_buf()));
        let mut failures = self.failures.lock().unwrap();
        if let Some(entry) = failures.iter_mut().find(|(o, n)| *o == op && *n > 0) {
            entry.1 -= 1;
            return Err(Error::io(
                format!("{op:?} {}", target.display()),
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        let exists = |p: &Path| self.host.as_ref().is_none_or(|h| h.exists(p));
        if op != MountOp::Unmount && !exists(target) {
            return Err(Error::io(
                format!("{op:?} {}", target.display()),
                std::io::ErrorKind::NotFound.into(),
            ));
        }
        Ok(())
    }

    fn push(&self, target: &Path, mount: FakeMount) {
        self.table
            .lock()
            .unwrap()
            .entry(target.to_path_buf())
            .or_default()
            .push(mount);
    }
}

impl Mounter for FakeMounter {
    fn mount_fs(
        &self,
        device: &Path,
        target: &Path,
        fstype: &str,
        options: &MountOptions,
    ) -> Result<()> {
        self.check(MountOp::MountFs, target)?;
        self.wait_if_hung(target)?;
        self.push(
            target,
            FakeMount {
                source: device.into(),
                fstype: fstype.into(),
                readonly: options.readonly,
                bind: false,
                options: options.clone(),
                id: MountId {
                    dev: fake_dev(device),
                    rdev: 0,
                },
            },
        );
        Ok(())
    }

    fn bind(
        &self,
        source: &Path,
        target: &Path,
        readonly: bool,
        options: &MountOptions,
    ) -> Result<()> {
        self.check(MountOp::Bind, target)?;
        // A bind of a mount shows that mount's filesystem; a bind of a
        // device node shows devtmpfs, and the node's device as rdev.
        let (fstype, id) = match self.get(source) {
            Some(m) => (m.fstype, m.id),
            None => (
                "devtmpfs".to_string(),
                MountId {
                    dev: DEVTMPFS,
                    rdev: fake_dev(source),
                },
            ),
        };
        self.push(
            target,
            FakeMount {
                source: source.into(),
                fstype,
                readonly,
                bind: true,
                options: options.clone(),
                id,
            },
        );
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<bool> {
        self.check(MountOp::Unmount, target)?;
        let mut table = self.table.lock().unwrap();
        let Some(stack) = table.get_mut(target) else {
            return Ok(false);
        };
        stack.pop();
        if stack.is_empty() {
            table.remove(target);
        }
        Ok(true)
    }

    fn node_id(&self, path: &Path) -> Result<MountId> {
        if self.gone.lock().unwrap().iter().any(|p| p == path) {
            return Err(Error::io(
                format!("stat {}", path.display()),
                std::io::Error::from_raw_os_error(libc::ENOENT),
            ));
        }
        Ok(match self.get(path) {
            Some(m) => m.id,
            None => MountId {
                dev: DEVTMPFS,
                rdev: fake_dev(path),
            },
        })
    }

    fn mounted(&self, path: &Path) -> Result<Option<MountId>> {
        if self.stale.lock().unwrap().iter().any(|p| p == path) {
            return Err(Error::io(
                format!("statx {}", path.display()),
                std::io::Error::from_raw_os_error(libc::ESTALE),
            ));
        }
        Ok(self
            .table
            .lock()
            .unwrap()
            .get(path)
            .and_then(|stack| stack.last())
            .map(|m| m.id))
    }

    fn mounts(&self) -> Result<Vec<MountInfo>> {
        let table = self.table.lock().unwrap();
        let mut out = Vec::new();
        for (i, (target, stack)) in table.iter().enumerate() {
            for m in stack {
                out.push(MountInfo {
                    id: 100 + i as u32,
                    parent: 1,
                    dev: "0:0".into(),
                    root: "/".into(),
                    mount_point: target.clone(),
                    options: vec![if m.readonly { "ro".into() } else { "rw".into() }],
                    fstype: m.fstype.clone(),
                    source: m.source.display().to_string(),
                    super_options: vec![],
                });
            }
        }
        Ok(out)
    }
}
