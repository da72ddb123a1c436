//! The metrics operators alert on and chart (deploy/components/monitoring), on a real server,
//! PostgreSQL and kube-sim: each follows what happened — starts and their outcomes, gradings
//! the lab's agent did not answer, terminals, VM places and quotas — and what the database
//! says at scrape time: sessions past their expiry, sessions held by objects still
//! terminating, the last reaper cycle.

use std::time::{Duration, Instant};

use crate::support;

use serde_json::{Value, json};
use support::{NS, Running, World, policy, sql, start_running, token};
use ttlab_api::auth::Role;

/// The metrics text (no ops port in these tests: `/metrics` is on the public port).
async fn scrape(s: &Running) -> String {
    let (status, body) = s.raw("GET", "/metrics", None, None, Vec::new()).await;
    assert_eq!(status, 200, "{body}");
    match body {
        Value::String(text) => text,
        other => panic!("not the text format: {other}"),
    }
}

/// The value of the sample whose name and labels are exactly `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

/// Scrapes until `series` has a value `ok` accepts (bounded: 20 s); the value.
async fn until(s: &Running, series: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = scrape(s).await;
        match sample(&text, series) {
            Some(v) if ok(v) => return v,
            got => assert!(
                Instant::now() < deadline,
                "{series} is {got:?}, never what was expected:\n{text}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn starts_gradings_terminals_places_and_quotas_are_counted() {
    let w = World::new().await;
    w.sim
        .create(json!({
            "apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": "ttlab-vms", "namespace": NS},
            "spec": {"hard": {"count/virtualmachines.kubevirt.io": "8", "requests.memory": "48Gi"}}
        }))
        .unwrap();
    let s = w.server(policy(3600, 7200, 3), 5).await;
    let before = scrape(&s).await;
    for series in [
        "ttlab_provisionings_total{runtime=\"vm\",outcome=\"ready\"}",
        "ttlab_provisionings_total{runtime=\"vm\",outcome=\"failed\"}",
        "ttlab_gradings_total{outcome=\"graded\"}",
        "ttlab_gradings_total{outcome=\"agent_unavailable\"}",
        "ttlab_console_connections{runtime=\"vm\"}",
        "ttlab_capacity_used{site=\"default\",by=\"labs\"}",
    ] {
        assert_eq!(sample(&before, series), Some(0.0), "{series}:\n{before}");
    }
    assert_eq!(
        sample(&before, "ttlab_capacity_limit{site=\"default\"}"),
        Some(5.0)
    );

    // A start that becomes ready, and one whose setup fails.
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let bob = token("bob", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &bob, json!({"lesson": "broken"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let broken = v["id"].as_str().unwrap().to_owned();
    s.wait_session(&broken, &bob, |v| v["status"] == "failed")
        .await;
    let text = scrape(&s).await;
    assert_eq!(
        sample(
            &text,
            "ttlab_provisionings_total{runtime=\"vm\",outcome=\"ready\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "ttlab_provisionings_total{runtime=\"vm\",outcome=\"failed\"}"
        ),
        Some(1.0),
        "{text}"
    );
    // Alice's VM takes one of the five places; the quota reads as numbers once counted.
    assert_eq!(
        sample(&text, "ttlab_capacity_used{site=\"default\",by=\"labs\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "ttlab_quota_hard{site=\"default\",quota=\"ttlab-vms\",resource=\"requests.memory\"}"
        ),
        Some(48.0 * 1024.0 * 1024.0 * 1024.0),
        "{text}"
    );
    until(
        &s,
        "ttlab_quota_used{site=\"default\",quota=\"ttlab-vms\",resource=\"count/virtualmachines.kubevirt.io\"}",
        |v| v == 1.0,
    )
    .await;

    // A grading, then one the lab's agent does not answer (it was killed).
    let grade = format!("/api/sessions/{sid}/grade");
    let (status, v) = s.post(&grade, &alice, json!({})).await;
    assert_eq!(status, 200, "{v}");
    let (_, view) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    let vm = view["nodes"][0]["vm"].as_str().unwrap().to_owned();
    let pid = w.sim.agent_pid(NS, &vm).expect("the guest agent runs");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let (status, v) = s.post(&grade, &alice, json!({})).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (502, Some("agent_unavailable"))
    );
    let text = scrape(&s).await;
    assert_eq!(
        sample(&text, "ttlab_gradings_total{outcome=\"graded\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "ttlab_gradings_total{outcome=\"agent_unavailable\"}"),
        Some(1.0),
        "{text}"
    );

    // A terminal: counted while open, and why it closed once closed.
    let (status, t) = s
        .post(
            &format!("/api/sessions/{sid}/console-ticket"),
            &alice,
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{t}");
    let url = format!(
        "{}{}",
        s.base.replacen("http://", "ws://", 1),
        t["url"].as_str().unwrap()
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    until(&s, "ttlab_console_connections{runtime=\"vm\"}", |v| {
        v == 1.0
    })
    .await;
    ws.close(None).await.unwrap();
    drop(ws);
    until(&s, "ttlab_console_connections{runtime=\"vm\"}", |v| {
        v == 0.0
    })
    .await;
    until(
        &s,
        "ttlab_console_closed_total{reason=\"browser_closed\"}",
        |v| v == 1.0,
    )
    .await;
    s.stop().await;
}

#[tokio::test]
async fn expiry_terminating_sessions_and_the_last_reaper_cycle_are_read_from_the_database() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let text = scrape(&s).await;
    for series in [
        "ttlab_sessions_past_expiry",
        "ttlab_sessions_past_expiry_max_seconds",
        "ttlab_sessions_terminating",
        "ttlab_sessions_terminating_max_seconds",
        // No reaper has run yet: an alert on its age fires.
        "ttlab_last_reaper_cycle_timestamp_seconds",
    ] {
        assert_eq!(sample(&text, series), Some(0.0), "{series}:\n{text}");
    }

    // Alice's session expired ten minutes ago and nobody reclaimed it.
    let (alice, _) = start_running(&s, "alice", "quick").await;
    let n = sql(
        &w,
        "UPDATE sessions SET started_at = started_at - interval '2 hours', \
         expires_at = now() - interval '10 minutes' WHERE id = $1::text::uuid",
        &alice,
    )
    .await;
    assert_eq!(n, 1);
    // Bob's is finishing, held for twenty minutes by a VM still terminating.
    let (bob, _) = start_running(&s, "bob", "quick").await;
    let n = sql(
        &w,
        "UPDATE sessions SET status = 'finishing', finishing_to = 'finished', \
         terminating_objects = ARRAY['VirtualMachine/held'], \
         terminating_since = now() - interval '20 minutes' WHERE id = $1::text::uuid",
        &bob,
    )
    .await;
    assert_eq!(n, 1);
    let text = scrape(&s).await;
    assert_eq!(
        sample(&text, "ttlab_sessions_past_expiry"),
        Some(1.0),
        "{text}"
    );
    let overdue = sample(&text, "ttlab_sessions_past_expiry_max_seconds").unwrap();
    assert!((600.0..660.0).contains(&overdue), "{overdue}");
    assert_eq!(
        sample(&text, "ttlab_sessions_terminating"),
        Some(1.0),
        "{text}"
    );
    let held = sample(&text, "ttlab_sessions_terminating_max_seconds").unwrap();
    assert!((1200.0..1260.0).contains(&held), "{held}");

    // A reaper cycle recorded (by a Deployment's reaper or a CronJob's run alike) ended a
    // minute ago; a dry run after it does not count.
    let store = w.db.store().await.unwrap();
    let started = store.db_now().await.unwrap() - chrono::TimeDelta::seconds(62);
    let cycle = |started_at, dry_run| ttlab_store::NewCycle {
        env: "dev".parse().unwrap(),
        started_at,
        duration: Duration::from_secs(2),
        trigger: ttlab_store::CycleTrigger::Timer,
        dry_run,
        expired: Default::default(),
        orphans: Default::default(),
        ghosts: Default::default(),
        stuck: Default::default(),
        errors: Vec::new(),
        collect_request: None,
    };
    store
        .reaper_cycles()
        .record(&cycle(started, false), &[])
        .await
        .unwrap();
    store
        .reaper_cycles()
        .record(&cycle(started + chrono::TimeDelta::seconds(30), true), &[])
        .await
        .unwrap();
    let text = scrape(&s).await;
    let ended = sample(&text, "ttlab_last_reaper_cycle_timestamp_seconds").unwrap();
    let expected = (started + chrono::TimeDelta::seconds(2)).timestamp_millis() as f64 / 1000.0;
    assert!((ended - expected).abs() < 0.01, "{ended} != {expected}");
    store.close();
    s.stop().await;
}
