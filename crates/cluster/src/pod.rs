//! What the cluster reports about a lab Pod, a command run in it, and the namespace's
//! ResourceQuotas: the values [`ConsoleCluster::pod_state`](crate::ConsoleCluster::pod_state),
//! [`ProvisionCluster::wait_pod_running`](crate::ProvisionCluster::wait_pod_running),
//! [`ConsoleCluster::exec_pod_command`](crate::ConsoleCluster::exec_pod_command) and
//! [`CapacityCluster::resource_quotas`](crate::CapacityCluster::resource_quotas) return.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

/// A Pod's `status.phase`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PodPhase {
    /// Accepted, not all containers running yet (or no phase reported).
    Pending,
    /// Bound to a node and at least one container running.
    Running,
    /// Every container ended successfully; it will not restart.
    Succeeded,
    /// Every container ended and at least one failed (or `activeDeadlineSeconds` passed).
    Failed,
    /// The state could not be obtained.
    Unknown,
    /// A phase this client does not know.
    Other(String),
}

impl PodPhase {
    /// Parses a phase; an empty one is `Pending`.
    pub fn parse(s: &str) -> Self {
        match s {
            "" | "Pending" => Self::Pending,
            "Running" => Self::Running,
            "Succeeded" => Self::Succeeded,
            "Failed" => Self::Failed,
            "Unknown" => Self::Unknown,
            other => Self::Other(other.to_owned()),
        }
    }

    /// The phase as Kubernetes writes it.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::Unknown => "Unknown",
            Self::Other(s) => s,
        }
    }

    /// Whether the Pod has ended for good (`Succeeded` or `Failed`).
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

impl fmt::Display for PodPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Pod's state, as far as a lab needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodState {
    /// The Pod's name.
    pub name: String,
    /// Its phase.
    pub phase: PodPhase,
    /// Whether its `Ready` condition is `True`.
    pub ready: bool,
    /// `status.podIP`, once assigned.
    pub ip: Option<IpAddr>,
    /// Whether its deletion has been requested.
    pub deleting: bool,
    /// `status.reason` (e.g. `DeadlineExceeded`), if any.
    pub reason: Option<String>,
    /// `status.message`, if any.
    pub message: Option<String>,
}

impl PodState {
    /// Whether a student can use it: `Running`, ready and not being deleted.
    pub fn is_usable(&self) -> bool {
        self.phase == PodPhase::Running && self.ready && !self.deleting
    }

    /// One line for messages: `Failed (DeadlineExceeded: …)`, `Running, not ready`.
    pub fn describe(&self) -> String {
        let mut s = self.phase.to_string();
        if self.phase == PodPhase::Running && !self.ready {
            s.push_str(", not ready");
        }
        match (&self.reason, &self.message) {
            (Some(r), Some(m)) => s.push_str(&format!(" ({r}: {m})")),
            (Some(r), None) => s.push_str(&format!(" ({r})")),
            (None, Some(m)) => s.push_str(&format!(" ({m})")),
            (None, None) => {}
        }
        if self.deleting {
            s.push_str(", being deleted");
        }
        s
    }
}

/// How waiting for a Pod to run ended (failures to get any answer are errors instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodWait {
    /// It is `Running` and ready.
    Running(PodState),
    /// It ended (`Succeeded` or `Failed`) before it was usable: it will not run by itself.
    Ended(PodState),
    /// It was not usable within the time given; the last state seen, `None` if the Pod never
    /// appeared.
    TimedOut {
        /// How long the wait lasted.
        waited: Duration,
        /// The last state observed.
        last: Option<PodState>,
    },
}

/// The result of a command run (without a TTY) in a Pod's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// The exit status; `None` if the command did not finish within its timeout.
    pub exit_code: Option<i32>,
    /// Standard output (lossy UTF-8, at most [`EXEC_OUTPUT_LIMIT`] bytes).
    pub stdout: String,
    /// Standard error (lossy UTF-8, at most [`EXEC_OUTPUT_LIMIT`] bytes).
    pub stderr: String,
    /// Whether the command was still running when its timeout passed (it was then abandoned).
    pub timed_out: bool,
    /// How long it ran.
    pub duration: Duration,
}

/// The most bytes kept of each of a command's output streams (the rest is read and dropped).
pub const EXEC_OUTPUT_LIMIT: usize = 256 * 1024;

/// One ResourceQuota of the namespace: what it limits and how much is used, as the API
/// server computed it (`status.hard`, `status.used`; quantities as written, e.g. `48Gi`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaSummary {
    /// The quota's name.
    pub name: String,
    /// Limits by resource (`requests.memory`, `count/virtualmachines.kubevirt.io`, `pods`, …).
    pub hard: BTreeMap<String, String>,
    /// Current usage by resource.
    pub used: BTreeMap<String, String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_parse_and_only_ended_ones_are_final() {
        for p in [
            "Pending",
            "Running",
            "Succeeded",
            "Failed",
            "Unknown",
            "Odd",
        ] {
            assert_eq!(PodPhase::parse(p).as_str(), p);
        }
        assert_eq!(PodPhase::parse(""), PodPhase::Pending);
        assert!(PodPhase::Failed.is_final() && PodPhase::Succeeded.is_final());
        assert!(!PodPhase::Running.is_final() && !PodPhase::Pending.is_final());
    }

    #[test]
    fn a_pod_is_usable_only_running_ready_and_not_deleted() {
        let mut s = PodState {
            name: "p".into(),
            phase: PodPhase::Running,
            ready: true,
            ip: None,
            deleting: false,
            reason: None,
            message: None,
        };
        assert!(s.is_usable());
        s.ready = false;
        assert!(!s.is_usable());
        assert_eq!(s.describe(), "Running, not ready");
        s.phase = PodPhase::Failed;
        s.reason = Some("DeadlineExceeded".into());
        assert_eq!(s.describe(), "Failed (DeadlineExceeded)");
    }
}
