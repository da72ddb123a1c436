use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{LifespanError, fmt_duration};

/// The name of the setting that holds the time-to-live: how long a session lasts when opened,
/// and how far ahead of "now" an extension moves its expiry.
pub const SESSION_TTL_VAR: &str = "TTLAB_SESSION_TTL";
/// The name of the setting that holds the maximum lifetime: no session runs past
/// `start + max`, however often it is extended.
pub const SESSION_MAX_VAR: &str = "TTLAB_SESSION_MAX";
/// The name of the setting that holds how many times a session may be extended.
pub const MAX_EXTENSIONS_VAR: &str = "TTLAB_MAX_EXTENSIONS";
/// The name of the setting that holds the extend window: a student may extend only in this
/// final stretch before the expiry.
pub const EXTEND_WINDOW_VAR: &str = "TTLAB_EXTEND_WINDOW";

/// Default time-to-live: 60 minutes.
pub const DEFAULT_TTL: Duration = Duration::from_secs(60 * 60);
/// Default maximum lifetime: 180 minutes.
pub const DEFAULT_MAX: Duration = Duration::from_secs(180 * 60);
/// Default number of extensions: 3.
pub const DEFAULT_MAX_EXTENSIONS: u32 = 3;
/// Default extend window: the last 15 minutes before the expiry.
pub const DEFAULT_EXTEND_WINDOW: Duration = Duration::from_secs(15 * 60);
/// The longest time-to-live or maximum lifetime a policy accepts: 7 days.
pub const LIFETIME_LIMIT: Duration = Duration::from_secs(7 * 24 * 60 * 60);
/// The most extensions a policy accepts.
pub const EXTENSIONS_LIMIT: u32 = 1000;
/// The name of the setting that holds the hard deadline's grace: how long past the maximum
/// lifetime the last-resort deadlines fire.
pub const HARD_DEADLINE_GRACE_VAR: &str = "TTLAB_HARD_DEADLINE_GRACE";

/// Default hard-deadline grace: the last-resort deadlines (a pod's `activeDeadlineSeconds`, a
/// VM guest's self power-off) fire 15 minutes after the maximum lifetime. The reaper normally
/// reclaims a session at its expiry, long before; the grace bounds the damage when it cannot
/// run.
pub const DEFAULT_HARD_DEADLINE_GRACE: Duration = Duration::from_secs(15 * 60);

/// How long sessions live: plain data, the same for every session of a deployment.
///
/// [`Policy::new`] and [`Policy::from_settings`] accept only sensible values (see
/// [`Policy::validate`]). The fields are public so a policy can be written down directly;
/// every function of this crate is total over any policy, even one that never passed
/// validation (a zero time-to-live, say), but only a valid policy gives the documented
/// guarantees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Policy {
    /// How long a session lasts when opened, and how far past "now" an extension moves the
    /// expiry. Default 60 minutes ([`SESSION_TTL_VAR`]).
    pub ttl: Duration,
    /// The longest a session may ever run, counted from its start. Default 180 minutes
    /// ([`SESSION_MAX_VAR`]).
    pub max: Duration,
    /// How many times a session may be extended. Default 3 ([`MAX_EXTENSIONS_VAR`]).
    pub max_extensions: u32,
    /// The final stretch before the expiry in which a student may extend: earlier, an
    /// extension would spend one of the few allowed for little time. Default 15 minutes
    /// ([`EXTEND_WINDOW_VAR`]).
    #[serde(default = "default_extend_window")]
    pub extend_window: Duration,
    /// How long after the maximum lifetime the last-resort deadlines fire: a pod lab's
    /// `activeDeadlineSeconds` and a VM guest's own power-off ([`Policy::hard_lifetime`]).
    /// Default 15 minutes ([`HARD_DEADLINE_GRACE_VAR`]).
    #[serde(default = "default_hard_deadline_grace")]
    pub hard_deadline_grace: Duration,
}

fn default_extend_window() -> Duration {
    DEFAULT_EXTEND_WINDOW
}

fn default_hard_deadline_grace() -> Duration {
    DEFAULT_HARD_DEADLINE_GRACE
}

impl Default for Policy {
    /// 60 minutes, at most 180 minutes, extended at most 3 times, each time in the last 15
    /// minutes; the last-resort deadlines 15 minutes after the maximum lifetime.
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            max: DEFAULT_MAX,
            max_extensions: DEFAULT_MAX_EXTENSIONS,
            extend_window: DEFAULT_EXTEND_WINDOW,
            hard_deadline_grace: DEFAULT_HARD_DEADLINE_GRACE,
        }
    }
}

impl Policy {
    /// A validated policy (see [`Policy::validate`] for the rules) with the default extend
    /// window and hard-deadline grace ([`Policy::with_extend_window`] and
    /// [`Policy::with_hard_deadline_grace`] set others).
    pub fn new(ttl: Duration, max: Duration, max_extensions: u32) -> Result<Self, LifespanError> {
        let policy = Self {
            ttl,
            max,
            max_extensions,
            extend_window: DEFAULT_EXTEND_WINDOW,
            hard_deadline_grace: DEFAULT_HARD_DEADLINE_GRACE,
        };
        policy.validate()?;
        Ok(policy)
    }

    /// This policy with the extend window `window`, validated.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ttlab_lifespan::Policy;
    ///
    /// let policy = Policy::default().with_extend_window(Duration::from_secs(600)).unwrap();
    /// assert_eq!(policy.extend_window, Duration::from_secs(600));
    /// assert!(Policy::default().with_extend_window(Duration::ZERO).is_err());
    /// ```
    pub fn with_extend_window(self, window: Duration) -> Result<Self, LifespanError> {
        let policy = Self {
            extend_window: window,
            ..self
        };
        policy.validate()?;
        Ok(policy)
    }

    /// This policy with the extend window read from the text of [`EXTEND_WINDOW_VAR`]
    /// (`None`: the default, 15 minutes), validated.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ttlab_lifespan::Policy;
    ///
    /// let policy = Policy::default().with_extend_window_setting(Some("10m")).unwrap();
    /// assert_eq!(policy.extend_window, Duration::from_secs(600));
    /// let err = Policy::default().with_extend_window_setting(Some("soon")).unwrap_err();
    /// assert!(err.to_string().starts_with("TTLAB_EXTEND_WINDOW (\"soon\")"), "{err}");
    /// ```
    pub fn with_extend_window_setting(self, text: Option<&str>) -> Result<Self, LifespanError> {
        let window = parse_duration(EXTEND_WINDOW_VAR, text, DEFAULT_EXTEND_WINDOW)?;
        self.with_extend_window(window)
    }

    /// This policy with the hard-deadline grace `grace`, validated.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ttlab_lifespan::Policy;
    ///
    /// let policy = Policy::default().with_hard_deadline_grace(Duration::from_secs(30)).unwrap();
    /// assert_eq!(policy.hard_lifetime(), Duration::from_secs(180 * 60 + 30));
    /// assert!(Policy::default().with_hard_deadline_grace(Duration::ZERO).is_err());
    /// ```
    pub fn with_hard_deadline_grace(self, grace: Duration) -> Result<Self, LifespanError> {
        let policy = Self {
            hard_deadline_grace: grace,
            ..self
        };
        policy.validate()?;
        Ok(policy)
    }

    /// This policy with the hard-deadline grace read from the text of
    /// [`HARD_DEADLINE_GRACE_VAR`] (`None`: the default, 15 minutes), validated.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ttlab_lifespan::Policy;
    ///
    /// let policy = Policy::default().with_hard_deadline_grace_setting(Some("2m")).unwrap();
    /// assert_eq!(policy.hard_deadline_grace, Duration::from_secs(120));
    /// let err = Policy::default().with_hard_deadline_grace_setting(Some("0s")).unwrap_err();
    /// assert!(err.to_string().starts_with("TTLAB_HARD_DEADLINE_GRACE is zero"), "{err}");
    /// ```
    pub fn with_hard_deadline_grace_setting(
        self,
        text: Option<&str>,
    ) -> Result<Self, LifespanError> {
        let grace = parse_duration(HARD_DEADLINE_GRACE_VAR, text, DEFAULT_HARD_DEADLINE_GRACE)?;
        self.with_hard_deadline_grace(grace)
    }

    /// A validated policy from the text of the three settings, as a binary reads them from
    /// [`SESSION_TTL_VAR`], [`SESSION_MAX_VAR`] and [`MAX_EXTENSIONS_VAR`]; `None` (the
    /// setting is absent) means the default.
    ///
    /// Durations are human durations (`60m`, `90s`, `1h30m`, `2h`); surrounding whitespace is
    /// ignored, and a setting that is present but empty is an error rather than a silent
    /// default. Every error message names the setting at fault.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ttlab_lifespan::Policy;
    ///
    /// let policy = Policy::from_settings(Some("45m"), Some("1h30m"), None).unwrap();
    /// assert_eq!(policy.ttl, Duration::from_secs(45 * 60));
    /// assert_eq!(policy.max, Duration::from_secs(90 * 60));
    /// assert_eq!(policy.max_extensions, 3);
    ///
    /// let err = Policy::from_settings(None, Some("30m"), None).unwrap_err();
    /// assert_eq!(err.to_string(), "TTLAB_SESSION_MAX (30m) is shorter than TTLAB_SESSION_TTL (60m)");
    /// ```
    pub fn from_settings(
        ttl: Option<&str>,
        max: Option<&str>,
        max_extensions: Option<&str>,
    ) -> Result<Self, LifespanError> {
        let ttl = parse_duration(SESSION_TTL_VAR, ttl, DEFAULT_TTL)?;
        let max = parse_duration(SESSION_MAX_VAR, max, DEFAULT_MAX)?;
        let max_extensions = parse_count(MAX_EXTENSIONS_VAR, max_extensions)?;
        Self::new(ttl, max, max_extensions)
    }

    /// Checks the rules a policy must follow, returning the first one broken:
    ///
    /// - the time-to-live is not zero ([`LifespanError::ZeroTtl`]);
    /// - both durations are whole seconds ([`LifespanError::FractionalSeconds`]), so deadlines
    ///   are exact and survive the database's microsecond timestamps;
    /// - neither is longer than [`LIFETIME_LIMIT`] ([`LifespanError::TooLong`]);
    /// - the maximum lifetime is at least the time-to-live
    ///   ([`LifespanError::MaxShorterThanTtl`]); equal is allowed and means extensions never
    ///   add time;
    /// - at most [`EXTENSIONS_LIMIT`] extensions ([`LifespanError::TooManyExtensions`]); zero
    ///   is allowed and means sessions cannot be extended;
    /// - the extend window is not zero ([`LifespanError::ZeroExtendWindow`]), whole seconds
    ///   and at most [`LIFETIME_LIMIT`]; a window longer than the ttl means "whenever
    ///   extending adds time";
    /// - the hard-deadline grace is not zero ([`LifespanError::ZeroHardDeadlineGrace`]: the
    ///   guest would power off at the very instant the reaper reclaims it), whole seconds and
    ///   at most [`LIFETIME_LIMIT`].
    pub fn validate(&self) -> Result<(), LifespanError> {
        if self.ttl.is_zero() {
            return Err(LifespanError::ZeroTtl);
        }
        if self.extend_window.is_zero() {
            return Err(LifespanError::ZeroExtendWindow);
        }
        if self.hard_deadline_grace.is_zero() {
            return Err(LifespanError::ZeroHardDeadlineGrace);
        }
        for (setting, value) in [
            (SESSION_TTL_VAR, self.ttl),
            (SESSION_MAX_VAR, self.max),
            (EXTEND_WINDOW_VAR, self.extend_window),
            (HARD_DEADLINE_GRACE_VAR, self.hard_deadline_grace),
        ] {
            if value.subsec_nanos() != 0 {
                return Err(LifespanError::FractionalSeconds { setting, value });
            }
            if value > LIFETIME_LIMIT {
                return Err(LifespanError::TooLong {
                    setting,
                    value,
                    limit: LIFETIME_LIMIT,
                });
            }
        }
        if self.max < self.ttl {
            return Err(LifespanError::MaxShorterThanTtl {
                max: self.max,
                ttl: self.ttl,
            });
        }
        if self.max_extensions > EXTENSIONS_LIMIT {
            return Err(LifespanError::TooManyExtensions {
                value: self.max_extensions,
                limit: EXTENSIONS_LIMIT,
            });
        }
        Ok(())
    }

    /// How long after its start a session is stopped by the last-resort deadlines: the maximum
    /// lifetime plus [`Policy::hard_deadline_grace`] (195 minutes by default).
    pub fn hard_lifetime(&self) -> Duration {
        self.max.saturating_add(self.hard_deadline_grace)
    }

    /// `activeDeadlineSeconds` for a pod lab: [`Policy::hard_lifetime`] in seconds, rounded up
    /// (11,700 by default). Kubernetes counts it from the pod's start, which is never before
    /// the session's start, so the pod never outlives [`Lifespan::hard_deadline`] by more than
    /// its own provisioning time. Saturates at `i64::MAX` for absurd unvalidated policies.
    ///
    /// [`Lifespan::hard_deadline`]: crate::Lifespan::hard_deadline
    pub fn pod_active_deadline_seconds(&self) -> i64 {
        let hard = self.hard_lifetime();
        let secs = hard
            .as_secs()
            .saturating_add(u64::from(hard.subsec_nanos() > 0));
        i64::try_from(secs).unwrap_or(i64::MAX)
    }
}

fn parse_duration(
    setting: &'static str,
    text: Option<&str>,
    default: Duration,
) -> Result<Duration, LifespanError> {
    let Some(text) = text else {
        return Ok(default);
    };
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(LifespanError::EmptySetting {
            setting,
            default: fmt_duration(default),
        });
    }
    humantime::parse_duration(trimmed).map_err(|e| LifespanError::InvalidDuration {
        setting,
        value: text.to_owned(),
        reason: e.to_string(),
    })
}

fn parse_count(setting: &'static str, text: Option<&str>) -> Result<u32, LifespanError> {
    let Some(text) = text else {
        return Ok(DEFAULT_MAX_EXTENSIONS);
    };
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(LifespanError::EmptySetting {
            setting,
            default: DEFAULT_MAX_EXTENSIONS.to_string(),
        });
    }
    match trimmed.parse::<u32>() {
        Ok(n) if n <= EXTENSIONS_LIMIT => Ok(n),
        Ok(n) => Err(LifespanError::TooManyExtensions {
            value: n,
            limit: EXTENSIONS_LIMIT,
        }),
        Err(_) => Err(LifespanError::InvalidCount {
            setting,
            value: text.to_owned(),
            limit: EXTENSIONS_LIMIT,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 60;

    fn mins(m: u64) -> Duration {
        Duration::from_secs(m * MIN)
    }

    fn settings(
        ttl: Option<&str>,
        max: Option<&str>,
        ext: Option<&str>,
    ) -> Result<Policy, LifespanError> {
        Policy::from_settings(ttl, max, ext)
    }

    #[test]
    fn the_extend_window_is_read_and_checked() {
        let p = Policy::default();
        assert_eq!(p.extend_window, mins(15));
        assert_eq!(p.with_extend_window_setting(None), Ok(p));
        assert_eq!(
            p.with_extend_window_setting(Some(" 5m "))
                .unwrap()
                .extend_window,
            mins(5)
        );
        let zero = p.with_extend_window_setting(Some("0s")).unwrap_err();
        assert_eq!(zero, LifespanError::ZeroExtendWindow);
        assert_eq!(
            zero.to_string(),
            "TTLAB_EXTEND_WINDOW is zero; to allow no extensions set TTLAB_MAX_EXTENSIONS to 0"
        );
        assert!(matches!(
            p.with_extend_window_setting(Some("")),
            Err(LifespanError::EmptySetting { .. })
        ));
        assert!(matches!(
            p.with_extend_window(Duration::from_millis(1500)),
            Err(LifespanError::FractionalSeconds {
                setting: "TTLAB_EXTEND_WINDOW",
                ..
            })
        ));
    }

    #[test]
    fn the_hard_deadline_grace_is_read_checked_and_moves_both_deadlines() {
        let p = Policy::default();
        assert_eq!(p.hard_deadline_grace, mins(15));
        assert_eq!(p.with_hard_deadline_grace_setting(None), Ok(p));
        let short = Policy::new(mins(5), mins(5), 0)
            .unwrap()
            .with_hard_deadline_grace_setting(Some(" 30s "))
            .unwrap();
        assert_eq!(short.hard_deadline_grace, Duration::from_secs(30));
        assert_eq!(short.hard_lifetime(), Duration::from_secs(5 * 60 + 30));
        assert_eq!(short.pod_active_deadline_seconds(), 5 * 60 + 30);
        // The other settings are kept.
        assert_eq!(
            (short.ttl, short.max, short.max_extensions),
            (mins(5), mins(5), 0)
        );

        let zero = p.with_hard_deadline_grace_setting(Some("0s")).unwrap_err();
        assert_eq!(zero, LifespanError::ZeroHardDeadlineGrace);
        assert_eq!(
            zero.to_string(),
            "TTLAB_HARD_DEADLINE_GRACE is zero: the last-resort deadlines must fall after \
             TTLAB_SESSION_MAX (at least one second later)"
        );
        assert_eq!(zero.code(), "invalid_policy");
        assert!(!zero.is_extend_refusal());
        assert_eq!(
            p.with_hard_deadline_grace_setting(Some(""))
                .unwrap_err()
                .to_string(),
            "TTLAB_HARD_DEADLINE_GRACE is set but empty; unset it to use the default (15m)"
        );
        assert!(
            p.with_hard_deadline_grace_setting(Some("soon"))
                .unwrap_err()
                .to_string()
                .starts_with("TTLAB_HARD_DEADLINE_GRACE (\"soon\") is not a duration")
        );
        assert!(matches!(
            p.with_hard_deadline_grace(Duration::from_millis(1500)),
            Err(LifespanError::FractionalSeconds {
                setting: HARD_DEADLINE_GRACE_VAR,
                ..
            })
        ));
        assert_eq!(
            p.with_hard_deadline_grace_setting(Some("8d"))
                .unwrap_err()
                .to_string(),
            "TTLAB_HARD_DEADLINE_GRACE (8d) is longer than the limit of 7d"
        );
        // A policy written before the grace was a setting reads with the default.
        let old: Policy = serde_json::from_str(
            r#"{"ttl":{"secs":3600,"nanos":0},"max":{"secs":10800,"nanos":0},"max_extensions":3}"#,
        )
        .unwrap();
        assert_eq!(old, p);
    }

    #[test]
    fn defaults_are_60_180_3_and_valid() {
        let p = Policy::default();
        assert_eq!((p.ttl, p.max, p.max_extensions), (mins(60), mins(180), 3));
        assert_eq!(p.validate(), Ok(()));
        assert_eq!(settings(None, None, None), Ok(p));
    }

    #[test]
    fn default_hard_lifetime_is_195_minutes_and_11700_seconds() {
        let p = Policy::default();
        assert_eq!(p.hard_lifetime(), mins(195));
        assert_eq!(p.pod_active_deadline_seconds(), 11_700);
    }

    #[test]
    fn pod_deadline_follows_max_not_ttl() {
        let p = Policy::new(mins(30), mins(90), 1).unwrap();
        assert_eq!(p.pod_active_deadline_seconds(), (90 + 15) * 60);
        let p = Policy::new(mins(30), mins(30), 0).unwrap();
        assert_eq!(p.pod_active_deadline_seconds(), (30 + 15) * 60);
    }

    #[test]
    fn pod_deadline_rounds_fractions_up_and_saturates() {
        let p = Policy {
            ttl: Duration::from_millis(1500),
            max: Duration::from_millis(1500),
            max_extensions: 0,
            extend_window: DEFAULT_EXTEND_WINDOW,
            hard_deadline_grace: DEFAULT_HARD_DEADLINE_GRACE,
        };
        assert_eq!(p.pod_active_deadline_seconds(), 15 * 60 + 2);
        let p = Policy {
            ttl: Duration::MAX,
            max: Duration::MAX,
            max_extensions: 0,
            extend_window: DEFAULT_EXTEND_WINDOW,
            hard_deadline_grace: DEFAULT_HARD_DEADLINE_GRACE,
        };
        assert_eq!(p.pod_active_deadline_seconds(), i64::MAX);
    }

    #[test]
    fn human_durations_parse() {
        let p = settings(Some("90s"), Some("1h30m"), Some("0")).unwrap();
        assert_eq!(
            (p.ttl, p.max, p.max_extensions),
            (Duration::from_secs(90), mins(90), 0)
        );
        let p = settings(Some(" 45m "), Some("2h"), Some(" 5 ")).unwrap();
        assert_eq!((p.ttl, p.max, p.max_extensions), (mins(45), mins(120), 5));
        let p = settings(Some("1day"), Some("7d"), None).unwrap();
        assert_eq!((p.ttl, p.max), (mins(24 * 60), LIFETIME_LIMIT));
    }

    #[test]
    fn max_equal_to_ttl_is_allowed() {
        assert!(settings(Some("60m"), Some("60m"), None).is_ok());
    }

    #[test]
    fn max_shorter_than_ttl_names_both_settings() {
        let err = settings(None, Some("30m"), None).unwrap_err();
        assert_eq!(
            err,
            LifespanError::MaxShorterThanTtl {
                max: mins(30),
                ttl: mins(60)
            }
        );
        assert_eq!(
            err.to_string(),
            "TTLAB_SESSION_MAX (30m) is shorter than TTLAB_SESSION_TTL (60m)"
        );
        assert_eq!(err.code(), "invalid_policy");
        assert!(!err.is_extend_refusal());
    }

    #[test]
    fn zero_ttl_is_rejected() {
        for zero in ["0", "0s", "0m"] {
            let err = settings(Some(zero), None, None).unwrap_err();
            assert_eq!(err, LifespanError::ZeroTtl);
            assert!(
                err.to_string().starts_with("TTLAB_SESSION_TTL is zero"),
                "{err}"
            );
        }
        // A zero max is caught as shorter than the ttl.
        let err = settings(None, Some("0s"), None).unwrap_err();
        assert!(
            matches!(err, LifespanError::MaxShorterThanTtl { .. }),
            "{err}"
        );
    }

    #[test]
    fn fractional_seconds_are_rejected() {
        let err = settings(Some("1500ms"), None, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "TTLAB_SESSION_TTL (1s 500ms) must be a whole number of seconds"
        );
        let err = settings(None, Some("3h 1ms"), None).unwrap_err();
        assert!(err.to_string().starts_with("TTLAB_SESSION_MAX ("), "{err}");
    }

    #[test]
    fn absurdly_long_durations_are_rejected() {
        let err = settings(None, Some("8d"), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "TTLAB_SESSION_MAX (8d) is longer than the limit of 7d"
        );
        let err = settings(Some("30d"), Some("30d"), None).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("TTLAB_SESSION_TTL (30d) is longer"),
            "{err}"
        );
        // Far beyond what chrono can add to a date: still a clean error, never a panic.
        let err = settings(None, Some("500000000years"), None).unwrap_err();
        assert!(
            matches!(
                err,
                LifespanError::TooLong {
                    setting: SESSION_MAX_VAR,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn unparsable_durations_name_the_setting_and_the_text() {
        let err = settings(Some("sixty"), None, None).unwrap_err();
        assert!(
            err.to_string().starts_with(
                "TTLAB_SESSION_TTL (\"sixty\") is not a duration like 60m, 90s or 1h30m: "
            ),
            "{err}"
        );
        // A bare number has no unit: rejected rather than guessed.
        let err = settings(None, Some("180"), None).unwrap_err();
        assert!(matches!(
            err,
            LifespanError::InvalidDuration {
                setting: SESSION_MAX_VAR,
                ..
            }
        ));
        assert!(err.to_string().contains("time unit needed"), "{err}");
        let err = settings(None, None, Some("-1")).unwrap_err();
        assert!(matches!(err, LifespanError::InvalidCount { .. }));
    }

    #[test]
    fn bad_extension_counts_are_rejected() {
        for bad in ["three", "-1", "2.5", "1e3"] {
            let err = settings(None, None, Some(bad)).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("TTLAB_MAX_EXTENSIONS ({bad:?}) is not a whole number from 0 to 1000")
            );
        }
        let err = settings(None, None, Some("1001")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "TTLAB_MAX_EXTENSIONS (1001) is more than the limit of 1000"
        );
        assert_eq!(
            settings(None, None, Some("1000")).unwrap().max_extensions,
            1000
        );
    }

    #[test]
    fn empty_settings_are_errors_not_silent_defaults() {
        let err = settings(Some(""), None, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "TTLAB_SESSION_TTL is set but empty; unset it to use the default (60m)"
        );
        let err = settings(None, Some("  "), None).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("TTLAB_SESSION_MAX is set but empty"),
            "{err}"
        );
        let err = settings(None, None, Some("")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "TTLAB_MAX_EXTENSIONS is set but empty; unset it to use the default (3)"
        );
    }

    #[test]
    fn new_validates_like_from_settings() {
        assert_eq!(Policy::new(mins(60), mins(180), 3), Ok(Policy::default()));
        assert_eq!(
            Policy::new(Duration::ZERO, mins(180), 3),
            Err(LifespanError::ZeroTtl)
        );
        assert!(Policy::new(mins(60), mins(59), 3).is_err());
        assert!(Policy::new(mins(60), mins(60), EXTENSIONS_LIMIT + 1).is_err());
    }

    #[test]
    fn policy_serde_round_trips() {
        let p = Policy::new(mins(45), mins(90), 2)
            .unwrap()
            .with_hard_deadline_grace(mins(2))
            .unwrap();
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<Policy>(&json).unwrap(), p);
    }
}
