//! Prometheus metrics of the server, with typed label sets.
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `ttlab_sessions` | `status` | live sessions of this environment now (read at scrape) |
//! | `ttlab_sessions_opened_total` | `lesson`, `runtime` | sessions accepted (202) |
//! | `ttlab_sessions_ended_total` | `status` | sessions this server ended (finished, failed) |
//! | `ttlab_stage_seconds` | `stage` | time from the request to each provisioning stage |
//! | `ttlab_capacity_rejections_total` | — | `POST /api/sessions` answered 503 `capacity` |
//! | `ttlab_disk_decisions_total` | `kind`, `reason` | root disk decisions |
//! | `ttlab_cluster_reachable` | — | 1 if the last cluster probe answered in time, else 0 |
//! | `ttlab_cluster_probe_seconds` | — | how long the last cluster probe took |
//! | `ttlab_rate_limited_total` | `action` | start, extend, grade answered 429 |
//! | `ttlab_requests_shed_total` | `reason` | requests answered 503 `overloaded` or `request_timeout` |
//! | `ttlab_waitlist_joined_total` | — | students put on the waitlist |
//! | `ttlab_waitlist_granted_total` | — | freed places held for the first in line (by this replica) |
//! | `ttlab_waitlist_lapsed_total` | — | holds that lapsed untaken (removed by this replica) |
//! | `ttlab_pool_claims_total` | `lesson` | "Start lab" served by a prepared member of the lesson's pool (by this replica) |
//! | `ttlab_pool_misses_total` | `lesson` | "Start lab" on a pooled lesson that found no ready member and went the cold way |
//! | `ttlab_pool_refills_total` | `lesson` | pool members this replica started preparing |
//! | `ttlab_pool_retired_total` | `lesson`, `reason` | pool members this replica retired (`too_old`, `surplus`, `capacity_short`, `stuck_preparing`) |
//! | `ttlab_pool_ready` | `lesson` | unclaimed members ready, at this replica's last look |
//! | `ttlab_pool_preparing` | `lesson` | unclaimed members still being prepared, at its last look |
//! | `ttlab_pool_target` | `lesson` | the size the pool is kept at (fixed, or from demand) |
//! | `ttlab_objects_terminating` | `kind` | objects of sessions this server ended whose deletion was accepted but that were still there at its last look (their sessions stay `finishing`) |
//! | `ttlab_task_activations_total` | `task` | activations of each background task ([`crate::tasks`]) |
//! | `ttlab_task_failures_total` | `task` | activations that failed (an error or a panic) |
//! | `ttlab_task_last_duration_seconds` | `task` | how long its last activation took |
//! | `ttlab_task_last_success_timestamp_seconds` | `task` | Unix time of its last success |

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use ttlab_model::SessionId;

/// Labels of `ttlab_sessions` and `ttlab_sessions_ended_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    /// Session status.
    pub status: String,
}

/// Labels of `ttlab_sessions_opened_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpenedLabels {
    /// Lesson id.
    pub lesson: String,
    /// `vm` or `pod`.
    pub runtime: String,
}

/// Labels of `ttlab_stage_seconds`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// `vm_created`, `vmi_running`, `agent_up`, `ready`.
    pub stage: String,
}

/// Labels of `ttlab_disk_decisions_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiskLabels {
    /// `golden` or `container`.
    pub kind: String,
    /// `ready` or the fallback reason.
    pub reason: String,
}

/// Labels of `ttlab_rate_limited_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// `start`, `extend` or `grade`.
    pub action: String,
}

/// Labels of `ttlab_requests_shed_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShedLabels {
    /// `overloaded` or `request_timeout`.
    pub reason: String,
}

/// Labels of `ttlab_objects_terminating`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// The object's kind (`VirtualMachine`, `Secret`, …).
    pub kind: String,
}

/// Labels of the pool metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LessonLabels {
    /// Lesson id.
    pub lesson: String,
}

/// Labels of `ttlab_pool_retired_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetireLabels {
    /// Lesson id.
    pub lesson: String,
    /// Why: `too_old`, `surplus`, `capacity_short`, `stuck_preparing`.
    pub reason: String,
}

/// The server's metrics. Cheap to clone (shared handles).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// Live sessions by status (set at scrape).
    pub sessions: Family<StatusLabels, Gauge>,
    /// Sessions accepted.
    pub opened: Family<OpenedLabels, Counter>,
    /// Sessions ended by this server.
    pub ended: Family<StatusLabels, Counter>,
    /// Seconds from the request to each stage.
    pub stage_seconds: Family<StageLabels, Histogram>,
    /// Capacity refusals.
    pub capacity_rejections: Counter,
    /// Disk decisions.
    pub disk_decisions: Family<DiskLabels, Counter>,
    /// 1 while the cluster answers the probe in time.
    pub cluster_reachable: Gauge,
    /// Seconds the last cluster probe took.
    pub cluster_probe_seconds: Gauge<f64, AtomicU64>,
    /// Requests refused by the per-user rate limit.
    pub rate_limited: Family<ActionLabels, Counter>,
    /// Requests refused by the concurrency limit or cut by the request timeout.
    pub shed: Family<ShedLabels, Counter>,
    /// Students put on the waitlist.
    pub waitlist_joined: Counter,
    /// Holds granted.
    pub waitlist_granted: Counter,
    /// Holds that lapsed untaken.
    pub waitlist_lapsed: Counter,
    /// Objects still terminating, by kind (kept by [`Metrics::set_terminating`]).
    pub objects_terminating: Family<KindLabels, Gauge>,
    /// What `objects_terminating` is computed from.
    terminating: Arc<Mutex<Terminating>>,
    /// Claims of pool members.
    pub pool_claims: Family<LessonLabels, Counter>,
    /// Pooled starts that found no ready member.
    pub pool_misses: Family<LessonLabels, Counter>,
    /// Pool members started.
    pub pool_refills: Family<LessonLabels, Counter>,
    /// Pool members retired.
    pub pool_retired: Family<RetireLabels, Counter>,
    /// Unclaimed ready members.
    pub pool_ready: Family<LessonLabels, Gauge>,
    /// Unclaimed members being prepared.
    pub pool_preparing: Family<LessonLabels, Gauge>,
    /// Each pool's target size.
    pub pool_target: Family<LessonLabels, Gauge>,
    /// The background tasks' activations, failures, durations and last successes.
    pub tasks: ttlab_background::TaskMetrics,
}

/// The kinds of the objects still terminating, by session, and the kinds exported so far.
#[derive(Debug, Default)]
struct Terminating {
    by_session: BTreeMap<SessionId, Vec<String>>,
    exported: std::collections::BTreeSet<String>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics in a registry of their own.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let sessions = Family::<StatusLabels, Gauge>::default();
        let opened = Family::<OpenedLabels, Counter>::default();
        let ended = Family::<StatusLabels, Counter>::default();
        let stage_seconds = Family::<StageLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
            ])
        });
        let capacity_rejections = Counter::default();
        let disk_decisions = Family::<DiskLabels, Counter>::default();
        registry.register(
            "ttlab_sessions",
            "Live sessions of this environment by status",
            sessions.clone(),
        );
        registry.register("ttlab_sessions_opened", "Sessions accepted", opened.clone());
        registry.register(
            "ttlab_sessions_ended",
            "Sessions this server ended, by final status",
            ended.clone(),
        );
        registry.register(
            "ttlab_stage_seconds",
            "Seconds from the request to each provisioning stage",
            stage_seconds.clone(),
        );
        registry.register(
            "ttlab_capacity_rejections",
            "Session requests refused because the VM limit was reached",
            capacity_rejections.clone(),
        );
        registry.register(
            "ttlab_disk_decisions",
            "Root disk decisions by kind and reason",
            disk_decisions.clone(),
        );
        let cluster_reachable = Gauge::default();
        let cluster_probe_seconds = Gauge::<f64, AtomicU64>::default();
        let rate_limited = Family::<ActionLabels, Counter>::default();
        let shed = Family::<ShedLabels, Counter>::default();
        let waitlist_joined = Counter::default();
        let waitlist_granted = Counter::default();
        let waitlist_lapsed = Counter::default();
        registry.register(
            "ttlab_waitlist_joined",
            "Students put on the waitlist",
            waitlist_joined.clone(),
        );
        registry.register(
            "ttlab_waitlist_granted",
            "Freed places held for the first student in line",
            waitlist_granted.clone(),
        );
        registry.register(
            "ttlab_waitlist_lapsed",
            "Waitlist holds that lapsed untaken",
            waitlist_lapsed.clone(),
        );
        registry.register(
            "ttlab_cluster_reachable",
            "1 if the last probe of the Kubernetes API answered in time, else 0",
            cluster_reachable.clone(),
        );
        registry.register(
            "ttlab_cluster_probe_seconds",
            "Seconds the last probe of the Kubernetes API took",
            cluster_probe_seconds.clone(),
        );
        let objects_terminating = Family::<KindLabels, Gauge>::default();
        registry.register(
            "ttlab_objects_terminating",
            "Objects of sessions this server ended that were still terminating at its last look, \
             by kind",
            objects_terminating.clone(),
        );
        registry.register(
            "ttlab_rate_limited",
            "Requests refused by the per-user rate limit, by action",
            rate_limited.clone(),
        );
        registry.register(
            "ttlab_requests_shed",
            "Requests refused by the concurrency limit or cut by the request timeout",
            shed.clone(),
        );
        let pool_claims = Family::<LessonLabels, Counter>::default();
        let pool_misses = Family::<LessonLabels, Counter>::default();
        let pool_refills = Family::<LessonLabels, Counter>::default();
        let pool_retired = Family::<RetireLabels, Counter>::default();
        let pool_ready = Family::<LessonLabels, Gauge>::default();
        let pool_preparing = Family::<LessonLabels, Gauge>::default();
        let pool_target = Family::<LessonLabels, Gauge>::default();
        registry.register(
            "ttlab_pool_claims",
            "Starts served by a prepared member of the lesson's pool",
            pool_claims.clone(),
        );
        registry.register(
            "ttlab_pool_misses",
            "Starts of a pooled lesson that found no ready member",
            pool_misses.clone(),
        );
        registry.register(
            "ttlab_pool_refills",
            "Pool members started",
            pool_refills.clone(),
        );
        registry.register(
            "ttlab_pool_retired",
            "Pool members retired, by reason",
            pool_retired.clone(),
        );
        registry.register(
            "ttlab_pool_ready",
            "Unclaimed pool members ready",
            pool_ready.clone(),
        );
        registry.register(
            "ttlab_pool_preparing",
            "Unclaimed pool members being prepared",
            pool_preparing.clone(),
        );
        registry.register(
            "ttlab_pool_target",
            "The size each pool is kept at",
            pool_target.clone(),
        );
        let tasks = ttlab_background::TaskMetrics::new();
        tasks.register(registry.sub_registry_with_prefix("ttlab"));
        Self {
            registry: Arc::new(registry),
            tasks,
            pool_claims,
            pool_misses,
            pool_refills,
            pool_retired,
            pool_ready,
            pool_preparing,
            pool_target,
            cluster_reachable,
            cluster_probe_seconds,
            rate_limited,
            shed,
            waitlist_joined,
            waitlist_granted,
            waitlist_lapsed,
            sessions,
            opened,
            ended,
            stage_seconds,
            capacity_rejections,
            disk_decisions,
            objects_terminating,
            terminating: Arc::default(),
        }
    }

    /// Records the kinds of the objects of `session` still terminating at the last look
    /// (none: nothing of it is followed here any more), and sets `ttlab_objects_terminating`
    /// from every session's. A kind once exported stays, at 0 when nothing of it is left.
    pub fn set_terminating(&self, session: SessionId, kinds: Vec<String>) {
        let mut t = self
            .terminating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if kinds.is_empty() {
            t.by_session.remove(&session);
        } else {
            t.by_session.insert(session, kinds);
        }
        let mut counts: BTreeMap<String, i64> = t.exported.iter().map(|k| (k.clone(), 0)).collect();
        for kind in t.by_session.values().flatten() {
            *counts.entry(kind.clone()).or_default() += 1;
        }
        for (kind, n) in counts {
            self.objects_terminating
                .get_or_create(&KindLabels { kind: kind.clone() })
                .set(n);
            t.exported.insert(kind);
        }
    }

    /// Records how long after the request a stage was reached.
    pub fn observe_stage(&self, stage: &str, seconds: f64) {
        self.stage_seconds
            .get_or_create(&StageLabels {
                stage: stage.to_owned(),
            })
            .observe(seconds.max(0.0));
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_terminating_counts_each_sessions_last_look_once() {
        let m = Metrics::new();
        let (a, b) = (SessionId::new_random(), SessionId::new_random());
        m.set_terminating(a, vec!["VirtualMachine".into()]);
        // A second look at the same session replaces the first.
        m.set_terminating(a, vec!["VirtualMachine".into()]);
        m.set_terminating(b, vec!["VirtualMachine".into(), "Secret".into()]);
        let text = m.encode();
        assert!(
            text.contains("ttlab_objects_terminating{kind=\"VirtualMachine\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("ttlab_objects_terminating{kind=\"Secret\"} 1"),
            "{text}"
        );
        m.set_terminating(a, Vec::new());
        m.set_terminating(b, vec!["VirtualMachine".into()]);
        let text = m.encode();
        assert!(
            text.contains("ttlab_objects_terminating{kind=\"VirtualMachine\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("ttlab_objects_terminating{kind=\"Secret\"} 0"),
            "gone, still exported: {text}"
        );
    }
}
