//! `agent_keeper`: at start-up makes sure of this version's agent (its sighting recorded, its
//! ConfigMap present: [`crate::saga::record_agent_seen`],
//! [`crate::saga::ensure_agent_config_map`]), then records the version as seen every
//! [`AGENT_HEARTBEAT`] while the server runs, so the reaper keeps the versions a server saw
//! recently. A failure is never fatal: each session records and checks again.

use ttlab_background::{Activation, BackgroundTask, Failure, Reason, Schedule, TaskName, TaskSpec};

use crate::AppState;
use crate::saga::{AGENT_HEARTBEAT, ensure_agent_config_map, record_agent_seen};

/// The task's name.
pub const NAME: TaskName = TaskName::new("agent_keeper");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Makes sure of this version's agent ConfigMap at start-up, and records the version as \
         seen every 5 min so the reaper keeps it",
        Schedule::every(AGENT_HEARTBEAT),
    )
}

pub(super) struct AgentKeeper {
    pub(super) state: AppState,
}

impl BackgroundTask for AgentKeeper {
    async fn activate(&mut self, cx: &Activation) -> Result<(), Failure> {
        record_agent_seen(&self.state).await.map_err(|e| {
            Failure::new(format!(
                "could not record the agent version as seen (each session records it again): \
                 {e}"
            ))
        })?;
        if cx.reason() == Reason::Start {
            ensure_agent_config_map(&self.state).await.map_err(|e| {
                Failure::new(format!(
                    "could not make sure of the agent ConfigMap at start-up (each session \
                     checks again): {e}"
                ))
            })?;
        }
        Ok(())
    }
}
