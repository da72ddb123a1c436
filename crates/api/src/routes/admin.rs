//! Admin routes: every session, one session in detail, ending and extending a session (each
//! recorded in `admin_actions`), capacity, reaper reports, "collect now", statistics with
//! readiness histograms per lesson and stage, and this replica's background tasks.

use std::collections::BTreeMap;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};
use ttlab_cluster::QuotaSummary;
use ttlab_model::SessionStatus;
use ttlab_store::{ReaperCycle, StoreError};
use ttlab_vm_manifest::launcher::LauncherSpec;

use crate::auth::AdminUser;
use crate::extract::{ApiJson, SessionPath};
use crate::sites::SiteRuntime;
use crate::view::SessionView;
use crate::{ApiError, AppState};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/admin/sessions", get(sessions))
        .route("/api/admin/sessions/{id}", get(session_detail))
        .route("/api/admin/sessions/{id}/end", post(end))
        .route("/api/admin/sessions/{id}/extend", post(extend))
        .route("/api/admin/actions", get(actions))
        .route("/api/admin/capacity", get(capacity))
        .route("/api/admin/reaper", get(reaper))
        .route("/api/admin/reaper/collect", post(collect))
        .route("/api/admin/stats", get(stats))
        .route("/api/admin/tasks", get(tasks))
}

/// Milliseconds of `d`, for JSON.
fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `GET /api/admin/tasks`: the status of each background task of the replica that answers.
async fn tasks(State(state): State<AppState>, _admin: AdminUser) -> Json<Value> {
    let tasks: Vec<Value> = state
        .background()
        .statuses()
        .iter()
        .map(|t| {
            json!({
                "name": t.name.as_str(),
                "description": t.description,
                "period_seconds": t.period.map(|p| p.as_secs_f64()),
                "running": t.running,
                "finished": t.finished,
                "activations": t.activations,
                "failures": t.failures,
                "consecutive_failures": t.consecutive_failures,
                "last_started_at": t.last_started_at,
                "last_reason": t.last_reason.map(|r| r.as_str()),
                "last_duration_ms": t.last_duration.map(millis),
                "last_success_at": t.last_success_at,
                "last_error": t.last_error,
                "last_error_at": t.last_error_at,
            })
        })
        .collect();
    Json(json!({
        "replica": crate::console::replica(),
        "server_time": Utc::now(),
        "tasks": tasks,
    }))
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
    let starting_rows = state
        .store()
        .sessions()
        .list_in_status(&state.config().env, SessionStatus::Starting, None, 5000)
        .await?;
    let starting = starting_rows.len();
    // Per site, with the cluster probe's finding; the top-level fields are the first site's
    // (the only one without a sites file), as they always were.
    let several = state.sites().len() > 1;
    let mut sites = Vec::new();
    let mut first = None;
    for site in state.sites() {
        let seen = site_capacity(&state, site, several).await;
        let (reachable, why) = site_reachable(&site.health(), seen.error.as_deref());
        let vm_limit = site.vm_limit();
        sites.push(json!({
            "name": site.name(),
            "namespace": site.cluster().namespace(),
            "vm_limit": vm_limit,
            "weight": site.site().weight.get(),
            "labels": site.site().labels,
            "agent_path": site.agent_path().as_str(),
            "in_use": seen.live_vms,
            "available": seen.live_vms.map(|n| vm_limit.saturating_sub(n)),
            "starting_sessions": starting_rows.iter().filter(|s| &s.site == site.name()).count(),
            "quota": seen.quota,
            "quota_error": seen.quota_error,
            "memory": seen.memory,
            "error": seen.error,
            "reachable": reachable,
            "why": why,
            "checked_at": site.health().checked_at,
            "golden_disks_ready": several.then(|| site.golden_ready_lessons()),
        }));
        if first.is_none() {
            first = Some(seen);
        }
    }
    let site = state.first_site();
    let seen = first.unwrap_or_else(|| unreachable!("a server has at least one site"));
    Ok(Json(json!({
        "live_vms": seen.live_vms,
        "starting_sessions": starting,
        "limit": site.vm_limit(),
        "available": seen.live_vms.map(|n| site.vm_limit().saturating_sub(n)),
        "namespace": site.cluster().namespace(),
        "quota": seen.quota,
        "memory": seen.memory,
        "terminating_vms": seen.terminating_vms,
        "terminating": terminating,
        "error": seen.error,
        "quota_error": seen.quota_error,
        "sites": sites,
    })))
}

/// What the capacity view shows of one site's cluster.
struct SiteSeen {
    live_vms: Option<usize>,
    terminating_vms: Option<Vec<String>>,
    error: Option<String>,
    quota: Option<Vec<Value>>,
    quota_error: Option<String>,
    memory: Value,
}

/// How long the capacity view waits for one of several sites' API servers.
const SITE_VIEW_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Lists one site's VMs (every VM ttlab manages counts, those being deleted too: their
/// guests hold memory until they are gone; the ones being deleted are named) and reads its
/// ResourceQuotas (the second layer, as the API server accounts them). With `several` sites
/// each call is bounded by [`SITE_VIEW_TIMEOUT`], so one silent site does not hold the view.
async fn site_capacity(state: &AppState, site: &SiteRuntime, several: bool) -> SiteSeen {
    let selector = ttlab_model::labels::managed_selector();
    let list = site
        .cluster()
        .list_all(ttlab_cluster::Kind::VirtualMachine, &selector);
    let listed = if several {
        tokio::time::timeout(SITE_VIEW_TIMEOUT, list)
            .await
            .unwrap_or_else(|_| Err(site_timed_out()))
    } else {
        list.await
    };
    let terminating_vms = listed.as_ref().ok().map(|vms| {
        vms.iter()
            .filter(|v| v.deleting)
            .map(|v| v.name.clone())
            .collect()
    });
    let (live_vms, error) = match &listed {
        Ok(vms) => (Some(vms.len()), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let quotas = if several && error.is_some() {
        // Its API server did not answer the listing: not asked again.
        Err(site_timed_out())
    } else {
        site.cluster().resource_quotas().await
    };
    let (quota, quota_error) = match &quotas {
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
    let memory = memory_view(&state.config().lessons, quotas.as_deref().ok());
    SiteSeen {
        live_vms,
        terminating_vms,
        error,
        quota,
        quota_error,
        memory,
    }
}

fn site_timed_out() -> ttlab_cluster::ClusterError {
    ttlab_cluster::ClusterError::Transient {
        message: format!(
            "the API server did not answer within {} s",
            SITE_VIEW_TIMEOUT.as_secs()
        ),
    }
}

/// Whether a site's cluster is reachable, and if not why: the last probe's finding
/// (`tasks::cluster_probe`); before the first probe ends, whether this view's own count of
/// the site's VMs answered (`count_error` its error).
fn site_reachable(
    health: &crate::ClusterHealth,
    count_error: Option<&str>,
) -> (bool, Option<String>) {
    match health.reachable {
        Some(true) => (true, None),
        Some(false) => (
            false,
            Some(
                health
                    .error
                    .clone()
                    .unwrap_or_else(|| "the last probe of the Kubernetes API failed".to_owned()),
            ),
        ),
        None => (count_error.is_none(), count_error.map(str::to_owned)),
    }
}

/// Memory against the quota: the `requests.memory` of the namespace quota with the least left
/// (hard and used as the API server accounts them; `null` when no quota limits memory or the
/// quotas could not be read), what one session of each VM lesson costs there — KubeVirt's
/// launcher pod requests the guest's memory plus its overhead, and the console log's sidecar
/// beside it (`ttlab_vm_manifest::launcher`) — and how many more sessions of it the memory left
/// allows.
fn memory_view(lessons: &ttlab_lesson::LessonSet, quotas: Option<&[QuotaSummary]>) -> Value {
    // The one place a quota's quantity is read.
    let bytes = |text: &str| {
        let q: ttlab_model::Quantity = text.parse().ok()?;
        u64::try_from(q.whole_units()?).ok()
    };
    let binding = quotas
        .into_iter()
        .flatten()
        .filter_map(|q| {
            let hard = q.hard.get(REQUESTS_MEMORY)?;
            let used = q.used.get(REQUESTS_MEMORY).map_or("0", String::as_str);
            let (hard_bytes, used_bytes) = (bytes(hard)?, bytes(used)?);
            Some((q, hard, used, hard_bytes, used_bytes))
        })
        .min_by_key(|(_, _, _, hard, used)| hard.saturating_sub(*used));
    let free = binding.map(|(_, _, _, hard, used)| hard.saturating_sub(used));
    let lessons: Vec<Value> = lessons
        .iter()
        .filter(|l| l.runtime == ttlab_model::Runtime::Vm)
        .map(|l| {
            let vm = LauncherSpec::lab_vm(l.memory.bytes(), l.cores).resources();
            let vms = l.nodes.len() as u64;
            let session = vm.pod_memory.saturating_mul(vms);
            json!({
                "lesson": l.id.as_str(),
                "vms": vms,
                "guest_bytes": vm.guest,
                "overhead_bytes": vm.overhead,
                "launcher_request_bytes": vm.compute_memory,
                "vm_bytes": vm.pod_memory,
                "session_bytes": session,
                "more_sessions": free.map(|f| f / session.max(1)),
            })
        })
        .collect();
    json!({
        "quota": binding.map(|(q, ..)| q.name.as_str()),
        "hard": binding.map(|(_, hard, ..)| hard.as_str()),
        "used": binding.map(|(_, _, used, ..)| used),
        "hard_bytes": binding.map(|(_, _, _, hard, _)| hard),
        "used_bytes": binding.map(|(.., used)| used),
        "free_bytes": free,
        "lessons": lessons,
    })
}

/// The quota resource of the pods' memory requests.
const REQUESTS_MEMORY: &str = "requests.memory";

fn cycle_json(c: &ReaperCycle) -> Value {
    let r = &c.cycle;
    json!({
        "id": c.id.get(),
        "env": r.env.as_str(),
        "site": c.site.as_ref().map(|s| s.as_str()),
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
    let readiness = readiness_histograms(&rows);
    let time_to_ready: Vec<Value> = ready
        .into_iter()
        .map(|((lesson, disk), v)| json!({"lesson": lesson, "disk": disk, "seconds": distribution(v)}))
        .collect();
    Ok(Json(json!({
        "sessions": rows.len(),
        "by_status": by_status,
        "time_to_ready": time_to_ready,
        "expiry_to_reclaimed": {"seconds": distribution(reclaim)},
        "readiness": readiness,
    })))
}

/// Upper bounds (seconds) of the readiness histograms' buckets; a last bucket holds the rest.
const BUCKETS: [f64; 10] = [1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0];

/// How long each provisioning stage took, per lesson, as histograms over the recorded stage
/// times of `rows`: `vm_created` (request → object created), `vmi_running`, `agent_up`,
/// `ready` (each from the stage before it that was recorded) and `total` (request → ready).
fn readiness_histograms(rows: &[ttlab_store::Session]) -> Vec<Value> {
    let mut by: BTreeMap<(String, &'static str), Vec<f64>> = BTreeMap::new();
    for s in rows {
        let Some(ready) = s.ready_at else { continue };
        let lesson = s.lesson.to_string();
        let mut previous = s.created_at;
        for (stage, at) in [
            ("1_vm_created", s.vm_created_at),
            ("2_vmi_running", s.vmi_running_at),
            ("3_agent_up", s.agent_up_at),
            ("4_ready", Some(ready)),
        ] {
            if let Some(at) = at {
                by.entry((lesson.clone(), stage))
                    .or_default()
                    .push(seconds(previous, at).max(0.0));
                previous = at;
            }
        }
        by.entry((lesson, "5_total"))
            .or_default()
            .push(seconds(s.created_at, ready).max(0.0));
    }
    by.into_iter()
        .map(|((lesson, stage), values)| {
            let mut counts = [0usize; BUCKETS.len() + 1];
            for v in &values {
                let i = BUCKETS.iter().position(|b| v <= b).unwrap_or(BUCKETS.len());
                counts[i] += 1;
            }
            let buckets: Vec<Value> = counts
                .iter()
                .enumerate()
                .map(|(i, n)| json!({"le": BUCKETS.get(i), "count": n}))
                .collect();
            json!({
                "lesson": lesson,
                "stage": &stage[2..],
                "buckets": buckets,
                "seconds": distribution(values),
            })
        })
        .collect()
}

/// The session view of `s` for an admin, at the database's now.
async fn admin_view(state: &AppState, s: &ttlab_store::Session) -> Result<SessionView, ApiError> {
    let now = state.store().db_now().await?;
    Ok(SessionView::new(s, &state.config().policy, now))
}

async fn find(
    state: &AppState,
    id: ttlab_model::SessionId,
) -> Result<ttlab_store::Session, ApiError> {
    state
        .store()
        .sessions()
        .get(id)
        .await?
        .ok_or(ApiError::SessionNotFound)
}

/// `GET /api/admin/sessions/{id}`: one session with everything an operator needs: the view
/// (the full failure detail included), each stage with its time since the request, the
/// cluster objects with their state (and, while it is finishing, those still terminating after
/// their deletion was accepted; once final, when they were confirmed gone), the reference
/// students quote, the grading history (the last 50 "Check my work") and the operators'
/// actions.
async fn session_detail(
    State(state): State<AppState>,
    _admin: AdminUser,
    SessionPath(id): SessionPath,
) -> Result<Json<Value>, ApiError> {
    let s = find(&state, id).await?;
    let view = admin_view(&state, &s).await?;
    let stages: Vec<Value> = [
        ("requested", Some(s.created_at)),
        ("vm_created", s.vm_created_at),
        ("vmi_running", s.vmi_running_at),
        ("agent_up", s.agent_up_at),
        ("ready", s.ready_at),
        ("finished", s.finished_at),
        ("reclaimed", s.reclaimed_at),
    ]
    .into_iter()
    .map(|(stage, at)| {
        json!({
            "stage": stage,
            "at": at,
            "after_seconds": at.map(|at| seconds(s.created_at, at)),
        })
    })
    .collect();
    let selector = ttlab_model::labels::session_selector(&s.env, s.id);
    let mut objects = Vec::new();
    let mut objects_error = None;
    let site = state.site_of(&s.site);
    for kind in ttlab_cluster::Kind::ALL {
        match site.cluster().list_all(kind, &selector).await {
            Ok(found) => {
                for o in found {
                    let status = if kind == ttlab_cluster::Kind::VirtualMachine {
                        site.cluster()
                            .vm_status(&o.name)
                            .await
                            .ok()
                            .flatten()
                            .and_then(|v| v.printable_status)
                    } else {
                        None
                    };
                    objects.push(json!({
                        "kind": kind.to_string(),
                        "name": o.name,
                        "state": if o.deleting { "deleting".to_owned() } else { status.unwrap_or_else(|| "present".into()) },
                        "created_at": o.created_at,
                    }));
                }
            }
            Err(e) => objects_error = Some(e.to_string()),
        }
    }
    // Objects whose deletion was accepted but that were still there at the last look (the
    // row stays finishing until they are gone), and when everything was confirmed gone.
    let terminating = state
        .store()
        .sessions()
        .terminating_of(s.id)
        .await?
        .map(|t| json!({"objects": t.objects, "since": t.since}));
    let objects_gone_at = state.store().sessions().objects_gone_at(s.id).await?;
    let actions = state.store().admin_actions().for_session(s.id).await?;
    let grading = state
        .store()
        .grading_results()
        .for_session(s.id, 50)
        .await?;
    // Who holds each console (or last held it), on which replica: any replica may relay it.
    let console: Vec<Value> = state
        .store()
        .console_connections()
        .for_session(s.id)
        .await?
        .into_iter()
        .map(|c| {
            json!({
                "node": c.node,
                "user": c.user,
                "replica": c.replica,
                "opened_at": c.opened_at,
                "closed_at": c.closed_at,
                "closed_why": c.closed_why,
            })
        })
        .collect();
    Ok(Json(json!({
        "console": console,
        "grading": grading,
        "session": view,
        "reference": crate::view::reference_of(&s.id.to_string()),
        "stages": stages,
        "objects": objects,
        "objects_error": objects_error,
        "terminating": terminating,
        "objects_gone_at": objects_gone_at,
        "actions": actions,
    })))
}

/// `POST /api/admin/sessions/{id}/end` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndBody {
    /// Why (recorded).
    reason: String,
}

/// `POST /api/admin/sessions/{id}/extend` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExtendBody {
    /// Minutes to add (capped at the session's maximum lifetime).
    minutes: u32,
    /// Why (recorded).
    reason: String,
}

fn reason(text: &str) -> Result<&str, ApiError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(ApiError::bad_request(
            "reason_required",
            "say why (the reason is recorded with the action)",
        ));
    }
    if text.chars().count() > ttlab_store::admin_actions::MAX_REASON_CHARS {
        return Err(ApiError::bad_request(
            "reason_too_long",
            "the reason is longer than 500 characters",
        ));
    }
    Ok(text)
}

/// Ends a `starting` or `running` session as `finished`, as a student's Finish would: its
/// objects are deleted now and the row goes final once they are confirmed gone (an object
/// still terminating, or a failed deletion, leaves it `finishing`: followed by this server,
/// retried by the reaper), and the action is recorded.
async fn end(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    SessionPath(id): SessionPath,
    ApiJson(body): ApiJson<EndBody>,
) -> Result<Json<Value>, ApiError> {
    let why = reason(&body.reason)?;
    let s = find(&state, id).await?;
    if !matches!(s.status, SessionStatus::Starting | SessionStatus::Running) {
        return Err(ApiError::WrongState {
            code: "not_live",
            message: format!(
                "the session is {}; only a live session can be ended",
                s.status
            ),
        });
    }
    let Some(row) = crate::saga::finish_by_student(&state, &s).await? else {
        return Err(ApiError::WrongState {
            code: "not_live",
            message: "the session ended meanwhile".into(),
        });
    };
    let action = state
        .store()
        .admin_actions()
        .record_end(id, &admin.user, why)
        .await?;
    tracing::info!(session = %id, admin = %admin.user, reason = why, "session ended by an operator");
    Ok(Json(json!({
        "session": admin_view(&state, &row).await?,
        "action": action,
    })))
}

/// Moves a running session's expiry `minutes` later, beyond the student's extensions (none
/// is used) but never past its maximum lifetime, and records the action.
async fn extend(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    SessionPath(id): SessionPath,
    ApiJson(body): ApiJson<ExtendBody>,
) -> Result<Json<Value>, ApiError> {
    let why = reason(&body.reason)?;
    if body.minutes == 0 || body.minutes > 24 * 60 {
        return Err(ApiError::bad_request(
            "invalid_minutes",
            "minutes must be from 1 to 1440",
        ));
    }
    let by = std::time::Duration::from_secs(u64::from(body.minutes) * 60);
    let policy = state.config().policy;
    for _ in 0..5 {
        let s = find(&state, id).await?;
        if s.status != SessionStatus::Running {
            return Err(ApiError::WrongState {
                code: "not_running",
                message: format!(
                    "the session is {}; only a running session can be extended",
                    s.status
                ),
            });
        }
        let now = state.store().db_now().await?;
        let next = s
            .lifespan()
            .extend_by_operator(now, by, &policy)
            .map_err(ApiError::Extend)?;
        let next_expires_at = next.expires_at.min(s.max_expires_at);
        if next_expires_at <= s.expires_at {
            return Err(ApiError::Extend(
                ttlab_lifespan::LifespanError::MaxLifetime {
                    max_expires_at: s.max_expires_at,
                },
            ));
        }
        if let Some(action) = state
            .store()
            .admin_actions()
            .extend(id, &admin.user, s.expires_at, next_expires_at, why)
            .await?
        {
            tracing::info!(session = %id, admin = %admin.user, added_seconds = action.added_seconds, reason = why, "session extended by an operator");
            let row = find(&state, id).await?;
            return Ok(Json(json!({
                "session": admin_view(&state, &row).await?,
                "action": action,
            })));
        }
    }
    Err(ApiError::Internal(
        "the session kept changing while it was extended".into(),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionsQuery {
    limit: Option<u32>,
}

/// `GET /api/admin/actions`: the most recent operator actions, newest first.
async fn actions(
    State(state): State<AppState>,
    _admin: AdminUser,
    q: Result<Query<ActionsQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let q = query(q)?;
    let actions = state
        .store()
        .admin_actions()
        .recent(q.limit.unwrap_or(20).clamp(1, 500))
        .await?;
    Ok(Json(json!(actions)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_site_is_reachable_as_the_last_probe_found_it() {
        let probe = |reachable, error: Option<&str>| crate::ClusterHealth {
            reachable,
            error: error.map(str::to_owned),
            ..crate::ClusterHealth::default()
        };
        assert_eq!(site_reachable(&probe(Some(true), None), None), (true, None));
        // The probe's finding wins over this view's own count, either way.
        assert_eq!(
            site_reachable(&probe(Some(true), None), Some("timed out")),
            (true, None)
        );
        assert_eq!(
            site_reachable(&probe(Some(false), Some("connection refused")), None),
            (false, Some("connection refused".to_owned()))
        );
        let (reachable, why) = site_reachable(&probe(Some(false), None), None);
        assert!(!reachable);
        assert!(why.unwrap().contains("probe"));
        // Before the first probe: the count decides.
        assert_eq!(site_reachable(&probe(None, None), None), (true, None));
        assert_eq!(
            site_reachable(&probe(None, None), Some("connection refused")),
            (false, Some("connection refused".to_owned()))
        );
    }

    fn quota(name: &str, hard: &str, used: Option<&str>) -> QuotaSummary {
        QuotaSummary {
            name: name.into(),
            hard: BTreeMap::from([(REQUESTS_MEMORY.to_owned(), hard.to_owned())]),
            used: used
                .map(|u| BTreeMap::from([(REQUESTS_MEMORY.to_owned(), u.to_owned())]))
                .unwrap_or_default(),
        }
    }

    #[test]
    fn memory_is_judged_by_the_quota_with_the_least_left() {
        let lessons = ttlab_lesson::samples::sample_set();
        let quotas = [
            quota("roomy", "100Gi", Some("0")),
            quota("tight", "8Gi", Some("2488667840")),
            QuotaSummary {
                name: "pods-only".into(),
                hard: BTreeMap::from([("pods".to_owned(), "30".to_owned())]),
                used: BTreeMap::new(),
            },
        ];
        let m = memory_view(&lessons, Some(&quotas));
        assert_eq!(m["quota"], "tight");
        assert_eq!(m["hard"], "8Gi");
        assert_eq!(m["used"], "2488667840");
        assert_eq!(m["free_bytes"], (8u64 << 30) - 2_488_667_840);
        let lesson = |id: &str| {
            m["lessons"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["lesson"] == id)
                .cloned()
                .unwrap()
        };
        let systemd = lesson("systemd-basics");
        assert_eq!(systemd["launcher_request_bytes"], 2340u64 << 20);
        assert_eq!(systemd["session_bytes"], 2_488_667_840u64);
        // 8Gi - 2.32 GiB leaves room for 2 more sessions of 2.32 GiB, not 3.
        assert_eq!(systemd["more_sessions"], 2);
        let kubeadm = lesson("kubeadm-cluster");
        assert_eq!(kubeadm["vms"], 3);
        assert_eq!(kubeadm["launcher_request_bytes"], 4_613_734_401u64);
        assert_eq!(kubeadm["session_bytes"], 3 * 4_648_734_401u64);
        assert_eq!(kubeadm["more_sessions"], 0);

        // Used above hard (a lowered quota) leaves nothing, without underflow; no used yet
        // counts as none.
        let over = memory_view(&lessons, Some(&[quota("q", "1Gi", Some("2Gi"))]));
        assert_eq!(over["free_bytes"], 0);
        let fresh = memory_view(&lessons, Some(&[quota("q", "48Gi", None)]));
        assert_eq!(fresh["free_bytes"], 48u64 << 30);
        // No quota on memory, or quotas unread: the costs without a verdict.
        for m in [
            memory_view(&lessons, Some(&quotas[2..])),
            memory_view(&lessons, None),
        ] {
            assert!(m["quota"].is_null() && m["free_bytes"].is_null(), "{m}");
            assert!(m["lessons"][0]["more_sessions"].is_null());
            assert!(m["lessons"][0]["session_bytes"].as_u64().unwrap() > 0);
        }
    }

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
