//! Freezing mounted filesystems (FIFREEZE / FITHAW): a frozen filesystem
//! has written out everything it held and takes no new writes until it is
//! thawed, so copies taken meanwhile of the devices under several of them
//! show one instant.
//!
//! A freeze never outlives its holder: [`Frozen`] thaws what it froze when
//! dropped, at [`Frozen::thaw`], or when its deadline passes, whichever is
//! first; a deadline that passed is reported by `thaw`, so the caller
//! knows its copies may not show one instant. A FIFREEZE stuck in the
//! kernel (a device that does not answer its flush) is waited for only
//! until the deadline; if it returns later, the filesystem is thawed then.

use crate::error::{Error, Result};
use crate::sync::LockExt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[allow(unsafe_code)] // the ioctls below, on descriptors the caller owns
mod sys {
    // linux/fs.h: _IOWR('X', 119, int) and _IOWR('X', 120, int).
    nix::ioctl_readwrite_bad!(fifreeze, 0xC004_5877, libc::c_int);
    nix::ioctl_readwrite_bad!(fithaw, 0xC004_5878, libc::c_int);
}

/// Whether this kernel lets a filesystem frozen from userspace (FIFREEZE)
/// be frozen again through its block device, as a device-mapper suspend
/// does (LVM suspends an origin to snapshot it): since Linux 6.8 the
/// kernel counts freezes of the two kinds; before, the second fails EBUSY
/// (seen on 6.1; 6.12 tested to nest, thick and thin snapshots alike).
pub fn block_freeze_nests() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| release_nests(r.trim()))
        .unwrap_or(false)
}

/// `release` (`uname -r`) is Linux 6.8 or later.
fn release_nests(release: &str) -> bool {
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= (6, 8),
        _ => false,
    }
}

/// Freezes the filesystem mounted at `path`; returns the descriptor that
/// thaws it.
#[allow(unsafe_code)] // FIFREEZE on a descriptor this function opened
fn freeze_one(path: &Path) -> Result<File> {
    use std::os::fd::AsRawFd;
    let dir = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    let mut arg: libc::c_int = 0;
    // SAFETY: FIFREEZE takes an int it does not read; `dir` is open.
    unsafe { sys::fifreeze(dir.as_raw_fd(), &mut arg) }.map_err(|e| {
        Error::io(
            format!("freeze the filesystem at {}", path.display()),
            e.into(),
        )
    })?;
    Ok(dir)
}

#[allow(unsafe_code)] // FITHAW on a descriptor FIFREEZE froze through
fn thaw_one(path: &Path, dir: &File) {
    use std::os::fd::AsRawFd;
    let mut arg: libc::c_int = 0;
    // SAFETY: as above.
    if let Err(e) = unsafe { sys::fithaw(dir.as_raw_fd(), &mut arg) } {
        tracing::error!(path = %path.display(), error = %e, "could not thaw a filesystem ferrovol froze");
    }
}

/// Filesystems frozen together.
pub struct Frozen {
    held: Arc<Mutex<Vec<(PathBuf, File)>>>,
    /// Set once the deadline thawed them.
    expired: Arc<AtomicBool>,
    /// Set when the holder is gone: a freeze that returns late thaws.
    gone: Arc<AtomicBool>,
}

impl Frozen {
    /// Freezes the filesystems mounted at `paths`, in order, within
    /// `deadline` from now; any failure thaws those already frozen.
    pub async fn freeze(paths: Vec<PathBuf>, deadline: Duration) -> Result<Self> {
        let frozen = Frozen {
            held: Arc::default(),
            expired: Arc::default(),
            gone: Arc::default(),
        };
        let (held, gone) = (frozen.held.clone(), frozen.gone.clone());
        let work = tokio::task::spawn_blocking(move || {
            for path in paths {
                let dir = freeze_one(&path)?;
                let mut held = held.locked();
                // The holder gave up meanwhile: this one is not held by
                // anyone, so it is thawed at once.
                if gone.load(Ordering::SeqCst) {
                    thaw_one(&path, &dir);
                    drop(held);
                    return Err(Error::unavailable("the freeze was given up"));
                }
                held.push((path, dir));
            }
            Ok(())
        });
        match tokio::time::timeout(deadline, work).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => return Err(e),
            Ok(Err(join)) => return Err(Error::internal(format!("freezing: {join}"))),
            Err(_) => {
                return Err(Error::unavailable(format!(
                    "freezing the filesystems did not finish within {:.1}s (a device that does \
                     not take its flush?); those frozen are thawed",
                    deadline.as_secs_f64()
                )))
            }
        }
        // The deadline thaws whatever is still frozen then.
        let (held, expired) = (frozen.held.clone(), frozen.expired.clone());
        tokio::spawn(async move {
            tokio::time::sleep(deadline).await;
            if thaw_all(&held) {
                expired.store(true, Ordering::SeqCst);
                tracing::warn!("a freeze reached its deadline and was thawed");
            }
        });
        Ok(frozen)
    }

    /// Thaws them all; UNAVAILABLE when the deadline had thawed them
    /// already (what was copied meanwhile may not show one instant).
    pub fn thaw(self) -> Result<()> {
        thaw_all(&self.held);
        if self.expired.load(Ordering::SeqCst) {
            return Err(Error::unavailable(
                "the freeze reached its deadline before every copy was taken",
            ));
        }
        Ok(())
    }
}

/// Thaws what `held` holds; whether there was anything.
fn thaw_all(held: &Mutex<Vec<(PathBuf, File)>>) -> bool {
    let all = std::mem::take(&mut *held.locked());
    let any = !all.is_empty();
    for (path, dir) in all.iter().rev() {
        thaw_one(path, dir);
    }
    any
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // Under the lock, so a freeze still running sees it before it
        // adds to what would no longer be thawed.
        let held = self.held.locked();
        self.gone.store(true, Ordering::SeqCst);
        drop(held);
        thaw_all(&self.held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_block_freezes_from_linux_6_8() {
        for (release, nests) in [
            ("6.1.0-56-amd64", false),
            ("6.7.12", false),
            ("6.8.0-45-generic", true),
            ("6.12.95+deb12-amd64", true),
            ("7.0.1", true),
            ("5.15.0", false),
            ("", false),
            ("garbage", false),
        ] {
            assert_eq!(release_nests(release), nests, "{release}");
        }
    }
}
