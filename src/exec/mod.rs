//! The exec seam: every external command ferrovol runs goes through a
//! [`CommandRunner`], which enforces a timeout (killing the child when it
//! expires) and redacts secrets from everything it reports.

#[cfg(test)]
mod fake;
mod system;

#[cfg(test)]
pub use fake::{Effect, FakeRunner, Reply};
pub use system::{supervised, SystemRunner};

use crate::error::{Error, Kind, Result};
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Default time a command may run before it is killed.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// One external command: program, arguments, optional stdin, a timeout, and
/// the secret values that must never be shown.
#[derive(Clone, PartialEq, Eq)]
pub struct Command {
    pub program: String,
    pub args: Vec<String>,
    pub stdin: Option<Vec<u8>>,
    pub timeout: Duration,
    /// Extra environment variables for the child.
    pub env: Vec<(String, String)>,
    secrets: Vec<String>,
}

impl Command {
    pub fn new(program: impl Into<String>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            stdin: None,
            timeout: DEFAULT_TIMEOUT,
            env: Vec::new(),
            secrets: Vec::new(),
        }
    }
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
    /// The time this command may run under a runner's cap, if it has one.
    pub fn timeout_under(&self, cap: Option<Duration>) -> Duration {
        cap.map_or(self.timeout, |m| m.min(self.timeout))
    }
    pub fn stdin(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(data.into());
        self
    }
    /// Marks a value as secret: it is replaced by `***` wherever this
    /// command's arguments, output or errors are displayed.
    pub fn secret(mut self, value: impl Into<String>) -> Self {
        let value = value.into();
        if !value.is_empty() {
            self.secrets.push(value);
        }
        self
    }

    /// Replaces every secret value in `text` with `***`.
    pub fn redact(&self, text: &str) -> String {
        redact(text, &self.secrets)
    }

    /// [`Self::redact`], and the secrets of the call being served: for
    /// text that is shown (command lines, stderr, error reasons).
    pub fn redact_shown(&self, text: &str) -> String {
        let call = call_secrets();
        if call.is_empty() {
            return self.redact(text);
        }
        let all: Vec<String> = self.secrets.iter().chain(call.iter()).cloned().collect();
        redact(text, &all)
    }
}

tokio::task_local! {
    /// The secret values of the RPC being served: its CSI `secrets` map.
    static CALL_SECRETS: Arc<[String]>;
}

/// Values shorter than this are not hidden as a call's secrets: they
/// protect nothing and would blank out common words of every message.
pub const MIN_CALL_SECRET: usize = 4;

/// The values of a request's secrets map worth hiding.
pub fn call_secret_values<'a>(values: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    values
        .into_iter()
        .filter(|v| v.len() >= MIN_CALL_SECRET)
        .map(str::to_string)
        .collect()
}

/// Runs `work` (one RPC) with `values` (the secrets its request carried)
/// hidden from what the runner reports during it, whichever backend runs
/// the command and whether or not it marked them: command lines, error
/// text, stderr. A command's stdout on success is data for its caller to
/// parse and is left as the tool printed it (a user name in the secrets map
/// may be part of a name in it); only the values the command marked itself
/// are hidden there.
pub async fn hiding<F: Future>(values: Vec<String>, work: F) -> F::Output {
    CALL_SECRETS.scope(values.into(), work).await
}

/// The secrets of the call this task serves, if any.
fn call_secrets() -> Arc<[String]> {
    CALL_SECRETS
        .try_with(Arc::clone)
        .unwrap_or_else(|_| Arc::from(Vec::new()))
}

/// Replaces each of `secrets` in `text` with `***`, longest first so a secret
/// that contains another is hidden whole.
pub fn redact(text: &str, secrets: &[String]) -> String {
    let mut sorted: Vec<&String> = secrets.iter().filter(|s| !s.is_empty()).collect();
    sorted.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_string();
    for s in sorted {
        out = out.replace(s.as_str(), "***");
    }
    out
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let line = std::iter::once(self.program.as_str())
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ");
        f.write_str(&self.redact_shown(&line))
    }
}

impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Command({self})")
    }
}

/// What a finished command produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Output {
    /// The exit code; `None` when the child died from a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// The output of a command that succeeded, or the failure of
    /// `command` (its shown line) that exited otherwise.
    pub fn checked(self, command: String) -> std::result::Result<Output, ExecError> {
        if self.success() {
            Ok(self)
        } else {
            Err(ExecError::Failed {
                command,
                output: self,
            })
        }
    }
}

/// Why a command did not succeed. Display text is already redacted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecError {
    /// The program could not be started (missing binary, permissions).
    Spawn { command: String, reason: String },
    /// The program ran longer than its timeout and was killed.
    Timeout { command: String, after: Duration },
    /// The program exited with a non-zero status.
    Failed { command: String, output: Output },
}

impl ExecError {
    /// The exit code, for a command that ran and failed.
    pub fn exit_code(&self) -> Option<i32> {
        match self {
            ExecError::Failed { output, .. } => output.code,
            _ => None,
        }
    }
}

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExecError::Spawn { command, reason } => {
                write!(f, "could not run `{command}`: {reason}")
            }
            ExecError::Timeout { command, after } => {
                write!(
                    f,
                    "`{command}` timed out after {:.1}s and was killed",
                    after.as_secs_f64()
                )
            }
            ExecError::Failed { command, output } => {
                let code = output
                    .code
                    .map_or("a signal".to_string(), |c| format!("status {c}"));
                let stderr = output.stderr.trim();
                if stderr.is_empty() {
                    write!(f, "`{command}` failed with {code}")
                } else {
                    write!(f, "`{command}` failed with {code}: {stderr}")
                }
            }
        }
    }
}

impl std::error::Error for ExecError {}

impl From<ExecError> for Error {
    fn from(err: ExecError) -> Self {
        let kind = match err {
            ExecError::Timeout { .. } => Kind::Unavailable,
            _ => Kind::Internal,
        };
        Error::new(kind, err.to_string())
    }
}

/// A path as a command argument; refuses what a command could take for an
/// option.
pub fn path_arg(path: &Path) -> Result<String> {
    let s = path
        .to_str()
        .ok_or_else(|| Error::invalid("path is not UTF-8"))?;
    if !s.starts_with('/') {
        return Err(Error::internal(format!(
            "refusing relative path {s:?} as an argument"
        )));
    }
    Ok(s.to_string())
}

/// Runs external commands. The system implementation spawns real processes;
/// the fake one answers from a script so every caller can be unit-tested.
#[async_trait::async_trait]
pub trait CommandRunner: Send + Sync {
    /// Runs the command to completion. A non-zero exit is an error carrying
    /// the (redacted) output.
    async fn run(&self, command: Command) -> Result<Output, ExecError>;

    /// The cap on every command's timeout, if the driver was given one
    /// (`--command-timeout`): in-process calls to storage (librbd) keep
    /// to it too.
    fn max_timeout(&self) -> Option<std::time::Duration> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_redacts_secret_arguments() {
        let cmd = Command::new("iscsiadm")
            .args(["--value", "hunter2", "-p", "x"])
            .secret("hunter2");
        assert_eq!(cmd.to_string(), "iscsiadm --value *** -p x");
        assert!(!format!("{cmd:?}").contains("hunter2"));
    }

    #[test]
    fn redact_hides_longest_secret_first() {
        let out = redact("key=abcdef and abc", &["abc".into(), "abcdef".into()]);
        assert_eq!(out, "key=*** and ***");
    }

    #[test]
    fn failed_error_includes_stderr_and_code() {
        let err = ExecError::Failed {
            command: "mkfs.ext4 /dev/loop0".into(),
            output: Output {
                code: Some(1),
                stdout: String::new(),
                stderr: "bad superblock\n".into(),
            },
        };
        assert_eq!(
            err.to_string(),
            "`mkfs.ext4 /dev/loop0` failed with status 1: bad superblock"
        );
        assert_eq!(Error::from(err).kind, Kind::Internal);
    }
}
