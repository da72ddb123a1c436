//! The operators' routes, served on the ops port when one is configured (`ops_listen`, a port
//! the Ingress does not route): `/healthz` (the process answers), `/readyz` (this process and
//! its database), `/healthz/cluster` (what the last probe of the Kubernetes API found) and
//! `/metrics`.
//!
//! Readiness deliberately leaves the cluster out: every replica shares the one API server, so
//! a readiness that listed VMs took all of them out of service together when the API server
//! was slow, although reading a session, the countdown and the console's ticket need only the
//! database. Cluster health is reported instead, here and as `ttlab_cluster_reachable`.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::metrics::StatusLabels;
use crate::{ApiError, AppState};

/// The longest `/readyz` waits for the database.
const READY_DB_TIMEOUT: Duration = Duration::from_secs(3);

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/healthz/cluster", get(cluster))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

async fn readyz(State(state): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    tokio::time::timeout(READY_DB_TIMEOUT, state.store().ping())
        .await
        .map_err(|_| ApiError::DatabaseUnavailable("no answer within 3 s".into()))??;
    Ok(Json(json!({"status": "ready", "database": "ok"})))
}

/// 200 while the last probe answered, 503 when it did not (for dashboards and alerts, not
/// probes); the body says when, how fast, and why not.
async fn cluster(State(state): State<AppState>) -> Response {
    let health = state.cluster_health();
    let status = match health.reachable {
        Some(false) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::OK,
    };
    (status, Json(health)).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    // Sessions by status are read at scrape time; if the database is away the gauges keep
    // their last values.
    if let Ok(Ok(live)) = tokio::time::timeout(
        READY_DB_TIMEOUT,
        state
            .store()
            .sessions()
            .list_live(&state.config().env, None, 10_000),
    )
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
