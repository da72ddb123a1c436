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
    /// 4. [`NotYet`](LifespanError::NotYet) when `now` is before the extend window, i.e. before
    ///    `expires_at - extend_window` ([`Lifespan::extend_opens_at`]);
    /// 5. [`TooEarly`](LifespanError::TooEarly) when `min(now + ttl, start + max)` is not later
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
        let opens_at = self.extend_opens_at(policy);
        if now < opens_at {
            return Err(LifespanError::NotYet {
                opens_at,
                window: policy.extend_window,
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

    /// The first instant a student may extend: `expires_at - extend_window`.
    pub fn extend_opens_at(&self, policy: &Policy) -> DateTime<Utc> {
        sub(self.expires_at, policy.extend_window)
    }

    /// What extending at `now` would do, for the page's button and the API's session view:
    /// whether it is offered, the time it gains, and from when it opens. Exactly
    /// [`Lifespan::extend`] at `now`, described.
    pub fn offer(&self, now: DateTime<Utc>, policy: &Policy) -> ExtendOffer {
        let opens_at = self.extend_opens_at(policy);
        match self.extend(now, policy) {
            Ok(next) => ExtendOffer {
                available: true,
                gain: next
                    .expires_at
                    .signed_duration_since(self.expires_at)
                    .to_std()
                    .unwrap_or(Duration::ZERO),
                opens_at,
                refusal: None,
            },
            Err(refusal) => ExtendOffer {
                available: false,
                gain: Duration::ZERO,
                opens_at: match refusal {
                    LifespanError::TooEarly {
                        adds_time_after, ..
                    } => adds_time_after.max(opens_at),
                    _ => opens_at,
                },
                refusal: Some(refusal),
            },
        }
    }

    /// The lifespan after an operator extends it at `now` by `by`: the expiry moves `by` later
    /// but never past `start + max`, whatever the window and the student's extensions (none
    /// is used up). Refused as [`Expired`](LifespanError::Expired) when the session is
    /// expired at `now`, and as [`MaxLifetime`](LifespanError::MaxLifetime) when it would
    /// gain nothing (already at the cap, or `by` is zero).
    pub fn extend_by_operator(
        &self,
        now: DateTime<Utc>,
        by: Duration,
        policy: &Policy,
    ) -> Result<Self, LifespanError> {
        if self.is_expired(now) {
            return Err(LifespanError::Expired {
                expired_at: self.expires_at,
            });
        }
        let max_expires_at = self.max_expires_at(policy);
        let expires_at = add(self.expires_at, by).min(max_expires_at);
        if expires_at <= self.expires_at {
            return Err(LifespanError::MaxLifetime { max_expires_at });
        }
        Ok(Self {
            expires_at,
            ..*self
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

    /// The last-resort deadline: `start + max + grace` ([`Policy::hard_lifetime`]; the grace
    /// is 15 minutes by default). A VM guest powers itself off at this instant in case the
    /// reaper cannot reclaim it; pods get the same bound through
    /// [`Policy::pod_active_deadline_seconds`].
    pub fn hard_deadline(&self, policy: &Policy) -> DateTime<Utc> {
        add(self.started_at, policy.hard_lifetime())
    }
}

/// What extending at one instant would do ([`Lifespan::offer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtendOffer {
    /// Whether extending now would be granted.
    pub available: bool,
    /// How much later the expiry would move (zero when not available).
    pub gain: Duration,
    /// From when extending is offered (the window opens, or extending starts to add time).
    pub opens_at: DateTime<Utc>,
    /// Why extending now is refused, if it is.
    pub refusal: Option<LifespanError>,
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

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn start() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 10, 16, 9, 0, 0).unwrap()
    }

    fn at(minutes: i64) -> DateTime<Utc> {
        start() + TimeDelta::minutes(minutes)
    }

    fn mins(m: u64) -> Duration {
        Duration::from_secs(m * 60)
    }

    #[test]
    fn opening_gives_one_ttl_and_all_extensions() {
        let policy = Policy::default();
        let s = Lifespan::open(start(), &policy);
        assert_eq!(s.started_at, start());
        assert_eq!(s.expires_at, at(60));
        assert_eq!(s.extensions_used, 0);
        assert_eq!(s.extensions_left(&policy), 3);
        assert_eq!(s.remaining(start()), mins(60));
        assert_eq!(s.max_expires_at(&policy), at(180));
        assert_eq!(s.hard_deadline(&policy), at(195));
    }

    #[test]
    fn extensions_move_expiry_to_now_plus_ttl_capped_at_start_plus_max() {
        let policy = Policy::default();
        let s = Lifespan::open(start(), &policy);
        let s = s.extend(at(59), &policy).unwrap();
        assert_eq!((s.expires_at, s.extensions_used), (at(119), 1));
        let s = s.extend(at(118), &policy).unwrap();
        assert_eq!((s.expires_at, s.extensions_used), (at(178), 2));
        // now + ttl would be 237 minutes: capped at start + max.
        let s = s.extend(at(177), &policy).unwrap();
        assert_eq!((s.expires_at, s.extensions_used), (at(180), 3));
        assert_eq!(s.extensions_left(&policy), 0);
        assert_eq!(s.started_at, start());
    }

    /// `policy` with an extend window longer than any session, so only the other rules refuse.
    fn anytime(policy: Policy) -> Policy {
        policy.with_extend_window(crate::LIFETIME_LIMIT).unwrap()
    }

    #[test]
    fn extending_before_the_window_is_refused_and_says_when_it_opens() {
        let policy = Policy::default(); // 60 min, window 15 min
        let s = Lifespan::open(start(), &policy);
        let err = s.extend(at(5), &policy).unwrap_err();
        assert_eq!(
            err,
            LifespanError::NotYet {
                opens_at: at(45),
                window: mins(15)
            }
        );
        assert_eq!(err.code(), "not_yet");
        assert!(err.is_extend_refusal());
        assert_eq!(
            err.to_string(),
            "extending is possible only in the last 15m before the expiry; it opens at 2026-10-16 \
             09:45:00 UTC"
        );
        let just_before = at(45) - TimeDelta::microseconds(1);
        assert_eq!(
            s.extend(just_before, &policy).unwrap_err().code(),
            "not_yet"
        );
        // From the opening instant on it is granted and gains 45 minutes or more.
        let s = s.extend(at(45), &policy).unwrap();
        assert_eq!(s.expires_at, at(105));
        assert_eq!(s.extensions_used, 1);
    }

    #[test]
    fn the_offer_says_what_extending_gains_and_from_when() {
        let policy = Policy::default();
        let s = Lifespan::open(start(), &policy);
        let early = s.offer(at(5), &policy);
        assert!(!early.available);
        assert_eq!(early.gain, Duration::ZERO);
        assert_eq!(early.opens_at, at(45));
        assert_eq!(early.refusal.map(|e| e.code()), Some("not_yet"));
        let open = s.offer(at(50), &policy);
        assert!(open.available);
        assert_eq!(open.gain, mins(50));
        assert_eq!(open.refusal, None);
        // Near the cap the gain is what is left up to start + max.
        let s = Lifespan {
            expires_at: at(170),
            ..s
        };
        assert_eq!(s.offer(at(160), &policy).gain, mins(10));
        // A window longer than the ttl: offered as soon as it adds time.
        let wide = policy.with_extend_window(mins(90)).unwrap();
        let fresh = Lifespan::open(start(), &wide);
        let offer = fresh.offer(start(), &wide);
        assert_eq!(offer.refusal.map(|e| e.code()), Some("too_early"));
        assert_eq!(offer.opens_at, start());
    }

    #[test]
    fn an_operator_extends_beyond_the_student_rules_but_not_past_the_cap() {
        let policy = Policy::new(mins(60), mins(180), 0).unwrap(); // no student extensions
        let s = Lifespan::open(start(), &policy);
        let s2 = s.extend_by_operator(at(5), mins(30), &policy).unwrap();
        assert_eq!(s2.expires_at, at(90));
        assert_eq!(s2.extensions_used, 0, "no student extension used");
        let capped = s2.extend_by_operator(at(6), mins(500), &policy).unwrap();
        assert_eq!(capped.expires_at, at(180));
        let err = capped
            .extend_by_operator(at(7), mins(1), &policy)
            .unwrap_err();
        assert_eq!(err.code(), "max_lifetime");
        assert_eq!(
            s.extend_by_operator(at(60), mins(10), &policy)
                .unwrap_err()
                .code(),
            "expired"
        );
        assert_eq!(
            s.extend_by_operator(at(5), Duration::ZERO, &policy)
                .unwrap_err()
                .code(),
            "max_lifetime"
        );
    }

    #[test]
    fn extending_an_expired_session_is_refused_from_the_expiry_instant_on() {
        let policy = Policy::default();
        let s = Lifespan::open(start(), &policy);
        let just_before = at(60) - TimeDelta::microseconds(1);
        assert!(s.extend(just_before, &policy).is_ok());
        for now in [at(60), at(61), at(10_000)] {
            let err = s.extend(now, &policy).unwrap_err();
            assert_eq!(err, LifespanError::Expired { expired_at: at(60) });
            assert_eq!(err.code(), "expired");
            assert!(err.is_extend_refusal());
        }
    }

    #[test]
    fn extending_at_the_cap_is_refused_as_max_lifetime() {
        // Plenty of extensions, so only the cap can refuse.
        let policy = Policy::new(mins(60), mins(90), 10).unwrap();
        let s = Lifespan::open(start(), &policy)
            .extend(at(50), &policy)
            .unwrap();
        assert_eq!(s.expires_at, at(90));
        let err = s.extend(at(80), &policy).unwrap_err();
        assert_eq!(
            err,
            LifespanError::MaxLifetime {
                max_expires_at: at(90)
            }
        );
        assert_eq!(err.code(), "max_lifetime");
        assert_eq!(
            err.to_string(),
            "the session already runs until its maximum lifetime (2026-10-16 10:30:00 UTC)"
        );
        assert_eq!(s.extensions_left(&policy), 9, "a refusal uses no extension");
    }

    #[test]
    fn max_equal_to_ttl_means_never_extendable() {
        let policy = Policy::new(mins(60), mins(60), 3).unwrap();
        let s = Lifespan::open(start(), &policy);
        let err = s.extend(at(30), &policy).unwrap_err();
        assert_eq!(err.code(), "max_lifetime");
    }

    #[test]
    fn extending_past_the_limit_is_refused_as_extension_limit() {
        // A long max, so only the count can refuse.
        let policy = anytime(Policy::new(mins(60), mins(1000), 2).unwrap());
        let s = Lifespan::open(start(), &policy);
        let s = s.extend(at(30), &policy).unwrap();
        let s = s.extend(at(60), &policy).unwrap();
        assert_eq!(s.expires_at, at(120));
        let err = s.extend(at(90), &policy).unwrap_err();
        assert_eq!(err, LifespanError::ExtensionLimit { limit: 2 });
        assert_eq!(err.code(), "extension_limit");
        assert_eq!(
            err.to_string(),
            "all 2 extensions of this session have been used"
        );
    }

    #[test]
    fn zero_extensions_means_never_extendable() {
        let policy = Policy::new(mins(60), mins(180), 0).unwrap();
        let s = Lifespan::open(start(), &policy);
        let err = s.extend(at(59), &policy).unwrap_err();
        assert_eq!(err, LifespanError::ExtensionLimit { limit: 0 });
        assert_eq!(err.to_string(), "sessions cannot be extended");
    }

    #[test]
    fn an_extension_that_adds_no_time_is_refused_and_says_when_it_would() {
        let policy = anytime(Policy::default());
        let s = Lifespan::open(start(), &policy);
        let err = s.extend(start(), &policy).unwrap_err();
        assert_eq!(
            err,
            LifespanError::TooEarly {
                expires_at: at(60),
                adds_time_after: start()
            }
        );
        assert_eq!(err.code(), "too_early");
        assert_eq!(s.extensions_left(&policy), 3);
        // One microsecond later it adds one microsecond.
        let later = start() + TimeDelta::microseconds(1);
        let s = s.extend(later, &policy).unwrap();
        assert_eq!(s.expires_at, at(60) + TimeDelta::microseconds(1));
    }

    #[test]
    fn a_shorter_ttl_never_moves_expiry_backwards() {
        let generous = Policy::default();
        let s = Lifespan::open(start(), &generous);
        // The deployment is reconfigured to 10-minute extensions while the session runs.
        let strict = anytime(Policy::new(mins(10), mins(180), 3).unwrap());
        let err = s.extend(at(30), &strict).unwrap_err();
        assert_eq!(
            err,
            LifespanError::TooEarly {
                expires_at: at(60),
                adds_time_after: at(50)
            }
        );
        assert_eq!(s.extend(at(55), &strict).unwrap().expires_at, at(65));
    }

    #[test]
    fn a_tightened_max_refuses_without_shortening() {
        let s = Lifespan::open(start(), &Policy::default())
            .extend(at(59), &Policy::default())
            .unwrap();
        assert_eq!(s.expires_at, at(119));
        let tight = Policy::new(mins(60), mins(90), 3).unwrap();
        let err = s.extend(at(100), &tight).unwrap_err();
        assert_eq!(
            err,
            LifespanError::MaxLifetime {
                max_expires_at: at(90)
            }
        );
    }

    #[test]
    fn refusal_order_is_expired_then_max_then_limit() {
        let policy = Policy::default();
        let full = Lifespan {
            started_at: start(),
            expires_at: at(180),
            extensions_used: 3,
        };
        assert_eq!(full.extend(at(180), &policy).unwrap_err().code(), "expired");
        assert_eq!(
            full.extend(at(179), &policy).unwrap_err().code(),
            "max_lifetime"
        );
        let used_up = Lifespan {
            expires_at: at(170),
            ..full
        };
        assert_eq!(
            used_up.extend(at(169), &policy).unwrap_err().code(),
            "extension_limit"
        );
    }

    #[test]
    fn remaining_counts_down_to_zero_and_never_below() {
        let s = Lifespan::open(start(), &Policy::default());
        assert_eq!(
            s.remaining(at(-5)),
            mins(65),
            "before the start there is more time"
        );
        assert_eq!(s.remaining(at(59)), mins(1));
        let micro = at(60) - TimeDelta::microseconds(1);
        assert_eq!(s.remaining(micro), Duration::from_micros(1));
        assert!(!s.is_expired(micro));
        assert_eq!(s.remaining(at(60)), Duration::ZERO);
        assert!(s.is_expired(at(60)));
        assert_eq!(s.remaining(at(1_000_000)), Duration::ZERO);
        assert!(s.is_expired(at(1_000_000)));
    }

    #[test]
    fn extremes_of_the_calendar_saturate_instead_of_panicking() {
        let policy = Policy {
            ttl: Duration::MAX,
            max: Duration::MAX,
            max_extensions: u32::MAX,
            extend_window: Duration::MAX,
            hard_deadline_grace: Duration::MAX,
        };
        let s = Lifespan::open(DateTime::<Utc>::MAX_UTC, &policy);
        assert_eq!(s.expires_at, DateTime::<Utc>::MAX_UTC);
        assert_eq!(s.hard_deadline(&policy), DateTime::<Utc>::MAX_UTC);
        assert!(s.extend(DateTime::<Utc>::MIN_UTC, &policy).is_err());
        assert!(s.is_expired(DateTime::<Utc>::MAX_UTC));
        let s = Lifespan::open(DateTime::<Utc>::MIN_UTC, &Policy::default());
        let err = s
            .extend(DateTime::<Utc>::MIN_UTC, &Policy::default())
            .unwrap_err();
        assert!(matches!(err, LifespanError::NotYet { .. }), "{err}");
        let err = s
            .extend(DateTime::<Utc>::MIN_UTC, &anytime(Policy::default()))
            .unwrap_err();
        assert!(matches!(err, LifespanError::TooEarly { .. }), "{err}");
    }

    #[test]
    fn lifespan_serde_uses_plain_field_names_and_round_trips() {
        let s = Lifespan::open(start(), &Policy::default());
        let json = serde_json::to_value(s).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "started_at": "2026-10-16T09:00:00Z",
                "expires_at": "2026-10-16T10:00:00Z",
                "extensions_used": 0,
            })
        );
        assert_eq!(serde_json::from_value::<Lifespan>(json).unwrap(), s);
    }
}
