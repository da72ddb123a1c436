//! The waitlist against real PostgreSQL and kube-sim over HTTP: two server replicas on one
//! database, the order decided by the database, a freed place held for the first in line
//! only, a lapsed hold passing on, the one-session-per-person rule, and a start the
//! namespace's quota refused at capacity going back in the line at the front.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{Running, World, policy, token};
use ttlab_api::auth::Role;

fn id(v: &Value) -> String {
    v["id"].as_str().expect("an id").to_owned()
}

async fn start(s: &Running, who: &str, lesson: &str) -> (u16, Value) {
    s.post(
        "/api/sessions",
        &token(who, Role::Student),
        json!({ "lesson": lesson }),
    )
    .await
}

async fn join(s: &Running, who: &str, lesson: &str) -> (u16, Value) {
    s.post(
        "/api/waitlist",
        &token(who, Role::Student),
        json!({ "lesson": lesson }),
    )
    .await
}

async fn place(s: &Running, who: &str) -> Value {
    let (status, v) = s.get("/api/waitlist", &token(who, Role::Student)).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// Polls `who`'s place until `pred` holds (bounded: 20 s).
async fn wait_place(s: &Running, who: &str, pred: impl Fn(&Value) -> bool) -> Value {
    for _ in 0..400 {
        let v = place(s, who).await;
        if pred(&v) {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{who}'s waitlist place never reached the expected state");
}

/// Starts `who`'s lab and waits until it runs; its id.
async fn running(s: &Running, who: &str, lesson: &str) -> String {
    let (status, v) = start(s, who, lesson).await;
    assert_eq!(status, 202, "{v}");
    let sid = id(&v);
    let v = s
        .wait_session(&sid, &token(who, Role::Student), |v| {
            v["status"] != "starting"
        })
        .await;
    assert_eq!(v["status"], "running", "{v}");
    sid
}

/// The value of a counter summed over replicas.
async fn counter(replicas: &[&Running], name: &str) -> u64 {
    let mut total = 0;
    for s in replicas {
        let (status, m) = s.raw("GET", "/metrics", None, None, vec![]).await;
        assert_eq!(status, 200);
        let text = m.as_str().unwrap().to_owned();
        let line = text
            .lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .unwrap_or_else(|| panic!("{name} not in the metrics:\n{text}"));
        total += line
            .split_whitespace()
            .last()
            .unwrap()
            .parse::<u64>()
            .unwrap();
    }
    total
}

async fn two_replicas(w: &World, hold: Duration) -> (Running, Running) {
    let mut config = w.config(policy(3600, 7200, 3), 1).await;
    config.waitlist_hold = hold;
    let a = w.serve(config.clone()).await;
    let b = w.serve(config).await;
    (a, b)
}

#[tokio::test]
async fn the_first_to_wait_gets_the_freed_place_whichever_replica_they_asked() {
    let w = World::new().await;
    let (a, b) = two_replicas(&w, Duration::from_secs(60)).await;
    let alice = running(&a, "alice", "quick").await;

    // Full: bob is refused, joins on replica b; carol joins after him on replica a.
    let (status, v) = start(&b, "bob", "quick").await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"], "capacity");
    let (status, v) = join(&b, "bob", "quick").await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["waiting"], true);
    assert_eq!(v["position"], 1, "{v}");
    assert!(v.get("held_until").is_none(), "{v}");
    // Without a hold, the place lapses after the longest wait (an hour by default): the page
    // tells the student why when it does.
    assert_eq!(v["max_wait_seconds"], 3600, "{v}");
    let leaves = v["leaves_in_seconds"].as_i64().unwrap();
    assert!((3590..=3600).contains(&leaves), "{v}");
    assert!(v["leaves_at"].is_string(), "{v}");
    let (status, v) = join(&a, "carol", "quick").await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["position"], 2, "{v}");
    // The database decides: either replica tells the same order.
    assert_eq!(place(&a, "bob").await["position"], 1);
    assert_eq!(place(&b, "carol").await["position"], 2);

    // One entry per user, and a live lab cannot wait.
    let (status, v) = join(&a, "bob", "quick").await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"], "already_waiting");
    let (status, v) = join(&b, "alice", "quick").await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"], "session_exists");
    assert_eq!(place(&a, "alice").await["waiting"], false);

    // Alice ends her lab: the freed place is held for bob, the first in line.
    let (status, v) = a
        .delete(
            &format!("/api/sessions/{alice}"),
            &token("alice", Role::Student),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let held = wait_place(&a, "bob", |v| v.get("held_until").is_some()).await;
    assert_eq!(held["position"], 1, "{held}");
    let left = held["hold_seconds_left"].as_i64().unwrap();
    assert!((50..=60).contains(&left), "{held}");
    // A held place no longer lapses by waiting.
    assert!(held.get("leaves_at").is_none(), "{held}");

    // During the hold, nobody else takes the place: not the second in line, not a newcomer
    // (on either replica).
    let carol = place(&b, "carol").await;
    assert!(carol.get("held_until").is_none(), "{carol}");
    assert_eq!(carol["position"], 2, "{carol}");
    for (s, who) in [(&a, "carol"), (&b, "carol"), (&a, "dave"), (&b, "dave")] {
        let (status, v) = start(s, who, "quick").await;
        assert_eq!(status, 503, "{who}: {v}");
        assert_eq!(v["error"], "capacity", "{v}");
    }

    // Bob takes it, on the other replica than the one he joined on; he no longer waits and
    // carol is first now.
    let bob = running(&a, "bob", "quick").await;
    assert_eq!(place(&b, "bob").await["waiting"], false);
    assert_eq!(place(&a, "carol").await["position"], 1);
    // One place, one hold: the two replicas never granted it twice.
    assert_eq!(counter(&[&a, &b], "ttlab_waitlist_granted_total").await, 1);
    assert_eq!(counter(&[&a, &b], "ttlab_waitlist_joined_total").await, 2);

    // Carol leaves: she is off the list, and leaving twice is a client mistake.
    let carol_token = token("carol", Role::Student);
    let (status, v) = b.delete("/api/waitlist", &carol_token).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["waiting"], false);
    let (status, v) = a.delete("/api/waitlist", &carol_token).await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"], "not_waiting");

    let (status, _) = a
        .delete(
            &format!("/api/sessions/{bob}"),
            &token("bob", Role::Student),
        )
        .await;
    assert_eq!(status, 200);
    w.wait_empty().await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_lapsed_hold_passes_to_the_next_in_line() {
    let w = World::new().await;
    let (a, b) = two_replicas(&w, Duration::from_secs(2)).await;
    let alice = running(&a, "alice", "quick").await;
    assert_eq!(join(&a, "bob", "quick").await.0, 201);
    assert_eq!(join(&b, "carol", "quick").await.0, 201);
    let (status, _) = a
        .delete(
            &format!("/api/sessions/{alice}"),
            &token("alice", Role::Student),
        )
        .await;
    assert_eq!(status, 200);
    wait_place(&b, "bob", |v| v.get("held_until").is_some()).await;

    // Bob does not come back in time: his hold lapses, he is removed, carol gets the place.
    let carol = wait_place(&a, "carol", |v| v.get("held_until").is_some()).await;
    assert_eq!(carol["position"], 1, "{carol}");
    assert_eq!(place(&a, "bob").await["waiting"], false);
    let (status, v) = start(&b, "bob", "quick").await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"], "capacity");
    assert_eq!(counter(&[&a, &b], "ttlab_waitlist_lapsed_total").await, 1);
    assert_eq!(counter(&[&a, &b], "ttlab_waitlist_granted_total").await, 2);

    let carol = running(&b, "carol", "quick").await;
    let (status, _) = b
        .delete(
            &format!("/api/sessions/{carol}"),
            &token("carol", Role::Student),
        )
        .await;
    assert_eq!(status, 200);
    w.wait_empty().await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn waitlist_mistakes_are_answered_4xx() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 1).await;
    let erin = token("erin", Role::Student);

    let (status, v) = join(&s, "erin", "no-such-lab").await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"], "lesson_not_found");
    let (status, v) = join(&s, "erin", "shell").await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"], "not_limited");
    let (status, v) = s
        .post("/api/waitlist", &erin, json!({"lesson": "quick", "x": 1}))
        .await;
    assert_eq!(status, 400, "{v}");
    let (status, v) = s
        .raw(
            "POST",
            "/api/waitlist",
            Some(&erin),
            Some("application/json"),
            b"{not json".to_vec(),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    let (status, v) = s.delete("/api/waitlist", &erin).await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v["error"], "not_waiting");
    let (status, _) = s.raw("GET", "/api/waitlist", None, None, vec![]).await;
    assert_eq!(status, 401);

    // Waiting for one lab, erin cannot open another (a pod lab included) meanwhile.
    let (status, v) = join(&s, "erin", "quick").await;
    assert_eq!(status, 201, "{v}");
    for lesson in ["duo", "shell"] {
        let (status, v) = start(&s, "erin", lesson).await;
        assert_eq!(status, 409, "{lesson}: {v}");
        assert_eq!(v["error"], "waiting", "{v}");
        assert!(v["message"].as_str().unwrap().contains("quick"), "{v}");
    }
    s.stop().await;
}

#[tokio::test]
async fn a_start_the_quota_refuses_at_capacity_goes_back_in_the_line_at_the_front() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 7200, 3), 2).await;
    config.waitlist_hold = Duration::from_secs(60);
    config.quota_recount_wait = Duration::from_secs(1);
    let s = w.serve(config).await;
    let alice = running(&s, "alice", "quick").await;
    // The namespace's quota is used up by VMs the server does not count (another server
    // took the last place a moment ago): it refuses bob's VM however often he tries.
    let full = ttlab_kube_sim::FaultRule {
        action: ttlab_kube_sim::FaultAction::Fail {
            status: 403,
            message: Some(
                "virtualmachines.kubevirt.io \"tt-x-vm\" is forbidden: exceeded quota: \
                 ttlab-vms, requested: count/virtualmachines.kubevirt.io=1, used: \
                 count/virtualmachines.kubevirt.io=2, limited: count/virtualmachines.kubevirt.io=2"
                    .to_owned(),
            ),
        },
        ..ttlab_kube_sim::FaultRule::fail(
            Some(ttlab_kube_sim::Verb::Create),
            Some("virtualmachines"),
            403,
        )
    };
    let rule = w.sim.faults().add(full);
    let bob_token = token("bob", Role::Student);
    let (status, v) = start(&s, "bob", "quick").await;
    assert_eq!(status, 202, "{v}");
    let bob_session = id(&v);
    // Carol joins the line while bob's lab is being created.
    let (status, v) = join(&s, "carol", "quick").await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["position"], 1, "{v}");
    let ended = s
        .wait_session(&bob_session, &bob_token, |v| {
            v["status"]
                .as_str()
                .is_some_and(|s| s != "starting" && s != "finishing")
        })
        .await;
    // Not a failure: the session ends `requeued`, saying so.
    assert_eq!(ended["status"], "requeued", "{ended}");
    let reason = ended["failure_reason"].as_str().unwrap();
    assert!(
        reason.contains("the lab namespace was full") && reason.contains("back in the line"),
        "{reason}"
    );
    // Bob is back in the line ahead of carol, who joined before him.
    let bob = wait_place(&s, "bob", |v| v["waiting"] == true).await;
    assert_eq!(bob["position"], 1, "{bob}");
    assert_eq!(place(&s, "carol").await["position"], 2);
    // The free place is held for him, not for carol.
    wait_place(&s, "bob", |v| v.get("held_until").is_some()).await;
    let carol = place(&s, "carol").await;
    assert!(carol.get("held_until").is_none(), "{carol}");
    // The quota has room again: bob takes his place and his lab runs, one VM of his.
    assert!(w.sim.faults().remove(rule));
    let bob = running(&s, "bob", "quick").await;
    assert_eq!(place(&s, "bob").await["waiting"], false);
    assert_eq!(w.sim.stats().vms, 2, "alice's and bob's");

    for (sid, who) in [(alice, "alice"), (bob, "bob")] {
        let (status, _) = s
            .delete(&format!("/api/sessions/{sid}"), &token(who, Role::Student))
            .await;
        assert_eq!(status, 200);
    }
    w.wait_empty().await;
    s.stop().await;
}
