//! The provisioning saga (steps ② to ⑧ of the write-up) and the end of a session.
//!
//! [`open_session`] runs inside the request: capacity under the database's capacity lock,
//! then the `starting` row (one live row per user is the database's rule). Everything after
//! the 202 runs in a task per session ([`spawn_provisioning`]) holding the session's
//! provisioning lease; its state is the row. Any failure deletes everything created for the
//! session and marks it `failed` with a reason a student can read. Every live server adopts
//! the `starting` sessions nobody holds the lease of and resumes them ([`recover`]); a server
//! told to stop hands its sessions over ([`hand_over`]).
//!
//! Where to read: a VM lesson's walk is `vm::provision`, its steps in order, each a function
//! of `vm.rs` below it; a pod lesson's is `pod::provision`. The steps both share (the lesson,
//! stages, marking running) are in `steps`, the retries (a database that went away, a create
//! refused for now) in `retry`, and every failure's wording for the student in `failure`.

mod agent;
pub(crate) mod disk;
mod failure;
mod gone;
mod open;
mod pod;
mod quota;
mod retry;
mod steps;
mod tokens;
mod vm;

use std::time::Duration;

use ttlab_cluster::{LabelSweep, SessionTarget, teardown_session};
use ttlab_model::{FinalStatus, NodeName, Runtime, SessionStatus};
use ttlab_store::{Session, StoreError};

use crate::{ApiError, AppState};

pub use agent::{AGENT_HEARTBEAT, ensure_agent_config_map, record_agent_seen};
use failure::Failure;
use gone::{complete, complete_within};
pub(crate) use open::ListedVm;
pub(crate) use open::grant_waitlist;
pub use open::open_session;
pub(crate) use open::{count_vms, listed_vms, no_site_carries, site_states, wanted_of};
pub(crate) use pod::LAB_CONTAINER;
pub(crate) use retry::{create_object, with_db};
pub(crate) use tokens::fresh as fresh_token;
pub(crate) use tokens::stored as agent_token;

/// Why provisioning stopped.
#[derive(Debug)]
pub(crate) enum Stop {
    /// It failed; the reason is for the student.
    Failed(String),
    /// The row left `starting` under us (finished by the student, failed by the reaper):
    /// whoever moved it ends it; we only remove what we created.
    Superseded,
    /// The namespace's quota refused a create at capacity: not a failure. The session ends
    /// `requeued` (the reason is for the student) and its student goes back in the line, at
    /// the front.
    Requeued(String),
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Failure::Database(e).into()
    }
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
        Err(Stop::Requeued(_)) => crate::metrics::ProvisioningOutcome::Requeued,
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
                        state.site_of(&session.site).cluster().as_ref(),
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
        Err(Stop::Requeued(reason)) => requeue(state, session, &reason).await,
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

/// Ends a start the namespace's quota refused at capacity, or a claimed member whose
/// hand-over failed, as `requeued` (its objects
/// deleted, like a failure's) and puts its student back in the line at the front, where the
/// page shows their position. The entry is made while the row is `finishing` (its places
/// still counted), so no grant can give the place it frees to somebody behind the student.
/// Someone else ending the session first (the student finished it) leaves them out of the
/// line.
async fn requeue(state: &AppState, session: &Session, reason: &str) {
    tracing::info!(%reason, "the student goes back in the line");
    let from = [SessionStatus::Starting];
    let row =
        match begin_finishing(state, session, &from, FinalStatus::Requeued, Some(reason)).await {
            Ok(Some(row)) => row,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "could not end the requeued session; the reaper will");
                return;
            }
        };
    // The row's student: a pool member's is the one who claimed it while it was prepared.
    if let Some(user) = row.user.as_ref().or(session.user.as_ref()) {
        let needed = u32::try_from(nodes_of(state, session).len()).unwrap_or(u32::MAX);
        let joined = with_db(|| async {
            state
                .store()
                .waitlist()
                .requeue(user, &session.lesson, &state.config().env, needed)
                .await
        })
        .await;
        match joined {
            Ok(entry) => {
                state.metrics().waitlist_joined.inc();
                tracing::info!(%user, position = entry.position, "back in the line");
            }
            Err(e) => {
                tracing::warn!(%user, error = %e, "could not put the student back in the line")
            }
        }
    }
    if let Err(e) = complete(state, row).await {
        tracing::warn!(error = %e, "could not end the requeued session; the reaper will");
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

/// A claimed pool member whose hand-over failed: released from its student (so the same
/// click can give them the next member or a cold start) and failed with `reason`, in one
/// statement, then its objects deleted (one look; what is still terminating is followed in
/// the background, and left to the reaper after that). `false` if it was no longer the
/// student's running member (someone else is ending it): the student still holds it.
pub(crate) async fn release_failed_claim(
    state: &AppState,
    session: &Session,
    reason: &str,
) -> Result<bool, ApiError> {
    let Some(user) = session.user.as_ref() else {
        return Ok(false);
    };
    let released = with_db(|| async {
        state
            .store()
            .sessions()
            .release_failed_claim(session.id, user, reason)
            .await
    })
    .await?;
    let Some(row) = released else {
        return Ok(false);
    };
    if let Err(e) = complete_within(state, row, Duration::ZERO).await {
        tracing::warn!(session = %session.id, error = %e, "cannot delete the objects of a member whose hand-over failed now; the reaper will");
    }
    Ok(true)
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
