//! PostgreSQL stopped and restarted under load: while it is down every answer that needs it
//! is 503 `database_unavailable` with the error body, quickly; afterwards the same server
//! serves again, sessions opened before are intact, and the session being provisioned across
//! the outage ends cleanly without leaking anything.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Running, World, policy, token};
use ttlab_api::auth::Role;
use ttlab_store::ephemeral::PgCluster;
use ttlab_store::{Store, StoreOptions};

/// The longest any request may take, database up or down.
const REQUEST_BOUND: Duration = Duration::from_secs(8);

fn id(v: &Value) -> String {
    v["id"].as_str().expect("an id").to_owned()
}

/// One request of the load, bounded; a hang or a dropped connection fails the test.
async fn timed(s: &Running, method: &str, path: &str, tok: &str) -> (u16, Value, Duration) {
    let started = Instant::now();
    let fut = async {
        match method {
            "GET" => s.get(path, tok).await,
            _ => s.post(path, tok, json!({"lesson": "quick"})).await,
        }
    };
    let (status, body) = tokio::time::timeout(REQUEST_BOUND, fut)
        .await
        .unwrap_or_else(|_| panic!("{method} {path} took longer than {REQUEST_BOUND:?}"));
    (status, body, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_stopped_and_restarted_under_load() {
    let w = World::new().await;
    let mut pg = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .unwrap()
        .unwrap();
    let url = pg.create_database("ttlab").await.unwrap();
    let options = StoreOptions {
        max_connections: 8,
        acquire_timeout: Duration::from_secs(2),
        ..StoreOptions::default()
    };
    let store = Store::connect(&url, options).await.unwrap();
    store.migrate().await.unwrap();
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    // The load below extends and grades as one student many times a second: what is tested
    // is the outage, not the per-user rate limit (crates/api/tests/suite/resilience.rs has that).
    config.user_rate_limit = ttlab_api::limits::RateLimit::OFF;
    let s = w.serve_on(config, store.clone()).await;

    // Before: alice runs; bob's session is being provisioned (the guests are held).
    let alice = token("alice", Role::Student);
    let (_, a) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    let alice_id = id(&a);
    let before = s
        .wait_session(&alice_id, &alice, |v| v["status"] == "running")
        .await;
    w.sim.pause_kubevirt(true);
    let bob = token("bob", Role::Student);
    let (status, b) = s
        .post("/api/sessions", &bob, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{b}");
    let bob_id = id(&b);
    s.wait_session(&bob_id, &bob, |v| v["stages"]["vm_created"].is_string())
        .await;

    // The load: reads of both sessions, the current session, and new sessions, in a loop.
    let down = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let s = Arc::new(s);
    let mut load = Vec::new();
    for worker in 0..3 {
        let (s, down, stop) = (s.clone(), down.clone(), stop.clone());
        let (alice, bob, alice_id, bob_id) =
            (alice.clone(), bob.clone(), alice_id.clone(), bob_id.clone());
        load.push(tokio::spawn(async move {
            let carol = token(&format!("carol{worker}"), Role::Student);
            let mut answers = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let was_down = down.load(Ordering::SeqCst);
                for (method, path, tok) in [
                    ("GET", format!("/api/sessions/{alice_id}"), &alice),
                    ("GET", format!("/api/sessions/{bob_id}"), &bob),
                    ("GET", "/api/sessions/current".to_owned(), &alice),
                    ("POST", "/api/sessions".to_owned(), &carol),
                ] {
                    let (status, body, took) = timed(&s, method, &path, tok).await;
                    answers.push((was_down, method, path, status, body, took));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            answers
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Down for a few seconds; the guests start meanwhile, so provisioning meets the outage.
    down.store(true, Ordering::SeqCst);
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    w.sim.pause_kubevirt(false);
    let (status, e, _) = timed(&s, "GET", &format!("/api/sessions/{alice_id}"), &alice).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("database_unavailable")),
        "{e}"
    );
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
    let (status, _) = s.raw("GET", "/readyz", None, None, vec![]).await;
    assert_eq!(status, 503);
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::task::block_in_place(|| pg.resume()).unwrap();
    let resumed = Instant::now();
    down.store(false, Ordering::SeqCst);

    // Service resumes without a restart of the server.
    let back = loop {
        let (status, v, _) = timed(&s, "GET", &format!("/api/sessions/{alice_id}"), &alice).await;
        if status == 200 {
            break v;
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(15),
            "still {status} {v} after the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let mut answers = Vec::new();
    for l in load {
        answers.extend(l.await.unwrap());
    }

    let mut outage_503 = 0;
    for (was_down, method, path, status, body, took) in &answers {
        assert!(*took < REQUEST_BOUND, "{method} {path} took {took:?}");
        match status {
            200 | 202 | 409 => {}
            503 => {
                assert!(body["message"].is_string(), "{body}");
                let code = body["error"].as_str().unwrap_or("");
                assert!(
                    matches!(code, "database_unavailable" | "capacity"),
                    "{method} {path}: {body}"
                );
                if *was_down && code == "database_unavailable" {
                    outage_503 += 1;
                }
            }
            other => panic!("{method} {path} answered {other}: {body}"),
        }
    }
    assert!(outage_503 > 0, "no request saw the outage");

    // Nothing lost: alice's session is as it was.
    for key in ["status", "expires_at", "started_at", "extensions_used"] {
        assert_eq!(back[key], before[key], "{key}");
    }
    // Bob's session, provisioned across the outage, ends cleanly: running, or failed with
    // nothing of it left in the cluster.
    let bob_now = s
        .wait_session(&bob_id, &bob, |v| {
            v["status"] == "running" || v["status"] == "failed"
        })
        .await;
    if bob_now["status"] == "failed" {
        let vm = bob_now["nodes"][0]["vm"].as_str().unwrap();
        assert!(
            w.sim.get("virtualmachines", support::NS, vm).is_none(),
            "{bob_now}"
        );
    }
    // And new work goes through.
    let dave = token("dave", Role::Student);
    let (status, d) = s
        .post("/api/sessions", &dave, json!({"lesson": "quick"}))
        .await;
    if status == 202 {
        let d = s
            .wait_session(&id(&d), &dave, |v| v["status"] != "starting")
            .await;
        assert_eq!(d["status"], "running", "{d}");
    } else {
        assert_eq!(
            (status, d["error"].as_str()),
            (503, Some("capacity")),
            "{d}"
        );
    }
    // Every VM in the cluster belongs to a live session. The cluster is listed first: a VM
    // is only created after its name is recorded on its session's row.
    let cluster = w.cluster().await;
    use ttlab_cluster::ReaperCluster as _;
    let vms = cluster
        .list_all(
            ttlab_cluster::Kind::VirtualMachine,
            &ttlab_model::labels::managed_selector(),
        )
        .await
        .unwrap();
    let rows = store
        .sessions()
        .list_recent(&"dev".parse().unwrap(), 1000)
        .await
        .unwrap();
    for vm in vms.iter().filter(|v| !v.deleting) {
        let owners: Vec<_> = rows
            .iter()
            .filter(|r| r.vms.iter().any(|v| v.name == vm.name))
            .map(|r| (r.status, r.failure_reason.clone()))
            .collect();
        assert!(
            owners.iter().any(|(status, _)| status.is_live()),
            "{} has no live session: {owners:?}",
            vm.name
        );
    }
    if let Ok(s) = Arc::try_unwrap(s) {
        s.stop().await;
    }
    tokio::task::block_in_place(|| pg.stop()).unwrap();
}
