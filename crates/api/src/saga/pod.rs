//! A pod lesson: one unprivileged Pod (no added capabilities, every default one dropped, no
//! privilege escalation, a non-root user) with `activeDeadlineSeconds` from the lifespan
//! policy, so it ends by itself even if nothing reclaims it. The session is running only
//! once the Pod is `Running` and ready (watched, within the lesson's readiness timeout);
//! grading runs the lesson's commands in its container through the cluster's pod exec.

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

use super::{Stop, with_db};
use crate::AppState;

/// The uid and gid the lab container runs as.
pub const LAB_UID: i64 = 1000;

pub(crate) async fn provision(state: &AppState, session: &Session) -> Result<(), Stop> {
    let lesson = state
        .config()
        .lessons
        .get(&session.lesson)
        .cloned()
        .ok_or_else(|| {
            Stop::Failed(format!(
                "the lesson {} is no longer offered",
                session.lesson
            ))
        })?;
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
        node: node.clone(),
        name: name.clone(),
    }];
    with_db(|| async { store.sessions().record_vms(session.id, &vms).await }).await?;
    let pod = lab_pod(state, session, &lesson, &name);
    super::create_object(state, session, "lab pod", || {
        state.cluster().create_pod(pod.clone())
    })
    .await?;
    super::record_stage(state, session, Stage::VmCreated).await?;

    // Running only once the Pod runs and is ready, within the lesson's readiness timeout.
    let readiness = lesson.readiness_timeout;
    let waited = state
        .cluster()
        .wait_pod_running(&name, readiness)
        .await
        .map_err(|e| Stop::Failed(format!("could not watch the lab pod start: {e}")))?;
    match waited {
        PodWait::Running(_) => {}
        PodWait::Ended(s) => {
            return Err(Stop::Failed(format!(
                "the lab pod stopped before it was ready ({})",
                s.describe()
            )));
        }
        PodWait::TimedOut { last, .. } => {
            let seen = last.map(|s| format!(" (last seen: {})", s.describe()));
            return Err(Stop::Failed(format!(
                "lab pod did not start within {} s{}",
                readiness.as_secs(),
                seen.unwrap_or_default()
            )));
        }
    }
    // The pod's "VMI running" stage: its container runs.
    super::record_stage(state, session, Stage::VmiRunning).await?;
    match with_db(|| async { store.sessions().mark_running(session.id, None).await }).await? {
        Some(_) => Ok(()),
        None => Err(Stop::Superseded),
    }
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
