//! The student's terminal: `POST /api/sessions/{id}/console-ticket` and the WebSocket
//! `GET /api/sessions/{id}/console?ticket=T[&node=NAME]`, relayed by `ttlab-console` to the
//! VMI's serial console (VM labs) or a shell in the pod (pod labs).
//!
//! - A browser cannot send its bearer token on a WebSocket, so it first trades it for a ticket:
//!   random, single use, good for 30 s, bound to the user and the session (and the node, when
//!   the ticket request names one with `?node=`). Tickets are kept in PostgreSQL (as digests),
//!   so any server replica accepts a ticket another one issued.
//! - A request that is not a WebSocket upgrade is refused (400 `websocket_required`) before
//!   its ticket is looked at: only a real upgrade spends a ticket.
//! - Before upgrading, the WebSocket request is checked: a valid ticket for this session
//!   (else 403 `invalid_ticket`), the ticket's user still owns the session (else 403
//!   `not_your_session`), the session is running (else 409 `not_running`), the node exists
//!   (else 400 `unknown_node`). Every refusal has the JSON error body.
//! - A VM has one console: opening a second one (another tab) closes the first with "opened in
//!   another tab" before the new one connects — on this replica at once, and on every other
//!   replica through the `ttlab_console_taken` notification, announced before the new console
//!   connects to KubeVirt (which drops the old connection).
//! - Each console closes at the session's expiry (the instant the countdown shows, from the
//!   database clock), follows extensions, and closes when the session is finished, expires or
//!   fails. One background task per server (`console_sessions`, [`crate::tasks`], started
//!   with the first console ticket) follows session changes (the notification hub, plus a
//!   re-read every 10 s) for all open consoles with one query; another
//!   (`console_takeovers`) listens for other replicas' takeovers.
//!
//! - The page's terminal size (a text control message, see `ttlab_console::BrowserControl`)
//!   is set on the VM's serial console through its agent, or on the pod shell's TTY through
//!   the exec's resize channel, on connecting and on every resize; a VM's console is then
//!   redrawn (Ctrl-L) so a (re)connected student sees the prompt at once.
//! - The page is told, in a text frame, when the console itself is open
//!   (`{"type":"connected"}`, `ttlab_console::ConsoleStatus`): a WebSocket to the server is
//!   not yet a connection to the VM, which may still be booting or unreachable.
//! - Warnings are written into the terminal 5 minutes and 1 minute before the expiry, and the
//!   page is told first (`{"type":"warned","leads":[300]}`). A page that reconnects names the
//!   warnings it was already shown for the current expiry (`&warned=300,60`, lead times in
//!   seconds): they are not written again (an extension re-arms them).
//! - Each console's owner is recorded in PostgreSQL (`console_connections`: the user, this
//!   replica's name, when it opened, when and why it closed) for the admin's session view. A
//!   failure to record is logged and never closes the console. The replica marks its open
//!   consoles' records seen every 10 s; the records of a replica that stopped doing so (it
//!   crashed or was killed) are closed by another one as `replica_gone`.
//!
//! Nothing here needs sticky sessions: a ticket issued by one replica opens the console on
//! another, and a console opened on one replica closes the one open on another.

mod tickets;
mod upstream;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
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
use tokio::sync::Notify;
use tokio::time::Instant;
use ttlab_console::{CloseReason, Controller, Frame, LabKind, RelayConfig, relay};
use ttlab_model::{FinalStatus, NodeName, Runtime, SessionId, SessionStatus, UserId};
use ttlab_store::{ConsoleClosedWhy, ConsoleTaken, Session};
use uuid::Uuid;

use crate::auth::CurrentUser;
use crate::extract::SessionPath;
use crate::{ApiError, AppState, ErrorBody};

pub use tickets::TICKET_TTL;
use tickets::TicketRefusal;
use upstream::{PodShell, VmConsole};

/// Largest message accepted from the browser (keystrokes and pastes).
const MAX_BROWSER_MESSAGE: usize = 64 * 1024;
/// How long a new console waits for this replica to be listening for other replicas'
/// takeovers before it connects anyway (the first console after a start, or while the
/// database is unreachable).
const LISTEN_WAIT: Duration = Duration::from_secs(2);

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

/// The open consoles of one server.
#[derive(Default)]
pub(crate) struct Consoles {
    open: Mutex<HashMap<Key, Open>>,
    watching: AtomicBool,
    /// This replica is listening for other replicas' takeovers.
    listening: AtomicBool,
    listening_changed: Notify,
}

struct Open {
    id: Uuid,
    controller: Controller,
    /// Its own takeover announcement came back through the listener. Announcements reach
    /// every replica in the same order, so one for another connection that arrives after this
    /// is newer (KubeVirt holds the other one now), and one that arrives before is older.
    announced: bool,
}

/// Unregisters an open console when its relay ends.
struct Registration {
    consoles: Arc<Consoles>,
    key: Key,
    id: Uuid,
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
        let id = Uuid::new_v4();
        let previous = lock(&self.open).insert(
            key.clone(),
            Open {
                id,
                controller,
                announced: false,
            },
        );
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

    /// The connection `by` (on any replica) announced that it took the console of `key`.
    /// This replica's connection to it is closed if it is older (its own announcement came
    /// first); if it is `by` itself, it is now known to be announced.
    fn taken(&self, key: &Key, by: Uuid) {
        let mut opens = lock(&self.open);
        let Some(open) = opens.get_mut(key) else {
            return;
        };
        if open.id == by {
            open.announced = true;
        } else if open.announced {
            open.controller.close(CloseReason::Replaced);
        }
    }

    /// A connection (on any replica) announced that it took a console (see [`Self::taken`]).
    pub(crate) fn taken_over(&self, taken: &ConsoleTaken) {
        self.taken(
            &(taken.session, taken.node.as_str().to_owned()),
            taken.connection,
        );
    }

    /// Whether this replica listens for takeovers now (the `console_takeovers` task).
    pub(crate) fn set_listening(&self, listening: bool) {
        self.listening.store(listening, Ordering::SeqCst);
        if listening {
            self.listening_changed.notify_waiters();
        }
    }

    /// Waits (at most `limit`) until this replica listens for takeovers.
    async fn until_listening(&self, limit: Duration) {
        let wait = async {
            loop {
                let changed = self.listening_changed.notified();
                if self.listening.load(Ordering::SeqCst) {
                    return;
                }
                changed.await;
            }
        };
        let _ = tokio::time::timeout(limit, wait).await;
    }

    /// The connection ids of the open consoles.
    fn connections(&self) -> Vec<Uuid> {
        lock(&self.open).values().map(|o| o.id).collect()
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
        message: "the session has expired; its lab is being reclaimed".to_owned(),
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

/// The ticket request's query: the node whose console the ticket opens (multi-VM labs).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TicketQuery {
    node: Option<String>,
}

async fn ticket(
    State(state): State<AppState>,
    Extension(consoles): Extension<Arc<Consoles>>,
    user: CurrentUser,
    SessionPath(id): SessionPath,
    query: Result<Query<TicketQuery>, QueryRejection>,
) -> Result<Json<TicketView>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    let s = match state.store().sessions().get(id).await? {
        Some(s) if s.user.as_ref() == Some(&user.user) => s,
        _ => return Err(ApiError::SessionNotFound),
    };
    if s.status != SessionStatus::Running {
        return Err(not_running(&s));
    }
    if s.expires_at <= state.store().db_now().await? {
        return Err(expired());
    }
    let node: Option<NodeName> = match &query.node {
        Some(name) => match s.vms.iter().find(|v| v.node.as_str() == name) {
            Some(vm) => Some(vm.node.clone()),
            None => return Err(unknown_node(&s, name)),
        },
        None => None,
    };
    // Listening for other replicas' takeovers is started before any console of this replica
    // can open (the WebSocket usually follows the ticket within milliseconds).
    watch_sessions(&state, &consoles);
    let ttl = state.config().console_ticket_ttl;
    let (ticket, _expires) =
        tickets::issue(state.store(), &user.user, id, node.as_ref(), ttl).await?;
    let url = match &node {
        Some(node) => format!("/api/sessions/{id}/console?ticket={ticket}&node={node}"),
        None => format!("/api/sessions/{id}/console?ticket={ticket}"),
    };
    Ok(Json(TicketView {
        url,
        ticket,
        expires_in_seconds: ttl.as_secs(),
    }))
}

fn unknown_node(s: &Session, name: &str) -> ApiError {
    let nodes: Vec<&str> = s.vms.iter().map(|v| v.node.as_str()).collect();
    ApiError::bad_request(
        "unknown_node",
        format!(
            "this lab has no node {name:?}; its nodes are: {}",
            nodes.join(", ")
        ),
    )
}

// ---------------------------------------------------------------------------------------------
// GET /api/sessions/{id}/console

/// The WebSocket request's query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsoleQuery {
    ticket: Option<String>,
    node: Option<String>,
    /// The warnings the page was already shown for the session's current expiry: lead times
    /// in seconds, comma-separated (`300,60`).
    warned: Option<String>,
}

/// The lead times of a `warned` query parameter (`300,60`); why not, for anything else.
fn warned_leads(text: &str) -> Result<Vec<Duration>, String> {
    text.split(',')
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .map(|s| Duration::from_secs(u64::from(s)))
                .map_err(|_| {
                    format!(
                        "warned must list lead times in whole seconds, comma-separated (like 300,60); got {text:?}"
                    )
                })
        })
        .collect()
}

async fn console(
    State(state): State<AppState>,
    Extension(consoles): Extension<Arc<Consoles>>,
    SessionPath(id): SessionPath,
    query: Result<Query<ConsoleQuery>, QueryRejection>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    // Only a real WebSocket upgrade may spend the ticket: a plain GET (a link preview, a
    // proxy's probe, a prefetch) is refused before the ticket is looked at, and the ticket
    // still opens the console afterwards.
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
    match prepare(&state, id, query).await {
        Ok(target) => start(state, consoles, target, upgrade),
        Err(response) => response,
    }
}

/// What a checked console request opens.
struct Target {
    session: SessionId,
    /// Who opens it (the ticket's user).
    user: UserId,
    runtime: Runtime,
    /// The session's site, whose cluster serves the console.
    site: std::sync::Arc<crate::sites::SiteRuntime>,
    node: String,
    object: String,
    deadline: Instant,
    /// The warnings the page was already shown for the current expiry.
    warned: Vec<Duration>,
}

async fn prepare(
    state: &AppState,
    id: SessionId,
    query: Result<Query<ConsoleQuery>, QueryRejection>,
) -> Result<Target, Response> {
    let Query(query) =
        query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()).into_response())?;
    let warned = warned_leads(query.warned.as_deref().unwrap_or_default())
        .map_err(|why| ApiError::bad_request("invalid_query", why).into_response())?;
    let Some(value) = query.ticket else {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "invalid_ticket",
            "the console needs a ticket: POST /api/sessions/{id}/console-ticket, then open the \
             WebSocket at the url it returns",
        ));
    };
    let taken = tickets::take(state.store(), &value, id, query.node.as_deref())
        .await
        .map_err(|e| ApiError::from(e).into_response())?;
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
        Err(TicketRefusal::OtherNode) => {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                "invalid_ticket",
                "this console ticket was issued for another node of the session",
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
    if session.user.as_ref() != Some(&ticket.user) {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "not_your_session",
            "this session belongs to someone else",
        ));
    }
    if session.status != SessionStatus::Running {
        return Err(not_running(&session).into_response());
    }
    // The session's cluster must answer: else 503 `site_unavailable`, saying so.
    let site = state
        .usable_site(&session.site)
        .map_err(IntoResponse::into_response)?;
    let now = state
        .store()
        .db_now()
        .await
        .map_err(|e| ApiError::from(e).into_response())?;
    if session.expires_at <= now {
        return Err(expired().into_response());
    }
    let wanted = ticket
        .node
        .as_ref()
        .map(|n| n.as_str().to_owned())
        .or(query.node);
    let vm = match &wanted {
        Some(node) => session.vms.iter().find(|v| v.node.as_str() == node),
        None => session.vms.first(),
    };
    let Some(vm) = vm else {
        return Err(match wanted {
            None => not_running(&session).into_response(),
            Some(name) => unknown_node(&session, &name).into_response(),
        });
    };
    Ok(Target {
        session: id,
        user: ticket.user,
        runtime: session.runtime,
        site,
        node: vm.node.to_string(),
        object: vm.name.clone(),
        deadline: instant_of(session.expires_at, now),
        warned,
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
    let taken = target.node.parse().ok().map(|node| ConsoleTaken {
        session: target.session,
        node,
        connection: registration.id,
    });
    let config = RelayConfig {
        connected_message: Some(match target.runtime {
            Runtime::Vm => format!(
                "Connected to the console of {}. Press Enter if no prompt is shown.",
                target.node
            ),
            Runtime::Pod => format!("Connected to {}.", target.node),
        }),
        // A serial console shows nothing new on connecting: Ctrl-L makes the shell (or the
        // full-screen program) redraw, without running anything. A pod's new shell prints its
        // own prompt.
        redraw: match target.runtime {
            Runtime::Vm => Some(axum::body::Bytes::from_static(b"\x0c")),
            Runtime::Pod => None,
        },
        lab: match target.runtime {
            Runtime::Vm => LabKind::Vm,
            Runtime::Pod => LabKind::Container,
        },
        // The page says "Connected" only once the console itself is open, and remembers the
        // warnings it was shown.
        status: true,
        warnings_given: target.warned.clone(),
        ..RelayConfig::default()
    };
    let cluster: Arc<dyn ttlab_cluster::ConsoleCluster> = target.site.cluster().clone();
    upgrade
        .read_buffer_size(8 * 1024)
        .write_buffer_size(0)
        .max_message_size(MAX_BROWSER_MESSAGE)
        .max_frame_size(MAX_BROWSER_MESSAGE)
        .on_upgrade(move |socket| async move {
            // Other replicas close their connections to this console before KubeVirt drops
            // them, so their pages show "another tab" instead of reconnecting.
            if let Some(taken) = &taken {
                consoles.until_listening(LISTEN_WAIT).await;
                if let Err(e) = state.store().announce_console_taken(taken).await {
                    tracing::warn!(session = %taken.session, error = %e, "console takeover not announced to other replicas");
                }
                // The new owner replaces the row of the connection it took over.
                if let Err(e) = state
                    .store()
                    .console_connections()
                    .opened(taken.session, &taken.node, taken.connection, &target.user, replica())
                    .await
                {
                    tracing::warn!(session = %taken.session, node = %taken.node, error = %e, "console connection not recorded");
                }
            }
            let store = state.store().clone();
            let metrics = state.metrics().clone();
            let open = metrics.console_opened(target.runtime);
            let (to_browser, from_browser) = browser_frames(socket);
            let end = match target.runtime {
                Runtime::Vm => {
                    let vm = VmConsole {
                        state,
                        session: target.session,
                        site: Arc::clone(&target.site),
                        cluster,
                        vm: target.object.clone(),
                        node: target.node.clone(),
                        agent: None,
                        resizing: None,
                    };
                    relay(to_browser, from_browser, vm, controls, config).await
                }
                Runtime::Pod => {
                    let pod = PodShell {
                        state,
                        session: target.session,
                        cluster,
                        pod: target.object.clone(),
                        shell: None,
                        resize: None,
                    };
                    relay(to_browser, from_browser, pod, controls, config).await
                }
            };
            drop(registration);
            drop(open);
            metrics.console_closed(closed_why(&end.reason));
            if let Some(taken) = &taken
                && let Err(e) = store
                    .console_connections()
                    .closed(taken.session, &taken.node, taken.connection, Some(closed_why(&end.reason)))
                    .await
            {
                tracing::warn!(session = %taken.session, node = %taken.node, error = %e, "console close not recorded");
            }
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

/// This server process as console records name it: its host name (a pod's name) and a random
/// id drawn once per process, so two replicas on one host, or a restarted one, differ.
pub(crate) fn replica() -> &'static str {
    static REPLICA: OnceLock<String> = OnceLock::new();
    REPLICA.get_or_init(|| {
        let id = Uuid::new_v4().simple().to_string();
        let id = &id[..8];
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default();
        if host.is_empty() || host.chars().count() > 200 {
            id.to_owned()
        } else {
            format!("{host}/{id}")
        }
    })
}

/// How a relay's end is recorded for the admin's session view.
fn closed_why(reason: &CloseReason) -> ConsoleClosedWhy {
    match reason {
        CloseReason::BrowserClosed => ConsoleClosedWhy::BrowserClosed,
        CloseReason::Replaced => ConsoleClosedWhy::TakenOver,
        CloseReason::Expired | CloseReason::Finished | CloseReason::VmStopped => {
            ConsoleClosedWhy::SessionEnded
        }
        CloseReason::Unavailable(_)
        | CloseReason::ConsoleLost(_)
        | CloseReason::BrowserUnresponsive
        | CloseReason::ServerShutdown => ConsoleClosedWhy::Lost,
    }
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

/// Starts (once per registry) the tasks that apply session changes to open consoles and
/// follow other replicas' takeovers (`console_sessions`, `console_takeovers`: see
/// [`crate::tasks`]).
fn watch_sessions(state: &AppState, consoles: &Arc<Consoles>) {
    if consoles.watching.swap(true, Ordering::SeqCst) {
        return;
    }
    crate::tasks::start_console_watchers(state, consoles);
}

/// Closes every console of a registry when dropped: the `console_sessions` task holds it, so
/// every console is told when the server stops.
pub(crate) struct CloseAllOnDrop(pub(crate) Weak<Consoles>);

impl Drop for CloseAllOnDrop {
    fn drop(&mut self) {
        if let Some(consoles) = self.0.upgrade() {
            consoles.close_all(&CloseReason::ServerShutdown);
        }
    }
}

/// Marks the records of this replica's open consoles seen (a replica that stops doing so is
/// taken for gone, and its records closed: `console_replicas`).
pub(crate) async fn mark_seen(state: &AppState, consoles: &Consoles) -> Result<(), ApiError> {
    state
        .store()
        .console_connections()
        .seen(&consoles.connections())
        .await?;
    Ok(())
}

/// Re-reads the sessions of open consoles (one query for all live ones) and applies them.
pub(crate) async fn apply_changes(state: &AppState, consoles: &Consoles) -> Result<(), ApiError> {
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
            Some(FinalStatus::Finished | FinalStatus::Requeued) | None => CloseReason::Finished,
        },
        SessionStatus::Finished | SessionStatus::Requeued => CloseReason::Finished,
        SessionStatus::Expired => CloseReason::Expired,
        SessionStatus::Failed | SessionStatus::Ghost => CloseReason::VmStopped,
    })
}
