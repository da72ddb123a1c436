//! The state every route shares, and the hub that turns Postgres notifications into an
//! in-process broadcast for event streams.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::FromRef;
use tokio::sync::broadcast;
use tokio::task::JoinSet;
use ttlab_cluster::Cluster;
use ttlab_store::{Channel, Store};

use crate::ApiConfig;
use crate::auth::AuthConfig;
use crate::metrics::Metrics;

/// A listing of the namespace's VMs and when it was taken.
pub(crate) type ListedVms = (tokio::time::Instant, Arc<Vec<crate::saga::ListedVm>>);

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
    tasks: Mutex<JoinSet<()>>,
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
        Self {
            inner: Arc::new(Inner {
                config,
                store,
                cluster,
                metrics: Metrics::new(),
                hub,
                capacity: tokio::sync::Mutex::new(()),
                listed_vms: tokio::sync::Mutex::new(None),
                tasks: Mutex::new(JoinSet::new()),
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

    /// The last listing of the namespace's VMs the capacity check took (see
    /// `saga::open::count_vms`), shared by the requests of this process.
    pub(crate) fn listed_vms(&self) -> &tokio::sync::Mutex<Option<ListedVms>> {
        &self.inner.listed_vms
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

impl FromRef<AppState> for AuthConfig {
    fn from_ref(state: &AppState) -> Self {
        state.inner.config.auth.clone()
    }
}
