//! The state every route shares: configuration, database, the sites (each with its cluster
//! client), metrics, the in-process broadcast of change hints (fed by the `hub` task) and the
//! tasks of this process.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::FromRef;
use tokio::sync::broadcast;
use tokio::task::JoinSet;
use ttlab_background::Driver;
use ttlab_cluster::Cluster;
use ttlab_model::{SiteName, UserId};
use ttlab_store::Store;

use crate::auth::AuthConfig;
use crate::limits::{Action, UserLimiter};
use crate::metrics::{ActionLabels, Metrics};
use crate::sites::SiteRuntime;
use crate::{ApiConfig, ApiError};

/// A listing of the namespace's VMs (or why it could not be taken) and when it was taken.
/// A failure is kept too, so the requests behind a slow or failing cluster get the answer
/// at once instead of each waiting out the listing's timeout in turn.
pub(crate) type ListedVms = (
    tokio::time::Instant,
    Result<Arc<Vec<crate::saga::ListedVm>>, String>,
);

/// What the last probe of the Kubernetes API found (`tasks::cluster_probe`). Reported (`/healthz/cluster`, the
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

impl ClusterHealth {
    /// The health of several sites as one: reachable only when every site's last probe
    /// answered (`None` while one is unprobed and none failed), the oldest check, the
    /// slowest answer, each failing site's error (prefixed `site NAME: ` when there are
    /// several) and the most probes failed in a row. One site's is its own.
    pub fn over(sites: &[(&SiteName, ClusterHealth)]) -> ClusterHealth {
        if let [(_, only)] = sites {
            return only.clone();
        }
        let reachable = if sites.iter().any(|(_, h)| h.reachable == Some(false)) {
            Some(false)
        } else if sites.iter().all(|(_, h)| h.reachable == Some(true)) {
            Some(true)
        } else {
            None
        };
        let errors: Vec<String> = sites
            .iter()
            .filter_map(|(name, h)| Some(format!("site {name}: {}", h.error.as_ref()?)))
            .collect();
        ClusterHealth {
            reachable,
            checked_at: if sites.iter().all(|(_, h)| h.checked_at.is_some()) {
                sites.iter().filter_map(|(_, h)| h.checked_at).min()
            } else {
                None
            },
            latency_ms: sites.iter().filter_map(|(_, h)| h.latency_ms).max(),
            error: (!errors.is_empty()).then(|| errors.join("; ")),
            consecutive_failures: sites
                .iter()
                .map(|(_, h)| h.consecutive_failures)
                .max()
                .unwrap_or(0),
        }
    }
}

/// What the server knows of its database (`tasks::database`): whether it is ready for the
/// requests that need it, and if not, since when and why not. `/readyz` serves it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct DatabaseHealth {
    /// The database answered and the schema is at this build's version (migrated by this
    /// server when it migrates), and the start-up's clean-up ran: requests that need the
    /// database are served. Stays true once set; an outage after that is seen per request.
    pub prepared: bool,
    /// Whether the last check answered. `None` before the first check ended.
    pub reachable: Option<bool>,
    /// When the last check ended.
    pub checked_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Since when the checks have failed (`None` while the database answers).
    pub unreachable_since: Option<chrono::DateTime<chrono::Utc>>,
    /// Why the last check failed.
    pub last_error: Option<String>,
}

impl DatabaseHealth {
    /// Records a check that ended at `now`: answered, or failed with the error.
    pub(crate) fn record(&mut self, now: chrono::DateTime<chrono::Utc>, answer: Result<(), &str>) {
        self.checked_at = Some(now);
        match answer {
            Ok(()) => {
                self.reachable = Some(true);
                self.unreachable_since = None;
                self.last_error = None;
            }
            Err(e) => {
                if self.reachable != Some(false) {
                    self.unreachable_since = Some(now);
                }
                self.reachable = Some(false);
                self.last_error = Some(e.to_owned());
            }
        }
    }

    /// Why the server is not ready for requests that need the database, in one sentence;
    /// `None` when it is ready.
    pub fn not_ready(&self) -> Option<String> {
        let since = self
            .unreachable_since
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
        match (self.prepared, self.reachable, since, &self.last_error) {
            (true, _, _, _) => None,
            (false, None, _, _) => {
                Some("the database has not been checked yet (the server is starting)".to_owned())
            }
            (false, Some(false), Some(since), Some(error)) => Some(format!(
                "the database has been unreachable since {since} (the server keeps trying): {error}"
            )),
            (false, _, _, Some(error)) => Some(format!(
                "the database is not ready yet (the server keeps trying): {error}"
            )),
            (false, _, _, None) => Some(
                "the server is starting: the database answered, and the server is preparing on \
                 it (the schema, what a previous run left)"
                    .to_owned(),
            ),
        }
    }
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
    /// The sites, in the sites file's order (one, `default`, without it).
    sites: Vec<Arc<SiteRuntime>>,
    metrics: Metrics,
    hub: broadcast::Sender<HubEvent>,
    database: tokio::sync::watch::Sender<DatabaseHealth>,
    limiter: UserLimiter,
    tasks: Mutex<JoinSet<()>>,
    /// The long-lived loops ([`crate::tasks`]).
    background: Driver,
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
    /// Builds the state of a server with one site, `config.site`, on `cluster` (its namespace
    /// the client's, `config.vm_limit` places, `config.agent_path`), with no background task
    /// running yet ([`crate::tasks`] starts them).
    pub fn new(config: ApiConfig, store: Store, cluster: Arc<dyn Cluster>) -> Self {
        let site = single_site(&config, cluster.namespace());
        let sites = vec![SiteRuntime::connected(site, cluster)];
        Self::with_sites(config, store, sites)
    }

    /// Builds the state of a server with these sites (at least one; `config.vm_limit`,
    /// `config.agent_path` and `config.site` are then not used), with no background task
    /// running yet.
    pub fn with_sites(config: ApiConfig, store: Store, sites: Vec<SiteRuntime>) -> Self {
        let (hub, _) = broadcast::channel(256);
        let limiter = UserLimiter::new(config.user_rate_limit);
        let metrics = Metrics::new();
        for site in &sites {
            metrics.add_site(site.name().as_str(), site.vm_limit());
        }
        let background = crate::tasks::driver(&metrics);
        Self {
            inner: Arc::new(Inner {
                config,
                store,
                sites: sites.into_iter().map(Arc::new).collect(),
                metrics,
                hub,
                database: tokio::sync::watch::channel(DatabaseHealth::default()).0,
                limiter,
                tasks: Mutex::new(JoinSet::new()),
                background,
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

    /// The sites, in configuration order.
    pub fn sites(&self) -> &[Arc<SiteRuntime>] {
        &self.inner.sites
    }

    /// The first site of the sites file (the only one without it): its probe is the server's
    /// `/healthz/cluster`.
    pub fn first_site(&self) -> &Arc<SiteRuntime> {
        self.inner
            .sites
            .first()
            .unwrap_or_else(|| unreachable!("a server has at least one site"))
    }

    /// The first site, in configuration order, that carries every label `lesson` requires
    /// (where its pool is planned when no such site has room for a member); `None` when none
    /// does.
    pub fn pool_site(&self, lesson: &ttlab_lesson::Lesson) -> Option<&Arc<SiteRuntime>> {
        self.inner
            .sites
            .iter()
            .find(|s| lesson.site_labels.is_subset(&s.site().labels))
    }

    /// The site `name` (a session row's): the configured one, or, for a site this server is
    /// not configured with, one whose every cluster call fails saying so (the session's
    /// objects are then left to whoever is configured with it).
    pub fn site_of(&self, name: &SiteName) -> Arc<SiteRuntime> {
        self.inner
            .sites
            .iter()
            .find(|s| s.name() == name)
            .cloned()
            .unwrap_or_else(|| Arc::new(SiteRuntime::missing(name)))
    }

    /// The site of a session for a request that needs its cluster now (console, grading):
    /// 503 `site_unavailable` when this server is not configured with it, or, with several
    /// sites, its last probe did not reach it (the one site of a server without a sites file
    /// is always tried, as it always was).
    pub(crate) fn usable_site(&self, name: &SiteName) -> Result<Arc<SiteRuntime>, ApiError> {
        let site = self.site_of(name);
        if !site.is_configured() {
            return Err(ApiError::SiteUnavailable {
                site: name.clone(),
                reason: "this server is not configured with it".to_owned(),
            });
        }
        if self.inner.sites.len() == 1 && site.has_client() {
            return Ok(site);
        }
        match site.reachability() {
            ttlab_site::Reachability::Reachable => Ok(site),
            ttlab_site::Reachability::Unreachable(reason) => Err(ApiError::SiteUnavailable {
                site: name.clone(),
                reason,
            }),
        }
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Subscribes to change hints (for event streams).
    pub fn subscribe(&self) -> broadcast::Receiver<HubEvent> {
        self.inner.hub.subscribe()
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

    /// What the last probes found, over every site: reachable only when every site's last
    /// probe answered (unknown while one has not been probed yet and none failed), the
    /// oldest check, the slowest answer, each failing site's error (named by its site when
    /// there are several) and the most probes failed in a row. With one site, its own.
    pub fn cluster_health(&self) -> ClusterHealth {
        let healths: Vec<(&SiteName, ClusterHealth)> = self
            .sites()
            .iter()
            .map(|s| (s.name(), s.health()))
            .collect();
        ClusterHealth::over(&healths)
    }

    /// What the last probe of each site found, in the sites' order.
    pub fn site_healths(&self) -> Vec<(SiteName, ClusterHealth)> {
        self.sites()
            .iter()
            .map(|s| (s.name().clone(), s.health()))
            .collect()
    }

    /// What the server knows of its database (`tasks::database`).
    pub fn database_health(&self) -> DatabaseHealth {
        self.inner.database.borrow().clone()
    }

    /// Records what a check of the database found (see `tasks::database`).
    pub(crate) fn update_database_health(&self, update: impl FnOnce(&mut DatabaseHealth)) {
        self.inner.database.send_modify(update);
    }

    /// Resolves once the first check of the database ended, answered or not, or after
    /// `within`.
    pub(crate) async fn database_checked(&self, within: Duration) {
        let mut rx = self.inner.database.subscribe();
        let _ = tokio::time::timeout(within, rx.wait_for(|h| h.checked_at.is_some())).await;
    }

    /// Whether this server is handing over (SIGTERM): it takes no new starts.
    pub fn is_draining(&self) -> bool {
        self.inner.handover.draining()
    }

    pub(crate) fn handover(&self) -> &HandOver {
        &self.inner.handover
    }

    /// Runs `task` (a session's provisioning) in the background, tracked so
    /// [`AppState::abort_tasks`] can stop it.
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

    /// Stops every task at once (provisioning, and the background tasks: the hub, the
    /// probe, …), as a crash would: the sessions they were provisioning stay `starting` and are
    /// resumed by the next start.
    pub fn abort_tasks(&self) {
        self.inner.background.abort();
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .abort_all();
    }

    /// Tells this process's followers of the hub (event streams, the waitlist, the pools,
    /// the consoles) that sessions may have changed.
    pub(crate) fn hint(&self, event: HubEvent) {
        let _ = self.inner.hub.send(event);
    }

    /// The driver of this server's background tasks (see [`crate::tasks`]).
    pub fn background(&self) -> &Driver {
        &self.inner.background
    }
}

/// The one site of a server without a sites file, from its configuration.
fn single_site(config: &ApiConfig, namespace: &str) -> ttlab_site::Site {
    ttlab_site::Site {
        name: config.site.clone(),
        connection: ttlab_site::Connection::Inferred,
        namespace: namespace
            .parse()
            .unwrap_or_else(|_| "default".parse().unwrap_or_else(|_| unreachable!())),
        vm_limit: std::num::NonZeroU32::new(u32::try_from(config.vm_limit).unwrap_or(u32::MAX))
            .unwrap_or(std::num::NonZeroU32::MIN),
        labels: Default::default(),
        weight: std::num::NonZeroU32::MIN,
        agent_path: config.agent_path,
    }
}

impl FromRef<AppState> for AuthConfig {
    fn from_ref(state: &AppState) -> Self {
        state.inner.config.auth.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(reachable: Option<bool>, latency_ms: u64, error: Option<&str>) -> ClusterHealth {
        ClusterHealth {
            reachable,
            checked_at: reachable.map(|_| chrono::DateTime::UNIX_EPOCH),
            latency_ms: Some(latency_ms),
            error: error.map(str::to_owned),
            consecutive_failures: u32::from(error.is_some()) * 3,
        }
    }

    #[test]
    fn several_sites_are_reachable_only_when_each_is_and_name_the_one_that_is_not() {
        let (a, b): (SiteName, SiteName) = ("site-a".parse().unwrap(), "site-b".parse().unwrap());
        let up = ClusterHealth::over(&[
            (&a, health(Some(true), 4, None)),
            (&b, health(Some(true), 9, None)),
        ]);
        assert_eq!(up.reachable, Some(true));
        assert_eq!(up.latency_ms, Some(9));
        assert_eq!(up.error, None);

        let one_down = ClusterHealth::over(&[
            (&a, health(Some(true), 4, None)),
            (&b, health(Some(false), 5000, Some("no answer within 5 s"))),
        ]);
        assert_eq!(one_down.reachable, Some(false));
        assert_eq!(
            one_down.error.as_deref(),
            Some("site site-b: no answer within 5 s")
        );
        assert_eq!(one_down.consecutive_failures, 3);

        let unprobed = ClusterHealth::over(&[
            (&a, health(Some(true), 4, None)),
            (&b, ClusterHealth::default()),
        ]);
        assert_eq!(unprobed.reachable, None);
        assert_eq!(unprobed.checked_at, None);

        // One site's health is its own, its error not prefixed.
        let only = ClusterHealth::over(&[(&b, health(Some(false), 5000, Some("refused")))]);
        assert_eq!(only.error.as_deref(), Some("refused"));
    }
}
