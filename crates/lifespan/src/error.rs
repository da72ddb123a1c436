use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::fmt_duration;

/// Everything this crate refuses: a policy setting that makes no sense, or an extension that
/// cannot be granted.
///
/// The first group comes from [`Policy::new`](crate::Policy::new) and
/// [`Policy::from_settings`](crate::Policy::from_settings), read once when a binary starts; every
/// message names the setting at fault. The second group comes only from
/// [`Lifespan::extend`](crate::Lifespan::extend) and is meant for the student: each has a
/// stable [`code`](LifespanError::code) for the API. A refused extension changes nothing and
/// uses up no extension.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LifespanError {
    /// A duration setting is not a duration humantime understands (`60m`, `90s`, `1h30m`).
    #[error("{setting} ({value:?}) is not a duration like 60m, 90s or 1h30m: {reason}")]
    InvalidDuration {
        /// The setting at fault, e.g. `TTLAB_SESSION_TTL`.
        setting: &'static str,
        /// The text as given.
        value: String,
        /// What the parser objected to.
        reason: String,
    },
    /// The extension count is not a whole number in range.
    #[error("{setting} ({value:?}) is not a whole number from 0 to {limit}")]
    InvalidCount {
        /// The setting at fault, `TTLAB_MAX_EXTENSIONS`.
        setting: &'static str,
        /// The text as given.
        value: String,
        /// The largest accepted value.
        limit: u32,
    },
    /// A setting was present but empty, which is almost always a deployment mistake.
    #[error("{setting} is set but empty; unset it to use the default ({default})")]
    EmptySetting {
        /// The setting at fault.
        setting: &'static str,
        /// The default that unsetting it would give.
        default: String,
    },
    /// The session time-to-live is zero: every session would be expired at birth.
    #[error("{setting} is zero: a session must last at least one second", setting = crate::SESSION_TTL_VAR)]
    ZeroTtl,
    /// A duration has a fraction of a second; lifespans are kept in whole seconds so that
    /// deadlines are exact and survive a round trip through the database.
    #[error("{setting} ({}) must be a whole number of seconds", fmt_duration(*.value))]
    FractionalSeconds {
        /// The setting at fault.
        setting: &'static str,
        /// The rejected duration.
        value: Duration,
    },
    /// The extend window is zero: no student could ever extend (set `TTLAB_MAX_EXTENSIONS=0`
    /// for that).
    #[error("{setting} is zero; to allow no extensions set {ext} to 0", setting = crate::EXTEND_WINDOW_VAR, ext = crate::MAX_EXTENSIONS_VAR)]
    ZeroExtendWindow,
    /// The hard-deadline grace is zero: a guest would power itself off at the very instant its
    /// session reaches the maximum lifetime, while the reaper is reclaiming it.
    #[error(
        "{setting} is zero: the last-resort deadlines must fall after {max} (at least one second later)",
        setting = crate::HARD_DEADLINE_GRACE_VAR,
        max = crate::SESSION_MAX_VAR
    )]
    ZeroHardDeadlineGrace,
    /// The maximum lifetime is shorter than a single time-to-live.
    #[error(
        "{max_setting} ({}) is shorter than {ttl_setting} ({})",
        fmt_duration(*.max),
        fmt_duration(*.ttl),
        max_setting = crate::SESSION_MAX_VAR,
        ttl_setting = crate::SESSION_TTL_VAR
    )]
    MaxShorterThanTtl {
        /// The rejected maximum lifetime.
        max: Duration,
        /// The time-to-live it is shorter than.
        ttl: Duration,
    },
    /// A duration is longer than any lab session can sensibly last.
    #[error("{setting} ({}) is longer than the limit of {}", fmt_duration(*.value), fmt_duration(*.limit))]
    TooLong {
        /// The setting at fault.
        setting: &'static str,
        /// The rejected duration.
        value: Duration,
        /// The longest accepted duration.
        limit: Duration,
    },
    /// More extensions than any session can sensibly use.
    #[error("{setting} ({value}) is more than the limit of {limit}", setting = crate::MAX_EXTENSIONS_VAR)]
    TooManyExtensions {
        /// The rejected count.
        value: u32,
        /// The largest accepted count.
        limit: u32,
    },
    /// Extension refused: the session has already expired. API code `expired`.
    #[error("the session expired at {expired_at}; an expired session cannot be extended")]
    Expired {
        /// When the session expired.
        expired_at: DateTime<Utc>,
    },
    /// Extension refused: every allowed extension has been used. API code `extension_limit`.
    #[error("{}", extension_limit_message(*.limit))]
    ExtensionLimit {
        /// How many extensions the policy allows (and the session has used).
        limit: u32,
    },
    /// Extension refused: the session already runs until its maximum lifetime. API code
    /// `max_lifetime`.
    #[error("the session already runs until its maximum lifetime ({max_expires_at})")]
    MaxLifetime {
        /// The latest instant the session may ever run until (start + max).
        max_expires_at: DateTime<Utc>,
    },
    /// Extension refused: the extend window has not opened yet (extending is offered only in
    /// the last [`Policy::extend_window`](crate::Policy::extend_window) before the expiry). No
    /// extension is used up; `opens_at` says from when it is offered. API code `not_yet`.
    #[error(
        "extending is possible only in the last {} before the expiry; it opens at {opens_at}",
        fmt_duration(*.window)
    )]
    NotYet {
        /// The first instant extending is offered.
        opens_at: DateTime<Utc>,
        /// The window.
        window: Duration,
    },
    /// Extension refused: extending now would not move the expiry later (the session was
    /// opened or extended too recently). No extension is used up; trying again after
    /// `adds_time_after` gains time. API code `too_early`.
    #[error(
        "the session already runs until {expires_at}; extending adds time only after {adds_time_after}"
    )]
    TooEarly {
        /// The current expiry, which extending now would not move.
        expires_at: DateTime<Utc>,
        /// Extending at any instant after this one moves the expiry later.
        adds_time_after: DateTime<Utc>,
    },
}

impl LifespanError {
    /// A short, stable, machine-readable code, suitable as an API error code.
    ///
    /// Extension refusals give `expired`, `extension_limit`, `max_lifetime`, `not_yet` and
    /// `too_early`;
    /// every policy error gives `invalid_policy`.
    pub const fn code(&self) -> &'static str {
        match self {
            Self::Expired { .. } => "expired",
            Self::ExtensionLimit { .. } => "extension_limit",
            Self::MaxLifetime { .. } => "max_lifetime",
            Self::TooEarly { .. } => "too_early",
            Self::NotYet { .. } => "not_yet",
            Self::InvalidDuration { .. }
            | Self::InvalidCount { .. }
            | Self::EmptySetting { .. }
            | Self::ZeroTtl
            | Self::ZeroExtendWindow
            | Self::ZeroHardDeadlineGrace
            | Self::FractionalSeconds { .. }
            | Self::MaxShorterThanTtl { .. }
            | Self::TooLong { .. }
            | Self::TooManyExtensions { .. } => "invalid_policy",
        }
    }

    /// Whether this is a refused extension (a student-facing outcome, not a configuration
    /// mistake).
    pub const fn is_extend_refusal(&self) -> bool {
        matches!(
            self,
            Self::Expired { .. }
                | Self::ExtensionLimit { .. }
                | Self::MaxLifetime { .. }
                | Self::TooEarly { .. }
                | Self::NotYet { .. }
        )
    }
}

fn extension_limit_message(limit: u32) -> String {
    match limit {
        0 => "sessions cannot be extended".to_owned(),
        1 => "the one extension of this session has been used".to_owned(),
        n => format!("all {n} extensions of this session have been used"),
    }
}
