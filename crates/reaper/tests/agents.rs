//! The reaper removes agent versions no VM uses: only its own environment's agent
//! ConfigMaps, never one a VM (of any environment) references, never one younger than the
//! minimum age or that a server recorded as seen within it; a dry run names them and deletes
//! nothing. On kube-sim and on the real control plane (the reaper as the shipped
//! `ttlab-reaper` ServiceAccount).

mod common;

use std::time::Duration;

use chrono::TimeDelta;
use common::{Harness, env};
use ttlab_cloudinit::AgentPayload;
use ttlab_cluster::{Kind, ProvisionCluster as _, ReaperCluster as _};
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_model::{SessionId, SessionStatus};
use ttlab_reaper::reap_once;
use ttlab_vm_manifest::{AgentDisk, SessionVms, render_with_agent};

macro_rules! on_both_backends {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn on_kube_sim() {
                super::$name(super::Harness::start().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn on_the_real_control_plane() {
                if let Some(h) = super::Harness::start_real().await {
                    super::$name(h).await;
                }
            }
        }
    };
}

fn payload(tag: &str) -> AgentPayload {
    AgentPayload::new(format!("\x7fELF agent build {tag}").as_bytes()).unwrap()
}

/// Creates the agent ConfigMap of `agent` as a server of `env_name` would.
async fn share(h: &Harness, env_name: &str, agent: &AgentPayload) {
    h.fixtures
        .ensure_config_map(agent.config_map(&env(env_name)))
        .await
        .expect("agent ConfigMap");
}

/// A VM of a live session of `env_name` mounting `agent`'s ConfigMap (the guest need not
/// start).
async fn vm_using(h: &Harness, env_name: &str, agent: &AgentPayload) {
    let session = h
        .open(
            env_name,
            SessionStatus::Running,
            TimeDelta::minutes(30),
            &["vm"],
        )
        .await;
    vm_of(h, env_name, agent, session.id).await;
}

/// A VM of session `session` of `env_name` mounting `agent`'s ConfigMap, whatever the rows say.
async fn vm_of(h: &Harness, env_name: &str, agent: &AgentPayload, session: SessionId) {
    let input = SessionVms {
        session,
        env: env(env_name),
        lesson: common::LESSON.parse().unwrap(),
        namespace: None,
        image: "quay.io/containerdisks/debian:12".into(),
        memory: "128Mi".into(),
        cores: 1,
        nodes: vec![common::node("vm")],
        disk: DiskDecision::ContainerDisk {
            reason: FallbackReason::NotRequested,
        },
        termination_grace_period_seconds: 0,
    };
    let disk = AgentDisk {
        config_map: agent.config_map_name(),
        volume_label: agent.volume_label().to_owned(),
    };
    let vm = render_with_agent(&input, &disk).unwrap().vms.remove(0);
    common::retry_quota(|| h.fixtures.create_vm(serde_json::to_value(&vm).unwrap()))
        .await
        .expect("VM");
}

async fn present(h: &Harness, agent: &AgentPayload) -> bool {
    h.fixtures
        .get(Kind::ConfigMap, &agent.config_map_name())
        .await
        .unwrap()
        .is_some()
}

on_both_backends!(only_unused_versions_of_this_environment_are_removed);
async fn only_unused_versions_of_this_environment_are_removed(h: Harness) {
    let (used, used_by_prod, unused, prods) = (
        payload("used"),
        payload("used-by-prod"),
        payload("unused"),
        payload("prod"),
    );
    share(&h, "dev", &used).await;
    share(&h, "dev", &used_by_prod).await;
    share(&h, "dev", &unused).await;
    share(&h, "prod", &prods).await;
    vm_using(&h, "dev", &used).await;
    // A prod VM may mount a ConfigMap a dev server created under the same name.
    vm_using(&h, "prod", &used_by_prod).await;

    let mut ctx = h.ctx("dev");
    ctx.settings.agent_min_age = Duration::ZERO;
    ctx.settings.dry_run = true;
    let report = reap_once(&ctx).await;
    let named = report.details();
    assert!(
        named.contains(&format!("ConfigMap/{}", unused.config_map_name())),
        "a dry run names it: {named}"
    );
    assert!(present(&h, &unused).await, "a dry run deletes nothing");

    ctx.settings.dry_run = false;
    let report = reap_once(&ctx).await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let removed: Vec<&str> = report
        .actions
        .iter()
        .filter(|a| a.subject.starts_with("ConfigMap/"))
        .map(|a| a.subject.as_str())
        .collect();
    assert_eq!(
        removed,
        [format!("ConfigMap/{}", unused.config_map_name())],
        "{report:?}"
    );
    assert!(!present(&h, &unused).await);
    assert!(present(&h, &used).await, "a dev VM uses it");
    assert!(present(&h, &used_by_prod).await, "a prod VM uses it");
    assert!(present(&h, &prods).await, "another environment's ConfigMap");
    // The prod reaper removes its own unused version, and nothing of dev.
    let mut prod = h.ctx("prod");
    prod.settings.agent_min_age = Duration::ZERO;
    reap_once(&prod).await;
    assert!(!present(&h, &prods).await);
    assert!(present(&h, &used).await && present(&h, &used_by_prod).await);
}

on_both_backends!(
    a_version_a_vm_mounts_or_a_server_is_about_to_use_is_kept_even_with_no_minimum_age
);
async fn a_version_a_vm_mounts_or_a_server_is_about_to_use_is_kept_even_with_no_minimum_age(
    h: Harness,
) {
    let (rowless, in_flight, unused) = (
        payload("rowless"),
        payload("in-flight"),
        payload("unused-too"),
    );
    for agent in [&rowless, &in_flight, &unused] {
        share(&h, "dev", agent).await;
    }
    // A VM no session row holds (a pool member's whose row is gone, or not written yet):
    // the cluster says it mounts the version, and that is what counts.
    vm_of(&h, "dev", &rowless, SessionId::new_random()).await;
    // A server recorded this version just now: it records it right before each VM create,
    // so a VM mounting it may be on its way.
    h.store
        .agent_versions()
        .seen(
            &env("dev"),
            &in_flight.config_map_name(),
            in_flight.digest(),
        )
        .await
        .unwrap();
    let mut ctx = h.ctx("dev");
    ctx.settings.agent_min_age = Duration::ZERO;
    ctx.settings.orphan_min_age = Duration::from_secs(3600);
    let report = reap_once(&ctx).await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(present(&h, &rowless).await, "a VM mounts it: {report:?}");
    assert!(
        present(&h, &in_flight).await,
        "a server is about to use it: {report:?}"
    );
    assert!(!present(&h, &unused).await, "nothing uses it: {report:?}");
}

/// A version a server saw within the minimum age is kept however old its ConfigMap is; one
/// whose ConfigMap is younger than the minimum age is kept too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_version_a_server_saw_recently_or_a_young_one_is_kept() {
    let h = Harness::start().await;
    let (seen, young, stale) = (payload("seen"), payload("young"), payload("stale"));
    let long_ago = h.now().await - TimeDelta::hours(3);
    for agent in [&seen, &stale] {
        let object = serde_json::to_value(agent.config_map(&env("dev"))).unwrap();
        let mut object = object;
        object["apiVersion"] = "v1".into();
        object["kind"] = "ConfigMap".into();
        object["metadata"]["namespace"] = common::NS.into();
        h.sim().create_backdated(object, long_ago).unwrap();
    }
    share(&h, "dev", &young).await;
    // The server of `seen` still runs: it recorded its version just now.
    h.store
        .agent_versions()
        .seen(&env("dev"), &seen.config_map_name(), seen.digest())
        .await
        .unwrap();
    let mut ctx = h.ctx("dev");
    ctx.settings.agent_min_age = Duration::from_secs(3600);
    let report = reap_once(&ctx).await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(
        present(&h, &seen).await,
        "seen by a server within the minimum age"
    );
    assert!(present(&h, &young).await, "younger than the minimum age");
    assert!(
        !present(&h, &stale).await,
        "old, unused, unseen: {report:?}"
    );
    assert_eq!(
        h.store
            .agent_versions()
            .list(&env("dev"))
            .await
            .unwrap()
            .len(),
        1,
        "only the version still seen is remembered"
    );
}
