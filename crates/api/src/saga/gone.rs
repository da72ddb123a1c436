//! The end of a session: "deleted" means gone. A `finishing` session's objects are deleted,
//! then looked for again (for at most [`GONE_WITHIN`]: a guest that stops quickly is
//! confirmed gone in the same request); the row goes final, with `objects_gone_at`, only once
//! every object is confirmed absent. An object still there (a guest within its shutdown
//! grace, a finalizer, a VM on a dead node) keeps the row `finishing` — live, so its VMs count
//! against the VM limit and its student's one session — recorded on the row for the admin page
//! and in `ttlab_objects_terminating`; this server keeps looking for it for
//! [`FOLLOW_UP_FOR`] and finalises the row when it is gone, and the reaper retries every
//! `finishing` row (deleting again) on each of its cycles, whichever comes first.

use std::time::Duration;

use ttlab_background::Backoff;
use ttlab_cluster::{Kind, LabelSweep, Outcome, TeardownReport, teardown_session_within};
use ttlab_model::{SessionId, SessionStatus, SiteName};
use ttlab_store::Session;

use super::{nodes_of, target, with_db};
use crate::sites::SiteRuntime;
use crate::{ApiError, AppState};

/// How long ending a session waits for objects whose deletion was accepted to be gone
/// before it answers with the row still `finishing` (a request waits this long at most).
pub(crate) const GONE_WITHIN: Duration = Duration::from_secs(3);

/// How long this server keeps looking for a session's objects still terminating after
/// [`GONE_WITHIN`] before it leaves the session to the reaper.
const FOLLOW_UP_FOR: Duration = Duration::from_secs(5 * 60);
/// Pauses between those looks: 500 ms, doubling up to 10 s.
const FOLLOW_UP: Backoff =
    Backoff::doubling(Duration::from_millis(500), Duration::from_secs(10)).without_jitter();

/// What one attempt at completing a session did.
enum Attempt {
    /// The row is final (by this attempt or someone else's), or no longer `finishing`.
    Done(Box<Session>),
    /// Some object is still there (or its deletion failed): the row stays `finishing`.
    Left(Left),
}

/// What a teardown left: the objects not confirmed gone, and whether a deletion (or a look)
/// failed, so that the next attempt deletes again rather than only looking.
struct Left {
    objects: Vec<(Kind, String)>,
    failed: bool,
}

/// Deletes everything of a `finishing` session, waits up to [`GONE_WITHIN`] for it to be
/// gone, and marks the row final if it is. Otherwise returns the row still `finishing` and
/// keeps following it in the background (see the module docs).
pub(crate) async fn complete(state: &AppState, row: Session) -> Result<Session, ApiError> {
    complete_within(state, row, GONE_WITHIN).await
}

/// [`complete`] waiting at most `gone_within` (zero: one look after the deletions).
pub(crate) async fn complete_within(
    state: &AppState,
    row: Session,
    gone_within: Duration,
) -> Result<Session, ApiError> {
    match attempt(state, &row, gone_within).await? {
        Attempt::Done(done) => Ok(*done),
        Attempt::Left(left) => {
            follow_up(state, row.id, &row.site, left);
            Ok(
                with_db(|| async { state.store().sessions().get(row.id).await })
                    .await?
                    .unwrap_or(row),
            )
        }
    }
}

/// One teardown of `row` and, if everything is gone, its completion.
async fn attempt(
    state: &AppState,
    row: &Session,
    gone_within: Duration,
) -> Result<Attempt, ApiError> {
    let nodes = nodes_of(state, row);
    let report = teardown_session_within(
        state.site_of(&row.site).cluster().as_ref(),
        &target(state, row, &nodes),
        LabelSweep::Always,
        gone_within,
        &[],
        None,
    )
    .await;
    if report.all_gone() {
        return Ok(Attempt::Done(Box::new(finalise(state, row).await?)));
    }
    let left = Left {
        objects: still_there(&report),
        failed: !report.all_deleted(),
    };
    for (o, e) in report.failures() {
        tracing::warn!(session = %row.id, kind = %o.kind, name = %o.name, error = %e, "deletion failed; the session stays finishing");
    }
    let terminating: Vec<String> = report
        .terminating()
        .map(|o| format!("{}/{}", o.kind, o.name))
        .collect();
    if !terminating.is_empty() {
        tracing::info!(session = %row.id, objects = %terminating.join(", "), "deletions accepted, objects still terminating; the session stays finishing");
    }
    record(state, row.id, &report, &terminating).await;
    Ok(Attempt::Left(left))
}

/// Records what is still terminating on the row and in the metrics. Nothing terminating (a
/// deletion failed instead) clears what an earlier look recorded, and records nothing new.
async fn record(state: &AppState, id: SessionId, report: &TeardownReport, objects: &[String]) {
    state.metrics().set_terminating(
        id,
        report.terminating().map(|o| o.kind.to_string()).collect(),
    );
    let sessions = state.store().sessions();
    let result = with_db(|| async {
        if objects.is_empty() && sessions.terminating_of(id).await?.is_none() {
            return Ok(false);
        }
        sessions.record_terminating(id, objects).await
    })
    .await;
    if let Err(e) = result {
        tracing::warn!(session = %id, error = %e, "cannot record the objects still terminating");
    }
}

/// The objects of `report` still terminating.
fn still_there(report: &TeardownReport) -> Vec<(Kind, String)> {
    report
        .objects
        .iter()
        .filter(|o| matches!(o.outcome, Outcome::Terminating))
        .map(|o| (o.kind, o.name.clone()))
        .collect()
}

/// finishing → final, every object confirmed gone (`objects_gone_at` recorded).
async fn finalise(state: &AppState, row: &Session) -> Result<Session, ApiError> {
    state.metrics().set_terminating(row.id, Vec::new());
    let done =
        with_db(|| async { state.store().sessions().complete_objects_gone(row.id).await }).await?;
    match done {
        Some(done) => {
            state
                .metrics()
                .ended
                .get_or_create(&crate::metrics::StatusLabels {
                    status: done.status.as_str().to_owned(),
                })
                .inc();
            Ok(done)
        }
        // Someone else completed it meanwhile (the reaper, another replica).
        None => Ok(
            with_db(|| async { state.store().sessions().get(row.id).await })
                .await?
                .unwrap_or_else(|| row.clone()),
        ),
    }
}

/// Keeps looking for what `left` names (objects of session `id` still terminating) with a
/// growing pause; once none is found (or at once, when a deletion failed), tears the session
/// down once more (deleting again, catching anything else labelled with it) and marks it
/// final if everything is gone. Stops when the row leaves `finishing` (the reaper completed
/// it) or after [`FOLLOW_UP_FOR`], leaving it to the reaper.
fn follow_up(state: &AppState, id: SessionId, site: &SiteName, mut left: Left) {
    let st = state.clone();
    let site = state.site_of(site);
    state.spawn(async move {
        let start = tokio::time::Instant::now();
        let mut pauses = FOLLOW_UP.pauses();
        loop {
            let pause = pauses.next_pause();
            if start.elapsed() + pause > FOLLOW_UP_FOR {
                tracing::warn!(session = %id, objects = left.objects.len(), "objects still terminating after {} s; left to the reaper", start.elapsed().as_secs());
                st.metrics().set_terminating(id, Vec::new());
                return;
            }
            tokio::time::sleep(pause).await;
            if !left.failed && !all_absent(&site, &left.objects).await {
                continue;
            }
            let row = match with_db(|| async { st.store().sessions().get(id).await }).await {
                Ok(Some(row)) if row.status == SessionStatus::Finishing => row,
                Ok(_) => {
                    st.metrics().set_terminating(id, Vec::new());
                    return;
                }
                Err(e) => {
                    tracing::warn!(session = %id, error = %e, "cannot read the finishing session; looking again later");
                    continue;
                }
            };
            match attempt(&st, &row, Duration::ZERO).await {
                Ok(Attempt::Done(done)) => {
                    tracing::info!(session = %id, status = %done.status, "every object confirmed gone; the session is final");
                    return;
                }
                Ok(Attempt::Left(still)) => left = still,
                Err(e) => {
                    tracing::warn!(session = %id, error = %e, "cannot complete the session; looking again later");
                }
            }
        }
    });
}

/// Whether none of `objects` is found any more (a failed look counts as found).
async fn all_absent(site: &SiteRuntime, objects: &[(Kind, String)]) -> bool {
    for (kind, name) in objects {
        match site.cluster().find(*kind, name).await {
            Ok(None) => {}
            Ok(Some(_)) => return false,
            Err(e) => {
                tracing::debug!(kind = %kind, name, error = %e, "cannot look for an object being deleted");
                return false;
            }
        }
    }
    true
}
