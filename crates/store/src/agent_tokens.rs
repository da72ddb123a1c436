//! The `agent_tokens` table: the guest agent token of every VM of a live session.
//!
//! A token is 32 random bytes from the server's CSPRNG (64 hex digits), one per VM, written
//! into the VM's cloud-init Secret. It cannot be derived again, so the database keeps it for
//! every replica (and a restarted server) to reach the agent for readiness and grading. A
//! trigger deletes a session's tokens the moment its row becomes final.
//!
//! Tokens are secrets: this module never logs them, its errors never contain them (the table
//! has no CHECK constraints, whose violations would quote the row), and no API view shows
//! them. The values come in already typed (a [`NodeName`], a token the caller generated and
//! validated).

use ttlab_model::{NodeName, SessionId, SessionStatus};

use crate::{Store, StoreError};

/// Queries on `agent_tokens`, from [`Store::agent_tokens`].
#[derive(Debug, Clone, Copy)]
pub struct AgentTokens<'a> {
    store: &'a Store,
}

impl<'a> AgentTokens<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Stores the token of each `(node, token)` of a session that is still `starting`,
    /// replacing any token an earlier attempt stored for the same node, in one statement.
    /// `false` (nothing stored) if the session is not `starting` any more.
    pub async fn put(
        &self,
        session: SessionId,
        tokens: &[(NodeName, &str)],
    ) -> Result<bool, StoreError> {
        const SQL: &str = "INSERT INTO agent_tokens (session_id, node, token) \
             SELECT s.id, t.node, t.token \
             FROM sessions s, unnest($2::text[], $3::text[]) AS t(node, token) \
             WHERE s.id = $1 AND s.status = $4 \
             ON CONFLICT (session_id, node) DO UPDATE \
             SET token = EXCLUDED.token, created_at = now()";
        if tokens.is_empty() {
            return Err(StoreError::InvalidArgument("no agent tokens to store"));
        }
        let nodes: Vec<&str> = tokens.iter().map(|(n, _)| n.as_str()).collect();
        let values: Vec<&str> = tokens.iter().map(|(_, t)| *t).collect();
        let client = self.store.client().await?;
        let n = client
            .execute(
                SQL,
                &[
                    &session.as_uuid(),
                    &nodes,
                    &values,
                    &SessionStatus::Starting.as_str(),
                ],
            )
            .await
            .map_err(StoreError::query("storing agent tokens"))?;
        Ok(n as usize == tokens.len())
    }

    /// The token of `node`'s agent in `session`; `None` if none is stored (the session is
    /// final, or was provisioned before tokens were stored).
    pub async fn get(
        &self,
        session: SessionId,
        node: &NodeName,
    ) -> Result<Option<String>, StoreError> {
        const SQL: &str = "SELECT token FROM agent_tokens WHERE session_id = $1 AND node = $2";
        let client = self.store.client().await?;
        let row = client
            .query_opt(SQL, &[&session.as_uuid(), &node.as_str()])
            .await
            .map_err(StoreError::query("reading an agent token"))?;
        row.map(|r| r.try_get::<_, String>(0))
            .transpose()
            .map_err(StoreError::query("reading an agent token"))
    }

    /// Replaces the token of `node` of a live `session` (a pool member's token rotated at
    /// its claim). `false` (nothing stored) if the session is not live any more or has no
    /// token for that node.
    pub async fn replace(
        &self,
        session: SessionId,
        node: &NodeName,
        token: &str,
    ) -> Result<bool, StoreError> {
        const SQL: &str = "UPDATE agent_tokens t SET token = $3, created_at = now() \
             FROM sessions s WHERE t.session_id = $1 AND t.node = $2 \
             AND s.id = t.session_id AND s.status = ANY($4)";
        let live: Vec<&str> = SessionStatus::LIVE.iter().map(|s| s.as_str()).collect();
        let client = self.store.client().await?;
        let n = client
            .execute(SQL, &[&session.as_uuid(), &node.as_str(), &token, &live])
            .await
            .map_err(StoreError::query("replacing an agent token"))?;
        Ok(n == 1)
    }

    /// How many tokens are stored for `session` (for checks that final sessions keep none).
    pub async fn count(&self, session: SessionId) -> Result<u64, StoreError> {
        const SQL: &str = "SELECT count(*) FROM agent_tokens WHERE session_id = $1";
        let client = self.store.client().await?;
        let row = client
            .query_one(SQL, &[&session.as_uuid()])
            .await
            .map_err(StoreError::query("counting agent tokens"))?;
        let n: i64 = row
            .try_get(0)
            .map_err(StoreError::query("counting agent tokens"))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
