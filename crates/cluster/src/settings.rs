//! Client-side settings of a [`KubeCluster`](crate::KubeCluster).

use std::time::Duration;

/// The `User-Agent` of a client whose program did not name itself: `ttlab/<version>`.
pub const DEFAULT_USER_AGENT: &str = concat!("ttlab/", env!("CARGO_PKG_VERSION"));

/// How a [`KubeCluster`](crate::KubeCluster) talks to the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSettings {
    /// The namespace of every object ttlab manages. `None`: the client's default (the
    /// kubeconfig context's namespace, or the service account's namespace in a pod).
    pub namespace: Option<String>,
    /// The most API calls in flight at once from this client (a semaphore around every
    /// call but the list and watch of a VMI or Pod wait, which kube-rs' watcher makes, one
    /// per session being provisioned). Default 16, so a reaper cycle cannot flood the API
    /// server. Values below 1 are treated as 1.
    pub max_in_flight: usize,
    /// Objects per page when listing (`limit`). Default 500, as kubectl uses.
    pub page_size: u32,
    /// How long one API call (not a watch, not a wait) may take before it counts as a
    /// transient failure. Default 30 s.
    pub request_timeout: Duration,
    /// The field manager named on writes. Default `ttlab`.
    pub field_manager: String,
    /// Whether answers of 429 Too Many Requests, 503 and 504 are retried inside the client
    /// (kube-rs' server-aware policy: exponential backoff from 5 ms, honouring
    /// `Retry-After`, as client-go does for API priority and fairness), within
    /// `request_timeout`. Default true. When false they surface at once as
    /// [`ClusterError::Transient`](crate::ClusterError::Transient). Applies to clients this
    /// crate builds (not to [`KubeCluster::new`](crate::KubeCluster::new)).
    pub retry_throttled: bool,
    /// How often an open VMI console is pinged (`None` or zero: never). A console from which
    /// no frame at all (pong or output) arrived for a whole interval after a ping is taken for
    /// dead: its output ends with [`ClusterError::Transient`](crate::ClusterError::Transient).
    /// Default 25 s.
    pub console_ping_interval: Option<Duration>,
    /// The `User-Agent` header of every request (the API server's audit log and its
    /// per-client metrics name callers by it), `program/version` as Kubernetes clients write
    /// it. The binaries name themselves (`ttlab-server/0.1.0`, `ttlab-reaper/0.1.0`); default
    /// [`DEFAULT_USER_AGENT`]. Applies to clients this crate builds (not to
    /// [`KubeCluster::new`](crate::KubeCluster::new)); a value that cannot be a header is a
    /// [`ClusterError::Config`](crate::ClusterError::Config).
    pub user_agent: String,
}

impl Default for ClusterSettings {
    fn default() -> Self {
        Self {
            namespace: None,
            max_in_flight: 16,
            page_size: 500,
            request_timeout: Duration::from_secs(30),
            field_manager: "ttlab".to_owned(),
            retry_throttled: true,
            console_ping_interval: Some(Duration::from_secs(25)),
            user_agent: DEFAULT_USER_AGENT.to_owned(),
        }
    }
}

impl ClusterSettings {
    /// The default settings in `namespace`.
    pub fn in_namespace(namespace: impl Into<String>) -> Self {
        Self {
            namespace: Some(namespace.into()),
            ..Self::default()
        }
    }
}
