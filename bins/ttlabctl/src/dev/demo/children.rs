//! Child processes of the demo and the benchmarks (`ttlab-server`, `ttlab-reaper`): started in
//! their own process group (so a terminal's Ctrl-C reaches only ttlabctl, which then stops
//! them in order), their output forwarded line by line to our stderr with a prefix, and
//! stopped by pid: SIGTERM, then SIGKILL after a grace period.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncBufReadExt as _, AsyncRead, BufReader};
use tokio::process::Command;

/// How many of a child's last output lines are kept for error messages.
const TAIL_LINES: usize = 20;

/// A running child process.
pub(crate) struct ChildProcess {
    name: &'static str,
    pid: u32,
    child: tokio::process::Child,
    tail: Arc<Mutex<VecDeque<String>>>,
    exited: Option<ExitStatus>,
}

impl ChildProcess {
    /// Starts `program` with `args` and `envs` added to (or replacing) our environment.
    pub(crate) fn spawn(
        name: &'static str,
        program: &Path,
        args: &[&str],
        envs: &[(&str, OsString)],
    ) -> anyhow::Result<Self> {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({})", program.display()))?;
        let pid = child
            .id()
            .with_context(|| format!("{name} exited before its pid was read"))?;
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        if let Some(out) = child.stdout.take() {
            forward(name, out, tail.clone());
        }
        if let Some(err) = child.stderr.take() {
            forward(name, err, tail.clone());
        }
        Ok(Self {
            name,
            pid,
            child,
            tail,
            exited: None,
        })
    }

    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The name it was started under (`server`, `reaper`).
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// Its last output lines, oldest first, joined by newlines.
    pub(crate) fn tail(&self) -> String {
        let tail = self
            .tail
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        tail.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Waits until it exits by itself.
    pub(crate) async fn exited(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(s) = self.exited {
            return Ok(s);
        }
        let status = self.child.wait().await?;
        self.exited = Some(status);
        Ok(status)
    }

    /// Whether it has exited (without waiting).
    pub(crate) fn has_exited(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none()
            && let Ok(Some(s)) = self.child.try_wait()
        {
            self.exited = Some(s);
        }
        self.exited
    }

    /// Asks it to stop (SIGTERM), waits up to `grace`, then kills it (SIGKILL). Returns how it
    /// ended; the process is reaped either way.
    pub(crate) async fn stop(&mut self, grace: Duration) -> anyhow::Result<ExitStatus> {
        if let Some(s) = self.has_exited() {
            return Ok(s);
        }
        if let Some(pid) = i32::try_from(self.pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            // It may have exited in between: ESRCH is fine, the wait below reaps it.
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => {
                let status = status.with_context(|| format!("waiting for {}", self.name))?;
                self.exited = Some(status);
                Ok(status)
            }
            Err(_) => {
                eprintln!(
                    "ttlabctl: {} (pid {}) did not stop within {}s of SIGTERM; killing it",
                    self.name,
                    self.pid,
                    grace.as_secs()
                );
                self.child
                    .kill()
                    .await
                    .with_context(|| format!("killing {}", self.name))?;
                let status = self.child.wait().await?;
                self.exited = Some(status);
                Ok(status)
            }
        }
    }
}

fn forward(
    name: &'static str,
    stream: impl AsyncRead + Unpin + Send + 'static,
    tail: Arc<Mutex<VecDeque<String>>>,
) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stream).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("[{name}] {line}");
            let mut tail = tail
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line);
        }
    });
}
