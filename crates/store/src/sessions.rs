//! The `sessions` table: one row per lab session, shared by the server and the reaper.
//!
//! Every status change is a conditional `UPDATE … WHERE id = $1 AND status = ANY($2)` that
//! returns the updated row, or `None` when the row was not in a state the change applies to
//! (someone else got there first — callers treat that as "already done" or re-read). Each
//! change is checked against [`SessionStatus::can_become`] before any statement is sent, and
//! changes that move a deadline notify [`Channel::SessionsChanged`](crate::Channel) with the
//! environment as payload, so the reaper can sleep until the next deadline. Progress records
//! (stage, disk, VMs, failure reason) notify the same channel, so a server replica streaming
//! a session's progress hears about changes another replica made.
//!
//! Warm-pool members (schema version 12) are rows of this table too, opened with no user
//! ([`Sessions::insert_pool_member`]) and handed to one by [`Sessions::claim_pool_member`].
//! Queries by user never return an unclaimed member; the reaper's listings and the capacity
//! count include every member.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use ttlab_model::{
    EnvName, FinalStatus, LessonId, NodeName, Runtime, SessionId, SessionStatus, UserId,
};
use uuid::Uuid;

use crate::notify::channel_sessions_changed;
use crate::rows::{get, non_negative, parse, parse_opt};
use crate::{Store, StoreError};

/// Every column of a session row, in the order [`Session::from_row`] reads them.
macro_rules! columns {
    () => {
        "id, user_id, lesson, runtime, env, status, finishing_to, started_at, expires_at, \
         max_expires_at, extensions_used, readiness_deadline, created_at, vm_created_at, \
         vmi_running_at, agent_up_at, ready_at, finished_at, reclaimed_at, disk_kind, \
         disk_reason, node_names, vm_names, failure_reason, updated_at, pool_member, claimed_at"
    };
}

/// `RETURNING` list of a change the reaper should hear about.
macro_rules! returning_and_notify {
    () => {
        concat!(
            " RETURNING ",
            columns!(),
            ", pg_notify('",
            channel_sessions_changed!(),
            "', env)"
        )
    };
}

/// `RETURNING` clause of a progress update (stage, disk, VMs, failure reason): no deadline
/// moves, but watchers of the session (the server's event streams, on every replica) hear
/// about it on the same channel.
macro_rules! notify_progress {
    () => {
        concat!(
            " RETURNING pg_notify('",
            channel_sessions_changed!(),
            "', env)"
        )
    };
}

/// The three instants of a session's lifespan, as computed by `ttlab-lifespan` from the
/// database clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionTimes {
    /// When the lifespan started.
    pub started_at: DateTime<Utc>,
    /// When it ends unless extended.
    pub expires_at: DateTime<Utc>,
    /// The hard cap no extension can pass.
    pub max_expires_at: DateTime<Utc>,
}

/// A session about to be opened (status `starting`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSession {
    /// Its id (Kubernetes object names derive from it).
    pub id: SessionId,
    /// Whose session.
    pub user: UserId,
    /// Which lesson.
    pub lesson: LessonId,
    /// What it runs on; the reaper decides what to delete from this.
    pub runtime: Runtime,
    /// The environment of the backend opening it.
    pub env: EnvName,
    /// Its lifespan.
    pub times: SessionTimes,
    /// If it is not running by then, it is failed and reclaimed.
    pub readiness_deadline: DateTime<Utc>,
}

/// A warm-pool member about to be opened (status `starting`): provisioned like a session,
/// held by no user until [`Sessions::claim_pool_member`] hands it to one. Its lifespan is the
/// pool's age limit (the reaper expires and reclaims an old member like any session); its
/// readiness deadline is the lesson's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPoolMember {
    /// Its id (Kubernetes object names derive from it).
    pub id: SessionId,
    /// Which lesson's pool.
    pub lesson: LessonId,
    /// What it runs on.
    pub runtime: Runtime,
    /// The environment of the backend opening it.
    pub env: EnvName,
    /// Its age limit, as a lifespan: it is expired at `expires_at` unless claimed before.
    pub times: SessionTimes,
    /// If it is not running by then, it is failed and reclaimed.
    pub readiness_deadline: DateTime<Utc>,
}

/// A student's "Start lab" served from a lesson's warm pool: see
/// [`Sessions::claim_pool_member`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolClaim {
    /// The environment of the backend claiming.
    pub env: EnvName,
    /// The lesson whose pool is claimed from.
    pub lesson: LessonId,
    /// Who gets the member.
    pub user: UserId,
    /// The session's lifespan from the claim: `expires_at` = claim + `ttl` (the policy's TTL,
    /// as `ttlab-lifespan` would compute for a session opened at the claim instant).
    pub ttl: std::time::Duration,
    /// The hard cap from the claim: `max_expires_at` = claim + `max` (at least `ttl`).
    pub max: std::time::Duration,
}

/// The longest lifespan a claim may ask for (ten years; far beyond any policy).
const LIFESPAN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10 * 365 * 24 * 3600);

/// A member whose age limit (`expires_at`) is this close is left to the reaper, not claimed.
pub const CLAIM_MARGIN: std::time::Duration = std::time::Duration::from_secs(120);

/// Which root disk a session got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskKind {
    /// The golden PVC as a read-only base with a per-VM copy-on-write layer.
    Golden,
    /// A container disk.
    Container,
}

impl DiskKind {
    /// Lowercase name, as stored.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Golden => "golden",
            Self::Container => "container",
        }
    }
}

impl fmt::Display for DiskKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DiskKind {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "golden" => Ok(Self::Golden),
            "container" => Ok(Self::Container),
            other => Err(StoreError::corrupt(
                "disk_kind",
                format!("unknown disk kind {other:?}"),
            )),
        }
    }
}

/// One VM (or pod) of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionVm {
    /// The lab node it plays.
    pub node: NodeName,
    /// The Kubernetes object name.
    pub name: String,
}

/// A provisioning stage whose first-reached instant is recorded (database clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The VirtualMachine object was created.
    VmCreated,
    /// The VMI reached phase Running.
    VmiRunning,
    /// The guest agent answered.
    AgentUp,
}

/// One row of `sessions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    /// The session id.
    pub id: SessionId,
    /// Whose session: `None` exactly for a warm-pool member nobody has claimed yet.
    pub user: Option<UserId>,
    /// Which lesson.
    pub lesson: LessonId,
    /// What it runs on.
    pub runtime: Runtime,
    /// The environment of the backend that opened it.
    pub env: EnvName,
    /// Where it is in its life.
    pub status: SessionStatus,
    /// While finishing: the final status it lands on once its objects are deleted.
    pub finishing_to: Option<FinalStatus>,
    /// When the lifespan started.
    pub started_at: DateTime<Utc>,
    /// When it expires unless extended.
    pub expires_at: DateTime<Utc>,
    /// The hard cap no extension can pass.
    pub max_expires_at: DateTime<Utc>,
    /// Extensions used so far.
    pub extensions_used: u32,
    /// A starting session not running by then is failed.
    pub readiness_deadline: DateTime<Utc>,
    /// When the row was created (the request was accepted).
    pub created_at: DateTime<Utc>,
    /// When the VirtualMachine was created.
    pub vm_created_at: Option<DateTime<Utc>>,
    /// When the VMI was first seen Running.
    pub vmi_running_at: Option<DateTime<Utc>>,
    /// When the guest agent first answered.
    pub agent_up_at: Option<DateTime<Utc>>,
    /// When the session became running (VMI Running and readiness marker present).
    pub ready_at: Option<DateTime<Utc>>,
    /// When it stopped being usable (entered finishing, or became a ghost).
    pub finished_at: Option<DateTime<Utc>>,
    /// When every cluster object of it was confirmed deleted.
    pub reclaimed_at: Option<DateTime<Utc>>,
    /// The root disk decision and its reason.
    pub disk: Option<(DiskKind, String)>,
    /// Its VMs (or pod), one per lab node.
    pub vms: Vec<SessionVm>,
    /// Why provisioning failed, if it did.
    pub failure_reason: Option<String>,
    /// Last change of the row.
    pub updated_at: DateTime<Utc>,
    /// Whether it was opened as a warm-pool member (claimed or not).
    pub pool_member: bool,
    /// When a student claimed it (pool members only; its lifespan starts then).
    pub claimed_at: Option<DateTime<Utc>>,
}

impl Session {
    /// The lifespan instants.
    pub fn times(&self) -> SessionTimes {
        SessionTimes {
            started_at: self.started_at,
            expires_at: self.expires_at,
            max_expires_at: self.max_expires_at,
        }
    }

    fn from_row(row: &Row) -> Result<Self, StoreError> {
        let disk_kind: Option<DiskKind> = parse_opt(row, "disk_kind")?;
        let disk_reason: Option<String> = get(row, "disk_reason")?;
        let node_names: Vec<String> = get(row, "node_names")?;
        let vm_names: Vec<String> = get(row, "vm_names")?;
        if node_names.len() != vm_names.len() {
            return Err(StoreError::corrupt(
                "vm_names",
                "not one name per node".to_owned(),
            ));
        }
        let vms = node_names
            .into_iter()
            .zip(vm_names)
            .map(|(node, name)| {
                Ok(SessionVm {
                    node: node
                        .parse()
                        .map_err(|e| StoreError::corrupt("node_names", e))?,
                    name,
                })
            })
            .collect::<Result<_, StoreError>>()?;
        Ok(Self {
            id: SessionId::from_uuid(get::<Uuid>(row, "id")?),
            user: parse_opt(row, "user_id")?,
            lesson: parse(row, "lesson")?,
            runtime: parse(row, "runtime")?,
            env: parse(row, "env")?,
            status: parse(row, "status")?,
            finishing_to: parse_opt(row, "finishing_to")?,
            started_at: get(row, "started_at")?,
            expires_at: get(row, "expires_at")?,
            max_expires_at: get(row, "max_expires_at")?,
            extensions_used: non_negative(row, "extensions_used")?,
            readiness_deadline: get(row, "readiness_deadline")?,
            created_at: get(row, "created_at")?,
            vm_created_at: get(row, "vm_created_at")?,
            vmi_running_at: get(row, "vmi_running_at")?,
            agent_up_at: get(row, "agent_up_at")?,
            ready_at: get(row, "ready_at")?,
            finished_at: get(row, "finished_at")?,
            reclaimed_at: get(row, "reclaimed_at")?,
            disk: match (disk_kind, disk_reason) {
                (Some(kind), Some(reason)) => Some((kind, reason)),
                _ => None,
            },
            vms,
            failure_reason: get(row, "failure_reason")?,
            updated_at: get(row, "updated_at")?,
            pool_member: get(row, "pool_member")?,
            claimed_at: get(row, "claimed_at")?,
        })
    }
}

fn rows_to_sessions(rows: &[Row]) -> Result<Vec<Session>, StoreError> {
    rows.iter().map(Session::from_row).collect()
}

fn opt_session(row: Option<Row>) -> Result<Option<Session>, StoreError> {
    row.as_ref().map(Session::from_row).transpose()
}

fn names(statuses: &[SessionStatus]) -> Vec<&'static str> {
    statuses.iter().map(|s| s.as_str()).collect()
}

fn limit(n: u32) -> i64 {
    i64::from(n)
}

/// Refuses a change the state machine forbids, before anything reaches the database.
fn ensure(from: &[SessionStatus], to: SessionStatus) -> Result<(), StoreError> {
    if from.is_empty() {
        return Err(StoreError::InvalidArgument(
            "a status change needs at least one status to start from",
        ));
    }
    match from.iter().find(|f| !f.can_become(to)) {
        Some(&bad) => Err(StoreError::InvalidTransition { from: bad, to }),
        None => Ok(()),
    }
}

/// The transitions with fixed end points offered by [`Sessions`] (checked again at run time,
/// and exhaustively by a test).
const TO_RUNNING: (&[SessionStatus], SessionStatus) =
    (&[SessionStatus::Starting], SessionStatus::Running);
const EXPIRING: (&[SessionStatus], SessionStatus) =
    (&[SessionStatus::Running], SessionStatus::Finishing);
const STUCK_FAILING: (&[SessionStatus], SessionStatus) =
    (&[SessionStatus::Starting], SessionStatus::Finishing);
const TO_GHOST: (&[SessionStatus], SessionStatus) =
    (&[SessionStatus::Running], SessionStatus::Ghost);

pub(crate) enum InsertError {
    /// The user already has a live session (the unique partial index said so).
    LiveExists,
    /// Anything else.
    Other(StoreError),
}

pub(crate) fn exists_error(user: &UserId, open: Session) -> StoreError {
    StoreError::SessionExists {
        user: user.clone(),
        lesson: open.lesson,
        session: open.id,
        status: open.status,
    }
}

/// Inserts a user's `starting` row on `client` (pooled connection or open transaction).
pub(crate) async fn insert_on(
    client: &tokio_postgres::Client,
    new: &NewSession,
) -> Result<Session, InsertError> {
    insert_row(
        client,
        NewRow {
            id: new.id,
            user: Some(&new.user),
            lesson: &new.lesson,
            runtime: new.runtime,
            env: &new.env,
            times: &new.times,
            readiness_deadline: new.readiness_deadline,
        },
    )
    .await
}

/// Inserts a warm-pool member's `starting` row (no user) on `client`.
pub(crate) async fn insert_member_on(
    client: &tokio_postgres::Client,
    new: &NewPoolMember,
) -> Result<Session, StoreError> {
    let row = NewRow {
        id: new.id,
        user: None,
        lesson: &new.lesson,
        runtime: new.runtime,
        env: &new.env,
        times: &new.times,
        readiness_deadline: new.readiness_deadline,
    };
    match insert_row(client, row).await {
        Ok(session) => Ok(session),
        Err(InsertError::Other(e)) => Err(e),
        // A row without a user is not covered by the one-live-per-user index.
        Err(InsertError::LiveExists) => Err(StoreError::Conflict {
            what: "a pool member collided with a user's live session",
        }),
    }
}

/// The values of a new `starting` row; `user` is `None` for a warm-pool member.
struct NewRow<'a> {
    id: SessionId,
    user: Option<&'a UserId>,
    lesson: &'a LessonId,
    runtime: Runtime,
    env: &'a EnvName,
    times: &'a SessionTimes,
    readiness_deadline: DateTime<Utc>,
}

async fn insert_row(
    client: &tokio_postgres::Client,
    new: NewRow<'_>,
) -> Result<Session, InsertError> {
    const SQL: &str = concat!(
        "INSERT INTO sessions (id, user_id, lesson, runtime, env, status, started_at, \
         expires_at, max_expires_at, readiness_deadline, pool_member) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        returning_and_notify!()
    );
    let t = new.times;
    if !(t.started_at <= t.expires_at && t.expires_at <= t.max_expires_at) {
        return Err(InsertError::Other(StoreError::InvalidArgument(
            "a session needs started_at <= expires_at <= max_expires_at",
        )));
    }
    let result = client
        .query_one(
            SQL,
            &[
                &new.id.as_uuid(),
                &new.user.map(UserId::as_str),
                &new.lesson.as_str(),
                &new.runtime.as_str(),
                &new.env.as_str(),
                &SessionStatus::Starting.as_str(),
                &t.started_at,
                &t.expires_at,
                &t.max_expires_at,
                &new.readiness_deadline,
                &new.user.is_none(),
            ],
        )
        .await;
    match result {
        Ok(row) => Session::from_row(&row).map_err(InsertError::Other),
        Err(e) if is_live_exists(&e) => Err(InsertError::LiveExists),
        Err(e) => Err(InsertError::Other(
            StoreError::query("inserting a session")(e),
        )),
    }
}

/// Whether `e` is the one-live-per-user index refusing a row.
fn is_live_exists(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::UNIQUE_VIOLATION)
        && e.as_db_error().and_then(|d| d.constraint()) == Some("sessions_one_live_per_user")
}

/// Queries on the `sessions` table; get one with [`Store::sessions`].
#[derive(Debug, Clone, Copy)]
pub struct Sessions<'a> {
    store: &'a Store,
}

impl<'a> Sessions<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    async fn query_opt(
        &self,
        what: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<Session>, StoreError> {
        let (client, statement) = self.store.prepared(what, sql).await?;
        let row = client
            .query_opt(&statement, params)
            .await
            .map_err(StoreError::query(what))?;
        opt_session(row)
    }

    async fn query_all(
        &self,
        what: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Session>, StoreError> {
        let (client, statement) = self.store.prepared(what, sql).await?;
        let rows = client
            .query(&statement, params)
            .await
            .map_err(StoreError::query(what))?;
        rows_to_sessions(&rows)
    }

    async fn execute(
        &self,
        what: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<bool, StoreError> {
        let (client, statement) = self.store.prepared(what, sql).await?;
        let n = client
            .execute(&statement, params)
            .await
            .map_err(StoreError::query(what))?;
        Ok(n > 0)
    }

    /// Opens a session in status `starting`. If the user already has a live session, fails
    /// with [`StoreError::SessionExists`] naming it — the database's unique index decides,
    /// so concurrent requests (double clicks, several replicas) open exactly one.
    pub async fn insert(&self, new: &NewSession) -> Result<Session, StoreError> {
        // A conflicting session may end between the failed insert and the look-up; then the
        // insert is simply tried again.
        for _ in 0..3 {
            let client = self.store.client().await?;
            match insert_on(&client, new).await {
                Ok(session) => return Ok(session),
                Err(InsertError::Other(e)) => return Err(e),
                Err(InsertError::LiveExists) => {
                    drop(client);
                    if let Some(open) = self.live_for_user(&new.user).await? {
                        return Err(exists_error(&new.user, open));
                    }
                }
            }
        }
        Err(StoreError::Conflict {
            what: "the user's other session kept changing",
        })
    }

    /// Opens a warm-pool member in status `starting`, held by no user (outside the capacity
    /// lock; the server opens members through [`CapacityGuard::insert_pool_member`]).
    ///
    /// [`CapacityGuard::insert_pool_member`]: crate::CapacityGuard::insert_pool_member
    pub async fn insert_pool_member(&self, new: &NewPoolMember) -> Result<Session, StoreError> {
        let client = self.store.client().await?;
        insert_member_on(&client, new).await
    }

    /// Claims the longest-ready unclaimed running member of `claim.lesson`'s pool in
    /// `claim.env` for `claim.user`, in one statement (`FOR UPDATE SKIP LOCKED`: concurrent
    /// claims, on any replica, never get the same member). The member becomes the user's
    /// session: `user`, `claimed_at` and a fresh lifespan starting at the claim (database
    /// clock). Members within [`CLAIM_MARGIN`] of their age limit are passed over. Every
    /// attempt is recorded as a claim or a miss (for hit rates).
    ///
    /// `Ok(None)` is a miss: no ready member (open a session the cold way). A user who
    /// already has a live session gets [`StoreError::SessionExists`], as for a second
    /// [`Sessions::insert`], and the member stays in the pool.
    pub async fn claim_pool_member(
        &self,
        claim: &PoolClaim,
    ) -> Result<Option<Session>, StoreError> {
        const WHAT: &str = "claiming a pool member";
        const SQL: &str = concat!(
            "WITH claimed AS (UPDATE sessions SET user_id = $3, claimed_at = now(), \
             started_at = now(), expires_at = now() + $4::float8 * interval '1 second', \
             max_expires_at = now() + $5::float8 * interval '1 second', updated_at = now() \
             WHERE id = (SELECT id FROM sessions WHERE env = $1 AND lesson = $2 \
               AND pool_member AND claimed_at IS NULL AND status = 'running' \
               AND expires_at > now() + $6::float8 * interval '1 second' \
               ORDER BY ready_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) \
             AND pool_member AND claimed_at IS NULL AND status = 'running'",
            returning_and_notify!(),
            "), event AS (INSERT INTO pool_events (env, lesson, kind) \
             SELECT $1, $2, CASE WHEN EXISTS (SELECT 1 FROM claimed) THEN 'claim' ELSE 'miss' END) \
             SELECT ",
            columns!(),
            " FROM claimed"
        );
        if claim.ttl > claim.max {
            return Err(StoreError::InvalidArgument(
                "a session needs started_at <= expires_at <= max_expires_at",
            ));
        }
        if claim.max > LIFESPAN_LIMIT {
            return Err(StoreError::InvalidArgument("a lifespan is out of range"));
        }
        let (ttl, max) = (claim.ttl.as_secs_f64(), claim.max.as_secs_f64());
        let margin = CLAIM_MARGIN.as_secs_f64();
        for _ in 0..3 {
            let (client, statement) = self.store.prepared(WHAT, SQL).await?;
            let result = client
                .query_opt(
                    &statement,
                    &[
                        &claim.env.as_str(),
                        &claim.lesson.as_str(),
                        &claim.user.as_str(),
                        &ttl,
                        &max,
                        &margin,
                    ],
                )
                .await;
            match result {
                Ok(row) => return opt_session(row),
                Err(e) if is_live_exists(&e) => {
                    drop(client);
                    if let Some(open) = self.live_for_user(&claim.user).await? {
                        return Err(exists_error(&claim.user, open));
                    }
                }
                Err(e) => return Err(StoreError::query(WHAT)(e)),
            }
        }
        Err(StoreError::Conflict {
            what: "the user's other session kept changing",
        })
    }

    /// Seconds from request to ready of the `n` most recent sessions of `lesson` in `env`
    /// that became ready, newest first (the measured distribution a starting session's
    /// expected time comes from).
    pub async fn recent_ready_seconds(
        &self,
        env: &EnvName,
        lesson: &LessonId,
        n: u32,
    ) -> Result<Vec<f64>, StoreError> {
        const SQL: &str = "SELECT extract(epoch FROM ready_at - created_at)::float8 \
             FROM sessions WHERE env = $1 AND lesson = $2 AND ready_at IS NOT NULL \
             ORDER BY ready_at DESC LIMIT $3";
        const WHAT: &str = "reading recent readiness times";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let rows = client
            .query(
                &statement,
                &[&env.as_str(), &lesson.as_str(), &i64::from(n)],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter()
            .map(|r| r.try_get::<_, f64>(0).map_err(StoreError::query(WHAT)))
            .collect()
    }

    /// One session by id.
    pub async fn get(&self, id: SessionId) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!("SELECT ", columns!(), " FROM sessions WHERE id = $1");
        self.query_opt("reading a session", SQL, &[&id.as_uuid()])
            .await
    }

    /// The session `id` and the database clock, read in one statement (one round trip for
    /// a read rendered against "now"); `None` if there is no such session.
    pub async fn get_with_now(
        &self,
        id: SessionId,
    ) -> Result<Option<(Session, DateTime<Utc>)>, StoreError> {
        const WHAT: &str = "reading a session";
        const SQL: &str = concat!(
            "SELECT now() AS db_now, ",
            columns!(),
            " FROM sessions WHERE id = $1"
        );
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let Some(row) = client
            .query_opt(&statement, &[&id.as_uuid()])
            .await
            .map_err(StoreError::query(WHAT))?
        else {
            return Ok(None);
        };
        let now: DateTime<Utc> = row.try_get("db_now").map_err(StoreError::query(WHAT))?;
        Ok(Some((Session::from_row(&row)?, now)))
    }

    /// The user's live (starting, running or finishing) session, if any (a claimed pool
    /// member is the user's session; an unclaimed one is nobody's).
    pub async fn live_for_user(&self, user: &UserId) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE user_id = $1 AND status = ANY($2)"
        );
        self.query_opt(
            "reading the user's live session",
            SQL,
            &[&user.as_str(), &names(&SessionStatus::LIVE)],
        )
        .await
    }

    /// The unclaimed live (starting, running, finishing) members of `lesson`'s pool in `env`,
    /// oldest first ([`Pools::members`](crate::Pools::members)).
    pub(crate) async fn unclaimed_members(
        &self,
        env: &EnvName,
        lesson: &LessonId,
    ) -> Result<Vec<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE env = $1 AND lesson = $2 AND pool_member \
             AND claimed_at IS NULL AND status IN ('starting', 'running', 'finishing') \
             ORDER BY created_at, id"
        );
        self.query_all(
            "listing a pool's members",
            SQL,
            &[&env.as_str(), &lesson.as_str()],
        )
        .await
    }

    /// Live sessions of `env`, unclaimed pool members included, by id, at most `limit`, after
    /// `after` (the last id of the previous page).
    pub async fn list_live(
        &self,
        env: &EnvName,
        after: Option<SessionId>,
        limit: u32,
    ) -> Result<Vec<Session>, StoreError> {
        self.list_with_statuses(env, &SessionStatus::LIVE, after, limit)
            .await
    }

    /// Sessions of `env` in `status`, by id, paged like [`Sessions::list_live`].
    pub async fn list_in_status(
        &self,
        env: &EnvName,
        status: SessionStatus,
        after: Option<SessionId>,
        limit: u32,
    ) -> Result<Vec<Session>, StoreError> {
        self.list_with_statuses(env, &[status], after, limit).await
    }

    async fn list_with_statuses(
        &self,
        env: &EnvName,
        statuses: &[SessionStatus],
        after: Option<SessionId>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE env = $1 AND status = ANY($2) \
             AND ($3::uuid IS NULL OR id > $3) ORDER BY id LIMIT $4"
        );
        self.query_all(
            "listing sessions",
            SQL,
            &[
                &env.as_str(),
                &names(statuses),
                &after.map(|a| a.as_uuid()),
                &limit(n),
            ],
        )
        .await
    }

    /// The VMs that live VM sessions of every environment sharing this database hold or are
    /// about to create: per session, its id, lesson and recorded VM names (empty while its
    /// VMs are not recorded yet). Only these columns are read, in one statement, so the
    /// capacity check stays cheap with many live sessions.
    pub async fn live_vm_sessions_all_envs(
        &self,
    ) -> Result<Vec<(SessionId, LessonId, Vec<String>)>, StoreError> {
        const WHAT: &str = "listing live VM sessions";
        const SQL: &str = "SELECT id, lesson, vm_names FROM sessions \
             WHERE status = ANY($1) AND runtime = $2";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let rows = client
            .query(
                &statement,
                &[&names(&SessionStatus::LIVE), &Runtime::Vm.as_str()],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter()
            .map(|row| {
                let id: Uuid = row.try_get(0).map_err(StoreError::query(WHAT))?;
                let lesson: &str = row.try_get(1).map_err(StoreError::query(WHAT))?;
                let vms: Vec<String> = row.try_get(2).map_err(StoreError::query(WHAT))?;
                let lesson = lesson
                    .parse()
                    .map_err(|e| StoreError::corrupt("lesson", e))?;
                Ok((SessionId::from_uuid(id), lesson, vms))
            })
            .collect()
    }

    /// Running sessions of `env` whose `expires_at` is at or before `until`, soonest first.
    /// With `until` = the database's now, these are the expired ones (the reaper confirms
    /// each with `ttlab-lifespan` and [`Sessions::begin_expiring`]).
    pub async fn list_expired(
        &self,
        env: &EnvName,
        until: DateTime<Utc>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE env = $1 AND status = $2 AND expires_at <= $3 \
             ORDER BY expires_at, id LIMIT $4"
        );
        self.query_all(
            "listing expired sessions",
            SQL,
            &[
                &env.as_str(),
                &SessionStatus::Running.as_str(),
                &until,
                &limit(n),
            ],
        )
        .await
    }

    /// Starting sessions of `env` whose readiness deadline is at or before `now`.
    pub async fn list_stuck_starting(
        &self,
        env: &EnvName,
        now: DateTime<Utc>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE env = $1 AND status = $2 AND readiness_deadline <= $3 \
             ORDER BY readiness_deadline, id LIMIT $4"
        );
        self.query_all(
            "listing stuck sessions",
            SQL,
            &[
                &env.as_str(),
                &SessionStatus::Starting.as_str(),
                &now,
                &limit(n),
            ],
        )
        .await
    }

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

    /// The earliest instant something in `env` becomes due: a running session's expiry or a
    /// starting session's readiness deadline. `None` when nothing is pending. The reaper sleeps
    /// until then (or until a [`Channel::SessionsChanged`](crate::Channel) notification).
    pub async fn next_deadline(&self, env: &EnvName) -> Result<Option<DateTime<Utc>>, StoreError> {
        const SQL: &str = "SELECT LEAST(\
             (SELECT min(expires_at) FROM sessions WHERE env = $1 AND status = $2), \
             (SELECT min(readiness_deadline) FROM sessions WHERE env = $1 AND status = $3))";
        let client = self.store.client().await?;
        let row = client
            .query_one(
                SQL,
                &[
                    &env.as_str(),
                    &SessionStatus::Running.as_str(),
                    &SessionStatus::Starting.as_str(),
                ],
            )
            .await
            .map_err(StoreError::query("reading the next deadline"))?;
        row.try_get(0)
            .map_err(StoreError::query("reading the next deadline"))
    }

    /// How many live sessions `env` has.
    pub async fn count_live(&self, env: &EnvName) -> Result<u64, StoreError> {
        const SQL: &str = "SELECT count(*) FROM sessions WHERE env = $1 AND status = ANY($2)";
        let client = self.store.client().await?;
        let row = client
            .query_one(SQL, &[&env.as_str(), &names(&SessionStatus::LIVE)])
            .await
            .map_err(StoreError::query("counting live sessions"))?;
        let n: i64 = row
            .try_get(0)
            .map_err(StoreError::query("counting live sessions"))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// starting → running: the VMI is Running and the agent reported the readiness marker.
    /// Sets `ready_at`; with `restart`, also replaces the lifespan (when the clock starts at
    /// readiness rather than at the request).
    pub async fn mark_running(
        &self,
        id: SessionId,
        restart: Option<SessionTimes>,
    ) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = $2, ready_at = now(), updated_at = now(), \
             started_at = COALESCE($4, started_at), expires_at = COALESCE($5, expires_at), \
             max_expires_at = COALESCE($6, max_expires_at) \
             WHERE id = $1 AND status = ANY($3)",
            returning_and_notify!()
        );
        let (from, to) = TO_RUNNING;
        ensure(from, to)?;
        if let Some(t) = &restart
            && !(t.started_at <= t.expires_at && t.expires_at <= t.max_expires_at)
        {
            return Err(StoreError::InvalidArgument(
                "a session needs started_at <= expires_at <= max_expires_at",
            ));
        }
        self.query_opt(
            "marking a session running",
            SQL,
            &[
                &id.as_uuid(),
                &to.as_str(),
                &names(from),
                &restart.map(|t| t.started_at),
                &restart.map(|t| t.expires_at),
                &restart.map(|t| t.max_expires_at),
            ],
        )
        .await
    }

    /// `from` → finishing, heading for `target`: the caller is about to delete the session's
    /// objects. Records `finished_at` (first time only) and, if given, the failure reason.
    /// Every status in `from` must be allowed to become finishing.
    pub async fn begin_finishing(
        &self,
        id: SessionId,
        from: &[SessionStatus],
        target: FinalStatus,
        failure_reason: Option<&str>,
    ) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = $2, finishing_to = $3, \
             finished_at = COALESCE(finished_at, now()), \
             failure_reason = COALESCE($4, failure_reason), updated_at = now() \
             WHERE id = $1 AND status = ANY($5)",
            returning_and_notify!()
        );
        ensure(from, SessionStatus::Finishing)?;
        self.query_opt(
            "finishing a session",
            SQL,
            &[
                &id.as_uuid(),
                &SessionStatus::Finishing.as_str(),
                &target.as_str(),
                &failure_reason,
                &names(from),
            ],
        )
        .await
    }

    /// running → finishing (heading for expired), only if `expires_at` is still the value the
    /// caller judged expired: an extension that got in between wins, and this returns `None`.
    pub async fn begin_expiring(
        &self,
        id: SessionId,
        seen_expires_at: DateTime<Utc>,
    ) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = $2, finishing_to = $3, \
             finished_at = COALESCE(finished_at, now()), updated_at = now() \
             WHERE id = $1 AND status = ANY($4) AND expires_at = $5",
            returning_and_notify!()
        );
        let (from, to) = EXPIRING;
        ensure(from, to)?;
        self.query_opt(
            "expiring a session",
            SQL,
            &[
                &id.as_uuid(),
                &to.as_str(),
                &FinalStatus::Expired.as_str(),
                &names(from),
                &seen_expires_at,
            ],
        )
        .await
    }

    /// starting → finishing (heading for failed), only if the readiness deadline has passed at
    /// `now` (the database clock): the server that was provisioning it gave up or died.
    pub async fn fail_stuck_starting(
        &self,
        id: SessionId,
        now: DateTime<Utc>,
    ) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = $2, finishing_to = $3, \
             finished_at = COALESCE(finished_at, now()), \
             failure_reason = COALESCE(failure_reason, $6), updated_at = now() \
             WHERE id = $1 AND status = ANY($4) AND readiness_deadline <= $5",
            returning_and_notify!()
        );
        let (from, to) = STUCK_FAILING;
        ensure(from, to)?;
        self.query_opt(
            "failing a stuck session",
            SQL,
            &[
                &id.as_uuid(),
                &to.as_str(),
                &FinalStatus::Failed.as_str(),
                &names(from),
                &now,
                &"not ready before its readiness deadline",
            ],
        )
        .await
    }

    /// finishing → its recorded final status: every cluster object of the session was
    /// confirmed deleted. Sets `reclaimed_at`.
    pub async fn complete_finishing(&self, id: SessionId) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = finishing_to, finishing_to = NULL, \
             reclaimed_at = now(), updated_at = now() \
             WHERE id = $1 AND status = $2 AND finishing_to = ANY($3)",
            returning_and_notify!()
        );
        for target in FinalStatus::ALL {
            ensure(&[SessionStatus::Finishing], target.status())?;
        }
        let targets: Vec<&str> = FinalStatus::ALL.iter().map(|t| t.as_str()).collect();
        self.query_opt(
            "completing a finishing session",
            SQL,
            &[&id.as_uuid(), &SessionStatus::Finishing.as_str(), &targets],
        )
        .await
    }

    /// running → ghost: its VM is gone from the cluster (confirmed by a direct get).
    pub async fn mark_ghost(&self, id: SessionId) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = $2, finished_at = COALESCE(finished_at, now()), \
             updated_at = now() WHERE id = $1 AND status = ANY($3)",
            returning_and_notify!()
        );
        let (from, to) = TO_GHOST;
        ensure(from, to)?;
        self.query_opt(
            "marking a session ghost",
            SQL,
            &[&id.as_uuid(), &to.as_str(), &names(from)],
        )
        .await
    }

    /// Extends a running session to `new_expires_at` (computed by `ttlab-lifespan`) and uses
    /// up one extension — only if it still has `seen_extensions_used` extensions used, has not
    /// expired by the database clock, and the new expiry neither passes `max_expires_at` nor
    /// moves backwards. `None` when any of that no longer holds (re-read and decide again).
    pub async fn extend(
        &self,
        id: SessionId,
        seen_extensions_used: u32,
        new_expires_at: DateTime<Utc>,
    ) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET expires_at = $3, extensions_used = extensions_used + 1, \
             updated_at = now() \
             WHERE id = $1 AND status = $4 AND extensions_used = $2 \
             AND expires_at > now() AND $3 >= expires_at AND $3 <= max_expires_at",
            returning_and_notify!()
        );
        let seen = i32::try_from(seen_extensions_used)
            .map_err(|_| StoreError::InvalidArgument("extensions_used is out of range"))?;
        self.query_opt(
            "extending a session",
            SQL,
            &[
                &id.as_uuid(),
                &seen,
                &new_expires_at,
                &SessionStatus::Running.as_str(),
            ],
        )
        .await
    }

    /// Records the first time a provisioning stage was reached (later calls keep the first
    /// instant). `false` if the session is not live.
    pub async fn record_stage(&self, id: SessionId, stage: Stage) -> Result<bool, StoreError> {
        let sql = match stage {
            Stage::VmCreated => {
                concat!(
                    "UPDATE sessions SET vm_created_at = COALESCE(vm_created_at, now()), \
                     updated_at = now() WHERE id = $1 AND status = ANY($2)",
                    notify_progress!()
                )
            }
            Stage::VmiRunning => {
                concat!(
                    "UPDATE sessions SET vmi_running_at = COALESCE(vmi_running_at, now()), \
                     updated_at = now() WHERE id = $1 AND status = ANY($2)",
                    notify_progress!()
                )
            }
            Stage::AgentUp => {
                concat!(
                    "UPDATE sessions SET agent_up_at = COALESCE(agent_up_at, now()), \
                     updated_at = now() WHERE id = $1 AND status = ANY($2)",
                    notify_progress!()
                )
            }
        };
        self.execute(
            "recording a provisioning stage",
            sql,
            &[&id.as_uuid(), &names(&SessionStatus::LIVE)],
        )
        .await
    }

    /// Records the root disk decision and its reason. `false` if the session is not live.
    pub async fn record_disk(
        &self,
        id: SessionId,
        kind: DiskKind,
        reason: &str,
    ) -> Result<bool, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET disk_kind = $2, disk_reason = $3, \
             updated_at = now() WHERE id = $1 AND status = ANY($4)",
            notify_progress!()
        );
        self.execute(
            "recording the disk decision",
            SQL,
            &[
                &id.as_uuid(),
                &kind.as_str(),
                &reason,
                &names(&SessionStatus::LIVE),
            ],
        )
        .await
    }

    /// Records the session's VMs (or pod), one per lab node. `false` if it is not live.
    pub async fn record_vms(&self, id: SessionId, vms: &[SessionVm]) -> Result<bool, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET node_names = $2, vm_names = $3, \
             updated_at = now() WHERE id = $1 AND status = ANY($4)",
            notify_progress!()
        );
        let nodes: Vec<&str> = vms.iter().map(|v| v.node.as_str()).collect();
        let names_: Vec<&str> = vms.iter().map(|v| v.name.as_str()).collect();
        self.execute(
            "recording the session's VMs",
            SQL,
            &[&id.as_uuid(), &nodes, &names_, &names(&SessionStatus::LIVE)],
        )
        .await
    }

    /// Records why provisioning failed. `false` if the session is not live.
    pub async fn record_failure_reason(
        &self,
        id: SessionId,
        reason: &str,
    ) -> Result<bool, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET failure_reason = $2, updated_at = now() \
             WHERE id = $1 AND status = ANY($3)",
            notify_progress!()
        );
        self.execute(
            "recording a failure reason",
            SQL,
            &[&id.as_uuid(), &reason, &names(&SessionStatus::LIVE)],
        )
        .await
    }
}

/// A finishing session whose objects' deletions were accepted but that are still there
/// (`sessions.terminating_objects`, schema version 6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminatingSession {
    /// The session.
    pub id: SessionId,
    /// Its environment.
    pub env: EnvName,
    /// Its lesson.
    pub lesson: LessonId,
    /// The final status it is heading for.
    pub finishing_to: Option<FinalStatus>,
    /// Its objects still terminating at the last look, as `Kind/name`.
    pub objects: Vec<String>,
    /// Since when some object of it has been seen terminating (database clock).
    pub since: DateTime<Utc>,
}

/// Gone means gone (schema version 6): a finishing session goes final only once its objects
/// are confirmed absent, and the ones still terminating are recorded meanwhile.
impl Sessions<'_> {
    /// finishing → its recorded final status, once every cluster object of the session was
    /// looked for after its deletion and found absent. Sets `reclaimed_at` and
    /// `objects_gone_at`, and clears what was recorded as terminating.
    pub async fn complete_objects_gone(
        &self,
        id: SessionId,
    ) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = finishing_to, finishing_to = NULL, \
             reclaimed_at = now(), objects_gone_at = now(), terminating_objects = '{}', \
             updated_at = now() \
             WHERE id = $1 AND status = $2 AND finishing_to = ANY($3)",
            returning_and_notify!()
        );
        for target in FinalStatus::ALL {
            ensure(&[SessionStatus::Finishing], target.status())?;
        }
        let targets: Vec<&str> = FinalStatus::ALL.iter().map(|t| t.as_str()).collect();
        self.query_opt(
            "completing a session whose objects are gone",
            SQL,
            &[&id.as_uuid(), &SessionStatus::Finishing.as_str(), &targets],
        )
        .await
    }

    /// Records which objects (`Kind/name`) of a finishing session are still terminating after
    /// their deletions were accepted; `terminating_since` keeps the first time any was seen.
    /// `false` if the session is not finishing.
    pub async fn record_terminating(
        &self,
        id: SessionId,
        objects: &[String],
    ) -> Result<bool, StoreError> {
        const SQL: &str = "UPDATE sessions SET terminating_objects = $2, \
             terminating_since = COALESCE(terminating_since, now()), updated_at = now() \
             WHERE id = $1 AND status = $3";
        self.execute(
            "recording objects still terminating",
            SQL,
            &[&id.as_uuid(), &objects, &SessionStatus::Finishing.as_str()],
        )
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

    /// What of session `id` is still terminating, as last recorded: `None` when nothing is
    /// (the session is not finishing, or no object of it was seen lingering).
    pub async fn terminating_of(
        &self,
        id: SessionId,
    ) -> Result<Option<TerminatingSession>, StoreError> {
        const SQL: &str = "SELECT id, env, lesson, finishing_to, terminating_objects, \
             terminating_since FROM sessions \
             WHERE id = $1 AND status = $2 AND terminating_since IS NOT NULL \
             AND cardinality(terminating_objects) > 0";
        const WHAT: &str = "reading what of a session is still terminating";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let row = client
            .query_opt(
                &statement,
                &[&id.as_uuid(), &SessionStatus::Finishing.as_str()],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        row.as_ref().map(terminating_from_row).transpose()
    }
}

/// A [`TerminatingSession`] from a row of `id, env, lesson, finishing_to,
/// terminating_objects, terminating_since`.
fn terminating_from_row(row: &Row) -> Result<TerminatingSession, StoreError> {
    Ok(TerminatingSession {
        id: SessionId::from_uuid(get(row, "id")?),
        env: parse(row, "env")?,
        lesson: parse(row, "lesson")?,
        finishing_to: parse_opt(row, "finishing_to")?,
        objects: get(row, "terminating_objects")?,
        since: get(row, "terminating_since")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fixed_transition_is_allowed_by_the_model() {
        for (from, to) in [TO_RUNNING, EXPIRING, STUCK_FAILING, TO_GHOST] {
            assert!(ensure(from, to).is_ok(), "{from:?} -> {to}");
        }
        for target in FinalStatus::ALL {
            assert!(SessionStatus::Finishing.can_become(target.status()));
        }
    }

    #[test]
    fn forbidden_transitions_are_refused_before_the_database() {
        for from in SessionStatus::ALL {
            for to in SessionStatus::ALL {
                let r = ensure(&[from], to);
                assert_eq!(r.is_ok(), from.can_become(to), "{from} -> {to}");
            }
        }
        let err = ensure(
            &[SessionStatus::Running, SessionStatus::Expired],
            SessionStatus::Finishing,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "a session cannot go from expired to finishing"
        );
        assert!(matches!(
            ensure(&[], SessionStatus::Running),
            Err(StoreError::InvalidArgument(_))
        ));
    }

    #[test]
    fn disk_kinds_round_trip() {
        for k in [DiskKind::Golden, DiskKind::Container] {
            assert_eq!(k.as_str().parse::<DiskKind>().unwrap(), k);
        }
        assert!("ceph".parse::<DiskKind>().is_err());
    }
}
