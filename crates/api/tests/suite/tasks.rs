//! The background tasks as operators see them, on a real server against PostgreSQL and
//! kube-sim: `GET /api/admin/tasks` lists each task with its last run, and a task's error
//! shows there, and in the `ttlab_task_*` metrics, until it recovers.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::Value;
use support::{Running, World, policy, token};
use ttlab_api::auth::Role;
use ttlab_kube_sim::{FaultRule, Verb};

/// The task `name` of the listing.
fn task<'a>(listing: &'a Value, name: &str) -> &'a Value {
    listing["tasks"]
        .as_array()
        .expect("a list of tasks")
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no task {name} in {listing}"))
}

/// Reads the listing until `pred` holds (bounded: 40 s, the probe runs every 10 s).
async fn listing_until(
    s: &Running,
    admin: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let until = Instant::now() + Duration::from_secs(40);
    loop {
        let (status, listing) = s.get("/api/admin/tasks", admin).await;
        assert_eq!(status, 200, "{listing}");
        if pred(&listing) {
            return listing;
        }
        assert!(Instant::now() < until, "never {what}: {listing}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads the listing until the cluster probe's status satisfies `pred`.
async fn probe_until(s: &Running, admin: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    listing_until(s, admin, what, |l| pred(task(l, "cluster_probe"))).await
}

/// A time of the listing.
fn at(v: &Value) -> chrono::DateTime<chrono::FixedOffset> {
    chrono::DateTime::parse_from_rfc3339(v.as_str().expect("a time")).expect("an RFC 3339 time")
}

/// The value of the metric line `metric{task="name"} value`.
fn metric(text: &str, metric: &str, name: &str) -> Option<f64> {
    let prefix = format!("{metric}{{task=\"{name}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_tasks_error_shows_until_it_recovers() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let admin = token("root", Role::Admin);

    // Admins only.
    let (status, v) = s
        .get("/api/admin/tasks", &token("alice", Role::Student))
        .await;
    assert_eq!(status, 403, "{v}");

    // Every task a server runs from its start is listed, with its last run; the probe has
    // succeeded, and the hub (a listener) is connected.
    let listing = listing_until(&s, &admin, "probed and listening", |l| {
        let (probe, hub) = (task(l, "cluster_probe"), task(l, "hub"));
        probe["last_success_at"].is_string() && hub["last_success_at"].is_string()
    })
    .await;
    let names: Vec<&str> = listing["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    for expected in [
        "database",
        "cluster_probe",
        "hub",
        "waitlist",
        "pool_refill",
        "adoption",
    ] {
        assert!(names.contains(&expected), "{expected} in {names:?}");
    }
    assert!(
        listing["replica"].is_string() && listing["server_time"].is_string(),
        "{listing}"
    );
    let probe = task(&listing, "cluster_probe");
    assert_eq!(probe["period_seconds"], 10.0, "{probe}");
    assert!(probe["last_started_at"].is_string(), "{probe}");
    assert!(probe["last_duration_ms"].is_u64(), "{probe}");
    assert!(
        probe["description"]
            .as_str()
            .unwrap()
            .contains("Kubernetes API"),
        "{probe}"
    );
    // The hub is a listener: running, connected, without error.
    let hub = task(&listing, "hub");
    assert_eq!(hub["running"], true, "{hub}");
    assert!(hub["period_seconds"].is_null(), "{hub}");
    assert!(
        hub["last_success_at"].is_string() && hub["last_error"].is_null(),
        "{hub}"
    );

    // The Kubernetes API fails every list: the probe's error shows, and is counted.
    let refusing = w
        .sim
        .faults()
        .add(FaultRule::fail(Some(Verb::List), None, 500));
    let listing = probe_until(&s, &admin, "failed", |p| p["last_error"].is_string()).await;
    let probe = task(&listing, "cluster_probe");
    let error = probe["last_error"].as_str().unwrap();
    assert!(error.contains("does not answer the probe"), "{probe}");
    assert!(
        probe["consecutive_failures"].as_u64().unwrap() >= 1,
        "{probe}"
    );
    assert!(probe["failures"].as_u64().unwrap() >= 1, "{probe}");
    let failed_at = at(&probe["last_error_at"]);
    let (status, metrics) = s.raw("GET", "/metrics", None, None, Vec::new()).await;
    assert_eq!(status, 200);
    let text = metrics.as_str().unwrap_or_default();
    let failures = metric(text, "ttlab_task_failures_total", "cluster_probe");
    assert!(failures.is_some_and(|n| n >= 1.0), "{text}");
    assert!(
        metric(text, "ttlab_task_activations_total", "hub").is_some_and(|n| n >= 1.0),
        "{text}"
    );

    // It answers again: the error clears at the next probe.
    w.sim.faults().remove(refusing);
    let listing = probe_until(&s, &admin, "recovered", |p| p["last_error"].is_null()).await;
    let probe = task(&listing, "cluster_probe");
    assert_eq!(probe["consecutive_failures"], 0, "{probe}");
    assert!(
        probe["failures"].as_u64().unwrap() >= 1,
        "the failures stay counted: {probe}"
    );
    assert!(at(&probe["last_success_at"]) > failed_at, "{probe}");
    s.stop().await;
}
