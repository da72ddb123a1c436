//! The VM side of a console: the VMI's serial console (VM labs) or a login shell in the pod
//! (pod labs), over the `Cluster` trait, with KubeVirt's answers turned into what the relay
//! decides on.

use std::sync::Arc;
use std::time::Duration;

use ttlab_cluster::{ByteSink, ByteStream, Cluster, ClusterError, Kind, VmiPhase};
use ttlab_console::{CloseReason, Connected, ConsoleError, Upstream};
use ttlab_model::SessionId;

use crate::AppState;

/// Asks the pod whether it has bash (exit status 0 if so).
const HAS_BASH: &str = "command -v bash >/dev/null 2>&1";
/// How long that question may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The VMI's serial console.
pub(super) struct VmConsole {
    pub(super) state: AppState,
    pub(super) session: SessionId,
    pub(super) cluster: Arc<dyn Cluster>,
    pub(super) vm: String,
}

/// A shell in the pod: a login shell, bash if the image has it, else sh. Which one is asked
/// once (a short exec without a TTY) and kept for reconnections; the interactive shell is
/// then exec'd directly rather than through a `sh -c` script.
pub(super) struct PodShell {
    pub(super) state: AppState,
    pub(super) session: SessionId,
    pub(super) cluster: Arc<dyn Cluster>,
    pub(super) pod: String,
    pub(super) shell: Option<&'static str>,
}

impl PodShell {
    async fn shell(&mut self) -> Result<&'static str, ClusterError> {
        if let Some(shell) = self.shell {
            return Ok(shell);
        }
        let probe = vec!["sh".to_owned(), "-c".to_owned(), HAS_BASH.to_owned()];
        let answer = self
            .cluster
            .exec_pod_command(&self.pod, None, probe, PROBE_TIMEOUT)
            .await?;
        let shell = if answer.exit_code == Some(0) {
            "bash"
        } else {
            "sh"
        };
        self.shell = Some(shell);
        Ok(shell)
    }
}

/// Why the session's console ended, if the session itself says so (finished, expired…):
/// finishing a session deletes its VM, which closes the console before the change is heard of.
async fn session_says(state: &AppState, session: SessionId) -> Option<CloseReason> {
    match state.store().sessions().get(session).await {
        Ok(Some(row)) => super::reason_of(&row),
        Ok(None) => Some(CloseReason::Finished),
        Err(_) => None,
    }
}

impl Upstream for VmConsole {
    type Input = ByteSink;
    type Output = ByteStream;
    type Error = ClusterError;

    fn connect(&mut self) -> Connected<'_, Self> {
        Box::pin(async move {
            match self.cluster.open_console(&self.vm).await {
                Ok(terminal) => Ok((terminal.input, terminal.output)),
                Err(e) => Err(console_error(e)),
            }
        })
    }

    fn ended(&mut self, detail: String) -> futures::future::BoxFuture<'_, CloseReason> {
        Box::pin(async move {
            if let Some(reason) = session_says(&self.state, self.session).await {
                return reason;
            }
            match self.cluster.vmi_state(&self.vm).await {
                Ok(None) => CloseReason::VmStopped,
                Ok(Some(s))
                    if s.deleting || matches!(s.phase, VmiPhase::Succeeded | VmiPhase::Failed) =>
                {
                    CloseReason::VmStopped
                }
                _ => CloseReason::ConsoleLost(detail),
            }
        })
    }
}

impl Upstream for PodShell {
    type Input = ByteSink;
    type Output = ByteStream;
    type Error = ClusterError;

    fn connect(&mut self) -> Connected<'_, Self> {
        Box::pin(async move {
            let shell = self.shell().await.map_err(console_error)?;
            let command = vec![shell.to_owned(), "-l".to_owned()];
            match self.cluster.exec_pod(&self.pod, None, command).await {
                Ok(terminal) => Ok((terminal.input, terminal.output)),
                Err(e) => Err(console_error(e)),
            }
        })
    }

    fn ended(&mut self, detail: String) -> futures::future::BoxFuture<'_, CloseReason> {
        Box::pin(async move {
            if let Some(reason) = session_says(&self.state, self.session).await {
                return reason;
            }
            match self.cluster.get(Kind::Pod, &self.pod).await {
                Ok(None) => CloseReason::VmStopped,
                _ => CloseReason::ConsoleLost(format!("the shell ended ({detail})")),
            }
        })
    }
}

/// What the relay should do about a failed attempt to open a console.
fn console_error(e: ClusterError) -> ConsoleError {
    match e {
        ClusterError::ConsoleNotReady { message, .. } => ConsoleError::NotReady {
            message: waiting_for(&message),
        },
        ClusterError::Transient { .. } => ConsoleError::NotReady {
            message: "the cluster is not answering; trying again".to_owned(),
        },
        ClusterError::Conflict { message } | ClusterError::NotFound { message } => {
            ConsoleError::Stopped { message }
        }
        other => ConsoleError::Unavailable {
            message: other.to_string(),
        },
    }
}

/// KubeVirt's "… because phase is Scheduling instead of Running" as "the VM is Scheduling".
fn waiting_for(message: &str) -> String {
    let phase = message
        .split("phase is ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .filter(|p| p.chars().all(|c| c.is_ascii_alphabetic()) && !p.is_empty());
    match phase {
        Some(phase) => format!("the VM is {phase}, not yet Running"),
        None => "the VM is starting".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubevirt_refusals_become_what_the_student_waits_for() {
        assert_eq!(
            waiting_for(
                "Internal error occurred: dialing virt-handler: Unable to connect to \
                 VirtualMachineInstance because phase is Scheduling instead of Running"
            ),
            "the VM is Scheduling, not yet Running"
        );
        assert_eq!(waiting_for("something else"), "the VM is starting");
        assert!(matches!(
            console_error(ClusterError::Conflict {
                message: "phase is Failed".into()
            }),
            ConsoleError::Stopped { .. }
        ));
        assert!(matches!(
            console_error(ClusterError::Forbidden {
                message: "no".into()
            }),
            ConsoleError::Unavailable { .. }
        ));
    }
}
