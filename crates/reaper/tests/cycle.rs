//! `reap_once` against a real PostgreSQL and, over HTTP, kube-sim and the real control plane
//! (the reaper running as the shipped `ttlab-reaper` ServiceAccount): the three directions, the
//! two incidents of the operators' write-up, the orphan re-read, dry runs. Tests that inject
//! faults (a failing delete, an unlistable cluster) or backdate objects need kube-sim.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::TimeDelta;
use common::{Harness, node};
use ttlab_cluster::{CapacityCluster as _, Kind, ProvisionCluster as _, ReaperCluster as _};
use ttlab_kube_sim::{FaultRule, Verb};
use ttlab_model::{SessionId, SessionStatus};
use ttlab_reaper::{ReaperSettings, delete_orphans, find_orphans, reap_once, reap_sessions};
use ttlab_store::Direction;
use ttlab_vm_manifest::{secret_name, vm_name};

/// Runs the test body `$name(h)` twice: on kube-sim (`$name::on_kube_sim`) and on the real
/// control plane with the shipped Roles (`$name::on_the_real_control_plane`).
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

fn minutes(n: i64) -> TimeDelta {
    TimeDelta::minutes(n)
}

on_both_backends!(an_expired_session_is_reclaimed_and_its_unowned_secret_deleted_by_name);
async fn an_expired_session_is_reclaimed_and_its_unowned_secret_deleted_by_name(h: Harness) {
    let expired = h
        .open("dev", SessionStatus::Running, minutes(-1), &["vm"])
        .await;
    h.create_vms("dev", expired.id, &["vm"], false).await;
    let live = h
        .open("dev", SessionStatus::Running, minutes(30), &["vm"])
        .await;
    h.create_vms("dev", live.id, &["vm"], true).await;

    let report = reap_once(&h.ctx("dev")).await;
    assert!(report.ran());
    assert_eq!(
        (report.expired.done, report.expired.failed),
        (1, 0),
        "{report:?}"
    );
    let row = h.store.sessions().get(expired.id).await.unwrap().unwrap();
    assert_eq!(row.status, SessionStatus::Expired);
    assert!(row.reclaimed_at.is_some(), "reclaimed_at is recorded");
    assert!(!h.vm_alive(expired.id, "vm").await);
    // No owner link: only the explicit deletion by name removes it.
    let secret = secret_name(expired.id, &node("vm"));
    assert!(
        h.fixtures
            .get(Kind::Secret, &secret)
            .await
            .unwrap()
            .is_none()
    );
    // The live session is untouched.
    assert_eq!(h.status(live.id).await, SessionStatus::Running);
    assert!(h.vm_alive(live.id, "vm").await && h.secret_alive(live.id, "vm").await);
    assert_eq!(report.orphans.done, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn incident_2_one_failing_delete_holds_back_nothing_else() {
    let h = Harness::start().await;
    let mut sessions = Vec::new();
    for _ in 0..6 {
        let s = h
            .open("dev", SessionStatus::Running, minutes(-2), &["vm"])
            .await;
        h.create_vms("dev", s.id, &["vm"], true).await;
        sessions.push(s.id);
    }
    let bad = sessions[2];
    let fault = h.sim().faults().add(
        FaultRule::fail(Some(Verb::Delete), Some("virtualmachines"), 500)
            .named(&vm_name(bad, &node("vm"))),
    );
    let ctx = h.ctx("dev");
    for round in 0..3 {
        let report = reap_once(&ctx).await;
        if round == 0 {
            assert_eq!(
                (report.expired.done, report.expired.failed),
                (5, 1),
                "{report:?}"
            );
        } else {
            // Retried from `finishing` every cycle, failing the same way, alone.
            assert_eq!(
                (report.stuck.done, report.stuck.failed),
                (0, 1),
                "{report:?}"
            );
        }
        assert!(report.errors.iter().any(|e| e.subject == bad.to_string()));
        for &id in &sessions {
            let status = h.status(id).await;
            if id == bad {
                assert_eq!(
                    status,
                    SessionStatus::Finishing,
                    "the failing row stays live"
                );
                assert!(h.vm_alive(id, "vm").await);
            } else {
                assert_eq!(status, SessionStatus::Expired);
                assert!(!h.vm_alive(id, "vm").await);
            }
        }
    }
    assert!(h.sim().faults().remove(fault));
    let report = reap_once(&ctx).await;
    assert_eq!(
        (report.stuck.done, report.stuck.failed),
        (1, 0),
        "{report:?}"
    );
    assert_eq!(h.status(bad).await, SessionStatus::Expired);
    assert!(!h.vm_alive(bad, "vm").await);
}

on_both_backends!(incident_1_dev_and_prod_reapers_never_delete_each_others_objects);
async fn incident_1_dev_and_prod_reapers_never_delete_each_others_objects(h: Harness) {
    // Far more VMs than the shipped quota allows live at once here: this is about who deletes
    // what, not about capacity.
    h.raise_vm_quota(200).await;
    let dev = h.ctx("dev");
    let prod = h.ctx("prod");
    // Names of every object each environment created, by environment.
    let mut names: [BTreeSet<String>; 2] = [BTreeSet::new(), BTreeSet::new()];
    // An unlabelled VM-like Secret nobody may touch.
    h.fixtures
        .create_secret(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "handmade"},
                "stringData": {"userdata": "#cloud-config\n{}\n"}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let mut seed: u64 = 0x5eed_1234;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..8 {
        for (i, env_name) in ["dev", "prod"].into_iter().enumerate() {
            for _ in 0..3 {
                let nodes: &[&str] = if next() % 2 == 0 {
                    &["vm"]
                } else {
                    &["a", "b"]
                };
                let id = match next() % 4 {
                    // Live, expired, starting, or objects without any row (orphans).
                    0 => {
                        h.open(env_name, SessionStatus::Running, minutes(30), nodes)
                            .await
                            .id
                    }
                    1 => {
                        h.open(env_name, SessionStatus::Running, minutes(-1), nodes)
                            .await
                            .id
                    }
                    2 => {
                        h.open(env_name, SessionStatus::Starting, minutes(5), nodes)
                            .await
                            .id
                    }
                    _ => SessionId::new_random(),
                };
                h.create_vms(env_name, id, nodes, next() % 2 == 0).await;
                for n in nodes {
                    names[i].insert(vm_name(id, &node(n)));
                    names[i].insert(secret_name(id, &node(n)));
                }
                names[i].insert(ttlab_vm_manifest::service_name(id));
                names[i].insert(ttlab_vm_manifest::network_policy_name(id));
            }
        }
        for (i, ctx) in [&dev, &prod].into_iter().enumerate() {
            let mark = h.mark();
            let report = reap_once(ctx).await;
            assert!(report.ran() && report.cluster_listed, "{report:?}");
            let deletes: Vec<String> = h
                .reaper_calls_since(mark)
                .into_iter()
                .filter(|c| c.verb == "delete")
                .filter_map(|c| c.name)
                .collect();
            for name in &deletes {
                assert!(
                    names[i].contains(name),
                    "round {round}: the {} reaper deleted {name}, not its own",
                    ctx.env
                );
                assert!(!names[1 - i].contains(name));
            }
        }
    }
    assert!(h.alive(Kind::Secret, "handmade").await);
    // Every live session of either environment still has its VMs.
    for env_name in ["dev", "prod"] {
        let live = h
            .store
            .sessions()
            .list_in_status(&common::env(env_name), SessionStatus::Running, None, 1000)
            .await
            .unwrap();
        for s in live {
            for vm in &s.vms {
                assert!(
                    h.alive(Kind::VirtualMachine, &vm.name).await,
                    "{} lost {}",
                    env_name,
                    vm.name
                );
            }
        }
    }
}

on_both_backends!(a_session_opened_after_the_listing_is_not_an_orphan);
async fn a_session_opened_after_the_listing_is_not_an_orphan(h: Harness) {
    let ctx = h.ctx("dev");
    let late = SessionId::new_random();
    let stray = SessionId::new_random();
    h.create_vms("dev", late, &["vm"], true).await;
    h.create_vms("dev", stray, &["vm"], true).await;

    let candidates = find_orphans(&ctx).await.unwrap();
    let sessions: BTreeSet<SessionId> = candidates.iter().map(|c| c.session).collect();
    assert_eq!(sessions, BTreeSet::from([late, stray]));

    // Between the listing and the deletion, the server opens the session `late` belongs to.
    let now = h.now().await;
    h.store
        .sessions()
        .insert(&ttlab_store::NewSession {
            id: late,
            user: ttlab_model::UserId::new("late-student").unwrap(),
            lesson: common::LESSON.parse().unwrap(),
            runtime: ttlab_model::Runtime::Vm,
            env: common::env("dev"),
            site: "default".parse().unwrap(),
            times: ttlab_store::SessionTimes {
                started_at: now,
                expires_at: now + minutes(60),
                max_expires_at: now + minutes(180),
            },
            readiness_deadline: now + minutes(5),
        })
        .await
        .unwrap();

    let report = delete_orphans(&ctx, candidates).await.unwrap();
    assert_eq!(
        report.orphans.done, 2,
        "the stray VM and Secret: {report:?}"
    );
    assert!(h.vm_alive(late, "vm").await && h.secret_alive(late, "vm").await);
    assert!(!h.vm_alive(stray, "vm").await && !h.secret_alive(stray, "vm").await);
}

on_both_backends!(a_long_running_reaper_reads_vms_and_secrets_from_its_watch_and_sees_new_orphans);
async fn a_long_running_reaper_reads_vms_and_secrets_from_its_watch_and_sees_new_orphans(
    h: Harness,
) {
    let live = h
        .open("dev", SessionStatus::Running, minutes(30), &["vm"])
        .await;
    h.create_vms("dev", live.id, &["vm"], true).await;
    let ctx = h.ctx("dev").with_cached_listings(Duration::from_secs(300));
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while !ctx.cached_listings_ready() {
        assert!(
            tokio::time::Instant::now() < until,
            "the listings did not fill in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A cycle with nothing to do lists neither VMs nor Secrets: it reads them from the watch.
    let mark = h.mark();
    let report = reap_once(&ctx).await;
    assert!(report.ran() && report.cluster_listed, "{report:?}");
    assert_eq!(report.orphans.done + report.ghosts.done, 0, "{report:?}");
    let listed: Vec<_> = h
        .reaper_calls_since(mark)
        .into_iter()
        .filter(|c| {
            c.verb == "list" && ["virtualmachines", "secrets"].contains(&c.resource.as_str())
        })
        .collect();
    assert!(listed.is_empty(), "the no-op cycle listed {listed:?}");
    // Objects left behind after the listings filled reach the reaper through the watch.
    let stray = SessionId::new_random();
    h.create_vms("dev", stray, &["vm"], true).await;
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut deleted = 0;
    while deleted < 2 {
        assert!(
            tokio::time::Instant::now() < until,
            "the stray VM and Secret were not reclaimed in 30 s ({deleted} deleted)"
        );
        deleted += reap_once(&ctx).await.orphans.done;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!h.vm_alive(stray, "vm").await && !h.secret_alive(stray, "vm").await);
    assert!(h.vm_alive(live.id, "vm").await && h.secret_alive(live.id, "vm").await);
    assert_eq!(h.status(live.id).await, SessionStatus::Running);
}

on_both_backends!(a_long_running_reaper_sees_deleted_objects_go_through_its_watch);
async fn a_long_running_reaper_sees_deleted_objects_go_through_its_watch(h: Harness) {
    const HOLD: &str = "test.ttlab.io/shutting-down";
    // Expired sessions whose VMs linger a moment after their deletion (a finalizer, as a
    // guest's shutdown holds a real one), and the reaper's watch-fed listings filled.
    let mut expired = Vec::new();
    for _ in 0..3 {
        let s = h
            .open("dev", SessionStatus::Running, minutes(-1), &["vm"])
            .await;
        h.create_vms_held("dev", s.id, &["vm"], true, Some(HOLD))
            .await;
        expired.push(s.id);
    }
    let ctx = h.ctx("dev").with_cached_listings(Duration::from_secs(300));
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while !ctx.cached_listings_ready() {
        assert!(
            tokio::time::Instant::now() < until,
            "the listings did not fill in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mark = h.mark();
    let cycle = tokio::spawn({
        let ctx = ctx.clone();
        async move { reap_sessions(&ctx).await }
    });
    // The VMs go a moment after their deletions were accepted: seen in the call log (which
    // asks the API server nothing), then their finalizers dropped.
    let vms: BTreeSet<String> = expired.iter().map(|id| vm_name(*id, &node("vm"))).collect();
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let deleted: BTreeSet<String> = h
            .reaper_calls_since(mark)
            .into_iter()
            .filter(|c| c.verb == "delete" && c.resource == "virtualmachines")
            .filter_map(|c| c.name)
            .collect();
        if vms.is_subset(&deleted) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the reaper did not delete the VMs in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for vm in &vms {
        h.drop_finalizers(vm).await;
    }
    let report = cycle.await.unwrap();
    // Every row is final in the same cycle: the watch reported each VM gone, and the Secrets
    // were removed at once (the API server's answer said so). Neither cost a request.
    assert_eq!(
        (report.expired.done, report.expired.failed),
        (3, 0),
        "{report:?}"
    );
    let looked: Vec<_> = h
        .reaper_calls_since(mark)
        .into_iter()
        .filter(|c| {
            ["get", "list"].contains(&c.verb.as_str())
                && ["virtualmachines", "secrets"].contains(&c.resource.as_str())
        })
        .collect();
    assert!(
        looked.is_empty(),
        "the reaper looked for what its watch saw go: {looked:?}"
    );
    for id in &expired {
        assert_eq!(h.status(*id).await, SessionStatus::Expired);
        assert!(!h.vm_alive(*id, "vm").await && !h.secret_alive(*id, "vm").await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stray_cloud_init_secrets_of_this_environment_go_and_others_stay() {
    let h = Harness::start().await;
    // A session that ended long ago (its row is final) left its cloud-init Secret behind 32
    // days ago; so did one of another environment, and one with no row at all.
    let old = h
        .open(
            "dev",
            SessionStatus::Running,
            minutes(-32 * 24 * 60),
            &["vm"],
        )
        .await;
    reap_once(&h.ctx("dev")).await;
    assert_eq!(h.status(old.id).await, SessionStatus::Expired);
    let month_ago = h.now().await - minutes(32 * 24 * 60);
    h.create_secret_backdated("dev", old.id, "vm", month_ago);
    let rowless = SessionId::new_random();
    h.create_secret_backdated("dev", rowless, "vm", month_ago);
    let foreign = SessionId::new_random();
    h.create_secret_backdated("prod", foreign, "vm", month_ago);
    // One just written (its session's row may not be committed yet): younger than the
    // minimum age, kept whatever its session.
    let fresh = SessionId::new_random();
    h.create_secret("dev", fresh, "vm", None).await;

    // The reaper as deployed: the default minimum age (2 minutes).
    let deployed = h.ctx("dev").with_settings(ReaperSettings::default());
    let report = reap_once(&deployed).await;
    assert_eq!(
        (report.orphans.done, report.orphans.failed),
        (2, 0),
        "{report:?}"
    );
    assert!(!h.secret_alive(old.id, "vm").await);
    assert!(!h.secret_alive(rowless, "vm").await);
    assert!(
        h.secret_alive(foreign, "vm").await,
        "another environment's Secret stays"
    );
    assert!(h.secret_alive(fresh, "vm").await, "a fresh Secret stays");
    let report = reap_once(&deployed).await;
    assert_eq!(report.orphans.done, 0, "{report:?}");
    assert!(h.secret_alive(foreign, "vm").await && h.secret_alive(fresh, "vm").await);
}

on_both_backends!(ghosts_and_stuck_starts);
async fn ghosts_and_stuck_starts(h: Harness) {
    let ctx = h.ctx("dev");
    // Running, but its VM was deleted behind the backend's back.
    let ghost = h
        .open("dev", SessionStatus::Running, minutes(30), &["vm"])
        .await;
    // Starting past its readiness deadline, with its VM created: the server died.
    let stuck = h
        .open("dev", SessionStatus::Starting, minutes(-1), &["vm"])
        .await;
    h.create_vms("dev", stuck.id, &["vm"], true).await;
    let report = reap_once(&ctx).await;
    assert_eq!(
        (report.ghosts.done, report.stuck.done),
        (1, 1),
        "{report:?}"
    );
    let row = h.store.sessions().get(ghost.id).await.unwrap().unwrap();
    assert_eq!(row.status, SessionStatus::Ghost);
    assert!(row.finished_at.is_some());
    assert_eq!(h.status(stuck.id).await, SessionStatus::Failed);
    assert!(!h.vm_alive(stuck.id, "vm").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unlisted_cluster_still_gets_what_the_database_alone_allows() {
    let h = Harness::start().await;
    let ctx = h.ctx("dev");
    // The cluster cannot be listed: what the database alone allows still happens.
    let expired = h
        .open("dev", SessionStatus::Running, minutes(-1), &["vm"])
        .await;
    h.create_vms("dev", expired.id, &["vm"], true).await;
    // (A 500: kube-rs itself retries a 503 for as long as the request timeout.)
    let fault = h
        .sim()
        .faults()
        .add(FaultRule::fail(Some(Verb::List), None, 500));
    let report = reap_once(&ctx).await;
    assert!(report.ran() && !report.cluster_listed);
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.direction == Direction::Orphans)
    );
    // Its objects are deleted all the same (by name, from the row). Whether this cycle also
    // confirms them gone depends on how fast the deleted VM goes: a look that still finds it
    // terminating leaves the row finishing, a failure of this cycle, for the next one.
    assert!(!h.vm_alive(expired.id, "vm").await);
    assert_eq!(report.expired.done + report.expired.failed, 1, "{report:?}");
    let confirmed_at_once = report.expired.done == 1;
    if !confirmed_at_once {
        assert_eq!(h.status(expired.id).await, SessionStatus::Finishing);
    }
    assert!(h.sim().faults().remove(fault));
    let report = reap_once(&ctx).await;
    assert!(report.cluster_listed, "{report:?}");
    if !confirmed_at_once {
        assert_eq!(
            (report.stuck.done, report.stuck.failed),
            (1, 0),
            "{report:?}"
        );
    }
    assert_eq!(h.status(expired.id).await, SessionStatus::Expired);
    assert!(
        h.store
            .sessions()
            .objects_gone_at(expired.id)
            .await
            .unwrap()
            .is_some()
    );
}

on_both_backends!(a_stuck_start_whose_provisioner_still_runs_is_left_to_it_until_it_lets_go);
async fn a_stuck_start_whose_provisioner_still_runs_is_left_to_it_until_it_lets_go(h: Harness) {
    let ctx = h.ctx("dev");
    let stuck = h
        .open("dev", SessionStatus::Starting, minutes(-1), &["vm"])
        .await;
    h.create_vms("dev", stuck.id, &["vm"], true).await;
    // A server is still provisioning it (and may be creating objects right now).
    let provisioner = h
        .store
        .try_provisioning_lock(stuck.id)
        .await
        .unwrap()
        .unwrap();
    let report = reap_once(&ctx).await;
    assert_eq!(
        (report.stuck.done, report.stuck.failed),
        (0, 0),
        "{report:?}"
    );
    // It is told to stop (the row left `starting`), and nothing was deleted under it.
    assert_eq!(h.status(stuck.id).await, SessionStatus::Finishing);
    assert!(h.vm_alive(stuck.id, "vm").await);
    // The provisioner dies without completing it: the next cycle does.
    drop(provisioner);
    let mut report = reap_once(&ctx).await;
    for _ in 0..50 {
        if report.stuck.done == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        report = reap_once(&ctx).await;
    }
    assert_eq!(report.stuck.done, 1, "{report:?}");
    assert_eq!(h.status(stuck.id).await, SessionStatus::Failed);
    assert!(!h.vm_alive(stuck.id, "vm").await);
}

on_both_backends!(a_dry_run_reports_and_deletes_nothing);
async fn a_dry_run_reports_and_deletes_nothing(h: Harness) {
    let expired = h
        .open("dev", SessionStatus::Running, minutes(-1), &["vm"])
        .await;
    h.create_vms("dev", expired.id, &["vm"], true).await;
    let orphan = SessionId::new_random();
    h.create_vms("dev", orphan, &["vm"], true).await;
    let ghost = h
        .open("dev", SessionStatus::Running, minutes(30), &["vm"])
        .await;
    let mut ctx = h.ctx("dev");
    ctx.settings.dry_run = true;
    let mark = h.mark();
    let report = reap_once(&ctx).await;
    assert!(report.dry_run);
    assert_eq!(
        (report.expired.done, report.orphans.done, report.ghosts.done),
        (1, 2, 1),
        "{report:?}"
    );
    assert!(
        report
            .actions
            .iter()
            .any(|a| a.what.contains("would delete"))
    );
    let writes: Vec<_> = h
        .reaper_calls_since(mark)
        .into_iter()
        .filter(|c| !c.is_read())
        .collect();
    assert!(writes.is_empty(), "{writes:?}");
    assert_eq!(h.status(expired.id).await, SessionStatus::Running);
    assert_eq!(h.status(ghost.id).await, SessionStatus::Running);
    assert!(h.vm_alive(expired.id, "vm").await && h.vm_alive(orphan, "vm").await);
}

on_both_backends!(a_vm_stuck_terminating_keeps_its_session_finishing_until_it_is_gone);
async fn a_vm_stuck_terminating_keeps_its_session_finishing_until_it_is_gone(h: Harness) {
    const HOLD: &str = "test.ttlab.io/node-unreachable";
    let ctx = h.ctx("dev");
    let stuck = h
        .open("dev", SessionStatus::Running, minutes(-1), &["vm"])
        .await;
    h.create_vms_held("dev", stuck.id, &["vm"], true, Some(HOLD))
        .await;
    let vm = vm_name(stuck.id, &node("vm"));
    // A session whose VM goes at once, beside it: reclaimed in the same cycle.
    let fine = h
        .open("dev", SessionStatus::Running, minutes(-1), &["vm"])
        .await;
    h.create_vms("dev", fine.id, &["vm"], true).await;

    let report = reap_once(&ctx).await;
    assert_eq!(
        (report.expired.done, report.expired.failed),
        (1, 0),
        "{report:?}"
    );
    assert_eq!(h.status(fine.id).await, SessionStatus::Expired);
    // The stuck one: its deletion was accepted, but the VM is still there, so the row stays
    // finishing (live) and the VM is named in the report, its errors (not counted as a
    // failure) and the metrics.
    assert_eq!(h.status(stuck.id).await, SessionStatus::Finishing);
    let named: Vec<(Kind, &str, &str)> = report
        .terminating
        .iter()
        .map(|t| (t.kind, t.name.as_str(), t.session.as_str()))
        .collect();
    let stuck_id = stuck.id.to_string();
    assert_eq!(
        named,
        [(Kind::VirtualMachine, vm.as_str(), stuck_id.as_str())],
        "{report:?}"
    );
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.subject == format!("VirtualMachine/{vm}")
                && e.message.contains("still terminating")),
        "{report:?}"
    );
    assert!(report.details().contains(&format!(
        "objects still terminating: 1\n  VirtualMachine/{vm}  session {stuck_id}\n"
    )));
    let metrics = ttlab_reaper::Metrics::new();
    metrics.observe(&report, ttlab_store::CycleTrigger::Timer);
    let text = metrics.render();
    assert!(
        text.contains(
            "ttlab_reaper_objects_terminating{kind=\"VirtualMachine\",site=\"default\"} 1"
        ),
        "{text}"
    );
    // Recorded on the row, for the admin page.
    let terminating = h
        .store
        .sessions()
        .list_terminating(Some(&"dev".parse().unwrap()), 10)
        .await
        .unwrap();
    assert_eq!(terminating.len(), 1, "{terminating:?}");
    assert_eq!(terminating[0].id, stuck.id);
    assert_eq!(terminating[0].objects, [format!("VirtualMachine/{vm}")]);
    assert!(
        h.store
            .sessions()
            .objects_gone_at(stuck.id)
            .await
            .unwrap()
            .is_none()
    );
    // It still counts against capacity: the cluster still lists it.
    let counted = h.fixtures.count_live_vms().await.unwrap();
    assert!(counted >= 1, "{counted}");
    assert!(
        h.fixtures
            .get(Kind::VirtualMachine, &vm)
            .await
            .unwrap()
            .is_some_and(|o| o.deleting)
    );

    // Every cycle deletes it again and looks again; it stays finishing meanwhile.
    let mark = h.mark();
    let again = reap_once(&ctx).await;
    assert_eq!(h.status(stuck.id).await, SessionStatus::Finishing);
    assert_eq!(again.terminating.len(), 1, "{again:?}");
    assert_eq!((again.stuck.done, again.stuck.failed), (0, 0), "{again:?}");
    assert!(
        h.reaper_calls_since(mark)
            .iter()
            .any(|c| c.verb == "delete" && c.name.as_deref() == Some(vm.as_str())),
        "the deletion is retried"
    );

    // Once the VM is gone, the next cycle confirms it and the row goes final, with the time.
    let released_at = h.now().await;
    h.release(&vm, HOLD).await;
    h.wait_gone(Kind::VirtualMachine, &vm).await;
    let last = reap_once(&ctx).await;
    assert_eq!((last.stuck.done, last.stuck.failed), (1, 0), "{last:?}");
    assert!(last.terminating.is_empty(), "{last:?}");
    assert_eq!(h.status(stuck.id).await, SessionStatus::Expired);
    let gone_at = h
        .store
        .sessions()
        .objects_gone_at(stuck.id)
        .await
        .unwrap()
        .expect("the time its objects were confirmed gone");
    assert!(gone_at >= released_at, "{gone_at} < {released_at}");
    assert!(
        h.store
            .sessions()
            .list_terminating(None, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

on_both_backends!(pool_members_are_their_environments_and_never_another_reapers);
async fn pool_members_are_their_environments_and_never_another_reapers(h: Harness) {
    // A ready member of dev's warm pool (a live row held by no student) with its VM, and one
    // past its age limit.
    let now = h.now().await;
    let sessions = h.store.sessions();
    let member = |age_limit: TimeDelta| {
        let id = SessionId::new_random();
        let new = ttlab_store::NewPoolMember {
            id,
            lesson: common::LESSON.parse().unwrap(),
            runtime: ttlab_model::Runtime::Vm,
            env: common::env("dev"),
            site: "default".parse().unwrap(),
            times: ttlab_store::SessionTimes {
                started_at: now - TimeDelta::hours(1),
                expires_at: now + age_limit,
                max_expires_at: now + age_limit,
            },
            readiness_deadline: now + TimeDelta::minutes(5),
            class: None,
        };
        (id, new)
    };
    let (ready, ready_new) = member(TimeDelta::hours(3));
    let (old, old_new) = member(TimeDelta::minutes(-1));
    for (id, new) in [(ready, &ready_new), (old, &old_new)] {
        sessions.insert_pool_member(new).await.unwrap();
        let vms = [ttlab_store::SessionVm {
            node: node("vm"),
            name: vm_name(id, &node("vm")),
        }];
        assert!(sessions.record_vms(id, &vms).await.unwrap());
        sessions.mark_running(id, None).await.unwrap().unwrap();
        h.create_vms("dev", id, &["vm"], true).await;
    }
    // A member's objects whose row is gone (a refill that crashed half-way): an orphan of dev.
    let leftover = SessionId::new_random();
    h.create_vms("dev", leftover, &["vm"], true).await;

    // The other environment's reaper touches none of them.
    let prod = reap_once(&h.ctx("prod")).await;
    assert_eq!(
        (prod.expired.done, prod.orphans.done, prod.ghosts.done),
        (0, 0, 0),
        "{prod:?}"
    );
    for id in [ready, old, leftover] {
        assert!(h.vm_alive(id, "vm").await, "prod's reaper touched {id}");
    }
    // Dev's own reaper: the ready member is a live session (kept), the old one expired like
    // any session, the leftover deleted as an orphan.
    let dev = reap_once(&h.ctx("dev")).await;
    assert_eq!(dev.expired.done, 1, "{dev:?}");
    assert!(dev.orphans.done >= 1, "{dev:?}");
    assert!(h.vm_alive(ready, "vm").await);
    assert_eq!(h.status(ready).await, SessionStatus::Running);
    assert!(!h.vm_alive(old, "vm").await);
    assert_eq!(h.status(old).await, SessionStatus::Expired);
    assert!(!h.vm_alive(leftover, "vm").await);
}
