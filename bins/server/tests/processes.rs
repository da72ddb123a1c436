//! `ttlab-server` as separate processes against kube-sim, a throwaway PostgreSQL and the real
//! agent: two replicas receiving 50 concurrent clicks of one student open one session; a
//! server killed (SIGKILL) while provisioning has its session resumed once it starts again; a
//! server stopped (SIGTERM, a deploy) mid-provisioning hands its session to another replica,
//! which finishes it; a server cut off from PostgreSQL (half-open connections, through a
//! `FaultProxy`) has its session taken over by another replica within 30 s; and a server
//! started without its PostgreSQL, or whose PostgreSQL stops under it, stays up (alive, not
//! ready, saying why) and works again within seconds of the database's return; one whose
//! Kubernetes API does not answer at start stays up and serves what needs only the database.

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
use ttlab_cluster::{ClusterSettings, Kind, KubeCluster, ReaperCluster as _};
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

    /// Starts `ttlab-server` on `database_url` with `settings` (more `TTLAB_*` variables) on
    /// a port of its choosing, and waits for it to say where.
    async fn server_with(&self, database_url: &str, settings: &[(&str, &str)]) -> Server {
        let agent = ttlab_agent::locate_binary().expect("cargo build -p ttlab-agent-bin");
        let mut child = Command::new(env!("CARGO_BIN_EXE_ttlab-server"))
            .envs(settings.iter().copied())
            .env("DATABASE_URL", database_url)
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
        let (status, _, json) = self.exchange(method, path, tok, body).await;
        (status, json)
    }

    /// One HTTP/1.1 request; returns the status, the head (status line and headers) and the
    /// JSON body.
    async fn exchange(
        &self,
        method: &str,
        path: &str,
        tok: &str,
        body: Option<Value>,
    ) -> (u16, String, Value) {
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
        let (head, json) = match text.split_once("\r\n\r\n") {
            Some((head, b)) => (
                head.to_owned(),
                serde_json::from_str(b).unwrap_or(Value::Null),
            ),
            None => (text.to_string(), Value::Null),
        };
        (status, head, json)
    }

    /// Whether the process has exited (and then how).
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("the child's status")
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
    // The per-user rate limit would answer most of the clicks 429 before they race: off here.
    let no_rate_limit = [("TTLAB_USER_RATE_INTERVAL", "0s")];
    let (a, b) = tokio::join!(
        w.server_with(w.db.url(), &no_rate_limit),
        w.server_with(w.db.url(), &no_rate_limit)
    );
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

/// Short leases, so the tests need not wait out the production ones.
const SHORT_LEASE: &[(&str, &str)] = &[("TTLAB_PROVISIONING_LEASE", "2s")];

/// Starts a session of the two-VM lesson on `server` and waits until its VMs exist (the guests
/// are held by the caller, so provisioning is still under way).
async fn start_duo(server: &Server, tok: &str) -> String {
    let (status, v) = server
        .request("POST", "/api/sessions", tok, Some(json!({"lesson": "duo"})))
        .await;
    assert_eq!(status, 202, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    server
        .wait_session(&id, tok, |v| v["stages"]["vm_created"].is_string())
        .await;
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_killed_while_provisioning_has_its_session_resumed_after_a_restart() {
    let w = World::new().await;
    // Hold the guests, so the kill lands mid-provisioning.
    w.sim.pause_kubevirt(true);
    let first = w.server_with(w.db.url(), SHORT_LEASE).await;
    let alice = token("alice");
    let id = start_duo(&first, &alice).await;
    first.kill().await;
    w.sim.pause_kubevirt(false);
    assert!(w.sim.stats().vms >= 1, "the kill left VMs behind");

    // The restarted server finds the session unleased (the dead one's lease expired: nothing
    // depended on its sockets) and resumes it: the student's lab is not failed by the crash.
    let again = w.server_with(w.db.url(), SHORT_LEASE).await;
    let v = again
        .wait_session(&id, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    // Resumed, not duplicated: the VMs already there were adopted.
    assert_eq!(w.sim.stats().peak_vms, 2, "{:?}", w.sim.stats());
    assert!(
        again
            .log
            .lock()
            .unwrap()
            .contains("adopting a session nobody is provisioning"),
        "{}",
        again.log.lock().unwrap()
    );
    // The student can grade and finish as usual; nothing is left behind.
    let (status, v) = again
        .request("DELETE", &format!("/api/sessions/{id}"), &alice, None)
        .await;
    assert!(status == 200 || status == 202, "{status} {v}");
    w.wait_empty().await;
    again.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_stopped_mid_provisioning_hands_its_session_to_another_server() {
    let w = World::new().await;
    w.sim.pause_kubevirt(true);
    let (a, b) = tokio::join!(
        w.server_with(w.db.url(), SHORT_LEASE),
        w.server_with(w.db.url(), SHORT_LEASE)
    );
    let alice = token("alice");
    let id = start_duo(&a, &alice).await;

    // A rolling deploy stops `a` while the session is being prepared.
    let log = a.log.clone();
    let stopped = std::time::Instant::now();
    a.stop().await;
    let text = log.lock().unwrap().clone();
    assert!(text.contains("handing over"), "{text}");
    assert!(
        stopped.elapsed() < Duration::from_secs(15),
        "the hand-over took {:?}",
        stopped.elapsed()
    );
    w.sim.pause_kubevirt(false);

    // `b` adopts it and finishes it: the deploy failed nobody's lab.
    let v = b
        .wait_session(&id, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert!(v["failure_reason"].is_null(), "{v}");
    assert_eq!(w.sim.stats().peak_vms, 2, "{:?}", w.sim.stats());
    eprintln!(
        "session {id} resumed by the other server and running {:.1}s after SIGTERM",
        stopped.elapsed().as_secs_f64()
    );
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_cut_off_from_the_database_has_its_session_taken_over_within_30_s() {
    let w = World::new().await;
    let upstream = match w.db.server_socket() {
        ttlab_store::testing::ServerSocket::Unix(p) => ttlab_testkit::Upstream::Unix(p),
        ttlab_store::testing::ServerSocket::Tcp(host, port) => {
            use std::net::ToSocketAddrs as _;
            ttlab_testkit::Upstream::Tcp(
                (host.as_str(), port)
                    .to_socket_addrs()
                    .unwrap()
                    .next()
                    .unwrap(),
            )
        }
    };
    let proxy = ttlab_testkit::FaultProxy::start(upstream).unwrap();
    w.sim.pause_kubevirt(true);
    let cut_off_url = w.db.url_at(proxy.addr());
    let settings = [
        ("TTLAB_PROVISIONING_LEASE", "2s"),
        ("TTLAB_DB_CALL_TIMEOUT", "1s"),
    ];
    let (a, b) = tokio::join!(
        w.server_with(&cut_off_url, &settings),
        w.server_with(w.db.url(), &settings)
    );
    let alice = token("alice");
    let id = start_duo(&a, &alice).await;

    // `a`'s connections go half-open: no reply, no RST, no FIN.
    proxy.set_mode(ttlab_testkit::FaultMode::Blackhole);
    let cut = std::time::Instant::now();
    w.sim.pause_kubevirt(false);
    let v = b
        .wait_session(&id, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert!(
        cut.elapsed() < Duration::from_secs(30),
        "taken over after {:?}",
        cut.elapsed()
    );
    eprintln!(
        "session {id} taken over and running {:.1}s after its server was cut off",
        cut.elapsed().as_secs_f64()
    );
    let b_log = b.log.lock().unwrap().clone();
    assert!(
        b_log.contains("adopting a session nobody is provisioning"),
        "{b_log}"
    );
    a.kill().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_server_connects_over_verified_tls_and_a_wrong_ca_fails_clearly() {
    if ttlab_testkit::which("openssl").is_none() {
        return ttlab_testkit::skip_or_fail("openssl is not on PATH (test certificates)");
    }
    let w = World::new().await;
    let pg = tokio::task::spawn_blocking(ttlab_store::testing::TlsServer::start)
        .await
        .unwrap()
        .expect("TLS-enabled throwaway PostgreSQL");
    pg.create_database("ttlab", false).await.unwrap();
    let url = |ca: &std::path::Path| {
        pg.url(
            "localhost",
            "ttlab",
            &format!("sslmode=verify-full&sslrootcert={}", ca.display()),
        )
    };

    // The right CA: it migrates, serves, and a lab reaches running.
    let server = w.server_with(&url(&pg.ca()), &[]).await;
    let alice = token("alice");
    let (status, v) = server
        .request(
            "POST",
            "/api/sessions",
            &alice,
            Some(json!({"lesson": "quick"})),
        )
        .await;
    assert_eq!(status, 202, "{v}");
    let v = server
        .wait_session(v["id"].as_str().unwrap(), &alice, |v| {
            v["status"] != "starting"
        })
        .await;
    assert_eq!(v["status"], "running", "{v}");
    server.stop().await;

    // A CA that did not sign the server's certificate: it exits at once with a clear reason.
    let agent = ttlab_agent::locate_binary().expect("cargo build -p ttlab-agent-bin");
    let out = tokio::time::timeout(
        STARTUP,
        Command::new(env!("CARGO_BIN_EXE_ttlab-server"))
            .env("DATABASE_URL", url(&pg.wrong_ca()))
            .env("TTLAB_LISTEN", "127.0.0.1:0")
            .env("TTLAB_AUTH_SECRET", SECRET)
            .env("TTLAB_LESSONS", w.path("lessons.yaml"))
            .env("TTLAB_AGENT_BINARY", &agent)
            .env("KUBECONFIG", w.path("kubeconfig"))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("it exits")
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("cannot connect to PostgreSQL at localhost:")
            && err.contains("invalid peer certificate: UnknownIssuer"),
        "{err}"
    );
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

/// While its database is down the server stays up and says why: `/healthz` 200 (liveness),
/// `/readyz` 503 naming the unreachable database, a student's request 503
/// `database_unavailable` with `Retry-After`; checked for `secs` seconds.
async fn stays_up_without_its_database(server: &mut Server, tok: &str, secs: u64) {
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    let mut checks = 0;
    while std::time::Instant::now() < until || checks < 3 {
        assert_eq!(
            server.exited(),
            None,
            "the server exited without its database"
        );
        let (status, live) = server.request("GET", "/healthz", tok, None).await;
        assert_eq!(status, 200, "liveness without the database: {live}");
        let (status, ready) = server.request("GET", "/readyz", tok, None).await;
        assert_eq!(status, 503, "ready without its database? {ready}");
        let reason = ready["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("database") && ready["database"]["last_error"].is_string(),
            "/readyz does not say why: {ready}"
        );
        let (status, head, body) = server
            .exchange("GET", "/api/sessions/current", tok, None)
            .await;
        assert_eq!(
            (status, body["error"].as_str()),
            (503, Some("database_unavailable")),
            "{body}"
        );
        assert!(
            head.to_ascii_lowercase().contains("\r\nretry-after: "),
            "no Retry-After: {head}"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Polls `works` every 100 ms until it holds; how long after `since` it did (at most 60 s).
async fn working_again<F, Fut>(since: std::time::Instant, mut works: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    while since.elapsed() < Duration::from_secs(60) {
        if works().await {
            return since.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("not working again 60 s after the database returned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_its_database_the_server_stays_up_and_works_again_within_seconds_of_its_return() {
    let w = World::new().await;
    let mut pg = tokio::task::spawn_blocking(ttlab_store::ephemeral::PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    // An empty database: the server migrates it once it answers.
    let url = pg.create_database("ttlab").await.unwrap();
    let alice = token("alice");

    // 1. Started while PostgreSQL is down: it serves at once, not ready, and does not exit.
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    let mut server = w.server_with(&url, &[]).await;
    stays_up_without_its_database(&mut server, &alice, 4).await;
    tokio::task::block_in_place(|| pg.resume()).unwrap();
    let returned = std::time::Instant::now();
    // Working: a start (the capacity lock, the insert) is accepted.
    let session = Mutex::new(None);
    let took = working_again(returned, || async {
        let (status, v) = server
            .request(
                "POST",
                "/api/sessions",
                &alice,
                Some(json!({"lesson": "quick"})),
            )
            .await;
        if status == 202 {
            *session.lock().unwrap() = v["id"].as_str().map(str::to_owned);
        }
        status == 202
    })
    .await;
    println!(
        "ttlab-server: working again {:.1} s after the database returned (started without it)",
        took.as_secs_f64()
    );
    assert!(took <= Duration::from_secs(5), "{took:?}");
    let session = session
        .into_inner()
        .unwrap()
        .expect("the started session's id");
    server
        .wait_session(&session, &alice, |v| v["status"] == "running")
        .await;
    let (status, ready) = server.request("GET", "/readyz", &alice, None).await;
    assert_eq!(status, 200, "{ready}");

    // 2. PostgreSQL stops under the running server: it stays up, and works again.
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    stays_up_without_its_database(&mut server, &alice, 4).await;
    tokio::task::block_in_place(|| pg.resume()).unwrap();
    let returned = std::time::Instant::now();
    // Working: the student's session is read from the database.
    let took = working_again(returned, || async {
        let (status, v) = server
            .request("GET", "/api/sessions/current", &alice, None)
            .await;
        status == 200 && v["id"].as_str() == Some(session.as_str())
    })
    .await;
    println!(
        "ttlab-server: working again {:.1} s after the database returned (stopped under it)",
        took.as_secs_f64()
    );
    assert!(took <= Duration::from_secs(5), "{took:?}");
    let (status, ready) = server.request("GET", "/readyz", &alice, None).await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(server.exited(), None, "the server exited");

    server.stop().await;
    tokio::task::block_in_place(|| pg.stop()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_whose_cluster_does_not_answer_at_start_stays_up_and_serves_from_its_database() {
    let w = World::new().await;
    // An API server address nothing listens on: every call is refused.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    std::fs::write(
        w.path("kubeconfig"),
        ttlab_kube_sim::kubeconfig_yaml(&format!("http://{dead}"), NS),
    )
    .unwrap();
    let mut server = w.server_with(w.db.url(), &[]).await;
    let alice = token("alice");
    // The probe finds the cluster unreachable, and says so; the process stays up, alive and
    // ready (reading a session needs only the database), and answers from its database.
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, health) = server
            .request("GET", "/healthz/cluster", &alice, None)
            .await;
        if status == 503 {
            assert_eq!(health["reachable"], false, "{health}");
            assert!(health["error"].is_string(), "{health}");
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the probe never reported the unreachable cluster: {health}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for _ in 0..3 {
        assert_eq!(
            server.exited(),
            None,
            "the server exited without its cluster"
        );
        let (status, live) = server.request("GET", "/healthz", &alice, None).await;
        assert_eq!(status, 200, "{live}");
        let (status, ready) = server.request("GET", "/readyz", &alice, None).await;
        assert_eq!(status, 200, "{ready}");
        let (status, none) = server
            .request("GET", "/api/sessions/current", &alice, None)
            .await;
        assert_eq!(
            (status, none["error"].as_str()),
            (404, Some("session_not_found")),
            "{none}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    server.stop().await;
}
