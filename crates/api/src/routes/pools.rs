//! Admin routes of warm pools: each VM lesson's pool state (`GET /api/admin/pools`), and an
//! operator's override of its settings — resize, pause, resume, a pool for a lesson whose file
//! has none (`PUT /api/admin/pools/{lesson}`) — or back to the lesson file's
//! (`DELETE /api/admin/pools/{lesson}`).

use std::time::Duration;

use axum::extract::{Path, State};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use ttlab_lesson::Lesson;
use ttlab_model::{LessonId, Runtime};

use crate::auth::AdminUser;
use crate::extract::ApiJson;
use crate::pool::settings_with;
use crate::{ApiError, AppState};

pub(super) fn routes() -> Router<AppState> {
    Router::new().route("/api/admin/pools", get(list)).route(
        "/api/admin/pools/{lesson}",
        get(one).put(put).delete(delete),
    )
}

/// The longest age limit an operator may give members (a week).
const MAX_AGE_MINUTES_CAP: u32 = 7 * 24 * 60;

/// `PUT /api/admin/pools/{lesson}`: the settings to run the pool with. Fields left out keep
/// the pool's current value (the override's, else the lesson file's, else 0 / 240 minutes /
/// false).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PutBody {
    size: Option<u32>,
    min: Option<u32>,
    max: Option<u32>,
    max_age_minutes: Option<u32>,
    demand: Option<bool>,
    paused: Option<bool>,
}

fn vm_lesson(state: &AppState, raw: &str) -> Result<Lesson, ApiError> {
    let lesson = raw
        .parse::<LessonId>()
        .ok()
        .and_then(|id| state.config().lessons.get(&id).cloned())
        .ok_or_else(|| ApiError::LessonNotFound(raw.to_owned()))?;
    if lesson.runtime != Runtime::Vm {
        return Err(ApiError::bad_request(
            "not_pooled",
            format!(
                "{} is a pod lesson; only VM lessons have pools (a pod starts in seconds)",
                lesson.id
            ),
        ));
    }
    Ok(lesson)
}

async fn pool_json(state: &AppState, lesson: &Lesson) -> Result<Value, ApiError> {
    let env = &state.config().env;
    let overridden = state.store().pools().get(env, &lesson.id).await?;
    let settings = settings_with(lesson, overridden.as_ref().map(|o| &o.settings))?;
    let counts = state.store().pools().counts(env, &lesson.id).await?;
    let plan = state.pool_plan(&lesson.id);
    Ok(json!({
        "lesson": lesson.id.to_string(),
        "title": lesson.title,
        "nodes": lesson.nodes.len(),
        "pooled": settings.is_some(),
        "source": settings.as_ref().map(|(_, s)| *s),
        "settings": settings.as_ref().map(|(s, _)| json!({
            "size": s.size(),
            "min": s.min(),
            "max": s.max(),
            "max_age_minutes": s.max_age().num_minutes(),
            "demand": s.demand_driven(),
            "paused": s.paused(),
        })),
        "updated_by": overridden.as_ref().map(|o| o.updated_by.to_string()),
        "updated_at": overridden.as_ref().map(|o| o.updated_at),
        "ready": counts.ready,
        "preparing": counts.preparing,
        "claims_24h": counts.claims_24h,
        "misses_24h": counts.misses_24h,
        "handover_failures_24h": counts.handover_failures_24h,
        "hit_rate": counts.hit_rate(),
        "median_refill_seconds": counts.median_refill.map(|d| d.as_secs_f64()),
        "target": plan.as_ref().map(|p| p.target),
        "deferred": plan.as_ref().map(|p| p.deferred),
        "why": plan.map(|p| p.why),
    }))
}

async fn list(State(state): State<AppState>, _admin: AdminUser) -> Result<Json<Value>, ApiError> {
    let mut pools = Vec::new();
    for lesson in state
        .config()
        .lessons
        .iter()
        .filter(|l| l.runtime == Runtime::Vm)
    {
        pools.push(pool_json(&state, lesson).await?);
    }
    Ok(Json(json!({ "pools": pools })))
}

async fn one(
    State(state): State<AppState>,
    _admin: AdminUser,
    Path(lesson): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let lesson = vm_lesson(&state, &lesson)?;
    Ok(Json(pool_json(&state, &lesson).await?))
}

async fn put(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    Path(lesson): Path<String>,
    ApiJson(body): ApiJson<PutBody>,
) -> Result<Json<Value>, ApiError> {
    let lesson = vm_lesson(&state, &lesson)?;
    let env = &state.config().env;
    let overridden = state.store().pools().get(env, &lesson.id).await?;
    let current = settings_with(&lesson, overridden.as_ref().map(|o| &o.settings))?;
    let (size, min, max, age, demand, paused) = match &current {
        Some((s, _)) => (
            s.size(),
            s.min(),
            s.max(),
            u32::try_from(s.max_age().num_minutes()).unwrap_or(MAX_AGE_MINUTES_CAP),
            s.demand_driven(),
            s.paused(),
        ),
        None => (0, 0, 0, 240, false, false),
    };
    let size = body.size.unwrap_or(size);
    // A new size beyond the old bounds moves them with it, unless they were given.
    let max = body.max.unwrap_or(max.max(size));
    let min = body.min.unwrap_or(min.min(size));
    let age = body.max_age_minutes.unwrap_or(age);
    if !(min <= size && size <= max) {
        return Err(ApiError::bad_request(
            "invalid_pool",
            format!("a pool needs min <= size <= max; got min {min}, size {size}, max {max}"),
        ));
    }
    if max > ttlab_store::POOL_SIZE_CAP {
        return Err(ApiError::bad_request(
            "invalid_pool",
            format!(
                "a pool holds at most {} members; got max {max}",
                ttlab_store::POOL_SIZE_CAP
            ),
        ));
    }
    if !(1..=MAX_AGE_MINUTES_CAP).contains(&age) {
        return Err(ApiError::bad_request(
            "invalid_pool",
            format!("max_age_minutes must be from 1 to {MAX_AGE_MINUTES_CAP} (a week); got {age}"),
        ));
    }
    let settings = ttlab_store::PoolSettings {
        size,
        min,
        max,
        paused: body.paused.unwrap_or(paused),
        max_age: Duration::from_secs(u64::from(age) * 60),
        demand_driven: body.demand.unwrap_or(demand),
    };
    state
        .store()
        .pools()
        .upsert(env, &lesson.id, &settings, &admin.user)
        .await?;
    tracing::info!(lesson = %lesson.id, admin = %admin.user, size, min, max, paused = settings.paused, demand = settings.demand_driven, "pool settings changed by an operator");
    Ok(Json(pool_json(&state, &lesson).await?))
}

async fn delete(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    Path(lesson): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let lesson = vm_lesson(&state, &lesson)?;
    let removed = state
        .store()
        .pools()
        .delete(&state.config().env, &lesson.id)
        .await?;
    if removed {
        tracing::info!(lesson = %lesson.id, admin = %admin.user, "pool settings back to the lesson file's");
    }
    let mut v = pool_json(&state, &lesson).await?;
    v["removed_override"] = json!(removed);
    Ok(Json(v))
}
