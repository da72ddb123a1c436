//! The VM side of a console: the VMI's serial console (VM labs) or a login shell in the pod
//! (pod labs), over the cluster's `ConsoleCluster` part, with KubeVirt's answers turned into what the relay
//! decides on. The page's terminal size reaches a VM through its agent (`POST
//! /v1/console-size`: the serial console has no resize channel) and a pod through the exec's
//! resize channel.

use std::sync::Arc;
use std::time::Duration;

use futures::SinkExt as _;
use ttlab_agent::AgentClient;
use ttlab_agent::protocol::ConsoleSize;
use ttlab_cluster::{
    ByteSink, ByteStream, ClusterError, ConsoleCluster, ResizeSink, TtySize, VmStatus, VmiPhase,
    VmiState,
};
use ttlab_console::{CloseReason, Connected, ConsoleError, TermSize, Upstream};
use ttlab_model::{NodeName, SessionId};

use crate::agent_route::{NoAgent, agent_client};
use crate::sites::SiteRuntime;
use crate::{AppState, saga};

/// Asks the pod whether it has bash (exit status 0 if so).
const HAS_BASH: &str = "command -v bash >/dev/null 2>&1";
/// How long that question may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long setting the console's size through the agent may take.
const RESIZE_TIMEOUT: Duration = Duration::from_secs(3);

/// A size the agent could not take yet (the console opens when the VMI runs, while the guest
/// still boots and its agent does not answer) is tried again this often, for this long.
const RESIZE_RETRY_EVERY: Duration = Duration::from_secs(1);
const RESIZE_RETRY_FOR: Duration = Duration::from_secs(600);

/// The VMI's serial console.
pub(super) struct VmConsole {
    pub(super) state: AppState,
    pub(super) session: SessionId,
    /// The session's site (its agents are reached as the site says).
    pub(super) site: Arc<SiteRuntime>,
    pub(super) cluster: Arc<dyn ConsoleCluster>,
    pub(super) vm: String,
    /// The lab node the VM is (its agent's token is the node's).
    pub(super) node: String,
    /// The VM's agent, once found (its address and token do not change while the VM runs).
    pub(super) agent: Option<AgentClient>,
    /// The last size, still being tried in the background because the agent did not take it.
    pub(super) resizing: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for VmConsole {
    fn drop(&mut self) {
        if let Some(task) = self.resizing.take() {
            task.abort();
        }
    }
}

/// A client of the agent of `vm` (node `node` of `session`), reached as its site's agent
/// path says, with the node's stored token.
async fn agent_of(
    state: &AppState,
    site: &SiteRuntime,
    session: SessionId,
    vm: &str,
    node: &str,
) -> Result<AgentClient, String> {
    let node: NodeName = node.parse().map_err(|_| format!("no node {node:?}"))?;
    let token = saga::agent_token(state, session, &node)
        .await
        .map_err(|e| e.to_string())?;
    let client = agent_client(state, site, vm, None, token)
        .await
        .map_err(|e| match e {
            NoAgent::NoAddress => format!("{vm} has no address yet"),
            e => e.to_string(),
        })?;
    Ok(client.with_timeouts(RESIZE_TIMEOUT, RESIZE_TIMEOUT))
}

impl VmConsole {
    async fn agent(&mut self) -> Result<&AgentClient, String> {
        if self.agent.is_none() {
            let client =
                agent_of(&self.state, &self.site, self.session, &self.vm, &self.node).await?;
            self.agent = Some(client);
        }
        self.agent
            .as_ref()
            .ok_or_else(|| "no agent client".to_owned())
    }

    /// Keeps trying `wanted` in the background until the agent takes it (a guest still
    /// booting, or restarted with another address), for [`RESIZE_RETRY_FOR`] at most; a newer
    /// size replaces it.
    fn retry_resize(&mut self, wanted: ConsoleSize) {
        let (state, site, session) = (self.state.clone(), self.site.clone(), self.session);
        let (vm, node) = (self.vm.clone(), self.node.clone());
        self.resizing = Some(tokio::spawn(async move {
            let until = tokio::time::Instant::now() + RESIZE_RETRY_FOR;
            while tokio::time::Instant::now() < until {
                tokio::time::sleep(RESIZE_RETRY_EVERY).await;
                let Ok(agent) = agent_of(&state, &site, session, &vm, &node).await else {
                    continue;
                };
                if agent.set_console_size(wanted).await.is_ok() {
                    tracing::debug!(%session, rows = wanted.rows, cols = wanted.cols, "console resized once the agent answered");
                    return;
                }
            }
            tracing::info!(%session, "the console's size never reached the guest");
        }));
    }
}

/// A shell in the pod: a login shell, bash if the image has it, else sh. Which one is asked
/// once (a short exec without a TTY) and kept for reconnections; the interactive shell is
/// then exec'd directly rather than through a `sh -c` script.
pub(super) struct PodShell {
    pub(super) state: AppState,
    pub(super) session: SessionId,
    pub(super) cluster: Arc<dyn ConsoleCluster>,
    pub(super) pod: String,
    pub(super) shell: Option<&'static str>,
    /// The resize channel of the open exec.
    pub(super) resize: Option<ResizeSink>,
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

/// How long a console that ended while its VMI still reads running waits for the VMI to say
/// why (within the relay's `close_timeout`, two seconds): long enough for KubeVirt to record a
/// guest's power-off or crash, short enough that a merely lost connection is reopened soon.
const VMI_END_SETTLES: Duration = Duration::from_millis(1200);

/// How often the VMI is looked at meanwhile.
const VMI_END_POLL: Duration = Duration::from_millis(200);

/// What the cluster says of a VM whose console refused to open or ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VmSeen {
    /// Its VMI exists and has not ended: the VM runs.
    Runs,
    /// Its VMI crashed, is being replaced or is absent, and the VM is meant to run (the run
    /// strategy restarts a crashed guest).
    Restarting,
    /// The guest powered itself off (the run strategy leaves it off), or the VM is stopped,
    /// gone or being deleted.
    Stopped,
    /// The cluster could not be asked.
    Unknown,
}

async fn look_at_vm(cluster: &dyn ConsoleCluster, vm: &str) -> VmSeen {
    let vmi = match cluster.vmi_state(vm).await {
        Ok(vmi) => vmi,
        Err(_) => return VmSeen::Unknown,
    };
    if let Some(seen) = vmi.as_ref().and_then(seen_from_vmi) {
        return seen;
    }
    match cluster.vm_status(vm).await {
        Ok(status) => seen_from_vm(vmi.as_ref(), status.as_ref()),
        Err(_) => VmSeen::Unknown,
    }
}

/// What a VMI alone says, when it says enough. A console is opened on a session that was
/// running: a VMI not running yet is the next one, starting.
fn seen_from_vmi(vmi: &VmiState) -> Option<VmSeen> {
    match &vmi.phase {
        _ if vmi.deleting => None,
        VmiPhase::Running => Some(VmSeen::Runs),
        phase if phase.is_final() => None,
        _ => Some(VmSeen::Restarting),
    }
}

/// What the VM's status says of a VM whose VMI ended, is being deleted or is absent.
fn seen_from_vm(vmi: Option<&VmiState>, status: Option<&VmStatus>) -> VmSeen {
    let Some(status) = status else {
        return VmSeen::Stopped;
    };
    match vmi {
        // An ended VMI stays until KubeVirt's VM controller acts on it, and the VM reads
        // `Stopped` meanwhile: the run strategy says whether a new one follows (a crash
        // restarts under `RerunOnFailure`, a guest power-off does not).
        Some(v) if v.phase.is_final() => {
            if status.restarts_after(&v.phase) {
                VmSeen::Restarting
            } else {
                VmSeen::Stopped
            }
        }
        _ if status.stopped_for_good() => VmSeen::Stopped,
        _ => VmSeen::Restarting,
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
                // KubeVirt's console answers 404 (or 409) not only for a VM that is gone: also
                // while the console subresource is not served, or the VMI is being replaced.
                // The VM itself says which.
                Err(e @ (ClusterError::NotFound { .. } | ClusterError::Conflict { .. })) => Err(
                    refused_console(look_at_vm(self.cluster.as_ref(), &self.vm).await, e),
                ),
                Err(e) => Err(console_error(e)),
            }
        })
    }

    fn ended(&mut self, detail: String) -> futures::future::BoxFuture<'_, CloseReason> {
        Box::pin(async move {
            // The serial console closes as the guest's qemu exits, a moment before KubeVirt
            // records the VMI's end: a VMI still running is looked at again for a while.
            let settled = tokio::time::Instant::now() + VMI_END_SETTLES;
            loop {
                if let Some(reason) = session_says(&self.state, self.session).await {
                    return reason;
                }
                let seen = look_at_vm(self.cluster.as_ref(), &self.vm).await;
                if seen == VmSeen::Runs && tokio::time::Instant::now() < settled {
                    tokio::time::sleep(VMI_END_POLL).await;
                    continue;
                }
                return match seen {
                    VmSeen::Stopped => CloseReason::VmStopped,
                    VmSeen::Restarting => {
                        CloseReason::ConsoleLost("the VM is restarting".to_owned())
                    }
                    VmSeen::Runs | VmSeen::Unknown => CloseReason::ConsoleLost(detail),
                };
            }
        })
    }

    fn resize(&mut self, size: TermSize) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(task) = self.resizing.take() {
                task.abort();
            }
            let session = self.session;
            let wanted = ConsoleSize {
                rows: size.rows,
                cols: size.cols,
            };
            let result = match self.agent().await {
                Ok(agent) => agent
                    .set_console_size(wanted)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e),
            };
            match result {
                Ok(_) => {
                    tracing::debug!(%session, rows = size.rows, cols = size.cols, "console resized")
                }
                Err(e) => {
                    // A restarted VM may have another address: look it up again next time.
                    self.agent = None;
                    tracing::info!(%session, error = %e, "the console's size could not be set in the guest yet; trying again");
                    self.retry_resize(wanted);
                }
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
                Ok(terminal) => {
                    self.resize = terminal.resize;
                    Ok((terminal.input, terminal.output))
                }
                Err(e) => Err(console_error(e)),
            }
        })
    }

    fn ended(&mut self, detail: String) -> futures::future::BoxFuture<'_, CloseReason> {
        Box::pin(async move {
            if let Some(reason) = session_says(&self.state, self.session).await {
                return reason;
            }
            match self.cluster.pod_state(&self.pod).await {
                Ok(None) => CloseReason::VmStopped,
                Ok(Some(pod)) if pod.deleting => CloseReason::VmStopped,
                _ => CloseReason::ConsoleLost(format!("the shell ended ({detail})")),
            }
        })
    }

    fn resize(&mut self, size: TermSize) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            let Some(channel) = self.resize.as_mut() else {
                return;
            };
            let size = TtySize {
                cols: size.cols,
                rows: size.rows,
            };
            if let Err(e) = channel.send(size).await {
                tracing::debug!(session = %self.session, error = %e, "the shell's TTY could not be resized");
                self.resize = None;
            }
        })
    }
}

/// What the relay should do about a console that answered 404 or 409, given what the VM
/// says: wait while it runs or restarts, stop only when it has stopped.
fn refused_console(seen: VmSeen, e: ClusterError) -> ConsoleError {
    match seen {
        VmSeen::Runs => ConsoleError::NotReady {
            message: "the VM is running, but its console is not available right now; retrying"
                .to_owned(),
        },
        VmSeen::Restarting => ConsoleError::NotReady {
            message: "the VM is restarting".to_owned(),
        },
        VmSeen::Unknown => ConsoleError::NotReady {
            message: "the console is not available right now; retrying".to_owned(),
        },
        VmSeen::Stopped => console_error(e),
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

    #[test]
    fn a_console_refused_with_404_is_waited_for_unless_the_vm_has_stopped() {
        let gone = || ClusterError::NotFound {
            message: "virtualmachineinstances.kubevirt.io \"tt-1\" not found".into(),
        };
        for seen in [VmSeen::Runs, VmSeen::Restarting, VmSeen::Unknown] {
            assert!(
                matches!(refused_console(seen, gone()), ConsoleError::NotReady { .. }),
                "{seen:?}"
            );
        }
        assert!(matches!(
            refused_console(VmSeen::Stopped, gone()),
            ConsoleError::Stopped { .. }
        ));
    }

    fn vmi(phase: VmiPhase, deleting: bool) -> VmiState {
        VmiState {
            name: "tt-1-vm".into(),
            phase,
            conditions: Vec::new(),
            ip: None,
            node: None,
            deleting,
        }
    }

    fn vm(printable: &str, start_requested: bool) -> VmStatus {
        VmStatus {
            name: "tt-1-vm".into(),
            printable_status: Some(printable.into()),
            run_strategy: Some(ttlab_vm_manifest::RUN_STRATEGY),
            start_requested,
            deleting: false,
        }
    }

    /// What each moment of a crash and of a power-off looks like, as KubeVirt shows it.
    fn seen(vmi: Option<VmiState>, status: Option<VmStatus>) -> VmSeen {
        vmi.as_ref()
            .and_then(seen_from_vmi)
            .unwrap_or_else(|| seen_from_vm(vmi.as_ref(), status.as_ref()))
    }

    #[test]
    fn a_crashed_guest_reads_restarting_at_every_step_of_its_replacement() {
        let stopped = || Some(vm("Stopped", false));
        // The VMI ended Failed; the VM already reads Stopped, not yet acted on.
        assert_eq!(
            seen(Some(vmi(VmiPhase::Failed, false)), stopped()),
            VmSeen::Restarting
        );
        // Being deleted by the VM controller.
        assert_eq!(
            seen(Some(vmi(VmiPhase::Failed, true)), stopped()),
            VmSeen::Restarting
        );
        // Gone, with the start request the controller left for the next one.
        assert_eq!(seen(None, Some(vm("Stopped", true))), VmSeen::Restarting);
        // The next one, not running yet.
        assert_eq!(
            seen(
                Some(vmi(VmiPhase::Scheduled, false)),
                Some(vm("Starting", false))
            ),
            VmSeen::Restarting
        );
        assert_eq!(
            seen(
                Some(vmi(VmiPhase::Running, false)),
                Some(vm("Running", false))
            ),
            VmSeen::Runs
        );
    }

    #[test]
    fn a_guest_that_powered_off_reads_stopped_at_every_step() {
        let stopped = || Some(vm("Stopped", false));
        assert_eq!(
            seen(Some(vmi(VmiPhase::Succeeded, false)), stopped()),
            VmSeen::Stopped
        );
        assert_eq!(
            seen(Some(vmi(VmiPhase::Succeeded, true)), stopped()),
            VmSeen::Stopped
        );
        assert_eq!(seen(None, stopped()), VmSeen::Stopped);
        // The VM itself gone or being deleted.
        assert_eq!(seen(None, None), VmSeen::Stopped);
        let mut deleting = vm("Running", false);
        deleting.deleting = true;
        assert_eq!(
            seen(Some(vmi(VmiPhase::Failed, true)), Some(deleting)),
            VmSeen::Stopped
        );
    }
}
