//! Pod lessons against kube-sim: running only once the Pod runs and is ready, graded through
//! pod exec, failed and cleaned up when the Pod does not start in time; and the capacity
//! view with the namespace's ResourceQuota.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{NS, World, policy, token};
use ttlab_api::auth::Role;
use ttlab_cluster::{Kind, ReaperCluster as _};

fn id(v: &Value) -> String {
    v["id"].as_str().expect("an id").to_owned()
}

/// Lab pods of ttlab still in the cluster and not being deleted.
async fn live_pods(w: &World) -> usize {
    let selector = ttlab_model::labels::managed_selector();
    let pods = w
        .cluster()
        .await
        .list_all(Kind::Pod, &selector)
        .await
        .unwrap();
    pods.iter().filter(|p| !p.deleting).count()
}

#[tokio::test]
async fn a_pod_lesson_runs_once_its_pod_is_ready_and_is_graded_by_exec() {
    // The kubelet takes a while: the session must stay starting until the Pod runs.
    let w = World::with(|c| c.timings.pod_start = Duration::from_millis(700)).await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "shell"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["runtime"], "pod");
    let sid = id(&v);
    let created = s
        .wait_session(&sid, &alice, |v| v["stages"]["vm_created"].is_string())
        .await;
    let pod = created["nodes"][0]["vm"].as_str().unwrap().to_owned();
    let seen = w.sim.get("pods", NS, &pod).expect("the lab pod");
    if seen["status"]["phase"] != "Running" {
        assert_eq!(created["status"], "starting", "{created}");
    }
    let v = s
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert!(v["stages"]["vmi_running"].is_string(), "{v}");
    let pod_now = w.sim.get("pods", NS, &pod).unwrap();
    assert_eq!(pod_now["status"]["phase"], "Running", "{pod_now}");
    // The Pod carries its deadline, so it ends even if nothing reclaims it.
    assert_eq!(
        pod_now["spec"]["activeDeadlineSeconds"].as_i64(),
        Some(7200 + 15 * 60)
    );

    let (status, g) = s
        .post(&format!("/api/sessions/{sid}/grade"), &alice, json!({}))
        .await;
    assert_eq!(status, 200, "{g}");
    assert_eq!(
        (g["passed"].as_u64(), g["total"].as_u64()),
        (Some(1), Some(2)),
        "{g}"
    );
    assert_eq!(g["steps"][0]["exit_code"], 0, "{g}");
    assert_eq!(g["steps"][1]["exit_code"], 3, "{g}");
    assert_eq!(g["steps"][1]["passed"], false);

    // While the API server fails the exec, "Check my work" says the cluster is unavailable
    // (503, try again), not that the lab is unreachable.
    let fault = w.sim.faults().add(ttlab_kube_sim::FaultRule::fail(
        Some(ttlab_kube_sim::Verb::Get),
        Some("pods/exec"),
        503,
    ));
    let (status, g) = s
        .post(&format!("/api/sessions/{sid}/grade"), &alice, json!({}))
        .await;
    assert_eq!(
        (status, g["error"].as_str()),
        (503, Some("cluster_unavailable")),
        "{g}"
    );
    w.sim.faults().remove(fault);

    let (status, f) = s.delete(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(
        (status, f["status"].as_str()),
        (200, Some("finished")),
        "{f}"
    );
    assert_eq!(live_pods(&w).await, 0);
    s.stop().await;
}

#[tokio::test]
async fn a_pod_that_does_not_start_in_time_fails_the_session_and_is_deleted() {
    // The lesson allows 2 s; the kubelet needs 5.
    let w = World::with(|c| c.timings.pod_start = Duration::from_secs(5)).await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (_, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "shell"}))
        .await;
    let v = s
        .wait_session(&id(&v), &alice, |v| {
            v["status"] == "failed" || v["status"] == "running"
        })
        .await;
    assert_eq!(v["status"], "failed", "{v}");
    let reason = v["failure_reason"].as_str().unwrap();
    assert!(
        reason.starts_with("lab pod did not start within 2 s (last seen: Pending"),
        "{reason}"
    );
    assert_eq!(live_pods(&w).await, 0);
    s.stop().await;
}

#[tokio::test]
async fn capacity_shows_the_namespace_quota() {
    let w = World::new().await;
    w.sim
        .create(json!({
            "apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": "ttlab-vms", "namespace": NS},
            "spec": {"hard": {"count/virtualmachines.kubevirt.io": "8", "requests.memory": "48Gi", "pods": "30"}}
        }))
        .unwrap();
    // A new quota shows no usage until the quota controller has counted (as on a cluster).
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while w
        .sim
        .get("resourcequotas", NS, "ttlab-vms")
        .and_then(|q| {
            q["status"]["used"]["count/virtualmachines.kubevirt.io"]
                .as_str()
                .map(str::to_owned)
        })
        .is_none()
    {
        assert!(
            std::time::Instant::now() < until,
            "the quota was never counted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let admin = token("root", Role::Admin);
    let (status, before) = s.get("/api/admin/capacity", &admin).await;
    assert_eq!(status, 200, "{before}");
    assert_eq!(before["quota"][0]["name"], "ttlab-vms", "{before}");
    assert_eq!(before["quota"][0]["hard"]["requests.memory"], "48Gi");
    assert_eq!(
        before["quota"][0]["used"]["count/virtualmachines.kubevirt.io"],
        "0"
    );
    // Memory against the quota. A VM of `quick` (256Mi, 1 core) costs its launcher pod's
    // requests: 256Mi + KubeVirt's overhead of 302514177 bytes (524289 of page tables, 240Mi
    // for its processes, 8Mi for the vCPU, 8Mi for the IOThread, 32Mi of video RAM) in the
    // compute container, and 35M for the console log's sidecar.
    const QUICK_VM: u64 = 268_435_456 + 302_514_177 + 35_000_000;
    const HARD: u64 = 48 << 30;
    let m = &before["memory"];
    assert_eq!(m["quota"], "ttlab-vms", "{before}");
    assert_eq!(m["hard"], "48Gi");
    assert_eq!(
        (m["hard_bytes"].as_u64(), m["used_bytes"].as_u64()),
        (Some(HARD), Some(0))
    );
    let lesson = |m: &Value, id: &str| {
        m["lessons"]
            .as_array()
            .and_then(|ls| ls.iter().find(|l| l["lesson"] == id).cloned())
            .unwrap_or_else(|| panic!("no {id} in {m}"))
    };
    let quick = lesson(m, "quick");
    assert_eq!(quick["vms"], 1);
    assert_eq!(quick["guest_bytes"], 268_435_456);
    assert_eq!(quick["overhead_bytes"], 302_514_177);
    assert_eq!(quick["launcher_request_bytes"], 268_435_456 + 302_514_177);
    assert_eq!(quick["session_bytes"], QUICK_VM);
    assert_eq!(quick["more_sessions"], HARD / QUICK_VM);
    assert_eq!(lesson(m, "duo")["session_bytes"], 2 * QUICK_VM);
    assert!(
        m["lessons"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["lesson"] != "shell"),
        "pod lessons are not VMs: {m}"
    );

    let alice = token("alice", Role::Student);
    let (_, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    s.wait_session(&id(&v), &alice, |v| v["status"] == "running")
        .await;
    let (_, after) = s.get("/api/admin/capacity", &admin).await;
    let q = &after["quota"][0];
    assert_eq!(
        q["used"]["count/virtualmachines.kubevirt.io"], "1",
        "{after}"
    );
    // The virt-launcher pod requests the guest's memory (and a little more).
    assert_ne!(q["used"]["requests.memory"], "0", "{after}");
    assert_eq!(after["live_vms"], 1);
    assert!(after["quota_error"].is_null(), "{after}");
    // The quota was charged the VM's launcher pod, KubeVirt's overhead included, and the
    // memory left allows that many fewer sessions.
    let m = &after["memory"];
    assert_eq!(m["used_bytes"], QUICK_VM, "{after}");
    assert_eq!(m["free_bytes"], HARD - QUICK_VM);
    assert_eq!(
        lesson(m, "quick")["more_sessions"],
        (HARD - QUICK_VM) / QUICK_VM
    );
    assert_eq!(
        lesson(m, "duo")["more_sessions"],
        (HARD - QUICK_VM) / (2 * QUICK_VM)
    );

    // Every field shown is described by the OpenAPI document.
    let (_, doc) = s.raw("GET", "/api/openapi.json", None, None, vec![]).await;
    let described = doc["components"]["schemas"]["Capacity"]["properties"]
        .as_object()
        .expect("a Capacity schema");
    for key in after.as_object().unwrap().keys() {
        assert!(described.contains_key(key), "{key} is not documented");
    }
    s.stop().await;
}

#[test]
fn the_pod_sample_lesson_loads_with_the_others() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lessons");
    let set = ttlab_lesson::LessonSet::load(&dir).unwrap();
    let lesson = set
        .get(&"shell-basics".parse().unwrap())
        .expect("the pod sample");
    assert_eq!(lesson.runtime, ttlab_model::Runtime::Pod);
    assert_eq!(lesson.grading.len(), 4);
}
