//! `GET /api/sessions/{id}/events`: server-sent events, one `session` event with the full
//! view now and on every change (stage, status, expiry), until the session is final.
//!
//! `GET /api/waitlist/events`: the same for the student's place on the waitlist (`waitlist`
//! events), until they leave it or take their place.
//!
//! Changes arrive as Postgres notifications (so a change made by another replica or the
//! reaper shows up too), with a re-read every few seconds as the fallback for a missed one.

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::get;
use futures::Stream;
use tokio::sync::broadcast;

use super::sessions::visible;
use crate::auth::CurrentUser;
use crate::extract::SessionPath;
use crate::state::HubEvent;
use crate::view::SessionView;
use crate::{ApiError, AppState};

/// Re-read at least this often, in case a notification was missed.
const FALLBACK: Duration = Duration::from_secs(5);

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/sessions/{id}/events", get(events))
        .route("/api/waitlist/events", get(waitlist_events))
}

/// How often the waitlist stream re-reads without a hint (the hold's countdown and a
/// position that moved on another environment's change need no notification).
const WAITLIST_FALLBACK: Duration = Duration::from_secs(2);

/// `GET /api/waitlist/events`: one `waitlist` event with the student's place now and on
/// every change (position, a held place, leaving), until they are no longer waiting.
async fn waitlist_events(
    State(state): State<AppState>,
    user: CurrentUser,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let rx = state.subscribe();
    let first = super::sessions::waitlist_view(&state, &user.user).await?;
    let init = (state, user, rx, Some(first), None::<String>, false);
    let stream = futures::stream::unfold(
        init,
        |(state, user, mut rx, mut pending, mut last, done)| async move {
            if done {
                return None;
            }
            loop {
                let view = match pending.take() {
                    Some(v) => v,
                    None => {
                        if let Ok(Err(broadcast::error::RecvError::Closed)) =
                            tokio::time::timeout(WAITLIST_FALLBACK, rx.recv()).await
                        {
                            return None;
                        }
                        match super::sessions::waitlist_view(&state, &user.user).await {
                            Ok(v) => v,
                            Err(_) => continue,
                        }
                    }
                };
                let json = serde_json::to_string(&view).unwrap_or_default();
                // The countdown moves every second; send when anything but it changed.
                let key = serde_json::to_value(&view)
                    .map(|mut v| {
                        if let Some(o) = v.as_object_mut() {
                            o.remove("hold_seconds_left");
                        }
                        v.to_string()
                    })
                    .unwrap_or_default();
                if last.as_ref() == Some(&key) {
                    continue;
                }
                last = Some(key);
                let finished = !view.is_waiting();
                let event = Event::default().event("waitlist").data(json);
                return Some((Ok(event), (state, user, rx, None, last, finished)));
            }
        },
    );
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

struct Watch {
    state: AppState,
    id: ttlab_model::SessionId,
    rx: broadcast::Receiver<HubEvent>,
    viewer: CurrentUser,
    last: Option<(String, &'static str, chrono::DateTime<chrono::Utc>)>,
    done: bool,
}

async fn events(
    State(state): State<AppState>,
    user: CurrentUser,
    SessionPath(id): SessionPath,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    // Subscribe before the first read, so no change between the two is missed.
    let rx = state.subscribe();
    visible(&state, &user, id).await?;
    let watch = Watch {
        state,
        id,
        rx,
        viewer: user,
        last: None,
        done: false,
    };
    let stream = futures::stream::unfold(watch, |mut w| async move {
        if w.done {
            return None;
        }
        loop {
            if w.last.is_some() {
                // A hint, a lagged receiver or the fallback timer: re-read either way.
                if let Ok(Err(broadcast::error::RecvError::Closed)) =
                    tokio::time::timeout(FALLBACK, w.rx.recv()).await
                {
                    return None;
                }
            }
            let row = match w.state.store().sessions().get(w.id).await {
                Ok(Some(row)) => row,
                Ok(None) => return None,
                // The database is away: keep the stream open and try again later.
                Err(_) => {
                    if w.last.is_none() {
                        w.last =
                            Some((String::new(), "", chrono::DateTime::<chrono::Utc>::MIN_UTC));
                    }
                    continue;
                }
            };
            let key = (
                row.status.as_str().to_owned(),
                crate::view::stage_of(&row),
                row.updated_at,
            );
            if w.last.as_ref() == Some(&key) {
                continue;
            }
            w.last = Some(key);
            w.done = row.status.is_final();
            let now = w
                .state
                .store()
                .db_now()
                .await
                .unwrap_or_else(|_| chrono::Utc::now());
            let expected = super::sessions::expected(&w.state, &row).await;
            let view = SessionView::new(&row, &w.state.config().policy, now)
                .with_expected(expected)
                .with_site(w.state.usable_site(&row.site).is_ok())
                .for_viewer(&w.viewer);
            let event = Event::default()
                .event("session")
                .json_data(&view)
                .unwrap_or_else(|_| Event::default().event("session"));
            return Some((Ok(event), w));
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
