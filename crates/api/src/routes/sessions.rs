//! Student routes: lessons, sessions, extend, finish, grade.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;
use ttlab_agent::AgentClient;
use ttlab_lifespan::Lifespan;
use ttlab_model::{LessonId, Runtime, SessionStatus};
use ttlab_store::Session;

use crate::auth::CurrentUser;
use crate::extract::{ApiJson, SessionPath};
use crate::limits::Action;
use crate::saga;
use crate::view::SessionView;
use crate::{ApiError, AppState};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/lessons", get(lessons))
        .route("/api/sessions", post(create))
        .route("/api/sessions/current", get(current))
        .route("/api/sessions/{id}", get(read).delete(finish))
        .route("/api/sessions/{id}/extend", post(extend))
        .route("/api/sessions/{id}/grade", post(grade))
}

/// A lesson as listed.
#[derive(Debug, Serialize)]
struct LessonView {
    id: String,
    title: String,
    runtime: Runtime,
    nodes: Vec<String>,
    grading_steps: usize,
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
            })
            .collect(),
    )
}

/// `POST /api/sessions` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateSession {
    lesson: String,
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
    let session = saga::open_session(&state, &user.user, &lesson).await?;
    tracing::info!(session = %session.id, user = %user.user, lesson = %lesson.id, "session accepted");
    saga::spawn_provisioning(&state, session.clone());
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

/// The view of a row at the database's now.
pub(super) async fn view(state: &AppState, s: &Session) -> Result<SessionView, ApiError> {
    let now = state.store().db_now().await?;
    Ok(SessionView::new(s, &state.config().policy, now))
}

/// The session `id` if `user` may read it (its owner, or an admin); otherwise 404, so
/// another user's session ids reveal nothing.
pub(super) async fn visible(
    state: &AppState,
    user: &CurrentUser,
    id: ttlab_model::SessionId,
) -> Result<Session, ApiError> {
    match state.store().sessions().get(id).await? {
        Some(s) if s.user == user.user || user.is_admin() => Ok(s),
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
        Some(s) if s.user == user.user => Ok(s),
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
        Some((s, now)) if s.user == user.user || user.is_admin() => Ok(Json(
            SessionView::new(&s, &state.config().policy, now).for_viewer(&user),
        )),
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
        let lifespan = Lifespan {
            started_at: s.started_at,
            expires_at: s.expires_at,
            extensions_used: s.extensions_used,
        };
        let next = lifespan.extend(now, &policy).map_err(ApiError::Extend)?;
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
        return Err(ApiError::WrongState {
            code: "not_running",
            message: format!(
                "the session is {}; only a running session can be graded",
                s.status
            ),
        });
    }
    let lesson = state
        .config()
        .lessons
        .get(&s.lesson)
        .cloned()
        .ok_or_else(|| ApiError::LessonNotFound(s.lesson.to_string()))?;
    let mut steps = Vec::with_capacity(lesson.grading.len());
    for step in &lesson.grading {
        steps.push(match s.runtime {
            Runtime::Vm => grade_in_vm(&state, &s, step).await?,
            Runtime::Pod => grade_in_pod(&state, &s, step).await?,
        });
    }
    let passed = steps.iter().filter(|s| s.passed).count();
    tracing::info!(session = %s.id, passed, total = steps.len(), "graded");
    Ok(Json(json!({
        "session": s.id.to_string(),
        "passed": passed,
        "total": steps.len(),
        "steps": steps,
    })))
}

/// Runs one grading step through the agent in the step's VM, with the VM's stored token.
async fn grade_in_vm(
    state: &AppState,
    s: &Session,
    step: &ttlab_lesson::GradingStep,
) -> Result<StepResult, ApiError> {
    let vm = s
        .vms
        .iter()
        .find(|v| v.node == step.node)
        .ok_or_else(|| ApiError::Internal(format!("no VM recorded for node {}", step.node)))?;
    let ip = state
        .cluster()
        .vmi_ip(&vm.name)
        .await?
        .ok_or_else(|| ApiError::AgentUnavailable(format!("{} has no address", vm.name)))?;
    let token = saga::agent_token(state, s.id, &step.node).await?;
    let client = AgentClient::new(SocketAddr::new(ip, state.config().agent_port), token)
        .with_timeouts(Duration::from_secs(3), Duration::from_secs(5))
        .with_user_agent(state.config().user_agent.as_str());
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
    state: &AppState,
    s: &Session,
    step: &ttlab_lesson::GradingStep,
) -> Result<StepResult, ApiError> {
    let pod = s
        .vms
        .first()
        .ok_or_else(|| ApiError::Internal("no pod recorded for the session".into()))?;
    let command = vec!["sh".to_owned(), "-c".to_owned(), step.command.clone()];
    let out = state
        .cluster()
        .exec_pod_command(&pod.name, Some(saga::LAB_CONTAINER), command, step.timeout)
        .await
        .map_err(|e| ApiError::AgentUnavailable(format!("the lab pod: {e}")))?;
    Ok(StepResult::new(
        step,
        out.exit_code,
        out.timed_out,
        out.stdout,
        out.stderr,
        u64::try_from(out.duration.as_millis()).unwrap_or(u64::MAX),
    ))
}
