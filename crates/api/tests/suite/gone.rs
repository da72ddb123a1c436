//! "Ended" means gone, on the server, against real PostgreSQL, kube-sim over HTTP and the real
//! agent binary: a session ended by its student or by an operator whose VM lingers in
//! deletion (KubeVirt keeps its finalizer, as for a guest still shutting down or a VM on a
//! dead node) stays `finishing`, counts against the VM limit, is shown as terminating on the
//! admin views and in the metrics, and goes final — with the time its objects were confirmed
//! gone — only once the VM is gone.

use crate::support;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use support::{NS, Running, World, policy, start_running, token};
use ttlab_api::auth::Role;

/// The VM of the one-node session `sid`.
fn vm_of(sid: &str) -> String {
    ttlab_vm_manifest::vm_name(sid.parse().unwrap(), &"vm".parse().unwrap())
}

fn instant(v: &Value) -> DateTime<Utc> {
    v.as_str()
        .unwrap_or_else(|| panic!("not an instant: {v}"))
        .parse()
        .unwrap()
}

/// The server's metrics, as text.
async fn metrics(s: &Running) -> String {
    let (status, m) = s.raw("GET", "/metrics", None, None, vec![]).await;
    assert_eq!(status, 200, "{m}");
    m.as_str().unwrap_or_default().to_owned()
}

/// Asserts that the admin views show session `sid` as held back by its VM `vm`, still
/// terminating.
async fn assert_shown_terminating(s: &Running, sid: &str, vm: &str) {
    let admin = token("root", Role::Admin);
    let (status, d) = s.get(&format!("/api/admin/sessions/{sid}"), &admin).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["session"]["status"], "finishing", "{d}");
    assert_eq!(
        d["terminating"]["objects"],
        json!([format!("VirtualMachine/{vm}")]),
        "the detail names what is left: {d}"
    );
    assert!(d["terminating"]["since"].is_string(), "{d}");
    assert_eq!(d["objects_gone_at"], Value::Null, "{d}");
    let listed: Vec<&Value> = d["objects"]
        .as_array()
        .expect("objects")
        .iter()
        .filter(|o| o["kind"] == "VirtualMachine" && o["name"] == vm)
        .collect();
    assert_eq!(listed.len(), 1, "{d}");
    assert_eq!(listed[0]["state"], "deleting", "{d}");

    let (status, cap) = s.get("/api/admin/capacity", &admin).await;
    assert_eq!(status, 200, "{cap}");
    assert_eq!(cap["terminating_vms"], json!([vm]), "{cap}");
    let held: Vec<&Value> = cap["terminating"]
        .as_array()
        .expect("terminating")
        .iter()
        .filter(|t| t["session"] == sid)
        .collect();
    assert_eq!(held.len(), 1, "the capacity view names the session: {cap}");
    assert_eq!(held[0]["objects"], json!([format!("VirtualMachine/{vm}")]));
    assert_eq!(held[0]["finishing_to"], "finished");

    let text = metrics(s).await;
    assert!(
        text.contains("ttlab_objects_terminating{kind=\"VirtualMachine\"} 1"),
        "{text}"
    );
}

/// Lets KubeVirt act again and polls session `sid` (as its student, `student`) until it is
/// final, checking at every look that it is not final while its VM `vm` still exists. Returns
/// the final view.
async fn resume_until_final(w: &World, s: &Running, sid: &str, student: &str, vm: &str) -> Value {
    w.sim.pause_kubevirt(false);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        let (status, v) = s.get(&format!("/api/sessions/{sid}"), student).await;
        assert_eq!(status, 200, "{v}");
        if v["status"] != "finishing" {
            assert!(
                w.sim.get("virtualmachines", NS, vm).is_none(),
                "final while its VM still exists: {v}"
            );
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still finishing 40 s after its VM could go: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_finished_session_whose_vm_lingers_stays_finishing_counted_and_shown_until_it_is_gone() {
    let w = World::new().await;
    // One VM place: whatever holds it refuses the next start.
    let s = w.server(policy(3600, 7200, 3), 1).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let vm = vm_of(&sid);
    // KubeVirt stops acting: once the VM is deleted its finalizer stays, as while a guest
    // shuts down or for a VM on a dead node.
    w.sim.pause_kubevirt(true);

    let (status, v) = s.delete(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["status"], "finishing",
        "not final while its VM is still there: {v}"
    );
    assert_eq!(v["finishing_to"], "finished", "{v}");
    let lingering = w
        .sim
        .get("virtualmachines", NS, &vm)
        .expect("the VM is still there");
    assert!(
        lingering["metadata"]["deletionTimestamp"].is_string(),
        "its deletion was accepted: {lingering}"
    );

    // It still takes its place: a start that would pass the limit is refused.
    let bob = token("bob", Role::Student);
    let (status, e) = s
        .post("/api/sessions", &bob, json!({"lesson": "quick"}))
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("capacity")),
        "{e}"
    );
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("1 VM still shutting down")),
        "{e}"
    );
    // And its student's one session.
    let (status, e) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 409, "{e}");

    assert_shown_terminating(&s, &sid, &vm).await;
    // Well past the seconds the finish waited, nothing has changed while the VM is there.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(v["status"], "finishing", "{v}");

    let store = w.db.store().await.unwrap();
    let before_gone = store.db_now().await.unwrap();
    let done = resume_until_final(&w, &s, &sid, &alice, &vm).await;
    assert_eq!(done["status"], "finished", "{done}");
    let gone_at = store
        .sessions()
        .objects_gone_at(sid.parse().unwrap())
        .await
        .unwrap()
        .expect("the time its objects were confirmed gone");
    assert!(gone_at > before_gone, "{gone_at} vs {before_gone}");

    let admin = token("root", Role::Admin);
    let (_, d) = s.get(&format!("/api/admin/sessions/{sid}"), &admin).await;
    assert_eq!(d["terminating"], Value::Null, "{d}");
    assert_eq!(instant(&d["objects_gone_at"]), gone_at, "{d}");
    let (_, cap) = s.get("/api/admin/capacity", &admin).await;
    assert_eq!(cap["terminating"], json!([]), "{cap}");
    let text = metrics(&s).await;
    assert!(
        text.contains("ttlab_objects_terminating{kind=\"VirtualMachine\"} 0"),
        "{text}"
    );
    // The place is free again.
    let (status, v) = s
        .post("/api/sessions", &bob, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    s.wait_session(v["id"].as_str().unwrap(), &bob, |v| {
        v["status"] == "running"
    })
    .await;
    s.stop().await;
}

#[tokio::test]
async fn an_operators_end_of_a_session_whose_vm_lingers_goes_final_only_once_it_is_gone() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 1).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let vm = vm_of(&sid);
    w.sim.pause_kubevirt(true);

    let admin = token("root", Role::Admin);
    let (status, r) = s
        .post(
            &format!("/api/admin/sessions/{sid}/end"),
            &admin,
            json!({"reason": "left running after class"}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["action"]["action"], "end", "{r}");
    assert_eq!(
        r["session"]["status"], "finishing",
        "not reclaimed while its VM is still deleting: {r}"
    );
    assert!(w.sim.get("virtualmachines", NS, &vm).is_some());
    assert_shown_terminating(&s, &sid, &vm).await;
    let bob = token("bob", Role::Student);
    let (status, e) = s
        .post("/api/sessions", &bob, json!({"lesson": "quick"}))
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("capacity")),
        "{e}"
    );

    let done = resume_until_final(&w, &s, &sid, &alice, &vm).await;
    assert_eq!(done["status"], "finished", "{done}");
    let (_, d) = s.get(&format!("/api/admin/sessions/{sid}"), &admin).await;
    let reclaimed = d["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|st| st["stage"] == "reclaimed")
        .cloned()
        .unwrap();
    assert_eq!(
        instant(&reclaimed["at"]),
        instant(&d["objects_gone_at"]),
        "{d}"
    );
    s.stop().await;
}
