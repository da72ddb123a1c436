//! The background tasks' Prometheus metrics, labelled by [`TaskName`].
//!
//! | metric (under the registry's prefix) | meaning |
//! |---|---|
//! | `task_activations_total{task}` | activations begun |
//! | `task_failures_total{task}` | activations that failed (an error or a panic) |
//! | `task_last_duration_seconds{task}` | how long the last activation that ended took |
//! | `task_last_success_timestamp_seconds{task}` | Unix time of the last success |

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::TaskName;

/// The label set of every task metric.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TaskLabels {
    /// The task.
    pub task: TaskName,
}

/// The task metrics of one process. Cheap to clone (shared handles).
#[derive(Debug, Clone, Default)]
pub struct TaskMetrics {
    activations: Family<TaskLabels, Counter>,
    failures: Family<TaskLabels, Counter>,
    last_duration: Family<TaskLabels, Gauge<f64, AtomicU64>>,
    last_success: Family<TaskLabels, Gauge<f64, AtomicU64>>,
}

impl TaskMetrics {
    /// Fresh metrics, in no registry yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers them in `registry` (`task_activations` and so on, under its prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "task_activations",
            "Activations of each background task",
            self.activations.clone(),
        );
        registry.register(
            "task_failures",
            "Activations of each background task that failed (an error or a panic)",
            self.failures.clone(),
        );
        registry.register(
            "task_last_duration_seconds",
            "How long the last activation of each background task took",
            self.last_duration.clone(),
        );
        registry.register(
            "task_last_success_timestamp_seconds",
            "Unix time of each background task's last success",
            self.last_success.clone(),
        );
    }

    /// Makes the task's series exist (at 0) before its first activation.
    pub(crate) fn touch(&self, task: TaskName) {
        let _ = self.activations(task);
        let _ = self.failures(task);
    }

    pub(crate) fn activations(&self, task: TaskName) -> Counter {
        self.activations.get_or_create(&TaskLabels { task }).clone()
    }

    pub(crate) fn failures(&self, task: TaskName) -> Counter {
        self.failures.get_or_create(&TaskLabels { task }).clone()
    }

    pub(crate) fn last_duration(&self, task: TaskName) -> Gauge<f64, AtomicU64> {
        self.last_duration
            .get_or_create(&TaskLabels { task })
            .clone()
    }

    pub(crate) fn last_success(&self, task: TaskName) -> Gauge<f64, AtomicU64> {
        self.last_success
            .get_or_create(&TaskLabels { task })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Reason, TaskRecord};

    #[test]
    fn each_task_is_a_series_of_its_own_under_the_registrys_prefix() {
        let metrics = TaskMetrics::new();
        let mut registry = Registry::with_prefix("ttlab");
        metrics.register(&mut registry);
        // Registered and never activated: its series are there, at 0.
        let _hub = TaskRecord::new(TaskName::new("hub"), "listens", None, &metrics);
        let probe = TaskRecord::new(TaskName::new("cluster_probe"), "probes", None, &metrics);
        for _ in 0..3 {
            let began = probe.began(Reason::Period);
            probe.ended(began, Ok(()));
        }
        let began = probe.began(Reason::Period);
        probe.ended(began, Err("no answer"));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "ttlab_task_activations_total{task=\"cluster_probe\"} 4",
            "ttlab_task_failures_total{task=\"cluster_probe\"} 1",
            "ttlab_task_activations_total{task=\"hub\"} 0",
            "ttlab_task_failures_total{task=\"hub\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        assert!(
            text.contains("ttlab_task_last_duration_seconds{task=\"cluster_probe\"}"),
            "{text}"
        );
        assert!(
            text.contains("ttlab_task_last_success_timestamp_seconds{task=\"cluster_probe\"}"),
            "{text}"
        );
    }
}
