//! Removing a directory tree in the process, as `rm -rf --one-file-system`
//! does, without a process: every directory is opened relative to its
//! parent's descriptor with `O_NOFOLLOW`, so a symlink anywhere in the tree
//! (or swapped in while it is being removed) is removed as a link, never
//! followed; a directory on another filesystem (something mounted inside)
//! is left alone and the removal fails, naming it.

use crate::error::{Error, Result};
use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};
use std::ffi::{OsStr, OsString};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// How many times a directory is listed again when entries keep appearing
/// in it while it is being removed.
const RELISTS: u32 = 3;

/// One directory being emptied.
struct Level {
    dir: Dir,
    /// Its name in its parent.
    name: OsString,
    /// Subdirectories still to empty and remove.
    pending: Vec<OsString>,
    /// Not listed yet (or to be listed again).
    fresh: bool,
    /// Times it was listed again because entries appeared.
    relisted: u32,
}

impl Level {
    fn new(dir: Dir, name: OsString, relisted: u32) -> Self {
        Level {
            dir,
            name,
            pending: Vec::new(),
            fresh: true,
            relisted,
        }
    }
}

fn open_dir<Fd: AsFd>(parent: Fd, name: &OsStr) -> nix::Result<Dir> {
    Dir::openat(
        parent,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
}

fn is_dir(mode: u32) -> bool {
    SFlag::from_bits_truncate(mode) & SFlag::S_IFMT == SFlag::S_IFDIR
}

/// Removes `path` and everything under it, staying on `path`'s filesystem.
/// A path that does not exist is removed already; a symlink at `path` is
/// removed itself.
pub fn remove_tree(path: &Path) -> Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(Error::internal(format!(
            "refusing to remove {}",
            path.display()
        )));
    };
    let mut walk = Walk { path, device: 0 };
    let parent = Dir::open(
        parent,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| walk.err("open the parent of".into(), e))?;
    let top = match fstatat(parent.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(walk.err("inspect".into(), e)),
    };
    if !is_dir(top.st_mode) {
        return match unlinkat(parent.as_fd(), name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(walk.err("remove".into(), e)),
        };
    }
    walk.device = top.st_dev;
    let mut stack = vec![Level::new(
        open_dir(parent.as_fd(), name).map_err(|e| walk.err("open".into(), e))?,
        name.to_os_string(),
        0,
    )];
    while let Some(level) = stack.last_mut() {
        // First visit (or entries appeared since): remove what is not a
        // directory, note the subdirectories.
        if level.fresh {
            walk.list(level)?;
        }
        if let Some(sub) = level.pending.pop() {
            if let Some(dir) = walk.open_pending(level, &sub)? {
                stack.push(Level::new(dir, sub, 0));
            }
            continue;
        }
        // Emptied: remove it from its parent.
        let done = stack.pop().expect("a level");
        let up = match stack.last() {
            Some(up) => up.dir.as_fd(),
            None => parent.as_fd(),
        };
        if let Some(again) = walk.remove_emptied(up, done)? {
            stack.push(again);
        }
    }
    Ok(())
}

/// A removal under way: the tree's top and its filesystem.
struct Walk<'a> {
    path: &'a Path,
    device: u64,
}

impl Walk<'_> {
    fn err(&self, what: String, e: Errno) -> Error {
        Error::io(format!("{what} {}", self.path.display()), e.into())
    }

    fn mounted(&self, at: &OsStr) -> Error {
        Error::precondition(format!(
            "{} has another filesystem mounted at {at:?} inside it: not removed",
            self.path.display()
        ))
    }

    /// Lists a level: removes what is not a directory, notes the
    /// subdirectories (refusing one on another filesystem).
    fn list(&self, level: &mut Level) -> Result<()> {
        level.fresh = false;
        let names: Vec<OsString> = level
            .dir
            .iter()
            .filter_map(|e| e.ok())
            .map(|e| OsStr::from_bytes(e.file_name().to_bytes()).to_os_string())
            .filter(|n| n != "." && n != "..")
            .collect();
        for entry in names {
            let st = match fstatat(
                level.dir.as_fd(),
                entry.as_os_str(),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            ) {
                Ok(st) => st,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(self.err(format!("inspect {entry:?} under"), e)),
            };
            if is_dir(st.st_mode) {
                if st.st_dev != self.device {
                    return Err(self.mounted(&entry));
                }
                level.pending.push(entry);
                continue;
            }
            match unlinkat(
                level.dir.as_fd(),
                entry.as_os_str(),
                UnlinkatFlags::NoRemoveDir,
            ) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(e) => return Err(self.err(format!("remove {entry:?} under"), e)),
            }
        }
        Ok(())
    }

    /// Opens a subdirectory noted at `level`, checked to be on the tree's
    /// filesystem. None when it is gone, or was replaced by something
    /// that is not a directory (removed here; the level is listed again
    /// when it is emptied).
    fn open_pending(&self, level: &Level, sub: &OsStr) -> Result<Option<Dir>> {
        let dir = match open_dir(level.dir.as_fd(), sub) {
            Ok(d) => d,
            Err(Errno::ENOENT) => return Ok(None),
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                return match unlinkat(level.dir.as_fd(), sub, UnlinkatFlags::NoRemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => Ok(None),
                    Err(e) => Err(self.err(format!("remove {sub:?} under"), e)),
                }
            }
            Err(e) => return Err(self.err(format!("open {sub:?} under"), e)),
        };
        // What was opened is what gets emptied: check its filesystem.
        let st = fstat(dir.as_fd()).map_err(|e| self.err("inspect".into(), e))?;
        if st.st_dev != self.device {
            return Err(self.mounted(sub));
        }
        Ok(Some(dir))
    }

    /// Removes an emptied level from the directory above it. Something
    /// added meanwhile: the level again, to list once more (a few times).
    fn remove_emptied(&self, up: std::os::fd::BorrowedFd, done: Level) -> Result<Option<Level>> {
        let (name, relisted) = (done.name, done.relisted);
        drop(done.dir);
        match unlinkat(up, name.as_os_str(), UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(None),
            Err(Errno::ENOTEMPTY) if relisted < RELISTS => {
                let dir =
                    open_dir(up, &name).map_err(|e| self.err(format!("open {name:?} under"), e))?;
                Ok(Some(Level::new(dir, name, relisted + 1)))
            }
            Err(e) => Err(self.err(format!("remove {name:?} under"), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A tree with files, empty and full subdirectories, a deep chain, a
    /// FIFO and links pointing out of it: all of it goes, and nothing a
    /// link points to.
    #[test]
    fn removes_a_tree_and_never_follows_a_link() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir_all(outside.join("keep")).unwrap();
        std::fs::write(outside.join("keep/file"), b"x").unwrap();
        let top = d.path().join("vol");
        std::fs::create_dir_all(top.join("a/b/c")).unwrap();
        std::fs::create_dir_all(top.join("empty")).unwrap();
        std::fs::write(top.join("a/b/c/f"), b"1").unwrap();
        std::fs::write(top.join("a/f"), b"2").unwrap();
        symlink(&outside, top.join("a/link-to-dir")).unwrap();
        symlink(outside.join("keep/file"), top.join("link-to-file")).unwrap();
        nix::unistd::mkfifo(&top.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        let mut deep = top.join("deep");
        for i in 0..300 {
            deep = deep.join(format!("{i}"));
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("bottom"), b"3").unwrap();
        for i in 0..200 {
            std::fs::create_dir(top.join(format!("wide-{i}"))).unwrap();
            std::fs::write(top.join(format!("wide-{i}/f")), b"4").unwrap();
        }
        remove_tree(&top).unwrap();
        assert!(!top.exists());
        assert_eq!(std::fs::read(outside.join("keep/file")).unwrap(), b"x");
        // Gone already: done.
        remove_tree(&top).unwrap();
    }

    /// A link where the tree should be is removed, not what it points at.
    #[test]
    fn a_link_at_the_top_is_removed_itself() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("target");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("f"), b"x").unwrap();
        let link = d.path().join("vol");
        symlink(&target, &link).unwrap();
        remove_tree(&link).unwrap();
        assert!(link.symlink_metadata().is_err());
        assert_eq!(std::fs::read(target.join("f")).unwrap(), b"x");
    }

    /// Something mounted inside the tree (another filesystem) is not
    /// touched, and the removal fails naming it. Needs root (CI is).
    #[test]
    fn a_filesystem_mounted_inside_is_left_alone() {
        assert!(nix::unistd::geteuid().is_root(), "needs root");
        let d = tempfile::tempdir().unwrap();
        let top = d.path().join("vol");
        let inner = top.join("sub/mnt");
        std::fs::create_dir_all(&inner).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &inner,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
        std::fs::write(inner.join("theirs"), b"x").unwrap();
        let e = remove_tree(&top).unwrap_err();
        let kept = std::fs::read(inner.join("theirs"));
        nix::mount::umount(&inner).unwrap();
        assert_eq!(
            e.kind,
            crate::error::Kind::FailedPrecondition,
            "{}",
            e.message
        );
        assert!(e.message.contains("mnt"), "{}", e.message);
        assert_eq!(kept.unwrap(), b"x");
        remove_tree(&top).unwrap();
        assert!(!top.exists());
    }
}
