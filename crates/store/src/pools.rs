//! Warm pools (schema version 12): an operator's override of a lesson's pool settings
//! (`lesson_pools`), the pool's state and history for the admin page and metrics (members
//! ready and preparing, claims, misses, failed hand-overs, refill time), and the recent starts demand-driven
//! sizing reads.
//!
//! Pool members themselves are session rows (`pool_member`, no user until claimed): they are
//! opened with [`Sessions::insert_pool_member`](crate::Sessions::insert_pool_member) or
//! [`CapacityGuard::insert_pool_member`](crate::CapacityGuard::insert_pool_member) and claimed
//! with [`Sessions::claim_pool_member`](crate::Sessions::claim_pool_member), which also records
//! each claim and miss in `pool_events`. [`Pools::prune_events`] drops events older than
//! [`EVENT_RETENTION`].

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use ttlab_model::{EnvName, LessonId, UserId};

use crate::rows::{get, non_negative, parse};
use crate::{Session, Store, StoreError};

/// The largest pool an operator may configure (`lesson_pools.max_size`).
pub const POOL_SIZE_CAP: u32 = 200;

/// How long claim and miss events are kept: a week of history plus a day, so "the same
/// window a week earlier" is always there.
pub const EVENT_RETENTION: Duration = Duration::from_secs(8 * 24 * 3600);

/// A lesson's pool settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PoolSettings {
    /// Members to keep ready (the fixed size, or the demand-driven size's starting point).
    pub size: u32,
    /// Fewest members, even when demand is low.
    pub min: u32,
    /// Most members, whatever the demand (at most [`POOL_SIZE_CAP`]).
    pub max: u32,
    /// While paused, no member is created (the ready ones can still be claimed).
    pub paused: bool,
    /// A member older than this is replaced (its lifespan as a member; 60 s to 7 days).
    pub max_age: Duration,
    /// Whether the size follows recent starts (within `min`..=`max`) instead of `size`.
    pub demand_driven: bool,
}

/// An operator's override of a lesson's pool settings (a row of `lesson_pools`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LessonPool {
    /// The environment.
    pub env: EnvName,
    /// The lesson.
    pub lesson: LessonId,
    /// The settings.
    pub settings: PoolSettings,
    /// When they were last changed (database clock).
    pub updated_at: DateTime<Utc>,
    /// Who changed them.
    pub updated_by: UserId,
}

/// A pool's state and recent history.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PoolCounts {
    /// Unclaimed members that are running (claimable).
    pub ready: u64,
    /// Unclaimed members still starting.
    pub preparing: u64,
    /// Claims in the last 24 hours.
    pub claims_24h: u64,
    /// Misses (a claim found no ready member) in the last 24 hours.
    pub misses_24h: u64,
    /// Claimed members whose hand-over failed in the last 24 hours (each is also one of
    /// `claims_24h`: the member was taken, then failed and reclaimed, and the student given
    /// the next member or a cold start).
    pub handover_failures_24h: u64,
    /// The median time from creation to ready of members that became ready in the last
    /// 24 hours; `None` when none did.
    pub median_refill: Option<Duration>,
    /// The database clock when these were counted.
    pub at: DateTime<Utc>,
}

impl PoolCounts {
    /// Clicks served by a member over clicks on the pool in the last 24 hours; `None` without
    /// any. A member whose hand-over failed served nobody: the click that took it ended with
    /// the next member (another claim) or a cold start (a miss).
    pub fn hit_rate(&self) -> Option<f64> {
        let served = self.claims_24h.saturating_sub(self.handover_failures_24h);
        let attempts = served + self.misses_24h;
        #[allow(clippy::cast_precision_loss)]
        (attempts > 0).then(|| served as f64 / attempts as f64)
    }
}

/// Start instants of a lesson (cold sessions' creation, members' claims) in three windows of
/// the same length: ending at `now`, a day earlier and a week earlier. Each list is sorted.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct RecentStarts {
    /// `(now - window, now]`.
    pub recent: Vec<DateTime<Utc>>,
    /// The same window one day earlier.
    pub day_before: Vec<DateTime<Utc>>,
    /// The same window one week earlier.
    pub week_before: Vec<DateTime<Utc>>,
}

/// Queries on warm pools; get one with [`Store::pools`].
#[derive(Debug, Clone, Copy)]
pub struct Pools<'a> {
    store: &'a Store,
}

const SETTINGS_COLUMNS: &str = "env, lesson, size, min_size, max_size, paused, \
     max_age_seconds, demand_driven, updated_at, updated_by";

const SIZES_RULE: &str = "a pool needs 0 <= min <= size <= max <= 200";
const MAX_AGE_RULE: &str = "a pool member's age limit must be between 60 s and 7 days";

fn count(row: &Row, column: &'static str) -> Result<u64, StoreError> {
    let n: i64 = get(row, column)?;
    u64::try_from(n).map_err(|_| StoreError::corrupt(column, "negative count"))
}

fn pool_from_row(row: &Row) -> Result<LessonPool, StoreError> {
    Ok(LessonPool {
        env: parse(row, "env")?,
        lesson: parse(row, "lesson")?,
        settings: PoolSettings {
            size: non_negative(row, "size")?,
            min: non_negative(row, "min_size")?,
            max: non_negative(row, "max_size")?,
            paused: get(row, "paused")?,
            max_age: Duration::from_secs(u64::from(non_negative(row, "max_age_seconds")?)),
            demand_driven: get(row, "demand_driven")?,
        },
        updated_at: get(row, "updated_at")?,
        updated_by: parse(row, "updated_by")?,
    })
}

impl<'a> Pools<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// The override of `lesson`'s pool in `env`, if an operator set one.
    pub async fn get(
        &self,
        env: &EnvName,
        lesson: &LessonId,
    ) -> Result<Option<LessonPool>, StoreError> {
        const WHAT: &str = "reading a lesson's pool settings";
        let sql =
            format!("SELECT {SETTINGS_COLUMNS} FROM lesson_pools WHERE env = $1 AND lesson = $2");
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let row = client
            .query_opt(&statement, &[&env.as_str(), &lesson.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        row.as_ref().map(pool_from_row).transpose()
    }

    /// Every override in `env`, by lesson.
    pub async fn list(&self, env: &EnvName) -> Result<Vec<LessonPool>, StoreError> {
        const WHAT: &str = "listing pool settings";
        let sql =
            format!("SELECT {SETTINGS_COLUMNS} FROM lesson_pools WHERE env = $1 ORDER BY lesson");
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let rows = client
            .query(&statement, &[&env.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter().map(pool_from_row).collect()
    }

    /// Sets (or replaces) the override of `lesson`'s pool in `env` — an operator's resize,
    /// pause or resume — recording who did it. Values the schema forbids (sizes out of
    /// `0 <= min <= size <= max <= 200`, an age limit outside 60 s..7 days) are
    /// [`StoreError::Refused`].
    pub async fn upsert(
        &self,
        env: &EnvName,
        lesson: &LessonId,
        settings: &PoolSettings,
        by: &UserId,
    ) -> Result<LessonPool, StoreError> {
        const WHAT: &str = "saving a lesson's pool settings";
        let refused = |rule| StoreError::Refused {
            what: "pool settings",
            rule,
        };
        let size = |n: u32| i32::try_from(n).map_err(|_| refused(SIZES_RULE));
        let max_age =
            i32::try_from(settings.max_age.as_secs()).map_err(|_| refused(MAX_AGE_RULE))?;
        let sql = format!(
            "INSERT INTO lesson_pools (env, lesson, size, min_size, max_size, paused, \
             max_age_seconds, demand_driven, updated_by) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (env, lesson) DO UPDATE SET size = EXCLUDED.size, \
             min_size = EXCLUDED.min_size, max_size = EXCLUDED.max_size, \
             paused = EXCLUDED.paused, max_age_seconds = EXCLUDED.max_age_seconds, \
             demand_driven = EXCLUDED.demand_driven, updated_by = EXCLUDED.updated_by, \
             updated_at = now() \
             RETURNING {SETTINGS_COLUMNS}"
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let row = client
            .query_one(
                &statement,
                &[
                    &env.as_str(),
                    &lesson.as_str(),
                    &size(settings.size)?,
                    &size(settings.min)?,
                    &size(settings.max)?,
                    &settings.paused,
                    &max_age,
                    &settings.demand_driven,
                    &by.as_str(),
                ],
            )
            .await
            .map_err(|e| {
                if e.code() == Some(&SqlState::CHECK_VIOLATION) {
                    match e.as_db_error().and_then(|d| d.constraint()) {
                        Some("lesson_pools_sizes") => return refused(SIZES_RULE),
                        Some("lesson_pools_max_age") => return refused(MAX_AGE_RULE),
                        _ => {}
                    }
                }
                StoreError::query(WHAT)(e)
            })?;
        pool_from_row(&row)
    }

    /// Removes the override of `lesson`'s pool in `env` (back to the lesson file's settings).
    /// `false` if there was none.
    pub async fn delete(&self, env: &EnvName, lesson: &LessonId) -> Result<bool, StoreError> {
        const WHAT: &str = "removing a lesson's pool settings";
        const SQL: &str = "DELETE FROM lesson_pools WHERE env = $1 AND lesson = $2";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let n = client
            .execute(&statement, &[&env.as_str(), &lesson.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        Ok(n > 0)
    }

    /// The state and last-24-hours history of `lesson`'s pool in `env`, in one statement.
    pub async fn counts(&self, env: &EnvName, lesson: &LessonId) -> Result<PoolCounts, StoreError> {
        const WHAT: &str = "counting a pool";
        const SQL: &str = "SELECT \
             (SELECT count(*) FROM sessions WHERE env = $1 AND lesson = $2 AND pool_member \
                AND claimed_at IS NULL AND status = 'running') AS ready, \
             (SELECT count(*) FROM sessions WHERE env = $1 AND lesson = $2 AND pool_member \
                AND claimed_at IS NULL AND status = 'starting') AS preparing, \
             (SELECT count(*) FROM pool_events WHERE env = $1 AND lesson = $2 \
                AND kind = 'claim' AND at > now() - interval '24 hours') AS claims, \
             (SELECT count(*) FROM pool_events WHERE env = $1 AND lesson = $2 \
                AND kind = 'miss' AND at > now() - interval '24 hours') AS misses, \
             (SELECT count(*) FROM pool_events WHERE env = $1 AND lesson = $2 \
                AND kind = 'handover_failed' AND at > now() - interval '24 hours') \
                AS handover_failures, \
             (SELECT percentile_cont(0.5) WITHIN GROUP \
                (ORDER BY extract(epoch FROM ready_at - created_at)::float8) \
                FROM sessions WHERE env = $1 AND lesson = $2 AND pool_member \
                AND ready_at IS NOT NULL AND ready_at > now() - interval '24 hours') AS refill, \
             now() AS at";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let row = client
            .query_one(&statement, &[&env.as_str(), &lesson.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        let refill: Option<f64> = get(&row, "refill")?;
        Ok(PoolCounts {
            ready: count(&row, "ready")?,
            preparing: count(&row, "preparing")?,
            claims_24h: count(&row, "claims")?,
            misses_24h: count(&row, "misses")?,
            handover_failures_24h: count(&row, "handover_failures")?,
            median_refill: refill
                .map(|s| Duration::try_from_secs_f64(s.max(0.0)))
                .transpose()
                .map_err(|e| StoreError::corrupt("ready_at", e))?,
            at: get(&row, "at")?,
        })
    }

    /// When `lesson` was started in `env` (a cold session's creation, a member's claim)
    /// within `window` before `now`, and in the same window one day and one week earlier:
    /// what demand-driven sizing reads. Pass the database clock as `now`.
    pub async fn recent_starts(
        &self,
        env: &EnvName,
        lesson: &LessonId,
        now: DateTime<Utc>,
        window: Duration,
    ) -> Result<RecentStarts, StoreError> {
        const WHAT: &str = "reading recent starts";
        const SQL: &str = "SELECT d.days, x.at FROM (VALUES (0), (1), (7)) AS d(days), LATERAL ( \
             SELECT created_at AS at FROM sessions WHERE env = $1 AND lesson = $2 \
               AND NOT pool_member \
               AND created_at > $3::timestamptz - d.days * interval '1 day' - $4::float8 * interval '1 second' \
               AND created_at <= $3::timestamptz - d.days * interval '1 day' \
             UNION ALL \
             SELECT claimed_at FROM sessions WHERE env = $1 AND lesson = $2 \
               AND claimed_at IS NOT NULL \
               AND claimed_at > $3::timestamptz - d.days * interval '1 day' - $4::float8 * interval '1 second' \
               AND claimed_at <= $3::timestamptz - d.days * interval '1 day') AS x \
             ORDER BY d.days, x.at";
        if window > Duration::from_secs(24 * 3600) {
            return Err(StoreError::InvalidArgument(
                "a demand window is at most one day",
            ));
        }
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let rows = client
            .query(
                &statement,
                &[&env.as_str(), &lesson.as_str(), &now, &window.as_secs_f64()],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        let mut out = RecentStarts::default();
        for row in &rows {
            let days: i32 = get(row, "days")?;
            let at: DateTime<Utc> = get(row, "at")?;
            match days {
                0 => out.recent.push(at),
                1 => out.day_before.push(at),
                _ => out.week_before.push(at),
            }
        }
        Ok(out)
    }

    /// The unclaimed members of `lesson`'s pool in `env` that are starting, running or
    /// finishing, oldest first (claimed members are their students' sessions).
    pub async fn members(
        &self,
        env: &EnvName,
        lesson: &LessonId,
    ) -> Result<Vec<Session>, StoreError> {
        self.store.sessions().unclaimed_members(env, lesson).await
    }

    /// When `lesson` was started in `env` within `start <= t < end`: a cold session's
    /// creation or a pool member's claim, oldest first.
    pub async fn starts_between(
        &self,
        env: &EnvName,
        lesson: &LessonId,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
    ) -> Result<Vec<DateTime<Utc>>, StoreError> {
        const WHAT: &str = "reading starts";
        const SQL: &str = "SELECT at FROM ( \
             SELECT created_at AS at FROM sessions WHERE env = $1 AND lesson = $2 \
               AND NOT pool_member AND created_at >= $3 AND created_at < $4 \
             UNION ALL \
             SELECT claimed_at FROM sessions WHERE env = $1 AND lesson = $2 \
               AND claimed_at IS NOT NULL AND claimed_at >= $3 AND claimed_at < $4) AS x \
             ORDER BY at";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let rows = client
            .query(&statement, &[&env.as_str(), &lesson.as_str(), &start, &end])
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter().map(|row| get(row, "at")).collect()
    }

    /// The creation of the oldest session `env` still holds: starts before it are not known
    /// (`None` when it holds none).
    pub async fn history_since(&self, env: &EnvName) -> Result<Option<DateTime<Utc>>, StoreError> {
        const WHAT: &str = "reading how far the session history goes back";
        const SQL: &str = "SELECT min(created_at) AS since FROM sessions WHERE env = $1";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let row = client
            .query_one(&statement, &[&env.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        get(&row, "since")
    }

    /// Records that a member claimed while it was being prepared could not be handed over
    /// when it turned ready (counted in [`PoolCounts`] as a hand-over failure).
    pub async fn record_handover_failure(
        &self,
        env: &EnvName,
        lesson: &LessonId,
    ) -> Result<(), StoreError> {
        const WHAT: &str = "recording a failed hand-over";
        const SQL: &str =
            "INSERT INTO pool_events (env, lesson, kind) VALUES ($1, $2, 'handover_failed')";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        client
            .execute(&statement, &[&env.as_str(), &lesson.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        Ok(())
    }

    /// Deletes claim and miss events older than [`EVENT_RETENTION`]; how many went.
    pub async fn prune_events(&self) -> Result<u64, StoreError> {
        const WHAT: &str = "pruning pool events";
        const SQL: &str =
            "DELETE FROM pool_events WHERE at < now() - $1::float8 * interval '1 second'";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        client
            .execute(&statement, &[&EVENT_RETENTION.as_secs_f64()])
            .await
            .map_err(StoreError::query(WHAT))
    }
}
