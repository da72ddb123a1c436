//! Where the agent finds its token, markers and moved deadline, with the `--root DIR` mapping for tests.

use std::path::{Path, PathBuf};

use crate::protocol;

/// The files the agent reads, and the directory commands run in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentPaths {
    /// The bearer token file ([`protocol::TOKEN_PATH`]).
    pub token: PathBuf,
    /// The readiness marker ([`protocol::READY_MARKER_PATH`]).
    pub ready_marker: PathBuf,
    /// The setup failure marker ([`protocol::FAILED_MARKER_PATH`]).
    pub failed_marker: PathBuf,
    /// A hard deadline moved by `POST /v1/deadline` ([`protocol::POWER_OFF_AT_PATH`]).
    pub power_off_at: PathBuf,
    /// Working directory of executed commands (`/`, or DIR under `--root`).
    pub workdir: PathBuf,
    /// The serial console ([`protocol::CONSOLE_TTY_PATH`]).
    pub console: PathBuf,
    /// Under `--root` there is no console device: a simulated guest's console reads the size
    /// the agent writes, as text `ROWS COLS`, to [`AgentPaths::console`].
    pub simulated: bool,
}

impl AgentPaths {
    /// The protocol's absolute paths, each mapped under `root` when given (`--root DIR`):
    /// `/etc/ttlab/agent.token` becomes `DIR/etc/ttlab/agent.token`.
    pub fn under(root: Option<&Path>) -> Self {
        let map = |absolute: &str| match root {
            Some(root) => root.join(absolute.trim_start_matches('/')),
            None => PathBuf::from(absolute),
        };
        Self {
            token: map(protocol::TOKEN_PATH),
            ready_marker: map(protocol::READY_MARKER_PATH),
            failed_marker: map(protocol::FAILED_MARKER_PATH),
            power_off_at: map(protocol::POWER_OFF_AT_PATH),
            workdir: root.map_or_else(|| PathBuf::from("/"), Path::to_path_buf),
            console: map(protocol::CONSOLE_TTY_PATH),
            simulated: root.is_some(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_the_protocol_ones_or_mapped_under_root() {
        let real = AgentPaths::under(None);
        assert_eq!(real.token, Path::new(protocol::TOKEN_PATH));
        assert_eq!(real.ready_marker, Path::new(protocol::READY_MARKER_PATH));
        assert_eq!(real.power_off_at, Path::new("/etc/ttlab/power-off-at"));
        assert_eq!(real.workdir, Path::new("/"));
        assert_eq!(real.console, Path::new("/dev/ttyS0"));
        assert!(!real.simulated);

        let mapped = AgentPaths::under(Some(Path::new("/tmp/x")));
        assert_eq!(mapped.token, Path::new("/tmp/x/etc/ttlab/agent.token"));
        assert_eq!(mapped.ready_marker, Path::new("/tmp/x/var/lib/ttlab/ready"));
        assert_eq!(
            mapped.failed_marker,
            Path::new("/tmp/x/var/lib/ttlab/failed")
        );
        assert_eq!(
            mapped.power_off_at,
            Path::new("/tmp/x/etc/ttlab/power-off-at")
        );
        assert_eq!(mapped.workdir, Path::new("/tmp/x"));
        assert_eq!(mapped.console, Path::new("/tmp/x/dev/ttyS0"));
        assert!(mapped.simulated);
    }
}
