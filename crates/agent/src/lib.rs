//! The guest grading agent: the wire protocol between the server and `ttlab-agent`, the fixed
//! paths the agent and cloud-init agree on, the agent itself (token check, HTTP handling,
//! command runner, token rotation, the moved hard deadline), and, behind the `client` feature,
//! the typed async client the server uses for readiness, grading, the console size, token
//! rotation and the deadline.
//!
//! It does not own what runs around it: cloud-init installs and starts the agent and writes its
//! token and markers (the cloudinit crate), the server decides when to poll and what to grade
//! (the api crate), and the network policy decides who can reach port [`protocol::PORT`].
//!
//! # The agent
//!
//! `ttlab-agent [--root DIR] [--listen ADDR:PORT]` ([`protocol::CLI_USAGE`]) serves HTTP/1.1
//! on `0.0.0.0:8899`, one request per connection, at most
//! [`protocol::MAX_CONCURRENT_REQUESTS`] at once (503 `busy` beyond). Every request needs
//! `Authorization: Bearer <token>`, compared in constant time with the token file
//! ([`protocol::TOKEN_PATH`], re-read for each request; 401 otherwise, 503
//! `token_unavailable` while the file is missing or invalid).
//!
//! - `GET /v1/ready` → [`protocol::ReadyResponse`]: whether the readiness marker exists, and
//!   the failure marker's text if the setup failed.
//! - `POST /v1/exec` with [`protocol::ExecRequest`] → [`protocol::ExecResponse`]: runs
//!   `/bin/sh -c COMMAND` as the agent's user in `/`, in its own process group, killed as a
//!   group at the timeout (and when the shell exits, so nothing it started lingers); output is
//!   capped at [`protocol::MAX_OUTPUT_BYTES`] per stream.
//! - `POST /v1/console-size` with [`protocol::ConsoleSize`] (`{"rows":40,"cols":120}`, each
//!   1 to [`protocol::MAX_CONSOLE_DIMENSION`], else 400) → the same size: sets the window size
//!   of the serial console [`protocol::CONSOLE_TTY_PATH`] (`TIOCSWINSZ`; the kernel sends
//!   `SIGWINCH` to its foreground programs, so `vim`, `top` and `less` redraw for the size of
//!   the student's browser terminal). Under `--root DIR` (a simulated guest, no device) it
//!   writes `ROWS COLS` to `DIR/dev/ttyS0` instead, which the simulated console reads.
//!   A console that is missing or not a terminal gets 500 `internal`.
//! - `POST /v1/token` with [`protocol::RotateTokenRequest`] (`{"token":"<64 lowercase hex>"}`,
//!   parsed exactly as the token file is; anything else 400 `bad_request`, whose message never
//!   repeats what was sent) → [`protocol::TokenRotated`]: replaces the token file atomically
//!   (a temporary file in the same directory, mode 0600, fsynced, renamed over it). From the
//!   answer on only the new token is accepted, on every endpoint and after a restart; requests
//!   already authenticated with the old one complete. Rotating to the token in use answers
//!   `{"changed":false}` and writes nothing. Rotations hold a mutex; one that finds the token
//!   already rotated to another by a concurrent request gets 409 `conflict`. When the new file
//!   cannot be written the answer is 500 `internal` with the reason, and the old token stays
//!   valid, its file untouched.
//! - `POST /v1/deadline` with [`protocol::PowerOffAt`] (`{"power_off_at":1767225600}`, Unix
//!   seconds, not before 2020 ([`protocol::MIN_POWER_OFF_AT`]) nor more than 400 days after
//!   the guest's clock, else 400) → the value stored: writes it atomically (mode 0644) to
//!   [`protocol::POWER_OFF_AT_PATH`], which the guest's power-off check (run every minute by
//!   its timer) prefers to the deadline baked in at first boot, so the new deadline, earlier or
//!   later, takes effect within a minute. 500 `internal` if it cannot be written (the previous
//!   deadline stays in force).
//!
//! Why only the server may call these two: the bearer token is the only credential, and only
//! its current holder can rotate it, so a pool VM's boot token (in its cloud-init Secret and
//! its user-data) stops working once the server rotates it at claim time. The deadline
//! endpoint can move the guest's power-off later as well as earlier, which is why the token
//! is never given to anyone but the server. A student is root in their own guest and can
//! always disable the power-off there; it is the last-resort layer behind the reaper, which
//! deletes the VM at expiry from the database clock.
//! - A known path with another method gets 405, an unknown path 404. Malformed HTTP gets 400, an oversized head 431, an oversized body 413 (unread), a
//!   request not received within 10 s 408; the agent keeps serving.
//!
//! Once listening it prints one line, [`protocol::LISTENING_PREFIX`] and the bound address, to
//! standard output; requests are logged to standard error (never the token).
//!
//! # Where it runs
//!
//! The binary is linked dynamically against glibc and needs glibc ≥ 2.34
//! ([`protocol::MIN_GLIBC`]): Ubuntu 22.04+, Debian 12+, RHEL 9+ and their derivatives. On an
//! older guest it cannot start: the dynamic loader exits with
//! ``version `GLIBC_2.34' not found``, the readiness marker is never reported, and the server
//! times out. It needs nothing else on the guest but `/bin/sh`.
//!
//! # Size
//!
//! It travels gzip+base64 inside the cloud-init Secret (≤ 1 MiB), so the agent code path uses
//! only std, serde_json, httparse and rustix (raw syscalls for process groups). Build the
//! shipped binary with `cargo build -p ttlab-agent-bin --profile agent`;
//! `bins/agent/measure-size.sh` builds it and prints its raw, gzip and base64 sizes and the
//! newest glibc symbol version it needs, failing past 400 KiB of base64 or GLIBC_2.34. Dev
//! builds of the agent crates are optimised for size too (root `Cargo.toml`), so the
//! `target/debug/ttlab-agent` that tests and the simulator embed also fits the Secret.
//!
//! # Using the real binary in tests
//!
//! `bins/agent` has integration tests, so `cargo test --workspace` and
//! `cargo nextest run --workspace` build `target/debug/ttlab-agent`; [`locate_binary`] finds it
//! next to the running test executable. A crate whose tests need it alone should run
//! `cargo build -p ttlab-agent-bin` first.
//!
//! # Example
//!
//! ```
//! use ttlab_agent::protocol::{AgentToken, ExecRequest};
//! use ttlab_agent::token;
//!
//! let token = AgentToken::from_random_bytes([7; 32]);
//! let header = format!("Bearer {}", token.reveal());
//! let presented = token::bearer(header.as_bytes()).expect("a bearer token");
//! assert!(token::matches(&token, presented));
//! assert!(!token::matches(&token, b"guess"));
//!
//! let body = serde_json::to_string(&ExecRequest { command: "systemctl is-active nginx".into(), timeout_ms: 5000 })?;
//! assert_eq!(body, r#"{"command":"systemctl is-active nginx","timeout_ms":5000}"#);
//! # Ok::<(), serde_json::Error>(())
//! ```

#[cfg(feature = "client")]
mod client;
mod http;
mod paths;
pub mod protocol;
mod runner;
mod server;
pub mod token;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[cfg(feature = "client")]
pub use client::{AgentClient, AgentConnection, AgentIo, AgentRoute, Connector};
pub use paths::AgentPaths;
pub use server::{Agent, AgentConfig, REQUEST_TIMEOUT};
#[doc(hidden)]
pub use server::{Answered, answer_bytes};

/// Where a client reaches an agent, as its errors name it: the agent's address, or a tunnel
/// that a [`Connector`](crate::Connector) opens (described in its own words, such as `port
/// 8899 of VMI lab-1 through the API server`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentAddr {
    /// A TCP connection to this address.
    Direct(SocketAddr),
    /// A tunnel, described.
    Tunnel(String),
}

impl AgentAddr {
    /// The address of a direct connection.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        match self {
            Self::Direct(addr) => Some(*addr),
            Self::Tunnel(_) => None,
        }
    }
}

impl std::fmt::Display for AgentAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Direct(addr) => write!(f, "{addr}"),
            Self::Tunnel(what) => f.write_str(what),
        }
    }
}

/// Everything that can go wrong in this crate: starting the agent, and talking to one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The agent's command line is wrong (the text includes the usage line).
    #[error("{0}")]
    Usage(String),
    /// The agent could not bind its listening socket.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why it failed.
        source: std::io::Error,
    },
    /// No connection to the agent (refused, unreachable; or a tunnel that could not be opened
    /// now): the guest is not up yet, or the agent is not running.
    #[error("agent at {addr} unreachable: {source}")]
    Unreachable {
        /// The agent's address.
        addr: AgentAddr,
        /// Why connecting failed.
        source: std::io::Error,
    },
    /// The way to the agent is refused for good: a tunnel's [`Connector`](crate::Connector)
    /// failed with `PermissionDenied`, `NotFound` or `InvalidInput` (no right to open it, no
    /// such VM). Retrying will not help.
    #[error("agent at {addr} cannot be reached: {source}")]
    NoRoute {
        /// Where the agent was sought.
        addr: AgentAddr,
        /// Why the tunnel was refused.
        source: std::io::Error,
    },
    /// The connection broke during the exchange.
    #[error("connection to the agent at {addr} failed: {reason}")]
    Transport {
        /// The agent's address.
        addr: AgentAddr,
        /// What failed.
        reason: String,
    },
    /// No answer (or no connection) within the deadline.
    #[error("agent at {addr} did not answer within {after:?}")]
    Timeout {
        /// The agent's address.
        addr: AgentAddr,
        /// The deadline that passed.
        after: Duration,
    },
    /// The agent refused the token (401): the wrong VM, or a token mix-up.
    #[error("agent at {addr} refused the token")]
    Unauthorized {
        /// The agent's address.
        addr: AgentAddr,
    },
    /// The agent cannot serve now (503: `busy`, or `token_unavailable` while cloud-init has
    /// not written the token yet); retrying later may succeed.
    #[error("agent at {addr} unavailable ({code}): {message}")]
    Unavailable {
        /// The agent's address.
        addr: AgentAddr,
        /// The error code ([`protocol::error_code`]).
        code: String,
        /// The agent's explanation.
        message: String,
    },
    /// The agent refused the request (4xx other than 401, or 500).
    #[error("agent at {addr} refused the request with {status} ({code}): {message}")]
    Rejected {
        /// The agent's address.
        addr: AgentAddr,
        /// HTTP status.
        status: u16,
        /// The error code ([`protocol::error_code`]).
        code: String,
        /// The agent's explanation.
        message: String,
    },
    /// The answer was not the agent protocol (wrong status, bad JSON, too large).
    #[error("agent at {addr} answered outside the protocol: {reason}")]
    BadResponse {
        /// The agent's address.
        addr: AgentAddr,
        /// What was wrong.
        reason: String,
    },
    /// The request was not sent because it is invalid (for example a zero timeout).
    #[error("invalid agent request: {0}")]
    InvalidRequest(String),
    /// The agent did not report ready (nor failed) within the allowed time.
    #[error("agent at {addr} not ready after {after:?} (last: {last})")]
    NotReady {
        /// The agent's address.
        addr: AgentAddr,
        /// How long it was polled.
        after: Duration,
        /// The last answer or error seen.
        last: String,
    },
    /// [`locate_binary`] found no built `ttlab-agent`.
    #[error("no ttlab-agent binary at {}; build it with `cargo build -p ttlab-agent-bin`", .searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" or "))]
    BinaryNotFound {
        /// The places looked at.
        searched: Vec<PathBuf>,
    },
}

impl Error {
    /// Whether the same request may succeed later (the guest is still booting, the agent is
    /// busy, a connection dropped); the others need a human.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Unreachable { .. }
                | Self::Transport { .. }
                | Self::Timeout { .. }
                | Self::Unavailable { .. }
        )
    }
}

/// The built `ttlab-agent` binary next to the running executable: `target/<profile>/ttlab-agent`
/// seen from a test in `target/<profile>/deps/`, or from a binary in `target/<profile>/`.
/// For tests and the simulator; a deployment knows where its agent is.
pub fn locate_binary() -> Result<PathBuf, Error> {
    let exe = std::env::current_exe().map_err(|_| Error::BinaryNotFound {
        searched: Vec::new(),
    })?;
    let mut searched = Vec::new();
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let candidate = d.join("ttlab-agent");
        if candidate.is_file() {
            return Ok(candidate);
        }
        searched.push(candidate);
        dir = d.parent();
    }
    Err(Error::BinaryNotFound { searched })
}
