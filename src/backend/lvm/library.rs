//! lvm's commands run in helper processes kept running (`ferrovol
//! lvm-helper`, this binary), through liblvm2cmd's `lvm2_run`, instead of
//! an lvm process each. Starting lvm is most of what a short lvm command
//! costs: in the emulated test guest an `lvs` took 190-260 ms as a
//! process and 75-90 ms in a helper, an `lvremove` 610 against 160-300.
//!
//! Each command keeps what a process gives it: its own timeout (a helper
//! still running a command then is killed, as the command's process
//! would be, and a new one serves the next), its exit code, its stdout
//! and stderr (redacted as any command's), death with the driver, and a
//! kill when its caller goes away. Without liblvm2cmd, or for a command
//! the helper cannot take (input on stdin, an environment of its own, an
//! argument lvm's own line splitter cannot carry), commands run as
//! processes through the runner beneath.
//!
//! Each command runs in a fork of its helper, taken just after
//! `lvm2_init`: it starts from the state a new lvm process would have,
//! and what lvm's library learns while it runs ends with it. (Commands
//! that shared one context answered from what earlier ones had seen: a
//! thin LV active since was taken for inactive, and left active by
//! NodeUnstage.) A command that sets what liblvm2cmd settles at its
//! start ([`SETTLED_AT_START`]) runs as a process.

use crate::exec::{Command, CommandRunner, ExecError, Output};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The subcommand of this binary that serves as a helper.
pub const HELPER_COMMAND: &str = "lvm-helper";

/// The lvm tools the helpers run (lvm's own command names).
const TOOLS: &[&str] = &[
    "lvs",
    "vgs",
    "pvs",
    "lvcreate",
    "lvremove",
    "lvchange",
    "lvextend",
    "lvconvert",
    "lvrename",
];

/// Helpers running at once, at most: lvm commands of different calls run
/// side by side as their processes did (lvm's own locks order what must
/// be ordered).
const HELPERS: usize = 3;

/// A helper serves this many commands, then goes (and a new one comes):
/// each command runs in a fork and keeps nothing, but the helper's own
/// reading of lvm.conf is refreshed now and then all the same.
const COMMANDS_PER_HELPER: u32 = 500;

/// How long a new helper has to load liblvm2cmd and say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A setting liblvm2cmd takes from lvm.conf when `lvm2_init` runs and
/// keeps, whatever a command's `--config` says: rebuilding its filters
/// for a command's own configuration, lvm 2.03.16 puts this one back as
/// it was (`refresh_filters`, "during repair code must not reset
/// suspended flag"). A helper's command told to skip suspended devices
/// read them anyway: in a whole guest run, an `lvs` after a snapshot
/// (which makes the next command scan every device) blocked on the hold
/// devices an iscsi group snapshot had suspended. A command that says it
/// runs as a process, where it is honoured.
const SETTLED_AT_START: &str = "ignore_suspended_devices";

/// The `lvm2_run` line splitter's limit on arguments, with room.
const MAX_ARGS: usize = 60;

/// The setting that keeps memory areas out of what lvm pins.
const MLOCK_FILTER: &str = "mlock_filter";

/// The `--config` text a helper's commands add: this binary's own file
/// left out of the memory lvm pins (mlock) while it has devices
/// suspended, or nothing when its path cannot be named in lvm's syntax.
///
/// lvm pins every mapping of its process before it suspends a device,
/// so that no page it needs while the device's I/O waits is read back
/// from a disk; `mlock_filter` names the mappings known not to be
/// touched meanwhile. A helper's fork maps this whole binary, which runs
/// nothing while `lvm2_run` does (no callback of ours: lvm writes to
/// plain descriptors), so pinning it only costs: in the emulated test
/// guest, pinning and unpinning the test build (31 MB of code) took
/// about 6% of what the lvm commands' forks spent (2026-12-03).
/// The path is the binary's as the kernel has it, which is how
/// /proc/self/maps names its mappings (with " (deleted)" after an
/// upgrade replaced the file: lvm matches part of a line).
fn unpinned_config(exe: &std::path::Path) -> Option<String> {
    let target = std::fs::read_link(exe).unwrap_or_else(|_| exe.to_path_buf());
    let path = target.to_str()?;
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    (path.starts_with('/') && !path.contains(['"', '\'', '\\', '\n']))
        .then(|| format!("activation {{ {MLOCK_FILTER} = [ \"{path}\" ] }}"))
}

/// `args` with `extra` added to their `--config` text (or given as one),
/// unless that text sets the mlock filter itself.
fn with_config(mut args: Vec<String>, extra: &str) -> Vec<String> {
    match args.iter().position(|a| a == "--config") {
        Some(i) if i + 1 < args.len() => {
            if !args[i + 1].contains(MLOCK_FILTER) {
                args[i + 1] = format!("{} {extra}", args[i + 1]);
            }
        }
        _ => {
            args.insert(0, extra.to_string());
            args.insert(0, "--config".to_string());
        }
    }
    args
}

#[derive(Serialize, Deserialize)]
struct Request {
    line: String,
}

#[derive(Serialize, Deserialize)]
struct Reply {
    /// Set on the first line only: liblvm2cmd loaded (or why not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ready: Option<Result<(), String>>,
    #[serde(default)]
    code: i32,
    #[serde(default)]
    stdout: String,
    #[serde(default)]
    stderr: String,
}

/// The line `lvm2_run` splits back into `command`'s arguments, when it
/// can: lvm's splitter takes an argument whole when it has no white
/// space, or when it is quoted (with ' or ") and holds no quote of that
/// kind; it knows no escapes, and a `#` starting an argument ends the
/// line.
fn command_line(command: &Command) -> Option<String> {
    if command.args.len() > MAX_ARGS {
        return None;
    }
    let mut line = command.program.clone();
    for arg in &command.args {
        line.push(' ');
        let plain = !arg.is_empty()
            && !arg.starts_with(['#', '\'', '"'])
            && !arg.chars().any(char::is_whitespace);
        if arg.contains('\0') {
            return None;
        } else if plain {
            line.push_str(arg);
        } else if !arg.contains('\'') {
            line.push('\'');
            line.push_str(arg);
            line.push('\'');
        } else if !arg.contains('"') {
            line.push('"');
            line.push_str(arg);
            line.push('"');
        } else {
            return None;
        }
    }
    Some(line)
}

/// One helper process, idle between commands.
struct Helper {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: BufReader<tokio::process::ChildStdout>,
    served: u32,
}

impl Helper {
    async fn start(exe: &std::path::Path) -> Result<Helper, String> {
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg(HELPER_COMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .env("LVM_SUPPRESS_FD_WARNINGS", "1");
        // Killed when dropped and when the driver dies, as every
        // command's process is.
        crate::exec::supervised(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| e.to_string())?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("no pipes to the helper".into());
        };
        let mut helper = Helper {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            served: 0,
        };
        let first = tokio::time::timeout(START_TIMEOUT, helper.reply())
            .await
            .map_err(|_| "the helper did not start in time".to_string())??;
        match first.ready {
            Some(Ok(())) => Ok(helper),
            Some(Err(why)) => Err(why),
            None => Err("the helper said nothing of liblvm2cmd".into()),
        }
    }

    async fn reply(&mut self) -> Result<Reply, String> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line).await {
            Ok(0) => Err("the helper exited".into()),
            Ok(_) => serde_json::from_str(&line).map_err(|e| format!("the helper's answer: {e}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Runs one command line; an error says the helper is gone (it died
    /// or broke the protocol), with the command perhaps part done.
    async fn run(&mut self, line: String) -> Result<Reply, String> {
        let mut request = serde_json::to_string(&Request { line }).map_err(|e| e.to_string())?;
        request.push('\n');
        self.stdin
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("the helper: {e}"))?;
        self.served += 1;
        self.reply().await
    }
}

/// The runner the lvm backend runs its commands through: helpers for
/// lvm's tools, `inner` for everything else and whatever the helpers
/// cannot take.
pub struct LvmLibrary {
    inner: Arc<dyn CommandRunner>,
    /// This binary, as the kernel has it (an upgrade may have replaced
    /// its file).
    exe: PathBuf,
    idle: Mutex<Vec<Helper>>,
    slots: tokio::sync::Semaphore,
    /// Set when no helper could start (no liblvm2cmd): processes from
    /// then on.
    unavailable: AtomicBool,
    /// What each helper's command adds to its `--config`
    /// ([`unpinned_config`]).
    unpinned: Option<String>,
}

impl LvmLibrary {
    pub fn new(inner: Arc<dyn CommandRunner>, exe: PathBuf) -> Self {
        Self {
            unpinned: unpinned_config(&exe),
            inner,
            exe,
            idle: Mutex::new(Vec::new()),
            slots: tokio::sync::Semaphore::new(HELPERS),
            unavailable: AtomicBool::new(false),
        }
    }

    fn takes(&self, command: &Command) -> Option<String> {
        if self.unavailable.load(Ordering::Relaxed)
            || !TOOLS.contains(&command.program.as_str())
            || command.stdin.is_some()
            || command
                .env
                .iter()
                .any(|(k, v)| !(k == "LVM_SUPPRESS_FD_WARNINGS" && v == "1"))
            || command.args.iter().any(|a| a.contains(SETTLED_AT_START))
        {
            return None;
        }
        match &self.unpinned {
            Some(extra) => {
                let mut unpinned = command.clone();
                unpinned.args = with_config(unpinned.args, extra);
                command_line(&unpinned)
            }
            None => command_line(command),
        }
    }

    /// An idle helper that still runs, or a new one.
    async fn helper(&self) -> Result<Helper, String> {
        loop {
            let next = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match next {
                Some(mut h) => {
                    if matches!(h.child.try_wait(), Ok(None)) {
                        return Ok(h);
                    }
                }
                None => {
                    let started = Instant::now();
                    tracing::debug!("lvm helper starting");
                    let h = Helper::start(&self.exe).await;
                    tracing::debug!(
                        ms = started.elapsed().as_millis() as u64,
                        ok = h.is_ok(),
                        "lvm helper started"
                    );
                    return h;
                }
            }
        }
    }

    fn put_back(&self, helper: Helper) {
        if helper.served < COMMANDS_PER_HELPER {
            self.idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(helper);
        }
    }
}

#[async_trait::async_trait]
impl CommandRunner for LvmLibrary {
    fn max_timeout(&self) -> Option<Duration> {
        self.inner.max_timeout()
    }

    async fn run(&self, command: Command) -> Result<Output, ExecError> {
        let Some(line) = self.takes(&command) else {
            return self.inner.run(command).await;
        };
        let shown = command.to_string();
        let started = Instant::now();
        let limit = command.timeout_under(self.inner.max_timeout());
        let deadline = tokio::time::Instant::now() + limit;
        let timed_out = || ExecError::Timeout {
            command: shown.clone(),
            after: limit,
        };
        // A slot among the helpers; waiting for one counts against the
        // command's time, as a process's start would.
        let Ok(Ok(_slot)) = tokio::time::timeout_at(deadline, self.slots.acquire()).await else {
            return Err(timed_out());
        };
        let mut helper = match tokio::time::timeout_at(deadline, self.helper()).await {
            Err(_) => return Err(timed_out()),
            Ok(Ok(h)) => h,
            Ok(Err(why)) => {
                if !self.unavailable.swap(true, Ordering::Relaxed) {
                    tracing::warn!(reason = %why, "lvm commands run as processes: no helper through liblvm2cmd");
                }
                return self.inner.run(command).await;
            }
        };
        // A helper dropped part way (the timeout, or the caller gone) is
        // killed: its command stops as its process would.
        let reply = match tokio::time::timeout_at(deadline, helper.run(line)).await {
            Err(_) => {
                let _ = helper.child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(5), helper.child.wait()).await;
                return Err(timed_out());
            }
            Ok(Err(why)) => {
                let _ = helper.child.start_kill();
                return Err(ExecError::Failed {
                    command: shown,
                    output: Output {
                        code: None,
                        stdout: String::new(),
                        stderr: command.redact_shown(&why),
                    },
                });
            }
            Ok(Ok(reply)) => reply,
        };
        self.put_back(helper);
        tracing::debug!(
            command = %shown,
            code = reply.code,
            ms = started.elapsed().as_millis() as u64,
            via = "liblvm2cmd",
            "command ran"
        );
        Output {
            code: Some(reply.code),
            stdout: command.redact(&reply.stdout),
            stderr: command.redact_shown(&reply.stderr),
        }
        .checked(shown)
    }
}

/// `ferrovol lvm-helper`: loads liblvm2cmd, says so on its first line,
/// then runs each command line it reads (one JSON object a line) and
/// answers each with its exit code, stdout and stderr (one JSON object a
/// line). Ends at the end of its input.
pub fn helper_main() -> i32 {
    match serve() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ferrovol {HELPER_COMMAND}: {e}");
            2
        }
    }
}

/// The handle and function liblvm2cmd gives.
struct Lvm {
    handle: *mut libc::c_void,
    run: unsafe extern "C" fn(*mut libc::c_void, *const libc::c_char) -> libc::c_int,
}

#[allow(unsafe_code)]
fn load() -> Result<Lvm, String> {
    // SAFETY: dlopen and dlsym take NUL-terminated names; the symbols
    // have the types liblvm2cmd's header (lvm2cmd.h) gives them.
    unsafe {
        let lib = libc::dlopen(c"liblvm2cmd.so.2.03".as_ptr(), libc::RTLD_NOW);
        if lib.is_null() {
            return Err("liblvm2cmd.so.2.03 cannot be loaded".into());
        }
        let init = libc::dlsym(lib, c"lvm2_init".as_ptr());
        let run = libc::dlsym(lib, c"lvm2_run".as_ptr());
        if init.is_null() || run.is_null() {
            return Err("liblvm2cmd has no lvm2_init or lvm2_run".into());
        }
        let init: unsafe extern "C" fn() -> *mut libc::c_void = std::mem::transmute(init);
        let handle = init();
        if handle.is_null() {
            return Err("lvm2_init failed".into());
        }
        Ok(Lvm {
            handle,
            run: std::mem::transmute::<
                *mut libc::c_void,
                unsafe extern "C" fn(*mut libc::c_void, *const libc::c_char) -> libc::c_int,
            >(run),
        })
    }
}

/// A file in memory, for one command's stdout or stderr.
#[allow(unsafe_code)]
fn memfd() -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: a NUL-terminated name; the fd returned is ours alone.
    let fd = unsafe { libc::memfd_create(c"lvm-output".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor no one else owns.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

#[allow(unsafe_code)]
fn redirect(from: &impl std::os::fd::AsRawFd, to: libc::c_int) -> std::io::Result<()> {
    // SAFETY: dup2 of descriptors this process holds; fflush(NULL)
    // flushes stdio's buffers (lvm's printf output) before the swap.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        if libc::dup2(from.as_raw_fd(), to) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Runs one command line in a fork of this helper, its stdout and
/// stderr in `out` and `err`; answers the command's exit code (lvm's:
/// 0 for success), and the signal that killed it, if one did.
///
/// The fork is what makes a helper as good as a process: each command
/// starts from the context `lvm2_init` made, as a new lvm process would,
/// and whatever lvm's library learns while it runs (its device and
/// filter caches, what it read of the devices and of device-mapper)
/// ends with it. A helper whose commands shared one context answered
/// from what earlier commands had seen: in a whole guest run one took an
/// active LV for inactive, and one read a device suspended since, though
/// told to skip suspended devices. What the fork saves is the rest of a
/// process's start (exec, loading lvm and its libraries, `lvm2_init`).
#[allow(unsafe_code)]
fn run_forked(
    lvm: &Lvm,
    line: &std::ffi::CStr,
    out: &std::fs::File,
    err: &std::fs::File,
) -> std::io::Result<(i32, Option<i32>)> {
    // SAFETY: this helper is one thread (nothing here starts another),
    // so the child may run any code after fork; fflush first so that no
    // buffered output is written twice. The child leaves only by _exit.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        let parent = libc::getpid();
        let pid = libc::fork();
        if pid < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if pid == 0 {
            // Dies with the helper (killed on a timeout, or with the
            // driver), as the command's process would.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                || libc::getppid() != parent
                || redirect(out, 1).is_err()
                || redirect(err, 2).is_err()
            {
                libc::_exit(127);
            }
            let ret = (lvm.run)(lvm.handle, line.as_ptr());
            libc::fflush(std::ptr::null_mut());
            // lvm's own exit code: 1 (ECMD_PROCESSED) is success.
            libc::_exit(if ret == 1 { 0 } else { ret.clamp(2, 126) });
        }
        let mut status = 0;
        loop {
            if libc::waitpid(pid, &mut status, 0) == pid {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        if libc::WIFSIGNALED(status) {
            let signal = libc::WTERMSIG(status);
            Ok((128 + signal, Some(signal)))
        } else {
            Ok((libc::WEXITSTATUS(status), None))
        }
    }
}

#[allow(unsafe_code)]
fn serve() -> std::io::Result<()> {
    use std::io::{BufRead, Read, Seek, Write};
    use std::os::fd::FromRawFd;
    // The protocol moves off stdin and stdout: lvm prints its reports to
    // stdout and asks its questions on stdin, which is /dev/null (a
    // question is answered no: the driver says -y where it means yes).
    // SAFETY: dup of this process's own standard descriptors.
    let (input, output) = unsafe { (libc::dup(0), libc::dup(1)) };
    if input < 0 || output < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both are new descriptors owned here alone.
    let (input, mut output) = unsafe {
        (
            std::io::BufReader::new(std::fs::File::from_raw_fd(input)),
            std::fs::File::from_raw_fd(output),
        )
    };
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    redirect(&null, 0)?;
    redirect(&null, 1)?;
    let mut say = |reply: &Reply| -> std::io::Result<()> {
        let mut line = serde_json::to_string(reply)?;
        line.push('\n');
        output.write_all(line.as_bytes())?;
        output.flush()
    };
    let lvm = match load() {
        Ok(lvm) => lvm,
        Err(why) => {
            return say(&Reply {
                ready: Some(Err(why)),
                code: 0,
                stdout: String::new(),
                stderr: String::new(),
            })
        }
    };
    say(&Reply {
        ready: Some(Ok(())),
        code: 0,
        stdout: String::new(),
        stderr: String::new(),
    })?;
    for line in input.lines() {
        let request: Request = serde_json::from_str(&line?)?;
        let Ok(cline) = std::ffi::CString::new(request.line) else {
            return Err(std::io::Error::other("a command line with a NUL"));
        };
        let (mut out, mut err) = (memfd()?, memfd()?);
        let (code, killed) = run_forked(&lvm, &cline, &out, &err)?;
        let read = |f: &mut std::fs::File| -> std::io::Result<String> {
            f.rewind()?;
            let mut bytes = Vec::new();
            f.read_to_end(&mut bytes)?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        };
        let mut stderr = read(&mut err)?;
        if let Some(signal) = killed {
            stderr.push_str(&format!(
                "\nthe lvm command was killed by signal {signal}\n"
            ));
        }
        say(&Reply {
            ready: None,
            code,
            stdout: read(&mut out)?,
            stderr,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_split_back_as_lvm_splits_them() {
        let c = Command::new("lvs").args([
            "--config",
            "devices { global_filter = [ \"r|^/dev/rbd|\" ] }",
            "-o",
            "lv_name,lv_tags",
            "vg0/lv",
        ]);
        assert_eq!(
            command_line(&c).unwrap(),
            "lvs --config 'devices { global_filter = [ \"r|^/dev/rbd|\" ] }' -o lv_name,lv_tags vg0/lv"
        );
        // A single quote inside: double quotes around it.
        let c = Command::new("lvs").args(["--config", "x = 'a b'"]);
        assert_eq!(command_line(&c).unwrap(), "lvs --config \"x = 'a b'\"");
        // Both kinds of quote, or a NUL: lvm's splitter cannot carry it.
        assert!(command_line(&Command::new("lvs").arg("a'b\"c d")).is_none());
        assert!(command_line(&Command::new("lvs").arg("a\0b")).is_none());
        // An empty argument, one that starts with # or a quote: quoted.
        assert_eq!(
            command_line(&Command::new("lvs").args(["", "#x", "'y"])).unwrap(),
            "lvs '' '#x' \"'y\""
        );
    }

    #[test]
    fn only_lvm_tools_without_input_an_environment_or_a_setting_fixed_at_start_are_taken() {
        let lib = LvmLibrary::new(
            Arc::new(crate::exec::FakeRunner::new()),
            PathBuf::from("/nonexistent"),
        );
        let lvs = Command::new("lvs").env("LVM_SUPPRESS_FD_WARNINGS", "1");
        assert!(lib.takes(&lvs).is_some());
        assert!(lib.takes(&Command::new("dd")).is_none());
        assert!(lib.takes(&Command::new("lvs").env("X", "1")).is_none());
        assert!(lib
            .takes(&Command::new("lvs").stdin(b"y".to_vec()))
            .is_none());
        // A helper would not honour it (SETTLED_AT_START).
        assert!(lib
            .takes(&Command::new("lvs").args(["--config", "devices/ignore_suspended_devices=1"]))
            .is_none());
        assert!(lib
            .takes(&Command::new("lvs").args(["--config", "devices/scan_lvs=0"]))
            .is_some());
    }

    /// A helper's command leaves this binary out of what lvm pins, in the
    /// `--config` it has or one of its own, unless its text sets the
    /// filter; the path is the binary's file, as /proc/self/maps names it.
    #[test]
    fn a_helpers_commands_leave_this_binary_unpinned() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("ferrovol");
        std::fs::write(&real, b"").unwrap();
        let link = dir.path().join("exe");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let extra = unpinned_config(&link).unwrap();
        assert_eq!(
            extra,
            format!("activation {{ mlock_filter = [ \"{}\" ] }}", real.display())
        );
        let lib = LvmLibrary::new(Arc::new(crate::exec::FakeRunner::new()), link);
        let line = lib
            .takes(&Command::new("lvs").args(["--config", "devices/scan_lvs=0", "vg0"]))
            .unwrap();
        assert_eq!(
            line,
            format!("lvs --config 'devices/scan_lvs=0 {extra}' vg0"),
            "added to the command's own text"
        );
        let line = lib.takes(&Command::new("lvs").arg("vg0")).unwrap();
        assert_eq!(line, format!("lvs --config '{extra}' vg0"));
        let own = "activation { mlock_filter = [ \"x\" ] }";
        let line = lib
            .takes(&Command::new("lvs").args(["--config", own]))
            .unwrap();
        assert_eq!(
            line,
            format!("lvs --config '{own}'"),
            "the operator's filter kept"
        );
        // Replaced by an upgrade: the same path; one lvm's syntax cannot
        // carry: no filter.
        let deleted = dir.path().join("gone");
        std::os::unix::fs::symlink("/usr/bin/ferrovol (deleted)", &deleted).unwrap();
        assert_eq!(
            unpinned_config(&deleted).unwrap(),
            "activation { mlock_filter = [ \"/usr/bin/ferrovol\" ] }"
        );
        let quoted = dir.path().join("quoted");
        std::os::unix::fs::symlink("/opt/a\"b/ferrovol", &quoted).unwrap();
        assert!(unpinned_config(&quoted).is_none());
    }

    /// Without a helper (this binary here is the test harness, which
    /// knows no `lvm-helper`), commands run as processes through the
    /// runner beneath, from then on.
    #[tokio::test]
    async fn without_a_helper_commands_run_as_processes() {
        let fake = Arc::new(crate::exec::FakeRunner::new());
        fake.expect("lvs", crate::exec::Reply::Ok("rows".into()));
        fake.expect("lvs", crate::exec::Reply::Ok("more".into()));
        let lib = LvmLibrary::new(fake.clone(), PathBuf::from("/nonexistent/ferrovol"));
        let out = lib.run(Command::new("lvs").arg("vg0")).await.unwrap();
        assert_eq!(out.stdout, "rows");
        assert!(lib.unavailable.load(Ordering::Relaxed));
        let out = lib.run(Command::new("lvs").arg("vg0")).await.unwrap();
        assert_eq!(out.stdout, "more");
        assert_eq!(fake.lines().len(), 2);
    }
}
