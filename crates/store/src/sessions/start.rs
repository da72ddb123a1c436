//! The server's side of a student's session: opening it (one live session per user, decided
//! by the database's unique index), the capacity check's count of live VMs, the expected time
//! to ready, each provisioning stage recorded as it is reached, starting → running, and the
//! student's extensions.

use chrono::{DateTime, Utc};
use tokio_postgres::error::SqlState;
use ttlab_model::{
    ClassId, EnvName, LessonId, Runtime, SessionId, SessionStatus, SiteName, UserId,
};
use uuid::Uuid;

use super::{DiskKind, Session, SessionTimes, SessionVm, Sessions, TO_RUNNING, ensure, names};
use crate::StoreError;

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
    /// The site its VMs are created on.
    pub site: SiteName,
    /// Its lifespan.
    pub times: SessionTimes,
    /// If it is not running by then, it is failed and reclaimed.
    pub readiness_deadline: DateTime<Utc>,
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
            site: &new.site,
            times: &new.times,
            readiness_deadline: new.readiness_deadline,
            class: None,
        },
    )
    .await
}

/// The values of a new `starting` row; `user` is `None` for a warm-pool member.
pub(super) struct NewRow<'a> {
    pub(super) id: SessionId,
    pub(super) user: Option<&'a UserId>,
    pub(super) lesson: &'a LessonId,
    pub(super) runtime: Runtime,
    pub(super) env: &'a EnvName,
    pub(super) site: &'a SiteName,
    pub(super) times: &'a SessionTimes,
    pub(super) readiness_deadline: DateTime<Utc>,
    pub(super) class: Option<ClassId>,
}

pub(super) async fn insert_row(
    client: &tokio_postgres::Client,
    new: NewRow<'_>,
) -> Result<Session, InsertError> {
    const SQL: &str = concat!(
        "INSERT INTO sessions (id, user_id, lesson, runtime, env, status, started_at, \
         expires_at, max_expires_at, readiness_deadline, pool_member, class_id, site) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
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
                &new.class.map(|c| c.as_uuid()),
                &new.site.as_str(),
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
pub(super) fn is_live_exists(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::UNIQUE_VIOLATION)
        && e.as_db_error().and_then(|d| d.constraint()) == Some("sessions_one_live_per_user")
}

impl Sessions<'_> {
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

    /// The VMs that live VM sessions of every environment sharing this database hold or are
    /// about to create: per session, its id, lesson and recorded VM names (empty while its
    /// VMs are not recorded yet). Only these columns are read, in one statement, so the
    /// capacity check stays cheap with many live sessions.
    pub async fn live_vm_sessions_all_envs(
        &self,
    ) -> Result<Vec<(SessionId, LessonId, Vec<String>)>, StoreError> {
        Ok(self
            .live_vm_sessions_by_site()
            .await?
            .into_values()
            .flatten()
            .collect())
    }

    /// [`Self::live_vm_sessions_all_envs`] of one site: the live VM sessions of every
    /// environment whose row records `site`.
    pub async fn live_vm_sessions_of_site(
        &self,
        site: &ttlab_model::SiteName,
    ) -> Result<Vec<(SessionId, LessonId, Vec<String>)>, StoreError> {
        const WHAT: &str = "listing live VM sessions of a site";
        const SQL: &str = "SELECT id, lesson, vm_names FROM sessions \
             WHERE status = ANY($1) AND runtime = $2 AND site = $3";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let rows = client
            .query(
                &statement,
                &[
                    &names(&SessionStatus::LIVE),
                    &Runtime::Vm.as_str(),
                    &site.as_str(),
                ],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter().map(|row| live_vm_session(row, WHAT)).collect()
    }

    /// [`Self::live_vm_sessions_all_envs`] grouped by the site each row records, in one
    /// statement: what a start on several sites reads once for all of them.
    pub async fn live_vm_sessions_by_site(
        &self,
    ) -> Result<
        std::collections::BTreeMap<ttlab_model::SiteName, Vec<(SessionId, LessonId, Vec<String>)>>,
        StoreError,
    > {
        const WHAT: &str = "listing live VM sessions by site";
        const SQL: &str = "SELECT id, lesson, vm_names, site FROM sessions \
             WHERE status = ANY($1) AND runtime = $2";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let rows = client
            .query(
                &statement,
                &[&names(&SessionStatus::LIVE), &Runtime::Vm.as_str()],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        let mut by_site: std::collections::BTreeMap<_, Vec<_>> = Default::default();
        for row in &rows {
            let site: ttlab_model::SiteName = crate::rows::parse(row, "site")?;
            by_site
                .entry(site)
                .or_default()
                .push(live_vm_session(row, WHAT)?);
        }
        Ok(by_site)
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

    /// starting → running for a warm-pool member, only if it is still unclaimed (`claimed`
    /// false) or already claimed (`claimed` true): a member claimed while it was being
    /// prepared is handed over (token rotation, deadline re-arm) before it runs for its
    /// student, so its provisioner marks it running unclaimed — or, finding it claimed,
    /// hands it over first and then marks it running claimed. `None` when the row is not a
    /// `starting` member in that claim state (re-read and decide again).
    pub async fn mark_member_running(
        &self,
        id: SessionId,
        claimed: bool,
    ) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = $2, ready_at = now(), updated_at = now() \
             WHERE id = $1 AND status = ANY($3) AND pool_member \
             AND (claimed_at IS NOT NULL) = $4",
            returning_and_notify!()
        );
        let (from, to) = TO_RUNNING;
        ensure(from, to)?;
        self.query_opt(
            "marking a pool member running",
            SQL,
            &[&id.as_uuid(), &to.as_str(), &names(from), &claimed],
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

/// One row of `SELECT id, lesson, vm_names` of a live VM session (the capacity check's view).
fn live_vm_session(
    row: &tokio_postgres::Row,
    what: &'static str,
) -> Result<(SessionId, LessonId, Vec<String>), StoreError> {
    let id: Uuid = row.try_get(0).map_err(StoreError::query(what))?;
    let lesson: &str = row.try_get(1).map_err(StoreError::query(what))?;
    let vms: Vec<String> = row.try_get(2).map_err(StoreError::query(what))?;
    let lesson = lesson
        .parse()
        .map_err(|e| StoreError::corrupt("lesson", e))?;
    Ok((SessionId::from_uuid(id), lesson, vms))
}
