//! The `admin_actions` table: what operators did to sessions — ending one, extending one
//! beyond the student's own extensions — with who, when, how much and why.
//!
//! An operator's extension moves the session's expiry and records the action in one
//! statement, conditional on the expiry the caller read (so two operators, or an operator and
//! the student, racing on the same session cannot both apply) and on the row still running
//! and unexpired by the database clock; the new expiry itself is computed by
//! `ttlab-lifespan`, never here, and never passes the row's `max_expires_at`. Ending is
//! recorded once the session's move to finishing applied. Rows are never updated.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::Row;
use ttlab_model::{SessionId, SessionStatus, UserId};

use crate::notify::channel_sessions_changed;
use crate::rows::{get, parse};
use crate::{Store, StoreError};

/// What an operator did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr)]
#[strum(
    serialize_all = "snake_case",
    parse_err_ty = String,
    parse_err_fn = unknown_action
)]
pub enum AdminActionKind {
    /// Ended the session (it is reclaimed like a finished one).
    End,
    /// Moved its expiry later, beyond the student's extensions.
    Extend,
}

impl AdminActionKind {
    /// The name stored and shown: `end` or `extend`.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

fn unknown_action(s: &str) -> String {
    format!("unknown admin action {s:?}")
}

/// One recorded action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AdminAction {
    /// Row id (increasing).
    pub id: i64,
    /// The session acted on.
    pub session: SessionId,
    /// The operator.
    pub admin: UserId,
    /// What was done.
    pub action: AdminActionKind,
    /// When (database clock).
    pub at: DateTime<Utc>,
    /// Why, as the operator wrote it.
    pub reason: String,
    /// An extension: the expiry before.
    pub expires_before: Option<DateTime<Utc>>,
    /// An extension: the expiry after.
    pub expires_after: Option<DateTime<Utc>>,
    /// An extension: the seconds it added.
    pub added_seconds: Option<u32>,
}

/// The longest reason accepted, in characters.
pub const MAX_REASON_CHARS: usize = 500;

const COLUMNS: &str = "id, session_id, admin, action, at, reason, expires_before, expires_after, \
                       added_seconds";

impl AdminAction {
    fn from_row(row: &Row) -> Result<Self, StoreError> {
        let added: Option<i32> = get(row, "added_seconds")?;
        Ok(Self {
            id: get(row, "id")?,
            session: SessionId::from_uuid(get(row, "session_id")?),
            admin: parse(row, "admin")?,
            action: parse(row, "action")?,
            at: get(row, "at")?,
            reason: get(row, "reason")?,
            expires_before: get(row, "expires_before")?,
            expires_after: get(row, "expires_after")?,
            added_seconds: added.and_then(|n| u32::try_from(n).ok()),
        })
    }
}

/// Queries on `admin_actions`, from [`Store::admin_actions`].
#[derive(Debug, Clone, Copy)]
pub struct AdminActions<'a> {
    store: &'a Store,
}

fn check_reason(reason: &str) -> Result<(), StoreError> {
    let n = reason.trim().chars().count();
    if n == 0 {
        return Err(StoreError::InvalidArgument(
            "an admin action needs a reason",
        ));
    }
    if n > MAX_REASON_CHARS {
        return Err(StoreError::InvalidArgument(
            "an admin action's reason is longer than 500 characters",
        ));
    }
    Ok(())
}

impl<'a> AdminActions<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Moves a running session's expiry from `seen_expires_at` to `new_expires_at` (from
    /// `ttlab-lifespan`; no student extension is used up) and records the action, in one
    /// statement. `None` when the row no longer runs with that expiry, has expired by the
    /// database clock, or `new_expires_at` is not later or passes `max_expires_at`: re-read
    /// and decide again.
    pub async fn extend(
        &self,
        session: SessionId,
        admin: &UserId,
        seen_expires_at: DateTime<Utc>,
        new_expires_at: DateTime<Utc>,
        reason: &str,
    ) -> Result<Option<AdminAction>, StoreError> {
        check_reason(reason)?;
        let added = (new_expires_at - seen_expires_at).num_seconds();
        let added =
            i32::try_from(added)
                .ok()
                .filter(|n| *n > 0)
                .ok_or(StoreError::InvalidArgument(
                    "an extension must add between 1 s and 68 years",
                ))?;
        let sql = format!(
            "WITH moved AS (\
                UPDATE sessions SET expires_at = $4, updated_at = now() \
                WHERE id = $1 AND status = $7 AND expires_at = $3 AND expires_at > now() \
                AND $4 > expires_at AND $4 <= max_expires_at \
                RETURNING id, pg_notify('{}', env)) \
             INSERT INTO admin_actions \
                (session_id, admin, action, reason, expires_before, expires_after, added_seconds) \
             SELECT id, $2, 'extend', $5, $3, $4, $6 FROM moved \
             RETURNING {COLUMNS}",
            channel_sessions_changed!()
        );
        let client = self.store.client().await?;
        let row = client
            .query_opt(
                &sql,
                &[
                    &session.as_uuid(),
                    &admin.as_str(),
                    &seen_expires_at,
                    &new_expires_at,
                    &reason.trim(),
                    &added,
                    &SessionStatus::Running.as_str(),
                ],
            )
            .await
            .map_err(StoreError::query("extending a session as an operator"))?;
        row.as_ref().map(AdminAction::from_row).transpose()
    }

    /// Records that `admin` ended `session` (after its move to finishing applied).
    pub async fn record_end(
        &self,
        session: SessionId,
        admin: &UserId,
        reason: &str,
    ) -> Result<AdminAction, StoreError> {
        check_reason(reason)?;
        let sql = format!(
            "INSERT INTO admin_actions (session_id, admin, action, reason) \
             VALUES ($1, $2, 'end', $3) RETURNING {COLUMNS}"
        );
        let client = self.store.client().await?;
        let row = client
            .query_one(&sql, &[&session.as_uuid(), &admin.as_str(), &reason.trim()])
            .await
            .map_err(StoreError::query("recording an admin action"))?;
        AdminAction::from_row(&row)
    }

    /// The actions on `session`, oldest first.
    pub async fn for_session(&self, session: SessionId) -> Result<Vec<AdminAction>, StoreError> {
        let sql =
            format!("SELECT {COLUMNS} FROM admin_actions WHERE session_id = $1 ORDER BY at, id");
        let client = self.store.client().await?;
        let rows = client
            .query(&sql, &[&session.as_uuid()])
            .await
            .map_err(StoreError::query("reading admin actions"))?;
        rows.iter().map(AdminAction::from_row).collect()
    }

    /// The `limit` most recent actions on any session, newest first.
    pub async fn recent(&self, limit: u32) -> Result<Vec<AdminAction>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM admin_actions ORDER BY at DESC, id DESC LIMIT $1");
        let client = self.store.client().await?;
        let rows = client
            .query(&sql, &[&i64::from(limit)])
            .await
            .map_err(StoreError::query("reading admin actions"))?;
        rows.iter().map(AdminAction::from_row).collect()
    }
}
