//! Volumes as btrfs subvolumes, on an export whose filesystem the
//! controller reaches on its own machine (`btrfs_path`): a snapshot of a
//! subvolume is one instant of every file in it, made at once whatever its
//! size, and a restore or a clone is a writable snapshot of it. The NFS
//! clients see each subvolume as the directory it is.

use crate::error::{Error, Result};
use crate::exec::{path_arg, Command, CommandRunner};
use std::path::Path;
use std::time::Duration;

/// `btrfs subvolume` commands are metadata operations; a snapshot waits
/// for the filesystem's current transaction to commit.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The inode number of every subvolume's root directory
/// (`BTRFS_FIRST_FREE_OBJECTID`).
const SUBVOLUME_ROOT: u64 = 256;

/// Whether `path` is on a btrfs filesystem.
pub fn is_btrfs(path: &Path) -> Result<bool> {
    let fs = nix::sys::statfs::statfs(path)
        .map_err(|e| Error::io(format!("inspect {}", path.display()), e.into()))?;
    Ok(fs.filesystem_type() == nix::sys::statfs::BTRFS_SUPER_MAGIC)
}

/// Whether `path` is the root of a btrfs subvolume (false for anything
/// else, or for what cannot be read).
pub fn is_subvolume(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).is_ok_and(|md| md.is_dir() && md.ino() == SUBVOLUME_ROOT)
        && is_btrfs(path).unwrap_or(false)
}

/// Checks that `root` (an export's `btrfs_path`) is a btrfs filesystem's
/// directory: FAILED_PRECONDITION naming it otherwise.
pub fn check_root(root: &Path) -> Result<()> {
    match is_btrfs(root) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::precondition(format!(
            "btrfs_path {} is not on a btrfs filesystem",
            root.display()
        ))),
        Err(e) => Err(e.context("btrfs_path")),
    }
}

async fn subvolume(
    runner: &dyn CommandRunner,
    what: &str,
    args: &[&str],
    paths: &[&Path],
) -> Result<()> {
    let mut cmd = Command::new("btrfs")
        .arg("subvolume")
        .args(args.iter().copied());
    for p in paths {
        cmd = cmd.arg(path_arg(p)?);
    }
    runner
        .run(cmd.timeout(TIMEOUT))
        .await
        .map_err(|e| Error::from(e).context(what.to_string()))?;
    Ok(())
}

/// Makes `path` (its parent exists) an empty subvolume.
pub async fn create(runner: &dyn CommandRunner, path: &Path) -> Result<()> {
    subvolume(runner, "make the volume's subvolume", &["create"], &[path]).await
}

/// Snapshots subvolume `from` as `to` (absent, its parent exists): read-only
/// for a snapshot, writable for a restore or a clone.
pub async fn snapshot(
    runner: &dyn CommandRunner,
    from: &Path,
    to: &Path,
    read_only: bool,
) -> Result<()> {
    let args: &[&str] = if read_only {
        &["snapshot", "-r"]
    } else {
        &["snapshot"]
    };
    subvolume(runner, "snapshot the subvolume", args, &[from, to]).await
}

/// Deletes subvolume `path` with everything in it (absent: nothing to do).
pub async fn delete(runner: &dyn CommandRunner, path: &Path) -> Result<()> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    if !is_subvolume(path) {
        return Err(Error::internal(format!(
            "{} is not a subvolume: not deleted as one",
            path.display()
        )));
    }
    subvolume(runner, "delete the subvolume", &["delete"], &[path]).await
}
