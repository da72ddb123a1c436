//! Graceful hand-over against kube-sim and a real PostgreSQL: a server told to stop refuses
//! new starts with a clear 503, keeps serving everything else, and lets go of the session it
//! was preparing, which another replica adopts and finishes.

use crate::support;

use serde_json::json;
use support::{World, policy, token};
use ttlab_api::auth::Role;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_handing_over_refuses_new_starts_and_another_finishes_its_session() {
    let w = World::new().await;
    w.sim.pause_kubevirt(true);
    let a = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = a
        .post("/api/sessions", &alice, json!({"lesson": "duo"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = v["id"].as_str().unwrap().to_owned();
    a.wait_session(&sid, &alice, |v| v["stages"]["vm_created"].is_string())
        .await;

    // SIGTERM's work, as the binary does it.
    let began = std::time::Instant::now();
    ttlab_api::saga::hand_over(&a.state).await;
    assert!(
        began.elapsed() < ttlab_api::saga::HAND_OVER_WAIT,
        "the provisioning task let go in {:?}",
        began.elapsed()
    );
    assert!(a.state.is_draining());

    // New starts: a clear, retryable 503; everything else is still served.
    let bob = token("bob", Role::Student);
    let (status, v) = a
        .post("/api/sessions", &bob, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"], "shutting_down", "{v}");
    assert!(v["message"].as_str().unwrap().contains("try again"), "{v}");
    let (status, v) = a.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "starting", "{v}");
    // Its lease is free at once (released, not left to expire).
    let store = w.db.store().await.unwrap();
    assert!(
        !store
            .provisioning_in_progress(sid.parse().unwrap())
            .await
            .unwrap()
    );

    // Another replica adopts it (within its adoption pass) and finishes it.
    let b = w.server(policy(3600, 7200, 3), 8).await;
    w.sim.pause_kubevirt(false);
    let v = b
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(w.sim.stats().peak_vms, 2, "{:?}", w.sim.stats());
    // And bob starts on the replica that is not stopping.
    let (status, v) = b
        .post("/api/sessions", &bob, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    a.stop().await;
    b.stop().await;
}
