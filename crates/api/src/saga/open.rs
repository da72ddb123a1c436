//! Steps ① and ②: the `starting` row, after the capacity check for VM lessons.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::TimeDelta;
use ttlab_lesson::Lesson;
use ttlab_lifespan::Lifespan;
use ttlab_model::{Runtime, SessionId, UserId};
use ttlab_store::{NewSession, Session, SessionTimes, StoreError};

use crate::{ApiError, AppState};

/// Opens a `starting` session of `lesson` for `user`: 409 `session_exists` if they have a
/// live one, 503 `capacity` if a VM lesson would pass the VM limit. Provisioning is not
/// started here (see [`super::spawn_provisioning`]).
pub async fn open_session(
    state: &AppState,
    user: &UserId,
    lesson: &Lesson,
) -> Result<Session, ApiError> {
    // Cheap early answer for a double click; the database's unique index decides anyway.
    if let Some(open) = state.store().sessions().live_for_user(user).await? {
        return Err(ApiError::SessionExists {
            lesson: open.lesson,
            session: open.id,
        });
    }
    let now = state.store().db_now().await?;
    let policy = &state.config().policy;
    let lifespan = Lifespan::open(now, policy);
    let wait = lesson.readiness_timeout + lesson.setup_timeout + state.config().readiness_margin;
    let new = NewSession {
        id: SessionId::new_random(),
        user: user.clone(),
        lesson: lesson.id.clone(),
        runtime: lesson.runtime,
        env: state.config().env.clone(),
        times: SessionTimes {
            started_at: lifespan.started_at,
            expires_at: lifespan.expires_at,
            max_expires_at: lifespan.max_expires_at(policy),
        },
        readiness_deadline: now + TimeDelta::from_std(wait).unwrap_or(TimeDelta::MAX),
    };
    let session = match lesson.runtime {
        Runtime::Pod => state.store().sessions().insert(&new).await?,
        Runtime::Vm => open_vm_session(state, lesson, &new).await?,
    };
    state
        .metrics()
        .opened
        .get_or_create(&crate::metrics::OpenedLabels {
            lesson: lesson.id.to_string(),
            runtime: lesson.runtime.as_str().to_owned(),
        })
        .inc();
    Ok(session)
}

async fn open_vm_session(
    state: &AppState,
    lesson: &Lesson,
    new: &NewSession,
) -> Result<Session, ApiError> {
    let _turn = state.capacity_turn().await;
    for _ in 0..3 {
        // Listed before the lock is taken and the rows are read (see `count_vms`).
        let listing = listed_vms(state).await;
        let guard = state.store().lock_capacity().await?;
        let limit = state.config().vm_limit;
        let needed = lesson.nodes.len();
        let count = match listing {
            Ok(listing) => count_vms(state, &listing).await,
            Err(e) => Err(e),
        };
        match count {
            Ok(count) if count + needed > limit => {
                guard.rollback().await?;
                state.metrics().capacity_rejections.inc();
                tracing::info!(count, limit, "VM limit reached");
                return Err(ApiError::Capacity { limit });
            }
            Ok(_) => {}
            // If the count cannot be read, do not block: the namespace quota still holds.
            Err(e) => tracing::warn!(error = %e, "cannot count live VMs; not limiting"),
        }
        match guard.insert_session(new).await {
            Ok(session) => return Ok(session),
            // The user's other session ended while this one was opened: try again.
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::Internal(
        "the user's sessions kept changing while one was opened".into(),
    ))
}

/// How old a listing of the namespace's VMs the capacity check may use.
const LISTING_MAX_AGE: Duration = Duration::from_secs(1);

/// The names of the VMs ttlab manages in the namespace (whatever their environment), from a
/// listing at most [`LISTING_MAX_AGE`] old, taken again when older.
async fn listed_vms(state: &AppState) -> Result<Arc<Vec<String>>, ApiError> {
    let mut cached = state.listed_vms().lock().await;
    if let Some((at, names)) = cached.as_ref()
        && at.elapsed() <= LISTING_MAX_AGE
    {
        return Ok(names.clone());
    }
    let selector = ttlab_model::labels::managed_selector();
    let listed = tokio::time::timeout(
        Duration::from_secs(5),
        state
            .cluster()
            .list_all(ttlab_cluster::Kind::VirtualMachine, &selector),
    )
    .await
    .map_err(|_| ApiError::ClusterUnavailable("listing VMs took longer than 5 s".into()))??;
    let names = Arc::new(listed.into_iter().map(|o| o.name).collect::<Vec<_>>());
    *cached = Some((tokio::time::Instant::now(), names.clone()));
    Ok(names)
}

/// Live VMs: the VMs that live sessions of every environment sharing this database hold or
/// are about to create (recorded names, else the lesson's nodes), plus every VM ttlab manages
/// in the namespace without such a session (ghosts, leftovers, the other environment's
/// objects hold memory too). A VM counted twice counts once.
///
/// A session's row is live from before its first VM is created until after its last is
/// deleted, so the database alone accounts for every session's VMs, whatever the age of the
/// listing; the listing (`listing`, taken before the database is read, at most a second
/// old) only adds VMs no live session accounts for, where a second's delay is harmless.
async fn count_vms(state: &AppState, listing: &[String]) -> Result<usize, ApiError> {
    let mut names: BTreeSet<String> = listing.iter().cloned().collect();
    let live = state.store().sessions().live_vm_sessions_all_envs().await?;
    for (id, lesson, vms) in live {
        if !vms.is_empty() {
            names.extend(vms);
            continue;
        }
        match state.config().lessons.get(&lesson) {
            Some(l) if !l.nodes.is_empty() => {
                for node in l.nodes.as_slice() {
                    names.insert(ttlab_vm_manifest::vm_name(id, node));
                }
            }
            // A lesson this server does not know (another environment's): one VM at least.
            _ => {
                names.insert(format!("unknown-lesson-{id}"));
            }
        }
    }
    Ok(names.len())
}
