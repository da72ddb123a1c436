//! The `grading_results` table: every "Check my work" of a session — when, how many checks
//! passed out of how many, and the names of those that failed — for the operators' view of a
//! session. Rows are never updated.

use chrono::{DateTime, Utc};
use serde::Serialize;
use ttlab_model::SessionId;

use crate::{Store, StoreError};

/// One grading of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GradingResult {
    /// When (database clock).
    pub at: DateTime<Utc>,
    /// Checks passed.
    pub passed: u32,
    /// Checks run.
    pub total: u32,
    /// The names of the checks that did not pass, in the lesson's order.
    pub failed: Vec<String>,
}

/// Queries on `grading_results`, from [`Store::grading_results`].
#[derive(Debug, Clone, Copy)]
pub struct GradingResults<'a> {
    store: &'a Store,
}

fn count(n: u32) -> Result<i32, StoreError> {
    i32::try_from(n).map_err(|_| StoreError::InvalidArgument("a check count is out of range"))
}

impl<'a> GradingResults<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Records a grading of `session`.
    pub async fn record(
        &self,
        session: SessionId,
        passed: u32,
        total: u32,
        failed: &[String],
    ) -> Result<(), StoreError> {
        if passed > total {
            return Err(StoreError::InvalidArgument(
                "more checks passed than were run",
            ));
        }
        const SQL: &str = "INSERT INTO grading_results (session_id, passed, total, failed) VALUES ($1, $2, $3, $4)";
        let client = self.store.client().await?;
        client
            .execute(
                SQL,
                &[&session.as_uuid(), &count(passed)?, &count(total)?, &failed],
            )
            .await
            .map_err(StoreError::query("recording a grading"))?;
        Ok(())
    }

    /// The gradings of `session`, oldest first (at most the last `limit`).
    pub async fn for_session(
        &self,
        session: SessionId,
        limit: u32,
    ) -> Result<Vec<GradingResult>, StoreError> {
        const SQL: &str = "SELECT at, passed, total, failed FROM (\
             SELECT id, at, passed, total, failed FROM grading_results WHERE session_id = $1 \
             ORDER BY at DESC, id DESC LIMIT $2) AS last ORDER BY at, id";
        const WHAT: &str = "reading gradings";
        let client = self.store.client().await?;
        let rows = client
            .query(SQL, &[&session.as_uuid(), &i64::from(limit)])
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter()
            .map(|r| {
                let passed: i32 = r.try_get(1).map_err(StoreError::query(WHAT))?;
                let total: i32 = r.try_get(2).map_err(StoreError::query(WHAT))?;
                Ok(GradingResult {
                    at: r.try_get(0).map_err(StoreError::query(WHAT))?,
                    passed: u32::try_from(passed).unwrap_or(0),
                    total: u32::try_from(total).unwrap_or(0),
                    failed: r.try_get(3).map_err(StoreError::query(WHAT))?,
                })
            })
            .collect()
    }
}
