//! The steps a VM lesson's and a pod lesson's provisioning share: finding the lesson,
//! checking the session is still `starting`, recording the stages the student page shows,
//! timing them, and marking the session running.

use ttlab_lesson::Lesson;
use ttlab_store::{Session, Stage, StoreError};

use super::{Failure, Stop, with_db};
use crate::AppState;

/// The session's lesson, if it is still offered.
pub(crate) fn offered_lesson(state: &AppState, session: &Session) -> Result<Lesson, Stop> {
    state
        .config()
        .lessons
        .get(&session.lesson)
        .cloned()
        .ok_or_else(|| Failure::LessonGone(session.lesson.clone()).into())
}

/// Stops if the row left `starting` (finished by the student, failed by the reaper).
pub(crate) async fn ensure_starting(state: &AppState, session: &Session) -> Result<(), Stop> {
    let row = with_db(|| async { state.store().sessions().get(session.id).await }).await?;
    match row {
        Some(r) if r.status == ttlab_model::SessionStatus::Starting => Ok(()),
        _ => Err(Stop::Superseded),
    }
}

/// Records that provisioning of `session` reached `stage` (retrying while the database is
/// away).
pub(crate) async fn record_stage(
    state: &AppState,
    session: &Session,
    stage: Stage,
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

/// Records the time from the request to `stage` in the metrics (database clock).
pub(crate) async fn observe_stage(state: &AppState, session: &Session, stage: &str) {
    if let Ok(now) = state.store().db_now().await {
        let secs = (now - session.created_at).num_milliseconds() as f64 / 1000.0;
        state.metrics().observe_stage(stage, secs);
    }
}

/// `starting` → `running`; [`Stop::Superseded`] if the row had left `starting`.
pub(crate) async fn mark_running(state: &AppState, session: &Session) -> Result<(), Stop> {
    let marked = with_db(|| async {
        state
            .store()
            .sessions()
            .mark_running(session.id, None)
            .await
    })
    .await?;
    match marked {
        Some(_) => Ok(()),
        None => Err(Stop::Superseded),
    }
}
