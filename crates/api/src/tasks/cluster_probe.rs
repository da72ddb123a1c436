//! `cluster_probe`: every [`CLUSTER_PROBE_INTERVAL`], one page of ttlab's VMs is listed on
//! every site within [`CLUSTER_PROBE_TIMEOUT`], and what it found is recorded per site (a
//! site that fails it takes no new start until a probe answers again), for `/healthz/cluster` and the
//! `ttlab_cluster_reachable` and `ttlab_cluster_probe_seconds` gauges (by `site`). A probe that fails is
//! the task's failure, so its error is also the task's last error.

use std::time::Duration;

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};

use crate::AppState;
use crate::sites::SiteRuntime;

/// How often the cluster is probed for `/healthz/cluster` and `ttlab_cluster_reachable`.
pub const CLUSTER_PROBE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a probe may take before the cluster counts as unreachable.
pub const CLUSTER_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The task's name.
pub const NAME: TaskName = TaskName::new("cluster_probe");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Lists one page of ttlab's VMs every 10 s (5 s budget) and records whether the \
         Kubernetes API answered, for /healthz/cluster and ttlab_cluster_reachable",
        Schedule::every(CLUSTER_PROBE_INTERVAL),
    )
}

pub(super) struct ClusterProbe {
    pub(super) state: AppState,
}

impl BackgroundTask for ClusterProbe {
    async fn activate(&mut self, _cx: &Activation) -> Result<(), Failure> {
        let state = &self.state;
        let several = state.sites().len() > 1;
        let probes = state.sites().iter().map(|site| probe(site));
        let errors = futures::future::join_all(probes).await;
        for (site, (took, error)) in state.sites().iter().zip(&errors) {
            state
                .metrics()
                .set_probe(site.name().as_str(), error.is_none(), *took);
        }
        let failed: Vec<String> = state
            .sites()
            .iter()
            .zip(&errors)
            .filter_map(|(site, (_, error))| {
                let e = error.as_ref()?;
                Some(if several {
                    format!("site {}: {e}", site.name())
                } else {
                    e.clone()
                })
            })
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(Failure::new(format!(
                "the Kubernetes API does not answer the probe: {}",
                failed.join("; ")
            )))
        }
    }
}

/// Probes one site and records what it found; how long it took, and why it failed.
async fn probe(site: &SiteRuntime) -> (Duration, Option<String>) {
    let selector = ttlab_model::labels::managed_selector();
    let started = tokio::time::Instant::now();
    let answer = tokio::time::timeout(
        CLUSTER_PROBE_TIMEOUT,
        site.cluster()
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
    site.update_health(|health| {
        if error.is_some() {
            health.consecutive_failures = health.consecutive_failures.saturating_add(1);
        } else {
            health.consecutive_failures = 0;
        }
        health.reachable = Some(error.is_none());
        health.checked_at = Some(chrono::Utc::now());
        health.latency_ms = Some(u64::try_from(took.as_millis()).unwrap_or(u64::MAX));
        health.error.clone_from(&error);
    });
    (took, error)
}
