//! A pod lesson: one unprivileged Pod (no added capabilities, every default one dropped, no
//! privilege escalation, a non-root user) with `activeDeadlineSeconds` from the lifespan
//! policy, so it ends by itself even if nothing reclaims it. The session is running only
//! once the Pod is `Running` and ready (watched, within the lesson's readiness timeout);
//! grading runs the lesson's commands in its container through the cluster's pod exec.
//! [`provision`] walks the steps, which follow it in order, as a VM lesson's do.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, Pod, PodSecurityContext, PodSpec, ResourceRequirements,
    SeccompProfile, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use ttlab_cluster::PodWait;
use ttlab_lesson::Lesson;
use ttlab_model::labels::{self, ObjectLabels};
use ttlab_store::{DiskKind, Session, SessionVm, Stage};
use ttlab_vm_manifest::pod_name;

use super::steps::{self, record_stage};
use super::{Failure, Stop, create_object, with_db};
use crate::AppState;

/// The uid and gid the lab container runs as.
pub const LAB_UID: i64 = 1000;

/// Provisions a pod lesson's session, from its `starting` row to `running`.
pub(crate) async fn provision(state: &AppState, session: &Session) -> Result<(), Stop> {
    let lesson = steps::offered_lesson(state, session)?;
    let name = record_pod_name(state, session, &lesson).await?;
    create_pod(state, session, &lesson, &name).await?;
    wait_pod_running(state, session, &lesson, &name).await?;
    steps::mark_running(state, session).await
}

/// The Pod's name, recorded on the row (as its one "VM", with the container disk) before it
/// is created.
async fn record_pod_name(
    state: &AppState,
    session: &Session,
    lesson: &Lesson,
) -> Result<String, Stop> {
    let store = state.store();
    let node = lesson.nodes.first().clone();
    let name = pod_name(session.id, &node);
    with_db(|| async {
        store
            .sessions()
            .record_disk(session.id, DiskKind::Container, "pod")
            .await
    })
    .await?;
    let vms = [SessionVm {
        node,
        name: name.clone(),
    }];
    with_db(|| async { store.sessions().record_vms(session.id, &vms).await }).await?;
    Ok(name)
}

/// The lab Pod ([`lab_pod`]); the `vm_created` stage once it is.
async fn create_pod(
    state: &AppState,
    session: &Session,
    lesson: &Lesson,
    name: &str,
) -> Result<(), Stop> {
    let pod = lab_pod(state, session, lesson, name);
    let site = state.site_of(&session.site);
    create_object(state, session, "lab pod", || {
        site.cluster().create_pod(pod.clone())
    })
    .await?;
    record_stage(state, session, Stage::VmCreated).await?;
    Ok(())
}

/// The Pod running and ready within the lesson's readiness timeout (watched); the pod's
/// "VMI running" stage then: its container runs.
async fn wait_pod_running(
    state: &AppState,
    session: &Session,
    lesson: &Lesson,
    name: &str,
) -> Result<(), Stop> {
    let readiness = lesson.readiness_timeout;
    let waited = state
        .site_of(&session.site)
        .cluster()
        .wait_pod_running(name, readiness)
        .await
        .map_err(Failure::PodUnwatchable)?;
    match waited {
        PodWait::Running(_) => {}
        PodWait::Ended(s) => return Err(Failure::PodEnded(s.describe()).into()),
        PodWait::TimedOut { last, .. } => {
            return Err(Failure::PodTimedOut {
                within: readiness,
                seen: last.map(|s| s.describe()),
            }
            .into());
        }
    }
    record_stage(state, session, Stage::VmiRunning).await?;
    Ok(())
}

/// The name of the lab container in the Pod (exec and grading run there).
pub const LAB_CONTAINER: &str = "lab";

/// The lab Pod of a pod lesson.
pub fn lab_pod(state: &AppState, session: &Session, lesson: &Lesson, name: &str) -> Pod {
    let mut labels_map = ObjectLabels::new(
        session.id,
        state.config().env.clone(),
        lesson.id.clone(),
        Some(lesson.nodes.first().clone()),
    )
    .to_map();
    labels_map.insert(labels::COMPONENT.to_owned(), "pod".to_owned());
    let memory = Quantity(lesson.memory.as_str().to_owned());
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(labels_map),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            active_deadline_seconds: Some(state.config().policy.pod_active_deadline_seconds()),
            restart_policy: Some("Never".to_owned()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(LAB_UID),
                run_as_group: Some(LAB_UID),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_owned(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            containers: vec![Container {
                name: LAB_CONTAINER.to_owned(),
                image: Some(lesson.image.clone()),
                stdin: Some(true),
                tty: Some(true),
                resources: Some(ResourceRequirements {
                    requests: Some(BTreeMap::from([("memory".to_owned(), memory.clone())])),
                    limits: Some(BTreeMap::from([("memory".to_owned(), memory)])),
                    ..ResourceRequirements::default()
                }),
                security_context: Some(SecurityContext {
                    allow_privilege_escalation: Some(false),
                    privileged: Some(false),
                    run_as_non_root: Some(true),
                    capabilities: Some(Capabilities {
                        add: None,
                        drop: Some(vec!["ALL".to_owned()]),
                    }),
                    ..SecurityContext::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}
