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
    }
}
