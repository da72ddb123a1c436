//! Warm pools through the real server on kube-sim and a real PostgreSQL: claims on two
//! replicas never share a member, a claimed member's boot token stops working and its hard
//! deadline becomes the session's, the pool never takes a cold start's places, a member
//! past its age limit is replaced, and a member that cannot be handed over is replaced by the
//! next one or a cold start without the student seeing it; with none ready, a member being
//! prepared is claimed and handed over when it is ready.

use crate::support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{LESSONS, NS, Running, World, policy, token};
use ttlab_agent::AgentClient;
use ttlab_agent::protocol::AgentToken;
use ttlab_api::auth::Role;
use ttlab_lesson::LessonSet;
use ttlab_model::{NodeName, SessionId};

/// A single-node lesson with a pool of three.
const POOLED: &str = r#"
id: pooled
title: Pooled
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
pool:
  size: 3
grading:
  - name: passes
    command: "true"
"#;

/// The test lessons with the pooled one.
fn lessons() -> LessonSet {
    LessonSet::from_sources([
        ("test.yaml".into(), LESSONS.to_owned()),
        ("pooled.yaml".into(), POOLED.to_owned()),
    ])
    .unwrap()
}

async fn pooled_server(w: &World, vm_limit: usize) -> Running {
    let mut config = w.config(policy(3600, 7200, 3), vm_limit).await;
    config.lessons = lessons();
    w.serve(config).await
}

fn admin() -> String {
    token("operator", Role::Admin)
}

/// The pool's state as the admin API shows it.
async fn pool(s: &Running, lesson: &str) -> Value {
    let (status, v) = s.get(&format!("/api/admin/pools/{lesson}"), &admin()).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// An operator's `PUT` of a pool's settings.
async fn put_pool(s: &Running, path: &str, body: Value) -> (u16, Value) {
    s.raw(
        "PUT",
        path,
        Some(&admin()),
        Some("application/json"),
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

/// Waits (60 s at most) until `lesson`'s pool has `ready` members ready.
async fn wait_ready(s: &Running, lesson: &str, ready: u64) -> Value {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let v = pool(s, lesson).await;
        if v["ready"].as_u64() == Some(ready) && v["preparing"].as_u64() == Some(0) {
            return v;
        }
        assert!(
            Instant::now() < until,
            "the pool never had {ready} ready: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_students_on_two_replicas_never_share_a_member_and_a_double_click_gets_one_session() {
    let w = World::new().await;
    let a = Arc::new(pooled_server(&w, 80).await);
    let b = Arc::new(pooled_server(&w, 80).await);
    wait_ready(&a, "pooled", 3).await;

    // Fifty students at once, every other one on the other replica.
    let clicks: Vec<_> = (0..50)
        .map(|i| {
            let replica = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move {
                let t = token(&format!("student{i:02}"), Role::Student);
                let (status, v) = replica
                    .post("/api/sessions", &t, json!({"lesson": "pooled"}))
                    .await;
                (status, v, t)
            })
        })
        .collect();
    let mut ids = BTreeSet::new();
    let mut hits = 0;
    let mut followed = Vec::new();
    for c in clicks {
        let (status, v, t) = c.await.unwrap();
        assert_eq!(status, 202, "{v}");
        let id = v["id"].as_str().unwrap().to_owned();
        assert!(ids.insert(id.clone()), "session {id} given twice");
        if v["status"] == "running" {
            hits += 1;
        }
        followed.push((id, t));
    }
    assert_eq!(ids.len(), 50);
    // The three ready members went to three students (refills may have served a few more),
    // and nobody got a member someone else had.
    assert!(hits >= 3, "only {hits} clicks were served by the pool");
    let store = w.db.store().await.unwrap();
    let mut claimed_by = BTreeSet::new();
    for (id, _) in &followed {
        let s = store
            .sessions()
            .get(id.parse().unwrap())
            .await
            .unwrap()
            .unwrap();
        let user = s.user.clone().expect("every session has its student");
        assert!(
            claimed_by.insert(user.to_string()),
            "{user} has two sessions"
        );
    }
    // Every one of them runs.
    for (id, t) in &followed {
        let v = a.wait_session(id, t, |v| v["status"] != "starting").await;
        assert_eq!(v["status"], "running", "{v}");
    }

    // A double click on a pooled lesson: one session, and a clear 409 for the other click.
    wait_ready(&a, "pooled", 3).await;
    let t = token("doubleclick", Role::Student);
    let (x, y) = tokio::join!(
        a.post("/api/sessions", &t, json!({"lesson": "pooled"})),
        b.post("/api/sessions", &t, json!({"lesson": "pooled"})),
    );
    let mut statuses = [x.0, y.0];
    statuses.sort();
    assert_eq!(statuses, [202, 409], "{x:?} {y:?}");
    let conflict = if x.0 == 409 { &x.1 } else { &y.1 };
    assert_eq!(conflict["error"], "session_exists", "{conflict}");
    for replica in [a, b] {
        if let Ok(r) = Arc::try_unwrap(replica) {
            r.stop().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claimed_member_refuses_its_boot_token_and_powers_off_at_the_sessions_deadline() {
    let w = World::new().await;
    let s = pooled_server(&w, 20).await;
    wait_ready(&s, "pooled", 3).await;
    let store = w.db.store().await.unwrap();
    let node: NodeName = "vm".parse().unwrap();
    // The boot tokens of the ready members.
    let members = store
        .pools()
        .members(&"dev".parse().unwrap(), &"pooled".parse().unwrap())
        .await
        .unwrap();
    let mut boot_tokens = std::collections::BTreeMap::new();
    for m in &members {
        let t = store
            .agent_tokens()
            .get(m.id, &node)
            .await
            .unwrap()
            .unwrap();
        boot_tokens.insert(m.id, t);
    }

    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "pooled"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "running", "served by the pool: {v}");
    let id: SessionId = v["id"].as_str().unwrap().parse().unwrap();
    let boot = boot_tokens.get(&id).expect("a member was claimed").clone();
    let vm = ttlab_vm_manifest::vm_name(id, &node);
    let ip = w.sim.guest_ip(NS, &vm).expect("the guest's address");
    let addr = std::net::SocketAddr::new(ip.into(), s.state.config().agent_port);

    // The token the member booted with is refused; the rotated one, stored, works.
    let old = AgentClient::new(addr, AgentToken::parse(&boot).unwrap());
    let refused = old.exec("true", Duration::from_secs(5)).await;
    assert!(refused.is_err(), "the boot token still works: {refused:?}");
    let current = store.agent_tokens().get(id, &node).await.unwrap().unwrap();
    assert_ne!(current, boot);
    let new = AgentClient::new(addr, AgentToken::parse(&current).unwrap());
    let ran = new.exec("true", Duration::from_secs(5)).await.unwrap();
    assert_eq!(ran.exit_code, Some(0));
    // Grading (through the server) uses it.
    let (status, graded) = s
        .post(&format!("/api/sessions/{id}/grade"), &alice, json!({}))
        .await;
    assert_eq!(status, 200, "{graded}");
    assert_eq!(graded["passed"], 1, "{graded}");

    // The guest powers off at the session's hard cap plus the grace, not the member's.
    let session = store.sessions().get(id).await.unwrap().unwrap();
    let grace = chrono::TimeDelta::from_std(s.state.config().policy.hard_deadline_grace).unwrap();
    let want = (session.max_expires_at + grace).timestamp();
    let file = w
        .sim
        .guest_dir(NS, &vm)
        .unwrap()
        .join(ttlab_agent::protocol::POWER_OFF_AT_PATH.trim_start_matches('/'));
    let got: i64 = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        got, want,
        "power-off at {got}, the session's deadline is {want}"
    );
    // The lifespan started at the claim, not when the member was prepared.
    assert_eq!(Some(session.started_at), session.claimed_at);
    assert!(session.started_at > session.created_at);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_pool_never_takes_the_places_a_cold_start_needs() {
    let w = World::new().await;
    // Five places; the largest lesson (duo) needs two, so the pool may hold three at most,
    // however large it is asked to be.
    let s = pooled_server(&w, 5).await;
    let (status, v) = put_pool(&s, "/api/admin/pools/pooled", json!({"size": 10})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["source"], "admin", "{v}");
    let v = wait_ready(&s, "pooled", 3).await;
    assert_eq!(v["target"], 10, "{v}");
    assert!(v["deferred"].as_u64().unwrap() > 0, "{v}");
    for _ in 0..20 {
        assert!(w.sim.stats().vms <= 3, "{:?}", w.sim.stats());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A cold start of the largest lesson still finds its places.
    let (status, v) = s
        .post(
            "/api/sessions",
            &token("bob", Role::Student),
            json!({"lesson": "duo"}),
        )
        .await;
    assert_eq!(status, 202, "{v}");
    // Bad settings are the operator's mistake, said plainly.
    let (status, v) = put_pool(&s, "/api/admin/pools/pooled", json!({"size": 5, "max": 2})).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"], "invalid_pool", "{v}");
    let (status, v) = put_pool(&s, "/api/admin/pools/shell", json!({"size": 1})).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"], "not_pooled", "{v}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_older_than_its_age_limit_is_replaced_and_never_reused() {
    let w = World::new().await;
    let s = pooled_server(&w, 20).await;
    wait_ready(&s, "pooled", 3).await;
    let store = w.db.store().await.unwrap();
    let env = "dev".parse().unwrap();
    let lesson = "pooled".parse().unwrap();
    let members = store.pools().members(&env, &lesson).await.unwrap();
    let old = members[0].id;
    // It was created five hours ago (the age limit is four).
    let moved = support::sql(
        &w,
        "UPDATE sessions SET created_at = created_at - interval '5 hours' WHERE id = $1::text::uuid",
        &old.to_string(),
    )
    .await;
    assert_eq!(moved, 1);
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let row = store.sessions().get(old).await.unwrap().unwrap();
        let now = store.pools().members(&env, &lesson).await.unwrap();
        let ready = now
            .iter()
            .filter(|m| m.status == ttlab_model::SessionStatus::Running)
            .count();
        if row.status.is_final() && ready == 3 && now.iter().all(|m| m.id != old) {
            assert_eq!(row.status, ttlab_model::SessionStatus::Expired, "{row:?}");
            assert!(row.user.is_none(), "it served nobody");
            break;
        }
        assert!(
            Instant::now() < until,
            "not replaced: {row:?}, members {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        w.sim
            .get(
                "virtualmachines",
                NS,
                &ttlab_vm_manifest::vm_name(old, &"vm".parse().unwrap())
            )
            .is_none()
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_demand_driven_pool_is_ready_for_the_class_that_started_at_this_time_yesterday() {
    let w = World::new().await;
    let s = pooled_server(&w, 40).await;
    // Five students start the lab and finish it.
    for i in 0..5 {
        let (sid, t) = support::start_running(&s, &format!("yesterday{i}"), "pooled").await;
        let (status, v) = s.delete(&format!("/api/sessions/{sid}"), &t).await;
        assert_eq!(status, 200, "{v}");
    }
    // As if they had started a day ago, a minute from now; the history goes back a week.
    support::sql(
        &w,
        "UPDATE sessions SET created_at = created_at - interval '1 day' + interval '1 minute', \
         claimed_at = claimed_at - interval '1 day' + interval '1 minute' \
         WHERE user_id IS NOT NULL AND lesson = $1",
        "pooled",
    )
    .await;
    let sid = store_any_session(&w).await;
    support::sql(
        &w,
        "UPDATE sessions SET created_at = now() - interval '8 days' WHERE id = $1::text::uuid",
        &sid,
    )
    .await;
    // The pool now follows demand: the five starts of yesterday's next minutes.
    let (status, v) = put_pool(
        &s,
        "/api/admin/pools/pooled",
        json!({"demand": true, "min": 0, "max": 8}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let v = wait_ready(&s, "pooled", 5).await;
    assert_eq!(v["target"], 5, "{v}");
    assert!(
        v["why"].as_str().unwrap_or_default().contains("day"),
        "the reason names the window: {v}"
    );
    s.stop().await;
}

/// The id of some session of the test's database.
async fn store_any_session(w: &World) -> String {
    let store = w.db.store().await.unwrap();
    let rows = store
        .sessions()
        .list_recent(&"dev".parse().unwrap(), 1)
        .await
        .unwrap();
    rows[0].id.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_of_a_two_vm_lesson_hands_over_every_node() {
    let w = World::new().await;
    let s = pooled_server(&w, 20).await;
    // The duo lesson has no pool in its file: an operator gives it one.
    let (status, v) = put_pool(&s, "/api/admin/pools/duo", json!({"size": 1})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["nodes"], 2, "{v}");
    wait_ready(&s, "duo", 1).await;
    let store = w.db.store().await.unwrap();
    let member = store
        .pools()
        .members(&"dev".parse().unwrap(), &"duo".parse().unwrap())
        .await
        .unwrap()
        .remove(0);
    let nodes: Vec<NodeName> = vec!["one".parse().unwrap(), "two".parse().unwrap()];
    let mut boot = Vec::new();
    for n in &nodes {
        boot.push(
            store
                .agent_tokens()
                .get(member.id, n)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let bob = token("bob", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &bob, json!({"lesson": "duo"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(v["id"], member.id.to_string(), "{v}");
    assert_eq!(v["nodes"].as_array().unwrap().len(), 2, "{v}");
    for (n, old) in nodes.iter().zip(&boot) {
        let now = store
            .agent_tokens()
            .get(member.id, n)
            .await
            .unwrap()
            .unwrap();
        assert_ne!(&now, old, "node {n} kept its boot token");
    }
    // Each guest's agent takes its new token and refuses its boot token.
    for (n, old) in nodes.iter().zip(&boot) {
        let vm = ttlab_vm_manifest::vm_name(member.id, n);
        let ip = w.sim.guest_ip(NS, &vm).expect("the guest's address");
        let addr = std::net::SocketAddr::new(ip.into(), s.state.config().agent_port);
        let now = store
            .agent_tokens()
            .get(member.id, n)
            .await
            .unwrap()
            .unwrap();
        let new = AgentClient::new(addr, AgentToken::parse(&now).unwrap());
        assert_eq!(
            new.exec("true", Duration::from_secs(5))
                .await
                .unwrap()
                .exit_code,
            Some(0)
        );
        let stale = AgentClient::new(addr, AgentToken::parse(old).unwrap());
        assert!(
            stale.exec("true", Duration::from_secs(5)).await.is_err(),
            "node {n}"
        );
    }
    s.stop().await;
}

/// Kills the agent of `member`'s only VM: it answers nothing from then on.
fn kill_agent(w: &World, member: SessionId) {
    let vm = ttlab_vm_manifest::vm_name(member, &"vm".parse().unwrap());
    let pid = w.sim.agent_pid(NS, &vm).expect("the guest agent runs");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

/// Waits (30 s at most) until the session `id` is final, and returns it.
async fn wait_final(w: &World, id: SessionId) -> ttlab_store::Session {
    let store = w.db.store().await.unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let s = store.sessions().get(id).await.unwrap().unwrap();
        if s.status.is_final() {
            return s;
        }
        assert!(Instant::now() < until, "{id} never ended: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The value of the metric sample named (with its labels) exactly `series`.
async fn metric(s: &Running, series: &str) -> Option<f64> {
    let (status, body) = s.raw("GET", "/metrics", None, None, Vec::new()).await;
    assert_eq!(status, 200, "{body}");
    let Value::String(text) = body else {
        panic!("not the text format: {body}")
    };
    text.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_cannot_be_handed_over_is_replaced_by_the_next_or_a_cold_start_unseen() {
    let w = World::new().await;
    let s = pooled_server(&w, 20).await;
    wait_ready(&s, "pooled", 3).await;
    // Nothing new is prepared meanwhile: the three ready members are all there is.
    let (status, v) = put_pool(&s, "/api/admin/pools/pooled", json!({"paused": true})).await;
    assert_eq!(status, 200, "{v}");
    let store = w.db.store().await.unwrap();
    let (env, lesson) = ("dev".parse().unwrap(), "pooled".parse().unwrap());
    let mut members = store.pools().members(&env, &lesson).await.unwrap();
    assert_eq!(members.len(), 3);
    members.sort_by_key(|m| (m.ready_at, m.id));
    // The agents of the two longest-ready members, the ones a claim takes first, are dead:
    // neither can be re-armed nor given a new token.
    for m in &members[..2] {
        kill_agent(&w, m.id);
    }
    let node: NodeName = "vm".parse().unwrap();
    let boot = store
        .agent_tokens()
        .get(members[2].id, &node)
        .await
        .unwrap()
        .unwrap();

    // One click: the student gets the third member, running, with no error in between.
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "pooled"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "running", "served by the pool: {v}");
    assert_eq!(v["id"], members[2].id.to_string(), "{v}");
    // It was handed over: its boot token was replaced.
    let current = store
        .agent_tokens()
        .get(members[2].id, &node)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(current, boot);
    // The two that failed are nobody's, failed and reclaimed.
    for m in &members[..2] {
        let ended = wait_final(&w, m.id).await;
        assert_eq!(ended.status.as_str(), "failed", "{ended:?}");
        assert_eq!(ended.user, None, "{ended:?}");
        assert!(
            ended
                .failure_reason
                .as_deref()
                .is_some_and(|r| r.contains("could not be handed over")),
            "{ended:?}"
        );
        let vm = ttlab_vm_manifest::vm_name(m.id, &node);
        assert!(w.sim.guest_ip(NS, &vm).is_none(), "{vm} is still there");
    }
    let v = pool(&s, "pooled").await;
    assert_eq!(v["handover_failures_24h"], 2, "{v}");
    assert_eq!(v["claims_24h"], 3, "{v}");
    assert_eq!(v["hit_rate"], 1.0, "one click, served by the pool: {v}");
    let series = "ttlab_pool_handover_failures_total{lesson=\"pooled\"}";
    assert_eq!(metric(&s, series).await, Some(2.0));

    // A member that fails when no other is ready: the click goes the cold way.
    let (status, v) = put_pool(
        &s,
        "/api/admin/pools/pooled",
        json!({"paused": false, "size": 1}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    wait_ready(&s, "pooled", 1).await;
    let (status, v) = put_pool(&s, "/api/admin/pools/pooled", json!({"paused": true})).await;
    assert_eq!(status, 200, "{v}");
    let last = store.pools().members(&env, &lesson).await.unwrap();
    let last = last
        .iter()
        .find(|m| m.status.as_str() == "running")
        .expect("a ready member");
    kill_agent(&w, last.id);
    let bob = token("bob", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &bob, json!({"lesson": "pooled"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "starting", "a cold start: {v}");
    assert_ne!(v["id"], last.id.to_string(), "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    let v = s
        .wait_session(&id, &bob, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(wait_final(&w, last.id).await.status.as_str(), "failed");
    let v = pool(&s, "pooled").await;
    assert_eq!(v["handover_failures_24h"], 3, "{v}");
    assert_eq!(metric(&s, series).await, Some(3.0));
    s.stop().await;
}

/// A single-node lesson with a pool of one whose guests take seconds to boot and set up.
const SLOW_POOLED: &str = r#"
id: slowpool
title: Slow pool
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
readiness_timeout_seconds: 60
setup_timeout_seconds: 60
pool:
  size: 1
grading:
  - name: passes
    command: "true"
"#;

/// A server with the slow pool of one: its first member ready (one preparation measured),
/// taken by alice, and its replacement being prepared (returned) with no other member.
async fn one_member_being_prepared() -> (World, Running, SessionId) {
    let w = World::with(|c| {
        c.timings.boot = Duration::from_secs(8);
        c.timings.setup = Duration::from_secs(4);
    })
    .await;
    let mut config = w.config(policy(3600, 7200, 3), 20).await;
    config.lessons = LessonSet::from_sources([
        ("test.yaml".into(), LESSONS.to_owned()),
        ("slowpool.yaml".into(), SLOW_POOLED.to_owned()),
    ])
    .unwrap();
    let s = w.serve(config).await;
    let until = Instant::now() + Duration::from_secs(120);
    while pool(&s, "slowpool").await["ready"] != 1 {
        assert!(Instant::now() < until, "no member ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Alice takes it; the pool starts preparing its replacement.
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "slowpool"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "running", "{v}");
    let until = Instant::now() + Duration::from_secs(30);
    while pool(&s, "slowpool").await["preparing"] != 1 {
        assert!(Instant::now() < until, "no member being prepared");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let store = w.db.store().await.unwrap();
    let (env, lesson) = ("dev".parse().unwrap(), "slowpool".parse().unwrap());
    let preparing = store.pools().members(&env, &lesson).await.unwrap();
    assert_eq!(preparing.len(), 1, "{preparing:?}");
    let member = preparing[0].id;
    (w, s, member)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_no_member_ready_a_student_takes_one_being_prepared_and_it_is_handed_over_when_ready()
{
    let (w, s, member) = one_member_being_prepared().await;
    let store = w.db.store().await.unwrap();

    // Bob clicks while it boots: he is given that member, starting, rather than a fresh start.
    let bob = token("bob", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &bob, json!({"lesson": "slowpool"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "starting", "{v}");
    assert_eq!(
        v["id"],
        member.to_string(),
        "the member being prepared: {v}"
    );
    let id = member.to_string();
    let node: NodeName = "vm".parse().unwrap();
    // Its boot token (stored before its VM was created).
    let boot = loop {
        if let Some(t) = store.agent_tokens().get(member, &node).await.unwrap() {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Bob's page follows the member's real stages and the expected time.
    // (It boots for 8 s and sets up for 4 s: it is still starting now.)
    let (status, v) = s.get(&format!("/api/sessions/{id}"), &bob).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "starting", "{v}");
    assert!(v["stages"]["requested"].is_string(), "{v}");
    assert!(v["expected_ready"]["p50_seconds"].is_number(), "{v}");
    let mut seen = BTreeSet::new();
    let until = Instant::now() + Duration::from_secs(90);
    let v = loop {
        let (status, v) = s.get(&format!("/api/sessions/{id}"), &bob).await;
        assert_eq!(status, 200, "{v}");
        if v["status"] != "starting" {
            break v;
        }
        seen.insert(v["stage"].as_str().unwrap_or_default().to_owned());
        assert!(Instant::now() < until, "still starting: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(v["status"], "running", "{v}");
    assert!(
        seen.contains("vmi_running") || seen.contains("agent_up"),
        "the stages of the boot were shown: {seen:?}"
    );
    for stage in ["vm_created", "vmi_running", "agent_up", "ready"] {
        assert!(v["stages"][stage].is_string(), "{stage}: {v}");
    }

    // Handed over at readiness: the boot token refused, the stored new one accepted, and the
    // guest powers off at Bob's session's hard cap plus the grace.
    let session = store.sessions().get(member).await.unwrap().unwrap();
    assert_eq!(session.user.as_ref().map(|u| u.as_str()), Some("bob"));
    let vm = ttlab_vm_manifest::vm_name(member, &node);
    let ip = w.sim.guest_ip(NS, &vm).expect("the guest's address");
    let addr = std::net::SocketAddr::new(ip.into(), s.state.config().agent_port);
    let old = AgentClient::new(addr, AgentToken::parse(&boot).unwrap());
    assert!(old.exec("true", Duration::from_secs(5)).await.is_err());
    let current = store
        .agent_tokens()
        .get(member, &node)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(current, boot);
    let new = AgentClient::new(addr, AgentToken::parse(&current).unwrap());
    let ran = new.exec("true", Duration::from_secs(5)).await.unwrap();
    assert_eq!(ran.exit_code, Some(0));
    let grace = chrono::TimeDelta::from_std(s.state.config().policy.hard_deadline_grace).unwrap();
    let file = w
        .sim
        .guest_dir(NS, &vm)
        .unwrap()
        .join(ttlab_agent::protocol::POWER_OFF_AT_PATH.trim_start_matches('/'));
    let got: i64 = std::fs::read_to_string(&file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(got, (session.max_expires_at + grace).timestamp());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_claimed_while_prepared_that_cannot_be_handed_over_puts_its_student_first_in_line()
{
    let (w, s, member) = one_member_being_prepared().await;
    let store = w.db.store().await.unwrap();

    // Bob takes the member being prepared.
    let bob = token("bob", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &bob, json!({"lesson": "slowpool"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "starting", "{v}");
    assert_eq!(v["id"], member.to_string(), "{v}");
    // The token its hand-over will authenticate with is not the one its guest booted with:
    // the guest's agent will refuse the hand-over (its readiness is checked with the boot
    // token the provisioner holds, so the member still turns ready).
    let node: NodeName = "vm".parse().unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while store
        .agent_tokens()
        .get(member, &node)
        .await
        .unwrap()
        .is_none()
    {
        assert!(Instant::now() < until, "no boot token stored");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let wrong = AgentToken::from_random_bytes([7; AgentToken::BYTES]);
    assert!(
        store
            .agent_tokens()
            .replace(member, &node, wrong.reveal())
            .await
            .unwrap()
    );

    // Not a failure in front of Bob: the session ends `requeued`, saying why, and he is first
    // in line, where his page takes him.
    let id = member.to_string();
    let ended = s
        .wait_session(&id, &bob, |v| {
            v["status"]
                .as_str()
                .is_some_and(|s| s != "starting" && s != "finishing")
        })
        .await;
    assert_eq!(ended["status"], "requeued", "{ended}");
    let reason = ended["failure_reason"].as_str().unwrap();
    assert!(reason.contains("could not be handed over"), "{reason}");
    let (status, place) = s.get("/api/waitlist", &bob).await;
    assert_eq!(status, 200, "{place}");
    assert_eq!(place["waiting"], true, "{place}");
    assert_eq!(place["position"], 1, "{place}");
    // Counted as a failed hand-over, and the member's VM reclaimed.
    let v = pool(&s, "slowpool").await;
    assert_eq!(v["handover_failures_24h"], 1, "{v}");
    let series = "ttlab_pool_handover_failures_total{lesson=\"slowpool\"}";
    assert_eq!(metric(&s, series).await, Some(1.0));
    let vm = ttlab_vm_manifest::vm_name(member, &node);
    let until = Instant::now() + Duration::from_secs(60);
    while w.sim.guest_ip(NS, &vm).is_some() {
        assert!(Instant::now() < until, "{vm} is still there");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // With his place held, his next click starts his lab (the cold way or the next member).
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, place) = s.get("/api/waitlist", &bob).await;
        if place.get("held_until").is_some() {
            break;
        }
        assert!(Instant::now() < until, "no place held for bob: {place}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, v) = s
        .post("/api/sessions", &bob, json!({"lesson": "slowpool"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let next = v["id"].as_str().unwrap().to_owned();
    assert_ne!(next, id, "{v}");
    let v = s
        .wait_session(&next, &bob, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    s.stop().await;
}
