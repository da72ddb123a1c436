//! The reaper's side: what is due in an environment, or in one of its sites (expired running
//! sessions, starting sessions past their readiness deadline, the next deadline to sleep
//! until), and the
//! transitions only it makes (running → finishing on expiry, stuck starting → finishing,
//! running → ghost).

use chrono::{DateTime, Utc};
use ttlab_model::{EnvName, FinalStatus, SessionId, SessionStatus, SiteName};

use super::{EXPIRING, STUCK_FAILING, Session, Sessions, TO_GHOST, ensure, limit, names};
use crate::StoreError;

impl Sessions<'_> {
    /// Running sessions of `env` whose `expires_at` is at or before `until`, soonest first.
    /// With `until` = the database's now, these are the expired ones (the reaper confirms
    /// each with `ttlab-lifespan` and [`Sessions::begin_expiring`]).
    pub async fn list_expired(
        &self,
        env: &EnvName,
        until: DateTime<Utc>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        self.expired_on(env, None, until, n).await
    }

    /// [`Sessions::list_expired`], of one site's sessions only.
    pub async fn list_expired_on(
        &self,
        env: &EnvName,
        site: &SiteName,
        until: DateTime<Utc>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        self.expired_on(env, Some(site), until, n).await
    }

    async fn expired_on(
        &self,
        env: &EnvName,
        site: Option<&SiteName>,
        until: DateTime<Utc>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE env = $1 AND status = $2 AND expires_at <= $3 \
             AND ($5::text IS NULL OR site = $5) ORDER BY expires_at, id LIMIT $4"
        );
        self.query_all(
            "listing expired sessions",
            SQL,
            &[
                &env.as_str(),
                &SessionStatus::Running.as_str(),
                &until,
                &limit(n),
                &site.map(SiteName::as_str),
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
        self.stuck_starting_on(env, None, now, n).await
    }

    /// [`Sessions::list_stuck_starting`], of one site's sessions only.
    pub async fn list_stuck_starting_on(
        &self,
        env: &EnvName,
        site: &SiteName,
        now: DateTime<Utc>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        self.stuck_starting_on(env, Some(site), now, n).await
    }

    async fn stuck_starting_on(
        &self,
        env: &EnvName,
        site: Option<&SiteName>,
        now: DateTime<Utc>,
        n: u32,
    ) -> Result<Vec<Session>, StoreError> {
        const SQL: &str = concat!(
            "SELECT ",
            columns!(),
            " FROM sessions WHERE env = $1 AND status = $2 AND readiness_deadline <= $3 \
             AND ($5::text IS NULL OR site = $5) ORDER BY readiness_deadline, id LIMIT $4"
        );
        self.query_all(
            "listing stuck sessions",
            SQL,
            &[
                &env.as_str(),
                &SessionStatus::Starting.as_str(),
                &now,
                &limit(n),
                &site.map(SiteName::as_str),
            ],
        )
        .await
    }

    /// The earliest instant something in `env` becomes due: a running session's expiry or a
    /// starting session's readiness deadline. `None` when nothing is pending. The reaper sleeps
    /// until then (or until a [`Channel::SessionsChanged`](crate::Channel) notification).
    pub async fn next_deadline(&self, env: &EnvName) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.next_deadline_of(env, None).await
    }

    /// [`Sessions::next_deadline`], of one site's sessions only.
    pub async fn next_deadline_on(
        &self,
        env: &EnvName,
        site: &SiteName,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.next_deadline_of(env, Some(site)).await
    }

    async fn next_deadline_of(
        &self,
        env: &EnvName,
        site: Option<&SiteName>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        const SQL: &str = "SELECT LEAST(\
             (SELECT min(expires_at) FROM sessions WHERE env = $1 AND status = $2 \
              AND ($4::text IS NULL OR site = $4)), \
             (SELECT min(readiness_deadline) FROM sessions WHERE env = $1 AND status = $3 \
              AND ($4::text IS NULL OR site = $4)))";
        let client = self.store.client().await?;
        let row = client
            .query_one(
                SQL,
                &[
                    &env.as_str(),
                    &SessionStatus::Running.as_str(),
                    &SessionStatus::Starting.as_str(),
                    &site.map(SiteName::as_str),
                ],
            )
            .await
            .map_err(StoreError::query("reading the next deadline"))?;
        row.try_get(0)
            .map_err(StoreError::query("reading the next deadline"))
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
}
