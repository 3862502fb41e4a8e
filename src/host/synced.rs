//! Asking the server, not the cache: a statx with AT_STATX_FORCE_SYNC makes
//! a network filesystem's client revalidate what it holds (an NFS client
//! otherwise answers from its attribute and name caches for up to a
//! minute, and a directory removed on the server still "exists" here).

use crate::error::{Error, Result};
use std::path::Path;

mod sys {
    use std::ffi::CStr;

    /// statx(2) of `path` (not following a last symlink), synced with the
    /// server; `Err` is the OS error.
    #[allow(unsafe_code)] // statx(2) through libc: nix has no wrapper for it
    pub fn statx_synced(path: &CStr) -> std::io::Result<()> {
        let mut buf = std::mem::MaybeUninit::<libc::statx>::zeroed();
        // SAFETY: `path` is NUL-terminated and `buf` is a writable statx
        // buffer that outlives the call; the buffer is not read after.
        let rc = unsafe {
            libc::statx(
                libc::AT_FDCWD,
                path.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW | libc::AT_STATX_FORCE_SYNC,
                // Attributes that need revalidating: asked for the type
                // alone, an NFS client answers from its cache, sync or not.
                libc::STATX_BASIC_STATS,
                buf.as_mut_ptr(),
            )
        };
        match rc {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    }
}

/// Whether `path` exists as its server says now. Its parent is synced
/// first, so that a name the server made or removed since is looked up
/// again rather than answered from the client's cache of the directory. A
/// missing path is `false`; any other failure (ESTALE among them) is
/// returned, with its errno.
pub fn exists_on_server(path: &Path) -> Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let cstr = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| Error::invalid("path contains NUL"))
    };
    if let Some(parent) = path.parent() {
        // Its own failure shows again below, on the path itself.
        let _ = sys::statx_synced(&cstr(parent)?);
    }
    match sys::statx_synced(&cstr(path)?) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("statx {}", path.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_exists_or_not_and_other_errors_keep_their_errno() {
        let dir = tempfile::tempdir().unwrap();
        assert!(exists_on_server(dir.path()).unwrap());
        assert!(!exists_on_server(&dir.path().join("gone")).unwrap());
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = exists_on_server(&file.join("below")).unwrap_err();
        assert_eq!(e.os_error, Some(libc::ENOTDIR), "{e}");
    }
}
