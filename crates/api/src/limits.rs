//! Per-user rate limits on the actions that cost the cluster or a guest something: starting a
//! lab, extending it, grading it. A generic cell rate (GCRA, a token bucket without a timer):
//! `burst` requests at once, then one per `interval`. The limiter is logic over a map and takes
//! `now` as a value; the routes pass the monotonic clock.
//!
//! The limit is per process: behind N replicas a user gets up to N times the rate in the worst
//! case, which still bounds a hammering client (the point) without a shared store on the path
//! of every click.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use ttlab_model::UserId;

/// The actions limited per user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::EnumCount)]
#[strum(serialize_all = "lowercase")]
pub enum Action {
    /// `POST /api/sessions`.
    Start,
    /// `POST /api/sessions/{id}/extend`.
    Extend,
    /// `POST /api/sessions/{id}/grade`.
    Grade,
}

impl Action {
    /// Every action, for exhaustive tests.
    pub const ALL: [Self; <Action as strum::EnumCount>::COUNT] =
        [Self::Start, Self::Extend, Self::Grade];

    /// The action's name, as in the 429 sentence and the metric label.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// How often one user may perform one action: `burst` at once, then one per `interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Requests accepted back to back (at least 1).
    pub burst: u32,
    /// The steady rate: one request per this long. Zero turns the limit off.
    pub interval: Duration,
}

impl RateLimit {
    /// The default: 10 at once, then one a second — far above what a person clicks, far
    /// below what a script hammering `grade` would send.
    pub const DEFAULT: Self = Self {
        burst: 10,
        interval: Duration::from_secs(1),
    };

    /// No limit.
    pub const OFF: Self = Self {
        burst: 1,
        interval: Duration::ZERO,
    };
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Entries kept before idle ones are dropped.
const PRUNE_ABOVE: usize = 10_000;

/// The per-user, per-action limiter of one process.
#[derive(Debug)]
pub struct UserLimiter {
    limit: RateLimit,
    /// Per (user, action): the theoretical arrival time of the next request.
    next: Mutex<HashMap<(UserId, Action), Instant>>,
}

impl UserLimiter {
    /// A limiter applying `limit` to every user and action.
    pub fn new(limit: RateLimit) -> Self {
        Self {
            limit,
            next: Mutex::new(HashMap::new()),
        }
    }

    /// Admits one `action` of `user` at `now`, or says how long until one is admitted.
    pub fn check(&self, user: &UserId, action: Action, now: Instant) -> Result<(), Duration> {
        let interval = self.limit.interval;
        if interval.is_zero() {
            return Ok(());
        }
        let tolerance = interval * self.limit.burst.max(1).saturating_sub(1);
        let mut next = self
            .next
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if next.len() > PRUNE_ABOVE {
            // An entry whose time has come is the same as no entry.
            next.retain(|_, at| *at > now);
        }
        let at = next.get(&(user.clone(), action)).copied().unwrap_or(now);
        let at = at.max(now);
        let ahead = at - now;
        if ahead > tolerance {
            return Err(ahead - tolerance);
        }
        next.insert((user.clone(), action), at + interval);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_names_are_stable() {
        let names: Vec<&str> = Action::ALL.iter().map(|a| a.as_str()).collect();
        assert_eq!(names, ["start", "extend", "grade"]);
    }

    fn alice() -> UserId {
        UserId::new("alice").unwrap()
    }

    #[test]
    fn a_burst_then_one_per_interval_per_user_and_action() {
        let limiter = UserLimiter::new(RateLimit {
            burst: 3,
            interval: Duration::from_secs(2),
        });
        let t0 = Instant::now();
        for action in Action::ALL {
            for _ in 0..3 {
                assert_eq!(limiter.check(&alice(), action, t0), Ok(()));
            }
            // The fourth waits for one interval to pass.
            assert_eq!(
                limiter.check(&alice(), action, t0),
                Err(Duration::from_secs(2))
            );
        }
        // Another user is not affected.
        let bob = UserId::new("bob").unwrap();
        assert_eq!(limiter.check(&bob, Action::Grade, t0), Ok(()));
        // Half an interval later: still refused, for the other half.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(
            limiter.check(&alice(), Action::Grade, t1),
            Err(Duration::from_secs(1))
        );
        // After the interval: one more, not two.
        let t2 = t0 + Duration::from_secs(2);
        assert_eq!(limiter.check(&alice(), Action::Grade, t2), Ok(()));
        assert!(limiter.check(&alice(), Action::Grade, t2).is_err());
        // Idle long enough, the whole burst is back.
        let t3 = t2 + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(limiter.check(&alice(), Action::Grade, t3), Ok(()));
        }
    }

    #[test]
    fn a_zero_interval_is_no_limit() {
        let limiter = UserLimiter::new(RateLimit::OFF);
        let now = Instant::now();
        for _ in 0..1000 {
            assert_eq!(limiter.check(&alice(), Action::Start, now), Ok(()));
        }
    }
}
