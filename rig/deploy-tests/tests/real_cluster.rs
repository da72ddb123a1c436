//! The real binaries with the shipped `deploy/` objects and each binary as its own
//! ServiceAccount, on kube-sim and on the real control plane: `ttlab-server` (as
//! `ttlab-server`) takes a VM lesson, the three-VM lesson and the pod lesson to running, shows
//! the quota on the admin page, relays the consoles and tears a finished session down;
//! `ttlab-reaper --once` (as `ttlab-reaper`) lists what it would do with `--dry-run`, then
//! reclaims expired sessions, orphans of its own environment only and ghosts. On the real
//! control plane KubeVirt and the kubelet are played by `ttlab-kubevirt-sim`, a controller
//! talking to the same API server; kube-sim simulates them itself and authorizes each token's
//! calls by the shipped Roles, as a real API server does.
//!
//! Then **least privilege, proven by calls**: every (verb, group, resource) each identity
//! called — from the API server's audit log, or kube-sim's call record — must equal what its
//! Role grants: nothing missing (no call was refused), nothing unused. The one exception on
//! both is the server's port forward to the agents, which these runs (agents reached by pod
//! IP, the default) do not use ([`PORTFORWARD`]); on the real control plane also the grants
//! it cannot exercise (pod exec and the pod read before it, served by a kubelet), named in
//! [`NOT_EXERCISABLE`]. The VM console goes
//! the way it goes on a cluster: the server asks kube-apiserver for
//! `virtualmachineinstances/console`, which checks the server's Role and proxies to the
//! aggregated API server that serves `subresources.kubevirt.io` (played by
//! `ttlab-kubevirt-sim`). Neither binary may log a 403.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::rbac::v1::Role;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use ttlab_deploy_tests::repo_root;
use ttlab_envtest::Call;

use common::{AUTH_SECRET, binaries_dir, binary, free_port, start_and_wait_running, token};

/// The port forward to a guest's agent (`TTLAB_AGENT_PATH=portforward`, or a site whose
/// `agent_path` is `portforward`): these runs reach the agents by pod IP, the default, so the
/// server never calls it; the grant is there for sites reached through their API server.
const PORTFORWARD: (&str, &str, &str, &str) = (
    "server",
    "subresources.kubevirt.io",
    "virtualmachineinstances/portforward",
    "get",
);

/// Grants of the shipped Roles that no call on kube-sim exercises here, with why.
/// (identity, group, resource, verb.)
const NOT_EXERCISED_ON_KUBE_SIM: &[(&str, &str, &str, &str)] = &[PORTFORWARD];

/// Grants of the shipped Roles that no call on the real control plane can exercise, with why;
/// the same test on kube-sim exercises them (but the port forward). (identity, group,
/// resource, verb.)
const NOT_EXERCISABLE: &[(&str, &str, &str, &str)] = &[
    PORTFORWARD,
    // Pod exec is served by the kubelet, which this control plane does not have: the pod-lab
    // terminal and grading exec on kube-sim.
    ("server", "", "pods/exec", "get"),
    ("server", "", "pods/exec", "create"),
    // The pod-lab console reads its pod before it execs (crates/api/src/console/upstream.rs).
    ("server", "", "pods", "get"),
];

/// A process whose output lines are kept (for markers and for the 403 check).
struct Process {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Process {
    fn spawn(program: &Path, args: &[&str], env: &BTreeMap<String, String>) -> Self {
        let mut child = Command::new(program)
            .args(args)
            .env_clear()
            .envs(env)
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        for reader in [
            Box::new(stdout) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
            Box::new(stderr),
        ] {
            let lines = lines.clone();
            tokio::spawn(async move {
                let mut reader = BufReader::new(reader).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    lines.lock().unwrap().push(line);
                }
            });
        }
        Self { child, lines }
    }

    fn output(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    async fn wait_for(&self, marker: &str, within: Duration) {
        let until = tokio::time::Instant::now() + within;
        while !self.output().iter().any(|l| l.contains(marker)) {
            assert!(
                tokio::time::Instant::now() < until,
                "{marker:?} not printed within {within:?}:\n{}",
                self.output().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs to its end (for `--once`) and returns its exit code and output.
    async fn finish(mut self) -> (i32, Vec<String>) {
        let status = tokio::time::timeout(Duration::from_secs(120), self.child.wait())
            .await
            .expect("exits within 2 minutes")
            .unwrap();
        // Let the readers drain.
        tokio::time::sleep(Duration::from_millis(200)).await;
        (status.code().unwrap_or(-1), self.output())
    }
}

/// One HTTP/1.1 request with `Connection: close`; returns the status and the JSON body (or
/// `Value::Null`).
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw);
    let (head, payload) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let payload = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(payload)
    } else {
        payload.to_owned()
    };
    (
        status,
        serde_json::from_str(&payload).unwrap_or(Value::Null),
    )
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The pool on this backend, and the agent's ConfigMap never missing under a VM: the
/// server's agent ConfigMap is deleted behind its back (as a reaper with a short minimum age,
/// or an operator, would), then an operator gives `systemd-basics` a pool of one. The member's
/// VM gets the ConfigMap back before it is created (it is asked for right before each VM
/// create, never trusted from an earlier finding: a VM created without it waits for its agent
/// disk for ever, and the member stays `preparing`). Once the member is ready the pool is
/// paused, a student's start is handed the member, already running, and the hand-over is
/// checked at the guest: the boot token is refused by its agent, the new one (stored) is
/// accepted, and the agent has the session's hard deadline. The pool is handed back to the
/// lesson file (which has none).
async fn warm_pool_hands_over_a_member(
    stage: &Stage,
    addr: SocketAddr,
    admin: &str,
    database_url: &str,
    agent_bin: &Path,
) {
    use ttlab_cluster::ReaperCluster as _;
    const LESSON: &str = "systemd-basics";
    let fixtures = ttlab_cluster::KubeCluster::from_kubeconfig(
        &stage.admin_kubeconfig,
        ttlab_cluster::ClusterSettings::in_namespace(&stage.vm_namespace),
    )
    .await
    .unwrap();
    let store = ttlab_store::Store::connect(database_url, ttlab_store::StoreOptions::default())
        .await
        .unwrap();
    let config_map = ttlab_cloudinit::AgentPayload::new(&std::fs::read(agent_bin).unwrap())
        .unwrap()
        .config_map_name();
    let kind = ttlab_cluster::Kind::ConfigMap;
    assert!(
        fixtures.get(kind, &config_map).await.unwrap().is_some(),
        "the server made sure of {config_map} for the sessions before"
    );
    fixtures
        .delete(kind, &config_map, ttlab_cluster::Propagation::Background)
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while fixtures.get(kind, &config_map).await.unwrap().is_some() {
        assert!(tokio::time::Instant::now() < until, "{config_map} not gone");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let path = format!("/api/admin/pools/{LESSON}");
    let (status, pool) = http(addr, "PUT", &path, Some(admin), Some(json!({"size": 1}))).await;
    assert_eq!(status, 200, "{pool}");
    let until = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let (status, pool) = http(addr, "GET", &path, Some(admin), None).await;
        assert_eq!(status, 200, "{pool}");
        if pool["ready"] == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "no pool member ready after 2 minutes: {pool}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let (status, pool) = http(
        addr,
        "PUT",
        &path,
        Some(admin),
        Some(json!({"paused": true})),
    )
    .await;
    assert_eq!(status, 200, "{pool}");
    // The member's VM mounts the ConfigMap, which is there again.
    let (env, lesson) = ("dev".parse().unwrap(), LESSON.parse().unwrap());
    let members = store.pools().members(&env, &lesson).await.unwrap();
    assert_eq!(members.len(), 1, "{members:?}");
    let member = &members[0];
    let vm = member.vms[0].clone();
    let summary = fixtures
        .get(ttlab_cluster::Kind::VirtualMachine, &vm.name)
        .await
        .unwrap()
        .expect("the member's VM");
    assert_eq!(
        summary.labels.get(ttlab_model::labels::AGENT_CONFIG_MAP),
        Some(&config_map),
        "{summary:?}"
    );
    assert!(
        fixtures.get(kind, &config_map).await.unwrap().is_some(),
        "the server created {config_map} again before the member's VM"
    );
    let boot = store
        .agent_tokens()
        .get(member.id, &vm.node)
        .await
        .unwrap()
        .expect("the member's boot token");

    let t = token("student-pooled", ttlab_api::auth::Role::Student);
    let (status, session) = http(
        addr,
        "POST",
        "/api/sessions",
        Some(&t),
        Some(json!({"lesson": LESSON})),
    )
    .await;
    assert_eq!(status, 202, "{session}");
    assert_eq!(
        session["status"], "running",
        "the member is handed over: {session}"
    );
    assert_eq!(session["id"], member.id.to_string(), "{session}");
    let (status, pool) = http(addr, "GET", &path, Some(admin), None).await;
    assert_eq!(status, 200, "{pool}");
    assert_eq!(
        (
            pool["claims_24h"].as_u64(),
            pool["ready"].as_u64(),
            pool["handover_failures_24h"].as_u64()
        ),
        (Some(1), Some(0), Some(0)),
        "{pool}"
    );

    // The hand-over, as the guest's agent sees it.
    let (ip, dir) = stage.guest(&vm.name).expect("the member's guest");
    let agent = SocketAddr::new(ip.into(), ttlab_agent::protocol::PORT);
    let old = ttlab_agent::AgentClient::new(
        agent,
        ttlab_agent::protocol::AgentToken::parse(&boot).unwrap(),
    );
    let refused = old.exec("true", Duration::from_secs(5)).await;
    assert!(refused.is_err(), "the boot token still works: {refused:?}");
    let current = store
        .agent_tokens()
        .get(member.id, &vm.node)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(current, boot);
    let new = ttlab_agent::AgentClient::new(
        agent,
        ttlab_agent::protocol::AgentToken::parse(&current).unwrap(),
    );
    let ran = new.exec("true", Duration::from_secs(5)).await.unwrap();
    assert_eq!(ran.exit_code, Some(0), "{ran:?}");
    let claimed = store.sessions().get(member.id).await.unwrap().unwrap();
    let grace = chrono::TimeDelta::from_std(ttlab_lifespan::DEFAULT_HARD_DEADLINE_GRACE).unwrap();
    let file = dir.join(ttlab_agent::protocol::POWER_OFF_AT_PATH.trim_start_matches('/'));
    let armed: i64 = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        armed,
        (claimed.max_expires_at + grace).timestamp(),
        "the guest powers off at the session's hard cap plus the grace"
    );

    let (status, finished) = http(
        addr,
        "DELETE",
        &format!("/api/sessions/{}", member.id),
        Some(&t),
        None,
    )
    .await;
    assert_eq!(status, 200, "{finished}");
    let (status, pool) = http(addr, "DELETE", &path, Some(admin), None).await;
    assert_eq!(status, 200, "{pool}");
    assert_eq!(pool["pooled"], false, "{pool}");
}

/// What `role` grants, as (group, resource, verb).
fn grants(objects: &[Value], role: &str) -> BTreeSet<(String, String, String)> {
    let object = objects
        .iter()
        .find(|o| o["kind"] == "Role" && o["metadata"]["name"] == role)
        .unwrap_or_else(|| panic!("no Role {role} installed"));
    let role: Role = serde_json::from_value(object.clone()).unwrap();
    let mut out = BTreeSet::new();
    for rule in role.rules.into_iter().flatten() {
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    out.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    out
}

/// The distinct (group, resource, verb) of `calls`, with the `create` an exec's WebSocket
/// upgrade is checked as besides its own `get` (Kubernetes 1.35 and later,
/// `AuthorizePodWebsocketUpgradeCreatePermission`; the audit log shows only the `get`).
fn used(calls: &BTreeSet<Call>) -> BTreeSet<(String, String, String)> {
    let mut used = BTreeSet::new();
    for c in calls {
        used.insert((c.group.clone(), c.resource.clone(), c.verb.clone()));
        if c.resource == "pods/exec" && c.verb == "get" && c.code != 403 {
            used.insert((c.group.clone(), c.resource.clone(), "create".to_owned()));
        }
    }
    used
}

/// Compares what an identity called with what its Role grants; returns the differences as
/// readable lines (empty: they agree).
fn compare(
    identity: &str,
    granted: &BTreeSet<(String, String, String)>,
    calls: &BTreeSet<Call>,
    excused: &[(&str, &str, &str, &str)],
) -> Vec<String> {
    let mut problems = Vec::new();
    for call in calls.iter().filter(|c| c.code == 403) {
        problems.push(format!("{identity}: refused (403): {call:?}"));
    }
    let used = used(calls);
    for (g, r, v) in used.difference(granted) {
        problems.push(format!("{identity}: called but not granted: {v} {g}/{r}"));
    }
    for (g, r, v) in granted.difference(&used) {
        let excused = excused.iter().any(|(who, eg, er, ev)| {
            *who == identity && (*eg, *er, *ev) == (g.as_str(), r.as_str(), v.as_str())
        });
        if !excused {
            problems.push(format!("{identity}: granted but never called: {v} {g}/{r}"));
        }
    }
    problems
}

/// Where the binaries run, and what each backend can tell about the calls they made.
struct Stage {
    vm_namespace: String,
    admin_kubeconfig: PathBuf,
    server_kubeconfig: PathBuf,
    reaper_kubeconfig: PathBuf,
    server_user: String,
    reaper_user: String,
    /// The installed objects (the Roles among them).
    objects: Vec<Value>,
    /// Grants no call can exercise on this backend.
    excused: &'static [(&'static str, &'static str, &'static str, &'static str)],
    /// Whether pods can be exec'd into (a kubelet, or kube-sim's simulated one).
    exec: bool,
    backend: Backend,
}

enum Backend {
    Sim {
        sim: ttlab_kube_sim::KubeSim,
        _dir: tempfile::TempDir,
    },
    Real {
        plane: &'static ttlab_envtest::ControlPlane,
        kubevirt: ttlab_kubevirt_sim::KubevirtSim,
        console: ttlab_kubevirt_sim::ConsoleServer,
        _guests: tempfile::TempDir,
    },
}

impl Stage {
    /// The calls `user` made in the VM namespace, in RBAC terms.
    fn calls_of(&self, user: &str) -> BTreeSet<Call> {
        match &self.backend {
            Backend::Real { plane, .. } => plane.calls_of(user, &self.vm_namespace).unwrap(),
            Backend::Sim { sim, .. } => sim
                .calls()
                .into_iter()
                .filter(|c| {
                    c.user.as_deref() == Some(user)
                        && c.namespace.as_deref() == Some(&self.vm_namespace)
                })
                .map(|c| Call {
                    group: c.group.clone(),
                    resource: c.resource.clone(),
                    verb: c.verb.as_str().to_owned(),
                    namespace: c.namespace.clone(),
                    code: c.status,
                })
                .collect(),
        }
    }

    /// The loopback address and root directory of the guest of VMI `name`.
    fn guest(&self, name: &str) -> Option<(std::net::Ipv4Addr, PathBuf)> {
        let ns = &self.vm_namespace;
        match &self.backend {
            Backend::Sim { sim, .. } => Some((sim.guest_ip(ns, name)?, sim.guest_dir(ns, name)?)),
            Backend::Real { kubevirt, .. } => kubevirt.guest(ns, name).map(|g| (g.ip, g.dir)),
        }
    }

    async fn stop(self) {
        match self.backend {
            Backend::Sim { sim, .. } => sim.shutdown().await,
            Backend::Real {
                kubevirt, console, ..
            } => {
                console.stop().await;
                kubevirt.stop().await;
            }
        }
    }
}

/// kube-sim with `deploy/overlays/dev`'s Roles, RoleBindings and quota, and a token for each
/// of its ServiceAccounts.
async fn kube_sim_stage() -> Option<Stage> {
    let rendered = common::render_overlay("dev")?;
    let (vm_namespace, backend_namespace) = ("ttlab-vms".to_owned(), "ttlab-dev");
    let mut config = ttlab_kube_sim::SimConfig::for_tests();
    config.namespaces = vec![vm_namespace.clone(), backend_namespace.into()];
    let sim = ttlab_kube_sim::KubeSim::start(config).await.unwrap();
    assert!(sim.apply_rbac(&rendered.objects).unwrap() >= 4);
    for quota in rendered.of_kind("ResourceQuota") {
        sim.create(quota.clone()).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let user = |sa: &str| format!("system:serviceaccount:{backend_namespace}:{sa}");
    let (server_user, reaper_user) = (user("ttlab-server"), user("ttlab-reaper"));
    let kubeconfig = |name: &str, who: Option<&str>| {
        let path = dir.path().join(name);
        match who {
            Some(u) => sim.write_kubeconfig_for(&path, &vm_namespace, u),
            None => sim.write_kubeconfig(&path, &vm_namespace),
        }
        .unwrap();
        path
    };
    Some(Stage {
        admin_kubeconfig: kubeconfig("admin", None),
        server_kubeconfig: kubeconfig("server", Some(&server_user)),
        reaper_kubeconfig: kubeconfig("reaper", Some(&reaper_user)),
        vm_namespace,
        server_user,
        reaper_user,
        objects: rendered.objects,
        excused: NOT_EXERCISED_ON_KUBE_SIM,
        exec: true,
        backend: Backend::Sim { sim, _dir: dir },
    })
}

/// The real control plane with `deploy/overlays/dev` installed (all but the Deployments,
/// whose pods this control plane cannot run: the binaries run here instead), KubeVirt and the
/// kubelet as a controller, and KubeVirt's console as an aggregated API server.
async fn real_stage(agent_bin: &Path) -> Option<Stage> {
    let plane = ttlab_envtest::shared_or_skip()?;
    let installed = plane.install_shipped(&["dev"]).await.unwrap();
    let dev = installed.env("dev").clone();
    let ns = installed.vm_namespace.clone();

    // KubeVirt and the kubelet, as a controller of their own identity (the administrator),
    // and its console as an aggregated API server.
    let guests = tempfile::tempdir().unwrap();
    let (kubevirt, console) =
        common::kubevirt_on(plane, vec![ns.clone()], agent_bin, guests.path()).await;
    Some(Stage {
        vm_namespace: ns,
        admin_kubeconfig: installed.admin_kubeconfig.clone(),
        server_kubeconfig: dev.server_kubeconfig.clone(),
        reaper_kubeconfig: dev.reaper_kubeconfig.clone(),
        server_user: dev.server_user(),
        reaper_user: dev.reaper_user(),
        objects: installed.objects.clone(),
        excused: NOT_EXERCISABLE,
        exec: false,
        backend: Backend::Real {
            plane,
            kubevirt,
            console,
            _guests: guests,
        },
    })
}

/// The binaries the test runs: server, reaper, agent, ttlabctl.
fn binaries() -> Option<[PathBuf; 4]> {
    let found = ["ttlab-server", "ttlab-reaper", "ttlab-agent", "ttlabctl"].map(binary);
    if found.iter().all(Option::is_some) {
        return Some(found.map(Option::unwrap));
    }
    ttlab_testkit::skip_or_fail(&format!(
        "the binaries are not built in {}: cargo build -p ttlab-server-bin -p ttlab-reaper-bin -p ttlab-agent-bin -p ttlab-ttlabctl-bin",
        binaries_dir().display()
    ));
    None
}

mod every_lesson_runs_and_each_identity_uses_exactly_its_role {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn on_kube_sim() {
        let Some(bins) = binaries() else { return };
        let Some(stage) = kube_sim_stage().await else {
            return;
        };
        every_lesson(stage, &bins).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn on_the_real_control_plane() {
        let Some(bins) = binaries() else { return };
        if common::kubectl_or_skip().is_none() {
            return;
        }
        let Some(stage) = real_stage(&bins[2]).await else {
            return;
        };
        every_lesson(stage, &bins).await;
    }
}

async fn every_lesson(stage: Stage, bins: &[PathBuf; 4]) {
    let [server_bin, reaper_bin, agent_bin, ttlabctl] = bins;
    let ns = stage.vm_namespace.clone();

    // PostgreSQL, migrated as the initContainer does.
    let (pg, database_url) = common::migrated_database(ttlabctl).await;

    // The environment the Deployments give the containers, with what cannot hold outside a pod
    // replaced: addresses, the image's paths, and the ServiceAccount's token (a kubeconfig).
    let rendered = common::render_overlay("dev").unwrap();
    let (mut env, _) = rendered.container_env(rendered.get("Deployment", "ttlab-server"));
    let root = repo_root();
    let path = |p: &Path| p.display().to_string();
    let server_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    for (k, v) in [
        ("DATABASE_URL", database_url.clone()),
        ("TTLAB_AUTH_SECRET", AUTH_SECRET.to_owned()),
        ("TTLAB_NAMESPACE", ns.clone()),
        ("TTLAB_LISTEN", server_addr.to_string()),
        ("TTLAB_METRICS_LISTEN", format!("127.0.0.1:{}", free_port())),
        ("TTLAB_OPS_LISTEN", format!("127.0.0.1:{}", free_port())),
        ("TTLAB_LESSONS", path(&root.join("lessons"))),
        ("TTLAB_AGENT_BINARY", path(agent_bin)),
        ("TTLAB_WEB_DIR", path(&root.join("web"))),
        ("RUST_LOG", "info".to_owned()),
    ] {
        env.insert(k.to_owned(), v);
    }
    let mut server_env = env.clone();
    server_env.insert("KUBECONFIG".into(), path(&stage.server_kubeconfig));
    let mut reaper_env = env.clone();
    reaper_env.insert("KUBECONFIG".into(), path(&stage.reaper_kubeconfig));
    reaper_env.insert("TTLAB_ORPHAN_MIN_AGE".into(), "0s".into());
    reaper_env.insert("TTLAB_AGENT_MIN_AGE".into(), "0s".into());

    // Right after install: the quota controller may not have counted the new quota yet.
    let server = Process::spawn(server_bin, &[], &server_env);
    server
        .wait_for("ttlab-server listening", Duration::from_secs(60))
        .await;

    // Every kind of lesson reaches running through the server's own identity.
    let vm = start_and_wait_running(server_addr, "student-vm", "systemd-basics").await;
    let cluster = start_and_wait_running(server_addr, "student-cluster", "kubeadm-cluster").await;
    let pod = start_and_wait_running(server_addr, "student-pod", "shell-basics").await;
    assert_eq!(
        cluster["nodes"].as_array().map(Vec::len),
        Some(3),
        "{cluster}"
    );
    assert_eq!(vm["disk"]["kind"], "container", "no golden disk here: {vm}");

    // The admin page's capacity view shows the namespace quota.
    let admin_token = token("admin", ttlab_api::auth::Role::Admin);
    let (status, capacity) = http(
        server_addr,
        "GET",
        "/api/admin/capacity",
        Some(&admin_token),
        None,
    )
    .await;
    assert_eq!(status, 200, "{capacity}");
    assert!(
        capacity["quota"].as_array().is_some_and(|q| !q.is_empty())
            && capacity["quota_error"].is_null(),
        "the quota is shown: {capacity}"
    );
    assert_eq!(capacity["live_vms"], 4, "{capacity}");

    // The student's terminal: the server's WebSocket, relayed to the VM's serial console
    // through kube-apiserver.
    let student = token("student-vm", ttlab_api::auth::Role::Student);
    let vm_id = vm["id"].as_str().unwrap();
    let (status, ticket) = http(
        server_addr,
        "POST",
        &format!("/api/sessions/{vm_id}/console-ticket"),
        Some(&student),
        Some(json!({})),
    )
    .await;
    assert_eq!(status, 200, "{ticket}");
    let url = format!("ws://{server_addr}{}", ticket["url"].as_str().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
    use futures::{SinkExt as _, StreamExt as _};
    use tokio_tungstenite::tungstenite::Message;
    // Reads frames until their text contains `needle`; everything read so far.
    async fn read_until<S>(ws: &mut S, needle: &str) -> String
    where
        S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
    {
        let mut seen = String::new();
        tokio::time::timeout(Duration::from_secs(30), async {
            while !seen.contains(needle) {
                match ws.next().await {
                    Some(Ok(Message::Binary(b))) => seen.push_str(&String::from_utf8_lossy(&b)),
                    Some(Ok(Message::Text(t))) => seen.push_str(&t),
                    Some(Ok(_)) => {}
                    other => panic!("the console ended before {needle:?}: {other:?}: {seen:?}"),
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no {needle:?} on the console: {seen:?}"));
        seen
    }
    read_until(&mut ws, "# ").await;
    // Enter on a serial terminal is a carriage return.
    ws.send(Message::Binary(b"seq 3\r".to_vec().into()))
        .await
        .unwrap();
    // What the shell printed, not the echo of what was typed.
    read_until(&mut ws, "2\r\n3").await;
    drop(ws);

    // Grading asks the VM's agent; then every student finishes, and the server deletes what
    // it created: a VM and its Secret, three of each with the Service and NetworkPolicy, a pod.
    let (status, graded) = http(
        server_addr,
        "POST",
        &format!("/api/sessions/{vm_id}/grade"),
        Some(&student),
        None,
    )
    .await;
    assert_eq!(status, 200, "{graded}");
    // The pod lab's terminal and grading exec into its pod (where a kubelet serves exec).
    if stage.exec {
        let student = token("student-pod", ttlab_api::auth::Role::Student);
        let pod_id = pod["id"].as_str().unwrap();
        let (status, ticket) = http(
            server_addr,
            "POST",
            &format!("/api/sessions/{pod_id}/console-ticket"),
            Some(&student),
            Some(json!({})),
        )
        .await;
        assert_eq!(status, 200, "{ticket}");
        let url = format!("ws://{server_addr}{}", ticket["url"].as_str().unwrap());
        let (mut ws, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
        read_until(&mut ws, "$ ").await;
        ws.send(Message::Binary(b"seq 3\r".to_vec().into()))
            .await
            .unwrap();
        read_until(&mut ws, "2\r\n3").await;
        // The student leaves the shell: the server asks the pod whether the lab is over or
        // only the shell ended.
        ws.send(Message::Binary(b"exit\r".to_vec().into()))
            .await
            .unwrap();
        let asked = tokio::time::Instant::now() + Duration::from_secs(30);
        while !stage
            .calls_of(&stage.server_user)
            .iter()
            .any(|c| (c.verb.as_str(), c.resource.as_str()) == ("get", "pods"))
        {
            assert!(
                tokio::time::Instant::now() < asked,
                "the server never looked at the pod after its shell ended"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drop(ws);
        let (status, graded) = http(
            server_addr,
            "POST",
            &format!("/api/sessions/{pod_id}/grade"),
            Some(&student),
            None,
        )
        .await;
        assert_eq!(status, 200, "{graded}");
        assert!(
            graded["steps"].as_array().is_some_and(|c| !c.is_empty()),
            "{graded}"
        );
    }
    for (user, session) in [
        ("student-vm", &vm),
        ("student-cluster", &cluster),
        ("student-pod", &pod),
    ] {
        let id = session["id"].as_str().unwrap();
        let (status, finished) = http(
            server_addr,
            "DELETE",
            &format!("/api/sessions/{id}"),
            Some(&token(user, ttlab_api::auth::Role::Student)),
            None,
        )
        .await;
        assert_eq!(status, 200, "{finished}");
        assert_eq!(finished["status"], "finished", "{finished}");
    }

    // A warm pool of one, its agent ConfigMap deleted first: its member is prepared through
    // the server's identity (the ConfigMap made again), and a student's start is handed it,
    // running at once, with a new agent token and the session's deadline.
    warm_pool_hands_over_a_member(&stage, server_addr, &admin_token, &database_url, agent_bin)
        .await;

    // Two more sessions whose time runs out, two ghosts (their VM or pod deleted behind the
    // backend's back) and orphans.
    let cluster = start_and_wait_running(server_addr, "student-cluster-2", "kubeadm-cluster").await;
    let pod = start_and_wait_running(server_addr, "student-pod-2", "shell-basics").await;
    let store = ttlab_store::Store::connect(&database_url, ttlab_store::StoreOptions::default())
        .await
        .unwrap();
    let (pg_client, connection) = tokio_postgres::connect(&database_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    for session in [&cluster, &pod] {
        let id: uuid::Uuid = session["id"].as_str().unwrap().parse().unwrap();
        pg_client
            .execute(
                "UPDATE sessions SET started_at = now() - interval '61 minutes', \
                 expires_at = now() - interval '1 minute' WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap();
    }
    let ghost = start_and_wait_running(server_addr, "student-ghost", "systemd-basics").await;
    let pod_ghost = start_and_wait_running(server_addr, "student-pod-ghost", "shell-basics").await;
    let fixtures = ttlab_cluster::KubeCluster::from_kubeconfig(
        &stage.admin_kubeconfig,
        ttlab_cluster::ClusterSettings::in_namespace(&ns),
    )
    .await
    .unwrap();
    use ttlab_cluster::{ProvisionCluster as _, ReaperCluster as _};
    let behind_the_back = [
        (
            ttlab_cluster::Kind::VirtualMachine,
            ghost["nodes"][0]["vm"].as_str().unwrap().to_owned(),
        ),
        (
            ttlab_cluster::Kind::Pod,
            pod_ghost["nodes"][0]["vm"].as_str().unwrap().to_owned(),
        ),
    ];
    for (kind, name) in &behind_the_back {
        fixtures
            .delete(*kind, name, ttlab_cluster::Propagation::Background)
            .await
            .unwrap();
    }
    let orphan_session = ttlab_model::SessionId::new_random();
    let labels = ttlab_model::labels::ObjectLabels::new(
        orphan_session,
        "dev".parse().unwrap(),
        "systemd-basics".parse().unwrap(),
        None,
    );
    let orphan_secret = format!("orphan-{}", orphan_session.simple());
    fixtures
        .create_secret(
            serde_json::from_value(json!({
                "metadata": {"name": orphan_secret, "labels": labels.to_map()},
                "stringData": {"userdata": "#cloud-config\n{}\n"}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    // Another environment's object: never this reaper's.
    let foreign = ttlab_model::labels::ObjectLabels::new(
        ttlab_model::SessionId::new_random(),
        "prod".parse().unwrap(),
        "systemd-basics".parse().unwrap(),
        None,
    );
    fixtures
        .create_secret(
            serde_json::from_value(json!({
                "metadata": {"name": "prod-secret", "labels": foreign.to_map()},
                "stringData": {"userdata": "#cloud-config\n{}\n"}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    // An agent version no server runs and no VM uses any more, and another environment's.
    let stale_agent =
        ttlab_cloudinit::AgentPayload::new(b"\x7fELF an agent build no server runs any more")
            .unwrap();
    let prod_agent =
        ttlab_cloudinit::AgentPayload::new(b"\x7fELF the agent build of prod").unwrap();
    for (agent, env) in [(&stale_agent, "dev"), (&prod_agent, "prod")] {
        fixtures
            .ensure_config_map(agent.config_map(&env.parse().unwrap()))
            .await
            .unwrap();
    }
    // Wait until the deleted VM and pod are really gone (KubeVirt releases its finalizer, the
    // kubelet confirms the pod's end).
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    for (kind, name) in &behind_the_back {
        while fixtures.get(*kind, name).await.unwrap().is_some() {
            assert!(tokio::time::Instant::now() < until, "{name} not gone");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    // The reaper: a dry run names what it would do and changes nothing ...
    let (code, dry) = Process::spawn(reaper_bin, &["--once", "--dry-run"], &reaper_env)
        .finish()
        .await;
    assert_eq!(code, 0, "{}", dry.join("\n"));
    let dry_text = dry.join("\n");
    for name in [
        cluster["id"].as_str().unwrap(),
        pod["id"].as_str().unwrap(),
        ghost["id"].as_str().unwrap(),
        pod_ghost["id"].as_str().unwrap(),
        orphan_secret.as_str(),
        stale_agent.config_map_name().as_str(),
    ] {
        assert!(
            dry_text.contains(name),
            "the dry run names {name}:\n{dry_text}"
        );
    }
    assert!(!dry_text.contains("prod-secret"), "{dry_text}");
    assert!(
        !dry_text.contains(&prod_agent.config_map_name()),
        "{dry_text}"
    );
    assert!(
        fixtures
            .get(ttlab_cluster::Kind::Secret, &orphan_secret)
            .await
            .unwrap()
            .is_some(),
        "the dry run deleted nothing"
    );
    // ... and a real cycle does it.
    let (code, once) = Process::spawn(reaper_bin, &["--once"], &reaper_env)
        .finish()
        .await;
    assert_eq!(code, 0, "{}", once.join("\n"));
    let status_of = |s: &Value| {
        let id: ttlab_model::SessionId = s["id"].as_str().unwrap().parse().unwrap();
        let store = store.clone();
        async move { store.sessions().get(id).await.unwrap().unwrap().status }
    };
    use ttlab_model::SessionStatus as S;
    assert_eq!(status_of(&cluster).await, S::Expired);
    assert_eq!(status_of(&pod).await, S::Expired);
    assert_eq!(status_of(&ghost).await, S::Ghost);
    assert_eq!(status_of(&pod_ghost).await, S::Ghost);
    assert_eq!(status_of(&vm).await, S::Finished);
    assert!(
        fixtures
            .get(ttlab_cluster::Kind::Secret, &orphan_secret)
            .await
            .unwrap()
            .is_none(),
        "the orphan is deleted"
    );
    assert!(
        fixtures
            .get(ttlab_cluster::Kind::Secret, "prod-secret")
            .await
            .unwrap()
            .is_some(),
        "another environment's object stays"
    );
    let agent_present = |name: String| {
        let fixtures = fixtures.clone();
        async move {
            fixtures
                .get(ttlab_cluster::Kind::ConfigMap, &name)
                .await
                .unwrap()
                .is_some()
        }
    };
    assert!(
        !agent_present(stale_agent.config_map_name()).await,
        "the unused agent version is removed"
    );
    assert!(
        agent_present(prod_agent.config_map_name()).await,
        "another environment's agent version stays"
    );

    // A long-running reaper keeps its VMs and Secrets in watch-fed listings: both fill.
    let mut loop_env = reaper_env.clone();
    loop_env.insert("TTLAB_REAP_INTERVAL".into(), "1h".into());
    loop_env.insert(
        "TTLAB_METRICS_LISTEN".into(),
        format!("127.0.0.1:{}", free_port()),
    );
    let reaper_loop = Process::spawn(reaper_bin, &[], &loop_env);
    for kind in ["VirtualMachine", "Secret"] {
        let until = tokio::time::Instant::now() + Duration::from_secs(60);
        while !reaper_loop
            .output()
            .iter()
            .any(|l| l.contains("listing cached") && l.contains(kind))
        {
            assert!(
                tokio::time::Instant::now() < until,
                "the reaper's {kind} listing is not cached within 60 s:\n{}",
                reaper_loop.output().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let loop_log = reaper_loop.output();
    drop(reaper_loop);

    // Neither binary logged a refusal.
    let server_log = server.output();
    for (who, log) in [
        ("server", &server_log),
        ("reaper --once", &once),
        ("reaper --dry-run", &dry),
        ("reaper", &loop_log),
    ] {
        let refused: Vec<&String> = log
            .iter()
            .filter(|l| l.contains(" 403") || l.to_ascii_lowercase().contains("forbidden"))
            .collect();
        assert!(refused.is_empty(), "{who} logged refusals: {refused:#?}");
    }

    // Least privilege, proven by calls.
    let mut problems = Vec::new();
    for (identity, user, role) in [
        ("server", &stage.server_user, "ttlab-server"),
        ("reaper", &stage.reaper_user, "ttlab-reaper"),
    ] {
        let calls = stage.calls_of(user);
        problems.extend(compare(
            identity,
            &grants(&stage.objects, role),
            &calls,
            stage.excused,
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    store.close();
    drop(server);
    stage.stop().await;
    tokio::task::spawn_blocking(move || pg.stop())
        .await
        .unwrap()
        .unwrap();
}

#[test]
fn the_comparison_names_a_missing_and_an_unused_grant() {
    let granted: BTreeSet<_> = [("", "secrets", "create"), ("", "secrets", "list")]
        .iter()
        .map(|(g, r, v)| (g.to_string(), r.to_string(), v.to_string()))
        .collect();
    let call = |verb: &str, code: u16| Call {
        group: String::new(),
        resource: "secrets".into(),
        verb: verb.into(),
        namespace: Some("n".into()),
        code,
    };
    let calls = BTreeSet::from([call("create", 201), call("delete", 403)]);
    let problems = compare("server", &granted, &calls, &[]);
    assert_eq!(
        problems,
        [
            "server: refused (403): Call { group: \"\", resource: \"secrets\", verb: \"delete\", namespace: Some(\"n\"), code: 403 }",
            "server: called but not granted: delete /secrets",
            "server: granted but never called: list /secrets",
        ]
    );
}
