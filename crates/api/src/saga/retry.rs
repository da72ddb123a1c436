//! The saga's retries, their pauses from the shared policy (`ttlab_background::Backoff`, over
//! backon): a database that went away ([`with_db`]), and a create the cluster refused for now
//! ([`create_object`]: a quota not counted yet, or a transient failure).

use std::future::Future;
use std::time::Duration;

use ttlab_background::Backoff;
use ttlab_cluster::ClusterError;
use ttlab_model::Runtime;
use ttlab_store::{Session, StoreError};

use super::quota::{Places, QuotaDecision, QuotaRefusal, decide_quota};
use super::{Failure, Stop, steps::ensure_starting};
use crate::AppState;

/// How long a provisioning step retries a database that went away before giving up.
const DB_RETRY_FOR: Duration = Duration::from_secs(120);

/// Pauses between attempts at a database that went away: 50 ms, doubling up to 2 s.
const DB_BACKOFF: Backoff =
    Backoff::doubling(Duration::from_millis(50), Duration::from_secs(2)).without_jitter();

/// First and longest pause between creates refused by a quota the cluster has not counted yet
/// (each pause is drawn between half and all of the current one, so servers retrying at once
/// spread out).
const QUOTA_RETRY_FIRST: Duration = Duration::from_millis(250);
const QUOTA_RETRY_MAX: Duration = Duration::from_secs(4);
/// The quota pauses.
const QUOTA_BACKOFF: Backoff = Backoff::doubling(QUOTA_RETRY_FIRST, QUOTA_RETRY_MAX);

/// First and longest pause between attempts of a cluster call that failed transiently (a 5xx,
/// 429, a timeout, a lost connection), jittered like the quota pauses. kube-rs has already
/// retried 429, 503 and 504 inside the call, honouring `Retry-After`, before such a failure
/// reaches this loop; it retries nothing else.
const FAULT_RETRY_FIRST: Duration = Duration::from_millis(200);
const FAULT_RETRY_MAX: Duration = Duration::from_secs(5);
/// The pauses after transient failures.
const FAULT_BACKOFF: Backoff = Backoff::doubling(FAULT_RETRY_FIRST, FAULT_RETRY_MAX);

/// Whether a store error means the database cannot be reached right now.
fn db_unavailable(e: &StoreError) -> bool {
    crate::error::store_unavailable(e)
}

/// Runs a database step, retrying with backoff while the database is unreachable (up to
/// two minutes), so a database restart does not lose a session being provisioned.
pub(crate) async fn with_db<T, F, Fut>(mut step: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let start = tokio::time::Instant::now();
    let mut pauses = DB_BACKOFF.pauses();
    loop {
        match step().await {
            Err(e) if db_unavailable(&e) && start.elapsed() < DB_RETRY_FOR => {
                tracing::debug!(error = %e, "database unavailable; retrying");
                tokio::time::sleep(pauses.next_pause()).await;
            }
            other => return other,
        }
    }
}

/// How a failed create may be retried.
enum Retry {
    /// Refused by a quota ([`ClusterError::QuotaPending`] or [`ClusterError::QuotaExceeded`]),
    /// for at most this long in all.
    Quota(Duration),
    /// Failed transiently ([`ClusterError::is_retryable`]).
    Fault,
    /// Not at all.
    Never,
}

impl Retry {
    fn of(state: &AppState, e: &ClusterError) -> Self {
        match e {
            ClusterError::QuotaPending { .. } => Self::Quota(state.config().quota_settle_wait),
            ClusterError::QuotaExceeded { .. } => Self::Quota(state.config().quota_recount_wait),
            e if e.is_retryable() => Self::Fault,
            _ => Self::Never,
        }
    }
}

/// Creates one object of `session` with `create`.
///
/// A create is safe to repeat: the cluster adopts an object of the same name that carries this
/// session's labels (a create whose reply was lost, or that kube-rs retried after it was
/// applied), and refuses one that is not this session's as a conflict. So a create that failed
/// transiently ([`ClusterError::is_retryable`]: a 5xx, 429, a timeout, a lost connection) is
/// tried again with jittered backoff for at most [`crate::ApiConfig::cluster_retry_budget`],
/// then fails with a reason that names the object and how many attempts failed.
///
/// A create a ResourceQuota refused is weighed by [`decide_quota`] against the server's count
/// of the VM places others hold: at capacity the start stops as [`Stop::Requeued`] (the
/// student goes back in the line, at the front; a pod lab or a pool's lab, which cannot wait
/// in line, fails as the namespace being full); with places free it is tried again, for at
/// most [`crate::ApiConfig::quota_settle_wait`] when the quota has not been counted yet
/// ([`ClusterError::QuotaPending`]: a quota or resource type that appeared moments ago;
/// nothing was created) and [`crate::ApiConfig::quota_recount_wait`] when it refused as
/// exceeded ([`ClusterError::QuotaExceeded`]: the quota recounts what deletions freed a moment
/// later), then fails with the reason. Every retry stops if the session left `starting`
/// meanwhile. Any other failure (a foreign object holding the name, a missing
/// permission, an invalid object) ends provisioning at once.
pub(crate) async fn create_object<T, F, Fut>(
    state: &AppState,
    session: &Session,
    what: &str,
    mut create: F,
) -> Result<T, Stop>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ClusterError>>,
{
    let start = tokio::time::Instant::now();
    let mut quota_pauses = QUOTA_BACKOFF.pauses();
    let mut fault_pauses = FAULT_BACKOFF.pauses();
    let mut refusals = 0u32;
    let mut first_refusal = None;
    let mut faults = 0u32;
    loop {
        let e = match create().await {
            Ok(created) => return Ok(created),
            Err(e) => e,
        };
        let wait = match Retry::of(state, &e) {
            Retry::Never => return Err(create_failed(what, e)),
            Retry::Fault => {
                faults += 1;
                let wait = fault_pauses.next_pause();
                if start.elapsed() + wait > state.config().cluster_retry_budget {
                    tracing::warn!(what, faults, error = %e, "the cluster kept failing; giving up");
                    return Err(Failure::ClusterKeptFailing {
                        what: format!("create the {what}"),
                        attempts: faults,
                        took: start.elapsed(),
                        last: e,
                    }
                    .into());
                }
                tracing::info!(what, faults, error = %e, "the create failed transiently; retrying");
                wait
            }
            Retry::Quota(grace) => {
                refusals += 1;
                let first = *first_refusal.get_or_insert_with(tokio::time::Instant::now);
                let refusal = QuotaRefusal {
                    what,
                    error: &e,
                    refusals,
                    persisted: first.elapsed(),
                };
                let places = places_of_others(state, session).await;
                match decide_quota(refusal, places, quota_pauses.next_pause(), grace) {
                    QuotaDecision::Retry(wait) => {
                        tracing::info!(what, refusals, error = %e, "refused by the quota; retrying the create");
                        wait
                    }
                    QuotaDecision::Fail(failure) => {
                        tracing::warn!(what, refusals, error = %e, "the quota still refuses; giving up");
                        return Err(failure.into());
                    }
                    QuotaDecision::Requeue if can_wait_in_line(session) => {
                        tracing::info!(what, refusals, taken = places.taken, limit = places.limit, error = %e, "the namespace is full; back in the line");
                        return Err(Stop::Requeued(format!(
                            "the lab namespace was full when your lab was being created (its \
                             quota refused the {what}); you are back in the line, at the front"
                        )));
                    }
                    QuotaDecision::Requeue => {
                        tracing::warn!(what, refusals, error = %e, "the namespace is full and this session cannot wait in line");
                        return Err(create_failed(what, e));
                    }
                }
            }
        };
        tokio::time::sleep(wait).await;
        ensure_starting(state, session).await?;
    }
}

/// The VM places others hold on the session's site by the server's count (its VM limit against every place taken
/// but this session's), for [`decide_quota`]. A pod lab is held back by no VM limit; places
/// that cannot be counted now count as free (the quota's own words decide past the grace).
async fn places_of_others(state: &AppState, session: &Session) -> Places {
    let site = state.site_of(&session.site);
    let limit = site.vm_limit();
    if session.runtime != Runtime::Vm {
        return Places { taken: 0, limit };
    }
    let counted = match super::listed_vms(&site).await {
        Ok(listing) => super::count_vms(state, &site, &listing).await,
        Err(e) => Err(e),
    };
    match counted {
        Ok(used) => Places {
            taken: used
                .total()
                .saturating_sub(super::nodes_of(state, session).len()),
            limit,
        },
        Err(e) => {
            tracing::info!(error = %e, "cannot count the VM places; the quota's refusal decides");
            Places { taken: 0, limit }
        }
    }
}

/// Whether a session refused at capacity can go back in the line: a student's VM lab (a pod
/// lab is not held back by the VM limit, a pool's lab has no student yet).
fn can_wait_in_line(session: &Session) -> bool {
    session.runtime == Runtime::Vm && session.user.is_some()
}

/// Why creating `what` failed, for the student.
fn create_failed(what: &str, error: ClusterError) -> Stop {
    Failure::Create {
        what: what.to_owned(),
        error,
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `n`th pause (from 1) of a fresh run of `policy`.
    fn nth_pause(policy: Backoff, n: usize) -> Duration {
        policy.pauses().nth(n - 1).unwrap()
    }

    #[test]
    fn quota_retry_pauses_are_jittered_within_half_and_all_of_the_pause() {
        // The fifth pause is the longest (250 ms doubled four times is 4 s).
        let pause = Duration::from_secs(4);
        let draws: Vec<Duration> = (0..64).map(|_| nth_pause(QUOTA_BACKOFF, 5)).collect();
        assert!(
            draws.iter().all(|d| *d >= pause / 2 && *d <= pause),
            "{draws:?}"
        );
        let distinct: std::collections::BTreeSet<_> = draws.iter().collect();
        assert!(distinct.len() > 1, "no jitter: {draws:?}");
    }

    #[test]
    fn retry_pauses_double_from_their_first_to_their_longest() {
        for (policy, first, max) in [
            (QUOTA_BACKOFF, QUOTA_RETRY_FIRST, QUOTA_RETRY_MAX),
            (FAULT_BACKOFF, FAULT_RETRY_FIRST, FAULT_RETRY_MAX),
        ] {
            let mut pause = first;
            for n in 1..=8 {
                let drawn = nth_pause(policy, n);
                assert!(
                    drawn >= pause / 2 && drawn <= pause,
                    "pause {n}: {drawn:?} for {pause:?}"
                );
                pause = (pause * 2).min(max);
            }
        }
        // The database's pauses are not jittered: 50 ms, doubling up to 2 s.
        let db: Vec<Duration> = DB_BACKOFF.pauses().take(7).collect();
        let ms = Duration::from_millis;
        assert_eq!(
            db,
            [
                ms(50),
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(2000)
            ]
        );
    }
}
