//! Steps ① and ②: the `starting` row, after the capacity check for VM lessons.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::TimeDelta;
use ttlab_lesson::Lesson;
use ttlab_lifespan::Lifespan;
use ttlab_model::{Runtime, SessionId, SessionStatus, UserId};
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
        let guard = state.store().lock_capacity().await?;
        let limit = state.config().vm_limit;
        let needed = lesson.nodes.len();
        match count_vms(state).await {
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

/// Live VMs: every VM ttlab manages in the namespace (whatever its environment: ghosts and
/// the other environment's VMs hold memory too), plus the VMs that sessions still `starting`
/// — of every environment sharing this database — are about to create. A VM counted twice
/// (created, and planned) counts once.
///
/// The starting rows are read before the cluster is listed: a session that turns running in
/// between created its VM before the list, so it is listed; read the other way round, its
/// VM could be in neither.
async fn count_vms(state: &AppState) -> Result<usize, ApiError> {
    let mut names: BTreeSet<String> = BTreeSet::new();
    let mut after = None;
    loop {
        let page = state
            .store()
            .sessions()
            .list_in_status_all_envs(SessionStatus::Starting, after, 500)
            .await?;
        let Some(last) = page.last() else { break };
        after = Some(last.id);
        for s in page.iter().filter(|s| s.runtime == Runtime::Vm) {
            if s.vms.is_empty() {
                let nodes = super::nodes_of(state, s);
                if nodes.is_empty() {
                    names.insert(format!("unknown-lesson-{}", s.id));
                }
                for node in nodes {
                    names.insert(ttlab_vm_manifest::vm_name(s.id, &node));
                }
            } else {
                names.extend(s.vms.iter().map(|v| v.name.clone()));
            }
        }
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
    names.extend(listed.into_iter().map(|o| o.name));
    Ok(names.len())
}
