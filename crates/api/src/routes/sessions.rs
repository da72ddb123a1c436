//! Student routes: lessons, sessions, extend, finish, grade.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;
use ttlab_model::{LessonId, Runtime, SessionStatus};
use ttlab_store::Session;

use crate::agent_route::{NoAgent, agent_client};
use crate::auth::CurrentUser;
use crate::extract::{ApiJson, SessionPath};
use crate::limits::Action;
use crate::metrics::GradingOutcome;
use crate::saga;
use crate::sites::SiteRuntime;
use crate::view::{ExpectedView, SessionView};
use crate::{ApiError, AppState};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/lessons", get(lessons))
        .route("/api/sessions", post(create))
        .route("/api/sessions/current", get(current))
        .route("/api/sessions/{id}", get(read).delete(finish))
        .route("/api/sessions/{id}/extend", post(extend))
        .route("/api/sessions/{id}/grade", post(grade))
        .route(
            "/api/waitlist",
            get(waitlist_read)
                .post(waitlist_join)
                .delete(waitlist_leave),
        )
}

/// A lesson as listed.
#[derive(Debug, Serialize)]
struct LessonView {
    id: String,
    title: String,
    runtime: Runtime,
    nodes: Vec<String>,
    grading_steps: usize,
    /// The names of the grading steps (what "Check my work" checks), in order.
    checks: Vec<String>,
    /// The lesson's instructions as safe HTML (rendered from its Markdown, HTML in it
    /// escaped); absent when the lesson has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    instructions_html: Option<String>,
}

async fn lessons(State(state): State<AppState>, _user: CurrentUser) -> Json<Vec<LessonView>> {
    Json(
        state
            .config()
            .lessons
            .iter()
            .map(|l| LessonView {
                id: l.id.to_string(),
                title: l.title.clone(),
                runtime: l.runtime,
                nodes: l.nodes.iter().map(ToString::to_string).collect(),
                grading_steps: l.grading.len(),
                checks: l.grading.iter().map(|g| g.name.clone()).collect(),
                instructions_html: l.instructions.as_ref().map(|i| i.html()),
            })
            .collect(),
    )
}

/// `POST /api/sessions` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateSession {
    lesson: String,
    /// A scheduled class's join code: its student takes the class's prepared labs first. A
    /// code that opens no class of the lesson now is a 422.
    #[serde(default)]
    class_code: Option<String>,
}

async fn create(
    State(state): State<AppState>,
    user: CurrentUser,
    ApiJson(body): ApiJson<CreateSession>,
) -> Result<Response, ApiError> {
    state.admit(&user.user, Action::Start)?;
    let lesson = body
        .lesson
        .parse::<LessonId>()
        .ok()
        .and_then(|id| state.config().lessons.get(&id).cloned())
        .ok_or_else(|| ApiError::LessonNotFound(body.lesson.clone()))?;
    let code = body.class_code.as_deref().filter(|c| !c.trim().is_empty());
    let class = crate::classes::student_class(&state, &lesson, code).await?;
    let session = saga::open_session(&state, &user.user, &lesson, class).await?;
    tracing::info!(session = %session.id, user = %user.user, lesson = %lesson.id, "session accepted");
    // A member claimed from the lesson's pool is running already; anything else is prepared
    // now.
    if session.status == SessionStatus::Starting {
        saga::spawn_provisioning(&state, session.clone());
    }
    let view = view(&state, &session).await?.for_viewer(&user);
    Ok((
        StatusCode::ACCEPTED,
        [(
            axum::http::header::LOCATION,
            format!("/api/sessions/{}", session.id),
        )],
        Json(view),
    )
        .into_response())
}

/// How many recent ready sessions of a lesson its expected time to ready is measured over.
const EXPECTED_OVER: u32 = 20;

/// The view of a row at the database's now (with the lesson's expected time to ready while
/// it starts).
pub(super) async fn view(state: &AppState, s: &Session) -> Result<SessionView, ApiError> {
    let now = state.store().db_now().await?;
    Ok(SessionView::new(s, &state.config().policy, now)
        .with_expected(expected(state, s).await)
        .with_site(state.usable_site(&s.site).is_ok()))
}

/// While `s` starts: how long the last ready sessions of its lesson took. A failed read
/// only leaves the estimate out.
pub(super) async fn expected(state: &AppState, s: &Session) -> Option<ExpectedView> {
    if s.status != SessionStatus::Starting {
        return None;
    }
    let seconds = state
        .store()
        .sessions()
        .recent_ready_seconds(&s.env, &s.lesson, EXPECTED_OVER)
        .await
        .ok()?;
    ExpectedView::from_seconds(seconds)
}

/// The session `id` if `user` may read it (its owner, or an admin); otherwise 404, so
/// another user's session ids reveal nothing.
pub(super) async fn visible(
    state: &AppState,
    user: &CurrentUser,
    id: ttlab_model::SessionId,
) -> Result<Session, ApiError> {
    match state.store().sessions().get(id).await? {
        Some(s) if s.user.as_ref() == Some(&user.user) || user.is_admin() => Ok(s),
        _ => Err(ApiError::SessionNotFound),
    }
}

/// The session `id` if `user` owns it (actions are the owner's only).
async fn owned(
    state: &AppState,
    user: &CurrentUser,
    id: ttlab_model::SessionId,
) -> Result<Session, ApiError> {
    match state.store().sessions().get(id).await? {
        Some(s) if s.user.as_ref() == Some(&user.user) => Ok(s),
        _ => Err(ApiError::SessionNotFound),
    }
}

async fn current(
    State(state): State<AppState>,
    user: CurrentUser,
) -> Result<Json<SessionView>, ApiError> {
    let s = state
        .store()
        .sessions()
        .live_for_user(&user.user)
        .await?
        .ok_or(ApiError::SessionNotFound)?;
    Ok(Json(view(&state, &s).await?.for_viewer(&user)))
}

async fn read(
    State(state): State<AppState>,
    user: CurrentUser,
    SessionPath(id): SessionPath,
) -> Result<Json<SessionView>, ApiError> {
    // One round trip: the row and the database clock it is rendered against.
    match state.store().sessions().get_with_now(id).await? {
        Some((s, now)) if s.user.as_ref() == Some(&user.user) || user.is_admin() => {
            let expected = expected(&state, &s).await;
            Ok(Json(
                SessionView::new(&s, &state.config().policy, now)
                    .with_expected(expected)
                    .with_site(state.usable_site(&s.site).is_ok())
                    .for_viewer(&user),
            ))
        }
        _ => Err(ApiError::SessionNotFound),
    }
}

async fn extend(
    State(state): State<AppState>,
    user: CurrentUser,
    SessionPath(id): SessionPath,
) -> Result<Json<SessionView>, ApiError> {
    state.admit(&user.user, Action::Extend)?;
    let policy = state.config().policy;
    for _ in 0..5 {
        let s = owned(&state, &user, id).await?;
        if s.status != SessionStatus::Running {
            return Err(ApiError::WrongState {
                code: if s.status.is_final() {
                    "expired"
                } else {
                    "not_running"
                },
                message: format!(
                    "the session is {}; only a running session can be extended",
                    s.status
                ),
            });
        }
        let now = state.store().db_now().await?;
        let next = s
            .lifespan()
            .extend(now, &policy)
            .map_err(ApiError::Extend)?;
        // Conditional on what was read: a concurrent extension or expiry makes it `None`,
        // and the rules are applied again to the fresh row.
        if let Some(row) = state
            .store()
            .sessions()
            .extend(id, s.extensions_used, next.expires_at)
            .await?
        {
            return Ok(Json(SessionView::new(&row, &policy, now).for_viewer(&user)));
        }
    }
    Err(ApiError::Internal(
        "the session kept changing while it was extended".into(),
    ))
}

async fn finish(
    State(state): State<AppState>,
    user: CurrentUser,
    SessionPath(id): SessionPath,
) -> Result<Json<SessionView>, ApiError> {
    let s = owned(&state, &user, id).await?;
    let ended = if matches!(s.status, SessionStatus::Starting | SessionStatus::Running) {
        saga::finish_by_student(&state, &s).await?
    } else {
        None
    };
    let row = match ended {
        Some(row) => row,
        None => state
            .store()
            .sessions()
            .get(id)
            .await?
            .ok_or(ApiError::SessionNotFound)?,
    };
    Ok(Json(view(&state, &row).await?.for_viewer(&user)))
}

/// One grading step's result.
#[derive(Debug, Serialize)]
struct StepResult {
    name: String,
    node: String,
    passed: bool,
    exit_code: Option<i32>,
    expected_exit: i32,
    timed_out: bool,
    stdout: String,
    stderr: String,
    duration_ms: u64,
}

impl StepResult {
    /// The result of `step`, from what running its command gave; it passed if it finished
    /// with the expected exit code.
    fn new(
        step: &ttlab_lesson::GradingStep,
        exit_code: Option<i32>,
        timed_out: bool,
        stdout: String,
        stderr: String,
        duration_ms: u64,
    ) -> Self {
        Self {
            name: step.name.clone(),
            node: step.node.to_string(),
            passed: !timed_out && exit_code == Some(step.expect_exit),
            exit_code,
            expected_exit: step.expect_exit,
            timed_out,
            stdout,
            stderr,
            duration_ms,
        }
    }
}

async fn grade(
    State(state): State<AppState>,
    user: CurrentUser,
    SessionPath(id): SessionPath,
) -> Result<Json<serde_json::Value>, ApiError> {
    state.admit(&user.user, Action::Grade)?;
    let s = owned(&state, &user, id).await?;
    if s.status != SessionStatus::Running {
        return Err(not_running(s.status));
    }
    // Its site must answer: else 503 `site_unavailable`, saying so.
    let site = state.usable_site(&s.site)?;
    let lesson = state
        .config()
        .lessons
        .get(&s.lesson)
        .cloned()
        .ok_or_else(|| ApiError::LessonNotFound(s.lesson.to_string()))?;
    let mut steps = Vec::with_capacity(lesson.grading.len());
    for step in &lesson.grading {
        let result = match s.runtime {
            Runtime::Vm => grade_in_vm(&state, &site, &s, step).await,
            Runtime::Pod => grade_in_pod(&site, &s, step).await,
        };
        match result {
            Ok(step) => steps.push(step),
            // The session may have ended while it was graded (expired, finished, reclaimed:
            // its VM is then gone): that is what the student is told, not the failed step.
            Err(e) => {
                let e = match owned(&state, &user, id).await {
                    Ok(now) if now.status != SessionStatus::Running => not_running(now.status),
                    _ => e,
                };
                state.metrics().graded(match e {
                    ApiError::AgentUnavailable(_) => GradingOutcome::AgentUnavailable,
                    _ => GradingOutcome::Failed,
                });
                return Err(e);
            }
        }
    }
    state.metrics().graded(GradingOutcome::Graded);
    let passed = steps.iter().filter(|s| s.passed).count();
    tracing::info!(session = %s.id, passed, total = steps.len(), "graded");
    // The operators' history of this session's gradings; a failure to record it does not
    // take the result from the student.
    let failed: Vec<String> = steps
        .iter()
        .filter(|s| !s.passed)
        .map(|s| s.name.clone())
        .collect();
    if let Err(e) = state
        .store()
        .grading_results()
        .record(
            s.id,
            u32::try_from(passed).unwrap_or(u32::MAX),
            u32::try_from(steps.len()).unwrap_or(u32::MAX),
            &failed,
        )
        .await
    {
        tracing::warn!(session = %s.id, error = %e, "could not record the grading");
    }
    Ok(Json(json!({
        "session": s.id.to_string(),
        "passed": passed,
        "total": steps.len(),
        "steps": steps,
    })))
}

/// The answer to grading a session that is not running (or stopped running meanwhile).
fn not_running(status: SessionStatus) -> ApiError {
    ApiError::WrongState {
        code: "not_running",
        message: format!("the session is {status}; only a running session can be graded"),
    }
}

/// Runs one grading step through the agent in the step's VM, with the VM's stored token.
async fn grade_in_vm(
    state: &AppState,
    site: &SiteRuntime,
    s: &Session,
    step: &ttlab_lesson::GradingStep,
) -> Result<StepResult, ApiError> {
    let vm = s
        .vms
        .iter()
        .find(|v| v.node == step.node)
        .ok_or_else(|| ApiError::Internal(format!("no VM recorded for node {}", step.node)))?;
    let token = saga::agent_token(state, s.id, &step.node).await?;
    let client = match agent_client(state, site, &vm.name, None, token).await {
        Ok(client) => client,
        Err(NoAgent::NoAddress) => {
            return Err(ApiError::AgentUnavailable(format!(
                "{} has no address",
                vm.name
            )));
        }
        // No VMI: the VM is not running (powered off, or deleted behind the server's back).
        Err(NoAgent::NoInstance) => {
            return Err(ApiError::AgentUnavailable(format!(
                "{} has no running instance",
                vm.name
            )));
        }
        Err(NoAgent::Cluster(e)) => return Err(e.into()),
    }
    .with_timeouts(Duration::from_secs(3), Duration::from_secs(5));
    let out = client
        .exec(&step.command, step.timeout)
        .await
        .map_err(|e| ApiError::AgentUnavailable(e.to_string()))?;
    Ok(StepResult::new(
        step,
        out.exit_code,
        out.timed_out,
        out.stdout,
        out.stderr,
        out.duration_ms,
    ))
}

/// Runs one grading step in a pod lab's container (`sh -c COMMAND`, no TTY) through the
/// cluster's pod exec: pods have no agent, the kubelet runs the command.
async fn grade_in_pod(
    site: &SiteRuntime,
    s: &Session,
    step: &ttlab_lesson::GradingStep,
) -> Result<StepResult, ApiError> {
    let pod = s
        .vms
        .first()
        .ok_or_else(|| ApiError::Internal("no pod recorded for the session".into()))?;
    let command = vec!["sh".to_owned(), "-c".to_owned(), step.command.clone()];
    let out = site
        .cluster()
        .exec_pod_command(&pod.name, Some(saga::LAB_CONTAINER), command, step.timeout)
        .await
        .map_err(|e| {
            // The API server failing the exec (a 5xx, a timeout) is the cluster's, and passes;
            // an exec it refuses for good means the lab pod cannot be reached.
            if e.is_retryable() {
                ApiError::ClusterUnavailable(format!("the lab pod: {e}"))
            } else {
                ApiError::AgentUnavailable(format!("the lab pod: {e}"))
            }
        })?;
    Ok(StepResult::new(
        step,
        out.exit_code,
        out.timed_out,
        out.stdout,
        out.stderr,
        u64::try_from(out.duration.as_millis()).unwrap_or(u64::MAX),
    ))
}

/// The student's place on the waitlist (`GET`/`POST /api/waitlist`, and the `waitlist`
/// events of `GET /api/waitlist/events`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(super) struct WaitlistView {
    /// Whether the student is on the waitlist.
    waiting: bool,
    /// The lesson they wait for.
    #[serde(skip_serializing_if = "Option::is_none")]
    lesson: Option<String>,
    /// 1 for the first in line.
    #[serde(skip_serializing_if = "Option::is_none")]
    position: Option<u32>,
    /// When they joined.
    #[serde(skip_serializing_if = "Option::is_none")]
    enqueued_at: Option<chrono::DateTime<chrono::Utc>>,
    /// While a place is held for them: until when (only they can take it meanwhile).
    #[serde(skip_serializing_if = "Option::is_none")]
    held_until: Option<chrono::DateTime<chrono::Utc>>,
    /// While a place is held for them: whole seconds left to take it.
    #[serde(skip_serializing_if = "Option::is_none")]
    hold_seconds_left: Option<i64>,
    /// While they wait without a hold: when they are taken off the list if no place frees
    /// for them by then (`TTLAB_WAITLIST_MAX_WAIT` after joining).
    #[serde(skip_serializing_if = "Option::is_none")]
    leaves_at: Option<chrono::DateTime<chrono::Utc>>,
    /// While they wait without a hold: whole seconds until `leaves_at` (at least 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    leaves_in_seconds: Option<i64>,
    /// While they wait: the longest wait without a hold, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_wait_seconds: Option<u64>,
}

impl WaitlistView {
    /// Whether the student is on the waitlist.
    pub(super) fn is_waiting(&self) -> bool {
        self.waiting
    }
}

/// The waitlist view of `user` now.
pub(super) async fn waitlist_view(
    state: &AppState,
    user: &ttlab_model::UserId,
) -> Result<WaitlistView, ApiError> {
    let Some(entry) = state.store().waitlist().get(user).await? else {
        return Ok(WaitlistView {
            waiting: false,
            lesson: None,
            position: None,
            enqueued_at: None,
            held_until: None,
            hold_seconds_left: None,
            leaves_at: None,
            leaves_in_seconds: None,
            max_wait_seconds: None,
        });
    };
    let now = state.store().db_now().await?;
    let held_until = entry.hold_until.filter(|h| *h > now);
    let max_wait = state.config().waitlist_max_wait;
    let leaves_at = chrono::TimeDelta::from_std(max_wait)
        .ok()
        .and_then(|wait| entry.enqueued_at.checked_add_signed(wait))
        .filter(|_| entry.hold_until.is_none());
    Ok(WaitlistView {
        waiting: true,
        lesson: Some(entry.lesson.to_string()),
        position: Some(entry.position),
        enqueued_at: Some(entry.enqueued_at),
        held_until,
        hold_seconds_left: held_until.map(|h| (h - now).num_seconds()),
        leaves_at,
        leaves_in_seconds: leaves_at.map(|at| (at - now).num_seconds().max(0)),
        max_wait_seconds: Some(max_wait.as_secs()),
    })
}

/// `POST /api/waitlist` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JoinWaitlist {
    lesson: String,
}

async fn waitlist_read(
    State(state): State<AppState>,
    user: CurrentUser,
) -> Result<Json<WaitlistView>, ApiError> {
    Ok(Json(waitlist_view(&state, &user.user).await?))
}

async fn waitlist_join(
    State(state): State<AppState>,
    user: CurrentUser,
    ApiJson(body): ApiJson<JoinWaitlist>,
) -> Result<Response, ApiError> {
    let lesson = body
        .lesson
        .parse::<LessonId>()
        .ok()
        .and_then(|id| state.config().lessons.get(&id).cloned())
        .ok_or_else(|| ApiError::LessonNotFound(body.lesson.clone()))?;
    if lesson.runtime != Runtime::Vm {
        return Err(ApiError::BadRequest {
            code: "not_limited",
            message: format!(
                "{} runs in a pod, which the VM limit does not hold back: start it directly",
                lesson.id
            ),
        });
    }
    if let Some(open) = state.store().sessions().live_for_user(&user.user).await? {
        return Err(ApiError::SessionExists {
            lesson: open.lesson,
            session: open.id,
        });
    }
    let needed = u32::try_from(lesson.nodes.len()).unwrap_or(u32::MAX);
    match state
        .store()
        .waitlist()
        .join(&user.user, &lesson.id, &state.config().env, needed)
        .await?
    {
        ttlab_store::Joined::Existing(entry) => Err(ApiError::WrongState {
            code: "already_waiting",
            message: format!(
                "you are already on the waitlist for {} (position {})",
                entry.lesson, entry.position
            ),
        }),
        ttlab_store::Joined::New(entry) => {
            state.metrics().waitlist_joined.inc();
            tracing::info!(user = %user.user, lesson = %lesson.id, position = entry.position, "joined the waitlist");
            let view = waitlist_view(&state, &user.user).await?;
            Ok((StatusCode::CREATED, Json(view)).into_response())
        }
    }
}

async fn waitlist_leave(
    State(state): State<AppState>,
    user: CurrentUser,
) -> Result<Json<WaitlistView>, ApiError> {
    if !state.store().waitlist().remove(&user.user).await? {
        return Err(ApiError::WrongState {
            code: "not_waiting",
            message: "you are not on the waitlist".to_owned(),
        });
    }
    tracing::info!(user = %user.user, "left the waitlist");
    Ok(Json(waitlist_view(&state, &user.user).await?))
}
