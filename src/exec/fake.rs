//! A scripted runner for unit tests: records every command and answers from a
//! queue of replies matched by program name.

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
    /// Behave as if the command hung and was killed at its timeout.
    Timeout,
}

/// Answers commands from a script; unscripted commands succeed with empty
/// output so tests only script what they assert on.
#[derive(Default)]
pub struct FakeRunner {
    script: Mutex<VecDeque<(String, Reply)>>,
    calls: Mutex<Vec<Command>>,
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
        match reply.unwrap_or(Reply::Ok(String::new())) {
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
                    stderr: command.redact(&stderr),
                },
            }),
            Reply::Timeout => Err(ExecError::Timeout {
                command: shown,
                after: command.timeout,
            }),
        }
    }
}
