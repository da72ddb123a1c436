//! A real, throwaway Kubernetes control plane for tests, the envtest way.
//!
//! This crate owns starting and stopping the control plane the real-cluster suites run against:
//! etcd, kube-apiserver (authorization `Node,RBAC`, ServiceAccount tokens, an audit log of every
//! request) and kube-controller-manager (garbage collector, quota, namespace and ServiceAccount
//! controllers), from the binaries in `KUBEBUILDER_ASSETS` (controller-runtime's envtest layout:
//! `etcd`, `kube-apiserver`, `kube-controller-manager` in one folder), on free loopback ports,
//! with everything under one temporary directory. It installs the vendored KubeVirt and CDI
//! CRDs (`crds/`, see `crds/PROVENANCE.md`), creates objects as an operator would (the shipped
//! `deploy/` objects, renamed into a test's own namespaces), hands out a kubeconfig per
//! ServiceAccount (a bound token from the TokenRequest API, so the shipped Roles are really
//! enforced), and reads the audit log back as the list of calls each identity made.
//!
//! It does not simulate KubeVirt or the kubelet (`ttlab-kubevirt-sim` does, as a controller),
//! and it runs nothing in production. A test that needs it and finds no binaries calls
//! [`ttlab_testkit::skip_or_fail`] through [`shared_or_skip`]: skipped on a developer's machine,
//! failed under `CI=true`.
//!
//! ```no_run
//! # async fn example() {
//! let Some(plane) = ttlab_envtest::shared_or_skip() else { return };
//! let ns = plane.create_namespace("doc").await.unwrap();
//! let kubeconfig = plane.admin_kubeconfig(&ns).unwrap();
//! assert!(kubeconfig.exists());
//! # }
//! ```

mod audit;
mod objects;
mod process;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

pub use audit::{AuditEvent, Call};
pub use objects::{load_crds, rename_namespaces};
use process::Processes;

/// Errors of starting and using the control plane.
#[derive(Debug, thiserror::Error)]
pub enum EnvtestError {
    /// No folder with the three binaries was found.
    #[error(
        "no control-plane binaries: set KUBEBUILDER_ASSETS to a folder with etcd, kube-apiserver and kube-controller-manager ({0})"
    )]
    NoAssets(String),
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A helper command (openssl) failed.
    #[error("{command} failed: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// What it printed on standard error.
        stderr: String,
    },
    /// The API server did not become ready.
    #[error("kube-apiserver not ready after {waited:?}; last lines of its log:\n{log}")]
    NotReady {
        /// How long it was waited for.
        waited: Duration,
        /// The end of its log.
        log: String,
    },
    /// A call to the API server failed.
    #[error("{what}: {source}")]
    Kube {
        /// What was being done.
        what: String,
        /// The error.
        source: kube::Error,
    },
    /// A manifest could not be read or used.
    #[error("{0}")]
    Manifest(String),
}

impl EnvtestError {
    fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }

    fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |source| Self::Kube { what, source }
    }
}

/// The folder of control-plane binaries: `KUBEBUILDER_ASSETS` if set, else the `envtest/bin`
/// folder of a `shared/` directory beside the checkout (where the project's machines keep it).
pub fn assets() -> Result<PathBuf, EnvtestError> {
    let candidates: Vec<PathBuf> = match std::env::var_os("KUBEBUILDER_ASSETS") {
        Some(dir) if !dir.is_empty() => vec![PathBuf::from(dir)],
        _ => vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/envtest/bin")],
    };
    for dir in &candidates {
        let complete = ["etcd", "kube-apiserver", "kube-controller-manager"]
            .iter()
            .all(|b| dir.join(b).is_file());
        if complete {
            return dir
                .canonicalize()
                .map_err(EnvtestError::io(format!("{}", dir.display())));
        }
    }
    Err(EnvtestError::NoAssets(format!(
        "looked in {}",
        candidates
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// The control plane shared by every test of this test process, started on first use (about
/// 6 s on 2 cores) and stopped when the process exits. `None`, after
/// [`ttlab_testkit::skip_or_fail`], when there are no binaries (so: a failure under `CI=true`).
/// A plane that was found but failed to start panics with the reason.
pub fn shared_or_skip() -> Option<&'static ControlPlane> {
    static PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    if let Err(e) = assets() {
        ttlab_testkit::skip_or_fail(&format!("the real control plane cannot start: {e}"));
        return None;
    }
    match PLANE.get_or_init(|| ControlPlane::start().map_err(|e| e.to_string())) {
        Ok(plane) => Some(plane),
        Err(e) => panic!("the real control plane did not start: {e}"),
    }
}

/// A running etcd + kube-apiserver + kube-controller-manager.
pub struct ControlPlane {
    processes: Processes,
    dir: PathBuf,
    server: String,
    ca_pem: Vec<u8>,
    front_proxy_ca_pem: Vec<u8>,
    admin_token: String,
    audit_log: PathBuf,
    etcd_url: String,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server", &self.server)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Starts a control plane from [`assets`] and installs the vendored CRDs. Blocks until the
    /// API server is ready and the CRDs are established. Stop it with [`ControlPlane::stop`]
    /// (or drop it); if this process dies first, a watchdog stops the processes and removes
    /// the directory.
    pub fn start() -> Result<Self, EnvtestError> {
        let bin = assets()?;
        let (processes, layout) = process::start(&bin)?;
        let mut plane = Self {
            processes,
            dir: layout.dir,
            server: layout.server,
            ca_pem: layout.ca_pem,
            front_proxy_ca_pem: layout.front_proxy_ca_pem,
            admin_token: layout.admin_token,
            audit_log: layout.audit_log,
            etcd_url: layout.etcd_url,
        };
        let crds = load_crds()?;
        plane.block_on(async {
            plane.wait_ready().await?;
            plane.install_crds(&crds).await
        })?;
        plane.processes.start_controller_manager()?;
        Ok(plane)
    }

    /// The API server's URL (`https://127.0.0.1:<port>`).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The CA of the API server's serving certificate (PEM).
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca_pem
    }

    /// The CA that signed the client certificate kube-apiserver presents when it proxies a
    /// request to an aggregated API server (PEM); such a server trusts the `X-Remote-User` and
    /// `X-Remote-Group` headers of connections with a certificate from this CA, named
    /// `front-proxy-client`.
    pub fn front_proxy_ca_pem(&self) -> &[u8] {
        &self.front_proxy_ca_pem
    }

    /// The front-proxy CA as a file, for servers that read it from disk.
    pub fn front_proxy_ca_file(&self) -> PathBuf {
        self.dir.join("pki").join("front-proxy-ca.crt")
    }

    /// A serving certificate and key (PEM files) for `dns_name`, signed by the plane's CA
    /// ([`ControlPlane::ca_pem`]): what an aggregated API server behind a Service presents
    /// (`<service>.<namespace>.svc`, the name the aggregator checks).
    pub fn serving_certificate(&self, dns_name: &str) -> Result<(PathBuf, PathBuf), EnvtestError> {
        process::serving_certificate(&self.dir.join("pki"), dns_name)
    }

    /// etcd's client URL (`http://127.0.0.1:<port>`, plain HTTP on loopback).
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// etcd's `/metrics` (Prometheus text format), read from its client URL.
    pub fn etcd_metrics(&self) -> Result<String, EnvtestError> {
        use std::io::{Read as _, Write as _};
        let authority = self
            .etcd_url
            .strip_prefix("http://")
            .unwrap_or(&self.etcd_url);
        let what = || format!("reading {}/metrics", self.etcd_url);
        let mut stream =
            std::net::TcpStream::connect(authority).map_err(EnvtestError::io(what()))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(EnvtestError::io(what()))?;
        write!(
            stream,
            "GET /metrics HTTP/1.0\r\nHost: {authority}\r\nAccept: text/plain\r\n\r\n"
        )
        .map_err(EnvtestError::io(what()))?;
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .map_err(EnvtestError::io(what()))?;
        let (head, body) = answer
            .split_once("\r\n\r\n")
            .ok_or_else(|| EnvtestError::Manifest(format!("{}: no HTTP answer", what())))?;
        if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
            let status = head.lines().next().unwrap_or_default();
            return Err(EnvtestError::Manifest(format!("{}: {status}", what())));
        }
        Ok(body.to_owned())
    }

    /// The value of the unlabelled metric `name` (e.g. `etcd_mvcc_db_total_size_in_bytes`) in
    /// etcd's `/metrics`; `None` when etcd does not report it.
    pub fn etcd_metric(&self, name: &str) -> Result<Option<f64>, EnvtestError> {
        Ok(metric_value(&self.etcd_metrics()?, name))
    }

    /// The directory holding the plane's certificates, data, logs and kubeconfigs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops every process and removes the directory.
    pub fn stop(self) {
        drop(self);
    }

    fn block_on<T: Send>(
        &self,
        f: impl std::future::Future<Output = Result<T, EnvtestError>> + Send,
    ) -> Result<T, EnvtestError> {
        std::thread::scope(|s| {
            s.spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(EnvtestError::io("a runtime for the control plane's setup"))?
                    .block_on(f)
            })
            .join()
            .unwrap_or_else(|_| Err(EnvtestError::Manifest("setup panicked".into())))
        })
    }

    fn kubeconfig_value(&self, user: &str, token: &str, namespace: &str) -> Value {
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "envtest", "cluster": {"server": self.server, "certificate-authority-data": ca}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": user, "namespace": namespace}}],
            "current-context": "envtest",
        })
    }

    fn write_kubeconfig(&self, file: &str, value: &Value) -> Result<PathBuf, EnvtestError> {
        let dir = self.dir.join("kubeconfigs");
        std::fs::create_dir_all(&dir).map_err(EnvtestError::io("kubeconfig directory"))?;
        let path = dir.join(file);
        let text = serde_json::to_string_pretty(value).expect("a kubeconfig serializes");
        std::fs::write(&path, text).map_err(EnvtestError::io(format!("{}", path.display())))?;
        Ok(path)
    }

    /// A kubeconfig of the cluster administrator (`system:masters`) whose default namespace is
    /// `namespace`: for test fixtures, never for the code under test.
    pub fn admin_kubeconfig(&self, namespace: &str) -> Result<PathBuf, EnvtestError> {
        let value = self.kubeconfig_value("admin", &self.admin_token, namespace);
        self.write_kubeconfig(&format!("admin@{namespace}.json"), &value)
    }

    /// A client of the cluster administrator (default namespace `default`).
    pub async fn admin_client(&self) -> Result<kube::Client, EnvtestError> {
        self.client_for(self.kubeconfig_value("admin", &self.admin_token, "default"))
            .await
    }

    async fn client_for(&self, kubeconfig: Value) -> Result<kube::Client, EnvtestError> {
        let kubeconfig: kube::config::Kubeconfig = serde_json::from_value(kubeconfig)
            .map_err(|e| EnvtestError::Manifest(format!("kubeconfig: {e}")))?;
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .map_err(|e| EnvtestError::Manifest(format!("kubeconfig: {e}")))?;
        kube::Client::try_from(config).map_err(EnvtestError::kube("a client of the control plane"))
    }

    async fn wait_ready(&self) -> Result<(), EnvtestError> {
        let client = self.admin_client().await?;
        let waited = Duration::from_secs(90);
        let until = tokio::time::Instant::now() + waited;
        loop {
            let request = http_get("/readyz");
            match client.request_text(request).await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                _ if tokio::time::Instant::now() > until => {
                    return Err(EnvtestError::NotReady {
                        waited,
                        log: self.processes.log_tail("kube-apiserver", 10),
                    });
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    async fn install_crds(&self, crds: &[Value]) -> Result<(), EnvtestError> {
        let client = self.admin_client().await?;
        objects::create_all(&client, crds).await?;
        objects::wait_crds_established(&client, crds).await
    }

    /// Creates a namespace named `<prefix>-<random>` and returns its name.
    pub async fn create_namespace(&self, prefix: &str) -> Result<String, EnvtestError> {
        let name = unique_name(prefix);
        let client = self.admin_client().await?;
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": name}})).expect("a namespace");
        Api::<Namespace>::all(client)
            .create(&PostParams::default(), &ns)
            .await
            .map_err(EnvtestError::kube(format!("create namespace {name}")))?;
        Ok(name)
    }

    /// Creates `objects` (JSON manifests of any kind the API server serves) as the
    /// administrator: Namespaces and CRDs first, then the rest in order. An object that already
    /// exists is an error.
    pub async fn create(&self, objects: &[Value]) -> Result<(), EnvtestError> {
        let client = self.admin_client().await?;
        objects::create_all(&client, objects).await
    }

    /// A kubeconfig for the ServiceAccount `namespace/name`, with a bound token (TokenRequest,
    /// valid for a day) and `default_namespace` as its context's namespace: what a pod running
    /// as that ServiceAccount would present.
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
        default_namespace: &str,
    ) -> Result<PathBuf, EnvtestError> {
        let client = self.admin_client().await?;
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                expiration_seconds: Some(86_400),
                ..Default::default()
            },
            ..Default::default()
        };
        let what = format!("a token for serviceaccount {namespace}/{name}");
        let api = Api::<ServiceAccount>::namespaced(client, namespace);
        let mut token = None;
        // The ServiceAccount may have been created a moment ago: retry briefly.
        for _ in 0..50 {
            match api
                .create_token_request(name, &PostParams::default(), &request)
                .await
            {
                Ok(answer) => {
                    token = answer.status.map(|s| s.token);
                    break;
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(EnvtestError::kube(what)(e)),
            }
        }
        let token = token.ok_or_else(|| EnvtestError::Manifest(format!("{what}: none issued")))?;
        let user = format!("system:serviceaccount:{namespace}:{name}");
        let value = self.kubeconfig_value(&user, &token, default_namespace);
        self.write_kubeconfig(
            &format!("{namespace}.{name}@{default_namespace}.json"),
            &value,
        )
    }

    /// Every request the API server has logged so far (audit stage `ResponseComplete`, or
    /// `ResponseStarted` for watches), oldest first.
    pub fn audit_events(&self) -> Result<Vec<AuditEvent>, EnvtestError> {
        audit::read(&self.audit_log)
    }

    /// The distinct calls of `username` (e.g. `system:serviceaccount:ns:name`) in `namespace`,
    /// in RBAC terms.
    pub fn calls_of(
        &self,
        username: &str,
        namespace: &str,
    ) -> Result<std::collections::BTreeSet<Call>, EnvtestError> {
        Ok(self
            .audit_events()?
            .iter()
            .filter(|e| e.user.username == username)
            .filter_map(AuditEvent::call)
            .filter(|c| c.namespace.as_deref() == Some(namespace))
            .collect())
    }
}

fn http_get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path)
        .body(Vec::new())
        .expect("a GET request builds")
}

/// The value of the unlabelled metric `name` in a Prometheus text exposition.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (metric, value) = l.split_once(char::is_whitespace)?;
        (metric == name).then(|| value.trim().parse().ok())?
    })
}

/// `<prefix>-<8 random hex digits>`, a valid namespace or object name for a short prefix.
pub fn unique_name(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    format!("{prefix}-{:08x}", h.finish() as u32)
}

/// The shipped `deploy/` objects of one or more environments installed into namespaces of a
/// test's own (one VM namespace shared by the environments, as in production), with
/// kubeconfigs for each environment's ServiceAccounts.
#[derive(Debug, Clone)]
pub struct Installed {
    /// The VM namespace (the shipped `ttlab-vms`, renamed).
    pub vm_namespace: String,
    /// A kubeconfig of the administrator, defaulting to the VM namespace (for fixtures).
    pub admin_kubeconfig: PathBuf,
    /// Each environment installed, in the order asked for.
    pub envs: Vec<InstalledEnv>,
    /// The objects created, after renaming.
    pub objects: Vec<Value>,
}

/// One environment of an [`Installed`] set.
#[derive(Debug, Clone)]
pub struct InstalledEnv {
    /// The environment (`dev` or `prod`), as in `deploy/overlays/<env>`.
    pub env: String,
    /// The backend namespace (the shipped `ttlab-<env>`, renamed).
    pub backend_namespace: String,
    /// A kubeconfig of the server's ServiceAccount, defaulting to the VM namespace.
    pub server_kubeconfig: PathBuf,
    /// A kubeconfig of the reaper's ServiceAccount, defaulting to the VM namespace.
    pub reaper_kubeconfig: PathBuf,
}

impl InstalledEnv {
    /// The audit username of the server's ServiceAccount.
    pub fn server_user(&self) -> String {
        format!(
            "system:serviceaccount:{}:ttlab-server",
            self.backend_namespace
        )
    }

    /// The audit username of the reaper's ServiceAccount.
    pub fn reaper_user(&self) -> String {
        format!(
            "system:serviceaccount:{}:ttlab-reaper",
            self.backend_namespace
        )
    }
}

impl Installed {
    /// The installed environment `env`; panics if it was not installed (a test's mistake).
    pub fn env(&self, env: &str) -> &InstalledEnv {
        self.envs
            .iter()
            .find(|e| e.env == env)
            .unwrap_or_else(|| panic!("environment {env} was not installed"))
    }
}

/// Kinds of `deploy/` that are not installed: workloads, whose pods would never run here (no
/// kubelet), and which the tests replace by running the binaries or the libraries themselves.
pub const NOT_INSTALLED: [&str; 2] = ["Deployment", "CronJob"];

/// `kubectl kustomize deploy/overlays/<env>` as JSON objects.
pub fn render_overlay(env: &str) -> Result<Vec<Value>, EnvtestError> {
    let kubectl = ttlab_testkit::which("kubectl")
        .ok_or_else(|| EnvtestError::Manifest("kubectl is not on PATH".into()))?;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/overlays")
        .join(env);
    let out = std::process::Command::new(kubectl)
        .arg("kustomize")
        .arg(&dir)
        .output()
        .map_err(EnvtestError::io("kubectl kustomize"))?;
    if !out.status.success() {
        return Err(EnvtestError::Command {
            command: format!("kubectl kustomize {}", dir.display()),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    objects::parse_stream(&String::from_utf8_lossy(&out.stdout))
}

impl ControlPlane {
    /// Installs the shipped objects of `deploy/overlays/<env>` for each of `envs` (all but
    /// [`NOT_INSTALLED`]) as an operator would, into fresh namespaces (`ttlab-vms` and each
    /// `ttlab-<env>` renamed with a random suffix, so tests sharing a plane never see each
    /// other's objects; the VM namespace's objects, identical in every overlay, are created
    /// once), and issues kubeconfigs for each environment's server and reaper.
    pub async fn install_shipped(&self, envs: &[&str]) -> Result<Installed, EnvtestError> {
        let suffix = unique_name("t");
        let vm_namespace = format!("vms-{suffix}");
        let mut objects: Vec<Value> = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for env in envs {
            let names = std::collections::BTreeMap::from([
                ("ttlab-vms".to_owned(), vm_namespace.clone()),
                (format!("ttlab-{env}"), format!("{env}-{suffix}")),
            ]);
            for object in rename_namespaces(&render_overlay(env)?, &names) {
                let kind = object["kind"].as_str().unwrap_or_default().to_owned();
                let key = (
                    kind.clone(),
                    object["metadata"]["namespace"].as_str().map(str::to_owned),
                    object["metadata"]["name"].as_str().map(str::to_owned),
                );
                if !NOT_INSTALLED.contains(&kind.as_str()) && seen.insert(key) {
                    objects.push(object);
                }
            }
        }
        self.create(&objects).await?;
        let mut installed = Vec::new();
        for env in envs {
            let backend_namespace = format!("{env}-{suffix}");
            let server_kubeconfig = self
                .service_account_kubeconfig(&backend_namespace, "ttlab-server", &vm_namespace)
                .await?;
            let reaper_kubeconfig = self
                .service_account_kubeconfig(&backend_namespace, "ttlab-reaper", &vm_namespace)
                .await?;
            installed.push(InstalledEnv {
                env: (*env).to_owned(),
                backend_namespace,
                server_kubeconfig,
                reaper_kubeconfig,
            });
        }
        let admin_kubeconfig = self.admin_kubeconfig(&vm_namespace)?;
        Ok(Installed {
            vm_namespace,
            admin_kubeconfig,
            envs: installed,
            objects,
        })
    }
}
