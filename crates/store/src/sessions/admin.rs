//! The admin pages' reads: the recent history of an environment, and the finishing sessions
//! whose objects linger.

use chrono::{DateTime, Utc};
use ttlab_model::{EnvName, SessionId, SessionStatus};

use super::finish::terminating_from_row;
use super::{Session, Sessions, TerminatingSession, limit};
use crate::StoreError;
use crate::rows::get;

impl Sessions<'_> {
    /// The most recently created sessions of `env`, whatever their status (admin history).
    pub async fn list_recent(&self, env: &EnvName, n: u32) -> Result<Vec<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE env = $1 ORDER BY created_at DESC, id LIMIT $2"
        );
        self.query_all("listing recent sessions", SQL, &[&env.as_str(), &limit(n)])
            .await
    }

    /// When the objects of session `id` were confirmed gone (`None`: not (yet) confirmed, or
    /// no such session).
    pub async fn objects_gone_at(
        &self,
        id: SessionId,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        const SQL: &str = "SELECT objects_gone_at FROM sessions WHERE id = $1";
        const WHAT: &str = "reading when a session's objects were gone";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let row = client
            .query_opt(&statement, &[&id.as_uuid()])
            .await
            .map_err(StoreError::query(WHAT))?;
        match row {
            Some(row) => get(&row, "objects_gone_at"),
            None => Ok(None),
        }
    }

    /// The finishing sessions with objects still terminating (of `env`, or of every
    /// environment), longest-terminating first, at most `n`.
    pub async fn list_terminating(
        &self,
        env: Option<&EnvName>,
        n: u32,
    ) -> Result<Vec<TerminatingSession>, StoreError> {
        const SQL: &str = "SELECT id, env, lesson, finishing_to, terminating_objects, \
             terminating_since FROM sessions \
             WHERE status = $1 AND terminating_since IS NOT NULL \
             AND cardinality(terminating_objects) > 0 AND ($2::text IS NULL OR env = $2) \
             ORDER BY terminating_since, id LIMIT $3";
        const WHAT: &str = "listing sessions with objects still terminating";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let env = env.map(ToString::to_string);
        let rows = client
            .query(
                &statement,
                &[&SessionStatus::Finishing.as_str(), &env, &limit(n)],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter().map(terminating_from_row).collect()
    }
}
