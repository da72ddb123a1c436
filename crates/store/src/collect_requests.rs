//! The `collect_requests` table: an admin's "collect now". Requesting inserts a row and
//! notifies [`Channel::CollectRequested`](crate::Channel); the reaper of that environment runs
//! a cycle and answers with its report ([`ReaperCycles::record`](crate::ReaperCycles::record)),
//! which notifies [`Channel::CollectAnswered`](crate::Channel); [`CollectRequests::wait_for_answer`]
//! waits for that.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::Row;
use ttlab_model::{EnvName, UserId};

use crate::notify::{Channel, channel_collect_requested};
use crate::reaper_cycles::{CycleId, ReaperCycle, cycle_columns, cycle_from_row};
use crate::rows::{get, parse};
use crate::{Store, StoreError};

/// The id of a "collect now" request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CollectRequestId(i64);

impl CollectRequestId {
    /// The number inside.
    pub const fn get(self) -> i64 {
        self.0
    }

    pub(crate) const fn from_i64(id: i64) -> Self {
        Self(id)
    }
}

impl fmt::Display for CollectRequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One "collect now" request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectRequest {
    /// Its id.
    pub id: CollectRequestId,
    /// The environment to collect.
    pub env: EnvName,
    /// When it was made (database clock).
    pub requested_at: DateTime<Utc>,
    /// Who asked.
    pub requested_by: UserId,
    /// When a cycle answered it.
    pub answered_at: Option<DateTime<Utc>>,
    /// The cycle that answered it.
    pub cycle: Option<CycleId>,
}

macro_rules! request_columns {
    () => {
        "id, env, requested_at, requested_by, answered_at, cycle_id"
    };
}

impl CollectRequest {
    fn from_row(row: &Row) -> Result<Self, StoreError> {
        let cycle: Option<i64> = get(row, "cycle_id")?;
        Ok(Self {
            id: CollectRequestId(get(row, "id")?),
            env: parse(row, "env")?,
            requested_at: get(row, "requested_at")?,
            requested_by: parse(row, "requested_by")?,
            answered_at: get(row, "answered_at")?,
            cycle: cycle.map(CycleId::from_i64),
        })
    }
}

/// Queries on the `collect_requests` table; get one with [`Store::collect_requests`].
#[derive(Debug, Clone, Copy)]
pub struct CollectRequests<'a> {
    store: &'a Store,
}

impl<'a> CollectRequests<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Asks the reaper of `env` to run a cycle now.
    pub async fn request(
        &self,
        env: &EnvName,
        requested_by: &UserId,
    ) -> Result<CollectRequest, StoreError> {
        const SQL: &str = concat!(
            "INSERT INTO collect_requests (env, requested_by) VALUES ($1, $2) RETURNING ",
            request_columns!(),
            ", pg_notify('",
            channel_collect_requested!(),
            "', env)"
        );
        let client = self.store.client().await?;
        let row = client
            .query_one(SQL, &[&env.as_str(), &requested_by.as_str()])
            .await
            .map_err(StoreError::query("requesting a collection"))?;
        CollectRequest::from_row(&row)
    }

    /// One request by id.
    pub async fn get(&self, id: CollectRequestId) -> Result<Option<CollectRequest>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            request_columns!(),
            " FROM collect_requests WHERE id = $1"
        );
        let client = self.store.client().await?;
        let row = client
            .query_opt(SQL, &[&id.0])
            .await
            .map_err(StoreError::query("reading a collect request"))?;
        row.as_ref().map(CollectRequest::from_row).transpose()
    }

    /// Unanswered requests of `env`, oldest first.
    pub async fn pending(&self, env: &EnvName) -> Result<Vec<CollectRequest>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            request_columns!(),
            " FROM collect_requests WHERE env = $1 AND answered_at IS NULL ORDER BY id"
        );
        let client = self.store.client().await?;
        let rows = client
            .query(SQL, &[&env.as_str()])
            .await
            .map_err(StoreError::query("listing pending collect requests"))?;
        rows.iter().map(CollectRequest::from_row).collect()
    }

    /// The cycle report that answered request `id`, if it has been answered.
    pub async fn answer(&self, id: CollectRequestId) -> Result<Option<ReaperCycle>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            cycle_columns!(),
            " FROM reaper_cycles WHERE id = (SELECT cycle_id FROM collect_requests WHERE id = $1)"
        );
        let client = self.store.client().await?;
        let row = client
            .query_opt(SQL, &[&id.0])
            .await
            .map_err(StoreError::query("reading a collect answer"))?;
        row.as_ref().map(cycle_from_row).transpose()
    }

    /// Waits until request `id` is answered and returns the answering cycle's report; fails
    /// with [`StoreError::Timeout`] after `timeout`.
    pub async fn wait_for_answer(
        &self,
        id: CollectRequestId,
        timeout: Duration,
    ) -> Result<ReaperCycle, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // Listen first, then look: an answer between the two is not missed.
        let mut listener = self.store.listen(&[Channel::CollectAnswered]).await?;
        loop {
            if let Some(cycle) = self.answer(id).await? {
                return Ok(cycle);
            }
            loop {
                match tokio::time::timeout_at(deadline, listener.recv()).await {
                    Err(_) => {
                        return Err(StoreError::Timeout {
                            what: "the reaper to answer a collect request",
                            elapsed: timeout,
                        });
                    }
                    Ok(Err(e)) => return Err(e),
                    Ok(Ok(n)) if n.payload == id.0.to_string() => break,
                    Ok(Ok(_other)) => {}
                }
            }
        }
    }
}
