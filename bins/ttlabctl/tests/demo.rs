//! `ttlabctl demo` end to end: started on a free loopback port with a short session lifespan,
//! it prints a URL and a student link whose token opens a session through the API; the
//! session reaches `running`, is reclaimed by the reaper after expiry, and Ctrl-C (SIGINT) stops
//! every process and removes every file. A demo without a reaper leaves the expiry unchecked
//! with a `SKIPPED:` line, or fails under `CI=true`.
//!
//! The demo runs the sibling binaries `ttlab-server`, `ttlab-reaper` and `ttlab-agent`; when
//! they are missing it builds them with the cargo that builds this test.
//!
//! With `--sites 2` (one place each), two students' labs land one on each site's kube-sim,
//! a third is refused for capacity, and the reaper reclaims both after expiry.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, BufReader, Lines};
use tokio::process::ChildStdout;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// What the demo printed once ready.
#[derive(Debug, Default)]
struct Banner {
    url: String,
    student_token: String,
    server_pid: Option<u32>,
    reaper_pid: Option<u32>,
    sim_url: String,
    /// With several sites: each site's name and kube-sim URL.
    sites: Vec<(String, String)>,
    postgres_dir: PathBuf,
    data_dir: PathBuf,
}

fn after<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.trim_start().strip_prefix(key).map(str::trim)
}

fn pid_in(rest: &str) -> Option<u32> {
    rest.strip_prefix("pid ")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Reads the demo's stdout up to the end of its banner.
async fn read_banner(lines: &mut Lines<BufReader<ChildStdout>>) -> Banner {
    let mut b = Banner::default();
    while let Some(line) = lines.next_line().await.expect("reading the demo's output") {
        if let Some(rest) = after(&line, "ttlab demo ready:") {
            b.url = rest.trim_end_matches('/').to_owned();
        } else if let Some(rest) = after(&line, "student:") {
            let token = rest
                .split("token=")
                .nth(1)
                .and_then(|t| t.split_whitespace().next())
                .expect("the student link carries a token");
            b.student_token = token.to_owned();
        } else if let Some(rest) = after(&line, "server:") {
            b.server_pid = pid_in(rest);
        } else if let Some(rest) = after(&line, "reaper:") {
            b.reaper_pid = pid_in(rest);
        } else if let Some(rest) = after(&line, "cluster:") {
            b.sim_url = rest.trim_start_matches("kube-sim at ").to_owned();
        } else if let Some((name, rest)) = line.trim_start().split_once(": kube-sim at ")
            && name.starts_with("site-")
        {
            let url = rest.split_whitespace().next().unwrap_or(rest);
            b.sites.push((name.to_owned(), url.to_owned()));
        } else if let Some(rest) = after(&line, "postgres:") {
            b.postgres_dir = PathBuf::from(rest);
        } else if let Some(rest) = after(&line, "data:") {
            b.data_dir = PathBuf::from(rest.split(" (").next().unwrap_or(rest));
        } else if line.starts_with("Ctrl-C stops everything") {
            return b;
        }
    }
    panic!("the demo ended before printing its banner: {b:?}");
}

async fn send(
    http: &HttpClient,
    method: http::Method,
    url: &str,
    token: &str,
    body: Option<Value>,
) -> (http::StatusCode, Value) {
    let mut req = http::Request::builder().method(method).uri(url);
    // No credentials at all for an empty token: an empty bearer token is one the API server
    // cannot authenticate (401), not an anonymous request.
    if !token.is_empty() {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let body = match body {
        Some(v) => {
            req = req.header("content-type", "application/json");
            Full::new(Bytes::from(v.to_string()))
        }
        None => Full::new(Bytes::new()),
    };
    let res = http.request(req.body(body).unwrap()).await.expect(url);
    let status = res.status();
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, v)
}

/// Follows the session's server-sent events until `until` holds for a view; returns it.
async fn follow_until(
    http: &HttpClient,
    url: &str,
    token: &str,
    until: impl Fn(&Value) -> bool,
) -> Value {
    let req = http::Request::get(url)
        .header("authorization", format!("Bearer {token}"))
        .header("accept", "text/event-stream")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = http.request(req).await.expect(url);
    assert_eq!(res.status(), http::StatusCode::OK, "{url}");
    let mut body = res.into_body();
    let mut buf = Vec::new();
    let mut last = Value::Null;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.expect("reading events").into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(json) = line.trim_end().strip_prefix("data:") {
                last = serde_json::from_str(json.trim()).expect("event data is JSON");
                if until(&last) {
                    return last;
                }
            }
        }
    }
    panic!("the event stream ended; last view: {last}");
}

fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if !entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
        {
            continue;
        }
        if let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(needle) {
                found.push(format!("{}: {cmd}", entry.file_name().to_string_lossy()));
            }
        }
    }
    found
}

/// Sends SIGINT to the demo if the test ends early, so that it stops what it started.
struct Interrupt(Option<u32>);

impl Drop for Interrupt {
    fn drop(&mut self) {
        if let Some(pid) = self
            .0
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_a_session_that_expires_and_stops_cleanly_on_sigint() {
    let port = free_port();
    let mut child = spawn_demo(port, &[], &[("TTLAB_SESSION_TTL", "12s")]);
    let _interrupt = Interrupt(child.id());
    let pid = child.id().expect("the demo's pid");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();

    // Building missing sibling binaries on a fresh checkout can take minutes.
    let banner = tokio::time::timeout(Duration::from_secs(900), read_banner(&mut lines))
        .await
        .expect("the demo printed its URL in time");
    assert_eq!(banner.url, format!("http://127.0.0.1:{port}"));
    assert!(!banner.student_token.is_empty());
    let server_pid = banner
        .server_pid
        .expect("the banner names the server's pid");
    assert!(process_exists(server_pid));
    assert!(banner.data_dir.is_dir(), "{banner:?}");
    assert!(banner.postgres_dir.is_dir(), "{banner:?}");
    // Keep reading stdout so the demo never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    let http: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let token = banner.student_token.clone();
    let (status, created) = send(
        &http,
        http::Method::POST,
        &format!("{}/api/sessions", banner.url),
        &token,
        Some(serde_json::json!({"lesson": "systemd-basics"})),
    )
    .await;
    assert_eq!(status, http::StatusCode::ACCEPTED, "{created}");
    assert_eq!(created["user"], "demo-student");
    let id = created["id"].as_str().expect("the session's id").to_owned();
    let events = format!("{}/api/sessions/{id}/events", banner.url);

    let running = tokio::time::timeout(
        Duration::from_secs(60),
        follow_until(&http, &events, &token, |v| v["status"] != "starting"),
    )
    .await
    .expect("the session left `starting` in time");
    assert_eq!(running["status"], "running", "{running}");
    // The demo's golden PVC for this lesson is present.
    assert_eq!(running["disk"]["kind"], "golden", "{running}");

    if let Some(reaper_pid) = banner.reaper_pid {
        assert!(process_exists(reaper_pid));
        let done = tokio::time::timeout(
            Duration::from_secs(90),
            follow_until(&http, &events, &token, |v| {
                !matches!(v["status"].as_str(), Some("running" | "finishing"))
            }),
        )
        .await
        .expect("the session was reclaimed in time after expiry");
        assert_eq!(done["status"], "expired", "{done}");
        let items = vms_at(&http, &banner.sim_url).await;
        // Deleted: gone, or going (the simulated guest is still shutting down).
        assert!(
            items
                .iter()
                .all(|vm| vm["metadata"]["deletionTimestamp"].is_string()),
            "every VM of the expired session is deleted: {items:?}"
        );
    } else {
        ttlab_testkit::skip_or_fail(
            "the demo started no ttlab-reaper (its banner says NOT RUNNING), so the reclaiming \
             of the expired session was not checked",
        );
    }

    interrupt_and_wait(&mut child, pid).await;

    assert!(!process_exists(server_pid), "the server is gone");
    if let Some(reaper_pid) = banner.reaper_pid {
        assert!(!process_exists(reaper_pid), "the reaper is gone");
    }
    for dir in [&banner.data_dir, &banner.postgres_dir] {
        assert!(!dir.exists(), "{} was removed", dir.display());
        let left = processes_mentioning(&dir.display().to_string());
        assert!(left.is_empty(), "processes left behind: {left:?}");
    }
}

/// A free loopback port.
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `ttlabctl demo` on `port` with quick simulated guests, `args` and `env` added.
fn spawn_demo(port: u16, args: &[&str], env: &[(&str, &str)]) -> tokio::process::Child {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"));
    command
        .args(["demo", "--port", &port.to_string()])
        .args(args)
        .env("CARGO", env!("CARGO"))
        .env("TTLAB_SIM_BOOT", "300ms")
        .env("TTLAB_SIM_SETUP", "300ms")
        .env("RUST_LOG", "warn")
        .env_remove("TTLAB_AUTH_SECRET")
        .env_remove("DATABASE_URL");
    for (k, v) in env {
        command.env(k, v);
    }
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("starting ttlabctl demo")
}

/// Sends SIGINT to the demo and waits for it to exit cleanly.
async fn interrupt_and_wait(child: &mut tokio::process::Child, pid: u32) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::INT,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the demo stopped in time after SIGINT")
        .unwrap();
    assert!(
        status.success(),
        "the demo exits cleanly on SIGINT: {status}"
    );
}

/// The VMs in kube-sim's lab namespace at `sim_url`.
async fn vms_at(http: &HttpClient, sim_url: &str) -> Vec<Value> {
    let (status, vms) = send(
        http,
        http::Method::GET,
        &format!("{sim_url}/apis/kubevirt.io/v1/namespaces/ttlab-vms/virtualmachines"),
        "",
        None,
    )
    .await;
    assert_eq!(status, http::StatusCode::OK, "{vms}");
    vms["items"].as_array().expect("a VM list").clone()
}

/// A token for `user`, minted by `ttlabctl token` with the demo's secret.
fn token_for(user: &str, secret: &str) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args(["token", "--user", user])
        .env("TTLAB_AUTH_SECRET", secret)
        .env_remove("RUST_LOG")
        .output()
        .expect("ttlabctl token runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_with_two_sites_puts_a_lab_on_each_refuses_a_third_and_reclaims_both() {
    let secret = "demo-sites-test-secret-of-at-least-32-bytes";
    let port = free_port();
    let mut child = spawn_demo(
        port,
        &["--sites", "2", "--site-vm-limit", "1"],
        &[("TTLAB_SESSION_TTL", "20s"), ("TTLAB_AUTH_SECRET", secret)],
    );
    let _interrupt = Interrupt(child.id());
    let pid = child.id().expect("the demo's pid");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let banner = tokio::time::timeout(Duration::from_secs(900), read_banner(&mut lines))
        .await
        .expect("the demo printed its URL in time");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let names: Vec<&str> = banner.sites.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["site-a", "site-b"], "{banner:?}");

    let http: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let mut placed = Vec::new();
    for user in ["student-1", "student-2"] {
        let token = token_for(user, secret);
        let (status, created) = send(
            &http,
            http::Method::POST,
            &format!("{}/api/sessions", banner.url),
            &token,
            Some(serde_json::json!({"lesson": "systemd-basics"})),
        )
        .await;
        assert_eq!(status, http::StatusCode::ACCEPTED, "{user}: {created}");
        let id = created["id"].as_str().expect("the session's id").to_owned();
        let events = format!("{}/api/sessions/{id}/events", banner.url);
        let running = tokio::time::timeout(
            Duration::from_secs(90),
            follow_until(&http, &events, &token, |v| v["status"] != "starting"),
        )
        .await
        .expect("the session left `starting` in time");
        assert_eq!(running["status"], "running", "{user}: {running}");
        let site = running["site"].as_str().unwrap_or("").to_owned();
        placed.push((token, events, site));
    }
    let mut sites: Vec<&str> = placed.iter().map(|(_, _, s)| s.as_str()).collect();
    sites.sort_unstable();
    assert_eq!(sites, ["site-a", "site-b"], "one lab on each site");
    for (name, url) in &banner.sites {
        let vms = vms_at(&http, url).await;
        assert_eq!(vms.len(), 1, "one VM on {name}: {vms:?}");
    }

    // Both sites full: a third student is told there is no room.
    let token = token_for("student-3", secret);
    let (status, refused) = send(
        &http,
        http::Method::POST,
        &format!("{}/api/sessions", banner.url),
        &token,
        Some(serde_json::json!({"lesson": "systemd-basics"})),
    )
    .await;
    assert_eq!(status, http::StatusCode::SERVICE_UNAVAILABLE, "{refused}");
    assert_eq!(refused["error"], "capacity", "{refused}");

    // Expired on both sites, each reclaimed on its own cluster.
    for (token, events, site) in &placed {
        let done = tokio::time::timeout(
            Duration::from_secs(90),
            follow_until(&http, events, token, |v| {
                !matches!(v["status"].as_str(), Some("running" | "finishing"))
            }),
        )
        .await
        .expect("the session was reclaimed in time after expiry");
        assert_eq!(done["status"], "expired", "{site}: {done}");
    }
    for (name, url) in &banner.sites {
        let vms = vms_at(&http, url).await;
        assert!(
            vms.iter()
                .all(|vm| vm["metadata"]["deletionTimestamp"].is_string()),
            "every VM on {name} is deleted: {vms:?}"
        );
    }
    interrupt_and_wait(&mut child, pid).await;
    assert!(
        !banner.data_dir.exists(),
        "{} was removed",
        banner.data_dir.display()
    );
}
