//! The state every route shares, and the hub that turns Postgres notifications into an
//! in-process broadcast for event streams.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::FromRef;
use tokio::sync::broadcast;
use tokio::task::JoinSet;
use ttlab_cluster::Cluster;
use ttlab_model::UserId;
use ttlab_store::{Channel, Store};

use crate::auth::AuthConfig;
use crate::limits::{Action, UserLimiter};
use crate::metrics::{ActionLabels, Metrics};
use crate::{ApiConfig, ApiError};

/// A listing of the namespace's VMs (or why it could not be taken) and when it was taken.
/// A failure is kept too, so the requests behind a slow or failing cluster get the answer
/// at once instead of each waiting out the listing's timeout in turn.
pub(crate) type ListedVms = (
    tokio::time::Instant,
    Result<Arc<Vec<crate::saga::ListedVm>>, String>,
);

/// How often the cluster is probed for `/healthz/cluster` and `ttlab_cluster_reachable`.
pub const CLUSTER_PROBE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a probe may take before the cluster counts as unreachable.
pub const CLUSTER_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the last probe of the Kubernetes API found. Reported (`/healthz/cluster`, the
/// metrics), never used for readiness: a slow API server must not take every replica out of
/// service at once, when most requests need only the database.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ClusterHealth {
    /// Whether the last probe answered in time. `None` before the first probe ends.
    pub reachable: Option<bool>,
    /// When the last probe ended (server clock).
    pub checked_at: Option<chrono::DateTime<chrono::Utc>>,
    /// How long it took, in milliseconds.
    pub latency_ms: Option<u64>,
    /// Why it failed (for operators: this is only served on the ops port).
    pub error: Option<String>,
    /// Probes failed in a row.
    pub consecutive_failures: u32,
}

/// What the routes share: configuration, database, cluster, metrics, the notification hub
/// and the provisioning tasks. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    config: ApiConfig,
    store: Store,
    cluster: Arc<dyn Cluster>,
    metrics: Metrics,
    hub: broadcast::Sender<HubEvent>,
    capacity: tokio::sync::Mutex<()>,
    listed_vms: tokio::sync::Mutex<Option<ListedVms>>,
    /// When the agent's ConfigMap was last found present (see
    /// `saga::agent::ensure_agent_config_map`).
    agent_present_at: tokio::sync::Mutex<Option<tokio::time::Instant>>,
    cluster_health: Mutex<ClusterHealth>,
    limiter: UserLimiter,
    tasks: Mutex<JoinSet<()>>,
    handover: HandOver,
    /// The last plan of each pool by this replica's refiller (for the admin page).
    pool_plans: Mutex<std::collections::BTreeMap<ttlab_model::LessonId, PoolPlanSeen>>,
}

/// A pool's last plan, as the admin page shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct PoolPlanSeen {
    /// The size the pool is kept at.
    pub target: u32,
    /// Members the target wants but capacity does not allow now.
    pub deferred: u32,
    /// Why, in one line.
    pub why: String,
}

/// A graceful hand-over in progress (SIGTERM): new starts are refused, provisioning tasks let
/// go of their sessions (releasing their leases) for another replica — or this server after
/// its restart — to resume. See [`crate::saga::hand_over`].
#[derive(Debug)]
pub(crate) struct HandOver {
    /// Set once the hand-over began: new starts get 503 with `Retry-After`.
    stop: tokio::sync::watch::Sender<bool>,
    /// Provisioning tasks running in this process.
    running: tokio::sync::watch::Sender<usize>,
    /// Whether the background adoption of abandoned sessions was started.
    pub(crate) adopting: std::sync::atomic::AtomicBool,
}

/// Counts one provisioning task while it lives.
#[derive(Debug)]
pub(crate) struct Tracked(tokio::sync::watch::Sender<usize>);

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl HandOver {
    fn new() -> Self {
        Self {
            stop: tokio::sync::watch::channel(false).0,
            running: tokio::sync::watch::channel(0).0,
            adopting: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Begins the hand-over (idempotent).
    pub(crate) fn begin(&self) {
        self.stop.send_replace(true);
    }

    /// Whether the hand-over began.
    pub(crate) fn draining(&self) -> bool {
        *self.stop.borrow()
    }

    /// Resolves once the hand-over began.
    pub(crate) fn stopping(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }

    /// Counts a provisioning task until the returned value is dropped.
    pub(crate) fn track(&self) -> Tracked {
        self.running.send_modify(|n| *n += 1);
        Tracked(self.running.clone())
    }

    /// Waits until no provisioning task runs, at most `within`; whether none does.
    pub(crate) async fn idle(&self, within: Duration) -> bool {
        let mut rx = self.running.subscribe();
        tokio::time::timeout(within, rx.wait_for(|n| *n == 0))
            .await
            .is_ok()
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("config", &self.inner.config)
            .field("store", &self.inner.store)
            .finish_non_exhaustive()
    }
}

/// A hint from the hub that sessions may have changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HubEvent {
    /// A session of this environment changed (on any replica).
    Changed,
    /// The notification connection was re-established: anything may have changed.
    Resync,
}

impl AppState {
    /// Builds the state. Call [`AppState::start_hub`] inside a runtime to receive
    /// notifications.
    pub fn new(config: ApiConfig, store: Store, cluster: Arc<dyn Cluster>) -> Self {
        let (hub, _) = broadcast::channel(256);
        let limiter = UserLimiter::new(config.user_rate_limit);
        Self {
            inner: Arc::new(Inner {
                config,
                store,
                cluster,
                metrics: Metrics::new(),
                hub,
                capacity: tokio::sync::Mutex::new(()),
                listed_vms: tokio::sync::Mutex::new(None),
                agent_present_at: tokio::sync::Mutex::new(None),
                cluster_health: Mutex::new(ClusterHealth::default()),
                limiter,
                tasks: Mutex::new(JoinSet::new()),
                handover: HandOver::new(),
                pool_plans: Mutex::default(),
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ApiConfig {
        &self.inner.config
    }

    /// The database.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The cluster.
    pub fn cluster(&self) -> &Arc<dyn Cluster> {
        &self.inner.cluster
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Subscribes to change hints (for event streams).
    pub fn subscribe(&self) -> broadcast::Receiver<HubEvent> {
        self.inner.hub.subscribe()
    }

    /// Serialises the capacity check of this process, so at most one of its requests waits
    /// on the database's capacity lock at a time (the others wait here, not on a pooled
    /// connection).
    pub(crate) async fn capacity_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.inner.capacity.lock().await
    }

    /// Keeps a pool's last plan for the admin page.
    pub(crate) fn record_pool_plan(&self, lesson: &ttlab_model::LessonId, plan: &ttlab_pool::Plan) {
        let seen = PoolPlanSeen {
            target: plan.target,
            deferred: plan.deferred,
            why: plan.why.clone(),
        };
        self.inner
            .pool_plans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(lesson.clone(), seen);
    }

    /// A pool's last plan by this replica, if its refiller has looked at it.
    pub(crate) fn pool_plan(&self, lesson: &ttlab_model::LessonId) -> Option<PoolPlanSeen> {
        self.inner
            .pool_plans
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(lesson)
            .cloned()
    }

    /// When the agent's ConfigMap was last found present (see
    /// `saga::agent::ensure_agent_config_map`).
    pub(crate) fn agent_present_at(&self) -> &tokio::sync::Mutex<Option<tokio::time::Instant>> {
        &self.inner.agent_present_at
    }

    /// The last listing of the namespace's VMs the capacity check took (see
    /// `saga::open::count_vms`), shared by the requests of this process.
    pub(crate) fn listed_vms(&self) -> &tokio::sync::Mutex<Option<ListedVms>> {
        &self.inner.listed_vms
    }

    /// Admits one `action` of `user` under the per-user rate limit, or refuses it with 429.
    pub(crate) fn admit(&self, user: &UserId, action: Action) -> Result<(), ApiError> {
        self.inner
            .limiter
            .check(user, action, tokio::time::Instant::now())
            .map_err(|retry_after| {
                self.metrics()
                    .rate_limited
                    .get_or_create(&ActionLabels {
                        action: action.as_str().to_owned(),
                    })
                    .inc();
                tracing::info!(%user, action = action.as_str(), "rate limited");
                ApiError::RateLimited {
                    action: action.as_str(),
                    retry_after,
                }
            })
    }

    /// What the last cluster probe found.
    pub fn cluster_health(&self) -> ClusterHealth {
        self.inner
            .cluster_health
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Starts the task that probes the Kubernetes API every [`CLUSTER_PROBE_INTERVAL`] (one
    /// page of ttlab's VMs, within [`CLUSTER_PROBE_TIMEOUT`]) and records what it found.
    pub fn start_cluster_probe(&self) {
        let state = self.clone();
        self.spawn(async move {
            let selector = ttlab_model::labels::managed_selector();
            loop {
                let started = tokio::time::Instant::now();
                let answer = tokio::time::timeout(
                    CLUSTER_PROBE_TIMEOUT,
                    state
                        .cluster()
                        .list_page(ttlab_cluster::Kind::VirtualMachine, &selector, None),
                )
                .await;
                let took = started.elapsed();
                let error = match answer {
                    Ok(Ok(_)) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!(
                        "no answer within {} s",
                        CLUSTER_PROBE_TIMEOUT.as_secs()
                    )),
                };
                let metrics = state.metrics();
                metrics.cluster_probe_seconds.set(took.as_secs_f64());
                metrics
                    .cluster_reachable
                    .set(i64::from(error.is_none()));
                {
                    let mut health = state
                        .inner
                        .cluster_health
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if let Some(e) = &error {
                        if health.consecutive_failures == 0 {
                            tracing::warn!(error = %e, "the Kubernetes API does not answer the probe");
                        }
                        health.consecutive_failures = health.consecutive_failures.saturating_add(1);
                    } else {
                        if health.consecutive_failures > 0 {
                            tracing::info!("the Kubernetes API answers the probe again");
                        }
                        health.consecutive_failures = 0;
                    }
                    health.reachable = Some(error.is_none());
                    health.checked_at = Some(chrono::Utc::now());
                    health.latency_ms = Some(u64::try_from(took.as_millis()).unwrap_or(u64::MAX));
                    health.error = error;
                }
                tokio::time::sleep(CLUSTER_PROBE_INTERVAL.saturating_sub(took)).await;
            }
        });
    }

    /// Whether this server is handing over (SIGTERM): it takes no new starts.
    pub fn is_draining(&self) -> bool {
        self.inner.handover.draining()
    }

    pub(crate) fn handover(&self) -> &HandOver {
        &self.inner.handover
    }

    /// Runs `task` in the background, tracked so [`AppState::abort_tasks`] can stop it.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let mut tasks = self
            .inner
            .tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Reap finished tasks so the set does not grow without bound.
        while tasks.try_join_next().is_some() {}
        tasks.spawn(task);
    }

    /// Stops every background task at once (provisioning, the hub), as a crash would: the
    /// sessions they were provisioning stay `starting` and are resumed by the next start.
    pub fn abort_tasks(&self) {
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .abort_all();
    }

    /// Starts the task that listens on the sessions channel and broadcasts hints for this
    /// environment. It reconnects with backoff when the database goes away.
    pub fn start_hub(&self) {
        self.start_waitlist();
        let state = self.clone();
        self.spawn(async move {
            let env = state.config().env.as_str().to_owned();
            let mut pause = Duration::from_millis(100);
            loop {
                match state.store().listen(&[Channel::SessionsChanged]).await {
                    Ok(mut listener) => {
                        pause = Duration::from_millis(100);
                        let _ = state.inner.hub.send(HubEvent::Resync);
                        loop {
                            match listener.recv().await {
                                Ok(n) if n.payload == env => {
                                    let _ = state.inner.hub.send(HubEvent::Changed);
                                }
                                Ok(_) => {}
                                Err(e) => {
                                    tracing::warn!(error = %e, "notification connection lost");
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot listen for notifications yet");
                    }
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        });
    }
}

impl AppState {
    /// Starts the task that hands freed places to the waitlist: every
    /// [`WAITLIST_TICK`] and on every change hint (a session ended on any replica), while
    /// anybody waits, it grants holds ([`crate::saga::grant_waitlist`]). Every replica
    /// runs one; the capacity lock makes their grants take turns.
    fn start_waitlist(&self) {
        let state = self.clone();
        let mut rx = self.subscribe();
        self.spawn(async move {
            loop {
                if let Ok(Err(broadcast::error::RecvError::Closed)) =
                    tokio::time::timeout(WAITLIST_TICK, rx.recv()).await
                {
                    return;
                }
                match state.store().waitlist().any().await {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot read the waitlist");
                        continue;
                    }
                }
                match crate::saga::grant_waitlist(&state).await {
                    Ok(report) => {
                        let metrics = state.metrics();
                        metrics.waitlist_granted.inc_by(report.granted.len() as u64);
                        metrics.waitlist_lapsed.inc_by(report.lapsed.len() as u64);
                        for user in &report.granted {
                            tracing::info!(%user, "a place is held for the first on the waitlist");
                        }
                        for user in &report.lapsed {
                            tracing::info!(%user, "a waitlist hold lapsed");
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "cannot grant waitlist holds now"),
                }
            }
        });
    }
}

/// How often each replica looks for freed places while anybody waits.
pub const WAITLIST_TICK: Duration = Duration::from_secs(1);

impl FromRef<AppState> for AuthConfig {
    fn from_ref(state: &AppState) -> Self {
        state.inner.config.auth.clone()
    }
}
