//! The service stays up and exposes only what it should: a slow Kubernetes API leaves every
//! replica ready and sessions quick to read, starts answer within their timeout, the per-user
//! rate limit answers 429 with `Retry-After`, health and metrics live on the ops port only,
//! a student's error never carries the agent's address, and grading tells a lab that does not
//! answer from a session that ended, even one that ends while it is graded. A real server,
//! real PostgreSQL, kube-sim over HTTP with its fault table.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use support::{NS, World, policy, token};
use ttlab_api::Server;
use ttlab_api::auth::Role;
use ttlab_api::limits::RateLimit;
use ttlab_kube_sim::{FaultAction, FaultRule, Verb};

/// One answer: status, `Retry-After`, JSON (or text) body.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: Value,
}

async fn call(method: &str, url: &str, token: Option<&str>, body: Option<Value>) -> Answer {
    call_with(method, url, token, body, &[]).await
}

async fn call_with(
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<Value>,
    headers: &[(&str, &str)],
) -> Answer {
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = http::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let payload = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            serde_json::to_vec(&b).unwrap()
        }
        None => Vec::new(),
    };
    let res = tokio::time::timeout(
        Duration::from_secs(60),
        http.request(req.body(Full::new(Bytes::from(payload))).unwrap()),
    )
    .await
    .expect("an answer within 60 s")
    .expect("a response");
    let status = res.status().as_u16();
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Answer {
        status,
        retry_after,
        body,
    }
}

/// A server of `config` with its public and ops addresses, stopped by dropping the sender.
struct Served {
    public: String,
    ops: Option<String>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    async fn start(w: &World, config: ttlab_api::ApiConfig) -> Self {
        let store = w.db.store().await.unwrap();
        let server = Server::bind(config, store, w.cluster().await)
            .await
            .unwrap();
        let public = format!("http://{}", server.local_addr());
        let ops = server.ops_addr().map(|a| format!("http://{a}"));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            server
                .run(async move {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        Self {
            public,
            ops,
            stop: Some(tx),
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.public)
    }

    fn ops_url(&self, path: &str) -> String {
        format!("{}{path}", self.ops.as_deref().expect("an ops port"))
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = self.task.await;
    }
}

/// Starts `lesson` for `user` and waits (bounded) until it runs.
async fn running(s: &Served, user: &str, lesson: &str) -> (String, String) {
    let t = token(user, Role::Student);
    let a = call(
        "POST",
        &s.url("/api/sessions"),
        Some(&t),
        Some(json!({ "lesson": lesson })),
    )
    .await;
    assert_eq!(a.status, 202, "{}", a.body);
    let id = a.body["id"].as_str().unwrap().to_owned();
    for _ in 0..400 {
        let v = call(
            "GET",
            &s.url(&format!("/api/sessions/{id}")),
            Some(&t),
            None,
        )
        .await;
        if v.body["status"] == "running" {
            return (id, t);
        }
        assert_eq!(v.body["status"], "starting", "{}", v.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{id} never ran");
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn nearest_rank(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_seconds_of_a_slow_kubernetes_api_leave_the_server_ready_and_sessions_quick() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.ops_listen = Some(loopback());
    let s = Served::start(&w, config).await;
    let (sid, alice) = running(&s, "alice", "quick").await;

    // Every list of the cluster now takes 10 s (readiness used to list VMs with a 3 s budget;
    // a start lists them for the capacity check with a 5 s one).
    let slow = w.sim.faults().add(FaultRule {
        action: FaultAction::Delay { millis: 10_000 },
        ..FaultRule::fail(Some(Verb::List), None, 500)
    });
    let began = Instant::now();

    // Starts by ten students at once, meanwhile: each is answered within its timeout, not
    // queued behind the others' listings (serially that was 10 × 5 s).
    let starts: Vec<_> = (0..10)
        .map(|i| {
            let url = s.url("/api/sessions");
            tokio::spawn(async move {
                let t = token(&format!("student{i}"), Role::Student);
                let at = Instant::now();
                let a = call("POST", &url, Some(&t), Some(json!({"lesson": "quick"}))).await;
                (a.status, a.body, at.elapsed())
            })
        })
        .collect();

    let mut reads = Vec::new();
    let mut unreachable_seen = false;
    while began.elapsed() < Duration::from_secs(10) || !unreachable_seen {
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "the cluster probe never reported the slow API server"
        );
        let ready = call("GET", &s.ops_url("/readyz"), None, None).await;
        assert_eq!(
            ready.status, 200,
            "readiness during API slowness: {}",
            ready.body
        );
        let at = Instant::now();
        let read = call(
            "GET",
            &s.url(&format!("/api/sessions/{sid}")),
            Some(&alice),
            None,
        )
        .await;
        reads.push(at.elapsed());
        assert_eq!(read.status, 200, "{}", read.body);
        assert_eq!(read.body["status"], "running", "{}", read.body);
        let cluster = call("GET", &s.ops_url("/healthz/cluster"), None, None).await;
        if cluster.body["reachable"] == false {
            assert_eq!(cluster.status, 503, "{}", cluster.body);
            assert!(cluster.body["error"].is_string(), "{}", cluster.body);
            unreachable_seen = true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = call("GET", &s.ops_url("/metrics"), None, None).await;
    let text = metrics.body.as_str().unwrap_or_default().to_owned();
    assert!(
        text.lines()
            .any(|l| l.trim() == "ttlab_cluster_reachable{site=\"default\"} 0"),
        "{text}"
    );

    let mut slowest = Duration::ZERO;
    for start in starts {
        let (status, body, took) = start.await.unwrap();
        slowest = slowest.max(took);
        // Admitted (the count could not be read: the quota still holds) or refused for
        // capacity; never left waiting.
        assert!(
            status == 202 || (status == 503 && body["error"] == "capacity"),
            "{status} {body}"
        );
        assert!(
            took < Duration::from_secs(20),
            "a start took {took:?} behind a slow API server"
        );
    }
    println!("10 starts at once during API slowness: the slowest answered in {slowest:?}");
    reads.sort();
    let p99 = nearest_rank(&reads, 0.99);
    println!(
        "GET session during 10 s of API slowness: {} reads, p50 {:?}, p99 {:?}, max {:?}",
        reads.len(),
        nearest_rank(&reads, 0.5),
        p99,
        reads.last().unwrap()
    );
    // Generous for a loaded 2-core machine (the figures printed above are the measure); the
    // point is "not behind the 10 s lists nor the 5 s listing budget".
    assert!(p99 < Duration::from_millis(2500), "GET session p99 {p99:?}");

    // The API server recovers: so does the report.
    w.sim.faults().remove(slow);
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let cluster = call("GET", &s.ops_url("/healthz/cluster"), None, None).await;
        if cluster.body["reachable"] == true {
            assert_eq!(cluster.status, 200);
            break;
        }
        assert!(
            Instant::now() < until,
            "still unreachable: {}",
            cluster.body
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_and_metrics_are_on_the_ops_port_only() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.ops_listen = Some(loopback());
    let s = Served::start(&w, config).await;
    assert_ne!(s.ops, Some(s.public.clone()));

    for path in ["/healthz", "/readyz", "/healthz/cluster", "/metrics"] {
        let ops = call("GET", &s.ops_url(path), None, None).await;
        assert_eq!(ops.status, 200, "ops {path}: {}", ops.body);
        let public = call("GET", &s.url(path), None, None).await;
        assert_eq!(public.status, 404, "public {path}: {}", public.body);
        assert_eq!(public.body["error"], "not_found", "public {path}");
    }
    let metrics = call("GET", &s.ops_url("/metrics"), None, None).await;
    assert!(
        metrics
            .body
            .as_str()
            .is_some_and(|m| m.contains("ttlab_sessions{status=\"running\"}")
                && m.contains("ttlab_cluster_reachable{site=\"default\"} 1")),
        "{}",
        metrics.body
    );
    let ready = call("GET", &s.ops_url("/readyz"), None, None).await;
    assert_eq!(ready.body, json!({"status": "ready", "database": "ok"}));
    // The ops port serves nothing else: no API, no pages.
    let t = token("alice", Role::Student);
    let api = call("GET", &s.ops_url("/api/lessons"), Some(&t), None).await;
    assert_eq!(api.status, 404, "{}", api.body);
    // The public port still serves the API.
    let lessons = call("GET", &s.url("/api/lessons"), Some(&t), None).await;
    assert_eq!(lessons.status, 200, "{}", lessons.body);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn start_extend_and_grade_are_limited_per_user_with_429_and_retry_after() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.user_rate_limit = RateLimit {
        burst: 2,
        interval: Duration::from_secs(30),
    };
    let s = Served::start(&w, config).await;
    let alice = token("alice", Role::Student);
    let sessions = s.url("/api/sessions");
    let start = || {
        call(
            "POST",
            &sessions,
            Some(&alice),
            Some(json!({"lesson": "quick"})),
        )
    };
    let first = start().await;
    assert_eq!(first.status, 202, "{}", first.body);
    let sid = first.body["id"].as_str().unwrap().to_owned();
    // The second is admitted (and refused for the open lab); the third is over the limit.
    let second = start().await;
    assert_eq!(
        (second.status, second.body["error"].as_str()),
        (409, Some("session_exists"))
    );
    let third = start().await;
    assert_eq!(third.status, 429, "{}", third.body);
    assert_eq!(third.body["error"], "rate_limited", "{}", third.body);
    assert!(
        third.body["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("too many start requests; try again in")),
        "{}",
        third.body
    );
    let after: u64 = third
        .retry_after
        .as_deref()
        .expect("a Retry-After header")
        .parse()
        .expect("Retry-After in seconds");
    assert!((1..=30).contains(&after), "Retry-After: {after}");

    // Extend and grade are counted apart from start, and from each other.
    for action in ["extend", "grade"] {
        let url = s.url(&format!("/api/sessions/{sid}/{action}"));
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(call("POST", &url, Some(&alice), None).await);
        }
        assert_ne!(statuses[0].status, 429, "{action}: {}", statuses[0].body);
        assert_ne!(statuses[1].status, 429, "{action}: {}", statuses[1].body);
        assert_eq!(statuses[2].status, 429, "{action}: {}", statuses[2].body);
        assert!(statuses[2].retry_after.is_some(), "{action}");
    }
    // Another student is not affected; reading is not limited.
    let bob = token("bob", Role::Student);
    let b = call(
        "POST",
        &s.url("/api/sessions"),
        Some(&bob),
        Some(json!({"lesson": "quick"})),
    )
    .await;
    assert_eq!(b.status, 202, "{}", b.body);
    for _ in 0..20 {
        let r = call(
            "GET",
            &s.url(&format!("/api/sessions/{sid}")),
            Some(&alice),
            None,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    s.stop().await;
}

/// The VM name of a session's first node, as its student's view shows it.
async fn first_vm(s: &Served, sid: &str, token: &str) -> String {
    let view = call(
        "GET",
        &s.url(&format!("/api/sessions/{sid}")),
        Some(token),
        None,
    )
    .await;
    view.body["nodes"][0]["vm"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_student_never_sees_the_agents_address() {
    let w = World::new().await;
    let config = w.config(policy(3600, 7200, 3), 8).await;
    let s = Served::start(&w, config).await;
    let (sid, alice) = running(&s, "alice", "quick").await;
    let vm = first_vm(&s, &sid, &alice).await;
    let ip = w.sim.guest_ip(NS, &vm).expect("the guest's address");
    let pid = w.sim.agent_pid(NS, &vm).expect("the guest agent runs");

    // The agent dies: grading cannot reach it.
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let a = call(
        "POST",
        &s.url(&format!("/api/sessions/{sid}/grade")),
        Some(&alice),
        None,
    )
    .await;
    assert_eq!(
        (a.status, a.body["error"].as_str()),
        (502, Some("agent_unavailable")),
        "{}",
        a.body
    );
    let message = a.body["message"].as_str().unwrap();
    assert!(!message.is_empty());
    for secret in [ip.to_string(), "8899".to_owned(), "http".to_owned()] {
        assert!(!message.contains(&secret), "{secret} in {message:?}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grading_a_vm_that_is_gone_says_so_and_an_ended_session_is_not_running() {
    let w = World::new().await;
    let config = w.config(policy(3600, 7200, 3), 8).await;
    let s = Served::start(&w, config).await;
    let (sid, alice) = running(&s, "alice", "quick").await;
    let vm = first_vm(&s, &sid, &alice).await;

    // The guest powers itself off: with RerunOnFailure its VMI is deleted and stays off.
    w.sim.power_off(NS, &vm).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while w.sim.get("virtualmachineinstances", NS, &vm).is_some() {
        assert!(
            Instant::now() < deadline,
            "the powered-off VM's VMI never went"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let grade = s.url(&format!("/api/sessions/{sid}/grade"));
    let a = call("POST", &grade, Some(&alice), None).await;
    assert_eq!(
        (a.status, a.body["error"].as_str()),
        (502, Some("agent_unavailable")),
        "a VM with no instance is a lab that does not answer, not a server error: {}",
        a.body
    );

    // Once the student has finished, grading says the session is not running.
    let f = call(
        "DELETE",
        &s.url(&format!("/api/sessions/{sid}")),
        Some(&alice),
        None,
    )
    .await;
    assert_eq!(f.status, 200, "{}", f.body);
    let a = call("POST", &grade, Some(&alice), None).await;
    assert_eq!(
        (a.status, a.body["error"].as_str()),
        (409, Some("not_running")),
        "{}",
        a.body
    );
    s.stop().await;
}

/// A lesson whose first grading step says in the guest that it started, then takes its time:
/// long enough to end the session under it.
const SLOW_GRADING: &str = r#"
id: slow-grading
title: Graded slowly
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
grading:
  - name: takes its time
    command: "touch grading-started && sleep 4"
    timeout_seconds: 30
  - name: passes
    command: "true"
"#;

/// The soak's grade that raced the reaper: a step fails because the session ended under it
/// (its VM deleted, the agent gone), and the server must re-read the session before it
/// answers, so the student is told the session ended (409 `not_running`), not that the lab
/// did not answer (502 `agent_unavailable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_that_ends_while_it_is_graded_is_not_running_not_a_failed_step() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.lessons = ttlab_lesson::LessonSet::from_sources([(
        "test.yaml".into(),
        format!("{}---{SLOW_GRADING}", support::LESSONS),
    )])
    .unwrap();
    let s = Served::start(&w, config).await;
    let (sid, alice) = running(&s, "alice", "slow-grading").await;
    let vm = first_vm(&s, &sid, &alice).await;
    let started = w
        .sim
        .guest_dir(NS, &vm)
        .expect("the guest's directory")
        .join("grading-started");

    let grade = {
        let (url, alice) = (s.url(&format!("/api/sessions/{sid}/grade")), alice.clone());
        tokio::spawn(async move { call("POST", &url, Some(&alice), None).await })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !started.exists() {
        assert!(
            Instant::now() < deadline && !grade.is_finished(),
            "the first grading step never started in the guest"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The first step runs; the student finishes meanwhile, and the VM goes from under it.
    let f = call(
        "DELETE",
        &s.url(&format!("/api/sessions/{sid}")),
        Some(&alice),
        None,
    )
    .await;
    assert_eq!(f.status, 200, "{}", f.body);
    while w.sim.get("virtualmachineinstances", NS, &vm).is_some() {
        assert!(
            Instant::now() < deadline,
            "the finished session's VMI never went"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = grade.await.unwrap();
    assert_eq!(
        (a.status, a.body["error"].as_str()),
        (409, Some("not_running")),
        "a grading whose step failed because the session ended says the session ended: {}",
        a.body
    );
    let message = a.body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("only a running session can be graded"),
        "{message:?}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_user_header_is_believed_only_from_the_trusted_proxy() {
    let w = World::new().await;
    // Behind the shipped Ingress: the proxy is elsewhere, this client (127.0.0.1) is not it.
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.auth = support::auth()
        .with_trusted_header("X-Remote-User", "10.42.0.0/16".parse().unwrap())
        .unwrap();
    let s = Served::start(&w, config).await;
    let forged = call_with(
        "GET",
        &s.url("/api/sessions/current"),
        None,
        None,
        &[("x-remote-user", "alice")],
    )
    .await;
    assert_eq!(
        (forged.status, forged.body["error"].as_str()),
        (401, Some("unauthorized")),
        "{}",
        forged.body
    );
    assert!(
        forged.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("only accepted from the authenticating proxy")),
        "{}",
        forged.body
    );
    // A bearer token still works for everyone.
    let t = token("alice", Role::Student);
    let with_token = call("GET", &s.url("/api/lessons"), Some(&t), None).await;
    assert_eq!(with_token.status, 200, "{}", with_token.body);
    s.stop().await;

    // The proxy itself (here: this very address) is believed.
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.auth = support::auth()
        .with_trusted_header("X-Remote-User", "127.0.0.1".parse().unwrap())
        .unwrap();
    let s = Served::start(&w, config).await;
    let proxied = call_with(
        "GET",
        &s.url("/api/lessons"),
        None,
        None,
        &[("x-remote-user", "alice")],
    )
    .await;
    assert_eq!(proxied.status, 200, "{}", proxied.body);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_request_timeout_or_the_concurrency_limit_the_answer_is_503_at_once() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 7200, 3), 8).await;
    config.request_timeout = Duration::from_secs(2);
    config.max_concurrent_requests = 1;
    config.ops_listen = Some(loopback());
    let s = Served::start(&w, config).await;
    // Lists of VMs hang for 10 s: a start waits on its capacity listing (5 s budget).
    w.sim.faults().add(FaultRule {
        action: FaultAction::Delay { millis: 10_000 },
        ..FaultRule::fail(Some(Verb::List), Some("virtualmachines"), 500)
    });
    // Two outcomes say nothing about the limit, and such a start is tried again by another
    // student:
    // - 201: a listing taken before the rule serves starts for up to 1 s from its answer, and
    //   on a loaded machine one sent just before the rule may be answered later; a start
    //   served from it does not wait (whether or not a request was refused meanwhile);
    // - 503 `overloaded`: on a loaded machine the start's request may arrive after the first
    //   poll below, which then holds the place, and the start is the request refused.
    let url = s.url("/api/sessions");
    let t = token("bob", Role::Student);
    let mut not_counted = Vec::new();
    let mut waited = None;
    for student in ["alice", "carol", "dave", "erin", "frank"] {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let url = url.clone();
        let start = tokio::spawn(async move {
            let t = token(student, Role::Student);
            let at = Instant::now();
            let a = call("POST", &url, Some(&t), Some(json!({"lesson": "quick"}))).await;
            (a.status, a.retry_after, a.body, at.elapsed())
        });
        // A head start for the start's request.
        tokio::time::sleep(Duration::from_millis(200)).await;
        // While it holds the one place, anything else is refused at once, not queued.
        // (Polled for as long as the start is outstanding: on a loaded machine its request
        // may arrive late.)
        let until = Instant::now() + Duration::from_secs(20);
        let mut refused = None;
        while Instant::now() < until && !start.is_finished() {
            let at = Instant::now();
            let a = call("GET", &s.url("/api/lessons"), Some(&t), None).await;
            if a.status == 503 {
                refused = Some((a, at.elapsed()));
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The ops port is not limited: probes are answered meanwhile.
        let ready = match refused {
            Some(_) => Some(call("GET", &s.ops_url("/readyz"), None, None).await),
            None => None,
        };
        let answer = start.await.unwrap();
        if answer.0 == 201 || (answer.0 == 503 && answer.2["error"] == "overloaded") {
            not_counted.push(format!("{student}: {} after {:?}", answer.0, answer.3));
            eprintln!("not counted: {}", not_counted.last().unwrap());
            continue;
        }
        waited = Some((refused, ready, answer));
        break;
    }
    let (refused, ready, (status, retry_after, body, took)) = waited.unwrap_or_else(|| {
        panic!("no start waited on its listing while holding the place: {not_counted:?}")
    });
    let (a, refused_in) = refused.expect("a request refused while the only place is taken");
    assert_eq!(a.body["error"], "overloaded", "{}", a.body);
    assert_eq!(a.retry_after.as_deref(), Some("1"));
    assert!(
        refused_in < Duration::from_secs(1),
        "refused after {refused_in:?}"
    );
    let ready = ready.expect("readiness probed while the place was taken");
    assert_eq!(ready.status, 200, "{}", ready.body);

    assert_eq!(
        (status, body["error"].as_str()),
        (503, Some("request_timeout")),
        "{body}"
    );
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(5),
        "answered after {took:?}"
    );
    // And the place is free again.
    let lessons = call("GET", &s.url("/api/lessons"), Some(&t), None).await;
    assert_eq!(lessons.status, 200, "{}", lessons.body);
    s.stop().await;
}
