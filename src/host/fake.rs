//! A host for unit tests, wholly in memory: a small tree of directories,
//! files and symlinks that the test lays out (and the code under test
//! changes through the seam), with usage figures, device sizes, device
//! links and writability set by the test. Nothing on the machine's
//! filesystem is read or written.

use super::{FsUsage, Host};
use crate::error::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What is at a path of the fake tree.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Dir,
    File { len: u64 },
    Link { to: PathBuf },
}

#[derive(Default)]
pub struct FakeHost {
    tree: Mutex<BTreeMap<PathBuf, Entry>>,
    usage: Mutex<HashMap<PathBuf, FsUsage>>,
    sizes: Mutex<HashMap<PathBuf, u64>>,
    read_only: Mutex<Vec<PathBuf>>,
    /// Device links: what `canonical` resolves a path to.
    links: Mutex<HashMap<PathBuf, PathBuf>>,
    /// What a device holds from a byte offset (`read_at`).
    contents: Mutex<HashMap<PathBuf, (u64, Vec<u8>)>>,
}

fn missing(path: &Path) -> Error {
    Error::io(
        path.display(),
        std::io::Error::from(std::io::ErrorKind::NotFound),
    )
}

impl FakeHost {
    pub fn new() -> Self {
        let host = Self::default();
        host.add_dir(Path::new("/"));
        host
    }

    /// A directory at `path`, and every missing one above it.
    pub fn add_dir(&self, path: &Path) {
        let mut tree = self.tree.lock().unwrap();
        for p in path.ancestors() {
            tree.entry(p.to_path_buf()).or_insert(Entry::Dir);
        }
    }

    /// `bytes` on device `path` from byte `offset`, for `read_at`.
    pub fn set_contents(&self, path: &Path, offset: u64, bytes: Vec<u8>) {
        self.contents
            .lock()
            .unwrap()
            .insert(path.to_path_buf(), (offset, bytes));
    }

    /// A file of `len` bytes at `path` (its folder made as needed).
    pub fn add_file(&self, path: &Path, len: u64) {
        if let Some(parent) = path.parent() {
            self.add_dir(parent);
        }
        self.tree
            .lock()
            .unwrap()
            .insert(path.to_path_buf(), Entry::File { len });
    }

    /// A symlink at `path` to `to` (its folder made as needed).
    pub fn add_symlink(&self, path: &Path, to: &Path) {
        if let Some(parent) = path.parent() {
            self.add_dir(parent);
        }
        self.tree.lock().unwrap().insert(
            path.to_path_buf(),
            Entry::Link {
                to: to.to_path_buf(),
            },
        );
    }

    /// Whether anything is at `path` in the fake tree.
    pub fn contains(&self, path: &Path) -> bool {
        self.tree.lock().unwrap().contains_key(path)
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

    fn entry(&self, path: &Path) -> Option<Entry> {
        self.tree.lock().unwrap().get(path).cloned()
    }

    /// Whether the directory at `path` holds anything.
    fn has_children(&self, path: &Path) -> bool {
        let tree = self.tree.lock().unwrap();
        tree.range(path.to_path_buf()..)
            .skip(1)
            .take_while(|(p, _)| p.starts_with(path))
            .next()
            .is_some()
    }
}

impl Host for FakeHost {
    fn fs_usage(&self, path: &Path) -> Result<FsUsage> {
        let usage = self.usage.lock().unwrap();
        path.ancestors()
            .find_map(|p| usage.get(p).copied())
            .ok_or_else(|| Error::internal(format!("no usage set for {}", path.display())))
    }

    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
        let contents = self.contents.lock().unwrap();
        let (at, bytes) = contents.get(path).ok_or_else(|| missing(path))?;
        let from = offset.checked_sub(*at).ok_or_else(|| missing(path))? as usize;
        bytes
            .get(from..from + len)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| missing(path))
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
        match self.entry(dir) {
            Some(Entry::Dir) => {}
            Some(_) => {
                return Err(Error::precondition(format!(
                    "{} is not a directory",
                    dir.display()
                )))
            }
            None => return Err(missing(dir)),
        }
        let read_only = self.read_only.lock().unwrap();
        if read_only.iter().any(|p| dir.starts_with(p)) {
            return Err(Error::precondition(format!(
                "{} is not writable",
                dir.display()
            )));
        }
        Ok(())
    }

    fn require_dir(&self, path: &Path, field: &str) -> Result<()> {
        match self.entry(path) {
            Some(Entry::Dir) => Ok(()),
            Some(Entry::Link { .. }) => Err(Error::invalid(format!(
                "{field} {} is a symlink",
                path.display()
            ))),
            Some(Entry::File { .. }) => Err(Error::invalid(format!(
                "{field} {} is not a directory",
                path.display()
            ))),
            None => Err(Error::invalid(format!(
                "{field} {} does not exist",
                path.display()
            ))),
        }
    }

    fn make_target(&self, path: &Path, block: bool) -> Result<bool> {
        let parent = path
            .parent()
            .ok_or_else(|| Error::invalid("target_path has no parent"))?;
        if self.entry(parent) != Some(Entry::Dir) {
            return Err(Error::invalid(format!(
                "the parent of target_path {} is not a directory",
                path.display()
            )));
        }
        match self.entry(path) {
            None => {
                let made = match block {
                    true => Entry::File { len: 0 },
                    false => Entry::Dir,
                };
                self.tree.lock().unwrap().insert(path.to_path_buf(), made);
                Ok(true)
            }
            Some(Entry::Link { .. }) => Err(Error::invalid(format!(
                "target_path {} is a symlink",
                path.display()
            ))),
            Some(Entry::File { .. }) if block => Ok(false),
            Some(Entry::Dir) if !block => Ok(false),
            Some(_) => Err(Error::invalid(format!(
                "target_path {} exists and is not a {}",
                path.display(),
                if block { "regular file" } else { "directory" }
            ))),
        }
    }

    fn remove_target(&self, path: &Path) -> Result<()> {
        if self.entry(path) == Some(Entry::Dir) && self.has_children(path) {
            return Ok(()); // someone's data: left in place
        }
        self.tree.lock().unwrap().remove(path);
        Ok(())
    }

    fn remove_empty_dir(&self, path: &Path) -> Result<bool> {
        if self.entry(path) != Some(Entry::Dir) || self.has_children(path) {
            return Ok(false);
        }
        self.tree.lock().unwrap().remove(path);
        Ok(true)
    }

    fn exists(&self, path: &Path) -> bool {
        self.contains(path)
    }

    fn is_empty(&self, path: &Path) -> Result<bool> {
        Ok(match self.entry(path) {
            None | Some(Entry::Link { .. }) => true,
            Some(Entry::Dir) => !self.has_children(path),
            Some(Entry::File { len }) => len == 0,
        })
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

    fn resolve(&self, path: &Path) -> Result<PathBuf> {
        // Symlinks on the way are followed (one level each, as the tests
        // lay them out); the last part is kept as it is.
        let mut out = PathBuf::new();
        let parts: Vec<_> = path.components().collect();
        for (i, part) in parts.iter().enumerate() {
            out.push(part);
            if i + 1 < parts.len() {
                if let Some(Entry::Link { to }) = self.entry(&out) {
                    out = to;
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fake_tree_answers_as_a_filesystem_would() {
        let h = FakeHost::new();
        h.add_dir(Path::new("/k/pods"));
        h.add_file(Path::new("/k/pods/full"), 3);
        h.add_symlink(Path::new("/k/link"), Path::new("/elsewhere"));
        assert!(h.make_target(Path::new("/k/pods/t"), false).unwrap());
        assert!(!h.make_target(Path::new("/k/pods/t"), false).unwrap());
        assert!(h.make_target(Path::new("/k/pods/t"), true).is_err());
        assert!(h.make_target(Path::new("/k/link"), false).is_err());
        assert!(h.make_target(Path::new("/nowhere/t"), false).is_err());
        assert!(h.is_empty(Path::new("/k/pods/t")).unwrap());
        assert!(!h.is_empty(Path::new("/k/pods/full")).unwrap());
        assert!(!h.is_empty(Path::new("/k/pods")).unwrap());
        // A directory that holds something stays.
        h.remove_target(Path::new("/k/pods")).unwrap();
        assert!(h.contains(Path::new("/k/pods")));
        assert!(!h.remove_empty_dir(Path::new("/k/pods")).unwrap());
        h.remove_target(Path::new("/k/pods/t")).unwrap();
        assert!(!h.exists(Path::new("/k/pods/t")));
        assert!(h.require_dir(Path::new("/k/link"), "f").is_err());
        assert!(h.require_dir(Path::new("/k"), "f").is_ok());
        assert_eq!(
            h.resolve(Path::new("/k/link/x")).unwrap(),
            PathBuf::from("/elsewhere/x")
        );
        h.set_read_only(Path::new("/k"));
        assert!(h.writable_dir(Path::new("/k/pods")).is_err());
        assert!(h.writable_dir(Path::new("/")).is_ok());
        // Nothing of it is on the machine.
        assert!(!Path::new("/k/pods").exists());
    }
}
