//! A "Start lab" queued behind a capacity lock that stays held (a slow or vanished holder)
//! gets a clear, retryable 503 within the bound, not a hang; the next start goes through once
//! the lock is free.

use crate::support;

use serde_json::json;
use support::{World, policy, token};
use ttlab_api::auth::Role;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_start_behind_a_held_capacity_lock_is_told_to_retry_within_the_bound() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let store = w.db.store().await.unwrap();
    // Someone else counts capacity and never finishes.
    let held = store.lock_capacity().await.unwrap();
    let alice = token("alice", Role::Student);
    let started = std::time::Instant::now();
    let (status, v) = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        s.post("/api/sessions", &alice, json!({"lesson": "quick"})),
    )
    .await
    .expect("answered, not hung");
    let took = started.elapsed();
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"], "overloaded", "{v}");
    assert!(v["message"].as_str().unwrap().contains("try again"), "{v}");
    // The default bound is 5 s.
    assert!(took >= std::time::Duration::from_secs(4), "{took:?}");
    assert!(took < std::time::Duration::from_secs(20), "{took:?}");
    // Nothing was opened for her; once the lock is free, her retry goes through.
    let (status, _) = s.get("/api/sessions/current", &alice).await;
    assert_ne!(status, 200);
    held.rollback().await.unwrap();
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    s.stop().await;
}
