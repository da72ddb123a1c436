//! The ttlab server as a library: the HTTP API (students and admins), authentication, and
//! the provisioning saga that turns "Start lab" into a running, graded VM (steps ① to ⑧ of
//! the operators' write-up), plus finishing a session.
//!
//! It owns composition: which routes exist and what they answer ([`routes`]), who may call
//! them ([`auth`], over the token format of `ttlab-auth`), the order of provisioning and what a failure leaves behind ([`saga`]).
//! It refuses to own anything below: SQL is `ttlab-store`'s, Kubernetes calls are
//! `ttlab-cluster`'s, expiry maths is `ttlab-lifespan`'s (always fed the database clock),
//! manifests and cloud-init are rendered by their own crates, and expired sessions are the
//! reaper's. The binary `ttlab-server` only parses settings and calls [`Server::bind`].
//!
//! Errors are JSON `{"error": code, "message": sentence}` with the right status
//! ([`ApiError`]); bad input is a 4xx, never a 5xx or a panic.
//!
//! ```
//! use std::time::Duration;
//! use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
//! use ttlab_api::{ApiError, CapacityUse};
//!
//! // Secrets shorter than 32 bytes are refused at start-up.
//! assert!(matches!(AuthSecret::new("short").map_err(ApiError::from), Err(ApiError::Config(_))));
//!
//! let auth = AuthConfig::new(AuthSecret::new(vec![42u8; 32]).unwrap());
//! let alice = "alice".parse().unwrap();
//! let token = auth.mint(&alice, Role::Student, 1_900_000_000, Duration::from_secs(3600)).unwrap();
//! // Valid until 2030: verifies now.
//! assert_eq!(auth.verify(&token).unwrap().user, alice);
//! assert!(auth.verify("not.a.token").is_err());
//!
//! let capacity = ApiError::Capacity {
//!     limit: 8,
//!     needed: 1,
//!     usage: CapacityUse { labs: 6, shutting_down: 2, without_lab: 0 },
//! };
//! assert_eq!(
//!     capacity.to_string(),
//!     "No VM capacity right now: 6 of 8 VMs are in use by open labs, plus 2 VMs still shutting \
//!      down. Try again in a few minutes."
//! );
//! ```
//!
//! Running it (as `ttlabctl demo` does):
//!
//! ```no_run
//! # async fn run(config: ttlab_api::ApiConfig, store: ttlab_store::Store,
//! #              cluster: std::sync::Arc<dyn ttlab_cluster::Cluster>) -> Result<(), ttlab_api::ApiError> {
//! let server = ttlab_api::Server::bind(config, store, cluster).await?;
//! println!("listening on {}", server.local_addr());
//! server.run(async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

mod agent_route;
pub mod auth;
mod classes;
mod config;
pub mod console;
mod error;
pub mod extract;
pub mod limits;
pub mod metrics;
mod pool;
pub mod routes;
pub mod saga;
pub mod sites;
mod state;
pub mod tasks;
pub mod view;
pub mod web;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use ttlab_cluster::Cluster;
use ttlab_store::Store;

pub use config::{
    AgentPath, ApiConfig, DEFAULT_COLLECT_TIMEOUT, DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_QUOTA_SETTLE_WAIT, DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_VM_LIMIT, agent_path_setting,
};
pub use error::{ApiError, CapacityUse, ErrorBody};
pub use state::{AppState, ClusterHealth, DatabaseHealth, HubEvent};

/// The longest [`Server::bind`] waits for the first check of the database (and, when it
/// answers, the start-up's clean-up) before it returns.
pub const STARTUP_CHECK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A bound, not yet serving, server: the public port, and the ops port if one is configured.
pub struct Server {
    state: AppState,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    ops: Option<(tokio::net::TcpListener, SocketAddr)>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .field("ops_addr", &self.ops_addr())
            .finish()
    }
}

impl Server {
    /// Validates the configuration, binds `config.listen` and `config.ops_listen` (port 0
    /// picks one) and starts the background tasks ([`tasks`]: the database check, the cluster
    /// probe, the notification hub, the waitlist, the pool refiller). Neither the database
    /// nor the cluster has to answer: at the database's first answer the `database` task
    /// migrates the schema (with [`ApiConfig::migrate`]; otherwise the database must be
    /// migrated), cleans up sessions a previous run left half-provisioned
    /// ([`saga::recover`]; a failure there is logged, not fatal, since the reaper also cleans
    /// up) and starts the adoption of abandoned sessions. Until then `/readyz` says why not,
    /// and requests that need the database are answered 503 with `Retry-After`. Returns once
    /// that first check ended (answered or not) or after [`STARTUP_CHECK_WAIT`].
    pub async fn bind(
        config: ApiConfig,
        store: Store,
        cluster: Arc<dyn Cluster>,
    ) -> Result<Self, ApiError> {
        if config.vm_limit == 0 {
            return Err(ApiError::Config("TTLAB_VM_LIMIT must be at least 1".into()));
        }
        let state = AppState::new(config, store, cluster);
        Self::bind_state(state).await
    }

    /// [`Server::bind`] with these sites (the sites file's, each with its client or why none
    /// could be built) instead of one cluster: sessions are placed among them, and each
    /// session's later steps go to its own site.
    pub async fn bind_sites(
        config: ApiConfig,
        store: Store,
        sites: Vec<sites::SiteRuntime>,
    ) -> Result<Self, ApiError> {
        if sites.is_empty() {
            return Err(ApiError::Config("no site is configured".into()));
        }
        let state = AppState::with_sites(config, store, sites);
        Self::bind_state(state).await
    }

    async fn bind_state(state: AppState) -> Result<Self, ApiError> {
        let config = state.config();
        config
            .policy
            .validate()
            .map_err(|e| ApiError::Config(e.to_string()))?;
        if config.lessons.is_empty() {
            return Err(ApiError::Config(
                "no lessons are configured (TTLAB_LESSONS)".into(),
            ));
        }
        if config.request_timeout.is_zero() {
            return Err(ApiError::Config(
                "TTLAB_REQUEST_TIMEOUT must be more than zero".into(),
            ));
        }
        if config.max_concurrent_requests == 0 {
            return Err(ApiError::Config(
                "TTLAB_MAX_CONCURRENT_REQUESTS must be at least 1".into(),
            ));
        }
        // A lesson no site can run is refused at each start (503 `no_site`); said once here.
        for lesson in config.lessons.iter() {
            if let Some(why) = saga::no_site_carries(&state, &lesson.site_labels) {
                tracing::warn!(lesson = %lesson.id, %why, "no site can run this lesson");
            }
        }
        let (listener, addr) = bind(config.listen).await?;
        let ops = match config.ops_listen {
            Some(at) => Some(bind(at).await?),
            None => None,
        };
        tasks::start(&state)?;
        state.database_checked(STARTUP_CHECK_WAIT).await;
        if let Some(why) = state.database_health().not_ready() {
            tracing::warn!(reason = %why, "not ready: serving, and waiting for the database");
        }
        Ok(Self {
            state,
            listener,
            addr,
            ops,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound ops address (health, readiness, metrics), if one was configured.
    pub fn ops_addr(&self) -> Option<SocketAddr> {
        self.ops.as_ref().map(|(_, addr)| *addr)
    }

    /// The shared state (for tests and composition).
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `shutdown` completes, then stops accepting, finishes open requests, stops
    /// the background tasks (an activation in progress gets [`tasks::SHUTDOWN_GRACE`]) and
    /// the provisioning tasks (provisioning in progress is resumed or cleaned up by the next
    /// start).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ApiError> {
        use futures::FutureExt as _;
        let shutdown = shutdown.shared();
        let app =
            routes::router(self.state.clone()).into_make_service_with_connect_info::<SocketAddr>();
        let public = axum::serve(self.listener, app)
            .with_graceful_shutdown(shutdown.clone())
            .into_future();
        let result = match self.ops {
            Some((listener, _)) => {
                let ops = axum::serve(listener, routes::ops_router(self.state.clone()))
                    .with_graceful_shutdown(shutdown)
                    .into_future();
                let (public, ops) = tokio::join!(public, ops);
                public.and(ops)
            }
            None => public.await,
        }
        .map_err(|e| ApiError::Internal(format!("serving: {e}")));
        self.state.background().shutdown().await;
        self.state.abort_tasks();
        result
    }
}

/// Binds `addr`, and says which address it got.
async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), ApiError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ApiError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| ApiError::Bind { addr, source })?;
    Ok((listener, bound))
}

/// Binds and serves until `shutdown` completes: [`Server::bind`] then [`Server::run`].
pub async fn serve(
    config: ApiConfig,
    store: Store,
    cluster: Arc<dyn Cluster>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ApiError> {
    Server::bind(config, store, cluster)
        .await?
        .run(shutdown)
        .await
}
