//! The agent's shared ConfigMap (`ttlab-agent-<digest prefix>`): recorded in the database as
//! this server's version, and made sure of at start-up and before a session's VMs are
//! created, so that no VM is ever created referencing a ConfigMap that is not there.
//!
//! The check is cheap: once found present it is trusted for [`AGENT_RECHECK`] (far shorter
//! than the reaper's minimum age, within which the recorded sighting keeps the reaper away),
//! and checked again after that or after a failure. The sighting is recorded before every
//! check and on [`AGENT_HEARTBEAT`] while the server runs (the `agent_keeper` task,
//! [`crate::tasks`]).

use std::time::Duration;

use ttlab_cluster::{ClusterError, Ensured};

use crate::AppState;

/// How long a ConfigMap found present is trusted without asking the API server again.
pub const AGENT_RECHECK: Duration = Duration::from_secs(60);
/// How often a running server records its agent version as seen.
pub const AGENT_HEARTBEAT: Duration = Duration::from_secs(5 * 60);

/// Records this server's agent version as seen (database clock).
pub async fn record_agent_seen(state: &AppState) -> Result<(), ttlab_store::StoreError> {
    let agent = &state.config().agent;
    state
        .store()
        .agent_versions()
        .seen(
            &state.config().env,
            &agent.config_map_name(),
            agent.digest(),
        )
        .await
}

/// Makes sure the agent's ConfigMap exists, unless it was found present less than
/// [`AGENT_RECHECK`] ago (`Ok(None)`: the recent finding was trusted). Record the version as
/// seen ([`record_agent_seen`]) first.
pub async fn ensure_agent_config_map(state: &AppState) -> Result<Option<Ensured>, ClusterError> {
    let mut present = state.agent_present_at().lock().await;
    if present.is_some_and(|at| at.elapsed() < AGENT_RECHECK) {
        return Ok(None);
    }
    *present = None;
    let agent = &state.config().agent;
    let ensured = state
        .cluster()
        .ensure_config_map(agent.config_map(&state.config().env))
        .await?;
    if ensured == Ensured::Created {
        tracing::info!(
            config_map = %agent.config_map_name(),
            sha256 = agent.digest(),
            bytes = agent.config_map_size_bytes(),
            "created the agent ConfigMap of this version"
        );
    }
    *present = Some(tokio::time::Instant::now());
    Ok(Some(ensured))
}

/// Forgets that the ConfigMap was present (a VM referencing it did not start): the next
/// [`ensure_agent_config_map`] asks the API server again.
pub(crate) async fn distrust_agent(state: &AppState) {
    *state.agent_present_at().lock().await = None;
}
