//! The one error type of this crate: every way a request or the start-up can fail, with the
//! HTTP status and the stable `error` code of the JSON body `{"error": code, "message": …}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use ttlab_lifespan::LifespanError;
use ttlab_model::LessonId;
use ttlab_store::StoreError;

/// Why a request (or starting the server) failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No usable credentials (missing, malformed, wrong signature or algorithm, expired).
    #[error("{0}")]
    Unauthorized(String),
    /// Authenticated, but the role may not use this route.
    #[error("this needs the admin role")]
    Forbidden,
    /// The session does not exist, or belongs to someone else.
    #[error("no such session")]
    SessionNotFound,
    /// No lesson with this id is offered.
    #[error("there is no lesson {0:?}")]
    LessonNotFound(String),
    /// Nothing is served at this path.
    #[error("there is nothing at this path")]
    RouteNotFound,
    /// The path exists but not with this method.
    #[error("this method is not allowed here")]
    MethodNotAllowed,
    /// The user already has a live session.
    #[error("you already have a lab open ({lesson}); finish it before starting another")]
    SessionExists {
        /// The lesson of the open session.
        lesson: LessonId,
        /// The open session's id.
        session: ttlab_model::SessionId,
    },
    /// The VM limit is reached: the sentence says how many places are taken, by what, and the
    /// limit.
    #[error("{}", capacity_sentence(*limit, *needed, usage))]
    Capacity {
        /// The configured limit.
        limit: usize,
        /// The VMs the refused lab needs.
        needed: usize,
        /// What holds the places counted.
        usage: CapacityUse,
    },
    /// An extension was refused by the lifespan rules.
    #[error("{0}")]
    Extend(LifespanError),
    /// The session is not in a state this action applies to.
    #[error("{message}")]
    WrongState {
        /// Stable code (`not_running`, …).
        code: &'static str,
        /// Human sentence.
        message: String,
    },
    /// The request body or path could not be understood.
    #[error("{message}")]
    BadRequest {
        /// Stable code (`invalid_json`, `invalid_id`, `unknown_field`, …).
        code: &'static str,
        /// Human sentence.
        message: String,
    },
    /// The request body is larger than allowed.
    #[error("the request body is larger than this server accepts")]
    PayloadTooLarge,
    /// The body is not JSON (wrong or missing content type).
    #[error("send the body as application/json")]
    UnsupportedMediaType,
    /// The database cannot be reached right now.
    #[error("the service is temporarily unavailable (database: {0}); try again shortly")]
    DatabaseUnavailable(String),
    /// The cluster cannot be reached right now.
    #[error("the cluster is temporarily unavailable: {0}")]
    ClusterUnavailable(String),
    /// The grading agent in the VM did not answer.
    #[error("the lab VM did not answer: {0}")]
    AgentUnavailable(String),
    /// Waited for another component (the reaper) and it did not answer in time.
    #[error("{0}")]
    Timeout(String),
    /// The server's configuration is unusable (start-up only).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The listen address could not be bound (start-up only).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A defect or an unexpected answer; logged with details, shown without them.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What holds the VM places counted against the limit: every VM ttlab manages in the
/// namespace, and every VM a live session is about to create, once each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapacityUse {
    /// VMs of live sessions (of every environment), created or about to be.
    pub labs: usize,
    /// VMs being deleted: their guests still hold memory while they shut down.
    pub shutting_down: usize,
    /// VMs no live session holds (ghosts, leftovers the reaper removes).
    pub without_lab: usize,
}

impl CapacityUse {
    /// Every place taken.
    pub fn total(&self) -> usize {
        self.labs + self.shutting_down + self.without_lab
    }
}

fn vms(n: usize) -> String {
    if n == 1 {
        "1 VM".to_owned()
    } else {
        format!("{n} VMs")
    }
}

/// "No VM capacity right now: 6 of 8 VMs are in use by open labs, plus 2 VMs still shutting
/// down. Try again in a few minutes."
fn capacity_sentence(limit: usize, needed: usize, usage: &CapacityUse) -> String {
    let mut s = format!(
        "No VM capacity right now: {} of {limit} VMs {} in use by open labs",
        usage.labs,
        if usage.labs == 1 { "is" } else { "are" }
    );
    if usage.shutting_down > 0 {
        s.push_str(&format!(
            ", plus {} still shutting down",
            vms(usage.shutting_down)
        ));
    }
    if usage.without_lab > 0 {
        s.push_str(&format!(
            ", plus {} left over from ended labs",
            vms(usage.without_lab)
        ));
    }
    if needed > 1 {
        s.push_str(&format!("; this lab needs {needed}"));
    }
    s.push_str(". Try again in a few minutes.");
    s
}

/// The JSON error body.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    /// Stable machine-readable code.
    pub error: String,
    /// A sentence for a human.
    pub message: String,
}

impl ApiError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden => StatusCode::FORBIDDEN,
            Self::SessionNotFound | Self::LessonNotFound(_) | Self::RouteNotFound => {
                StatusCode::NOT_FOUND
            }
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::SessionExists { .. } | Self::Extend(_) | Self::WrongState { .. } => {
                StatusCode::CONFLICT
            }
            Self::Capacity { .. } | Self::DatabaseUnavailable(_) | Self::ClusterUnavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::AgentUnavailable(_) => StatusCode::BAD_GATEWAY,
            Self::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::Config(_) | Self::Bind { .. } | Self::Internal(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The stable `error` code of the body.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Unauthorized(_) => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::SessionNotFound => "session_not_found",
            Self::LessonNotFound(_) => "lesson_not_found",
            Self::RouteNotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::SessionExists { .. } => "session_exists",
            Self::Capacity { .. } => "capacity",
            // too_early: the extension would add no time yet; shown as its own code.
            Self::Extend(e) => e.code(),
            Self::WrongState { code, .. } | Self::BadRequest { code, .. } => code,
            Self::PayloadTooLarge => "payload_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::DatabaseUnavailable(_) => "database_unavailable",
            Self::ClusterUnavailable(_) => "cluster_unavailable",
            Self::AgentUnavailable(_) => "agent_unavailable",
            Self::Timeout(_) => "timeout",
            Self::Config(_) => "invalid_config",
            Self::Bind { .. } => "bind_failed",
            Self::Internal(_) => "internal",
        }
    }

    /// A bad-request error.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::BadRequest {
            code,
            message: message.into(),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::SessionExists {
                lesson, session, ..
            } => Self::SessionExists { lesson, session },
            e if store_unavailable(&e) => Self::DatabaseUnavailable(e.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<ttlab_cluster::ClusterError> for ApiError {
    fn from(e: ttlab_cluster::ClusterError) -> Self {
        if e.is_retryable() {
            Self::ClusterUnavailable(e.to_string())
        } else {
            Self::Internal(format!("cluster: {e}"))
        }
    }
}

/// Whether a store error means the database cannot be reached right now (as opposed to a
/// statement it refused): no connection, a broken one, or a server shutting down.
pub(crate) fn store_unavailable(e: &StoreError) -> bool {
    match e {
        StoreError::Connect { .. }
        | StoreError::ListenerClosed { .. }
        | StoreError::Timeout { .. } => true,
        // No SQLSTATE: the statement never got an answer. 57xxx: operator intervention
        // (shutdown); 08xxx: connection exceptions.
        StoreError::Query { .. } => e
            .sqlstate()
            .is_none_or(|s| s.starts_with("57") || s.starts_with("08")),
        _ => false,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(code = self.code(), error = %self, "request failed");
        }
        let message = match &self {
            // Details of defects go to the log, not to the client.
            Self::Internal(_) => "something went wrong on the server; it has been logged".into(),
            other => other.to_string(),
        };
        let body = ErrorBody {
            error: self.code().to_owned(),
            message,
        };
        (status, Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(
        limit: usize,
        needed: usize,
        labs: usize,
        shutting_down: usize,
        without_lab: usize,
    ) -> String {
        ApiError::Capacity {
            limit,
            needed,
            usage: CapacityUse {
                labs,
                shutting_down,
                without_lab,
            },
        }
        .to_string()
    }

    #[test]
    fn the_capacity_refusal_states_the_real_count_and_the_limit() {
        assert_eq!(
            refused(8, 1, 8, 0, 0),
            "No VM capacity right now: 8 of 8 VMs are in use by open labs. Try again in a few \
             minutes."
        );
        assert_eq!(
            refused(8, 1, 6, 2, 0),
            "No VM capacity right now: 6 of 8 VMs are in use by open labs, plus 2 VMs still \
             shutting down. Try again in a few minutes."
        );
        assert_eq!(
            refused(3, 2, 1, 1, 1),
            "No VM capacity right now: 1 of 3 VMs is in use by open labs, plus 1 VM still \
             shutting down, plus 1 VM left over from ended labs; this lab needs 2. Try again in \
             a few minutes."
        );
        let e = ApiError::Capacity {
            limit: 8,
            needed: 1,
            usage: CapacityUse::default(),
        };
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code(), "capacity");
    }

    #[test]
    fn connection_failures_are_503() {
        let e: ApiError = StoreError::Connect {
            target: "x".into(),
            reason: "connection refused".into(),
        }
        .into();
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code(), "database_unavailable");
    }
}
