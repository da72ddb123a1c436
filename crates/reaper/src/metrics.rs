//! Prometheus metrics of the reaper (counters per direction and outcome, cycle durations,
//! leadership) and the small HTTP endpoint serving them with `/healthz`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
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
        Self {
            registry,
            items,
            cycles,
            cycles_not_run,
            cycle_duration,
            leader,
            last_cycle,
        }
    }

    /// Counts one cycle's report.
    pub fn observe(&self, report: &CycleReport, trigger: CycleTrigger) {
        if !report.ran() {
            self.cycles_not_run.inc();
            return;
        }
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

/// Serves `GET /metrics` and `GET /healthz` on `addr` until `shutdown` is cancelled. Binds
/// before returning, so a taken port fails at once.
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
        .route("/healthz", get(|| async { "ok\n" }));
    let task = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned());
        if let Err(e) = serve.await {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok((bound, task))
}
