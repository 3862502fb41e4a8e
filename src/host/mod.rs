//! The host seam: the filesystem calls the node and the backends make
//! besides mounts and commands (usage figures, device sizes, access checks,
//! publish targets), behind a [`Host`] trait with a real implementation and
//! a fake, so that what depends on them is unit-tested without root.

pub mod crypt;
pub mod devices;
pub mod extents;
#[cfg(test)]
mod fake;
pub mod freeze;
pub mod fs;
pub mod hold;
pub mod iolimit;
pub mod loopdev;
pub mod synced;
mod targets;
mod tree;

/// Hands the allocator's free pages back to the system: freed memory
/// stays in glibc's per-thread arenas (returned only from an arena's top)
/// until this; whether any was returned.
pub fn return_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // malloc_trim(3) through libc: nix has no wrapper for it. It takes
        // no pointers and only walks the allocator's own free lists.
        #[allow(unsafe_code)]
        let released = unsafe { libc::malloc_trim(0) };
        released != 0
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}
pub use tree::remove_tree;

#[cfg(test)]
pub use fake::FakeHost;

use crate::error::{Error, Result};
use std::path::Path;

/// Runs a filesystem or mount-table call on the blocking pool, within
/// `deadline`: a call that blocks in the kernel (on an unreachable server)
/// holds one blocking thread, never an async worker, and the caller gets
/// UNAVAILABLE at the deadline.
pub async fn off_worker<T: Send + 'static>(
    what: &str,
    deadline: std::time::Duration,
    call: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::time::timeout(deadline, tokio::task::spawn_blocking(call)).await {
        Ok(Ok(result)) => result,
        Ok(Err(join)) => Err(Error::internal(format!("{what}: {join}"))),
        Err(_) => Err(Error::unavailable(format!(
            "{what} did not finish within {:.1}s; the call is stuck in the kernel \
             (often on an unreachable server): try again when it answers",
            deadline.as_secs_f64()
        ))),
    }
}

/// [`off_worker`] on a thread of its own whose file table is its own
/// (`unshare(CLONE_FILES)`, then every inherited descriptor but 0-2
/// closed): for writes to a remote filesystem. A file open for writing
/// there is flushed at every close of every copy of its descriptor, and a
/// child the driver spawns closes its copies at exec: while the server
/// does not answer, every command the driver spawned meanwhile (any
/// backend's) would hang at its exec. A file opened on this thread is in
/// no other table, so no child ever holds it. Where the call is refused
/// (a seccomp profile without it), the work runs there all the same,
/// with a warning once.
pub async fn off_worker_private<T: Send + 'static>(
    what: &str,
    deadline: std::time::Duration,
    call: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    // The answer comes back through a thread of the shared table: the
    // private one may not wake the runtime (its descriptor is not there).
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("ferrovol-private-files".into())
        .spawn(move || {
            if let Err(e) = private_file_table() {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(error = %e, "a thread of its own files cannot be made \
                        (unshare CLONE_FILES refused): a remote filesystem's writes share the \
                        driver's table, and a server that stops answering mid-write may hold \
                        up the commands spawned meanwhile");
                });
            }
            let _ = tx.send(call());
        });
    if let Err(e) = spawned {
        return Err(Error::internal(format!("{what}: no thread: {e}")));
    }
    let waited = what.to_string();
    off_worker(what, deadline, move || match rx.recv_timeout(deadline) {
        Ok(result) => result,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Error::unavailable(format!(
            "{waited} did not finish within {:.1}s",
            deadline.as_secs_f64()
        ))),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Err(Error::internal(format!("{waited}: its thread panicked")))
        }
    })
    .await
}

/// Gives the calling thread a file table of its own, holding only
/// descriptors 0-2 of the process's (the copies of the others closed, so
/// a thread stuck in the kernel holds no socket or lock of the driver's
/// open).
#[allow(unsafe_code)]
fn private_file_table() -> std::io::Result<()> {
    // SAFETY: unshare(2) and close_range(2) take plain integers and change
    // only this thread's file table, which nothing else on it uses yet.
    unsafe {
        if libc::unshare(libc::CLONE_FILES) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) == 0 {
            return Ok(());
        }
    }
    // A kernel before 5.9: one by one.
    let fds: Vec<i32> = std::fs::read_dir("/proc/thread-self/fd")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: a descriptor of this thread's own table, which no other
        // thread shares (the directory's own is closed already: EBADF).
        unsafe {
            libc::close(fd);
        }
    }
    Ok(())
}

/// The [`off_worker_once`] calls whose thread has not come back yet: by
/// what they do, each with a number of its own and when it began.
type Running = std::collections::HashMap<String, Vec<(u64, std::time::Instant)>>;
static IN_FLIGHT: std::sync::LazyLock<std::sync::Mutex<Running>> =
    std::sync::LazyLock::new(Default::default);
static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// [`off_worker`] for a call that touches a path a filesystem may hold
/// (a stat of a mount whose server does not answer): while a call of the
/// same `what` has been stuck in the kernel past `deadline`, another fails
/// at once (UNAVAILABLE) instead of leaving one more thread stuck beside
/// it, so a dead server, asked about every minute, never uses up the
/// threads. Calls that are merely at the same time all run.
pub async fn off_worker_once<T: Send + 'static>(
    what: &str,
    deadline: std::time::Duration,
    call: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    struct Done(String, u64);
    impl Drop for Done {
        fn drop(&mut self) {
            if let Ok(mut running) = IN_FLIGHT.lock() {
                if let Some(calls) = running.get_mut(&self.0) {
                    calls.retain(|(n, _)| *n != self.1);
                    if calls.is_empty() {
                        running.remove(&self.0);
                    }
                }
            }
        }
    }
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    {
        let mut running = IN_FLIGHT
            .lock()
            .map_err(|_| Error::internal("the stuck-call table is poisoned"))?;
        let calls = running.entry(what.to_string()).or_default();
        if let Some((_, began)) = calls.iter().find(|(_, began)| began.elapsed() >= deadline) {
            return Err(Error::unavailable(format!(
                "{what}: the same call is still stuck in the kernel after {:.0}s (often on an \
                 unreachable server): try again when it answers",
                began.elapsed().as_secs_f64()
            )));
        }
        calls.push((n, std::time::Instant::now()));
    }
    let done = Done(what.to_string(), n);
    off_worker(what, deadline, move || {
        let _done = done;
        call()
    })
    .await
}

/// Writes `value` to a sysfs attribute off the async workers, within
/// `deadline` (a SCSI device's `delete` or `rescan` waits on its path, and
/// a dead path holds it). Whether the attribute was there: a device gone
/// already has none.
pub async fn write_sysfs(
    path: std::path::PathBuf,
    value: &'static str,
    deadline: std::time::Duration,
) -> Result<bool> {
    let what = format!("writing {value} to {}", path.display());
    off_worker(&what, deadline, move || {
        match std::fs::write(&path, value) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io(format!("write {}", path.display()), e)),
        }
    })
    .await
}

/// A filesystem's usage, as statvfs reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FsUsage {
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Free to unprivileged users.
    pub available_bytes: u64,
    pub total_inodes: u64,
    pub free_inodes: u64,
}

/// Filesystem calls on the node.
pub trait Host: Send + Sync {
    /// Usage of the filesystem holding `path`.
    fn fs_usage(&self, path: &Path) -> Result<FsUsage>;
    /// The size of a block device (or file) in bytes.
    fn device_size(&self, path: &Path) -> Result<u64>;
    /// Checks that `dir` is a directory this process may write in.
    fn writable_dir(&self, dir: &Path) -> Result<()>;
    /// Checks that `path` is a directory, not a symlink.
    fn require_dir(&self, path: &Path, field: &str) -> Result<()>;
    /// Creates a publish target: a directory, or a file for a block bind.
    /// Whether it was made now (nothing was there).
    fn make_target(&self, path: &Path, block: bool) -> Result<bool>;
    /// Removes a publish target (never following a symlink).
    fn remove_target(&self, path: &Path) -> Result<()>;
    /// Removes `path` only if it is an empty directory (not a symlink to
    /// one): anything else, or nothing, is left as it is. Whether it
    /// removed something.
    fn remove_empty_dir(&self, path: &Path) -> Result<bool>;
    /// Whether anything (a symlink included) is at `path`.
    fn exists(&self, path: &Path) -> bool;
    /// Whether `path` holds nothing: missing, an empty directory, or an
    /// empty file (a symlink counts as empty here: it is refused by the
    /// path checks).
    fn is_empty(&self, path: &Path) -> Result<bool>;
    /// `path` with every symlink resolved, its last part included (an LV's
    /// `/dev/vg/lv` names `/dev/dm-N`); it must exist.
    fn canonical(&self, path: &Path) -> Result<std::path::PathBuf>;
    /// `path` with every symlink on the way resolved (its last part need
    /// not exist).
    fn resolve(&self, path: &Path) -> Result<std::path::PathBuf>;
    /// `len` bytes of a device (or file) from byte `offset` (a
    /// filesystem's superblock).
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>>;
}

/// The real host.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemHost;

impl Host for SystemHost {
    fn fs_usage(&self, path: &Path) -> Result<FsUsage> {
        let st = nix::sys::statvfs::statvfs(path).map_err(|e| {
            Error::io(
                format!("statvfs {}", path.display()),
                std::io::Error::from_raw_os_error(e as i32),
            )
        })?;
        let frsize = st.fragment_size() as u64;
        Ok(FsUsage {
            total_bytes: st.blocks() as u64 * frsize,
            free_bytes: st.blocks_free() as u64 * frsize,
            available_bytes: st.blocks_available() as u64 * frsize,
            total_inodes: st.files() as u64,
            free_inodes: st.files_free() as u64,
        })
    }

    fn device_size(&self, path: &Path) -> Result<u64> {
        targets::device_size(path)
    }

    fn read_at(&self, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; len];
        std::fs::File::open(path)
            .and_then(|f| f.read_exact_at(&mut buf, offset))
            .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        Ok(buf)
    }

    fn writable_dir(&self, dir: &Path) -> Result<()> {
        let md = std::fs::metadata(dir).map_err(|e| Error::io(format!("{}", dir.display()), e))?;
        if !md.is_dir() {
            return Err(Error::precondition(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
        nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK)
            .map_err(|e| Error::precondition(format!("{} is not writable: {e}", dir.display())))
    }

    fn require_dir(&self, path: &Path, field: &str) -> Result<()> {
        targets::require_dir(path, field)
    }

    fn make_target(&self, path: &Path, block: bool) -> Result<bool> {
        targets::make_target(path, block)
    }

    fn remove_target(&self, path: &Path) -> Result<()> {
        targets::remove_target(path)
    }

    fn exists(&self, path: &Path) -> bool {
        std::fs::symlink_metadata(path).is_ok()
    }

    fn remove_empty_dir(&self, path: &Path) -> Result<bool> {
        targets::remove_empty_dir(path)
    }

    fn is_empty(&self, path: &Path) -> Result<bool> {
        targets::is_empty(path)
    }

    fn resolve(&self, path: &Path) -> Result<std::path::PathBuf> {
        let parent = path
            .parent()
            .ok_or_else(|| Error::invalid(format!("{} has no parent", path.display())))?;
        let name = path
            .file_name()
            .ok_or_else(|| Error::invalid(format!("{} has no name", path.display())))?;
        let base = std::fs::canonicalize(parent)
            .map_err(|e| Error::io(format!("resolve {}", parent.display()), e))?;
        Ok(base.join(name))
    }

    fn canonical(&self, path: &Path) -> Result<std::path::PathBuf> {
        std::fs::canonicalize(path).map_err(|e| Error::io(format!("resolve {}", path.display()), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;
    use std::time::Duration;

    /// A call stuck past its deadline makes the next of its kind fail at
    /// once, not leave one more thread stuck; calls merely at the same
    /// time all run; once the stuck one comes back, calls run again.
    /// The files of this process's table, by what they point at.
    fn table(dir: &str) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .collect()
    }

    /// A file opened by a private-table call is in no other table (a
    /// child spawned meanwhile holds no copy), and the call's thread
    /// holds none of the process's files but 0-2. The same call on the
    /// blocking pool shows the file in the process's table: the check
    /// can fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_private_call_s_files_are_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let before = dir.path().join("opened-before");
        let _held = std::fs::File::create(&before).unwrap();
        for private in [true, false] {
            let path = dir.path().join(format!("written-{private}"));
            let (opened_tx, opened_rx) = std::sync::mpsc::channel();
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            let p = path.clone();
            let work = move || {
                let f = std::fs::File::create(&p).unwrap();
                let own = table("/proc/thread-self/fd");
                opened_tx.send(own).unwrap();
                go_rx.recv().unwrap();
                drop(f);
                Ok(())
            };
            let call = tokio::spawn(async move {
                match private {
                    true => off_worker_private("test", Duration::from_secs(30), work).await,
                    false => off_worker("test", Duration::from_secs(30), work).await,
                }
            });
            let own = tokio::task::spawn_blocking(move || opened_rx.recv().unwrap())
                .await
                .unwrap();
            let shared = table("/proc/self/fd");
            go_tx.send(()).unwrap();
            call.await.unwrap().unwrap();
            assert!(own.contains(&path), "{own:?}");
            assert_eq!(
                shared.contains(&path),
                !private,
                "private {private}: {shared:?}"
            );
            assert_eq!(
                own.contains(&before),
                !private,
                "private {private}: {own:?}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_stuck_in_the_kernel_is_not_piled_on() {
        let what = "statting /test/stuck-mount";
        let (release, held) = std::sync::mpsc::channel::<()>();
        let stuck = off_worker_once(what, Duration::from_millis(100), move || {
            let _ = held.recv();
            Ok(())
        })
        .await
        .unwrap_err();
        assert_eq!(stuck.kind, Kind::Unavailable);
        let began = std::time::Instant::now();
        let e = off_worker_once(what, Duration::from_millis(100), || Ok(()))
            .await
            .unwrap_err();
        assert_eq!(e.kind, Kind::Unavailable);
        assert!(e.message.contains("still stuck"), "{e:?}");
        assert!(began.elapsed() < Duration::from_millis(50));
        // Another path is not held up.
        off_worker_once("statting /test/other", Duration::from_secs(5), || Ok(()))
            .await
            .unwrap();
        // Two at once, neither stuck: both run.
        let slow = |ms| {
            move || {
                std::thread::sleep(Duration::from_millis(ms));
                Ok(())
            }
        };
        let (a, b) = tokio::join!(
            off_worker_once("statting /test/busy", Duration::from_secs(5), slow(100)),
            off_worker_once("statting /test/busy", Duration::from_secs(5), slow(100)),
        );
        a.unwrap();
        b.unwrap();
        // The stuck one comes back: calls go through again.
        release.send(()).unwrap();
        let again = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            match off_worker_once(what, Duration::from_secs(5), || Ok(())).await {
                Ok(()) => break,
                Err(_) if std::time::Instant::now() < again => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                Err(e) => panic!("{e:?}"),
            }
        }
    }

    /// A sysfs write that blocks in the kernel (here: opening a FIFO no
    /// one reads, as a SCSI delete waits on a dead path) holds a blocking
    /// thread, not the async worker: other work on the one-thread runtime
    /// goes on, and the caller gets UNAVAILABLE at the deadline.
    #[tokio::test]
    async fn a_stuck_sysfs_write_is_off_the_worker_and_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let attr = dir.path().join("delete");
        nix::unistd::mkfifo(&attr, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let stuck = tokio::spawn(write_sysfs(attr.clone(), "1", Duration::from_millis(300)));
        // The worker is free while the write is stuck.
        let other = tokio::spawn(async { 41 + 1 });
        assert_eq!(other.await.unwrap(), 42);
        let e = stuck.await.unwrap().unwrap_err();
        assert_eq!(e.kind, Kind::Unavailable, "{e}");
        // Let the blocked thread finish: read what it writes.
        let read = std::thread::spawn(move || std::fs::read(&attr).unwrap());
        assert_eq!(read.join().unwrap(), b"1");
        // An attribute that is gone: nothing to write, not an error.
        let gone = dir.path().join("gone/rescan");
        assert!(!write_sysfs(gone, "1", Duration::from_secs(5))
            .await
            .unwrap());
    }
}
