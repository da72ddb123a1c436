//! Rendering the overlays once per test binary (without kubectl a test reports it with
//! [`ttlab_testkit::skip_or_fail`]: a `SKIPPED:` line, or a failure under `CI=true`), and
//! starting the built binaries as processes.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

use ttlab_deploy_tests::{Rendered, deploy_dir, kubectl, kustomize};

/// The overlays under `deploy/overlays`.
pub const ENVIRONMENTS: [&str; 2] = ["dev", "prod"];

fn cache() -> &'static Mutex<BTreeMap<String, Rendered>> {
    static CACHE: OnceLock<Mutex<BTreeMap<String, Rendered>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// `kubectl`, or `None` after [`ttlab_testkit::skip_or_fail`] said why (it panics under
/// `CI=true`).
pub fn kubectl_or_skip() -> Option<PathBuf> {
    let found = kubectl();
    if found.is_none() {
        ttlab_testkit::skip_or_fail(
            "kubectl is not on PATH, so the deploy/ manifests were not rendered \
             (install kubectl; .ci/run requires it)",
        );
    }
    found
}

/// `kubectl kustomize deploy/overlays/<env>`; `None` (test skipped) without kubectl.
pub fn render_overlay(env: &str) -> Option<Rendered> {
    render_cached(&format!("overlays/{env}"), || {
        let kubectl = kubectl_or_skip()?;
        Some(
            kustomize(&kubectl, &deploy_dir(&format!("overlays/{env}")))
                .unwrap_or_else(|e| panic!("{e}")),
        )
    })
}

/// The `env` overlay with `deploy/components/reaper-cronjob` enabled, as an operator would by
/// uncommenting its `components:` lines.
pub fn render_with_cronjob(env: &str) -> Option<Rendered> {
    render_with_components(env, &["reaper-cronjob"])
}

/// The `env` overlay with the components under `deploy/components/` named in `components`
/// enabled, as an operator would by uncommenting the `components:` line and theirs: a copy of
/// the overlay in a temporary directory whose paths point back into the repository.
pub fn render_with_components(env: &str, components: &[&str]) -> Option<Rendered> {
    render_cached(&format!("overlays/{env}+{}", components.join("+")), || {
        let kubectl = kubectl_or_skip()?;
        let dir = tempfile::tempdir().unwrap();
        copy_overlay(env, components, dir.path());
        Some(kustomize(&kubectl, dir.path()).unwrap_or_else(|e| panic!("{e}")))
    })
}

/// `kubectl kustomize deploy/<relative>` for a kustomization other than an overlay (an
/// example under `deploy/examples/`); `None` (test skipped) without kubectl.
pub fn render_deploy_dir(relative: &str) -> Option<Rendered> {
    render_cached(relative, || {
        let kubectl = kubectl_or_skip()?;
        Some(kustomize(&kubectl, &deploy_dir(relative)).unwrap_or_else(|e| panic!("{e}")))
    })
}

/// The example `deploy/examples/<example>`, built on `deploy/overlays/<env>` with the
/// components named in `components` enabled in that overlay, as an operator would: copies of
/// the overlay and of the example side by side in a temporary directory, the example's
/// `../../overlays/<env>` pointing at the copy.
pub fn render_example_with_components(
    example: &str,
    env: &str,
    components: &[&str],
) -> Option<Rendered> {
    let key = format!("examples/{example}@overlays/{env}+{}", components.join("+"));
    render_cached(&key, || {
        let kubectl = kubectl_or_skip()?;
        let dir = tempfile::tempdir().unwrap();
        let overlays = dir.path().join("overlays");
        let overlay = overlays.join(env);
        let copy = dir.path().join("examples").join(example);
        std::fs::create_dir_all(&overlay).unwrap();
        std::fs::create_dir_all(&copy).unwrap();
        copy_overlay(env, components, &overlay);
        let source = deploy_dir(&format!("examples/{example}"));
        let reference = format!("  - ../../overlays/{env}\n");
        for entry in std::fs::read_dir(&source).unwrap() {
            let entry = entry.unwrap();
            if !entry.file_type().unwrap().is_file() {
                continue;
            }
            let text = std::fs::read_to_string(entry.path()).unwrap();
            if entry.file_name() == "kustomization.yaml" {
                assert!(
                    text.contains(&reference),
                    "the example's reference to the overlay moved"
                );
            }
            std::fs::write(copy.join(entry.file_name()), text).unwrap();
        }
        Some(kustomize(&kubectl, &copy).unwrap_or_else(|e| panic!("{e}")))
    })
}

/// Writes into `dir` a copy of `deploy/overlays/<env>` with the components named in
/// `components` enabled (its `components:` line and theirs uncommented), its paths pointing
/// back into the repository.
fn copy_overlay(env: &str, components: &[&str], dir: &Path) {
    let overlay = deploy_dir(&format!("overlays/{env}"));
    let back = relative_to_root(dir);
    let repo_deploy = format!("{back}{}", deploy_dir("").display());
    let repo_deploy = repo_deploy.trim_end_matches('/');
    for entry in std::fs::read_dir(&overlay).unwrap() {
        let entry = entry.unwrap();
        let text = std::fs::read_to_string(entry.path()).unwrap();
        let text = if entry.file_name() == "kustomization.yaml" {
            let mut enabled = text
                .replace("  - ../../base", &format!("  - {repo_deploy}/base"))
                .replace("\n# components:\n", "\ncomponents:\n");
            for component in components {
                let line = format!("#   - ../../components/{component}");
                assert!(
                    enabled.contains(&line),
                    "the overlay's commented line for {component} moved"
                );
                enabled =
                    enabled.replace(&line, &format!("  - {repo_deploy}/components/{component}"));
            }
            assert!(
                enabled.contains("\ncomponents:\n"),
                "the overlay's commented components line moved"
            );
            enabled
        } else {
            text
        };
        std::fs::write(dir.join(entry.file_name()), text).unwrap();
    }
}

/// `../..` from `dir` up to `/` (kustomize refuses absolute paths), so that appending an
/// absolute path without its leading `/` names it.
fn relative_to_root(dir: &Path) -> String {
    let depth = dir
        .canonicalize()
        .unwrap()
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count();
    "../".repeat(depth).trim_end_matches('/').to_owned()
}

fn render_cached(
    key: &str,
    render: impl FnOnce() -> Option<Vec<serde_json::Value>>,
) -> Option<Rendered> {
    if let Some(hit) = cache().lock().unwrap().get(key) {
        return Some(hit.clone());
    }
    let rendered = Rendered::new(render()?);
    cache()
        .lock()
        .unwrap()
        .insert(key.to_owned(), rendered.clone());
    Some(rendered)
}

/// `target/<profile>/`, where cargo puts the workspace's binaries: a test runs from
/// `target/<profile>/deps/`.
pub fn binaries_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("the test executable is in target/<profile>/deps/")
        .to_path_buf()
}

/// The built binary `name` in [`binaries_dir`], if it is there.
pub fn binary(name: &str) -> Option<PathBuf> {
    let path = binaries_dir().join(name);
    path.is_file().then_some(path)
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// How long a process may take to come up (debug builds, a cold database).
pub const STARTUP: Duration = Duration::from_secs(60);

/// One HTTP/1.1 GET; returns the status code.
pub async fn get_status(addr: SocketAddr, path: &str) -> u16 {
    http(addr, "GET", path, None, None).await.0
}

/// One HTTP/1.1 request (with a bearer token and a JSON body, if given) on a connection of
/// its own; the status code and the body.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    json: Option<&serde_json::Value>,
) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let body = json.map(|j| j.to_string()).unwrap_or_default();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    if json.is_some() {
        head.push_str("Content-Type: application/json\r\n");
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Starts `program` with exactly `env` (plus PATH) and waits until a line of its output
/// contains `marker`. Panics with the output so far if it exits or takes too long.
pub async fn start(
    program: &Path,
    args: &[&str],
    env: &BTreeMap<String, String>,
    marker: &str,
) -> Child {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .envs(env)
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    for mut lines in [Box::new(stdout) as Box<dyn LinesSource>, Box::new(stderr)] {
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(line) = lines.next().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    let mut seen = Vec::new();
    let found = tokio::time::timeout(STARTUP, async {
        while let Some(line) = rx.recv().await {
            let hit = line.contains(marker);
            seen.push(line);
            if hit {
                return true;
            }
        }
        false
    })
    .await;
    match found {
        Ok(true) => {
            // Keep draining so the process never blocks on a full pipe.
            tokio::spawn(async move { while rx.recv().await.is_some() {} });
            child
        }
        _ => {
            let _ = child.start_kill();
            panic!(
                "{} did not print {marker:?} within {STARTUP:?}:\n{}",
                program.display(),
                seen.join("\n")
            );
        }
    }
}

/// Lines from a child's stdout or stderr.
pub trait LinesSource: Send {
    fn next(
        &mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send + '_>>;
}

impl<R: tokio::io::AsyncBufRead + Unpin + Send> LinesSource for tokio::io::Lines<R> {
    fn next(
        &mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send + '_>> {
        Box::pin(async move { self.next_line().await.ok().flatten() })
    }
}

/// The signing secret the tests give `ttlab-server` (`TTLAB_AUTH_SECRET`).
pub const AUTH_SECRET: &str = "a-test-secret-of-at-least-thirty-two-bytes";

/// A bearer token for `user` in `role`, signed with [`AUTH_SECRET`], valid for an hour.
pub fn token(user: &str, role: ttlab_api::auth::Role) -> String {
    let secret = ttlab_api::auth::AuthSecret::new(AUTH_SECRET.as_bytes().to_vec()).unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    ttlab_api::auth::AuthConfig::new(secret)
        .mint(&user.parse().unwrap(), role, now, Duration::from_secs(3600))
        .unwrap()
}

/// [`http`] with the body read as JSON (`Value::Null` when it is not).
pub async fn http_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    json: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let (status, body) = http(addr, method, path, token, json.as_ref()).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or(serde_json::Value::Null),
    )
}

/// Starts `lesson` for `user` on the server at `addr` and waits until the session runs
/// (2 minutes at most); returns it.
pub async fn start_and_wait_running(
    addr: SocketAddr,
    user: &str,
    lesson: &str,
) -> serde_json::Value {
    let t = token(user, ttlab_api::auth::Role::Student);
    let (status, session) = http_json(
        addr,
        "POST",
        "/api/sessions",
        Some(&t),
        Some(serde_json::json!({"lesson": lesson})),
    )
    .await;
    assert_eq!(status, 202, "start {lesson}: {session}");
    let id = session["id"].as_str().unwrap().to_owned();
    let until = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let (status, session) =
            http_json(addr, "GET", &format!("/api/sessions/{id}"), Some(&t), None).await;
        assert_eq!(status, 200, "{session}");
        match session["status"].as_str() {
            Some("running") => return session,
            Some("starting") => {}
            other => panic!("{lesson} did not reach running: {other:?}: {session}"),
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{lesson} still starting after 2 minutes: {session}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// KubeVirt and the kubelet on the real control plane `plane`, for `namespaces`: played by
/// `ttlab-kubevirt-sim` as a controller of the administrator's identity (its guests run
/// `agent_bin`, under `guests`), with its console and port forward served as an aggregated
/// API server registered with an APIService, as virt-api is.
pub async fn kubevirt_on(
    plane: &ttlab_envtest::ControlPlane,
    namespaces: Vec<String>,
    agent_bin: &Path,
    guests: &Path,
) -> (
    ttlab_kubevirt_sim::KubevirtSim,
    ttlab_kubevirt_sim::ConsoleServer,
) {
    let admin = plane.admin_client().await.unwrap();
    let mut settings = ttlab_kubevirt_sim::SimSettings::for_tests(namespaces, guests);
    settings.agent_binary = Some(agent_bin.to_path_buf());
    let kubevirt = ttlab_kubevirt_sim::KubevirtSim::start(admin.clone(), settings)
        .await
        .unwrap();
    let console_ns = plane.create_namespace("kubevirt").await.unwrap();
    let (cert, key) = plane
        .serving_certificate(&format!("virt-api.{console_ns}.svc"))
        .unwrap();
    let mut console_settings =
        ttlab_kubevirt_sim::ConsoleSettings::new(cert, key, plane.front_proxy_ca_file());
    console_settings.allowed_names = vec!["front-proxy-client".into()];
    let console = kubevirt.serve_console(console_settings).await.unwrap();
    console
        .register(
            &admin,
            &console_ns,
            "virt-api",
            plane.ca_pem(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    (kubevirt, console)
}

/// A throwaway PostgreSQL with a database `ttlab` migrated by `ttlabctl migrate`, as the
/// initContainer does; the cluster (stopped when dropped) and the database's URL.
pub async fn migrated_database(ttlabctl: &Path) -> (ttlab_store::ephemeral::PgCluster, String) {
    let pg = tokio::task::spawn_blocking(ttlab_store::ephemeral::PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    let database_url = pg.create_database("ttlab").await.unwrap();
    let out = Command::new(ttlabctl)
        .arg("migrate")
        .env_clear()
        .env("DATABASE_URL", &database_url)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (pg, database_url)
}
