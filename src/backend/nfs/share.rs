//! The controller's view of an NFS share: mounted in a private working
//! directory through the mount helper (a child the exec seam kills at its
//! deadline), shared by the calls that need it and released when idle; and
//! directory work inside it that never follows a symlink out, run off the
//! async workers with a deadline (a call on a share whose server went away
//! blocks in the kernel).

use crate::error::{Error, Result};
use crate::exec::CommandRunner;
use crate::mount::{mount_with_helper, MountOptions, Mounter};
use crate::sync::LockExt;
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a share's mount waits unused before it is released.
pub const IDLE: Duration = Duration::from_secs(60);
/// Deadlines for mounting a share and for work inside it.
pub const MOUNT_DEADLINE: Duration = Duration::from_secs(60);
pub const WORK_DEADLINE: Duration = Duration::from_secs(120);

/// Where and how to mount one share.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShareSpec {
    /// `server:/path`, as the mount helper takes it.
    pub source: String,
    pub options: Vec<String>,
}

struct Entry {
    users: usize,
    last_used: Instant,
}

/// The shares this controller has mounted, by working directory.
pub struct WorkMounts {
    root: PathBuf,
    runner: Arc<dyn CommandRunner>,
    /// The mount table, read through the seam.
    mounter: Arc<dyn Mounter>,
    table: Mutex<HashMap<PathBuf, Entry>>,
    /// One lock per share, serializing its mount and its release (never
    /// held across work inside it): a share whose server does not answer
    /// holds up only the calls that need that share.
    mounting: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    reaper_started: std::sync::atomic::AtomicBool,
}

/// A share held mounted while this lives.
pub struct Held {
    mounts: Arc<WorkMounts>,
    pub dir: PathBuf,
    /// The share is an NFS mount here (not a local path: `btrfs_path`).
    pub on_nfs: bool,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut table = self.mounts.table.locked();
        if let Some(e) = table.get_mut(&self.dir) {
            e.users = e.users.saturating_sub(1);
            e.last_used = Instant::now();
        }
    }
}

impl WorkMounts {
    /// An export's filesystem that this machine has at `dir` itself: held
    /// with no mount (nothing to release).
    pub fn local(self: &Arc<Self>, dir: PathBuf) -> Held {
        Held {
            mounts: self.clone(),
            dir,
            on_nfs: false,
        }
    }

    pub fn new(
        root: PathBuf,
        runner: Arc<dyn CommandRunner>,
        mounter: Arc<dyn Mounter>,
    ) -> Arc<Self> {
        Arc::new(WorkMounts {
            root,
            runner,
            mounter,
            table: Mutex::new(HashMap::new()),
            mounting: Mutex::new(HashMap::new()),
            reaper_started: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn dir_for(&self, spec: &ShareSpec) -> PathBuf {
        self.root
            .join(crate::plugin::digest_hex(spec.source.as_bytes(), 12))
    }

    fn share_lock(&self, dir: &Path) -> Arc<tokio::sync::Mutex<()>> {
        self.mounting
            .locked()
            .entry(dir.to_path_buf())
            .or_default()
            .clone()
    }

    /// Counts one more user of `dir` when it is mounted.
    fn join(&self, dir: &Path) -> bool {
        let mut table = self.table.locked();
        match table.get_mut(dir) {
            Some(e) => {
                e.users += 1;
                true
            }
            None => false,
        }
    }

    /// Mounts the share (once; later callers share the mount) and holds it.
    pub async fn hold(self: &Arc<Self>, spec: &ShareSpec) -> Result<Held> {
        self.start_reaper();
        let dir = self.dir_for(spec);
        // A mounted share is joined without waiting on anything.
        if self.join(&dir) {
            return Ok(Held {
                mounts: self.clone(),
                dir,
                on_nfs: true,
            });
        }
        let lock = self.share_lock(&dir);
        let _m = lock.lock().await;
        if !self.join(&dir) {
            crate::records::private_dir(&dir)?;
            // Left mounted by an earlier run: let it go first.
            if self.mounted_at(&dir) {
                let _ = self.unmount(&dir).await;
            }
            let options = MountOptions::parse(&spec.options, false)?;
            mount_with_helper(
                self.runner.as_ref(),
                &spec.source,
                &dir,
                "nfs",
                &options,
                MOUNT_DEADLINE,
            )
            .await
            .map_err(|e| e.context("mount the share"))?;
            self.table.locked().insert(
                dir.clone(),
                Entry {
                    users: 1,
                    last_used: Instant::now(),
                },
            );
        }
        Ok(Held {
            mounts: self.clone(),
            dir,
            on_nfs: true,
        })
    }

    /// Whether something is mounted at `dir`, from the mount table (which
    /// never asks an NFS server anything).
    fn mounted_at(&self, dir: &Path) -> bool {
        matches!(self.mounter.mount_at(dir), Ok(Some(_)))
    }

    /// Unmounts `dir`, and lazily when the server does not answer (a lazy
    /// unmount never waits on it); never forced (see
    /// [`crate::mount::unmount_with_helper`]).
    async fn unmount(&self, dir: &Path) -> Result<()> {
        crate::mount::unmount_with_helper(self.runner.as_ref(), dir, "nfs", Duration::from_secs(20))
            .await
    }

    /// Releases the shares unused for `idle`; returns how many. A share
    /// being mounted or released by another call is left to that call.
    pub async fn release_idle(&self, idle: Duration) -> usize {
        let candidates: Vec<PathBuf> = {
            let table = self.table.locked();
            table
                .iter()
                .filter(|(_, e)| e.users == 0 && e.last_used.elapsed() >= idle)
                .map(|(d, _)| d.clone())
                .collect()
        };
        let mut released = 0;
        for dir in &candidates {
            let lock = self.share_lock(dir);
            let Ok(_m) = lock.try_lock() else { continue };
            // Taken out of the table before it is unmounted, so no call
            // joins a share on its way out (a new one mounts it again,
            // after this lock).
            {
                let mut table = self.table.locked();
                match table.get(dir) {
                    Some(e) if e.users == 0 && e.last_used.elapsed() >= idle => {
                        table.remove(dir);
                    }
                    _ => continue,
                }
            }
            let _ = self.unmount(dir).await;
            let _ = std::fs::remove_dir(dir);
            released += 1;
        }
        released
    }

    /// Lets go of every share mounted under the working root, this run's
    /// and those an earlier run left (a driver killed before it could
    /// release them): at start, and at shutdown once calls are done. Only
    /// the working root's own entries are touched: they are this
    /// backend's. Returns how many were mounted.
    pub async fn release_all(&self) -> usize {
        self.table.locked().clear();
        let left: Vec<PathBuf> = self
            .mounter
            .mounts()
            .map(|all| {
                all.into_iter()
                    .map(|m| m.mount_point)
                    .filter(|p| p.parent() == Some(self.root.as_path()))
                    .collect()
            })
            .unwrap_or_default();
        for dir in &left {
            if let Err(e) = self.unmount(dir).await {
                tracing::warn!(dir = %dir.display(), error = %e.message, "could not release a share's working mount");
            }
        }
        if let Ok(entries) = std::fs::read_dir(&self.root) {
            for e in entries.flatten() {
                let _ = std::fs::remove_dir(e.path());
            }
        }
        left.len()
    }

    /// How many shares are mounted now.
    #[cfg(test)]
    pub fn mounted(&self) -> usize {
        self.table.locked().len()
    }

    fn start_reaper(self: &Arc<Self>) {
        if self
            .reaper_started
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(IDLE / 4).await;
                let Some(mounts) = weak.upgrade() else { return };
                mounts.release_idle(IDLE).await;
            }
        });
    }
}

/// Runs filesystem work on a share off the async workers, within the
/// deadline.
pub async fn blocking<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    crate::host::off_worker(what, WORK_DEADLINE, work).await
}

/// [`blocking`] for work that opens files on a share for writing: on a
/// thread whose file table is its own ([`crate::host::off_worker_private`]),
/// so a server that stops answering mid-write holds up that write alone,
/// never the commands the driver spawns meanwhile.
pub async fn writing<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    crate::host::off_worker_private(what, WORK_DEADLINE, work).await
}

/// Checks a subdirectory path from a request or a template: relative,
/// normal components of `[A-Za-z0-9._-]`, none `.` or `..`, at most 8 deep.
pub fn check_subdir(subdir: &str) -> Result<PathBuf> {
    let bad = |why: &str| Error::invalid(format!("subdirectory {subdir:?} {why}"));
    if subdir.is_empty() || subdir.len() > 200 {
        return Err(bad("must be 1 to 200 bytes"));
    }
    // Judged as text: Path would quietly drop a `.` or an empty part.
    let parts: Vec<&str> = subdir.split('/').collect();
    for name in &parts {
        if name.is_empty() || *name == "." || *name == ".." {
            return Err(bad(
                "must be a relative path of plain parts (no '', '.', '..')",
            ));
        }
        let ok = name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            && !name.starts_with('.');
        if !ok {
            return Err(bad(
                "may hold only letters, digits, '.', '_', '-' and '/', no hidden parts",
            ));
        }
    }
    if parts.len() > 8 {
        return Err(bad("is more than 8 levels deep"));
    }
    let path = Path::new(subdir);
    debug_assert!(path.components().all(|c| matches!(c, Component::Normal(_))));
    Ok(path.to_path_buf())
}

/// The directory `rel` under `root`, if every component exists and is a
/// real directory (a symlink anywhere is refused: it could lead out of the
/// share). `Ok(None)` when something on the way does not exist.
pub fn resolve(root: &Path, rel: &Path) -> Result<Option<PathBuf>> {
    let mut at = root.to_path_buf();
    for c in rel.components() {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(md) if md.file_type().is_symlink() => {
                return Err(Error::precondition(format!(
                    "{} is a symlink; ferrovol does not follow links on a share",
                    at.display()
                )))
            }
            Ok(md) if md.is_dir() => {}
            Ok(_) => {
                return Err(Error::precondition(format!(
                    "{} is not a directory",
                    at.display()
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format!("inspect {}", at.display()), e)),
        }
    }
    Ok(Some(at))
}

/// Creates `rel` under `root` (and what leads to it) with `mode`, never
/// through a symlink. Returns the directory.
pub fn ensure_dir(root: &Path, rel: &Path, mode: u32) -> Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let mut at = root.to_path_buf();
    for c in rel.components() {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(md) if md.file_type().is_symlink() => {
                return Err(Error::precondition(format!(
                    "{} is a symlink; ferrovol does not follow links on a share",
                    at.display()
                )))
            }
            Ok(md) if md.is_dir() => continue,
            Ok(_) => {
                return Err(Error::precondition(format!(
                    "{} is not a directory",
                    at.display()
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("inspect {}", at.display()), e)),
        }
        match std::fs::DirBuilder::new().mode(mode).create(&at) {
            Ok(()) => {}
            // Made meanwhile by someone else: checked on the next round.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io(format!("create {}", at.display()), e)),
        }
        // The umask must not narrow the mode asked for.
        std::fs::set_permissions(&at, std::fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io(format!("chmod {}", at.display()), e))?;
    }
    resolve(root, rel)?.ok_or_else(|| Error::internal("a directory vanished as it was made"))
}

/// Writes a record on a share as [`crate::records::write`] does, without
/// the folder's fsync where the share is an NFS mount
/// ([`crate::records::write_on_server`]).
pub fn write_on_share(on_nfs: bool, path: &Path, bytes: &[u8]) -> Result<()> {
    if on_nfs {
        crate::records::write_on_server(path, bytes)
    } else {
        crate::records::write(path, bytes)
    }
}

/// Removes a record on a share as [`crate::records::remove`] does, without
/// the folder's fsync where the share is an NFS mount.
pub fn remove_on_share(on_nfs: bool, path: &Path) -> Result<bool> {
    if on_nfs {
        crate::records::remove_on_server(path)
    } else {
        crate::records::remove(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;
    use crate::exec::{Command, ExecError, Output};

    /// A mount helper whose mounts of `dead:/` never return until the
    /// test lets them go (a server that does not answer); every other
    /// command succeeds at once.
    struct DeadServer {
        release: tokio::sync::Notify,
        stuck: tokio::sync::Notify,
    }

    #[async_trait::async_trait]
    impl CommandRunner for DeadServer {
        async fn run(&self, command: Command) -> std::result::Result<Output, ExecError> {
            if command.program == "mount.nfs" && command.args.iter().any(|a| a == "dead:/") {
                self.stuck.notify_one();
                self.release.notified().await;
            }
            Ok(Output {
                code: Some(0),
                stdout: String::new(),
                stderr: String::new(),
            })
        }
    }

    #[tokio::test]
    async fn a_dead_server_holds_up_only_its_own_share() {
        let dir = tempfile::tempdir().unwrap();
        let runner = Arc::new(DeadServer {
            release: tokio::sync::Notify::new(),
            stuck: tokio::sync::Notify::new(),
        });
        let mounts = WorkMounts::new(
            dir.path().join("work"),
            runner.clone(),
            Arc::new(crate::mount::SystemMounter),
        );
        let spec = |source: &str| ShareSpec {
            source: source.into(),
            options: vec![],
        };
        let dead = {
            let mounts = mounts.clone();
            let spec = spec("dead:/");
            tokio::spawn(async move { mounts.hold(&spec).await.map(|h| h.dir.clone()) })
        };
        runner.stuck.notified().await;
        // The dead share's mount is still stuck: the live one mounts, is
        // held twice and released, while it waits.
        for _ in 0..2 {
            let held = tokio::time::timeout(Duration::from_secs(30), mounts.hold(&spec("live:/")))
                .await
                .expect("the live share waited on the dead one")
                .unwrap();
            drop(held);
        }
        assert_eq!(mounts.release_idle(Duration::ZERO).await, 1);
        assert!(!dead.is_finished(), "the dead share's mount returned early");
        runner.release.notify_one();
        dead.await.unwrap().unwrap();
        assert_eq!(mounts.mounted(), 1);
    }

    #[test]
    fn subdirs_are_plain_relative_paths() {
        for ok in ["pvc-1", "ns/pvc-1", "a.b_c-d/e"] {
            assert!(check_subdir(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/abs",
            "../up",
            "a/../b",
            "a/./b",
            ".hidden",
            "a/.x",
            "sp ace",
            "a\nb",
            "é",
            "a/b/c/d/e/f/g/h/i",
        ] {
            assert_eq!(
                check_subdir(bad).unwrap_err().kind,
                Kind::InvalidArgument,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn never_walks_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("share");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("ns")).unwrap();
        let rel = Path::new("ns/pvc-1");
        assert_eq!(
            ensure_dir(&root, rel, 0o777).unwrap_err().kind,
            Kind::FailedPrecondition
        );
        assert_eq!(
            resolve(&root, rel).unwrap_err().kind,
            Kind::FailedPrecondition
        );
        assert!(
            !outside.join("pvc-1").exists(),
            "made a directory outside the share"
        );
    }

    #[test]
    fn makes_directories_with_the_mode_asked() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let made = ensure_dir(dir.path(), Path::new("ns/pvc-1"), 0o2770).unwrap();
        assert_eq!(made, dir.path().join("ns/pvc-1"));
        let mode = std::fs::metadata(&made).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o2770);
        // Again: found, not an error.
        assert_eq!(
            ensure_dir(dir.path(), Path::new("ns/pvc-1"), 0o2770).unwrap(),
            made
        );
        assert_eq!(resolve(dir.path(), Path::new("ns/none")).unwrap(), None);
    }
}
