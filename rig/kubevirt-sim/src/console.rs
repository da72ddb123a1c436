//! The console subresource, served the way KubeVirt's virt-api serves it: an aggregated API
//! server for `subresources.kubevirt.io/v1`, registered with an `APIService`, so a console
//! goes through kube-apiserver's proxy (authentication, RBAC on
//! `virtualmachineinstances/console`) to here.
//!
//! Here it accepts only connections whose client certificate chains to the front proxy's CA
//! (`--requestheader-client-ca-file`) and, when names are configured, whose common name is
//! one of them (`--requestheader-allowed-names`); takes the user from the front proxy's
//! headers (`X-Remote-User`, `X-Remote-Group`, `X-Remote-Extra-*`); and authorizes again with
//! a SubjectAccessReview, as a delegating API server does. A console is a WebSocket with
//! subprotocol `plain.kubevirt.io`: raw bytes in binary frames both ways, text frames
//! ignored, one connection per VMI (a new one closes the old); a VMI that is not running
//! answers 400, a failed one 409.
//!
//! [`ConsoleSettings::behind_a_local_front`] serves the same console as plain HTTP on a
//! loopback address for a front on this machine that has already authenticated and
//! authorized the caller (kube-sim relays its console subresource there): no TLS, no
//! review.
//!
//! Behind it is the guest's serial line: root's autologin shell, simulated — input is echoed,
//! a line runs with `/bin/sh -c` in the guest's directory (`hostname` alone prints the guest's
//! name), its output comes back with a prompt.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio_rustls::rustls;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_util::sync::CancellationToken;

use crate::guests::GuestState;
use crate::object::uid;
use crate::rest::Kind;
use crate::{Ctx, Error};

mod portforward;

/// The subprotocol of KubeVirt's serial console.
pub const PROTOCOL: &str = "plain.kubevirt.io";
/// The API group served.
pub const GROUP: &str = "subresources.kubevirt.io";
/// The API version served.
pub const VERSION: &str = "v1";
/// How long one console command may run.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// How often an open console checks that its guest still runs.
const GUEST_CHECK: Duration = Duration::from_millis(250);

/// Whom the console server trusts for authentication and authorization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    /// kube-apiserver's aggregator: TLS with its front-proxy client certificate, the user
    /// from its headers, and a SubjectAccessReview per console.
    Aggregator,
    /// A front on this machine that has already authenticated and authorized the caller:
    /// plain HTTP, on a loopback address only.
    Local,
}

/// Settings of the console server.
#[derive(Debug, Clone)]
pub struct ConsoleSettings {
    /// Where to listen (port 0 picks a free one).
    pub listen: SocketAddr,
    /// Whom it trusts (the certificate paths matter for [`Front::Aggregator`] only).
    pub front: Front,
    /// PEM serving certificate (chain); valid for `<service>.<namespace>.svc`, the name the
    /// aggregator checks.
    pub serving_cert: PathBuf,
    /// PEM private key of the serving certificate.
    pub serving_key: PathBuf,
    /// PEM CA the front proxy's client certificate chains to (kube-apiserver's
    /// `--requestheader-client-ca-file`).
    pub client_ca: PathBuf,
    /// Common names accepted on the front proxy's certificate (`--requestheader-allowed-names`);
    /// empty accepts any certificate of `client_ca`.
    pub allowed_names: Vec<String>,
    /// Headers naming the user (`--requestheader-username-headers`).
    pub username_headers: Vec<String>,
    /// Headers naming the user's groups (`--requestheader-group-headers`).
    pub group_headers: Vec<String>,
    /// Prefixes of headers carrying the user's extra attributes
    /// (`--requestheader-extra-headers-prefix`).
    pub extra_headers_prefixes: Vec<String>,
}

impl ConsoleSettings {
    /// On 127.0.0.1 (a free port), with the conventional front-proxy headers.
    pub fn new(
        serving_cert: impl Into<PathBuf>,
        serving_key: impl Into<PathBuf>,
        client_ca: impl Into<PathBuf>,
    ) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            front: Front::Aggregator,
            serving_cert: serving_cert.into(),
            serving_key: serving_key.into(),
            client_ca: client_ca.into(),
            allowed_names: Vec::new(),
            username_headers: vec!["X-Remote-User".into()],
            group_headers: vec!["X-Remote-Group".into()],
            extra_headers_prefixes: vec!["X-Remote-Extra-".into()],
        }
    }

    /// Plain HTTP on 127.0.0.1 (a free port) for a local front that has authorized the
    /// caller already ([`Front::Local`]).
    pub fn behind_a_local_front() -> Self {
        Self {
            front: Front::Local,
            ..Self::new("", "", "")
        }
    }
}

/// The open consoles, one per VMI, each with its number; and the VMIs (by uid) whose boot
/// lines a console has shown.
#[derive(Default)]
struct Consoles {
    open: Mutex<HashMap<(String, String), (u64, CancellationToken)>>,
    next: std::sync::atomic::AtomicU64,
    booted: Mutex<std::collections::HashSet<String>>,
}

impl Consoles {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<(String, String), (u64, CancellationToken)>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new console of `ns/name`: the previous one closes.
    fn open(&self, ns: &str, name: &str) -> (u64, CancellationToken) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let token = CancellationToken::new();
        let old = self
            .lock()
            .insert((ns.to_owned(), name.to_owned()), (id, token.clone()));
        if let Some((_, old)) = old {
            old.cancel();
        }
        (id, token)
    }

    /// Whether this is the first console of VMI `vmi_uid` (which shows what the guest
    /// printed while it booted, as a serial port's first reader does).
    fn first_of(&self, vmi_uid: &str) -> bool {
        self.booted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(vmi_uid.to_owned())
    }

    /// Console `id` of `ns/name` ended (a newer one stays registered).
    fn close(&self, ns: &str, name: &str, id: u64) {
        let mut open = self.lock();
        let key = (ns.to_owned(), name.to_owned());
        if open.get(&key).is_some_and(|(i, _)| *i == id) {
            open.remove(&key);
        }
    }
}

/// A running console server. Stops on drop or [`ConsoleServer::stop`].
pub struct ConsoleServer {
    addr: SocketAddr,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

struct Server {
    ctx: Arc<Ctx>,
    settings: ConsoleSettings,
    consoles: Consoles,
}

impl ConsoleServer {
    pub(crate) async fn start(ctx: Arc<Ctx>, settings: ConsoleSettings) -> Result<Self, Error> {
        let acceptor = match settings.front {
            Front::Aggregator => Some(tokio_rustls::TlsAcceptor::from(Arc::new(tls_config(
                &settings,
            )?))),
            Front::Local if settings.listen.ip().is_loopback() => None,
            Front::Local => {
                return Err(Error::Settings(format!(
                    "a console behind a local front listens on a loopback address, not {}",
                    settings.listen
                )));
            }
        };
        let listener = tokio::net::TcpListener::bind(settings.listen)
            .await
            .map_err(|source| Error::Io {
                path: PathBuf::from(settings.listen.to_string()),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| Error::Io {
            path: PathBuf::from(settings.listen.to_string()),
            source,
        })?;
        let stop = CancellationToken::new();
        let server = Arc::new(Server {
            ctx,
            settings,
            consoles: Consoles::default(),
        });
        let token = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                let (tcp, peer) = tokio::select! {
                    r = listener.accept() => match r {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!(error = %e, "console server: accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                    () = token.cancelled() => return,
                };
                let acceptor = acceptor.clone();
                let server = server.clone();
                let token = token.clone();
                tokio::spawn(async move {
                    let Some(acceptor) = acceptor else {
                        server.serve(tcp, peer, token).await;
                        return;
                    };
                    let tls = match tokio::time::timeout(
                        Duration::from_secs(10),
                        acceptor.accept(tcp),
                    )
                    .await
                    {
                        Ok(Ok(t)) => t,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "console server: TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    };
                    let cn = tls
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .and_then(|c| common_name(c.as_ref()));
                    let allowed = &server.settings.allowed_names;
                    if !allowed.is_empty() && !cn.as_ref().is_some_and(|n| allowed.contains(n)) {
                        tracing::warn!(%peer, ?cn, "console server: client certificate name not allowed");
                        return;
                    }
                    server.serve(tls, peer, token).await;
                });
            }
        });
        tracing::info!(%addr, "console server listening");
        Ok(Self {
            addr,
            stop,
            task: Some(task),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Registers this server with the API server as `v1.subresources.kubevirt.io`: a Service
    /// `service` in `namespace` of type ExternalName `localhost` on this server's port (the
    /// aggregator resolves it without `--enable-aggregator-routing`; Endpoints cannot hold a
    /// loopback address) and the `APIService` pointing at it, trusting `ca_bundle_pem` for
    /// the serving certificate. Waits (at most `wait`) until the APIService is Available.
    pub async fn register(
        &self,
        client: &kube::Client,
        namespace: &str,
        service: &str,
        ca_bundle_pem: &[u8],
        wait: Duration,
    ) -> Result<(), Error> {
        let rest = crate::rest::Rest::new(client.clone());
        let port = self.addr.port();
        let svc = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": service, "namespace": namespace},
            "spec": {"type": "ExternalName", "externalName": "localhost",
                     "ports": [{"name": "https", "port": port, "protocol": "TCP"}]},
        });
        match rest.create(Kind::Service, namespace, &svc).await {
            Ok(_) => {}
            Err(e) if e.is_already_exists() => {
                rest.update(
                    Kind::Service,
                    namespace,
                    service,
                    crate::rest::Part::Main,
                    |cur| {
                        let mut new = cur.clone();
                        new["spec"]["ports"] = svc["spec"]["ports"].clone();
                        new["spec"]["externalName"] = Value::from("localhost");
                        Some(new)
                    },
                )
                .await?;
            }
            Err(e) => return Err(e),
        }
        let api_service_name = format!("{VERSION}.{GROUP}");
        let spec = json!({
            "group": GROUP,
            "version": VERSION,
            "groupPriorityMinimum": 1000,
            "versionPriority": 15,
            "caBundle": base64::engine::general_purpose::STANDARD.encode(ca_bundle_pem),
            "service": {"namespace": namespace, "name": service, "port": port},
        });
        let body = json!({
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": api_service_name},
            "spec": spec,
        });
        match rest.create(Kind::ApiService, "", &body).await {
            Ok(_) => {}
            Err(e) if e.is_already_exists() => {
                rest.update(
                    Kind::ApiService,
                    "",
                    &api_service_name,
                    crate::rest::Part::Main,
                    |cur| {
                        let mut new = cur.clone();
                        new["spec"] = spec.clone();
                        Some(new)
                    },
                )
                .await?;
            }
            Err(e) => return Err(e),
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let a = rest.get(Kind::ApiService, "", &api_service_name).await?;
            let available = a.as_ref().and_then(|a| {
                crate::object::condition(&a["status"]["conditions"], "Available").cloned()
            });
            if available.as_ref().is_some_and(|c| c["status"] == "True") {
                tracing::info!(
                    apiservice = api_service_name,
                    "console API registered and available"
                );
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Sync(format!(
                    "APIService {api_service_name} not available after {wait:?}: {}",
                    available
                        .map(|c| c.to_string())
                        .unwrap_or_else(|| "no condition".into())
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stops accepting and closes the listener.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }
}

impl Drop for ConsoleServer {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

fn tls_config(s: &ConsoleSettings) -> Result<rustls::ServerConfig, Error> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |what: &str, path: &PathBuf, e: &dyn std::fmt::Display| {
        Error::Settings(format!("{what} {}: {e}", path.display()))
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&s.serving_cert)
        .map_err(|e| bad("serving certificate", &s.serving_cert, &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad("serving certificate", &s.serving_cert, &e))?;
    let key = PrivateKeyDer::from_pem_file(&s.serving_key)
        .map_err(|e| bad("serving key", &s.serving_key, &e))?;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(&s.client_ca)
        .map_err(|e| bad("client CA", &s.client_ca, &e))?
    {
        let c = c.map_err(|e| bad("client CA", &s.client_ca, &e))?;
        roots
            .add(c)
            .map_err(|e| bad("client CA", &s.client_ca, &e))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .map_err(|e| bad("client CA", &s.client_ca, &e))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Settings(format!("TLS: {e}")))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(|e| bad("serving certificate", &s.serving_cert, &e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

type Body = Full<Bytes>;

fn respond(code: StatusCode, body: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// A `Status` error answer.
fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    respond(
        code,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code.as_u16()}),
    )
}

/// The user the front proxy names.
#[derive(Debug)]
struct User {
    name: String,
    groups: Vec<String>,
    extra: serde_json::Map<String, Value>,
}

impl Server {
    /// Serves HTTP/1.1 (with upgrades) on one accepted connection.
    async fn serve<IO>(self: Arc<Self>, io: IO, peer: SocketAddr, token: CancellationToken)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let svc = hyper::service::service_fn(move |req| {
            let server = self.clone();
            let token = token.clone();
            async move { Ok::<_, std::convert::Infallible>(server.handle(req, token).await) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), svc)
            .with_upgrades();
        if let Err(e) = conn.await {
            tracing::debug!(%peer, error = %e, "console server: connection ended");
        }
    }

    fn user(&self, req: &Request<Incoming>) -> Option<User> {
        let h = req.headers();
        let name = self
            .settings
            .username_headers
            .iter()
            .find_map(|k| h.get(k.as_str()).and_then(|v| v.to_str().ok()))
            .filter(|n| !n.is_empty())?
            .to_owned();
        let groups = self
            .settings
            .group_headers
            .iter()
            .flat_map(|k| h.get_all(k.as_str()))
            .filter_map(|v| v.to_str().ok())
            .map(str::to_owned)
            .collect();
        let mut extra = serde_json::Map::new();
        for (k, v) in h {
            let k = k.as_str();
            for p in &self.settings.extra_headers_prefixes {
                let p = p.to_ascii_lowercase();
                if let Some(key) = k.strip_prefix(p.as_str())
                    && let Ok(v) = v.to_str()
                {
                    let list = extra
                        .entry(key.to_owned())
                        .or_insert_with(|| Value::Array(Vec::new()));
                    if let Some(l) = list.as_array_mut() {
                        l.push(Value::from(v));
                    }
                }
            }
        }
        Some(User {
            name,
            groups,
            extra,
        })
    }

    async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        stop: CancellationToken,
    ) -> Response<Body> {
        let path = req.uri().path().trim_end_matches('/').to_owned();
        let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match (req.method(), segs.as_slice()) {
            (&Method::GET, ["healthz" | "readyz" | "livez"]) => {
                let mut r = Response::new(Full::new(Bytes::from_static(b"ok")));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("text/plain"),
                );
                r
            }
            (&Method::GET, ["apis"]) => respond(
                StatusCode::OK,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group()]}),
            ),
            (&Method::GET, ["apis", GROUP]) => respond(StatusCode::OK, &group()),
            (&Method::GET, ["apis", GROUP, VERSION]) => respond(
                StatusCode::OK,
                &json!({
                    "kind": "APIResourceList",
                    "apiVersion": "v1",
                    "groupVersion": format!("{GROUP}/{VERSION}"),
                    "resources": [{
                        "name": "virtualmachineinstances/console",
                        "singularName": "",
                        "namespaced": true,
                        "kind": "VirtualMachineInstance",
                        "verbs": ["get"],
                    }, {
                        "name": "virtualmachineinstances/portforward",
                        "singularName": "",
                        "namespaced": true,
                        "kind": "VirtualMachineInstance",
                        "verbs": ["get"],
                    }],
                }),
            ),
            (
                &Method::GET,
                [
                    "apis",
                    GROUP,
                    VERSION,
                    "namespaces",
                    ns,
                    "virtualmachineinstances",
                    vmi,
                    "console",
                ],
            ) => {
                let (ns, vmi) = ((*ns).to_owned(), (*vmi).to_owned());
                self.console(req, &ns, &vmi, stop).await
            }
            (
                &Method::GET,
                [
                    "apis",
                    GROUP,
                    VERSION,
                    "namespaces",
                    ns,
                    "virtualmachineinstances",
                    vmi,
                    "portforward",
                    port,
                    protocol @ ..,
                ],
            ) if protocol.len() <= 1 => {
                let (ns, vmi, port) = ((*ns).to_owned(), (*vmi).to_owned(), (*port).to_owned());
                let protocol = protocol.first().copied().unwrap_or("tcp").to_owned();
                self.portforward(req, &ns, &vmi, &port, &protocol, stop)
                    .await
            }
            _ => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            ),
        }
    }

    /// Authorizes `user` for `get` on `virtualmachineinstances/<subresource>` of `ns/vmi`.
    async fn authorized(
        &self,
        user: &User,
        ns: &str,
        vmi: &str,
        subresource: &str,
    ) -> Result<bool, Error> {
        let review = json!({
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user.name,
                "groups": user.groups,
                "extra": user.extra,
                "resourceAttributes": {
                    "namespace": ns,
                    "verb": "get",
                    "group": GROUP,
                    "version": VERSION,
                    "resource": "virtualmachineinstances",
                    "subresource": subresource,
                    "name": vmi,
                },
            },
        });
        let answer = self
            .ctx
            .rest
            .create(Kind::SubjectAccessReview, "", &review)
            .await?;
        Ok(answer["status"]["allowed"] == true)
    }

    /// The caller of `virtualmachineinstances/<subresource>` of `ns/vmi`, authenticated and
    /// authorized as the front requires; else the refusal to answer.
    async fn admit(
        &self,
        req: &Request<Incoming>,
        ns: &str,
        vmi_name: &str,
        subresource: &str,
    ) -> Result<User, Response<Body>> {
        let user = match (self.user(req), self.settings.front) {
            (Some(user), _) => user,
            // A local front authorized the caller; it may not name them.
            (None, Front::Local) => User {
                name: "(local front)".into(),
                groups: Vec::new(),
                extra: serde_json::Map::new(),
            },
            (None, Front::Aggregator) => {
                return Err(status(
                    StatusCode::UNAUTHORIZED,
                    "Unauthorized",
                    "no user in the front proxy's headers",
                ));
            }
        };
        let review = match self.settings.front {
            Front::Aggregator => self.authorized(&user, ns, vmi_name, subresource).await,
            Front::Local => Ok(true),
        };
        match review {
            Ok(true) => {}
            Ok(false) => {
                return Err(status(
                    StatusCode::FORBIDDEN,
                    "Forbidden",
                    &format!(
                        "User \"{}\" cannot get resource \"virtualmachineinstances/{subresource}\" in API group \"{GROUP}\" in the namespace \"{ns}\"",
                        user.name
                    ),
                ));
            }
            Err(e) => {
                tracing::warn!(error = %e, "console: SubjectAccessReview failed");
                return Err(status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    &e.to_string(),
                ));
            }
        }
        Ok(user)
    }

    /// The VMI `vmi_name` in `ns`, or virt-api's answer when there is none (404) or it cannot
    /// be read (500).
    async fn vmi(&self, ns: &str, vmi_name: &str) -> Result<Value, Response<Body>> {
        match self.ctx.rest.get(Kind::Vmi, ns, vmi_name).await {
            Ok(Some(v)) => Ok(v),
            Ok(None) => Err(status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("virtualmachineinstance.kubevirt.io \"{vmi_name}\" not found"),
            )),
            Err(e) => Err(status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                &format!("unable to retrieve vmi [{vmi_name}]: {e}"),
            )),
        }
    }

    async fn console(
        self: Arc<Self>,
        req: Request<Incoming>,
        ns: &str,
        vmi_name: &str,
        stop: CancellationToken,
    ) -> Response<Body> {
        let user = match self.admit(&req, ns, vmi_name, "console").await {
            Ok(user) => user,
            Err(refused) => return refused,
        };
        let vmi = match self.vmi(ns, vmi_name).await {
            Ok(vmi) => vmi,
            Err(refused) => return refused,
        };
        match vmi["status"]["phase"].as_str().filter(|p| !p.is_empty()) {
            Some("Running") => {}
            Some("Failed") => {
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    &not_running_message("Failed"),
                );
            }
            phase => {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &not_running_message(phase.unwrap_or("Pending")),
                );
            }
        }
        let vmi_uid = uid(&vmi).to_owned();
        let Some(guest) = self
            .ctx
            .guests
            .info(ns, vmi_name)
            .filter(|g| g.vmi_uid == vmi_uid && g.state == GuestState::Running)
        else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!(
                    "VirtualMachineInstance {vmi_name} is not running yet: its guest is still booting"
                ),
            );
        };
        // The WebSocket upgrade, with the console's subprotocol.
        let h = req.headers();
        let upgrade = h
            .get(header::UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
        let offered = h
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|p| p.trim() == PROTOCOL);
        let Some(key) = h
            .get(header::SEC_WEBSOCKET_KEY)
            .map(|k| k.as_bytes().to_vec())
        else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "a console is a WebSocket upgrade",
            );
        };
        if !upgrade || !offered {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("a console is a WebSocket upgrade with subprotocol {PROTOCOL}"),
            );
        }
        let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(&key);
        let (ns, vmi_name) = (ns.to_owned(), vmi_name.to_owned());
        let who = user.name.clone();
        let server = self.clone();
        tokio::spawn(async move {
            let upgraded = match hyper::upgrade::on(req).await {
                Ok(u) => u,
                Err(e) => {
                    tracing::warn!(error = %e, "console: upgrade failed");
                    return;
                }
            };
            let ws =
                WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
            let (id, token) = server.consoles.open(&ns, &vmi_name);
            tracing::info!(ns, vmi = vmi_name, user = who, "console opened");
            let first = server.consoles.first_of(&vmi_uid);
            if let Some(serial) = server.ctx.guests.serial(&vmi_uid) {
                serial_session(&server.ctx, ws, &serial, first, &vmi_uid, &token, &stop).await;
            } else {
                let mut terminal = Terminal::new(guest.hostname.clone(), guest.dir.clone());
                terminal.boot = first;
                session(&server.ctx, ws, &mut terminal, &vmi_uid, &token, &stop).await;
            }
            server.consoles.close(&ns, &vmi_name, id);
            tracing::info!(ns, vmi = vmi_name, "console closed");
        });
        switching_protocols(&accept, true)
    }
}

/// The `101 Switching Protocols` answer of a WebSocket upgrade: `accept` as its
/// `Sec-WebSocket-Accept`, and [`PROTOCOL`] as its subprotocol when `with_protocol` (as
/// gorilla's upgrader answers: the subprotocol only when the client offered it).
fn switching_protocols(accept: &str, with_protocol: bool) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let hs = r.headers_mut();
    hs.insert(
        header::UPGRADE,
        header::HeaderValue::from_static("websocket"),
    );
    hs.insert(
        header::CONNECTION,
        header::HeaderValue::from_static("Upgrade"),
    );
    if let Ok(v) = header::HeaderValue::from_str(accept) {
        hs.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    if with_protocol {
        hs.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            header::HeaderValue::from_static(PROTOCOL),
        );
    }
    r
}

/// KubeVirt's refusal of a console to a VMI in `phase`.
fn not_running_message(phase: &str) -> String {
    format!(
        "Internal error occurred: dialing virt-handler: Unable to connect to VirtualMachineInstance because phase is {phase} instead of Running"
    )
}

fn group() -> Value {
    let gv = json!({"groupVersion": format!("{GROUP}/{VERSION}"), "version": VERSION});
    json!({"kind": "APIGroup", "apiVersion": "v1", "name": GROUP, "versions": [gv], "preferredVersion": gv})
}

/// One console connection: bytes in, the terminal's bytes out, until the client closes, a
/// newer console replaces this one, the guest stops, or the server stops. A command's output
/// streams as it comes; Ctrl-C interrupts it.
async fn session<S>(
    ctx: &Ctx,
    mut ws: WebSocketStream<S>,
    terminal: &mut Terminal,
    vmi_uid: &str,
    token: &CancellationToken,
    stop: &CancellationToken,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let over = connection_over(ctx, vmi_uid, token, stop);
    tokio::pin!(over);
    if ws.send(Message::binary(terminal.greeting())).await.is_err() {
        return;
    }
    let mut running: Option<Running> = None;
    loop {
        tokio::select! {
            m = ws.next() => match m {
                Some(Ok(Message::Binary(data))) => {
                    let outs = match &mut running {
                        Some(r) => r.input(&data, terminal).await,
                        None => {
                            let (outs, line) = terminal.input(&data);
                            if let Some(line) = line {
                                running = Some(terminal.start(&line));
                            }
                            outs
                        }
                    };
                    if running.as_ref().is_some_and(Running::interrupted) {
                        running = None;
                    }
                    for out in outs {
                        if ws.send(Message::binary(out)).await.is_err() {
                            return;
                        }
                    }
                }
                // Text frames are dropped, as KubeVirt does; pings are answered by the codec.
                Some(Ok(Message::Text(_) | Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
            },
            out = async {
                match &mut running {
                    Some(r) => r.output.recv().await,
                    None => std::future::pending().await,
                }
            } => {
                let bytes = match out {
                    Some(chunk) => crlf(&chunk),
                    // The command ended: the prompt again.
                    None => {
                        running = None;
                        terminal.prompt()
                    }
                };
                if ws.send(Message::binary(bytes)).await.is_err() {
                    return;
                }
            }
            () = &mut over => {
                let _ = ws.close(None).await;
                return;
            }
        }
    }
}

/// Resolves when a console connection of VMI `vmi_uid` is over: its guest no longer runs
/// (looked at every [`GUEST_CHECK`]), a newer console replaced it (`token`), or the server
/// stops (`stop`).
async fn connection_over(
    ctx: &Ctx,
    vmi_uid: &str,
    token: &CancellationToken,
    stop: &CancellationToken,
) {
    let mut tick = tokio::time::interval(GUEST_CHECK);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if ctx.guests.state(vmi_uid) != Some(GuestState::Running) {
                    return;
                }
            }
            () = token.cancelled() => return,
            () = stop.cancelled() => return,
        }
    }
}

/// One console connection to a qemu guest's serial port: what it printed before (for the
/// first client, as a serial port's first reader sees the boot), then its output as it comes;
/// the client's frames are typed on it. Ends as [`session`] does.
async fn serial_session<S>(
    ctx: &Ctx,
    mut ws: WebSocketStream<S>,
    serial: &ttlab_qemu_guest::Console,
    first: bool,
    vmi_uid: &str,
    token: &CancellationToken,
    stop: &CancellationToken,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::sync::broadcast::error::RecvError;
    let mut output = serial.subscribe();
    let history = if first { serial.history() } else { Vec::new() };
    if !history.is_empty() && ws.send(Message::binary(history)).await.is_err() {
        return;
    }
    let over = connection_over(ctx, vmi_uid, token, stop);
    tokio::pin!(over);
    loop {
        tokio::select! {
            m = ws.next() => match m {
                Some(Ok(Message::Binary(data))) => {
                    if serial.send(data).await.is_err() {
                        let _ = ws.close(None).await;
                        return;
                    }
                }
                Some(Ok(Message::Text(_) | Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
            },
            out = output.recv() => match out {
                Ok(bytes) => if ws.send(Message::binary(bytes)).await.is_err() { return },
                Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => {
                    let _ = ws.close(None).await;
                    return;
                }
            },
            () = &mut over => {
                let _ = ws.close(None).await;
                return;
            }
        }
    }
}

/// `\n` as a terminal shows it: `\r\n`.
fn crlf(out: &[u8]) -> Vec<u8> {
    let mut crlf = Vec::with_capacity(out.len());
    for &b in out {
        if b == b'\n' {
            crlf.push(b'\r');
        }
        crlf.push(b);
    }
    crlf
}

/// A simulated serial line: echo and line editing, a line run by `/bin/sh -c` in the guest's
/// directory.
struct Terminal {
    hostname: String,
    dir: PathBuf,
    line: Vec<u8>,
    /// Whether the greeting shows the boot lines (the guest's first console).
    boot: bool,
}

/// A command running on the console: its output, in chunks, until it ends.
struct Running {
    output: tokio::sync::mpsc::Receiver<Vec<u8>>,
    kill: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Running {
    /// Input while it runs: Ctrl-C interrupts it; anything else is dropped (its standard
    /// input is closed).
    async fn input(&mut self, data: &[u8], terminal: &Terminal) -> Vec<Vec<u8>> {
        if !data.contains(&0x03) {
            return Vec::new();
        }
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        let mut out = b"^C\r\n".to_vec();
        out.extend(terminal.prompt());
        vec![out]
    }

    fn interrupted(&self) -> bool {
        self.kill.is_none()
    }
}

impl Terminal {
    fn new(hostname: String, dir: PathBuf) -> Self {
        Self {
            hostname,
            dir,
            line: Vec::new(),
            boot: false,
        }
    }

    fn prompt(&self) -> Vec<u8> {
        format!("root@{}:~# ", self.hostname).into_bytes()
    }

    /// The first bytes a console shows: for the guest's first console the kernel's,
    /// cloud-init's and getty's autologin lines, then the prompt.
    fn greeting(&self) -> Vec<u8> {
        let h = &self.hostname;
        let mut out = if self.boot {
            format!(
                "[    0.000000] Linux version 6.1.0-kubevirt-sim (simulated serial console)\r\n\
                 [    1.234567] cloud-init[512]: Cloud-init v. 22.4.2 running 'modules:final'\r\n\
                 \r\nDebian GNU/Linux 12 {h} ttyS0\r\n\r\n\
                 {h} login: root (automatic login)\r\n"
            )
            .into_bytes()
        } else {
            Vec::new()
        };
        out.extend_from_slice(b"\r\n");
        out.extend(self.prompt());
        out
    }

    /// What the line echoes for `data`, and the line to run if one was entered (what
    /// follows it in `data` is dropped, as typed ahead while it runs).
    fn input(&mut self, data: &[u8]) -> (Vec<Vec<u8>>, Option<String>) {
        let mut outs = Vec::new();
        let mut echo = Vec::new();
        for &b in data {
            match b {
                b'\r' | b'\n' => {
                    echo.extend_from_slice(b"\r\n");
                    let line =
                        String::from_utf8_lossy(&std::mem::take(&mut self.line)).into_owned();
                    if !line.trim().is_empty() {
                        outs.push(echo);
                        return (outs, Some(line));
                    }
                    echo.extend(self.prompt());
                }
                0x7f | 0x08 if !self.line.is_empty() => {
                    self.line.pop();
                    echo.extend_from_slice(b"\x08 \x08");
                }
                0x7f | 0x08 => {}
                0x03 => {
                    self.line.clear();
                    echo.extend_from_slice(b"^C\r\n");
                    echo.extend(self.prompt());
                }
                b if b >= 0x20 || b == b'\t' => {
                    self.line.push(b);
                    echo.push(b);
                }
                _ => {}
            }
        }
        if !echo.is_empty() {
            outs.push(echo);
        }
        (outs, None)
    }

    /// What the guest itself answers, not this machine: `hostname` (the guest's name),
    /// `whoami` (the console's user, root) and `stty size` (the size the guest's agent set on
    /// the serial line, `ROWS COLS` written under the guest's root, as `TIOCSWINSZ` holds it;
    /// a line never sized is 24 80).
    fn builtin(&self, line: &str) -> Option<String> {
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["hostname"] => Some(format!("{}\n", self.hostname)),
            ["whoami"] => Some("root\n".to_owned()),
            ["stty", "size"] => {
                let set = ttlab_sim_guest::console_size(&self.dir);
                let (rows, cols) = set.unwrap_or((24, 80));
                Some(format!("{rows} {cols}\n"))
            }
            _ => None,
        }
    }

    /// Starts `line`: a [`Terminal::builtin`] answers as the guest would; anything else runs
    /// with `/bin/sh -c` in the guest's directory, for at most [`COMMAND_TIMEOUT`], its
    /// standard output and error streamed as they come.
    fn start(&self, line: &str) -> Running {
        let (tx, output) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
        let (kill, killed) = tokio::sync::oneshot::channel::<()>();
        if let Some(answer) = self.builtin(line) {
            tokio::spawn(async move {
                let _ = tx.send(answer.into_bytes()).await;
            });
            return Running {
                output,
                kill: Some(kill),
            };
        }
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(line)
            .current_dir(&self.dir)
            .env("HOME", self.dir.join("root"))
            .env("HOSTNAME", &self.hostname)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        tokio::spawn(async move {
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send(format!("sh: {e}\n").into_bytes()).await;
                    return;
                }
            };
            let out = child.stdout.take().map(|o| forward(o, tx.clone()));
            let err = child.stderr.take().map(|e| forward(e, tx.clone()));
            // The shell and whatever it started: its own process group.
            let group = child
                .id()
                .and_then(|id| i32::try_from(id).ok())
                .and_then(rustix::process::Pid::from_raw);
            let kill_group = || {
                if let Some(g) = group {
                    let _ = rustix::process::kill_process_group(g, rustix::process::Signal::KILL);
                }
            };
            tokio::select! {
                _ = child.wait() => {}
                _ = killed => {
                    kill_group();
                    let _ = child.wait().await;
                    return;
                }
                () = tokio::time::sleep(COMMAND_TIMEOUT) => {
                    kill_group();
                    let _ = child.wait().await;
                    let _ = tx.send(b"\n[timed out]\n".to_vec()).await;
                }
            }
            for t in [out, err].into_iter().flatten() {
                let _ = t.await;
            }
        });
        Running {
            output,
            kill: Some(kill),
        }
    }
}

/// Sends what `from` yields, in chunks, until it ends or nobody listens.
fn forward(
    mut from: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    to: tokio::sync::mpsc::Sender<Vec<u8>>,
) -> tokio::task::JoinHandle<()> {
    use tokio::io::AsyncReadExt as _;
    tokio::spawn(async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if to.send(buf[..n].to_vec()).await.is_err() {
                        return;
                    }
                }
            }
        }
    })
}

/// The common name of a DER certificate's subject, if it has one.
pub(crate) fn common_name(der: &[u8]) -> Option<String> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version?, serialNumber,
    // signature, issuer, validity, subject, … } … }
    let (_, cert, _) = der_item(der)?;
    let (_, tbs, _) = der_item(cert)?;
    let mut rest = tbs;
    let (tag, _, after) = der_item(rest)?;
    if tag == 0xa0 {
        rest = after;
    }
    // serialNumber, signature, issuer, validity
    for _ in 0..4 {
        let (_, _, after) = der_item(rest)?;
        rest = after;
    }
    let (_, subject, _) = der_item(rest)?;
    let mut rdns = subject;
    while !rdns.is_empty() {
        let (_, set, after) = der_item(rdns)?;
        rdns = after;
        let mut atvs = set;
        while !atvs.is_empty() {
            let (_, atv, after) = der_item(atvs)?;
            atvs = after;
            let (tag, oid, value) = der_item(atv)?;
            if tag == 0x06 && oid == [0x55, 0x04, 0x03] {
                let (_, v, _) = der_item(value)?;
                return String::from_utf8(v.to_vec()).ok();
            }
        }
    }
    None
}

/// One DER item: (tag, contents, what follows).
fn der_item(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let tag = *b.first()?;
    let first = *b.get(1)?;
    let (len, start) = if first & 0x80 == 0 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for i in 0..n {
            len = (len << 8) | usize::from(*b.get(2 + i)?);
        }
        (len, 2 + n)
    };
    let end = start.checked_add(len)?;
    if end > b.len() {
        return None;
    }
    Some((tag, &b[start..end], &b[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything a started line prints, until it ends.
    async fn output_of(mut r: Running) -> String {
        let mut all = Vec::new();
        while let Some(chunk) = r.output.recv().await {
            all.extend(chunk);
        }
        String::from_utf8_lossy(&all).into_owned()
    }

    #[tokio::test]
    async fn the_terminal_echoes_edits_and_runs_lines() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Terminal::new("lab".into(), dir.path().to_path_buf());
        assert_eq!(t.greeting(), b"\r\nroot@lab:~# ");
        t.boot = true;
        let first = String::from_utf8(t.greeting()).unwrap();
        assert!(
            first.contains("\r\nlab login: root (automatic login)\r\n"),
            "{first:?}"
        );
        assert!(first.ends_with("\r\n\r\nroot@lab:~# "), "{first:?}");
        let (outs, line) = t.input(b"echo hix\x7f\r");
        let text = String::from_utf8_lossy(&outs.concat()).into_owned();
        assert!(text.contains("\x08 \x08"), "{text:?}");
        assert_eq!(line.as_deref(), Some("echo hi"));
        assert_eq!(output_of(t.start("echo hi")).await, "hi\n");
        assert_eq!(output_of(t.start("hostname")).await, "lab\n");
        assert_eq!(output_of(t.start("whoami")).await, "root\n");
        // The serial line's size is what the guest's agent wrote, 24 80 until it does.
        assert_eq!(output_of(t.start("stty size")).await, "24 80\n");
        std::fs::create_dir_all(dir.path().join("dev")).unwrap();
        std::fs::write(dir.path().join("dev/ttyS0"), "43 132\n").unwrap();
        assert_eq!(output_of(t.start("stty  size")).await, "43 132\n");
        let (outs, line) = t.input(b"abc\x03");
        assert!(String::from_utf8_lossy(&outs.concat()).contains("^C"));
        assert!(line.is_none() && t.line.is_empty());
        let (outs, line) = t.input(b"\r");
        assert_eq!(outs.concat(), b"\r\nroot@lab:~# ");
        assert!(line.is_none());
    }

    #[tokio::test]
    async fn ctrl_c_interrupts_a_command_that_does_not_end() {
        let dir = tempfile::tempdir().unwrap();
        let t = Terminal::new("lab".into(), dir.path().to_path_buf());
        let mut r = t.start("yes");
        let mut got = 0usize;
        while got < 1 << 20 {
            got += r.output.recv().await.expect("output while it runs").len();
        }
        let outs = r.input(b"\x03", &t).await;
        assert_eq!(outs.concat(), b"^C\r\nroot@lab:~# ");
        assert!(r.interrupted());
        // The output ends once the command is killed.
        let drained = tokio::time::timeout(Duration::from_secs(10), async {
            while r.output.recv().await.is_some() {}
        })
        .await;
        assert!(drained.is_ok(), "yes went on after Ctrl-C");
    }

    #[test]
    fn a_certificate_without_the_right_shape_has_no_name() {
        assert_eq!(common_name(b""), None);
        assert_eq!(common_name(&[0x30, 0x82, 0xff]), None);
        assert_eq!(common_name(&[0x30, 0x00]), None);
    }
}
