//! The router, composed of one module per area. Each module's `routes()` returns a
//! `Router<AppState>`; adding an area (the console relay, static pages) is one `.merge(…)`
//! here.

mod admin;
mod events;
mod health;
pub mod openapi;
mod sessions;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::response::IntoResponse;

use crate::{ApiError, AppState};

/// Every route of the server, not yet bound to a state (for composing with other areas).
pub fn routes() -> Router<AppState> {
    Router::new()
        .merge(health::routes())
        .merge(sessions::routes())
        .merge(events::routes())
        .merge(admin::routes())
        .merge(openapi::routes())
        .merge(crate::console::routes())
}

/// The complete application: [`routes`] with the state, the body limit and JSON answers for
/// unknown paths and methods.
pub fn router(state: AppState) -> Router {
    let limit = state.config().max_body_bytes;
    let web = crate::web::web_dir(state.config().web_dir.as_deref());
    routes()
        .merge(crate::web::routes(web))
        .fallback(|| async { ApiError::RouteNotFound.into_response() })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed.into_response() })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}
