//! Guest agent tokens: a fresh one per VM, 32 bytes from the operating system's CSPRNG,
//! stored in the database (`agent_tokens`) before the VM's cloud-init Secret carries it, so
//! every replica — and this server after a restart — can reach the agent. Tokens are never
//! logged and never shown by the API.

use ttlab_agent::protocol::AgentToken;
use ttlab_model::{NodeName, SessionId};
use ttlab_store::Session;

use super::{Failure, Stop, with_db};
use crate::{ApiError, AppState};

/// A new token from the operating system's CSPRNG.
pub(crate) fn fresh() -> Result<AgentToken, ApiError> {
    let mut bytes = [0u8; AgentToken::BYTES];
    getrandom::fill(&mut bytes).map_err(|e| {
        ApiError::Internal(format!("the operating system's random source failed: {e}"))
    })?;
    Ok(AgentToken::from_random_bytes(bytes))
}

/// The stored token of `node`'s agent in `session`.
pub(crate) async fn stored(
    state: &AppState,
    session: SessionId,
    node: &NodeName,
) -> Result<AgentToken, ApiError> {
    let text = state
        .store()
        .agent_tokens()
        .get(session, node)
        .await?
        .ok_or_else(|| {
            ApiError::AgentUnavailable(format!(
                "no agent token is stored for node {node} of this session"
            ))
        })?;
    AgentToken::parse(&text).ok_or_else(|| {
        ApiError::Internal(format!(
            "the stored agent token of node {node} is malformed"
        ))
    })
}

/// The agent tokens of a session being provisioned, one per node in `nodes`' order: those
/// already stored when every node has one (a session resumed after its provisioner stopped:
/// its Secrets may carry them already, and a Secret found in place is adopted, not
/// rewritten), else fresh ones.
pub(crate) async fn for_nodes(
    state: &AppState,
    session: &Session,
    nodes: &[NodeName],
) -> Result<Vec<AgentToken>, Stop> {
    let mut stored = Vec::with_capacity(nodes.len());
    for node in nodes {
        let token =
            with_db(|| async { state.store().agent_tokens().get(session.id, node).await }).await?;
        match token.as_deref().and_then(AgentToken::parse) {
            Some(t) => stored.push(t),
            None => break,
        }
    }
    if stored.len() == nodes.len() {
        return Ok(stored);
    }
    nodes
        .iter()
        .map(|_| fresh())
        .collect::<Result<_, _>>()
        .map_err(|e| Failure::Tokens(e.to_string()).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_tokens_differ_and_are_256_bits_of_hex() {
        let tokens: std::collections::BTreeSet<String> = (0..64)
            .map(|_| fresh().unwrap().reveal().to_owned())
            .collect();
        assert_eq!(tokens.len(), 64);
        for t in &tokens {
            assert!(AgentToken::parse(t).is_some(), "{t}");
        }
    }
}
