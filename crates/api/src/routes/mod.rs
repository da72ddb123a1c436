//! The router, composed of one module per area. Each module's `routes()` returns a
//! `Router<AppState>`; adding an area (the console relay, static pages) is one `.merge(…)`
//! here.
//!
//! Two routers: the public one (students, admins, the web pages) behind the request timeout
//! and the concurrency limit, and the operators' one (health, readiness, metrics), which is
//! merged into the public one only when no ops port is configured. Every answer of both
//! carries the security headers ([`headers`]).

mod admin;
mod classes;
mod events;
pub mod headers;
mod health;
pub mod openapi;
mod pools;
mod sessions;

use std::time::Duration;

use axum::Router;
use axum::error_handling::HandleErrorLayer;
use axum::extract::DefaultBodyLimit;
use axum::response::{IntoResponse, Response};
use tower::ServiceBuilder;
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::metrics::ShedLabels;
use crate::{ApiError, AppState};

/// Every route of the server, not yet bound to a state (for composing with other areas),
/// the operators' routes included.
pub fn routes() -> Router<AppState> {
    public_routes().merge(health::routes())
}

/// The student- and admin-facing routes, without health, readiness and metrics.
pub fn public_routes() -> Router<AppState> {
    Router::new()
        .merge(sessions::routes())
        .merge(events::routes())
        .merge(admin::routes())
        .merge(pools::routes())
        .merge(classes::routes())
        .merge(openapi::routes())
        .merge(crate::console::routes())
}

/// The public application: the routes with the state, the body limit, the request timeout,
/// the concurrency limit, JSON answers for unknown paths and methods, and the security
/// headers on every answer (refusals of the guard layers included). With no ops port
/// configured, health, readiness and metrics are served here too.
pub fn router(state: AppState) -> Router {
    let limit = state.config().max_body_bytes;
    let web = crate::web::web_dir(state.config().web_dir.as_deref());
    // Until the database first answered (and the schema is ready), what needs it is
    // answered 503 with `Retry-After`, and why; health, readiness and the pages are served.
    let gated = public_routes().route_layer(axum::middleware::from_fn_with_state(
        state.clone(),
        require_database,
    ));
    let routes = if state.config().ops_listen.is_some() {
        gated
    } else {
        gated.merge(health::routes())
    };
    let timeout = state.config().request_timeout;
    let shed_state = state.clone();
    let guard = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(move |e: tower::BoxError| {
            let state = shed_state.clone();
            async move { shed(&state, timeout, &e) }
        }))
        .load_shed()
        .layer(GlobalConcurrencyLimitLayer::new(
            state.config().max_concurrent_requests.max(1),
        ))
        .timeout(timeout);
    routes
        .merge(crate::web::routes(web))
        .fallback(|| async { ApiError::RouteNotFound.into_response() })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed.into_response() })
        .layer(DefaultBodyLimit::max(limit))
        .layer(guard)
        .layer(axum::middleware::map_response(
            headers::set_security_headers,
        ))
        .with_state(state)
}

/// The operators' application (the ops port): health, readiness, cluster health, metrics.
/// No concurrency limit: probes must be answered when the public port is saturated.
pub fn ops_router(state: AppState) -> Router {
    health::routes()
        .fallback(|| async { ApiError::RouteNotFound.into_response() })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed.into_response() })
        .layer(axum::middleware::map_response(
            headers::set_security_headers,
        ))
        .with_state(state)
}

/// Answers 503 `database_unavailable` (with `Retry-After`) while the server has not yet been
/// prepared on its database (`tasks::database`); passes the request on once it has.
async fn require_database(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match state.database_health().not_ready() {
        Some(why) => ApiError::DatabaseUnavailable(why).into_response(),
        None => next.run(request).await,
    }
}

/// The answer to a request the guard layers refused: 503 `overloaded` or `request_timeout`.
fn shed(state: &AppState, timeout: Duration, e: &tower::BoxError) -> Response {
    let (reason, error) = if e.is::<tower::timeout::error::Elapsed>() {
        ("request_timeout", ApiError::RequestTimeout(timeout))
    } else if e.is::<tower::load_shed::error::Overloaded>() {
        ("overloaded", ApiError::Overloaded)
    } else {
        (
            "internal",
            ApiError::Internal(format!("request guard: {e}")),
        )
    };
    state
        .metrics()
        .shed
        .get_or_create(&ShedLabels {
            reason: reason.to_owned(),
        })
        .inc();
    error.into_response()
}
