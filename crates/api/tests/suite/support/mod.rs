//! A server under test: a fresh database, kube-sim over HTTP, the real agent binary, and
//! `ttlab_api::Server` on 127.0.0.1:0.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_api::{ApiConfig, Server};
use ttlab_cluster::{ClusterSettings, KubeCluster};
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_lesson::LessonSet;
use ttlab_lifespan::Policy;
use ttlab_store::testing::TestDb;

pub const NS: &str = "ttlab-vms";
pub const SECRET: &[u8] = b"a test secret that is long enough, 40+ b";

/// Test lessons: short timeouts so failures are fast (a VM's start gets 15 s: kube-sim starts
/// one in well under a second, but a saturated 2-core machine has taken over 5 s).
pub const LESSONS: &str = r#"
id: quick
title: Quick
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
grading:
  - name: passes
    command: "true"
  - name: fails
    command: "exit 3"
---
id: golden
title: Golden
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
golden:
  pvc: golden-debian
readiness_timeout_seconds: 2
setup_timeout_seconds: 5
---
id: broken
title: Broken setup
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
---
id: hangs
title: Setup never finishes
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
readiness_timeout_seconds: 15
setup_timeout_seconds: 1
---
id: duo
title: Two nodes
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
nodes: [one, two]
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
---
id: shell
title: A shell in a pod
runtime: pod
image: docker.io/library/debian:12
memory: 128Mi
readiness_timeout_seconds: 2
grading:
  - name: passes
    command: "true"
  - name: fails
    command: "exit 3"
"#;

pub struct World {
    pub db: TestDb,
    pub sim: KubeSim,
    pub kubeconfig: tempfile::TempDir,
}

pub fn auth() -> AuthConfig {
    AuthConfig::new(AuthSecret::new(SECRET.to_vec()).unwrap())
}

pub fn token(user: &str, role: Role) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    auth()
        .mint(&user.parse().unwrap(), role, now, Duration::from_secs(3600))
        .unwrap()
}

/// A guest address range unlikely to be used by another test process at the same time.
fn octet() -> u8 {
    let n = std::process::id() as u64
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos() as u64;
    101 + (n % 150) as u8
}

/// A kube-sim for tests (with the namespace [`NS`], the test lessons' setup outcomes, a guest
/// address range of its own), configured further by `configure`, and a directory holding its
/// kubeconfig (`config`).
pub async fn sim_with(configure: impl FnOnce(&mut SimConfig)) -> (KubeSim, tempfile::TempDir) {
    let mut config = SimConfig::for_tests();
    config.namespaces.push(NS.into());
    config.guest_ip_second_octet = octet();
    config.lesson_setup.insert(
        "broken".into(),
        ttlab_kube_sim::SetupOutcome::Fail {
            reason: "apt-get failed".into(),
        },
    );
    config
        .lesson_setup
        .insert("hangs".into(), ttlab_kube_sim::SetupOutcome::Never);
    configure(&mut config);
    let sim = KubeSim::start(config).await.expect("kube-sim");
    let kubeconfig = tempfile::tempdir().unwrap();
    sim.write_kubeconfig(&kubeconfig.path().join("config"), NS)
        .unwrap();
    (sim, kubeconfig)
}

impl World {
    pub async fn new() -> Self {
        Self::with(|_| {}).await
    }

    /// A world whose kube-sim is configured further by `configure`.
    pub async fn with(configure: impl FnOnce(&mut SimConfig)) -> Self {
        let db = TestDb::new().await.expect("test database");
        let (sim, kubeconfig) = sim_with(configure).await;
        Self {
            db,
            sim,
            kubeconfig,
        }
    }

    pub async fn config(&self, policy: Policy, vm_limit: usize) -> ApiConfig {
        let agent =
            std::fs::read(ttlab_agent::locate_binary().expect("cargo build -p ttlab-agent-bin"))
                .unwrap();
        let lessons = LessonSet::from_sources([("test.yaml".into(), LESSONS.to_owned())]).unwrap();
        let mut config = ApiConfig::new(
            "dev".parse().unwrap(),
            auth(),
            lessons,
            ttlab_cloudinit::AgentPayload::new(&agent).unwrap(),
        );
        config.listen = "127.0.0.1:0".parse().unwrap();
        config.policy = policy;
        config.vm_limit = vm_limit;
        config.collect_timeout = Duration::from_millis(500);
        config
    }

    pub async fn cluster(&self) -> Arc<KubeCluster> {
        let settings = ClusterSettings::in_namespace(NS);
        Arc::new(
            KubeCluster::from_kubeconfig(&self.kubeconfig.path().join("config"), settings)
                .await
                .unwrap(),
        )
    }

    /// Starts a server instance (a replica) on its own pool and cluster client.
    pub async fn server(&self, policy: Policy, vm_limit: usize) -> Running {
        let config = self.config(policy, vm_limit).await;
        self.serve(config).await
    }

    /// Starts a server instance with `config` (from [`World::config`], changed by the test).
    pub async fn serve(&self, config: ApiConfig) -> Running {
        let store = self.db.store().await.unwrap();
        self.serve_on(config, store).await
    }

    /// A cluster client whose calls go to `addr` (a proxy in front of kube-sim) instead.
    pub async fn cluster_through(&self, addr: std::net::SocketAddr) -> Arc<KubeCluster> {
        let path = self
            .kubeconfig
            .path()
            .join(format!("through-{}", addr.port()));
        std::fs::write(
            &path,
            ttlab_kube_sim::kubeconfig_yaml(&format!("http://{addr}"), NS),
        )
        .unwrap();
        Arc::new(
            KubeCluster::from_kubeconfig(&path, ClusterSettings::in_namespace(NS))
                .await
                .unwrap(),
        )
    }

    /// Starts a server instance with `config` on `store` (a database of the test's own).
    pub async fn serve_on(&self, config: ApiConfig, store: ttlab_store::Store) -> Running {
        self.serve_with(config, store, self.cluster().await).await
    }

    /// Starts a server instance with `config` on the sites `sites` (each with its client).
    pub async fn serve_sites(
        &self,
        config: ApiConfig,
        sites: Vec<ttlab_api::sites::SiteRuntime>,
    ) -> Running {
        let store = self.db.store().await.unwrap();
        let server = Server::bind_sites(config, store, sites).await.unwrap();
        Running::of(server)
    }

    /// Starts a server instance with `config` on `store` and `cluster` (a client of the
    /// test's own, through a proxy, say).
    pub async fn serve_with(
        &self,
        config: ApiConfig,
        store: ttlab_store::Store,
        cluster: Arc<KubeCluster>,
    ) -> Running {
        let server = Server::bind(config, store, cluster).await.unwrap();
        Running::of(server)
    }

    /// Cluster objects of kinds ttlab creates, labelled as ttlab's.
    pub fn leftovers(&self) -> usize {
        let s = self.sim.stats();
        s.vms + s.vmis
    }

    /// Waits (bounded) until the cluster holds no VM and no VMI.
    pub async fn wait_empty(&self) {
        for _ in 0..200 {
            if self.leftovers() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("cluster not empty: {:?}", self.sim.stats());
    }
}

pub struct Running {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    pub state: ttlab_api::AppState,
    http: Client<HttpConnector, Full<Bytes>>,
}

impl Running {
    /// Serves `server` in a task of its own.
    pub fn of(server: Server) -> Self {
        let addr = server.local_addr();
        let state = server.state().clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            server
                .run(async move {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        Running {
            base: format!("http://{addr}"),
            stop: Some(tx),
            task: Some(task),
            state,
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> (u16, Value) {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let res = self
            .http
            .request(req.body(Full::new(Bytes::from(body))).unwrap())
            .await
            .expect("response");
        let status = res.status().as_u16();
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        let v = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (status, v)
    }

    /// `GET path` (with `token`, if any): the status, the headers and the body's length.
    pub async fn head_of(&self, path: &str, token: Option<&str>) -> (u16, http::HeaderMap, usize) {
        let mut req = http::Request::builder()
            .method("GET")
            .uri(format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let res = self
            .http
            .request(req.body(Full::new(Bytes::new())).unwrap())
            .await
            .expect("response");
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        (status, headers, bytes.len())
    }

    pub async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        self.raw("GET", path, Some(token), None, Vec::new()).await
    }

    pub async fn post(&self, path: &str, token: &str, body: Value) -> (u16, Value) {
        self.raw(
            "POST",
            path,
            Some(token),
            Some("application/json"),
            serde_json::to_vec(&body).unwrap(),
        )
        .await
    }

    pub async fn delete(&self, path: &str, token: &str) -> (u16, Value) {
        self.raw("DELETE", path, Some(token), None, Vec::new())
            .await
    }

    /// Polls the session until `pred` holds (bounded: about 60 s).
    pub async fn wait_session(
        &self,
        id: &str,
        token: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        for _ in 0..1200 {
            let (status, v) = self.get(&format!("/api/sessions/{id}"), token).await;
            assert_eq!(status, 200, "{v}");
            if pred(&v) {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("session {id} never reached the expected state");
    }

    /// Stops serving and aborts background work, as a crash would.
    pub async fn kill(mut self) {
        self.state.abort_tasks();
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}
/// Opens a session of `lesson` for the student `user` and waits until it runs; its id and the
/// student's token.
pub async fn start_running(s: &Running, user: &str, lesson: &str) -> (String, String) {
    let t = token(user, Role::Student);
    let (status, v) = s
        .post("/api/sessions", &t, serde_json::json!({ "lesson": lesson }))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = v["id"].as_str().unwrap().to_owned();
    let v = s
        .wait_session(&sid, &t, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    (sid, t)
}

/// A policy whose extend window is the whole ttl: extending is offered whenever it adds time
/// (the tests of other rules extend right after the start).
pub fn policy(ttl: u64, max: u64, ext: u32) -> Policy {
    Policy::new(Duration::from_secs(ttl), Duration::from_secs(max), ext)
        .unwrap()
        .with_extend_window(Duration::from_secs(ttl))
        .unwrap()
}

/// A policy with an extend window of `window` seconds.
pub fn windowed_policy(ttl: u64, max: u64, ext: u32, window: u64) -> Policy {
    Policy::new(Duration::from_secs(ttl), Duration::from_secs(max), ext)
        .unwrap()
        .with_extend_window(Duration::from_secs(window))
        .unwrap()
}

/// Runs `statement` with the session id as `$1` (text: cast it, `$1::text::uuid`) on the
/// test's database; how many rows it changed.
#[allow(dead_code)]
pub async fn sql(w: &World, statement: &str, sid: &str) -> u64 {
    let (db, connection) = tokio_postgres::connect(w.db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let n = db.execute(statement, &[&sid]).await.unwrap();
    drop(db);
    let _ = connection.await;
    n
}
