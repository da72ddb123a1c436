//! Admin routes of scheduled classes: schedule one (`POST /api/admin/classes`), list the
//! upcoming and running ones (`GET`), read one (`GET /api/admin/classes/{id}`), change its
//! seats, times, title or code (`PATCH`), cancel it (`DELETE`).
//!
//! Every refusal is a 4xx that names the field and says why, and writes nothing: a value out of
//! range or inconsistent is a 422 (`invalid_class`, `unknown_lesson`, `not_pooled`); a class
//! that is over or cancelled is a 409. Classes that overlap and together ask more than the
//! capacity are accepted: the answer says how many of each one's seats can be warm.

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};
use ttlab_lesson::Lesson;
use ttlab_model::{ClassId, LessonId, Runtime};
use ttlab_pool::{LeadTime, LeadTimeSource};
use ttlab_store::{CLASS_SEATS_CAP, ClassChange, ClassCounts, NewClass, StoreError};

use crate::auth::AdminUser;
use crate::classes::{CurrentClasses, JOIN_EARLY, lead_time, normalize_code};
use crate::extract::ApiJson;
use crate::{ApiError, AppState};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/admin/classes", get(list).post(create))
        .route(
            "/api/admin/classes/{id}",
            get(one).patch(change).delete(cancel),
        )
}

/// The longest a class may last (the store's rule too).
const MAX_WINDOW: TimeDelta = TimeDelta::hours(12);

/// How far ahead a class may be scheduled.
const MAX_AHEAD: TimeDelta = TimeDelta::days(366);

/// The longest title.
const TITLE_CAP: usize = 100;

/// `POST /api/admin/classes` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    lesson: String,
    title: Option<String>,
    seats: Option<i64>,
    starts_at: Option<String>,
    ends_at: Option<String>,
    join_code: Option<String>,
}

/// `PATCH /api/admin/classes/{id}` body: each field given replaces the class's value;
/// `"join_code": null` removes the code.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChangeBody {
    title: Option<String>,
    seats: Option<i64>,
    starts_at: Option<String>,
    ends_at: Option<String>,
    #[serde(default, deserialize_with = "present")]
    join_code: Option<Option<String>>,
}

/// A field that may be `null`: absent is `None`, `null` is `Some(None)`.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

fn invalid(field: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::invalid("invalid_class", field, message)
}

/// The class `{id}` of the path (400 `invalid_id` if it is not a UUID).
fn class_id(raw: &str) -> Result<ClassId, ApiError> {
    raw.parse().map_err(|_| {
        ApiError::bad_request("invalid_id", format!("{raw:?} is not a class id (a UUID)"))
    })
}

/// A VM lesson of this server whose labs can be prepared ahead: not a pod lesson, and one lab
/// fits beside the places kept for a cold start.
fn poolable_lesson(state: &AppState, raw: &str) -> Result<Lesson, ApiError> {
    let lesson = raw
        .parse::<LessonId>()
        .ok()
        .and_then(|id| state.config().lessons.get(&id).cloned())
        .ok_or_else(|| {
            ApiError::invalid(
                "unknown_lesson",
                "lesson",
                format!("there is no lesson {raw:?}"),
            )
        })?;
    if lesson.runtime != Runtime::Vm {
        return Err(ApiError::invalid(
            "not_pooled",
            "lesson",
            format!(
                "{} is a pod lesson: a class prepares VM labs ahead, and a pod starts in seconds",
                lesson.id
            ),
        ));
    }
    // Classes are prepared on the sites that carry the lesson's labels; one lab on one of
    // them, within its limit.
    if let Some(why) = crate::saga::no_site_carries(state, &lesson.site_labels) {
        return Err(ApiError::invalid("not_pooled", "lesson", why));
    }
    let limit = state
        .sites()
        .iter()
        .filter(|s| lesson.site_labels.is_subset(&s.site().labels))
        .map(|s| s.vm_limit())
        .max()
        .unwrap_or(0);
    let reserve = usize::try_from(crate::pool::cold_reserve(state)).unwrap_or(usize::MAX);
    let nodes = lesson.nodes.len();
    if nodes + reserve > limit {
        return Err(ApiError::invalid(
            "not_pooled",
            "lesson",
            format!(
                "a lab of {} takes {nodes} VM(s); with the VM limit {limit} and {reserve} kept \
                 for a cold start, none can be prepared ahead",
                lesson.id
            ),
        ));
    }
    Ok(lesson)
}

fn title(raw: &str) -> Result<String, ApiError> {
    let t = raw.trim();
    if t.is_empty() || t.chars().count() > TITLE_CAP || t.chars().any(char::is_control) {
        return Err(invalid(
            "title",
            format!("a title has 1 to {TITLE_CAP} characters, none of them control characters"),
        ));
    }
    Ok(t.to_owned())
}

fn seats(n: i64) -> Result<u32, ApiError> {
    if n < 1 {
        return Err(invalid(
            "seats",
            format!("a class needs at least 1 seat, got {n}"),
        ));
    }
    match u32::try_from(n) {
        Ok(n) if n <= CLASS_SEATS_CAP => Ok(n),
        _ => Err(invalid(
            "seats",
            format!("a class has at most {CLASS_SEATS_CAP} seats, got {n}"),
        )),
    }
}

fn time(field: &'static str, raw: &str) -> Result<DateTime<Utc>, ApiError> {
    DateTime::parse_from_rfc3339(raw.trim())
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            invalid(
                field,
                format!("{field} must be an RFC 3339 time like 2026-12-02T10:00:00Z, got {raw:?}"),
            )
        })
}

fn code(raw: &str) -> Result<String, ApiError> {
    let c = normalize_code(raw);
    let ok = (4..=32).contains(&c.chars().count())
        && c.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '-');
    if !ok {
        return Err(invalid(
            "join_code",
            "a join code has 4 to 32 letters, digits or dashes",
        ));
    }
    Ok(c)
}

/// `ends_at` after `starts_at`, and at most [`MAX_WINDOW`] later.
fn window(starts_at: DateTime<Utc>, ends_at: DateTime<Utc>) -> Result<(), ApiError> {
    if ends_at <= starts_at {
        return Err(invalid(
            "ends_at",
            format!("ends_at ({ends_at}) must be after starts_at ({starts_at})"),
        ));
    }
    if ends_at - starts_at > MAX_WINDOW {
        return Err(invalid(
            "ends_at",
            format!(
                "a class lasts at most {} hours; this one lasts {} min",
                MAX_WINDOW.num_hours(),
                (ends_at - starts_at).num_minutes()
            ),
        ));
    }
    Ok(())
}

/// A start not in the past and not absurdly far ahead.
fn future_start(starts_at: DateTime<Utc>, now: DateTime<Utc>) -> Result<(), ApiError> {
    if starts_at < now {
        return Err(invalid(
            "starts_at",
            format!("starts_at ({starts_at}) is in the past (the server's time is {now})"),
        ));
    }
    if starts_at - now > MAX_AHEAD {
        return Err(invalid(
            "starts_at",
            format!("starts_at is more than {} days ahead", MAX_AHEAD.num_days()),
        ));
    }
    Ok(())
}

/// A join code no other class (not cancelled, not over) uses at an overlapping time, from
/// [`JOIN_EARLY`] before each start: a code names one class while students can use it.
async fn code_free(
    state: &AppState,
    code: &str,
    starts_at: DateTime<Utc>,
    ends_at: DateTime<Utc>,
    except: Option<ClassId>,
    now: DateTime<Utc>,
) -> Result<(), ApiError> {
    let current = state
        .store()
        .classes()
        .current(&state.config().env, now)
        .await?;
    let clash = current.iter().any(|c| {
        Some(c.id) != except
            && c.join_code.as_deref() == Some(code)
            && c.starts_at - JOIN_EARLY < ends_at
            && starts_at - JOIN_EARLY < c.ends_at
    });
    if clash {
        return Err(invalid(
            "join_code",
            "another class uses this join code at an overlapping time",
        ));
    }
    Ok(())
}

fn lead_json(lead: LeadTime) -> Value {
    json!({
        "seconds": lead.value().num_seconds(),
        "source": match lead.source() {
            LeadTimeSource::Default => "default",
            LeadTimeSource::Measured { .. } => "measured",
        },
        "measured": match lead.source() {
            LeadTimeSource::Default => Value::Null,
            LeadTimeSource::Measured { samples, .. } => json!(samples),
        },
        "describe": lead.to_string(),
    })
}

/// One class as the API shows it.
fn class_json(
    row: &ttlab_store::Class,
    counts: Option<&ClassCounts>,
    lead: LeadTime,
    now: DateTime<Utc>,
    warm: Option<&(u32, Option<String>)>,
) -> Value {
    let planned = ttlab_pool::Class {
        id: row.id,
        title: row.title.clone(),
        starts_at: row.starts_at,
        ends_at: row.ends_at,
        seats: row.seats,
        started: 0,
    };
    let phase = if row.cancelled_at.is_some() {
        "cancelled"
    } else {
        planned.phase(now, lead).as_str()
    };
    json!({
        "id": row.id,
        "lesson": row.lesson,
        "title": row.title,
        "seats": row.seats,
        "starts_at": row.starts_at,
        "ends_at": row.ends_at,
        "join_code": row.join_code,
        "phase": phase,
        "lead_time": lead_json(lead),
        "lead_in_at": planned.lead_in_at(lead),
        "warm": counts.map(|c| json!({"ready": c.ready, "preparing": c.preparing})),
        "started": counts.map(|c| c.started),
        "seats_warm": warm.map(|w| w.0),
        "capacity_note": warm.and_then(|w| w.1.clone()),
        "created_at": row.created_at,
        "created_by": row.created_by,
        "updated_at": row.updated_at,
        "updated_by": row.updated_by,
        "cancelled_at": row.cancelled_at,
        "cancelled_by": row.cancelled_by,
    })
}

/// The VM limit (of every site, added up) and the places kept for a cold start (on each
/// site), as classes are planned with.
fn limits(state: &AppState) -> (u32, u32) {
    (
        state
            .sites()
            .iter()
            .map(|s| u32::try_from(s.vm_limit()).unwrap_or(u32::MAX))
            .fold(0, u32::saturating_add),
        crate::pool::cold_reserve(state),
    )
}

/// The VM places the classes of `lesson` may hold: on each site that carries the lesson's
/// labels, its limit beyond the `reserve` kept there for a cold start, added up.
fn headroom_of(state: &AppState, lesson: &LessonId, reserve: u32) -> u32 {
    let labels = state
        .config()
        .lessons
        .get(lesson)
        .map(|l| l.site_labels.clone())
        .unwrap_or_default();
    state
        .sites()
        .iter()
        .filter(|s| labels.is_subset(&s.site().labels))
        .map(|s| {
            u32::try_from(s.vm_limit())
                .unwrap_or(u32::MAX)
                .saturating_sub(reserve)
        })
        .fold(0, u32::saturating_add)
}

/// Every current class with its counts, lead time and seats warm at its start.
struct Listing {
    now: DateTime<Utc>,
    current: CurrentClasses,
    warm: BTreeMap<ClassId, (u32, Option<String>)>,
}

impl Listing {
    async fn read(state: &AppState) -> Result<Self, ApiError> {
        let now = state.store().db_now().await?;
        let current = CurrentClasses::read(state, now).await?;
        let (_, reserve) = limits(state);
        let warm = current.seats_warm(|lesson| headroom_of(state, lesson, reserve));
        Ok(Self { now, current, warm })
    }

    /// The class `id` if it is current.
    fn json_of(&self, id: ClassId) -> Option<Value> {
        let c = self.current.classes.iter().find(|c| c.row.id == id)?;
        Some(class_json(
            &c.row,
            Some(&c.counts),
            self.current.lead_of(&c.row.lesson),
            self.now,
            self.warm.get(&id),
        ))
    }

    /// The other current classes running (or in their lead-in) at `id`'s start, with their
    /// seats warm.
    fn overlapping(&self, id: ClassId) -> Vec<Value> {
        let Some(c) = self.current.classes.iter().find(|c| c.row.id == id) else {
            return Vec::new();
        };
        self.current
            .classes
            .iter()
            .filter(|o| o.row.id != id)
            .filter(|o| {
                o.planned()
                    .phase(c.row.starts_at, self.current.lead_of(&o.row.lesson))
                    .is_active()
            })
            .map(|o| {
                json!({
                    "id": o.row.id,
                    "title": o.row.title,
                    "lesson": o.row.lesson,
                    "seats": o.row.seats,
                    "seats_warm": self.warm.get(&o.row.id).map(|w| w.0),
                })
            })
            .collect()
    }
}

async fn list(State(state): State<AppState>, _admin: AdminUser) -> Result<Json<Value>, ApiError> {
    let listing = Listing::read(&state).await?;
    let classes: Vec<Value> = listing
        .current
        .classes
        .iter()
        .filter_map(|c| listing.json_of(c.row.id))
        .collect();
    let (limit, reserve) = limits(&state);
    Ok(Json(json!({
        "classes": classes,
        "now": listing.now,
        "vm_limit": limit,
        "reserve": reserve,
    })))
}

/// A class that is current, or else (over or cancelled) as stored, without seats warm.
async fn class_answer(state: &AppState, id: ClassId) -> Result<Value, ApiError> {
    let listing = Listing::read(state).await?;
    if let Some(mut v) = listing.json_of(id) {
        v["overlapping"] = json!(listing.overlapping(id));
        return Ok(v);
    }
    let row = state
        .store()
        .classes()
        .get(&state.config().env, id)
        .await?
        .ok_or(ApiError::ClassNotFound)?;
    let counts = state.store().classes().counts(&[id]).await?;
    let lead = lead_time(state, &row.lesson).await?;
    Ok(class_json(&row, counts.first(), lead, listing.now, None))
}

async fn one(
    State(state): State<AppState>,
    _admin: AdminUser,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = class_id(&id)?;
    Ok(Json(class_answer(&state, id).await?))
}

async fn create(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    ApiJson(body): ApiJson<CreateBody>,
) -> Result<Response, ApiError> {
    let lesson = poolable_lesson(&state, &body.lesson)?;
    let seats = seats(
        body.seats
            .ok_or_else(|| invalid("seats", "seats is required"))?,
    )?;
    let starts_at = time(
        "starts_at",
        body.starts_at
            .as_deref()
            .ok_or_else(|| invalid("starts_at", "starts_at is required"))?,
    )?;
    let ends_at = time(
        "ends_at",
        body.ends_at
            .as_deref()
            .ok_or_else(|| invalid("ends_at", "ends_at is required"))?,
    )?;
    let now = state.store().db_now().await?;
    future_start(starts_at, now)?;
    window(starts_at, ends_at)?;
    let title = match body.title.as_deref() {
        Some(t) => title(t)?,
        None => format!("{} {}", lesson.id, starts_at.format("%H:%M")),
    };
    let join_code = body.join_code.as_deref().map(code).transpose()?;
    if let Some(c) = &join_code {
        code_free(&state, c, starts_at, ends_at, None, now).await?;
    }
    let new = NewClass {
        id: ClassId::new_random(),
        env: state.config().env.clone(),
        lesson: lesson.id.clone(),
        title,
        seats,
        starts_at,
        ends_at,
        join_code,
        by: admin.user.clone(),
    };
    let class = state
        .store()
        .classes()
        .insert(&new)
        .await
        .map_err(refused)?;
    tracing::info!(class = %class.id, lesson = %class.lesson, seats, %starts_at, %ends_at, admin = %admin.user, "class scheduled");
    let answer = class_answer(&state, class.id).await?;
    Ok((
        StatusCode::CREATED,
        [(
            axum::http::header::LOCATION,
            format!("/api/admin/classes/{}", class.id),
        )],
        Json(answer),
    )
        .into_response())
}

/// The store refused values its schema forbids (checked here first, so only a race or a
/// defect gets here): a 422 all the same.
fn refused(e: StoreError) -> ApiError {
    match e {
        StoreError::Refused { rule, .. } => invalid("body", rule),
        other => other.into(),
    }
}

/// A class that can still change: not cancelled (409 `class_cancelled`), not over (409
/// `class_over`).
fn changeable(row: &ttlab_store::Class, now: DateTime<Utc>) -> Result<(), ApiError> {
    if row.cancelled_at.is_some() {
        return Err(ApiError::WrongState {
            code: "class_cancelled",
            message: format!("the class {:?} was cancelled", row.title),
        });
    }
    if row.ends_at <= now {
        return Err(ApiError::WrongState {
            code: "class_over",
            message: format!("the class {:?} is over", row.title),
        });
    }
    Ok(())
}

async fn change(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ChangeBody>,
) -> Result<Json<Value>, ApiError> {
    let id = class_id(&id)?;
    let env = &state.config().env;
    let row = state
        .store()
        .classes()
        .get(env, id)
        .await?
        .ok_or(ApiError::ClassNotFound)?;
    let now = state.store().db_now().await?;
    changeable(&row, now)?;
    if body.title.is_none()
        && body.seats.is_none()
        && body.starts_at.is_none()
        && body.ends_at.is_none()
        && body.join_code.is_none()
    {
        return Err(invalid(
            "body",
            "nothing to change: give seats, starts_at, ends_at, title or join_code",
        ));
    }
    let running = row.starts_at <= now;
    if running {
        let only = |field: &'static str| {
            invalid(
                field,
                format!(
                    "the class {:?} is running: only its end and seats can change",
                    row.title
                ),
            )
        };
        if body.starts_at.is_some() {
            return Err(only("starts_at"));
        }
        if body.title.is_some() {
            return Err(only("title"));
        }
        if body.join_code.is_some() {
            return Err(only("join_code"));
        }
    }
    let title = body.title.as_deref().map(title).transpose()?;
    let seats = body.seats.map(seats).transpose()?;
    let starts_at = body
        .starts_at
        .as_deref()
        .map(|t| time("starts_at", t))
        .transpose()?;
    let ends_at = body
        .ends_at
        .as_deref()
        .map(|t| time("ends_at", t))
        .transpose()?;
    if let Some(s) = starts_at {
        future_start(s, now)?;
    }
    let (new_start, new_end) = (
        starts_at.unwrap_or(row.starts_at),
        ends_at.unwrap_or(row.ends_at),
    );
    if new_end <= now {
        return Err(invalid(
            "ends_at",
            "ends_at must be later than now; to end a class now, cancel it",
        ));
    }
    window(new_start, new_end)?;
    let join_code = match &body.join_code {
        None => None,
        Some(None) => Some(None),
        Some(Some(c)) => Some(Some(code(c)?)),
    };
    if let Some(c) = join_code.clone().unwrap_or_else(|| row.join_code.clone())
        && (join_code.is_some() || starts_at.is_some() || ends_at.is_some())
    {
        code_free(&state, &c, new_start, new_end, Some(id), now).await?;
    }
    let changed = state
        .store()
        .classes()
        .update(
            env,
            id,
            &ClassChange {
                title,
                seats,
                starts_at,
                ends_at,
                join_code,
                seen: row.updated_at,
                by: admin.user.clone(),
            },
        )
        .await
        .map_err(refused)?
        .ok_or_else(|| ApiError::WrongState {
            code: "class_changed",
            message: "the class changed (or ended, or was cancelled) while this change was \
                      made; read it again"
                .into(),
        })?;
    tracing::info!(class = %id, seats = changed.seats, starts_at = %changed.starts_at, ends_at = %changed.ends_at, admin = %admin.user, "class changed");
    Ok(Json(class_answer(&state, id).await?))
}

async fn cancel(
    State(state): State<AppState>,
    AdminUser(admin): AdminUser,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = class_id(&id)?;
    let env = &state.config().env;
    let row = state
        .store()
        .classes()
        .get(env, id)
        .await?
        .ok_or(ApiError::ClassNotFound)?;
    let now = state.store().db_now().await?;
    changeable(&row, now)?;
    state
        .store()
        .classes()
        .cancel(env, id, &admin.user)
        .await?
        .ok_or_else(|| ApiError::WrongState {
            code: "class_changed",
            message: "the class ended or was cancelled meanwhile".into(),
        })?;
    tracing::info!(class = %id, admin = %admin.user, "class cancelled; its members are ordinary members of the pool now");
    Ok(Json(class_answer(&state, id).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_checked_with_a_sentence_naming_the_rule() {
        assert!(seats(1).is_ok() && seats(500).is_ok());
        assert_eq!(
            seats(0).unwrap_err().to_string(),
            "a class needs at least 1 seat, got 0"
        );
        assert_eq!(
            seats(501).unwrap_err().to_string(),
            "a class has at most 500 seats, got 501"
        );
        assert_eq!(code(" alpha-7 ").unwrap(), "ALPHA-7");
        assert!(code("ab").is_err() && code("no spaces").is_err());
        assert!(title("").is_err() && title("a\tb").is_err());
        assert!(time("starts_at", "tomorrow").is_err());
        let t = time("starts_at", "2026-12-02T10:00:00+01:00").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-12-02T09:00:00+00:00");
        assert!(window(t, t).is_err());
        assert!(window(t, t + TimeDelta::hours(13)).is_err());
        assert!(window(t, t + TimeDelta::hours(12)).is_ok());
    }
}
