//! The provisioning saga (steps ② to ⑧ of the write-up) and the end of a session.
//!
//! [`open_session`] runs inside the request: capacity under the database's capacity lock,
//! then the `starting` row (one live row per user is the database's rule). Everything after
//! the 202 runs in a task per session ([`spawn_provisioning`]) holding the session's
//! provisioning lease; its state is the row. Any failure deletes everything created for the
//! session and marks it `failed` with a reason a student can read. Every live server adopts
//! the `starting` sessions nobody holds the lease of and resumes them ([`recover`]); a server
//! told to stop hands its sessions over ([`hand_over`]).

mod agent;
mod disk;
mod gone;
mod open;
mod pod;
mod tokens;
mod vm;

use std::future::Future;
use std::time::Duration;

use ttlab_cluster::{ClusterError, LabelSweep, SessionTarget, teardown_session};
use ttlab_model::{FinalStatus, NodeName, Runtime, SessionStatus};
use ttlab_store::{Session, StoreError};

use crate::{ApiError, AppState};

pub use agent::{AGENT_HEARTBEAT, AGENT_RECHECK, ensure_agent_config_map, record_agent_seen};
use gone::complete;
pub(crate) use open::ListedVm;
pub(crate) use open::grant_waitlist;
pub use open::open_session;
pub(crate) use open::{count_vms, listed_vms};
pub(crate) use pod::LAB_CONTAINER;
pub(crate) use tokens::fresh as fresh_token;
pub(crate) use tokens::stored as agent_token;

/// How long a provisioning step retries a database that went away before giving up.
const DB_RETRY_FOR: Duration = Duration::from_secs(120);

/// Why provisioning stopped.
#[derive(Debug)]
pub(crate) enum Stop {
    /// It failed; the reason is for the student.
    Failed(String),
    /// The row left `starting` under us (finished by the student, failed by the reaper):
    /// whoever moved it ends it; we only remove what we created.
    Superseded,
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Failed(format!("the database failed during provisioning: {e}"))
    }
}

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
    let mut pause = Duration::from_millis(50);
    loop {
        match step().await {
            Err(e) if db_unavailable(&e) && start.elapsed() < DB_RETRY_FOR => {
                tracing::debug!(error = %e, "database unavailable; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

/// First and longest pause between creates refused by a quota the cluster has not counted yet
/// (each pause is drawn between half and all of the current one, so servers retrying at once
/// spread out).
const QUOTA_RETRY_FIRST: Duration = Duration::from_millis(250);
const QUOTA_RETRY_MAX: Duration = Duration::from_secs(4);

/// First and longest pause between attempts of a cluster call that failed transiently (a 5xx,
/// 429, a timeout, a lost connection), jittered like the quota pauses. kube-rs has already
/// retried 429, 503 and 504 inside the call, honouring `Retry-After`, before such a failure
/// reaches this loop; it retries nothing else.
const FAULT_RETRY_FIRST: Duration = Duration::from_millis(200);
const FAULT_RETRY_MAX: Duration = Duration::from_secs(5);

/// Creates one object of `session` with `create`.
///
/// A create is safe to repeat: the cluster adopts an object of the same name that carries this
/// session's labels (a create whose reply was lost, or that kube-rs retried after it was
/// applied), and refuses one that is not this session's as a conflict. So a create that failed
/// transiently ([`ClusterError::is_retryable`]: a 5xx, 429, a timeout, a lost connection) is
/// tried again with jittered backoff for at most [`crate::ApiConfig::cluster_retry_budget`],
/// then fails with a reason that names the object and how many attempts failed.
///
/// A create refused only because a ResourceQuota has not been counted yet
/// ([`ClusterError::QuotaPending`]: a quota or resource type that appeared moments ago;
/// nothing was created) is tried again for at most [`crate::ApiConfig::quota_settle_wait`];
/// one refused as exceeded ([`ClusterError::QuotaExceeded`]) for at most
/// [`crate::ApiConfig::quota_recount_wait`] (the server's own count admitted the session; the
/// quota recounts what deletions freed a moment later). Every retry stops if the session left
/// `starting` meanwhile. Any other failure (a foreign object holding the name, a missing
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
    let mut pause = QUOTA_RETRY_FIRST;
    let mut fault_pause = FAULT_RETRY_FIRST;
    let mut refusals = 0u32;
    let mut faults = 0u32;
    loop {
        let (e, budget) = match create().await {
            Ok(created) => return Ok(created),
            Err(e @ ClusterError::QuotaPending { .. }) => (e, state.config().quota_settle_wait),
            Err(e @ ClusterError::QuotaExceeded { .. }) => (e, state.config().quota_recount_wait),
            Err(e) if e.is_retryable() => {
                faults += 1;
                let wait = jittered(fault_pause);
                if start.elapsed() + wait > state.config().cluster_retry_budget {
                    tracing::warn!(what, faults, error = %e, "the cluster kept failing; giving up");
                    return Err(gave_up(&format!("create the {what}"), faults, start, &e));
                }
                tracing::info!(what, faults, error = %e, "the create failed transiently; retrying");
                tokio::time::sleep(wait).await;
                fault_pause = (fault_pause * 2).min(FAULT_RETRY_MAX);
                ensure_starting(state, session).await?;
                continue;
            }
            Err(e) => return Err(create_failed(what, &e)),
        };
        refusals += 1;
        let wait = jittered(pause);
        if start.elapsed() + wait > budget {
            if let ClusterError::QuotaExceeded { .. } = e {
                tracing::warn!(what, refusals, error = %e, "the quota still refuses; giving up");
                return Err(create_failed(what, &e));
            }
            tracing::warn!(what, refusals, error = %e, "the quota was still not counted; giving up");
            return Err(Stop::Failed(format!(
                "the cluster had still not counted the lab namespace's quota after {} s (it \
                 refused the {what} {refusals} times); try again in a minute",
                start.elapsed().as_secs().max(1)
            )));
        }
        tracing::info!(what, refusals, error = %e, "refused by the quota; retrying the create");
        tokio::time::sleep(wait).await;
        pause = (pause * 2).min(QUOTA_RETRY_MAX);
        ensure_starting(state, session).await?;
    }
}

/// The final reason of a call that kept failing transiently.
fn gave_up(what: &str, attempts: u32, start: tokio::time::Instant, last: &ClusterError) -> Stop {
    Stop::Failed(format!(
        "could not {what}: the cluster failed {attempts} times in {} s (last: {last}); try \
         again in a few minutes",
        start.elapsed().as_secs().max(1)
    ))
}

/// Between half and all of `pause`, at random.
fn jittered(pause: Duration) -> Duration {
    let mut bytes = [0u8; 4];
    let draw = match getrandom::fill(&mut bytes) {
        Ok(()) => f64::from(u32::from_le_bytes(bytes)) / f64::from(u32::MAX),
        Err(_) => 0.5,
    };
    pause.mul_f64(0.5 + draw / 2.0)
}

/// Why creating `what` failed, for the student.
pub(crate) fn create_failed(what: &str, e: &ClusterError) -> Stop {
    match e {
        ClusterError::QuotaExceeded { .. } => Stop::Failed(format!(
            "the lab namespace is full (its quota refused the {what}); try again later"
        )),
        other => Stop::Failed(format!("could not create the {what}: {other}")),
    }
}

/// Stops if the row left `starting` (finished by the student, failed by the reaper).
pub(crate) async fn ensure_starting(state: &AppState, session: &Session) -> Result<(), Stop> {
    let row = with_db(|| async { state.store().sessions().get(session.id).await }).await?;
    match row {
        Some(r) if r.status == SessionStatus::Starting => Ok(()),
        _ => Err(Stop::Superseded),
    }
}

/// Records that provisioning of `session` reached `stage` (retrying while the database is
/// away).
pub(crate) async fn record_stage(
    state: &AppState,
    session: &Session,
    stage: ttlab_store::Stage,
) -> Result<bool, StoreError> {
    with_db(|| async {
        state
            .store()
            .sessions()
            .record_stage(session.id, stage)
            .await
    })
    .await
}

/// Starts provisioning `session` in the background, holding its provisioning lease (renewed
/// on a heartbeat) for as long as it works on it. Whoever holds the lease provisions; without
/// it (another server has it, or the database could not be asked) nothing is done here, and
/// the session is adopted by whichever live server finds it unleased ([`recover`]).
///
/// The task stops at once — dropping the step in flight; every step is safe to repeat — when
/// the lease is lost (its renewals did not get through: another server may take the session
/// over) or this server hands over ([`hand_over`]: the lease is released first, so another
/// replica resumes the session without waiting for it to expire).
pub fn spawn_provisioning(state: &AppState, session: Session) {
    if state.is_draining() {
        tracing::info!(session = %session.id, "handing over: left for another server to adopt");
        return;
    }
    let st = state.clone();
    let tracked = state.handover().track();
    state.spawn(async move {
        let _tracked = tracked;
        let lock = match with_db(|| st.store().try_provisioning_lock(session.id)).await {
            Ok(Some(lock)) => lock,
            Ok(None) => {
                tracing::info!(session = %session.id, "another server is provisioning it");
                return;
            }
            Err(e) => {
                tracing::warn!(session = %session.id, error = %e, "cannot take the provisioning lease; a live server will adopt the session");
                return;
            }
        };
        let stopping = st.handover().stopping();
        tokio::select! {
            () = provision(&st, &session) => {
                if let Err(e) = lock.release().await {
                    tracing::debug!(session = %session.id, error = %e, "provisioning lease not released; it expires");
                }
            }
            () = lock.lost() => {
                tracing::warn!(session = %session.id, "the provisioning lease could not be renewed; stopping (another server resumes the session)");
            }
            () = stopping => {
                tracing::info!(session = %session.id, "handing over: provisioning stops here and resumes on another server");
                if let Err(e) = lock.release().await {
                    tracing::warn!(session = %session.id, error = %e, "provisioning lease not released; another server adopts the session once it expires");
                }
            }
        }
    });
}

/// How often a server looks for `starting` sessions nobody provisions (their provisioner
/// stopped or vanished), to adopt them.
pub const ADOPT_EVERY: Duration = Duration::from_secs(5);
/// How long a server handing over waits for its provisioning tasks to let go of their
/// sessions.
pub const HAND_OVER_WAIT: Duration = Duration::from_secs(10);

/// Begins a graceful hand-over (on SIGTERM): new starts are refused (503 with `Retry-After`),
/// adoption stops, and every provisioning task releases its session's lease and stops, so
/// another replica (or this server, restarted) resumes the session where it stands. Returns
/// once the tasks stopped, or after [`HAND_OVER_WAIT`].
pub async fn hand_over(state: &AppState) {
    state.handover().begin();
    if state.handover().idle(HAND_OVER_WAIT).await {
        tracing::info!("handed over every session being prepared");
    } else {
        tracing::warn!("some provisioning tasks did not stop in time; their leases expire");
    }
}

/// The agent tokens of a session being provisioned: those already stored when every node has
/// one (a session resumed after its provisioner stopped: its Secrets may carry them already,
/// and a Secret found in place is adopted, not rewritten), else fresh ones.
pub(crate) async fn resume_tokens(
    state: &AppState,
    session: &Session,
    nodes: &[NodeName],
) -> Result<Vec<ttlab_agent::protocol::AgentToken>, Stop> {
    let mut stored = Vec::with_capacity(nodes.len());
    for node in nodes {
        let token =
            with_db(|| async { state.store().agent_tokens().get(session.id, node).await }).await?;
        match token
            .as_deref()
            .and_then(ttlab_agent::protocol::AgentToken::parse)
        {
            Some(t) => stored.push(t),
            None => break,
        }
    }
    if stored.len() == nodes.len() {
        return Ok(stored);
    }
    nodes
        .iter()
        .map(|_| tokens::fresh())
        .collect::<Result<_, _>>()
        .map_err(|e| Stop::Failed(e.to_string()))
}

#[tracing::instrument(skip_all, fields(session = %session.id, lesson = %session.lesson))]
async fn provision(state: &AppState, session: &Session) {
    let result = match session.runtime {
        Runtime::Vm => vm::provision(state, session).await,
        Runtime::Pod => pod::provision(state, session).await,
    };
    let outcome = match &result {
        Ok(()) => crate::metrics::ProvisioningOutcome::Ready,
        Err(Stop::Failed(_)) => crate::metrics::ProvisioningOutcome::Failed,
        Err(Stop::Superseded) => crate::metrics::ProvisioningOutcome::Superseded,
    };
    state.metrics().provisioning_ended(session.runtime, outcome);
    match result {
        Ok(()) => tracing::info!("session running"),
        Err(Stop::Superseded) => {
            tracing::info!("session left starting during provisioning");
            // Whoever moved the row on may have left its completion to us (a student's finish
            // does, while we hold the provisioning lock): we are the last to create objects,
            // so a `finishing` row is completed here, after our own deletions.
            let row = with_db(|| async { state.store().sessions().get(session.id).await }).await;
            match row {
                // Running already: the statement that marks it running went through on an
                // attempt whose answer was lost (the retry then found it running), or another
                // server finished it. Its objects are the running lab's: nothing to undo.
                Ok(Some(row)) if row.status == SessionStatus::Running => {
                    tracing::info!("the session is running already; its objects stay");
                }
                Ok(Some(row)) if row.status == SessionStatus::Finishing => {
                    if let Err(e) = complete(state, row).await {
                        tracing::warn!(error = %e, "could not end the session; the reaper will");
                    }
                }
                _ => {
                    let report = teardown_session(
                        state.cluster().as_ref(),
                        &target(state, session, &nodes_of(state, session)),
                        LabelSweep::Always,
                    )
                    .await;
                    if !report.all_deleted() {
                        tracing::warn!(
                            "some objects could not be deleted; the reaper will find them"
                        );
                    }
                }
            }
        }
        Err(Stop::Failed(reason)) => {
            tracing::warn!(%reason, "provisioning failed");
            if let Err(e) = end_session(
                state,
                session,
                &[SessionStatus::Starting],
                FinalStatus::Failed,
                Some(&reason),
            )
            .await
            {
                tracing::warn!(error = %e, "could not end the failed session; the reaper will");
            }
        }
    }
}

/// The lab nodes of a session: recorded on the row, else the lesson's.
pub(crate) fn nodes_of(state: &AppState, session: &Session) -> Vec<NodeName> {
    if !session.vms.is_empty() {
        return session.vms.iter().map(|v| v.node.clone()).collect();
    }
    state
        .config()
        .lessons
        .get(&session.lesson)
        .map(|l| l.nodes.as_slice().to_vec())
        .unwrap_or_default()
}

fn target<'a>(state: &'a AppState, session: &Session, nodes: &'a [NodeName]) -> SessionTarget<'a> {
    SessionTarget {
        env: &state.config().env,
        session: session.id,
        runtime: session.runtime,
        nodes,
    }
}

/// Moves a session from one of `from` to finishing (heading for `to`), deletes everything
/// of it, and marks it final once every object is confirmed gone (waiting a few seconds for
/// that; an object still terminating leaves the row `finishing`, see [`gone`]). Returns the
/// row as it ends up; `None` if it was not in one of `from` (someone else is ending it).
pub async fn end_session(
    state: &AppState,
    session: &Session,
    from: &[SessionStatus],
    to: FinalStatus,
    reason: Option<&str>,
) -> Result<Option<Session>, ApiError> {
    let Some(row) = begin_finishing(state, session, from, to, reason).await? else {
        return Ok(None);
    };
    Ok(Some(complete(state, row).await?))
}

/// Moves a session from one of `from` to finishing (heading for `to`); `None` if it was not
/// in one of `from`.
async fn begin_finishing(
    state: &AppState,
    session: &Session,
    from: &[SessionStatus],
    to: FinalStatus,
    reason: Option<&str>,
) -> Result<Option<Session>, ApiError> {
    Ok(with_db(|| async {
        state
            .store()
            .sessions()
            .begin_finishing(session.id, from, to, reason)
            .await
    })
    .await?)
}

/// How long a student's finish of a `starting` session waits for its provisioner to stop
/// before leaving the session `finishing` for the provisioner (or the reaper) to complete.
const PROVISIONER_STOP_WAIT: Duration = Duration::from_secs(3);

/// A student ends their session (`starting` or `running`) as `finished`. A session still
/// being provisioned may have a provisioner creating objects at this very moment: the row goes
/// `finishing` first (so the provisioner stops at its next step), then the provisioning lock is
/// waited for, so nothing is created after the deletions. If the provisioner takes longer, the
/// row is returned `finishing`; the provisioner completes it when it stops.
pub async fn finish_by_student(
    state: &AppState,
    session: &Session,
) -> Result<Option<Session>, ApiError> {
    end_live(state, session, FinalStatus::Finished, None).await
}

/// Ends a `starting` or `running` session as `to` (with `reason`), the way a student's finish
/// does ([`finish_by_student`]): a provisioner still at work is waited for before anything is
/// deleted, or left to complete the row itself.
pub(crate) async fn end_live(
    state: &AppState,
    session: &Session,
    to: FinalStatus,
    reason: Option<&str>,
) -> Result<Option<Session>, ApiError> {
    let Some(row) = begin_finishing(
        state,
        session,
        &[SessionStatus::Starting, SessionStatus::Running],
        to,
        reason,
    )
    .await?
    else {
        return Ok(None);
    };
    if session.status != SessionStatus::Starting {
        return Ok(Some(complete(state, row).await?));
    }
    let lock = with_db(|| {
        state
            .store()
            .wait_provisioning_lock(session.id, PROVISIONER_STOP_WAIT)
    })
    .await?;
    match lock {
        Some(lock) => {
            // The provisioner may have completed it already on its way out.
            let fresh = with_db(|| async { state.store().sessions().get(session.id).await })
                .await?
                .unwrap_or(row);
            let done = if fresh.status == SessionStatus::Finishing {
                complete(state, fresh).await?
            } else {
                fresh
            };
            drop(lock);
            Ok(Some(done))
        }
        None => {
            tracing::info!(session = %session.id, "finish left to the provisioner, which is still stopping");
            Ok(Some(row))
        }
    }
}

/// At start-up, and from then on every [`ADOPT_EVERY`] (the `adoption` task,
/// [`crate::tasks`]): `starting` sessions of this environment nobody holds the provisioning
/// lease of (their provisioner stopped — a deploy — or vanished and its lease expired) are
/// adopted and their provisioning resumed (every step is safe to repeat: objects are created
/// under deterministic names and adopted when already there); at start-up `finishing` ones
/// are also finished. Sessions another replica is provisioning are left alone. Returns how
/// many sessions it took on at start-up.
pub async fn recover(state: &AppState) -> Result<usize, ApiError> {
    let env = state.config().env.clone();
    let mut handled = adopt_abandoned(state).await?;
    let finishing = state
        .store()
        .sessions()
        .list_in_status(&env, SessionStatus::Finishing, None, 1000)
        .await?;
    // One look each (no wait): what is still terminating is followed in the background.
    for s in finishing {
        gone::complete_within(state, s, Duration::ZERO).await?;
        handled += 1;
    }
    Ok(handled)
}

/// Resumes provisioning of every `starting` session nobody provisions; how many.
pub(crate) async fn adopt_abandoned(state: &AppState) -> Result<usize, ApiError> {
    if state.is_draining() {
        return Ok(0);
    }
    let env = state.config().env.clone();
    let ids = state.store().leases().unleased_starting(&env, 100).await?;
    let mut adopted = 0;
    for id in ids {
        let Some(s) = state.store().sessions().get(id).await? else {
            continue;
        };
        if s.status != SessionStatus::Starting {
            continue;
        }
        tracing::info!(session = %s.id, "adopting a session nobody is provisioning; resuming it");
        spawn_provisioning(state, s);
        adopted += 1;
    }
    Ok(adopted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_retry_pauses_are_jittered_within_half_and_all_of_the_pause() {
        let pause = Duration::from_secs(4);
        let draws: Vec<Duration> = (0..64).map(|_| jittered(pause)).collect();
        assert!(
            draws.iter().all(|d| *d >= pause / 2 && *d <= pause),
            "{draws:?}"
        );
        let distinct: std::collections::BTreeSet<_> = draws.iter().collect();
        assert!(distinct.len() > 1, "no jitter: {draws:?}");
    }
}
