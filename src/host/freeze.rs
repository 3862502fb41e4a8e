//! Freezing mounted filesystems (FIFREEZE / FITHAW): a frozen filesystem
//! has written out everything it held and takes no new writes until it is
//! thawed, so copies taken meanwhile of the devices under several of them
//! show one instant.
//!
//! A freeze never outlives its holder, even a holder that is SIGKILLed:
//!
//! - The freezing is done by a small child process, the holder (this
//!   binary, `freeze-holder`), which keeps the frozen filesystems' handles
//!   and thaws them all when the driver asks, when its own deadline
//!   passes, or when its standard input closes: the driver's end of that
//!   pipe closes when the driver dies, however it dies. A driver killed
//!   alone (OOM, a signal, a panic) thaws within the time the holder takes
//!   to read the end of its input.
//! - Before the holder is started, an intent naming the filesystems is
//!   recorded durably ([`crate::intents`]); it goes once they are thawed.
//!   When driver and holder die together (the container killed as a
//!   whole), the next start thaws what an intent names (each path still
//!   this node's staged volume), before it serves anything.
//!
//! A FIFREEZE stuck in the kernel (a device that does not answer its
//! flush) is waited for only until the deadline; if it returns later, the
//! holder thaws at once.

use crate::error::{Error, Result};
use crate::intents::{Intent, IntentId, Intents};
use crate::sync::LockExt;
use std::fs::File;
use std::path::{Path, PathBuf};
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
        // The holder has no log of its own: its standard error is the
        // driver's.
        eprintln!(
            "ferrovol freeze-holder: could not thaw the filesystem at {}: {e}",
            path.display()
        );
    }
}

/// Thaws the filesystem mounted at `path` if it is frozen: whether it was
/// (FITHAW on a filesystem not frozen fails EINVAL). For what a dead
/// holder left frozen.
#[allow(unsafe_code)] // FITHAW on a descriptor this function opened
pub fn thaw_path(path: &Path) -> Result<bool> {
    use std::os::fd::AsRawFd;
    let dir = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    let mut arg: libc::c_int = 0;
    // SAFETY: FITHAW takes an int it does not read; `dir` is open.
    match unsafe { sys::fithaw(dir.as_raw_fd(), &mut arg) } {
        Ok(_) => Ok(true),
        Err(nix::errno::Errno::EINVAL) => Ok(false),
        Err(e) => Err(Error::io(
            format!("thaw the filesystem at {}", path.display()),
            e.into(),
        )),
    }
}

/// The first argument that makes this binary a freeze's holder.
pub const HOLDER_COMMAND: &str = "freeze-holder";

/// What the driver sends its holder, as one JSON line on its standard
/// input. After it, a line `thaw` (or the end of the input) thaws.
#[derive(serde::Serialize, serde::Deserialize)]
struct HoldRequest {
    paths: Vec<PathBuf>,
    deadline_ms: u64,
}

/// The holder's lines on its standard output.
const FROZEN: &str = "frozen";
const THAWED: &str = "thawed";
const EXPIRED: &str = "expired";
const FAILED: &str = "error ";

/// What the holder holds: the frozen filesystems' handles, and whether its
/// deadline thawed them, under one lock (a freeze that finishes after the
/// deadline is thawed at once, never kept).
#[derive(Default)]
struct Hold {
    frozen: Vec<(PathBuf, File)>,
    expired: bool,
}

/// Thaws what `hold` holds, newest first.
fn thaw_all(hold: &mut Hold) {
    for (path, dir) in std::mem::take(&mut hold.frozen).iter().rev() {
        thaw_one(path, dir);
    }
}

/// The holder: `ferrovol freeze-holder`, run by [`Freezer::freeze`]. Reads
/// its [`HoldRequest`], freezes each path in order, says `frozen` (or
/// `error <why>`, with those it froze thawed), then thaws everything at a
/// `thaw` line, at the end of its input (the driver is gone) or at the
/// deadline, whichever comes first, and says `thawed` (or `expired`).
/// Returns the exit status.
pub fn holder_main() -> i32 {
    use std::io::{BufRead, Write};
    let mut input = std::io::stdin().lock().lines();
    let say = |line: &str| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}").and_then(|()| out.flush());
    };
    let request: HoldRequest = match input.next().map(|l| l.map(|l| serde_json::from_str(&l))) {
        Some(Ok(Ok(r))) => r,
        _ => {
            say(&format!("{FAILED}no hold request on standard input"));
            return 2;
        }
    };
    let hold = Arc::new(Mutex::new(Hold::default()));
    let deadline = Duration::from_millis(request.deadline_ms);
    {
        let hold = hold.clone();
        std::thread::spawn(move || {
            std::thread::sleep(deadline);
            let mut hold = hold.locked();
            hold.expired = true;
            thaw_all(&mut hold);
        });
    }
    for path in request.paths {
        let frozen = freeze_one(&path);
        let mut hold = hold.locked();
        match frozen {
            Ok(dir) if !hold.expired => hold.frozen.push((path, dir)),
            Ok(dir) => {
                thaw_one(&path, &dir);
                drop(hold);
                say(&format!(
                    "{FAILED}the freeze's deadline passed before every filesystem was frozen"
                ));
                return 1;
            }
            Err(e) => {
                thaw_all(&mut hold);
                drop(hold);
                say(&format!("{FAILED}{}", e.message));
                return 1;
            }
        }
    }
    say(FROZEN);
    // A `thaw`, or the end of the input, or an unreadable line: all thaw.
    let _ = input.next();
    let mut hold = hold.locked();
    thaw_all(&mut hold);
    say(if hold.expired { EXPIRED } else { THAWED });
    0
}

/// Freezes filesystems through a holder, with an intent on disk first.
pub struct Freezer {
    /// The program run as the holder, with [`HOLDER_COMMAND`] as its
    /// argument: this binary.
    holder: PathBuf,
    intents: Arc<Intents>,
}

impl Freezer {
    /// Holders run as `holder freeze-holder`; intents go to `intents`.
    pub fn new(holder: PathBuf, intents: Arc<Intents>) -> Self {
        Freezer { holder, intents }
    }

    /// Freezes the filesystems mounted at `paths`, in order, within
    /// `deadline` from now, and keeps them frozen until [`Frozen::thaw`],
    /// the [`Frozen`] dropped, the driver's death, or `deadline` from now,
    /// whichever comes first. Any failure thaws those already frozen.
    pub async fn freeze(&self, paths: Vec<PathBuf>, deadline: Duration) -> Result<Frozen> {
        if paths.is_empty() {
            return Ok(Frozen::none());
        }
        let intent = self.intents.record(&Intent::Freeze {
            paths: paths.clone(),
        })?;
        crate::killpoint::hit(crate::killpoint::Step::FreezeIntent);
        let spawned = tokio::process::Command::new(&self.holder)
            .arg(HOLDER_COMMAND)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            // Out of the driver's process group: a terminal's ^C to the
            // driver must not kill the holder before it thaws.
            .process_group(0)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = self.intents.done(&intent);
                return Err(Error::io(
                    format!("start the freeze holder {}", self.holder.display()),
                    e,
                ));
            }
        };
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Error::internal("the freeze holder has no pipes"));
        };
        let mut held = Held {
            child: Some(child),
            stdin: Some(stdin),
            stdout: tokio::io::BufReader::new(stdout),
            paths: paths.clone(),
            intent: Some(intent),
            intents: self.intents.clone(),
        };
        let request = HoldRequest {
            paths,
            deadline_ms: deadline.as_millis() as u64,
        };
        let mut line = serde_json::to_string(&request)
            .map_err(|e| Error::internal(format!("encode the hold request: {e}")))?;
        line.push('\n');
        let answer = tokio::time::timeout(deadline, async {
            held.send(&line).await?;
            held.answer().await
        })
        .await;
        match answer {
            Ok(Ok(a)) if a == FROZEN => {}
            Ok(Ok(a)) => {
                held.finish().await;
                let why = a
                    .strip_prefix(FAILED)
                    .unwrap_or("the freeze holder ended early");
                return Err(Error::unavailable(format!("freezing: {why}")));
            }
            Ok(Err(e)) => {
                held.finish().await;
                return Err(e);
            }
            // Dropped: the holder thaws when (if) its freeze returns.
            Err(_) => {
                return Err(Error::unavailable(format!(
                    "freezing the filesystems did not finish within {:.1}s (a device that does \
                     not take its flush?); those frozen are thawed",
                    deadline.as_secs_f64()
                )))
            }
        }
        crate::killpoint::hit(crate::killpoint::Step::FreezeHeld);
        Ok(Frozen { held: Some(held) })
    }
}

/// A holder at work, as the driver sees it.
struct Held {
    child: Option<tokio::process::Child>,
    stdin: Option<tokio::process::ChildStdin>,
    stdout: tokio::io::BufReader<tokio::process::ChildStdout>,
    paths: Vec<PathBuf>,
    intent: Option<IntentId>,
    intents: Arc<Intents>,
}

impl Held {
    async fn send(&mut self, line: &str) -> Result<()> {
        use tokio::io::AsyncWriteExt;
        let stdin = self.stdin.as_mut().expect("the holder's input is open");
        stdin
            .write_all(line.as_bytes())
            .await
            .map_err(|e| Error::io("write to the freeze holder", e))
    }

    /// The holder's next line; empty at the end of its output.
    async fn answer(&mut self) -> Result<String> {
        use tokio::io::AsyncBufReadExt;
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .await
            .map_err(|e| Error::io("read from the freeze holder", e))?;
        Ok(line.trim_end().to_string())
    }

    /// Ends the holder (its input closed: it thaws what it holds) and
    /// waits for it: whether it ended by itself (a holder that exits has
    /// thawed; one killed by a signal may not have).
    async fn end(&mut self) -> bool {
        self.stdin = None;
        match self.child.take() {
            Some(mut child) => child.wait().await.is_ok_and(|s| s.code().is_some()),
            None => true,
        }
    }

    /// [`Held::end`], then [`Held::thawed`].
    async fn finish(&mut self) {
        let thawed_itself = self.end().await;
        self.thawed(!thawed_itself);
    }

    /// The holder is gone: thaws what it held directly when it may have
    /// left it frozen (`direct`: it was killed, or never said it thawed),
    /// then drops the intent. A holder that said so is taken at its word:
    /// a FITHAW after it could thaw another's freeze taken since.
    fn thawed(&mut self, direct: bool) {
        for path in self.paths.iter().filter(|_| direct) {
            match thaw_path(path) {
                Ok(true) => {
                    tracing::warn!(path = %path.display(), "thawed a filesystem its holder left frozen")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e.message, "could not check a filesystem was thawed")
                }
            }
        }
        if let Some(intent) = self.intent.take() {
            if let Err(e) = self.intents.done(&intent) {
                tracing::warn!(intent = %intent, error = %e.message, "could not remove a freeze intent (the next start removes it)");
            }
        }
    }
}

/// Filesystems frozen together.
pub struct Frozen {
    held: Option<Held>,
}

impl Frozen {
    /// Nothing frozen.
    pub fn none() -> Self {
        Frozen { held: None }
    }

    /// Thaws them all; UNAVAILABLE when the deadline had thawed them
    /// already (what was copied meanwhile may not show one instant).
    pub async fn thaw(mut self) -> Result<()> {
        let Some(mut held) = self.held.take() else {
            return Ok(());
        };
        let answer = match held.send("thaw\n").await {
            Ok(()) => held.answer().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        held.end().await;
        crate::killpoint::hit(crate::killpoint::Step::FreezeThawed);
        held.thawed(!matches!(answer.as_str(), THAWED | EXPIRED));
        match answer.as_str() {
            THAWED => Ok(()),
            EXPIRED => Err(Error::unavailable(
                "the freeze reached its deadline before every copy was taken",
            )),
            other => Err(Error::unavailable(format!(
                "the freeze holder ended without thawing ({other:?}): the filesystems were \
                 thawed directly, and the copies may not show one instant"
            ))),
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let Some(mut held) = self.held.take() else {
            return;
        };
        // Its input closed, the holder thaws at once; its end is waited
        // for off this thread, then the intent goes.
        held.stdin = None;
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move { held.finish().await });
            }
            Err(_) => tracing::warn!(
                "a freeze was dropped outside the runtime; the next start removes its intent"
            ),
        }
    }
}

/// Thaws what a dead driver's freeze left frozen: each path of a freeze
/// intent for which `ours` says the filesystem mounted there is still the
/// one that was frozen. Whether each was frozen is logged.
pub fn undo_intent(paths: &[PathBuf], ours: impl Fn(&Path) -> bool) {
    for path in paths {
        if !ours(path) {
            tracing::warn!(path = %path.display(), "a freeze intent names a path that no longer holds this node's volume: left alone");
            continue;
        }
        match thaw_path(path) {
            Ok(true) => {
                tracing::warn!(path = %path.display(), "thawed a filesystem a dead driver had frozen")
            }
            Ok(false) => {
                tracing::info!(path = %path.display(), "a freeze intent's filesystem was not frozen")
            }
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e.message, "could not thaw a filesystem a freeze intent names")
            }
        }
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
