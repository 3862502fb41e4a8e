//! The real runner: tokio processes with a timeout that kills the child.

use super::{Command, CommandRunner, ExecError, Output};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// How long a killed child is waited for before its timeout is reported:
/// one that dies (anything but a process stuck in the kernel) is gone,
/// reaped, by then; one that does not is reaped in the background.
const REAP_GRACE: Duration = Duration::from_secs(5);

/// A child's process group, killed whole when this is dropped armed: a
/// command that timed out, or whose call was cancelled. Disarmed when the
/// child exits on its own (a daemon it started, such as `rpc.statd`,
/// lives on).
struct Group(Option<i32>);

impl Group {
    fn kill(&mut self) {
        if let Some(pgid) = self.0.take() {
            // SAFETY: killpg takes plain integers and touches no memory.
            #[allow(unsafe_code)]
            unsafe {
                libc::killpg(pgid, libc::SIGKILL);
            }
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Everything a child writes to one of its pipes, until it closes.
async fn read_pipe<R: AsyncRead + Unpin>(pipe: &mut Option<R>) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    if let Some(p) = pipe {
        p.read_to_end(&mut bytes).await?;
    }
    Ok(bytes)
}

/// Runs commands as child processes of the driver.
#[derive(Debug, Default, Clone)]
pub struct SystemRunner {
    /// An upper bound on every command's timeout (operators lower it to
    /// fail fast on hung storage; tests lower it to test hangs quickly).
    pub max_timeout: Option<std::time::Duration>,
}

/// The process a command runs as: its arguments and environment, its
/// pipes, killed when dropped and when the driver dies.
fn child_command(command: &Command) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&command.program);
    cmd.args(&command.args)
        .stdin(if command.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    supervised(&mut cmd);
    cmd.envs(command.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    cmd
}

/// What every child of the driver runs under (a command's process, or a
/// helper that runs commands for it): killed when dropped, with what it
/// started, and when the driver dies; the C locale.
pub fn supervised(cmd: &mut tokio::process::Command) {
    // A child outliving its timeout (or a cancelled RPC) is killed,
    // with what it started: it leads a process group of its own
    // (`mount` runs `mount.nfs`, which a kill of `mount` alone would
    // leave running).
    cmd.kill_on_drop(true).process_group(0).env("LC_ALL", "C");
    // If the driver itself dies (SIGKILL, OOM), its children die with it
    // instead of running on unsupervised (an orphaned mkfs would race the
    // restarted driver's retry).
    // SAFETY: prctl is async-signal-safe and touches no memory of ours;
    // the closure allocates nothing.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[async_trait::async_trait]
impl CommandRunner for SystemRunner {
    fn max_timeout(&self) -> Option<std::time::Duration> {
        self.max_timeout
    }

    async fn run(&self, command: Command) -> Result<Output, ExecError> {
        let shown = command.to_string();
        let started = std::time::Instant::now();
        let mut cmd = child_command(&command);
        let mut child = cmd.spawn().map_err(|e| ExecError::Spawn {
            command: shown.clone(),
            reason: command.redact_shown(&e.to_string()),
        })?;
        let mut group = Group(child.id().and_then(|id| i32::try_from(id).ok()));
        if let (Some(data), Some(mut stdin)) = (command.stdin.clone(), child.stdin.take()) {
            // Errors here surface as the child's own failure.
            let _ = stdin.write_all(&data).await;
            drop(stdin);
        }
        let limit = command.timeout_under(self.max_timeout);
        let (mut stdout, mut stderr) = (child.stdout.take(), child.stderr.take());
        let waited = tokio::time::timeout(limit, async {
            let (status, out, err) =
                tokio::join!(child.wait(), read_pipe(&mut stdout), read_pipe(&mut stderr));
            Ok::<_, std::io::Error>(std::process::Output {
                status: status?,
                stdout: out?,
                stderr: err?,
            })
        })
        .await;
        let out = match waited {
            Err(_) => {
                // Killed with its group, and reaped before the timeout is
                // reported.
                group.kill();
                let _ = child.start_kill();
                let _ = tokio::time::timeout(REAP_GRACE, child.wait()).await;
                return Err(ExecError::Timeout {
                    command: shown,
                    after: limit,
                });
            }
            Ok(Err(e)) => {
                return Err(ExecError::Spawn {
                    command: shown,
                    reason: command.redact_shown(&e.to_string()),
                })
            }
            Ok(Ok(out)) => {
                group.0 = None;
                out
            }
        };
        // Each command's time (its line is redacted as any error's is),
        // to see where a call's time goes.
        tracing::debug!(
            command = %shown,
            code = ?out.status.code(),
            ms = started.elapsed().as_millis() as u64,
            "command ran"
        );
        Output {
            code: out.status.code(),
            stdout: command.redact(&String::from_utf8_lossy(&out.stdout)),
            stderr: command.redact_shown(&String::from_utf8_lossy(&out.stderr)),
        }
        .checked(shown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Whether process `pid` still runs (a zombie does not).
    fn running(pid: &str) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, r)| r.trim().starts_with(['R', 'S', 'D']))
            })
            .unwrap_or(false)
    }

    /// A command that times out is killed with what it started (a helper
    /// it runs, as `mount` runs `mount.nfs`); one that exits on its own
    /// leaves a process it started in the background alone.
    #[tokio::test]
    async fn a_timed_out_command_is_killed_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let script = format!("sleep 60 & echo $! > {}; wait", pid_file.display());
        let err = SystemRunner::default()
            .run(
                Command::new("sh")
                    .args(["-c", &script])
                    .timeout(Duration::from_millis(300)),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::Timeout { .. }), "{err}");
        let pid = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .to_string();
        let gone = Instant::now() + Duration::from_secs(5);
        while running(&pid) && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            !running(&pid),
            "the command's child {pid} outlived its timeout"
        );
        // Exited on its own: its background child lives on.
        let script = format!(
            "sleep 60 </dev/null >/dev/null 2>&1 & echo $! > {}",
            pid_file.display()
        );
        SystemRunner::default()
            .run(Command::new("sh").args(["-c", &script]))
            .await
            .unwrap();
        let pid = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .to_string();
        assert!(running(&pid));
        let _ = std::process::Command::new("kill").arg(&pid).status();
    }

    #[tokio::test]
    async fn runs_and_captures_output() {
        let out = SystemRunner::default()
            .run(Command::new("sh").args(["-c", "echo out; echo err >&2"]))
            .await
            .unwrap();
        assert_eq!(out.stdout, "out\n");
        assert_eq!(out.stderr, "err\n");
    }

    #[tokio::test]
    async fn nonzero_exit_is_an_error_with_redacted_stderr() {
        let err = SystemRunner::default()
            .run(
                Command::new("sh")
                    .args(["-c", "echo 'bad key s3cr3t' >&2; exit 3"])
                    .secret("s3cr3t"),
            )
            .await
            .unwrap_err();
        assert_eq!(err.exit_code(), Some(3));
        let text = err.to_string();
        assert!(text.contains("bad key ***"), "{text}");
        assert!(!text.contains("s3cr3t"), "{text}");
    }

    /// The secrets of the call being served are hidden from what any
    /// command run for it shows, though no one marked them on the command;
    /// a successful command's stdout is left as printed (it is parsed, not
    /// shown); outside the call nothing is hidden.
    #[tokio::test]
    async fn a_calls_secrets_are_hidden_from_every_command_run_for_it() {
        let secret = "call-secret-value".to_string();
        let script = "echo \"$1\"; echo \"refused $1\" >&2; exit ${2:-0}";
        let run =
            |code: &str| Command::new("sh").args(["-c", script, "sh", "call-secret-value", code]);
        let (failed, passed, shown) = crate::exec::hiding(vec![secret.clone()], async {
            let runner = SystemRunner::default();
            (
                runner.run(run("3")).await.unwrap_err(),
                runner.run(run("0")).await.unwrap(),
                run("0").to_string(),
            )
        })
        .await;
        let text = failed.to_string();
        assert!(text.contains("refused ***"), "{text}");
        assert!(!text.contains(&secret), "{text}");
        assert!(!shown.contains(&secret), "{shown}");
        assert!(!passed.stderr.contains(&secret), "{}", passed.stderr);
        assert_eq!(passed.stdout.trim(), secret);
        // Outside the call: shown as is.
        assert!(run("0").to_string().contains(&secret));
        // Values too short to be secrets are not blanked out of words.
        assert!(crate::exec::call_secret_values(["abc", "long-enough"]) == ["long-enough"]);
    }

    #[tokio::test]
    async fn stdin_is_fed() {
        let out = SystemRunner::default()
            .run(Command::new("cat").stdin("hello"))
            .await
            .unwrap();
        assert_eq!(out.stdout, "hello");
    }

    /// Live (not zombie) processes whose command line holds `tag`.
    fn live_with(tag: &str) -> Vec<i32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                String::from_utf8_lossy(&cmdline).contains(tag)
                    && stat.split_whitespace().nth(2) != Some("Z")
            })
            .collect()
    }

    #[tokio::test]
    async fn hung_child_is_killed_at_timeout() {
        // The child renames itself to a unique tag, so the test can see it
        // start and see it gone, without racing it for a pid file.
        let tag = format!("ferrovol-hung-{}", std::process::id());
        let runner = SystemRunner::default();
        let cmd = Command::new("bash")
            .args(["-c", &format!("exec -a {tag} sleep 30")])
            .timeout(Duration::from_secs(3));
        let run = tokio::spawn(async move { runner.run(cmd).await });
        // Seen alive, unless the machine is so slow that the timeout came
        // first: either way it must end as a timeout with nothing left.
        while live_with(&tag).is_empty() && !run.is_finished() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let err = run.await.unwrap().unwrap_err();
        assert!(matches!(err, ExecError::Timeout { .. }), "{err}");
        // Killed and reaped by the time the timeout is reported.
        assert!(live_with(&tag).is_empty(), "the child outlived its timeout");
    }

    #[tokio::test]
    async fn the_runner_cap_shortens_long_timeouts() {
        let runner = SystemRunner {
            max_timeout: Some(Duration::from_millis(200)),
        };
        let start = Instant::now();
        let err = runner
            .run(
                Command::new("sleep")
                    .arg("30")
                    .timeout(Duration::from_secs(60)),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(err, ExecError::Timeout { after, .. } if after == Duration::from_millis(200)),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn missing_program_is_a_spawn_error() {
        let err = SystemRunner::default()
            .run(Command::new("/nonexistent/ferrovol-tool"))
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::Spawn { .. }));
    }
}
