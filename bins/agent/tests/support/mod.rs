//! Starts the real `ttlab-agent` binary on 127.0.0.1 with a private `--root`, and talks raw
//! HTTP to it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ttlab_agent::protocol::{self, AgentToken};

/// How long a test waits for an answer before failing (a safety net, not a pause).
pub const PATIENCE: Duration = Duration::from_secs(60);

/// A running agent, killed when dropped.
pub struct RunningAgent {
    child: Child,
    /// The bound address.
    pub addr: SocketAddr,
    /// The `--root` directory.
    pub root: tempfile::TempDir,
    /// The token written to the token file.
    pub token: AgentToken,
    /// The agent's log lines (standard error).
    pub log: mpsc::Receiver<String>,
}

impl RunningAgent {
    /// An agent with a token file.
    pub fn start() -> Self {
        Self::start_with(true)
    }

    /// An agent whose token file has not been written.
    pub fn start_without_token() -> Self {
        Self::start_with(false)
    }

    fn start_with(write_token: bool) -> Self {
        let root = tempfile::tempdir().expect("temp dir");
        let token = AgentToken::from_random_bytes(std::array::from_fn(|i| {
            (i as u8).wrapping_mul(37) ^ 0x5a
        }));
        if write_token {
            write_file(
                &root
                    .path()
                    .join(protocol::TOKEN_PATH.trim_start_matches('/')),
                token.reveal(),
            );
        }
        let (child, addr, log) = spawn(root.path());
        Self {
            child,
            addr,
            root,
            token,
            log,
        }
    }

    /// Stops the agent and starts a new one on the same root (a new address), as systemd's
    /// `Restart=always` would after a crash or a reboot.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let (child, addr, log) = spawn(self.root.path());
        self.child = child;
        self.addr = addr;
        self.log = log;
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A path under the agent's root, for one of the protocol's absolute paths.
    pub fn path(&self, absolute: &str) -> PathBuf {
        self.root.path().join(absolute.trim_start_matches('/'))
    }

    /// `Authorization` header line with the right token.
    pub fn auth(&self) -> String {
        format!("Authorization: Bearer {}\r\n", self.token.reveal())
    }

    /// `POST path` with `token` as bearer and `json` as body.
    pub fn post_with(&self, token: &AgentToken, path: &str, json: &str) -> (u16, String) {
        self.raw(
            format!(
                "POST {path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n{json}",
                token.reveal(),
                json.len()
            )
            .as_bytes(),
        )
    }

    /// Sends `raw` and returns the status and body of the answer.
    pub fn raw(&self, raw: &[u8]) -> (u16, String) {
        let mut stream = TcpStream::connect(self.addr).expect("connect");
        stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
        stream.write_all(raw).expect("send");
        read_answer(&mut stream)
    }

    /// `POST /v1/exec` with the right token and `json` as body.
    pub fn exec_json(&self, json: &str) -> (u16, String) {
        self.raw(
            format!(
                "POST /v1/exec HTTP/1.1\r\nHost: a\r\n{}Content-Length: {}\r\n\r\n{json}",
                self.auth(),
                json.len()
            )
            .as_bytes(),
        )
    }

    /// Waits for a log line containing `needle`.
    pub fn wait_for_log(&self, needle: &str) -> String {
        loop {
            let line = self
                .log
                .recv_timeout(PATIENCE)
                .unwrap_or_else(|_| panic!("no log line with {needle:?}"));
            if line.contains(needle) {
                return line;
            }
        }
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the binary on 127.0.0.1 with `--root root`; returns it, its address and its log.
fn spawn(root: &Path) -> (Child, SocketAddr, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ttlab-agent"))
        .arg("--root")
        .arg(root)
        .args(["--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ttlab-agent");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read stdout");
    let addr = line
        .trim()
        .strip_prefix(protocol::LISTENING_PREFIX)
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .expect("address");
    let (tx, log) = mpsc::channel();
    let stderr = child.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, addr, log)
}

/// Reads an answer to its end and returns its status and body.
pub fn read_answer(stream: &mut TcpStream) -> (u16, String) {
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes).expect("read answer");
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Writes `content` to `path`, creating its directory.
pub fn write_file(path: &Path, content: &str) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, content).expect("write");
}

/// Waits (up to a minute) until `pid` has exited: a pidfd becomes readable when its process
/// ends. Returns whether it has.
pub fn exits(pid: i32) -> bool {
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

/// A field of `/proc/PID/status` in KiB (`VmHWM`, `VmRSS`).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in status"))
}
