//! The student's terminal: `POST /api/sessions/{id}/console-ticket` and the WebSocket
//! `GET /api/sessions/{id}/console?ticket=T[&node=NAME]`, relayed by `ttlab-console` to the
//! VMI's serial console (VM labs) or a shell in the pod (pod labs).
//!
//! - A browser cannot send its bearer token on a WebSocket, so it first trades it for a ticket:
//!   random, single use, good for 30 s, bound to the user and the session.
//! - Before upgrading, the WebSocket request is checked: a valid ticket for this session
//!   (else 403 `invalid_ticket`), the ticket's user still owns the session (else 403
//!   `not_your_session`), the session is running (else 409 `not_running`), the node exists
//!   (else 400 `unknown_node`). Every refusal has the JSON error body.
//! - A VM has one console: opening a second one (another tab) closes the first with "opened in
//!   another tab" before the new one connects.
//! - Each console closes at the session's expiry (the instant the countdown shows, from the
//!   database clock), follows extensions, and closes when the session is finished, expires or
//!   fails. One task per server follows session changes (the notification hub, plus a re-read
//!   every 10 s) for all open consoles with one query.
//!
//! Tickets and the one-console-per-VM rule are kept in this process: with several server
//! replicas, route a session's requests to one replica (sticky by session id).

mod tickets;
mod upstream;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{self, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use chrono::{DateTime, Utc};
use futures::{SinkExt as _, StreamExt as _, future};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use tokio::time::Instant;
use ttlab_console::{CloseReason, Controller, Frame, RelayConfig, relay};
use ttlab_model::{FinalStatus, Runtime, SessionId, SessionStatus};
use ttlab_store::Session;

use crate::auth::CurrentUser;
use crate::extract::SessionPath;
use crate::{ApiError, AppState, ErrorBody};

pub use tickets::TICKET_TTL;
use tickets::{TicketRefusal, Tickets};
use upstream::{PodShell, VmConsole};

/// Largest message accepted from the browser (keystrokes and pastes).
const MAX_BROWSER_MESSAGE: usize = 64 * 1024;
/// Re-read the sessions of open consoles at least this often.
const FALLBACK: Duration = Duration::from_secs(10);
/// Changes arriving together are applied once.
const DEBOUNCE: Duration = Duration::from_millis(100);

/// The console routes, with this router's registry of tickets and open consoles.
pub fn routes() -> Router<AppState> {
    let consoles = Arc::new(Consoles::default());
    Router::new()
        .route("/api/sessions/{id}/console-ticket", post(ticket))
        .route("/api/sessions/{id}/console", get(console))
        .layer(Extension(consoles))
}

// ---------------------------------------------------------------------------------------------
// The registry

type Key = (SessionId, String);

/// Tickets and open consoles of one server.
#[derive(Default)]
struct Consoles {
    tickets: Mutex<Tickets>,
    open: Mutex<HashMap<Key, Open>>,
    next_id: AtomicU64,
    watching: AtomicBool,
}

struct Open {
    id: u64,
    controller: Controller,
}

/// Unregisters an open console when its relay ends.
struct Registration {
    consoles: Arc<Consoles>,
    key: Key,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut open = lock(&self.consoles.open);
        if open.get(&self.key).is_some_and(|o| o.id == self.id) {
            open.remove(&self.key);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Consoles {
    /// Registers a console of `key`, closing the one already open (another tab).
    fn open(
        self: &Arc<Self>,
        key: Key,
        deadline: Instant,
    ) -> (ttlab_console::Controls, Registration) {
        let (controller, controls) = ttlab_console::controls(Some(deadline));
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let previous = lock(&self.open).insert(key.clone(), Open { id, controller });
        if let Some(previous) = previous {
            previous.controller.close(CloseReason::Replaced);
        }
        let registration = Registration {
            consoles: Arc::clone(self),
            key,
            id,
        };
        (controls, registration)
    }

    fn sessions(&self) -> BTreeSet<SessionId> {
        lock(&self.open).keys().map(|(s, _)| *s).collect()
    }

    /// Applies `f` to the controllers of every open console of `session`.
    fn each(&self, session: SessionId, f: impl Fn(&Controller)) {
        for ((s, _), open) in lock(&self.open).iter() {
            if *s == session {
                f(&open.controller);
            }
        }
    }

    fn close_all(&self, reason: &CloseReason) {
        for open in lock(&self.open).values() {
            open.controller.close(reason.clone());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors with the API's body, for the refusals that have no `ApiError` of their own

fn refuse(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let body = ErrorBody {
        error: code.to_owned(),
        message: message.into(),
    };
    (status, Json(body)).into_response()
}

/// A session past its expiry has no console, even while the reaper has not reclaimed it yet.
fn expired() -> ApiError {
    ApiError::WrongState {
        code: "expired",
        message: "the session has expired; its VM is being reclaimed".to_owned(),
    }
}

fn not_running(s: &Session) -> ApiError {
    ApiError::WrongState {
        code: "not_running",
        message: format!(
            "the session is {}; its console opens once it is running",
            s.status
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// POST /api/sessions/{id}/console-ticket

/// The answer to a ticket request.
#[derive(Debug, Serialize)]
struct TicketView {
    /// The ticket.
    ticket: String,
    /// Where to open the WebSocket (add `&node=NAME` for a multi-VM lab).
    url: String,
    /// Seconds the ticket stays valid.
    expires_in_seconds: u64,
}

async fn ticket(
    State(state): State<AppState>,
    Extension(consoles): Extension<Arc<Consoles>>,
    user: CurrentUser,
    SessionPath(id): SessionPath,
) -> Result<Json<TicketView>, ApiError> {
    let s = match state.store().sessions().get(id).await? {
        Some(s) if s.user == user.user => s,
        _ => return Err(ApiError::SessionNotFound),
    };
    if s.status != SessionStatus::Running {
        return Err(not_running(&s));
    }
    if s.expires_at <= state.store().db_now().await? {
        return Err(expired());
    }
    let ticket = lock(&consoles.tickets).issue(user.user, id, std::time::Instant::now());
    Ok(Json(TicketView {
        url: format!("/api/sessions/{id}/console?ticket={ticket}"),
        ticket,
        expires_in_seconds: TICKET_TTL.as_secs(),
    }))
}

// ---------------------------------------------------------------------------------------------
// GET /api/sessions/{id}/console

/// The WebSocket request's query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsoleQuery {
    ticket: Option<String>,
    node: Option<String>,
}

async fn console(
    State(state): State<AppState>,
    Extension(consoles): Extension<Arc<Consoles>>,
    SessionPath(id): SessionPath,
    query: Result<Query<ConsoleQuery>, QueryRejection>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match prepare(&state, &consoles, id, query).await {
        Ok(target) => {
            let upgrade = match upgrade {
                Ok(upgrade) => upgrade,
                Err(rejection) => {
                    return refuse(
                        StatusCode::BAD_REQUEST,
                        "websocket_required",
                        format!("open the console as a WebSocket: {}", rejection.body_text()),
                    );
                }
            };
            start(state, consoles, target, upgrade)
        }
        Err(response) => response,
    }
}

/// What a checked console request opens.
struct Target {
    session: SessionId,
    runtime: Runtime,
    node: String,
    object: String,
    deadline: Instant,
}

async fn prepare(
    state: &AppState,
    consoles: &Consoles,
    id: SessionId,
    query: Result<Query<ConsoleQuery>, QueryRejection>,
) -> Result<Target, Response> {
    let Query(query) =
        query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()).into_response())?;
    let Some(value) = query.ticket else {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "invalid_ticket",
            "the console needs a ticket: POST /api/sessions/{id}/console-ticket, then open the \
             WebSocket at the url it returns",
        ));
    };
    let taken = lock(&consoles.tickets).take(&value, id, std::time::Instant::now());
    let ticket = match taken {
        Ok(ticket) => ticket,
        Err(TicketRefusal::Unknown) => {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                "invalid_ticket",
                "this console ticket is unknown, already used or expired; get a new one",
            ));
        }
        Err(TicketRefusal::OtherSession) => {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                "invalid_ticket",
                "this console ticket was issued for another session",
            ));
        }
    };
    let session = state
        .store()
        .sessions()
        .get(id)
        .await
        .map_err(|e| ApiError::from(e).into_response())?
        .ok_or_else(|| ApiError::SessionNotFound.into_response())?;
    if session.user != ticket.user {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "not_your_session",
            "this session belongs to someone else",
        ));
    }
    if session.status != SessionStatus::Running {
        return Err(not_running(&session).into_response());
    }
    let now = state
        .store()
        .db_now()
        .await
        .map_err(|e| ApiError::from(e).into_response())?;
    if session.expires_at <= now {
        return Err(expired().into_response());
    }
    let vm = match &query.node {
        Some(node) => session.vms.iter().find(|v| v.node.as_str() == node),
        None => session.vms.first(),
    };
    let Some(vm) = vm else {
        if query.node.is_none() {
            return Err(not_running(&session).into_response());
        }
        let nodes: Vec<&str> = session.vms.iter().map(|v| v.node.as_str()).collect();
        return Err(ApiError::bad_request(
            "unknown_node",
            format!(
                "this lab has no node {:?}; its nodes are: {}",
                query.node.unwrap_or_default(),
                nodes.join(", ")
            ),
        )
        .into_response());
    };
    Ok(Target {
        session: id,
        runtime: session.runtime,
        node: vm.node.to_string(),
        object: vm.name.clone(),
        deadline: instant_of(session.expires_at, now),
    })
}

/// The local instant of a database-clock instant, `now` being the database clock now.
fn instant_of(at: DateTime<Utc>, now: DateTime<Utc>) -> Instant {
    let ahead = (at - now).to_std().unwrap_or(Duration::ZERO);
    Instant::now() + ahead
}

fn start(
    state: AppState,
    consoles: Arc<Consoles>,
    target: Target,
    upgrade: WebSocketUpgrade,
) -> Response {
    watch_sessions(&state, &consoles);
    let (controls, registration) =
        consoles.open((target.session, target.node.clone()), target.deadline);
    let config = RelayConfig {
        connected_message: Some(match target.runtime {
            Runtime::Vm => format!(
                "Connected to the console of {}. Press Enter if no prompt is shown.",
                target.node
            ),
            Runtime::Pod => format!("Connected to {}.", target.node),
        }),
        ..RelayConfig::default()
    };
    let cluster = Arc::clone(state.cluster());
    upgrade
        .read_buffer_size(8 * 1024)
        .write_buffer_size(0)
        .max_message_size(MAX_BROWSER_MESSAGE)
        .max_frame_size(MAX_BROWSER_MESSAGE)
        .on_upgrade(move |socket| async move {
            let (to_browser, from_browser) = browser_frames(socket);
            let end = match target.runtime {
                Runtime::Vm => {
                    let vm = VmConsole {
                        state,
                        session: target.session,
                        cluster,
                        vm: target.object.clone(),
                    };
                    relay(to_browser, from_browser, vm, controls, config).await
                }
                Runtime::Pod => {
                    let pod = PodShell {
                        state,
                        session: target.session,
                        cluster,
                        pod: target.object.clone(),
                    };
                    relay(to_browser, from_browser, pod, controls, config).await
                }
            };
            drop(registration);
            tracing::info!(
                session = %target.session,
                node = %target.node,
                reason = %end.reason,
                to_browser = end.bytes_to_browser,
                to_console = end.bytes_to_console,
                "console closed"
            );
        })
}

/// The browser's WebSocket as relay frames.
fn browser_frames(
    socket: WebSocket,
) -> (
    impl futures::Sink<Frame, Error = axum::Error> + Unpin + Send,
    impl futures::Stream<Item = Result<Frame, axum::Error>> + Unpin + Send,
) {
    let (sink, stream) = socket.split();
    let sink = sink.with(|frame: Frame| future::ready(Ok::<_, axum::Error>(message_of(frame))));
    let stream = stream.map(|m| m.map(frame_of));
    (sink, stream)
}

fn message_of(frame: Frame) -> Message {
    match frame {
        Frame::Binary(b) => Message::Binary(b),
        Frame::Text(t) => Message::Text(t.into()),
        Frame::Ping(b) => Message::Ping(b),
        Frame::Pong(b) => Message::Pong(b),
        Frame::Close(c) => Message::Close(c.map(|c| ws::CloseFrame {
            code: c.code,
            reason: c.reason.into(),
        })),
    }
}

fn frame_of(message: Message) -> Frame {
    match message {
        Message::Binary(b) => Frame::Binary(b),
        Message::Text(t) => Frame::Text(t.as_str().to_owned()),
        Message::Ping(b) => Frame::Ping(b),
        Message::Pong(b) => Frame::Pong(b),
        Message::Close(c) => Frame::Close(c.map(|c| ttlab_console::CloseFrame {
            code: c.code,
            reason: c.reason.as_str().to_owned(),
        })),
    }
}

// ---------------------------------------------------------------------------------------------
// Following the sessions of open consoles

/// Starts (once per registry) the task that applies session changes to open consoles.
fn watch_sessions(state: &AppState, consoles: &Arc<Consoles>) {
    if consoles.watching.swap(true, Ordering::SeqCst) {
        return;
    }
    let weak = Arc::downgrade(consoles);
    let mut hints = state.subscribe();
    let task_state = state.clone();
    state.spawn(async move {
        // Stopped with the server: every console is told so.
        let _guard = CloseAllOnDrop(weak.clone());
        loop {
            let hint = tokio::time::timeout(FALLBACK, hints.recv()).await;
            if let Ok(Err(broadcast::error::RecvError::Closed)) = hint {
                return;
            }
            tokio::time::sleep(DEBOUNCE).await;
            while !matches!(
                hints.try_recv(),
                Err(broadcast::error::TryRecvError::Empty | broadcast::error::TryRecvError::Closed)
            ) {}
            let Some(consoles) = weak.upgrade() else {
                return;
            };
            if let Err(e) = apply_changes(&task_state, &consoles).await {
                tracing::debug!(error = %e, "console sessions not re-read; trying again");
            }
        }
    });
}

struct CloseAllOnDrop(Weak<Consoles>);

impl Drop for CloseAllOnDrop {
    fn drop(&mut self) {
        if let Some(consoles) = self.0.upgrade() {
            consoles.close_all(&CloseReason::ServerShutdown);
        }
    }
}

/// Re-reads the sessions of open consoles (one query for all live ones) and applies them.
async fn apply_changes(state: &AppState, consoles: &Consoles) -> Result<(), ApiError> {
    let watched = consoles.sessions();
    if watched.is_empty() {
        return Ok(());
    }
    let now = state.store().db_now().await?;
    let live: BTreeMap<SessionId, Session> = state
        .store()
        .sessions()
        .list_live(&state.config().env, None, 5000)
        .await?
        .into_iter()
        .filter(|s| watched.contains(&s.id))
        .map(|s| (s.id, s))
        .collect();
    for id in watched {
        let row = match live.get(&id) {
            Some(row) => Some(row.clone()),
            None => state.store().sessions().get(id).await?,
        };
        match row {
            Some(row) => apply(consoles, &row, now),
            None => consoles.each(id, |c| c.close(CloseReason::Finished)),
        }
    }
    Ok(())
}

/// What a session's row means for its open consoles.
fn apply(consoles: &Consoles, row: &Session, now: DateTime<Utc>) {
    match reason_of(row) {
        Some(reason) => consoles.each(row.id, |c| c.close(reason.clone())),
        None if row.status == SessionStatus::Running => {
            let deadline = instant_of(row.expires_at, now);
            consoles.each(row.id, |c| c.set_deadline(Some(deadline)));
        }
        None => {}
    }
}

/// Why a console of this session must close, if it must (`None`: starting or running).
fn reason_of(row: &Session) -> Option<CloseReason> {
    Some(match row.status {
        SessionStatus::Starting | SessionStatus::Running => return None,
        SessionStatus::Finishing => match row.finishing_to {
            Some(FinalStatus::Expired) => CloseReason::Expired,
            Some(FinalStatus::Failed) => CloseReason::VmStopped,
            Some(FinalStatus::Finished) | None => CloseReason::Finished,
        },
        SessionStatus::Finished => CloseReason::Finished,
        SessionStatus::Expired => CloseReason::Expired,
        SessionStatus::Failed | SessionStatus::Ghost => CloseReason::VmStopped,
    })
}
