//! The command runner: `/bin/sh -c COMMAND` in its own process group, with a deadline, its
//! output drained concurrently and capped.
//!
//! - The shell is the leader of a new process group (`process_group(0)`), so everything it
//!   starts (unless it calls `setsid` itself) can be signalled at once.
//! - A waiter thread blocks in `waitid(WEXITED | WNOWAIT)`: it learns that the shell ended
//!   without reaping it. While the shell is an unreaped zombie its pid, which is the group id,
//!   cannot be reused, so the `SIGKILL` to the group can never hit an unrelated process.
//! - The group is killed when the deadline passes, and also when the shell exits in time:
//!   background processes left behind by a grading command do not outlive it, and cannot hold
//!   the output pipes open.
//! - Standard output and standard error are read by one thread each, so a command filling
//!   one pipe never blocks on the other. Each keeps at most `max_output` bytes and reads and
//!   drops the rest, so memory stays bounded whatever the command prints.
//! - If a process that left the group (with `setsid`) still holds a pipe, the output collected
//!   so far is returned after a short grace and marked truncated.
//!
//! Process-group signalling uses `rustix` (raw Linux syscalls, no libc, no `unsafe` here):
//! std can put the child in a group but cannot signal a group or wait without reaping.

use std::io::{self, Read};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};

use crate::protocol::ExecResponse;

/// How long, after the process group was killed, the output readers may take to see the end of
/// their pipes before the output is returned as it is.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);
/// Stack size of the helper threads (they hold no large buffers on the stack).
const HELPER_STACK: usize = 64 * 1024;
/// Read buffer of each output reader.
const READ_CHUNK: usize = 16 * 1024;

/// Runs `command` with `/bin/sh -c` in `workdir`, kills its process group after `timeout`, and
/// returns what happened. Standard input is `/dev/null`. Errors only when the shell or a
/// helper thread cannot be started.
pub fn run(
    command: &str,
    timeout: Duration,
    workdir: &Path,
    max_output: usize,
) -> io::Result<ExecResponse> {
    let started = Instant::now();
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(command)
        .current_dir(workdir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()?;
    let pid = Pid::from_child(&child);

    let (done_tx, done_rx) = mpsc::channel::<()>();
    let stdout = Arc::new(Mutex::new(Captured::default()));
    let stderr = Arc::new(Mutex::new(Captured::default()));
    let pipes = [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    ];
    let mut readers = 0;
    for (pipe, sink) in pipes.into_iter().zip([&stdout, &stderr]) {
        let Some(pipe) = pipe else { continue };
        let (sink, done) = (Arc::clone(sink), done_tx.clone());
        let spawned = spawn_helper("ttlab-agent-output", move || {
            drain(pipe, &sink, max_output);
            let _ = done.send(());
        });
        if let Err(e) = spawned {
            kill_group(pid);
            let _ = child.wait();
            return Err(e);
        }
        readers += 1;
    }
    drop(done_tx);

    let (exit_tx, exit_rx) = mpsc::channel::<()>();
    let waiter = spawn_helper("ttlab-agent-wait", move || {
        // Returns once the shell exited, or was already reaped by the runner (ECHILD).
        while let Err(rustix::io::Errno::INTR) = rustix::process::waitid(
            WaitId::Pid(pid),
            WaitIdOptions::EXITED | WaitIdOptions::NOWAIT,
        ) {}
        let _ = exit_tx.send(());
    });
    if let Err(e) = waiter {
        kill_group(pid);
        let _ = child.wait();
        return Err(e);
    }
    let timed_out = exit_rx.recv_timeout(timeout) == Err(mpsc::RecvTimeoutError::Timeout);

    // The shell is unreaped here (exited or not), so its pid still names our group.
    kill_group(pid);
    let status = child.wait()?;

    let grace_end = Instant::now() + OUTPUT_GRACE;
    let mut finished = 0;
    while finished < readers {
        let left = grace_end.saturating_duration_since(Instant::now());
        match done_rx.recv_timeout(left) {
            Ok(()) => finished += 1,
            Err(_) => break,
        }
    }
    let incomplete = finished < readers;
    let (stdout, stdout_truncated) = take(&stdout, incomplete);
    let (stderr, stderr_truncated) = take(&stderr, incomplete);

    Ok(ExecResponse {
        exit_code: if timed_out { None } else { status.code() },
        timed_out,
        stdout,
        stderr,
        stdout_truncated,
        stderr_truncated,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    })
}

/// Output kept from one pipe.
#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    truncated: bool,
    finished: bool,
}

/// Reads `pipe` to its end, keeping the first `max` bytes in `sink`.
fn drain(mut pipe: Box<dyn Read + Send>, sink: &Mutex<Captured>, max: usize) {
    let mut chunk = vec![0u8; READ_CHUNK];
    loop {
        let n = match pipe.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let mut captured = sink.lock().unwrap_or_else(|p| p.into_inner());
        let room = max.saturating_sub(captured.bytes.len());
        let keep = n.min(room);
        captured.bytes.extend_from_slice(&chunk[..keep]);
        if keep < n {
            captured.truncated = true;
        }
    }
    sink.lock().unwrap_or_else(|p| p.into_inner()).finished = true;
}

/// The text and truncation flag of a capture; output still being read counts as truncated.
fn take(sink: &Mutex<Captured>, incomplete: bool) -> (String, bool) {
    let mut captured = sink.lock().unwrap_or_else(|p| p.into_inner());
    let truncated = captured.truncated || (incomplete && !captured.finished);
    let bytes = std::mem::take(&mut captured.bytes);
    (String::from_utf8_lossy(&bytes).into_owned(), truncated)
}

/// `SIGKILL` to the whole process group led by `pid`; an already empty group is fine.
fn kill_group(pid: Pid) {
    let _ = rustix::process::kill_process_group(pid, Signal::KILL);
}

/// Starts a small named helper thread.
fn spawn_helper(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> io::Result<thread::JoinHandle<()>> {
    thread::Builder::new()
        .name(name.to_owned())
        .stack_size(HELPER_STACK)
        .spawn(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(command: &str, timeout_ms: u64, max: usize) -> ExecResponse {
        run(
            command,
            Duration::from_millis(timeout_ms),
            Path::new("/"),
            max,
        )
        .expect("runs")
    }

    #[test]
    fn reports_exit_code_and_both_streams() {
        let r = sh("echo out; echo err >&2; exit 3", 10_000, 1024);
        assert_eq!(r.exit_code, Some(3));
        assert!(!r.timed_out);
        assert_eq!(r.stdout, "out\n");
        assert_eq!(r.stderr, "err\n");
        assert!(!r.stdout_truncated && !r.stderr_truncated);
    }

    #[test]
    fn output_beyond_the_cap_is_dropped_and_flagged() {
        let r = sh(
            "head -c 100000 /dev/zero | tr '\\0' a; head -c 10 /dev/zero | tr '\\0' b >&2",
            10_000,
            1000,
        );
        assert_eq!(r.stdout, "a".repeat(1000));
        assert!(r.stdout_truncated);
        assert_eq!(r.stderr, "b".repeat(10));
        assert!(!r.stderr_truncated);
        assert_eq!(r.exit_code, Some(0));
    }

    #[test]
    fn a_full_stderr_pipe_does_not_block_stdout() {
        // 1 MB to stderr first: with sequential reading this would fill the pipe and hang.
        let r = sh("head -c 1000000 /dev/zero >&2; echo done", 10_000, 16);
        assert_eq!(r.stdout, "done\n");
        assert!(r.stderr_truncated);
    }

    #[test]
    fn timeout_kills_the_whole_group_and_reports_no_exit_code() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("bg.pid");
        let cmd = format!("sleep 300 & echo $! > {}; wait", pidfile.display());
        let r = sh(&cmd, 300, 1024);
        assert!(r.timed_out);
        assert_eq!(r.exit_code, None);
        assert!(
            r.duration_ms >= 300 && r.duration_ms < 10_000,
            "{}",
            r.duration_ms
        );
        let bg: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(exits(bg), "background child {bg} survived the timeout");
    }

    #[test]
    fn background_processes_do_not_outlive_a_finished_command() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("bg.pid");
        // The background sleep keeps stdout open; without the group kill this would hang.
        let cmd = format!("sleep 300 & echo $! > {}; echo hi", pidfile.display());
        let r = sh(&cmd, 60_000, 1024);
        assert_eq!(r.exit_code, Some(0));
        assert_eq!(r.stdout, "hi\n");
        assert!(r.duration_ms < 10_000, "{}", r.duration_ms);
        let bg: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(exits(bg), "background child {bg} survived");
    }

    #[test]
    fn a_missing_working_directory_is_an_error_not_a_panic() {
        assert!(
            run(
                "true",
                Duration::from_secs(5),
                Path::new("/nonexistent/dir"),
                10
            )
            .is_err()
        );
    }

    /// Waits (up to a minute) until `pid` has exited: a pidfd becomes readable when its process
    /// ends. Returns whether it has.
    pub(crate) fn exits(pid: i32) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec};
        use rustix::process::{Pid, PidfdFlags, pidfd_open};
        let Some(pid) = Pid::from_raw(pid) else {
            return true;
        };
        let fd = match pidfd_open(pid, PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::SRCH) => return true,
            Err(e) => panic!("pidfd_open: {e}"),
        };
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        let timeout = Timespec {
            tv_sec: 60,
            tv_nsec: 0,
        };
        rustix::event::poll(&mut fds, Some(&timeout)).expect("poll") == 1
    }
}
