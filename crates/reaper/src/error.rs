//! The reaper's one error type.

use ttlab_cluster::ClusterError;
use ttlab_store::StoreError;

/// Why the reaper could not do something as a whole (a single item's failure is never an
/// error: it is counted in the [`CycleReport`](crate::CycleReport)).
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    /// The database could not be reached or answered with an error.
    #[error("database: {0}")]
    Store(#[from] StoreError),
    /// The cluster could not be reached or answered with an error.
    #[error("cluster: {0}")]
    Cluster(#[from] ClusterError),
    /// A setting is out of range.
    #[error("invalid setting: {0}")]
    Setting(String),
    /// The metrics listener could not be bound or served.
    #[error("metrics endpoint on {addr}: {source}")]
    Metrics {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A short, stable name for the kind of a cluster error, for logs and metrics.
pub fn cluster_error_kind(e: &ClusterError) -> &'static str {
    match e {
        ClusterError::NotFound { .. } => "not_found",
        ClusterError::Forbidden { .. } => "forbidden",
        ClusterError::Conflict { .. } => "conflict",
        ClusterError::QuotaExceeded { .. } => "quota_exceeded",
        ClusterError::QuotaPending { .. } => "quota_pending",
        ClusterError::Invalid { .. } => "invalid",
        ClusterError::ConsoleNotReady { .. } => "console_not_ready",
        ClusterError::PortUnreachable { .. } => "port_unreachable",
        ClusterError::Transient { .. } => "transient",
        ClusterError::WaitTimedOut { .. } => "wait_timed_out",
        ClusterError::VmiEnded { .. } => "vmi_ended",
        ClusterError::Unexpected { .. } => "unexpected",
        ClusterError::Config { .. } => "config",
    }
}

/// A short, stable name for the kind of a store error, for logs and metrics.
pub fn store_error_kind(e: &StoreError) -> &'static str {
    match e {
        StoreError::Connect { .. } => "connect",
        StoreError::Query { .. } => "query",
        StoreError::Corrupt { .. } => "corrupt",
        StoreError::Conflict { .. } => "conflict",
        StoreError::Timeout { .. } => "timeout",
        _ => "other",
    }
}
