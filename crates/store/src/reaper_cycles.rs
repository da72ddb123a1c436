//! The `reaper_cycles` table: one report per reaper cycle (what it reclaimed and what failed,
//! by direction, and since schema version 18 the site it ran on), which the server reads for
//! the admin screen. Recording a cycle also answers the "collect now" requests it served, in
//! the same transaction.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::Row;
use tokio_postgres::types::Json;
use ttlab_model::{EnvName, SiteName};

use crate::collect_requests::CollectRequestId;
use crate::notify::channel_collect_answered;
use crate::rows::{get, non_negative, parse, parse_opt};
use crate::{Store, StoreError};

/// At most this many errors are kept per cycle report (the rest are only counted).
pub const MAX_ERRORS_KEPT: usize = 20;

/// The id of a reaper cycle report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CycleId(i64);

impl CycleId {
    /// The number inside.
    pub const fn get(self) -> i64 {
        self.0
    }

    pub(crate) const fn from_i64(id: i64) -> Self {
        Self(id)
    }
}

impl fmt::Display for CycleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What started a cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr, strum::EnumCount)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = StoreError,
    parse_err_fn = unknown_trigger
)]
pub enum CycleTrigger {
    /// The first cycle after the reaper started.
    Startup,
    /// The periodic timer.
    Timer,
    /// A deadline came due, or a session change woke the reaper.
    Wakeup,
    /// An admin's "collect now".
    Collect,
}

impl CycleTrigger {
    /// Every trigger.
    pub const ALL: [CycleTrigger; <CycleTrigger as strum::EnumCount>::COUNT] =
        [Self::Startup, Self::Timer, Self::Wakeup, Self::Collect];

    /// Lowercase name, as stored.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

fn unknown_trigger(s: &str) -> StoreError {
    StoreError::corrupt("trigger", format!("unknown trigger {s:?}"))
}

/// One of the reaper's directions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Expired sessions: delete their objects, then mark them expired.
    Expired,
    /// Labelled objects of this environment with no live session.
    Orphans,
    /// Running sessions whose VM is gone.
    Ghosts,
    /// Starting sessions past their readiness deadline, and finishing sessions to retry.
    Stuck,
}

/// Successes and failures of one direction in one cycle.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionCount {
    /// Items handled (reclaimed, deleted or marked).
    pub done: u32,
    /// Items that failed; they are seen again next cycle.
    pub failed: u32,
}

/// One failure of a cycle, as kept in its report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CycleError {
    /// The direction it happened in.
    pub direction: Direction,
    /// What failed (a session id, or `kind/name` of an object).
    pub subject: String,
    /// One line saying why.
    pub message: String,
}

/// A cycle report to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCycle {
    /// The reaper's environment.
    pub env: EnvName,
    /// When the cycle started (database clock).
    pub started_at: DateTime<Utc>,
    /// How long it took.
    pub duration: Duration,
    /// What started it.
    pub trigger: CycleTrigger,
    /// Whether it only reported what it would have done.
    pub dry_run: bool,
    /// Expired sessions reclaimed / failed.
    pub expired: DirectionCount,
    /// Orphan objects deleted / failed.
    pub orphans: DirectionCount,
    /// Ghost sessions marked / failed.
    pub ghosts: DirectionCount,
    /// Stuck or finishing sessions reclaimed / failed.
    pub stuck: DirectionCount,
    /// The cycle's errors; only the first [`MAX_ERRORS_KEPT`] are stored.
    pub errors: Vec<CycleError>,
    /// The "collect now" request that started it, if any.
    pub collect_request: Option<CollectRequestId>,
}

/// A recorded cycle report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaperCycle {
    /// Its id.
    pub id: CycleId,
    /// The site it ran on (`None`: recorded without one, or before schema version 18).
    pub site: Option<SiteName>,
    /// The report.
    pub cycle: NewCycle,
}

impl ReaperCycle {
    fn from_row(row: &Row) -> Result<Self, StoreError> {
        let trigger: &str = get(row, "trigger")?;
        let duration_ms: i64 = get(row, "duration_ms")?;
        let Json(errors): Json<Vec<CycleError>> = get(row, "errors")?;
        let collect: Option<i64> = get(row, "collect_request_id")?;
        Ok(Self {
            id: CycleId(get(row, "id")?),
            site: parse_opt(row, "site")?,
            cycle: NewCycle {
                env: parse(row, "env")?,
                started_at: get(row, "started_at")?,
                duration: Duration::from_millis(
                    u64::try_from(duration_ms)
                        .map_err(|_| StoreError::corrupt("duration_ms", "negative"))?,
                ),
                trigger: trigger.parse()?,
                dry_run: get(row, "dry_run")?,
                expired: DirectionCount {
                    done: non_negative(row, "expired_reclaimed")?,
                    failed: non_negative(row, "expired_failed")?,
                },
                orphans: DirectionCount {
                    done: non_negative(row, "orphans_deleted")?,
                    failed: non_negative(row, "orphans_failed")?,
                },
                ghosts: DirectionCount {
                    done: non_negative(row, "ghosts_marked")?,
                    failed: non_negative(row, "ghosts_failed")?,
                },
                stuck: DirectionCount {
                    done: non_negative(row, "stuck_reclaimed")?,
                    failed: non_negative(row, "stuck_failed")?,
                },
                errors,
                collect_request: collect.map(CollectRequestId::from_i64),
            },
        })
    }
}

macro_rules! cycle_columns {
    () => {
        "id, env, started_at, duration_ms, trigger, dry_run, expired_reclaimed, \
         expired_failed, orphans_deleted, orphans_failed, ghosts_marked, ghosts_failed, \
         stuck_reclaimed, stuck_failed, errors, collect_request_id, site"
    };
}
pub(crate) use cycle_columns;

pub(crate) fn cycle_from_row(row: &Row) -> Result<ReaperCycle, StoreError> {
    ReaperCycle::from_row(row)
}

fn count_param(n: u32) -> Result<i32, StoreError> {
    i32::try_from(n).map_err(|_| StoreError::InvalidArgument("a cycle count is out of range"))
}

/// Queries on the `reaper_cycles` table; get one with [`Store::reaper_cycles`].
#[derive(Debug, Clone, Copy)]
pub struct ReaperCycles<'a> {
    store: &'a Store,
}

impl<'a> ReaperCycles<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Records a cycle report and, in the same transaction, answers the given "collect now"
    /// requests with it (those already answered are left alone) and notifies
    /// [`Channel::CollectAnswered`](crate::Channel) for each. The report names no site; see
    /// [`ReaperCycles::record_on_site`].
    pub async fn record(
        &self,
        cycle: &NewCycle,
        answers: &[CollectRequestId],
    ) -> Result<ReaperCycle, StoreError> {
        self.record_on_site(cycle, None, answers).await
    }

    /// [`ReaperCycles::record`], the report naming the site the cycle ran on.
    pub async fn record_on_site(
        &self,
        cycle: &NewCycle,
        site: Option<&SiteName>,
        answers: &[CollectRequestId],
    ) -> Result<ReaperCycle, StoreError> {
        const INSERT: &str = concat!(
            "INSERT INTO reaper_cycles (env, started_at, duration_ms, trigger, dry_run, \
             expired_reclaimed, expired_failed, orphans_deleted, orphans_failed, ghosts_marked, \
             ghosts_failed, stuck_reclaimed, stuck_failed, errors, collect_request_id, site) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16) \
             RETURNING ",
            cycle_columns!()
        );
        const ANSWER: &str = concat!(
            "UPDATE collect_requests SET answered_at = now(), cycle_id = $2 \
             WHERE id = ANY($1) AND answered_at IS NULL \
             RETURNING id, pg_notify('",
            channel_collect_answered!(),
            "', id::text)"
        );
        let duration_ms = i64::try_from(cycle.duration.as_millis())
            .map_err(|_| StoreError::InvalidArgument("a cycle duration is out of range"))?;
        let kept: Vec<&CycleError> = cycle.errors.iter().take(MAX_ERRORS_KEPT).collect();
        let mut client = self.store.client().await?;
        let tx = client
            .transaction()
            .await
            .map_err(StoreError::query("recording a reaper cycle"))?;
        let row = tx
            .query_one(
                INSERT,
                &[
                    &cycle.env.as_str(),
                    &cycle.started_at,
                    &duration_ms,
                    &cycle.trigger.as_str(),
                    &cycle.dry_run,
                    &count_param(cycle.expired.done)?,
                    &count_param(cycle.expired.failed)?,
                    &count_param(cycle.orphans.done)?,
                    &count_param(cycle.orphans.failed)?,
                    &count_param(cycle.ghosts.done)?,
                    &count_param(cycle.ghosts.failed)?,
                    &count_param(cycle.stuck.done)?,
                    &count_param(cycle.stuck.failed)?,
                    &Json(&kept),
                    &cycle.collect_request.map(CollectRequestId::get),
                    &site.map(SiteName::as_str),
                ],
            )
            .await
            .map_err(StoreError::query("recording a reaper cycle"))?;
        let recorded = ReaperCycle::from_row(&row)?;
        if !answers.is_empty() {
            let ids: Vec<i64> = answers.iter().map(|a| a.get()).collect();
            tx.query(ANSWER, &[&ids, &recorded.id.0])
                .await
                .map_err(StoreError::query("answering collect requests"))?;
        }
        tx.commit()
            .await
            .map_err(StoreError::query("recording a reaper cycle"))?;
        Ok(recorded)
    }

    /// One cycle report by id.
    pub async fn get(&self, id: CycleId) -> Result<Option<ReaperCycle>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            cycle_columns!(),
            " FROM reaper_cycles WHERE id = $1"
        );
        let client = self.store.client().await?;
        let row = client
            .query_opt(SQL, &[&id.0])
            .await
            .map_err(StoreError::query("reading a reaper cycle"))?;
        row.as_ref().map(ReaperCycle::from_row).transpose()
    }

    /// The latest `limit` cycle reports, newest first; of one environment, or of all.
    pub async fn recent(
        &self,
        env: Option<&EnvName>,
        limit: u32,
    ) -> Result<Vec<ReaperCycle>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            cycle_columns!(),
            " FROM reaper_cycles WHERE ($1::text IS NULL OR env = $1) \
             ORDER BY started_at DESC, id DESC LIMIT $2"
        );
        let client = self.store.client().await?;
        let rows = client
            .query(SQL, &[&env.map(EnvName::as_str), &i64::from(limit)])
            .await
            .map_err(StoreError::query("listing reaper cycles"))?;
        rows.iter().map(ReaperCycle::from_row).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triggers_round_trip() {
        for t in CycleTrigger::ALL {
            assert_eq!(t.as_str().parse::<CycleTrigger>().unwrap(), t);
        }
        assert!("cron".parse::<CycleTrigger>().is_err());
    }
}
