//! Secrets stay secret through a whole run: the server and the reaper run as processes with
//! `RUST_LOG=debug` against kube-sim and a throwaway PostgreSQL, students go through every
//! step of a session (start, grade, console ticket, extend, finish, expiry reclaimed by the
//! reaper, forged tokens, another student's session), and then every captured line of both
//! processes' output, every API answer and both `/metrics` pages are searched for the auth
//! secret and for every agent token the database handed out (raw, and base64-encoded as it
//! travels inside the user-data).
//!
//! The binaries are those of `target/<profile>/`: `cargo test --workspace` builds them; alone,
//! run `cargo build -p ttlab-server-bin -p ttlab-reaper-bin -p ttlab-agent-bin` first. When
//! they are missing the test says so with [`ttlab_testkit::skip_or_fail`]: a `SKIPPED:` line,
//! or a failure under `CI=true` (`.ci/run` builds them).

mod common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_deploy_tests::repo_root;
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_model::{NodeName, SessionId};
use ttlab_store::ephemeral::PgCluster;

use common::{binaries_dir, binary, free_port};

const STARTUP: Duration = Duration::from_secs(60);
const SECRET: &str = "secret-pass-the-server-must-never-print-8f3a91c2";
const NAMESPACE: &str = "ttlab-vms";

/// Everything the processes printed and the API answered.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<String>>>);

impl Capture {
    fn push(&self, what: &str, text: String) {
        self.0.lock().unwrap().push(format!("[{what}] {text}"));
    }
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// Starts `program` with exactly `env` (plus PATH); every output line goes to `capture`.
/// Returns once a line contains `marker`.
async fn start(
    program: &Path,
    env: &BTreeMap<String, String>,
    marker: &str,
    capture: &Capture,
) -> Child {
    let mut child = Command::new(program)
        .env_clear()
        .envs(env)
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let name = program.file_name().unwrap().to_string_lossy().into_owned();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    for (stream, reader) in [
        (
            "stdout",
            Box::new(stdout) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
        ),
        ("stderr", Box::new(stderr)),
    ] {
        let capture = capture.clone();
        let tx = tx.clone();
        let what = format!("{name} {stream}");
        let marker = marker.to_owned();
        tokio::spawn(async move {
            let mut lines = BufReader::new(reader).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let hit = line.contains(&marker);
                capture.push(&what, line);
                if hit {
                    let _ = tx.send(());
                }
            }
        });
    }
    drop(tx);
    if tokio::time::timeout(STARTUP, rx.recv())
        .await
        .ok()
        .flatten()
        .is_none()
    {
        let _ = child.start_kill();
        panic!(
            "{} did not print {marker:?}:\n{}",
            program.display(),
            capture.all().join("\n")
        );
    }
    child
}

/// One HTTP/1.1 request; the status and the body, both recorded.
async fn http(
    capture: &Capture,
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {response:?}"));
    capture.push(&format!("{method} {path}"), response.clone());
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

fn json_of(body: &str) -> Value {
    // Bodies may be chunked: take the outermost JSON value.
    let start = body.find(['{', '[']).unwrap_or(0);
    let end = body.rfind(['}', ']']).map_or(body.len(), |e| e + 1);
    serde_json::from_str(&body[start..end]).unwrap_or(Value::Null)
}

struct Api<'a> {
    capture: &'a Capture,
    addr: SocketAddr,
}

impl Api<'_> {
    async fn call(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let (status, body) = http(self.capture, self.addr, method, path, Some(token), body).await;
        (status, json_of(&body))
    }

    /// Polls the session until `pred` holds (bounded).
    async fn wait(
        &self,
        sid: &str,
        token: &str,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let until = tokio::time::Instant::now() + within;
        loop {
            let (status, v) = self
                .call("GET", &format!("/api/sessions/{sid}"), token, None)
                .await;
            assert_eq!(status, 200, "{v}");
            if pred(&v) {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "session {sid} stuck: {v}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_or_agent_token_appears_in_logs_answers_or_metrics_over_a_full_run() {
    let (Some(server_bin), Some(reaper_bin), Some(agent_bin)) = (
        binary("ttlab-server"),
        binary("ttlab-reaper"),
        binary("ttlab-agent"),
    ) else {
        return ttlab_testkit::skip_or_fail(&format!(
            "ttlab-server, ttlab-reaper or ttlab-agent is not built in {}; build them first: \
             cargo build -p ttlab-server-bin -p ttlab-reaper-bin -p ttlab-agent-bin",
            binaries_dir().display()
        ));
    };
    let mut config = SimConfig::for_tests();
    config.namespaces.push(NAMESPACE.to_owned());
    let sim = KubeSim::start(config).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&kubeconfig, NAMESPACE).unwrap();
    let pg = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    let database_url = pg.create_database("ttlab").await.unwrap();

    let server_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let metrics_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let path = |p: &Path| p.display().to_string();
    let env: BTreeMap<String, String> = [
        ("DATABASE_URL", database_url.clone()),
        ("TTLAB_AUTH_SECRET", SECRET.to_owned()),
        ("KUBECONFIG", path(&kubeconfig)),
        ("TTLAB_NAMESPACE", NAMESPACE.to_owned()),
        ("TTLAB_ENV", "dev".to_owned()),
        ("TTLAB_LISTEN", server_addr.to_string()),
        ("TTLAB_METRICS_LISTEN", metrics_addr.to_string()),
        ("TTLAB_LESSONS", path(&repo_root().join("lessons"))),
        ("TTLAB_AGENT_BINARY", path(&agent_bin)),
        // Short lives so that the reaper reclaims one session during the run.
        ("TTLAB_SESSION_TTL", "40s".to_owned()),
        ("TTLAB_REAP_INTERVAL", "1s".to_owned()),
        ("RUST_LOG", "debug".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();

    let capture = Capture::default();
    let mut server = start(&server_bin, &env, "ttlab-server listening", &capture).await;
    let mut reaper = start(&reaper_bin, &env, "cycle in ", &capture).await;
    let api = Api {
        capture: &capture,
        addr: server_addr,
    };
    let auth = AuthConfig::new(AuthSecret::new(SECRET.as_bytes().to_vec()).unwrap());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mint = |user: &str, role| {
        auth.mint(&user.parse().unwrap(), role, now, Duration::from_secs(3600))
            .unwrap()
    };
    let (alice, bob, admin) = (
        mint("alice", Role::Student),
        mint("bob", Role::Student),
        mint("root", Role::Admin),
    );
    let store = ttlab_store::Store::connect(&database_url, ttlab_store::StoreOptions::default())
        .await
        .unwrap();
    let mut tokens: Vec<String> = Vec::new();

    // Two sessions: alice's single VM (left to expire), bob's multi-VM lab (finished).
    let mut sessions = Vec::new();
    for (token, lesson) in [(&alice, "systemd-basics"), (&bob, "kubeadm-cluster")] {
        let (status, v) = api
            .call(
                "POST",
                "/api/sessions",
                token,
                Some(json!({ "lesson": lesson })),
            )
            .await;
        assert_eq!(status, 202, "{v}");
        sessions.push(v["id"].as_str().unwrap().to_owned());
    }
    for (sid, token) in sessions.iter().zip([&alice, &bob]) {
        let v = api
            .wait(sid, token, Duration::from_secs(60), |v| {
                v["status"] != "starting"
            })
            .await;
        assert_eq!(v["status"], "running", "{v}");
        // The tokens the database handed out for this session's VMs.
        let id: SessionId = sid.parse().unwrap();
        for node in v["nodes"].as_array().unwrap() {
            let node: NodeName = node["node"].as_str().unwrap().parse().unwrap();
            if let Some(t) = store.agent_tokens().get(id, &node).await.unwrap() {
                tokens.push(t);
            }
        }
        let (status, v) = api
            .call(
                "POST",
                &format!("/api/sessions/{sid}/grade"),
                token,
                Some(json!({})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        let (status, v) = api
            .call(
                "POST",
                &format!("/api/sessions/{sid}/console-ticket"),
                token,
                Some(json!({})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
    }
    assert!(
        tokens.len() >= 3,
        "agent tokens from the database: {}",
        tokens.len()
    );

    // Refusals and admin screens, which carry error bodies and session data.
    let (alice_sid, bob_sid) = (&sessions[0], &sessions[1]);
    for (method, path, token) in [
        ("GET", format!("/api/sessions/{alice_sid}"), bob.clone()),
        (
            "POST",
            format!("/api/sessions/{alice_sid}/extend"),
            bob.clone(),
        ),
        ("GET", "/api/lessons".to_owned(), format!("{alice}x")),
        ("GET", "/api/admin/sessions".to_owned(), alice.clone()),
        ("GET", "/api/admin/sessions".to_owned(), admin.clone()),
        ("GET", "/api/admin/capacity".to_owned(), admin.clone()),
        ("GET", "/api/admin/reaper".to_owned(), admin.clone()),
        ("GET", "/api/admin/stats".to_owned(), admin.clone()),
        ("GET", "/api/sessions/current".to_owned(), alice.clone()),
        (
            "POST",
            format!("/api/sessions/{bob_sid}/extend"),
            bob.clone(),
        ),
    ] {
        let body = (method == "POST").then(|| json!({}));
        api.call(method, &path, &token, body).await;
    }
    let (status, v) = api
        .call("DELETE", &format!("/api/sessions/{bob_sid}"), &bob, None)
        .await;
    assert!(status < 300, "{status} {v}");
    api.wait(bob_sid, &bob, Duration::from_secs(60), |v| {
        v["status"] == "finished"
    })
    .await;
    // Alice's session expires and the reaper reclaims it.
    api.wait(alice_sid, &alice, Duration::from_secs(120), |v| {
        v["status"] == "expired"
    })
    .await;
    for (addr, what) in [(server_addr, "server"), (metrics_addr, "reaper")] {
        let (status, body) = http(&capture, addr, "GET", "/metrics", None, None).await;
        assert_eq!(status, 200, "{what} /metrics: {body}");
    }
    store.close();
    for child in [&mut server, &mut reaper] {
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }
    // Let the readers take the last lines.
    tokio::time::sleep(Duration::from_millis(200)).await;

    let b64 = base64::engine::general_purpose::STANDARD;
    let mut needles: Vec<(String, String)> = vec![
        ("the auth secret".into(), SECRET.to_owned()),
        ("the auth secret (base64)".into(), b64.encode(SECRET)),
    ];
    for (i, t) in tokens.iter().enumerate() {
        needles.push((format!("agent token {i}"), t.clone()));
        needles.push((
            format!("agent token {i} as in the user-data"),
            b64.encode(format!("{t}\n")),
        ));
        // Half of it is already enough to be a leak worth knowing about.
        needles.push((format!("agent token {i} (first half)"), t[..32].to_owned()));
    }
    let lines = capture.all();
    assert!(
        lines.iter().any(|l| l.contains("DEBUG")),
        "the run was not logged at debug level"
    );
    assert!(
        lines.len() > 100,
        "too little output captured: {}",
        lines.len()
    );
    for (what, needle) in &needles {
        if let Some(line) = lines.iter().find(|l| l.contains(needle.as_str())) {
            panic!("{what} appears in the captured output: {line}");
        }
    }
    eprintln!(
        "searched {} captured lines and answers ({} bytes) for {} secrets",
        lines.len(),
        lines.iter().map(String::len).sum::<usize>(),
        needles.len()
    );
    sim.shutdown().await;
    tokio::task::spawn_blocking(move || pg.stop())
        .await
        .unwrap()
        .unwrap();
}
