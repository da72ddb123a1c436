//! What a namespace quota's refusal of a create means ([`decide_quota`]): at capacity it is a
//! place in the line (the start goes back on the waitlist, at the front), with places free it
//! is the quota lagging (retried for a short grace), and only a refusal that persists with
//! places free fails, with the reason. Pure: counts and durations in, a decision out.

use std::time::Duration;

use ttlab_cluster::ClusterError;

use super::Failure;

/// VM places by the server's count when a quota refused a create: the places taken by
/// everything but the refused session (VMs of other live sessions of every environment, VMs
/// shutting down, VMs without a lab) against the VM limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Places {
    /// Places taken by others.
    pub taken: usize,
    /// The VM limit.
    pub limit: usize,
}

impl Places {
    /// Places free (none when over the limit).
    pub fn free(self) -> usize {
        self.limit.saturating_sub(self.taken)
    }
}

/// How much of the refused resource a quota had used against its hard limit, as its refusal
/// states it (`used: count/virtualmachines.kubevirt.io=8, limited: …=8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QuotaUse {
    /// Used.
    pub used: u64,
    /// Hard.
    pub hard: u64,
}

/// Reads the used and hard counts of the first resource a quota's `exceeded quota` refusal
/// names; `None` when the message does not state them as whole numbers (a memory quantity
/// such as `4Gi`, another wording).
pub(crate) fn quota_use(message: &str) -> Option<QuotaUse> {
    /// The first `name=value` after `key` in `message`, its value as a whole number.
    fn first_count(message: &str, key: &str) -> Option<u64> {
        let rest = &message[message.find(key)? + key.len()..];
        let pair = rest.split([',', ' ']).find(|p| !p.is_empty())?;
        pair.rsplit_once('=')?.1.trim().parse().ok()
    }
    Some(QuotaUse {
        used: first_count(message, "used: ")?,
        hard: first_count(message, "limited: ")?,
    })
}

/// What to do about a create a namespace quota refused.
#[derive(Debug)]
pub(crate) enum QuotaDecision {
    /// The namespace is full: roll the start back and put the student back in the line, at
    /// the front. Not a failure: a place taken by someone else in the same moment.
    Requeue,
    /// Try the create again after this pause (the quota is recounting or counting).
    Retry(Duration),
    /// Give up: places are free and the quota kept refusing past its grace.
    Fail(Failure),
}

/// A quota's refusal of a create, as [`decide_quota`] weighs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QuotaRefusal<'a> {
    /// What was being created.
    pub what: &'a str,
    /// The refusal: [`ClusterError::QuotaPending`] or [`ClusterError::QuotaExceeded`].
    pub error: &'a ClusterError,
    /// How many times the quota refused it so far (this one included).
    pub refusals: u32,
    /// How long refusals have persisted (since the first).
    pub persisted: Duration,
}

/// Decides what a quota's refusal means.
///
/// When the server's own count leaves no place for this session (others hold every place:
/// two servers raced for the last one and this one lost), the namespace is full and the start
/// goes back in the line at once ([`QuotaDecision::Requeue`]). Otherwise the quota may be
/// lagging (it recounts deletions a moment later, or has not counted a new quota yet): the
/// create is retried after `pause` (the shared policy's next one) while refusals have
/// persisted no longer than `grace`. Past the grace, a quota whose refusal says its used
/// count has reached its hard one is full all the same (VMs the server does not count hold
/// it): requeue; only a refusal with places free by both counts fails, with the reason.
pub(crate) fn decide_quota(
    refusal: QuotaRefusal<'_>,
    places: Places,
    pause: Duration,
    grace: Duration,
) -> QuotaDecision {
    let message = match refusal.error {
        ClusterError::QuotaExceeded { message } | ClusterError::QuotaPending { message } => message,
        other => {
            return QuotaDecision::Fail(Failure::Create {
                what: refusal.what.to_owned(),
                error: other.clone(),
            });
        }
    };
    if places.free() == 0 {
        return QuotaDecision::Requeue;
    }
    if refusal.persisted + pause <= grace {
        return QuotaDecision::Retry(pause);
    }
    let exceeded = matches!(refusal.error, ClusterError::QuotaExceeded { .. });
    if exceeded && quota_use(message).is_some_and(|u| u.used >= u.hard) {
        return QuotaDecision::Requeue;
    }
    QuotaDecision::Fail(if exceeded {
        Failure::QuotaPersists {
            what: refusal.what.to_owned(),
            refusals: refusal.refusals,
            took: refusal.persisted,
            free: places.free(),
            message: message.clone(),
        }
    } else {
        Failure::QuotaUncounted {
            what: refusal.what.to_owned(),
            refusals: refusal.refusals,
            took: refusal.persisted,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL_MESSAGE: &str = "virtualmachines.kubevirt.io \"tt-9\" is forbidden: exceeded quota: \
        ttlab-vms, requested: count/virtualmachines.kubevirt.io=1, used: \
        count/virtualmachines.kubevirt.io=8, limited: count/virtualmachines.kubevirt.io=8";
    const LAGGING_MESSAGE: &str = "virtualmachines.kubevirt.io \"tt-9\" is forbidden: exceeded \
        quota: ttlab-vms, requested: count/virtualmachines.kubevirt.io=1, used: \
        count/virtualmachines.kubevirt.io=7, limited: count/virtualmachines.kubevirt.io=8";

    fn exceeded(message: &str) -> ClusterError {
        ClusterError::QuotaExceeded {
            message: message.to_owned(),
        }
    }

    fn refusal<'a>(
        error: &'a ClusterError,
        refusals: u32,
        persisted: Duration,
    ) -> QuotaRefusal<'a> {
        QuotaRefusal {
            what: "VM",
            error,
            refusals,
            persisted,
        }
    }

    const SECOND: Duration = Duration::from_secs(1);
    const GRACE: Duration = Duration::from_secs(15);

    #[test]
    fn the_used_and_hard_counts_are_read_from_the_refusal() {
        assert_eq!(quota_use(FULL_MESSAGE), Some(QuotaUse { used: 8, hard: 8 }));
        assert_eq!(
            quota_use(LAGGING_MESSAGE),
            Some(QuotaUse { used: 7, hard: 8 })
        );
        // Several resources: the first is read.
        assert_eq!(
            quota_use(
                "exceeded quota: q, requested: pods=1,secrets=1, used: pods=3,secrets=9, limited: pods=4,secrets=10"
            ),
            Some(QuotaUse { used: 3, hard: 4 })
        );
        // Not whole numbers, or not stated: unknown.
        assert_eq!(
            quota_use(
                "exceeded quota: q, requested: memory=2Gi, used: memory=6Gi, limited: memory=8Gi"
            ),
            None
        );
        assert_eq!(quota_use("exceeded quota"), None);
        assert_eq!(quota_use(""), None);
    }

    #[test]
    fn a_refusal_at_the_vm_limit_requeues_at_once() {
        let error = exceeded("exceeded quota");
        let full = Places { taken: 8, limit: 8 };
        let decision = decide_quota(refusal(&error, 1, Duration::ZERO), full, SECOND, GRACE);
        assert!(matches!(decision, QuotaDecision::Requeue), "{decision:?}");
        // Over the limit (ghosts counted) is full too, however long it has persisted.
        let over = Places { taken: 9, limit: 8 };
        let decision = decide_quota(refusal(&error, 40, GRACE * 4), over, SECOND, GRACE);
        assert!(matches!(decision, QuotaDecision::Requeue), "{decision:?}");
    }

    #[test]
    fn a_quota_used_up_with_places_free_by_the_count_is_retried_then_requeued() {
        // The quota counts VMs still being deleted a moment longer than the server does.
        let error = exceeded(FULL_MESSAGE);
        let places = Places { taken: 6, limit: 8 };
        let decision = decide_quota(refusal(&error, 1, Duration::ZERO), places, SECOND, GRACE);
        assert!(matches!(decision, QuotaDecision::Retry(_)), "{decision:?}");
        // Still used up past the grace: full by VMs the server does not count; a wait.
        let decision = decide_quota(refusal(&error, 14, GRACE), places, SECOND, GRACE);
        assert!(matches!(decision, QuotaDecision::Requeue), "{decision:?}");
    }

    #[test]
    fn a_refusal_with_free_places_is_retried_with_the_pause_within_the_grace() {
        let error = exceeded(LAGGING_MESSAGE);
        let places = Places { taken: 7, limit: 8 };
        let pause = Duration::from_millis(700);
        let decision = decide_quota(refusal(&error, 3, SECOND * 5), places, pause, GRACE);
        assert!(
            matches!(decision, QuotaDecision::Retry(p) if p == pause),
            "{decision:?}"
        );
        // The last pause that still ends within the grace.
        let decision = decide_quota(refusal(&error, 9, GRACE - pause), places, pause, GRACE);
        assert!(matches!(decision, QuotaDecision::Retry(_)), "{decision:?}");
    }

    #[test]
    fn a_refusal_with_free_places_fails_past_the_grace_with_the_reason() {
        let error = exceeded(LAGGING_MESSAGE);
        let places = Places { taken: 6, limit: 8 };
        let decision = decide_quota(refusal(&error, 12, SECOND * 15), places, SECOND, GRACE);
        let QuotaDecision::Fail(failure) = decision else {
            panic!("not a failure: {decision:?}");
        };
        let reason = failure.to_string();
        assert!(
            reason.starts_with(
                "the lab namespace's quota refused the VM 12 times in 15 s although 2 VM places are free ("
            ),
            "{reason}"
        );
        assert!(
            reason.contains("used: count/virtualmachines.kubevirt.io=7"),
            "{reason}"
        );
        // A zero grace fails at the first refusal.
        let decision = decide_quota(
            refusal(&error, 1, Duration::ZERO),
            places,
            SECOND,
            Duration::ZERO,
        );
        assert!(matches!(decision, QuotaDecision::Fail(_)), "{decision:?}");
    }

    #[test]
    fn a_quota_not_counted_yet_is_retried_then_fails_as_uncounted() {
        let error = ClusterError::QuotaPending {
            message: "status unknown for quota: ttlab-vms".into(),
        };
        let places = Places { taken: 1, limit: 8 };
        let settle = Duration::from_secs(30);
        let decision = decide_quota(refusal(&error, 2, SECOND), places, SECOND, settle);
        assert!(matches!(decision, QuotaDecision::Retry(_)), "{decision:?}");
        let decision = decide_quota(refusal(&error, 20, settle), places, SECOND, settle);
        let QuotaDecision::Fail(failure) = decision else {
            panic!("not a failure: {decision:?}");
        };
        assert!(
            failure.to_string().starts_with(
                "the cluster had still not counted the lab namespace's quota after 30 s"
            ),
            "{failure}"
        );
        // At the limit, the line is the answer whatever the quota's state.
        let full = Places { taken: 8, limit: 8 };
        let decision = decide_quota(refusal(&error, 1, Duration::ZERO), full, SECOND, settle);
        assert!(matches!(decision, QuotaDecision::Requeue), "{decision:?}");
    }

    #[test]
    fn a_refusal_other_than_a_quota_fails_as_a_create() {
        let error = ClusterError::Conflict {
            message: "tt-9 belongs to another session".into(),
        };
        let places = Places { taken: 8, limit: 8 };
        let decision = decide_quota(refusal(&error, 1, Duration::ZERO), places, SECOND, GRACE);
        assert!(
            matches!(decision, QuotaDecision::Fail(Failure::Create { .. })),
            "{decision:?}"
        );
    }
}
