//! `ttlabctl demo --guest qemu` end to end: the real `ttlab-server` and `ttlab-reaper` on
//! kube-sim whose VMs are real qemu guests of the Debian 12 image. One systemd-basics session
//! goes from "Start lab" to running (ready only after the guest's real readiness marker),
//! grades 0/6, shows root's autologin shell through the server's console relay, and grades 6/6
//! once the task is done by typing on that console; Ctrl-C stops everything, guests included.
//! The timings of the server's stages (VM created, VMI running, agent up, ready) are printed.
//!
//! The hard-deadline power-off and a failing setup are covered on real guests by
//! `crates/kube-sim/tests/real_guest.rs` (through the server, a hard deadline is at least the
//! lifespan's 15-minute grace away).
//!
//! Needs qemu, `TTLAB_GUEST_IMAGE` (the directory `ttlabctl guest-image` prints) and the sibling
//! binaries (built by the demo when missing); without qemu or the image: `SKIPPED:`, or a
//! failure under `CI=true`. Four to seven minutes under TCG on two cores.

use std::net::{Ipv4Addr, TcpListener};
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio_tungstenite::tungstenite::Message;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn send(
    http: &HttpClient,
    method: http::Method,
    url: &str,
    token: &str,
    body: Option<Value>,
) -> (http::StatusCode, Value) {
    let mut req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("authorization", format!("Bearer {token}"));
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
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn seconds_between(view: &Value, from: &str, to: &str) -> f64 {
    let at = |k: &str| {
        view["stages"][k]
            .as_str()
            .and_then(|s| s.parse::<chrono::DateTime<chrono::Utc>>().ok())
            .unwrap_or_else(|| panic!("stage {k} missing: {view}"))
    };
    (at(to) - at(from)).num_milliseconds() as f64 / 1000.0
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

const THE_TASK: &str = "cat > /etc/systemd/system/greeter.service <<'UNIT'
[Unit]
Description=Greeter
[Service]
User=greeter
ExecStart=/opt/lab/bin/greeter
Restart=on-failure
[Install]
WantedBy=multi-user.target
UNIT
sed -i 's#/usr/local/sbin/tar#/usr/bin/tar#' /etc/systemd/system/backup.service
printf '[Unit]\\nDescription=Nightly backup\\n[Timer]\\nOnCalendar=*-*-* 02:00:00\\n[Install]\\nWantedBy=timers.target\\n' > /etc/systemd/system/backup.timer
systemctl daemon-reload && systemctl enable --now greeter.service && systemctl enable backup.timer && echo task-$((40+2))-done
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_guest_session_through_the_server_is_ready_graded_and_typed_on() {
    if ttlab_testkit::which("qemu-system-x86_64").is_none() {
        ttlab_testkit::skip_or_fail(
            "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)",
        );
        return;
    }
    let Some(image) = std::env::var_os("TTLAB_GUEST_IMAGE") else {
        ttlab_testkit::skip_or_fail(
            "TTLAB_GUEST_IMAGE is not set: build the image with `sudo ttlabctl guest-image` and \
             set it to the directory printed",
        );
        return;
    };
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args([
            "demo",
            "--port",
            &port.to_string(),
            "--guest",
            "qemu",
            "--guest-image",
        ])
        .arg(&image)
        .env("CARGO", env!("CARGO"))
        .env("RUST_LOG", "warn")
        .env_remove("TTLAB_AUTH_SECRET")
        .env_remove("DATABASE_URL")
        .env_remove("TTLAB_SESSION_TTL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("starting ttlabctl demo --guest qemu");
    let _interrupt = Interrupt(child.id());
    let pid = child.id().expect("the demo's pid");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut token = String::new();
    let banner = tokio::time::timeout(Duration::from_secs(900), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(t) = line.trim().strip_prefix("student:") {
                token = t
                    .split("token=")
                    .nth(1)
                    .and_then(|t| t.split_whitespace().next())
                    .unwrap()
                    .to_owned();
            }
            if line.starts_with("Ctrl-C stops everything") {
                return;
            }
        }
        panic!("the demo ended before its banner");
    });
    banner.await.expect("the demo printed its banner in time");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let url = format!("http://127.0.0.1:{port}");
    let http: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    let clicked = Instant::now();
    let (status, created) = send(
        &http,
        http::Method::POST,
        &format!("{url}/api/sessions"),
        &token,
        Some(serde_json::json!({"lesson": "systemd-basics"})),
    )
    .await;
    assert_eq!(status, http::StatusCode::ACCEPTED, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    let session = format!("{url}/api/sessions/{id}");
    let view = loop {
        let (_, v) = send(&http, http::Method::GET, &session, &token, None).await;
        if v["status"] != "starting" {
            break v;
        }
        assert!(
            clicked.elapsed() < Duration::from_secs(900),
            "still starting after 15 min: {v}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    assert_eq!(view["status"], "running", "{view}");
    assert_eq!(view["stage"], "ready", "{view}");
    println!(
        "real guest through the server: Start lab -> running {:.1} s; VM created -> VMI running \
         {:.1} s, -> agent up {:.1} s (boot), -> ready {:.1} s (setup {:.1} s)",
        clicked.elapsed().as_secs_f64(),
        seconds_between(&view, "vm_created", "vmi_running"),
        seconds_between(&view, "vm_created", "agent_up"),
        seconds_between(&view, "vm_created", "ready"),
        seconds_between(&view, "agent_up", "ready"),
    );

    let grade = |http: HttpClient, token: String, session: String| async move {
        let (status, g) = send(
            &http,
            http::Method::POST,
            &format!("{session}/grade"),
            &token,
            None,
        )
        .await;
        assert_eq!(status, http::StatusCode::OK, "{g}");
        (g["passed"].as_u64().unwrap(), g["total"].as_u64().unwrap())
    };
    assert_eq!(
        grade(http.clone(), token.clone(), session.clone()).await,
        (0, 6)
    );

    let (status, ticket) = send(
        &http,
        http::Method::POST,
        &format!("{session}/console-ticket"),
        &token,
        None,
    )
    .await;
    assert_eq!(status, http::StatusCode::OK, "{ticket}");
    let ws_url = match ticket["url"].as_str().unwrap() {
        u if u.starts_with('/') => format!("ws://127.0.0.1:{port}{u}"),
        u => u.replacen("http", "ws", 1),
    };
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url.as_str())
        .await
        .expect("the console opens");
    let mut seen = String::new();
    async fn expect(
        ws: &mut tokio_tungstenite::WebSocketStream<
            tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
        >,
        seen: &mut String,
        needle: &str,
        within: Duration,
    ) {
        let deadline = Instant::now() + within;
        while !seen.contains(needle) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, ws.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) => seen.push_str(&String::from_utf8_lossy(&b)),
                Ok(Some(Ok(_))) => {}
                other => panic!("console: {needle:?} not seen ({other:?}):\n{seen}"),
            }
        }
    }
    ws.send(Message::Binary(Bytes::from_static(b"\r")))
        .await
        .unwrap();
    expect(&mut ws, &mut seen, "root@vm:~#", Duration::from_secs(60)).await;
    ws.send(Message::Binary(Bytes::from_static(
        b"systemctl --version | head -n 1\r",
    )))
    .await
    .unwrap();
    expect(&mut ws, &mut seen, "systemd 252", Duration::from_secs(60)).await;
    ws.send(Message::Binary(Bytes::from_static(THE_TASK.as_bytes())))
        .await
        .unwrap();
    expect(&mut ws, &mut seen, "task-42-done", Duration::from_secs(120)).await;
    assert_eq!(
        grade(http.clone(), token.clone(), session.clone()).await,
        (6, 6),
        "console:\n{seen}"
    );
    let _ = ws.close(None).await;

    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::INT,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(120), child.wait())
        .await
        .expect("the demo stopped in time after SIGINT")
        .unwrap();
    assert!(
        status.success(),
        "the demo exits cleanly on SIGINT: {status}"
    );
}
