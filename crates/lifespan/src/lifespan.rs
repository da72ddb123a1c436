use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};

use crate::{LifespanError, Policy};

/// The time of one session: when it started, when it expires, how often it was extended.
///
/// A plain value, stored as three columns and moved around freely; every method takes the
/// instant to judge against (`now`, from the database clock in the running system) and, where
/// limits matter, the [`Policy`]. Methods never mutate: [`Lifespan::extend`] returns the new
/// value, so a refused extension cannot change anything.
///
/// Instants before `started_at` are accepted as they are (a session judged "before it started"
/// simply has more time left); arithmetic saturates at the ends of the calendar instead of
/// panicking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Lifespan {
    /// When the session was opened.
    pub started_at: DateTime<Utc>,
    /// When the session expires: from this instant on it is expired.
    pub expires_at: DateTime<Utc>,
    /// How many extensions were granted so far.
    pub extensions_used: u32,
}

impl Lifespan {
    /// A session opened at `start`: it expires at `start + ttl` (clamped to `start + max` for a
    /// policy that never passed validation) with no extension used.
    pub fn open(start: DateTime<Utc>, policy: &Policy) -> Self {
        Self {
            started_at: start,
            expires_at: add(start, policy.ttl.min(policy.max)),
            extensions_used: 0,
        }
    }

    /// The lifespan after the student extends at `now`: expiry becomes
    /// `min(now + ttl, start + max)` and one more extension is used.
    ///
    /// Refused, in this order, with nothing changed and no extension used up:
    ///
    /// 1. [`Expired`](LifespanError::Expired) when the session is expired at `now`;
    /// 2. [`MaxLifetime`](LifespanError::MaxLifetime) when it already runs until
    ///    `start + max` (or later, if the policy was tightened since);
    /// 3. [`ExtensionLimit`](LifespanError::ExtensionLimit) when every allowed extension is
    ///    used;
    /// 4. [`TooEarly`](LifespanError::TooEarly) when `min(now + ttl, start + max)` is not later
    ///    than the current expiry, e.g. right after opening. An extension that would add no
    ///    time is refused rather than granted for nothing, and the expiry never moves
    ///    backwards (which a shortened ttl could otherwise cause).
    ///
    /// So a granted extension always moves the expiry strictly later and never past
    /// `start + max`.
    pub fn extend(&self, now: DateTime<Utc>, policy: &Policy) -> Result<Self, LifespanError> {
        if self.is_expired(now) {
            return Err(LifespanError::Expired {
                expired_at: self.expires_at,
            });
        }
        let max_expires_at = self.max_expires_at(policy);
        if self.expires_at >= max_expires_at {
            return Err(LifespanError::MaxLifetime { max_expires_at });
        }
        if self.extensions_used >= policy.max_extensions {
            return Err(LifespanError::ExtensionLimit {
                limit: policy.max_extensions,
            });
        }
        let expires_at = add(now, policy.ttl).min(max_expires_at);
        if expires_at <= self.expires_at {
            return Err(LifespanError::TooEarly {
                expires_at: self.expires_at,
                adds_time_after: sub(self.expires_at, policy.ttl),
            });
        }
        Ok(Self {
            started_at: self.started_at,
            expires_at,
            extensions_used: self.extensions_used + 1,
        })
    }

    /// Time left at `now`: `expires_at - now`, or zero once that is not positive. This is the
    /// one number behind both the student's countdown and the reaper's decision.
    pub fn remaining(&self, now: DateTime<Utc>) -> Duration {
        self.expires_at
            .signed_duration_since(now)
            .to_std()
            .unwrap_or(Duration::ZERO)
    }

    /// Whether the session is expired at `now`: exactly when [`Lifespan::remaining`] is zero,
    /// i.e. from `expires_at` on.
    pub fn is_expired(&self, now: DateTime<Utc>) -> bool {
        self.remaining(now).is_zero()
    }

    /// The latest the session can ever expire: `start + max`.
    pub fn max_expires_at(&self, policy: &Policy) -> DateTime<Utc> {
        add(self.started_at, policy.max)
    }

    /// How many extensions are left (zero if more were used than the policy now allows).
    pub fn extensions_left(&self, policy: &Policy) -> u32 {
        policy.max_extensions.saturating_sub(self.extensions_used)
    }

    /// The last-resort deadline: `start + max + 15 min` ([`Policy::hard_lifetime`]). A VM
    /// guest powers itself off at this instant in case the reaper cannot reclaim it; pods get
    /// the same bound through [`Policy::pod_active_deadline_seconds`].
    pub fn hard_deadline(&self, policy: &Policy) -> DateTime<Utc> {
        add(self.started_at, policy.hard_lifetime())
    }
}

/// `t + d`, saturating at the end of the calendar.
fn add(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `t - d`, saturating at the start of the calendar.
fn sub(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| t.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}
