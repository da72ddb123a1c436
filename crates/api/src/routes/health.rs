//! The operators' routes, served on the ops port when one is configured (`ops_listen`, a port
//! the Ingress does not route): `/healthz` (the process answers: liveness, fine while it
//! waits for its database), `/readyz` (this process and its database, and if not ready, why:
//! since when the database has not answered, the last error), `/healthz/cluster` (what the last probe of each site's Kubernetes API found) and
//! `/metrics` (a scrape also reads the database and the cluster — sessions, the last reaper
//! cycle, the VM places taken, the quotas — each part within a timeout).
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

/// The longest `/readyz` (and a scrape) waits for the database.
const READY_DB_TIMEOUT: Duration = Duration::from_secs(3);
/// The longest a scrape waits for the cluster's VMs and quotas.
const SCRAPE_CLUSTER_TIMEOUT: Duration = Duration::from_secs(5);

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

/// 200 `{"status": "ready", "database": "ok"}` once the server was prepared on its database
/// and the database answers now; otherwise 503 with why (`reason`), what the database checks
/// found (since when it has been unreachable, the last error) and, for the operator's
/// information only, what the last cluster probe found.
async fn readyz(State(state): State<AppState>) -> Response {
    let reason = match state.database_health().not_ready() {
        Some(why) => why,
        None => {
            let error = match tokio::time::timeout(READY_DB_TIMEOUT, state.store().ping()).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {} s", READY_DB_TIMEOUT.as_secs())),
            };
            let now = chrono::Utc::now();
            state.update_database_health(|health| {
                health.record(now, error.as_deref().map_or(Ok(()), Err));
            });
            match error {
                None => return Json(json!({"status": "ready", "database": "ok"})).into_response(),
                Some(e) => format!("the database does not answer: {e}"),
            }
        }
    };
    let body = json!({
        "status": "not ready",
        "error": ApiError::DatabaseUnavailable(String::new()).code(),
        "reason": reason,
        "database": state.database_health(),
        "cluster": state.cluster_health(),
    });
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

/// 200 while every site's last probe answered, 503 when one did not (for dashboards and
/// alerts, not probes); the body says when, how fast, and why not, over all sites
/// ([`crate::ClusterHealth::over`]), and then each site's under `sites`.
async fn cluster(State(state): State<AppState>) -> Response {
    let health = state.cluster_health();
    let status = match health.reachable {
        Some(false) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::OK,
    };
    let sites: Vec<serde_json::Value> = state
        .site_healths()
        .into_iter()
        .map(|(site, health)| {
            let mut v = json!({"site": site});
            if let (Some(o), Ok(serde_json::Value::Object(h))) =
                (v.as_object_mut(), serde_json::to_value(health))
            {
                o.extend(h);
            }
            v
        })
        .collect();
    let mut body = serde_json::to_value(health).unwrap_or_default();
    if let Some(o) = body.as_object_mut() {
        o.insert("sites".to_owned(), sites.into());
    }
    (status, Json(body)).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    // What the database and the cluster say now, read at scrape time; a part that cannot be
    // read in time keeps its last values.
    tokio::join!(from_database(&state), from_cluster(&state));
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

/// Sessions by status, the sessions past their expiry or held by objects still terminating,
/// and the last reaper cycle, from the database (its clock).
async fn from_database(state: &AppState) {
    let env = &state.config().env;
    let store = state.store();
    let read = async {
        let now = store.db_now().await?;
        let live = store.sessions().list_live(env, None, 10_000).await?;
        let terminating = store.sessions().list_terminating(Some(env), 10_000).await?;
        let cycles = store.reaper_cycles().recent(Some(env), 20).await?;
        Ok::<_, ttlab_store::StoreError>((now, live, terminating, cycles))
    };
    let Ok(Ok((now, live, terminating, cycles))) =
        tokio::time::timeout(READY_DB_TIMEOUT, read).await
    else {
        return;
    };
    let metrics = state.metrics();
    let mut counts: BTreeMap<&str, i64> = ttlab_model::SessionStatus::LIVE
        .iter()
        .map(|s| (s.as_str(), 0))
        .collect();
    for s in &live {
        *counts.entry(s.status.as_str()).or_default() += 1;
    }
    for (status, n) in counts {
        metrics
            .sessions
            .get_or_create(&StatusLabels {
                status: status.to_owned(),
            })
            .set(n);
    }
    let seconds_since = |at: chrono::DateTime<chrono::Utc>| {
        (now - at).to_std().map(|d| d.as_secs_f64()).unwrap_or(0.0)
    };
    let overdue: Vec<f64> = live
        .iter()
        .filter(|s| s.expires_at < now)
        .map(|s| seconds_since(s.expires_at))
        .collect();
    metrics
        .sessions_past_expiry
        .set(i64::try_from(overdue.len()).unwrap_or(i64::MAX));
    metrics
        .sessions_past_expiry_max_seconds
        .set(overdue.iter().copied().fold(0.0, f64::max));
    metrics
        .sessions_terminating
        .set(i64::try_from(terminating.len()).unwrap_or(i64::MAX));
    metrics.sessions_terminating_max_seconds.set(
        terminating
            .iter()
            .map(|t| seconds_since(t.since))
            .fold(0.0, f64::max),
    );
    // The reaper records each cycle as it ends, whether it runs as a Deployment or as a
    // CronJob; a dry run reclaims nothing and does not count.
    let last = cycles.iter().find(|c| !c.cycle.dry_run).map(|c| {
        c.cycle.started_at.timestamp_millis() as f64 / 1000.0 + c.cycle.duration.as_secs_f64()
    });
    match last {
        Some(ended) => {
            metrics.last_reaper_cycle.set(ended);
        }
        None if cycles.is_empty() => {
            metrics.last_reaper_cycle.set(0.0);
        }
        // Only dry runs lately: the last value stands.
        None => {}
    }
}

/// The VM places taken (as the capacity check counts them) and the namespace's quotas, of
/// every site side by side, each within the scrape's timeout (a site that does not answer in
/// time keeps its last values).
async fn from_cluster(state: &AppState) {
    let scrapes = state.sites().iter().map(|site| from_site(state, site));
    futures::future::join_all(scrapes).await;
}

async fn from_site(state: &AppState, site: &crate::sites::SiteRuntime) {
    let metrics = state.metrics();
    let name = site.name().as_str();
    let limit = site.vm_limit();
    let usage = async {
        let listing = crate::saga::listed_vms(site).await?;
        crate::saga::count_vms(state, site, &listing).await
    };
    let (usage, quotas) = tokio::join!(
        tokio::time::timeout(SCRAPE_CLUSTER_TIMEOUT, usage),
        tokio::time::timeout(SCRAPE_CLUSTER_TIMEOUT, site.cluster().resource_quotas()),
    );
    if let Ok(Ok(usage)) = usage {
        metrics.set_capacity(name, &usage, limit);
    }
    if let Ok(Ok(quotas)) = quotas {
        metrics.set_quotas(name, &quotas);
    }
}
