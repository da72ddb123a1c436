//! `ttlab-server` as separate processes against kube-sim, a throwaway PostgreSQL and the real
//! agent: two replicas receiving 50 concurrent clicks of one student open one session, and a
//! server killed (SIGKILL) while provisioning leaves nothing behind once a server starts
//! again.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_cluster::{Cluster as _, ClusterSettings, Kind, KubeCluster};
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_store::testing::TestDb;

const NS: &str = "ttlab-vms";
const SECRET: &str = "a process test secret, long enough: 40+ bytes";
/// How long a server process may take to come up (debug build, loaded machine).
const STARTUP: Duration = Duration::from_secs(60);

const LESSONS: &str = r#"
id: quick
title: Quick
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
readiness_timeout_seconds: 10
setup_timeout_seconds: 10
---
id: duo
title: Two nodes
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
nodes: [one, two]
readiness_timeout_seconds: 10
setup_timeout_seconds: 10
"#;

fn token(user: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    AuthConfig::new(AuthSecret::new(SECRET).unwrap())
        .mint(
            &user.parse().unwrap(),
            Role::Student,
            now,
            Duration::from_secs(3600),
        )
        .unwrap()
}

struct World {
    db: TestDb,
    sim: KubeSim,
    dir: tempfile::TempDir,
}

impl World {
    async fn new() -> Self {
        let db = TestDb::new().await.expect("test database");
        let mut config = SimConfig::for_tests();
        config.namespaces.push(NS.into());
        let sim = KubeSim::start(config).await.expect("kube-sim");
        let dir = tempfile::tempdir().unwrap();
        sim.write_kubeconfig(&dir.path().join("kubeconfig"), NS)
            .unwrap();
        std::fs::write(dir.path().join("lessons.yaml"), LESSONS).unwrap();
        Self { db, sim, dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    async fn cluster(&self) -> KubeCluster {
        KubeCluster::from_kubeconfig(&self.path("kubeconfig"), ClusterSettings::in_namespace(NS))
            .await
            .unwrap()
    }

    /// Starts `ttlab-server` on a port of its choosing and waits for it to say where.
    async fn server(&self) -> Server {
        let agent = ttlab_agent::locate_binary().expect("cargo build -p ttlab-agent-bin");
        let mut child = Command::new(env!("CARGO_BIN_EXE_ttlab-server"))
            .env("DATABASE_URL", self.db.url())
            .env("TTLAB_LISTEN", "127.0.0.1:0")
            .env("TTLAB_AUTH_SECRET", SECRET)
            .env("TTLAB_LESSONS", self.path("lessons.yaml"))
            .env("TTLAB_AGENT_BINARY", &agent)
            .env("TTLAB_NAMESPACE", NS)
            .env("TTLAB_ENV", "dev")
            .env("KUBECONFIG", self.path("kubeconfig"))
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("TTLAB_AUTH_HEADER")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("ttlab-server starts");
        let log = Arc::new(Mutex::new(String::new()));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = tokio::time::timeout(STARTUP, async {
            while let Ok(Some(line)) = lines.next_line().await {
                log.lock().unwrap().push_str(&format!("{line}\n"));
                if line.contains("ttlab-server listening")
                    && let Some(addr) = listening_addr(&line)
                {
                    return Some(addr);
                }
            }
            None
        })
        .await
        .ok()
        .flatten();
        let Some(addr) = addr else {
            let mut err = String::new();
            let _ = child.kill().await;
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err).await;
            }
            panic!("ttlab-server did not come up: {}{err}", log.lock().unwrap());
        };
        // Keep draining its output, so it never blocks on a full pipe.
        let drain = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                drain.lock().unwrap().push_str(&format!("{line}\n"));
            }
        });
        let mut stderr = child.stderr.take().unwrap();
        tokio::spawn(async move {
            let mut sink = Vec::new();
            let _ = stderr.read_to_end(&mut sink).await;
        });
        Server { child, addr, log }
    }

    /// Waits (bounded) until the cluster holds no VM, VMI or cloud-init Secret of ttlab.
    async fn wait_empty(&self) {
        let cluster = self.cluster().await;
        let selector = ttlab_model::labels::managed_selector();
        for _ in 0..400 {
            let stats = self.sim.stats();
            let secrets = cluster.list_all(Kind::Secret, &selector).await.unwrap();
            if stats.vms + stats.vmis == 0 && secrets.iter().all(|s| s.deleting) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("cluster not empty: {:?}", self.sim.stats());
    }
}

/// `addr=127.0.0.1:PORT` in a log line.
fn listening_addr(line: &str) -> Option<SocketAddr> {
    let rest = &line[line.find("addr=")? + 5..];
    rest.split_whitespace().next()?.parse().ok()
}

struct Server {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
}

impl Server {
    /// One HTTP/1.1 request; returns the status and the JSON body.
    async fn request(
        &self,
        method: &str,
        path: &str,
        tok: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut stream = TcpStream::connect(self.addr).await.unwrap();
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {tok}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let text = String::from_utf8_lossy(&response);
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP response: {text}"));
        let json = text
            .split_once("\r\n\r\n")
            .and_then(|(_, b)| serde_json::from_str(b).ok())
            .unwrap_or(Value::Null);
        (status, json)
    }

    async fn wait_session(&self, id: &str, tok: &str, pred: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..600 {
            let (status, v) = self
                .request("GET", &format!("/api/sessions/{id}"), tok, None)
                .await;
            assert_eq!(status, 200, "{v}");
            if pred(&v) {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "session {id} never reached the expected state; server log:\n{}",
            self.log.lock().unwrap()
        );
    }

    /// SIGKILL, as a crash or an OOM kill would.
    async fn kill(mut self) {
        self.child.start_kill().unwrap();
        let status = self.child.wait().await.unwrap();
        assert!(!status.success());
    }

    /// SIGTERM and wait for the graceful exit.
    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_clicks_on_two_server_processes_open_one_session() {
    let w = World::new().await;
    let (a, b) = tokio::join!(w.server(), w.server());
    let alice = token("alice");
    let clicks = (0..50).map(|i| {
        let s = if i % 2 == 0 { &a } else { &b };
        s.request(
            "POST",
            "/api/sessions",
            &alice,
            Some(json!({"lesson": "quick"})),
        )
    });
    let results = futures::future::join_all(clicks).await;
    let accepted: Vec<&Value> = results
        .iter()
        .filter(|(s, _)| *s == 202)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(accepted.len(), 1, "{results:?}");
    for (status, v) in &results {
        assert!(
            *status == 202 || (*status == 409 && v["error"] == "session_exists"),
            "{status} {v}"
        );
    }
    let id = accepted[0]["id"].as_str().unwrap().to_owned();
    // Either process serves it (the state is in the database).
    let v = b
        .wait_session(&id, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    let (_, current) = a
        .request("GET", "/api/sessions/current", &alice, None)
        .await;
    assert_eq!(current["id"], id.as_str());
    assert_eq!(w.sim.stats().peak_vms, 1, "{:?}", w.sim.stats());
    tokio::join!(a.stop(), b.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_killed_while_provisioning_leaks_nothing_after_a_restart() {
    let w = World::new().await;
    // Hold the guests, so the kill lands mid-provisioning.
    w.sim.pause_kubevirt(true);
    let first = w.server().await;
    let alice = token("alice");
    let (status, v) = first
        .request(
            "POST",
            "/api/sessions",
            &alice,
            Some(json!({"lesson": "duo"})),
        )
        .await;
    assert_eq!(status, 202, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    first
        .wait_session(&id, &alice, |v| v["stages"]["vm_created"].is_string())
        .await;
    first.kill().await;
    w.sim.pause_kubevirt(false);
    assert!(w.sim.stats().vms >= 1, "the kill left VMs to clean up");

    // The dead server's database connection (and its provisioning lock) goes away with it.
    let store = w.db.store().await.unwrap();
    let sid: ttlab_model::SessionId = id.parse().unwrap();
    let mut free = false;
    for _ in 0..200 {
        if store.try_provisioning_lock(sid).await.unwrap().is_some() {
            free = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        free,
        "the killed server's provisioning lock was never released"
    );

    let again = w.server().await;
    let v = again
        .wait_session(&id, &alice, |v| v["status"] == "failed")
        .await;
    assert!(
        v["failure_reason"].as_str().unwrap().contains("restarted"),
        "{v}"
    );
    w.wait_empty().await;
    assert_eq!(store.agent_tokens().count(sid).await.unwrap(), 0);
    // The student starts again on the restarted server.
    let (status, v) = again
        .request(
            "POST",
            "/api/sessions",
            &alice,
            Some(json!({"lesson": "duo"})),
        )
        .await;
    assert_eq!(status, 202, "{v}");
    let v = again
        .wait_session(v["id"].as_str().unwrap(), &alice, |v| {
            v["status"] != "starting"
        })
        .await;
    assert_eq!(v["status"], "running", "{v}");
    again.stop().await;
}

#[test]
fn the_listening_line_names_the_address() {
    assert_eq!(
        listening_addr(
            "2026-01-01T00:00:00Z  INFO ttlab_server: ttlab-server listening addr=127.0.0.1:4321"
        ),
        Some("127.0.0.1:4321".parse().unwrap())
    );
}
