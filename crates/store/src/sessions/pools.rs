//! Warm-pool members: rows opened with no user, provisioned like a session, and claimed by
//! a student's "Start lab" in one statement (the warm pools' refiller and claim in the
//! server; [`Pools`](crate::Pools) counts and lists them).

use chrono::{DateTime, Utc};
use ttlab_model::{ClassId, EnvName, LessonId, Runtime, SessionId, SiteName, UserId};

use super::start::{InsertError, NewRow, exists_error, insert_row, is_live_exists};
use super::{Session, SessionTimes, Sessions, opt_session};
use crate::StoreError;

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
    /// The site its VMs are created on (a claimed member stays there).
    pub site: SiteName,
    /// Its age limit, as a lifespan: it is expired at `expires_at` unless claimed before.
    pub times: SessionTimes,
    /// If it is not running by then, it is failed and reclaimed.
    pub readiness_deadline: DateTime<Utc>,
    /// The scheduled class it is prepared for, if any (schema version 13): that class's
    /// students claim it first, and nobody else takes it until the class ends.
    pub class: Option<ClassId>,
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
    /// The class the user is a student of now, if any (schema version 13): its members are
    /// taken first, and the session records it.
    pub class: Option<ClassId>,
    /// When no member is ready, a member still being prepared may be claimed if it was
    /// created less than this long ago (younger ones are expected ready sooner than a fresh
    /// start would be; an older one may be stuck). `None`: ready members only.
    pub preparing_within: Option<std::time::Duration>,
}

/// The longest lifespan a claim may ask for (ten years; far beyond any policy).
const LIFESPAN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10 * 365 * 24 * 3600);

/// A member whose age limit (`expires_at`) is this close is left to the reaper, not claimed.
pub const CLAIM_MARGIN: std::time::Duration = std::time::Duration::from_secs(120);

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
        site: &new.site,
        times: &new.times,
        readiness_deadline: new.readiness_deadline,
        class: new.class,
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

impl Sessions<'_> {
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
    /// Scheduled classes (schema version 13): a student of `claim.class` takes a member
    /// prepared for that class first, then an ordinary one; nobody takes a member prepared for
    /// another class that is neither cancelled nor over (so a student outside a class never
    /// drains its members from its lead-in to its end). The claimed row records the claimer's
    /// class (`class`), which is how a class's started seats are counted.
    ///
    /// With [`PoolClaim::preparing_within`], when no member is ready a member still being
    /// prepared (status `starting`, created within that time) is claimed instead, the oldest
    /// first (the nearest to ready): it stays `starting` for its student, and its
    /// provisioner hands it over when it is ready ([`Sessions::mark_member_running`]).
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
             max_expires_at = now() + $5::float8 * interval '1 second', updated_at = now(), \
             class_id = $7::uuid \
             WHERE id = (SELECT s.id FROM sessions s WHERE s.env = $1 AND s.lesson = $2 \
               AND s.pool_member AND s.claimed_at IS NULL \
               AND (s.status = 'running' OR (s.status = 'starting' \
                 AND s.created_at > now() - $8::float8 * interval '1 second')) \
               AND s.expires_at > now() + $6::float8 * interval '1 second' \
               AND (s.class_id IS NULL OR s.class_id = $7::uuid OR NOT EXISTS ( \
                 SELECT 1 FROM classes c WHERE c.id = s.class_id \
                   AND c.cancelled_at IS NULL AND c.ends_at > now())) \
               ORDER BY s.status = 'running' DESC, (s.class_id = $7::uuid) IS TRUE DESC, \
                 s.ready_at, s.created_at, s.id \
               LIMIT 1 FOR UPDATE OF s SKIP LOCKED) \
             AND pool_member AND claimed_at IS NULL AND status IN ('running', 'starting')",
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
        // No preparing member is young enough for a negative age.
        let preparing = claim.preparing_within.map_or(-1.0, |d| d.as_secs_f64());
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
                        &claim.class.map(|c| c.as_uuid()),
                        &preparing,
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

    /// A claimed member whose hand-over failed (its agent could not be re-armed or given its
    /// new token): released from `user` — so the same click can give them another member, or
    /// open a cold session, at once — and moved to `finishing` heading for `failed` with
    /// `reason`, in one statement that also records a `handover_failed` pool event (counted by
    /// [`Pools::counts`](crate::Pools::counts)). The row is then an unclaimed member being
    /// retired: its objects are deleted as for any finishing session. `None` if it is no longer
    /// `user`'s running claimed member (someone else is ending it).
    pub async fn release_failed_claim(
        &self,
        id: SessionId,
        user: &UserId,
        reason: &str,
    ) -> Result<Option<Session>, StoreError> {
        const SQL: &str = concat!(
            "WITH released AS (UPDATE sessions SET user_id = NULL, claimed_at = NULL, \
             status = 'finishing', finishing_to = 'failed', \
             finished_at = COALESCE(finished_at, now()), failure_reason = $3, updated_at = now() \
             WHERE id = $1 AND user_id = $2 AND pool_member AND claimed_at IS NOT NULL \
             AND status = 'running'",
            returning_and_notify!(),
            "), event AS (INSERT INTO pool_events (env, lesson, kind) \
             SELECT env, lesson, 'handover_failed' FROM released) \
             SELECT ",
            columns!(),
            " FROM released"
        );
        self.query_opt(
            "releasing a member whose hand-over failed",
            SQL,
            &[&id.as_uuid(), &user.as_str(), &reason],
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
}
