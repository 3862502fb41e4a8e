//! Publish targets and devices on the host's filesystem: the real side of
//! the `Host` seam's target calls (node paths are validated before, in
//! `node::paths`).

use crate::error::{Error, Result};
use std::path::Path;

/// The staging path must be an existing directory (the CO creates it), and
/// not a symlink.
pub fn require_dir(path: &Path, field: &str) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => Ok(()),
        Ok(md) if md.file_type().is_symlink() => Err(Error::invalid(format!(
            "{field} {} is a symlink",
            path.display()
        ))),
        Ok(_) => Err(Error::invalid(format!(
            "{field} {} is not a directory",
            path.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::invalid(format!(
            "{field} {} does not exist",
            path.display()
        ))),
        Err(e) => Err(Error::io(format!("{field} {}", path.display()), e)),
    }
}

/// Creates the publish target: a directory for mount access, an empty file
/// for block access. Its parent must be a directory (not a symlink); a
/// symlink at the target is refused so a bind can never be redirected
/// elsewhere. Whether it was made now: a target made now held nothing and
/// had nothing mounted on it. The usual case costs one stat and the
/// create; only a target that exists already is looked at.
pub fn make_target(target: &Path, block: bool) -> Result<bool> {
    let parent = target
        .parent()
        .ok_or_else(|| Error::invalid("target_path has no parent"))?;
    match std::fs::symlink_metadata(parent) {
        Ok(md) if md.is_dir() => {}
        _ => {
            return Err(Error::invalid(format!(
                "the parent of target_path {} is not a directory",
                target.display()
            )))
        }
    }
    let made = if block {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(target)
            .map(|_| ())
    } else {
        std::fs::create_dir(target)
    };
    match made {
        Ok(()) => return Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(format!("create target {}", target.display()), e)),
    }
    match std::fs::symlink_metadata(target) {
        Ok(md) if md.file_type().is_symlink() => Err(Error::invalid(format!(
            "target_path {} is a symlink",
            target.display()
        ))),
        Ok(md) if block && md.is_file() => Ok(false),
        Ok(md) if !block && md.is_dir() => Ok(false),
        Ok(_) => Err(Error::invalid(format!(
            "target_path {} exists and is not a {}",
            target.display(),
            if block { "regular file" } else { "directory" }
        ))),
        Err(e) => Err(Error::io(format!("target {}", target.display()), e)),
    }
}

/// Removes what [`make_target`] created: an empty directory or a file
/// (never following a symlink: one at the target is removed itself). A
/// directory that is not empty is left in place (it holds someone's data).
pub fn remove_target(target: &Path) -> Result<()> {
    let removed = match std::fs::remove_dir(target) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => std::fs::remove_file(target),
        other => other,
    };
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) => {
            tracing::warn!(target = %target.display(), "target directory not empty after unmount; left in place");
            Ok(())
        }
        Err(e) => Err(Error::io(format!("remove target {}", target.display()), e)),
    }
}

/// Removes `path` only if it is an empty directory (not a symlink to one):
/// anything else, or nothing, is left as it is. Whether it removed
/// something.
pub fn remove_empty_dir(path: &Path) -> Result<bool> {
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(true),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::ENOTDIR | libc::ENOTEMPTY | libc::EEXIST)
            ) =>
        {
            Ok(false)
        }
        Err(e) => Err(Error::io(format!("remove {}", path.display()), e)),
    }
}

/// Whether `path` holds nothing: missing, an empty directory, or an empty
/// file (a symlink counts as empty here: it is refused as such where paths
/// are checked).
pub fn is_empty(path: &Path) -> Result<bool> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(Error::io(format!("inspect {}", path.display()), e)),
        Ok(md) if md.file_type().is_symlink() => Ok(true),
        Ok(md) if md.is_dir() => Ok(std::fs::read_dir(path)
            .map_err(|e| Error::io(format!("read {}", path.display()), e))?
            .next()
            .is_none()),
        Ok(md) => Ok(md.is_file() && md.len() == 0),
    }
}

/// The size of a block device (or file) in bytes.
pub fn device_size(path: &Path) -> Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut f =
        std::fs::File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    f.seek(SeekFrom::End(0))
        .map_err(|e| Error::io(format!("size of {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_created_and_removed_without_following_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t");
        make_target(&t, false).unwrap();
        assert!(t.is_dir());
        make_target(&t, false).unwrap();
        assert!(make_target(&t, true).is_err());
        remove_target(&t).unwrap();
        assert!(!t.exists());

        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        assert!(make_target(&link, false)
            .unwrap_err()
            .message
            .contains("symlink"));
        assert!(require_dir(&link, "staging")
            .unwrap_err()
            .message
            .contains("symlink"));
        assert!(make_target(&dir.path().join("missing/t"), false).is_err());

        let f = dir.path().join("blk");
        make_target(&f, true).unwrap();
        assert!(f.is_file());
        remove_target(&f).unwrap();
        assert!(!f.exists());
    }

    #[test]
    fn non_empty_target_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t");
        std::fs::create_dir(&t).unwrap();
        std::fs::write(t.join("data"), b"keep").unwrap();
        remove_target(&t).unwrap();
        assert!(t.join("data").exists());
    }
}
