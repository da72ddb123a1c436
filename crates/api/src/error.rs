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
    /// A value of the request is out of range or inconsistent with the others (422): the
    /// answer names the field and says why, and nothing was written.
    #[error("{message}")]
    Invalid {
        /// Stable code (`invalid_class`, `unknown_class_code`, …).
        code: &'static str,
        /// The field of the request at fault (`seats`, `starts_at`, …).
        field: &'static str,
        /// Human sentence.
        message: String,
    },
    /// No class with this id is scheduled in this environment.
    #[error("no such class")]
    ClassNotFound,
    /// The request body is larger than allowed.
    #[error("the request body is larger than this server accepts")]
    PayloadTooLarge,
    /// The body is not JSON (wrong or missing content type).
    #[error("send the body as application/json")]
    UnsupportedMediaType,
    /// The database cannot be reached right now (503 with `Retry-After`).
    #[error("the service is temporarily unavailable (database: {0}); try again shortly")]
    DatabaseUnavailable(String),
    /// The cluster cannot be reached right now.
    #[error("the cluster is temporarily unavailable: {0}")]
    ClusterUnavailable(String),
    /// No configured site can ever run this lesson: it requires a site label that no site
    /// carries (503 `no_site`; the sentence says which, and is the operators' to fix).
    #[error("this lab cannot run here: {0}; tell the operators")]
    NoSite(String),
    /// The site (cluster) a session lives on cannot be used now: its API server did not
    /// answer the last probe, no client could be built for it, or this server is not
    /// configured with it (503 `site_unavailable`).
    #[error("the cluster of site {site} is unreachable: {reason}")]
    SiteUnavailable {
        /// The session's site.
        site: ttlab_model::SiteName,
        /// Why (for operators: the log and the admin page).
        reason: String,
    },
    /// The grading agent in the VM did not answer.
    #[error("the lab VM did not answer: {0}")]
    AgentUnavailable(String),
    /// Waited for another component (the reaper) and it did not answer in time.
    #[error("{0}")]
    Timeout(String),
    /// This user asked for this action too often; `retry_after` says when the next one is
    /// accepted (429 with `Retry-After`).
    #[error("too many {action} requests; try again in {} s", retry_after_secs(*retry_after))]
    RateLimited {
        /// The action limited (`start`, `extend`, `grade`).
        action: &'static str,
        /// How long until the next request is accepted.
        retry_after: std::time::Duration,
    },
    /// The server is answering as many requests as it is configured to (503 with
    /// `Retry-After`).
    #[error("the server is busy; try again in a moment")]
    Overloaded,
    /// This server is shutting down (a deploy) and takes no new starts; another replica does
    /// (503 with `Retry-After`).
    #[error("this server is restarting and takes no new labs; try again in a few seconds")]
    ShuttingDown,
    /// The request was not answered within the server's request timeout.
    #[error("the server did not answer this request within {} s; try again", .0.as_secs())]
    RequestTimeout(std::time::Duration),
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

/// Whole seconds to wait, rounded up, at least 1 (the `Retry-After` value).
fn retry_after_secs(after: std::time::Duration) -> u64 {
    (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1)
}

/// The JSON error body.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    /// Stable machine-readable code.
    pub error: String,
    /// A sentence for a human.
    pub message: String,
}

/// The JSON error body of [`ApiError`]'s answers: [`ErrorBody`] and what some answers add.
#[derive(Debug, Serialize)]
struct FullErrorBody {
    #[serde(flatten)]
    body: ErrorBody,
    /// For a failure on the server's side: the reference the log line of its detail carries,
    /// for the student to quote to an operator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// For a refused extension whose window has not opened: from when extending is offered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub opens_at: Option<chrono::DateTime<chrono::Utc>>,
    /// For a value refused (422): the field of the request at fault.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<&'static str>,
}

/// A fresh reference for one failure: eight hex digits, enough to find its log line.
pub fn new_reference() -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    id[..8].to_owned()
}

impl ApiError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden => StatusCode::FORBIDDEN,
            Self::SessionNotFound
            | Self::LessonNotFound(_)
            | Self::RouteNotFound
            | Self::ClassNotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::SessionExists { .. } | Self::Extend(_) | Self::WrongState { .. } => {
                StatusCode::CONFLICT
            }
            Self::Capacity { .. }
            | Self::DatabaseUnavailable(_)
            | Self::ClusterUnavailable(_)
            | Self::NoSite(_)
            | Self::SiteUnavailable { .. }
            | Self::Overloaded
            | Self::ShuttingDown
            | Self::RequestTimeout(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Invalid { .. } => StatusCode::UNPROCESSABLE_ENTITY,
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
            Self::WrongState { code, .. }
            | Self::BadRequest { code, .. }
            | Self::Invalid { code, .. } => code,
            Self::ClassNotFound => "class_not_found",
            Self::PayloadTooLarge => "payload_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::DatabaseUnavailable(_) => "database_unavailable",
            Self::ClusterUnavailable(_) => "cluster_unavailable",
            Self::NoSite(_) => "no_site",
            Self::SiteUnavailable { .. } => "site_unavailable",
            Self::AgentUnavailable(_) => "agent_unavailable",
            Self::Timeout(_) => "timeout",
            Self::RateLimited { .. } => "rate_limited",
            Self::Overloaded => "overloaded",
            Self::ShuttingDown => "shutting_down",
            Self::RequestTimeout(_) => "request_timeout",
            Self::Config(_) => "invalid_config",
            Self::Bind { .. } => "bind_failed",
            Self::Internal(_) => "internal",
        }
    }

    /// The sentence the client sees. Defects, and the details of a dependency's failure (an
    /// agent's address, a cluster's or database's error text), go to the log and the admin
    /// page only: a student gets a plain reason.
    pub fn public_message(&self) -> String {
        match self {
            Self::Internal(_) => "something went wrong on the server; it has been logged".into(),
            Self::DatabaseUnavailable(_) => {
                "the service is temporarily unavailable (its database cannot be reached); try \
                 again shortly"
                    .into()
            }
            Self::ClusterUnavailable(_) => {
                "the cluster is temporarily unavailable; try again shortly".into()
            }
            Self::SiteUnavailable { site, .. } => format!(
                "the cluster your lab runs on (site {site}) cannot be reached right now; your \
                 lab is not lost, try again in a moment"
            ),
            Self::AgentUnavailable(_) => "the lab VM did not answer; try again in a moment".into(),
            other => other.to_string(),
        }
    }

    /// Whether this is a failure on the server's side (a defect, or a dependency that did not
    /// answer), as opposed to an answer that is the rules working (capacity, overload, a
    /// restart): a failure's answer carries a reference that its log line carries too.
    pub fn is_failure(&self) -> bool {
        matches!(
            self,
            Self::Internal(_)
                | Self::DatabaseUnavailable(_)
                | Self::ClusterUnavailable(_)
                | Self::SiteUnavailable { .. }
                | Self::AgentUnavailable(_)
                | Self::Timeout(_)
        )
    }

    /// The `Retry-After` the answer carries, if any.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            Self::RateLimited { retry_after, .. } => Some(*retry_after),
            Self::Overloaded | Self::RequestTimeout(_) => Some(std::time::Duration::from_secs(1)),
            Self::ShuttingDown | Self::DatabaseUnavailable(_) => {
                Some(std::time::Duration::from_secs(2))
            }
            Self::SiteUnavailable { .. } => Some(std::time::Duration::from_secs(5)),
            _ => None,
        }
    }

    /// A value refused (422), naming the field at fault.
    pub fn invalid(code: &'static str, field: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            code,
            field,
            message: message.into(),
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
            // Another start held the capacity lock for the whole wait: busy, try again.
            StoreError::Busy { .. } => Self::Overloaded,
            e if store_unavailable(&e) => Self::DatabaseUnavailable(e.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<ttlab_auth::AuthError> for ApiError {
    fn from(e: ttlab_auth::AuthError) -> Self {
        use ttlab_auth::AuthError;
        match e {
            AuthError::SecretTooShort { .. } => Self::Config(e.to_string()),
            AuthError::Rejected(why) => Self::Unauthorized(why),
            AuthError::Key(_) | AuthError::Sign(_) => Self::Internal(e.to_string()),
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
        let reference = self.is_failure().then(new_reference);
        if let Some(reference) = &reference {
            // A 500 is the server's own fault, never an outage it rode out: an error line, so
            // it shows at the quietest log level.
            if status == StatusCode::INTERNAL_SERVER_ERROR {
                tracing::error!(code = self.code(), reference = %reference, error = %self, "request failed");
            } else {
                tracing::warn!(code = self.code(), reference = %reference, error = %self, "request failed");
            }
        } else if status.is_server_error() {
            tracing::warn!(code = self.code(), error = %self, "request failed");
        }
        let message = match &reference {
            Some(r) => format!("{} (reference {r})", self.public_message()),
            None => self.public_message(),
        };
        let opens_at = match &self {
            Self::Extend(LifespanError::NotYet { opens_at, .. }) => Some(*opens_at),
            _ => None,
        };
        let body = FullErrorBody {
            body: ErrorBody {
                error: self.code().to_owned(),
                message,
            },
            reference,
            opens_at,
            field: match &self {
                Self::Invalid { field, .. } => Some(*field),
                _ => None,
            },
        };
        let mut response = (status, Json(body)).into_response();
        if let Some(after) = self.retry_after() {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(retry_after_secs(after)),
            );
        }
        response
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
    fn a_lesson_no_site_can_run_is_told_to_the_student_as_it_is() {
        let e = ApiError::NoSite("no site offers the site label gpu this lesson requires".into());
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code(), "no_site");
        assert!(
            !e.is_failure(),
            "a configuration, not a failure: no reference"
        );
        assert_eq!(e.retry_after(), None, "trying again does not help");
        assert_eq!(
            e.public_message(),
            "this lab cannot run here: no site offers the site label gpu this lesson requires; \
             tell the operators"
        );
    }

    #[test]
    fn dependency_details_stay_out_of_the_answer() {
        let agent = ApiError::AgentUnavailable(
            "error sending request for url (http://10.244.1.7:8899/v1/grade)".into(),
        );
        assert!(
            !agent.public_message().contains("10.244"),
            "{}",
            agent.public_message()
        );
        assert!(
            agent.to_string().contains("10.244.1.7:8899"),
            "the log keeps it"
        );
        let cluster = ApiError::ClusterUnavailable("https://10.0.0.1:6443 timed out".into());
        assert!(!cluster.public_message().contains("6443"));
        let db = ApiError::DatabaseUnavailable("db.internal:5432 refused".into());
        assert!(!db.public_message().contains("5432"));
        // A client is told when to come back, as for every other outage it can ride out.
        assert_eq!(db.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(db.retry_after().map(retry_after_secs), Some(2));
    }

    #[test]
    fn a_rate_limit_says_when_to_come_back() {
        let e = ApiError::RateLimited {
            action: "grade",
            retry_after: std::time::Duration::from_millis(1_200),
        };
        assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after().map(retry_after_secs), Some(2));
        assert_eq!(e.to_string(), "too many grade requests; try again in 2 s");
        assert_eq!(retry_after_secs(std::time::Duration::ZERO), 1);
        assert_eq!(retry_after_secs(std::time::Duration::from_secs(3)), 3);
    }

    #[test]
    fn connection_failures_are_503() {
        let e: ApiError = StoreError::Connect {
            target: "x".into(),
            reason: "connection refused".into(),
            rejected: false,
        }
        .into();
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code(), "database_unavailable");
    }
}
