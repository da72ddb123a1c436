//! The agent's shared ConfigMap (`ttlab-agent-<digest prefix>`): recorded in the database as
//! this server's version, and made sure of at start-up and right before each VM that mounts
//! it is created, so that no VM is ever created referencing a ConfigMap that is not there (a
//! VM whose agent disk is missing never starts: its launcher waits for the volume for ever).
//!
//! Before each VM create attempt the version is recorded as seen (under the version's lock in
//! the database, which the reaper takes to remove a version) and the ConfigMap is asked for —
//! one metadata `get`, and a `create` when it is absent — never trusted from an earlier
//! finding: an operator, or a reaper whose minimum age is short, may have removed it a moment
//! ago. The sighting is also recorded on [`AGENT_HEARTBEAT`] while the server runs (the
//! `agent_keeper` task, [`crate::tasks`]).

use std::time::Duration;

use ttlab_cluster::{ClusterError, Ensured};

use crate::AppState;
use crate::sites::SiteRuntime;

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

/// Makes sure the agent's ConfigMap exists on every site: asks each API server, and creates
/// it when it is absent. Record the version as seen ([`record_agent_seen`]) first. Every
/// site is tried; the first failure is the answer (with several sites, naming the site).
pub async fn ensure_agent_config_map(state: &AppState) -> Result<Ensured, ClusterError> {
    let mut answer = Ok(Ensured::Present);
    let several = state.sites().len() > 1;
    for site in state.sites() {
        match ensure_agent_config_map_on(state, site).await {
            Ok(Ensured::Created) if answer.is_ok() => answer = Ok(Ensured::Created),
            Ok(_) => {}
            Err(e) if answer.is_ok() => {
                answer = Err(if several {
                    ClusterError::Transient {
                        message: format!("site {}: {e}", site.name()),
                    }
                } else {
                    e
                });
            }
            Err(e) => {
                tracing::warn!(site = %site.name(), error = %e, "cannot make sure of the agent ConfigMap")
            }
        }
    }
    answer
}

/// [`ensure_agent_config_map`] on one site.
async fn ensure_agent_config_map_on(
    state: &AppState,
    site: &SiteRuntime,
) -> Result<Ensured, ClusterError> {
    let agent = &state.config().agent;
    let ensured = site
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
    Ok(ensured)
}

/// Right before a VM mounting the agent's ConfigMap is created: the version recorded as seen
/// (so the reaper keeps it), then the ConfigMap made sure of. A database that cannot record
/// the sighting is a transient failure of the create (it is tried again).
pub(crate) async fn agent_before_vm(
    state: &AppState,
    site: &SiteRuntime,
) -> Result<(), ClusterError> {
    record_agent_seen(state)
        .await
        .map_err(|e| ClusterError::Transient {
            message: format!("recording the agent version as seen: {e}"),
        })?;
    ensure_agent_config_map_on(state, site).await.map(|_| ())
}
