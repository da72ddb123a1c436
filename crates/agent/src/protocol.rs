//! What cloud-init, the agent and the server agree on: paths, port, and the JSON bodies.

use serde::{Deserialize, Serialize};

/// TCP port the agent listens on inside the guest.
pub const PORT: u16 = 8899;
/// Where cloud-init installs the agent binary.
pub const BINARY_PATH: &str = "/usr/local/bin/ttlab-agent";
/// The systemd unit that runs the agent.
pub const UNIT_PATH: &str = "/etc/systemd/system/ttlab-agent.service";
/// The per-VM bearer token (mode 0600, owner root).
pub const TOKEN_PATH: &str = "/etc/ttlab/agent.token";
/// Written by cloud-init as its very last step, and only if the setup script succeeded.
pub const READY_MARKER_PATH: &str = "/var/lib/ttlab/ready";
/// Written by cloud-init when the setup script failed (holds the reason); never together
/// with the readiness marker.
pub const FAILED_MARKER_PATH: &str = "/var/lib/ttlab/failed";

/// A hard deadline moved by `POST /v1/deadline` (Unix seconds, one line, mode 0644): the
/// power-off check prefers it to the deadline cloud-init baked in at first boot, and falls back
/// to that one when this file is missing or does not hold a plausible Unix time.
pub const POWER_OFF_AT_PATH: &str = "/etc/ttlab/power-off-at";

/// The earliest deadline `POST /v1/deadline` accepts: 2020-01-01T00:00:00Z.
pub const MIN_POWER_OFF_AT: i64 = 1_577_836_800;

/// How far past the agent's own clock `POST /v1/deadline` accepts a deadline: 400 days.
pub const MAX_POWER_OFF_AHEAD_SECS: i64 = 400 * 24 * 60 * 60;

/// The guest's serial console, whose window size `POST /v1/console-size` sets (the console the
/// browser's terminal is relayed to; its getty and shell run on it).
pub const CONSOLE_TTY_PATH: &str = "/dev/ttyS0";

/// The largest number of rows or columns `POST /v1/console-size` accepts.
pub const MAX_CONSOLE_DIMENSION: u16 = 1000;

/// `GET /v1/ready` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadyResponse {
    /// The readiness marker exists.
    pub ready: bool,
    /// The setup failed (the failure marker exists), with its content if readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// `POST /v1/exec` body: run `command` with `/bin/sh -c` as root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Shell command line.
    pub command: String,
    /// Kill the command's whole process group after this many milliseconds.
    pub timeout_ms: u64,
}

/// `POST /v1/exec` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecResponse {
    /// Exit code; `None` when the command was killed by a signal or the timeout.
    pub exit_code: Option<i32>,
    /// The command ran past its timeout and its process group was killed.
    pub timed_out: bool,
    /// Standard output (lossy UTF-8), at most the agent's cap.
    pub stdout: String,
    /// Standard error (lossy UTF-8), at most the agent's cap.
    pub stderr: String,
    /// Standard output was longer than the cap and was cut.
    pub stdout_truncated: bool,
    /// Standard error was longer than the cap and was cut.
    pub stderr_truncated: bool,
    /// Wall-clock run time in milliseconds.
    pub duration_ms: u64,
}

/// `POST /v1/console-size` body, and its answer: the window size of the serial console, in
/// character cells. Each must be between 1 and [`MAX_CONSOLE_DIMENSION`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleSize {
    /// Rows (lines).
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

impl ConsoleSize {
    /// Whether both dimensions are within 1..=[`MAX_CONSOLE_DIMENSION`].
    pub fn is_valid(&self) -> bool {
        (1..=MAX_CONSOLE_DIMENSION).contains(&self.rows)
            && (1..=MAX_CONSOLE_DIMENSION).contains(&self.cols)
    }
}

/// `POST /v1/token` body: the token that replaces the current one (64 lowercase hex digits, as
/// [`AgentToken::parse`] reads them). `Debug` redacts it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RotateTokenRequest {
    /// The new token's text.
    pub token: String,
}

impl RotateTokenRequest {
    /// The body that rotates to `token`.
    pub fn new(token: &AgentToken) -> Self {
        Self {
            token: token.reveal().to_owned(),
        }
    }
}

impl std::fmt::Debug for RotateTokenRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RotateTokenRequest { token: <redacted> }")
    }
}

/// `POST /v1/token` answer (never the token itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRotated {
    /// Whether the token changed: `false` when the request asked for the token already in use.
    pub changed: bool,
}

/// `POST /v1/deadline` body, and its answer (the value stored): the guest's hard deadline in
/// Unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PowerOffAt {
    /// When the guest powers itself off, in seconds since the Unix epoch (UTC).
    pub power_off_at: i64,
}

impl PowerOffAt {
    /// Checks the bounds against `now_unix` (the checker's clock): not before
    /// [`MIN_POWER_OFF_AT`], not after `now_unix` + [`MAX_POWER_OFF_AHEAD_SECS`]. The error
    /// is a sentence for humans.
    pub fn check(&self, now_unix: i64) -> Result<(), String> {
        let latest = now_unix.saturating_add(MAX_POWER_OFF_AHEAD_SECS);
        if self.power_off_at < MIN_POWER_OFF_AT {
            Err(format!(
                "power_off_at must be a Unix time in seconds, not before {MIN_POWER_OFF_AT} (2020-01-01), got {}",
                self.power_off_at
            ))
        } else if self.power_off_at > latest {
            Err(format!(
                "power_off_at must be at most 400 days ahead (at most {latest}), got {}",
                self.power_off_at
            ))
        } else {
            Ok(())
        }
    }
}

/// Error body for every non-2xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// Machine-readable code (`unauthorized`, `bad_request`, `too_large`, `busy`, …).
    pub error: String,
    /// A sentence for humans.
    pub message: String,
}

/// Command line of the agent binary, as cloud-init's unit and kube-sim's simulated guest start
/// it: `ttlab-agent [--root DIR] [--listen ADDR:PORT]`. `--root` maps every absolute path
/// above under DIR (for unprivileged tests); `--listen` defaults to `0.0.0.0:8899`.
pub const CLI_USAGE: &str = "ttlab-agent [--root DIR] [--listen ADDR:PORT]";

/// The agent prints exactly one line to standard output once it is listening:
/// this prefix followed by the bound `ADDR:PORT` (so callers that pass port 0 learn the port
/// without racing).
pub const LISTENING_PREFIX: &str = "ttlab-agent listening on ";

/// Oldest glibc the dynamically linked agent starts on (Ubuntu 22.04+, Debian 12+, RHEL 9+).
/// On an older guest the dynamic loader refuses to start it with
/// ``version `GLIBC_2.34' not found``.
pub const MIN_GLIBC: &str = "2.34";

/// Largest request body the agent reads; a longer `Content-Length` gets 413 unread.
pub const MAX_REQUEST_BODY_BYTES: usize = 64 * 1024;

/// Largest request head (request line and headers) the agent reads; more gets 431.
pub const MAX_REQUEST_HEAD_BYTES: usize = 16 * 1024;

/// Most request headers the agent accepts; more gets 431.
pub const MAX_REQUEST_HEADERS: usize = 32;

/// Bytes of standard output (and, separately, of standard error) kept per command; the rest is
/// read and discarded, and the matching `*_truncated` flag is set.
pub const MAX_OUTPUT_BYTES: usize = 256 * 1024;

/// Longest `timeout_ms` an exec request may ask for (one hour); 0 or more gets 400.
pub const MAX_EXEC_TIMEOUT_MS: u64 = 60 * 60 * 1000;

/// Requests the agent serves at once; one more gets 503 with the code [`error_code::BUSY`].
pub const MAX_CONCURRENT_REQUESTS: usize = 4;

/// The `error` values of [`ErrorResponse`].
pub mod error_code {
    /// 401: missing, malformed or wrong bearer token.
    pub const UNAUTHORIZED: &str = "unauthorized";
    /// 503: the token file is missing or invalid, so no request can be authenticated yet.
    pub const TOKEN_UNAVAILABLE: &str = "token_unavailable";
    /// 503: the agent is serving [`super::MAX_CONCURRENT_REQUESTS`] requests already.
    pub const BUSY: &str = "busy";
    /// 400: malformed HTTP or an invalid JSON body.
    pub const BAD_REQUEST: &str = "bad_request";
    /// 409: a token rotation found the token already rotated to another one by a concurrent
    /// request, so the token it presented is no longer valid.
    pub const CONFLICT: &str = "conflict";
    /// 404: no such path.
    pub const NOT_FOUND: &str = "not_found";
    /// 405: the path exists but not with this method.
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    /// 408: the request did not arrive in time.
    pub const TIMEOUT: &str = "timeout";
    /// 411: a body without `Content-Length` (chunked bodies are refused).
    pub const LENGTH_REQUIRED: &str = "length_required";
    /// 413: the body is larger than [`super::MAX_REQUEST_BODY_BYTES`].
    pub const TOO_LARGE: &str = "too_large";
    /// 431: too many or too large headers.
    pub const HEADERS_TOO_LARGE: &str = "headers_too_large";
    /// 500: the agent could not run the command (for example `/bin/sh` is missing), could
    /// not set the console's size (no such device, or not a terminal), or could not store a
    /// new token or deadline (the previous one stays in force, its file untouched).
    pub const INTERNAL: &str = "internal";
}

/// The per-VM bearer token: 256 random bits as 64 lowercase hex digits.
///
/// It is a secret: `Debug` redacts it and it has no `Display`; only [`AgentToken::reveal`]
/// gives the text (for the `Authorization` header and the cloud-init file).
#[derive(Clone, PartialEq, Eq)]
pub struct AgentToken(String);

impl AgentToken {
    /// Number of random bytes in a token.
    pub const BYTES: usize = 32;

    /// A token from random bytes the caller generated (with a CSPRNG).
    pub fn from_random_bytes(bytes: [u8; Self::BYTES]) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(Self::BYTES * 2);
        for b in bytes {
            s.push(HEX[usize::from(b >> 4)] as char);
            s.push(HEX[usize::from(b & 0x0f)] as char);
        }
        Self(s)
    }

    /// Parses a token as written in the token file (surrounding whitespace ignored). `None`
    /// unless it is exactly 64 lowercase hex digits.
    pub fn parse(text: &str) -> Option<Self> {
        let t = text.trim();
        (t.len() == Self::BYTES * 2 && t.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| Self(t.to_owned()))
    }

    /// The secret text. Never log it.
    pub fn reveal(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for AgentToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AgentToken(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_hex_redacted_and_parse_back() {
        let t = AgentToken::from_random_bytes([0xab; 32]);
        assert_eq!(t.reveal().len(), 64);
        assert_eq!(format!("{t:?}"), "AgentToken(<redacted>)");
        assert_eq!(AgentToken::parse(&format!("  {}\n", t.reveal())), Some(t));
        assert_eq!(AgentToken::parse("abc"), None);
        assert_eq!(AgentToken::parse(&"G".repeat(64)), None);
        assert_eq!(AgentToken::parse(&"A".repeat(64)), None);
    }

    #[test]
    fn rotation_bodies_redact_the_token() {
        let t = AgentToken::from_random_bytes([0xcd; 32]);
        let body = RotateTokenRequest::new(&t);
        assert!(!format!("{body:?}").contains(t.reveal()));
        assert_eq!(
            serde_json::to_string(&body).unwrap(),
            format!(r#"{{"token":"{}"}}"#, t.reveal())
        );
    }

    #[test]
    fn deadlines_are_bounded_by_2020_and_400_days_ahead() {
        let now = 1_800_000_000;
        let at = |power_off_at| PowerOffAt { power_off_at };
        assert!(at(MIN_POWER_OFF_AT).check(now).is_ok());
        assert!(at(now + MAX_POWER_OFF_AHEAD_SECS).check(now).is_ok());
        let early = at(MIN_POWER_OFF_AT - 1).check(now).unwrap_err();
        assert!(early.contains("2020"), "{early}");
        let late = at(now + MAX_POWER_OFF_AHEAD_SECS + 1)
            .check(now)
            .unwrap_err();
        assert!(late.contains("400 days"), "{late}");
        assert!(at(i64::MAX).check(i64::MAX).is_ok());
        assert!(at(-1).check(now).is_err());
    }
}
