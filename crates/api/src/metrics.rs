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
//! | `ttlab_cluster_reachable` | `site` | 1 if the last probe of the site's API server answered in time, else 0 (0 before the first) |
//! | `ttlab_cluster_probe_seconds` | `site` | how long the last probe of the site took |
//! | `ttlab_rate_limited_total` | `action` | start, extend, grade answered 429 |
//! | `ttlab_requests_shed_total` | `reason` | requests answered 503 `overloaded` or `request_timeout` |
//! | `ttlab_waitlist_joined_total` | — | students put on the waitlist |
//! | `ttlab_waitlist_granted_total` | — | freed places held for the first in line (by this replica) |
//! | `ttlab_waitlist_lapsed_total` | — | holds that lapsed untaken (removed by this replica) |
//! | `ttlab_pool_claims_total` | `lesson` | "Start lab" served by a prepared member of the lesson's pool (by this replica) |
//! | `ttlab_pool_misses_total` | `lesson` | "Start lab" on a pooled lesson that found no ready member and went the cold way |
//! | `ttlab_pool_handover_failures_total` | `lesson` | claimed members whose hand-over (deadline re-arm, token rotation) failed: each was failed and reclaimed, and the student given the next member or a cold start in the same click (a member claimed while it was prepared: its student put first in line) |
//! | `ttlab_pool_refills_total` | `lesson` | pool members this replica started preparing |
//! | `ttlab_pool_retired_total` | `lesson`, `reason` | pool members this replica retired (`too_old`, `surplus`, `capacity_short`, `stuck_preparing`) |
//! | `ttlab_pool_ready` | `lesson` | unclaimed members ready, at this replica's last look |
//! | `ttlab_pool_preparing` | `lesson` | unclaimed members still being prepared, at its last look |
//! | `ttlab_pool_target` | `lesson` | the size the pool is kept at (fixed, or from demand) |
//! | `ttlab_objects_terminating` | `kind` | objects of sessions this server ended whose deletion was accepted but that were still there at its last look (their sessions stay `finishing`) |
//! | `ttlab_provisionings_total` | `runtime`, `outcome` | provisioning runs this replica ended: `ready`, `failed`, or `superseded` (the session was ended by someone else first) |
//! | `ttlab_gradings_total` | `outcome` | "Check my work" requests: `graded`, `agent_unavailable` (the lab's agent or pod did not answer), `failed` (anything else) |
//! | `ttlab_console_connections` | `runtime` | terminal connections this replica relays now |
//! | `ttlab_console_closed_total` | `reason` | terminal connections this replica closed: `browser_closed`, `taken_over`, `session_ended`, `lost`, `replica_gone` (the record of a gone replica's console) |
//! | `ttlab_sessions_past_expiry` | — | live sessions of this environment whose expiry has passed (database clock; read at scrape) |
//! | `ttlab_sessions_past_expiry_max_seconds` | — | how long ago the expiry of the most overdue of them passed, 0 when none (read at scrape) |
//! | `ttlab_sessions_terminating` | — | `finishing` sessions of this environment held by objects still terminating (read at scrape) |
//! | `ttlab_sessions_terminating_max_seconds` | — | how long the longest of them has been held, 0 when none (read at scrape) |
//! | `ttlab_last_reaper_cycle_timestamp_seconds` | — | Unix time at which the last reaper cycle of this environment recorded in the database ended, whichever reaper ran it (Deployment or CronJob; dry runs left out); 0 before the first (read at scrape) |
//! | `ttlab_capacity_limit` | `site` | the site's VM limit (`TTLAB_VM_LIMIT`, or `vm_limit` in the sites file) |
//! | `ttlab_capacity_used` | `site`, `by` | VM places taken on the site, as the capacity check counts them: `labs`, `shutting_down`, `without_lab` (read at scrape) |
//! | `ttlab_quota_hard`, `ttlab_quota_used` | `site`, `quota`, `resource` | the site's VM namespace's ResourceQuotas, as its API server accounts them (bytes for memory; read at scrape) |
//!
//! Without a sites file the one site is `default`. A site whose API server does not answer a
//! scrape in time keeps its last values.
//!
//! The families whose label values are a fixed set are created with every value at 0, so a
//! rate over them starts at the first scrape, not at the first event.
//! | `ttlab_task_activations_total` | `task` | activations of each background task ([`crate::tasks`]) |
//! | `ttlab_task_failures_total` | `task` | activations that failed (an error or a panic) |
//! | `ttlab_task_last_duration_seconds` | `task` | how long its last activation took |
//! | `ttlab_task_last_success_timestamp_seconds` | `task` | Unix time of its last success |

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
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

/// A label value of a fixed set, exported as its snake_case name.
macro_rules! label_value {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            /// Every value (each series is created at 0).
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The exported value.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }
        }

        impl EncodeLabelValue for $name {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
                EncodeLabelValue::encode(&self.as_str(), encoder)
            }
        }
    };
}

label_value! {
    /// How a provisioning run ended.
    ProvisioningOutcome {
        /// The session is running (ready).
        Ready => "ready",
        /// It failed; the session was ended `failed`.
        Failed => "failed",
        /// The row left `starting` first (finished by its student, failed by the reaper).
        Superseded => "superseded",
        /// The namespace's quota refused it at capacity; the session was ended `requeued` and
        /// its student put back in the line.
        Requeued => "requeued",
    }
}

label_value! {
    /// A runtime, as a label.
    RuntimeLabel {
        /// A VM lab.
        Vm => "vm",
        /// A pod lab.
        Pod => "pod",
    }
}

impl From<ttlab_model::Runtime> for RuntimeLabel {
    fn from(r: ttlab_model::Runtime) -> Self {
        match r {
            ttlab_model::Runtime::Vm => Self::Vm,
            ttlab_model::Runtime::Pod => Self::Pod,
        }
    }
}

label_value! {
    /// How a "Check my work" request ended.
    GradingOutcome {
        /// Every step ran and its result went to the student.
        Graded => "graded",
        /// The lab's agent (or pod) did not answer: the student got `agent_unavailable`.
        AgentUnavailable => "agent_unavailable",
        /// Any other error (the cluster, the database, the session ended meanwhile).
        Failed => "failed",
    }
}

label_value! {
    /// Who takes a VM place, as the capacity check counts them.
    CapacityBy {
        /// VMs of live sessions (or about to be created for them).
        Labs => "labs",
        /// VMs being deleted, whose guests still hold memory.
        ShuttingDown => "shutting_down",
        /// VMs ttlab manages that no live session holds (ghosts, leftovers).
        WithoutLab => "without_lab",
    }
}

/// Labels of `ttlab_provisionings_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProvisioningLabels {
    /// `vm` or `pod`.
    pub runtime: RuntimeLabel,
    /// How it ended.
    pub outcome: ProvisioningOutcome,
}

/// Labels of `ttlab_gradings_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GradingLabels {
    /// How it ended.
    pub outcome: GradingOutcome,
}

/// Labels of `ttlab_console_connections`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuntimeLabels {
    /// `vm` or `pod`.
    pub runtime: RuntimeLabel,
}

/// Labels of `ttlab_console_closed_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClosedLabels {
    /// Why (`ttlab_store::ConsoleClosedWhy`).
    pub reason: String,
}

/// Labels of the per-site gauges (`ttlab_capacity_limit`, `ttlab_cluster_reachable`,
/// `ttlab_cluster_probe_seconds`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SiteLabels {
    /// The site's name.
    pub site: String,
}

/// Labels of `ttlab_capacity_used`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CapacityLabels {
    /// The site's name.
    pub site: String,
    /// Who takes the places.
    pub by: CapacityBy,
}

/// Labels of `ttlab_quota_hard` and `ttlab_quota_used`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuotaLabels {
    /// The site's name.
    pub site: String,
    /// The ResourceQuota's name.
    pub quota: String,
    /// The resource (`count/virtualmachines.kubevirt.io`, `requests.memory`, …).
    pub resource: String,
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
    /// 1 while the site answers the probe in time, by site.
    pub cluster_reachable: Family<SiteLabels, Gauge>,
    /// Seconds the last probe of each site took.
    pub cluster_probe_seconds: Family<SiteLabels, Gauge<f64, AtomicU64>>,
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
    /// Claimed members whose hand-over failed.
    pub pool_handover_failures: Family<LessonLabels, Counter>,
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
    /// Provisioning runs ended, by runtime and outcome.
    pub provisionings: Family<ProvisioningLabels, Counter>,
    /// "Check my work" requests, by outcome.
    pub gradings: Family<GradingLabels, Counter>,
    /// Terminal connections relayed now, by runtime.
    pub console_connections: Family<RuntimeLabels, Gauge>,
    /// Terminal connections closed, by reason.
    pub console_closed: Family<ClosedLabels, Counter>,
    /// Live sessions past their expiry (set at scrape).
    pub sessions_past_expiry: Gauge,
    /// Seconds since the expiry of the most overdue live session (set at scrape).
    pub sessions_past_expiry_max_seconds: Gauge<f64, AtomicU64>,
    /// Finishing sessions held by objects still terminating (set at scrape).
    pub sessions_terminating: Gauge,
    /// Seconds the longest-held of them has been terminating (set at scrape).
    pub sessions_terminating_max_seconds: Gauge<f64, AtomicU64>,
    /// When the last recorded reaper cycle of this environment ended (set at scrape).
    pub last_reaper_cycle: Gauge<f64, AtomicU64>,
    /// Each site's VM limit.
    pub capacity_limit: Family<SiteLabels, Gauge>,
    /// VM places taken, by whom (set at scrape).
    pub capacity_used: Family<CapacityLabels, Gauge>,
    /// ResourceQuota limits (set at scrape).
    pub quota_hard: Family<QuotaLabels, Gauge<f64, AtomicU64>>,
    /// ResourceQuota usage (set at scrape).
    pub quota_used: Family<QuotaLabels, Gauge<f64, AtomicU64>>,
    /// The background tasks' activations, failures, durations and last successes.
    pub tasks: ttlab_background::TaskMetrics,
    /// Each site's ResourceQuotas as last read (a site not read in time keeps its own).
    quotas: Arc<Mutex<BTreeMap<String, Vec<ttlab_cluster::QuotaSummary>>>>,
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
        let cluster_reachable = Family::<SiteLabels, Gauge>::default();
        let cluster_probe_seconds = Family::<SiteLabels, Gauge<f64, AtomicU64>>::default();
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
            "1 if the last probe of the site's Kubernetes API answered in time, else 0",
            cluster_reachable.clone(),
        );
        registry.register(
            "ttlab_cluster_probe_seconds",
            "Seconds the last probe of the site's Kubernetes API took",
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
        let pool_handover_failures = Family::<LessonLabels, Counter>::default();
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
            "ttlab_pool_handover_failures",
            "Claimed pool members whose hand-over failed (failed, reclaimed, and replaced for the student)",
            pool_handover_failures.clone(),
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
        let provisionings = Family::<ProvisioningLabels, Counter>::default();
        for &runtime in RuntimeLabel::ALL {
            for &outcome in ProvisioningOutcome::ALL {
                provisionings
                    .get_or_create(&ProvisioningLabels { runtime, outcome })
                    .inc_by(0);
            }
        }
        registry.register(
            "ttlab_provisionings",
            "Provisioning runs this replica ended, by runtime and outcome",
            provisionings.clone(),
        );
        let gradings = Family::<GradingLabels, Counter>::default();
        for &outcome in GradingOutcome::ALL {
            gradings.get_or_create(&GradingLabels { outcome }).inc_by(0);
        }
        registry.register(
            "ttlab_gradings",
            "Check-my-work requests, by outcome",
            gradings.clone(),
        );
        let console_connections = Family::<RuntimeLabels, Gauge>::default();
        for &runtime in RuntimeLabel::ALL {
            console_connections
                .get_or_create(&RuntimeLabels { runtime })
                .set(0);
        }
        registry.register(
            "ttlab_console_connections",
            "Terminal connections this replica relays now, by runtime",
            console_connections.clone(),
        );
        let console_closed = Family::<ClosedLabels, Counter>::default();
        for why in ttlab_store::ConsoleClosedWhy::ALL {
            console_closed
                .get_or_create(&ClosedLabels {
                    reason: why.as_str().to_owned(),
                })
                .inc_by(0);
        }
        registry.register(
            "ttlab_console_closed",
            "Terminal connections this replica closed, by reason",
            console_closed.clone(),
        );
        let sessions_past_expiry = Gauge::default();
        let sessions_past_expiry_max_seconds = Gauge::<f64, AtomicU64>::default();
        let sessions_terminating = Gauge::default();
        let sessions_terminating_max_seconds = Gauge::<f64, AtomicU64>::default();
        let last_reaper_cycle = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "ttlab_sessions_past_expiry",
            "Live sessions of this environment whose expiry has passed (database clock)",
            sessions_past_expiry.clone(),
        );
        registry.register(
            "ttlab_sessions_past_expiry_max_seconds",
            "Seconds since the expiry of the most overdue live session, 0 when none",
            sessions_past_expiry_max_seconds.clone(),
        );
        registry.register(
            "ttlab_sessions_terminating",
            "Finishing sessions of this environment held by objects still terminating",
            sessions_terminating.clone(),
        );
        registry.register(
            "ttlab_sessions_terminating_max_seconds",
            "Seconds the longest-held finishing session has had objects terminating, 0 when none",
            sessions_terminating_max_seconds.clone(),
        );
        registry.register(
            "ttlab_last_reaper_cycle_timestamp_seconds",
            "Unix time at which the last reaper cycle of this environment recorded in the \
             database ended (any reaper, dry runs left out); 0 before the first",
            last_reaper_cycle.clone(),
        );
        let capacity_limit = Family::<SiteLabels, Gauge>::default();
        let capacity_used = Family::<CapacityLabels, Gauge>::default();
        registry.register(
            "ttlab_capacity_limit",
            "Each site's VM limit (TTLAB_VM_LIMIT, or vm_limit in the sites file)",
            capacity_limit.clone(),
        );
        registry.register(
            "ttlab_capacity_used",
            "VM places taken on each site, as the capacity check counts them, by whom",
            capacity_used.clone(),
        );
        let quota_hard = Family::<QuotaLabels, Gauge<f64, AtomicU64>>::default();
        let quota_used = Family::<QuotaLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "ttlab_quota_hard",
            "Limits of each site's VM namespace's ResourceQuotas (bytes for memory)",
            quota_hard.clone(),
        );
        registry.register(
            "ttlab_quota_used",
            "Usage of each site's VM namespace's ResourceQuotas (bytes for memory)",
            quota_used.clone(),
        );
        let tasks = ttlab_background::TaskMetrics::new();
        tasks.register(registry.sub_registry_with_prefix("ttlab"));
        Self {
            registry: Arc::new(registry),
            provisionings,
            gradings,
            console_connections,
            console_closed,
            sessions_past_expiry,
            sessions_past_expiry_max_seconds,
            sessions_terminating,
            sessions_terminating_max_seconds,
            last_reaper_cycle,
            capacity_limit,
            capacity_used,
            quota_hard,
            quota_used,
            tasks,
            pool_claims,
            pool_misses,
            pool_handover_failures,
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
            quotas: Arc::default(),
        }
    }

    /// Exports each site's series before any scrape or probe: its limit, no place taken and,
    /// until its first probe, not reachable.
    pub fn add_site(&self, site: &str, vm_limit: usize) {
        let labels = SiteLabels {
            site: site.to_owned(),
        };
        self.capacity_limit
            .get_or_create(&labels)
            .set(i64::try_from(vm_limit).unwrap_or(i64::MAX));
        self.cluster_reachable.get_or_create(&labels).set(0);
        for &by in CapacityBy::ALL {
            self.capacity_used
                .get_or_create(&CapacityLabels {
                    site: site.to_owned(),
                    by,
                })
                .set(0);
        }
    }

    /// Records what a probe of `site` found: whether it answered in time, and how long it took.
    pub fn set_probe(&self, site: &str, reachable: bool, took: std::time::Duration) {
        let labels = SiteLabels {
            site: site.to_owned(),
        };
        self.cluster_reachable
            .get_or_create(&labels)
            .set(i64::from(reachable));
        self.cluster_probe_seconds
            .get_or_create(&labels)
            .set(took.as_secs_f64());
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

    /// Counts a provisioning run's end.
    pub fn provisioning_ended(&self, runtime: ttlab_model::Runtime, outcome: ProvisioningOutcome) {
        self.provisionings
            .get_or_create(&ProvisioningLabels {
                runtime: runtime.into(),
                outcome,
            })
            .inc();
    }

    /// Counts a "Check my work" request's end.
    pub fn graded(&self, outcome: GradingOutcome) {
        self.gradings
            .get_or_create(&GradingLabels { outcome })
            .inc();
    }

    /// Counts a terminal connection of `runtime` open until the returned guard is dropped.
    pub fn console_opened(&self, runtime: ttlab_model::Runtime) -> ConsoleOpen {
        let gauge = self
            .console_connections
            .get_or_create(&RuntimeLabels {
                runtime: runtime.into(),
            })
            .clone();
        gauge.inc();
        ConsoleOpen(gauge)
    }

    /// Counts a terminal connection closed for `reason`.
    pub fn console_closed(&self, reason: ttlab_store::ConsoleClosedWhy) {
        self.console_closed
            .get_or_create(&ClosedLabels {
                reason: reason.as_str().to_owned(),
            })
            .inc();
    }

    /// Sets the places taken and the limit, as the capacity check counted them.
    pub fn set_capacity(&self, site: &str, usage: &crate::CapacityUse, limit: usize) {
        for (by, n) in [
            (CapacityBy::Labs, usage.labs),
            (CapacityBy::ShuttingDown, usage.shutting_down),
            (CapacityBy::WithoutLab, usage.without_lab),
        ] {
            self.capacity_used
                .get_or_create(&CapacityLabels {
                    site: site.to_owned(),
                    by,
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        self.capacity_limit
            .get_or_create(&SiteLabels {
                site: site.to_owned(),
            })
            .set(i64::try_from(limit).unwrap_or(i64::MAX));
    }

    /// Sets the quota gauges of `site` from its namespace's ResourceQuotas; a value that is
    /// not a Kubernetes quantity is left out. Other sites' keep their last values.
    pub fn set_quotas(&self, site: &str, quotas: &[ttlab_cluster::QuotaSummary]) {
        let mut all = self
            .quotas
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.insert(site.to_owned(), quotas.to_vec());
        // A quota or resource no longer there is no longer exported.
        self.quota_hard.clear();
        self.quota_used.clear();
        for (site, quotas) in all.iter() {
            for q in quotas {
                for (family, values) in [(&self.quota_hard, &q.hard), (&self.quota_used, &q.used)] {
                    for (resource, text) in values {
                        if let Some(value) = quantity(text) {
                            family
                                .get_or_create(&QuotaLabels {
                                    site: site.clone(),
                                    quota: q.name.clone(),
                                    resource: resource.clone(),
                                })
                                .set(value);
                        }
                    }
                }
            }
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// A terminal connection counted in `ttlab_console_connections` until dropped.
#[derive(Debug)]
pub struct ConsoleOpen(Gauge);

impl Drop for ConsoleOpen {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The value of a Kubernetes quantity (`48Gi`, `8`, `500m`, `1.5G`, `12e9`) as a gauge
/// reads it, or `None` if `text` is not one.
fn quantity(text: &str) -> Option<f64> {
    let q: ttlab_model::Quantity = text.trim().parse().ok()?;
    Some(q.milli() as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_read_as_kubernetes_writes_them() {
        for (text, value) in [
            ("8", 8.0),
            ("48Gi", 48.0 * 1024.0 * 1024.0 * 1024.0),
            ("512Mi", 512.0 * 1024.0 * 1024.0),
            ("1.5Gi", 1.5 * 1024.0 * 1024.0 * 1024.0),
            ("2G", 2e9),
            ("500m", 0.5),
            ("12e9", 12e9),
            ("1E3", 1e3),
            ("0", 0.0),
        ] {
            assert_eq!(quantity(text), Some(value), "{text}");
        }
        for text in ["", "Gi", "4GB", "four", "1e", "1.2.3"] {
            assert_eq!(quantity(text), None, "{text}");
        }
    }

    #[test]
    fn fixed_label_sets_are_exported_at_zero_before_any_event() {
        let m = Metrics::new();
        m.add_site("default", 4);
        let text = m.encode();
        for line in [
            "ttlab_provisionings_total{runtime=\"vm\",outcome=\"ready\"} 0",
            "ttlab_provisionings_total{runtime=\"pod\",outcome=\"failed\"} 0",
            "ttlab_gradings_total{outcome=\"agent_unavailable\"} 0",
            "ttlab_console_connections{runtime=\"vm\"} 0",
            "ttlab_console_closed_total{reason=\"lost\"} 0",
            "ttlab_capacity_used{site=\"default\",by=\"shutting_down\"} 0",
            "ttlab_capacity_limit{site=\"default\"} 4",
            "ttlab_cluster_reachable{site=\"default\"} 0",
            "ttlab_last_reaper_cycle_timestamp_seconds 0",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
    }

    #[test]
    fn a_console_counts_while_its_guard_lives_and_quotas_read_as_numbers() {
        let m = Metrics::new();
        let a = m.console_opened(ttlab_model::Runtime::Vm);
        let b = m.console_opened(ttlab_model::Runtime::Vm);
        assert!(
            m.encode()
                .contains("ttlab_console_connections{runtime=\"vm\"} 2")
        );
        drop(a);
        assert!(
            m.encode()
                .contains("ttlab_console_connections{runtime=\"vm\"} 1")
        );
        drop(b);
        assert!(
            m.encode()
                .contains("ttlab_console_connections{runtime=\"vm\"} 0")
        );

        m.set_quotas(
            "site-a",
            &[ttlab_cluster::QuotaSummary {
                name: "ttlab-vms".into(),
                hard: [
                    ("requests.memory".to_owned(), "48Gi".to_owned()),
                    (
                        "count/virtualmachines.kubevirt.io".to_owned(),
                        "8".to_owned(),
                    ),
                ]
                .into(),
                used: [("requests.memory".to_owned(), "not a quantity".to_owned())].into(),
            }],
        );
        let text = m.encode();
        assert!(
            text.contains(
                "ttlab_quota_hard{site=\"site-a\",quota=\"ttlab-vms\",resource=\"requests.memory\"} 51539607552.0"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "ttlab_quota_hard{site=\"site-a\",quota=\"ttlab-vms\",resource=\"count/virtualmachines.kubevirt.io\"} 8.0"
            ),
            "{text}"
        );
        assert!(!text.contains("ttlab_quota_used{"), "{text}");
        // Another site's quotas are exported beside the first's, and a site's new reading
        // replaces only its own.
        m.set_quotas(
            "site-b",
            &[ttlab_cluster::QuotaSummary {
                name: "ttlab-vms".into(),
                hard: [("requests.memory".to_owned(), "1Gi".to_owned())].into(),
                used: Default::default(),
            }],
        );
        m.set_quotas("site-a", &[]);
        let text = m.encode();
        assert!(
            text.contains(
                "ttlab_quota_hard{site=\"site-b\",quota=\"ttlab-vms\",resource=\"requests.memory\"} 1073741824.0"
            ),
            "{text}"
        );
        assert!(!text.contains("site=\"site-a\",quota="), "{text}");
    }

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
