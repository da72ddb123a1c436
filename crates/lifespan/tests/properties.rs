//! Properties of session time over arbitrary starts, extension times and policies.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use proptest::prelude::*;
use ttlab_lifespan::{LIFETIME_LIMIT, Lifespan, LifespanError, Policy};

/// 2000-01-01 .. 2100-01-01, in microseconds (the database's resolution).
const FROM_US: i64 = 946_684_800_000_000;
const TO_US: i64 = 4_102_444_800_000_000;

fn instant() -> impl Strategy<Value = DateTime<Utc>> {
    (FROM_US..TO_US).prop_map(|us| DateTime::from_timestamp_micros(us).unwrap())
}

/// Any instant chrono can represent, extremes included.
fn any_instant() -> impl Strategy<Value = DateTime<Utc>> {
    let min = DateTime::<Utc>::MIN_UTC.timestamp_micros();
    let max = DateTime::<Utc>::MAX_UTC.timestamp_micros();
    prop_oneof![
        3 => instant(),
        1 => (min..=max).prop_map(|us| DateTime::from_timestamp_micros(us).unwrap()),
        1 => Just(DateTime::<Utc>::MIN_UTC),
        1 => Just(DateTime::<Utc>::MAX_UTC),
    ]
}

/// Policies that pass validation: short ones (many refusals at the cap) and long ones.
fn valid_policy() -> impl Strategy<Value = Policy> {
    let limit = LIFETIME_LIMIT.as_secs();
    prop_oneof![
        (1..=600u64, 0..=1800u64, 0..=5u32),
        (1..=limit, 0..=limit, 0..=1000u32),
    ]
    .prop_flat_map(move |(ttl, extra, n)| {
        let max = (ttl + extra).min(limit);
        // Windows shorter than, around and longer than the ttl; graces from a second to the
        // limit.
        (
            Just((ttl, max, n)),
            1..=(ttl * 2).min(limit),
            prop_oneof![1..=3600u64, 1..=limit],
        )
    })
    .prop_map(|((ttl, max, n), window, grace)| {
        Policy::new(Duration::from_secs(ttl), Duration::from_secs(max), n)
            .unwrap()
            .with_extend_window(Duration::from_secs(window))
            .unwrap()
            .with_hard_deadline_grace(Duration::from_secs(grace))
            .unwrap()
    })
}

/// Anything at all, including policies validation rejects.
fn any_policy() -> impl Strategy<Value = Policy> {
    let duration = prop_oneof![
        Just(Duration::ZERO),
        (0..=100_000u64).prop_map(Duration::from_secs),
        (0..=u64::MAX, 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
        Just(Duration::MAX),
    ];
    (
        duration.clone(),
        duration.clone(),
        any::<u32>(),
        duration.clone(),
        duration,
    )
        .prop_map(
            |(ttl, max, max_extensions, extend_window, hard_deadline_grace)| Policy {
                ttl,
                max,
                max_extensions,
                extend_window,
                hard_deadline_grace,
            },
        )
}

/// Extension attempts, each as a step forward from the previous attempt measured in
/// thousandths of a ttl (mostly within one ttl so sessions live long enough to reach their
/// limits; slightly negative steps model clocks that disagree), plus up to a millisecond of
/// jitter so attempts land on and around every boundary.
fn steps() -> impl Strategy<Value = Vec<(i64, i64)>> {
    let step = prop_oneof![6 => -50..=950i64, 1 => 950..=1300i64];
    prop::collection::vec((step, -1000..=1000i64), 0..12)
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap()
}

fn plus(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    t + TimeDelta::from_std(d).unwrap()
}

/// The documented refusal rules, restated: which refusal (if any) `extend` must give.
fn expected_refusal(s: &Lifespan, now: DateTime<Utc>, p: &Policy) -> Option<&'static str> {
    let cap = plus(s.started_at, p.max);
    if now >= s.expires_at {
        Some("expired")
    } else if s.expires_at >= cap {
        Some("max_lifetime")
    } else if s.extensions_used >= p.max_extensions {
        Some("extension_limit")
    } else if now < s.expires_at - TimeDelta::from_std(p.extend_window).unwrap() {
        Some("not_yet")
    } else if plus(now, p.ttl).min(cap) <= s.expires_at {
        Some("too_early")
    } else {
        None
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Over any sequence of extension attempts: expiry never passes start + max, never moves
    /// backwards, extensions never exceed the limit, a granted extension is exactly
    /// `min(now + ttl, start + max)` and a refusal is exactly the documented one and leaves
    /// the session as it was.
    #[test]
    fn extension_sequences_keep_every_invariant(
        start in instant(),
        policy in valid_policy(),
        steps in steps(),
    ) {
        let cap = plus(start, policy.max);
        let mut session = Lifespan::open(start, &policy);
        prop_assert_eq!(session.expires_at, plus(start, policy.ttl));
        prop_assert_eq!(session.remaining(start), policy.ttl);

        let mut now = start;
        for (permille, jitter) in steps {
            now += TimeDelta::microseconds(micros(policy.ttl) / 1000 * permille + jitter);
            let before = session;
            let expected = expected_refusal(&before, now, &policy);
            let offer = before.offer(now, &policy);
            prop_assert_eq!(offer.available, expected.is_none());
            prop_assert_eq!(offer.refusal.as_ref().map(|e| e.code()), expected);
            match before.extend(now, &policy) {
                Ok(after) => {
                    prop_assert_eq!(expected, None);
                    prop_assert_eq!(offer.gain, (after.expires_at - before.expires_at).to_std().unwrap());
                    prop_assert!(offer.gain <= policy.extend_window.max(policy.ttl));
                    prop_assert!(!before.is_expired(now));
                    prop_assert_eq!(after.started_at, before.started_at);
                    prop_assert_eq!(after.expires_at, plus(now, policy.ttl).min(cap));
                    prop_assert!(after.expires_at > before.expires_at, "expiry moved later");
                    prop_assert_eq!(after.extensions_used, before.extensions_used + 1);
                    prop_assert_eq!(after.extensions_left(&policy) + 1, before.extensions_left(&policy));
                    prop_assert!(!after.is_expired(now));
                    prop_assert!(after.remaining(now) <= policy.ttl);
                    session = after;
                }
                Err(err) => {
                    prop_assert!(err.is_extend_refusal(), "{}", err);
                    prop_assert_eq!(Some(err.code()), expected, "{}", err);
                    // Refusing is deterministic: the same attempt is refused the same way,
                    // and the session keeps its expiry and its extensions.
                    prop_assert_eq!(before.extend(now, &policy), Err(err));
                    prop_assert_eq!(session, before);
                }
            }
            prop_assert!(session.expires_at <= cap, "expiry passed start + max");
            prop_assert!(session.expires_at >= before.expires_at, "expiry moved backwards");
            prop_assert!(session.extensions_used <= policy.max_extensions);
            prop_assert!(session.hard_deadline(&policy) > session.expires_at);
        }
    }

    /// Whoever asks (countdown or reaper), "expired" is exactly "nothing remaining", which is
    /// exactly "now is at or past expires_at"; remaining time only ever shrinks as now grows.
    #[test]
    fn remaining_and_expired_agree(
        started_at in any_instant(),
        expires_at in any_instant(),
        extensions_used in any::<u32>(),
        now in any_instant(),
        later_by in 0..=i64::MAX / 1000,
    ) {
        let s = Lifespan { started_at, expires_at, extensions_used };
        prop_assert_eq!(s.is_expired(now), s.remaining(now).is_zero());
        prop_assert_eq!(s.is_expired(now), now >= expires_at);
        if now < expires_at {
            let left = (expires_at - now).to_std().unwrap();
            prop_assert_eq!(s.remaining(now), left);
        }
        if let Some(later) = now.checked_add_signed(TimeDelta::microseconds(later_by)) {
            prop_assert!(s.remaining(later) <= s.remaining(now));
            prop_assert!(!s.is_expired(now) || s.is_expired(later), "once expired, always expired");
        }
    }

    /// Whatever the policy (even one validation rejects) and whatever the instants, nothing
    /// panics, a granted extension moves the expiry strictly later without passing the cap or
    /// the extension limit, and a refusal is an extension refusal.
    #[test]
    fn every_policy_and_instant_is_handled_without_panicking(
        start in any_instant(),
        policy in any_policy(),
        expires_at in any_instant(),
        extensions_used in any::<u32>(),
        now in any_instant(),
    ) {
        let opened = Lifespan::open(start, &policy);
        prop_assert!(opened.expires_at >= start);
        prop_assert!(opened.expires_at <= opened.max_expires_at(&policy));
        prop_assert!(opened.hard_deadline(&policy) >= opened.max_expires_at(&policy));
        let grace = i64::try_from(policy.hard_deadline_grace.as_secs()).unwrap_or(i64::MAX);
        prop_assert!(policy.pod_active_deadline_seconds() >= grace);

        for s in [opened, Lifespan { started_at: start, expires_at, extensions_used }] {
            match s.extend(now, &policy) {
                Ok(after) => {
                    prop_assert!(after.expires_at > s.expires_at);
                    prop_assert!(after.expires_at <= s.max_expires_at(&policy));
                    prop_assert!(after.extensions_used <= policy.max_extensions);
                    prop_assert_eq!(after.extensions_used, s.extensions_used + 1);
                }
                Err(err) => prop_assert!(err.is_extend_refusal(), "{}", err),
            }
            prop_assert_eq!(s.is_expired(now), s.remaining(now).is_zero());
        }
    }

    /// An operator's extension never passes start + max, never uses a student's extension,
    /// moves the expiry by exactly `by` when the cap allows, and is refused only when the
    /// session is expired or would gain nothing.
    #[test]
    fn operator_extensions_are_capped_by_the_maximum_lifetime(
        start in instant(),
        policy in valid_policy(),
        elapsed_permille in 0..=1200i64,
        by in 0..=LIFETIME_LIMIT.as_secs(),
    ) {
        let s = Lifespan::open(start, &policy);
        let now = start + TimeDelta::microseconds(micros(policy.ttl) / 1000 * elapsed_permille);
        let cap = s.max_expires_at(&policy);
        match s.extend_by_operator(now, Duration::from_secs(by), &policy) {
            Ok(after) => {
                prop_assert!(!s.is_expired(now));
                prop_assert_eq!(after.expires_at, plus(s.expires_at, Duration::from_secs(by)).min(cap));
                prop_assert!(after.expires_at > s.expires_at);
                prop_assert_eq!(after.extensions_used, s.extensions_used);
            }
            Err(LifespanError::Expired { .. }) => prop_assert!(s.is_expired(now)),
            Err(LifespanError::MaxLifetime { .. }) => prop_assert!(by == 0 || s.expires_at >= cap),
            Err(other) => prop_assert!(false, "unexpected refusal {}", other),
        }
    }

    /// Every valid policy survives being written as settings and read back, and its pod
    /// deadline is exactly max + the grace.
    #[test]
    fn valid_policies_round_trip_through_settings(policy in valid_policy()) {
        let ttl = format!("{}s", policy.ttl.as_secs());
        let max = format!("{}s", policy.max.as_secs());
        let n = policy.max_extensions.to_string();
        let window = format!("{}s", policy.extend_window.as_secs());
        let grace = format!("{}s", policy.hard_deadline_grace.as_secs());
        prop_assert_eq!(
            Policy::from_settings(Some(&ttl), Some(&max), Some(&n))
                .and_then(|p| p.with_extend_window_setting(Some(&window)))
                .and_then(|p| p.with_hard_deadline_grace_setting(Some(&grace))),
            Ok(policy)
        );
        let expected = i64::try_from(policy.max.as_secs() + policy.hard_deadline_grace.as_secs()).unwrap();
        prop_assert_eq!(policy.pod_active_deadline_seconds(), expected);
    }

    /// A maximum shorter than the ttl is always rejected, naming both settings.
    #[test]
    fn max_shorter_than_ttl_is_always_rejected(ttl in 2..=100_000u64, short_by in 1..=100_000u64) {
        let max = ttl.saturating_sub(short_by);
        let result = Policy::from_settings(
            Some(&format!("{ttl}s")),
            Some(&format!("{max}s")),
            None,
        );
        let err = result.unwrap_err();
        prop_assert!(matches!(err, LifespanError::MaxShorterThanTtl { .. }), "{}", err);
        let text = err.to_string();
        prop_assert!(text.contains("TTLAB_SESSION_MAX") && text.contains("TTLAB_SESSION_TTL"), "{}", text);
    }
}
