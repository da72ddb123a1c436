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
//!
//! One handle, [`Sessions`], whose queries live in a file per user of them: this file holds
//! the row ([`Session`]), its decoding and the reads everyone makes (by id, by user, live
//! listings); `start` the server's opening and provisioning of a student's session (and its
//! extension); `pools` the warm pools' members and claims; `finish` the way every session
//! ends, for the server and the reaper alike (finishing, objects confirmed gone); `reaper`
//! the reaper's listings and transitions (expiry, stuck starts, ghosts, its next deadline);
//! `admin` the admin pages' history and lingering objects.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::Row;
use ttlab_lifespan::Lifespan;
use ttlab_model::{
    ClassId, EnvName, FinalStatus, LessonId, NodeName, Runtime, SessionId, SessionStatus, SiteName,
    UserId,
};
use uuid::Uuid;

use crate::rows::{get, non_negative, parse, parse_opt};
use crate::{Store, StoreError};

/// Every column of a session row, in the order [`Session::from_row`] reads them.
macro_rules! columns {
    () => {
        "id, user_id, lesson, runtime, env, status, finishing_to, started_at, expires_at, \
         max_expires_at, extensions_used, readiness_deadline, created_at, vm_created_at, \
         vmi_running_at, agent_up_at, ready_at, finished_at, reclaimed_at, disk_kind, \
         disk_reason, node_names, vm_names, failure_reason, updated_at, pool_member, claimed_at, \
         class_id, site"
    };
}

/// `RETURNING` list of a change the reaper should hear about.
macro_rules! returning_and_notify {
    () => {
        concat!(
            " RETURNING ",
            columns!(),
            ", pg_notify('",
            $crate::notify::channel_sessions_changed!(),
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
            $crate::notify::channel_sessions_changed!(),
            "', env)"
        )
    };
}

mod admin;
mod finish;
mod pools;
mod reaper;
mod start;

pub use finish::TerminatingSession;
pub(crate) use pools::insert_member_on;
pub use pools::{CLAIM_MARGIN, NewPoolMember, PoolClaim};
pub(crate) use start::{InsertError, exists_error, insert_on};
pub use start::{NewSession, Stage};

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

/// Which root disk a session got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr, strum::EnumCount)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = StoreError,
    parse_err_fn = unknown_disk_kind
)]
pub enum DiskKind {
    /// The golden PVC as a read-only base with a per-VM copy-on-write layer.
    Golden,
    /// A container disk.
    Container,
}

impl DiskKind {
    /// Every kind.
    pub const ALL: [DiskKind; <DiskKind as strum::EnumCount>::COUNT] =
        [Self::Golden, Self::Container];

    /// Lowercase name, as stored.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

fn unknown_disk_kind(s: &str) -> StoreError {
    StoreError::corrupt("disk_kind", format!("unknown disk kind {s:?}"))
}

/// One VM (or pod) of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionVm {
    /// The lab node it plays.
    pub node: NodeName,
    /// The Kubernetes object name.
    pub name: String,
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
    /// The site its VMs run on (schema version 17; `default` without a sites file).
    pub site: SiteName,
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
    /// The scheduled class it belongs to (schema version 13): the class an unclaimed member
    /// was prepared for, or the class a student started it in.
    pub class: Option<ClassId>,
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

    /// Its lifespan as `ttlab-lifespan` judges it (expired, extensions offered, the hard
    /// deadline): the one rule the countdown, the extend button and the reaper share.
    pub fn lifespan(&self) -> Lifespan {
        Lifespan {
            started_at: self.started_at,
            expires_at: self.expires_at,
            extensions_used: self.extensions_used,
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
            site: parse(row, "site")?,
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
            class: get::<Option<Uuid>>(row, "class_id")?.map(ClassId::from_uuid),
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

    /// Live sessions of `env`, unclaimed pool members included, by id, at most `limit`, after
    /// `after` (the last id of the previous page).
    pub async fn list_live(
        &self,
        env: &EnvName,
        after: Option<SessionId>,
        limit: u32,
    ) -> Result<Vec<Session>, StoreError> {
        self.list_with_statuses(env, None, &SessionStatus::LIVE, after, limit)
            .await
    }

    /// [`Sessions::list_live`], of one site's sessions only.
    pub async fn list_live_on(
        &self,
        env: &EnvName,
        site: &SiteName,
        after: Option<SessionId>,
        limit: u32,
    ) -> Result<Vec<Session>, StoreError> {
        self.list_with_statuses(env, Some(site), &SessionStatus::LIVE, after, limit)
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
        self.list_with_statuses(env, None, &[status], after, limit)
            .await
    }

    /// [`Sessions::list_in_status`], of one site's sessions only.
    pub async fn list_in_status_on(
        &self,
        env: &EnvName,
        site: &SiteName,
        status: SessionStatus,
        after: Option<SessionId>,
        limit: u32,
    ) -> Result<Vec<Session>, StoreError> {
        self.list_with_statuses(env, Some(site), &[status], after, limit)
            .await
    }

    async fn list_with_statuses(
        &self,
        env: &EnvName,
        site: Option<&SiteName>,
        statuses: &[SessionStatus],
        after: Option<SessionId>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE env = $1 AND status = ANY($2) \
             AND ($3::uuid IS NULL OR id > $3) AND ($5::text IS NULL OR site = $5) \
             ORDER BY id LIMIT $4"
        );
        self.query_all(
            "listing sessions",
            SQL,
            &[
                &env.as_str(),
                &names(statuses),
                &after.map(|a| a.as_uuid()),
                &limit(n),
                &site.map(SiteName::as_str),
            ],
        )
        .await
    }

    /// How many live sessions of `env` each site holds that is not in `known`, by site name
    /// (sessions on a site no longer configured). Empty when every live session's site is
    /// known.
    pub async fn live_on_other_sites(
        &self,
        env: &EnvName,
        known: &[SiteName],
    ) -> Result<Vec<(SiteName, u64)>, StoreError> {
        const WHAT: &str = "counting live sessions on other sites";
        const SQL: &str = "SELECT site, count(*) FROM sessions \
             WHERE env = $1 AND status = ANY($2) AND NOT (site = ANY($3)) \
             GROUP BY site ORDER BY site";
        let known: Vec<&str> = known.iter().map(SiteName::as_str).collect();
        let client = self.store.client().await?;
        let rows = client
            .query(SQL, &[&env.as_str(), &names(&SessionStatus::LIVE), &known])
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter()
            .map(|row| {
                let site: SiteName = crate::rows::parse(row, "site")?;
                let n: i64 = row.try_get(1).map_err(StoreError::query(WHAT))?;
                Ok((site, u64::try_from(n).unwrap_or(0)))
            })
            .collect()
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
