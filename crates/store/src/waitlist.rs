//! The `waitlist` table: students waiting for a place when the VM limit is reached.
//!
//! One entry per user (the primary key), served in enqueue order (`enqueued_at`, then
//! insertion order), except that entries put back at the front ([`Waitlist::requeue`]: a
//! start the namespace's quota refused at capacity) go before every other, in their own
//! enqueue order: the line is ordered by `(NOT front, enqueued_at, seq)`. The database
//! decides the order, whichever replica a student reached.
//! When places free, [`Waitlist::grant`] gives the first waiting entries a *hold* until a
//! deadline: during it, the capacity check counts the held places as taken for everybody
//! but the holder ([`Waitlist::reservations`]). A hold that lapses, or an entry that waited
//! longer than the maximum wait, is removed by the next grant; so is the entry of a user who
//! has a live session. Which entries get a hold is decided by [`plan_holds`], pure (`now`
//! passed in). Every change notifies [`Channel::SessionsChanged`](crate::Channel) with the
//! entry's environment, so event streams on every replica re-read.
//!
//! Grants must be serialised with session opens: the caller holds the capacity lock
//! ([`Store::lock_capacity`]) while it counts places and grants, so two replicas never give
//! the same place twice; the rows are also locked (`FOR UPDATE`) for the grant's transaction.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;
use tokio_postgres::Row;
use ttlab_model::{EnvName, LessonId, SessionStatus, UserId};

use crate::notify::channel_sessions_changed;
use crate::rows::{get, parse};
use crate::{Store, StoreError};

/// One entry of the waitlist, with its place in the queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WaitlistEntry {
    /// Who waits.
    pub user: UserId,
    /// For which lesson.
    pub lesson: LessonId,
    /// The environment of the server that enqueued it.
    pub env: EnvName,
    /// Places (VMs) the lesson needs.
    pub needed: u32,
    /// When it was enqueued (database clock).
    pub enqueued_at: DateTime<Utc>,
    /// 1 for the first in line.
    pub position: u32,
    /// While a place is held for this entry: until when.
    pub hold_until: Option<DateTime<Utc>>,
    /// Put back at the front of the line after a start the namespace's quota refused at
    /// capacity ([`Waitlist::requeue`]).
    pub front: bool,
}

/// What joining did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Joined {
    /// A new entry.
    New(WaitlistEntry),
    /// The user already waits (for this or another lesson): their entry, unchanged.
    Existing(WaitlistEntry),
}

/// Places the waitlist keeps from one user, for the capacity check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reservations {
    /// Places held (hold not lapsed) for other users.
    pub held_for_others: usize,
    /// Entries of other users ahead of this user (all of them if the user does not wait)
    /// that have no hold yet: a free place is theirs first.
    pub waiting_ahead: usize,
    /// This user's own hold, if one is current.
    pub own_hold: Option<DateTime<Utc>>,
}

/// What one grant did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GrantReport {
    /// Users given a hold now, first in line first.
    pub granted: Vec<UserId>,
    /// Users whose hold lapsed (removed).
    pub lapsed: Vec<UserId>,
    /// Entries removed because they waited longer than the maximum wait, or their user has a
    /// live session.
    pub removed: u64,
}

/// An entry as [`plan_holds`] sees it, in queue order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedEntry {
    /// Places it needs.
    pub needed: u32,
    /// Its hold, if any.
    pub hold_until: Option<DateTime<Utc>>,
}

/// Which entries of `queue` (in order) get a hold at `now`, given `free` places not taken by
/// sessions or VMs: current holds keep their places; then entries without a hold, first in
/// line first, get one while their need fits in what is left. Strictly in order: the first
/// waiting entry that does not fit stops the grant (a later, smaller lab does not pass it).
/// Lapsed holds (`hold_until <= now`) are the caller's to remove first; here they count as
/// nothing. Returns the indexes to grant.
pub fn plan_holds(queue: &[QueuedEntry], free: usize, now: DateTime<Utc>) -> Vec<usize> {
    let held: usize = queue
        .iter()
        .filter(|e| e.hold_until.is_some_and(|h| h > now))
        .map(|e| e.needed as usize)
        .sum();
    let mut left = free.saturating_sub(held);
    let mut grant = Vec::new();
    for (i, e) in queue.iter().enumerate() {
        if e.hold_until.is_some() {
            continue;
        }
        let needed = e.needed as usize;
        if needed > left {
            break;
        }
        left -= needed;
        grant.push(i);
    }
    grant
}

/// Queries on the `waitlist` table.
#[derive(Debug, Clone, Copy)]
pub struct Waitlist<'a> {
    store: &'a Store,
}

/// The columns of an entry with its position, from `waitlist w`.
const ENTRY: &str = "w.user_id, w.lesson, w.env, w.needed, w.enqueued_at, w.hold_until, \
     w.front, (SELECT count(*) FROM waitlist o \
       WHERE (NOT o.front, o.enqueued_at, o.seq) <= (NOT w.front, w.enqueued_at, w.seq)) \
     AS position";

/// The order of the line.
const LINE: &str = "(NOT front), enqueued_at, seq";

fn entry_from_row(row: &Row) -> Result<WaitlistEntry, StoreError> {
    let needed: i32 = get(row, "needed")?;
    let position: i64 = get(row, "position")?;
    Ok(WaitlistEntry {
        user: parse(row, "user_id")?,
        lesson: parse(row, "lesson")?,
        env: parse(row, "env")?,
        needed: u32::try_from(needed).map_err(|e| StoreError::corrupt("needed", e))?,
        enqueued_at: get(row, "enqueued_at")?,
        position: u32::try_from(position).unwrap_or(u32::MAX),
        hold_until: get(row, "hold_until")?,
        front: get(row, "front")?,
    })
}

fn live_names() -> Vec<&'static str> {
    SessionStatus::LIVE.iter().map(|s| s.as_str()).collect()
}

impl<'a> Waitlist<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Puts `user` on the waitlist for `lesson` (needing `needed` places), at the end of the
    /// queue; if they already wait, their entry is returned unchanged.
    pub async fn join(
        &self,
        user: &UserId,
        lesson: &LessonId,
        env: &EnvName,
        needed: u32,
    ) -> Result<Joined, StoreError> {
        const WHAT: &str = "joining the waitlist";
        let needed = i32::try_from(needed.max(1))
            .map_err(|_| StoreError::InvalidArgument("a lab needs too many places"))?;
        let sql = format!(
            "INSERT INTO waitlist (user_id, lesson, env, needed) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (user_id) DO NOTHING RETURNING pg_notify('{}', env)",
            channel_sessions_changed!()
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let inserted = client
            .query(
                &statement,
                &[&user.as_str(), &lesson.as_str(), &env.as_str(), &needed],
            )
            .await
            .map_err(StoreError::query(WHAT))?
            .len();
        drop(client);
        let entry = self.get(user).await?.ok_or(StoreError::Conflict {
            what: "the waitlist entry was removed as it was made",
        })?;
        Ok(if inserted > 0 {
            Joined::New(entry)
        } else {
            Joined::Existing(entry)
        })
    }

    /// Puts `user` back in the line for `lesson` at the front: ahead of every entry that
    /// joined normally, behind the entries requeued before it. For a start the namespace's
    /// quota refused at capacity (the session was rolled back, not failed). If the user waits
    /// already, their entry moves to the front. Call it once their session is final: a grant
    /// removes the entry of a user whose session is `starting` or `running`, but keeps a
    /// requeued one while the session it replaces is still `finishing`.
    pub async fn requeue(
        &self,
        user: &UserId,
        lesson: &LessonId,
        env: &EnvName,
        needed: u32,
    ) -> Result<WaitlistEntry, StoreError> {
        const WHAT: &str = "putting a student back in the line";
        let needed = i32::try_from(needed.max(1))
            .map_err(|_| StoreError::InvalidArgument("a lab needs too many places"))?;
        let sql = format!(
            "INSERT INTO waitlist (user_id, lesson, env, needed, front) \
             VALUES ($1, $2, $3, $4, true) \
             ON CONFLICT (user_id) DO UPDATE SET front = true \
             RETURNING pg_notify('{}', env)",
            channel_sessions_changed!()
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        client
            .query(
                &statement,
                &[&user.as_str(), &lesson.as_str(), &env.as_str(), &needed],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        drop(client);
        self.get(user).await?.ok_or(StoreError::Conflict {
            what: "the waitlist entry was removed as it was made",
        })
    }

    /// The user's entry and position, if they wait.
    pub async fn get(&self, user: &UserId) -> Result<Option<WaitlistEntry>, StoreError> {
        const WHAT: &str = "reading a waitlist entry";
        let sql = format!("SELECT {ENTRY} FROM waitlist w WHERE w.user_id = $1");
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        client
            .query_opt(&statement, &[&user.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?
            .as_ref()
            .map(entry_from_row)
            .transpose()
    }

    /// Every entry, first in line first (for operators and tests).
    pub async fn list(&self) -> Result<Vec<WaitlistEntry>, StoreError> {
        const WHAT: &str = "listing the waitlist";
        let sql =
            format!("SELECT {ENTRY} FROM waitlist w ORDER BY (NOT w.front), w.enqueued_at, w.seq");
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let rows = client
            .query(&statement, &[])
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter().map(entry_from_row).collect()
    }

    /// Whether anybody waits (cheap: the grant tick runs only then).
    pub async fn any(&self) -> Result<bool, StoreError> {
        const WHAT: &str = "looking at the waitlist";
        let (client, statement) = self
            .store
            .prepared(WHAT, "SELECT EXISTS (SELECT 1 FROM waitlist)")
            .await?;
        let row = client
            .query_one(&statement, &[])
            .await
            .map_err(StoreError::query(WHAT))?;
        row.try_get(0).map_err(StoreError::query(WHAT))
    }

    /// Removes the user's entry (they leave, or they took their place). Whether one was there.
    pub async fn remove(&self, user: &UserId) -> Result<bool, StoreError> {
        const WHAT: &str = "leaving the waitlist";
        let sql = format!(
            "DELETE FROM waitlist WHERE user_id = $1 RETURNING pg_notify('{}', env)",
            channel_sessions_changed!()
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let rows = client
            .query(&statement, &[&user.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        Ok(!rows.is_empty())
    }

    /// The places the waitlist keeps from `user` at `now` (see [`Reservations`]).
    pub async fn reservations(
        &self,
        user: &UserId,
        now: DateTime<Utc>,
    ) -> Result<Reservations, StoreError> {
        const WHAT: &str = "counting the waitlist's holds";
        const SQL: &str = "WITH me AS (SELECT front, enqueued_at, seq, hold_until FROM waitlist \
             WHERE user_id = $1) \
             SELECT \
               coalesce(sum(w.needed) FILTER (WHERE w.user_id <> $1 AND w.hold_until > $2), 0)::int8 \
                 AS held, \
               count(*) FILTER (WHERE w.user_id <> $1 AND w.hold_until IS NULL AND \
                 (NOT EXISTS (SELECT 1 FROM me) OR \
                  (NOT w.front, w.enqueued_at, w.seq) < (SELECT NOT front, enqueued_at, seq FROM me))) \
                 ::int8 AS ahead, \
               (SELECT hold_until FROM me WHERE hold_until > $2) AS own \
             FROM waitlist w";
        let (client, statement) = self.store.prepared(WHAT, SQL).await?;
        let row = client
            .query_one(&statement, &[&user.as_str(), &now])
            .await
            .map_err(StoreError::query(WHAT))?;
        let held: i64 = row.try_get("held").map_err(StoreError::query(WHAT))?;
        let ahead: i64 = row.try_get("ahead").map_err(StoreError::query(WHAT))?;
        Ok(Reservations {
            held_for_others: usize::try_from(held).unwrap_or(usize::MAX),
            waiting_ahead: usize::try_from(ahead).unwrap_or(usize::MAX),
            own_hold: row.try_get("own").map_err(StoreError::query(WHAT))?,
        })
    }

    /// One grant at `now`, in one transaction: removes lapsed holds, entries older than
    /// `max_wait` and entries of users with a live session (but not a requeued entry while
    /// the session it replaces is `finishing`), then gives holds of `hold` to the
    /// first waiting entries that fit in `free` places (places not taken by sessions or VMs;
    /// current holds are subtracted here), as [`plan_holds`] decides. Call it while holding
    /// the capacity lock, with `free` counted under it.
    pub async fn grant(
        &self,
        free: usize,
        now: DateTime<Utc>,
        hold: Duration,
        max_wait: Duration,
    ) -> Result<GrantReport, StoreError> {
        const WHAT: &str = "granting waitlist holds";
        let hold = TimeDelta::from_std(hold)
            .map_err(|_| StoreError::InvalidArgument("the waitlist hold is too long"))?;
        let max_wait = TimeDelta::from_std(max_wait)
            .map_err(|_| StoreError::InvalidArgument("the waitlist's maximum wait is too long"))?;
        let mut client = self.store.client().await?;
        let tx = client
            .transaction()
            .await
            .map_err(StoreError::query(WHAT))?;
        let notify = channel_sessions_changed!();
        let lapsed_rows = tx
            .query(
                &format!(
                    "DELETE FROM waitlist WHERE hold_until <= $1 \
                     RETURNING user_id, pg_notify('{notify}', env)"
                ),
                &[&now],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        let mut report = GrantReport::default();
        for row in &lapsed_rows {
            let user: &str = row.try_get(0).map_err(StoreError::query(WHAT))?;
            report.lapsed.push(
                user.parse()
                    .map_err(|e| StoreError::corrupt("user_id", e))?,
            );
        }
        let removed = tx
            .query(
                &format!(
                    "DELETE FROM waitlist w WHERE (w.enqueued_at <= $1 AND w.hold_until IS NULL) \
                     OR EXISTS (SELECT 1 FROM sessions s WHERE s.user_id = w.user_id \
                                AND s.status = ANY($2) \
                                AND NOT (w.front AND s.status = $3)) \
                     RETURNING pg_notify('{notify}', w.env)"
                ),
                &[
                    &(now - max_wait),
                    &live_names(),
                    &SessionStatus::Finishing.as_str(),
                ],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        report.removed = removed.len() as u64;
        let rows = tx
            .query(
                &format!(
                    "SELECT user_id, needed, hold_until FROM waitlist ORDER BY {LINE} FOR UPDATE"
                ),
                &[],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        let mut queue = Vec::with_capacity(rows.len());
        let mut users = Vec::with_capacity(rows.len());
        for row in &rows {
            let user: String = row.try_get(0).map_err(StoreError::query(WHAT))?;
            let needed: i32 = row.try_get(1).map_err(StoreError::query(WHAT))?;
            queue.push(QueuedEntry {
                needed: u32::try_from(needed).unwrap_or(1),
                hold_until: row.try_get(2).map_err(StoreError::query(WHAT))?,
            });
            users.push(user);
        }
        let until = now + hold;
        for i in plan_holds(&queue, free, now) {
            tx.execute(
                &format!(
                    "UPDATE waitlist SET hold_until = $2 WHERE user_id = $1 \
                     RETURNING pg_notify('{notify}', env)"
                ),
                &[&users[i], &until],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
            report.granted.push(
                users[i]
                    .parse()
                    .map_err(|e| StoreError::corrupt("user_id", e))?,
            );
        }
        tx.commit().await.map_err(StoreError::query(WHAT))?;
        Ok(report)
    }
}

impl Store {
    /// Queries on the `waitlist` table (students waiting for a place).
    pub fn waitlist(&self) -> Waitlist<'_> {
        Waitlist::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::<Utc>::from_timestamp(1_800_000_000 + secs, 0).unwrap()
    }

    fn waiting(needed: u32) -> QueuedEntry {
        QueuedEntry {
            needed,
            hold_until: None,
        }
    }

    #[test]
    fn the_first_in_line_gets_the_free_place() {
        let queue = [waiting(1), waiting(1), waiting(1)];
        assert_eq!(plan_holds(&queue, 1, at(0)), vec![0]);
        assert_eq!(plan_holds(&queue, 2, at(0)), vec![0, 1]);
        assert!(plan_holds(&queue, 0, at(0)).is_empty());
    }

    #[test]
    fn current_holds_keep_their_places_and_a_big_lab_is_not_passed() {
        let held = QueuedEntry {
            needed: 1,
            hold_until: Some(at(60)),
        };
        // One place free, already held: nobody else gets one.
        assert!(plan_holds(&[held.clone(), waiting(1)], 1, at(0)).is_empty());
        // Two free: the held one keeps its place, the next gets the other.
        assert_eq!(plan_holds(&[held, waiting(1)], 2, at(0)), vec![1]);
        // The first waiting needs three, two are free: the later one-VM lab waits behind it.
        assert!(plan_holds(&[waiting(3), waiting(1)], 2, at(0)).is_empty());
    }

    #[test]
    fn a_lapsed_hold_counts_for_nothing() {
        let lapsed = QueuedEntry {
            needed: 1,
            hold_until: Some(at(0)),
        };
        assert_eq!(plan_holds(&[lapsed, waiting(1)], 1, at(0)), vec![1]);
    }
}
