//! `/healthz` (the process answers), `/readyz` (database and cluster reachable), `/metrics`.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use ttlab_cluster::Kind;

use crate::metrics::StatusLabels;
use crate::{ApiError, AppState};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

async fn readyz(State(state): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    let limit = Duration::from_secs(3);
    tokio::time::timeout(limit, state.store().ping())
        .await
        .map_err(|_| ApiError::DatabaseUnavailable("no answer within 3 s".into()))??;
    let selector = ttlab_model::labels::managed_selector();
    tokio::time::timeout(
        limit,
        state
            .cluster()
            .list_page(Kind::VirtualMachine, &selector, None),
    )
    .await
    .map_err(|_| ApiError::ClusterUnavailable("no answer within 3 s".into()))?
    .map_err(|e| ApiError::ClusterUnavailable(e.to_string()))?;
    Ok(Json(
        json!({"status": "ready", "database": "ok", "cluster": "ok"}),
    ))
}

async fn metrics(State(state): State<AppState>) -> Response {
    // Sessions by status are read at scrape time; if the database is away the gauges keep
    // their last values.
    if let Ok(live) = state
        .store()
        .sessions()
        .list_live(&state.config().env, None, 10_000)
        .await
    {
        let mut counts: BTreeMap<&str, i64> = ttlab_model::SessionStatus::LIVE
            .iter()
            .map(|s| (s.as_str(), 0))
            .collect();
        for s in &live {
            *counts.entry(s.status.as_str()).or_default() += 1;
        }
        for (status, n) in counts {
            state
                .metrics()
                .sessions
                .get_or_create(&StatusLabels {
                    status: status.to_owned(),
                })
                .set(n);
        }
    }
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics().encode(),
    )
        .into_response()
}
