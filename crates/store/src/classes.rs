//! Scheduled classes (schema version 13): the `classes` table — a lesson, seats and a window an
//! operator booked in one environment, with an optional join code — and what the planner and
//! the admin page read about them: each class's members and started students, and a lesson's
//! measured preparation times (its lead time).
//!
//! Which class a session belongs to is the `class_id` column of `sessions`: set when a member
//! is opened for a class ([`NewPoolMember::class`](crate::NewPoolMember)), when a class's
//! student claims a member ([`PoolClaim::class`](crate::PoolClaim)), or afterwards for a
//! student's cold start ([`Classes::record_student`]). A class is never deleted: cancelling
//! keeps the row, so the sessions that name it keep their history.
//!
//! Join codes are stored as given (operators are shown them) and never looked up by value: the
//! server reads the classes open for a lesson ([`Classes::current`]) and compares codes in
//! constant time.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use ttlab_model::{ClassId, EnvName, LessonId, SessionId, UserId};
use uuid::Uuid;

use crate::rows::{get, non_negative, parse, parse_opt};
use crate::{Store, StoreError};

/// The most seats a class may have (`classes_seats`).
pub const CLASS_SEATS_CAP: u32 = 500;

/// The longest window a class may have: 12 hours (`classes_window`).
pub const CLASS_WINDOW_CAP: Duration = Duration::from_secs(12 * 3600);

/// How many of a lesson's recent preparations its lead time is measured over, at most.
pub const PREPARATIONS_MEASURED: u32 = 50;

/// How far back preparations are measured: a week.
pub const PREPARATIONS_SINCE: Duration = Duration::from_secs(7 * 24 * 3600);

const SEATS_RULE: &str = "a class has 1 to 500 seats";
const WINDOW_RULE: &str = "a class ends after it starts, at most 12 hours later";
const TEXT_RULE: &str = "a title has 1 to 100 characters, a join code 4 to 32";

/// A class about to be scheduled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewClass {
    /// Its id.
    pub id: ClassId,
    /// The environment it is for.
    pub env: EnvName,
    /// Its lesson (a VM lesson of that environment; the caller checks).
    pub lesson: LessonId,
    /// What operators and the pool's `why` call it (`Intro 10:00`).
    pub title: String,
    /// How many students (1 to [`CLASS_SEATS_CAP`]).
    pub seats: u32,
    /// When it begins: its members should be ready then.
    pub starts_at: DateTime<Utc>,
    /// When it ends (after `starts_at`, within [`CLASS_WINDOW_CAP`]).
    pub ends_at: DateTime<Utc>,
    /// What its students enter to be recognised as its students; `None`: everyone starting
    /// its lesson during its window is.
    pub join_code: Option<String>,
    /// The operator scheduling it.
    pub by: UserId,
}

/// A row of `classes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Class {
    /// Its id.
    pub id: ClassId,
    /// Its environment.
    pub env: EnvName,
    /// Its lesson.
    pub lesson: LessonId,
    /// Its title.
    pub title: String,
    /// Its seats.
    pub seats: u32,
    /// When it begins.
    pub starts_at: DateTime<Utc>,
    /// When it ends.
    pub ends_at: DateTime<Utc>,
    /// Its join code, if it has one.
    pub join_code: Option<String>,
    /// When it was scheduled (database clock).
    pub created_at: DateTime<Utc>,
    /// Who scheduled it.
    pub created_by: UserId,
    /// When it was last changed.
    pub updated_at: DateTime<Utc>,
    /// Who last changed it.
    pub updated_by: UserId,
    /// When it was cancelled, if it was.
    pub cancelled_at: Option<DateTime<Utc>>,
    /// Who cancelled it.
    pub cancelled_by: Option<UserId>,
}

/// A change to a class: each field given replaces the class's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassChange {
    /// A new title.
    pub title: Option<String>,
    /// New seats.
    pub seats: Option<u32>,
    /// A new start.
    pub starts_at: Option<DateTime<Utc>>,
    /// A new end.
    pub ends_at: Option<DateTime<Utc>>,
    /// A new join code (`Some(None)` removes it).
    pub join_code: Option<Option<String>>,
    /// The `updated_at` the change was decided against: if the class changed since, nothing
    /// is written.
    pub seen: DateTime<Utc>,
    /// The operator changing it.
    pub by: UserId,
}

/// What a class holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ClassCounts {
    /// The class.
    pub class: ClassId,
    /// Unclaimed members prepared for it that are running (claimable).
    pub ready: u64,
    /// Unclaimed members prepared for it still starting.
    pub preparing: u64,
    /// Unclaimed members prepared for it whose retirement is under way.
    pub retiring: u64,
    /// Distinct students who started a lab in it (a claimed member or a cold start).
    pub started: u64,
}

/// Queries on scheduled classes; get one with [`Store::classes`].
#[derive(Debug, Clone, Copy)]
pub struct Classes<'a> {
    store: &'a Store,
}

const COLUMNS: &str = "id, env, lesson, title, seats, starts_at, ends_at, join_code, \
     created_at, created_by, updated_at, updated_by, cancelled_at, cancelled_by";

fn count(row: &Row, column: &'static str) -> Result<u64, StoreError> {
    let n: i64 = get(row, column)?;
    u64::try_from(n).map_err(|_| StoreError::corrupt(column, "negative count"))
}

fn class_from_row(row: &Row) -> Result<Class, StoreError> {
    Ok(Class {
        id: ClassId::from_uuid(get::<Uuid>(row, "id")?),
        env: parse(row, "env")?,
        lesson: parse(row, "lesson")?,
        title: get(row, "title")?,
        seats: non_negative(row, "seats")?,
        starts_at: get(row, "starts_at")?,
        ends_at: get(row, "ends_at")?,
        join_code: get(row, "join_code")?,
        created_at: get(row, "created_at")?,
        created_by: parse(row, "created_by")?,
        updated_at: get(row, "updated_at")?,
        updated_by: parse(row, "updated_by")?,
        cancelled_at: get(row, "cancelled_at")?,
        cancelled_by: parse_opt(row, "cancelled_by")?,
    })
}

/// A CHECK constraint's refusal as [`StoreError::Refused`], naming the rule.
fn refusal(what: &'static str) -> impl Fn(tokio_postgres::Error) -> StoreError {
    move |e| {
        if e.code() == Some(&SqlState::CHECK_VIOLATION) {
            let rule = match e.as_db_error().and_then(|d| d.constraint()) {
                Some("classes_seats") => Some(SEATS_RULE),
                Some("classes_window") => Some(WINDOW_RULE),
                Some("classes_title_check" | "classes_join_code_check") => Some(TEXT_RULE),
                _ => None,
            };
            if let Some(rule) = rule {
                return StoreError::Refused {
                    what: "a class",
                    rule,
                };
            }
        }
        StoreError::query(what)(e)
    }
}

fn seats(n: u32) -> Result<i32, StoreError> {
    i32::try_from(n).map_err(|_| StoreError::Refused {
        what: "a class",
        rule: SEATS_RULE,
    })
}

impl<'a> Classes<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Schedules a class. Values the schema forbids (seats outside 1..=500, an end not after
    /// the start or more than 12 hours later, a title or code of the wrong length) are
    /// [`StoreError::Refused`] and write nothing.
    pub async fn insert(&self, new: &NewClass) -> Result<Class, StoreError> {
        const WHAT: &str = "scheduling a class";
        let sql = format!(
            "INSERT INTO classes (id, env, lesson, title, seats, starts_at, ends_at, join_code, \
             created_by, updated_by) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9) \
             RETURNING {COLUMNS}"
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let row = client
            .query_one(
                &statement,
                &[
                    &new.id.as_uuid(),
                    &new.env.as_str(),
                    &new.lesson.as_str(),
                    &new.title,
                    &seats(new.seats)?,
                    &new.starts_at,
                    &new.ends_at,
                    &new.join_code,
                    &new.by.as_str(),
                ],
            )
            .await
            .map_err(refusal(WHAT))?;
        class_from_row(&row)
    }

    /// The class `id` of `env` (cancelled or not), if there is one.
    pub async fn get(&self, env: &EnvName, id: ClassId) -> Result<Option<Class>, StoreError> {
        const WHAT: &str = "reading a class";
        let sql = format!("SELECT {COLUMNS} FROM classes WHERE env = $1 AND id = $2");
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let row = client
            .query_opt(&statement, &[&env.as_str(), &id.as_uuid()])
            .await
            .map_err(StoreError::query(WHAT))?;
        row.as_ref().map(class_from_row).transpose()
    }

    /// The classes of `env` neither cancelled nor over at `now` (upcoming and running), by
    /// start, then id.
    pub async fn current(
        &self,
        env: &EnvName,
        now: DateTime<Utc>,
    ) -> Result<Vec<Class>, StoreError> {
        const WHAT: &str = "listing classes";
        let sql = format!(
            "SELECT {COLUMNS} FROM classes WHERE env = $1 AND cancelled_at IS NULL \
             AND ends_at > $2 ORDER BY starts_at, id"
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let rows = client
            .query(&statement, &[&env.as_str(), &now])
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter().map(class_from_row).collect()
    }

    /// Changes a class that is neither cancelled nor over, and has not changed since
    /// `change.seen`; `None` if it is cancelled, over, unknown, or changed meanwhile (read it
    /// again). Values the schema forbids are [`StoreError::Refused`] and write nothing.
    pub async fn update(
        &self,
        env: &EnvName,
        id: ClassId,
        change: &ClassChange,
    ) -> Result<Option<Class>, StoreError> {
        const WHAT: &str = "changing a class";
        let sql = format!(
            "UPDATE classes SET title = COALESCE($3, title), seats = COALESCE($4, seats), \
             starts_at = COALESCE($5, starts_at), ends_at = COALESCE($6, ends_at), \
             join_code = CASE WHEN $7 THEN $8 ELSE join_code END, \
             updated_by = $9, updated_at = now() \
             WHERE env = $1 AND id = $2 AND cancelled_at IS NULL AND ends_at > now() \
             AND updated_at = $10 RETURNING {COLUMNS}"
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let row = client
            .query_opt(
                &statement,
                &[
                    &env.as_str(),
                    &id.as_uuid(),
                    &change.title,
                    &change.seats.map(seats).transpose()?,
                    &change.starts_at,
                    &change.ends_at,
                    &change.join_code.is_some(),
                    &change.join_code.clone().flatten(),
                    &change.by.as_str(),
                    &change.seen,
                ],
            )
            .await
            .map_err(refusal(WHAT))?;
        row.as_ref().map(class_from_row).transpose()
    }

    /// Cancels a class that is neither cancelled nor over, recording who; `None` if it is
    /// already cancelled, over, or unknown. Its members become ordinary members of the pool.
    pub async fn cancel(
        &self,
        env: &EnvName,
        id: ClassId,
        by: &UserId,
    ) -> Result<Option<Class>, StoreError> {
        const WHAT: &str = "cancelling a class";
        let sql = format!(
            "UPDATE classes SET cancelled_at = now(), cancelled_by = $3, updated_at = now(), \
             updated_by = $3 WHERE env = $1 AND id = $2 AND cancelled_at IS NULL \
             AND ends_at > now() RETURNING {COLUMNS}"
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let row = client
            .query_opt(&statement, &[&env.as_str(), &id.as_uuid(), &by.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        row.as_ref().map(class_from_row).transpose()
    }

    /// For each of `classes`: its unclaimed live members (ready, preparing, retiring) and its
    /// distinct students so far, in one statement; in the order given.
    pub async fn counts(&self, classes: &[ClassId]) -> Result<Vec<ClassCounts>, StoreError> {
        const WHAT: &str = "counting classes' members and students";
        const SQL: &str = "SELECT c.id, \
             count(*) FILTER (WHERE s.user_id IS NULL AND s.status = 'running') AS ready, \
             count(*) FILTER (WHERE s.user_id IS NULL AND s.status = 'starting') AS preparing, \
             count(*) FILTER (WHERE s.user_id IS NULL AND s.status = 'finishing') AS retiring, \
             count(DISTINCT s.user_id) AS started \
             FROM unnest($1::uuid[]) AS c(id) LEFT JOIN sessions s ON s.class_id = c.id \
             GROUP BY c.id";
        let ids: Vec<Uuid> = classes.iter().map(ClassId::as_uuid).collect();
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let rows = client
            .query(&statement, &[&ids])
            .await
            .map_err(StoreError::query(WHAT))?;
        let mut out = Vec::with_capacity(classes.len());
        for id in classes {
            let row = rows
                .iter()
                .find(|r| r.try_get::<_, Uuid>("id").ok() == Some(id.as_uuid()));
            out.push(match row {
                Some(row) => ClassCounts {
                    class: *id,
                    ready: count(row, "ready")?,
                    preparing: count(row, "preparing")?,
                    retiring: count(row, "retiring")?,
                    started: count(row, "started")?,
                },
                None => ClassCounts {
                    class: *id,
                    ready: 0,
                    preparing: 0,
                    retiring: 0,
                    started: 0,
                },
            });
        }
        Ok(out)
    }

    /// Records that the student's session `session` was started in `class` (a cold start by
    /// one of its students: a claimed member records it in the claim). `false` if the session
    /// is unknown, nobody's, or already belongs to a class.
    pub async fn record_student(
        &self,
        session: SessionId,
        class: ClassId,
    ) -> Result<bool, StoreError> {
        const WHAT: &str = "recording a class's student";
        const SQL: &str = "UPDATE sessions SET class_id = $2 WHERE id = $1 \
             AND user_id IS NOT NULL AND class_id IS NULL";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let n = client
            .execute(&statement, &[&session.as_uuid(), &class.as_uuid()])
            .await
            .map_err(StoreError::query(WHAT))?;
        Ok(n > 0)
    }

    /// How long `lesson`'s most recent pool members in `env` took from creation to ready:
    /// at most [`PREPARATIONS_MEASURED`] of those that became ready within
    /// [`PREPARATIONS_SINCE`], newest first (what its lead time is measured from).
    pub async fn prepare_durations(
        &self,
        env: &EnvName,
        lesson: &LessonId,
    ) -> Result<Vec<Duration>, StoreError> {
        const WHAT: &str = "reading recent preparation times";
        const SQL: &str = "SELECT extract(epoch FROM ready_at - created_at)::float8 AS seconds \
             FROM sessions WHERE env = $1 AND lesson = $2 AND pool_member \
             AND ready_at IS NOT NULL \
             AND ready_at > now() - $3::float8 * interval '1 second' \
             ORDER BY ready_at DESC LIMIT $4";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let rows = client
            .query(
                &statement,
                &[
                    &env.as_str(),
                    &lesson.as_str(),
                    &PREPARATIONS_SINCE.as_secs_f64(),
                    &i64::from(PREPARATIONS_MEASURED),
                ],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter()
            .map(|r| {
                let s: f64 = get(r, "seconds")?;
                Duration::try_from_secs_f64(s.max(0.0))
                    .map_err(|e| StoreError::corrupt("ready_at", e))
            })
            .collect()
    }
}
