//! Provisioning against kube-sim: one session per user across replicas, the VM limit, the
//! disk decision, failures that leave nothing behind, a crash mid-provisioning, and transient
//! faults (500s, lost replies, failing watches) ridden out by retries and creates that adopt
//! this session's own objects — while a foreign object or a fault that persists fails clearly.

use crate::support;

use serde_json::{Value, json};
use support::{NS, World, policy, token};
use ttlab_api::auth::Role;

fn id(v: &Value) -> String {
    v["id"].as_str().expect("an id").to_owned()
}

#[tokio::test]
async fn fifty_clicks_on_two_replicas_open_one_session() {
    let w = World::new().await;
    let a = w.server(policy(3600, 7200, 3), 8).await;
    let b = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let mut tasks = Vec::new();
    for i in 0..50 {
        let base = if i % 2 == 0 { &a } else { &b };
        tasks.push(base.post("/api/sessions", &alice, json!({"lesson": "quick"})));
    }
    let results = futures::future::join_all(tasks).await;
    let accepted: Vec<&Value> = results
        .iter()
        .filter(|(s, _)| *s == 202)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(accepted.len(), 1, "{results:?}");
    for (status, v) in &results {
        // Fifty clicks at once also meet the per-user rate limit (429) on each replica.
        assert!(
            *status == 202
                || (*status == 409 && v["error"] == "session_exists")
                || (*status == 429 && v["error"] == "rate_limited"),
            "{status} {v}"
        );
    }
    let sid = id(accepted[0]);
    let v = b
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(w.sim.stats().peak_vms, 1);
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn twenty_students_with_a_limit_of_eight_never_exceed_eight_vms() {
    let w = World::new().await;
    let a = w.server(policy(3600, 7200, 3), 8).await;
    let b = w.server(policy(3600, 7200, 3), 8).await;
    let tokens: Vec<String> = (0..20)
        .map(|i| token(&format!("student{i}"), Role::Student))
        .collect();
    let mut tasks = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let s = if i % 2 == 0 { &a } else { &b };
        tasks.push(s.post("/api/sessions", t, json!({"lesson": "quick"})));
    }
    let results = futures::future::join_all(tasks).await;
    let accepted = results.iter().filter(|(s, _)| *s == 202).count();
    assert_eq!(accepted, 8, "{results:?}");
    for (status, v) in results.iter().filter(|(s, _)| *s != 202) {
        assert_eq!(*status, 503, "{v}");
        assert_eq!(v["error"], "capacity");
        assert_eq!(
            v["message"],
            "No VM capacity right now: 8 of 8 VMs are in use by open labs. Try again in a few \
             minutes."
        );
    }
    for ((_, v), t) in results.iter().zip(&tokens).filter(|((s, _), _)| *s == 202) {
        a.wait_session(&id(v), t, |v| v["status"] == "running")
            .await;
    }
    assert_eq!(w.sim.stats().peak_vms, 8, "{:?}", w.sim.stats());
    let admin = token("root", Role::Admin);
    let (_, cap) = a.get("/api/admin/capacity", &admin).await;
    assert_eq!(
        (cap["live_vms"].as_u64(), cap["limit"].as_u64()),
        (Some(8), Some(8)),
        "{cap}"
    );
    // The one site, `default`: the server's namespace, its limit and its VMs, reachable.
    let sites = cap["sites"].as_array().expect("a list of sites");
    assert_eq!(sites.len(), 1, "{cap}");
    let site = &sites[0];
    assert_eq!(site["name"], "default", "{cap}");
    assert_eq!(site["namespace"], NS, "{cap}");
    assert_eq!(site["vm_limit"], 8, "{cap}");
    assert_eq!(site["in_use"], 8, "{cap}");
    assert_eq!(site["available"], 0, "{cap}");
    assert_eq!(site["starting_sessions"], 0, "{cap}");
    assert_eq!(site["quota"], cap["quota"], "{cap}");
    assert_eq!(site["memory"], cap["memory"], "{cap}");
    assert_eq!(site["reachable"], true, "{cap}");
    assert_eq!(site["why"], Value::Null, "{cap}");
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn two_environments_sharing_the_namespace_and_database_share_one_vm_limit() {
    let w = World::new().await;
    // VMs are created slowly: every session is still `starting`, its VM not yet listed, while
    // all the clicks are answered. Only the starting rows of both environments say how many
    // VMs are coming.
    w.sim.faults().add(ttlab_kube_sim::FaultRule {
        action: ttlab_kube_sim::FaultAction::Delay { millis: 1500 },
        ..ttlab_kube_sim::FaultRule::fail(
            Some(ttlab_kube_sim::Verb::Create),
            Some("virtualmachines"),
            500,
        )
    });
    let dev = w.server(policy(3600, 7200, 3), 4).await;
    let mut config = w.config(policy(3600, 7200, 3), 4).await;
    config.env = "prod".parse().unwrap();
    let prod = w.serve(config).await;
    let tokens: Vec<String> = (0..12)
        .map(|i| token(&format!("student{i}"), Role::Student))
        .collect();
    let mut tasks = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let s = if i % 2 == 0 { &dev } else { &prod };
        tasks.push(s.post("/api/sessions", t, json!({"lesson": "quick"})));
    }
    let results = futures::future::join_all(tasks).await;
    let accepted: Vec<(usize, &Value)> = results
        .iter()
        .enumerate()
        .filter(|(_, (s, _))| *s == 202)
        .map(|(i, (_, v))| (i, v))
        .collect();
    assert_eq!(accepted.len(), 4, "{results:?}");
    for (i, v) in &accepted {
        let s = if i % 2 == 0 { &dev } else { &prod };
        s.wait_session(&id(v), &tokens[*i], |v| v["status"] == "running")
            .await;
    }
    assert_eq!(w.sim.stats().peak_vms, 4, "{:?}", w.sim.stats());
    dev.stop().await;
    prod.stop().await;
}

fn golden_pvc(w: &World) {
    w.sim
        .create(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "golden-debian", "namespace": NS},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
        .unwrap();
    w.sim
        .set_status(
            "persistentvolumeclaims",
            NS,
            "golden-debian",
            json!({"phase": "Bound", "accessModes": ["ReadOnlyMany"]}),
        )
        .unwrap();
}

#[tokio::test]
async fn golden_disk_when_present_container_disk_with_the_reason_when_missing() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (_, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "golden"}))
        .await;
    let v = s
        .wait_session(&id(&v), &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(
        (v["disk"]["kind"].as_str(), v["disk"]["reason"].as_str()),
        (Some("container"), Some("not_found"))
    );
    let vm = w
        .sim
        .get("virtualmachines", NS, v["nodes"][0]["vm"].as_str().unwrap())
        .unwrap();
    assert!(
        vm["spec"]["template"]["spec"]["volumes"][0]["containerDisk"].is_object(),
        "{vm}"
    );
    s.delete(&format!("/api/sessions/{}", id(&v)), &alice).await;
    w.wait_empty().await;

    golden_pvc(&w);
    let (_, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "golden"}))
        .await;
    let v = s
        .wait_session(&id(&v), &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(
        (v["disk"]["kind"].as_str(), v["disk"]["reason"].as_str()),
        (Some("golden"), Some("ready"))
    );
    let vm = w
        .sim
        .get("virtualmachines", NS, v["nodes"][0]["vm"].as_str().unwrap())
        .unwrap();
    let root = &vm["spec"]["template"]["spec"]["volumes"][0]["ephemeral"]["persistentVolumeClaim"];
    assert_eq!(
        (root["claimName"].as_str(), root["readOnly"].as_bool()),
        (Some("golden-debian"), Some(true)),
        "{vm}"
    );
    s.stop().await;
}

async fn fails_with(w: &World, lesson: &str, reason_part: &str) {
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let user = token(&format!("u-{lesson}"), Role::Student);
    let (status, v) = s
        .post("/api/sessions", &user, json!({"lesson": lesson}))
        .await;
    assert_eq!(status, 202, "{v}");
    let v = s
        .wait_session(&id(&v), &user, |v| {
            v["status"]
                .as_str()
                .is_some_and(|s| s != "starting" && s != "finishing")
        })
        .await;
    assert_eq!(v["status"], "failed", "{v}");
    let reason = v["failure_reason"].as_str().unwrap();
    assert!(reason.contains(reason_part), "{reason}");
    w.wait_empty().await;
    let cluster = w.cluster().await;
    let selector = ttlab_model::labels::managed_selector();
    for kind in [
        ttlab_cluster::Kind::Secret,
        ttlab_cluster::Kind::VirtualMachine,
    ] {
        use ttlab_cluster::ReaperCluster as _;
        let left = cluster.list_all(kind, &selector).await.unwrap();
        assert!(left.iter().all(|o| o.deleting), "{kind} left: {left:?}");
    }
    s.stop().await;
}

#[tokio::test]
async fn a_failed_setup_fails_the_session_and_leaves_nothing() {
    let w = World::new().await;
    fails_with(&w, "broken", "setup script failed: apt-get failed").await;
}

#[tokio::test]
async fn a_setup_that_never_finishes_fails_the_session_and_leaves_nothing() {
    let w = World::new().await;
    fails_with(&w, "hangs", "setup script did not finish within 1 s").await;
}

#[tokio::test]
async fn a_vmi_stuck_pending_fails_the_session_and_leaves_nothing() {
    let w = World::new().await;
    // The golden PVC is there when the disk is chosen and gone when the VM starts: the VMI
    // waits for it for ever (FailedPvcNotFound), and the lesson's readiness timeout ends it.
    golden_pvc(&w);
    w.sim.faults().add(ttlab_kube_sim::FaultRule {
        action: ttlab_kube_sim::FaultAction::Delay { millis: 400 },
        ..ttlab_kube_sim::FaultRule::fail(
            Some(ttlab_kube_sim::Verb::Create),
            Some("virtualmachines"),
            500,
        )
    });
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (_, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "golden"}))
        .await;
    let sid = id(&v);
    s.wait_session(&sid, &alice, |v| v["disk"]["kind"] == "golden")
        .await;
    let pvc = w
        .sim
        .get("persistentvolumeclaims", NS, "golden-debian")
        .unwrap();
    assert!(pvc.is_object());
    // Remove the claim directly (as an operator would).
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::delete(format!(
        "{}/api/v1/namespaces/{NS}/persistentvolumeclaims/golden-debian",
        w.sim.url()
    ))
    .body(http_body_util::Full::new(bytes::Bytes::new()))
    .unwrap();
    assert!(http.request(req).await.unwrap().status().is_success());
    let v = s
        .wait_session(&sid, &alice, |v| v["status"] == "failed")
        .await;
    let reason = v["failure_reason"].as_str().unwrap();
    assert!(
        reason.starts_with("VM did not start within 2 s"),
        "{reason}"
    );
    assert!(reason.contains("FailedPvcNotFound"), "{reason}");
    w.wait_empty().await;
    s.stop().await;
}

#[tokio::test]
async fn a_server_killed_while_provisioning_is_resumed_after_restart_and_leaks_nothing() {
    let w = World::new().await;
    // Hold the guests before they run, so the crash happens mid-provisioning.
    w.sim.pause_kubevirt(true);
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (_, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "duo"}))
        .await;
    let sid = id(&v);
    s.wait_session(&sid, &alice, |v| v["stages"]["vm_created"].is_string())
        .await;
    s.kill().await;
    w.sim.pause_kubevirt(false);
    assert!(w.sim.stats().vms >= 1);

    let again = w.server(policy(3600, 7200, 3), 8).await;
    // The restarted server resumes the session where it stood: the VMs and Secrets already
    // created are adopted (same names, this session's labels), not made twice.
    let v = again
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(w.sim.stats().vms, 2, "{:?}", w.sim.stats());
    // And when it ends, nothing is left.
    let (status, v) = again.delete(&format!("/api/sessions/{sid}"), &alice).await;
    assert!(status == 200 || status == 202, "{status} {v}");
    w.wait_empty().await;
    // And the student can start again.
    let (status, v) = again
        .post("/api/sessions", &alice, json!({"lesson": "duo"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let v = again
        .wait_session(&id(&v), &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(v["nodes"].as_array().unwrap().len(), 2);
    again.stop().await;
}

fn delay(verb: ttlab_kube_sim::Verb, resource: &str, millis: u64) -> ttlab_kube_sim::FaultRule {
    ttlab_kube_sim::FaultRule {
        action: ttlab_kube_sim::FaultAction::Delay { millis },
        ..ttlab_kube_sim::FaultRule::fail(Some(verb), Some(resource), 500)
    }
}

#[tokio::test]
async fn finishing_a_session_while_it_is_created_leaves_no_object_behind_the_final_row() {
    let w = World::new().await;
    // The cloud-init Secret is created slowly, after the VM: the student finishes between the
    // two. Deleting Secrets is slow too, so a Secret created after the row went final would
    // be seen.
    w.sim
        .faults()
        .add(delay(ttlab_kube_sim::Verb::Create, "secrets", 2500));
    w.sim
        .faults()
        .add(delay(ttlab_kube_sim::Verb::Delete, "secrets", 300));
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = id(&v);
    // Finish while the Secret's creation is under way: it is asked for right after the VM.
    s.wait_session(&sid, &alice, |v| !v["stages"]["vm_created"].is_null())
        .await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let (status, f) = s.delete(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(status, 200, "{f}");
    assert!(
        f["status"] == "finishing" || f["status"] == "finished",
        "{f}"
    );

    // The row goes final only after the last call that creates, changes or deletes anything
    // of the session: nothing is created after the deletions, nothing deleted after the end.
    let done = s
        .wait_session(&sid, &alice, |v| {
            v["status"] != "starting" && v["status"] != "finishing"
        })
        .await;
    assert_eq!(done["status"], "finished", "{done}");
    // Long enough for a Secret creation still under way to land (and be cleaned up).
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let row = s
        .state
        .store()
        .sessions()
        .get(sid.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    let reclaimed = row
        .reclaimed_at
        .expect("a final row says when it was reclaimed");
    let calls = w.sim.calls();
    let late: Vec<_> = calls
        .iter()
        .filter(|c| {
            matches!(
                c.verb,
                ttlab_kube_sim::Verb::Create
                    | ttlab_kube_sim::Verb::Delete
                    | ttlab_kube_sim::Verb::Patch
                    | ttlab_kube_sim::Verb::Update
            )
        })
        .filter(|c| c.at.parse::<chrono::DateTime<chrono::Utc>>().unwrap() > reclaimed)
        .collect();
    assert!(
        late.is_empty(),
        "calls after the row went final at {reclaimed}: {late:#?}"
    );
    // (The case above was the one tested: the Secret was asked for before the finish.)
    let finished_at: chrono::DateTime<chrono::Utc> =
        done["finished_at"].as_str().unwrap().parse().unwrap();
    assert!(
        calls.iter().any(|c| c.verb == ttlab_kube_sim::Verb::Create
            && c.resource == "secrets"
            && c.at.parse::<chrono::DateTime<chrono::Utc>>().unwrap() < finished_at),
        "{calls:#?}"
    );
    s.stop().await;
}

/// The API server's refusal while kube-controller-manager has not counted a new quota or a new
/// resource type yet (resourcequota admission), for `resource` of object `name`.
fn quota_not_counted(resource: &str, group: &str, name: &str) -> String {
    let qualified = if group.is_empty() {
        resource.to_owned()
    } else {
        format!("{resource}.{group}")
    };
    format!(
        "{qualified} \"{name}\" is forbidden: status unknown for quota: ttlab-vms, resources: count/{qualified}"
    )
}

fn refuse_create(resource: &str, message: String, times: Option<u32>) -> ttlab_kube_sim::FaultRule {
    ttlab_kube_sim::FaultRule {
        action: ttlab_kube_sim::FaultAction::Fail {
            status: 403,
            message: Some(message),
        },
        times,
        ..ttlab_kube_sim::FaultRule::fail(Some(ttlab_kube_sim::Verb::Create), Some(resource), 403)
    }
}

#[tokio::test]
async fn creates_refused_until_the_quota_is_counted_are_retried_and_the_lab_starts() {
    let w = World::new().await;
    // Right after install: the quota controller has not counted the quota yet.
    w.sim.faults().add(refuse_create(
        "virtualmachines",
        quota_not_counted("virtualmachines", "kubevirt.io", "tt-x-vm"),
        Some(3),
    ));
    w.sim.faults().add(refuse_create(
        "secrets",
        quota_not_counted("secrets", "", "tt-x-vm-ci"),
        Some(2),
    ));
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let v = s
        .wait_session(&id(&v), &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    let refused = |resource: &str| {
        w.sim
            .calls()
            .iter()
            .filter(|c| {
                c.verb == ttlab_kube_sim::Verb::Create && c.resource == resource && c.status == 403
            })
            .count()
    };
    assert_eq!((refused("virtualmachines"), refused("secrets")), (3, 2));
    assert_eq!(w.sim.stats().vms, 1, "one VM, however many attempts");
    s.stop().await;
}

#[tokio::test]
async fn a_quota_never_counted_fails_the_lab_with_the_reason_after_the_retries() {
    let w = World::new().await;
    w.sim.faults().add(refuse_create(
        "virtualmachines",
        quota_not_counted("virtualmachines", "kubevirt.io", "tt-x-vm"),
        None,
    ));
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.quota_settle_wait = std::time::Duration::from_secs(2);
    let s = w.serve(config).await;
    let alice = token("alice", Role::Student);
    let started = std::time::Instant::now();
    let (_, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    let v = s
        .wait_session(&id(&v), &alice, |v| {
            v["status"] == "failed" || v["status"] == "running"
        })
        .await;
    assert_eq!(v["status"], "failed", "{v}");
    let reason = v["failure_reason"].as_str().unwrap();
    assert!(
        reason.contains("had still not counted the lab namespace's quota")
            && reason.contains("refused the VM"),
        "{reason}"
    );
    let waited = started.elapsed();
    assert!(
        (std::time::Duration::from_millis(900)..std::time::Duration::from_secs(10))
            .contains(&waited),
        "retried for about the settle wait, then gave up: {waited:?}"
    );
    let attempts = w
        .sim
        .calls()
        .iter()
        .filter(|c| c.verb == ttlab_kube_sim::Verb::Create && c.resource == "virtualmachines")
        .count();
    assert!((2..=12).contains(&attempts), "bounded retries: {attempts}");
    s.stop().await;
}

#[tokio::test]
async fn an_exceeded_quota_with_places_free_fails_the_lab_with_the_reason_after_the_recount_wait() {
    let w = World::new().await;
    // The quota refuses although it has room by its own count and the server's: not a full
    // namespace (that is a place in the line), a quota that keeps refusing.
    w.sim.faults().add(refuse_create(
        "virtualmachines",
        "virtualmachines.kubevirt.io \"tt-x-vm\" is forbidden: exceeded quota: ttlab-vms, \
         requested: count/virtualmachines.kubevirt.io=1, used: \
         count/virtualmachines.kubevirt.io=7, limited: count/virtualmachines.kubevirt.io=8"
            .to_owned(),
        None,
    ));
    let started = std::time::Instant::now();
    fails_with(&w, "quick", "the lab namespace's quota refused the VM").await;
    let attempts = w
        .sim
        .calls()
        .iter()
        .filter(|c| c.verb == ttlab_kube_sim::Verb::Create && c.resource == "virtualmachines")
        .count();
    // Retried while the quota may still be recounting what deletions freed, then failed.
    assert!(
        attempts > 1,
        "a refusal is retried for the recount: {attempts}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "a refusing quota fails within the recount wait: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_quota_that_refuses_until_it_has_recounted_a_deletion_is_ridden_out() {
    let w = World::new().await;
    // The quota still counts a VM deleted a moment ago: two refusals, then room.
    w.sim.faults().add(refuse_create(
        "virtualmachines",
        "virtualmachines.kubevirt.io \"tt-x-vm\" is forbidden: exceeded quota: ttlab-vms, \
         requested: count/virtualmachines.kubevirt.io=1, used: \
         count/virtualmachines.kubevirt.io=8, limited: count/virtualmachines.kubevirt.io=8"
            .to_owned(),
        Some(2),
    ));
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let done = s
        .wait_session(&id(&v), &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(done["status"], "running", "{done}");
}

#[tokio::test]
async fn the_capacity_refusal_counts_vms_still_shutting_down_apart_from_open_labs() {
    use ttlab_cluster::{ProvisionCluster as _, ReaperCluster as _};
    let w = World::new().await;
    let cluster = w.cluster().await;
    // Two VMs of labs that ended: deleted, but their guests still shutting down (a finalizer
    // holds them, as KubeVirt's does while the VMI stops).
    for _ in 0..2 {
        let session = ttlab_model::SessionId::new_random();
        let manifests = ttlab_vm_manifest::render(&ttlab_vm_manifest::SessionVms {
            session,
            env: "dev".parse().unwrap(),
            lesson: "quick".parse().unwrap(),
            namespace: None,
            image: "quay.io/containerdisks/debian:12".into(),
            memory: "256Mi".into(),
            cores: 1,
            nodes: vec!["vm".parse().unwrap()],
            disk: ttlab_disk_select::DiskDecision::ContainerDisk {
                reason: ttlab_disk_select::FallbackReason::NotRequested,
            },
            termination_grace_period_seconds: 0,
        })
        .unwrap();
        let mut vm = serde_json::to_value(&manifests.vms[0]).unwrap();
        vm["metadata"]["finalizers"] = json!(["test.ttlab.io/still-shutting-down"]);
        let created = cluster.create_vm(vm).await.unwrap();
        cluster
            .delete(
                ttlab_cluster::Kind::VirtualMachine,
                &created.name,
                ttlab_cluster::Propagation::Background,
            )
            .await
            .unwrap();
    }
    let s = w.server(policy(3600, 7200, 3), 4).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    s.wait_session(&id(&v), &alice, |v| v["status"] == "running")
        .await;
    // One open lab's VM and two shutting down take 3 of 4 places: a two-VM lab does not fit.
    let bob = token("bob", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &bob, json!({"lesson": "duo"}))
        .await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"], "capacity");
    assert_eq!(
        v["message"],
        "No VM capacity right now: 1 of 4 VMs is in use by open labs, plus 2 VMs still \
         shutting down; this lab needs 2. Try again in a few minutes."
    );
    s.stop().await;
}

/// The failure reason of session `sid` as an admin reads it (a student sees only its first
/// sentence).
async fn admin_reason(s: &support::Running, sid: &str) -> String {
    let (status, v) = s
        .get(&format!("/api/sessions/{sid}"), &token("root", Role::Admin))
        .await;
    assert_eq!(status, 200, "{v}");
    v["failure_reason"].as_str().unwrap_or_default().to_owned()
}

/// Calls of `verb` on `resource` that kube-sim answered with `status`.
fn answered(w: &World, verb: ttlab_kube_sim::Verb, resource: &str, status: u16) -> usize {
    w.sim
        .calls()
        .iter()
        .filter(|c| c.verb == verb && c.resource == resource && c.status == status)
        .count()
}

#[tokio::test]
async fn a_cluster_failing_a_third_of_creates_reads_and_watches_still_brings_labs_up() {
    use ttlab_kube_sim::{FaultRule, Verb};
    let w = World::new().await;
    for (verb, resource) in [
        (Verb::Create, "virtualmachines"),
        (Verb::Create, "secrets"),
        (Verb::Create, "services"),
        (Verb::Create, "networkpolicies"),
        (Verb::List, "virtualmachineinstances"),
        (Verb::Watch, "virtualmachineinstances"),
    ] {
        w.sim
            .faults()
            .add(FaultRule::fail(Some(verb), Some(resource), 500).fraction(0.34));
    }
    // And some replies lost after the create was applied.
    w.sim
        .faults()
        .add(FaultRule::lose_reply(Some(Verb::Create), Some("virtualmachines")).fraction(0.3));
    w.sim
        .faults()
        .add(FaultRule::lose_reply(Some(Verb::Create), Some("secrets")).fraction(0.3));
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let students: Vec<(String, &str)> = (0..6)
        .map(|i| {
            let lesson = if i % 3 == 0 { "duo" } else { "quick" };
            (token(&format!("student{i}"), Role::Student), lesson)
        })
        .collect();
    let mut ids = Vec::new();
    for (t, lesson) in &students {
        let (status, v) = s.post("/api/sessions", t, json!({"lesson": lesson})).await;
        assert_eq!(status, 202, "{v}");
        ids.push(id(&v));
    }
    for ((t, _), sid) in students.iter().zip(&ids) {
        let v = s.wait_session(sid, t, |v| v["status"] != "starting").await;
        assert_eq!(v["status"], "running", "{v}");
    }
    assert!(
        answered(&w, Verb::Create, "virtualmachines", 500) > 0,
        "the faults were injected: {:?}",
        w.sim.faults().rules()
    );
    // Two lessons of one VM and two of two: one VM per node, however many attempts.
    assert_eq!(w.sim.stats().vms, 8, "{:?}", w.sim.stats());
    s.stop().await;
}

#[tokio::test]
async fn a_create_whose_reply_was_lost_is_adopted_and_the_lab_starts() {
    use ttlab_kube_sim::{FaultRule, Verb};
    let w = World::new().await;
    w.sim
        .faults()
        .add(FaultRule::lose_reply(Some(Verb::Create), Some("virtualmachines")).times(1));
    w.sim
        .faults()
        .add(FaultRule::lose_reply(Some(Verb::Create), Some("secrets")).times(1));
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = id(&v);
    let v = s
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    // Each create was applied, its reply lost, and the repeat found it (409) and adopted it.
    assert_eq!(answered(&w, Verb::Create, "virtualmachines", 409), 1);
    assert_eq!(answered(&w, Verb::Create, "secrets", 409), 1);
    assert_eq!(w.sim.stats().vms, 1, "{:?}", w.sim.stats());
    // The Secret is owned by the VM that was adopted (its uid came from the adoption).
    let session: ttlab_model::SessionId = sid.parse().unwrap();
    let node: ttlab_model::NodeName = "vm".parse().unwrap();
    let vm = w
        .sim
        .get(
            "virtualmachines",
            NS,
            &ttlab_vm_manifest::vm_name(session, &node),
        )
        .expect("the VM");
    let secret = w
        .sim
        .get(
            "secrets",
            NS,
            &ttlab_vm_manifest::secret_name(session, &node),
        )
        .expect("the Secret");
    assert_eq!(
        secret["metadata"]["ownerReferences"][0]["uid"], vm["metadata"]["uid"],
        "{secret}"
    );
    s.stop().await;
}

/// The statement that marks a session running commits, but its answer never comes back: the
/// server gives up on the connection (its call timeout) and retries, and the retry finds the
/// row running already. The lab is the student's, and it must stay up: no object deleted, the
/// session running (in the 10-minute soak this tore down two running labs, which became
/// ghosts).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lab_whose_mark_running_answer_was_lost_stays_running() {
    use ttlab_kube_sim::Verb;
    let w = World::new().await;
    // The answer is lost the way a dropped connection loses it: the update holds its row in
    // a trigger that sleeps past the client's call timeout, then commits (the server is not
    // told the client left); the client has retried on another connection meanwhile.
    let (db, connection) = tokio_postgres::connect(w.db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    db.batch_execute(
        "CREATE TABLE slow_updates (pid int NOT NULL); \
         CREATE FUNCTION slow_mark_running() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN INSERT INTO slow_updates VALUES (pg_backend_pid()); \
                    PERFORM pg_sleep(3); RETURN NEW; END $$; \
         CREATE TRIGGER slow_mark_running AFTER UPDATE OF status ON sessions FOR EACH ROW \
           WHEN (OLD.status = 'starting' AND NEW.status = 'running') \
           EXECUTE FUNCTION slow_mark_running();",
    )
    .await
    .unwrap();
    let mut options = ttlab_store::StoreOptions::default();
    options.timeouts.call = std::time::Duration::from_secs(1);
    let store = w.db.store_with(options).await.unwrap();
    let config = w.config(policy(3600, 7200, 3), 8).await;
    let s = w.serve_on(config, store).await;
    let clicked = std::time::Instant::now();
    let (sid, alice) = support::start_running(&s, "alice", "quick").await;
    eprintln!(
        "running {:.1} s after the click",
        clicked.elapsed().as_secs_f64()
    );
    // The first attempt's answer was lost: the server gave its connection up while the
    // update slept, so the backend that ran it ended once it had committed.
    let mut alive = 1;
    for _ in 0..100 {
        alive = db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE pid IN (SELECT pid FROM slow_updates)",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0);
        if alive == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let slow: i64 = db
        .query_one("SELECT count(*) FROM slow_updates", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(slow, 1, "the session was marked running once");
    assert_eq!(
        alive, 0,
        "the connection of the slow update is still open: its answer was not lost"
    );
    // Give a wrong teardown time to happen, then check that nothing of the lab was deleted.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let deletes: Vec<_> = w
        .sim
        .calls()
        .into_iter()
        .filter(|c| c.verb == Verb::Delete)
        .collect();
    assert!(
        deletes.is_empty(),
        "the running lab was torn down: {deletes:?}"
    );
    assert_eq!(w.sim.stats().vms, 1, "{:?}", w.sim.stats());
    let (status, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    drop(db);
    let _ = connection.await;
    s.stop().await;
}

#[tokio::test]
async fn an_object_of_someone_else_under_the_name_fails_the_lab_clearly() {
    use ttlab_kube_sim::{FaultAction, FaultRule, Verb};
    let w = World::new().await;
    // The server's VM create is held back while someone else's VM takes the name.
    w.sim.faults().add(FaultRule {
        action: FaultAction::Delay { millis: 3000 },
        ..FaultRule::fail(Some(Verb::Create), Some("virtualmachines"), 500).times(1)
    });
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = id(&v);
    let session: ttlab_model::SessionId = sid.parse().unwrap();
    let name = ttlab_vm_manifest::vm_name(session, &"vm".parse().unwrap());
    let other = ttlab_model::SessionId::new_random();
    w.sim
        .create(json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachine",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {
                    "app.kubernetes.io/managed-by": "ttlab",
                    "ttlab.io/env": "dev",
                    "ttlab.io/session": other.to_string(),
                    "ttlab.io/lesson": "quick",
                },
            },
            "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}}}},
        }))
        .expect("the other VM");
    let v = s
        .wait_session(&sid, &alice, |v| {
            v["status"] != "starting" && v["status"] != "finishing"
        })
        .await;
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(
        v["failure_reason"], "could not create the VM (the operators have the details)",
        "{v}"
    );
    let reason = admin_reason(&s, &sid).await;
    assert!(
        reason.contains("could not create the VM")
            && reason.contains("already exists and is not this session's")
            && reason.contains(&other.to_string()),
        "{reason}"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_create_that_keeps_failing_fails_the_lab_within_the_budget_saying_so() {
    use ttlab_kube_sim::{FaultRule, Verb};
    let w = World::new().await;
    w.sim.faults().add(FaultRule::fail(
        Some(Verb::Create),
        Some("virtualmachines"),
        500,
    ));
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.cluster_retry_budget = std::time::Duration::from_secs(3);
    let s = w.serve(config).await;
    let alice = token("alice", Role::Student);
    let started = std::time::Instant::now();
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = id(&v);
    let v = s
        .wait_session(&sid, &alice, |v| {
            v["status"] != "starting" && v["status"] != "finishing"
        })
        .await;
    let waited = started.elapsed();
    assert_eq!(v["status"], "failed", "{v}");
    let attempts = answered(&w, Verb::Create, "virtualmachines", 500);
    let reason = admin_reason(&s, &sid).await;
    assert!(
        reason.contains("could not create the VM: the cluster failed")
            && reason.contains(&format!("failed {attempts} times"))
            && reason.contains("500"),
        "{reason} ({attempts} attempts)"
    );
    assert!(
        (3..=20).contains(&attempts),
        "retried, within bounds: {attempts}"
    );
    assert!(
        (std::time::Duration::from_millis(1500)..std::time::Duration::from_secs(30))
            .contains(&waited),
        "gave up after about the budget: {waited:?}"
    );
    w.wait_empty().await;
    s.stop().await;
}

#[tokio::test]
async fn the_admin_capacity_names_what_is_still_terminating() {
    use ttlab_cluster::ReaperCluster as _;
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = id(&v);
    s.wait_session(&sid, &alice, |v| v["status"] == "running")
        .await;
    // KubeVirt stops acting (as for a VM on a dead node): its finalizer stays on the VM once
    // it is deleted, and the reaper found it still there and recorded it so.
    let session: ttlab_model::SessionId = sid.parse().unwrap();
    let vm = ttlab_vm_manifest::vm_name(session, &"vm".parse().unwrap());
    w.sim.pause_kubevirt(true);
    let cluster = w.cluster().await;
    let store = w.db.store().await.unwrap();
    store
        .sessions()
        .begin_finishing(
            session,
            &[ttlab_model::SessionStatus::Running],
            ttlab_model::FinalStatus::Expired,
            None,
        )
        .await
        .unwrap()
        .expect("finishing");
    cluster
        .delete(
            ttlab_cluster::Kind::VirtualMachine,
            &vm,
            ttlab_cluster::Propagation::Background,
        )
        .await
        .unwrap();
    assert!(
        store
            .sessions()
            .record_terminating(session, &[format!("VirtualMachine/{vm}")])
            .await
            .unwrap()
    );

    let admin = token("root", Role::Admin);
    let (status, cap) = s.get("/api/admin/capacity", &admin).await;
    assert_eq!(status, 200, "{cap}");
    assert_eq!(cap["terminating_vms"], json!([vm]), "{cap}");
    assert_eq!(cap["live_vms"], 1, "still counted: {cap}");
    let terminating = cap["terminating"].as_array().expect("a list");
    assert_eq!(terminating.len(), 1, "{cap}");
    assert_eq!(terminating[0]["session"], sid.as_str());
    assert_eq!(terminating[0]["env"], "dev");
    assert_eq!(terminating[0]["lesson"], "quick");
    assert_eq!(terminating[0]["finishing_to"], "expired");
    assert_eq!(
        terminating[0]["objects"],
        json!([format!("VirtualMachine/{vm}")])
    );
    assert!(terminating[0]["since"].is_string(), "{cap}");
    // The student's one session is still live while it goes.
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 409, "{v}");
    w.sim.pause_kubevirt(false);
    s.stop().await;
}

#[tokio::test]
async fn a_vmi_that_cannot_be_watched_fails_the_lab_saying_why() {
    use ttlab_kube_sim::{FaultRule, Verb};
    let w = World::new().await;
    for verb in [Verb::List, Verb::Watch] {
        w.sim.faults().add(FaultRule::fail(
            Some(verb),
            Some("virtualmachineinstances"),
            500,
        ));
    }
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = id(&v);
    let v = s
        .wait_session(&sid, &alice, |v| {
            v["status"] != "starting" && v["status"] != "finishing"
        })
        .await;
    assert_eq!(v["status"], "failed", "{v}");
    let reason = admin_reason(&s, &sid).await;
    assert!(
        reason.starts_with("VM did not start within 15 s (the watch failed ")
            && reason.contains("times (last: ")
            && reason.contains("500"),
        "{reason}"
    );
    w.wait_empty().await;
    s.stop().await;
}
