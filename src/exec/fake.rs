//! A scripted runner for unit tests: records every command and answers from a
//! queue of replies matched by program name. It is strict: a command nobody
//! scripted fails (and fails the test), and so does a scripted reply that
//! was never used, checked when the runner is dropped.

use super::{Command, CommandRunner, ExecError, Output};
use std::collections::VecDeque;
use std::sync::Mutex;

/// How the fake answers one command.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Exit 0 with this stdout.
    Ok(String),
    /// Exit with this code and stderr.
    Fail(i32, String),
    /// Exit with this code, having written this stdout (a report of what
    /// it found before it failed).
    FailWithOutput(i32, String),
    /// Behave as if the command hung and was killed at its timeout.
    Timeout,
    /// Exit 0 with this stdout, having done to the world what the command
    /// does (a device removed from a fake sysfs).
    OkAfter(String, Effect),
}

/// What a scripted command does besides answering.
#[derive(Clone)]
pub struct Effect(pub std::sync::Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Effect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Effect(..)")
    }
}

/// Answers commands from a script, strictly.
#[derive(Default)]
pub struct FakeRunner {
    script: Mutex<VecDeque<(String, Reply)>>,
    calls: Mutex<Vec<Command>>,
    unexpected: Mutex<Vec<String>>,
}

impl FakeRunner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues a reply for the next call of `program` (matched in order).
    pub fn expect(&self, program: &str, reply: Reply) -> &Self {
        self.script
            .lock()
            .unwrap()
            .push_back((program.to_string(), reply));
        self
    }

    /// Queues a plain success (exit 0, no output) for `program`.
    pub fn ok(&self, program: &str) -> &Self {
        self.expect(program, Reply::Ok(String::new()))
    }

    /// Every command run so far.
    pub fn calls(&self) -> Vec<Command> {
        self.calls.lock().unwrap().clone()
    }

    /// The command lines run so far, as displayed (redacted).
    pub fn lines(&self) -> Vec<String> {
        self.calls().iter().map(|c| c.to_string()).collect()
    }
}

#[async_trait::async_trait]
impl CommandRunner for FakeRunner {
    async fn run(&self, command: Command) -> Result<Output, ExecError> {
        self.calls.lock().unwrap().push(command.clone());
        let reply = {
            let mut script = self.script.lock().unwrap();
            let pos = script.iter().position(|(p, _)| *p == command.program);
            pos.and_then(|i| script.remove(i)).map(|(_, r)| r)
        };
        let shown = command.to_string();
        let Some(reply) = reply else {
            self.unexpected.lock().unwrap().push(shown.clone());
            return Err(ExecError::Failed {
                command: shown,
                output: Output {
                    code: Some(127),
                    stdout: String::new(),
                    stderr: "the test scripted no reply for this command".into(),
                },
            });
        };
        match reply {
            Reply::Ok(stdout) => Ok(Output {
                code: Some(0),
                stdout: command.redact(&stdout),
                stderr: String::new(),
            }),
            Reply::Fail(code, stderr) => Err(ExecError::Failed {
                command: shown,
                output: Output {
                    code: Some(code),
                    stdout: String::new(),
                    stderr: command.redact_shown(&stderr),
                },
            }),
            Reply::FailWithOutput(code, stdout) => Err(ExecError::Failed {
                command: shown,
                output: Output {
                    code: Some(code),
                    stdout: command.redact(&stdout),
                    stderr: String::new(),
                },
            }),
            Reply::OkAfter(stdout, Effect(effect)) => {
                effect();
                Ok(Output {
                    code: Some(0),
                    stdout: command.redact(&stdout),
                    stderr: String::new(),
                })
            }
            Reply::Timeout => Err(ExecError::Timeout {
                command: shown,
                after: command.timeout,
            }),
        }
    }
}

impl Drop for FakeRunner {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let unexpected = self.unexpected.get_mut().unwrap();
        assert!(
            unexpected.is_empty(),
            "commands run that the test did not script: {unexpected:#?}"
        );
        let unused: Vec<String> = self
            .script
            .get_mut()
            .unwrap()
            .iter()
            .map(|(program, reply)| format!("{program}: {reply:?}"))
            .collect();
        assert!(
            unused.is_empty(),
            "scripted replies never used: {unused:#?}"
        );
    }
}
