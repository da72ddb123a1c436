//! The one implementation of session time: when a session expires, how an extension moves
//! that expiry, how much time is left, and the last-resort deadlines after which a pod or VM
//! stops even if nothing reclaims it. The student's countdown, the extend button and the
//! reaper all call these functions, so they can never disagree about whether a session is
//! over.
//!
//! It owns the [`Policy`] (time-to-live, maximum lifetime, number of extensions, with their
//! defaults and validation) and the [`Lifespan`] value of a session. It refuses to own a clock,
//! environment variables or storage: every function takes `now` (the database clock in the
//! running system, so server replicas and the reaper agree), binaries pass in the text of
//! `TTLAB_SESSION_TTL`, `TTLAB_SESSION_MAX`, `TTLAB_MAX_EXTENSIONS`, `TTLAB_EXTEND_WINDOW`
//! and `TTLAB_HARD_DEADLINE_GRACE`, and the store keeps the three fields of a [`Lifespan`].
//!
//! # Rules
//!
//! - A session opened at `start` expires at `start + ttl` ([`Lifespan::open`]).
//! - Extending at `now` moves the expiry to `min(now + ttl, start + max)`, at most
//!   `max_extensions` times ([`Lifespan::extend`]). A granted extension always moves the expiry
//!   strictly later; the expiry never moves backwards and never passes `start + max`.
//! - A student may extend only in the final `extend_window` before the expiry (15 minutes by
//!   default, `TTLAB_EXTEND_WINDOW`), so an extension is not spent for a few minutes.
//!   [`Lifespan::offer`] says whether extending is offered at `now`, from when, and how much
//!   it gains: the page's button, the API and the refusal all come from it.
//! - A refused extension changes nothing and uses up no extension. Each refusal is its own
//!   [`LifespanError`] variant with an API code: `expired` (at or past the expiry),
//!   `max_lifetime` (already runs until `start + max`), `extension_limit` (every extension
//!   used), `not_yet` (the extend window has not opened; the error says when it opens), and
//!   `too_early` (extending now would add no time, e.g. right after opening, or after the ttl
//!   was shortened; the error says from when extending helps).
//! - An operator may extend by a chosen amount beyond the student's extensions
//!   ([`Lifespan::extend_by_operator`]): no window, no count, but never past `start + max`.
//! - [`Lifespan::remaining`] never goes negative, and [`Lifespan::is_expired`] is defined as
//!   "remaining is zero", so a session is expired from `expires_at` on, for everyone.
//! - Last-resort deadlines sit a grace past the maximum lifetime (15 minutes by default,
//!   `TTLAB_HARD_DEADLINE_GRACE`): a pod lab's `activeDeadlineSeconds`
//!   ([`Policy::pod_active_deadline_seconds`], 11,700 by default) and a VM guest's self
//!   power-off ([`Lifespan::hard_deadline`]).
//! - Policy durations are whole seconds, so every instant derived from a database timestamp
//!   is again exact to the microsecond and survives being stored.
//! - The functions are total: instants before the start, policies changed while a session
//!   runs, even policies that never passed validation give defined results, and arithmetic
//!   saturates at the ends of the calendar instead of panicking.
//!
//! ```
//! use std::time::Duration;
//! use chrono::{TimeDelta, TimeZone, Utc};
//! use ttlab_lifespan::{Lifespan, LifespanError, Policy};
//!
//! let policy = Policy::default(); // 60 min, at most 180 min, 3 extensions
//! let start = Utc.with_ymd_and_hms(2026, 10, 16, 9, 0, 0).unwrap();
//! let minutes = |m| start + TimeDelta::minutes(m);
//!
//! let session = Lifespan::open(start, &policy);
//! assert_eq!(session.expires_at, minutes(60));
//! assert_eq!(session.remaining(minutes(45)), Duration::from_secs(15 * 60));
//!
//! // Extending is offered in the last 15 minutes only, and says what it gains.
//! let err = session.extend(minutes(30), &policy).unwrap_err();
//! assert_eq!(err.code(), "not_yet");
//! assert_eq!(session.offer(minutes(50), &policy).gain, Duration::from_secs(50 * 60));
//!
//! // Extending moves the expiry to now + 60 min, never past start + 180 min.
//! let session = session.extend(minutes(50), &policy).unwrap();
//! assert_eq!(session.expires_at, minutes(110));
//! assert_eq!(session.extensions_left(&policy), 2);
//!
//! // Refusals say why, with a stable API code, and change nothing.
//! let err = session.extend(minutes(120), &policy).unwrap_err();
//! assert!(matches!(err, LifespanError::Expired { .. }));
//! assert_eq!(err.code(), "expired");
//!
//! // "Expired" is exactly "no time remaining".
//! assert!(session.is_expired(minutes(110)));
//! assert_eq!(session.remaining(minutes(110)), Duration::ZERO);
//!
//! // Last-resort deadlines: max + the grace, 15 min by default.
//! assert_eq!(session.hard_deadline(&policy), minutes(195));
//! assert_eq!(policy.pod_active_deadline_seconds(), 11_700);
//! ```

mod error;
mod lifespan;
mod policy;

pub use error::LifespanError;
pub use lifespan::{ExtendOffer, Lifespan};
pub use policy::{
    DEFAULT_EXTEND_WINDOW, DEFAULT_HARD_DEADLINE_GRACE, DEFAULT_MAX, DEFAULT_MAX_EXTENSIONS,
    DEFAULT_TTL, EXTEND_WINDOW_VAR, EXTENSIONS_LIMIT, HARD_DEADLINE_GRACE_VAR, LIFETIME_LIMIT,
    MAX_EXTENSIONS_VAR, Policy, SESSION_MAX_VAR, SESSION_TTL_VAR,
};

/// A duration as the settings are usually written: `90s`, `60m`, `7d`, or humantime's form
/// for anything with a fraction of a second.
pub(crate) fn fmt_duration(d: std::time::Duration) -> String {
    const DAY: u64 = 24 * 60 * 60;
    let secs = d.as_secs();
    if d.subsec_nanos() != 0 {
        humantime::format_duration(d).to_string()
    } else if secs >= DAY && secs.is_multiple_of(DAY) {
        format!("{}d", secs / DAY)
    } else if secs >= 60 && secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
    }
}
