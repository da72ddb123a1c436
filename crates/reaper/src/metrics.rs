//! Prometheus metrics of the reaper (counters per direction and outcome, cycle durations,
//! leadership, and the status records of its loops: taking the leader lease and opening the
//! notification listeners, `ttlab_reaper_task_*{task}`) and the small HTTP endpoint serving
//! them with `/healthz`.
//!
//! `/healthz` is the loop's heartbeat, not just "the process answers": it fails (503) when
//! the reaper's loop has not made progress for the configured stall time
//! ([`Metrics::with_stall_after`]) — as the leader, a cycle that ran; as a standby or while
//! its database is away, a leader lock attempt that ended, answered or failed. A reaper stuck
//! on a hung call is then restarted by its liveness probe instead of silently reclaiming
//! nothing; one whose database is down stays alive and keeps trying (a restart would not
//! bring the database back, and its back-off would keep the reaper away after the database
//! returned).
//!
//! `/readyz` says whether the database answered the loop's last call, and if not, since when
//! it has not and the last error ([`Metrics::readiness`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use ttlab_background::{TaskMetrics, TaskName, TaskRecord};
use ttlab_store::{CycleTrigger, Direction};

use crate::{CycleReport, ReaperError};

/// A direction, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(missing_docs)]
pub enum DirectionLabel {
    Expired,
    Orphans,
    Ghosts,
    Stuck,
}

impl From<Direction> for DirectionLabel {
    fn from(d: Direction) -> Self {
        match d {
            Direction::Expired => Self::Expired,
            Direction::Orphans => Self::Orphans,
            Direction::Ghosts => Self::Ghosts,
            Direction::Stuck => Self::Stuck,
        }
    }
}

/// An item's outcome, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(missing_docs)]
pub enum OutcomeLabel {
    Done,
    Failed,
}

/// Labels of [`Metrics::items`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ItemLabels {
    /// The direction.
    pub direction: DirectionLabel,
    /// Done or failed.
    pub outcome: OutcomeLabel,
}

/// A trigger, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(missing_docs)]
pub enum TriggerLabel {
    Startup,
    Timer,
    Wakeup,
    Collect,
}

impl From<CycleTrigger> for TriggerLabel {
    fn from(t: CycleTrigger) -> Self {
        match t {
            CycleTrigger::Startup => Self::Startup,
            CycleTrigger::Timer => Self::Timer,
            CycleTrigger::Wakeup => Self::Wakeup,
            CycleTrigger::Collect => Self::Collect,
        }
    }
}

/// Labels of [`Metrics::cycles`].
/// Labels of the objects still terminating: their kind (`VirtualMachine`, `Secret`, …).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct KindLabels {
    /// The object's kind.
    pub kind: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CycleLabels {
    /// What started the cycle.
    pub trigger: TriggerLabel,
}

/// The reaper's metrics.
pub struct Metrics {
    registry: Registry,
    /// `ttlab_reaper_items_total{direction, outcome}`.
    pub items: Family<ItemLabels, Counter>,
    /// `ttlab_reaper_cycles_total{trigger}`.
    pub cycles: Family<CycleLabels, Counter>,
    /// `ttlab_reaper_cycles_not_run_total`: cycles that could not run at all.
    pub cycles_not_run: Counter,
    /// `ttlab_reaper_cycle_duration_seconds`.
    pub cycle_duration: Histogram,
    /// `ttlab_reaper_leader`: 1 while this process is the acting reaper.
    pub leader: Gauge<i64, AtomicI64>,
    /// `ttlab_reaper_last_cycle_timestamp_seconds`.
    pub last_cycle: Gauge<f64, AtomicU64>,
    /// Objects whose deletion was accepted but that were still there at the last cycle's look,
    /// by kind (their sessions stay finishing).
    pub objects_terminating: Family<KindLabels, Gauge>,
    /// The attempts to take the environment's leader lease (`leader_lease`): each attempt the
    /// database answered is a success, whether or not another reaper holds the lease.
    pub leader_lease: TaskRecord,
    /// The notification listeners (`notifications`): each attempt to open one, and each lost
    /// connection.
    pub notifications: TaskRecord,
    /// When the loop last made progress (start-up counts as progress).
    heartbeat: Mutex<Instant>,
    /// How long without progress `/healthz` tolerates; `None`: it always says ok.
    stall_after: Option<Duration>,
    /// What the last call to the database found, for `/readyz`.
    database: Mutex<DatabaseSeen>,
}

/// What the reaper's last calls to its database found (`/readyz`).
#[derive(Debug, Clone, Default)]
struct DatabaseSeen {
    /// Whether the last attempt was answered.
    answered: bool,
    /// Since when the attempts have failed (`None` while it answers, or before the first).
    unreachable_since: Option<chrono::DateTime<chrono::Utc>>,
    /// The last failure.
    last_error: Option<String>,
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
    /// Fresh metrics in their own registry.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ttlab_reaper");
        let items = Family::<ItemLabels, Counter>::default();
        let cycles = Family::<CycleLabels, Counter>::default();
        let cycles_not_run = Counter::default();
        let cycle_duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let leader = Gauge::<i64, AtomicI64>::default();
        let last_cycle = Gauge::<f64, AtomicU64>::default();
        let objects_terminating = Family::<KindLabels, Gauge>::default();
        registry.register(
            "items",
            "Items handled by the reaper, by direction and outcome",
            items.clone(),
        );
        registry.register("cycles", "Reaper cycles run, by trigger", cycles.clone());
        registry.register(
            "cycles_not_run",
            "Reaper cycles that could not run at all (database unreachable)",
            cycles_not_run.clone(),
        );
        registry.register(
            "cycle_duration_seconds",
            "Duration of reaper cycles",
            cycle_duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this process is the acting reaper of its environment",
            leader.clone(),
        );
        registry.register(
            "last_cycle_timestamp_seconds",
            "Unix time at which the last cycle ended",
            last_cycle.clone(),
        );
        registry.register(
            "objects_terminating",
            "Objects whose deletion was accepted but that were still there at the last cycle's \
             look (their sessions stay finishing), by kind",
            objects_terminating.clone(),
        );
        let tasks = TaskMetrics::new();
        tasks.register(&mut registry);
        let leader_lease = TaskRecord::new(
            TaskName::new("leader_lease"),
            "Tries to take the environment's leader lease, every second while another reaper \
             holds it",
            Some(crate::LEADER_RETRY),
            &tasks,
        );
        let notifications = TaskRecord::new(
            TaskName::new("notifications"),
            "Opens the LISTEN connections for collect requests and session changes, again \
             while one is down",
            None,
            &tasks,
        );
        Self {
            registry,
            leader_lease,
            notifications,
            items,
            cycles,
            cycles_not_run,
            cycle_duration,
            leader,
            last_cycle,
            objects_terminating,
            heartbeat: Mutex::new(Instant::now()),
            stall_after: None,
            database: Mutex::new(DatabaseSeen::default()),
        }
    }

    /// Makes `/healthz` fail once the loop has made no progress for `stall_after`.
    pub fn with_stall_after(mut self, stall_after: Duration) -> Self {
        self.stall_after = Some(stall_after);
        self
    }

    /// Records that the loop made progress (a cycle ran, or the database answered a standby's
    /// lock attempt).
    pub fn beat(&self) {
        *self
            .heartbeat
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
    }

    /// Records that the database answered (a lock attempt, a cycle): ready again.
    pub fn database_answered(&self) {
        let mut seen = self
            .database
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *seen = DatabaseSeen {
            answered: true,
            ..DatabaseSeen::default()
        };
    }

    /// Records that a call to the database failed with `error`: not ready until one is
    /// answered again.
    pub fn database_failed(&self, error: &str) {
        let mut seen = self
            .database
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.answered || seen.unreachable_since.is_none() {
            seen.unreachable_since = Some(chrono::Utc::now());
        }
        seen.answered = false;
        seen.last_error = Some(error.to_owned());
    }

    /// Ok once the database answered the loop's last call; otherwise why not, in one line
    /// (`/readyz`).
    pub fn readiness(&self) -> Result<(), String> {
        let seen = self
            .database
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if seen.answered {
            return Ok(());
        }
        Err(match (seen.unreachable_since, seen.last_error) {
            (Some(since), Some(error)) => format!(
                "the database has been unreachable since {} ({} s; the reaper keeps trying): {error}",
                since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                (chrono::Utc::now() - since).num_seconds().max(0)
            ),
            _ => "the database has not answered yet".to_owned(),
        })
    }

    /// Ok while the loop made progress within the stall time; otherwise how long it has not.
    pub fn health(&self) -> Result<(), Duration> {
        let since = self
            .heartbeat
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .elapsed();
        match self.stall_after {
            Some(limit) if since > limit => Err(since),
            _ => Ok(()),
        }
    }

    /// Counts one cycle's report.
    pub fn observe(&self, report: &CycleReport, trigger: CycleTrigger) {
        if !report.ran() {
            self.cycles_not_run.inc();
            return;
        }
        self.beat();
        self.cycles
            .get_or_create(&CycleLabels {
                trigger: trigger.into(),
            })
            .inc();
        self.cycle_duration.observe(report.duration.as_secs_f64());
        for d in [
            Direction::Expired,
            Direction::Orphans,
            Direction::Ghosts,
            Direction::Stuck,
        ] {
            let c = report.count(d);
            for (outcome, n) in [
                (OutcomeLabel::Done, c.done),
                (OutcomeLabel::Failed, c.failed),
            ] {
                self.items
                    .get_or_create(&ItemLabels {
                        direction: d.into(),
                        outcome,
                    })
                    .inc_by(u64::from(n));
            }
        }
        // A gauge per kind ttlab creates, so a kind whose last object went reads 0 again.
        // A sessions-only cycle looks at fewer sessions: it only raises the gauges.
        let mut by_kind = std::collections::BTreeMap::<String, i64>::new();
        for t in &report.terminating {
            *by_kind.entry(t.kind.name().to_owned()).or_default() += 1;
        }
        for kind in crate::ORPHAN_KINDS {
            let n = by_kind.get(kind.name()).copied().unwrap_or(0);
            let gauge = self.objects_terminating.get_or_create(&KindLabels {
                kind: kind.name().to_owned(),
            });
            if !report.sessions_only || n > gauge.get() {
                gauge.set(n);
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        self.last_cycle.set(now);
    }

    /// The metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `GET /metrics`, `GET /healthz` ([`Metrics::health`]: 200 `ok`, or 503 when the
/// loop stalled) and `GET /readyz` ([`Metrics::readiness`]: 200 `ready`, or 503 `not ready:`
/// and why) on `addr` until `shutdown` is cancelled. Binds before returning, so a taken
/// port fails at once.
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ReaperError> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ReaperError::Metrics { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| ReaperError::Metrics { addr, source })?;
    let health = metrics.clone();
    let ready = metrics.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let health = health.clone();
                async move {
                    match health.health() {
                        Ok(()) => (axum::http::StatusCode::OK, "ok\n".to_owned()),
                        Err(since) => (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            format!(
                                "stalled: the reaper loop has made no progress for {} s\n",
                                since.as_secs()
                            ),
                        ),
                    }
                }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let ready = ready.clone();
                async move {
                    match ready.readiness() {
                        Ok(()) => (axum::http::StatusCode::OK, "ready\n".to_owned()),
                        Err(why) => (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}\n"),
                        ),
                    }
                }
            }),
        );
    let task = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned());
        if let Err(e) = serve.await {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok((bound, task))
}
