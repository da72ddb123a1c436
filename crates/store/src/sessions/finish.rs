//! How every session ends, for the server (a student's Finish, a failed provisioning) and the
//! reaper alike: live → finishing with the final status it is heading for, and finishing →
//! that status once its cluster objects are confirmed gone, the ones still terminating
//! recorded meanwhile (schema version 6).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_postgres::Row;
use ttlab_model::{EnvName, FinalStatus, LessonId, SessionId, SessionStatus};

use super::{Session, Sessions, ensure, names};
use crate::StoreError;
use crate::rows::{get, parse, parse_opt};

impl Sessions<'_> {
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

    /// finishing → its recorded final status: every cluster object of the session was
    /// confirmed deleted. Sets `reclaimed_at`.
    pub async fn complete_finishing(&self, id: SessionId) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "UPDATE sessions SET status = finishing_to, finishing_to = NULL, \
             reclaimed_at = now(), updated_at = now() \
             WHERE id = $1 AND status = $2 AND finishing_to = ANY($3)",
            returning_and_notify!()
        );
        self.land("completing a finishing session", SQL, id).await
    }

    /// finishing → its recorded final status, by `sql` (`$1` the id, `$2` finishing, `$3`
    /// the final statuses), which sets whatever else the landing records.
    async fn land(
        &self,
        what: &'static str,
        sql: &str,
        id: SessionId,
    ) -> Result<Option<Session>, StoreError> {
        for target in FinalStatus::ALL {
            ensure(&[SessionStatus::Finishing], target.status())?;
        }
        let targets: Vec<&str> = FinalStatus::ALL.iter().map(|t| t.as_str()).collect();
        self.query_opt(
            what,
            sql,
            &[&id.as_uuid(), &SessionStatus::Finishing.as_str(), &targets],
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
        self.land("completing a session whose objects are gone", SQL, id)
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
pub(super) fn terminating_from_row(row: &Row) -> Result<TerminatingSession, StoreError> {
    Ok(TerminatingSession {
        id: SessionId::from_uuid(get(row, "id")?),
        env: parse(row, "env")?,
        lesson: parse(row, "lesson")?,
        finishing_to: parse_opt(row, "finishing_to")?,
        objects: get(row, "terminating_objects")?,
        since: get(row, "terminating_since")?,
    })
}
