//! Admin routes: every session, capacity, reaper reports, "collect now", statistics.

use std::collections::BTreeMap;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};
use ttlab_model::SessionStatus;
use ttlab_store::{ReaperCycle, StoreError};

use crate::auth::AdminUser;
use crate::view::SessionView;
use crate::{ApiError, AppState};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/admin/sessions", get(sessions))
        .route("/api/admin/capacity", get(capacity))
        .route("/api/admin/reaper", get(reaper))
        .route("/api/admin/reaper/collect", post(collect))
        .route("/api/admin/stats", get(stats))
}

/// `GET /api/admin/sessions` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    /// `live` (default) or `recent`.
    scope: Option<String>,
    /// Most rows (default 200, at most 5000).
    limit: Option<u32>,
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(t)| t)
        .map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))
}

async fn sessions(
    State(state): State<AppState>,
    _admin: AdminUser,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<Vec<SessionView>>, ApiError> {
    let q = query(q)?;
    let limit = q.limit.unwrap_or(200).clamp(1, 5000);
    let env = &state.config().env;
    let rows = match q.scope.as_deref().unwrap_or("live") {
        "live" => state.store().sessions().list_live(env, None, limit).await?,
        "recent" => state.store().sessions().list_recent(env, limit).await?,
        other => {
            return Err(ApiError::bad_request(
                "invalid_query",
                format!("scope {other:?}: expected `live` or `recent`"),
            ));
        }
    };
    let now = state.store().db_now().await?;
    let policy = state.config().policy;
    Ok(Json(
        rows.iter()
            .map(|s| SessionView::new(s, &policy, now))
            .collect(),
    ))
}

async fn capacity(
    State(state): State<AppState>,
    _admin: AdminUser,
) -> Result<Json<Value>, ApiError> {
    // Every VM ttlab manages counts, those being deleted too (their guests hold memory until
    // they are gone); the ones being deleted are named.
    let listed = state
        .cluster()
        .list_all(
            ttlab_cluster::Kind::VirtualMachine,
            &ttlab_model::labels::managed_selector(),
        )
        .await;
    let live = listed.as_ref().map(Vec::len).map_err(Clone::clone);
    let terminating_vms: Option<Vec<&str>> = listed.as_ref().ok().map(|vms| {
        vms.iter()
            .filter(|v| v.deleting)
            .map(|v| v.name.as_str())
            .collect()
    });
    // Sessions left finishing because some object of theirs is still terminating after its
    // deletion was accepted, as the reaper last saw them (every environment: they all share
    // the namespace and its capacity).
    let terminating_sessions = state.store().sessions().list_terminating(None, 500).await?;
    let terminating: Vec<Value> = terminating_sessions
        .iter()
        .map(|t| {
            json!({
                "session": t.id.to_string(),
                "env": t.env.as_str(),
                "lesson": t.lesson.to_string(),
                "finishing_to": t.finishing_to.map(|f| f.as_str()),
                "objects": t.objects,
                "since": t.since,
            })
        })
        .collect();
    let starting = state
        .store()
        .sessions()
        .list_in_status(&state.config().env, SessionStatus::Starting, None, 5000)
        .await?
        .len();
    let (live_vms, error) = match live {
        Ok(n) => (Some(n), None),
        Err(e) => (None, Some(e.to_string())),
    };
    // The second layer: the namespace's ResourceQuotas, as the API server accounts them.
    let (quota, quota_error) = match state.cluster().resource_quotas().await {
        Ok(quotas) => (
            Some(
                quotas
                    .iter()
                    .map(|q| json!({"name": q.name, "hard": q.hard, "used": q.used}))
                    .collect::<Vec<_>>(),
            ),
            None,
        ),
        Err(e) => (None, Some(e.to_string())),
    };
    Ok(Json(json!({
        "live_vms": live_vms,
        "starting_sessions": starting,
        "limit": state.config().vm_limit,
        "available": live_vms.map(|n| state.config().vm_limit.saturating_sub(n)),
        "namespace": state.cluster().namespace(),
        "quota": quota,
        "terminating_vms": terminating_vms,
        "terminating": terminating,
        "error": error,
        "quota_error": quota_error,
    })))
}

fn cycle_json(c: &ReaperCycle) -> Value {
    let r = &c.cycle;
    json!({
        "id": c.id.get(),
        "env": r.env.as_str(),
        "started_at": r.started_at,
        "duration_ms": u64::try_from(r.duration.as_millis()).unwrap_or(u64::MAX),
        "trigger": r.trigger.as_str(),
        "dry_run": r.dry_run,
        "expired": r.expired,
        "orphans": r.orphans,
        "ghosts": r.ghosts,
        "stuck": r.stuck,
        "errors": r.errors,
        "collect_request": r.collect_request.map(|id| id.get()),
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReaperQuery {
    limit: Option<u32>,
}

async fn reaper(
    State(state): State<AppState>,
    _admin: AdminUser,
    q: Result<Query<ReaperQuery>, QueryRejection>,
) -> Result<Json<Vec<Value>>, ApiError> {
    let q = query(q)?;
    let cycles = state
        .store()
        .reaper_cycles()
        .recent(
            Some(&state.config().env),
            q.limit.unwrap_or(20).clamp(1, 500),
        )
        .await?;
    Ok(Json(cycles.iter().map(cycle_json).collect()))
}

async fn collect(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
) -> Result<Json<Value>, ApiError> {
    let env = &state.config().env;
    let request = state
        .store()
        .collect_requests()
        .request(env, &admin.user)
        .await?;
    let timeout = state.config().collect_timeout;
    match state
        .store()
        .collect_requests()
        .wait_for_answer(request.id, timeout)
        .await
    {
        Ok(cycle) => Ok(Json(cycle_json(&cycle))),
        Err(StoreError::Timeout { .. }) => Err(ApiError::Timeout(format!(
            "no reaper of environment {env} answered within {} s; is ttlab-reaper running?",
            timeout.as_secs()
        ))),
        Err(e) => Err(e.into()),
    }
}

/// p50/p90/p99 (nearest rank) and count of `values` (seconds).
fn distribution(mut values: Vec<f64>) -> Value {
    if values.is_empty() {
        return json!({"count": 0, "p50": null, "p90": null, "p99": null});
    }
    values.sort_by(f64::total_cmp);
    let pick = |p: f64| {
        let rank = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
        values[rank - 1]
    };
    json!({"count": values.len(), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)})
}

fn seconds(from: DateTime<Utc>, to: DateTime<Utc>) -> f64 {
    (to - from).num_milliseconds() as f64 / 1000.0
}

async fn stats(State(state): State<AppState>, _admin: AdminUser) -> Result<Json<Value>, ApiError> {
    let rows = state
        .store()
        .sessions()
        .list_recent(&state.config().env, 10_000)
        .await?;
    let mut ready: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    let mut reclaim = Vec::new();
    let mut by_status: BTreeMap<&'static str, usize> = BTreeMap::new();
    for s in &rows {
        *by_status.entry(s.status.as_str()).or_default() += 1;
        if let Some(at) = s.ready_at {
            let disk = s
                .disk
                .as_ref()
                .map(|(k, _)| k.as_str().to_owned())
                .unwrap_or_else(|| "unknown".into());
            ready
                .entry((s.lesson.to_string(), disk))
                .or_default()
                .push(seconds(s.created_at, at));
        }
        if s.status == SessionStatus::Expired
            && let Some(at) = s.reclaimed_at
        {
            reclaim.push(seconds(s.expires_at, at));
        }
    }
    let time_to_ready: Vec<Value> = ready
        .into_iter()
        .map(|((lesson, disk), v)| json!({"lesson": lesson, "disk": disk, "seconds": distribution(v)}))
        .collect();
    Ok(Json(json!({
        "sessions": rows.len(),
        "by_status": by_status,
        "time_to_ready": time_to_ready,
        "expiry_to_reclaimed": {"seconds": distribution(reclaim)},
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let d = distribution((1..=100).map(f64::from).collect());
        assert_eq!(d["count"], 100);
        assert_eq!(d["p50"], 50.0);
        assert_eq!(d["p90"], 90.0);
        assert_eq!(d["p99"], 99.0);
        let one = distribution(vec![3.5]);
        assert_eq!(
            (one["p50"].clone(), one["p99"].clone()),
            (json!(3.5), json!(3.5))
        );
        assert_eq!(distribution(vec![])["count"], 0);
    }
}
