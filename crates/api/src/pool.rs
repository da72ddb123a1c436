//! Warm pools: "Start lab" for a pooled lesson claims a prepared member, and every replica
//! keeps the pools filled within the capacity headroom.
//!
//! A member is a session row held by no student (`pool_member`), opened under the capacity
//! lock like any VM session and provisioned by the normal saga (setup done, readiness marker
//! written). Its lifespan as a member is the pool's age limit, and the guest's hard deadline
//! follows from it, so the reaper expires an old member like any session, fails one stuck
//! preparing, and treats its objects as its environment's (never another's).
//!
//! **The claim** ([`claim`]) is one statement (`FOR UPDATE SKIP LOCKED`): two clicks, or two
//! replicas, never get the same member, and the one-live-session-per-student index still
//! decides. A scheduled class's student takes a member prepared for that class first; nobody
//! else takes one before the class ends ([`crate::classes`]). The lifespan starts at the claim. Then the member is handed over: through each
//! VM's agent the guest's hard deadline is re-armed to the session's hard cap plus the grace,
//! and the agent token is rotated (the token the member booted with stops working) and the new
//! one stored. A member that cannot be handed over is failed and reclaimed, never given
//! half-done, and the student gets the next member, or the cold path, in the same click.
//!
//! **The refiller** (the `pool_refill` task, [`crate::tasks`]) runs on every replica, every
//! 2 s and on change hints, calling [`refill`] for each VM lesson. For each pooled lesson it
//! takes the capacity lock, counts the VM places as a start does, lists the unclaimed members,
//! reads the scheduled classes (the environment's, sharing the headroom by seats, and the
//! lesson's lead time) and asks [`ttlab_pool::plan`] what to do (a lesson without a pool of
//! its own is tended while it has a class); it
//! opens at most one member per turn of the lock (so replicas take turns and never
//! over-fill), and retires what the plan retires. Places held for the waitlist, and the
//! reserve a cold start of the largest lesson needs, are never taken.
//!
//! **Sites.** Each member (class members too) is prepared on the site a start of its lesson
//! would be placed on at that turn (`member_site`: a site that carries the lesson's labels,
//! answers, and has room for the member beside the cold-start reserve; its golden disk ready
//! first, then the most free places, weighted), under that site's capacity lock and counted
//! against its VM limit. With one site, that site, as before sites existed.

use std::num::NonZeroU32;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use ttlab_lesson::Lesson;
use ttlab_model::{ClassId, FinalStatus, Runtime, SessionId, SessionStatus, UserId};
use ttlab_pool::{Capacity, Demand, Forecast, Member, Plan, PlanInput, PoolSettings, RetireReason};
use ttlab_store::{NewPoolMember, PoolClaim, Session, SessionTimes};

use crate::agent_route::{NoAgent, agent_client};
use crate::classes::CurrentClasses;
use crate::metrics::LessonLabels;
use crate::saga::{self, with_db};
use crate::sites::SiteRuntime;
use crate::{ApiError, AppState};

/// How long the hand-over of a claimed member may take, per VM.
const HAND_OVER_WITHIN: Duration = Duration::from_secs(5);

/// How many members one click may claim when hand-overs fail, before it goes the cold way.
pub(crate) const CLAIM_ATTEMPTS: usize = 3;

/// Where a pool's settings come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SettingsSource {
    /// The lesson file's `pool:` section.
    Lesson,
    /// An operator's override (`PUT /api/admin/pools/{lesson}`).
    Admin,
}

/// The settings a VM lesson's pool runs with: an operator's override if there is one, else
/// the lesson file's. `None` for a lesson without a pool (and for pod lessons).
pub(crate) async fn settings_of(
    state: &AppState,
    lesson: &Lesson,
) -> Result<Option<(PoolSettings, SettingsSource)>, ApiError> {
    if lesson.runtime != Runtime::Vm {
        return Ok(None);
    }
    let overridden = state
        .store()
        .pools()
        .get(&state.config().env, &lesson.id)
        .await?;
    settings_with(lesson, overridden.as_ref().map(|p| &p.settings))
}

/// [`settings_of`] from an override already read.
pub(crate) fn settings_with(
    lesson: &Lesson,
    overridden: Option<&ttlab_store::PoolSettings>,
) -> Result<Option<(PoolSettings, SettingsSource)>, ApiError> {
    if lesson.runtime != Runtime::Vm {
        return Ok(None);
    }
    match (overridden, lesson.pool.as_ref()) {
        (Some(o), _) => Ok(Some((from_store(o)?, SettingsSource::Admin))),
        (None, Some(spec)) => Ok(Some((
            PoolSettings::try_from(spec)
                .map_err(|e| ApiError::Internal(format!("the pool of {}: {e}", lesson.id)))?,
            SettingsSource::Lesson,
        ))),
        (None, None) => Ok(None),
    }
}

pub(crate) fn from_store(s: &ttlab_store::PoolSettings) -> Result<PoolSettings, ApiError> {
    let max_age = TimeDelta::from_std(s.max_age)
        .map_err(|_| ApiError::Internal("a pool's age limit is out of range".into()))?;
    Ok(PoolSettings::new(s.min, s.size, s.max, max_age)
        .map_err(|e| ApiError::Internal(format!("stored pool settings: {e}")))?
        .with_demand(s.demand_driven)
        .with_paused(s.paused))
}

/// "Start lab" on a pooled lesson: the longest-ready member, claimed for `user` and handed
/// over; for a student of `class`, a member prepared for that class first (a lesson without a
/// pool of its own has members while it has a class). `Ok(None)`: the lesson has no pool and
/// the user is no class's student, or no member is ready (a miss: open the session the cold
/// way, with no extra wait).
///
/// When no member is ready, a member still being prepared and younger than the lesson's 90th
/// percentile of preparations is claimed (see [`preparing_within`]): the session is
/// `starting` for the student, with the member's own stages, and its provisioner hands it
/// over when it is ready.
///
/// A member whose hand-over fails is released from the student, failed and reclaimed, and the
/// next ready member is claimed in its place, at most [`CLAIM_ATTEMPTS`] times; after that,
/// or when none is left, the start goes the cold way. The student never sees the failure.
pub(crate) async fn claim(
    state: &AppState,
    user: &UserId,
    lesson: &Lesson,
    class: Option<ClassId>,
) -> Result<Option<Session>, ApiError> {
    if class.is_none() && settings_of(state, lesson).await?.is_none() {
        return Ok(None);
    }
    let policy = &state.config().policy;
    let request = PoolClaim {
        env: state.config().env.clone(),
        lesson: lesson.id.clone(),
        user: user.clone(),
        ttl: policy.ttl,
        max: policy.max,
        class,
        preparing_within: preparing_within(state, lesson).await?,
    };
    let labels = LessonLabels {
        lesson: lesson.id.to_string(),
    };
    let metrics = state.metrics();
    for _ in 0..CLAIM_ATTEMPTS {
        let Some(session) = state.store().sessions().claim_pool_member(&request).await? else {
            metrics.pool_misses.get_or_create(&labels).inc();
            return Ok(None);
        };
        if session.status == SessionStatus::Starting {
            // Still being prepared: its provisioner hands it over when it is ready.
            metrics.pool_claims.get_or_create(&labels).inc();
            tracing::info!(session = %session.id, %user, lesson = %lesson.id, class = ?class, "claimed a pool member still being prepared");
            return Ok(Some(session));
        }
        let why = match hand_over(state, &session).await {
            Ok(()) => {
                metrics.pool_claims.get_or_create(&labels).inc();
                tracing::info!(session = %session.id, %user, lesson = %lesson.id, class = ?class, "claimed a prepared lab from the pool");
                return Ok(Some(session));
            }
            Err(why) => why,
        };
        metrics.pool_handover_failures.get_or_create(&labels).inc();
        tracing::warn!(session = %session.id, error = %why, "a claimed pool member could not be handed over; failing it and trying the next");
        let reason = format!("the prepared lab could not be handed over: {why}");
        if !saga::release_failed_claim(state, &session, &reason).await? {
            // Someone else is ending it (the reaper, an operator): it is still the student's
            // until it is gone, as after a double click.
            return Err(ApiError::SessionExists {
                lesson: session.lesson.clone(),
                session: session.id,
            });
        }
    }
    tracing::warn!(lesson = %lesson.id, attempts = CLAIM_ATTEMPTS, "no claimed member could be handed over; starting cold");
    metrics.pool_misses.get_or_create(&labels).inc();
    Ok(None)
}

/// How young a member still being prepared must be to be claimed when none is ready: the
/// 90th percentile of the lesson's recent preparations. A member created since is expected
/// ready sooner than a fresh start (which takes a whole preparation); an older one may be
/// stuck. `None` (ready members only) while no preparation is measured.
async fn preparing_within(state: &AppState, lesson: &Lesson) -> Result<Option<Duration>, ApiError> {
    let durations = state
        .store()
        .classes()
        .prepare_durations(&state.config().env, &lesson.id)
        .await?;
    let seconds = durations.iter().map(Duration::as_secs_f64).collect();
    Ok(crate::view::ExpectedView::from_seconds(seconds)
        .and_then(|e| Duration::try_from_secs_f64(e.p90_seconds).ok()))
}

/// Re-arms each guest's hard deadline for the session and rotates its agent token, through
/// its agent (authenticated with the token it booted with), storing each new token.
pub(crate) async fn hand_over(state: &AppState, session: &Session) -> Result<(), String> {
    let grace = TimeDelta::from_std(state.config().policy.hard_deadline_grace)
        .map_err(|_| "the hard-deadline grace is out of range".to_owned())?;
    let power_off_at = session
        .max_expires_at
        .checked_add_signed(grace)
        .ok_or_else(|| "the hard deadline is out of range".to_owned())?;
    let site = &state.site_of(&session.site);
    let each = session.vms.iter().map(|vm| async move {
        tokio::time::timeout(
            HAND_OVER_WITHIN,
            hand_over_vm(state, site, session.id, vm, power_off_at),
        )
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "{}: no answer within {HAND_OVER_WITHIN:?}",
                vm.node
            ))
        })
    });
    futures::future::try_join_all(each).await.map(|_| ())
}

async fn hand_over_vm(
    state: &AppState,
    site: &SiteRuntime,
    session: SessionId,
    vm: &ttlab_store::SessionVm,
    power_off_at: DateTime<Utc>,
) -> Result<(), String> {
    let node = &vm.node;
    let old = saga::agent_token(state, session, node)
        .await
        .map_err(|e| format!("{node}: {e}"))?;
    let new = crate::saga::fresh_token().map_err(|e| format!("{node}: {e}"))?;
    let client = agent_client(state, site, &vm.name, None, old)
        .await
        .map_err(|e| match e {
            NoAgent::NoAddress => format!("{node}: the VM has no address"),
            e => format!("{node}: {e}"),
        })?
        .with_timeouts(Duration::from_secs(2), Duration::from_secs(3));
    client
        .set_deadline(power_off_at.into())
        .await
        .map_err(|e| format!("{node}: re-arming the hard deadline: {e}"))?;
    client
        .rotate_token(&new)
        .await
        .map_err(|e| format!("{node}: rotating the agent token: {e}"))?;
    let stored = with_db(|| async {
        state
            .store()
            .agent_tokens()
            .replace(session, node, new.reveal())
            .await
    })
    .await
    .map_err(|e| format!("{node}: storing the rotated agent token: {e}"))?;
    if !stored {
        return Err(format!("{node}: the session ended during the hand-over"));
    }
    Ok(())
}

/// The VM places of the largest VM lesson: what a cold start may need, and the pools leave.
pub(crate) fn cold_reserve(state: &AppState) -> u32 {
    state
        .config()
        .lessons
        .iter()
        .filter(|l| l.runtime == Runtime::Vm)
        .map(|l| u32::try_from(l.nodes.len()).unwrap_or(u32::MAX))
        .max()
        .unwrap_or(1)
}

/// One round for one pooled lesson: plan under the capacity lock, open at most one member per
/// turn of the lock (again while the plan wants more), and retire what the first plan
/// retires. A VM lesson without a pool of its own is tended while it has a current class (its
/// pool is then the class's members alone), or while members are left (its pool was taken
/// away, or its class is over: they are surplus).
pub(crate) async fn refill(
    state: &AppState,
    lesson: &Lesson,
    overridden: Option<&ttlab_store::PoolSettings>,
) -> Result<(), ApiError> {
    let env = &state.config().env;
    let settings = match settings_with(lesson, overridden)? {
        Some((settings, _)) => settings,
        None => {
            let members = state.store().pools().members(env, &lesson.id).await?;
            if members.is_empty() {
                let now = state.store().db_now().await?;
                let classes = state.store().classes().current(env, now).await?;
                if !classes.iter().any(|c| c.lesson == lesson.id) {
                    return Ok(());
                }
            }
            PoolSettings::new(0, 0, 0, ttlab_pool::DEFAULT_MAX_AGE)
                .map_err(|e| ApiError::Internal(format!("an empty pool: {e}")))?
        }
    };
    let labels = LessonLabels {
        lesson: lesson.id.to_string(),
    };
    // Members are prepared on the sites that carry the lesson's site labels: each on the
    // one a start of the lesson would be placed on now.
    let allowed: u32 = state
        .sites()
        .iter()
        .filter(|s| lesson.site_labels.is_subset(&s.site().labels))
        .map(|s| u32::try_from(s.vm_limit()).unwrap_or(u32::MAX))
        .fold(0, u32::saturating_add);
    if allowed == 0 {
        tracing::warn!(lesson = %lesson.id, labels = ?lesson.site_labels, "no site carries the lesson's site labels: its pool prepares nothing");
        return Ok(());
    }
    let mut retired = false;
    // Each turn opens one member: the pool's own (at most `max`) and its classes' (at most
    // the VM limits of the sites it may use) bound the turns.
    for _ in 0..=settings.max().saturating_add(allowed) {
        let site = member_site(state, lesson).await?;
        let site = site.as_ref();
        let limit = u32::try_from(site.vm_limit()).unwrap_or(u32::MAX);
        let _turn = site.capacity_turn().await;
        let listing = saga::listed_vms(site).await?;
        let guard = state.store().lock_capacity_of_site(site.name()).await?;
        let usage = saga::count_vms(state, site, &listing).await?;
        let members = state.store().pools().members(env, &lesson.id).await?;
        let now = state.store().db_now().await?;
        let demand = if settings.demand_driven() {
            Some(demand_of(state, lesson, now).await?)
        } else {
            None
        };
        // Students waiting for a place come first: while anybody waits, the pools take no
        // place and give theirs back.
        let waitlist = state.store().waitlist().list().await?;
        let waiting_elsewhere = waitlist.iter().filter(|w| w.lesson != lesson.id).count();
        let member_nodes = nodes_of(lesson);
        let retiring: u32 = members
            .iter()
            .filter(|m| m.status == SessionStatus::Finishing)
            .map(|m| u32::try_from(m.vms.len().max(lesson.nodes.len())).unwrap_or(u32::MAX))
            .sum();
        let capacity = Capacity {
            limit,
            alive: u32::try_from(usage.total()).unwrap_or(u32::MAX),
            starting: 0,
            retiring,
            reserve: if waitlist.is_empty() {
                cold_reserve(state)
            } else {
                limit
            },
        };
        let classes = CurrentClasses::read(state, now).await?;
        let input = PlanInput {
            now,
            settings,
            member_nodes,
            members: members
                .iter()
                .filter(|m| m.status != SessionStatus::Finishing)
                .map(|m| Member {
                    id: m.id,
                    created_at: m.created_at,
                    ready_at: (m.status == SessionStatus::Running)
                        .then_some(m.ready_at.unwrap_or(m.created_at)),
                    nodes: member_nodes,
                    class: m.class,
                })
                .collect(),
            capacity,
            demand,
            stuck_after: TimeDelta::from_std(
                lesson.readiness_timeout + lesson.setup_timeout + state.config().readiness_margin,
            )
            .unwrap_or(TimeDelta::MAX),
            classes: classes.of_lesson(&lesson.id),
            lead_time: classes.lead_of(&lesson.id),
            sharing: Some(classes.sharing(now, capacity.free(), capacity.reserve)),
            waiting_elsewhere: u32::try_from(waiting_elsewhere).unwrap_or(u32::MAX),
        };
        let plan: Plan = ttlab_pool::plan(&input);
        let ready = input.members.iter().filter(|m| m.is_ready()).count();
        let metrics = state.metrics();
        metrics
            .pool_ready
            .get_or_create(&labels)
            .set(i64::try_from(ready).unwrap_or(i64::MAX));
        metrics
            .pool_preparing
            .get_or_create(&labels)
            .set(i64::try_from(input.members.len() - ready).unwrap_or(i64::MAX));
        metrics
            .pool_target
            .get_or_create(&labels)
            .set(i64::from(plan.target));
        state.record_pool_plan(&lesson.id, &plan);
        if plan.create == 0 {
            guard.rollback().await?;
            if !retired {
                retire(state, &members, &plan.retire).await;
            }
            return Ok(());
        }
        // The classes' members first, in the plan's order; then the pool's own.
        let class = plan.create_for.first().map(|(class, _)| *class);
        let member = guard
            .insert_pool_member(&new_member(state, site, lesson, &settings, now, class))
            .await?;
        metrics.pool_refills.get_or_create(&labels).inc();
        tracing::info!(session = %member.id, lesson = %lesson.id, class = ?class, why = %plan.why, "preparing a pool member");
        saga::spawn_provisioning(state, member);
        if !retired {
            retired = true;
            retire(state, &members, &plan.retire).await;
        }
    }
    Ok(())
}

/// Where `lesson`'s pool prepares its next member. One site: that site. Several: the site a
/// start of the lesson would be placed on now ([`ttlab_site::place`]: among the sites that
/// carry its labels and answer, with room for a member beside the places kept for a cold
/// start, its golden disk ready first, then the most free places, weighted), else the first
/// site that carries its labels (its plan then finds no room there). Call it only when a
/// site carries them.
async fn member_site(
    state: &AppState,
    lesson: &Lesson,
) -> Result<std::sync::Arc<SiteRuntime>, ApiError> {
    let fallback = || {
        state
            .pool_site(lesson)
            .unwrap_or_else(|| state.first_site())
            .clone()
    };
    if state.sites().len() == 1 {
        return Ok(fallback());
    }
    let (mut states, _) = saga::site_states(state, lesson, 0).await?;
    let reserve = cold_reserve(state);
    for s in &mut states {
        s.vms_needed = s.vms_needed.saturating_add(reserve);
    }
    let placement = ttlab_site::place(&saga::wanted_of(lesson), &states);
    tracing::debug!(lesson = %lesson.id, %placement, "where the pool prepares");
    Ok(placement
        .site()
        .map_or_else(fallback, |chosen| state.site_of(chosen)))
}

fn nodes_of(lesson: &Lesson) -> NonZeroU32 {
    NonZeroU32::new(u32::try_from(lesson.nodes.len()).unwrap_or(u32::MAX))
        .unwrap_or(NonZeroU32::MIN)
}

/// A new member of `lesson`'s pool (prepared for `class`, if given): its lifespan as a member
/// is the pool's age limit, and it has the lesson's readiness deadline, like a cold session.
fn new_member(
    state: &AppState,
    site: &crate::sites::SiteRuntime,
    lesson: &Lesson,
    settings: &PoolSettings,
    now: DateTime<Utc>,
    class: Option<ClassId>,
) -> NewPoolMember {
    let expires = now.checked_add_signed(settings.max_age()).unwrap_or(now);
    let wait = lesson.readiness_timeout + lesson.setup_timeout + state.config().readiness_margin;
    NewPoolMember {
        id: SessionId::new_random(),
        lesson: lesson.id.clone(),
        runtime: lesson.runtime,
        env: state.config().env.clone(),
        site: site.name().clone(),
        times: SessionTimes {
            started_at: now,
            expires_at: expires,
            max_expires_at: expires,
        },
        readiness_deadline: now + TimeDelta::from_std(wait).unwrap_or(TimeDelta::MAX),
        class,
    }
}

/// The recent starts of `lesson`, for a demand-driven size.
async fn demand_of(
    state: &AppState,
    lesson: &Lesson,
    now: DateTime<Utc>,
) -> Result<Demand, ApiError> {
    let refill = state
        .store()
        .pools()
        .counts(&state.config().env, &lesson.id)
        .await?
        .median_refill
        .and_then(|d| TimeDelta::from_std(d).ok())
        .filter(|d| *d > TimeDelta::zero())
        .unwrap_or(ttlab_pool::DEFAULT_REFILL_TIME);
    let forecast = Forecast::new(refill, ttlab_pool::DEFAULT_RECENT_WINDOW)
        .or_else(|_| {
            Forecast::new(
                ttlab_pool::DEFAULT_REFILL_TIME,
                ttlab_pool::DEFAULT_RECENT_WINDOW,
            )
        })
        .map_err(|e| ApiError::Internal(format!("demand forecast: {e}")))?;
    let env = &state.config().env;
    let windows = forecast.windows(now);
    let mut starts = Vec::new();
    for w in [windows.recent, windows.day_before, windows.week_before]
        .into_iter()
        .flatten()
    {
        starts.extend(
            state
                .store()
                .pools()
                .starts_between(env, &lesson.id, w.start, w.end)
                .await?,
        );
    }
    // Before the oldest session the database holds, nothing is known (not "nobody started").
    let recorded_since = state
        .store()
        .pools()
        .history_since(env)
        .await?
        .unwrap_or(now);
    Ok(Demand {
        forecast,
        starts,
        recorded_since,
    })
}

/// Retires members as the plan says: each is ended like a student's finish (a provisioner
/// still at work is waited for), as `expired` (too old, surplus, places needed) or `failed`
/// (stuck preparing).
async fn retire(state: &AppState, members: &[Session], retire: &[(SessionId, RetireReason)]) {
    for (id, reason) in retire {
        let Some(member) = members.iter().find(|m| m.id == *id) else {
            continue;
        };
        let (to, why) = match reason {
            RetireReason::TooOld => (
                FinalStatus::Expired,
                "retired from the pool: older than its age limit",
            ),
            RetireReason::Surplus => (
                FinalStatus::Expired,
                "retired from the pool: more members than its size (or its class's seats)",
            ),
            RetireReason::CapacityShort => (
                FinalStatus::Expired,
                "retired from the pool: its places are needed",
            ),
            RetireReason::StuckPreparing => (
                FinalStatus::Failed,
                "retired from the pool: its preparation did not finish in time",
            ),
        };
        state
            .metrics()
            .pool_retired
            .get_or_create(&crate::metrics::RetireLabels {
                lesson: member.lesson.to_string(),
                reason: reason.as_str().to_owned(),
            })
            .inc();
        tracing::info!(session = %id, reason = reason.as_str(), "retiring a pool member");
        if let Err(e) = saga::end_live(state, member, to, Some(why)).await {
            tracing::warn!(session = %id, error = %e, "cannot retire the pool member now");
        }
    }
}
